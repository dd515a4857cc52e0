"""Drafting methods, one file each, behind the `Drafter` interface.

Every module of this package is imported here, so the methods it defines register themselves
(`specdec.drafting.registry.register_method`): a new method is a new file, and nothing else changes.
"""
from __future__ import annotations

import importlib
import pkgutil

from specdec.drafting.base import Draft, DraftEnv, Drafter, DraftRequest, ForwardClock, HeadOptions
from specdec.drafting.registry import MethodInfo, SpeculativeConfig, method_info, register_method, registered_methods

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def build_drafter(cfg: SpeculativeConfig, env: DraftEnv) -> Drafter:
    """The drafter of `cfg.method`, built by the method's own file."""
    return cfg.info.build(cfg, env)


__all__ = ["Draft", "DraftEnv", "DraftRequest", "Drafter", "ForwardClock", "HeadOptions", "MethodInfo",
           "SpeculativeConfig", "build_drafter", "method_info", "register_method", "registered_methods"]
