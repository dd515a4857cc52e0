"""Turns a scheduled batch into tensors, runs the model over the paged cache, and samples.

    tokens, positions: [T]      every sequence's new tokens, flattened (no padding)
    context:           [B, L]   every slot sequence i attends: its cached prefix + this step's tokens

A draft tree is fed like a chain, one slot per node in node order after the last committed token, but
each node gets the rotary position of its depth and sees only the prefix and its own ancestors (the
tree mask); siblings are alternatives for the same position. After verification the speculator moves
the accepted path's K/V down to consecutive slots (`compact`).
"""
from __future__ import annotations

import torch

from specdec.engine.scheduler import ScheduledBatch
from specdec.engine.sequence import Sequence
from specdec.kv_cache import NULL_BLOCK, BlockAllocator, KVPool
from specdec.models.attention import AttentionMetadata
from specdec.models.llama import LlamaModel
from specdec.sampling import SamplingTensors, sample
from specdec.tree import TreeFeed


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVPool, allocator: BlockAllocator) -> None:
        self.model, self.kv, self.allocator = model, kv, allocator
        self.device = model.device
        # Decoder layers whose outputs a drafter reads (EAGLE features); every forward of the engine then
        # leaves them, concatenated per row, in `features` [T, len(feature_layers) * H].
        self.feature_layers: tuple[int, ...] = ()
        self.features: torch.Tensor | None = None

    def sibling(self, model: LlamaModel) -> "ModelRunner":
        """A runner for another model (a draft) with its own KV pool over the same blocks and block tables."""
        kv = KVPool(model.config, self.allocator.num_blocks, self.allocator.block_size, model.act_dtype,
                    model.device)
        return ModelRunner(model, kv, self.allocator)

    def prepare(self, seqs: list[Sequence], num_new: list[int], extra_tokens: list[list[int]] | None = None,
                trees: list[TreeFeed | None] | None = None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Inputs and attention metadata for `num_new[i]` uncached tokens of each sequence, continued by
        `extra_tokens[i]` (draft tokens, not committed) when given, laid out as `trees[i]` when given."""
        feeds = [(s.token_ids[s.num_cached:] + (extra_tokens[i] if extra_tokens else []))[:n]
                 for i, (s, n) in enumerate(zip(seqs, num_new))]
        return self.build([s.block_table.blocks for s in seqs], [s.num_cached for s in seqs], feeds, trees)

    def build(self, tables: list[list[int]], starts: list[int], feeds: list[list[int]],
              trees: list[TreeFeed | None] | None = None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Tensors for feeding `feeds[i]` into slots starts[i].. of the sequence owning blocks tables[i]:
        consecutive and causal, or in the layout of trees[i] when given."""
        trees = trees or [None] * len(feeds)
        num_new = [len(f) for f in feeds]
        B, S = len(feeds), max(num_new)
        bs = self.allocator.block_size
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
            num_layers: int | None = None, trees: list[TreeFeed | None] | None = None) -> torch.Tensor:
        """Feed explicit tokens (how drafters use a runner); hidden states of every fed token, [T, H]."""
        tokens, positions, meta = self.build(tables, starts, feeds, trees)
        return self.model(tokens, positions, meta, self.kv, num_layers=num_layers)[0]

    def forward(self, seqs: list[Sequence], num_new: list[int]) -> torch.Tensor:
        """Run the model; returns the hidden state of each sequence's last new token, [B, H]."""
        hidden = self.forward_rows(seqs, num_new)
        last = torch.tensor(num_new, device=self.device).cumsum(0) - 1
        return hidden[last]

    def forward_rows(self, seqs: list[Sequence], num_new: list[int], extra_tokens: list[list[int]] | None = None,
                     trees: list[TreeFeed | None] | None = None) -> torch.Tensor:
        """Run the model; the hidden state of every new token, [T, H] (sequence by sequence)."""
        tokens, positions, meta = self.prepare(seqs, num_new, extra_tokens, trees)
        hidden, captured = self.model(tokens, positions, meta, self.kv, output_layers=self.feature_layers)
        self.features = torch.cat([captured[i] for i in self.feature_layers], -1) if self.feature_layers else None
        return hidden

    def compact(self, seq: Sequence, nodes: list[int]) -> None:
        """Move the K/V of accepted tree nodes (indices fed after the token at slot index seq.num_cached)
        down to the slots right after it, in every layer. A no-op for a chain's accepted prefix."""
        moves = [(seq.num_cached + 1 + node, seq.num_cached + 1 + depth) for depth, node in enumerate(nodes)
                 if node != depth]
        if not moves:
            return
        table, bs = seq.block_table.blocks, self.allocator.block_size
        src, dst = ([table[i // bs] * bs + i % bs for i in idx] for idx in zip(*moves))
        src, dst = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        for pool in self.kv.k + self.kv.v:  # dst < src and both increase, so no move overwrites a later source
            pool[dst] = pool[src]

    def step(self, batch: ScheduledBatch) -> list[int | None]:
        """One forward for the batch; the next token of every sequence whose input is now fully cached."""
        hidden = self.forward(batch.seqs, batch.num_new_tokens)
        offset = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if self.features is not None:  # every fed token is now cached: its features are final
                seq.pending_features.append(self.features[offset:offset + n])
            offset += n
            seq.num_cached += n
        ready = [i for i, s in enumerate(batch.seqs) if s.num_uncached == 0]
        out: list[int | None] = [None] * len(batch.seqs)
        if not ready:
            return out
        seqs = [batch.seqs[i] for i in ready]
        logits = self.model.compute_logits(hidden[ready])
        st = SamplingTensors.from_params([s.params for s in seqs], [s.generator for s in seqs], self.device)
        for i, tok in zip(ready, sample(logits, st).tolist()):
            out[i] = tok
        return out
