"""Test and benchmark helpers: the cases, their random inputs, an fp64 oracle and
one error bound. tests/, minipaged.benchmark and scripts/ all use this module,
so every backend is judged on the same inputs by the same rule.

Cases (frozen dataclasses; `op`, `label`, `flops`, `shape()` serve the benchmark):
    PrefillCase   dense [B, H, N, D] prefill
    VarlenCase    packed sequences with cu_seqlens
    DecodeCase    one query per sequence over a paged cache
    PagedCase     any query run per sequence over a paged cache

Inputs are drawn in fp32 and rounded to the dtype, so every dtype sees the same
distribution. `seed` (an int) draws from a CPU generator, reproducible on any
device; seed=None draws from the global RNG on the device itself (the
benchmark's large caches). Paged caches put each sequence's pages at a random
permutation of the pool; with poison=True every slot no sequence owns (spare
pages, the tail of a last page) is NaN, and block-table entries past a
sequence's pages are `tail` (-1 by default), which DESIGN.md says is never read.

The oracle (attention_ref and its prefill/varlen/paged/decode wrappers) is
re-derived from DESIGN.md and shares nothing with minipaged.reference, which it
judges too: per sequence, its own bottom-right mask, query head h reads KV head
h // (Hq // Hkv), zeros and lse -inf for a row that sees no key. lowp=True runs
the same attention as a plain PyTorch user would in the input dtype (matmuls in
that dtype, softmax in fp32, P rounded to the dtype): its error against the fp64
truth is the yardstick of `assert_close`.

Error bound (FlashAttention's tests): max|out - truth| <= ERR_FACTOR * max|lowp -
truth| + ERR_FLOOR[dtype]. The multiple is of the low-precision error, never of
a difference between two library backends, so a wrong oracle cannot widen its
own bound. lse: |lse - truth| <= LSE_TOL[dtype] * (1 + |truth|), -inf exactly
where the truth is.

Imports torch only (no triton, no CUDA build); minipaged/__init__ does not
import it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch

from .benchmark import flops as _flops

__all__ = [
    "PrefillCase", "VarlenCase", "DecodeCase", "PagedCase",
    "randn", "cu_seqlens", "strided_copy", "slot_mapping",
    "make_prefill_inputs", "make_varlen_inputs", "PagedKV", "paged_kv", "make_decode_inputs",
    "make_paged_inputs",
    "visible_mask", "attention_ref", "prefill_ref", "varlen_ref", "paged_ref", "decode_ref", "gather_kv",
    "ERR_FACTOR", "ERR_FLOOR", "LSE_TOL", "assert_close",
    "make_write_inputs", "assert_same_cache",
]


# ============================================================================ cases


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
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def label(self) -> str:
        n = (f"N={self.seqlen_q}" if self.seqlen_q == self.seqlen_k
             else f"Nq={self.seqlen_q} Nk={self.seqlen_k}")
        return f"B={self.batch} {n}"

    @property
    def flops(self) -> int:
        return _flops.prefill_flops(self.batch, self.num_q_heads, self.seqlen_q,
                                    self.seqlen_k, self.head_dim, self.causal)

    def shape(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class VarlenCase:
    seqlens_q: tuple[int, ...]
    seqlens_k: tuple[int, ...]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool = True

    op = "prefill_varlen"

    def __post_init__(self):
        if len(self.seqlens_q) != len(self.seqlens_k):
            raise ValueError(f"seqlens_q has {len(self.seqlens_q)} entries, seqlens_k {len(self.seqlens_k)}")

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def batch(self) -> int:
        return len(self.seqlens_q)


@dataclass(frozen=True)
class DecodeCase:
    batch: int
    context_len: int  # every sequence has this many cached tokens (unless context_lens is set)
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    context_lens: tuple[int, ...] | None = field(default=None)
    spare_blocks: int = 1  # pool pages no sequence owns (NaN when poisoned)

    op = "decode"

    def __post_init__(self):
        if self.context_lens is not None and len(self.context_lens) != self.batch:
            raise ValueError(f"batch={self.batch} but context_lens has {len(self.context_lens)} entries")

    @classmethod
    def of(cls, context_lens: Sequence[int], num_q_heads: int, num_kv_heads: int, head_dim: int,
           block_size: int = 16, spare_blocks: int = 1) -> "DecodeCase":
        """A ragged batch: one sequence per entry of context_lens."""
        lens = tuple(int(n) for n in context_lens)
        return cls(len(lens), max(lens, default=0), num_q_heads, num_kv_heads, head_dim, block_size,
                   context_lens=lens, spare_blocks=spare_blocks)

    @property
    def lens(self) -> tuple[int, ...]:
        if self.context_lens is not None:
            return tuple(self.context_lens)
        return (self.context_len,) * self.batch

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def label(self) -> str:
        if self.context_lens is not None:
            lens = self.context_lens
            if len(lens) > 8:  # a long ragged batch: its range and mean, not every length
                return f"B={self.batch} L={min(lens)}..{max(lens)} mean {round(sum(lens) / len(lens))}"
            return f"B={self.batch} L={list(lens)}"
        return f"B={self.batch} L={self.context_len}"

    @property
    def uniform(self) -> bool:
        """Every sequence has the same context length (what contiguous [B, Hkv, L, D] K/V needs)."""
        return len(set(self.lens)) <= 1

    @property
    def tokens(self) -> int:
        return sum(self.lens)

    def bytes(self, elem_bytes: int) -> int:
        return _flops.decode_bytes(self.num_q_heads, self.num_kv_heads, self.head_dim, self.lens, elem_bytes)

    @property
    def flops(self) -> int:
        return _flops.decode_flops(self.num_q_heads, self.head_dim, self.lens)

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
    spare_blocks: int = 1

    op = "paged"

    def __post_init__(self):
        if len(self.q_lens) != len(self.context_lens):
            raise ValueError(f"q_lens has {len(self.q_lens)} entries, context_lens {len(self.context_lens)}")

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

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
        return _flops.paged_flops(self.num_q_heads, self.head_dim, self.q_lens, self.context_lens, self.causal)

    def bytes(self, elem_bytes: int) -> int:
        return _flops.paged_bytes(self.num_q_heads, self.num_kv_heads, self.head_dim, self.q_lens,
                                  self.context_lens, elem_bytes)

    def subset(self, seqs: list[int], kind: str) -> "PagedCase":
        return PagedCase(kind, tuple(self.q_lens[s] for s in seqs), tuple(self.context_lens[s] for s in seqs),
                         self.num_q_heads, self.num_kv_heads, self.head_dim, self.block_size, self.causal,
                         self.spare_blocks)

    def decode_case(self) -> DecodeCase:
        """The same sequences and cache as a decode batch (one query each)."""
        return DecodeCase.of(self.context_lens, self.num_q_heads, self.num_kv_heads, self.head_dim,
                             self.block_size, self.spare_blocks)

    def shape(self) -> dict:
        d = asdict(self)
        d["q_lens"], d["context_lens"], d["batch"] = list(self.q_lens), list(self.context_lens), self.batch
        return d


# ============================================================================ inputs


def _generator(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(int(seed))


def randn(shape, dtype, device, gen: torch.Generator | None = None) -> torch.Tensor:
    """Normal values drawn in fp32 and rounded to dtype. gen: a CPU generator (drawn on
    the CPU, then moved) or None (the global RNG, drawn on the device)."""
    if gen is None:
        return torch.randn(*shape, dtype=torch.float32, device=device).to(dtype)
    return torch.randn(*shape, dtype=torch.float32, generator=gen).to(device=device, dtype=dtype)


def cu_seqlens(lens, device) -> torch.Tensor:
    """int32 [S + 1]: 0 then the running sums of lens."""
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    if len(lens):
        cu[1:] = torch.cumsum(torch.tensor([int(n) for n in lens], dtype=torch.int32), 0)
    return cu.to(device)


def strided_copy(x: torch.Tensor) -> torch.Tensor:
    """x's values in a tensor whose last dim is stride 1 but which is not contiguous:
    every row sits next to a NaN row, so a kernel that ignores the strides reads NaN."""
    full = torch.full((*x.shape[:-1], 2, x.shape[-1]), float("nan"), dtype=x.dtype, device=x.device)
    full[..., 1, :] = x
    return full[..., 1, :]


def make_prefill_inputs(case: PrefillCase, dtype, device, seed: int | None = 0):
    """Random q [B, Hq, Nq, D], k, v [B, Hkv, Nk, D]."""
    gen = _generator(seed)
    q = randn((case.batch, case.num_q_heads, case.seqlen_q, case.head_dim), dtype, device, gen)
    k = randn((case.batch, case.num_kv_heads, case.seqlen_k, case.head_dim), dtype, device, gen)
    v = randn((case.batch, case.num_kv_heads, case.seqlen_k, case.head_dim), dtype, device, gen)
    return q, k, v


def make_varlen_inputs(case: VarlenCase, dtype, device, seed: int | None = 0):
    """Random packed q [Tq, Hq, D], k, v [Tk, Hkv, D] and int32 cu_seqlens_q, cu_seqlens_k."""
    gen = _generator(seed)
    tq, tk = sum(case.seqlens_q), sum(case.seqlens_k)
    q = randn((tq, case.num_q_heads, case.head_dim), dtype, device, gen)
    k = randn((tk, case.num_kv_heads, case.head_dim), dtype, device, gen)
    v = randn((tk, case.num_kv_heads, case.head_dim), dtype, device, gen)
    return q, k, v, cu_seqlens(case.seqlens_q, device), cu_seqlens(case.seqlens_k, device)


@dataclass
class PagedKV:
    """A paged K/V cache and what was written into it."""

    k_cache: torch.Tensor          # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor     # int32 [S, width], on the cache's device
    context_lens: torch.Tensor     # int32 [S]
    tables: list[list[int]]        # the used entries of each row (host ints)
    keys: list[torch.Tensor]       # sequence s's K as written, [context_lens[s], Hkv, D]
    vals: list[torch.Tensor]


def paged_kv(context_lens: Sequence[int], num_kv_heads: int, head_dim: int, block_size: int, dtype, device, *,
             seed: int | None = 0, gen: torch.Generator | None = None, spare_blocks: int = 1,
             spare_columns: int = 1, poison: bool = True, tail: int = -1,
             keys: Sequence[torch.Tensor] | None = None, vals: Sequence[torch.Tensor] | None = None) -> PagedKV:
    """Random K/V of each sequence (or the given keys/vals) on pages at a random
    permutation of a pool of sum(ceil(L / block_size)) + spare_blocks pages.

    poison=True: every slot no sequence owns is NaN; False: it holds random values
    (as a reused pool would). Table rows have max pages + spare_columns entries;
    those past a sequence's pages hold `tail`. gen (a CPU generator) overrides seed,
    so a caller can keep drawing from the same stream.
    """
    if gen is None:
        gen = _generator(seed)
    if keys is not None:
        context_lens = [int(k.shape[0]) for k in keys]
    lens = [int(n) for n in context_lens]
    need = [-(-n // block_size) for n in lens]
    num_blocks = max(sum(need) + spare_blocks, 1)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(need + [1]) + spare_columns
    rows, at = [], 0
    for p in need:
        rows.append(perm[at: at + p])
        at += p
    block_tables = torch.full((len(lens), width), tail, dtype=torch.int32)
    for s, r in enumerate(rows):
        block_tables[s, : len(r)] = torch.tensor(r, dtype=torch.int32)
    slot = slot_mapping(rows, lens, block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches, written = [], []
    for given in (keys, vals):
        if given is None:
            tok = randn((sum(lens), num_kv_heads, head_dim), dtype, device, gen)
        else:
            tok = torch.cat([x.to(device=device, dtype=dtype) for x in given]) if given else \
                torch.zeros(0, num_kv_heads, head_dim, dtype=dtype, device=device)
        cache = (torch.full(shape, float("nan"), dtype=dtype, device=device) if poison
                 else randn(shape, dtype, device, gen))
        cache.view(-1, num_kv_heads, head_dim)[slot.to(device)] = tok
        caches.append(cache)
        written.append(list(torch.split(tok, lens)))
    return PagedKV(caches[0], caches[1], block_tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device),
                   rows, written[0], written[1])


def slot_mapping(block_tables, context_lens, block_size: int) -> torch.Tensor:
    """int64 [sum(context_lens)]: slot page * block_size + offset of every token, sequence
    by sequence (what write_kv_cache takes), on the CPU."""
    tables = block_tables.tolist() if isinstance(block_tables, torch.Tensor) else block_tables
    out = []
    for row, n in zip(tables, _ints(context_lens)):
        t = torch.arange(n)
        out.append(torch.tensor(row[: -(-n // block_size)], dtype=torch.long)[t // block_size] * block_size
                   + t % block_size)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def make_decode_inputs(case: DecodeCase, dtype, device, seed: int | None = 0, poison: bool = True,
                       spare_columns: int = 1):
    """(q [B, Hq, D], k_cache, v_cache, block_tables int32, context_lens int32) over a
    paged cache laid out as paged_kv lays it out."""
    gen = _generator(seed)
    kv = paged_kv(case.lens, case.num_kv_heads, case.head_dim, case.block_size, dtype, device, gen=gen,
                  spare_blocks=case.spare_blocks, spare_columns=spare_columns, poison=poison)
    q = randn((case.batch, case.num_q_heads, case.head_dim), dtype, device, gen)
    return q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens


def make_paged_inputs(case: PagedCase, dtype, device, seed: int | None = 0, poison: bool = True,
                      spare_columns: int = 1):
    """(q [Tq, Hq, D] packed new tokens, k_cache, v_cache, block_tables, cu_seqlens_q,
    context_lens), int32 indices, over a cache laid out as paged_kv lays it out."""
    gen = _generator(seed)
    kv = paged_kv(case.context_lens, case.num_kv_heads, case.head_dim, case.block_size, dtype, device, gen=gen,
                  spare_blocks=case.spare_blocks, spare_columns=spare_columns, poison=poison)
    q = randn((sum(case.q_lens), case.num_q_heads, case.head_dim), dtype, device, gen)
    return q, kv.k_cache, kv.v_cache, kv.block_tables, cu_seqlens(case.q_lens, device), kv.context_lens


# ============================================================================ oracle


def visible_mask(nq: int, nk: int, causal: bool, device=None, row0: int = 0, rows: int | None = None) -> torch.Tensor:
    """bool [rows, nk] for query rows row0 .. row0 + rows of nq: row i sees key j iff
    j < nk - nq + i + 1 (bottom-right causal), every key otherwise."""
    rows = nq - row0 if rows is None else rows
    if not causal:
        return torch.ones(rows, nk, dtype=torch.bool, device=device)
    i = torch.arange(row0, row0 + rows, device=device).view(rows, 1)
    j = torch.arange(nk, device=device).view(1, nk)
    return j < (nk - nq) + i + 1


def attention_ref(q, k, v, *, causal: bool = True, scale: float | None = None, lowp: bool = False,
                  chunk: int = 1024):
    """One sequence: q [Nq, Hq, D], k/v [Nk, Hkv, D] -> (o float64 [Nq, Hq, D], lse float64 [Nq, Hq]).

    lowp=False: fp64 throughout. lowp=True: matmuls in q's dtype, softmax in fp32,
    probabilities rounded to q's dtype. Query rows go `chunk` at a time (long contexts).
    """
    nq, hq, d = q.shape
    nk, hkv = k.shape[0], k.shape[1]
    if hq % hkv:
        raise ValueError(f"Hq={hq} is not a multiple of Hkv={hkv}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    dev = q.device
    o = torch.zeros(nq, hq, d, dtype=torch.float64, device=dev)
    lse = torch.full((nq, hq), -math.inf, dtype=torch.float64, device=dev)
    if nq == 0 or nk == 0:
        return o, lse
    work = q.dtype if lowp else torch.float64
    soft = torch.float32 if lowp else torch.float64
    kv_head = torch.tensor([h // (hq // hkv) for h in range(hq)], device=dev)
    kk = k.detach().to(work).index_select(1, kv_head).transpose(0, 1)  # [Hq, Nk, D]
    vv = v.detach().to(work).index_select(1, kv_head).transpose(0, 1)
    for r0 in range(0, nq, chunk):
        r1 = min(nq, r0 + chunk)
        qq = q[r0:r1].detach().to(work).transpose(0, 1)  # [Hq, n, D]
        s = torch.matmul(qq, kk.transpose(1, 2)).to(soft) * scale
        seen = visible_mask(nq, nk, causal, dev, r0, r1 - r0)  # [n, Nk]
        s = s.masked_fill(~seen, -math.inf)
        has = seen.any(1).view(1, -1, 1)
        m = torch.where(has, s.amax(-1, keepdim=True), torch.zeros_like(s[..., :1]))
        w = torch.exp(s - m)  # hidden keys: exp(-inf) = 0
        z = w.sum(-1, keepdim=True)
        p = w / torch.where(z > 0, z, torch.ones_like(z))
        out = torch.matmul(p.to(work), vv).to(torch.float64)  # rows without a key: p = 0, o = 0
        o[r0:r1] = out.transpose(0, 1)
        lse[r0:r1] = (m + torch.log(z)).squeeze(-1).transpose(0, 1).to(torch.float64)
    return o, lse


def prefill_ref(q, k, v, *, causal: bool = True, scale=None, lowp: bool = False):
    """Dense q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D] -> (o [B, Hq, Nq, D], lse [B, Hq, Nq]), float64."""
    B, hq, nq, d = q.shape
    o = torch.zeros(B, hq, nq, d, dtype=torch.float64, device=q.device)
    lse = torch.full((B, hq, nq), -math.inf, dtype=torch.float64, device=q.device)
    for b in range(B):
        ob, lb = attention_ref(q[b].transpose(0, 1), k[b].transpose(0, 1), v[b].transpose(0, 1),
                               causal=causal, scale=scale, lowp=lowp)
        o[b], lse[b] = ob.transpose(0, 1), lb.transpose(0, 1)
    return o, lse


def _ints(x) -> list[int]:
    return [int(n) for n in (x.tolist() if isinstance(x, torch.Tensor) else x)]


def paged_ref(q, keys, vals, cu_q, *, causal: bool = True, scale=None, lowp: bool = False):
    """Packed q [Tq, Hq, D] of S sequences over each one's whole K/V (keys[s], vals[s]
    [L_s, Hkv, D]); cu_q [S + 1]. -> (o [Tq, Hq, D], lse [Tq, Hq]), float64."""
    cu = _ints(cu_q)
    tq, hq, d = q.shape
    o = torch.zeros(tq, hq, d, dtype=torch.float64, device=q.device)
    lse = torch.full((tq, hq), -math.inf, dtype=torch.float64, device=q.device)
    for s in range(len(cu) - 1):
        a, b = cu[s], cu[s + 1]
        if a < b:
            o[a:b], lse[a:b] = attention_ref(q[a:b], keys[s], vals[s], causal=causal, scale=scale, lowp=lowp)
    return o, lse


def varlen_ref(q, k, v, cu_q, cu_k, *, causal: bool = True, scale=None, lowp: bool = False):
    """Packed q [Tq, Hq, D], k/v [Tk, Hkv, D] -> (o [Tq, Hq, D], lse [Tq, Hq]), float64."""
    ck = _ints(cu_k)
    keys = [k[ck[s]: ck[s + 1]] for s in range(len(ck) - 1)]
    vals = [v[ck[s]: ck[s + 1]] for s in range(len(ck) - 1)]
    return paged_ref(q, keys, vals, cu_q, causal=causal, scale=scale, lowp=lowp)


def decode_ref(q, keys, vals, *, scale=None, lowp: bool = False):
    """q [B, Hq, D], one query per sequence over keys[b], vals[b] -> (o [B, Hq, D], lse [B, Hq])."""
    return paged_ref(q, keys, vals, list(range(q.shape[0] + 1)), causal=False, scale=scale, lowp=lowp)


def gather_kv(k_cache, v_cache, block_tables, context_lens):
    """The oracle's own page walk: token t of sequence s is at page block_tables[s][t //
    page], offset t % page. -> (keys, vals), lists of [L_s, Hkv, D]."""
    page = k_cache.shape[1]
    tables = block_tables.tolist() if isinstance(block_tables, torch.Tensor) else block_tables
    keys, vals = [], []
    for row, n in zip(tables, _ints(context_lens)):
        blk = torch.tensor([row[t // page] for t in range(n)], dtype=torch.long, device=k_cache.device)
        off = torch.tensor([t % page for t in range(n)], dtype=torch.long, device=k_cache.device)
        keys.append(k_cache[blk, off])
        vals.append(v_cache[blk, off])
    return keys, vals


# ============================================================================ error bound

# How many times the plain low-precision error a kernel may make, and the floor
# under it (tile-order summation and one final rounding to the output dtype).
ERR_FACTOR = 2.0
ERR_FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}
# lse comes from fp32 scores whatever the input dtype: relative to 1 + |lse|
LSE_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-3}


def assert_close(out, truth, lowp, what: str = "", *, lse=None, truth_lse=None,
                 factor: float = ERR_FACTOR, floor: float | None = None) -> float:
    """max|out - truth| <= factor * max|lowp - truth| + floor (ERR_FLOOR of out's dtype).

    NaN or inf anywhere in out fails (NaN-poisoned caches rely on it). With
    truth_lse, rows that see no key (truth_lse -inf) must be exact zeros; with lse
    too, lse must be float32, -inf exactly there and within LSE_TOL elsewhere.
    Returns the max error.
    """
    assert torch.isfinite(out).all(), f"{what}: non-finite output ({int((~torch.isfinite(out)).sum())} elements)"
    assert out.shape == truth.shape, f"{what}: shape {tuple(out.shape)} != {tuple(truth.shape)}"
    floor = ERR_FLOOR[out.dtype] if floor is None else floor
    o = out.detach().to(torch.float64)
    t = truth.to(device=o.device, dtype=torch.float64)
    err = 0.0
    if o.numel():
        err = (o - t).abs().max().item()
        base = (lowp.to(device=o.device, dtype=torch.float64) - t).abs().max().item()
        bound = factor * base + floor
        assert err <= bound, f"{what}: max err {err:.3e} > bound {bound:.3e} (low-precision error {base:.3e})"
    if truth_lse is not None:
        tl = truth_lse.to(device=o.device, dtype=torch.float64)
        empty = torch.isneginf(tl)
        assert (o[empty] == 0).all(), f"{what}: a row that sees no key is not exact zeros"
        if lse is not None:
            assert lse.dtype == torch.float32, f"{what}: lse dtype {lse.dtype}"
            assert lse.shape == tl.shape, f"{what}: lse shape {tuple(lse.shape)} != {tuple(tl.shape)}"
            ld = lse.detach().to(device=o.device, dtype=torch.float64)
            assert not torch.isnan(ld).any(), f"{what}: NaN in lse"
            assert torch.equal(torch.isneginf(ld), empty), f"{what}: lse is -inf exactly where no key is seen"
            if (~empty).any():
                d = (ld - tl)[~empty].abs()
                tol = LSE_TOL[out.dtype] * (1 + tl[~empty].abs())
                assert (d <= tol).all(), f"{what}: lse err {d.max().item():.3e}"
    return err


# ============================================================================ write_kv_cache


def make_write_inputs(num_tokens: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                      dtype, device, *, seed: int = 0, skip: float = 0.25, any_negative: bool = True):
    """Tokens to scatter into NaN caches at distinct random slots, about `skip` of
    them skipped with a negative slot (-1, or any negative with any_negative), and
    the caches a correct write leaves, written by hand one token at a time.

    -> (k, v [T, Hkv, D], k_cache, v_cache (NaN), slots int64 [T], want_k, want_v)."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    skipped = torch.rand(num_tokens, generator=gen) < skip
    if any_negative:
        slots[skipped] = -torch.randint(1, 1000, (int(skipped.sum()),), generator=gen)
    else:
        slots[skipped] = -1
    k = randn((num_tokens, num_kv_heads, head_dim), dtype, device, gen)
    v = randn((num_tokens, num_kv_heads, head_dim), dtype, device, gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s // block_size, s % block_size] = k[t]
            want_v[s // block_size, s % block_size] = v[t]
    return k, v, k_cache, v_cache, slots.to(device), want_k, want_v


def assert_same_cache(got, want, what: str = "") -> None:
    """Bitwise equal, NaN where want is NaN (slots a write must not touch)."""
    got, want = got.cpu(), want.cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: written at the wrong slots"
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)), f"{what}: wrong values"
