"""Medusa-1 draft heads, in the checkpoint layout of the reference Medusa implementation.

    h         = norm(target's last-layer output at token t)                 [T, H]    (the target's final norm)
    x_i       = ResBlock^L(h),  ResBlock(x) = x + SiLU(linear(x))           [T, H]    K heads, L blocks each
    logits_i  = lm_head_i(x_i)                                              [T, V]    predicts token t + i + 2

The target's own LM head predicts token t + 1, so head i (0-based) looks i + 1 tokens further ahead. The LM
head is by default the target's (shared and frozen, as when only the blocks are trained); a checkpoint may
carry one per head instead (reference Medusa-1), which is then used.

Checkpoint (a directory): config.json (`medusa_num_heads`, `medusa_num_layers`, optionally `hidden_size` and
`vocab_size`) + *.safetensors with `medusa_head.{i}.{j}.linear.{weight,bias}` for block j < L and, optionally,
`medusa_head.{i}.{L}.weight` [V, H] (head i's own LM head). State-dict names here are the reference names.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.config import ModelConfig, SpecdecError
from specdec.models.blocks.kernels import linear
from specdec.models.heads.files import check_made_for
from specdec.models.heads.formats import read_head
from specdec.models.llama import Linear, LlamaModel


class ResBlock(nn.Module):
    """x + SiLU(x @ W.T + b): the reference Medusa block (zero-initialised in training: starts as identity)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.linear = Linear(hidden_size, hidden_size, True, dtype, device, torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class HeadLM(nn.Module):
    """A head's own LM head; its weight is `medusa_head.{i}.{L}.weight` [V, H] as in the reference."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)


class MedusaHeads(nn.Module):
    """K heads of L residual blocks over the target's final-normed hidden state.

    lm_head: the target's LM head [V, H], shared by every head (not part of this module's weights); None gives
    each head its own (`medusa_head.{i}.{L}`), to be loaded from a checkpoint."""

    unrolls = False  # trained one step ahead
    aux_layers: tuple[int, ...] = ()  # reads no intermediate target layer: only its final hidden state

    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int,
                 lm_head: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise SpecdecError(f"a Medusa head needs >= 1 heads and >= 0 layers, got {num_heads} and {num_layers}")
        if lm_head is not None and tuple(lm_head.shape) != (vocab_size, hidden_size):
            raise SpecdecError(f"the shared LM head has shape {tuple(lm_head.shape)}, expected "
                               f"{(vocab_size, hidden_size)}")
        self.num_heads, self.num_layers = num_heads, num_layers
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.dtype, self.device = dtype, torch.device(device)
        # detach(): a plain tensor view, so the target's weight is neither registered nor saved here
        self.shared_lm_head = lm_head.detach() if isinstance(lm_head, torch.Tensor) else lm_head  # or quantized
        self.medusa_head = nn.ModuleList(
            nn.ModuleList([*(ResBlock(hidden_size, dtype, device) for _ in range(num_layers)),
                           *([] if lm_head is not None else [HeadLM(vocab_size, hidden_size, dtype, device)])])
            for _ in range(num_heads))

    @property
    def max_draft_depth(self) -> int:
        """Head i drafts depth i + 1 only."""
        return self.num_heads

    @property
    def lm_head(self) -> torch.Tensor | None:
        """The shared LM head (the trainer's logits when heads share the target's)."""
        return self.shared_lm_head

    @property
    def owns_lm_heads(self) -> bool:
        return self.shared_lm_head is None

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """hidden: the target's final-normed states [T, H] -> each head's block output [K, T, H] (float32).
        num_heads: run only the first heads (a draft shallower than K needs no more)."""
        return torch.stack(self.blocks(hidden.float(), num_heads))

    def blocks(self, hidden: torch.Tensor, num_heads: int | None = None) -> list[torch.Tensor]:
        """Each head's block output [T, H] (differentiable outside inference mode: the trainer uses it)."""
        outs = []
        for head in self.medusa_head[:num_heads]:
            h = hidden
            for block in head[:self.num_layers]:
                h = block(h)
            outs.append(h)
        return outs

    def training_terms(self, embeds: torch.Tensor, features: torch.Tensor, hidden: torch.Tensor,
                       normed: torch.Tensor, steps: int) -> tuple[list[tuple[torch.Tensor, int, int]], torch.Tensor,
                                                                  None]:
        """What the trainer fits (see `Eagle3Head.training_terms`): head i at row t reads the target's final
        normed hidden state and predicts token t + i + 2."""
        T = len(embeds) + 1
        outs = self.blocks(normed.clone())
        return [(out[:T - i - 2], i + 1, 0) for i, out in enumerate(outs)], normed.clone(), None

    @torch.inference_mode()
    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Block outputs [k, T, H] of the first k heads -> float32 logits [k, T, V]."""
        k, T, H = out.shape
        if self.owns_lm_heads:
            return torch.stack([linear(out[i], self.medusa_head[i][self.num_layers].weight) for i in range(k)]).float()
        return linear(out.reshape(k * T, H), self.shared_lm_head).float().view(k, T, -1)

    # ---- checkpoints ------------------------------------------------------------------------------
    @classmethod
    def create(cls, method: str, target: LlamaModel, draft_ids: torch.Tensor | None = None, num_layers: int = 1,
               num_heads: int = 3) -> MedusaHeads:
        """Untrained heads sharing the target's LM head; every block starts as the identity (Medusa's
        initialisation: zero weights)."""
        heads = cls(num_heads, num_layers, target.config.hidden_size, target.config.vocab_size, target.lm_head)
        for p in heads.parameters():
            p.data.zero_()
        return heads

    @classmethod
    def load_for(cls, method: str, path: str | Path, target: LlamaModel) -> MedusaHeads:
        """The heads in `path` for the target model `target` (sharing its LM head unless they have their own)."""
        return cls.load(path, target.config, target.lm_head, target.dtype, target.device)

    @classmethod
    def load(cls, path: str | Path, target: ModelConfig, target_lm_head: torch.Tensor,
             dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> MedusaHeads:
        """A head in the reference Medusa layout (a directory with `medusa_lm_head.pt` or safetensors, the file
        itself, or a Hub id; vLLM's converted layout too), checked against the target it drafts for. The head
        count is read from the tensors (published configs misstate it); heads with their own LM heads (Medusa-1)
        use them, the others (Medusa-2) share `target_lm_head` [V, H]."""
        ckpt = read_head(path, "medusa")
        cfg, sd, path = ckpt.config, ckpt.tensors, ckpt.path
        if not any(name.startswith("medusa_head.") for name in sd):  # saved from the bare ModuleList
            sd = {f"medusa_head.{name}": t for name, t in sd.items()}
        found = {int(m[1]) for name in sd if (m := re.match(r"medusa_head\.(\d+)\.", name))}
        if not found and "medusa_num_heads" not in cfg:
            raise SpecdecError(f"Medusa head {path}: no medusa_head tensors and no 'medusa_num_heads' in config.json")
        K = max(found) + 1 if found else int(cfg["medusa_num_heads"])
        L = int(cfg.get("medusa_num_layers", 1))
        H, V = cfg.get("hidden_size", target.hidden_size), cfg.get("vocab_size", target.vocab_size)
        check_made_for("Medusa", path, H, V, target)
        own = [f"medusa_head.{i}.{L}.weight" in sd for i in range(K)]
        if any(own) and not all(own):
            raise SpecdecError(f"Medusa head {path} is missing tensor 'medusa_head.{own.index(False)}.{L}.weight' "
                               "(some heads have their own LM head, so every head needs one)")
        heads = cls(K, L, H, V, None if all(own) else target_lm_head, dtype, device)
        heads.load_reference(sd, str(path))
        return heads

    def load_reference(self, sd: dict[str, torch.Tensor], where: str = "checkpoint") -> None:
        """Copy reference-named weights in, every tensor present with its expected shape and none left over."""
        expected = self.state_dict()
        missing = [name for name in expected if name not in sd]
        if missing:
            raise SpecdecError(f"Medusa head {where} is missing tensor {missing[0]!r}"
                               + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        leftover = [name for name in sd if name not in expected]
        if leftover:
            raise SpecdecError(f"Medusa head {where} has tensors its config (medusa_num_heads={self.num_heads}, "
                               f"medusa_num_layers={self.num_layers}) does not expect, e.g. {leftover[:3]}")
        for name, param in expected.items():
            if tuple(sd[name].shape) != tuple(param.shape):
                raise SpecdecError(f"Medusa tensor {name!r} has shape {tuple(sd[name].shape)}, expected "
                                   f"{tuple(param.shape)} (hidden size {self.hidden_size}, vocab size "
                                   f"{self.vocab_size})")
            param.copy_(sd[name].to(param.dtype))

    def state_dict_reference(self) -> dict[str, torch.Tensor]:
        """Weights under their reference names (no LM heads when sharing the target's)."""
        return {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()}

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = {"architectures": ["MedusaModel"], "medusa_num_heads": self.num_heads,
                  "medusa_num_layers": self.num_layers, "hidden_size": self.hidden_size,
                  "vocab_size": self.vocab_size}
        (path / "config.json").write_text(json.dumps(config, indent=1))
        save_file(self.state_dict_reference(), path / "model.safetensors", metadata={"format": "pt"})
