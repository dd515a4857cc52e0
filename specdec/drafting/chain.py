"""Autoregressive chain drafting with a Llama-family model whose KV lives in the target's block tables.

Shared by `draft_model` (a small LM with its own KV pool) and `layer_skip` (the target's first layers,
reading and writing the target's own KV for those layers). Each step:

    catch up:  feed the committed tokens the draft cache lacks (at least the last one)  -> d1
    extend:    feed d1, d2, ... one token per sequence                                 -> d2 .. dk

The draft cache is rewound by bookkeeping only: it remembers which tokens it fed, and after verification
keeps the prefix that was committed; anything past it is overwritten by the next step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.drafting.base import Draft, DraftEnv, Drafter, DraftRequest
from specdec.kv_cache import KVPool
from specdec.models.llama import LlamaModel
from specdec.sampling import SamplingTensors, keyed_sample, logits_to_probs, sample_from_probs, sampling_key
from specdec.tree import TreeFeed


@dataclass
class DraftCache:
    """What the draft KV of one sequence holds: K/V for `fed` at positions 0 .. len(fed) - 1."""

    epoch: int = -1  # the sequence's preemption count when this was written
    fed: list[int] = field(default_factory=list)
    committed: int = 0  # len(fed) that was committed when fed (the rest were drafts)

    def valid_prefix(self, token_ids: list[int], epoch: int) -> int:
        if epoch != self.epoch:
            return 0
        n = self.committed
        while n < min(len(self.fed), len(token_ids)) and self.fed[n] == token_ids[n]:
            n += 1
        return n


class ChainDrafter(Drafter):
    """model, kv: the draft model and its KV pool over the shared blocks; num_layers: early exit (layer skip);
    shares_target_cache: the draft layers are the target's, whose KV for committed tokens is already valid."""

    def __init__(self, env: DraftEnv, model: LlamaModel, kv: KVPool, num_speculative_tokens: int,
                 num_layers: int | None = None, shares_target_cache: bool = False) -> None:
        self.env, self.model, self.kv = env, model, kv
        self.k, self.num_layers, self.shares_target_cache = num_speculative_tokens, num_layers, shares_target_cache
        self.caches: dict[int, DraftCache] = {}

    def run(self, tables: list[list[int]], starts: list[int], feeds: list[list[int]],
            trees: list[TreeFeed | None] | None = None) -> torch.Tensor:
        """Feed the draft model; hidden states of every fed token [T, H]."""
        return self.env.run(self.model, self.kv, tables, starts, feeds, trees, self.num_layers)

    def propose(self, requests: list[DraftRequest]) -> Draft:
        st = SamplingTensors.from_requests(requests, self.model.device)
        tables = [r.block_table for r in requests]
        starts = [self._cached(r) for r in requests]
        feeds = [r.token_ids[start:] for r, start in zip(requests, starts)]
        steps = max(r.max_tokens for r in requests)
        if steps <= 0:  # nobody drafts (all throttled or paused): nothing is fed, so the cache stays as it was
            return Draft.chains([[] for _ in requests])
        tokens, probs = [], []
        for step in range(steps):
            hidden = self.run(tables, starts, feeds)
            last = torch.tensor([len(f) for f in feeds], device=hidden.device).cumsum(0) - 1
            tok, q = self._sample(self.env.logits(self.model, hidden[last]), st, requests, step)
            tokens.append(tok)
            probs.append(q)
            starts = [start + len(f) for start, f in zip(starts, feeds)]
            feeds = [[t] for t in tok.tolist()]
        for i, r in enumerate(requests):  # K/V was written for every drafted token but the last
            drafted = [int(t[i]) for t in tokens[:-1]]
            self.caches[r.seq_id] = DraftCache(r.epoch, r.token_ids + drafted, len(r.token_ids))
        draft = Draft.chains(torch.stack(tokens, 1).tolist())
        draft.probs = None if st.all_greedy else torch.stack(probs, 1)  # [B, k, V]
        return draft

    def _cached(self, r: DraftRequest) -> int:
        """How many leading tokens of the sequence already have valid K/V in the draft cache."""
        if self.shares_target_cache:
            return r.num_cached  # the target wrote these layers' K/V for every committed token
        return min(self.cached_prefix(r), len(r.token_ids) - 1)

    def cached_prefix(self, request: DraftRequest) -> int | None:
        if self.shares_target_cache:
            return None  # the target's own K/V
        cache = self.caches.get(request.seq_id, DraftCache())
        # Blocks reused from the prefix cache came with the draft's K/V (they were cached where both held them).
        return max(cache.valid_prefix(request.token_ids, request.epoch), request.num_prefix_hit)

    @staticmethod
    def _sample(logits: torch.Tensor, st: SamplingTensors, requests: list[DraftRequest], step: int
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy rows take the argmax; sampled rows draw from the draft's distribution, processed with the
        request's own temperature / top-k / top-p, and report it as q. Under keyed verification a sampled row
        draws with the key the target uses at the same position (greedy rows: q is one-hot, the same argmax)."""
        if st.all_greedy:
            return logits.argmax(-1), None
        q = logits_to_probs(logits, st)
        if all(r.sampling_seed is not None for r in requests):
            return keyed_sample(q, [sampling_key(r.sampling_seed, r.position + step) for r in requests]), q
        return sample_from_probs(q, st.generators), q

    def release(self, seq_id: int) -> None:
        self.caches.pop(seq_id, None)
