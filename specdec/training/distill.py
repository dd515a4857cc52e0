"""Self-distillation data: the training prompts answered by the target itself.

A draft head learns to predict the target, so it should train on the target's own phrasing, not on
human-written answers. `specdec distill` answers the first user turn of every training conversation in the
folder `--data-dir` names (a balanced quota per source file) with the target's own decoding: greedy for most
prompts and seeded sampling at temperature 0.7 for a stated share, because users sample too.

The result is reproducible (a job is a source row, a temperature and a seed, all derived from `--seed`),
resumable (finished answers are flushed to chunk files in a cache directory outside the repository every few
hundred requests; a restarted run skips them) and compact: one `.npz` of token ids (uint16, deflated) plus,
per answer, where its prompt comes from. Prompts are not stored: they are re-rendered from the source files
with the chat template and checked against a CRC32 of their token ids, so a changed data file or tokenizer
is caught instead of silently misaligning prompts and answers.
"""
from __future__ import annotations

import json
import random
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from specdec.config import SamplingParams, SpecdecError, cache_root
from specdec.models.loader import model_fingerprint  # noqa: F401  (callers import it from here too)

if TYPE_CHECKING:
    from specdec.llm import LLM

FORMAT = 1
FINISH_CODES = {"stop": 0, "length": 1, "skipped": 2}  # skipped: the prompt is longer than max_prompt_tokens


@dataclass(frozen=True)
class Job:
    """One prompt to answer: row `row` of `source` (a file stem), sampled at `temperature` with `seed`."""

    source: str
    row: int
    temperature: float
    seed: int


@dataclass
class Record:
    """One answer: its job, the prompt's length and CRC32 (of its token ids) and the answer's token ids."""

    job: Job
    prompt_len: int
    prompt_crc: int
    finish: str  # "stop" | "length" | "skipped"
    tokens: list[int]


# ---------------------------------------------------------------------------------------------- sources
def read_sources(data_dir: str | Path) -> dict[str, list[list[dict] | None]]:
    """The prompts of every training file (`*.jsonl` directly in `data_dir`, never `spec_bench/`), by file stem."""
    data_dir = Path(data_dir).expanduser()
    if not data_dir.is_dir():
        raise SpecdecError(f"training data directory {data_dir} does not exist")
    files = sorted(data_dir.glob("*.jsonl"))
    if not files:
        raise SpecdecError(f"{data_dir} holds no *.jsonl training file")
    return {p.stem: read_prompts(p) for p in files}


def read_prompts(path: Path) -> list[list[dict] | None]:
    """Per line of a `{"messages": [...]}` file: the messages before its first assistant turn (None when the
    line has no user turn before an assistant turn, so row numbers stay line numbers)."""
    prompts: list[list[dict] | None] = []
    lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines(): answers hold U+2028
    for lineno, line in enumerate(lines[:-1] if lines and not lines[-1] else lines, 1):
        if not line.strip():
            prompts.append(None)
            continue
        try:
            messages = json.loads(line)["messages"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise SpecdecError(f"{path}:{lineno}: expected a JSON object with a 'messages' list") from None
        first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
        head = messages[:first]
        prompts.append(head if any(m.get("role") == "user" for m in head) else None)
    return prompts


def plan(sources: dict[str, list[list[dict] | None]], per_source: int, sampled_share: float, seed: int,
         temperature: float = 0.7) -> list[Job]:
    """`per_source` jobs per source, rows drawn in a seeded order, so a larger quota extends a smaller one.
    A job is sampled (at `temperature`, with its own seed) with probability `sampled_share`, drawn per row."""
    if per_source < 1:
        raise SpecdecError(f"invalid per-source quota {per_source}: must be >= 1")
    if not 0 <= sampled_share <= 1:
        raise SpecdecError(f"invalid sampled share {sampled_share}: must be in [0, 1]")
    jobs = []
    for name, prompts in sources.items():
        rows = [i for i, p in enumerate(prompts) if p is not None]
        random.Random(f"{seed}:{name}").shuffle(rows)
        for row in rows[:per_source]:
            draw = random.Random(f"{seed}:{name}:{row}")
            sampled = draw.random() < sampled_share
            jobs.append(Job(name, row, temperature if sampled else 0.0, draw.randrange(2**31)))
    return jobs


def crc(ids: list[int]) -> int:
    return zlib.crc32(np.asarray(ids, dtype=np.uint32).tobytes())


# ---------------------------------------------------------------------------------------------- storage
def save(path: Path, records: list[Record], meta: dict) -> None:
    """Write records (sorted by source and row) atomically as one compressed `.npz`."""
    records = sorted(records, key=lambda r: (r.job.source, r.job.row))
    names = sorted({r.job.source for r in records})
    index = {n: i for i, n in enumerate(names)}
    lengths = np.array([len(r.tokens) for r in records], dtype=np.int64)
    arrays = {
        "meta": np.frombuffer(json.dumps({**meta, "format": FORMAT, "sources": names}).encode(), dtype=np.uint8),
        "source": np.array([index[r.job.source] for r in records], dtype=np.uint8),
        "row": np.array([r.job.row for r in records], dtype=np.int32),
        "temperature": np.array([r.job.temperature for r in records], dtype=np.float32),
        "seed": np.array([r.job.seed for r in records], dtype=np.int64),
        "prompt_len": np.array([r.prompt_len for r in records], dtype=np.int32),
        "prompt_crc": np.array([r.prompt_crc for r in records], dtype=np.uint32),
        "finish": np.array([FINISH_CODES[r.finish] for r in records], dtype=np.uint8),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "tokens": np.array([t for r in records for t in r.tokens], dtype=np.uint16),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    tmp.replace(path)


def load(path: Path) -> tuple[dict, list[Record]]:
    """The meta dict and records of a file written by `save`."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise SpecdecError(f"self-distillation data {path} does not exist (make it with `specdec distill`)")
    try:
        with np.load(path) as z:
            meta = json.loads(z["meta"].tobytes().decode())
            a = {k: z[k] for k in ("source", "row", "temperature", "seed", "prompt_len", "prompt_crc", "finish",
                                   "offsets", "tokens")}
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as err:
        raise SpecdecError(f"{path} is not a self-distillation file ({type(err).__name__}: {err})") from None
    if meta.get("format") != FORMAT:
        raise SpecdecError(f"{path} has format {meta.get('format')}, this specdec reads format {FORMAT}")
    finish = {v: k for k, v in FINISH_CODES.items()}
    names, off, tokens = meta["sources"], a["offsets"], a["tokens"]
    records = [Record(Job(names[a["source"][i]], int(a["row"][i]), round(float(a["temperature"][i]), 4),
                          int(a["seed"][i])),
                      int(a["prompt_len"][i]), int(a["prompt_crc"][i]), finish[int(a["finish"][i])],
                      tokens[off[i]:off[i + 1]].tolist())
               for i in range(len(a["row"]))]
    return meta, records


# ---------------------------------------------------------------------------------------------- running
def regenerate(llm: LLM, data_dir: str | Path, out: str | Path, *, per_source: int = 1000, sampled_share: float = 0.25,
               max_tokens: int = 256, max_prompt_tokens: int = 1536, seed: int = 0, cache_dir: str | Path | None = None,
               flush_every: int = 200, in_flight: int = 96, limit: int | None = None) -> dict:
    """Answer every planned job not yet in `out` or the cache, flushing chunks as it goes; then pack all of
    them into `out`. `limit` stops after that many new answers (the rest waits for the next run)."""
    sources = read_sources(data_dir)
    out = Path(out)
    meta = {"model": model_fingerprint(llm.engine.model), "max_tokens": max_tokens,
            "max_prompt_tokens": max_prompt_tokens, "seed": seed}
    cache = Path(cache_dir).expanduser() if cache_dir else cache_root() / "distill" / meta["model"]
    cache.mkdir(parents=True, exist_ok=True)
    done: dict[tuple[str, int], Record] = {}
    for path in ([out] if out.is_file() else []) + sorted(cache.glob("chunk-*.npz")):
        old_meta, records = load(path)
        mismatch = {k: (old_meta.get(k), v) for k, v in meta.items() if old_meta.get(k) != v}
        if mismatch:
            raise SpecdecError(f"{path} was made with other settings ({mismatch}, as (there, here)); "
                               "use another --out and cache directory, or the same settings")
        done.update({(r.job.source, r.job.row): r for r in records})
    planned = plan(sources, per_source, sampled_share, seed)
    jobs = [j for j in planned if (j.source, j.row) not in done]
    if limit is not None:
        jobs = jobs[:limit]
    engine = llm.engine
    pending, fresh = list(reversed(jobs)), []
    running: list[tuple[Job, list[int], object]] = []
    chunk_id = len(list(cache.glob("chunk-*.npz")))
    bar = tqdm(total=len(jobs), desc="distill", unit="answer", file=sys.stderr)
    new_tokens, start = 0, time.perf_counter()

    def flush() -> None:
        nonlocal chunk_id, fresh
        if fresh:
            save(cache / f"chunk-{chunk_id:05d}.npz", fresh, meta)
            done.update({(r.job.source, r.job.row): r for r in fresh})
            chunk_id, fresh = chunk_id + 1, []

    try:
        while pending or running:
            while pending and len(running) < in_flight:
                job = pending.pop()
                ids = llm.apply_chat_template(sources[job.source][job.row])
                if len(ids) > max_prompt_tokens:
                    fresh.append(Record(job, len(ids), crc(ids), "skipped", []))
                    bar.update()
                    continue
                params = SamplingParams(temperature=job.temperature, seed=job.seed if job.temperature else None,
                                        max_tokens=max_tokens)
                running.append((job, ids, engine.add_request(ids, params)))
            finished = {u.request_id: u.output for u in engine.step() if u.finished} if running else {}
            still = []
            for job, ids, request_id in running:
                answer = finished.get(request_id)
                if answer is None:
                    still.append((job, ids, request_id))
                    continue
                tokens = list(answer.token_ids)
                fresh.append(Record(job, len(ids), crc(ids), answer.finish_reason, tokens))
                new_tokens += len(tokens)
                bar.update()
                bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - start):.0f}")
            running = still
            if len(fresh) >= flush_every:
                flush()
    finally:
        bar.close()
        for _, _, request_id in running:
            engine.abort(request_id)
        flush()
    save(out, list(done.values()), meta)
    elapsed = time.perf_counter() - start
    return {"answers": len(done), "new_answers": len(jobs), "new_tokens": new_tokens, "seconds": round(elapsed, 1),
            "tokens_per_s": round(new_tokens / max(elapsed, 1e-9), 1),
            "remaining": sum((j.source, j.row) not in done for j in planned), "out": str(out)}


def samples(path: str | Path, data_dir: str | Path, llm: LLM, max_len: int) -> list[tuple[list[int], list[bool]]]:
    """Training samples (prompt + the target's answer, the answer masked in) from a packed file; every
    prompt is re-rendered and checked against its recorded length and CRC32."""
    meta, records = load(Path(path))
    if meta["model"] != model_fingerprint(llm.engine.model):
        raise SpecdecError(f"{path} holds answers of another target (fingerprint {meta['model']}, this target "
                           f"{model_fingerprint(llm.engine.model)}); regenerate it with `specdec distill`")
    sources = read_sources(data_dir)
    out = []
    for r in records:
        if r.finish == "skipped" or not r.tokens:
            continue
        if r.job.source not in sources:
            raise SpecdecError(f"{path} refers to source {r.job.source!r}, not in {data_dir}")
        rows = sources[r.job.source]
        messages = rows[r.job.row] if r.job.row < len(rows) else None
        ids = llm.apply_chat_template(messages) if messages is not None else []
        if len(ids) != r.prompt_len or crc(ids) != r.prompt_crc:
            raise SpecdecError(f"{r.job.source} row {r.job.row} no longer renders to the prompt its answer was "
                               "made for (the data file or the chat template changed); regenerate")
        full = (ids + r.tokens)[:max_len]
        out.append((full, [i >= len(ids) for i in range(len(full))]))
    return out
