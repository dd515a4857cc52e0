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

try:
    import numba
    import numpy as np
    from numba import njit, prange
except ImportError:  # pragma: no cover - numba is a dependency; torch alone still gives correct results
    numba = None


if numba is not None:
    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def _gemm_rows(w, x, y):  # pragma: no cover - compiled
        """y[m, r] = dot(w[r], x[m]) for w: [out, in], x: [M, in], y: [M, out] (float32, contiguous).

        Rows of w are split across threads; four rows of x share each load of w, so a weight is
        read from memory once per call whatever M is.
        """
        n_out, n_in = w.shape
        n_rows = x.shape[0]
        block = 16
        for b in prange((n_out + block - 1) // block):
            for r in range(b * block, min(n_out, b * block + block)):
                m = 0
                while m + 4 <= n_rows:
                    a0 = np.float32(0.0)
                    a1 = np.float32(0.0)
                    a2 = np.float32(0.0)
                    a3 = np.float32(0.0)
                    for k in range(n_in):
                        wk = w[r, k]
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
                        acc += w[r, k] * x[m, k]
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
    def _paged_attention(q, k, v, k_pool, v_pool, slot_mapping, context_slots, mask, scale, out):
        """Write the new K/V at their slots, then attend each query over its sequence's context slots.

        q: [B, S, Hq, D]; k, v: [B, S, Hkv, D]; pools: [N, Hkv, D]; slot_mapping: [B*S];
        context_slots: [B, L]; mask: [B, S, L] bool; out: [B, S, Hq, D].
        """  # pragma: no cover - compiled
        B, S, Hq, D = q.shape
        Hkv = k.shape[2]
        group = Hq // Hkv
        L = context_slots.shape[1]
        for t in range(B * S):
            slot = slot_mapping[t]
            for h in range(Hkv):
                for d in range(D):
                    k_pool[slot, h, d] = k[t // S, t % S, h, d]
                    v_pool[slot, h, d] = v[t // S, t % S, h, d]
        for task in prange(B * S * Hq):
            b = task // (S * Hq)
            s = (task // Hq) % S
            h = task % Hq
            hk = h // group
            scores = np.empty(L, np.float32)
            best = np.float32(-np.inf)
            for j in range(L):
                if mask[b, s, j]:
                    slot = context_slots[b, j]
                    acc = np.float32(0.0)
                    for d in range(D):
                        acc += q[b, s, h, d] * k_pool[slot, hk, d]
                    acc *= scale
                    scores[j] = acc
                    if acc > best:
                        best = acc
            total = np.float32(0.0)
            acc_v = np.zeros(D, np.float32)
            for j in range(L):
                if mask[b, s, j]:
                    p = np.exp(scores[j] - best)
                    total += p
                    slot = context_slots[b, j]
                    for d in range(D):
                        acc_v[d] += p * v_pool[slot, hk, d]
            for d in range(D):
                out[b, s, h, d] = acc_v[d] / total


def _fast(*tensors: torch.Tensor) -> bool:
    return numba is not None and not _DISABLED and all(
        t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def use_fast_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.shape[0] <= SMALL_M and _fast(x, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [T, H]; the numba path for small T in float32."""
    if x.dim() == 2 and x.shape[0] <= SMALL_M and _fast(x, weight):
        x = x.contiguous()
        out = torch.empty_like(x)
        _rms_norm(x.numpy(), weight.numpy(), eps, out.numpy())
        return out
    return F.rms_norm(x, weight.shape, weight, eps)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                    v_pool: torch.Tensor, slot_mapping: torch.Tensor, context_slots: torch.Tensor,
                    mask: torch.Tensor, scale: float) -> torch.Tensor | None:
    """The numba decode path of `attention.paged_attention`, or None when it does not apply.

    q: [B, S, Hq, D]; k, v: [B, S, Hkv, D]; mask: [B, S, L] bool. Returns [B, S, Hq, D].
    """
    if q.shape[0] * q.shape[1] > SMALL_M or not _fast(q, k, v, k_pool, v_pool):
        return None
    out = torch.empty_like(q)
    _paged_attention(q.contiguous().numpy(), k.contiguous().numpy(), v.contiguous().numpy(),
                     k_pool.numpy(), v_pool.numpy(), slot_mapping.numpy(), context_slots.numpy(),
                     mask.contiguous().numpy(), scale, out.numpy())
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias. x: [M, in], weight: [out, in] (nn.Linear layout)."""
    if not use_fast_gemv(x, weight):
        return F.linear(x, weight, bias)
    x = x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    _gemm_rows(weight.numpy(), x.numpy(), y.numpy())
    return y if bias is None else y.add_(bias)


_DISABLED = os.environ.get("SPECDEC_DISABLE_KERNELS", "") not in ("", "0")
