"""What every draft-head checkpoint shares: a directory with config.json + *.safetensors, made for one target's
hidden and vocabulary sizes, whose tensors are copied into ours with their names and shapes checked."""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

from specdec.config import ModelConfig, SpecdecError


def read_head_config(path: str | Path, what: str) -> tuple[Path, dict]:
    """(the directory, its config.json); `what` names the head in errors."""
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise SpecdecError(f"{what} head {path} has no config.json (expected a directory with config.json "
                           "and model.safetensors)")
    return path, json.loads((path / "config.json").read_text())


# What each kind of head's config.json names as its architecture (what our heads' `save` writes, and SpecForge's
# EAGLE-3 checkpoints): a head of another method is refused by name rather than by a tensor shape.
HEAD_ARCHITECTURES = {"LlamaForCausalLMEagle3": "eagle3", "EagleHead": "eagle", "DeepseekMTPHead": "mtp",
                      "MedusaModel": "medusa"}


def check_head_method(path: str | Path, method: str) -> None:
    """Refuse a head directory whose config.json names the architecture of another method's head (a head that
    names none, or one not in `HEAD_ARCHITECTURES`, is left to its loader's checks)."""
    path, hf = read_head_config(path, method)
    named = hf.get("architectures") or []
    kinds = sorted({HEAD_ARCHITECTURES[a] for a in named if isinstance(a, str) and a in HEAD_ARCHITECTURES})
    if kinds and method not in kinds:
        raise SpecdecError(f"{path} is a head of method {' / '.join(kinds)!r} (architectures {named}), not "
                           f"{method!r}: give a {method} head")


def read_head_tensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's *.safetensors files (read after the config passed its checks)."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SpecdecError(f"{what} head {path} has no *.safetensors weights")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(f))
    return sd


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


def tensor_copier(sd: dict[str, torch.Tensor], what: str
                  ) -> tuple[Callable[[str], torch.Tensor], Callable[..., None]]:
    """take(name) -> the checkpoint's tensor; put(param, tensor, name) copies it in if the shapes agree (the
    signature `llama.load_decoder_layer` expects)."""
    def take(name: str) -> torch.Tensor:
        if name not in sd:
            raise SpecdecError(f"{what} checkpoint is missing tensor {name!r}")
        return sd[name]

    def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
        if tuple(param.shape) != tuple(value.shape):
            raise SpecdecError(f"{what} tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(value.to(param.dtype))

    return take, put
