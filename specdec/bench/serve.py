"""`specdec bench --serve`: load test of the OpenAI-compatible server, speculative against plain.

Two servers over the same model run as subprocesses, one with the speculative config and one without.
At each concurrency level C, C client workers stream chat completions of Spec-Bench prompts (greedy) from
one server, then from the other, in two rounds of half the requests each (A B, then B A, so machine drift
does not favour a side); only one server is loaded at a time. Per level and side:

    throughput       completion tokens / wall time of the level
    TTFT             request sent -> first content chunk            (p50, p99)
    TPOT             (last chunk - first chunk) / (tokens - 1)      (p50, p99 over requests: inter-token latency)
    acceptance       completion tokens / target forwards, from the `usage` the server reports

and the speculative/plain ratio of throughput, which is plotted against concurrency (PNG) next to the JSON.
With `--llama-server PATH`, llama.cpp's own server runs as a third side on the same GGUF file (one slot per
client of the highest level, the same threads, the same requests and rounds), and each level also gives
specdec's throughput over llama-server's.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.bench.config import BenchConfig
from specdec.bench.machine import machine_info
from specdec.bench.prompts import load_questions, pick_round_robin, prompts_path
from specdec.bench.report import format_table, output_path
from specdec.config import SpecdecError
from specdec.drafting.registry import SpeculativeConfig
from specdec.llm import parse_device
from specdec.models.loader import default_speculative_config

if TYPE_CHECKING:
    import httpx

STARTUP_TIMEOUT_S = 600


# ------------------------------------------------------------------------------------------ servers
def free_port() -> tuple[int, str]:
    """A free loopback port and its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return port, f"http://127.0.0.1:{port}"


def llama_server_command(binary: str, gguf: Path, port: int, slots: int, threads: int,
                         flags: Sequence[str] = ()) -> list[str]:
    """`slots` parallel sequences of 4,096 tokens each, `threads` threads for decoding and prefill (a draft model's
    too: llama.cpp's draft threads default to these), then `flags`."""
    return [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
            "-c", str(4096 * slots), "-t", str(threads), "-tb", str(threads), "-a", "bench", *flags]


class ServerProcess:
    """`specdec serve` in a subprocess on a free loopback port; stopped on exit."""

    def __init__(self, cfg: BenchConfig, speculative_config: str, max_num_seqs: int, log: Path,
                 replicas: int = 0) -> None:
        self.port, self.url = free_port()
        cmd = [sys.executable, "-m", "specdec.cli", "serve", "--model", cfg.model, "--dtype", cfg.dtype,
               "--device", str(parse_device(cfg.device)), "--port", str(self.port),
               "--max-num-seqs", str(max_num_seqs), "--speculative-config", speculative_config,
               "--served-model-name", "bench"]
        if replicas:  # on Ray Serve, a cluster of its own
            cmd += ["--replicas", str(replicas)]
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=os.environ.copy())

    @classmethod
    def llama_server(cls, binary: str, gguf: Path, slots: int, threads: int, log: Path,
                     flags: Sequence[str] = ()) -> ServerProcess:
        """llama.cpp's `llama-server` on `gguf` (`llama_server_command`), its own defaults otherwise (continuous
        batching, its prompt cache); `flags` come last (a speculative mode's)."""
        server = object.__new__(cls)
        server.port, server.url = free_port()
        cmd = llama_server_command(binary, gguf, server.port, slots, threads, flags)
        server.log = log.open("w")
        try:
            server.proc = subprocess.Popen(cmd, stdout=server.log, stderr=subprocess.STDOUT)
        except OSError as e:
            server.log.close()
            raise SpecdecError(f"cannot start llama-server {binary!r}: {e}") from None
        return server

    def wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SpecdecError(f"the server exited with code {self.proc.returncode} while starting; "
                                   f"see its log at {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SpecdecError(f"the server did not become healthy within {STARTUP_TIMEOUT_S} s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


# ------------------------------------------------------------------------------------------ client
@dataclass
class RequestResult:
    prompt_index: int
    text: str = ""
    sent: float = 0.0
    first: float | None = None
    last: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    usage: dict = field(default_factory=dict)
    error: str | None = None


async def one_request(client: httpx.AsyncClient, url: str, index: int, prompt: str, max_tokens: int) -> RequestResult:
    """One streamed greedy chat completion. A connection the server closed while idle (llama-server drops kept-alive
    ones) fails before the request reaches it: such a request is sent again once, on a new connection."""

    r = await _stream_once(client, url, index, prompt, max_tokens)
    if r.error is not None and r.error.startswith("RemoteProtocolError") and r.first is None:
        r = await _stream_once(client, url, index, prompt, max_tokens)
    return r


async def _stream_once(client: httpx.AsyncClient, url: str, index: int, prompt: str, max_tokens: int
                       ) -> RequestResult:
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    r = RequestResult(index, sent=time.perf_counter())
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    r.usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    content = choice.get("delta", {}).get("content")
                    if content:
                        r.first = r.first or now
                        r.last = now
                        r.chunk_times.append(now)
                        r.text += content
    except Exception as e:  # noqa: BLE001  a failed request is reported, not fatal to the run
        r.error = f"{type(e).__name__}: {e}"
    return r


async def drive(url: str, prompts: list[str], concurrency: int, requests: range, max_tokens: int
                ) -> tuple[list[RequestResult], float]:
    """`concurrency` workers send the requests (request i asks prompt i mod len(prompts)); returns the
    results and the wall time."""
    import httpx

    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in requests:
        queue.put_nowait(i)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                results.append(await one_request(client, url, i % len(prompts), prompts[i % len(prompts)], max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return sorted(results, key=lambda r: (r.prompt_index, r.sent)), wall


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize_level(results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if r.error is None]
    tokens = sum(r.usage.get("completion_tokens", len(r.chunk_times)) for r in ok)  # a peer may omit usage
    steps = sum(r.usage["completion_tokens"] / r.usage["acceptance_length"] for r in ok
                if r.usage.get("acceptance_length"))
    ttft = [r.first - r.sent for r in ok if r.first is not None]
    tpot = [(r.last - r.first) / (r.usage["completion_tokens"] - 1) for r in ok
            if r.first is not None and r.usage.get("completion_tokens", 0) > 1]
    gaps = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    return {
        "requests": len(results), "errors": [r.error for r in results if r.error], "completion_tokens": tokens,
        "wall_s": wall, "throughput_tok_s": tokens / wall if wall > 0 else None,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5), "tpot_p99_s": percentile(tpot, 0.99),
        "chunk_gap_p50_s": percentile(gaps, 0.5), "chunk_gap_p99_s": percentile(gaps, 0.99),
        "acceptance_length": tokens / steps if steps else None,
    }


QUESTIONS = ["Summarize the text above in one sentence.", "What is the main topic of the text above?",
             "List three key facts from the text above.", "Who is mentioned first in the text above?",
             "Give the text above a short title.", "Is the tone of the text above positive or negative?"]


async def prefix_cache_ttft(url: str, system: str, questions: list[str] = QUESTIONS, repeats: int = 3) -> dict:
    """TTFT of a request whose long system prompt is new (a miss: a fresh tag starts it) against the same
    system prompt with another short question right after (a hit on every full block of the system prompt)."""
    import httpx

    cold, warm = [], []
    async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
        for rep in range(repeats):
            tagged = f"[session {time.time_ns()}-{rep}] {system}"
            for i, bucket in enumerate((cold, warm)):
                body = {"model": "bench", "max_tokens": 1, "temperature": 0, "stream": True,
                        "messages": [{"role": "system", "content": tagged},
                                     {"role": "user", "content": questions[(2 * rep + i) % len(questions)]}]}
                sent = time.perf_counter()
                async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
                    async for line in resp.aiter_lines():  # one token: its chunk comes with the finish reason
                        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["finish_reason"]:
                            bucket.append(time.perf_counter() - sent)
    miss, hit = percentile(cold, 0.5), percentile(warm, 0.5)
    return {"system_prompt_chars": len(system), "ttft_miss_s": miss, "ttft_hit_s": hit,
            "ratio": miss / hit if hit else None}


def gguf_of(model: str) -> Path:
    """The GGUF file llama-server is given: the model's own."""
    from specdec.models.loader import resolve

    src = resolve(model)
    if src.gguf_file is None:
        raise SpecdecError(f"--llama-server serves a GGUF file, and {model} is a Hugging Face directory")
    return src.gguf_file


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def offline_speedup(cfg: BenchConfig, prompts: list[str], spec: str) -> dict:
    """The same prompts decoded offline at batch 1 (LLM.chat, plain and speculative interleaved prompt by
    prompt): the speedup serving at concurrency 1 should keep."""
    from specdec.config import SamplingParams
    from specdec.llm import LLM

    plain = LLM(cfg.model, dtype=cfg.dtype, device=cfg.device, speculative_config="off",
                quantization=cfg.quantization)
    fast = plain.with_speculative_config(spec)
    params = SamplingParams(temperature=0, max_tokens=cfg.max_tokens)
    for llm in (plain, fast):  # first calls pay one-time costs (kernel loading)
        llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=4))
    seconds = {"plain": 0.0, "speculative": 0.0}
    tokens = 0
    for j, prompt in enumerate(prompts):
        for side, llm in (("plain", plain), ("speculative", fast))[:: 1 if j % 2 == 0 else -1]:
            start = time.perf_counter()
            out = llm.chat([{"role": "user", "content": prompt}], params)[0]
            seconds[side] += time.perf_counter() - start
        tokens += len(out.token_ids)
    return {"tokens": tokens, "plain_tok_s": tokens / seconds["plain"],
            "speculative_tok_s": tokens / seconds["speculative"],
            "speedup": seconds["plain"] / seconds["speculative"]}


def drive_sides(servers: dict[str, ServerProcess], level: dict, prompts: list[str], concurrency: int,
                num_requests: int, max_tokens: int) -> dict[str, dict[int, str]]:
    """One concurrency level on every server, in two rounds of half the requests each (order A B C, then
    C B A, so drift over the run does not favour a side); each side's summary goes into `level`. Returns
    each side's texts by prompt index."""
    sides = list(servers)
    results: dict[str, list[RequestResult]] = {side: [] for side in sides}
    walls = dict.fromkeys(sides, 0.0)
    halves = [range(0, num_requests // 2), range(num_requests // 2, num_requests)]
    for half, order in zip(halves, (sides, sides[::-1])):
        for side in order:
            got, wall = asyncio.run(drive(servers[side].url, prompts, concurrency, half, max_tokens))
            results[side] += got
            walls[side] += wall
    texts = {}
    for side in sides:
        level[side] = summarize_level(results[side], walls[side])
        texts[side] = {r.prompt_index: r.text for r in results[side] if r.error is None}
        print(f"concurrency {concurrency:>3} {side:<11} {level[side]['throughput_tok_s']:.1f} tok/s", flush=True)
    return texts


# ------------------------------------------------------------------------------------------ the runs
def spec_text(cfg: BenchConfig) -> str | None:
    """The speculative config as the server's flag takes it (a library caller may give it parsed)."""
    spec = cfg.speculative_config
    return spec if spec is None or isinstance(spec, str) else json.dumps(spec)


def run_serve_bench(cfg: BenchConfig) -> dict:
    spec = spec_text(cfg)
    if spec is None and (default := default_speculative_config(cfg.model)) is not None:
        spec = json.dumps(default)
    if spec in (None, "off"):
        raise SpecdecError("--serve compares speculative against plain serving: pass --speculative-config JSON")
    SpeculativeConfig.parse(spec)  # validates before any server starts
    levels = list(cfg.concurrency)
    rows = pick_round_robin(load_questions(prompts_path(cfg.prompts)), max(cfg.num_prompts, 1))
    prompts = [row["turns"][0] for row in rows]
    out = output_path(cfg.out)
    result: dict = {"machine": machine_info(parse_device(cfg.device)), "args": dataclasses.asdict(cfg), "levels": []}
    result["offline"] = offline_speedup(cfg, prompts, spec)  # before the servers start: nothing else runs
    print(f"offline, batch 1: {result['offline']['speedup']:.2f}x "
          f"({result['offline']['speculative_tok_s']:.1f} vs {result['offline']['plain_tok_s']:.1f} tok/s)", flush=True)
    servers = {"plain": ServerProcess(cfg, "off", max(levels), out.with_suffix(".plain.log")),
               "speculative": ServerProcess(cfg, spec, max(levels), out.with_suffix(".spec.log"))}
    if cfg.llama_server:
        servers["llama-server"] = ServerProcess.llama_server(cfg.llama_server, gguf_of(cfg.model), max(levels),
                                                             torch_threads(), out.with_suffix(".llama-server.log"))
    try:
        for server in servers.values():
            server.wait_ready()
        system = " ".join(row["turns"][0] for row in rows if row.get("category") == "summarization")[:6000]
        result["prefix_cache"] = asyncio.run(prefix_cache_ttft(servers["plain"].url, system or prompts[0] * 20))
        pc = result["prefix_cache"]
        print(f"prefix cache: TTFT {pc['ttft_miss_s'] * 1e3:.0f} ms on a miss, {pc['ttft_hit_s'] * 1e3:.0f} ms "
              f"on a hit ({pc['system_prompt_chars']}-character system prompt)", flush=True)
        for c in levels:
            n = max(cfg.requests_per_level or 0, 2 * c, len(prompts) if c == 1 else 0)
            level: dict = {"concurrency": c, "num_requests": n}
            texts = drive_sides(servers, level, prompts, c, n, cfg.max_tokens)
            same = [texts["plain"][i] == texts["speculative"][i] for i in texts["plain"] if i in texts["speculative"]]
            level["identical"] = [sum(same), len(same)]
            p, s = level["plain"]["throughput_tok_s"], level["speculative"]["throughput_tok_s"]
            level["throughput_ratio"] = s / p if p and s else None
            if (peer := level.get("llama-server", {}).get("throughput_tok_s")):
                level["vs_llama_server"] = {"plain": p / peer if p else None, "speculative": s / peer if s else None}
            result["levels"].append(level)
    finally:
        for server in servers.values():
            server.stop()
    out.write_text(json.dumps(result, indent=1, default=str))
    plot = plot_levels(result, out.with_suffix(".png"))
    first = result["levels"][0]
    if first["concurrency"] == 1 and first["throughput_ratio"]:
        result["offline"]["kept_at_concurrency_1"] = first["throughput_ratio"] / result["offline"]["speedup"]
    print(format_serve_report(result))
    off = result["offline"]
    if "kept_at_concurrency_1" in off:
        print(f"\noffline speedup {off['speedup']:.2f}x; served at concurrency 1: "
              f"{first['throughput_ratio']:.2f}x = {off['kept_at_concurrency_1']:.0%} of it")
    if "prefix_cache" in result:
        pc = result["prefix_cache"]
        print(f"prefix cache: TTFT {pc['ttft_miss_s'] * 1e3:.0f} ms on a miss, "
              f"{pc['ttft_hit_s'] * 1e3:.0f} ms on a hit "
              f"({pc['ratio']:.1f}x lower)")
    print(f"\nresults written to {out} and {plot}")
    return result


def run_replica_bench(cfg: BenchConfig) -> dict:
    """`specdec bench --serve --replicas 0,1,2`: the same speculative server as 0 (plain `specdec serve`, no
    Ray), 1 and 2 Ray Serve replicas, all up at once and driven one at a time at each concurrency level, in two
    rounds of half the requests (order A B C, then C B A). Throughput and latency per side; the ratio of each
    side to the first."""
    spec = spec_text(cfg)
    if spec is None:
        spec = json.dumps(default) if (default := default_speculative_config(cfg.model)) is not None else "off"
    SpeculativeConfig.parse(spec)
    counts = list(cfg.replicas or ())  # two or more: the config checks
    levels = list(cfg.concurrency)
    rows = pick_round_robin(load_questions(prompts_path(cfg.prompts)), max(cfg.num_prompts, 1))
    prompts = [row["turns"][0] for row in rows]
    out = output_path(cfg.out)
    sides = [f"replicas={n}" if n else "no Ray" for n in counts]
    result: dict = {"machine": machine_info(parse_device(cfg.device)), "args": dataclasses.asdict(cfg),
                    "speculative_config": spec, "sides": sides, "levels": []}
    servers = {side: ServerProcess(cfg, spec, max(levels), out.with_suffix(f".{n}.log"), replicas=n)
               for side, n in zip(sides, counts)}
    try:
        for server in servers.values():
            server.wait_ready()
        for c in levels:
            n = max(cfg.requests_per_level or 0, 2 * c, len(prompts) if c == 1 else 0)
            level: dict = {"concurrency": c, "num_requests": n}
            texts = drive_sides(servers, level, prompts, c, n, cfg.max_tokens)
            base = level[sides[0]]["throughput_tok_s"]
            for side in sides[1:]:
                same = [texts[sides[0]][i] == t for i, t in texts[side].items() if i in texts[sides[0]]]
                level[side]["identical"] = [sum(same), len(same)]
                got = level[side]["throughput_tok_s"]
                level[side]["ratio"] = got / base if got and base else None
            result["levels"].append(level)
    finally:
        for server in servers.values():
            server.stop()
    out.write_text(json.dumps(result, indent=1, default=str))
    print(format_replica_report(result))
    print(f"\nresults written to {out}")
    return result


def format_replica_report(result: dict) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.0f}"

    rows = []
    first = result["sides"][0]
    for lv in result["levels"]:
        for side in result["sides"]:
            s = lv[side]
            rows.append([str(lv["concurrency"]), side, f"{s['throughput_tok_s']:.1f}",
                         f"{s['ratio']:.2f}x" if s.get("ratio") else "", ms(s["ttft_p50_s"]), ms(s["ttft_p99_s"]),
                         ms(s["tpot_p50_s"]), ms(s["tpot_p99_s"]),
                         "-" if s["acceptance_length"] is None else f"{s['acceptance_length']:.2f}",
                         f"{s['identical'][0]}/{s['identical'][1]}" if "identical" in s else "",
                         str(len(s["errors"]))])
    headers = ["conc", "server", "tok/s", f"vs {first}", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
               "TPOT p99 ms", "accept len", "identical", "errors"]
    return format_table(headers, rows, left=2)


def plot_levels(result: dict, path: Path) -> Path:
    """Speculative/plain throughput against concurrency (the shape of Meta's figure 9)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [lv["concurrency"] for lv in result["levels"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(levels, [lv["throughput_ratio"] or 0 for lv in result["levels"]], "o-")
    ax1.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax1.set(xscale="log", xlabel="concurrent requests", ylabel="speculative / plain throughput",
            title="Speedup vs concurrency")
    for side in ("plain", "speculative"):
        ax2.plot(levels, [lv[side]["throughput_tok_s"] or 0 for lv in result["levels"]], "o-", label=side)
    ax2.set(xscale="log", xlabel="concurrent requests", ylabel="tokens/s", title="Throughput")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xticks(levels, [str(c) for c in levels])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_serve_report(result: dict) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.0f}"

    def vs_peer(lv: dict, side: str) -> str:
        ratio = (lv.get("vs_llama_server") or {}).get(side)
        return f"{ratio:.2f}x" if ratio else ""

    rows = []
    for lv in result["levels"]:
        for side in [name for name in ("plain", "speculative", "llama-server") if name in lv]:
            s = lv[side]
            rows.append([str(lv["concurrency"]), side, f"{s['throughput_tok_s']:.1f}", ms(s["ttft_p50_s"]),
                         ms(s["ttft_p99_s"]), ms(s["tpot_p50_s"]), ms(s["tpot_p99_s"]),
                         "-" if s["acceptance_length"] is None else f"{s['acceptance_length']:.2f}",
                         f"{lv['throughput_ratio']:.2f}x" if side == "speculative" and lv["throughput_ratio"] else "",
                         vs_peer(lv, side),
                         f"{lv['identical'][0]}/{lv['identical'][1]}" if side == "speculative" else "",
                         str(len(s["errors"]))])
    headers = ["conc", "server", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
               "accept len", "spec/plain", "vs llama-server", "identical", "errors"]
    return format_table(headers, rows, left=2)
