"""Paged attention for any mix of query lengths in one launch (decode, speculative
verification runs, chunked prefill over a cached prefix).

Grid (num_seqs * q_tiles, kv_head, split). Program (s, t, h, p) owns query
positions [t * BLOCK_Q, (t + 1) * BLOCK_Q) of sequence s, for every query head
of KV head h's GQA group: the rows of its tl.dots are the packed
(position, head-of-group) pairs, row r = (r // group, r % group), so a K/V tile
is loaded once for the whole group and BLOCK_M = BLOCK_Q * group rows are fed
to the tensor cores (decode: group rows; a q_len 4 verification run with group
2: 8 rows; a long chunk: BLOCK_M = 128 rows = 64 positions at group 2). The
host sizes the grid from max_seqlen_q, so no device value is needed; a tile past
its sequence's q_len exits at once. The q-tile index runs backwards over axis 0
so the bottom tiles of long chunks, which have the most keys, start first.

Keys come through the block table: a KV tile of BLOCK_N keys reads one table
entry when one page holds the whole tile, else (GATHER) one entry per key or
one per page broadcast over its keys, optionally loaded a tile ahead. K and V
share the block ids. Table indices are clamped to ceil(context_len/PAGE) - 1,
so entries past it are never read.

Causal masking is bottom-right aligned per sequence (position i sees key j iff
j <= i + context_len - q_len). A tile's key range splits like prefill's:
  [0, full_end)     seen by every row of the tile: unmasked inner loop
  [full_end, end)   diagonal band and the ragged end of the context: masked loop
  [end, ctx)        seen by no row of the tile: never loaded
The same inner-loop function runs both ranges (MASKED is a constexpr).

KV_FP8 (constexpr): fp8 e4m3fn caches dequantised on the fly, as in decode.py
(tiles widened to q's dtype in registers, k_scale of the KV head folded into
the softmax scale, v_scale applied to the normalised output).

Split-KV: with several splits, split p takes a contiguous BLOCK_N-aligned slice
of [0, end) and writes an fp32 partial output and its log2-sum-exp; the decode
reduce kernel merges them, and stores the lse when asked.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .softmax import _softmax_step, _softmax_step_masked



@triton.jit
def _tile_blocks(table_row, start_n, last_page,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, GATHER: tl.constexpr):
    """Cache block of every key of the tile starting at start_n: a scalar when one page
    holds the tile, else [BLOCK_N]. Table indices are clamped to the last page the
    context uses, so entries past it (maybe -1) are never read; keys past the
    context get some valid block and are masked by the caller."""
    if PAGE >= BLOCK_N:
        return tl.load(table_row + tl.minimum(start_n // PAGE, last_page)).to(tl.int64)
    elif GATHER == 0:
        # one table load per key (mostly L1 hits)
        idx = tl.minimum((start_n + tl.arange(0, BLOCK_N)) // PAGE, last_page)
        return tl.load(table_row + idx).to(tl.int64)
    else:
        # one table load per page of the tile, broadcast over its keys
        NUM_PAGES: tl.constexpr = BLOCK_N // PAGE
        idx = tl.minimum(start_n // PAGE + tl.arange(0, NUM_PAGES), last_page)
        blocks = tl.load(table_row + idx).to(tl.int64)
        return tl.reshape(tl.broadcast_to(blocks[:, None], (NUM_PAGES, PAGE)), (BLOCK_N,))


@triton.jit
def _paged_inner(acc, l_i, m_i, q, pos, k_head, v_head, table_row,
                 n_lo, n_hi, ctx, diag,
                 stride_kblock, stride_ktok, stride_vblock, stride_vtok,
                 qk_scale_log2,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 IS_CAUSAL: tl.constexpr, GATHER: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    last_page = tl.maximum(tl.cdiv(ctx, PAGE) - 1, 0)
    if GATHER == 2:
        # the next tile's block ids are loaded one iteration ahead, so the K/V
        # addresses of a tile never wait on a table load of the same iteration
        blocks = _tile_blocks(table_row, n_lo, last_page, PAGE, BLOCK_N, GATHER)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        if GATHER == 2:
            cur = blocks
            blocks = _tile_blocks(table_row, start_n + BLOCK_N, last_page, PAGE, BLOCK_N, GATHER)
        else:
            cur = _tile_blocks(table_row, start_n, last_page, PAGE, BLOCK_N, GATHER)
        in_page = ((start_n + offs_n) % PAGE).to(tl.int64)
        k_ptrs = k_head + (cur * stride_kblock + in_page * stride_ktok)[:, None]
        v_ptrs = v_head + (cur * stride_vblock + in_page * stride_vtok)[:, None]
        if MASKED:
            cols = start_n + offs_n
            tok_ok = cols < ctx
            # masked loads give 0 for keys past the context: NaN in unused slots never
            # reaches the dots (0 * NaN would poison every row)
            # .to(q.dtype): widens fp8 tiles (exact); a no-op for 16/32-bit caches
            k = tl.load(k_ptrs, mask=tok_ok[:, None], other=0.0).to(q.dtype)
            v = tl.load(v_ptrs, mask=tok_ok[:, None], other=0.0).to(q.dtype)
            visible = tok_ok[None, :]
            if IS_CAUSAL:
                visible = visible & (cols[None, :] <= pos[:, None] + diag)
            # a row may see nothing here (or at all)
            acc, l_i, m_i = _softmax_step_masked(acc, l_i, m_i, q, k, v, visible, qk_scale_log2, DOT_PRECISION,
                                                 True)
        else:
            k = tl.load(k_ptrs).to(q.dtype)
            v = tl.load(v_ptrs).to(q.dtype)
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, q, k, v, qk_scale_log2, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _paged_kernel(
    Q, K_cache, V_cache, block_tables, cu_seqlens_q, context_lens,
    O, LSE, O_partial, LSE_partial, K_scale, V_scale,
    stride_qt, stride_qh,
    stride_kblock, stride_ktok, stride_khead,
    stride_vblock, stride_vtok, stride_vhead,
    stride_table,
    stride_ot, stride_oh,
    stride_lt, stride_lh,
    num_seqs, num_q_heads, kv_group, num_splits,
    qk_scale_log2,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    SPLIT: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    GATHER: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    pid = tl.program_id(0)
    seq = pid % num_seqs
    q_tile = tl.num_programs(0) // num_seqs - 1 - pid // num_seqs
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    m_start = q_tile * BLOCK_Q
    if m_start < q_len:
        ctx = tl.load(context_lens + seq)
        offs_r = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        pos = m_start + offs_r // kv_group
        heads = kv_head * kv_group + offs_r % kv_group
        row_ok = (offs_r < BLOCK_Q * kv_group) & (pos < q_len)
        tok = q_start.to(tl.int64) + pos
        q = tl.load(Q + tok[:, None] * stride_qt + heads[:, None].to(tl.int64) * stride_qh
                    + offs_d[None, :], mask=row_ok[:, None], other=0.0)

        if IS_CAUSAL:
            diag = ctx - q_len
            # the tile's first position sees keys [0, m_start + diag], its last valid one
            # [0, min(m_start + BLOCK_Q, q_len) - 1 + diag]
            full_end = tl.minimum(m_start + diag + 1, ctx)
            end = tl.minimum(tl.minimum(m_start + BLOCK_Q, q_len) + diag, ctx)
        else:
            diag = 0
            full_end = ctx
            end = ctx
        full_end = tl.maximum(full_end, 0) // BLOCK_N * BLOCK_N
        end = tl.maximum(end, 0)

        # this split's slice of [0, end); a split past the end gets an empty range
        tiles_per_split = tl.cdiv(tl.cdiv(end, BLOCK_N), num_splits)
        n_begin = split * tiles_per_split * BLOCK_N
        n_end = tl.minimum(n_begin + tiles_per_split * BLOCK_N, end)
        n_mid = tl.minimum(tl.maximum(full_end, n_begin), n_end)

        table_row = block_tables + seq.to(tl.int64) * stride_table
        k_head = K_cache + kv_head.to(tl.int64) * stride_khead + offs_d[None, :]
        v_head = V_cache + kv_head.to(tl.int64) * stride_vhead + offs_d[None, :]

        if KV_FP8:
            qk_scale_log2 = qk_scale_log2 * tl.load(K_scale + kv_head)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        acc, l_i, m_i = _paged_inner(acc, l_i, m_i, q, pos, k_head, v_head, table_row,
                                     n_begin, n_mid, ctx, diag,
                                     stride_kblock, stride_ktok, stride_vblock, stride_vtok,
                                     qk_scale_log2, PAGE, BLOCK_N, False, IS_CAUSAL, GATHER, DOT_PRECISION)
        acc, l_i, m_i = _paged_inner(acc, l_i, m_i, q, pos, k_head, v_head, table_row,
                                     n_mid, n_end, ctx, diag,
                                     stride_kblock, stride_ktok, stride_vblock, stride_vtok,
                                     qk_scale_log2, PAGE, BLOCK_N, True, IS_CAUSAL, GATHER, DOT_PRECISION)

        # rows that saw no key: l == 0 and acc == 0, so they store exact zeros
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        if KV_FP8:
            out = out * tl.load(V_scale + kv_head)
        if SPLIT:
            # partials [Tq, Hq, num_splits, D] and [Tq, Hq, num_splits], fp32, log2 domain
            row = (tok * num_q_heads + heads) * num_splits + split
            tl.store(O_partial + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_ok[:, None])
            lse2 = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
            tl.store(LSE_partial + row, lse2, mask=row_ok)
        else:
            tl.store(O + tok[:, None] * stride_ot + heads[:, None].to(tl.int64) * stride_oh
                     + offs_d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])
            if RETURN_LSE:
                lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
                tl.store(LSE + tok * stride_lt + heads.to(tl.int64) * stride_lh, lse, mask=row_ok)
