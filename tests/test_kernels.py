"""The numba decode kernels must agree with the torch reference path they replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import MISSING
from specdec.models import kernels
from specdec.models.attention import AttentionMetadata, paged_attention

pytestmark = pytest.mark.skipif(kernels.numba is None, reason=f"{MISSING} numba")


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 16])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (577, 1536), (5, 7)])
def test_linear_matches_torch(m, out_features, in_features):
    g = torch.Generator().manual_seed(m)
    w = torch.randn(out_features, in_features, generator=g)
    x, b = torch.randn(m, in_features, generator=g), torch.randn(out_features, generator=g)
    assert kernels.use_fast_gemv(x, w)
    assert torch.allclose(kernels.linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    assert torch.allclose(kernels.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_large_batches_and_other_dtypes_use_torch():
    w = torch.randn(8, 4)
    assert not kernels.use_fast_gemv(torch.randn(kernels.SMALL_M + 1, 4), w)
    assert not kernels.use_fast_gemv(torch.randn(1, 4, dtype=torch.bfloat16), w.bfloat16())


def test_rms_norm_matches_torch():
    x, w = torch.randn(7, 576), torch.randn(576)
    assert torch.allclose(kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5), atol=1e-5)


def ragged_meta(lengths: list[int], new: int | list[int], block_size: int = 4, num_blocks: int = 64):
    """Metadata for sequences with `lengths` cached tokens each feeding `new` (or new[i]) tokens, blocks
    shuffled."""
    news = new if isinstance(new, list) else [new] * len(lengths)
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(0)) + 1
    B, L, S = len(lengths), max(n + m for n, m in zip(lengths, news)), max(news)
    ctx_slots = torch.zeros(B, L, dtype=torch.long)
    ctx_pos = torch.full((B, L), -1)
    positions = torch.full((B, S), -1, dtype=torch.long)
    used = 0
    for i, (n, m) in enumerate(zip(lengths, news)):
        blocks = perm[used: used + -(-(n + m) // block_size)]
        used += len(blocks)
        p = torch.arange(n + m)
        ctx_slots[i, : n + m] = blocks[p // block_size] * block_size + p % block_size
        ctx_pos[i, : n + m] = p
        positions[i, :m] = torch.arange(n, n + m)
    real = positions >= 0
    slot_mapping = ctx_slots.gather(1, positions.clamp(min=0))[real]
    meta = AttentionMetadata.causal(positions, ctx_slots, ctx_pos, slot_mapping, news)
    return meta, num_blocks * block_size


@pytest.mark.parametrize("lengths, new", [([9], 1), ([3, 17, 8], 1), ([5, 12], 2), ([30, 4], 4),
                                          ([6, 20, 11], [3, 1, 5])])
def test_paged_attention_kernel_matches_sdpa(lengths, new):
    """The attention inside the fused decode layer, against the torch path, over shuffled blocks; the last
    case is ragged (verification of drafts of different lengths in one batch)."""
    meta, num_slots = ragged_meta(lengths, new)
    g = torch.Generator().manual_seed(1)
    T, Hq, Hkv, D = sum(meta.query_lens), 6, 2, 16
    q = torch.randn(T, Hq, D, generator=g)
    k, v = torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)
    pools = [torch.randn(num_slots, Hkv, D, generator=g) for _ in range(2)]
    ref_pools = [p.clone() for p in pools]
    ref = paged_attention(q, k, v, *ref_pools, meta, D ** -0.5)
    out = torch.empty_like(q)
    kernels._paged_attention(q.numpy(), k.numpy(), v.numpy(), pools[0].numpy(), pools[1].numpy(),
                             meta.slot_mapping.numpy(), meta.context_slots.numpy(), meta.mask.numpy(),
                             kernels.query_starts(meta.query_lens), D ** -0.5, out.numpy())
    assert torch.allclose(out, ref, atol=1e-5)
    assert torch.equal(pools[0], ref_pools[0]) and torch.equal(pools[1], ref_pools[1])  # same K/V writes


@pytest.mark.parametrize("cached", [40, 300, 700])
def test_paged_attention_kernel_is_invariant_to_what_is_fed_with_a_query(cached):
    """A query's attention output is bit for bit the same whether it is fed alone (a plain decode step),
    followed by draft tokens (verification), or beside another sequence in the batch: its softmax sum keeps
    the same lanes and order however many masked keys follow. With the batch-invariant GEMM this makes
    greedy speculative output equal plain greedy output by construction, not by luck."""
    g = torch.Generator().manual_seed(cached)
    Hq, Hkv, D = 9, 3, 64

    def run(lengths, news, rows):
        meta, num_slots = ragged_meta(lengths, news, block_size=16, num_blocks=160)
        q, k, v = (rows[name][: sum(news)] for name in "qkv")
        pools = [torch.zeros(num_slots, Hkv, D) for _ in range(2)]
        for pool, cache in zip(pools, (rows["kc"], rows["vc"])):  # the same cached prefix in every run
            slots = meta.context_slots[0, :lengths[0]]
            pool[slots] = cache[: lengths[0]]
        out = torch.empty_like(q)
        kernels._paged_attention(q.numpy(), k.numpy(), v.numpy(), pools[0].numpy(), pools[1].numpy(),
                                 meta.slot_mapping.numpy(), meta.context_slots.numpy(), meta.mask.numpy(),
                                 kernels.query_starts(meta.query_lens), D ** -0.5, out.numpy())
        return out

    rows = {name: torch.randn(16, H, D, generator=g) for name, H in (("q", Hq), ("k", Hkv), ("v", Hkv))}
    rows["kc"], rows["vc"] = torch.randn(cached, Hkv, D, generator=g), torch.randn(cached, Hkv, D, generator=g)
    alone = run([cached], [1], rows)
    assert torch.equal(run([cached], [9], rows)[0], alone[0])  # followed by 8 draft tokens
    assert torch.equal(run([cached], [16], rows)[0], alone[0])
    other = {name: t if name in ("kc", "vc") else torch.cat([t[:1], torch.randn(15, t.shape[1], D, generator=g)])
             for name, t in rows.items()}
    batch = run([cached, 90], [1, 5], other)  # beside another sequence verifying a draft of 4
    assert torch.equal(batch[0], alone[0])


@pytest.mark.parametrize("m", [1, 3, 4, 7])
def test_bfloat16_weights_are_widened_exactly(m):
    """bf16 weights, float32 activations: the same arithmetic as float32 on the bf16-rounded weights."""
    g = torch.Generator().manual_seed(m)
    w = torch.randn(577, 96, generator=g).to(torch.bfloat16)
    x, b = torch.randn(m, 96, generator=g), torch.randn(577, generator=g)
    assert kernels.use_fast_gemv(x, w)
    out = kernels.linear(x, w, b)
    assert out.dtype == torch.float32
    assert torch.allclose(out, F.linear(x, w.float(), b), atol=1e-4, rtol=1e-5)


def test_bfloat16_large_batches_fall_back_to_torch():
    w = torch.randn(8, 4).to(torch.bfloat16)
    x = torch.randn(kernels.SMALL_M + 1, 4)
    out = kernels.linear(x, w)
    assert out.dtype == torch.float32
    assert torch.allclose(out, F.linear(x.bfloat16(), w).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_is_batch_invariant(dtype):
    """A row's result does not depend on how many rows share the call or where it sits, bit for bit:
    this is what makes greedy verification of k drafts agree exactly with k + 1 plain decode steps."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(963, 576, generator=g).to(dtype)  # 60 full blocks of 16 rows and a partial one
    x = torch.randn(kernels.SMALL_M, 576, generator=g)
    alone = torch.cat([kernels.linear(x[m:m + 1], w) for m in range(kernels.SMALL_M)])
    for m in range(1, kernels.SMALL_M + 1):
        assert torch.equal(kernels.linear(x[:m], w), alone[:m]), m
    assert torch.equal(kernels.linear(x[5:12], w), alone[5:12])
