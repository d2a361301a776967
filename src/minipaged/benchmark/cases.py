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


@dataclass(frozen=True)
class PagedCase:
    """One paged_attention call: sequence s has q_lens[s] new tokens at the end of a
    context of context_lens[s] tokens (new ones included), all in a paged cache."""

    kind: str                      # "chunked" | "spec" | "mixed": what the call stands for
    q_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    causal: bool = True

    op = "paged"

    def __post_init__(self):
        if len(self.q_lens) != len(self.context_lens):
            raise ValueError(f"q_lens has {len(self.q_lens)} entries, context_lens {len(self.context_lens)}")

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    @property
    def uniform(self) -> bool:
        """Every sequence has the same q_len and context (one batched SDPA call can do it)."""
        return len(set(self.q_lens)) == 1 and len(set(self.context_lens)) == 1

    @property
    def decode_like(self) -> bool:
        """Short query runs only: microseconds of memory-bound work, timed as graph replays."""
        return max(self.q_lens, default=0) <= 16

    @property
    def chunk_seqs(self) -> list[int]:
        """Sequences with more than one new token (the prefill chunks of a mixed batch)."""
        return [s for s, n in enumerate(self.q_lens) if n > 1]

    @property
    def decode_seqs(self) -> list[int]:
        return [s for s, n in enumerate(self.q_lens) if n == 1]

    @property
    def label(self) -> str:
        if self.uniform:
            return f"{self.kind} B={self.batch} q={self.q_lens[0]} L={self.context_lens[0]}"
        chunks, decs = self.chunk_seqs, self.decode_seqs
        if (self.kind == "mixed" and len(chunks) == 1 and decs and len(chunks) + len(decs) == self.batch
                and len({self.context_lens[s] for s in decs}) == 1):
            c = chunks[0]
            return (f"mixed q={self.q_lens[c]} L={self.context_lens[c]} + {len(decs)} decodes "
                    f"L={self.context_lens[decs[0]]}")
        return f"{self.kind} q={list(self.q_lens)} L={list(self.context_lens)}"

    @property
    def flops(self) -> int:
        return flops.paged_flops(self.num_q_heads, self.head_dim, self.q_lens, self.context_lens, self.causal)

    def bytes(self, elem_bytes: int) -> int:
        return flops.paged_bytes(self.num_q_heads, self.num_kv_heads, self.head_dim, self.q_lens,
                                 self.context_lens, elem_bytes)

    def subset(self, seqs: list[int], kind: str) -> "PagedCase":
        return PagedCase(kind, tuple(self.q_lens[s] for s in seqs), tuple(self.context_lens[s] for s in seqs),
                         self.num_q_heads, self.num_kv_heads, self.head_dim, self.block_size, self.causal)

    def shape(self) -> dict:
        d = asdict(self)
        d["q_lens"], d["context_lens"], d["batch"] = list(self.q_lens), list(self.context_lens), self.batch
        return d


def standard_paged_cases() -> list[PagedCase]:
    """paged_attention, Qwen3 heads, block size 16, pages scattered at random:
    chunked prefill (8 x 512 new over 4k cached; 1 x 2k new over 30k cached),
    speculative verification (B=32, 4 new tokens, 4k context) and a mixed batch
    (one 2k chunk over 2k cached + 63 decodes at 4k context) in one launch."""
    h = QWEN3_HEADS
    return [
        PagedCase("chunked", (512,) * 8, (4096 + 512,) * 8, **h),
        PagedCase("chunked", (2048,), (30720 + 2048,), **h),
        PagedCase("spec", (4,) * 32, (4096,) * 32, **h),
        PagedCase("mixed", (2048,) + (1,) * 63, (4096,) * 64, **h),
    ]


def quick_paged_cases() -> list[PagedCase]:
    h = QUICK_HEADS
    return [
        PagedCase("chunked", (32,) * 2, (96,) * 2, **h),
        PagedCase("spec", (4,) * 4, (64,) * 4, **h),
        PagedCase("mixed", (48,) + (1,) * 3, (96,) + (64,) * 3, **h),
    ]


def crosscheck_paged_cases(quick: bool) -> list[PagedCase]:
    """One call mixing a chunk over a prefix, a decode, an empty query, a fresh prompt
    (q_len == context) and a context one past a page."""
    if quick:
        return [PagedCase("mixed", (5, 1, 0, 20), (40, 17, 3, 20), **QUICK_HEADS)]
    return [PagedCase("mixed", (300, 1, 4, 0, 97), (1000, 4097, 1023, 16, 97), **QWEN3_HEADS)]


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


def make_paged_inputs(case: PagedCase, dtype: torch.dtype, device, pad_value: float | None = None):
    """Random q [Tq, Hq, D] (the new tokens of every sequence, packed) over a paged
    cache laid out as in make_decode_inputs (scattered pages, -1 padded tables).

    Returns (q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens), int32 indices."""
    dcase = DecodeCase(case.batch, max(case.context_lens, default=0), case.num_q_heads, case.num_kv_heads,
                       case.head_dim, case.block_size, context_lens=tuple(case.context_lens))
    _, k_cache, v_cache, block_tables, context_lens = make_decode_inputs(dcase, dtype, device, pad_value)
    q = _rnd((sum(case.q_lens), case.num_q_heads, case.head_dim), dtype, device)
    return q, k_cache, v_cache, block_tables, cu_seqlens(case.q_lens, device), context_lens


def cu_seqlens(lens, device) -> torch.Tensor:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    if len(lens):
        cu[1:] = torch.cumsum(torch.tensor(list(lens), dtype=torch.int32), 0)
    return cu.to(device)


def gather_varlen_kv(k_cache, v_cache, block_tables, context_lens):
    """The K/V of every sequence's context made contiguous and packed, [Tk, Hkv, D],
    with its cu_seqlens_k (what prefill_attention_varlen takes); context_lens a list."""
    bs = k_cache.shape[1]
    slots = []
    tables = block_tables.cpu()
    for s, n in enumerate(context_lens):
        t = torch.arange(int(n))
        slots.append(tables[s, t // bs].long() * bs + t % bs)
    idx = (torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long)).to(k_cache.device)

    def gather(cache):
        return cache.reshape(-1, cache.shape[2], cache.shape[3])[idx].contiguous()

    return gather(k_cache), gather(v_cache), cu_seqlens(context_lens, k_cache.device)


def paged_from_dense(k, v, block_size: int = 16):
    """Dense k, v [B, Hkv, N, D] written into a fresh paged cache with scattered pages
    (for anchors that read pages on the prefill grid). Returns
    (k_cache, v_cache, block_tables, context_lens) as make_decode_inputs lays them out."""
    batch, num_kv_heads, n, head_dim = k.shape
    nb = (n + block_size - 1) // block_size
    perm = torch.randperm(batch * nb).to(torch.int32)
    tables = perm.view(batch, nb).to(k.device)
    k_cache = torch.zeros(batch * nb, block_size, num_kv_heads, head_dim, dtype=k.dtype, device=k.device)
    v_cache = torch.zeros_like(k_cache)
    pad = nb * block_size - n
    for src, dst in ((k, k_cache), (v, v_cache)):
        tok = src.permute(0, 2, 1, 3)  # [B, N, Hkv, D]
        if pad:
            tok = torch.nn.functional.pad(tok, (0, 0, 0, 0, 0, pad))
        dst[tables.long().flatten()] = tok.reshape(batch * nb, block_size, num_kv_heads, head_dim)
    context_lens = torch.full((batch,), n, dtype=torch.int32, device=k.device)
    return k_cache, v_cache, tables, context_lens
