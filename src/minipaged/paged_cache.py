"""Paged KV cache: per-layer K/V pools, a free-list block allocator, block tables.

Layout per layer: k_caches[l], v_caches[l] of shape [num_blocks, block_size, Hkv, D].
A sequence owns a list of blocks; token position p of a sequence lives in
block `table[p // block_size]` at offset `p % block_size`, i.e. at slot
`table[p // block_size] * block_size + p % block_size`.

Every mutation checks first and then commits, so a CacheFullError leaves the
cache exactly as it was: no half-allocated sequence, no other sequence touched.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable, Iterable

import torch


HEAD_DIMS = (64, 128, 256)
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_device(device) -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but torch sees no CUDA device")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev


class CacheFullError(RuntimeError):
    """Not enough free blocks for the request; the cache is unchanged."""


class PagedKVCache:
    """Block allocator plus K/V tensors for `num_layers` layers.

    Args:
        num_layers: number of attention layers (one K and one V pool each).
        num_kv_heads: Hkv.
        head_dim: D.
        num_blocks: pages per pool.
        block_size: tokens per page, a power of two in 1..256.
        dtype, device: of the pools.

    Pools: `k_caches[l]`, `v_caches[l]`: [num_blocks, block_size, Hkv, D].
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float16,
        device: str | torch.device = "cpu",
    ):
        for name, val in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                          ("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if not (1 <= block_size <= 256) or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {block_size}")
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {list(HEAD_DIMS)} (what the kernels support), got {head_dim}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
        if dtype not in CACHE_DTYPES:
            raise TypeError(f"dtype must be one of {[str(d) for d in CACHE_DTYPES]}, got {dtype}")
        device = _check_device(device)
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # One allocation per K and V; layers are contiguous views into it.
        self._k = torch.empty(shape, dtype=dtype, device=self.device)
        self._v = torch.empty(shape, dtype=dtype, device=self.device)
        self.k_caches = list(self._k.unbind(0))
        self.v_caches = list(self._v.unbind(0))
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    @property
    def seq_ids(self) -> list[Hashable]:
        return list(self._tables)

    def seq_len(self, seq_id: Hashable) -> int:
        return self._lens[self._known(seq_id)]

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._tables[self._known(seq_id)])

    def blocks_needed(self, seq_id: Hashable | None, num_new_tokens: int) -> int:
        """Extra blocks that adding `num_new_tokens` to `seq_id` (None: a new sequence) takes."""
        cur = 0 if seq_id is None else self._lens[self._known(seq_id)]
        have = 0 if seq_id is None else len(self._tables[seq_id])
        return max(0, -(-(cur + num_new_tokens) // self.block_size) - have)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(None, num_tokens) <= self.num_free_blocks

    def can_append(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= self.num_free_blocks

    # ------------------------------------------------------------------ mutations

    def allocate(self, seq_id: Hashable, num_tokens: int, *, return_slots: bool = True) -> torch.Tensor | None:
        """Start sequence `seq_id` with room for `num_tokens`; returns their int64 slots [num_tokens]
        (None with return_slots=False: a hot loop that computes slots itself skips the tensor)."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        self._count("num_tokens", num_tokens)
        need = self.blocks_needed(None, num_tokens)
        self._reserve(need, f"allocate {num_tokens} tokens for sequence {seq_id!r}")
        self._tables[seq_id] = [self._free.popleft() for _ in range(need)]
        self._lens[seq_id] = num_tokens
        return self.slot_mapping(seq_id, 0, num_tokens) if return_slots else None

    def append(self, seq_id: Hashable, num_tokens: int = 1, *, return_slots: bool = True) -> torch.Tensor | None:
        """Grow `seq_id` by `num_tokens`; returns the new tokens' int64 slots (None with return_slots=False)."""
        self._known(seq_id)
        self._count("num_tokens", num_tokens)
        need = self.blocks_needed(seq_id, num_tokens)
        self._reserve(need, f"append {num_tokens} tokens to sequence {seq_id!r}")
        self._tables[seq_id].extend(self._free.popleft() for _ in range(need))
        start = self._lens[seq_id]
        self._lens[seq_id] = start + num_tokens
        return self.slot_mapping(seq_id, start, start + num_tokens) if return_slots else None

    def free(self, seq_id: Hashable) -> None:
        """Return every block of `seq_id` to the pool."""
        self._known(seq_id)
        self._free.extend(self._tables.pop(seq_id))
        del self._lens[seq_id]

    # ------------------------------------------------------------------ tensors

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> torch.Tensor:
        """int64 [end - start]: the slots of positions start..end-1 of `seq_id`."""
        table = self._tables[self._known(seq_id)]
        if not (0 <= start <= end <= self._lens[seq_id]):
            raise ValueError(f"positions [{start}, {end}) are outside sequence {seq_id!r} of length {self._lens[seq_id]}")
        pos = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.int64)[pos // self.block_size] if end > start else pos
        return (blocks * self.block_size + pos % self.block_size).to(self.device)

    def block_tables(self, seq_ids: Iterable[Hashable], pad: int = -1) -> torch.Tensor:
        """int32 [B, max_blocks] on the cache device; short rows are padded with `pad`."""
        rows = [self._tables[self._known(s)] for s in seq_ids]
        width = max((len(r) for r in rows), default=0)
        out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.int32)
        for i, r in enumerate(rows):
            if r:
                out[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        return out.to(self.device)

    def context_lens(self, seq_ids: Iterable[Hashable]) -> torch.Tensor:
        """int32 [B] on the cache device: cached tokens per sequence."""
        return torch.tensor([self._lens[self._known(s)] for s in seq_ids], dtype=torch.int32).to(self.device)

    # ------------------------------------------------------------------ helpers

    def _known(self, seq_id: Hashable) -> Hashable:
        if seq_id not in self._tables:
            raise KeyError(f"unknown sequence {seq_id!r}")
        return seq_id

    @staticmethod
    def _count(name: str, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be a non-negative int, got {n!r}")

    def _reserve(self, need: int, what: str) -> None:
        if need > len(self._free):
            raise CacheFullError(
                f"cannot {what}: needs {need} free blocks of {self.block_size} tokens, "
                f"{len(self._free)} of {self.num_blocks} are free"
            )

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(layers={self.num_layers}, blocks={self.num_blocks}x{self.block_size}, "
            f"Hkv={self.num_kv_heads}, D={self.head_dim}, {self.dtype}, {self.device}, "
            f"free={self.num_free_blocks}, seqs={len(self._tables)})"
        )
