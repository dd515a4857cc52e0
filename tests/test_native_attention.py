"""The native runtime's attention (csrc/attention.h) and argmax: against float64 references, and bit for bit
invariant to what a query is computed with (alone, before draft rows, in a tree, in a prefill, beside other
sequences), for float32 and float16 K/V pools, on every instruction-set path this CPU runs (TESTED_ISAS)."""
from __future__ import annotations

from functools import lru_cache

import pytest
import torch
from conftest import needs_native

from specdec.kv_cache import paged_inputs
from specdec.models.cpu import native
from specdec.tree import TreeFeed

pytestmark = needs_native
TESTED_ISAS = native.distinct_isas() if native.available() else ["native"]  # as in test_quant.py

HQ, HKV, D, BS = 9, 3, 64, 16


def layout(starts: list[int], feeds: list[int], trees: list[TreeFeed | None] | None = None,
           ids: list[int] | None = None):
    """Sequences feeding feeds[i] rows after starts[i] cached tokens; sequence `ids[i]` (default i) keeps its
    tokens in blocks 64 * (id + 1) on, the same slots in every call."""
    ids = ids or list(range(len(starts)))
    tables = [[64 * (ids[i] + 1) + b for b in range(-(-(s + 64) // BS))] for i, s in enumerate(starts)]
    rows = [[7] * (n if trees is None or trees[i] is None else len(trees[i].index)) for i, n in enumerate(feeds)]
    _, _, meta = paged_inputs(tables, starts, rows, trees, block_size=BS)
    return meta


def attend(q: torch.Tensor, pools: tuple[torch.Tensor, torch.Tensor], meta, isa: str | None = None) -> torch.Tensor:
    return native.ops(isa).attention(q, *pools, meta.context_slots, meta.mask,
                                     meta.row_starts(), q.shape[-1] ** -0.5)


def reference(q: torch.Tensor, pools: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor:
    """float64 softmax attention over each query's visible slots (the pools' stored values, widened)."""
    k_pool, v_pool = (p.double() for p in pools)
    group, d = q.shape[1] // k_pool.shape[1], q.shape[2]
    out, row = torch.empty(q.shape, dtype=torch.float64), 0
    for b, n in enumerate(meta.query_lens):
        for s in range(n):
            slots = meta.context_slots[b][meta.mask[b, s]]
            keys, values = k_pool[slots].repeat_interleave(group, 1), v_pool[slots].repeat_interleave(group, 1)
            scores = torch.einsum("hd,khd->hk", q[row].double(), keys) * d ** -0.5
            out[row] = torch.einsum("hk,khd->hd", scores.softmax(-1), values)
            row += 1
    return out


def random_pools(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(256 * BS, HKV, D, generator=g) * 2).to(dtype) for _ in range(2))


@lru_cache(maxsize=1)  # the ISAs vary fastest: each case's float64 reference is computed once
def case(dtype: torch.dtype, starts: tuple[int, ...], feeds: tuple[int, ...]):
    meta = layout(list(starts), list(feeds))
    q = torch.randn(sum(meta.query_lens), HQ, D, generator=torch.Generator().manual_seed(1))
    pools = random_pools(dtype)
    return q, pools, meta, reference(q, pools, meta)


@pytest.mark.parametrize("isa", TESTED_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("starts, feeds", [([0], [1]), ([37], [1]), ([700], [1]), ([31, 95, 300], [1, 1, 1]),
                                           ([64, 5], [9, 3]), ([200], [40]), ([0], [70])])
def test_attention_matches_float64(dtype, starts, feeds, isa):
    """Decode, chains of drafts and prefills over 1 to 23 chunks of 32 keys: only float32 rounding differs."""
    q, pools, meta, ref = case(dtype, tuple(starts), tuple(feeds))
    assert (attend(q, pools, meta, isa).double() - ref).abs().max().item() < 2e-5


@pytest.mark.parametrize("isa", TESTED_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tree_rows_see_only_their_ancestors(dtype, isa):
    parents = [-1, -1, 0, 0, 1, 2]  # two roots, their children, a grandchild
    meta = layout([130], [0], [TreeFeed.verification(parents)])
    q = torch.randn(len(parents) + 1, HQ, D, generator=torch.Generator().manual_seed(2))
    pools = random_pools(dtype, 3)
    assert (attend(q, pools, meta, isa).double() - reference(q, pools, meta)).abs().max().item() < 2e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_vector_paths_agree_bit_for_bit_and_the_scalar_path_within_rounding(dtype):
    """Attention has no VNNI code: every vector build runs the same AVX2 instructions, so the same bits. The
    portable path computes scores, exp (libm's, not the 8-lane polynomial) and sums in another order: not the
    same bits, but within 2e-6 of the largest output (seen: 8e-7; either path is 3e-6 or less from float64)."""
    q, pools, meta, _ = case(dtype, (64, 5), (9, 3))
    outs = {isa: attend(q, pools, meta, isa) for isa in TESTED_ISAS}
    vector = [isa for isa in TESTED_ISAS if native.ops(isa).isa() != "portable"]
    for isa in vector[1:]:
        assert torch.equal(outs[isa], outs[vector[0]]), (isa, vector[0])
    base = outs[vector[0] if vector else "native"]
    for isa in TESTED_ISAS:
        assert ((outs[isa] - base).abs().max() / base.abs().max()).item() < 2e-6, isa


@pytest.mark.parametrize("isa", TESTED_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cached", [0, 31, 32, 100, 640])
def test_a_query_has_the_same_bits_whatever_it_is_computed_with(dtype, cached, isa):
    """The query at position `cached` alone (a plain decode step) equals it followed by 8 and 15 draft rows, as
    the root of a draft tree, beside two other sequences, and as row 20 of a 40-row prefill (which splits the
    work by query blocks instead of by chunks): greedy speculative output then equals plain output by
    construction."""
    pools = random_pools(dtype, cached)
    g = torch.Generator().manual_seed(cached + 1)
    q = torch.randn(40, HQ, D, generator=g)
    alone = attend(q[:1], pools, layout([cached], [1]), isa)[0]
    assert torch.equal(attend(q[:9], pools, layout([cached], [9]), isa)[0], alone)
    assert torch.equal(attend(q[:16], pools, layout([cached], [16]), isa)[0], alone)
    tree = TreeFeed.verification([-1, -1, 0, 1])
    assert torch.equal(attend(q[:5], pools, layout([cached], [0], [tree]), isa)[0], alone)
    others = torch.cat([torch.randn(3, HQ, D, generator=g), q[:1], torch.randn(5, HQ, D, generator=g)])
    assert torch.equal(attend(others, pools, layout([50, cached, 300], [3, 1, 5], ids=[1, 0, 2]), isa)[3], alone)
    if cached >= 20:
        prefill = torch.cat([torch.randn(20, HQ, D, generator=g), q[:1], torch.randn(19, HQ, D, generator=g)])
        assert torch.equal(attend(prefill, pools, layout([cached - 20], [40]), isa)[20], alone)


@pytest.mark.parametrize("hq, hkv, d", [(16, 2, 128), (8, 8, 32), (12, 4, 80), (6, 1, 48), (10, 5, 24), (4, 2, 20)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_head_shape_matches_float64_with_the_same_bits_everywhere(hq, hkv, d, dtype):
    """The kernel's tiles follow the head size (a multiple of 64, 32, 16 or 8; 20 takes the buffered path) and the
    query heads per KV head (1 to 8 here): each shape matches float64, a query has the same bits alone and before
    7 draft rows, and every vector build gives the same bits."""
    g = torch.Generator().manual_seed(hq * d)
    pools = tuple((torch.randn(256 * BS, hkv, d, generator=g) * 2).to(dtype) for _ in range(2))
    q = torch.randn(8, hq, d, generator=g)
    meta = layout([75], [8])
    ref = reference(q, pools, meta)
    outs = {}
    for isa in TESTED_ISAS:
        outs[isa] = out = attend(q, pools, meta, isa)
        assert (out.double() - ref).abs().max().item() < 2e-5, isa
        assert torch.equal(attend(q[:1], pools, layout([75], [1]), isa)[0], out[0]), isa
    vector = [isa for isa in TESTED_ISAS if native.ops(isa).isa() != "portable"]
    for isa in vector[1:]:
        assert torch.equal(outs[isa], outs[vector[0]]), (isa, vector[0])


@pytest.mark.parametrize("isa", TESTED_ISAS)
def test_argmax_is_the_first_maximum_like_torch(isa):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 49157, generator=g)
    logits[1, 40000] = logits[1, 3] = 50.0  # a tie: the first index wins
    logits[2, -1] = 60.0  # in the scalar tail
    logits[3] = 1.0  # all equal
    for rows in (logits, logits[:, :5], logits[:, :8], logits[:, :13]):
        assert torch.equal(native.ops(isa).argmax_rows(rows.contiguous()), rows.argmax(-1))
    batched = logits[:6].reshape(2, 3, -1)  # any leading shape: [..., V] -> [...]
    assert torch.equal(native.ops(isa).argmax_rows(batched), batched.argmax(-1))


@pytest.mark.parametrize("isa", TESTED_ISAS)
def test_logprob_rows_are_torchs_log_softmax_and_topk(isa):
    """The logprobs kernel: each row's token's log-softmax value and its k largest with their indices (largest
    first, the lowest index first among equals), torch's values to float rounding, in the vector body and the
    scalar tail alike."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 49157, generator=g) * 4
    logits[1, 40000] = logits[1, 3] = 50.0  # a tie
    logits[2, -1] = 60.0  # in the scalar tail
    tokens = torch.tensor([0, 40000, 49156, 77, 12345])
    ref = torch.log_softmax(logits, -1)
    for k in (0, 1, 7, 20):
        for rows, toks in ((logits, tokens), (logits[:, :13], tokens % 13)):
            k = min(k, rows.shape[1])
            picked, values, ids = native.ops(isa).logprob_rows(rows.contiguous(), toks, k)
            want = torch.log_softmax(rows, -1)
            assert torch.allclose(picked, want.gather(1, toks[:, None])[:, 0], atol=2e-5)
            top = want.topk(k, -1)
            assert torch.allclose(values, top.values, atol=2e-5) and values.shape == (5, k)
            assert torch.equal(ids[[0, 2, 3, 4]], top.indices[[0, 2, 3, 4]])
    _, _, ids = native.ops(isa).logprob_rows(logits, tokens, 2)
    assert ids[1].tolist() == [3, 40000] and torch.allclose(ref[1, 3], ref[1, 40000])


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_load():
    """torch's extension builder waits forever on its lock file, even to load a build that is up to date; one left by
    a process killed mid-build used to hang every later load. Under specdec's own lock (released by the kernel when a
    process dies) such a leftover is removed, and a fresh process loads the kernels. In the tests' own cache (the
    build is there already, so this costs a load, not a build); the lock is removed afterwards whatever happens, so a
    regression fails this test alone."""
    import subprocess
    import sys

    lock = native.cache_dir() / "lock"  # what torch's builder leaves when its process is killed
    native.ops()  # built (and its cache folder made) before the leftover is planted
    lock.touch()
    try:
        load = "from specdec.models.cpu import native; native.ops(); print('loaded')"
        done = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=300)
        assert done.stdout.strip() == "loaded", done.stderr[-2000:]
        assert not lock.exists() and list(lock.parent.glob("*.so"))
    finally:
        lock.unlink(missing_ok=True)


def test_the_tests_keep_out_of_the_users_cache():
    """What specdec caches on disk (kernels' builds, retrieval datastores, converted tokenizers: all under
    $SPECDEC_CACHE) goes to the tests' own folder (conftest), not the user's ~/.cache/specdec."""
    import os
    from pathlib import Path

    from specdec.drafting import retrieval

    home = (Path.home() / ".cache").resolve()
    for path in (Path(os.environ.get("SPECDEC_CACHE", home)), native.cache_dir(), retrieval.cache_dir()):
        assert not path.resolve().is_relative_to(home), path
