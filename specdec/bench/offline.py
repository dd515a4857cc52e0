"""`specdec bench`: time specdec against itself (batch sizes, dtypes), transformers, and the memory roofline.

Results are a list of runs, each a config {engine, method, dtype, batch_size} with its measurements, so a
new decoding method is one more run. Batch-1 runs of different engines alternate per prompt (A/B, then
B/A) so that drift in a noisy machine's speed hits both engines alike. Every specdec run also says where its
engine steps' time went (`step_times`: ms per step by phase, `LLMEngine.step_times`), beside the roofline step:
one read of the target's weights at the bandwidth measured at the start.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.bench.config import BenchConfig
from specdec.bench.engines import load_hf, load_llamacpp, time_group, time_hf, time_llamacpp, time_specdec
from specdec.bench.llamacpp_spec import ENGINE as LLAMA_SERVER
from specdec.bench.llamacpp_spec import LlamaServerPeers, PeerConfig, start_peers, summarize_peers
from specdec.bench.machine import machine_info, measure_bandwidth, read_bandwidth_probe
from specdec.bench.prompts import BenchPrompt, encode_prompts, load_questions, pick_round_robin, prompts_path
from specdec.bench.report import format_report, output_path, ratio
from specdec.config import SamplingParams, SpecdecError
from specdec.drafting.registry import SpeculativeConfig
from specdec.models.loader import default_speculative_config, resolve, shipped_head


def bench_params(cfg: BenchConfig) -> SamplingParams:
    return SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                          seed=0 if cfg.temperature > 0 else None)


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


def batch1_runs(timers: dict[tuple[str, str], Callable[[BenchPrompt], dict]], prompts: list[BenchPrompt],
                dtype: str, probe: Callable[[], float], forget: Callable[[], None] = lambda: None) -> list[dict]:
    """Every engine on every prompt, one request at a time, alternating which engine goes first. `forget`
    runs after the warm-up: no drafter may draft a timed prompt from its own warm-up answer."""
    for timer in timers.values():
        timer(prompts[0])  # untimed warm-up
    forget()
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


def batched_runs(engines: dict[tuple[str, str], object], prompts: list[BenchPrompt], batch_size: int,
                 params: SamplingParams, dtype: str, batch1: dict[tuple[str, str], dict]) -> list[dict]:
    """Groups of batch_size prompts (cycling through the list), one generate() call per group and engine,
    the engines alternating group by group (which goes first too) so machine drift hits them alike."""
    for llm in engines.values():
        if batch_size > llm.measuring.max_num_seqs:
            raise SpecdecError(f"batch size {batch_size} exceeds the engine's max_num_seqs="
                               f"{llm.measuring.max_num_seqs}")
    order = [i % len(prompts) for i in range(math.ceil(len(prompts) / batch_size) * batch_size)]
    names = list(engines)
    per_group: dict[tuple[str, str], list[dict]] = {name: [] for name in names}
    identical = dict.fromkeys(names, 0)
    starts = range(0, len(order), batch_size)
    for n, g in enumerate(tqdm(starts, desc=f"{dtype} batch {batch_size}", file=sys.stderr)):
        group = order[g:g + batch_size]
        for name in names if n % 2 == 0 else names[::-1]:
            record, token_ids = time_group(engines[name], [prompts[i] for i in group], params)
            reference = batch1[name]["per_prompt"]
            identical[name] += sum(ids == reference[i]["token_ids"] for ids, i in zip(token_ids, group))
            per_group[name].append({"prompt_indices": group, **record})
    runs = []
    for (_, method), groups in per_group.items():
        total = {k: sum(g[k] for g in groups) for k in ("generated_tokens", "wall_s", "ttft_s_sum", "decode_tokens",
                                                       "decode_s")}
        base = batch1[("specdec", method)]["summary"]["e2e_tokens_per_s"]
        e2e_tps = total["generated_tokens"] / total["wall_s"]
        summary = {"num_prompts": len(order), "generated_tokens": total["generated_tokens"], "e2e_s": total["wall_s"],
                   "ttft_s_mean": total["ttft_s_sum"] / len(order),
                   "decode_tokens_per_s": total["decode_tokens"] / total["decode_s"] if total["decode_s"] > 0 else None,
                   "e2e_tokens_per_s": e2e_tps, "speedup_vs_batch1": e2e_tps / base if base else None,
                   "identical_to_batch1": identical[("specdec", method)]}
        runs.append({"config": run_config("specdec", dtype, batch_size, method), "summary": summary,
                     "per_group": groups})
    return runs


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length); None if identical."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


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
        by_category[cat] = {"e2e_speedup": ratio(c_sum["e2e_tokens_per_s"], b_sum["e2e_tokens_per_s"]),
                            "decode_speedup": ratio(c_sum["decode_tokens_per_s"], b_sum["decode_tokens_per_s"])}
    return {"candidate": candidate["config"], "baseline": baseline["config"],
            "e2e_speedup": ratio(cs["e2e_tokens_per_s"], bs["e2e_tokens_per_s"]),
            "decode_speedup": ratio(cs["decode_tokens_per_s"], bs["decode_tokens_per_s"]),
            "ttft_speedup": ratio(bs["ttft_s_mean"], cs["ttft_s_mean"]),
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


def add_step_times(runs: list[dict], engines: dict[tuple[str, str], object], roofline_step_ms: float) -> None:
    """Each specdec run's step accounting: its engine's `step_times` since the pass began (prefill and decode
    steps apart), and the roofline step; a speculative run's cost model predictions (`engine.cost.Prediction`)."""
    for run in runs:
        llm = engines.get((run["config"]["engine"], run["config"]["method"]))
        if llm is not None:
            run["step_times"] = {**llm.measuring.step_times.summary(), "roofline_step_ms": roofline_step_ms}
            if (prediction := llm.measuring.prediction()) is not None:
                run["cost_model"] = prediction  # the cost model's prediction, to check


def bench_dtype(cfg: BenchConfig, dtype: str, rows: list[dict], batch_sizes: list[int],
                bandwidth: dict, peer_cfg: PeerConfig | None = None) -> tuple[list[dict], list[dict], dict | None]:
    """All runs for one dtype: batch 1 (speculative and transformers interleaved with plain when asked; with
    `peer_cfg`, llama.cpp's speculative modes too, summarized in the third value), roofline, larger batches.
    Speculation is compared with plain decoding of the same engine and weights."""
    from specdec.llm import LLM, parse_dtype

    llm = LLM(cfg.model, dtype=dtype, device=cfg.device, speculative_config="off", quantization=cfg.quantization)
    model = llm.measuring.model
    # Runs are labelled with what the weights compute in: 'auto' resolves to a GGUF's block formats ('q4_1').
    dtype = model.quantization or (str(model.dtype).removeprefix("torch.") if dtype == "auto" else dtype)
    prompts = encode_prompts(llm, rows)
    params = bench_params(cfg)
    engines = {("specdec", "plain"): llm}
    spec = cfg.speculative_config if cfg.speculative_config is not None else \
        default_speculative_config(cfg.model, model.config.num_mtp_layers)
    if SpeculativeConfig.parse(spec) is not None:
        spec_llm = llm.with_speculative_config(spec)
        engines[("specdec", spec_llm.speculative_method)] = spec_llm
    timers = {key: (lambda p, e=e: time_specdec(e, p, params)) for key, e in engines.items()}
    eos = sorted(llm.measuring.eos_token_ids)
    if cfg.compare_hf:
        hf_dtype = torch.float32 if model.quantization else parse_dtype(dtype)
        hf = load_hf(resolve(cfg.model), hf_dtype, model.device)
        if hf.generation_config.cache_implementation == "static":  # compiles its first decode: not timed
            time_hf(hf, max(prompts, key=lambda p: len(p.token_ids)), cfg.max_tokens, eos)
        timers[("transformers", "plain")] = lambda p: time_hf(hf, p, cfg.max_tokens, eos)
    if cfg.compare_llamacpp:
        peer = load_llamacpp(resolve(cfg.model), torch.get_num_threads())
        timers[("llama.cpp", "plain")] = lambda p: time_llamacpp(peer, p, cfg.max_tokens, eos)
    servers: LlamaServerPeers | None = start_peers(peer_cfg) if peer_cfg is not None else None
    commands = servers.commands() if servers is not None else {}
    if servers is not None:
        timers.update(servers.timers())

    def forget() -> None:  # before each timed pass: no drafter remembers it, every engine counts its steps anew
        for engine in engines.values():
            engine.measuring.forget_finished()
            engine.measuring.step_times.switch(True)  # on a GPU too (there every phase then waits for the device)
            engine.measuring.step_times.reset()
        if servers is not None:
            servers.forget()

    try:
        runs = batch1_runs(timers, prompts, dtype, read_bandwidth_probe(model.device), forget)
    finally:
        if servers is not None:
            servers.stop()
    peer_summary = summarize_peers(runs, servers.refused, commands) if servers is not None else None
    weight_bytes = model.weight_bytes_per_token()
    roofline_step_ms = 1e3 * weight_bytes / bandwidth["read_bytes_per_s"]
    add_step_times(runs, engines, roofline_step_ms)
    plain = runs[0]
    plain["roofline"] = roofline(weight_bytes, bandwidth, plain["summary"]["decode_tokens_per_s"], plain["per_prompt"])
    def differs_by_design(method: str) -> bool:  # rejection sampling's tokens depend on the drafts; keyed ones do not
        verification = engines[("specdec", method)].measuring.sampled_verification()
        return params.temperature > 0 and verification == "rejection"

    comparisons = [{**compare(other, plain), "sampled": differs_by_design(other["config"]["method"])}
                   for other in runs[1:] if other["config"]["engine"] == "specdec"]
    # Against peers: our plain decoding, and every speculative configuration, over each peer's plain decoding.
    peers = [other for other in runs[1:] if other["config"]["engine"] not in ("specdec", LLAMA_SERVER)]
    comparisons += [compare(ours, peer) for peer in peers for ours in runs if ours["config"]["engine"] == "specdec"]
    batch1 = {key: next(r for r in runs if (r["config"]["engine"], r["config"]["method"]) == key) for key in engines}
    for b in batch_sizes:
        if b > 1:
            forget()  # each pass drafts as a first pass over these prompts would
            batched = batched_runs(engines, prompts, b, params, dtype, batch1)
            add_step_times(batched, engines, roofline_step_ms)
            runs += batched
    return runs, comparisons, peer_summary


def peer_config(cfg: BenchConfig, out: Path) -> PeerConfig | None:
    """--llama-server with --compare-llamacpp: llama.cpp's speculative modes on the model's GGUF, with specdec's
    threads; the shipped EAGLE-3 head when the model has one. Checked before any model loads."""
    if not cfg.llama_server:
        return None
    if not cfg.compare_llamacpp:
        raise SpecdecError("--llama-server runs llama.cpp's speculative modes beside --compare-llamacpp (or serves "
                           "with --serve): pass one of them")
    if not Path(cfg.llama_server).is_file():
        raise SpecdecError(f"--llama-server {cfg.llama_server!r} is not a file: build it as docs/benchmarks.md says")
    draft = Path(cfg.llamacpp_draft).expanduser() if cfg.llamacpp_draft else None
    if draft is not None and not draft.is_file():
        raise SpecdecError(f"--llamacpp-draft {draft} is not a file")
    gguf = resolve(cfg.model).gguf_file
    if gguf is None:
        raise SpecdecError(f"--llama-server runs llama.cpp on a GGUF file, and {cfg.model} is a Hugging Face model")
    head = shipped_head(cfg.model)
    return PeerConfig(cfg.llama_server, gguf, torch.get_num_threads(), cfg.max_tokens, out, draft,
                      head if head is not None and head.is_dir() else None)


def run_bench(cfg: BenchConfig) -> dict:
    """Validate everything cheap first, then measure; prints the report and writes the JSON."""
    SpeculativeConfig.parse(cfg.speculative_config)  # validates before any model loads
    from specdec.llm import parse_device

    path = prompts_path(cfg.prompts)
    dtypes = cfg.dtypes or (cfg.dtype,)
    batch_sizes = sorted({*cfg.batch_sizes, 1})  # every other batch size is reported relative to batch 1
    bench_params(cfg)  # validates --max-tokens and --temperature
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    rows = pick_round_robin(load_questions(path), cfg.num_prompts)
    device = parse_device(cfg.device)
    out = output_path(cfg.out)
    peer_cfg = peer_config(cfg, out)
    result = {"machine": machine_info(device), "args": dataclasses.asdict(cfg), "prompts_file": str(path),
              "bandwidth": measure_bandwidth(device), "runs": [], "comparisons": []}
    for dtype in dtypes:
        runs, comparisons, peer_summary = bench_dtype(cfg, dtype, rows, batch_sizes, result["bandwidth"], peer_cfg)
        result["runs"] += runs
        result["comparisons"] += comparisons
        if peer_summary is not None:
            result.setdefault("llamacpp_spec", []).append(peer_summary)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(format_report(result))
    print(f"\nresults written to {out}")
    return result
