"""The `triton` backend ops (positional signatures of minipaged.registry).

Arguments arrive checked by minipaged.api; these wrappers only pick launch
configs, allocate outputs and launch. Nothing here syncs with the device, so
decode and write_kv_cache can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch
import triton
from triton.runtime.errors import OutOfResources

from ..registry import BackendOps
from . import configs, prefill_tma
from .cache import _write_kv_kernel
from .configs import (
    PagedConfig,
    PrefillConfig,
    decode_config,
    paged_config,
    paged_num_splits,
    prefill_config,
)
from .decode import _decode_kernel, _decode_reduce
from .launch import fast
from .merge import _merge_kernel
from .paged import _paged_kernel, _paged_long_kernel, _short_reduce, invariant_reduce
from .prefill import _attn_fwd, dense_args, varlen_args

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


def _smaller(cfg: PrefillConfig | PagedConfig, min_block_m: int = 32) -> PrefillConfig | PagedConfig | None:
    """The next tile to try after `cfg` ran out of shared memory or registers: one stage fewer,
    then half the keys, then half the rows (one warpgroup), then one stage; every other field
    (the tile kind, a register cap) kept."""
    if cfg.num_stages > 2:
        return replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.block_n > 32:
        return replace(cfg, block_n=cfg.block_n // 2)
    if cfg.block_m > min_block_m:
        return replace(cfg, block_m=cfg.block_m // 2, num_warps=4)
    if cfg.num_stages > 1:
        return replace(cfg, num_stages=1)
    return None


def _launch_attn(cfg: PrefillConfig, num_programs_bh: int, max_seqlen_q: int, args: tuple,
                 is_varlen: bool, causal: bool, head_dim: int, dtype: torch.dtype,
                 return_lse: bool) -> None:
    key = (cfg, head_dim, dtype, causal, is_varlen, return_lse)
    cfg = _prefill_fallback.get(key, cfg)
    while True:
        grid = (num_programs_bh, triton.cdiv(max_seqlen_q, cfg.block_m))
        try:
            fast(_attn_fwd)[grid](
                *args,
                IS_VARLEN=is_varlen,
                IS_CAUSAL=causal,
                HEAD_DIM=head_dim,
                BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n,
                DOT_PRECISION=_dot_precision(dtype),
                RETURN_LSE=return_lse,
                LAZY_RESCALE=configs.prefill_lazy_rescale(),
                **cfg.launch_options(),
            )
            return
        except OutOfResources:
            smaller = _smaller(cfg)
            if smaller is None:
                raise
            _prefill_fallback[key] = smaller
            cfg = smaller


def _lse_buffer(shape, device, return_lse: bool) -> torch.Tensor | None:
    return torch.empty(shape, dtype=torch.float32, device=device) if return_lse else None


def _result(out: torch.Tensor, lse: torch.Tensor | None):
    return out if lse is None else (out, lse)


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
            return_lse: bool = False):
    res = prefill_tma.try_prefill(q, k, v, causal, scale, return_lse)  # None: the pointer kernel runs
    if res is not None:
        return res
    batch, num_q_heads, seqlen_q, head_dim = q.shape
    out = torch.empty((batch, num_q_heads, seqlen_q, head_dim), dtype=q.dtype, device=q.device)
    lse = _lse_buffer((batch, num_q_heads, seqlen_q), q.device, return_lse)
    if out.numel() == 0:
        return _result(out, lse)
    cfg = prefill_config(head_dim, q.dtype, causal, batch * num_q_heads, seqlen_q, q.device, k.shape[2])
    args = dense_args(q, k, v, out, lse, scale)
    with _device_scope(q):
        _launch_attn(cfg, batch * num_q_heads, seqlen_q, args, False, bool(causal), head_dim, q.dtype,
                     lse is not None)
    return _result(out, lse)


def prefill_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                   max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float,
                   return_lse: bool = False):
    res = prefill_tma.try_prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                         scale, return_lse)
    if res is not None:
        return res
    total_q, num_q_heads, head_dim = q.shape
    num_seqs = cu_seqlens_q.shape[0] - 1
    out = torch.empty((total_q, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    lse = _lse_buffer((total_q, num_q_heads), q.device, return_lse)
    if out.numel() == 0 or num_seqs <= 0 or int(max_seqlen_q) <= 0:
        if lse is not None:
            lse.fill_(float("-inf"))
        return _result(out.zero_(), lse)
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32).contiguous()
    cfg = prefill_config(head_dim, q.dtype, causal, num_seqs * num_q_heads, int(max_seqlen_q), q.device,
                         int(max_seqlen_k))
    args = varlen_args(q, k, v, out, lse, cu_q, cu_k, scale)
    with _device_scope(q):
        _launch_attn(cfg, num_seqs * num_q_heads, int(max_seqlen_q), args, True, bool(causal),
                     head_dim, q.dtype, lse is not None)
    return _result(out, lse)


# (device, dtype, shapes, env overrides) -> (config, num_splits, BLOCK_H): decode is
# latency-bound at small batch, so the per-call host work is kept to a dict lookup
_decode_plans: dict = {}


def _decode_plan(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor):
    key = (q.device, q.dtype, k_cache.dtype, *q.shape, *k_cache.shape[1:3], block_tables.shape[1],
           configs.overrides_version, configs.interpreting())
    plan = _decode_plans.get(key)
    if plan is None:
        batch, num_q_heads, head_dim = q.shape
        page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        cfg = decode_config(head_dim, q.dtype, q.device, k_cache.dtype == torch.float8_e4m3fn,
                            batch * num_kv_heads)
        capacity = block_tables.shape[1] * page_size
        worklist, num_splits = configs.decode_split_plan(batch, num_kv_heads, capacity, cfg.block_n, q.device)
        block_h = max(16, triton.next_power_of_2(num_q_heads // num_kv_heads))
        plan = _decode_plans[key] = (cfg, num_splits, block_h, worklist)
    return plan


def _kv_scales(k_cache: torch.Tensor, k_scale, v_scale, dummy: torch.Tensor):
    """(fp8?, K scale, V scale) kernel arguments: float32 [Hkv] scales for an fp8
    cache (api.py made them so), a never-read placeholder otherwise."""
    if k_cache.dtype == torch.float8_e4m3fn:
        # the kernels index the scales as dense [Hkv] (an expanded scalar has stride 0)
        return True, k_scale.contiguous(), v_scale.contiguous()
    return False, dummy, dummy


def _paged_strides(q, k_cache, v_cache, block_tables, out) -> tuple[int, ...]:
    """The stride arguments _decode_kernel and _paged_kernel share, in their order: q's row and
    head strides, each cache's block / token / head strides, the table's row stride and o's
    row and head strides."""
    qs, ks, vs, os_ = q.stride(), k_cache.stride(), v_cache.stride(), out.stride()
    return (qs[0], qs[1], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], block_tables.stride(0), os_[0], os_[1])


def _split_partials(rows: int, head_dim: int, out: torch.Tensor, split: bool):
    """(o_partial [rows * head_dim], lse_partial [rows]) float32, one allocation, for a
    split-KV launch; unsplit launches pass `out` for both (never read)."""
    if not split:
        return out, out
    work = torch.empty(rows * (head_dim + 1), dtype=torch.float32, device=out.device)
    return work[: rows * head_dim], work[rows * head_dim:]


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
           return_lse: bool = False, k_scale: torch.Tensor | None = None,
           v_scale: torch.Tensor | None = None):
    batch, num_q_heads, head_dim = q.shape
    out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    lse = _lse_buffer((batch, num_q_heads), q.device, return_lse)
    if out.numel() == 0:
        return _result(out, lse)
    cfg, num_splits, block_h, worklist = _decode_plan(q, k_cache, block_tables)
    lse_arg, lse_strides = (lse, lse.stride()) if lse is not None else (out, (0, 0))
    fp8, k_s, v_s = _kv_scales(k_cache, k_scale, v_scale, out)
    with _device_scope(q):
        _decode_launches(batch, num_splits, worklist, block_h, cfg, q, k_cache, v_cache, block_tables, context_lens,
                         out, lse_arg, lse_strides, k_s, v_s, fp8, scale, lse is not None)
    return _result(out, lse)


def _decode_launches(num_rows: int, num_splits: int, worklist: bool, block_h: int, cfg, q, k_cache, v_cache,
                     block_tables, context_lens, out, lse_arg, lse_strides, k_s, v_s, fp8: bool, scale: float,
                     return_lse: bool, cu_seqlens_q=None) -> None:
    """The decode kernel over num_rows sequences and, when it splits, its reduce: num_splits
    per sequence (the plain plan), or (worklist) a work list of num_rows + num_splits slots per
    KV head, num_splits its budget (decode.py, WORKLIST). cu_seqlens_q: as _launch_decode_kernel."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    split = worklist or num_splits > 1
    # partials [B, Hq, S, D] outputs, then [B, Hq, S] LSEs; a work list's by slot, [Hq, B + S, D], [Hq, B + S]
    rows = num_q_heads * (num_rows + num_splits if worklist else num_rows * num_splits)
    o_partial, lse_partial = _split_partials(rows, head_dim, out, split)
    _launch_decode_kernel(num_rows, num_splits, block_h, cfg, q, k_cache, v_cache, block_tables, context_lens,
                          out, lse_arg, lse_strides, o_partial, lse_partial, k_s, v_s, fp8, scale, return_lse,
                          cu_seqlens_q, worklist)
    if split:
        _reduce_splits(o_partial, lse_partial, out, lse_arg, lse_strides, num_rows, num_q_heads, num_splits,
                       head_dim, return_lse, cu_seqlens_q=cu_seqlens_q,
                       context_lens=context_lens if worklist else None, block_n=cfg.block_n)


# (launch inputs) -> (grid, constexprs and options) of a decode-kernel launch: decode calls are
# host-bound at small batch, so these are worked out once per shape
_decode_launch_kwargs: dict = {}


def _launch_decode_kernel(num_rows: int, num_splits: int, block_h: int, cfg, q, k_cache, v_cache, block_tables,
                          context_lens, out, lse_arg, lse_strides, o_partial, lse_partial, k_s, v_s, fp8: bool,
                          scale: float, return_lse: bool, cu_seqlens_q=None, worklist: bool = False) -> None:
    """_decode_kernel over num_rows sequences x KV heads x num_splits, BLOCK_H query heads
    per program and cfg's key tile; worklist: over num_rows + num_splits slots x KV heads.
    cu_seqlens_q: the packed decode rows of a paged call (PACKED_Q: q, out and lse are
    [Tq, ...] and programs of other q_lens return at once)."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    packed = cu_seqlens_q is not None
    words = _fp8_words(fp8, q, k_cache, v_cache) if fp8 else 0
    key = (num_rows, num_splits, block_h, cfg, num_kv_heads, head_dim, page, q.dtype, q.device, return_lse, fp8,
           words, packed, worklist, configs.overrides_version)
    launch = _decode_launch_kwargs.get(key)
    if launch is None:
        grid = (num_rows + num_splits, num_kv_heads, 1) if worklist else (num_rows, num_kv_heads, num_splits)
        launch = _decode_launch_kwargs[key] = (grid, dict(
            HEAD_DIM=head_dim,
            BLOCK_H=block_h,
            BLOCK_N=cfg.block_n,
            PAGE=page,
            SPLIT=num_splits > 1,
            DOT_PRECISION=_dot_precision(q.dtype),
            RETURN_LSE=return_lse,
            KV_FP8=fp8,
            FP8_F16=_fp8_f16(fp8, q),
            FP8_WORDS=words,
            HW_CVT=bool(words) and configs.e4m3_cvt(q.device),  # asked only where it matters (a host lookup)
            TABLE_AHEAD=configs.decode_table_ahead(cfg),
            **(dict(PACKED_Q=True) if packed else {}),
            **(dict(WORKLIST=True, BLOCK_B=triton.next_power_of_2(num_rows)) if worklist else {}),
            **cfg.launch_options(),
        ))
    grid, kwargs = launch
    if packed:
        kwargs = dict(kwargs, cu_seqlens_q=cu_seqlens_q)
    fast(_decode_kernel)[grid](
        q, k_cache, v_cache, block_tables, context_lens,
        out, lse_arg, o_partial, lse_partial, k_s, v_s,
        *_paged_strides(q, k_cache, v_cache, block_tables, out),
        *lse_strides,
        num_q_heads // num_kv_heads, num_splits,
        float(scale) * _LOG2E,
        **kwargs,
    )


def _fp8_f16(fp8: bool, q: torch.Tensor) -> bool:
    """The decode kernel's fp16 dots on fp8 caches (configs.decode_fp8_f16), for 16-bit q."""
    return fp8 and q.dtype != torch.float32 and configs.decode_fp8_f16()


def _fp8_words(fp8: bool, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """With the fp16 dots, the fp8 tiles read as int32 words (configs.decode_fp8_words, its mode
    1 or 2; 0: not): every cache stride and base 4-byte aligned, so a row's bytes are whole words."""
    mode = configs.decode_fp8_words() if _fp8_f16(fp8, q) else 0
    if mode and all(t.data_ptr() % 4 == 0 and all(st % 4 == 0 for st in t.stride()[:-1]) for t in (k_cache, v_cache)):
        return mode
    return 0


def _reduce_splits(o_partial, lse_partial, out, lse_arg, lse_strides, rows: int, num_q_heads: int,
                   num_splits: int, head_dim: int, return_lse: bool, cu_seqlens_q=None, context_lens=None,
                   block_n: int = 1) -> None:
    """Merges the split-KV partials of `rows` rows (sequences) into out / lse. cu_seqlens_q:
    the partials are per sequence and out is packed by token (paged decode rows). context_lens:
    a work list's partials (the decode launch's budget num_splits, so rows + num_splits slots,
    and its key tile block_n), merged in chunks of up to 16 splits."""
    extra = {} if cu_seqlens_q is None else {"cu_seqlens_q": cu_seqlens_q, "PACKED_Q": True}
    chunk = triton.next_power_of_2(num_splits)
    if cu_seqlens_q is not None and not configs.interpreting():
        # a mixed step's split count follows its batch: at least 16 lanes (masked) keeps the
        # variants compiled mid-serving to a few (the interpreter compiles nothing and pays per lane)
        chunk = max(chunk, 16)
    if context_lens is not None:
        extra.update(context_lens=context_lens, WORKLIST=True, BLOCK_B=triton.next_power_of_2(rows), BLOCK_N=block_n)
        chunk = min(chunk, _WORKLIST_MERGE_CHUNK)
    fast(_decode_reduce)[(rows, num_q_heads)](
        o_partial, lse_partial, out, lse_arg,
        out.stride(0), out.stride(1),
        *lse_strides,
        num_q_heads, num_splits,
        HEAD_DIM=head_dim,
        SPLITS_POW2=chunk,
        RETURN_LSE=return_lse,
        **extra,
        num_warps=4,
    )


# splits a work-list merge folds per step: a long sequence may take a hundred of them
_WORKLIST_MERGE_CHUNK = 16


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    page_size = k_cache.shape[1]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8:
        # the kernel writes the e4m3 bytes it computes itself (cache.py says why)
        k_dst, v_dst = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        k_s, v_s = k_scale.contiguous(), v_scale.contiguous()
    else:
        k_dst, v_dst = k_cache, v_cache
        k_s = v_s = slot_mapping  # unused
    with _device_scope(k):
        fast(_write_kv_kernel)[(num_tokens,)](
            k, v, k_dst, v_dst, slot_mapping, k_s, v_s,
            k.stride(0), k.stride(1),
            v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            num_kv_heads,
            PAGE=page_size,
            HEAD_DIM=head_dim,
            HEADS_POW2=triton.next_power_of_2(num_kv_heads),
            KV_FP8=fp8,
            num_warps=4,
        )


# how the paged kernel reads block ids when a KV tile spans pages (paged.py
# _tile_blocks): 0 one per key, 1 one per page, 2 one per page loaded a tile ahead;
# None: 2 for prefill-like tiles, 1 for decode-like ones. H200 (bf16, D 128, page 16,
# `_tune paged sweep`): loading a tile ahead took long chunks over a cached prefix
# from ~280 to ~370 TFLOP/s; for decode-like tiles the three were within noise.
# A module attribute so tuning runs can compare them.
PAGED_GATHER: int | None = None

# (cfg, head_dim, q dtype, cache dtype, causal, page, lse) that ran out of shared memory -> smaller config
_paged_fallback: dict = {}


_paged_plans: dict = {}
# The batch-invariant paged launch and its segment reduction fold segments with the same
# function (softmax._merge_segment); without FMA contraction each multiply and add rounds
# on its own in both kernels, so their bits agree whatever the compiler would fuse in each.
_INVARIANT_FP = {"enable_fp_fusion": False}


@dataclass(frozen=True)
class _PagedLaunch:
    """One kernel launch of a paged call (see configs: paged long chunks and mixed batches)."""

    kernel: str          # "v1" (paged._paged_kernel), "v2" (paged._paged_long_kernel), "gluon"
    #                      (prefill_gluon._paged_fwd_gluon, sm_90 long chunks) or "decode"
    cfg: PagedConfig     # "decode": block_m is the kernel's BLOCK_H, the rest its DecodeConfig
    min_q: int = 0       # sequences of at most min_q tokens are another launch's (0: none)
    max_q: int = 0       # sequences of more than max_q tokens are another launch's (0: none)


def _v2_usable(q, k_cache, v_cache, block_tables, num_seqs: int) -> bool:
    # v2 bakes the contiguous cache layout in (STRIDE_TOK = Hkv * D, head stride D, K and V
    # alike) and finds sequences among at most PAGED_SEARCH^2
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    want = (k_cache.shape[1] * hkv * d, hkv * d, d, 1)
    return (k_cache.stride() == want and v_cache.stride() == want
            and num_seqs <= configs.PAGED_SEARCH ** 2)


def _gluon_paged_usable(q, k_cache, v_cache, max_seqlen_q: int) -> bool:
    if q.shape[-1] not in configs.GLUON_HEAD_DIMS or max_seqlen_q < configs.GLUON_PAGED_MIN_Q:
        return False
    if configs.interpreting() or "paged_long_kernel" in configs.OVERRIDES:
        return False
    from . import prefill_gluon

    return prefill_gluon.paged_usable(q, k_cache, v_cache)


def _paged_launches(head_dim: int, dtype: torch.dtype, causal: bool, total_q: int, num_seqs: int,
                    max_seqlen_q: int, group: int, device: torch.device, v2_ok: bool,
                    config: PagedConfig | None, kv_fp8: bool = False,
                    gluon_ok: bool = False) -> tuple[_PagedLaunch, ...]:
    cfg = config or paged_config(head_dim, dtype, causal, max_seqlen_q, group, device, kv_fp8)
    if cfg.packed:
        # every query run fits one packed tile (decode, speculative verification); a forced tile
        # (config) stays on v1
        packed_v2 = config is None and v2_ok and configs.paged_packed_kernel() == "v2"
        return (_PagedLaunch("v2" if packed_v2 else "v1", cfg),)
    if gluon_ok:  # paged() rules out a forced tile or split and FP8 pages
        kernel = "gluon"
    else:
        kernel = configs.paged_long_kernel() if v2_ok else "v1"
    if configs.paged_mixed_mode() == "split":
        short = configs.paged_short_config(head_dim, dtype, group, device)
        short_q = short.block_q(group)
        # a sequence of <= short_q tokens leaves at most (num_seqs - 1) * max_seqlen_q for the rest
        if 0 < short_q < max_seqlen_q and total_q <= short_q + (num_seqs - 1) * max_seqlen_q:
            return (_PagedLaunch(kernel, cfg, min_q=short_q), _PagedLaunch("v1", short, max_q=short_q))
    if configs.paged_mixed_mode() == "decode":
        # q_len 1 rows through the decode kernel (packed-query mode), the rest through the long
        # launch; a q_len 1 sequence leaves at most (num_seqs - 1) * max_seqlen_q for the rest
        if 1 < max_seqlen_q and total_q <= 1 + (num_seqs - 1) * max_seqlen_q:
            dec = decode_config(head_dim, dtype, device)
            block_h = max(16, triton.next_power_of_2(group))
            dcfg = PagedConfig(block_h, dec.block_n, dec.num_warps, dec.num_stages, True)
            return (_PagedLaunch(kernel, cfg, min_q=1), _PagedLaunch("decode", dcfg, max_q=1))
    return (_PagedLaunch(kernel, cfg),)


def paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
          cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, max_seqlen_q: int, causal: bool,
          scale: float, return_lse: bool = False, k_scale: torch.Tensor | None = None,
          v_scale: torch.Tensor | None = None, *, num_splits: int | None = None,
          config: PagedConfig | None = None, batch_invariant: bool = False):
    """Paged attention for packed new tokens of any lengths (see paged.py).

    Batches of short query runs are one packed launch; a batch with a long chunk runs the
    long-chunk kernel, plus (mixed mode "split") a packed launch for its short sequences or
    ("decode") a decode-kernel launch for its q_len 1 sequences (configs: paged long chunks
    and mixed batches). num_splits / config (keyword only, for tests and tuning) force the
    split count of every launch and the tile (a packed config: one v1 launch for
    everything); by default both come from shapes, so nothing syncs.
    batch_invariant (keyword only): one v1 launch of the batch-invariant path (the pinned
    tile of configs.invariant_paged_config, keys in fixed segments, every tile masked; see
    paged._invariant_tile), split over segments when the batch leaves the GPU idle (the bits
    are the same either way), so a row's bits depend on its query and its keys only.
    """
    total_q, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    num_seqs = cu_seqlens_q.shape[0] - 1
    max_seqlen_q = int(max_seqlen_q)
    if batch_invariant:
        config = configs.invariant_paged_config(head_dim, group, q.device)
        num_splits = configs.invariant_paged_splits(num_seqs, total_q, max_seqlen_q, num_q_heads, num_kv_heads,
                                                    head_dim, block_tables.shape[1] * page_size, config, q.device)
    out = torch.empty((total_q, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    lse = _lse_buffer((total_q, num_q_heads), q.device, return_lse)
    if out.numel() == 0 or num_seqs <= 0 or max_seqlen_q <= 0:
        if lse is not None:
            lse.fill_(float("-inf"))
        return _result(out.zero_(), lse)
    # Launches depend on shapes only; cached so that a step of short queries pays a dict
    # lookup, not the heuristics (decode-sized kernels are host-bound).
    # up to 32 (position, head) rows a batch always gets a packed tile: skip the layout check
    # unless packed tiles may run v2
    v2_ok = ((config is not None or max_seqlen_q * group > 32 or configs.paged_packed_kernel() == "v2")
             and _v2_usable(q, k_cache, v_cache, block_tables, num_seqs))
    fp8, k_s, v_s = _kv_scales(k_cache, k_scale, v_scale, out)
    gluon_ok = (v2_ok and config is None and num_splits is None and not fp8
                and _gluon_paged_usable(q, k_cache, v_cache, max_seqlen_q))
    plan_key = (q.device, q.dtype, fp8, total_q, num_q_heads, head_dim, page_size, num_kv_heads, num_seqs,
                max_seqlen_q, block_tables.shape[1], bool(causal), v2_ok, gluon_ok, configs.overrides_version,
                configs.interpreting())
    plan = None if config is not None else _paged_plans.get(plan_key)
    if plan is None:
        plan = _paged_launches(head_dim, q.dtype, bool(causal), total_q, num_seqs, max_seqlen_q, group,
                               q.device, v2_ok, config, fp8, gluon_ok)
        if config is None:
            _paged_plans[plan_key] = plan
    lse_arg, lse_strides = (lse, lse.stride()) if lse is not None else (out, (0, 0))
    with _device_scope(q):
        # the long launch first: a split long launch reduces over every row, and the short
        # (or decode) launch then overwrites its sequences' rows
        for launch in plan:
            _paged_launch(launch, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
                          lse, lse_arg, lse_strides, k_s, v_s, fp8, max_seqlen_q, bool(causal), scale,
                          num_splits, len(plan) > 1, batch_invariant)
    return _result(out, lse)


def _paged_launch(launch: _PagedLaunch, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                  out, lse, lse_arg, lse_strides, k_s, v_s, fp8: bool, max_seqlen_q: int, causal: bool,
                  scale: float, num_splits: int | None, shared: bool, batch_invariant: bool = False) -> None:
    if launch.kernel == "decode":
        _paged_decode_launch(launch, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
                             lse_arg, lse_strides, lse is not None, k_s, v_s, fp8, scale, num_splits)
        return
    if launch.kernel == "gluon":
        # no split-KV: a long chunk's 128-row blocks of every head fill the GPU on their own
        from . import prefill_gluon

        prefill_gluon.launch_paged(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, lse_arg,
                                   lse_strides, lse is not None, max_seqlen_q, launch.min_q, causal,
                                   float(scale) * _LOG2E, configs.PAGED_SEARCH)
        return
    total_q, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    num_seqs = cu_seqlens_q.shape[0] - 1
    fb_key = (launch, head_dim, q.dtype, k_cache.dtype, causal, page_size, lse is not None)
    # the invariant tile never shrinks: a smaller one would give other bits
    cfg = launch.cfg if batch_invariant else _paged_fallback.get(fb_key, launch.cfg)
    # the longest run this launch serves: it sizes the grid and the split count
    run_q = min(max_seqlen_q, launch.max_q) if launch.max_q else max_seqlen_q
    while True:
        block_q = cfg.block_q(group)
        splits = num_splits or paged_num_splits(
            num_seqs, min(total_q, num_seqs * run_q), run_q, num_kv_heads, block_tables.shape[1] * page_size,
            cfg, group, q.device)
        split = splits > 1
        o_partial, lse_partial = _split_partials(total_q * num_q_heads * splits, head_dim, out, split)
        try:
            if launch.kernel == "v2":
                direct_tiles = num_seqs * triton.cdiv(run_q, block_q)
                compact_tiles = total_q // block_q + num_seqs
                direct = direct_tiles <= compact_tiles
                slots = direct_tiles if direct else compact_tiles
                heads_fastest = configs.paged_heads_fastest()
                grid = (slots * num_kv_heads, 1, splits) if heads_fastest else (slots, num_kv_heads, splits)
                fast(_paged_long_kernel)[grid](
                    q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                    out, lse_arg, o_partial, lse_partial, k_s, v_s,
                    q.stride(0), q.stride(1),
                    block_tables.stride(0),
                    out.stride(0), out.stride(1),
                    *lse_strides,
                    num_seqs, num_q_heads, group, splits,
                    float(scale) * _LOG2E,
                    HEAD_DIM=head_dim,
                    BLOCK_M=cfg.block_m,
                    BLOCK_Q=block_q,
                    BLOCK_N=cfg.block_n,
                    PAGE=page_size,
                    STRIDE_TOK=num_kv_heads * head_dim,
                    IS_CAUSAL=causal,
                    SPLIT=split,
                    RETURN_LSE=lse is not None,
                    DOT_PRECISION=_dot_precision(q.dtype),
                    KV_FP8=fp8,
                    DIRECT=direct,
                    SEARCH=configs.PAGED_SEARCH,
                    MIN_Q=launch.min_q,
                    PREFETCH=configs.paged_prefetch(),
                    HEADS_FASTEST=heads_fastest,
                    FP8_F16=fp8 and configs.paged_fp8_f16(q.dtype),
                    **cfg.launch_options(),
                )
            else:
                tiles = num_seqs * triton.cdiv(run_q, block_q)
                # the invariant launch also carries prefill chunks: longest tiles first over all heads
                grid = (tiles * num_kv_heads, 1, splits) if batch_invariant else (tiles, num_kv_heads, splits)
                fast(_paged_kernel)[grid](
                    q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                    out, lse_arg, o_partial, lse_partial, k_s, v_s,
                    *_paged_strides(q, k_cache, v_cache, block_tables, out),
                    *lse_strides,
                    num_seqs, num_q_heads, group, splits,
                    float(scale) * _LOG2E,
                    HEAD_DIM=head_dim,
                    BLOCK_M=cfg.block_m,
                    BLOCK_Q=block_q,
                    BLOCK_N=cfg.block_n,
                    PAGE=page_size,
                    IS_CAUSAL=causal,
                    SPLIT=split,
                    RETURN_LSE=lse is not None,
                    GATHER=PAGED_GATHER if PAGED_GATHER is not None else (1 if cfg.packed else 2),
                    DOT_PRECISION=_dot_precision(q.dtype),
                    KV_FP8=fp8,
                    MIN_Q=launch.min_q,
                    MAX_Q=launch.max_q,
                    INVARIANT_SEGMENT=configs.invariant_segment_tiles(q.device) if batch_invariant else 0,
                    HEADS_FASTEST=batch_invariant,
                    **cfg.launch_options(),
                    **_INVARIANT_FP if batch_invariant else {},
                )
            break
        except OutOfResources:
            smaller = None if batch_invariant else _smaller(cfg, max(32, triton.next_power_of_2(group)))
            if smaller is None:
                raise
            _paged_fallback[fb_key] = cfg = smaller
    if not split:
        return
    if batch_invariant:
        rows = total_q * num_q_heads
        fast(invariant_reduce)[(triton.cdiv(rows, 16),)](
            o_partial, lse_partial, out, lse_arg,
            rows, num_q_heads, splits,
            out.stride(0), out.stride(1),
            *lse_strides,
            HEAD_DIM=head_dim,
            BLOCK_R=16,
            RETURN_LSE=lse is not None,
            num_warps=4,
            **_INVARIANT_FP,
        )
    elif launch.max_q:
        # only this launch's (short) sequences: the long launch owns the other rows
        fast(_short_reduce)[(num_seqs, num_q_heads)](
            o_partial, lse_partial, out, lse_arg, cu_seqlens_q,
            out.stride(0), out.stride(1),
            *lse_strides,
            num_q_heads, splits,
            HEAD_DIM=head_dim,
            SPLITS_POW2=triton.next_power_of_2(splits),
            MAX_Q=launch.max_q,
            RETURN_LSE=lse is not None,
            num_warps=4,
        )
    else:
        # every row (a following short launch rewrites its own)
        _reduce_splits(o_partial, lse_partial, out, lse_arg, lse_strides, total_q, num_q_heads,
                       splits, head_dim, lse is not None)


def _paged_decode_launch(launch: _PagedLaunch, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                         out, lse_arg, lse_strides, return_lse: bool, k_s, v_s, fp8: bool, scale: float,
                         num_splits: int | None) -> None:
    """The q_len 1 sequences of a paged call through the decode kernel (mixed mode "decode"):
    one program column per sequence of the call; those of other lengths return at once (the
    kernel's PACKED_Q). Runs after the long launch, whose split reduce writes every row."""
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = cu_seqlens_q.shape[0] - 1
    cfg = launch.cfg
    # a forced split count keeps the plain plan (tests and tuning); from shapes, every sequence
    # counts as a decode (an upper bound of the decodes)
    worklist, splits = (False, num_splits) if num_splits else configs.decode_split_plan(
        num_seqs, num_kv_heads, block_tables.shape[1] * page_size, cfg.block_n, q.device)
    # partials indexed by sequence (by slot under a work list); out and lse by packed token
    _decode_launches(num_seqs, splits, worklist, cfg.block_m, cfg, q, k_cache, v_cache, block_tables, context_lens,
                     out, lse_arg, lse_strides, k_s, v_s, fp8, scale, return_lse, cu_seqlens_q)


def merge_attention_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                           lse_b: torch.Tensor):
    o_a, lse_a, o_b, lse_b = (t.contiguous() for t in (o_a, lse_a, o_b, lse_b))
    out = torch.empty_like(o_a)
    lse = torch.empty(lse_a.shape, dtype=torch.float32, device=o_a.device)
    head_dim = o_a.shape[-1]
    num_rows = lse_a.numel()
    if num_rows == 0 or head_dim == 0:
        return out, lse.fill_(float("-inf"))
    block_d = triton.next_power_of_2(head_dim)
    block_r = max(1, min(64, 4096 // block_d))
    with _device_scope(o_a):
        fast(_merge_kernel)[(triton.cdiv(num_rows, block_r),)](
            o_a, lse_a, o_b, lse_b, out, lse,
            num_rows, head_dim,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out, lse


OPS = BackendOps(
    prefill=prefill,
    prefill_varlen=prefill_varlen,
    decode=decode,
    paged=paged,
    write_kv_cache=write_kv_cache,
    merge_attention_states=merge_attention_states,
)
