"""Tool calling (OpenAI's `tools`, `tool_choice`, `tool` messages and `tool_calls`) on any chat model.

The model is shown its tools and asked to call one as a tagged JSON object, the format Hermes, Qwen and many
templates use:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A chat template that renders `tools` itself is given them (and the conversation's `tool_calls` and `tool`
messages) as they are; for one that does not (SmolLM2's), `default_conversation` writes them as plain messages in
the same format. What the model writes is parsed back into OpenAI's `tool_calls` (`parse`, or `StreamParser`
while streaming: text outside the tags streams as content, a call is sent once its closing tag arrived).

`tool_choice` is a structured-output constraint (`constraint`), so speculation stays lossless and the forced
parts (the tag, `{"name": "`, a named function's name, `", "arguments": `) are drafted by jump-forward:
"required" and a named function allow nothing but calls whose arguments match their function's JSON schema: a named
function exactly one call, then the end of the answer (as vLLM's), and so "required" without parallel_tool_calls;
"auto" lets the model write text, and once it opens a tag, only a valid call; "none" leaves tools out of the
prompt and the output unconstrained.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from specdec.config import SpecdecError, StructuredOutput

BEGIN, END = "<tool_call>", "</tool_call>"
_OPEN = BEGIN + "\n"  # a call's text up to its JSON
_CLOSE = "\n" + END
MAX_TOOLS = 128


class ToolError(SpecdecError):
    """A malformed `tools` or `tool_choice`; `param` is the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Tools:
    """A request's tools and how it lets the model use them."""

    functions: list[dict]  # each {"name", "description"?, "parameters"?}, as the request gave them
    choice: str = "auto"  # "auto" | "required" | "none" | "function" (then `name`)
    name: str | None = None  # the function tool_choice names
    parallel: bool = True  # several calls in one answer (never for a named function: it is called once)

    @property
    def offered(self) -> list[dict]:
        """The functions the prompt shows: none under "none", only the named one when one is forced."""
        if self.choice == "none":
            return []
        return [f for f in self.functions if self.name is None or f["name"] == self.name]


def parse_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> Tools | None:
    """The request's tools, checked (ToolError naming the field), or None when it gives none."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice needs tools: give the functions it may call in `tools`", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolError(f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
                            "tools")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or not all(c.isalnum() or c in "_-." for c in name):
            raise ToolError(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}",
                            "tools")
        if name in names:
            raise ToolError(f"{where}.function.name {name!r} is given twice", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"{where}.function.parameters must be a JSON schema object", "tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ToolError(f"{where}.function.description must be a string", "tools")
        names.add(name)
        functions.append({"name": name, "description": fn.get("description") or "", "parameters": params})
    if parallel_tool_calls not in (None, True, False):
        raise ToolError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    parallel = parallel_tool_calls is not False
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return Tools(functions, tool_choice or "auto", None, parallel)
    if (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
            and isinstance(tool_choice.get("function"), dict)):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise ToolError(f"tool_choice names the function {name!r}, which is not among the tools "
                            f"({sorted(names)})", "tool_choice")
        return Tools(functions, "function", name, False)  # one call, as vLLM and OpenAI answer
    raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                    '{"name": ...}}', "tool_choice")


def constraint(tools: Tools) -> StructuredOutput | None:
    """The structured-output constraint that `tool_choice` asks for (None under "none"). Each function is one
    tag whose begin holds its name, so the name and the keys are forced text; its arguments follow the schema.
    A named function, or any call without parallel calls, ends the answer after one call (`stop_after_first`:
    only the end of the text may follow), so a model cannot repeat it until max_tokens."""
    if tools.choice == "none":
        return None
    single = not tools.parallel or tools.name is not None
    tags = [{"type": "tag", "begin": f'{_OPEN}{{"name": {json.dumps(fn["name"])}, "arguments": ',
             "content": {"type": "json_schema", "json_schema": fn["parameters"]}, "end": "}" + _CLOSE}
            for fn in tools.offered]
    if tools.choice == "auto":
        fmt = {"type": "triggered_tags", "triggers": [BEGIN], "tags": tags, "at_least_one": False,
               "stop_after_first": single}
    else:  # required, or one named function: calls only, one after another
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
               "stop_after_first": single}
    return StructuredOutput(structural_tag={"type": "structural_tag", "format": fmt})


# -- the prompt -------------------------------------------------------------------------------------------
def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it (compact JSON, as the constraint forces)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'{_OPEN}{{"name": {json.dumps(name)}, "arguments": {args}}}{_CLOSE}'


def system_text(functions: list[dict], parallel: bool) -> str:
    """The instructions and signatures of the default format, for templates that do not render tools."""
    lines = ["You can call functions to help answer. The functions, as JSON schemas:", "<tools>"]
    lines += [json.dumps({"type": "function", "function": fn}, ensure_ascii=False) for fn in functions]
    lines += ["</tools>", "To call a function, answer with its name and arguments as a JSON object inside "
              f"{BEGIN}{END} tags, like this:", call_text("function_name", {"argument": "value"})]
    if parallel:
        lines.append("To call several functions, write one tagged object per call, one per line.")
    lines.append("A function's result comes back in a <tool_response></tool_response> message; then answer the user.")
    return "\n".join(lines)


def default_conversation(messages: list[dict], tools: Tools | None) -> list[dict]:
    """The conversation for a chat template that does not render tools: the tools described in the system
    message, an assistant's tool_calls written as calls, a `tool` message as a user turn holding the result."""
    out: list[dict] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        if out and role == "user" and out[-1]["role"] == "user" and m["role"] == "tool" and \
                out[-1]["content"].endswith("</tool_response>"):
            out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + content}  # parallel results: one turn
        else:
            out.append({"role": role, "content": content})
    if tools is not None and tools.offered:
        text = system_text(tools.offered, tools.parallel)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


# -- the answer ---------------------------------------------------------------------------------------------
@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, OpenAI's form

    def json(self, index: int | None = None) -> dict:
        body = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return body if index is None else {"index": index} | body


def _call(body: str, names: set[str] | None) -> ToolCall | None:
    """A call from the text between the tags, or None when it is not one (then the text stays content)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) \
            or (names is not None and obj["name"] not in names):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], json.dumps(args, ensure_ascii=False))


def parse(text: str, names: set[str] | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole answer: every well-formed tagged call of a known function is a call; the rest
    of the text (without the tags' surrounding newlines) is content."""
    parser = StreamParser(names)
    content, calls = parser.feed(text)
    return content + parser.finish(), calls


class StreamParser:
    """Splits streamed text into content and calls: text that may be the start of a tag is held back until it
    is known not to be; a call is returned once its closing tag arrived."""

    def __init__(self, names: set[str] | None = None) -> None:
        self.names, self.buffer, self.in_call = names, "", False
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        content, calls = [], []
        while True:
            if self.in_call:
                end = self.buffer.find(END)
                if end < 0:
                    break
                body, self.buffer, self.in_call = self.buffer[:end], self.buffer[end + len(END):], False
                call = _call(body.strip(), self.names)
                if call is None:
                    content.append(BEGIN + body + END)
                else:
                    calls.append(call)
                    self.buffer = self.buffer.removeprefix("\n")
                continue
            start = self.buffer.find(BEGIN)
            if start >= 0:
                content.append(self.buffer[:start].removesuffix("\n") if start else "")
                self.buffer, self.in_call = self.buffer[start + len(BEGIN):], True
                continue
            keep = next((k for k in range(min(len(BEGIN), len(self.buffer)), 0, -1)
                         if BEGIN.startswith(self.buffer[-k:])), 0)
            keep += self.buffer[:len(self.buffer) - keep].endswith("\n")  # a newline before a tag is not content
            content.append(self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            break
        self.calls += len(calls)
        return "".join(content), calls

    def finish(self) -> str:
        """What is left at the end, as content (an unclosed tag's text too)."""
        rest = (BEGIN if self.in_call else "") + self.buffer
        self.buffer, self.in_call = "", False
        return rest
