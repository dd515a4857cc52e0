"""tools/step_ab.py: both step paths (layer by layer with the LM head apart, one thread team with it inside) on the
default model, every config's output equal to plain decoding's, and the paths restored after."""
from __future__ import annotations

import sys
from pathlib import Path

from conftest import needs_default_model, needs_native

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import step_ab  # noqa: E402

from specdec.engine.model_runner import ModelRunner  # noqa: E402
from specdec.models.cpu import native  # noqa: E402

pytestmark = [needs_native, needs_default_model]


def test_both_paths_give_plain_decodings_tokens(capsys):
    step_ab.main(["--num-prompts", "1", "--max-tokens", "12"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[1:]] == ["plain", "ngram chain-4", "head chain-1"]
    assert all(line.endswith("ids equal plain: True") for line in lines[1:])
    assert native.ops().team_max_rows() == 16 and ModelRunner.run_logits is step_ab.FUSED
