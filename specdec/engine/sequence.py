"""A request's state as it moves through the engine: tokens, cache position, timing."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from specdec.config import SamplingParams
from specdec.kv_cache import BlockTable
from specdec.structured.grammar import GrammarState


@dataclass
class SpecStats:
    """Per-request speculation counters (vLLM names); all zero without speculation."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)  # drafts that reached each depth
    draft_error: str | None = None  # the drafter raised on this request: it decodes without drafts from then on
    num_draft_failures: int = 0  # (the engine's totals) requests whose drafter raised

    def record(self, num_draft: int, num_accepted: int, depth: int | None = None) -> None:
        """One verified draft of `num_draft` nodes, `depth` levels deep (a chain: its length), of which
        `num_accepted` were kept. Positions count levels: a tree keeps at most one node per level."""
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos += [0] * (num_draft - len(self.accepted_per_pos))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1
        levels = depth or num_draft
        if len(self.drafted_per_pos) < levels:
            self.drafted_per_pos += [0] * (levels - len(self.drafted_per_pos))
        for j in range(levels):
            self.drafted_per_pos[j] += 1


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    max_len: int  # the context limit: prompt + output never exceeds it
    eos_token_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None  # seeded requests: rejection sampling's draws (`sampled_verification`)
    sampling_seed: int = 0  # the key of its sampled tokens: its seed, or a random one (`sampling.sampling_key`)
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_cached: int = 0  # tokens whose K/V are in the cache
    num_prefix_hit: int = 0  # of those, tokens reused from the prefix cache at the latest admission
    block_table: BlockTable = field(default_factory=BlockTable)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_steps: int = 0  # target forwards that produced output tokens
    num_preemptions: int = 0  # each one drops all of the sequence's KV, the drafters' too
    spec: SpecStats = field(default_factory=SpecStats)
    # Target hidden states not yet handed to the drafter (only for drafters that read them, e.g. EAGLE):
    # one [n, F] tensor per forward, covering tokens features_start .. num_cached - 1 in order.
    pending_features: list[torch.Tensor] = field(default_factory=list)
    features_start: int = 0
    grammar: GrammarState | None = None  # structured output: the grammar's state after the committed tokens
    logprobs: list = field(default_factory=list)  # sampling.TokenLogprob per output token (params.logprobs set)
    prompt_logprobs: list = field(default_factory=list)  # the same per prompt token after the first (prompt_logprobs)
    # n > 1: the choice whose prefill this one waits for, to share its prompt's K/V blocks (see Scheduler)
    prompt_source: Sequence | None = None

    def take_features(self, leave: int = 0) -> tuple[int, torch.Tensor | None]:
        """The pending target features and the token index of their first row; they are handed over once. `leave`:
        that many last rows stay pending (a drafter's next draft starts from the row of the last cached token)."""
        start, pending = self.features_start, self.pending_features
        rows = pending[0] if len(pending) == 1 else torch.cat(pending) if pending else None
        if leave and rows is not None and len(rows) > leave:
            self.features_start, self.pending_features = self.num_cached - leave, [rows[-leave:]]
            return start, rows[:-leave]
        self.features_start, self.pending_features = self.num_cached, []
        return start, rows

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        """len(output_token_ids) without copying them (asked per sequence and step)."""
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncached(self) -> int:
        return len(self.token_ids) - self.num_cached

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def append(self, token: int) -> None:
        """Add one generated token (whether the sequence stops after it is `commit.keep`'s to say)."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.token_ids.append(token)

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.status = Status.FINISHED
        self.finish_time = time.perf_counter()
