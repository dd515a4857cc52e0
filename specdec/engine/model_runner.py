"""Turns a scheduled batch into tensors, runs the model over the paged cache, and samples.

    tokens, positions: [B, S]   each row a sequence's new tokens, right-padded (position -1)
    context:           [B, L]   every slot the row attends: its cached prefix + this step's tokens
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

    def prepare(self, seqs: list[Sequence], num_new: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Inputs and attention metadata for `num_new[i]` uncached tokens of each sequence."""
        B, S = len(seqs), max(num_new)
        bs = self.allocator.block_size
        tokens = torch.zeros(B, S, dtype=torch.long)
        positions = torch.full((B, S), -1, dtype=torch.long)
        ends = [s.num_cached + n for s, n in zip(seqs, num_new)]
        L = max(ends)
        tables = torch.full((B, -(-L // bs)), NULL_BLOCK, dtype=torch.long)
        for i, (seq, n) in enumerate(zip(seqs, num_new)):
            start = seq.num_cached
            tokens[i, :n] = torch.tensor(seq.token_ids[start:start + n])
            positions[i, :n] = torch.arange(start, start + n)
            blocks = seq.block_table.blocks[: tables.shape[1]]
            tables[i, : len(blocks)] = torch.tensor(blocks)
        pos = torch.arange(L)
        valid = pos[None, :] < torch.tensor(ends)[:, None]  # [B, L]
        context_slots = torch.where(valid, tables[:, pos // bs] * bs + pos % bs, NULL_BLOCK * bs)
        context_positions = torch.where(valid, pos[None, :], -1)
        slot_mapping = torch.where(positions >= 0, context_slots.gather(1, positions.clamp(min=0)), NULL_BLOCK * bs)
        meta = AttentionMetadata.causal(positions.to(self.device), context_slots.to(self.device),
                                        context_positions.to(self.device), slot_mapping.reshape(-1).to(self.device))
        return tokens.to(self.device), positions.to(self.device), meta

    def forward(self, seqs: list[Sequence], num_new: list[int]) -> torch.Tensor:
        """Run the model; returns the hidden state of each sequence's last new token, [B, H]."""
        tokens, positions, meta = self.prepare(seqs, num_new)
        hidden, _ = self.model(tokens, positions, meta, self.kv)
        last = torch.tensor(num_new, device=self.device) - 1
        return hidden[torch.arange(len(seqs), device=self.device), last]

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
