"""The online-softmax tile step every Triton attention kernel runs (prefill, decode, paged).

Scores live in the exp2 domain (log2(e) folded into `qk_scale_log2`). A step takes one K/V
tile already in registers; the kernels differ only in how they load it.
"""

import triton
import triton.language as tl


@triton.jit
def _q_to_fp16_range(q, qk_scale_log2):
    """q (a 16-bit tile) as fp16 times 2^-shift, the power of two that brings its largest
    magnitude into (8192, 16384] (exact, barring fp16 subnormals for elements 2^-24 of that
    maximum or smaller), and the score scale times 2^shift: the dots over FP8 K/V then run in
    fp16 whatever q's dtype (e4m3 -> fp16 is one cvt per pair, -> bf16 four)."""
    qf = q.to(tl.float32)
    amax = tl.maximum(tl.max(tl.max(tl.abs(qf), 1), 0), 1e-30)
    shift = tl.ceil(tl.math.log2(amax / 16384.0))
    return (qf * tl.math.exp2(-shift)).to(tl.float16), qk_scale_log2 * tl.math.exp2(shift)


@triton.jit
def _softmax_step(acc, l_i, m_i, q, k, v, qk_scale_log2, DOT_PRECISION: tl.constexpr):
    """A tile every row sees whole: no mask. Returns the updated (acc, l, m)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale_log2)
    p = tl.math.exp2(s * qk_scale_log2 - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _softmax_step_lazy(acc, l_i, m_i, q, k, v, qk_scale_log2, DOT_PRECISION: tl.constexpr,
                       THRESHOLD: tl.constexpr):
    """_softmax_step that rescales acc and l only when some row's running max grew by more than
    THRESHOLD (log2 units) in this tile, one decision for the whole tile. Otherwise every row
    keeps its old max as the reference: its p are at most 2^THRESHOLD, exact enough in fp32
    and in range for a 16-bit P, and the final acc / l is unchanged in value. Saves the
    [BLOCK_M, D] rescale multiply on most tiles of a long row, whose max settles early."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale_log2)
    if tl.max(m_new - m_i, 0) > THRESHOLD:
        alpha = tl.math.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_new
    p = tl.math.exp2(s * qk_scale_log2 - m_i[:, None])
    l_i = l_i + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _softmax_step_masked(acc, l_i, m_i, q, k, v, visible, qk_scale_log2, DOT_PRECISION: tl.constexpr,
                         ROWS_MAY_BE_EMPTY: tl.constexpr):
    """A tile with a [rows, keys] `visible` mask. ROWS_MAY_BE_EMPTY: a row may see no key here
    (or at all), so its running max can stay -inf; subtracting 0 instead keeps exp2 away from
    (-inf) - (-inf)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if ROWS_MAY_BE_EMPTY:
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    p = tl.math.exp2(s - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _merge_splits(O_partial, LSE_partial, row0, num_splits, offs_d, HEAD_DIM: tl.constexpr,
                  SPLITS_POW2: tl.constexpr):
    """Merges the num_splits split-KV partials of one (row, head), at rows row0.. of
    O_partial [*, HEAD_DIM] and LSE_partial [*] (base-2 LSEs, -inf for a split that saw no
    key). -> (out [HEAD_DIM] fp32, the weights' reference m_sub and sum total: _split_lse)."""
    offs_s = tl.arange(0, SPLITS_POW2)
    split_ok = offs_s < num_splits
    lse = tl.load(LSE_partial + row0 + offs_s, mask=split_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m_sub = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m_sub)
    parts = tl.load(O_partial + (row0 + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
                    mask=split_ok[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    return out, m_sub, total


@triton.jit
def _merge_split_run(O_partial, LSE_partial, row0, num_splits, offs_d, HEAD_DIM: tl.constexpr,
                     CHUNK: tl.constexpr):
    """_merge_splits for any number of splits: rows row0 .. row0 + num_splits - 1 folded CHUNK
    at a time into a running (acc, total, m), rescaled as the maximum grows. -> (out [HEAD_DIM]
    fp32, m_sub, total) with _merge_splits' meaning."""
    offs_s = tl.arange(0, CHUNK)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    total = tl.zeros([], dtype=tl.float32)
    m = tl.full([], float("-inf"), dtype=tl.float32)
    for s0 in range(0, num_splits, CHUNK):
        split_ok = s0 + offs_s < num_splits
        lse = tl.load(LSE_partial + row0 + s0 + offs_s, mask=split_ok, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_sub)
        w = tl.math.exp2(lse - m_sub)
        parts = tl.load(O_partial + (row0 + s0 + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
                        mask=split_ok[:, None], other=0.0)
        acc = acc * alpha + tl.sum(parts * w[:, None], 0)
        total = total * alpha + tl.sum(w, 0)
        m = m_new
    out = acc / tl.where(total == 0.0, 1.0, total)
    return out, tl.where(m == float("-inf"), 0.0, m), total


@triton.jit
def _split_lse(m_sub, total):
    """The natural-log lse of merged splits (_merge_splits): -inf when no split saw a key."""
    return tl.where(total == 0.0, float("-inf"),
                    (m_sub + tl.math.log2(tl.where(total == 0.0, 1.0, total))) * 0.6931471805599453)


@triton.jit
def _segment_result(acc, l_i, m_i):
    """A finished key segment of the batch-invariant path: its normalised output (fp32) and
    base-2 lse (-inf and zeros for rows that saw no key)."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    return acc / l_safe[:, None], tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))


@triton.jit
def _merge_segment(acc, total, m, part, lse2):
    """Folds one segment (part [rows, D], base-2 lse2 [rows]) into the running (acc, total, m).
    Both batch-invariant launches (split or not) fold with this one function in segment
    order, so they compute the same bits; a segment a row saw nothing of (lse2 -inf, part 0)
    leaves its state exactly as it was (alpha = 1, w = 0)."""
    m_new = tl.maximum(m, lse2)
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m - m_sub)
    w = tl.math.exp2(lse2 - m_sub)
    return acc * alpha[:, None] + part * w[:, None], total * alpha + w, m_new


@triton.jit
def _merged_result(acc, total, m):
    """(output fp32 [rows, D], natural-log lse [rows]) of the folded segments; rows that saw no
    key give zeros and -inf."""
    return acc / tl.where(total == 0.0, 1.0, total)[:, None], _split_lse(m, total)

