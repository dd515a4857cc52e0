"""Weights kept in GGUF block formats, and the linear layer that computes on them.

A `QuantWeight` is a matrix [out, in] stored as the GGUF file stores it: each row a run of blocks (Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4: 32 weights; Q4_K, Q5_K, Q6_K, IQ4_XS: 256), in one format per range of rows
("parts": q/k/v or gate/up fused from tensors a GGUF may quantize differently). The C++ kernels (`native`)
regroup each 8 rows' blocks once at load into interleaved records holding the same scales and quants
(csrc/formats.h), unpack them in registers and take integer dot products with activations quantized per row
to int8 blocks of 32, so what we multiply is exactly what the file holds; `dequantize` (gguf's reference)
gives the float32 matrix the tests compare against.

Numerics: weights are exactly the file's (f16 scales read as f16). Activations are rounded to 8 bits per
block of 32 (relative error about 0.4% of the block's largest value), as llama.cpp does on CPU, so logits
differ from the float32 engine's by a little, and greedy output can differ from it at near-ties. Every
row is computed independently of the others, so speculative output equals plain output of this runtime.
"""
from __future__ import annotations

import ctypes
import mmap
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from specdec.models.cpu import native
from specdec.models.formats.quantizers import quantize as ggml_quantize


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml: GGMLQuantizationType
    kernel_id: int  # the format's id in csrc/formats.h

    @property
    def block(self) -> int:
        return GGML_QUANT_SIZES[self.ggml][0]

    @property
    def bytes(self) -> int:
        return GGML_QUANT_SIZES[self.ggml][1]


FORMATS = {f.name: f for f in (
    BlockFormat("q8_0", GGMLQuantizationType.Q8_0, 0),
    BlockFormat("q4_0", GGMLQuantizationType.Q4_0, 1),
    BlockFormat("q4_1", GGMLQuantizationType.Q4_1, 2),
    BlockFormat("q4_k", GGMLQuantizationType.Q4_K, 3),
    BlockFormat("q6_k", GGMLQuantizationType.Q6_K, 4),
    BlockFormat("q5_0", GGMLQuantizationType.Q5_0, 5),
    BlockFormat("q5_1", GGMLQuantizationType.Q5_1, 6),
    BlockFormat("q5_k", GGMLQuantizationType.Q5_K, 7),
    BlockFormat("iq4_nl", GGMLQuantizationType.IQ4_NL, 8),
    BlockFormat("iq4_xs", GGMLQuantizationType.IQ4_XS, 9),
    BlockFormat("mxfp4", GGMLQuantizationType.MXFP4, 13),
)}
BY_GGML = {f.ggml: f for f in FORMATS.values()}
QUANTIZE_ON_LOAD = sorted(FORMATS)  # every format can also be made from float weights on load (`quantizers`)


@dataclass
class QuantWeight:
    """A block-quantized matrix [out_features, in_features]: parts of rows, each (uint8 [rows, row_bytes], format)."""

    parts: list[tuple[torch.Tensor, BlockFormat]]
    in_features: int
    mapped: bool = False  # every part is a view of a read-only file mapping (`from_mapping`), not memory of ours
    _matrix: object = field(default=None, repr=False, compare=False)
    _rows: object = field(default=None, repr=False, compare=False)
    _dense: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def out_features(self) -> int:
        return sum(data.shape[0] for data, _ in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(data.numel() for data, _ in self.parts)

    @property
    def formats(self) -> list[str]:
        return [fmt.name for _, fmt in self.parts]

    @classmethod
    def from_gguf(cls, data: np.ndarray, ggml: GGMLQuantizationType, in_features: int) -> QuantWeight:
        """data: the tensor's bytes as gguf reads them, [rows, row_bytes] uint8."""
        fmt = BY_GGML[ggml]
        rows = np.array(data).reshape(-1, in_features // fmt.block * fmt.bytes)  # owned: the file may be unmapped
        return cls([(torch.from_numpy(rows), fmt)], in_features)

    @classmethod
    def from_mapping(cls, data: np.ndarray, ggml: GGMLQuantizationType, in_features: int) -> QuantWeight:
        """data: a read-only view of a mapped file's tensor, [rows, row_bytes] uint8, kept as a view: the file's
        pages are read while the kernels interleave them and then given back (`matrix`), so a loaded model holds
        one copy of its weights, not two."""
        fmt = BY_GGML[ggml]
        with warnings.catch_warnings():  # never written: torch's warning about a read-only buffer does not apply
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            rows = torch.from_numpy(data.reshape(-1, in_features // fmt.block * fmt.bytes))
        return cls([(rows, fmt)], in_features, mapped=True)

    @classmethod
    def quantize(cls, weight: torch.Tensor, name: str) -> QuantWeight:
        """Quantize a float matrix [out, in] into format `name` (ggml's reference quantizers, `quantizers`)."""
        fmt = FORMATS[name]
        data = ggml_quantize(weight.detach().float().cpu().numpy(), fmt.ggml)
        return cls([(torch.from_numpy(np.ascontiguousarray(data)), fmt)], weight.shape[1])

    @classmethod
    def cat(cls, weights: list[QuantWeight]) -> QuantWeight:
        """Stack matrices by rows (q/k/v, gate/up). The parts stay as they are, not copied into one: a mapped
        file's views stay views (each part of 8k rows is interleaved alike either way)."""
        if len({w.in_features for w in weights}) != 1:
            raise ValueError("cannot fuse matrices with different input sizes")
        return cls([p for w in weights for p in w.parts], weights[0].in_features, all(w.mapped for w in weights))

    def permute_rows(self, order: torch.Tensor) -> QuantWeight:
        """Rows in a new order (undoing convert_hf_to_gguf's q/k permutation); one part only."""
        if len(self.parts) != 1:
            raise ValueError("can only permute the rows of a single-format matrix")
        data, fmt = self.parts[0]
        return QuantWeight([(data[order].contiguous(), fmt)], self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix (gguf's reference dequantizer): what the kernels' integer math approximates."""
        return torch.cat([torch.from_numpy(gguf_dequantize(data.numpy(), fmt.ggml).reshape(data.shape[0], -1))
                          for data, fmt in self.parts]).float()

    @property
    def dtype(self) -> torch.dtype:
        """What the matrix computes in and returns: float32 activations."""
        return torch.float32

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows (token ids, for an embedding) as float32 [len(rows), in_features]."""
        rows = torch.as_tensor(rows)
        if rows.device.type == "cpu" and native.available():
            if self._matrix is None and self._rows is None:  # an embedding only: no interleaved copy
                self._rows = native.ops().QMatrix([d for d, _ in self.parts], [f.kernel_id for _, f in self.parts],
                                                  self.in_features, interleave=False)
            return native.ops().dequantize_rows(self._rows if self._matrix is None else self._matrix, rows)
        return self.dense(rows.device)[rows]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T + bias for x [..., in]: the native kernels on CPU, the dequantized matrix elsewhere."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.device.type == "cpu":
            y = native.ops().linear(x2.float(), self.matrix())
        else:  # no device kernels (CUDA): the dequantized matrix, built once
            y = torch.nn.functional.linear(x2.float(), self.dense(x2.device))
        if bias is not None:
            y = y + bias
        return y.to(x.dtype).reshape(*shape[:-1], y.shape[-1])

    def dense(self, device: torch.device) -> torch.Tensor:
        if self._dense is None or self._dense.device != device:
            self._dense = self.dequantize().to(device)
        return self._dense

    def matrix(self) -> Any:  # a native QMatrix (pybind)
        """The kernels' view of this matrix (built once)."""
        if self._matrix is None:
            self._matrix = native.ops().QMatrix([d for d, _ in self.parts], [f.kernel_id for _, f in self.parts],
                                                self.in_features)
            if self.mapped:  # the kernels read their interleaved copy; the file's pages are read again only
                for data, _ in self.parts:  # for the rows left over from groups of 8 (and embedding rows)
                    release_pages(data)
        return self._matrix


_libc = ctypes.CDLL(None, use_errno=True)
_MADV_DONTNEED = 4


def release_pages(view: torch.Tensor) -> None:
    """Give back the resident pages of a view of a read-only file mapping (madvise DONTNEED on the whole pages it
    spans): they stop counting towards this process's memory and are read again from the page cache if touched.
    Only for file mappings: on memory of our own, DONTNEED would discard the data."""
    start, end = view.data_ptr(), view.data_ptr() + view.numel() * view.element_size()
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def check_quantizable(name: str, shape: tuple[int, ...], what: str) -> None:
    """Refuse a quantization that a matrix cannot take, naming the valid choices."""
    if name not in FORMATS:
        raise ValueError(f"unknown quantization {name!r}; choose one of {QUANTIZE_ON_LOAD}")
    block = FORMATS[name].block
    if shape[-1] % block:
        raise ValueError(f"{what} has {shape[-1]} inputs, not a multiple of {name}'s block of {block}: "
                         f"it cannot be quantized to {name} (choices: {QUANTIZE_ON_LOAD}, or no quantization)")
