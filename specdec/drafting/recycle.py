"""Token recycling (Luo et al. 2024): the target's own top-k at every verified position is free information.

After each verification the engine hands the drafter (`observe`) the target's k most likely next tokens
after every token it kept. They go into one adjacency table, token -> its latest k candidates (best first),
shared by all requests: what the target tends to say after a token changes little with the context, and a
table of the whole vocabulary costs V * k * 4 bytes (1.5 MB for 49k tokens and k = 8).

A draft is grown breadth first from the last committed token: depth d takes the first `widths[d]`
candidates of each node at depth d - 1 (a token already among its siblings is skipped), until the step's
budget of nodes or depth. Tokens never seen yet have no candidates, so a request drafts nothing until the
target has been through a few steps. Proposals are deterministic (q = one-hot): lossless as any draft.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specdec.config import SpecdecError
from specdec.drafting.base import Draft, DraftEnv, Drafter, DraftRequest, check_int
from specdec.drafting.registry import SpeculativeConfig, register_method
from specdec.tree import ROOT


@dataclass
class RecycleOptions:
    recycle_topk: int = 8  # candidates kept per token
    recycle_widths: list[int] = field(default_factory=lambda: [1])  # children per node by depth; the last repeats

    def __post_init__(self) -> None:
        k, w = self.recycle_topk, self.recycle_widths
        check_int("recycle_topk", k, 1, 64)
        if (not isinstance(w, (list, tuple)) or not w
                or not all(isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= k for x in w)):
            raise SpecdecError(f"invalid recycle_widths={w!r}: a non-empty list of integers in [1, recycle_topk]")


class AdjacencyTable:
    """token -> the target's latest top-k next tokens after it (-1: none yet)."""

    def __init__(self, vocab_size: int, k: int) -> None:
        self.table = np.full((vocab_size, k), -1, dtype=np.int32)

    def update(self, tokens: list[int], candidates: list[list[int]]) -> None:
        k = self.table.shape[1]
        for t, c in zip(tokens, candidates):
            self.table[t, :len(c[:k])] = c[:k]

    def candidates(self, token: int, width: int) -> list[int]:
        row = self.table[token, :width]
        return [int(x) for x in row if x >= 0]


def bfs_tree(table: AdjacencyTable, root: int, widths: list[int], max_nodes: int, max_depth: int
             ) -> tuple[list[int], list[int]]:
    """The draft tree below `root`: tokens and parents (ROOT for depth 1), breadth first."""
    tokens: list[int] = []
    parents: list[int] = []
    frontier = [(ROOT, root)]
    depth = 0
    while frontier and len(tokens) < max_nodes and depth < max_depth:
        width = widths[min(depth, len(widths) - 1)]
        nxt = []
        for parent, token in frontier:
            for c in table.candidates(token, width):
                if len(tokens) == max_nodes:
                    break
                tokens.append(c)
                parents.append(parent)
                nxt.append((len(tokens) - 1, c))
        frontier, depth = nxt, depth + 1
    return tokens, parents


@register_method("recycle", RecycleOptions)
class RecycleDrafter(Drafter):
    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, env: DraftEnv) -> RecycleDrafter:
        o = cfg.options
        return cls(cfg.num_speculative_tokens, env.target.config.vocab_size, o.recycle_topk, list(o.recycle_widths))

    def __init__(self, num_speculative_tokens: int, vocab_size: int, topk: int = 8, widths: list[int] | None = None
                 ) -> None:
        self.k, self.widths = num_speculative_tokens, widths or [1]
        self.observe_topk = topk
        self.table = AdjacencyTable(vocab_size, topk)

    def observe(self, seq_id: int, tokens: list[int], candidates: list[list[int]]) -> None:
        self.table.update(tokens, candidates)

    def forget(self) -> None:
        self.table.table.fill(-1)

    def propose(self, requests: list[DraftRequest]) -> Draft:
        rows = []
        for r in requests:
            budget = min(self.k, r.max_tokens)
            depth = budget if r.max_depth is None else min(budget, r.max_depth)
            rows.append(bfs_tree(self.table, r.token_ids[-1], self.widths, budget, depth) if budget > 0 else ([], []))
        return Draft.from_rows(rows)
