"""specdec.models.formats.quantizers: GGML block bytes that gguf-py's dequantizers read back as the quantized values.

Three kinds of checks: round-trip error bands on Gaussian and edge rows for every type; exact round trips
of data already on each format's grid (the scale searches must find it); and packing of random codes,
compared with the format's formula, so a byte in the wrong place cannot hide behind a small error.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize

from specdec.models.formats import quantizers
from specdec.models.formats.quantizers import IQ4_VALUES, SUPPORTED, quantize

# Relative RMS error on N(0, 1) rows; measured values (seed 0) in comments, bounds 15-20% above them.
GAUSSIAN_BOUND = {
    T.Q4_K: 0.08,     # 0.071
    T.Q5_K: 0.042,    # 0.036
    T.Q6_K: 0.021,    # 0.018
    T.IQ4_NL: 0.087,  # 0.076
    T.IQ4_XS: 0.087,  # 0.077
    T.Q4_0: 0.098,    # 0.086
    T.Q4_1: 0.09,     # 0.078
    T.Q5_0: 0.049,    # 0.043
    T.Q5_1: 0.044,    # 0.038
    T.Q8_0: 0.0062,   # 0.0053
    T.MXFP4: 0.13,    # 0.115 (gguf-py's: a power-of-two scale per 32 over the FP4 grid)
    T.F16: 2.5e-4,    # 2.1e-4
    T.BF16: 2e-3,     # 1.7e-3
    T.F32: 0.0,
}
OURS = (T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS)


def _rel_rms(x: np.ndarray, qtype: T) -> float:
    y = dequantize(quantize(x, qtype), qtype)
    return float(np.sqrt(((y - x) ** 2).mean() / (x ** 2).mean()))


@pytest.fixture(scope="module")
def gaussian() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((16, 1024)).astype(np.float32)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_round_trip_error_on_gaussian_rows(qtype, gaussian):
    block, type_size = GGML_QUANT_SIZES[qtype]
    q = quantize(gaussian, qtype)
    assert q.dtype == np.uint8 and q.shape == (16, 1024 // block * type_size)
    assert _rel_rms(gaussian, qtype) <= GAUSSIAN_BOUND[qtype]
    assert _rel_rms(gaussian * 0.02, qtype) <= GAUSSIAN_BOUND[qtype]  # a weight-sized scale


def test_k_quants_beat_the_legacy_formats_of_their_width(gaussian):
    assert _rel_rms(gaussian, T.Q4_K) < _rel_rms(gaussian, T.Q4_1) < _rel_rms(gaussian, T.Q4_0)
    assert _rel_rms(gaussian, T.IQ4_NL) < _rel_rms(gaussian, T.Q4_0)
    assert _rel_rms(gaussian, T.Q5_K) < _rel_rms(gaussian, T.Q5_1) < _rel_rms(gaussian, T.Q5_0)


@pytest.mark.parametrize("qtype", OURS, ids=lambda t: t.name)
def test_edge_rows(qtype, gaussian):
    x = gaussian[:4]
    zero = np.zeros_like(x)
    assert np.array_equal(dequantize(quantize(zero, qtype), qtype), zero)
    for value in (0.37, -0.37, 1e4):
        const = np.full_like(x, value)
        assert np.abs(dequantize(quantize(const, qtype), qtype) - const).max() <= 1e-3 * abs(value)
    assert _rel_rms(-np.abs(x), qtype) <= GAUSSIAN_BOUND[qtype]  # negative only
    assert _rel_rms(np.abs(x), qtype) <= GAUSSIAN_BOUND[qtype]
    tiny = dequantize(quantize(x * 1e-20, qtype), qtype)  # scales underflow f16: zeros, as in ggml
    assert np.isfinite(tiny).all() and np.abs(tiny).max() <= 1e-19


@pytest.mark.parametrize("qtype", OURS, ids=lambda t: t.name)
def test_one_huge_value_costs_only_its_own_block(qtype, gaussian):
    x = gaussian[:4].copy()
    x[:, 5] = 1000.0
    y = dequantize(quantize(x, qtype), qtype)
    assert np.isfinite(y).all()
    assert np.allclose(y[:, 5], 1000.0, rtol=2e-3)
    rest = x[:, 256:]
    assert np.sqrt(((y[:, 256:] - rest) ** 2).mean() / (rest ** 2).mean()) <= GAUSSIAN_BOUND[qtype]


def test_refused_shapes_and_values():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(np.zeros((2, 300), np.float32), T.Q4_K)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np.zeros((2, 48), np.float32), T.IQ4_NL)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np.zeros((2, 48), np.float32), T.Q8_0)
    with pytest.raises(ValueError, match="2-D"):
        quantize(np.zeros(256, np.float32), T.Q6_K)
    with pytest.raises(ValueError, match="Q2_K"):
        quantize(np.zeros((1, 256), np.float32), T.Q2_K)
    with pytest.raises(ValueError, match="NaN"):
        quantize(np.full((1, 256), np.nan, np.float32), T.IQ4_XS)


def test_accepts_other_float_dtypes_and_strided_input(gaussian):
    want = quantize(gaussian[:2], T.Q5_K)
    assert np.array_equal(quantize(gaussian[:2].astype(np.float64), T.Q5_K), want)
    wide = np.repeat(gaussian[:2], 2, axis=1)[:, ::2]  # not contiguous
    assert np.array_equal(quantize(wide, T.Q5_K), want)


def test_many_chunks_match_one(gaussian, monkeypatch):
    want = quantize(gaussian, T.IQ4_XS)
    monkeypatch.setattr(quantizers, "_CHUNK_ELEMENTS", 256 * 3)
    assert np.array_equal(quantize(gaussian, T.IQ4_XS), want)


# ---- data already on a format's grid comes back exactly (the searches find it) ----

def test_on_grid_k_quants_are_exact():
    rng = np.random.default_rng(1)
    for qtype, nmax in ((T.Q4_K, 15), (T.Q5_K, 31)):
        codes = rng.integers(0, nmax + 1, (3, 8, 32))
        codes[:, :, 0], codes[:, :, 1] = 0, nmax  # each sub-block spans the whole code range
        x = (codes * (63 * 2.0 ** -6) - 63 * 2.0 ** -7).astype(np.float32).reshape(3, 256)
        assert np.array_equal(dequantize(quantize(x, qtype), qtype), x), qtype.name


def test_on_grid_q6_k_is_exact():
    codes = np.random.default_rng(2).integers(-32, 32, (3, 16, 16))
    codes[:, :, 0] = -32  # the peak of every sub-block sits on the longer side of the grid
    x = (codes * 2.0 ** -5).astype(np.float32).reshape(3, 256)
    assert np.array_equal(dequantize(quantize(x, T.Q6_K), T.Q6_K), x)


@pytest.mark.parametrize("qtype", (T.IQ4_NL, T.IQ4_XS), ids=lambda t: t.name)
def test_on_grid_iq4_is_exact(qtype):
    codes = np.random.default_rng(3).integers(0, 16, (3, 8, 32))
    codes[:, :, 0] = 0  # -127, the largest magnitude
    x = (IQ4_VALUES[codes] * 2.0 ** -7).reshape(3, 256)
    assert np.array_equal(dequantize(quantize(x, qtype), qtype), x)


# ---- packing: random codes and scales, dequantized by gguf-py, equal the format's formula ----

def _f16(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.uniform(0.01, 1, n).astype(np.float16).astype(np.float32)


@pytest.mark.parametrize("qtype", (T.Q4_K, T.Q5_K), ids=lambda t: t.name)
def test_k_layout_with_mins(qtype):
    rng, n = np.random.default_rng(4), 5
    codes = rng.integers(0, 16 if qtype == T.Q4_K else 32, (n, 8, 32)).astype(np.uint8)
    sc, mn = (rng.integers(0, 64, (n, 8)).astype(np.uint8) for _ in range(2))
    d, dmin = _f16(rng, n), _f16(rng, n)
    pack = quantizers.pack_q4_k if qtype == T.Q4_K else quantizers.pack_q5_k
    got = dequantize(pack(codes, d, dmin, sc, mn), qtype)
    want = d[:, None, None] * sc[..., None] * codes - dmin[:, None, None] * mn[..., None]
    assert np.allclose(got, want.reshape(n, 256), rtol=1e-6, atol=0)


def test_q6_k_layout():
    rng, n = np.random.default_rng(5), 5
    codes = rng.integers(0, 64, (n, 256)).astype(np.uint8)
    sc, d = rng.integers(-128, 128, (n, 16)).astype(np.int8), _f16(rng, n)
    got = dequantize(quantizers.pack_q6_k(codes, d, sc), T.Q6_K)
    want = d[:, None, None] * sc[..., None] * (codes.reshape(n, 16, 16).astype(np.float32) - 32)
    assert np.allclose(got, want.reshape(n, 256), rtol=1e-6, atol=0)


def test_iq4_layouts():
    rng, n = np.random.default_rng(6), 5
    codes, d = rng.integers(0, 16, (n, 8, 32)).astype(np.uint8), _f16(rng, n)
    got = dequantize(quantizers.pack_iq4_nl(codes[:, 0], d), T.IQ4_NL)
    assert np.allclose(got, d[:, None] * IQ4_VALUES[codes[:, 0]], rtol=1e-6, atol=0)
    sc = rng.integers(0, 64, (n, 8)).astype(np.uint8)
    got = dequantize(quantizers.pack_iq4_xs(codes, d, sc), T.IQ4_XS)
    want = d[:, None, None] * (sc[..., None].astype(np.float32) - 32) * IQ4_VALUES[codes]
    assert np.allclose(got, want.reshape(n, 256), rtol=1e-6, atol=0)
