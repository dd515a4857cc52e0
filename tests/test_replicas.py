"""Ray Serve replicas (specdec.serving.replicas): the routing table and policy exactly, then two engine replicas of
a tiny model on a local Ray cluster driven by the official openai client: answers equal offline greedy
decoding, errors pass through in OpenAI's shape, a shared prefix sticks to one replica while load spreads,
/metrics covers every replica, and a killed replica is replaced while the other keeps serving."""
from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import ray
from conftest import save_tiny_model
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.config import SpecdecError
from specdec.serving.api import ChatBody, CompletionBody
from specdec.serving.replicas import (
    APP_NAME,
    CHUNK_CHARS,
    PrefixTable,
    ReplicaSpec,
    build_app,
    preferred,
    prefix_keys,
    routing_text,
)

SPEC = {"method": "ngram", "num_speculative_tokens": 3}
SYSTEM = "You are a terse assistant. The quick brown fox jumps over the lazy dog. " * 6  # 438 characters


# -- the routing table and policy, without Ray ---------------------------------------------------------------
def test_prefix_keys_are_chained_per_whole_chunk():
    text = "a" * (3 * CHUNK_CHARS + 5)
    keys = prefix_keys(text)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert prefix_keys(text[:2 * CHUNK_CHARS]) == keys[:2]  # a prefix's keys are the keys' prefix
    assert prefix_keys("b" + text[1:])[0] != keys[0] and prefix_keys("a" * (CHUNK_CHARS - 1)) == []


def test_the_table_gives_each_replica_its_longest_prefix_and_the_latest_owner_wins():
    table = PrefixTable(chunk=4)
    table.record("A", "abcdefgh-one")
    table.record("B", "abcdXXXX")
    assert table.match("abcdefgh-two") == {"B": 4, "A": 8}  # "abcd" was last sent to B
    assert table.match("zzzzabcd") == {}  # a prefix, not a substring
    table.record("A", "abcd")
    assert table.match("abcdXXXX") == {"A": 4, "B": 8}  # B still holds the longer prefix
    table.drop("A")
    assert table.match("abcdefgh") == {} and len(table.owner) == 1  # only B's "abcdXXXX" key is left


def test_the_table_forgets_the_least_recently_routed_prefixes_first():
    table = PrefixTable(capacity=4, chunk=2)
    table.record("A", "aabbcc")  # 3 keys
    table.record("B", "xxyy")  # 2 more: the oldest key, "aa", goes
    assert len(table.owner) == 4 and table.match("aabbcc") == {} and table.match("xxyy") == {"B": 4}


def test_preferred_takes_the_longest_prefix_unless_that_replica_is_too_busy():
    queues = {"A": 3, "B": 0, "C": None}
    assert preferred({"A": 512, "B": 128}, queues, min_chars=128, imbalance=4) == "A"
    assert preferred({"A": 512, "B": 128}, queues | {"A": 5}, min_chars=128, imbalance=4) == "B"  # 5 - 0 > 4
    assert preferred({"A": 64}, queues, min_chars=128) is None  # too short to be worth it
    assert preferred({"C": 256}, queues, min_chars=128) == "C"  # an unknown queue does not count against it
    assert preferred({"D": 1024}, queues, min_chars=128) is None  # not a candidate (gone)
    assert preferred({}, queues) is None


def test_routing_text_keys_chat_by_role_and_every_prompt_form():
    chat = ChatBody(model="m", messages=[{"role": "system", "content": "S"},
                                         {"role": "user", "content": [{"type": "text", "text": "Q"}]}])
    assert routing_text(chat) == "\x00system\x00S\x00user\x00Q"
    assert routing_text(CompletionBody(model="m", prompt="hello")) == "hello"
    assert routing_text(CompletionBody(model="m", prompt=["hello"])) == "hello"
    assert routing_text(CompletionBody(model="m", prompt=[5, 6, 7])) == "5 6 7 "
    assert routing_text(CompletionBody(model="m", prompt=[[5, 6]])) == "5 6 "
    assert routing_text(SimpleNamespace()) == ""


def test_the_spec_refuses_what_every_replica_would_fail_on(tiny_llama_dir):
    ReplicaSpec(str(tiny_llama_dir), {"speculative_config": json.dumps(SPEC), "max_num_seqs": 4}).check()
    with pytest.raises(SpecdecError, match="replicas"):
        ReplicaSpec(str(tiny_llama_dir), replicas=0).check()
    with pytest.raises(SpecdecError):
        ReplicaSpec("/no/such/model").check()
    with pytest.raises(SpecdecError, match="method"):
        ReplicaSpec(str(tiny_llama_dir), {"speculative_config": '{"method": "telepathy"}'}).check()
    with pytest.raises(SpecdecError, match="max_num_seqs"):
        ReplicaSpec(str(tiny_llama_dir), {"max_num_seqs": 0}).check()
    with pytest.raises(SpecdecError, match="unknown arguments"):
        build_app({"model": str(tiny_llama_dir), "replica": "2"})


def test_cli_serve_replicas_deploys_the_spec_it_is_asked_for(tiny_llama_dir, monkeypatch):
    import specdec.serving.replicas

    calls = []
    monkeypatch.setattr(specdec.serving.replicas, "serve_replicas", lambda spec, **kw: calls.append((spec, kw)))
    assert main(["serve", str(tiny_llama_dir), "--replicas", "3", "--port", "9002", "--max-num-seqs", "8",
                 "--speculative-config", json.dumps(SPEC), "--served-model-name", "m", "--api-key", "k"]) == 0
    spec, kw = calls[-1]
    assert (spec.model, spec.replicas, spec.served_model_name, spec.api_key) == (str(tiny_llama_dir), 3, "m", "k")
    assert spec.llm_kwargs["max_num_seqs"] == 8 and json.loads(spec.llm_kwargs["speculative_config"]) == SPEC
    assert kw == {"host": "127.0.0.1", "port": 9002}


# -- two replicas on a local Ray cluster ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def replica_model_dir(tmp_path_factory) -> Path:
    """A small model that still takes seconds for 4000 tokens (8 layers, 4096 positions): a request a client
    leaves is surely still running when the leaving reaches the replica, however loaded the machine is."""
    return save_tiny_model(tmp_path_factory.mktemp("replica_model"), "llama", hidden_size=256, intermediate_size=768,
                           num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                           max_position_embeddings=4096)


@pytest.fixture(scope="module")
def cluster(replica_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=128 * 2**20)
    from specdec.serving import replicas

    spec = ReplicaSpec(str(replica_model_dir), {"speculative_config": json.dumps(SPEC), "max_num_seqs": 8},
                       replicas=2, served_model_name="tiny")
    try:
        replicas.start(spec, port=port)
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}",
                              client=openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                                   max_retries=0, timeout=60))
    finally:
        replicas.stop()


@pytest.fixture(scope="module")
def offline(replica_model_dir):
    return LLM(str(replica_model_dir), speculative_config="off")


def chat(cluster, messages, **kw):
    raw = cluster.client.chat.completions.with_raw_response.create(model="tiny", messages=messages, temperature=0,
                                                                   **kw)
    return raw.headers["x-specdec-replica"], raw.parse()


def replica_metrics(cluster) -> dict[str, dict[str, float]]:
    """replica -> {sample name with labels: value} from the ingress's /metrics."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(cluster.url + "/metrics", timeout=10).text):
        for s in family.samples:
            labels = dict(s.labels)
            replica = labels.pop("replica")
            key = s.name + (json.dumps(labels, sort_keys=True) if labels else "")
            out.setdefault(replica, {})[key] = s.value
    return out


def test_replicas_answer_the_openai_client_as_offline_greedy_decoding_does(cluster, offline):
    messages = [{"role": "user", "content": "1 2 3 4 1 2 3 4 1 2"}]
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=24))[0]
    _, got = chat(cluster, messages, max_tokens=24)
    assert got.choices[0].message.content == want.text and got.usage.completion_tokens == len(want.token_ids)
    streamed = cluster.client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=24,
                                                      stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want.text
    ids = offline.encode("Hello world, speculative decoding")[1]
    want = offline.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=16))[0]
    got = cluster.client.completions.create(model="tiny", prompt=ids, temperature=0, max_tokens=16)
    assert got.choices[0].text == want.text

    with pytest.raises(openai.BadRequestError, match=r"temperature=5.0: must be in \[0, 2\]"):
        cluster.client.chat.completions.create(model="tiny", messages=messages, temperature=5.0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        cluster.client.chat.completions.create(model="other", messages=messages)
    r = httpx.post(cluster.url + "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert [m.id for m in cluster.client.models.list()] == ["tiny"]
    assert httpx.get(cluster.url + "/health").status_code == 200


def test_a_shared_prefix_sticks_to_one_replica_while_load_spreads(cluster):
    homes = {chat(cluster, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}],
                  max_tokens=4)[0] for i in range(4)}
    assert len(homes) == 1

    def distinct(i: int) -> str:  # short prompts: no prefix worth following, so the least loaded replica
        return chat(cluster, [{"role": "user", "content": f"{i} 1 2 3"}], max_tokens=48)[0]

    with ThreadPoolExecutor(8) as pool:
        assert len(set(pool.map(distinct, range(16)))) == 2


def test_metrics_cover_every_replica(cluster):
    chat(cluster, [{"role": "user", "content": "count the metrics"}], max_tokens=4)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # replicas report every STATS_PERIOD_S
        per_replica = replica_metrics(cluster)
        finished = sum(v for m in per_replica.values() for k, v in m.items() if k.startswith("specdec_requests_total"))
        if len(per_replica) == 2 and finished >= 1:
            break
        time.sleep(1)
    assert len(per_replica) == 2 and finished >= 1
    assert all("specdec_kv_blocks_total" in m for m in per_replica.values())


def test_clients_that_leave_free_their_requests_on_the_replicas(cluster):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 4000,
            "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # not streamed: gone before the answer
        httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=0.05))
    with httpx.stream("POST", cluster.url + "/v1/chat/completions", json=body | {"stream": True}, timeout=10) as r:
        next(r.iter_lines())  # streamed: gone after the first chunk
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the aborts reach the replicas' metrics within STATS_PERIOD_S
        per_replica = replica_metrics(cluster)
        aborted = sum(m.get('specdec_requests_total{"finish_reason": "abort"}', 0) for m in per_replica.values())
        running = sum(m.get("specdec_requests_running", 0) for m in per_replica.values())
        if aborted >= 2 and running == 0:
            break
        time.sleep(0.5)
    assert aborted >= 2 and running == 0


def test_a_killed_replica_is_replaced_while_the_other_keeps_serving(cluster):
    before = {name for name, _ in (chat(cluster, [{"role": "user", "content": f"{i} before"}], max_tokens=2)
                                   for i in range(6))} | set(replica_metrics(cluster))
    assert len(before) == 2
    victim = sorted(before)[0]
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#EngineReplica#{victim}", namespace="serve"), no_restart=True)
    served_by = [chat(cluster, [{"role": "user", "content": f"{i} after"}], max_tokens=8)[0] for i in range(6)]
    assert victim not in served_by  # every request answered, none by the dead replica

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = serve.status().applications[APP_NAME].deployments["EngineReplica"]
        live = set(replica_metrics(cluster))
        if status.replica_states.get("RUNNING") == 2 and len(live - before) == 1:
            break
        time.sleep(1)
    assert status.replica_states.get("RUNNING") == 2 and victim not in live and len(live - before) == 1
    _, out = chat(cluster, [{"role": "user", "content": "and after the replacement"}], max_tokens=4)
    assert out.choices[0].finish_reason in ("stop", "length")
