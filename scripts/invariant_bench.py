"""What batch invariance costs, kernel by kernel (GPU): the pinned-tile kernels of
minipaged.triton.invariant against the default path on Qwen3-0.6B shapes, bf16, cold L2,
CUDA graphs. Every timed pair is first checked: the invariant rows of a slice must equal
the same rows of the full batch bit for bit (the default path's are reported, not required).

    PYTHONPATH=src python3 scripts/invariant_bench.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

from minipaged.benchmark.timing import environment, time_fn  # noqa: E402
from minipaged.testing import cu_seqlens, paged_kv  # noqa: E402
from minipaged.triton import invariant, ops  # noqa: E402


def _us(fn) -> float:
    return time_fn(fn, device="cuda", reps=200, warmup=3, cold_l2=True, cuda_graph=True).median_ms * 1e3


def linear_rows(rows: list, dtype=torch.bfloat16) -> None:
    # (N, K): qkv, o, gate_up, down, lm_head of Qwen3-0.6B
    for N, K in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)):
        w = torch.randn(N, K, device="cuda", dtype=dtype) * K ** -0.5
        for M in (1, 64, 2048, 8192):
            if N > 100_000 and M > 64:
                continue  # the engine computes logits for the sampled rows only
            x = torch.randn(M, K, device="cuda", dtype=dtype)
            same_inv = torch.equal(invariant.linear(x[-1:], w), invariant.linear(x, w)[-1:])
            same_def = torch.equal(F.linear(x[-1:], w), F.linear(x, w)[-1:])
            t_inv, t_def = _us(lambda: invariant.linear(x, w)), _us(lambda: F.linear(x, w))
            flops = 2 * M * N * K
            rows.append(dict(op="linear", M=M, N=N, K=K, invariant_us=t_inv, default_us=t_def,
                             ratio=t_inv / t_def, invariant_tflops=flops / t_inv / 1e6,
                             default_tflops=flops / t_def / 1e6, invariant_rows_equal=same_inv,
                             default_rows_equal=same_def))
            print(json.dumps(rows[-1]), flush=True)


def norm_rows(rows: list, dtype=torch.bfloat16) -> None:
    for T in (1, 64, 8192):
        x = torch.randn(T, 1024, device="cuda", dtype=dtype)
        w = torch.randn(1024, device="cuda", dtype=dtype)
        same = torch.equal(invariant.rms_norm(x[-1:], w, 1e-6), invariant.rms_norm(x, w, 1e-6)[-1:])
        t_inv = _us(lambda: invariant.rms_norm(x, w, 1e-6))
        t_def = _us(lambda: F.rms_norm(x, (1024,), w, 1e-6))
        rows.append(dict(op="rms_norm", T=T, D=1024, invariant_us=t_inv, default_us=t_def, ratio=t_inv / t_def,
                         invariant_rows_equal=same))
        print(json.dumps(rows[-1]), flush=True)


def paged_rows(rows: list, dtype=torch.bfloat16) -> None:
    hq, hkv, D, page = 16, 8, 128, 16
    # decode batches, a speculative batch, a chunk over a cached prefix, a whole prompt
    for name, q_lens, ctx in (("decode B=1 L=4k", [1], [4096]), ("decode B=64 L=4k", [1] * 64, [4096] * 64),
                              ("spec B=32 q=4 L=4k", [4] * 32, [4096] * 32),
                              ("chunk 8x512 over 4k", [512] * 8, [4608] * 8), ("prompt 8k", [8192], [8192])):
        kv = paged_kv(ctx, hkv, D, page, dtype, "cuda", seed=0, poison=False)
        q = torch.randn(sum(q_lens), hq, D, device="cuda", dtype=dtype)
        cu = cu_seqlens(q_lens, "cuda")
        args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, max(q_lens), True, D ** -0.5)
        t_inv = _us(lambda: ops.paged(*args, batch_invariant=True))
        t_def = _us(lambda: ops.paged(*args))
        rows.append(dict(op="paged", case=name, invariant_us=t_inv, default_us=t_def, ratio=t_inv / t_def))
        print(json.dumps(rows[-1]), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: invariant_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    rows: list = []
    linear_rows(rows)
    norm_rows(rows)
    paged_rows(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(bench="invariant", env=environment("cuda"), rows=rows), f, indent=1, default=str)
    bad = [r for r in rows if r.get("invariant_rows_equal") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
