"""Drafting methods, one file each, behind the `Drafter` interface."""
from __future__ import annotations

from specdec.config import SpecdecError, SpeculativeConfig
from specdec.drafting.base import Draft, DraftRequest, Drafter
from specdec.drafting.draft_model import DraftModelDrafter, check_same_vocabulary
from specdec.drafting.eagle import EagleDrafter
from specdec.drafting.layer_skip import LayerSkipDrafter
from specdec.drafting.ngram import NgramDrafter
from specdec.drafting.tree_draft import TreeDrafter


def build_drafter(cfg: SpeculativeConfig, target_runner, tokenizer) -> Drafter:
    """target_runner: the engine's ModelRunner (its model, KV pool and block allocator)."""
    k = cfg.num_speculative_tokens
    if cfg.method == "draft_model":
        from specdec.models.loader import load_model, load_tokenizer

        target = target_runner.model
        draft, src = load_model(cfg.model, target.dtype, target.device)
        check_same_vocabulary(cfg.model, draft.config.vocab_size, target.config.vocab_size,
                              load_tokenizer(src), tokenizer)
        return DraftModelDrafter(target_runner.sibling(draft), k)
    if cfg.method == "layer_skip":
        return LayerSkipDrafter(target_runner, k, cfg.num_layers)
    if cfg.method == "eagle3":
        from specdec.models.eagle3 import Eagle3Head

        target = target_runner.model
        return EagleDrafter(Eagle3Head.load(cfg.model, target.config, target.dtype, target.device), target_runner, k)
    if cfg.method in ("eagle", "mtp"):
        from specdec.models.eagle import EagleHead

        return EagleDrafter(EagleHead.load(cfg.model, target_runner.model, cfg.method), target_runner, k)
    if cfg.method == "medusa":
        from specdec.drafting.medusa import MedusaDrafter, check_depth
        from specdec.models.medusa import MedusaHeads

        target = target_runner.model
        heads = MedusaHeads.load(cfg.model, target.config, target.lm_head, target.dtype, target.device)
        check_depth(cfg, heads.num_heads, cfg.model)
        return MedusaDrafter(heads, target_runner, k)
    if cfg.method == "ngram":
        return NgramDrafter(cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max,
                            cfg.ngram_match, cfg.ngram_pool,
                            adaptive=cfg.ngram_draft_length == "adaptive", branches=cfg.ngram_branches)
    if cfg.method == "custom":
        if not callable(getattr(cfg.drafter, "propose", None)):
            raise SpecdecError("the custom drafter must have a propose(requests) -> Draft method")
        return cfg.drafter
    raise SpecdecError(f"speculative method {cfg.method!r} is not available")  # pragma: no cover


__all__ = ["Draft", "DraftRequest", "Drafter", "EagleDrafter", "NgramDrafter", "DraftModelDrafter", "LayerSkipDrafter",
           "TreeDrafter", "build_drafter"]
