"""What a grammar's next-token mask costs on each backend (docs/benchmarks-history.md, "Structured output"): the
tokenizer's setup, one compile, then a mask per token of a valid answer to a nested JSON schema, from a fresh
state each pass: the library's own fill of one row, and in the other passes the engine's `GrammarState.masks`
(the fill, its tensor, the dead-end check).

    python tools/grammar_mask_bench.py [--model smollm2-135m] [--passes 20] [--backends xgrammar,llguidance]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from specdec.bench.machine import cpu_model
from specdec.config import StructuredOutput
from specdec.models.loader import load_tokenizer, resolve
from specdec.structured import BACKEND_ENV, compiler_for

# object, array of strings, a nested object with a pattern, an enum
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"street": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "zip"]},
    "status": {"enum": ["active", "inactive", "pending"]}},
    "required": ["name", "tags", "address", "status"]}
ANSWER = ('{"name": "Ada Lovelace", "tags": ["mathematics", "poetry", "analytical engines"], '
          '"address": {"street": "12 St James\'s Square", "zip": "10115"}, "status": "active"}')


def setup(backend: str, tokenizer) -> dict:
    os.environ[BACKEND_ENV] = backend
    start = time.perf_counter()
    compiler = compiler_for(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    setup_s = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile(StructuredOutput(json=SCHEMA))
    return {"backend": backend, "compiler": compiler, "setup_s": setup_s,
            "compile_ms": (time.perf_counter() - start) * 1e3, "fills": [], "masks": []}


def one_pass(run: dict, tokens: list[int], engine: bool) -> None:
    """A fresh state masked before each token of the answer (and before the stop token): by the library alone,
    or (`engine`) by `GrammarState.masks`."""
    state = run["compiler"].state(StructuredOutput(json=SCHEMA))
    row = torch.zeros((1, state.width), dtype=torch.int32)
    for token in tokens:
        start = time.perf_counter()
        state.masks([], []) if engine else state.matcher.fill_next_token_bitmask(row, 0)
        run["masks" if engine else "fills"].append((time.perf_counter() - start) * 1e6)
        assert state.accept(token)


def summary(run: dict) -> str:
    def quantiles(us: list[float]) -> str:
        us = sorted(us)
        return f"{statistics.median(us):.0f} / {us[int(0.9 * (len(us) - 1))]:.0f} / {us[-1]:.0f} us"

    return (f"| {run['backend']} | {run['setup_s']:.2f} s | {run['compile_ms']:.1f} ms | {quantiles(run['fills'])} | "
            f"{quantiles(run['masks'])} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="the tokenizer's model: alias or HF directory")
    ap.add_argument("--passes", type=int, default=20, help="fresh states (each way), masked at every token")
    ap.add_argument("--backends", default="xgrammar,llguidance")
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer(resolve(args.model))
    tokens = tokenizer.encode(ANSWER, add_special_tokens=False) + [tokenizer.eos_token_id]
    runs = [setup(backend, tokenizer) for backend in args.backends.split(",")]
    for i in range(2 * args.passes):  # the backends in turn, pass by pass, so drift on a shared machine hits both
        for run in runs:
            one_pass(run, tokens, engine=i % 2 == 1)
    print(f"CPU: {cpu_model()}; vocabulary {len(tokenizer)}; {len(tokens)} masks x {args.passes} passes")
    print("| backend | tokenizer setup | compile | library fill: median / p90 / max | GrammarState.masks: median / p90 "
          "/ max |\n|---|---|---|---|---|")
    for run in runs:
        print(summary(run))


if __name__ == "__main__":
    main()
