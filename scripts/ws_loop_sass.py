#!/usr/bin/env python3
"""Instruction mix of the warp-specialised prefill's key-tile loop, from its sm_90a SASS (no GPU).

Builds one instantiation of prefill_ws_kernel (the sm_90 default schedule, causal, bf16) into a
cubin, disassembles it, finds the consumer loop over key tiles (the backward branch whose body
holds the 16 HGMMA of one tile: 8 for Q K^T, 8 for P V at D=128) and counts its instructions by
class. --unmasked builds a copy of the sources whose consumers take the unmasked softmax on every
tile, so the loop is the steady-state one (plus the lazy-rescale blocks, which it skips on most
tiles); without it the loop holds both the masked and the unmasked copy.

    python3 scripts/ws_loop_sass.py [--d 128] [--unmasked] [--src src] [--list]

nvdisasm comes from the CUDA toolkit or, where the toolkit lacks it, from triton's bundled
binaries (triton/backends/nvidia/bin).
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

INSTANCE = """#include <cuda_bf16.h>
#include "params.h"
#include "prefill/mainloop_ws.cuh"
namespace mf = minipaged::fast;
using Cfg = mf::WsCfg<__nv_bfloat16, {d}, 128, 2, true, true, true, false, false, false, false, true>;
template cudaError_t mf::launch_prefill_ws<Cfg, true>(const minipaged::PrefillParams&, cudaStream_t);
"""

CLASSES = [
    ("HGMMA", {"HGMMA"}),
    ("WARPGROUP arrive/depbar", None),
    ("MUFU", {"MUFU"}),
    ("FFMA", {"FFMA"}), ("FMUL", {"FMUL"}), ("FADD", {"FADD"}), ("FMNMX", {"FMNMX"}),
    ("FSEL/FSETP", {"FSEL", "FSETP"}),
    ("conversions (F2FP/PRMT/...)", {"F2FP", "F2F", "I2F", "F2I", "I2FP", "F2IP", "PRMT"}),
    ("SHFL", {"SHFL"}),
    ("SYNCS (mbarrier)", {"SYNCS"}),
    ("BAR/WARPSYNC", {"BAR", "WARPSYNC", "NANOSLEEP", "MEMBAR", "FENCE"}),
    ("LDS/STS/LDSM", {"LDS", "STS", "LDSM", "STSM", "LD", "ST", "LDG", "STG"}),
    ("uniform datapath", None),
    ("vector int/address/move", {"IMAD", "IADD3", "VIADD", "LEA", "LOP3", "SHF", "MOV", "SEL", "ISETP", "S2R",
                                 "IABS", "IMNMX", "VIMNMX", "POPC", "FLO", "BMSK", "SGXT", "CS2R", "P2R", "R2P",
                                 "VOTE", "ELECT"}),
    ("branch/control", {"PLOP3", "BRA", "BSSY", "BSYNC", "EXIT", "RET", "CALL", "YIELD", "NOP"}),
]
_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?\s*(.*?);")


def classify(op: str) -> str:
    if op.startswith("WARPGROUP"):
        return "WARPGROUP arrive/depbar"
    if op.startswith("U") or op in ("R2UR", "S2UR"):
        return "uniform datapath"
    for name, ops in CLASSES:
        if ops and op in ops:
            return name
    return "other " + op


def nvdisasm() -> str:
    tool = shutil.which("nvdisasm")
    if tool:
        return tool
    try:
        import triton
        cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
        if cand.exists():
            return str(cand)
    except ImportError:
        pass
    sys.exit("error: no nvdisasm (CUDA toolkit or triton's bundled binaries)")


def build(src: Path, d: int, unmasked: bool, work: Path) -> Path:
    csrc = src / "minipaged" / "cuda" / "csrc"
    if unmasked:
        copy = work / "csrc"
        shutil.copytree(csrc, copy)
        f = copy / "prefill" / "mainloop_ws.cuh"
        text = f.read_text()
        masked = "    if (t < n_masked) softmax_tile(t, MaskOn{});\n    else softmax_tile(t, MaskOff{});"
        if masked not in text:
            sys.exit("error: the consumer's masked/unmasked choice is not where this script expects it")
        f.write_text(text.replace(masked, "    softmax_tile(t, MaskOff{});"))
        csrc = copy
    cu = work / "instance.cu"
    cu.write_text(INSTANCE.format(d=d))
    cubin = work / "k.cubin"
    subprocess.run(["nvcc", "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-DMINIPAGED_ENABLE_SM90A",
                    "-I", str(csrc), "-cubin", str(cu), "-o", str(cubin)], check=True)
    sass = work / "k.sass"
    sass.write_text(subprocess.run([nvdisasm(), "-c", str(cubin)], check=True, capture_output=True,
                                   text=True).stdout)
    return sass


def tile_loop(sass: Path, hgmma: int):
    ins, labels, pending = [], {}, []
    for line in sass.read_text().splitlines():
        lm = re.match(r"\s*(\.L_x_\d+):", line)
        if lm:
            pending.append(lm.group(1))
            continue
        m = _INS.search(line)
        if m:
            addr = int(m.group(1), 16)
            for p in pending:
                labels[p] = addr
            pending = []
            ins.append((addr, m.group(3), m.group(5), line.strip()))
    loops = []
    for addr, op, args, _ in ins:
        t = re.search(r"(\.L_x_\d+)", args) if op == "BRA" else None
        if t and labels.get(t.group(1), addr) < addr:
            body = [x for x in ins if labels[t.group(1)] <= x[0] <= addr]
            if sum(1 for x in body if x[1] == "HGMMA") == hgmma:
                loops.append(body)
    return min(loops, key=len) if loops else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=128, choices=(64, 128))
    ap.add_argument("--unmasked", action="store_true", help="count the steady-state (unmasked) loop")
    ap.add_argument("--src", type=Path, default=ROOT / "src")
    ap.add_argument("--list", action="store_true", help="print the loop's instructions too")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        sass = build(args.src, args.d, args.unmasked, Path(tmp))
        body = tile_loop(sass, 8 + args.d // 16)
    if body is None:
        print("error: no loop with one tile's HGMMA found", file=sys.stderr)
        return 1
    counts = collections.Counter(classify(op) for _, op, _, _ in body)
    print(f"key-tile loop {body[0][0]:#x}-{body[-1][0]:#x}, D={args.d}, "
          f"{'unmasked path only' if args.unmasked else 'masked and unmasked copies'}: {len(body)} instructions")
    for name, _ in CLASSES:
        print(f"{counts.pop(name, 0):6d}  {name}")
    for name, n in sorted(counts.items()):
        print(f"{n:6d}  {name}")
    if args.list:
        for *_, line in body:
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
