"""`specdec bench --soak`: many mixed requests against a live server, every response checked.

The server runs in this process as `specdec serve` runs it (engine loop on the main thread, HTTP on another,
an API key, operator limits) so that faults can be injected through the engine's test-only hook
(`engine.measuring.inject_fault`): a request whose prompt ends with the marker token makes any step it is in raise.
Clients (`--soak-concurrency` of them, on a thread of their own) draw request kinds from a fixed, seeded mix:

    greedy     chat, streamed or not: 200, and the text equals every other greedy answer to the same prompt and,
               checked after the run, offline `LLM.chat` of the same prompt
    seeded     sampled with a seed: 200, and the same (prompt, seed) gives the same text every time
    choices    n = 3 sampled with a seed, streamed or not: three choices, the same three for the same (prompt, seed)
    cancelled  a stream the client drops after its first chunks (nothing to check but the server's health)
    bad        one of a catalogue of malformed or hostile requests: its exact status and, for 400, the field
    no_auth    a wrong or missing API key: 401
    fault      a prompt carrying the marker token: 500 naming the injected fault, and only that request fails

At the end, once idle: KV blocks in use must equal the blocks only the prefix cache keeps (0 leaked), nothing
runs or waits, and /health is 200. One summary line, and JSON with every figure.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import secrets
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.bench.config import BenchConfig
from specdec.bench.machine import machine_info
from specdec.bench.prompts import load_questions, pick_round_robin, prompts_path
from specdec.bench.report import output_path
from specdec.bench.serve import percentile
from specdec.config import SamplingParams, SpecdecError
from specdec.llm import LLM, parse_device

if TYPE_CHECKING:
    import httpx

    from specdec.engine.sequence import Sequence

MIX = {"greedy": 0.35, "seeded": 0.15, "choices": 0.05, "cancelled": 0.10, "bad": 0.20, "no_auth": 0.05, "fault": 0.10}
FAULT = "injected fault"


def bad_requests(model: str) -> list[tuple[str, str | dict, int, str | None]]:
    """(path, body, status, field) of requests a server must refuse: body dicts are sent as JSON, strings raw."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return [
        ("/v1/chat/completions", chat | {"temperature": 7}, 400, "temperature"),
        ("/v1/chat/completions", chat | {"messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages"),
        ("/v1/chat/completions", json.dumps(chat | {"messages": [{"role": "user", "content": "\ud800"}]}), 400,
         "messages"),
        ("/v1/chat/completions", chat | {"stop": [str(i) for i in range(5000)]}, 400, "stop"),
        ("/v1/chat/completions", chat | {"max_tokens": 10**9}, 400, "max_tokens"),
        ("/v1/chat/completions", chat | {"n": 99}, 400, "n"),
        ("/v1/chat/completions", chat | {"tools": [{"type": "function", "function": {"name": "f"}}],
                                         "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
         "tool_choice"),
        ("/v1/chat/completions", chat | {"model": "not-this-one"}, 404, "model"),
        ("/v1/chat/completions", chat | {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", '{"model": "x", "messages": [', 400, None),
        ("/v1/chat/completions", "[1, 2, 3]", 400, None),
        ("/v1/completions", {"model": model, "prompt": "x" * (3 * 2**20)}, 413, None),
        ("/v1/completions", {"model": model, "prompt": [1, 10**9]}, 400, "prompt"),
        ("/v1/chat/completions", chat | {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         400, "response_format.json_schema.schema"),
        ("/v1/chat/completions", chat | {"guided_regex": "[unclosed"}, 400, "guided_regex"),
        ("/v1/chat/completions", chat | {"logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ]


@dataclass
class Outcome:
    kind: str
    status: int | None
    seconds: float
    problem: str | None = None  # what was wrong with the response, if anything
    key: tuple | None = None  # greedy and seeded: what must give the same text
    text: str | None = None


@dataclass
class Soak:
    url: str
    api_key: str
    model: str
    prompts: list[str]
    max_tokens: int
    marker: int
    outcomes: list[Outcome] = field(default_factory=list)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    async def one(self, client: httpx.AsyncClient, kind: str, rng: random.Random) -> Outcome:
        start = time.perf_counter()
        try:
            out = await getattr(self, kind)(client, rng)
        except Exception as e:  # noqa: BLE001  a transport failure is a finding, not the end of the soak
            out = Outcome(kind, None, 0.0, f"{type(e).__name__}: {e}")
        out.seconds = time.perf_counter() - start
        return out

    def chat(self, prompt: str, **kw) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": self.max_tokens} | kw

    async def complete(self, client: httpx.AsyncClient, body: dict, kind: str, key: tuple | None) -> Outcome:
        """Streamed or not (the body says); the text of a 200, or the problem."""
        if not body.get("stream"):
            r = await client.post(self.url + "/v1/chat/completions", json=body, headers=self.headers())
            if r.status_code != 200:
                return Outcome(kind, r.status_code, 0.0, f"HTTP {r.status_code}: {r.text[:200]}", key)
            return Outcome(kind, 200, 0.0, None, key, r.json()["choices"][0]["message"]["content"])
        text, error = "", None
        async with client.stream("POST", self.url + "/v1/chat/completions", json=body, headers=self.headers()) as r:
            if r.status_code != 200:
                return Outcome(kind, r.status_code, 0.0, f"HTTP {r.status_code}", key)
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = chunk["error"]["message"]
                    for choice in chunk.get("choices", []):
                        text += choice["delta"].get("content") or ""
        return Outcome(kind, 200, 0.0, error and f"stream error: {error}", key, text)

    async def greedy(self, client: httpx.AsyncClient, rng: random.Random) -> Outcome:
        i = rng.randrange(len(self.prompts))
        return await self.complete(client, self.chat(self.prompts[i], temperature=0, stream=rng.random() < 0.5),
                                   "greedy", ("greedy", i))

    async def seeded(self, client: httpx.AsyncClient, rng: random.Random) -> Outcome:
        i, seed = rng.randrange(len(self.prompts)), rng.randrange(4)
        return await self.complete(client, self.chat(self.prompts[i], temperature=0.8, seed=seed,
                                                     stream=rng.random() < 0.5), "seeded", ("seeded", i, seed))

    async def choices(self, client: httpx.AsyncClient, rng: random.Random) -> Outcome:
        i, seed, stream = rng.randrange(len(self.prompts)), rng.randrange(4), rng.random() < 0.5
        body = self.chat(self.prompts[i], temperature=0.8, seed=seed, n=3, stream=stream)
        key = ("choices", i, seed)
        if not stream:
            r = await client.post(self.url + "/v1/chat/completions", json=body, headers=self.headers())
            if r.status_code != 200:
                return Outcome("choices", r.status_code, 0.0, f"HTTP {r.status_code}: {r.text[:200]}", key)
            texts = [c["message"]["content"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
            return Outcome("choices", 200, 0.0, None if len(texts) == 3 else f"{len(texts)} choices", key,
                           json.dumps(texts))
        texts, error = ["", "", ""], None
        async with client.stream("POST", self.url + "/v1/chat/completions", json=body, headers=self.headers()) as r:
            if r.status_code != 200:
                return Outcome("choices", r.status_code, 0.0, f"HTTP {r.status_code}", key)
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    error = error or chunk.get("error", {}).get("message")
                    for choice in chunk.get("choices", []):
                        texts[choice["index"]] += choice["delta"].get("content") or ""
        return Outcome("choices", 200, 0.0, error and f"stream error: {error}", key, json.dumps(texts))

    async def cancelled(self, client: httpx.AsyncClient, rng: random.Random) -> Outcome:
        body = self.chat(self.prompts[rng.randrange(len(self.prompts))], temperature=0, stream=True)
        keep = rng.randrange(1, 4)
        async with client.stream("POST", self.url + "/v1/chat/completions", json=body, headers=self.headers()) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                keep -= line.startswith("data: ")
                if keep <= 0:
                    break  # leaving the block closes the connection mid-stream
        return Outcome("cancelled", status, 0.0, None if status == 200 else f"HTTP {status}")

    async def bad(self, client: httpx.AsyncClient, rng: random.Random) -> Outcome:
        path, body, status, param = rng.choice(bad_requests(self.model))
        kw = {"json": body} if isinstance(body, dict) else {
            "content": body.encode("utf-8", "surrogatepass"), "headers": {"content-type": "application/json"}}
        kw["headers"] = kw.get("headers", {}) | self.headers()
        r = await client.post(self.url + path, **kw)
        problem = None
        if r.status_code != status:
            problem = f"{path} {str(body)[:60]!r}: HTTP {r.status_code}, expected {status}: {r.text[:160]}"
        elif param is not None and r.json()["error"]["param"] != param:
            problem = f"{path}: the error names {r.json()['error']['param']!r}, not {param!r}"
        return Outcome("bad", r.status_code, 0.0, problem)

    async def no_auth(self, client: httpx.AsyncClient, rng: random.Random) -> Outcome:
        headers = rng.choice([{}, {"Authorization": "Bearer wrong"}, {"Authorization": self.api_key}])
        r = await client.post(self.url + "/v1/chat/completions", json=self.chat("Hi"), headers=headers)
        return Outcome("no_auth", r.status_code, 0.0, None if r.status_code == 401 else f"HTTP {r.status_code}")

    async def fault(self, client: httpx.AsyncClient, rng: random.Random) -> Outcome:
        prompt = [rng.randrange(3, min(1000, self.marker)) for _ in range(6)] + [self.marker]
        body = {"model": self.model, "prompt": prompt,
                "max_tokens": 8, "temperature": 0}
        r = await client.post(self.url + "/v1/completions", json=body, headers=self.headers())
        ok = r.status_code == 500 and FAULT in r.json()["error"]["message"]
        return Outcome("fault", r.status_code, 0.0, None if ok else f"HTTP {r.status_code}: {r.text[:160]}")

    async def run(self, num_requests: int, concurrency: int, seed: int) -> float:
        import httpx

        rng = random.Random(seed)
        kinds = rng.choices(list(MIX), weights=list(MIX.values()), k=num_requests)
        queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
        for job in enumerate(kinds):
            queue.put_nowait(job)
        limits = httpx.Limits(max_connections=concurrency + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
            async def worker() -> None:
                while not queue.empty():
                    i, kind = queue.get_nowait()
                    self.outcomes.append(await self.one(client, kind, random.Random(seed * 1_000_003 + i)))

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return time.perf_counter() - start


def check_repeats(outcomes: list[Outcome]) -> list[str]:
    """Greedy answers to one prompt, and seeded answers to one (prompt, seed), must all be equal."""
    texts: dict[tuple, set[str]] = defaultdict(set)
    for o in outcomes:
        if o.key is not None and o.problem is None and o.text is not None:
            texts[o.key].add(o.text)
    return [f"{key}: {len(t)} different texts" for key, t in texts.items() if len(t) > 1]


def run_soak(cfg: BenchConfig) -> dict:
    import httpx
    import uvicorn

    from specdec.serving.api import Limits
    from specdec.serving.server import create_app

    rows = pick_round_robin(load_questions(prompts_path(cfg.prompts)), max(cfg.num_prompts, 1))
    prompts = [row["turns"][0][:2000] for row in rows]
    llm = LLM(cfg.model, dtype=cfg.dtype, device=cfg.device, speculative_config=cfg.speculative_config,
              quantization=cfg.quantization, max_num_seqs=cfg.soak_concurrency, max_num_batched_tokens=512)
    marker = llm.vocab_size - 1

    def fault(seqs: list[Sequence]) -> None:
        if any(s.prompt_token_ids[-1] == marker for s in seqs):
            raise RuntimeError(FAULT)

    llm.measuring.inject_fault(fault)
    logging.getLogger("specdec.engine").setLevel(logging.CRITICAL)  # the injected faults are expected; each
    # response is checked instead of reading their tracebacks
    api_key = secrets.token_hex(8)
    app = create_app(llm, "soak", api_key, engine_thread=False,
                     limits=Limits(max_queue=4 * cfg.soak_concurrency, request_timeout_s=600))
    engine = app.state.server.engine
    http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    threading.Thread(target=http.run, daemon=True).start()
    while not http.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{http.servers[0].sockets[0].getsockname()[1]}"
    soak = Soak(url, api_key, "soak", prompts, cfg.max_tokens, marker)
    result: dict = {"machine": machine_info(parse_device(cfg.device)), "args": dataclasses.asdict(cfg)}

    def drive() -> None:
        try:
            result["wall_s"] = asyncio.run(soak.run(cfg.num_requests, cfg.soak_concurrency, cfg.soak_seed))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # idle: nothing runs, only the prefix cache keeps blocks
                s = engine.stats
                if s["requests_running"] == 0 and s["requests_waiting"] == 0 and \
                        s["kv_blocks_used"] == s["kv_blocks_cached"]:
                    break
                time.sleep(0.1)
            result["kv"] = {k: engine.stats[k] for k in ("kv_blocks_used", "kv_blocks_cached", "kv_blocks_total",
                                                           "requests_running", "requests_waiting")}
            result["health"] = httpx.get(url + "/health", headers=soak.headers()).status_code
        finally:
            engine.stop()

    driver = threading.Thread(target=drive)
    driver.start()
    engine.run()  # the engine loop on this (the main) thread, as `specdec serve` runs it
    driver.join()
    http.should_exit = True

    # After the run: greedy answers against offline decoding of the same prompts by the same engine.
    llm.measuring.inject_fault(None)
    offline_mismatch = []
    greedy_texts = {o.key[1]: o.text for o in soak.outcomes if o.kind == "greedy" and o.problem is None}
    for i, text in sorted(greedy_texts.items()):
        want = llm.chat([{"role": "user", "content": prompts[i]}],
                        SamplingParams(temperature=0, max_tokens=cfg.max_tokens))[0].text
        if want != text:
            offline_mismatch.append(f"prompt {i}: served {text[:60]!r}, offline {want[:60]!r}")
    return summarize(result, soak.outcomes, check_repeats(soak.outcomes), offline_mismatch, len(greedy_texts),
                     output_path("bench_results/soak.json" if cfg.out == "bench_results/bench.json" else cfg.out))


def summarize(result: dict, outcomes: list[Outcome], repeats: list[str], offline_mismatch: list[str],
              offline_checked: int, out: Path) -> dict:
    statuses = defaultdict(Counter)
    for o in outcomes:
        statuses[o.kind][str(o.status)] += 1
    problems = [f"{o.kind}: {o.problem}" for o in outcomes if o.problem]
    unexpected_5xx = [o for o in outcomes if o.status and o.status >= 500 and o.kind != "fault"]
    served = [o.seconds for o in outcomes if o.kind in ("greedy", "seeded") and o.status == 200]
    kv = result.get("kv", {})
    leaked = kv.get("kv_blocks_used", 0) - kv.get("kv_blocks_cached", 0)
    result |= {
        "requests": len(outcomes), "statuses": {k: dict(v) for k, v in sorted(statuses.items())},
        "problems": problems, "unexpected_5xx": len(unexpected_5xx), "repeat_mismatches": repeats,
        "offline_checked": offline_checked, "offline_mismatches": offline_mismatch, "leaked_blocks": leaked,
        "latency_p50_s": percentile(served, 0.5), "latency_p99_s": percentile(served, 0.99),
    }
    result["ok"] = not problems and not repeats and not offline_mismatch and leaked == 0 and \
        result.get("health") == 200 and kv.get("requests_running") == 0
    out.write_text(json.dumps(result, indent=1, default=str))
    codes = " ".join(f"{k}:{'/'.join(f'{s}x{n}' for s, n in v.items())}" for k, v in result["statuses"].items())
    p50, p99 = result["latency_p50_s"], result["latency_p99_s"]
    print(f"soak {'OK' if result['ok'] else 'FAILED'}: {len(outcomes)} requests in {result.get('wall_s', 0):.0f} s; "
          f"{codes}; problems {len(problems)}, unexpected 5xx {len(unexpected_5xx)}; greedy/seeded repeats "
          f"{'equal' if not repeats else f'{len(repeats)} differ'}; offline {offline_checked - len(offline_mismatch)}"
          f"/{offline_checked} equal; latency p50 {p50 or 0:.2f} s p99 {p99 or 0:.2f} s; KV used "
          f"{kv.get('kv_blocks_used')} = cached {kv.get('kv_blocks_cached')} of {kv.get('kv_blocks_total')}, "
          f"leaked {leaked}; health {result.get('health')}")
    for line in (problems + repeats + offline_mismatch)[:20]:
        print("  " + line)
    if not result["ok"]:
        raise SpecdecError(f"the soak found problems; see {out}")
    return result
