"""Sparse-upcycle a dense GGUF (by default the built-in SmolLM2-135M) into a mixture-of-experts GGUF that still writes
the model's text: every layer's MLP becomes `--experts` experts, each a copy of that MLP with a small perturbation
(`--noise` times the matrix's standard deviation, re-quantized in the file's own block format), and a random router
spreads the tokens over them (`--top-k` per token, Mixtral's renormalized weights). Each expert is nearly the MLP and
the top-k weights sum to 1, so the output is nearly the dense model's: the text (and so the acceptance of model-free
drafts and of the shipped head) stays real, while each row routes to its own experts as in a trained mixture, so
verification reads what a mixture reads.

Everything else is copied from the source as it is: its metadata (tokenizer, chat template), attention and
embedding blocks. The layout is llama.cpp's Mixtral (architecture llama with `expert_count`, stacked
`ffn_{gate,up,down}_exps` and an F32 `ffn_gate_inp` router), which specdec and llama.cpp both read.

    python tools/upcycle_moe.py --out /tmp/g/smollm2-moe-8x2.gguf --experts 8 --top-k 2
    python tools/upcycle_moe.py --out /tmp/g/smollm2-moe-64x8.gguf --experts 64 --top-k 8

A Qwen3-MoE layout is not offered: its per-head q/k norms cannot be made the identity, so the text would not stay
the model's.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

from specdec.models.formats.quantizers import quantize
from specdec.models.loader import resolve

_FFN = ("ffn_gate", "ffn_up", "ffn_down")


def _copy_fields(reader: GGUFReader, writer: GGUFWriter) -> None:
    """Every metadata key but the file's own bookkeeping (GGUF.*) and the architecture (the writer's)."""
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        if name == "general.name":
            value = f"{value} (sparse-upcycled)"
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type=sub)


def upcycle(source: Path, out: Path, experts: int, top_k: int, noise: float, router_scale: float,
            seed: int = 0) -> Path:
    """Write the upcycled file; returns `out`."""
    if not 1 <= top_k <= experts:
        raise SystemExit(f"--top-k {top_k} must be between 1 and --experts {experts}")
    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise SystemExit(f"{source} is a GGUF {arch!r} model; upcycling reads a dense llama-architecture file")
    if f"{arch}.expert_count" in reader.fields:
        raise SystemExit(f"{source} is a mixture of experts already")
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(out), arch)
    _copy_fields(reader, writer)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(top_k)
    hidden = int(reader.fields[f"{arch}.embedding_length"].contents())
    for tensor in reader.tensors:
        name = tensor.name
        block, _, kind = name.rpartition(".")[0].rpartition(".") if name.startswith("blk.") else ("", "", "")
        if kind not in _FFN:
            writer.add_tensor(name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
            continue
        qtype = tensor.tensor_type
        dense = dequantize(tensor.data, qtype).reshape(tuple(int(d) for d in reversed(tensor.shape)))  # [out, in]
        scale = noise * float(dense.std())
        stacked = [dense + scale * rng.standard_normal(dense.shape, dtype=np.float32) for _ in range(experts)]
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            data = np.stack(stacked).astype(np.float32 if qtype == GGMLQuantizationType.F32 else np.float16)
            writer.add_tensor(f"{block}.{kind}_exps.weight", data)
        else:
            data = np.stack([quantize(w, qtype) for w in stacked])  # [E, out, row bytes]
            writer.add_tensor(f"{block}.{kind}_exps.weight", data, raw_shape=data.shape, raw_dtype=qtype)
        if kind == "ffn_gate":  # the router: random directions, logits of about router_scale times the input's size
            router = (rng.standard_normal((experts, hidden)) * router_scale / np.sqrt(hidden)).astype(np.float32)
            writer.add_tensor(f"{block}.ffn_gate_inp.weight", router)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a dense llama-architecture GGUF (default: the built-in)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--noise", type=float, default=0.02, help="each expert's perturbation, in the matrix's std")
    ap.add_argument("--router-scale", type=float, default=4.0, help="the router logits' spread")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    source = resolve(args.model).gguf_file
    if source is None:
        raise SystemExit(f"{args.model} is not a GGUF file")
    out = upcycle(source, Path(args.out), args.experts, args.top_k, args.noise, args.router_scale, args.seed)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
