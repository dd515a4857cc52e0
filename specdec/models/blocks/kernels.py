"""Where a float model's CPU work runs: the C++ kernels of `native`, the same GEMM, layer and attention the
quantized runtime runs, for float32, bfloat16 and float16 weights with float32 activations; torch elsewhere
(CUDA, gradients for the head trainer, or a machine that cannot build the kernels).

On CPU every row count (decode, verification, prefill) goes through one C++ GEMM whose output element gets the
same operations in the same order whatever else shares the call, so a row has the same bits alone or in any
batch: greedy speculative output equals plain greedy output by construction for float models as for quantized
ones. torch's GEMM picks its blocking by shape, which made float steps of more than 16 rows part from plain
decoding at near ties.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from specdec.models.cpu import native
from specdec.models.formats.quant import QuantWeight

# the C++ float formats (csrc/formats.h FormatId) by weight dtype
FLOAT_KERNEL_IDS = {torch.float32: 10, torch.float16: 11, torch.bfloat16: 12}


def no_grad(*tensors: torch.Tensor) -> bool:
    """No gradient flows through these (the kernels are not differentiable; the head trainer needs torch's ops)."""
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def on_native(x: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether the C++ kernels compute this: float32 activations on CPU, no gradient, kernels built here."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and no_grad(x, *tensors)
            and native.available())


def matrix(weight: torch.Tensor | QuantWeight) -> Any:  # a native QMatrix (pybind), or the float tensor
    """The C++ kernels' view of a weight matrix [out, in]: its blocks, or the float tensor itself (no copy; kept on
    the tensor and rebuilt if its storage changes)."""
    if isinstance(weight, QuantWeight):
        return weight.matrix()
    if weight.dtype not in FLOAT_KERNEL_IDS:
        raise ValueError(f"the native kernels take float32, float16 or bfloat16 weights, not {weight.dtype}")
    data = weight.detach()
    key = (data.data_ptr(), tuple(data.shape), data.dtype)
    cached = getattr(weight, "_specdec_matrix", None)
    if cached is None or cached[0] != key:  # (a strided view is copied once)
        cached = (key, native.ops().QMatrix([data.contiguous()], [FLOAT_KERNEL_IDS[data.dtype]], data.shape[1]))
        weight._specdec_matrix = cached
    return cached[1]


def linear(x: torch.Tensor, weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias. x: [..., in], weight: [out, in] (nn.Linear layout), float or block-quantized; the result
    is in x's dtype. On CPU the C++ GEMM for any number of rows (see the module docstring)."""
    if isinstance(weight, QuantWeight):
        return weight.linear(x, bias)
    if weight.dtype in FLOAT_KERNEL_IDS and weight.device.type == "cpu" and on_native(x, weight):
        shape = x.shape
        y = native.ops().linear(x.reshape(-1, shape[-1]), matrix(weight))
        if bias is not None:
            y = y.add_(bias)
        return y.reshape(*shape[:-1], y.shape[-1])
    if weight.dtype != x.dtype:  # narrower weights than activations off the native path: compute in the weights'
        return F.linear(x.to(weight.dtype), weight).to(x.dtype) + (0 if bias is None else bias)
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [T, H]: the layers' own C++ norm on CPU (a row's bits do not depend on T,
    which torch's kernel does not promise), torch's elsewhere."""
    if x.dim() == 2 and weight.dtype == torch.float32 and on_native(x, weight):
        return native.ops().rms_norm(x, weight, eps)
    if x.dtype != weight.dtype:  # bfloat16 activations of a float32 head under autocast (training): in float32
        return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(torch.promote_types(x.dtype, weight.dtype))
    return F.rms_norm(x, weight.shape, weight, eps)


def greedy_with_logprob(logits: torch.Tensor, to_target: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax (mapped by `to_target`, e.g. a head's draft ids to target ids) [N] and its log-softmax
    [N], from logits [N, V]: on CPU the native row kernels a head's C++ step uses too (the same bits)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and native.available():
        ids = native.ops().argmax_rows(logits)
        logp = native.ops().logprob_rows(logits, ids, 0)[0]
    else:
        ids = logits.argmax(-1)
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, None])[:, 0]
    return (to_target(ids) if to_target is not None else ids), logp
