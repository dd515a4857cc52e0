"""tools/verify_cost.py: times a step feeding n tokens against a plain step (`engine.step_cost.time_verification`)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from verify_cost import main  # noqa: E402

from specdec.bench.verify_cost import llamacpp_step_times  # noqa: E402


def test_verify_cost_prints_one_row_per_context(tiny_llama_dir, capsys):
    main(["--model", str(tiny_llama_dir), "--contexts", "20,40", "--tokens", "1,3,9"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "| engine | context | 1 tokens | 3 tokens | 9 tokens |"
    for ctx, line in zip((20, 40), lines[2:]):
        cells = re.fullmatch(rf"\| specdec \| {ctx} \| (.*) \|", line)[1].split(" | ")
        assert len(cells) == 3 and cells[0].endswith("(1.00x)")
        assert all(re.fullmatch(r"\d+\.\d ms \(\d+\.\d\dx\)", c) for c in cells)


class FakeLlama:
    """What llamacpp_step_times uses of llama_cpp.Llama: eval appends after n_tokens (dropping what was past it)."""

    def __init__(self):
        self.n_tokens, self.seen = 0, []

    def n_vocab(self) -> int:
        return 50

    def reset(self) -> None:
        self.n_tokens = 0

    def eval(self, tokens: list[int]) -> None:
        self.seen.append((self.n_tokens, len(tokens)))
        self.n_tokens += len(tokens)


def test_llamacpp_steps_start_after_the_same_committed_tokens():
    fake = FakeLlama()
    times = llamacpp_step_times(fake, context=30, tokens=[1, 4], repeats=3)
    assert set(times) == {1, 4} and all(t >= 0 for t in times.values())
    assert fake.seen == [(0, 30)] + [(30, 1), (30, 4)] * 3  # prefill once, then every step after the 30 tokens
