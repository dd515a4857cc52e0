"""Tensor parallelism on CPU: 2 ranks over gloo (`specdec.models.parallel`, `specdec.engine.parallel`)."""
from __future__ import annotations

import time

import pytest
import torch
from conftest import (
    NEAR_TIE,
    assert_greedy_equal,
    every_step,
    gloo_threads_at_exit,
    gloo_threads_left,
    needs_default_model,
)

from specdec import LLM, SamplingParams
from specdec.config import ModelConfig, SpecdecError
from specdec.models.formats.quant import QuantWeight
from specdec.models.loader import shipped_head
from specdec.models.parallel import TPGroup, local_config, plan, split, take_columns, take_rows

PROMPTS = [[1, 60, 61, 62, 63, 60, 61], [1, 100, 101, 100, 101, 100], [1, 45, 200, 45, 200, 7]]


def tiny_llama_dir_of(llm: LLM) -> str:
    return llm.model_name


def logits_of(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The target's logits [T, V] after every prompt token (one prefill into blocks no request holds)."""
    runner, bs = llm.engine.runner, llm.engine.cfg.block_size
    table = list(range(1, 1 + -(-len(prompt) // bs)))
    hidden, _ = runner.run([table], [0], [prompt])
    return runner.logits(hidden)


# -- the plan: hand-worked splits ---------------------------------------------------------------------------
def test_shares_split_as_evenly_as_whole_blocks_allow():
    assert split(3, 2) == [(0, 2), (2, 3)]  # SmolLM2-135M's 3 K/V heads on 2 ranks
    assert split(1536, 2, 32) == [(0, 768), (768, 1536)]
    assert split(96, 2, 32) == [(0, 64), (64, 96)]  # 3 blocks: 2 + 1
    with pytest.raises(SpecdecError, match="whole blocks of 256"):
        split(256, 2, 256)
    cfg = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    first, second = plan(cfg, TPGroup(0, 2), 32), plan(cfg, TPGroup(1, 2), 32)
    assert (first.kv_heads, second.kv_heads) == ((0, 2), (2, 3))
    assert local_config(cfg, first).num_attention_heads == 6 and local_config(cfg, second).num_attention_heads == 3
    assert local_config(cfg, second).intermediate_size == 768 and first.vocab == [(0, 24576), (24576, 49152)]
    with pytest.raises(SpecdecError, match="exceeds the model's 3 key/value heads"):
        plan(cfg, TPGroup(0, 4))


def test_quantized_matrices_split_on_block_boundaries():
    torch.manual_seed(0)
    w = torch.randn(8, 128)
    q = QuantWeight.quantize(w, "q4_1")
    dense = q.dequantize()
    assert torch.equal(take_rows(q, [(2, 4), (6, 8)]).dequantize(), dense[[2, 3, 6, 7]])
    assert torch.equal(take_columns(q, 32, 96, "m").dequantize(), dense[:, 32:96])
    with pytest.raises(SpecdecError, match="inside a q4_1 block of 32 weights"):
        take_columns(q, 16, 64, "layer 0 down_proj")


# -- the default model (Q4_1 on its own blocks) ---------------------------------------------------------------
@needs_default_model
def test_two_ranks_on_the_default_model():
    """9 query / 3 K/V heads split 6 + 3 / 2 + 1. Activations are quantized to int8 per block of 32 before
    every matmul, so a 1e-6 difference in a partial sum (two ranks add in another order) can move a value
    across a rounding boundary, one step of its block's max / 127, and that compounds over 30 layers (the
    same happens between one process's fused stack and its per-matrix path): logits agree to about 3% of
    their scale (asserted: 10%), argmax on at least 90% of rows. Greedy speculation on two ranks (ngram, the
    shipped EAGLE-3 head) equals plain decoding on two ranks token for token, batched or alone: every op of
    a rank's per-matrix path is row-invariant (the layers' C++ attention, the per-row RMSNorm)."""
    one = LLM("smollm2-135m", speculative_config="off")
    two = LLM("smollm2-135m", speculative_config="off", tensor_parallel_size=2)
    try:
        prompts = [one.apply_chat_template([{"role": "user", "content": c}]) for c in
                   ("Name three colors.", "What is 12 times 7?", "Write a haiku about rain.")]
        for p in prompts:
            a, b = logits_of(one, p), logits_of(two, p)
            assert (a - b).abs().max() <= 0.1 * a.abs().max()
            assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
        params = SamplingParams(temperature=0, max_tokens=32)
        feeds = [{"prompt_token_ids": p} for p in prompts]
        expected = [o.token_ids for o in two.generate(feeds, params)]
        for config in ({"method": "ngram", "num_speculative_tokens": 4},
                       {"method": "eagle3", "num_speculative_tokens": 3, "model": str(shipped_head("smollm2-135m"))}):
            spec = two.with_speculative_config(every_step(config))
            assert [o.token_ids for o in spec.generate(feeds, params)] == expected, config
            assert [spec.generate(f, params)[0].token_ids for f in feeds] == expected, config  # alone
    finally:
        two.shutdown()


def test_shutdown_gives_the_process_back_its_threads(tiny_llama_dir):
    """Rank 0 takes its share of the cores while the ranks run (share_threads); shutdown() gives back the count
    it found, also when a rank died first (the failure closed the engine, shutdown() still frees the process group,
    so the next tensor-parallel engine starts)."""
    torch.set_num_threads(4)  # a count that 2 ranks halve, whatever this machine has (conftest restores it)
    for kill_a_rank in (True, False):
        two = LLM(str(tiny_llama_dir), speculative_config="off", tensor_parallel_size=2)
        assert torch.get_num_threads() == 2
        if kill_a_rank:
            two.workers.processes[0].kill()
            two.workers.processes[0].wait()
            with pytest.raises(SpecdecError, match="rank 1 exited"):
                two.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=4))
        two.shutdown()
        assert torch.get_num_threads() == 4


def test_shutdown_ends_the_process_groups(tiny_llama_dir, tmp_path):
    """The flaky `pytest tests/test_parallel.py tests/test_train.py` (a rank exiting with SIGABRT, "terminate
    called without an active exception"): a gloo process group that outlives destroy_process_group keeps its
    threads until interpreter exit, where one still releasing a collective's tensors needs the GIL, Python ends
    that thread, and the unwinding aborts the process. Two references kept the groups: the commands group's
    module global, and torch.distributed.nn.functional, whose functions bind the default group as a default
    argument when the module is first imported (loading a tokenizer imports it, after the ranks joined). After
    shutdown() no gloo thread is left. A fresh interpreter, so that the module's first import comes where it
    comes in a user's script (in this process an earlier test has imported it)."""
    import json
    import subprocess
    import sys

    script = tmp_path / "tp.py"
    script.write_text(
        gloo_threads_at_exit(tmp_path) +
        "import json\n"
        "from specdec import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_llama_dir)!r}, speculative_config='off', tensor_parallel_size=2)\n"
        f"llm.generate([{{'prompt_token_ids': {PROMPTS[0]!r}}}], SamplingParams(temperature=0, max_tokens=4))\n"
        "running = gloo_threads()\n"
        "llm.shutdown()\n"
        "print(json.dumps([running, gloo_threads()]))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    running, after_shutdown = json.loads(done.stdout.splitlines()[-1])
    assert "pt_gloo_runloop" in running  # what the check looks for is there while the ranks run
    assert after_shutdown == [] and gloo_threads_left(tmp_path) == {"0": []}


# -- two ranks --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    one = LLM(str(tiny_llama_dir), speculative_config="off")
    two = LLM(str(tiny_llama_dir), speculative_config="off", tensor_parallel_size=2)
    yield one, two
    two.shutdown()


def test_two_ranks_give_the_logits_of_one_on_a_tiny_model(tiny):
    """float32: the two partial sums of each row-parallel matmul add in another order than one process's
    single sum; measured max |difference| about 1e-6, asserted below 1e-4 of the logits' scale."""
    one, two = tiny
    for prompt in PROMPTS:
        a, b = logits_of(one, prompt), logits_of(two, prompt)
        assert a.shape == b.shape == (len(prompt), one.engine.model.config.vocab_size)
        tol = 1e-4 * a.abs().max()
        assert (a - b).abs().max() <= tol
        top = a.topk(2, dim=-1).values
        clear = top[:, 0] - top[:, 1] > 2 * tol  # the top token can only change where two logits are closer
        assert clear.any() and torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


@pytest.mark.parametrize("config", [{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
                                    {"method": "ngram", "num_speculative_tokens": 6, "ngram_branches": 2}])
def test_greedy_speculation_on_two_ranks_equals_plain_decoding(tiny, config):
    """Against plain decoding on the same two ranks, token for token (every step row-invariant); one process sums
    each row-parallel matmul in another order: a different numerical path, compared up to near ties."""
    one, two = tiny
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    expected = two.generate(prompts, params)
    spec = two.with_speculative_config(every_step(config))
    for batch in (1, len(prompts)):
        outs = [o for i in range(0, len(prompts), batch) for o in spec.generate(prompts[i:i + batch], params)]
        assert_greedy_equal(two, outs, [e.token_ids for e in expected])
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 0
    assert_greedy_equal(one, one.generate(prompts, params), [e.token_ids for e in expected], tie=NEAR_TIE)


def test_a_seed_gives_the_same_tokens_on_two_ranks_with_speculation_on_or_off(tiny):
    """Seeded sampling on two ranks: rank 0 chooses every token with its key, so speculation changes nothing."""
    _, two = tiny
    params = [SamplingParams(temperature=0.9, top_k=20, max_tokens=24, ignore_eos=True, seed=s) for s in range(4)]
    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(4)]
    expected = [o.token_ids for o in two.generate(prompts, params)]
    spec = two.with_speculative_config(every_step({"method": "ngram", "num_speculative_tokens": 4,
                                                   "prompt_lookup_min": 1}))
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0


def test_an_engine_that_goes_frees_its_pools_on_every_rank(tiny):
    import gc

    two = tiny[1]
    extra = two.with_speculative_config(every_step({"method": "ngram", "num_speculative_tokens": 2}))
    engine_id = extra.engine.runner.engine_id
    del extra
    gc.collect()
    assert engine_id in two.workers.released  # collected: the other ranks drop its pool at the next command
    two.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=2))
    assert two.workers.released == []


def test_methods_that_run_the_target_layers_are_refused(tiny):
    with pytest.raises(SpecdecError, match="layer_skip.*tensor_parallel_size=1"):
        tiny[1].with_speculative_config(every_step({"method": "layer_skip", "num_layers": 1}))


@pytest.mark.parametrize("size, message", [(0, "positive integer"), (True, "positive integer"),
                                           (3, "exceeds the model's 2 key/value heads")])
def test_impossible_sizes_are_refused(tiny_llama_dir, size, message):
    with pytest.raises(SpecdecError, match=message):
        LLM(str(tiny_llama_dir), speculative_config="off", tensor_parallel_size=size)


def test_torchrun_launches_the_ranks(tiny, tmp_path):
    """Every rank runs the same script; rank 0's LLM drives, the others serve it and exit with it, neither with a
    process group still running (see test_shutdown_ends_the_process_groups)."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "tp.py"
    script.write_text(
        gloo_threads_at_exit(tmp_path) +
        "import json, sys\n"
        "from specdec import LLM, SamplingParams\n"
        f"llm = LLM({tiny[0].model_name!r}, speculative_config={{'method': 'ngram', 'num_speculative_tokens': 4}})\n"
        f"outs = llm.generate([{{'prompt_token_ids': p}} for p in {PROMPTS!r}],\n"
        "                     SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))\n"
        f"open({str(tmp_path / 'out.json')!r}, 'w').write(json.dumps([o.token_ids for o in outs]))\n"
        "llm.shutdown()\n")
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", str(script)],
                          capture_output=True, text=True, timeout=240)
    # what killed a rank is near the top of its output, torchrun's own report at the bottom: show both
    assert done.returncode == 0, done.stderr[:3000] + "\n...\n" + done.stderr[-1500:]
    expected = tiny[0].generate([{"prompt_token_ids": p} for p in PROMPTS],
                                SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    import json

    assert json.loads((tmp_path / "out.json").read_text()) == [e.token_ids for e in expected]
    assert gloo_threads_left(tmp_path) == {"0": [], "1": []}


def test_a_rank_that_dies_fails_the_engine_with_a_clear_error(tiny):
    """(Last: it kills the module's second rank.) The next step fails at once, naming the rank, and so does
    a collective already under way (rank 0 watches the process while it waits); a second tensor-parallel
    engine in the same process is refused until the first is shut down."""
    two = tiny[1]
    two.workers.processes[0].kill()
    two.workers.processes[0].wait()
    start = time.perf_counter()
    with pytest.raises(SpecdecError, match="rank 1 exited"):
        two.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=4))
    assert time.perf_counter() - start < 5
    start = time.perf_counter()
    with pytest.raises(SpecdecError, match="collective failed.*rank 1 exited"):  # inside a collective
        two.engine.runner._collective(two.engine.model.compute_logits,
                                      torch.zeros(1, two.engine.model.config.hidden_size))
    assert time.perf_counter() - start < 5
    with pytest.raises(SpecdecError, match="already runs in this process"):
        LLM(str(tiny_llama_dir_of(two)), speculative_config="off", tensor_parallel_size=2)
