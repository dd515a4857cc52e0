"""`BenchConfig` and `TuneConfig`: every option of `specdec bench` and `specdec tune`, typed, with the commands'
defaults.

The command line builds one from its flags (`specdec.cli`, where the comma-separated lists are parsed by the
functions below); a library caller builds one directly:

    run_bench(BenchConfig(model="/models/m.gguf", num_prompts=20, batch_sizes=(1, 4, 16), out="b.json"))

A config checks its own values when made, before any model loads; errors name the command-line flag, so both
callers read the same message. Which kind of run (`--serve`, `--soak`, ...) is the caller's choice of function,
not a field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from specdec.config import SpecdecError
from specdec.llm import parse_dtype
from specdec.models.loader import DEFAULT_MODEL

AT_LEAST_ONE = ("num_prompts", "max_tokens", "num_requests", "soak_concurrency")


def parse_counts(text: str, flag: str, example: str, least: int = 1) -> tuple[int, ...]:
    """'1,4,16' -> (1, 4, 16), sorted and without repeats; every count at least `least`."""
    try:
        counts = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < least:
        kind = "positive" if least == 1 else "non-negative"
        raise SpecdecError(f"invalid {flag} {text!r}: expected comma-separated {kind} integers, e.g. {example}")
    return tuple(counts)


def parse_dtypes(text: str) -> tuple[str, ...]:
    names = [d.strip() for d in text.split(",") if d.strip()]
    if not names:
        raise SpecdecError(f"invalid --dtypes {text!r}: expected comma-separated dtypes, e.g. float32,bfloat16")
    for name in names:
        parse_dtype(name)  # raises with the valid names listed
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What every measuring command shares: the model, its drafting, and the prompt set."""
    model: str = DEFAULT_MODEL  # alias, HF directory or .gguf file
    dtype: str = "auto"  # auto: a GGUF computes on its own blocks, a Hugging Face model in float32
    quantization: str | None = None  # a block format to quantize float weights into on load
    device: str | None = None  # cpu | cuda (None: $SPECDEC_DEVICE, else cpu)
    speculative_config: str | dict | list | None = None  # JSON or parsed; "off"; None: the model's default
    prompts: str | None = None  # JSONL with 'turns' (None: the command's shipped set)
    num_prompts: int = 8  # taken round-robin across categories
    max_tokens: int = 128  # tokens per prompt
    batch_sizes: tuple[int, ...] = (1,)
    out: str = "bench_results/bench.json"  # where the JSON results go

    def __post_init__(self) -> None:
        for name in AT_LEAST_ONE:
            if getattr(self, name, 1) < 1:
                raise SpecdecError(f"invalid --{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise SpecdecError(f"invalid --batch-sizes {self.batch_sizes}: expected positive integers, e.g. 1,4,16")

    def speculative_dict(self, default: dict) -> dict:
        """The speculative config as a dict (`default` where none was given)."""
        spec = self.speculative_config
        if spec is None:
            return default
        try:
            spec = json.loads(spec) if isinstance(spec, str) else spec
        except json.JSONDecodeError as e:
            raise SpecdecError(f"--speculative-config is not JSON ({e.msg}): {spec!r}") from None
        if not isinstance(spec, dict):
            raise SpecdecError(f"--speculative-config must be one config (a JSON object) here, not {spec!r}")
        return spec


@dataclass(frozen=True, kw_only=True)
class BenchConfig(RunConfig):
    dtypes: tuple[str, ...] | None = None  # dtypes compared side by side (None: `dtype` alone)
    compare_hf: bool = False  # also time transformers' generate, interleaved
    compare_llamacpp: bool = False  # also time llama.cpp (llama-cpp-python) on the same GGUF, interleaved
    threads: int | None = None  # torch intra-op threads (None: torch's choice)
    temperature: float = 0.0  # 0: greedy; above 0 every prompt samples with a fixed seed
    # --serve
    concurrency: tuple[int, ...] = (1, 4, 16, 64)  # concurrent clients per level
    requests_per_level: int | None = None  # None: 2x the concurrency, at least num_prompts at 1
    replicas: tuple[int, ...] | None = None  # compare Ray Serve replica counts instead (0: no Ray)
    llama_server: str | None = None  # llama.cpp's llama-server binary: its serving, or its speculative modes
    llamacpp_draft: str | None = None  # a draft GGUF for llama-server's draft-model mode
    # --soak
    num_requests: int = 1000
    soak_concurrency: int = 16
    soak_seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.threads is not None and self.threads < 1:
            raise SpecdecError(f"invalid --threads {self.threads}: must be >= 1")
        if self.temperature < 0:
            raise SpecdecError(f"invalid --temperature {self.temperature}: must be >= 0")
        if not self.concurrency or min(self.concurrency) < 1:
            raise SpecdecError(f"invalid --concurrency {self.concurrency}: expected positive integers, e.g. 1,4,16")
        if self.replicas is not None and (len(self.replicas) < 2 or min(self.replicas) < 0):
            raise SpecdecError(f"invalid --replicas {self.replicas}: give two or more counts, e.g. 1,2 (0: no Ray)")
        if self.requests_per_level is not None and self.requests_per_level < 1:
            raise SpecdecError(f"invalid --requests-per-level {self.requests_per_level}: must be >= 1")
        if self.llamacpp_draft and not self.llama_server:
            raise SpecdecError("--llamacpp-draft is a draft model for llama-server: pass --llama-server PATH too")


@dataclass(frozen=True, kw_only=True)
class TuneConfig(RunConfig):
    max_tokens: int = 64
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    out: str = "tune.json"
    write_default: bool = False  # write the fastest config as the model's default
