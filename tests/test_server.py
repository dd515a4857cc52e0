"""`specdec serve`: a real uvicorn server in a thread, driven by the official openai client and httpx.

Greedy answers must equal offline `LLM.generate` / `LLM.chat` on a separate LLM, streamed or not, with
and without speculation; bad input gets OpenAI-shaped errors naming the field; cancelled and failed
requests leak no KV blocks and do not disturb the others.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from conftest import every_step
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from specdec import LLM, SamplingParams, SpecdecError
from specdec.cli import main
from specdec.serving.admin import Admin, head_path
from specdec.serving.api import APIError, Limits, warn_if_exposed
from specdec.serving.openai_format import streamable_length
from specdec.serving.server import create_app

MODEL = "tiny"
SPEC = {"method": "ngram", "num_speculative_tokens": 4}
CHAT = [{"role": "user", "content": "Hello world, 1 2 3 1 2 3"}]
REPETITIVE = "1 2 3 4 1 2 3 4 1 2 3 4 1 2"  # gives the n-gram drafter something to match


@dataclass
class Served:
    url: str
    llm: LLM
    app: FastAPI

    def client(self, api_key: str = "unused", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, **kw)

    def post(self, path: str, body: dict | str, **kw) -> httpx.Response:
        if isinstance(body, dict):
            return httpx.post(f"{self.url}{path}", json=body, timeout=30, **kw)
        return httpx.post(f"{self.url}{path}", content=body, headers={"content-type": "application/json"},
                          timeout=30, **kw)

    def metrics(self) -> dict[str, float]:
        """Every sample as 'name{label="v"}' -> value."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Metrics once nothing runs or waits and only the prefix cache holds blocks (or the timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["specdec_requests_running"] == 0 and m["specdec_requests_waiting"] == 0
            if (idle and m["specdec_kv_blocks_used"] == m["specdec_kv_blocks_cached"]) or time.monotonic() > deadline:
                return m
            time.sleep(0.02)


@contextlib.contextmanager
def serving(llm: LLM, **app_kwargs) -> Iterator[Served]:
    app = create_app(llm, **app_kwargs)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield Served(f"http://127.0.0.1:{port}", llm, app)
    finally:
        server.should_exit = True
        thread.join(15)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def plain(tiny_llama_dir) -> Iterator[Served]:
    with serving(LLM(str(tiny_llama_dir), speculative_config="off"), served_model_name=MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def spec(tiny_llama_dir) -> Iterator[Served]:
    with serving(LLM(str(tiny_llama_dir), speculative_config=every_step(SPEC)), served_model_name=MODEL) as s:
        yield s


@pytest.fixture(params=["plain", "spec"])
def served(request) -> Served:
    return request.getfixturevalue(request.param)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


# -- answers equal offline generation ----------------------------------------------------------------------
def test_chat_equals_offline_streamed_or_not(served, offline):
    expected = offline.chat(CHAT, greedy(20))[0]
    client = served.client()
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-") and resp.model == MODEL
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == "length"
    usage = resp.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(expected.prompt_token_ids), 20)
    assert usage.total_tokens == usage.prompt_tokens + 20
    extra = usage.model_extra
    assert {"acceptance_length", "num_drafts", "num_draft_tokens", "num_accepted_tokens"} <= set(extra)
    assert extra["acceptance_length"] >= 1

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0,
                                                 extra_body={"ignore_eos": True}, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == expected.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.model_extra["num_drafts"] == extra["num_drafts"]


SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 10},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["word", "count"], "additionalProperties": False}


def test_structured_output_through_the_openai_client_streamed_or_not(served, offline):
    """response_format json_schema (strict), streamed and not, and a vLLM-style guided_choice: the same text as
    the offline engine under the same constraint, valid for it."""
    from jsonschema import validate

    expected = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=60, structured_output={"json": SCHEMA}))[0]
    validate(json.loads(expected.text), SCHEMA)
    client = served.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "tally", "schema": SCHEMA, "strict": True}}
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60, temperature=0,
                                          response_format=fmt)
    assert resp.choices[0].message.content == expected.text and resp.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60, temperature=0,
                                                 response_format=fmt, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    choice = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0.9, seed=3,
                                            extra_body={"guided_choice": ["red", "green", "blue"]})
    assert choice.choices[0].message.content in ("red", "green", "blue")
    anything = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60, temperature=0,
                                              response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    m = served.wait_idle()
    assert m["specdec_kv_blocks_used"] == m["specdec_kv_blocks_cached"]


def test_completions_equal_offline_for_every_prompt_form(served, offline):
    expected = offline.generate(REPETITIVE, greedy(24))[0]
    client = served.client()
    for prompt in (REPETITIVE, [REPETITIVE], expected.prompt_token_ids):
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
        assert resp.choices[0].text == expected.text and resp.choices[0].finish_reason == "length"
        assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    chunks = list(client.completions.create(model=MODEL, prompt=REPETITIVE, max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True}, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


def test_speculation_is_reported_in_usage(spec):
    resp = spec.client().completions.create(model=MODEL, prompt=REPETITIVE, max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True})
    u = resp.usage.model_extra
    assert u["num_drafts"] > 0 and u["num_draft_tokens"] >= u["num_accepted_tokens"] >= 0
    assert u["acceptance_length"] == pytest.approx(24 / (24 - u["num_accepted_tokens"]))


def test_default_max_tokens_runs_to_the_context(plain):
    resp = plain.post("/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "temperature": 0,
                                          "ignore_eos": True})
    assert resp.status_code == 200
    assert resp.json()["usage"]["completion_tokens"] == plain.llm.engine.max_model_len - 3


# -- stop strings ------------------------------------------------------------------------------------------
def test_streamable_length_holds_back_stop_prefixes_and_partial_utf8():
    assert streamable_length("hello wor", ["world"]) == len("hello ")
    assert streamable_length("hello wo", ["xx", "wor"]) == len("hello ")
    assert streamable_length("hello", ["lo!", "llo?"]) == len("he")
    assert streamable_length("hello", ["abc"]) == 5
    assert streamable_length("caf\ufffd", []) == 3
    assert streamable_length("ab\ufffd", ["bz"]) == 1
    assert streamable_length("", ["a"]) == 0


def test_stop_strings_never_leak_into_the_stream(served, offline):
    free = offline.generate(REPETITIVE, greedy(30))[0].text
    cuts = [i for i in range(4, len(free) - 3) if free[i:i + 3].strip() and "\ufffd" not in free[i:i + 3]]
    assert cuts, f"the test needs printable text from the tiny model, got {free!r}"
    stop = free[cuts[len(cuts) // 2]:][:3]
    expected = free[:free.find(stop)]
    stream = served.client().completions.create(model=MODEL, prompt=REPETITIVE, max_tokens=30, temperature=0,
                                                stop=[stop, "\x00never"], extra_body={"ignore_eos": True},
                                                stream=True)
    text, finish = "", None
    for c in stream:
        text += c.choices[0].text
        finish = c.choices[0].finish_reason or finish
        assert stop not in text
        assert expected.startswith(text)  # nothing past the stop string, even for a moment
    assert text == expected and finish == "stop"


# -- concurrency and cancellation --------------------------------------------------------------------------
def test_concurrent_streams_with_cancellations_leak_nothing(spec, offline):
    n = 12
    cancel = {2, 5, 9}
    prompts = [f"Hello world {i} " + REPETITIVE[: 4 + i] for i in range(n)]

    def body(i: int) -> dict:
        b = {"model": MODEL, "prompt": prompts[i], "max_tokens": 400 if i in cancel else 6 + 3 * i,
             "ignore_eos": True, "stream": True, "temperature": 0}
        if i % 3 == 1:
            b.update(temperature=0.8, seed=1000 + i)
        elif i % 3 == 2:
            b.update(temperature=0.8, top_p=0.9, top_k=50, seed=2000 + i)
        return b

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, str | None] | None:
        async with client.stream("POST", f"{spec.url}/v1/completions", json=body(i)) as r:
            assert r.status_code == 200
            text, finish, chunks = "", None, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return text, finish
                choice = json.loads(line[6:])["choices"][0]
                text, finish, chunks = text + choice["text"], choice["finish_reason"], chunks + 1
                if i in cancel and chunks == 3:
                    return None  # leaving the block closes the connection mid-stream
        raise AssertionError("stream ended without [DONE]")

    async def run_all() -> list:
        limits = httpx.Limits(max_connections=n + 2)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    aborts_before = spec.metrics()['specdec_requests_total{finish_reason="abort"}']
    results = asyncio.run(run_all())
    for i, result in enumerate(results):
        if i in cancel:
            assert result is None
            continue
        text, finish = result
        assert finish == "length"
        if i % 3 == 0:
            assert text == offline.generate(prompts[i], greedy(6 + 3 * i))[0].text, i
    # A seeded sampled request repeats exactly when sent again, alone.
    for i in (4, 8):
        again = spec.post("/v1/completions", body(i) | {"stream": False}).json()["choices"][0]["text"]
        assert again == results[i][0]
    m = spec.wait_idle()
    assert m["specdec_kv_blocks_used"] == m["specdec_kv_blocks_cached"]  # no blocks leaked
    assert m['specdec_requests_total{finish_reason="abort"}'] - aborts_before == len(cancel)


@contextlib.contextmanager
def steps_held_until_abort(s: Served, monkeypatch) -> Iterator[None]:
    """No engine step finishes before the server queued an abort (it saw the client leave), so a request that
    is left can never end on its own first."""
    measuring, served, gate = s.llm.measuring, s.app.state.server.engine, threading.Event()
    queue_abort = served.abort

    def abort_then_resume(req):
        queue_abort(req)
        gate.set()

    monkeypatch.setattr(served, "abort", abort_then_resume)
    measuring.inject_fault(lambda seqs: gate.wait(10))
    try:
        yield
    finally:
        measuring.inject_fault(None)
        gate.set()


def test_non_streaming_client_that_leaves_is_aborted(plain, monkeypatch):
    before = plain.metrics()['specdec_requests_total{finish_reason="abort"}']
    with steps_held_until_abort(plain, monkeypatch), pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{plain.url}/v1/completions", timeout=0.3,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 500, "ignore_eos": True})
    m = plain.wait_idle()
    assert m['specdec_requests_total{finish_reason="abort"}'] == before + 1
    assert m["specdec_kv_blocks_used"] == m["specdec_kv_blocks_cached"]


# -- errors ------------------------------------------------------------------------------------------------
OK_CHAT = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
OK_COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


def test_fields_we_do_not_use_but_that_change_nothing_are_accepted(plain):
    body = OK_CHAT | {"logprobs": False, "frequency_penalty": 0, "response_format": {"type": "text"}, "user": "u1",
                      "metadata": {"a": "b"}, "tools": [], "parallel_tool_calls": False}
    assert plain.post("/v1/chat/completions", body).status_code == 200


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/chat/completions", '{"model": "tiny", "messages": [', 400, None),
    ("/v1/chat/completions", "[1, 2]", 400, None),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2}, 400, "messages"),
    ("/v1/chat/completions", OK_CHAT | {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", OK_CHAT | {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", OK_CHAT | {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT}, 400, "model"),
    ("/v1/chat/completions", OK_CHAT | {"model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", OK_CHAT | {"temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", OK_CHAT | {"temperature": 2.5}, 400, "temperature"),
    ("/v1/chat/completions", OK_CHAT | {"temperature": -0.1}, 400, "temperature"),
    ("/v1/chat/completions", OK_CHAT | {"top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", OK_CHAT | {"top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", OK_CHAT | {"top_k": -2}, 400, "top_k"),
    ("/v1/chat/completions", OK_CHAT | {"min_p": 1.5}, 400, "min_p"),
    ("/v1/chat/completions", OK_CHAT | {"n": 17}, 400, "n"),
    ("/v1/chat/completions", OK_CHAT | {"n": 0}, 400, "n"),
    ("/v1/completions", OK_COMPLETION | {"prompt": ["a", "b", "c", "d", "e"], "n": 4}, 400, "n"),
    ("/v1/chat/completions", OK_CHAT | {"max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", OK_CHAT | {"max_tokens": None, "max_completion_tokens": -1}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", OK_CHAT | {"max_tokens": 510}, 400, "max_tokens"),
    ("/v1/chat/completions", OK_CHAT | {"stop": [""]}, 400, "stop"),
    ("/v1/chat/completions", OK_CHAT | {"seed": "x"}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", OK_COMPLETION | {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", OK_COMPLETION | {"prompt": ["a", ""]}, 400, "prompt"),
    ("/v1/completions", OK_COMPLETION | {"prompt": list(range(5, 605))}, 400, "prompt"),
    ("/v1/completions", OK_COMPLETION | {"prompt": list(range(5, 605)), "stream": True}, 400, "prompt"),
    ("/v1/completions", OK_COMPLETION | {"prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", OK_COMPLETION | {"max_tokens": 1000}, 400, "max_tokens"),
    ("/v1/completions", OK_COMPLETION | {"max_tokens": 1000, "stream": True}, 400, "max_tokens"),
    ("/v1/chat/completions", OK_CHAT | {"response_format": {"type": "yaml"}}, 400, "response_format"),
    ("/v1/chat/completions", OK_CHAT | {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     400, "response_format.json_schema.schema"),
    ("/v1/chat/completions", OK_CHAT | {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, 400,
     "response_format"),
    ("/v1/chat/completions", OK_CHAT | {"guided_regex": "[a-"}, 400, "guided_regex"),
    ("/v1/chat/completions", OK_CHAT | {"guided_grammar": "root ::= (("}, 400, "guided_grammar"),
    ("/v1/chat/completions", OK_CHAT | {"guided_choice": []}, 400, "guided_choice"),
    ("/v1/chat/completions", OK_CHAT | {"guided_json": "{not json"}, 400, "guided_json"),
    ("/v1/chat/completions", OK_CHAT | {"guided_json": {"type": "array", "uniqueItems": True}}, 400, "guided_json"),
    ("/v1/chat/completions", OK_CHAT | {"guided_regex": "a", "guided_choice": ["a"]}, 400, "guided_choice"),
    ("/v1/chat/completions", OK_CHAT | {"structured_outputs": {"regex": "a", "choice": ["a"]}}, 400,
     "structured_outputs"),
    # tools: malformed, unknown or unenforceable (each a 400 naming its field)
    ("/v1/chat/completions", OK_CHAT | {"tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", OK_CHAT | {"tools": [{"type": "function", "function": {"name": "a b"}}]}, 400, "tools"),
    ("/v1/chat/completions", OK_CHAT | {"tools": [TOOL, TOOL]}, 400, "tools"),
    ("/v1/chat/completions", OK_CHAT | {"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
     400, "tools"),
    ("/v1/chat/completions", OK_CHAT | {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "not": {"type": "string"}}}}]}, 400, "tools"),
    ("/v1/chat/completions",
     OK_CHAT | {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     400, "tool_choice"),
    ("/v1/chat/completions", OK_CHAT | {"tools": [TOOL], "tool_choice": "sometimes"}, 400, "tool_choice"),
    ("/v1/chat/completions", OK_CHAT | {"tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", OK_CHAT | {"tools": [TOOL], "tool_choice": "required",
                                        "response_format": {"type": "json_object"}}, 400, "tool_choice"),
    ("/v1/chat/completions", OK_CHAT | {"functions": [{"name": "f"}]}, 400, "functions"),
    ("/v1/chat/completions", OK_CHAT | {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f",
        "arguments": "{not json"}}]}]}, 400, "messages"),
    ("/v1/chat/completions", OK_CHAT | {"frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ("/v1/chat/completions", OK_CHAT | {"presence_penalty": -3}, 400, "presence_penalty"),
    ("/v1/chat/completions", OK_CHAT | {"repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/chat/completions", OK_CHAT | {"logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/chat/completions", OK_CHAT | {"logit_bias": {"hello": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", OK_CHAT | {"logit_bias": {"100000": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", OK_CHAT | {"logit_bias": {"5": "x"}}, 400, "logit_bias"),
    ("/v1/chat/completions", OK_CHAT | {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", OK_CHAT | {"top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/completions", OK_COMPLETION | {"logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", OK_COMPLETION | {"max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", OK_COMPLETION | {"best_of": 3}, 400, "best_of"),
    ("/v1/completions", OK_COMPLETION | {"suffix": "x"}, 400, "suffix"),
    ("/v1/completions", OK_COMPLETION | {"skip_special_tokens": False}, 400, "skip_special_tokens"),
    ("/v1/completions", OK_COMPLETION | {"stop_token_ids": [100000]}, 400, "stop_token_ids"),
    ("/v1/completions", OK_COMPLETION | {"stop_token_ids": list(range(17))}, 400, "stop_token_ids"),
    ("/v1/chat/completions", OK_CHAT | {"record": "no"}, 400, "record"),
    # issue 18: input the edge refuses, each naming its field
    ("/v1/chat/completions", OK_CHAT | {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", json.dumps(OK_CHAT | {"messages": [{"role": "user", "content": "a\ud800"}]}), 400,
     "messages"),
    ("/v1/completions", json.dumps(OK_COMPLETION | {"prompt": "x\udfff"}), 400, "prompt"),
    ("/v1/chat/completions", json.dumps(OK_CHAT | {"stop": ["\ud800"]}), 400, "stop"),
    ("/v1/chat/completions", OK_CHAT | {"stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ("/v1/chat/completions", OK_CHAT | {"stop": ["x" * 257]}, 400, "stop"),
    ("/v1/completions", OK_COMPLETION | {"prompt": "a" * 400_000}, 400, "prompt"),
    ("/v1/chat/completions", OK_CHAT | {"messages": [{"role": "user", "content": "a" * 400_000}]}, 400, "messages"),
    ("/v1/chat/completions", OK_CHAT | {"guided_json": {"type": "array", "items": json.loads("[" * 80 + "]" * 80)}},
     400, "guided_json"),
])
def test_bad_requests_get_openai_errors_naming_the_field(plain, path, body, status, param):
    resp = plain.post(path, body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if param is not None:
        assert param in err["message"]
    if status == 404:
        assert err["code"] == "model_not_found"


def test_a_seed_gives_the_same_choices_with_speculation_on_or_off(plain, spec):
    """The OpenAI `seed` with n = 3 sampled choices: the server that drafts (n-gram) answers every choice with the
    text the plain server gives, streamed or not, chat and completions."""
    kw = dict(model=MODEL, max_tokens=24, temperature=0.8, top_p=0.95, seed=11, n=3)
    for create, extra in ((lambda c, **k: c.chat.completions.create(messages=CHAT, **k), {}),
                          (lambda c, **k: c.completions.create(prompt=REPETITIVE, **k), {"frequency_penalty": 0.3})):
        answers = []
        for served in (plain, spec):
            whole = create(served.client(), **kw, **extra)
            texts = [c.message.content if hasattr(c, "message") else c.text for c in whole.choices]
            streamed = ["", "", ""]
            for chunk in create(served.client(), **kw, **extra, stream=True):
                for c in chunk.choices:
                    streamed[c.index] += (c.delta.content or "") if hasattr(c, "delta") else (c.text or "")
            assert streamed == texts
            answers.append(texts)
        assert answers[0] == answers[1] and len(set(answers[0])) > 1, answers  # the same, and 3 different choices
    assert spec.metrics()["specdec_spec_draft_tokens_total"] > 0


def test_penalties_and_logit_bias_through_the_openai_client(served, offline):
    """The fields ordinary apps send, streamed and not, with speculation or without: the server answers what the
    offline engine generates under the same penalties; a logit_bias of -100 bans a token, +100 forces it."""
    client = served.client()
    first = offline.generate(REPETITIVE, SamplingParams(temperature=0, max_tokens=1))[0].token_ids[0]
    forced = client.completions.create(model=MODEL, prompt=REPETITIVE, max_tokens=4, temperature=0,
                                       logit_bias={str(first + 1): 100})
    assert forced.choices[0].text == offline.engine.decode([first + 1] * 4)
    cases = [{"logit_bias": {first: -100.0}},
             {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3}]
    for penalties in cases:
        want = offline.generate(REPETITIVE, SamplingParams(temperature=0, max_tokens=8, **penalties))[0]
        assert first not in want.token_ids[:1] or "logit_bias" not in penalties
        body = dict(model=MODEL, prompt=REPETITIVE, max_tokens=8, temperature=0,
                    logit_bias={str(t): b for t, b in penalties.get("logit_bias", {}).items()} or None,
                    presence_penalty=penalties.get("presence_penalty"),
                    frequency_penalty=penalties.get("frequency_penalty"),
                    extra_body={"repetition_penalty": penalties.get("repetition_penalty", 1.0)})
        assert client.completions.create(**body).choices[0].text == want.text
        streamed = client.completions.create(**body, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want.text


def test_logprobs_through_the_openai_client(served, offline):
    """Chat `logprobs`/`top_logprobs` and completions `logprobs`, streamed and not, with speculation or without: the
    values the offline engine computes for the same tokens, in OpenAI's two shapes."""
    client = served.client()
    want = offline.generate(REPETITIVE, SamplingParams(temperature=0, max_tokens=8, logprobs=2))[0].logprobs
    done = client.completions.create(model=MODEL, prompt=REPETITIVE, max_tokens=8, temperature=0, logprobs=2)
    lp = done.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want], abs=1e-5)
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == done.usage.completion_tokens
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    chunks = [c for c in client.completions.create(model=MODEL, prompt=REPETITIVE, max_tokens=8, temperature=0,
                                                   logprobs=2, stream=True) if c.choices]
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert [v for x in streamed for v in x.token_logprobs] == lp.token_logprobs
    assert [v for x in streamed for v in x.text_offset] == lp.text_offset

    ref = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=8, logprobs=3))[0].logprobs
    chat = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    content = client.chat.completions.create(**chat).choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx([e.logprob for e in ref], abs=1e-5)
    for e, r in zip(content, ref):
        assert [t.logprob for t in e.top_logprobs] == pytest.approx([v for _, v in r.top], abs=1e-5)
        assert e.bytes == list(e.token.encode())
    streamed = [e for c in client.chat.completions.create(**chat, stream=True) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain_answer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    assert plain_answer.choices[0].logprobs is None


def test_documented_fields_are_accepted_and_errors_leak_nothing(plain):
    body = OK_CHAT | {"frequency_penalty": 0, "user": "u", "logit_bias": {}, "stream_options": None, "store": False,
                      "service_tier": "auto", "metadata": {"a": "b"}, "prediction": {"type": "content", "content": "x"},
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "x"}]}
    assert plain.post("/v1/chat/completions", body).status_code == 200
    assert plain.post("/v1/completions", OK_COMPLETION | {"user": "u", "skip_special_tokens": True}).status_code == 200
    m = plain.wait_idle()
    assert m["specdec_kv_blocks_used"] == m["specdec_kv_blocks_cached"]
    assert plain.post("/v1/nope", {}).json()["error"]["message"]  # unknown routes also answer in OpenAI shape


ASK = [{"role": "user", "content": "Hi"}]
# every endpoint that takes a body: a body it answers 200, with documented fields it accepts and ignores
ENDPOINTS = [("/v1/chat/completions", OK_CHAT | {"reasoning_effort": "low", "web_search_options": {}}),
             ("/v1/completions", OK_COMPLETION | {"user": "u"}),
             ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "user": "u",
                                "prompt_cache_key": "k", "service_tier": "auto"}),
             ("/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": ASK, "metadata": {"user_id": "u"},
                               "service_tier": "auto"}),
             ("/v1/messages/count_tokens", {"model": MODEL, "messages": ASK, "cache_control": {"type": "ephemeral"}}),
             ("/tokenize", {"prompt": "Hello"}), ("/detokenize", {"tokens": [5, 6]})]


@pytest.mark.parametrize("path, body", ENDPOINTS)
def test_unknown_fields_are_refused_naming_them(plain, path, body):
    """A field no endpoint knows is a 400 naming it, in OpenAI's words and shape (Anthropic's shape under
    /v1/messages); the same body without it is answered."""
    assert plain.post(path, body).status_code == 200
    for unknown in ("frobnicate", "guided_decoding_backend", "max_output_tokens" if "/messages" in path else "top_n"):
        resp = plain.post(path, body | {unknown: 1})
        assert resp.status_code == 400, resp.text
        message = f"Unrecognized request argument supplied: {unknown}"
        if path.startswith("/v1/messages"):
            assert resp.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
        else:
            assert resp.json() == {"error": {"message": message, "type": "invalid_request_error", "param": unknown,
                                             "code": None}}


def test_unknown_fields_inside_nested_objects_are_refused_by_their_path(plain):
    """A typo inside stream_options or a message is a 400 naming its path, as at the top; what OpenAI's SDK writes back
    when a client resends an answer's message whole (refusal, annotations, audio) is accepted and ignored."""
    stream = OK_CHAT | {"stream": True, "stream_options": {"include_usage": True}}
    cases = {"stream_options.include_usge": stream | {"stream_options": {"include_usge": True}},
             "messages[0].contnet": OK_CHAT | {"messages": [{"role": "user", "contnet": "Hi"}]},
             "messages[1].tool_call": OK_CHAT | {"messages": [*CHAT, {"role": "assistant", "content": "Hi",
                                                                   "tool_call": []}]}}
    for path, body in cases.items():
        resp = plain.post("/v1/chat/completions", body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"] == {"message": f"Unrecognized request argument supplied: {path}",
                                        "type": "invalid_request_error", "param": path, "code": None}
    resent = {"role": "assistant", "content": "Hi", "refusal": None, "annotations": [], "audio": None}
    assert plain.post("/v1/chat/completions", OK_CHAT | {"messages": [*CHAT, resent, *CHAT]}).status_code == 200
    assert plain.post("/tokenize", {"messages": [{"role": "user", "contnet": "Hi"}]}).status_code == 400


def test_allow_unknown_fields_accepts_and_ignores_them(tiny_llama_dir):
    limits = Limits(allow_unknown_fields=True)
    with serving(LLM(str(tiny_llama_dir)), served_model_name=MODEL, limits=limits) as s:
        for path, body in ENDPOINTS:
            resp = s.post(path, body | {"frobnicate": 1, "guided_decoding_backend": "x"})
            assert resp.status_code == 200, (path, resp.text)
        nested = OK_CHAT | {"messages": [{"role": "user", "content": "Hi", "contnet": "x"}],
                            "stream": True, "stream_options": {"include_usage": True, "include_usge": True}}
        assert s.post("/v1/chat/completions", nested).status_code == 200
        resp = s.post("/v1/chat/completions", OK_CHAT | {"suffix": "x"})  # known elsewhere, refused as before
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "suffix"


def test_stop_token_ids_end_a_choice(plain, offline):
    ids = offline.generate(REPETITIVE, greedy(6))[0].token_ids
    want = offline.generate(REPETITIVE, greedy(6, stop_token_ids=[ids[-1]]))[0]
    assert want.finish_reason == "stop" and want.token_ids == ids[:ids.index(ids[-1]) + 1]
    body = {"model": MODEL, "prompt": REPETITIVE, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stop_token_ids": [ids[-1]]}
    choice = plain.post("/v1/completions", body).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (want.text, "stop")


def test_api_key(tiny_llama_dir):
    with serving(LLM(str(tiny_llama_dir)), served_model_name=MODEL, api_key="sekret") as s:
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong", max_retries=0).models.list()
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            resp = s.post("/v1/completions", OK_COMPLETION, headers=headers)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        assert s.post("/v1/completions", OK_COMPLETION, headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert [m.id for m in s.client(api_key="sekret").models.list()] == [MODEL]
        for route in ("/health", "/metrics"):  # every route, not only /v1
            assert httpx.get(s.url + route).status_code == 401
            assert httpx.get(s.url + route, headers={"Authorization": "Bearer sekret"}).status_code == 200


def test_admin_routes_are_off_without_an_admin_key(plain):
    for method in ("GET", "POST", "DELETE"):
        resp = httpx.request(method, plain.url + "/admin/draft", json={"model": "/x"})
        assert resp.status_code == 404 and "--admin-key" in resp.json()["error"]["message"]
        assert resp.json()["error"]["code"] == "admin_off"


def test_admin_routes_have_a_key_of_their_own(tiny_llama_dir, tmp_path):
    """No key 401, the API key alone 403, the admin key 200 (and it opens nothing else); a head outside the allowed
    folders is a 403 before anything is read, one inside reaches the engine (which has no head: 400)."""
    (tmp_path / "heads" / "h").mkdir(parents=True)
    admin = Admin("adm", [tmp_path / "heads"])
    llm = LLM(str(tiny_llama_dir), speculative_config="off")
    with serving(llm, served_model_name=MODEL, api_key="k", admin=admin) as s:
        def draft(key: str | None = None, **body) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            if body:
                return s.post("/admin/draft", body, headers=headers)
            return httpx.get(s.url + "/admin/draft", headers=headers, timeout=10)

        for key, status in ((None, 401), ("wrong", 401), ("k", 403), ("adm", 200)):
            assert draft(key).status_code == status
            assert draft(key, model=str(tmp_path / "heads" / "h")).status_code == (400 if key == "adm" else status)
        assert draft("adm").json() == {"object": "draft_head", "method": None, "model": None}
        assert httpx.get(s.url + "/admin/draft", headers={"x-api-key": "adm"}).status_code == 200
        assert draft("k").json()["error"]["code"] == "admin_key_required"
        assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer adm"}).status_code == 401
        resp = draft("adm", model=str(tmp_path / "heads" / ".." / "elsewhere"))
        assert resp.status_code == 403 and resp.json()["error"]["param"] == "model"
        assert f"is {(tmp_path / 'elsewhere').resolve()}, outside the folders" in resp.json()["error"]["message"]
        assert "--allowed-head-dirs" in resp.json()["error"]["message"]
    with pytest.raises(SpecdecError, match="--admin-key must differ from --api-key"):
        create_app(LLM(str(tiny_llama_dir)), api_key="k", admin=Admin("k"))
    with pytest.raises(SpecdecError, match="no such directory"):
        Admin("adm", [tmp_path / "missing"])


def test_a_head_path_is_resolved_before_it_is_checked(tmp_path):
    """Links and `..` are followed first: a folder, or one file in it, that leads outside the allowed folders is
    refused, naming where it leads; a Hub id goes on to the Hugging Face cache."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    for folder in (allowed / "good", allowed / "leaky", outside / "head"):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    (allowed / "linked").symlink_to(outside / "head")
    (allowed / "leaky" / "model.safetensors").symlink_to(outside / "head" / "config.json")
    roots = [allowed.resolve()]
    assert head_path(str(allowed / "good"), roots) == str((allowed / "good").resolve())
    assert head_path(str(allowed / "good" / "config.json"), roots) == str((allowed / "good" / "config.json").resolve())
    assert head_path(str(allowed / "nowhere"), roots) == str((allowed / "nowhere").resolve())  # the loader says
    assert head_path("someone/some-head", roots) == "someone/some-head"
    for name, leads in ((allowed / "linked", outside / "head"), (allowed / "good" / ".." / ".." / "outside", outside),
                        (allowed / "leaky", outside / "head" / "config.json"), ("/etc/passwd", "/etc/passwd")):
        with pytest.raises(APIError) as refused:
            head_path(str(name), roots)
        assert refused.value.status == 403 and f"is {Path(leads).resolve()}, outside" in refused.value.message


def test_serving_beyond_this_machine_without_an_api_key_is_warned_about(caplog):
    for host, key, warned in (("127.0.0.1", None, False), ("::1", None, False), ("localhost", None, False),
                              ("0.0.0.0", None, True), ("192.168.1.5", None, True), ("myhost", None, True),
                              ("0.0.0.0", "k", False)):
        caplog.clear()
        warn_if_exposed(host, key)
        assert bool(caplog.records) == warned, host
        if warned:
            assert "--api-key" in caplog.text and host in caplog.text


# -- health, models, metrics -------------------------------------------------------------------------------
def test_models_and_health(plain):
    models = httpx.get(f"{plain.url}/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["object"] == "model"
    assert httpx.get(f"{plain.url}/health").status_code == 200


METRIC_NAMES = ["specdec_requests_running", "specdec_requests_waiting", "specdec_kv_blocks_used",
                "specdec_kv_blocks_total", "specdec_prefix_cache_hits_total", "specdec_spec_drafts_total",
                "specdec_spec_draft_tokens_total", "specdec_spec_accepted_tokens_total",
                "specdec_time_to_first_token_seconds_count", "specdec_inter_token_latency_seconds_count",
                'specdec_requests_total{finish_reason="length"}', "specdec_prompt_tokens_total",
                "specdec_generation_tokens_total"]


def test_metrics_follow_the_engine(spec):
    before = spec.metrics()
    assert all(name in before for name in METRIC_NAMES), [n for n in METRIC_NAMES if n not in before]
    assert before["specdec_kv_blocks_total"] == spec.llm.engine.stats()["kv_blocks_total"] > 0
    resp = spec.post("/v1/completions", {"model": MODEL, "prompt": REPETITIVE, "max_tokens": 24,
                                         "temperature": 0, "ignore_eos": True}).json()
    after = spec.wait_idle()
    usage = resp["usage"]
    assert after["specdec_spec_drafts_total"] - before["specdec_spec_drafts_total"] == usage["num_drafts"] > 0
    assert (after["specdec_spec_accepted_tokens_total"] - before["specdec_spec_accepted_tokens_total"]
            == usage["num_accepted_tokens"])
    assert after["specdec_spec_draft_tokens_total"] > before["specdec_spec_draft_tokens_total"]
    per_pos = {k: v for k, v in after.items() if k.startswith("specdec_spec_accepted_per_position_total{")}
    assert 'specdec_spec_accepted_per_position_total{position="1"}' in per_pos
    assert sum(per_pos.values()) == after["specdec_spec_accepted_tokens_total"]  # a chain accepts a prefix
    assert after["specdec_generation_tokens_total"] - before["specdec_generation_tokens_total"] == 24
    assert after["specdec_prompt_tokens_total"] - before["specdec_prompt_tokens_total"] == usage["prompt_tokens"]
    assert after["specdec_time_to_first_token_seconds_count"] == before["specdec_time_to_first_token_seconds_count"] + 1
    # Inter-token latency is recorded per token after the first, however many tokens a step emits.
    assert (after["specdec_inter_token_latency_seconds_count"]
            - before["specdec_inter_token_latency_seconds_count"]) == 23
    assert (after['specdec_requests_total{finish_reason="length"}']
            == before['specdec_requests_total{finish_reason="length"}'] + 1)


# -- faults ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_engine_step_fails_its_request_and_the_server_goes_on(plain, offline, monkeypatch, stream):
    engine = plain.llm.engine
    real_step = engine.step
    calls = []

    def step_failing_on_second_call():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine, "step", step_failing_on_second_call)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    if stream:
        with pytest.raises(openai.APIError, match="boom"):
            for _ in plain.client(max_retries=0).completions.create(
                    model=MODEL, prompt="Hello", max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
                    stream=True):
                pass
    else:
        resp = plain.post("/v1/completions", body)
        assert resp.status_code == 500
        err = resp.json()["error"]
        assert err["type"] == "internal_server_error" and "boom" in err["message"]
    m = plain.wait_idle()
    assert m["specdec_kv_blocks_used"] == m["specdec_kv_blocks_cached"]
    assert httpx.get(f"{plain.url}/health").status_code == 200
    resp = plain.post("/v1/completions", body)
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["text"] == offline.generate("Hello", greedy(8))[0].text


def test_health_reports_a_dead_engine(tiny_llama_dir):
    with serving(LLM(str(tiny_llama_dir)), served_model_name=MODEL) as s:
        assert httpx.get(f"{s.url}/health").status_code == 200
        s.app.state.server.engine.stop()
        assert httpx.get(f"{s.url}/health").status_code == 503
        resp = s.post("/v1/completions", OK_COMPLETION)
        assert resp.status_code == 503 and resp.json()["error"]["message"]


# -- the command line --------------------------------------------------------------------------------------
def test_cli_serve_builds_the_server_it_is_asked_for(tiny_llama_dir, tmp_path, monkeypatch):
    import specdec.serving.server

    calls = []
    monkeypatch.setattr(specdec.serving.server, "serve", lambda llm, **kw: calls.append((llm, kw)))
    assert main(["serve", str(tiny_llama_dir), "--speculative-config", "off"]) == 0
    llm, kw = calls[-1]
    assert llm.engine.speculator is None and kw == {"host": "127.0.0.1", "port": 8000, "api_key": None,
                                                    "served_model_name": None, "limits": Limits(),
                                                    "shutdown_timeout": 30.0, "record_traffic": None, "admin": Admin()}
    assert main(["serve", "--model", str(tiny_llama_dir), "--port", "9001", "--api-key", "k", "--max-num-seqs", "3",
                 "--served-model-name", "m", "--speculative-config", json.dumps(SPEC), "--max-model-len", "256",
                 "--default-max-tokens", "5", "--max-queue", "0", "--request-timeout", "2.5",
                 "--max-request-bytes", "1000", "--shutdown-timeout", "5", "--admin-key", "a",
                 "--allowed-head-dirs", str(tmp_path), str(tiny_llama_dir), "--allow-unknown-fields"]) == 0
    llm, kw = calls[-1]
    assert llm.engine.speculator is not None and llm.engine.cfg.max_num_seqs == 3 and llm.engine.max_model_len == 256
    assert kw == {"host": "127.0.0.1", "port": 9001, "api_key": "k", "served_model_name": "m", "shutdown_timeout": 5.0,
                  "limits": Limits(max_request_bytes=1000, default_max_tokens=5, max_queue=0, request_timeout_s=2.5,
                                   allow_unknown_fields=True),
                  "record_traffic": None, "admin": Admin("a", [str(tmp_path), str(tiny_llama_dir)])}
    assert main(["serve", str(tiny_llama_dir), "--model", "/elsewhere"]) == 2
    for bad in (["--max-num-seqs", "0"], ["--max-queue", "-1"], ["--request-timeout", "0"], ["--max-model-len", "0"],
                ["--admin-key", "a", "--allowed-head-dirs", str(tmp_path / "missing")], ["--admin-key", " "],
                ["--admin-key", "a", "--replicas", "2"]):
        assert main(["serve", str(tiny_llama_dir), *bad]) == 2
    assert len(calls) == 2


def test_incremental_detokenization_equals_decoding_everything(tiny_llama_dir):
    """Streaming decodes a short window per step; the text it builds is the full decode at every step where
    no UTF-8 character is cut (and never shows a half character)."""
    from specdec.engine.outputs import IncrementalText

    tok = LLM(str(tiny_llama_dir)).tokenizer
    ids = tok.encode("héllo wörld 😀 naïve café, déjà vu 🚀🚀 end", add_special_tokens=False)
    inc = IncrementalText(lambda t: tok.decode(t, skip_special_tokens=True))
    for n in range(1, len(ids) + 1):
        text = inc.update(ids[:n])
        full = tok.decode(ids[:n], skip_special_tokens=True)
        assert "\ufffd" not in text and full.startswith(text)
        if not full.endswith("\ufffd"):
            assert text == full
    assert text == tok.decode(ids)


# -- reliability: operator limits, faults, shutdown (issue 18) ---------------------------------------------
def test_developer_messages_are_system_messages(plain, offline):
    def ask(role: str) -> str:
        body = OK_CHAT | {"messages": [{"role": role, "content": "Be brief."}] + CHAT, "max_tokens": 6,
                          "temperature": 0}
        return plain.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]

    assert ask("developer") == ask("system")


def test_bodies_over_the_limit_get_413_before_they_are_read(tiny_llama_dir):
    with serving(LLM(str(tiny_llama_dir)), served_model_name=MODEL, limits=Limits(max_request_bytes=2000)) as s:
        big = json.dumps(OK_COMPLETION | {"prompt": "x" * 3000})
        resp = s.post("/v1/completions", big)  # with a Content-Length
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: refused once the bytes pass the limit
            for i in range(0, len(big), 500):
                yield big[i:i + 500].encode()

        resp = httpx.post(f"{s.url}/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert resp.status_code == 413 and "2000 bytes" in resp.json()["error"]["message"]
        assert s.post("/v1/completions", OK_COMPLETION).status_code == 200


def test_default_max_tokens_and_the_request_time_limit(tiny_llama_dir):
    limits = Limits(default_max_tokens=5, request_timeout_s=0.5)
    with serving(LLM(str(tiny_llama_dir)), served_model_name=MODEL, limits=limits) as s:
        body = {"model": MODEL, "prompt": "Hello", "temperature": 0, "ignore_eos": True}
        out = s.post("/v1/completions", body).json()
        assert out["usage"]["completion_tokens"] == 5 and out["choices"][0]["finish_reason"] == "length"

        engine, step = s.llm.engine, s.llm.engine.step

        def slow_step():
            time.sleep(0.05)
            return step()

        engine.step = slow_step  # 20 tokens/s at most: 400 tokens would take 20 s
        try:
            start = time.monotonic()
            out = s.post("/v1/completions", body | {"max_tokens": 400}).json()
        finally:
            del engine.step
        assert time.monotonic() - start < 10  # the limit, 0.5 s, and not the 20 s the request would take
        assert out["choices"][0]["finish_reason"] == "length" and 1 <= out["usage"]["completion_tokens"] < 400
        m = s.wait_idle()
        assert m["specdec_kv_blocks_used"] == m["specdec_kv_blocks_cached"]


def test_a_full_server_answers_429_with_retry_after(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), max_num_seqs=1)
    with serving(llm, served_model_name=MODEL, limits=Limits(max_queue=1)) as s:
        gate = threading.Event()
        llm.measuring.inject_fault(lambda seqs: gate.wait(10))  # hold every step until released
        body = OK_COMPLETION | {"max_tokens": 3}
        with ThreadPoolExecutor(2) as pool:
            running = [pool.submit(s.post, "/v1/completions", body) for _ in range(2)]  # 1 runs, 1 waits
            deadline = time.monotonic() + 10
            while s.app.state.server.engine.in_system < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            with pytest.raises(openai.RateLimitError) as e:
                s.client(max_retries=0).completions.create(model=MODEL, prompt="Hello", max_tokens=3)
            assert int(e.value.response.headers["retry-after"]) >= 1
            assert e.value.response.json()["error"]["code"] == "server_full"
            llm.measuring.inject_fault(None)
            gate.set()
            assert [f.result().status_code for f in running] == [200, 200]
        assert s.post("/v1/completions", body).status_code == 200


def test_an_injected_fault_fails_only_its_request(tiny_llama_dir, offline):
    from test_llm import FAULTY, fail_on_marked

    llm = LLM(str(tiny_llama_dir))
    with serving(llm, served_model_name=MODEL) as s:
        llm.measuring.inject_fault(fail_on_marked)
        good = {"model": MODEL, "prompt": "Hello world", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        bad = good | {"prompt": [5, 6, 7, FAULTY]}
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda b: s.post("/v1/completions", b), [good, bad, good, bad | {"stream": True}]))
        want = offline.generate("Hello world", greedy(24))[0].text
        assert [r.status_code for r in replies[:3]] == [200, 500, 200]
        assert replies[0].json()["choices"][0]["text"] == replies[2].json()["choices"][0]["text"] == want
        assert "injected fault" in replies[1].json()["error"]["message"]
        assert '"error"' in replies[3].text and "injected fault" in replies[3].text  # streamed: an error event
        m = s.wait_idle()
        assert m["specdec_requests_failed_total"] == 2 and m["specdec_kv_blocks_used"] == m["specdec_kv_blocks_cached"]
        assert httpx.get(f"{s.url}/health").status_code == 200


def test_health_says_not_ready_while_a_step_is_stuck(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir))
    with serving(llm, served_model_name=MODEL, limits=Limits(stuck_after_s=0.3)) as s:
        gate = threading.Event()
        llm.measuring.inject_fault(lambda seqs: gate.wait(10))
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(s.post, "/v1/completions", OK_COMPLETION)
            deadline = time.monotonic() + 10  # the step is held: /health must turn 503 0.3 s after it began
            while httpx.get(f"{s.url}/health").status_code != 503:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            llm.measuring.inject_fault(None)
            gate.set()
            assert reply.result().status_code == 200
        assert httpx.get(f"{s.url}/health").status_code == 200


def test_draining_finishes_requests_in_flight_and_refuses_new_ones(tiny_llama_dir, offline):
    llm = LLM(str(tiny_llama_dir))
    with serving(llm, served_model_name=MODEL) as s:
        engine = s.app.state.server.engine
        step = llm.engine.step

        def slow_step():
            time.sleep(0.02)
            return step()

        llm.engine.step = slow_step
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(s.post, "/v1/completions", body)
            while s.metrics()["specdec_requests_running"] < 1:
                time.sleep(0.01)
            engine.drain(timeout=30)
            refused = s.post("/v1/completions", body)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            assert httpx.get(f"{s.url}/health").status_code == 503
            done = in_flight.result()
        assert done.status_code == 200
        assert done.json()["choices"][0]["text"] == offline.generate("Hello", greedy(30))[0].text
        deadline = time.monotonic() + 10
        while engine.alive:
            assert time.monotonic() < deadline
            time.sleep(0.02)


# -- fuzzing the API from its own schema (schemathesis) ----------------------------------------------------
def test_schemathesis_finds_no_server_error_and_no_response_off_the_schema(tiny_llama_dir):
    """Every operation of the server's own OpenAPI schema, 40 generated requests each (valid and invalid
    bodies), sent in-process to the app: no 5xx, and every status, content type and body as the schema says."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    app = create_app(LLM(str(tiny_llama_dir), max_num_seqs=4), served_model_name=MODEL, engine_thread=False,
                     limits=Limits(default_max_tokens=8), admin=Admin("adm"))
    engine = app.state.server.engine
    engine.start()
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    tested = []
    try:
        for result in schemathesis.openapi.from_asgi("/openapi.json", app).get_all_operations():
            operation = result.ok()

            @settings(max_examples=40, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck),
                      database=None)
            @given(operation.as_strategy())
            def fuzz(case):
                case.call_and_validate(checks=checks, headers={"Authorization": "Bearer adm"})

            fuzz()
            tested.append(f"{operation.method.upper()} {operation.path}")
    finally:
        engine.stop()
    assert sorted(tested) == ["DELETE /v1/responses/{response_id}", "GET /admin/draft", "GET /health", "GET /metrics",
                              "GET /v1/models", "GET /v1/responses/{response_id}", "POST /admin/draft",
                              "POST /detokenize", "POST /tokenize", "POST /v1/chat/completions", "POST /v1/completions",
                              "POST /v1/messages", "POST /v1/messages/count_tokens", "POST /v1/responses"]
    assert engine.engine.allocator.num_used == 0


def test_sigterm_drains_the_server_and_exits_0(tiny_llama_dir):
    """`specdec serve` in a subprocess: SIGTERM while a request streams; the server says it drains, that
    request still gets its whole answer, and the process exits 0 (new requests meanwhile get 503: tested
    in-process above, as the tiny model finishes too fast to race here)."""
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", str(tiny_llama_dir), "--port", str(port),
                             "--served-model-name", MODEL, "--speculative-config", "off", "--shutdown-timeout", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)  # the request runs
            proc.send_signal(signal.SIGTERM)
            rest = [x for x in lines if x]
        finals = [json.loads(x[6:]) for x in rest if x.startswith("data: {")]
        assert finals[-1]["choices"][0]["finish_reason"] == "length" and rest[-1] == "data: [DONE]"
        assert not any("error" in f for f in finals)
        assert proc.wait(timeout=60) == 0
        assert "shutting down: requests in flight have 60 s to finish" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
