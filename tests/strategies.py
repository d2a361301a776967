"""Hypothesis strategies over the cases of minipaged.testing.

Every backend's tests draw from here, so torch, Triton and CUDA are checked on
the same distribution of shapes: B, Hkv, GQA ratio 1-8, Nq and Nk (both Nq < Nk
and Nq > Nk), D in {64, 128}, power-of-two block sizes 1-256 and ragged context
lengths including 0. Inputs, the oracle and the error bound are minipaged.testing's.
"""

from __future__ import annotations

from hypothesis import strategies as st

from minipaged.testing import DecodeCase, PrefillCase, VarlenCase

HEAD_DIMS = (64, 128)
GQA_RATIOS = (1, 2, 3, 4, 8)
BLOCK_SIZES = tuple(2**i for i in range(9))  # 1 .. 256


def _lengths(max_len: int):
    # Mix odd sizes that straddle tile edges with uniform draws.
    special = [n for n in (1, 15, 16, 17, 63, 64, 65, 97, 127, 128, 129, 255, 1023) if n <= max_len]
    return st.one_of(st.sampled_from(special), st.integers(1, max_len))


def _heads(draw, max_kv_heads):
    hkv = draw(st.integers(1, max_kv_heads))
    return hkv * draw(st.sampled_from(GQA_RATIOS)), hkv


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
    batch = draw(st.integers(1, max_batch))
    hq, hkv = _heads(draw, max_kv_heads)
    return PrefillCase(batch, seqlen_q, seqlen_k, hq, hkv, draw(st.sampled_from(head_dims)), draw(st.booleans()))


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
    hq, hkv = _heads(draw, max_kv_heads)
    return VarlenCase(tuple(qs), tuple(ks), hq, hkv, draw(st.sampled_from(head_dims)), draw(st.booleans()))


@st.composite
def decode_cases(draw, max_ctx: int = 300, max_batch: int = 5, max_kv_heads: int = 2, head_dims=HEAD_DIMS,
                 block_sizes=BLOCK_SIZES):
    batch = draw(st.integers(1, max_batch))
    lens = draw(st.lists(st.one_of(st.just(0), _lengths(max_ctx)), min_size=batch, max_size=batch))
    hq, hkv = _heads(draw, max_kv_heads)
    return DecodeCase.of(lens, hq, hkv, draw(st.sampled_from(head_dims)),
                         block_size=draw(st.sampled_from(block_sizes)), spare_blocks=draw(st.integers(0, 3)))
