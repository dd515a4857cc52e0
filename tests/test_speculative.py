"""Speculative decoding end to end: output never changes, whatever the drafter proposes."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from conftest import accelerator_checks, assert_logprobs_equal, every_step

from specdec import LLM, SamplingParams, SpecdecError
from specdec.drafting import Draft, Drafter, DraftRequest
from specdec.drafting.registry import SpeculativeConfig
from specdec.engine.cost import PROBE_EVERY, WORTH_PROBE
from specdec.engine.scheduler import ScheduledBatch
from specdec.engine.step_cost import StepCost

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "1 2 3 4 5 6 7 8 9 10 1 2 3 4", "def add(a, b):\n    return a + b\n\ndef add(",
           "Hello world, speculative decoding is fast. Hello world"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), speculative_config="off")


@pytest.fixture(scope="module")
def reference(plain) -> list[list[int]]:
    return [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]


class ScriptedDrafter(Drafter):
    """Proposes the true continuation (from `truth`) with some positions corrupted."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], k: int, corrupt_every: int = 0):
        self.truth, self.k, self.corrupt_every, self.calls = truth, k, corrupt_every, 0

    def propose(self, requests: list[DraftRequest]) -> Draft:
        proposals = []
        for r in requests:
            self.calls += 1
            for prompt, full in self.truth.items():
                if tuple(r.token_ids[: len(prompt)]) == prompt:
                    done = len(r.token_ids) - len(prompt)
                    guess = list(full[done: done + min(self.k, r.max_tokens)])
                    if self.corrupt_every and guess and self.calls % self.corrupt_every == 0:
                        guess[len(guess) // 2] = (guess[len(guess) // 2] + 1) % 300
                    proposals.append(guess)
                    break
            else:
                proposals.append([])
        return Draft.chains(proposals)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_greedy_equals_plain(tiny_llama_dir, reference, k):
    llm = LLM(str(tiny_llama_dir), speculative_config=every_step({"method": "ngram", "num_speculative_tokens": k}))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.metrics["num_drafts"] for o in outs) > 0  # speculation actually happened
    assert llm.engine.allocator.num_used == 0


def test_oracle_drafter_is_fully_accepted(tiny_llama_dir, plain, reference):
    truth = {tuple(plain.encode(p)[1]): ref for p, ref in zip(PROMPTS, reference)}
    llm = LLM(str(tiny_llama_dir), speculative_config=every_step({"method": "custom", "num_speculative_tokens": 4,
                                                                  "drafter": ScriptedDrafter(truth, 4)}))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    for o in outs:
        m = o.metrics
        assert m["num_accepted_tokens"] == m["num_draft_tokens"] > 0
        assert m["acceptance_rate"] == 1.0 and m["acceptance_length"] > 3
        assert m["accepted_per_pos"][0] == m["num_drafts"]


def test_wrong_drafts_never_change_the_output(tiny_llama_dir, plain, reference):
    truth = {tuple(plain.encode(p)[1]): ref for p, ref in zip(PROMPTS, reference)}
    drafter = ScriptedDrafter(truth, 5, corrupt_every=2)
    llm = LLM(str(tiny_llama_dir), speculative_config=every_step({"method": "custom", "num_speculative_tokens": 5,
                                                                  "drafter": drafter}))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert any(o.metrics["acceptance_rate"] < 1 for o in outs)  # rejections happened, sequences ragged


def made_up_costs(llm: LLM, row_cost: float = 0.2) -> None:
    """Verifying each row beyond a plain step's costs `row_cost` plain steps, whatever this machine measures."""
    llm.engine.speculator.planner.cost = StepCost([1, 2], [32], [[1.0, 1.0 + row_cost]], online=False)


def test_requests_whose_drafts_keep_failing_stop_drafting_and_probe(tiny_llama_dir, plain, reference):
    """The cost model: a request whose drafts are wrong at every position is soon expected to keep less than a row
    costs (0.2 plain steps), so it stops drafting; once idle PROBE_EVERY steps it drafts one token on the engine's
    next PROBE_EVERY-th step (a probe). A drafter right every time drafts every step."""
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    want = plain.generate(PROMPTS[0], params)[0].token_ids
    bad = ScriptedDrafter({tuple(plain.encode(PROMPTS[0])[1]): want}, 4, corrupt_every=1)  # wrong from the middle
    bad.propose = lambda requests, orig=bad.propose: wrong_first(orig(requests))  # ... and at the first token
    llm = LLM(str(tiny_llama_dir), speculative_config={"method": "custom", "num_speculative_tokens": 4,
                                                       "drafter": bad})
    made_up_costs(llm)
    with llm.measuring.trace_speculation() as trace:
        out = llm.generate(PROMPTS[0], params)[0]
    assert out.token_ids == want
    m = out.metrics
    drafted = [n for _, n in trace if n]
    assert m["num_accepted_tokens"] == 0 and sum(drafted) == m["num_draft_tokens"]
    learning = next(i for i, n in enumerate(drafted) if n == 1)  # full drafts until their estimate falls
    assert 1 <= learning <= 4 and set(drafted[learning:]) == {1}
    probes = len(drafted) - learning
    assert 80 // PROBE_EVERY - 2 <= probes <= 80 // PROBE_EVERY  # (the first one once PROBE_EVERY steps idle)

    truth = {tuple(plain.encode(p)[1]): ref for p, ref in zip(PROMPTS, reference)}
    good = LLM(str(tiny_llama_dir), speculative_config={"method": "custom", "num_speculative_tokens": 4,
                                                        "drafter": ScriptedDrafter(truth, 4)})
    made_up_costs(good)
    m = good.generate(PROMPTS[0], GREEDY)[0].metrics
    assert m["num_drafts"] == m["num_steps"] - 1 and m["acceptance_rate"] == 1.0  # never stopped


class Evident(Drafter):
    """Drafts the true continuation where the sequence's length is even ("sure"), a wrong one where it is odd
    ("guess"), saying which (`Draft.evidence`); `drafts_first` as given."""

    def __init__(self, prompt: tuple[int, ...], want: list[int], drafts_first: bool):
        self.prompt, self.want, self.drafts_first = prompt, want, drafts_first
        self.asked = {"sure": 0, "guess": 0}

    def propose(self, requests: list[DraftRequest]) -> Draft:
        proposals, evidence = [], []
        for r in requests:
            done = len(r.token_ids) - len(self.prompt)
            kind = "sure" if len(r.token_ids) % 2 == 0 else "guess"
            truth = self.want[done:done + r.max_tokens]
            proposals.append(truth if kind == "sure" else [(t + 1) % 300 for t in truth])
            evidence.append(kind)
            self.asked[kind] += 1
        draft = Draft.chains(proposals)
        draft.evidence = evidence
        return draft


def test_a_drafter_that_drafts_first_is_planned_by_what_drafts_of_its_evidence_kept(tiny_llama_dir, plain):
    """`Drafter.drafts_first`: the speculator asks for the whole budget every step and prices each draft by what
    drafts of the same evidence kept. Rows cost 0.2 plain steps: every sure draft is verified, a guess only until
    its evidence's estimate falls and then on probes. Without evidence the plan sees their mix (half of the first
    tokens kept) and verifies guesses all along. The output is plain decoding's either way."""
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    want = plain.generate(PROMPTS[0], params)[0].token_ids
    prompt = tuple(plain.encode(PROMPTS[0])[1])
    runs = {}
    for first in (True, False):
        drafter = Evident(prompt, want, first)
        llm = LLM(str(tiny_llama_dir), speculative_config={"method": "custom", "num_speculative_tokens": 4,
                                                           "drafter": drafter})
        made_up_costs(llm)
        out = llm.generate(PROMPTS[0], params)[0]
        assert out.token_ids == want
        runs[first] = drafter, llm.engine.speculator.planner.source, out.metrics
    drafter, source, m = runs[True]
    sure, guess = source["sure"], source["guess"]
    assert sure.drafted[0] == sure.kept[0] == drafter.asked["sure"]  # every sure draft verified, and kept
    # every guess asked for is measured (verified, or learnt from the tokens after it), none verified once its
    # evidence's estimate fell: no forward probes for a drafter that drafts first
    assert guess.kept[0] == 0 and drafter.asked["guess"] - 2 <= guess.drafted[0] <= drafter.asked["guess"]
    wasted = m["num_draft_tokens"] - m["num_accepted_tokens"]
    assert wasted <= 4 * 8
    _, blind, m_blind = runs[False]
    assert set(blind) == {None}  # evidence is read only from a drafter that drafts first
    assert wasted < m_blind["num_draft_tokens"] - m_blind["num_accepted_tokens"]
    assert m["num_steps"] <= m_blind["num_steps"]


class Offering(Drafter):
    """Drafts first, offering two chains per request: a wrong one ("guess") as its row, the true continuation
    ("sure") as an alternative (`Draft.alternatives`), or only the guess where `sure_every` says so."""

    drafts_first = True

    def __init__(self, prompt: tuple[int, ...], want: list[int], sure_every: int = 1):
        self.prompt, self.want, self.sure_every = prompt, want, sure_every
        self.offered = 0

    def propose(self, requests: list[DraftRequest]) -> Draft:
        rows, others = [], []
        for r in requests:
            done = len(r.token_ids) - len(self.prompt)
            truth = self.want[done:done + r.max_tokens]
            rows.append([(t + 1) % 300 for t in truth])
            offer = truth and done % self.sure_every == 0
            others.append([(truth, "sure")] if offer else [])
            self.offered += bool(offer)
        draft = Draft.chains(rows)
        draft.evidence, draft.alternatives = ["guess"] * len(requests), others
        return draft


def test_the_chain_verified_is_the_one_its_evidence_prices_highest_and_the_other_is_still_measured(
        tiny_llama_dir, plain):
    """`Draft.alternatives`: each step the speculator verifies, per request, the chain whose evidence is expected to
    keep most beyond its rows' cost. Offered a wrong row and the true continuation, it verifies the wrong one only at
    the first step (the two evidences tie at the prior: the row), learns there what the passed-over truth would have
    kept (read off the tokens committed), and verifies the truth from then on; the guesses it passes over are
    measured all the same (nothing of theirs kept). Output is plain decoding's."""
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    want = plain.generate(PROMPTS[0], params)[0].token_ids
    drafter = Offering(tuple(plain.encode(PROMPTS[0])[1]), want)
    llm = LLM(str(tiny_llama_dir), speculative_config={"method": "custom", "num_speculative_tokens": 4,
                                                       "drafter": drafter})
    made_up_costs(llm)
    out = llm.generate(PROMPTS[0], params)[0]
    assert out.token_ids == want
    m, source = out.metrics, llm.engine.speculator.planner.source
    assert m["num_draft_tokens"] - m["num_accepted_tokens"] <= 2  # the first step's guess (and no other) was wrong
    sure, guess = source["sure"], source["guess"]
    assert sure.kept[0] == sure.drafted[0] >= m["num_drafts"]  # verified every step but the first, and measured there
    assert guess.kept[0] == 0 and guess.drafted[0] >= m["num_drafts"] - 1  # passed over (and once verified): measured
    assert m["num_steps"] <= len(want) // 3  # 4 drafted tokens a step, nearly all kept


def test_a_passed_over_chain_is_measured_where_only_it_was_offered(tiny_llama_dir, plain):
    """Where the true chain is offered only every third step, the steps in between have the guess alone: the cost
    model, having measured guesses (verified and passed over) keep nothing, verifies none of them beyond probes."""
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    want = plain.generate(PROMPTS[0], params)[0].token_ids
    drafter = Offering(tuple(plain.encode(PROMPTS[0])[1]), want, sure_every=3)
    llm = LLM(str(tiny_llama_dir), speculative_config={"method": "custom", "num_speculative_tokens": 4,
                                                       "drafter": drafter})
    made_up_costs(llm)
    out = llm.generate(PROMPTS[0], params)[0]
    assert out.token_ids == want
    m = out.metrics
    wasted = m["num_draft_tokens"] - m["num_accepted_tokens"]
    assert wasted <= 4 + 80 // PROBE_EVERY  # guesses: a first few, then probes
    assert m["num_accepted_tokens"] >= 2 * drafter.offered // 3  # most offered truths verified and kept


class Slow(Drafter):
    """Drafts first: the true continuation (`right`) or a wrong one, taking `seconds` per call; counts its calls."""

    drafts_first = True

    def __init__(self, prompt: tuple[int, ...], want: list[int], right: bool, seconds: float):
        self.prompt, self.want, self.right, self.seconds, self.calls = prompt, want, right, seconds, 0

    def propose(self, requests: list[DraftRequest]) -> Draft:
        self.calls += 1
        time.sleep(self.seconds)
        chains = []
        for r in requests:
            done = len(r.token_ids) - len(self.prompt)
            truth = self.want[done:done + r.max_tokens]
            chains.append(truth if self.right else [(t + 1) % 300 for t in truth])
        draft = Draft.chains(chains)
        draft.evidence = ["x"] * len(requests)
        return draft


def test_proposals_that_cost_more_than_their_drafts_save_are_made_one_step_in_a_few(tiny_llama_dir, plain):
    """`DraftingWorth`: a plain step of 4 ms, rows at 0.2 of it, and proposals of about 0.5 ms (under the 1.9 ms the
    prior expects 4 rows to save). Wrong drafts save nothing, so once measured the request is asked for a proposal only
    one step in WORTH_PROBE (or WORTH_PROBE + 1, in turn); right drafts save more than they cost, so it is asked every
    step. Output is plain decoding's either way."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    want = plain.generate(PROMPTS[0], params)[0].token_ids
    calls, probes = {}, {}
    for right in (False, True):
        drafter = Slow(tuple(plain.encode(PROMPTS[0])[1]), want, right, 0.0005)
        llm = LLM(str(tiny_llama_dir), speculative_config={"method": "custom", "num_speculative_tokens": 4,
                                                           "drafter": drafter})
        llm.engine.speculator.planner.cost = StepCost([1, 2], [32], [[0.004, 0.0048]], online=False)
        with llm.measuring.trace_speculation() as trace:
            out = llm.generate(PROMPTS[0], params)[0]
        assert out.token_ids == want
        calls[right] = (drafter.calls, out.metrics["num_steps"])
        probes[right] = [n for _, n in trace][2:]  # the drafts verified after the first two, which close the gate
    wrong_calls, wrong_steps = calls[False]
    assert wrong_steps // (WORTH_PROBE + 1) <= wrong_calls <= 4 + wrong_steps // WORTH_PROBE, calls
    # and none of its drafts is verified once they are measured wrong: what a proposal would have kept is learnt
    # from the tokens after it (`DraftPlanner.shadow`), so no forward probe spends a row on them
    assert probes[False] == [], probes
    right_calls, right_steps = calls[True]
    assert right_calls >= right_steps - 2 and right_steps <= len(want) // 3, calls  # (the prefill step asks none)


def test_a_chain_is_cut_where_the_requests_own_acceptance_stops_paying(tiny_llama_dir, plain, reference):
    """A drafter right at positions 1-2 and always wrong from 3 on, where a row costs 0.2 plain steps: the cost
    model verifies 2 tokens a step (3 on every PROBE_EVERY-th draft: a deeper probe), which keep all the drafter
    gets right; with `adaptive` off every draft has 4. Output unchanged."""
    truth = {tuple(plain.encode(p)[1]): ref for p, ref in zip(PROMPTS, reference)}
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)

    def run(adaptive: bool) -> dict:
        drafter = ScriptedDrafter(truth, 4)
        propose = drafter.propose

        def right_then_wrong(requests):
            d = propose(requests)
            return Draft.chains([[t if j < 2 else (t + 1) % 300 for j, t in enumerate(d.tokens[i, :n].tolist())]
                                 for i, n in enumerate(d.num_nodes())])

        drafter.propose = right_then_wrong
        llm = LLM(str(tiny_llama_dir), speculative_config={"method": "custom", "num_speculative_tokens": 4,
                                                           "adaptive": adaptive, "drafter": drafter})
        made_up_costs(llm)
        out = llm.generate(PROMPTS[0], params)[0]
        assert out.token_ids == plain.generate(PROMPTS[0], params)[0].token_ids
        return out.metrics

    full, cut = run(False), run(True)
    assert full["num_draft_tokens"] >= 4 * full["num_drafts"] - 4  # (shorter only near max_tokens)
    assert full["accepted_per_pos"][2:] == [0, 0] and cut["accepted_per_pos"][2:] in ([0, 0], [0], [])
    probes = cut["num_drafts"] // PROBE_EVERY + 1
    assert cut["num_draft_tokens"] <= 2 * cut["num_drafts"] + probes
    assert cut["num_draft_tokens"] < full["num_draft_tokens"]
    assert cut["num_accepted_tokens"] == full["num_accepted_tokens"]
    assert cut["num_steps"] <= full["num_steps"] + 1  # the cut positions were never accepted anyway


def test_a_config_for_greedy_requests_only_leaves_sampled_ones_plain(tiny_llama_dir, plain):
    """"sampled": false: a sampled request never drafts and, alone, takes the plain path (the same tokens as
    plain decoding with the same seed); a greedy request beside it still drafts."""
    llm = LLM(str(tiny_llama_dir), speculative_config=every_step({"method": "ngram", "num_speculative_tokens": 4,
                                                                  "prompt_lookup_min": 1, "sampled": False}))
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True)
    with llm.measuring.trace_speculation() as trace:
        out = llm.generate(PROMPTS[0], sampled)[0]
    assert not trace and out.metrics["num_drafts"] == 0
    assert out.token_ids == plain.generate(PROMPTS[0], sampled)[0].token_ids
    mixed = llm.generate([PROMPTS[0], PROMPTS[1]], [sampled, SamplingParams(temperature=0, max_tokens=30)])
    assert mixed[0].metrics["num_drafts"] == 0 and mixed[1].metrics["num_drafts"] > 0


def test_a_well_predicted_tree_is_not_throttled_by_its_siblings(tiny_llama_dir, plain, reference):
    """A tree of the right token and three wrong siblings: a quarter of its nodes are kept but every level is,
    so the request keeps drafting the whole tree (the throttle reads acceptance per level, not per node)."""
    truth = {tuple(plain.encode(p)[1]): ref for p, ref in zip(PROMPTS, reference)}
    chain = ScriptedDrafter(truth, 1)

    class Siblings(Drafter):
        def propose(self, requests):
            rows = []
            for r, guess in zip(requests, chain.propose(requests).tokens.tolist()):
                right = guess[0] if guess else 0
                rows.append(([right] + [(right + j) % 300 for j in (1, 2, 3)], [-1] * 4) if r.max_tokens >= 4
                            else ([right], [-1]))
            return Draft.from_rows(rows)

    llm = LLM(str(tiny_llama_dir), speculative_config=every_step({"method": "custom", "num_speculative_tokens": 4,
                                                                  "drafter": Siblings()}))
    out = llm.generate(PROMPTS[0], GREEDY)[0]
    assert out.token_ids == reference[0]
    m = out.metrics
    assert m["num_accepted_tokens"] == m["num_drafts"] and m["num_draft_tokens"] >= 4 * m["num_drafts"] - 3, m


def wrong_first(draft: Draft) -> Draft:
    if draft.tokens.shape[1]:
        draft.tokens[:, 0] = (draft.tokens[:, 0] + 1) % 300
    return draft


def test_stop_conditions_inside_an_accepted_draft(tiny_llama_dir, plain, reference):
    truth = {tuple(plain.encode(p)[1]): ref for p, ref in zip(PROMPTS, reference)}
    stop_token = reference[0][6]
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_token])
    llm = LLM(str(tiny_llama_dir), speculative_config=every_step({"method": "custom", "num_speculative_tokens": 5,
                                                                  "drafter": ScriptedDrafter(truth, 5)}))
    spec, ref = llm.generate(PROMPTS[0], params)[0], plain.generate(PROMPTS[0], params)[0]
    assert spec.token_ids == ref.token_ids and spec.finish_reason == "stop"
    short = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    assert llm.generate(PROMPTS, short)[1].token_ids == reference[1][:7]


class PairingDrafter(ScriptedDrafter):
    """The scripted drafter reading target features: it refuses a row whose next token was not kept, as a head's
    feed does (`EagleDrafter._catch_up` pairs row t's feature with token t + 1)."""

    feature_layers = (0,)

    def propose(self, requests: list[DraftRequest]) -> Draft:
        for r in requests:
            if r.features is not None and len(r.features) > len(r.token_ids) - 1 - r.features_start:
                raise RuntimeError(f"{len(r.features)} feature rows, {len(r.token_ids) - 1 - r.features_start} "
                                   "tokens to pair them with")
        return super().propose(requests)


def test_a_stop_inside_an_accepted_draft_hands_a_feature_drafter_only_rows_it_can_pair(tiny_llama_dir, plain,
                                                                                       reference):
    """The step that accepts a stop token mid-draft caches rows past it; the catch-up at the request's end hands
    the drafter only the rows whose next token was kept (before, a head failed there and the sequence's blocks
    missed the prefix cache)."""
    truth = {tuple(plain.encode(p)[1]): ref for p, ref in zip(PROMPTS, reference)}
    first = reference[0]
    stop = next(i for i in range(2, 5) if first[i] not in first[:i])  # inside the first step's 5 accepted drafts
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[first[stop]])
    drafter = PairingDrafter(truth, 5)
    llm = LLM(str(tiny_llama_dir), speculative_config=every_step({"method": "custom", "num_speculative_tokens": 5,
                                                                  "drafter": drafter}))
    out = llm.generate(PROMPTS[0], params)[0]
    assert out.token_ids == first[:stop + 1] == plain.generate(PROMPTS[0], params)[0].token_ids
    assert out.finish_reason == "stop" and out.metrics["num_accepted_tokens"] == 5  # verified past the stop
    assert llm.engine.stats()["spec_draft_failures"] == 0 and llm.engine.allocator.num_used == 0


def chi_square_two_sample(a: torch.Tensor, b: torch.Tensor, min_count: int = 20) -> tuple[float, int]:
    """Two-sample chi-square over categories; rare categories are pooled so expected counts are large."""
    size = int(max(a.max(), b.max())) + 1
    ca, cb = torch.bincount(a, minlength=size).double(), torch.bincount(b, minlength=size).double()
    keep = (ca + cb) >= min_count
    ca, cb = torch.cat([ca[keep], ca[~keep].sum()[None]]), torch.cat([cb[keep], cb[~keep].sum()[None]])
    expected = (ca + cb) / 2
    chi2 = (((ca - expected) ** 2 + (cb - expected) ** 2) / expected.clamp(min=1e-9)).sum().item()
    return chi2, len(ca) - 1


MIN_P_VALUE = 1e-4  # see `significance`


def significance(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int, float]:
    """(chi2, dof, p-value) of the two-sample chi-square test that samples a and b come from one distribution
    (`chi_square_two_sample`: categories under 20 samples pooled). The p-value is the chi-square survival
    function Q(dof / 2, chi2 / 2); a comparison fails under MIN_P_VALUE = 1e-4, i.e. above the 0.9999
    quantile. Why that threshold: a correct engine fails one comparison in 10^4 seed sets, so the ~100
    comparisons of tests/test_sampled_methods.py fail a fresh seed set (after a change to how the engine draws its
    random numbers) with
    probability about 1%, while each of three lossy verifications tried on it (drawing from p instead of the
    residual after a rejection, reading p after the wrong node, one uniform for all of a step's nodes) fails
    16 or 17 of its 17 cases, with p-values from 1e-5 down to 1e-80. It is the quantile the suite's usual
    bound, dof + 4 sqrt(2 dof), is meant to approximate; but the chi-square is skewed, so at the 5-25 dof
    seen here that bound is only its 0.997-0.999 quantile (at 8 dof 24.0, against 31.8 for the 0.9999
    quantile)."""
    chi2, dof = chi_square_two_sample(a, b)
    return chi2, dof, p_value(chi2, dof)


def p_value(chi2: float, dof: int) -> float:
    """The chi-square survival function Q(dof / 2, chi2 / 2); 1 where nothing is left to test (0 dof)."""
    if dof == 0:
        return 1.0
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                   torch.tensor(chi2 / 2, dtype=torch.float64)).item()


@pytest.mark.parametrize("shape", ["chain", "tree", "deterministic-tree"])
@pytest.mark.parametrize("sampling", [dict(temperature=1.0, top_k=6), dict(temperature=0.7, top_p=0.9)])
def test_sampled_output_follows_the_target_distribution(tiny_llama_dir, sampling, shape):
    """Two-sample chi-square on tokens 1, 2 and their joint distribution, with and without a drafter whose q
    differs from the target's p on the tokens that matter (so acceptances and residual draws both happen).
    Trees: two siblings at the root and a child under the first, drawn from q (multi-round speculative
    sampling: a rejected sibling's q is taken out of p before the next is tried), or fixed distinct tokens
    (q = one-hot: a rejected token is removed from p).
    Threshold: p-value 1e-4 (`significance`), so a correct engine fails 1 comparison in 10^4 seed sets."""
    import transformers

    prompt = [5, 6, 7]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    with torch.no_grad():
        likely = hf(torch.tensor([prompt])).logits[0, -1].topk(6).indices  # the target's top-6 at the root

    class SkewedDrafter(Drafter):
        def __init__(self):
            self.g = torch.Generator().manual_seed(5)

        def propose(self, requests):
            B = len(requests)
            parents = torch.tensor([-1, 0] if shape == "chain" else [-1, -1, 0]).expand(B, -1).clone()
            n = parents.shape[1]  # the engine verifies no more than each request's max_tokens
            if shape == "deterministic-tree":  # the target's 4th, 1st and 2nd choices
                return Draft(likely[[3, 0, 1]].expand(B, n).clone(), parents)
            q = torch.zeros(B, n, 320)
            q[:, :, likely] = torch.tensor([0.05, 0.05, 0.1, 0.2, 0.3, 0.3])  # reversed preference
            tokens = torch.multinomial(q.view(-1, 320), 1, generator=self.g).view(B, n)
            return Draft(tokens, parents, q)

    n = 3000
    prompts = [{"prompt_token_ids": prompt}] * n
    params = [SamplingParams(max_tokens=5, ignore_eos=True, seed=i, **sampling) for i in range(n)]
    plain = LLM(str(tiny_llama_dir), max_num_seqs=256)
    spec = LLM(str(tiny_llama_dir), max_num_seqs=256,
               speculative_config=every_step({"method": "custom", "num_speculative_tokens": 3,
                                              "drafter": SkewedDrafter(),
                                              "sampled_verification": "rejection"}))  # keyed: the plain output
    # Token 0 comes from the prefill; tokens 1 and 2 from the first speculative step (root, then node 0).
    a = torch.tensor([o.token_ids[1:3] for o in plain.generate(prompts, params)])
    spec_outs = spec.generate(prompts, params)
    b = torch.tensor([o.token_ids[1:3] for o in spec_outs])
    drafted = sum(o.metrics["num_draft_tokens"] for o in spec_outs)
    accepted = sum(o.metrics["num_accepted_tokens"] for o in spec_outs)
    assert 100 < accepted < 0.9 * drafted  # both acceptances and residual draws happened, many of each
    pairs = (a[:, 0] * 320 + a[:, 1], b[:, 0] * 320 + b[:, 1])
    for i, (a_cat, b_cat) in enumerate([(a[:, 0], b[:, 0]), (a[:, 1], b[:, 1]), pairs]):
        chi2, dof = chi_square_two_sample(a_cat, b_cat)
        assert dof >= 1 or i == 2, "too few samples for a test"  # the joint may pool everything when p is flat
        assert p_value(chi2, dof) >= MIN_P_VALUE, (chi2, dof)


@pytest.mark.parametrize("config, message", [
    ({"method": "magic"}, "unknown speculative method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokenz": 3}, "valid keys"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "ngram_pool": "global"}, "ngram_pool"),
    ({"method": "ngram", "ngram_match": "best"}, "'latest', 'oldest' or 'frequent'"),
    ({"method": "ngram", "ngram_text_match": "yes"}, "ngram_text_match"),
    ({"method": "custom"}, "drafter"),
    ('{"method": ', "not valid JSON"),
    ({"num_speculative_tokens": 3}, "method"),
    ({"method": "ngram", "tree": "D2-BF2"}, "drafts chains only"),
    ({"method": "layer_skip", "num_layers": 2, "tree": "D2-X"}, "Dm-BFn"),
    ({"method": "layer_skip", "num_layers": 2, "tree": [[0], [1, 0]]}, "has no parent"),
    ({"method": "layer_skip", "num_layers": 2, "tree": "D4-BF3"}, "at most 64"),
    ({"method": "layer_skip", "num_layers": 2, "tree": {"topk": 2}}, "needs exactly the keys"),
    ({"method": "layer_skip", "num_layers": 2, "tree": {"topk": 9, "num_steps": 2, "num_draft_tokens": 4}},
     r"topk=9 must be an integer in \[1, 8\]"),
    ({"method": "layer_skip", "num_layers": 2, "tree": 3.5}, "choice list"),
    ({"method": "ngram", "dispatch": {"0": "off"}}, "batch size >= 1"),
    ({"method": "ngram", "dispatch": {"4": "D2-BF2"}}, "drafts chains only"),
    ({"method": "ngram", "dispatch": {"4": "chain-20"}}, "1 to 15"),
    ({"method": "ngram", "dispatch": []}, "min batch size"),
    ({"method": "layer_skip", "num_layers": 2, "dispatch": {"1": "D2-X"}}, "Dm-BFn"),
])
def test_bad_speculative_configs_are_refused(config, message):
    with pytest.raises(SpecdecError, match=message):
        SpeculativeConfig.parse(config)


def test_dispatcher_picks_the_shape_by_batch_size():
    cfg = SpeculativeConfig.parse({"method": "layer_skip", "num_layers": 2, "tree": "D2-BF2",
                                   "dispatch": {"4": "chain-3", "16": "off", "8": 2}})
    assert [str(cfg.shape_for(b)) for b in (1, 3, 4, 7, 8, 15, 16, 64)] == [
        "tree(6 nodes)", "tree(6 nodes)", "chain-3", "chain-3", "chain-2", "chain-2", "off", "off"]
    assert cfg.num_draft_tokens == 6  # slots the scheduler reserves: the largest shape
    dynamic = SpeculativeConfig.parse({"method": "draft_model", "model": "x", "dispatch": {
        "1": {"topk": 4, "num_steps": 4, "num_draft_tokens": 10}, "2": "chain-3"}})
    assert str(dynamic.shape_for(1)) == "dynamic(topk=4, num_steps=4, num_draft_tokens=10)"
    assert dynamic.num_draft_tokens == 12  # it feeds 4 * 3 candidates before keeping 10


def test_dispatcher_turns_speculation_off_for_large_batches(tiny_llama_dir, reference):
    llm = LLM(str(tiny_llama_dir), speculative_config=every_step({"method": "ngram", "num_speculative_tokens": 3,
                                                                  "dispatch": {"3": "off"}}))
    outs = llm.generate(PROMPTS, GREEDY)  # four requests of equal length: every step has batch 4
    assert [o.token_ids for o in outs] == reference
    assert sum(o.metrics["num_drafts"] for o in outs) == 0
    alone = llm.generate(PROMPTS[1], GREEDY)[0]
    assert alone.token_ids == reference[1] and alone.metrics["num_drafts"] > 0


class TreeOracle(Drafter):
    """Trees whose true continuation hides on the last branch: at every depth the node on the true path has
    `width - 1` wrong elder siblings, so verification must fall through siblings, accept a late branch,
    and the engine must move the accepted path's K/V down to consecutive slots."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], depth: int, width: int):
        self.truth, self.depth, self.width = truth, depth, width

    def propose(self, requests):
        B, N = len(requests), self.depth * self.width
        tokens = torch.zeros(B, N, dtype=torch.long)
        parents = torch.full((B, N), -2, dtype=torch.long)
        for i, r in enumerate(requests):
            future = next((list(full[len(r.token_ids) - len(p):]) for p, full in self.truth.items()
                           if tuple(r.token_ids[:len(p)]) == p), [])
            n, parent = 0, -1
            for d in range(min(self.depth, len(future))):
                if n + self.width > r.max_tokens:
                    break
                for w in range(self.width):  # wrong siblings first, the true token last
                    tokens[i, n] = (future[d] + 1 + w) % 300 if w < self.width - 1 else future[d]
                    parents[i, n] = parent
                    n += 1
                parent = n - 1
        return Draft(tokens, parents)


@pytest.mark.parametrize("depth, width", [(3, 2), (2, 3), (1, 4)])
def test_tree_drafts_greedy_equals_plain(tiny_llama_dir, plain, reference, depth, width):
    truth = {tuple(plain.encode(p)[1]): ref for p, ref in zip(PROMPTS, reference)}
    k = depth * width
    llm = LLM(str(tiny_llama_dir), speculative_config=every_step({"method": "custom", "num_speculative_tokens": k,
                                                                  "drafter": TreeOracle(truth, depth, width)}))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    for o in outs:  # every tree's true path was accepted, always off the first branch
        m = o.metrics
        assert m["accepted_per_pos"][0] == m["num_drafts"] > 0, m
        assert m["num_accepted_tokens"] >= (depth - 1) * m["num_drafts"], m
    assert llm.engine.allocator.num_used == 0


def test_random_trees_never_change_the_output(tiny_llama_dir, reference):
    class RandomTrees(Drafter):
        def __init__(self):
            self.g = torch.Generator().manual_seed(3)

        def propose(self, requests):
            B, N = len(requests), 6
            tokens = torch.randint(0, 320, (B, N), generator=self.g)
            parents = torch.stack([torch.randint(-1, j, (B,), generator=self.g) if j else torch.full((B,), -1)
                                   for j in range(N)], 1)
            return Draft(tokens, parents)

    llm = LLM(str(tiny_llama_dir), speculative_config=every_step({"method": "custom", "num_speculative_tokens": 6,
                                                                  "drafter": RandomTrees()}))
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


@pytest.mark.parametrize("make, message", [
    (lambda n: Draft(torch.zeros(n + 1, 2, dtype=torch.long), torch.zeros(n + 1, 2, dtype=torch.long)), "must both be"),
    (lambda n: Draft(torch.zeros(n, 2, dtype=torch.long), torch.zeros(n, 3, dtype=torch.long)), "must both be"),
    (lambda n: Draft(torch.zeros(n, 2), torch.tensor([[-1, 0]] * n)), "torch.long"),
    (lambda n: Draft(torch.full((n, 2), 10**6), torch.tensor([[-1, 0]] * n)), "token ids must be in"),
    (lambda n: Draft(torch.zeros(n, 2, dtype=torch.long), torch.tensor([[-1, 0]] * n), torch.ones(n, 2, 7)),
     "draft probs"),
    (lambda n: Draft(torch.zeros(n, 2, dtype=torch.long), torch.tensor([[-1, 1]] * n)), "draft parents"),
    (lambda n: Draft(torch.zeros(n, 2, dtype=torch.long), torch.tensor([[-2, -1]] * n)), "draft parents"),
])
def test_malformed_drafts_are_refused(tiny_llama_dir, make, message, caplog):
    """A user's drafter that returns a malformed draft is named in the log and its request decodes without
    drafts: the output is plain decoding's (issue 18: a drafter's failure costs speed, never a request)."""
    class Broken(Drafter):
        def propose(self, requests):
            return make(len(requests))

    plain = LLM(str(tiny_llama_dir), speculative_config="off")
    llm = plain.with_speculative_config(every_step({"method": "custom", "num_speculative_tokens": 2,
                                                    "drafter": Broken()}))
    with caplog.at_level("WARNING", logger="specdec.engine"):
        out = llm.generate("Hello world", GREEDY)[0]
    assert out.token_ids == plain.generate("Hello world", GREEDY)[0].token_ids and out.metrics["num_drafts"] == 0
    assert message in caplog.text and "decodes without drafts" in caplog.text
    assert llm.engine.stats()["spec_draft_failures"] == 1 and llm.engine.allocator.num_used == 0


def test_bfloat16_speculative_greedy_equals_plain(tiny_llama_dir):
    """On CPU bf16 weights are widened in float32 kernels, so verifying k + 1 tokens computes each row
    as decoding one does, and greedy speculation stays token-identical in bf16 too."""
    plain = LLM(str(tiny_llama_dir), dtype="bfloat16")
    spec = plain.with_speculative_config(every_step({"method": "ngram", "num_speculative_tokens": 3}))
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == \
        [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]


def test_drafters_receive_the_targets_features_of_every_committed_token(tmp_path):
    """A drafter that declares feature_layers gets, over its calls, the outputs of those target layers for
    every committed token exactly once and in order (prefill rows, then the last token and the accepted
    drafts of every verification, trees included), equal to transformers' hidden states."""
    import transformers
    from conftest import save_tiny_model

    path = save_tiny_model(tmp_path, "llama", num_hidden_layers=4)
    plain = LLM(str(path))
    prompts = PROMPTS[:3]
    reference = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    truth = {tuple(plain.encode(p)[1]): ref for p, ref in zip(prompts, reference)}

    class FeatureReader(TreeOracle):
        feature_layers = (0, 2)

        def __init__(self):
            super().__init__(truth, depth=2, width=2)
            self.received: dict[tuple[int, ...], list[tuple[int, torch.Tensor]]] = {}

        def propose(self, requests):
            for r in requests:
                prompt = next(p for p in self.truth if tuple(r.token_ids[:len(p)]) == p)
                if r.features is not None:
                    self.received.setdefault(prompt, []).append((r.features_start, r.features.clone()))
            return super().propose(requests)

    drafter = FeatureReader()
    spec = LLM(str(path), speculative_config=every_step({"method": "custom", "num_speculative_tokens": 4,
                                                         "drafter": drafter}))
    outs = spec.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    for prompt, out in zip(truth, outs):
        chunks = drafter.received[prompt]
        assert chunks[0][0] == 0 and all(a + len(f) == b for (a, f), (b, _) in zip(chunks, chunks[1:]))
        got = torch.cat([f.cpu() for _, f in chunks])  # [n, 2 * H], tokens 0 .. n - 1
        assert len(prompt) < got.shape[0] < len(prompt) + len(out.token_ids)
        with torch.no_grad():
            states = hf(torch.tensor([list(prompt) + out.token_ids]), output_hidden_states=True).hidden_states
        want = torch.cat([states[1][0], states[3][0]], -1)[: got.shape[0]]  # outputs of layers 0 and 2
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_a_sequence_part_way_through_a_chunked_prefill_never_verifies_drafts(tiny_llama_dir):
    """Regression: with a small token budget, a prompt is prefilled in chunks while other requests decode;
    such a sequence used to enter decode steps with all its uncached tokens, so verification read the wrong
    logits rows (chains: a wrong token) or its tree did not cover the feed (trees: a crash). Duplicate prompts
    make prefix-cache hits part of the mix."""
    prompts = [("the quick brown fox jumps over the lazy dog " * (3 + i % 3)).strip() for i in range(5)] * 2
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(str(tiny_llama_dir), speculative_config="off", max_num_batched_tokens=48)
    reference = [o.token_ids for o in plain.generate(prompts, params)]
    for config in ({"method": "ngram", "num_speculative_tokens": 3},
                   {"method": "ngram", "num_speculative_tokens": 6, "ngram_branches": 2}):
        spec = plain.with_speculative_config(every_step(config), max_num_batched_tokens=48)
        assert [o.token_ids for o in spec.generate(prompts, params)] == reference
        assert spec.engine.allocator.num_used == 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_tree_step_runs_on_the_engine_device(tiny_llama_dir, temperature):
    """On CUDA every tree failed: host drafts met device logits in a gather. With the engine on "meta" (shapes,
    no data) a whole tree step runs, drafts, tree feed, target forward, logits, and verification up to its one
    read back to the host, with every op's devices checked as CUDA checks them."""

    class Tree(Drafter):
        def propose(self, requests):  # two roots, the first with two children, one grandchild
            return Draft.from_rows([([5, 6, 7, 8, 9], [-1, -1, 0, 0, 2]) for _ in requests])

    engine = LLM(str(tiny_llama_dir), device="meta",
                 speculative_config=every_step({"method": "custom", "num_speculative_tokens": 5,
                                                "drafter": Tree()})).engine
    seqs = [engine.sequence(engine.add_request([1, 2, 3, 4, 5, 6][: 4 + i],
                                               SamplingParams(temperature=temperature, max_tokens=10)))
            for i in range(2)]
    for seq in seqs:  # as if prefilled (a meta cache holds nothing anyway)
        engine.allocator.allocate(seq.block_table, len(seq.token_ids) + 6)
        seq.num_cached = len(seq.token_ids) - 1
    with accelerator_checks(), pytest.raises((NotImplementedError, RuntimeError)) as reached:
        engine._compute(ScheduledBatch(seqs, [1] * len(seqs), False))  # one decode step: draft, verify
    where = [Path(str(entry.path)).name for entry in reached.traceback]
    assert "verify.py" in where and "meta" in str(reached.value), (where, reached.value)  # the host read, in verify


PENALIZED = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=0.3,
                           frequency_penalty=0.2, repetition_penalty=1.1, logit_bias={5: 2.0, 17: -3.0})


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "suffix", "num_speculative_tokens": 4},
    {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 4, "tree": "D2-BF2"},
    "oracle-chain", "oracle-tree",
], ids=["ngram", "suffix", "layer_skip-tree", "oracle-chain", "oracle-tree"])
def test_penalties_and_bias_keep_greedy_speculation_identical(tiny_llama_dir, plain, reference, spec):
    """Penalties and logit_bias are applied at every draft position with the counts of that position's own path,
    so greedy speculative output equals plain output under them too. The oracles draft the penalized continuation
    itself (as a chain, and on a tree's last branch): their drafts are all kept only if every draft row counted
    the drafts before it."""
    want = [o.token_ids for o in plain.generate(PROMPTS, PENALIZED)]
    assert want != reference  # the penalties change the output: the comparison below tests them
    if isinstance(spec, str):
        truth = {tuple(plain.encode(p)[1]): ref for p, ref in zip(PROMPTS, want)}
        drafter = ScriptedDrafter(truth, 4) if spec == "oracle-chain" else TreeOracle(truth, 2, 2)
        spec = {"method": "custom", "num_speculative_tokens": 4, "drafter": drafter}
    llm = LLM(str(tiny_llama_dir), speculative_config=every_step(spec))
    outs = llm.generate(PROMPTS, PENALIZED)
    assert [o.token_ids for o in outs] == want
    if spec["method"] == "custom":
        assert sum(o.metrics["num_accepted_tokens"] for o in outs) >= 2 * sum(o.metrics["num_drafts"] for o in outs)
    assert llm.engine.allocator.num_used == 0


LOGPROBS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 4, "tree": "D2-BF2"},
    "oracle-tree",
], ids=["ngram", "layer_skip-tree", "oracle-tree"])
def test_logprobs_under_speculation_equal_plain_decodings(tiny_llama_dir, plain, reference, spec):
    """A drafted and verified token gets the log-probability plain decoding gives it: the verification row that
    predicted it is the row plain decoding computes there (the kernels are batch-invariant: equal to 1e-6)."""
    want = plain.generate(PROMPTS, LOGPROBS)
    for o in want:
        assert [lp.token for lp in o.logprobs] == o.token_ids
        for lp in o.logprobs:  # greedy: the chosen token is the most likely one
            assert len(lp.top) == 3 and lp.top[0] == (lp.token, lp.logprob) and lp.logprob <= 0
            assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    if spec == "oracle-tree":
        truth = {tuple(plain.encode(p)[1]): ref for p, ref in zip(PROMPTS, reference)}
        spec = {"method": "custom", "num_speculative_tokens": 4, "drafter": TreeOracle(truth, 2, 2)}
    assert_logprobs_equal(LLM(str(tiny_llama_dir), speculative_config=every_step(spec)).generate(PROMPTS, LOGPROBS),
                                                                                 want, 1e-6)


def test_logprobs_are_the_models_own_before_bias_and_penalties(plain):
    """vLLM's default: a token forced by logit_bias +100 keeps the log-probability the model gave it."""
    forced = plain.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logprobs=0, logit_bias={7: 100}))[0]
    assert forced.token_ids == [7] * 4
    assert all(lp.top == [] and lp.logprob < -0.5 for lp in forced.logprobs)  # a random tiny model: far from 1
    assert plain.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))[0].logprobs is None


def test_prompt_logprobs_are_those_of_decoding_each_prompt_token(tiny_llama_dir, plain):
    """prompt_logprobs (echo): entry i is the log-probability of prompt token i + 1 after the tokens before it,
    what decoding that prefix would give the same token (forced here by logit_bias, which logprobs ignore); a
    prompt prefilled in chunks and a prompt whose prefix is cached give the same values."""
    ids = plain.encode(PROMPTS[0])[1]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    got = plain.generate({"prompt_token_ids": ids}, params)[0].prompt_logprobs
    assert [e.token for e in got] == ids[1:] and all(len(e.top) == 2 for e in got)
    for k in (1, 5, len(ids) - 1):
        forced = SamplingParams(temperature=0, max_tokens=1, logprobs=0, logit_bias={ids[k]: 100})
        want = plain.generate({"prompt_token_ids": ids[:k]}, forced)[0].logprobs[0]
        assert want.token == ids[k] and abs(got[k - 1].logprob - want.logprob) <= 1e-5
    chunked = LLM(str(tiny_llama_dir), max_num_batched_tokens=4, block_size=4)
    chunked.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1))  # its blocks now cached
    again = chunked.generate({"prompt_token_ids": ids}, params)[0]
    assert again.metrics["num_cached_tokens"] == 0  # prompt logprobs need the whole prefill
    assert [e.logprob for e in again.prompt_logprobs] == pytest.approx([e.logprob for e in got], abs=1e-5)


def test_a_draft_from_host_lists_gives_the_same_rows_as_its_tensors():
    """A draft made from lists keeps them (the engine reads them without building tensors); its tensors, built on
    first use, are the padded table, and from then on they are the draft: a change made to them is what the host
    rows read."""
    rows = [([5, 6, 7], [-1, 0, 1]), ([], []), ([8, 9], [-1, -1])]
    draft = Draft.from_rows(rows)
    assert draft.host_rows() == ([[5, 6, 7], [], [8, 9]], [[-1, 0, 1], [], [-1, -1]])
    assert draft.tokens.tolist() == [[5, 6, 7], [0, 0, 0], [8, 9, 0]]
    assert draft.parents.tolist() == [[-1, 0, 1], [-2, -2, -2], [-1, -1, -2]]
    assert draft.num_nodes() == [3, 0, 2]
    draft.tokens[0, 2] = 4  # a drafter editing its tensors in place
    assert draft.host_rows()[0][0] == [5, 6, 4]
    spread = Draft.chains([[1, 2]]).spread([1], 3)
    assert spread.host_rows() == ([[], [1, 2], []], [[], [-1, 0], []])
    scored = Draft.from_rows([([3], [-1], [0.5]), ([4, 5], [-1, 0], [0.25, 0.75])])
    assert scored.scores.tolist() == [[0.5, 0.0], [0.25, 0.75]] and scored.host_rows()[0] == [[3], [4, 5]]
    assert Draft.chains([]).tokens.shape == (0, 0) and Draft.chains([[]]).host_rows() == ([[]], [[]])
