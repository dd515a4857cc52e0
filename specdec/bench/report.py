"""How benchmark results read: aligned plain-text tables (per prompt, summary, step accounting), one-line
comparisons, acceptance and roofline lines, and where the JSON goes."""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from specdec.config import SpecdecError


def output_path(out: str) -> Path:
    """Create the output directory before the long run, so a bad --out fails at once."""
    path = Path(out).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecdecError(f"cannot create the directory for --out {path}: {e.strerror}") from None
    return path


def ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x and y else None


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


STEP_COLUMNS = [("schedule", "schedule"), ("draft model", "draft_forward"), ("draft host", "draft_host"),
                ("target forward", "target_forward"), ("logits", "logits"), ("token choice", "token_choice"),
                ("settle", "settle"), ("commit", "commit")]


def step_table(runs: list[dict]) -> str:
    """Where a decode step's time goes, per specdec run: ms per engine step by phase, the whole step, and the
    roofline step (one read of the target's weights)."""
    headers = ["config", "tokens/step", *(name for name, _ in STEP_COLUMNS), "whole step", "roofline step"]
    rows = []
    for run in runs:
        if "step_times" not in run:
            continue
        c, t = run["config"], run["step_times"]
        d = t["decode"]
        rows.append([f"{label(c)} {c['dtype']} b{c['batch_size']}", _num(d["tokens_per_step"], ".2f"),
                     *(_num(d[f"{key}_ms"], ".2f") for _, key in STEP_COLUMNS), _num(d["step_ms"], ".2f"),
                     _num(t["roofline_step_ms"], ".2f")])
    return format_table(headers, rows)


def comparison_line(c: dict) -> str:
    cand, base = c["candidate"], c["baseline"]
    text = (f"{cand['engine']}/{cand['method']} vs {base['engine']}/{base['method']} ({cand['dtype']}, batch 1): "
            f"e2e {_num(c['e2e_speedup'], '.2f')}x, decode {_num(c['decode_speedup'], '.2f')}x, "
            f"TTFT {_num(c['ttft_speedup'], '.2f')}x; " + (
                f"token ids identical on {c['identical_prompts']}/{c['num_prompts']} prompts"
                if not c.get("sampled") else "rejection sampling: outputs differ from plain decoding by design"))
    if c["divergences"] and not c.get("sampled"):
        text += " (first divergence: " + ", ".join(f"#{d['index']} at token {d['position']}"
                                                   for d in c["divergences"]) + ")"
    text += "\n  decode speedup by category: " + ", ".join(
        f"{cat} {_num(x['decode_speedup'], '.2f')}x" for cat, x in c["by_category"].items())
    return text


def batched_comparison_lines(runs: list[dict]) -> list[str]:
    """Speculative over plain decoding at each batch size > 1 (their groups were timed alternately)."""
    lines = []
    for run in runs:
        c = run["config"]
        if c["batch_size"] == 1 or c["method"] == "plain":
            continue
        plain = next((r for r in runs if r["config"] == {**c, "method": "plain"}), None)
        if plain is None:
            continue
        s, p = run["summary"], plain["summary"]
        decode = ratio(s["decode_tokens_per_s"], p["decode_tokens_per_s"])
        e2e = ratio(s["e2e_tokens_per_s"], p["e2e_tokens_per_s"])
        lines.append(f"{c['engine']}/{c['method']} vs {c['engine']}/plain ({c['dtype']}, batch {c['batch_size']}, "
                     f"groups alternated): decode {_num(decode, '.2f')}x, e2e {_num(e2e, '.2f')}x; greedy token ids "
                     f"identical to batch 1 on {s['identical_to_batch1']}/{s['num_prompts']}")
    return lines


def acceptance_line(run: dict) -> str:
    a, c = run["acceptance"], run["config"]
    per_cat = ", ".join(f"{cat} {_num(x['acceptance_length'], '.2f') if x else '-'}"
                        for cat, x in run["acceptance_by_category"].items())
    per_pos = " ".join(f"{x:.2f}" for x in a["acceptance_per_pos"])
    return (f"Acceptance ({c['engine']}/{c['method']}, {c['dtype']}, batch 1): acceptance length "
            f"{a['acceptance_length']:.2f} tokens per target forward, acceptance rate {a['acceptance_rate']:.1%}, "
            f"accepted per position [{per_pos}]; acceptance length by category: {per_cat}")


def cost_model_lines(runs: list[dict]) -> list[str]:
    """Each speculative run's predicted speedup (the cost model's, over its decode steps) beside the measured one
    (decode tokens per second over plain decoding's, same batch size and dtype)."""
    lines = []
    for run in runs:
        predicted = (run.get("cost_model") or {}).get("predicted_speedup")
        c = run["config"]
        plain = next((r for r in runs if r["config"] == {**c, "method": "plain"}), None)
        if predicted is None or plain is None:
            continue
        measured = ratio(run["summary"]["decode_tokens_per_s"], plain["summary"]["decode_tokens_per_s"])
        error = predicted / measured - 1 if measured else None
        lines.append(f"Cost model ({c['engine']}/{c['method']}, {c['dtype']}, batch {c['batch_size']}): predicted "
                     f"{predicted:.2f}x plain decoding, measured {_num(measured, '.2f')}x "
                     f"(prediction off by {_num(error, '+.1%')}); tokens "
                     f"{_num(run['cost_model']['tokens_ratio'], '.2f')}x and step time "
                     f"{_num(run['cost_model']['seconds_ratio'], '.2f')}x what it expected")
    return lines


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
        batch1 = [r for r in result["runs"] if r["config"]["dtype"] == dtype and r["config"]["batch_size"] == 1
                  and r["config"]["engine"] != "llama-server"]  # llama.cpp's speculative modes: their own table
        comps = [c for c in result["comparisons"] if c["candidate"]["dtype"] == dtype]
        parts += [f"\nPer prompt ({dtype}, batch 1)", per_prompt_table(batch1, comps)]
    parts += ["\nSummary (aggregates = total tokens / total time; for batch > 1, TTFT is the mean over requests "
              "and decode starts once every request in the group has its first token)",
              summary_table(result["runs"])]
    if any("step_times" in r for r in result["runs"]):
        parts += ["\nStep accounting (ms per decode step; tokens/step: tokens emitted per engine step, every "
                  "sequence of the step together; roofline step: one read of the target's weights)",
                  step_table(result["runs"])]
    parts += [""]
    parts += [comparison_line(c) for c in result["comparisons"]]
    parts += batched_comparison_lines(result["runs"])
    parts += [acceptance_line(r) for r in result["runs"] if r.get("acceptance")]
    parts += cost_model_lines(result["runs"])
    parts += [roofline_line(r) for r in result["runs"] if "roofline" in r]
    for summary in result.get("llamacpp_spec", []):
        parts += llamacpp_spec_lines(summary)
    return "\n".join(parts)


def llamacpp_spec_lines(s: dict) -> list[str]:
    """llama.cpp's speculative modes (llama-server, batch 1): one row per mode, then specdec's default speculation
    over the fastest of them, beside the target ratio; a mode llama-server refused, with its error."""
    headers = ["llama-server mode", "dec tok/s", "e2e tok/s", "accepted/drafted", "accept rate", "ids=none",
               "ids=llama.cpp plain", f"sd/{s['specdec_method']} over it"]

    def same(m: dict, reference: str) -> str:
        count = m[f"identical_to_{reference}"]
        return "-" if count is None else f"{count}/{m['num_prompts']}"

    rows = [[m["mode"], _num(m["decode_tokens_per_s"]), _num(m["e2e_tokens_per_s"]),
             f"{m['accepted']}/{m['drafted']}", _num(m["acceptance_rate"], ".1%"), same(m, "server_plain"),
             same(m, "llamacpp_plain"), _num(m["specdec_over_mode"], ".2f")] for m in s["modes"]]
    lines = [f"\nllama.cpp's speculative modes ({s['dtype']}, batch 1, llama-server, one slot, same threads and "
             "token ids; dec tok/s excludes the first token; ids=none: greedy ids equal to llama-server's plain "
             "decoding, ids=llama.cpp plain: to llama-cpp-python's)", format_table(headers, rows)]
    lines += [f"llama-server refused {mode}: {error}" for mode, error in s["refused"].items()]
    if s["best_mode"] is None or s["specdec_method"] is None:
        lines.append("no ratio to llama.cpp's best speculative mode: " + (
            "no specdec speculative run (--speculative-config off)" if s["specdec_method"] is None
            else "no llama.cpp speculative mode ran"))
    else:
        met = "meets" if s["meets_target"] else "misses"
        lines.append(f"specdec/{s['specdec_method']} decode {_num(s['specdec_decode_tokens_per_s'])} tok/s over "
                     f"llama.cpp's best speculative mode ({s['best_mode']}, {_num(s['best_decode_tokens_per_s'])} "
                     f"tok/s): {_num(s['specdec_over_best'], '.2f')}x ({met} the {s['target_ratio']}x target)")
    return lines
