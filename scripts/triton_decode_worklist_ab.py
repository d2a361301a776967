"""A/B of Triton's work-list decode (configs.decode_worklist) against the plain plan, on the H200.

The plain plan sizes its KV splits from the block table's width, the same for every sequence:
a batch of 64 gets one program per (sequence, KV head), so one 32k sequence among 1k ones runs
its 32k keys in 8 programs while the GPU idles (the bench's one-long row, 0.11x FlashInfer at
19ecb43). The work list gives each sequence programs in proportion to its length, planned on
the device from context_lens (decode.py, WORKLIST). This times both on the standard decode grid
(16-bit and fp8 caches), the two interleaved in each of --rounds rounds, same process, and
prints work list / plain per row (--modes: also "worklist2", twice the work list's budget, and
"default", configs.decode_worklist's own choice; "specialised", the default with num_splits
specialised again in _decode_kernel and _decode_reduce, as before they left it to the runtime so
that a serving batch's changing split count compiles nothing). --grid wide adds tables wider than their
lengths (an engine's fixed-width tables), where the default takes the work list on shapes alone.

    PYTHONPATH=src python scripts/triton_decode_worklist_ab.py --json OUT.json [--rounds 2]

Each mode is first checked on an uneven batch (one long sequence among short and empty ones,
NaN-poisoned unused cache slots) against the fp64 oracle of minipaged.testing, 16-bit and fp8;
the timing runs only if both pass. Timing: minipaged.benchmark.timing.time_fn, CUDA-graph
replays, cold L2 (read flush between replays), median of --reps.
--smoke runs the plumbing on CPU under the interpreter (fp16, tiny shapes); it measures nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

import minipaged as mp
from minipaged import testing
from minipaged.benchmark import cases as bench_cases
from minipaged.benchmark.timing import time_fn
from minipaged.triton import configs
from ab_report import finish  # noqa: E402 - scripts/ is on sys.path when a script runs

# mode -> (work list on, budget factor): "worklist2" doubles the work list's split budget S
# (configs.decode_num_splits of one sequence), so a long sequence can take twice the splits
# and equal lengths get twice the plain plan's
# "default": no override, what configs.decode_worklist picks from the shapes
MODES = {"plain": (0, 1), "worklist": (1, 1), "worklist2": (1, 2), "default": (None, 1), "specialised": (None, 1)}
# "specialised": the decode kernels re-jitted without do_not_specialize (built once)
_SPECIALISED: dict = {}


@contextlib.contextmanager
def _kernels(mode: str):
    """The decode kernels `mode` launches, swapped into the triton backend for the block."""
    if mode != "specialised":
        yield
        return
    import triton

    from minipaged.triton import decode, ops

    if not _SPECIALISED:
        for name in ("_decode_kernel", "_decode_reduce"):
            _SPECIALISED[name] = triton.jit(getattr(decode, name).fn)
    saved = {name: getattr(ops, name) for name in _SPECIALISED}
    try:
        for name, kernel in _SPECIALISED.items():
            setattr(ops, name, kernel)
        yield
    finally:
        for name, kernel in saved.items():
            setattr(ops, name, kernel)


def _overrides(mode: str, q, k_cache, block_tables) -> dict:
    """The configs overrides of `mode` for a decode of these shapes."""
    on, factor = MODES[mode]
    if on is None:
        return {}
    batch, _, head_dim = q.shape
    # (a batch the work list does not take keeps the plain plan: no budget to change)
    if factor == 1 or not 2 <= batch <= configs.MAX_WORKLIST_BATCH:
        return {"decode_worklist": on}
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    cfg = configs.decode_config(head_dim, q.dtype, q.device, k_cache.dtype == torch.float8_e4m3fn,
                                batch * num_kv_heads)
    budget = configs.decode_num_splits(1, num_kv_heads, block_tables.shape[1] * page_size, cfg.block_n, q.device)
    return {"decode_worklist": on, "decode_splits": factor * budget}


def _inputs(case, dtype, device, fp8: bool, seed: int, poison: bool = True, spare_columns: int = 1):
    q, kc, vc, bt, cl = testing.make_decode_inputs(case, dtype, device, seed=seed, poison=poison,
                                                   spare_columns=spare_columns)
    if not fp8:
        return q, kc, vc, bt, cl, {}
    kc8, vc8, ks, vs = bench_cases.fp8_caches(kc, vc)
    return q, kc8, vc8, bt, cl, dict(k_scale=ks, v_scale=vs)


def _check(mode: str, fp8: bool, dtype, device) -> str:
    """'' if `mode` matches the oracle on an uneven batch, else why not."""
    gpu = device.type == "cuda"
    lens = [1024] * 20 + [0, 1, 17, 20000] if gpu else [300, 0, 17, 1, 33]
    case = testing.DecodeCase.of(lens, 16 if gpu else 4, 8 if gpu else 2, 128 if gpu else 64)
    q, kc, vc, bt, cl, kw = _inputs(case, dtype, device, fp8, seed=3)
    kd, vd = ((bench_cases.dequantize_fp8(kc, kw["k_scale"]), bench_cases.dequantize_fp8(vc, kw["v_scale"]))
              if fp8 else (kc, vc))
    keys, vals = testing.gather_kv(kd, vd, bt, cl)
    truth, truth_lse = testing.decode_ref(q, keys, vals)
    lowp, _ = testing.decode_ref(q, keys, vals, lowp=True)
    try:
        with configs.overriding(**_overrides(mode, q, kc, bt)), _kernels(mode):
            out, lse = mp.decode_attention(q, kc, vc, bt, cl, return_lse=True, backend="triton", **kw)
        testing.assert_close(out, truth, lowp, f"{mode} fp8={fp8}", lse=lse, truth_lse=truth_lse)
    except Exception as e:  # noqa: BLE001 - a mode that is wrong is reported, not timed
        return f"{type(e).__name__}: {str(e)[:300]}"
    return ""


def _time(inputs, mode: str, device, reps: int) -> float:
    q, kc, vc, bt, cl, kw = inputs
    with configs.overriding(**_overrides(mode, q, kc, bt)), _kernels(mode):
        fn = lambda: mp.decode_attention(q, kc, vc, bt, cl, backend="triton", check_values=False, **kw)  # noqa: E731
        t = time_fn(fn, device=device, reps=reps, cuda_graph=device.type == "cuda", max_time_s=2.0)
    return t.median_ms * 1e3


def _wide_rows() -> list:
    """(case, spare table columns, label): batches whose table is wider than their lengths, as
    an engine's fixed-width tables are; the ones configs.decode_worklist takes by default
    (the plain plan's split of the width is over WORKLIST_MIN_SPAN) without being uneven, so
    they show what the default costs where the work list has nothing to balance."""
    heads = bench_cases.QWEN3_HEADS
    rows = []
    for batch, length, width in [(64, 1024, 32768), (64, 8192, 32768), (32, 32768, 32768), (256, 1024, 16384)]:
        case = testing.DecodeCase(batch, length, **heads, block_size=16)
        rows.append((case, (width - length) // 16 + 1, f"{case.label} table {width}"))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved plain / work-list rounds per row")
    ap.add_argument("--no-fp8", action="store_true", help="16-bit caches only")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter plumbing check, tiny shapes")
    ap.add_argument("--grid", choices=["standard", "wide", "all"], default="all",
                    help="the standard decode grid, the wide-table rows (_wide_rows), or both")
    ap.add_argument("--modes", default="plain,worklist", help=f"comma-separated, from {list(MODES)}; the first "
                    "is the baseline of the ratios")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes) or len(modes) < 2:
        ap.error(f"--modes: two or more of {list(MODES)}, got {args.modes!r}")
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float16 if args.smoke else torch.bfloat16
    if args.smoke:
        grid = [(c, 1, c.label) for c in bench_cases.quick_decode_cases()]
        grid.append((testing.DecodeCase.of((16,) * 3 + (256,), **bench_cases.QUICK_HEADS, block_size=16), 1,
                     "smoke uneven"))
        grid.append((testing.DecodeCase(4, 16, **bench_cases.QUICK_HEADS, block_size=16), 16, "smoke wide table"))
    else:
        grid = [(c, 1, c.label) for c in bench_cases.standard_decode_cases()] if args.grid != "wide" else []
        grid += _wide_rows() if args.grid != "standard" else []
    caches = [False] if args.no_fp8 else [False, True]
    t0 = time.time()
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "dtype": str(dtype), "triton": __import__("triton").__version__, "rows": [], "failed": {}}
    for fp8 in caches:
        for mode in modes:
            why = _check(mode, fp8, dtype, device)
            print(f"check {mode} fp8={fp8}: {'ok' if not why else why}", flush=True)
            if why:
                results["failed"][f"{mode} fp8={fp8}"] = why
    if results["failed"]:
        print("a check failed: nothing timed")
    else:
        for fp8 in caches:
            for case, spare_columns, label in grid:
                inputs = _inputs(case, dtype, device, fp8, seed=0, poison=False, spare_columns=spare_columns)
                times = {mode: [] for mode in modes}
                for _ in range(args.rounds):
                    for mode in modes:
                        times[mode].append(_time(inputs, mode, device, args.reps))
                del inputs
                med = {mode: statistics.median(ts) for mode, ts in times.items()}
                base = med[modes[0]]
                row = {"case": label, "kv": "fp8" if fp8 else "16-bit", "us": times,
                       "ratio": {mode: med[mode] / base for mode in modes[1:]}}
                results["rows"].append(row)
                print(f"{label:40s} {row['kv']:6s} {modes[0]} {base:9.1f} us  "
                      + "  ".join(f"{m} {med[m]:9.1f} us {row['ratio'][m]:.3f}x" for m in modes[1:]), flush=True)
    return finish(results, args.json, t0, bool(results["failed"]))


if __name__ == "__main__":
    sys.exit(main())
