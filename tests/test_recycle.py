"""Token recycling: the adjacency table, the trees grown from it, the engine's hand-over of the target's
top-k, and that the output never depends on the drafts."""
from __future__ import annotations

import pytest
import torch
from conftest import every_step
from test_drafters import GREEDY, PROMPTS, reference, target_dir  # noqa: F401 (module fixtures)

from specdec import LLM, SamplingParams, SpecdecError
from specdec.drafting.base import Drafter, DraftRequest
from specdec.drafting.recycle import AdjacencyTable, RecycleDrafter, bfs_tree


def test_table_keeps_the_latest_candidates_and_trees_grow_breadth_first():
    table = AdjacencyTable(20, 3)
    table.update([1, 2, 3], [[2, 3, 4], [5, 6, 7], [8, 9, 10]])
    table.update([1], [[3, 2, 11]])  # the latest observation replaces the row
    assert table.candidates(1, 3) == [3, 2, 11] and table.candidates(4, 3) == []
    # root 1 -> (3, 2); 3 -> 8; 2 -> 5; then 8 and 5 have no candidates
    tokens, parents = bfs_tree(table, 1, [2, 1], max_nodes=10, max_depth=5)
    assert tokens == [3, 2, 8, 5] and parents == [-1, -1, 0, 1]
    assert bfs_tree(table, 1, [2, 1], max_nodes=3, max_depth=5) == ([3, 2, 8], [-1, -1, 0])
    assert bfs_tree(table, 1, [1], max_nodes=10, max_depth=1) == ([3], [-1])
    assert bfs_tree(table, 7, [2], max_nodes=10, max_depth=5) == ([], [])


def test_the_drafter_drafts_a_chain_of_recycled_successors():
    drafter = RecycleDrafter(4, vocab_size=20, topk=2)
    drafter.observe(0, [5, 6, 7], [[6, 1], [7, 2], [8, 3]])
    draft = drafter.propose([DraftRequest(0, [9, 5], 1, 4), DraftRequest(1, [4], 1, 4), DraftRequest(2, [5], 1, 2)])
    assert draft.tokens[0].tolist() == [6, 7, 8] and draft.parents[0].tolist() == [-1, 0, 1]  # 8 has none
    assert draft.parents[1].tolist() == [-2] * 3  # 4 was never observed
    assert draft.tokens[2, :2].tolist() == [6, 7] and draft.parents[2].tolist() == [-1, 0, -2]  # the budget


def test_the_engine_hands_over_the_targets_top_k_of_every_kept_token(target_dir):
    """observe() gets, for the last committed token and each accepted draft, the target's own top-k after it:
    checked against a plain forward of the whole sequence."""
    seen = []

    class Recorder(Drafter):
        observe_topk = 3

        def propose(self, requests):
            return RecycleDrafter(3, 320).propose(requests)  # empty table: no drafts

        def observe(self, seq_id, tokens, candidates):
            seen.append((list(tokens), candidates))

    llm = LLM(str(target_dir), speculative_config=every_step({"method": "custom", "num_speculative_tokens": 3,
                                                              "drafter": Recorder()}))
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)[0]
    full = [5, 6, 7] + out.token_ids
    plain = LLM(str(target_dir)).engine.model
    from specdec.training.targets import target_outputs
    _, _, logits = target_outputs(plain, full, ())
    assert [t for tokens, _ in seen for t in tokens] == full[3:len(full) - 1]  # every generated token but the last
    for n, (_, candidates) in enumerate(seen):
        pos = 3 + n  # one kept token per step without drafts
        assert candidates[0] == logits[pos].topk(3).indices.tolist()


@pytest.mark.parametrize("widths", [[1], [2, 1], [3]])
def test_token_recycling_is_lossless_and_gets_accepted(target_dir, reference, widths):
    llm = LLM(str(target_dir), speculative_config=every_step({"method": "recycle", "num_speculative_tokens": 5,
                                                              "recycle_widths": widths}))
    for _ in range(2):
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == reference
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 0


def test_sampled_token_recycling_keeps_the_targets_distribution(tiny_llama_dir):
    """Recycled trees (two candidates, then one below each) hold the target's likeliest tokens, so both
    acceptances and residual draws happen; tokens 1 and 2 and their pair, with and without them, pass a
    two-sample chi-square, failing under a p-value of 1e-4 (test_speculative.significance)."""
    from test_speculative import MIN_P_VALUE, chi_square_two_sample, p_value

    n, prompt = 2000, [5, 6, 7]
    params = [SamplingParams(temperature=1.0, top_k=6, max_tokens=4, ignore_eos=True, seed=i) for i in range(n)]
    plain = LLM(str(tiny_llama_dir), max_num_seqs=256)
    spec = LLM(str(tiny_llama_dir), max_num_seqs=256, speculative_config=every_step({
        "method": "recycle", "num_speculative_tokens": 4, "recycle_widths": [2, 1]}))
    spec.generate([{"prompt_token_ids": prompt}] * 8, params[:8])  # the table learns the target's candidates
    a = torch.tensor([o.token_ids[1:3] for o in plain.generate([{"prompt_token_ids": prompt}] * n, params)])
    outs = spec.generate([{"prompt_token_ids": prompt}] * n, params)
    b = torch.tensor([o.token_ids[1:3] for o in outs])
    drafted = sum(o.metrics["num_draft_tokens"] for o in outs)
    accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
    assert 100 < accepted < 0.9 * drafted
    for a_cat, b_cat in ((a[:, 0], b[:, 0]), (a[:, 1], b[:, 1]), (a[:, 0] * 320 + a[:, 1], b[:, 0] * 320 + b[:, 1])):
        chi2, dof = chi_square_two_sample(a_cat, b_cat)
        assert p_value(chi2, dof) >= MIN_P_VALUE, (chi2, dof)


@pytest.mark.parametrize("options, message", [({"recycle_topk": 0}, "recycle_topk"),
                                              ({"recycle_widths": []}, "recycle_widths"),
                                              ({"recycle_topk": 2, "recycle_widths": [3]}, "recycle_widths")])
def test_bad_recycle_options_are_refused(target_dir, options, message):
    with pytest.raises(SpecdecError, match=message):
        LLM(str(target_dir), speculative_config=every_step({"method": "recycle", "num_speculative_tokens": 3,
                                                            **options}))
