"""Paged KV cache: allocation, rewind, and that paging never changes what the model computes."""
from __future__ import annotations

import pytest
import torch
from conftest import needs_native, sequence_inputs

from specdec import LLM, SamplingParams
from specdec.engine.model_runner import ModelRunner
from specdec.engine.sequence import Sequence
from specdec.kv_cache import NULL_BLOCK, BlockAllocator, BlockTable, KVPool, OutOfBlocks, pool_tensor
from specdec.models.loader import load_model


def test_allocate_grow_truncate_free():
    alloc = BlockAllocator(num_blocks=6, block_size=4)
    assert alloc.num_free == 5  # block 0 is the null block
    t = BlockTable()
    alloc.allocate(t, 9)
    assert len(t.blocks) == 3 and NULL_BLOCK not in t.blocks
    alloc.allocate(t, 12)  # still fits in 3 blocks
    assert len(t.blocks) == 3
    assert alloc.slots(t, 3, 6) == [t.blocks[0] * 4 + 3, t.blocks[1] * 4, t.blocks[1] * 4 + 1]
    alloc.truncate(t, 5)
    assert len(t.blocks) == 2 and alloc.num_free == 3
    alloc.truncate(t, 8)  # truncating to a longer length frees nothing
    assert len(t.blocks) == 2
    alloc.free(t)
    assert t.blocks == [] and alloc.num_free == 5


class _Windowed:
    """A pool whose every layer reads `reach` positions back (only what the allocator asks of a pool)."""

    def __init__(self, reach: int) -> None:
        self.reach = reach

    def fill(self, blocks: list[int], value: float) -> None:  # the debug fill has no tensors to fill here
        pass


@pytest.mark.parametrize("caching", [False, True])
def test_blocks_no_window_reaches_are_freed_and_keep_their_place(caching):
    """Window 6, blocks of 4: with 13 tokens committed the next query (position 13) reads positions 8.. only, so
    blocks 0 and 1 (positions 0-7) are freed and the table keeps the null block in their place; a pool that sees
    every key (a full layer, a draft head) frees nothing. With prefix caching a released block stays keyed for a
    request with the same prefix, and only keyed blocks are released."""
    alloc = BlockAllocator(num_blocks=10, block_size=4, enable_prefix_caching=caching)
    alloc.pools.append(_Windowed(6))
    t, ids = BlockTable(), list(range(100, 116))
    alloc.allocate(t, 14)
    held = list(t.blocks)
    alloc.release_behind(t, 12)  # next query at 12 reads 7..: only block 0 is behind
    assert t.blocks[0] == NULL_BLOCK if not caching else t.blocks == held  # nothing keyed yet
    alloc.register(t, ids, 13)
    alloc.release_behind(t, 13)
    assert t.blocks == [NULL_BLOCK, NULL_BLOCK, *held[2:]] and alloc.num_free == 9 - 2
    if caching:
        assert list(alloc.evictable) == held[:2]  # kept for a later request with this prefix
        other = BlockTable()
        assert alloc.admit(other, ids, max_new=16) == 12 and other.blocks[:2] == held[:2]
        alloc.free(other)
    alloc.truncate(t, 9)  # a rewind past the kept blocks only
    assert t.blocks == [NULL_BLOCK, NULL_BLOCK, held[2]]
    alloc.free(t)
    assert t.blocks == [] and alloc.num_free == 9 and alloc.ref_count == [0] * 10
    alloc.pools.append(_Windowed(0))  # a pool whose layers see every key
    alloc.allocate(t, 14)
    alloc.register(t, ids, 14)
    alloc.release_behind(t, 14)
    assert NULL_BLOCK not in t.blocks


def test_out_of_blocks_is_refused_without_side_effects():
    alloc = BlockAllocator(num_blocks=3, block_size=4)
    t = BlockTable()
    assert not alloc.can_allocate(t, 9)
    with pytest.raises(OutOfBlocks):
        alloc.allocate(t, 9)
    assert t.blocks == [] and alloc.num_free == 2


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(tiny_llama_dir)[0]


class Harness:
    """Drives one sequence through the runner by hand: feed tokens, rewind, read logits."""

    def __init__(self, model, block_size: int = 4):
        self.model = model
        self.alloc = BlockAllocator(64, block_size)
        self.runner = ModelRunner(model, KVPool(model.config, 64, block_size, model.act_dtype, "cpu"), block_size)

    def feed(self, seqs: list[Sequence], new: list[list[int]]) -> list[torch.Tensor]:
        for s, toks in zip(seqs, new):
            s.token_ids = s.token_ids[: s.num_cached] + toks
            self.alloc.allocate(s.block_table, s.num_cached + len(toks))
        counts = [len(t) for t in new]
        tokens, positions, meta = sequence_inputs(self.runner, seqs, counts)
        hidden, _ = self.model(tokens, positions, meta, self.runner.kv)
        for s, n in zip(seqs, counts):
            s.num_cached += n
        return [self.model.compute_logits(rows) for rows in hidden.split(counts)]

    def rewind(self, seq: Sequence, n: int) -> None:
        seq.num_cached = n
        seq.token_ids = seq.token_ids[:n]
        self.alloc.truncate(seq.block_table, n)


def new_seq(i: int = 0) -> Sequence:
    return Sequence(i, [], SamplingParams(), 512)


def test_prefill_then_decode_equals_one_full_forward(model):
    ids = list(range(10, 31))
    full = Harness(model).feed([new_seq()], [ids])[0]
    h, seq = Harness(model), new_seq()
    steps = [h.feed([seq], [ids[:9]])[0]] + [h.feed([seq], [[t]])[0] for t in ids[9:]]
    assert torch.allclose(torch.cat(steps), full, atol=1e-5)


def test_rewind_then_redecode_is_identical(model):
    h, seq = Harness(model), new_seq()
    prompt, cont = list(range(40, 47)), [50, 51, 52, 53, 54, 55]
    h.feed([seq], [prompt])
    first = [h.feed([seq], [[t]])[0] for t in cont]
    free_before = h.alloc.num_free
    h.rewind(seq, len(prompt) + 2)  # drop the last 4 tokens (crosses a block boundary)
    assert h.alloc.num_free > free_before
    h.feed([seq], [[99, 98, 97, 96, 95]])  # write other tokens over the freed positions
    h.rewind(seq, len(prompt) + 2)
    again = [h.feed([seq], [[t]])[0] for t in cont[2:]]
    for a, b in zip(first[2:], again):
        assert torch.equal(a, b)


def test_ragged_batch_equals_each_prompt_alone(model):
    prompts = [list(range(5, 8)), list(range(60, 77)), list(range(100, 109))]
    h = Harness(model)
    seqs = [new_seq(i) for i in range(3)]
    batched = h.feed(seqs, prompts)
    step = h.feed(seqs, [[1], [2], [3]])
    for i, p in enumerate(prompts):
        solo_h, solo = Harness(model), new_seq()
        assert torch.allclose(solo_h.feed([solo], [p])[0], batched[i], atol=1e-5)
        assert torch.allclose(solo_h.feed([solo], [[i + 1]])[0], step[i], atol=1e-5)


def test_generate_batch_equals_one_by_one_and_frees_blocks(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), block_size=4, max_num_batched_tokens=64)
    prompts = ["Hello world", "The quick brown fox jumps over", "def add(a, b):", "1 2 3"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    together = llm.generate(prompts, params)
    alone = [llm.generate(p, params)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert llm.engine.allocator.num_used == 0


def test_preemption_when_blocks_run_out_keeps_outputs_exact(tiny_llama_dir):
    """A cache too small for all sequences at once preempts and recomputes; results do not change."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = ["Hello world", "The quick brown fox", "def add(a, b):", "1 2 3 4"]
    roomy = LLM(str(tiny_llama_dir), block_size=4).generate(prompts, params)
    tight_llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=16)
    tight = tight_llm.generate(prompts, params)
    assert tight_llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert tight_llm.engine.allocator.num_used == 0


def test_chunked_prefill_gives_the_same_tokens(tiny_llama_dir):
    """A prompt longer than the per-step token budget is prefilled in chunks, with the same result."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(10, 90))}
    whole = LLM(str(tiny_llama_dir)).generate(prompt, params)[0]
    chunked_llm = LLM(str(tiny_llama_dir), max_num_batched_tokens=24)
    chunked = chunked_llm.generate([prompt, "Hello world"], params)
    assert chunked[0].token_ids == whole.token_ids
    assert chunked[0].metrics["num_steps"] == 8  # chunks that produce no token are not counted as steps


def test_blocks_are_filled_when_handed_out_under_the_debug_fill(monkeypatch):
    """SPECDEC_KV_FILL (on for the whole suite): a new block holds the fill value in every pool over the
    blocks, including blocks freed by an earlier sequence; blocks reused from the prefix cache keep their K/V."""
    class Geometry:
        num_key_value_heads, head_dim, num_hidden_layers = 1, 2, 2

    monkeypatch.setenv("SPECDEC_KV_FILL", "nan")
    alloc = BlockAllocator(num_blocks=4, block_size=2, enable_prefix_caching=True)
    pools = [KVPool(Geometry, 4, 2, torch.float16, "cpu"), KVPool(Geometry, 4, 2, torch.float32, "cpu")]
    alloc.pools.extend(pools)
    for pool in pools:
        for t in pool.k + pool.v:
            t[2:] = 1.0  # what an earlier sequence left (the null block, slots 0-1, stays 0)
    first = BlockTable()
    alloc.allocate(first, 3)  # blocks 1, 2
    assert all(t[2:6].isnan().all() and not t[6:].isnan().any() and (t[:2] == 0).all()
               for pool in pools for t in pool.k + pool.v)
    for pool in pools:
        for t in pool.k + pool.v:
            t[2:6] = 3.0  # the sequence writes its slots
    alloc.register(first, [5, 6, 7], 3)  # block 1 (tokens 5, 6) is cached
    alloc.free(first)
    second = BlockTable()
    assert alloc.admit(second, [5, 6, 8, 9], 4) == 2
    new = second.blocks[1] * 2
    assert second.blocks[0] == 1 and all((t[2:4] == 3).all() and t[new:new + 2].isnan().all() for t in pools[0].k)


@needs_native
def test_kv_pools_on_the_cpu_come_from_huge_pages():
    """Every step reads the pools' recent blocks: on the CPU they sit on 2 MB pages (native huge_empty)."""
    pool = pool_tensor((4096, 8, 64), torch.float16, "cpu")  # 4 MB: from a shared chunk
    big = pool_tensor((65536, 8, 64), torch.float16, "cpu")  # 64 MB: a chunk of its own
    assert pool.shape == (4096, 8, 64) and pool.dtype == torch.float16 and pool.is_contiguous()
    assert big.data_ptr() % (2 << 20) == 0


@needs_native
def test_the_native_causal_layout_equals_the_numpy_one(monkeypatch):
    """Steps without trees take their layout from one native call; it must be the numpy path's, array for array:
    ragged feeds (decode rows, chains, prefill chunks, a sequence feeding nothing), tables longer and shorter than
    the context."""
    import random

    from specdec.kv_cache import paged_inputs
    from specdec.models.cpu import native
    rng = random.Random(0)
    cases = [([[3, 1]], [5], [[7]], 4), ([[2], [4, 6]], [0, 17], [[1, 2, 3], []], 16)]
    for _ in range(40):
        B, bs = rng.randint(1, 5), rng.choice([1, 4, 16])
        starts = [rng.randint(0, 40) for _ in range(B)]
        feeds = [[rng.randrange(1000) for _ in range(rng.choice([0, 1, 2, 5, 9]))] for _ in range(B)]
        tables = [rng.sample(range(1, 99), max(0, -(-(s + len(f)) // bs) + rng.randint(-1, 2)))
                  for s, f in zip(starts, feeds)]
        cases.append((tables, starts, feeds, bs))
    for tables, starts, feeds, bs in cases:
        fast = paged_inputs(tables, starts, feeds, block_size=bs)
        monkeypatch.setattr(native, "available", lambda *a: False)
        slow = paged_inputs(tables, starts, feeds, block_size=bs)
        monkeypatch.undo()
        for a, b in ((fast[0], slow[0]), (fast[1], slow[1])):
            assert a.dtype == b.dtype and torch.equal(a, b)
        for name in ("slot_mapping", "context_slots", "mask"):
            a, b = getattr(fast[2], name), getattr(slow[2], name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
        assert fast[2].query_lens == slow[2].query_lens and fast[2].context_lens == slow[2].context_lens
        assert fast[2].tree_starts is None and slow[2].tree_starts is None
