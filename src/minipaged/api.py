"""Public ops: argument checking, then dispatch through the backend registry.

Every rule of DESIGN.md is checked here, once, before any kernel runs, so that
a user's mistake becomes a TypeError/ValueError naming the argument, the value
seen and the rule, never an illegal memory access that kills the CUDA context.
Backend functions trust their arguments; this module is also the one place
that makes tensors kernel-ready (`_kernel_ready`).

Checks that read tensor *values* (block-table ranges, context capacity,
cu_seqlens) need a device sync; `check_values=False` skips them for callers
that built those tensors themselves (the engine), never by default.
"""

from __future__ import annotations

import contextlib
import math
import numbers

import torch

from . import registry
from .registry import Backend

_FLOAT_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
MAX_BLOCK_SIZE = 256
_NEG_INF = float("-inf")


# --------------------------------------------------------------------------- checks


def _type_name(x) -> str:
    """x's type as the messages show it: qualified unless a builtin (numpy's bool prints as "bool"
    too, and "causal must be a bool, got bool" tells the caller nothing)."""
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {_type_name(x)}")
    if x.layout != torch.strided or x.is_nested:
        # sparse and nested tensors have no strides: the checks below and the kernels index dense memory
        kind = "nested" if x.is_nested else x.layout
        raise TypeError(f"{name} must be a dense (strided) tensor, got a {kind} tensor")
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


# The kernels hold every scale in float32: a value must be a positive normal-or-subnormal fp32.
_F32_MAX = 3.4028234663852886e38
_F32_MIN_POSITIVE = 1.401298464324817e-45


def positive_float32(name: str, x) -> float:
    """x (a Python int or float) as a float that float32 holds as a positive finite number,
    else ValueError naming `name` (an int too large for a float included)."""
    try:
        f = float(x)
    except OverflowError:
        f = math.inf
    if not (_F32_MIN_POSITIVE <= f <= _F32_MAX):
        shown = repr(x) if len(repr(x)) <= 40 else f"{repr(x)[:12]}... ({len(repr(x))} digits)"
        raise ValueError(f"{name} must be a positive finite float within float32's range, got {shown}")
    return f


def _scale(scale, head_dim: int) -> float:
    # called after the head-dim check, so head_dim > 0 here
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not real_number(scale):
        raise TypeError(f"scale must be a float or None, got {_type_name(scale)}")
    return positive_float32("scale", scale)


def _bool(name: str, x) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {_type_name(x)}")
    return x


def real_number(x) -> bool:
    """A real number that is not a bool: Python's, or numpy's scalars (registered as numbers.Real;
    numpy's bool is not)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_block_size(n: int) -> bool:
    """Whether n tokens per page is one the kernels take: a power of two from 1 to MAX_BLOCK_SIZE.
    The one rule behind every block-size / page-size check (API, cache, engine, CLIs)."""
    return 1 <= n <= MAX_BLOCK_SIZE and n & (n - 1) == 0


def integer_number(x) -> bool:
    """An integer that is not a bool: Python's, or numpy's integer scalars (numbers.Integral)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _max_len(name: str, m) -> int | None:
    if m is not None and (not integer_number(m) or m < 0):
        raise ValueError(f"{name} must be a non-negative int or None, got {m!r}")
    return None if m is None else int(m)


def _kernel_ready(b: Backend, x: torch.Tensor) -> torch.Tensor:
    """Last dim stride 1 for every backend; for the GPU kernels also 16-byte
    aligned rows (they move rows with 16-byte vector loads), else a fresh
    contiguous copy (`clone`: `.contiguous()` of a contiguous view that starts
    off a 16-byte boundary would return the same misaligned view)."""
    if x.numel() == 0:
        return x
    if x.stride(-1) != 1:
        return x.contiguous()
    if b.name == "torch":
        return x
    step = 16 // x.element_size()
    aligned = x.data_ptr() % 16 == 0 and all(st % step == 0 for st, n in zip(x.stride()[:-1], x.shape[:-1]) if n > 1)
    return x if aligned else x.clone(memory_format=torch.contiguous_format)


def _cache_ready(b: Backend, c: torch.Tensor) -> torch.Tensor:
    """A cache the attention kernels read: contiguous, and for the GPU kernels with a
    16-byte aligned base (a view that is not, never a PagedKVCache's, is copied once
    for the call; the binding refuses anything else)."""
    if b.name == "torch" or c.numel() == 0:
        return c.contiguous()
    if c.is_contiguous() and c.data_ptr() % 16 == 0:
        return c
    return c.clone(memory_format=torch.contiguous_format)


_picked: dict[tuple, Backend] = {}


def _pick(op: str, device: torch.device, backend: str | None, dtype: torch.dtype, head_dim: int,
          fp8_kv: bool = False) -> Backend:
    """The backend for this call, after its dtype and head-dim rules; memoised on everything
    the answer depends on (the selection key, dtype, head dim, an fp8 cache)."""
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"the tensors are on {device}: minipaged runs on cpu and cuda tensors")
    key = (registry.selection_key(op, device.type, backend), dtype, head_dim, fp8_kv)
    b = _picked.get(key)
    if b is None:
        b = _picked[key] = _pick_uncached(op, device, backend, dtype, head_dim, fp8_kv)
    return b


def _pick_uncached(op: str, device: torch.device, backend: str | None, dtype: torch.dtype, head_dim: int,
                   fp8_kv: bool) -> Backend:
    b = registry.resolve(op, device.type, backend, fp8_kv=fp8_kv)
    if fp8_kv and not b.fp8_kv:
        have = [x.name for x in registry.all_backends().values() if x.fp8_kv]
        raise TypeError(f"backend {b.name!r} has no float8_e4m3fn KV-cache kernels for {op}; backends that do: {have}")
    dname = _FLOAT_DTYPES[dtype]
    dtypes, why = b.supported_dtypes(device.type)
    if dname not in dtypes:
        reason = f": {why}" if why and dname in b.dtypes else ""
        raise TypeError(f"backend {b.name!r} supports dtypes {list(dtypes)} on {device.type}, got {dname}{reason}")
    if head_dim not in b.head_dims:
        raise ValueError(f"head dim D={head_dim} is not supported by backend {b.name!r}; supported: {list(b.head_dims)}")
    return b


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int, tensor_name: str) -> tuple[list[int], int]:
    """Value checks of one cu_seqlens tensor; returns (its per-sequence lengths, the largest)."""
    vals = cu.tolist()
    if vals[0] != 0:
        raise ValueError(f"{name} must start at 0, got {vals[0]}")
    diffs = [b - a for a, b in zip(vals, vals[1:])]
    if any(d < 0 for d in diffs):
        i = next(i for i, d in enumerate(diffs) if d < 0)
        raise ValueError(f"{name} must be non-decreasing, got {vals[i]} then {vals[i + 1]} at index {i}")
    if vals[-1] != total:
        raise ValueError(f"{name}[-1] is {vals[-1]} but {tensor_name} has {total} tokens; they must be equal")
    return diffs, max(diffs, default=0)


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    _ndim("k_cache", k_cache, 4, "[num_blocks, block_size, Hkv, D]")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if not is_block_size(block_size):
        raise ValueError(f"block_size (k_cache.shape[1]) must be a power of two in [1, {MAX_BLOCK_SIZE}], got {block_size}")
    return num_blocks, block_size, num_kv_heads, head_dim


def _check_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Value checks of a paged batch (syncs): lengths in [0, capacity], read table entries in range."""
    if context_lens.numel() == 0:
        return
    max_blocks = block_tables.shape[1]
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
    used = torch.arange(max_blocks, device=lens.device).unsqueeze(0) < ((lens + block_size - 1) // block_size).unsqueeze(1)
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(bad.any()):
        r, c = (int(x) for x in bad.nonzero()[0].tolist())
        raise ValueError(
            f"block_tables[{r}, {c}]={block_tables[r, c].item()} is outside [0, num_blocks={num_blocks}) "
            f"though sequence {r} (context_lens={lens[r].item()}) reads it"
        )


def _empty_result(o: torch.Tensor, lse_shape: tuple, return_lse: bool):
    """What a call with no key to attend to returns: o as given (zeros), lse -inf."""
    if not return_lse:
        return o
    return o, torch.full(lse_shape, _NEG_INF, dtype=torch.float32, device=o.device)


_FP8 = torch.float8_e4m3fn
_scale_tensors: dict[tuple, torch.Tensor] = {}


def _check_cache_dtype(ref_name: str, ref: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Caches share one dtype: the dtype of `ref` (q, or k for writes), or float8_e4m3fn with a
    float16/bfloat16 `ref`. Returns whether the caches are fp8."""
    if k_cache.dtype != _FP8 and v_cache.dtype != _FP8:
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if c.dtype != ref.dtype:
                # a 16-bit ref takes an FP8 cache too: say which FP8 dtype, or an e5m2 cache (or vLLM's
                # uint8 FP8 pages) reads as "FP8 is not supported"
                fp8 = " or float8_e4m3fn" if ref.dtype in (torch.float16, torch.bfloat16) else ""
                raise TypeError(f"{name} must have the dtype of {ref_name} ({ref.dtype}){fp8}, got {c.dtype}")
        return False
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"v_cache must have the dtype of k_cache ({k_cache.dtype}), got {v_cache.dtype}")
    if ref.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"{ref_name} must be float16 or bfloat16 with a float8_e4m3fn cache, got {ref.dtype}")
    return True


def _kv_scale(name: str, s, fp8: bool, cache: torch.Tensor, check_values: bool) -> torch.Tensor | None:
    """A k_scale/v_scale argument as the backends take it: float32 [Hkv] on the cache's device
    (None for a 16/32-bit cache, which must not be given one)."""
    if not fp8:
        if s is not None:
            raise ValueError(f"{name} was given but the cache is {cache.dtype}; scales apply to "
                             "float8_e4m3fn caches only (they would be silently ignored)")
        return None
    num_kv_heads = cache.shape[2]
    if s is None:
        s = 1.0
    if isinstance(s, torch.Tensor):
        # a sparse or nested scale has no strides: torch's NotImplementedError / "NestedTensorImpl
        # doesn't support sizes" came out of the shape and value checks below
        _tensor(name, s)
        if s.dtype != torch.float32:
            raise TypeError(f"{name} must be a float or a float32 tensor, got a {s.dtype} tensor")
        if s.device != cache.device:
            raise ValueError(f"{name} is on {s.device} but the cache is on {cache.device}")
        if s.shape not in ((), (num_kv_heads,)):
            raise ValueError(f"{name} must have shape [] or [Hkv] = [{num_kv_heads}] (one per KV head), "
                             f"got {tuple(s.shape)}")
        if check_values and not bool((torch.isfinite(s) & (s > 0)).all()):
            raise ValueError(f"{name} must be positive and finite, got {s.tolist()}")
        return s.reshape(1).expand(num_kv_heads).contiguous() if s.dim() == 0 else s.contiguous()
    if not real_number(s):
        raise TypeError(f"{name} must be a positive float or a float32 tensor, got {_type_name(s)}")
    s = positive_float32(name, s)
    key = (s, num_kv_heads, cache.device)
    t = _scale_tensors.get(key)
    if t is None:
        if len(_scale_tensors) >= 256:
            _scale_tensors.clear()
        t = _scale_tensors[key] = torch.full((num_kv_heads,), float(s), dtype=torch.float32, device=cache.device)
    return t


def _scales_copied(given: tuple, scales: tuple) -> bool:
    """Whether a k_scale/v_scale tensor the caller gave reaches the kernels as a copy (0-dim,
    non-contiguous): such a call must not be remembered by the check_values=False fast path, whose
    copy would go stale when the caller updates its tensor in place."""
    return any(isinstance(x, torch.Tensor) and x is not y for x, y in zip(given, scales))


def _scale_args(k_scale, v_scale) -> tuple:
    """Trailing backend arguments: none for 16-bit caches, so that backends without FP8 keep
    their signatures."""
    return () if k_scale is None else (k_scale, v_scale)


# --------------------------------------------------------------------------- ops


def prefill_attention(q, k, v, *, causal: bool = True, scale: float | None = None, return_lse: bool = False,
                      backend: str | None = None):
    """Causal (or full) attention over dense, equal-length batches, with GQA.

    Args:
        q: [B, Hq, Nq, D] float16/bfloat16 (float32 on torch/triton).
        k, v: [B, Hkv, Nk, D], same dtype and device as q; Hq % Hkv == 0.
        causal: bottom-right aligned mask: query row i sees key j iff j < Nk - Nq + i + 1.
        scale: softmax scale, default 1/sqrt(D).
        return_lse: also return lse float32 [B, Hq, Nq], the natural log of each row's
            softmax denominator of the scaled scores (-inf for a row that sees no key).
        backend: "auto", "torch", "triton", "cuda", "cuda-wmma" or None (env vars, then auto).

    Returns:
        o: [B, Hq, Nq, D] in q's dtype (or (o, lse)). Rows that see no key are exact zeros.
    """
    q, k, v = _tensor("q", q), _tensor("k", k), _tensor("v", v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _ndim(name, x, 4, "[B, H, N, D]")
    _float_dtype("q", q)
    _same_dtype("q", q, k=k, v=v)
    _same_device("q", q, k=k, v=v)
    causal, return_lse = _bool("causal", causal), _bool("return_lse", return_lse)
    B, Hq, Nq, D = q.shape
    _dim_eq("k.shape[0] (batch)", k.shape[0], B, "q and k share the batch size")
    _dim_eq("v.shape[0] (batch)", v.shape[0], B, "q and v share the batch size")
    _dim_eq("k.shape[3] (head dim)", k.shape[3], D, "q and k share the head dim")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    _heads(Hq, k.shape[1])
    b = _pick("prefill", q.device, backend, q.dtype, D)
    scale = _scale(scale, D)
    if q.numel() == 0:
        return _empty_result(torch.empty_like(q), (B, Hq, Nq), return_lse)
    if k.shape[2] == 0:
        return _empty_result(torch.zeros_like(q), (B, Hq, Nq), return_lse)
    q, k, v = (_kernel_ready(b, x) for x in (q, k, v))
    return b.op("prefill")(q, k, v, causal, scale, return_lse)


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
    return_lse: bool = False,
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
        return_lse: also return lse float32 [Tq, Hq].
        check_values: verify cu_seqlens/max_seqlen values (syncs); pass False only
            when you built them yourself.

    Returns:
        o: [Tq, Hq, D] in q's dtype (or (o, lse)).
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
    causal, return_lse = _bool("causal", causal), _bool("return_lse", return_lse)
    check_values = _bool("check_values", check_values)
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
    max_seqlen_q = _max_len("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _max_len("max_seqlen_k", max_seqlen_k)
    b = _pick("prefill_varlen", q.device, backend, q.dtype, D)
    scale = _scale(scale, D)
    if check_values or max_seqlen_q is None or max_seqlen_k is None:
        _, real_q = _check_cu_seqlens("cu_seqlens_q", cu_q, Tq, "q")
        _, real_k = _check_cu_seqlens("cu_seqlens_k", cu_k, k.shape[0], "k")
        if max_seqlen_q is not None and max_seqlen_q < real_q:
            raise ValueError(f"max_seqlen_q={max_seqlen_q} is below the longest query sequence ({real_q})")
        if max_seqlen_k is not None and max_seqlen_k < real_k:
            raise ValueError(f"max_seqlen_k={max_seqlen_k} is below the longest key sequence ({real_k})")
        max_seqlen_q = real_q if max_seqlen_q is None else max_seqlen_q
        max_seqlen_k = real_k if max_seqlen_k is None else max_seqlen_k
    # an upper bound past the packed totals holds no sequence: the kernels size grids from it
    max_seqlen_q, max_seqlen_k = min(max_seqlen_q, Tq), min(max_seqlen_k, k.shape[0])
    if Tq == 0:
        return _empty_result(torch.empty_like(q), (Tq, Hq), return_lse)
    q, k, v = (_kernel_ready(b, x) for x in (q, k, v))
    return b.op("prefill_varlen")(q, k, v, cu_q.contiguous(), cu_k.contiguous(), max_seqlen_q, max_seqlen_k,
                                  causal, scale, return_lse)


# Microsecond ops (decode, paged) called with check_values=False skip the metadata checks
# when a call with the same metadata already passed them: the rules depend on shapes,
# dtypes, devices, the scalar arguments and the backend selection only. The key holds
# exactly those; the layout a kernel needs (contiguous, 16-byte aligned q) is re-tested
# per call because it is not part of the key.
_validated: dict[tuple, tuple] = {}
_VALIDATED_MAX = 4096


def _fast_key(op: str, tensors: tuple, scalars: tuple, backend) -> tuple | None:
    try:
        key = [op]
        for t in tensors:
            key += (t.shape, t.dtype, t.device)
        for x in scalars:
            key += (x, type(x))  # type too: True == 1 must not pass for a bool check
        key.append(registry.selection_key(op, tensors[0].device.type, backend))
        key = tuple(key)
        hash(key)
        return key
    # not tensors, unhashable arguments, or tensors without sizes (torch.nested.nested_tensor's
    # default layout raises RuntimeError for .shape): the slow path's checks say why
    except (AttributeError, TypeError, RuntimeError):
        return None


def _layout_ok(q: torch.Tensor, others: tuple) -> bool:
    # what the slow path would hand the kernels as they are: contiguous, 16-byte aligned
    try:
        for t in (q, *others):
            if not (t.is_contiguous() and t.data_ptr() % 16 == 0):
                return False
    except RuntimeError:  # a tensor without storage (e.g. mkldnn) has no data_ptr: the slow path refuses it
        return False
    return True


def _remember(key: tuple | None, fn, scale: float, scales: tuple) -> None:
    if key is not None:
        if len(_validated) >= _VALIDATED_MAX:
            _validated.clear()
        _validated[key] = (fn, scale, scales)


def _check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens):
    """Type/shape/device rules shared by decode_attention and paged_attention (no sync)."""
    _ndim("q", q, 3, "[tokens, Hq, D]")
    _float_dtype("q", q)
    fp8 = _check_cache_dtype("q", q, k_cache, v_cache)
    _int_dtype("block_tables", block_tables)
    _int_dtype("context_lens", context_lens)
    _same_device("q", q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, context_lens=context_lens)
    num_blocks, block_size, Hkv, Dc = _check_cache_pair(k_cache, v_cache)
    _dim_eq("k_cache.shape[3] (head dim)", Dc, q.shape[2], "q and the caches share the head dim")
    _heads(q.shape[1], Hkv)
    _ndim("block_tables", block_tables, 2, "[S, max_blocks]")
    _ndim("context_lens", context_lens, 1, "[S]")
    return num_blocks, block_size, fp8


def decode_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    *,
    scale: float | None = None,
    k_scale=None,
    v_scale=None,
    return_lse: bool = False,
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
        k_scale, v_scale: for float8_e4m3fn caches only: a positive float or a float32
            tensor [] or [Hkv]; stored value x scale = real value (default 1.0).
        return_lse: also return lse float32 [B, Hq].
        check_values: verify table entries and lengths (syncs); pass False only
            when you built them yourself.

    Returns:
        o: [B, Hq, D] in q's dtype (or (o, lse)).
    """
    key = None
    if check_values is False:
        key = _fast_key("decode", (q, k_cache, v_cache, block_tables, context_lens),
                        (scale, return_lse, k_scale, v_scale), backend)
        hit = _validated.get(key) if key is not None else None
        if hit is not None and _layout_ok(q, (k_cache, v_cache, block_tables, context_lens)):
            return hit[0](q, k_cache, v_cache, block_tables, context_lens, hit[1], return_lse, *hit[2])
    q = _tensor("q", q)
    k_cache, v_cache = _tensor("k_cache", k_cache), _tensor("v_cache", v_cache)
    block_tables, context_lens = _tensor("block_tables", block_tables), _tensor("context_lens", context_lens)
    num_blocks, block_size, fp8 = _check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens)
    B, Hq, D = q.shape
    _dim_eq("block_tables.shape[0]", block_tables.shape[0], B, "one block-table row per query")
    _dim_eq("context_lens.shape[0]", context_lens.shape[0], B, "one context length per query")
    return_lse, check_values = _bool("return_lse", return_lse), _bool("check_values", check_values)
    b = _pick("decode", q.device, backend, q.dtype, D, fp8)
    scale = _scale(scale, D)
    scales = _scale_args(_kv_scale("k_scale", k_scale, fp8, k_cache, check_values),
                         _kv_scale("v_scale", v_scale, fp8, v_cache, check_values))
    if _scales_copied((k_scale, v_scale), scales):
        key = None
    if check_values:
        _check_tables(block_tables, context_lens, num_blocks, block_size)
    if B == 0:
        return _empty_result(torch.empty_like(q), (B, Hq), return_lse)
    fn = b.op("decode")
    _remember(key, fn, scale, scales)
    q = _kernel_ready(b, q)
    return fn(q, _cache_ready(b, k_cache), _cache_ready(b, v_cache), block_tables.contiguous(),
              context_lens.contiguous(), scale, return_lse, *scales)


def paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    cu_seqlens_q,
    context_lens,
    *,
    max_seqlen_q: int | None = None,
    causal: bool = True,
    scale: float | None = None,
    k_scale=None,
    v_scale=None,
    return_lse: bool = False,
    backend: str | None = None,
    check_values: bool = True,
):
    """Attention of any number of new query tokens per sequence over a paged KV cache.

    Serves chunked prefill over a cached prefix, prefix caching, speculative
    verification (q_len 2..8) and mixed batches of these and decodes in one call.

    Args:
        q: [Tq, Hq, D]: the new tokens of S sequences, packed; sequence s owns rows
            cu_seqlens_q[s]:cu_seqlens_q[s+1] (its q_len, 0 allowed).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], same dtype as q.
        block_tables: int32 [S, max_blocks]; only the first
            ceil(context_lens[s] / block_size) entries of row s are read.
        cu_seqlens_q: int32 [S + 1], starts at 0, non-decreasing, ends at Tq.
        context_lens: int32 [S], each sequence's whole KV length, its new tokens
            included (their K/V must already be in the cache, e.g. by write_kv_cache).
        max_seqlen_q: the largest q_len (computed, with a device sync, when None).
        causal: row i of a sequence with q_len rows sees key j iff
            j < context_len - q_len + i + 1; False: every j < context_len.
        scale, backend: as in `prefill_attention`.
        k_scale, v_scale: for float8_e4m3fn caches, as in `decode_attention`.
        return_lse: also return lse float32 [Tq, Hq].
        check_values: verify cu_seqlens_q, table entries and lengths (syncs); pass
            False only when you built them yourself.

    Returns:
        o: [Tq, Hq, D] in q's dtype (or (o, lse)). Rows that see no key are exact zeros.
    """
    key = None
    if check_values is False and max_seqlen_q is not None:
        key = _fast_key("paged", (q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens),
                        (max_seqlen_q, causal, scale, return_lse, k_scale, v_scale), backend)
        hit = _validated.get(key) if key is not None else None
        if hit is not None and _layout_ok(q, (k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)):
            return hit[0](q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                          min(int(max_seqlen_q), q.shape[0]), causal, hit[1], return_lse, *hit[2])
    q = _tensor("q", q)
    k_cache, v_cache = _tensor("k_cache", k_cache), _tensor("v_cache", v_cache)
    block_tables, context_lens = _tensor("block_tables", block_tables), _tensor("context_lens", context_lens)
    cu_q = _tensor("cu_seqlens_q", cu_seqlens_q)
    _int_dtype("cu_seqlens_q", cu_q)
    if cu_q.device != q.device:
        raise ValueError(f"cu_seqlens_q is on {cu_q.device} but q is on {q.device}; all tensors must share one device")
    num_blocks, block_size, fp8 = _check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens)
    _dim_eq("context_lens.shape[0]", context_lens.shape[0], block_tables.shape[0],
            "one context length per block-table row")
    _ndim("cu_seqlens_q", cu_q, 1, "[S + 1]")
    _dim_eq("len(cu_seqlens_q)", cu_q.shape[0], block_tables.shape[0] + 1,
            "S + 1 entries for the S rows of block_tables")
    Tq, Hq, D = q.shape
    causal, return_lse = _bool("causal", causal), _bool("return_lse", return_lse)
    check_values = _bool("check_values", check_values)
    max_seqlen_q = _max_len("max_seqlen_q", max_seqlen_q)
    b = _pick("paged", q.device, backend, q.dtype, D, fp8)
    scale = _scale(scale, D)
    scales = _scale_args(_kv_scale("k_scale", k_scale, fp8, k_cache, check_values),
                         _kv_scale("v_scale", v_scale, fp8, v_cache, check_values))
    if _scales_copied((k_scale, v_scale), scales):
        key = None
    if check_values or max_seqlen_q is None:
        _, real_q = _check_cu_seqlens("cu_seqlens_q", cu_q, Tq, "q")
        if max_seqlen_q is not None and max_seqlen_q < real_q:
            raise ValueError(f"max_seqlen_q={max_seqlen_q} is below the longest query sequence ({real_q})")
        max_seqlen_q = real_q if max_seqlen_q is None else max_seqlen_q
    max_seqlen_q = min(max_seqlen_q, Tq)  # past the packed total: no sequence is that long
    if check_values:
        _check_tables(block_tables, context_lens, num_blocks, block_size)
    if Tq == 0 or max_seqlen_q == 0:
        return _empty_result(torch.zeros_like(q), (Tq, Hq), return_lse)
    fn = b.op("paged")
    _remember(key, fn, scale, scales)
    q = _kernel_ready(b, q)
    return fn(q, _cache_ready(b, k_cache), _cache_ready(b, v_cache), block_tables.contiguous(), cu_q.contiguous(),
              context_lens.contiguous(), max_seqlen_q, causal, scale, return_lse, *scales)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None, backend: str | None = None,
                   check_values: bool = True) -> None:
    """Scatter new tokens' K/V into the paged caches, in place.

    Args:
        k, v: [T, Hkv, D].
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], same dtype as k; any strides
            (views of one larger tensor too), written in place.
        slot_mapping: int32 or int64 [T]; token t goes to block slot // block_size,
            offset slot % block_size. A negative slot skips its token.
        k_scale, v_scale: for float8_e4m3fn caches only (k, v float16/bfloat16): a positive
            float or a float32 tensor [] or [Hkv]; the cache stores k / k_scale rounded to
            nearest even, saturated at +-448 (default scale 1.0).
        backend: as in `prefill_attention`.
        check_values: verify slots < num_blocks * block_size (syncs).
    """
    k, v = _tensor("k", k), _tensor("v", v)
    k_cache, v_cache = _tensor("k_cache", k_cache), _tensor("v_cache", v_cache)
    slot_mapping = _tensor("slot_mapping", slot_mapping)
    _ndim("k", k, 3, "[T, Hkv, D]")
    _ndim("v", v, 3, "[T, Hkv, D]")
    _float_dtype("k", k)
    _same_dtype("k", k, v=v)
    fp8 = _check_cache_dtype("k", k, k_cache, v_cache)
    _int_dtype("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    _same_device("k", k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    num_blocks, block_size, Hkv, D = _check_cache_pair(k_cache, v_cache)
    if Hkv <= 0:
        raise ValueError(f"the caches must have at least one KV head, got shape {tuple(k_cache.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    _dim_eq("k.shape[1] (KV heads)", k.shape[1], Hkv, "k and k_cache share Hkv")
    _dim_eq("k.shape[2] (head dim)", k.shape[2], D, "k and k_cache share the head dim")
    _ndim("slot_mapping", slot_mapping, 1, "[T]")
    _dim_eq("slot_mapping.shape[0]", slot_mapping.shape[0], k.shape[0], "one slot per token")
    check_values = _bool("check_values", check_values)
    b = _pick("write_kv_cache", k.device, backend, k.dtype, D, fp8)
    scales = _scale_args(_kv_scale("k_scale", k_scale, fp8, k_cache, check_values),
                         _kv_scale("v_scale", v_scale, fp8, v_cache, check_values))
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.requires_grad:
            raise ValueError(f"{name} requires grad: a cache is written in place, outside autograd "
                             "(allocate it without requires_grad)")
        if any(st == 0 and n > 1 for st, n in zip(c.stride(), c.shape)):
            raise ValueError(f"{name} has a broadcast (stride 0) dim of shape {tuple(c.shape)}, strides "
                             f"{tuple(c.stride())}: its slots alias, so it cannot be written in place")
    if check_values and slot_mapping.numel() > 0:
        hi = int(slot_mapping.max().item())
        if hi >= num_blocks * block_size:
            raise ValueError(
                f"slot_mapping holds {hi}, outside the cache's num_blocks * block_size = {num_blocks * block_size} slots"
            )
    if k.shape[0] == 0:
        return None
    # A cache is no autograd node: K/V that require grad must not make it one (the next write would
    # refuse it).
    k, v = _kernel_ready(b, k.detach()), _kernel_ready(b, v.detach())
    # The GPU kernels take any cache strides with a stride-1 last dim (e.g. the K and V halves of
    # one [num_blocks, block_size, 2, Hkv, D] tensor); any other layout is written through a
    # contiguous copy that is copied back.
    kc, vc = (c if b.name == "torch" or c.stride(-1) == 1 or c.shape[-1] <= 1 else c.contiguous()
              for c in (k_cache, v_cache))
    # A cache allocated under inference mode is written under it too (torch refuses in-place updates
    # of inference tensors outside it). Only then, and never while torch.compile traces (which can
    # neither ask is_inference() nor take the context into a graph).
    inference = not torch.compiler.is_compiling() and (k_cache.is_inference() or v_cache.is_inference())
    with torch.inference_mode() if inference else contextlib.nullcontext():
        b.op("write_kv_cache")(k, v, kc, vc, slot_mapping.to(torch.int64).contiguous(), *scales)
        for c, written in ((k_cache, kc), (v_cache, vc)):
            if written is not c:
                c.copy_(written)
    return None


def merge_attention_states(o_a, lse_a, o_b, lse_b, *, backend: str | None = None):
    """Combine two partial attentions of the same queries over disjoint key sets.

    lse = logaddexp(lse_a, lse_b); o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b,
    in fp32. Rows where both sides saw no key (both lse -inf) give zeros and -inf.

    Args:
        o_a, o_b: [..., Hq, D], same shape, dtype and device.
        lse_a, lse_b: float32 [..., Hq] (o's shape without its last dim).
        backend: a backend name, chosen as for the other ops (argument > use_backend() >
            MINIPAGED_BACKEND > auto). "cuda" and "cuda-wmma" run the Triton merge kernel (they
            have none of their own); auto runs triton on CUDA tensors when it can run there,
            else torch.

    Returns:
        (o [..., Hq, D] in o_a's dtype, lse float32 [..., Hq]).
    """
    o_a, o_b = _tensor("o_a", o_a), _tensor("o_b", o_b)
    lse_a, lse_b = _tensor("lse_a", lse_a), _tensor("lse_b", lse_b)
    _float_dtype("o_a", o_a)
    _same_dtype("o_a", o_a, o_b=o_b)
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if x.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {x.dtype}")
    _same_device("o_a", o_a, o_b=o_b, lse_a=lse_a, lse_b=lse_b)
    if o_a.device.type not in ("cpu", "cuda"):
        raise ValueError(f"the tensors are on {o_a.device}: minipaged runs on cpu and cuda tensors")
    if o_a.dim() < 2:
        raise ValueError(f"o_a must be at least 2-D [..., Hq, D], got shape {tuple(o_a.shape)}")
    if o_b.shape != o_a.shape:
        raise ValueError(f"o_b must have the shape of o_a {tuple(o_a.shape)}, got {tuple(o_b.shape)}")
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if x.shape != o_a.shape[:-1]:
            raise ValueError(f"{name} must have shape {tuple(o_a.shape[:-1])} (o_a's shape without its last dim), "
                             f"got {tuple(x.shape)}")
    name, source = registry.requested_name(None, backend)
    if name in ("cuda", "cuda-wmma"):
        # the hand-written backends have no merge kernel of their own: theirs is Triton's
        ok, why = registry.all_backends()[name].is_available(o_a.device.type)
        if not ok:
            raise registry.BackendUnavailableError(f"backend {name!r} (from {source}) is unavailable: {why}")
        name = "triton"
    elif name == registry.AUTO:
        name = "triton" if o_a.is_cuda and registry.all_backends()["triton"].is_available("cuda")[0] else "torch"
    b = registry.all_backends()[name]
    if name == "triton":
        ok, why = b.is_available(o_a.device.type)
        if not ok:
            raise registry.BackendUnavailableError(f"backend 'triton' is unavailable on {o_a.device.type}: {why}")
        dtypes, why = b.supported_dtypes(o_a.device.type)
        if _FLOAT_DTYPES[o_a.dtype] not in dtypes:
            raise TypeError(f"backend 'triton' supports dtypes {list(dtypes)} on {o_a.device.type}, "
                            f"got {_FLOAT_DTYPES[o_a.dtype]}: {why}")
    if o_a.numel() == 0:
        # no output elements (D = 0 or no rows): the lse still has a value per row
        return torch.empty_like(o_a), torch.logaddexp(lse_a, lse_b)
    return b.ops().merge_attention_states(o_a.contiguous(), lse_a.contiguous(), o_b.contiguous(), lse_b.contiguous())
