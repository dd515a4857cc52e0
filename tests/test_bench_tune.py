"""`specdec tune`: the dispatch table it writes is measured, loadable, and its acceptance table is right."""
from __future__ import annotations

import json

import pytest

from specdec.bench.tune import MIN_GAIN
from specdec.cli import main
from specdec.drafting.registry import SpeculativeConfig


def test_tune_writes_a_dispatch_table_that_speculative_config_loads(tiny_llama_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"category": c, "turns": [t]}) for c, t in [
        ("a", "The quick brown fox jumps over the lazy dog. The quick"), ("b", "1 2 3 4 5 6 1 2 3")]))
    out = tmp_path / "tune.json"
    spec = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3}
    rc = main(["tune", "--model", str(tiny_llama_dir), "--speculative-config", json.dumps(spec), "--prompts",
               str(prompts), "--num-prompts", "2", "--max-tokens", "12", "--batch-sizes", "1,2", "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert set(result["dispatch"]) == {"1", "2"}
    # A self-draft: the draft's best candidate is the target's own choice, so at every depth the rank-0
    # child is accepted whenever its parent was, and no other rank ever is.
    rates = result["acceptance_by_depth_and_rank"]
    assert len(rates) == 3 and all(row[0] == 1.0 and row[1] == row[2] == 0.0 for row in rates)
    assert {"tree(4 nodes)", "off", "dynamic(topk=2, num_steps=3, num_draft_tokens=6)"} <= set(result["candidates"])
    for b, speeds in result["decode_tokens_per_s"].items():
        assert set(speeds) == set(result["candidates"]) and all(v > 0 for v in speeds.values())
        fastest = max(speeds, key=speeds.get)  # chosen unless within MIN_GAIN of plain decoding
        assert result["chosen"][b] == (fastest if speeds[fastest] >= MIN_GAIN * speeds["off"] else "off")
    cfg = SpeculativeConfig.parse({**spec, "dispatch": str(out)})
    assert str(cfg.shape_for(1)) == result["chosen"]["1"] and str(cfg.shape_for(5)) == result["chosen"]["2"]
    assert "batch 1:" in capsys.readouterr().out


def test_candidates_include_dynamic_trees_for_methods_that_draft_them():
    """Feature heads and draft models draft EAGLE-2 dynamic trees, so tune tries them; Medusa's heads draft static
    trees only, so tuning them never proposes a dynamic tree (it would be refused)."""
    from specdec.bench.tune import candidates

    rates = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]
    eagle3 = candidates(SpeculativeConfig.parse({"method": "eagle3", "model": "head", "num_speculative_tokens": 3}),
                        rates)
    assert any(s.dynamic for s in eagle3) and any(s.tree for s in eagle3)
    medusa = candidates(SpeculativeConfig.parse({"method": "medusa", "model": "head", "num_speculative_tokens": 3}),
                        rates)
    assert medusa and all(s.dynamic is None for s in medusa) and any(s.tree for s in medusa)
    layer_skip = SpeculativeConfig.parse({"method": "layer_skip", "num_layers": 2})
    assert any(s.dynamic for s in candidates(layer_skip, rates))


def test_tune_picks_the_default_among_methods_by_their_speed_against_plain(tiny_llama_dir, tmp_path, capsys,
                                                                            monkeypatch):
    import math

    from specdec.bench.tune import shippable
    from specdec.models.loader import HEADS_DIR, default_speculative_config

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))  # where --write-default writes this model's default

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"category": "a", "turns": ["1 2 3 4 5 6 1 2 3 4 5 6 1 2"]}))
    out = tmp_path / "tune.json"
    configs = [{"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 2},
               {"method": "ngram", "num_speculative_tokens": 2}]
    args = ["tune", "--model", str(tiny_llama_dir), "--speculative-config", json.dumps(configs), "--prompts",
            str(prompts), "--num-prompts", "1", "--max-tokens", "8", "--batch-sizes", "1,2", "--out", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert [r["method"] for r in result["methods"]] == ["draft_model", "ngram"]

    def score(r):
        ratios = [s[r["chosen"][b]] / s["off"] for b, s in r["decode_tokens_per_s"].items()]
        return math.prod(ratios) ** 0.5

    best = max(result["methods"], key=score)
    assert result["default"] == {**best["config"], "dispatch": best["dispatch"]}
    assert SpeculativeConfig.parse(result["default"]).shape_for(2) is not None
    capsys.readouterr()
    assert main(args + ["--write-default"]) == 0  # any model: this machine's default for it, used from then on
    written = json.loads(out.read_text())["default"]  # (this run's timings chose it)
    assert default_speculative_config(str(tiny_llama_dir)) == shippable(written)
    head = {"method": "eagle3", "model": str(HEADS_DIR / "smollm2-135m-eagle3"), "num_speculative_tokens": 3}
    assert shippable(head)["model"] == "smollm2-135m-eagle3" and shippable(configs[0]) == configs[0]


def test_tune_sets_a_hybrids_min_score_from_the_measured_verification_cost(tiny_llama_dir, tmp_path, monkeypatch):
    from specdec.bench import tune

    seen = []

    def token_cost(engine, context, nodes):
        seen.append((context, nodes))
        return 0.23456

    monkeypatch.setattr(tune, "token_cost", token_cost)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"category": "a", "turns": ["1 2 3 4 5 6 1 2 3 4 5 6 1 2"]}))
    out = tmp_path / "tune.json"
    sources = [{"method": "ngram", "num_speculative_tokens": 2}, {"method": "suffix", "num_speculative_tokens": 3}]
    hybrid = {"method": "hybrid", "num_speculative_tokens": 4, "sources": sources}
    given = {**hybrid, "min_score": 0.5}
    args = ["tune", "--model", str(tiny_llama_dir), "--speculative-config", json.dumps([hybrid, given]), "--prompts",
            str(prompts), "--num-prompts", "1", "--max-tokens", "8", "--batch-sizes", "1", "--out", str(out)]
    assert main(args) == 0
    measured, kept = json.loads(out.read_text())["methods"]
    assert measured["config"] == {**hybrid, "min_score": 0.235} and kept["config"] == given
    assert len(seen) == 1 and seen[0][1] == 4 and seen[0][0] > 8


def test_token_cost_times_the_engines_own_steps(tiny_llama_dir):
    from specdec import LLM, SamplingParams, SpecdecError
    from specdec.bench.verify_cost import token_cost
    from specdec.engine.step_cost import time_verification

    llm = LLM(str(tiny_llama_dir), speculative_config="off")
    engine = llm.engine
    times = time_verification(engine, 20, [1, 5], repeats=3)
    assert set(times) == {1, 5} and all(t > 0 for t in times.values())
    assert token_cost(llm.measuring, 20, 4, repeats=3) >= 0
    assert not engine.has_unfinished() and engine.allocator.num_used == 0  # the probe sequence is given back
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(SpecdecError, match="while requests run"):
        time_verification(engine, 20, [1])
