#!/usr/bin/env python3
"""`cuda`'s paged prefill against its dense/varlen prefill on one-wave causal chunks (both run
mirrored block pairs there: dense since 4138ec0, paged since 4a01a04; the paged call launches
only the tiled kernel for them since 5823656): B=1 chunks with little or no cached prefix, whose
grids are at most one wave of 128-row blocks, timed through
mp.paged_attention (page 16, pages shuffled) and through mp.prefill_attention_varlen on the same
K/V made contiguous, same process, cold L2, CUDA-graph replays (a call is ~20 us of GPU
work, less than the API's host path). Prints TFLOP/s (exact causal FLOPs) and the paged /
dense ratio, after checking that the two outputs agree. --kv-cache-dtype fp8 also times the
paged call on an FP8 copy of the cache (mirrored pairs since 0e15b34), checked against the
16-bit output within the FP8 rounding.

    PYTHONPATH=src python scripts/one_wave_paged_probe.py [--kv-cache-dtype fp8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch

import minipaged as mp
from minipaged.benchmark.cases import fp8_caches
from minipaged.benchmark.flops import prefill_flops
from minipaged.benchmark.timing import time_fn

HQ, HKV, D, PAGE = 16, 8, 128, 16


def case(q_len: int, ctx: int, gen: torch.Generator, fp8: bool = False) -> dict:
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(q_len, HQ, D, device=dev, generator=gen).to(dt)
    k = torch.randn(ctx, HKV, D, device=dev, generator=gen).to(dt)
    v = torch.randn(ctx, HKV, D, device=dev, generator=gen).to(dt)
    pages = -(-ctx // PAGE)
    num_blocks = pages + 7
    perm = torch.randperm(num_blocks, device=dev, generator=gen)[:pages].to(torch.int32)
    k_cache = torch.full((num_blocks, PAGE, HKV, D), float("nan"), device=dev, dtype=dt)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = (perm.long()[torch.arange(ctx, device=dev) // PAGE] * PAGE + torch.arange(ctx, device=dev) % PAGE)
    mp.write_kv_cache(k, v, k_cache, v_cache, slots, backend="cuda")
    block_tables = perm[None, :]
    cu_q = torch.tensor([0, q_len], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, ctx], dtype=torch.int32, device=dev)
    ctx_lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
    scale = 1 / math.sqrt(D)

    def paged():
        return mp.paged_attention(q, k_cache, v_cache, block_tables, cu_q, ctx_lens, max_seqlen_q=q_len,
                                  scale=scale, backend="cuda", check_values=False)

    def dense():
        return mp.prefill_attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=q_len, max_seqlen_k=ctx, scale=scale,
                                           backend="cuda", check_values=False)

    diff = (paged().float() - dense().float()).abs().max().item()
    assert diff < 2e-2, f"paged and dense disagree: {diff}"
    flops = prefill_flops(1, HQ, q_len, ctx, D, causal=True)
    out = {"q_len": q_len, "ctx": ctx, "max_abs_diff": diff}
    calls = [("paged", paged), ("dense", dense)]
    if fp8:
        # the same pages quantised with per-KV-head amax scales, as `minipaged bench` does
        k8, v8, k_scale, v_scale = fp8_caches(k_cache, v_cache)

        def paged_fp8():
            return mp.paged_attention(q, k8, v8, block_tables, cu_q, ctx_lens, max_seqlen_q=q_len, scale=scale,
                                      k_scale=k_scale, v_scale=v_scale, backend="cuda", check_values=False)

        out["fp8_max_abs_diff"] = (paged_fp8().float() - dense().float()).abs().max().item()
        assert out["fp8_max_abs_diff"] < 0.25, f"fp8 paged and dense disagree: {out['fp8_max_abs_diff']}"
        calls.append(("paged_fp8", paged_fp8))
    for name, fn in calls:
        t = time_fn(fn, device=dev, reps=100, max_time_s=1.0, cuda_graph=True)
        out[name] = {"median_ms": t.median_ms, "p20_ms": t.p20_ms, "p80_ms": t.p80_ms,
                     "tflops": flops / (t.median_ms * 1e-3) / 1e12}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    fp8 = args.kv_cache_dtype == "fp8"
    rows = [case(q, c, gen, fp8) for q, c in ((1024, 1024), (512, 512), (1024, 1536), (768, 768))]
    for r in rows:
        print(f"B=1 q={r['q_len']} ctx={r['ctx']}: paged {r['paged']['tflops']:.1f} TFLOP/s "
              f"({r['paged']['median_ms'] * 1e3:.1f} us), dense {r['dense']['tflops']:.1f} "
              f"({r['dense']['median_ms'] * 1e3:.1f} us), paged/dense speed "
              f"{r['dense']['median_ms'] / r['paged']['median_ms']:.3f}, max|diff| {r['max_abs_diff']:.2e}")
        if "paged_fp8" in r:
            print(f"    fp8 pages: {r['paged_fp8']['tflops']:.1f} TFLOP/s ({r['paged_fp8']['median_ms'] * 1e3:.1f} us), "
                  f"max|diff| to dense {r['fp8_max_abs_diff']:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
