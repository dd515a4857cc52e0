"""OpenAI's answers: what the engine produced for a plan (`RequestOutput`s, or the text as it grows) becomes the
chat or completions JSON (`OpenAIFormat.answer`) or its SSE chunks (`ChoiceStream`): text, logprobs, tool calls,
usage. The Responses and Messages APIs read these chat shapes and rewrite them in their own
(specdec.serving.responses_api, specdec.serving.messages_api), so tool-call parsing and stop-string holding live
here alone.
"""
from __future__ import annotations

import itertools

from specdec.engine.outputs import RequestOutput
from specdec.sampling import TokenLogprob
from specdec.serving.plans import Plan
from specdec.serving.served_model import ServedModel
from specdec.serving.tool_calls import StreamParser, ToolCall, Tools


class OpenAIFormat:
    """Formats one served model's outputs in OpenAI's shapes."""

    def __init__(self, model: ServedModel) -> None:
        self.model = model

    def answer(self, plan: Plan, outputs: list[RequestOutput], created: int) -> dict:
        """A non-streaming request's JSON body."""
        choices = []
        for index, out in enumerate(outputs):
            tokens, logprobs, text = self.choice_tokens(plan, out)
            lps = self.logprobs_json(logprobs, plan.chat, 0, tokens) if plan.logprobs else None
            choice = {"index": index, "logprobs": lps, "finish_reason": out.finish_reason}
            if plan.stop_reasons:
                choice["stop_reason"] = out.stop_reason  # the stop string or token that ended it (vLLM's field)
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
                "created": created, "model": self.model.name, "choices": choices, "usage": usage(plan, outputs)}

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
        text = self.model.token_text
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

    def chunk(self, plan: Plan, created: int, choice: dict, usage_: dict | None = None) -> dict:
        """One SSE chunk's body."""
        body = {"id": plan.rid, "object": "chat.completion.chunk" if plan.chat else "text_completion",
                "created": created, "model": self.model.name, "choices": [choice] if choice else []}
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

    def __init__(self, protocol: OpenAIFormat, plan: Plan, index: int) -> None:
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
            if self.plan.stop_reasons:
                chunks[-1]["stop_reason"] = out.stop_reason
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
        self.offset += sum(len(self.protocol.model.token_text(e.token)) for e in self.pending)
        self.pending = []
        return lps

    def _choice(self, delta: dict, finish: str | None = None, with_logprobs: bool = True) -> dict:
        return {"index": self.index, "delta": delta, "logprobs": self._logprobs() if with_logprobs else None,
                "finish_reason": finish}

    def _text_choice(self, text: str, logprobs: dict | None, finish: str | None = None) -> dict:
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
