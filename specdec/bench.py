"""`specdec bench`: time specdec against itself (batch sizes, dtypes), transformers, and the memory roofline.

Results are a list of runs, each a config {engine, method, dtype, batch_size} with its measurements, so a
new decoding method is one more run. Batch-1 runs of different engines alternate per prompt (A/B, then
B/A) so that drift in a noisy machine's speed hits both engines alike.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specdec.config import SamplingParams, SpecdecError, SpeculativeConfig
from specdec.models.loader import ModelSource, default_speculative_config, resolve

DEFAULT_PROMPTS = Path("../shared/data/spec_bench/question.jsonl")
_REPO_PROMPTS = Path(__file__).resolve().parents[1].parent / "shared/data/spec_bench/question.jsonl"
BANDWIDTH_BUFFER_BYTES = 512 * 2**20  # far beyond any CPU cache, so the bandwidth is DRAM's
BANDWIDTH_REPEATS = 5


@dataclass
class BenchPrompt:
    question_id: Any
    category: str
    token_ids: list[int]


# ---------------------------------------------------------------------------------------- inputs
def parse_batch_sizes(text: str) -> list[int]:
    """Batch size 1 is always measured: every other batch size is reported relative to it."""
    try:
        sizes = {int(s) for s in text.split(",") if s.strip()}
    except ValueError:
        sizes = {0}
    if not sizes or min(sizes) < 1:
        raise SpecdecError(f"invalid --batch-sizes {text!r}: expected comma-separated positive integers, e.g. 1,4,16")
    return sorted(sizes | {1})


def parse_dtypes(dtypes: str | None, default: str) -> list[str]:
    from specdec.llm import parse_dtype

    names = [d.strip() for d in (dtypes or default).split(",") if d.strip()]
    if not names:
        raise SpecdecError(f"invalid --dtypes {dtypes!r}: expected comma-separated dtypes, e.g. float32,bfloat16")
    for name in names:
        parse_dtype(name)  # raises with the valid names listed
    return list(dict.fromkeys(names))


def prompts_path(arg: str | None) -> Path:
    """--prompts as given, else the Spec-Bench file next to the repo (from the cwd, then from this file)."""
    if arg is not None:
        path = Path(arg).expanduser()
        if not path.is_file():
            raise SpecdecError(f"prompts file {path} " + ("is a directory" if path.is_dir() else "does not exist"))
        return path
    for path in (DEFAULT_PROMPTS, _REPO_PROMPTS):
        if path.is_file():
            return path
    raise SpecdecError(f"no --prompts given and the default Spec-Bench file is in neither {DEFAULT_PROMPTS.resolve()} "
                       f"nor {_REPO_PROMPTS}; pass --prompts FILE.jsonl")


def load_questions(path: Path) -> list[dict]:
    """Spec-Bench rows: a JSON object per line with a non-empty 'turns' list (only the first turn is used)."""
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecdecError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        turns = row.get("turns") if isinstance(row, dict) else None
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0]:
            raise SpecdecError(f"{path}:{lineno}: expected an object with a non-empty 'turns' list of strings")
        rows.append(row)
    if not rows:
        raise SpecdecError(f"prompts file {path} has no prompts (it is empty)")
    return rows


def pick_round_robin(rows: list[dict], n: int) -> list[dict]:
    """n rows taking one per category in turn, so a small sample still covers every category."""
    if n < 1:
        raise SpecdecError(f"invalid --num-prompts {n}: must be >= 1")
    by_cat: dict[str, list[dict]] = {}
    for row in rows:
        by_cat.setdefault(str(row.get("category", "")), []).append(row)
    picked: list[dict] = []
    for i in range(max(len(v) for v in by_cat.values())):
        picked += [v[i] for v in by_cat.values() if i < len(v)]
    return picked[:n]


def encode_prompts(llm, rows: list[dict]) -> list[BenchPrompt]:
    """First turn as a user message through the chat template, or raw text when the model has none."""
    chat = bool(getattr(llm.tokenizer, "chat_template", None))
    out = []
    for row in rows:
        text = row["turns"][0]
        ids = llm.apply_chat_template([{"role": "user", "content": text}]) if chat else llm.encode(text)[1]
        out.append(BenchPrompt(row.get("question_id"), str(row.get("category", "")), ids))
    return out


# --------------------------------------------------------------------------------------- machine
def machine_info(device: torch.device) -> dict:
    import transformers

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def cpu_model() -> str | None:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or None
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """Fastest of `repeats` timed calls after one untimed one: the least-disturbed run on a noisy machine."""
    fn()
    _sync(device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(device: torch.device) -> dict:
    """Read bandwidth (a full-tensor sum) and STREAM-style copy bandwidth (bytes read + written by copy_)."""
    a = torch.ones(BANDWIDTH_BUFFER_BYTES // 4, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    read_s = best_seconds(a.sum, BANDWIDTH_REPEATS, device)
    copy_s = best_seconds(lambda: b.copy_(a), BANDWIDTH_REPEATS, device)
    nbytes = a.numel() * a.element_size()
    return {"buffer_bytes": nbytes, "repeats": BANDWIDTH_REPEATS, "threads": torch.get_num_threads(),
            "read_bytes_per_s": nbytes / read_s, "copy_bytes_per_s": 2 * nbytes / copy_s}


# ---------------------------------------------------------------------------------------- timing
def measurement(token_ids: list[int], ttft_s: float | None, decode_s: float, e2e_s: float) -> dict:
    """One request's numbers. Decode tokens/s excludes the first token, which belongs to the prefill."""
    n = len(token_ids)
    return {"generated_tokens": n, "ttft_s": ttft_s, "decode_s": decode_s, "e2e_s": e2e_s,
            "decode_tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
            "e2e_tokens_per_s": n / e2e_s if e2e_s > 0 else None, "token_ids": list(token_ids)}


SPEC_METRICS = ("num_steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos")


def time_specdec(llm, prompt: BenchPrompt, params: SamplingParams) -> dict:
    start = time.perf_counter()
    out = llm.generate({"prompt_token_ids": prompt.token_ids}, params)[0]
    e2e = time.perf_counter() - start
    m = out.metrics
    return {**measurement(out.token_ids, m["ttft_s"], m["decode_s"], e2e), **{k: m[k] for k in SPEC_METRICS}}


def acceptance(records: list[dict]) -> dict | None:
    """Speculation over a set of requests: acceptance length = tokens per target forward (bonus included)."""
    if not records or "num_steps" not in records[0] or not sum(r["num_draft_tokens"] for r in records):
        return None
    steps = sum(r["num_steps"] for r in records)
    drafted = sum(r["num_draft_tokens"] for r in records)
    per_pos = [sum(r["accepted_per_pos"][j] if j < len(r["accepted_per_pos"]) else 0 for r in records)
               for j in range(max(len(r["accepted_per_pos"]) for r in records))]
    drafts = sum(r["num_drafts"] for r in records)
    return {"acceptance_length": sum(r["generated_tokens"] for r in records) / steps,
            "acceptance_rate": sum(r["num_accepted_tokens"] for r in records) / drafted,
            "num_drafts": drafts, "num_draft_tokens": drafted,
            "acceptance_per_pos": [a / drafts for a in per_pos]}


def acceptance_by_category(records: list[dict]) -> dict:
    categories = dict.fromkeys(r["category"] for r in records)
    return {c: acceptance([r for r in records if r["category"] == c]) for c in categories}


class _TokenClock:
    """A transformers streamer that timestamps the first and last generated tokens.

    generate() puts the prompt first, then each new token, so the first put is skipped.
    """

    def __init__(self) -> None:
        self.puts, self.first, self.last = 0, None, None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts > 1:
            self.last = time.perf_counter()
            self.first = self.first or self.last

    def end(self) -> None:
        pass


def time_hf(model, prompt: BenchPrompt, max_tokens: int, eos: list[int]) -> dict:
    """transformers' greedy generate on the same ids, stopping on the same EOS ids as specdec."""
    x = torch.tensor([prompt.token_ids], device=model.device)
    clock = _TokenClock()
    start = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=eos or None, pad_token_id=eos[0] if eos else None, streamer=clock)
    e2e = time.perf_counter() - start
    first = clock.first or start
    return measurement(out[0, x.shape[1]:].tolist(), first - start, (clock.last or first) - first, e2e)


def load_hf(src: ModelSource, dtype: torch.dtype, device: torch.device):
    """transformers' own load of the same model, as an independent reference.

    A GGUF goes through transformers' dequantizer directly: from_pretrained(gguf_file=...) insists on
    `accelerate`, which specdec does not depend on.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if src.gguf_file is None:
        return AutoModelForCausalLM.from_pretrained(str(src.path), dtype=dtype).to(device).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(src.path), gguf_file=src.gguf_file.name)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = load_gguf_checkpoint(str(src.gguf_file), return_tensors=True, model_to_load=skeleton)["tensors"]
    missing = set(model.load_state_dict(state, strict=False).missing_keys)
    if missing - {"lm_head.weight"} or ("lm_head.weight" in missing and not config.tie_word_embeddings):
        raise SpecdecError(f"transformers' load of {src.name} lacks tensors {sorted(missing)[:3]}")
    return model.to(device).eval()


# ------------------------------------------------------------------------------------------ runs
def summarize(records: list[dict]) -> dict:
    """Aggregates are ratios of sums (total tokens / total time), so long requests weigh what they cost."""
    tokens = sum(r["generated_tokens"] for r in records)
    e2e = sum(r["e2e_s"] for r in records)
    decode_s = sum(r["decode_s"] for r in records)
    ttfts = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    return {"num_prompts": len(records), "generated_tokens": tokens, "e2e_s": e2e,
            "ttft_s_mean": sum(ttfts) / len(ttfts) if ttfts else None,
            "decode_tokens_per_s": sum(max(r["generated_tokens"] - 1, 0) for r in records) / decode_s
            if decode_s > 0 else None,
            "e2e_tokens_per_s": tokens / e2e if e2e > 0 else None}


def read_bandwidth_probe(device: torch.device) -> Callable[[], float]:
    """A quick read-bandwidth sample (bytes/s), taken beside every prompt: this machine's bandwidth drifts
    by tens of percent within minutes, so the roofline is also judged against the bandwidth of the moment."""
    a = torch.ones(BANDWIDTH_BUFFER_BYTES // 8, dtype=torch.float32, device=device)
    return lambda: a.numel() * a.element_size() / best_seconds(a.sum, 3, device)


def batch1_runs(timers: dict[tuple[str, str], Callable[[BenchPrompt], dict]], prompts: list[BenchPrompt],
                dtype: str, probe: Callable[[], float]) -> list[dict]:
    """Every engine on every prompt, one request at a time, alternating which engine goes first."""
    for timer in timers.values():
        timer(prompts[0])  # untimed warm-up
    per_prompt: dict[tuple[str, str], list[dict]] = {name: [] for name in timers}
    names = list(timers)
    for i, p in enumerate(tqdm(prompts, desc=f"{dtype} batch 1", file=sys.stderr)):
        bandwidth = probe()
        for name in names if i % 2 == 0 else names[::-1]:
            rec = timers[name](p)
            per_prompt[name].append({"index": i, "question_id": p.question_id, "category": p.category,
                                     "prompt_tokens": len(p.token_ids), "read_bytes_per_s_beside": bandwidth,
                                     **rec})
    return [{"config": run_config(engine, dtype, 1, method), "summary": summarize(recs), "per_prompt": recs,
             "acceptance": acceptance(recs), "acceptance_by_category": acceptance_by_category(recs)}
            for (engine, method), recs in per_prompt.items()]


def run_config(engine: str, dtype: str, batch_size: int, method: str = "plain") -> dict:
    return {"engine": engine, "method": method, "dtype": dtype, "batch_size": batch_size}


def time_group(llm, prompts: list[BenchPrompt], params: SamplingParams) -> tuple[dict, list[list[int]]]:
    """One generate() call for a group. Its decode phase starts once every request has its first token."""
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p.token_ids} for p in prompts], params)
    wall = time.perf_counter() - start
    prefill = max(o.metrics["ttft_s"] for o in outs)
    record = {"generated_tokens": sum(len(o.token_ids) for o in outs), "wall_s": wall, "ttft_s_max": prefill,
              "ttft_s_sum": sum(o.metrics["ttft_s"] for o in outs),
              "decode_tokens": sum(len(o.token_ids) - 1 for o in outs), "decode_s": wall - prefill}
    return record, [o.token_ids for o in outs]


def batched_run(llm, prompts: list[BenchPrompt], batch_size: int, params: SamplingParams, dtype: str,
                batch1: dict, method: str = "plain") -> dict:
    """Groups of batch_size prompts (cycling through the list), one generate() call per group."""
    if batch_size > llm.engine.cfg.max_num_seqs:
        raise SpecdecError(f"batch size {batch_size} exceeds the engine's max_num_seqs={llm.engine.cfg.max_num_seqs}")
    order = [i % len(prompts) for i in range(math.ceil(len(prompts) / batch_size) * batch_size)]
    reference = [r["token_ids"] for r in batch1["per_prompt"]]
    per_group, identical = [], 0
    for g in tqdm(range(0, len(order), batch_size), desc=f"{method} {dtype} batch {batch_size}", file=sys.stderr):
        group = order[g:g + batch_size]
        record, token_ids = time_group(llm, [prompts[i] for i in group], params)
        identical += sum(ids == reference[i] for ids, i in zip(token_ids, group))
        per_group.append({"prompt_indices": group, **record})
    total = {k: sum(g[k] for g in per_group) for k in ("generated_tokens", "wall_s", "ttft_s_sum", "decode_tokens",
                                                         "decode_s")}
    base = batch1["summary"]["e2e_tokens_per_s"]
    e2e_tps = total["generated_tokens"] / total["wall_s"]
    summary = {"num_prompts": len(order), "generated_tokens": total["generated_tokens"], "e2e_s": total["wall_s"],
               "ttft_s_mean": total["ttft_s_sum"] / len(order),
               "decode_tokens_per_s": total["decode_tokens"] / total["decode_s"] if total["decode_s"] > 0 else None,
               "e2e_tokens_per_s": e2e_tps, "speedup_vs_batch1": e2e_tps / base if base else None,
               "identical_to_batch1": identical}
    return {"config": run_config("specdec", dtype, batch_size, method), "summary": summary, "per_group": per_group}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length); None if identical."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x and y else None


def bench_params(args: argparse.Namespace) -> SamplingParams:
    temperature = getattr(args, "temperature", 0.0)
    return SamplingParams(temperature=temperature, max_tokens=args.max_tokens, seed=0 if temperature > 0 else None)


def compare(candidate: dict, baseline: dict) -> dict:
    """Speed of candidate over baseline from the same interleaved run, and whether greedy outputs agree."""
    cs, bs = candidate["summary"], baseline["summary"]
    divergences = []
    for c, b in zip(candidate["per_prompt"], baseline["per_prompt"]):
        pos = first_divergence(c["token_ids"], b["token_ids"])
        if pos is not None:
            divergences.append({"index": c["index"], "question_id": c["question_id"], "position": pos})
    by_category = {}
    for cat in dict.fromkeys(r["category"] for r in candidate["per_prompt"]):
        c_sum = summarize([r for r in candidate["per_prompt"] if r["category"] == cat])
        b_sum = summarize([r for r in baseline["per_prompt"] if r["category"] == cat])
        by_category[cat] = {"e2e_speedup": _ratio(c_sum["e2e_tokens_per_s"], b_sum["e2e_tokens_per_s"]),
                            "decode_speedup": _ratio(c_sum["decode_tokens_per_s"], b_sum["decode_tokens_per_s"])}
    return {"candidate": candidate["config"], "baseline": baseline["config"],
            "e2e_speedup": _ratio(cs["e2e_tokens_per_s"], bs["e2e_tokens_per_s"]),
            "decode_speedup": _ratio(cs["decode_tokens_per_s"], bs["decode_tokens_per_s"]),
            "ttft_speedup": _ratio(bs["ttft_s_mean"], cs["ttft_s_mean"]),
            "by_category": by_category, "num_prompts": len(candidate["per_prompt"]),
            "identical_prompts": len(candidate["per_prompt"]) - len(divergences), "divergences": divergences}


def roofline(weight_bytes: int, bandwidth: dict, achieved: float | None, records: list[dict]) -> dict:
    """Batch-1 decode reads every weight once per token, so bandwidth / weight bytes bounds tokens/s.

    Judged twice: against the bandwidth measured at the start of the run, and per prompt against the
    bandwidth sampled just before it (the median of those per-prompt fractions).
    """
    read = bandwidth["read_bytes_per_s"] / weight_bytes
    copy = bandwidth["copy_bytes_per_s"] / weight_bytes
    beside = sorted(r["decode_tokens_per_s"] * weight_bytes / r["read_bytes_per_s_beside"]
                    for r in records if r.get("decode_tokens_per_s") and r.get("read_bytes_per_s_beside"))
    return {"weight_bytes_per_token": weight_bytes, "read_bw_tokens_per_s": read, "copy_bw_tokens_per_s": copy,
            "achieved_decode_tokens_per_s": achieved,
            "fraction_of_read_bw": achieved / read if achieved else None,
            "fraction_of_copy_bw": achieved / copy if achieved else None,
            "fraction_of_read_bw_beside_median": beside[len(beside) // 2] if beside else None}


def bench_dtype(args: argparse.Namespace, dtype: str, rows: list[dict], batch_sizes: list[int],
                bandwidth: dict) -> tuple[list[dict], list[dict]]:
    """All runs for one dtype: batch 1 (speculative and transformers interleaved with plain when asked),
    roofline, larger batches. Speculation is compared with plain decoding of the same engine and weights."""
    from specdec.llm import LLM, parse_dtype

    llm = LLM(args.model, dtype=dtype, device=args.device, speculative_config="off")
    prompts = encode_prompts(llm, rows)
    params = bench_params(args)
    engines = {("specdec", "plain"): llm}
    spec = args.speculative_config if args.speculative_config is not None else default_speculative_config(args.model)
    if SpeculativeConfig.parse(spec) is not None:
        spec_llm = llm.with_speculative_config(spec)
        engines[("specdec", spec_llm.engine.speculative.method)] = spec_llm
    timers = {key: (lambda p, e=e: time_specdec(e, p, params)) for key, e in engines.items()}
    if args.compare_hf:
        hf = load_hf(resolve(args.model), parse_dtype(dtype), llm.engine.model.device)
        eos = sorted(llm.engine.eos_token_ids)
        timers[("transformers", "plain")] = lambda p: time_hf(hf, p, args.max_tokens, eos)
    runs = batch1_runs(timers, prompts, dtype, read_bandwidth_probe(llm.engine.model.device))
    plain = runs[0]
    plain["roofline"] = roofline(llm.engine.model.weight_bytes_per_token(), bandwidth,
                                 plain["summary"]["decode_tokens_per_s"], plain["per_prompt"])
    comparisons = [{**compare(other, plain), "sampled": params.temperature > 0}
                   for other in runs[1:] if other["config"]["engine"] == "specdec"]
    comparisons += [compare(plain, other) for other in runs[1:] if other["config"]["engine"] != "specdec"]
    for (_, method), engine in engines.items():
        batch1 = next(r for r in runs if r["config"]["method"] == method and r["config"]["engine"] == "specdec")
        runs += [batched_run(engine, prompts, b, params, dtype, batch1, method) for b in batch_sizes if b > 1]
    return runs, comparisons


def output_path(out: str) -> Path:
    """Create the output directory before the long run, so a bad --out fails at once."""
    path = Path(out).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecdecError(f"cannot create the directory for --out {path}: {e.strerror}") from None
    return path


def run_bench(args: argparse.Namespace) -> dict:
    """Validate everything cheap first, then measure; prints the report and writes the JSON."""
    SpeculativeConfig.parse(args.speculative_config)  # validates before any model loads
    from specdec.llm import parse_device

    path = prompts_path(args.prompts)
    dtypes = parse_dtypes(args.dtypes, args.dtype)
    batch_sizes = parse_batch_sizes(args.batch_sizes)
    bench_params(args)  # validates --max-tokens and --temperature
    if args.threads is not None:
        if args.threads < 1:
            raise SpecdecError(f"invalid --threads {args.threads}: must be >= 1")
        torch.set_num_threads(args.threads)
    rows = pick_round_robin(load_questions(path), args.num_prompts)
    device = parse_device(args.device)
    out = output_path(args.out)
    result = {"machine": machine_info(device), "args": vars(args), "prompts_file": str(path),
              "bandwidth": measure_bandwidth(device), "runs": [], "comparisons": []}
    for dtype in dtypes:
        runs, comparisons = bench_dtype(args, dtype, rows, batch_sizes, result["bandwidth"])
        result["runs"] += runs
        result["comparisons"] += comparisons
    out.write_text(json.dumps(result, indent=1, default=str))
    print(format_report(result))
    print(f"\nresults written to {out}")
    return result


# ---------------------------------------------------------------------------------------- report
def _num(x: float | None, spec: str = ".1f", scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def format_table(headers: list[str], rows: Iterable[list[str]], left: int = 1) -> str:
    """Plain aligned text: the first `left` columns are labels (left-aligned), the rest numbers."""
    rows = list(rows)
    widths = [max(len(c) for c in col) for col in zip(headers, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


_SHORT = {"specdec": "sd", "transformers": "hf"}


def label(config: dict) -> str:
    name = _SHORT.get(config["engine"], config["engine"])
    return name if config["method"] == "plain" else f"{name}/{config['method']}"


def per_prompt_table(runs: list[dict], comparisons: list[dict]) -> str:
    """One row per prompt, the batch-1 runs of one dtype side by side, then whether greedy ids matched."""
    headers = ["#", "category", "in"]
    for run in runs:
        headers += [f"{label(run['config'])} {h}" for h in ("tok", "TTFT ms", "dec tok/s", "e2e tok/s")]
    headers += [f"{label(c['candidate'])}={label(c['baseline'])}" for c in comparisons]
    diverged = [{d["index"]: d["position"] for d in c["divergences"]} for c in comparisons]
    rows = []
    for i, first in enumerate(runs[0]["per_prompt"]):
        row = [str(i), first["category"], str(first["prompt_tokens"])]
        for run in runs:
            r = run["per_prompt"][i]
            row += [str(r["generated_tokens"]), _num(r["ttft_s"], ".0f", 1e3), _num(r["decode_tokens_per_s"]),
                    _num(r["e2e_tokens_per_s"])]
        row += ["yes" if i not in d else f"no@{d[i]}" for d in diverged]
        rows.append(row)
    return format_table(headers, rows, left=2)


def summary_table(runs: list[dict]) -> str:
    headers = ["engine", "method", "dtype", "batch", "prompts", "tokens", "TTFT ms", "dec tok/s", "e2e tok/s",
               "x batch1", "ids=batch1"]
    rows = []
    for run in runs:
        c, s = run["config"], run["summary"]
        ident = s.get("identical_to_batch1")
        rows.append([c["engine"], c["method"], c["dtype"], str(c["batch_size"]), str(s["num_prompts"]),
                     str(s["generated_tokens"]), _num(s.get("ttft_s_mean"), ".0f", 1e3),
                     _num(s.get("decode_tokens_per_s")), _num(s["e2e_tokens_per_s"]),
                     _num(s.get("speedup_vs_batch1"), ".2f"), "-" if ident is None else f"{ident}/{s['num_prompts']}"])
    return format_table(headers, rows, left=3)


def comparison_line(c: dict) -> str:
    cand, base = c["candidate"], c["baseline"]
    text = (f"{cand['engine']}/{cand['method']} vs {base['engine']}/{base['method']} ({cand['dtype']}, batch 1): "
            f"e2e {_num(c['e2e_speedup'], '.2f')}x, decode {_num(c['decode_speedup'], '.2f')}x, "
            f"TTFT {_num(c['ttft_speedup'], '.2f')}x; " + (
                f"greedy token ids identical on {c['identical_prompts']}/{c['num_prompts']} prompts"
                if not c.get("sampled") else "sampled: outputs differ from plain decoding by design"))
    if c["divergences"] and not c.get("sampled"):
        text += " (first divergence: " + ", ".join(f"#{d['index']} at token {d['position']}"
                                                   for d in c["divergences"]) + ")"
    text += "\n  decode speedup by category: " + ", ".join(
        f"{cat} {_num(x['decode_speedup'], '.2f')}x" for cat, x in c["by_category"].items())
    return text


def acceptance_line(run: dict) -> str:
    a, c = run["acceptance"], run["config"]
    per_cat = ", ".join(f"{cat} {_num(x['acceptance_length'], '.2f') if x else '-'}"
                        for cat, x in run["acceptance_by_category"].items())
    per_pos = " ".join(f"{x:.2f}" for x in a["acceptance_per_pos"])
    return (f"Acceptance ({c['engine']}/{c['method']}, {c['dtype']}, batch 1): acceptance length "
            f"{a['acceptance_length']:.2f} tokens per target forward, acceptance rate {a['acceptance_rate']:.1%}, "
            f"accepted per position [{per_pos}]; acceptance length by category: {per_cat}")


def roofline_line(run: dict) -> str:
    r = run["roofline"]
    return (f"Roofline ({run['config']['dtype']}, batch 1): {r['weight_bytes_per_token'] / 1e6:.1f} MB of weights "
            f"per token -> read-BW bound {_num(r['read_bw_tokens_per_s'])} tok/s, copy-BW bound "
            f"{_num(r['copy_bw_tokens_per_s'])} tok/s; achieved decode {_num(r['achieved_decode_tokens_per_s'])} "
            f"tok/s = {_num(r['fraction_of_read_bw'], '.1%')} of the read-BW roofline, "
            f"{_num(r['fraction_of_copy_bw'], '.1%')} of the copy-BW roofline; median per prompt against the "
            f"read bandwidth sampled beside it: {_num(r['fraction_of_read_bw_beside_median'], '.1%')}")


def format_report(result: dict) -> str:
    m, bw = result["machine"], result["bandwidth"]
    parts = [f"Machine: {m['cpu_model'] or 'unknown CPU'} ({m['cpu_count']} CPUs), {m['torch_threads']} torch "
             f"threads, torch {m['torch']}, transformers {m['transformers']}, device {m['device']}",
             f"Memory bandwidth (best of {bw['repeats']}, {bw['buffer_bytes'] / 2**20:.0f} MiB float32 buffer): "
             f"read {bw['read_bytes_per_s'] / 1e9:.1f} GB/s (tensor.sum), "
             f"copy {bw['copy_bytes_per_s'] / 1e9:.1f} GB/s (b.copy_(a), bytes read + written)",
             "Columns: sd = specdec, hf = transformers; in/tok = prompt/generated tokens; "
             "dec tok/s excludes the first token; sd=hf: greedy ids identical (no@N: first differing token)"]
    for dtype in dict.fromkeys(r["config"]["dtype"] for r in result["runs"]):
        batch1 = [r for r in result["runs"] if r["config"]["dtype"] == dtype and r["config"]["batch_size"] == 1]
        comps = [c for c in result["comparisons"] if c["candidate"]["dtype"] == dtype]
        parts += [f"\nPer prompt ({dtype}, batch 1)", per_prompt_table(batch1, comps)]
    parts += ["\nSummary (aggregates = total tokens / total time; for batch > 1, TTFT is the mean over requests "
              "and decode starts once every request in the group has its first token)",
              summary_table(result["runs"]), ""]
    parts += [comparison_line(c) for c in result["comparisons"]]
    parts += [acceptance_line(r) for r in result["runs"] if r.get("acceptance")]
    parts += [roofline_line(r) for r in result["runs"] if "roofline" in r]
    return "\n".join(parts)
