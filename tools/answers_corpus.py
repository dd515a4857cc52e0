"""One retrieval corpus of every answer the default model has given: `specdec distill` answer files (and the
H200 answers) concatenated into the layout `drafting.retrieval` reads (`tokens`, `offsets`, `meta` with the
target's fingerprint), refused when the files come from different targets. The shipped corpus of the built-in
model, `specdec/data/answers/smollm2-135m-all.npz`, is

    python tools/answers_corpus.py data/answers/smollm2-135m/*.npz specdec/data/distill/smollm2-135m.npz \
        --out specdec/data/answers/smollm2-135m-all.npz
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def read(path: Path) -> tuple[np.ndarray, np.ndarray, str | None]:
    """(tokens, offsets, the target's fingerprint) of one answers file."""
    with np.load(path) as z:
        meta = json.loads(z["meta"].tobytes().decode()) if "meta" in z else {}
        tokens = z["tokens"] if "tokens" in z else z["answer_ids"]
        offsets = z["offsets"].astype(np.int64)
    if len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(tokens) or np.any(np.diff(offsets) < 0):
        raise SystemExit(f"{path}: 'offsets' must rise from 0 to the number of tokens")
    return tokens, offsets, meta.get("model")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path, help="answer files (.npz), concatenated in the order of their paths")
    ap.add_argument("--out", type=Path, required=True, help="the corpus to write (.npz)")
    args = ap.parse_args(argv)
    parts, offsets, models = [], [np.zeros(1, dtype=np.int64)], set()
    files = sorted(set(args.files), key=str)  # (whatever order the shell gives)
    for path in files:
        tokens, offs, model = read(path)
        if tokens.size and int(tokens.max()) >= 1 << 16:
            raise SystemExit(f"{path}: token ids above 65535 do not fit the corpus's uint16")
        parts.append(tokens.astype(np.uint16))
        offsets.append(offs[1:] + offsets[-1][-1])
        models.add(model)
    if len(models - {None}) > 1:
        raise SystemExit(f"the files hold the answers of different targets: {sorted(models - {None})}")
    meta = {"model": next(iter(models - {None}), None), "format": 1, "files": [p.name for p in files]}
    tokens, offs = np.concatenate(parts), np.concatenate(offsets)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, tokens=tokens, offsets=offs,
                        meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    print(f"{args.out}: {len(offs) - 1} answers, {len(tokens)} tokens, {args.out.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
