"""The `cuda` and `cuda-wmma` backend ops (signatures: minipaged.registry).

Every function forwards to a torch custom op of the `minipaged_cuda` namespace
(schemas and CUDA kernels in csrc/binding.cpp). The fake (meta) implementations
registered here let the ops run under torch.compile(fullgraph=True) and in CUDA
graphs: they only allocate the output, and no op syncs the host.

Importing this module on a machine with a GPU builds (once, cached) and loads
the kernels, so that tracing later never meets the build code.
"""

from __future__ import annotations

import torch

from . import build

_ready = False


def _register_fakes() -> None:
    lib = "minipaged_cuda::"

    def _like_q(q, *args, **kwargs):
        return q.new_empty(q.shape)

    for op in ("prefill_fast", "prefill_wmma", "prefill_varlen_fast", "prefill_varlen_wmma", "decode"):
        torch.library.register_fake(lib + op)(_like_q)

    @torch.library.register_fake(lib + "write_kv_cache")
    def _write_kv_cache_fake(k, v, k_cache, v_cache, slot_mapping):
        return None


def ensure_loaded() -> None:
    """Build/load the extension and register the fake implementations (idempotent)."""
    global _ready
    if _ready:
        return
    build.load()
    _register_fakes()
    _ready = True


if torch.cuda.is_available():
    ensure_loaded()


def _ops():
    if not _ready:
        ensure_loaded()
    return torch.ops.minipaged_cuda


_DTYPES = (torch.float16, torch.bfloat16)


def _check(name, x, head_dim_axis=-1):
    # Shape/dtype facts only (no device sync); api.py has checked everything
    # else. Raising here keeps the common mistakes out of the C++ layer.
    if x.dtype not in _DTYPES:
        raise TypeError(f"{name}: the cuda backends take float16 or bfloat16, got {x.dtype}")
    if x.shape[head_dim_axis] not in (64, 128):
        raise ValueError(f"{name}: head dim must be 64 or 128 on the cuda backends, got {x.shape[head_dim_axis]}")


def prefill(q, k, v, causal, scale):
    """FA2-style prefill through the mma.sync kernel (launch_prefill_fast). q [B,Hq,Nq,D]."""
    _check("q", q)
    return _ops().prefill_fast(q, k, v, bool(causal), float(scale))


def prefill_wmma(q, k, v, causal, scale):
    """The article's WMMA teaching kernel (launch_prefill_wmma). q [B,Hq,Nq,D]."""
    _check("q", q)
    return _ops().prefill_wmma(q, k, v, bool(causal), float(scale))


def prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale):
    """Varlen prefill through the mma.sync kernel. q [Tq,Hq,D], cu_seqlens int32 [S+1]."""
    _check("q", q)
    return _ops().prefill_varlen_fast(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), bool(causal), float(scale)
    )


def prefill_varlen_wmma(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale):
    """Varlen prefill through the WMMA teaching kernel."""
    _check("q", q)
    return _ops().prefill_varlen_wmma(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), bool(causal), float(scale)
    )


def decode(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=0, variant=0):
    """Paged decode shared by `cuda` and `cuda-wmma`. q [B,Hq,D]; caches [num_blocks,block_size,Hkv,D].

    num_splits (0: heuristic) and variant (0: tuned tiling) exist for benchmarking.
    """
    _check("q", q)
    return _ops().decode(q, k_cache, v_cache, block_tables, context_lens, float(scale), num_splits, variant)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping):
    """Scatter k/v [T,Hkv,D] into the paged caches at slot_mapping (negative = skip). Returns None."""
    _check("k", k)
    _ops().write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
