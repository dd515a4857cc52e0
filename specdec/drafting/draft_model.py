"""Draft/target speculation (`draft_model`): a small LM with the target's tokenizer drafts chains, static
trees or EAGLE-2 dynamic trees.

Its K/V live in a pool of its own, addressed by the target's block tables, so blocks are reserved,
rewound and freed for both models at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.config import SpecdecError
from specdec.drafting.base import DraftEnv, check_quantization_name
from specdec.drafting.registry import SpeculativeConfig, register_method
from specdec.drafting.tree_draft import TreeDrafter
from specdec.models.loader import QUANTIZATIONS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class DraftModelOptions:
    model: str | None = None  # the draft LM: alias, Hugging Face directory or .gguf
    # None: as the target (a quantized target runs a GGUF draft on its own blocks, anything else in the target's
    # dtype); 'gguf' or a format to quantize the draft on load (one of `quant.FORMATS`, e.g. 'q8_0', 'q4_0').
    quantization: str | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise SpecdecError("method 'draft_model' needs 'model': the draft LM (alias, HF directory or .gguf)")
        check_quantization_name(self.quantization, "draft_model", QUANTIZATIONS)


def check_same_vocabulary(draft_name: str, draft_vocab_size: int, target_vocab_size: int,
                          draft_tokenizer: PreTrainedTokenizerBase, target_tokenizer: PreTrainedTokenizerBase) -> None:
    """Speculation compares token ids, so both models must number tokens the same way."""
    if draft_vocab_size != target_vocab_size:
        raise SpecdecError(f"draft model {draft_name!r} has vocab size {draft_vocab_size} but the target has "
                           f"{target_vocab_size}; the draft must use the target's tokenizer")
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise SpecdecError(f"draft model {draft_name!r} has the same vocab size ({draft_vocab_size}) as the target "
                           "but a different tokenizer; the draft must use the target's tokenizer")


@register_method("draft_model", DraftModelOptions, trees=True, dynamic_trees=True)
class DraftModelDrafter(TreeDrafter):
    """Chains or trees from a draft LM with its own KV pool."""

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, env: DraftEnv) -> DraftModelDrafter:
        from specdec.models.loader import load_model, load_tokenizer

        name, target = cfg.options.model, env.target
        quantization = cfg.options.quantization
        dtype = "auto" if quantization or target.quantization else target.dtype
        draft, src = load_model(name, dtype, target.device, quantization)
        check_same_vocabulary(name, draft.config.vocab_size, target.config.vocab_size, load_tokenizer(src),
                              env.tokenizer)
        return cls(env, draft, env.kv_pool(draft.config, draft.kv_dtype), cfg.num_speculative_tokens)
