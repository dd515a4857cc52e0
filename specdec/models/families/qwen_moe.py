"""Qwen2-MoE and Qwen3-MoE: the Llama form (Qwen2-MoE with q/k/v bias, Qwen3-MoE with q/k norms) whose MLPs are
mixtures of experts on every `decoder_sparse_step`-th layer but those in `mlp_only_layers`; Qwen2-MoE adds a shared
expert every token takes, gated by sigmoid. The checkpoint's names are the canonical ones."""
from __future__ import annotations

from specdec.config import ModelConfig
from specdec.models.families import Family, rope_fields
from specdec.models.formats.gguf import GGUFArch


def moe_layers(hf: dict, experts: int) -> tuple[int, ...]:
    """The sparse layers, as transformers decides them."""
    step, dense = hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or ())
    return tuple(i for i in range(hf["num_hidden_layers"]) if experts > 0 and i not in dense and (i + 1) % step == 0)


def config(hf: dict) -> ModelConfig:
    qwen2 = hf["model_type"] == "qwen2_moe"
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0  # transformers 5 writes the latter
    return ModelConfig.from_hf(
        hf, **rope_fields(hf),
        attention_bias=bool(hf.get("qkv_bias", hf.get("attention_bias", qwen2))),
        qk_norm=not qwen2,
        num_experts=experts,
        num_experts_per_tok=hf.get("num_experts_per_tok", 0),
        moe_intermediate_size=hf.get("moe_intermediate_size", 0),
        norm_topk_prob=bool(hf.get("norm_topk_prob", not qwen2)),
        moe_layers=moe_layers(hf, experts),
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0) if qwen2 else 0,
    )


FAMILY = Family("qwen_moe", ("qwen2_moe", "qwen3_moe"), config, gguf=(
    GGUFArch("qwen2moe", "qwen2_moe", "Qwen2MoeForCausalLM", attention_bias=True),
    GGUFArch("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM", norm_topk=True),
))
