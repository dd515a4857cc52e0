"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the chat pipeline.

A Messages body becomes a chat body (`to_chat`): `system` a system message, text blocks content, an assistant's
`tool_use` blocks its tool_calls, a user's `tool_result` blocks tool messages, `tools` (name, description,
input_schema) chat tools, `tool_choice` auto/any/tool/none, `stop_sequences` stop strings. It is planned and run as
a chat request, so speculation, seeded sampling, grammar checks and limits apply unchanged; the chat answer or its
chunks are rewritten as a Message (`message_json`) or as Anthropic's events (`MessageEvents`):

    message_start, then per block (text, or tool_use whose input comes as one input_json_delta):
    content_block_start, content_block_delta..., content_block_stop; then message_delta (stop_reason, usage),
    message_stop

Errors under /v1/messages come in Anthropic's shape (specdec.serving.api.APIError.anthropic_body).
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import StrictBool, StrictFloat, StrictInt

from specdec.serving.api import APIError, Body, ChatBody, error_responses
from specdec.serving.chat_path import ChatPath
from specdec.serving.plans import Plan, checked_chat, renamed_fields
from specdec.serving.responses_api import new_id, sse_events

if TYPE_CHECKING:
    from specdec.serving.engine_thread import EngineRequest

# Fields whose effect we do not provide, refused when set rather than silently ignored.
REFUSED = {"thinking": lambda v: isinstance(v, dict) and v.get("type") not in (None, "disabled"),
           "mcp_servers": lambda v: bool(v), "container": lambda v: v is not None,
           "output_format": lambda v: v is not None, "output_config": lambda v: bool(v)}  # structured output, effort
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# Sampling extensions (vLLM's) passed on to the chat pipeline as they are (it checks them, naming them).
PASSED = ("seed", "ignore_eos", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
FIELDS = {"stop": "stop_sequences"}  # chat's names of our fields, where they differ


class CountTokensBody(Body):
    IGNORED = frozenset({"cache_control", "speed", "user_profile_id", "workspace_id"})
    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    # refused when set (REFUSED)
    thinking: Any = None
    mcp_servers: Any = None
    container: Any = None
    output_format: Any = None
    output_config: Any = None


class MessagesBody(CountTokensBody):
    IGNORED = CountTokensBody.IGNORED | {"diagnostics", "inference_geo", "metadata", "service_tier"}
    max_tokens: StrictInt
    stop_sequences: list[str] | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    stream: StrictBool | None = None
    record: StrictBool = True  # false: not written by --record-traffic
    # vLLM's sampling fields, passed on as sent (PASSED): the chat pipeline checks them
    seed: Any = None
    ignore_eos: Any = None
    min_p: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None


# -- body -> chat body ------------------------------------------------------------------------------------------
def to_chat(body: CountTokensBody) -> ChatBody:
    for name, refused in REFUSED.items():
        if refused(getattr(body, name)):
            raise APIError(400, f"{name} is not supported by this server; leave it out", param=name)
    messages = ([{"role": "system", "content": system_text(body.system)}] if body.system else [])
    for i, message in enumerate(body.messages):
        messages += chat_messages(message, i)
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        chat["tools"] = [chat_tool(t, i) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat |= chat_tool_choice(body.tool_choice)
    if isinstance(body, MessagesBody):
        if body.max_tokens < 1:
            raise APIError(400, f"max_tokens: must be at least 1, got {body.max_tokens}", param="max_tokens")
        if body.temperature is not None and not 0 <= body.temperature <= 1:
            raise APIError(400, f"temperature: must be in [0, 1], got {body.temperature}", param="temperature")
        chat |= {"max_tokens": body.max_tokens, "stop": body.stop_sequences, "temperature": body.temperature,
                 "top_p": body.top_p, "top_k": body.top_k, "stream": bool(body.stream),
                 "stream_options": {"include_usage": True} if body.stream else None, "record": body.record}
        chat |= {name: getattr(body, name) for name in PASSED if name in body.model_fields_set}
    return checked_chat(chat, "messages")


def system_text(system: str | list[dict]) -> str:
    if isinstance(system, str):
        return system
    return "".join(_text_block(b, "system") for b in system)


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise APIError(400, f"{where}: only text blocks are supported here, got {kind!r}", param=where.split("[")[0])
    return block["text"]


def chat_messages(message: dict, i: int) -> list[dict]:
    """One Messages turn as chat messages: a user turn's tool results become tool messages (first, as Anthropic
    requires them first), its text a user message; an assistant turn's tool_use blocks its tool_calls."""
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise APIError(400, f"messages[{i}].role must be \"user\" or \"assistant\", got {role!r}", param="messages")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise APIError(400, f"messages[{i}].content must be a string or a list of content blocks", param="messages")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise APIError(400, f"{where}: a tool_use block needs an id and a name", param="messages")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            results.append(tool_message(block, where))
        else:
            texts.append(_text_block(block, where).strip("\n") if kind == "text" else _text_block(block, where))
    turn = [{"role": role, "content": "".join(texts)}] if texts or not (calls or results) else []
    if calls:
        turn = [{"role": "assistant", "content": "".join(texts), "tool_calls": calls}]
    return results + turn


def tool_message(block: dict, where: str) -> dict:
    if not isinstance(block.get("tool_use_id"), str):
        raise APIError(400, f"{where}.tool_use_id is required: the tool_use it answers", param="messages")
    content = block.get("content", "")
    text = content if isinstance(content, str) else "".join(_text_block(b, f"{where}.content") for b in content)
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def chat_tool(tool: Any, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") not in (None, "custom") or "input_schema" not in tool:
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise APIError(400, f"tools[{i}] must be a client tool {{\"name\", \"description\", \"input_schema\"}}"
                       + (f"; {kind!r} tools are not supported" if kind else ""), param="tools")
    fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def chat_tool_choice(choice: dict) -> dict:
    kind = choice.get("type")
    parallel = {"parallel_tool_calls": False} if choice.get("disable_parallel_tool_use") is True else {}
    if kind == "tool":
        return {"tool_choice": {"type": "function", "function": {"name": choice.get("name")}}} | parallel
    if kind not in TOOL_CHOICES:
        raise APIError(400, 'tool_choice.type must be "auto", "any", "tool" or "none"', param="tool_choice")
    return {"tool_choice": TOOL_CHOICES[kind]} | parallel


# -- chat answer -> Message -------------------------------------------------------------------------------------
def tool_use(call: dict) -> dict:
    return {"type": "tool_use", "id": call["id"].replace("call_", "toolu_", 1), "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


def stop_reason(finish: str | None, stop: Any, called: bool) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a chat finish reason and the stop that ended the answer."""
    if called:
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def message_json(answer: dict, model: str) -> dict:
    choice = answer["choices"][0]
    message, calls = choice["message"], choice["message"].get("tool_calls") or []
    content = [{"type": "text", "text": message["content"] or ""}] if message["content"] or not calls else []
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"), bool(calls))
    usage = answer["usage"]
    return {"id": new_id("msg"), "type": "message", "role": "assistant", "model": model,
            "content": content + [tool_use(c) for c in calls], "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}}


# -- chat chunks -> Messages events ---------------------------------------------------------------------------
class MessageEvents:
    """Rewrites a chat stream's chunks as Anthropic's events."""

    def __init__(self, model: str, input_tokens: int) -> None:
        self.model, self.input_tokens = model, input_tokens
        self.blocks = 0  # content blocks started
        self.text_open = False
        self.called = False
        self.finish: tuple[str | None, Any] = (None, None)

    def start(self) -> list[dict]:
        message = {"id": new_id("msg"), "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def chunk(self, chunk: dict) -> list[dict]:
        if "error" in chunk:
            return [{"type": "error", "error": {"type": "api_error", "message": chunk["error"]["message"]}}]
        if not chunk["choices"]:  # the usage chunk: the stream's end
            return self.end(chunk["usage"]["completion_tokens"])
        choice = chunk["choices"][0]
        delta, events = choice.get("delta") or {}, []
        if delta.get("content"):
            events += self.open_text()
            events.append({"type": "content_block_delta", "index": self.blocks - 1,
                           "delta": {"type": "text_delta", "text": delta["content"]}})
        for call in delta.get("tool_calls") or []:
            events += self.close_text() + self.call(call)
        if choice.get("finish_reason"):
            self.finish = (choice["finish_reason"], choice.get("stop_reason"))
        return events

    def open_text(self) -> list[dict]:
        if self.text_open:
            return []
        self.text_open, self.blocks = True, self.blocks + 1
        block = {"type": "text", "text": ""}
        return [{"type": "content_block_start", "index": self.blocks - 1, "content_block": block}]

    def close_text(self) -> list[dict]:
        if not self.text_open:
            return []
        self.text_open = False
        return [{"type": "content_block_stop", "index": self.blocks - 1}]

    def call(self, call: dict) -> list[dict]:
        block, index = tool_use(call), self.blocks
        self.blocks, self.called = self.blocks + 1, True
        return [{"type": "content_block_start", "index": index, "content_block": block | {"input": {}}},
                {"type": "content_block_delta", "index": index,
                 "delta": {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}},
                {"type": "content_block_stop", "index": index}]

    def end(self, output_tokens: int) -> list[dict]:
        events = self.open_text() if not self.blocks else []  # an empty answer: one empty text block
        reason, sequence = stop_reason(*self.finish, self.called)
        return events + self.close_text() + [
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
             "usage": {"output_tokens": output_tokens}}, {"type": "message_stop"}]


# -- the endpoint -------------------------------------------------------------------------------------------
class MessagesEndpoint:
    """`/v1/messages` and its count_tokens, answered through the server's chat path."""

    def __init__(self, server: ChatPath) -> None:
        self.server = server

    def router(self) -> APIRouter:
        v1 = APIRouter(prefix="/v1")
        errors = error_responses(anthropic=True)
        v1.add_api_route("/messages", self.create, methods=["POST"], responses=errors, response_class=Response)
        v1.add_api_route("/messages/count_tokens", self.count_tokens, methods=["POST"], responses=errors)
        return v1

    async def create(self, body: MessagesBody, request: Request) -> Response:
        self.server.planner.check_fields(body)
        self.server.planner.check_model(body.model)
        with renamed_fields(FIELDS):
            plan = self.server.planner.plan(to_chat(body))
            plan.stop_reasons = True
            req = await self.server.submit(plan)
        if plan.stream:
            return self.server.streaming(self.events(plan, req), req)
        answer = await self.server.answer(plan, req, request.is_disconnected)
        if answer is None:
            return Response(status_code=499)  # the client went away; nobody reads this
        return JSONResponse(message_json(answer, body.model))

    async def events(self, plan: Plan, req: EngineRequest) -> AsyncIterator[str]:
        rewrite = MessageEvents(self.server.model, len(req.prompt_ids[0]))
        yield sse_events(rewrite.start())
        async for batch in self.server.chunks(plan, req):
            if events := [e for chunk in batch for e in rewrite.chunk(chunk)]:
                yield sse_events(events)

    async def count_tokens(self, body: CountTokensBody) -> dict:
        """The input tokens a Messages request with this body is given (its whole prompt, tools included)."""
        self.server.planner.check_fields(body)
        self.server.planner.check_model(body.model)
        chat = to_chat(body)
        tokenize = self.server.planner.prompts(chat, self.server.planner.tools(chat))[0][0]
        return {"input_tokens": len(await self.server.on_engine_thread(tokenize))}
