"""engine/graphs.py: a step padded into a bucket's static buffers gives every real row what the step itself gives
it (bit for bit on the native kernels), for decode, chains and trees; the engine's output does not change."""
from __future__ import annotations

import logging

import pytest
import torch
from conftest import needs_native, save_tiny_model

from specdec import LLM, SamplingParams
from specdec.engine.graphs import GraphRunner, bucket, context_bucket
from specdec.kv_cache import BlockTable
from specdec.tree import TreeFeed

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9, 10, 11, 12, 13, 14], [7, 8, 9]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("graphs"), "llama")


def prefilled(engine, prompts: list[list[int]], room: int) -> list[list[int]]:
    """Block tables of the prompts, prefilled eagerly, with `room` more slots each."""
    tables = []
    for p in prompts:
        table = BlockTable()
        engine.allocator.allocate(table, len(p) + room)
        tables.append(table.blocks)
    engine.runner.run(tables, [0] * len(prompts), prompts)
    return tables


def test_buckets():
    assert [bucket(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert [context_bucket(n, 1000) for n in (1, 256, 257, 600, 1000, 1001)] == [256, 256, 512, 1000, 1000, None]


STEPS = {
    "decode, 3 sequences in a bucket of 4": ([[20], [21], [22]], None),
    "chains of 1 + 3 and 1 + 1 drafts": ([[20, 21, 22, 23], [24, 25], [26]], None),
    "a tree beside a chain and a decode row": ([[20, 21, 22, 23, 24], [25, 26], [27]],
                                               [[-1, -1, 0, 0], None, None]),
}


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False], ids=["native", "torch"])
@pytest.mark.parametrize("name", list(STEPS))
def test_a_padded_bucket_gives_every_row_what_the_step_gives_it(model_dir, monkeypatch, native, name):
    if not native:  # the torch ops a GPU runs
        from specdec.models import llama
        from specdec.models.blocks import attention, kernels
        for module in (kernels, attention, llama):
            monkeypatch.setattr(module, "on_native", lambda *tensors: False)
    feeds, parents = STEPS[name]
    engine = LLM(str(model_dir), speculative_config="off").engine
    tables = prefilled(engine, PROMPTS, room=8)
    starts = [len(p) for p in PROMPTS]
    trees = [TreeFeed.verification(p) if p is not None else None for p in parents] if parents else None
    graphs = GraphRunner(engine.model, engine.kv, engine.allocator.block_size, max_seqs=8, max_context=512,
                         capture=False)
    assert graphs.shape(starts, feeds, trees) == (4, bucket(max(map(len, feeds)), (1, 2, 4, 8, 16)), 256)
    eager, _ = engine.runner.run(tables, starts, feeds, trees)
    padded, _ = graphs.run(tables, starts, feeds, trees)
    if native:  # the kernels are batch-invariant: padding changes no bit
        assert torch.equal(padded, eager)
    else:
        torch.testing.assert_close(padded, eager)


def test_steps_beyond_every_bucket_run_eagerly(model_dir):
    engine = LLM(str(model_dir), speculative_config="off").engine
    graphs = GraphRunner(engine.model, engine.kv, engine.allocator.block_size, max_seqs=4, max_context=300,
                         capture=False)
    assert graphs.shape([0], [list(range(17))], None) is None  # a prefill of 17 rows
    assert graphs.shape([295], [[1, 2, 3, 4, 5, 6]], None) is None  # past the context
    assert graphs.shape([0] * 5, [[1]] * 5, None) is None  # more sequences than the engine runs
    assert graphs.shape([0] * 3, [[1]] * 3, None) == (4, 1, 256)


@pytest.mark.parametrize("spec", [
    None,
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 4, "tree": "D2-BF2"},
], ids=["plain", "ngram", "layer_skip-tree"])
def test_generation_through_buckets_equals_eager(model_dir, spec):
    """The engine with every decode and verification step through the padded buckets (no capture on CPU)
    generates what it generates eagerly, and the buckets were used."""
    prompts = ["1 2 3 4 1 2 3 4 1 2", "Hello world, hello world, hello", "def add(a, b):\n    return"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = [o.token_ids for o in LLM(str(model_dir), speculative_config="off").generate(prompts, params)]
    llm = LLM(str(model_dir), speculative_config=spec or "off")
    engine = llm.engine
    engine.runner.graphs = GraphRunner(engine.model, engine.kv, engine.allocator.block_size,
                                       engine.cfg.max_num_seqs, engine.max_model_len, capture=False)
    assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    assert engine.runner.graphs.buckets and engine.allocator.num_used == 0


def test_a_failed_capture_leaves_the_forward_eager(model_dir, monkeypatch, caplog):
    engine = LLM(str(model_dir), speculative_config="off").engine
    graphs = GraphRunner(engine.model, engine.kv, engine.allocator.block_size, 4, 256, capture=False)
    graphs.capture = True

    def broken(forward):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_capture", broken)
    tables = prefilled(engine, PROMPTS[:1], room=2)
    with caplog.at_level(logging.WARNING, logger="specdec.engine"):
        assert graphs.run(tables, [len(PROMPTS[0])], [[20]]) is None
    assert "runs eagerly" in caplog.text and "stream is capturing" in graphs.failed
    assert graphs.run(tables, [len(PROMPTS[0])], [[20]]) is None and not graphs.buckets
