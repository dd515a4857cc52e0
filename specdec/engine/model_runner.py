"""Feeds a model over the paged cache: every forward of the engine and of its drafters goes through `inputs`.

    tokens, positions: [T]      every sequence's new tokens, flattened (no padding)
    context:           [B, L]   every slot sequence i attends: its cached prefix + this step's tokens

A draft tree is fed like a chain, one slot per node in node order after the last committed token, but
each node gets the rotary position of its depth and sees only the prefix and its own ancestors (the
tree mask); siblings are alternatives for the same position. After verification the speculator moves
the accepted path's K/V down to consecutive slots (`compact`).
"""
from __future__ import annotations

import torch

from specdec.kv_cache import NULL_BLOCK, KVPool
from specdec.models.attention import AttentionMetadata
from specdec.models.llama import LlamaModel
from specdec.tree import TreeFeed


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVPool, block_size: int) -> None:
        self.model, self.kv, self.block_size = model, kv, block_size
        self.device = model.device

    def inputs(self, tables: list[list[int]], starts: list[int], feeds: list[list[int]],
               trees: list[TreeFeed | None] | None = None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Tensors for feeding `feeds[i]` into slots starts[i].. of the sequence owning blocks tables[i]:
        consecutive and causal, or in the layout of trees[i] when given."""
        trees = trees or [None] * len(feeds)
        num_new = [len(f) for f in feeds]
        B, S = len(feeds), max(num_new)
        bs = self.block_size
        ends = [start + (n if t is None else t.visible.shape[1]) for start, n, t in zip(starts, num_new, trees)]
        L = max(ends)
        padded_index = torch.full((B, S), -1, dtype=torch.long)  # slot index in the sequence, -1 = padding
        block_tables = torch.full((B, -(-L // bs)), NULL_BLOCK, dtype=torch.long)
        for i, (start, n, blocks) in enumerate(zip(starts, num_new, tables)):
            offsets = torch.arange(n) if trees[i] is None else torch.tensor(trees[i].index, dtype=torch.long)
            padded_index[i, :n] = start + offsets
            blocks = blocks[: block_tables.shape[1]]
            block_tables[i, : len(blocks)] = torch.tensor(blocks)
        pos = torch.arange(L)
        valid = pos[None, :] < torch.tensor(ends)[:, None]  # [B, L]
        context_slots = torch.where(valid, block_tables[:, pos // bs] * bs + pos % bs, NULL_BLOCK * bs)
        context_positions = torch.where(valid, pos[None, :], -1)
        is_new = padded_index >= 0
        slot_mapping = context_slots.gather(1, padded_index.clamp(min=0))[is_new]
        meta = AttentionMetadata.causal(padded_index, context_slots, context_positions, slot_mapping, num_new)
        rope = padded_index.clone()
        if any(t is not None for t in trees):
            meta.tree_starts = list(starts)  # every sequence's fed region is its "tree"; a chain's is causal
        for i, tree in enumerate(trees):
            if tree is not None:
                n, start = len(tree.index), starts[i]
                rope[i, :n] = start + torch.tensor(tree.rope, dtype=torch.long)
                meta.mask[i, :n, start:start + tree.visible.shape[1]] = tree.visible
        dev = self.device
        meta = meta.to(dev)
        tokens = torch.tensor([t for f in feeds for t in f], dtype=torch.long, device=dev)
        return tokens, rope[is_new].to(dev), meta

    def run(self, tables: list[list[int]], starts: list[int], feeds: list[list[int]],
            trees: list[TreeFeed | None] | None = None, feature_layers: tuple[int, ...] = ()
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed the target (see `inputs`): the final hidden state of every fed token [T, H], and the outputs of
        `feature_layers` concatenated per row [T, len(feature_layers) * H] (None without any)."""
        tokens, positions, meta = self.inputs(tables, starts, feeds, trees)
        hidden, captured = self.model(tokens, positions, meta, self.kv, output_layers=feature_layers)
        return hidden, torch.cat([captured[i] for i in feature_layers], -1) if feature_layers else None

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
