"""Acceptance length of drafting configs on Spec-Bench prompts, one request after another (batch 1, greedy),
with greedy ids checked against the first config's, and the share of drafts
accepted at each position. No timing: it measures what drafts are worth, and can run
while the machine is busy.

    python tools/acceptance.py --every 25 --max-tokens 96 \
        '{"method": "ngram", "num_speculative_tokens": 4}' '{"method": "suffix", "num_speculative_tokens": 8}'
"""
from __future__ import annotations

import argparse
import json

from specdec import LLM, SamplingParams
from specdec.bench.prompts import DEFAULT_PROMPTS


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="+", help="speculative configs as JSON")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="JSONL with 'turns' (default: Spec-Bench)")
    ap.add_argument("--every", type=int, default=25, help="take every N-th prompt (default 25: 16 of 400)")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    rows = [json.loads(line) for line in open(args.prompts, encoding="utf-8") if line.strip()][::args.every]
    plain = LLM(args.model, speculative_config="off")
    encoded = [{"prompt_token_ids": plain.apply_chat_template([{"role": "user", "content": r["turns"][0]}])}
               for r in rows]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    reference = None
    for cfg in args.configs:
        llm = plain.with_speculative_config(json.loads(cfg))
        outs = [llm.generate(e, params)[0] for e in encoded]
        generated = sum(o.metrics["num_generated_tokens"] for o in outs)
        steps = sum(o.metrics["num_steps"] for o in outs)
        drafted = sum(o.metrics.get("num_draft_tokens", 0) for o in outs)
        drafts = max(1, sum(o.metrics.get("num_drafts", 0) for o in outs))
        per_pos = [sum(o.metrics["accepted_per_pos"][j] for o in outs if j < len(o.metrics.get("accepted_per_pos", [])))
                   / drafts for j in range(max(len(o.metrics.get("accepted_per_pos", [])) for o in outs))]
        ids = [o.token_ids for o in outs]
        reference = reference or ids
        same = sum(a == b for a, b in zip(ids, reference))
        print(f"{cfg}: acceptance length {generated / steps:.3f}, draft tokens per step {drafted / steps:.2f}, "
              f"accepted per position {' '.join(f'{a:.2f}' for a in per_pos)}, "
              f"ids = first config's on {same}/{len(ids)}", flush=True)


if __name__ == "__main__":
    main()
