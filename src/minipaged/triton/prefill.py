"""FlashAttention-2 forward in Triton: one kernel body for dense and varlen prefill.

Each program owns BLOCK_M query rows of one (sequence, query head). The Q tile
stays in registers; K/V tiles of BLOCK_N keys stream through shared memory;
softmax is online in the log2 domain (scale * log2(e) is folded into one
multiplier so every exponential is a single exp2). P goes from registers
straight into the PV tl.dot.

Causal masking is bottom-right aligned (row i sees key j iff j <= i + Nk - Nq).
For a query tile the key range splits in three parts:
  [0, full_end)       every row sees every key: no mask work at all
  [full_end, end)     the diagonal band: per-element mask
  [end, Nk)           seen by no row: never loaded
Dense and varlen differ only in where a sequence starts: dense passes batch
strides and fixed lengths, varlen passes cu_seqlens and a zero batch stride.

RETURN_LSE (constexpr, so the default launch carries none of it) also stores
the natural-log softmax denominator per row, -inf for a row that saw no key.

This is the "pointer" variant; prefill_tma.py holds the Hopper ones (TMA descriptors,
warp specialisation), chosen by configs.prefill_variant.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .softmax import _softmax_step, _softmax_step_lazy, _softmax_step_masked


@triton.jit
def _program_rows(cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, num_q_heads, kv_group,
                  IS_VARLEN: tl.constexpr):
    """Which (sequence, head, query tile) a program of the prefill grid owns: axis 0 is
    sequence x head, axis 1 the query tile, reversed so that the bottom tiles (the most
    keys under a causal mask) start first. -> (seq, head, kv_head, pid_m, q_start, q_len,
    k_start, k_len); starts are rows of the packed varlen tensors (0 when dense)."""
    return _rows_of(tl.program_id(0), tl.num_programs(1) - 1 - tl.program_id(1), cu_seqlens_q, cu_seqlens_k,
                    seqlen_q, seqlen_k, num_q_heads, kv_group, IS_VARLEN)


@triton.jit
def _rows_of(pid_bh, pid_m, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, num_q_heads, kv_group,
             IS_VARLEN: tl.constexpr):
    """_program_rows for the (sequence x head, query tile) pair (pid_bh, pid_m)."""
    seq = pid_bh // num_q_heads
    head = pid_bh % num_q_heads
    kv_head = head // kv_group
    if IS_VARLEN:
        q_start = tl.load(cu_seqlens_q + seq).to(tl.int64)
        q_len = (tl.load(cu_seqlens_q + seq + 1) - tl.load(cu_seqlens_q + seq)).to(tl.int32)
        k_start = tl.load(cu_seqlens_k + seq).to(tl.int64)
        k_len = (tl.load(cu_seqlens_k + seq + 1) - tl.load(cu_seqlens_k + seq)).to(tl.int32)
    else:
        q_start = 0
        q_len = seqlen_q
        k_start = 0
        k_len = seqlen_k
    return seq, head, kv_head, pid_m, q_start, q_len, k_start, k_len


@triton.jit
def _head_bases(Q, K, V, O, seq64, head, kv_head, q_start, k_start,
                stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om):
    """Row 0 of this program's (sequence, head) in Q and O, of its KV head in K and V."""
    q_base = Q + seq64 * stride_qb + q_start * stride_qm + head.to(tl.int64) * stride_qh
    k_base = K + seq64 * stride_kb + k_start * stride_kn + kv_head.to(tl.int64) * stride_kh
    v_base = V + seq64 * stride_vb + k_start * stride_vn + kv_head.to(tl.int64) * stride_vh
    o_base = O + seq64 * stride_ob + q_start * stride_om + head.to(tl.int64) * stride_oh
    return q_base, k_base, v_base, o_base


@triton.jit
def _causal_key_range(q_len, k_len, m_start, rows_end, IS_CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Bottom-right causal: query row i sees keys [0, i + k_len - q_len]. For a tile of rows
    [m_start, rows_end) -> (diag, full_end, end): every row of the tile sees keys
    [0, full_end) completely (a multiple of BLOCK_N), some row sees keys up to end; the keys
    in between need the mask."""
    if IS_CAUSAL:
        diag = k_len - q_len
        # the first row of the tile sees keys [0, m_start + diag], its last one
        # [0, rows_end - 1 + diag]
        full_end = tl.minimum(m_start + diag + 1, k_len)
        end = tl.minimum(rows_end + diag, k_len)
    else:
        diag = 0
        full_end = k_len
        end = k_len
    full_end = tl.maximum(full_end, 0) // BLOCK_N * BLOCK_N
    end = tl.maximum(end, 0)
    return diag, full_end, end


@triton.jit
def _tile_key_range(q_len, k_len, m_start, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """_causal_key_range for the BLOCK_M rows at m_start (rows past q_len are never stored)."""
    return _causal_key_range(q_len, k_len, m_start, m_start + BLOCK_M, IS_CAUSAL, BLOCK_N)


@triton.jit
def _store_lse(LSE, l_i, m_i, l_safe, seq64, head, q_start, offs_m, q_len, stride_lb, stride_lh, stride_lm):
    """The rows' natural-log lse (m is in the log2 domain of the scaled scores; ln 2 brings
    it back), -inf for a row that saw no key."""
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    tl.store(LSE + seq64 * stride_lb + q_start * stride_lm + head.to(tl.int64) * stride_lh
             + offs_m * stride_lm, lse, mask=offs_m < q_len)


@triton.jit
def _attn_fwd(
    Q, K, V, O, LSE,
    cu_seqlens_q, cu_seqlens_k,
    seqlen_q, seqlen_k,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_lb, stride_lh, stride_lm,
    num_q_heads, kv_group,
    qk_scale_log2,
    IS_VARLEN: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    LAZY_RESCALE: tl.constexpr = 0,
):
    seq, head, kv_head, pid_m, q_start, q_len, k_start, k_len = _program_rows(
        cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, num_q_heads, kv_group, IS_VARLEN)
    m_start = pid_m * BLOCK_M
    if m_start < q_len:
        offs_m = m_start + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)

        seq64 = seq.to(tl.int64)
        q_base, k_base, v_base, o_base = _head_bases(Q, K, V, O, seq64, head, kv_head, q_start, k_start,
                                                     stride_qb, stride_qh, stride_qm, stride_kb, stride_kh,
                                                     stride_kn, stride_vb, stride_vh, stride_vn, stride_ob,
                                                     stride_oh, stride_om)

        row_ok = offs_m[:, None] < q_len
        q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=row_ok, other=0.0)

        k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

        diag, full_end, end = _tile_key_range(q_len, k_len, m_start, IS_CAUSAL, BLOCK_M, BLOCK_N)

        # Tiles every row sees completely: no masks, no bounds checks.
        for start_n in range(0, full_end, BLOCK_N):
            k = tl.load(k_ptrs + start_n * stride_kn)
            v = tl.load(v_ptrs + start_n * stride_vn)
            if LAZY_RESCALE > 0:
                acc, l_i, m_i = _softmax_step_lazy(acc, l_i, m_i, q, k, v, qk_scale_log2, DOT_PRECISION,
                                                   LAZY_RESCALE)
            else:
                acc, l_i, m_i = _softmax_step(acc, l_i, m_i, q, k, v, qk_scale_log2, DOT_PRECISION)

        # Diagonal band and the ragged last tile: per-element masks; a row may see
        # nothing in a tile (or at all).
        for start_n in range(full_end, end, BLOCK_N):
            cols = start_n + offs_n
            col_ok = cols < k_len
            k = tl.load(k_ptrs + start_n * stride_kn, mask=col_ok[:, None], other=0.0)
            v = tl.load(v_ptrs + start_n * stride_vn, mask=col_ok[:, None], other=0.0)
            visible = col_ok[None, :]
            if IS_CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + diag)
            acc, l_i, m_i = _softmax_step_masked(acc, l_i, m_i, q, k, v, visible, qk_scale_log2, DOT_PRECISION,
                                                 True)

        # Rows that saw no key have l == 0 and acc == 0: they store exact zeros.
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=row_ok)
        if RETURN_LSE:
            _store_lse(LSE, l_i, m_i, l_safe, seq64, head, q_start, offs_m, q_len, stride_lb, stride_lh, stride_lm)


# ------------------------------------------------------------------ launch arguments
# _attn_fwd's runtime arguments (the prefill_tma variants take the same ones), built in one
# place for the pointer launcher (ops.py) and the TMA launchers (prefill_tma.py).

_LOG2E = 1.4426950408889634


def dense_args(q, k, v, out, lse, scale: float) -> tuple:
    """Dense q / out [B, Hq, Nq, D], k / v [B, Hkv, Nk, D], lse [B, Hq, Nq] float32 or None."""
    lse_arg, lse_strides = (lse, lse.stride()) if lse is not None else (out, (0, 0, 0))
    return (
        q, k, v, out, lse_arg,
        q, q,  # cu_seqlens unused in dense mode
        q.shape[2], k.shape[2],
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        *lse_strides,
        q.shape[1], q.shape[1] // k.shape[1],
        float(scale) * _LOG2E,
    )


def varlen_args(q, k, v, out, lse, cu_q, cu_k, scale: float) -> tuple:
    """Packed q / out [Tq, Hq, D], k / v [Tk, Hkv, D], lse [Tq, Hq] float32 or None, int32
    cu_q / cu_k [S + 1] on q's device. The seqlen_q / seqlen_k slots get 0: varlen programs read
    their lengths from cu_q / cu_k, and a fixed value keeps Triton from compiling another variant
    whenever a step's longest length changes its divisibility class."""
    lse_arg, lse_strides = (lse, (0, lse.stride(1), lse.stride(0))) if lse is not None else (out, (0, 0, 0))
    return (
        q, k, v, out, lse_arg,
        cu_q, cu_k,
        0, 0,
        0, q.stride(1), q.stride(0),
        0, k.stride(1), k.stride(0),
        0, v.stride(1), v.stride(0),
        0, out.stride(1), out.stride(0),
        *lse_strides,
        q.shape[1], q.shape[1] // k.shape[1],
        float(scale) * _LOG2E,
    )
