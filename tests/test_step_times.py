"""Step accounting (`LLMEngine.step_times`): every phase is recorded, none is negative, the phases add up to the
whole step, a drafter's model forwards are told apart from its host-side work, and `specdec bench` writes and
prints it per configuration. No speed is asserted."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.engine.step_times import PHASES

PROMPTS = [[1, 60, 61, 62, 63, 60, 61, 62], [1, 100, 101, 100, 101, 100, 101]]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run_timed(llm: LLM) -> float:
    """Generate PROMPTS step by step on the engine; the seconds its `step` calls took, measured around them."""
    engine = llm.engine
    for p in PROMPTS:
        engine.add_request(p, PARAMS)
    outside = 0.0
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        outside += time.perf_counter() - start
    return outside


def check_phases(kind: dict) -> None:
    assert kind["num_steps"] > 0 and kind["tokens_per_step"] > 0
    phases = [kind[f"{p}_ms"] for p in PHASES]
    assert all(ms >= 0 for ms in phases)
    assert sum(phases) == pytest.approx(kind["step_ms"], rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
                                  "self_draft"])
def test_phases_are_recorded_and_add_up_to_the_whole_step(tiny_llama_dir, spec):
    if spec == "self_draft":  # a drafter that runs a model: the tiny model drafts for itself
        spec = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3}
    llm = LLM(str(tiny_llama_dir), speculative_config=spec or "off")
    llm.engine.step_times.reset()
    outside = run_timed(llm)
    times = llm.engine.step_times.summary()
    for kind in times.values():
        check_phases(kind)
    decode = times["decode"]
    assert decode["target_forward_ms"] > 0 and decode["logits_ms"] > 0 and decode["token_choice_ms"] > 0
    inside = sum(kind["step_ms"] * kind["num_steps"] for kind in times.values()) / 1e3
    assert 0.5 * outside <= inside <= outside  # the whole step is measured inside each `step` call
    tokens = sum(kind["tokens_per_step"] * kind["num_steps"] for kind in times.values())
    assert tokens == pytest.approx(len(PROMPTS) * PARAMS.max_tokens)
    if spec is None:
        assert decode["draft_forward_ms"] == 0 and decode["settle_ms"] == 0
        assert decode["tokens_per_step"] == pytest.approx(len(PROMPTS))  # one token per sequence per step
    elif spec["method"] == "ngram":
        assert decode["draft_forward_ms"] == 0 and decode["settle_ms"] > 0  # a drafter without a model
    else:
        assert decode["draft_forward_ms"] > 0 and decode["draft_host_ms"] >= 0


def test_accounting_switched_off_records_nothing(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), speculative_config="off")
    llm.engine.step_times.switch(False)
    llm.engine.step_times.reset()
    run_timed(llm)
    assert all(kind["num_steps"] == 0 and kind["step_ms"] is None for kind in llm.engine.step_times.summary().values())


def test_bench_writes_and_prints_the_step_accounting(tiny_llama_dir, tmp_path: Path, capsys):
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [t]}) + "\n"
                               for i, t in enumerate(["What is the answer?", "Add 1 2 3 4 5 1 2 3 4 5."])))
    out = tmp_path / "b.json"
    assert main(["bench", "--model", str(tiny_llama_dir), "--prompts", str(prompts), "--num-prompts", "2",
                 "--max-tokens", "8", "--batch-sizes", "1,2", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 3}', "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert {(r["config"]["method"], r["config"]["batch_size"]) for r in runs} == {
        ("plain", 1), ("ngram", 1), ("plain", 2), ("ngram", 2)}
    for run in runs:
        t = run["step_times"]
        check_phases(t["decode"])
        assert t["roofline_step_ms"] > 0
    text = capsys.readouterr().out
    assert "Step accounting" in text and "draft model" in text and "roofline step" in text
    assert "sd/ngram float32 b1" in text and "sd float32 b2" in text
