"""CPU kernels for decoding, compiled by numba (LLVM, vectorized, split across threads).

Decoding reads every weight once per step, so its speed is memory bandwidth. On our CPUs torch's fp32
GEMV streams weights at ~21 GB/s with one or two threads, while the machine reads at ~38 GB/s; the row-dot
kernel here reaches ~40 GB/s. The attention and norm kernels exist because, at one token per sequence, the
dozen small torch ops they replace cost more in dispatch than in arithmetic. They serve the small batches
of decode and verification (up to `SMALL_M` rows); prefill is compute-bound and stays on torch, which is
also the reference every kernel is tested against.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

SMALL_M = 16
# The attention kernel's scalar exp makes it slower than torch's SDPA once several queries per sequence
# (verification of a draft) meet a long context; single-token decode is where it wins.
MAX_FUSED_QUERIES = 2

try:
    import numba
    import numpy as np
    from numba import njit, prange, types
    from numba.extending import overload
except ImportError:  # pragma: no cover - numba is a dependency; torch alone still gives correct results
    numba = None


def _weight_row(w, r, buf):  # pragma: no cover - a stub: only its numba overloads run
    """Row r of a weight matrix as float32: a view for float32 weights, widened into buf for bf16."""
    raise NotImplementedError


if numba is not None:
    @overload(_weight_row)
    def _weight_row_impl(w, r, buf):  # pragma: no cover - compiled
        if w.dtype == types.uint16:  # bfloat16 bits: the high half of a float32
            def widen(w, r, buf):
                for k in range(w.shape[1]):
                    buf[k] = np.uint32(w[r, k]) << np.uint32(16)
                return buf.view(np.float32)
            return widen
        return lambda w, r, buf: w[r]

    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def _gemm_rows(w, x, y):  # pragma: no cover - compiled
        """y[m, r] = dot(w[r], x[m]) for w: [out, in] float32 or bf16 bits (uint16), x: [M, in] float32,
        y: [M, out] float32 (all contiguous).

        Rows of w are split across threads; four rows of x share each load of w, so a weight is read
        from memory once per call whatever M is. bf16 weights are widened row by row and accumulated in
        float32: half the bytes of float32 for the same arithmetic, whatever the batch shape.
        """
        n_out, n_in = w.shape
        n_rows = x.shape[0]
        block = 16
        for b in prange((n_out + block - 1) // block):
            buf = np.empty(n_in, np.uint32)
            for r in range(b * block, min(n_out, b * block + block)):
                row = _weight_row(w, r, buf)
                m = 0
                while m + 4 <= n_rows:
                    a0 = np.float32(0.0)
                    a1 = np.float32(0.0)
                    a2 = np.float32(0.0)
                    a3 = np.float32(0.0)
                    for k in range(n_in):
                        wk = row[k]
                        a0 += wk * x[m, k]
                        a1 += wk * x[m + 1, k]
                        a2 += wk * x[m + 2, k]
                        a3 += wk * x[m + 3, k]
                    y[m, r] = a0
                    y[m + 1, r] = a1
                    y[m + 2, r] = a2
                    y[m + 3, r] = a3
                    m += 4
                while m < n_rows:
                    acc = np.float32(0.0)
                    for k in range(n_in):
                        acc += row[k] * x[m, k]
                    y[m, r] = acc
                    m += 1


    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def _rms_norm(x, w, eps, out):  # pragma: no cover - compiled
        for t in prange(x.shape[0]):
            ss = np.float32(0.0)
            for i in range(x.shape[1]):
                ss += x[t, i] * x[t, i]
            inv = np.float32(1.0) / np.sqrt(ss / np.float32(x.shape[1]) + np.float32(eps))
            for i in range(x.shape[1]):
                out[t, i] = w[i] * (x[t, i] * inv)

    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def _paged_attention(q, k, v, k_pool, v_pool, slot_mapping, context_slots, mask, S, scale, out):
        """Write the new K/V at their slots, then attend each query over its sequence's context slots.

        q: [T, Hq, D]; k, v: [T, Hkv, D] (T = B * S); pools: [N, Hkv, D]; slot_mapping: [T];
        context_slots: [B, L]; mask: [B, S, L] bool; out: [T, Hq, D].
        One task per (sequence, KV head): each cached K/V row is read once for all the queries sharing it.
        """  # pragma: no cover - compiled
        T, Hq, D = q.shape
        Hkv = k.shape[1]
        group = Hq // Hkv
        L = context_slots.shape[1]
        for t in range(T):
            k_pool[slot_mapping[t]] = k[t]
            v_pool[slot_mapping[t]] = v[t]
        for task in prange((T // S) * Hkv):
            b, hk = task // Hkv, task % Hkv
            R = S * group  # query rows sharing this KV head: row s * group + g
            scores = np.full((R, L), -np.inf, np.float32)
            for j in range(L):
                key = k_pool[context_slots[b, j], hk]
                for s in range(S):
                    if mask[b, s, j]:
                        for g in range(group):
                            acc = np.float32(0.0)
                            for d in range(D):
                                acc += q[b * S + s, hk * group + g, d] * key[d]
                            scores[s * group + g, j] = acc * scale
            for r in range(R):
                row = scores[r]
                row[:] = np.exp(row - row.max())
                row /= row.sum()
            acc_v = np.zeros((R, D), np.float32)
            for j in range(L):
                value = v_pool[context_slots[b, j], hk]
                for r in range(R):
                    p = scores[r, j]
                    if p > 0:
                        for d in range(D):
                            acc_v[r, d] += p * value[d]
            for s in range(S):
                for g in range(group):
                    out[b * S + s, hk * group + g] = acc_v[s * group + g]

    @njit(fastmath=True, cache=True, nogil=True)
    def _rope_and_qk_norm(qkv, n_rot, n_heads, q_norm, k_norm, eps, cos, ssin):
        """In place on qkv [T, heads, D]: per-head RMSNorm of q and k (Qwen3, when given), then RoPE
        on the first n_rot heads (q and k). HF 'rotate_half' layout; ssin = [-sin, sin] halves."""
        T, _, D = qkv.shape
        half = D // 2
        tmp = np.empty(D, np.float32)
        for t in range(T):
            for h in range(n_rot):
                if q_norm.shape[0] > 0:
                    w = q_norm if h < n_heads else k_norm
                    ss = np.float32(0.0)
                    for d in range(D):
                        ss += qkv[t, h, d] * qkv[t, h, d]
                    inv = np.float32(1.0) / np.sqrt(ss / np.float32(D) + np.float32(eps))
                    for d in range(D):
                        qkv[t, h, d] = w[d] * (qkv[t, h, d] * inv)
                for d in range(D):
                    tmp[d] = qkv[t, h, d]
                for d in range(D):
                    qkv[t, h, d] = tmp[d] * cos[t, d] + tmp[(d + half) % D] * ssin[t, d]

    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def _decoder_layer(x, ln1, qkv_w, qkv_b, q_norm, k_norm, o_w, ln2, gate_up_w, down_w, eps, cos, ssin,
                       k_pool, v_pool, slot_mapping, context_slots, mask, S, n_heads, n_kv, scale):
        """One whole decoder layer for a few tokens, in place on x [T, H]: the decode fast path.

        Same math as `llama.DecoderLayer.forward`, without a dozen torch dispatches per layer.
        """  # pragma: no cover - compiled
        T, H = x.shape
        D = cos.shape[1]
        h = np.empty_like(x)
        _rms_norm(x, ln1, eps, h)
        qkv = np.empty((T, qkv_w.shape[0]), np.float32)
        _gemm_rows(qkv_w, h, qkv)
        if qkv_b.shape[0] > 0:
            for t in range(T):
                qkv[t] += qkv_b
        heads = qkv.reshape(T, n_heads + 2 * n_kv, D)
        _rope_and_qk_norm(heads, n_heads + n_kv, n_heads, q_norm, k_norm, eps, cos, ssin)
        attn = np.empty((T, n_heads, D), np.float32)
        q = np.ascontiguousarray(heads[:, :n_heads])  # contiguous, so the score loop vectorizes
        k = np.ascontiguousarray(heads[:, n_heads:n_heads + n_kv])
        v = np.ascontiguousarray(heads[:, n_heads + n_kv:])
        _paged_attention(q, k, v, k_pool, v_pool, slot_mapping, context_slots, mask, S, scale, attn)
        out = np.empty((T, H), np.float32)
        _gemm_rows(o_w, attn.reshape(T, n_heads * D), out)
        x += out
        _rms_norm(x, ln2, eps, h)
        gate_up = np.empty((T, gate_up_w.shape[0]), np.float32)
        _gemm_rows(gate_up_w, h, gate_up)
        inter = gate_up_w.shape[0] // 2
        act = np.empty((T, inter), np.float32)
        for t in range(T):
            for i in range(inter):
                g = gate_up[t, i]
                act[t, i] = g / (np.float32(1.0) + np.exp(-g)) * gate_up[t, inter + i]
        _gemm_rows(down_w, act, out)
        x += out


def _fast(*tensors: torch.Tensor) -> bool:
    return numba is not None and not _DISABLED and all(
        t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def use_fast_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.shape[0] <= SMALL_M and _fast(x) and weight.device.type == "cpu"
            and weight.dtype in (torch.float32, torch.bfloat16))


def as_numpy(t: torch.Tensor) -> "np.ndarray":
    """A numpy view for the kernels: float32 as is, bfloat16 as its raw 16 bits (uint16)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [T, H]; the numba path for small T in float32."""
    if x.dim() == 2 and x.shape[0] <= SMALL_M and _fast(x, weight):
        x = x.contiguous()
        out = torch.empty_like(x)
        _rms_norm(x.numpy(), weight.numpy(), eps, out.numpy())
        return out
    return F.rms_norm(x, weight.shape, weight, eps)


def can_fuse_layer(x: torch.Tensor, meta_query_lens: list[int]) -> bool:
    """Whether `decoder_layer` applies: a few float32 CPU tokens, one (or two) per sequence."""
    return (max(meta_query_lens) <= MAX_FUSED_QUERIES and len(set(meta_query_lens)) == 1
            and x.shape[0] <= SMALL_M and _fast(x))


def decoder_layer(x: torch.Tensor, weights: tuple, cos: torch.Tensor, signed_sin: torch.Tensor,
                  k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor,
                  context_slots: torch.Tensor, mask: torch.Tensor, num_heads: int, num_kv_heads: int,
                  eps: float, scale: float) -> torch.Tensor:
    """One decoder layer through the fused kernel. weights: numpy arrays in `_decoder_layer` order
    (ln1, qkv_w, qkv_b, q_norm, k_norm, o_w, ln2, gate_up_w, down_w; absent ones empty). x: [T, H]."""
    out = x.clone()
    _decoder_layer(out.numpy(), *weights, eps, cos.numpy(), signed_sin.numpy(), k_pool.numpy(), v_pool.numpy(),
                   slot_mapping.numpy(), context_slots.numpy(), mask.numpy(), mask.shape[1], num_heads,
                   num_kv_heads, scale)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias. x: [M, in], weight: [out, in] (nn.Linear layout).

    Weights may be stored in a narrower dtype than x (bfloat16 weights, float32 activations on CPU):
    the result is always in x's dtype."""
    if use_fast_gemv(x, weight):
        x = x.contiguous()
        y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
        _gemm_rows(as_numpy(weight), x.numpy(), y.numpy())
        return y if bias is None else y.add_(bias)
    if weight.dtype != x.dtype:  # large batches (prefill): torch's bf16 GEMM, back to x's dtype
        return F.linear(x.to(weight.dtype), weight).to(x.dtype) + (0 if bias is None else bias)
    return F.linear(x, weight, bias)


_DISABLED = os.environ.get("SPECDEC_DISABLE_KERNELS", "") not in ("", "0")
