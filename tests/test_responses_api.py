"""The OpenAI Responses API (`/v1/responses`, specdec.serving.responses_api) through the official openai client:
text and message input, instructions, the streamed event sequence, function tools and their outputs, structured
output through `text.format`, usage, stored responses and `previous_response_id`. Every answer equals what the
chat endpoint (and offline decoding) gives for the same conversation, with speculation or without; bad input is
a 400 (404 for an unknown response) naming the field, and leaks no KV block."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from test_protocol import (  # noqa: F401  module fixtures of their own here
    WEATHER,
    idle,
    model_dir,
    offline,
    plain,
    served,
    spec,
)
from test_server import MODEL, Served, serving

from specdec import LLM, SamplingParams
from specdec.serving.api import Limits
from specdec.serving.response_store import ResponseStore

TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER,
        "strict": True}
FORCED = {"type": "function", "name": "get_weather"}
SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["word", "n"], "additionalProperties": False}
ASK = "What is the weather in Paris?"
GREEDY = dict(model=MODEL, temperature=0, extra_body={"ignore_eos": True})


def chat_text(served: Served, messages: list[dict], max_tokens: int, **kw) -> str:
    resp = served.client().chat.completions.create(messages=messages, max_tokens=max_tokens, **GREEDY, **kw)
    return resp.choices[0].message.content


def stream_events(served: Served, **kw) -> list:
    return list(served.client().responses.create(stream=True, **kw))


def test_text_and_message_input_equal_offline_streamed_or_not(served, offline):
    """A string input with instructions, and the same conversation as message items (developer role, text
    parts): the offline engine's greedy text, its usage, streamed in the official event order."""
    want = offline.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    client = served.client()
    resp = client.responses.create(input=ASK, instructions="Be brief.", max_output_tokens=16, **GREEDY)
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == MODEL
    assert resp.output_text == want.text and resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (len(want.prompt_token_ids), 16)
    assert resp.usage.total_tokens == resp.usage.input_tokens + 16
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]}]
    assert client.responses.create(input=items, max_output_tokens=16, **GREEDY).output_text == want.text

    events = stream_events(served, input=ASK, instructions="Be brief.", max_output_tokens=16, **GREEDY)
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"] and deltas >= 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.text
    assert events[-4].text == want.text and events[-1].response.output_text == want.text
    assert events[-1].response.usage.output_tokens == 16
    idle(served)


def test_speculation_gives_the_plain_answer_and_a_seed_repeats(plain, spec):
    kw = dict(input="1 2 3 1 2 3 1 2 3", max_output_tokens=24)
    answers = [s.client().responses.create(**kw, **GREEDY).output_text for s in (plain, spec)]
    assert answers[0] == answers[1]
    sampled = dict(model=MODEL, temperature=0.8, top_p=0.9, extra_body={"seed": 5, "ignore_eos": True})
    texts = {s.client().responses.create(**kw, **sampled).output_text for s in (plain, spec, plain)}
    assert len(texts) == 1 and texts != {answers[0]}
    assert spec.metrics()["specdec_spec_draft_tokens_total"] > 0


def test_a_function_tool_and_its_output_round_trip_like_chat(served):
    """A forced function call comes back as a function_call item (arguments valid for its schema, as the chat
    endpoint writes them); fed back with a function_call_output item, the answer is the chat endpoint's for
    the same assistant tool_calls and tool message. Streamed, the call arrives as its own item."""
    client = served.client()
    resp = client.responses.create(input=ASK, tools=[TOOL], tool_choice=FORCED, max_output_tokens=300,
                                   model=MODEL, temperature=0)
    calls = [item for item in resp.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and resp.status == "completed"
    args = json.loads(calls[0].arguments)
    jsonschema.validate(args, WEATHER)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], temperature=0,
                                          max_tokens=300, tools=[{"type": "function", "function": {
                                              k: TOOL[k] for k in ("name", "description", "parameters")}}],
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(chat.choices[0].message.tool_calls[0].function.arguments) == args

    events = stream_events(served, input=ASK, tools=[TOOL], tool_choice=FORCED, max_output_tokens=300,
                           model=MODEL, temperature=0)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == args
    assert events[-1].type == "response.completed" and events[-1].response.output[-1].type == "function_call"

    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"celsius": 21}'}
    answer = client.responses.create(input=[{"role": "user", "content": ASK}, calls[0].model_dump(), result],
                                     tools=[TOOL], max_output_tokens=12, **GREEDY)
    messages = [{"role": "user", "content": ASK},
                {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
                {"role": "tool", "tool_call_id": calls[0].call_id, "content": '{"celsius": 21}'}]
    tools = [{"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}]
    assert answer.output_text == chat_text(served, messages, 12, tools=tools)
    idle(served)


def test_structured_output_through_text_format(served):
    client = served.client()
    for fmt, chat_fmt in (({"type": "json_schema", "name": "tally", "schema": SCHEMA, "strict": True},
                           {"type": "json_schema", "json_schema": {"name": "tally", "schema": SCHEMA, "strict": True}}),
                          ({"type": "json_object"}, {"type": "json_object"})):
        resp = client.responses.create(model=MODEL, input=ASK, text={"format": fmt}, max_output_tokens=80,
                                       temperature=0)
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                              temperature=0, max_tokens=80, response_format=chat_fmt)
        assert resp.output_text == chat.choices[0].message.content
        if fmt["type"] == "json_schema":
            jsonschema.validate(json.loads(resp.output_text), SCHEMA)
            assert resp.text.format.type == "json_schema"
    idle(served)


def test_previous_response_id_continues_a_stored_conversation(plain):
    client = plain.client()
    first = client.responses.create(input="Hello there", instructions="Be brief.", max_output_tokens=6, **GREEDY)
    assert first.store is True
    second = client.responses.create(input="And then?", previous_response_id=first.id, max_output_tokens=6,
                                     **GREEDY)
    history = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And then?"}]
    assert second.previous_response_id == first.id and second.output_text == chat_text(plain, history, 6)
    streamed = stream_events(plain, input="And then?", previous_response_id=first.id, max_output_tokens=6, **GREEDY)
    assert streamed[-1].response.output_text == second.output_text
    assert client.responses.retrieve(first.id).output_text == first.output_text
    assert plain.post("/v1/responses", {"model": MODEL, "input": "x", "previous_response_id": second.id,
                                        "max_output_tokens": 1, "store": False}).status_code == 200
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id"
    idle(plain)


def test_storing_can_be_turned_off_and_is_bounded(model_dir):
    with serving(LLM(str(model_dir), speculative_config="off"), served_model_name=MODEL,
                 limits=Limits(max_stored_responses=0)) as s:
        resp = s.client().responses.create(model=MODEL, input="Hi", max_output_tokens=2)
        assert resp.store is False
        assert httpx.get(f"{s.url}/v1/responses/{resp.id}").status_code == 404
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    for i in range(3):
        store.put({"id": f"r{i}", "output": []}, [{"role": "user", "content": "x" * 100}])
    assert list(store.entries) == ["r1", "r2"]
    store.get("r1")  # now the most recently used: r2 goes first
    store.put({"id": "big", "output": []}, [{"role": "user", "content": "x" * 9_000}])
    assert list(store.entries) == ["r1", "big"]
    store.put({"id": "big2", "output": []}, [{"role": "user", "content": "x" * 9_000}])  # past the bytes
    assert list(store.entries) == ["big2"] and store.bytes < 10_000
    store.put({"id": "huge", "output": []}, [{"role": "user", "content": "x" * 20_000}])  # over the budget alone
    assert "huge" not in store.entries


OK = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}


@pytest.mark.parametrize("body, status, param", [
    ('{"model": "tiny", "input": [', 400, None),
    ({"model": MODEL}, 400, "input"),
    (OK | {"input": 5}, 400, "input"),
    (OK | {"input": []}, 400, "input"),
    (OK | {"input": [{"role": "wizard", "content": "hi"}]}, 400, "input"),
    (OK | {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
    (OK | {"input": [{"type": "item_reference", "id": "x"}]}, 400, "input"),
    (OK | {"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input"),
    (OK | {"model": "gpt-4o"}, 404, "model"),
    (OK | {"max_output_tokens": 5000}, 400, "max_output_tokens"),
    (OK | {"max_output_tokens": "many"}, 400, "max_output_tokens"),
    (OK | {"temperature": 3.0}, 400, "temperature"),
    (OK | {"stream": "yes"}, 400, "stream"),
    (OK | {"tools": [{"type": "web_search"}]}, 400, "tools"),
    (OK | {"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
    (OK | {"text": {"format": {"type": "yaml"}}}, 400, "text"),
    (OK | {"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text"),
    (OK | {"background": True}, 400, "background"),
    (OK | {"truncation": "auto"}, 400, "truncation"),
    (OK | {"reasoning": {"effort": "high"}}, 400, "reasoning"),
    (OK | {"include": ["message.output_text.logprobs"]}, 400, "include"),
    (OK | {"previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
])
def test_bad_requests_are_refused_naming_the_field(plain, body, status, param):
    resp = plain.post("/v1/responses", body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["message"]
    if param is not None and status == 400:
        assert param.split("_")[0] in err["message"]


def test_the_server_keeps_serving_after_bad_requests(plain):
    for body in (OK | {"max_output_tokens": 5000}, OK | {"input": [{"role": "x"}]}, OK | {"stream": True,
                                                                                          "temperature": 9.0}):
        assert plain.post("/v1/responses", body).status_code == 400
    assert plain.client().responses.create(**OK).status in ("completed", "incomplete")
    idle(plain)
