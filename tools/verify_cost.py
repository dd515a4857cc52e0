"""What verification costs on this machine: one target forward (all layers, LM head, argmax) feeding n
tokens of one sequence, against a plain decode step (n = 1), at several context lengths
(`specdec.bench.verify_cost`, which `specdec tune` uses to size hybrid trees).

    python tools/verify_cost.py --contexts 300,768 --tokens 1,2,3,4,5,9,16 [--dtype float32]
"""
from __future__ import annotations

import argparse

from specdec import LLM
from specdec.bench.verify_cost import step_times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="alias, HF directory or .gguf (default smollm2-135m)")
    ap.add_argument("--dtype", default="auto", help="auto (a GGUF's own blocks) | float32 | bfloat16 (default auto)")
    ap.add_argument("--contexts", default="64,768", help="committed tokens before the step, comma-separated")
    ap.add_argument("--tokens", default="1,2,3,5,9,16", help="tokens fed by the step, comma-separated (1 first)")
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = [int(n) for n in args.tokens.split(",")]
    engine = LLM(args.model, dtype=args.dtype, speculative_config="off").engine
    print("| context | " + " | ".join(f"{n} tokens" for n in rows) + " |")
    print("|---" * (len(rows) + 1) + "|")
    for ctx in contexts:
        ms = {n: s * 1e3 for n, s in step_times(engine, ctx, rows).items()}
        print(f"| {ctx} | " + " | ".join(f"{ms[n]:.1f} ms ({ms[n] / ms[1]:.2f}x)" for n in rows) + " |", flush=True)


if __name__ == "__main__":
    main()
