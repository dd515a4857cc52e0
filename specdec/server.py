"""`specdec serve`: an OpenAI-compatible HTTP API (chat and text completions, SSE streaming, /metrics) over one
engine; its HTTP surface (shapes, errors, limits, routes) is specdec.api.

The engine is not thread-safe, so one engine thread owns it: it tokenizes prompts, admits requests,
steps the engine while there is work (it sleeps on its inbox when idle) and hands every request its
events through an `asyncio.Queue` on the server's event loop. The asyncio side only validates,
formats and streams; it never touches the engine or the tokenizer.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import math
import queue
import re
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specdec.api import (UNSUPPORTED_FIELDS, APIError, ChatBody, CompletionBody, Limits, api_app, check_text,
                         internal_error, structured_output)
from specdec.config import MAX_LOGPROBS, SamplingParams, SpecdecError
from specdec.engine.llm_engine import RequestOutput
from specdec.llm import LLM
from specdec.sampling import TokenLogprob

log = logging.getLogger("specdec.server")

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks whether its client is still there
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


# -- the engine thread ---------------------------------------------------------------------------------
@dataclass
class _Event:
    """What the engine thread tells a request: text so far (streaming only), then its output or an error."""

    text: str = ""
    output: RequestOutput | None = None
    error: APIError | None = None
    logprobs: list | None = None  # streaming with logprobs: those of the tokens generated since the last event


Prepare = Callable[[], tuple[list[int], SamplingParams]]


class EngineRequest:
    """One request as both sides see it. `prepare` runs on the engine thread (tokenizers are not safe
    to share across threads) and returns the prompt ids and final sampling params, or raises APIError."""

    def __init__(self, prepare: Prepare, stream: bool, prompt_field: str) -> None:
        self.loop = asyncio.get_running_loop()
        self.prepare, self.stream, self.prompt_field = prepare, stream, prompt_field
        self.events: asyncio.Queue[_Event] = asyncio.Queue()
        self.admitted: asyncio.Future[None] = self.loop.create_future()
        self.seq = None  # the engine's Sequence, set on the engine thread
        self.arrival = time.perf_counter()
        self.last_token_time: float | None = None
        self.logprobs_posted = 0  # streaming: the sequence's logprobs already posted

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
        self._active: dict[int, EngineRequest] = {}  # seq_id -> request; touched by the engine thread only
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
        return len(self._active) + sum(r.seq is None for r in list(self._submitted))

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

    async def submit(self, prepare: Prepare, stream: bool, prompt_field: str) -> EngineRequest:
        """Queue a request and wait until the engine admitted it (raises APIError when it refused)."""
        if not self.alive:
            raise APIError(503, "the engine is not running", type="service_unavailable", code="engine_dead")
        if self.draining:
            raise APIError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")
        self.check_room()
        req = EngineRequest(prepare, stream, prompt_field)
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
            prompt_ids, params = req.prepare()
            req.seq = self.engine.add_request(prompt_ids, params)
        except APIError as e:
            return req.resolve(e)
        except SpecdecError as e:  # empty prompt, prompt too long, token ids out of range, no chat template
            return req.resolve(APIError(400, str(e), param=req.prompt_field))
        except Exception as e:
            log.exception("could not admit a request")
            return req.resolve(internal_error(f"could not admit the request: {type(e).__name__}: {e}"))
        self._active[req.seq.seq_id] = req
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        req.resolve()

    def _abort(self, req: EngineRequest) -> None:
        if req.seq is not None and self._active.pop(req.seq.seq_id, None) is req:
            self.engine.abort(req.seq)  # frees its KV blocks
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
            req = self._active.get(seq.seq_id)
            if req is None:
                continue
            if new_ids:
                self._record_latency(req, len(new_ids), now)
            if seq.is_finished:
                self._finish(req)
            elif req.stream and new_ids:
                new, req.logprobs_posted = seq.logprobs[req.logprobs_posted:], len(seq.logprobs)
                req.post(_Event(text=self.engine.text(seq), logprobs=new or None))
        for req in [r for r in self._active.values() if r.seq.is_finished]:  # finished without an event
            self._finish(req)

    def _expire(self) -> None:
        """End requests past the wall-time limit: what they generated is their answer, finish "length"."""
        limit, now = self.limits.request_timeout_s, time.perf_counter()
        for req in [r for r in self._active.values() if now - r.arrival > limit]:
            self.engine.abort(req.seq, "length", f"request time limit ({limit:g} s)")
            self._finish(req)

    def _record_latency(self, req: EngineRequest, n: int, now: float) -> None:
        """TTFT once per request. Inter-token latency once per emitted token: a step that emits n tokens
        (speculation) records its gap divided by n, n times, so the histogram's count is the number of
        tokens after the first and its sum the decode time."""
        if req.last_token_time is None:
            self.metrics.ttft.observe(now - req.arrival)
            gap, count = 0.0, n - 1  # tokens that arrived together with the first one
        else:
            gap, count = (now - req.last_token_time) / n, n
        for _ in range(count):
            self.metrics.itl.observe(gap)
        req.last_token_time = now

    def _finish(self, req: EngineRequest) -> None:
        del self._active[req.seq.seq_id]
        out = self.engine.output(req.seq)  # once: it pops the stop-truncated text
        self._mean_e2e_s += 0.1 * (time.perf_counter() - req.arrival - self._mean_e2e_s)
        if out.finish_reason == "error":  # a step failed with this request alone: it alone fails
            self.metrics.requests.labels("error").inc()
            return req.post(_Event(error=internal_error(f"the engine failed on this request: {out.stop_reason}")))
        self.metrics.requests.labels(out.finish_reason or "abort").inc()
        self.metrics.generation_tokens.inc(len(out.token_ids))
        req.post(_Event(output=out))

    def _fail_all(self, error: APIError) -> None:
        for req in list(self._active.values()):
            with contextlib.suppress(Exception):
                self.engine.abort(req.seq)
            self.metrics.requests.labels("error").inc()
            req.post(_Event(error=error))
        self._active.clear()


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


# -- streaming text ----------------------------------------------------------------------------------------
def streamable_length(text: str, stops: list[str]) -> int:
    """How much of `text` may be sent now: not a trailing incomplete UTF-8 character ("\\ufffd"), and not
    a tail that could still grow into a stop string (text past a stop string must never be sent)."""
    end = len(text.rstrip("\ufffd"))
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, end), held, -1):
            if text.startswith(stop[:k], end - k):
                held = k
                break
    return end - held


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


# -- the OpenAI API --------------------------------------------------------------------------------------
@dataclass
class Started:
    """An admitted request and what its response needs."""

    req: EngineRequest
    rid: str
    chat: bool
    stops: list[str]
    stream: bool
    include_usage: bool
    logprobs: bool = False  # the response carries log-probabilities


class OpenAIServer:
    def __init__(self, llm: LLM, served_model_name: str | None = None, limits: Limits | None = None) -> None:
        self.llm = llm
        self.model = served_model_name or llm.model_name
        self.limits = limits or Limits()
        self.metrics = ServerMetrics()
        self.engine = AsyncEngine(llm, self.metrics, self.limits)
        self.metrics.watch(self.engine)
        self.created = int(time.time())
        # the most characters one token stands for: a prompt longer than the context times this cannot fit,
        # so it is refused without tokenizing it
        self.max_token_chars = max(map(len, llm.tokenizer.get_vocab()), default=1)

    def sampling_params(self, body: ChatBody | CompletionBody) -> tuple[SamplingParams, int | None, str, str | None]:
        """Validate sampling fields here, where we still know their names; max_tokens is settled on
        the engine thread once the prompt length is known. Also returns the field a structured output
        constraint came from (its grammar is compiled on the engine thread, which names it in an error)."""
        for name, value in (body.model_extra or {}).items():
            if name in UNSUPPORTED_FIELDS and UNSUPPORTED_FIELDS[name](value):
                raise APIError(400, f"{name}={json.dumps(value)[:80]} is not supported by this server; leave it out",
                               param=name, code="unsupported_parameter")
        if body.n not in (None, 1):
            raise APIError(400, f"n={body.n} is not supported: this server returns one choice per request (n=1)",
                           param="n")
        max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"invalid {max_field}={max_tokens}: must be at least 1", param=max_field)
        temperature = 1.0 if body.temperature is None else body.temperature
        if not 0 <= temperature <= 2:
            raise APIError(400, f"invalid temperature={temperature}: must be in [0, 2]", param="temperature")
        if body.seed is not None and not -2**63 <= body.seed < 2**64:
            raise APIError(400, f"invalid seed={body.seed}: must fit in 64 bits", param="seed")
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > self.limits.max_stop:
            raise APIError(400, f"stop holds {len(stops)} strings; this server takes at most {self.limits.max_stop}",
                           param="stop")
        for i, stop in enumerate(stops):
            if len(stop) > self.limits.max_stop_chars:
                raise APIError(400, f"stop[{i}] has {len(stop)} characters; this server takes at most "
                               f"{self.limits.max_stop_chars}", param="stop")
            check_text(stop, f"stop[{i}]")
        constraint, constraint_field = structured_output(body.model_extra or {})
        if isinstance(body, ChatBody):
            top = body.top_logprobs
            if top is not None and not 0 <= top <= MAX_LOGPROBS:
                raise APIError(400, f"invalid top_logprobs={top}: must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
            if top and not body.logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
            logprobs = (top or 0) if body.logprobs else None
        else:  # its range is SamplingParams' to check, under the same name
            logprobs = body.logprobs
        penalties = {"logprobs": logprobs, "presence_penalty": body.presence_penalty or 0.0,
                     "frequency_penalty": body.frequency_penalty or 0.0,
                     "repetition_penalty": 1.0 if body.repetition_penalty is None else body.repetition_penalty,
                     "logit_bias": self.logit_bias(body.logit_bias)}
        try:
            params = SamplingParams(temperature=temperature, top_p=1.0 if body.top_p is None else body.top_p,
                                    top_k=body.top_k or 0, min_p=body.min_p or 0.0, seed=body.seed,
                                    max_tokens=max_tokens or 1, stop=body.stop, ignore_eos=body.ignore_eos,
                                    structured_output=constraint, **penalties)
        except SpecdecError as e:  # "invalid top_p=1.5: must be in (0, 1]"
            match = re.match(r"invalid (\w+)=", str(e))
            raise APIError(400, str(e), param=match[1] if match else None) from None
        return params, max_tokens, max_field, constraint_field

    def logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI's logit_bias (token ids as strings) as token ids of this vocabulary; SamplingParams checks the
        biases."""
        if not bias:
            return None
        vocab = self.llm.engine.model.config.vocab_size
        for key in bias:
            if not key.strip().isdigit() or int(key) >= vocab:
                raise APIError(400, f"logit_bias key {key[:40]!r} is not a token id of this model's vocabulary "
                               f"(integers 0 to {vocab - 1})", param="logit_bias")
        return {int(key): value for key, value in bias.items()}

    def preparer(self, tokenize: Callable[[], list[int]], params: SamplingParams, max_tokens: int | None,
                 max_field: str, prompt_field: str, constraint_field: str | None = None) -> Prepare:
        def prepare() -> tuple[list[int], SamplingParams]:
            if constraint_field is not None:
                try:  # compiled once here (cached by its text) to name the field; the engine reuses it
                    self.llm.engine.grammar_state(params)
                except SpecdecError as e:
                    raise APIError(400, f"{constraint_field}: {e}", param=constraint_field) from None
            ids = tokenize()
            n, limit = len(ids), self.llm.engine.max_model_len
            if n >= limit:
                raise APIError(400, f"the prompt has {n} tokens but the model's context is {limit} tokens; "
                               f"shorten it to at most {limit - 1}", param=prompt_field, code="context_length_exceeded")
            if max_tokens is not None and n + max_tokens > limit:
                raise APIError(400, f"{max_field}={max_tokens} plus the prompt's {n} tokens exceeds the model's "
                               f"context of {limit} tokens; ask for at most {limit - n}", param=max_field,
                               code="context_length_exceeded")
            default = limit - n if self.limits.default_max_tokens is None else min(limit - n, self.limits.default_max_tokens)
            return ids, dataclasses.replace(params, max_tokens=max_tokens or default)
        return prepare

    def tokenizer_for(self, body: ChatBody | CompletionBody) -> tuple[Callable[[], list[int]], str]:
        if isinstance(body, ChatBody):
            if not body.messages:
                raise APIError(400, "messages must contain at least one message", param="messages")
            conversation = []
            for i, m in enumerate(body.messages):
                content = _text_content(m.content, i)
                check_text(content, f"messages[{i}].content")
                # a developer message is what the chat templates we serve call a system message
                conversation.append({"role": "system" if m.role == "developer" else m.role, "content": content})
            self.check_chars(sum(len(c["content"]) for c in conversation), "messages")
            return lambda: self.llm.apply_chat_template(conversation), "messages"
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"prompt holds {len(prompt)} prompts; send one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            self.check_chars(len(prompt), "prompt")
            return lambda: self.llm.encode(prompt)[1], "prompt"
        return lambda: list(prompt), "prompt"

    def check_chars(self, chars: int, field: str) -> None:
        """A prompt too long for the context whatever its tokens, refused before tokenizing it."""
        limit = self.llm.engine.max_model_len
        if chars > (limit - 1) * self.max_token_chars:
            raise APIError(400, f"{field}: {chars} characters of text, more than the model's context of {limit} "
                           f"tokens can hold (a token covers at most {self.max_token_chars}); shorten it", param=field,
                           code="context_length_exceeded")

    async def start(self, body: ChatBody | CompletionBody) -> Started:
        """Validate the request and queue it on the engine; returns once admitted (APIError when refused)."""
        if body.model != self.model:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {self.model!r}",
                           param="model", code="model_not_found")
        params, max_tokens, max_field, constraint_field = self.sampling_params(body)
        tokenize, prompt_field = self.tokenizer_for(body)
        prepare = self.preparer(tokenize, params, max_tokens, max_field, prompt_field, constraint_field)
        req = await self.engine.submit(prepare, bool(body.stream), prompt_field)
        chat = isinstance(body, ChatBody)
        return Started(req, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", chat, params.stop,
                       bool(body.stream), bool(body.stream_options and body.stream_options.include_usage),
                       params.logprobs is not None)

    def events(self, started: Started) -> AsyncIterator[str]:
        """A streaming request's SSE chunks."""
        return self.stream(started.req, started.rid, started.chat, started.stops, started.include_usage,
                           started.logprobs)

    async def answer(self, started: Started, disconnected: Callable[[], Awaitable[bool]] | None = None
                     ) -> dict | None:
        """A non-streaming request's JSON body, or None when `disconnected()` said the client left first."""
        try:
            out = await self.wait_for_output(started.req, disconnected)
        finally:
            self.engine.abort(started.req)  # a no-op once finished; frees the blocks when we stop early
        if out is None:
            return None
        choice = {"index": 0, "logprobs": self.logprobs_json(out.logprobs, started.chat),
                  "finish_reason": out.finish_reason}
        choice.update({"message": {"role": "assistant", "content": out.text}} if started.chat else {"text": out.text})
        return {"id": started.rid, "object": "chat.completion" if started.chat else "text_completion",
                "created": int(time.time()), "model": self.model, "choices": [choice], "usage": _usage(out)}

    def logprobs_json(self, entries: list[TokenLogprob] | None, chat: bool, offset: int = 0) -> dict | None:
        """OpenAI's logprobs object: chat's `content` entries, or the completions' parallel lists (`text_offset`
        counted from `offset` characters into the generated text)."""
        if entries is None:
            return None
        text = self.token_text
        if chat:
            def one(token: int, logprob: float) -> dict:
                s = text(token)
                return {"token": s, "logprob": logprob, "bytes": list(s.encode())}

            return {"content": [one(e.token, e.logprob) | {"top_logprobs": [one(t, v) for t, v in e.top]}
                                for e in entries]}
        tokens = [text(e.token) for e in entries]
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{text(t): v for t, v in e.top} for e in entries],
                "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))
                if tokens else []}

    @functools.lru_cache(maxsize=65536)  # noqa: B019  one server per process; a token's text never changes
    def token_text(self, token: int) -> str:
        return self.llm.tokenizer.decode([token], skip_special_tokens=False)

    def model_card(self) -> dict:
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "specdec",
                "max_model_len": self.llm.engine.max_model_len}

    async def generate(self, body: ChatBody | CompletionBody, request: Request) -> Response:
        started = await self.start(body)
        if started.stream:
            return _AbortOnClose(self.events(started), on_close=lambda: self.engine.abort(started.req))
        answer = await self.answer(started, request.is_disconnected)
        if answer is None:
            return Response(status_code=499)  # the client went away; nobody reads this
        return JSONResponse(answer)

    async def wait_for_output(self, req: EngineRequest, disconnected: Callable[[], Awaitable[bool]] | None
                              ) -> RequestOutput | None:
        """The finished output, or None when the client disconnected first (polled meanwhile when
        `disconnected` is given; without it the caller is cancelled instead)."""
        while True:
            try:
                event = await asyncio.wait_for(req.events.get(), DISCONNECT_POLL_S if disconnected else None)
            except asyncio.TimeoutError:
                if await disconnected():
                    return None
                continue
            if event.error is not None:
                raise event.error
            if event.output is not None:
                return event.output

    async def stream(self, req: EngineRequest, rid: str, chat: bool, stops: list[str],
                     include_usage: bool, logprobs: bool = False) -> AsyncIterator[str]:
        """SSE chunks: the decoded text's new suffix as it becomes safe to send, then the remainder of
        the final (stop-truncated) text with the finish reason, optionally usage, then [DONE]. With logprobs,
        each text chunk carries those of the tokens generated since the previous chunk (the last one, the rest)."""
        created = int(time.time())
        pending: list[TokenLogprob] = []  # logprobs received and not sent yet
        count, offset = 0, 0  # logprobs sent, and the characters of their tokens (completions' text_offset)

        def chunk(text: str | None, finish: str | None = None, role: bool = False) -> str:
            nonlocal pending, count, offset
            lps = self.logprobs_json(pending, chat, offset) if logprobs and pending and not role else None
            if lps is not None:
                count, offset = count + len(pending), offset + sum(len(self.token_text(e.token)) for e in pending)
                pending = []
            if chat:
                delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
                choice = {"index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": lps, "finish_reason": finish}
            body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created, "model": self.model, "choices": [choice]}
            return _sse(body | ({"usage": None} if include_usage else {}))

        sent = ""
        if chat:
            yield chunk("", role=True)
        while True:
            event = await req.events.get()
            pending += event.logprobs or []
            while event.output is None and event.error is None and not req.events.empty():
                event = req.events.get_nowait()  # fall behind gracefully: only the latest text matters
                pending += event.logprobs or []
            if event.error is not None:
                yield _sse(event.error.body())
                break
            out = event.output
            if out is None:
                text = event.text
                safe = streamable_length(text, stops)
                if safe > len(sent) and text.startswith(sent):
                    yield chunk(text[len(sent):safe])
                    sent = text[:safe]
                continue
            if not out.text.startswith(sent):  # the incremental text drifted from the full decode
                log.warning("request %s: streamed text is not a prefix of the final text", rid)
            pending = list(out.logprobs[count:]) if out.logprobs is not None else []
            rest = out.text[len(sent):]
            if chat:
                if rest or pending:
                    yield chunk(rest)
                yield chunk(None, out.finish_reason)
            else:
                yield chunk(rest, out.finish_reason)
            if include_usage:
                yield _sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": created, "model": self.model, "choices": [], "usage": _usage(out)})
            break
        yield _sse("[DONE]")


def _text_content(content: str | list[dict[str, Any]] | None, index: int) -> str:
    """OpenAI clients may send content as parts; only text parts are understood."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, f"messages[{index}].content: only text parts are supported, got "
                           f"{part.get('type')!r}", param="messages")
        texts.append(part["text"])
    return "".join(texts)


def _usage(out: RequestOutput) -> dict:
    m = out.metrics
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "acceptance_length": m.get("acceptance_length"), "num_drafts": m.get("num_drafts", 0),
            "num_draft_tokens": m.get("num_draft_tokens", 0), "num_accepted_tokens": m.get("num_accepted_tokens", 0)}


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
