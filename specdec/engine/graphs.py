"""The target's decode and verification forwards at bucketed shapes, replayed as CUDA graphs.

A step of a small model on a GPU is launch-bound: about ten kernels per layer, each a few microseconds of work,
issued one by one from Python (17.7 ms a step for the default model on an H100, whose weights it reads in under
0.1 ms). Captured once per shape and replayed, the whole forward is one launch. A graph fixes its shapes and
addresses, so a step is padded to a bucket and copied into that bucket's static buffers:

    bucket (B, S, L):  B sequences (1, 2, 4, ... up to max_num_seqs), S rows each (1, 2, 4, 8, 16: a decode row,
                       or the last token and its draft nodes), L context slots each (256, 512, ... up to the
                       context length)
    padding:           extra rows and sequences write their K/V into the null block and see only its first slot
                       (finite, and never seen by a real row); extra context slots are masked off
    attention:         every row's visibility is one mask [B, S, L], causal rows and tree rows alike, so one
                       captured forward serves chains and trees

A prefill (more rows than the largest bucket) runs eagerly, and so do the drafters' own forwards. On CPU the
same padded forward can run without capture (`capture=False`): the tests check there that a padded bucket gives
every real row what the unpadded step gives it, bit for bit on the native kernels.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from specdec.kv_cache import NULL_BLOCK, KVPool, paged_inputs
from specdec.models.blocks.attention import AttentionMetadata
from specdec.models.llama import LlamaModel

log = logging.getLogger("specdec.engine")

SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
ROW_BUCKETS = (1, 2, 4, 8, 16)
MIN_CONTEXT = 256


def bucket(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size >= n, None when n exceeds them all."""
    return next((s for s in sizes if s >= n), None)


def context_bucket(n: int, max_context: int) -> int | None:
    """MIN_CONTEXT doubled until it holds n, at most max_context (None beyond it)."""
    if n > max_context:
        return None
    L = MIN_CONTEXT
    while L < n:
        L *= 2
    return min(L, max_context)


@dataclass
class Bucket:
    """One captured shape: its static inputs, its outputs, and how to run it."""

    tokens: torch.Tensor  # [B * S] long
    positions: torch.Tensor  # [B * S] long
    slot_mapping: torch.Tensor  # [B * S] long
    context_slots: torch.Tensor  # [B, L] long
    mask: torch.Tensor  # [B, S, L] bool
    run: Callable[[], tuple[torch.Tensor, torch.Tensor | None]] | None = None


class GraphRunner:
    """Runs the target's forward for steps that fit a bucket (`run` returns None for the others)."""

    def __init__(self, model: LlamaModel, kv: KVPool, block_size: int, max_seqs: int, max_context: int,
                 capture: bool) -> None:
        self.model, self.kv, self.block_size, self.capture = model, kv, block_size, capture
        self.seq_buckets = tuple(b for b in SEQ_BUCKETS if b < max_seqs) + (bucket(max_seqs, SEQ_BUCKETS) or max_seqs,)
        self.max_context = max_context
        self.buckets: dict[tuple, Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # one memory pool shared by every graph
        self.null_slot = NULL_BLOCK * block_size
        self.failed: str | None = None  # why capturing failed: every forward is eager from then on

    def shape(self, starts: list[int], feeds: list[list[int]], trees: list | None) -> tuple[int, int, int] | None:
        """The bucket (B, S, L) of a step, None when it fits none."""
        trees = trees or [None] * len(feeds)
        ends = [s + (len(f) if t is None else t.visible.shape[1]) for s, f, t in zip(starts, feeds, trees)]
        b, s = bucket(len(feeds), self.seq_buckets), bucket(max(len(f) for f in feeds), ROW_BUCKETS)
        L = context_bucket(max(ends), self.max_context)
        return None if b is None or s is None or L is None else (b, s, L)

    def run(self, tables: list[list[int]], starts: list[int], feeds: list[list[int]], trees: list | None = None,
            feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The final hidden states of the fed rows [T, H] (and their features, as ModelRunner.run), or None when the
        step fits no bucket."""
        key = self.shape(starts, feeds, trees)
        if key is None or self.failed is not None:
            return None
        b, s, L = key
        tokens, positions, meta = paged_inputs(tables, starts, feeds, trees, block_size=self.block_size)  # host
        rows = np.concatenate([i * s + np.arange(len(f)) for i, f in enumerate(feeds)])  # real rows, padded layout
        entry = self.buckets.get((*key, feature_layers)) or self._build(key, feature_layers)
        if entry is None:
            return None
        self._load(entry, key, rows, tokens.numpy(), positions.numpy(), meta)
        hidden, features = entry.run()
        index = torch.from_numpy(rows).to(hidden.device)
        return hidden[index], features[index] if features is not None else None

    def _load(self, entry: Bucket, key: tuple[int, int, int], rows: np.ndarray, tokens: np.ndarray,
              positions: np.ndarray, meta: AttentionMetadata) -> None:
        """Copy a step into the bucket's buffers: padded rows and sequences see only the null block's first slot."""
        b, s, L = key
        B, S, Lr = meta.mask.shape
        flat = np.zeros((3, b * s), dtype=np.int64)  # tokens, positions, slots
        flat[2] = self.null_slot
        flat[:, rows] = tokens, positions, meta.slot_mapping.numpy()
        context = np.full((b, L), self.null_slot, dtype=np.int64)
        context[:B, :Lr] = meta.context_slots.numpy()
        mask = np.zeros((b, s, L), dtype=bool)
        mask[:B, :S, :Lr] = meta.mask.numpy()
        real = np.zeros(b * s, dtype=bool)
        real[rows] = True
        mask.reshape(b * s, L)[~real, 0] = True  # a padded row sees one finite key
        flat_t = torch.from_numpy(flat)
        for dst, src in ((entry.tokens, flat_t[0]), (entry.positions, flat_t[1]), (entry.slot_mapping, flat_t[2]),
                         (entry.context_slots, torch.from_numpy(context)), (entry.mask, torch.from_numpy(mask))):
            dst.copy_(src)

    def _build(self, key: tuple[int, int, int], feature_layers: tuple[int, ...]) -> Bucket | None:
        b, s, L = key

        def buffer(shape: tuple[int, ...], fill: int | bool, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, device=self.model.device)

        entry = Bucket(buffer((b * s,), 0), buffer((b * s,), 0), buffer((b * s,), self.null_slot),
                       buffer((b, L), self.null_slot), buffer((b, s, L), False, torch.bool))
        entry.mask[:, :, 0] = True
        meta = AttentionMetadata(entry.slot_mapping, entry.context_slots, entry.mask, [s] * b, [L] * b)

        def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
            hidden, captured = self.model(entry.tokens, entry.positions, meta, self.kv, output_layers=feature_layers)
            return hidden, torch.cat([captured[i] for i in feature_layers], -1) if feature_layers else None

        try:
            entry.run = forward if not self.capture else self._capture(forward)
        except Exception as e:  # noqa: BLE001  a graph is an optimization: the eager forward stays correct
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("capturing the forward of %s sequences x %s rows x %s slots failed (%s); every forward "
                        "runs eagerly from now on", b, s, L, self.failed)
            return None
        self.buckets[(*key, feature_layers)] = entry
        return entry

    def _capture(self, forward: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
                 ) -> Callable[[], tuple[torch.Tensor, torch.Tensor | None]]:
        """A CUDA graph of `forward` (warmed up first on a side stream: lazy initialization, library workspaces);
        replaying it writes the same output tensors."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = forward()

        def replay() -> tuple[torch.Tensor, torch.Tensor | None]:
            graph.replay()
            return outputs

        return replay
