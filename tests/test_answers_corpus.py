"""tools/answers_corpus.py: every answer file of one target becomes one retrieval corpus, and the shipped corpus of
the built-in model is what it makes of the repository's answers."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from answers_corpus import main  # noqa: E402

from specdec.drafting.retrieval import _read_token_file  # noqa: E402


def answers(path: Path, docs: list[list[int]], model: str | None = "m") -> Path:
    meta = json.dumps({"model": model} if model else {}).encode()
    np.savez(path, tokens=np.array([t for d in docs for t in d], dtype=np.uint16),
             offsets=np.cumsum([0] + [len(d) for d in docs]).astype(np.int64),
             meta=np.frombuffer(meta, dtype=np.uint8))
    return path


def test_answer_files_concatenate_into_one_corpus_of_their_documents(tmp_path):
    b = answers(tmp_path / "b.npz", [[5, 6, 7], [8]])
    a = answers(tmp_path / "a.npz", [[1, 2]], model=None)  # a file without a fingerprint joins any target's
    main([str(b), str(a), "--out", str(tmp_path / "out.npz")])
    tokens = _read_token_file(tmp_path / "out.npz", 10, 100, "m")  # the reader's own check of the fingerprint
    assert tokens.tolist() == [1, 2, -1, 5, 6, 7, -1, 8, -1]  # in the order of the paths, each document ended


def test_answers_of_different_targets_are_refused(tmp_path):
    a, b = answers(tmp_path / "a.npz", [[1]], "m"), answers(tmp_path / "b.npz", [[2]], "other")
    with pytest.raises(SystemExit, match="different targets"):
        main([str(a), str(b), "--out", str(tmp_path / "out.npz")])
    assert not (tmp_path / "out.npz").exists()


def test_the_shipped_corpus_is_every_answer_in_the_repository(tmp_path):
    sources = sorted((ROOT / "data" / "answers" / "smollm2-135m").glob("*.npz"))
    sources.append(ROOT / "specdec" / "data" / "distill" / "smollm2-135m.npz")
    main([*map(str, sources), "--out", str(tmp_path / "again.npz")])
    with np.load(ROOT / "specdec" / "data" / "answers" / "smollm2-135m-all.npz") as shipped, \
            np.load(tmp_path / "again.npz") as again:
        assert np.array_equal(shipped["tokens"], again["tokens"]), "new answers: run the tool's docstring command"
        assert np.array_equal(shipped["offsets"], again["offsets"])
        assert len(shipped["offsets"]) - 1 == sum(len(np.load(s)["offsets"]) - 1 for s in sources)
