"""Tool calling's pieces (specdec.serving.tool_calls): requests checked, the default prompt format, the constraint that
makes invalid calls impossible, and the parser, whole and streamed in any split."""
from __future__ import annotations

import json

import pytest
from conftest import needs_default_model

from specdec.serving.tool_calls import (
    BEGIN,
    END,
    StreamParser,
    ToolError,
    Tools,
    call_text,
    constraint,
    default_conversation,
    parse,
    parse_tools,
)

FN = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
OTHER = {"type": "function", "function": {"name": "echo", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}


def test_tool_choice_and_tools_are_checked():
    assert parse_tools(None, None, None) is None
    tools = parse_tools([FN, OTHER], {"type": "function", "function": {"name": "echo"}}, False)
    assert (tools.choice, tools.name, tools.parallel) == ("function", "echo", False)
    assert [f["name"] for f in tools.offered] == ["echo"]
    assert parse_tools([FN], "none", None).offered == []
    for tools_, choice, field in [([FN], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
                                  ([FN], "always", "tool_choice"), (None, "required", "tool_choice"),
                                  ([{"type": "retrieval"}], None, "tools"), ([FN, FN], None, "tools"),
                                  ([{"type": "function", "function": {"name": ""}}], None, "tools")]:
        with pytest.raises(ToolError) as e:
            parse_tools(tools_, choice, None)
        assert e.value.param == field


def test_the_default_format_writes_tools_calls_and_results_as_messages():
    tools = parse_tools([FN], "auto", True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 2?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
                    {"id": "c2", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "3"}, {"role": "tool", "tool_call_id": "c2",
                                                                           "content": "4"}]
    out = default_conversation(messages, tools)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n") and '"name": "add"' in out[0]["content"]
    assert out[2]["content"] == call_text("add", {"a": 1, "b": 2}) + "\n" + call_text("add", {"a": 2, "b": 2})
    assert out[3]["content"] == "<tool_response>\n3\n</tool_response>\n<tool_response>\n4\n</tool_response>"


def test_parse_splits_content_and_calls():
    text = "Let me add.\n" + call_text("add", {"a": 1, "b": 2}) + "\n" + call_text("echo", {"text": "hi"})
    content, calls = parse(text)
    assert content == "Let me add."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2}), ("echo", {"text": "hi"})]
    assert len({c.id for c in calls}) == 2
    # not calls: unknown names, broken JSON, an unclosed tag stay text
    for bad in (call_text("nope", {}), f"{BEGIN}\n{{\"name\": \"add\", \"arguments\": {{\n{END}",
                f"{BEGIN}\n{{\"name\""):
        assert parse(bad, {"add", "echo"}) == (bad, [])
    assert parse("plain < text <tool", {"add"}) == ("plain < text <tool", [])


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_pieces_give_the_same_answer_in_any_split(step):
    text = "Sure.\n" + call_text("add", {"a": 1, "b": 2}) + "\n" + call_text("echo", {"text": "<tool_call> x"}) + " ok"
    whole = parse(text)
    parser, content, calls = StreamParser(), "", []
    for i in range(0, len(text), step):
        piece, new = parser.feed(text[i:i + step])
        content += piece
        calls += new
        assert BEGIN[:2] not in piece or "<tool_call> x" in text  # a tag's start is never sent as content
    content += parser.finish()
    assert (content, [(c.name, c.arguments) for c in calls]) == (whole[0], [(c.name, c.arguments) for c in whole[1]])


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_forced_choices_admit_only_valid_calls(tiny_llama_dir, monkeypatch, backend):
    """The constraint of required / a named function, compiled for a real tokenizer by either grammar library: a
    valid call is accepted to its end, a wrong name, a missing key or a wrong type is refused at the first token
    that makes it wrong; auto takes text, then only a valid call."""
    from specdec import LLM
    from specdec.structured import BACKEND_ENV

    monkeypatch.setenv(BACKEND_ENV, backend)
    engine = LLM(str(tiny_llama_dir)).engine
    tok = engine.tokenizer

    def accepts(tools, text: str, complete: bool = True) -> bool:
        from specdec.config import SamplingParams

        state = engine.grammar_state(SamplingParams(structured_output=constraint(tools)))
        for t in tok.encode(text, add_special_tokens=False):
            if not state.accept(t):
                return False
        return state.matcher.is_completed() or not complete

    required = parse_tools([FN, OTHER], "required", True)
    assert accepts(required, call_text("add", {"a": 1, "b": 2}))
    assert accepts(required, call_text("add", {"a": 1, "b": 2}) + "\n" + call_text("echo", {"text": "x"}))
    assert not accepts(required, "Hello")
    assert not accepts(required, call_text("sub", {"a": 1, "b": 2}))
    assert not accepts(required, call_text("add", {"a": "1", "b": 2}))
    assert not accepts(required, call_text("add", {"a": 1}))
    single = parse_tools([FN, OTHER], "required", False)
    assert not accepts(single, call_text("add", {"a": 1, "b": 2}) + "\n" + call_text("echo", {"text": "x"}), False)
    named = parse_tools([FN, OTHER], {"type": "function", "function": {"name": "echo"}}, True)
    assert not accepts(named, call_text("add", {"a": 1, "b": 2}))
    assert accepts(named, call_text("echo", {"text": "x"}))
    auto = parse_tools([FN, OTHER], "auto", True)
    assert accepts(auto, "Just text.", complete=False)
    assert accepts(auto, "Text, then " + call_text("add", {"a": 1, "b": 2}), complete=False)
    assert not accepts(auto, "Text, then " + call_text("add", {"a": 1, "b": "x"}), complete=False)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_named_choice_and_required_without_parallel_calls_end_after_one_call(tiny_llama_dir, monkeypatch, backend):
    """A named function (whatever parallel_tool_calls says) and required without parallel calls: one call, then
    nothing but the end of the text (the model cannot repeat the call until max_tokens, as vLLM's answer ends);
    required with parallel calls takes several."""
    from specdec import LLM
    from specdec.config import SamplingParams
    from specdec.structured import BACKEND_ENV

    monkeypatch.setenv(BACKEND_ENV, backend)
    engine = LLM(str(tiny_llama_dir)).engine
    tok = engine.tokenizer
    one = call_text("echo", {"text": "x"})
    named = {"type": "function", "function": {"name": "echo"}}
    cases = [parse_tools([FN, OTHER], named, parallel) for parallel in (True, None, False)]
    cases += [Tools(cases[0].functions, "function", "echo", parallel=True), parse_tools([FN, OTHER], "required", False)]
    for tools in cases:
        state = engine.grammar_state(SamplingParams(structured_output=constraint(tools)))
        assert all(state.accept(t) for t in tok.encode(one, add_special_tokens=False)), tools
        assert state.matcher.is_completed(), tools
        assert not state.accept(tok.encode("\n", add_special_tokens=False)[0]), tools  # no separator, no 2nd call
        assert state.accept(tok.eos_token_id), tools  # only the end
    state = engine.grammar_state(SamplingParams(structured_output=constraint(parse_tools([FN, OTHER], "required",
                                                                                         True))))
    assert all(state.accept(t) for t in tok.encode(one + "\n" + one, add_special_tokens=False))


@needs_default_model
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_the_default_model_calls_a_named_function_once(monkeypatch, backend):
    """What instructor's TOOLS mode and the OpenAI Agents SDK send: a named tool_choice, max_tokens to spare. The
    answer is exactly one call and finish_reason "tool_calls" (SmolLM2 would otherwise repeat the call until
    max_tokens: finish "length", an incomplete output)."""
    from test_server import serving

    from specdec import LLM
    from specdec.structured import BACKEND_ENV

    monkeypatch.setenv(BACKEND_ENV, backend)  # read when the engine compiles its first grammar
    tool = {"type": "function", "function": {"name": "multiply", "description": "Multiply two integers.",
                                             "parameters": {"type": "object", "properties": {
                                                 "a": {"type": "integer"}, "b": {"type": "integer"}},
                                                 "required": ["a", "b"]}}}
    with serving(LLM("smollm2-135m"), served_model_name="smollm2") as served:
        for parallel in (None, True):
            body = {"model": "smollm2", "messages": [{"role": "user", "content": "What is 12 times 7?"}],
                    "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "multiply"}},
                    "max_tokens": 200, "temperature": 0}
            if parallel is not None:
                body["parallel_tool_calls"] = parallel
            answer = served.post("/v1/chat/completions", body).json()
            choice = answer["choices"][0]
            calls = choice["message"]["tool_calls"]
            assert len(calls) == 1 and calls[0]["function"]["name"] == "multiply", answer
            assert set(json.loads(calls[0]["function"]["arguments"])) == {"a", "b"}
            assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"], answer
            assert answer["usage"]["completion_tokens"] < 100, answer
