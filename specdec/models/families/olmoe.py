"""OLMoE: the Llama form with one RMSNorm over all of q and one over all of k (not per head), q/k/v clamped at
clip_qkv where set, and every MLP a mixture of experts (top-8 of 64, probabilities not renormalized by default)."""
from __future__ import annotations

from specdec.config import ModelConfig
from specdec.models.families import Family, rope_fields
from specdec.models.formats.gguf import GGUFArch


def config(hf: dict) -> ModelConfig:
    return ModelConfig.from_hf(
        hf, **rope_fields(hf), qk_norm_full=True, clip_qkv=hf.get("clip_qkv"),
        num_experts=hf.get("num_experts") or hf["num_local_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=tuple(range(hf["num_hidden_layers"])))


FAMILY = Family("olmoe", ("olmoe",), config, gguf=(GGUFArch("olmoe", "olmoe", "OlmoeForCausalLM"),))
