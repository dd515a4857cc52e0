"""User drafters (`custom`): any object implementing `Drafter`, passed in Python as
`speculative_config={"method": "custom", "drafter": obj}`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec.config import SpecdecError
from specdec.drafting.base import DraftEnv, Drafter
from specdec.drafting.registry import SpeculativeConfig, register_method


@dataclass
class CustomOptions:
    drafter: Any = None  # an object implementing specdec.drafting.Drafter

    def __post_init__(self) -> None:
        if self.drafter is None:
            raise SpecdecError("method 'custom' needs a 'drafter' object implementing specdec.drafting.Drafter")


@register_method("custom", CustomOptions, validate_drafts=True)  # a user's drafts are checked
def custom_drafter(cfg: SpeculativeConfig, env: DraftEnv) -> Drafter:
    drafter = cfg.options.drafter
    if not isinstance(drafter, Drafter):  # the engine also calls release, cached_prefix, feature_layers
        raise SpecdecError(f"the custom drafter must be a specdec.drafting.Drafter (subclass it and implement "
                           f"propose(requests) -> Draft), got {type(drafter).__name__}")
    return drafter
