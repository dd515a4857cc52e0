"""Peak resident memory of loading a model and decoding a few tokens, as /proc/self/status reports it (Linux).

    python tools/peak_memory.py MODEL [--max-tokens 16]

Prints VmHWM (the peak), VmRSS, RssAnon (our own memory) and RssFile (pages of mapped files) after loading and
after decoding, and the peak over the file's size (the goal in docs/benchmarks.md: at most the file plus 1.5 GB).
"""
from __future__ import annotations

import argparse
import os
import time


def status() -> dict[str, float]:
    """GB of each memory figure of this process."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 / 1e9 for k in ("VmHWM", "VmRSS", "RssAnon", "RssFile")}


def show(tag: str) -> dict[str, float]:
    s = status()
    print(f"{tag:>10}: " + "  ".join(f"{k} {v:.2f} GB" for k, v in s.items()), flush=True)
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    from specdec import LLM, SamplingParams

    show("imported")
    t = time.perf_counter()
    llm = LLM(args.model, speculative_config="off")
    show(f"loaded {time.perf_counter() - t:.0f}s")
    llm.generate(["Hello there, how are you today? " * 4], SamplingParams(max_tokens=args.max_tokens, temperature=0))
    peak = show("decoded")["VmHWM"]
    if os.path.isfile(args.model):
        size = os.path.getsize(args.model) / 1e9
        print(f"file {size:.2f} GB, peak {peak:.2f} GB = file + {peak - size:.2f} GB")


if __name__ == "__main__":
    main()
