"""Paged-KV decode in Triton (one query token per sequence), split-KV capable.

Grid (batch, kv_head, split). A program loads each K/V tile of its KV head once
and uses it for every query head of the GQA group: the group's query vectors
are the rows of the QK^T tl.dot (padded to BLOCK_H >= 16, the smallest tensor
core M). The program's token range is a contiguous, BLOCK_N-aligned slice of
the sequence, sized inside the kernel from that sequence's own context length,
so the host never needs context_lens.max().

Tokens reach memory through the block table: token t lives at
(block_tables[b, t // PAGE], t % PAGE). PAGE >= BLOCK_N means a tile lies in
one page (one table load); PAGE < BLOCK_N means a tile gathers several pages
(one table load per token, mostly L1 hits).

With one split the kernel writes the normalised output; with several it writes
an fp32 partial output and its log2-sum-exp per split, and `_decode_reduce`
merges them (the paged kernel's splits use the same reduce: its partials have
the same [rows, Hq, splits, D] layout with a token in place of a sequence).

WORKLIST (constexpr, decode of 2+ sequences; configs.decode_worklist): the grid is
(num_slots, kv_head) and a program maps its slot to (sequence, split) from context_lens alone,
so a sequence's share of the programs follows its length instead of the table's width.
Sequence b takes n_b = max(1, ceil(ctx_b * S / total - 1/4)) slots, at most its tiles, where
S = num_splits is the host's split budget (the splits one sequence may take) and total the
batch's cached tokens; n_b <= ctx_b * S / total + 1, so num_slots = B + S covers every batch.
Equal lengths get ceil(S / B - 1/4) splits each, about the plain plan's round(S / B); one
long sequence among short ones gets the splits the short ones leave idle. A sequence of one slot
writes its output directly; the others write fp32 partials [Hq, num_slots, D] that
_decode_reduce merges after deriving the same plan. Slots past the batch's last return. With
PACKED_Q only the q_len 1 sequences take slots.

RETURN_LSE (constexpr) also stores the natural-log softmax denominator per
query head, -inf where the context is empty.

KV_FP8 (constexpr): the caches hold float8_e4m3fn and the real value is the
stored one times K_scale[h] / V_scale[h] (fp32, one per KV head). Tiles are
loaded as fp8 and widened to q's dtype in registers, which is exact (every e4m3
value is an fp16 and a bf16 value), so the dots see the stored values
unrounded; k_scale is folded into the softmax scale of the program's KV head
and v_scale multiplies the normalised output, the only roundings the scales
add. With KV_FP8 off the kernel is the 16/32-bit one, unchanged.

FP8_F16 (constexpr, with KV_FP8 and a 16-bit q): the dots run in fp16 whatever q's dtype. q
is multiplied by 2^-shift, the power of two that brings its largest magnitude in the
program's tile into (8192, 16384] (exact, barring fp16 subnormals for elements 2^-24 of that
maximum or smaller), and qk_scale by 2^shift; K/V widen from e4m3 straight to fp16 (exact)
and P is rounded to fp16 (finer than bf16 for values in [0, 1]). The accumulators stay fp32.

FP8_WORDS (constexpr, with FP8_F16; 0 off, 1 or 2): the full tiles are read as int32 words
of 4 e4m3 bytes and widened in registers before the dots, so shared memory holds fp16
operands that the dots read with ldmatrix. Widened as dot operands instead (0), the sm_90
code reads the fp8 tiles from shared memory one byte per instruction (128 LDS.U8 per thread
per 64-token tile). 1 joins the widened halves back into one [BLOCK_N, D] tile, which costs
register shuffles; 2 keeps them as four column planes (head dim c in plane c % 4: the same
permutation of the contraction for q and K, undone on the output once per program) and runs
four dots of D / 4 per product, the same MMA count. Unmasked loop per tile under triton 3.6,
the GPU machine's: 640 (0), 554 (1), 478 (2), 423 for a 16-bit cache; triton 3.9: 642 and 431
for 1 (scripts/triton_decode_sm90.py). The ragged last tile takes the whole-tile path.
HW_CVT: the widening by cvt.rn.f16x2.e4m3x2 (two elements per instruction); off (the
interpreter, which runs no PTX), by integer ops on the bits, exact and NaN-preserving too.

TABLE_AHEAD (constexpr; configs.decode_table_ahead: the sm_90 D 128 tiles of FP8 pages, and of
16-bit pages at batch): the full tiles' block ids are read one tile ahead and carried, so no
K/V load waits on a table load of its own iteration. With the table read in the same iteration
the software pipeliner keeps one tile in flight whatever num_stages says (one shared buffer per
operand in the sm_90 TTGIR); ahead, it can keep num_stages - 1. Same tiles, same order: the
results are the same bits.

PACKED_Q (constexpr, default off): the decode rows of a paged batch (ops.paged, mixed mode
"decode"). Program b serves sequence b of the paged call only if its q_len
cu_seqlens_q[b+1] - cu_seqlens_q[b] is 1, and then its query, output and lse row is the
packed token cu_seqlens_q[b] ([Tq, Hq, D] and [Tq, Hq]); a program of any other sequence
returns before it reads or writes anything, and so does its reduce program. Split partials
stay indexed by b (by slot under a work list). Decided on the device, so the launch needs no
host sync. Off, the argument cu_seqlens_q is None (a compile-time constant), so the plain
decode kernel keeps its parameter list and its code.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .softmax import (
    _merge_split_run,
    _merge_splits,
    _q_to_fp16_range,
    _softmax_step,
    _softmax_step_masked,
    _split_lse,
)


@triton.jit
def _tile_offsets(blocks, toks, stride_block, stride_tok, PAGE: tl.constexpr):
    """Offsets of the keys `toks` in a cache whose pages are `blocks` (a scalar or one id per key)."""
    return blocks * stride_block + (toks % PAGE).to(tl.int64) * stride_tok


@triton.jit
def _kv_tile_offsets(table_row, start_n, offs_n, tok_ok, stride_block, stride_tok,
                     PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    toks = start_n + offs_n
    if PAGE >= BLOCK_N:
        block = tl.load(table_row + start_n // PAGE).to(tl.int64)
    else:
        if MASKED:
            block = tl.load(table_row + toks // PAGE, mask=tok_ok, other=0).to(tl.int64)
        else:
            block = tl.load(table_row + toks // PAGE).to(tl.int64)
    return _tile_offsets(block, toks, stride_block, stride_tok, PAGE)


@triton.jit
def _tile_block_ids(table_row, start_n, offs_n, limit, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                    MASKED: tl.constexpr):
    """The block ids of the keys start_n + offs_n (int64): one scalar when PAGE >= BLOCK_N, else
    one per key. MASKED: 0 unless start_n < limit, with nothing read."""
    if PAGE >= BLOCK_N:
        if MASKED:
            return tl.load(table_row + start_n // PAGE, mask=start_n < limit, other=0).to(tl.int64)
        return tl.load(table_row + start_n // PAGE).to(tl.int64)
    else:
        if MASKED:
            return tl.load(table_row + (start_n + offs_n) // PAGE, mask=(offs_n * 0 + start_n) < limit,
                           other=0).to(tl.int64)
        return tl.load(table_row + (start_n + offs_n) // PAGE).to(tl.int64)


@triton.jit
def _full_tile_offsets(table_row, blocks, start_n, full_end, offs_n,
                       stride_kblock, stride_ktok, stride_vblock, stride_vtok,
                       PAGE: tl.constexpr, BLOCK_N: tl.constexpr, TABLE_AHEAD: tl.constexpr):
    """K and V offsets of the full tile at start_n, and the block ids to carry to the next one:
    with TABLE_AHEAD `blocks` holds this tile's ids, read an iteration earlier, and the next
    tile's are read now (the last iteration re-reads its own, so every index stays inside the
    context); without, the ids are read here and `blocks` passes through unused."""
    if TABLE_AHEAD:
        cur = blocks
        blocks = _tile_block_ids(table_row, tl.minimum(start_n + BLOCK_N, full_end - BLOCK_N), offs_n, full_end,
                                 PAGE, BLOCK_N, False)
        k_off = _tile_offsets(cur, start_n + offs_n, stride_kblock, stride_ktok, PAGE)
        v_off = _tile_offsets(cur, start_n + offs_n, stride_vblock, stride_vtok, PAGE)
    else:
        k_off = _kv_tile_offsets(table_row, start_n, offs_n, offs_n < BLOCK_N,
                                 stride_kblock, stride_ktok, PAGE, BLOCK_N, False)
        v_off = _kv_tile_offsets(table_row, start_n, offs_n, offs_n < BLOCK_N,
                                 stride_vblock, stride_vtok, PAGE, BLOCK_N, False)
    return k_off, v_off, blocks


@triton.jit
def _e4m3_byte_to_f16(b):
    """e4m3fn byte b (int32, 0..255) -> its fp16 value: the exponent and mantissa bits shifted
    into fp16's fields give the value times 2^-8 (exponent bias 7 against 15; subnormals too),
    so the product with 256 is exact; 0x7f / 0xff are NaN."""
    bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    h = bits.to(tl.int16).to(tl.float16, bitcast=True) * 256.0
    return tl.where((b & 0x7F) == 0x7F, float("nan"), h).to(tl.float16)


@triton.jit
def _e4m3_word_planes(w, HW_CVT: tl.constexpr):
    """[ROWS, COLS // 4] int32 words of 4 e4m3 bytes -> four fp16 planes [ROWS, COLS // 4]:
    plane j holds element 4c + j of each word c (no interleaving, so no register shuffle)."""
    if HW_CVT:
        lo, hi = tl.inline_asm_elementwise(
            asm="{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h; }",
            constraints="=r,=r,r", args=[w], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        return (lo.to(tl.int16).to(tl.float16, bitcast=True), (lo >> 16).to(tl.int16).to(tl.float16, bitcast=True),
                hi.to(tl.int16).to(tl.float16, bitcast=True), (hi >> 16).to(tl.int16).to(tl.float16, bitcast=True))
    return (_e4m3_byte_to_f16(w & 0xFF), _e4m3_byte_to_f16((w >> 8) & 0xFF),
            _e4m3_byte_to_f16((w >> 16) & 0xFF), _e4m3_byte_to_f16((w >> 24) & 0xFF))


@triton.jit
def _planes4(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """x [ROWS, COLS] -> its four column planes x[:, j::4], j = 0..3."""
    a, b = tl.split(tl.reshape(x, [ROWS, COLS // 4, 2, 2]))  # last dim: element 4c + 2m + k, k split off
    p0, p2 = tl.split(a)
    p1, p3 = tl.split(b)
    return p0, p1, p2, p3


@triton.jit
def _unplanes4(p0, p1, p2, p3, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The inverse of _planes4: [..., k, m] holds element 2k + m of each group of four, so
    join(p0, p2) is m = 0 and join(p1, p3) m = 1."""
    return tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), [ROWS, COLS])


@triton.jit
def _e4m3_words_to_f16(w, ROWS: tl.constexpr, COLS: tl.constexpr, HW_CVT: tl.constexpr):
    """[ROWS, COLS // 4] int32 words of 4 e4m3 bytes each (little endian: byte j is element
    4c + j) -> the [ROWS, COLS] fp16 tile."""
    return _unplanes4(*_e4m3_word_planes(w, HW_CVT), ROWS, COLS)


@triton.jit
def _softmax_step_planes(a0, a1, a2, a3, l_i, m_i, q0, q1, q2, q3, k0, k1, k2, k3, v0, v1, v2, v3,
                         qk_scale_log2, DOT_PRECISION: tl.constexpr):
    """_softmax_step over K, V and the output split into four column planes (a permutation of
    the head dim, the same for q and k, and undone for V at the end): four dots of D / 4
    instead of one of D, the same MMA count."""
    s = tl.dot(q0, tl.trans(k0), input_precision=DOT_PRECISION)
    s = tl.dot(q1, tl.trans(k1), s, input_precision=DOT_PRECISION)
    s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PRECISION)
    s = tl.dot(q3, tl.trans(k3), s, input_precision=DOT_PRECISION)
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale_log2)
    p = tl.math.exp2(s * qk_scale_log2 - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v0.dtype)
    a0 = tl.dot(p, v0, a0 * alpha[:, None], input_precision=DOT_PRECISION)
    a1 = tl.dot(p, v1, a1 * alpha[:, None], input_precision=DOT_PRECISION)
    a2 = tl.dot(p, v2, a2 * alpha[:, None], input_precision=DOT_PRECISION)
    a3 = tl.dot(p, v3, a3 * alpha[:, None], input_precision=DOT_PRECISION)
    return a0, a1, a2, a3, l_i, m_new


@triton.jit
def _worklist_plan(context_lens, num_rows, num_splits, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
                   cu_seqlens_q=None, PACKED_Q: tl.constexpr = False):
    """The work-list plan (module docstring, WORKLIST) of the first num_rows sequences, padded
    to BLOCK_B: (ctx, n, ends) [BLOCK_B], the context lengths, the slots of each sequence
    (0 past num_rows) and their running sum (sequence b owns slots ends[b] - n[b] .. ends[b] - 1).
    PACKED_Q: only the sequences of q_len 1 take slots (and count in the total).
    The decode kernel and its reduce both call this, so they agree on every slot."""
    offs_b = tl.arange(0, BLOCK_B)
    row_ok = offs_b < num_rows
    if PACKED_Q:
        q_begin = tl.load(cu_seqlens_q + offs_b, mask=row_ok, other=0)
        row_ok = row_ok & (tl.load(cu_seqlens_q + offs_b + 1, mask=row_ok, other=0) - q_begin == 1)
    ctx = tl.load(context_lens + offs_b, mask=row_ok, other=0)
    ctx64 = ctx.to(tl.int64)
    total = tl.sum(ctx64, 0)
    # ceil(ctx * S / total - 1/4) in integers: ceil((4 ctx S - total) / (4 total))
    num = 4 * ctx64 * num_splits - total
    den = 4 * tl.maximum(total, 1)
    n = tl.where(num > 0, (num + den - 1) // den, 0)
    n = tl.maximum(tl.minimum(n, tl.cdiv(ctx64, BLOCK_N)), 1)
    n = tl.where(row_ok, n, 0).to(tl.int32)
    return ctx, n, tl.cumsum(n, 0)


@triton.jit
def _sum2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _sum4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _worklist_slot(ctx, n, ends, slot, BLOCK_B: tl.constexpr):
    """(sequence, its slot count, its first slot, its context length) of work slot `slot` under
    the plan (ctx, n, ends) of _worklist_plan: the one lane whose slots hold it, read out in one
    block reduction (Triton has no dynamic index); a count of 0 past the batch's last slot."""
    first = ends - n
    mine = (first <= slot) & (slot < ends)
    return tl.reduce((tl.where(mine, tl.arange(0, BLOCK_B), 0), tl.where(mine, n, 0), tl.where(mine, first, 0),
                      tl.where(mine, ctx, 0)), 0, _sum4)


@triton.jit
def _worklist_row(n, ends, seq, BLOCK_B: tl.constexpr):
    """(slot count, first slot) of sequence `seq` under the plan of _worklist_plan."""
    mine = tl.arange(0, BLOCK_B) == seq
    return tl.reduce((tl.where(mine, n, 0), tl.where(mine, ends - n, 0)), 0, _sum2)


# num_splits unspecialised: it follows the batch size, and Triton would compile a variant for 1, for
# multiples of 16 and for the rest (a stall mid-serving); SPLIT says whether it is 1
@triton.jit(do_not_specialize=["num_splits"])
def _decode_kernel(
    Q, K_cache, V_cache, block_tables, context_lens,
    O, LSE, O_partial, LSE_partial, K_scale, V_scale,
    stride_qb, stride_qh,
    stride_kblock, stride_ktok, stride_khead,
    stride_vblock, stride_vtok, stride_vhead,
    stride_table,
    stride_ob, stride_oh,
    stride_lb, stride_lh,
    kv_group, num_splits,
    qk_scale_log2,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    KV_FP8: tl.constexpr,
    cu_seqlens_q=None,
    PACKED_Q: tl.constexpr = False,
    FP8_F16: tl.constexpr = False,
    FP8_WORDS: tl.constexpr = 0,
    HW_CVT: tl.constexpr = False,
    TABLE_AHEAD: tl.constexpr = False,
    WORKLIST: tl.constexpr = False,
    BLOCK_B: tl.constexpr = 1,
):
    if WORKLIST:
        # grid (B + S, Hkv), S = num_splits
        slot = tl.program_id(0)
        kv_head = tl.program_id(1)
        ctx_all, n_all, ends = _worklist_plan(context_lens, tl.num_programs(0) - num_splits, num_splits, BLOCK_B,
                                              BLOCK_N, cu_seqlens_q, PACKED_Q)
        seq, seq_splits, first_slot, ctx = _worklist_slot(ctx_all, n_all, ends, slot, BLOCK_B)
        if seq_splits == 0:  # past the batch's last slot
            return
        split = slot - first_slot
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq_splits = num_splits
    if PACKED_Q:
        q_row = tl.load(cu_seqlens_q + seq)
        # a sequence of 0 or several tokens belongs to the paged launch of the same call
        if tl.load(cu_seqlens_q + seq + 1) - q_row != 1:
            return
    if KV_FP8:
        qk_scale_log2 = qk_scale_log2 * tl.load(K_scale + kv_head)

    if not WORKLIST:
        ctx = tl.load(context_lens + seq)
    num_tiles = tl.cdiv(ctx, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, seq_splits)
    n_begin = split * tiles_per_split * BLOCK_N
    n_end = tl.minimum(n_begin + tiles_per_split * BLOCK_N, ctx)
    # full tiles run without masks; the ragged last tile of the sequence is masked
    full_end = n_begin + tl.maximum(n_end - n_begin, 0) // BLOCK_N * BLOCK_N

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * kv_group + offs_h
    head_ok = offs_h < kv_group

    seq64 = seq.to(tl.int64)
    # the q/o/lse row: the sequence, or (PACKED_Q) its token in the packed layout
    if PACKED_Q:
        row64 = q_row.to(tl.int64)
    else:
        row64 = seq64
    q = tl.load(Q + row64 * stride_qb + heads[:, None].to(tl.int64) * stride_qh + offs_d[None, :],
                mask=head_ok[:, None], other=0.0)
    if FP8_F16:
        q, qk_scale_log2 = _q_to_fp16_range(q, qk_scale_log2)
    table_row = block_tables + seq64 * stride_table
    k_row0 = K_cache + kv_head.to(tl.int64) * stride_khead
    v_row0 = V_cache + kv_head.to(tl.int64) * stride_vhead
    k_head = k_row0 + offs_d[None, :]
    v_head = v_row0 + offs_d[None, :]

    if FP8_WORDS:
        # the head's row start as int32 words (the launcher checks every stride is a multiple of 4)
        offs_w = tl.arange(0, HEAD_DIM // 4)
        k_words = k_row0.to(tl.pointer_type(tl.int32), bitcast=True)
        v_words = v_row0.to(tl.pointer_type(tl.int32), bitcast=True)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)

    if FP8_WORDS == 2:
        # the full tiles in four column planes (head dim c -> plane c % 4); the ragged tile
        # below takes the whole-tile path, so the planes merge back first
        q0, q1, q2, q3 = _planes4(q, BLOCK_H, HEAD_DIM)
        a0 = tl.zeros([BLOCK_H, HEAD_DIM // 4], dtype=tl.float32)
        a1 = tl.zeros([BLOCK_H, HEAD_DIM // 4], dtype=tl.float32)
        a2 = tl.zeros([BLOCK_H, HEAD_DIM // 4], dtype=tl.float32)
        a3 = tl.zeros([BLOCK_H, HEAD_DIM // 4], dtype=tl.float32)
        blocks = _tile_block_ids(table_row, n_begin, offs_n, full_end, PAGE, BLOCK_N, True) if TABLE_AHEAD else 0
        for start_n in range(n_begin, full_end, BLOCK_N):
            k_off, v_off, blocks = _full_tile_offsets(table_row, blocks, start_n, full_end, offs_n,
                                                      stride_kblock, stride_ktok, stride_vblock, stride_vtok,
                                                      PAGE, BLOCK_N, TABLE_AHEAD)
            k0, k1, k2, k3 = _e4m3_word_planes(tl.load(k_words + (k_off // 4)[:, None] + offs_w[None, :]), HW_CVT)
            v0, v1, v2, v3 = _e4m3_word_planes(tl.load(v_words + (v_off // 4)[:, None] + offs_w[None, :]), HW_CVT)
            a0, a1, a2, a3, l_i, m_i = _softmax_step_planes(a0, a1, a2, a3, l_i, m_i, q0, q1, q2, q3,
                                                            k0, k1, k2, k3, v0, v1, v2, v3, qk_scale_log2,
                                                            DOT_PRECISION)
        acc = _unplanes4(a0, a1, a2, a3, BLOCK_H, HEAD_DIM)
        full_lo = full_end
    else:
        full_lo = n_begin

    blocks = _tile_block_ids(table_row, full_lo, offs_n, full_end, PAGE, BLOCK_N, True) if TABLE_AHEAD else 0
    for start_n in range(full_lo, full_end, BLOCK_N):
        k_off, v_off, blocks = _full_tile_offsets(table_row, blocks, start_n, full_end, offs_n,
                                                  stride_kblock, stride_ktok, stride_vblock, stride_vtok,
                                                  PAGE, BLOCK_N, TABLE_AHEAD)
        if FP8_WORDS == 1:
            k = _e4m3_words_to_f16(tl.load(k_words + (k_off // 4)[:, None] + offs_w[None, :]), BLOCK_N, HEAD_DIM,
                                   HW_CVT)
            v = _e4m3_words_to_f16(tl.load(v_words + (v_off // 4)[:, None] + offs_w[None, :]), BLOCK_N, HEAD_DIM,
                                   HW_CVT)
        else:
            k = tl.load(k_head + k_off[:, None])
            v = tl.load(v_head + v_off[:, None])
            if KV_FP8:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, q, k, v, qk_scale_log2, DOT_PRECISION)

    # at most one ragged tile; masked loads keep NaN-poisoned unused slots and
    # -1 table entries out of the math
    for start_n in range(full_end, n_end, BLOCK_N):
        tok_ok = start_n + offs_n < n_end
        k_off = _kv_tile_offsets(table_row, start_n, offs_n, tok_ok,
                                 stride_kblock, stride_ktok, PAGE, BLOCK_N, True)
        v_off = _kv_tile_offsets(table_row, start_n, offs_n, tok_ok,
                                 stride_vblock, stride_vtok, PAGE, BLOCK_N, True)
        k = tl.load(k_head + k_off[:, None], mask=tok_ok[:, None], other=0.0)
        v = tl.load(v_head + v_off[:, None], mask=tok_ok[:, None], other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        # the ragged tile holds at least one key of the range, so no row's max stays -inf
        acc, l_i, m_i = _softmax_step_masked(acc, l_i, m_i, q, k, v, tok_ok[None, :], qk_scale_log2,
                                             DOT_PRECISION, False)

    # empty range (context 0, or a split past the end): l == 0, acc == 0
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if KV_FP8:
        # the reduce's weighted mean of split partials is linear: scaling each is exact
        out = out * tl.load(V_scale + kv_head)
    if WORKLIST:
        if seq_splits == 1:
            _store_output(O, LSE, row64, heads, head_ok, offs_d, out, l_i, m_i, l_safe,
                          stride_ob, stride_oh, stride_lb, stride_lh, RETURN_LSE)
        else:
            # partial layout [Hq, num_slots, D] and [Hq, num_slots], fp32
            row = heads.to(tl.int64) * tl.num_programs(0) + slot
            _store_partial(O_partial, LSE_partial, row, head_ok, offs_d, out, l_i, m_i, l_safe, HEAD_DIM)
    elif SPLIT:
        # partial layout [B, Hq, num_splits, D] and [B, Hq, num_splits], fp32
        row = (seq64 * (kv_group * tl.num_programs(1)) + heads.to(tl.int64)) * num_splits + split
        _store_partial(O_partial, LSE_partial, row, head_ok, offs_d, out, l_i, m_i, l_safe, HEAD_DIM)
    else:
        _store_output(O, LSE, row64, heads, head_ok, offs_d, out, l_i, m_i, l_safe,
                      stride_ob, stride_oh, stride_lb, stride_lh, RETURN_LSE)


@triton.jit
def _store_partial(O_partial, LSE_partial, row, head_ok, offs_d, out, l_i, m_i, l_safe, HEAD_DIM: tl.constexpr):
    """A split's normalised fp32 output and base-2 lse (-inf when it saw no key) at `row`."""
    tl.store(O_partial + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=head_ok[:, None])
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
    tl.store(LSE_partial + row, lse, mask=head_ok)


@triton.jit
def _store_output(O, LSE, row64, heads, head_ok, offs_d, out, l_i, m_i, l_safe,
                  stride_ob, stride_oh, stride_lb, stride_lh, RETURN_LSE: tl.constexpr):
    """A whole context's output in O's dtype, and (RETURN_LSE) its natural-log lse."""
    tl.store(O + row64 * stride_ob + heads[:, None].to(tl.int64) * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=head_ok[:, None])
    if RETURN_LSE:
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
        tl.store(LSE + row64 * stride_lb + heads.to(tl.int64) * stride_lh, lse, mask=head_ok)


@triton.jit(do_not_specialize=["num_splits"])  # as _decode_kernel
def _decode_reduce(
    O_partial, LSE_partial, O, LSE,
    stride_ob, stride_oh,
    stride_lb, stride_lh,
    num_q_heads, num_splits,
    HEAD_DIM: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    cu_seqlens_q=None,
    PACKED_Q: tl.constexpr = False,
    context_lens=None,
    WORKLIST: tl.constexpr = False,
    BLOCK_B: tl.constexpr = 1,
    BLOCK_N: tl.constexpr = 1,
):
    """Grid (B, Hq). WORKLIST: the kernel's plan again (same BLOCK_N and budget num_splits, so
    B + num_splits slots); a sequence of one slot was written by the kernel, the others merge
    their consecutive slots in chunks of SPLITS_POW2."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    if PACKED_Q:
        # partials are indexed by sequence, the output by its packed token (see the kernel)
        q_row = tl.load(cu_seqlens_q + seq)
        if tl.load(cu_seqlens_q + seq + 1) - q_row != 1:
            return
    offs_d = tl.arange(0, HEAD_DIM)
    if WORKLIST:
        _, n_all, ends = _worklist_plan(context_lens, tl.num_programs(0), num_splits, BLOCK_B, BLOCK_N, cu_seqlens_q,
                                        PACKED_Q)
        seq_splits, first_slot = _worklist_row(n_all, ends, seq, BLOCK_B)
        if seq_splits <= 1:  # written by the kernel (or, packed, not a decode row)
            return
        row0 = head.to(tl.int64) * (tl.num_programs(0) + num_splits) + first_slot
        out, m_sub, total = _merge_split_run(O_partial, LSE_partial, row0, seq_splits, offs_d, HEAD_DIM,
                                             SPLITS_POW2)
    else:
        row0 = (seq.to(tl.int64) * num_q_heads + head) * num_splits
        out, m_sub, total = _merge_splits(O_partial, LSE_partial, row0, num_splits, offs_d, HEAD_DIM,
                                          SPLITS_POW2)
    if PACKED_Q:
        row64 = q_row.to(tl.int64)
    else:
        row64 = seq.to(tl.int64)
    tl.store(O + row64 * stride_ob + head.to(tl.int64) * stride_oh + offs_d,
             out.to(O.dtype.element_ty))
    if RETURN_LSE:
        lse_row = _split_lse(m_sub, total)
        tl.store(LSE + row64 * stride_lb + head.to(tl.int64) * stride_lh, lse_row)
