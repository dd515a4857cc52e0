"""Keyed verification against multi-round rejection sampling, per drafting method, on Spec-Bench prompts at a
sampling temperature (batch 1, one seed per prompt): acceptance length, decode speed and how many outputs equal
plain decoding's, with plain, keyed and rejection alternating prompt by prompt (A B C, then C B A) in one run.

    python tools/keyed_vs_rejection.py --num-prompts 40 --max-tokens 128 --temperature 0.7 \
        '{"method": "ngram", "num_speculative_tokens": 3}' '{"method": "suffix", "num_speculative_tokens": 8}'
"""
from __future__ import annotations

import argparse
import json
import sys

from specdec import LLM, SamplingParams
from specdec.bench.machine import machine_info
from specdec.bench.prompts import encode_prompts, load_questions, pick_round_robin, prompts_path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="+", help="speculative configs as JSON (sampled_verification is set here)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default=None, help="JSONL with 'turns' (default: the Spec-Bench prompts shipped)")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    plain = LLM(args.model, speculative_config="off")
    prompts = encode_prompts(plain, pick_round_robin(load_questions(prompts_path(args.prompts)), args.num_prompts))
    results = {"machine": machine_info(plain.engine.model.device), "args": vars(args), "methods": []}
    print(f"machine: {results['machine'].get('cpu_model', '?')}", file=sys.stderr)
    for cfg in args.configs:
        engines = {"plain": plain}
        for mode in ("keyed", "rejection"):
            engines[mode] = plain.with_speculative_config({**json.loads(cfg), "sampled_verification": mode})
        totals = {name: {"tokens": 0, "steps": 0, "decode_tokens": 0, "decode_s": 0.0, "same": 0} for name in engines}
        for i, p in enumerate(prompts):
            params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=i)
            ids = {}
            for name in list(engines) if i % 2 == 0 else list(engines)[::-1]:
                out = engines[name].generate({"prompt_token_ids": p.token_ids}, params)[0]
                m, t = out.metrics, totals[name]
                ids[name] = out.token_ids
                t["tokens"] += len(out.token_ids)
                t["steps"] += m["num_steps"]
                t["decode_tokens"] += max(len(out.token_ids) - 1, 0)
                t["decode_s"] += m["decode_s"]
            for name in engines:
                totals[name]["same"] += ids[name] == ids["plain"]
            for llm in engines.values():
                llm.engine.forget_finished()  # no drafter drafts a later prompt from an earlier answer
        row = {"config": json.loads(cfg)}
        for name, t in totals.items():
            row[name] = {"acceptance_length": t["tokens"] / t["steps"],
                         "decode_tokens_per_s": t["decode_tokens"] / t["decode_s"] if t["decode_s"] else None,
                         "outputs_equal_plain": f"{t['same']}/{len(prompts)}"}
        results["methods"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
