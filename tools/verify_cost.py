"""What verification costs on this machine: one target forward (all layers, LM head, argmax) feeding n
tokens of one sequence, against a plain decode step (n = 1), at several context lengths. The shapes are
interleaved repetition by repetition, so drift of the machine hits them alike.

    python tools/verify_cost.py --contexts 300,768 --tokens 1,2,3,4,5,9,16 [--dtype float32]
"""
from __future__ import annotations

import argparse
import statistics
import time

from specdec import LLM, SamplingParams


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
        vocab = engine.model.config.vocab_size
        prompt = [(1000 + i) % vocab for i in range(ctx)]
        seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=400))
        while seq.num_cached < ctx:  # the prompt's prefill
            engine.step()
        engine.allocator.allocate(seq.block_table, seq.num_cached + max(rows))
        times: dict[int, list[float]] = {n: [] for n in rows}
        for _ in range(9):
            for n in rows:  # the fed tokens are written past the committed ones and never committed
                start = time.perf_counter()
                hidden, _ = engine.runner.run([seq.block_table.blocks], [seq.num_cached],
                                              [seq.token_ids[seq.num_cached:] + [100 % vocab] * (n - 1)])
                engine.runner.model.compute_logits(hidden).argmax(-1)
                times[n].append(time.perf_counter() - start)
        ms = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        print(f"| {ctx} | " + " | ".join(f"{ms[n]:.1f} ms ({ms[n] / ms[1]:.2f}x)" for n in rows) + " |", flush=True)
        engine.abort(seq)


if __name__ == "__main__":
    main()
