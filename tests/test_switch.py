"""Switch drafting: which source drafts (hand-worked estimates), what it learns from the target, the head's
features held across the steps it was not asked, and that the engine's output never depends on it."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from conftest import every_step
from test_drafters import PROMPTS, other_draft_dir, target_dir  # noqa: F401 (module fixtures)
from test_eagle3 import random_head
from test_retrieval import SAMPLED_PROMPT, assert_first_step_follows_plain, likely_corpus
from test_speculative import made_up_costs

from specdec import LLM, SamplingParams, SpecdecError
from specdec.drafting.base import Draft, Drafter, DraftRequest
from specdec.drafting.datastore import Datastore
from specdec.drafting.eagle import EagleDrafter
from specdec.drafting.ngram import NgramDrafter
from specdec.drafting.registry import SpeculativeConfig
from specdec.drafting.retrieval import RetrievalDrafter
from specdec.drafting.switch import CATCH_UP_ROWS, PRIOR_DRAFTS, PRIOR_KEPT, SwitchDrafter


class Fixed(Drafter):
    """Proposes the same chain for every request (none while `tokens` is empty) and counts the requests asked."""

    def __init__(self, tokens, features=False):
        self.tokens, self.asked, self.seen = tokens, 0, []
        self.feature_layers = (0,) if features else ()

    def propose(self, requests):
        self.asked += len(requests)
        self.seen += [(r.features_start, None if r.features is None else len(r.features)) for r in requests]
        return Draft.chains([list(self.tokens) for _ in requests])


def switch(*drafters, **costs) -> SwitchDrafter:
    """A switch over these drafters; free drafts and verification unless `costs` say otherwise (token_cost,
    context_cost, head_cost), so that kept tokens alone decide."""
    costs = {"token_cost": 0.0, "context_cost": 0.0, "head_cost": 0.0, **costs}
    return SwitchDrafter([(d, SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4}))
                          for d in drafters], **costs)


def step(drafter, tokens, seq_id=0, **kw):
    return drafter.propose([DraftRequest(seq_id, list(tokens), 1, 4, **kw)]).tokens[0].tolist()


def test_the_first_source_drafts_until_its_drafts_keep_less_than_the_next_ones():
    """A drafts 1 2 3, which the target never follows; B drafts 7, which it always does. Both start at the prior
    (half a token a draft, as if from 8 drafts), so A's draft is taken; once the sequence has left it, it measures
    0 kept and A's 3-node drafts expect 4 / 9 = 0.44 < 0.5: B drafts from then on. A is still asked (its draft
    costs nothing to look at) and each of its drafts is measured against the committed tokens as if verified."""
    a, b = Fixed([1, 2, 3]), Fixed([7])
    drafter = switch(a, b)
    tokens = [9, 9]
    taken = []
    for _ in range(12):
        taken.append(step(drafter, tokens))
        tokens += [7, 5]  # the target's own tokens: B's 7 (kept where B drafted), then 5
    # A's first draft is measured at the next call: the committed 7 already leaves its path
    assert taken[:1] == [[1, 2, 3]] and taken[1:] == [[7]] * 11
    assert drafter.taken == [1, 11] and a.asked == 12 and b.asked == 11
    # the sequence (24 tokens at the last call) decided A's drafts made at lengths 2 .. 22: none kept
    assert drafter.sources[0].drafts[2] == 11 and drafter.sources[0].kept[2] == 0
    # ... and B's made at lengths 4 .. 22, each kept
    assert drafter.sources[1].mean() == pytest.approx((10 + PRIOR_KEPT) / (10 + PRIOR_DRAFTS))


def test_a_source_with_nothing_to_draft_passes_the_request_on():
    a, b = Fixed([]), Fixed([7])
    drafter = switch(a, b)
    assert step(drafter, [9, 9]) == [7] and b.asked == 1
    a.tokens = [4]  # A's 1-token drafts expect the prior, 0.5, against B's 5 / 9 once its draft was kept
    assert step(drafter, [9, 9, 7, 5]) == [7] and a.asked == b.asked == 2


def test_what_a_draft_kept_is_its_longest_path_the_sequence_follows_and_forget_drops_it():
    a, b = Fixed([1, 2, 3]), Fixed([7])
    drafter = switch(a, b)
    step(drafter, [9, 9])
    step(drafter, [9, 9, 1, 2])  # not decided yet: the sequence follows the draft and has not covered it
    assert drafter.sources[0].drafts[2] == 0
    step(drafter, [9, 9, 1, 2, 8, 6])  # follows 1 2, then the target's 8 (and leaves the next draft at once)
    assert drafter.sources[0].kept[2] == 2 and drafter.sources[0].drafts[2] == 2
    drafter.release(0)
    drafter.forget()
    assert drafter.sources[0].drafts == [0.0] * len(drafter.sources[0].drafts) and drafter.taken == [0, 0]


def test_a_draft_is_verified_only_where_it_pays_for_its_nodes_at_the_requests_context():
    """token_cost 0.25: A's 4 nodes at the prior (0.5 kept) are worth 1.5 / 2 = 0.75 of a plain step, under 1;
    B's one node 1.5 / 1.25 = 1.2. With context_cost 0.1 per 1,000 tokens, at 2,000 tokens of context a node costs
    0.45 (B: 1.5 / 1.45, still worth it); at 4,000, 0.65 (B: 1.5 / 1.65 < 1): nothing is drafted."""
    a, b = Fixed([1, 2, 3, 4]), Fixed([7])
    drafter = switch(a, b, token_cost=0.25, context_cost=0.1)
    assert step(drafter, [9, 9]) == [7]
    assert step(drafter, [9] * 2000, seq_id=1) == [7]
    assert step(drafter, [9] * 4000, seq_id=2) == []
    assert a.asked == 3 and b.asked == 3  # free to ask: asked, then weighed


def test_a_head_that_does_not_pay_to_ask_is_asked_only_on_probes():
    """head_cost 0.5: asking the head is worth (1 + 0.5) / (1 + 0.25 + 0.5) = 0.86 of a plain step: it is asked
    for one request in PROBE_EVERY only (and its draft, worth 1.5 / 1.25 once made, is verified)."""
    head = Fixed([7], features=True)
    drafter = switch(Fixed([]), head, token_cost=0.25, head_cost=0.5)
    drafts = [step(drafter, [9, 9], seq_id=n, features=torch.zeros(1, 4)) for n in range(2 * SwitchDrafter.PROBE_EVERY)]
    assert head.asked == 2 and drafts.count([7]) == 2


def test_a_heads_drafting_cost_is_its_measured_time_over_a_plain_steps():
    """head_cost 0.01 is only where it starts: the head's forward (here 20 ms a request) over the request's share of
    a plain step (`plain_seconds`) is what asking it costs once measured. Against 10 ms steps that is 2 plain steps,
    and it is asked only on probes; against 1 s steps it costs 0.02, and it is asked every time."""
    class Slow(Fixed):
        def propose(self, requests):
            time.sleep(0.02 * len(requests))
            return super().propose(requests)

    for plain_seconds, asked in ((0.01, 1 + 1), (1.0, 2 * SwitchDrafter.PROBE_EVERY)):
        head = Slow([7], features=True)
        drafter = switch(Fixed([]), head, token_cost=0.25, head_cost=0.01)
        for n in range(2 * SwitchDrafter.PROBE_EVERY):
            step(drafter, [9, 9], seq_id=n, features=torch.zeros(1, 4), plain_seconds=plain_seconds)
        assert head.asked == asked
        measured = drafter.sources[1].drafting_cost(plain_seconds) * plain_seconds  # seconds a request
        assert 0.02 <= measured < 0.2  # a sleep never ends early; a busy machine may end it late
    assert drafter.sources[1].drafting_cost(None) == 0.01  # no plain step known: the constant


def test_a_head_not_asked_catches_up_once_catch_up_rows_wait():
    """A drafts every step, so the head is never asked; the rows held for it go to it once CATCH_UP_ROWS wait
    (the prompt's 70 at once), then every CATCH_UP_ROWS steps of one row; its catch-up drafts are measured, never
    verified."""
    a, head = Fixed([9]), Fixed([7], features=True)
    drafter = switch(a, head)
    seen = [step(drafter, [9] * 71, features=torch.zeros(70, 4), features_start=0)]
    for n in range(70, 70 + 2 * CATCH_UP_ROWS):
        seen.append(step(drafter, [9] * (n + 2), features=torch.zeros(1, 4), features_start=n))
    assert all(d == [9] for d in seen)  # A's drafts, every step
    assert head.seen == [(0, 70), (70, CATCH_UP_ROWS), (70 + CATCH_UP_ROWS, CATCH_UP_ROWS)]
    assert drafter.taken == [1 + 2 * CATCH_UP_ROWS, 0]
    assert sum(drafter.sources[1].drafts) > 0  # the head's catch-up drafts, measured against the sequence
    end = 70 + 2 * CATCH_UP_ROWS
    drafter.catch_up([DraftRequest(0, [9] * (end + 3), 1, 1, features=torch.zeros(2, 4), features_start=end)])
    assert head.seen[-1] == (end, 2)  # the engine's catch-up (steps that drafted nothing, a request's end): all rows


def test_the_head_gets_every_feature_row_gathered_while_it_was_not_asked():
    """Features arrive every step; A drafts on steps 1 and 2, the head (B) on step 3: it sees rows 0..6 at once."""
    a, head = Fixed([9]), Fixed([7], features=True)  # the target keeps A's 9s
    drafter = switch(a, head)
    rows = [(0, 3), (3, 2), (5, 2)]  # (features_start, rows) handed over per step
    for n, (start, count) in enumerate(rows):
        if n == 2:
            a.tokens = []  # A has nothing: the head drafts
        step(drafter, [9] * (start + count + 1), features=torch.zeros(count, 4), features_start=start)
    assert head.seen == [(0, 7)]
    step(drafter, [9] * 10, features=torch.zeros(2, 4), features_start=7)
    assert head.seen[-1] == (7, 2)
    step(drafter, [9] * 5, features=torch.zeros(4, 4), features_start=0, epoch=1)  # a new epoch starts over
    assert head.seen[-1] == (0, 4)


def with_head(target_dir, tmp_path):
    path = tmp_path / "head"
    random_head(LLM(str(target_dir)).engine.model.config).save(path)
    return str(path)


def test_sources_that_draft_first_are_all_asked_and_their_chains_offered_to_the_cost_model():
    """Over sources that all draft first (n-gram, retrieval), a request asked for its whole budget gets every source's
    chain: the first non-empty one as its row, the others as its alternatives, each with its evidence; the engine's
    cost model chooses (`DraftPlanner.choose`). Asked otherwise, or over a source that does not draft first, the
    switch weighs the sources itself as before."""
    store = Datastore.build(np.array([5, 6, 7, 8, 9, -1], dtype=np.int32), 4, 4)
    drafter = switch(NgramDrafter(4), RetrievalDrafter(store, 4, max_match=4, min_match=2))
    assert drafter.drafts_first and not drafter.sizes_own_drafts
    requests = [DraftRequest(0, [5, 6, 1, 2, 5, 6], 6, 4, sized_by_plan=True),  # the n-gram matches [5, 6]: 1 2 5 6
                DraftRequest(1, [3, 5, 6, 7], 4, 4, sized_by_plan=True)]  # no n-gram match; the corpus has 5 6 7
    draft = drafter.propose(requests)
    assert draft.host_rows()[0] == [[1, 2, 5, 6], [8, 9]]
    assert draft.evidence == ["match 2", "retrieval 2"]
    assert draft.alternatives == [[([7, 8, 9], "retrieval 2")], []]
    assert drafter.propose([DraftRequest(0, [5, 6, 1, 2, 5, 6], 6, 4)]).alternatives is None  # its own weighing
    mixed = switch(NgramDrafter(4), Fixed([7]))
    assert not mixed.drafts_first and mixed.sizes_own_drafts


@pytest.mark.parametrize("verification", ["greedy", "rejection"])
def test_a_switch_over_ngram_and_retrieval_chosen_by_evidence_is_lossless(target_dir, tmp_path, verification):
    """The cost model choosing per request and step between the n-gram's and retrieval's chains (batches of up to 4):
    greedy output is plain decoding's (rows at 0.05 plain steps), with both sources' evidence measured; sampled output
    (rejection sampling, rows free so that every draft is verified) keeps the first speculative step's
    distribution."""
    plain = LLM(str(target_dir), max_num_seqs=4)
    config = {"method": "switch", "num_speculative_tokens": 4, "sampled_verification": "rejection", "sources": [
        {"method": "ngram", "num_speculative_tokens": 4},
        {"method": "retrieval", "corpus": likely_corpus(tmp_path / "c.npz", plain.engine.model),
         "num_speculative_tokens": 4}]}
    spec = LLM(str(target_dir), max_num_seqs=4, speculative_config=config)
    made_up_costs(spec, 0.0 if verification == "rejection" else 0.05)  # sampled: every draft verified (free rows)
    if verification == "rejection":
        assert_first_step_follows_plain(plain, spec)
        return
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompts = [{"prompt_token_ids": SAMPLED_PROMPT}] + [{"prompt_token_ids": plain.encode(p)[1]} for p in PROMPTS]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    outs = [spec.generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in outs] == want
    kinds = {str(e).split()[0] for e in spec.engine.speculator.planner.source}
    assert {"match", "retrieval"} <= kinds, kinds
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 0
    assert spec.engine.allocator.num_used == 0


def test_switch_is_lossless_and_the_head_drafts_what_it_drafts_alone(target_dir, tmp_path, monkeypatch):
    """Greedy output is plain decoding's; where both run, the head's first draft after the same committed tokens
    is the one it drafts when it runs every step, also right after steps the n-gram drafted (its catch-up over the
    held features reaches the same state, up to float32 rounding)."""
    head = with_head(target_dir, tmp_path)
    seen: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = {}  # (run, committed ids) -> (draft, feature rows)
    run = {"name": ""}
    propose = EagleDrafter.propose

    def recording(self, requests):
        draft = propose(self, requests)
        for r, row in zip(requests, draft.host_rows()[0]):
            if row:
                seen[(run["name"], tuple(r.token_ids))] = (row[0], len(r.features))
        return draft

    monkeypatch.setattr(EagleDrafter, "propose", recording)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompts = PROMPTS + ["a b c a b c a b", "one two three four one two"]
    plain = [o.token_ids for o in LLM(str(target_dir)).generate(prompts, params)]
    eagle = {"method": "eagle3", "model": head, "num_speculative_tokens": 1}
    config = {"method": "switch", "num_speculative_tokens": 4, "token_cost": 0, "context_cost": 0, "head_cost": 0,
              "sources": [{"method": "ngram", "num_speculative_tokens": 4}, eagle]}  # free: the random head drafts
    for name, cfg in (("alone", eagle), ("switch", config)):
        run["name"] = name
        llm = LLM(str(target_dir), speculative_config=every_step(cfg))
        outs = [llm.generate([p], params)[0] for p in prompts]  # batch 1: each request's own steps
        assert [o.token_ids for o in outs] == plain
        assert llm.engine.allocator.num_used == 0
    taken = llm.engine.speculator.drafter.taken
    assert taken[0] > 0 and taken[1] > 0  # both sources drafted
    alone = {k[1]: v for k, v in seen.items() if k[0] == "alone"}
    both = [(v, alone[k[1]]) for k, v in seen.items() if k[0] == "switch" and k[1] in alone]
    # the tiny model runs torch's float32 GEMM, whose rounding depends on how many rows a forward has: a catch-up
    # over held rows sums in another order than row-by-row, and a random head's near ties may flip (as in
    # test_prefix_cache), so drafts are compared to 90%
    agree = sum(s[0] == a[0] for s, a in both)
    assert agree >= 0.9 * len(both), [(s, a) for s, a in both if s[0] != a[0]]
    assert any(s[1] > a[1] for s, a in both), both  # after held features: more rows than running every step


def test_sampled_output_with_a_switch_follows_the_target(target_dir, other_draft_dir, tmp_path):
    """Rejection sampling (not keyed verification, whose output is plain decoding's whatever is drafted) over
    drafts switched between a random draft model's sampled chains (their q dropped: verified as one-hot) and
    retrieval's chains over the target's likely tokens keeps the first speculative step's distribution."""
    plain = LLM(str(target_dir), max_num_seqs=256)
    spec = LLM(str(target_dir), max_num_seqs=256, speculative_config=every_step({
        "method": "switch", "num_speculative_tokens": 4, "sampled_verification": "rejection", "sources": [
            {"method": "draft_model", "model": str(other_draft_dir), "num_speculative_tokens": 2},
            {"method": "retrieval", "corpus": likely_corpus(tmp_path / "c.npz", plain.engine.model),
             "num_speculative_tokens": 4, "min_token_prob": 0.0}]}))
    assert_first_step_follows_plain(plain, spec)
    assert all(spec.engine.speculator.drafter.taken)  # both sources' drafts were verified


@pytest.mark.parametrize("config, message", [
    ({"sources": [{"method": "ngram"}]}, "at least two speculative configs"),
    ({"sources": [{"method": "ngram"}, {"num_speculative_tokens": 3}]}, "must be a speculative config with"),
    ({"sources": [{"method": "ngram"}, {"method": "hybrid", "sources": []}]}, "cannot itself be 'hybrid'"),
    ({"sources": [{"method": "ngram"}, {"method": "ngram", "num_speculative_tokens": 9}]}, "more than the switch's"),
    ({"sources": [{"method": "ngram"}, {"method": "layer_skip", "num_layers": 2,
                                        "tree": {"topk": 2, "num_steps": 2, "num_draft_tokens": 3}}]},
     "dynamic trees cannot be nested"),
    ({"sources": [{"method": "ngram"}, {"method": "lookahead"}]}, "does not take 'lookahead'"),
    ({"sources": [{"method": "ngram"}, {"method": "magic"}]}, "unknown speculative method"),
    ({"sources": [{"method": "ngram"}, {"method": "suffix"}], "token_cost": 2}, "invalid token_cost=2"),
    ({"sources": [{"method": "ngram"}, {"method": "suffix"}], "head_cost": -1}, "invalid head_cost=-1"),
])
def test_bad_switch_configs_are_refused(target_dir, config, message):
    with pytest.raises(SpecdecError, match=message):
        LLM(str(target_dir), speculative_config=every_step({"method": "switch", "num_speculative_tokens": 8,
                                                            **config}))
