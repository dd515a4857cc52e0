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


class _Shape:
    """A static tree prepared for drafting: parents, ranks and the nodes of each level."""

    def __init__(self, choices: tuple[tuple[int, ...], ...]) -> None:
        tree = tree_from_choices(choices)
        self.tensor_parents = tree.parents
        self.parents, self.ranks = tree.parents.tolist(), tree.ranks.tolist()
        self.width = max(self.ranks) + 1
        depth = tree.depths.tolist()
        self.levels = [[n for n, d in enumerate(depth) if d == level] for level in range(1, max(depth) + 1)]


class TreeDrafter(ChainDrafter):
    """A ChainDrafter that drafts the static tree a request asks for (`DraftRequest.tree`), all requests of
    a step sharing one shape; chains when none is asked for. One drafter (and one draft cache) serves
    every shape, so the tree dispatcher can switch shapes from step to step."""

    def __init__(self, runner, num_speculative_tokens: int, num_layers: int | None = None,
                 shares_target_cache: bool = False) -> None:
        super().__init__(runner, num_speculative_tokens, num_layers, shares_target_cache)
        self.shapes: dict[tuple, _Shape] = {}

    def propose(self, requests: list[DraftRequest]) -> Draft:
        if not requests or requests[0].tree is None:
            return super().propose(requests)
        shape = self.shapes.get(requests[0].tree) or self.shapes.setdefault(requests[0].tree, _Shape(requests[0].tree))
        B = len(requests)
        sizes = [min(len(shape.parents), r.max_tokens) for r in requests]  # a prefix of the node order is a tree
        N = max(sizes, default=0)
        tokens = torch.zeros(B, N, dtype=torch.long)
        parents = torch.full((B, N), PAD, dtype=torch.long)
        for i, n in enumerate(sizes):
            parents[i, :n] = shape.tensor_parents[:n]
        if N == 0:
            return Draft(tokens, parents)
        tables = [r.seq.block_table.blocks for r in requests]
        starts = [self._cached(r) for r in requests]
        hidden = self.runner.run(tables, starts, [r.token_ids[s:] for r, s in zip(requests, starts)], self.num_layers)
        last = torch.tensor([len(r.token_ids) - s for r, s in zip(requests, starts)], device=hidden.device).cumsum(0) - 1
        top = self.runner.model.compute_logits(hidden[last]).topk(shape.width).indices.cpu()  # [B, width]
        for c in shape.levels[0]:
            if c < N:
                tokens[:, c] = top[:, shape.ranks[c]]
        for r in requests:  # committed tokens only: the nodes' K/V below are not on the sequence's path
            self.caches[r.seq_id] = DraftCache(r.seq.num_preemptions, list(r.token_ids), len(r.token_ids))
        for level, below in zip(shape.levels, shape.levels[1:]):
            rows = [[n for n in level if n < size and any(shape.parents[c] == n for c in below if c < size)]
                    for size in sizes]
            batch = [i for i in range(B) if rows[i]]
            if not batch:
                break
            trees = [TreeFeed.level(shape.parents[:sizes[i]], rows[i]) for i in batch]
            hidden = self.runner.run([tables[i] for i in batch], [len(requests[i].token_ids) for i in batch],
                                     [tokens[i, rows[i]].tolist() for i in batch], self.num_layers, trees)
            top = self.runner.model.compute_logits(hidden).topk(shape.width).indices.cpu()  # [rows fed, width]
            offset = 0
            for i in batch:
                for c in below:
                    if c < sizes[i] and shape.parents[c] in rows[i]:
                        tokens[i, c] = top[offset + rows[i].index(shape.parents[c]), shape.ranks[c]]
                offset += len(rows[i])
        return Draft(tokens, parents)
