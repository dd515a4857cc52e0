"""The OpenAI protocol, both ways: a chat or completions body becomes what the engine runs (`Plan`: prompt ids
and SamplingParams per choice, tokenized later on the engine thread), and what the engine produces becomes
OpenAI's JSON (`answer`) or its SSE chunks (`ChoiceStream`): text, logprobs, tool calls, usage.

Every field is checked here, where its name is known, so a bad one is a 400 naming it. Nothing here touches the
engine: `specdec.serving.server` runs plans on its engine thread and hands the outputs back.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdec.config import MAX_LOGPROBS, SamplingParams, SpecdecError, StructuredOutput, from_kwargs
from specdec.engine.outputs import RequestOutput
from specdec.llm import LLM
from specdec.sampling import TokenLogprob
from specdec.serving.api import APIError, ChatBody, CompletionBody, Limits, check_text
from specdec.serving.tool_calls import (
    StreamParser,
    ToolCall,
    ToolError,
    Tools,
    constraint,
    default_conversation,
    parse_tools,
)


def _is_set(value: Any) -> bool:
    return value not in (None, False, 0, 0.0, "", [], {})


# Fields a client may send whose effect we do not provide: refused rather than silently ignored, so a client
# never takes an answer without the effect it asked for.
UNSUPPORTED_FIELDS: dict[str, Callable[[Any], bool]] = {
    "suffix": _is_set, "functions": _is_set, "function_call": _is_set,
}

# Structured output: OpenAI's response_format, vLLM's guided_* fields and its newer structured_outputs dict.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar",
                 "guided_choice": "choice"}

MAX_CONSTRAINT_DEPTH = 64  # nesting of a structured output constraint (schemas are compiled recursively)


def _depth(value: Any, limit: int = MAX_CONSTRAINT_DEPTH + 1) -> int:
    """Nesting depth of JSON-like data, counted no further than `limit`."""
    if limit <= 0 or not isinstance(value, (dict, list)):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(c, limit - 1) for c in children), default=0)


def structured_output(extra: dict[str, Any]) -> tuple[StructuredOutput | None, str | None]:
    """The request's constraint and the field it came from, or (None, None); APIError 400 naming the field
    when it is malformed or more than one is given."""
    found: list[tuple[str, dict]] = []
    fmt = extra.get("response_format")
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
        if extra.get(name) is not None:
            found.append((name, {key: extra[name]}))
    if extra.get("structured_outputs") is not None:
        so = extra["structured_outputs"]
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

    @property
    def n(self) -> int:
        return len(self.prepares)


class OpenAIProtocol:
    """Maps bodies to plans and outputs to responses for one served model."""

    def __init__(self, llm: LLM, model: str, limits: Limits) -> None:
        self.llm, self.model, self.limits = llm, model, limits
        # the most characters one token stands for: a prompt longer than the context times this cannot fit,
        # so it is refused without tokenizing it
        self.max_token_chars = max(map(len, llm.tokenizer.get_vocab()), default=1)

    # -- request -> plan -----------------------------------------------------------------------------------
    def plan(self, body: ChatBody | CompletionBody) -> Plan:
        """The request checked and planned; APIError (4xx naming the field) when it cannot be served."""
        if body.model != self.model:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {self.model!r}",
                           param="model", code="model_not_found")
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
                    params.logprobs is not None, echo, zero, tools, params.stop)

    def tools(self, body: ChatBody) -> Tools | None:
        try:
            tools = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        except ToolError as e:
            raise APIError(400, str(e), param=e.param) from None
        if tools is not None:
            if _depth(body.tools) > MAX_CONSTRAINT_DEPTH:
                raise APIError(400, f"tools nest deeper than {MAX_CONSTRAINT_DEPTH} levels", param="tools")
            if tools.choice != "none" and structured_output(body.model_extra or {})[0] is not None:
                raise APIError(400, "tools with tool_choice other than \"none\" cannot be combined with a structured "
                               "output constraint (response_format, guided_*); give one of them", param="tool_choice")
        return tools

    def sampling_params(self, body: ChatBody | CompletionBody, tools: Tools | None = None
                        ) -> tuple[SamplingParams, int | None, str, str | None]:
        """Validate sampling fields here, where we still know their names; max_tokens is settled on the engine
        thread once the prompt length is known. Also returns the field a structured output constraint came from
        (its grammar is compiled on the engine thread, which names it in an error)."""
        for name, value in (body.model_extra or {}).items():
            if name in UNSUPPORTED_FIELDS and UNSUPPORTED_FIELDS[name](value):
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
        constraint_, constraint_field = structured_output(body.model_extra or {})
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
                                    structured_output=constraint_, **penalties)
        except SpecdecError as e:  # "invalid top_p=1.5: must be in (0, 1]"
            match = re.match(r"invalid (\w+)=", str(e))
            raise APIError(400, str(e), param=match[1] if match else None) from None
        return params, max_tokens, max_field, constraint_field

    def logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI's logit_bias (token ids as strings) as token ids of this vocabulary; SamplingParams checks the
        biases."""
        if not bias:
            return None
        vocab = self.llm.vocab_size
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
                    self.llm.check_structured_output(params)
                except SpecdecError as e:
                    raise APIError(400, f"{constraint_field}: {e}", param=constraint_field) from None
            ids = tokenize()
            n, limit = len(ids), self.llm.max_model_len
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
                out.append(functools.partial(lambda p: self.llm.encode(p)[1], prompt))
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
        if self.llm.renders_tools:
            offered = [{"type": "function", "function": f} for f in tools.offered] if tools else None
            return lambda: self.llm.apply_chat_template(messages, offered)
        conversation = default_conversation(messages, tools)
        return lambda: self.llm.apply_chat_template(conversation)

    def check_chars(self, chars: int, field: str) -> None:
        """A prompt too long for the context whatever its tokens, refused before tokenizing it."""
        limit = self.llm.max_model_len
        if chars > (limit - 1) * self.max_token_chars:
            raise APIError(400, f"{field}: {chars} characters of text, more than the model's context of {limit} "
                           f"tokens can hold (a token covers at most {self.max_token_chars}); shorten it", param=field,
                           code="context_length_exceeded")

    # -- outputs -> response -------------------------------------------------------------------------------
    def answer(self, plan: Plan, outputs: list[RequestOutput], created: int) -> dict:
        """A non-streaming request's JSON body."""
        choices = []
        for index, out in enumerate(outputs):
            tokens, logprobs, text = self.choice_tokens(plan, out)
            lps = self.logprobs_json(logprobs, plan.chat, 0, tokens) if plan.logprobs else None
            choice = {"index": index, "logprobs": lps, "finish_reason": out.finish_reason}
            if plan.chat:
                content, calls = text, []
                if plan.tools is not None and plan.tools.choice != "none":
                    parser = StreamParser({f["name"] for f in plan.tools.offered})
                    content, calls = parser.feed(text)
                    content += _rest(parser, plan.tools)
                message = {"role": "assistant", "content": content or (None if calls else "")}
                if calls:
                    message["tool_calls"] = [c.json() for c in calls]
                    choice["finish_reason"] = _tool_finish(out.finish_reason)
                choice["message"] = message
            else:
                choice["text"] = text
            choices.append(choice)
        return {"id": plan.rid, "object": "chat.completion" if plan.chat else "text_completion",
                "created": created, "model": self.model, "choices": choices, "usage": usage(plan, outputs)}

    def choice_tokens(self, plan: Plan, out: RequestOutput) -> tuple[list[int], list[TokenLogprob | None] | None, str]:
        """A choice's tokens, logprobs and text as the response shows them: with echo the prompt (its text as
        the engine thread decoded it, `out.prompt`) comes first, its first token without a logprob; with
        max_tokens 0 nothing after it."""
        tokens, logprobs, text = list(out.token_ids), out.logprobs, out.text
        if plan.zero_tokens:
            tokens, logprobs, text = [], [] if logprobs is not None else None, ""
        if plan.echo:
            tokens = out.prompt_token_ids + tokens
            if logprobs is not None:
                logprobs = [None] + list(out.prompt_logprobs or []) + list(logprobs)
            text = (out.prompt or "") + text
        return tokens, logprobs, text

    def logprobs_json(self, entries: list[TokenLogprob | None] | None, chat: bool, offset: int = 0,
                      tokens: list[int] | None = None) -> dict | None:
        """OpenAI's logprobs object: chat's `content` entries, or the completions' parallel lists (`text_offset`
        counted from `offset` characters into the text; an entry None is an echoed first prompt token, whose id
        is `tokens[0]`)."""
        if entries is None:
            return None
        text = self.token_text
        if chat:
            def one(token: int, logprob: float) -> dict:
                s = text(token)
                return {"token": s, "logprob": logprob, "bytes": list(s.encode())}

            return {"content": [one(e.token, e.logprob) | {"top_logprobs": [one(t, v) for t, v in e.top]}
                                for e in entries]}
        ids = [e.token if e is not None else tokens[0] for e in entries]
        strings = [text(t) for t in ids]
        return {"tokens": strings, "token_logprobs": [e.logprob if e is not None else None for e in entries],
                "top_logprobs": [{text(t): v for t, v in e.top} if e is not None else None for e in entries],
                "text_offset": list(itertools.accumulate((len(s) for s in strings[:-1]), initial=offset))
                if strings else []}

    @functools.lru_cache(maxsize=65536)  # noqa: B019  one protocol per server; a token's text never changes
    def token_text(self, token: int) -> str:
        return self.llm.tokenizer.decode([token], skip_special_tokens=False)

    def chunk(self, plan: Plan, created: int, choice: dict, usage_: dict | None = None) -> dict:
        """One SSE chunk's body."""
        body = {"id": plan.rid, "object": "chat.completion.chunk" if plan.chat else "text_completion",
                "created": created, "model": self.model, "choices": [choice] if choice else []}
        if plan.include_usage:
            body["usage"] = usage_  # null on every chunk but the last
        return body


def _rest(parser: StreamParser, tools: Tools) -> str:
    """The text left at the end: content, except a call cut short (finish "length") where only calls may be
    written (required, a named function): there it is no answer at all."""
    rest = parser.finish()
    return "" if tools.choice in ("required", "function") else rest


def _tool_finish(reason: str | None) -> str | None:
    return "tool_calls" if reason == "stop" else reason


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


def usage(plan: Plan, outputs: list[RequestOutput]) -> dict:
    """Tokens of the request: its prompts counted once each (choices share them), every choice's completion."""
    prompts = sum(len(out.prompt_token_ids) for i, out in enumerate(outputs) if plan.shares[i] is None)
    completion = 0 if plan.zero_tokens else sum(len(out.token_ids) for out in outputs)
    metrics = [out.metrics for out in outputs]
    generated = sum(len(out.token_ids) for out in outputs)
    steps = sum(m.get("num_steps") or 0 for m in metrics)
    return {"prompt_tokens": prompts, "completion_tokens": completion, "total_tokens": prompts + completion,
            "acceptance_length": generated / steps if steps else None,  # tokens per target forward, all choices
            "num_drafts": sum(m.get("num_drafts", 0) for m in metrics),
            "num_draft_tokens": sum(m.get("num_draft_tokens", 0) for m in metrics),
            "num_accepted_tokens": sum(m.get("num_accepted_tokens", 0) for m in metrics)}


# -- streaming ------------------------------------------------------------------------------------------------
def streamable_length(text: str, stops: list[str]) -> int:
    """How much of `text` may be sent now: not a trailing incomplete UTF-8 character ("\\ufffd"), and not
    a tail that could still grow into a stop string (text past a stop string must never be sent)."""
    end = len(text.rstrip("\ufffd"))
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, end), held, -1):
            if text.startswith(stop[:k], end - k):
                held = k
                break
    return end - held


class ChoiceStream:
    """One choice's SSE deltas: its text's new suffix as it becomes safe to send (never past a stop string, never
    half a character), with the logprobs of the tokens since the previous chunk, tool calls once complete, and
    last the rest of the final text with the finish reason."""

    def __init__(self, protocol: OpenAIProtocol, plan: Plan, index: int) -> None:
        self.protocol, self.plan, self.index = protocol, plan, index
        self.sent = ""  # text sent so far (of the generated text; an echoed prompt goes first, separately)
        self.pending: list[TokenLogprob] = []  # logprobs received and not sent yet
        self.count, self.offset = 0, 0  # logprobs sent, and the characters of their tokens (text_offset)
        tools = plan.tools
        self.parser = StreamParser({f["name"] for f in tools.offered}) if tools and tools.choice != "none" else None
        self.calls = 0

    def start(self) -> list[dict]:
        """The first chunks: chat's role, or an echoed prompt (and its logprobs)."""
        if self.plan.chat:
            return [self._choice({"role": "assistant", "content": ""}, with_logprobs=False)]
        return []

    def echo(self, prompt: str, prompt_ids: list[int], prompt_logprobs: list[TokenLogprob] | None) -> list[dict]:
        """Completions with echo: the prompt first (and its logprobs, known once it was prefilled)."""
        lps = None
        if self.plan.logprobs:
            lps = self.protocol.logprobs_json([None] + list(prompt_logprobs or []), False, 0, prompt_ids)
        self.offset = len(prompt)
        return [self._text_choice(prompt, lps)]

    def update(self, text: str, logprobs: list[TokenLogprob] | None) -> list[dict]:
        """A step's progress: the whole generated text so far and the new tokens' logprobs."""
        self.pending += logprobs or []
        if self.plan.zero_tokens:
            return []
        safe = streamable_length(text, self.plan.stops)
        if safe <= len(self.sent) or not text.startswith(self.sent):
            return []
        delta, self.sent = text[len(self.sent):safe], text[:safe]
        return self._deltas(delta)

    def finish(self, out: RequestOutput) -> list[dict]:
        """The last chunks: the rest of the final (stop-truncated) text and the finish reason."""
        self.pending = list(out.logprobs[self.count:]) if out.logprobs is not None else []
        if self.plan.zero_tokens:
            self.pending, rest = [], ""
        else:
            rest = out.text[len(self.sent):] if out.text.startswith(self.sent) else ""
        chunks = self._deltas(rest, final=True) if rest or self.pending or self.parser else []
        reason = _tool_finish(out.finish_reason) if self.calls else out.finish_reason
        if self.plan.chat:
            chunks.append(self._choice({}, reason, with_logprobs=False))
        elif chunks:
            chunks[-1]["finish_reason"] = reason
        else:
            chunks.append(self._text_choice("", None, reason))
        return chunks

    def _deltas(self, delta: str, final: bool = False) -> list[dict]:
        if not self.plan.chat:
            return [self._text_choice(delta, self._logprobs())]
        calls: list[ToolCall] = []
        if self.parser is not None:
            delta, calls = self.parser.feed(delta)
            if final:
                delta += _rest(self.parser, self.plan.tools)
        chunks = []
        if delta or (self.pending and not calls):
            chunks.append(self._choice({"content": delta}))
        if calls:
            chunks.append(self._choice({"tool_calls": [c.json(self.calls + k) for k, c in enumerate(calls)]}))
            self.calls += len(calls)
        return chunks

    def _logprobs(self) -> dict | None:
        if not (self.plan.logprobs and self.pending):
            return None
        lps = self.protocol.logprobs_json(self.pending, self.plan.chat, self.offset)
        self.count += len(self.pending)
        self.offset += sum(len(self.protocol.token_text(e.token)) for e in self.pending)
        self.pending = []
        return lps

    def _choice(self, delta: dict, finish: str | None = None, with_logprobs: bool = True) -> dict:
        return {"index": self.index, "delta": delta, "logprobs": self._logprobs() if with_logprobs else None,
                "finish_reason": finish}

    def _text_choice(self, text: str, logprobs: dict | None, finish: str | None = None) -> dict:
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
