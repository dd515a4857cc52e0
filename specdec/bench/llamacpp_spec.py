"""llama.cpp's own speculative decoding as peers of `specdec bench --compare-llamacpp --llama-server PATH`.

specdec's default speculation is judged against the fastest of llama.cpp's, on the same GGUF file and token ids,
not only against llama.cpp's plain decoding. Each mode is one `llama-server` process (`ServerProcess`), with one
slot and specdec's threads, started with its `--spec-type` (llama.cpp's own defaults for everything else):

    none          no speculation: the same harness's plain decoding
    ngram-mod     n-gram drafts from a hash pool of the prompts and outputs seen (kept across requests)
    ngram-simple  n-gram drafts from the current context
    ngram-map-k   n-gram drafts from a map of n-gram keys
    draft-simple  a draft model (--llamacpp-draft GGUF, same vocabulary)
    draft-eagle3  the EAGLE-3 head shipped for the model, converted by `specdec convert-head --to gguf`
    draft-mtp     the GGUF's own MTP (`nextn`) layers, when it has them

A request is a prompt's token ids to /completion, greedy (temperature 0, top_k 1), n_predict = --max-tokens, no
prompt cache. Its `timings` give what specdec measures of itself: predicted_n tokens, the first from the
prefill, in predicted_ms (first token -> last), so decode tokens/s = (predicted_n - 1) / predicted_ms; draft_n
tokens drafted of which draft_n_accepted accepted. A mode llama-server refuses is reported with its log's
error lines, not run.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specdec.bench.engines import measurement
from specdec.bench.prompts import BenchPrompt
from specdec.bench.report import ratio
from specdec.bench.serve import ServerProcess
from specdec.config import SpecdecError, cache_root

ENGINE = "llama-server"
NGRAM_MODES = ("ngram-mod", "ngram-simple", "ngram-map-k")
TARGET_RATIO = 1.5  # the figure to report: specdec's default speculation over llama.cpp's best
_LOG_LINE = re.compile(r"^\d+(?:\.\d+)+ ([A-Z]) (.*)$")  # llama.cpp's log: time stamp, level, text
PROBE = BenchPrompt(question_id="probe", category="probe", token_ids=list(range(16, 48)) * 2)  # repeats: ngrams draft


@dataclass
class PeerMode:
    """One llama-server configuration: its name (the --spec-type, or none) and the flags that select it."""

    name: str
    flags: list[str] = field(default_factory=list)


@dataclass
class PeerConfig:
    """What the peers run on: the binary, the target GGUF, specdec's threads, and the optional drafts."""

    binary: str
    gguf: Path
    threads: int
    max_tokens: int
    out: Path  # the results' JSON: each mode's server log goes beside it
    draft: Path | None = None  # a draft model GGUF (draft-simple)
    eagle3_head: Path | None = None  # the shipped EAGLE-3 head's directory, converted for draft-eagle3


def has_mtp_layers(gguf: Path) -> bool:
    """Whether the GGUF carries MTP layers: `{arch}.nextn_predict_layers` > 0, as specdec's own reader asks."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    arch = reader.get_field("general.architecture")
    if arch is None:
        return False
    layers = reader.get_field(f"{arch.contents()}.nextn_predict_layers")
    return layers is not None and int(layers.contents()) > 0


def peer_modes(gguf: Path, draft: Path | None = None, eagle3: Path | None = None) -> list[PeerMode]:
    """Every mode that applies to this file: plain, the n-gram modes, and each draft that exists."""
    modes = [PeerMode("none"), *(PeerMode(m, ["--spec-type", m]) for m in NGRAM_MODES)]
    if draft is not None:
        modes.append(PeerMode("draft-simple", ["--spec-type", "draft-simple", "--spec-draft-model", str(draft)]))
    if eagle3 is not None:
        modes.append(PeerMode("draft-eagle3", ["--spec-type", "draft-eagle3", "--spec-draft-model", str(eagle3)]))
    if has_mtp_layers(gguf):
        modes.append(PeerMode("draft-mtp", ["--spec-type", "draft-mtp"]))
    return modes


def has_tokenizer(gguf: Path) -> bool:
    from gguf import GGUFReader

    try:
        return "tokenizer.ggml.model" in GGUFReader(gguf).fields
    except (OSError, ValueError):
        return False


def convert_eagle3(head: Path, target: Path, out_dir: Path) -> Path:
    """The head in llama.cpp's EAGLE-3 GGUF with the target's tokenizer, by specdec's converter (`convert-head --to
    gguf --target`); converted again only when a file of the head, or the target, is newer than the conversion."""
    from specdec.models.heads.formats import read_head, write_head

    out = out_dir / f"{head.name}.gguf"
    newest = max([p.stat().st_mtime for p in head.iterdir()] + [target.stat().st_mtime])
    if not out.is_file() or out.stat().st_mtime < newest or not has_tokenizer(out):  # (older conversions had none)
        write_head(read_head(head, "eagle3"), "gguf", out, target)
    return out


def request_body(prompt: BenchPrompt, max_tokens: int) -> dict:
    """Greedy, the prompt's own token ids (no BOS added, no template), nothing reused from the last request."""
    return {"prompt": list(prompt.token_ids), "n_predict": max_tokens, "temperature": 0, "top_k": 1,
            "cache_prompt": False, "return_tokens": True, "stream": False}


def parse_completion(body: dict, e2e_s: float) -> dict:
    """A /completion response as specdec's measurement record, with the drafts counted."""
    t = body["timings"]
    tokens = list(body["tokens"])
    if len(tokens) != t["predicted_n"]:
        raise SpecdecError(f"llama-server returned {len(tokens)} token ids for predicted_n={t['predicted_n']}")
    return {**measurement(tokens, t["prompt_ms"] / 1e3, t["predicted_ms"] / 1e3, e2e_s),
            "draft_n": t.get("draft_n", 0), "draft_n_accepted": t.get("draft_n_accepted", 0)}


def startup_error(log: str, limit: int = 600) -> str:
    """What llama-server said when it would not start: its lines of level E (`0.00.212.939 E text`), else the
    lines that read like errors; in order, once each, without the time stamps."""
    keys = ("error", "failed", "exception", "abort", "invalid", "not found")
    errors, suspects = [], []
    for raw in log.splitlines():
        line = " ".join(raw.split())
        if stamped := _LOG_LINE.match(line):
            errors += [stamped[2]] if stamped[1] == "E" else []
        elif any(k in line.lower() for k in keys):
            suspects.append(line)
    text = " | ".join(dict.fromkeys(errors or suspects))
    return (text or log.strip()[-limit:] or "exited without a message")[:limit]


class LlamaServerPeers:
    """One llama-server per mode, all started at once (idle between their requests) so that every prompt can go
    to every mode in turn; a mode whose server will not start is kept in `refused` with its error."""

    def __init__(self, cfg: PeerConfig, modes: list[PeerMode], refused: dict[str, str] | None = None) -> None:
        self.cfg, self.modes = cfg, modes
        self.refused: dict[str, str] = dict(refused or {})
        self.servers: dict[str, ServerProcess] = {}
        self.served = False

    def start(self) -> None:
        for mode in self.modes:
            if mode.name not in self.refused:
                log = self.cfg.out.with_suffix(f".llama-server.{mode.name}.log")
                self.servers[mode.name] = ServerProcess.llama_server(self.cfg.binary, self.cfg.gguf, 1,
                                                                     self.cfg.threads, log, mode.flags)
        for name, server in list(self.servers.items()):
            try:
                server.wait_ready()
                self.time(name, PROBE)  # a mode that loads but fails its first drafts is refused here too
            except SpecdecError:
                server.stop()
                self.refused[name] = startup_error(Path(server.log.name).read_text(errors="replace"))
                del self.servers[name]
        self.served = False

    def forget(self) -> None:
        """Restart every server that has answered since it started: ngram-mod keeps its pool across requests, and
        no drafter may draft a timed prompt from its own warm-up answer."""
        if self.served:
            self.stop()
            self.start()

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers = {}

    def time(self, mode: str, prompt: BenchPrompt) -> dict:
        import httpx

        self.served = True
        server = self.servers[mode]
        start = time.perf_counter()
        try:
            resp = httpx.post(server.url + "/completion", json=request_body(prompt, self.cfg.max_tokens), timeout=None)
        except httpx.HTTPError as e:
            server.log.flush()
            raise SpecdecError(f"llama-server ({mode}) failed a request ({type(e).__name__}): "
                               f"{startup_error(Path(server.log.name).read_text(errors='replace'))}") from None
        e2e = time.perf_counter() - start
        if resp.status_code != 200:
            raise SpecdecError(f"llama-server ({mode}) answered HTTP {resp.status_code}: {resp.text[:200]}")
        return parse_completion(resp.json(), e2e)

    def timers(self) -> dict[tuple[str, str], Callable[[BenchPrompt], dict]]:
        """One timer per running mode, keyed as the bench keys its runs: (engine, method)."""
        return {(ENGINE, name): (lambda p, name=name: self.time(name, p)) for name in self.servers}

    def commands(self) -> dict[str, list[str]]:
        return {name: server.proc.args for name, server in self.servers.items()}


def start_peers(cfg: PeerConfig) -> LlamaServerPeers:
    """Every applicable mode's server, running; the EAGLE-3 head converted first (a conversion that fails
    refuses that mode, with the converter's error)."""
    refused: dict[str, str] = {}
    eagle3 = None
    if cfg.eagle3_head is not None:
        try:
            eagle3 = convert_eagle3(cfg.eagle3_head, cfg.gguf, cache_root() / "llamacpp")
        except SpecdecError as e:
            refused["draft-eagle3"] = f"specdec convert-head --to gguf failed: {e}"
    peers = LlamaServerPeers(cfg, peer_modes(cfg.gguf, cfg.draft, eagle3), refused)
    peers.start()
    return peers


def summarize_peers(runs: list[dict], refused: dict[str, str], commands: dict[str, list[str]]) -> dict:
    """Per mode: decode tokens/s, drafts accepted, greedy ids equal to llama-server's plain decoding's (the same
    build: speculation must not change them) and to llama-cpp-python's, and specdec's speculative decode tokens/s
    over it; the best speculative mode and specdec's ratio over it."""
    def key(run: dict) -> tuple[str, str]:
        return run["config"]["engine"], run["config"]["method"]

    def same(recs: list[dict], reference: dict | None) -> int | None:
        return sum(a["token_ids"] == b["token_ids"] for a, b in zip(recs, reference["per_prompt"])) \
            if reference else None

    ours = next((r for r in runs if r["config"]["engine"] == "specdec" and r["config"]["method"] != "plain"), None)
    plain = next((r for r in runs if key(r) == ("llama.cpp", "plain")), None)
    server_plain = next((r for r in runs if key(r) == (ENGINE, "none")), None)
    ours_tps = ours["summary"]["decode_tokens_per_s"] if ours else None
    modes = []
    for run in (r for r in runs if r["config"]["engine"] == ENGINE):
        recs, name = run["per_prompt"], run["config"]["method"]
        drafted = sum(r["draft_n"] for r in recs)
        accepted = sum(r["draft_n_accepted"] for r in recs)
        tps = run["summary"]["decode_tokens_per_s"]
        modes.append({"mode": name, "command": commands.get(name), "decode_tokens_per_s": tps,
                      "e2e_tokens_per_s": run["summary"]["e2e_tokens_per_s"], "drafted": drafted,
                      "accepted": accepted, "acceptance_rate": accepted / drafted if drafted else None,
                      "identical_to_server_plain": same(recs, server_plain),  # lossless: same engine, same build
                      "identical_to_llamacpp_plain": same(recs, plain), "num_prompts": len(recs),
                      "specdec_over_mode": ratio(ours_tps, tps)})
    speculative = [m for m in modes if m["mode"] != "none" and m["decode_tokens_per_s"]]
    best = max(speculative, key=lambda m: m["decode_tokens_per_s"], default=None)
    over_best = ratio(ours_tps, best["decode_tokens_per_s"]) if best else None
    return {"dtype": runs[0]["config"]["dtype"], "specdec_method": ours["config"]["method"] if ours else None,
            "specdec_decode_tokens_per_s": ours_tps,
            "llamacpp_plain_decode_tokens_per_s": plain["summary"]["decode_tokens_per_s"] if plain else None,
            "modes": modes, "refused": refused, "best_mode": best["mode"] if best else None,
            "best_decode_tokens_per_s": best["decode_tokens_per_s"] if best else None,
            "specdec_over_best": over_best, "target_ratio": TARGET_RATIO,
            "meets_target": over_best >= TARGET_RATIO if over_best else None}
