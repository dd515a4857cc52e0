r"""Tree attention as prefix + suffix, merged by log-sum-exp (EAGLE at scale, section 3.1).

A speculative tree of S draft tokens is flattened into one query block per sequence. Every tree
token must see the whole cached prefix of its sequence, but only itself and its ancestors among the
new tokens. Instead of one attention over [prefix + tree] with a big explicit mask, split it:

                      keys:  cached prefix (P, paged)          | new tree tokens (S)
                             p0  p1  p2  ...  p(len-1)  pad..  | t0  t1  t2  t3  t4
    query t0 (root)          x   x   x   ...  x         .      | x   .   .   .   .
    query t1 (child of t0)   x   x   x   ...  x         .      | x   x   .   .   .
    query t2 (child of t0)   x   x   x   ...  x         .      | x   .   x   .   .
    query t3 (child of t1)   x   x   x   ...  x         .      | x   x   .   x   .
    query t4 (child of t2)   x   x   x   ...  x         .      | x   .   x   .   x
                             \____ prefix part: mask-free ___/   \_ suffix: tree mask _/
                                   (only ragged padding)            (small, S x S)

Both parts return their partial output and the log-sum-exp (lse) of their scores; since the two key
sets are disjoint, `merge_attention` recombines them into exactly the attention over the union
(Juravsky et al., 2024; xFormers `merge_attentions`). The expensive part (prefix) needs no tree
mask, and the part that needs the tree mask is tiny.

Pure torch and device-agnostic; all shapes follow `specdec.models.blocks.attention`:
    q:           [B, S, Hq, D]          Hq = G * Hkv (GQA)
    k/v pools:   [num_slots, Hkv, D]    slot = block_id * block_size + offset
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

NEG_INF = float("-inf")


def _fold_gqa(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, S, Hq, D] -> [B, Hkv, G*S, D]: the G query heads of one KV head share its K/V untouched."""
    B, S, Hq, D = q.shape
    G = Hq // num_kv_heads
    return q.view(B, S, num_kv_heads, G, D).permute(0, 2, 3, 1, 4).reshape(B, num_kv_heads, G * S, D)


def _unfold_gqa(x: torch.Tensor, S: int) -> torch.Tensor:
    """[B, Hkv, G*S, *rest] -> [B, S, Hkv*G, *rest], the inverse of `_fold_gqa` (rest = (D,) or ())."""
    B, Hkv, GS = x.shape[:3]
    rest = x.shape[3:]
    G = GS // S
    x = x.view(B, Hkv, G, S, *rest).permute(0, 3, 1, 2, *range(4, 4 + len(rest)))
    return x.reshape(B, S, Hkv * G, *rest)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention that also returns the log-sum-exp of the scores.

    q: [B, S, Hq, D]; k, v: [B, L, Hkv, D]; mask: [B, S, L] bool (or broadcastable, e.g. [B, 1, L]),
    True = visible, None = all visible. Returns out [B, S, Hq, D] (q's dtype) and lse [B, S, Hq]
    (float32). A query that sees no key gets lse = -inf and out = 0, which `merge_attention` treats as
    "contributes nothing". Explicit matmuls instead of SDPA because SDPA does not expose the lse.
    """
    B, S, Hq, D = q.shape
    Hkv, L = k.shape[2], k.shape[1]
    G = Hq // Hkv
    qf = _fold_gqa(q, Hkv).float()  # [B, Hkv, G*S, D]
    kf = k.transpose(1, 2).float()  # [B, Hkv, L, D]
    vf = v.transpose(1, 2).float()  # [B, Hkv, L, D]
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [B, Hkv, G*S, L]
    if mask is not None:
        m = mask.expand(B, S, L)
        # A key no query sees may be a slot nobody wrote (a tree node not fed yet): it must add exactly 0, but
        # probability 0 x a NaN value is NaN, so its value is zeroed (its score is replaced by -inf below).
        vf = vf.masked_fill(~m.any(1)[:, None, :, None], 0.0)
        m = m[:, None, None].expand(B, 1, G, S, L).reshape(B, 1, G * S, L)
        scores = scores.masked_fill(~m, NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G*S]; -inf where nothing is visible
    safe_lse = lse.masked_fill(torch.isneginf(lse), 0.0)  # exp(-inf - 0) = 0 instead of NaN
    probs = torch.exp(scores - safe_lse[..., None])  # [B, Hkv, G*S, L]
    out = torch.matmul(probs, vf)  # [B, Hkv, G*S, D]
    return _unfold_gqa(out, S).to(q.dtype), _unfold_gqa(lse, S)


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over the union of two disjoint key sets, from each set's partial attention.

    out_*: [..., D] normalised partial outputs; lse_*: [...] their log-sum-exps. Since
    softmax over A u B = (e^lse_a * softmax_A + e^lse_b * softmax_B) / (e^lse_a + e^lse_b):
        lse = logaddexp(lse_a, lse_b),  out = e^(lse_a - lse) * out_a + e^(lse_b - lse) * out_b.
    A side with lse = -inf gets weight 0; if both are -inf the result is out 0, lse -inf.
    """
    lse_a, lse_b = lse_a.float(), lse_b.float()
    lse = torch.logaddexp(lse_a, lse_b)
    safe = lse.masked_fill(torch.isneginf(lse), 0.0)  # both empty: weights exp(-inf) = 0, not NaN
    w_a = torch.exp(lse_a - safe)[..., None]
    w_b = torch.exp(lse_b - safe)[..., None]
    out = w_a * out_a.float() + w_b * out_b.float()
    return out.to(out_a.dtype), lse


def _prefix_mask(prefix_lens: Sequence[int] | torch.Tensor, P: int, device: torch.device) -> torch.Tensor:
    """[B] lengths -> [B, 1, P] bool: key p of sequence i is real iff p < prefix_lens[i]."""
    lens = torch.as_tensor(prefix_lens, dtype=torch.long, device=device)
    return (torch.arange(P, device=device)[None, :] < lens[:, None])[:, None, :]


def gather_prefix(pool: torch.Tensor, prefix_slots: torch.Tensor) -> torch.Tensor:
    """pool [num_slots, Hkv, D], prefix_slots [B, P] -> [B, P, Hkv, D].

    Padding slots may be any value (negative ones are clamped to 0); they are masked out later.
    """
    B, P = prefix_slots.shape
    slots = prefix_slots.reshape(-1).clamp(min=0)
    return pool.index_select(0, slots).view(B, P, *pool.shape[1:])


def paged_tree_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         prefix_slots: torch.Tensor, prefix_lens: Sequence[int] | torch.Tensor,
                         suffix_slots: torch.Tensor, suffix_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of S tree tokens over [cached prefix + tree], computed as prefix part + suffix part, every K/V
    read from the pool (the engine writes every fed token's K/V before attending, and a drafter growing a tree
    level by level attends to nodes fed earlier).

    q: [B, S, Hq, D]; k_pool, v_pool: [num_slots, Hkv, D]; prefix_slots: [B, P] pool slots of each sequence's
    cached prefix, right-padded; prefix_lens: [B] valid entries per row (0 allowed); suffix_slots: [B, W] pool
    slots of each sequence's tree region, right-padded; suffix_mask: [B, S, W] bool, True where tree token i may
    see tree slot j (itself or an ancestor), False on padding. Returns [B, S, Hq, D].

        prefix part: every tree token sees all prefix_lens[i] cached keys  (no tree mask)
        suffix part: tree token i sees tree slot j iff suffix_mask[i, j]
        merge:       log-sum-exp combination, exact since the key sets are disjoint
    """
    keys, values = gather_prefix(k_pool, suffix_slots), gather_prefix(v_pool, suffix_slots)
    out, lse = attention_with_lse(q, keys, values, suffix_mask, scale)  # suffix
    return _with_prefix(q, out, lse, k_pool, v_pool, prefix_slots, prefix_lens, scale)


def _with_prefix(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, k_pool: torch.Tensor,
                 v_pool: torch.Tensor, prefix_slots: torch.Tensor, prefix_lens: Sequence[int] | torch.Tensor,
                 scale: float) -> torch.Tensor:
    """Merge the suffix part (out, lse) with the mask-free attention over each sequence's cached prefix."""
    P = prefix_slots.shape[1]
    if P == 0:
        return out
    keys = gather_prefix(k_pool, prefix_slots)  # [B, P, Hkv, D]
    values = gather_prefix(v_pool, prefix_slots)
    pmask = _prefix_mask(prefix_lens, P, q.device)  # [B, 1, P], broadcast over the S queries
    out_p, lse_p = attention_with_lse(q, keys, values, pmask, scale)  # prefix
    return merge_attention(out_p, lse_p, out, lse)[0]
