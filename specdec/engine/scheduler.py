"""CPU bookkeeping: which sequences run this step, with how many tokens, and in which KV blocks.

Every block-allocator call and every change to a sequence's cache state (`num_cached`, its block table,
the target features waiting for its drafter, its blocks in the prefix cache) happens here: `schedule` reserves
the slots a step may write, the step decides what each sequence kept (`commit.Kept`), `update` applies it, and
`settle` and `finish` hand the full blocks to the prefix cache.

A step is either a prefill step (new or preempted sequences feed their uncached tokens, chunked by a
token budget) or a decode step (every running sequence feeds its last token, plus up to `lookahead`
draft tokens whose slots are reserved here). While both kinds of work wait, prefill and decode steps
alternate, so a long prompt arriving never stalls the requests already decoding for more than one chunk.
A new sequence starts from the longest cached prefix of its tokens (prefix caching). When blocks run out
during decode, the newest sequence is preempted: its blocks are freed and it is recomputed later (its
full blocks stay in the prefix cache, so the recompute is usually cheap).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from specdec.config import EngineConfig
from specdec.engine.commit import Kept
from specdec.engine.sequence import Sequence, Status
from specdec.kv_cache import BlockAllocator


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence feeds this step
    is_prefill: bool


class Scheduler:
    def __init__(self, cfg: EngineConfig, allocator: BlockAllocator, lookahead: int = 0,
                 structured_lookahead: int | None = None,
                 drafted: Callable[[Sequence], int | None] | None = None) -> None:
        """lookahead: draft tokens a decode step may verify per sequence; their slots are reserved too.
        structured_lookahead: the same for a structured request, which may also draft its grammar's forced
        text (default: lookahead). drafted: how many leading tokens of a sequence have final K/V in the
        drafter's own pool over the shared blocks (None: it keeps none there; `Speculator.cached_prefix`)."""
        self.cfg, self.allocator, self.lookahead, self.drafted = cfg, allocator, lookahead, drafted
        self.structured_lookahead = lookahead if structured_lookahead is None else structured_lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.last_was_prefill = False
        # After a step failed: its sequences, each to run alone until one step of its own works (then it
        # rejoins the batch) or fails (then it alone fails). Nothing else runs meanwhile.
        self.suspects: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def suspect(self, seqs: list[Sequence]) -> None:
        self.suspects.extend(s for s in seqs if s not in self.suspects)

    def cleared(self, batch: ScheduledBatch) -> None:
        """A step worked: a suspect that ran it alone is cleared."""
        if len(batch.seqs) == 1 and self.suspects and self.suspects[0] is batch.seqs[0]:
            self.suspects.popleft()

    def schedule(self) -> ScheduledBatch | None:
        while self.suspects and self.suspects[0].is_finished:
            self.suspects.popleft()
        if self.suspects:  # the prefill or decode step of one suspect, alone (when it fits; else as usual)
            seq = self.suspects[0]
            alone = (self._schedule_prefill([seq]) if seq.status == Status.WAITING or seq.num_uncached > 1
                     else self._schedule_decode([seq]))
            if alone is not None:
                return alone
        decodable = any(s.num_uncached == 1 for s in self.running)
        batch = None
        if not (self.last_was_prefill and decodable):
            batch = self._schedule_prefill()
        if batch is None:
            batch = self._schedule_decode()
        self.last_was_prefill = batch is not None and batch.is_prefill
        return batch

    def _schedule_prefill(self, only: list[Sequence] | None = None) -> ScheduledBatch | None:
        seqs: list[Sequence] = []
        counts: list[int] = []
        budget = self.cfg.max_num_batched_tokens
        # Sequences part-way through a chunked prefill go first, then new arrivals.
        candidates = only or [s for s in self.running if s.num_uncached > 1] + list(self.waiting)
        num_admitted = 0
        for seq in candidates:
            is_new = seq.status == Status.WAITING
            if is_new and self._holds(seq):
                continue
            if is_new and len(self.running) + num_admitted >= self.cfg.max_num_seqs:
                break
            room = budget - sum(counts)
            if room <= 0:
                break
            if is_new:  # start from the longest cached prefix, then reserve the first chunk after it
                hit = self.allocator.admit(seq.block_table, seq.token_ids, room,
                                           use_cache=seq.params.prompt_logprobs is None)
                if hit is None:
                    break
                seq.num_cached = seq.num_prefix_hit = seq.features_start = hit  # features start after the hit
            n = min(seq.num_uncached, room)  # a prompt over the budget is chunked
            if not is_new:
                if not self.allocator.can_allocate(seq.block_table, seq.num_cached + n):
                    break
                self.allocator.allocate(seq.block_table, seq.num_cached + n)
            seqs.append(seq)
            counts.append(n)
            num_admitted += is_new
        for seq in seqs:
            if seq.status == Status.WAITING:
                self.waiting.remove(seq)
                seq.status = Status.RUNNING
                self.running.append(seq)
        return ScheduledBatch(seqs, counts, True) if seqs else None

    def _holds(self, seq: Sequence) -> bool:
        """Whether a new sequence waits for its `prompt_source` (another choice of the same prompt, n > 1): until
        the source's prompt blocks are in the prefix cache (the engine registers them once the target's and the
        drafter's K/V are final), so this one's admission shares them instead of prefilling the prompt again.
        A source that finished, was preempted or decoded past its prompt without registering it releases it."""
        source = seq.prompt_source
        if source is None or not self.allocator.enable_prefix_caching:
            return False
        if source.is_finished or source.num_preemptions or source.num_steps >= 2:
            seq.prompt_source = None
            return False
        if len(source.block_table.keys) >= (seq.num_prompt_tokens - 1) // self.allocator.block_size:
            seq.prompt_source = None
            return False
        return True

    def _schedule_decode(self, only: list[Sequence] | None = None) -> ScheduledBatch | None:
        seqs: list[Sequence] = []
        for seq in only or list(self.running):
            if seq.status != Status.RUNNING or seq.num_uncached != 1:
                continue  # part-way through a chunked prefill: its next chunk comes in a prefill step
            ahead = self.lookahead if seq.grammar is None else self.structured_lookahead
            need = min(seq.num_cached + 1 + ahead, seq.max_len)
            while not self.allocator.can_allocate(seq.block_table, need):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status == Status.RUNNING:
                self.allocator.allocate(seq.block_table, need)
                seqs.append(seq)
        if not seqs and self.waiting and not self.running:
            seq = self.waiting[0]
            raise RuntimeError(f"request {seq.seq_id} needs more KV blocks than the cache holds "
                               f"({len(seq.token_ids)} tokens, {self.allocator.num_free} blocks free)")
        return ScheduledBatch(seqs, [1] * len(seqs), False) if seqs else None

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Blocks for the sequence's first `num_tokens` slots, outside any step (a measuring tool writes rows past
        its committed tokens; the next `update` or `finish` gives them back)."""
        if not self.allocator.can_allocate(seq.block_table, num_tokens):
            raise RuntimeError(f"{num_tokens} slots do not fit in the KV cache ({self.allocator.num_free} blocks free)")
        self.allocator.allocate(seq.block_table, num_tokens)

    def update(self, kept: list[Kept]) -> None:
        """Apply what each sequence kept of a step: those tokens' K/V are cached, the slots past them go back to
        the pool (rejected drafts', and accepted ones' after a stop), and their target features wait for the
        drafter."""
        for k in kept:
            seq = k.seq
            seq.num_cached += k.num_cached
            self.allocator.truncate(seq.block_table, seq.num_cached)
            if k.features is not None:
                seq.pending_features.append(k.features)

    def settle(self, seqs: list[Sequence]) -> None:
        """Offer each sequence's full blocks to the prefix cache and free those its windows left behind, up to
        where both the target's K/V (its cached tokens) and the drafter's (`drafted`) hold committed tokens."""
        if not (self.allocator.enable_prefix_caching or self.allocator.reach):
            return
        for seq in seqs:
            n, drafted = seq.num_cached, self.drafted(seq) if self.drafted is not None else None
            n = n if drafted is None else min(n, drafted)
            self.allocator.register(seq.block_table, seq.token_ids, n)
            self.allocator.release_behind(seq.block_table, n)

    def preempt(self, seq: Sequence) -> None:
        """Free a sequence's blocks and queue it to be recomputed from its tokens."""
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        self.num_preemptions += 1
        seq.num_preemptions += 1
        seq.num_cached = seq.num_prefix_hit = 0
        seq.pending_features, seq.features_start = [], 0  # recomputed with the prefix
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Finish (or abort) a sequence and return its blocks; its full blocks outlive it in the prefix cache."""
        self.settle([seq])
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq.block_table)
        seq.finish(reason, stop_reason)
