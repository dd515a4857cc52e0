"""Where an engine step's time goes (issue 46's step accounting), so every change to the step is judged by it:

    | schedule | draft: model forward, host | target forward | logits | token choice | settle | commit |
    begin      mark ...                                                                              end

The step marks the end of each phase; a phase is the time since the previous mark, so the phases add up to the
whole step. Drafting is split by the drafter's own clock (`drafting.ForwardClock`): the seconds its model's
forwards took, and the rest (catching up on accepted tokens, assembling inputs, sampling, trees). Prefill and
decode steps are counted apart. A step costs about ten perf_counter calls (a few microseconds). On CPU the
times are the work's own; on a GPU the device is waited for at every mark, which costs the overlap of host and
device, so there the accounting is off until `switch(True)`.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec.drafting import ForwardClock

PHASES = ("schedule", "draft_forward", "draft_host", "target_forward", "logits", "token_choice", "settle", "commit")


@dataclass
class PhaseTotals:
    """The time of one kind of step (prefill or decode), summed over its steps."""

    num_steps: int = 0
    num_tokens: int = 0  # tokens the steps' sequences kept (emitted), all sequences of a step together
    step_s: float = 0.0  # whole steps
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def ms_per_step(self) -> dict[str, float | int | None]:
        """{num_steps, tokens_per_step, step_ms, <phase>_ms...}: per step (None without steps)."""
        per = 1 / self.num_steps if self.num_steps else None
        return {"num_steps": self.num_steps, "tokens_per_step": self.num_tokens * per if per else None,
                "step_ms": self.step_s * 1e3 * per if per else None,
                **{f"{phase}_ms": s * 1e3 * per if per else None for phase, s in self.seconds.items()}}


class StepTimes:
    """The engine's accumulator: `begin` a step, `mark` each phase's end, `end` it as a prefill or decode step."""

    def __init__(self, clock: ForwardClock, sync: Callable[[], None] | None = None, on: bool = True) -> None:
        """clock: the drafter's forward clock; sync: waits for the device (a GPU's), called at every mark when on."""
        self.clock, self.sync = clock, sync
        self.on = False
        self.switch(on)
        self.reset()

    def switch(self, on: bool) -> None:
        """Turn the accounting on or off (with it, the drafter clock's waits for the device)."""
        self.on = on
        self.clock.sync = self.sync if on else None

    def reset(self) -> None:
        self.totals = {"prefill": PhaseTotals(), "decode": PhaseTotals()}
        self._open()  # marks outside a step (a test driving `_compute` alone) count toward nothing

    def begin(self) -> None:
        if self.on:
            self._wait()
            self._open()

    def _open(self) -> None:
        self._first = self._last = time.perf_counter()
        self._clock = self.clock.seconds
        self._step = dict.fromkeys(PHASES, 0.0)

    def mark(self, phase: str) -> None:
        """The phase `phase` ends now."""
        if not self.on:
            return
        self._wait()
        now = time.perf_counter()
        self._step[phase] += now - self._last
        self._last = now

    def mark_draft(self) -> None:
        """Drafting ends now: the drafter's forwards since `begin` are its model time, the rest host time."""
        if not self.on:
            return
        self._wait()
        now = time.perf_counter()
        model = self.clock.seconds - self._clock
        self._step["draft_forward"] += model
        self._step["draft_host"] += now - self._last - model
        self._last = now

    def end(self, prefill: bool, num_tokens: int) -> None:
        """The step ends now, its sequences having kept `num_tokens` tokens; what ran since the last mark was
        committing."""
        if not self.on:
            return
        self.mark("commit")
        totals = self.totals["prefill" if prefill else "decode"]
        totals.num_steps += 1
        totals.num_tokens += num_tokens
        totals.step_s += self._last - self._first
        for phase, s in self._step.items():
            totals.seconds[phase] += s

    def summary(self) -> dict[str, dict[str, float | int | None]]:
        """Milliseconds per step of each phase and of the whole step, per step kind (what `specdec bench` writes)."""
        return {kind: totals.ms_per_step() for kind, totals in self.totals.items()}

    def _wait(self) -> None:
        if self.sync is not None:
            self.sync()
