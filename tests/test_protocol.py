"""The OpenAI protocol through the official openai client (specdec.serving.plans, openai_format): n choices,
several prompts, echo with prompt logprobs, and tool calling (auto, required, named, parallel, a tool message round
trip), streamed and not, with speculation or without; greedy answers equal offline decoding."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from conftest import save_tiny_model
from test_server import MODEL, REPETITIVE, Served, serving, steps_held_until_abort

from specdec import LLM, SamplingParams

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                                               "required": ["a", "b"]}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny model with room for tool prompts (its small vocabulary spells them out in ~1,000 tokens)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny_long"), "llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def plain(model_dir) -> Iterator[Served]:
    with serving(LLM(str(model_dir), block_size=4, speculative_config="off"), served_model_name=MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def spec(model_dir) -> Iterator[Served]:
    config = {"method": "suffix", "num_speculative_tokens": 6}
    with serving(LLM(str(model_dir), block_size=4, speculative_config=config), served_model_name=MODEL) as s:
        yield s


@pytest.fixture(params=["plain", "spec"])
def served(request) -> Served:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def offline(model_dir) -> LLM:
    return LLM(str(model_dir))


def idle(s: Served) -> None:
    m = s.wait_idle()
    assert m["specdec_kv_blocks_used"] == m["specdec_kv_blocks_cached"], "a request kept KV blocks"


# -- n choices and several prompts ----------------------------------------------------------------------------
def test_n_choices_repeat_with_a_seed_and_share_the_prompt(served):
    """n = 4: four choices, each its own random stream, the prompt's blocks shared (prefix cache hits: all but the
    last block, for each later choice), every block back at the end. Seeded choices repeat, streamed or not, where
    the draws do not depend on drafts: plain decoding (a sampled speculative step draws as many numbers as its
    draft needs, and suffix decoding's drafts grow with every answer)."""
    client = served.client()
    hits = served.metrics()["specdec_prefix_cache_hits_total"]
    body = dict(model=MODEL, prompt=REPETITIVE * 3, max_tokens=12, temperature=1.0, seed=11, n=4,
                extra_body={"ignore_eos": True})
    first = client.completions.create(**body)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    texts = [c.text for c in first.choices]
    assert len(set(texts)) > 1
    prompt_len = first.usage.prompt_tokens
    assert first.usage.completion_tokens == 48 and first.usage.total_tokens == prompt_len + 48
    assert served.metrics()["specdec_prefix_cache_hits_total"] - hits >= 3 * (prompt_len - 4)
    chunks = list(client.completions.create(**body, stream=True))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(4)]
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1, 2, 3]
    if served.llm.engine.speculator is None:
        assert streamed == texts
        assert [c.text for c in client.completions.create(**body).choices] == texts
    idle(served)


def test_greedy_choices_and_several_prompts_equal_offline(served, offline):
    client = served.client()
    want = offline.chat(ASK, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].text
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, temperature=0, n=3,
                                          extra_body={"ignore_eos": True})
    assert [c.message.content for c in chat.choices] == [want] * 3
    prompts = ["Hello world", REPETITIVE, "def add(a, b):"]
    want = [o.text for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))]
    done = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2,
                                     extra_body={"ignore_eos": True})
    assert [c.text for c in done.choices] == [w for w in want for _ in range(2)]
    assert done.usage.prompt_tokens == sum(len(offline.encode(p)[1]) for p in prompts)  # each prompt once
    idle(served)


# -- echo and prompt logprobs ---------------------------------------------------------------------------------
def test_echo_scores_the_prompt_like_an_evaluation_harness(served, offline):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, no new tokens (or one); the prompt's tokens
    and log-probabilities are the offline engine's, the first token without one."""
    client = served.client()
    ids = offline.encode(REPETITIVE)[1]
    want = offline.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    for max_tokens in (0, 1):
        done = client.completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens, echo=True, logprobs=1,
                                         temperature=0)
        lp = done.choices[0].logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:len(ids)] == pytest.approx([e.logprob for e in want.prompt_logprobs], abs=1e-5)
        assert len(lp.tokens) == len(ids) + max_tokens and done.usage.completion_tokens == max_tokens
        assert done.choices[0].text.startswith(offline.tokenizer.decode(ids))
        assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    text = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, echo=True, temperature=0,
                                     extra_body={"ignore_eos": True})
    completion = offline.generate("Hello world", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].text
    assert text.choices[0].text == "Hello world" + completion
    chunks = [c for c in client.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, echo=True,
                                                   temperature=0, logprobs=0, stream=True,
                                                   extra_body={"ignore_eos": True}) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == "Hello world" + completion
    assert chunks[0].choices[0].text == "Hello world" and chunks[0].choices[0].logprobs.token_logprobs[0] is None
    idle(served)


# -- tools -----------------------------------------------------------------------------------------------------
def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def streamed_calls(chunks) -> tuple[str, list[tuple[str, dict]], list[str]]:
    """Content, calls and finish reasons assembled from streamed deltas (what OpenAI clients do)."""
    content, calls, finishes = "", {}, []
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            entry = calls.setdefault(t.index, {"name": "", "arguments": ""})
            entry["name"] += t.function.name or ""
            entry["arguments"] += t.function.arguments or ""
            assert t.id is None or t.id.startswith("call_")
        if c.choices[0].finish_reason:
            finishes.append(c.choices[0].finish_reason)
    return content, [(e["name"], json.loads(e["arguments"])) for _, e in sorted(calls.items())], finishes


@pytest.mark.parametrize("tool_choice, parallel", [
    ("required", True), ("required", False), ({"type": "function", "function": {"name": "add"}}, False)])
def test_forced_tool_calls_are_valid_calls(served, tool_choice, parallel):
    """required and a named function: the answer is calls only, each naming a given function with arguments
    valid against its schema (a random model could write nothing else); one call without parallel_tool_calls;
    streamed deltas assemble to the same calls."""
    client = served.client()
    body = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=parallel,
                max_tokens=120, temperature=0)
    done = client.chat.completions.create(**body)
    choice = done.choices[0]
    calls = calls_of(choice.message)
    assert calls and choice.finish_reason == "tool_calls" and not choice.message.content
    assert len(calls) == 1 or parallel
    for name, args in calls:
        assert isinstance(tool_choice, str) or name == "add"
        jsonschema.validate(args, SCHEMAS[name])
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    content, streamed, finishes = streamed_calls(client.chat.completions.create(**body, stream=True))
    assert (content, streamed, finishes) == ("", calls, ["tool_calls"])
    idle(served)


def test_tool_calls_are_lossless_under_speculation(plain, spec):
    """The forced parts of a call are drafted (jump-forward) and verified: the calls equal plain decoding's."""
    body = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0)
    plain_done = plain.client().chat.completions.create(**body)
    spec_done = spec.client().chat.completions.create(**body)
    assert calls_of(spec_done.choices[0].message) == calls_of(plain_done.choices[0].message)
    assert spec_done.usage.completion_tokens == plain_done.usage.completion_tokens
    assert spec_done.usage.model_extra["acceptance_length"] > 1.5  # the forced text: nearly free


def test_auto_tool_choice_lets_the_model_answer_in_text(plain, offline):
    """auto: the model may answer in text (a random model does); the prompt carries the tools either way."""
    client = plain.client()
    done = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=12, temperature=0)
    without = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0)
    assert done.usage.prompt_tokens > without.usage.prompt_tokens + 50
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=12,
                                          temperature=0)
    assert none.usage.prompt_tokens == without.usage.prompt_tokens
    assert none.choices[0].message.content == without.choices[0].message.content
    assert done.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_tool_result_round_trip(served):
    """The assistant's calls and the tool's result go back in the conversation, as agent loops send them."""
    client = served.client()
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    final = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0)
    assert final.choices[0].message.content is not None and final.choices[0].finish_reason in ("stop", "length")
    alone = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    assert final.usage.prompt_tokens > alone.usage.prompt_tokens + 60  # the call and its result are in the prompt
    idle(served)


def test_a_tool_message_without_its_tool_call_id_is_refused(plain):
    """A tool message names the call it answers (OpenAI and vLLM answer 400 without it), whether or not an
    assistant's call comes before it; the error names the message's field."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    for history in (ASK + [{"role": "tool", "content": "3"}],
                    ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "content": "3"}],
                    ASK + [{"role": "tool", "content": "3", "tool_call_id": None}]):
        resp = plain.post("/v1/chat/completions",
                          {"model": MODEL, "messages": history, "tools": TOOLS, "max_tokens": 2})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert f"messages[{len(history) - 1}].tool_call_id" in err["message"], err
        assert (err["type"], err["param"]) == ("invalid_request_error", "messages")
    ok = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "3", "tool_call_id": "call_1"}]
    assert plain.post("/v1/chat/completions", {"model": MODEL, "messages": ok, "tools": TOOLS,
                                               "max_tokens": 2}).status_code == 200
    idle(plain)


def test_a_client_gone_ends_every_choice(plain, monkeypatch):
    """Dropping a stream of n choices, or a non-streaming request's connection, aborts all of its sequences and
    frees their blocks."""
    import httpx

    aborted = 'specdec_requests_total{finish_reason="abort"}'
    before = plain.metrics().get(aborted, 0)
    body = {"model": MODEL, "prompt": REPETITIVE, "n": 4, "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{plain.url}/v1/completions", json=body, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    m = plain.wait_idle()
    assert m[aborted] == before + 4 and m["specdec_kv_blocks_used"] == m["specdec_kv_blocks_cached"]

    with steps_held_until_abort(plain, monkeypatch), pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{plain.url}/v1/completions", json=body | {"stream": False}, timeout=0.3)
    m = plain.wait_idle(20)
    assert m[aborted] == before + 8 and m["specdec_requests_running"] == 0
    assert m["specdec_kv_blocks_used"] == m["specdec_kv_blocks_cached"]
