"""Time the CPU step paths against each other in one process, alternating prompt by prompt (the machine's speed
drifts by tens of percent within minutes, so two separate runs cannot be compared):

    before: the stack layer by layer (a parallel region per product and per attention), the LM head in a second
            native call, an EAGLE-3 head's draft step op by op
    after:  the whole stack and the LM head in one thread team (`native.ops().team_max_rows`), the head's draft
            step in one native call (`Eagle3Head.draft_step`)

for plain decoding, the n-gram chain of 4 and the shipped head's chain of 1. Prints decode tokens/s and ms per
engine step per path, and whether every output equals plain decoding's.

    python tools/step_ab.py --prompts specdec/data/chat_code_prompts.jsonl --num-prompts 12
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec import LLM, SamplingParams
from specdec.engine.model_runner import ModelRunner
from specdec.models.cpu import native

HEAD = Path(__file__).resolve().parents[1] / "specdec" / "heads" / "smollm2-135m-eagle3"
FUSED = ModelRunner.run_logits


def run_then_logits(self, tables, starts, feeds, trees, feature_layers, rows):
    """The LM head in a second call, as before the change."""
    hidden, features = self.run(tables, starts, feeds, trees, feature_layers)
    return hidden, features, self.logits(hidden, rows)


def use(after: bool, llm: LLM) -> None:
    native.ops().team_max_rows(16 if after else 0)
    ModelRunner.run_logits = FUSED if after else run_then_logits
    speculator = llm.engine.speculator
    if speculator is not None and hasattr(speculator.drafter, "head"):
        speculator.drafter.head._step = None if after else False  # None: built on next use; False: op by op


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="specdec/data/chat_code_prompts.jsonl", help="JSONL with 'turns'")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    chats = [[{"role": "user", "content": r["turns"][0]}] for r in rows[:args.num_prompts]]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    plain = LLM(speculative_config="off")
    configs = {"plain": plain,
               "ngram chain-4": plain.with_speculative_config({"method": "ngram", "num_speculative_tokens": 4}),
               "head chain-1": plain.with_speculative_config({"method": "eagle3", "model": str(HEAD),
                                                             "num_speculative_tokens": 1})}
    results: dict[tuple[str, bool], list] = {(name, after): [] for name in configs for after in (False, True)}
    try:
        for i, chat in enumerate(chats):
            for name, llm in configs.items():
                for after in ((False, True) if i % 2 == 0 else (True, False)):
                    use(after, llm)
                    out = llm.chat([chat], params)[0]
                    results[(name, after)].append(out)
    finally:
        use(True, plain)
    reference = [o.token_ids for o in results[("plain", False)]]
    print(f"{len(chats)} prompts, {args.max_tokens} tokens, kernels {native.ops().isa()}")
    for name in configs:
        rates = {}
        for after in (False, True):
            outs = results[(name, after)]
            decode_s = sum(o.metrics["decode_s"] for o in outs)
            tokens = sum(o.metrics["num_generated_tokens"] - 1 for o in outs)
            steps = sum(o.metrics["num_steps"] for o in outs)
            rates[after] = (tokens / decode_s, decode_s / steps * 1e3)
        same = all(o.token_ids == ref for after in (False, True) for o, ref in zip(results[(name, after)], reference))
        print(f"{name}: before {rates[False][0]:.1f} tok/s {rates[False][1]:.2f} ms/step | after {rates[True][0]:.1f} "
              f"tok/s {rates[True][1]:.2f} ms/step | after / before {rates[True][0] / rates[False][0]:.3f} | "
              f"ids equal plain: {same}")


if __name__ == "__main__":
    main()
