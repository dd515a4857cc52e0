"""gpt-oss: the Llama form with biases on q/k/v and o, a learned sink logit per head in every attention softmax,
sliding (128) and full layers alternating, YaRN, and a mixture of experts on every layer: a router with a bias whose
top-k logits are softmaxed, experts with biases and a clamped SwiGLU (`hidden_act` swigluoai). The checkpoint stores
each layer's experts stacked, gate and up interleaved by column ([E, H, 2I]), in float or in MXFP4 blocks
(`*_blocks` with `*_scales`, the published files, kept as GGUF's MXFP4 blocks the native kernels compute on); they
are split here into the canonical per-expert names."""
from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from specdec.config import ModelConfig
from specdec.models.families import Family, State, rope_fields
from specdec.models.formats.gguf import GGUFArch, KeyReader, f32, window_layers
from specdec.models.formats.quant import QuantWeight


def config(hf: dict) -> ModelConfig:
    bias = bool(hf.get("attention_bias", True))
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    return ModelConfig.from_hf(
        {**hf, "attention_bias": bias}, **rope_fields(hf),
        o_proj_bias=bias,
        attn_sinks=True,
        num_experts=experts,
        num_experts_per_tok=hf.get("num_experts_per_tok") or hf.get("experts_per_token"),
        moe_intermediate_size=hf["intermediate_size"],
        moe_layers=tuple(range(hf["num_hidden_layers"])),
        norm_topk_prob=True,  # a softmax over the top-k logits: the full softmax's top k renormalized
        router_bias=True,
        expert_bias=True,
        hidden_act="swigluoai",
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
    )


def mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> QuantWeight:
    """One matrix's Hugging Face MXFP4 (blocks [out, in / 32, 16], scales [out, in / 32]) as GGUF's MXFP4 blocks,
    the same numbers: per 32 weights the exponent byte, then byte j holding weight j (low nibble) and j + 16 (high),
    as llama.cpp's converter repacks them. The native kernels compute on them as they are."""
    b = blocks.to(torch.uint8)
    codes = torch.stack((b & 15, b >> 4), dim=-1).flatten(-2)  # [out, G, 32] nibble codes in weight order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    rows = torch.cat((scales.to(torch.uint8)[..., None], packed), dim=-1).flatten(-2)  # [out, G * 17]
    return QuantWeight.from_gguf(rows.numpy(), GGMLQuantizationType.MXFP4, b.shape[-2] * 32)


def state(state: State, hf: dict) -> State:
    out = {}
    packed = {}
    for name, t in state.items():
        if name.endswith(("_blocks", "_scales")):
            packed[name] = t
            continue
        name = name.replace(".mlp.router.", ".mlp.gate.")
        stem, _, kind = name.rpartition(".mlp.experts.")
        if not stem:
            out[name] = t
        elif kind == "gate_up_proj":  # [E, H, 2I]: rows of out after the transpose, gate even and up odd
            _split_gate_up(out, stem, t.transpose(1, 2), ".weight")
        elif kind == "gate_up_proj_bias":
            _split_gate_up(out, stem, t, ".bias")
        elif kind in ("down_proj", "down_proj_bias"):
            for e, w in enumerate(t.transpose(1, 2) if kind == "down_proj" else t):
                out[f"{stem}.mlp.experts.{e}.down_proj.{'weight' if kind == 'down_proj' else 'bias'}"] = w
        else:
            out[name] = t
    for name in [n for n in packed if n.endswith("_blocks")]:  # [E, out, in / 32, 16], kept in their blocks
        stem, _, kind = name.removesuffix("_blocks").rpartition(".mlp.experts.")
        blocks, scales = packed[name], packed[name.removesuffix("_blocks") + "_scales"]
        if kind == "gate_up_proj":
            for e in range(blocks.shape[0]):
                out[f"{stem}.mlp.experts.{e}.gate_proj.weight"] = mxfp4_blocks(blocks[e, 0::2], scales[e, 0::2])
                out[f"{stem}.mlp.experts.{e}.up_proj.weight"] = mxfp4_blocks(blocks[e, 1::2], scales[e, 1::2])
        else:
            for e in range(blocks.shape[0]):
                out[f"{stem}.mlp.experts.{e}.down_proj.weight"] = mxfp4_blocks(blocks[e], scales[e])
    return out


def _split_gate_up(out: State, stem: str, t: torch.Tensor, suffix: str) -> None:
    """[E, 2I(, H)] with gate and up interleaved by row -> each expert's gate_proj and up_proj."""
    for e, w in enumerate(t):
        out[f"{stem}.mlp.experts.{e}.gate_proj{suffix}"] = w[0::2].contiguous()
        out[f"{stem}.mlp.experts.{e}.up_proj{suffix}"] = w[1::2].contiguous()


def _gguf_keys(key: KeyReader, config: dict, tensors: dict) -> dict:
    """llama.cpp's rule: every even layer slides (unless the file lists them); YaRN's ramp not cut to whole
    dimensions (the config's truncate: false, which the file does not say and ggml always does); the SwiGLU limit
    where it is not llama.cpp's 7."""
    pattern, layers = key("attention.sliding_window_pattern", None), config["num_hidden_layers"]
    out = {"sliding_window": key("attention.sliding_window"),
           "layer_types": window_layers(pattern, layers, lambda i: i % 2 == 0)}
    if config["rope_scaling"]:
        out["rope_scaling"] = {**config["rope_scaling"], "truncate": False}
    if (clamp := key("swiglu_clamp_exp", None)) is not None:
        out["swiglu_limit"] = f32(clamp[0] if isinstance(clamp, list) else clamp)
    return out


FAMILY = Family("gpt_oss", ("gpt_oss",), config, state, gguf=(
    GGUFArch("gpt-oss", "gpt_oss", "GptOssForCausalLM", _gguf_keys, attention_bias=True, window=False),))
