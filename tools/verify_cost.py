"""What verification costs on this machine: one target forward (all layers, LM head, argmax) feeding n
tokens of one sequence, against a plain decode step (n = 1), at several context lengths
(`engine.step_cost.time_verification`, which `specdec tune` uses to size hybrid trees).

    python tools/verify_cost.py --contexts 300,768 --tokens 1,2,3,4,5,9,16 [--dtype float32] [--compare-llamacpp]

With --compare-llamacpp, llama.cpp's cost of the same steps on the same GGUF file follows each row (every fed row's
logits computed, as verification needs them).
"""
from __future__ import annotations

import argparse

import torch

from specdec import LLM
from specdec.bench.engines import load_llamacpp
from specdec.bench.verify_cost import llamacpp_step_times
from specdec.models.loader import resolve


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="alias, HF directory or .gguf (default smollm2-135m)")
    ap.add_argument("--dtype", default="auto", help="auto (a GGUF's own blocks) | float32 | bfloat16 (default auto)")
    ap.add_argument("--contexts", default="64,768", help="committed tokens before the step, comma-separated")
    ap.add_argument("--tokens", default="1,2,3,5,9,16", help="tokens fed by the step, comma-separated (1 first)")
    ap.add_argument("--compare-llamacpp", action="store_true", help="also time llama.cpp's steps on the same file")
    ap.add_argument("--device", default=None, help="cpu | cuda (default: $SPECDEC_DEVICE, else cpu)")
    ap.add_argument("--enforce-eager", action="store_true", help="on a GPU: no CUDA graphs, every forward eager")
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = [int(n) for n in args.tokens.split(",")]
    llm = LLM(args.model, dtype=args.dtype, device=args.device, speculative_config="off",
              enforce_eager=args.enforce_eager)
    peer = None
    if args.compare_llamacpp:
        peer = load_llamacpp(resolve(args.model), torch.get_num_threads(), max(contexts) + max(rows) + 8,
                             logits_all=True)
    print("| engine | context | " + " | ".join(f"{n} tokens" for n in rows) + " |")
    print("|---" * (len(rows) + 2) + "|")
    for ctx in contexts:
        measured = [("specdec", llm.measuring.time_verification(ctx, rows))]
        if peer is not None:
            measured.append(("llama.cpp", llamacpp_step_times(peer, ctx, rows)))
        for name, times in measured:
            ms = {n: s * 1e3 for n, s in times.items()}
            print(f"| {name} | {ctx} | " + " | ".join(f"{ms[n]:.1f} ms ({ms[n] / ms[1]:.2f}x)" for n in rows) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
