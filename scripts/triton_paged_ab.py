"""A/B of the Triton paged-attention launch paths on the H200 (issue #13): the old path
(v1 kernel, one launch for a mixed batch) against the long-chunk kernel v2, the two-launch
mixed batches ("split": a packed short launch; "decode": the decode kernel for the q_len 1
rows), and alternative tiles, all through configs.set_override.

    PYTHONPATH=src python scripts/triton_paged_ab.py --json bench/results/nvidia-h200/triton_paged_ab.json

Cases (bf16, Hq/Hkv/D 16/8/128 or --heads, the `minipaged bench --op paged` grid), each at
page sizes 16, 1 and 128: chunked prefill B=8 q=512 L=4608 and B=1 q=2048 L=32768, speculative
verification B=32 q=4 L=4096, a mixed batch (one q=2048 chunk + 63 decodes, L=4096).
Anchors in the same run: the dense varlen prefill on the same K/V made contiguous
(chunked; target paged >= 0.9x of it), plain decode at the same B and L (spec; target
<= 1.3x its time), the mixed batch's chunk alone through paged plus its decodes alone
through decode (mixed; target <= 1.1x their sum).
Timing: minipaged.benchmark.timing.time_fn: L2 emptied by reading a 256 MB buffer before
each call (outside the events), medians of >= 20 calls (--reps), CUDA graphs for the
short cases (spec, and the decode anchors); the mixed batch and the chunked cases eager,
as `minipaged bench` times them (the mixed batch also as a graph, `graph_us`).
Before timing, every variant's output is checked against an fp64 oracle
(minipaged.testing.attention_ref, per sequence): max error <= 2 x that of plain bf16 math
+ 4e-3; a variant that fails the check is reported and not timed.
Robust to a variant that does not build: each variant is first run once per case in a
child process (in parallel), so a compiler error or crash only marks that variant.
--smoke runs the plumbing on CPU under the interpreter (fp16, tiny shapes); it measures nothing.

What to read: the summary, per case and page, the median us of each variant and its
ratio to the anchor. Make the fastest correct combination the default in
configs.py (PAGED_LONG_KERNEL, PAGED_MIXED, PAGED_PREFETCH, the paged tile table).
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

HQ, HKV, D = 16, 8, 128
DT = torch.bfloat16
DEVICE = "cuda"
CASES = {
    "chunked B=8 q=512 L=4608": ([512] * 8, [4608] * 8),
    "chunked B=1 q=2048 L=32768": ([2048], [32768]),
    "spec B=32 q=4 L=4096": ([4] * 32, [4096] * 32),
    # a decode step through paged_attention (one packed tile per sequence), against decode itself
    "spec B=64 q=1 L=8192": ([1] * 64, [8192] * 64),
    "mixed q=2048 + 63 decodes L=4096": ([2048] + [1] * 63, [4096] * 64),
}
PAGES = [16, 1, 128]
# name -> (which cases: "all" | "long" (chunked + mixed) | "mixed", overrides)
_NEW = {"paged_long_kernel": "v2", "paged_mixed": "split"}  # the candidate default (configs.py)
VARIANTS = {
    "old": ("all", {"paged_long_kernel": "v1", "paged_mixed": "one"}),
    "default": ("all", {}),
    "v2+split": ("all", dict(_NEW)),
    "v1+split": ("mixed", {"paged_long_kernel": "v1", "paged_mixed": "split"}),
    "v2+one": ("mixed", {"paged_long_kernel": "v2", "paged_mixed": "one"}),
    # q_len 1 rows through the decode kernel (packed-query mode), the chunk through v2
    "v2+decode": ("mixed", {"paged_long_kernel": "v2", "paged_mixed": "decode"}),
    "v2 no-prefetch": ("long", {**_NEW, "paged_prefetch": 0}),
    # the Gluon long-chunk kernel (the default on sm_90 for D 128, pages >= 16, chunks >= 256)
    # with its loader reading the table entries of each page copy, for K and again for V, as
    # when it was first measured (configs.gluon_table_ahead off)
    "gluon no-ahead": ("long", {"gluon_table_ahead": 0}),
    # ... and with its loader split in two warps, one for K and one for V
    "gluon split": ("long", {"gluon_split_loader": 1}),
    # the defaults but programs of KV head 0 first, then head 1, ... (the order before
    # configs.PAGED_HEADS_FASTEST)
    "v2 heads-slowest": ("long", {"paged_heads_fastest": 0}),
    "v2 tile 128,64,8,2": ("long", {**_NEW, "paged": (128, 64, 8, 2)}),
    "v2 tile 64,64,4,3": ("long", {**_NEW, "paged": (64, 64, 4, 3)}),
    "v2 tile 128,32,8,4": ("long", {**_NEW, "paged": (128, 32, 8, 4)}),
    # 128-row tiles of 32 keys capped at 128 registers, so that two programs share an SM (81 /
    # 96 KB of shared memory; ptxas: 56 bytes of spills, outside the key loop)
    "v2 tile 128,32,8,3 r128": ("long", {**_NEW, "paged": (128, 32, 8, 3, 128)}),
    "v2 tile 128,32,8,4 r128": ("long", {**_NEW, "paged": (128, 32, 8, 4, 128)}),
    # wider key tiles: 8 pages of 16 per tile, half the softmax steps and table loads per key
    "v2 tile 128,128,8,2": ("long", {**_NEW, "paged": (128, 128, 8, 2)}),
    "v2 tile 64,128,4,2": ("long", {**_NEW, "paged": (64, 128, 4, 2)}),
    "v2 tile 128,64,4,3": ("long", {**_NEW, "paged": (128, 64, 4, 3)}),
    # a fourth stage in flight: the CUDA paged TMA kernel's page-16 gap closed with a third
    # ring stage (bench/results/nvidia-h200/paged_ws3_1ad5ff9/)
    "v2 tile 128,64,8,4": ("long", {**_NEW, "paged": (128, 64, 8, 4)}),
    "v2 tile 128,64,8,5": ("long", {**_NEW, "paged": (128, 64, 8, 5)}),
    # packed tiles of the speculative row at G = 8 (--heads 64/8: 4 positions x 8 heads = 32 rows;
    # the default is the decode kernel's 64 keys, 4 warps, 2 stages)
    "spec tile 32,64,4,2": ("spec", {"paged": (32, 64, 4, 2)}),  # the packed default at G 8 before 128-key packed tiles
    "spec tile 32,32,4,2": ("spec", {"paged": (32, 32, 4, 2)}),
    "spec tile 32,64,8,2": ("spec", {"paged": (32, 64, 8, 2)}),
    "spec tile 32,64,4,3": ("spec", {"paged": (32, 64, 4, 3)}),
    "spec tile 32,128,4,2": ("spec", {"paged": (32, 128, 4, 2)}),
    "spec tile 32,128,8,2": ("spec", {"paged": (32, 128, 8, 2)}),
    # packed tiles (spec and decode-shaped calls) through v1 (the default) or the long-chunk
    # kernel's loop (configs.paged_packed_kernel), at the default tile (16 rows at G 2: 64 keys,
    # 4 warps, 2 stages) and wider / deeper ones
    "spec v1": ("spec", {}),
    "spec v2": ("spec", {"paged_packed_kernel": "v2"}),
    "spec v2 tile 16,128,4,2": ("spec", {"paged_packed_kernel": "v2", "paged": (16, 128, 4, 2)}),
    "spec v2 tile 16,64,4,3": ("spec", {"paged_packed_kernel": "v2", "paged": (16, 64, 4, 3)}),
    "spec v2 tile 16,32,4,3": ("spec", {"paged_packed_kernel": "v2", "paged": (16, 32, 4, 3)}),
    "spec v2 no-prefetch": ("spec", {"paged_packed_kernel": "v2", "paged_prefetch": 0}),
    "spec v1 tile 16,128,4,2": ("spec", {"paged": (16, 128, 4, 2)}),
    "short 32,64,4,2": ("mixed", {**_NEW, "paged_short": (32, 64, 4, 2)}),
    "short 16,32,4,2": ("mixed", {**_NEW, "paged_short": (16, 32, 4, 2)}),
}
REPS = 30


def _smoke_setup():
    global HQ, HKV, D, DT, DEVICE, CASES, PAGES, REPS
    os.environ["TRITON_INTERPRET"] = "1"
    HQ, HKV, D, DT, DEVICE, REPS = 4, 2, 64, torch.float16, "cpu", 1
    CASES = {
        "chunked B=2 q=40 L=70": ([40] * 2, [70] * 2),
        "spec B=3 q=4 L=37": ([4] * 3, [37] * 3),
        "mixed q=40 + 3 decodes L=50": ([40, 1, 1, 1], [50] * 4),
    }
    PAGES = [16, 1]


def _kind(case: str) -> str:
    return case.split()[0]


def _applies(which: str, case: str) -> bool:
    return which == "all" or (which == "long" and _kind(case) != "spec") or which == _kind(case)


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------ inputs and oracle


def _dense(case: str):
    from minipaged.testing import randn

    q_lens, ctxs = CASES[case]
    g = torch.Generator().manual_seed(len(q_lens) * 7919 + sum(ctxs))
    keys = [randn((n, HKV, D), DT, DEVICE, g) for n in ctxs]
    vals = [randn((n, HKV, D), DT, DEVICE, g) for n in ctxs]
    q = randn((sum(q_lens), HQ, D), DT, DEVICE, g)
    return q, keys, vals


def _paged_inputs(case: str, page: int, dense):
    from minipaged.testing import cu_seqlens, paged_kv

    q_lens, _ = CASES[case]
    q, keys, vals = dense
    # NaN in every slot no sequence owns and -1 past the used table entries
    kv = paged_kv(None, HKV, D, page, DT, DEVICE, seed=page, spare_blocks=2, spare_columns=1, poison=True,
                  keys=keys, vals=vals)
    return (q, kv.k_cache, kv.v_cache, kv.block_tables, cu_seqlens(q_lens, DEVICE), kv.context_lens, max(q_lens))


def _pool_order(inputs):
    """The same cache with every sequence's pages renumbered to consecutive pool slots in table
    order (sequence 0's pages first): what the scatter of pages through the pool costs, with
    the values, the poisoned spare slots and the -1 table tails unchanged."""
    q, k_cache, v_cache, tables, cu_q, ctx, max_q = inputs
    used = [b for row in tables.tolist() for b in row if b >= 0]
    seen = set(used)
    order = torch.tensor(used + [b for b in range(k_cache.shape[0]) if b not in seen], device=k_cache.device)
    new_id = torch.empty_like(order)
    new_id[order] = torch.arange(order.numel(), device=order.device)
    tables = torch.where(tables >= 0, new_id[tables.clamp_min(0).long()].to(tables.dtype), tables)
    return q, k_cache[order].contiguous(), v_cache[order].contiguous(), tables, cu_q, ctx, max_q


def _oracle(case: str, dense):
    """(fp64 truth, bf16-math result) [Tq, Hq, D], sequence by sequence."""
    from minipaged.testing import attention_ref

    q_lens, _ = CASES[case]
    q, keys, vals = dense
    truth = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    lowp = torch.empty_like(truth)
    at = 0
    for n, k, v in zip(q_lens, keys, vals):
        truth[at:at + n], _ = attention_ref(q[at:at + n], k, v, causal=True, scale=1 / math.sqrt(D), chunk=256)
        lowp[at:at + n], _ = attention_ref(q[at:at + n], k, v, causal=True, scale=1 / math.sqrt(D), lowp=True,
                                           chunk=256)
        at += n
    return truth, lowp


def _check(out, truth, lowp) -> tuple[float, float]:
    o = out.double()
    if not torch.isfinite(o).all():
        return float("inf"), 0.0
    return (o - truth).abs().max().item(), 2.0 * (lowp - truth).abs().max().item() + 4e-3


# ------------------------------------------------------------------------ running a variant


class _Overrides:
    def __init__(self, overrides: dict):
        self.overrides = overrides

    def __enter__(self):
        from minipaged.triton import configs

        for k, v in self.overrides.items():
            configs.set_override(k, v)

    def __exit__(self, *exc):
        from minipaged.triton import configs

        for k in self.overrides:
            configs.set_override(k, None)


def _paged_fn(inputs, overrides: dict):
    from minipaged.triton import ops

    q, kc, vc, bt, cu, cl, max_q = inputs

    def fn():
        with _Overrides(overrides):
            return ops.paged(q, kc, vc, bt, cu, cl, max_q, True, 1 / math.sqrt(D), False)

    return fn


def _launch_summary(inputs, overrides: dict) -> str:
    """Which launches ops.paged makes for these inputs under the overrides (host only)."""
    from minipaged.triton import configs, ops

    q, kc, vc, bt, cu, cl, max_q = inputs
    with _Overrides(overrides):
        plan = ops._paged_launches(D, q.dtype, True, q.shape[0], cu.shape[0] - 1, max_q, HQ // HKV, q.device,
                                   ops._v2_usable(q, kc, vc, bt, cu.shape[0] - 1), None,
                                   kc.dtype == torch.float8_e4m3fn)
        prefetch = configs.paged_prefetch()
    parts = []
    for launch in plan:
        c = launch.cfg
        extra = f" min_q={launch.min_q}" if launch.min_q else f" max_q={launch.max_q}" if launch.max_q else ""
        pf = f" prefetch={int(prefetch)}" if launch.kernel == "v2" else ""
        cap = f",r{c.maxnreg}" if c.maxnreg else ""
        parts.append(f"{launch.kernel}[{c.block_m},{c.block_n},{c.num_warps},{c.num_stages}{cap}]{extra}{pf}")
    return " + ".join(parts)


def _compile_child(variant: str) -> int:
    """Child process: one call of `variant` on every case and page, one line per result."""
    which, overrides = VARIANTS[variant]
    for case in CASES:
        if not _applies(which, case):
            continue
        dense = _dense(case)
        for page in PAGES:
            key = f"{case}|{page}"
            try:
                _paged_fn(_paged_inputs(case, page, dense), overrides)()
                _sync()
                print(f"OK\t{key}", flush=True)
            except Exception as e:  # a combination that does not build is a result
                print(f"FAIL\t{key}\t{type(e).__name__}: {' '.join(str(e).split())[:300]}", flush=True)
    return 0


def precompile(variants: list[str], jobs: int, timeout_s: float) -> dict[tuple, str]:
    """{(variant, case|page): "" (ok) or why not}, from child processes run in parallel."""
    status: dict[tuple, str] = {}
    smoke = ["--smoke"] if DEVICE == "cpu" else []
    pending = list(variants)
    running: dict[str, tuple] = {}
    deadline = time.time() + timeout_s
    while pending or running:
        while pending and len(running) < jobs:
            v = pending.pop(0)
            running[v] = (subprocess.Popen([sys.executable, __file__, *smoke, "--pages", *map(str, PAGES),
                                            "--heads", f"{HQ}/{HKV}", "--cases", *CASES, "--compile-child", v],
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), time.time())
        for v, (p, _) in list(running.items()):
            if p.poll() is None and time.time() < deadline:
                continue
            if p.poll() is None:
                p.kill()
            out, err = p.communicate()
            for line in out.splitlines():
                # tab-separated: case names hold spaces
                word, _, rest = line.partition("\t")
                if word in ("OK", "FAIL"):
                    key, _, why = rest.partition("\t")
                    status[(v, key)] = "" if word == "OK" else why
            if p.returncode not in (0, None) and not any(k[0] == v for k in status if status[k]):
                tail = " ".join(err.strip().splitlines()[-3:])[:300]
                status[(v, "*")] = f"child exited with {p.returncode}: {tail}"
            del running[v]
        time.sleep(0.2)
    return status


def _time(fn, graph: bool):
    from minipaged.benchmark import timing

    t = timing.time_fn(fn, device=DEVICE, reps=REPS, min_reps=min(20, REPS), warmup=2, max_time_s=2.0,
                       cold_l2=True, cuda_graph=graph and DEVICE == "cuda")
    return {"median_us": t.median_ms * 1e3, "p20_us": t.p20_ms * 1e3, "p80_us": t.p80_ms * 1e3, "reps": t.reps,
            "clock": t.clock}


# ------------------------------------------------------------------------ anchors


def _anchors(case: str, page: int, inputs, dense, truth, lowp) -> dict:
    from minipaged.testing import cu_seqlens
    from minipaged.triton import ops

    q, kc, vc, bt, cu, cl, max_q = inputs
    q_lens, ctxs = CASES[case]
    scale = 1 / math.sqrt(D)
    res = {}

    def timed(name, fn, graph, rows=None):
        try:
            out = fn()
            _sync()
            if rows is not None:
                err, bound = _check(out, truth[rows], lowp[rows])
                if not err <= bound:
                    res[name] = {"status": "wrong", "err": err, "bound": bound}
                    return
            res[name] = dict(_time(fn, graph), status="ok")
        except Exception as e:  # an anchor that fails is reported, the rest goes on
            res[name] = {"status": "failed", "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}

    kind = _kind(case)
    if kind == "chunked" and page == PAGES[0]:
        _, keys, vals = dense
        k, v = torch.cat(keys), torch.cat(vals)
        cu_k = cu_seqlens(ctxs, DEVICE)
        timed("dense varlen", lambda: ops.prefill_varlen(q, k, v, cu, cu_k, max_q, max(ctxs), True, scale, False),
              False, slice(None))
    if kind != "spec" and DEVICE == "cuda":
        # FlashInfer's paged prefill on the same pages, when it is importable (never a dependency)
        from minipaged.benchmark import anchors

        ok, _ = anchors.flashinfer_available(q.device)
        if ok:
            try:
                prep = anchors.prepare_flashinfer_paged(q, kc, vc, bt, cu, cl, causal=True, scale=scale)
                # not checked: the spare slots here are NaN-poisoned, which FlashInfer need not mask
                timed("flashinfer paged", prep.fn, False)
            except Exception as e:  # noqa: BLE001 - an anchor that cannot run is reported
                res["flashinfer paged"] = {"status": "failed", "error": f"{type(e).__name__}: {str(e)[:300]}"}
    if kind == "spec":
        # the same sequences, one query each (the last of each run): plain decode
        last = (cu[1:] - 1).long()
        q1 = q[last].contiguous()
        timed("decode", lambda: ops.decode(q1, kc, vc, bt, cl, scale, False), True)
    if kind == "mixed":
        chunks = [s for s, n in enumerate(q_lens) if n > 1]
        decs = [s for s, n in enumerate(q_lens) if n == 1]
        starts = cu.tolist()
        rows_c = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in chunks]).to(q.device)
        sel = torch.tensor(chunks, device=q.device)
        qc = q[rows_c].contiguous()
        cu_c = cu_seqlens([q_lens[s] for s in chunks], DEVICE)
        btc, clc = bt[sel].contiguous(), cl[sel].contiguous()
        mq = max(q_lens[s] for s in chunks)
        for name, ov in (("chunk alone (v2)", dict(_NEW)), ("chunk alone (old)", VARIANTS["old"][1])):
            timed(name, _paged_fn((qc, kc, vc, btc, cu_c, clc, mq), ov), False, rows_c)
        dsel = torch.tensor(decs, device=q.device)
        rows_d = torch.tensor([starts[s] for s in decs], device=q.device)
        qd, btd, cld = q[rows_d].contiguous(), bt[dsel].contiguous(), cl[dsel].contiguous()
        timed("decodes alone", lambda: ops.decode(qd, kc, vc, btd, cld, scale, False), False, rows_d)
        timed("decodes alone (graph)", lambda: ops.decode(qd, kc, vc, btd, cld, scale, False), True)
    return res


# ------------------------------------------------------------------------ main


def run(args) -> dict:
    variants = [v for v in VARIANTS if not args.only or any(s in v for s in args.only)]
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
            "dtype": str(DT), "heads": [HQ, HKV, D], "pages": PAGES, "reps": REPS, "variants": {
                v: {"cases": VARIANTS[v][0], "overrides": {k: list(x) if isinstance(x, tuple) else x
                                                          for k, x in VARIANTS[v][1].items()}} for v in variants}}
    try:
        import triton

        meta["triton"] = triton.__version__
        meta["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
    except Exception:  # noqa: BLE001 - metadata only
        pass
    t0 = time.time()
    status = precompile(variants, args.jobs, args.compile_timeout)
    meta["precompile_s"] = round(time.time() - t0, 1)
    print(f"precompiled {len(variants)} variants in {meta['precompile_s']} s", flush=True)
    rows = []
    for case in CASES:
        dense = _dense(case)
        truth, lowp = _oracle(case, dense)
        for page, pool_order in [(p, o) for p in PAGES for o in ((False, True) if args.pool_order else (False,))]:
            inputs = _paged_inputs(case, page, dense)
            if pool_order:
                inputs = _pool_order(inputs)
            tag = f"p{page}" + (" pool-order" if pool_order else "")
            row = {"case": case, "page": page, "pool_order": pool_order, "variants": {}, "anchors": {}}
            for v in variants:
                which, overrides = VARIANTS[v]
                if not _applies(which, case):
                    continue
                why = status.get((v, f"{case}|{page}"), status.get((v, "*"), "not compiled"))
                entry = {"launches": _launch_summary(inputs, overrides)}
                row["variants"][v] = entry
                if why:
                    entry.update(status="failed", error=why)
                    print(f"  {case} {tag} {v}: FAILED {why[:120]}", flush=True)
                    continue
                fn = _paged_fn(inputs, overrides)
                try:
                    err, bound = _check(fn(), truth, lowp)
                    entry.update(err=err, bound=bound)
                    if not err <= bound:
                        entry["status"] = "wrong"
                        print(f"  {case} {tag} {v}: WRONG err {err:.3e} > {bound:.3e}", flush=True)
                        continue
                    entry.update(_time(fn, _kind(case) == "spec"), status="ok")
                    if _kind(case) == "mixed" and DEVICE == "cuda":
                        entry["graph_us"] = _time(fn, True)["median_us"]
                except Exception as e:  # a variant that fails at run time is a result
                    entry.update(status="failed", error=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
                    if args.verbose:
                        traceback.print_exc()
                    continue
                print(f"  {case} {tag} {v}: {entry['median_us']:.1f} us  [{entry['launches']}]", flush=True)
            row["anchors"] = _anchors(case, page, inputs, dense, truth, lowp)
            for name, a in row["anchors"].items():
                print(f"  {case} {tag} anchor {name}: "
                      + (f"{a['median_us']:.1f} us" if a["status"] == "ok" else a["status"]), flush=True)
            rows.append(row)
            if args.json:
                # after every row, so a run cut short by a time limit still leaves its figures
                _write(args.json, {"meta": meta, "rows": rows, "summary": _summary(rows), "partial": True})
            del inputs
        del dense, truth, lowp
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return {"meta": meta, "rows": rows, "summary": _summary(rows)}


def _summary(rows) -> list[str]:
    """One line per (case, page, variant): median and the ratio the target is about."""
    lines = []
    dense = {r["case"]: r["anchors"].get("dense varlen") for r in rows if "dense varlen" in r["anchors"]}
    for r in rows:
        case, kind, an = r["case"], _kind(r["case"]), r["anchors"]
        tag = f"p{r['page']}" + (" pool-order" if r.get("pool_order") else "")
        for v, e in r["variants"].items():
            if e.get("status") != "ok":
                lines.append(f"{case} {tag} {v}: {e.get('status')}")
                continue
            t = e["median_us"]
            note = ""
            if kind == "chunked" and dense.get(case, {}).get("status") == "ok":
                note = f"dense/paged = {dense[case]['median_us'] / t:.3f} (target >= 0.9)"
            elif kind == "spec" and an.get("decode", {}).get("status") == "ok":
                note = f"paged/decode = {t / an['decode']['median_us']:.3f} (target <= 1.3)"
            elif kind == "mixed":
                best = [an[n]["median_us"] for n in ("chunk alone (v2)", "chunk alone (old)")
                        if an.get(n, {}).get("status") == "ok"]
                dec = an.get("decodes alone", {})
                if best and dec.get("status") == "ok":
                    parts = min(best) + dec["median_us"]
                    note = f"mixed/(chunk+decodes) = {t / parts:.3f} (target <= 1.1; parts {parts:.1f} us)"
                    if "graph_us" in e:
                        note += f"; as a graph {e['graph_us']:.1f} us"
            fi = an.get("flashinfer paged", {})
            if kind != "spec" and fi.get("status") == "ok":
                note += f"; FlashInfer/paged = {fi['median_us'] / t:.3f}"
            lines.append(f"{case} {tag} {v}: {t:.1f} us  {note}  [{e['launches']}]")
    return lines


def _write(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)


def main(argv=None) -> int:
    global REPS, PAGES, HQ, HKV, CASES
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--only", nargs="*", help="substrings of the variant names to run")
    ap.add_argument("--cases", nargs="*", help="substrings of the case names to run (default all)")
    ap.add_argument("--reps", type=int, default=REPS, help="timed calls per measurement (>= 20)")
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="parallel compile children")
    ap.add_argument("--compile-timeout", type=float, default=240.0)
    ap.add_argument("--pages", type=int, nargs="*", help="page sizes (default 16 1 128)")
    ap.add_argument("--heads", help="query/KV heads, e.g. 32/8 (default 16/8; the smoke run's 4/2)")
    ap.add_argument("--pool-order", action="store_true",
                    help="also run every case on the same pages renumbered into pool order (_pool_order)")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter plumbing check, tiny shapes")
    ap.add_argument("--compile-child", help=argparse.SUPPRESS)
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        _smoke_setup()
    else:
        REPS = max(20, args.reps)
    if args.pages:
        PAGES = list(args.pages)
    if args.heads:
        HQ, HKV = (int(x) for x in args.heads.split("/"))
        if HQ % HKV:
            ap.error(f"--heads {args.heads}: query heads must be a multiple of KV heads")
    if args.cases:
        CASES = {c: v for c, v in CASES.items() if any(x in c for x in args.cases)}
        if not CASES:
            ap.error(f"--cases {args.cases}: no case matches")
    if args.compile_child:
        return _compile_child(args.compile_child)
    result = run(args)
    print("\n".join(["", "# summary"] + result["summary"]))
    if args.json:
        _write(args.json, result)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
