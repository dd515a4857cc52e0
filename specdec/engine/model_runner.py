"""Turns a scheduled batch into tensors, runs the model over the paged cache, and samples.

    tokens, positions: [T]      every sequence's new tokens, flattened (no padding)
    context:           [B, L]   every slot sequence i attends: its cached prefix + this step's tokens
"""
from __future__ import annotations

import torch

from specdec.engine.scheduler import ScheduledBatch
from specdec.engine.sequence import Sequence
from specdec.kv_cache import NULL_BLOCK, BlockAllocator, KVPool
from specdec.models.attention import AttentionMetadata
from specdec.models.llama import LlamaModel
from specdec.sampling import SamplingTensors, sample


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVPool, allocator: BlockAllocator) -> None:
        self.model, self.kv, self.allocator = model, kv, allocator
        self.device = model.device

    def sibling(self, model: LlamaModel) -> "ModelRunner":
        """A runner for another model (a draft) with its own KV pool over the same blocks and block tables."""
        kv = KVPool(model.config, self.allocator.num_blocks, self.allocator.block_size, model.act_dtype,
                    model.device)
        return ModelRunner(model, kv, self.allocator)

    def prepare(self, seqs: list[Sequence], num_new: list[int], extra_tokens: list[list[int]] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Inputs and attention metadata for `num_new[i]` uncached tokens of each sequence, continued by
        `extra_tokens[i]` (draft tokens, not committed) when given."""
        feeds = [(s.token_ids[s.num_cached:] + (extra_tokens[i] if extra_tokens else []))[:n]
                 for i, (s, n) in enumerate(zip(seqs, num_new))]
        return self.build([s.block_table.blocks for s in seqs], [s.num_cached for s in seqs], feeds)

    def build(self, tables: list[list[int]], starts: list[int], feeds: list[list[int]]
              ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Tensors for feeding `feeds[i]` at positions starts[i].. of the sequence owning blocks tables[i]."""
        num_new = [len(f) for f in feeds]
        B, S = len(feeds), max(num_new)
        bs = self.allocator.block_size
        ends = [start + n for start, n in zip(starts, num_new)]
        L = max(ends)
        padded_positions = torch.full((B, S), -1, dtype=torch.long)
        block_tables = torch.full((B, -(-L // bs)), NULL_BLOCK, dtype=torch.long)
        for i, (start, n, blocks) in enumerate(zip(starts, num_new, tables)):
            padded_positions[i, :n] = torch.arange(start, start + n)
            blocks = blocks[: block_tables.shape[1]]
            block_tables[i, : len(blocks)] = torch.tensor(blocks)
        pos = torch.arange(L)
        valid = pos[None, :] < torch.tensor(ends)[:, None]  # [B, L]
        context_slots = torch.where(valid, block_tables[:, pos // bs] * bs + pos % bs, NULL_BLOCK * bs)
        context_positions = torch.where(valid, pos[None, :], -1)
        is_new = padded_positions >= 0
        positions = padded_positions[is_new]  # [T], row-major: sequence by sequence
        slot_mapping = context_slots.gather(1, padded_positions.clamp(min=0))[is_new]
        dev = self.device
        meta = AttentionMetadata.causal(padded_positions.to(dev), context_slots.to(dev),
                                        context_positions.to(dev), slot_mapping.to(dev), num_new)
        tokens = torch.tensor([t for f in feeds for t in f], dtype=torch.long, device=dev)
        return tokens, positions.to(dev), meta

    def run(self, tables: list[list[int]], starts: list[int], feeds: list[list[int]],
            num_layers: int | None = None) -> torch.Tensor:
        """Feed explicit tokens (how drafters use a runner); hidden states of every fed token, [T, H]."""
        tokens, positions, meta = self.build(tables, starts, feeds)
        return self.model(tokens, positions, meta, self.kv, num_layers=num_layers)[0]

    def forward(self, seqs: list[Sequence], num_new: list[int]) -> torch.Tensor:
        """Run the model; returns the hidden state of each sequence's last new token, [B, H]."""
        hidden = self.forward_rows(seqs, num_new)
        last = torch.tensor(num_new, device=self.device).cumsum(0) - 1
        return hidden[last]

    def forward_rows(self, seqs: list[Sequence], num_new: list[int], extra_tokens: list[list[int]] | None = None
                     ) -> torch.Tensor:
        """Run the model; the hidden state of every new token, [T, H] (sequence by sequence)."""
        tokens, positions, meta = self.prepare(seqs, num_new, extra_tokens)
        return self.model(tokens, positions, meta, self.kv)[0]

    def step(self, batch: ScheduledBatch) -> list[int | None]:
        """One forward for the batch; the next token of every sequence whose input is now fully cached."""
        hidden = self.forward(batch.seqs, batch.num_new_tokens)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
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
