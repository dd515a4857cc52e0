"""Attention over a paged KV cache, driven by one explicit metadata object.

The model knows nothing about requests or speculation. Tokens of all sequences in a step are
flattened into T rows (sequence i owns `query_lens[i]` consecutive rows), and each forward gets an
`AttentionMetadata` saying where the new K/V go and which cached slots every query may read:

    KV pool (per layer):  [num_slots, num_kv_heads, head_dim]   slot = block_id * block_size + offset
    slot_mapping:         [T]        where each new token's K/V goes
    context_slots:        [B, L]     the slots sequence i attends (cached prefix + new tokens), padded with 0
    mask:                 [B, S, L]  bool, True where the s-th new token of sequence i may see key l
                                     (S = max query length; causal today, a tree suffix later)
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from specdec.models.blocks.kernels import on_native
from specdec.models.cpu import native


class KVLayers(Protocol):
    """What a model reads and writes of a K/V cache: one paged K and one paged V tensor per layer, [num_blocks,
    block_size, Hkv, D] each (`specdec.kv_cache.KVPool` is one; the models never import it)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long
    context_slots: torch.Tensor  # [B, L] long
    mask: torch.Tensor  # [B, S, L] bool
    query_lens: list[int]  # rows of each sequence, host side
    context_lens: list[int]  # valid keys of each sequence, host side
    # Draft trees: where each sequence's tree region begins in its context. Keys before it (the cached
    # prefix) are visible to every row of the sequence; `mask` matters only from there on.
    tree_starts: list[int] | None = None
    # [B + 1] int64 on the CPU: the first row of each sequence, and T (the native kernels' ragged batches). Given by
    # the native layout builder, else made on first use (`row_starts`).
    query_starts: torch.Tensor | None = None

    def row_starts(self) -> torch.Tensor:
        """`query_starts`, made once from `query_lens` where the layout builder did not give it."""
        if self.query_starts is None:
            self.query_starts = torch.tensor(list(itertools.accumulate(self.query_lens, initial=0)), dtype=torch.int64)
        return self.query_starts

    @property
    def uniform(self) -> bool:
        """Every sequence feeds the same number of tokens (decode, chain verification)."""
        return len(set(self.query_lens)) == 1

    def to(self, device: torch.device) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping.to(device), self.context_slots.to(device), self.mask.to(device),
                                 self.query_lens, self.context_lens, self.tree_starts, self.query_starts)

    def windowed(self, window: int) -> AttentionMetadata:
        """This step's layout for a sliding-window layer: each query keeps its last `window` visible keys. A query
        sees its whole prefix and, in a tree, one ancestor per position, so its visible keys in slot order are at
        consecutive positions ending at its own: the last `window` of them are those at positions > its - window
        (transformers' and llama.cpp's rule). The tree split is off: the mask says everything."""
        mask = self.mask
        rank = mask.cumsum(-1)  # [B, S, L] 1-based rank of each visible key in its row
        keep = rank > rank[..., -1:] - window
        return AttentionMetadata(self.slot_mapping, self.context_slots, mask & keep, self.query_lens,
                                 self.context_lens, None, self.query_starts)

    @classmethod
    def causal(cls, positions: torch.Tensor, context_slots: torch.Tensor, context_positions: torch.Tensor,
               slot_mapping: torch.Tensor, query_lens: list[int]) -> AttentionMetadata:
        """Standard causal attention: a query sees every valid key at a position <= its own.

        positions: [B, S] (-1 for padding), context_positions: [B, L] (-1 for padding keys).
        """
        valid = (context_positions >= 0)[:, None, :]  # [B, 1, L]
        mask = valid & (context_positions[:, None, :] <= positions[:, :, None])  # [B, S, L]
        mask[:, :, 0] |= positions < 0  # a padding query still sees one key, so softmax stays finite
        context_lens = (context_positions >= 0).sum(1).tolist()
        return cls(slot_mapping, context_slots, mask, list(query_lens), context_lens)


def _sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
          softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, S, Hq, D]; keys, values: [B, L, Hkv, D]; mask: [B, S, L] -> [B, S, Hq, D].

    The G query heads sharing a KV head are folded into the query axis: GQA without repeating K/V. softcap > 0:
    scores become cap * tanh(score / cap) before the mask (Gemma 2); sinks [Hq]: each head's learned logit joins
    its softmax and takes its share with no value (gpt-oss); written out since SDPA has neither option.
    """
    B, S, Hq, D = q.shape
    Hkv, L = keys.shape[2], keys.shape[1]
    G = Hq // Hkv
    qf = q.view(B, S, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * S, D)
    mf = mask[:, None].expand(B, G, S, L).reshape(B, 1, G * S, L)
    if softcap > 0 or sinks is not None:
        scores = qf @ keys.permute(0, 2, 3, 1) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mf, float("-inf")).float()
        if sinks is not None:  # [Hkv, G] heads, each row of a head's S queries
            sink = sinks.float().view(1, Hkv, G, 1, 1).expand(B, Hkv, G, S, 1).reshape(B, Hkv, G * S, 1)
            scores = torch.cat((scores, sink), dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :L]
        out = probs.to(qf.dtype) @ values.transpose(1, 2)
        return out.view(B, Hkv, G, S, D).permute(0, 3, 1, 2, 4).reshape(B, S, Hq, D)
    out = F.scaled_dot_product_attention(qf, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mf, scale=scale)
    return out.view(B, Hkv, G, S, D).permute(0, 3, 1, 2, 4).reshape(B, S, Hq, D)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Write the new K/V into the pool, then attend over each sequence's context slots (window > 0: each query's
    last `window` keys, `AttentionMetadata.windowed`; softcap > 0: Gemma 2's capped scores; sinks: gpt-oss's).

    q: [T, Hq, D]; k, v: [T, Hkv, D]; pools: [num_slots, Hkv, D]. Returns [T, Hq, D].
    """
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    k_pool.index_copy_(0, meta.slot_mapping, k)
    v_pool.index_copy_(0, meta.slot_mapping, v)
    if window > 0:
        meta = meta.windowed(window)
    if meta.tree_starts is not None and softcap == 0 and sinks is None:
        return _tree_split(q, k_pool, v_pool, meta, scale)
    if meta.uniform:
        B, S, L = len(meta.query_lens), meta.query_lens[0], meta.context_slots.shape[1]
        slots = meta.context_slots.reshape(-1)
        keys = k_pool.index_select(0, slots).view(B, L, Hkv, D)
        values = v_pool.index_select(0, slots).view(B, L, Hkv, D)
        return _sdpa(q.reshape(B, S, Hq, D), keys, values, meta.mask, scale, softcap, sinks).reshape(T, Hq, D)
    # Ragged (prefill of different lengths): one attention per sequence, no padded rows at all.
    outs, start = [], 0
    for i, (n, L) in enumerate(zip(meta.query_lens, meta.context_lens)):
        slots = meta.context_slots[i, :L]
        keys, values = k_pool.index_select(0, slots)[None], v_pool.index_select(0, slots)[None]
        outs.append(_sdpa(q[start:start + n][None], keys, values, meta.mask[i:i + 1, :n, :L], scale, softcap,
                          sinks)[0])
        start += n
    return torch.cat(outs)


def _tree_split(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
    """Draft trees the way the Meta report splits them: attention to the cached prefix without a mask,
    attention within the tree region with the small tree mask, merged exactly by log-sum-exp."""
    from specdec.models.blocks.tree_attention import paged_tree_attention

    T, Hq, D = q.shape
    B, S = len(meta.query_lens), max(meta.query_lens)
    starts, ends = meta.tree_starts, meta.context_lens
    P, W = max(starts), max(e - s for s, e in zip(starts, ends))
    dev = q.device
    qp = q.new_zeros(B, S, Hq, D)
    prefix = torch.zeros(B, P, dtype=torch.long, device=dev)
    suffix = torch.zeros(B, W, dtype=torch.long, device=dev)
    suffix_mask = torch.zeros(B, S, W, dtype=torch.bool, device=dev)
    row = 0
    for i, (n, start, end) in enumerate(zip(meta.query_lens, starts, ends)):
        qp[i, :n] = q[row:row + n]
        row += n
        prefix[i, :start] = meta.context_slots[i, :start]
        suffix[i, :end - start] = meta.context_slots[i, start:end]
        suffix_mask[i, :n, :end - start] = meta.mask[i, :n, start:end]
    out = paged_tree_attention(qp, k_pool, v_pool, prefix, starts, suffix, suffix_mask, scale)
    return torch.cat([out[i, :n] for i, n in enumerate(meta.query_lens)])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
           meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_attention`, through the fused layers' own C++ attention on CPU: a query's result then does not depend
    on the other queries of its step (torch's attention picks kernels by shape). v_pool may be k_pool (latent
    attention reads its keys as values): the rows are then written once."""
    if not on_native(q, k, v) or k_pool.device.type != "cpu":
        return paged_attention(q, k, v, k_pool, v_pool, meta, scale, window, softcap, sinks)
    k_pool.index_copy_(0, meta.slot_mapping, k.to(k_pool.dtype))
    if v_pool is not k_pool:
        v_pool.index_copy_(0, meta.slot_mapping, v.to(v_pool.dtype))
    sinks = sinks.detach().float().contiguous() if sinks is not None else torch.empty(0)
    return native.ops().attention(q.contiguous(), k_pool, v_pool, meta.context_slots, meta.mask, meta.row_starts(),
                                  scale, window, softcap, sinks)
