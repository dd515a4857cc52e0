"""Phi-3 and Phi-4 (mini): the Llama form with q/k/v and gate/up fused in the checkpoint, LongRoPE scaling (its short
factors and attention factor; see `rotary.rope_tables`) and Phi-4-mini's partial rotary factor."""
from __future__ import annotations

from specdec.config import ModelConfig
from specdec.models.families import Family, State, rope_fields, split_rows
from specdec.models.formats.gguf import GGUFArch, KeyReader


def config(hf: dict) -> ModelConfig:
    rope = rope_fields(hf)
    params = hf.get("rope_parameters") or {}
    scaling = rope["rope_scaling"]
    if scaling is not None:
        original = scaling.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
        rope["rope_scaling"] = {**scaling, "original_max_position_embeddings": original}
    return ModelConfig.from_hf(hf, **rope,
                               partial_rotary_factor=float(params.get("partial_rotary_factor")
                                                           or hf.get("partial_rotary_factor") or 1.0))


def state(state: State, hf: dict) -> State:
    cfg = config(hf)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    state = split_rows(state, "self_attn.qkv_proj.weight",
                       {"self_attn.q_proj.weight": q, "self_attn.k_proj.weight": kv, "self_attn.v_proj.weight": kv})
    inter = cfg.intermediate_size
    return split_rows(state, "mlp.gate_up_proj.weight", {"mlp.gate_proj.weight": inter, "mlp.up_proj.weight": inter})


def _gguf_keys(key: KeyReader, config: dict, tensors: dict) -> dict:
    """A stated window slides every layer, as transformers' Phi-3 does (llama.cpp turns Phi's off)."""
    window = key("attention.sliding_window", 0)
    return {"sliding_window": window} if window > 0 else {}


FAMILY = Family("phi3", ("phi3",), config, state,
                gguf=(GGUFArch("phi3", "phi3", "Phi3ForCausalLM", _gguf_keys, window=False),))
