"""Self-speculation with a low-bit copy of the target (`quantized_self`): the target's own matrices, quantized
to a 4-bit block format, draft chains, static trees or EAGLE-2 dynamic trees with a KV pool of their own.

The copy reads about a quarter of a float32 target's bytes per token (and 60% of a Q8_0 one's), predicts
what the target would say far more often than a separate small model can, and needs no training (CPU
self-speculation with a low-bit copy: ipex-llm, ML-SpecQD). It pays when the target is wider than the copy;
a target that is already Q4 gains nothing from a Q4 copy of itself.
"""
from __future__ import annotations

from dataclasses import dataclass

from specdec.config import SpecdecError
from specdec.drafting.base import DraftEnv, check_quantization_name
from specdec.drafting.registry import SpeculativeConfig, register_method
from specdec.drafting.tree_draft import TreeDrafter
from specdec.models.quantize import quantized_copy


@dataclass
class QuantizedSelfOptions:
    quantization: str = "q4_0"  # the copy's block format

    def __post_init__(self) -> None:
        check_quantization_name(self.quantization, "quantized_self")


@register_method("quantized_self", QuantizedSelfOptions, trees=True, dynamic_trees=True,
                 runs_target_layers=True)  # a copy of the target's own (under tensor parallelism, sharded) layers
class QuantizedSelfDrafter(TreeDrafter):
    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, env: DraftEnv) -> QuantizedSelfDrafter:
        try:
            copy = quantized_copy(env.target, cfg.options.quantization)
        except ValueError as e:
            raise SpecdecError(f"method 'quantized_self': {e}") from None
        return cls(env, copy, env.kv_pool(copy.config, copy.kv_dtype), cfg.num_speculative_tokens)
