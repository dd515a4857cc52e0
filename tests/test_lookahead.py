"""Lookahead decoding: the n-gram pool, Jacobi iterations over the window, and lossless outputs."""
from __future__ import annotations

import pytest
from conftest import every_step
from test_drafters import GREEDY, PROMPTS, reference, target_dir  # noqa: F401 (module fixtures)
from test_retrieval import assert_first_step_follows_plain

from specdec import LLM, SpecdecError
from specdec.drafting.base import DraftRequest
from specdec.drafting.lookahead import LookaheadDrafter, NgramPool


def test_pool_keeps_the_most_recent_distinct_continuations_per_first_token():
    pool = NgramPool(max_per_key=2)
    for gram in [(1, 2, 3), (1, 4, 5), (1, 2, 3), (1, 6, 7), (9, 9, 9)]:
        pool.add(gram)
    assert pool.lookup(1, 5) == [(6, 7), (2, 3)]  # (2, 3) was seen again after (4, 5), which was evicted
    assert pool.lookup(1, 1) == [(6, 7)] and pool.lookup(9, 3) == [(9, 9)] and pool.lookup(4, 3) == []
    assert len(pool) == 3


def nodes(draft) -> tuple[list[int], list[int]]:
    n = draft.num_nodes()[0]
    return draft.tokens[0, :n].tolist(), draft.parents[0, :n].tolist()


def test_draft_tree_puts_pool_guesses_first_and_shares_prefixes_with_the_window():
    drafter = LookaheadDrafter(num_speculative_tokens=8, window=3, ngram=3, guesses=2)
    drafter.propose([DraftRequest(0, [5, 6, 7], 3, 8)])  # creates the state
    state = drafter.states[0]
    state.pool.add((7, 8, 9))
    state.pool.add((7, 1, 2))
    state.levels[-1] = {3: 8, 4: 9, 5: 4}  # the newest iterates for positions 3, 4, 5
    tokens, parents = nodes(drafter.propose([DraftRequest(0, [5, 6, 7], 0, 8)]))
    # guesses (newest first): 7 -> 1 2, 7 -> 8 9; the window 8 9 4 shares the nodes of 8 9
    assert tokens == [1, 2, 8, 9, 4] and parents == [-1, 0, -1, 2, 3]
    assert state.window_nodes == {3: 2, 4: 3, 5: 4} and state.root == 2
    # a budget of 3 nodes cuts the window after its first token
    tokens, parents = nodes(drafter.propose([DraftRequest(0, [5, 6, 7], 0, 3)]))
    assert tokens == [1, 2, 8] and state.window_nodes == {3: 2}


def test_jacobi_iterates_become_ngrams_along_diagonals():
    drafter = LookaheadDrafter(num_speculative_tokens=8, window=3, ngram=3, guesses=0)
    drafter.propose([DraftRequest(0, [5, 6, 7], 3, 8)])
    state = drafter.states[0]
    state.levels[-1] = {3: 20, 4: 21, 5: 22}
    tokens, _ = nodes(drafter.propose([DraftRequest(0, [5, 6, 7], 0, 8)]))
    assert tokens == [20, 21, 22]
    drafter.observe_draft(0, tokens, [30, 31, 32, 33])  # after 7 (pos 2): 30; after 20: 31; 21: 32; 22: 33
    assert state.levels[-1] == {3: 30, 4: 31, 5: 32, 6: 33} and len(state.pool) == 0  # one level: no 3-grams yet
    # 30 was committed at position 3 (the root's prediction, the bonus token): the window is 31 32 33
    tokens, _ = nodes(drafter.propose([DraftRequest(0, [5, 6, 7, 30], 1, 8)]))
    assert tokens == [31, 32, 33]
    drafter.observe_draft(0, tokens, [40, 41, 42, 43])  # new level: 4: 40, 5: 41, 6: 42, 7: 43
    # diagonals ending at 5, 6, 7: (20 @ 3, 31 @ 4, 41 @ 5), (21, 32, 42), (22, 33, 43)
    assert sorted(g for k, c in state.pool.grams.items() for g in [(k, *t) for t in c]) == [
        (20, 31, 41), (21, 32, 42), (22, 33, 43)]


def run_greedy(drafter: LookaheadDrafter, prompt: list[int], target, steps: int) -> tuple[list[int], list[int]]:
    """Drive the drafter like the engine does, with `target(context)` as a greedy model: verify the longest
    path the target agrees with, commit it and the next token, hand back the target's guess at every node."""
    seq, accepted_per_step = list(prompt), []
    for _ in range(steps):
        tokens, parents = nodes(drafter.propose([DraftRequest(0, list(seq), 1, drafter.k)]))
        paths: list[list[int]] = []
        for t, p in zip(tokens, parents):
            paths.append((paths[p] if p >= 0 else []) + [t])
        predictions = [target(seq)] + [target(seq + path) for path in paths]
        node, accepted = -1, []
        while True:
            child = next((j for j, p in enumerate(parents) if p == node and tokens[j] == predictions[node + 1]), None)
            if child is None:
                break
            accepted.append(tokens[child])
            node = child
        drafter.observe_draft(0, tokens, predictions)
        seq += accepted + [predictions[node + 1]]
        accepted_per_step.append(len(accepted))
    return seq, accepted_per_step


def test_jacobi_trajectories_fill_the_pool_and_get_accepted():
    """A target whose next token follows from the last one (counting modulo 12): every n-gram the window's
    iterates trace is a true continuation, and once the pool holds one for each token, every step accepts a
    whole guess (N - 1 tokens) beside the bonus token."""
    def target(context: list[int]) -> int:
        return (context[-1] + 1) % 12

    drafter = LookaheadDrafter(num_speculative_tokens=8, window=4, ngram=3, guesses=2)
    seq, accepted = run_greedy(drafter, [1, 2, 3], target, steps=30)
    assert seq == [(1 + i) % 12 for i in range(len(seq))]  # lossless: the target's own continuation
    assert accepted[0] == 0 and accepted[-10:] == [2] * 10
    grams = [(k, *t) for k, c in drafter.states[0].pool.grams.items() for t in c]
    assert len(grams) == 12 and all(g[1] == (g[0] + 1) % 12 and g[2] == (g[1] + 1) % 12 for g in grams)


def test_lookahead_is_lossless(target_dir, reference):  # noqa: F811
    llm = LLM(str(target_dir), speculative_config=every_step({"method": "lookahead", "num_speculative_tokens": 10,
                                                              "lookahead_window": 5, "lookahead_ngram": 3}))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0
    assert llm.engine.allocator.num_used == 0 and not llm.engine.speculator.drafter.states


def test_sampled_output_with_lookahead_follows_the_target(target_dir):  # noqa: F811
    """Tokens 1 .. 5: lookahead drafts little in its first steps, so later ones are compared too."""
    plain = LLM(str(target_dir), max_num_seqs=256)
    spec = LLM(str(target_dir), max_num_seqs=256, speculative_config=every_step({
        "method": "lookahead", "num_speculative_tokens": 6, "lookahead_window": 3, "lookahead_guesses": 1}))
    assert_first_step_follows_plain(plain, spec, n=1500, prompt=[5, 6, 7, 5, 6, 7], last=5)


@pytest.mark.parametrize("key, value", [("lookahead_window", 0), ("lookahead_ngram", 1), ("lookahead_guesses", -1),
                                        ("lookahead_max_pool", 0), ("lookahead_window", True)])
def test_bad_lookahead_options_are_refused(target_dir, key, value):  # noqa: F811
    with pytest.raises(SpecdecError, match=key):
        LLM(str(target_dir), speculative_config=every_step({"method": "lookahead", key: value}))


def test_a_hybrid_does_not_merge_lookahead(target_dir):  # noqa: F811
    with pytest.raises(SpecdecError, match="does not take 'lookahead'"):
        LLM(str(target_dir), speculative_config=every_step({"method": "hybrid", "num_speculative_tokens": 6,
                                                            "sources": [
            {"method": "ngram", "num_speculative_tokens": 3}, {"method": "lookahead", "num_speculative_tokens": 6}]}))
