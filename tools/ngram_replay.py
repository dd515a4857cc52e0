"""Replay n-gram drafting offline on recorded greedy outputs: acceptance without timing noise.

Greedy speculative output equals plain greedy output, so how many tokens a drafting policy gets accepted
can be computed from the plain output alone: walk the output, let the drafter propose from what is
committed, accept the longest prefix that matches, commit it plus the bonus token, repeat. This prints,
per Spec-Bench category and `ngram_match` mode: the acceptance length; the acceptance length an oracle
would reach on the same steps by picking the best of the indexed continuations (one per distinct first
token, from every matching suffix length), i.e. the headroom of smarter selection; and the speedup implied
by a step cost of 1 + row_cost * drafted tokens plain steps, or by measured costs (`--costs`, from
tools/verify_cost.py). The outputs are recorded once into `--cache`; delete it to record other rows.

    python tools/ngram_replay.py --rows 20:30 --branches 1,2,3
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from specdec import LLM, SamplingParams
from specdec.bench.prompts import encode_prompts, load_questions, prompts_path
from specdec.drafting import DraftRequest
from specdec.drafting.ngram import NgramDrafter


def record(rows: slice, max_tokens: int, cache: Path) -> list[dict]:
    """Plain greedy outputs of the chosen rows of every category (cached as JSON)."""
    if cache.exists():
        return json.loads(cache.read_text())
    llm = LLM(speculative_config="off")
    by_category = defaultdict(list)
    for row in load_questions(prompts_path(None)):
        by_category[row["category"]].append(row)
    records = []
    for prompt in encode_prompts(llm, [row for picked in by_category.values() for row in picked[rows]]):
        greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
        out = llm.generate([{"prompt_token_ids": prompt.token_ids}], greedy, use_tqdm=False)[0]  # batch 1, as served
        records.append({"category": prompt.category, "prompt": prompt.token_ids, "output": out.token_ids})
    cache.write_text(json.dumps(records))
    return records


def accepted(draft: list[int], output: list[int], t: int) -> int:
    n = 0
    while n < len(draft) and t + n < len(output) and draft[n] == output[t + n]:
        n += 1
    return n


def chains(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """The branches of an n-gram draft: chains hanging from the last committed token (parent -1)."""
    out: list[list[int]] = []
    for token, parent in zip(tokens, parents):
        if parent == -1:
            out.append([])
        out[-1].append(token)
    return out


def replay(records: list[dict], match: str, k: int, row_cost: float | list[float], branches: int = 1
           ) -> dict[str, tuple[float, float, float]]:
    """category -> (acceptance length, oracle acceptance length, implied speedup). row_cost: the cost of each
    verified draft token in plain steps, or the measured cost of a step feeding 1, 2, ... tokens."""
    def step_cost(drafted: int) -> float:
        if isinstance(row_cost, list):
            return row_cost[min(drafted, len(row_cost) - 1)]
        return 1 + row_cost * drafted

    totals = defaultdict(lambda: [0, 0, 0, 0.0])  # emitted, steps, oracle accepted, cost
    for rec in records:
        prompt, output = rec["prompt"], rec["output"]
        drafter = NgramDrafter(k, match=match, branches=branches)
        committed, t = list(prompt), 0
        while t < len(output):
            draft = drafter.propose([DraftRequest(0, committed, 0, k)])
            n = draft.num_nodes()[0]
            tokens = draft.tokens[0, :n].tolist()
            kept = max((accepted(c, output, t) for c in chains(tokens, draft.parents[0, :n].tolist())), default=0)
            index = drafter.index_for(0)
            best = max((accepted(c, output, t) for c, _ in index.lookup_branches(committed, k, 10**6)), default=0)
            emitted = min(kept + 1, len(output) - t)
            row = totals[rec["category"]]
            row[0] += emitted
            row[1] += 1
            row[2] += best
            row[3] += step_cost(len(tokens))
            committed, t = committed + output[t:t + emitted], t + emitted
    return {c: (e / s, 1 + o / s, e / cost) for c, (e, s, o, cost) in totals.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="20:30", help="Spec-Bench rows of each category, as a slice (default 20:30)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--cache", default="bench_results/replay_outputs.json")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--row-cost", type=float, default=0.11, help="cost of one more verified token, in plain steps")
    ap.add_argument("--costs", help="measured step costs feeding 1, 2, ... tokens, comma-separated (tools/"
                    "verify_cost.py), instead of --row-cost")
    ap.add_argument("--branches", default="1", help="comma-separated ngram_branches to compare (default 1)")
    args = ap.parse_args()
    start, stop = (int(x) for x in args.rows.split(":"))
    cache = Path(args.cache)
    cache.parent.mkdir(parents=True, exist_ok=True)
    records = record(slice(start, stop), args.max_tokens, cache)
    cost = [float(c) for c in args.costs.split(",")] if args.costs else args.row_cost
    print(f"{len(records)} outputs, k = {args.k}, step cost {cost}")
    for branches in (int(b) for b in args.branches.split(",")):
        for match in ("latest", "oldest", "frequent"):
            results = replay(records, match, args.k, cost, branches)
            cells = [f"{c}: AL {al:.2f} (oracle {oracle:.2f}) {speedup:.2f}x"
                     for c, (al, oracle, speedup) in results.items()]
            print(f"branches {branches} {match:9s}", " | ".join(cells))


if __name__ == "__main__":
    main()
