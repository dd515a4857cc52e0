"""Time the native matmul kernels per GGUF format: one matrix of random weights quantized to each format, 1-16
activation rows, through the interleaved 8-row records (what the engine runs) and through the row-at-a-time
loop (what the rows left after the groups of 8 run, and every row before the interleaved records). Prints the
time of one row, its weight bytes per second, and what 8 and 16 rows cost against one (the price of verifying
k drafts, for this matrix alone).

    python tools/kernel_bench.py --rows 8192 --cols 2048            # every format
    python tools/kernel_bench.py --formats q4_k,q6_k --cols 8192

A matrix smaller than the last-level cache is read from cache, not memory: use wide ones (or several) to see
memory-bound rates.
"""
from __future__ import annotations

import argparse
import time

import torch

from specdec.models.cpu import native
from specdec.models.formats.quant import FORMATS, QuantWeight

ROW_COUNTS = (1, 2, 4, 8, 16)


def seconds_per_call(fn, budget: float) -> float:
    fn()
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < budget:
        fn()
        n += 1
    return (time.perf_counter() - start) / n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192, help="output features N (default 8192)")
    ap.add_argument("--cols", type=int, default=2048, help="input features K, a multiple of 256 (default 2048)")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated (default: every format)")
    ap.add_argument("--seconds", type=float, default=0.4, help="time per measurement (default 0.4)")
    args = ap.parse_args(argv)
    ops = native.ops()
    torch.manual_seed(0)
    weight = torch.randn(args.rows, args.cols) * 0.02
    print(f"[{args.rows} x {args.cols}] threads {torch.get_num_threads()}, kernels {ops.isa()}")
    print("format  MB     | interleaved: 1 row ms  GB/s   8/1   16/1 | row loop: 1 row ms  8/1 "
          "| interleaved speedup 1, 8")
    for name in args.formats.split(","):
        w = QuantWeight.quantize(weight, name)
        data, ids = [d for d, _ in w.parts], [f.kernel_id for _, f in w.parts]
        t = {}
        for interleave in (True, False):
            matrix = ops.QMatrix(data, ids, args.cols, interleave=interleave)
            xs = {m: torch.randn(m, args.cols) for m in ROW_COUNTS}
            t[interleave] = {m: seconds_per_call(lambda m=m, xs=xs, matrix=matrix: ops.linear(xs[m], matrix),
                                                 args.seconds) for m in ROW_COUNTS}
        x8, loop = t[True], t[False]
        print(f"{name:7s} {w.nbytes / 1e6:6.3g} | {x8[1] * 1e3:20.4g} {w.nbytes / x8[1] / 1e9:6.3g} "
              f"{x8[8] / x8[1]:5.2f} "
              f"{x8[16] / x8[1]:6.2f} | {loop[1] * 1e3:17.4g} {loop[8] / loop[1]:4.2f} | "
              f"{loop[1] / x8[1]:4.2f} {loop[8] / x8[8]:4.2f}")


if __name__ == "__main__":
    main()
