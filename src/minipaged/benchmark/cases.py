"""The benchmark grids (standard GPU grid, quick CPU grid, cross-check cases)
and the random inputs for each case."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from . import flops

QWEN3_HEADS = dict(num_q_heads=16, num_kv_heads=8, head_dim=128)
QUICK_HEADS = dict(num_q_heads=4, num_kv_heads=2, head_dim=64)


@dataclass(frozen=True)
class PrefillCase:
    batch: int
    seqlen_q: int
    seqlen_k: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool = True

    op = "prefill"

    @property
    def label(self) -> str:
        n = (f"N={self.seqlen_q}" if self.seqlen_q == self.seqlen_k
             else f"Nq={self.seqlen_q} Nk={self.seqlen_k}")
        return f"B={self.batch} {n}"

    @property
    def flops(self) -> int:
        return flops.prefill_flops(self.batch, self.num_q_heads, self.seqlen_q,
                                   self.seqlen_k, self.head_dim, self.causal)

    def shape(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DecodeCase:
    batch: int
    context_len: int  # every sequence has this many cached tokens (unless context_lens set)
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    context_lens: tuple[int, ...] | None = field(default=None)

    op = "decode"

    @property
    def lens(self) -> tuple[int, ...]:
        if self.context_lens is not None:
            return tuple(self.context_lens)
        return (self.context_len,) * self.batch

    @property
    def label(self) -> str:
        if self.context_lens is not None:
            return f"B={self.batch} L={list(self.context_lens)}"
        return f"B={self.batch} L={self.context_len}"

    @property
    def tokens(self) -> int:
        return sum(self.lens)

    def bytes(self, elem_bytes: int) -> int:
        return flops.decode_bytes(self.num_q_heads, self.num_kv_heads, self.head_dim,
                                  self.lens, elem_bytes)

    @property
    def flops(self) -> int:
        return flops.decode_flops(self.num_q_heads, self.head_dim, self.lens)

    def shape(self) -> dict:
        d = asdict(self)
        d["context_lens"] = list(self.lens)
        return d


def standard_prefill_cases() -> list[PrefillCase]:
    """Causal prefill, Qwen3 heads (16 q, 8 kv, D=128): B=1 at 1k..16k and B=8 at 1k."""
    cases = [PrefillCase(1, n, n, **QWEN3_HEADS) for n in (1024, 4096, 8192, 16384)]
    cases.append(PrefillCase(8, 1024, 1024, **QWEN3_HEADS))
    return cases


def standard_decode_cases() -> list[DecodeCase]:
    """Paged decode, Qwen3 heads, block size 16, every context = L."""
    grid = [(1, 4096), (1, 32768), (8, 4096), (32, 4096), (64, 8192), (256, 1024)]
    return [DecodeCase(b, l, **QWEN3_HEADS, block_size=16) for b, l in grid]


def quick_prefill_cases() -> list[PrefillCase]:
    return [PrefillCase(1, n, n, **QUICK_HEADS) for n in (64, 128)]


def quick_decode_cases() -> list[DecodeCase]:
    return [DecodeCase(b, l, **QUICK_HEADS, block_size=16) for b in (1, 4) for l in (64, 256)]


def crosscheck_prefill_cases(quick: bool) -> list[PrefillCase]:
    """Odd lengths and a chunk after a cached prefix (Nq < Nk, bottom-right causal)."""
    if quick:
        return [PrefillCase(1, 97, 97, **QUICK_HEADS), PrefillCase(2, 33, 80, **QUICK_HEADS)]
    return [PrefillCase(2, 1000, 1000, **QWEN3_HEADS), PrefillCase(1, 300, 1023, **QWEN3_HEADS)]


def crosscheck_decode_cases(quick: bool) -> list[DecodeCase]:
    """Ragged contexts including an empty one and a partial last page."""
    if quick:
        lens = (0, 17, 100)
        return [DecodeCase(len(lens), max(lens), **QUICK_HEADS, block_size=16, context_lens=lens)]
    lens = (1, 17, 1000, 4097)
    return [DecodeCase(len(lens), max(lens), **QWEN3_HEADS, block_size=16, context_lens=lens)]


# ----------------------------------------------------------------------------- inputs


def _rnd(shape, dtype, device):
    # drawn in fp32 and rounded, so every dtype sees the same distribution
    return torch.randn(*shape, dtype=torch.float32, device=device).to(dtype)


def make_prefill_inputs(case: PrefillCase, dtype: torch.dtype, device):
    """Random q [B,Hq,Nq,D], k, v [B,Hkv,Nk,D] (seed with torch.manual_seed)."""
    def rnd(*shape):
        return _rnd(shape, dtype, device)

    q = rnd(case.batch, case.num_q_heads, case.seqlen_q, case.head_dim)
    k = rnd(case.batch, case.num_kv_heads, case.seqlen_k, case.head_dim)
    v = rnd(case.batch, case.num_kv_heads, case.seqlen_k, case.head_dim)
    return q, k, v


def make_decode_inputs(case: DecodeCase, dtype: torch.dtype, device,
                       pad_value: float | None = None):
    """Random q [B,Hq,D], a paged cache whose pages are a random permutation of
    the pool (so a sequence's pages are scattered), block tables padded with -1.

    Returns (q, k_cache, v_cache, block_tables int32, context_lens int32).
    The pool has exactly as many blocks as the sequences need, plus one
    (filled with `pad_value`, e.g. NaN, when given) that no table points at.
    """
    bs = case.block_size
    lens = case.lens
    blocks_per_seq = [(n + bs - 1) // bs for n in lens]
    max_blocks = max(1, max(blocks_per_seq))
    num_used = sum(blocks_per_seq)
    num_blocks = num_used + 1
    # tables are built on the host: one small copy instead of B tiny device writes
    perm = torch.randperm(num_blocks)
    tables = torch.full((case.batch, max_blocks), -1, dtype=torch.int32)
    pos = 0
    for b, nb in enumerate(blocks_per_seq):
        tables[b, :nb] = perm[pos:pos + nb].to(torch.int32)
        pos += nb
    block_tables = tables.to(device)
    spare = perm[num_used:].to(device)

    def rnd(*shape):
        return _rnd(shape, dtype, device)

    k_cache = rnd(num_blocks, bs, case.num_kv_heads, case.head_dim)
    v_cache = rnd(num_blocks, bs, case.num_kv_heads, case.head_dim)
    if pad_value is not None:
        k_cache[spare] = pad_value
        v_cache[spare] = pad_value
        # slots past each context inside its last page are never read either
        for b, n in enumerate(lens):
            if n % bs:
                blk = block_tables[b, n // bs].long()
                k_cache[blk, n % bs:] = pad_value
                v_cache[blk, n % bs:] = pad_value
    q = rnd(case.batch, case.num_q_heads, case.head_dim)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_tables, context_lens


def contiguous_kv(k_cache, v_cache, block_tables, context_len: int):
    """The same K/V as the paged cache, laid out [B, Hkv, L, D] contiguous (for the
    SDPA decode anchors). All sequences must have context_len tokens."""
    batch = block_tables.shape[0]
    bs = k_cache.shape[1]
    nb = (context_len + bs - 1) // bs
    idx = block_tables[:, :nb].long()

    def gather(cache):
        g = cache[idx]  # [B, nb, bs, Hkv, D]
        g = g.reshape(batch, nb * bs, cache.shape[2], cache.shape[3])[:, :context_len]
        return g.permute(0, 2, 1, 3).contiguous()

    return gather(k_cache), gather(v_cache)
