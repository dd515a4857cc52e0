"""`Measuring`: the one interface through which measuring tools (`specdec bench`, `specdec tune`, the soak, tests)
see and drive an engine, kept out of `LLMEngine`: the engine's own step knows nothing of them. `LLM.measuring`
hands one out; bench and training use nothing else of the engine.

What it reads:
    model                      the target network (its device, config, weights per token)
    speculative                the speculative config, or None
    eos_token_ids, max_num_seqs
    step_times                 where the engine's steps spent their time (`StepTimes`: switch, reset, summary)
    prediction()               the cost model's predictions beside the steps' measured times, or None
What it drives:
    forget_finished()          no drafter remembers earlier requests (each timed pass starts alike)
    time_verification(c, ns)   one sequence's verification forwards of n rows after c tokens (`step_cost`)
    pin_draft_shape(shape)     the speculator drafts `shape` at every step, whatever the batch size
    trace_speculation()        every verification appends (accepted node indices, nodes drafted) per sequence
    inject_fault(fault)        `fault(seqs)` runs before each step computes; what it raises is that step's fault

A fault raised there is handled as any failure of the step's computation: only the request at fault fails
(`LLMEngine._isolate`), which is how fault isolation is exercised without breaking a kernel.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from specdec.config import SpecdecError
from specdec.drafting.registry import SpeculativeConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.scheduler import ScheduledBatch
from specdec.engine.sequence import Sequence
from specdec.engine.step_cost import time_verification
from specdec.engine.step_times import StepTimes
from specdec.tree import SpecShape


class Measuring:
    """An engine as measuring tools see it (see the module's docstring)."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine

    @property
    def model(self) -> torch.nn.Module:
        return self._engine.model

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return self._engine.speculative

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self._engine.eos_token_ids)

    @property
    def max_num_seqs(self) -> int:
        return self._engine.cfg.max_num_seqs

    @property
    def step_times(self) -> StepTimes:
        return self._engine.step_times

    def prediction(self) -> dict | None:
        """The cost model's predicted speedup and its measured tokens and seconds per predicted ones (None: no cost
        model decides this engine's drafts)."""
        spec = self._engine.speculator
        return spec.planner.prediction.summary() if spec is not None and spec.planner.cost is not None else None

    def sampled_verification(self) -> str | None:
        spec = self._engine.speculator
        return spec.cfg.sampled_verification if spec is not None else None

    def forget_finished(self) -> None:
        self._engine.forget_finished()

    def time_verification(self, context_len: int, num_rows: list[int], repeats: int = 9) -> dict[int, float]:
        return time_verification(self._engine, context_len, num_rows, repeats)

    def pin_draft_shape(self, shape: SpecShape | None) -> None:
        pin_draft_shape(self._engine, shape)

    def trace_speculation(self) -> contextlib.AbstractContextManager[list[tuple[list[int], int]]]:
        return trace_speculation(self._engine)

    def inject_fault(self, fault: Callable[[list[Sequence]], None] | None) -> None:
        inject_fault(self._engine, fault)


def pin_draft_shape(engine: LLMEngine, shape: SpecShape | None) -> None:
    """Draft this shape at every step, whatever the batch size (None: back to the config's shape per batch size)."""
    if engine.speculator is None:
        raise SpecdecError("this engine does not speculate: there is no draft shape to pin")
    if shape is not None and shape.num_slots > engine.scheduler.lookahead:
        raise SpecdecError(f"draft shape {shape} needs {shape.num_slots} slots per step; this engine reserves "
                           f"{engine.scheduler.lookahead} (its speculative config's largest shape)")
    engine.speculator.pinned = shape


@contextmanager
def trace_speculation(engine: LLMEngine) -> Iterator[list[tuple[list[int], int]]]:
    """Within the block, every verification appends (accepted node indices, nodes drafted) per sequence."""
    if engine.speculator is None:
        raise SpecdecError("this engine does not speculate: there is nothing to trace")
    engine.speculator.trace = trace = []
    try:
        yield trace
    finally:
        engine.speculator.trace = None


def inject_fault(engine: LLMEngine, fault: Callable[[list[Sequence]], None] | None) -> None:
    """Call `fault(seqs)` with each step's sequences before the step computes (None: stop). It runs inside the
    step's computation, so what it raises fails that step as a kernel's error would."""
    engine.__dict__.pop("_compute", None)  # the class's own again
    if fault is None:
        return
    compute = engine._compute

    def faulty(batch: ScheduledBatch) -> object:
        fault(batch.seqs)
        return compute(batch)

    engine._compute = faulty
