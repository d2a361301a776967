"""Public ops: argument checking, then dispatch through the backend registry.

Every rule of DESIGN.md is checked here, before any kernel runs, so that a
user's mistake becomes a TypeError/ValueError naming the argument, the value
seen and the rule, never an illegal memory access that kills the CUDA context.
Checks that read tensor *values* (block-table ranges, context capacity,
cu_seqlens) need a device sync; `check_values=False` skips them for callers
that built those tensors themselves (the engine), never by default.
"""

from __future__ import annotations

import math

import torch

from . import registry
from .registry import Backend

_FLOAT_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
MAX_BLOCK_SIZE = 256


# --------------------------------------------------------------------------- checks


def _tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _ndim(name: str, x: torch.Tensor, ndim: int, layout: str) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(x.shape)}")


def _float_dtype(name: str, x: torch.Tensor) -> None:
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")


def _same_dtype(ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    for name, x in others.items():
        if x.dtype != ref.dtype:
            raise TypeError(f"{name} must have the dtype of {ref_name} ({ref.dtype}), got {x.dtype}")


def _same_device(ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    for name, x in others.items():
        if x.device != ref.device:
            raise ValueError(f"{name} is on {x.device} but {ref_name} is on {ref.device}; all tensors must share one device")


def _int_dtype(name: str, x: torch.Tensor, allowed=(torch.int32,)) -> None:
    if x.dtype not in allowed:
        want = " or ".join(str(a).replace("torch.", "") for a in allowed)
        raise TypeError(f"{name} must be {want}, got {x.dtype}")


def _dim_eq(what: str, got: int, want: int, rule: str) -> None:
    if got != want:
        raise ValueError(f"{what} is {got} but must equal {want} ({rule})")


def _heads(num_q_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads <= 0 or num_q_heads <= 0:
        raise ValueError(f"head counts must be positive, got Hq={num_q_heads}, Hkv={num_kv_heads}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"GQA needs Hq % Hkv == 0, got Hq={num_q_heads} and Hkv={num_kv_heads} (query head h reads KV head h // (Hq // Hkv))"
        )


def _scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale}")
    return float(scale)


def _bool(name: str, x) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")
    return x


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 or x.numel() == 0 else x.contiguous()


def _kernel_ready(b: Backend, x: torch.Tensor) -> torch.Tensor:
    """Last dim stride 1 for every backend; for the GPU kernels also 16-byte
    aligned rows (they move rows with 16-byte vector loads), else a contiguous copy."""
    x = _last_dim_contiguous(x)
    if b.name == "torch" or x.numel() == 0:
        return x
    step = 16 // x.element_size()
    aligned = x.data_ptr() % 16 == 0 and all(st % step == 0 for st, n in zip(x.stride()[:-1], x.shape[:-1]) if n > 1)
    return x if aligned else x.contiguous()


def _pick(op: str, device: torch.device, backend: str | None, dtype: torch.dtype, head_dim: int) -> Backend:
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
    b = registry.resolve(op, device.type, backend)
    dname = _FLOAT_DTYPES[dtype]
    if dname not in b.dtypes:
        raise TypeError(f"backend {b.name!r} supports dtypes {list(b.dtypes)}, got {dname}")
    if head_dim not in b.head_dims:
        raise ValueError(f"head dim D={head_dim} is not supported by backend {b.name!r}; supported: {list(b.head_dims)}")
    return b


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int, tensor_name: str) -> int:
    """Value checks of one cu_seqlens tensor; returns its largest sequence length."""
    vals = cu.tolist()
    if vals[0] != 0:
        raise ValueError(f"{name} must start at 0, got {vals[0]}")
    diffs = [b - a for a, b in zip(vals, vals[1:])]
    if any(d < 0 for d in diffs):
        i = next(i for i, d in enumerate(diffs) if d < 0)
        raise ValueError(f"{name} must be non-decreasing, got {vals[i]} then {vals[i + 1]} at index {i}")
    if vals[-1] != total:
        raise ValueError(f"{name}[-1] is {vals[-1]} but {tensor_name} has {total} tokens; they must be equal")
    return max(diffs, default=0)


# --------------------------------------------------------------------------- ops


def prefill_attention(q, k, v, *, causal: bool = True, scale: float | None = None, backend: str | None = None):
    """Causal (or full) attention over dense, equal-length batches, with GQA.

    Args:
        q: [B, Hq, Nq, D] float16/bfloat16 (float32 on torch/triton).
        k, v: [B, Hkv, Nk, D], same dtype and device as q; Hq % Hkv == 0.
        causal: bottom-right aligned mask: query row i sees key j iff j < Nk - Nq + i + 1.
        scale: softmax scale, default 1/sqrt(D).
        backend: "auto", "torch", "triton", "cuda", "cuda-wmma" or None (env vars, then auto).

    Returns:
        o: [B, Hq, Nq, D] in q's dtype. Rows that see no key are exact zeros.
    """
    q, k, v = _tensor("q", q), _tensor("k", k), _tensor("v", v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _ndim(name, x, 4, "[B, H, N, D]")
    _float_dtype("q", q)
    _same_dtype("q", q, k=k, v=v)
    _same_device("q", q, k=k, v=v)
    causal = _bool("causal", causal)
    B, Hq, Nq, D = q.shape
    _dim_eq("k.shape[0] (batch)", k.shape[0], B, "q and k share the batch size")
    _dim_eq("v.shape[0] (batch)", v.shape[0], B, "q and v share the batch size")
    _dim_eq("k.shape[3] (head dim)", k.shape[3], D, "q and k share the head dim")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    _heads(Hq, k.shape[1])
    scale = _scale(scale, D)
    b = _pick("prefill", q.device, backend, q.dtype, D)
    if q.numel() == 0:
        return torch.empty_like(q)
    if k.shape[2] == 0:
        return torch.zeros_like(q)
    q, k, v = (_kernel_ready(b, x) for x in (q, k, v))
    return b.op("prefill")(q, k, v, causal, scale)


def prefill_attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = True,
    scale: float | None = None,
    backend: str | None = None,
    check_values: bool = True,
):
    """Attention over packed sequences of different lengths (no padding), with GQA.

    Args:
        q: [Tq, Hq, D]; k, v: [Tk, Hkv, D]. Sequence s owns q rows
            cu_seqlens_q[s]:cu_seqlens_q[s+1] and k/v rows cu_seqlens_k[s]:cu_seqlens_k[s+1].
        cu_seqlens_q, cu_seqlens_k: int32 [S + 1], start at 0, non-decreasing,
            end at Tq / Tk. A sequence may be empty; Nq_s != Nk_s is allowed.
        max_seqlen_q, max_seqlen_k: the largest per-sequence lengths (computed,
            with a device sync, when None).
        causal, scale, backend: as in `prefill_attention` (causal is bottom-right per sequence).
        check_values: verify cu_seqlens/max_seqlen values (syncs); pass False only
            when you built them yourself.

    Returns:
        o: [Tq, Hq, D] in q's dtype.
    """
    q, k, v = _tensor("q", q), _tensor("k", k), _tensor("v", v)
    cu_q, cu_k = _tensor("cu_seqlens_q", cu_seqlens_q), _tensor("cu_seqlens_k", cu_seqlens_k)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _ndim(name, x, 3, "[T, H, D]")
    _float_dtype("q", q)
    _same_dtype("q", q, k=k, v=v)
    _int_dtype("cu_seqlens_q", cu_q)
    _int_dtype("cu_seqlens_k", cu_k)
    _same_device("q", q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    causal = _bool("causal", causal)
    _ndim("cu_seqlens_q", cu_q, 1, "[S + 1]")
    _ndim("cu_seqlens_k", cu_k, 1, "[S + 1]")
    if cu_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q must hold at least one entry (0 sequences: [0])")
    _dim_eq("len(cu_seqlens_k)", cu_k.shape[0], cu_q.shape[0], "one entry per sequence boundary, like cu_seqlens_q")
    Tq, Hq, D = q.shape
    _dim_eq("k.shape[2] (head dim)", k.shape[2], D, "q and k share the head dim")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    _heads(Hq, k.shape[1])
    scale = _scale(scale, D)
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise ValueError(f"{name} must be a non-negative int or None, got {m!r}")
    b = _pick("prefill_varlen", q.device, backend, q.dtype, D)
    if check_values or max_seqlen_q is None or max_seqlen_k is None:
        real_q = _check_cu_seqlens("cu_seqlens_q", cu_q, Tq, "q")
        real_k = _check_cu_seqlens("cu_seqlens_k", cu_k, k.shape[0], "k")
        if max_seqlen_q is not None and max_seqlen_q < real_q:
            raise ValueError(f"max_seqlen_q={max_seqlen_q} is below the longest query sequence ({real_q})")
        if max_seqlen_k is not None and max_seqlen_k < real_k:
            raise ValueError(f"max_seqlen_k={max_seqlen_k} is below the longest key sequence ({real_k})")
        max_seqlen_q = real_q if max_seqlen_q is None else max_seqlen_q
        max_seqlen_k = real_k if max_seqlen_k is None else max_seqlen_k
    if Tq == 0:
        return torch.empty_like(q)
    q, k, v = (_kernel_ready(b, x) for x in (q, k, v))
    cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()
    return b.op("prefill_varlen")(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, scale)


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    _ndim("k_cache", k_cache, 4, "[num_blocks, block_size, Hkv, D]")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if not (1 <= block_size <= MAX_BLOCK_SIZE) or block_size & (block_size - 1):
        raise ValueError(f"block_size (k_cache.shape[1]) must be a power of two in [1, {MAX_BLOCK_SIZE}], got {block_size}")
    return num_blocks, block_size, num_kv_heads, head_dim


def decode_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    *,
    scale: float | None = None,
    backend: str | None = None,
    check_values: bool = True,
):
    """One new query token per sequence against a paged KV cache, with GQA.

    Args:
        q: [B, Hq, D].
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] (NHD pages); block_size
            a power of two in 1..256; same dtype as q.
        block_tables: int32 [B, max_blocks]; row b lists sequence b's pages in
            order. Only the first ceil(context_lens[b] / block_size) entries are
            read; the rest may hold anything (e.g. -1).
        context_lens: int32 [B], tokens cached per sequence (0 gives zeros).
        scale, backend: as in `prefill_attention`.
        check_values: verify table entries and lengths (syncs); pass False only
            when you built them yourself.

    Returns:
        o: [B, Hq, D] in q's dtype.
    """
    q = _tensor("q", q)
    k_cache, v_cache = _tensor("k_cache", k_cache), _tensor("v_cache", v_cache)
    block_tables, context_lens = _tensor("block_tables", block_tables), _tensor("context_lens", context_lens)
    _ndim("q", q, 3, "[B, Hq, D]")
    _float_dtype("q", q)
    _same_dtype("q", q, k_cache=k_cache, v_cache=v_cache)
    _int_dtype("block_tables", block_tables)
    _int_dtype("context_lens", context_lens)
    _same_device("q", q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, context_lens=context_lens)
    num_blocks, block_size, Hkv, Dc = _check_cache_pair(k_cache, v_cache)
    B, Hq, D = q.shape
    _dim_eq("k_cache.shape[3] (head dim)", Dc, D, "q and the caches share the head dim")
    _heads(Hq, Hkv)
    _ndim("block_tables", block_tables, 2, "[B, max_blocks]")
    _ndim("context_lens", context_lens, 1, "[B]")
    _dim_eq("block_tables.shape[0]", block_tables.shape[0], B, "one block-table row per query")
    _dim_eq("context_lens.shape[0]", context_lens.shape[0], B, "one context length per query")
    scale = _scale(scale, D)
    b = _pick("decode", q.device, backend, q.dtype, D)
    max_blocks = block_tables.shape[1]
    if check_values and B > 0:
        lens = context_lens.long()
        if bool((lens < 0).any()):
            raise ValueError(f"context_lens must be >= 0, got {lens.min().item()}")
        cap = max_blocks * block_size
        if bool((lens > cap).any()):
            i = int(torch.argmax(lens).item())
            raise ValueError(
                f"context_lens[{i}]={lens[i].item()} exceeds the block table's capacity "
                f"max_blocks * block_size = {max_blocks} * {block_size} = {cap}"
            )
        used = torch.arange(max_blocks, device=q.device).unsqueeze(0) < ((lens + block_size - 1) // block_size).unsqueeze(1)
        bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
        if bool(bad.any()):
            r, c = (int(x) for x in bad.nonzero()[0].tolist())
            raise ValueError(
                f"block_tables[{r}, {c}]={block_tables[r, c].item()} is outside [0, num_blocks={num_blocks}) "
                f"though sequence {r} (context_lens={lens[r].item()}) reads it"
            )
    if B == 0:
        return torch.empty_like(q)
    q = _kernel_ready(b, q)
    # Kernels index pages with flat strides; a strided cache view is rare, copy it.
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    return b.op("decode")(q, k_cache, v_cache, block_tables.contiguous(), context_lens.contiguous(), scale)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, *, backend: str | None = None, check_values: bool = True) -> None:
    """Scatter new tokens' K/V into the paged caches, in place.

    Args:
        k, v: [T, Hkv, D].
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], same dtype as k, contiguous.
        slot_mapping: int32 or int64 [T]; token t goes to block slot // block_size,
            offset slot % block_size. A negative slot skips its token.
        backend: as in `prefill_attention`.
        check_values: verify slots < num_blocks * block_size (syncs).
    """
    k, v = _tensor("k", k), _tensor("v", v)
    k_cache, v_cache = _tensor("k_cache", k_cache), _tensor("v_cache", v_cache)
    slot_mapping = _tensor("slot_mapping", slot_mapping)
    _ndim("k", k, 3, "[T, Hkv, D]")
    _ndim("v", v, 3, "[T, Hkv, D]")
    _float_dtype("k", k)
    _same_dtype("k", k, v=v, k_cache=k_cache, v_cache=v_cache)
    _int_dtype("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    _same_device("k", k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    num_blocks, block_size, Hkv, D = _check_cache_pair(k_cache, v_cache)
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    _dim_eq("k.shape[1] (KV heads)", k.shape[1], Hkv, "k and k_cache share Hkv")
    _dim_eq("k.shape[2] (head dim)", k.shape[2], D, "k and k_cache share the head dim")
    _ndim("slot_mapping", slot_mapping, 1, "[T]")
    _dim_eq("slot_mapping.shape[0]", slot_mapping.shape[0], k.shape[0], "one slot per token")
    b = _pick("write_kv_cache", k.device, backend, k.dtype, D)
    if b.name != "torch":
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not c.is_contiguous():
                raise ValueError(f"{name} must be contiguous for backend {b.name!r} (it is written in place)")
    if check_values and slot_mapping.numel() > 0:
        hi = int(slot_mapping.max().item())
        if hi >= num_blocks * block_size:
            raise ValueError(
                f"slot_mapping holds {hi}, outside the cache's num_blocks * block_size = {num_blocks * block_size} slots"
            )
    if k.shape[0] == 0:
        return None
    k, v = _kernel_ready(b, k), _kernel_ready(b, v)
    b.op("write_kv_cache")(k, v, k_cache, v_cache, slot_mapping.to(torch.int64).contiguous())
    return None
