"""A head that learns from the deployment's traffic, the serving side: `--record-traffic` writes exactly what
the server served (prompt and output ids), in private files, within a size cap and a retention, never a request
that opted out, rotates its files and is read back past a line cut by a crash; `POST /admin/draft` (behind the
admin key) swaps the EAGLE-3 head between engine steps, refuses a head of another method or shape by name while
the old one keeps drafting, and greedy output stays plain decoding's throughout."""
from __future__ import annotations

import dataclasses
import logging
import os
import stat
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from conftest import every_step, save_tiny_model
from test_server import serving

from specdec import LLM, SamplingParams, SpecdecError
from specdec.cli import main
from specdec.models.heads.eagle import EagleHead
from specdec.models.heads.eagle3 import Eagle3Head
from specdec.models.heads.files import init_random
from specdec.models.loader import model_fingerprint
from specdec.serving.admin import Admin
from specdec.serving.traffic import Recording, TrafficRecorder, read_traffic

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Hello world, 1 2 3 1 2 3"}]
PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick", "Hello world", "1 2 3 4 5 6 1 2 3"]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    # 4 layers: a head reads three distinct ones; 128 wide MLP: q8_0 blocks fit
    return save_tiny_model(tmp_path_factory.mktemp("target"), "llama", num_hidden_layers=4, intermediate_size=128)


@pytest.fixture(scope="module")
def plain(target_dir) -> LLM:
    return LLM(str(target_dir), speculative_config="off")


def save_head(plain: LLM, path, seed: int, aux: tuple[int, ...] = (0, 1, 2), **config):
    """A random EAGLE-3 head for the target over a random draft vocabulary of 100 tokens."""
    target = plain.engine.model.config
    head = Eagle3Head(dataclasses.replace(target, num_hidden_layers=1, **config), 100, aux)
    init_random(list(head.parameters()), seed)
    chosen = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(seed))[:100].sort().values
    head.d2t.copy_(chosen - torch.arange(100))
    head.save(path)
    return path


@pytest.fixture(scope="module")
def heads(plain, tmp_path_factory):
    """Two heads that fit the serving one, and three that do not (another method, layers, K/V shape)."""
    made = {name: tmp_path_factory.mktemp(name) for name in ("a", "b", "eagle1", "layers", "kv")}
    save_head(plain, made["a"], 0)
    save_head(plain, made["b"], 1)
    EagleHead.create("eagle", plain.engine.model).save(made["eagle1"])
    save_head(plain, made["layers"], 2, aux=(0, 1, 3))
    save_head(plain, made["kv"], 3, num_key_value_heads=4)
    return made


def eagle3(head) -> dict:
    return every_step({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})


# -- recording ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("speculative", ["off", {"method": "ngram", "num_speculative_tokens": 4}])
def test_recording_writes_what_was_served(target_dir, plain, tmp_path, speculative):
    """Chat and completions, streamed or not, greedy and sampled: one record each, in order, with the prompt ids
    the engine was given and the target's output ids (those of plain decoding, and the response's text)."""
    llm = LLM(str(target_dir), speculative_config=every_step(speculative))
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    chat = body | {"messages": CHAT}
    completion = body | {"prompt": PROMPTS[0]}
    sampled = completion | {"temperature": 0.7, "seed": 5}
    with serving(llm, served_model_name=MODEL, record_traffic=tmp_path / "traffic") as s:
        texts = [s.post("/v1/chat/completions", chat).json()["choices"][0]["message"]["content"],
                 s.post("/v1/completions", completion).json()["choices"][0]["text"]]
        for path, request in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
            with httpx.stream("POST", s.url + path, json=request | {"stream": True}, timeout=30) as r:
                assert r.status_code == 200 and r.read().endswith(b"data: [DONE]\n\n")
        texts.append(s.post("/v1/completions", sampled).json()["choices"][0]["text"])
    records = read_traffic(tmp_path / "traffic")
    assert len(list((tmp_path / "traffic").glob("traffic-*.jsonl"))) == 1
    want_chat, want_completion = plain.chat(CHAT, greedy(12))[0], plain.generate(PROMPTS[0], greedy(12))[0]
    expected = [want_chat, want_completion, want_chat, want_completion]
    assert [(r["prompt_ids"], r["output_ids"]) for r in records[:4]] == \
        [(w.prompt_token_ids, w.token_ids) for w in expected]
    assert records[4]["prompt_ids"] == want_completion.prompt_token_ids and len(records[4]["output_ids"]) == 12
    decode = llm.tokenizer.decode
    assert [decode(r["output_ids"], skip_special_tokens=True) for r in records[:2] + records[4:]] == texts
    assert [r["temperature"] for r in records] == [0.0, 0.0, 0.0, 0.0, 0.7]
    assert {r["model"] for r in records} == {model_fingerprint(plain.engine.model)}
    assert {r["finish_reason"] for r in records} == {"length"}
    assert all(list(r) == ["model", "prompt_ids", "output_ids", "finish_reason", "temperature", "time"]
               for r in records)
    assert sorted(r["time"] for r in records) == [r["time"] for r in records]


def test_aborted_requests_are_not_recorded_and_recording_is_off_by_default(target_dir, tmp_path):
    with serving(LLM(str(target_dir)), served_model_name=MODEL, record_traffic=tmp_path) as s:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 480, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
            next(r.iter_lines())  # it runs; leaving now aborts it
        s.wait_idle()
        assert s.metrics()['specdec_requests_total{finish_reason="abort"}'] == 1
        assert s.post("/v1/completions", body | {"stream": False, "max_tokens": 3}).status_code == 200
    assert [len(r["output_ids"]) for r in read_traffic(tmp_path)] == [3]
    with serving(LLM(str(target_dir)), served_model_name=MODEL) as s:
        assert s.app.state.server.recorder is None and s.app.state.server.engine.recorder is None


def test_files_rotate_and_a_line_cut_by_a_crash_is_skipped(tmp_path):
    recorder = TrafficRecorder(tmp_path / "new" / "dir", "fp", max_records=3)
    for i in range(7):
        recorder.record([1, i], [i, 2], "stop", 0.5)
    recorder.close()
    files = sorted((tmp_path / "new" / "dir").glob("traffic-*.jsonl"))
    assert [len(f.read_text().splitlines()) for f in files] == [3, 3, 1]
    assert all(f.name.endswith(f"-{os.getpid()}.jsonl") for f in files)
    records = read_traffic(tmp_path / "new" / "dir")
    assert [r["prompt_ids"] for r in records] == [[1, i] for i in range(7)]
    assert read_traffic(tmp_path / "new" / "dir", model="other") == []
    whole = files[-1].read_text()
    files[-1].write_text(whole + whole[:25])  # the process died while writing a line
    assert read_traffic(tmp_path / "new" / "dir") == records
    files[0].write_text("{not json\n" + files[0].read_text())
    with pytest.raises(SpecdecError, match=r"traffic-.*\.jsonl:1 is not a JSON record"):
        read_traffic(tmp_path / "new" / "dir")
    (tmp_path / "file").write_text("")
    with pytest.raises(SpecdecError, match="cannot record traffic"):
        TrafficRecorder(tmp_path / "file" / "below", "fp")


def test_cli_passes_record_traffic(target_dir, tmp_path, monkeypatch):
    import specdec.serving.server

    calls = []
    monkeypatch.setattr(specdec.serving.server, "serve", lambda llm, **kw: calls.append(kw))
    assert main(["serve", str(target_dir), "--speculative-config", "off", "--record-traffic", str(tmp_path)]) == 0
    assert calls[-1]["record_traffic"] == Recording(str(tmp_path), max_mb=1024, max_days=None)
    assert main(["serve", str(target_dir), "--speculative-config", "off", "--record-traffic", str(tmp_path),
                 "--record-traffic-max-mb", "50", "--record-traffic-days", "7.5"]) == 0
    assert calls[-1]["record_traffic"] == Recording(str(tmp_path), max_mb=50, max_days=7.5)
    assert main(["serve", str(target_dir), "--record-traffic", str(tmp_path), "--replicas", "2"]) == 2
    for bad in (["--record-traffic-max-mb", "0"], ["--record-traffic-days", "-1"]):
        assert main(["serve", str(target_dir), "--record-traffic", str(tmp_path), *bad]) == 2
    assert len(calls) == 2


# -- what an operator can trust: private files, a size cap, a retention, an opt-out ------------------------------
def write(recorder: TrafficRecorder, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        recorder.record([1, i], [i, 2], "stop", 0.5)


def traffic_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("traffic-*.jsonl"))


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])
def test_files_are_0600_in_a_0700_folder_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        recorder = TrafficRecorder(tmp_path / "parent" / "traffic", "fp", max_records=2)
        write(recorder, 3)
        recorder.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "parent" / "traffic").stat().st_mode) == 0o700
    files = traffic_files(tmp_path / "parent" / "traffic")
    assert len(files) == 2 and {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}
    assert len(read_traffic(tmp_path / "parent" / "traffic")) == 3


def test_a_folder_open_to_others_is_used_with_a_warning(tmp_path, caplog):
    (tmp_path / "shared").mkdir()
    os.chmod(tmp_path / "shared", 0o755)
    with caplog.at_level(logging.WARNING, logger="specdec.server"):
        recorder = TrafficRecorder(tmp_path / "shared", "fp")
    assert "open to other users (mode 755)" in caplog.text and "chmod 700" in caplog.text
    write(recorder, 1)
    recorder.close()
    assert stat.S_IMODE(traffic_files(tmp_path / "shared")[0].stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o755  # the operator's folder, left as it is


def test_the_size_cap_deletes_the_oldest_files_first(tmp_path):
    """Files close at a tenth of the cap; each new one first deletes the oldest until it fits, so the folder stays
    under the cap and holds the newest records, in order; a new recorder on a folder over the cap trims it at
    start; other files are never touched."""
    folder = tmp_path / "traffic"
    recording = Recording(folder, max_mb=20_000 / 2**20)  # 20,000 bytes: files of 2,000 (about 18 records)
    recorder = TrafficRecorder(recording, "fp")
    (folder / "notes.txt").write_text("mine")
    write(recorder, 500)
    recorder.close()
    files = traffic_files(folder)
    sizes = [f.stat().st_size for f in files]
    assert 5 <= len(files) <= 10 and sum(sizes) <= 20_000 and max(sizes) <= 2_000
    kept = [r["prompt_ids"][1] for r in read_traffic(folder)]
    assert kept == list(range(500 - len(kept), 500)) and len(kept) < 200  # the newest, every one of them
    assert (folder / "notes.txt").read_text() == "mine"

    TrafficRecorder(Recording(folder, max_mb=5_000 / 2**20), "fp")  # a smaller cap: trimmed at start
    left = traffic_files(folder)
    assert left == files[len(files) - len(left):] and sum(f.stat().st_size for f in left) <= 5_000 - 500
    assert (folder / "notes.txt").read_text() == "mine"


def test_files_older_than_the_retention_are_deleted_at_start_and_at_rotation(tmp_path):
    folder = tmp_path / "traffic"
    recorder = TrafficRecorder(folder, "fp", max_records=1)
    write(recorder, 4)
    recorder.close()
    files = traffic_files(folder)
    now = time.time()
    for path, days_ago in zip(files, (10, 6, 1, 0)):
        os.utime(path, (now - days_ago * 86_400, now - days_ago * 86_400))
    recorder = TrafficRecorder(Recording(folder, max_days=5), "fp", max_records=1)
    assert traffic_files(folder) == files[2:]  # at start: the 10 and 6 days old ones
    write(recorder, 1, start=4)  # the first file of this recorder
    os.utime(files[2], (now - 8 * 86_400, now - 8 * 86_400))
    write(recorder, 1, start=5)  # a new file: the retention runs again
    recorder.close()
    assert [r["prompt_ids"][1] for r in read_traffic(folder)] == [3, 4, 5]


def test_a_request_sent_with_record_false_is_not_recorded(target_dir, tmp_path):
    """The opt-out on every generating endpoint: chat, completions, responses and messages, streamed or not."""
    body = {"model": MODEL, "temperature": 0, "record": False}
    requests = [("/v1/chat/completions", body | {"messages": CHAT, "max_tokens": 3}),
                ("/v1/completions", body | {"prompt": PROMPTS[0], "max_tokens": 3}),
                ("/v1/responses", body | {"input": "Hello", "max_output_tokens": 3}),
                ("/v1/messages", body | {"messages": CHAT, "max_tokens": 3})]
    with serving(LLM(str(target_dir)), served_model_name=MODEL, record_traffic=tmp_path / "traffic") as s:
        for path, request in requests:
            assert s.post(path, request).status_code == 200, path
            with httpx.stream("POST", s.url + path, json=request | {"stream": True}, timeout=30) as r:
                assert r.status_code == 200 and r.read()
        s.wait_idle()
        assert read_traffic(tmp_path / "traffic") == []
        for path, request in requests:
            assert s.post(path, request | {"record": True}).status_code == 200, path
    assert len(read_traffic(tmp_path / "traffic")) == 4


# -- hot reload of the draft head -------------------------------------------------------------------------------
def heads_root(heads: dict) -> Path:
    return Path(os.path.commonpath([str(h) for h in heads.values()]))


def test_post_admin_draft_swaps_the_head_between_steps(target_dir, plain, heads):
    """Behind the admin key: the head swaps while a request runs (its output stays plain decoding's), the new one
    drafts, and heads that do not fit are a 400 naming why while the one drafting stays."""
    reference = [o.text for o in plain.generate(PROMPTS, greedy(16))]
    long_reference = plain.generate(PROMPTS[0], greedy(256))[0].text
    llm = LLM(str(target_dir), speculative_config=eagle3(heads["a"]))
    auth, admin = {"Authorization": "Bearer k"}, {"Authorization": "Bearer adm"}

    def complete(s, prompt, max_tokens=16) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        resp = s.post("/v1/completions", body, headers=auth)
        assert resp.status_code == 200
        return resp.json()["choices"][0]["text"]

    def reload(s, path) -> httpx.Response:
        return s.post("/admin/draft", {"model": str(path)}, headers=admin)

    with serving(llm, served_model_name=MODEL, api_key="k", admin=Admin("adm", [heads_root(heads)])) as s:
        assert httpx.get(s.url + "/admin/draft").status_code == 401
        assert s.post("/admin/draft", {"model": str(heads["b"])}).status_code == 401
        assert s.post("/admin/draft", {"model": str(heads["b"])}, headers=auth).status_code == 403
        card = httpx.get(s.url + "/admin/draft", headers=admin).json()
        assert card == {"object": "draft_head", "method": "eagle3", "model": str(heads["a"])}
        old = llm.engine.speculator.drafter.head
        assert [complete(s, p) for p in PROMPTS] == reference

        in_flight: list[str] = []
        swapped_while_running = []
        swap = llm.reload_draft
        llm.reload_draft = lambda path: (swapped_while_running.append(llm.engine.has_unfinished()), swap(path))[1]
        thread = threading.Thread(target=lambda: in_flight.append(complete(s, PROMPTS[0], 256)))
        thread.start()
        while not s.app.state.server.engine.stats["requests_running"] and thread.is_alive():
            time.sleep(0.001)
        resp = reload(s, heads["b"])  # while that request runs (it finishes with the new head)
        thread.join(60)
        assert resp.status_code == 200 and resp.json()["model"] == str(heads["b"])
        assert in_flight == [long_reference] and swapped_while_running == [True]
        new = llm.engine.speculator.drafter.head
        assert new is not old and llm.draft_head == str(heads["b"])
        assert httpx.get(s.url + "/admin/draft", headers=admin).json()["model"] == str(heads["b"])
        before = s.app.state.server.engine.stats["spec_num_draft_tokens"]
        assert [complete(s, p) for p in PROMPTS] == reference
        assert s.app.state.server.engine.stats["spec_num_draft_tokens"] > before  # the new head drafts

        for bad, words in ((heads["a"] / "nowhere", "not found"), (heads["eagle1"], "holds a head of method 'eagle'"),
                           (heads["layers"], "reads target layers [0, 1, 3]"), (heads["kv"], "4 K/V heads")):
            resp = reload(s, bad)
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert words in err["message"] and err["param"] == "model" and err["code"] == "invalid_draft_head"
            assert llm.engine.speculator.drafter.head is new
        assert s.post("/admin/draft", {"model": 3}, headers=admin).status_code == 400
        assert reload(s, "/etc").status_code == 403  # a folder not allowed
        assert httpx.get(s.url + "/admin/draft", headers=admin).json()["model"] == str(heads["b"])
        assert [complete(s, p) for p in PROMPTS] == reference


def test_reload_draft_prepares_the_head_as_a_fresh_load(target_dir, heads):
    """On a target computing on q8_0 blocks the reloaded head is quantized to q8_0 like the first ("auto") and
    drafts through its own native step; a hybrid's head source swaps too; a server without a head says why."""
    from specdec.models.formats.quant import QuantWeight

    quantized = LLM(str(target_dir), quantization="q8_0", speculative_config="off")
    reference = [o.token_ids for o in quantized.generate(PROMPTS, greedy(16))]
    llm = quantized.with_speculative_config(eagle3(heads["a"]))
    drafter = llm.engine.speculator.drafter
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(16))] == reference
    old = drafter.head
    llm.reload_draft(str(heads["b"]))
    new = drafter.head

    def formats(head) -> set[str]:
        return {f for w in (head.fc.weight, head.lm_head) if isinstance(w, QuantWeight) for f in w.formats}

    assert formats(new) == formats(old) == {"q8_0"}
    outs = llm.generate(PROMPTS, greedy(16))
    assert [o.token_ids for o in outs] == reference and sum(o.metrics["num_draft_tokens"] for o in outs) > 0
    assert new._step is not None and bool(new._step) == bool(old._step)  # its own native step, built alike

    hybrid = quantized.with_speculative_config(every_step({
        "method": "hybrid", "num_speculative_tokens": 4,
        "sources": [{"method": "eagle3", "model": str(heads["a"]), "num_speculative_tokens": 3},
                    {"method": "ngram", "num_speculative_tokens": 3}]}))
    hybrid.reload_draft(str(heads["b"]))
    assert hybrid.draft_head == str(heads["b"])
    assert [o.token_ids for o in hybrid.generate(PROMPTS, greedy(16))] == reference

    with pytest.raises(SpecdecError, match="does not speculate"):
        quantized.reload_draft(str(heads["b"]))
    ngram = quantized.with_speculative_config({"method": "ngram"})
    with pytest.raises(SpecdecError, match="'ngram' drafts without a head"):
        ngram.reload_draft(str(heads["b"]))
    assert ngram.draft_head is None and quantized.draft_head is None


def test_a_server_without_a_head_refuses_a_reload(target_dir, heads):
    admin = {"Authorization": "Bearer adm"}
    with serving(LLM(str(target_dir), speculative_config="off"), served_model_name=MODEL,
                 admin=Admin("adm", [heads_root(heads)])) as s:
        assert httpx.get(s.url + "/admin/draft", headers=admin).json() == \
            {"object": "draft_head", "method": None, "model": None}
        resp = s.post("/admin/draft", {"model": str(heads["b"])}, headers=admin)
        assert resp.status_code == 400 and "does not speculate" in resp.json()["error"]["message"]
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
        assert s.post("/v1/completions", body).status_code == 200
