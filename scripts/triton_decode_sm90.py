"""Compile the Triton decode kernels (decode._decode_kernel, decode._decode_reduce) for
sm_90 ahead of time, without a GPU: the plain decode specialisations and the packed-query
ones that ops.paged's mixed mode "decode" launches, and the work-list ones. Reports shared
memory, registers and spills (ptxas -v, the ptxas bundled with triton), the SASS loops, the
spill instructions in each loop, and where the second global load is issued (the prologue's
length before a program's first data load past its context length); with --same-as REV,
whether the plain specialisations compile to the same PTX and TTGIR as decode.py at git
revision REV (line info off, so only the code counts).

    PYTHONPATH=src python scripts/triton_decode_sm90.py [--same-as HEAD~1] [--dump DIR] [--inflight]

Run it with the GPU machine's triton as well (an unpacked 3.6 wheel first on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
# the comparison is of code: source line numbers move with any edit of decode.py
os.environ["TRITON_DISABLE_LINE_INFO"] = "1"

import triton  # noqa: E402
from triton_aot import (  # noqa: E402
    ELEM,
    compile_sm90,
    divisible16,
    kv_in_flight,
    ptxas_usage,
    sass_loops,
    sass_report,
    signature,
)

from minipaged.triton import decode  # noqa: E402

_I32 = ("block_tables", "context_lens", "cu_seqlens_q")
_F32 = ("LSE", "O_partial", "LSE_partial", "K_scale", "V_scale")


def _compile(fn, q_dt, kv_dt, cx, warps, stages, **options):
    if "cu_seqlens_q" in fn.arg_names and not cx.get("PACKED_Q"):
        # what a plain launch passes: nothing, so the defaults (None is a compile-time constant)
        cx = dict(cx, cu_seqlens_q=None, PACKED_Q=False)
    if fn is decode._decode_reduce and "context_lens" in fn.arg_names and not cx.get("WORKLIST"):
        cx = dict(cx, context_lens=None)  # the same for the merge's work-list plan
    types = {"Q": ELEM[q_dt], "O": ELEM[q_dt], "K_cache": ELEM[kv_dt], "V_cache": ELEM[kv_dt],
             **{n: "i32" for n in _I32}, **{n: "fp32" for n in _F32}}
    # 16-byte aligned pointers and strides divisible by 16, except the block-table row
    div = set(types) | {n for n in fn.arg_names if n.startswith("stride_") and n != "stride_table"}
    return compile_sm90(fn, signature(fn, cx, types), cx, divisible16(fn, cx, div), warps, stages, **options)


def variants(plain_only: bool = False):
    """(name, fn, q dtype, cache dtype, constexprs, warps, stages[, compile options]): the sm_90 decode tile
    (configs.decode_config: BLOCK_N 64, 4 warps, 2 stages) at the benchmark's heads."""
    k, r = decode._decode_kernel, decode._decode_reduce
    base = dict(HEAD_DIM=128, BLOCK_H=16, BLOCK_N=64, PAGE=16, SPLIT=False, DOT_PRECISION="tf32",
                RETURN_LSE=False, KV_FP8=False)
    out = [
        ("plain", k, "bf16", "bf16", dict(base), 4, 2),
        ("plain_split_lse", k, "bf16", "bf16", dict(base, SPLIT=True, RETURN_LSE=True), 4, 2),
        ("plain_fp8", k, "bf16", "fp8", dict(base, KV_FP8=True), 4, 2),
        ("plain_p1_fp16", k, "fp16", "fp16", dict(base, PAGE=1), 4, 2),
        ("plain_d64_p128", k, "bf16", "bf16", dict(base, HEAD_DIM=64, PAGE=128), 4, 2),
        ("reduce", r, "bf16", "bf16", dict(HEAD_DIM=128, SPLITS_POW2=4, RETURN_LSE=True), 4, 1),
    ]
    if not plain_only:
        out += [
            ("packed", k, "bf16", "bf16", dict(base, PACKED_Q=True), 4, 2),
            ("packed_lse", k, "bf16", "bf16", dict(base, RETURN_LSE=True, PACKED_Q=True), 4, 2),
            ("packed_split_lse", k, "bf16", "bf16", dict(base, SPLIT=True, RETURN_LSE=True, PACKED_Q=True), 4, 2),
            ("packed_fp8_split", k, "bf16", "fp8", dict(base, KV_FP8=True, SPLIT=True, PACKED_Q=True), 4, 2),
            # configs.decode_fp8_f16: the fp8 rows' dots in fp16 (K/V widened e4m3 -> fp16 only)
            ("plain_fp8_f16", k, "bf16", "fp8", dict(base, KV_FP8=True, FP8_F16=True), 4, 2),
            ("packed_fp8_f16_split", k, "bf16", "fp8", dict(base, KV_FP8=True, SPLIT=True, PACKED_Q=True,
                                                           FP8_F16=True), 4, 2),
            # configs.decode_fp8_words: the full tiles read as int32 words, widened by cvt
            ("plain_fp8_words", k, "bf16", "fp8", dict(base, KV_FP8=True, FP8_F16=True, FP8_WORDS=True,
                                                       HW_CVT=True), 4, 2),
            ("packed_fp8_words_split", k, "bf16", "fp8", dict(base, KV_FP8=True, SPLIT=True, PACKED_Q=True,
                                                              FP8_F16=True, FP8_WORDS=True, HW_CVT=True), 4, 2),
            # FP8_WORDS=2: the words widened into four column planes, four dots of D / 4 per product
            ("plain_fp8_planes", k, "bf16", "fp8", dict(base, KV_FP8=True, FP8_F16=True, FP8_WORDS=2, HW_CVT=True),
             4, 2),
            ("packed_fp8_planes_split", k, "bf16", "fp8", dict(base, KV_FP8=True, SPLIT=True, PACKED_Q=True,
                                                               FP8_F16=True, FP8_WORDS=2, HW_CVT=True), 4, 2),
            # configs.decode_config's sm_90 FP8 tile: ids ahead, 3 stages, 128 registers; with the
            # planes, and the fp16-dot loop a misaligned cache falls back to
            *[(f"sm90_fp8_{name}", k, q_dt, "fp8", dict(base, KV_FP8=True, FP8_F16=True, TABLE_AHEAD=True,
                                                       **{"HW_CVT": True, **cx}), 4, 3, {"maxnreg": 128})
              for name, q_dt, cx in (("planes", "bf16", dict(FP8_WORDS=2)),
                                     ("planes_split_lse", "bf16", dict(FP8_WORDS=2, SPLIT=True, RETURN_LSE=True)),
                                     ("planes_fp16_p1", "fp16", dict(FP8_WORDS=2, PAGE=1)),
                                     ("f16_split_lse", "bf16", dict(FP8_WORDS=0, HW_CVT=False, SPLIT=True,
                                                                   RETURN_LSE=True)))],
            # its batched 16-bit tile: 32 keys, ids ahead, 3 stages, 102 registers
            *[(f"sm90_batched_{name}", k, q_dt, q_dt, dict(base, BLOCK_N=32, TABLE_AHEAD=True, **cx), 4, 3,
               {"maxnreg": 102})
              for name, q_dt, cx in (("plain", "bf16", {}), ("split_lse", "bf16", dict(SPLIT=True, RETURN_LSE=True)),
                                     ("fp16_p1", "fp16", dict(PAGE=1)))],
            # configs.decode_worklist: the batched tile and the FP8 planes tile over a work list of
            # up to 64 sequences, and its merge in chunks of 16
            ("worklist_batched_lse", k, "bf16", "bf16", dict(base, BLOCK_N=32, TABLE_AHEAD=True, SPLIT=True,
                                                             RETURN_LSE=True, WORKLIST=True, BLOCK_B=64), 4, 3,
             {"maxnreg": 102}),
            ("worklist_fp8_planes", k, "bf16", "fp8", dict(base, KV_FP8=True, FP8_F16=True, TABLE_AHEAD=True,
                                                           HW_CVT=True, FP8_WORDS=2, SPLIT=True, WORKLIST=True,
                                                           BLOCK_B=64), 4, 3, {"maxnreg": 128}),
            ("worklist_reduce", r, "bf16", "bf16", dict(HEAD_DIM=128, SPLITS_POW2=16, RETURN_LSE=True, WORKLIST=True,
                                                        BLOCK_B=64, BLOCK_N=32), 4, 1),
            ("packed_p1_fp16", k, "fp16", "fp16", dict(base, PAGE=1, PACKED_Q=True), 4, 2),
            ("packed_reduce", r, "bf16", "bf16", dict(HEAD_DIM=128, SPLITS_POW2=4, RETURN_LSE=True, PACKED_Q=True),
             4, 1),
        ]
    return out


def _ptxas(ptx: str) -> dict:
    # triton's own ptxas, else the toolkit's; a PTX newer than both leaves the columns empty
    usage = ptxas_usage(ptx, toolkit_fallback=True)
    return usage if usage.get("regs") is not None else {"regs": "n/a (no ptxas reads this PTX version)"}


def emit(out_dir: str, plain_only: bool) -> int:
    os.makedirs(out_dir, exist_ok=True)
    failures = 0
    for name, fn, q_dt, kv_dt, cx, w, s, *options in variants(plain_only):
        try:
            k = _compile(fn, q_dt, kv_dt, cx, w, s, **(options[0] if options else {}))
        except Exception as e:  # a variant that does not compile is a result
            failures += 1
            print(f"FAIL {name}: {type(e).__name__}: {' '.join(str(e).split())[:300]}", flush=True)
            continue
        for ext in ("ptx", "ttgir"):
            with open(os.path.join(out_dir, f"{name}.{ext}"), "w") as f:
                f.write(k.asm[ext])
        info = {"shared": k.metadata.shared, **_ptxas(k.asm["ptx"]), **sass_report(k.asm["cubin"])}
        print(f"ok   {name}: " + " ".join(f"{a}={b}" for a, b in info.items()), flush=True)
    return failures


def same_as(rev: str, here: str) -> int:
    """Compile the plain variants from decode.py at `rev` (in a child process, over a copy
    of the package) and compare them with those just emitted under `here`."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()
    old = subprocess.run(["git", "show", f"{rev}:src/minipaged/triton/decode.py"], capture_output=True, text=True,
                         check=True, cwd=root).stdout
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(os.path.join(root, "src", "minipaged"), os.path.join(tmp, "src", "minipaged"))
        with open(os.path.join(tmp, "src", "minipaged", "triton", "decode.py"), "w") as f:
            f.write(old)
        env = dict(os.environ)
        # the same triton as this process, then the old package
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(triton.__file__)),
                                             os.path.join(tmp, "src")])
        there = os.path.join(tmp, "out")
        res = subprocess.run([sys.executable, os.path.abspath(__file__), "--emit", there, "--plain-only"], env=env,
                             capture_output=True, text=True)
        if res.returncode:
            print(res.stdout + res.stderr)
            return 1
        diffs = 0
        for name, *_ in variants(plain_only=True):
            for ext in ("ptx", "ttgir"):
                with open(os.path.join(here, f"{name}.{ext}")) as a, open(os.path.join(there, f"{name}.{ext}")) as b:
                    same = a.read() == b.read()
                diffs += not same
                print(f"{'same' if same else 'DIFF'} {name}.{ext} as at {rev}")
    return diffs


# Decode tiles by the K/V bytes they keep in flight: (cache, BLOCK_N, warps, stages, maxnreg or
# None, TABLE_AHEAD). With the block ids read in the same iteration (TABLE_AHEAD off, the
# default) the software pipeliner gives the K/V loads one buffer whatever num_stages says; read
# a tile ahead, num_stages - 1. "fp8" is the default FP8 mode (four planes, decode_fp8_words 2).
INFLIGHT_TILES = [
    ("bf16", 64, 4, 2, None, False), ("bf16", 64, 4, 3, None, True),
    ("fp8", 64, 4, 2, None, False), ("fp8", 64, 4, 3, None, False), ("fp8", 64, 4, 2, 102, False),
    ("fp8", 128, 4, 2, None, False), ("fp8", 128, 4, 2, 168, False), ("fp8", 128, 4, 2, 128, False),
    ("fp8", 128, 4, 3, 168, False), ("fp8", 128, 8, 2, None, False),
    ("fp8", 64, 4, 2, None, True), ("fp8", 64, 4, 3, None, True), ("fp8", 64, 4, 4, None, True),
    ("fp8", 64, 4, 3, 128, True), ("fp8", 64, 4, 4, 128, True), ("fp8", 128, 4, 3, 168, True),
    # caps meant for five programs per SM: 102 registers still gives four (the allocation unit is
    # 256 registers per warp), 96 gives five
    ("fp8", 64, 4, 3, 102, True), ("fp8", 64, 4, 3, 96, True), ("fp8", 32, 4, 5, 102, True), ("fp8", 32, 4, 5, 96, True),
    ("fp8", 32, 4, 4, 128, True), ("bf16", 32, 4, 3, 102, True), ("bf16", 32, 4, 4, 102, True),
    ("bf16", 32, 4, 3, 96, True), ("bf16", 32, 4, 3, 128, True), ("bf16", 32, 4, 3, None, True),
]


def inflight_tiles() -> int:
    """Registers, spills, shared memory, loop length, K/V buffers per operand (from the TTGIR)
    and the resulting K/V bytes in flight per SM of the decode at INFLIGHT_TILES, bf16 q."""
    k = decode._decode_kernel
    failures = 0
    for kv, bn, warps, stages, cap, ahead in INFLIGHT_TILES:
        cx = dict(HEAD_DIM=128, BLOCK_H=16, BLOCK_N=bn, PAGE=16, SPLIT=False, DOT_PRECISION="tf32",
                  RETURN_LSE=False, TABLE_AHEAD=ahead, KV_FP8=kv == "fp8")
        if kv == "fp8":
            cx.update(FP8_F16=True, FP8_WORDS=2, HW_CVT=True)
        name = f"{kv} {bn}x{warps}x{stages}" + (f" maxnreg {cap}" if cap else "") + (" table ahead" if ahead else "")
        try:
            kern = _compile(k, "bf16", kv, cx, warps, stages, **({"maxnreg": cap} if cap else {}))
        except Exception as e:  # a tile that does not compile is a result
            failures += 1
            print(f"FAIL {name}: {type(e).__name__}: {' '.join(str(e).split())[:300]}", flush=True)
            continue
        usage = _ptxas(kern.asm["ptx"])
        regs, smem = usage.get("regs"), kern.metadata.shared
        # the full-tile loop's K (or word) buffers
        inflight = kv_in_flight(kern, regs, warps, bn, "i32" if kv == "fp8" else "bf16",
                                bn * 128 * 2 * (1 if kv == "fp8" else 2))
        print(f"ok   {name}: regs={regs} spill_bytes={usage.get('spill_bytes')} shared={smem} "
              f"sass_loops={sass_loops(kern.asm['cubin'])} {inflight}", flush=True)
    return failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--same-as", help="git revision whose decode.py the plain variants must equal")
    ap.add_argument("--dump", help="keep <name>.ptx/.ttgir here")
    ap.add_argument("--emit", help=argparse.SUPPRESS)
    ap.add_argument("--plain-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--inflight", action="store_true", help="only the tiles of INFLIGHT_TILES: K/V bytes in flight")
    args = ap.parse_args(argv)
    if args.emit:
        return 1 if emit(args.emit, args.plain_only) else 0
    print(f"triton {triton.__version__}, target sm_90")
    if args.inflight:
        return 1 if inflight_tiles() else 0
    with tempfile.TemporaryDirectory() as tmp:
        here = args.dump or tmp
        failures = emit(here, False)
        if args.same_as:
            failures += same_as(args.same_as, here)
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
