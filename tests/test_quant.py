"""The native quantized kernels: every block format against gguf's reference dequantizer and batch invariance
bit for bit, on every instruction-set path this CPU runs (TESTED_ISAS); the paths against each other;
quantization on load."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import needs_native

from specdec.models.cpu import native
from specdec.models.formats.quant import FORMATS, QuantWeight, check_quantizable
from specdec.models.formats.quantizers import quantize

pytestmark = needs_native
# every code path this CPU runs (the native build's, then AVX2 and the portable scalar one where they differ)
TESTED_ISAS = native.distinct_isas() if native.available() else ["native"]


def f16_bytes(values: np.ndarray) -> np.ndarray:
    return np.frombuffer(np.asarray(values, np.float16).tobytes(), np.uint8).reshape(*np.shape(values), 2)


def random_blocks(name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes in a format's layout, with edge values: a zero scale, all-15 / all-0 nibbles (extreme
    quants), negative and positive minimums, and f16 scales over four decades (MXFP4: exponents over 21 octaves
    and a subnormal one)."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    nb = cols // fmt.block
    raw = rng.integers(0, 256, size=(rows, nb, fmt.bytes), dtype=np.uint8)
    d = (rng.uniform(-1, 1, size=(rows, nb)) * 10.0 ** rng.integers(-4, 0, size=(rows, nb))).astype(np.float16)
    d[0, 0] = 0.0  # a zero scale
    scale_at = 208 if name == "q6_k" else 0
    if name == "mxfp4":  # an E8M0 exponent byte: scales 2^-17 .. 2^4, and one subnormal (e = 1)
        raw[..., 0] = rng.integers(111, 133, size=(rows, nb))
        raw[0, 0, 0] = 1
    else:
        raw[..., scale_at:scale_at + 2] = f16_bytes(d)
    if name in ("q4_1", "q5_1", "q4_k", "q5_k"):  # the minimum (K-quants: dmin), of either sign
        raw[..., 2:4] = f16_bytes(rng.uniform(-0.05, 0.05, size=(rows, nb)))
    if name in ("q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "iq4_xs", "mxfp4"):
        raw[1, 0, -16:] = 0xFF  # every nibble 15 (the largest quant or level)
        raw[2, 0, -16:] = 0x00  # every nibble 0 (the smallest)
    if name in ("q5_0", "q5_1"):  # every fifth bit set / clear
        raw[1, 0, fmt.bytes - 20:fmt.bytes - 16] = 0xFF
        raw[2, 0, fmt.bytes - 20:fmt.bytes - 16] = 0x00
    return raw.reshape(rows, nb * fmt.bytes)


def kernel_linear(w: QuantWeight, x: torch.Tensor, isa: str) -> torch.Tensor:
    """x @ w.T by instruction set isa's kernels (w.linear is the default build's)."""
    return native.ops(isa).linear(x, kernel_matrix(w, isa))


def kernel_matrix(w: QuantWeight, isa: str):
    return native.ops(isa).QMatrix([d for d, _ in w.parts], [f.kernel_id for _, f in w.parts], w.in_features)


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """What the kernels multiply: each row rounded to int8 per block of 32 (d = max|x| / 127), as float64."""
    xb = x.double().reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(xb / torch.where(d > 0, d, 1)), 0)
    return (q * d).reshape(x.shape)


@pytest.mark.parametrize("isa", TESTED_ISAS)
@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("rows", [43, 8])  # 43: groups of 8 interleaved rows plus 3 rows done one at a time
def test_kernels_match_the_reference_dequantization(name, rows, isa):
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
        y = kernel_linear(w, x, isa)
        ref = quantized_activations(x) @ ref_w.T
        err = ((y.double() - ref).abs() / ref.abs().amax(-1, keepdim=True).clamp(min=1e-30)).max().item()
        assert err < 1e-5, (name, m, err)


@pytest.mark.parametrize("isa", TESTED_ISAS)
@pytest.mark.parametrize("name", list(FORMATS))
def test_dequantized_rows_equal_gguf_reference(name, isa):
    w = QuantWeight.from_gguf(random_blocks(name, 11, 256, seed=1), FORMATS[name].ggml, 256)
    rows = torch.tensor([10, 0, 3, 3])
    assert torch.equal(native.ops(isa).dequantize_rows(kernel_matrix(w, isa), rows), w.dequantize()[rows])
    assert torch.equal(w[rows], w.dequantize()[rows])  # the model's lookup (the default build)
    grid = rows.view(2, 2)  # any shape of ids: [...] -> [..., K]
    assert torch.equal(native.ops(isa).dequantize_rows(kernel_matrix(w, isa), grid), w.dequantize()[grid])


@pytest.mark.parametrize("isa", TESTED_ISAS)
@pytest.mark.parametrize("name", list(FORMATS))
def test_a_row_has_the_same_bits_alone_or_in_any_batch(name, isa):
    """Rows 1..64 in one call equal each row computed alone, and draft rows appended after a row do not
    change it: verification computes exactly what plain decoding computes."""
    w = QuantWeight.from_gguf(random_blocks(name, 45, 1024, seed=2), FORMATS[name].ggml, 1024)
    m_ops, matrix = native.ops(isa), kernel_matrix(w, isa)
    torch.manual_seed(1)
    x = torch.randn(64, 1024)
    alone = torch.cat([m_ops.linear(x[i:i + 1], matrix) for i in range(64)])
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 33, 64):  # every tile height of every build, and their sums
        assert torch.equal(m_ops.linear(x[:m], matrix), alone[:m]), m
    assert torch.equal(m_ops.linear(x[5:12], matrix)[0], alone[5])


@pytest.mark.parametrize("name", list(FORMATS))
def test_vector_paths_agree_bit_for_bit_and_the_scalar_path_within_rounding(name):
    """simd.h promises VNNI gives exactly the AVX2 integers (and the float steps after them are the same), so
    every vector build computes the same bits. The portable scalar path adds the same products in another
    order (one float sum over the blocks where AVX2 keeps 8 lane sums and adds them at the end): not the same bits, but
    within 2e-6 of each row's largest output (seen: 5e-7)."""
    w = QuantWeight.from_gguf(random_blocks(name, 45, 1024, seed=4), FORMATS[name].ggml, 1024)
    torch.manual_seed(2)
    x = torch.randn(17, 1024)
    ys = {isa: kernel_linear(w, x, isa) for isa in TESTED_ISAS}
    vector = [isa for isa in TESTED_ISAS if native.ops(isa).isa() != "portable"]
    for isa in vector[1:]:
        assert torch.equal(ys[isa], ys[vector[0]]), (isa, vector[0])
    base = ys[vector[0] if vector else "native"]
    for isa in TESTED_ISAS:
        err = ((ys[isa] - base).abs() / base.abs().amax(-1, keepdim=True)).max().item()
        assert err < 2e-6, (isa, err)


def test_every_path_quantizes_activations_to_the_same_integers():
    """The AVX2 activation quantizer computes the scalar definition's values (activations.h), bit for bit: with a
    Q8_0 identity matrix (d = 1, one 1 per row) y is each activation's int8 times its block scale, exactly."""
    k = 256
    raw = np.zeros((k, k // 32, 34), np.uint8)
    raw[..., :2] = f16_bytes(np.ones((k, k // 32)))
    raw.reshape(k, -1)[np.arange(k), (np.arange(k) // 32) * 34 + 2 + np.arange(k) % 32] = 1
    w = QuantWeight.from_gguf(raw.reshape(k, -1), FORMATS["q8_0"].ggml, k)
    torch.manual_seed(3)
    x = torch.randn(9, k) * torch.logspace(-3, 2, 9)[:, None]
    x[0, 0], x[0, 1:32] = 127.0, torch.arange(31) - 15.5  # 1 / d = 1: exact ties, to even on every path
    x[1, 32:64] = 0.0  # d = 0
    ys = [kernel_linear(w, x, isa) for isa in TESTED_ISAS]
    assert torch.allclose(ys[0].double(), quantized_activations(x), rtol=1e-6, atol=0)
    for isa, y in zip(TESTED_ISAS, ys):
        assert torch.equal(y, ys[0]), isa


def test_each_build_reports_its_path():
    """`isa()` names the path a build takes: every ISA its own, "native" the best this CPU runs."""
    paths = {isa: native.ops(isa).isa() for isa in TESTED_ISAS}
    assert paths["native"] in native.runnable_isas() and "portable" in native.runnable_isas()
    assert all(path == isa for isa, path in paths.items() if isa != "native"), paths
    assert native.ops() is native.ops(native.resolve_isa())


def test_specdec_isa_picks_the_build_the_model_layers_use(monkeypatch):
    """$SPECDEC_ISA (read by a process's first default call) routes every default call, QuantWeight's too."""
    monkeypatch.setattr(native, "ops", native.ops.__wrapped__)  # as in a fresh process: the default not yet read
    monkeypatch.setenv(native.ISA_ENV, "portable")
    assert native.ops() is native.ops("portable") and native.ops().isa() == "portable"
    w = QuantWeight.from_gguf(random_blocks("q4_1", 16, 256), FORMATS["q4_1"].ggml, 256)
    x = torch.randn(3, 256)
    assert torch.equal(w.linear(x), kernel_linear(w, x, "portable"))


def test_an_isa_the_cpu_cannot_run_is_refused_naming_the_missing_flags(monkeypatch):
    monkeypatch.setattr(native, "_cpu_flags", lambda: "fpu sse2 avx avx2 fma")  # an AVX2 CPU without F16C
    monkeypatch.setattr(native, "ops", native.ops.__wrapped__)  # nothing cached
    assert native.runnable_isas() == ["native", "portable"]
    with pytest.raises(native.KernelBuildError, match=r"'avx512vnni': /proc/cpuinfo lacks f16c avx512_vnni "
                                                       r"avx512vl; choose one of \['native', 'portable'\]"):
        native.ops("avx512vnni")
    assert not native.available("avx2")
    with pytest.raises(ValueError, match=r"unknown instruction set 'avx3'.*choose one of \['native', 'avx2'"):
        native.ops("avx3")
    monkeypatch.setenv(native.ISA_ENV, "sse")
    with pytest.raises(ValueError, match=r"unknown instruction set 'sse'.*\$SPECDEC_ISA"):
        native.ops()


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


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantize_on_load_writes_ggml_blocks_the_kernels_compute_on(name):
    torch.manual_seed(0)
    weight = torch.randn(24, 512)
    w = QuantWeight.quantize(weight, name)
    assert np.array_equal(w.parts[0][0].numpy(), quantize(weight.numpy(), FORMATS[name].ggml))
    bound = {"q8_0": 0.01, "q4_0": 0.2, "q4_1": 0.15, "q5_0": 0.1, "q5_1": 0.08, "q4_k": 0.15, "q5_k": 0.08,
             "q6_k": 0.04, "iq4_nl": 0.2, "iq4_xs": 0.2, "mxfp4": 0.25}[name]  # a step of the format's grid, relative
    assert ((w.dequantize() - weight).abs().max() / weight.abs().max()).item() < bound
    x = torch.randn(3, 512)
    assert torch.allclose(w.linear(x), quantized_activations(x).float() @ w.dequantize().T, rtol=1e-4, atol=1e-3)


def test_quantization_that_a_matrix_cannot_take_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"unknown quantization 'q3'.*q4_0"):
        check_quantizable("q3", (8, 64), "a matrix")
    with pytest.raises(ValueError, match="not a multiple of q4_0's block of 32"):
        check_quantizable("q4_0", (8, 72), "a matrix")


_MAPPED_CHILD = r"""
import sys, numpy as np, torch
sys.path.insert(0, sys.argv[3])
from test_quant import random_blocks
from specdec.models.formats.quant import FORMATS, QuantWeight

def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile")}

rows, cols, path = 4096, 8192, sys.argv[1]
owned = QuantWeight.from_gguf(random_blocks("q8_0", rows, cols), FORMATS["q8_0"].ggml, cols)
x = torch.randn(3, cols)
want, want_rows = owned.linear(x), owned[torch.tensor([0, 4095, 17])]
owned.parts[0][0].numpy().tofile(path)
del owned
size = rows * cols // 32 * 34
before = status()
view = np.memmap(path, np.uint8, "r").view(np.ndarray).reshape(rows, -1)
w = QuantWeight.from_mapping(view, FORMATS["q8_0"].ggml, cols)
view.sum(dtype=np.int64)  # every page of the file resident, as reading it for the kernels makes it
touched = status()
w.matrix()  # interleaved copy built, the file's pages given back
after = status()
assert touched["RssFile"] - before["RssFile"] > 0.9 * size, (before, touched)
assert after["RssFile"] - before["RssFile"] < 0.05 * size, ("file pages still resident", before, after)
assert 0.9 * size < after["RssAnon"] - before["RssAnon"] < 1.2 * size, ("not one copy", before, after)
assert torch.equal(w.linear(x), want) and torch.equal(w[torch.tensor([0, 4095, 17])], want_rows)
assert torch.equal(w.dequantize(), QuantWeight.from_gguf(np.fromfile(path, np.uint8).reshape(rows, -1),
                                                         FORMATS["q8_0"].ggml, cols).dequantize())
print("ok")
"""


def test_a_mapped_matrix_is_held_once(tmp_path):
    """A GGUF's matrices are views of the mapped file: building the kernels' interleaved copy gives the file's pages
    back, so a loaded model holds one copy of its weights (the interleaved one), not the file's pages beside it, and
    its products and rows are the same as an owned copy's (the pages come back from the file when read again).
    Measured in a child process from /proc/self/status: 71 MB of Q8_0."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _MAPPED_CHILD, str(tmp_path / "w.bin"), "", os.path.dirname(__file__)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
