"""Merge two partial attentions over disjoint key sets of the same queries.

With lse = logaddexp(lse_a, lse_b), o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b.
Weights are taken relative to max(lse_a, lse_b) (0 when both are -inf), so no
exp of (-inf) - (-inf) is ever formed: a row with no key on either side gets
zero weights, zeros and -inf. A side with zero weight contributes exactly 0,
whatever its o holds. Math in fp32; the output has o_a's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _merge_kernel(
    O_a, LSE_a, O_b, LSE_b, O, LSE,
    num_rows, head_dim,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (offs_d[None, :] < head_dim)
    la = tl.load(LSE_a + rows, mask=row_ok, other=float("-inf")).to(tl.float32)
    lb = tl.load(LSE_b + rows, mask=row_ok, other=float("-inf")).to(tl.float32)
    m = tl.maximum(la, lb)
    m_sub = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m_sub)
    wb = tl.exp(lb - m_sub)
    total = wa + wb
    inv = 1.0 / tl.where(total == 0.0, 1.0, total)
    ptrs = rows[:, None] * head_dim + offs_d[None, :]
    oa = tl.load(O_a + ptrs, mask=mask, other=0.0).to(tl.float32)
    ob = tl.load(O_b + ptrs, mask=mask, other=0.0).to(tl.float32)
    ca = tl.where((wa == 0.0)[:, None], 0.0, oa * (wa * inv)[:, None])
    cb = tl.where((wb == 0.0)[:, None], 0.0, ob * (wb * inv)[:, None])
    tl.store(O + ptrs, (ca + cb).to(O.dtype.element_ty), mask=mask)
    lse = tl.where(total == 0.0, float("-inf"), m_sub + tl.log(tl.where(total == 0.0, 1.0, total)))
    tl.store(LSE + rows, lse, mask=row_ok)
