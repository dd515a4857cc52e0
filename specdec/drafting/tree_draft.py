"""Static-tree drafting with a draft LM (draft_model or layer_skip): each node's children are the draft's
top-ranked tokens after it (greedy draft decoding, as in the Meta report, section 3.2).

    catch up:  feed the committed tokens the draft cache lacks (at least the last one)  -> root's top-k
    level d:   feed every depth-d node in one forward (tree mask, positions by depth)   -> their top-k

Children are deterministic proposals (q = one-hot), which tree verification handles losslessly for any
temperature. Node K/V are written to the slots right after the committed tokens (the ones the target's
verification overwrites) and are not kept: the next catch-up feeds the accepted tokens again.
"""
from __future__ import annotations

import torch

from specdec.drafting.base import PAD, Draft, DraftRequest
from specdec.drafting.chain import ChainDrafter, DraftCache
from specdec.tree import TreeFeed, tree_from_choices


class TreeDrafter(ChainDrafter):
    def __init__(self, runner, choices: list[list[int]], num_layers: int | None = None,
                 shares_target_cache: bool = False) -> None:
        super().__init__(runner, len(choices), num_layers, shares_target_cache)
        self.tree = tree_from_choices(choices)
        self.parents = self.tree.parents.tolist()
        self.ranks = self.tree.ranks.tolist()
        self.width = max(self.ranks) + 1
        depth = self.tree.depths.tolist()
        self.levels = [[n for n, d in enumerate(depth) if d == level] for level in range(1, max(depth) + 1)]

    def propose(self, requests: list[DraftRequest]) -> Draft:
        B = len(requests)
        sizes = [min(len(self.parents), r.max_tokens) for r in requests]  # a prefix of the node order is a tree
        N = max(sizes, default=0)
        tokens = torch.zeros(B, N, dtype=torch.long)
        parents = torch.full((B, N), PAD, dtype=torch.long)
        for i, n in enumerate(sizes):
            parents[i, :n] = self.tree.parents[:n]
        if N == 0:
            return Draft(tokens, parents)
        tables = [r.seq.block_table.blocks for r in requests]
        starts = [self._cached(r) for r in requests]
        hidden = self.runner.run(tables, starts, [r.token_ids[s:] for r, s in zip(requests, starts)], self.num_layers)
        last = torch.tensor([len(r.token_ids) - s for r, s in zip(requests, starts)], device=hidden.device).cumsum(0) - 1
        top = self.runner.model.compute_logits(hidden[last]).topk(self.width).indices.cpu()  # [B, width]
        for c in self.levels[0]:
            if c < N:
                tokens[:, c] = top[:, self.ranks[c]]
        for r in requests:  # committed tokens only: the nodes' K/V below are not on the sequence's path
            self.caches[r.seq_id] = DraftCache(r.seq.num_preemptions, list(r.token_ids), len(r.token_ids))
        for level, below in zip(self.levels, self.levels[1:]):
            rows = [[n for n in level if n < size and any(self.parents[c] == n for c in below if c < size)]
                    for size in sizes]
            batch = [i for i in range(B) if rows[i]]
            if not batch:
                break
            trees = [TreeFeed.level(self.parents[:sizes[i]], rows[i]) for i in batch]
            hidden = self.runner.run([tables[i] for i in batch], [len(requests[i].token_ids) for i in batch],
                                     [tokens[i, rows[i]].tolist() for i in batch], self.num_layers, trees)
            top = self.runner.model.compute_logits(hidden).topk(self.width).indices.cpu()  # [rows fed, width]
            offset = 0
            for i in batch:
                for c in below:
                    if c < sizes[i] and self.parents[c] in rows[i]:
                        tokens[i, c] = top[offset + rows[i].index(self.parents[c]), self.ranks[c]]
                offset += len(rows[i])
        return Draft(tokens, parents)
