"""Tree attention (prefix + suffix merged by log-sum-exp) against explicit one-shot attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.models.blocks.attention import _sdpa
from specdec.models.blocks.tree_attention import attention_with_lse, merge_attention, paged_tree_attention

HQ, HKV, D, BLOCK = 6, 2, 16, 4
SCALE = D ** -0.5
TOL = 1e-5


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """parents[i] < i (or -1 for a root) -> [S, S] bool: row i = own bit OR parent's row."""
    S = len(parents)
    m = torch.zeros(S, S, dtype=torch.bool)
    for i, p in enumerate(parents):
        m[i, i] = True
        if p >= 0:
            m[i] |= m[p]
    return m


def random_parents(S: int, gen: torch.Generator) -> list[int]:
    """A random tree in topological order: token 0 is the root, every other token has an earlier parent."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, S)]


def paged_prefix(prefix_lens: list[int], gen: torch.Generator):
    """Random K/V pools with each sequence's prefix scattered over shuffled blocks.

    Returns k_pool, v_pool [num_slots, Hkv, D], prefix_slots [B, P] (padded with 0), and the
    per-sequence dense prefixes (list of ([len, Hkv, D], [len, Hkv, D])) for the reference.
    """
    blocks_per_seq = [-(-n // BLOCK) for n in prefix_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few spare blocks hold garbage that must never be read
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    k_pool = torch.randn(num_blocks * BLOCK, HKV, D, generator=gen)
    v_pool = torch.randn(num_blocks * BLOCK, HKV, D, generator=gen)
    P = max(max(prefix_lens), 1)
    prefix_slots = torch.zeros(len(prefix_lens), P, dtype=torch.long)
    dense = []
    for i, n in enumerate(prefix_lens):
        blocks, perm = perm[:blocks_per_seq[i]], perm[blocks_per_seq[i]:]
        slots = torch.tensor([blocks[t // BLOCK] * BLOCK + t % BLOCK for t in range(n)], dtype=torch.long)
        prefix_slots[i, :n] = slots
        dense.append((k_pool[slots], v_pool[slots]))
    return k_pool, v_pool, prefix_slots, dense


def tree_attention(q, k_new, v_new, k_pool, v_pool, prefix_slots, prefix_lens, tree_mask, scale):
    """The tree tokens' K/V [B, S, Hkv, D] written into fresh pool slots, as the engine writes them, then
    `paged_tree_attention` over the pool."""
    B, S = k_new.shape[:2]
    suffix_slots = k_pool.shape[0] + torch.arange(B * S).view(B, S)
    k_pool = torch.cat([k_pool, k_new.reshape(B * S, *k_new.shape[2:])])
    v_pool = torch.cat([v_pool, v_new.reshape(B * S, *v_new.shape[2:])])
    return paged_tree_attention(q, k_pool, v_pool, prefix_slots, prefix_lens, suffix_slots, tree_mask, scale)


def reference(q, k_new, v_new, dense, tree_mask):
    """One-shot SDPA per sequence over [prefix + new] with repeated KV heads and the combined mask."""
    outs = []
    for i, (kp, vp) in enumerate(dense):
        keys = torch.cat([kp, k_new[i]]).repeat_interleave(HQ // HKV, dim=1)  # [n + S, Hq, D]
        values = torch.cat([vp, v_new[i]]).repeat_interleave(HQ // HKV, dim=1)
        S = q.shape[1]
        mask = torch.cat([torch.ones(S, kp.shape[0], dtype=torch.bool), tree_mask[i]], dim=1)  # [S, n + S]
        o = F.scaled_dot_product_attention(q[i].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                           attn_mask=mask, scale=SCALE)  # [Hq, S, D]
        outs.append(o.transpose(0, 1))
    return torch.stack(outs)


@pytest.mark.parametrize("prefix_lens", [[5, 13, 0], [0, 0], [4, 8], [1]])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_tree_attention_matches_one_shot_reference(prefix_lens, as_tensor):
    gen = torch.Generator().manual_seed(sum(prefix_lens) + 7 * len(prefix_lens))
    B, S = len(prefix_lens), 7
    k_pool, v_pool, prefix_slots, dense = paged_prefix(prefix_lens, gen)
    q = torch.randn(B, S, HQ, D, generator=gen)
    k_new = torch.randn(B, S, HKV, D, generator=gen)
    v_new = torch.randn(B, S, HKV, D, generator=gen)
    tree_mask = torch.stack([ancestor_mask(random_parents(S, gen)) for _ in range(B)])
    lens = torch.tensor(prefix_lens) if as_tensor else prefix_lens
    out = tree_attention(q, k_new, v_new, k_pool, v_pool, prefix_slots, lens, tree_mask, SCALE)
    assert out.shape == (B, S, HQ, D)
    assert (out - reference(q, k_new, v_new, dense, tree_mask)).abs().max() < TOL


def test_tree_attention_without_prefix_columns():
    """A batch with no cached prefix at all (prefix_slots [B, 0]) is pure suffix attention."""
    gen = torch.Generator().manual_seed(3)
    B, S = 2, 5
    q = torch.randn(B, S, HQ, D, generator=gen)
    k_new, v_new = torch.randn(B, S, HKV, D, generator=gen), torch.randn(B, S, HKV, D, generator=gen)
    tree_mask = torch.stack([ancestor_mask(random_parents(S, gen)) for _ in range(B)])
    pool = torch.randn(8, HKV, D, generator=gen)
    out = tree_attention(q, k_new, v_new, pool, pool, torch.zeros(B, 0, dtype=torch.long), [0, 0], tree_mask, SCALE)
    dense = [(torch.empty(0, HKV, D), torch.empty(0, HKV, D))] * B
    assert (out - reference(q, k_new, v_new, dense, tree_mask)).abs().max() < TOL


def test_chain_tree_reproduces_causal_attention():
    """A chain (each token's parent is the previous one) is exactly causal attention after the prefix."""
    gen = torch.Generator().manual_seed(11)
    prefix_lens, S = [6, 9], 4
    B = len(prefix_lens)
    k_pool, v_pool, prefix_slots, dense = paged_prefix(prefix_lens, gen)
    q = torch.randn(B, S, HQ, D, generator=gen)
    k_new, v_new = torch.randn(B, S, HKV, D, generator=gen), torch.randn(B, S, HKV, D, generator=gen)
    chain = torch.tril(torch.ones(S, S, dtype=torch.bool))
    assert torch.equal(chain, ancestor_mask(list(range(-1, S - 1))))
    out = tree_attention(q, k_new, v_new, k_pool, v_pool, prefix_slots, prefix_lens, chain.expand(B, S, S), SCALE)
    for i, (kp, vp) in enumerate(dense):
        n = kp.shape[0]
        keys, values = torch.cat([kp, k_new[i]])[None], torch.cat([vp, v_new[i]])[None]  # [1, n + S, Hkv, D]
        causal = torch.ones(S, n + S, dtype=torch.bool).tril(diagonal=n)[None]  # query s sees keys <= n + s
        ref = _sdpa(q[i:i + 1], keys, values, causal, SCALE)[0]
        assert (out[i] - ref).abs().max() < TOL


def test_attention_with_lse_matches_sdpa_and_logsumexp():
    gen = torch.Generator().manual_seed(5)
    B, S, L = 2, 3, 9
    q = torch.randn(B, S, HQ, D, generator=gen)
    k, v = torch.randn(B, L, HKV, D, generator=gen), torch.randn(B, L, HKV, D, generator=gen)
    mask = torch.rand(B, S, L, generator=gen) < 0.6
    mask[..., 0] = True
    out, lse = attention_with_lse(q, k, v, mask, SCALE)
    assert (out - _sdpa(q, k, v, mask, SCALE)).abs().max() < TOL
    kr = k.repeat_interleave(HQ // HKV, dim=2)  # [B, L, Hq, D]
    scores = torch.einsum("bshd,blhd->bshl", q, kr) * SCALE
    ref_lse = torch.logsumexp(scores.masked_fill(~mask[:, :, None], float("-inf")), dim=-1)
    assert lse.dtype == torch.float32 and lse.shape == (B, S, HQ)
    assert (lse - ref_lse).abs().max() < TOL
    out_all, _ = attention_with_lse(q, k, v, None, SCALE)
    assert (out_all - _sdpa(q, k, v, torch.ones(B, S, L, dtype=torch.bool), SCALE)).abs().max() < TOL


def test_query_that_sees_nothing_gives_zero_and_neg_inf():
    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 2, HQ, D, generator=gen), torch.randn(1, 3, HKV, D), torch.randn(1, 3, HKV, D)
    mask = torch.tensor([[[True, False, True], [False, False, False]]])
    out, lse = attention_with_lse(q, k, v, mask, SCALE)
    assert torch.isfinite(lse[0, 0]).all() and torch.isneginf(lse[0, 1]).all()
    assert torch.equal(out[0, 1], torch.zeros(HQ, D)) and not torch.isnan(out).any()


def test_merge_equals_one_shot_on_split_keys():
    gen = torch.Generator().manual_seed(9)
    B, S, L, split = 2, 4, 10, 6
    q = torch.randn(B, S, HQ, D, generator=gen)
    k, v = torch.randn(B, L, HKV, D, generator=gen), torch.randn(B, L, HKV, D, generator=gen)
    mask = torch.rand(B, S, L, generator=gen) < 0.5
    mask[:, :, 0] = True  # every query sees at least one key overall ...
    mask[0, 1, split:] = False  # ... but this one sees nothing on side b
    mask[1, :, split:] = False  # and sequence 1 sees nothing on side b at all
    mask[0, 2, 1:split] = False
    mask[0, 2, 0] = False  # this query sees nothing on side a
    mask[0, 2, split] = True
    full_out, full_lse = attention_with_lse(q, k, v, mask, SCALE)
    out_a, lse_a = attention_with_lse(q, k[:, :split], v[:, :split], mask[..., :split], SCALE)
    out_b, lse_b = attention_with_lse(q, k[:, split:], v[:, split:], mask[..., split:], SCALE)
    assert torch.isneginf(lse_b[0, 1]).all() and torch.isneginf(lse_a[0, 2]).all()
    for (oa, la, ob, lb) in [(out_a, lse_a, out_b, lse_b), (out_b, lse_b, out_a, lse_a)]:  # order-free
        out, lse = merge_attention(oa, la, ob, lb)
        assert (out - full_out).abs().max() < TOL and (lse - full_lse).abs().max() < TOL


def test_merge_of_two_empty_sides_is_empty():
    out = torch.randn(3, HQ, D)
    lse = torch.full((3, HQ), float("-inf"))
    m_out, m_lse = merge_attention(out, lse, out, lse)
    assert torch.equal(m_out, torch.zeros_like(out)) and torch.isneginf(m_lse).all()


def test_dtype_is_preserved():
    gen = torch.Generator().manual_seed(1)
    k_pool, v_pool, prefix_slots, _ = paged_prefix([3, 5], gen)
    q = torch.randn(2, 3, HQ, D, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    kn, vn = torch.randn(2, 3, HKV, D).bfloat16(), torch.randn(2, 3, HKV, D).bfloat16()
    tm = ancestor_mask([-1, 0, 0]).expand(2, 3, 3)
    out = tree_attention(q, kn, vn, k_pool.bfloat16(), v_pool.bfloat16(), prefix_slots, [3, 5], tm, SCALE)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_engine_tree_layouts_split_into_prefix_and_suffix_match_the_full_mask():
    """What the model runs: ModelRunner lays out verification trees (and a chain beside them) over the
    paged cache; attention split into prefix + tree suffix equals attention with the full explicit mask."""
    from specdec.kv_cache import BlockAllocator, BlockTable, paged_inputs
    from specdec.models.blocks.attention import paged_attention
    from specdec.tree import TreeFeed

    gen = torch.Generator().manual_seed(4)
    allocator = BlockAllocator(64, 4)
    starts, trees = [9, 3, 14], [random_parents(6, gen), None, random_parents(3, gen)]
    feeds = [[1] * (len(p) + 1) if p is not None else [1, 1, 1] for p in trees]
    tables = []
    for s, f in zip(starts, feeds):
        table = BlockTable()
        allocator.allocate(table, s + len(f))
        tables.append(table.blocks)
    layouts = [TreeFeed.verification(p) if p is not None else None for p in trees]
    _, _, meta = paged_inputs(tables, starts, feeds, layouts, block_size=allocator.block_size)
    assert meta.tree_starts == starts
    T, Hq, Hkv, D = sum(len(f) for f in feeds), 6, 2, 16
    q = torch.randn(T, Hq, D, generator=gen)
    k, v = torch.randn(T, Hkv, D, generator=gen), torch.randn(T, Hkv, D, generator=gen)
    pools = [torch.randn(64 * 4, Hkv, D, generator=gen) for _ in range(2)]
    split = paged_attention(q, k, v, pools[0].clone(), pools[1].clone(), meta, D ** -0.5)
    meta.tree_starts = None
    full = paged_attention(q, k, v, pools[0].clone(), pools[1].clone(), meta, D ** -0.5)
    assert torch.allclose(split, full, atol=1e-5)


@pytest.mark.parametrize("fed", [[1, 2], [3], [4, 5]])
def test_a_tree_level_never_reads_slots_not_fed_yet(fed):
    """A drafter grows a tree level by level: level d attends over the nodes fed before it, while the slots of
    later levels (and of leaves nobody expands) still hold whatever the pool held, NaN included. They must
    add exactly nothing: the result equals attention over a pool where those slots hold zeros."""
    from specdec.kv_cache import paged_inputs
    from specdec.models.blocks.attention import paged_attention
    from specdec.tree import TreeFeed

    gen = torch.Generator().manual_seed(5)
    parents = [-1, -1, 0, 0, 1, 2, 3]  # nodes 1-6 expanded level by level from the roots 0 and 1
    start, Hq, Hkv, D = 6, 6, 2, 16
    written = set(range(start)) | {start + n for n in range(7) if n < min(fed)}  # the prefix, earlier levels
    _, _, meta = paged_inputs([[1, 2, 3, 4]], [start], [[1] * len(fed)], [TreeFeed.level(parents, fed)],
                              block_size=4)
    q = torch.randn(len(fed), Hq, D, generator=gen)
    k, v = torch.randn(len(fed), Hkv, D, generator=gen), torch.randn(len(fed), Hkv, D, generator=gen)
    outs = []
    for fill in (float("nan"), 0.0):
        pools = [torch.full((5 * 4, Hkv, D), fill) for _ in range(2)]
        for p in pools:
            p[:4] = 0  # the null block
            for pos in written:
                p[4 + pos] = torch.randn(Hkv, D, generator=torch.Generator().manual_seed(pos))
        outs.append(paged_attention(q, k, v, pools[0], pools[1], meta, D ** -0.5))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])
