"""Verification: exact tables for greedy and forced sampling, statistical losslessness, seeded repeatability."""
from __future__ import annotations

import math

import pytest
import torch

from specdec.verify import residual_probs, verify, verify_greedy, verify_greedy_chains, verify_sampling

CHAIN3 = [-1, 0, 1]
V = 8


def one_hot_targets(target_ids: list[list[int]], vocab: int = V) -> torch.Tensor:
    """Greedy rows: target_probs [B, N + 1, vocab], one-hot at the given argmax ids."""
    return torch.nn.functional.one_hot(torch.tensor(target_ids), vocab).float()


def run_greedy(tokens: list[list[int]], parents: list[list[int]], target_ids: list[list[int]]):
    """Both the fast greedy path and the general rule on one-hot p; they must agree."""
    d, par = torch.tensor(tokens), torch.tensor(parents)
    fast = verify(d, par, one_hot_targets(target_ids), all_greedy=True)
    general = verify_sampling(d, par, one_hot_targets(target_ids))
    assert fast.accepted_nodes == general.accepted_nodes and fast.emitted_tokens == general.emitted_tokens
    assert fast.accepted_nodes == general.accepted_nodes and torch.equal(fast.num_accepted, general.num_accepted)
    return fast


# tokens, parents, target argmax per row (row 0 = root, row i + 1 = after node i), accepted nodes, emitted
GREEDY_TABLE = {
    "chain all accepted + bonus": ([3, 5, 7], CHAIN3, [3, 5, 7, 2], [0, 1, 2], [3, 5, 7, 2]),
    "chain first rejected": ([3, 5, 7], CHAIN3, [4, 5, 7, 2], [], [4]),
    "chain middle rejected": ([3, 5, 7], CHAIN3, [3, 6, 7, 2], [0], [3, 6]),
    "chain last rejected": ([3, 5, 7], CHAIN3, [3, 5, 1, 2], [0, 1], [3, 5, 1]),
    # root -> {0: 4, 1: 6}; 0 -> {2: 1}; 1 -> {3: 2}
    "tree sibling fall-through": ([4, 6, 1, 2], [-1, -1, 0, 1], [6, 1, 2, 0, 5], [1, 3], [6, 2, 5]),
    "tree first branch": ([4, 6, 1, 2], [-1, -1, 0, 1], [4, 1, 7, 0, 5], [0, 2], [4, 1, 0]),
    "tree no branch": ([4, 6, 1, 2], [-1, -1, 0, 1], [5, 1, 7, 0, 5], [], [5]),
    "tree repeated siblings: first wins": ([4, 4, 1, 2], [-1, -1, 0, 1], [4, 3, 0, 2, 5], [0], [4, 3]),
    # root -> {0, 1, 2}; 1 -> {3, 4}; 3 -> {5}: falls through twice, then once more one level down
    "tree deep fall-through": ([1, 2, 3, 4, 5, 6], [-1, -1, -1, 1, 1, 3],
                               [2, 0, 5, 0, 6, 0, 7], [1, 4], [2, 5, 0]),
}


@pytest.mark.parametrize("case", GREEDY_TABLE)
def test_greedy_table(case):
    tokens, parents, target, nodes, emitted = GREEDY_TABLE[case]
    r = run_greedy([tokens], [parents], [target])
    assert r.accepted_nodes == [nodes] and r.emitted_tokens == [emitted]
    assert r.num_accepted.tolist() == [len(nodes)]
    assert r.extra_tokens.tolist() == [emitted[-1]]


@pytest.mark.parametrize("N", [1, 2, 3, 4, 5, 8, 9, 16, 17])
def test_greedy_long_chains_see_the_whole_path(N):
    """Only the first node wrong (nothing accepted) and the last node wrong, at each power-of-two boundary."""
    tokens = [[i % V for i in range(N)]] * 2
    target = [[(tokens[0][0] + 1) % V] + tokens[0][1:] + [0], tokens[0][:-1] + [(tokens[0][-1] + 1) % V, 0]]
    r = run_greedy(tokens, [list(range(-1, N - 1))] * 2, target)
    assert r.accepted_nodes == [[], list(range(N - 1))]


def test_greedy_ragged_batch_with_padding():
    """Rows of different sizes padded with parent -2; padding tokens that would match are still ignored."""
    tokens = [[3, 5, 7, 1], [3, 5, 0, 0], [2, 6, 3, 0], [0, 0, 0, 0]]
    parents = [[-1, 0, 1, 2], [-1, 0, -2, -2], [-1, -1, 1, -2], [-2, -2, -2, -2]]
    target = [[3, 5, 7, 1, 4], [3, 5, 6, 0, 0], [6, 0, 3, 0, 0], [4, 0, 0, 0, 0]]
    r = run_greedy(tokens, parents, target)
    assert r.accepted_nodes == [[0, 1, 2, 3], [0, 1], [1, 2], []]
    assert r.emitted_tokens == [[3, 5, 7, 1, 4], [3, 5, 6], [6, 3, 0], [4]]
    assert r.num_accepted.tolist() == [4, 2, 2, 0] and [n[-1] if n else -1 for n in r.accepted_nodes] == [3, 1, 2, -1]


def random_tree_batch(B: int, N: int, vocab: int, seed: int):
    """Random trees (each parent 1 to 4 nodes back, so paths get deep), tokens, target p and draft q."""
    g = torch.Generator().manual_seed(seed)
    parents = (torch.arange(N) - 1 - torch.randint(0, 4, (B, N), generator=g)).clamp(min=-1)
    tokens = torch.randint(0, vocab, (B, N), generator=g)
    p = torch.softmax(3 * torch.randn(B, N + 1, vocab, generator=g), -1)
    q = torch.softmax(torch.randn(B, N, vocab, generator=g), -1)
    return tokens, parents, p, q


def test_greedy_fast_path_matches_the_general_rule_on_random_trees():
    B, N, vocab = 64, 12, 3
    tokens, parents, p, q = random_tree_batch(B, N, vocab, seed=0)
    target = p.argmax(-1)
    agree = torch.rand(B, N, generator=torch.Generator().manual_seed(1)) < 0.7
    tokens = torch.where(agree, target.gather(1, parents + 1), tokens)  # so that paths get deep
    parents[B // 2:, N - 3:] = -2  # ragged
    fast = verify_greedy(tokens, parents, target)
    general = verify_sampling(tokens, parents, torch.nn.functional.one_hot(target, vocab).float(), q)
    assert fast.accepted_nodes == general.accepted_nodes and fast.emitted_tokens == general.emitted_tokens
    assert max(map(len, fast.accepted_nodes)) >= 6  # the comparison reached deep paths


# ---- sampling: hand-made p and q whose outcome is forced ----

def test_residual_is_normalized_positive_part():
    p = torch.tensor([[0.1, 0.4, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.4, 0.1, 0.1, 0.4], [0.25, 0.25, 0.25, 0.25]])
    fallback = torch.tensor([[0.0, 0.0, 0.0, 1.0]]).expand(2, 4)
    r = residual_probs(p, q, fallback)
    assert torch.allclose(r[0], torch.tensor([0.0, 0.6, 0.4, 0.0]))
    assert torch.equal(r[1], fallback[1])  # zero mass: the target's unmodified p


def test_sampling_q_equal_p_always_accepts_and_bonus_comes_from_p():
    n = 20_000
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.2, 0.8, 0.0], [0.1, 0.0, 0.0, 0.9], [0.3, 0.0, 0.7, 0.0]])
    target = p.expand(n, 4, 4)
    r = verify_sampling(torch.tensor([[1, 2, 3]]).expand(n, 3), torch.tensor([CHAIN3]).expand(n, 3),
                        target, target[:, :3])
    assert set(map(tuple, r.accepted_nodes)) == {(0, 1, 2)}
    counts = torch.bincount(r.extra_tokens, minlength=4).double()
    assert counts[1] == counts[3] == 0
    assert abs(counts[0].item() / n - 0.3) < 0.015  # 4.6 standard deviations


def test_sampling_zero_target_mass_always_rejects_and_recovers_from_residual():
    """p(x) = 0 forces a rejection; max(p - q, 0) = [0, .5, 0, 0] forces the recovered token."""
    n = 2_000
    p = torch.tensor([0.0, 0.5, 0.3, 0.2])
    q = torch.tensor([0.5, 0.0, 0.3, 0.2])
    r = verify_sampling(torch.zeros(n, 1, dtype=torch.long), torch.full((n, 1), -1), p.expand(n, 2, 4),
                        q.expand(n, 1, 4))
    assert r.accepted_nodes == [[]] * n and r.emitted_tokens == [[1]] * n


def test_sampling_forced_sibling_fall_through():
    """Root children: token 0 (p = 0, rejected), then token 1 drawn from q = the residual (accepted)."""
    n = 2_000
    p_root = torch.tensor([0.0, 0.5, 0.5, 0.0])
    target = torch.stack([p_root, torch.tensor([0.0, 0.0, 0.0, 1.0]), torch.tensor([0.0, 0.0, 1.0, 0.0])])
    q = torch.stack([torch.tensor([1.0, 0.0, 0.0, 0.0]), p_root])
    r = verify_sampling(torch.tensor([[0, 1]]).expand(n, 2), torch.tensor([[-1, -1]]).expand(n, 2),
                        target.expand(n, 3, 4), q.expand(n, 2, 4))
    assert r.accepted_nodes == [[1]] * n and r.emitted_tokens == [[1, 2]] * n


def test_sampling_deterministic_siblings_remove_the_rejected_token():
    """Root children 0 and 0 again, no q: if the first 0 is rejected, p loses 0, so the repeat is rejected too
    and the recovered token can only be 1."""
    n = 20_000
    target = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]).expand(n, 3, 3)
    r = verify_sampling(torch.zeros(n, 2, dtype=torch.long), torch.full((n, 2), -1), target)
    outcomes = {(tuple(a), tuple(e)) for a, e in zip(r.accepted_nodes, r.emitted_tokens)}
    assert outcomes == {((0,), (0, 2)), ((), (1,))}
    assert abs(r.num_accepted.float().mean().item() - 0.5) < 0.02  # 5.7 standard deviations


# ---- statistical losslessness ----

def chi2_threshold(dof: int, z: float = 4.5) -> float:
    """Wilson-Hilferty upper quantile of chi-square(dof) at normal z: 4.5 sigma is a ~3e-6 false alarm rate."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def assert_follows(samples: torch.Tensor, expected: torch.Tensor) -> None:
    """Pearson chi-square goodness of fit of integer samples [n] to `expected` [K] (all cells >= 1e-3)."""
    n, K = samples.numel(), expected.numel()
    counts = torch.bincount(samples, minlength=K).double()
    e = n * expected.double()
    chi2 = ((counts - e) ** 2 / e).sum().item()
    assert chi2 < chi2_threshold(K - 1), f"chi2 {chi2:.1f} >= {chi2_threshold(K - 1):.1f} with {K - 1} dof"


class Model:
    """Random next-token tables that depend on the whole prefix: tables[d] is [vocab] * (d + 1)."""

    def __init__(self, vocab: int, depth: int, g: torch.Generator, floor: float):
        tables = [torch.rand([vocab] * (d + 1), generator=g) + floor for d in range(depth + 1)]
        self.tables = [t / t.sum(-1, keepdim=True) for t in tables]

    def after(self, prefix: list[torch.Tensor], n: int) -> torch.Tensor:
        """The distribution after `prefix` (one [n] token tensor per position); returns [n, vocab]."""
        return self.tables[len(prefix)][tuple(prefix)] if prefix else self.tables[0].expand(n, -1)


def depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for par in parents:
        out.append(out[par] + 1 if par >= 0 else 0)
    return out


def draft_and_verify(parents: list[int], n: int, vocab: int, deterministic: bool,
                     seed: int) -> tuple[torch.Tensor, Model]:
    """n trials of one draft tree shape; returns the first two tokens [n, 2] and the target model.

    Sampled drafts: each node drawn from the draft model q given its prefix, siblings with replacement from the
    same q. Deterministic drafts: the k-th child is the k-th most likely token of q (EAGLE's greedy tree), the
    same tree in every trial, passed without q (one-hot). (Drafts that vary at random would not do: uniformly
    random deterministic drafts average a missing residual update away.) Target p is a function of the
    prefix, so equal prefixes share p.
    When a step emits one token, the second would come from the next step, i.e. from p(. | x1): it is drawn
    from the target directly, which keeps the expected joint p_root(x1) p(x2 | x1) under a lossless verifier.
    """
    g = torch.Generator().manual_seed(seed)
    target, draft = Model(vocab, max(depths(parents)) + 1, g, 0.3), Model(vocab, max(depths(parents)), g, 0.05)
    prefixes: list[list[torch.Tensor]] = []  # per node, the tokens from the root down to and including it
    q_rows, tokens = [], []
    for i, par in enumerate(parents):
        above = prefixes[par] if par >= 0 else []
        q = draft.after(above, n)  # [n, vocab]
        rank = parents[:i].count(par)  # earlier siblings
        x = (q.topk(rank + 1).indices[:, rank] if deterministic
             else torch.multinomial(q, 1, generator=g).squeeze(1))
        prefixes.append(above + [x])
        q_rows.append(q)
        tokens.append(x)
    p_rows = [target.after([], n)] + [target.after(pre, n) for pre in prefixes]
    torch.manual_seed(seed)  # the verifier's unseeded draws
    r = verify(torch.stack(tokens, 1), torch.tensor([parents]).expand(n, -1), torch.stack(p_rows, 1),
               None if deterministic else torch.stack(q_rows, 1))
    first = torch.tensor([e[0] for e in r.emitted_tokens])
    emitted_second = torch.tensor([e[1] if len(e) > 1 else -1 for e in r.emitted_tokens])
    next_step = torch.multinomial(target.after([first], n), 1, generator=g).squeeze(1)
    return torch.stack([first, torch.where(emitted_second >= 0, emitted_second, next_step)], 1), target


SHAPES = {
    "chain of 3": [-1, 0, 1],
    "2 root children, 1 child each": [-1, -1, 0, 1],
    "3 root children, 2 + 1 grandchildren": [-1, -1, -1, 0, 0, 1],
}


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled q", "deterministic"])
@pytest.mark.parametrize("shape", SHAPES)
def test_emitted_tokens_follow_the_target(shape, deterministic):
    """The first emitted token follows p_root and the first two follow p_root(x1) p(x2 | x1) (chi-square)."""
    vocab, n = 6, 40_000
    seed = list(SHAPES).index(shape) * 2 + deterministic
    pairs, target = draft_and_verify(SHAPES[shape], n, vocab, deterministic, seed)
    p1 = target.tables[0]
    assert_follows(pairs[:, 0], p1)
    assert_follows(pairs[:, 0] * vocab + pairs[:, 1], (p1[:, None] * target.tables[1]).flatten())


# ---- randomness: seeded rows repeat, whatever else is in the batch; mixed batches ----

def test_seeded_rows_repeat_and_ignore_their_neighbours():
    """Same seeds, same result; a seeded row alone gives what it gives padded inside a bigger batch."""
    tokens, parents, p, q = random_tree_batch(3, 6, 5, seed=3)
    parents[0, 4:] = -2  # row 0 has 4 real nodes

    def run(seed: int) -> list[list[int]]:
        gens = [torch.Generator().manual_seed(seed), None, torch.Generator().manual_seed(seed + 1)]
        return verify(tokens, parents, p, q, gens).emitted_tokens

    for seed in range(20):
        first, again = run(seed), run(seed)
        assert first[0] == again[0] and first[2] == again[2]
        alone = verify(tokens[:1, :4], parents[:1, :4], p[:1, :5], q[:1, :4], [torch.Generator().manual_seed(seed)])
        assert alone.emitted_tokens[0] == first[0]
    assert len({tuple(run(seed)[0]) for seed in range(20)}) > 1  # the seed matters


def test_mixed_batch_greedy_rows_follow_argmax():
    tokens, parents, p, q = random_tree_batch(8, 7, 3, seed=4)
    greedy_rows = torch.tensor([True, False] * 4)
    argmax = p.argmax(-1)
    p = torch.where(greedy_rows[:, None, None], torch.nn.functional.one_hot(argmax, 3).float(), p)
    tokens = torch.where(greedy_rows[:, None], argmax.gather(1, parents + 1), tokens)  # so they accept a lot
    mixed = verify(tokens, parents, p, q, [torch.Generator().manual_seed(i) for i in range(8)])
    greedy = verify_greedy(tokens, parents, argmax)
    for i in range(0, 8, 2):
        assert mixed.emitted_tokens[i] == greedy.emitted_tokens[i]
    assert sum(map(len, greedy.accepted_nodes[::2])) > 0


def test_greedy_chains_on_lists_match_the_tensor_verifier():
    """The host-list path the engine takes for greedy chains keeps exactly what `verify_greedy` keeps, on
    random chains of different lengths (none, all accepted, a miss at every position)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        lengths = torch.randint(0, 6, (4,), generator=g).tolist()
        drafts = [torch.randint(0, 3, (n,), generator=g).tolist() for n in lengths]
        targets = [torch.randint(0, 3, (n + 1,), generator=g).tolist() for n in lengths]
        N = max(lengths)
        tokens = torch.tensor([d + [0] * (N - len(d)) for d in drafts], dtype=torch.long).reshape(4, N)
        parents = torch.tensor([list(range(-1, n - 1)) + [-2] * (N - n) for n in lengths],
                               dtype=torch.long).reshape(4, N)
        ids = torch.tensor([t + [0] * (N + 1 - len(t)) for t in targets], dtype=torch.long)
        ref = verify_greedy(tokens, parents, ids)
        got = verify_greedy_chains(drafts, [x for t in targets for x in t])
        assert got.accepted_nodes == ref.accepted_nodes and got.emitted_tokens == ref.emitted_tokens
        assert torch.equal(got.num_accepted, ref.num_accepted) and torch.equal(got.extra_tokens, ref.extra_tokens)


def test_greedy_chains_table():
    got = verify_greedy_chains([[5, 6, 7], [], [1, 2]], [5, 6, 9, 4, 3, 8, 1, 0])
    assert got.accepted_nodes == [[0, 1], [], []]
    assert got.emitted_tokens == [[5, 6, 9], [3], [8]]
