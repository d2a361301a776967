"""Compile the batch-invariant Triton kernels for sm_90 ahead of time, without a GPU: the
pinned-tile linear (bf16, fp16, fp32 tiles of configs.invariant_linear_config), the RMSNorm
(D 1024 and 128 rows), the invariant paged-attention launch (every tile masked; unsplit and
split over key segments) and its segment reduction; report
shared memory, wgmma count and, where triton's ptxas reads its PTX, registers and spills.

    cd scripts && PYTHONPATH=../src:. python triton_invariant_sm90.py

The GPU machine runs triton 3.6: put an unpacked triton 3.6 wheel first on PYTHONPATH to see
its code (and registers: its ptxas reads its PTX).
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton_aot import ELEM, compile_sm90, compiled_info, divisible16, report_line, signature  # noqa: E402

from minipaged.triton import configs  # noqa: E402
from minipaged.triton.invariant import _linear_kernel, _rms_norm_kernel  # noqa: E402
from minipaged.triton.paged import _paged_kernel, invariant_reduce  # noqa: E402

_CUDA = torch.device("cuda")  # configs only read .type
_NO_FMA = {"enable_fp_fusion": False}  # as ops.paged launches the invariant path


def _linear(dt: str, torch_dt):
    c = configs.invariant_linear_config(torch_dt, _CUDA)
    cx = dict(HAS_BIAS=False, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=8,
              DOT_PRECISION="ieee" if dt == "fp32" else "tf32")
    types = {n: ELEM[dt] for n in ("X", "W", "Bias", "Y")}
    div = set(types) | {"N", "K", "stride_xm", "stride_wn", "stride_ym"}
    return _linear_kernel, types, cx, div, c.num_warps, c.num_stages


def _norm(block_d: int):
    cx = dict(W_ROWS=1 if block_d > 128 else 24, BLOCK_R=configs.invariant_norm_rows(block_d, _CUDA), BLOCK_D=block_d)
    types = {n: "bf16" for n in ("X", "W", "Y")}
    sig_extra = {"eps": "fp32"}
    return _rms_norm_kernel, types, cx, set(types), 4, 1, sig_extra


def _paged(head_dim: int, page: int, split: bool = False):
    c = configs.invariant_paged_config(head_dim, 2, _CUDA)
    cx = dict(HEAD_DIM=head_dim, BLOCK_M=c.block_m, BLOCK_Q=c.block_m // 2, BLOCK_N=c.block_n, PAGE=page,
              IS_CAUSAL=True, SPLIT=split, RETURN_LSE=False, GATHER=1, DOT_PRECISION="tf32", KV_FP8=False,
              MIN_Q=0, MAX_Q=0, INVARIANT_SEGMENT=configs.invariant_segment_tiles(_CUDA), HEADS_FASTEST=True)
    types = {**{n: "bf16" for n in ("Q", "O", "K_cache", "V_cache")},
             **{n: "i32" for n in ("block_tables", "cu_seqlens_q", "context_lens")},
             **{n: "fp32" for n in ("LSE", "O_partial", "LSE_partial", "K_scale", "V_scale")}}
    div = set(types) | {n for n in _paged_kernel.arg_names if n.startswith("stride_") and n != "stride_table"}
    return _paged_kernel, types, cx, div, c.num_warps, c.num_stages


def variants():
    for dt, tdt in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        yield (f"linear_{dt}", *_linear(dt, tdt), {}, {})
    for d in (1024, 128):
        fn, types, cx, div, w, s, extra = _norm(d)
        yield (f"rms_norm_d{d}", fn, types, cx, div, w, s, extra, {})
    for d, page in ((128, 16), (128, 1), (64, 256), (256, 16)):
        yield (f"paged_invariant_d{d}_p{page}", *_paged(d, page), {}, _NO_FMA)
    yield ("paged_invariant_d128_p16_split", *_paged(128, 16, True), {}, _NO_FMA)
    cx = dict(HEAD_DIM=128, BLOCK_R=16, RETURN_LSE=False)
    yield ("invariant_reduce_d128", invariant_reduce,
           {"O_partial": "fp32", "LSE_partial": "fp32", "O": "bf16", "LSE": "fp32"}, cx,
           {"O_partial", "LSE_partial", "O", "LSE"}, 4, 1, {}, _NO_FMA)


def main() -> int:
    print(f"triton {triton.__version__}, target sm_90")
    failures = 0
    for name, fn, types, cx, div, w, s, extra, options in variants():
        sig = signature(fn, cx, types)
        sig.update(extra)
        try:
            k = compile_sm90(fn, sig, cx, divisible16(fn, cx, div), w, s, **options)
        except Exception as e:  # a variant that does not compile is a result
            failures += 1
            print(f"FAIL {name}: {type(e).__name__}: {' '.join(str(e).split())[:300]}", flush=True)
            continue
        print(report_line(name, compiled_info(k, w, s)), flush=True)
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
