#!/usr/bin/env python3
"""Registers, shared memory, stack and spills per kernel, from `nvcc -Xptxas -v`.

    PYTHONPATH=src python scripts/ptxas_report.py [--arch 90] [decode.cu ...]

With no file names every .cu in src/minipaged/cuda/csrc is compiled. Needs
nvcc only (no GPU, no CUDA torch). Kernel names are demangled with cu++filt.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from minipaged.cuda import build


def demangle(names: list[str]) -> list[str]:
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if not tool or not names:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return out if len(out) == len(names) else names


def short(name: str) -> str:
    # "void minipaged::(anonymous namespace)::paged_decode_kernel<__nv_bfloat16, 128, 2, 8, 2>(minipaged::DecodeParams)"
    name = name.replace("minipaged::", "").replace("(anonymous namespace)::", "")
    if name.startswith("void "):
        name = name[5:]
    return name.split("(")[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help=".cu files in csrc (default: all)")
    ap.add_argument("--arch", default="90", help="80, 90, 90a ... (default 90)")
    args = ap.parse_args()
    if build.nvcc_path() is None:
        print("nvcc not found", file=sys.stderr)
        return 2
    files = args.files or build.cuda_sources()
    rc = 0
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda f: build.compile_standalone(build.CSRC / f, args.arch, tmp), files))
    print(f"{'file':<18} {'kernel':<70} {'regs':>5} {'smem B':>7} {'stack B':>7} {'spill st/ld B':>13}")
    for f, (code, log) in zip(files, results):
        if code != 0:
            print(f"{f:<18} COMPILE FAILED\n{log[-3000:]}")
            rc = 1
            continue
        kernels = build.parse_ptxas(log)
        names = demangle([k["kernel"] for k in kernels])
        for k, name in zip(kernels, names):
            spill = f"{k['spill_stores']}/{k['spill_loads']}"
            print(f"{f:<18} {short(name):<70} {k['registers']:>5} {k['smem']:>7} {k['stack']:>7} {spill:>13}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
