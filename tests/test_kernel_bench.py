"""tools/kernel_bench.py: one line per format asked for, with finite timings of both kernel paths."""
from __future__ import annotations

import math
import sys
from pathlib import Path

from conftest import needs_native

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import kernel_bench  # noqa: E402

pytestmark = needs_native


def test_prints_a_line_per_format_with_both_paths(capsys):
    kernel_bench.main(["--rows", "24", "--cols", "256", "--formats", "q4_k,iq4_nl", "--seconds", "0.01"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[24 x 256]") and len(lines) == 4
    for line, name in zip(lines[2:], ("q4_k", "iq4_nl")):
        fields = line.replace("|", " ").split()
        assert fields[0] == name and len(fields) == 10 and all(math.isfinite(float(f)) for f in fields[1:])
