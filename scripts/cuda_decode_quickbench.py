#!/usr/bin/env python3
"""Quick timing of the CUDA paged decode on the GPU, next to copy/read anchors.

    PYTHONPATH=src python scripts/cuda_decode_quickbench.py [--sweep]

bf16, Hq=16, Hkv=8, D=128, block 16, pages in random order (the benchmark's
inputs, minipaged.testing). Medians of minipaged.benchmark.timing.time_fn (cold,
clean L2 before every timed call, as `minipaged bench`); TB/s counts the K and V
bytes read. The real benchmark harness is bench/; this
script only exists to tune the kernel (variants, split counts).
"""

from __future__ import annotations

import argparse

import torch

from minipaged.benchmark import timing
from minipaged.cuda import ops
from minipaged.testing import DecodeCase, make_decode_inputs

SHAPES = [(1, 4096), (1, 32768), (8, 4096), (32, 4096), (64, 8192), (256, 1024)]


def _median_ms(fn, reps=40, warmup=10):
    return timing.time_fn(fn, device="cuda", reps=reps, warmup=warmup, max_time_s=0).median_ms


def anchors():
    x = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    y = torch.empty_like(x)
    t_copy = _median_ms(lambda: y.copy_(x))
    t_read = _median_ms(lambda: x.sum(dtype=torch.float32))
    del x, y
    return 2 * (1 << 31) / (t_copy * 1e-3) / 1e12, (1 << 31) / (t_read * 1e-3) / 1e12


def problem(B, L, bs=16, Hq=16, Hkv=8, D=128, dtype=torch.bfloat16):
    case = DecodeCase(B, L, Hq, Hkv, D, bs)
    inputs = make_decode_inputs(case, dtype, "cuda", seed=None, poison=False, spare_columns=0)
    return (*inputs, B * L * Hkv * D * 2 * 2)


def time_decode(prob, splits=0, variant=0):
    q, kc, vc, bt, cl, nbytes = prob
    fn = lambda: ops.decode(q, kc, vc, bt, cl, 0.0883, False, num_splits=splits, variant=variant)  # noqa: E731
    fn()
    t = _median_ms(fn)
    return t * 1e3, nbytes / (t * 1e-3) / 1e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time the tiling variants and split counts")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}  SMs: {torch.cuda.get_device_properties(0).multi_processor_count}")
    copy_tbps, read_tbps = anchors()
    print(f"anchor: device copy {copy_tbps:.2f} TB/s (read+write), x.sum() read {read_tbps:.2f} TB/s")
    for B, L in SHAPES:
        prob = problem(B, L)
        us, tbps = time_decode(prob)
        line = f"decode B={B:<4} L={L:<6} default: {us:8.1f} us {tbps:5.2f} TB/s"
        if args.sweep:
            for variant in (1, 2, 3, 5, 6, 7, 8):
                try:
                    _, tb = time_decode(prob, variant=variant)
                    line += f" | v{variant} {tb:4.2f}"
                except Exception as e:  # keep timing the rest
                    line += f" | v{variant} ERR {type(e).__name__}"
            cands = {1: (32, 48, 64, 96, 128), 8: (6, 8, 12), 32: (2, 3, 4), 64: (1, 2), 256: ()}[B]
            if B == 1 and L <= 4096:
                cands = (16, 32, 64)
            for s in cands:
                for variant in (0, 6, 7):
                    try:
                        _, tb = time_decode(prob, splits=s, variant=variant)
                        line += f" | s{s}v{variant} {tb:4.2f}"
                    except Exception as e:  # keep timing the rest
                        line += f" | s{s}v{variant} ERR {type(e).__name__}"
        print(line, flush=True)
        del prob
        torch.cuda.empty_cache()
    if args.sweep:  # larger GQA groups (Qwen3-4B/8B: G=4, Qwen3-32B: G=8) at B=32, L=4k
        for hq in (32, 64):
            prob = problem(32, 4096, Hq=hq)
            line = f"decode B=32 L=4096 Hq={hq} Hkv=8:"
            for variant in (0, 7):
                try:
                    us, tb = time_decode(prob, variant=variant)
                    line += f" | v{variant} {us:7.1f} us {tb:4.2f} TB/s"
                except Exception as e:
                    line += f" | v{variant} ERR {type(e).__name__}"
            print(line, flush=True)
            del prob
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
