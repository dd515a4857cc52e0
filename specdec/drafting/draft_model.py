"""Draft/target speculation: a small LM with the target's tokenizer drafts k tokens autoregressively.

Its K/V live in a pool of its own, addressed by the target's block tables, so blocks are reserved,
rewound and freed for both models at once.
"""
from __future__ import annotations

from specdec.config import SpecdecError
from specdec.drafting.tree_draft import TreeDrafter


def check_same_vocabulary(draft_name: str, draft_vocab_size: int, target_vocab_size: int,
                          draft_tokenizer, target_tokenizer) -> None:
    """Speculation compares token ids, so both models must number tokens the same way."""
    if draft_vocab_size != target_vocab_size:
        raise SpecdecError(f"draft model {draft_name!r} has vocab size {draft_vocab_size} but the target has "
                           f"{target_vocab_size}; the draft must use the target's tokenizer")
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise SpecdecError(f"draft model {draft_name!r} has the same vocab size ({draft_vocab_size}) as the target "
                           "but a different tokenizer; the draft must use the target's tokenizer")


class DraftModelDrafter(TreeDrafter):
    """Chains or static trees from a draft LM with its own KV pool (built by the engine: see `build_drafter`)."""
