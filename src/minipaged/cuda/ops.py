"""The `cuda` and `cuda-wmma` backend ops (signatures: minipaged.registry).

Every function forwards to a torch custom op of the `minipaged_cuda` namespace
(schemas and CUDA kernels in csrc/binding.cpp). Arguments are trusted: api.py
has checked them (the binding keeps only the checks that guard memory). The fake (meta) implementations
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

    # Every attention op returns (o, lse): lse is float32 of q's shape without
    # its last dim when return_lse is true, else an empty placeholder.
    def _out_lse(q, return_lse):
        lse_shape = q.shape[:-1] if return_lse else (0,)
        return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)

    @torch.library.register_fake(lib + "prefill_fast")
    def _prefill_fast_fake(q, k, v, causal, scale, return_lse=False):
        return _out_lse(q, return_lse)

    @torch.library.register_fake(lib + "prefill_wmma")
    def _prefill_wmma_fake(q, k, v, causal, scale, return_lse=False):
        return _out_lse(q, return_lse)

    @torch.library.register_fake(lib + "prefill_varlen_fast")
    def _prefill_varlen_fast_fake(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, return_lse=False):
        return _out_lse(q, return_lse)

    @torch.library.register_fake(lib + "prefill_varlen_wmma")
    def _prefill_varlen_wmma_fake(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, return_lse=False):
        return _out_lse(q, return_lse)

    @torch.library.register_fake(lib + "decode")
    def _decode_fake(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=0, variant=0,
                     return_lse=False, k_scale=None, v_scale=None):
        return _out_lse(q, return_lse)

    @torch.library.register_fake(lib + "paged")
    def _paged_fake(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, causal, scale,
                    return_lse=False, num_splits=0, variant=0, k_scale=None, v_scale=None):
        return _out_lse(q, return_lse)

    @torch.library.register_fake(lib + "write_kv_cache")
    def _write_kv_cache_fake(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
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


def _result(out, return_lse):
    return out if return_lse else out[0]


def prefill(q, k, v, causal, scale, return_lse=False):
    """FA2-style prefill (mma.sync, or wgmma on sm_90). q [B,Hq,Nq,D] -> o, or (o, lse [B,Hq,Nq])."""
    return _result(_ops().prefill_fast(q, k, v, bool(causal), float(scale), return_lse), return_lse)


def prefill_wmma(q, k, v, causal, scale, return_lse=False):
    """The article's WMMA teaching kernel (launch_prefill_wmma). q [B,Hq,Nq,D]."""
    return _result(_ops().prefill_wmma(q, k, v, bool(causal), float(scale), return_lse), return_lse)


def prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, return_lse=False):
    """Varlen prefill through the fast kernels. q [Tq,Hq,D], cu_seqlens int32 [S+1] -> o, or (o, lse [Tq,Hq])."""
    out = _ops().prefill_varlen_fast(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), bool(causal), float(scale), return_lse
    )
    return _result(out, return_lse)


def prefill_varlen_wmma(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                        return_lse=False):
    """Varlen prefill through the WMMA teaching kernel."""
    out = _ops().prefill_varlen_wmma(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), bool(causal), float(scale), return_lse
    )
    return _result(out, return_lse)


def decode(q, k_cache, v_cache, block_tables, context_lens, scale, return_lse=False, k_scale=None, v_scale=None, *,
           num_splits=0, variant=0):
    """Paged decode shared by `cuda` and `cuda-wmma`. q [B,Hq,D]; caches [num_blocks,block_size,Hkv,D].

    -> o, or (o, lse [B,Hq]). float8_e4m3fn caches take k_scale/v_scale, float32
    [Hkv] (real value = stored x scale), dequantised inside the kernels.
    num_splits (0: heuristic) and variant (0: tuned tiling) exist for benchmarking. A forced
    num_splits is each sequence's most: a sequence takes min(num_splits, its length in kernel
    tiles) even runs of its own length, as the heuristic's splits do.
    """
    out = _ops().decode(q, k_cache, v_cache, block_tables, context_lens, float(scale), int(num_splits), int(variant),
                        return_lse, k_scale, v_scale)
    return _result(out, return_lse)


# paged() variant: the q_len == 1 rows of a mixed batch through the decode kernels (split-K),
# the rest through the tiled prefill kernel (csrc/prefill/dispatch.cuh, kPagedVariantDecodeRouting).
PAGED_DECODE_ROUTING = 4


def paged(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, causal, scale,
          return_lse=False, k_scale=None, v_scale=None, *, num_splits=0, variant=0):
    """Paged attention for any query length. q [Tq,Hq,D] packed by cu_seqlens_q int32 [S+1];
    caches [num_blocks,block_size,Hkv,D]; context_lens int32 [S] include the new tokens.

    -> o [Tq,Hq,D], or (o, lse [Tq,Hq]). With max_seqlen_q == 1 and one row per
    sequence it runs the decode kernels (num_splits/variant apply there as in decode).
    Short query runs (q_len 2..16, speculative verification) run the tensor-core decode kernel
    with their (query, head) pairs as its rows where max_seqlen_q x G <= 32
    (csrc/prefill/dispatch.cuh paged_spec_decode_ok), else the GQA-packed prefill kernel; both
    split their keys as decode does, and num_splits > 0 forces that count too.
    Otherwise variant (benchmarking) picks the paged paths: 0 the tuned choice, 1 never
    pack GQA groups, 2 always, 3 the newer paths forced on, PAGED_DECODE_ROUTING (4) also
    routes the q_len == 1 rows to the decode kernels (num_splits then sets their split
    count; variant 0 routes them too, since the routing became the default). Bit 0x40000 ORed
    into any of these flips the decode kernels' merge rule for the routed rows and short runs
    (csrc/decode/splits.h decode_warp_merge_by_rule), as it does in decode; bit 0x80000 flips the
    FP8 short-ring rule of the routed rows (csrc/params.h decode_fp8_short_ring_wanted).
    float8_e4m3fn caches take k_scale/v_scale as in decode.
    """
    out = _ops().paged(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, int(max_seqlen_q),
                       bool(causal), float(scale), return_lse, int(num_splits), int(variant), k_scale, v_scale)
    return _result(out, return_lse)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """Scatter k/v [T,Hkv,D] into the paged caches at slot_mapping (negative = skip). Returns None.

    float8_e4m3fn caches store e4m3(k / k_scale[h]) (v likewise): an IEEE division, rounded to
    nearest even, saturated at +-448; k_scale/v_scale float32 [Hkv].
    """
    _ops().write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


# The two registry backends (minipaged.registry loads these): `cuda` runs the
# fast prefill kernels, `cuda-wmma` the article's teaching kernel for prefill;
# both share decode, paged attention and the cache writer. Neither has a
# merge_attention_states kernel (api.py routes it to torch/triton).
from ..registry import BackendOps  # noqa: E402  (after the functions it names)

OPS = BackendOps(prefill=prefill, prefill_varlen=prefill_varlen, decode=decode, paged=paged,
                 write_kv_cache=write_kv_cache)
WMMA_OPS = BackendOps(prefill=prefill_wmma, prefill_varlen=prefill_varlen_wmma, decode=decode, paged=paged,
                      write_kv_cache=write_kv_cache)
