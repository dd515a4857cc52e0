"""`specdec bench --serve`: the load test drives real servers and reports what they did."""
from __future__ import annotations

import json

import pytest

from specdec.bench.config import BenchConfig, parse_counts
from specdec.bench.serve import RequestResult, percentile, summarize_level
from specdec.cli import main
from specdec.config import SpecdecError


def test_percentiles_and_level_summary():
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([0.0, 10.0], 0.99) == pytest.approx(9.9)
    ok = RequestResult(0, sent=0.0, first=0.5, last=2.5, chunk_times=[0.5, 1.5, 2.5],
                       usage={"completion_tokens": 5, "acceptance_length": 2.5})
    failed = RequestResult(1, error="HTTP 500")
    s = summarize_level([ok, failed], wall=4.0)
    assert s["completion_tokens"] == 5 and s["throughput_tok_s"] == 1.25 and s["errors"] == ["HTTP 500"]
    assert s["ttft_p50_s"] == 0.5 and s["tpot_p50_s"] == 0.5 and s["acceptance_length"] == 2.5


def test_bad_levels_and_missing_speculation_are_refused(tiny_llama_dir):
    with pytest.raises(SpecdecError, match="--concurrency"):
        parse_counts("1,0", "--concurrency", "1,4")
    with pytest.raises(SpecdecError, match="--concurrency"):
        BenchConfig(concurrency=(0, 4))
    with pytest.raises(SpecdecError, match="--replicas"):
        BenchConfig(replicas=(1,))  # nothing to compare it with
    assert parse_counts("16, 1,4", "--concurrency", "1,4") == (1, 4, 16)
    assert main(["bench", "--serve", "--concurrency", "1,x"]) == 2
    assert main(["bench", "--serve", "--speculative-config", "off"]) == 2  # nothing to compare against plain
    assert main(["bench", "--serve", "--model", str(tiny_llama_dir)]) == 2  # no head ships for it


def test_serve_bench_end_to_end(tiny_llama_dir, tmp_path, capsys):
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("\n".join(json.dumps({"category": c, "turns": [t]}) for c, t in
                                 [("a", "Hello world hello world"), ("b", "The quick brown fox")]))
    out = tmp_path / "serve.json"
    rc = main(["bench", "--serve", "--model", str(tiny_llama_dir), "--prompts", str(prompts), "--num-prompts", "2",
               "--max-tokens", "8", "--concurrency", "1,3", "--out", str(out),
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 3]
    for lv in result["levels"]:
        assert lv["identical"][0] == lv["identical"][1] == 2  # greedy: both servers say the same
        for side in ("plain", "speculative"):
            assert lv[side]["errors"] == [] and lv[side]["completion_tokens"] > 0
        assert lv["speculative"]["acceptance_length"] >= 1.0 and lv["plain"]["acceptance_length"] == 1.0
    assert result["offline"]["speedup"] > 0 and result["prefix_cache"]["ttft_hit_s"] > 0
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "spec/plain" in capsys.readouterr().out
