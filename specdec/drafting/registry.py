"""The drafting methods' registry and `speculative_config`.

Each method's own file registers itself (`register_method`: its name, options dataclass, what it can do), and
this package's `__init__` imports every file of the package before anything can look a method up: importing
`SpeculativeConfig` from here is what fills the registry, so no lookup depends on what was imported first.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.config import SpecdecError
from specdec.tree import parse_shape


@dataclass(frozen=True)
class MethodInfo:
    """A drafting method as `speculative_config` knows it. Each method's own file registers one (see
    `specdec/drafting/`), so adding a method touches no other file. Everything the engine, the server or
    `specdec tune` treat differently per method is a field here: none of them names a method."""

    name: str
    options: type  # the dataclass of the method's own keys: defaults, validation and errors in its __post_init__
    build: Callable[..., Any]  # (SpeculativeConfig, DraftEnv) -> the method's Drafter
    trees: bool = False  # drafts static trees (full trees, choice lists) besides chains
    dynamic_trees: bool = False  # drafts EAGLE-2 dynamic trees
    head: type | None = None  # a draft head trained for one target: its model class (`specdec train --method`)
    # Drafts with the target's own layers (self-speculation): refused under tensor parallelism, which splits
    # those layers across processes while drafters run on rank 0 alone (`check_tensor_parallel`).
    runs_target_layers: bool = False
    # Its drafters come from outside specdec (a user's object): every draft is checked (`Draft.validate`) and a
    # malformed one refused by name. Ours are built valid and skip the check.
    validate_drafts: bool = False
    # Its own keys that are a least acceptance chance worth verifying a node for: `specdec tune` sets those the
    # user left out to the measured cost of verifying one more token, in plain steps (`bench.verify_cost`).
    verify_cost_keys: tuple[str, ...] = ()
    # Its head may live inside the target's own files (MTP layers after the main ones): a config that names no
    # `model` reads it from there (`LLM` fills `model` with the target's files).
    head_in_model: bool = False

    def check_tensor_parallel(self, tensor_parallel_size: int) -> None:
        """Refuse, naming the fix, a method that cannot draft beside a target split over that many processes."""
        if tensor_parallel_size > 1 and self.runs_target_layers:
            raise SpecdecError(f"speculative method {self.name!r} runs the target's own layers, which tensor "
                               "parallelism splits across processes; use another method, or tensor_parallel_size=1")


_METHODS: dict[str, MethodInfo] = {}


def register_method(name: str, options: type, *, trees: bool = False, dynamic_trees: bool = False,
                    head: type | None = None, runs_target_layers: bool = False, validate_drafts: bool = False,
                    verify_cost_keys: tuple[str, ...] = (), head_in_model: bool = False) -> Callable[[Any], Any]:
    """Class decorator of a drafting method: `{"method": name, ...}` then builds it with the class's
    `from_config(cfg, env)` (or calls the decorated function so). The keywords declare what it can do (see
    `MethodInfo`). Registering a name again replaces it."""
    if not dataclasses.is_dataclass(options):
        raise TypeError(f"the options of method {name!r} must be a dataclass, got {options!r}")
    own = {f.name for f in dataclasses.fields(options)}
    if not set(verify_cost_keys) <= own:
        raise TypeError(f"verify_cost_keys {sorted(set(verify_cost_keys) - own)} of method {name!r} are not keys "
                        f"of {options.__name__}")

    def register(target: Any) -> Any:
        _METHODS[name] = MethodInfo(name, options, getattr(target, "from_config", target), trees, dynamic_trees, head,
                                    runs_target_layers, validate_drafts, tuple(verify_cost_keys), head_in_model)
        return target

    return register


def method_info(name: str) -> MethodInfo:
    if name not in _METHODS:
        raise SpecdecError(f"unknown speculative method {name!r}; choose one of {registered_methods()}")
    return _METHODS[name]


def registered_methods(head: bool = False) -> list[str]:
    """The method names `speculative_config` accepts (head=True: only trainable draft heads)."""
    return sorted(name for name, info in _METHODS.items() if info.head is not None or not head)


@dataclass
class SpeculativeConfig:
    """vLLM-style `speculative_config`: which drafter, and how many tokens it proposes per step.

    The keys every method shares are fields here; a method's own keys (`model`, `prompt_lookup_max`, ...)
    live in its registered options dataclass, `options`. `parse` takes vLLM's flat dict and splits it."""

    method: str
    num_speculative_tokens: int = 4
    # What each step drafts ("shape"), in the grammar of `specdec.tree`: "chain" (k tokens), "chain-K", "off",
    # and for methods that draft trees a full tree "Dm-BFn" (e.g. "D3-BF2"), a static tree as a choice list
    # [[0], [1], [0, 0], ...] (a node is its path of child ranks: the EAGLE/Medusa format) or an EAGLE-2
    # dynamic tree {"topk": 4, "num_steps": 3, "num_draft_tokens": 12}.
    tree: Any = "chain"
    # The tree dispatcher: {"<min batch size>": shape} picks the shape by the step's batch size, e.g.
    # {"1": "D2-BF2", "8": "chain-2", "32": "off"}; batch sizes below the smallest key use `tree`. Or the
    # path of a JSON table written by `specdec tune`.
    dispatch: dict | str | None = None
    # Structured output: up to this many tokens of text a request's grammar forces are drafted per step
    # (jump-forward drafting; they extend or replace the drafter's chain); 0 or false: off, true: 8
    jump_forward: int | bool = 8
    # Whether the cost model (`specdec.engine.cost`) decides, per step and request, how much of the shape is worth
    # verifying (none where drafts do not pay); false: every step drafts the whole shape (a drafter measured alone)
    adaptive: bool = True
    # Whether sampled requests draft too (false: only greedy ones do; a step of sampled requests alone is plain)
    sampled: bool = True
    # How sampled requests' drafts are verified. "keyed": against the target's own sample at each position, keyed by
    # the request's seed and the position, so the output is plain decoding's, token for token, whatever was drafted
    # (the same seed gives the same text with speculation on or off, any drafter, any batch). "rejection":
    # multi-round rejection sampling with the draft's q (the same distribution; the tokens depend on the drafts).
    sampled_verification: str = "keyed"
    options: Any = None  # the method's own keys (its options dataclass); None: the method's defaults

    def __post_init__(self) -> None:
        info = method_info(self.method)
        if self.options is None:
            self.options = info.options()
        elif not isinstance(self.options, info.options):
            raise SpecdecError(f"method {self.method!r} takes options of type {info.options.__name__}, "
                               f"got {type(self.options).__name__}")
        if isinstance(self.jump_forward, bool):
            self.jump_forward = 8 if self.jump_forward else 0
        if not isinstance(self.jump_forward, int) or not 0 <= self.jump_forward <= 15:
            raise SpecdecError(f"invalid jump_forward={self.jump_forward!r}: an integer in [0, 15] (tokens of "
                               "forced text per step), or true / false")
        if not isinstance(self.sampled, bool):
            raise SpecdecError(f"invalid sampled={self.sampled!r}: must be true or false")
        if self.sampled_verification not in ("keyed", "rejection"):
            raise SpecdecError(f"invalid sampled_verification={self.sampled_verification!r}: \"keyed\" (the output "
                               "equals plain decoding's for the same seed) or \"rejection\"")
        if not isinstance(self.adaptive, bool):
            raise SpecdecError(f"invalid adaptive={self.adaptive!r}: must be true or false")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 15:
            raise SpecdecError(f"invalid num_speculative_tokens={k!r}: must be an integer in [1, 15]")
        self.shape = self.parse_shape(self.tree, "tree")
        self.dispatch_table = self._parse_dispatch()

    @property
    def info(self) -> MethodInfo:
        return method_info(self.method)

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens one step may verify per sequence, whatever the batch size (slots reserved for them)."""
        return max(shape.num_slots for shape in self.shapes())

    @property
    def num_slots(self) -> int:
        """KV slots a decode step reserves per sequence: the drafter's largest shape, or forced text."""
        return max(self.num_draft_tokens, self.jump_forward)

    def shapes(self) -> list[Any]:
        """Every draft shape this config may use: the default one and the dispatch table's."""
        return [self.shape, *dict(self.dispatch_table).values()]

    def shape_for(self, batch_size: int) -> Any:
        """The draft shape (`tree.SpecShape`) for a step of this many sequences: the dispatch entry with the
        largest minimum batch size not above it, else the default shape (`tree`, or a chain of k)."""
        shape = self.shape
        for min_batch, entry in self.dispatch_table:
            if batch_size >= min_batch:
                shape = entry
        return shape

    def parse_shape(self, value: Any, what: str = "tree") -> Any:
        """A draft shape as `tree` and dispatch entries write it, checked against what this method drafts
        (the grammar itself is `specdec.tree.parse_shape`)."""
        trees = [n for n, m in _METHODS.items() if m.trees]
        dynamic = [n for n, m in _METHODS.items() if m.dynamic_trees]
        try:
            return parse_shape(value, self.num_speculative_tokens, what, self.method, trees, dynamic)
        except ValueError as e:
            raise SpecdecError(str(e)) from None

    def _parse_dispatch(self) -> list[tuple[int, Any]]:
        if self.dispatch is None:
            return []
        if isinstance(self.dispatch, str):  # a table written by `specdec tune`
            path = Path(self.dispatch).expanduser()
            try:
                loaded = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise SpecdecError(f"cannot read the dispatch table {path}: {e}") from None
            self.dispatch = loaded.get("dispatch", loaded) if isinstance(loaded, dict) else loaded
        if not isinstance(self.dispatch, dict) or not self.dispatch:
            raise SpecdecError('invalid dispatch: expected an object {"<min batch size>": shape, ...}, e.g. '
                               '{"1": "D2-BF2", "8": "chain-2", "32": "off"}')
        table = []
        for key, value in self.dispatch.items():
            try:
                min_batch = int(key)
            except (TypeError, ValueError):
                min_batch = 0
            if min_batch < 1:
                raise SpecdecError(f"invalid dispatch key {key!r}: must be a batch size >= 1")
            table.append((min_batch, self.parse_shape(value, f"dispatch[{key!r}]")))
        return sorted(table)

    def to_dict(self) -> dict[str, Any]:
        """The flat vLLM-style dict that `parse` reads back."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "options"}
        return {**shared, **{f.name: getattr(self.options, f.name) for f in dataclasses.fields(self.options)}}

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a flat dict (Python) or a JSON string (CLI); None or "off" means no speculation."""
        if value is None or value == "off" or isinstance(value, cls):
            return None if value == "off" else value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise SpecdecError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict) or "method" not in value:
            raise SpecdecError('speculative_config must be an object with a "method", e.g. '
                               '{"method": "ngram", "num_speculative_tokens": 4}')
        info = method_info(value["method"])
        shared = [f.name for f in dataclasses.fields(cls) if f.name != "options"]
        own = [f.name for f in dataclasses.fields(info.options)]
        unknown = sorted(set(value) - set(shared) - set(own))
        if unknown:
            raise SpecdecError(f"unknown key(s) {unknown} for speculative method {info.name!r}; valid keys: "
                               f"{sorted(shared + own)}")
        options = info.options(**{k: v for k, v in value.items() if k in own})
        return cls(**{k: v for k, v in value.items() if k in shared}, options=options)


__all__ = ["MethodInfo", "SpeculativeConfig", "method_info", "register_method", "registered_methods"]
