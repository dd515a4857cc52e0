"""Self-speculation by layer skipping: the target's first L layers, final norm and LM head draft k tokens.

No second model and no second cache: the first L layers' K/V of every committed token were written by
the target's own forward and are exactly what the draft would compute, so the draft only feeds the
last committed token and its own drafts (whose K/V the target overwrites when it verifies them).
"""
from __future__ import annotations

from specdec.config import SpecdecError
from specdec.drafting.tree_draft import TreeDrafter


class LayerSkipDrafter(TreeDrafter):
    def __init__(self, target_runner, num_speculative_tokens: int, num_layers: int) -> None:
        self.check_layers(target_runner.model, num_layers)
        super().__init__(target_runner, num_speculative_tokens, num_layers=num_layers, shares_target_cache=True)

    @staticmethod
    def check_layers(model, num_layers: int) -> None:
        total = model.config.num_hidden_layers
        if not 1 <= num_layers < total:
            raise SpecdecError(f"layer_skip num_layers={num_layers} must be in [1, {total - 1}] for a "
                               f"{total}-layer target")
