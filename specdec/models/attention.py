"""Attention over a paged KV cache, driven by one explicit metadata object.

The model knows nothing about requests or speculation. Each forward gets an `AttentionMetadata`
that says where the new tokens' K/V are written and which cached slots every query may read:

    KV pool (per layer):  [num_slots, num_kv_heads, head_dim]   slot = block_id * block_size + offset
    slot_mapping:         [B*S]    where each new token's K/V goes (padding -> the null slot 0)
    context_slots:        [B, L]   the slots each sequence attends (cached prefix + new tokens), padded with 0
    mask:                 [B, 1, S, L] bool, True where query s may see key l
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.models import kernels


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [B*S] long
    context_slots: torch.Tensor  # [B, L] long
    mask: torch.Tensor  # [B, 1, S, L] bool

    @classmethod
    def causal(cls, positions: torch.Tensor, context_slots: torch.Tensor, context_positions: torch.Tensor,
               slot_mapping: torch.Tensor) -> "AttentionMetadata":
        """Standard causal attention: a query sees every valid key at a position <= its own.

        positions: [B, S] (-1 for padding queries), context_positions: [B, L] (-1 for padding keys).
        """
        valid = (context_positions >= 0)[:, None, :]  # [B, 1, L]
        mask = valid & (context_positions[:, None, :] <= positions[:, :, None])  # [B, S, L]
        # A padding query must still see one key, or softmax would produce NaN.
        mask[:, :, 0] |= positions < 0
        return cls(slot_mapping, context_slots, mask[:, None])


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    meta: AttentionMetadata, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Write the new K/V into the pool, then attend over the slots in `meta.context_slots`.

    q: [B, S, Hq, D]; k, v: [B, S, Hkv, D]; pools: [num_slots, Hkv, D];
    mask: [B, 1, G*S, L] (the metadata mask repeated for the G query heads sharing a KV head).
    Returns [B, S, Hq, D].
    """
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    fast = kernels.paged_attention(q, k, v, k_pool, v_pool, meta.slot_mapping, meta.context_slots,
                                   meta.mask[:, 0], scale)
    if fast is not None:
        return fast
    k_pool.index_copy_(0, meta.slot_mapping, k.reshape(B * S, Hkv, D))
    v_pool.index_copy_(0, meta.slot_mapping, v.reshape(B * S, Hkv, D))
    L = meta.context_slots.shape[1]
    slots = meta.context_slots.reshape(-1)
    keys = k_pool.index_select(0, slots).view(B, L, Hkv, D).permute(0, 2, 1, 3)  # [B, Hkv, L, D]
    values = v_pool.index_select(0, slots).view(B, L, Hkv, D).permute(0, 2, 1, 3)
    # Fold the G query heads of each KV head into the query axis: GQA without repeating K/V.
    qf = q.view(B, S, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * S, D)
    out = F.scaled_dot_product_attention(qf, keys, values, attn_mask=mask, scale=scale)  # [B, Hkv, G*S, D]
    return out.view(B, Hkv, G, S, D).permute(0, 3, 1, 2, 4).reshape(B, S, Hq, D)


def fold_gqa_mask(mask: torch.Tensor, group: int) -> torch.Tensor:
    """[B, 1, S, L] -> [B, 1, G*S, L], matching the query folding in `paged_attention`."""
    B, _, S, L = mask.shape
    return mask.expand(B, group, S, L).reshape(B, 1, group * S, L)
