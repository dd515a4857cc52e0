"""Prompt sets for the benchmarks: Spec-Bench rows (or any JSONL with 'turns'), picked round-robin across
categories so a small sample covers every one, and encoded as users send them (through the chat template)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.config import SpecdecError

if TYPE_CHECKING:
    from specdec.llm import LLM

# Spec-Bench's single-turn rows, shipped inside the package (specdec/data/README.md: source, commit, license)
DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "spec_bench" / "question.jsonl"


@dataclass
class BenchPrompt:
    question_id: Any
    category: str
    token_ids: list[int]


def prompts_path(arg: str | None) -> Path:
    """--prompts as given, else the Spec-Bench prompts the package ships."""
    if arg is not None:
        path = Path(arg).expanduser()
        if not path.is_file():
            raise SpecdecError(f"prompts file {path} " + ("is a directory" if path.is_dir() else "does not exist"))
        return path
    if DEFAULT_PROMPTS.is_file():
        return DEFAULT_PROMPTS
    raise SpecdecError(f"no --prompts given and the Spec-Bench prompts this package ships are missing "
                       f"({DEFAULT_PROMPTS}: a broken install?); reinstall specdec or pass --prompts FILE.jsonl")


def load_questions(path: Path) -> list[dict]:
    """Spec-Bench rows: a JSON object per line with a non-empty 'turns' list (only the first turn is used)."""
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecdecError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        turns = row.get("turns") if isinstance(row, dict) else None
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0]:
            raise SpecdecError(f"{path}:{lineno}: expected an object with a non-empty 'turns' list of strings")
        rows.append(row)
    if not rows:
        raise SpecdecError(f"prompts file {path} has no prompts (it is empty)")
    return rows


def pick_round_robin(rows: list[dict], n: int) -> list[dict]:
    """n rows taking one per category in turn, so a small sample still covers every category."""
    if n < 1:
        raise SpecdecError(f"invalid --num-prompts {n}: must be >= 1")
    by_cat: dict[str, list[dict]] = {}
    for row in rows:
        by_cat.setdefault(str(row.get("category", "")), []).append(row)
    picked: list[dict] = []
    for i in range(max(len(v) for v in by_cat.values())):
        picked += [v[i] for v in by_cat.values() if i < len(v)]
    return picked[:n]


def encode_prompts(llm: LLM, rows: list[dict]) -> list[BenchPrompt]:
    """First turn as a user message (after the row's "system" message, where it has one: a deployment's
    system prompt) through the chat template, or raw text when the model has none."""
    chat = bool(getattr(llm.tokenizer, "chat_template", None))
    out = []
    for row in rows:
        text = row["turns"][0]
        system = [{"role": "system", "content": row["system"]}] if isinstance(row.get("system"), str) else []
        ids = llm.apply_chat_template(system + [{"role": "user", "content": text}]) if chat else llm.encode(text)[1]
        out.append(BenchPrompt(row.get("question_id"), str(row.get("category", "")), ids))
    return out
