"""Where does small-batch paged decode spend its time? (tuning tool, H200)

    PYTHONPATH=src python scripts/decode_diag.py time OUT.json   # graph-replay sweep
    PYTHONPATH=src python scripts/decode_diag.py groups OUT.json # Qwen3 GQA layouts
    ncu ... python scripts/decode_diag.py ncu                    # one call per config
    (or: scripts/gpu_check.sh build diag ncu)

`groups`: scalar tilings against the tensor-core kernel for each Qwen3 head
layout; DIAG_SHORT=1 swaps in large-batch, short-context shapes.
`time`: every CUDA tiling / split count / reduction variant and Triton, timed
exactly as `minipaged bench` times decode (CUDA-graph replay, median, cold L2),
under both flush modes, next to two anchors measured in the same process: a
graph holding one tiny kernel (the floor every graph-timed row pays) and a
contiguous read of the same number of bytes (`x.sum()`).
`ncu`: runs the configs once each after a warm-up so Nsight Compute can give
per-kernel durations (split kernel vs reduction).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from minipaged.triton import configs

from minipaged.benchmark import cases as cs
from minipaged.benchmark import timing
from minipaged.cuda import ops as cuda_ops
from minipaged.registry import all_backends

NOPDL = 0x200  # decode.cu kVariantNoPDL
# Tiling numbers are decode.cu's `variant & 0xff` for G=2, D=128. The first run
# (bench/results/nvidia-h200/decode_diag/) used the numbering before the default
# changed: there 0 was today's 4 and 4 today's 0, and 0x100 selected the old
# one-thread-per-dim reduction.
SHAPES = ((1, 32768), (1, 4096), (8, 4096), (64, 8192))


def sweep_configs(B, L):
    out = [("triton", 0, None)]
    if B == 1:
        out.append(("triton", 64, None))
    splits = (0, 32, 64, 128, 256) if B == 1 and L > 8192 else (0, 16, 32, 64) if B == 1 else (0,)
    for s in splits:
        for tiling in (0, 1, 3, 4, 5, 6, 7, 8, 9):
            out.append(("cuda", s, tiling))
        out.append(("cuda", s, NOPDL))
    return out


SCALE = 128**-0.5


def runner(name, splits, variant, inputs):
    """A zero-argument decode call; Triton's split count goes through configs.set_override."""
    q, kc, vc, bt, cl = inputs
    if name == "cuda":
        return lambda: cuda_ops.decode(q, kc, vc, bt, cl, SCALE, False, num_splits=splits, variant=variant)
    fn = all_backends()["triton"].op("decode")

    def run():
        if splits:
            configs.set_override("decode_splits", str(splits))
        else:
            configs.set_override("decode_splits", None)
        return fn(q, kc, vc, bt, cl, SCALE)

    return run


def problem(B, L, num_q_heads=16, with_ref=True):
    """bf16 inputs of `minipaged bench` for (B, L), their byte count and (with_ref) the
    default CUDA output to compare every config with."""
    case = cs.DecodeCase(batch=B, context_len=L, num_q_heads=num_q_heads, num_kv_heads=8, head_dim=128)
    torch.manual_seed(0)
    inputs = cs.make_decode_inputs(case, torch.bfloat16, "cuda", seed=None, poison=False, spare_columns=0)
    ref = cuda_ops.decode(*inputs, SCALE, False, num_splits=0, variant=0).float() if with_ref else None
    return inputs, case.bytes(2), ref


def measure(fn, nbytes, row, ref=None):
    """Times fn as the bench does (graph replay, cold L2); adds the figures to `row`, prints it."""
    try:
        if ref is not None:
            row["max_diff"] = (fn().float() - ref).abs().max().item()
        t = timing.time_fn(fn, device="cuda", reps=100, max_time_s=0.3, cuda_graph=True)
        row.update(us=t.median_ms * 1e3, tbps=nbytes / t.median_ms / 1e9, clock=t.clock)
    except Exception as e:  # noqa: BLE001 - keep sweeping
        row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
    print(row, flush=True)
    return row


def main_time(out_path):
    rows = []
    for B, L in SHAPES:
        inputs, nbytes, ref = problem(B, L)
        x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        tiny = torch.zeros(1, device="cuda")
        for mode in ("read", "write"):
            os.environ["MINIPAGED_BENCH_L2_FLUSH"] = mode
            for name, fn in (("anchor-empty-graph", lambda: tiny.add_(1.0)),
                             ("anchor-read-same-bytes", lambda: x.sum(dtype=torch.float32))):
                rows.append(measure(fn, nbytes, dict(B=B, L=L, flush=mode, backend=name)))
            for name, splits, variant in sweep_configs(B, L):
                row = dict(B=B, L=L, flush=mode, backend=name, splits=splits, variant=variant)
                rows.append(measure(runner(name, splits, variant, inputs), nbytes, row, ref))
            configs.set_override("decode_splits", None)
        inputs = x = None  # free this shape's buffers before the next one
        torch.cuda.empty_cache()
    json.dump(rows, open(out_path, "w"), indent=1)


def main_groups(out_path):
    """GQA groups of Qwen3: 0.6B-1.7B 16/8, 4B/8B 32/8, 14B 40/8, 32B 64/8; scalar
    tilings against the tensor-core kernel (10: 3 stages, 11: 2 stages), read flush."""
    rows = []
    os.environ["MINIPAGED_BENCH_L2_FLUSH"] = "read"
    plan = [(16, (0, 10, 11), ((1, 32768), (64, 8192))),
            (32, (0, 7, 10, 11), ((1, 32768), (32, 4096))),
            (40, (0, 10, 11), ((1, 32768), (32, 4096))),
            (64, (0, 7, 10, 11), ((1, 32768), (32, 4096)))]
    if os.environ.get("DIAG_SHORT"):  # short contexts, as in an engine's first decode steps
        # (20-22: the tensor-core kernel in two-warp CTAs, 3 / 4 / 2 stages)
        plan = [(hq, (0, 10, 12, 20, 21, 22), ((64, 192), (128, 256))) for hq in (16, 32, 64)]
    for hq, variants, shapes in plan:
        for B, L in shapes:
            inputs, nbytes, ref = problem(B, L, hq)
            for name, variant in [("triton", None)] + [("cuda", v) for v in variants]:
                row = dict(B=B, L=L, Hq=hq, Hkv=8, flush="read", backend=name, variant=variant)
                rows.append(measure(runner(name, 0, variant, inputs), nbytes, row, ref))
            del inputs
            torch.cuda.empty_cache()
    json.dump(rows, open(out_path, "w"), indent=1)


def main_ncu():
    B, L = 1, 32768
    inputs, _, _ = problem(B, L, with_ref=False)  # no extra kernel in the profile
    todo = [("triton", 0, None), ("triton", 64, None)]
    for s in (0, 64, 256):
        todo += [("cuda", s, 0), ("cuda", s, 4), ("cuda", s, NOPDL), ("cuda", s, 6)]
    for name, splits, variant in todo:
        fn = runner(name, splits, variant, inputs)
        fn()
        torch.cuda.synchronize()
        print(f"CONFIG {name} splits={splits} variant={variant}", flush=True)
        fn()
        torch.cuda.synchronize()


if __name__ == "__main__":
    if sys.argv[1] == "time":
        main_time(sys.argv[2])
    elif sys.argv[1] == "groups":
        main_groups(sys.argv[2])
    else:
        main_ncu()
