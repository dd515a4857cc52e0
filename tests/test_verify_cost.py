"""tools/verify_cost.py: times a step feeding n tokens against a plain step, through the engine's runner."""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from verify_cost import main  # noqa: E402


def test_verify_cost_prints_one_row_per_context(tiny_llama_dir, capsys):
    main(["--model", str(tiny_llama_dir), "--contexts", "20,40", "--tokens", "1,3,9"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "| context | 1 tokens | 3 tokens | 9 tokens |"
    for ctx, line in zip((20, 40), lines[2:]):
        cells = re.fullmatch(rf"\| {ctx} \| (.*) \|", line)[1].split(" | ")
        assert len(cells) == 3 and cells[0].endswith("(1.00x)")
        assert all(re.fullmatch(r"\d+\.\d ms \(\d+\.\d\dx\)", c) for c in cells)
