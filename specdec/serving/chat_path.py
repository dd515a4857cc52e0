"""What an API built on the chat pipeline needs of the server (`server.OpenAIServer` is it): plan and queue a chat
body, turn the engine's output into the chat answer or its chunk stream, and run a function on the engine thread.
The Responses, Messages and tokenize endpoints are written against this, so the server imports them and none of
them imports the server."""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from fastapi.responses import Response

    from specdec.serving.api import ChatBody, CompletionBody
    from specdec.serving.engine_thread import EngineRequest
    from specdec.serving.plans import Plan, Planner
    from specdec.serving.served_model import ServedModel


class ChatPath(Protocol):
    model: str  # the name clients send as `model`
    served: ServedModel
    planner: Planner

    async def start(self, body: ChatBody | CompletionBody) -> tuple[Plan, EngineRequest]: ...

    async def submit(self, plan: Plan) -> EngineRequest: ...

    async def answer(self, plan: Plan, req: EngineRequest,
                     disconnected: Callable[[], Awaitable[bool]] | None = None) -> dict | None: ...

    def chunks(self, plan: Plan, req: EngineRequest) -> AsyncIterator[list[dict]]: ...

    def streaming(self, content: AsyncIterator[str], req: EngineRequest) -> Response: ...

    async def on_engine_thread(self, fn: Callable[[], Any]) -> Any: ...
