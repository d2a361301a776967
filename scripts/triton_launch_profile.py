"""Where the host time of an eager Triton attention call goes (GPU only).

For three engine-shaped calls of the triton backend (decode B=1 L=4k; a mixed paged step: one
256-token chunk over a 1k context plus 15 decodes; write_kv_cache of 272 tokens), bf16,
Hq/Hkv/D 16/8/128, page 16:
  - the median host time of one bare call (the backend function the registry resolves), with
    minipaged's launch cache (minipaged.triton.launch) on and off, in alternating rounds;
  - each Triton launch inside it, timed four ways on the same arguments: the whole
    JITFunction.run (binder, cache key, launch), the binder alone, the compiled kernel's own
    launcher with its metadata prepared once (the floor a cached launch could reach), and a
    hit of the launch cache;
  - a cProfile of many calls with the cache on, top functions by own time.

    PYTHONPATH=src python3 scripts/triton_launch_profile.py [--calls 1000] [--json PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from bench_overhead import _host_times  # noqa: E402


def _host_us(call, n: int) -> float:
    return statistics.median(_host_times(call, n))


def _record_launches(call):
    """The Triton launches one call makes: [(JITFunction, args, kwargs)] (the launch cache off, so
    that every launch goes through JITFunction.run)."""
    from triton.runtime.jit import JITFunction

    from minipaged.triton import launch

    seen = []
    orig, enabled = JITFunction.run, launch.ENABLED
    launch.ENABLED = False

    def spy(self, *args, grid, warmup, **kwargs):
        seen.append((self, args, dict(kwargs, grid=grid)))
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs)

    JITFunction.run = spy
    try:
        call()
    finally:
        JITFunction.run, launch.ENABLED = orig, enabled
    torch.cuda.synchronize()
    return seen


def _launch_costs(fn, args, kwargs, n: int) -> dict:
    """Host µs of fn.run (everything), of its binder alone, and of the compiled launcher alone."""
    from triton import knobs  # noqa: F401 - present in the triton versions that have the 5-tuple caches
    from triton.runtime.driver import driver

    grid = kwargs.pop("grid")
    row = dict(kernel=fn.__name__, args=len(args), kwargs=len(kwargs))
    row["run_us"] = _host_us(lambda: fn.run(*args, grid=grid, warmup=False, **kwargs), n)
    try:
        device = driver.active.get_current_device()
        stream = driver.active.get_current_stream(device)
        caches = fn.device_caches[device]
        binder = caches[-1]
        kw = dict(kwargs)
        kw.setdefault("debug", fn.debug)
        for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
            if hasattr(knobs.compilation, name):
                kw.setdefault(name, getattr(knobs.compilation, name))
        row["binder_us"] = _host_us(lambda: binder(*args, **kw), n)
        bound_args, _, _ = binder(*args, **kw)
        kernel = fn.run(*args, grid=grid, warmup=False, **kwargs)
        g = grid(bound_args) if callable(grid) else grid
        g = tuple(g) + (1,) * (3 - len(g))
        values = list(bound_args.values())
        meta = kernel.launch_metadata(g, stream, *values)

        def direct():
            kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, meta, None, None, *values)

        row["launcher_us"] = _host_us(direct, n)
        from minipaged.triton.launch import fast

        fk = fast(fn)
        fk.launch(grid, args, kwargs)  # the entry (a miss), then hits
        row["cache_hit_us"] = _host_us(lambda: fk.launch(grid, args, kwargs), n)
    except Exception as e:  # noqa: BLE001 - the floor is optional; the triton version may differ
        row["floor_error"] = f"{type(e).__name__}: {e}"
    return row


def mixed_step_inputs(dev, dt, num_q_heads: int, head_dim: int, page: int, num_blocks: int, gen):
    """A mixed paged step's (q [Tq, Hq, D], block_tables, cu_seqlens_q, context_lens): one chunk of
    256 queries over 1024 keys, then 15 single-query decodes over 600..838 keys, random pages."""
    ctx = [1024] + [600 + 17 * i for i in range(15)]
    qlens = [256] + [1] * 15
    width = max(-(-c // page) for c in ctx)
    tables = torch.randperm(num_blocks, device=dev, generator=gen)[: 16 * width].int().reshape(16, width)
    q = torch.randn(sum(qlens), num_q_heads, head_dim, device=dev, dtype=dt, generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32, device=dev)
    return q, tables, cu, torch.tensor(ctx, dtype=torch.int32, device=dev)


def _profile(call, n: int, top: int = 18) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        call()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: triton_launch_profile needs a CUDA GPU", file=sys.stderr)
        return 2
    from minipaged import registry

    dev, dt = torch.device("cuda"), torch.bfloat16
    Hq, Hkv, D, page = 16, 8, 128, 16
    g = torch.Generator(device=dev).manual_seed(0)
    nblk = 4096
    kc = torch.randn(nblk, page, Hkv, D, device=dev, dtype=dt, generator=g)
    vc = torch.randn_like(kc)
    scale = D ** -0.5
    b = registry.resolve("decode", "cuda", "triton")

    # decode B=1 L=4k
    tab1 = torch.randperm(nblk, device=dev, generator=g)[:256].int().reshape(1, 256)
    q1 = torch.randn(1, Hq, D, device=dev, dtype=dt, generator=g)
    lens1 = torch.full((1,), 4096, dtype=torch.int32, device=dev)
    dec = b.op("decode")

    qm, tabm, cu, lensm = mixed_step_inputs(dev, dt, Hq, D, page, nblk, g)
    paged = registry.resolve("paged", "cuda", "triton").op("paged")

    # write 272 tokens
    k_new = torch.randn(272, Hkv, D, device=dev, dtype=dt, generator=g)
    v_new = torch.randn_like(k_new)
    slots = torch.randperm(nblk * page, device=dev, generator=g)[:272]
    write = registry.resolve("write_kv_cache", "cuda", "triton").op("write_kv_cache")

    cases = {
        "decode B=1 L=4k": lambda: dec(q1, kc, vc, tab1, lens1, scale, False),
        "paged 256-chunk + 15 decodes": lambda: paged(qm, kc, vc, tabm, cu, lensm, 256, True, scale, False),
        "write_kv_cache 272 tokens": lambda: write(k_new, v_new, kc, vc, slots),
    }
    from minipaged.triton import launch

    rows = []
    for name, call in cases.items():
        for _ in range(30):
            call()
        torch.cuda.synchronize()
        on, off = [], []
        for _ in range(5):  # alternating rounds: the host's drift falls on both
            launch.ENABLED = True
            on.append(_host_us(call, args.calls // 5 or 1))
            launch.ENABLED = False
            off.append(_host_us(call, args.calls // 5 or 1))
        launch.ENABLED = True
        t, t_off = statistics.median(on), statistics.median(off)
        launches = _record_launches(call)
        row = dict(case=name, call_us=t, call_us_cache_off=t_off,
                   launches=[_launch_costs(f, a, k, args.calls) for f, a, k in launches])
        rows.append(row)
        print(f"== {name}: bare call {t:.1f} us with the launch cache, {t_off:.1f} us without; "
              f"{len(launches)} Triton launch(es)", flush=True)
        for lr in row["launches"]:
            print("   ", json.dumps(lr), flush=True)
        print(_profile(call, args.calls), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, triton=__import__("triton").__version__), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
