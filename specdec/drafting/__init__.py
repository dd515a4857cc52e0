"""Drafting methods, one file each, behind the `Drafter` interface."""
from __future__ import annotations

from specdec.config import SpecdecError, SpeculativeConfig
from specdec.drafting.base import Draft, DraftRequest, Drafter
from specdec.drafting.ngram import NgramDrafter


def build_drafter(cfg: SpeculativeConfig) -> Drafter:
    if cfg.method == "ngram":
        return NgramDrafter(cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max,
                            cfg.ngram_match)
    if cfg.method == "custom":
        if not callable(getattr(cfg.drafter, "propose", None)):
            raise SpecdecError("the custom drafter must have a propose(requests) -> Draft method")
        return cfg.drafter
    raise SpecdecError(f"speculative method {cfg.method!r} is not available")  # pragma: no cover


__all__ = ["Draft", "DraftRequest", "Drafter", "NgramDrafter", "build_drafter"]
