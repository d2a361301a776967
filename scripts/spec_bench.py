"""Speculative verification through paged_attention on `cuda`: q_len 4 (and the --q-lens given)
per sequence, the default route (the tensor-core decode kernel where paged_spec_decode_ok) against
the GQA-packed prefill kernel with its KV splits (paged variant 3, the unrouted default), next to
`cuda` decode (q_len 1, the last query of each run) on the same cache and triton's paged; 16-bit
and FP8 pages. Hq/Hkv/D 16/8/128 (--heads another Hq/Hkv), page 16, pages scattered, CUDA-graph
replays, cold L2, median.
Every timed call is first checked against the fp64 oracle (minipaged.testing.assert_close).

    PYTHONPATH=src python scripts/spec_bench.py [--json out.json] [--reps 50] [--q-lens 4,16]
        [--rows 32x4096,1x32768] [--heads 32/4] [--profile N]

--profile N: no timing; each row's `cuda` spec call and `cuda` decode run N times each, eagerly
(16-bit pages), for a profiler (ncu -k regex:decode) to take the kernels one by one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from minipaged import testing
from minipaged.benchmark import cases as bench_cases
from minipaged.benchmark.timing import time_fn
from minipaged.cuda import ops as cuda_ops
from minipaged.triton import ops as triton_ops

ROWS = [(1, 4096), (1, 32768), (4, 4096), (8, 4096), (32, 4096), (64, 4096), (128, 1024)]
PACKED = 3  # paged variant: short runs on the GQA-packed prefill kernel (csrc/prefill/dispatch.cuh)


def _bytes(case: testing.PagedCase, kv_elem: int) -> int:
    return sum(case.context_lens) * case.num_kv_heads * case.head_dim * 2 * kv_elem


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--q-lens", default="4", help="comma-separated q_len per sequence")
    ap.add_argument("--rows", help="comma-separated BxL rows (default: the standard set)")
    ap.add_argument("--heads", help="Hq/Hkv (default: Qwen3's 16/8), head_dim 128")
    ap.add_argument("--columns", help="comma-separated column labels to time (default: all), e.g. 'fp8 cuda'")
    ap.add_argument("--profile", type=int, default=0)
    args = ap.parse_args()
    heads = dict(bench_cases.QWEN3_HEADS)
    if args.heads:
        heads["num_q_heads"], heads["num_kv_heads"] = (int(x) for x in args.heads.split("/"))
    rows = [tuple(int(x) for x in r.split("x")) for r in args.rows.split(",")] if args.rows else ROWS
    dtype, dev = torch.bfloat16, torch.device("cuda")
    q_lens = [int(x) for x in args.q_lens.split(",")]
    columns = set(args.columns.split(",")) if args.columns else None
    wanted = lambda label: columns is None or label in columns  # noqa: E731
    out = {"device": torch.cuda.get_device_name(), "q_lens": q_lens, "heads": heads, "rows": [], "failed": []}
    t0 = time.time()
    for Q_LEN, (B, L) in ((ql, r) for ql in q_lens for r in rows):
        case = testing.PagedCase("spec", (Q_LEN,) * B, (L,) * B, **heads)
        q, kc, vc, bt, cu, cl = testing.make_paged_inputs(case, dtype, dev, seed=B, poison=False)
        kc8, vc8, ks, vs = bench_cases.fp8_caches(kc, vc, spread=True)
        scale = case.head_dim ** -0.5
        qd = q[Q_LEN - 1::Q_LEN].contiguous()  # one query per sequence: the decode step
        if args.profile:
            for _ in range(args.profile):
                cuda_ops.paged(q, kc, vc, bt, cu, cl, Q_LEN, True, scale, False)
                cuda_ops.decode(qd, kc, vc, bt, cl, scale, False)
            torch.cuda.synchronize()
            continue
        row = {"q_len": Q_LEN, "B": B, "L": L, "us": {}, "TBps": {}}
        for cache, (k_, v_, kw) in {"16-bit": (kc, vc, {}), "fp8": (kc8, vc8, {"k_scale": ks, "v_scale": vs})}.items():
            if not any(wanted(f"{cache} {name}") for name in ("cuda", "cuda packed", "triton", "cuda decode*")):
                continue
            if cache == "fp8":
                keys, vals = testing.gather_kv(bench_cases.dequantize_fp8(k_, ks), bench_cases.dequantize_fp8(v_, vs),
                                               bt, cl)
            else:
                keys, vals = testing.gather_kv(k_, v_, bt, cl)
            truth, _ = testing.paged_ref(q, keys, vals, cu)
            lowp, _ = testing.paged_ref(q, keys, vals, cu, lowp=True)
            fns = {
                "cuda": lambda: cuda_ops.paged(q, k_, v_, bt, cu, cl, Q_LEN, True, scale, False, **kw),
                "cuda packed": lambda: cuda_ops.paged(q, k_, v_, bt, cu, cl, Q_LEN, True, scale, False, **kw,
                                                      variant=PACKED),
                "triton": lambda: triton_ops.paged(q, k_, v_, bt, cu, cl, Q_LEN, True, scale, False, **kw),
            }
            for name, fn in fns.items():
                label = f"{cache} {name}"
                if not wanted(label):
                    continue
                try:
                    testing.assert_close(fn(), truth, lowp, f"q={Q_LEN} B={B} L={L} {label}")
                except Exception as e:  # noqa: BLE001 - reported, not timed
                    out["failed"].append(f"q={Q_LEN} B={B} L={L} {label}: {type(e).__name__}: {str(e)[:300]}")
                    print(out["failed"][-1], flush=True)
                    continue
                t = time_fn(fn, device=dev, reps=args.reps, min_reps=10, max_time_s=2.0, cuda_graph=True)
                row["us"][label] = t.median_ms * 1e3
                row["TBps"][label] = _bytes(case, 1 if cache == "fp8" else 2) / (t.median_ms * 1e-3) / 1e12
            if wanted(f"{cache} cuda decode*"):
                dec = lambda: cuda_ops.decode(qd, k_, v_, bt, cl, scale, False, **kw)  # noqa: E731
                t = time_fn(dec, device=dev, reps=args.reps, min_reps=10, max_time_s=2.0, cuda_graph=True)
                row["us"][f"{cache} cuda decode*"] = t.median_ms * 1e3
        print(f"q={Q_LEN:2d} B={B:4d} L={L:6d} " + "  ".join(f"{k} {v:7.1f}" for k, v in row["us"].items()), flush=True)
        out["rows"].append(row)
    print(f"took {time.time() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if out["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
