"""Plain dataclasses for every configuration: the model's shape, sampling, and the engine.

Nothing here imports torch modules or models, so every other module can depend on it.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class SpecdecError(ValueError):
    """A problem with what the user asked for (bad path, bad value); shown without a traceback."""


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q/k/v
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config.json dict; refuses architectures we do not implement."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = hf.get("architectures") or [model_type]
            raise SpecdecError(
                f"unsupported architecture {archs[0]!r} (model_type={model_type!r}); "
                f"specdec supports model_type in {list(SUPPORTED_MODEL_TYPES)}"
            )
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        params = hf.get("rope_parameters")  # transformers >= 5 folds theta and scaling in here
        if params:
            rope_theta = rope_theta or params.get("rope_theta")
            if params.get("rope_type", "default") != "default":
                rope_scaling = rope_scaling or params
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
        )


@dataclass
class SamplingParams:
    """Per-request sampling, named as in vLLM. temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(name: str, value: Any, rule: str) -> SpecdecError:
            return SpecdecError(f"invalid {name}={value!r}: {rule}")

        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", self.temperature, "must be a finite number >= 0 (0 = greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "must be an integer >= 0 (0 or -1 = off)")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", self.seed, "must be an integer or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class EngineConfig:
    """How the engine lays out memory and batches work."""

    block_size: int = 16
    num_kv_blocks: int | None = None  # None: enough for max_num_seqs full-context sequences, capped by memory
    kv_cache_memory_gb: float = 4.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096  # prefill tokens per step
    max_model_len: int | None = None  # None: the model's context length
    enable_prefix_caching: bool = True  # reuse the K/V of full blocks whose token prefix was seen before


HEAD_METHODS = ("eagle", "eagle3", "mtp", "medusa")  # draft heads trained for one target: `model` is their directory
SPECULATIVE_METHODS = ("ngram", "draft_model", "layer_skip", *HEAD_METHODS, "custom")
TREE_METHODS = ("draft_model", "layer_skip", *HEAD_METHODS)
MAX_TREE_NODES = 64


@dataclass(frozen=True)
class SpecShape:
    """What one speculative step drafts per sequence: a chain of k tokens, or a static tree (choice list,
    node order); k = 0 is no speculation."""

    k: int
    tree: tuple[tuple[int, ...], ...] | None = None
    dynamic: tuple[int, int, int] | None = None  # EAGLE-2 (topk, num_steps, num_draft_tokens)

    @property
    def num_tokens(self) -> int:
        """Draft nodes verified per sequence."""
        return self.dynamic[2] if self.dynamic else len(self.tree) if self.tree else self.k

    @property
    def num_slots(self) -> int:
        """KV slots a step writes after the last committed token (a dynamic tree's drafter feeds
        topk * (num_steps - 1) candidates before choosing which to verify)."""
        return max(self.num_tokens, self.dynamic[0] * (self.dynamic[1] - 1)) if self.dynamic else self.num_tokens

    def nodes_within(self, depth: int) -> int:
        """How many nodes lie at most `depth` deep (nodes are in depth order): the draft that can still be
        accepted when only `depth` more tokens may be emitted. Dynamic trees limit their depth themselves."""
        if self.dynamic:
            return self.num_tokens if depth > 0 else 0
        if self.tree is None:
            return max(0, min(self.k, depth))
        return sum(1 for path in self.tree if len(path) <= depth)

    def __str__(self) -> str:
        if self.dynamic:
            return "dynamic(topk={}, num_steps={}, num_draft_tokens={})".format(*self.dynamic)
        return "off" if self.k == 0 else f"tree({len(self.tree)} nodes)" if self.tree else f"chain-{self.k}"


@dataclass
class SpeculativeConfig:
    """vLLM-style `speculative_config`: which drafter, and how many tokens it proposes per step."""

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1  # ngram
    prompt_lookup_max: int = 4  # ngram
    ngram_match: str = "frequent"  # ngram: follow the continuation most occurrences agree on, the "latest" or "oldest"
    ngram_pool: str = "request"  # ngram: look up in the request's own text, or "shared" across requests
    ngram_draft_length: str = "adaptive"  # ngram: "adaptive" (by match length, up to k) or "fixed" (always k)
    ngram_branches: int = 1  # ngram: continuations with different first tokens, drafted as a tree (k nodes in all)
    model: str | None = None  # draft_model: alias, HF directory or .gguf of the draft LM; heads: the head's directory
    num_layers: int | None = None  # layer_skip: how many of the target's first layers draft
    drafter: Any = None  # custom: an object implementing specdec.drafting.Drafter
    # What each step drafts ("shape"): "chain" (k tokens), "chain-K", "off", and for TREE_METHODS a full tree
    # "Dm-BFn" (e.g. "D3-BF2"), a static tree as a choice list [[0], [1], [0, 0], ...] (a node is its path of
    # child ranks: the EAGLE/Medusa format) or, for draft_model / layer_skip, an EAGLE-2 dynamic tree
    # {"topk": 4, "num_steps": 3, "num_draft_tokens": 12}.
    tree: Any = "chain"
    # The tree dispatcher: {"<min batch size>": shape} picks the shape by the step's batch size, e.g.
    # {"1": "D2-BF2", "8": "chain-2", "32": "off"}; batch sizes below the smallest key use `tree`. Or the
    # path of a JSON table written by `specdec tune`.
    dispatch: dict | str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise SpecdecError(f"unknown speculative method {self.method!r}; choose one of {list(SPECULATIVE_METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 15:
            raise SpecdecError(f"invalid num_speculative_tokens={k!r}: must be an integer in [1, 15]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise SpecdecError(f"invalid prompt_lookup_min={self.prompt_lookup_min!r} / prompt_lookup_max="
                               f"{self.prompt_lookup_max!r}: need 1 <= min <= max")
        if self.ngram_match not in ("latest", "oldest", "frequent"):
            raise SpecdecError(f"invalid ngram_match={self.ngram_match!r}: choose 'latest', 'oldest' or 'frequent'")
        if self.ngram_pool not in ("request", "shared"):
            raise SpecdecError(f"invalid ngram_pool={self.ngram_pool!r}: choose 'request' or 'shared'")
        if not isinstance(self.ngram_branches, int) or not 1 <= self.ngram_branches <= 8:
            raise SpecdecError(f"invalid ngram_branches={self.ngram_branches!r}: must be an integer in [1, 8]")
        if self.ngram_draft_length not in ("adaptive", "fixed"):
            raise SpecdecError(f"invalid ngram_draft_length={self.ngram_draft_length!r}: choose 'adaptive' or 'fixed'")
        self.shape = self.parse_shape(self.tree, "tree")
        self.dispatch_table = self._parse_dispatch()
        if self.method in HEAD_METHODS and not self.model:
            raise SpecdecError(f"method {self.method!r} needs 'model': the directory of a {self.method} head "
                               "(config.json + model.safetensors)")
        if self.method == "draft_model" and not self.model:
            raise SpecdecError("method 'draft_model' needs 'model': the draft LM (alias, HF directory or .gguf)")
        if self.method == "layer_skip" and not isinstance(self.num_layers, int):
            raise SpecdecError("method 'layer_skip' needs 'num_layers': how many of the target's layers draft")
        if self.method == "custom" and self.drafter is None:
            raise SpecdecError("method 'custom' needs a 'drafter' object implementing specdec.drafting.Drafter")

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens one step may verify per sequence, whatever the batch size (slots reserved for them)."""
        return max(shape.num_slots for shape in [self.shape, *dict(self.dispatch_table).values()])

    def shape_for(self, batch_size: int) -> "SpecShape":
        """The draft shape for a step of this many sequences: the dispatch entry with the largest minimum
        batch size not above it, else the default shape (`tree`, or a chain of k)."""
        shape = self.shape
        for min_batch, entry in self.dispatch_table:
            if batch_size >= min_batch:
                shape = entry
        return shape

    def parse_shape(self, value: Any, what: str = "tree") -> "SpecShape":
        """A draft shape as `tree` and dispatch entries write it, checked against this method."""
        from specdec.tree import parse_tree_spec, tree_from_choices

        if value == "off":
            return SpecShape(0)
        if value in ("chain", None):
            return SpecShape(self.num_speculative_tokens)
        chain = re.fullmatch(r"chain-(\d+)", value) if isinstance(value, str) else None
        if chain or (isinstance(value, int) and not isinstance(value, bool)):
            k = int(chain[1]) if chain else value
            if not 1 <= k <= 15:
                raise SpecdecError(f"invalid {what} {value!r}: a chain drafts 1 to 15 tokens")
            return SpecShape(k)
        if self.method not in TREE_METHODS:
            raise SpecdecError(f"invalid {what} {value!r}: method {self.method!r} drafts chains only ('chain', "
                               f"'chain-K' or 'off'); trees are available for {list(TREE_METHODS)} (ngram branches with "
                               "'ngram_branches'; a custom drafter returns its own trees)")
        if isinstance(value, dict):
            if self.method in HEAD_METHODS:
                raise SpecdecError(f"invalid {what} {value!r}: dynamic trees are available for draft_model and "
                                   f"layer_skip; {self.method} drafts chains and static trees")
            return self._parse_dynamic(value, what)
        try:
            if isinstance(value, str):
                choices = parse_tree_spec(value)
            elif isinstance(value, list) and all(isinstance(c, list) and all(isinstance(r, int) for r in c)
                                                 for c in value):
                choices = [list(c) for c in value]
            else:
                raise ValueError("expected 'off', 'chain', 'chain-K', a full tree 'Dm-BFn' (e.g. 'D3-BF2'), "
                                 "a choice list such as [[0], [1], [0, 0]] or a dynamic tree "
                                 '{"topk": 4, "num_steps": 3, "num_draft_tokens": 12}')
            tree = tree_from_choices(choices)
        except ValueError as e:
            raise SpecdecError(f"invalid {what} {value!r}: {e}") from None
        if not 1 <= len(choices) <= MAX_TREE_NODES:
            raise SpecdecError(f"invalid {what} {value!r}: it has {len(choices)} nodes; at most "
                               f"{MAX_TREE_NODES} are verified per step")
        return SpecShape(len(choices), tuple(tuple(p) for p in tree.paths))

    @staticmethod
    def _parse_dynamic(value: dict, what: str) -> "SpecShape":
        """EAGLE-2's dynamic tree, with SGLang's knob names."""
        limits = {"topk": (1, 8), "num_steps": (1, 8), "num_draft_tokens": (1, MAX_TREE_NODES)}
        unknown = sorted(set(value) - set(limits))
        if unknown or set(value) != set(limits):
            raise SpecdecError(f"invalid {what} {value!r}: a dynamic tree needs exactly the keys {sorted(limits)}")
        for key, (lo, hi) in limits.items():
            v = value[key]
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise SpecdecError(f"invalid {what}: {key}={v!r} must be an integer in [{lo}, {hi}]")
        return SpecShape(value["num_draft_tokens"], dynamic=(value["topk"], value["num_steps"], value["num_draft_tokens"]))

    def _parse_dispatch(self) -> list[tuple[int, "SpecShape"]]:
        if self.dispatch is None:
            return []
        if isinstance(self.dispatch, str):  # a table written by `specdec tune`
            import json
            from pathlib import Path

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

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a dict (Python) or a JSON string (CLI); None or "off" means no speculation."""
        if value is None or value == "off" or isinstance(value, cls):
            return None if value == "off" else value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise SpecdecError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict) or "method" not in value:
            raise SpecdecError('speculative_config must be an object with a "method", e.g. '
                               '{"method": "ngram", "num_speculative_tokens": 4}')
        return from_kwargs(cls, value)


def from_kwargs(cls: type, kwargs: dict[str, Any]) -> Any:
    """Build a dataclass from a dict, refusing unknown keys with the valid ones listed."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise SpecdecError(f"unknown {cls.__name__} key(s) {unknown}; valid keys: {sorted(names)}")
    return cls(**kwargs)


__all__ = ["SpecdecError", "ModelConfig", "SamplingParams", "EngineConfig", "SpeculativeConfig", "SpecShape", "from_kwargs", "SUPPORTED_MODEL_TYPES"]
