"""Compile the Triton prefill kernels for sm_90 ahead of time, without a GPU, and report
what the backend made of them: whether it compiled, shared memory, spills (from ptxas),
and which Hopper instructions the PTX holds (TMA `cp.async.bulk.tensor`, `wgmma`,
`setmaxnreg` / warp-specialised partitions).

    PYTHONPATH=src python scripts/triton_sm90_compile.py [--dump DIR] [--only NAME]

Run it with the triton the GPU machine has as well (an unpacked wheel first on
PYTHONPATH) to catch compile errors before they cost device time.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton_aot import SM90_MAX_SHARED, compile_sm90, divisible16, ptxas_usage, sass_loops, signature  # noqa: E402

from minipaged.triton.prefill import _attn_fwd  # noqa: E402
from minipaged.triton.prefill_tma import _attn_fwd_tma  # noqa: E402

_PTRS = ("Q", "K", "V", "O", "LSE", "cu_seqlens_q", "cu_seqlens_k")


def compile_one(fn, dtype: str, constexprs: dict, num_warps: int, num_stages: int):
    types = {**{n: dtype for n in ("Q", "K", "V", "O")}, "LSE": "fp32",
             **{n: "i32" for n in fn.arg_names if n.startswith("cu_seqlens")}}
    # what the launcher's specialisation sees for contiguous 16-bit tensors: 16-byte aligned
    # pointers and strides divisible by 16 (a zero varlen batch stride is too); lengths and
    # head counts stay unspecialised
    div16 = set(_PTRS) | {n for n in fn.arg_names if n.startswith("stride_")}
    return compile_sm90(fn, signature(fn, constexprs, types), constexprs, divisible16(fn, constexprs, div16),
                        num_warps, num_stages)


def summarize(k) -> dict:
    ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
    return {
        "shared": k.metadata.shared,
        "num_warps": k.metadata.num_warps,
        "tma_load": len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::(?:cluster|cta)\.global", ptx)),
        "tma_store": len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)),
        "tensormap_create": len(re.findall(r"tensormap\.replace", ptx)),
        "cp_async_16": len(re.findall(r"cp\.async\.cg\.shared\.global", ptx)),
        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "setmaxnreg": len(re.findall(r"setmaxnreg", ptx)),
        "ttg.warp_specialize": ttgir.count("ttg.warp_specialize"),
        "mbarrier_wait": len(re.findall(r"mbarrier\.try_wait", ptx)),
    }


def variants():
    """(name, fn, dtype, constexprs, num_warps, num_stages): the tiles configs.py can pick."""
    out = []
    for dt in ("bf16", "fp16"):
        for d in (64, 128):
            for causal in (True, False):
                for varlen in (False, True):
                    base = dict(IS_VARLEN=varlen, IS_CAUSAL=causal, HEAD_DIM=d, DOT_PRECISION="tf32",
                                RETURN_LSE=False)
                    tag = f"{dt}_d{d}_{'causal' if causal else 'full'}_{'varlen' if varlen else 'dense'}"
                    out.append((f"pointer_{tag}", _attn_fwd, dt, dict(base, BLOCK_M=128, BLOCK_N=64), 8, 3))
                    for bn, w, s in ((64, 8, 3), (128, 8, 2)):
                        out.append((f"tma_{tag}_bn{bn}_w{w}_s{s}", _attn_fwd_tma, dt,
                                    dict(base, BLOCK_M=128, BLOCK_N=bn, WARP_SPECIALIZE=False), w, s))
                    # warp specialisation wants num_warps=4 (one warpgroup, which the pass turns
                    # into a producer and two consumers: 12 warps)
                    for bn, w, s in ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3)):
                        out.append((f"tma_ws_{tag}_bn{bn}_w{w}_s{s}", _attn_fwd_tma, dt,
                                    dict(base, BLOCK_M=128, BLOCK_N=bn, WARP_SPECIALIZE=True), w, s))
    # configs.prefill_lazy_rescale (the rescale skipped on tiles where no row's max grew by > 2^8)
    base = dict(IS_VARLEN=False, IS_CAUSAL=True, HEAD_DIM=128, DOT_PRECISION="tf32", RETURN_LSE=False,
                BLOCK_M=128, BLOCK_N=64)
    out.append(("pointer_lazy8_bf16_d128_causal_dense", _attn_fwd, "bf16", dict(base, LAZY_RESCALE=8), 8, 3))
    # lse on, once per kernel
    base = dict(IS_VARLEN=True, IS_CAUSAL=True, HEAD_DIM=128, DOT_PRECISION="tf32", RETURN_LSE=True,
                BLOCK_M=128, BLOCK_N=128)
    out.append(("tma_lse_bf16_d128_causal_varlen", _attn_fwd_tma, "bf16", dict(base, WARP_SPECIALIZE=False), 8, 2))
    out.append(("tma_ws_lse_bf16_d128_causal_varlen", _attn_fwd_tma, "bf16", dict(base, WARP_SPECIALIZE=True), 4, 2))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", help="write <name>.ttgir/.ptx here")
    ap.add_argument("--only", help="substring of the variant names to compile")
    ap.add_argument("--ptxas", action="store_true", help="also registers and spills from ptxas -v")
    args = ap.parse_args(argv)
    print(f"triton {triton.__version__}, target sm_90")
    failures = 0
    for name, fn, dt, cx, w, s in variants():
        if args.only and args.only not in name:
            continue
        try:
            k = compile_one(fn, dt, cx, w, s)
        except Exception as e:  # a variant that does not compile is a result
            failures += 1
            msg = str(e).strip().splitlines()
            print(f"FAIL {name}: {type(e).__name__}: {msg[0][:200] if msg else ''}", flush=True)
            if os.environ.get("VERBOSE"):
                traceback.print_exc()
            continue
        info = summarize(k)
        info["sass_loops"] = sass_loops(k.asm["cubin"]) if "cubin" in k.asm else []
        if args.ptxas:
            info.update(ptxas_usage(k.asm["ptx"]))
        status = "ok  " if info["shared"] <= SM90_MAX_SHARED else "SMEM"
        print(f"{status} {name}: " + " ".join(f"{a}={b}" for a, b in info.items()), flush=True)
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            for ext in ("ttgir", "ptx"):
                with open(os.path.join(args.dump, f"{name}.{ext}"), "w") as f:
                    f.write(k.asm[ext])
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
