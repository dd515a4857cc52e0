"""Anthropic's Messages API (`/v1/messages`, specdec.serving.messages_api) through the official anthropic client:
system, text and block content, stop sequences, tools with tool_use and tool_result blocks, the streamed events,
usage and count_tokens; plus vLLM's /tokenize and /detokenize. Answers equal the chat endpoint's (and offline
decoding's), with speculation or without; errors come in Anthropic's shape naming the field, and leak nothing."""
from __future__ import annotations

import json

import jsonschema
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
from test_server import MODEL, Served

from specdec import SamplingParams

anthropic = pytest.importorskip("anthropic", reason="missing piece: pip install anthropic")

TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SYSTEM = "Be brief."
GREEDY = {"temperature": 0, "ignore_eos": True}  # the SDK takes sampling fields as extra_body (its models fix them)


def client(served: Served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)


def test_messages_equal_offline_streamed_or_not(served, offline):
    want = offline.chat([{"role": "system", "content": SYSTEM}] + ASK,
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    kw = dict(model=MODEL, max_tokens=16, system=SYSTEM, messages=ASK, extra_body=GREEDY)
    msg = client(served).messages.create(**kw)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == want.text
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (len(want.prompt_token_ids), 16)
    blocks = dict(kw, system=[{"type": "text", "text": SYSTEM}],
                  messages=[{"role": "user", "content": [{"type": "text", "text": ASK[0]["content"]}]}])
    assert client(served).messages.create(**blocks).content[0].text == want.text
    assert client(served).messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK).input_tokens == \
        len(want.prompt_token_ids)

    with client(served).messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == want.text and final.content[0].text == want.text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 16 and final.usage.input_tokens == len(want.prompt_token_ids)
    idle(served)


def test_the_streamed_events_come_in_anthropics_order(plain):
    events = list(client(plain).messages.create(model=MODEL, max_tokens=8, messages=ASK, stream=True,
                                                extra_body=GREEDY))
    kinds = [e.type for e in events]
    deltas = kinds.count("content_block_delta")
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"] and deltas >= 1
    assert events[0].message.usage.input_tokens > 0 and events[-2].delta.stop_reason == "max_tokens"


def test_a_stop_sequence_is_reported(served):
    kw = dict(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY)
    whole = client(served).messages.create(**kw).content[0].text
    stop = whole[8:11]
    cut = client(served).messages.create(**kw, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == whole[:whole.index(stop)]
    with client(served).messages.stream(**kw, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_a_tool_use_and_its_result_round_trip_like_chat(served):
    """A forced tool comes back as a tool_use block with stop_reason tool_use (its input valid for the schema, as
    the chat endpoint writes it, streamed as one input_json_delta); its tool_result fed back gives the chat
    endpoint's answer for the same tool message."""
    kw = dict(model=MODEL, max_tokens=300, messages=ASK, tools=[TOOL], extra_body={"temperature": 0})
    msg = client(served).messages.create(**kw, tool_choice={"type": "tool", "name": "get_weather"})
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
    use = msg.content[0]
    jsonschema.validate(use.input, WEATHER)
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "description": TOOL["description"],
                                                    "parameters": WEATHER}}]
    chat = served.client().chat.completions.create(model=MODEL, messages=ASK, tools=chat_tools, temperature=0,
                                                   max_tokens=300, tool_choice={"type": "function", "function": {
                                                       "name": "get_weather"}})
    assert json.loads(chat.choices[0].message.tool_calls[0].function.arguments) == use.input
    with client(served).messages.stream(**kw, tool_choice={"type": "any"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    jsonschema.validate(final.content[-1].input, WEATHER)

    turns = ASK + [{"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]}]
    answer = client(served).messages.create(model=MODEL, max_tokens=10, messages=turns, tools=[TOOL],
                                            extra_body=GREEDY)
    chat_turns = ASK + [{"role": "assistant", "content": "", "tool_calls": [{"id": use.id, "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps(use.input)}}]},
                        {"role": "tool", "tool_call_id": use.id, "content": "21 C"}]
    want = served.client().chat.completions.create(model=MODEL, messages=chat_turns, tools=chat_tools, max_tokens=10,
                                                   temperature=0, extra_body={"ignore_eos": True})
    assert answer.content[0].text == want.choices[0].message.content
    idle(served)


def test_speculation_gives_the_plain_answer_and_a_seed_repeats(plain, spec):
    """Greedy and seeded sampled answers are the same with speculation and without (and a seed repeats)."""
    kw = dict(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "1 2 3 1 2 3 1 2 3"}])
    answers = [client(s).messages.create(**kw, extra_body=GREEDY).content[0].text for s in (plain, spec)]
    assert answers[0] == answers[1]
    sampled = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 5, "ignore_eos": True}
    texts = {client(s).messages.create(**kw, extra_body=sampled).content[0].text for s in (plain, spec, plain)}
    assert len(texts) == 1 and texts != {answers[0]}
    assert spec.metrics()["specdec_spec_draft_tokens_total"] > 0


OK = {"model": MODEL, "max_tokens": 2, "messages": ASK}


@pytest.mark.parametrize("body, status, word", [
    ('{"model": "tiny", "messages": [', 400, "JSON"),
    ({"model": MODEL, "messages": ASK}, 400, "max_tokens"),
    (OK | {"max_tokens": 0}, 400, "max_tokens"),
    (OK | {"max_tokens": 5000}, 400, "max_tokens"),
    (OK | {"messages": "hi"}, 400, "messages"),
    (OK | {"messages": [{"role": "system", "content": "hi"}]}, 400, "messages"),
    (OK | {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "messages"),
    (OK | {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, 400, "tool_use_id"),
    (OK | {"temperature": 1.5}, 400, "temperature"),
    (OK | {"stop_sequences": [""]}, 400, "stop_sequences"),
    (OK | {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools"),
    (OK | {"tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, 400, "tool_choice"),
    (OK | {"tool_choice": {"type": "sometimes"}}, 400, "tool_choice"),
    (OK | {"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "thinking"),
    (OK | {"output_format": {"type": "json_schema", "schema": {"type": "object"}}}, 400, "output_format"),
    (OK | {"model": "claude-opus"}, 404, "model"),
])
def test_errors_come_in_anthropics_shape(plain, body, status, word):
    resp = plain.post("/v1/messages", body)
    assert resp.status_code == status, resp.text
    error = resp.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert word in error["error"]["message"]
    with pytest.raises(anthropic.NotFoundError if status == 404 else anthropic.BadRequestError):
        if isinstance(body, dict) and "max_tokens" in body:
            sdk = {k: body[k] for k in ("model", "max_tokens", "messages", "stop_sequences", "tools", "tool_choice",
                                        "thinking") if k in body}
            client(plain).messages.create(**sdk, extra_body={k: v for k, v in body.items() if k not in sdk})
        else:
            raise anthropic.BadRequestError("the SDK refuses it itself", response=resp, body=error)


def test_count_tokens_and_the_server_keeps_serving(plain):
    counted = client(plain).messages.count_tokens(model=MODEL, messages=ASK, tools=[TOOL])
    msg = client(plain).messages.create(model=MODEL, max_tokens=2, messages=ASK, tools=[TOOL])
    assert counted.input_tokens == msg.usage.input_tokens > len(ASK[0]["content"]) // 8
    assert plain.post("/v1/messages/count_tokens", {"model": MODEL}).json()["error"]["type"] == \
        "invalid_request_error"
    idle(plain)


# -- /tokenize and /detokenize (vLLM's) ------------------------------------------------------------------------
def test_tokenize_and_detokenize(plain, offline):
    ids = offline.encode("Hello world")[1]
    got = plain.post("/tokenize", {"prompt": "Hello world", "model": MODEL}).json()
    assert got == {"count": len(ids), "max_model_len": offline.max_model_len, "tokens": ids, "token_strs": None}
    chat_ids = offline.apply_chat_template(ASK)
    assert plain.post("/tokenize", {"messages": ASK}).json()["tokens"] == chat_ids
    bare = plain.post("/tokenize", {"messages": ASK, "add_generation_prompt": False}).json()["tokens"]
    assert bare == chat_ids[:len(bare)] and len(bare) < len(chat_ids)
    strs = plain.post("/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()["token_strs"]
    assert "".join(strs).endswith("Hello world")
    assert plain.post("/detokenize", {"tokens": ids}).json() == {"prompt": offline.tokenizer.decode(ids)}
    for path, body, param in (("/detokenize", {"tokens": [1, 99999]}, "tokens"),
                              ("/detokenize", {"tokens": "1 2"}, "tokens"),
                              ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "a", "messages": ASK}, "prompt"),
                              ("/tokenize", {"prompt": "a", "chat_template": "{{x}}"}, "chat_template"),
                              ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
                              ("/tokenize", {"prompt": "a", "model": "other"}, "model")):
        resp = plain.post(path, body)
        assert resp.status_code == (404 if param == "model" else 400), resp.text
        assert resp.json()["error"]["param"] == param
    assert "99999" in plain.post("/detokenize", {"tokens": [99999]}).json()["error"]["message"]
