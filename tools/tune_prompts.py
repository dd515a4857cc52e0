"""Write a prompt set for `specdec tune` from the training data's rows that the distilled set (and so the
trained head) never saw, in Spec-Bench's layout ({"category", "turns"} per line), so tuning the default
touches neither the evaluation prompts nor the head's own training prompts.

    python tools/tune_prompts.py --per-source 4 --out data/tune_prompts.jsonl
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "train"))
    ap.add_argument("--distilled", default=str(ROOT / "data" / "distill" / "smollm2-135m.npz"))
    ap.add_argument("--per-source", type=int, default=4)
    ap.add_argument("--max-chars", type=int, default=3000, help="skip longer prompts (tune times decoding)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "data" / "tune_prompts.jsonl"))
    args = ap.parse_args()

    packed = np.load(args.distilled)
    sources = json.loads(bytes(packed["meta"].astype(np.uint8)).decode())["sources"]
    seen = {(sources[s], int(r)) for s, r in zip(packed["source"], packed["row"])}
    rng = random.Random(args.seed)
    out = []
    for name in sources:
        rows = Path(args.data, f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
        order = list(range(len(rows)))
        rng.shuffle(order)
        picked = 0
        for i in order:
            if picked == args.per_source:
                break
            if (name, i) in seen:
                continue
            users = [m["content"] for m in json.loads(rows[i])["messages"] if m["role"] == "user"]
            if not users or len(users[0]) > args.max_chars:
                continue
            out.append({"category": name, "turns": [users[0]], "source_row": i})
            picked += 1
    Path(args.out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out), encoding="utf-8")
    print(f"{len(out)} prompts from {len(sources)} sources written to {args.out}")


if __name__ == "__main__":
    main()
