"""The native quantized kernels: every block format against gguf's reference dequantizer, batch invariance
bit for bit, and quantization on load."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import quantize as gguf_quantize

from specdec.models import native
from specdec.models.quant import FORMATS, QuantWeight, check_quantizable

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels need g++ and ninja")


def f16_bytes(values: np.ndarray) -> np.ndarray:
    return np.frombuffer(np.asarray(values, np.float16).tobytes(), np.uint8).reshape(*np.shape(values), 2)


def random_blocks(name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes in a format's layout, with edge values: a zero scale, all-15 / all-0 nibbles (extreme
    quants), negative and positive minimums, and f16 scales over four decades."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    nb = cols // fmt.block
    raw = rng.integers(0, 256, size=(rows, nb, fmt.bytes), dtype=np.uint8)
    d = (rng.uniform(-1, 1, size=(rows, nb)) * 10.0 ** rng.integers(-4, 0, size=(rows, nb))).astype(np.float16)
    d[0, 0] = 0.0  # a zero scale
    scale_at = {"q8_0": 0, "q4_0": 0, "q4_1": 0, "q4_k": 0, "q6_k": 208}[name]
    raw[..., scale_at:scale_at + 2] = f16_bytes(d)
    if name in ("q4_1", "q4_k"):  # the minimum (Q4_K: dmin), of either sign
        raw[..., 2:4] = f16_bytes(rng.uniform(-0.05, 0.05, size=(rows, nb)))
    if name in ("q4_0", "q4_1"):
        raw[1, 0, -16:] = 0xFF  # every nibble 15
        raw[2, 0, -16:] = 0x00  # every nibble 0
    return raw.reshape(rows, nb * fmt.bytes)


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """What the kernels multiply: each row rounded to int8 per block of 32 (d = max|x| / 127), as float64."""
    xb = x.double().reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(xb / torch.where(d > 0, d, 1)), 0)
    return (q * d).reshape(x.shape)


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("rows", [43, 8])  # 43: groups of 8 interleaved rows plus 3 rows done one at a time
def test_kernels_match_the_reference_dequantization(name, rows):
    """y = x @ W.T against float64 math on gguf's dequantized W and the int8-rounded x: the kernels' only
    difference is float32 accumulation over 512 products (relative 1e-5 of the largest output is generous
    for that; a wrong nibble, scale or minimum gives errors of order 1)."""
    cols = 512
    w = QuantWeight.from_gguf(random_blocks(name, rows, cols), FORMATS[name].ggml, cols)
    ref_w = w.dequantize().double()
    torch.manual_seed(0)
    for m in (1, 2, 3, 4, 5, 16, 64):
        x = torch.randn(m, cols) * torch.logspace(-2, 1, m)[:, None]
        x[0, :32] = 0.0  # an all-zero activation block
        y = w.linear(x)
        ref = quantized_activations(x) @ ref_w.T
        err = ((y.double() - ref).abs() / ref.abs().amax(-1, keepdim=True).clamp(min=1e-30)).max().item()
        assert err < 1e-5, (name, m, err)


@pytest.mark.parametrize("name", list(FORMATS))
def test_dequantized_rows_equal_gguf_reference(name):
    w = QuantWeight.from_gguf(random_blocks(name, 11, 256, seed=1), FORMATS[name].ggml, 256)
    rows = torch.tensor([10, 0, 3, 3])
    assert torch.equal(w[rows], w.dequantize()[rows])


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_row_has_the_same_bits_alone_or_in_any_batch(name):
    """Rows 1..64 in one call equal each row computed alone, and draft rows appended after a row do not
    change it: verification computes exactly what plain decoding computes."""
    w = QuantWeight.from_gguf(random_blocks(name, 45, 1024, seed=2), FORMATS[name].ggml, 1024)
    torch.manual_seed(1)
    x = torch.randn(64, 1024)
    alone = torch.cat([w.linear(x[i:i + 1]) for i in range(64)])
    for m in (1, 2, 3, 4, 7, 9, 16, 33, 64):
        assert torch.equal(w.linear(x[:m]), alone[:m]), m
    assert torch.equal(w.linear(x[5:12])[0], alone[5])


def test_fused_matrices_keep_each_part_format():
    """q/k/v fused from tensors of different formats (as Q4_K_M files mix Q4_K and Q6_K) compute each part in
    its own format."""
    a = QuantWeight.from_gguf(random_blocks("q4_k", 16, 256), FORMATS["q4_k"].ggml, 256)
    b = QuantWeight.from_gguf(random_blocks("q6_k", 9, 256), FORMATS["q6_k"].ggml, 256)
    c = QuantWeight.from_gguf(random_blocks("q4_k", 4, 256, seed=3), FORMATS["q4_k"].ggml, 256)
    fused = QuantWeight.cat([a, b, c])
    assert fused.formats == ["q4_k", "q6_k", "q4_k"] and fused.shape == (29, 256)
    x = torch.randn(3, 256)
    assert torch.equal(fused.linear(x), torch.cat([a.linear(x), b.linear(x), c.linear(x)], dim=1))


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1"])
def test_quantize_on_load_matches_gguf_quantizer(name):
    torch.manual_seed(0)
    weight = torch.randn(24, 96)
    w = QuantWeight.quantize(weight, name)
    assert np.array_equal(w.parts[0][0].numpy(), gguf_quantize(weight.numpy(), FORMATS[name].ggml))
    bound = {"q8_0": 0.01, "q4_0": 0.2, "q4_1": 0.15}[name]  # a step of the format's grid, relative
    assert ((w.dequantize() - weight).abs().max() / weight.abs().max()).item() < bound


def test_quantization_that_a_matrix_cannot_take_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"unknown quantization 'q3'.*q4_0"):
        check_quantizable("q3", (8, 64), "a matrix")
    with pytest.raises(ValueError, match="not a multiple of q4_0's block of 32"):
        check_quantizable("q4_0", (8, 72), "a matrix")
