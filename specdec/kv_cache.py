"""Paged KV cache: a block allocator, per-sequence block tables, and the KV tensors (pools).

Memory layout (one pool per model; a draft model gets its own pool over the same block tables):

    pool.k[layer]: [num_blocks * block_size, num_kv_heads, head_dim]
                    |-- block 0 --|-- block 1 --| ...      block 0 is the null block: padding writes land there
    block_table(seq) = [7, 3, 12]  ->  token at position p lives in slot block_table[p // bs] * bs + p % bs

Blocks carry reference counts so that a later prefix cache can share full blocks between sequences.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.config import ModelConfig

NULL_BLOCK = 0


class KVPool:
    """The K and V tensors of one model for every block."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> None:
        shape = (num_blocks * block_size, cfg.num_key_value_heads, cfg.head_dim)
        # empty, not zeros: on CPU untouched pages cost no memory. Only the null block is ever read
        # before being written (by padding queries), so only it must hold finite values.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        for t in self.k + self.v:
            t[NULL_BLOCK * block_size:(NULL_BLOCK + 1) * block_size].zero_()

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


class OutOfBlocks(RuntimeError):
    """Raised when an allocation cannot be satisfied; the scheduler preempts instead of crashing."""


@dataclass
class BlockTable:
    """The blocks one sequence owns, in order."""

    blocks: list[int] = field(default_factory=list)


class BlockAllocator:
    """Hands out KV blocks and takes them back; sequences grow, rewind and free through it."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is the null block), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: list[int] = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() gives low ids first
        self.ref_count = [0] * num_blocks
        self.num_cached_free = 0  # blocks kept only by the prefix cache
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self.free_blocks)

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
            block = self.free_blocks.pop()
            self.ref_count[block] = 1
            table.blocks.append(block)

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Rewind `table` to `num_tokens` tokens; blocks past the end go back to the pool."""
        keep = -(-num_tokens // self.block_size)
        while len(table.blocks) > keep:
            self._release(table.blocks.pop())

    def free(self, table: BlockTable) -> None:
        self.truncate(table, 0)

    def _release(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free_blocks.append(block)

    def slots(self, table: BlockTable, start: int, end: int) -> list[int]:
        """Flat slot indices of positions [start, end)."""
        bs = self.block_size
        return [table.blocks[p // bs] * bs + p % bs for p in range(start, end)]
