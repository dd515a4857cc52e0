"""The measured dispatcher: whether a decode step of B sequences speculates, decided by what this engine's own steps
took. It serves speculative configs that name no `dispatch` table (a table, e.g. one `specdec tune` wrote, is
followed as written).

Speculation pays at a batch size when its tokens per second beat plain decoding's there. Which one wins depends on
the machine, the model, the drafter, the traffic and the batch (on two CPU cores a head's chain of 1 won at batch 1
and lost a third of the speed at batch 16: there every verified row is arithmetic the cores must do), so from
batch 2 on both are measured on the engine's own decode steps, per bucket of batch sizes (2, 3-4, 5-8, ...):

    opening:   a bucket's first WARMUP steps speculate, its next PROBES are plain (where plain decoding is
               faster at a smaller batch size, a bucket opens plain instead and first probes speculation after
               MAX_EXPLORE / 2 steps: verification only costs more as the batch grows, and a probe of a feature
               head after a plain stretch pays for catching up on it, 3-6 plain steps at batch 16 on two cores)
    then:      the side faster over its recent steps runs; after a while the other side runs PROBES steps again
               (a probe, measured afresh), so a change in the traffic (prompts that start or stop repeating) is
               seen. The wait between probes starts at EXPLORE steps; each probe that confirms the choice at least
               doubles it, and stretches it so that probes cost at most BUDGET of the time, up to MAX_EXPLORE.

The first step after a switch is not counted: it pays for the switch (a feature drafter catching up on the
tokens decoded without it). Outputs do not depend on the choice: greedy and keyed-sampled tokens are plain
decoding's whatever is drafted, so switching is free of any effect but speed.

A step of one sequence always speculates: verifying a short chain costs little more than a plain step there (one
more row: 1.09 plain steps on two cores), each request's own back-off already stops drafts that keep failing
(`Speculator.draft_budget`), and what a user measures of a drafter alone is what it drafts.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WARMUP = 4  # speculative steps that open a bucket (the first not counted)
PROBES = 4  # steps a probe of the other side runs (its first not counted)
WINDOW = 16  # recent steps of the chosen side compared
EXPLORE = 32  # steps between probes at first
MAX_EXPLORE = 512  # and at most
BUDGET = 0.02  # the share of the time probes that confirm the choice may cost


@dataclass
class Rate:
    """Tokens and seconds of a side's recent steps."""

    steps: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # (tokens, seconds) per step

    def add(self, tokens: int, seconds: float) -> None:
        self.steps.append((tokens, seconds))

    @property
    def tokens_per_second(self) -> float:
        seconds = sum(s for _, s in self.steps)
        return sum(t for t, _ in self.steps) / seconds if seconds > 0 else 0.0


@dataclass
class Bucket:
    opened: bool = True  # the side the bucket runs until both are measured
    wait: int = WARMUP  # steps from the last probe to the next
    speculative: Rate = field(default_factory=Rate)
    plain: Rate = field(default_factory=Rate)
    probe: bool = False  # the side the current probe runs
    probe_left: int = 0  # steps left in it
    before: bool = True  # the choice when it began
    since: int = 0  # steps since the last probe ended
    last: bool | None = None  # whether the bucket's last step speculated
    probe_cost: list = field(default_factory=lambda: [0, 0.0])  # tokens and seconds of the current probe

    def next_wait(self) -> int:
        """Steps to the next probe, after one ended: EXPLORE where it changed the choice (the traffic may be
        changing); else twice as long as before, and long enough that probes cost at most BUDGET of the time (a
        feature head's probe after a plain stretch pays for catching up on it), up to MAX_EXPLORE."""
        if self.choice() != self.before or self.wait < EXPLORE:
            return EXPLORE
        chosen = self.speculative if self.before else self.plain
        rate, steps = chosen.tokens_per_second, len(chosen.steps)
        if not rate or not steps:
            return min(2 * self.wait, MAX_EXPLORE)
        tokens, seconds = self.probe_cost
        excess = max(0.0, seconds - tokens / rate)  # what the probe cost over the chosen side's pace
        step_s = sum(s for _, s in chosen.steps) / steps
        return min(max(2 * self.wait, round(excess / (BUDGET * step_s))), MAX_EXPLORE)

    def choice(self) -> bool:
        """Whether the next step speculates."""
        if self.probe_left:
            return self.probe
        if not (self.speculative.steps and self.plain.steps):
            return self.opened
        return self.speculative.tokens_per_second >= self.plain.tokens_per_second


class MeasuredDispatch:
    """Per bucket of batch sizes, whether decode steps speculate (see the module's docstring)."""

    def __init__(self) -> None:
        self.buckets: dict[int, Bucket] = {}

    def speculates(self, batch_size: int) -> bool:
        """Whether a decode step of this many sequences speculates (the same answer until `record`)."""
        return batch_size <= 1 or self._bucket(batch_size).choice()

    def record(self, batch_size: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode step of `batch_size` sequences ran, speculating or not, and emitted `tokens` in `seconds`."""
        if batch_size <= 1:
            return
        b = self._bucket(batch_size)
        if b.last == speculated:  # the first step after a switch pays for the switch: not counted
            (b.speculative if speculated else b.plain).add(tokens, seconds)
        b.last = speculated
        if b.probe_left:
            b.probe_left -= 1
            b.probe_cost[0] += tokens
            b.probe_cost[1] += seconds
            if not b.probe_left:
                b.wait, b.since = b.next_wait(), 0
            return
        b.since += 1
        if b.since >= b.wait:  # probe the side not chosen, measured afresh
            b.before = b.choice()
            b.probe, b.probe_left, b.probe_cost = not b.before, PROBES, [0, 0.0]
            (b.speculative if b.probe else b.plain).steps.clear()

    def _bucket(self, batch_size: int) -> Bucket:
        key = (batch_size - 1).bit_length()  # buckets 2, 3-4, 5-8, ...
        if key not in self.buckets:  # where plain decoding wins at a smaller batch, a larger one opens with it
            opened = all(b.choice() for k, b in self.buckets.items() if k < key)
            self.buckets[key] = Bucket(opened, WARMUP if opened else MAX_EXPLORE // 2)
        return self.buckets[key]
