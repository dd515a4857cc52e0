"""The blocks every family's layers are built from: a linear map over float or block-quantized weights, RMSNorm, and
the gated MLP's activations. (Attention is `attention`, `mla` and the native kernels; the mixture-of-experts MLP
`moe`; rotary embeddings `rotary`.)"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specdec.config import ModelConfig
from specdec.models.blocks.kernels import linear, rms_norm
from specdec.models.formats.quant import QuantWeight


def replace_parameter(module: nn.Module, attr: str, value: QuantWeight) -> None:
    """Put a block-quantized matrix where a float Parameter was (a QuantWeight is not a Parameter)."""
    module._parameters.pop(attr, None)
    setattr(module, attr, value)


class Linear(nn.Module):
    """y = x @ weight.T + bias, weight: [out, in] as in nn.Linear and HF checkpoints: a float Parameter, or a
    block-quantized `QuantWeight` (a GGUF's own blocks, or quantized on load) set by `set_weight`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device | str,
                 act_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=act_dtype or dtype, device=device),
                                 requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    @property
    def quantized(self) -> bool:
        return isinstance(self.weight, QuantWeight)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def set_weight(self, value: torch.Tensor | QuantWeight, name: str) -> None:
        """Load a float tensor into the Parameter, or replace the Parameter by a quantized matrix."""
        if tuple(value.shape) != tuple(self.weight.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(value.shape)}, config expects "
                             f"{tuple(self.weight.shape)}")
        if isinstance(value, QuantWeight):
            replace_parameter(self, "weight", value)
        else:
            if self.quantized:
                raise ValueError(f"tensor {name!r}: a float tensor for a quantized layer")
            self.weight.data.copy_(value.to(self.weight.dtype))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return rms_norm(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)  # as transformers does: normalize in fp32, scale in x's dtype


def activation(name: str, gate: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation of its gate half: SiLU (SwiGLU), or tanh-approximated GELU (Gemma's GeGLU)."""
    return F.silu(gate) if name == "silu" else F.gelu(gate, approximate="tanh")


def glu(cfg: ModelConfig, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's product of its halves: act(gate) * up, or gpt-oss's clamped form (swigluoai)."""
    if cfg.hidden_act != "swigluoai":
        return activation(cfg.hidden_act, gate) * up
    limit = cfg.swiglu_limit
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(gate * cfg.swiglu_alpha) * (up + 1)


def fuse_rows(weights: list) -> torch.Tensor | QuantWeight:
    """Fuse matrices by rows (q/k/v, gate/up), float or block-quantized."""
    if any(isinstance(w, QuantWeight) for w in weights):
        if not all(isinstance(w, QuantWeight) for w in weights):
            raise ValueError("cannot fuse a quantized matrix with a float one")
        return QuantWeight.cat(weights)
    return torch.cat(weights)


def load_gated_mlp(gate_up: Linear, down: Linear, p: str, take: Callable[[str], torch.Tensor]) -> None:
    """A gated MLP's `{p}gate_proj`, `{p}up_proj` (fused by rows) and `{p}down_proj`, with their biases where the
    layers have them (gpt-oss's experts). take(name) -> the checkpoint's tensor."""
    gate_up.set_weight(fuse_rows([take(p + "gate_proj.weight"), take(p + "up_proj.weight")]),
                       p + "gate_up_proj.weight")
    down.set_weight(take(p + "down_proj.weight"), p + "down_proj.weight")
    for lin, bias, name in ((gate_up, lambda: torch.cat([take(p + "gate_proj.bias"), take(p + "up_proj.bias")]),
                             "gate_up_proj.bias"), (down, lambda: take(p + "down_proj.bias"), "down_proj.bias")):
        if lin.bias is not None:
            value = bias()
            if tuple(value.shape) != tuple(lin.bias.shape):
                raise ValueError(f"tensor {p + name!r} has shape {tuple(value.shape)}, config expects "
                                 f"{tuple(lin.bias.shape)}")
            lin.bias.data.copy_(value)
