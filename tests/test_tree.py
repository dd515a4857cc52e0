"""Draft trees: exact tables on hand-made trees, refused choice lists, and random trees against naive references."""
from __future__ import annotations

import pytest
import torch

from specdec.tree import (
    TreeFeed,
    ancestor_mask,
    chain,
    depths,
    expand_step,
    full_tree,
    parse_tree_spec,
    pruned_tree,
    select_dynamic_tree,
    tree_from_choices,
)

CHAIN3 = [-1, 0, 1]
#        0 - 1 - 3
# root <
#        2 - 4
TWO_BRANCH = [-1, 0, -1, 1, 2]
RAGGED = [[-1, 0, 1, -2, -2], TWO_BRANCH]  # a chain padded to 5 nodes, then the two-branch tree


def mask_rows(parents: list[int]) -> list[set[int]]:
    mask = ancestor_mask(torch.tensor([parents]))[0]
    return [set(row.nonzero().flatten().tolist()) for row in mask]


# ---- masks, depths, positions, paths ----

@pytest.mark.parametrize("parents, rows", [
    (CHAIN3, [{0}, {0, 1}, {0, 1, 2}]),
    (TWO_BRANCH, [{0}, {0, 1}, {2}, {0, 1, 3}, {2, 4}]),
    ([-1, 0, 1, -2, -2], [{0}, {0, 1}, {0, 1, 2}, {3}, {4}]),  # padding sees only itself
])
def test_ancestor_mask(parents, rows):
    assert mask_rows(parents) == rows


def test_depths_and_fed_positions_on_a_ragged_batch():
    parents = torch.tensor(RAGGED)
    assert depths(parents).tolist() == [[1, 2, 3, 0, 0], [1, 2, 1, 3, 2]]
    # fed for verification: the last committed token, then each node at its depth's position, siblings alike
    feed = TreeFeed.verification(TWO_BRANCH)
    assert feed.rope == [0, 1, 2, 1, 3, 2] and feed.index == [0, 1, 2, 3, 4, 5]


def test_a_chain_is_causal_and_an_empty_tree_is_empty():
    n = 4
    assert torch.equal(ancestor_mask((torch.arange(n) - 1)[None])[0], torch.ones(n, n, dtype=torch.bool).tril())
    empty = torch.zeros(2, 0, dtype=torch.long)
    assert ancestor_mask(empty).shape == (2, 0, 0) and depths(empty).shape == (2, 0)


def naive_ancestors(parents: list[int], i: int) -> set[int]:
    if parents[i] == -2:
        return {i}
    found = {i}
    while parents[i] >= 0:
        i = parents[i]
        found.add(i)
    return found


def random_parents(gen: torch.Generator, n: int) -> list[int]:
    """A random topologically ordered tree over n slots, some of them padding."""
    parents = []
    for i in range(n):
        if torch.rand(1, generator=gen).item() < 0.2:
            parents.append(-2)
        else:
            real = [j for j in range(i) if parents[j] != -2]
            parents.append(real[torch.randint(len(real), (1,), generator=gen).item()] if real and
                           torch.rand(1, generator=gen).item() < 0.8 else -1)
    return parents


def test_ancestor_mask_and_depths_agree_with_a_naive_walk_on_random_trees():
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        batch = [random_parents(gen, 9) for _ in range(3)]
        mask, depth = ancestor_mask(torch.tensor(batch)), depths(torch.tensor(batch))
        for b, parents in enumerate(batch):
            for i in range(len(parents)):
                assert set(mask[b, i].nonzero().flatten().tolist()) == naive_ancestors(parents, i)
                assert depth[b, i] == (0 if parents[i] == -2 else len(naive_ancestors(parents, i)))


# ---- static trees ----

def test_eagle_style_choices():
    choices = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    tree = tree_from_choices(choices)
    assert tree.parents.tolist() == [-1, -1, 0, 0, 2]
    assert tree.ranks.tolist() == [0, 1, 0, 1, 0]
    assert tree.depths.tolist() == [1, 1, 2, 2, 3]
    assert tree.paths == [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    shuffled = tree_from_choices([[0, 0, 0], [0, 1], [1], [0, 0], [0]])  # order of the list does not matter
    assert shuffled.paths == tree.paths and torch.equal(shuffled.parents, tree.parents)
    assert torch.equal(depths(tree.parents[None])[0], tree.depths)


@pytest.mark.parametrize("choices, message", [
    ([[0], [0, 0], [1, 0]], "has no parent"),
    ([[0], [0]], "appears twice"),
    ([[0], []], "non-empty"),
    ([[-1]], "ranks >= 0"),
])
def test_invalid_choices_are_refused(choices, message):
    with pytest.raises(ValueError, match=message):
        tree_from_choices(choices)


def test_full_trees_and_chains():
    assert full_tree(2, 2) == [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1]]
    assert parse_tree_spec("D2-BF2") == full_tree(2, 2) and parse_tree_spec("d3-bf2") == full_tree(3, 2)
    d3 = tree_from_choices(parse_tree_spec("D3-BF2"))
    assert len(d3.paths) == 14 and d3.depths.tolist() == [1] * 2 + [2] * 4 + [3] * 8
    assert (d3.parents[2:] < torch.arange(2, 14)).all()
    assert tree_from_choices(chain(3)).parents.tolist() == CHAIN3
    with pytest.raises(ValueError, match="Dm-BFn"):
        parse_tree_spec("N8")


# per-depth, per-rank acceptance rates; path probabilities:
# (0) .8  (1) .3  (2) .1 | (0,0) .56  (1,0) .21  (0,1) .16  (2,0) .07 ... | (0,0,0) .336  (1,0,0) .126 ...
TABLE = [[0.8, 0.3, 0.1], [0.7, 0.2], [0.6]]


@pytest.mark.parametrize("num_nodes, expected", [
    (1, [[0]]),
    (4, [[0], [1], [0, 0], [0, 0, 0]]),
    (5, [[0], [1], [0, 0], [1, 0], [0, 0, 0]]),
    (6, [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
    (100, full_tree(1, 3) + [[a, b] for a in range(3) for b in range(2)] + [[a, b, 0] for a in range(3)
                                                                        for b in range(2)]),
])
def test_pruned_tree_from_an_acceptance_table(num_nodes, expected):
    assert sorted(pruned_tree(TABLE, num_nodes)) == sorted(expected)
    tree_from_choices(pruned_tree(TABLE, num_nodes))  # prefix-closed, hence a valid tree


def test_pruned_tree_from_measured_paths_stays_prefix_closed():
    # (1, 0) is the most likely path but can only be chosen once (1,) is; (5, 0) has no parent at all
    measured = {(0,): 0.5, (1,): 0.4, (0, 0): 0.2, (1, 0): 0.9, (5, 0): 0.99}
    assert pruned_tree(measured, 2) == [[0], [1]]
    assert pruned_tree(measured, 3) == [[0], [1], [1, 0]]
    assert pruned_tree(measured, 10) == [[0], [1], [0, 0], [1, 0]]
    assert pruned_tree([[0.5, 0.5]], 1) == [[0]]  # ties go to the lower rank


# ---- dynamic trees (EAGLE-2) ----

def test_select_dynamic_tree_exact():
    parents = torch.tensor([[-1, -1, 0, 0, 1, 2]])
    scores = torch.tensor([[-0.1, -1.0, -0.3, -2.0, -1.2, -0.5]])
    keep, new_parents = select_dynamic_tree(scores, parents, 4)
    assert keep.tolist() == [[0, 1, 2, 5]] and new_parents.tolist() == [[-1, -1, 0, 2]]
    keep, new_parents = select_dynamic_tree(scores, parents, 100)  # asking for more keeps everything
    assert keep.tolist() == [[0, 1, 2, 3, 4, 5]] and torch.equal(new_parents, parents)


def test_select_dynamic_tree_ties_padding_and_closure():
    parents = torch.tensor([[-1, 0, -1, -2], [-1, 0, -2, -2], [-1, 0, -1, -2]])
    scores = torch.tensor([[-1.0, -1.0, -1.0, 0.0],   # all tied: lower index wins, parent before child
                           [-0.1, -0.2, 0.0, 0.0],    # fewer real nodes than asked: padding comes last
                           [-2.0, -0.1, -1.0, 0.0]])  # non-monotone: node 1 cannot outrank its parent 0
    keep, new_parents = select_dynamic_tree(scores, parents, 3)
    assert keep.tolist() == [[0, 1, 2], [0, 1, 2], [0, 1, 2]]
    assert new_parents.tolist() == [[-1, 0, -1], [-1, 0, -2], [-1, 0, -1]]
    keep, new_parents = select_dynamic_tree(scores[2:], parents[2:], 2)
    assert keep.tolist() == [[0, 2]] and new_parents.tolist() == [[-1, -1]]


def test_select_dynamic_tree_keeps_the_top_scores_on_random_trees():
    gen = torch.Generator().manual_seed(1)
    for _ in range(30):
        batch = [random_parents(gen, 10) for _ in range(2)]
        parents = torch.tensor(batch)
        logprobs = (-torch.rand(parents.shape, generator=gen)).tolist()
        cum = [[0.0] * len(row) for row in batch]  # true cumulative scores: the parent's plus its own
        for b, row in enumerate(batch):
            for i, p in enumerate(row):
                cum[b][i] = logprobs[b][i] + (cum[b][p] if p >= 0 else 0.0)
        cum = torch.tensor(cum)
        keep, new_parents = select_dynamic_tree(cum, parents, 5)
        for b, row in enumerate(batch):
            real = [i for i, p in enumerate(row) if p != -2]
            expected = sorted(sorted(real, key=lambda i: -cum[b, i].item())[:5])
            assert keep[b, :len(expected)].tolist() == expected
            for k, node in enumerate(expected):  # re-indexed parents point at the same nodes
                old = row[node]
                assert new_parents[b, k].item() == (-1 if old == -1 else expected.index(old))
            assert (new_parents[b, len(expected):] == -2).all()


def test_expand_then_select_builds_an_eagle2_tree():
    # step 1: the root (score 0) proposes its top-2 tokens
    step1 = expand_step(torch.tensor([[-1]]), torch.zeros(1, 1), torch.tensor([[[5, 7]]]),
                        torch.tensor([[[-0.2, -1.0]]]), topk=2)
    assert step1.tokens.tolist() == [[5, 7]] and step1.parents.tolist() == [[-1, -1]]
    assert step1.next_frontier.tolist() == [[0, 1]]
    # step 2: both frontier nodes (tree indices 0, 1) propose 2 children each; expand the best 2 of 4
    step2 = expand_step(step1.next_frontier, step1.scores.gather(1, step1.next_frontier),
                        torch.tensor([[[3, 4], [8, 9]]]), torch.tensor([[[-0.1, -2.0], [-0.05, -0.3]]]), topk=2)
    assert step2.parents.tolist() == [[0, 0, 1, 1]]
    assert torch.allclose(step2.scores, torch.tensor([[-0.3, -2.2, -1.05, -1.3]]))
    assert step2.next_frontier.tolist() == [[0, 2]]
    # rerank: keep the best 4 of the 6 candidates
    tokens = torch.cat([step1.tokens, step2.tokens], 1)
    keep, parents = select_dynamic_tree(torch.cat([step1.scores, step2.scores], 1),
                                        torch.cat([step1.parents, step2.parents], 1), 4)
    assert keep.tolist() == [[0, 1, 2, 4]] and parents.tolist() == [[-1, -1, 0, 1]]
    assert tokens.gather(1, keep).tolist() == [[5, 7, 3, 8]]


def test_expand_step_ties_go_to_the_lower_candidate():
    step = expand_step(torch.tensor([[-1]]), torch.zeros(1, 1), torch.tensor([[[1, 2, 3]]]),
                       torch.tensor([[[-0.5, -0.1, -0.1]]]), topk=2)
    assert step.next_frontier.tolist() == [[1, 2]]
