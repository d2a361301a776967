"""Scatter new K/V tokens into the paged cache (one program per token)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    K, V, K_cache, V_cache, slot_mapping,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_kcblock, stride_kctok, stride_kchead,
    stride_vcblock, stride_vctok, stride_vchead,
    num_kv_heads,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_POW2: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + tok).to(tl.int64)
    # a negative slot (padding token) writes nothing; clamp keeps the address math sane
    offs_h = tl.arange(0, HEADS_POW2)
    offs_d = tl.arange(0, HEAD_DIM)
    # built as a tensor: the interpreter rejects a scalar bool in a mask expression
    keep = (offs_d[None, :] * 0 + slot) >= 0
    slot = tl.maximum(slot, 0)
    block = slot // PAGE
    offset = slot % PAGE
    mask = (offs_h[:, None] < num_kv_heads) & keep
    k = tl.load(K + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(K_cache + block * stride_kcblock + offset * stride_kctok
             + offs_h[:, None] * stride_kchead + offs_d[None, :],
             k.to(K_cache.dtype.element_ty), mask=mask)
    tl.store(V_cache + block * stride_vcblock + offset * stride_vctok
             + offs_h[:, None] * stride_vchead + offs_d[None, :],
             v.to(V_cache.dtype.element_ty), mask=mask)
