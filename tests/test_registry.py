"""Drafting methods register themselves: a method defined in this test module (its options, its drafter, its
registration, nothing else) works end to end; drafters see plain data, never the engine."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from specdec import LLM, SamplingParams, SpecdecError
from specdec.config import SpeculativeConfig, register_method, registered_methods
from specdec.drafting import Draft, DraftEnv, DraftRequest, Drafter
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
    def from_config(cls, cfg: SpeculativeConfig, env: DraftEnv) -> "EchoDrafter":
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
    llm = LLM(str(tiny_llama_dir), speculative_config={"method": "echo_test", "num_speculative_tokens": 3, "lag": 1})
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
                                           r"'echo_test'; valid keys: \['dispatch', 'jump_forward', 'lag', 'method'"):
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
    llm = LLM(str(tiny_llama_dir), speculative_config={"method": "echo_test", "num_speculative_tokens": 2})
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
        LLM(str(tiny_llama_dir), speculative_config={"method": "custom", "drafter": Almost()})
