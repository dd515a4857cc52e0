"""`specdec serve`: an OpenAI-compatible HTTP API (chat and text completions, SSE streaming, /metrics) over one
engine; its HTTP surface (shapes, errors, limits, routes) is specdec.serving.api. The Responses API, Anthropic's
Messages API and /tokenize are answered through the same chat path (specdec.serving.responses_api, messages_api,
tokenize_api).

The engine is not thread-safe, so one engine thread owns it (`engine_thread.AsyncEngine`). The asyncio side here
only validates, formats and streams; it never touches the engine or the tokenizer.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specdec.config import SpecdecError
from specdec.engine.outputs import RequestOutput
from specdec.llm import LLM
from specdec.serving.admin import Admin, AdminEndpoint
from specdec.serving.api import ChatBody, CompletionBody, Limits, api_app, warn_if_exposed
from specdec.serving.engine_thread import AsyncEngine, EngineRequest, _Event
from specdec.serving.messages_api import MessagesEndpoint
from specdec.serving.openai_format import ChoiceStream, OpenAIFormat, usage
from specdec.serving.plans import Plan, Planner
from specdec.serving.response_store import ResponseStore
from specdec.serving.responses_api import ResponsesEndpoint
from specdec.serving.served_model import ServedModel
from specdec.serving.tokenize_api import TokenizeEndpoint
from specdec.serving.traffic import Recording, TrafficRecorder

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

log = logging.getLogger("specdec.server")

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks whether its client is still there
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class OpenAIServer:
    """The engine thread and the OpenAI protocol together: plans go to the engine, events come back as
    JSON or SSE. record_traffic: where every finished request is recorded, a Recording or its directory with the
    default caps (specdec.serving.traffic)."""

    def __init__(self, llm: LLM, served_model_name: str | None = None, limits: Limits | None = None,
                 record_traffic: Recording | str | Path | None = None) -> None:
        self.llm = llm
        self.model = served_model_name or llm.model_name
        self.limits = limits or Limits()
        self.metrics = ServerMetrics()
        self.recorder = TrafficRecorder(record_traffic, llm.fingerprint) \
            if record_traffic is not None else None
        self.engine = AsyncEngine(llm, self.metrics, self.limits, self.recorder)
        self.metrics.watch(self.engine)
        self.served = ServedModel.of(llm, self.model)
        self.planner = Planner(self.served, self.limits)
        self.format = OpenAIFormat(self.served)
        self.created = int(time.time())

    async def start(self, body: ChatBody | CompletionBody) -> tuple[Plan, EngineRequest]:
        """Validate the request and queue it on the engine; returns once admitted (APIError when refused)."""
        plan = self.planner.plan(body)
        return plan, await self.submit(plan)

    async def submit(self, plan: Plan) -> EngineRequest:
        """Queue a plan on the engine; returns once admitted (APIError when refused)."""
        return await self.engine.submit(plan)

    def model_card(self) -> dict:
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "specdec",
                "max_model_len": self.served.max_model_len}

    def draft_card(self) -> dict:
        """What `GET /admin/draft` says: the speculative method and the directory of the head drafting."""
        return {"object": "draft_head", "method": self.llm.speculative_method, "model": self.llm.draft_head}

    async def reload_draft(self, path: str) -> dict:
        """`POST /admin/draft`: swap the draft head between two engine steps (APIError 400 when refused)."""
        await self.engine.reload_draft(path)
        return self.draft_card()

    async def generate(self, body: ChatBody | CompletionBody, request: Request) -> Response:
        plan, req = await self.start(body)
        if plan.stream:
            return self.streaming(self.stream(plan, req), req)
        answer = await self.answer(plan, req, request.is_disconnected)
        if answer is None:
            return Response(status_code=499)  # the client went away; nobody reads this
        return JSONResponse(answer)

    def streaming(self, content: AsyncIterator[str], req: EngineRequest) -> Response:
        """An SSE response that aborts `req` however it ends."""
        return _AbortOnClose(content, on_close=lambda: self.engine.abort(req))

    async def answer(self, plan: Plan, req: EngineRequest, disconnected: Callable[[], Awaitable[bool]] | None = None
                     ) -> dict | None:
        """A non-streaming request's JSON body, or None when `disconnected()` said the client left first."""
        try:
            outputs = await self.wait_for_outputs(req, disconnected)
        finally:
            self.engine.abort(req)  # a no-op once finished; frees the blocks when we stop early
        return None if outputs is None else self.format.answer(plan, outputs, int(time.time()))

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
        """SSE: the chunks of `chunks`, then [DONE]."""
        async for batch in self.chunks(plan, req):
            yield "".join(map(_sse, batch))
        yield _sse("[DONE]")

    async def chunks(self, plan: Plan, req: EngineRequest) -> AsyncIterator[list[dict]]:
        """The stream's chunk bodies, a batch per wake-up: each choice's text as it becomes safe to send
        (`ChoiceStream`), then its finish reason, optionally the usage. A failure ends it with its error's body
        ({"error": ...}). The Responses and Messages APIs rewrite these chunks as their own events."""
        created = int(time.time())
        choices = [ChoiceStream(self.format, plan, i) for i in range(plan.n)]
        outputs: list[RequestOutput | None] = [None] * plan.n

        def bodies(deltas: list[dict]) -> list[dict]:
            return [self.format.chunk(plan, created, d) for d in deltas]

        for choice in choices:
            if start := bodies(choice.start()):
                yield start
        while not all(outputs):
            events = [await req.events.get()]
            while not req.events.empty():  # fall behind gracefully: a choice's newest text supersedes its older
                events.append(req.events.get_nowait())
            batch: list[dict] = []
            for event in _coalesce(events):
                if event.error is not None:
                    yield batch + [event.error.body()]
                    return
                choice = choices[event.index]
                if event.prompt is not None:
                    out = event.output
                    ids = out.prompt_token_ids if out is not None else req.prompt_ids[event.index]
                    batch += bodies(choice.echo(event.prompt, ids, event.prompt_logprobs))
                if event.output is None:
                    batch += bodies(choice.update(event.text, event.logprobs))
                    continue
                outputs[event.index] = event.output
                batch += bodies(choice.finish(event.output))
            if batch:
                yield batch
        if plan.include_usage:
            yield [self.format.chunk(plan, created, {}, usage(plan, outputs))]

    async def on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        """`fn()` run on the engine thread (where the tokenizer lives), between two steps; APIError as it raised
        it, a SpecdecError as a 400."""
        return await self.engine.call(fn)


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
               engine_thread: bool = True, limits: Limits | None = None,
               record_traffic: Recording | str | Path | None = None, admin: Admin | None = None) -> FastAPI:
    """An app over `llm`; its engine loop runs while the app is up, on a thread of its own unless
    `engine_thread` is False and the caller runs `app.state.server.engine.run()` itself (one app per LLM:
    the engine is not thread-safe). With `api_key`, every route but /admin/* (/health and /metrics too: they
    tell what the server is doing) needs `Authorization: Bearer <key>`; probes and scrapers send it as well.
    admin: the /admin routes' own key and the folders heads may come from (off by default; see
    specdec.serving.admin). record_traffic: where every finished request is recorded (off by default; see
    specdec.serving.traffic)."""
    server = OpenAIServer(llm, served_model_name, limits, record_traffic)
    admin_routes = AdminEndpoint(admin or Admin(), api_key, server.draft_card, server.reload_draft)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        if engine_thread:
            server.engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.engine.stop)
            if server.recorder is not None:
                server.recorder.close()

    async def models() -> dict:
        return server.model_card()

    async def healthy() -> bool:
        return server.engine.ready

    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app = api_app(server.generate, models, healthy, metrics, api_key, lifespan, server.limits.max_request_bytes,
                  server.model)
    limits = server.limits
    store = ResponseStore(limits.max_stored_responses, limits.max_stored_bytes)
    for endpoint in (ResponsesEndpoint(server, store), MessagesEndpoint(server), TokenizeEndpoint(server),
                     admin_routes):
        app.include_router(endpoint.router())
    app.state.server = server
    return app


def serve(llm: LLM, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, limits: Limits | None = None, shutdown_timeout: float = 30.0,
          record_traffic: Recording | str | Path | None = None, admin: Admin | None = None) -> None:
    """Run the server in the foreground until SIGTERM or Ctrl-C: then it refuses new requests (503), lets those
    in flight finish for up to `shutdown_timeout` seconds, fails the rest (503) and returns; a second signal
    stops it at once. record_traffic, admin: see `create_app`. A host other than this machine's without
    `api_key` is served, with a warning.

    The engine loop runs on the main thread and HTTP on a second one. The main thread loaded the model, so
    it already owns an OpenMP thread team (torch's and the C++ kernels'); when another thread computes,
    libgomp manages more threads than there are cores and stops spin-waiting, and decoding ran ~1.6x
    slower on our 2-core machines."""
    import signal

    import uvicorn

    warn_if_exposed(host, api_key)
    app = create_app(llm, served_model_name, api_key, engine_thread=False, limits=limits, record_traffic=record_traffic,
                     admin=admin)
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
