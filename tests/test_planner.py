"""engine/planner.py: the cost model's decisions on plain values: which chain a request verifies among its
alternatives (and what the passed-over ones teach), the probes, and what a step's time and tokens teach."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from specdec.drafting import Draft
from specdec.engine.cost import CALIBRATION_DECAY, PROBE_EVERY, Plan, TimeCalibration
from specdec.engine.planner import DraftPlanner
from specdec.engine.step_cost import StepCost

LINEAR = StepCost([1, 2], [32], [[1.0, 1.2]], online=False)  # each row past the first costs 0.2 plain steps


def seq(seq_id: int, tokens: list[int], drafts: int = 0) -> SimpleNamespace:
    """What the planner reads of a sequence."""
    return SimpleNamespace(seq_id=seq_id, token_ids=tokens, spec=SimpleNamespace(num_drafts=drafts))


def test_a_request_verifies_the_chain_worth_most_and_learns_what_the_others_would_have_kept():
    planner = DraftPlanner()
    planner.cost = LINEAR
    s = seq(0, [1, 2, 3])
    draft = Draft.chains([[7, 8]])
    draft.evidence, draft.alternatives = ["weak"], [[([5, 6, 9], "strong")]]
    rates = {"weak": [0.3, 0.1], "strong": [0.9, 0.8, 0.1]}  # past the row price 0.2: 0.1 against 1.3
    chosen, evidence = planner.choose([s], draft, list(draft.evidence), [3], 32, lambda i, n, e: rates[e][:n])
    assert chosen.host_rows()[0] == [[5, 6, 9]] and evidence == ["strong"]
    s.token_ids += [7, 8, 4]  # the target went the passed-over chain's way for two tokens
    planner.learn_shadows([s])
    weak = planner.source["weak"]
    assert weak.drafted[:2] == [1, 1] and weak.kept[:2] == [1, 1]  # both of its tokens would have been kept
    planner.learn_shadows([s])  # learnt once
    assert planner.source["weak"].drafted[:2] == [1, 1]


def test_an_idle_request_is_probed_with_one_row_on_every_probe_every_th_step():
    planner = DraftPlanner()
    s = seq(0, [1, 2, 3])
    rows = [planner.probe([s], [4], [0], False)[0] for _ in range(2 * PROBE_EVERY)]
    assert [i + 1 for i, r in enumerate(rows) if r] == [PROBE_EVERY, 2 * PROBE_EVERY] and set(rows) == {0, 1}
    whole = DraftPlanner()  # a tree is probed whole
    assert [whole.probe([s], [6], [0], True)[0] for _ in range(PROBE_EVERY)][-1] == 6
    deeper = DraftPlanner()  # every PROBE_EVERY-th draft verifies one position past the ones that pay
    assert deeper.probe([seq(1, [1], drafts=PROBE_EVERY - 1)], [4], [2], False) == [3]


def test_probes_spend_only_their_credit_longest_idle_first_and_are_part_of_the_plan():
    planner = DraftPlanner()
    planner.cost = StepCost([1, 4, 5, 7, 8], [32], [[0.004, 0.010, 0.015, 0.018, 0.024]])
    seqs = [seq(i, list(range(32))) for i in range(4)]
    planner.idle = {2: 5}  # request 2 has been idle longest
    planner.probe_credit = 0.006  # one probe row (5 ms) of the four
    for _ in range(PROBE_EVERY):
        planner.start_step(32.0)
        rows = planner.probe(seqs, [4] * 4, [0] * 4, False, gain=lambda i, a, b: 0.5 * (b - a))
    assert rows == [0, 0, 1, 0] and planner.plan.rows == rows
    assert planner.plan.seconds == pytest.approx(0.015) and planner.plan.tokens == pytest.approx(4.5)
    assert planner.probe_credit == pytest.approx(0.001)
    for _ in range(PROBE_EVERY):  # the others wait for credit: none at the next probe step
        planner.start_step(32.0)
        rows = planner.probe(seqs, [4] * 4, [0] * 4, False)
    assert rows == [0] * 4 and planner.plan is None
    planner.record_step(4, False, 4, 0.5)  # a step's share of credit, at most two steps' worth
    assert planner.probe_credit == pytest.approx(0.001 + 0.01)
    planner.cost.overhead.clear()  # (what that made-up step taught the costs)
    for _ in range(PROBE_EVERY):
        planner.start_step(32.0)
        rows = planner.probe(seqs, [4] * 4, [0] * 4, False)
    assert rows == [1, 1, 0, 1] and planner.plan.seconds == pytest.approx(0.018)  # 8 ms of the 11 (four: 14)


def test_a_steps_tokens_and_time_correct_the_plan_they_were_predicted_by():
    planner = DraftPlanner()
    planner.cost = StepCost([1, 2, 3], [32], [[0.004, 0.0044, 0.0048]])
    s = seq(0, list(range(32)))
    planner.start_step(32.0)
    rows = planner.plan_budgets([s], [2], 2, False, 32.0)
    assert rows == [2] and planner.plan.tokens == pytest.approx(1 + 0.5 + 0.35)  # the prior
    planner.drafted(1, 2, 2, 0.0002, early=False)
    assert planner.plan.seconds == pytest.approx(0.0048 + 0.0002)
    planner.record_step(1, True, 3, 0.0050)  # both drafts kept
    assert planner.calibration[1].factor > 1 and planner.prediction.measured_tokens == 3
    assert planner.token_calibration(4) is planner.calibration[1]  # a size without drafting steps: the nearest's
    assert planner.plan is None and planner.step == (0, 0.0, 0.0)


def test_a_batch_size_without_drafting_steps_of_its_own_is_priced_as_its_nearest():
    planner = DraftPlanner()
    planner.cost = StepCost([1, 2, 4, 16, 17, 20], [32], [[0.004, 0.0044, 0.005, 0.012, 0.0135, 0.015]])
    slow = TimeCalibration()
    for _ in range(20):
        slow.record(1.5, 1.0)  # batch 16's drafting steps take 1.5x their costs
    planner.timing[16] = slow
    assert planner.time_calibration(15) is slow and planner.time_calibration(2) is slow
    planner.timing[4] = TimeCalibration()
    assert planner.time_calibration(2) is planner.timing[4] and planner.time_calibration(10) is planner.timing[4]
    seqs = [seq(i, list(range(32))) for i in range(15)]
    planner.start_step(32.0)
    planner.plan_budgets(seqs, [1] * 15, 1, False, 32.0)
    assert planner._time_factor == pytest.approx(slow.factor)  # priced at batch 16's 1.5x
    # batch 15's first drafting step: its own calibration starts from batch 16's, then learns
    planner.plan, planner.step = Plan([1] + [0] * 14, 15.5, 0.013 * slow.factor, 0.0114), (1, 32.0, 0.0)
    planner.record_step(15, True, 16, 0.013)
    own = planner.timing[15]
    assert own is not slow and own.weight == pytest.approx(slow.weight * CALIBRATION_DECAY + 1)
    assert 1.0 < own.factor < slow.factor  # (a step that ran to its costs, after 20 at 1.5x)


def test_plain_decoding_is_predicted_without_the_planning_a_plain_engine_never_does():
    planner = DraftPlanner()
    planner.cost = StepCost([1, 2], [32], [[0.004, 0.0044]])
    s = seq(0, list(range(32)))
    planner.start_step(32.0)
    planner.planned(0.0003)  # the speculator's own host work this step, no draft made first
    planner.record_step(1, False, 1, 0.0048)  # a plain step: 0.8 ms past the forward, 0.3 of them planning
    assert planner.cost.overhead[1].value == pytest.approx(0.0008)  # plans price plain steps as this engine runs them
    assert planner.prediction.seconds == pytest.approx(0.004) and planner.prediction.plain_seconds == \
        pytest.approx(0.0037)  # (predicted before it taught anything: the table's forward)
    planner.start_step(32.0)
    rows = planner.plan_budgets([s], [1], 1, False, 32.0)  # one row at the prior 0.5 for 0.4 ms: it pays
    assert rows == [1] and planner.plan.plain_seconds == pytest.approx(0.0048)
    planner.planned(0.0002)
    planner.drafted(1, 1, 1, 0.0, early=False)
    planner.record_step(1, True, 2, 0.0052)
    assert planner.prediction.plain_seconds == pytest.approx(0.0037 + 1.5 * (0.0048 - 0.0003))
    planner.start_step(32.0)
    planner.step = (0, 32.0, 0.00005)  # a draft made first: 0.05 ms of the 0.1 are drafting, not planning
    planner.planned(0.0001)
    assert planner._planning_s == pytest.approx(0.00005)


def test_a_proposal_not_verified_is_learnt_once_the_tokens_after_it_decide_it():
    """`shadow`: a chain whose first token matched the one token committed since is not learnt yet (learnt then, as
    a draft that reached one position, the positions after it would be learnt from the chains that failed early
    alone); it is learnt when a token differs or every token matched."""
    planner = DraftPlanner()
    s = seq(0, [1, 2, 3])
    planner.shadow(s, [7, 8, 9], "a")
    planner.shadow(s, [5, 6], "b")
    s.token_ids.append(7)  # a plain step: "a" matches so far, "b" is decided (kept 0 of 2)
    planner.learn_shadows([s])
    assert "a" not in planner.source and planner.source["b"].drafted == [1, 1] and planner.source["b"].kept == [0, 0]
    s.token_ids += [8, 4]  # a drafting step of two tokens: "a" kept 2 of its 3
    planner.learn_shadows([s])
    a = planner.source["a"]
    assert a.drafted == [1, 1, 1] and a.kept == [1, 1, 0] and planner._shadows[0] == []
    planner.shadow(s, [1, 2], "c")
    s.token_ids += [1, 2]  # every token matched: kept both
    planner.learn_shadows([s])
    assert planner.source["c"].kept == [1, 1]
    planner.shadow(s, [1], "d")
    planner.release(0)  # a finished request's pending shadows go with it
    assert 0 not in planner._shadows

