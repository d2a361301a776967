"""Host overhead of the public API on the decode hot path.

Times, on the GPU, eager calls (no CUDA graph) of
    mp.decode_attention(q, k_cache, v_cache, block_tables, context_lens, check_values=False)
against a bare call of the backend function that the registry resolves to, on
the same tensors (B=1, L=4096, bf16, Hq/Hkv/D 16/8/128, page 16). Each sample is
the host wall time of one call (the launch is asynchronous; the stream is
drained every 64 calls so the launch queue never fills); median of --calls
samples. API overhead = median(api) - median(bare). The bare call's own host
time is the backend's launcher cost (Triton's launcher runs in Python).

    PYTHONPATH=src python3 bench/bench_overhead.py [--calls 1000] [--json PATH]

Run it with PYTHONPATH pointing at another checkout's src/ to measure that one
(the function it resolves is found through whatever registry that version has).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def _bare_fn(mp, name):
    """The resolved backend function and how to call it, for this version of minipaged."""
    from minipaged import registry

    b = registry.resolve("decode", "cuda", name)
    fn = b.op("decode")
    import inspect

    takes_lse = "return_lse" in inspect.signature(fn).parameters or len(inspect.signature(fn).parameters) >= 7
    return fn, takes_lse


def _host_times(call, n: int) -> list[float]:
    out = []
    for i in range(n):
        if i % 64 == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        out.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--backends", default="cuda,triton")
    ap.add_argument("--label", default="")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench_overhead needs a CUDA GPU", file=sys.stderr)
        return 2
    import minipaged as mp

    dev = torch.device("cuda")
    B, Hq, Hkv, D, L, page = 1, 16, 8, 128, 4096, 16
    g = torch.Generator(device=dev).manual_seed(0)
    nblk = L // page
    q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
    kc = torch.randn(nblk + 8, page, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    tables = torch.randperm(nblk + 8, device=dev, generator=g)[:nblk].int().reshape(1, nblk)
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    scale = D ** -0.5
    rows = []
    for name in [b for b in args.backends.split(",") if b]:
        try:
            fn, takes_lse = _bare_fn(mp, name)
        except Exception as e:  # noqa: BLE001
            rows.append(dict(backend=name, error=f"{type(e).__name__}: {e}"))
            continue
        bare_args = (q, kc, vc, tables, lens, scale) + ((False,) if takes_lse else ())

        def api():
            return mp.decode_attention(q, kc, vc, tables, lens, backend=name, check_values=False)

        def bare():
            return fn(*bare_args)

        torch.testing.assert_close(api(), bare())
        for _ in range(50):  # JIT, caches, first-call work
            api()
            bare()
        t_api = statistics.median(_host_times(api, args.calls))
        t_bare = statistics.median(_host_times(bare, args.calls))
        rows.append(dict(backend=name, api_us=t_api, bare_us=t_bare, overhead_us=t_api - t_bare, calls=args.calls))
        print(f"{args.label:8s} {name:7s} api {t_api:7.1f} us  bare {t_bare:7.1f} us  "
              f"api overhead {t_api - t_bare:6.1f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(label=args.label, shape=dict(B=B, Hq=Hq, Hkv=Hkv, D=D, L=L, page=page), rows=rows), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
