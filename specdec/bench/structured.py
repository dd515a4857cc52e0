"""`specdec bench --structured`: constrained decoding on JSON-extraction prompts (a text and the schema of what
to extract from it, `data/structured_prompts.jsonl`), plain against speculative with and without jump-forward
drafting, prompt by prompt in turn on one engine's weights; validity (each output parsed and validated against
its schema with `jsonschema`), token identity with constrained plain decoding, and the masks' share of time."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.bench.config import BenchConfig
from specdec.bench.engines import time_specdec
from specdec.bench.prompts import BenchPrompt
from specdec.bench.report import format_table, output_path, ratio
from specdec.config import SamplingParams, SpecdecError
from specdec.structured import grammar_backend

if TYPE_CHECKING:
    from specdec.llm import LLM

DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "structured_prompts.jsonl"


def load_tasks(path: Path) -> list[dict]:
    """Rows of {"text": ..., "schema": {...}}."""
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise SpecdecError(f"cannot read structured prompts {path}: {e}") from None
    if not rows or any(not isinstance(r.get("text"), str) or not isinstance(r.get("schema"), dict) for r in rows):
        raise SpecdecError(f"{path}: every line must be an object with 'text' and 'schema'")
    return rows


def extraction_prompt(task: dict) -> list[dict]:
    keys = ", ".join(task["schema"].get("properties", {}))
    return [{"role": "user", "content": f"Extract the information in this text as JSON with the keys {keys}.\n\n"
                                        f"Text: {task['text']}"}]


def is_valid(text: str, schema: dict) -> bool:
    from jsonschema import ValidationError, validate

    try:
        validate(json.loads(text), schema)
        return True
    except (json.JSONDecodeError, ValidationError):
        return False


def run_structured_bench(cfg: BenchConfig) -> dict:
    from specdec.llm import LLM

    tasks = load_tasks(Path(cfg.prompts) if cfg.prompts else DEFAULT_PROMPTS)[: cfg.num_prompts]
    llm = LLM(cfg.model, dtype=cfg.dtype, device=cfg.device, quantization=cfg.quantization,
              speculative_config="off")
    spec_cfg = cfg.speculative_dict({"method": "ngram", "num_speculative_tokens": 4})
    engines = {"plain": llm, "speculative": llm.with_speculative_config({"jump_forward": True, **spec_cfg}),
               "speculative, no jump-forward": llm.with_speculative_config({**spec_cfg, "jump_forward": False})}
    prompts = [BenchPrompt(i, "json", llm.apply_chat_template(extraction_prompt(t))) for i, t in enumerate(tasks)]
    records: dict[str, list[dict]] = {name: [] for name in engines}
    for eng in engines.values():  # warm-up: kernels, grammar compiler
        time_specdec(eng, prompts[0], _params(tasks[0], 8, cfg.temperature))
    for task, prompt in zip(tasks, prompts):
        params = _params(task, cfg.max_tokens, cfg.temperature)
        for name, eng in engines.items():
            out = eng.generate({"prompt_token_ids": prompt.token_ids}, params)[0]
            m = out.metrics
            records[name].append({"valid": is_valid(out.text, task["schema"]), "token_ids": out.token_ids,
                                  "tokens": len(out.token_ids), "decode_s": m["decode_s"], "e2e_s": m["e2e_s"],
                                  "grammar_s": m["grammar_s"], "num_steps": m["num_steps"]})
    result = {"config": spec_cfg, "grammar_backend": grammar_backend(), "temperature": cfg.temperature,
              "num_prompts": len(tasks),
              "summary": {name: _summary(recs, records["plain"]) for name, recs in records.items()},
              "batched": [_batched(engines["plain"], engines["speculative"], tasks, prompts, b, cfg)
                          for b in cfg.batch_sizes if b > 1]}
    print(format_structured(result))
    path = output_path(cfg.out)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return result


def _batched(plain: LLM, spec: LLM, tasks: list[dict], prompts: list[BenchPrompt], batch_size: int,
             cfg: BenchConfig) -> dict:
    """Groups of batch_size prompts decoded together, plain and speculative in turn group by group (which goes
    first alternates): decode tok/s after the group's last first token, validity, identity."""
    import time

    totals = {name: {"tokens": 0, "decode_s": 0.0, "valid": 0, "ids": []} for name in ("plain", "speculative")}
    for n, start in enumerate(range(0, len(tasks), batch_size)):
        group = list(range(start, min(start + batch_size, len(tasks))))
        for name, eng in ([("plain", plain), ("speculative", spec)] if n % 2 == 0 else
                          [("speculative", spec), ("plain", plain)]):
            begin = time.perf_counter()
            outs = eng.generate([{"prompt_token_ids": prompts[i].token_ids} for i in group],
                                [_params(tasks[i], cfg.max_tokens, cfg.temperature) for i in group])
            wall = time.perf_counter() - begin
            t = totals[name]
            t["tokens"] += sum(len(o.token_ids) - 1 for o in outs)
            t["decode_s"] += wall - max(o.metrics["ttft_s"] for o in outs)
            t["valid"] += sum(is_valid(o.text, tasks[i]["schema"]) for o, i in zip(outs, group))
            t["ids"] += [o.token_ids for o in outs]
    rate = {name: t["tokens"] / t["decode_s"] for name, t in totals.items()}
    return {"batch_size": batch_size, "plain_decode_tokens_per_s": rate["plain"],
            "speculative_decode_tokens_per_s": rate["speculative"],
            "valid": {name: t["valid"] for name, t in totals.items()},
            "identical_to_plain": sum(a == b for a, b in zip(totals["plain"]["ids"], totals["speculative"]["ids"]))}


def _params(task: dict, max_tokens: int, temperature: float) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=0 if temperature else None, max_tokens=max_tokens,
                          structured_output={"json": task["schema"]})


def _summary(recs: list[dict], plain: list[dict]) -> dict:
    decode_tokens = sum(r["tokens"] - 1 for r in recs)
    decode_s = sum(r["decode_s"] for r in recs)
    return {"valid": sum(r["valid"] for r in recs), "identical_to_plain": sum(
                r["token_ids"] == p["token_ids"] for r, p in zip(recs, plain)),
            "decode_tokens_per_s": decode_tokens / decode_s if decode_s else None,
            "acceptance_length": sum(r["tokens"] for r in recs) / sum(r["num_steps"] for r in recs),
            "grammar_share": sum(r["grammar_s"] for r in recs) / sum(r["e2e_s"] for r in recs)}


def format_structured(result: dict) -> str:
    s = result["summary"]
    base = s["plain"]["decode_tokens_per_s"]
    rows = [[name, f"{v['decode_tokens_per_s']:.1f}", f"{ratio(v['decode_tokens_per_s'], base):.2f}x",
             f"{v['acceptance_length']:.2f}", f"{v['valid']}/{result['num_prompts']}",
             f"{v['identical_to_plain']}/{result['num_prompts']}", f"{100 * v['grammar_share']:.1f}%"]
            for name, v in s.items()]
    head = (f"structured output: {result['num_prompts']} JSON-extraction prompts, temperature {result['temperature']}, "
            f"speculative config {json.dumps(result['config'])}, grammar backend {result['grammar_backend']}")
    lines = [f"batch {b['batch_size']}, groups alternated: decode {b['plain_decode_tokens_per_s']:.1f} -> "
             f"{b['speculative_decode_tokens_per_s']:.1f} tok/s "
             f"({ratio(b['speculative_decode_tokens_per_s'], b['plain_decode_tokens_per_s']):.2f}x), valid "
             f"{b['valid']['plain']}/{b['valid']['speculative']} of {result['num_prompts']}, ids = plain "
             f"{b['identical_to_plain']}/{result['num_prompts']}" for b in result["batched"]]
    return "\n".join([head, format_table(["decoding", "decode tok/s", "vs plain", "acceptance length",
                                           "valid JSON", "ids = plain", "mask time share"], rows), *lines])
