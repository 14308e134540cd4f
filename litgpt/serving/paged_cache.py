"""A paged KV cache: keys and values live in a pool of fixed-size blocks that sequences take as they grow and give back
when they end (the layout of vLLM's PagedAttention, arXiv:2309.06180), so memory follows the tokens in flight
instead of reserving the model's whole context for every row.

A sequence's block table lists its blocks in order: position p of the sequence lives in block table[p // page_size]
at offset p % page_size. Each forward pass the engine says where its tokens go (`PagedBatch.slots`) and which
positions each row reads (`PagedBatch.reads`); every layer's `PagedKVCache` writes the new keys and values there and
hands attention each row's positions 0..length-1 gathered from the pool, with the model's usual position mask. Block 0
is never handed out: the padding of a batch writes there and unused table entries read from it (masked).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from litgpt.errors import UserError

NULL_BLOCK = 0


class PagedBatch:
    """Where one forward pass writes and reads, shared by every layer's cache: `slots` (B, T) the pool slot of each
    input token, `reads` (B, L) the pool slot of each row's positions 0..L-1."""

    def __init__(self) -> None:
        self.slots: Optional[torch.Tensor] = None
        self.reads: Optional[torch.Tensor] = None


class PagedKVCache(nn.Module):
    """One layer's pool of `num_blocks` blocks of `page_size` positions: keys (slots, groups, k_size) and values
    (slots, groups, v_size) flattened by slot; the `update` of the static `KVCache`, reading the slots of `batch`."""

    def __init__(self, num_blocks: int, page_size: int, groups: int, k_size: int, v_size: int, latent: bool,
                 batch: PagedBatch, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.latent, self.batch = latent, batch
        slots = num_blocks * page_size
        self.register_buffer("k", torch.zeros(slots, groups, k_size, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(slots, groups, v_size, device=device, dtype=dtype), persistent=False)

    @property
    def length(self) -> int:
        return self.batch.reads.size(1)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k and v (B, groups, T, size) to the batch's slots; return every row's keys and values at positions
        0..L-1 (B, groups, L, size). `input_pos` is the mask's business: the slots already say where."""
        slots = self.batch.slots
        self.k[slots] = k.transpose(1, 2).to(self.k.dtype)  # (B, T, groups, size) at (B, T) slots
        self.v[slots] = v.transpose(1, 2).to(self.v.dtype)
        reads = self.batch.reads
        return self.k[reads].transpose(1, 2), self.v[reads].transpose(1, 2)


@dataclass(frozen=True)
class CacheShape:
    """What one token costs in every layer's cache, as the layers' own `new_kv_cache` lays it out."""

    layers: list[tuple[int, int, int, bool]]  # (groups, k_size, v_size, latent) per layer
    element_bytes: int

    @classmethod
    def of(cls, model, dtype: torch.dtype) -> "CacheShape":
        layers = []
        for block in model.transformer.h:
            cache = block.attn.new_kv_cache(1, 1, device="meta", dtype=dtype)
            layers.append((cache.k.size(1), cache.k.size(3), cache.v.size(3), cache.latent))
        return cls(layers, torch.empty((), dtype=dtype).element_size())

    @property
    def bytes_per_token(self) -> int:
        return sum(groups * (k + v) for groups, k, v, _ in self.layers) * self.element_bytes


@dataclass(frozen=True)
class CachePlan:
    """How many blocks the pool has and the longest sequence served."""

    num_blocks: int  # including the null block
    page_size: int
    max_seq_length: int
    bytes: int

    @property
    def tokens(self) -> int:
        return (self.num_blocks - 1) * self.page_size

    def describe(self) -> str:
        return (f"KV cache: {self.num_blocks - 1} blocks of {self.page_size} tokens = {self.tokens} tokens "
                f"({self.bytes / 2**30:.2f} GiB); sequences of up to {self.max_seq_length} tokens")


def free_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on `device`: the CUDA allocator's free memory, or the host's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def plan_cache(shape: CacheShape, block_size: int, page_size: int, max_batch_size: int,
               max_seq_length: Optional[int], kv_cache_gb: Optional[float], kv_cache_fraction: float,
               free_bytes: int) -> CachePlan:
    """Size the pool: `kv_cache_gb`, else `kv_cache_fraction` of `free_bytes`, but no more than `max_batch_size`
    sequences of `max_seq_length` need. Without `max_seq_length` sequences may grow to the model's context or to what
    the budget holds, whichever is shorter; an explicit one that the budget cannot hold once is an error."""
    if page_size < 1:
        raise UserError(f"kv_block_size must be >= 1, got {page_size}.")
    if max_seq_length is not None and not 2 <= max_seq_length <= block_size:
        raise UserError(f"max_seq_length must be in [2, {block_size}] (the model's context), got {max_seq_length}.")
    if kv_cache_gb is not None and not kv_cache_gb > 0:
        raise UserError(f"kv_cache_gb must be > 0, got {kv_cache_gb}.")
    if not 0 < kv_cache_fraction <= 1:
        raise UserError(f"kv_cache_fraction must be in (0, 1], got {kv_cache_fraction}.")
    budget = int(kv_cache_gb * 2**30) if kv_cache_gb is not None else int(kv_cache_fraction * free_bytes)
    block_bytes = shape.bytes_per_token * page_size
    affordable = budget // block_bytes
    wanted_length = max_seq_length or block_size
    needed = max_batch_size * -(-wanted_length // page_size)
    blocks = min(affordable, needed)
    if max_seq_length is None:
        max_seq_length = min(block_size, blocks * page_size)
    if blocks * page_size < max(max_seq_length, 2):
        where = f"--kv_cache_gb {kv_cache_gb}" if kv_cache_gb is not None else (
            f"{kv_cache_fraction:.0%} of the {free_bytes / 2**30:.2f} GiB free")
        raise UserError(
            f"The KV cache budget ({where}: {budget / 2**30:.3f} GiB) holds {blocks * page_size} tokens at "
            f"{shape.bytes_per_token} bytes a token, fewer than one sequence of {max(max_seq_length, 2)}: raise "
            "--kv_cache_gb or --kv_cache_fraction, or lower --max_seq_length."
        )
    return CachePlan(blocks + 1, page_size, max_seq_length, (blocks + 1) * block_bytes)


class BlockPool:
    """The free blocks of the pool (block 0, the null block, is never handed out)."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, NULL_BLOCK, -1))  # popped from the end: lowest ids first

    def take(self, count: int) -> list[int]:
        taken, self.free = self.free[len(self.free) - count:], self.free[: len(self.free) - count]
        return taken[::-1]

    def give_back(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))


def attach_paged_cache(model, plan: CachePlan, device: torch.device, dtype: torch.dtype) -> PagedBatch:
    """Give every layer of `model` its block pool; returns the `PagedBatch` the engine fills before each pass."""
    batch = PagedBatch()
    for block, (groups, k_size, v_size, latent) in zip(model.transformer.h, CacheShape.of(model, dtype).layers):
        block.attn.kv_cache = PagedKVCache(plan.num_blocks, plan.page_size, groups, k_size, v_size, latent, batch,
                                           device, dtype)
    return batch
