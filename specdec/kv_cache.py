"""Paged KV cache: a block allocator, per-sequence block tables, and the KV tensors (pools).

Memory layout (one pool per model; a draft model gets its own pool over the same block tables):

    pool.k[layer]: [num_blocks * block_size, num_kv_heads, head_dim]
                    |-- block 0 --|-- block 1 --| ...      block 0 is the null block: padding writes land there
    block_table(seq) = [7, 3, 12]  ->  token at position p lives in slot block_table[p // bs] * bs + p % bs

`paged_inputs` lays a step's tokens out over this cache: where each new token's K/V go and which slots each
query reads.

Prefix caching (Meta's persistent KV): once a block is full of committed tokens it is keyed by a hash of
every token up to its end (chained block by block, so a key names the whole prefix). Blocks are reference
counted: a new request whose prompt starts with a cached prefix shares those blocks instead of prefilling
them; a block nobody holds but that has a key is kept in an LRU pool and only evicted when no truly free
block is left. Draft KV pools live over the same blocks, so target and draft caches hit and evict together.
"""
from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from specdec.config import ModelConfig
from specdec.models.blocks.attention import AttentionMetadata
from specdec.models.cpu import native

NULL_BLOCK = 0
# Tests set SPECDEC_KV_FILL=nan: every block an allocation hands out is first filled with NaN in every pool over
# the blocks, so a kernel that reads a slot nobody wrote since (even with probability 0: 0 x NaN = NaN) fails at
# once, instead of depending on what earlier sequences or tests left there.
FILL_ENV = "SPECDEC_KV_FILL"


def debug_fill() -> float | None:
    value = os.environ.get(FILL_ENV)
    return None if value is None else float(value)


def pool_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An uninitialized pool: on the CPU on 2 MB pages where the native kernels load (every step reads the
    pools' recent blocks: 4 KB pages cost TLB misses and stop the prefetchers at each page), else torch.empty."""
    if torch.device(device).type == "cpu" and native.available():
        return native.ops().huge_empty(list(shape), dtype)
    return torch.empty(shape, dtype=dtype, device=device)


def _v_dim(cfg: ModelConfig) -> int:
    """A value head's width: ModelConfig.v_cache_dim (0 under latent attention), head_dim for a plain geometry."""
    return getattr(cfg, "v_cache_dim", cfg.head_dim)


class KVPool:
    """The K and V tensors of one model for every block."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        shape = (num_blocks * block_size, cfg.num_key_value_heads, cfg.head_dim)
        v_shape = (*shape[:2], _v_dim(cfg))  # latent attention: no value cache of its own
        # empty, not zeros: on CPU untouched pages cost no memory. Only the null block is ever read
        # before being written (by padding queries), so only it must hold finite values.
        self.block_size = block_size
        # How far back a query reads: the widest window when every layer has one (a key further back than that
        # is never read again), 0 when some layer sees every key.
        windows = [cfg.window(i) if hasattr(cfg, "window") else 0 for i in range(cfg.num_hidden_layers)]
        self.reach = max(windows) if windows and min(windows) > 0 else 0
        self.k = [pool_tensor(shape, dtype, device) for _ in range(cfg.num_hidden_layers)]
        self.v = [pool_tensor(v_shape, dtype, device) if v_shape[-1] else torch.empty(v_shape, dtype=dtype,
                                                                                      device=device)
                  for _ in range(cfg.num_hidden_layers)]
        for t in self.k + self.v:
            t[NULL_BLOCK * block_size:(NULL_BLOCK + 1) * block_size].zero_()

    def fill(self, blocks: list[int], value: float) -> None:
        """Set every slot of `blocks` to `value` in every layer (SPECDEC_KV_FILL: see BlockAllocator.allocate)."""
        bs = self.block_size
        index = (torch.tensor(blocks)[:, None] * bs + torch.arange(bs)).reshape(-1).to(self.k[0].device)
        for t in self.k + self.v:
            t.index_fill_(0, index, value)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * (cfg.head_dim + _v_dim(cfg)) * elem


class OutOfBlocks(RuntimeError):
    """Raised when an allocation cannot be satisfied; the scheduler preempts instead of crashing."""


@dataclass
class BlockTable:
    """The blocks one sequence owns, in order; `keys[i]` is block i's prefix key once it is registered."""

    blocks: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """Key of a full block: a 128-bit digest of the parent block's key and this block's tokens."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockAllocator:
    """Hands out KV blocks and takes them back; sequences grow, rewind and free through it."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 match_next_token: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is the null block), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        # A drafter whose K/V at slot t also encode token t + 1 (EAGLE pairs the feature of token t with token
        # t + 1) writes a block's last slot from the token after the block: a cached block is then reused only
        # by a prefix that goes on with that same token.
        self.match_next_token = match_next_token
        self.free_blocks: list[int] = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() gives low ids first
        self.ref_count = [0] * num_blocks
        self.block_of: dict[bytes, int] = {}  # prefix key -> block holding it
        self.key_of: dict[int, bytes] = {}
        self.next_token: dict[int, int] = {}  # cached block -> the token that followed it when it was registered
        self.evictable: OrderedDict[int, None] = OrderedDict()  # keyed blocks nobody holds, oldest first
        self.prefix_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of those, tokens whose K/V were reused
        # The K/V pools over these blocks (target's and drafters'): under SPECDEC_KV_FILL every block handed out
        # is filled in each of them first.
        self.pools: list[KVPool] = []
        self.fill_value = debug_fill()

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones, then cached ones nobody holds (evicted on demand)."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used(self) -> int:
        """Blocks held by sequences (not counting those kept only by the prefix cache)."""
        return self.num_blocks - 1 - self.num_free

    @property
    def num_cached_free(self) -> int:
        return len(self.evictable)

    def blocks_needed(self, table: BlockTable, num_tokens: int) -> int:
        """Blocks to add so that `table` holds `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(table.blocks))

    def can_allocate(self, table: BlockTable, num_tokens: int) -> bool:
        return self.blocks_needed(table, num_tokens) <= self.num_free

    def allocate(self, table: BlockTable, num_tokens: int) -> None:
        """Grow `table` to hold `num_tokens` tokens."""
        need = self.blocks_needed(table, num_tokens)
        if need > self.num_free:
            raise OutOfBlocks(f"need {need} KV blocks, {self.num_free} free")
        for _ in range(need):
            if self.free_blocks:
                block = self.free_blocks.pop()
            else:  # evict the least recently used cached block
                block, _ = self.evictable.popitem(last=False)
                del self.block_of[self.key_of.pop(block)]
                self.next_token.pop(block, None)
            self.ref_count[block] = 1
            table.blocks.append(block)
        if need and self.fill_value is not None:
            for pool in self.pools:
                pool.fill(table.blocks[-need:], self.fill_value)

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Rewind `table` to `num_tokens` tokens; blocks past the end go back to the pool."""
        keep = -(-num_tokens // self.block_size)
        while len(table.blocks) > keep:
            self._release(table.blocks.pop())
        del table.keys[keep:]

    def free(self, table: BlockTable) -> None:
        self.truncate(table, 0)

    @property
    def reach(self) -> int:
        """How many positions back any pool's query reads (every layer of every pool windowed); 0: unbounded."""
        reaches = [pool.reach for pool in self.pools]
        return max(reaches) if reaches and min(reaches) > 0 else 0

    def release_behind(self, table: BlockTable, num_tokens: int) -> None:
        """Free the blocks no query can read again once the first `num_tokens` tokens are committed: the next
        query is at position num_tokens or later, and reads keys after position - reach (a sliding window on every
        layer of every pool over these blocks). The table keeps the null block in their place, so positions still
        map to table entries (a window masks them). With prefix caching only blocks already keyed are released:
        they stay in the cache for a request with the same prefix, and no entry is keyed twice."""
        reach = self.reach
        if not reach:
            return
        behind = (num_tokens - reach + 1) // self.block_size  # blocks wholly before the first readable position
        if self.enable_prefix_caching:
            behind = min(behind, len(table.keys))
        for b in range(min(behind, len(table.blocks))):
            if table.blocks[b] != NULL_BLOCK:
                self._release(table.blocks[b])
                table.blocks[b] = NULL_BLOCK

    def _release(self, block: int) -> None:
        if block == NULL_BLOCK:  # an entry a window left behind (`release_behind`)
            return
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            if block in self.key_of:
                self.evictable[block] = None  # most recently used last
            else:
                self.free_blocks.append(block)

    # -- prefix caching ---------------------------------------------------------------------------
    def admit(self, table: BlockTable, token_ids: list[int], max_new: int, use_cache: bool = True) -> int | None:
        """Give an empty `table` the cached blocks of the longest cached prefix of `token_ids` (never the
        last token: it must be fed to get logits; with `match_next_token`, only blocks followed by the same
        token as here; none without `use_cache`), then grow it by up to `max_new` of the remaining tokens.
        Returns how many tokens came from the cache, or None (nothing changed) when blocks are short."""
        assert not table.blocks, "admit() starts a sequence's table"
        hits: list[tuple[int, bytes]] = []
        if self.enable_prefix_caching and use_cache:
            key, bs = b"", self.block_size
            for b in range((len(token_ids) - 1) // bs):
                key = block_key(key, token_ids[b * bs:(b + 1) * bs])
                block = self.block_of.get(key)
                if block is None or self.match_next_token and self.next_token.get(block) != token_ids[(b + 1) * bs]:
                    break
                hits.append((block, key))
        num_hit = len(hits) * self.block_size
        num_tokens = min(len(token_ids) - num_hit, max_new)
        reused_idle = sum(1 for block, _ in hits if block in self.evictable)
        need = -(-(num_hit + num_tokens) // self.block_size) - len(hits)
        if need > self.num_free - reused_idle:
            return None
        for block, key in hits:
            self.evictable.pop(block, None)
            self.ref_count[block] += 1
            table.blocks.append(block)
            table.keys.append(key)
        self.allocate(table, num_hit + num_tokens)
        self.prefix_queried_tokens += len(token_ids)
        self.prefix_hit_tokens += num_hit
        return num_hit

    def register(self, table: BlockTable, token_ids: list[int], num_tokens: int) -> None:
        """Key the full blocks among the first `num_tokens` tokens (whose K/V, target's and drafts', are final)
        so that later requests can reuse them; each remembers the token that followed it (`match_next_token`)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for b in range(len(table.keys), min(num_tokens // bs, len(table.blocks))):
            key = block_key(table.keys[-1] if table.keys else b"", token_ids[b * bs:(b + 1) * bs])
            table.keys.append(key)
            block = table.blocks[b]
            if key not in self.block_of and block not in self.key_of:  # else an identical block is cached
                self.block_of[key], self.key_of[block] = block, key
                if (b + 1) * bs < len(token_ids):
                    self.next_token[block] = token_ids[(b + 1) * bs]

    def slots(self, table: BlockTable, start: int, end: int) -> list[int]:
        """Flat slot indices of positions [start, end)."""
        bs = self.block_size
        return [table.blocks[p // bs] * bs + p % bs for p in range(start, end)]


def paged_inputs(tables: list[list[int]], starts: list[int], feeds: list[list[int]], trees: list | None = None, *,
                 block_size: int, device: torch.device | str = "cpu"
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Tensors for feeding `feeds[i]` into slots starts[i].. of the sequence owning blocks tables[i]:
    consecutive and causal, or in the layout of trees[i] when given (a `tree.TreeFeed`: each row's slot
    offset, rotary offset, and which slots from starts[i] on it sees).

        tokens, positions: [T]      every sequence's new tokens, flattened (no padding)
        context:           [B, L]   every slot sequence i attends: its cached prefix + this step's tokens

    A step without trees is built in one native call where the kernels load (`causal_inputs`: the same arrays),
    else with numpy (a step's layout is a few small arrays; torch's per-op cost would dominate it).
    """
    on_cpu = device == "cpu" or torch.device(device).type == "cpu"
    if feeds and on_cpu and (trees is None or all(t is None for t in trees)) and native.available():
        tokens, positions, slot_mapping, context_slots, mask, query_starts = native.ops().causal_inputs(
            tables, starts, feeds, block_size, NULL_BLOCK)
        num_new = [len(f) for f in feeds]
        return tokens, positions, AttentionMetadata(slot_mapping, context_slots, mask, num_new,
                                                    [start + n for start, n in zip(starts, num_new)],
                                                    query_starts=query_starts)
    trees = trees or [None] * len(feeds)
    num_new = [len(f) for f in feeds]
    B, S = len(feeds), max(num_new)
    bs = block_size
    ends_list = [start + (n if t is None else t.visible.shape[1]) for start, n, t in zip(starts, num_new, trees)]
    ends, L = np.array(ends_list), max(ends_list)
    padded_index = np.full((B, S), -1, dtype=np.int64)  # slot index in the sequence, -1 = padding
    block_tables = np.full((B, -(-L // bs)), NULL_BLOCK, dtype=np.int64)
    for i, (start, n, blocks) in enumerate(zip(starts, num_new, tables)):
        padded_index[i, :n] = start + (np.arange(n) if trees[i] is None else np.asarray(trees[i].index))
        blocks = blocks[: block_tables.shape[1]]
        block_tables[i, : len(blocks)] = blocks
    pos = np.arange(L)
    valid = pos[None, :] < ends[:, None]  # [B, L]
    context_slots = np.where(valid, block_tables[:, pos // bs] * bs + pos % bs, NULL_BLOCK * bs)
    is_new = padded_index >= 0
    rows, _ = np.nonzero(is_new)
    slot_mapping = context_slots[rows, padded_index[is_new]]
    # causal: a query sees every valid key at a position <= its own; a padding query still sees one key, so its
    # softmax stays finite
    mask = valid[:, None, :] & (pos[None, None, :] <= padded_index[:, :, None])  # [B, S, L]
    mask[:, :, 0] |= padded_index < 0
    rope = padded_index.copy()
    for i, tree in enumerate(trees):
        if tree is not None:
            n, start = len(tree.index), starts[i]
            rope[i, :n] = start + np.asarray(tree.rope)
            mask[i, :n, start:start + tree.visible.shape[1]] = tree.visible.numpy()
    meta = AttentionMetadata(torch.from_numpy(slot_mapping), torch.from_numpy(context_slots), torch.from_numpy(mask),
                             num_new, ends_list, list(starts) if any(t is not None for t in trees) else None)
    tokens = torch.from_numpy(np.array([t for f in feeds for t in f], dtype=np.int64))
    positions = torch.from_numpy(rope[is_new])
    if device != "cpu" and torch.device(device).type != "cpu":
        meta, tokens, positions = meta.to(device), tokens.to(device), positions.to(device)
    return tokens, positions, meta
