"""Feeds the target over the paged cache: every forward of the engine lays its tokens out with
`kv_cache.paged_inputs` (drafters get the same function through their `DraftEnv`).

A draft tree is fed like a chain, one slot per node in node order after the last committed token, but
each node gets the rotary position of its depth and sees only the prefix and its own ancestors (the
tree mask); siblings are alternatives for the same position. After verification the speculator moves
the accepted path's K/V down to consecutive slots (`compact`).
"""
from __future__ import annotations

import functools

import torch

from specdec.engine.graphs import GraphRunner
from specdec.kv_cache import KVPool, paged_inputs
from specdec.models.llama import LlamaModel
from specdec.tree import TreeFeed


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVPool, block_size: int, graphs: GraphRunner | None = None) -> None:
        self.model, self.kv, self.block_size, self.graphs = model, kv, block_size, graphs
        self.device = model.device
        self.inputs = functools.partial(paged_inputs, block_size=block_size, device=model.device)  # a plain function

    def run(self, tables: list[list[int]], starts: list[int], feeds: list[list[int]],
            trees: list[TreeFeed | None] | None = None, feature_layers: tuple[int, ...] = ()
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed the target (see `inputs`): the final hidden state of every fed token [T, H], and the outputs of
        `feature_layers` concatenated per row [T, len(feature_layers) * H] (None without any). Steps that fit a
        captured shape replay its graph (`graphs`, on a GPU)."""
        if self.graphs is not None:
            out = self.graphs.run(tables, starts, feeds, trees, feature_layers)
            if out is not None:
                return out
        tokens, positions, meta = self.inputs(tables, starts, feeds, trees)
        hidden, captured = self.model(tokens, positions, meta, self.kv, output_layers=feature_layers)
        return hidden, torch.cat([captured[i] for i in feature_layers], -1) if feature_layers else None

    def run_logits(self, tables: list[list[int]], starts: list[int], feeds: list[list[int]],
                   trees: list[TreeFeed | None] | None, feature_layers: tuple[int, ...], rows: list[int]
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """`run`, then `logits(hidden, rows)`: in the same native call where the model runs its whole stack as one
        (the LM head right after the last layer), the same bits either way."""
        if self.graphs is not None:
            hidden, features = self.run(tables, starts, feeds, trees, feature_layers)
            return hidden, features, self.logits(hidden, rows)
        tokens, positions, meta = self.inputs(tables, starts, feeds, trees)
        return self.model.forward_logits(tokens, positions, meta, self.kv, rows, feature_layers)

    def logits(self, hidden: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """float32 logits [N, V] of the rows `rows` of the last forward's hidden states (None: all of them)."""
        if rows is not None and len(rows) != hidden.shape[0]:
            hidden = hidden[torch.tensor(rows, device=hidden.device)]
        return self.model.compute_logits(hidden)

    def compact(self, table: list[int], start: int, nodes: list[int]) -> None:
        """Move the K/V of accepted tree nodes (indices fed after the token at slot index `start`) down to
        the slots right after it, in every layer. A no-op for a chain's accepted prefix."""
        moves = [(start + 1 + node, start + 1 + depth) for depth, node in enumerate(nodes) if node != depth]
        if not moves:
            return
        bs = self.block_size
        src, dst = ([table[i // bs] * bs + i % bs for i in idx] for idx in zip(*moves))
        src, dst = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        for pool in self.kv.k + self.kv.v:  # dst < src and both increase, so no move overwrites a later source
            pool[dst] = pool[src]
