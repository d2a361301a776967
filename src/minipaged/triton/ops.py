"""The `triton` backend ops (positional signatures of minipaged.registry).

Arguments arrive checked by minipaged.api; these wrappers only pick launch
configs, allocate outputs and launch. Nothing here syncs with the device, so
decode and write_kv_cache can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
from triton.runtime.errors import OutOfResources

from .cache import _write_kv_kernel
from .configs import (
    PrefillConfig,
    decode_config,
    decode_num_splits,
    prefill_config,
)
from .decode import _decode_kernel, _decode_reduce
from .prefill import _attn_fwd

_LOG2E = 1.4426950408889634
# configs that failed to compile for lack of shared memory/registers -> the smaller one used instead
_prefill_fallback: dict = {}


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not silently drop to TF32 (10-bit mantissa) in tl.dot
    return "ieee" if dtype == torch.float32 else "tf32"


_NO_SCOPE = contextlib.nullcontext()


def _device_scope(t: torch.Tensor):
    # Triton launches on the current device; switching costs microseconds, so only when needed
    if t.is_cuda and t.device.index is not None and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NO_SCOPE


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _smaller(cfg: PrefillConfig) -> PrefillConfig | None:
    if cfg.num_stages > 2:
        return PrefillConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages - 1)
    if cfg.block_n > 32:
        return PrefillConfig(cfg.block_m, cfg.block_n // 2, cfg.num_warps, cfg.num_stages)
    if cfg.block_m > 32:
        return PrefillConfig(cfg.block_m // 2, cfg.block_n, 4, cfg.num_stages)
    if cfg.num_stages > 1:
        return PrefillConfig(cfg.block_m, cfg.block_n, cfg.num_warps, 1)
    return None


def _launch_attn(cfg: PrefillConfig, num_programs_bh: int, max_seqlen_q: int, args: tuple,
                 is_varlen: bool, causal: bool, head_dim: int, dtype: torch.dtype) -> None:
    key = (cfg, head_dim, dtype, causal, is_varlen)
    cfg = _prefill_fallback.get(key, cfg)
    while True:
        grid = (num_programs_bh, triton.cdiv(max_seqlen_q, cfg.block_m))
        try:
            _attn_fwd[grid](
                *args,
                IS_VARLEN=is_varlen,
                IS_CAUSAL=causal,
                HEAD_DIM=head_dim,
                BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n,
                DOT_PRECISION=_dot_precision(dtype),
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
            )
            return
        except OutOfResources:
            smaller = _smaller(cfg)
            if smaller is None:
                raise
            _prefill_fallback[key] = smaller
            cfg = smaller


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    batch, num_q_heads, seqlen_q, head_dim = q.shape
    num_kv_heads, seqlen_k = k.shape[1], k.shape[2]
    out = torch.empty((batch, num_q_heads, seqlen_q, head_dim), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    cfg = prefill_config(head_dim, q.dtype, causal, batch * num_q_heads, seqlen_q, q.device)
    args = (
        q, k, v, out,
        q, q,  # cu_seqlens unused in dense mode
        seqlen_q, seqlen_k,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        num_q_heads, num_q_heads // num_kv_heads,
        float(scale) * _LOG2E,
    )
    with _device_scope(q):
        _launch_attn(cfg, batch * num_q_heads, seqlen_q, args, False, bool(causal), head_dim, q.dtype)
    return out


def prefill_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                   max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float) -> torch.Tensor:
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    total_q, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_seqs = cu_seqlens_q.shape[0] - 1
    out = torch.empty((total_q, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if out.numel() == 0 or num_seqs <= 0 or int(max_seqlen_q) <= 0:
        return out.zero_()
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32).contiguous()
    cfg = prefill_config(head_dim, q.dtype, causal, num_seqs * num_q_heads, int(max_seqlen_q), q.device)
    args = (
        q, k, v, out,
        cu_q, cu_k,
        int(max_seqlen_q), int(max_seqlen_k),
        0, q.stride(1), q.stride(0),
        0, k.stride(1), k.stride(0),
        0, v.stride(1), v.stride(0),
        0, out.stride(1), out.stride(0),
        num_q_heads, num_q_heads // num_kv_heads,
        float(scale) * _LOG2E,
    )
    with _device_scope(q):
        _launch_attn(cfg, num_seqs * num_q_heads, int(max_seqlen_q), args, True, bool(causal),
                     head_dim, q.dtype)
    return out


# (device, dtype, shapes, env overrides) -> (config, num_splits, BLOCK_H): decode is
# latency-bound at small batch, so the per-call host work is kept to a dict lookup
_decode_plans: dict = {}


def _decode_plan(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor):
    key = (q.device, q.dtype, *q.shape, *k_cache.shape[1:3], block_tables.shape[1],
           os.environ.get("MINIPAGED_TRITON_DECODE_SPLITS"), os.environ.get("MINIPAGED_TRITON_DECODE_CONFIG"),
           os.environ.get("TRITON_INTERPRET"))
    plan = _decode_plans.get(key)
    if plan is None:
        batch, num_q_heads, head_dim = q.shape
        page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        cfg = decode_config(head_dim, q.dtype, q.device)
        capacity = block_tables.shape[1] * page_size
        num_splits = decode_num_splits(batch, num_kv_heads, capacity, cfg.block_n, q.device)
        block_h = max(16, triton.next_power_of_2(num_q_heads // num_kv_heads))
        plan = _decode_plans[key] = (cfg, num_splits, block_h)
    return plan


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        q, k_cache, v_cache = (_last_dim_contiguous(t) for t in (q, k_cache, v_cache))
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    if context_lens.stride(0) != 1:
        context_lens = context_lens.contiguous()
    cfg, num_splits, block_h = _decode_plan(q, k_cache, block_tables)
    split = num_splits > 1
    if split:
        # one allocation for both partials: [B, Hq, S, D] outputs, then [B, Hq, S] LSEs
        rows = batch * num_q_heads * num_splits
        work = torch.empty(rows * (head_dim + 1), dtype=torch.float32, device=q.device)
        o_partial = work[: rows * head_dim]
        lse_partial = work[rows * head_dim:]
    else:
        o_partial = lse_partial = out  # unused
    with _device_scope(q):
        _decode_kernel[(batch, num_kv_heads, num_splits)](
            q, k_cache, v_cache, block_tables, context_lens,
            out, o_partial, lse_partial,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0),
            out.stride(0), out.stride(1),
            group, num_splits,
            float(scale) * _LOG2E,
            HEAD_DIM=head_dim,
            BLOCK_H=block_h,
            BLOCK_N=cfg.block_n,
            PAGE=page_size,
            SPLIT=split,
            DOT_PRECISION=_dot_precision(q.dtype),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        if split:
            _decode_reduce[(batch, num_q_heads)](
                o_partial, lse_partial, out,
                out.stride(0), out.stride(1),
                num_q_heads, num_splits,
                HEAD_DIM=head_dim,
                SPLITS_POW2=triton.next_power_of_2(num_splits),
                num_warps=4,
            )
    return out


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("write_kv_cache: the caches must have a stride-1 last dim (written in place)")
    slot_mapping = slot_mapping.contiguous()
    page_size = k_cache.shape[1]
    with _device_scope(k):
        _write_kv_kernel[(num_tokens,)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k.stride(1),
            v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            num_kv_heads,
            PAGE=page_size,
            HEAD_DIM=head_dim,
            HEADS_POW2=triton.next_power_of_2(num_kv_heads),
            num_warps=4,
        )


__all__ = ["prefill", "prefill_varlen", "decode", "write_kv_cache"]
