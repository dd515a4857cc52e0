"""engine/step_cost.py: the measured table of what a step costs, linear between its widths and contexts, corrected by
each batch size's steps, measured once per model and machine and cached, and measured again where a busy machine
measured it."""
from __future__ import annotations

import json

import numpy as np
import pytest

from specdec import LLM
from specdec.engine import step_cost as cost
from specdec.engine.cost import Item, plan
from specdec.engine.step_cost import (
    INTERCEPT_PRIOR,
    ONLINE,
    SLOPE_PRIOR,
    SLOPE_RANGE,
    StepCost,
    time_verification,
)


def ridge(steps: list[tuple[float, float]], a0: float) -> tuple[float, float]:
    """`RowFit`'s (a, b) for steps (x, y), oldest first, solved independently: weighted least squares over the steps
    (each older one weighing 1 - ONLINE less) and two pseudo-observations, a = a0 with the weight of INTERCEPT_PRIOR
    steps and b = 1 with SLOPE_PRIOR times the steps' mean x^2; b clipped to SLOPE_RANGE, then a refitted."""
    w = np.array([(1 - ONLINE) ** (len(steps) - 1 - i) for i in range(len(steps))])
    x, y = np.array([s[0] for s in steps]), np.array([s[1] for s in steps])
    slope_w = SLOPE_PRIOR * (w * x * x).sum() / w.sum()
    rows = np.vstack([np.sqrt(w)[:, None] * np.c_[np.ones_like(x), x], [np.sqrt(INTERCEPT_PRIOR), 0],
                      [0, np.sqrt(slope_w)]])
    target = np.r_[np.sqrt(w) * y, np.sqrt(INTERCEPT_PRIOR) * a0, np.sqrt(slope_w)]
    a, b = np.linalg.lstsq(rows, target, rcond=None)[0]
    b = min(max(b, SLOPE_RANGE[0]), SLOPE_RANGE[1])
    return (float((w * (y - b * x)).sum() + INTERCEPT_PRIOR * a0) / (w.sum() + INTERCEPT_PRIOR), float(b))




def test_step_costs_are_linear_between_and_beyond_the_measured_widths_and_contexts():
    c = StepCost([1, 2, 4], [32, 512], [[1.0, 1.0, 2.0], [2.0, 3.0, 5.0]])
    assert c(1, 32) == 1.0 and c(3, 32) == 1.5 and c(8, 32) == 4.0  # beyond 4: the slope of the last two
    assert c(2, 272) == 2.0 and c(2, 992) == 5.0  # halfway between the contexts; beyond, the same slope
    assert c(1, 0) == 1 - 32 / 480  # below the short context too (never under half of it)
    c.observe(2, 4, 32, 2.2)  # a drafting step of two sequences, 0.2 s beyond its forward (its extra rows: 1.0 s)
    a, b = ridge([(1.0, 1.2)], 0.0)  # shrunk toward plain steps' overhead (none measured: 0) and the table's slope
    assert 0 < a < 0.2 and 1 < b < 1.2
    assert c(2, 32, batch=2) == pytest.approx(1.0 + a) and c(4, 32, batch=2) == pytest.approx(1.0 + a + b)  # plain
    c.observe(1, 1, 32, 1.5)  # a plain step of one sequence measured 0.5 s beyond its forward   # ones as drafting
    assert c(1, 32, batch=1) == 1.5 and c(4, 32, batch=1) == 2.5 and c(4, 32, batch=3) == 2.0  # drafting: as plain
    c.observe(1, 4, 32, 2.2)  # until a drafting step is measured: 0.2 s beyond its forward, shrunk toward the 0.5
    a, b = ridge([(1.0, 1.2)], 0.5)
    assert c(1, 32, batch=1) == 1.5 and c(4, 32, batch=1) == pytest.approx(1.0 + a + b)
    assert 2.2 < c(4, 32, batch=1) < 2.5
    c.observe(1, 1, 32, 2.5)
    assert c.overhead[1].value == pytest.approx((0.5 + 1.5) / 2)  # the median of the recent ones
    assert not c.observe(1, 1, 32, 9.0)  # a stall, 4.5x what it expects: not learnt from
    assert c.overhead[1].value == pytest.approx(1.0) and not c.observe(1, 4, 32, 9.0)
    for _ in range(3):
        c.observe(1, 1, 32, 1.4)
    assert c.overhead[1].value == pytest.approx(0.4)  # the median: the 1.5 of one slow step weighs nothing
    frozen = StepCost([1], [32], [[1.0]], online=False)
    frozen.observe(1, 1, 32, 9.0)
    assert frozen.overhead == {} and frozen.fits == {}


def test_a_stalled_first_step_cannot_hold_a_batch_sizes_estimate():
    """The first step of a batch size may carry one-time work (6x its steps, seen at batch 16); the recent median
    forgets it as soon as the steps after it outnumber it, where a moving mean held it for hundreds of steps."""
    c = StepCost([1, 16], [32], [[0.003, 0.02]])
    c.observe(16, 16, 32, 0.12)  # the first plain step at batch 16: 100 ms beyond its 20 ms forward
    for _ in range(2):
        c.observe(16, 16, 32, 0.023)
    assert c(16, 32, batch=16) == pytest.approx(0.023)


def test_drafting_steps_fit_what_their_extra_rows_really_cost():
    """Batch 4's drafting steps cost 0.3 s beyond a plain forward plus twice the table's time for their extra rows
    (B sequences of a few rows each, not the table's one sequence): once steps of several widths are seen, the fit
    finds both, so wide drafts are priced at twice the table. Steps of one width alone keep the table's slope, 1."""
    table = StepCost([1, 4, 8, 16], [32], [[1.0, 1.0, 2.0, 4.0]])  # batch 4's plain forward: 1 s
    for rows in [5, 6, 8, 12] * 20:
        extra = table.forward(rows, 32) - 1.0
        table.observe(4, rows, 32, 1.0 + 0.3 + 2 * extra)
    a, b = table.fits[4].coefficients()
    steps = [(table.forward(rows, 32) - 1.0, 0.3 + 2 * (table.forward(rows, 32) - 1.0)) for rows in [5, 6, 8, 12] * 20]
    assert (a, b) == pytest.approx(ridge(steps, 0.0))  # shrunk a little toward the table and toward plain steps
    assert 1.8 < b <= 2.0 and 0.2 < a < 0.4
    assert table(12, 32, batch=4) == pytest.approx(1.0 + 0.3 + 2 * 2.0, rel=0.03)
    assert table(4, 32, batch=4) == pytest.approx(1.0 + a)  # no plain step measured: the fit's intercept
    one_width = StepCost([1, 4, 8, 16], [32], [[1.0, 1.0, 2.0, 4.0]])
    for _ in range(10):
        one_width.observe(4, 8, 32, 1.0 + 0.3 + 2 * 1.0)
    a, b = one_width.fits[4].coefficients()
    assert (a, b) == pytest.approx(ridge([(1.0, 2.3)] * 10, 0.0))
    assert one_width(8, 32, batch=4) == pytest.approx(3.3, rel=0.03)  # what its steps took, split between the two


def test_one_slow_drafting_step_cannot_price_every_row_out():
    """A batch size's first drafting step may carry one-time work (here 5 s beyond a 1 s forward, under the stall
    filter's 3x). Unshrunk, the fit's intercept took it all and priced the next row at 5 s where the table says 0.1,
    so nothing drafted again and nothing corrected it; shrunk toward what plain steps add, the price stays within
    a few times the table's and the steps after it bring it down."""
    c = StepCost([1, 2, 4], [32], [[1.0, 1.1, 1.3]])
    for _ in range(8):
        c.observe(1, 1, 32, 1.0)  # plain steps: nothing beyond their forward
    c.observe(1, 3, 32, 1.2 + 2.0)  # the first drafting step of two rows: 2 s of one-time work
    assert c(2, 32, batch=1) - c(1, 32, batch=1) < 1.0
    first = c(2, 32, batch=1) - c(1, 32, batch=1)
    for _ in range(30):
        c.observe(1, 3, 32, 1.2)
    after = c(2, 32, batch=1) - c(1, 32, batch=1)
    assert after == pytest.approx(0.1, abs=0.02) and after < first


def test_a_batch_prices_the_row_that_starts_a_kernel_pass_at_what_it_costs():
    """The CPU kernels multiply 8 rows per pass over the weights, so 17 rows cost a step more than 16: the measured
    widths take the width past each multiple of 8, and a batch of 16 with two near-certain drafts pays for them only
    where the pass it starts is priced in (times: 1.0 + 0.04 a row, 0.2 more per pass begun after the first)."""
    def step(w: int) -> float:
        return 1.0 + 0.04 * (w - 1) + 0.2 * ((w - 1) // 8)

    table = cost.measure(lambda context, widths, repeats: {w: step(w) for w in widths}, 24, 600)
    assert {8, 9, 16, 17, 24} <= set(table.rows)
    assert table(17, 32, 16) == pytest.approx(step(17)) and table(20, 32, 16) == pytest.approx(step(20))
    sure = [Item(i, 1, 0.95) for i in range(2)]  # 17.9 tokens in 2.08 s: 8.61/s against 16 / 1.8 = 8.89/s
    assert plan(sure, 16, 32, table).rows == [0] * 16
    # interpolated from 16 to 24 rows, they would seem to pay: 17.9 / 1.93 = 9.27/s
    blind = StepCost([w for w in table.rows if w % 8 != 1], [32], [[step(w) for w in table.rows if w % 8 != 1]])
    assert plan(sure, 16, 32, blind).rows[:2] == [1, 1]
    # a whole pass of near-certain rows pays either way: 16 + 8 * 0.95 = 23.6 tokens in 2.32 s
    assert plan([Item(i, 1, 0.95) for i in range(8)], 16, 32, table).rows[:8] == [1] * 8


def test_costs_are_measured_once_per_model_machine_and_kernels_and_leave_no_trace(tiny_llama_dir, tmp_path,
                                                                                 monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    measured = []
    real = cost.measure

    def counting(*args):
        measured.append(args[1:])
        return real(*args)

    monkeypatch.setattr(cost, "measure", counting)
    # a tiny model's forwards take about the same time at every width: too flat for the busy-machine check to be
    # steady on a loaded CI machine (that check has its own test below)
    monkeypatch.setattr(cost.StepCost, "plausible", lambda self: True)
    monkeypatch.setattr(cost, "SPOT_CHECK_SLACK_S", 1.0)  # nor for the spot check of the cached table (its own test)
    llm = LLM(str(tiny_llama_dir), speculative_config={"method": "ngram", "num_speculative_tokens": 3}, block_size=4)
    table = llm.engine.speculator.planner.cost
    assert len(measured) == 1 and table.rows[:8] == [1, 2, 3, 4, 5, 6, 8, 9] and len(table.contexts) == 2
    assert all(s > 0 for row in table.seconds for s in row)
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1
    e = llm.engine  # scratch blocks, given back in their order: no request, no prefix entry, no counter
    assert e.allocator.num_used == 0 and e.allocator.free_blocks == list(range(e.allocator.num_blocks - 1, 0, -1))
    assert e.stats()["prefix_cache_queried_tokens"] == 0 and not e.has_unfinished()
    again = LLM(str(tiny_llama_dir), speculative_config={"method": "ngram", "num_speculative_tokens": 3}, block_size=4)
    assert len(measured) == 1 and again.engine.speculator.planner.cost.seconds == table.seconds  # read from the cache
    assert time_verification(e, 8, [1, 3], repeats=1).keys() == {1, 3}
    # other kernels (a changed source, flags or instruction set) cost otherwise: their table is measured anew
    monkeypatch.setattr(cost.native, "build_key", lambda isa=None: "another-build")
    LLM(str(tiny_llama_dir), speculative_config={"method": "ngram", "num_speculative_tokens": 3}, block_size=4)
    assert len(measured) == 2 and len(list((tmp_path / "costs").glob("*.json"))) == 2


def test_a_table_a_busy_machine_measured_is_measured_again_and_never_cached(tmp_path, monkeypatch):
    """A wider forward timed faster than a narrower one, or a width costing more than 1.5x a row per row, is a busy
    machine's table: measured again (up to MEASURE_ATTEMPTS), used but not cached when it stays so, and a cached
    one like it is measured again."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    quiet = StepCost([1, 2, 4], [32, 512], [[1.0, 1.1, 1.5], [1.1, 1.2, 1.7]])
    assert quiet.plausible()
    assert not StepCost([1, 2, 4], [32], [[0.72, 0.03, 0.02]]).plausible()  # a first forward that waited
    assert not StepCost([1, 2, 4], [32], [[1.0, 1.1, 9.0]]).plausible()  # 4 rows at 9 times one
    assert not StepCost([1, 2], [32, 512], [[1.0, 1.1], [0.5, 1.2]]).plausible()  # a long context much faster

    def timer(busy: list[bool]):
        def time_rows(context, widths, repeats):
            noisy = busy.pop(0) if len(widths) > 1 and busy else False  # a whole table's first call per attempt
            return {w: (0.5 if noisy and w == 1 else 0.01 * (1 + 0.2 * w)) for w in widths}
        return time_rows

    calls = [True, False, False, False]  # the first attempt's short context is noisy, the second attempt is quiet
    table = cost.measure(timer(calls), 8, 600)
    assert table.plausible() and not calls[-1:]
    key = "busy-test"
    stays_busy = cost.load_or_measure(key, lambda: cost.measure(timer([True] * 9), 8, 600))
    assert not stays_busy.plausible() and not list((tmp_path / "costs").glob("*.json"))  # used, not cached
    path = tmp_path / "costs" / f"{key}.json"
    path.parent.mkdir()
    path.write_text(json.dumps(stays_busy.to_json()))  # a table an older version cached while the machine was busy
    assert cost.load_or_measure(key, lambda: quiet) is quiet
    assert json.loads(path.read_text())["seconds"] == quiet.seconds
    # A plausible cached table that one fresh forward contradicts (an oversubscribed machine's, every width 250x
    # slower alike) is measured again; one the fresh forward agrees with is kept.
    fresh = StepCost([1, 2, 4], [32, 512], [[0.004, 0.0044, 0.006], [0.0045, 0.005, 0.0068]])
    assert cost.load_or_measure(key, lambda: fresh, spot_check=lambda context: 0.0041) is fresh  # 1.0 s cached
    assert json.loads(path.read_text())["seconds"] == fresh.seconds

    def never() -> StepCost:
        raise AssertionError("a table the spot check agrees with is not measured again")

    kept = cost.load_or_measure(key, never, spot_check=lambda context: 0.0039)
    assert kept.seconds == fresh.seconds
    assert cost.load_or_measure(key, never, spot_check=lambda context: 0.0049).seconds == fresh.seconds  # 1 ms slack
    assert cost.load_or_measure(key, lambda: quiet, spot_check=lambda context: 0.02) is quiet  # 5x: measured again


def test_a_quiet_tables_noise_is_lowered_to_what_wider_and_longer_forwards_took():
    """A plausible table whose narrower width (or shorter context) timed above a wider (longer) one by noise is
    lowered to the least of those: noise slows a forward, it never speeds one. A busy machine's table stays as
    measured (it is measured again and never cached)."""
    ms = 1e-3
    noisy = {32: {1: 1.00, 2: 1.05, 3: 1.30, 4: 1.25, 5: 1.40}, 512: {1: 1.30, 2: 1.20, 3: 1.50, 4: 1.55, 5: 1.35}}
    table = cost.measure(lambda context, widths, repeats: {w: noisy[context][w] * ms for w in widths}, 5, 600)
    short, long = table.seconds  # each entry the least of the wider and longer ones
    assert short == pytest.approx([x * ms for x in (1.0, 1.05, 1.25, 1.25, 1.35)])
    assert long == pytest.approx([x * ms for x in (1.2, 1.2, 1.35, 1.35, 1.35)])
    busy = {32: {1: 5.0, 2: 1.05, 3: 1.10, 4: 1.2, 5: 1.3}, 512: {1: 5.0, 2: 1.2, 3: 1.5, 4: 1.55, 5: 1.6}}
    stays = cost.measure(lambda context, widths, repeats: {w: busy[context][w] * ms for w in widths}, 5, 600)
    assert not stays.plausible() and stays.seconds[0][0] == 5.0 * ms
    # a model whose forward takes over SLOW_FORWARD_S is timed once per shape, at any number of widths
    slow = cost.measure(lambda context, widths, repeats: {w: noisy[context][w] for w in widths}, 3, 600)
    assert slow.rows == [1, 2, 3] and slow.seconds[0] == [1.0, 1.05, 1.30]
