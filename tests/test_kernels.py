"""Float weights on the C++ kernels (`kernels`): float32, bfloat16 and float16 matrices against torch's float64
math, bit-for-bit batch invariance for every row count on every instruction-set path, the layers' RMSNorm, and
torch where the kernels do not apply (gradients), and tensors on 2 MB pages (huge_empty)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import needs_native

from specdec.models.blocks import kernels
from specdec.models.cpu import native

pytestmark = needs_native
TESTED_ISAS = native.distinct_isas() if native.available() else ["native"]  # as in test_quant.py
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def float_linear(x: torch.Tensor, w: torch.Tensor, isa: str) -> torch.Tensor:
    return native.ops(isa).linear(x, native.ops(isa).QMatrix([w], [kernels.FLOAT_KERNEL_IDS[w.dtype]], w.shape[1]))


@pytest.mark.parametrize("isa", TESTED_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features, in_features", [(963, 576), (37, 1536), (5, 7)])
def test_linear_matches_float64_on_the_stored_weights(out_features, in_features, dtype, isa):
    """Narrow weights are widened exactly; the only error is float32 summation (8 lanes, then in order)."""
    g = torch.Generator().manual_seed(in_features)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    x = torch.randn(17, in_features, generator=g) * torch.logspace(-2, 2, 17)[:, None]
    y = float_linear(x, w, isa)
    ref = x.double() @ w.double().T
    err = ((y.double() - ref).abs() / ref.abs().amax(-1, keepdim=True)).max().item()
    assert y.dtype == torch.float32 and err < 1e-5, err


@pytest.mark.parametrize("isa", TESTED_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_has_the_same_bits_alone_or_in_any_batch(dtype, isa):
    """1..64 rows in one call equal each row computed alone (verification computes exactly what plain decoding
    computes, for any number of draft rows or sequences), including a K that is not a multiple of 8."""
    g = torch.Generator().manual_seed(0)
    for k in (576, 203):
        w = torch.randn(45, k, generator=g).to(dtype)
        x = torch.randn(64, k, generator=g)
        alone = torch.cat([float_linear(x[i:i + 1], w, isa) for i in range(64)])
        for m in (1, 2, 3, 4, 7, 16, 17, 33, 64):
            assert torch.equal(float_linear(x[:m], w, isa), alone[:m]), (k, m)
        assert torch.equal(float_linear(x[5:12], w, isa), alone[5:12])


@pytest.mark.parametrize("dtype", DTYPES)
def test_vector_paths_agree_bit_for_bit_and_the_scalar_path_within_rounding(dtype):
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(40, 576, generator=g).to(dtype), torch.randn(9, 576, generator=g)
    ys = {isa: float_linear(x, w, isa) for isa in TESTED_ISAS}
    vector = [isa for isa in TESTED_ISAS if native.ops(isa).isa() != "portable"]
    for isa in vector[1:]:
        assert torch.equal(ys[isa], ys[vector[0]]), isa
    base = ys[vector[0] if vector else "native"]
    for isa, y in ys.items():
        assert ((y - base).abs() / base.abs().amax(-1, keepdim=True)).max().item() < 2e-6, isa


def test_linear_dispatches_to_the_kernels_and_keeps_shapes_and_bias():
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(33, 96, generator=g), torch.randn(33, generator=g)
    x = torch.randn(2, 5, 96, generator=g)
    y = kernels.linear(x, w, b)
    assert y.shape == (2, 5, 33)
    assert torch.equal(y, (float_linear(x.reshape(10, 96), w, "native") + b).reshape(2, 5, 33))
    assert torch.allclose(y, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    assert kernels.matrix(w) is kernels.matrix(w)  # built once per weight
    w.data = torch.randn(33, 96, generator=g)  # new storage: a new view
    assert torch.allclose(kernels.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_gradients_flow_through_torch():
    """The head trainer differentiates through the serving layers: with grad on, linear and rms_norm are torch's."""
    w = torch.randn(8, 16, requires_grad=True)
    x = torch.randn(3, 16)
    kernels.linear(x, w).sum().backward()
    assert w.grad is not None and w.grad.shape == w.shape
    norm_w = torch.ones(16, requires_grad=True)
    kernels.rms_norm(x, norm_w, 1e-5).sum().backward()
    assert norm_w.grad is not None


def test_rms_norm_matches_torch_and_is_row_invariant():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(40, 576, generator=g), torch.randn(576, generator=g)
    out = kernels.rms_norm(x, w, 1e-5)
    assert torch.allclose(out, F.rms_norm(x, (576,), w, 1e-5), atol=1e-5)
    assert torch.equal(torch.cat([kernels.rms_norm(x[i:i + 1], w, 1e-5) for i in range(40)]), out)


def test_huge_empty_gives_separate_lasting_tensors_on_2mb_pages():
    """What every step streams (the interleaved weights, the K/V pools) sits on 2 MB pages (csrc/memory.h): a large
    tensor starts on a 2 MB boundary; small ones share a chunk without overlapping and keep their values when the
    others sharing it are gone."""
    ops = native.ops()
    big = ops.huge_empty([20 << 20], torch.uint8)
    assert big.shape == (20 << 20,) and big.dtype == torch.uint8 and big.data_ptr() % (2 << 20) == 0
    big.fill_(7)
    shapes = ((1000, torch.float32), (17, torch.int64), (5, torch.float16))
    small = [ops.huge_empty([n, 3], dtype) for n, dtype in shapes]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in [big, *small])
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    for i, t in enumerate(small):
        t.fill_(i + 1)
    del small[0], big
    assert all(bool((t == i + 2).all()) for i, t in enumerate(small))


def test_the_weight_stream_prefetch_hint_follows_the_vendor_and_keys_the_build(monkeypatch):
    """Non-temporal prefetches of the weight stream on AMD only (on Intel they made a decode step 2.3x slower): the
    define reaches the compiler flags, and so the build's cache key, which the vendor's own build is cached under."""
    assert native.vendor_flags("AuthenticAMD") == ["-DSPECDEC_STREAM_NTA"]
    assert native.vendor_flags("GenuineIntel") == [] and native.vendor_flags("") == []
    keys = {}
    for vendor in ("AuthenticAMD", "GenuineIntel"):
        monkeypatch.setattr(native, "cpu_vendor", lambda v=vendor: v)
        keys[vendor] = native.build_key("avx2")
        assert ("-DSPECDEC_STREAM_NTA" in native.compiler_flags("avx2")) == (vendor == "AuthenticAMD")
    assert keys["AuthenticAMD"] != keys["GenuineIntel"]
