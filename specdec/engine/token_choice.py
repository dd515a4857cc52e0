"""Logits -> tokens, once for every step kind: a plain step is a speculative step whose drafts are empty.

Sequence i of a step owns 1 + n_i consecutive rows of the step's logits: the distribution after its committed
tokens, then after each of its n_i draft nodes' paths (n_i = 0 in a plain step or a prefill's last chunk).

    logits [T, V] ─┬─> raw copy of the rows whose requests want logprobs (the model's own distribution)
                   ├─> logit_bias and penalties, each row counting the tokens on its own path
                   ├─> grammar masks, each row after its own path (structured output)
                   ├─> verification: greedy (argmax, host lists for chains) or sampled (multi-round rejection
                   │   sampling over trees); with no drafts that is the plain greedy choice or one sample per row
                   └─> logprobs of every emitted token, from the raw row that predicted it

So each sampling feature is written once and holds under speculation by construction: a draft row sees exactly
the distribution plain decoding would see after the same tokens.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from specdec.drafting import Draft
from specdec.engine.sequence import Sequence
from specdec.sampling import (Penalized, SamplingTensors, TokenLogprob, greedy_tokens, logits_to_probs, penalize,
                              sample, token_logprobs)
from specdec.structured import mask_logits
from specdec.tree import PAD, TreeFeed
from specdec.verify import VerifyResult, verify, verify_greedy, verify_greedy_chains


@dataclass
class StepDrafts:
    """What a step feeds after each sequence's last token: nothing in a plain step."""

    tokens: list[list[int]]  # draft node tokens per sequence, a parent before its children
    parents: list[list[int]]  # each node's parent index (-1: the last committed token)
    trees: list[TreeFeed | None]  # the tree feed of a sequence whose draft is not a chain (None: a chain)
    draft: Draft | None = None  # the padded tensors (and the draft distributions q of sampled drafts)

    @classmethod
    def none(cls, num_seqs: int) -> "StepDrafts":
        return cls([[] for _ in range(num_seqs)], [[] for _ in range(num_seqs)], [None] * num_seqs)

    @property
    def counts(self) -> list[int]:
        return [len(t) for t in self.tokens]

    @property
    def any_tree(self) -> bool:
        return any(t is not None for t in self.trees)


@dataclass
class Choice:
    """The tokens a step chose: what verification kept, per sequence, and their logprobs where asked."""

    result: VerifyResult  # accepted draft nodes and emitted tokens (the accepted drafts, then one more)
    logprobs: list[list[TokenLogprob] | None]  # per sequence: one per emitted token, when its request asked
    top1: list[int] | None  # every row's argmax after penalties and masks, where it was computed


def choose_tokens(seqs: list[Sequence], logits: torch.Tensor, drafts: StepDrafts, want_top1: bool = False) -> Choice:
    """Turn a step's logits [T, V] (sequence i's 1 + n_i rows after one another) into the tokens each sequence
    emits. Penalties and masks are applied to `logits` in place. want_top1: return every row's argmax too (a
    drafter that watches the target's guesses)."""
    counts = drafts.counts
    starts = list(itertools.accumulate((1 + n for n in counts), initial=0))  # sequence i's rows: starts[i]..
    asked = [r for i, s in enumerate(seqs) if s.params.logprobs is not None for r in range(starts[i], starts[i + 1])]
    raw = logits[asked] if asked else None  # a copy: the model's own logits, before penalties and masks
    if any(s.params.penalized for s in seqs):  # the target's distribution at every row, before any mask
        penalize(logits, penalty_rows(seqs, drafts.tokens, drafts.parents))
    top = None  # every row's argmax, where masking computed it
    if any(s.grammar is not None for s in seqs):  # row j of a constrained sequence: after node j's path
        top = mask_logits(logits, [(s.grammar, d, p, s.params.greedy)
                                   for s, d, p in zip(seqs, drafts.tokens, drafts.parents)])
    result = _verify(seqs, drafts, logits, top)
    logprobs: list[list[TokenLogprob] | None] = [None] * len(seqs)
    if raw is not None:
        raw_row = {r: k for k, r in enumerate(asked)}
        for i, seq in enumerate(seqs):
            if seq.params.logprobs is not None:  # emitted token j was predicted by the row of kept node j
                kept = [starts[i]] + [starts[i] + 1 + node for node in result.accepted_nodes[i]]
                logprobs[i] = token_logprobs(raw[[raw_row[r] for r in kept]], result.emitted_tokens[i],
                                             seq.params.logprobs)
    top1 = (top or greedy_tokens(logits).tolist()) if want_top1 else None
    return Choice(result, logprobs, top1)


def penalty_rows(seqs: list[Sequence], drafted: list[list[int]], parents: list[list[int]]) -> list[Penalized]:
    """The rows of each penalized sequence in a step's logits: after its output, then after each draft node's path
    (its ancestors and itself), as `sampling.penalize` takes them."""
    out, row = [], 0
    for seq, tokens, links in zip(seqs, drafted, parents):
        if seq.params.penalized:
            paths: list[list[int]] = [[]]
            for token, parent in zip(tokens, links):  # a parent comes before its children
                paths.append(paths[parent + 1] + [token])
            out.append(Penalized(row, seq.params, seq.prompt_token_ids, seq.output_token_ids, paths))
        row += 1 + len(tokens)
    return out


def plain_result(tokens: torch.Tensor) -> VerifyResult:
    """The verification result of a step without drafts: one sampled token per sequence."""
    B = tokens.shape[0]
    zeros = torch.zeros(B, dtype=torch.long)
    return VerifyResult([[] for _ in range(B)], [[t] for t in tokens.tolist()], zeros, zeros - 1, tokens)


def _verify(seqs: list[Sequence], drafts: StepDrafts, logits: torch.Tensor, top: list[int] | None) -> VerifyResult:
    """logits: [T, V], the rows of every sequence (`top`: their argmax, if known). A greedy batch of chains (every
    plain greedy step, most speculative ones) is verified on host lists; trees and sampled requests on tensors."""
    greedy = all(s.params.greedy for s in seqs)
    if greedy and not drafts.any_tree:
        return verify_greedy_chains(drafts.tokens, top if top is not None else greedy_tokens(logits).tolist())
    counts = drafts.counts
    N = max(counts)
    if not greedy and N == 0:  # nobody drafted: a plain step, one sample per row (greedy rows take the argmax)
        return plain_result(sample(logits, SamplingTensors.from_requests(seqs, logits.device)))
    B, device, draft = len(seqs), logits.device, drafts.draft
    # Drafts come from the host (n-gram, suffix, ...) or the device (model drafters): verification runs where
    # the logits are, one upload of the draft, one copy of the result back (`verify._result`).
    tokens = draft.tokens[:, :N].to(device)
    real = torch.arange(N)[None, :] < torch.tensor(counts)[:, None]  # [B, N]
    parents = torch.where(real, draft.parents[:, :N].cpu(), PAD).to(device)
    rows = torch.full((B, N + 1), -1, dtype=torch.long)  # logits row of each (sequence, node + 1)
    start = 0
    for i, n in enumerate(counts):
        rows[i, : n + 1] = torch.arange(start, start + n + 1)
        start += n + 1
    rows = rows.to(device)
    if greedy:
        return verify_greedy(tokens, parents, greedy_tokens(logits)[rows.clamp(min=0)])  # target ids [B, N + 1]
    st = SamplingTensors.from_requests(seqs, logits.device)
    probs = logits_to_probs(logits, st.select([i for i, n in enumerate(counts) for _ in range(n + 1)]))
    q = draft.probs[:, :N].to(device) if draft.probs is not None else None
    return verify(tokens, parents, probs[rows.clamp(min=0)], q, st.generators)
