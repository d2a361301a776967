"""Reference points measured in the same run as our kernels: PyTorch's own
attention (SDPA flash / cuDNN / memory-efficient, compiled FlexAttention),
FlashInfer when it happens to be importable (never a dependency), and the
device's copy bandwidth (the ceiling for a memory-bound decode).

Each `prepare_*` returns a Prepared: a no-argument callable to time, a context
to enter around the timing (which SDPA backend is allowed), and a note saying
how GQA was handled. Anything that must not be timed (repeating K/V heads when
a kernel lacks GQA, building block masks, compiling) happens in prepare.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F

FI_RAGGED, FI_PAGED = "flashinfer-ragged", "flashinfer-paged"
FI_DECODE, FI_DECODE_TC = "flashinfer-decode", "flashinfer-decode-tc"
# BatchDecodeWithPagedKVCacheWrapper on a float8_e4m3fn cache (scalar k_scale/v_scale): timed
# only with --kv-cache-dtype fp8, next to the fp8 rows
FI_DECODE_FP8 = "flashinfer-decode-fp8"
FP8_ANCHORS = (FI_DECODE_FP8,)
FLASHINFER_ANCHORS = (FI_RAGGED, FI_PAGED, FI_DECODE, FI_DECODE_TC, FI_DECODE_FP8)
PREFILL_ANCHORS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex", FI_RAGGED, FI_PAGED)
DECODE_ANCHORS = ("sdpa-flash", "sdpa-cudnn", FI_DECODE, FI_DECODE_TC, FI_DECODE_FP8)
# the paged rows' own references: the same backend's dense varlen kernel on the K/V made
# contiguous, its decode kernel, and the split of a mixed batch into separate launches
SAME_BACKEND = "same-backend"
PAGED_ANCHORS = (SAME_BACKEND, "sdpa-flash", "sdpa-cudnn", FI_PAGED)
COPY_ANCHOR = "copy"
# On CPU, SDPBackend.FLASH_ATTENTION runs aten::_scaled_dot_product_flash_attention_for_cpu,
# torch's own tiled CPU kernel, not FlashAttention: the row is named for what runs.
CPU_SDPA = "sdpa-cpu"
CPU_ANCHORS = (CPU_SDPA,)

_SDPA_BACKEND_NAMES = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    CPU_SDPA: "FLASH_ATTENTION",
}


def anchors_for(op: str, device: torch.device) -> tuple[str, ...]:
    """The anchors that exist for `op` ("prefill" / "decode" / "paged") on `device`
    (FlashInfer's are listed on CUDA whether or not it imports: see flashinfer_available).

    The copy-bandwidth anchor is GPU-only: the quick CPU decode cases fit in the
    CPU caches, so a percentage of a DRAM copy would exceed 100% and mean nothing."""
    if device.type != "cuda":
        return ((SAME_BACKEND,) if op == "paged" else ()) + CPU_ANCHORS
    if op == "paged":
        return PAGED_ANCHORS
    return (PREFILL_ANCHORS if op == "prefill" else DECODE_ANCHORS) + ((COPY_ANCHOR,) if op == "decode" else ())


def all_anchor_names() -> list[str]:
    return sorted(set(PREFILL_ANCHORS) | set(DECODE_ANCHORS) | set(PAGED_ANCHORS) | {COPY_ANCHOR, CPU_SDPA})


class AnchorSkipped(Exception):
    """The anchor does not exist on this device / torch build (not a failure)."""


@dataclass
class Prepared:
    fn: Callable[[], object]
    context: Callable[[], ContextManager] = field(default=contextlib.nullcontext)
    note: str = ""
    # fn()'s result in minipaged's layout for the case (so it can be compared with a backend)
    as_ours: Callable[[object], torch.Tensor] | None = None


def _sdpa_context(name: str) -> Callable[[], ContextManager]:
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:  # torch < 2.3
        raise AnchorSkipped(f"torch.nn.attention.sdpa_kernel missing: {e}") from e
    backend = getattr(SDPBackend, _SDPA_BACKEND_NAMES[name], None)
    if backend is None:
        raise AnchorSkipped(f"SDPBackend.{_SDPA_BACKEND_NAMES[name]} missing in torch {torch.__version__}")
    return lambda: sdpa_kernel(backend)


def sdpa_available(name: str, device: torch.device) -> tuple[bool, str]:
    """sdpa-cpu is torch's CPU kernel; flash, cuDNN and memory-efficient are CUDA kernels."""
    if name not in _SDPA_BACKEND_NAMES:
        return False, f"unknown SDPA anchor {name}"
    if device.type == "cuda" and name == CPU_SDPA:
        return False, f"{CPU_SDPA} is the CPU kernel; on CUDA use sdpa-flash, sdpa-cudnn or sdpa-efficient"
    if device.type != "cuda" and name != CPU_SDPA:
        return False, f"CUDA only (on CPU the SDPA anchor is {CPU_SDPA})"
    return True, ""


def _quiet_call(ctx, fn):
    # SDPA explains a refusal with UserWarnings before raising; the error row
    # carries the RuntimeError, the warnings would only clutter the output.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ctx():
            return fn()


def prepare_sdpa_prefill(name: str, q, k, v, *, causal: bool, scale: float) -> Prepared:
    """SDPA under one kernel choice. GQA: enable_gqa=True where the kernel takes
    it, else K/V heads repeated before timing (noted)."""
    ok, why = sdpa_available(name, q.device)
    if not ok:
        raise AnchorSkipped(why)
    if q.shape[2] != k.shape[2] and causal:
        # SDPA's is_causal is top-left aligned; ours is bottom-right. The grids use Nq == Nk.
        raise AnchorSkipped("SDPA is_causal differs from bottom-right causal when Nq != Nk")
    ctx = _sdpa_context(name)
    group = q.shape[1] // k.shape[1]

    def gqa_call():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)

    kernel = "torch's CPU flash kernel, " if name == CPU_SDPA else ""
    if group == 1:
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)  # noqa: E731
        _quiet_call(ctx, fn)
        return Prepared(fn, ctx, kernel + "MHA")
    try:
        _quiet_call(ctx, gqa_call)
        return Prepared(gqa_call, ctx, kernel + "enable_gqa=True")
    except (RuntimeError, TypeError) as gqa_error:
        k_rep = k.repeat_interleave(group, dim=1)
        v_rep = v.repeat_interleave(group, dim=1)
        fn = lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=causal, scale=scale)  # noqa: E731
        try:
            _quiet_call(ctx, fn)
        except RuntimeError as e:
            raise RuntimeError(f"{e} (enable_gqa also failed: {gqa_error})") from e
        return Prepared(fn, ctx, kernel + "K/V heads repeated before timing (no enable_gqa)")


def prepare_sdpa_decode(name: str, q, k, v, *, scale: float) -> Prepared:
    """Decode as SDPA on contiguous K/V: the GQA group folded into query rows,
    q [B, Hkv, group, D] against k, v [B, Hkv, L, D], no mask."""
    ok, why = sdpa_available(name, q.device)
    if not ok:
        raise AnchorSkipped(why)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q4 = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    ctx = _sdpa_context(name)
    fn = lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale)  # noqa: E731
    _quiet_call(ctx, fn)
    kernel = "torch's CPU flash kernel, " if name == CPU_SDPA else ""
    return Prepared(fn, ctx, kernel + "contiguous KV, group folded into query rows")


def _lower_right_mask(nq: int, nk: int, device) -> torch.Tensor:
    """Boolean [Nq, Nk], True where row i may see key j: j < Nk - Nq + i + 1 (DESIGN.md)."""
    return torch.ones(nq, nk, dtype=torch.bool, device=device).tril(nk - nq)


def _flash_takes(q, k, v, enable_gqa: bool) -> bool:
    """Whether SDPA's flash kernel accepts these inputs (CausalBias would otherwise pick
    another kernel without saying so). Unknown (no such API): assume it does."""
    try:
        cuda_backends = torch.backends.cuda
        try:
            params = cuda_backends.SDPAParams(q, k, v, None, 0.0, False, enable_gqa)
        except TypeError:
            params = cuda_backends.SDPAParams(q, k, v, None, 0.0, False)
        return bool(cuda_backends.can_use_flash_attention(params, False))
    except (AttributeError, RuntimeError):
        return True


def prepare_sdpa_paged(name: str, q, k, v, *, scale: float) -> Prepared:
    """SDPA on contiguous K/V for a chunk after a cached prefix (or a few speculative
    tokens): q [B, Hq, Nq, D], k, v [B, Hkv, Nk, D], bottom-right causal.

    SDPA's is_causal is top-left aligned, so for Nq < Nk the mask is given: flash takes
    no explicit mask, so it gets torch.nn.attention.bias.causal_lower_right (whose dispatch
    calls the flash kernel itself); the other kernels get an explicit boolean mask."""
    ok, why = sdpa_available(name, q.device)
    if not ok:
        raise AnchorSkipped(why)
    nq, nk = q.shape[2], k.shape[2]
    if nq == nk:
        return prepare_sdpa_prefill(name, q, k, v, causal=True, scale=scale)
    ctx = _sdpa_context(name)
    group = q.shape[1] // k.shape[1]
    gqa = group > 1
    kernel = "torch's CPU flash kernel, " if name == CPU_SDPA else ""
    if name == "sdpa-flash":
        try:
            from torch.nn.attention.bias import causal_lower_right
        except ImportError as e:
            raise AnchorSkipped(f"flash takes no explicit mask and torch {torch.__version__} has no "
                                f"causal_lower_right: {e}") from e
        if not _flash_takes(q, k, v, gqa):
            raise AnchorSkipped("the SDPA flash kernel refuses these inputs (causal_lower_right would "
                                "silently run another kernel)")
        bias = causal_lower_right(nq, nk)
        how = "causal_lower_right bias (flash kernel)"
        kwargs = dict(attn_mask=bias, scale=scale)
    else:
        how = "explicit bottom-right boolean mask"
        kwargs = dict(attn_mask=_lower_right_mask(nq, nk, q.device), scale=scale)

    def call(kk, vv, **extra):
        return lambda: F.scaled_dot_product_attention(q, kk, vv, **kwargs, **extra)  # noqa: E731

    fn = call(k, v, **({"enable_gqa": True} if gqa else {}))
    try:
        _quiet_call(ctx, fn)
        note = kernel + how + (", enable_gqa=True" if gqa else "")
    except (RuntimeError, TypeError) as first:
        if not gqa:
            raise AnchorSkipped(f"{name} refuses a masked Nq={nq} < Nk={nk} call: {_line(first)}") from first
        k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        fn = call(k_rep, v_rep)
        try:
            _quiet_call(ctx, fn)
        except (RuntimeError, TypeError) as e:
            raise AnchorSkipped(f"{name} refuses a masked Nq={nq} < Nk={nk} call: {_line(e)} "
                                f"(with enable_gqa: {_line(first)})") from e
        note = kernel + how + ", K/V heads repeated before timing (no enable_gqa)"
    return Prepared(fn, ctx, note + "; contiguous K/V (gather not timed)")


def _line(e: BaseException, limit: int = 160) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------- FlashInfer

_fi_state: tuple | None = None
_fi_workspaces: dict[str, torch.Tensor] = {}


def _import_flashinfer():
    """(module, "") or (None, why); tried once per process."""
    global _fi_state
    if _fi_state is None:
        import os

        # FlashInfer's binding layer JIT-builds a DLPack addon at import when torch lacks the
        # DLPack C exchange API (about a minute); with the API present it is not needed
        if not (hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
                or hasattr(torch.Tensor, "__c_dlpack_exchange_api__")):
            os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
        try:
            import flashinfer

            _fi_state = (flashinfer, "")
        except Exception as e:  # noqa: BLE001 - any import failure means "no FlashInfer here"
            _fi_state = (None, f"flashinfer is not importable ({type(e).__name__}: {_line(e)})")
    return _fi_state


def flashinfer_available(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, "FlashInfer runs on CUDA only"
    mod, why = _import_flashinfer()
    return mod is not None, why


def _flashinfer(device):
    ok, why = flashinfer_available(device)
    if not ok:
        raise AnchorSkipped(why)
    return _import_flashinfer()[0]


def _fi_version(fi) -> str:
    return str(getattr(fi, "__version__", "?"))


def _fi_workspace(device) -> torch.Tensor:
    key = str(device)
    if key not in _fi_workspaces:
        # split-KV partial results live here; zeroed once, as FlashInfer asks
        _fi_workspaces[key] = torch.zeros(256 << 20, dtype=torch.uint8, device=device)
    return _fi_workspaces[key]


def release_flashinfer_workspaces() -> None:
    _fi_workspaces.clear()


def flashinfer_page_layout(block_tables, context_lens, block_size: int):
    """minipaged's block tables as FlashInfer's CSR page lists: (indptr [S+1],
    indices [indptr[-1]], last_page_len [S]), int32 on the tables' device.
    Sequence s owns pages indices[indptr[s]:indptr[s+1]], its last one holding
    last_page_len[s] tokens (0 for an empty sequence)."""
    tables = block_tables.cpu()
    lens = [int(x) for x in context_lens.cpu().tolist()]
    counts = [(n + block_size - 1) // block_size for n in lens]
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    if lens:
        indptr[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int32), 0)
    pieces = [tables[s, :c].to(torch.int32) for s, c in enumerate(counts)]
    indices = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int32)
    last = torch.tensor([n - (c - 1) * block_size if c else 0 for n, c in zip(lens, counts)], dtype=torch.int32)
    dev = block_tables.device
    return indptr.to(dev), indices.to(dev), last.to(dev)


def _fi_prefill_backends(device) -> list[str]:
    """FA3 on Hopper when the installed FlashInfer takes it, else its own default."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9:
        return ["fa3", "auto"]
    return ["auto"]


def _first_working(attempts, what: str):
    """Run (label, build) attempts in order; build() returns a Prepared after one real call.
    The note names the variant that ran and why earlier ones did not."""
    errors = []
    for label, build in attempts:
        try:
            prep = build()
            if errors:
                prep.note += " (" + "; ".join(errors) + ")"
            return prep
        except AnchorSkipped:
            raise
        except Exception as e:  # noqa: BLE001 - try the next variant, report all if none works
            errors.append(f"{label} failed: {type(e).__name__}: {_line(e)}")
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    raise RuntimeError(f"{what}: " + "; ".join(errors))


def prepare_flashinfer_paged(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, *,
                             causal: bool, scale: float, cuda_graph: bool = False) -> Prepared:
    """BatchPrefillWithPagedKVCacheWrapper on minipaged's own pages (NHD, (k, v) tuple):
    q [Tq, Hq, D] packed, bottom-right causal like ours. cuda_graph: a wrapper in
    FlashInfer's CUDA-graph mode (fixed index buffers), so the harness can capture it."""
    fi = _flashinfer(q.device)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    indptr, indices, last = flashinfer_page_layout(block_tables, context_lens, block_size)
    qo_indptr = cu_seqlens_q.to(torch.int32)
    ws = _fi_workspace(q.device)
    out = torch.empty_like(q)

    def build(backend):
        def make():
            if cuda_graph:
                w = fi.BatchPrefillWithPagedKVCacheWrapper(
                    ws, "NHD", use_cuda_graph=True, qo_indptr_buf=qo_indptr.clone(),
                    paged_kv_indptr_buf=indptr.clone(), paged_kv_indices_buf=indices.clone(),
                    paged_kv_last_page_len_buf=last.clone(), backend=backend)
            else:
                w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
            w.plan(qo_indptr, indptr, indices, last, num_q_heads, num_kv_heads, head_dim, block_size,
                   causal=causal, sm_scale=scale, q_data_type=q.dtype, kv_data_type=k_cache.dtype)
            fn = lambda: w.run(q, (k_cache, v_cache), out=out)  # noqa: E731
            fn()  # loads (or JIT-builds) the kernel before the harness' warm-up
            return Prepared(fn, note=f"FlashInfer {_fi_version(fi)} BatchPrefillWithPagedKVCacheWrapper "
                                     f"backend={backend}, the same pages"
                                     + (", CUDA-graph mode" if cuda_graph else ""))
        return make

    return _first_working([(f"backend={b}", build(b)) for b in _fi_prefill_backends(q.device)],
                          "FlashInfer paged prefill")


def prepare_flashinfer_ragged(q, k, v, *, causal: bool, scale: float) -> Prepared:
    """BatchPrefillWithRaggedKVCacheWrapper on the prefill grid's dense inputs:
    q [B, Hq, Nq, D], k, v [B, Hkv, Nk, D] repacked [B*N, H, D] before timing."""
    fi = _flashinfer(q.device)
    batch, num_q_heads, nq, head_dim = q.shape
    num_kv_heads, nk = k.shape[1], k.shape[2]

    def pack(x):
        return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]).contiguous()

    qp, kp, vp = pack(q), pack(k), pack(v)
    qo_indptr = (torch.arange(batch + 1, dtype=torch.int32) * nq).to(q.device)
    kv_indptr = (torch.arange(batch + 1, dtype=torch.int32) * nk).to(q.device)
    ws = _fi_workspace(q.device)
    out = torch.empty_like(qp)

    def build(backend):
        def make():
            w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
            w.plan(qo_indptr, kv_indptr, num_q_heads, num_kv_heads, head_dim, causal=causal, sm_scale=scale,
                   q_data_type=q.dtype, kv_data_type=k.dtype)
            fn = lambda: w.run(qp, kp, vp, out=out)  # noqa: E731
            fn()
            return Prepared(fn, note=f"FlashInfer {_fi_version(fi)} BatchPrefillWithRaggedKVCacheWrapper "
                                     f"backend={backend}, inputs packed [B*N, H, D] before timing",
                            as_ours=lambda o: o.view(batch, nq, num_q_heads, head_dim).transpose(1, 2))
        return make

    return _first_working([(f"backend={b}", build(b)) for b in _fi_prefill_backends(q.device)],
                          "FlashInfer ragged prefill")


def prepare_flashinfer_paged_prefill(q, k, v, *, causal: bool, scale: float, block_size: int = 16) -> Prepared:
    """The prefill grid's dense inputs written into scattered pages (before timing),
    then prepare_flashinfer_paged on them."""
    from .cases import cu_seqlens, paged_from_dense

    _flashinfer(q.device)
    batch, num_q_heads, nq, head_dim = q.shape
    k_cache, v_cache, tables, context_lens = paged_from_dense(k, v, block_size)
    qp = q.transpose(1, 2).reshape(-1, num_q_heads, head_dim).contiguous()
    prep = prepare_flashinfer_paged(qp, k_cache, v_cache, tables, cu_seqlens([nq] * batch, q.device),
                                    context_lens, causal=causal, scale=scale)
    prep.note += f", K/V written into scattered {block_size}-token pages before timing"
    prep.as_ours = lambda o: o.view(batch, nq, num_q_heads, head_dim).transpose(1, 2)
    return prep


def prepare_flashinfer_decode(q, k_cache, v_cache, block_tables, context_lens, *, scale: float,
                              tensor_cores: bool, cuda_graph: bool = True,
                              k_scale: float | None = None, v_scale: float | None = None) -> Prepared:
    """BatchDecodeWithPagedKVCacheWrapper on the same pages: the CUDA-core kernel
    (use_tensor_cores=False) or the tensor-core one; CUDA-graph mode so the harness
    can capture it like our decode rows. A float8_e4m3fn cache is planned with
    kv_data_type=float8_e4m3fn and run with k_scale/v_scale (FlashInfer takes one float
    each, no per-head scales)."""
    fi = _flashinfer(q.device)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    indptr, indices, last = flashinfer_page_layout(block_tables, context_lens, block_size)
    ws = _fi_workspace(q.device)
    out = torch.empty_like(q)
    scales = {}
    if k_scale is not None or v_scale is not None:
        scales = dict(k_scale=float(1.0 if k_scale is None else k_scale),
                      v_scale=float(1.0 if v_scale is None else v_scale))
        k_scale, v_scale = scales["k_scale"], scales["v_scale"]

    def build(extra):
        def make():
            kwargs = dict(use_cuda_graph=cuda_graph, use_tensor_cores=tensor_cores, **extra)
            if cuda_graph:
                kwargs.update(paged_kv_indptr_buffer=indptr.clone(), paged_kv_indices_buffer=indices.clone(),
                              paged_kv_last_page_len_buffer=last.clone())
            w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", **kwargs)
            w.plan(indptr, indices, last, num_q_heads, num_kv_heads, head_dim, block_size,
                   pos_encoding_mode="NONE", sm_scale=scale, q_data_type=q.dtype, kv_data_type=k_cache.dtype)
            fn = lambda: w.run(q, (k_cache, v_cache), out=out, **scales)  # noqa: E731
            fn()
            return Prepared(fn, note=f"FlashInfer {_fi_version(fi)} BatchDecodeWithPagedKVCacheWrapper "
                                     f"use_tensor_cores={tensor_cores}"
                                     + (f" backend={extra['backend']}" if extra else "") + ", the same pages"
                                     + (f", fp8 KV, scalar k_scale={k_scale:.4g} v_scale={v_scale:.4g}"
                                        if scales else ""))
        return make

    # backend="fa2" keeps the wrapper on the kernels the tensor-core flag selects (no other
    # vendor path); an older FlashInfer without the keyword gets its default
    return _first_working([("backend=fa2", build({"backend": "fa2"})), ("default backend", build({}))],
                          "FlashInfer decode")


_compiled_flex = None


def flex_available(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, "compiled FlexAttention is timed on CUDA only"
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError as e:
        return False, f"torch {torch.__version__} has no FlexAttention: {e}"
    return True, ""


def prepare_flex_prefill(q, k, v, *, causal: bool, scale: float) -> Prepared:
    """torch.compile'd flex_attention (static shapes: one compile per shape, done
    here by a first call) with a causal block mask, GQA via enable_gqa=True."""
    ok, why = flex_available(q.device)
    if not ok:
        raise AnchorSkipped(why)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _compiled_flex
    if _compiled_flex is None:
        # static shapes: one specialised kernel per grid shape; lift dynamo's
        # recompile cap (8 by default) so a longer grid never falls back to eager
        import torch._dynamo

        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(64, getattr(torch._dynamo.config, knob)))
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    nq, nk = q.shape[2], k.shape[2]
    block_mask = None
    if causal:
        offset = nk - nq

        def bottom_right_causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + offset

        block_mask = create_block_mask(bottom_right_causal, B=None, H=None,
                                       Q_LEN=nq, KV_LEN=nk, device=q.device)
    group = q.shape[1] // k.shape[1]
    kwargs = dict(block_mask=block_mask, scale=scale)
    if group > 1:
        kwargs["enable_gqa"] = True
    fn = lambda: _compiled_flex(q, k, v, **kwargs)  # noqa: E731
    fn()  # compile now, so the harness' warm-up is not the compile
    return Prepared(fn, contextlib.nullcontext, "torch.compile(flex_attention), causal block mask"
                    + (", enable_gqa=True" if group > 1 else ""))


def copy_buffer_bytes(device: torch.device) -> int:
    """1 GiB on a GPU (far past L2); 64 MiB elsewhere (the runner times copy on CUDA only)."""
    return (1 << 30) if device.type == "cuda" else (64 << 20)


def prepare_copy(device: torch.device, num_bytes: int | None = None) -> tuple[Prepared, int]:
    """A device-to-device copy of num_bytes; returns (prepared, bytes moved = read + written)."""
    num_bytes = num_bytes or copy_buffer_bytes(device)
    src = torch.empty(num_bytes // 4, dtype=torch.int32, device=device).random_()
    dst = torch.empty_like(src)
    fn = lambda: dst.copy_(src)  # noqa: E731
    return Prepared(fn, contextlib.nullcontext, f"{num_bytes >> 20} MiB copy_"), 2 * num_bytes
