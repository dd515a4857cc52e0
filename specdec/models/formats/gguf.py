"""Read llama.cpp GGUF checkpoints as a Hugging Face-style config dict and state dict (the loader's `load_gguf`
adds the family's own conversions: this module knows llama.cpp's names and keys, not the families).

Two ways: matrices kept in their own block formats (`keep_blocks`, the native quantized runtime: Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4, see `quant.FORMATS`; a file with another type, such as
Q2_K, Q3_K or the smaller IQ types, is refused naming the tensor, its type and what dequantizing costs), or
every weight dequantized to floats at load time, for which
any type that `gguf.quants.dequantize` handles works: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q2_K..Q6_K, the IQ*/TQ* families and MXFP4.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from specdec.config import FULL, SLIDING, ModelConfig
from specdec.models.formats.quant import BY_GGML, FORMATS, QuantWeight

_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)

KeyReader = Callable[..., Any]  # key(suffix, default) -> the file's `{arch}.{suffix}` value (no default: required)


@dataclass(frozen=True)
class GGUFArch:
    """How one of llama.cpp's architectures (`general.architecture`) reads as a family's config.json: a family
    module declares its own (`Family.gguf`), so this module holds llama.cpp's shared layout and keys only."""

    name: str  # llama.cpp's architecture name
    model_type: str  # the Hugging Face model_type whose family reads it
    hf_architecture: str  # config.json's architectures[0]
    keys: Callable[[KeyReader, dict, dict], dict] = lambda key, config, tensors: {}  # (key, config, tensors) -> the
    # family's own options from its keys, updating the config (which may change model_type: a llama file of experts)
    attention_bias: bool = False  # q/k/v biases (the file's tensors are then required)
    norm_topk: bool = False  # llama.cpp's router renormalizes its top-k weights (build_moe_ffn's norm_w)
    permuted_qk: bool = False  # llama.cpp's converter interleaves the rotary halves of Q and K
    window: bool = True  # `attention.sliding_window` (and its pattern) as a Mistral or Qwen window, where stated


_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# A dense Llama-form layer's GGUF suffix -> HF suffix under model.layers.N. (a draft head's layers: `head_gguf`)
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# GGUF rope.scaling.* suffix -> HF rope_scaling key, for files that state their scaling explicitly.
_ROPE_SCALING_KEYS = {
    "factor": "factor",
    "original_context_length": "original_max_position_embeddings",
    "attn_factor": "attention_factor",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
}
# Llama 3.x's original context; only the ratios original/low and original/high change frequencies, so a
# guessed original length still reproduces rope_freqs exactly once low/high are fitted against it.
_LLAMA3_ORIGINAL_CONTEXT = 8192
_DEQUANT_CHUNK_BLOCKS = 256
_REQUIRED = object()


class _Reader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memmap.

    GGUFReader slices its buffer once per metadata item (~250k times for a 49k-token vocabulary) and
    np.memmap's Python-level __getitem__/__array_finalize__ made that 3x slower; a base-class view shares
    the same mapped pages.
    """

    @property
    def data(self) -> np.ndarray:
        return self._buffer

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._buffer = value.view(np.ndarray)


def read_gguf(path: str | os.PathLike, archs: dict[str, GGUFArch], config_of: Callable[[dict], ModelConfig],
              dtype: torch.dtype = torch.float32, keep_blocks: bool = False
              ) -> tuple[dict, dict[str, torch.Tensor | QuantWeight]]:
    """Read a GGUF file; return (hf_config, state_dict) shaped like a Hugging Face checkpoint. archs: the
    architectures the families read (`families.gguf_archs`); config_of: the decoder's shape for a config.json dict
    (its family's rules), which says what tensors the file must hold.

    hf_config mirrors config.json (model_type, architectures, sizes, rope_theta/rope_scaling, token ids);
    state_dict uses HF parameter names and [out, in] linear shapes, converted to `dtype`. lm_head.weight is
    present only when the file has its own output.weight (otherwise tie_word_embeddings is True).
    keep_blocks: quantized matrices stay in their blocks (`QuantWeight`), float ones become float32; a
    quantized type the native kernels do not know is an error naming it and the tensor.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = _Reader(path)
    arch = architecture(reader, archs)
    tensors = {t.name: t for t in reader.tensors}
    config = hf_config(reader, arch, tensors)
    expected = _expected_tensors(config_of(config), tensors)
    state_dict = {}
    blocks = _field(reader, f"{arch.name}.block_count")
    mtp_blocks = tuple(f"blk.{i}." for i in range(config["num_hidden_layers"], blocks))
    for name, tensor in tensors.items():
        if name in _ROPE_TENSORS or name.startswith(mtp_blocks):  # rope scaling is in the config; MTP layers
            continue  # are a draft head's (`heads.gguf`)
        if name not in expected:
            raise ValueError(f"unexpected tensor {name!r} in {path} for architecture {arch.name!r}")
        state_dict.update(_convert(reader, path, arch, config, name, tensor, expected.pop(name), dtype, keep_blocks))
    if expected:
        raise ValueError(f"missing tensor {next(iter(expected))!r} in {path} ({len(expected)} missing in all)")
    return config, state_dict


def read_layer(reader: GGUFReader, path: Path, arch: GGUFArch, config_of: Callable[[dict], ModelConfig],
               config: dict, layer: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Block `layer` past the model's main layers (an MTP layer, `nextn_predict_layers`) read as a decoder layer of
    the model's own kind, float32 under `model.layers.{layer}.` names, and its other tensors as the file holds them
    (its `nextn.*` ones): (decoder layer state, {GGUF name: tensor})."""
    tensors = {t.name: t for t in reader.tensors}
    grown = {**config, "num_hidden_layers": layer + 1}
    if config.get("layer_types"):  # an MTP layer sees every key
        grown["layer_types"] = [*config["layer_types"], FULL]
    prefix = f"blk.{layer}."
    expected = {k: v for k, v in _expected_tensors(config_of(grown), tensors).items() if k.startswith(prefix)}
    state: dict[str, torch.Tensor] = {}
    rest = {}
    for name, tensor in tensors.items():
        if not name.startswith(prefix):
            continue
        if name in expected:
            state.update(_convert(reader, path, arch, config, name, tensor, expected.pop(name), torch.float32,
                                  keep_blocks=False))
        else:
            rest[name] = tensor
    if expected:
        raise ValueError(f"MTP layer {layer} in {path}: missing tensor {next(iter(expected))!r} ({len(expected)} "
                         "missing in all)")
    return state, rest


def _convert(reader: GGUFReader, path: Path, arch: GGUFArch, config: dict, name: str, tensor: Any,
             entry: tuple[list[tuple[str, tuple[int, ...]]], tuple], dtype: torch.dtype, keep_blocks: bool
             ) -> dict[str, torch.Tensor | QuantWeight]:
    """One GGUF tensor as its Hugging Face tensors (`_expected_tensors` entry: its parts and shape): views of the
    mapped blocks with keep_blocks, else dequantized to `dtype`; llama.cpp's q/k row permutation undone."""
    parts, hf_shape = entry
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if shape != hf_shape:
        raise ValueError(f"tensor {name!r} has shape {list(shape)}, expected {list(hf_shape)} from the metadata")
    permuted = arch.permuted_qk and name.endswith(("attn_q.weight", "attn_k.weight"))
    heads = config["num_attention_heads"] if "attn_q" in name else config["num_key_value_heads"]
    out: dict[str, torch.Tensor | QuantWeight] = {}
    if keep_blocks and tensor.tensor_type not in _FLOAT_TYPES and all(len(p[1]) == 2 for p in parts):
        if tensor.tensor_type not in BY_GGML:
            f32_bytes, size = float32_bytes(reader), os.path.getsize(path)
            raise ValueError(
                f"tensor {name!r} is {tensor.tensor_type.name}, which the native quantized runtime does not "
                f"compute on (it does {', '.join(f.upper() for f in FORMATS)}); dequantizing the whole model "
                f"instead costs {f32_bytes / 1e9:.2f} GB in float32 ({f32_bytes / size:.1f}x the file's "
                f"{size / 1e9:.2f} GB read per token; dtype='bfloat16' halves it)")
        rows, first = tensor.data.reshape(-1, tensor.data.shape[-1]), 0
        for hf_name, part in parts:
            weights = QuantWeight.from_mapping(rows[first:first + part[0]], tensor.tensor_type, part[1])
            first += part[0]
            if permuted:
                order = _unpermute_qk(np.arange(part[0]), heads)
                weights = weights.permute_rows(torch.from_numpy(order))
            out[hf_name] = weights
        return out
    weights = _dequantize(tensor.data, tensor.tensor_type, name).reshape(shape)
    if permuted:
        weights = _unpermute_qk(weights, heads)
    rows, first = weights.reshape(-1, *parts[0][1][1:]) if len(parts) > 1 else weights, 0
    for hf_name, part in parts:  # a whole tensor, or its rows split (fused q/k/v, gate/up, experts)
        piece = rows[first:first + part[0]] if len(parts) > 1 else rows.reshape(part)
        first += part[0]
        out[hf_name] = _to_torch(piece, torch.float32 if keep_blocks else dtype)
    return out


def float32_bytes(reader: GGUFReader) -> int:
    """What the file's weights take dequantized to float32 (the cost of computing a type we have no kernels for)."""
    return sum(int(t.n_elements) * 4 for t in reader.tensors)


def _field(reader: GGUFReader, key: str, default: Any = _REQUIRED) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def f32(value: float) -> float:
    """GGUF stores floats as f32; the shortest repr gives back the config.json value (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def architecture(reader: GGUFReader, archs: dict[str, GGUFArch]) -> GGUFArch:
    """The file's architecture as a family reads it, or an error naming every one specdec reads."""
    name = _field(reader, "general.architecture")
    if name not in archs:
        raise ValueError(f"unsupported GGUF architecture {name!r}; supported: {list(archs)}")
    return archs[name]


def hf_config(reader: GGUFReader, arch: GGUFArch, tensors: dict) -> dict:
    """The file's config as a Hugging Face config.json would state it: llama.cpp's shared keys here, then the
    family's own (`GGUFArch.keys`)."""
    def key(suffix: str, default: Any = _REQUIRED) -> Any:
        return _field(reader, f"{arch.name}.{suffix}", default)

    if "token_embd.weight" not in tensors:
        raise ValueError("missing tensor 'token_embd.weight'")
    hidden = key("embedding_length")
    heads = key("attention.head_count")
    head_dim = key("attention.key_length", None) or hidden // heads  # as llama.cpp: rope.dimension_count is the
    rope_theta = f32(key("rope.freq_base", 10000.0))  # rotated part (Phi-4-mini's is 3/4 of the head)
    mtp_layers = key("nextn_predict_layers", 0)
    layers = key("block_count") - mtp_layers  # MTP layers count in block_count
    config = {
        "model_type": arch.model_type,
        "architectures": [arch.hf_architecture],
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length", 0),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(reader, arch.name, tensors, rope_theta, head_dim),
        "max_position_embeddings": key("context_length", 4096),
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch.attention_bias,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", None),
    }
    if mtp_layers:  # as DeepSeek-V3's config.json states them
        config["num_nextn_predict_layers"] = mtp_layers
    if (rotary := key("rope.dimension_count", head_dim)) != head_dim:  # RoPE on part of each head (Phi-4-mini)
        config["partial_rotary_factor"] = rotary / head_dim
    experts = key("expert_count", 0)
    if experts:  # llama.cpp's MoE keys (Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss; DeepSeek adds its own)
        config.update(num_experts=experts, num_experts_per_tok=key("expert_used_count"),
                      moe_intermediate_size=key("expert_feed_forward_length", 0) or config["intermediate_size"],
                      shared_expert_intermediate_size=key("expert_shared_feed_forward_length", 0),
                      norm_topk_prob=arch.norm_topk, decoder_sparse_step=1,
                      mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors])
        if not config["intermediate_size"]:
            config["intermediate_size"] = config["moe_intermediate_size"]
    if (clamp := key("attention.clamp_kqv", None)) is not None:  # OLMoE's clip_qkv (llama.cpp's key for it)
        config["clip_qkv"] = f32(clamp)
    if arch.window and (window := key("attention.sliding_window", 0)) > 0:  # a Mistral or Qwen window, where a
        pattern = key("attention.sliding_window_pattern", None)  # file states it (llama.cpp reads none for these)
        config.update(sliding_window=window, layer_types=window_layers(pattern, layers, lambda i: True))
    config.update(arch.keys(key, config, tensors))
    return config


def window_layers(pattern: Any, layers: int, slides: Callable[[int], bool]) -> list[str]:
    """Each layer's attention (config.json's layer_types): a file's own `sliding_window_pattern` list (true: the
    layer slides), else the family's rule `slides(layer)`."""
    return [SLIDING if (bool(pattern[i]) if isinstance(pattern, list) else slides(i)) else FULL for i in range(layers)]


def _rope_scaling(reader: GGUFReader, arch: str, tensors: dict, rope_theta: float, head_dim: int) -> dict | None:
    """HF rope_scaling from `<arch>.rope.scaling.*` keys, else from a Llama-3 `rope_freqs.weight` tensor.

    Explicit keys map type -> rope_type and the suffixes in _ROPE_SCALING_KEYS; llama.cpp writes no keys
    for Llama 3 and stores the per-frequency divisors instead, which _llama3_scaling inverts.
    """
    prefix = f"{arch}.rope.scaling."
    if "rope_factors_short.weight" in tensors:  # Phi-3's LongRoPE: both factor sets as tensors
        factors = {k: np.asarray(tensors[f"rope_factors_{k}.weight"].data, dtype=np.float64).ravel().tolist()
                   for k in ("short", "long")}
        scaling = {"rope_type": "longrope", "short_factor": factors["short"], "long_factor": factors["long"],
                   "original_max_position_embeddings": _field(reader, prefix + "original_context_length")}
        if (attn := _field(reader, prefix + "attn_factor", None)) is not None:
            scaling["attention_factor"] = f32(attn)
        return scaling
    kind = _field(reader, prefix + "type", None)
    if kind not in (None, "none"):
        scaling = {"rope_type": kind}
        for suffix, hf_key in _ROPE_SCALING_KEYS.items():
            if (value := _field(reader, prefix + suffix, None)) is not None:
                scaling[hf_key] = f32(value) if isinstance(value, float) else value
        return scaling
    if "rope_freqs.weight" in tensors:
        factors = _dequantize(tensors["rope_freqs.weight"].data, tensors["rope_freqs.weight"].tensor_type,
                              "rope_freqs.weight").astype(np.float64).ravel()
        original = _field(reader, prefix + "original_context_length", _LLAMA3_ORIGINAL_CONTEXT)
        return _llama3_scaling(factors, rope_theta, head_dim, original)
    return None


def _llama3_scaling(factors: np.ndarray, rope_theta: float, head_dim: int, original: int) -> dict | None:
    """Recover HF's llama3 rope_scaling from llama.cpp's rope_freqs (inv_freq divisors).

    factor is the largest divisor. In the smoothed band 1/f = (1-s)/factor + s with
    s = original/wavelen/(high-low) - low/(high-low), which is linear in 1/wavelen: a least-squares line
    through those frequencies gives low and high. With fewer than two smoothed frequencies the band is
    unobservable, so Llama 3.1's low=1, high=4 are used.
    """
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_freq = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    inv_wavelen = inv_freq[: factors.size] / (2 * math.pi)
    band = (factors > 1.0 + 1e-4) & (factors < factor * (1 - 1e-4))
    low, high = 1.0, 4.0
    if band.sum() >= 2:
        smooth = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(inv_wavelen[band], smooth, 1)
        low = -intercept * original / slope
        high = low + original / slope
    return {
        "rope_type": "llama3",
        "factor": round(factor, 4),
        "low_freq_factor": round(float(low), 4),
        "high_freq_factor": round(float(high), 4),
        "original_max_position_embeddings": int(original),
    }


def _expected_tensors(cfg: ModelConfig, tensors: dict) -> dict[str, tuple[list[tuple[str, tuple[int, ...]]], tuple]]:
    """GGUF name -> (its parts: [(HF name, HF shape)] split from its rows in order, the GGUF tensor's shape) for every
    tensor the config implies, by llama.cpp's names. A tensor is one HF tensor, or several: Phi-3's fused attn_qkv
    and gate-up ffn_up, or a mixture's experts stacked in one [E, out, in] tensor (`*_exps`)."""
    hidden, inter, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_dim, kv_dim = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    vocab = cfg.vocab_size
    expected = {"token_embd.weight": ([("model.embed_tokens.weight", (vocab, hidden))], (vocab, hidden)),
                "output_norm.weight": ([("model.norm.weight", (hidden,))], (hidden,))}
    if not cfg.tie_word_embeddings:
        expected["output.weight"] = ([("lm_head.weight", (vocab, hidden))], (vocab, hidden))

    def one(gguf: str, hf: str, shape: tuple[int, ...]) -> None:
        expected[gguf] = ([(hf, shape)], shape)

    def rows(gguf: str, parts: list[tuple[str, tuple[int, ...]]]) -> None:
        expected[gguf] = (parts, (sum(p[1][0] for p in parts), *parts[0][1][1:]))

    if cfg.kv_lora_rank:
        q_dim = cfg.num_attention_heads * cfg.v_head_dim  # what the output projection reads
    for i in range(cfg.num_hidden_layers):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        one(b + "attn_norm.weight", h + "input_layernorm.weight", (hidden,))
        qkv = [(h + f"self_attn.{n}_proj.weight", (size, hidden)) for n, size in zip("qkv", (q_dim, kv_dim, kv_dim))]
        if cfg.kv_lora_rank:
            _expected_latent_attention(expected, b, h + "self_attn.", cfg, tensors)
        elif b + "attn_qkv.weight" in tensors:
            rows(b + "attn_qkv.weight", qkv)
        else:
            for n, part in zip("qkv", qkv):
                one(b + f"attn_{n}.weight", *part)
        if cfg.attention_bias:
            for n, size in zip("qkv", (q_dim, kv_dim, kv_dim)):
                one(b + f"attn_{n}.bias", h + f"self_attn.{n}_proj.bias", (size,))
        if cfg.qk_norm or cfg.qk_norm_full:
            one(b + "attn_q_norm.weight", h + "self_attn.q_norm.weight", (q_dim if cfg.qk_norm_full else D,))
            one(b + "attn_k_norm.weight", h + "self_attn.k_norm.weight", (kv_dim if cfg.qk_norm_full else D,))
        one(b + "attn_output.weight", h + "self_attn.o_proj.weight", (hidden, q_dim))
        if cfg.o_proj_bias:
            one(b + "attn_output.bias", h + "self_attn.o_proj.bias", (hidden,))
        if cfg.attn_sinks:
            one(b + "attn_sinks.weight", h + "self_attn.sinks", (cfg.num_attention_heads,))
        # the MLP's input norm (gpt-oss's file names it after attention, as Gemma's sandwich norm is named)
        mlp_norm = "post_attention_norm.weight" if cfg.attn_sinks else "ffn_norm.weight"
        one(b + mlp_norm, h + "post_attention_layernorm.weight", (hidden,))
        if cfg.sandwich_norms:
            one(b + "post_attention_norm.weight", h + "attn_out_norm.weight", (hidden,))
            one(b + "post_ffw_norm.weight", h + "mlp_out_norm.weight", (hidden,))
        if i in cfg.moe_layers:
            _expected_experts(expected, b, h + "mlp.", cfg)
        elif b + "ffn_gate.weight" not in tensors and cfg.model_type == "phi3":  # gate and up fused in ffn_up
            rows(b + "ffn_up.weight", [(h + "mlp.gate_proj.weight", (inter, hidden)),
                                       (h + "mlp.up_proj.weight", (inter, hidden))])
            one(b + "ffn_down.weight", h + "mlp.down_proj.weight", (hidden, inter))
        else:
            for n, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
                one(b + f"ffn_{n}.weight", h + f"mlp.{n}_proj.weight", shape)
    return expected


def _expected_latent_attention(expected: dict, b: str, h: str, cfg: Any, tensors: dict) -> None:
    """DeepSeek's attention tensors: q (or its q_a / q_a_norm / q_b bottleneck), kv_a_mqa, kv_a_norm, and the
    up-projection as llama.cpp's absorbed k_b [nH, r, nope] / v_b [nH, v, r] (or, in older files, one kv_b)."""
    hidden, nH, r, rope = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, v, q_rank = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
    q_out = nH * (nope + rope)

    def one(gguf: str, hf: str, shape: tuple[int, ...]) -> None:
        expected[b + gguf] = ([(h + hf, shape)], shape)

    if q_rank:
        one("attn_q_a.weight", "q_a_proj.weight", (q_rank, hidden))
        one("attn_q_a_norm.weight", "q_a_layernorm.weight", (q_rank,))
        one("attn_q_b.weight", "q_b_proj.weight", (q_out, q_rank))
    else:
        one("attn_q.weight", "q_proj.weight", (q_out, hidden))
    one("attn_kv_a_mqa.weight", "kv_a_proj_with_mqa.weight", (r + rope, hidden))
    one("attn_kv_a_norm.weight", "kv_a_layernorm.weight", (r,))
    if b + "attn_kv_b.weight" in tensors:
        one("attn_kv_b.weight", "kv_b_proj.weight", (nH * (nope + v), r))
    else:
        one("attn_k_b.weight", "k_b_proj.weight", (nH, r, nope))
        one("attn_v_b.weight", "v_b_proj.weight", (nH, v, r))


def _expected_experts(expected: dict, b: str, h: str, cfg: Any) -> None:
    """A mixture's tensors: the router, each of E experts' rows of the stacked [E, out, in] tensors, and a shared
    expert with its [H] gate where configured."""
    hidden, inter, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    expected[b + "ffn_gate_inp.weight"] = ([(h + "gate.weight", (E, hidden))], (E, hidden))
    if cfg.router_bias:
        expected[b + "ffn_gate_inp.bias"] = ([(h + "gate.bias", (E,))], (E,))
    for n, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
        expected[b + f"ffn_{n}_exps.weight"] = ([(h + f"experts.{e}.{n}_proj.weight", shape) for e in range(E)],
                                               (E, *shape))
        if cfg.expert_bias:
            expected[b + f"ffn_{n}_exps.bias"] = ([(h + f"experts.{e}.{n}_proj.bias", shape[:1]) for e in range(E)],
                                                 (E, shape[0]))
    if cfg.moe_choice_bias:
        expected[b + "exp_probs_b.bias"] = ([(h + "gate.e_score_correction_bias", (E,))], (E,))
    shared = cfg.shared_expert_intermediate_size
    if shared and cfg.shared_expert_gate:
        expected[b + "ffn_gate_inp_shexp.weight"] = ([(h + "shared_expert_gate.weight", (1, hidden))], (1, hidden))
    if shared:
        for n, shape in (("gate", (shared, hidden)), ("up", (shared, hidden)), ("down", (hidden, shared))):
            expected[b + f"ffn_{n}_shexp.weight"] = ([(h + f"shared_expert.{n}_proj.weight", shape)], shape)


def _dequantize(data: np.ndarray, qtype: GGMLQuantizationType, name: str) -> np.ndarray:
    """Dequantize to float32 in row-major element order.

    gguf's dequantize loops in Python over groups of 16 rows; blocks are independent and contiguous, so
    viewing the bytes as longer rows of _DEQUANT_CHUNK_BLOCKS blocks gives the same values ~3x faster.
    """
    if data.dtype == np.uint8:
        type_size = GGML_QUANT_SIZES[qtype][1]
        n_blocks = data.size // type_size
        data = data.reshape(-1, math.gcd(n_blocks, _DEQUANT_CHUNK_BLOCKS) * type_size)
    try:
        return dequantize(data, qtype)
    except NotImplementedError as err:
        raise ValueError(f"tensor {name!r}: cannot dequantize type {qtype.name}") from err


def _unpermute_qk(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's permute(): per head, rows were reordered [2, half] -> [half, 2]."""
    half = weights.shape[0] // n_heads // 2
    return weights.reshape(n_heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _to_torch(weights: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Own the memory (F32 tensors are read-only views of the file's mapping), then cast."""
    if not weights.flags.writeable or not weights.flags.c_contiguous:
        weights = np.array(weights)
    return torch.from_numpy(weights).to(dtype)


__all__ = ["GGUFArch", "read_gguf", "hf_config", "architecture"]
