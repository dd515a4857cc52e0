"""Every model family specdec runs, one module each, over the one decoder (`specdec.models.llama`) and its shared
blocks: a family says how its config.json maps onto `ModelConfig`, how its checkpoint's tensor names map onto the
canonical ones the decoder loads, and which of llama.cpp's GGUF architectures it reads, with their own keys
(`formats.gguf.GGUFArch`). Adding a family is adding a module here and naming it in `_families`.

    llama     llama, mistral, qwen2, qwen3      the Llama form (windows where the config slides)
    gemma     gemma2, gemma3_text, gemma3       GeGLU, sandwich norms, soft-caps, local rotary base, q/k norms
    phi3      phi3                              fused qkv and gate-up, LongRoPE, partial rotary
    qwen_moe  qwen2_moe, qwen3_moe              experts, a gated shared expert (Qwen2), sparse-step layouts
    mixtral   mixtral                           eight experts, top-2
    olmoe     olmoe                             experts, whole-q/k norms, clipped q/k/v
    deepseek  deepseek_v2, deepseek_v3          latent attention, YaRN, shared experts, grouped and biased routing
    gpt_oss   gpt_oss                           attention sinks, biases, alternating windows, clamped SwiGLU, MXFP4
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specdec.config import ModelConfig, SpecdecError
from specdec.models.formats.gguf import GGUFArch

State = dict[str, Any]  # tensor name -> a float tensor or a block-quantized QuantWeight


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    config: Callable[[dict], ModelConfig]  # config.json -> the decoder's shape and options
    state: Callable[[State, dict], State] = lambda state, hf: state  # a checkpoint's names -> the canonical ones
    gguf_state: Callable[[State, dict], State] = lambda state, hf: state  # the same for a GGUF's (llama.cpp's) state
    gguf: tuple[GGUFArch, ...] = ()  # llama.cpp's architectures this family reads, with their own keys


def _families() -> tuple[Family, ...]:
    from specdec.models.families import deepseek, gemma, gpt_oss, llama, mixtral, olmoe, phi3, qwen_moe

    return tuple(m.FAMILY for m in (llama, gemma, phi3, qwen_moe, mixtral, olmoe, deepseek, gpt_oss))


def family_of(hf: dict) -> Family:
    """The family of a config.json dict, or a SpecdecError naming every model_type specdec runs."""
    model_type = hf.get("model_type")
    families = _families()
    for family in families:
        if model_type in family.model_types:
            return family
    archs = hf.get("architectures") or [model_type]
    supported = [t for f in families for t in f.model_types]
    raise SpecdecError(f"unsupported architecture {archs[0]!r} (model_type={model_type!r}); specdec supports "
                       f"model_type in {supported}")


def gguf_archs() -> dict[str, GGUFArch]:
    """Every llama.cpp architecture a family reads, by its name."""
    return {arch.name: arch for family in _families() for arch in family.gguf}


def load_config(hf: dict) -> ModelConfig:
    config = family_of(hf).config(hf)
    return dataclasses.replace(config, num_mtp_layers=int(hf.get("num_nextn_predict_layers") or 0))


def rename(state: State, renames: dict[str, str]) -> State:
    """Tensors renamed by their suffix after `model.layers.N.` (or the whole name): the first match of `renames`."""
    out = {}
    for name, tensor in state.items():
        for old, new in renames.items():
            if name.endswith(old):
                name = name[: len(name) - len(old)] + new
                break
        out[name] = tensor
    return out


def split_rows(state: State, fused: str, parts: dict[str, int]) -> State:
    """Tensors named `...{fused}` split by rows into `...{part}` of the given sizes, in order (a fused qkv or
    gate-up projection, for a decoder that fuses them itself)."""
    out = {}
    for name, tensor in state.items():
        if not name.endswith(fused):
            out[name] = tensor
            continue
        if tensor.shape[0] != sum(parts.values()):
            raise SpecdecError(f"tensor {name!r} has {tensor.shape[0]} rows; the config implies {sum(parts.values())}")
        stem = name[: len(name) - len(fused)]
        for part, piece in zip(parts, torch.split(tensor, list(parts.values())), strict=True):
            out[stem + part] = piece
    return out


def rope_fields(hf: dict, params: dict | None = None) -> dict:
    """rope_theta and rope_scaling from a flat `rope_parameters` (transformers 5) or the older keys."""
    params = params if params is not None else (hf.get("rope_parameters") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return {"rope_theta": float(theta), "rope_scaling": scaling}
