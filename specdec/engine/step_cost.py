"""What a decode step costs on this model, on this machine, at this context length: `StepCost`, the measured
table t(rows, context) plus what each batch size's steps measured beyond their forward, and how it is measured.

    t(rows, context)   verification forwards of 1, 2, 3, ... rows at a short and a long context (`measure`,
                       `time_verification`), once per model and machine, cached under $SPECDEC_CACHE/costs
                       (`load_or_measure`), linear between the widths measured and beyond them
    beyond a forward   what each batch size's decode steps measured besides it (`StepCost.observe`): a plain
                       step's scheduling, token choice and commit (`Recent`), and a drafting step's rows as they
                       really cost there (`RowFit`: B sequences of a few rows each are not the table's one sequence of
                       as many)

The cost model (`engine.cost`) prices drafts with it.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import platform
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from specdec.config import SpecdecError, cache_root
from specdec.kv_cache import BlockTable
from specdec.models.cpu import native

log = logging.getLogger("specdec.engine")

# Verification widths measured (up to what a step needs). The CPU kernels multiply up to 8 activation rows per pass
# over a block of weights (csrc/gemm.h unpacks it once a pass), so the width past a multiple of 8 starts a pass:
# on a Zen 4 with the default file 16 -> 17 rows took 1.7 ms, 24 -> 25 1.1 ms, a row within a pass 0.6 ms. Each
# multiple of 8 and the width after it are measured, so the table's linear interpolation keeps those steps (without
# 17 a batch of 16 priced its first draft row at 0.7 ms and drafted where the step cost 1.7).
ROWS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 25, 32, 33, 48, 49, 64)
SHORT_CONTEXT, LONG_CONTEXT = 32, 512  # the contexts measured (others: linear between and beyond)
MEASURE_BUDGET_S = 4.0  # widths beyond the smallest eight are measured while the measurement took less than this
REPEATS = 3
MEASURE_ATTEMPTS = 3  # a table a busy machine measured (not `StepCost.plausible`) is measured again, this many in all
SLOW_FORWARD_S = 0.1  # a forward slower than this is timed once per shape
SPOT_CHECK_RATIO = 1.75  # a cached table whose one-row forward a fresh timing puts off by more is measured again
SPOT_CHECK_SLACK_S = 1e-3  # ... and by more than this many seconds (a tiny model's forwards jitter by multiples)
FORMAT = 3  # of the cached tables: a change to what is measured makes old ones stale
ONLINE = 0.1  # the weight of a step in a batch size's RowFit (older steps weigh 1 - ONLINE less each)
RECENT = 15  # a moving time (a batch size's plain-step overhead, the drafting time) is the median of this many
STALL = 3.0  # a step taking this many times what the model expects is a stall (page faults, a collection, a first
# call's one-time work): not learnt from, once the batch size has an estimate
SLOPE_PRIOR = 0.5  # the belief that extra rows cost what the table says, in steps of mean square x (`RowFit`)
SLOPE_RANGE = (0.5, 3.0)  # the fitted slope stays within these multiples of the table's
INTERCEPT_PRIOR = 2.0  # the belief that a drafting step adds to its forward what a plain step does, in steps

def cpu_model() -> str | None:
    """The CPU's model name (costs are cached per CPU)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or None
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), None)


@dataclass
class StepCost:
    """Seconds of a decode step verifying `rows` rows at `context` tokens of context: the measured forwards, linear
    between the table's widths and contexts (and beyond them, from the last two), plus what the engine's own steps
    of that many sequences measured beyond their forward (scheduling, token choice, commit: moving, per batch
    size). `online`: whether steps correct it (a test's made-up table does not)."""

    rows: list[int]
    contexts: list[int]
    seconds: list[list[float]]  # [context][width]
    online: bool = True
    # batch size -> seconds its plain steps add to their forward (the median of recent ones): scheduling, token
    # choice, commit
    overhead: dict[int, Recent] = field(default_factory=dict)
    # batch size -> its drafting steps' seconds beyond a plain step of now, fitted to the extra rows' forward time
    # (`RowFit`): a drafting step's token choice, settling and bookkeeping, and its rows as they really cost there
    # (B sequences of a few rows each are not the table's one sequence of as many)
    fits: dict[int, RowFit] = field(default_factory=dict)
    _dense: list[list[float]] = field(default_factory=lambda: [[]], repr=False)  # per context: seconds by width

    def __call__(self, rows: int, context: float, batch: int = 1) -> float:
        forward = self.forward(rows, context)
        fit, recent = self.fits.get(batch), self.overhead.get(batch)
        if rows > batch and fit is not None:  # a drafting step: a plain step now, then its rows at the fitted slope
            base = self.forward(batch, context)
            return max(base + self.plain_extra(batch) + fit.seconds(forward - base), 0.25 * forward)
        extra = recent.value if recent is not None else fit.intercept() if fit is not None else 0.0  # not measured:
        return max(forward + extra, 0.25 * forward)                                   # as the other kind of step

    def widths(self, batch: int, context: float, extra: int) -> list[float]:
        """[self(batch + n, context, batch) for n in 0..extra], with the context's interpolation and the batch
        size's fit worked out once: a plan prices every prefix of its items (up to 64 widths a step at batch 16)."""
        top = batch + extra
        self.forward(top, context)  # the dense copy reaches `top`
        first = self._dense[0]
        if len(self.contexts) == 1:
            forwards = first[batch:top + 1]
        else:
            i = min(max(bisect.bisect_left(self.contexts, context), 1), len(self.contexts) - 1)
            w = (context - self.contexts[i - 1]) / (self.contexts[i] - self.contexts[i - 1])
            lo, hi = self._dense[i - 1], self._dense[i]
            forwards = [max(lo[n] + (hi[n] - lo[n]) * w, 0.0, first[n] * 0.5) for n in range(batch, top + 1)]
        fit, recent, base = self.fits.get(batch), self.overhead.get(batch), forwards[0]
        plain_extra = recent.value if recent is not None else fit.intercept() if fit is not None else 0.0
        out = [max(base + plain_extra, 0.25 * base)]
        if fit is None:
            return out + [max(f + plain_extra, 0.25 * f) for f in forwards[1:]]
        a, b = fit.coefficients()
        a += self.plain_extra(batch)
        return out + [max(base + a + b * (f - base), 0.25 * f) for f in forwards[1:]]

    def plain_extra(self, batch: int) -> float:
        """What this batch size's plain steps add beyond their forward (0 before one is measured): what its drafting
        steps are fitted beyond (`RowFit`, `observe`)."""
        recent = self.overhead.get(batch)
        return recent.value if recent is not None else 0.0

    def forward(self, rows: int, context: float) -> float:
        """The table's seconds (no overhead): each context's row read off a dense copy (a plan asks for many widths a
        step), then linear in the context."""
        if rows >= len(self._dense[0]):
            self._dense = [[_linear(self.rows, s, n) for n in range(2 * rows + 1)] for s in self.seconds]
        by_context = [dense[rows] for dense in self._dense]
        if len(self.contexts) == 1:
            return by_context[0]
        return max(_linear(self.contexts, by_context, context), by_context[0] * 0.5)

    def plausible(self) -> bool:
        """Whether the table reads as a quiet machine's: a wider forward never much faster than a narrower one (nor a
        longer context than a shorter one), and none costing more than 1.5x a row's time per row. A busy machine's
        measurement breaks these; such a table is measured again and never cached."""
        for times in self.seconds:
            if min(times) <= 0 or any(b < 0.8 * a for a, b in zip(times, times[1:])):
                return False
            if any(t > 1.5 * w * times[0] for w, t in zip(self.rows, times)):
                return False
        return all(b >= 0.8 * a for short, long in zip(self.seconds, self.seconds[1:]) for a, b in zip(short, long))

    def monotone(self) -> StepCost:
        """The table with what a quiet machine's forwards satisfy restored where noise broke it by less than
        `plausible` refuses: no width above a wider one, no context above a longer one (each entry lowered to the
        least of those; a busy host's noise slows forwards, it never speeds them). A 1-row forward at context 512
        timed at 6.22 ms beside 5.75 ms for 2 rows (fresh timings: 5.5) had priced every plain step at long
        contexts 0.5-0.7 ms over what it took."""
        rows = [list(times) for times in self.seconds]
        for times in rows:
            for i in range(len(times) - 2, -1, -1):
                times[i] = min(times[i], times[i + 1])
        for j in range(len(rows) - 2, -1, -1):
            rows[j] = [min(a, b) for a, b in zip(rows[j], rows[j + 1])]
        return StepCost(self.rows, self.contexts, rows, self.online)

    def observe(self, batch: int, rows: int, context: float, seconds: float) -> bool:
        """A decode step of `batch` sequences and `rows` rows took `seconds` (its drafting not counted): a plain
        step's overhead joins the recent ones (beyond the forward); a drafting step refits its batch size's
        `RowFit`. A stall (STALL times what the model expects, once the batch size has an estimate) teaches
        nothing: returns whether the step was learnt from."""
        if not self.online or seconds <= 0:
            return False
        if (batch in self.overhead or batch in self.fits) and seconds > STALL * self(rows, context, batch):
            return False
        base = self.forward(batch, context)
        if rows > batch:  # beyond a plain step of now (a busy moment slows both kinds of step alike)
            self.fits.setdefault(batch, RowFit()).add(self.forward(rows, context) - base,
                                                      seconds - base - self.plain_extra(batch))
        else:
            self.overhead.setdefault(batch, Recent()).add(seconds - base)
        return True

    def to_json(self) -> dict:
        return {"format": FORMAT, "rows": self.rows, "contexts": self.contexts, "seconds": self.seconds}


@dataclass
class Recent:
    """The median of the last RECENT values: a moving time that a stalled step cannot drag as it drags a mean (a
    first step's one-time work once held a batch size's plain-step estimate at 6x its steps for hundreds of
    steps)."""

    values: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    value: float = 0.0

    def add(self, x: float) -> None:
        self.values.append(x)
        self.value = statistics.median(self.values)


@dataclass
class RowFit:
    """A batch size's drafting steps: seconds beyond a plain step of now (its forward and what plain steps add beyond
    it) ~ a + b x, x the table's time for their extra rows, fitted by least squares over recent steps (each older one
    weighs 1 - ONLINE less), b shrunk toward 1 (the table is right) by SLOPE_PRIOR times the mean x^2 and a toward 0
    (a drafting step adds its rows alone) by INTERCEPT_PRIOR steps. While the steps' rows do not vary, b stays 1 and
    a is the moving mean of what they took beyond the table. (Unshrunk, one drafting step's one-time work set a: on a
    Zen 4 the next row then cost 1.4 plain steps where the table says 0.05, nothing drafted again, and so nothing
    corrected it.)"""

    s0: float = 0.0  # decayed sums of 1, x, y, x^2, xy
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        keep = 1 - ONLINE if self.s0 else 0.0
        self.s0, self.sx, self.sy = keep * self.s0 + 1, keep * self.sx + x, keep * self.sy + y
        self.sxx, self.sxy = keep * self.sxx + x * x, keep * self.sxy + x * y

    def coefficients(self) -> tuple[float, float]:
        """(a, b): the ridge solution of [s0 + m, sx; sx, sxx + l] [a b] = [sy, sxy + l], l = SLOPE_PRIOR mean x^2,
        m = INTERCEPT_PRIOR."""
        prior, m = SLOPE_PRIOR * self.sxx / self.s0, INTERCEPT_PRIOR
        det = (self.s0 + m) * (self.sxx + prior) - self.sx * self.sx
        b = (self.s0 + m) * (self.sxy + prior) - self.sx * self.sy
        b = min(max(b / det, SLOPE_RANGE[0]), SLOPE_RANGE[1]) if det > 0 else 1.0
        return (self.sy - b * self.sx) / (self.s0 + m), b

    def intercept(self) -> float:
        return self.coefficients()[0]

    def seconds(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * x


def _linear(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), extended linearly past both ends (never below 0)."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def measure(time_rows: Callable[[int, list[int], int], dict[int, float]], max_rows: int, max_context: int
            ) -> StepCost:
    """The table: `time_rows(context, widths, repeats)` (`time_verification`) at a short and a long
    context, for the widths up to `max_rows`; the wider ones only while the whole measurement stays within
    MEASURE_BUDGET_S (past them the table extends linearly: wide forwards are compute-bound). A model whose
    forward takes more than SLOW_FORWARD_S is timed once per shape (its times vary less than a small one's). A table
    that is not `plausible` (a busy machine) is measured again, up to MEASURE_ATTEMPTS times while within twice the
    budget; the last one is returned either way, and a plausible one made `monotone`."""
    import time

    start = time.perf_counter()
    for attempt in range(1, MEASURE_ATTEMPTS + 1):
        cost = _measure_once(time_rows, max_rows, max_context)
        if cost.plausible():
            return cost.monotone()
        if attempt == MEASURE_ATTEMPTS or time.perf_counter() - start > 2 * MEASURE_BUDGET_S:
            return cost
        log.info("the verification costs measured on a busy machine (a wider forward faster than a narrower "
                 "one); measuring again")
    raise AssertionError("unreachable")


def _measure_once(time_rows: Callable[[int, list[int], int], dict[int, float]], max_rows: int, max_context: int
                  ) -> StepCost:
    import time

    start = time.perf_counter()
    widths = [w for w in ROWS if w <= max(2, max_rows)]
    contexts = sorted({min(SHORT_CONTEXT, max_context), min(LONG_CONTEXT, max_context)})
    repeats = REPEATS if time_rows(contexts[0], [1], 1)[1] < SLOW_FORWARD_S else 1
    if repeats == 1:
        log.info("measuring what verifying 1-%d rows costs on this model (once; cached under %s)", widths[:8][-1],
                 cache_root() / "costs")
    table = {c: time_rows(c, widths[:8], repeats) for c in contexts}
    for w in widths[8:]:
        if time.perf_counter() - start > MEASURE_BUDGET_S:
            break
        for c in contexts:
            table[c].update(time_rows(c, [w], repeats))
    measured = sorted(table[contexts[0]])
    return StepCost(measured, contexts, [[table[c][w] for w in measured] for c in contexts])


def time_verification(engine: MeasuredEngine, context_len: int, num_rows: list[int], repeats: int = 9
                      ) -> dict[int, float]:
    """Median seconds of a verification forward (every layer, the LM head on every row, the argmax and its copy to
    the host) feeding n rows of one sequence after `context_len` tokens of context, for each n in `num_rows`. The
    shapes are interleaved repetition by repetition, so drift of the machine hits them alike. The rows go to
    scratch blocks taken from the engine's pool and given back in their order (what the K/V there holds does not
    change the time), so no request, prefix cache entry or counter is left behind. The engine must be idle."""
    import time

    if engine.has_unfinished():
        raise SpecdecError("time_verification() while requests run: it measures an idle engine")
    vocab = engine.model.config.vocab_size
    table = BlockTable()
    engine.allocator.allocate(table, context_len + max(num_rows))
    try:
        # one untimed forward first: the scratch blocks' first touch (page faults) is no verification's cost
        feed = [(100 + i) % vocab for i in range(max(num_rows))]
        engine.runner.logits(engine.runner.run([table.blocks], [context_len], [feed])[0]).argmax(-1).tolist()
        times: dict[int, list[float]] = {n: [] for n in num_rows}
        for _ in range(repeats):
            for n in num_rows:
                start = time.perf_counter()
                hidden, _ = engine.runner.run([table.blocks], [context_len], [[(100 + i) % vocab for i in range(n)]])
                engine.runner.logits(hidden).argmax(-1).tolist()  # the step's one copy back (a GPU waits)
                times[n].append(time.perf_counter() - start)
    finally:
        engine.allocator.free(table)
    return {n: statistics.median(t) for n, t in times.items()}


def engine_costs(engine: MeasuredEngine) -> StepCost | None:
    """The engine's table: cached per model shape and formats, device, threads, CPU and kernel build, else measured
    now (once; about a second on the default model) at the widths its steps may verify. None on the meta device
    (nothing runs there)."""
    model = engine.model
    if model.device.type == "meta":
        return None
    max_rows = min(engine.cfg.max_num_seqs * (1 + engine.scheduler.lookahead), ROWS[-1], engine.max_model_len // 2)
    max_context = max(1, engine.max_model_len - max_rows - 2)
    formats = [getattr(linear.weight, "formats", str(linear.weight.dtype)) for linear in model.layers[0].linears]
    # the kernels' build (their sources, flags and instruction set): a faster kernel makes a table stale
    kernels = native.build_key() if model.device.type == "cpu" and native.available() else ""
    key = cache_key(repr(model.config), str(model.dtype), str(model.kv_dtype), str(model.device), formats,
                    type(engine.runner).__name__, engine.cfg.block_size, max_rows, max_context, kernels)
    return load_or_measure(key, lambda: measure(lambda c, w, r: time_verification(engine, c, w, r), max_rows,
                                                max_context),
                           spot_check=lambda c: min(time_verification(engine, c, [1], 1)[1] for _ in range(5)))


def cache_key(*parts: object) -> str:
    """A table's file name: the model's shape and formats, the device, the threads and the CPU."""
    import torch

    import specdec

    text = repr((FORMAT, specdec.__version__, cpu_model(), os.cpu_count(), torch.get_num_threads(), *parts))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def load_or_measure(key: str, measure_now: Callable[[], StepCost],
                    spot_check: Callable[[int], float] | None = None) -> StepCost:
    """The cached table for `key`, or one measured now and cached (an unwritable cache only costs measuring again).
    A table that is not `plausible` (measured while the machine was busy) is used this once, never cached, and a
    cached one is measured again. `spot_check(context)`: one row's forward timed now (the fastest of a few, so a
    moment's load does not count); a cached table it puts off by
    more than SPOT_CHECK_RATIO and SPOT_CHECK_SLACK_S either way (cached by a busy or oversubscribed machine, whose
    times can all be slow alike) is measured again."""
    path = cache_root() / "costs" / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        if data.get("format") == FORMAT and (cached := StepCost(data["rows"], data["contexts"], data["seconds"])
                                             ).plausible():
            if spot_check is None:
                return cached
            now, then = spot_check(cached.contexts[0]), cached.seconds[0][0]
            if then / SPOT_CHECK_RATIO - SPOT_CHECK_SLACK_S <= now <= then * SPOT_CHECK_RATIO + SPOT_CHECK_SLACK_S:
                return cached
            log.info("the cached verification costs (%s) put a forward at %.2f ms, it takes %.2f ms now: measuring "
                     "again", path.name, 1e3 * then, 1e3 * now)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    cost = measure_now()
    if not cost.plausible():
        log.warning("the verification costs vary as on a busy machine (%s); using them for this engine, not caching "
                    "them: they are measured again when the next engine starts", path.name)
        return cost
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cost.to_json()))
        tmp.replace(path)
    except OSError as e:
        log.warning("cannot cache the verification costs in %s (%s); they are measured again next time", path, e)
    return cost


class MeasuredEngine(Protocol):
    """What measuring reads of an engine (`LLMEngine` has it): the target, its runner and block pool, the widths its
    steps may verify."""

    model: object
    runner: object
    allocator: object
    cfg: object
    scheduler: object
    max_model_len: int

    def has_unfinished(self) -> bool: ...
