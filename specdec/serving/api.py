"""The OpenAI-compatible HTTP surface that `specdec serve` and the Ray Serve ingress (specdec.serving.replicas) share:
request and response shapes (the OpenAPI schema documents every status), OpenAI-shaped errors, the checks at
the edge and the operator's limits, and the FastAPI app (routes, API key, body limit). What answers a
request is given to `api_app`; nothing here touches an engine.
"""
from __future__ import annotations

import ipaddress
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.config import SpecdecError
from specdec.llm import unicode_text

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

log = logging.getLogger("specdec.server")


class APIError(Exception):
    """An error the client sees in OpenAI's shape; `param` names the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        """Anthropic's shape (the Messages API): its error type is the status's, the field is named in the text."""
        kind = ANTHROPIC_ERRORS.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str = "") -> JSONResponse:
        """The error as JSON, in Anthropic's shape under /v1/messages, else OpenAI's."""
        body = self.anthropic_body() if path.startswith(ANTHROPIC_PATH) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


ANTHROPIC_PATH = "/v1/messages"
ADMIN_PATH = "/admin/"  # routes behind the admin key instead of the API key (specdec.serving.admin)
ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error"}


def internal_error(message: str) -> APIError:
    return APIError(500, message, type="internal_server_error", code="internal_error")


# -- what an operator bounds ------------------------------------------------------------------------------
@dataclass
class Limits:
    """Server-side bounds (`specdec serve` flags); a request past one gets a 4xx naming it, never a 5xx."""

    max_request_bytes: int = 2 * 2**20  # a bigger body is refused (413) before it is read whole
    max_stop: int = 16  # stop strings per request (each is checked on every token)
    max_stop_chars: int = 256  # characters per stop string
    max_choices: int = 16  # choices per request (n, times the prompts of a completions request)
    default_max_tokens: int | None = None  # the cap of a request that gives no max_tokens (None: its context)
    max_queue: int | None = None  # requests waiting to run beyond max_num_seqs; past it 429 + Retry-After
    request_timeout_s: float | None = None  # wall time per request; past it the request ends, finish "length"
    stuck_after_s: float = 60.0  # /health says 503 while one engine step has run longer than this
    max_stored_responses: int = 1000  # Responses API: responses kept for previous_response_id (0: none are stored)
    max_stored_bytes: int = 256 * 2**20  # and the bytes they may take together (least recently used dropped first)
    allow_unknown_fields: bool = False  # accept and ignore fields no endpoint knows, instead of a 400 naming them

    def __post_init__(self) -> None:
        zero_ok = ("max_queue", "max_stored_responses")
        for name in ("max_request_bytes", "max_stop", "max_stop_chars", "max_choices", "default_max_tokens",
                     *zero_ok, "max_stored_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < (0 if name in zero_ok else 1)):
                kind = "non-negative" if name in zero_ok else "positive"
                raise SpecdecError(f"invalid {name}={value!r}: must be a {kind} integer")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise SpecdecError(f"invalid request_timeout_s={self.request_timeout_s!r}: must be positive")


def check_text(text: str, field: str) -> None:
    """Text no tokenizer takes (a lone UTF-16 surrogate: valid JSON, not Unicode) is a 400 naming its field."""
    try:
        unicode_text(text, field)
    except SpecdecError as e:
        raise APIError(400, str(e), param=field.split("[")[0].split(".")[0]) from None


# -- request bodies -------------------------------------------------------------------------------------------
class Body(BaseModel):
    """A request body, or an object inside one. Its known fields are those it declares (every field an endpoint
    reads, refuses or passes on) and `IGNORED`: documented fields of the API it mirrors that change nothing here,
    accepted and ignored. Any other field is unknown, at the top or inside a nested object (`stream_options`, a
    message): a 400 naming it (`plans.Planner.check_fields`) unless the operator allows unknown fields, so a client
    never takes an answer made without a field it believed was understood."""
    model_config = ConfigDict(extra="allow")  # kept, so that --allow-unknown-fields can accept them
    IGNORED: ClassVar[frozenset[str]] = frozenset()

    def unknown_fields(self, prefix: str = "") -> list[str]:
        """Unknown fields by their path ("top_n", "stream_options.include_usge", "messages[1].contnet")."""
        unknown = [prefix + name for name in self.model_extra or {} if name not in self.IGNORED]
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, Body):
                unknown += value.unknown_fields(f"{prefix}{name}.")
            elif isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, Body):
                        unknown += item.unknown_fields(f"{prefix}{name}[{i}].")
        return unknown


class _StreamOptions(Body):
    include_usage: StrictBool = False


class _GenerationBody(Body):
    model: str
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None  # vLLM's: token ids that end a choice (kept in its output ids)
    n: StrictInt | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None  # vLLM's extension
    logit_bias: dict[str, StrictFloat] | None = None  # token id (as a string, OpenAI's form) -> bias in [-100, 100]
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool | None = None  # vLLM's; answers always leave them out, so false is refused
    stream: StrictBool | None = False
    stream_options: _StreamOptions | None = None
    record: StrictBool = True  # false: this request is not written by --record-traffic (specdec.serving.traffic)
    # structured output, checked in specdec.serving.plans (each a 400 naming it): OpenAI's response_format, vLLM's
    # guided_* fields and its newer structured_outputs dict
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_grammar: Any = None
    guided_choice: Any = None
    structured_outputs: Any = None


class _ChatMessage(Body):
    # what OpenAI's SDK writes back when a client resends an answer's message whole: nothing here reads them
    IGNORED = frozenset({"annotations", "audio", "function_call", "reasoning", "reasoning_content", "refusal"})
    role: Literal["system", "developer", "user", "assistant", "tool"]  # developer: served as system
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, as the API returned them
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None


class ChatBody(_GenerationBody):
    IGNORED = frozenset({"audio", "metadata", "modalities", "moderation", "prediction", "prompt_cache_key",
                         "prompt_cache_options", "prompt_cache_retention", "reasoning_effort", "safety_identifier",
                         "service_tier", "store", "user", "verbosity", "web_search_options"})
    messages: list[_ChatMessage]
    logprobs: StrictBool | None = None  # each generated token's log-probability
    top_logprobs: StrictInt | None = None  # and this many alternatives (0-20), with logprobs=true
    tools: list[dict[str, Any]] | None = None  # functions the model may call ({"type": "function", "function": ...})
    tool_choice: str | dict[str, Any] | None = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: StrictBool | None = None
    functions: Any = None  # OpenAI's legacy function calling: refused when set (use tools)
    function_call: Any = None


class CompletionBody(_GenerationBody):
    IGNORED = frozenset({"user"})
    prompt: str | list[str] | list[int] | list[list[int]]  # several prompts: a choice (n of them) for each
    logprobs: StrictInt | None = None  # log-probabilities of the generated tokens and this many alternatives
    echo: StrictBool | None = None  # the prompt before the completion (with logprobs: the prompt's too)
    best_of: StrictInt | None = None  # only best_of = n (every choice is returned)
    suffix: Any = None  # refused when set


# -- what the API answers, for its OpenAPI schema (clients and schemathesis read it) -------------------------
class _ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: _ErrorDetail


class _AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """An error under /v1/messages, in Anthropic's shape."""
    type: Literal["error"]
    error: _AnthropicErrorDetail


class _Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    acceptance_length: float | None
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int


class _Function(BaseModel):
    name: str
    arguments: str  # JSON text


class _ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: _Function


class _Message(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[_ToolCall] | None = None


class _TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class _TokenLogprob(_TopLogprob):
    top_logprobs: list[_TopLogprob]


class _ChatLogprobs(BaseModel):
    content: list[_TokenLogprob] | None


class _TextLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token (nothing predicts it)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class _ChatChoice(BaseModel):
    index: int
    message: _Message
    logprobs: _ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[_ChatChoice]
    usage: _Usage


class _TextChoice(BaseModel):
    index: int
    text: str
    logprobs: _TextLogprobs | None
    finish_reason: str | None


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[_TextChoice]
    usage: _Usage


class _ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[_ModelCard]


_ERRORS = {400: "the request is invalid (the error names the field)", 401: "a missing or wrong API key",
           404: "an unknown model", 413: "the body is over the server's limit",
           429: "the server is full (see Retry-After)", 500: "the engine failed on this request",
           503: "the engine is not running, or the server is shutting down"}


def _responses(ok: type[BaseModel] | None, stream: bool = False, anthropic: bool = False) -> dict:
    errors = {code: {"model": AnthropicErrorBody if anthropic else ErrorBody, "description": doc}
              for code, doc in _ERRORS.items()}
    if ok is None:
        return errors
    # each server-sent event (OpenAPI 3.2's reading of text/event-stream): a JSON chunk or [DONE] in `data`
    event = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
             "required": ["data"]}
    content = {"text/event-stream": {"schema": event}} if stream else {}
    return errors | {200: {"model": ok, "content": content, "description": "the answer" +
                           (" (with stream: server-sent events)" if stream else "")}}


def error_responses(anthropic: bool = False) -> dict:
    """The error statuses of a route, for the OpenAPI schema (in Anthropic's shape under /v1/messages)."""
    return _responses(None, anthropic=anthropic)


def _validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI would answer 422 with its own shape; OpenAI answers 400 naming the field."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
    if not loc:  # no body, a body not sent as JSON (raw bytes reach us), or JSON that is not an object
        raw = err.get("type") == "missing" or isinstance(err.get("input"), (bytes, str))
        return APIError(400, "the request body must be a JSON object" +
                        (", sent with Content-Type: application/json" if raw else ""))
    where = ".".join(loc)
    if err.get("type") == "missing":
        return APIError(400, f"missing required field '{where}'", param=loc[0])
    return APIError(400, f"invalid value for '{where}': {err['msg']}", param=loc[0])


def presented_key(request: Request) -> str:
    """The key a request presents: `Authorization: Bearer <key>`, or `x-api-key` (Anthropic's clients); "" if none."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        given = request.headers.get("x-api-key", "")
    return given.strip()


def same_key(given: str, key: str) -> bool:
    return secrets.compare_digest(given.encode(), key.encode())


def warn_if_exposed(host: str, api_key: str | None) -> None:
    """Serving beyond this machine without an API key is allowed, with a warning at start."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may be reached from elsewhere
        loopback = False
    if api_key is None and not loopback:
        log.warning("serving on %s without --api-key: anyone who reaches this address can use the server; give "
                    "--api-key KEY, or bind 127.0.0.1", host)


def api_app(generate: Callable[[ChatBody | CompletionBody, Request], Awaitable[Response]],
            models: Callable[[], Awaitable[dict]], healthy: Callable[[], Awaitable[bool]],
            metrics: Callable[[], Awaitable[Response]], api_key: str | None = None, lifespan: Any = None,
            max_request_bytes: int = Limits.max_request_bytes, served_model: str | None = None) -> FastAPI:
    """The HTTP surface that `specdec serve` and the replicas' ingress (specdec.serving.replicas) share: the routes,
    the API key check and OpenAI-shaped errors; what answers a request is given. With `api_key`, every route needs
    it but those under /admin/, which check the admin key instead (specdec.serving.admin)."""
    def check_api_key(request: Request) -> None:
        if api_key is None or request.url.path.startswith(ADMIN_PATH):
            return
        if not same_key(presented_key(request), api_key):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: "
                           "<key>')", code="invalid_api_key")

    app = FastAPI(title="specdec", lifespan=lifespan, dependencies=[Depends(check_api_key)])
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    v1 = APIRouter(prefix="/v1")

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return internal_error(f"internal error: {type(exc).__name__}").response(request.url.path)

    @v1.post("/chat/completions", responses=_responses(ChatCompletion, stream=True))
    async def chat_completions(body: ChatBody, request: Request) -> Response:
        return await generate(body, request)

    @v1.post("/completions", responses=_responses(TextCompletion, stream=True))
    async def completions(body: CompletionBody, request: Request) -> Response:
        return await generate(body, request)

    @v1.get("/models", response_model=ModelList, responses=_responses(None))
    async def list_models() -> dict:
        return {"object": "list", "data": [await models()]}

    app.include_router(v1)

    @app.get("/health", response_class=Response, responses={200: {"description": "ready"}, 401: _responses(None)[401],
                                   503: {"description": "not ready: the engine stopped, is stuck in one step, or "
                                                        "the server is shutting down"}})
    async def health() -> Response:
        return Response(status_code=200 if await healthy() else 503)

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus metrics"},
        401: _responses(None)[401]})
    async def get_metrics() -> Response:
        return await metrics()

    def openapi() -> dict:
        """FastAPI's schema, less its 422 (we answer 400 in OpenAI's shape), with `model` limited to the name
        served when it is known."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema["paths"].values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            if served_model is not None:
                for name in ("ChatBody", "CompletionBody"):
                    schemas[name]["properties"]["model"]["enum"] = [served_model]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


class BodyLimit:
    """ASGI middleware: 413 for a request body over `limit` bytes, by its Content-Length before anything is
    read, else as soon as the bytes streamed in pass it; a body within the limit is read here and handed on
    whole (nothing over the limit is ever held or parsed)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        await APIError(413, f"the request body is over this server's limit of {self.limit} bytes",
                       code="request_too_large").response(scope.get("path", ""))(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            return await self.refuse(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self.refuse(scope, receive, send)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> dict:  # the body once, then the real channel (disconnects)
            nonlocal whole
            if whole is None:
                return await receive()
            message, whole = whole, None
            return message

        await self.app(scope, replay, send)
