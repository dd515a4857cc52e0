"""The engine thread: one thread owns the engine (it is not thread-safe). It tokenizes prompts, admits requests,
steps the engine while there is work (it sleeps on its inbox when idle) and hands every request its events through
an `asyncio.Queue` on the server's event loop. It reads only what the engine's steps return (`RequestUpdate`s, each
finished request's `RequestOutput`), never the engine's sequences. It also records each request as it finishes
(`--record-traffic`), swaps the draft head between two steps (`POST /admin/draft`), and runs the tokenizer for
requests that only tokenize (`/tokenize`, `/v1/messages/count_tokens`).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specdec.config import SpecdecError
from specdec.engine.outputs import RequestOutput
from specdec.llm import LLM
from specdec.serving.api import APIError, Limits, internal_error
from specdec.serving.plans import Plan
from specdec.serving.traffic import TrafficRecorder

log = logging.getLogger("specdec.server")

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
    """One request as both sides see it: its choices' engine requests (n of them, or one per prompt). Each `prepare`
    runs on the engine thread (tokenizers are not safe to share across threads) and returns a choice's prompt
    ids and final sampling params, or raises APIError; `shares[i]` is the earlier choice whose prompt blocks
    choice i shares."""

    def __init__(self, plan: Plan) -> None:
        self.loop = asyncio.get_running_loop()
        self.prepares, self.shares, self.prompt_field = plan.prepares, plan.shares, plan.prompt_field
        self.stream, self.echo, self.record = plan.stream, plan.echo, plan.record
        self.events: asyncio.Queue[_Event] = asyncio.Queue()
        self.admitted: asyncio.Future[None] = self.loop.create_future()
        self.request_ids: list[int] = []  # the engine's ids of its choices, set on the engine thread
        self.prompt_ids: list[list[int]] = []  # each choice's prompt token ids (echo, traffic recording)
        self.temperatures: list[float] = []  # each choice's sampling temperature (traffic recording)
        self.prompt_logprobs: list[list | None] = [None] * len(plan.prepares)  # each choice's, from its first update
        self.arrival = time.perf_counter()
        self.first_token = False  # TTFT recorded
        self.last_token_time: list[float | None] = [None] * len(plan.prepares)
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


class DraftReload:
    """A request to draft with another head (`POST /admin/draft`), answered from the engine thread: `done` is
    resolved once the head drafts, or fails with the APIError saying why not."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.loop = asyncio.get_running_loop()
        self.done: asyncio.Future[None] = self.loop.create_future()

    # Called from the engine thread.
    def resolve(self, error: APIError | None = None) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is closed: the server is gone
            self.loop.call_soon_threadsafe(self._resolve, error)

    def _resolve(self, error: APIError | None) -> None:
        if not self.done.done():
            self.done.set_exception(error) if error else self.done.set_result(None)


class EngineCall:
    """A function to run on the engine thread between two steps (tokenizing for /tokenize): `done` gets its result,
    or the APIError it raised (a SpecdecError as a 400)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.loop = asyncio.get_running_loop()
        self.done: asyncio.Future[Any] = self.loop.create_future()

    # Called from the engine thread.
    def run(self) -> None:
        try:
            result, error = self.fn(), None
        except APIError as e:
            result, error = None, e
        except SpecdecError as e:
            result, error = None, APIError(400, str(e))
        except Exception as e:  # noqa: BLE001  the engine goes on
            log.exception("a call on the engine thread failed")
            result, error = None, internal_error(f"{type(e).__name__}: {e}")
        self.resolve(error, result)

    def resolve(self, error: APIError | None = None, result: Any = None) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is closed: the server is gone
            self.loop.call_soon_threadsafe(self._resolve, result, error)

    def _resolve(self, result: Any, error: APIError | None) -> None:
        if not self.done.done():
            self.done.set_exception(error) if error else self.done.set_result(result)


class AsyncEngine:
    """Runs an LLMEngine on one thread (`run`); requests and aborts arrive through a thread-safe inbox."""

    def __init__(self, llm: LLM, metrics: Any, limits: Limits | None = None,
                 recorder: TrafficRecorder | None = None) -> None:
        """metrics: the server's Prometheus metrics (`server.ServerMetrics`), counted here as requests end.
        recorder: where each finished request is recorded (`--record-traffic`), or None."""
        self.llm, self.engine, self.metrics, self.recorder = llm, llm.engine, metrics, recorder
        self.limits = limits or Limits()
        self.stats: dict = self.engine.stats()  # the latest snapshot, replaced whole after every step
        self._submitted: set[EngineRequest] = set()  # awaiting admission (touched on the event loop's thread only)
        self._mean_e2e_s = 10.0  # running mean of finished requests' wall time, for Retry-After
        self._inbox: queue.Queue[tuple[str, EngineRequest | DraftReload | EngineCall | None]] = queue.Queue()
        self._active: dict[int, tuple[EngineRequest, int]] = {}  # request id -> (request, choice); engine thread only
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
        `_submitted` only when its handler resumes, so it counts there only until the engine took it."""
        return len(self._active) + sum(len(r.prepares) for r in list(self._submitted) if not r.request_ids)

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

    async def reload_draft(self, path: str) -> None:
        """Draft with the head in `path` from the next engine step on (`LLM.reload_draft`, run on the engine thread
        between two steps: the thread that loaded the first head and owns the OpenMP team loads it, so requests in
        flight pause for the load). APIError 400 when the head is refused; the old one keeps drafting."""
        if not self.alive or self.draining:
            raise APIError(503, "the engine is not running" if not self.alive else "the server is shutting down",
                           type="service_unavailable", code="engine_dead" if not self.alive else "shutting_down")
        reload = DraftReload(path)
        self._inbox.put(("reload", reload))
        await reload.done

    async def call(self, fn: Callable[[], Any]) -> Any:
        """`fn()`, run on the engine thread between two steps (see EngineCall)."""
        if not self.alive or self.draining:
            raise APIError(503, "the engine is not running" if not self.alive else "the server is shutting down",
                           type="service_unavailable", code="engine_dead" if not self.alive else "shutting_down")
        job = EngineCall(fn)
        self._inbox.put(("call", job))
        return await job.done

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
                    elif kind == "reload":
                        self._reload(req)
                    elif kind == "call":
                        req.run()
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

    def _shutdown(self, commands: list[tuple[str, EngineRequest | DraftReload | EngineCall | None]]) -> None:
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
                source = req.request_ids[share] if share is not None else None
                req.request_ids.append(self.engine.add_request(prompt_ids, params, share_prompt_with=source,
                                                               stream=req.stream))
                req.prompt_ids.append(prompt_ids)
                req.temperatures.append(params.temperature)
                self.metrics.prompt_tokens.inc(len(prompt_ids) if source is None else 0)
        except Exception as e:  # noqa: BLE001  nothing of the request runs: its admitted choices go too
            for request_id in req.request_ids:
                self.engine.abort(request_id)
            req.request_ids = []
            if isinstance(e, APIError):
                return req.resolve(e)
            if isinstance(e, SpecdecError):  # empty prompt, prompt too long, token ids out of range, no template
                return req.resolve(APIError(400, str(e), param=req.prompt_field))
            log.exception("could not admit a request")
            return req.resolve(internal_error(f"could not admit the request: {type(e).__name__}: {e}"))
        for index, request_id in enumerate(req.request_ids):
            self._active[request_id] = (req, index)
        req.resolve()

    def _reload(self, reload: DraftReload) -> None:
        try:
            self.llm.reload_draft(reload.path)
        except SpecdecError as e:  # not a head of this method and shape, or not a head at all
            return reload.resolve(APIError(400, str(e), param="model", code="invalid_draft_head"))
        except Exception as e:  # noqa: BLE001  the old head keeps drafting
            log.exception("could not reload the draft head")
            return reload.resolve(internal_error(f"could not reload the draft head: {type(e).__name__}: {e}"))
        reload.resolve()

    def _abort(self, req: EngineRequest) -> None:
        for request_id in req.request_ids:
            if self._active.get(request_id, (None,))[0] is req:
                del self._active[request_id]
                self.engine.abort(request_id)  # frees its KV blocks
                self.metrics.requests.labels("abort").inc()

    def _step(self) -> None:
        try:
            updates = self.engine.step()
        except Exception as e:
            # The engine isolates a step that raised (only the request at fault fails); what escapes is the
            # engine's own failure (a tensor-parallel rank gone) or a bookkeeping bug: every request in flight
            # is failed and aborted (its blocks freed); the next requests start clean.
            log.exception("engine step failed")
            self._fail_all(internal_error(f"the engine failed while generating: {type(e).__name__}: {e}"))
            return
        now = time.perf_counter()
        for update in updates:
            req, index = self._active.get(update.request_id, (None, 0))
            if req is None:
                continue
            if update.new_token_ids:
                self._record_latency(req, index, len(update.new_token_ids), now)
            if update.prompt_logprobs is not None:
                req.prompt_logprobs[index] = update.prompt_logprobs
            if update.finished:
                self._finish(req, index, update.output)
            elif req.stream and update.new_token_ids:
                req.post(self._first(req, index, _Event(index, update.text, logprobs=update.new_logprobs or None)))

    def _first(self, req: EngineRequest, index: int, event: _Event) -> _Event:
        """A choice's first event carries what echo shows before the completion: the prompt's text, decoded
        here (the tokenizer belongs to this thread), and its logprobs."""
        if req.echo and not req.posted[index]:
            logprobs = event.output.prompt_logprobs if event.output is not None else req.prompt_logprobs[index]
            event.prompt, event.prompt_logprobs = self.engine.decode(req.prompt_ids[index]), list(logprobs or [])
        req.posted[index] = True
        return event

    def _expire(self) -> None:
        """End requests past the wall-time limit: what they generated is their answer, finish "length"."""
        limit, now = self.limits.request_timeout_s, time.perf_counter()
        for req, index in [(r, i) for r, i in self._active.values() if now - r.arrival > limit]:
            self._finish(req, index, self.engine.abort(req.request_ids[index], "length",
                                                       f"request time limit ({limit:g} s)"))

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

    def _finish(self, req: EngineRequest, index: int, out: RequestOutput) -> None:
        del self._active[req.request_ids[index]]
        if req.echo:
            out.prompt = self.engine.decode(req.prompt_ids[index])
        self._mean_e2e_s += 0.1 * (time.perf_counter() - req.arrival - self._mean_e2e_s)
        if out.finish_reason == "error":  # a step failed with this request alone: it alone fails
            self.metrics.requests.labels("error").inc()
            self._abort(req)
            error = internal_error(f"the engine failed on this request: {out.stop_reason}")
            return req.post(_Event(index, error=error))
        self.metrics.requests.labels(out.finish_reason or "abort").inc()
        self.metrics.generation_tokens.inc(len(out.token_ids))
        if self.recorder is not None and req.record and out.finish_reason in ("stop", "length"):
            self.recorder.record(req.prompt_ids[index], out.token_ids, out.finish_reason, req.temperatures[index])
        req.post(self._first(req, index, _Event(index, output=out)))

    def _fail_all(self, error: APIError) -> None:
        failed = {id(r): r for r, _ in self._active.values()}
        for req, index in list(self._active.values()):
            with contextlib.suppress(Exception):
                self.engine.abort(req.request_ids[index])
            self.metrics.requests.labels("error").inc()
        self._active.clear()
        for req in failed.values():
            req.post(_Event(error=error))
