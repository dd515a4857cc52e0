"""Self-speculation by layer skipping (`layer_skip`): the target's first L layers, final norm and LM head
draft chains, static trees or EAGLE-2 dynamic trees.

No second model and no second cache: the first L layers' K/V of every committed token were written by
the target's own forward and are exactly what the draft would compute, so the draft only feeds the
last committed token and its own drafts (whose K/V the target overwrites when it verifies them).
"""
from __future__ import annotations

from dataclasses import dataclass

from specdec.config import SpecdecError
from specdec.drafting.base import DraftEnv
from specdec.drafting.registry import SpeculativeConfig, register_method
from specdec.drafting.tree_draft import TreeDrafter


@dataclass
class LayerSkipOptions:
    num_layers: int | None = None  # how many of the target's first layers draft

    def __post_init__(self) -> None:
        if not isinstance(self.num_layers, int) or isinstance(self.num_layers, bool):
            raise SpecdecError("method 'layer_skip' needs 'num_layers': how many of the target's layers draft")


@register_method("layer_skip", LayerSkipOptions, trees=True, dynamic_trees=True,
                 runs_target_layers=True)  # the target's first layers: sharded under tensor parallelism
class LayerSkipDrafter(TreeDrafter):
    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, env: DraftEnv) -> LayerSkipDrafter:
        num_layers, total = cfg.options.num_layers, env.target.config.num_hidden_layers
        if not 1 <= num_layers < total:
            raise SpecdecError(f"layer_skip num_layers={num_layers} must be in [1, {total - 1}] for a "
                               f"{total}-layer target")
        return cls(env, env.target, env.target_kv, cfg.num_speculative_tokens, num_layers=num_layers,
                   shares_target_cache=True)
