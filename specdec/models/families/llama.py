"""Llama 2/3 and SmolLM2, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k norms): the Llama form itself, with a sliding
window on the layers the config makes slide (`ModelConfig.from_hf`)."""
from __future__ import annotations

from specdec.config import SUPPORTED_MODEL_TYPES, ModelConfig
from specdec.models.families import Family
from specdec.models.formats.gguf import GGUFArch, KeyReader


def _llama_keys(key: KeyReader, config: dict, tensors: dict) -> dict:
    """A llama file with experts is Mixtral's (llama.cpp writes Mixtral as llama)."""
    return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]} if config.get("num_experts") else {}


FAMILY = Family("llama", SUPPORTED_MODEL_TYPES, ModelConfig.from_hf, gguf=(
    GGUFArch("llama", "llama", "LlamaForCausalLM", _llama_keys, norm_topk=True, permuted_qk=True),
    GGUFArch("mistral", "mistral", "MistralForCausalLM", permuted_qk=True),
    GGUFArch("qwen2", "qwen2", "Qwen2ForCausalLM", attention_bias=True),
    GGUFArch("qwen3", "qwen3", "Qwen3ForCausalLM"),
))
