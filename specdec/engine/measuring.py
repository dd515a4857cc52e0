"""Control of an engine for measuring tools (`specdec tune`, `bench --soak`, tests), kept out of `LLMEngine`: the
engine's own step knows nothing of them. Each reaches one documented place of the engine:

    pin_draft_shape(engine, shape)   the speculator drafts `shape` at every step, whatever the batch size
    trace_speculation(engine)        every verification appends (accepted node indices, nodes drafted) per sequence
    inject_fault(engine, fault)      `fault(seqs)` runs before each step computes; what it raises is that step's fault

A fault raised there is handled as any failure of the step's computation: only the request at fault fails
(`LLMEngine._isolate`), which is how fault isolation is exercised without breaking a kernel.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from specdec.config import SpecdecError
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.scheduler import ScheduledBatch
from specdec.engine.sequence import Sequence
from specdec.tree import SpecShape


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
