"""`specdec serve`: an OpenAI-compatible HTTP API (chat and text completions, SSE streaming, /metrics) over one
engine; its HTTP surface (shapes, errors, limits, routes) is specdec.serving.api.

The engine is not thread-safe, so one engine thread owns it: it tokenizes prompts, admits requests,
steps the engine while there is work (it sleeps on its inbox when idle) and hands every request its
events through an `asyncio.Queue` on the server's event loop. The asyncio side only validates,
formats and streams; it never touches the engine or the tokenizer.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specdec.serving.api import APIError, ChatBody, CompletionBody, Limits, api_app, internal_error
from specdec.config import SpecdecError
from specdec.engine.llm_engine import RequestOutput
from specdec.llm import LLM
from specdec.serving.protocol import ChoiceStream, OpenAIProtocol, Plan, usage

log = logging.getLogger("specdec.server")

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks whether its client is still there
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


# -- the engine thread ---------------------------------------------------------------------------------
@dataclass
class _Event:
    """What the engine thread tells a request about one of its choices (`index`): text so far (streaming only),
    then its output, or an error (for the whole request)."""

    index: int = 0
    text: str = ""
    output: RequestOutput | None = None
    error: APIError | None = None
    logprobs: list | None = None  # streaming with logprobs: those of the tokens generated since the last event
    prompt: str | None = None  # echo: the prompt's text (and logprobs), with the choice's first event
    prompt_logprobs: list | None = None


class EngineRequest:
    """One request as both sides see it: its choices' sequences (n of them, or one per prompt). Each `prepare`
    runs on the engine thread (tokenizers are not safe to share across threads) and returns a choice's prompt
    ids and final sampling params, or raises APIError; `shares[i]` is the earlier choice whose prompt blocks
    choice i shares."""

    def __init__(self, plan: Plan) -> None:
        self.loop = asyncio.get_running_loop()
        self.prepares, self.shares, self.prompt_field = plan.prepares, plan.shares, plan.prompt_field
        self.stream, self.echo = plan.stream, plan.echo
        self.events: asyncio.Queue[_Event] = asyncio.Queue()
        self.admitted: asyncio.Future[None] = self.loop.create_future()
        self.seqs: list = []  # the engine's Sequences, set on the engine thread
        self.arrival = time.perf_counter()
        self.first_token = False  # TTFT recorded
        self.last_token_time: list[float | None] = [None] * len(plan.prepares)
        self.logprobs_posted = [0] * len(plan.prepares)  # streaming: each sequence's logprobs already posted
        self.posted = [False] * len(plan.prepares)  # a choice's first event went out (echo rides on it)

    # Called from the engine thread.
    def post(self, event: _Event) -> None:
        self._call(self.events.put_nowait, event)

    def resolve(self, error: APIError | None = None) -> None:
        self._call(self._resolve, error)

    def _resolve(self, error: APIError | None) -> None:
        if not self.admitted.done():  # the handler may have been cancelled meanwhile
            self.admitted.set_exception(error) if error else self.admitted.set_result(None)

    def _call(self, fn: Callable, *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is closed: the server is gone
            self.loop.call_soon_threadsafe(fn, *args)


class AsyncEngine:
    """Runs an LLMEngine on one thread (`run`); requests and aborts arrive through a thread-safe inbox."""

    def __init__(self, llm: LLM, metrics: "ServerMetrics", limits: Limits | None = None) -> None:
        self.llm, self.engine, self.metrics = llm, llm.engine, metrics
        self.limits = limits or Limits()
        self.stats: dict = self.engine.stats()  # the latest snapshot, replaced whole after every step
        self._submitted: set[EngineRequest] = set()  # awaiting admission (touched on the event loop's thread only)
        self._mean_e2e_s = 10.0  # running mean of finished requests' wall time, for Retry-After
        self._inbox: queue.Queue[tuple[str, EngineRequest | None]] = queue.Queue()
        self._active: dict[int, tuple[EngineRequest, int]] = {}  # seq_id -> (request, choice); engine thread only
        self._running, self._stopped = threading.Event(), threading.Event()
        self._drain_until: float | None = None  # set by drain(): no new requests; in-flight ones finish by then
        self._beat = time.monotonic()  # when the step under way started
        self._busy = False  # a step is under way

    @property
    def alive(self) -> bool:
        return self._running.is_set()

    def start(self) -> None:
        """Run the engine loop on a new thread (how tests and embedding apps use it; `serve` runs the loop
        on the main thread instead, see there)."""
        if not self.alive:
            self._running.set()
            threading.Thread(target=self.run, name="specdec-engine", daemon=True).start()

    @property
    def stuck_for(self) -> float:
        """Seconds the step under way has run (0 between steps)."""
        return time.monotonic() - self._beat if self._busy else 0.0

    @property
    def in_system(self) -> int:
        """Requests admitted and not finished, plus those on their way in. An admitted request leaves
        `_submitted` only when its handler resumes, so it counts there only until the engine gave it a seq."""
        return len(self._active) + sum(len(r.prepares) for r in list(self._submitted) if not r.seqs)

    @property
    def ready(self) -> bool:
        """What /health says: the loop runs, is not stuck in one step, and is not shutting down."""
        return self.alive and not self.draining and self.stuck_for < self.limits.stuck_after_s

    @property
    def draining(self) -> bool:
        return self._drain_until is not None

    def drain(self, timeout: float) -> None:
        """Graceful shutdown, from any thread: refuse new requests (503), let those in flight finish for up
        to `timeout` seconds, then fail the rest (503) and end the loop."""
        self._drain_until = time.monotonic() + timeout
        self._inbox.put(("wake", None))

    def stop(self, timeout: float = 10.0) -> None:
        if self.alive:
            self._inbox.put(("stop", None))
            self._stopped.wait(timeout)

    async def submit(self, plan: Plan) -> EngineRequest:
        """Queue a request and wait until the engine admitted it (raises APIError when it refused)."""
        if not self.alive:
            raise APIError(503, "the engine is not running", type="service_unavailable", code="engine_dead")
        if self.draining:
            raise APIError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")
        self.check_room()
        req = EngineRequest(plan)
        self._inbox.put(("add", req))
        self._submitted.add(req)
        try:
            await req.admitted
        except asyncio.CancelledError:
            self.abort(req)
            raise
        finally:
            self._submitted.discard(req)
        return req

    def check_room(self) -> None:
        """429 with Retry-After when max_queue requests already wait beyond the max_num_seqs that run."""
        if self.limits.max_queue is None:
            return
        capacity = self.engine.cfg.max_num_seqs
        queued = self.in_system - capacity
        if queued >= self.limits.max_queue:
            wait = math.ceil(self._mean_e2e_s * (queued + 1) / capacity)
            raise APIError(429, f"the server is full ({queued} requests wait beyond the {capacity} that run); "
                           "retry later", type="rate_limit_error", code="server_full",
                           headers={"Retry-After": str(min(max(wait, 1), 600))})

    def abort(self, req: EngineRequest) -> None:
        """Thread-safe and idempotent: a finished or unknown request is left alone."""
        self._inbox.put(("abort", req))

    # Everything below runs on the engine thread.
    def run(self) -> None:
        """The engine loop, on the calling thread, until `stop()`."""
        self._stopped.clear()
        self._running.set()
        try:
            self._loop()
        finally:
            self._running.clear()
            self._stopped.set()

    def _loop(self) -> None:
        while True:
            try:
                busy = self.engine.has_unfinished()
                if self.draining and (not busy or time.monotonic() > self._drain_until):
                    return self._shutdown([])
                commands = [] if busy else [self._inbox.get()]  # idle: sleep here
                with contextlib.suppress(queue.Empty):
                    while True:
                        commands.append(self._inbox.get_nowait())
                for kind, req in commands:
                    if kind == "stop":
                        return self._shutdown(commands)
                    if kind == "add":
                        self._admit(req)
                    elif kind == "abort":
                        self._abort(req)
                if self.engine.has_unfinished():
                    self._beat, self._busy = time.monotonic(), True
                    try:
                        self._step()
                    finally:
                        self._busy = False
                if self.limits.request_timeout_s is not None:
                    self._expire()
                self.stats = self.engine.stats()
            except Exception:  # a bug in this loop's own bookkeeping: fail what is in flight, keep serving
                log.exception("engine loop error")
                self._fail_all(internal_error("internal error in the engine loop"))

    def _shutdown(self, commands: list[tuple[str, EngineRequest | None]]) -> None:
        """Fail what runs and what is queued (503), the inbox's requests included."""
        error = APIError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")
        self._fail_all(error)
        with contextlib.suppress(queue.Empty):
            while True:
                commands.append(self._inbox.get_nowait())
        for _, pending in commands:  # requests not admitted yet (a no-op for admitted ones)
            if pending is not None:
                pending.resolve(error)

    def _admit(self, req: EngineRequest) -> None:
        try:
            for prepare, share in zip(req.prepares, req.shares):
                prompt_ids, params = prepare()
                source = req.seqs[share] if share is not None else None
                req.seqs.append(self.engine.add_request(prompt_ids, params, share_prompt_with=source))
                self.metrics.prompt_tokens.inc(len(prompt_ids) if source is None else 0)
        except Exception as e:  # noqa: BLE001  nothing of the request runs: its admitted choices go too
            for seq in req.seqs:
                self.engine.abort(seq)
            req.seqs = []
            if isinstance(e, APIError):
                return req.resolve(e)
            if isinstance(e, SpecdecError):  # empty prompt, prompt too long, token ids out of range, no template
                return req.resolve(APIError(400, str(e), param=req.prompt_field))
            log.exception("could not admit a request")
            return req.resolve(internal_error(f"could not admit the request: {type(e).__name__}: {e}"))
        for index, seq in enumerate(req.seqs):
            self._active[seq.seq_id] = (req, index)
        req.resolve()

    def _abort(self, req: EngineRequest) -> None:
        for seq in req.seqs:
            if self._active.get(seq.seq_id, (None,))[0] is req:
                del self._active[seq.seq_id]
                self.engine.abort(seq)  # frees its KV blocks
                self.metrics.requests.labels("abort").inc()

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as e:
            # The engine isolates a step that raised (only the request at fault fails); what escapes is the
            # engine's own failure (a tensor-parallel rank gone) or a bookkeeping bug: every request in flight
            # is failed and aborted (its blocks freed); the next requests start clean.
            log.exception("engine step failed")
            self._fail_all(internal_error(f"the engine failed while generating: {type(e).__name__}: {e}"))
            return
        now = time.perf_counter()
        for seq, new_ids in events:
            req, index = self._active.get(seq.seq_id, (None, 0))
            if req is None:
                continue
            if new_ids:
                self._record_latency(req, index, len(new_ids), now)
            if seq.is_finished:
                self._finish(req, index)
            elif req.stream and new_ids:
                posted = req.logprobs_posted[index]
                new, req.logprobs_posted[index] = seq.logprobs[posted:], len(seq.logprobs)
                req.post(self._first(req, index, _Event(index, self.engine.text(seq), logprobs=new or None)))
        for seq_id in [k for k, (r, i) in self._active.items() if r.seqs[i].is_finished]:  # finished, no event
            self._finish(*self._active[seq_id])

    def _first(self, req: EngineRequest, index: int, event: _Event) -> _Event:
        """A choice's first event carries what echo shows before the completion: the prompt's text, decoded
        here (the tokenizer belongs to this thread), and its logprobs."""
        if req.echo and not req.posted[index]:
            seq = req.seqs[index]
            event.prompt, event.prompt_logprobs = self.engine.decode(seq.prompt_token_ids), list(seq.prompt_logprobs)
        req.posted[index] = True
        return event

    def _expire(self) -> None:
        """End requests past the wall-time limit: what they generated is their answer, finish "length"."""
        limit, now = self.limits.request_timeout_s, time.perf_counter()
        for req, index in [(r, i) for r, i in self._active.values() if now - r.arrival > limit]:
            self.engine.abort(req.seqs[index], "length", f"request time limit ({limit:g} s)")
            self._finish(req, index)

    def _record_latency(self, req: EngineRequest, index: int, n: int, now: float) -> None:
        """TTFT once per request. Inter-token latency once per emitted token: a step that emits n tokens
        (speculation) records its gap divided by n, n times, so the histogram's count is the number of
        tokens after the first and its sum the decode time (each choice its own gaps)."""
        last = req.last_token_time[index]
        if last is None:
            if not req.first_token:
                self.metrics.ttft.observe(now - req.arrival)
                req.first_token = True
            gap, count = 0.0, n - 1  # tokens that arrived together with the first one
        else:
            gap, count = (now - last) / n, n
        for _ in range(count):
            self.metrics.itl.observe(gap)
        req.last_token_time[index] = now

    def _finish(self, req: EngineRequest, index: int) -> None:
        seq = req.seqs[index]
        del self._active[seq.seq_id]
        out = self.engine.output(seq)  # once: it pops the stop-truncated text
        if req.echo:
            out.prompt = self.engine.decode(seq.prompt_token_ids)
        self._mean_e2e_s += 0.1 * (time.perf_counter() - req.arrival - self._mean_e2e_s)
        if out.finish_reason == "error":  # a step failed with this request alone: it alone fails
            self.metrics.requests.labels("error").inc()
            self._abort(req)
            return req.post(_Event(index, error=internal_error(f"the engine failed on this request: {out.stop_reason}")))
        self.metrics.requests.labels(out.finish_reason or "abort").inc()
        self.metrics.generation_tokens.inc(len(out.token_ids))
        req.post(self._first(req, index, _Event(index, output=out)))

    def _fail_all(self, error: APIError) -> None:
        failed = {id(r): r for r, _ in self._active.values()}
        for req, index in list(self._active.values()):
            with contextlib.suppress(Exception):
                self.engine.abort(req.seqs[index])
            self.metrics.requests.labels("error").inc()
        self._active.clear()
        for req in failed.values():
            req.post(_Event(error=error))


# -- metrics ---------------------------------------------------------------------------------------------
class _EngineStatsCollector:
    """Exports the engine's own gauges and cumulative counters from the latest snapshot, so the
    numbers are exactly the engine's (no second bookkeeping that could drift)."""

    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self.snapshot = snapshot

    def collect(self):
        s = self.snapshot()
        for key, doc in [("requests_running", "Requests being decoded"), ("requests_waiting", "Requests queued"),
                         ("kv_blocks_used", "KV blocks held by requests or the prefix cache"),
                         ("kv_blocks_total", "KV blocks in the cache"),
                         ("kv_blocks_cached", "KV blocks kept only by the prefix cache")]:
            yield GaugeMetricFamily(f"specdec_{key}", doc, value=s[key])
        for name, key, doc in [
            ("prefix_cache_queries", "prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache"),
            ("prefix_cache_hits", "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache"),
            ("preemptions", "num_preemptions", "Sequences preempted for lack of KV blocks"),
            ("spec_drafts", "spec_num_drafts", "Speculative drafts verified"),
            ("spec_draft_tokens", "spec_num_draft_tokens", "Draft tokens verified"),
            ("spec_accepted_tokens", "spec_num_accepted_tokens", "Draft tokens accepted"),
            ("spec_draft_failures", "spec_draft_failures", "Requests whose drafter raised (they go on without drafts)"),
            ("requests_failed", "requests_failed", "Requests failed by a step that raised with them alone")]:
            yield CounterMetricFamily(f"specdec_{name}", doc, value=s[key])
        per_pos = CounterMetricFamily("specdec_spec_accepted_per_position",
                                      "Drafts whose token at this position was accepted", labels=["position"])
        for j, count in enumerate(s["spec_accepted_per_pos"]):
            per_pos.add_metric([str(j + 1)], count)
        yield per_pos


class ServerMetrics:
    """One registry per app, so several apps can live in one process (tests)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "From request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specdec_inter_token_latency_seconds", "Time per output token after the first "
                             "(a speculative step's gap is divided across the tokens it emits)",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("specdec_requests", "Finished requests", ["finish_reason"], registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self.requests.labels(reason)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("specdec_generation_tokens", "Tokens generated by finished requests",
                                         registry=r)

    def watch(self, engine: AsyncEngine) -> None:
        self.registry.register(_EngineStatsCollector(lambda: engine.stats))


# -- the OpenAI API --------------------------------------------------------------------------------------
def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


class _AbortOnClose(StreamingResponse):
    """A stream that aborts its request however it ends: finished, failed, or its client gone (a disconnect
    may leave the body generator suspended, so a `finally` inside it would not run in time)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class OpenAIServer:
    """The engine thread and the OpenAI protocol together: plans go to the engine, events come back as
    JSON or SSE."""

    def __init__(self, llm: LLM, served_model_name: str | None = None, limits: Limits | None = None) -> None:
        self.llm = llm
        self.model = served_model_name or llm.model_name
        self.limits = limits or Limits()
        self.metrics = ServerMetrics()
        self.engine = AsyncEngine(llm, self.metrics, self.limits)
        self.metrics.watch(self.engine)
        self.protocol = OpenAIProtocol(llm, self.model, self.limits)
        self.created = int(time.time())

    async def start(self, body: ChatBody | CompletionBody) -> tuple[Plan, EngineRequest]:
        """Validate the request and queue it on the engine; returns once admitted (APIError when refused)."""
        plan = self.protocol.plan(body)
        return plan, await self.engine.submit(plan)

    def model_card(self) -> dict:
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "specdec",
                "max_model_len": self.llm.engine.max_model_len}

    async def generate(self, body: ChatBody | CompletionBody, request: Request) -> Response:
        plan, req = await self.start(body)
        if plan.stream:
            return _AbortOnClose(self.stream(plan, req), on_close=lambda: self.engine.abort(req))
        answer = await self.answer(plan, req, request.is_disconnected)
        if answer is None:
            return Response(status_code=499)  # the client went away; nobody reads this
        return JSONResponse(answer)

    async def answer(self, plan: Plan, req: EngineRequest, disconnected: Callable[[], Awaitable[bool]] | None = None
                     ) -> dict | None:
        """A non-streaming request's JSON body, or None when `disconnected()` said the client left first."""
        try:
            outputs = await self.wait_for_outputs(req, disconnected)
        finally:
            self.engine.abort(req)  # a no-op once finished; frees the blocks when we stop early
        return None if outputs is None else self.protocol.answer(plan, outputs, int(time.time()))

    async def wait_for_outputs(self, req: EngineRequest, disconnected: Callable[[], Awaitable[bool]] | None
                               ) -> list[RequestOutput] | None:
        """Every choice's finished output, or None when the client disconnected first (polled meanwhile when
        `disconnected` is given; without it the caller is cancelled instead)."""
        outputs: list[RequestOutput | None] = [None] * len(req.prepares)
        while not all(outputs):
            try:
                event = await asyncio.wait_for(req.events.get(), DISCONNECT_POLL_S if disconnected else None)
            except asyncio.TimeoutError:
                if await disconnected():
                    return None
                continue
            if event.error is not None:
                raise event.error
            if event.output is not None:
                outputs[event.index] = event.output
        return outputs

    async def stream(self, plan: Plan, req: EngineRequest) -> AsyncIterator[str]:
        """SSE chunks: each choice's text as it becomes safe to send (`ChoiceStream`), then its finish reason,
        optionally the usage, then [DONE]."""
        created = int(time.time())
        choices = [ChoiceStream(self.protocol, plan, i) for i in range(plan.n)]
        outputs: list[RequestOutput | None] = [None] * plan.n

        def sse(deltas: list[dict]) -> str:
            return "".join(_sse(self.protocol.chunk(plan, created, d)) for d in deltas)

        for choice in choices:
            if start := sse(choice.start()):
                yield start
        failed = False
        while not all(outputs) and not failed:
            events = [await req.events.get()]
            while not req.events.empty():  # fall behind gracefully: a choice's newest text supersedes its older
                events.append(req.events.get_nowait())
            for event in _coalesce(events):
                if event.error is not None:
                    yield _sse(event.error.body())
                    failed = True
                    break
                choice = choices[event.index]
                if event.prompt is not None:
                    out = event.output
                    ids = out.prompt_token_ids if out is not None else req.seqs[event.index].prompt_token_ids
                    yield sse(choice.echo(event.prompt, ids, event.prompt_logprobs))
                if event.output is None:
                    if chunk := sse(choice.update(event.text, event.logprobs)):
                        yield chunk
                    continue
                outputs[event.index] = event.output
                yield sse(choice.finish(event.output))
        if not failed and plan.include_usage:
            yield _sse(self.protocol.chunk(plan, created, {}, usage(plan, outputs)))
        yield _sse("[DONE]")


def _coalesce(events: list[_Event]) -> list[_Event]:
    """Back-to-back text updates of one choice as one (the newest text, every token's logprobs)."""
    merged: list[_Event] = []
    for e in events:
        last = merged[-1] if merged else None
        if (last is not None and e.index == last.index and last.output is None and last.error is None
                and e.output is None and e.error is None and e.prompt is None):
            last.text, last.logprobs = e.text, (last.logprobs or []) + (e.logprobs or [])
        else:
            merged.append(e)
    return merged


def create_app(llm: LLM, served_model_name: str | None = None, api_key: str | None = None,
               engine_thread: bool = True, limits: Limits | None = None) -> FastAPI:
    """An app over `llm`; its engine loop runs while the app is up, on a thread of its own unless
    `engine_thread` is False and the caller runs `app.state.server.engine.run()` itself (one app per LLM:
    the engine is not thread-safe). With `api_key`, every route (/health and /metrics too: they tell what the
    server is doing) needs `Authorization: Bearer <key>`; probes and scrapers send it as well."""
    server = OpenAIServer(llm, served_model_name, limits)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        if engine_thread:
            server.engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.engine.stop)

    async def models() -> dict:
        return server.model_card()

    async def healthy() -> bool:
        return server.engine.ready

    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app = api_app(server.generate, models, healthy, metrics, api_key, lifespan, server.limits.max_request_bytes,
                  server.model)
    app.state.server = server
    return app


def serve(llm: LLM, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, limits: Limits | None = None, shutdown_timeout: float = 30.0) -> None:
    """Run the server in the foreground until SIGTERM or Ctrl-C: then it refuses new requests (503), lets those
    in flight finish for up to `shutdown_timeout` seconds, fails the rest (503) and returns; a second signal
    stops it at once.

    The engine loop runs on the main thread and HTTP on a second one. The main thread loaded the model, so
    it already owns an OpenMP thread team (torch's and the C++ kernels'); when another thread computes,
    libgomp manages more threads than there are cores and stops spin-waiting, and decoding ran ~1.6x
    slower on our 2-core machines."""
    import signal

    import uvicorn

    app = create_app(llm, served_model_name, api_key, engine_thread=False, limits=limits)
    engine = app.state.server.engine
    http = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info"))
    thread = threading.Thread(target=http.run, name="specdec-http", daemon=True)
    thread.start()
    while not http.started:
        if not thread.is_alive():
            raise SpecdecError(f"could not serve on {host}:{port} (see the log above)")
        time.sleep(0.05)

    def interrupt(*_: Any) -> None:
        if engine.draining:
            raise KeyboardInterrupt
        print(f"specdec: shutting down: requests in flight have {shutdown_timeout:g} s to finish "
              "(signal again to stop now)", file=sys.stderr, flush=True)
        engine.drain(shutdown_timeout)

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    print(f"specdec: serving {served_model_name or llm.model_name!r} at http://{host}:{port}/v1", file=sys.stderr)
    try:
        engine.run()
    except KeyboardInterrupt:  # requests still in flight get a 503 and their blocks back
        engine._shutdown([])
    finally:
        http.should_exit = True
        thread.join(timeout=10)
