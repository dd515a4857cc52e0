"""The OpenAI Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`) over the chat pipeline.

A Responses body becomes a chat body (`to_chat`): `instructions` a system message, `input` items chat messages
(`function_call` items an assistant's tool_calls, `function_call_output` items tool messages), function `tools` chat
tools, `text.format` a `response_format`, `max_output_tokens` max_completion_tokens. That body is planned and run as
a chat request, so speculation, seeded sampling, grammar checks and limits apply unchanged. The chat answer, or its
stream of chunks, is then rewritten as a Response (`response_json`) or as the Responses events (`ResponseEvents`):

    response.created, response.in_progress,
    per message:  output_item.added, content_part.added, output_text.delta..., output_text.done,
                  content_part.done, output_item.done
    per call:     output_item.added, function_call_arguments.delta, function_call_arguments.done, output_item.done
    response.completed (or response.incomplete when max_output_tokens cut it)

Responses are stored (`store`, default true as at OpenAI) in a bounded LRU (`ResponseStore`), so a later request
can continue one by `previous_response_id`; `--max-stored-responses 0` turns storing off.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import StrictBool, StrictFloat, StrictInt

from specdec.serving.api import APIError, Body, ChatBody, error_responses
from specdec.serving.chat_path import ChatPath
from specdec.serving.plans import Plan, checked_chat, renamed_fields
from specdec.serving.response_store import ResponseStore

if TYPE_CHECKING:
    from specdec.serving.engine_thread import EngineRequest

# Fields of the Responses API whose effect we do not provide, refused when set rather than silently ignored.
REFUSED = {"background": lambda v: v is True, "conversation": lambda v: v is not None,
           "prompt": lambda v: v is not None, "truncation": lambda v: v not in (None, "disabled"),
           "reasoning": lambda v: isinstance(v, dict) and any(v.get(k) is not None for k in ("effort", "summary")),
           "top_logprobs": lambda v: v not in (None, 0), "max_tool_calls": lambda v: v is not None,
           "include": lambda v: v not in (None, [])}
# Sampling extensions passed on to the chat pipeline as they are (it checks them and names them in errors).
PASSED = ("seed", "top_k", "min_p", "stop", "ignore_eos", "presence_penalty", "frequency_penalty",
          "repetition_penalty")
ROLES = ("user", "system", "developer", "assistant")
FIELDS = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text"}


class ResponsesBody(Body):
    IGNORED = frozenset({"access_programs", "background_options", "context_management", "image", "moderation",
                         "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "safety_identifier",
                         "service_tier", "stream_options", "user"})
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: StrictBool | None = None
    stream: StrictBool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    metadata: dict[str, Any] | None = None  # echoed in the Response
    record: StrictBool = True  # false: not written by --record-traffic
    # vLLM's sampling fields, passed on as sent (PASSED): the chat pipeline checks them
    seed: Any = None
    top_k: Any = None
    min_p: Any = None
    stop: Any = None
    ignore_eos: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    # refused when set (REFUSED)
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    truncation: Any = None
    reasoning: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    include: Any = None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- body -> chat body ------------------------------------------------------------------------------------------
def to_chat(body: ResponsesBody, history: list[dict]) -> tuple[ChatBody, list[dict]]:
    """The chat body that runs this request, and the conversation it continues with (the stored conversation,
    then this input: what a later request's previous_response_id picks up; instructions are not carried over)."""
    for name, refused in REFUSED.items():
        value = getattr(body, name)
        if refused(value):
            raise APIError(400, f"{name}={json.dumps(value)[:80]} is not supported by this server; leave it "
                           "out", param=name, code="unsupported_parameter")
    conversation = history + input_messages(body.input)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": bool(body.stream),
                            "stream_options": {"include_usage": True} if body.stream else None,
                            "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
                            "top_p": body.top_p, "parallel_tool_calls": body.parallel_tool_calls,
                            "record": body.record}
    chat |= {name: getattr(body, name) for name in PASSED if name in body.model_fields_set}
    if body.tools:
        chat["tools"] = [chat_tool(t, i) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = chat_tool_choice(body.tool_choice)
    if body.text is not None and body.text.get("format") is not None:
        chat["response_format"] = response_format(body.text["format"])
    return checked_chat(chat, "input"), conversation


def input_messages(given: str | list[dict]) -> list[dict]:
    """The `input` as chat messages: a string is one user message; items are messages, function calls (an
    assistant's tool_calls, consecutive ones together) and function call outputs (tool messages)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not given:
        raise APIError(400, "input must hold at least one item", param="input")
    messages: list[dict] = []
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(input_message(item, i))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or not last["content"]):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _parts_text(output, i)
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i), "content": content})
        elif kind == "reasoning":
            continue  # a client echoing a reasoning item back; we write none, so it holds nothing for us
        else:
            raise APIError(400, f"input[{i}].type {kind!r} is not supported: give messages, function_call and "
                           "function_call_output items", param="input")
    return messages


def input_message(item: dict, i: int) -> dict:
    role = item.get("role")
    if role not in ROLES:
        raise APIError(400, f"input[{i}].role must be one of {list(ROLES)}, got {role!r}", param="input")
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(content, i)
    return {"role": role, "content": text}


def _parts_text(parts: Any, i: int) -> str:
    if not isinstance(parts, list):
        raise APIError(400, f"input[{i}].content must be a string or a list of text parts", param="input")
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"input[{i}].content: only input_text and output_text parts are supported, got "
                           f"{kind!r}", param="input")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, key: str, i: int) -> str:
    if not isinstance(item.get(key), str):
        raise APIError(400, f"input[{i}].{key} must be a string", param="input")
    return item[key]


def chat_tool(tool: dict, i: int) -> dict:
    if tool.get("type") != "function":
        raise APIError(400, f"tools[{i}].type {tool.get('type')!r} is not supported: this server runs function "
                       "tools only", param="tools")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # "auto" | "none" | "required"; anything else the chat pipeline refuses, naming tool_choice


def response_format(fmt: Any) -> dict:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, 'text.format must be {"type": "text" | "json_object" | "json_schema"}', param="text")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "text.format.schema must be given, a JSON schema object", param="text")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}


# -- chat answer -> Response -----------------------------------------------------------------------------------
def output_items(content: str | None, calls: list[dict]) -> list[dict]:
    """A chat message's content and tool_calls as Responses output items (a message unless only calls came)."""
    items = [message_item(content or "")] if content or not calls else []
    return items + [call_item(c) for c in calls]


def message_item(text: str, status: str = "completed") -> dict:
    return {"id": new_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)] if status == "completed" else []}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: dict, status: str = "completed") -> dict:
    fn = call["function"]
    return {"id": new_id("fc"), "type": "function_call", "status": status, "call_id": call["id"],
            "name": fn["name"], "arguments": fn["arguments"] if status == "completed" else ""}


def usage_json(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


@dataclass
class ResponseShell:
    """What a Response says besides its output: the request's settings, echoed as OpenAI does."""

    rid: str
    body: ResponsesBody
    created: int
    store: bool

    def json(self, output: list[dict], status: str, usage: dict | None, finish: str | None = None) -> dict:
        body = self.body
        text = {"format": (body.text or {}).get("format") or {"type": "text"}}
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "background": False, "error": None, "incomplete_details": incomplete,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": body.model,
                "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
                "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
                "store": self.store, "temperature": 1.0 if body.temperature is None else body.temperature,
                "text": text, "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
                "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
                "usage": usage_json(usage), "user": None, "metadata": body.metadata or {}}

    def from_chat(self, answer: dict) -> dict:
        """A non-streaming chat answer as a Response."""
        choice = answer["choices"][0]
        message = choice["message"]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        return self.json(output_items(message["content"], message.get("tool_calls") or []), status, answer["usage"])


def conversation_after(conversation: list[dict], output: list[dict]) -> list[dict]:
    """The conversation a stored response continues with: its input, then its output as an assistant turn."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        turn["tool_calls"] = calls
    return conversation + [turn]


# -- chat chunks -> Responses events --------------------------------------------------------------------------
class ResponseEvents:
    """Rewrites a chat stream's chunks as Responses events, numbered by `sequence_number`; `response` is the
    finished Response (for the store) once the stream ended without an error."""

    def __init__(self, shell: ResponseShell) -> None:
        self.shell = shell
        self.seq = 0
        self.output: list[dict] = []
        self.text: str | None = None  # the open message's text, None when no message is open
        self.finish: str | None = None
        self.response: dict | None = None

    def event(self, kind: str, **fields: Any) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict]:
        shell = self.shell.json([], "in_progress", None)
        return [self.event("response.created", response=shell), self.event("response.in_progress", response=shell)]

    def chunk(self, chunk: dict) -> list[dict]:
        if "error" in chunk:
            err = chunk["error"]
            return [self.event("error", code=err.get("code"), message=err["message"], param=err.get("param"))]
        if not chunk["choices"]:  # the usage chunk: the stream's end
            return self.close_message() + self.end(chunk.get("usage"))
        choice = chunk["choices"][0]
        delta, events = choice.get("delta") or {}, []
        if delta.get("content"):
            events += self.open_message() + [self.event("response.output_text.delta", **self.where(),
                                                        content_index=0, delta=delta["content"], logprobs=[])]
            self.text += delta["content"]
        for call in delta.get("tool_calls") or []:
            events += self.close_message() + self.call(call)
        self.finish = choice.get("finish_reason") or self.finish
        return events

    def where(self) -> dict:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def open_message(self) -> list[dict]:
        if self.text is not None:
            return []
        self.text = ""
        self.output.append(message_item("", "in_progress"))
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=self.output[-1]),
                self.event("response.content_part.added", **self.where(), content_index=0, part=text_part(""))]

    def close_message(self) -> list[dict]:
        if self.text is None:
            return []
        item, text, self.text = self.output[-1], self.text, None
        item.update(status="completed", content=[text_part(text)])
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        return [self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
                self.event("response.content_part.done", **where, content_index=0, part=text_part(text)),
                self.event("response.output_item.done", output_index=where["output_index"], item=item)]

    def call(self, call: dict) -> list[dict]:
        self.output.append(call_item(call, "in_progress"))
        added = self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(self.output[-1]))
        item = self.output[-1]
        item.update(status="completed", arguments=call["function"]["arguments"])
        return [added, self.event("response.function_call_arguments.delta", **self.where(), delta=item["arguments"]),
                self.event("response.function_call_arguments.done", **self.where(), arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=len(self.output) - 1, item=item)]

    def end(self, usage: dict | None) -> list[dict]:
        events = [] if self.output else self.open_message() + self.close_message()  # an empty answer: one message
        status = "incomplete" if self.finish == "length" else "completed"
        self.response = self.shell.json(self.output, status, usage)
        return events + [self.event(f"response.{status}", response=self.response)]


# -- the endpoint -------------------------------------------------------------------------------------------
def sse_events(events: list[dict]) -> str:
    """Named server-sent events, as OpenAI's and Anthropic's streams send them."""
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events)


class ResponsesEndpoint:
    """`/v1/responses`, answered through the server's chat path (`ChatPath.start`, `answer`, `chunks`)."""

    def __init__(self, server: ChatPath, store: ResponseStore) -> None:
        self.server, self.store = server, store

    async def create(self, body: ResponsesBody, request: Request) -> Response:
        self.server.planner.check_fields(body)
        self.server.planner.check_model(body.model)
        history = []
        if body.previous_response_id is not None:
            history = self.store.get(body.previous_response_id, "previous_response_id").conversation
        chat, conversation = to_chat(body, history)
        with renamed_fields(FIELDS):
            plan, req = await self.server.start(chat)
        shell = ResponseShell(new_id("resp"), body, int(time.time()), body.store is not False and self.store.enabled)
        if plan.stream:
            return self.server.streaming(self.events(shell, plan, req, conversation), req)
        answer = await self.server.answer(plan, req, request.is_disconnected)
        if answer is None:
            return Response(status_code=499)  # the client went away; nobody reads this
        response = shell.from_chat(answer)
        self.keep(shell, response, conversation)
        return JSONResponse(response)

    async def events(self, shell: ResponseShell, plan: Plan, req: EngineRequest, conversation: list[dict]
                     ) -> AsyncIterator[str]:
        rewrite = ResponseEvents(shell)
        yield sse_events(rewrite.start())
        async for batch in self.server.chunks(plan, req):
            if events := [e for chunk in batch for e in rewrite.chunk(chunk)]:
                yield sse_events(events)
        if rewrite.response is not None:
            self.keep(shell, rewrite.response, conversation)

    def keep(self, shell: ResponseShell, response: dict, conversation: list[dict]) -> None:
        if shell.store:
            self.store.put(response, conversation_after(conversation, response["output"]))

    def router(self) -> APIRouter:
        v1 = APIRouter(prefix="/v1")
        v1.add_api_route("/responses", self.create, methods=["POST"], responses=error_responses(),
                         response_class=Response)
        v1.add_api_route("/responses/{response_id}", self.retrieve, methods=["GET"], responses=error_responses())
        v1.add_api_route("/responses/{response_id}", self.delete, methods=["DELETE"], responses=error_responses())
        return v1

    async def retrieve(self, response_id: str) -> dict:
        return self.store.get(response_id).response

    async def delete(self, response_id: str) -> dict:
        return self.store.delete(response_id)
