"""What an n-gram draft keeps by what it rests on: for every decode position of plain greedy outputs, the n-gram
drafter's whole-budget draft, its evidence (`Draft.evidence`: "match n" for a token match of n tokens, "text c" for
a text match of c+ characters) and how many of its tokens greedy verification would keep there. The table is what
the cost model learns per evidence while it runs (specdec/engine/cost.py), measured offline in one pass.

    python tools/ngram_evidence.py --num-prompts 40
    python tools/ngram_evidence.py --prompts specdec/data/chat_code_prompts.jsonl --num-prompts 40 \
        --corpus specdec/data/answers/smollm2-135m-0.npz

With --corpus, also what a retrieval draft (`drafting.retrieval`: the continuation most of the corpus's occurrences
of the longest matching suffix agree on) would keep at the same positions, by the n-gram's evidence there and the
retrieval match's length: where the two sources' drafts keep most is where a drafter choosing between them by
evidence would gain.
"""
from __future__ import annotations

import argparse
from collections import Counter, defaultdict

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
    ap.add_argument("--corpus", default=None, help="a retrieval corpus (text, JSONL or .npz) to compare with")
    args = ap.parse_args()

    store = None
    if args.corpus:
        spec = LLM(args.model, speculative_config={"method": "retrieval", "corpus": args.corpus,
                                                    "num_speculative_tokens": args.depth})
        store, llm = spec.engine.speculator.drafter.store, spec.with_speculative_config("off")
    else:
        llm = LLM(args.model, speculative_config="off")
    prompts = encode_prompts(llm, pick_round_robin(load_questions(prompts_path(args.prompts)), args.num_prompts))
    outs = llm.generate([{"prompt_token_ids": p.token_ids} for p in prompts],
                        SamplingParams(max_tokens=args.max_tokens, temperature=0))
    drafter = NgramDrafter(args.depth, tokenizer=llm.tokenizer)
    seen: dict[object, list[int]] = defaultdict(lambda: [0] * (args.depth + 1))  # evidence -> [count, kept >= j+1]
    both: dict[tuple, list[int]] = defaultdict(lambda: [0] * (args.depth + 1))  # (n-gram, retrieval) -> the same
    for i, (p, o) in enumerate(zip(prompts, outs)):
        full = p.token_ids + o.token_ids
        for pos in range(len(p.token_ids), len(full)):
            d = drafter.propose([DraftRequest(i, full[:pos], 1, args.depth, sized_by_plan=True)])
            count(seen[d.evidence[0]], kept(d.tokens[0, : d.num_nodes()[0]].tolist(), full, pos))
            if store is not None:
                tokens, m = retrieval_draft(store, full[:pos], args.depth)
                bucket = "no match" if not m else "2-3" if m <= 3 else "4-7" if m <= 7 else "8+"
                count(both[(d.evidence[0], bucket)], kept(tokens, full, pos))
        drafter.release(i)
    total = sum(r[0] for r in seen.values())
    print(f"{len(prompts)} prompts, {total} decode positions; g(j): the share whose draft keeps its first j + 1")
    print("| evidence | share of positions | " + " | ".join(f"g({j})" for j in range(args.depth)) + " |")
    print("|---|---|" + "---|" * args.depth)
    for evidence, row in sorted(seen.items(), key=lambda kv: (kv[0] is not None, str(kv[0]))):
        rates = " | ".join(f"{k / row[0]:.2f}" for k in row[1:])
        print(f"| {evidence or 'no draft'} | {row[0] / total:.2f} | {rates} |")
    if store is not None:
        print("\nthe retrieval draft's g(j), by the n-gram's evidence and the retrieval match's length in tokens")
        print("| n-gram evidence | retrieval match | share of positions | " +
              " | ".join(f"g({j})" for j in range(args.depth)) + " |")
        print("|---|---|---|" + "---|" * args.depth)
        for (evidence, bucket), row in sorted(both.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            rates = " | ".join(f"{k / row[0]:.2f}" for k in row[1:])
            print(f"| {evidence or 'no draft'} | {bucket} | {row[0] / total:.3f} | {rates} |")


def kept(tokens: list[int], full: list[int], pos: int) -> int:
    """How many of a draft after position `pos` greedy verification keeps (the plain output is `full`)."""
    n = 0
    while n < len(tokens) and pos + n < len(full) and tokens[n] == full[pos + n]:
        n += 1
    return n


def count(row: list[int], n: int) -> None:
    row[0] += 1
    for j in range(n):
        row[1 + j] += 1


def retrieval_draft(store, context: list[int], depth: int) -> tuple[list[int], int]:
    """The continuation most occurrences of the longest suffix of `context` in the corpus agree on, token by token
    (up to 64 occurrences), and that suffix's length (0: none of 2+ tokens occurs)."""
    m, lo, hi = store.longest_match(context, 2, 16)
    if not m:
        return [], 0
    voters, draft = store.continuations(lo, hi, m, depth, 64).tolist(), []
    for j in range(depth):
        votes = Counter(row[j] for row in voters if row[j] >= 0)
        if not votes:
            break
        token = votes.most_common(1)[0][0]
        draft.append(token)
        voters = [row for row in voters if row[j] == token]
    return draft, m


if __name__ == "__main__":
    main()
