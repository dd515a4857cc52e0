"""Quantization on load: a model's or a draft head's float matrices turned into block-quantized ones.

`quant` knows the block formats and computes on them; this module decides which matrices of a model become
which format: a Hugging Face target (`quantization="q4_1"`, LM head in q8_0), a draft head, or a low-bit copy
of the target for self-speculation.
"""
from __future__ import annotations

import torch
from torch import nn

from specdec.models.formats.quant import FORMATS, QuantWeight, check_quantizable
from specdec.models.llama import Linear, LlamaModel, RMSNorm, replace_parameter


def dense(weight: torch.Tensor | QuantWeight) -> torch.Tensor:
    """A matrix as float32, whatever it is stored in."""
    return weight.dequantize() if isinstance(weight, QuantWeight) else weight.data.float()


def quantize_model(model: LlamaModel, name: str) -> None:
    """In place: every float decoder matrix into format `name`, and the LM head in q8_0 (a 4-bit LM head
    costs accuracy for little speed). Checks every matrix before changing any."""
    for i, layer in enumerate(model.layers):
        for lin in layer.linears:
            if not lin.quantized:
                check_quantizable(name, tuple(lin.weight.shape), f"layer {i}'s {type(lin).__name__}")
    for layer in model.layers:
        for lin in layer.linears:
            if not lin.quantized:
                lin.set_weight(QuantWeight.quantize(lin.weight.data, name), "")
    model.weights_changed()
    if not isinstance(model.lm_head, QuantWeight) and model.lm_head.shape[1] % FORMATS["q8_0"].block == 0:
        model.set_matrix("lm_head", QuantWeight.quantize(model.lm_head.data, "q8_0"))


def quantized_copy(model: LlamaModel, name: str) -> LlamaModel:
    """Another model over the same config whose matrices (LM head included) are `model`'s, quantized to
    format `name`; norms are copied and the embedding is shared. A cheap self-draft (`quantized_self`)."""
    copy = LlamaModel(model.config, torch.float32, model.device)
    for mine, theirs in zip(copy.layers, model.layers):
        for dst, src in zip(mine.linears, theirs.linears):
            weight = dense(src.weight)
            check_quantizable(name, tuple(weight.shape), "a decoder matrix")
            dst.set_weight(QuantWeight.quantize(weight, name), "")
            if src.bias is not None:
                dst.bias.data.copy_(src.bias)
        for norm in ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm"):
            if isinstance(getattr(theirs, norm), RMSNorm):
                getattr(mine, norm).weight.data.copy_(getattr(theirs, norm).weight)
    copy.norm.weight.data.copy_(model.norm.weight)
    replace_parameter(copy, "embed_tokens", model.embed_tokens)
    replace_parameter(copy, "lm_head", QuantWeight.quantize(dense(model.lm_head), name))
    return copy.eval()


def quantize_module(module: nn.Module, name: str, attrs: tuple[str, ...] = ("lm_head",)) -> int:
    """A draft head, in place: every float `Linear` whose width the block divides, and the float matrix
    parameters named in `attrs` (a head's own LM head). Returns how many matrices were quantized."""
    block, count = FORMATS[name].block, 0
    for sub in module.modules():
        if isinstance(sub, Linear) and not sub.quantized and sub.in_features % block == 0:
            sub.set_weight(QuantWeight.quantize(sub.weight.data, name), "")
            count += 1
        for attr in attrs:
            param = sub._parameters.get(attr)
            if param is not None and param.dim() == 2 and param.shape[1] % block == 0:
                replace_parameter(sub, attr, QuantWeight.quantize(param.data, name))
                count += 1
    return count
