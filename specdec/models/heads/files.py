"""What every draft-head checkpoint shares: a directory with config.json and its weights (*.safetensors, or the
PyTorch pickles the reference implementations publish, read with `weights_only`), or a Hub id resolving to
one, made for one target's hidden and vocabulary sizes, whose tensors are copied into ours with their names
and shapes checked. Layouts other than ours are translated by `specdec.models.heads.formats`."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.config import ModelConfig, SpecdecError
from specdec.models.hub import is_hub_id, resolve_hub

PICKLE_SUFFIXES = (".bin", ".pt", ".pth")  # the reference implementations' PyTorch pickles


@dataclass
class HeadCheckpoint:
    """A head's config and tensors in our layout for `method` (see `head_formats`), and the layout they were read
    from: `source`, one of `head_formats.FORMATS` or "mtp"."""

    method: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    path: Path
    source: str = "specforge"

def head_location(path: str | Path, what: str) -> tuple[Path, Path | None]:
    """(the head's directory, its one weight file where `path` names a file: a `.pt`, `.bin`, `.safetensors` or
    `.gguf`); a Hub id (`org/name`) resolves through the local Hugging Face cache."""
    name = str(path)
    if is_hub_id(name):
        return resolve_hub(name, f"{what} head"), None
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix not in (*PICKLE_SUFFIXES, ".safetensors", ".gguf"):
            raise SpecdecError(f"{what} head {path}: a head is a directory (config.json and weights), or one "
                               f"weight file (.safetensors, .bin, .pt, .pth, .gguf), not a {path.suffix or 'bare'} "
                               "file")
        return path.parent, path
    if not path.is_dir():
        raise SpecdecError(f"{what} head {path} not found: no such directory or file, and not a Hub id (org/name)")
    return path, None


def read_head_config(path: str | Path, what: str) -> tuple[Path, dict]:
    """(the directory, its config.json); `what` names the head in errors."""
    path, _ = head_location(path, what)
    if not (path / "config.json").is_file():
        raise SpecdecError(f"{what} head {path} has no config.json (expected a directory with config.json "
                           "and its weights: *.safetensors, pytorch_model.bin or a .pt file)")
    return path, json.loads((path / "config.json").read_text())


def weight_files(path: Path) -> list[Path]:
    """A head directory's weights: its *.safetensors, else its PyTorch pickles (*.bin, *.pt, *.pth: the EAGLE,
    AngelSlim and Medusa reference checkpoints)."""
    files = sorted(path.glob("*.safetensors"))
    return files or sorted(f for f in path.iterdir() if f.suffix in PICKLE_SUFFIXES and f.is_file())


def read_head_tensors(path: Path, what: str, file: Path | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the head's weight files (or of `file` alone), read after its config passed its checks.
    Pickles load with `weights_only` (tensors and containers only: no code in a downloaded file runs)."""
    files = [file] if file is not None else weight_files(path)
    if not files:
        raise SpecdecError(f"{what} head {path} has no weights (*.safetensors, *.bin, *.pt or *.pth)")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(_read_weights(f, what))
    return sd


def _read_weights(file: Path, what: str) -> dict[str, torch.Tensor]:
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(file)
    try:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  pickled code, a truncated file: refused with the reason
        raise SpecdecError(f"{what} head {file}: not a PyTorch state dict of tensors that loads with "
                           f"weights_only=True ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") \
            from None
    for key in ("state_dict", "model", "module"):  # a training checkpoint that wraps its state dict
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    bad = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)] if isinstance(obj, dict) else ["(root)"]
    if bad:
        raise SpecdecError(f"{what} head {file} holds entries that are not tensors: {bad[:5]}")
    return dict(obj)


def check_made_for(what: str, path: Path, hidden_size: int, vocab_size: int, target: ModelConfig) -> None:
    if hidden_size != target.hidden_size or vocab_size != target.vocab_size:
        raise SpecdecError(f"{what} head {path} was made for hidden size {hidden_size} and vocab size {vocab_size}, "
                           f"the target has {target.hidden_size} and {target.vocab_size}")


def init_random(params: list[torch.Tensor], seed: int = 0) -> None:
    """An untrained head's weights: 1-D tensors (norm weights) to one, matrices ~ N(0, 1 / fan_in)."""
    g = torch.Generator().manual_seed(seed)
    for p in params:
        if p.dim() == 1:
            p.data.fill_(1.0)
        else:
            p.data.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


class TensorCopier:
    """take(name) -> the checkpoint's tensor (remembering it was used); put(param, tensor, name) copies it in if
    the shapes agree (the signature `llama.load_decoder_layer` expects); `refuse_leftovers` then names any
    tensor the head had no place for, so a part we do not implement is never dropped silently."""

    def __init__(self, sd: dict[str, torch.Tensor], what: str) -> None:
        self.sd, self.what, self.taken = sd, what, set[str]()

    def take(self, name: str) -> torch.Tensor:
        if name not in self.sd:
            raise SpecdecError(f"{self.what} checkpoint is missing tensor {name!r}")
        self.taken.add(name)
        return self.sd[name]

    def put(self, param: torch.Tensor, value: torch.Tensor, name: str) -> None:
        if tuple(param.shape) != tuple(value.shape):
            raise SpecdecError(f"{self.what} tensor {name!r} has shape {tuple(value.shape)}, expected "
                               f"{tuple(param.shape)}")
        param.data.copy_(value.to(param.dtype))

    def refuse_leftovers(self, ignore: tuple[str, ...] = ()) -> None:
        """`ignore`: tensors a layout carries that the definition does not read (`t2d`: a training-only mask)."""
        left = sorted(set(self.sd) - self.taken - set(ignore))
        if left:
            raise SpecdecError(f"{self.what} checkpoint has tensors this head has no place for: {left[:6]}"
                               f"{' ...' if len(left) > 6 else ''} (an option its config does not declare, or a "
                               "layout specdec does not implement)")
