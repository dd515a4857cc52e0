"""Logits -> tokens, once for every step kind: a plain step is a speculative step whose drafts are empty.

Sequence i of a step owns 1 + n_i consecutive rows of the step's logits: the distribution after its committed
tokens, then after each of its n_i draft nodes' paths (n_i = 0 in a plain step or a prefill's last chunk); the
step's `StepLayout.logits` says where they are.

    logits [T, V] ─┬─> raw copy of the rows whose requests want logprobs (the model's own distribution)
                   ├─> logit_bias and penalties, each row counting the tokens on its own path
                   ├─> grammar masks, each row after its own path (structured output)
                   ├─> the target's own token at every row: greedy rows its argmax, sampled rows its keyed sample
                   │   (the exponential race with noise keyed by the request's seed and the row's output position)
                   ├─> verification: keep the draft nodes equal to the target's token after their parent, then
                   │   emit the target's token after the last one kept; with no drafts, the target's token
                   └─> logprobs of every emitted token, from the raw row that predicted it

So each sampling feature is written once and holds under speculation by construction: a draft row sees exactly
the distribution plain decoding would see after the same tokens, and samples with the same key, so speculative
output is plain output token for token, greedy or sampled, whatever was drafted. (A speculative config may ask
for multi-round rejection sampling with the draft's q instead, `sampled_verification: "rejection"`: the same
distribution, but the tokens then depend on the drafts.)

Keyed verification loses nothing against rejection sampling for deterministic drafts (n-gram, suffix, heads'
top-k trees): a node is kept with the target's probability of its token, and a node's children together with the
sum of theirs, as rejection sampling with one-hot q gives. For sampled drafts the draft model samples with the same
key on its own q (a coupling), which accepts about as often where q is close to p.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.drafting import Draft
from specdec.engine.layout import StepLayout
from specdec.engine.sequence import Sequence
from specdec.sampling import (
    Penalized,
    SamplingTensors,
    TokenLogprob,
    greedy_tokens,
    keyed_logit_sample,
    keyed_sample,
    logits_to_probs,
    only_temperature,
    penalize,
    sampling_key,
    token_logprobs,
)
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
    def none(cls, num_seqs: int) -> StepDrafts:
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


def choose_tokens(seqs: list[Sequence], logits: torch.Tensor, drafts: StepDrafts, layout: StepLayout,
                  want_top1: bool = False, rejection: bool = False) -> Choice:
    """Turn a step's logits [T, V] (sequence i's 1 + n_i rows after one another: `layout`, the step's
    `StepLayout.logits`) into the tokens each sequence emits. Penalties and masks are applied to `logits` in place.
    want_top1: return every row's argmax too (a drafter that watches the target's guesses). rejection: verify
    sampled requests' drafts by multi-round rejection sampling instead of against the target's keyed samples."""
    asked = [r for i, s in enumerate(seqs) if s.params.logprobs is not None for r in layout.rows(i)]
    raw = logits[asked] if asked else None  # a copy: the model's own logits, before penalties and masks
    if any(s.params.penalized for s in seqs):  # the target's distribution at every row, before any mask
        penalize(logits, penalty_rows(seqs, drafts, layout))
    top = None  # every row's argmax, where masking computed it
    if any(s.grammar is not None for s in seqs):  # row j of a constrained sequence: after node j's path
        top = mask_logits(logits, [(s.grammar, d, p, s.params.greedy)
                                   for s, d, p in zip(seqs, drafts.tokens, drafts.parents)])
    verify_step = _verify_rejection if rejection else _verify
    result = verify_step(seqs, drafts, layout, logits, top)
    logprobs: list[list[TokenLogprob] | None] = [None] * len(seqs)
    if raw is not None:
        raw_row = {r: k for k, r in enumerate(asked)}
        for i, seq in enumerate(seqs):
            if seq.params.logprobs is not None:  # emitted token j was predicted by the row of kept node j
                kept = layout.kept_rows(i, result.accepted_nodes[i])
                logprobs[i] = token_logprobs(raw[[raw_row[r] for r in kept]], result.emitted_tokens[i],
                                             seq.params.logprobs)
    top1 = (top or greedy_tokens(logits).tolist()) if want_top1 else None
    return Choice(result, logprobs, top1)


def penalty_rows(seqs: list[Sequence], drafts: StepDrafts, layout: StepLayout) -> list[Penalized]:
    """The rows of each penalized sequence in a step's logits: after its output, then after each draft node's path
    (its ancestors and itself), as `sampling.penalize` takes them."""
    out = []
    for i, (seq, tokens, links) in enumerate(zip(seqs, drafts.tokens, drafts.parents)):
        if seq.params.penalized:
            paths: list[list[int]] = [[]]
            for token, parent in zip(tokens, links):  # a parent comes before its children
                paths.append(paths[parent + 1] + [token])
            out.append(Penalized(layout.starts[i], seq.params, seq.prompt_token_ids, seq.output_token_ids, paths))
    return out


def row_levels(parents: list[int]) -> list[int]:
    """How many tokens after the sequence's committed ones each of its rows predicts from: 0 for the first row,
    then each draft node's depth (a child of the last committed token: 1)."""
    levels = [0]
    for parent in parents:
        levels.append(levels[parent + 1] + 1)
    return levels


def target_tokens(seqs: list[Sequence], drafts: StepDrafts, layout: StepLayout, logits: torch.Tensor,
                  top: list[int] | None) -> torch.Tensor:
    """The target's own token at every row [T], on the logits' device: greedy rows its argmax (`top`, when masking
    computed it), sampled rows its keyed sample, keyed by the request's seed and the output position the row
    predicts. On CPU a sampled sequence draws only on the rows verification reaches (from its first row, down the
    child equal to each draw: accepted + 1 rows, not 1 + n; verification never reads the others), a request that
    sets a temperature alone straight from its logits (`keyed_logit_sample`), the others from their processed
    distributions; elsewhere every row draws at once (no host read per row)."""
    if top is not None:
        ids = torch.tensor(top, device=logits.device)
    elif any(s.params.greedy for s in seqs):
        ids = greedy_tokens(logits)
    else:  # every row is sampled: the rows verification reaches are drawn below, the others never read
        ids = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    if all(s.params.greedy for s in seqs):
        return ids
    cpu = logits.device.type == "cpu"
    rows, owners, keys, spans = [], [], [], []
    for i, seq in enumerate(seqs):
        if not seq.params.greedy:
            position = len(seq.token_ids) - seq.num_prompt_tokens  # the output position row 0 predicts
            spans.append((i, layout.starts[i], len(keys)))
            keys += [sampling_key(seq.sampling_seed, position + level) for level in row_levels(drafts.parents[i])]
            if not (cpu and only_temperature(seq.params)):  # drawn from its processed distribution
                rows += layout.rows(i)
                owners += [i] * len(layout.rows(i))
    probs = None  # [R, V] the processed distributions of `rows`
    if rows:
        st = SamplingTensors.from_requests(seqs, logits.device).select(owners)
        probs = logits_to_probs(logits[torch.tensor(rows, device=logits.device)], st)
    if not cpu:
        ids[torch.tensor(rows, device=logits.device)] = keyed_sample(probs, keys)
        return ids
    at = {row: k for k, row in enumerate(rows)}  # logits row -> its processed row
    for i, first_row, first in spans:
        tokens, parents, params = drafts.tokens[i], drafts.parents[i], seqs[i].params
        node = -1  # the last committed token; then the deepest node kept so far
        while True:
            row, key = first_row + node + 1, keys[first + node + 1]
            if row in at:
                token = int(keyed_sample(probs[at[row]:at[row] + 1], [key])[0])
            else:
                token = keyed_logit_sample(logits[row], params.temperature, key)
            ids[row] = token
            node = next((c for c, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == token), None)
            if node is None:
                break
    return ids


def _verify(seqs: list[Sequence], drafts: StepDrafts, layout: StepLayout, logits: torch.Tensor,
            top: list[int] | None) -> VerifyResult:
    """Keep the draft nodes equal to the target's own token after their parent (`target_tokens`), then emit the
    target's token after the last node kept: greedy verification, whatever the request samples. Chains on host
    lists (one copy of the ids); trees on tensors (one upload of the draft, one copy of the result)."""
    if not drafts.any_tree:
        if top is not None and all(s.params.greedy for s in seqs):
            return verify_greedy_chains(drafts.tokens, top)
        return verify_greedy_chains(drafts.tokens, target_tokens(seqs, drafts, layout, logits, top).tolist())
    tokens, parents, rows = _padded(drafts, layout, logits.device)
    return verify_greedy(tokens, parents, target_tokens(seqs, drafts, layout, logits, top)[rows.clamp(min=0)])


def _padded(drafts: StepDrafts, layout: StepLayout, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The drafts as padded tensors on `device`: tokens and parents [B, N], and the logits row of each (sequence,
    node + 1) [B, N + 1] (-1: padding). Drafts come from the host (n-gram, suffix, ...) or the device (model
    drafters): verification runs where the logits are, and copies its result back once (`verify._result`)."""
    counts, draft = layout.num_drafts, drafts.draft
    B, N = len(counts), max(counts)
    tokens = draft.tokens[:, :N].to(device)
    real = torch.arange(N)[None, :] < torch.tensor(counts)[:, None]  # [B, N]
    parents = torch.where(real, draft.parents[:, :N].cpu(), PAD).to(device)
    rows = torch.full((B, N + 1), -1, dtype=torch.long)  # logits row of each (sequence, node + 1)
    for i, n in enumerate(counts):
        rows[i, : n + 1] = torch.arange(layout.starts[i], layout.starts[i + 1])
    return tokens, parents, rows.to(device)


def _verify_rejection(seqs: list[Sequence], drafts: StepDrafts, layout: StepLayout, logits: torch.Tensor,
                      top: list[int] | None) -> VerifyResult:
    """Multi-round rejection sampling for sampled requests (`verify.verify`, with the draft's q where it sampled);
    greedy batches as `_verify`. The output keeps the target's distribution; its tokens depend on the drafts."""
    greedy = all(s.params.greedy for s in seqs)
    if greedy or max(drafts.counts) == 0:
        return _verify(seqs, drafts, layout, logits, top)
    tokens, parents, rows = _padded(drafts, layout, logits.device)
    N = tokens.shape[1]
    st = SamplingTensors.from_requests(seqs, logits.device)
    probs = logits_to_probs(logits, st.select([i for i in range(len(seqs)) for _ in layout.rows(i)]))
    q = drafts.draft.probs[:, :N].to(logits.device) if drafts.draft.probs is not None else None
    return verify(tokens, parents, probs[rows.clamp(min=0)], q, st.generators)
