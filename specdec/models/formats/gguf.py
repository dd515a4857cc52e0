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

# GGUF architecture -> the Hugging Face model_type whose family reads it (a llama file with experts is Mixtral's)
_MODEL_TYPE = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
               "gemma3": "gemma3_text", "phi3": "phi3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
               "olmoe": "olmoe", "deepseek2": "deepseek_v2", "gpt-oss": "gpt_oss"}
SUPPORTED_ARCHITECTURES = tuple(_MODEL_TYPE)
_HF_ARCHITECTURE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                    "phi3": "Phi3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                    "olmoe": "OlmoeForCausalLM", "mixtral": "MixtralForCausalLM",
                    "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                    "gpt_oss": "GptOssForCausalLM"}
# llama.cpp's routers renormalize their top-k weights for these (build_moe_ffn's norm_w), not for the others
_NORM_TOPK = ("llama", "qwen3moe")

# llama.cpp's convert_hf_to_gguf.py interleaves the rotary halves of Q and K for these architectures only.
_PERMUTED_QK = ("llama", "mistral")

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
_QK_NORM_TENSORS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
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


def read_gguf(path: str | os.PathLike, config_of: Callable[[dict], ModelConfig], dtype: torch.dtype = torch.float32,
              keep_blocks: bool = False) -> tuple[dict, dict[str, torch.Tensor | QuantWeight]]:
    """Read a GGUF file; return (hf_config, state_dict) shaped like a Hugging Face checkpoint. config_of: the
    decoder's shape for a config.json dict (its family's rules), which says what tensors the file must hold.

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
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {list(SUPPORTED_ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    config = _hf_config(reader, arch, tensors)
    expected = _expected_tensors(config_of(config), tensors)
    state_dict = {}
    mtp_blocks = tuple(f"blk.{i}." for i in range(config["num_hidden_layers"], _field(reader, f"{arch}.block_count")))
    for name, tensor in tensors.items():
        if name in _ROPE_TENSORS or name.startswith(mtp_blocks):  # rope scaling is in the config; MTP layers
            continue  # are a draft head's (`head_gguf`)
        if name not in expected:
            raise ValueError(f"unexpected tensor {name!r} in {path} for architecture {arch!r}")
        parts, hf_shape = expected.pop(name)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if shape != hf_shape:
            raise ValueError(f"tensor {name!r} has shape {list(shape)}, expected {list(hf_shape)} from the metadata")
        permuted = arch in _PERMUTED_QK and name.endswith(("attn_q.weight", "attn_k.weight"))
        heads = config["num_attention_heads"] if "attn_q" in name else config["num_key_value_heads"]
        if keep_blocks and tensor.tensor_type not in _FLOAT_TYPES and all(len(p[1]) == 2 for p in parts):
            if tensor.tensor_type not in BY_GGML:
                f32, size = float32_bytes(reader), os.path.getsize(path)
                raise ValueError(
                    f"tensor {name!r} is {tensor.tensor_type.name}, which the native quantized runtime does not "
                    f"compute on (it does {', '.join(f.upper() for f in FORMATS)}); dequantizing the whole model "
                    f"instead costs {f32 / 1e9:.2f} GB in float32 ({f32 / size:.1f}x the file's {size / 1e9:.2f} GB "
                    "read per token; dtype='bfloat16' halves it)")
            rows, first = tensor.data.reshape(-1, tensor.data.shape[-1]), 0
            for hf_name, part in parts:
                weights = QuantWeight.from_mapping(rows[first:first + part[0]], tensor.tensor_type, part[1])
                first += part[0]
                if permuted:
                    order = _unpermute_qk(np.arange(part[0]), heads)
                    weights = weights.permute_rows(torch.from_numpy(order))
                state_dict[hf_name] = weights
            continue
        weights = _dequantize(tensor.data, tensor.tensor_type, name).reshape(shape)
        if permuted:
            weights = _unpermute_qk(weights, heads)
        rows, first = weights.reshape(-1, *parts[0][1][1:]) if len(parts) > 1 else weights, 0
        for hf_name, part in parts:  # a whole tensor, or its rows split (fused q/k/v, gate/up, experts)
            piece = rows[first:first + part[0]] if len(parts) > 1 else rows.reshape(part)
            first += part[0]
            state_dict[hf_name] = _to_torch(piece, torch.float32 if keep_blocks else dtype)
    if expected:
        raise ValueError(f"missing tensor {next(iter(expected))!r} in {path} ({len(expected)} missing in all)")
    return config, state_dict


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


def _f32(value: float) -> float:
    """GGUF stores floats as f32; the shortest repr gives back the config.json value (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _hf_config(reader: GGUFReader, arch: str, tensors: dict) -> dict:
    """The file's config as a Hugging Face config.json would state it, for the family that reads `arch`."""
    def key(suffix: str, default: Any = _REQUIRED) -> Any:
        return _field(reader, f"{arch}.{suffix}", default)

    if "token_embd.weight" not in tensors:
        raise ValueError("missing tensor 'token_embd.weight'")
    hidden = key("embedding_length")
    heads = key("attention.head_count")
    head_dim = key("attention.key_length", None) or hidden // heads  # as llama.cpp: rope.dimension_count is the
    rope_theta = _f32(key("rope.freq_base", 10000.0))  # rotated part (Phi-4-mini's is 3/4 of the head)
    layers = key("block_count") - key("nextn_predict_layers", 0)  # MTP layers count in block_count
    config = {
        "model_type": _MODEL_TYPE[arch],
        "architectures": [_HF_ARCHITECTURE[_MODEL_TYPE[arch]]],
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length", 0),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(reader, arch, tensors, rope_theta, head_dim),
        "max_position_embeddings": key("context_length", 4096),
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch in ("qwen2", "qwen2moe", "gpt-oss"),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", None),
    }
    if (rotary := key("rope.dimension_count", head_dim)) != head_dim:  # RoPE on part of each head (Phi-4-mini)
        config["partial_rotary_factor"] = rotary / head_dim
    experts = key("expert_count", 0)
    if experts:  # Mixtral (a llama file with experts), Qwen2/3-MoE, OLMoE: llama.cpp's MoE keys
        if arch == "llama":
            config.update(model_type="mixtral", architectures=[_HF_ARCHITECTURE["mixtral"]])
        config.update(num_experts=experts, num_experts_per_tok=key("expert_used_count"),
                      moe_intermediate_size=key("expert_feed_forward_length", 0) or config["intermediate_size"],
                      shared_expert_intermediate_size=key("expert_shared_feed_forward_length", 0),
                      norm_topk_prob=arch in _NORM_TOPK, decoder_sparse_step=1,
                      mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors])
        if not config["intermediate_size"]:
            config["intermediate_size"] = config["moe_intermediate_size"]
    if (clamp := key("attention.clamp_kqv", None)) is not None:  # OLMoE's clip_qkv (llama.cpp's key for it)
        config["clip_qkv"] = _f32(clamp)
    if arch == "deepseek2":
        config.update(_deepseek(reader, config, tensors))
        config.pop("partial_rotary_factor", None)  # the rotated part is its own width (qk_rope_head_dim)
    elif arch in ("gemma2", "gemma3"):
        config.update(_gemma(reader, arch, config))
    elif arch == "gpt-oss":  # llama.cpp's rule: every even layer slides (unless the file lists them)
        pattern = key("attention.sliding_window_pattern", None)
        config.update(sliding_window=key("attention.sliding_window"), layer_types=[
            SLIDING if (pattern[i] if pattern is not None else i % 2 == 0) else FULL for i in range(layers)])
        if config["rope_scaling"]:  # gpt-oss's YaRN ramp is not cut to whole dimensions (its config's truncate:
            config["rope_scaling"]["truncate"] = False  # false), which the file does not say and ggml always does
        if (clamp := key("swiglu_clamp_exp", None)) is not None:  # the SwiGLU limit where not llama.cpp's 7
            config["swiglu_limit"] = _f32(clamp[0] if isinstance(clamp, list) else clamp)
    elif arch != "phi3" and (window := key("attention.sliding_window", 0)) > 0:  # a Mistral or Qwen window, where
        pattern = key("attention.sliding_window_pattern", None)  # a file states it (llama.cpp reads none for these)
        config.update(sliding_window=window, layer_types=[
            SLIDING if pattern is None or pattern[i] else FULL for i in range(layers)])
    elif arch == "phi3":
        if (window := key("attention.sliding_window", 0)) > 0:
            config["sliding_window"] = window  # every layer, as transformers' Phi-3 (llama.cpp turns Phi's off)
    return config


def _gemma(reader: GGUFReader, arch: str, config: dict) -> dict:
    """Gemma 2 / 3's options from llama.cpp's keys and rules: sliding layers by the window pattern (every 2nd layer
    full for Gemma 2, every 6th for Gemma 3, or the file's own list), the sliding layers' rotary base (Gemma 3:
    10000 unless stated), the query scale 1 / sqrt(head_dim) but for the 27B shapes (1 / sqrt(hidden / heads)), and
    the soft-caps."""
    def key(suffix: str, default: Any = _REQUIRED) -> Any:
        return _field(reader, f"{arch}.{suffix}", default)

    n, gemma3 = config["num_hidden_layers"], arch == "gemma3"
    pattern = key("attention.sliding_window_pattern", 6 if gemma3 else 2)
    window = key("attention.sliding_window", 0 if gemma3 else 4096)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern][:n]
    else:
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(n)]
    big = n == (62 if gemma3 else 46)  # llama.cpp's 27B rule, unless the file states its scale
    scalar = config["hidden_size"] // config["num_attention_heads"] if big else config["head_dim"]
    if (scale := key("attention.scale", None)) is not None:
        scalar = 1.0 / float(scale) ** 2
    out = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
           "final_logit_softcapping": _f32(key("final_logit_softcapping", 0.0)) or None,
           "sliding_window": window or None,
           "layer_types": [SLIDING if s and window else FULL for s in sliding]}
    if gemma3:
        full = {"rope_type": "default", "rope_theta": config["rope_theta"], **(config["rope_scaling"] or {})}
        out["rope_parameters"] = {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": _f32(key("rope.freq_base_swa", 10000.0))}}
    else:
        out["attn_logit_softcapping"] = _f32(key("attn_logit_softcapping", 0.0)) or None
    return out


def _deepseek(reader: GGUFReader, config: dict, tensors: dict) -> dict:
    """DeepSeek-V2/V3's options from llama.cpp's deepseek2 keys: the latent ranks and head widths (the *_mla keys of
    files with the absorbed k_b / v_b pair, the plain ones before), the leading dense layers, the shared experts and
    the router (sigmoid gating or a correction bias: V3's; weights scale and norm; expert groups), YaRN's
    log multiplier (written as 0.1 * mscale_all_dim)."""
    def key(suffix: str, default: Any = _REQUIRED) -> Any:
        return _field(reader, f"deepseek2.{suffix}", default)

    rope = key("rope.dimension_count")
    qk = key("attention.key_length_mla", None) or key("attention.key_length")
    experts = key("expert_count", 0)
    v3 = key("expert_gating_func", 1) == 2 or any(n.endswith("exp_probs_b.bias") for n in tensors)
    out = {"model_type": "deepseek_v3" if v3 else "deepseek_v2",
           "architectures": [_HF_ARCHITECTURE["deepseek_v3" if v3 else "deepseek_v2"]],
           "kv_lora_rank": key("attention.kv_lora_rank"), "q_lora_rank": key("attention.q_lora_rank", 0) or None,
           "qk_rope_head_dim": rope, "qk_nope_head_dim": qk - rope,
           "v_head_dim": key("attention.value_length_mla", None) or key("attention.value_length"),
           "first_k_dense_replace": key("leading_dense_block_count", 0),
           "n_routed_experts": experts or None, "n_shared_experts": key("expert_shared_count", 0),
           "moe_intermediate_size": key("expert_feed_forward_length", 0),
           "routed_scaling_factor": _f32(key("expert_weights_scale", 1.0)),
           "norm_topk_prob": bool(key("expert_weights_norm", False)),
           "scoring_func": "sigmoid" if key("expert_gating_func", 1) == 2 else "softmax",
           "rope_interleave": True}
    groups = key("expert_group_count", 0)
    if groups > 1:
        out.update(n_group=groups, topk_group=key("expert_group_used_count"), topk_method="group_limited_greedy")
    scaling = config["rope_scaling"]
    if scaling and scaling.get("rope_type") == "yarn" and (log_mul := key("rope.scaling.yarn_log_multiplier", 0.0)):
        mscale = _f32(log_mul / 0.1)
        out["rope_scaling"] = {**scaling, "mscale": mscale, "mscale_all_dim": mscale}
    return out


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
            scaling["attention_factor"] = _f32(attn)
        return scaling
    kind = _field(reader, prefix + "type", None)
    if kind not in (None, "none"):
        scaling = {"rope_type": kind}
        for suffix, hf_key in _ROPE_SCALING_KEYS.items():
            if (value := _field(reader, prefix + suffix, None)) is not None:
                scaling[hf_key] = _f32(value) if isinstance(value, float) else value
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


__all__ = ["read_gguf", "SUPPORTED_ARCHITECTURES"]
