"""What an n-gram draft keeps by what it rests on: for every decode position of plain greedy outputs, the n-gram
drafter's whole-budget draft, its evidence (`Draft.evidence`: "match n" for a token match of n tokens, "text c" for
a text match of c+ characters) and how many of its tokens greedy verification would keep there. The table is what
the cost model learns per evidence while it runs (specdec/engine/cost.py), measured offline in one pass.

    python tools/ngram_evidence.py --num-prompts 40
    python tools/ngram_evidence.py --prompts specdec/data/chat_code_prompts.jsonl --num-prompts 40
"""
from __future__ import annotations

import argparse
from collections import defaultdict

from specdec import LLM, SamplingParams
from specdec.bench.prompts import encode_prompts, load_questions, pick_round_robin, prompts_path
from specdec.drafting import DraftRequest
from specdec.drafting.ngram import NgramDrafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default=None, help="JSONL with 'turns' (default: the shipped Spec-Bench prompts)")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=8, help="draft tokens looked at per position")
    args = ap.parse_args()

    llm = LLM(args.model, speculative_config="off")
    prompts = encode_prompts(llm, pick_round_robin(load_questions(prompts_path(args.prompts)), args.num_prompts))
    outs = llm.generate([{"prompt_token_ids": p.token_ids} for p in prompts],
                        SamplingParams(max_tokens=args.max_tokens, temperature=0))
    drafter = NgramDrafter(args.depth, tokenizer=llm.tokenizer)
    seen: dict[object, list[int]] = defaultdict(lambda: [0] * (args.depth + 1))  # evidence -> [count, kept >= j+1]
    for i, (p, o) in enumerate(zip(prompts, outs)):
        full = p.token_ids + o.token_ids
        for pos in range(len(p.token_ids), len(full)):
            d = drafter.propose([DraftRequest(i, full[:pos], 1, args.depth, sized_by_plan=True)])
            tokens = d.tokens[0, : d.num_nodes()[0]].tolist()
            kept = 0
            while kept < len(tokens) and pos + kept < len(full) and tokens[kept] == full[pos + kept]:
                kept += 1
            row = seen[d.evidence[0]]
            row[0] += 1
            for j in range(kept):
                row[1 + j] += 1
        drafter.release(i)
    total = sum(r[0] for r in seen.values())
    print(f"{len(prompts)} prompts, {total} decode positions; g(j): the share whose draft keeps its first j + 1")
    print("| evidence | share of positions | " + " | ".join(f"g({j})" for j in range(args.depth)) + " |")
    print("|---|---|" + "---|" * args.depth)
    for evidence, row in sorted(seen.items(), key=lambda kv: (kv[0] is not None, str(kv[0]))):
        rates = " | ".join(f"{k / row[0]:.2f}" for k in row[1:])
        print(f"| {evidence or 'no draft'} | {row[0] / total:.2f} | {rates} |")


if __name__ == "__main__":
    main()
