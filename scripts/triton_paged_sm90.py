"""Compile the Triton paged-attention kernels for sm_90 ahead of time, without a GPU, and
report per variant: shared memory, registers and spills (ptxas -v), wgmma / cp.async
counts, and the SASS length of each loop (the unmasked and masked KV loops; needs the
nvdisasm that ships with triton). The dense prefill kernel (prefill._attn_fwd, its sm_90
tile) is compiled alongside as the yardstick of the long-chunk loop.

    PYTHONPATH=src python scripts/triton_paged_sm90.py [--only SUBSTR] [--dump DIR]

Registers need ptxas that reads triton's PTX: triton 3.6 (the GPU machine's) brings one;
run with an unpacked 3.6 wheel first on PYTHONPATH. Under a triton whose PTX is newer than
every ptxas at hand the register columns stay empty.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton_aot import ELEM, compile_sm90, compiled_info, divisible16, kv_in_flight, report_line, signature  # noqa: E402

from minipaged.triton.paged import _paged_kernel, _paged_long_kernel  # noqa: E402
from minipaged.triton.prefill import _attn_fwd  # noqa: E402

_DATA = ("Q", "O", "K", "V")
_CACHE = ("K_cache", "V_cache")
_I32 = ("block_tables", "cu_seqlens_q", "context_lens", "cu_seqlens_k")
_F32 = ("LSE", "O_partial", "LSE_partial", "K_scale", "V_scale")


def compile_one(fn, q_dt, kv_dt, cx, num_warps, num_stages, **options):
    types = {**{n: ELEM[q_dt] for n in _DATA}, **{n: ELEM[kv_dt] for n in _CACHE},
             **{n: "i32" for n in _I32}, **{n: "fp32" for n in _F32}}
    # what the launcher sees for the benchmark's tensors: 16-byte aligned pointers, strides
    # divisible by 16 except the block-table row (max_blocks is any number)
    div = set(types) | {n for n in fn.arg_names if n.startswith("stride_") and n != "stride_table"}
    return compile_sm90(fn, signature(fn, cx, types), cx, divisible16(fn, cx, div), num_warps, num_stages, **options)


def variants():
    """(name, fn, q dtype, cache dtype, constexprs, warps, stages[, compile options]): what ops.paged launches
    for the benchmark's heads (Hq/Hkv/D 16/8/128) and the A/B script's alternatives."""
    out = [("dense_varlen_causal", _attn_fwd, "bf16", "bf16",
            dict(IS_VARLEN=True, IS_CAUSAL=True, HEAD_DIM=128, BLOCK_M=128, BLOCK_N=64, DOT_PRECISION="tf32",
                 RETURN_LSE=False), 8, 3)]
    v1 = dict(HEAD_DIM=128, BLOCK_M=128, BLOCK_Q=64, BLOCK_N=64, IS_CAUSAL=True, SPLIT=False, RETURN_LSE=False,
              GATHER=2, DOT_PRECISION="tf32", KV_FP8=False, MIN_Q=0, MAX_Q=0)
    v2 = dict(HEAD_DIM=128, BLOCK_M=128, BLOCK_Q=64, BLOCK_N=64, STRIDE_TOK=8 * 128, IS_CAUSAL=True, SPLIT=False,
              RETURN_LSE=False, DOT_PRECISION="tf32", KV_FP8=False, DIRECT=True, SEARCH=128, MIN_Q=0, PREFETCH=True,
              HEADS_FASTEST=True)
    for page in (1, 16, 128):
        out.append((f"v1_long_p{page}", _paged_kernel, "bf16", "bf16", dict(v1, PAGE=page), 8, 3))
        out.append((f"v2_long_p{page}", _paged_long_kernel, "bf16", "bf16", dict(v2, PAGE=page), 8, 3))
        out.append((f"v2_long_p{page}_noprefetch", _paged_long_kernel, "bf16", "bf16",
                    dict(v2, PAGE=page, PREFETCH=False), 8, 3))
    # what a mixed batch runs: the long launch over the compact tile space skipping short
    # sequences, and the packed short launch skipping long ones
    out.append(("v2_mixed_long_p16", _paged_long_kernel, "bf16", "bf16", dict(v2, PAGE=16, DIRECT=False, MIN_Q=8),
                8, 3))
    out.append(("v1_mixed_short_p16", _paged_kernel, "bf16", "bf16",
                dict(v1, PAGE=16, BLOCK_M=16, BLOCK_Q=8, GATHER=1, MAX_Q=8), 4, 2))
    out.append(("v1_spec_p16", _paged_kernel, "bf16", "bf16", dict(v1, PAGE=16, BLOCK_M=16, BLOCK_Q=8, GATHER=1,
                                                                   SPLIT=True), 4, 2))
    # the A/B script's alternative long tiles, split-KV with lse, non-causal, fp16, fp8 caches
    out.append(("v2_long_p16_bn128_s2", _paged_long_kernel, "bf16", "bf16", dict(v2, PAGE=16, BLOCK_N=128), 8, 2))
    out.append(("v2_long_p16_bn32_s4", _paged_long_kernel, "bf16", "bf16", dict(v2, PAGE=16, BLOCK_N=32), 8, 4))
    out.append(("v2_long_p16_s4", _paged_long_kernel, "bf16", "bf16", dict(v2, PAGE=16), 8, 4))
    out.append(("v2_long_p16_w4_bm64", _paged_long_kernel, "bf16", "bf16",
                dict(v2, PAGE=16, BLOCK_M=64, BLOCK_Q=32), 4, 3))
    out.append(("v2_long_p16_split_lse", _paged_long_kernel, "bf16", "bf16",
                dict(v2, PAGE=16, SPLIT=True, RETURN_LSE=True), 8, 3))
    out.append(("v2_long_p16_full", _paged_long_kernel, "bf16", "bf16", dict(v2, PAGE=16, IS_CAUSAL=False), 8, 3))
    out.append(("v2_long_p16_fp16", _paged_long_kernel, "fp16", "fp16", dict(v2, PAGE=16), 8, 3))
    out.append(("v2_long_p16_fp8", _paged_long_kernel, "bf16", "fp8", dict(v2, PAGE=16, KV_FP8=True), 8, 3))
    out.append(("v2_long_p16_fp8_f16", _paged_long_kernel, "bf16", "fp8", dict(v2, PAGE=16, KV_FP8=True, FP8_F16=True),
                8, 3))
    out.append(("v2_long_p64_d64", _paged_long_kernel, "bf16", "bf16",
                dict(v2, PAGE=64, HEAD_DIM=64, STRIDE_TOK=8 * 64), 8, 3))
    # FP8 pages' own 16-row packed tile (configs._PACKED_NARROW_FP8_SM90_D128: 64 keys, 4 warps,
    # 3 stages, capped at 128 registers) in what ops.paged launches with it: v2 over pages of 1,
    # 16 and 128, split with lse (decodes at small batch), non-causal, an fp16 q (which widens
    # instead of converting to fp16), and v1 (caches whose layout v2 cannot take)
    fp8_packed = dict(v2, BLOCK_M=16, BLOCK_Q=8, BLOCK_N=64, KV_FP8=True, FP8_F16=True, PAGE=16)
    cap = {"maxnreg": 128}
    for page in (1, 16, 128):
        out.append((f"fp8_packed_p{page}", _paged_long_kernel, "bf16", "fp8", dict(fp8_packed, PAGE=page), 4, 3, cap))
    out.append(("fp8_packed_split_lse", _paged_long_kernel, "bf16", "fp8",
                dict(fp8_packed, SPLIT=True, RETURN_LSE=True), 4, 3, cap))
    out.append(("fp8_packed_full", _paged_long_kernel, "bf16", "fp8", dict(fp8_packed, IS_CAUSAL=False), 4, 3, cap))
    out.append(("fp8_packed_fp16", _paged_long_kernel, "fp16", "fp8", dict(fp8_packed, FP8_F16=False), 4, 3, cap))
    out.append(("fp8_packed_v1_split", _paged_kernel, "bf16", "fp8",
                dict(v1, PAGE=16, BLOCK_M=16, BLOCK_Q=8, BLOCK_N=64, GATHER=1, KV_FP8=True, SPLIT=True), 4, 3, cap))
    return out


# The 16-row packed tile (decodes and speculative runs, configs._PACKED_NARROW_SM90_D128) through
# the long-chunk loop, by the K/V bytes it keeps in flight: (cache, BLOCK_N, stages, maxnreg or None).
# "fp8" is the default FP8 mode under a bf16 q (configs.paged_fp8_f16: fp16 dots).
PACKED_INFLIGHT_TILES = [
    ("bf16", 32, 3, None), ("bf16", 32, 5, None), ("bf16", 64, 3, None),
    ("fp8", 32, 3, None), ("fp8", 32, 5, None), ("fp8", 64, 3, None), ("fp8", 64, 3, 128), ("fp8", 64, 4, 128),
]


def packed_inflight() -> int:
    """Registers, spills, shared memory, loop lengths, K/V buffers (from the TTGIR) and K/V bytes
    in flight per SM of the packed tiles in PACKED_INFLIGHT_TILES (Hq/Hkv/D 16/8/128, page 16)."""
    failures = 0
    for kv, bn, stages, cap in PACKED_INFLIGHT_TILES:
        cx = dict(HEAD_DIM=128, BLOCK_M=16, BLOCK_Q=8, BLOCK_N=bn, STRIDE_TOK=8 * 128, IS_CAUSAL=True, SPLIT=False,
                  RETURN_LSE=False, DOT_PRECISION="tf32", KV_FP8=kv == "fp8", FP8_F16=kv == "fp8", DIRECT=True,
                  SEARCH=128, MIN_Q=0, PREFETCH=True, HEADS_FASTEST=True, PAGE=16)
        name = f"packed16 {kv} {bn}x4x{stages}" + (f" maxnreg {cap}" if cap else "")
        try:
            k = compile_one(_paged_long_kernel, "bf16", kv, cx, 4, stages, **({"maxnreg": cap} if cap else {}))
        except Exception as e:  # a tile that does not compile is a result
            failures += 1
            print(f"FAIL {name}: {type(e).__name__}: {' '.join(str(e).split())[:300]}", flush=True)
            continue
        info = compiled_info(k, 4, stages, loops=True)
        inflight = kv_in_flight(k, info.get("regs"), 4, bn, "f8E4M3FN" if kv == "fp8" else "bf16",
                                bn * 128 * 2 * (1 if kv == "fp8" else 2))
        print(f"{report_line(name, info)} {inflight}", flush=True)
    return failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="substring of the variant names")
    ap.add_argument("--dump", help="write <name>.ttgir/.ptx here")
    ap.add_argument("--inflight", action="store_true", help="only the packed tiles of PACKED_INFLIGHT_TILES")
    args = ap.parse_args(argv)
    print(f"triton {triton.__version__}, target sm_90")
    if args.inflight:
        return 1 if packed_inflight() else 0
    failures = 0
    for name, fn, q_dt, kv_dt, cx, w, s, *opts in variants():
        if args.only and args.only not in name:
            continue
        try:
            k = compile_one(fn, q_dt, kv_dt, cx, w, s, **(opts[0] if opts else {}))
        except Exception as e:  # a variant that does not compile is a result
            failures += 1
            print(f"FAIL {name}: {type(e).__name__}: {' '.join(str(e).split())[:300]}", flush=True)
            continue
        print(report_line(name, compiled_info(k, w, s, loops=True)), flush=True)
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            for ext in ("ttgir", "ptx"):
                with open(os.path.join(args.dump, f"{name}.{ext}"), "w") as f:
                    f.write(k.asm[ext])
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
