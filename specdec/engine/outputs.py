"""What a request looks like from outside the engine: its text, its stop strings, its updates and its output (vLLM
v1's `OutputProcessor`). The engine core steps sequences; this module turns what a step kept into text and the
objects every front door reads (`RequestUpdate` per step, `RequestOutput` once finished), so detokenizing and
output assembly change here without touching the step.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdec.engine.sequence import Sequence
from specdec.sampling import TokenLogprob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from specdec.models.llama import LlamaModel


@dataclass
class RequestOutput:
    """What a finished (or streaming) request returns; vLLM-like names."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None
    metrics: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # one per token id, when SamplingParams.logprobs asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token after the first (prompt_logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestUpdate:
    """What one request gained in a step: what every front door (`LLM`, the server's engine thread, the Ray Serve
    replicas) reads of the engine. A finished request's last update carries its whole `output`."""

    request_id: int
    new_token_ids: list[int]
    text: str | None  # the output's text so far (requests added with stream=True; else only with `output`)
    new_logprobs: list[TokenLogprob] | None = None  # one per new token, when SamplingParams.logprobs asked
    prompt_logprobs: list[TokenLogprob] | None = None  # with the request's first update, when it asked for them
    output: RequestOutput | None = None  # the finished request's result (its metrics included)

    @property
    def finished(self) -> bool:
        return self.output is not None


def eos_ids(model: LlamaModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The tokens that end a request: the model's end-of-sequence ids and the tokenizer's."""
    ids = model.config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class IncrementalText:
    """The text of a growing list of output ids, decoding only a short window each step (the prefix/read
    offsets of TGI and vLLM) instead of the whole output: the new text is decode(ids[prefix:]) minus
    decode(ids[prefix:read]), held back while it ends in an incomplete UTF-8 character."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode, self.text, self.prefix, self.read = decode, "", 0, 0

    def update(self, ids: list[int]) -> str:
        before = self.decode(ids[self.prefix:self.read])
        after = self.decode(ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(ids)
        return self.text


class OutputProcessor:
    """Text, stop strings and the updates and outputs of the engine's requests."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._streamed: set[int] = set()  # requests whose updates carry their text so far
        self._texts: dict[int, str] = {}  # finished requests' text, cut before the stop string that ended them
        self._detok: dict[int, IncrementalText] = {}  # sequences whose text is read while they run

    def add(self, seq: Sequence, stream: bool) -> None:
        """stream: every update of this request carries its text so far (decoded incrementally)."""
        if stream:
            self._streamed.add(seq.seq_id)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def text(self, seq: Sequence) -> str:
        """The output text of a running sequence so far, decoded incrementally (stop strings, streaming);
        an incomplete UTF-8 character at the end is held back."""
        detok = self._detok.get(seq.seq_id)
        if detok is None:
            detok = self._detok[seq.seq_id] = IncrementalText(self.decode)
        return detok.update(seq.output_token_ids)

    def stop_string(self, seq: Sequence) -> str | None:
        """The first of the request's stop strings the text now holds (None: none); the request's text is then
        cut before it."""
        if not seq.params.stop:
            return None
        text = self.text(seq)
        hits = [(text.find(s), s) for s in seq.params.stop if s in text]
        if not hits:
            return None
        cut, stop = min(hits)
        self._texts[seq.seq_id] = text[:cut]
        return stop

    def finished(self, seq: Sequence) -> None:
        """The sequence stopped running: its text is no longer decoded step by step."""
        self._detok.pop(seq.seq_id, None)

    def update(self, seq: Sequence, new_ids: list[int], new_logprobs: list[TokenLogprob] | None) -> RequestUpdate:
        """What a step gave the request; a finished one's carries its `output`."""
        first = seq.num_steps == 1 and seq.params.prompt_logprobs is not None
        update = RequestUpdate(seq.seq_id, new_ids, None, new_logprobs, list(seq.prompt_logprobs) if first else None)
        if seq.is_finished:
            update.output = self.output(seq)
            update.text = update.output.text
        elif seq.seq_id in self._streamed:
            update.text = self.text(seq)
        return update

    def output(self, seq: Sequence) -> RequestOutput:
        """A finished request's result, handed out once: this processor forgets the request."""
        text = self._texts.pop(seq.seq_id, None)
        if text is None:
            text = self.decode(seq.output_token_ids)
        self._streamed.discard(seq.seq_id)
        return RequestOutput(seq.seq_id, None, seq.prompt_token_ids, seq.output_token_ids, text,
                             seq.finish_reason, seq.stop_reason, request_metrics(seq),
                             list(seq.logprobs) if seq.params.logprobs is not None else None,
                             list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None)


def request_metrics(seq: Sequence) -> dict:
    """Timing and speculation metrics of one request. acceptance_length = tokens emitted per target
    forward, bonus tokens included (TPC in the Meta paper, Spec-Bench's mean accepted tokens)."""
    n = seq.num_output_tokens
    end = seq.finish_time or time.perf_counter()
    ttft = (seq.first_token_time - seq.arrival_time) if seq.first_token_time else None
    decode_s = (end - seq.first_token_time) if seq.first_token_time else 0.0
    spec = seq.spec
    return {
        "num_drafts": spec.num_drafts,
        "num_draft_tokens": spec.num_draft_tokens,
        "num_accepted_tokens": spec.num_accepted_tokens,
        "accepted_per_pos": list(spec.accepted_per_pos),
        "acceptance_rate": spec.num_accepted_tokens / spec.num_draft_tokens if spec.num_draft_tokens else None,
        "acceptance_length": n / seq.num_steps if seq.num_steps else None,
        "num_prompt_tokens": seq.num_prompt_tokens,
        "num_cached_tokens": seq.num_prefix_hit,  # prompt tokens served from the prefix cache
        "num_generated_tokens": n,
        "num_steps": seq.num_steps,
        "ttft_s": ttft,
        "decode_s": decode_s,
        "e2e_s": end - seq.arrival_time,
        "tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
        "grammar_s": seq.grammar.seconds if seq.grammar is not None else None,  # structured output's masks
    }
