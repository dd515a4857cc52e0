"""A step's commit, in one direction: first decide what each sequence keeps of the step (`keep`: its tokens up to
the first stop, and why it stops), then account for that one record (`Kept`) once: the scheduler caches it (counts,
blocks, the prefix cache), the drafter takes its target features, the outputs report its tokens.

    fed (a decode step):  [last token, d1, ..., da]     a prefill feeds its uncached prompt tokens instead
    emitted:              [d1, ..., da, bonus]          the accepted drafts, then the target's token after them
    kept:                 the emitted tokens up to and including the first stop (0 .. a + 1 of them)
    cached:               the fed tokens and every kept token but the last

So after a step that emitted, a sequence holds the K/V of all its tokens but its last (`len(token_ids) - 1`), as
plain decoding leaves it, wherever a stop fell: the rows of accepted drafts past a stop are not counted, as the
rows of rejected drafts are not, and nothing trims a count back to the tokens afterwards. (Acceptance statistics
stay verification's, recorded by `Speculator.settle`: a stop after accepted drafts does not make them wrong.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.engine.sequence import Sequence

if TYPE_CHECKING:
    from specdec.engine.outputs import OutputProcessor

GRAMMAR_DONE = "structured output complete: no token may follow"  # the stop reason of a grammar that ended


@dataclass
class StepOutput:
    """What one sequence produced in a step, before any stop applies."""

    num_fed: int  # tokens it fed, from its num_cached on (their K/V are final)
    tokens: list[int] | None  # emitted: its accepted drafts, then one more (None: a prefill chunk short of the prompt)
    features: torch.Tensor | None = None  # target features of the fed tokens, then the accepted drafts [fed + a, F]
    logprobs: list | None = None  # sampling.TokenLogprob per emitted token, when the request asked for them


@dataclass
class Kept:
    """What one sequence keeps of a step, decided once: the scheduler, the drafter and the outputs read this."""

    seq: Sequence
    num_cached: int  # tokens whose K/V the step makes final, counted on from the sequence's num_cached before it
    tokens: list[int] | None  # appended to the sequence (None: a prefill chunk; []: a grammar that had ended)
    features: torch.Tensor | None = None  # the target features of those cached tokens [num_cached, F]
    logprobs: list | None = None  # one per kept token, when the request asked for them
    finish_reason: str | None = None  # "stop" | "length" when the sequence stops here; None: it goes on
    stop_reason: int | str | None = None  # the stop token or string that ended it, or why its grammar did


def keep(seq: Sequence, out: StepOutput, outputs: OutputProcessor) -> Kept:
    """Append to the sequence the tokens it keeps of a step, and say why it stops. Checked for each token in this
    order: its grammar (one that allows no next token, having ended, e.g. past its end under ignore_eos, ends the
    request, and the token is dropped, wherever that falls in the step: a plain step's root row, or the row after
    a drafted stop token), then once it is appended a stop token or end-of-sequence, max_tokens or the context
    limit, a stop string."""
    if out.tokens is None:
        return Kept(seq, out.num_fed, None, out.features)
    seq.num_steps += 1
    kept: list[int] = []
    reason, why = None, None
    for token in out.tokens:
        if seq.grammar is not None and (seq.grammar.dead or not seq.grammar.accept(token)):
            reason, why = "stop", GRAMMAR_DONE
            break
        kept.append(token)
        seq.append(token)
        reason, why = _stop_after(seq, token, outputs)
        if reason is not None:
            break
    num_cached = out.num_fed + len(kept) - 1  # the last kept token is fed next step (or never)
    logprobs = out.logprobs[:len(kept)] if out.logprobs is not None else None
    if logprobs is not None:
        seq.logprobs += logprobs
    features = out.features[:num_cached] if out.features is not None else None
    return Kept(seq, num_cached, kept, features, logprobs, reason, why)


def _stop_after(seq: Sequence, token: int, outputs: OutputProcessor) -> tuple[str | None, int | str | None]:
    """(finish reason, stop reason) once `token` is appended; (None, None) when the sequence goes on."""
    p = seq.params
    if token in p.stop_token_ids or (not p.ignore_eos and token in seq.eos_token_ids):
        return "stop", token
    if seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= seq.max_len:
        return "length", None
    stop = outputs.stop_string(seq)
    return ("stop", stop) if stop is not None else (None, None)
