"""CPU kernels for decoding, compiled by numba (LLVM, vectorized, split across threads).

Decoding reads every weight once per step, so its speed is memory bandwidth. On our CPUs torch's fp32
GEMV streams weights at ~21 GB/s with one or two threads, while the machine reads at ~38 GB/s; the row-dot
kernel here reaches ~40 GB/s. The attention and norm kernels exist because, at one token per sequence, the
dozen small torch ops they replace cost more in dispatch than in arithmetic. They serve the small batches
of decode and verification (up to `SMALL_M` rows); prefill is compute-bound and stays on torch, which is
also the reference every kernel is tested against.

Both the GEMM and the attention give a row the same bits whatever else shares the call (other sequences,
or draft tokens after it): verification of k drafts computes exactly what k + 1 plain steps compute, so
greedy speculative output equals plain greedy output by construction.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from specdec.models.quant import QuantWeight

SMALL_M = 16
BLOCK = 16  # weight rows per GEMM task (and per register tile)
# Verification feeds 1 + k tokens per sequence; up to this many go through the fused layer kernel (beyond
# it, torch's batched attention wins).
MAX_FUSED_QUERIES = 16
SOFTMAX_PAD = 128  # attention score rows are padded (masked) to a multiple of this many keys: at least the
# vectorized sum's stride (16 lanes x 4 or 8 accumulators), so padding never moves a key to another lane

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


def _weight_block(w, r, buf):  # pragma: no cover - a stub: only its numba overloads run
    """Rows r..r+15 of a weight matrix as float32: a view for float32 weights, widened into buf for bf16."""
    raise NotImplementedError


def _block_buffer(w):  # pragma: no cover - a stub: only its numba overloads run
    """Scratch for `_weight_block`: a block's worth for bf16 weights, nothing for float32."""
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

    @overload(_weight_block)
    def _weight_block_impl(w, r, buf):  # pragma: no cover - compiled
        if w.dtype == types.uint16:  # bfloat16 bits: the high half of a float32
            def widen(w, r, buf):
                for i in range(BLOCK):
                    for k in range(w.shape[1]):
                        buf[i, k] = np.uint32(w[r + i, k]) << np.uint32(16)
                return buf.view(np.float32)
            return widen
        return lambda w, r, buf: w[r:r + BLOCK]

    @overload(_block_buffer)
    def _block_buffer_impl(w):  # pragma: no cover - compiled
        if w.dtype == types.uint16:
            return lambda w: np.empty((BLOCK, w.shape[1]), np.uint32)
        return lambda w: np.empty((0, 0), np.uint32)

    @njit(fastmath=True, inline="always")
    def _dot_4x4(wb, i, x, m, y, r):  # pragma: no cover - compiled
        """y[m:m+4, r+i:r+i+4] = rows m..m+3 of x against rows i..i+3 of the weight block wb."""
        a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
        a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = np.float32(0.0)
        for k in range(x.shape[1]):
            p0, p1, p2, p3 = wb[i, k], wb[i + 1, k], wb[i + 2, k], wb[i + 3, k]
            q0, q1, q2, q3 = x[m, k], x[m + 1, k], x[m + 2, k], x[m + 3, k]
            a00 += p0 * q0; a01 += p0 * q1; a02 += p0 * q2; a03 += p0 * q3  # noqa: E702
            a10 += p1 * q0; a11 += p1 * q1; a12 += p1 * q2; a13 += p1 * q3  # noqa: E702
            a20 += p2 * q0; a21 += p2 * q1; a22 += p2 * q2; a23 += p2 * q3  # noqa: E702
            a30 += p3 * q0; a31 += p3 * q1; a32 += p3 * q2; a33 += p3 * q3  # noqa: E702
        r += i
        y[m, r], y[m + 1, r], y[m + 2, r], y[m + 3, r] = a00, a01, a02, a03
        y[m, r + 1], y[m + 1, r + 1], y[m + 2, r + 1], y[m + 3, r + 1] = a10, a11, a12, a13
        y[m, r + 2], y[m + 1, r + 2], y[m + 2, r + 2], y[m + 3, r + 2] = a20, a21, a22, a23
        y[m, r + 3], y[m + 1, r + 3], y[m + 2, r + 3], y[m + 3, r + 3] = a30, a31, a32, a33

    @njit(fastmath=True, inline="always")
    def _dot_16x1(wb, x, m, y, r):  # pragma: no cover - compiled
        """y[m, r:r+16] = row m of x against the 16 rows of the weight block wb."""
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
        a8 = a9 = a10 = a11 = a12 = a13 = a14 = a15 = np.float32(0.0)
        for k in range(x.shape[1]):
            q = x[m, k]
            a0 += wb[0, k] * q; a1 += wb[1, k] * q; a2 += wb[2, k] * q; a3 += wb[3, k] * q  # noqa: E702
            a4 += wb[4, k] * q; a5 += wb[5, k] * q; a6 += wb[6, k] * q; a7 += wb[7, k] * q  # noqa: E702
            a8 += wb[8, k] * q; a9 += wb[9, k] * q; a10 += wb[10, k] * q; a11 += wb[11, k] * q  # noqa: E702
            a12 += wb[12, k] * q; a13 += wb[13, k] * q; a14 += wb[14, k] * q; a15 += wb[15, k] * q  # noqa: E702
        y[m, r], y[m, r + 1], y[m, r + 2], y[m, r + 3] = a0, a1, a2, a3
        y[m, r + 4], y[m, r + 5], y[m, r + 6], y[m, r + 7] = a4, a5, a6, a7
        y[m, r + 8], y[m, r + 9], y[m, r + 10], y[m, r + 11] = a8, a9, a10, a11
        y[m, r + 12], y[m, r + 13], y[m, r + 14], y[m, r + 15] = a12, a13, a14, a15

    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def _gemm_rows(w, x, y):  # pragma: no cover - compiled
        """y[m, r] = dot(w[r], x[m]) for w: [out, in] float32 or bf16 bits (uint16), x: [M, in] float32,
        y: [M, out] float32 (all contiguous).

        Blocks of 16 weight rows are split across threads and read from memory once per call whatever M
        is. Groups of four rows of x go through a 4x4 register tile (16 accumulators, each weight load
        used four times); a remaining row goes through a 16x1 tile. Both tiles keep 16 accumulators, so
        LLVM vectorizes them alike and every y[m, r] is summed in the same order whatever M is and
        wherever row m sits: a sequence's result does not depend on what else is in the batch (greedy
        speculative output equals plain output bit for bit). bf16 weights are widened block by block.
        """
        n_out, n_in = w.shape
        n_rows = x.shape[0]
        full = n_out // BLOCK
        for b in prange(full):
            r = b * BLOCK
            wb = _weight_block(w, r, _block_buffer(w))
            m = 0
            while m + 4 <= n_rows:
                for i in range(0, BLOCK, 4):
                    _dot_4x4(wb, i, x, m, y, r)
                m += 4
            while m < n_rows:
                _dot_16x1(wb, x, m, y, r)
                m += 1
        buf = np.empty(n_in, np.uint32)
        for r in range(full * BLOCK, n_out):  # a last partial block: plain dots, the same for every M
            row = _weight_row(w, r, buf)
            for m in range(n_rows):
                acc = np.float32(0.0)
                for k in range(n_in):
                    acc += row[k] * x[m, k]
                y[m, r] = acc

    @njit(fastmath=True, inline="always")
    def _rms_norm_row(x, w, eps, out, t):  # pragma: no cover - compiled
        ss = np.float32(0.0)
        for i in range(x.shape[1]):
            ss += x[t, i] * x[t, i]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(x.shape[1]) + np.float32(eps))
        for i in range(x.shape[1]):
            out[t, i] = w[i] * (x[t, i] * inv)

    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def _rms_norm(x, w, eps, out):  # pragma: no cover - compiled
        for t in prange(x.shape[0]):
            _rms_norm_row(x, w, eps, out, t)

    @njit(fastmath=True, cache=True, nogil=True)
    def _rms_norm_rows(x, w, eps, out):  # pragma: no cover - compiled
        """_rms_norm's loop on the calling thread (no numba thread pool: tensor-parallel ranks share cores)."""
        for t in range(x.shape[0]):
            _rms_norm_row(x, w, eps, out, t)

    @njit(fastmath=True, inline="always")
    def _softmax(row, bits):  # pragma: no cover - compiled
        """In place over row [L] (-inf = masked; L a multiple of SOFTMAX_PAD), with an exp that vectorizes.

        numba's exp is a scalar libm call per score, which made attention over long contexts the slow part
        of verifying several tokens. Here exp(x) = 2^n * e^r with n = round(x / ln 2), |r| <= ln(2) / 2, e^r
        by the Cephes polynomial (about 1e-7 relative error) and 2^n built in the exponent bits.

        The row is padded with masked scores to a multiple of SOFTMAX_PAD, a multiple of the vectorized sum's
        stride: a query's sum then has the same lanes and order whether or not more (masked) keys follow its
        last visible one, so a query fed alone or followed by draft tokens gets the same bits.
        """
        top = row.max()
        for j in range(row.shape[0]):
            x = max(row[j] - top, np.float32(-87.0))  # -inf (masked) -> an exp that is then zeroed
            n = np.floor(x * np.float32(1.44269504) + np.float32(0.5))
            r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
            p = np.float32(1.9875691500e-4)
            p = p * r + np.float32(1.3981999507e-3)
            p = p * r + np.float32(8.3334519073e-3)
            p = p * r + np.float32(4.1665795894e-2)
            p = p * r + np.float32(1.6666665459e-1)
            p = p * r + np.float32(5.0000001201e-1)
            row[j] = (p * r * r + r + np.float32(1.0)) if x > np.float32(-87.0) else np.float32(0.0)
            bits[j] = (np.int32(n) + np.int32(127)) << np.int32(23)
        scale = bits.view(np.float32)
        total = np.float32(0.0)
        for j in range(row.shape[0]):
            row[j] *= scale[j]
            total += row[j]
        inv = np.float32(1.0) / total
        for j in range(row.shape[0]):
            row[j] *= inv

    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def _paged_attention(q, k, v, k_pool, v_pool, slot_mapping, context_slots, mask, query_starts, scale, out):
        """Write the new K/V at their slots, then attend each query over its sequence's context slots.

        q: [T, Hq, D]; k, v: [T, Hkv, D]; pools: [N, Hkv, D]; slot_mapping: [T]; context_slots: [B, L];
        mask: [B, S, L] bool; query_starts: [B + 1], sequence b owns rows query_starts[b]..query_starts[b + 1]
        (ragged: a batch may verify drafts of different lengths); out: [T, Hq, D].
        One task per (sequence, KV head): each cached K/V row is read once for all the queries sharing it.
        """  # pragma: no cover - compiled
        T, Hq, D = q.shape
        Hkv = k.shape[1]
        group = Hq // Hkv
        L = context_slots.shape[1]
        for t in range(T):
            k_pool[slot_mapping[t]] = k[t]
            v_pool[slot_mapping[t]] = v[t]
        B = query_starts.shape[0] - 1
        for task in prange(B * Hkv):
            b, hk = task // Hkv, task % Hkv
            first, S = query_starts[b], query_starts[b + 1] - query_starts[b]
            R = S * group  # query rows sharing this KV head: row s * group + g
            scores = np.full((R, (L + SOFTMAX_PAD - 1) // SOFTMAX_PAD * SOFTMAX_PAD), -np.inf, np.float32)
            for j in range(L):
                key = k_pool[context_slots[b, j], hk]
                for s in range(S):
                    if mask[b, s, j]:
                        for g in range(group):
                            acc = np.float32(0.0)
                            for d in range(D):
                                acc += q[first + s, hk * group + g, d] * key[d]
                            scores[s * group + g, j] = acc * scale
            bits = np.empty(scores.shape[1], np.int32)
            for r in range(R):
                _softmax(scores[r], bits)
            acc_v = np.zeros((R, D), np.float32)
            for j in range(L):
                value = v_pool[context_slots[b, j], hk]
                for r in range(R):
                    p = scores[r, j]
                    if p != 0:  # masked keys are never read (their slots may hold anything)
                        for d in range(D):
                            acc_v[r, d] += p * value[d]
            for s in range(S):
                for g in range(group):
                    out[first + s, hk * group + g] = acc_v[s * group + g]

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
                       k_pool, v_pool, slot_mapping, context_slots, mask, query_starts, n_heads, n_kv, scale):
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
        _paged_attention(q, k, v, k_pool, v_pool, slot_mapping, context_slots, mask, query_starts, scale, attn)
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


def no_grad(*tensors: torch.Tensor) -> bool:
    """No gradient flows through these (the kernels are not differentiable; the head trainer needs torch's ops)."""
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def use_fast_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.shape[0] <= SMALL_M and _fast(x) and weight.device.type == "cpu"
            and weight.dtype in (torch.float32, torch.bfloat16) and no_grad(x, weight))


def as_numpy(t: torch.Tensor) -> "np.ndarray":
    """A numpy view for the kernels: float32 as is, bfloat16 as its raw 16 bits (uint16)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, rows: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of x [T, H]; the numba path for small T in float32, or for any T with `rows`
    (every row through the same loop: a row's bits do not depend on T, which torch's kernel does not promise)."""
    if x.dim() == 2 and (rows or x.shape[0] <= SMALL_M) and _fast(x, weight) and no_grad(x, weight):
        x = x.contiguous()
        out = torch.empty_like(x)
        (_rms_norm_rows if rows else _rms_norm)(x.numpy(), weight.numpy(), eps, out.numpy())
        return out
    return F.rms_norm(x, weight.shape, weight, eps)


def can_fuse_layer(x: torch.Tensor, meta_query_lens: list[int]) -> bool:
    """Whether `decoder_layer` applies: a few float32 CPU tokens (decode, or verification of drafts of any
    lengths up to MAX_FUSED_QUERIES - 1 per sequence)."""
    return max(meta_query_lens) <= MAX_FUSED_QUERIES and x.shape[0] <= SMALL_M and _fast(x)


def query_starts(query_lens: list[int]) -> "np.ndarray":
    """[B + 1] first row of every sequence (and the total), for the kernels' ragged batches."""
    return np.cumsum([0, *query_lens], dtype=np.int64)


def decoder_layer(x: torch.Tensor, weights: tuple, cos: torch.Tensor, signed_sin: torch.Tensor,
                  k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor,
                  context_slots: torch.Tensor, mask: torch.Tensor, query_lens: list[int], num_heads: int,
                  num_kv_heads: int, eps: float, scale: float) -> torch.Tensor:
    """One decoder layer through the fused kernel. weights: numpy arrays in `_decoder_layer` order
    (ln1, qkv_w, qkv_b, q_norm, k_norm, o_w, ln2, gate_up_w, down_w; absent ones empty). x: [T, H]."""
    out = x.clone()
    _decoder_layer(out.numpy(), *weights, eps, cos.numpy(), signed_sin.numpy(), k_pool.numpy(), v_pool.numpy(),
                   slot_mapping.numpy(), context_slots.numpy(), mask.numpy(), query_starts(query_lens), num_heads,
                   num_kv_heads, scale)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias. x: [M, in], weight: [out, in] (nn.Linear layout).

    Weights may be stored in a narrower dtype than x (bfloat16 weights, float32 activations on CPU), or
    block-quantized (`QuantWeight`): the result is always in x's dtype."""
    if isinstance(weight, QuantWeight):
        return weight.linear(x, bias)
    if use_fast_gemv(x, weight):
        x = x.contiguous()
        y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
        _gemm_rows(as_numpy(weight), x.numpy(), y.numpy())
        return y if bias is None else y.add_(bias)
    if weight.dtype != x.dtype:  # large batches (prefill): torch's bf16 GEMM, back to x's dtype
        return F.linear(x.to(weight.dtype), weight).to(x.dtype) + (0 if bias is None else bias)
    return F.linear(x, weight, bias)


_DISABLED = os.environ.get("SPECDEC_DISABLE_KERNELS", "") not in ("", "0")
