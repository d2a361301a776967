"""Shared hypothesis strategies, input builders and the error bound.

Every backend's tests draw their cases from here, so torch, Triton and CUDA
are checked on the same distribution of shapes: B, Hkv, GQA ratio 1-8, Nq and
Nk (both Nq < Nk and Nq > Nk), D in {64, 128}, power-of-two block sizes 1-256
and ragged context lengths including 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

HEAD_DIMS = (64, 128)
GQA_RATIOS = (1, 2, 3, 4, 8)
BLOCK_SIZES = tuple(2**i for i in range(9))  # 1 .. 256


@dataclass(frozen=True)
class PrefillCase:
    batch: int
    num_kv_heads: int
    group: int  # Hq // Hkv
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.group


@dataclass(frozen=True)
class VarlenCase:
    seqlens_q: tuple[int, ...]
    seqlens_k: tuple[int, ...]
    num_kv_heads: int
    group: int
    head_dim: int
    causal: bool

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.group


@dataclass(frozen=True)
class DecodeCase:
    context_lens: tuple[int, ...]
    num_kv_heads: int
    group: int
    head_dim: int
    block_size: int
    spare_blocks: int  # pool blocks no sequence owns (poisoned with NaN)

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.group

    @property
    def batch(self) -> int:
        return len(self.context_lens)


def _lengths(max_len: int):
    # Mix odd sizes that straddle tile edges with uniform draws.
    special = [n for n in (1, 15, 16, 17, 63, 64, 65, 97, 127, 128, 129, 255, 1023) if n <= max_len]
    return st.one_of(st.sampled_from(special), st.integers(1, max_len))


@st.composite
def prefill_cases(draw, max_len: int = 160, max_batch: int = 3, max_kv_heads: int = 2, head_dims=HEAD_DIMS):
    seqlen_q = draw(_lengths(max_len))
    relation = draw(st.sampled_from(["eq", "q<k", "q>k", "any"]))
    if relation == "eq":
        seqlen_k = seqlen_q
    elif relation == "q<k":
        seqlen_k = draw(st.integers(seqlen_q, max_len))
    elif relation == "q>k":
        seqlen_k = draw(st.integers(1, seqlen_q))
    else:
        seqlen_k = draw(_lengths(max_len))
    return PrefillCase(
        batch=draw(st.integers(1, max_batch)),
        num_kv_heads=draw(st.integers(1, max_kv_heads)),
        group=draw(st.sampled_from(GQA_RATIOS)),
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        head_dim=draw(st.sampled_from(head_dims)),
        causal=draw(st.booleans()),
    )


@st.composite
def varlen_cases(draw, max_len: int = 130, max_seqs: int = 4, max_kv_heads: int = 2, head_dims=HEAD_DIMS):
    n = draw(st.integers(1, max_seqs))
    qs, ks = [], []
    for _ in range(n):
        q = draw(st.one_of(st.just(0), _lengths(max_len)))
        # chunked prefill after a cached prefix (k >= q) is the common case; k < q too
        k = draw(st.one_of(st.integers(q, max_len + q), st.integers(0, max(q, 0)), st.just(q)))
        qs.append(q)
        ks.append(k)
    return VarlenCase(
        seqlens_q=tuple(qs),
        seqlens_k=tuple(ks),
        num_kv_heads=draw(st.integers(1, max_kv_heads)),
        group=draw(st.sampled_from(GQA_RATIOS)),
        head_dim=draw(st.sampled_from(head_dims)),
        causal=draw(st.booleans()),
    )


@st.composite
def decode_cases(draw, max_ctx: int = 300, max_batch: int = 5, max_kv_heads: int = 2, head_dims=HEAD_DIMS, block_sizes=BLOCK_SIZES):
    batch = draw(st.integers(1, max_batch))
    lens = draw(st.lists(st.one_of(st.just(0), _lengths(max_ctx)), min_size=batch, max_size=batch))
    return DecodeCase(
        context_lens=tuple(lens),
        num_kv_heads=draw(st.integers(1, max_kv_heads)),
        group=draw(st.sampled_from(GQA_RATIOS)),
        head_dim=draw(st.sampled_from(head_dims)),
        block_size=draw(st.sampled_from(block_sizes)),
        spare_blocks=draw(st.integers(0, 3)),
    )


# ----------------------------------------------------------------------------- inputs


def _randn(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype=dtype, device=device)


def make_prefill_inputs(case: PrefillCase, dtype, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = _randn((case.batch, case.num_q_heads, case.seqlen_q, case.head_dim), dtype, device, gen)
    k = _randn((case.batch, case.num_kv_heads, case.seqlen_k, case.head_dim), dtype, device, gen)
    v = _randn((case.batch, case.num_kv_heads, case.seqlen_k, case.head_dim), dtype, device, gen)
    return q, k, v


def make_varlen_inputs(case: VarlenCase, dtype, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(case.seqlens_q), sum(case.seqlens_k)
    q = _randn((tq, case.num_q_heads, case.head_dim), dtype, device, gen)
    k = _randn((tk, case.num_kv_heads, case.head_dim), dtype, device, gen)
    v = _randn((tk, case.num_kv_heads, case.head_dim), dtype, device, gen)
    cu_q = torch.tensor([0, *torch.tensor(case.seqlens_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(case.seqlens_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu_q, cu_k


def make_decode_inputs(case: DecodeCase, dtype, device, seed: int = 0, poison: bool = True):
    """Random caches whose pages are scattered by a random permutation; every
    slot no sequence reads (spare blocks, tails of last pages) is NaN, and
    block-table entries past a sequence's pages are -1."""
    gen = torch.Generator().manual_seed(seed)
    bs = case.block_size
    pages = [math.ceil(n / bs) for n in case.context_lens]
    num_blocks = sum(pages) + case.spare_blocks
    num_blocks = max(num_blocks, 1)
    shape = (num_blocks, bs, case.num_kv_heads, case.head_dim)
    k_cache = _randn(shape, dtype, device, gen)
    v_cache = _randn(shape, dtype, device, gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(max(pages, default=0), 1) + 1  # one spare column of -1
    tables = torch.full((case.batch, max_blocks), -1, dtype=torch.int32)
    used = torch.zeros(num_blocks, bs, dtype=torch.bool)
    cursor = 0
    for b, (n, p) in enumerate(zip(case.context_lens, pages)):
        for j in range(p):
            blk = perm[cursor]
            cursor += 1
            tables[b, j] = blk
            used[blk, : min(bs, n - j * bs)] = True
    if poison:
        k_cache[~used.to(device)] = float("nan")
        v_cache[~used.to(device)] = float("nan")
    q = _randn((case.batch, case.num_q_heads, case.head_dim), dtype, device, gen)
    lens = torch.tensor(case.context_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables.to(device), lens


# ----------------------------------------------------------------------------- error bound


def attention_fp64(q, k, v, causal: bool, scale: float | None = None, lowp_dtype=None):
    """Independent dense oracle: q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D] -> [B, Hq, Nq, D].

    K/V are repeated explicitly (not viewed as groups, as the library does).
    With lowp_dtype set, it runs the whole computation in that dtype instead,
    rounding scores and probabilities as a low-precision kernel would: that
    error is the baseline a kernel is allowed (about twice) of.
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    work = torch.float64 if lowp_dtype is None else lowp_dtype
    kr = k.to(work).repeat_interleave(Hq // Hkv, dim=1)
    vr = v.to(work).repeat_interleave(Hq // Hkv, dim=1)
    s = (q.to(work) @ kr.transpose(-1, -2)).float() * scale
    mask = torch.ones(Nq, Nk, dtype=torch.bool, device=q.device)
    if causal:
        # row i keeps keys [0, Nk - Nq + i + 1): a lower triangle shifted right by Nk - Nq
        mask = torch.tril(mask, diagonal=Nk - Nq)
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s.double(), dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # rows with no key: zeros
    o = p.to(work) @ vr
    return o.to(torch.float64)


def error_bound(dtype) -> float:
    """Absolute slack on top of twice the low-precision baseline error."""
    return {torch.float32: 2e-3, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


def assert_close(out: torch.Tensor, ref64: torch.Tensor, base: torch.Tensor, dtype, what: str = "") -> None:
    """FlashAttention-style check: max|out - ref| <= 2 * max|lowp_ref - ref| + slack.

    NaN anywhere in `out` fails (NaN poisoning of outputs and caches relies on it).
    """
    out64 = out.double()
    ref64 = ref64.double().to(out64.device)
    assert not torch.isnan(out64).any(), f"{what}: NaN in output ({int(torch.isnan(out64).sum())} elements)"
    assert out64.shape == ref64.shape, f"{what}: shape {tuple(out64.shape)} != {tuple(ref64.shape)}"
    if out64.numel() == 0:
        return
    err = (out64 - ref64).abs().max().item()
    base_err = (base.double().to(out64.device) - ref64).abs().max().item()
    bound = 2 * base_err + error_bound(dtype)
    assert err <= bound, f"{what}: max error {err:.3g} > bound {bound:.3g} (low-precision baseline {base_err:.3g})"


def varlen_to_dense(q, k, v, cu_q, cu_k, s):
    """Sequence s of a packed batch as dense [1, H, N, D] tensors."""
    q0, q1 = int(cu_q[s]), int(cu_q[s + 1])
    k0, k1 = int(cu_k[s]), int(cu_k[s + 1])
    f = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731
    return f(q[q0:q1]), f(k[k0:k1]), f(v[k0:k1])


def decode_to_dense(q, k_cache, v_cache, tables, lens, b):
    """Sequence b of a paged batch as dense q [1, Hq, 1, D], k/v [1, Hkv, L, D]."""
    n = int(lens[b])
    bs = k_cache.shape[1]
    pos = torch.arange(n, device=k_cache.device)
    blk = tables[b].long()[pos // bs] if n else pos
    k = k_cache[blk, pos % bs].transpose(0, 1).unsqueeze(0)
    v = v_cache[blk, pos % bs].transpose(0, 1).unsqueeze(0)
    return q[b : b + 1].unsqueeze(2), k, v
