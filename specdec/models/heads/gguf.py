"""Draft heads in GGUF, as llama.cpp defines them (read from the llama.cpp that llama-cpp-python 0.3.36 vendors:
`src/models/eagle3.cpp`, `conversion/llama.py`): its EAGLE-3 heads (`general.architecture` "eagle3") read and
written, and the MTP (`nextn`) layers a GGUF model may carry after its main layers, read.

llama.cpp's EAGLE-3 file, against our layout (`head_formats`, which reads and writes through this module):

    eagle3.target_layers         the INPUTS of those target layers (llama.cpp extracts layer inputs): ours + 1
                                 (`eagle3.extract_layers` in the first version of the format, read too)
    eagle3.target_hidden_size    the width of each target feature
    eagle3.norm_before_residual  optional, default false
    eagle3.norm_before_fc        optional, default false; its norm is `enc.output_norm.weight` (our input_norm)
    fc.weight, output_norm.weight, output.weight (lm_head), token_embd.weight (optional: an own embedding),
    blk.0.{attn_norm (the embedding's norm), attn_norm_2 (hidden_norm), attn_q/k/v/output, ffn_norm, ffn_*},
    d2t                          ABSOLUTE target ids, I64 (llama.cpp scatters row j to d2t[j]); ours are offsets

Q and K rows are stored permuted for llama.cpp's rotary layout, as in every Llama GGUF; one layer only, no q/k
norms, biases or per-layer feature norms (llama.cpp's graph has none of them).
MTP layers (`{arch}.nextn_predict_layers` = n, counted in `block_count`): block N = block_count - n holds
`nextn.{eh_proj, enorm, hnorm, shared_head_norm, shared_head_head, embed_tokens}` and a decoder layer.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.gguf_reader import ReaderTensor
from gguf.quants import quantize

from specdec.config import SpecdecError
from specdec.models.families import family_of, gguf_archs, load_config
from specdec.models.formats.gguf import _LAYER_TENSORS, _dequantize, _field, _to_torch, f32, hf_config, read_layer
from specdec.models.formats.gguf import _unpermute_qk as unpermute_qk
from specdec.models.heads.files import HeadCheckpoint

_EAGLE3_LAYER = {**_LAYER_TENSORS, "attn_norm_2.weight": "hidden_norm.weight"}
_EAGLE3_TOP = {"fc.weight": "fc.weight", "output_norm.weight": "norm.weight", "output.weight": "lm_head.weight",
               "token_embd.weight": "embed_tokens.weight", "enc.output_norm.weight": "input_norm.weight"}
_FIRST_VERSION = {"blk.0.hidden_norm.weight": "blk.0.attn_norm_2.weight"}  # names of the format's first version
_NEXTN = {"eh_proj": "eh_proj", "enorm": "enorm", "hnorm": "hnorm", "shared_head_norm": "shared_head.norm",
          "shared_head_head": "shared_head.head", "embed_tokens": "embed_tokens"}


def read_gguf_head(path: Path, method: str) -> HeadCheckpoint:
    """An EAGLE-3 GGUF (method eagle3), or the first MTP layer of a GGUF model (method mtp)."""
    reader = GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch == "eagle3":
        if method != "eagle3":
            raise SpecdecError(f"{path} is an EAGLE-3 head (GGUF architecture eagle3), not {method!r}")
        return _read_eagle3(reader, path)
    if _field(reader, f"{arch}.nextn_predict_layers", 0):
        if method != "mtp":
            raise SpecdecError(f"{path} is a {arch} model with MTP layers: use method 'mtp', not {method!r}")
        return _read_nextn(reader, path, arch)
    raise SpecdecError(f"{path} is a GGUF {arch!r} model, not a draft head (no eagle3 architecture, no "
                       f"{arch}.nextn_predict_layers)")


def _tensor(t: ReaderTensor, heads: int | None = None) -> torch.Tensor:
    """A GGUF tensor as float32 in HF [out, in] order, Q/K rows unpermuted when `heads` is given."""
    shape = tuple(int(d) for d in reversed(t.shape))
    w = _dequantize(t.data, t.tensor_type, t.name).reshape(shape)
    return _to_torch(unpermute_qk(w, heads) if heads else w, torch.float32)


def _read_eagle3(reader: GGUFReader, path: Path) -> HeadCheckpoint:
    def key(suffix: str, default=None):  # noqa: ANN001, ANN202
        return _field(reader, f"eagle3.{suffix}", default)

    if key("block_count", 1) != 1:
        raise SpecdecError(f"EAGLE-3 GGUF {path}: block_count={key('block_count')}; llama.cpp's EAGLE-3 has one layer")
    layers = [int(i) for i in key("target_layers", None) or key("extract_layers", [])]
    if len(layers) < 1 or min(layers) < 1:
        raise SpecdecError(f"EAGLE-3 GGUF {path}: eagle3.target_layers {layers} must name target layers >= 1 "
                           "(llama.cpp reads their inputs; layer 0's input, the embeddings, is not gathered here)")
    if "output.weight" not in {t.name for t in reader.tensors}:
        raise SpecdecError(f"EAGLE-3 GGUF {path} has no output.weight (a head that borrows the target's LM head), "
                           "which specdec does not implement")
    H, heads = int(key("embedding_length")), int(key("attention.head_count"))
    kv_heads = int(key("attention.head_count_kv", heads))
    tensors = {t.name: t for t in reader.tensors}
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
              "intermediate_size": int(key("feed_forward_length")), "num_hidden_layers": 1,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": int(key("attention.key_length", H // heads)),
              "rms_norm_eps": f32(key("attention.layer_norm_rms_epsilon", 1e-5)),
              "rope_theta": f32(key("rope.freq_base", 10000.0)),
              "max_position_embeddings": int(key("context_length", 4096)),
              "draft_vocab_size": int(tensors["output.weight"].shape[1]),
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers]}}
    vocab = key("vocab_size") or (int(tensors["token_embd.weight"].shape[1]) if "token_embd.weight" in tensors
                                  else None)
    if vocab:
        config["vocab_size"] = int(vocab)
    if key("target_hidden_size") and int(key("target_hidden_size")) != H:
        config["target_hidden_size"] = int(key("target_hidden_size"))
    for option in ("norm_before_residual", "norm_before_fc"):
        if key(option, False):
            config[option] = True
    out: dict[str, torch.Tensor] = {}
    for name, t in ((_FIRST_VERSION.get(n, n), t) for n, t in tensors.items()):
        if name in ("d2t", "d2t.weight"):
            out["d2t"] = _offsets(np.asarray(t.data).astype(np.int64), path)
        elif name in _EAGLE3_TOP:
            out[_EAGLE3_TOP[name]] = _tensor(t)
        elif name.startswith("blk.0.") and name[6:] in _EAGLE3_LAYER:
            heads_of = heads if name.endswith("attn_q.weight") else kv_heads if name.endswith("attn_k.weight") else None
            out["midlayer." + _EAGLE3_LAYER[name[6:]]] = _tensor(t, heads_of)
        elif name.endswith("rope_freqs.weight"):
            raise SpecdecError(f"EAGLE-3 GGUF {path}: rope frequency factors ({name}) are not implemented for heads")
        else:
            raise SpecdecError(f"EAGLE-3 GGUF {path} has tensor {name!r}, which specdec has no place for")
    return HeadCheckpoint("eagle3", config, out, path.parent, "gguf")


def _offsets(absolute: np.ndarray, path: Path) -> torch.Tensor:
    """llama.cpp's absolute d2t -> our offsets (target id = draft id + offset), checked to be a draft vocabulary."""
    if absolute.size > 1 and not (np.diff(absolute) > 0).all() or absolute.min() < 0:
        raise SpecdecError(f"EAGLE-3 GGUF {path}: d2t is not a strictly increasing list of target ids (llama.cpp "
                           "stores absolute ids)")
    return torch.from_numpy(absolute - np.arange(absolute.size, dtype=np.int64))


def _read_nextn(reader: GGUFReader, path: Path, arch: str) -> HeadCheckpoint:
    """The first MTP layer: block N (N = the main layers) read as a decoder layer of the model's own family (its
    attention and MLP kinds: DeepSeek's latent attention and experts too) plus its nextn.* tensors."""
    archs = gguf_archs()
    if arch not in archs:
        raise SpecdecError(f"{path}: MTP layers of a GGUF {arch!r} model, an architecture specdec does not read")
    tensors = {t.name: t for t in reader.tensors}
    config = hf_config(reader, archs[arch], tensors)  # its num_hidden_layers excludes the MTP layers
    block = config["num_hidden_layers"]
    hf = f"model.layers.{block}."
    try:
        layer, rest = read_layer(reader, path, archs[arch], load_config, config, block)
    except ValueError as e:
        raise SpecdecError(str(e)) from None
    out: dict[str, torch.Tensor] = dict(family_of(config).gguf_state(layer, config))
    for name, t in rest.items():
        short = name.removeprefix(f"blk.{block}.nextn.").removesuffix(".weight")
        if not name.startswith(f"blk.{block}.nextn.") or short not in _NEXTN:
            raise SpecdecError(f"MTP layer in {path} has tensor {name!r}, which specdec has no place for")
        out[hf + _NEXTN[short] + ".weight"] = _tensor(t)
    if hf + "eh_proj.weight" not in out:
        raise SpecdecError(f"{path} declares {arch}.nextn_predict_layers but block {block} has no nextn.eh_proj")
    head = {k: v for k, v in config.items() if k != "num_nextn_predict_layers"}  # the head's own shape
    return HeadCheckpoint("mtp", {**head, "num_hidden_layers": 1}, out, path.parent, "gguf")


# ---- writing -----------------------------------------------------------------------------------------------------
def write_gguf_head(ckpt: HeadCheckpoint, out: Path, target: Path | None = None) -> Path:
    """An EAGLE-3 head as llama.cpp's GGUF (`out`: a .gguf path, or a directory to write `model.gguf` into);
    what that format cannot hold is refused by name. `target`: the target's GGUF, whose tokenizer is copied in, as
    llama.cpp's own converter does (its loader refuses a head without `tokenizer.ggml.*`; without a target the
    file is for readers that take the tokenizer from the target, such as ours)."""
    c, sd = ckpt.config, ckpt.tensors
    refused = [k for k in ("fc_norm", "norm_output") if c.get(k)]
    refused += ["num_hidden_layers > 1"] * (int(c.get("num_hidden_layers", 1)) > 1)
    refused += ["q/k norms"] * ("midlayer.self_attn.q_norm.weight" in sd)
    refused += ["QKV biases"] * ("midlayer.self_attn.q_proj.bias" in sd)
    if refused:
        raise SpecdecError(f"llama.cpp's EAGLE-3 GGUF cannot hold this head's {', '.join(refused)}")
    ids = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise SpecdecError("the head names no target layers (eagle_aux_hidden_state_layer_ids), which "
                           "eagle3.extract_layers requires")
    path = out if out.suffix == ".gguf" else out / "model.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    H, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    kv_heads, head_dim = int(c.get("num_key_value_heads", heads)), int(c.get("head_dim") or H // heads)
    w = GGUFWriter(path, "eagle3")
    w.add_embedding_length(H)
    w.add_block_count(1)
    w.add_feed_forward_length(int(c["intermediate_size"]))
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-5)))
    w.add_rope_freq_base(float(c.get("rope_theta", 10000.0)))
    w.add_context_length(int(c.get("max_position_embeddings", 4096)))
    if c.get("vocab_size"):
        w.add_vocab_size(int(c["vocab_size"]))
    w.add_array("eagle3.target_layers", [int(i) + 1 for i in ids])
    w.add_uint32("eagle3.target_hidden_size", int(c.get("target_hidden_size") or H))
    w.add_bool("eagle3.norm_before_residual", bool(c.get("norm_before_residual")))
    w.add_bool("eagle3.norm_before_fc", bool(c.get("norm_before_fc")))
    if target is not None:
        copy_tokenizer(target, w)
    ours = {v: k for k, v in _EAGLE3_TOP.items()} | {"midlayer." + v: "blk.0." + k for k, v in _EAGLE3_LAYER.items()}
    for name, t in sd.items():
        if name == "t2d":
            continue  # a training-time mask; llama.cpp's converter drops it too
        if name == "d2t":
            w.add_tensor("d2t", (t.long() + torch.arange(len(t))).numpy().astype(np.int64))
            continue
        if name not in ours:
            raise SpecdecError(f"llama.cpp's EAGLE-3 GGUF has no place for tensor {name!r}")
        x = t.detach().float().numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            x = _permute_qk(x, heads if "q_proj" in name else kv_heads)
        _add(w, ours[name], x, t.dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def copy_tokenizer(target: Path, w: GGUFWriter) -> None:
    """Every `tokenizer.*` key of the target's GGUF, with its type, into the file being written."""
    try:
        fields = GGUFReader(target).fields
    except (OSError, ValueError) as e:
        raise SpecdecError(f"cannot read the target's GGUF {target} for its tokenizer: {e}") from None
    keys = [k for k in fields if k.startswith("tokenizer.")]
    if "tokenizer.ggml.model" not in keys:
        raise SpecdecError(f"the target's GGUF {target} holds no tokenizer (tokenizer.ggml.model) to copy")
    for key in keys:
        f = fields[key]
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)


def _permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permute (the inverse of `unpermute_qk`): per head, rows [half, 2] -> [2, half] interleaved."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add(w: GGUFWriter, name: str, x: np.ndarray, dtype: torch.dtype) -> None:
    """A tensor in the GGUF type that holds its values exactly (bfloat16 and float16 stay 16-bit)."""
    if x.ndim == 2 and dtype == torch.bfloat16:
        w.add_tensor(name, quantize(x, GGMLQuantizationType.BF16), raw_dtype=GGMLQuantizationType.BF16)
    elif x.ndim == 2 and dtype == torch.float16:
        w.add_tensor(name, x.astype(np.float16))
    else:
        w.add_tensor(name, np.ascontiguousarray(x.astype(np.float32)))
