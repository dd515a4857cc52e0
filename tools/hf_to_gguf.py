"""Write a Hugging Face model directory of any family specdec runs as a GGUF in llama.cpp's layout: its architecture
name, metadata keys and tensor names (Phi-3's fused attn_qkv and gate-up ffn_up, a mixture's experts stacked in one
[E, out, in] tensor per projection, Q and K rows interleaved for the llama architecture, Gemma's norms with their 1
folded in), and a tokenizer (the directory's byte-level BPE as llama.cpp's gpt2 vocabulary), in F32, F16 or a block
type (numpy quantizers, ggml's reference algorithms).

What the tests use to check each family's GGUF path against its Hugging Face path on the same weights, and what
`tools/compare_llamacpp.py` hands llama.cpp. Its layout is read back from specdec's own loader table
(`specdec.models.formats.gguf._expected_tensors`), so it is no independent check of that table: comparing its files with
those of llama.cpp's own converter is (`--check-against FILE`, names, shapes and keys).

    python tools/hf_to_gguf.py MODEL_DIR OUT.gguf --type Q8_0
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from specdec.models.families import family_of, load_config
from specdec.models.formats import gguf as specdec_gguf
from specdec.models.formats.quantizers import quantize
from specdec.models.loader import _load_safetensors

ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
        "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3", "phi3": "phi3", "qwen2_moe": "qwen2moe",
        "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2",
        "gpt_oss": "gpt-oss"}
TYPES = {"F32": GGMLQuantizationType.F32, "F16": GGMLQuantizationType.F16, "Q8_0": GGMLQuantizationType.Q8_0,
         "Q4_0": GGMLQuantizationType.Q4_0, "Q5_0": GGMLQuantizationType.Q5_0, "Q4_K": GGMLQuantizationType.Q4_K,
         "Q6_K": GGMLQuantizationType.Q6_K}


def add_shape_keys(writer: GGUFWriter, context: int, hidden: int, layers: int, ff: int, heads: int, kv_heads: int,
                   rotary_dims: int, rope_theta: float, eps: float) -> None:
    """The decoder's shape under llama.cpp's keys (every architecture's common ones)."""
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(rotary_dims)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(eps)


def add_family_keys(w: GGUFWriter, arch: str, hf: dict, cfg) -> None:
    """A decoder's shape and its family's options under llama.cpp's keys for `arch` (where llama.cpp has none: the
    window pattern as a list, Gemma's query scale where its rule would not give it, OLMoE's clamp)."""
    mtp = int(hf.get("num_nextn_predict_layers") or 0)  # MTP layers count in block_count (llama.cpp's nextn)
    add_shape_keys(w, cfg.max_position_embeddings, cfg.hidden_size, cfg.num_hidden_layers + mtp,
                   cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rotary_dim,
                   cfg.rope_theta, cfg.rms_norm_eps)
    if mtp:
        w.add_uint32(f"{arch}.nextn_predict_layers", mtp)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.kv_lora_rank or cfg.head_dim)  # latent attention: its values are the latent
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        w.add_string(f"{arch}.rope.scaling.type", "linear")
        w.add_float32(f"{arch}.rope.scaling.factor", float(scaling["factor"]))
    if kind == "yarn":
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", float(scaling["factor"]))
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", scaling["original_max_position_embeddings"])
        for key, name in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if scaling.get(key) is not None:
                w.add_float32(f"{arch}.rope.scaling.{name}", float(scaling[key]))
    if cfg.clip_qkv is not None:
        w.add_clamp_kqv(cfg.clip_qkv)
    if cfg.moe_layers:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_uint32(f"{arch}.expert_feed_forward_length", cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size and arch != "deepseek2":
            w.add_uint32(f"{arch}.expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size)
    if arch == "deepseek2":
        _deepseek_keys(w, hf, cfg)
    if arch == "gpt-oss" and cfg.swiglu_limit != 7.0:  # llama.cpp's gpt-oss assumes 7; its per-layer clamp key
        w.add_array(f"{arch}.swiglu_clamp_exp", [float(cfg.swiglu_limit)] * cfg.num_hidden_layers)
    if cfg.sliding_window and arch != "phi3":  # the layers that slide, as a list (llama.cpp's per-layer form)
        w.add_sliding_window(cfg.sliding_window)
        sliding = [t == "sliding_attention" for t in cfg.layer_types]
        if arch != "gpt-oss" or sliding != [i % 2 == 0 for i in range(len(sliding))]:  # gpt-oss: llama.cpp's rule
            w.add_array(f"{arch}.attention.sliding_window_pattern", sliding)
    if arch in ("gemma2", "gemma3"):
        big = cfg.num_hidden_layers == (62 if arch == "gemma3" else 46)  # llama.cpp's rule for the query scale
        if cfg.attn_scale != (cfg.hidden_size // cfg.num_attention_heads if big else cfg.head_dim) ** -0.5:
            w.add_float32(f"{arch}.attention.scale", cfg.attn_scale)  # a scale the rule would not give
        if cfg.attn_softcap:
            w.add_float32(f"{arch}.attn_logit_softcapping", cfg.attn_softcap)
        if cfg.final_softcap:
            w.add_float32(f"{arch}.final_logit_softcapping", cfg.final_softcap)
        if cfg.rope_local_theta is not None:
            w.add_float32(f"{arch}.rope.freq_base_swa", cfg.rope_local_theta)
    if arch == "phi3":
        w.add_sliding_window(cfg.sliding_window or 0)
        if kind in ("longrope", "su"):
            original = scaling["original_max_position_embeddings"]
            w.add_uint32(f"{arch}.rope.scaling.original_context_length", original)
            scale = cfg.max_position_embeddings / original
            attn = scaling.get("attention_factor") or (
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
            w.add_float32(f"{arch}.rope.scaling.attn_factor", attn)


def _deepseek_keys(w: GGUFWriter, hf: dict, cfg) -> None:
    """llama.cpp's deepseek2 keys: latent ranks and the per-head widths (*_mla), leading dense layers, shared
    experts by count, the router's gating, scale, norm and groups, and YaRN with DeepSeek's log multiplier."""
    a = "deepseek2"
    w.add_uint32(f"{a}.attention.kv_lora_rank", cfg.kv_lora_rank)
    # 0 for none: llama.cpp reads the key at any depth but the Lite ones (26 or 27 layers), where it assumes none
    w.add_uint32(f"{a}.attention.q_lora_rank", cfg.q_lora_rank)
    w.add_uint32(f"{a}.attention.key_length_mla", cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_uint32(f"{a}.attention.value_length_mla", cfg.v_head_dim)
    w.add_uint32(f"{a}.leading_dense_block_count", min(cfg.moe_layers, default=cfg.num_hidden_layers))
    if cfg.moe_layers:
        w.add_uint32(f"{a}.expert_shared_count", cfg.shared_expert_intermediate_size // cfg.moe_intermediate_size)
        w.add_float32(f"{a}.expert_weights_scale", cfg.routed_scaling_factor)
        if cfg.norm_topk_prob:
            w.add_bool(f"{a}.expert_weights_norm", True)
        w.add_uint32(f"{a}.expert_gating_func", 2 if cfg.moe_scoring == "sigmoid" else 1)
        if cfg.moe_groups > 1:
            w.add_uint32(f"{a}.expert_group_count", cfg.moe_groups)
            w.add_uint32(f"{a}.expert_group_used_count", cfg.moe_topk_groups)
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "yarn" and scaling.get("mscale_all_dim"):
        w.add_float32(f"{a}.rope.scaling.yarn_log_multiplier", 0.1 * float(scaling["mscale_all_dim"]))


def _tokenizer(w: GGUFWriter, model_dir: Path, vocab_size: int, hf: dict) -> None:
    """The directory's byte-level BPE as llama.cpp's gpt2 vocabulary, padded to the model's vocabulary size."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [5] * vocab_size  # unused
    special = {a["content"] for a in tok.get("added_tokens", []) if a.get("special")}
    for text, i in vocab.items():
        if i < vocab_size:
            tokens[i], types[i] = text, 3 if text in special else 1
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id")):
        if isinstance(hf.get(key), int):
            getattr(w, f"add_{name}_token_id")(hf[key])


def _permute_qk(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permute() for the llama architecture: per head, rows [half, 2] -> [2, half] (interleaved)."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, 2, half, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _encode(name: str, data: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType]:
    """Norms, biases, routers and rope factors stay F32 (as llama.cpp writes them); matrices take `qtype` where their
    rows hold whole blocks, else F32."""
    if data.ndim < 2 or "ffn_gate_inp" in name or qtype == GGMLQuantizationType.F32:
        return data.astype(np.float32), GGMLQuantizationType.F32
    if qtype == GGMLQuantizationType.F16:
        return data.astype(np.float16), qtype
    from gguf.constants import GGML_QUANT_SIZES

    if data.shape[-1] % GGML_QUANT_SIZES[qtype][0]:
        return data.astype(np.float32), GGMLQuantizationType.F32
    return quantize(data.reshape(-1, data.shape[-1]).astype(np.float32), qtype).reshape(
        *data.shape[:-1], -1), qtype


def write(model_dir: str | Path, out: str | Path, file_type: str = "F32") -> Path:
    """Write `model_dir` as a GGUF at `out` with matrices in `file_type`; returns `out`."""
    model_dir, out = Path(model_dir), Path(out)
    hf = json.loads((model_dir / "config.json").read_text())
    family = family_of(hf)
    cfg = load_config(hf)
    arch = ARCH[cfg.model_type]
    state = {k: v.float().numpy() for k, v in family.state(_load_safetensors(model_dir), hf).items()}
    fused = {f"blk.{i}.attn_qkv.weight" for i in range(cfg.num_hidden_layers)} if arch == "phi3" else set()
    expected = specdec_gguf._expected_tensors(cfg, fused)
    w = GGUFWriter(str(out), arch)
    w.add_name(model_dir.name)
    add_family_keys(w, arch, hf, cfg)
    _tokenizer(w, model_dir, cfg.vocab_size, hf)
    qtype = TYPES[file_type]
    if arch == "phi3" and (cfg.rope_scaling or {}).get("rope_type") in ("longrope", "su"):
        for k in ("long", "short"):
            w.add_tensor(f"rope_factors_{k}.weight", np.asarray(cfg.rope_scaling[f"{k}_factor"], dtype=np.float32))
    expected |= mtp_tensors(hf, cfg, fused, state)
    for name, (parts, shape) in expected.items():
        if any(hf_name not in state for hf_name, _ in parts):
            continue  # a tied checkpoint's lm_head
        data = np.concatenate([state.pop(hf_name).reshape(part) for hf_name, part in parts]).reshape(shape)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            data = _permute_qk(data, cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads)
        data, t = _encode(name, data, qtype)
        w.add_tensor(name, data, raw_dtype=t if t not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
                     else None)
    state.pop("lm_head.weight", None)
    if state:
        raise ValueError(f"tensors with no GGUF name: {sorted(state)[:3]}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


_NEXTN = {"eh_proj": "eh_proj", "enorm": "enorm", "hnorm": "hnorm", "shared_head.norm": "shared_head_norm",
          "shared_head.head": "shared_head_head", "embed_tokens": "embed_tokens"}


def mtp_tensors(hf: dict, cfg, fused: set[str], state: dict) -> dict:
    """The MTP layers a checkpoint carries after its main ones (`num_nextn_predict_layers`, DeepSeek-V3's layout), as
    llama.cpp's nextn blocks: each a decoder layer of the model's kind under blk.{N + i}. names, and its nextn.*
    tensors (eh_proj, enorm, hnorm, the shared head's norm and, where the checkpoint has them, its own LM head and
    embedding)."""
    n, main = int(hf.get("num_nextn_predict_layers") or 0), cfg.num_hidden_layers
    if not n:
        return {}
    grown = dataclasses.replace(cfg, num_hidden_layers=main + n, layer_types=None,
                                moe_layers=(*cfg.moe_layers, *range(main, main + n)) if cfg.moe_layers else ())
    out = {k: v for k, v in specdec_gguf._expected_tensors(grown, fused).items()
           if k.startswith(tuple(f"blk.{main + i}." for i in range(n)))}
    for i in range(main, main + n):
        for theirs, ours in _NEXTN.items():
            if f"model.layers.{i}.{theirs}.weight" in state:
                shape = tuple(state[f"model.layers.{i}.{theirs}.weight"].shape)
                out[f"blk.{i}.nextn.{ours}.weight"] = ([(f"model.layers.{i}.{theirs}.weight", shape)], shape)
    return out


def check_against(ours: Path, theirs: Path) -> list[str]:
    """How our file differs from another converter's (llama.cpp's): tensor names, shapes, and the architecture's
    metadata keys with their values (general.* and tokenizer.* aside). Empty when they agree."""
    a, b = GGUFReader(ours), GGUFReader(theirs)
    diffs = []
    shapes = [{t.name: tuple(int(d) for d in t.shape) for t in r.tensors} for r in (a, b)]
    for name in sorted(set(shapes[0]) | set(shapes[1])):
        if shapes[0].get(name) != shapes[1].get(name):
            diffs.append(f"tensor {name}: ours {shapes[0].get(name)}, theirs {shapes[1].get(name)}")
    keys = [{f.name: f.contents() for f in r.fields.values() if not f.name.startswith(("general.", "tokenizer."))
             and not f.name.startswith("GGUF.")} for r in (a, b)]
    for key in sorted(set(keys[0]) | set(keys[1])):
        x, y = keys[0].get(key), keys[1].get(key)
        same = x == y or (isinstance(x, float) and isinstance(y, float) and abs(x - y) <= 1e-6 * max(1, abs(y)))
        if not same:
            diffs.append(f"key {key}: ours {x!r}, theirs {y!r}")
    return diffs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--type", default="F32", choices=sorted(TYPES))
    ap.add_argument("--check-against", help="another converter's GGUF of the same directory: print how they differ")
    args = ap.parse_args(argv)
    with torch.no_grad():
        path = write(args.model_dir, args.out, args.type)
    print(f"wrote {path}")
    if args.check_against:
        diffs = check_against(path, Path(args.check_against))
        print("\n".join(diffs) or "same tensors, shapes and keys")


if __name__ == "__main__":
    main()
