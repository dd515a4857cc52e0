"""`specdec tune`: choose the draft shape for each batch size by measuring, as Meta's tree dispatcher does.

1. Acceptance statistics (tree methods): decode the prompts at batch 1 with a wide full tree and count,
   per depth and child rank, how often the rank-r candidate is accepted when its parent was. Pruned
   trees N_i (the i nodes most likely to be accepted, `tree.pruned_tree`) are built from that table.
2. Cost: for each batch size, decode groups of that many prompts with every candidate shape (chains,
   pruned trees, EAGLE-2 dynamic trees, speculation off), candidates interleaved group by group so machine drift hits
    them alike, and time the
   decode phase. The fastest candidate wins: small trees or chains for big batches, or no speculation.
3. The winners form a dispatch table, written as JSON that `speculative_config` loads with
   {"dispatch": "tune.json"}.
4. Given several methods (a JSON list), each is tuned so, and the default is the one fastest against plain
   decoding over the batch sizes; `--write-default` makes it the model's default config (shipped for a built-in
   model, this machine's under $SPECDEC_CACHE/defaults for any other).
A method's keys registered as `verify_cost_keys` (a hybrid tree's `min_score`), when the user leaves them out, get
the measured cost of verifying one more token, in plain steps (`specdec.bench.verify_cost`): a node is worth
verifying only while it is likelier to be accepted than that.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from specdec.bench.config import TuneConfig
from specdec.bench.engines import time_group
from specdec.bench.prompts import encode_prompts, load_questions, pick_round_robin, prompts_path
from specdec.bench.report import output_path
from specdec.bench.verify_cost import token_cost
from specdec.config import SamplingParams, SpecdecError
from specdec.drafting.registry import SpeculativeConfig
from specdec.models.loader import HEADS_DIR, default_config_path
from specdec.tree import SpecShape, pruned_tree

if TYPE_CHECKING:
    from specdec.bench.prompts import BenchPrompt
    from specdec.llm import LLM

MIN_GAIN = 1.02  # speculation is chosen only this much faster than plain: a noise-level win is not worth a risk
MEASURE_TREE = "D3-BF3"  # 39 nodes: three candidates per node, three levels deep
PRUNED_SIZES = (4, 8, 16, 32)
DYNAMIC_TREES = ({"topk": 2, "num_steps": 3, "num_draft_tokens": 6},
                 {"topk": 4, "num_steps": 4, "num_draft_tokens": 12})


def acceptance_table(llm: LLM, prompts: list[BenchPrompt], params: SamplingParams) -> list[list[float]]:
    """rate[d][r]: how often the rank-r child at depth d + 1 is accepted, given its parent was."""
    shape = llm.measuring.speculative.parse_shape(MEASURE_TREE, "tree")
    llm.measuring.pin_draft_shape(shape)
    width, depth = 1 + max(p[-1] for p in shape.tree), max(len(p) for p in shape.tree)
    reached, accepted = [0] * depth, [[0] * width for _ in range(depth)]
    for p in tqdm(prompts, desc="acceptance statistics", file=sys.stderr):
        with llm.measuring.trace_speculation() as trace:
            llm.generate({"prompt_token_ids": p.token_ids}, params)
        for nodes, num_drafted in trace:
            if not num_drafted:
                continue
            deepest = max(len(shape.tree[n]) for n in range(num_drafted))
            for d in range(min(len(nodes) + 1, deepest)):
                reached[d] += 1
            for d, n in enumerate(nodes):
                accepted[d][shape.tree[n][-1]] += 1
    llm.measuring.pin_draft_shape(None)
    return [[a / r if r else 0.0 for a in row] for row, r in zip(accepted, reached)]


def candidates(cfg: SpeculativeConfig, rates: list[list[float]] | None) -> list[SpecShape]:
    k = cfg.num_speculative_tokens
    shapes = [SpecShape(0)] + [SpecShape(n) for n in sorted({1, 2, max(1, k // 2), k})]
    if rates is not None:
        for size in PRUNED_SIZES:
            shapes.append(cfg.parse_shape(pruned_tree(rates, size), "tree"))
        if cfg.info.dynamic_trees:  # draft models and feature heads (Medusa's heads draft static trees only)
            shapes += [cfg.parse_shape(dict(d), "tree") for d in DYNAMIC_TREES]
    unique: dict[SpecShape, None] = dict.fromkeys(shapes)
    return list(unique)


def parse_candidates(value: str | dict | list) -> list[dict]:
    """--speculative-config: one method's config, or a JSON list of them to choose the default from."""
    configs = json.loads(value) if isinstance(value, str) else value
    configs = configs if isinstance(configs, list) else [configs]
    if not configs or not all(isinstance(c, dict) for c in configs):
        raise SpecdecError("specdec tune: --speculative-config must be a config or a non-empty JSON list of configs")
    for c in configs:
        SpeculativeConfig.parse(c)  # validates before any model loads
    return configs


def run_tune(cfg: TuneConfig) -> dict:
    if not cfg.speculative_config:
        raise SpecdecError("specdec tune needs --speculative-config: the drafting method(s) to tune")
    configs = parse_candidates(cfg.speculative_config)
    from specdec.llm import LLM

    out = output_path(cfg.out)
    batch_sizes = sorted({*cfg.batch_sizes, 1})  # batch 1 is the reference of every other size
    params = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens, ignore_eos=True)
    rows = pick_round_robin(load_questions(prompts_path(cfg.prompts)), cfg.num_prompts)
    base = LLM(cfg.model, dtype=cfg.dtype, device=cfg.device, speculative_config="off",
               quantization=cfg.quantization, max_num_seqs=max(max(batch_sizes), 1))
    prompts = encode_prompts(base, rows)  # the weights are loaded and the prompts encoded once for every method
    results = [tune_method(base, prompts, batch_sizes, params, user) for user in configs]
    result = {**results[0]} if len(results) == 1 else {"methods": results}
    result["default"] = pick_default(configs, results)
    result["args"] = dataclasses.asdict(cfg)
    out.write_text(json.dumps(result, indent=1))
    print("\n\n".join(format_tune(r) for r in results))
    print(f"\ndefault: {json.dumps(result['default'])}")
    print(f"\ndispatch tables written to {out}; use one with "
          f"--speculative-config '{{\"method\": \"...\", ..., \"dispatch\": \"{out}\"}}'")
    if cfg.write_default:
        path = default_config_path(cfg.model)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(shippable(result["default"]), indent=1) + "\n")
        print(f"default speculative config of {cfg.model} written to {path}")
    return result


def pick_default(configs: list[dict], results: list[dict]) -> dict:
    """The config to use when none is asked for: the method whose chosen shapes are fastest against plain
    decoding measured beside them (geometric mean of the ratios over the batch sizes; ratios are never
    under 1, since speculation off is a candidate), with its dispatch table."""
    def score(result: dict) -> float:
        ratios = [speeds[result["chosen"][b]] / speeds["off"] for b, speeds in result["decode_tokens_per_s"].items()]
        return math.prod(ratios) ** (1 / len(ratios))

    best = max(range(len(results)), key=lambda i: score(results[i]))
    config = {k: v for k, v in results[best]["config"].items() if k not in ("dispatch", "tree")}
    return {**config, "dispatch": results[best]["dispatch"]}


def shippable(config: dict) -> dict:
    """A default config as shipped: a head inside the shipped heads directory is named relative to it (a nested
    source's too)."""
    model = config.get("model")
    if model and Path(model).resolve().parent == HEADS_DIR:
        config = {**config, "model": Path(model).resolve().name}
    if isinstance(config.get("sources"), list):
        config = {**config, "sources": [shippable(s) if isinstance(s, dict) else s for s in config["sources"]]}
    return config


def choose(shapes: list[SpecShape], speeds: dict[str, float]) -> SpecShape:
    """The fastest shape, or no speculation unless the fastest beats it by MIN_GAIN."""
    best = max(shapes, key=lambda s: speeds[str(s)])
    return best if speeds[str(best)] >= MIN_GAIN * speeds["off"] else SpecShape(0)


def tune_method(base: LLM, prompts: list, batch_sizes: list[int], params: SamplingParams, user: dict) -> dict:
    """One method's dispatch table over the plain engine `base`'s weights: acceptance statistics (trees), then
    every candidate shape timed per batch size."""
    cfg = SpeculativeConfig.parse(user)
    missing = [key for key in cfg.info.verify_cost_keys if key not in user]
    if missing:
        cost = verify_cost_threshold(base, prompts, cfg.num_speculative_tokens, params)
        print(f"{cfg.method}: {', '.join(missing)} {cost}", file=sys.stderr)
        user = {**user, **dict.fromkeys(missing, cost)}
    tree_method = cfg.info.trees
    llm = base.with_speculative_config({**user, "dispatch": None, **({"tree": MEASURE_TREE} if tree_method else {})})
    rates = acceptance_table(llm, prompts, params) if tree_method else None
    shapes = candidates(llm.measuring.speculative, rates)
    speeds: dict[int, dict[str, float]] = {}
    for b in batch_sizes:
        totals = defaultdict(lambda: [0, 0.0])
        groups = [[prompts[(g + i) % len(prompts)] for i in range(b)] for g in range(0, max(len(prompts), b), b)]
        for g, group in enumerate(tqdm(groups, desc=f"{cfg.method}, batch {b}", file=sys.stderr)):
            for j in range(len(shapes)):  # rotate the order every group: drift hits every candidate alike
                shape = shapes[(g + j) % len(shapes)]
                llm.measuring.pin_draft_shape(shape)
                llm.measuring.forget_finished()  # no shape drafts from another shape's answers to these prompts
                record, _ = time_group(llm, group, params)
                totals[shape][0] += record["decode_tokens"]
                totals[shape][1] += record["decode_s"]
        speeds[b] = {str(s): n / t for s, (n, t) in totals.items()}
    best = {b: choose(shapes, speeds[b]) for b in batch_sizes}
    return {"method": cfg.method, "config": user, "dispatch": {str(b): best[b].to_json() for b in batch_sizes},
            "chosen": {str(b): str(best[b]) for b in batch_sizes},
            "decode_tokens_per_s": {str(b): v for b, v in speeds.items()},
            "acceptance_by_depth_and_rank": rates,
            "candidates": {str(s): s.to_json() for s in shapes}}


def verify_cost_threshold(base: LLM, prompts: list, nodes: int, params: SamplingParams) -> float:
    """The extra cost of verifying one more token, in plain steps, at the prompts' median context halfway
    through their answers: the least acceptance chance that pays for a draft node (at most 1)."""
    context = sorted(len(p.token_ids) for p in prompts)[len(prompts) // 2] + params.max_tokens // 2
    context = min(context, base.max_model_len - nodes - 2)
    cost = token_cost(base.measuring, context, nodes)
    print(f"verifying one more token costs {cost:.3f} plain steps (context {context}, {nodes} nodes)",
          file=sys.stderr)
    return min(round(cost, 3), 1.0)


def format_tune(result: dict) -> str:
    lines = [f"Tree dispatcher for {result['method']} (decode tokens/s per candidate, best marked *)"]
    for b, speeds in result["decode_tokens_per_s"].items():
        off = speeds.get("off")
        cells = [f"{name}{'*' if name == result['chosen'][b] else ''} {v:.1f}" for name, v in speeds.items()]
        best = speeds[result["chosen"][b]]
        ratio = f" ({best / off:.2f}x plain)" if off else ""
        lines.append(f"batch {b}: {', '.join(cells)} -> {result['chosen'][b]}{ratio}")
    return "\n".join(lines)
