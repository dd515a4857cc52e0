"""Numpy quantizers for the GGUF block formats that gguf-py reads but cannot write.

gguf-py dequantizes every GGML type but quantizes only F16, BF16 and Q4_0..Q8_0, so a synthetic checkpoint in
a K-quant mix or IQ4 needs the rest. Each quantizer below runs the search of ggml's reference C quantizer
(ggml-quants.c, no importance matrix) over all blocks at once and packs the result in GGML's byte layout, so
`gguf.quants.dequantize` reads back the quantized values. The searches try the same candidate scales as ggml
and keep the one with the least weighted squared error; results match ggml in spirit, not bit for bit.

Block layouts (little-endian; a "sub" is a sub-block sharing one scale):

    Q4_K   144 B = d f16 | dmin f16 | 12 B: 8 x (6-bit scale, 6-bit min) | 128 B nibbles, subs of 32
    Q5_K   176 B = d f16 | dmin f16 | 12 B scales as Q4_K | 32 B fifth bits | 128 B nibbles
    Q6_K   210 B = 128 B low nibbles | 64 B high 2-bit pairs | 16 x int8 scale, subs of 16 | d f16
    IQ4_NL  18 B = d f16 | 16 B nibbles, each an index into IQ4_VALUES
    IQ4_XS 136 B = d f16 | u16 high 2 bits of 8 scales | 4 B low nibbles of scales | 128 B nibbles, subs of 32

    value = d * scale * q - dmin * min (Q4_K, Q5_K) | d * scale * (q - 32) (Q6_K)
          | d * IQ4_VALUES[q] (IQ4_NL) | d * (scale - 32) * IQ4_VALUES[q] (IQ4_XS)
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

T = GGMLQuantizationType

# ggml's kvalues_iq4nl: a non-uniform 4-bit grid, denser near zero where weights are.
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)

_EPS = 1e-15  # ggml's GROUP_MAX_EPS: a sub-block below this is all zero
_CHUNK_ELEMENTS = 1 << 16  # blocks are quantized in chunks of this many values, to stay in cache

# Every index k = floor(2a) + 256 of a scaled value a in [-128, 128] maps to the IQ4 code nearest a. The
# midpoints between grid values are multiples of 0.5, so all a in one half-unit share one code; a tie goes
# to the larger value, as in ggml's best_index_int8.
_IQ4_MIDPOINTS = (IQ4_VALUES[1:] + IQ4_VALUES[:-1]) / 2
_IQ4_CODE = np.searchsorted(_IQ4_MIDPOINTS, np.arange(-256, 257) / 2, side="right").astype(np.uint8)
_IQ4_VALUE = IQ4_VALUES[_IQ4_CODE]


def quantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float [rows, cols] -> uint8 [rows, cols // block * type_size], GGML's bytes for `qtype`.

    Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS are quantized here; F32, F16, BF16, Q4_0..Q8_0 and MXFP4 by gguf-py.
    """
    data = np.asarray(data)
    if qtype not in SUPPORTED:
        raise ValueError(f"cannot quantize to {qtype.name}; supported: {[t.name for t in SUPPORTED]}")
    if data.ndim != 2:
        raise ValueError(f"expected a 2-D matrix [rows, cols], got shape {list(data.shape)}")
    block, type_size = GGML_QUANT_SIZES[qtype]
    if data.shape[1] % block:
        raise ValueError(f"{qtype.name} packs each row in blocks of {block} values; {data.shape[1]} columns "
                         f"is not a multiple of {block} (pick another type for this matrix)")
    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype not in _QUANTIZERS:
        return gguf_quantize(data, qtype).view(np.uint8).reshape(data.shape[0], -1)
    if not np.isfinite(data).all():
        raise ValueError(f"cannot quantize to {qtype.name}: the matrix has NaN or infinite values")
    blocks = data.reshape(-1, block)
    out = np.empty((blocks.shape[0], type_size), np.uint8)
    step = max(1, _CHUNK_ELEMENTS // block)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for start in range(0, blocks.shape[0], step):
            out[start:start + step] = _QUANTIZERS[qtype](blocks[start:start + step])
    return out.reshape(data.shape[0], data.shape[1] // block * type_size)


# ---- scale searches over sub-blocks x [S, n] (one scale each), after ggml's make_*_quants ----

def _dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise dot product [S, n] x [S, n] -> [S], in float64 so error comparisons do not cancel."""
    return np.einsum("ij,ij->i", a, b).astype(np.float64)


def _peak(x: np.ndarray) -> np.ndarray:
    """The signed value of largest magnitude in each row (the first one on ties, as ggml)."""
    return np.take_along_axis(x, np.abs(x).argmax(-1)[:, None], -1)[:, 0]


def _fit_scale_min(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(scale [S], min [S]) with x ~ scale * l - min, l in 0..nmax, min >= 0 (make_qkx2_quants).

    Tries nstep + 1 inverse scales (nmax + rmin + i * rdelta) / (max - min) and, for the codes each gives,
    the weighted least-squares scale and offset; keeps the pair of least weighted squared error.
    """
    lo, hi = np.minimum(x.min(-1), 0), x.max(-1)
    flat = hi == lo
    wx = w * x
    sum_w, sum_x, sum_x2 = w.sum(-1, dtype=np.float64), wx.sum(-1, dtype=np.float64), _dot(wx, x)

    def sums(iscale: np.ndarray, offset: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        levels = np.clip(np.rint((x - offset[:, None]) * iscale[:, None]), 0, nmax)
        wl = w * levels
        return wl.sum(-1, dtype=np.float64), _dot(wl, levels), _dot(wx, levels)

    def error(scale: np.ndarray, offset: np.ndarray, sl: np.ndarray, sl2: np.ndarray, sxl: np.ndarray
              ) -> np.ndarray:  # sum w (scale * l + offset - x)^2, expanded
        return (scale * scale * sl2 + offset * offset * sum_w + sum_x2
                + 2 * (scale * offset * sl - scale * sxl - offset * sum_x))

    span = np.where(flat, 1, hi - lo)
    scale, offset = (span / nmax).astype(np.float64), lo.astype(np.float64)
    best = error(scale, offset, *sums(nmax / span, lo))
    for i in range(nstep + 1):
        # as in ggml, the grid of each try starts from the offset accepted so far, not from the minimum
        span = np.where(flat, 1, hi - offset).astype(np.float32)
        sl, sl2, sxl = sums((rmin + rdelta * i + nmax) / span, offset.astype(np.float32))
        det = sum_w * sl2 - sl * sl
        s, o = (sum_w * sxl - sum_x * sl) / det, (sl2 * sum_x - sl * sxl) / det
        s, o = np.where(o > 0, sxl / sl2, s), np.minimum(o, 0)  # an offset above zero is refitted as zero
        err = error(s, o, sl, sl2, sxl)
        better = (det > 0) & (err < best)
        scale, offset, best = np.where(better, s, scale), np.where(better, o, offset), np.where(better, err, best)
    return np.where(flat, 0, scale), -offset


def _least_squares(x: np.ndarray, tries: Iterable[tuple[bool, np.ndarray]]) -> np.ndarray:
    """scale [S] of the try that fits x best: each try is (first, levels [S, n]); its scale is the least-squares
    sum(w x l) / sum(w l l) with weights w = x^2, and a try replaces the best so far only if its weighted error
    is smaller (the first one always counts)."""
    w = x * x
    wx = w * x
    best_scale, best = np.zeros(x.shape[0]), np.zeros(x.shape[0])
    for first, levels in tries:
        num, den = _dot(wx, levels), _dot(w * levels, levels)
        better = (den > 0) & ((num * num > best * den) | first)
        s = num / np.where(den > 0, den, 1)
        best_scale, best = np.where(better, s, best_scale), np.where(better, s * num, best)
    return best_scale


def _fit_symmetric(x: np.ndarray, nmax: int) -> np.ndarray:
    """scale [S] with x ~ scale * l, l in -nmax..nmax-1, weights x^2 (make_qx_quants, rmse_type 1).

    The largest-magnitude value maps to -nmax (the side with one more level); 19 inverse scales around that
    are tried, each with its least-squares scale, keeping the one of least weighted error.
    """
    peak = _peak(x)
    zero = np.abs(peak) < _EPS
    peak = np.where(zero, 1, peak)
    tries = ((i == 0, np.clip(np.rint(x * (-(nmax + 0.1 * i) / peak)[:, None].astype(np.float32)), -nmax, nmax - 1))
             for i in [0, *range(-9, 0), *range(1, 10)])
    return np.where(zero, 0, _least_squares(x, tries))


def _iq4_index(a: np.ndarray) -> np.ndarray:
    """Positions in the code tables of the grid value nearest each scaled value a."""
    return (np.clip(a, -128, 128) * 2 + 256).astype(np.intp)


def _fit_iq4(x: np.ndarray, ntry: int = 7) -> np.ndarray:
    """scale [S] with x ~ scale * IQ4_VALUES[code], weights x^2 (quantize_row_iq4_nl_impl, ntry 7).

    Starts from the peak mapped to +127, then tries it mapped to -127 + t for t in -ntry..ntry; each try
    assigns nearest grid codes and takes the least-squares scale; the one of least weighted error wins.
    """
    peak = _peak(x)
    zero = np.abs(peak) < _EPS
    peak = np.where(zero, 1, peak)
    tries = ((t is None, _IQ4_VALUE[_iq4_index(x * ((127 if t is None else t + IQ4_VALUES[0]) / peak)[:, None]
                                               .astype(np.float32))])
             for t in [None, *range(-ntry, ntry + 1)])
    return np.where(zero, 0, _least_squares(x, tries))


def _f16(x: np.ndarray) -> np.ndarray:
    """Values rounded to the f16 that the block stores, back as float32 for computing the codes."""
    return x.astype(np.float16).astype(np.float32)


# ---- the five formats: fit scales, requantize against the stored scales, pack ----

def _q45_k(blocks: np.ndarray, nmax: int, rmin: float, nstep: int) -> tuple[np.ndarray, ...]:
    """Shared by Q4_K and Q5_K: codes [B, 8, 32], super-scales d, dmin [B] and 6-bit sub scales, mins [B, 8]."""
    x = blocks.reshape(-1, 32)
    w = np.sqrt((x * x).mean(-1, keepdims=True)) + np.abs(x)  # rms of the sub-block + |x|
    scale, mins = _fit_scale_min(x, w, nmax, rmin, 0.1, nstep)
    scale, mins = scale.reshape(-1, 8), mins.reshape(-1, 8)
    max_scale, max_min = np.maximum(scale.max(-1), 0), np.maximum(mins.max(-1), 0)
    sc = np.clip(np.rint(scale * np.where(max_scale > 0, 63 / max_scale, 0)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(mins * np.where(max_min > 0, 63 / max_min, 0)[:, None]), 0, 63).astype(np.uint8)
    d, dmin = _f16(max_scale / 63), _f16(max_min / 63)
    d_sub, m_sub = (d[:, None] * sc)[..., None], (dmin[:, None] * mn)[..., None]
    x = blocks.reshape(-1, 8, 32)
    codes = np.where(d_sub != 0, np.clip(np.rint((x + m_sub) / d_sub), 0, nmax), 0).astype(np.uint8)
    return codes, d, dmin, sc, mn


def _pack_k_header(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """d, dmin and the 12 bytes of eight 6-bit (scale, min) pairs: [B, 16].

    Bytes 0-3 hold scales 0-3, bytes 4-7 mins 0-3, each with the top two bits of scale/min 4-7 in bits 6-7;
    bytes 8-11 hold the low nibbles of scale 4-7 (low) and min 4-7 (high).
    """
    lo_sc, hi_sc, lo_mn, hi_mn = sc[:, :4], sc[:, 4:], mn[:, :4], mn[:, 4:]
    packed = np.concatenate([lo_sc | (hi_sc >> 4) << 6, lo_mn | (hi_mn >> 4) << 6,
                             (hi_sc & 0xF) | (hi_mn & 0xF) << 4], axis=-1)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed], axis=-1)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype("<f2").view(np.uint8).reshape(-1, 2)


def _nibbles(codes: np.ndarray) -> np.ndarray:
    """[B, 2k, 32] codes -> [B, 32k] bytes: sub 2j in the low nibbles, sub 2j + 1 in the high ones."""
    pairs = codes.reshape(codes.shape[0], -1, 2, 32)
    return (pairs[:, :, 0] | pairs[:, :, 1] << 4).reshape(codes.shape[0], -1)


def pack_q4_k(codes: np.ndarray, d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """codes [B, 8, 32] in 0..15, d, dmin [B], sc, mn [B, 8] in 0..63 -> Q4_K blocks [B, 144]."""
    return np.concatenate([_pack_k_header(d, dmin, sc, mn), _nibbles(codes)], axis=-1)


def pack_q5_k(codes: np.ndarray, d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """codes [B, 8, 32] in 0..31 -> Q5_K blocks [B, 176]: bit i of byte l of qh is bit 4 of sub i's code l."""
    high = (codes >> 4).astype(np.uint8) << np.arange(8, dtype=np.uint8)[:, None]
    qh = np.bitwise_or.reduce(high, axis=1)
    return np.concatenate([_pack_k_header(d, dmin, sc, mn), qh, _nibbles(codes & 0xF)], axis=-1)


def pack_q6_k(codes: np.ndarray, d: np.ndarray, sc: np.ndarray) -> np.ndarray:
    """codes [B, 256] in 0..63, sc [B, 16] int8, d [B] -> Q6_K blocks [B, 210].

    Each half of 128 values: value j < 64 has its low nibble in the low half of ql[j], value 64 + j in the
    high half; the top two bits of value 32t + c go to bits 2t..2t+1 of qh[c].
    """
    halves = codes.reshape(-1, 2, 128)
    low = (halves & 0xF).reshape(-1, 2, 2, 64)
    ql = low[:, :, 0] | low[:, :, 1] << 4
    high = (halves >> 4).reshape(-1, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[:, None]
    qh = np.bitwise_or.reduce(high, axis=2)
    n = codes.shape[0]
    return np.concatenate([ql.reshape(n, -1), qh.reshape(n, -1), sc.astype(np.int8).view(np.uint8),
                           _f16_bytes(d)], axis=-1)


def pack_iq4_nl(codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """codes [B, 32] in 0..15, d [B] -> IQ4_NL blocks [B, 18]: value j low nibble, value 16 + j high."""
    return np.concatenate([_f16_bytes(d), codes[:, :16] | codes[:, 16:] << 4], axis=-1)


def pack_iq4_xs(codes: np.ndarray, d: np.ndarray, sc: np.ndarray) -> np.ndarray:
    """codes [B, 8, 32] in 0..15, sc [B, 8] in 0..63 (scale + 32), d [B] -> IQ4_XS blocks [B, 136]."""
    scales_h = np.bitwise_or.reduce((sc >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16)), axis=-1)
    scales_l = (sc[:, 0::2] & 0xF) | (sc[:, 1::2] & 0xF) << 4
    qs = (codes[:, :, :16] | codes[:, :, 16:] << 4).reshape(codes.shape[0], -1)
    return np.concatenate([_f16_bytes(d), scales_h.astype("<u2").view(np.uint8).reshape(-1, 2), scales_l, qs],
                          axis=-1)


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    return pack_q4_k(*_q45_k(blocks, 15, -1.0, 20))


def _quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    return pack_q5_k(*_q45_k(blocks, 31, -0.5, 15))


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Sub-scales fitted per 16 values; the largest in magnitude becomes -128 of an int8 grid over d."""
    scale = _fit_symmetric(blocks.reshape(-1, 16), 32).reshape(-1, 16)
    peak = _peak(scale)
    iscale = np.where(np.abs(peak) < _EPS, 0, -128 / peak)
    sc = np.clip(np.rint(iscale[:, None] * scale), -128, 127).astype(np.int8)
    d = _f16(np.where(iscale != 0, 1 / iscale, 0))
    d_sub = (d[:, None] * sc)[..., None]
    x = blocks.reshape(-1, 16, 16)
    codes = np.where(d_sub != 0, np.clip(np.rint(x / d_sub), -32, 31) + 32, 32).astype(np.uint8)
    return pack_q6_k(codes.reshape(-1, 256), d, sc)


def _quantize_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    d = _fit_iq4(blocks).astype(np.float32)
    inv = np.where(d != 0, 1 / d, 0)[:, None]
    return pack_iq4_nl(_IQ4_CODE[_iq4_index(blocks * inv)], _f16(d))


def _quantize_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    """Sub-scales fitted per 32 values; the largest in magnitude becomes -32 of a 6-bit grid over d."""
    scale = _fit_iq4(blocks.reshape(-1, 32)).reshape(-1, 8).astype(np.float32)
    d = -_peak(scale) / 32 + np.float32(0)  # + 0 turns -0.0 into 0.0
    inv = np.where(d != 0, 1 / d, 0)[:, None]
    levels = np.clip(np.rint(inv * scale), -32, 31)
    d_sub = (d[:, None] * levels)[..., None]
    x = blocks.reshape(-1, 8, 32)
    codes = _IQ4_CODE[_iq4_index(x * np.where(d_sub != 0, 1 / d_sub, 0))]
    return pack_iq4_xs(codes, _f16(d), (levels + 32).astype(np.uint8))


_QUANTIZERS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    T.Q4_K: _quantize_q4_k, T.Q5_K: _quantize_q5_k, T.Q6_K: _quantize_q6_k,
    T.IQ4_NL: _quantize_iq4_nl, T.IQ4_XS: _quantize_iq4_xs,
}
SUPPORTED = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4, *_QUANTIZERS)
