"""Our Llama-family runtime must reproduce transformers' logits through the paged cache."""
from __future__ import annotations

import pytest
import torch
import transformers
from conftest import save_tiny_model, sequence_inputs

from specdec.config import SamplingParams
from specdec.engine.model_runner import ModelRunner
from specdec.engine.sequence import Sequence
from specdec.kv_cache import BlockAllocator, BlockTable, KVPool
from specdec.models.loader import load_model
from specdec.tree import TreeFeed

CASES = {
    "llama": dict(model_type="llama", tie_word_embeddings=True),
    "llama-untied-llama3-rope": dict(model_type="llama", tie_word_embeddings=False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False),
}


def run_paged(model, prompts: list[list[int]], continuations: list[list[int]], block_size: int = 4):
    """Prefill the ragged batch, then feed the continuation one token per step; logits per position."""
    alloc = BlockAllocator(64, block_size)
    runner = ModelRunner(model, KVPool(model.config, 64, block_size, model.act_dtype, "cpu"), block_size)
    seqs = [Sequence(i, p, SamplingParams(), 512) for i, p in enumerate(prompts)]
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]

    def forward(num_new: list[int]) -> None:
        for s, n in zip(seqs, num_new):
            alloc.allocate(s.block_table, s.num_cached + n)
        tokens, positions, meta = sequence_inputs(runner, seqs, num_new)
        hidden, _ = model(tokens, positions, meta, runner.kv)
        for i, rows in enumerate(hidden.split(num_new)):
            logits[i].append(model.compute_logits(rows))
            seqs[i].num_cached += num_new[i]

    forward([len(p) for p in prompts])
    for step in range(len(continuations[0])):
        for s, c in zip(seqs, continuations):
            s.token_ids.append(c[step])
        forward([1] * len(seqs))
    return [torch.cat(x) for x in logits]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    kwargs = dict(CASES[case])
    path = save_tiny_model(tmp_path, **kwargs)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours, _ = load_model(path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (5, 11)]
    conts = [torch.randint(0, 320, (8,), generator=g).tolist() for _ in prompts]
    got = run_paged(ours, prompts, conts)
    for p, c, logits in zip(prompts, conts, got):
        with torch.no_grad():
            ref = hf(torch.tensor([p + c])).logits[0]
        assert logits.shape == ref.shape
        assert (logits - ref).abs().max().item() < 1e-4


def test_output_layers_are_the_residual_stream(tmp_path):
    """Chosen layers' outputs equal transformers' hidden_states[i + 1] (what EAGLE-3 reads)."""
    path = save_tiny_model(tmp_path, "llama", num_hidden_layers=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours, _ = load_model(path)
    ids = list(range(3, 12))
    alloc = BlockAllocator(8, 16)
    runner = ModelRunner(ours, KVPool(ours.config, 8, 16, torch.float32, "cpu"), 16)
    seq = Sequence(0, ids, SamplingParams(), 512)
    alloc.allocate(seq.block_table, len(ids))
    tokens, positions, meta = sequence_inputs(runner, [seq], [len(ids)])
    _, layers = ours(tokens, positions, meta, runner.kv, output_layers=(0, 1))
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert set(layers) == {0, 1}
    for i in (0, 1):  # hidden_states[-1] is post-norm in transformers, so not compared
        assert (layers[i] - ref[i + 1][0]).abs().max().item() < 1e-4


def test_bfloat16_runs_close_to_float32(tmp_path):
    path = save_tiny_model(tmp_path, "llama")
    f32, _ = load_model(path)
    bf16, _ = load_model(path, dtype=torch.bfloat16)
    prompts, conts = [[5, 6, 7, 8]], [[9, 10]]
    a, b = run_paged(f32, prompts, conts)[0], run_paged(bf16, prompts, conts)[0]
    assert b.dtype == torch.float32  # logits always come back in float32
    assert torch.allclose(a.softmax(-1), b.softmax(-1), atol=5e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_rows_logits_do_not_depend_on_the_other_rows_of_its_step(tmp_path, dtype):
    """Row invariance by construction, not by logit margins: every row count goes through the same C++ GEMM,
    norm and attention. Three sequences prefilled in one step of 92 rows give, bit for bit, what each gives alone;
    and a prompt with its continuation fed in one step gives, at the continuation's positions, what feeding the
    continuation one token per step gives (a verification step against plain decoding)."""
    path = save_tiny_model(tmp_path, "llama")
    model, _ = load_model(path, dtype=dtype)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (19, 33, 40)]
    conts = [torch.randint(0, 320, (20,), generator=g).tolist() for _ in prompts]
    together = run_paged(model, prompts, conts)
    for p, c, rows in zip(prompts, conts, together):
        assert torch.equal(rows, run_paged(model, [p], [c])[0])
        assert torch.equal(run_paged(model, [p + c], [[]])[0], rows)


@pytest.mark.parametrize("feeds, trees", [
    ([[5], [6]], None),  # decode: one token per sequence
    ([[5, 6, 7, 8], [6, 7, 8, 9]], None),  # chain verification: 1 + 3 drafts each
    ([[5, 6, 7, 8, 9], [6]], [[-1, -1, 0, 0], None]),  # a tree beside a decode row
])
def test_the_device_forward_compiles_as_one_graph(tmp_path, monkeypatch, feeds, trees):
    """The forward a GPU runs (torch ops, the C++ kernels off) captured whole by torch.compile(fullgraph=True): a
    graph break or a read back to the host inside it, which would also stop a CUDA graph capture, fails here
    without a GPU. The captured forward computes what the eager one does."""
    from specdec.models import llama
    from specdec.models.blocks import attention, kernels
    from specdec.tree import TreeFeed

    for module in (kernels, attention, llama):
        monkeypatch.setattr(module, "on_native", lambda *tensors: False)
    model, _ = load_model(str(save_tiny_model(tmp_path, "llama")), torch.float32, "cpu")
    alloc = BlockAllocator(32, 4)
    runner = ModelRunner(model, KVPool(model.config, 32, 4, model.act_dtype, "cpu"), 4)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9, 10, 11, 12, 13]]
    tables = [BlockTable() for _ in prompts]
    for table, p, f in zip(tables, prompts, feeds):
        alloc.allocate(table, len(p) + len(f))
    tables = [t.blocks for t in tables]
    runner.run(tables, [0, 0], prompts)  # the prefix, eagerly
    tree_feeds = [TreeFeed.verification(p) if p is not None else None for p in trees] if trees else None
    tokens, positions, meta = runner.inputs(tables, [len(p) for p in prompts], feeds, tree_feeds)
    eager, _ = model(tokens, positions, meta, runner.kv)
    captured, _ = torch.compile(model.forward, fullgraph=True, backend="eager")(tokens, positions, meta, runner.kv)
    torch.testing.assert_close(captured, eager)


@pytest.mark.parametrize("quantization", [None, "q4_1", "q8_0"])
def test_the_stack_in_one_thread_team_gives_the_bits_of_the_layer_by_layer_path(tmp_path, quantization):
    """Steps of few rows run the whole stack and the LM head in one OpenMP team (native `team_max_rows`), larger
    ones layer by layer with a parallel region per product: every output element gets the same operations either
    way, so decode, verification and tree steps over a cache filled by a prefill give the same hidden states,
    features and logits bit for bit whichever path runs them, and the logits computed in the same call are those
    of `compute_logits`."""
    from specdec.models.cpu import native

    path = save_tiny_model(tmp_path, "llama", intermediate_size=128, num_hidden_layers=3)
    model, _ = load_model(path, quantization=quantization)
    assert model.native_stack() is not None
    ops = native.ops()
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 320, (37,), generator=g).tolist()
    feeds = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (1, 3, 9, 16)]

    def step(feed, tree=None):
        alloc = BlockAllocator(32, 8)
        runner = ModelRunner(model, KVPool(model.config, 32, 8, model.kv_dtype, "cpu"), 8)
        seq = Sequence(0, prompt, SamplingParams(), 512)
        alloc.allocate(seq.block_table, len(prompt) + len(feed))
        runner.run([seq.block_table.blocks], [0], [prompt])  # the prefill: layer by layer either way
        tokens, positions, meta = runner.inputs([seq.block_table.blocks], [len(prompt)], [feed], tree)
        rows = list(range(len(feed)))[::-2]  # some rows, out of order: the LM head in the same call
        hidden, features, logits = model.forward_logits(tokens, positions, meta, runner.kv, rows, (0, 2))
        assert torch.equal(logits, runner.logits(hidden, rows))
        return hidden, features, logits

    before = ops.team_max_rows()
    try:
        for feed in feeds:
            trees = [None]  # causal rows, then the same rows as a verified chain and as a tree
            if len(feed) > 1:
                trees.append([TreeFeed.verification(list(range(-1, len(feed) - 2)))])
            if len(feed) == 9:  # two branches under the last token
                trees.append([TreeFeed.verification([-1, -1, 0, 1, 2, 3, 4, 5])])
            for tree in trees:
                ops.team_max_rows(16)
                team = step(feed, tree)
                ops.team_max_rows(0)
                alone = step(feed, tree)
                for a, b in zip(team, alone):
                    assert torch.equal(a, b)
    finally:
        ops.team_max_rows(before)
