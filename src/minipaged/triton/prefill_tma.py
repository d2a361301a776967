"""Hopper (sm_90) variants of the Triton prefill: TMA loads through tensor descriptors,
optionally with the compiler's warp specialisation of the key loop (issue #16, item 4).

Same algorithm, masks and outputs as prefill._attn_fwd (read that docstring first); what
changes is how tiles move:

  * Q, K, V and O go through device-side tensor descriptors (`tl.make_tensor_descriptor`),
    which the sm_90 backend lowers to TMA (`cp.async.bulk.tensor`) with mbarrier waits. Each
    program builds its descriptors over *its own* sequence and head: shape [len, D], so TMA
    clips the ragged last tile at the sequence end (zero fill on load, dropped rows on
    store). Varlen needs no row masks on loads or the store, and a tile never reads into
    the next sequence.
  * WARP_SPECIALIZE puts `warp_specialize=True` on the key loops; on sm_90 Triton's Hopper
    warp-specialisation pass then splits them into a producer partition (TMA) and consumer
    partitions (wgmma + softmax).

Descriptors need 16-byte aligned bases and strides (`usable`); the launchers here are only
called when that holds, and the pointer kernel serves everything else. Device-side
descriptors live in a per-launch global scratch buffer that Triton asks an allocator for;
`ensure_allocator` installs one backed by torch's caching allocator if the caller has not
set their own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import fast
from .prefill import _head_bases, _program_rows, _store_lse, _tile_key_range, dense_args, varlen_args
from .softmax import _softmax_step, _softmax_step_masked

# Scratch for device-side descriptors, requested by Triton at launch time.


def _torch_alloc(size: int, alignment: int, stream):
    # the caching allocator returns 512-byte aligned blocks, more than TMA's 64-byte rule
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Install `_torch_alloc` as Triton's launch-time allocator unless one is already set.

    Triton keeps the allocator in a ContextVar, so "already set" is per thread/context: this
    is checked on every launch (one ContextVar read) and set at most once per context, never
    replacing an allocator the user installed."""
    try:
        from triton.runtime import _allocation
    except ImportError:  # pragma: no cover - every supported triton has it
        return
    current = _allocation._allocator.get()
    if isinstance(current, _allocation.NullAllocator):
        triton.set_allocator(_torch_alloc)


def _aligned(t: torch.Tensor) -> bool:
    if t.data_ptr() % 16 != 0 or t.stride(-1) != 1:
        return False
    return all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1])


def usable(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can address these tensors: 16-bit floats, 16-byte aligned base
    and every leading stride a multiple of 16 bytes (so every per-(sequence, head) base the
    kernel forms is aligned too), unit last stride."""
    return all(t.dtype in (torch.float16, torch.bfloat16) and _aligned(t) for t in tensors)


@triton.jit
def _attn_fwd_tma(
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
    WARP_SPECIALIZE: tl.constexpr,
):
    seq, head, kv_head, pid_m, q_start, q_len, k_start, k_len = _program_rows(
        cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, num_q_heads, kv_group, IS_VARLEN)
    m_start = pid_m * BLOCK_M
    if m_start < q_len:
        offs_m = m_start + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)

        seq64 = seq.to(tl.int64)
        q_base, k_base, v_base, o_base = _head_bases(Q, K, V, O, seq64, head, kv_head, q_start, k_start,
                                                     stride_qb, stride_qh, stride_qm, stride_kb, stride_kh,
                                                     stride_kn, stride_vb, stride_vh, stride_vn, stride_ob,
                                                     stride_oh, stride_om)

        # An empty key range gets a one-row shape (a zero extent is not a valid TMA box
        # bound); no tile of it is ever loaded, since the loops below run to k_len.
        k_rows = tl.maximum(k_len, 1)
        q_desc = tl.make_tensor_descriptor(q_base, shape=[q_len, HEAD_DIM], strides=[stride_qm, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        k_desc = tl.make_tensor_descriptor(k_base, shape=[k_rows, HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        v_desc = tl.make_tensor_descriptor(v_base, shape=[k_rows, HEAD_DIM], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        o_desc = tl.make_tensor_descriptor(o_base, shape=[q_len, HEAD_DIM], strides=[stride_om, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])

        # rows past q_len come back as zeros and are never stored
        q = q_desc.load([m_start, 0])

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

        diag, full_end, end = _tile_key_range(q_len, k_len, m_start, IS_CAUSAL, BLOCK_M, BLOCK_N)

        if WARP_SPECIALIZE:
            # One loop over every key tile with the mask on every tile: the Hopper
            # warp-specialisation pass (triton 3.6 and 3.9) partitions a single key loop,
            # but gives up on a second loop that consumes the first one's results and on an
            # `if` inside the loop. The mask is one compare per score against a per-row limit
            # (last key the row sees); a row with limit < 0 sees nothing.
            if IS_CAUSAL:
                limit = tl.minimum(offs_m + diag, k_len - 1)
            else:
                limit = tl.zeros([BLOCK_M], dtype=tl.int32) + (k_len - 1)
            for start_n in tl.range(0, end, BLOCK_N, warp_specialize=True):
                k = k_desc.load([start_n, 0])
                v = v_desc.load([start_n, 0])
                visible = (start_n + offs_n)[None, :] <= limit[:, None]
                acc, l_i, m_i = _softmax_step_masked(acc, l_i, m_i, q, k, v, visible, qk_scale_log2,
                                                     DOT_PRECISION, True)
        else:
            for start_n in tl.range(0, full_end, BLOCK_N):
                k = k_desc.load([start_n, 0])
                v = v_desc.load([start_n, 0])
                acc, l_i, m_i = _softmax_step(acc, l_i, m_i, q, k, v, qk_scale_log2, DOT_PRECISION)

            # Keys past k_len load as zeros (TMA clips at the descriptor's shape); their scores
            # still need the column mask, since a zero key scores 0, not -inf.
            for start_n in tl.range(full_end, end, BLOCK_N):
                cols = start_n + offs_n
                k = k_desc.load([start_n, 0])
                v = v_desc.load([start_n, 0])
                visible = (cols < k_len)[None, :]
                if IS_CAUSAL:
                    visible = visible & (cols[None, :] <= offs_m[:, None] + diag)
                acc, l_i, m_i = _softmax_step_masked(acc, l_i, m_i, q, k, v, visible, qk_scale_log2,
                                                     DOT_PRECISION, True)

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        o_desc.store([m_start, 0], out.to(O.dtype.element_ty))
        if RETURN_LSE:
            _store_lse(LSE, l_i, m_i, l_safe, seq64, head, q_start, offs_m, q_len, stride_lb, stride_lh, stride_lm)


# ------------------------------------------------------------------------------ launchers

# (variant, cfg, head_dim, dtype, causal, varlen, lse) that failed to launch for lack of shared
# memory or registers: such calls take the pointer kernel from then on
_unlaunchable: set = set()


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _launch(variant: str, q: torch.Tensor, heads_and_keys: tuple[int, int, int, int, int], max_seqlen_q: int,
            args: tuple, is_varlen: bool, causal: bool, head_dim: int, return_lse: bool, strict: bool) -> bool:
    """Launch one Hopper variant; False when it does not fit (and strict is off).
    heads_and_keys: (sequences, q heads, KV heads, max keys per sequence, keys in all): the grid's
    (sequence, head) axis, and the Gluon kernel's L2 sections (prefill_gluon.section_for)."""
    from triton.runtime.errors import OutOfResources

    from . import configs

    cfg = configs.prefill_hopper_config(variant, head_dim, q.dtype, q.device)
    key = (variant, cfg, head_dim, q.dtype, causal, is_varlen, return_lse)
    if key in _unlaunchable and not strict:
        return False
    if q.is_cuda:
        ensure_allocator()
    num_programs_bh = heads_and_keys[0] * heads_and_keys[1]
    grid = (num_programs_bh, triton.cdiv(max_seqlen_q, cfg.block_m))
    try:
        if variant == "gluon":
            from . import prefill_gluon

            prefill_gluon.launch(args, num_programs_bh, max_seqlen_q, is_varlen, causal, head_dim, return_lse,
                                 block_n=cfg.block_n, stages=cfg.num_stages,
                                 section_hb=prefill_gluon.section_for(q, *heads_and_keys))
            return True
        fast(_attn_fwd_tma)[grid](
            *args,
            IS_VARLEN=is_varlen,
            IS_CAUSAL=causal,
            HEAD_DIM=head_dim,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            DOT_PRECISION=_dot_precision(q.dtype),
            RETURN_LSE=return_lse,
            WARP_SPECIALIZE=variant == "tma_ws",
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    except OutOfResources:
        if strict:
            raise
        _unlaunchable.add(key)
        return False
    return True


def _resolve(variant, q, k, v, avg_keys: float) -> tuple[str | None, bool]:
    """(variant to run or None for the pointer kernel, whether the caller forced it). A forced
    variant must suit the layout; fp32 is allowed then (the interpreter tests run it).
    avg_keys: keys per sequence on average, for the default's size rule."""
    from . import configs

    explicit = variant is not None
    if variant is None:
        variant = configs.prefill_variant(q.dtype, q.device, q.shape[-1], avg_keys)
    if variant not in configs.PREFILL_VARIANTS:
        raise ValueError(f"variant must be one of {configs.PREFILL_VARIANTS}, got {variant!r}")
    if variant == "pointer" or (not explicit and q.shape[-1] not in configs.HOPPER_PREFILL_HEAD_DIMS):
        return None, explicit
    if variant == "gluon":
        from . import prefill_gluon

        if not prefill_gluon.usable(q):
            if explicit:
                raise ValueError("variant 'gluon' needs an sm_90 GPU, float16/bfloat16 inputs, head_dim 64 or 128 "
                                 "and a triton with Gluon (no interpreter)")
            return None, explicit
    ok = usable(q, k, v) or (explicit and q.dtype == torch.float32 and all(_aligned(t) for t in (q, k, v)))
    if not ok:
        if explicit:
            raise ValueError(f"variant {variant!r} needs 16-byte aligned bases and strides "
                             f"(q strides {tuple(q.stride())}, k {tuple(k.stride())}, v {tuple(v.stride())})")
        return None, explicit
    return variant, explicit


def try_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                return_lse: bool = False, variant: str | None = None):
    """Dense prefill (ops.prefill's signature) through a Hopper variant, or None when the pointer
    kernel should run instead: the selected variant is "pointer", the layout does not suit TMA,
    the tile does not fit, or there is nothing to compute. `variant` forces one (tests, A/B);
    then an unsuitable layout or a tile that does not fit raises."""
    variant, strict = _resolve(variant, q, k, v, k.shape[2])
    if variant is None:
        return None
    batch, num_q_heads, seqlen_q, head_dim = q.shape
    out = torch.empty((batch, num_q_heads, seqlen_q, head_dim), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return None
    lse = torch.empty((batch, num_q_heads, seqlen_q), dtype=torch.float32, device=q.device) if return_lse else None
    args = dense_args(q, k, v, out, lse, scale)
    with _device_scope(q):
        if not _launch(variant, q, (batch, num_q_heads, k.shape[1], k.shape[2], batch * k.shape[2]), seqlen_q, args,
                       False, bool(causal), head_dim, lse is not None, strict):
            return None
    return out if lse is None else (out, lse)


def try_prefill_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                       max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float,
                       return_lse: bool = False, variant: str | None = None):
    """Varlen prefill (ops.prefill_varlen's signature) through a Hopper variant, or None; see
    try_prefill."""
    variant, strict = _resolve(variant, q, k, v, k.shape[0] / max(cu_seqlens_q.shape[0] - 1, 1))
    if variant is None:
        return None
    total_q, num_q_heads, head_dim = q.shape
    num_seqs = cu_seqlens_q.shape[0] - 1
    if total_q * num_q_heads * head_dim == 0 or num_seqs <= 0 or int(max_seqlen_q) <= 0:
        return None
    out = torch.empty((total_q, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((total_q, num_q_heads), dtype=torch.float32, device=q.device) if return_lse else None
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32).contiguous()
    args = varlen_args(q, k, v, out, lse, cu_q, cu_k, scale)
    with _device_scope(q):
        if not _launch(variant, q, (num_seqs, num_q_heads, k.shape[1], int(max_seqlen_k), k.shape[0]),
                       int(max_seqlen_q), args, True, bool(causal), head_dim, lse is not None, strict):
            return None
    return out if lse is None else (out, lse)


def _device_scope(t: torch.Tensor):
    import contextlib

    if t.is_cuda and t.device.index is not None and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()
