"""Paged KV cache: per-layer K/V pools, a refcounting block allocator with
prefix caching, block tables.

Layout per layer: k_caches[l], v_caches[l] of shape [num_blocks, block_size, Hkv, D].
A sequence owns a list of blocks; token position p of a sequence lives in
block `table[p // block_size]` at offset `p % block_size`, i.e. at slot
`table[p // block_size] * block_size + p % block_size`.

Prefix caching: once a block is full and its K/V are written, `commit()` names
it by a hash of its token ids chained with the previous block's hash. A new
sequence allocated with `token_ids` reuses (shares, refcounted) the cached
blocks of its longest cached prefix and only needs new blocks for the rest.
A named block is never written again. When its last reference goes it stays
cached ("evictable") and is reused by a later hit, or evicted, least recently
released first, when a new block is needed and no empty block is left.

Every mutation checks first and then commits, so a CacheFullError leaves the
cache exactly as it was: no half-allocated sequence, no other sequence touched.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from typing import Hashable, Iterable, Sequence

import numpy as np
import torch

from .api import MAX_BLOCK_SIZE, _tensor, is_block_size, positive_float32, real_number

try:  # a fast, process-stable hash; blake2b is the (slower, equally stable) fallback
    import xxhash

    def _block_hash_bytes(prev: int, data: bytes) -> int:
        """The chained hash of a block from its tokens' int64 bytes and the previous block's hash."""
        return xxhash.xxh3_64_intdigest(data, seed=prev)
except ImportError:  # pragma: no cover - xxhash is a dependency; kept for stripped environments
    def _block_hash_bytes(prev: int, data: bytes) -> int:
        h = hashlib.blake2b(data, digest_size=8, key=prev.to_bytes(8, "little"))
        return int.from_bytes(h.digest(), "little")


def _token_bytes(token_ids: Sequence[int], start: int, stop: int) -> bytes:
    """Tokens [start, stop) as int64 bytes: the hash input of the blocks they make up
    (block i of them at bytes [8 * block_size * i, 8 * block_size * (i + 1))).

    Integers only: a cast to int64 would hash 1.9 as 1 and "7" as 7, so another prompt's cached
    blocks would be reused for tokens that are not its own. array('q') refuses any element that
    is not an integer (one without __index__) at C speed; integer arrays and tensors convert whole."""
    part = token_ids[start:stop]
    if isinstance(part, (np.ndarray, torch.Tensor)):
        arr = np.asarray(part)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise TypeError(f"token ids must be integers, got a {arr.ndim}-D {arr.dtype} array")
        if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise ValueError("token ids must fit in int64")
        return arr.astype(np.int64, copy=False).tobytes()
    if isinstance(part, (str, bytes, bytearray, memoryview)):
        # array('q', b"...") would read the bytes as raw int64 values
        raise TypeError(f"token ids must be a sequence of ints, got {type(token_ids).__name__}")
    try:
        return array("q", part).tobytes()  # native int64, the bytes np.int64 gives
    except OverflowError:
        raise ValueError("token ids must fit in int64") from None
    except TypeError as e:
        raise TypeError(f"token ids must be ints: {e}") from None


HEAD_DIMS = (64, 128, 256)
_MAX_BLOCKS = 2**31 - 1
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)


def _layer_scales(name: str, s, num_layers: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """A cache's k_scale / v_scale as float32 [num_layers, Hkv] (stored value x scale = real value)."""
    if s is None:
        s = 1.0
    if isinstance(s, torch.Tensor):
        # a sparse or nested tensor has no strides: torch's RuntimeError came out of expand() / .shape
        _tensor(name, s)
        # a bool, integer or complex tensor would be cast silently, where a bool scalar is a TypeError
        if not s.is_floating_point():
            raise TypeError(f"{name} must be a positive float or a floating-point tensor, got a {s.dtype} tensor")
        if s.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} is on {s.device}: a scale tensor must be on cpu or cuda")
        t = s.detach().to(dtype=torch.float32)
        if t.shape not in ((), (num_kv_heads,), (num_layers, num_kv_heads)):
            raise ValueError(f"{name} must be a float or a tensor of shape [], [Hkv] = [{num_kv_heads}] or "
                             f"[num_layers, Hkv] = [{num_layers}, {num_kv_heads}], got {tuple(s.shape)}")
        t = t.to(device).expand(num_layers, num_kv_heads).contiguous()
    elif not real_number(s):
        raise TypeError(f"{name} must be a positive float or a float32 tensor, got {type(s).__name__}")
    else:
        t = torch.full((num_layers, num_kv_heads), positive_float32(name, s), dtype=torch.float32, device=device)
    if not bool((torch.isfinite(t) & (t > 0)).all()):
        raise ValueError(f"{name} must be positive and finite, got {t.flatten().tolist()[:8]}")
    return t


def check_device(device) -> torch.device:
    """A cpu or cuda[:N] device that exists here, else ValueError (TypeError for a non-device)."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but torch sees no CUDA device"
                         f"{' (this torch build has no CUDA)' if torch.version.cuda is None else ''}")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev


class CacheFullError(RuntimeError):
    """Not enough free blocks for the request; the cache is unchanged."""


class PagedKVCache:
    """Block allocator (refcounted, with prefix caching) plus K/V tensors for `num_layers` layers.

    Args:
        num_layers: number of attention layers (one K and one V pool each).
        num_kv_heads: Hkv.
        head_dim: D (64, 128 or 256).
        num_blocks: pages per pool.
        block_size: tokens per page, a power of two in 1..256.
        dtype, device: of the pools (float16, bfloat16, float32 or float8_e4m3fn).
        k_scale, v_scale: float8_e4m3fn caches only: a positive float, or a float32 tensor
            [], [Hkv] or [num_layers, Hkv] (default 1.0); kept as `k_scales`/`v_scales`
            [num_layers, Hkv], whose row l is what the ops take for layer l.

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
        k_scale=None,
        v_scale=None,
    ):
        for name, val in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                          ("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if num_blocks > _MAX_BLOCKS:
            raise ValueError(f"num_blocks must be at most {_MAX_BLOCKS} (block ids are int32 table entries), "
                             f"got {num_blocks}")
        if not is_block_size(block_size):
            raise ValueError(f"block_size must be a power of two in [1, {MAX_BLOCK_SIZE}], got {block_size}")
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {list(HEAD_DIMS)} (what the kernels support), got {head_dim}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
        if dtype not in CACHE_DTYPES:
            raise TypeError(f"dtype must be one of {[str(d) for d in CACHE_DTYPES]}, got {dtype}")
        device = check_device(device)
        self.is_fp8 = dtype == torch.float8_e4m3fn
        if not self.is_fp8 and (k_scale is not None or v_scale is not None):
            raise ValueError(f"k_scale/v_scale were given but dtype is {dtype}; scales apply to "
                             "float8_e4m3fn caches only")
        # fp8: float32 [num_layers, Hkv]; layer l's rows are what the ops take as k_scale / v_scale
        self.k_scales = _layer_scales("k_scale", k_scale, num_layers, num_kv_heads, device) if self.is_fp8 else None
        self.v_scales = _layer_scales("v_scale", v_scale, num_layers, num_kv_heads, device) if self.is_fp8 else None
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # One allocation per K and V; layers are contiguous views into it.
        try:
            self._k = torch.empty(shape, dtype=dtype, device=self.device)
            self._v = torch.empty(shape, dtype=dtype, device=self.device)
        except RuntimeError as e:
            if "overflow" not in str(e).lower():
                raise  # out of memory: a failure of this device, not of the arguments
            raise ValueError(f"a KV cache of shape 2 x {list(shape)} has more elements than torch can address") from None
        self.k_caches = list(self._k.unbind(0))
        self.v_caches = list(self._v.unbind(0))
        # Block states: referenced (ref > 0); empty (in _free); cached but unreferenced (in _evictable,
        # least recently released first). A block is in exactly one of them.
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_of: list[int | None] = [None] * num_blocks
        # a named block's tokens as int64 bytes (the hash input), to rule out hash collisions
        self._tokens_of: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._tables: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}
        self._chain: dict[Hashable, list[int]] = {}  # hashes of the sequence's leading full, committed blocks
        self._planned: dict[Hashable, list[int]] = {}  # hashes of every full block of the tokens given at allocation
        self._hit_tokens: dict[Hashable, int] = {}

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: empty ones plus cached ones no sequence references."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a named (hashed) full block, referenced or not."""
        return len(self._by_hash)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    @property
    def seq_ids(self) -> list[Hashable]:
        return list(self._tables)

    def seq_len(self, seq_id: Hashable) -> int:
        return self._lens[self._known(seq_id)]

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._tables[self._known(seq_id)])

    def ref_count(self, block: int) -> int:
        return self._ref[self._block_id(block)]

    def _block_id(self, block) -> int:
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block must be an int in [0, {self.num_blocks}), got {block!r}")
        return block

    def is_cached(self, block: int) -> bool:
        """The block holds a named full block (its K/V must never be written again)."""
        return self._hash_of[self._block_id(block)] is not None

    def prefix_hit_tokens(self, seq_id: Hashable) -> int:
        """Tokens of `seq_id` whose K/V came from cached blocks at allocation (a multiple of block_size)."""
        return self._hit_tokens[self._known(seq_id)]

    def blocks_needed(self, seq_id: Hashable | None, num_new_tokens: int) -> int:
        """Extra blocks that adding `num_new_tokens` to `seq_id` (None: a new sequence) takes."""
        self._count("num_new_tokens", num_new_tokens)
        cur = 0 if seq_id is None else self._lens[self._known(seq_id)]
        have = 0 if seq_id is None else len(self._tables[seq_id])
        return max(0, -(-(cur + num_new_tokens) // self.block_size) - have)

    def can_allocate(self, num_tokens: int, token_ids: Sequence[int] | None = None, *,
                     block_hashes: list[int] | None = None) -> bool:
        """block_hashes: `block_hashes(token_ids)` when the caller already has them (saves rehashing)."""
        self._count("num_tokens", num_tokens)
        hits = self._match(token_ids, block_hashes) if token_ids is not None else []
        return self._fresh_needed(num_tokens, hits) <= self._available(hits)

    def can_append(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= self.num_free_blocks

    def match_prefix(self, token_ids: Sequence[int], *, block_hashes: list[int] | None = None) -> int:
        """Tokens of the longest cached prefix of `token_ids` that an allocation would reuse
        (whole blocks, never the last token: it must be computed to have logits)."""
        return len(self._match(token_ids, block_hashes)) * self.block_size

    # ------------------------------------------------------------------ mutations

    def allocate(self, seq_id: Hashable, num_tokens: int, *, token_ids: Sequence[int] | None = None,
                 block_hashes: list[int] | None = None, return_slots: bool = True) -> torch.Tensor | None:
        """Start sequence `seq_id` with room for `num_tokens`.

        With `token_ids` (the sequence's tokens), the cached blocks of its longest cached
        prefix are shared instead of allocated; `prefix_hit_tokens(seq_id)` says how many
        tokens they hold. Returns the int64 slots [num_tokens - hit] of the positions that
        still need their K/V written (None with return_slots=False)."""
        self._allocate(seq_id, num_tokens, token_ids, block_hashes, strict=True)
        return self.slot_mapping(seq_id, self._hit_tokens[seq_id], num_tokens) if return_slots else None

    def try_allocate(self, seq_id: Hashable, num_tokens: int, *, token_ids: Sequence[int] | None = None,
                     block_hashes: list[int] | None = None) -> bool:
        """`allocate(..., return_slots=False)` if the blocks are there, else False and no change:
        `can_allocate` and `allocate` in one prefix match."""
        return self._allocate(seq_id, num_tokens, token_ids, block_hashes, strict=False)

    def _allocate(self, seq_id: Hashable, num_tokens: int, token_ids: Sequence[int] | None,
                  block_hashes: list[int] | None, *, strict: bool) -> bool:
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        self._count("num_tokens", num_tokens)
        planned = []
        if token_ids is not None:
            planned = block_hashes if block_hashes is not None else self.block_hashes(token_ids)
        hits = self._match(token_ids, planned) if token_ids is not None else []
        hits = hits[: num_tokens // self.block_size]
        need = self._fresh_needed(num_tokens, hits)
        if need > self._available(hits):
            if not strict:
                return False
            self._full(need, self._available(hits), f"allocate {num_tokens} tokens for sequence {seq_id!r}")
        for b in hits:
            self._acquire(b)
        self._tables[seq_id] = [*hits, *(self._take() for _ in range(need))]
        self._lens[seq_id] = num_tokens
        self._chain[seq_id] = [self._hash_of[b] for b in hits]
        self._planned[seq_id] = planned
        self._hit_tokens[seq_id] = len(hits) * self.block_size
        return True

    def append(self, seq_id: Hashable, num_tokens: int = 1, *, return_slots: bool = True) -> torch.Tensor | None:
        """Grow `seq_id` by `num_tokens`; returns the new tokens' int64 slots (None with return_slots=False)."""
        self._known(seq_id)
        self._count("num_tokens", num_tokens)
        need = self.blocks_needed(seq_id, num_tokens)
        if need > self.num_free_blocks:
            self._full(need, self.num_free_blocks, f"append {num_tokens} tokens to sequence {seq_id!r}")
        self._tables[seq_id].extend(self._take() for _ in range(need))
        start = self._lens[seq_id]
        self._lens[seq_id] = start + num_tokens
        return self.slot_mapping(seq_id, start, start + num_tokens) if return_slots else None

    def commit(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        """Name the full blocks among the first `num_computed` tokens of `seq_id` (whose K/V
        are written now) so later sequences can reuse them. `token_ids` are the sequence's tokens."""
        self._count("num_computed", num_computed)
        table = self._tables[self._known(seq_id)]
        bs = self.block_size
        chain = self._chain[seq_id]
        full = min(num_computed, len(token_ids), self._lens[seq_id]) // bs
        planned = self._planned[seq_id]
        first, width = len(chain), bs * 8
        buf = _token_bytes(token_ids, first * bs, full * bs)  # converted once, not per block
        for i in range(first, full):
            tokens = buf[(i - first) * width:(i - first + 1) * width]
            h = planned[i] if i < len(planned) else _block_hash_bytes(chain[-1] if chain else 0, tokens)
            chain.append(h)
            b = table[i]
            if h not in self._by_hash and self._hash_of[b] is None:
                self._by_hash[h] = b
                self._hash_of[b] = h
                self._tokens_of[b] = tokens
            # else: another block already holds this content; this one stays unnamed and private

    def free(self, seq_id: Hashable) -> None:
        """Release every block of `seq_id`. Named blocks stay cached until evicted; the tail is
        released first so that a shared prefix is the last to be evicted."""
        self._known(seq_id)
        for b in reversed(self._tables.pop(seq_id)):
            self._ref[b] -= 1
            assert self._ref[b] >= 0, f"block {b} released more often than acquired"
            if self._ref[b] == 0:
                if self._hash_of[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
        del self._lens[seq_id], self._chain[seq_id], self._hit_tokens[seq_id], self._planned[seq_id]

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no sequence references (they become empty)."""
        while self._evictable:
            b, _ = self._evictable.popitem(last=False)
            self._unname(b)
            self._free.append(b)

    # ------------------------------------------------------------------ tensors

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> torch.Tensor:
        """int64 [end - start]: the slots of positions start..end-1 of `seq_id`, for writing:
        none of them may lie in a shared or named block."""
        table = self._tables[self._known(seq_id)]
        self._count("start", start)
        self._count("end", end)
        if not (start <= end <= self._lens[seq_id]):
            raise ValueError(f"positions [{start}, {end}) are outside sequence {seq_id!r} of length {self._lens[seq_id]}")
        bs = self.block_size
        for i in range(start // bs, -(-end // bs)):
            b = table[i]
            if self._hash_of[b] is not None or self._ref[b] != 1:
                raise RuntimeError(f"positions [{start}, {end}) of sequence {seq_id!r} fall in block {b}, which is "
                                   f"shared or cached (ref {self._ref[b]}) and must never be written")
        pos = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.int64)[pos // bs] if end > start else pos
        return (blocks * bs + pos % bs).to(self.device)

    def block_tables(self, seq_ids: Iterable[Hashable] | None = None, pad: int = -1) -> torch.Tensor:
        """int32 [B, max_blocks] on the cache device, one row per sequence of seq_ids (None: every
        live sequence, in allocation order, as `seq_ids` lists them); short rows are padded
        with `pad`."""
        if isinstance(pad, bool) or not isinstance(pad, int) or not -(2**31) <= pad < 2**31:
            raise ValueError(f"pad must be an int32 value, got {pad!r}")
        rows = [self._tables[self._known(s)] for s in (self._tables if seq_ids is None else seq_ids)]
        width = max((len(r) for r in rows), default=0)
        out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.int32)
        for i, r in enumerate(rows):
            if r:
                out[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        return out.to(self.device)

    def context_lens(self, seq_ids: Iterable[Hashable] | None = None) -> torch.Tensor:
        """int32 [B] on the cache device: cached tokens per sequence of seq_ids (None: every live
        sequence, in the order of block_tables())."""
        ids = self._tables if seq_ids is None else seq_ids
        return torch.tensor([self._lens[self._known(s)] for s in ids], dtype=torch.int32).to(self.device)

    # ------------------------------------------------------------------ helpers

    def block_hashes(self, token_ids: Sequence[int]) -> list[int]:
        """The chained hashes of every full block of `token_ids` (what commit() would name them)."""
        bs = self.block_size
        n = len(token_ids) // bs
        width = bs * 8
        buf = _token_bytes(token_ids, 0, n * bs)  # once; each block hashes its own slice
        out, prev = [], 0
        for i in range(n):
            prev = _block_hash_bytes(prev, buf[i * width:(i + 1) * width])
            out.append(prev)
        return out

    def pending_hashes(self, seq_id: Hashable) -> list[int]:
        """Hashes of the full blocks of `seq_id`'s allocation tokens that it has not committed yet
        (the blocks it is still going to compute and name)."""
        return self._planned[self._known(seq_id)][len(self._chain[seq_id]):]

    def _match(self, token_ids: Sequence[int], hashes: list[int] | None = None) -> list[int]:
        """Blocks of the longest cached prefix of `token_ids`, at most (len - 1) // block_size."""
        bs = self.block_size
        if hashes is None:
            hashes = self.block_hashes(token_ids[: (len(token_ids) - 1) // bs * bs])
        blocks = []
        n = min(len(hashes), (len(token_ids) - 1) // bs)
        width = bs * 8  # bytes of a block's int64 tokens
        buf = None
        for i in range(n):
            b = self._by_hash.get(hashes[i])
            if b is None:
                break
            if buf is None:  # converted once, not per block
                buf = _token_bytes(token_ids, 0, n * bs)
            if self._tokens_of[b] != buf[i * width:(i + 1) * width]:
                break  # a 64-bit hash collision
            blocks.append(b)
        return blocks

    def _fresh_needed(self, num_tokens: int, hits: list[int]) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(hits))

    def _available(self, hits: list[int]) -> int:
        # a hit on an evictable block takes it out of the pool that fresh blocks come from
        return self.num_free_blocks - sum(1 for b in hits if self._ref[b] == 0)

    def _acquire(self, b: int) -> None:
        if self._ref[b] == 0:
            del self._evictable[b]
        self._ref[b] += 1

    def _take(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._evictable.popitem(last=False)  # least recently released
            self._unname(b)
        assert self._ref[b] == 0
        self._ref[b] = 1
        return b

    def _unname(self, b: int) -> None:
        h = self._hash_of[b]
        if h is not None:
            del self._by_hash[h]
            self._hash_of[b] = None
            self._tokens_of[b] = None

    def _known(self, seq_id: Hashable) -> Hashable:
        if seq_id not in self._tables:
            raise KeyError(f"unknown sequence {seq_id!r}")
        return seq_id

    @staticmethod
    def _count(name: str, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be a non-negative int, got {n!r}")

    def _full(self, need: int, have: int, what: str) -> None:
        raise CacheFullError(
            f"cannot {what}: needs {need} free blocks of {self.block_size} tokens, "
            f"{have} of {self.num_blocks} are free"
        )

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(layers={self.num_layers}, blocks={self.num_blocks}x{self.block_size}, "
            f"Hkv={self.num_kv_heads}, D={self.head_dim}, {self.dtype}, {self.device}, "
            f"free={self.num_free_blocks}, cached={self.num_cached_blocks}, seqs={len(self._tables)})"
        )
