"""A/B of Triton's paged long-chunk kernel (v2) over FP8 pages: tiles widened to q's dtype (the
default) against fp16 dots (configs.paged_fp8_f16: a bf16 q moved into fp16's range once per
program, e4m3 -> fp16 one cvt per pair), on the paged grid's chunked and mixed rows (--kinds), with
the same rows over the 16-bit cache in the same run (issue #13/#15); on the spec row, the packed
tiles through v1 or v2's loop (configs.paged_packed_kernel), timed as CUDA-graph replays.

    PYTHONPATH=src python scripts/triton_paged_fp8_ab.py --json out.json

Each variant is first checked on a ragged batch (q_len 0..300, contexts to 4097, NaN-poisoned
unused slots) and a batch of decodes and speculative runs (packed tiles), and at q magnitudes 1 and 1e5 against the fp64 oracle on the dequantised cache;
one that fails is reported and not timed. Timing: minipaged.benchmark.timing.time_fn, cold L2,
median of --reps. --smoke runs the plumbing on CPU under the interpreter (fp16, tiny shapes,
the fp16-dot path forced); it measures nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from minipaged import testing
from minipaged.benchmark import cases as bench_cases
from minipaged.benchmark.timing import time_fn
from minipaged.triton import configs, ops
from ab_report import finish  # noqa: E402 - scripts/ is on sys.path when a script runs

# name -> overrides (the long kernel and the mixed mode are pinned to the defaults' values); the
# 64-row one-warpgroup tile that 16-bit pages take on sm_90 (configs._PAGED_LONG_SM90_D128)
_TILE64 = (64, 64, 4, 3)
VARIANTS = {"widen": {"paged_fp8_f16": 0}, "f16 dots": {"paged_fp8_f16": 1},
            "widen 64-row": {"paged_fp8_f16": 0, "paged": _TILE64},
            "f16 dots 64-row": {"paged_fp8_f16": 1, "paged": _TILE64},
            # packed tiles (the spec row): v1 (the default; it widens to q's dtype) or v2's loop
            "packed v1": {},
            "packed v2 widen": {"paged_packed_kernel": "v2", "paged_fp8_f16": 0},
            "packed v2 f16 dots": {"paged_packed_kernel": "v2", "paged_fp8_f16": 1},
            # the 16-bit pages' 16-row sm_90 tile (configs._PACKED_NARROW_SM90_D128)
            "packed v2 f16 dots 16,32,4,3": {"paged_packed_kernel": "v2", "paged_fp8_f16": 1,
                                             "paged": (16, 32, 4, 3)},
            # more fp8 bytes in flight at 4 programs per SM (scripts/triton_paged_sm90.py --inflight;
            # bench/results/nvidia-h200/triton_paged_fp8_inflight_offline/): 16,32,4,3 holds two
            # 8 KB K+V buffers per program, 64 KB per SM; these hold 128, 128 and 192 KB
            "packed v2 f16 dots 16,32,4,5": {"paged_packed_kernel": "v2", "paged_fp8_f16": 1,
                                             "paged": (16, 32, 4, 5)},
            "packed v2 f16 dots 16,64,4,3,128": {"paged_packed_kernel": "v2", "paged_fp8_f16": 1,
                                                 "paged": (16, 64, 4, 3, 128)},
            "packed v2 f16 dots 16,64,4,4,128": {"paged_packed_kernel": "v2", "paged_fp8_f16": 1,
                                                 "paged": (16, 64, 4, 4, 128)}}


def _with(overrides: dict, fn):
    for k, v in overrides.items():
        configs.set_override(k, v)
    try:
        return fn()
    finally:
        for k in overrides:
            configs.set_override(k, None)


def _inputs(case: testing.PagedCase, dtype, device, seed: int, poison: bool, q_mult: float = 1.0):
    """(16-bit inputs, the same over FP8 caches): (q, k_cache, v_cache, tables, cu_seqlens_q,
    context_lens, k_scale, v_scale), scales None for the 16-bit caches."""
    q, kc, vc, bt, cu, cl = testing.make_paged_inputs(case, dtype, device, seed=seed, poison=poison)
    q = (q.float() * q_mult).to(dtype)
    kc8, vc8, ks, vs = bench_cases.fp8_caches(kc, vc, spread=True)
    return (q, kc, vc, bt, cu, cl, None, None), (q, kc8, vc8, bt, cu, cl, ks, vs)


def _call(inp, max_q: int, lse: bool):
    q, kc, vc, bt, cu, cl, ks, vs = inp
    kw = {} if ks is None else {"k_scale": ks, "v_scale": vs}
    return ops.paged(q, kc, vc, bt, cu, cl, max_q, True, q.shape[-1] ** -0.5, lse, **kw)


def _check(variant: str, dtype, device) -> str:
    """'' if the variant matches the oracle on a ragged fp8 batch at two q magnitudes, else why."""
    big = device.type == "cuda"
    # a ragged batch with a long chunk, and one of decodes and speculative runs only (packed tiles)
    batches = [((300, 1, 97, 0, 17, 40), (1000, 4097, 97, 16, 200, 40)) if big else ((40, 1, 17, 0), (90, 30, 17, 5)),
               ((4, 1, 0, 3, 4, 1), (4097, 97, 16, 3, 40, 0)) if big else ((4, 1, 0, 3), (37, 17, 5, 2))]
    try:
        for (q_lens, ctxs), q_mult in [(b, m) for b in batches for m in (1.0, 1e5 if big else 3e3)]:
            case = testing.PagedCase("mixed", q_lens, ctxs, 16 if big else 4, 8 if big else 2, 128 if big else 64, 16)
            _, inp = _inputs(case, dtype, device, seed=5, poison=True, q_mult=q_mult)
            q, kc, vc, bt, cu, cl, ks, vs = inp
            keys, vals = testing.gather_kv(bench_cases.dequantize_fp8(kc, ks), bench_cases.dequantize_fp8(vc, vs),
                                           bt, cl)
            truth, truth_lse = testing.paged_ref(q, keys, vals, cu)
            # the low-precision yardstick in bf16 (an fp16 one overflows at large q: the smoke's)
            lowp, _ = testing.paged_ref(q.to(torch.bfloat16), keys, vals, cu, lowp=True)
            out, lse = _with(VARIANTS[variant], lambda inp=inp: _call(inp, max(q_lens), True))
            testing.assert_close(out, truth, lowp, f"{variant} q x {q_mult}", lse=lse, truth_lse=truth_lse)
    except Exception as e:  # noqa: BLE001 - a variant that does not build or is wrong is reported
        return f"{type(e).__name__}: {str(e)[:300]}"
    return ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter plumbing check, tiny shapes")
    ap.add_argument("--only", nargs="*", help="substrings of the variant names to run (default all)")
    ap.add_argument("--kinds", nargs="*", default=["chunked", "mixed"],
                    help="kinds of the paged grid's rows to time (chunked, spec, mixed), or decode: "
                         "decode steps through paged_attention (B=8 L=4k, B=64 L=8k), which run the packed tile")
    args = ap.parse_args()
    variants = [v for v in VARIANTS if not args.only or any(x in v for x in args.only)]
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float16 if args.smoke else torch.bfloat16
    if args.smoke:
        rows = [testing.PagedCase("chunked", (40, 40), (70, 70), 4, 2, 64, 16),
                testing.PagedCase("spec", (4, 4), (37, 20), 4, 2, 64, 16)]
        rows = [c for c in rows if c.kind in args.kinds]
    else:
        rows = [c for c in bench_cases.standard_paged_cases() if c.kind in args.kinds]
        if "decode" in args.kinds:
            rows += [testing.PagedCase("decode", (1,) * b, (n,) * b, **bench_cases.QWEN3_HEADS) for b, n in ((8, 4096), (64, 8192))]
    t0 = time.time()
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype),
               "failed": {}, "rows": []}
    ok = []
    for v in variants:
        why = _check(v, dtype, device)
        print(f"check {v}: {'ok' if not why else why}", flush=True)
        if why:
            results["failed"][v] = why
        else:
            ok.append(v)
    for case in rows:
        label = f"{case.kind} q={list(case.q_lens)[:2]}{'...' if len(case.q_lens) > 2 else ''} L={case.context_lens[0]}"
        row = {"case": label}
        timings = {}
        inp16, inp8 = _inputs(case, dtype, device, seed=0, poison=False)
        # the 16-bit cache: the defaults, and on packed rows also through v2
        base16 = {"16-bit": {}, **({"16-bit packed v2": {"paged_packed_kernel": "v2"}}
                                    if case.kind in ("spec", "decode") else {})}
        for inp, names in ((inp16, list(base16)), (inp8, ok)):
            for name in names:
                over = base16[name] if name in base16 else VARIANTS[name]
                max_q = max(case.q_lens)
                # spec and decode rows are microseconds long: CUDA-graph replays, as minipaged bench times them
                t = time_fn(lambda over=over, inp=inp, max_q=max_q: _with(over, lambda: _call(inp, max_q, False)),
                            device=device, reps=args.reps, min_reps=min(10, args.reps), max_time_s=2.0,
                            cuda_graph=case.kind in ("spec", "decode") and device.type == "cuda")
                timings[name] = t.median_ms * 1e3
        row["us"] = timings
        base = timings["16-bit"]
        print(f"{label:40s} " + "  ".join(f"{k} {v:8.1f} us ({v / base:.2f}x)" for k, v in timings.items()),
              flush=True)
        results["rows"].append(row)
    return finish(results, args.json, t0, bool(results["failed"]))


if __name__ == "__main__":
    sys.exit(main())
