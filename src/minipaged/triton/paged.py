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

INVARIANT_SEGMENT (constexpr, > 0): the batch-invariant path (_invariant_tile) for the
engine's batch_invariant mode (invariant.py): pinned tile, keys in fixed segments of
INVARIANT_SEGMENT tiles, every tile masked, segments folded in order (split or not).

Split-KV: with several splits, split p takes a contiguous BLOCK_N-aligned slice
of [0, end) and writes an fp32 partial output and its log2-sum-exp; the decode
reduce kernel merges them, and stores the lse when asked.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .prefill import _causal_key_range
from .softmax import (_merge_segment, _merge_splits, _merged_result, _q_to_fp16_range, _segment_result,
                      _softmax_step, _softmax_step_masked, _split_lse)



@triton.jit
def _tile_blocks(table_row, start_n, last_page,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, GATHER: tl.constexpr, limit=None):
    """Cache block of every key of the tile starting at start_n: a scalar when one page
    holds the tile, else [BLOCK_N]. Table indices are clamped to the last page the
    context uses, so entries past it (maybe -1) are never read; keys past the
    context get some valid block and are masked by the caller. limit: nothing is read
    (ids 0) unless start_n < limit; a context of 0 uses no page, and its row may have no entry."""
    if PAGE >= BLOCK_N:
        idx = tl.minimum(start_n // PAGE, last_page)
    elif GATHER == 0:
        # one table load per key (mostly L1 hits)
        idx = tl.minimum((start_n + tl.arange(0, BLOCK_N)) // PAGE, last_page)
    else:
        # one table load per page of the tile, broadcast over its keys
        idx = tl.minimum(start_n // PAGE + tl.arange(0, BLOCK_N // PAGE), last_page)
    if limit is None:
        blocks = tl.load(table_row + idx).to(tl.int64)
    else:
        blocks = tl.load(table_row + idx, mask=(idx * 0 + start_n) < limit, other=0).to(tl.int64)
    if PAGE < BLOCK_N and GATHER != 0:
        NUM_PAGES: tl.constexpr = BLOCK_N // PAGE
        blocks = tl.reshape(tl.broadcast_to(blocks[:, None], (NUM_PAGES, PAGE)), (BLOCK_N,))
    return blocks


@triton.jit
def _paged_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, cols, ctx, pos, diag, qk_scale_log2,
                MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One KV tile of a paged kernel: keys `cols` at k_ptrs / v_ptrs [BLOCK_N, D]. MASKED:
    the tile reaches past the context or into the causal band; masked loads give 0 for keys
    past the context, so NaN in unused slots never reaches the dots (0 * NaN would poison
    every row), and a row may see nothing here (or at all). .to(q.dtype) widens fp8 tiles
    (exact), a no-op for 16/32-bit caches."""
    if MASKED:
        tok_ok = cols < ctx
        k = tl.load(k_ptrs, mask=tok_ok[:, None], other=0.0).to(q.dtype)
        v = tl.load(v_ptrs, mask=tok_ok[:, None], other=0.0).to(q.dtype)
        visible = tok_ok[None, :]
        if IS_CAUSAL:
            visible = visible & (cols[None, :] <= pos[:, None] + diag)
        acc, l_i, m_i = _softmax_step_masked(acc, l_i, m_i, q, k, v, visible, qk_scale_log2, DOT_PRECISION, True)
    else:
        k = tl.load(k_ptrs).to(q.dtype)
        v = tl.load(v_ptrs).to(q.dtype)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, q, k, v, qk_scale_log2, DOT_PRECISION)
    return acc, l_i, m_i


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
        # addresses of a tile never wait on a table load of the same iteration;
        # an empty range reads none (its context may be 0)
        blocks = _tile_blocks(table_row, n_lo, last_page, PAGE, BLOCK_N, GATHER, n_hi)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        if GATHER == 2:
            cur = blocks
            blocks = _tile_blocks(table_row, start_n + BLOCK_N, last_page, PAGE, BLOCK_N, GATHER)
        else:
            cur = _tile_blocks(table_row, start_n, last_page, PAGE, BLOCK_N, GATHER)
        in_page = ((start_n + offs_n) % PAGE).to(tl.int64)
        k_ptrs = k_head + (cur * stride_kblock + in_page * stride_ktok)[:, None]
        v_ptrs = v_head + (cur * stride_vblock + in_page * stride_vtok)[:, None]
        acc, l_i, m_i = _paged_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n + offs_n, ctx, pos, diag,
                                    qk_scale_log2, MASKED, IS_CAUSAL, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _program_head(num_kv_heads, HEADS_FASTEST: tl.constexpr):
    """(this program's index along the tiles, the number of such indices, its KV head).
    HEADS_FASTEST: axis 0 holds tile index t of KV head h at t * num_kv_heads + h (axis 1 is
    1); the GPU starts programs in index order, so the longest tile of every head comes before
    the next tile of any (configs.PAGED_HEADS_FASTEST). Otherwise heads are axis 1."""
    if HEADS_FASTEST:
        return (tl.program_id(0) // num_kv_heads, tl.num_programs(0) // num_kv_heads,
                tl.program_id(0) % num_kv_heads)
    return tl.program_id(0), tl.num_programs(0), tl.program_id(1)


@triton.jit
def _tile_rows(Q, q_start, q_len, m_start, kv_head, kv_group, stride_qt, stride_qh,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr):
    """The BLOCK_M packed (position, head) rows of a tile: query positions m_start ..
    m_start + BLOCK_Q - 1 of one sequence times the kv_group query heads of kv_head.
    -> (offs_d, pos, heads, row_ok, tok, q [BLOCK_M, HEAD_DIM]); rows past the sequence
    (or the tile's BLOCK_Q * kv_group) load zeros and have row_ok False."""
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    pos = m_start + offs_r // kv_group
    heads = kv_head * kv_group + offs_r % kv_group
    row_ok = (offs_r < BLOCK_Q * kv_group) & (pos < q_len)
    tok = q_start.to(tl.int64) + pos
    q = tl.load(Q + tok[:, None] * stride_qt + heads[:, None].to(tl.int64) * stride_qh
                + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    return offs_d, pos, heads, row_ok, tok, q


@triton.jit
def _tile_keys(ctx, q_len, m_start, split, num_splits, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """The keys a tile at query position m_start reads (bottom-right causal: position i
    sees [0, i + ctx - q_len]), this split's slice of them: -> (diag, n_begin, n_mid,
    n_end); [n_begin, n_mid) needs no mask, [n_mid, n_end) does; a split past the end gets
    an empty range."""
    # the tile's positions [m_start, min(m_start + BLOCK_Q, q_len)) of the sequence
    diag, full_end, end = _causal_key_range(q_len, ctx, m_start, tl.minimum(m_start + BLOCK_Q, q_len), IS_CAUSAL,
                                            BLOCK_N)
    tiles_per_split = tl.cdiv(tl.cdiv(end, BLOCK_N), num_splits)
    n_begin = split * tiles_per_split * BLOCK_N
    n_end = tl.minimum(n_begin + tiles_per_split * BLOCK_N, end)
    n_mid = tl.minimum(tl.maximum(full_end, n_begin), n_end)
    return diag, n_begin, n_mid, n_end


@triton.jit
def _tile_store(acc, l_i, m_i, tok, heads, row_ok, offs_d, split, num_q_heads, num_splits, kv_head,
                O, LSE, O_partial, LSE_partial, V_scale, stride_ot, stride_oh, stride_lt, stride_lh,
                HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, RETURN_LSE: tl.constexpr, KV_FP8: tl.constexpr):
    """acc / l to O (and the natural-log lse), or, SPLIT, the fp32 partials [Tq, Hq,
    num_splits, D] and their base-2 lse [Tq, Hq, num_splits]. Rows that saw no key (l == 0,
    acc == 0) store exact zeros and lse -inf."""
    out, lse2 = _segment_result(acc, l_i, m_i)
    if KV_FP8:
        out = out * tl.load(V_scale + kv_head)
    if SPLIT:
        row = (tok * num_q_heads + heads) * num_splits + split
        tl.store(O_partial + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_ok[:, None])
        tl.store(LSE_partial + row, lse2, mask=row_ok)
    else:
        tl.store(O + tok[:, None] * stride_ot + heads[:, None].to(tl.int64) * stride_oh
                 + offs_d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])
        if RETURN_LSE:
            # natural log (-inf stays -inf)
            tl.store(LSE + tok * stride_lt + heads.to(tl.int64) * stride_lh, lse2 * 0.6931471805599453, mask=row_ok)


@triton.jit
def _invariant_segment(q, pos, k_head, v_head, table_row, lo, hi, ctx, diag,
                       stride_kblock, stride_ktok, stride_vblock, stride_vtok, qk_scale_log2, V_scale, kv_head,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                       IS_CAUSAL: tl.constexpr, GATHER: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       KV_FP8: tl.constexpr):
    """One key segment [lo, hi) of the batch-invariant path from a fresh softmax state, every
    tile through the masked step -> (its normalised output, fp32, and base-2 lse)."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc, l_i, m_i = _paged_inner(acc, l_i, m_i, q, pos, k_head, v_head, table_row, lo, hi, ctx, diag,
                                 stride_kblock, stride_ktok, stride_vblock, stride_vtok,
                                 qk_scale_log2, PAGE, BLOCK_N, True, IS_CAUSAL, GATHER, DOT_PRECISION)
    part, lse2 = _segment_result(acc, l_i, m_i)
    if KV_FP8:
        part = part * tl.load(V_scale + kv_head)
    return part, lse2


@triton.jit
def _invariant_tile(q, pos, tok, heads, row_ok, offs_d, k_head, v_head, table_row, ctx, q_len, m_start,
                    split, num_q_heads, num_splits, kv_head, O, LSE, O_partial, LSE_partial, V_scale,
                    stride_kblock, stride_ktok, stride_vblock, stride_vtok,
                    stride_ot, stride_oh, stride_lt, stride_lh, qk_scale_log2,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                    PAGE: tl.constexpr, IS_CAUSAL: tl.constexpr, SPLIT: tl.constexpr, RETURN_LSE: tl.constexpr,
                    GATHER: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
                    SEGMENT_TILES: tl.constexpr):
    """The batch-invariant path (ops.paged(batch_invariant=True)): a row's bits depend on its
    query and its keys only. Keys are cut into segments of SEGMENT_TILES * BLOCK_N at fixed
    key positions; each segment is attended from a fresh state with every tile through the
    masked step (where the unmasked range would end depends on the other rows of the tile,
    and with FMA contraction the two steps round differently), then folded into the row's
    result in segment order by softmax._merge_segment. SPLIT: this program computes segment
    `split` only and stores it for invariant_reduce, which folds the segments with the same
    function; otherwise it folds them itself. The launcher compiles both without FMA
    contraction, so the arithmetic is the same either way and it may split a decode batch
    and not a prefill. Segments and key tiles a row sees nothing of are exact no-ops
    (p = 0, alpha = 1), so the tile's other rows never change a row's result."""
    SEGMENT: tl.constexpr = SEGMENT_TILES * BLOCK_N
    diag, full_end, end = _causal_key_range(q_len, ctx, m_start, tl.minimum(m_start + BLOCK_Q, q_len), IS_CAUSAL,
                                            BLOCK_N)
    if SPLIT:
        lo = split * SEGMENT
        part, lse2 = _invariant_segment(q, pos, k_head, v_head, table_row, lo, tl.minimum(lo + SEGMENT, end), ctx,
                                        diag, stride_kblock, stride_ktok, stride_vblock, stride_vtok, qk_scale_log2,
                                        V_scale, kv_head, HEAD_DIM, BLOCK_M, BLOCK_N, PAGE, IS_CAUSAL, GATHER,
                                        DOT_PRECISION, KV_FP8)
        row = (tok * num_q_heads + heads) * num_splits + split
        tl.store(O_partial + row[:, None] * HEAD_DIM + offs_d[None, :], part, mask=row_ok[:, None])
        tl.store(LSE_partial + row, lse2, mask=row_ok)
    else:
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        for lo in range(0, end, SEGMENT):
            part, lse2 = _invariant_segment(q, pos, k_head, v_head, table_row, lo, tl.minimum(lo + SEGMENT, end),
                                            ctx, diag, stride_kblock, stride_ktok, stride_vblock, stride_vtok,
                                            qk_scale_log2, V_scale, kv_head, HEAD_DIM, BLOCK_M, BLOCK_N, PAGE,
                                            IS_CAUSAL, GATHER, DOT_PRECISION, KV_FP8)
            acc, total, m = _merge_segment(acc, total, m, part, lse2)
        out, lse = _merged_result(acc, total, m)
        tl.store(O + tok[:, None] * stride_ot + heads[:, None].to(tl.int64) * stride_oh
                 + offs_d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])
        if RETURN_LSE:
            tl.store(LSE + tok * stride_lt + heads.to(tl.int64) * stride_lh, lse, mask=row_ok)


@triton.jit
def invariant_reduce(
    O_partial, LSE_partial, O, LSE,
    num_rows, num_q_heads, num_splits,
    stride_ot, stride_oh,
    stride_lt, stride_lh,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    """Folds the segments the batch-invariant SPLIT launch stored (rows r = token * Hq +
    head, num_splits each) in segment order, as the unsplit launch folds them itself."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows < num_rows
    acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    for p in range(0, num_splits):
        r = rows.to(tl.int64) * num_splits + p
        part = tl.load(O_partial + r[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0)
        lse2 = tl.load(LSE_partial + r, mask=ok, other=float("-inf"))
        acc, total, m = _merge_segment(acc, total, m, part, lse2)
    out, lse = _merged_result(acc, total, m)
    tok = (rows // num_q_heads).to(tl.int64)
    head = (rows % num_q_heads).to(tl.int64)
    tl.store(O + (tok * stride_ot + head * stride_oh)[:, None] + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=ok[:, None])
    if RETURN_LSE:
        tl.store(LSE + tok * stride_lt + head * stride_lh, lse, mask=ok)


# num_seqs and num_splits unspecialised: a server's batches take every value, and Triton would compile
# a variant for 1, for multiples of 16 and for the rest (SPLIT says whether num_splits is 1)
@triton.jit(do_not_specialize=["num_seqs", "num_splits"])
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
    MIN_Q: tl.constexpr = 0,
    MAX_Q: tl.constexpr = 0,
    INVARIANT_SEGMENT: tl.constexpr = 0,
    HEADS_FASTEST: tl.constexpr = False,
):
    pid, programs, kv_head = _program_head(num_q_heads // kv_group, HEADS_FASTEST)
    seq = pid % num_seqs
    q_tile = programs // num_seqs - 1 - pid // num_seqs
    split = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    m_start = q_tile * BLOCK_Q
    run = m_start < q_len
    # a two-launch batch: sequences outside (MIN_Q, MAX_Q] belong to the other launch
    if MIN_Q > 0:
        run = run & (q_len > MIN_Q)
    if MAX_Q > 0:
        run = run & (q_len <= MAX_Q)
    if run:
        ctx = tl.load(context_lens + seq)
        offs_d, pos, heads, row_ok, tok, q = _tile_rows(Q, q_start, q_len, m_start, kv_head, kv_group,
                                                        stride_qt, stride_qh, HEAD_DIM, BLOCK_M, BLOCK_Q)
        # (unused by the invariant path, which finds its keys itself)
        diag, n_begin, n_mid, n_end = _tile_keys(ctx, q_len, m_start, split, num_splits, IS_CAUSAL, BLOCK_Q,
                                                 BLOCK_N)

        table_row = block_tables + seq.to(tl.int64) * stride_table
        k_head = K_cache + kv_head.to(tl.int64) * stride_khead + offs_d[None, :]
        v_head = V_cache + kv_head.to(tl.int64) * stride_vhead + offs_d[None, :]

        if KV_FP8:
            qk_scale_log2 = qk_scale_log2 * tl.load(K_scale + kv_head)
        if INVARIANT_SEGMENT > 0:
            _invariant_tile(q, pos, tok, heads, row_ok, offs_d, k_head, v_head, table_row, ctx, q_len, m_start,
                            split, num_q_heads, num_splits, kv_head, O, LSE, O_partial, LSE_partial, V_scale,
                            stride_kblock, stride_ktok, stride_vblock, stride_vtok,
                            stride_ot, stride_oh, stride_lt, stride_lh, qk_scale_log2,
                            HEAD_DIM, BLOCK_M, BLOCK_Q, BLOCK_N, PAGE, IS_CAUSAL, SPLIT, RETURN_LSE, GATHER,
                            DOT_PRECISION, KV_FP8, INVARIANT_SEGMENT)
        else:
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

            _tile_store(acc, l_i, m_i, tok, heads, row_ok, offs_d, split, num_q_heads, num_splits, kv_head,
                        O, LSE, O_partial, LSE_partial, V_scale, stride_ot, stride_oh, stride_lt, stride_lh,
                        HEAD_DIM, SPLIT, RETURN_LSE, KV_FP8)


# ------------------------------------------------------------------ long chunks (v2)
#
# The kernel above spends about a third more instructions per KV tile than the dense
# prefill kernel (sm_90 SASS of the unmasked loop, bf16 D 128, page 16: 426 against
# 331): every tile recomputes each key's page offset with a signed remainder and
# multiplies block ids by the runtime strides in full 64-bit arithmetic. The long-chunk
# kernel below does per tile only what the gather needs: one table entry per key
# (a scalar when one page holds the tile), one multiply by a compile-time page stride
# (a single 32x32->64 multiply-add), added to K/V tile pointers built once before the
# loop. The caches must be contiguous (the backend contract): the token stride is the
# constexpr STRIDE_TOK = Hkv * D, the head stride HEAD_DIM, and K and V share them.
#
# Work split: program t of axis 0 (reversed, so later tiles start first) owns query
# positions [j * BLOCK_Q, (j + 1) * BLOCK_Q) of one sequence (HEADS_FASTEST: axis 0 holds
# slot t of KV head h at t * Hkv + h, and axis 1 is 1). DIRECT: t = tile * S + seq,
# the layout of the kernel above, for batches where nearly every sequence has
# max_seqlen_q tokens. Otherwise a compact tile space without a host sync: sequence s
# owns slots [cu[s] // BLOCK_Q + s, cu[s + 1] // BLOCK_Q + s + 1) (at least
# ceil(q_len / BLOCK_Q) of them, since floor((a + n) / B) - floor(a / B) >= floor(n / B)),
# Tq // BLOCK_Q + S slots in all, and a program finds its sequence by counting slot
# starts <= t in two vector loads of cu_seqlens (a coarse pass over every
# ceil(S / SEARCH)-th start, then SEARCH starts from there; S <= SEARCH^2).
# MIN_Q > 0: sequences of at most MIN_Q tokens are left to a packed launch (mixed batches).
# FP8_F16 (with KV_FP8): the dots run in fp16 whatever q's dtype (softmax._q_to_fp16_range, as
# decode.py's FP8_F16): a bf16 q then widens each e4m3 pair with one cvt instead of four
# conversions (configs.paged_fp8_f16).


@triton.jit
def _long_index(start_n, key_page, last_page, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, CLAMP: tl.constexpr):
    """Table index of each key of the tile at start_n ([BLOCK_N]), or of the whole tile
    (a scalar) when one page holds it. CLAMP: the tile may reach past the context, whose
    table entries past the used ones may be -1."""
    if PAGE >= BLOCK_N:
        idx = start_n // PAGE
    else:
        idx = start_n // PAGE + key_page
    if CLAMP:
        idx = tl.minimum(idx, last_page)
    return idx


@triton.jit
def _long_inner(acc, l_i, m_i, q, pos, k_tile, v_tile, table_row, key_page,
                n_lo, n_hi, ctx, diag, last_page, qk_scale_log2,
                PAGE: tl.constexpr, BLOCK_N: tl.constexpr, STRIDE_TOK: tl.constexpr,
                MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                PREFETCH: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    if PREFETCH:
        # block ids of the next tile are read one iteration ahead and carried, so the
        # K/V loads depend on no load of their own iteration: the software pipeliner
        # then keeps them num_stages - 1 tiles ahead (with the table read in the same
        # iteration it spends a stage on it and waits on every tile)
        # masked: an empty range of an empty context reads nothing (its table row may
        # have no entry)
        idx0 = _long_index(n_lo, key_page, last_page, PAGE, BLOCK_N, True)
        blk = tl.load(table_row + idx0, mask=(idx0 * 0 + n_lo) < n_hi, other=0)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        if PREFETCH:
            cur = blk
            if MASKED:
                blk = tl.load(table_row + _long_index(start_n + BLOCK_N, key_page, last_page, PAGE, BLOCK_N, True))
            else:
                # every tile of the unmasked range lies inside the context: clamping the next
                # tile's start to the range's last tile (the last iteration re-reads that one)
                # keeps every index in range with one scalar min instead of one per key
                nxt = tl.minimum(start_n + BLOCK_N, n_hi - BLOCK_N)
                blk = tl.load(table_row + _long_index(nxt, key_page, last_page, PAGE, BLOCK_N, False))
        else:
            # start_n < n_hi <= ctx: only keys of the masked loop can be past the context
            cur = tl.load(table_row + _long_index(start_n, key_page, last_page, PAGE, BLOCK_N, MASKED))
        if PAGE >= BLOCK_N:
            off = cur.to(tl.int64) * (PAGE * STRIDE_TOK) + (start_n % PAGE) * STRIDE_TOK
            k_ptrs = k_tile + off
            v_ptrs = v_tile + off
        else:
            off = cur.to(tl.int64) * (PAGE * STRIDE_TOK)
            k_ptrs = k_tile + off[:, None]
            v_ptrs = v_tile + off[:, None]
        acc, l_i, m_i = _paged_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n + offs_n, ctx, pos, diag,
                                    qk_scale_log2, MASKED, IS_CAUSAL, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _slot_seq(cu_seqlens_q, num_seqs, slot, BLOCK_Q: tl.constexpr, SEARCH: tl.constexpr):
    """The sequence whose slots of the compact tile space hold `slot`: the last s with
    cu[s] // BLOCK_Q + s <= slot (slot starts grow strictly with s)."""
    k = tl.arange(0, SEARCH)
    step = tl.cdiv(num_seqs, SEARCH)
    s1 = k * step
    ok1 = s1 < num_seqs
    start1 = tl.load(cu_seqlens_q + s1, mask=ok1, other=0) // BLOCK_Q + s1
    coarse = tl.sum((ok1 & (start1 <= slot)).to(tl.int32), 0) - 1
    s2 = coarse * step + k
    ok2 = (k < step) & (s2 < num_seqs)
    start2 = tl.load(cu_seqlens_q + s2, mask=ok2, other=0) // BLOCK_Q + s2
    return coarse * step + tl.sum((ok2 & (start2 <= slot)).to(tl.int32), 0) - 1


@triton.jit(do_not_specialize=["num_seqs", "num_splits"])  # as _paged_kernel
def _paged_long_kernel(
    Q, K_cache, V_cache, block_tables, cu_seqlens_q, context_lens,
    O, LSE, O_partial, LSE_partial, K_scale, V_scale,
    stride_qt, stride_qh,
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
    STRIDE_TOK: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    SPLIT: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    DIRECT: tl.constexpr,
    SEARCH: tl.constexpr,
    MIN_Q: tl.constexpr,
    PREFETCH: tl.constexpr,
    HEADS_FASTEST: tl.constexpr = False,
    FP8_F16: tl.constexpr = False,
):
    pid, programs, kv_head = _program_head(num_q_heads // kv_group, HEADS_FASTEST)
    slot = programs - 1 - pid
    split = tl.program_id(2)
    if DIRECT:
        seq = slot % num_seqs
        q_start = tl.load(cu_seqlens_q + seq)
        q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
        m_start = slot // num_seqs * BLOCK_Q
    else:
        seq = _slot_seq(cu_seqlens_q, num_seqs, slot, BLOCK_Q, SEARCH)
        q_start = tl.load(cu_seqlens_q + seq)
        q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
        m_start = (slot - q_start // BLOCK_Q - seq) * BLOCK_Q
    run = m_start < q_len
    if MIN_Q > 0:
        run = run & (q_len > MIN_Q)
    if run:
        ctx = tl.load(context_lens + seq)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d, pos, heads, row_ok, tok, q = _tile_rows(Q, q_start, q_len, m_start, kv_head, kv_group,
                                                        stride_qt, stride_qh, HEAD_DIM, BLOCK_M, BLOCK_Q)
        diag, n_begin, n_mid, n_end = _tile_keys(ctx, q_len, m_start, split, num_splits, IS_CAUSAL, BLOCK_Q,
                                                 BLOCK_N)

        # built once: each key's offset inside its page (tiles start on page boundaries
        # when a tile spans pages, so it does not change from tile to tile) plus the head
        table_row = block_tables + seq.to(tl.int64) * stride_table
        if PAGE >= BLOCK_N:
            inner = offs_n[:, None] * STRIDE_TOK + offs_d[None, :]
        else:
            inner = (offs_n % PAGE)[:, None] * STRIDE_TOK + offs_d[None, :]
        k_tile = K_cache + kv_head * HEAD_DIM + inner
        v_tile = V_cache + kv_head * HEAD_DIM + inner
        key_page = offs_n // PAGE
        last_page = tl.maximum(tl.cdiv(ctx, PAGE) - 1, 0)

        if KV_FP8:
            qk_scale_log2 = qk_scale_log2 * tl.load(K_scale + kv_head)
            if FP8_F16:
                q, qk_scale_log2 = _q_to_fp16_range(q, qk_scale_log2)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        acc, l_i, m_i = _long_inner(acc, l_i, m_i, q, pos, k_tile, v_tile, table_row, key_page,
                                    n_begin, n_mid, ctx, diag, last_page, qk_scale_log2,
                                    PAGE, BLOCK_N, STRIDE_TOK, False, IS_CAUSAL, DOT_PRECISION, PREFETCH)
        acc, l_i, m_i = _long_inner(acc, l_i, m_i, q, pos, k_tile, v_tile, table_row, key_page,
                                    n_mid, n_end, ctx, diag, last_page, qk_scale_log2,
                                    PAGE, BLOCK_N, STRIDE_TOK, True, IS_CAUSAL, DOT_PRECISION, PREFETCH)

        _tile_store(acc, l_i, m_i, tok, heads, row_ok, offs_d, split, num_q_heads, num_splits, kv_head,
                    O, LSE, O_partial, LSE_partial, V_scale, stride_ot, stride_oh, stride_lt, stride_lh,
                    HEAD_DIM, SPLIT, RETURN_LSE, KV_FP8)


@triton.jit
def _short_reduce(
    O_partial, LSE_partial, O, LSE, cu_seqlens_q,
    stride_ot, stride_oh,
    stride_lt, stride_lh,
    num_q_heads, num_splits,
    HEAD_DIM: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
    MAX_Q: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    """Merges the split-KV partials of the short launch of a mixed batch (sequences of
    1..MAX_Q tokens) into O and LSE; rows of longer sequences belong to the long launch
    and are left alone. Partials are indexed by token as in _paged_kernel."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    if q_len <= MAX_Q:
        offs_d = tl.arange(0, HEAD_DIM)
        for i in range(0, q_len):
            tok = q_start.to(tl.int64) + i
            row0 = (tok * num_q_heads + head) * num_splits
            out, m_sub, total = _merge_splits(O_partial, LSE_partial, row0, num_splits, offs_d, HEAD_DIM, SPLITS_POW2)
            tl.store(O + tok * stride_ot + head.to(tl.int64) * stride_oh + offs_d, out.to(O.dtype.element_ty))
            if RETURN_LSE:
                lse_row = _split_lse(m_sub, total)
                tl.store(LSE + tok * stride_lt + head.to(tl.int64) * stride_lh, lse_row)
