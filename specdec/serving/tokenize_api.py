"""`POST /tokenize` and `POST /detokenize`, as vLLM serves them: a prompt or a chat conversation as the model's
token ids (a conversation with the assistant's turn opened is exactly the prompt a chat request is given), and
ids back as text. Both run the tokenizer on the engine thread, which owns it.

    /tokenize   {"prompt": str, "add_special_tokens": true}
                {"messages": [...], "add_generation_prompt": true, "add_special_tokens": false, "tools": [...]}
             -> {"count": n, "max_model_len": L, "tokens": [...], "token_strs": null | [...]}
    /detokenize {"tokens": [...]} -> {"prompt": str}
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from pydantic import StrictBool, StrictInt

from specdec.serving.api import APIError, Body, check_text, error_responses
from specdec.serving.chat_path import ChatPath
from specdec.serving.plans import checked_chat

# vLLM's fields whose effect we do not provide, refused when set
REFUSED = ("chat_template", "chat_template_kwargs", "continue_final_message", "mm_processor_kwargs")


class TokenizeBody(Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: StrictBool | None = None  # default: true for a prompt, false for messages (the template's)
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False
    # refused when set (REFUSED)
    chat_template: Any = None
    chat_template_kwargs: Any = None
    continue_final_message: Any = None
    mm_processor_kwargs: Any = None


class DetokenizeBody(Body):
    model: str | None = None
    tokens: list[StrictInt]


class TokenizeEndpoint:
    def __init__(self, server: ChatPath) -> None:
        self.server = server

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/tokenize", self.tokenize, methods=["POST"], responses=error_responses())
        router.add_api_route("/detokenize", self.detokenize, methods=["POST"], responses=error_responses())
        return router

    async def tokenize(self, body: TokenizeBody) -> dict:
        model = self.server.served
        self.server.planner.check_fields(body)
        if body.model is not None:
            self.server.planner.check_model(body.model)
        for name in REFUSED:
            if getattr(body, name) not in (None, False, {}):
                raise APIError(400, f"{name} is not supported by this server; leave it out", param=name,
                               code="unsupported_parameter")
        ids = await self.server.on_engine_thread(self.tokenizer(body))
        return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids,
                "token_strs": [model.token_text(t) for t in ids] if body.return_token_strs else None}

    def tokenizer(self, body: TokenizeBody) -> Callable[[], list[int]]:
        """The ids of the body's prompt or conversation, computed on the engine thread."""
        model = self.server.served
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt (a string) or messages (a chat conversation)", param="prompt")
        if body.prompt is not None:
            check_text(body.prompt, "prompt")
            self.server.planner.check_chars(len(body.prompt), "prompt")
            special = body.add_special_tokens is not False
            return lambda: model.tokenize(body.prompt, special)
        if not body.messages:
            raise APIError(400, "messages must contain at least one message", param="messages")
        chat = checked_chat({"model": model.name, "messages": body.messages, "tools": body.tools}, "messages")
        self.server.planner.check_fields(chat)  # a message's unknown field, as a chat request's
        tools = self.server.planner.tools(chat)
        if body.add_generation_prompt and not body.add_special_tokens:  # what a chat request is given
            return self.server.planner.prompts(chat, tools)[0][0]
        conversation = [{"role": m.role, "content": m.content if isinstance(m.content, str) else
                         "".join(p.get("text", "") for p in m.content or [])} for m in chat.messages]
        self.server.planner.check_chars(len(json.dumps(conversation)), "messages")
        offered = [{"type": "function", "function": f} for f in tools.offered] if tools else None
        return lambda: model.render_chat(conversation, offered, body.add_generation_prompt,
                                         bool(body.add_special_tokens))

    async def detokenize(self, body: DetokenizeBody) -> dict:
        model = self.server.served
        self.server.planner.check_fields(body)
        if body.model is not None:
            self.server.planner.check_model(body.model)
        for i, token in enumerate(body.tokens):
            if not 0 <= token < model.vocab_size:
                raise APIError(400, f"tokens[{i}]={token} is not a token id of this model's vocabulary (integers 0 "
                               f"to {model.vocab_size - 1})", param="tokens")
        return {"prompt": await self.server.on_engine_thread(lambda: model.decode(body.tokens))}
