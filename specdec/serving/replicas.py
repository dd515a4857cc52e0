"""Multi-replica serving on Ray Serve: N engines behind one OpenAI-compatible endpoint.

    client --HTTP--> Ray's proxy --> Ingress --------------------------------> EngineReplica x N
                                     the FastAPI app of `specdec serve`        an LLM (maybe tensor-parallel),
                                     (routes, API key, request validation);    its engine thread and the
                                     forwards the parsed body through a        OpenAIServer that admits,
                                     handle whose PrefixAffinityRouter picks   decodes and formats
                                     the replica

The router prefers the replica that last served the longest prefix of a request's prompt (its prefix cache
holds that prefix's K/V, so the prompt is not prefilled again) unless that replica is busier than the least
loaded by more than `imbalance` requests; otherwise it takes the least loaded. Replies come back as one item
(a non-streaming JSON body, or an error) or as a head item followed by the SSE chunks, relayed as they come.
Ray owns placement, health checks and replacement of dead replicas; we own what a replica runs and where a
request goes. Ray is optional (`pip install specdec[ray]`); only this module imports it.

Entry points: `specdec serve --replicas N` (a local Ray cluster, or the one RAY_ADDRESS names) and
`serve run specdec.serving.replicas:build_app replicas=2 model=... speculative_config=...` for Serve configs.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import ray
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from specdec.config import EngineConfig, SpecdecError, from_kwargs
from specdec.drafting.registry import SpeculativeConfig
from specdec.models.loader import DEFAULT_MODEL, resolve
from specdec.serving.api import APIError, ChatBody, CompletionBody, Limits, api_app, warn_if_exposed

log = logging.getLogger("specdec.replicas")

APP_NAME = "specdec"
CHUNK_CHARS = 64  # prefix granularity of the routing table: about one 16-token KV block of English text
TABLE_KEYS = 200_000  # prefix keys remembered over all replicas (~20 MB), least recently routed dropped first
MIN_AFFINITY_CHARS = 2 * CHUNK_CHARS  # shorter shared prefixes are not worth skewing the load for
IMBALANCE = 4  # a preferred replica busier than the least loaded by more requests than this is passed over
RETRIES = 2  # a request whose replica died before it sent anything is sent again, this many times at most
HEALTH_TIMEOUT_S = 5.0  # /health: how long the ingress waits for a replica to answer
HEALTH_PERIOD_S = 5.0  # how often Ray checks each replica (a dead engine loop gets the replica replaced)
STATS_PERIOD_S = 2.0  # how often replicas report their metrics snapshot to the routers
INGRESS_MAX_ONGOING = 4096  # HTTP requests the ingress holds at once (engine replicas queue by their own limit)


# -- routing ---------------------------------------------------------------------------------------------
def routing_text(body: Any) -> str:
    """The text a request's prompt starts with, as the prefix table keys it: chat messages role by role
    (so a shared system prompt is a shared prefix), a completion prompt as given, token ids as digits."""
    messages = getattr(body, "messages", None)
    if messages is not None:
        parts = []
        for m in messages:
            content = m.content if isinstance(m.content, str) else "".join(
                p.get("text", "") for p in m.content or [] if isinstance(p, dict))
            parts.append(f"\x00{m.role}\x00{content}")
        return "".join(parts)
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt) + " "
    return ""


def prefix_keys(text: str, chunk: int = CHUNK_CHARS) -> list[bytes]:
    """One key per whole chunk of `text`: key i digests text[:(i + 1) * chunk], chained so each costs one
    chunk of hashing. Equal keys mean equal prefixes (16-byte BLAKE2b)."""
    keys, state = [], b""
    for end in range(chunk, len(text) + 1, chunk):
        state = hashlib.blake2b(state + text[end - chunk:end].encode(), digest_size=16).digest()
        keys.append(state)
    return keys


class PrefixTable:
    """Which replica was last sent each prompt prefix. One LRU over all replicas: a prefix belongs to the
    replica that served it most recently, which is the one whose prefix cache most likely still holds it."""

    def __init__(self, capacity: int = TABLE_KEYS, chunk: int = CHUNK_CHARS) -> None:
        self.capacity, self.chunk = capacity, chunk
        self.owner: OrderedDict[bytes, str] = OrderedDict()

    def record(self, replica: str, text: str) -> None:
        for key in prefix_keys(text, self.chunk):
            self.owner[key] = replica
            self.owner.move_to_end(key)
        while len(self.owner) > self.capacity:
            self.owner.popitem(last=False)

    def match(self, text: str) -> dict[str, int]:
        """Characters of `text`'s prefix each replica was last sent (replicas with none are absent)."""
        matched: dict[str, int] = {}
        for i, key in enumerate(prefix_keys(text, self.chunk)):
            replica = self.owner.get(key)
            if replica is None:
                break  # a longer prefix cannot be known if this one is not
            matched[replica] = (i + 1) * self.chunk
        return matched

    def drop(self, replica: str) -> None:
        for key in [k for k, r in self.owner.items() if r == replica]:
            del self.owner[key]


def preferred(matched: dict[str, int], queue_lens: dict[str, int | None], min_chars: int = MIN_AFFINITY_CHARS,
              imbalance: int = IMBALANCE) -> str | None:
    """The replica to prefer for a request: the one holding its longest known prefix (at least `min_chars`),
    unless it is busier than the least loaded replica by more than `imbalance` requests. Queue lengths not
    known (None) do not count against a replica."""
    known = [q for q in queue_lens.values() if q is not None]
    least = min(known, default=0)
    for replica, chars in sorted(matched.items(), key=lambda kv: -kv[1]):
        if chars < min_chars or replica not in queue_lens:
            continue
        q = queue_lens[replica]
        if q is None or q - least <= imbalance:
            return replica
    return None


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router for EngineReplica: prefix-cache affinity, else the least loaded replica.

    Ranks returned to Ray: [[preferred], all] or [all]; Ray sends the request to the replica with the fewest
    ongoing requests in the first rank that has one below its max_ongoing_requests (so a full preferred
    replica falls through to the least loaded)."""

    def initialize_state(self, min_chars: int = MIN_AFFINITY_CHARS, imbalance: int = IMBALANCE,
                         capacity: int = TABLE_KEYS) -> None:
        self.table = PrefixTable(capacity)
        self.min_chars, self.imbalance = min_chars, imbalance
        # Ray ships a router's module by value, so this module's globals here are copies: register with
        # the module the process imported, where the ingress reads /metrics.
        from specdec.serving import replicas

        replicas._routers.add(self)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        everyone = random.sample(candidate_replicas, len(candidate_replicas))  # ties go to a random replica
        if pending_request is None or not pending_request.args:
            return [everyone]
        text = routing_text(pending_request.args[0])
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        queue_lens = {rid: self.replica_queue_len_cache.get(r.replica_id) for rid, r in by_id.items()}
        choice = preferred(self.table.match(text), queue_lens, self.min_chars, self.imbalance)
        return [[by_id[choice]], everyone] if choice is not None else [everyone]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        if pending_request.args:
            self.table.record(replica_id.unique_id, routing_text(pending_request.args[0]))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.drop(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = {r.unique_id for r in self.curr_replicas} - {r.replica_id.unique_id for r in replicas}
        super().update_replicas(replicas)
        for replica in gone:
            self.table.drop(replica)


_routers: weakref.WeakSet[PrefixAffinityRouter] = weakref.WeakSet()  # this process's, for /metrics


def replica_metrics() -> dict[str, str]:
    """Replica name -> its latest Prometheus text, as this process's routers last heard it."""
    return {rid.unique_id: replica.routing_stats["metrics"] for router in list(_routers)
            for rid, replica in router.curr_replicas.items() if "metrics" in (replica.routing_stats or {})}


# -- the engine replica ----------------------------------------------------------------------------------
class EngineReplica:
    """One engine: what `specdec serve` runs, minus HTTP. The LLM is built on the thread that then runs the
    engine loop (the thread that loaded the model owns the OpenMP team; computing from another one ran ~1.6x
    slower, see specdec.serving.server.serve)."""

    def __init__(self, model: str, llm_kwargs: dict, served_model_name: str | None, threads: int,
                 limits: Limits | None = None) -> None:
        import torch

        from specdec.llm import LLM
        from specdec.serving.server import OpenAIServer

        self.name = serve.get_replica_context().replica_id.unique_id
        self.server: OpenAIServer | None = None
        self.error: BaseException | None = None
        ready = threading.Event()

        def run() -> None:
            try:
                torch.set_num_threads(threads)  # this replica's share of the cores (OpenMP's pool)
                llm = LLM(model, **llm_kwargs)
                self.server = OpenAIServer(llm, served_model_name, limits)
            except BaseException as e:  # noqa: BLE001  re-raised by the constructor, which Ray reports
                self.error = e
                return
            finally:
                ready.set()
            self.server.engine.run()

        threading.Thread(target=run, name="specdec-engine", daemon=True).start()
        ready.wait()
        if self.error is not None:
            raise self.error

    async def generate(self, body: ChatBody | CompletionBody) -> AsyncIterator[Any]:
        """First a head, {"status", "replica", "stream", "body"?}: an error or a whole non-streaming answer
        carries its body; a stream's head is followed by its SSE chunks."""
        head = {"status": 200, "replica": self.name, "stream": bool(body.stream)}
        try:
            plan, req = await self.server.start(body)
        except APIError as e:  # refused (429 carries Retry-After)
            yield head | {"status": e.status, "stream": False, "body": e.body(), "headers": e.headers or {}}
            return
        try:
            if not plan.stream:
                try:
                    answer = await self.server.answer(plan, req)  # cancelled when the client leaves
                except APIError as e:
                    yield head | {"status": e.status, "body": e.body()}
                    return
                yield head | {"body": answer}
                return
            yield head
            async for chunk in self.server.stream(plan, req):
                yield chunk
        finally:
            self.server.engine.abort(req)  # a no-op once finished

    def model_card(self) -> dict:
        return self.server.model_card()

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray polls this every STATS_PERIOD_S and hands it to the routers: the ingress's /metrics."""
        return {"metrics": generate_latest(self.server.metrics.registry).decode()}

    def check_health(self) -> None:
        """Ray calls this periodically; raising gets the replica replaced."""
        engine = self.server.engine
        if not engine.alive:
            raise RuntimeError("the engine loop stopped")
        if not engine.ready and not engine.draining:
            raise RuntimeError(f"the engine loop is stuck in one step for {engine.stuck_for:.0f} s")

    def __del__(self) -> None:
        if self.server is not None:
            self.server.engine.stop(timeout=5)
            self.server.llm.shutdown()


# -- the ingress -----------------------------------------------------------------------------------------
def _replica_gone(e: BaseException) -> bool:
    return isinstance(e, (RayActorError, ActorUnavailableError))


class Ingress:
    """The HTTP side: specdec's own FastAPI surface (api_app), answering through the engine replicas.
    (Wrapped by serve.ingress() where it is deployed, so that this class stays importable: Ray then ships
    it by reference and its methods see this module's state, the routers included.)"""

    async def __init__(self, engines: Any, api_key: str | None, max_request_bytes: int = Limits.max_request_bytes
                       ) -> None:
        self.engines, self.api_key, self.max_request_bytes = engines, api_key, max_request_bytes
        self.card = await self.engines.model_card.remote()  # also starts this process's router

    def __serve_build_asgi_app__(self):
        return api_app(self.generate, self.models, self.healthy, self.metrics, self.api_key,
                       max_request_bytes=self.max_request_bytes, served_model=self.card["id"])

    async def generate(self, body: ChatBody | CompletionBody, request: Request) -> Response:
        for attempt in range(RETRIES + 1):
            replies = self.engines.options(stream=True).generate.remote(body)
            try:
                head = await replies.__anext__()
            except asyncio.CancelledError:  # the client left: so does its request, on the replica too
                replies.cancel()
                raise
            except Exception as e:
                replies.cancel()
                if not _replica_gone(e):
                    raise
                if attempt == RETRIES:
                    raise APIError(503, "no engine replica could take the request; try again",
                                   type="service_unavailable", code="replica_unavailable") from None
                log.warning("a replica died before answering; sending the request again (%s)", type(e).__name__)
                continue
            headers = {"x-specdec-replica": head["replica"]} | head.get("headers", {})
            if "body" in head:
                replies.cancel()
                return JSONResponse(head["body"], status_code=head["status"], headers=headers)
            return StreamingResponse(self.relay(replies), media_type="text/event-stream",
                                     headers=headers | {"Cache-Control": "no-cache"})
        raise AssertionError("unreachable")

    @staticmethod
    async def relay(replies: Any) -> AsyncIterator[str]:
        """A stream's chunks as the replica sends them; the replica's request is cancelled (its blocks freed)
        however the stream ends, client gone included."""
        try:
            async for chunk in replies:
                yield chunk
        except Exception as e:  # the replica died mid-stream: what was sent stays sent; say why it stops
            if not _replica_gone(e):
                raise
            err = APIError(503, "the engine replica serving this stream stopped", type="service_unavailable",
                           code="replica_unavailable")
            yield f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n"
        finally:
            replies.cancel()

    async def models(self) -> dict:
        return self.card

    async def healthy(self) -> bool:
        """Up when a replica answers within HEALTH_TIMEOUT_S (Ray itself replaces replicas that fail)."""
        async def ask() -> dict:
            return await self.engines.model_card.remote()

        try:
            await asyncio.wait_for(ask(), HEALTH_TIMEOUT_S)
            return True
        except Exception:  # noqa: BLE001  any failure is "not healthy"
            return False

    async def metrics(self) -> Response:
        """Every live replica's metrics, each sample labelled with its replica, from the snapshots the replicas
        report to Ray for routing (at most STATS_PERIOD_S old)."""
        registry = CollectorRegistry()
        registry.register(Relabelled(replica_metrics()))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


class Relabelled:
    """A Prometheus collector replaying replicas' exposition text with a `replica` label on every sample."""

    def __init__(self, texts: dict[str, str]) -> None:
        self.texts = texts

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for replica, text in sorted(self.texts.items()):
            for family in text_string_to_metric_families(text):
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                             family.unit))
                into.samples += [s._replace(labels=s.labels | {"replica": replica}) for s in family.samples]
        yield from merged.values()


# -- deployment ------------------------------------------------------------------------------------------
@dataclass
class ReplicaSpec:
    """What `specdec serve --replicas N` deploys."""

    model: str = DEFAULT_MODEL
    llm_kwargs: dict = field(default_factory=dict)  # LLM(model, **llm_kwargs) on every replica
    replicas: int = 2
    served_model_name: str | None = None
    api_key: str | None = None
    cpus_per_replica: float | None = None  # default: this machine's cores shared evenly
    limits: Limits = field(default_factory=Limits)

    def check(self) -> None:
        """Refuse what would fail on every replica before Ray starts (Ray would retry it for a while)."""
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise SpecdecError(f"invalid --replicas {self.replicas!r}: must be a positive integer")
        resolve(self.model)
        kwargs = dict(self.llm_kwargs)
        SpeculativeConfig.parse(kwargs.pop("speculative_config", None))
        for name in ("dtype", "device", "quantization", "tensor_parallel_size"):
            kwargs.pop(name, None)
        from_kwargs(EngineConfig, kwargs)

    def application(self) -> serve.Application:
        cpus = self.cpus_per_replica or max((os.cpu_count() or 1) / self.replicas, 0.01)
        threads = max(1, int(cpus))
        engine = serve.deployment(EngineReplica).options(
            name="EngineReplica", num_replicas=self.replicas, ray_actor_options={"num_cpus": cpus},
            max_ongoing_requests=self.llm_kwargs.get("max_num_seqs", EngineConfig.max_num_seqs),
            health_check_period_s=HEALTH_PERIOD_S,
            request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                                      request_routing_stats_period_s=STATS_PERIOD_S))
        ingress = serve.deployment(serve.ingress()(Ingress)).options(name="Ingress", ray_actor_options={"num_cpus": 0},
                                                    max_ongoing_requests=INGRESS_MAX_ONGOING)
        engines = engine.bind(self.model, self.llm_kwargs, self.served_model_name, threads, self.limits)
        return ingress.bind(engines, self.api_key, self.limits.max_request_bytes)


def build_app(args: dict[str, str]) -> serve.Application:
    """`serve run specdec.serving.replicas:build_app model=... replicas=2 speculative_config='{...}'`: the same
    deployment from a Serve config's args (strings; llm_kwargs as JSON); Serve config fields (num_replicas,
    ray_actor_options, ...) override it per deployment."""
    args = dict(args)
    llm_kwargs = json.loads(args.pop("llm_kwargs", "{}"))
    for name in ("dtype", "device", "quantization", "speculative_config"):
        if name in args:
            llm_kwargs[name] = args.pop(name)
    for name in ("tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens"):
        if name in args:
            llm_kwargs[name] = int(args.pop(name))
    spec = ReplicaSpec(model=args.pop("model", DEFAULT_MODEL), llm_kwargs=llm_kwargs,
                       replicas=int(args.pop("replicas", 2)), served_model_name=args.pop("served_model_name", None),
                       api_key=args.pop("api_key", None))
    if "cpus_per_replica" in args:
        spec.cpus_per_replica = float(args.pop("cpus_per_replica"))
    if args:
        raise SpecdecError(f"unknown arguments {sorted(args)}; expected model, replicas, llm_kwargs, dtype, device, "
                           "quantization, speculative_config, tensor_parallel_size, max_num_seqs, "
                           "max_num_batched_tokens, served_model_name, api_key, cpus_per_replica")
    spec.check()
    return spec.application()


def start(spec: ReplicaSpec, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Deploy `spec` on Ray Serve and return once every replica is up; SpecdecError when they cannot start.
    Joins the Ray cluster RAY_ADDRESS names (`auto`: the one `ray start` began here), else starts a new one
    on this machine (never joins one unasked: two servers here stay apart)."""
    spec.check()
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local", include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(spec.application(), name=APP_NAME, route_prefix="/")
    except RuntimeError as e:  # Ray reports the replicas' failure with their traceback
        serve.delete(APP_NAME)
        last = [line for line in str(e).strip().splitlines() if line.strip()][-1:]
        raise SpecdecError(f"the engine replicas could not start: {last[0] if last else e}") from None


def stop() -> None:
    serve.shutdown()
    ray.shutdown()


def serve_replicas(spec: ReplicaSpec, host: str = "127.0.0.1", port: int = 8000) -> None:
    """`specdec serve --replicas N`: serve in the foreground until interrupted (Ctrl-C or SIGTERM)."""
    import signal

    def interrupt(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    warn_if_exposed(host, spec.api_key)
    try:
        start(spec, host, port)
        print(f"specdec: serving {spec.served_model_name or spec.model!r} on {spec.replicas} replicas at "
              f"http://{host}:{port}/v1", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    finally:
        stop()
