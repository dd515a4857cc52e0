"""engine/cost.py: the acceptance estimates and the plan that decides how much each request drafts, as exact tables;
and every model speculating by default under it."""
from __future__ import annotations

import dataclasses

import pytest

from specdec import LLM, SamplingParams
from specdec.engine import cost
from specdec.engine.cost import (
    WORTH_DECAY,
    Acceptance,
    DraftingWorth,
    Item,
    TimeCalibration,
    plan,
    prior_rates,
)
from specdec.engine.step_cost import STALL, StepCost

LINEAR = StepCost([1, 2], [32], [[1.0, 1.2]], online=False)  # each row past the first costs 0.2 plain steps


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
    predicted = llm.engine.speculator.planner.prediction.summary()
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
        llm.engine.speculator.planner.cost = LINEAR
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
