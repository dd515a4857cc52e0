"""Write a prompt set for `specdec tune` from the training data's rows that the head never trained on (no answer file
of `specdec distill` holds them: the package's distilled set, the answers corpus under data/answers/), in Spec-Bench's
layout ({"category", "turns"} per line), so tuning the default touches neither the evaluation prompts nor the
head's own training prompts.

    python tools/tune_prompts.py --per-source 4 --out specdec/data/tune_prompts.jsonl
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from specdec.training import distill

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "train"))
    ap.add_argument("--answers", nargs="*",
                    default=[str(ROOT / "specdec/data/distill/smollm2-135m.npz"),
                             str(ROOT / "data/answers/smollm2-135m")],
                    help="answer files or directories (`specdec distill`) whose prompts are left out")
    ap.add_argument("--per-source", type=int, default=4)
    ap.add_argument("--max-chars", type=int, default=3000, help="skip longer prompts (tune times decoding)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "specdec" / "data" / "tune_prompts.jsonl"))
    args = ap.parse_args()

    seen = set(distill.load_all(args.answers)[1])
    rng = random.Random(args.seed)
    out = []
    for name, prompts in distill.read_sources(args.data).items():
        order = list(range(len(prompts)))
        rng.shuffle(order)
        users = {i: next(m["content"] for m in prompts[i] if m["role"] == "user")
                 for i in order if prompts[i] is not None and (name, i) not in seen}
        picked = [i for i in order if i in users and len(users[i]) <= args.max_chars]
        out += [{"category": name, "turns": [users[i]], "source_row": i} for i in picked[:args.per_source]]
    Path(args.out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out), encoding="utf-8")
    print(f"{len(out)} prompts written to {args.out}")


if __name__ == "__main__":
    main()
