"""engine/cost.py: the measured step costs, the acceptance estimates and the plan that decides how much each request
drafts, as exact tables; and every model speculating by default under it."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from specdec import LLM, SamplingParams
from specdec.engine import cost
from specdec.engine.cost import (
    INTERCEPT_PRIOR,
    ONLINE,
    SLOPE_PRIOR,
    SLOPE_RANGE,
    STALL,
    WORTH_DECAY,
    Acceptance,
    DraftingWorth,
    Item,
    StepCost,
    TimeCalibration,
    plan,
    prior_rates,
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


LINEAR = StepCost([1, 2], [32], [[1.0, 1.2]], online=False)  # each row past the first costs 0.2 plain steps


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


def test_acceptance_is_shrunk_toward_the_prior_and_never_rises_with_depth():
    a = Acceptance()
    assert a.rates(3, [0.5, 0.4, 0.3], 4) == [0.5, 0.4, 0.3]  # nothing measured: the prior
    for kept in (2, 2, 0, 3):
        a.record(3, kept)
    assert a.drafted == [4, 4, 4] and a.kept == [3, 3, 1]
    assert a.rates(3, [0.5, 0.4, 0.3], 4) == pytest.approx([5 / 8, 4.6 / 8, 2.2 / 8])  # (kept + 4 prior) / (n + 4)
    a.record(1, 1)  # position 2 (0.4 prior) would estimate higher than position 1: capped
    assert a.rates(2, [0.5, 0.9], 4) == pytest.approx([6 / 9, 6 / 9])
    recent = Acceptance(decay=0.5)
    recent.record(1, 1)
    recent.record(1, 0)
    assert recent.drafted == [1.5] and recent.kept == [0.5]  # the older draft weighs half
    assert prior_rates(8)[:6] == list(cost.PRIOR) and prior_rates(8)[7] == pytest.approx(cost.PRIOR[-1] * 0.49)


def test_the_plan_takes_the_rows_that_maximize_tokens_per_second():
    # one request: (1 + 0.9 + 0.7) / 1.4 = 1.857 beats (1 + 0.9) / 1.2 = 1.583 and (1 + 0.9 + 0.7 + 0.3) / 1.6 = 1.8125
    p = plan([Item(0, 1, g) for g in (0.9, 0.7, 0.3, 0.1)], 1, 32, LINEAR)
    assert p.rows == [2] and p.tokens == pytest.approx(2.6) and p.seconds == pytest.approx(1.4) and p.plain_seconds == 1
    # rows that keep less than they cost are not verified: plain decoding's 1 token per second wins
    assert plan([Item(0, 1, 0.15), Item(0, 1, 0.1)], 1, 32, LINEAR).rows == [0]
    # drafting that costs 0.5 s must pay for itself: 2.6 / 1.9 = 1.37 still beats 1, 1.2 / 1.7 does not
    assert plan([Item(0, 1, g) for g in (0.9, 0.7)], 1, 32, LINEAR, draft_seconds=0.5).rows == [2]
    assert plan([Item(0, 1, 0.2)], 1, 32, LINEAR, draft_seconds=0.5).rows == [0]
    # a batch: the best rows per row of any request first; a tree is one item of all its nodes. Plain: 3 / 1.4 = 2.14;
    # then 3.9 / 1.6 = 2.44, with the tree 5.9 / 2.4 = 2.46, with the second row 6.1 / 2.6 = 2.35: the first two
    batch = [Item(0, 1, 0.9), Item(0, 1, 0.2), Item(1, 4, 2.0), Item(2, 1, 0.1)]
    assert plan(batch, 3, 32, LINEAR).rows == [1, 4, 0]
    # where every row is nearly free, everything expected to keep anything pays
    flat = StepCost([1, 64], [32], [[1.0, 1.0 + 63 * 0.001]], online=False)
    assert plan(batch, 3, 32, flat).rows == [2, 4, 1]


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


def test_costs_are_measured_once_per_model_and_machine_and_leave_no_trace(tiny_llama_dir, tmp_path, monkeypatch):
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
    table = llm.engine.speculator.cost
    assert len(measured) == 1 and table.rows[:8] == [1, 2, 3, 4, 5, 6, 8, 9] and len(table.contexts) == 2
    assert all(s > 0 for row in table.seconds for s in row)
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1
    e = llm.engine  # scratch blocks, given back in their order: no request, no prefix entry, no counter
    assert e.allocator.num_used == 0 and e.allocator.free_blocks == list(range(e.allocator.num_blocks - 1, 0, -1))
    assert e.stats()["prefix_cache_queried_tokens"] == 0 and not e.has_unfinished()
    again = LLM(str(tiny_llama_dir), speculative_config={"method": "ngram", "num_speculative_tokens": 3}, block_size=4)
    assert len(measured) == 1 and again.engine.speculator.cost.seconds == table.seconds  # read from the cache
    assert time_verification(e, 8, [1, 3], repeats=1).keys() == {1, 3}


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


def test_every_model_speculates_by_default_and_decodes_what_plain_decoding_does(tiny_llama_dir):
    """A model with no tuned default gets model-free drafting under the cost model; its text is plain decoding's,
    and the plans' predictions are kept beside the steps' measured times."""
    llm = LLM(str(tiny_llama_dir))
    assert llm.engine.speculative.method == "ngram" and llm.engine.speculative.adaptive
    off = LLM(str(tiny_llama_dir), speculative_config="off")
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]}, {"prompt_token_ids": [40, 41, 42]}]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in off.generate(prompts, params)]
    assert sum(o.metrics["num_drafts"] for o in outs) > 0  # repeating text: drafts paid
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=32, ignore_eos=True)
    assert llm.generate(prompts, seeded)[0].token_ids == off.generate(prompts, seeded)[0].token_ids
    predicted = llm.engine.speculator.prediction.summary()
    # the predictions against the steps: tokens as expected (timing on a loaded machine may put a tiny model's
    # predicted speedup either side of 1, since its proposals cost a fifth of a 0.5 ms step)
    assert predicted["steps"] > 0 and predicted["predicted_speedup"] > 0.5 and predicted["seconds_ratio"] > 0
    assert 0.8 <= predicted["tokens_ratio"] <= 1.25, predicted


def test_drafters_that_size_their_own_drafts_are_given_the_measured_row_cost(tiny_llama_dir):
    """The switch and the hybrid weigh a node against `DraftRequest.row_cost`: what one more verified row costs this
    step in plain steps, from the engine's costs (0.2 in a made-up linear table); nothing without the cost model."""
    from specdec.drafting import Draft, Drafter, DraftRequest
    from specdec.drafting.hybrid import HybridDrafter
    from specdec.drafting.switch import SwitchDrafter

    class Recorder(Drafter):
        def __init__(self):
            self.costs, self.plain = [], []

        def propose(self, requests):
            self.costs += [r.row_cost for r in requests]
            self.plain += [r.plain_seconds for r in requests]
            return Draft.chains([[7] * r.max_tokens for r in requests])

    for adaptive, want in ((True, 0.2), (False, None)):
        recorder = Recorder()
        llm = LLM(str(tiny_llama_dir), speculative_config={"method": "custom", "num_speculative_tokens": 2,
                                                           "adaptive": adaptive, "drafter": recorder})
        llm.engine.speculator.cost = LINEAR
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        assert recorder.costs and all(c == (pytest.approx(want) if want else None) for c in recorder.costs)
        assert all(p == (1.0 if want else None) for p in recorder.plain)  # a plain step of one: 1 s in LINEAR
    r = DraftRequest(0, [1] * 500, 1, 4)
    switch = SwitchDrafter.__new__(SwitchDrafter)
    switch.token_cost, switch.context_cost = 0.1, 0.07
    assert switch.node_cost(r) == pytest.approx(0.1 + 0.07 * 0.5)  # its own constants, without a measured cost
    r.row_cost = 0.3
    assert switch.node_cost(r) == 0.3
    hybrid = HybridDrafter.__new__(HybridDrafter)
    hybrid.min_score = 0.15
    assert hybrid.threshold(r) == 0.3 and hybrid.threshold(dataclasses.replace(r, row_cost=None)) == 0.15


def test_drafting_steps_that_run_over_their_costs_are_priced_at_what_they_take():
    """A batch size's drafting steps measured 10% over their predicted time: the time calibration moves toward
    1.1 (from 1, with the weight of a few steps; a stall's ratio clipped to 2), and a plan that paid by 5% at the
    costs alone drafts nothing at the calibrated ones."""
    t = TimeCalibration()
    assert t.factor == 1.0
    for _ in range(200):
        t.record(1.1, 1.0)
    assert t.factor == pytest.approx((4 + 1.1 * 50) / (4 + 50), rel=1e-3)  # 50 steps' weight at decay 0.98
    stalled = TimeCalibration()
    stalled.record(50.0, 1.0)
    assert stalled.factor == pytest.approx((4 + 2) / 5)
    flat = StepCost([1, 2], [32], [[1.0, 1.0]], online=False)  # a second row costs nothing...
    items = [Item(0, 1, 0.05)]  # ...and adds 0.05 tokens: 5% faster, past MARGIN
    assert plan(items, 1, 32, flat).rows == [1]
    assert plan(items, 1, 32, flat, time_factor=1.1).rows == [0]
    assert plan(items, 1, 32, flat, draft_seconds=0.01).draft_seconds == 0.01


def test_a_plans_widths_are_the_step_costs_it_would_ask_one_by_one():
    """`StepCost.widths` prices every prefix of a plan at once: the same seconds as asking each width, between and
    beyond the measured contexts, with and without a batch size's plain overhead and drafting-step fit."""
    cost = StepCost([1, 2, 4, 8], [32, 512], [[1.0, 1.1, 1.5, 2.6], [1.4, 1.6, 2.1, 3.5]])
    for batch in (1, 4):
        for context in (0, 32, 200, 512, 2000):
            assert cost.widths(batch, context, 12) == pytest.approx([cost(batch + n, context, batch)
                                                                     for n in range(13)])
    cost.observe(4, 4, 200, 2.6)  # a plain step's overhead, then drafting steps' fit
    for rows, seconds in ((6, 3.4), (8, 4.0), (5, 3.1)):
        cost.observe(4, rows, 200, seconds)
    assert cost.fits[4].coefficients()[1] != 1.0
    for context in (32, 300, 700):
        assert cost.widths(4, context, 20) == pytest.approx([cost(4 + n, context, 4) for n in range(21)])


def test_proposing_first_pays_while_its_plans_saved_more_than_the_proposals_took():
    """Decayed sums of what the plans expected to save and what proposing took; a proposal far over the recent
    median (a first one indexing a prompt) counts at STALL times it, and a plan saves nothing below zero."""
    worth = DraftingWorth()
    assert worth.pays  # nothing measured yet
    for _ in range(10):
        worth.record(0.002, 0.001)
    assert worth.pays
    worth.record(0.0, 1.0)  # one stalled proposal: counted at STALL times the median
    assert worth.spent == pytest.approx(0.001 * sum(WORTH_DECAY ** j for j in range(1, 11)) + STALL * 0.001)
    assert worth.pays
    for _ in range(20):
        worth.record(-0.5, 0.001)  # plans that take nothing (or lose) save nothing
    assert not worth.pays and worth.saved >= 0
