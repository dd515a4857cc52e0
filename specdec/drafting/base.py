"""The one interface every drafting method implements.

Each step the engine tells the drafter what was committed since its last call and asks for a draft:

    tokens  [B, N]  long   proposed tokens
    parents [B, N]  long   -1 = child of the last committed token, -2 = padding; a chain is arange(N) - 1
    probs   [B, N, V]      the distribution q each token was drawn from, or None for deterministic
                           proposals (n-gram, greedy), which verification treats as q = one-hot

A chain is a tree, so trees need no second code path.

What a drafter sees is plain data, never the engine: per step a `DraftRequest` for each sequence, and once,
when its method builds it, a `DraftEnv` with the target model, the shared block geometry, `inputs`, the
one way to lay tokens out over the paged cache, and `clock`, which times its model's forwards. Adding a method
means adding one file here that defines its options dataclass and its Drafter and registers them
(`specdec.drafting.registry.register_method`).
"""
from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from specdec.config import ModelConfig, SamplingParams, SpecdecError
from specdec.kv_cache import KVPool
from specdec.models.blocks.attention import AttentionMetadata
from specdec.models.formats.quant import QUANTIZE_ON_LOAD
from specdec.models.llama import LlamaModel
from specdec.models.quantize import quantize_module
from specdec.tree import PAD, ROOT, TreeFeed

# inputs(tables, starts, feeds, trees) -> tokens [T], positions [T], metadata: feed feeds[i] into the slots
# starts[i].. of the sequence owning KV blocks tables[i], causally or in the layout trees[i] (see TreeFeed).
Inputs = Callable[[list[list[int]], list[int], list[list[int]], "list[TreeFeed | None] | None"],
                  tuple[torch.Tensor, torch.Tensor, AttentionMetadata]]


class ForwardClock:
    """Seconds a drafter spends in its model's forwards (a draft model's or a head's layers and LM head), apart
    from the host-side work around them: a drafter that runs a model wraps each call, `with env.clock: ...`, and
    the engine reads `seconds` around each draft (its step accounting). Two perf_counter calls a forward; nested
    uses count once. With `sync` set (on a GPU) the device is waited for on both sides, so the time is the
    forward's own rather than its launch."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.sync: Callable[[], None] | None = None
        self._depth, self._start = 0, 0.0

    def __enter__(self) -> None:
        self._depth += 1
        if self._depth == 1:
            if self.sync is not None:
                self.sync()
            self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            if self.sync is not None:
                self.sync()
            self.seconds += time.perf_counter() - self._start


@dataclass
class DraftEnv:
    """What the engine lends a drafting method when it is built: the frozen target (its config, embedding,
    final norm, LM head, and first layers for self-speculation) with its KV pool, the tokenizer, the
    geometry of the KV blocks every model shares, and `inputs` (`kv_cache.paged_inputs` bound to that block
    size and the target's device: a plain function, not the engine's)."""

    target: LlamaModel
    target_kv: KVPool
    tokenizer: Any
    num_blocks: int
    block_size: int
    inputs: Inputs
    pools: list[KVPool] = field(default_factory=list)  # every pool over the shared blocks (the allocator's)
    tensor_parallel_size: int = 1  # processes the target is split over (a method that nests others checks them)
    clock: ForwardClock = field(default_factory=ForwardClock)  # times the drafter's model forwards

    def kv_pool(self, config: ModelConfig, dtype: torch.dtype) -> KVPool:
        """A KV pool of the drafter's own over the shared blocks, addressed by the target's block tables, so
        blocks are reserved, rewound and freed for both at once."""
        pool = KVPool(config, self.num_blocks, self.block_size, dtype, self.target.device)
        self.pools.append(pool)
        return pool

    def run(self, model: LlamaModel, kv: KVPool, tables: list[list[int]], starts: list[int],
            feeds: list[list[int]], trees: list[TreeFeed | None] | None = None,
            num_layers: int | None = None) -> torch.Tensor:
        """Feed a Llama-family model (a draft LM, or the target's first layers); hidden states [T, H]."""
        tokens, positions, meta = self.inputs(tables, starts, feeds, trees)
        with self.clock:
            return model(tokens, positions, meta, kv, num_layers=num_layers)[0]

    def logits(self, model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """A draft model's (or head's) logits of hidden states [N, H] -> [N, V], timed as part of its forward."""
        with self.clock:
            return model.compute_logits(hidden)


@dataclass
class DraftRequest:
    """What one sequence's drafter sees this step: plain values, copied or read-only."""

    seq_id: int
    token_ids: list[int]  # the whole committed sequence (prompt + output)
    num_new: int  # how many of its last tokens were committed since the drafter's last call
    max_tokens: int  # the most draft tokens this step may verify (k, or fewer near the length limit)
    params: SamplingParams | None = None  # the request's sampling (drafters that sample use its temperature...)
    generator: torch.Generator | None = None  # its seeded generator, if any (rejection sampling's draws)
    # Keyed verification (`SpeculativeConfig.sampled_verification`): a drafter that samples draws the token at output
    # position `position + j` with `sampling.sampling_key(sampling_seed, position + j)` on its own q, as the target
    # draws there (a coupling: where q is close to p the two agree). None: it samples with `generator`.
    sampling_seed: int | None = None
    position: int = 0  # the output position of the first draft token
    block_table: list[int] | None = None  # its KV blocks, in order: slot of position p = table[p // bs] * bs + p % bs
    num_cached: int = 0  # leading tokens whose target K/V are in the cache
    num_prefix_hit: int = 0  # of those, tokens reused from the prefix cache at admission (draft K/V came too)
    epoch: int = 0  # bumps when the sequence is preempted: every K/V of it, drafts' included, is gone
    tree: tuple[tuple[int, ...], ...] | None = None  # the static tree asked for (choice list); None: a chain
    dynamic: tuple[int, int, int] | None = None  # or an EAGLE-2 dynamic tree: (topk, num_steps, num_draft_tokens)
    max_depth: int | None = None  # the deepest draft worth verifying (tokens the request may still emit - 1)
    # What verifying one more row costs this step, in plain steps of this request (the engine's measured costs,
    # `specdec.engine.cost`): a drafter sizing its own drafts weighs a node against it. None: nothing measured.
    row_cost: float | None = None
    # What this request's share of a plain step takes this step, in seconds (the cost model's plain step of the batch
    # over its size): a drafter weighing its own drafting time converts it into plain steps with it. None: unknown.
    plain_seconds: float | None = None
    # For drafters with `feature_layers`: the target's features (those layers' outputs, concatenated) of the
    # tokens committed since the last call, one row per token from token index `features_start` on. The
    # last committed token has none yet (the target computes it when it feeds that token next step). After a
    # prefix-cache hit the first call starts at the hit (`num_prefix_hit`): the cached blocks' features are
    # not recomputed, and the drafter's K/V over them (see `cached_prefix`) came from the cache.
    features: torch.Tensor | None = None
    features_start: int = 0
    # For a drafter that `drafts_first`: the speculator cuts this draft to the rows its plan takes, from what drafts of
    # the same `Draft.evidence` kept, so the drafter proposes all of `max_tokens` it finds rather than its own cut.
    sized_by_plan: bool = False


class Draft:
    """A step's proposals: tokens and parents [B, N] (padded), optionally probs [B, N, V] and scores [B, N]. A
    draft made from host lists (`from_rows`: chains, n-gram and suffix branches) keeps them and builds its tensors
    only when asked: the engine reads the lists (`host_rows`), and right after a forward every small tensor
    operation costs tens of microseconds."""

    def __init__(self, tokens: torch.Tensor | None = None, parents: torch.Tensor | None = None,
                 probs: torch.Tensor | None = None, scores: torch.Tensor | None = None, *,
                 rows: list[tuple[list[int], list[int]]] | None = None) -> None:
        self._tokens, self._parents = tokens, parents  # [B, N] long each
        self.probs = probs  # [B, N, V]
        # optional: the drafter's own estimate that each node is accepted [B, N] (suffix and retrieval give the
        # share of the continuations that went that way); the hybrid tree weighs sources by it
        self.scores = scores
        # optional, per sequence: what its proposal rests on (the n-gram's match length), a hashable key; drafts of
        # one evidence keep alike, so the cost model tracks acceptance per evidence (None: no key)
        self.evidence: list[Hashable] | None = None
        # optional, per sequence: other chains it could verify instead of its row, each with its evidence (a drafter
        # over several sources that draft first: `switch`); the speculator verifies the one its rates price highest
        self.alternatives: list[list[tuple[list[int], Hashable]]] | None = None
        self._rows = rows  # per sequence (tokens, parents), unpadded; valid until the tensors are handed out

    @property
    def tokens(self) -> torch.Tensor:
        self._materialize()
        return self._tokens

    @property
    def parents(self) -> torch.Tensor:
        self._materialize()
        return self._parents

    def _materialize(self) -> None:
        """Build the padded tensors from the host lists; from then on the tensors are the draft (a caller may
        change them in place), so the lists are dropped."""
        if self._rows is None:
            return
        rows, self._rows = self._rows, None
        B, N = len(rows), max((len(t) for t, _ in rows), default=0)
        self._tokens = torch.tensor([[*t, *[0] * (N - len(t))] for t, _ in rows], dtype=torch.long).view(B, N)
        self._parents = torch.tensor([[*p, *[PAD] * (N - len(p))] for _, p in rows], dtype=torch.long).view(B, N)

    def host_rows(self) -> tuple[list[list[int]], list[list[int]]]:
        """Each sequence's node tokens and parents as host lists, without padding (read-only)."""
        if self._rows is not None:
            return [t for t, _ in self._rows], [p for _, p in self._rows]
        tokens, parents = self._tokens.tolist(), self._parents.tolist()
        counts = [len(row) - row.count(PAD) for row in parents]  # padding only follows a row's nodes
        return [row[:n] for row, n in zip(tokens, counts)], [row[:n] for row, n in zip(parents, counts)]

    @classmethod
    def chains(cls, proposals: list[list[int]]) -> Draft:
        """Deterministic chains of different lengths, padded to the longest."""
        return cls.branches([[p] for p in proposals])

    @classmethod
    def branches(cls, proposals: list[list[list[int]]]) -> Draft:
        """Deterministic trees made of chains hanging from the last committed token (one list of chains per
        sequence; a single chain is a plain chain)."""
        rows = []
        for chains in proposals:
            tokens, parents = [], []
            for chain in chains:
                for j, t in enumerate(chain):
                    parents.append(ROOT if j == 0 else len(tokens) - 1)
                    tokens.append(t)
            rows.append((tokens, parents))
        return cls.from_rows(rows)

    @classmethod
    def from_rows(cls, rows: list[tuple[list[int], list[int]] | tuple[list[int], list[int], list[float]]]
                  ) -> Draft:
        """Deterministic trees given as (tokens, parents) or (tokens, parents, scores) per sequence, padded to
        the largest (scores are kept when every row has them)."""
        draft = cls(rows=[(list(r[0]), list(r[1])) for r in rows])
        if rows and all(len(r) == 3 for r in rows):
            B, N = len(rows), max(len(r[0]) for r in rows)
            draft.scores = torch.tensor([[*r[2], *[0.0] * (N - len(r[2]))] for r in rows]).view(B, N)
        return draft

    def spread(self, rows: list[int], batch_size: int) -> Draft:
        """This draft's rows as rows `rows` of a batch of `batch_size`, the others empty."""
        if rows == list(range(batch_size)):
            return self
        if self._rows is not None and self.probs is None and self.scores is None:  # host lists stay host lists
            spread: list[tuple[list[int], list[int]]] = [([], []) for _ in range(batch_size)]
            for i, row in zip(rows, self._rows):
                spread[i] = row
            out = Draft(rows=spread)
        else:
            out = self._spread_tensors(rows, batch_size)
        if self.evidence is not None:
            out.evidence = [None] * batch_size
            for i, e in zip(rows, self.evidence):
                out.evidence[i] = e
        if self.alternatives is not None:
            out.alternatives = [[] for _ in range(batch_size)]
            for i, a in zip(rows, self.alternatives):
                out.alternatives[i] = a
        return out

    def _spread_tensors(self, rows: list[int], batch_size: int) -> Draft:
        B, N = batch_size, self.tokens.shape[1]
        out = Draft(torch.zeros(B, N, dtype=torch.long), torch.full((B, N), PAD, dtype=torch.long))
        out.tokens[rows], out.parents[rows] = self.tokens, self.parents
        if self.probs is not None:
            out.probs = self.probs.new_zeros(B, N, self.probs.shape[-1])
            out.probs[rows] = self.probs
        if self.scores is not None:
            out.scores = self.scores.new_zeros(B, N)
            out.scores[rows] = self.scores
        return out

    def validate(self, batch_size: int, vocab_size: int) -> None:
        """Refuse a malformed draft (e.g. from a user's drafter) with a message naming what is wrong."""
        t, p = self.tokens, self.parents
        if not isinstance(t, torch.Tensor) or not isinstance(p, torch.Tensor):
            raise SpecdecError("a Draft's tokens and parents must be torch tensors")
        if t.dim() != 2 or t.shape[0] != batch_size or p.shape != t.shape:
            raise SpecdecError(f"draft tokens {tuple(t.shape)} and parents {tuple(p.shape)} must both be "
                               f"[batch={batch_size}, N]")
        if t.dtype != torch.long or p.dtype != torch.long:
            raise SpecdecError("draft tokens and parents must be torch.long")
        if t.numel() and any(int(v) < 0 or int(v) >= vocab_size for v in torch.aminmax(t)):
            raise SpecdecError(f"draft token ids must be in [0, {vocab_size})")
        real = p != PAD
        if bool((real[:, 1:] > real[:, :-1]).any() | (real & ((p < ROOT) | (p >= torch.arange(p.shape[1])))).any()):
            raise SpecdecError("draft parents must be -1 (the last committed token) or the index of an earlier "
                               "node, with padding (-2) only after a row's last node")
        if self.scores is not None and tuple(self.scores.shape) != tuple(t.shape):
            raise SpecdecError(f"draft scores {tuple(self.scores.shape)} must be [batch, N] = {tuple(t.shape)}")
        if self.probs is not None and tuple(self.probs.shape) != (*t.shape, vocab_size):
            raise SpecdecError(f"draft probs {tuple(self.probs.shape)} must be [batch, N, vocab] = "
                               f"{(*t.shape, vocab_size)}")

    def num_nodes(self) -> list[int]:
        return (self.parents != PAD).sum(1).tolist()


@dataclass
class HeadOptions:
    """The keys of every draft-head method: the head's directory, and the block format its matrices compute in
    (one of `quant.FORMATS`, e.g. 'q8_0', 'q4_0', 'q4_k': the native int8 kernels on CPU). "auto" (the default):
    q8_0 when the target itself computes on quantized blocks on CPU (measured on the shipped EAGLE-3 head: the same
    acceptance per position as float32, its draft step 0.68 ms instead of 1.27 ms), else the head's float weights;
    "none": float weights always."""

    model: str | None = None
    quantization: str | None = "auto"
    method: ClassVar[str] = "a draft"

    def __post_init__(self) -> None:
        if not self.model:
            raise SpecdecError(f"method {self.method!r} needs 'model': the directory of a {self.method} head "
                               "(config.json + model.safetensors)")
        check_quantization_name(self.quantization, self.method, ("auto", "none", *QUANTIZE_ON_LOAD))

    def quantize(self, head: torch.nn.Module, target: torch.nn.Module) -> None:
        """Quantize the head's matrices into the chosen format (with "auto", by what the target computes on)."""
        fmt = self.quantization
        if fmt == "auto":
            on_blocks = target.device.type == "cpu" and getattr(target, "quantization", None) is not None
            fmt = "q8_0" if on_blocks else None
        if fmt and fmt != "none":
            quantize_module(head, fmt)


def check_int(name: str, value: object, low: int, high: int) -> None:
    """An integer option (not a bool) in [low, high], or a SpecdecError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise SpecdecError(f"invalid {name}={value!r}: must be an integer in [{low}, {high}]")


def check_number(name: str, value: object, low: float, high: float, open_low: bool = False) -> None:
    """A number option (not a bool) in [low, high] (or (low, high] with open_low), or a SpecdecError naming it."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value <= high \
        and (value > low if open_low else value >= low)
    if not ok:
        raise SpecdecError(f"invalid {name}={value!r}: must be a number in {'(' if open_low else '['}{low}, {high}]")


def check_quantization_name(name: str | None, method: str, choices: tuple[str, ...] | list[str] = QUANTIZE_ON_LOAD
                            ) -> None:
    if name is not None and name not in choices:
        raise SpecdecError(f"method {method!r}: unknown quantization {name!r}; choose one of {list(choices)}")


class Drafter(ABC):
    """Proposes draft tokens; never decides what is emitted (verification does)."""

    feature_layers: tuple[int, ...] = ()  # target decoder layers whose outputs this drafter reads (EAGLE)
    observe_topk: int = 0  # > 0: after each verification, `observe` gets the target's top-k next tokens
    observe_drafts: bool = False  # True: after each verification, `observe_draft` gets its guess after every node
    # True when its K/V at slot t also encode token t + 1 (EAGLE pairs the target's feature of token t with the
    # embedding of token t + 1): the prefix cache then reuses a block only before the same next token.
    cache_reads_next_token: bool = False
    # A drafter over a trained head that can take another one while serving (`reload_head`), and that head's path.
    reloads_head: bool = False
    head_path: str | None = None
    # Set by whoever weighs nodes from several drafters (the hybrid): a drafter that knows its own belief in a node
    # (a head's probability of the path) then gives it as `Draft.scores`; otherwise it saves building them.
    path_scores: bool = False
    # True for a drafter that chooses per request and step how much to draft from what its drafts kept (switch): the
    # speculator's single token while a request's recent acceptance is low, made for one drafter's drafts, would
    # cut the long drafts it chose for the steps where they pay (its pauses after failed drafts still apply).
    sizes_own_drafts: bool = False
    # True for a drafter whose proposals are cheap host work that say what they rest on (`Draft.evidence`): each step
    # the speculator asks it first for every request's whole budget (`DraftRequest.sized_by_plan`), then plans the
    # rows from what drafts of the same evidence kept. A request with no draft then costs no plan, and a long match
    # is priced as one (on the default model's Spec-Bench outputs, an n-gram draft after a 4-token match keeps its
    # first token 82% of the time, after a 1-token match 29%; unconditioned, the plan saw their mix). Its draft may
    # offer each request other chains to choose from (`Draft.alternatives`).
    drafts_first: bool = False

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> Draft:
        """A draft for every request (a request may get zero nodes)."""

    def catch_up(self, requests: list[DraftRequest]) -> None:
        """With `feature_layers`: take the target features these requests carry (rows of steps that drafted
        nothing) without drafting for them, so the drafter's own K/V follows each sequence: the prefix cache shares
        a block only where the drafter's K/V holds it too (`cached_prefix`). By default it drafts one token for each
        and drops it."""
        self.propose([dataclasses.replace(r, max_tokens=1) for r in requests])

    def reload_head(self, path: str) -> None:
        """With `reloads_head`: draft with the head in `path` from the next call on, loaded and prepared as the
        first one was (quantized alike). A head of another method or shape raises a SpecdecError naming what
        differs, and the current head keeps drafting. Called between steps only."""
        raise SpecdecError(f"{type(self).__name__} has no draft head to reload")

    def release(self, seq_id: int) -> None:
        """The sequence finished or was aborted: drop any state kept for it."""

    def observe(self, seq_id: int, tokens: list[int], candidates: list[list[int]]) -> None:
        """With `observe_topk` = k: after a verification, the target's k most likely next tokens (best first)
        after each token it kept this step (`tokens`, in order: the last committed token, then the accepted
        drafts). Free information from the verification forward (token recycling)."""

    def observe_draft(self, seq_id: int, tokens: list[int], predictions: list[int]) -> None:
        """With `observe_drafts`: after a verification, the draft tokens it scored (node order) and the target's
        most likely next token after the last committed token (predictions[0]) and after each node
        (predictions[1 + j]), accepted or not (Jacobi iterations learn from every row)."""

    def forget(self) -> None:
        """Drop what was learnt from finished requests (called only while none runs). Benchmarks and
        `specdec tune` call it between passes over the same prompts, which a drafter with cross-request memory
        (a global suffix trie, a shared n-gram pool) would otherwise draft from their own earlier answers."""

    @property
    def keeps_kv(self) -> bool:
        """Whether it keeps K/V of its own over the shared blocks (then `cached_prefix` says how far they hold)."""
        return type(self).cached_prefix is not Drafter.cached_prefix

    def cached_prefix(self, request: DraftRequest) -> int | None:
        """How many leading tokens of the request's sequence have final K/V in this drafter's own pool over the
        shared blocks; None when it keeps none there. Blocks enter the prefix cache only where target and
        draft both hold them, so a later request that reuses them finds the draft's K/V too."""
        return None
