"""Tensor parallelism (Megatron-style) over torch.distributed: what each rank keeps of a loaded model.

Every rank loads the whole checkpoint, then keeps its share (`shard_model`):
- attention by key/value-head groups (a group: one K/V head and the query heads that read it): q, k and v
  rows of its groups (column-parallel), the matching input columns of o_proj (row-parallel). Groups split
  as evenly as they go, so 3 K/V heads on 2 ranks are 2 + 1 (SmolLM2-135M has 9 query and 3 K/V heads);
- the MLP by intermediate units: gate and up rows (column-parallel), down_proj input columns (row-parallel);
- the LM head by vocabulary rows; the rows that need logits are gathered from every rank;
- embedding, norms and q/k norms whole (the embedding is a lookup: replicating it costs memory, not time).

A row-parallel output is a partial sum; one all-reduce after o_proj and one after down_proj make the
residual stream whole again on every rank, so every rank holds the same hidden states (and EAGLE-3's
features) after every layer. Block-quantized matrices split their input columns only on block boundaries
(32 weights for Q4_0/Q4_1/Q8_0, 256 for the K-quants); a split that would cut a block is refused.

With 2 ranks an all-reduce is one addition per element, the same whatever the batch, so a token's logits do
not depend on how its step was batched (greedy speculation stays identical to plain decoding at the same
world size); against a single process only the summation order differs (float32: about 1e-6 relative).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from specdec.config import ModelConfig, SpecdecError
from specdec.models.formats.quant import QuantWeight

if TYPE_CHECKING:
    from specdec.models.llama import LlamaModel


class SharedExchange:
    """Ranks on one host exchanging small CPU tensors through shared memory instead of gloo's sockets (a gloo
    all-reduce of 2 KB took 1.3 ms between two processes on 2 cores; this takes microseconds).

    Each rank copies its tensor into its slot, then raises its flag to the call's generation, waits for every
    flag, and reads every slot: a sum in rank order, so every rank gets the same bits. Slots alternate between
    two halves by the generation's parity, so a rank one call ahead never overwrites what a slower rank still
    reads (it cannot get two calls ahead: it waits for every flag). Stores become visible in program order
    on x86 (TSO); elsewhere the exchange is not used. A peer that stops raising its flag makes the wait fail
    after `timeout_s`, or at once where `alive` can tell (rank 0 watches the processes it spawned)."""

    def __init__(self, name: str, rank: int, world: int, slot_floats: int, create: bool, timeout_s: float) -> None:
        from multiprocessing import shared_memory

        self.rank, self.world, self.slot, self.timeout_s = rank, world, slot_floats, timeout_s
        size = 8 * world * 8 + 2 * world * slot_floats * 4
        self.shm = shared_memory.SharedMemory(name=name, create=create, size=size)
        if not create:  # the creator unlinks it; Python's tracker must not unlink it again at exit
            try:
                from multiprocessing import resource_tracker

                resource_tracker.unregister(self.shm._name, "shared_memory")
            except Exception:
                pass
        self.alive = None  # optional () -> str | None: why a peer is gone (checked while waiting)
        self.flags = torch.frombuffer(self.shm.buf, dtype=torch.int64, count=world * 8)  # one cache line each
        self.slots = torch.frombuffer(self.shm.buf, dtype=torch.float32, offset=8 * world * 8,
                                      count=2 * world * slot_floats).view(2, world, slot_floats)
        if create:
            self.flags.zero_()
        self.generation = 0

    def exchange(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x (same shape on every rank), or None when it does not fit (the caller uses gloo)."""
        n = x.numel()
        if n > self.slot or x.dtype != torch.float32:
            return None
        self.generation += 1
        g, half = self.generation, self.generation % 2
        self.slots[half, self.rank, :n].copy_(x.reshape(-1))
        self.flags[self.rank * 8] = g
        deadline, spins = None, 0
        others = [r * 8 for r in range(self.world) if r != self.rank]
        while any(int(self.flags[i]) < g for i in others):
            spins += 1
            if spins % 4096:
                continue
            if deadline is None:
                deadline = time.monotonic() + self.timeout_s
            gone = self.alive() if self.alive is not None else None
            if gone or time.monotonic() > deadline:
                raise RuntimeError(gone or f"a rank did not reach exchange {g} within {self.timeout_s} s")
        return [self.slots[half, r, :n].view(x.shape).clone() for r in range(self.world)]

    def close(self, unlink: bool) -> None:
        if self.shm is None:
            return
        del self.flags, self.slots
        self.shm.close()
        if unlink:
            self.shm.unlink()
        self.shm = None


@dataclass
class TPGroup:
    """This process's place among the tensor-parallel ranks (a torch.distributed process group, and a
    shared-memory exchange when every rank is on this host)."""

    rank: int
    world: int
    group: Any = None  # None: the default group
    shared: SharedExchange | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            parts = self.shared.exchange(x) if self.shared is not None else None
            if parts is None:
                dist.all_reduce(x, group=self.group)
            else:
                total = parts[0]
                for p in parts[1:]:
                    total += p  # rank order on every rank
                x.copy_(total)
        return x

    def gather_columns(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Every rank's x [N, sizes[rank]], concatenated along the last dim [N, sum(sizes)] on every rank."""
        if self.world == 1:
            return x
        padded = torch.nn.functional.pad(x, (0, max(sizes) - x.shape[-1])).contiguous()
        parts = self.shared.exchange(padded) if self.shared is not None else None
        if parts is None:
            parts = [torch.empty_like(padded) for _ in range(self.world)]
            dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)


def split(n: int, world: int, multiple: int = 1) -> list[tuple[int, int]]:
    """[start, end) of each rank's share of n units, in units of `multiple`, as even as they go (the first
    ranks take the remainder)."""
    if n % multiple:
        raise SpecdecError(f"cannot split {n} by {multiple}")
    units = n // multiple
    if units < world:
        raise SpecdecError(f"cannot split {n} into {world} shares of whole blocks of {multiple}")
    bounds, start = [], 0
    for r in range(world):
        size = (units // world + (r < units % world)) * multiple
        bounds.append((start, start + size))
        start += size
    return bounds


def block_of(weight: torch.Tensor | QuantWeight) -> int:
    """The column granularity a matrix can be cut at: its largest block (1 for a float matrix)."""
    return max(fmt.block for _, fmt in weight.parts) if isinstance(weight, QuantWeight) else 1


def take_rows(weight: torch.Tensor | QuantWeight, ranges: list[tuple[int, int]]) -> torch.Tensor | QuantWeight:
    """The rows in `ranges`, in order, of a float or block-quantized matrix (rows are independent)."""
    if not isinstance(weight, QuantWeight):
        return torch.cat([weight[a:b] for a, b in ranges]).contiguous()
    parts, offset = [], 0
    for data, fmt in weight.parts:
        for a, b in ranges:
            lo, hi = max(a, offset), min(b, offset + data.shape[0])
            if lo < hi:
                parts.append((data[lo - offset:hi - offset].contiguous(), fmt))
        offset += data.shape[0]
    return QuantWeight(parts, weight.in_features)


def take_columns(weight: torch.Tensor | QuantWeight, start: int, end: int, name: str) -> torch.Tensor | QuantWeight:
    """Input columns [start, end) of a float or block-quantized matrix; quantized, only whole blocks."""
    if not isinstance(weight, QuantWeight):
        return weight[:, start:end].contiguous()
    parts = []
    for data, fmt in weight.parts:
        if start % fmt.block or end % fmt.block:
            raise SpecdecError(f"tensor parallel: {name} would be cut inside a {fmt.name} block of {fmt.block} "
                               f"weights (columns {start}..{end}); choose a tensor_parallel_size that splits it "
                               "on block boundaries, or load the model in float32/bfloat16")
        per_block = fmt.bytes
        parts.append((data[:, start // fmt.block * per_block:end // fmt.block * per_block].contiguous(), fmt))
    return QuantWeight(parts, end - start)


@dataclass(frozen=True)
class Shares:
    """One rank's share of a model: K/V-head groups, intermediate units and vocabulary rows."""

    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: list[tuple[int, int]]  # every rank's vocabulary rows (the gather needs all sizes)


def plan(cfg: ModelConfig, tp: TPGroup, mlp_block: int = 1, vocab_block: int = 1) -> Shares:
    """How `cfg` splits over tp.world ranks; a SpecdecError naming the reason when it cannot."""
    if tp.world > 1 and (cfg.kv_lora_rank or cfg.moe_layers):
        raise SpecdecError(f"tensor_parallel_size={tp.world}: {cfg.model_type} ("
                           f"{'latent attention' if cfg.kv_lora_rank else 'mixture of experts'}) runs on one rank only")
    if cfg.num_key_value_heads < tp.world:
        raise SpecdecError(f"tensor_parallel_size={tp.world} exceeds the model's {cfg.num_key_value_heads} "
                           "key/value heads (attention is split by key/value-head groups)")
    try:
        mlp = split(cfg.intermediate_size, tp.world, mlp_block)
        vocab = split(cfg.vocab_size, tp.world, vocab_block)
    except SpecdecError as e:
        raise SpecdecError(f"tensor_parallel_size={tp.world}: {e}") from None
    return Shares(split(cfg.num_key_value_heads, tp.world)[tp.rank], mlp[tp.rank], vocab)


def local_config(cfg: ModelConfig, shares: Shares) -> ModelConfig:
    """The config of one rank's layers: its heads and intermediate units (head_dim unchanged)."""
    groups = shares.kv_heads[1] - shares.kv_heads[0]
    per_group = cfg.num_attention_heads // cfg.num_key_value_heads
    return dataclasses.replace(cfg, num_attention_heads=groups * per_group, num_key_value_heads=groups,
                               intermediate_size=shares.intermediate[1] - shares.intermediate[0])


def check_split(model: LlamaModel, world: int) -> None:
    """Refuse, naming the reason, a model that cannot be split over `world` ranks (before any rank starts)."""
    first = model.layers[0]
    plan(model.config, TPGroup(0, world), block_of(first.down_proj.weight))
    D, r = model.config.head_dim, model.config.num_attention_heads // model.config.num_key_value_heads
    for g0, g1 in split(model.config.num_key_value_heads, world):
        take_columns(first.o_proj.weight, g0 * r * D, g1 * r * D, "o_proj")


def shard_model(model: LlamaModel, tp: TPGroup) -> None:
    """Keep this rank's share of every decoder layer and of the LM head, in place (see the module docstring).
    The model's `embed_tokens` and full `lm_head` stay for drafters that read them (EAGLE's target head);
    the target's own logits come from the shard (`LlamaModel.compute_logits` gathers them)."""
    cfg = model.config
    first = model.layers[0]
    shares = plan(cfg, tp, block_of(first.down_proj.weight), 1)
    local = local_config(cfg, shares)
    D, r = cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    g0, g1 = shares.kv_heads
    i0, i1 = shares.intermediate
    q_size, kv_size, inter = cfg.num_attention_heads * D, cfg.num_key_value_heads * D, cfg.intermediate_size
    qkv_rows = [(g0 * r * D, g1 * r * D), (q_size + g0 * D, q_size + g1 * D),
                (q_size + kv_size + g0 * D, q_size + kv_size + g1 * D)]
    for i, layer in enumerate(model.layers):
        _put(layer.qkv_proj, "weight", take_rows(_data(layer.qkv_proj.weight), qkv_rows))
        if layer.qkv_proj.bias is not None:
            _put(layer.qkv_proj, "bias", torch.cat([layer.qkv_proj.bias.data[a:b] for a, b in qkv_rows]))
        _put(layer.o_proj, "weight", take_columns(_data(layer.o_proj.weight), g0 * r * D, g1 * r * D,
                                                  f"layer {i} o_proj"))
        _put(layer.gate_up_proj, "weight", take_rows(_data(layer.gate_up_proj.weight),
                                                     [(i0, i1), (inter + i0, inter + i1)]))
        _put(layer.down_proj, "weight", take_columns(_data(layer.down_proj.weight), i0, i1, f"layer {i} down_proj"))
        layer.num_heads, layer.num_kv_heads = local.num_attention_heads, local.num_key_value_heads
        layer.q_size, layer.kv_size = local.num_attention_heads * D, local.num_key_value_heads * D
        layer.tp = tp
    v0, v1 = shares.vocab[tp.rank]
    model.lm_shard = take_rows(_data(model.lm_head), [(v0, v1)])
    model.vocab_sizes = [b - a for a, b in shares.vocab]
    model.tp, model.kv_config = tp, local
    model.weights_changed()


def _data(weight: torch.Tensor | QuantWeight):
    return weight.data if isinstance(weight, torch.nn.Parameter) else weight


def _put(module: torch.nn.Module, attr: str, value: torch.Tensor | QuantWeight) -> None:
    """Replace a module's weight or bias by its shard (a Parameter again, or a quantized matrix)."""
    module._parameters.pop(attr, None)
    setattr(module, attr, value if isinstance(value, QuantWeight) else torch.nn.Parameter(value, requires_grad=False))
