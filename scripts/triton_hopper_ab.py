"""A/B of the Triton prefill kernels on sm_90: the pointer kernel (prefill._attn_fwd, its
config table) against each Hopper variant of prefill_tma ("tma": TMA descriptors; "tma_ws":
the same with the compiler's warp-specialised key loop; "gluon": prefill_gluon's hand-split
loader and consumer warpgroups), each at its table tile and a few alternative tiles. Issue #16,
item 4.

    PYTHONPATH=src python scripts/triton_hopper_ab.py --json bench/results/nvidia-h200/triton_hopper_ab.json

Grid: bf16, Hq/Hkv 16/8, D 128 and 64, causal and not; dense B=1 N=1k/4k/8k/16k and B=8
N=1k; varlen (a mixed batch of 8 prompts, and 4 chunks over cached prefixes).
Timing: minipaged.benchmark.timing.time_fn, one CUDA event pair per call, L2 emptied by
reading a 256 MB buffer between calls (outside the events), median of --reps (>= 20) calls.
TFLOP/s = 4 * B * Hq * D * visible (query, key) pairs / time.
Before timing, each kernel's output on the same inputs is checked against the fp64 oracle
of minipaged.testing (dense: the first and last 256 query rows, which hold every tile edge,
as the smaller problems they are; varlen: every row): max error <= 2 x that of plain bf16
math + 4e-3. A kernel that fails the check is reported and not timed.

Robust to a variant that does not build on the installed triton: every (kernel, tile, head
dim, causal, dense/varlen) is first compiled in child processes (in parallel, one per kernel
and tile), so a compiler crash, even an abort, only marks that combination failed.

What to read: the summary's "vs pointer" column, per case, for each variant at its table
tile. If one variant wins on every row, set configs.SM90_PREFILL_VARIANT to it; if an
alternative tile wins, move it into configs._PREFILL_SM90_HOPPER first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback

import torch

HQ, HKV = 16, 8
DT = torch.bfloat16
DENSE = [(1, 1024), (1, 4096), (1, 8192), (1, 16384), (8, 1024)]
# (q lens, k lens): a batch of fresh prompts (q == k), and chunks over cached prefixes (q < k)
VARLEN = [
    ((3000, 1024, 512, 2048, 100, 4096, 777, 1500),) * 2,
    ((512, 512, 2048, 1024), (4608, 1536, 10240, 3072)),
]
# alternative tiles per (variant, head_dim), (BM, BN, warps, stages); None = the table's tile
TILES = {
    # one-warpgroup tiles (two resident programs per SM by shared memory and registers: 64/64/4/3
    # is 112 KB and 216 registers under triton 3.9) and the 2-stage 128-row tile (96 KB)
    ("pointer", 128): [None, (64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 2)],
    ("pointer", 64): [None],
    # the pointer kernel with configs.prefill_lazy_rescale = 8 (rescale only on a max growth > 2^8)
    ("pointer_lazy", 128): [None],
    ("pointer_lazy", 64): [None],
    ("tma", 128): [None, (128, 128, 8, 2)],
    ("tma", 64): [None, (128, 64, 8, 3)],
    ("tma_ws", 128): [None, (128, 64, 4, 3), (128, 64, 4, 2)],
    ("tma_ws", 64): [None, (128, 128, 4, 2), (128, 64, 4, 3)],
    # gluon: BM is fixed at two consumers' 64 rows; BN and the ring depth vary (3 stages of
    # 128-key tiles at D=128 are 225 KB of the 227 KB)
    ("gluon", 128): [None, (128, 128, 4, 3), (128, 64, 4, 2), (128, 64, 4, 4)],
    ("gluon", 64): [None, (128, 128, 4, 3)],
    # the Gluon kernel's ablation steps (GLUON_STEPS), at its table tile
    ("gluon_serial_noregs", 128): [None],
    ("gluon_serial", 128): [None],
    ("gluon_noregs", 128): [None],
    ("gluon_l2", 128): [None],
    ("gluon_plain_order", 128): [None],
}
# Gluon ablation variants: the overrides each sets on top of variant "gluon". serial: each tile's
# Q K^T, softmax and P V in turn (no intra-warpgroup overlap); noregs: every partition keeps the
# launch's 168 registers (no setmaxnreg reallocation from the loader to the consumers).
_NOREGS = "168,168"
GLUON_STEPS = {
    "gluon_serial_noregs": {"gluon_overlap": 0, "gluon_regs": _NOREGS},
    "gluon_serial": {"gluon_overlap": 0},
    "gluon_noregs": {"gluon_regs": _NOREGS},
    # the programs in L2 sections when a grid's K/V exceed the L2 (16k and varlen rows; the default
    # since f4d9723), and the plain order
    "gluon_l2": {"gluon_l2_sections": 1},
    "gluon_plain_order": {"gluon_l2_sections": 0},
}
CHECK_ROWS = 256
DEVICE = "cuda"


def _smoke_setup():
    """--smoke: the same code paths on CPU under the Triton interpreter, tiny shapes, fp16
    (the interpreter's bf16 dot is wrong); checks the plumbing, measures nothing."""
    global DT, DENSE, VARLEN, CHECK_ROWS, DEVICE, HQ, HKV
    os.environ["TRITON_INTERPRET"] = "1"
    DT, DEVICE, HQ, HKV, CHECK_ROWS = torch.float16, "cpu", 4, 2, 16
    DENSE = [(1, 48), (2, 33)]
    VARLEN = [((17, 0, 40),) * 2, ((5, 16), (30, 16))]


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _label(variant, tile):
    return variant if tile is None else f"{variant}@{','.join(map(str, tile))}"


# ------------------------------------------------------------------------ the kernels


def _call(variant, tile, args, varlen, causal, scale):
    """One launch of `variant` at `tile` (None: its table tile); returns the output."""
    from minipaged.triton import configs, ops, prefill_tma

    configs.set_override("prefill", tile)
    steps = GLUON_STEPS.get(variant, {})
    for name, value in steps.items():
        configs.set_override(name, value)
    if steps:
        variant = "gluon"
    try:
        if variant in ("pointer", "pointer_lazy"):
            configs.set_override("prefill_variant", "pointer")
            configs.set_override("prefill_lazy_rescale", 8 if variant == "pointer_lazy" else None)
            return (ops.prefill_varlen(*args, causal, scale) if varlen else ops.prefill(*args, causal, scale))
        fn = prefill_tma.try_prefill_varlen if varlen else prefill_tma.try_prefill
        return fn(*args, causal, scale, False, variant=variant)
    finally:
        configs.set_override("prefill", None)
        configs.set_override("prefill_variant", None)
        configs.set_override("prefill_lazy_rescale", None)
        for name in steps:
            configs.set_override(name, None)


def _combo_key(variant, tile, d, causal, varlen):
    return f"{_label(variant, tile)}|d{d}|{'causal' if causal else 'full'}|{'varlen' if varlen else 'dense'}"


def _small_args(d, varlen):
    from minipaged.testing import PrefillCase, VarlenCase, make_prefill_inputs, make_varlen_inputs

    if varlen:
        q, k, v, cq, ck = make_varlen_inputs(VarlenCase((256, 160), (256, 320), HQ, HKV, d), DT, DEVICE)
        return (q, k, v, cq, ck, 256, 320)
    return make_prefill_inputs(PrefillCase(1, 256, 256, HQ, HKV, d), DT, DEVICE)


def _compile_child(combos: list[str]) -> int:
    """Child process: compile each combination by one small launch, one line per result."""
    for key in combos:
        label, d, causal, varlen = key.split("|")
        variant, _, t = label.partition("@")
        tile = tuple(int(x) for x in t.split(",")) if t else None
        d = int(d[1:])
        try:
            _call(variant, tile, _small_args(d, varlen == "varlen"), varlen == "varlen", causal == "causal",
                  1 / math.sqrt(d))
            _sync()
            print(f"OK {key}", flush=True)
        except Exception as e:  # a combination that does not build is a result
            msg = " ".join(str(e).split())[:300]
            print(f"FAIL {key} {type(e).__name__}: {msg}", flush=True)
    return 0


def precompile(groups: dict[str, list[str]], timeout_s: float) -> dict[str, str]:
    """Compile every combination in child processes (one per kernel and tile, run in
    parallel); returns {combination: "" (ok) or the reason it failed}. A child that dies
    takes only the combination it was compiling with it: the rest are retried."""
    status: dict[str, str] = {}
    pending = {g: list(c) for g, c in groups.items()}
    deadline = time.time() + timeout_s
    while any(pending.values()):
        procs = {}
        for g, combos in pending.items():
            if combos:
                smoke = ["--smoke"] if DEVICE == "cpu" else []
                procs[g] = subprocess.Popen([sys.executable, __file__, *smoke, "--compile-child", *combos],
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for g, p in procs.items():
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
            done = set()
            for line in out.splitlines():
                word, _, rest = line.partition(" ")
                if word in ("OK", "FAIL"):
                    key, _, why = rest.partition(" ")
                    status[key] = "" if word == "OK" else why
                    done.add(key)
            left = [c for c in pending[g] if c not in done]
            if left:
                # the child died (or ran out of time) while building left[0]; the rest go again
                tail = " ".join(err.strip().splitlines()[-3:])[:300]
                status[left[0]] = f"compiler process exited with {p.returncode}: {tail}"
                left = left[1:]
                if time.time() >= deadline:
                    for c in left:
                        status[c] = "not compiled: precompile time limit"
                    left = []
            pending[g] = left
    return status


# ------------------------------------------------------------------------ checks and timing


def _check(out, truth, lowp) -> tuple[float, float]:
    o = out.double()
    err = (o - truth).abs().max().item()
    bound = 2.0 * (lowp - truth).abs().max().item() + 4e-3
    return err, bound


def _dense_bands(n):
    """Query row bands checked against the oracle: everything for short prompts, else the
    first and last CHECK_ROWS rows."""
    if n <= 2 * CHECK_ROWS:
        return [(0, n)]
    return [(0, CHECK_ROWS), (n - CHECK_ROWS, n)]


def dense_reference(q, k, v, causal, scale):
    """[(row band, truth, lowp)]; for Nq == Nk a band [a, b) of a causal problem is the
    problem q[a:b] over keys [0, b) (bottom-right alignment), of a non-causal one q[a:b]
    over every key."""
    from minipaged.testing import prefill_ref

    refs = []
    n = q.shape[2]
    for a, b in _dense_bands(n):
        kk, vv = (k[:, :, :b], v[:, :, :b]) if causal else (k, v)
        t, _ = prefill_ref(q[:, :, a:b], kk, vv, causal=causal, scale=scale)
        lo, _ = prefill_ref(q[:, :, a:b], kk, vv, causal=causal, scale=scale, lowp=True)
        refs.append(((a, b), t, lo))
    return refs


def run(args) -> dict:
    import triton

    from minipaged.benchmark import timing
    from minipaged.benchmark.flops import visible_pairs
    from minipaged.testing import PrefillCase, VarlenCase, make_prefill_inputs, make_varlen_inputs, varlen_ref

    if DEVICE == "cuda":
        dev = torch.device("cuda")
        meta = {"device": torch.cuda.get_device_properties(dev).name,
                "capability": list(torch.cuda.get_device_capability(dev))}
    else:
        meta = {"device": "cpu (interpreter smoke run: the numbers mean nothing)"}
    meta |= {"triton": triton.__version__, "torch": torch.__version__, "reps": args.reps,
            "l2_flush": timing.l2_flush_mode(), "dtype": "bf16", "hq": HQ, "hkv": HKV}
    try:
        meta["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
    except OSError:
        pass
    from minipaged.triton import configs

    meta["sm90_prefill_variant_default"] = configs.SM90_PREFILL_VARIANT
    dims = [int(x) for x in args.head_dims.split(",")]
    variants = args.variants.split(",")
    causals = [True, False] if args.causal == "both" else [args.causal == "causal"]

    combos = {}
    for variant in variants:
        for d in dims:
            for tile in TILES.get((variant, d), [None]):
                g = _label(variant, tile) + f"|d{d}"
                combos[g] = [_combo_key(variant, tile, d, c, vl) for c in causals for vl in (False, True)]
    print(f"# precompiling {sum(map(len, combos.values()))} kernels in {len(combos)} processes", flush=True)
    t0 = time.time()
    built = precompile(combos, args.compile_timeout)
    print(f"# precompile took {time.time() - t0:.0f} s", flush=True)
    failed = {k: v for k, v in built.items() if v}
    for k, v in failed.items():
        print(f"# BUILD FAILED {k}: {v}", flush=True)

    rows = []
    cases = [("dense", B, N, None) for B, N in DENSE] + [("varlen", None, None, lens) for lens in VARLEN]
    for d in dims:
        scale = 1 / math.sqrt(d)
        for causal in causals:
            for kind, B, N, lens in cases:
                varlen = kind == "varlen"
                if varlen:
                    case = VarlenCase(tuple(lens[0]), tuple(lens[1]), HQ, HKV, d, causal)
                    q, k, v, cq, ck = make_varlen_inputs(case, DT, DEVICE, seed=1)
                    call_args = (q, k, v, cq, ck, max(lens[0]), max(lens[1]))
                    pairs = sum(visible_pairs(a, b, causal) for a, b in zip(*lens))
                    flops = 4 * HQ * d * pairs
                    name = f"varlen S={len(lens[0])} Tq={sum(lens[0])} Tk={sum(lens[1])}"
                    truth, _ = varlen_ref(q, k, v, cq, ck, causal=causal, scale=scale)
                    lowp, _ = varlen_ref(q, k, v, cq, ck, causal=causal, scale=scale, lowp=True)
                    refs = [(None, truth, lowp)]
                else:
                    q, k, v = make_prefill_inputs(PrefillCase(B, N, N, HQ, HKV, d, causal), DT, DEVICE, seed=1)
                    call_args = (q, k, v)
                    flops = 4 * B * HQ * d * visible_pairs(N, N, causal)
                    name = f"B={B} N={N}"
                    refs = dense_reference(q, k, v, causal, scale)
                base = {"case": name, "kind": kind, "head_dim": d, "causal": causal, "flops": flops}
                pointer_ms = None
                for variant in variants:
                    for tile in TILES.get((variant, d), [None]):
                        row = dict(base, variant=variant, tile=list(tile) if tile else None,
                                   label=_label(variant, tile))
                        key = _combo_key(variant, tile, d, causal, varlen)
                        if built.get(key):
                            row["error"] = f"build: {built[key]}"
                        else:
                            row.update(_measure(variant, tile, call_args, varlen, causal, scale, refs, args.reps))
                        if "median_ms" in row:
                            row["tflops"] = flops / row["median_ms"] / 1e9
                            if variant == "pointer" and tile is None:
                                pointer_ms = row["median_ms"]
                            if pointer_ms:
                                row["vs_pointer"] = pointer_ms / row["median_ms"]
                        rows.append(row)
                        _print_row(row, causal)
                del q, k, v, refs
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
    return {"meta": meta, "build_failures": failed, "rows": rows, "summary": _summary(rows)}


def _measure(variant, tile, call_args, varlen, causal, scale, refs, reps) -> dict:
    from minipaged.benchmark import timing

    try:
        out = _call(variant, tile, call_args, varlen, causal, scale)
        _sync()
    except Exception as e:
        return {"error": f"run: {type(e).__name__}: {' '.join(str(e).split())[:300]}"}
    if out is None:
        return {"error": "run: the variant declined these inputs (layout or tile) and returned None"}
    worst = (0.0, 1.0)
    for band, truth, lowp in refs:
        got = out if band is None else out[:, :, band[0]:band[1]]
        err, bound = _check(got, truth, lowp)
        if not math.isfinite(err) or err / bound > worst[0] / worst[1]:
            worst = (err, bound)
    res = {"max_err": worst[0], "err_bound": worst[1], "ok": bool(math.isfinite(worst[0]) and worst[0] <= worst[1])}
    del out
    if not res["ok"]:
        res["error"] = "check: output outside the oracle bound; not timed"
        return res
    try:
        t = timing.time_fn(lambda: _call(variant, tile, call_args, varlen, causal, scale), device=DEVICE,
                           reps=reps, min_reps=reps, warmup=3, max_time_s=0)
    except Exception as e:
        res["error"] = f"timing: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
        traceback.print_exc()
        return res
    res.update(median_ms=t.median_ms, timing=t.as_dict())
    return res


def _print_row(row, causal):
    c = "causal" if causal else "full"
    head = f"D={row['head_dim']:<3} {c:<6} {row['case']:<34} {row['label']:<22}"
    if "median_ms" in row:
        vs = f"{row['vs_pointer']:6.3f}x" if "vs_pointer" in row else "      -"
        print(f"{head} {row['median_ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s  vs pointer {vs}  "
              f"err {row['max_err']:.2e} <= {row['err_bound']:.2e}", flush=True)
    else:
        print(f"{head} {row.get('error')}", flush=True)


def _summary(rows) -> dict:
    """Per variant at its table tile (and per alternative tile): geometric mean and minimum of
    the speed-up over the pointer kernel, over the cases where both ran."""
    out = {}
    for label in sorted({r["label"] for r in rows}):
        ups = [r["vs_pointer"] for r in rows if r["label"] == label and "vs_pointer" in r]
        fails = sum(1 for r in rows if r["label"] == label and "error" in r)
        if ups:
            out[label] = {"cases": len(ups), "failed": fails, "geomean_vs_pointer": math.exp(sum(map(math.log, ups)) / len(ups)),
                          "min_vs_pointer": min(ups), "wins": sum(1 for u in ups if u > 1.0)}
        else:
            out[label] = {"cases": 0, "failed": fails}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=False, help="write the results here")
    ap.add_argument("--reps", type=int, default=30, help="timed calls per kernel (>= 20)")
    ap.add_argument("--head-dims", default="128,64")
    ap.add_argument("--variants", default="pointer,tma,tma_ws")
    ap.add_argument("--causal", choices=("both", "causal", "full"), default="both")
    ap.add_argument("--compile-timeout", type=float, default=300, help="seconds for all the precompiling")
    ap.add_argument("--tiles", help="alternative tiles of every variant instead of TILES' lists, as "
                    "'BM,BN,W,S;BM,BN,W,S', a fifth number a register cap (maxnreg); the table's tile always runs first")
    ap.add_argument("--table-tile-only", default="", help="comma-separated variants timed at their table tile alone")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter run of tiny shapes (plumbing only)")
    ap.add_argument("--compile-child", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        _smoke_setup()
    if args.compile_child is not None:
        return _compile_child(args.compile_child)
    if args.reps < 20:
        ap.error(f"--reps must be >= 20, got {args.reps}")
    if not args.smoke and not torch.cuda.is_available():
        ap.error("needs a CUDA device (or --smoke)")
    if "pointer" not in args.variants.split(","):
        ap.error("--variants must include pointer (the baseline)")
    if args.tiles:
        try:
            alt = [tuple(int(x) for x in t.split(",")) for t in args.tiles.split(";")]
        except ValueError:
            ap.error(f"--tiles: expected 'BM,BN,W,S[,MAXNREG];...', got {args.tiles!r}")
        if any(len(t) not in (4, 5) for t in alt):
            ap.error(f"--tiles: every tile has four numbers (a fifth: maxnreg), got {args.tiles!r}")
        for v in args.variants.split(","):
            for d in (int(x) for x in args.head_dims.split(",")):
                TILES[(v, d)] = [None, *alt]
    for v in filter(None, args.table_tile_only.split(",")):
        for d in (int(x) for x in args.head_dims.split(",")):
            TILES[(v, d)] = [None]
    result = run(args)
    print("\n## summary (speed-up over the pointer kernel at its table tile)")
    for label, s in result["summary"].items():
        if s.get("cases"):
            print(f"{label:<24} geomean {s['geomean_vs_pointer']:.3f}x  min {s['min_vs_pointer']:.3f}x  "
                  f"wins {s['wins']}/{s['cases']}  failed {s['failed']}")
        else:
            print(f"{label:<24} no timed case (failed {s['failed']})")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
