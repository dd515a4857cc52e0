"""Llama 2/3 and SmolLM2, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k norms): the Llama form itself, with a sliding
window on the layers the config makes slide (`ModelConfig.from_hf`)."""
from __future__ import annotations

from specdec.config import SUPPORTED_MODEL_TYPES, ModelConfig
from specdec.models.families import Family

FAMILY = Family("llama", SUPPORTED_MODEL_TYPES, ModelConfig.from_hf)
