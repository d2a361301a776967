#!/usr/bin/env python3
"""Does the paged layout cost large-batch decode its last percent against cuDNN? (issue #15)

At B >= 32 `cuda`'s decode runs at 0.98-1.00x SDPA's cuDNN kernel, which reads K/V laid out
[B, Hkv, L, D] contiguous: one 2 MB stream per (sequence, head). The paged cache is
[num_blocks, page, Hkv, D]: a CTA of one KV head reads 256-byte rows 2 KB apart, and its pages
lie anywhere. This times the same bytes under three layouts, same process, cold L2, CUDA graphs:

  paged     Hq/Hkv 16/8, pages shuffled (the standard grid's layout)
  in-order  Hq/Hkv 16/8, each sequence's pages consecutive in the pool
  one-head  Hq/Hkv 2/1 with 8x the sequences: every page of a CTA is 4 KB contiguous, same
            bytes, same CTA count and work per CTA, pages shuffled

and cuDNN on the contiguous [B, Hkv, L, D] copy. If one-head and in-order match paged, the
layout is not what separates `cuda` from cuDNN.

    PYTHONPATH=src python scripts/decode_layout_probe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

import minipaged as mp
from minipaged.benchmark.cases import contiguous_kv
from minipaged.benchmark.flops import decode_bytes
from minipaged.benchmark.timing import time_fn

D, PAGE = 128, 16
CASES = [(32, 4096), (64, 8192), (256, 1024), (8, 4096)]


def make(batch: int, ctx: int, hq: int, hkv: int, in_order: bool, gen: torch.Generator):
    dev, dt = "cuda", torch.bfloat16
    pages = ctx // PAGE
    num_blocks = batch * pages + 3
    perm = torch.arange(num_blocks, device=dev) if in_order else torch.randperm(num_blocks, device=dev, generator=gen)
    tables = perm[: batch * pages].view(batch, pages).to(torch.int32).contiguous()
    k_cache = torch.randn(num_blocks, PAGE, hkv, D, device=dev, generator=gen).to(dt)
    v_cache = torch.randn(num_blocks, PAGE, hkv, D, device=dev, generator=gen).to(dt)
    q = torch.randn(batch, hq, D, device=dev, generator=gen).to(dt)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    return q, k_cache, v_cache, tables, lens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = 1 / math.sqrt(D)
    rows = []
    for batch, ctx in CASES:
        nbytes = decode_bytes(16, 8, D, [ctx] * batch, 2)
        res = {"B": batch, "L": ctx}
        for name, b, hq, hkv, in_order in (("paged", batch, 16, 8, False), ("in-order", batch, 16, 8, True),
                                           ("one-head", batch * 8, 2, 1, False)):
            q, kc, vc, bt, cl = make(b, ctx, hq, hkv, in_order, gen)
            for backend in ("cuda", "triton"):
                fn = lambda: mp.decode_attention(q, kc, vc, bt, cl, scale=scale, backend=backend,  # noqa: E731
                                                 check_values=False)
                t = time_fn(fn, device="cuda", reps=args.reps, cuda_graph=True)
                res[f"{backend} {name}"] = t.median_ms * 1e3
            if name == "paged":
                k4, v4 = contiguous_kv(kc, vc, bt, ctx)
                out = mp.decode_attention(q, kc, vc, bt, cl, scale=scale, backend="cuda")
                q4 = q.view(b, hkv, hq // hkv, D)
                from torch.nn.attention import SDPBackend, sdpa_kernel
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    fn = lambda: F.scaled_dot_product_attention(q4, k4, v4, scale=scale)  # noqa: E731
                    ref = fn().reshape(b, hq, D)
                    res["max |cuda - cudnn|"] = (out.float() - ref.float()).abs().max().item()
                    res["cudnn contiguous"] = time_fn(fn, device="cuda", reps=args.reps, cuda_graph=True).median_ms * 1e3
                del k4, v4
            del q, kc, vc, bt, cl
            torch.cuda.empty_cache()
        res = {k: (round(v, 2) if isinstance(v, float) and not k.startswith("max") else v) for k, v in res.items()}
        line = f"B={batch} L={ctx}:"
        for k, v in res.items():
            if k in ("B", "L") or k.startswith("max"):
                continue
            line += f"  {k} {v:.1f} us ({nbytes / (v * 1e-6) / 1e12:.3f} TB/s)"
        print(line + f"  max|cuda-cudnn| {res['max |cuda - cudnn|']:.2e}", flush=True)
        rows.append(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"unit": "us (median, cold L2, CUDA graph)", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
