"""Gemma 2 and Gemma 3 (text): GeGLU, a norm before and after both attention and MLP, embeddings times sqrt(H),
queries scaled by query_pre_attn_scalar, sliding and global layers interleaved (Gemma 3's sliding layers on their own
rotary base), soft-capped attention scores and logits (Gemma 2), per-head q/k norms (Gemma 3), and a tied vocabulary.

Gemma's RMSNorm scales by (1 + weight): the 1 is folded into each norm weight on load (llama.cpp's converter does the
same, so a GGUF's norms are already folded)."""
from __future__ import annotations

import math

from specdec.config import FULL, SLIDING, ModelConfig
from specdec.models.families import Family, State, rename, rope_fields
from specdec.models.formats.gguf import GGUFArch, KeyReader, f32, window_layers

# Gemma's layer norms by the decoder's names: its pre-MLP norm is our post_attention_layernorm
_RENAMES = {"post_attention_layernorm.weight": "attn_out_norm.weight",
            "pre_feedforward_layernorm.weight": "post_attention_layernorm.weight",
            "post_feedforward_layernorm.weight": "mlp_out_norm.weight"}
# a Gemma 3 vision-language checkpoint's language model, by transformers 4 and 5 prefixes
_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                  "language_model.lm_head.": "lm_head."}


def _text(hf: dict) -> dict:
    """The language model's config: a Gemma 3 vision-language config's text_config."""
    if hf.get("model_type") == "gemma3":
        return {"model_type": "gemma3_text", **hf.get("text_config", {})}
    return hf


def config(hf: dict) -> ModelConfig:
    text = _text(hf)
    gemma3 = text["model_type"] == "gemma3_text"
    params = text.get("rope_parameters") or {}
    if gemma3 and "full_attention" in params:  # transformers 5: one set per layer type
        rope, local = rope_fields(text, params["full_attention"]), params.get("sliding_attention", {})
        local_theta = float(local.get("rope_theta", 10000.0))
    else:
        rope, local_theta = rope_fields(text), float(text.get("rope_local_base_freq", 10000.0)) if gemma3 else None
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    return ModelConfig.from_hf(
        {**text, "tie_word_embeddings": text.get("tie_word_embeddings", True)},
        **rope,
        hidden_act=text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh",
        sandwich_norms=True,
        embed_scale=math.sqrt(text["hidden_size"]),
        attn_scale=float(text.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        attn_softcap=text.get("attn_logit_softcapping"),
        final_softcap=text.get("final_logit_softcapping"),
        qk_norm=gemma3,
        rope_local_theta=local_theta if gemma3 and SLIDING in (text.get("layer_types") or (SLIDING,)) else None,
    )


def state(state: State, hf: dict) -> State:
    out = {}
    for name, tensor in state.items():
        for old, new in _TEXT_PREFIXES.items():
            if name.startswith(old):
                name = new + name[len(old):]
                break
        else:
            if not name.startswith(("model.", "lm_head.")):  # a vision tower or projector: not the text model's
                continue
        if name.endswith("norm.weight"):
            tensor = tensor.float() + 1.0
        out[name] = tensor
    return rename(out, _RENAMES)


def _gguf_keys(gemma3: bool):
    """Gemma 2 / 3's options from llama.cpp's keys and rules: sliding layers by the window pattern (every 2nd layer
    full for Gemma 2, every 6th for Gemma 3, or the file's own list), the sliding layers' rotary base (Gemma 3:
    10000 unless stated), the query scale 1 / sqrt(head_dim) but for the 27B shapes (1 / sqrt(hidden / heads)), and
    the soft-caps."""
    def keys(key: KeyReader, config: dict, tensors: dict) -> dict:
        n = config["num_hidden_layers"]
        pattern = key("attention.sliding_window_pattern", 6 if gemma3 else 2)
        window = key("attention.sliding_window", 0 if gemma3 else 4096)
        big = n == (62 if gemma3 else 46)  # llama.cpp's 27B rule, unless the file states its scale
        scalar = config["hidden_size"] // config["num_attention_heads"] if big else config["head_dim"]
        if (scale := key("attention.scale", None)) is not None:
            scalar = 1.0 / float(scale) ** 2
        out = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
               "final_logit_softcapping": f32(key("final_logit_softcapping", 0.0)) or None,
               "sliding_window": window or None,
               "layer_types": window_layers(pattern, n, lambda i: pattern == 0 or i % pattern < pattern - 1)
               if window else [FULL] * n}
        if gemma3:
            full = {"rope_type": "default", "rope_theta": config["rope_theta"], **(config["rope_scaling"] or {})}
            out["rope_parameters"] = {"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": f32(key("rope.freq_base_swa", 10000.0))}}
        else:
            out["attn_logit_softcapping"] = f32(key("attn_logit_softcapping", 0.0)) or None
        return out
    return keys


FAMILY = Family("gemma", ("gemma2", "gemma3_text", "gemma3"), config, state, gguf=(
    GGUFArch("gemma2", "gemma2", "Gemma2ForCausalLM", _gguf_keys(gemma3=False), window=False),
    GGUFArch("gemma3", "gemma3_text", "Gemma3ForCausalLM", _gguf_keys(gemma3=True), window=False),
))
