"""Reference points measured in the same run as our kernels: PyTorch's own
attention (SDPA flash / cuDNN / memory-efficient, compiled FlexAttention) and
the device's copy bandwidth (the ceiling for a memory-bound decode).

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

PREFILL_ANCHORS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex")
DECODE_ANCHORS = ("sdpa-flash", "sdpa-cudnn")
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
    """The anchors that exist for `op` ("prefill" / "decode") on `device`.

    The copy-bandwidth anchor is GPU-only: the quick CPU decode cases fit in the
    CPU caches, so a percentage of a DRAM copy would exceed 100% and mean nothing."""
    if device.type != "cuda":
        return CPU_ANCHORS
    return (PREFILL_ANCHORS if op == "prefill" else DECODE_ANCHORS) + ((COPY_ANCHOR,) if op == "decode" else ())


def all_anchor_names() -> list[str]:
    return sorted(set(PREFILL_ANCHORS) | set(DECODE_ANCHORS) | {COPY_ANCHOR, CPU_SDPA})


class AnchorSkipped(Exception):
    """The anchor does not exist on this device / torch build (not a failure)."""


@dataclass
class Prepared:
    fn: Callable[[], object]
    context: Callable[[], ContextManager] = field(default=contextlib.nullcontext)
    note: str = ""


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
