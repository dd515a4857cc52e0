"""EAGLE-3 drafting: a one-layer head over the target's low/mid/high features drafts a chain of k tokens.

Each step (Meta's alignment: the head is re-aligned from target features only):

    catch up:  rows t = first token without a consumed feature .. last cached token, each pairing the target's
               feature of token t with the embedding of token t + 1, at position t   -> d1 from the last row
    extend:    (the head's own output, d_j) at the next position                     -> d_(j+1)

The head's K/V live in a pool of its own over the target's block tables, at the same slots as the
tokens they belong to. Rows written while drafting are overwritten by the next catch-up, which restarts at
the first token whose target feature the head has not consumed, so no rewind is needed. Drafts are the
head's argmax (q = one-hot), which verification handles losslessly at any temperature.
"""
from __future__ import annotations

import torch

from specdec.drafting.base import Draft, DraftRequest, Drafter
from specdec.kv_cache import KVPool
from specdec.models.eagle3 import Eagle3Head


class Eagle3Drafter(Drafter):
    def __init__(self, head: Eagle3Head, target_runner, num_speculative_tokens: int) -> None:
        self.head, self.k, self.runner = head, num_speculative_tokens, target_runner
        self.embed = target_runner.model.embed
        alloc = target_runner.allocator
        self.kv = KVPool(head.config, alloc.num_blocks, alloc.block_size, torch.float32, head.device)
        self.feature_layers = head.aux_layers

    def propose(self, requests: list[DraftRequest]) -> Draft:
        active = [i for i, r in enumerate(requests) if r.features is not None and r.max_tokens > 0]
        proposals: list[list[int]] = [[] for _ in requests]
        if not active:
            return Draft.chains(proposals)
        reqs = [requests[i] for i in active]
        tables = [r.seq.block_table.blocks for r in reqs]
        starts = [r.features_start for r in reqs]
        feeds = [r.token_ids[s + 1:s + 1 + len(r.features)] for r, s in zip(reqs, starts)]
        out = self._run(tables, starts, feeds, features=torch.cat([r.features for r in reqs]))
        last = torch.tensor([len(f) for f in feeds]).cumsum(0) - 1
        hidden = out[last]  # [B, H] the head's output at each request's last row
        positions = [s + len(f) for s, f in zip(starts, feeds)]  # where the first draft token's row goes
        budget = [min(self.k, r.max_tokens) for r in reqs]
        tokens = self._next(hidden)
        chains = [[t] for t in tokens.tolist()]
        for step in range(1, max(budget)):
            rows = [i for i, b in enumerate(budget) if b > step]
            out = self._run([tables[i] for i in rows], [positions[i] + step - 1 for i in rows],
                            [[chains[i][-1]] for i in rows], hidden=hidden[rows])
            hidden = hidden.clone()
            hidden[rows] = out
            for i, t in zip(rows, self._next(out).tolist()):
                chains[i].append(t)
        for i, chain, b in zip(active, chains, budget):
            proposals[i] = chain[:b]
        return Draft.chains(proposals)

    def _run(self, tables, starts, feeds, features=None, hidden=None) -> torch.Tensor:
        tokens, positions, meta = self.runner.build(tables, starts, feeds)
        return self.head(self.embed(tokens), positions, meta, self.kv, features=features, hidden=hidden)

    def _next(self, out: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens (target ids) from head outputs [N, H]."""
        return self.head.target_ids(self.head.compute_logits(out).argmax(-1))
