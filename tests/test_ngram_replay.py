"""tools/ngram_replay.py: the offline replay counts what the engine would accept, step by step."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from ngram_replay import replay  # noqa: E402


def test_replay_counts_accepted_tokens_oracle_and_cost_by_hand():
    # Step 1: suffix [1, 2] matches once (2 tokens: adaptive length 2), drafts [3, 4]; both accepted + bonus 1.
    # Step 2: suffix [2, 3, 4, 1] matches (a full match drafts k), drafts [2, 3, 4, 1]; three accepted, and the
    # output ends. The oracle's best continuations accept 4 and 3 on those two steps.
    records = [{"category": "x", "prompt": [1, 2, 3, 4, 1, 2], "output": [3, 4, 1, 2, 3, 4]}]
    length, oracle, speedup = replay(records, "latest", 8, 0.1)["x"]
    assert length == 3.0
    assert oracle == 4.5
    assert speedup == pytest.approx(6 / ((1 + 0.1 * 2) + (1 + 0.1 * 4)))
    measured = [1.0, 1.05, 1.2, 1.3, 1.5]  # a step feeding 1, 2, ... tokens: the last token + the draft
    assert replay(records, "latest", 8, measured)["x"][2] == pytest.approx(6 / (1.2 + 1.5))
