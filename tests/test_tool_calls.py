"""Tool calling's pieces (specdec.serving.tool_calls): requests checked, the default prompt format, the constraint that
makes invalid calls impossible, and the parser, whole and streamed in any split."""
from __future__ import annotations

import json

import pytest

from specdec.serving.tool_calls import (BEGIN, END, StreamParser, ToolError, call_text, constraint, default_conversation,
                                parse, parse_tools)

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
    for bad in (call_text("nope", {}), f"{BEGIN}\n{{\"name\": \"add\", \"arguments\": {{\n{END}", f"{BEGIN}\n{{\"name\""):
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
