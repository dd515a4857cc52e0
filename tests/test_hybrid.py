"""Hybrid drafting: the merged tree (hand-worked table), its online calibration, and that the engine's output
never depends on it (greedy identity, sampled distribution with mixed sources)."""
from __future__ import annotations

import pytest
from conftest import every_step
from test_drafters import GREEDY, PROMPTS, other_draft_dir, reference, target_dir  # noqa: F401 (module fixtures)
from test_retrieval import assert_first_step_follows_plain, likely_corpus, private_cache  # noqa: F401

from specdec import LLM, SpecdecError
from specdec.drafting.base import Draft, Drafter, DraftRequest
from specdec.drafting.hybrid import HybridDrafter
from specdec.drafting.registry import SpeculativeConfig


class Fixed(Drafter):
    """Proposes the same (tokens, parents[, scores]) for every request."""

    def __init__(self, row):
        self.row = row

    def propose(self, requests):
        return Draft.from_rows([self.row for _ in requests])


def hybrid(rows, k=6, min_score=0.0, ks=None) -> HybridDrafter:
    sources = [(Fixed(row), SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": n}))
               for row, n in zip(rows, ks or [4] * len(rows))]
    return HybridDrafter(sources, k, min_score)


def calibration(drafter: HybridDrafter, source: int) -> list[float]:
    """Source `source`'s calibration g by depth, what the merged tree scores its nodes with."""
    return [round(drafter.sources[source].calibration(d), 4) for d in range(1, drafter.k + 1)]


def test_merged_tree_takes_nodes_by_calibrated_score():
    """A: chain 1 2 3 (no scores: b = 1). B: 1 5 and 4, with its own probabilities 0.9, 0.6, 0.3. Before any
    feedback g = 1/2, so A's nodes score 0.5; B's 0.45, 0.3, 0.15. The shared node [1] scores 0.5."""
    drafter = hybrid([([1, 2, 3], [-1, 0, 1]), ([1, 5, 4], [-1, 0, -1], [0.9, 0.6, 0.3])])
    draft = drafter.propose([DraftRequest(0, [9, 9], 2, 6)])
    # best first: [1] 0.5, [1 2] 0.5, [1 2 3] 0.5, [1 5] 0.3, [4] 0.15
    assert draft.tokens[0].tolist() == [1, 2, 3, 5, 4] and draft.parents[0].tolist() == [-1, 0, 1, 0, -1]
    assert draft.probs is None  # deterministic proposals, whatever the sources drew
    small = hybrid([([1, 2, 3], [-1, 0, 1]), ([1, 5, 4], [-1, 0, -1], [0.9, 0.6, 0.3])], min_score=0.2)
    assert small.propose([DraftRequest(0, [9, 9], 2, 6)]).tokens[0].tolist() == [1, 2, 3, 5]  # 0.15 < 0.2
    probe = hybrid([([1, 2, 3], [-1, 0, 1])], min_score=0.9)  # below the threshold: only the best node, a probe
    assert probe.propose([DraftRequest(0, [9, 9], 2, 6)]).tokens[0].tolist() == [1]
    budget = drafter.propose([DraftRequest(1, [9, 9], 2, 2)])
    assert budget.num_nodes() == [2]  # the request's own budget


def test_calibration_learns_from_what_the_target_kept():
    drafter = hybrid([([1, 2, 3], [-1, 0, 1]), ([1, 5, 4], [-1, 0, -1], [0.9, 0.6, 0.3])])
    drafter.propose([DraftRequest(0, [9, 9], 2, 6)])
    drafter.propose([DraftRequest(0, [9, 9, 1, 2, 7], 3, 6)])  # kept 1, 2 then the target's own 7
    a = calibration(drafter, 0)
    # A: depth 1 and 2 accepted (b = 1 each): (1 + 1) / (1 + 2); depth 3 rejected: 1 / 3
    assert a[:3] == [round(2 / 3, 4), round(2 / 3, 4), round(1 / 3, 4)]
    # B: [1] accepted with b 0.9 and [4] not (b 0.3) at depth 1: (1 + 1) / (1.2 + 2); [1 5] not: 1 / (0.6 + 2)
    assert calibration(drafter, 1)[:2] == [round(2 / 3.2, 4), round(1 / 2.6, 4)]
    preempted = DraftRequest(0, [9, 9, 1, 2, 7, 8], 1, 6, epoch=1)
    drafter.propose([preempted])  # another epoch: nothing is learnt from a tree whose K/V was dropped
    assert calibration(drafter, 0)[:3] == a[:3]
    drafter.release(0)
    drafter.forget()  # between benchmark passes: back to the prior, (0 + 1) / (0 + 2)
    assert set(calibration(drafter, 0)) == {0.5}


def test_a_source_that_does_not_pay_drafts_only_on_probe_steps():
    """A always drafts 1, which the target never keeps; B drafts 7, which it always keeps. A's g(1) falls as
    1 / (n + 2): under min_score 0.3 after two misses, then A is asked only every PROBE_EVERY-th step (and at a
    new request's first step), while B, which pays, drafts every step."""
    drafter = hybrid([([1], [-1]), ([7], [-1])], k=2, min_score=0.3)
    tokens = [9, 9]
    for _ in range(40):
        draft = drafter.propose([DraftRequest(0, list(tokens), 2, 2)])
        assert 7 in draft.tokens[0].tolist()
        tokens += [7, 5]  # the target kept 7 (B's node), then its own 5
    assert calibration(drafter, 0)[0] < 0.3 < calibration(drafter, 1)[0]
    # A is asked at step 1 (the request's first, g(1) = 1/2) and 2 (1/3 >= 0.3); from step 3 (1/4) only at
    # steps 8, 16, 24, 32, 40, where its node scores under min_score and is not verified (B's is the best)
    assert drafter.asked == [2 + 40 // HybridDrafter.PROBE_EVERY, 40]
    drafter.propose([DraftRequest(1, [9, 9], 2, 2)])  # a new request: every source sees its first step
    assert drafter.asked == [2 + 40 // HybridDrafter.PROBE_EVERY + 1, 41]


def test_a_depth_that_fell_under_min_score_is_probed_and_recovers():
    """A drafts 1 2 3. The target first rejects 2 a few times (g(2) falls to 1/6, under min_score 0.3, and
    depth 2 would never be verified again), then always keeps 1 2 3. Probe steps verify the whole best path, so
    g(2) and g(3) climb back over min_score and the full chain is drafted again on ordinary steps."""
    drafter = hybrid([([1, 2, 3], [-1, 0, 1])], k=3, min_score=0.3)
    tokens = [9, 9]
    sizes = []
    for step in range(1, 41):
        draft = drafter.propose([DraftRequest(0, list(tokens), 2, 3)])
        sizes.append(draft.num_nodes()[0])
        tokens += [1, 2, 3, 5] if step > 4 else [1, 5]  # the first four steps: 2 rejected
    g = calibration(drafter, 0)
    assert sizes[4] == 1 and g[1] > 0.3 and g[2] > 0.3  # fell under min_score, then earned it back
    assert sizes[HybridDrafter.PROBE_EVERY - 1] == 3  # a probe step takes the whole best path
    assert sizes[-1] == 3


HYBRID = {"method": "hybrid", "num_speculative_tokens": 8, "sources": [
    {"method": "ngram", "num_speculative_tokens": 4},
    {"method": "suffix", "num_speculative_tokens": 6},
    {"method": "recycle", "num_speculative_tokens": 3}]}


@pytest.mark.parametrize("min_score", [0.0, 0.15])
def test_hybrid_is_lossless(target_dir, other_draft_dir, reference, min_score):
    config = {**HYBRID, "min_score": min_score,
              "sources": HYBRID["sources"] + [{"method": "draft_model", "model": str(other_draft_dir),
                                                "num_speculative_tokens": 3}]}
    llm = LLM(str(target_dir), speculative_config=every_step(config))
    for _ in range(2):
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == reference
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 0
    assert llm.engine.allocator.num_used == 0


def test_sampled_output_with_a_mixed_tree_follows_the_target(target_dir, other_draft_dir, tmp_path):
    """A tree merging a random draft model's sampled chain with retrieval's branches over the target's likely
    tokens keeps the first speculative step's distribution."""
    plain = LLM(str(target_dir), max_num_seqs=256)
    spec = LLM(str(target_dir), max_num_seqs=256, speculative_config=every_step({
        "method": "hybrid", "num_speculative_tokens": 6, "min_score": 0.0, "sources": [
            {"method": "draft_model", "model": str(other_draft_dir), "num_speculative_tokens": 2},
            {"method": "retrieval", "corpus": likely_corpus(tmp_path / "c.npz", plain.engine.model),
             "num_speculative_tokens": 4, "min_token_prob": 0.0}]}))
    assert_first_step_follows_plain(plain, spec)


@pytest.mark.parametrize("config, message", [
    ({"sources": []}, "needs 'sources'"),
    ({"sources": [{"num_speculative_tokens": 3}]}, "must be a speculative config with a 'method'"),
    ({"sources": [{"method": "hybrid", "sources": []}]}, "cannot itself be 'hybrid'"),
    ({"sources": [{"method": "ngram", "num_speculative_tokens": 9}]}, "more than the hybrid's"),
    ({"sources": [{"method": "layer_skip", "num_layers": 2,
                   "tree": {"topk": 2, "num_steps": 2, "num_draft_tokens": 3}}]}, "dynamic trees cannot be nested"),
    ({"sources": [{"method": "ngram"}], "min_score": 2}, "min_score"),
    ({"sources": [{"method": "magic"}]}, "unknown speculative method"),
])
def test_bad_hybrid_configs_are_refused(target_dir, config, message):
    with pytest.raises(SpecdecError, match=message):
        LLM(str(target_dir), speculative_config=every_step({"method": "hybrid", "num_speculative_tokens": 8, **config}))
