"""tools/acceptance.py: acceptance length per config, with every config's greedy ids checked against the first."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from acceptance import main  # noqa: E402


def test_acceptance_tool_reports_each_config(tiny_llama_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [t]}) for t in ["1 2 3 1 2 3 1 2", "hello there", "a b a b"]))
    configs = ['{"method": "ngram", "num_speculative_tokens": 3}', '{"method": "suffix", "num_speculative_tokens": 4}']
    main(["--model", str(tiny_llama_dir), "--prompts", str(prompts), "--every", "1", "--max-tokens", "12", *configs])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    for cfg, line in zip(configs, lines):
        m = re.fullmatch(re.escape(cfg) + r": acceptance length (\d+\.\d{3}), draft tokens per step \d+\.\d\d, "
                         r"accepted per position ((?:[01]\.\d\d ?)+), ids = first config's on (\d)/3", line)
        assert m and float(m[1]) >= 1.0 and m[3] == "3"
        per_pos = [float(a) for a in m[2].split()]
        assert per_pos == sorted(per_pos, reverse=True)  # a position is reached only through the one before
