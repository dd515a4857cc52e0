"""Self-distillation data: the training prompts answered by the target itself.

A draft head learns to predict the target, so it should train on the target's own phrasing, not on
human-written answers. `specdec distill` answers the first user turn of every training conversation in the
folder `--data-dir` names (a balanced quota per source file) with the target's own decoding: greedy for most
prompts and seeded sampling at temperature 0.7 for a stated share, because users sample too.

The result is reproducible (a job is a source row, a temperature and a seed, all derived from `--seed`),
resumable (the answers are a directory of chunk files, `chunk-NNNNN.npz`, one flushed every `flush_every`
answers; a restarted run, on this machine or on another one given the directory, answers only what no file
there or in `also` holds) and compact: token ids (uint16, deflated) plus, per answer, where its prompt comes
from, about 0.8 bytes an answer token. Prompts are not stored: they are re-rendered from the source files with
the chat template and checked against a CRC32 of their token ids, so a changed data file or tokenizer is caught
instead of silently misaligning prompts and answers. `pack` writes any set of answers as one file (what the
package ships).

Answering is the engine's continuous batching (`in_flight` requests at once, 16-48 are the fastest on two
CPU cores) over jobs interleaved across the sources, so a run stopped early still covers every source.
Prompts reserved for evaluation (`reserved_turns`: the prompt sets whose first turns must never be trained on)
are never planned.
"""
from __future__ import annotations

import json
import random
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from specdec.config import SamplingParams, SpecdecError
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
def read_sources(data_dirs: str | Path | list[str | Path]) -> dict[str, list[list[dict] | None]]:
    """The prompts of every training file (`*.jsonl` directly in each of `data_dirs`, never `spec_bench/`), by
    file stem (a stem in two folders is refused: answers name their source by it)."""
    sources: dict[str, list[list[dict] | None]] = {}
    for data_dir in [data_dirs] if isinstance(data_dirs, (str, Path)) else data_dirs:
        data_dir = Path(data_dir).expanduser()
        if not data_dir.is_dir():
            raise SpecdecError(f"training data directory {data_dir} does not exist")
        files = sorted(data_dir.glob("*.jsonl"))
        if not files:
            raise SpecdecError(f"{data_dir} holds no *.jsonl training file")
        for p in files:
            if p.stem in sources:
                raise SpecdecError(f"two training files are named {p.stem}.jsonl ({p}): rename one")
            sources[p.stem] = read_prompts(p)
    return dict(sorted(sources.items()))


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


def export_prompts(data_dir: str | Path | list[str | Path], out_dir: str | Path) -> dict:
    """A copy of the training folder holding only what answering reads, the messages before each line's first
    assistant turn, line for line (a line without a prompt stays empty), so that answers made from the copy name
    the same rows: what a device machine needs, in a fraction of the size."""
    out_dir = Path(out_dir).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for name, prompts in read_sources(data_dir).items():
        lines = [json.dumps({"messages": m}, ensure_ascii=False) if m is not None else "" for m in prompts]
        (out_dir / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        sizes[name] = len(prompts)
    return {"out": str(out_dir), "rows": sizes}


def plan(sources: dict[str, list[list[dict] | None]], per_source: int | None, sampled_share: float, seed: int,
         temperature: float = 0.7, reserved: set[str] = frozenset()) -> list[Job]:
    """`per_source` jobs per source (None: every row), rows drawn in a seeded order, so a larger quota extends a
    smaller one, interleaved across sources (the k-th row of every source before any source's (k+1)-th). A job
    is sampled (at `temperature`, with its own seed) with probability `sampled_share`, drawn per row. Rows whose
    first user turn is in `reserved` are never planned."""
    if per_source is not None and per_source < 1:
        raise SpecdecError(f"invalid per-source quota {per_source}: must be >= 1")
    if not 0 <= sampled_share <= 1:
        raise SpecdecError(f"invalid sampled share {sampled_share}: must be in [0, 1]")
    lanes = []
    for name, prompts in sources.items():
        rows = [i for i, p in enumerate(prompts) if p is not None]
        random.Random(f"{seed}:{name}").shuffle(rows)
        lane = []
        for row in rows[:per_source]:
            if first_user_turn(prompts[row]) in reserved:
                continue
            draw = random.Random(f"{seed}:{name}:{row}")
            sampled = draw.random() < sampled_share
            lane.append(Job(name, row, temperature if sampled else 0.0, draw.randrange(2**31)))
        lanes.append(lane)
    return [lane[k] for k in range(max(map(len, lanes), default=0)) for lane in lanes if k < len(lane)]


def first_user_turn(messages: list[dict]) -> str | None:
    return next((m.get("content") for m in messages if m.get("role") == "user"), None)


def reserved_turns(paths: list[str | Path]) -> set[str]:
    """The first turns of prompt sets (`{"turns": [...]}` lines) kept for evaluation."""
    out = set()
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.strip():
                out.add(json.loads(line)["turns"][0])
    return out


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


def answer_files(paths: list[str | Path]) -> list[Path]:
    """The answer files that `paths` name: files as they are, directories by their `*.npz` (sorted)."""
    files = []
    for path in map(lambda p: Path(p).expanduser(), paths):
        if path.is_dir():
            files += sorted(path.glob("*.npz"))
        elif path.is_file():
            files.append(path)
        else:
            raise SpecdecError(f"self-distillation data {path} does not exist (make it with `specdec distill`)")
    return files


def load_all(paths: list[str | Path]) -> tuple[dict, dict[tuple[str, int], Record]]:
    """Every answer the files and directories of `paths` hold, by (source, row), later files winning; with the
    meta all of them share (a target other than the first file's is refused)."""
    meta: dict = {}
    done: dict[tuple[str, int], Record] = {}
    for path in answer_files(paths):
        m, records = load(path)
        if meta and m["model"] != meta["model"]:
            raise SpecdecError(f"{path} holds answers of another target (fingerprint {m['model']}, the others "
                               f"{meta['model']})")
        meta = meta or m
        done.update({(r.job.source, r.job.row): r for r in records})
    return meta, done


def pack(paths: list[str | Path], out: str | Path) -> dict:
    """All answers of `paths` as one file (e.g. what the package ships)."""
    meta, done = load_all(paths)
    if not done:
        raise SpecdecError(f"no answers in {[str(p) for p in paths]}")
    meta = {k: v for k, v in meta.items() if k not in ("format", "sources")}
    save(Path(out).expanduser(), list(done.values()), meta)
    return {"answers": len(done), "answer_tokens": sum(len(r.tokens) for r in done.values()), "out": str(out)}


# ---------------------------------------------------------------------------------------------- running
SETTINGS = ("model", "max_tokens", "max_prompt_tokens", "seed")  # what answers made together must share


def regenerate(llm: LLM, data_dir: str | Path | list[str | Path], out: str | Path, *, per_source: int | None = 1000,
               sampled_share: float = 0.25, max_tokens: int = 256, max_prompt_tokens: int = 1536, seed: int = 0,
               also: list[str | Path] = (), reserved: set[str] = frozenset(), flush_every: int = 1000,
               in_flight: int = 32, limit: int | None = None) -> dict:
    """Answer every planned job that no file in the directory `out` nor in `also` holds, flushing a chunk to
    `out` every `flush_every` answers (and when stopped). `limit` stops after that many new answers (the rest
    waits for the next run). Answers made with other settings (`SETTINGS`) are refused, not mixed."""
    sources = read_sources(data_dir)
    out = Path(out).expanduser()
    if out.is_file():
        raise SpecdecError(f"--out {out} is a file: answers go to a directory (chunk files); `--pack FILE` writes "
                           "them as one file")
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": llm.fingerprint, "max_tokens": max_tokens,
            "max_prompt_tokens": max_prompt_tokens, "seed": seed}
    done: dict[tuple[str, int], Record] = {}
    for path in answer_files([*also, out]):
        old_meta, records = load(path)
        mismatch = {k: (old_meta.get(k), meta[k]) for k in SETTINGS if old_meta.get(k) != meta[k]}
        if mismatch and not old_meta.get("imported"):
            raise SpecdecError(f"{path} was made with other settings ({mismatch}, as (there, here)); "
                               "use another --out, or the same settings")
        if old_meta.get("imported") and old_meta["model"] != meta["model"]:
            raise SpecdecError(f"{path} holds answers of another target ({old_meta['model']}, here {meta['model']})")
        done.update({(r.job.source, r.job.row): r for r in records})
    planned = plan(sources, per_source, sampled_share, seed, reserved=reserved)
    jobs = [j for j in planned if (j.source, j.row) not in done]
    if limit is not None:
        jobs = jobs[:limit]
    fresh: list[Record] = []
    submitted: list[tuple[Job, list[int]]] = []  # by the index `as_completed` gives back
    chunk_id = 1 + max((int(p.stem.split("-")[1]) for p in out.glob("chunk-*.npz")), default=-1)
    bar = tqdm(total=len(jobs), desc="distill", unit="answer", file=sys.stderr)
    new_tokens, start = 0, time.perf_counter()

    def flush() -> None:
        nonlocal chunk_id, fresh
        if fresh:
            save(out / f"chunk-{chunk_id:05d}.npz", fresh, meta)
            done.update({(r.job.source, r.job.row): r for r in fresh})
            chunk_id, fresh = chunk_id + 1, []

    def requests() -> Iterator[tuple[list[int], SamplingParams]]:  # rendered as the engine takes them
        for job in jobs:
            ids = llm.apply_chat_template(sources[job.source][job.row])
            if len(ids) > max_prompt_tokens:
                fresh.append(Record(job, len(ids), crc(ids), "skipped", []))
                bar.update()
                continue
            submitted.append((job, ids))
            yield ids, SamplingParams(temperature=job.temperature, seed=job.seed if job.temperature else None,
                                      max_tokens=max_tokens)

    try:
        for index, answer in llm.as_completed(requests(), in_flight):
            job, ids = submitted[index]
            tokens = list(answer.token_ids)
            fresh.append(Record(job, len(ids), crc(ids), answer.finish_reason, tokens))
            new_tokens += len(tokens)
            bar.update()
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - start):.0f}")
            if len(fresh) >= flush_every:
                flush()
    finally:
        bar.close()
        flush()
    elapsed = time.perf_counter() - start
    return {"answers": len(done), "answer_tokens": sum(len(r.tokens) for r in done.values()),
            "new_answers": len(jobs), "new_tokens": new_tokens, "seconds": round(elapsed, 1),
            "tokens_per_s": round(new_tokens / max(elapsed, 1e-9), 1),
            "remaining": sum((j.source, j.row) not in done for j in planned), "out": str(out)}


def samples(paths: str | Path | list[str | Path], data_dir: str | Path | list[str | Path], llm: LLM, max_len: int
            ) -> list[tuple[list[int], list[bool]]]:
    """Training samples (prompt + the target's answer, the answer masked in) from answer files or directories
    (in (source, row) order); every prompt is re-rendered and checked against its recorded length and CRC32."""
    return [(ids, mask) for _, ids, mask in keyed_samples(paths, data_dir, llm, max_len)]


def keyed_samples(paths: str | Path | list[str | Path], data_dir: str | Path | list[str | Path], llm: LLM,
                  max_len: int
                  ) -> list[tuple[tuple[str, int], list[int], list[bool]]]:
    """`samples`, each with its prompt's key (source, row)."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    meta, done = load_all(paths)
    if done and meta["model"] != llm.fingerprint:
        raise SpecdecError(f"{paths[0]} holds answers of another target (fingerprint {meta['model']}, this target "
                           f"{llm.fingerprint}); regenerate it with `specdec distill`")
    sources = read_sources(data_dir)
    out = []
    for key in sorted(done):
        r = done[key]
        if r.finish == "skipped" or not r.tokens:
            continue
        if r.job.source not in sources:
            raise SpecdecError(f"answers of source {r.job.source!r} in {paths}: no such file in {data_dir}")
        rows = sources[r.job.source]
        messages = rows[r.job.row] if r.job.row < len(rows) else None
        ids = llm.apply_chat_template(messages) if messages is not None else []
        if len(ids) != r.prompt_len or crc(ids) != r.prompt_crc:
            raise SpecdecError(f"{r.job.source} row {r.job.row} no longer renders to the prompt its answer was "
                               "made for (the data file or the chat template changed); regenerate")
        full = (ids + r.tokens)[:max_len]
        out.append((key, full, [i >= len(ids) for i in range(len(full))]))
    return out
