"""`specdec bench --soak`: a short soak of the tiny model passes every check, and the checks themselves catch
what they are for (different greedy texts, a leaked block, a 5xx nobody injected)."""
from __future__ import annotations

import json

import pytest

from specdec.bench.config import BenchConfig
from specdec.bench.soak import Outcome, check_repeats, run_soak, summarize
from specdec.config import SpecdecError

PROMPTS = ["Hello world, say something.", "1 2 3 1 2 3 1 2 3", "def add(a, b):", "The quick brown fox"]


def test_a_short_soak_of_the_tiny_model_passes(tiny_llama_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"category": "x", "turns": [p]}) + "\n" for p in PROMPTS))
    cfg = BenchConfig(model=str(tiny_llama_dir), device="cpu",
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3},  # parsed, or JSON text
                      prompts=str(prompts), num_prompts=4, max_tokens=16, num_requests=100, soak_concurrency=8,
                      out=str(tmp_path / "soak.json"))
    result = run_soak(cfg)
    assert result["ok"] and result["requests"] == 100 and result["leaked_blocks"] == 0
    assert set(result["statuses"]) == {"greedy", "seeded", "choices", "cancelled", "bad", "no_auth", "fault"}
    assert result["statuses"]["fault"] == {"500": sum(result["statuses"]["fault"].values())}
    assert result["statuses"]["no_auth"] == {"401": sum(result["statuses"]["no_auth"].values())}
    assert result["offline_checked"] == 4 and result["unexpected_5xx"] == 0
    assert capsys.readouterr().out.startswith("soak OK: 100 requests")
    assert json.loads((tmp_path / "soak.json").read_text())["ok"]


def test_the_checks_catch_what_they_are_for(tmp_path):
    same = [Outcome("greedy", 200, 0.1, key=("greedy", 0), text="a"), Outcome("greedy", 200, 0.1, key=("greedy", 0),
                                                                            text="a")]
    assert check_repeats(same) == []
    assert check_repeats(same + [Outcome("greedy", 200, 0.1, key=("greedy", 0), text="b")]) == \
        ["('greedy', 0): 2 different texts"]
    clean = {"kv": {"kv_blocks_used": 3, "kv_blocks_cached": 3, "requests_running": 0}, "health": 200}
    assert summarize(dict(clean), same, [], [], 1, tmp_path / "a.json")["ok"]
    with pytest.raises(SpecdecError, match="problems"):  # a leaked block
        summarize(clean | {"kv": clean["kv"] | {"kv_blocks_used": 4}}, same, [], [], 1, tmp_path / "b.json")
    with pytest.raises(SpecdecError, match="problems"):  # a 5xx nobody injected is a problem of its request
        summarize(dict(clean), same + [Outcome("greedy", 500, 0.1, "HTTP 500: boom")], [], [], 1, tmp_path / "c.json")
