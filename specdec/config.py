"""Plain dataclasses for the configurations every layer reads: the model's shape, sampling, structured output and
the engine. (Speculation's config lives with the drafting methods that fill its registry: `specdec.drafting.registry`.)

Nothing here imports torch modules or models, so every other module can depend on it.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The dense Llama-shaped families `ModelConfig.from_hf` reads alone; the others (`specdec.models.families`) build on it.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
FULL, SLIDING = "full_attention", "sliding_attention"  # HF's layer_types


CACHE_ENV = "SPECDEC_CACHE"


def cache_root() -> Path:
    """Where specdec keeps what it builds or converts once (kernel builds, tokenizers, retrieval datastores,
    distillation chunks): $SPECDEC_CACHE, else ~/.cache/specdec."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "specdec").expanduser()


class SpecdecError(ValueError):
    """A problem with what the user asked for (bad path, bad value); shown without a traceback."""


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder: the Llama form (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) and how the other families
    (`specdec.models.families`) differ from it, each a field whose default is Llama's."""

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
    # Attention per layer: FULL or SLIDING (each query sees its last `sliding_window` keys); None: every layer full.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' own rotary base, unscaled
    partial_rotary_factor: float = 1.0  # Phi-4-mini: RoPE on the first part of each head only
    # the gated MLP's activation: silu, gelu_pytorch_tanh (Gemma's GeGLU), or swigluoai (gpt-oss: the gate clamped
    # above and the up half both ways at swiglu_limit, gate * sigmoid(swiglu_alpha * gate) * (up + 1))
    hidden_act: str = "silu"
    sandwich_norms: bool = False  # Gemma 2/3: a norm after attention and around the MLP too (four per layer)
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # Gemma: query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5)
    attn_softcap: float | None = None  # Gemma 2: scores become cap * tanh(score / cap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    qk_norm_full: bool = False  # OLMoE: one RMSNorm over all of q (and of k), not per head
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to +-clip
    # Mixture of experts (no moe_layers: every MLP dense): which layers are sparse, the router's top-k, expert widths.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize the top-k router probabilities to sum to 1
    moe_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token takes, gated by sigmoid
    shared_expert_gate: bool = True  # the shared expert's sigmoid gate (Qwen2-MoE); DeepSeek's shared experts have none
    # How the router weighs experts (DeepSeek): softmax or sigmoid scores; the top-k chosen within the `moe_topk_groups`
    # best of `moe_groups` groups (a group scored by its best expert under softmax, its best two under sigmoid) and by
    # score plus a per-expert correction bias where the checkpoint has one (`moe_choice_bias`, DeepSeek-V3); weights
    # times routed_scaling_factor.
    moe_scoring: str = "softmax"
    moe_groups: int = 1
    moe_topk_groups: int = 1
    moe_choice_bias: bool = False
    routed_scaling_factor: float = 1.0
    # Multi-head latent attention (DeepSeek-V2/V3; kv_lora_rank > 0): queries through an optional q_lora_rank
    # bottleneck, keys and values from one kv_lora_rank latent per token plus a shared qk_rope_head_dim rotated key.
    # The cache holds the latent and the rotated key (num_key_value_heads 1, head_dim kv_lora_rank + qk_rope_head_dim:
    # the decoding form with the up-projections absorbed); rope_interleave: the rotated dims pair (2i, 2i + 1).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # gpt-oss: a learned sink logit per head in each attention softmax, a bias on the output projection, on the
    # router's logits and on every expert's projections, and its clamped SwiGLU (hidden_act swigluoai)
    attn_sinks: bool = False
    o_proj_bias: bool = False
    # MTP layers in the model's files past its main ones (DeepSeek-V3's `num_nextn_predict_layers`): not part of the
    # target, a draft head (`{"method": "mtp"}`) the default speculation drafts with
    num_mtp_layers: int = 0
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def identity(self) -> dict[str, Any]:
        """The fields that name this shape (what a fingerprint hashes): the Llama form's always, a family option only
        where it differs from its default, so a Llama-form model keeps the name it had before the options existed."""
        fields = dataclasses.fields(self)
        first_option = next(i for i, f in enumerate(fields) if f.name == "layer_types")
        return {f.name: getattr(self, f.name) for i, f in enumerate(fields) if f.name != "num_mtp_layers" and
                (i < first_option or getattr(self, f.name) != f.default)}  # MTP layers: a head's, not the shape

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window, 0 for a layer that sees every key."""
        if self.layer_types is None or self.layer_types[layer] != SLIDING:
            return 0
        return int(self.sliding_window)

    @property
    def rotary_dim(self) -> int:
        """The leading dimensions of each head that RoPE rotates (all of them but for a partial factor; MLA: the
        decoupled rotated part)."""
        if self.kv_lora_rank:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor) // 2 * 2

    @property
    def v_cache_dim(self) -> int:
        """The width of each cached value head: head_dim, or 0 under MLA (its values are the cached latent, read from
        the key cache)."""
        return 0 if self.kv_lora_rank else self.head_dim

    def __post_init__(self) -> None:
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= {FULL, SLIDING}:
                raise SpecdecError(f"layer_types must name {FULL!r} or {SLIDING!r} for each of the "
                                   f"{self.num_hidden_layers} layers; got {list(self.layer_types)}")
            if SLIDING in self.layer_types:
                w = self.sliding_window
                if not isinstance(w, int) or isinstance(w, bool) or w < 1:
                    raise SpecdecError(f"sliding_window={w!r}: sliding-window layers need a positive window")
                if w > self.max_position_embeddings:
                    raise SpecdecError(f"sliding_window={w} is larger than the context (max_position_embeddings="
                                       f"{self.max_position_embeddings}): not a window any position can reach")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh", "swigluoai"):
            raise SpecdecError(f"unsupported hidden_act {self.hidden_act!r}; supported: silu, gelu_pytorch_tanh, "
                               "swigluoai")
        if self.moe_scoring not in ("softmax", "sigmoid"):
            raise SpecdecError(f"unsupported expert scoring {self.moe_scoring!r}; supported: softmax, sigmoid")
        if self.moe_groups < 1 or self.num_experts % self.moe_groups or not 0 < self.moe_topk_groups <= self.moe_groups:
            raise SpecdecError(f"expert groups: n_group={self.moe_groups} must divide the {self.num_experts} experts "
                               f"and topk_group={self.moe_topk_groups} be in [1, n_group]")
        if self.kv_lora_rank and (self.num_key_value_heads != 1 or
                                  self.head_dim != self.kv_lora_rank + self.qk_rope_head_dim):
            raise SpecdecError("latent attention caches one head of kv_lora_rank + qk_rope_head_dim")
        if self.moe_layers and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise SpecdecError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
                               f"{self.num_experts}]")

    @classmethod
    def from_hf(cls, hf: dict[str, Any], **family: Any) -> ModelConfig:
        """Build from a Hugging Face config.json dict; refuses architectures we do not implement. `family`: the fields
        a family other than the dense four sets (`specdec.models.families`, which checks its own model_type)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES and not family:
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
        fields = dict(
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
            layer_types=_layer_types(hf),
            sliding_window=hf.get("sliding_window"),
        )
        fields.update(family)
        if fields["layer_types"] is None or SLIDING not in fields["layer_types"]:  # no window: the Llama form's None
            fields.update(layer_types=None, sliding_window=None)
        return cls(**fields)


def _layer_types(hf: dict[str, Any]) -> tuple[str, ...] | None:
    """Which layers slide, as transformers decides: `layer_types` where the config lists them; else Mistral's (and
    Phi-3's, Mixtral's) `sliding_window` on every layer, and Qwen's `use_sliding_window` from layer
    `max_window_layers` on."""
    n, window = hf["num_hidden_layers"], hf.get("sliding_window")
    if hf.get("layer_types") is not None:
        types = tuple(hf["layer_types"])
        return types if window is not None or SLIDING not in types else None
    if window is None:
        return None
    if "use_sliding_window" in hf:
        if not hf["use_sliding_window"]:
            return None
        first = hf.get("max_window_layers", n)
        return tuple(SLIDING if i >= first else FULL for i in range(n))
    return (SLIDING,) * n


@dataclass
class StructuredOutput:
    """A constraint on a request's output (vLLM's `StructuredOutputsParams`): exactly one of a JSON schema
    (dict or JSON text), any JSON object, a regex, a grammar (EBNF/GBNF, or Lark when `grammar_syntax` says
    so), a choice among strings, or a structural tag (xgrammar's and vLLM's format: tagged segments such as
    tool calls, each `{"type": "tag", "begin", "content", "end"}`, their JSON schema contents enforced; how tool
    calling is constrained). Compiled by `specdec.structured.grammar`, which names what is wrong in a bad one."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    grammar_syntax: str = "ebnf"  # or "lark"
    choice: list[str] | None = None
    structural_tag: dict | str | None = None

    KINDS = ("json", "json_object", "regex", "grammar", "choice", "structural_tag")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise SpecdecError(f"structured_output needs exactly one of {list(self.KINDS)}; got "
                               f"{given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise SpecdecError("structured_output.json must be a JSON schema: a dict or its JSON text")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (dict, str)):
            raise SpecdecError("structured_output.structural_tag must be a structural tag: a dict or its JSON text")
        if self.json_object not in (True, False):
            raise SpecdecError("structured_output.json_object must be true or false")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SpecdecError(f"structured_output.{name} must be a non-empty string")
        if self.grammar_syntax not in ("ebnf", "lark"):
            raise SpecdecError(f"structured_output.grammar_syntax={self.grammar_syntax!r}: use 'ebnf' or 'lark'")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise SpecdecError("structured_output.choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


GREEDY_BELOW = 1e-5  # a temperature under this samples greedily
MAX_LOGPROBS = 20  # alternatives per token, OpenAI's limit


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
    structured_output: StructuredOutput | dict | None = None  # a dict holds StructuredOutput's fields
    # Part of the target's distribution at every position, draft positions included (`sampling.penalize`):
    # logit_bias is added to the logits; repetition_penalty divides a positive logit (multiplies a negative one) of
    # every token in the prompt or the output so far; frequency_penalty subtracts count x penalty and
    # presence_penalty subtracts the penalty once, for every token in the output so far (OpenAI's definitions).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    # Each generated token's log-probability and this many most likely alternatives (0-20), from the target's own
    # distribution at that position (its logits before penalties, bias and temperature: vLLM's default), the same
    # whether the token was drafted and verified or decoded plainly. None: not computed.
    logprobs: int | None = None
    # The same for every prompt token after the first (OpenAI's `echo` with logprobs, how evaluation harnesses
    # score log-likelihoods): computed in the prefill, so such a prompt is prefilled whole, never served from the
    # prefix cache.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_output, dict):
            self.structured_output = from_kwargs(StructuredOutput, self.structured_output)
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise SpecdecError("structured_output must be a StructuredOutput or a dict of its fields "
                               "(json, json_object, regex, grammar, choice)")
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

        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not -2 <= value <= 2:
                raise bad(name, value, "must be a number in [-2, 2]")
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or isinstance(rp, bool) or not math.isfinite(rp) or rp <= 0:
            raise bad("repetition_penalty", rp, "must be a finite number > 0 (1 = off)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, value, f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                    not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.logit_bias):
                raise bad("logit_bias", self.logit_bias, "must map token ids (integers >= 0) to biases")
            if any(not isinstance(b, (int, float)) or isinstance(b, bool) or not -100 <= b <= 100
                   for b in self.logit_bias.values()):
                raise bad("logit_bias", self.logit_bias, "biases must be numbers in [-100, 100]")

    @property
    def penalized(self) -> bool:
        """Whether logit_bias or a penalty changes the target's logits."""
        return bool(self.logit_bias) or bool(self.presence_penalty) or bool(self.frequency_penalty) or \
            self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small that dividing logits by it overflows (vLLM's 1e-5 as well): argmax."""
        return self.temperature < GREEDY_BELOW


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
    enforce_eager: bool = False  # on a GPU: no CUDA graphs, every forward eager (as on CPU)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise SpecdecError(f"invalid {name}={value!r}: must be a positive integer")
        if not self.kv_cache_memory_gb > 0:
            raise SpecdecError(f"invalid kv_cache_memory_gb={self.kv_cache_memory_gb!r}: must be positive")


def from_kwargs(cls: type, kwargs: dict[str, Any]) -> Any:
    """Build a dataclass from a dict, refusing unknown keys with the valid ones listed."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise SpecdecError(f"unknown {cls.__name__} key(s) {unknown}; valid keys: {sorted(names)}")
    return cls(**kwargs)


__all__ = ["SpecdecError", "ModelConfig", "SamplingParams", "StructuredOutput", "EngineConfig", "from_kwargs",
           "SUPPORTED_MODEL_TYPES"]
