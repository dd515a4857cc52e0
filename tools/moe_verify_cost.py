"""What verifying n rows costs on a mixture-of-experts model, against the bytes those rows must read.

One sequence of --context committed tokens, then a forward of n new rows (distinct seeded token ids, as a draft's
are) and their logits, for each n: the median time over --repeats, interleaved by n. The bound for n rows is the
bytes they read at the read bandwidth measured beside them: every non-expert weight once, the LM head once, and in
each sparse layer the union of the experts the n rows route to (counted on the same rows by the Python layer,
`models.moe.MoE.route`), each expert's bytes once. Consecutive draft rows share experts, so k rows read far fewer than
k times one row's experts.

A second floor is the arithmetic: each row multiplies every non-expert matrix, its top-k experts and the LM head,
and the machine does at most so many multiply-adds a second. The tool measures that rate on the model's own LM head
at 32 rows (the kernels' best case: many rows per read weight) and reports time against the larger of the two
floors too. Where the compute floor is the larger, the byte bound cannot be reached on this machine whatever the
expert grouping does.

    python tools/moe_verify_cost.py /tmp/g/q3moe-4l-q4km.gguf --rows 1,2,3,5,9 --context 256
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.bench.machine import measure_bandwidth
from specdec.config import SamplingParams
from specdec.engine.model_runner import ModelRunner
from specdec.engine.sequence import Sequence
from specdec.kv_cache import BlockAllocator, KVPool
from specdec.models.blocks.moe import MoE
from specdec.models.loader import load_model


def expert_bytes(moe: MoE) -> float:
    """The mean bytes of one expert's matrices."""
    return sum(m.weight.nbytes for m in (*moe.gate_up, *moe.down)) / len(moe.gate_up)


def matrix_elements(model) -> tuple[int, list[int]]:
    """Multiply-adds one row costs outside the experts (every decoder matrix and the LM head), and one expert's per
    sparse layer (its gate/up and down, the mean over the layer's experts)."""
    experts = {id(lin) for layer in model.layers if layer.moe is not None
               for lin in (*layer.moe.gate_up, *layer.moe.down)}
    base = sum(lin.weight.shape[0] * lin.weight.shape[1] for layer in model.layers for lin in layer.linears
               if id(lin) not in experts)
    lm = model.lm_head
    base += lm.shape[0] * lm.shape[1]
    per_expert = [sum(lin.weight.shape[0] * lin.weight.shape[1] for lin in (*moe.gate_up, *moe.down))
                  // len(moe.gate_up) for moe in (layer.moe for layer in model.layers if layer.moe is not None)]
    return base, per_expert


def mac_rate(model, rows: int = 32, repeats: int = 5) -> float:
    """Multiply-adds a second of the native GEMM on the model's LM head with `rows` rows (median of `repeats`)."""
    lm = model.lm_head
    x = torch.randn(rows, lm.shape[1])
    linear = lm.linear if hasattr(lm, "linear") else (lambda v: v @ lm.T)
    linear(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        linear(x)
        times.append(time.perf_counter() - start)
    return rows * lm.shape[0] * lm.shape[1] / statistics.median(times)


def union_sizes(model, runner: ModelRunner, seq: Sequence, rows: list[int]) -> list[int]:
    """The number of distinct experts the rows route to, per sparse layer (the Python layers' routing)."""
    seen: list[set[int]] = []
    route = MoE.route

    def recording(self: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        experts, weights = route(self, x)
        seen.append(set(experts.reshape(-1).tolist()))
        return experts, weights

    stack = model._stack
    model._stack = False  # layer by layer; the sparse ones in Python, which routes there
    sparse = [layer for layer in model.layers if layer.moe is not None]
    for layer in sparse:
        layer.native_layer = lambda: None
    MoE.route = recording
    try:
        runner.run([seq.block_table.blocks], [seq.num_cached], [rows])
    finally:
        MoE.route, model._stack = route, stack
        for layer in sparse:
            del layer.native_layer
    return [len(s) for s in seen]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rows", default="1,2,3,5,9")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    rows = [int(n) for n in args.rows.split(",")]
    model, _ = load_model(args.model, dtype="auto")
    sparse = [layer.moe for layer in model.layers if layer.moe is not None]
    if not sparse:
        raise SystemExit(f"{args.model} has no mixture-of-experts layer")
    block = 16
    blocks = (args.context + max(rows)) // block + 2
    runner = ModelRunner(model, KVPool(model.kv_config, blocks + 1, block, model.kv_dtype, "cpu"), block)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    seq = Sequence(0, torch.randint(0, vocab, (args.context,), generator=g).tolist(), SamplingParams(), 1 << 20)
    BlockAllocator(blocks + 1, block).allocate(seq.block_table, args.context + max(rows))
    runner.run([seq.block_table.blocks], [0], [seq.token_ids])  # the prefill
    seq.num_cached = args.context
    feeds = {n: torch.randint(0, vocab, (n,), generator=g).tolist() for n in rows}
    unions = {n: union_sizes(model, runner, seq, feeds[n]) for n in rows}
    def step(n: int) -> float:
        start = time.perf_counter()
        runner.run_logits([seq.block_table.blocks], [seq.num_cached], [feeds[n]], None, (), list(range(n)))
        return time.perf_counter() - start

    for n in rows:  # each shape once untimed (first-touch of its buffers)
        step(n)
    bandwidth = [measure_bandwidth(torch.device("cpu"))["read_bytes_per_s"]]
    times: dict[int, list[float]] = {n: [] for n in rows}
    for _ in range(args.repeats):
        for n in rows:
            times[n].append(step(n))
    bandwidth.append(measure_bandwidth(torch.device("cpu"))["read_bytes_per_s"])
    read = statistics.mean(bandwidth)  # sampled before and after the timed steps
    rate = mac_rate(model)
    base_macs, expert_macs = matrix_elements(model)
    per_expert = [expert_bytes(moe) for moe in sparse]
    base = model.weight_bytes_per_token() - sum(moe.top_k * b for moe, b in zip(sparse, per_expert))
    t1 = statistics.median(times[rows[0]])
    print(f"read bandwidth {read / 1e9:.1f} GB/s; GEMM {rate / 1e9:.0f} G multiply-adds/s (LM head, 32 rows); "
          f"{len(sparse)} sparse layers, top {sparse[0].top_k} of {len(sparse[0].gate_up)} experts; "
          f"context {args.context}")
    print("| rows | ms | x first | experts read per layer | MB read | bound ms | time / bound "
          "| compute floor ms | time / max(bound, floor) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in rows:
        t = statistics.median(times[n])
        nbytes = base + sum(u * b for u, b in zip(unions[n], per_expert))
        bound = nbytes / read
        floor = n * (base_macs + sum(sparse[i].top_k * m for i, m in enumerate(expert_macs))) / rate
        print(f"| {n} | {t * 1e3:.2f} | {t / t1:.2f} | {statistics.mean(unions[n]):.1f} | {nbytes / 1e6:.1f} | "
              f"{bound * 1e3:.2f} | {t / bound:.2f} | {floor * 1e3:.2f} | {t / max(bound, floor):.2f} |")


if __name__ == "__main__":
    main()
