"""Hypothesis strategies over the cases of minipaged.testing.

Every backend's tests draw from here, so torch, Triton and CUDA are checked on
the same distribution of shapes: B, Hkv, GQA ratio 1-8, Nq and Nk (both Nq < Nk
and Nq > Nk), D in {64, 128}, power-of-two block sizes 1-256 and ragged context
lengths including 0, and mixed paged batches (q_len 0, 1, 2-8 and long chunks over
cached contexts). Inputs, the oracle and the error bound are minipaged.testing's.
"""

from __future__ import annotations

from hypothesis import strategies as st

from minipaged.testing import DecodeCase, PagedCase, PrefillCase, VarlenCase

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


@st.composite
def paged_cases(draw, max_ctx: int = 300, max_chunk: int = 130, max_seqs: int = 5, max_kv_heads: int = 2,
                head_dims=HEAD_DIMS, block_sizes=BLOCK_SIZES, tile: int = 16):
    """A mixed paged_attention batch: per sequence a kind (empty, decode, speculative run of
    2-8, long chunk) and a cached prefix drawn so that (context - q_len) hits every residue of
    `tile` and contexts sit at and around page boundaries; sometimes q_len > context (rows
    that see no key)."""
    n = draw(st.integers(1, max_seqs))
    block_size = draw(st.sampled_from(block_sizes))
    q_lens, ctx = [], []
    for _ in range(n):
        kind = draw(st.sampled_from(["empty", "decode", "spec", "chunk"]))
        q = {"empty": 0, "decode": 1}.get(kind) or draw(
            st.integers(2, 8) if kind == "spec" else st.one_of(_lengths(max_chunk), st.integers(9, max_chunk)))
        prefix = draw(st.one_of(
            st.integers(0, max_ctx),
            st.builds(lambda k, r: k * tile + r, st.integers(0, max(0, max_ctx // tile)), st.integers(0, tile - 1)),
            st.builds(lambda k, d: max(0, k * block_size + d), st.integers(0, max(1, max_ctx // block_size)),
                      st.sampled_from([-1, 0, 1]))))
        context = q + prefix if draw(st.integers(0, 9)) else draw(st.integers(0, q))  # 1 in 10: q_len >= context
        q_lens.append(q)
        ctx.append(context)
    hq, hkv = _heads(draw, max_kv_heads)
    return PagedCase("mixed", tuple(q_lens), tuple(ctx), hq, hkv, draw(st.sampled_from(head_dims)), block_size,
                     draw(st.booleans()), spare_blocks=draw(st.integers(0, 3)))
