"""A/B of Triton's decode tile on FP8 KV caches (issue #15), on the H200.

The fp8 decode rows of `minipaged bench --kv-cache-dtype fp8` run Triton's decode kernel with
the 16-bit tile (configs.decode_config: BLOCK_N 64, 4 warps, 2 stages) and take as long as the
bf16 rows, although they read half the bytes: a BLOCK_N-key tile of fp8 K/V is half the bytes
in flight of a 16-bit one. This times every candidate tile (configs.set_override("decode", ...))
on the standard decode grid, 16-bit (bf16) cache and fp8 cache, same run, and prints each fp8
time over the 16-bit time of the default tile (the issue's target: <= 0.55 at B=64 L=8k and B=1 L=32k).

    PYTHONPATH=src python scripts/triton_fp8_decode_ab.py --json bench/results/nvidia-h200/triton_fp8_decode_ab.json

Every tile is first checked on a ragged batch (contexts 1, 17, 1000, 4097, NaN-poisoned unused
cache slots) against the fp64 oracle of minipaged.testing on the same dequantised fp8 cache;
a tile that fails is reported and not timed. Timing: minipaged.benchmark.timing.time_fn,
CUDA-graph replays, cold L2 (read flush between replays), median of --reps.
--smoke runs the plumbing on CPU under the interpreter (fp16, tiny shapes); it measures nothing.
"""

from __future__ import annotations

import argparse
import os
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

# (BLOCK_N, WARPS, STAGES); None = the default tile. At b170871 / 788832e no tile made the fp8
# rows faster than the 16-bit ones; the sm_90 SASS (scripts/triton_decode_sm90.py) says why: the
# fp8 loop is 833 instructions per tile against 423 for bf16 (e4m3 -> fp16 -> bf16 widening).
TILES = [None, (128, 4, 2), (128, 8, 2), (128, 4, 3), (64, 4, 3), (256, 8, 2)]
# configs.decode_fp8_f16 (fp16 dots: a 640-instruction loop) on these tiles as well
F16_TILES = [None, (128, 4, 2), (128, 4, 3)]
# fp8 modes: "widen" (tiles widened to q's dtype), "f16" (configs.decode_fp8_f16, the default),
# "words" / "planes" (and configs.decode_fp8_words 1 / 2: full tiles read as int32 words, widened
# into one tile or four column planes; 554 / 478 instructions per tile under triton 3.6)
MODES = ("widen", "f16", "words", "planes")


def _set_mode(mode: str | None) -> None:
    """The overrides of fp8 mode `mode` (None: release them). A "+ahead" suffix also reads the
    full tiles' block ids a tile ahead (configs.decode_table_ahead), on either cache, and "+noahead" in
    the same iteration (neither: the tile's own table_ahead, False for a forced tile); a "+sN" suffix
    forces N KV splits per (sequence, KV head)."""
    base, *flags = (mode or "").split("+")
    splits = [int(f[1:]) for f in flags if f[:1] == "s"]
    configs.set_override("decode_fp8_f16", None if mode is None else int(base != "widen"))
    configs.set_override("decode_fp8_words", None if mode is None else {"words": 1, "planes": 2}.get(base, 0))
    # neither suffix: the tile's own choice (configs.decode_config's tiles carry one)
    ahead = 1 if "ahead" in flags else 0 if "noahead" in flags else None
    configs.set_override("decode_table_ahead", None if mode is None else ahead)
    configs.set_override("decode_splits", splits[0] if splits else None)


def _fp8(k_cache, v_cache):
    return bench_cases.fp8_caches(k_cache, v_cache)


def _check(tile, dtype, device, mode="widen") -> str:
    """'' if `tile` matches the oracle on a ragged fp8 batch, else why not."""
    case = testing.DecodeCase.of([1, 17, 1000, 4097] if device.type == "cuda" else [1, 17, 40], 16 if
                                 device.type == "cuda" else 4, 8 if device.type == "cuda" else 2,
                                 128 if device.type == "cuda" else 64)
    q, kc, vc, bt, cl = testing.make_decode_inputs(case, dtype, device, seed=3)
    kc8, vc8, ks, vs = _fp8(kc, vc)
    keys, vals = testing.gather_kv(bench_cases.dequantize_fp8(kc8, ks), bench_cases.dequantize_fp8(vc8, vs), bt, cl)
    truth, truth_lse = testing.decode_ref(q, keys, vals)
    lowp, _ = testing.decode_ref(q, keys, vals, lowp=True)
    configs.set_override("decode", tile)
    _set_mode(mode)
    try:
        out, lse = mp.decode_attention(q, kc8, vc8, bt, cl, k_scale=ks, v_scale=vs, return_lse=True, backend="triton")
        testing.assert_close(out, truth, lowp, f"tile {tile} {mode}", lse=lse, truth_lse=truth_lse)
    except Exception as e:  # noqa: BLE001 - a tile that does not build or is wrong is reported
        return f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        configs.set_override("decode", None)
        _set_mode(None)
    return ""


def _time(case, tile, fp8: bool, dtype, device, reps: int, mode: str = "widen") -> float:
    q, kc, vc, bt, cl = testing.make_decode_inputs(case, dtype, device, seed=0, poison=False)
    kw = {}
    if fp8:
        kc, vc, ks, vs = _fp8(kc, vc)
        kw = dict(k_scale=ks, v_scale=vs)
    configs.set_override("decode", tile)
    _set_mode(mode)
    try:
        fn = lambda: mp.decode_attention(q, kc, vc, bt, cl, backend="triton", check_values=False, **kw)  # noqa: E731
        t = time_fn(fn, device=device, reps=reps, cuda_graph=device.type == "cuda", max_time_s=2.0)
    finally:
        configs.set_override("decode", None)
        _set_mode(None)
    return t.median_ms * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--cases", help="only these rows of the grid, by label, comma-separated ('B=1 L=32768')")
    ap.add_argument("--no-fp8", action="store_true", help="time the 16-bit cache only (the 'widen' variants)")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter plumbing check, tiny shapes")
    ap.add_argument("--variants", help="only these, comma-separated: 'default', 'default-f16', "
                    "'default-words', '128x4x2', '128x4x2-f16', '128x4x2x168-planes', ... (BLOCK_N x WARPS x STAGES "
                    "[x MAXNREG]; a '+ahead' suffix: and configs.decode_table_ahead, e.g. '64x4x4-planes+ahead', '+s32': 32 splits, "
                    "'64x4x3-widen+ahead' for the 16-bit rows; -f16: "
                    "decode_fp8_f16; -words / -planes: and decode_fp8_words 1 / 2; neither: tiles widened to q's dtype)")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float16 if args.smoke else torch.bfloat16
    grid = bench_cases.quick_decode_cases() if args.smoke else bench_cases.standard_decode_cases()
    if args.cases:
        grid = [c for c in grid if c.label in args.cases.split(",")]
    variants = ([(t, "widen") for t in TILES] + [(t, "f16") for t in F16_TILES]
                + [(None, "words"), ((128, 4, 2), "words"), (None, "planes"), ((128, 4, 2), "planes")])
    if args.variants:
        def parse(v):
            tile, _, mode = v.partition("-")
            return (None if tile == "default" else tuple(int(x) for x in tile.split("x")), mode or "widen")
        variants = [parse(v) for v in args.variants.split(",") if v]
        def known(mode):
            base, *flags = mode.split("+")
            return base in MODES and all(f in ("ahead", "noahead") or (f[:1] == "s" and f[1:].isdigit())
                                         for f in flags)
        bad = [m for _, m in variants if not known(m)]
        if bad:
            ap.error(f"unknown fp8 mode(s) {bad}: want one of {MODES}, optionally with '+ahead' or '+noahead' and '+s<splits>'")
    if args.smoke:
        variants = [(None, m) for m in MODES] + [(None, "planes+ahead"), (None, "planes+ahead+s2")]
    t0 = time.time()
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "dtype": str(dtype), "rows": [], "failed": {}}
    ok = []
    for tile, mode in variants:
        name = f"{tile}{'' if mode == 'widen' else ' ' + mode}"
        why = _check(tile, dtype, device, mode)
        print(f"check tile {name}: {'ok' if not why else why}", flush=True)
        if why:
            results["failed"][name] = why
        else:
            ok.append((tile, mode, name))
    for case in grid:
        base = _time(case, None, False, dtype, device, args.reps)
        row = {"case": case.label, "16bit_default_us": base, "16bit": {}, "fp8": {}}
        for tile, mode, name in ok:
            if mode.partition("+")[0] == "widen":  # the 16-bit rows depend on no fp8 mode, only on "+ahead"
                row["16bit"][name] = (base if tile is None and mode == "widen"
                                      else _time(case, tile, False, dtype, device, args.reps, mode))
            if not args.no_fp8:
                row["fp8"][name] = _time(case, tile, True, dtype, device, args.reps, mode)
        if args.no_fp8:
            cells = "  ".join(f"{k}: {v:.1f} ({v / base:.3f}x)" for k, v in row["16bit"].items())
        else:
            best = min(row["fp8"], key=row["fp8"].get)
            cells = ("  ".join(f"{k}: 16-bit {row['16bit'].get(k, float('nan')):.1f} fp8 {v:.1f} ({v / base:.2f}x)"
                               for k, v in row["fp8"].items()) + f" | best fp8 {best} {row['fp8'][best] / base:.2f}x")
        print(f"{case.label:14s} 16-bit default {base:8.1f} us | {cells}", flush=True)
        results["rows"].append(row)
    return finish(results, args.json, t0, bool(results["failed"]) and not ok)


if __name__ == "__main__":
    sys.exit(main())
