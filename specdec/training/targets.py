"""What the frozen target gives the draft-head trainer: one causal forward per training sequence
(`target_outputs`: the head's input features, the last layer's output, logits), and the same computed once for
every sample and kept on disk in bfloat16 (`FeatureCache`), so epochs, resumed runs and one run per objective
never rerun the target."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

if TYPE_CHECKING:
    from specdec.models.llama import LlamaModel


def target_outputs(model: LlamaModel, ids: list[int], layers: tuple[int, ...], logits: bool = True
                   ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """One causal forward of the target over `ids` with a private cache: (the outputs of `layers` concatenated
    [T, len(layers) * H], or None without any; the last layer's output before the final norm [T, H];
    logits [T, V], or None with logits=False)."""
    from specdec.kv_cache import KVPool
    from specdec.models.blocks.attention import AttentionMetadata

    T, bs = len(ids), 16
    kv = KVPool(model.config, -(-T // bs) + 1, bs, model.kv_dtype, model.device)
    pos = torch.arange(T, device=model.device)
    slots = (pos + bs)[None]  # block 0 is the null block
    meta = AttentionMetadata.causal(pos[None], slots, pos[None], slots[0], [T])
    last = model.config.num_hidden_layers - 1
    normed, captured = model(torch.tensor(ids, device=model.device), pos, meta, kv, output_layers=(*layers, last))
    features = torch.cat([captured[i] for i in layers], -1) if layers else None
    return features, captured[last], model.compute_logits(normed) if logits else None


class FeatureCache:
    """The target's outputs for every training sample, computed once so that epochs never rerun it: per sample
    the head's input features and the last layer's output (before the final norm), in bfloat16 (half the
    bytes; the rounding is far below what the head fits), in shards of `SHARD` samples under a directory
    keyed by the target, the layers and the samples. Logits are recomputed from the stored hidden state
    (the LM head is a small share of the target's work). Building resumes at the first missing shard."""

    SHARD = 64

    def __init__(self, root: Path, model: LlamaModel, layers: tuple[int, ...],
                 samples: list[tuple[list[int], list[bool]]]) -> None:
        from specdec.models.loader import model_fingerprint

        self.dir = Path(root).expanduser() / model_fingerprint(model, [list(layers), [ids for ids, _ in samples]])
        self.model, self.layers, self.samples = model, layers, samples
        self._shard: tuple[int, dict] | None = None

    def shard_path(self, k: int) -> Path:
        return self.dir / f"shard-{k:05d}.pt"

    def build(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        n_shards = -(-len(self.samples) // self.SHARD)
        todo = [k for k in range(n_shards) if not self.shard_path(k).is_file()]
        for k in tqdm(todo, desc="target features", unit="shard", file=sys.stderr, disable=not todo):
            feats, hiddens, offsets = [], [], [0]
            for ids, _ in self.samples[k * self.SHARD:(k + 1) * self.SHARD]:
                f, hidden, _ = target_outputs(self.model, ids, self.layers, logits=False)
                feats.append(f.to(torch.bfloat16) if f is not None else torch.empty(len(ids), 0, dtype=torch.bfloat16))
                hiddens.append(hidden.to(torch.bfloat16))
                offsets.append(offsets[-1] + len(ids))
            tmp = self.shard_path(k).with_suffix(".tmp")
            torch.save({"features": torch.cat(feats), "hidden": torch.cat(hiddens),
                        "offsets": torch.tensor(offsets)}, tmp)
            tmp.replace(self.shard_path(k))

    @torch.inference_mode()
    def outputs(self, i: int, logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """What `target_outputs` gives sample i (features and hidden read back as float32)."""
        k = i // self.SHARD
        if self._shard is None or self._shard[0] != k:
            self._shard = (k, torch.load(self.shard_path(k), mmap=True))
        z = self._shard[1]
        a, b = int(z["offsets"][i % self.SHARD]), int(z["offsets"][i % self.SHARD + 1])
        hidden = z["hidden"][a:b].float()
        features = z["features"][a:b].float() if self.layers else None
        return features, hidden, self.model.compute_logits(self.model.norm(hidden)) if logits else None
