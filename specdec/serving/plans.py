"""OpenAI's requests, checked and planned: a chat or completions body becomes what the engine runs (`Plan`: for
each choice a function that returns its prompt ids and SamplingParams, run later on the engine thread, where the
tokenizer lives). The Responses and Messages APIs turn their bodies into a chat body and plan it here, so every
check, limit and constraint below applies to them unchanged.

Every field is checked here, where its name is known, so a bad one is a 400 naming it. What the model allows
(its context, vocabulary, grammar check, tokenizer) comes as values in a `ServedModel`; nothing here touches the
engine.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from specdec.config import MAX_LOGPROBS, SamplingParams, SpecdecError, StructuredOutput, from_kwargs
from specdec.serving.api import APIError, Body, ChatBody, CompletionBody, Limits, check_text
from specdec.serving.served_model import ServedModel
from specdec.serving.tool_calls import ToolError, Tools, constraint, default_conversation, parse_tools


def _is_set(value: Any) -> bool:
    return value not in (None, False, 0, 0.0, "", [], {})


# Fields a client may send whose effect we do not provide: refused rather than silently ignored, so a client
# never takes an answer without the effect it asked for.
UNSUPPORTED_FIELDS: dict[str, Callable[[Any], bool]] = {
    "suffix": _is_set, "functions": _is_set, "function_call": _is_set,
    "skip_special_tokens": lambda v: v is False,  # answers always leave special tokens out
}

# Structured output: OpenAI's response_format, vLLM's guided_* fields and its newer structured_outputs dict.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar",
                 "guided_choice": "choice"}
STRUCTURED_FIELDS = ("response_format", *GUIDED_FIELDS, "structured_outputs")

MAX_CONSTRAINT_DEPTH = 64  # nesting of a structured output constraint (schemas are compiled recursively)


def _depth(value: Any, limit: int = MAX_CONSTRAINT_DEPTH + 1) -> int:
    """Nesting depth of JSON-like data, counted no further than `limit`."""
    if limit <= 0 or not isinstance(value, (dict, list)):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(c, limit - 1) for c in children), default=0)


def structured_output(body: ChatBody | CompletionBody) -> tuple[StructuredOutput | None, str | None]:
    """The request's constraint and the field it came from, or (None, None); APIError 400 naming the field
    when it is malformed or more than one is given."""
    given = {name: getattr(body, name) for name in STRUCTURED_FIELDS}
    found: list[tuple[str, dict]] = []
    fmt = given["response_format"]
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise APIError(400, "response_format must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                           param="response_format")
        if fmt["type"] == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise APIError(400, "response_format.json_schema.schema must be given, a JSON schema object",
                               param="response_format.json_schema.schema")
            found.append(("response_format", {"json": spec["schema"]}))
    for name, key in GUIDED_FIELDS.items():
        if given[name] is not None:
            found.append((name, {key: given[name]}))
    if given["structured_outputs"] is not None:
        so = given["structured_outputs"]
        if not isinstance(so, dict):
            raise APIError(400, "structured_outputs must be an object such as {\"json\": {...}}",
                           param="structured_outputs")
        found.append(("structured_outputs", so))
    if not found:
        return None, None
    for name, spec in found:
        if _depth(spec) > MAX_CONSTRAINT_DEPTH:
            raise APIError(400, f"{name} nests deeper than {MAX_CONSTRAINT_DEPTH} levels", param=name)
    if len(found) > 1:
        raise APIError(400, f"give one structured output constraint, not {[f for f, _ in found]}",
                       param=found[1][0])
    name, kwargs = found[0]
    try:
        return from_kwargs(StructuredOutput, kwargs), name
    except SpecdecError as e:
        raise APIError(400, f"{name}: {e}", param=name) from None


Prepare = Callable[[], tuple[list[int], SamplingParams]]


@dataclass
class Plan:
    """One request, checked: what the engine runs for each choice and what the response needs."""

    chat: bool
    rid: str
    prepares: list[Prepare]  # one per choice, run on the engine thread: (prompt ids, final params)
    shares: list[int | None]  # per choice: the earlier choice with the same prompt, whose K/V blocks it shares
    prompt_field: str
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False  # the response carries log-probabilities
    echo: bool = False  # completions with echo: the prompt's text (and logprobs) before the completion's
    zero_tokens: bool = False  # echo with max_tokens 0: the prompt alone (one token is run for its logprobs)
    tools: Tools | None = None
    stops: list[str] = field(default_factory=list)
    stop_reasons: bool = False  # each choice also says what ended it (`stop_reason`: Messages' stop_sequence)
    record: bool = True  # written by --record-traffic when it finishes (the request's `record` field)

    @property
    def n(self) -> int:
        return len(self.prepares)


class Planner:
    """Maps bodies to plans for one served model."""

    def __init__(self, model: ServedModel, limits: Limits) -> None:
        self.model, self.limits = model, limits

    def plan(self, body: ChatBody | CompletionBody) -> Plan:
        """The request checked and planned; APIError (4xx naming the field) when it cannot be served."""
        self.check_fields(body)
        self.check_model(body.model)
        chat = isinstance(body, ChatBody)
        tools = self.tools(body) if chat else None
        params, max_tokens, max_field, constraint_field = self.sampling_params(body, tools)
        echo = bool(not chat and body.echo)
        zero = max_tokens == 0
        if zero and not echo:
            raise APIError(400, f"invalid {max_field}=0: must be at least 1 (0 only with echo)", param=max_field)
        if echo and params.logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=params.logprobs)
        n = 1 if body.n is None else body.n
        if not 1 <= n <= self.limits.max_choices:
            raise APIError(400, f"invalid n={n}: must be in [1, {self.limits.max_choices}]", param="n")
        if not chat and body.best_of not in (None, n):
            raise APIError(400, f"best_of={body.best_of} is not supported: every choice is returned, so best_of "
                           "must equal n (or be left out)", param="best_of")
        prompts, prompt_field = self.prompts(body, tools)
        if len(prompts) * n > self.limits.max_choices:
            raise APIError(400, f"{len(prompts)} prompts times n={n} make {len(prompts) * n} choices; this server "
                           f"returns at most {self.limits.max_choices} per request", param="n")
        prepares, shares = [], []
        for tokenize in prompts:
            first = len(prepares)
            for j in range(n):
                seed = None if params.seed is None else (params.seed + j) % 2**64  # each choice its own stream
                choice = dataclasses.replace(params, seed=seed) if j else params
                prepares.append(self.preparer(tokenize, choice, None if zero else max_tokens, max_field, prompt_field,
                                              constraint_field, zero))
                shares.append(None if j == 0 else first)
        return Plan(chat, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", prepares, shares, prompt_field,
                    bool(body.stream), bool(body.stream_options and body.stream_options.include_usage),
                    params.logprobs is not None, echo, zero, tools, params.stop, record=body.record)

    def check_fields(self, body: Body) -> None:
        """A field no endpoint knows is a 400 naming it (OpenAI's words; the Messages API's shape under
        /v1/messages), unless the operator allows unknown fields (`Limits.allow_unknown_fields`)."""
        unknown = [] if self.limits.allow_unknown_fields else body.unknown_fields()
        if unknown:
            raise APIError(400, f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])

    def check_model(self, model: str) -> None:
        if model != self.model.name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model.name!r}",
                           param="model", code="model_not_found")

    def tools(self, body: ChatBody) -> Tools | None:
        try:
            tools = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        except ToolError as e:
            raise APIError(400, str(e), param=e.param) from None
        if tools is not None:
            if _depth(body.tools) > MAX_CONSTRAINT_DEPTH:
                raise APIError(400, f"tools nest deeper than {MAX_CONSTRAINT_DEPTH} levels", param="tools")
            if tools.choice != "none" and structured_output(body)[0] is not None:
                raise APIError(400, "tools with tool_choice other than \"none\" cannot be combined with a structured "
                               "output constraint (response_format, guided_*); give one of them", param="tool_choice")
        return tools

    def sampling_params(self, body: ChatBody | CompletionBody, tools: Tools | None = None
                        ) -> tuple[SamplingParams, int | None, str, str | None]:
        """Validate sampling fields here, where we still know their names; max_tokens is settled on the engine
        thread once the prompt length is known. Also returns the field a structured output constraint came from
        (its grammar is compiled on the engine thread, which names it in an error)."""
        for name, refused in UNSUPPORTED_FIELDS.items():
            value = getattr(body, name, None)
            if refused(value):
                hint = "; use tools and tool_choice" if name.startswith("function") else "; leave it out"
                raise APIError(400, f"{name}={json.dumps(value)[:80]} is not supported by this server{hint}",
                               param=name, code="unsupported_parameter")
        max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is not None and max_tokens < 0:
            raise APIError(400, f"invalid {max_field}={max_tokens}: must be at least 1", param=max_field)
        temperature = 1.0 if body.temperature is None else body.temperature
        if not 0 <= temperature <= 2:
            raise APIError(400, f"invalid temperature={temperature}: must be in [0, 2]", param="temperature")
        if body.seed is not None and not -2**63 <= body.seed < 2**64:
            raise APIError(400, f"invalid seed={body.seed}: must fit in 64 bits", param="seed")
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > self.limits.max_stop:
            raise APIError(400, f"stop holds {len(stops)} strings; this server takes at most {self.limits.max_stop}",
                           param="stop")
        for i, stop in enumerate(stops):
            if len(stop) > self.limits.max_stop_chars:
                raise APIError(400, f"stop[{i}] has {len(stop)} characters; this server takes at most "
                               f"{self.limits.max_stop_chars}", param="stop")
            check_text(stop, f"stop[{i}]")
        constraint_, constraint_field = structured_output(body)
        if tools is not None and tools.choice != "none":
            constraint_, constraint_field = constraint(tools), "tools"
        if isinstance(body, ChatBody):
            top = body.top_logprobs
            if top is not None and not 0 <= top <= MAX_LOGPROBS:
                raise APIError(400, f"invalid top_logprobs={top}: must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
            if top and not body.logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
            logprobs = (top or 0) if body.logprobs else None
        else:  # its range is SamplingParams' to check, under the same name
            logprobs = body.logprobs
        penalties = {"logprobs": logprobs, "presence_penalty": body.presence_penalty or 0.0,
                     "frequency_penalty": body.frequency_penalty or 0.0,
                     "repetition_penalty": 1.0 if body.repetition_penalty is None else body.repetition_penalty,
                     "logit_bias": self.logit_bias(body.logit_bias)}
        try:
            params = SamplingParams(temperature=temperature, top_p=1.0 if body.top_p is None else body.top_p,
                                    top_k=body.top_k or 0, min_p=body.min_p or 0.0, seed=body.seed,
                                    max_tokens=max_tokens or 1, stop=body.stop, ignore_eos=body.ignore_eos,
                                    stop_token_ids=self.stop_token_ids(body.stop_token_ids),
                                    structured_output=constraint_, **penalties)
        except SpecdecError as e:  # "invalid top_p=1.5: must be in (0, 1]"
            match = re.match(r"invalid (\w+)=", str(e))
            raise APIError(400, str(e), param=match[1] if match else None) from None
        return params, max_tokens, max_field, constraint_field

    def stop_token_ids(self, ids: list[int] | None) -> list[int] | None:
        """vLLM's stop_token_ids, checked against this vocabulary and the stop limit."""
        if ids is None:
            return None
        if len(ids) > self.limits.max_stop:
            raise APIError(400, f"stop_token_ids holds {len(ids)} ids; this server takes at most "
                           f"{self.limits.max_stop}", param="stop_token_ids")
        vocab = self.model.vocab_size
        for i, token in enumerate(ids):
            if not 0 <= token < vocab:
                raise APIError(400, f"stop_token_ids[{i}]={token} is not a token id of this model's vocabulary "
                               f"(integers 0 to {vocab - 1})", param="stop_token_ids")
        return ids

    def logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI's logit_bias (token ids as strings) as token ids of this vocabulary; SamplingParams checks the
        biases."""
        if not bias:
            return None
        vocab = self.model.vocab_size
        for key in bias:
            if not key.strip().isdigit() or int(key) >= vocab:
                raise APIError(400, f"logit_bias key {key[:40]!r} is not a token id of this model's vocabulary "
                               f"(integers 0 to {vocab - 1})", param="logit_bias")
        return {int(key): value for key, value in bias.items()}

    def preparer(self, tokenize: Callable[[], list[int]], params: SamplingParams, max_tokens: int | None,
                 max_field: str, prompt_field: str, constraint_field: str | None = None, zero: bool = False) -> Prepare:
        def prepare() -> tuple[list[int], SamplingParams]:
            if constraint_field is not None:
                try:  # compiled once here (cached by its text) to name the field; the engine reuses it
                    self.model.check_structured_output(params)
                except SpecdecError as e:
                    raise APIError(400, f"{constraint_field}: {e}", param=constraint_field) from None
            ids = tokenize()
            n, limit = len(ids), self.model.max_model_len
            if n >= limit:
                raise APIError(400, f"the prompt has {n} tokens but the model's context is {limit} tokens; "
                               f"shorten it to at most {limit - 1}", param=prompt_field, code="context_length_exceeded")
            if max_tokens is not None and n + max_tokens > limit:
                raise APIError(400, f"{max_field}={max_tokens} plus the prompt's {n} tokens exceeds the model's "
                               f"context of {limit} tokens; ask for at most {limit - n}", param=max_field,
                               code="context_length_exceeded")
            if zero:
                return ids, dataclasses.replace(params, max_tokens=1)
            cap = self.limits.default_max_tokens
            default = limit - n if cap is None else min(limit - n, cap)
            return ids, dataclasses.replace(params, max_tokens=max_tokens or default)
        return prepare

    def prompts(self, body: ChatBody | CompletionBody, tools: Tools | None
                ) -> tuple[list[Callable[[], list[int]]], str]:
        """Each prompt's tokenizer (run on the engine thread), and the prompts' field."""
        if isinstance(body, ChatBody):
            return [self.chat_tokenizer(body, tools)], "messages"
        prompts = body.prompt
        if not (isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))):
            prompts = [prompts]
        out = []
        for i, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str):
                check_text(prompt, where)
                self.check_chars(len(prompt), "prompt")
                out.append(functools.partial(self.model.encode, prompt))
            else:
                out.append(functools.partial(list, prompt))
        return out, "prompt"

    def chat_tokenizer(self, body: ChatBody, tools: Tools | None) -> Callable[[], list[int]]:
        if not body.messages:
            raise APIError(400, "messages must contain at least one message", param="messages")
        messages = []
        for i, m in enumerate(body.messages):
            content = _text_content(m.content, i)
            check_text(content, f"messages[{i}].content")
            # a developer message is what the chat templates we serve call a system message
            message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
            if m.role == "assistant" and m.tool_calls:
                message["tool_calls"] = [_checked_call(c, i, j) for j, c in enumerate(m.tool_calls)]
            if m.role == "tool":
                if m.tool_call_id is None:  # as OpenAI and vLLM answer: the call it answers cannot be told
                    raise APIError(400, f"messages[{i}].tool_call_id is required: a tool message gives the id of the "
                                   "tool call it answers", param="messages", code="missing_required_parameter")
                message["tool_call_id"] = m.tool_call_id
            messages.append(message)
        self.check_chars(sum(len(m["content"]) + len(json.dumps(m.get("tool_calls", ""))) for m in messages)
                         + len(json.dumps(body.tools or [])), "messages")
        if self.model.renders_tools:
            offered = [{"type": "function", "function": f} for f in tools.offered] if tools else None
            return lambda: self.model.chat(messages, offered)
        conversation = default_conversation(messages, tools)
        return lambda: self.model.chat(conversation, None)

    def check_chars(self, chars: int, field: str) -> None:
        """A prompt too long for the context whatever its tokens, refused before tokenizing it."""
        limit, most = self.model.max_model_len, self.model.max_token_chars
        if chars > (limit - 1) * most:
            raise APIError(400, f"{field}: {chars} characters of text, more than the model's context of {limit} "
                           f"tokens can hold (a token covers at most {most}); shorten it", param=field,
                           code="context_length_exceeded")


def _checked_call(call: Any, i: int, j: int) -> dict:
    """An assistant message's tool call as the template and the default format read it."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
            or not isinstance(fn.get("arguments", "{}"), (str, dict)):
        raise APIError(400, f"messages[{i}].tool_calls[{j}] must be {{\"id\": ..., \"type\": \"function\", "
                       "\"function\": {\"name\": ..., \"arguments\": \"<JSON>\"}}", param="messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError:
            raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not JSON",
                           param="messages") from None
    return {"id": call.get("id") or f"call_{j}", "type": "function",
            "function": {"name": fn["name"], "arguments": args}}


def _text_content(content: str | list[dict[str, Any]] | None, index: int) -> str:
    """OpenAI clients may send content as parts; only text parts are understood."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, f"messages[{index}].content: only text parts are supported, got "
                           f"{part.get('type')!r}", param="messages")
        texts.append(part["text"])
    return "".join(texts)


def checked_chat(chat: dict, field: str) -> ChatBody:
    """A chat body built from another API's body (Responses, Messages, /tokenize); what it cannot hold is a 400
    naming `field`."""
    try:
        return ChatBody.model_validate(chat)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"{field}: invalid value at {where}: {err['msg']}", param=field) from None


@contextlib.contextmanager
def renamed_fields(names: dict[str, str]) -> Iterator[None]:
    """An APIError about a chat field, raised while another API's request is planned or admitted, names that API's
    field instead (Responses' max_output_tokens for max_completion_tokens)."""
    try:
        yield
    except APIError as e:
        if e.param in names:
            e.message = e.message.replace(e.param, names[e.param])
            e.param = names[e.param]
        raise
