"""Drafting methods register themselves: a method defined in this test module (its options, its drafter, its
registration, nothing else) works end to end; drafters see plain data, never the engine."""
from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import every_step

import specdec
from specdec import LLM, SamplingParams, SpecdecError
from specdec.config import EngineConfig
from specdec.drafting import Draft, DraftEnv, Drafter, DraftRequest
from specdec.drafting.registry import SpeculativeConfig, method_info, register_method, registered_methods
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.model_runner import ModelRunner
from specdec.engine.scheduler import Scheduler
from specdec.engine.sequence import Sequence

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "1 2 3 4 5 6 7 8 9 10 1 2 3 4"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@dataclass
class EchoOptions:
    lag: int = 1  # propose the tokens that followed the same token `lag` occurrences back

    def __post_init__(self) -> None:
        if not isinstance(self.lag, int) or self.lag < 1:
            raise SpecdecError(f"invalid lag={self.lag!r}: must be an integer >= 1")


@register_method("echo_test", EchoOptions)
class EchoDrafter(Drafter):
    """Drafts what followed the previous occurrence of the last token (a one-token prompt lookup)."""

    def __init__(self, k: int, lag: int) -> None:
        self.k, self.lag, self.seen_requests, self.seen_env = k, lag, [], None

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, env: DraftEnv) -> EchoDrafter:
        drafter = cls(cfg.num_speculative_tokens, cfg.options.lag)
        drafter.seen_env = env
        return drafter

    def propose(self, requests: list[DraftRequest]) -> Draft:
        self.seen_requests += requests
        proposals = []
        for r in requests:
            ids = r.token_ids
            places = [i for i in range(len(ids) - 1) if ids[i] == ids[-1]]
            start = places[-self.lag] + 1 if len(places) >= self.lag else len(ids)
            proposals.append(ids[start:start + min(self.k, r.max_tokens)])
        return Draft.chains(proposals)


def test_a_method_defined_in_a_test_module_works_end_to_end(tiny_llama_dir):
    assert "echo_test" in registered_methods() and "echo_test" not in registered_methods(head=True)
    plain = LLM(str(tiny_llama_dir), speculative_config="off").generate(PROMPTS, GREEDY)
    llm = LLM(str(tiny_llama_dir), speculative_config=every_step({"method": "echo_test", "num_speculative_tokens": 3,
                                                                  "lag": 1}))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.metrics["num_drafts"] for o in outs) > 0
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 0  # its lookups were accepted sometimes
    assert llm.engine.allocator.num_used == 0


def test_a_methods_own_keys_and_errors_come_from_its_options():
    cfg = SpeculativeConfig.parse({"method": "echo_test", "lag": 2})
    assert cfg.options == EchoOptions(lag=2) and cfg.to_dict()["lag"] == 2
    with pytest.raises(SpecdecError, match="invalid lag=0"):
        SpeculativeConfig.parse({"method": "echo_test", "lag": 0})
    with pytest.raises(SpecdecError, match=r"unknown key\(s\) \['prompt_lookup_max'\] for speculative method "
                                           r"'echo_test'; valid keys: \['adaptive', 'dispatch', 'jump_forward', 'lag', "
                                           r"'method'"):
        SpeculativeConfig.parse({"method": "echo_test", "prompt_lookup_max": 3})
    with pytest.raises(SpecdecError, match="drafts chains only"):  # it registered no trees
        SpeculativeConfig.parse({"method": "echo_test", "tree": "D2-BF2"})


def test_an_unknown_method_lists_the_registered_ones():
    with pytest.raises(SpecdecError) as e:
        SpeculativeConfig.parse({"method": "no_such_method"})
    message = str(e.value)
    for name in ("custom", "draft_model", "eagle", "eagle3", "echo_test", "layer_skip", "lookahead", "medusa", "mtp",
                 "ngram"):
        assert repr(name) in message


def test_drafters_get_plain_values_never_engine_objects(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), speculative_config=every_step({"method": "echo_test", "num_speculative_tokens": 2}))
    llm.generate(PROMPTS, [GREEDY, SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)])
    drafter = llm.engine.speculator.drafter
    engine_types = (LLMEngine, Scheduler, Sequence, ModelRunner)
    plain = (int, str, list, tuple, torch.Tensor, torch.Generator, SamplingParams, type(None))
    assert drafter.seen_requests
    for r in drafter.seen_requests:
        assert type(r) is DraftRequest
        for f in dataclasses.fields(r):
            value = getattr(r, f.name)
            assert isinstance(value, plain) and not isinstance(value, engine_types), (f.name, type(value))
            if isinstance(value, (list, tuple)):
                assert all(isinstance(x, (int, tuple)) for x in value), f.name
    env = drafter.seen_env
    assert type(env) is DraftEnv
    assert not any(isinstance(getattr(env, f.name), engine_types) for f in dataclasses.fields(env))
    assert getattr(env.inputs, "__self__", None) is None  # a function, not a bound method of the engine's runner
    assert {r.params.temperature for r in drafter.seen_requests} == {0.0, 0.8}
    assert any(r.generator is not None for r in drafter.seen_requests)  # the seeded request's generator


def test_a_custom_drafter_must_be_a_drafter(tiny_llama_dir):
    class Almost:
        def propose(self, requests):
            return Draft.chains([[] for _ in requests])

    with pytest.raises(SpecdecError, match="must be a specdec.drafting.Drafter .* got Almost"):
        LLM(str(tiny_llama_dir), speculative_config=every_step({"method": "custom", "drafter": Almost()}))


# ---- a closed registry: what a method can do is declared with it, and the engine never names one -------------

ROOT = Path(specdec.__file__).parent
SERVING = ROOT / "serving"
NO_METHOD_NAMES = sorted([*(ROOT / "engine").glob("*.py"), ROOT / "llm.py", *SERVING.glob("server.py"),
                          *SERVING.glob("engine_thread.py"), ROOT / "bench" / "tune.py"])  # not api.py: OpenAI's
                                                                                             # request has a "suffix"
NO_DRAFTER_REACH = sorted([*(ROOT / "engine").glob("*.py"), *(ROOT / "bench").glob("*.py"), ROOT / "llm.py",
                           *SERVING.glob("*.py")])


def builtin_methods() -> list[str]:
    """The methods specdec's own files register (not those a test module adds)."""
    return [n for n in registered_methods() if method_info(n).build.__module__.startswith("specdec.drafting.")]


def test_the_engine_names_no_drafting_method():
    """Per-method behaviour is a MethodInfo field, never a string compared in the engine (or the server, or
    `specdec tune`); string literals only, so prose in comments and docstrings may name methods."""
    names = set(builtin_methods())
    assert {"ngram", "eagle3", "custom", "layer_skip", "hybrid"} <= names
    found = []
    for path in NO_METHOD_NAMES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {node.value!r}")
    assert not found, found


def test_only_the_speculator_holds_the_drafter():
    """The engine, server and benchmarks talk to the speculator (`release`, `forget`, `cached_prefix`, ...);
    only the speculator touches its own `self.drafter`."""
    found = []
    for path in NO_DRAFTER_REACH:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Attribute) and node.attr == "drafter"):
                continue
            own = path.name == "speculator.py" and isinstance(node.value, ast.Name) and node.value.id == "self"
            if not own:
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


# name: (trees, dynamic_trees, head, runs_target_layers, validate_drafts, verify_cost_keys)
CAPABILITIES = {
    "custom": (False, False, None, False, True, ()),
    "draft_model": (True, True, None, False, False, ()),
    "eagle": (True, True, "EagleHead", False, False, ("min_prob",)),
    "eagle3": (True, True, "Eagle3Head", False, False, ("min_prob",)),
    "hybrid": (False, False, None, False, False, ("min_score",)),
    "layer_skip": (True, True, None, True, False, ()),
    "lookahead": (True, False, None, False, False, ()),
    "medusa": (True, False, "MedusaHeads", False, False, ()),
    "mtp": (True, True, "EagleHead", False, False, ("min_prob",)),
    "ngram": (False, False, None, False, False, ()),
    "quantized_self": (True, True, None, True, False, ()),
    "recycle": (False, False, None, False, False, ()),
    "retrieval": (False, False, None, False, False, ()),
    "suffix": (False, False, None, False, False, ()),
    "switch": (False, False, None, False, False, ("token_cost",)),
}


def test_the_builtin_methods_declare_these_capabilities():
    def row(info):
        return (info.trees, info.dynamic_trees, info.head and info.head.__name__, info.runs_target_layers,
                info.validate_drafts, info.verify_cost_keys)

    assert {name: row(method_info(name)) for name in builtin_methods()} == CAPABILITIES


@dataclass
class SelfOptions:
    pass


@register_method("self_layers_test", SelfOptions, runs_target_layers=True)
class SelfLayersDrafter(EchoDrafter):
    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, env: DraftEnv) -> SelfLayersDrafter:
        return cls(cfg.num_speculative_tokens, 1)


def test_a_method_that_runs_the_target_layers_is_refused_under_tensor_parallelism(tiny_llama_dir):
    """The engine refuses whatever method declares `runs_target_layers`, before a rank allocates anything
    (a stand-in for the workers: the check needs only their number; test_parallel refuses layer_skip on real
    ranks)."""
    info = method_info("self_layers_test")
    info.check_tensor_parallel(1)
    with pytest.raises(SpecdecError, match="'self_layers_test' runs the target's own layers.*tensor_parallel_size=1"):
        info.check_tensor_parallel(2)
    llm = LLM(str(tiny_llama_dir), speculative_config="off")
    cfg = SpeculativeConfig.parse({"method": "self_layers_test", "num_speculative_tokens": 2})
    two_ranks = SimpleNamespace(tp=SimpleNamespace(world=2))
    with pytest.raises(SpecdecError, match="'self_layers_test' runs the target's own layers.*tensor_parallel_size=1"):
        LLMEngine(llm.engine.model, llm.tokenizer, EngineConfig(num_kv_blocks=16), cfg, two_ranks)
    engine = LLMEngine(llm.engine.model, llm.tokenizer, EngineConfig(num_kv_blocks=16), cfg)  # one process: fine
    assert isinstance(engine.speculator.drafter, SelfLayersDrafter)


def test_a_hybrid_source_that_runs_the_target_layers_is_refused_under_tensor_parallelism():
    """A method that nests others (hybrid) checks each source against the same declaration."""
    cfg = SpeculativeConfig.parse({"method": "hybrid", "num_speculative_tokens": 4, "min_score": 0.1,
                                   "sources": [{"method": "self_layers_test", "num_speculative_tokens": 2}]})
    env = DraftEnv(None, None, None, 4, 4, None, tensor_parallel_size=2)  # refused before anything is built
    with pytest.raises(SpecdecError, match="'self_layers_test' runs the target's own layers"):
        cfg.info.build(cfg, env)


def test_declared_keys_must_be_the_methods_own():
    with pytest.raises(TypeError, match=r"verify_cost_keys \['min_score'\] of method 'bad_test' are not keys"):
        register_method("bad_test", SelfOptions, verify_cost_keys=("min_score",))
    assert "bad_test" not in registered_methods()


class OutOfVocab(Drafter):
    def propose(self, requests):
        return Draft.chains([[10**6] for _ in requests])


register_method("checked_test", SelfOptions, validate_drafts=True)(lambda cfg, env: OutOfVocab())


def test_drafts_are_checked_where_the_method_declares_it(tiny_llama_dir, monkeypatch):
    """A method registered with `validate_drafts` has a malformed draft refused by name (its request goes on
    without drafts, output unchanged); one registered without it is trusted and never checked."""
    plain = LLM(str(tiny_llama_dir), speculative_config="off")
    checked = plain.with_speculative_config(every_step({"method": "checked_test", "num_speculative_tokens": 1}))
    out = checked.generate(PROMPTS[:1], GREEDY)[0]
    assert out.token_ids == plain.generate(PROMPTS[:1], GREEDY)[0].token_ids
    assert out.metrics["num_drafts"] == 0 and checked.engine.stats()["spec_draft_failures"] == 1
    checks = []
    monkeypatch.setattr(Draft, "validate", lambda self, *args: checks.append(args))
    trusted = plain.with_speculative_config(every_step({"method": "echo_test", "num_speculative_tokens": 2}))
    assert trusted.generate(PROMPTS[:1], GREEDY)[0].metrics["num_drafts"] > 0 and not checks


@pytest.mark.parametrize("first_import", ["specdec.drafting.registry", "specdec.config", "specdec.cli"])
def test_the_registry_is_full_whatever_was_imported_first(first_import):
    """A fresh interpreter that imports only one module and then looks methods up sees every method the package's
    files register: the registry does not depend on which module happened to be imported first."""
    import re
    import subprocess
    import sys

    files = (Path(specdec.__file__).parent / "drafting").glob("*.py")
    declared = {m for f in files for m in re.findall(r'register_method\(\s*"(\w+)"', f.read_text())}
    code = (f"import {first_import}\n"
            "from specdec.drafting.registry import registered_methods, SpeculativeConfig\n"
            "print(' '.join(registered_methods()))\n"
            "SpeculativeConfig.parse({'method': 'suffix'})\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert set(out.split()) == declared and len(declared) >= 14
