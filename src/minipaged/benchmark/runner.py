"""`minipaged bench`: cross-check every backend against torch, then time prefill,
decode and paged attention (chunked prefill, speculative verification, mixed
batches) for every backend and every anchor in one run, and write
results.json, results.md and plots.

Our kernels are timed through their registry ops directly (positional
arguments, already-valid inputs), so argument checking and its host syncs stay
out of the timed region. The cross-check goes through the public API.
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..api import MAX_BLOCK_SIZE, is_block_size
from . import anchors as anc
from . import cases as cs
from . import flops, outputs, report, timing

SCHEMA = "minipaged.bench/1"
BACKEND_ORDER = ("torch", "triton", "cuda", "cuda-wmma")
# cuda-wmma's decode and paged entries are the cuda backend's kernels: timing them twice says nothing
_DECODE_SHARED = {"cuda-wmma": "cuda"}
_SHARED_OPS = ("decode", "paged")
OPS_ALL = ("prefill", "decode", "paged")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# max |o - o_fp32| allowed beyond twice the error of the torch oracle run in the same dtype
_ATOL = {torch.float32: 2e-3, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}
# --kv-cache-dtype: "auto" = the cache has the input dtype; "fp8" adds float8_e4m3fn rows
KV_CACHE_DTYPES = ("auto", "fp8")
FP8_NAME = report.FP8_NAME
FP8_OPS = ("decode", "paged")


@dataclass
class BenchConfig:
    op: str = "all"                       # prefill | decode | paged | all
    backends: list[str] | None = None     # None: every available backend
    anchors: list[str] | None = None      # None: every anchor; [] none
    dtype: str | None = None              # None: bfloat16 on GPU, float32 in CPU quick mode
    out: str | None = None
    quick: bool = False
    reps: int | None = None               # max timed calls per row
    max_time_s: float | None = None       # timed seconds per row (<= 0: exactly reps)
    time_budget_s: float | None = None    # past this, rows drop to the minimum reps
    crosscheck: bool = True
    plots: bool = True
    progress: bool = True
    seed: int = 0
    kv_cache_dtype: str = "auto"          # "fp8": decode/paged also on float8_e4m3fn caches
    heads: tuple[int, int, int | None] | None = None  # --heads (Hq, Hkv, D); D None: the grid's; None: its layout
    page_size: int = cs.DEFAULT_PAGE_SIZE  # --page-size: tokens per KV page of the decode and paged cases
    log: Callable[[str], None] = field(default=print, repr=False)


def pick_device(quick: bool, log) -> tuple[torch.device, bool]:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device()), quick
    if not quick:
        log("No CUDA GPU visible: running the quick CPU benchmark instead (small shapes, "
            "torch and Triton-interpreter rows; the times say nothing about GPU speed).")
    return torch.device("cpu"), True


def enable_triton_interpreter(log=print) -> bool:
    """On a machine without a GPU the Triton backend can only run interpreted.
    TRITON_INTERPRET must be set before the Triton kernels are defined, so this
    must run before anything imports minipaged.triton. Returns whether the
    interpreter is (now) in effect."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    if any(m == "minipaged.triton" or m.startswith("minipaged.triton.") for m in sys.modules):
        log("note: minipaged.triton was imported before TRITON_INTERPRET=1 could be set; "
            "Triton rows will be skipped (run `TRITON_INTERPRET=1 minipaged bench --quick`).")
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True


# ----------------------------------------------------------------------------- backends


def select_backends(cfg: BenchConfig, device: torch.device) -> tuple[list[str], dict]:
    """The backends to time and {name: {available, reason}} for every backend.

    With cfg.backends None: every backend available here. A backend named in
    cfg.backends that is unknown is a ValueError, one that cannot run here a
    BackendUnavailableError: a requested row is never silently dropped."""
    from minipaged import registry

    avail = registry.available_backends(device.type)
    known = list(registry.all_backends())
    order = [b for b in BACKEND_ORDER if b in known] + [b for b in known if b not in BACKEND_ORDER]
    if cfg.backends is None:
        chosen = [b for b in order if avail[b][0]]
    else:
        unknown = [b for b in cfg.backends if b not in known]
        if unknown:
            raise ValueError(f"--backends: unknown backend(s) {unknown}; valid names are {known}")
        for b in cfg.backends:
            if not avail[b][0]:
                raise registry.BackendUnavailableError(
                    f"--backends {b}: unavailable on {device.type}: {avail[b][1]}")
        chosen = list(dict.fromkeys(cfg.backends))
    return chosen, {b: {"available": ok, "reason": why} for b, (ok, why) in avail.items()}


def backend_op(name: str, op: str):
    from minipaged import registry

    return registry.all_backends()[name].op(op)


def _skip_reason(backend: str, op: str, dtype: torch.dtype, device: torch.device) -> str | None:
    from minipaged import registry

    b = registry.all_backends()[backend]
    if op not in b.provides:
        return f"{backend} has no {op}"
    if op in _SHARED_OPS and backend in _DECODE_SHARED:
        return f"{backend} {op} is the {_DECODE_SHARED[backend]} kernel (timed there)"
    if backend == "triton" and device.type == "cpu" and dtype == torch.bfloat16:
        return "the Triton interpreter's bf16 tl.dot is wrong: use --dtype float16/float32"
    name = str(dtype).replace("torch.", "")
    supported, why = b.supported_dtypes(device.type)
    if name not in supported:
        return why or f"{backend} does not run {name} (its dtypes: {', '.join(supported)})"
    return None


def fp8_key(op: str) -> str:
    """The failures-dict key of `op` on an fp8 cache (a backend's fp8 kernels fail or pass
    the cross-check apart from its 16-bit ones)."""
    return f"{op}:fp8"


def fp8_skip_reason(backend: str, op: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why `backend` runs no `op` on a float8_e4m3fn cache here (None: it does)."""
    from minipaged import registry

    if op not in FP8_OPS:
        return f"no fp8 cache in {op}"
    reason = _skip_reason(backend, op, dtype, device)
    if reason:
        return reason
    if dtype not in (torch.float16, torch.bfloat16):
        return f"an fp8 cache needs float16/bfloat16 q, got {str(dtype).replace('torch.', '')}"
    if not registry.all_backends()[backend].fp8_kv:
        return f"{backend} has no float8_e4m3fn KV-cache kernels (registry fp8_kv is False)"
    return None


def fp8_backends(backends, ops, dtype, device) -> list[str]:
    """The backends of `backends` that run at least one of `ops` on an fp8 cache here."""
    return [b for b in backends if any(not fp8_skip_reason(b, op, dtype, device) for op in ops if op in FP8_OPS)]


# ----------------------------------------------------------------------------- cross-check


def crosscheck_plan(backends, device, dtype, ops=("prefill", "decode")):
    """Which (backend, op) pairs a cross-check on `device` in `dtype` compares, and
    which it skips and why: (compared [(backend, op)], skipped [(backend, op | None, reason)]).
    op None: the whole backend cannot run here. torch (the oracle) is compared
    whenever it runs, against itself in fp32."""
    from minipaged import registry

    avail = registry.available_backends(device.type)
    compared, skipped = [], []
    for name in backends:
        ok, why = avail.get(name, (False, "unknown backend"))
        if not ok:
            skipped.append((name, None, why))
            continue
        for op in ops:
            reason = None if name == "torch" else _skip_reason(name, op, dtype, device)
            if reason:
                skipped.append((name, op, reason))
            else:
                compared.append((name, op))
    return compared, skipped


# an extension that failed to build or load; a Triton CompilationError is *not*
# one of these (it concerns one kernel, the backend's other ops may be fine)
_BUILD_WORDS = ("error building extension", "nvcc", "ninja", "cpp_extension", "no module named",
                "importerror", "modulenotfounderror", "undefined symbol", "cannot open shared object")


def _first_line(e: BaseException, limit: int = 300) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


# backends built from one extension: a build failure of one is a failure of all
_BUILD_GROUP = {"cuda": "minipaged.cuda", "cuda-wmma": "minipaged.cuda"}


def _failure_keys(name: str, op: str, e: BaseException) -> list[tuple[str, str]]:
    """(backend, op) pairs not worth running after `name` raised `e` on `op`.

    A build or import failure takes down every op of every backend served by
    the same module (cuda and cuda-wmma share one extension); anything else
    only this (backend, op)."""
    from minipaged import registry

    text = f"{type(e).__name__} {e}".lower()
    if not any(w in text for w in _BUILD_WORDS):
        return [(name, op)]
    group = _BUILD_GROUP.get(name, name)
    same = [b for b in registry.all_backends().values() if _BUILD_GROUP.get(b.name, b.name) == group]
    return ([(b.name, o) for b in same for o in registry.OPS if o in b.provides]
            + [(b.name, fp8_key(o)) for b in same for o in FP8_OPS if o in b.provides])


def _check_row(row: dict, run, ref, tol: float, device: torch.device, failures: dict, name: str,
               failure_op: str) -> dict:
    """Fills a cross-check row (max_abs_err, ok, note, error) from run() against ref. One
    raise per (backend, failure_op) is enough: it is kept in `failures` and later cases of
    it are not run (a failed JIT build would otherwise be retried, minutes each)."""
    if (name, failure_op) in failures:
        row["error"] = f"not run: raised earlier: {failures[(name, failure_op)]}"
        return row
    try:
        out = run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        err = _max_abs_err(out, ref)
        row.update(max_abs_err=err, ok=(not math.isnan(err)) and err <= tol)
        if math.isnan(err):
            row["note"] = "NaN in the output"
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        row["error"] = f"{type(e).__name__}: {_first_line(e)}"
        for key in _failure_keys(name, failure_op, e):
            failures.setdefault(key, row["error"])
    return row


def _max_abs_err(out, ref) -> float:
    diff = (out.float() - ref.float()).abs()
    if torch.isnan(diff).any():
        return float("nan")
    return float(diff.max()) if diff.numel() else 0.0


def crosscheck(backends, device, dtype, quick, log, ops=("prefill", "decode"),
               anchor_names=(), heads=None, page_size=cs.DEFAULT_PAGE_SIZE) -> tuple[list[dict], dict]:
    """Max |o_backend - o_fp32| for every backend on a few Qwen3-shaped cases.

    The oracle is the torch backend on inputs upcast to fp32; the torch backend
    run in `dtype` shows the error the output rounding alone costs. A backend
    passes when its error <= 2 * that + atol(dtype). Returns (rows, failures)
    where failures maps (backend, op) -> error text for backends that raised.
    The SDPA anchors in `anchor_names` are checked the same way on the Nq == Nk
    prefill cases (rows with kind "anchor"; they never stop an anchor's timing).
    heads: the cases' head layout (None: the grid's default, cases.grid_heads). page_size: the
    tokens per page of the decode and paged cases' caches (--page-size).
    """
    import minipaged as mp

    rows, failures = [], {}
    for op, case_list in (("prefill", cs.crosscheck_prefill_cases(quick, heads)),
                          ("decode", cs.crosscheck_decode_cases(quick, heads, page_size)),
                          ("paged", cs.crosscheck_paged_cases(quick, heads, page_size))):
        if op not in ops:
            continue
        for case in case_list:
            torch.manual_seed(1234)
            if op == "prefill":
                q, k, v = cs.make_prefill_inputs(case, dtype, device, seed=None)

                def call(name, dt=None):
                    a = [t.to(dt) if dt else t for t in (q, k, v)]
                    return mp.prefill_attention(*a, causal=case.causal, backend=name)
            elif op == "decode":
                q, kc, vc, bt, cl = cs.make_decode_inputs(case, dtype, device, seed=None, poison=True)

                def call(name, dt=None):
                    a = [t.to(dt) if dt else t for t in (q, kc, vc)]
                    return mp.decode_attention(a[0], a[1], a[2], bt, cl, backend=name)
            else:
                q, kc, vc, bt, cu, cl = cs.make_paged_inputs(case, dtype, device, seed=None, poison=True)

                def call(name, dt=None):
                    a = [t.to(dt) if dt else t for t in (q, kc, vc)]
                    return mp.paged_attention(a[0], a[1], a[2], bt, cu, cl, causal=case.causal, backend=name)
            try:
                ref = call("torch", torch.float32)
                ref_err = _max_abs_err(call("torch"), ref)
            except Exception as e:  # noqa: BLE001 - the oracle itself failing is reported, not fatal
                log(f"cross-check {op} {case.label}: the torch oracle failed: {type(e).__name__}: {e}")
                rows.append(dict(op=op, case=case.label, backend="torch", ok=False,
                                 error=f"{type(e).__name__}: {e}", max_abs_err=None))
                continue
            tol = 2 * ref_err + _ATOL[dtype]
            rows.append(dict(op=op, case=case.label, shape=case.shape(), backend="torch",
                             max_abs_err=ref_err, tol=None, ok=not math.isnan(ref_err), error=None,
                             note="torch in the benchmark dtype vs torch in fp32 (output rounding)"))
            for name in backends:
                if name == "torch":
                    continue
                skip = _skip_reason(name, op, dtype, device)
                if skip:
                    continue
                row = dict(op=op, case=case.label, shape=case.shape(), backend=name, tol=tol,
                           max_abs_err=None, ok=False, error=None, note="")
                rows.append(_check_row(row, lambda: call(name), ref, tol, device, failures, name, op))
            if op == "prefill" and case.seqlen_q == case.seqlen_k:
                rows += _crosscheck_anchors(anchor_names, case, q, k, v, ref, tol)
    return rows, failures


def _crosscheck_anchors(anchor_names, case, q, k, v, ref, tol) -> list[dict]:
    rows = []
    for name in anchor_names:
        if not name.startswith("sdpa"):
            continue  # flex: one compile per shape is enough; copy computes no attention
        row = dict(op="prefill", case=case.label, shape=case.shape(), backend=name, kind="anchor",
                   tol=tol, max_abs_err=None, ok=False, error=None, note="")
        try:
            prep = anc.prepare_sdpa_prefill(name, q, k, v, causal=case.causal,
                                            scale=1.0 / math.sqrt(case.head_dim))
            with prep.context():
                out = prep.fn()
            err = _max_abs_err(out, ref)
            row.update(max_abs_err=err, ok=(not math.isnan(err)) and err <= tol, note=prep.note)
        except anc.AnchorSkipped:
            continue
        except Exception as e:  # noqa: BLE001 - reported; the timing row will say it too
            row["error"] = f"{type(e).__name__}: {_first_line(e)}"
        rows.append(row)
    return rows


def crosscheck_plan_fp8(backends, device, dtype, ops):
    """crosscheck_plan for the fp8 cross-check: ops are labelled "decode fp8" / "paged fp8"."""
    from minipaged import registry

    avail = registry.available_backends(device.type)
    compared, skipped = [], []
    for name in backends:
        if not avail.get(name, (False, ""))[0]:
            continue  # crosscheck_plan already lists the whole backend as skipped
        for op in (o for o in FP8_OPS if o in ops):
            reason = fp8_skip_reason(name, op, dtype, device)
            (skipped.append((name, f"{op} fp8", reason)) if reason else compared.append((name, f"{op} fp8")))
    return compared, skipped


def crosscheck_fp8(backends, device, dtype, quick, log, ops=FP8_OPS, failures=None, heads=None,
                   page_size=cs.DEFAULT_PAGE_SIZE) -> list[dict]:
    """Every fp8-capable backend's decode / paged output on a float8_e4m3fn cache against the
    torch oracle on the SAME fp8 cache, so the quantisation error is nobody's fault.

    The cache is the cross-check case's 16-bit cache quantised with per-KV-head scales that
    differ by up to 4x between heads (cases.fp8_caches(spread=True)); unused slots stay NaN.
    The oracle is the torch backend in fp32 on that cache's exact dequantisation
    (stored x scale, fp32) with q upcast; torch on the fp8 cache itself, in `dtype`, shows
    what the output rounding costs. A backend passes when its error <= 2 * that + atol(dtype),
    the rule of crosscheck(). Raises go into `failures` under (backend, fp8_key(op)). heads, page_size: as
    crosscheck's."""
    import minipaged as mp

    failures = {} if failures is None else failures
    rows = []
    for op, case_list in (("decode", cs.crosscheck_decode_cases(quick, heads, page_size)),
                          ("paged", cs.crosscheck_paged_cases(quick, heads, page_size))):
        if op not in ops:
            continue
        for case in case_list:
            torch.manual_seed(4321)
            if op == "decode":
                q, kc, vc, bt, cl = cs.make_decode_inputs(case, dtype, device, seed=None, poison=True)
            else:
                q, kc, vc, bt, cu, cl = cs.make_paged_inputs(case, dtype, device, seed=None, poison=True)
            kc8, vc8, ks, vs = cs.fp8_caches(kc, vc, spread=True)
            del kc, vc

            def call(name, exact=False):
                if exact:
                    a = (q.float(), cs.dequantize_fp8(kc8, ks), cs.dequantize_fp8(vc8, vs))
                    sc = {}
                else:
                    a, sc = (q, kc8, vc8), dict(k_scale=ks, v_scale=vs)
                if op == "decode":
                    return mp.decode_attention(a[0], a[1], a[2], bt, cl, backend=name, **sc)
                return mp.paged_attention(a[0], a[1], a[2], bt, cu, cl, causal=case.causal, backend=name, **sc)

            base = dict(op=op, case=case.label, shape=case.shape(), kv_dtype=FP8_NAME)
            try:
                ref = call("torch", exact=True)
                ref_err = _max_abs_err(call("torch"), ref)
            except Exception as e:  # noqa: BLE001 - reported, the run goes on
                log(f"fp8 cross-check {op} {case.label}: the torch oracle failed: {type(e).__name__}: {e}")
                rows.append(dict(base, backend="torch", ok=False, error=f"{type(e).__name__}: {_first_line(e)}",
                                 max_abs_err=None, tol=None, note=""))
                continue
            tol = 2 * ref_err + _ATOL[dtype]
            rows.append(dict(base, backend="torch", max_abs_err=ref_err, tol=None, ok=not math.isnan(ref_err),
                             error=None, note="torch on the fp8 cache vs torch on its exact fp32 dequantisation "
                                              "(output rounding)"))
            for name in backends:
                if name == "torch" or fp8_skip_reason(name, op, dtype, device):
                    continue
                row = dict(base, backend=name, tol=tol, max_abs_err=None, ok=False, error=None, note="")
                rows.append(_check_row(row, lambda: call(name), ref, tol, device, failures, name, fp8_key(op)))
            del kc8, vc8
    return rows


# ----------------------------------------------------------------------------- timing rows


def _base_row(op, case, backend, kind) -> dict:
    return dict(op=op, case=case.label if case is not None else None,
                shape=case.shape() if case is not None else None,
                backend=backend, kind=kind, status="ok", error=None, note="",
                median_ms=None, min_ms=None, p20_ms=None, p80_ms=None, mean_ms=None,
                reps=0, warmup=0, cold_l2=None, clock=None,
                flops=None, bytes=None, tflops=None, tbps=None,
                vs_best_anchor=None, pct_copy_bw=None,
                # paged rows: what an anchor row is to its backend row, and the target ratios
                role=None, of_backend=None, speed_vs_dense=None, speed_vs_flashinfer=None,
                time_vs_decode=None, time_vs_split=None,
                # fp8 rows: the cache dtype (None: the input dtype), the row of the same kernel on the
                # 16-bit cache (its backend label) and that row's median / this row's median
                kv_dtype=None, of_16bit=None, speed_vs_16bit=None)


class _Runner:
    def __init__(self, cfg: BenchConfig, device, dtype, quick):
        self.cfg, self.device, self.dtype, self.quick = cfg, device, dtype, quick
        self.reps = cfg.reps if cfg.reps is not None else (5 if quick and device.type == "cpu" else 100)
        if cfg.max_time_s is not None:
            self.max_time_s = cfg.max_time_s
        else:
            self.max_time_s = 0.5 if device.type == "cpu" else 0.3
        # the standard GPU grid must fit a few minutes: past this many seconds of
        # timing (compiles included), rows drop to min_reps
        if cfg.time_budget_s is not None:
            self.time_budget_s = cfg.time_budget_s
        else:
            self.time_budget_s = None if quick else 150.0
        self.t0 = time.perf_counter()
        self.min_reps = 2 if device.type == "cpu" else 10
        self.warmup = 1 if device.type == "cpu" else 3
        self.dead: str | None = None
        self.flex_compile_s = 0.0
        self.fp8 = cfg.kv_cache_dtype == "fp8"

    # torch.compile is the one cost the rep count cannot bound: stop compiling new
    # FlexAttention shapes once this much time went into it
    FLEX_COMPILE_CAP_S = 120.0

    def over_budget(self) -> bool:
        return self.time_budget_s is not None and time.perf_counter() - self.t0 > self.time_budget_s

    def timed(self, row, prepared_factory, work_flops=None, work_bytes=None, cuda_graph=False, check=None):
        """Fill `row` by timing what prepared_factory() returns; errors become the row's status.

        check(prepared) -> note: called after the timing (outside it) to compare the
        anchor's output with a backend's; raising AnchorMismatch makes the row an error."""
        if self.dead:
            row.update(status="error", error=f"not run: the CUDA context was lost earlier ({self.dead})")
            return row
        over = self.over_budget()
        try:
            prepared = prepared_factory()
            with prepared.context():
                t = timing.time_fn(prepared.fn, device=self.device,
                                   reps=self.min_reps if over else self.reps,
                                   min_reps=self.min_reps, warmup=self.warmup,
                                   max_time_s=self.max_time_s, cuda_graph=cuda_graph)
            row.update(t.as_dict())
            notes = [prepared.note] if prepared.note else []
            if t.clock == "cuda-graph":
                notes.append("graph replay")
            elif cuda_graph and self.device.type == "cuda":
                notes.append("eager (not graph-capturable)")
            if over:
                notes.append("reps cut: past --time-budget")
            if check is not None:
                try:
                    with prepared.context():  # the same kernel choice as the timed calls
                        msg = check(prepared)
                except AnchorMismatch as e:
                    row["note"] = "; ".join(notes)
                    row.update(status="error", error=str(e))
                    return row
                if msg:
                    notes.append(msg)
            row["note"] = "; ".join(notes)
            secs = t.median_ms * 1e-3
            if work_flops is not None and secs > 0:
                row["flops"] = work_flops
                row["tflops"] = work_flops / secs / 1e12
            if work_bytes is not None and secs > 0:
                row["bytes"] = work_bytes
                row["tbps"] = work_bytes / secs / 1e12
        except anc.AnchorSkipped as e:
            row.update(status="skipped", error=str(e))
        except Exception as e:  # noqa: BLE001 - one failing kernel must not end the run
            row.update(status="error", error=f"{type(e).__name__}: {_first_line(e)}")
            if self.device.type == "cuda":
                try:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                except Exception as sticky:  # noqa: BLE001
                    # an illegal access poisons the CUDA context: every later row would fail
                    self.dead = f"{row['backend']} on {row['case']}: {_first_line(sticky)}"
        return row


class AnchorMismatch(Exception):
    """An anchor's output disagrees with a cross-checked backend's on the same inputs."""


class _Reference:
    """One backend's output on a case, computed on first use (one untimed call), to judge
    anchors whose layout conversion the cross-check does not cover (FlashInfer, masked SDPA).
    On a GPU a compiled backend is preferred (the torch oracle on a 32k-context case is slow
    and large); on CPU the oracle (exact, and the interpreted Triton takes seconds)."""

    def __init__(self, op, backends, failures, dtype, device, args, fp8: bool = False):
        self.op, self.args, self.out, self.name = op, args, None, None
        pref = ("cuda", "triton", "torch") if device.type == "cuda" else ("torch", "triton", "cuda")
        order = [b for b in pref if b in backends] + [b for b in backends if b not in pref]
        skip, key = (fp8_skip_reason, fp8_key(op)) if fp8 else (_skip_reason, op)
        self.candidates = [b for b in order if (b, key) not in failures and not skip(b, op, dtype, device)]

    def get(self):
        while self.out is None and self.candidates:
            name = self.candidates.pop(0)
            try:
                self.out = backend_op(name, self.op)(*self.args)
                self.name = name
            except Exception:  # noqa: BLE001 - that backend's own row reports it; try the next
                continue
        return self.out

    def check(self, prepared) -> str:
        return self.checker()(prepared)

    def checker(self, index=None):
        """A check for _Runner.timed comparing the output with ref[index] (index: rows of the
        reference, e.g. the last query of each sequence for a decode of the same batch)."""
        return lambda prepared: self._compare(prepared, index)

    def _compare(self, prepared, index) -> str:
        ref = self.get()
        if ref is None:
            return "output not compared (no backend output to compare with)"
        if index is not None:
            ref = ref[index]
        out = prepared.fn()
        if prepared.as_ours is not None:
            out = prepared.as_ours(out)
        err = _max_abs_err(out, ref)
        # a wrong layout or mask gives errors of the size of the output itself; rounding, a few %
        tol = 0.05 * float(ref.float().abs().max()) + 1e-3 if ref.numel() else 0.0
        if math.isnan(err) or err > tol:
            raise AnchorMismatch(f"output differs from {self.name}'s: max |diff| {err:.3g} > {tol:.3g}")
        return f"agrees with {self.name} (max |diff| {err:.2g})"


def _op_factory(name: str, op: str, args: tuple):
    """Resolve the backend op inside the timed row, so an import failure is that row's error."""
    def factory():
        fn = backend_op(name, op)
        return anc.Prepared(fn=lambda: fn(*args))
    return factory


def _backend_rows(r: _Runner, op, case, backends, failures, emit, args, timed_kwargs):
    """One row per backend for `op` on `case`: skipped, failed the cross-check, or timed
    with `timed_kwargs(name)` passed on to _Runner.timed."""
    for name in backends:
        emit(f"{case.label} {name}")
        row = _base_row(op, case, name, "backend")
        skip = _skip_reason(name, op, r.dtype, r.device)
        if skip:
            yield dict(row, status="skipped", error=skip)
            continue
        if (name, op) in failures:
            yield dict(row, status="error", error=f"failed the cross-check: {failures[(name, op)]}")
            continue
        yield r.timed(row, _op_factory(name, op, args), **timed_kwargs(name))


def _fp8_backend_rows(r: _Runner, op, case, backends, failures, emit, args, timed_kwargs):
    """_backend_rows on a float8_e4m3fn cache: rows labelled "<backend> fp8", each pointing
    at the same backend's 16-bit row of the case (of_16bit) for the speed-up ratio."""
    for name in backends:
        label = f"{name} fp8"
        emit(f"{case.label} {label}")
        row = dict(_base_row(op, case, label, "backend"), kv_dtype=FP8_NAME, of_16bit=name)
        skip = fp8_skip_reason(name, op, r.dtype, r.device)
        if skip:
            yield dict(row, status="skipped", error=skip)
            continue
        if (name, fp8_key(op)) in failures:
            yield dict(row, status="error", error=f"failed the fp8 cross-check: {failures[(name, fp8_key(op))]}")
            continue
        yield r.timed(row, _op_factory(name, op, args), **timed_kwargs(name))


def _bench_prefill_case(r: _Runner, case, backends, anchor_names, failures, emit):
    torch.manual_seed(r.cfg.seed)
    q, k, v = cs.make_prefill_inputs(case, r.dtype, r.device, seed=None)
    scale = 1.0 / math.sqrt(case.head_dim)
    args = (q, k, v, case.causal, scale, False)
    yield from _backend_rows(r, "prefill", case, backends, failures, emit, args,
                             lambda name: dict(work_flops=case.flops))
    ref = _Reference("prefill", backends, failures, r.dtype, r.device, args)
    for name in anchor_names:
        emit(f"{case.label} {name}")
        row = _base_row("prefill", case, name, "anchor")
        if name in anc.FLASHINFER_ANCHORS:
            row["role"] = "flashinfer"
            prep = anc.prepare_flashinfer_ragged if name == anc.FI_RAGGED else anc.prepare_flashinfer_paged_prefill
            yield r.timed(row, lambda p=prep: p(q, k, v, causal=case.causal, scale=scale),
                          work_flops=case.flops, check=ref.check)
            continue
        if name == "flex":
            if r.over_budget() or r.flex_compile_s > r.FLEX_COMPILE_CAP_S:
                yield dict(row, status="skipped",
                           error=f"compile budget spent ({r.flex_compile_s:.0f} s of torch.compile so far)"
                           if r.flex_compile_s > r.FLEX_COMPILE_CAP_S else "past --time-budget: no new compiles")
                continue

            def factory():
                t0 = time.perf_counter()
                try:
                    return anc.prepare_flex_prefill(q, k, v, causal=case.causal, scale=scale)
                finally:
                    r.flex_compile_s += time.perf_counter() - t0
        else:
            factory = (lambda n=name: anc.prepare_sdpa_prefill(n, q, k, v, causal=case.causal, scale=scale))
        yield r.timed(row, factory, work_flops=case.flops)


def _bench_decode_case(r: _Runner, case, backends, anchor_names, failures, emit):
    torch.manual_seed(r.cfg.seed)
    # timed inputs: unused slots random, tables exactly as wide as the pages (the split
    # heuristics read the table's capacity)
    q, kc, vc, bt, cl = cs.make_decode_inputs(case, r.dtype, r.device, seed=None, poison=False, spare_columns=0)
    scale = 1.0 / math.sqrt(case.head_dim)
    nbytes = case.bytes(torch.empty((), dtype=r.dtype).element_size())
    # Decode runs inside CUDA graphs in a serving engine, and one call is a few
    # microseconds of GPU work: time graph replays, or Python's launch path is
    # what gets measured. The torch oracle syncs the host (.item()): eager.
    args = (q, kc, vc, bt, cl, scale, False)
    yield from _backend_rows(r, "decode", case, backends, failures, emit, args,
                             lambda name: dict(work_flops=case.flops, work_bytes=nbytes,
                                               cuda_graph=name != "torch"))
    ref = _Reference("decode", backends, failures, r.dtype, r.device, args)
    for name in [a for a in anchor_names if a in anc.FLASHINFER_ANCHORS and a not in anc.FP8_ANCHORS]:
        emit(f"{case.label} {name}")
        row = _base_row("decode", case, name, "anchor")
        row["role"] = "flashinfer"
        yield r.timed(row, lambda tc=(name == anc.FI_DECODE_TC): anc.prepare_flashinfer_decode(
                          q, kc, vc, bt, cl, scale=scale, tensor_cores=tc),
                      work_flops=case.flops, work_bytes=nbytes, cuda_graph=True, check=ref.check)
    ref = None
    if r.fp8:
        yield from _bench_decode_fp8(r, case, backends, anchor_names, failures, emit, q, kc, vc, bt, cl, scale)
    # (the SDPA anchors read contiguous [B, Hkv, L, D] K/V: uniform batches only)
    anchor_names = [a for a in anchor_names if a not in anc.FLASHINFER_ANCHORS] if case.uniform else []
    if anchor_names:
        k4, v4 = cs.contiguous_kv(kc, vc, bt, case.context_len)
        del kc, vc
        for name in anchor_names:
            emit(f"{case.label} {name}")
            row = _base_row("decode", case, name, "anchor")
            yield r.timed(row, lambda n=name: anc.prepare_sdpa_decode(n, q, k4, v4, scale=scale),
                          work_flops=case.flops, work_bytes=nbytes, cuda_graph=True)


def _bench_decode_fp8(r: _Runner, case, backends, anchor_names, failures, emit, q, kc, vc, bt, cl, scale):
    """The decode rows on a float8_e4m3fn copy of the case's cache (per-KV-head amax scales),
    bytes counted at 1 per cached element; FlashInfer's fp8 decode on the same fp8 pages with
    scalar scales (it takes no per-head ones), judged against one of our backends run with the
    same scalar broadcast to every head."""
    kc8, vc8, ks, vs = cs.fp8_caches(kc, vc)
    nbytes = flops.decode_bytes(case.num_q_heads, case.num_kv_heads, case.head_dim, case.lens,
                                q.element_size(), kv_elem_bytes=1)
    args = (q, kc8, vc8, bt, cl, scale, False, ks, vs)
    yield from _fp8_backend_rows(r, "decode", case, backends, failures, emit, args,
                                 lambda name: dict(work_flops=case.flops, work_bytes=nbytes,
                                                   cuda_graph=name != "torch"))
    if anc.FI_DECODE_FP8 in anchor_names:
        yield _fi_fp8_row(r, case, backends, failures, emit, q, kc8, vc8, bt, cl, scale, ks, vs, nbytes)
    del kc8, vc8


def _bench_decode_fi_fp8(r: _Runner, case, backends, anchor_names, failures, emit):
    """FlashInfer's fp8 decode alone, on the same inputs _bench_decode_case builds for the case
    (same seed, same quantisation): the deferred pass of the run."""
    torch.manual_seed(r.cfg.seed)
    q, kc, vc, bt, cl = cs.make_decode_inputs(case, r.dtype, r.device, seed=None, poison=False, spare_columns=0)
    kc8, vc8, ks, vs = cs.fp8_caches(kc, vc)
    del kc, vc
    nbytes = flops.decode_bytes(case.num_q_heads, case.num_kv_heads, case.head_dim, case.lens,
                                q.element_size(), kv_elem_bytes=1)
    yield _fi_fp8_row(r, case, backends, failures, emit, q, kc8, vc8, bt, cl, 1.0 / math.sqrt(case.head_dim),
                      ks, vs, nbytes)


def _fi_fp8_row(r, case, backends, failures, emit, q, kc8, vc8, bt, cl, scale, ks, vs, nbytes):
    """FlashInfer's CUDA-core decode on the fp8 pages with scalar scales (the largest head
    scale), checked against one of our fp8 backends given that scalar for every head."""
    emit(f"{case.label} {anc.FI_DECODE_FP8}")
    k1, v1 = float(ks.max()), float(vs.max())
    ref = _Reference("decode", backends, failures, r.dtype, r.device,
                     (q, kc8, vc8, bt, cl, scale, False, torch.full_like(ks, k1), torch.full_like(vs, v1)), fp8=True)
    row = dict(_base_row("decode", case, anc.FI_DECODE_FP8, "anchor"), role="flashinfer", kv_dtype=FP8_NAME,
               of_16bit=anc.FI_DECODE)
    return r.timed(row, lambda: anc.prepare_flashinfer_decode(q, kc8, vc8, bt, cl, scale=scale, tensor_cores=False,
                                                              k_scale=k1, v_scale=v1),
                   work_flops=case.flops, work_bytes=nbytes, cuda_graph=True, check=ref.check)


def _bench_paged_case(r: _Runner, case, backends, anchor_names, failures, emit):
    """paged_attention rows for each backend, then in the same run what they are judged
    against: the same backend's dense varlen kernel on the K/V made contiguous (chunked,
    mixed), its decode kernel at the same batch and context (spec), the mixed batch
    split into its chunk and its decodes (mixed), SDPA and FlashInfer on the same data."""
    torch.manual_seed(r.cfg.seed)
    dtype, device = r.dtype, r.device
    q, kc, vc, bt, cu, cl = cs.make_paged_inputs(case, dtype, device, seed=None, poison=False, spare_columns=0)
    scale = 1.0 / math.sqrt(case.head_dim)
    es = torch.empty((), dtype=dtype).element_size()
    max_q = max(case.q_lens)
    graph = case.decode_like
    if device.type == "cuda" and r.cfg.backends is None:
        # the oracle loops over sequences in fp32: its rows would time Python, not a kernel
        backends = [b for b in backends if b != "torch"]
    args = (q, kc, vc, bt, cu, cl, max_q, case.causal, scale, False)
    yield from _backend_rows(r, "paged", case, backends, failures, emit, args,
                             lambda name: dict(work_flops=case.flops, work_bytes=case.bytes(es),
                                               cuda_graph=graph and name != "torch"))
    if r.fp8:
        kc8, vc8, ks, vs = cs.fp8_caches(kc, vc)
        nbytes8 = flops.paged_bytes(case.num_q_heads, case.num_kv_heads, case.head_dim, case.q_lens,
                                    case.context_lens, es, kv_elem_bytes=1)
        yield from _fp8_backend_rows(r, "paged", case, backends, failures, emit,
                                     (q, kc8, vc8, bt, cu, cl, max_q, case.causal, scale, False, ks, vs),
                                     lambda name: dict(work_flops=case.flops, work_bytes=nbytes8,
                                                       cuda_graph=graph and name != "torch"))
        del kc8, vc8
    runnable = [b for b in backends if not _skip_reason(b, "paged", dtype, device) and (b, "paged") not in failures]
    ref = _Reference("paged", backends, failures, dtype, device, args)

    if anc.SAME_BACKEND in anchor_names and runnable:
        yield from _same_backend_rows(r, case, runnable, failures, emit, q, kc, vc, bt, cu, cl, scale, es, ref)

    sdpa_names = [a for a in anchor_names if a.startswith("sdpa")]
    if sdpa_names:
        if case.uniform:
            nq, nk = case.q_lens[0], case.context_lens[0]
            q4 = q.view(case.batch, nq, case.num_q_heads, case.head_dim).transpose(1, 2).contiguous()
            k4, v4 = cs.contiguous_kv(kc, vc, bt, nk)
        for name in sdpa_names:
            emit(f"{case.label} {name}")
            row = dict(_base_row("paged", case, name, "anchor"), role="sdpa")
            if not case.uniform:
                yield dict(row, status="skipped", error="sequences of different lengths: no one batched "
                                                        "SDPA call computes this batch")
                continue
            yield r.timed(row, lambda n=name: _with_layout(
                              anc.prepare_sdpa_paged(n, q4, k4, v4, scale=scale),
                              lambda o: o.transpose(1, 2).reshape(q.shape)),
                          work_flops=case.flops, work_bytes=case.bytes(es), cuda_graph=graph, check=ref.check)
        if case.uniform:
            del q4, k4, v4
    if anc.FI_PAGED in anchor_names:
        emit(f"{case.label} {anc.FI_PAGED}")
        row = dict(_base_row("paged", case, anc.FI_PAGED, "anchor"), role="flashinfer")
        yield r.timed(row, lambda: anc.prepare_flashinfer_paged(q, kc, vc, bt, cu, cl, causal=case.causal,
                                                                scale=scale, cuda_graph=graph),
                      work_flops=case.flops, work_bytes=case.bytes(es), cuda_graph=graph, check=ref.check)


def _with_layout(prepared, as_ours):
    prepared.as_ours = as_ours
    return prepared


def _same_backend_rows(r, case, backends, failures, emit, q, kc, vc, bt, cu, cl, scale, es, ref):
    """The anchors a paged row's target ratios divide by, for each backend that timed it.
    Each is compared with the paged output's matching rows (the dense varlen op is not
    in the cross-check, and a decode of a sequence's last query equals its last paged row)."""
    dtype, device = r.dtype, r.device
    lens = list(case.context_lens)

    def anchor_row(name, role, sub, op):
        row = _base_row("paged", case, f"{name} {role}", "anchor")
        row.update(role=role, of_backend=name, shape=dict(case.shape(), part=sub.shape()))
        skip = _skip_reason(name, op, dtype, device)
        if skip:
            return dict(row, status="skipped", error=skip)
        if (name, op) in failures:
            return dict(row, status="error", error=f"failed the cross-check: {failures[(name, op)]}")
        return row

    def varlen_args(seqs):
        """Dense varlen inputs for the sequences `seqs` (K/V gathered once, before timing)."""
        sub_q = torch.cat([q[int(cu[s]):int(cu[s + 1])] for s in seqs]) if len(seqs) < case.batch else q
        k, v, cu_k = cs.gather_varlen_kv(kc, vc, bt[seqs], [lens[s] for s in seqs])
        q_lens = [case.q_lens[s] for s in seqs]
        return (sub_q, k, v, cs.cu_seqlens(q_lens, device), cu_k, max(q_lens),
                max(lens[s] for s in seqs), case.causal, scale, False)

    gather_note = "K/V gathered into contiguous [Tk, Hkv, D] before timing (gather not timed)"
    everything = list(range(case.batch))
    if case.kind in ("chunked", "mixed"):
        dense = varlen_args(everything)
        for name in backends:
            emit(f"{case.label} {name} dense")
            row = anchor_row(name, "dense", case, "prefill_varlen")
            if row["status"] == "ok":
                row = r.timed(row, _op_factory(name, "prefill_varlen", dense),
                              work_flops=case.flops, work_bytes=case.bytes(es), check=ref.checker())
                row["note"] = "; ".join(x for x in (gather_note, row["note"]) if x)
            yield row
        del dense
    if case.kind == "spec":
        # what the same batch costs when each sequence verifies one token instead of q_len
        last = (cu[1:].long() - 1)
        q1 = q[last].contiguous()
        sub = cs.DecodeCase(case.batch, max(lens), case.num_q_heads, case.num_kv_heads, case.head_dim,
                            case.block_size, context_lens=tuple(lens))
        for name in backends:
            emit(f"{case.label} {name} decode")
            row = anchor_row(name, "decode", sub, "decode")  # its FLOPs and bytes are the decode's
            if row["status"] == "ok":
                row = r.timed(row, _op_factory(name, "decode", (q1, kc, vc, bt, cl, scale, False)),
                              work_flops=sub.flops, work_bytes=sub.bytes(es), cuda_graph=name != "torch",
                              check=ref.checker(last))
                row["note"] = "; ".join(x for x in ("plain decode, 1 query per sequence", row["note"]) if x)
            yield row
    if case.kind == "mixed" and case.chunk_seqs and case.decode_seqs:
        chunks, decs = case.chunk_seqs, case.decode_seqs
        part = case.subset(chunks, "chunk")
        sel = torch.tensor(chunks, device=device)
        rows_q = torch.cat([torch.arange(int(cu[s]), int(cu[s + 1])) for s in chunks]).to(device)
        chunk_paged = (q[rows_q].contiguous(), kc, vc, bt[sel].contiguous(), cs.cu_seqlens(part.q_lens, device),
                       cl[sel].contiguous(), max(part.q_lens), case.causal, scale, False)
        chunk_dense = varlen_args(chunks)
        dsel = torch.tensor(decs, device=device)
        q_dec = q[cu[dsel].long()].contiguous()
        dcase = cs.DecodeCase(len(decs), max(lens[s] for s in decs), case.num_q_heads, case.num_kv_heads,
                              case.head_dim, case.block_size, context_lens=tuple(lens[s] for s in decs))
        dec_args = (q_dec, kc, vc, bt[dsel].contiguous(), cl[dsel].contiguous(), scale, False)
        dec_rows = cu[dsel].long()
        for name in backends:
            for role, op, a, work, rows_ref in (
                    ("chunk-paged", "paged", chunk_paged, (part.flops, part.bytes(es)), rows_q),
                    ("chunk-dense", "prefill_varlen", chunk_dense, (part.flops, part.bytes(es)), rows_q),
                    ("decodes", "decode", dec_args, (dcase.flops, dcase.bytes(es)), dec_rows)):
                emit(f"{case.label} {name} {role}")
                row = anchor_row(name, role, part if role != "decodes" else dcase, op)
                if row["status"] == "ok":
                    row = r.timed(row, _op_factory(name, op, a), work_flops=work[0], work_bytes=work[1],
                                  check=ref.checker(rows_ref))
                    what = {"chunk-paged": f"the chunk alone through paged ({part.label})",
                            "chunk-dense": f"the chunk alone through dense varlen; {gather_note}",
                            "decodes": f"the {len(decs)} decodes alone through decode"}[role]
                    row["note"] = "; ".join(x for x in (what, row["note"]) if x)
                yield row


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def finalize_rows(rows: list[dict], copy_tbps: float | None) -> None:
    """vs_best_anchor = (fastest anchor's median) / (this row's median): > 1 is
    faster than every anchor. pct_copy_bw = this row's TB/s / device copy TB/s."""
    best: dict[tuple, float] = {}
    # fp8 rows are judged against the fp8 anchors, 16-bit rows against the 16-bit ones
    for r in rows:
        if r["kind"] == "anchor" and r["status"] == "ok" and r["op"] in ("prefill", "decode"):
            key = (r["op"], r["case"], _is_fp8(r))
            best[key] = min(best.get(key, math.inf), r["median_ms"])
    for r in rows:
        if r["status"] != "ok" or r["op"] not in ("prefill", "decode"):
            continue
        b = best.get((r["op"], r["case"], _is_fp8(r)))
        r["vs_best_anchor"] = (b / r["median_ms"]) if b and r["median_ms"] else None
        if r["op"] == "decode" and copy_tbps and r["tbps"]:
            r["pct_copy_bw"] = 100.0 * r["tbps"] / copy_tbps
    _paged_ratios(rows)
    _fp8_ratios(rows)


_is_fp8 = report.is_fp8


def _fp8_ratios(rows: list[dict]) -> None:
    """speed_vs_16bit = (median of the same kernel on the 16-bit cache of the same case, the
    row named by of_16bit) / (this fp8 row's median): > 1 means the fp8 cache is faster."""
    base = {(r["op"], r["case"], r["backend"]): r["median_ms"] for r in rows
            if not _is_fp8(r) and r.get("status") == "ok" and r.get("median_ms")}
    for r in rows:
        if not _is_fp8(r):
            continue
        r["speed_vs_16bit"] = None
        if r["status"] != "ok" or not r["median_ms"]:
            continue
        b = base.get((r["op"], r["case"], r.get("of_16bit")))
        if b:
            r["speed_vs_16bit"] = b / r["median_ms"]


def _paged_ratios(rows: list[dict]) -> None:
    """Ratios of each paged backend row to its anchors of the same case (medians).
    speed_vs_* > 1 is faster than the anchor; time_vs_* < 1 is faster."""
    ok = [r for r in rows if r["op"] == "paged" and r["status"] == "ok" and r["median_ms"]]
    own: dict[tuple, float] = {}
    external: dict[tuple, float] = {}
    for r in ok:
        if r["kind"] != "anchor":
            continue
        if r.get("of_backend"):
            own[(r["case"], r["of_backend"], r["role"])] = r["median_ms"]
        elif r.get("role") in ("sdpa", "flashinfer"):
            for key in ((r["case"], "any"), (r["case"], r["role"])):
                external[key] = min(external.get(key, math.inf), r["median_ms"])
    for r in rows:
        if r["op"] != "paged" or r["kind"] == "anchor":
            continue
        for key in ("vs_best_anchor", "speed_vs_dense", "speed_vs_flashinfer", "time_vs_decode", "time_vs_split"):
            r[key] = None
        if _is_fp8(r):  # its anchors are 16-bit kernels: its one ratio is speed_vs_16bit
            continue
        if r["status"] != "ok" or not r["median_ms"]:
            continue
        ms, case, name = r["median_ms"], r["case"], r["backend"]
        kind = (r.get("shape") or {}).get("kind")
        best = external.get((case, "any"))
        r["vs_best_anchor"] = best / ms if best else None
        if kind in ("chunked", "mixed") and (case, name, "dense") in own:
            r["speed_vs_dense"] = own[(case, name, "dense")] / ms
        if (case, "flashinfer") in external:
            r["speed_vs_flashinfer"] = external[(case, "flashinfer")] / ms
        if kind == "spec" and (case, name, "decode") in own:
            r["time_vs_decode"] = ms / own[(case, name, "decode")]
        if kind == "mixed":
            chunk = [own[(case, name, k)] for k in ("chunk-paged", "chunk-dense") if (case, name, k) in own]
            decodes = own.get((case, name, "decodes"))
            if chunk and decodes:
                r["time_vs_split"] = ms / (min(chunk) + decodes)


def _anchor_names(cfg: BenchConfig, op: str, device, quick: bool = False) -> list[str]:
    """Anchors timed for `op`: every one that exists on `device`, or those of
    cfg.anchors (check_config has already refused names that do not exist here).
    FlashInfer's are dropped when it does not import, and by default in the quick grid
    (flashinfer_note says so)."""
    names = [a for a in anc.anchors_for(op, device) if a != anc.COPY_ANCHOR]
    if cfg.kv_cache_dtype != "fp8":
        names = [a for a in names if a not in anc.FP8_ANCHORS]
    if cfg.anchors is not None:
        names = [a for a in names if a in cfg.anchors]
    elif quick:
        names = [a for a in names if a not in anc.FLASHINFER_ANCHORS]
    if any(a in anc.FLASHINFER_ANCHORS for a in names) and not anc.flashinfer_available(device)[0]:
        names = [a for a in names if a not in anc.FLASHINFER_ANCHORS]
    return names


def flashinfer_note(cfg: BenchConfig, ops, device, quick: bool = False) -> str | None:
    """The note saying which FlashInfer anchors were not timed and why (None: all that
    were asked for run). FlashInfer is never a dependency: without it the run goes on."""
    gpu = torch.device("cuda")  # the ops' FlashInfer anchors as a GPU run lists them
    wanted = [a for a in anc.FLASHINFER_ANCHORS
              if (cfg.anchors is None or a in cfg.anchors) and any(a in anc.anchors_for(o, gpu) for o in ops)
              and (a not in anc.FP8_ANCHORS or cfg.kv_cache_dtype == "fp8")]
    if not wanted:
        return None
    ok, why = anc.flashinfer_available(device)
    if ok and quick and cfg.anchors is None:
        return (f"FlashInfer anchors not timed in the quick grid ({', '.join(wanted)}): its kernels for the "
                "quick shapes (D=64) are not prebuilt and would JIT-compile for minutes; name them in "
                "--anchors to time them anyway")
    if ok:
        return None
    return (f"FlashInfer anchors not timed ({', '.join(wanted)}): {why}"
            + ("; on the GPU machine `source .anchors/flashinfer/env.sh .anchors/flashinfer/fi_bundle.tar.xz` "
               "makes it importable" if device.type == "cuda" else ""))


def fp8_note(dtype, cfg: BenchConfig, device) -> str:
    """What the fp8 rows are, for the notes of a --kv-cache-dtype fp8 run."""
    dt = str(dtype).replace("torch.", "")
    text = ("fp8 rows (`<backend> fp8`): the same random cache quantised to float8_e4m3fn with per-KV-head "
            f"scales (amax / 448), q and o in {dt}; TB/s counts 1 byte per cached K/V element (q and o at their "
            "own size, the [Hkv] scales not counted); `speed-up vs 16-bit` = the same kernel's median on the "
            f"{dt} cache of the case / its fp8 median, both from this run; the fp8 cross-check compares each "
            "backend with the torch oracle on the same fp8 cache (exactly dequantised, fp32)")
    if cfg.anchors is None or anc.FI_DECODE_FP8 in cfg.anchors:
        text += (f"; {anc.FI_DECODE_FP8}: FlashInfer's CUDA-core decode on the same fp8 pages with scalar "
                 "k_scale/v_scale (it takes no per-head scales; the largest head scale, checked against our "
                 "backend given that scalar for every head)")
        if device.type == "cuda":
            text += ("; its fp8 kernel is JIT-compiled on first use unless prebuilt (minutes), so it is timed "
                     "in a pass after every other decode row")
    return text


def _wants_copy(cfg: BenchConfig, ops, device) -> bool:
    return ("decode" in ops and anc.COPY_ANCHOR in anc.anchors_for("decode", device)
            and (cfg.anchors is None or anc.COPY_ANCHOR in cfg.anchors))


DEFAULT_OUT_ROOT = "minipaged-bench-results"


def default_out_dir(device, quick: bool, heads=None, page_size: int = cs.DEFAULT_PAGE_SIZE) -> Path:
    """./minipaged-bench-results/<device>[-quick][-h<Hq>x<Hkv>x<D>][-p<N>] under the current folder (ignored
    by this repository's .gitignore); results meant to be committed are written with --out. The head
    suffix appears when `heads` (a cases.grid_heads dict) is not the grid's default layout, the page
    suffix when `page_size` is not 16, so a run at another model's shape or page size does not
    overwrite the default one's results."""
    slug = timing.device_slug(device) + ("-quick" if quick else "")
    if heads is not None and dict(heads) != cs.grid_heads(quick):
        slug += f"-h{heads['num_q_heads']}x{heads['num_kv_heads']}x{heads['head_dim']}"
    if page_size != cs.DEFAULT_PAGE_SIZE:
        slug += f"-p{page_size}"
    return Path(DEFAULT_OUT_ROOT) / slug


def _anchor_unavailable(name: str, device) -> str:
    if name == anc.COPY_ANCHOR:
        return ("the copy-bandwidth anchor is measured on a GPU only (the quick CPU cases fit in "
                "the CPU caches, so a percentage of a DRAM copy would mean nothing)")
    if name == "flex":
        return anc.flex_available(device)[1] or "not timed here"
    if name in anc.FLASHINFER_ANCHORS:
        return anc.flashinfer_available(device)[1] or "not timed here"
    if name == anc.SAME_BACKEND:
        return "it belongs to the paged rows (--op paged or all)"
    return anc.sdpa_available(name, device)[1] or "not timed here"


@dataclass
class Plan:
    """What a checked BenchConfig resolves to (check_config)."""

    device: torch.device
    quick: bool
    dtype: torch.dtype
    ops: list[str]
    backends: list[str]
    backend_info: dict
    out_dir: Path
    fp8: bool = False                     # --kv-cache-dtype fp8: decode/paged also on fp8 caches
    heads: dict | None = None             # the layout every grid runs at (None: cases.grid_heads(quick))
    page_size: int = cs.DEFAULT_PAGE_SIZE  # tokens per KV page of the decode and paged cases
    notes: list[str] = field(default_factory=list)  # logged and kept in the results' notes


# integer flags end up in int64 (seeds, counts): anything larger is a typo, not a request
_INT_MAX = 2**63 - 1


def _check_number(flag, value, *, minimum=None, integer=False):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise TypeError(f"{flag} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if isinstance(value, int) and abs(value) > _INT_MAX:
        raise ValueError(f"{flag} must be at most {_INT_MAX} in magnitude, got a {len(str(abs(value)))}-digit number")
    if not math.isfinite(value):
        raise ValueError(f"{flag} must be finite, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{flag} must be >= {minimum}, got {value!r}")


def parse_heads(text: str) -> tuple[int, int, int | None]:
    """--heads HQ/HKV[/D] as (Hq, Hkv, D or None); ValueError naming the flag when it is not that
    shape. The numbers themselves are judged by check_config."""
    parts = str(text).split("/")
    if len(parts) not in (2, 3) or not all(re.fullmatch(r"\s*[+-]?\d+\s*", x) for x in parts):
        raise ValueError(f"--heads must be HQ/HKV or HQ/HKV/D (query heads / KV heads / head dim, e.g. 32/8 "
                         f"or 64/8/128), got {text!r}")
    hq, hkv, *d = (int(x) for x in parts)
    return hq, hkv, (d[0] if d else None)


def heads_text(heads) -> str:
    """(Hq, Hkv, D | None) as --heads spells it."""
    return "/".join(str(x) for x in heads if x is not None)


def check_heads(heads) -> tuple[int, int, int | None] | None:
    """cfg.heads normalised to (Hq, Hkv, D | None); TypeError / ValueError for what no grid can run."""
    if heads is None:
        return None
    if isinstance(heads, str) or not isinstance(heads, (tuple, list)) or len(heads) not in (2, 3):
        raise TypeError(f"heads must be (HQ, HKV) or (HQ, HKV, D), got {heads!r}")
    hq, hkv, d = (*heads, None)[:3]
    for name, value in (("HQ", hq), ("HKV", hkv), ("D", d)):
        if value is not None or name != "D":
            _check_number(f"--heads {heads_text(heads)}: {name}", value, minimum=1, integer=True)
    if hq % hkv:
        raise ValueError(f"--heads {heads_text((hq, hkv, d))}: HQ={hq} is not a multiple of HKV={hkv} "
                         "(grouped-query attention shares each KV head among HQ/HKV query heads)")
    return hq, hkv, d


def check_page_size(page_size) -> int:
    """cfg.page_size (--page-size) as an int; TypeError / ValueError unless it is a power of two from 1 to 256
    (what the kernels take, as `minipaged generate --block-size`)."""
    _check_number("--page-size", page_size, integer=True)
    if page_size is None:
        raise TypeError("--page-size must be an integer, got None")
    if not is_block_size(page_size):
        raise ValueError(f"--page-size must be a power of two from 1 to {MAX_BLOCK_SIZE}, got {page_size}")
    return page_size


def head_dim_reason(backend: str, head_dim: int) -> str | None:
    """Why `backend` cannot run head dim `head_dim` by its registry entry (None: it can)."""
    from minipaged import registry

    dims = registry.all_backends()[backend].head_dims
    if head_dim in dims:
        return None
    return f"{backend} supports head dims {', '.join(str(x) for x in dims)} only, not D={head_dim}"


def check_config(cfg: BenchConfig, *, log=None) -> Plan:
    """Every check on a BenchConfig, before any case runs: ValueError / TypeError for a
    bad value, BackendUnavailableError for a named backend that cannot run here,
    OSError for an output folder that cannot be written. Switches the Triton
    interpreter on when there is no GPU (it decides whether triton is available)."""
    from minipaged import registry

    log = log or cfg.log
    if cfg.op not in (*OPS_ALL, "all"):
        raise ValueError(f"op must be prefill, decode, paged or all, got {cfg.op!r}")
    _check_number("--reps", cfg.reps, minimum=1, integer=True)
    _check_number("--max-time", cfg.max_time_s)
    _check_number("--time-budget", cfg.time_budget_s, minimum=0)
    _check_number("--seed", cfg.seed, minimum=0, integer=True)
    wanted_heads = check_heads(cfg.heads)
    page_size = check_page_size(cfg.page_size)
    if cfg.dtype is not None and cfg.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {cfg.dtype!r}")
    if cfg.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {list(KV_CACHE_DTYPES)}, got {cfg.kv_cache_dtype!r}")
    fp8 = cfg.kv_cache_dtype == "fp8"
    if fp8 and cfg.op == "prefill":
        raise ValueError("--kv-cache-dtype fp8: the fp8 rows are decode and paged rows; --op prefill has none "
                         "(use --op decode, paged or all)")
    if fp8 and cfg.dtype == "float32":
        raise ValueError("--kv-cache-dtype fp8 needs --dtype bfloat16 or float16 (q, k, v and o stay 16-bit with "
                         "an fp8 cache), got --dtype float32")
    device, quick = pick_device(cfg.quick, log)
    interp_ok = enable_triton_interpreter(log) if device.type == "cpu" else True
    if cfg.dtype is None:
        # the CPU quick grid runs fp32, but an fp8 cache needs 16-bit q (and the interpreter's bf16 is wrong)
        dtype = (torch.float16 if fp8 else torch.float32) if device.type == "cpu" else torch.bfloat16
    else:
        dtype = DTYPES[cfg.dtype]
    ops = list(OPS_ALL) if cfg.op == "all" else [cfg.op]

    if cfg.anchors is not None:
        known = anc.all_anchor_names()
        here = sorted({a for o in ops for a in anc.anchors_for(o, device)})
        unknown = sorted(set(cfg.anchors) - set(known))
        if unknown:
            raise ValueError(f"--anchors: unknown anchor(s) {unknown}; valid names are {known} "
                             f"(on {device.type} with --op {cfg.op}: {here})")
        for name in cfg.anchors:
            if name not in here:
                where = [o for o in OPS_ALL if name in anc.anchors_for(o, device)]
                why = (f"it is a {where[0]} anchor and --op is {cfg.op}" if where
                       else _anchor_unavailable(name, device))
                raise ValueError(f"--anchors {name}: not timed on {device.type}: {why}")
            if name == "flex" and not anc.flex_available(device)[0]:
                raise ValueError(f"--anchors flex: {anc.flex_available(device)[1]}")
            if name in anc.FLASHINFER_ANCHORS and not anc.flashinfer_available(device)[0]:
                raise ValueError(f"--anchors {name}: {anc.flashinfer_available(device)[1]}")
            if name in anc.FP8_ANCHORS and not fp8:
                raise ValueError(f"--anchors {name}: it is timed on an fp8 cache, only with --kv-cache-dtype fp8")

    backends, backend_info = select_backends(cfg, device)
    if device.type == "cpu" and not interp_ok:
        if cfg.backends is not None and "triton" in cfg.backends:
            raise registry.BackendUnavailableError(
                "--backends triton: minipaged.triton was imported before TRITON_INTERPRET=1 could be "
                "set; run `TRITON_INTERPRET=1 minipaged bench ...`")
        backends = [b for b in backends if b != "triton"]
    heads = cs.grid_heads(quick, wanted_heads)
    backends, notes = _fit_head_dim(cfg, backends, heads, wanted_heads)
    if cfg.backends is not None:
        for name in backends:
            reasons = [_skip_reason(name, op, dtype, device) for op in ops]
            if all(reasons):
                raise ValueError(f"--backends {name}: nothing to time with --op {cfg.op} in "
                                 f"{str(dtype).replace('torch.', '')} on {device.type}: {'; '.join(dict.fromkeys(reasons))}")

    if fp8:
        fp8_ops = [o for o in ops if o in FP8_OPS]
        if not fp8_backends(backends, fp8_ops, dtype, device):
            from minipaged import registry as _reg

            why = "; ".join(dict.fromkeys(fp8_skip_reason(b, o, dtype, device) for b in backends for o in fp8_ops))
            have = [n for n, b in _reg.all_backends().items() if b.fp8_kv]
            raise ValueError(f"--kv-cache-dtype fp8: none of the backends {backends} runs {'/'.join(fp8_ops)} on a "
                             f"float8_e4m3fn cache here ({why or 'no backends'}); backends with fp8 KV-cache "
                             f"kernels: {have}")

    out_dir = Path(cfg.out) if cfg.out else default_out_dir(device, quick, heads, page_size)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".minipaged-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise OSError(f"--out {str(out_dir)!r}: cannot write results there: "
                      f"{e.strerror or type(e).__name__}") from None
    return Plan(device, quick, dtype, ops, backends, backend_info, out_dir, fp8, heads, page_size, notes)


def _fit_head_dim(cfg: BenchConfig, backends: list[str], heads: dict, wanted) -> tuple[list[str], list[str]]:
    """(the backends that run the layout's head dim, notes for the results). A backend named in
    --backends that cannot is an error, as a named backend unavailable here is; one that was only
    a default is left out with a note. The cross-check's torch oracle must run it too."""
    d = heads["head_dim"]
    layout = f"head dim D={d}" + (f" (--heads {heads_text(wanted)})" if wanted else "")
    unfit = {b: why for b in backends if (why := head_dim_reason(b, d))}
    notes = []
    if unfit and cfg.backends is not None:
        raise ValueError(f"--backends {', '.join(unfit)} cannot run {layout}: {'; '.join(unfit.values())}")
    if unfit:
        backends = [b for b in backends if b not in unfit]
        if not backends:
            raise ValueError(f"no backend here runs {layout}: {'; '.join(unfit.values())}")
        notes.append(f"left out at {layout}: {'; '.join(unfit.values())}")
    oracle = head_dim_reason("torch", d)
    if cfg.crosscheck and oracle:
        raise ValueError(f"the cross-check's torch oracle cannot run {layout}: {oracle}; pass --no-crosscheck "
                         "to time without it")
    return backends, notes


def run_bench(cfg: BenchConfig, plan: Plan | None = None) -> dict:
    """Run the whole benchmark; returns the result dict also written to results.json.
    `plan` is check_config(cfg) when the caller already ran it."""
    log = cfg.log
    if plan is None:
        plan = check_config(cfg)
    device, quick, dtype = plan.device, plan.quick, plan.dtype

    # On CPU (a functional check, not a speed figure) one intra-op thread: on a
    # loaded small box, spinning intra-op threads bury a short call in noise.
    saved_threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        return _run(cfg, device, quick, dtype, plan.ops, plan.backends, plan.backend_info, plan.out_dir, log,
                    fp8=plan.fp8, heads=plan.heads, page_size=plan.page_size, notes=plan.notes)
    finally:
        torch.set_num_threads(saved_threads)


def _run(cfg, device, quick, dtype, ops, backends, backend_info, out_dir, log, fp8: bool = False,
         heads: dict | None = None, page_size: int = cs.DEFAULT_PAGE_SIZE, notes=()) -> dict:
    heads = heads or cs.grid_heads(quick, cfg.heads)
    env = timing.environment(device)
    env["torch_threads"] = torch.get_num_threads()
    result = dict(
        schema=SCHEMA, env=env,
        config=dict(op=cfg.op, dtype=str(dtype).replace("torch.", ""), quick=quick,
                    backends=backends, anchors=cfg.anchors, reps=cfg.reps,
                    max_time_s=cfg.max_time_s, time_budget_s=cfg.time_budget_s, seed=cfg.seed,
                    kv_cache_dtype=cfg.kv_cache_dtype, heads=dict(heads), page_size=page_size),
        backends=backend_info, crosscheck=[], rows=[], copy_bandwidth_tbps=None, notes=[],
        complete=False,
    )
    log(f"minipaged bench on {env['device_name']}"
        + (f" ({env['sm_count']} SMs)" if env["sm_count"] else "")
        + f", torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, commit {env['git_commit'][:12]}")
    log(f"dtype {result['config']['dtype']}, {'quick grid' if quick else 'standard grid'} at "
        f"Hq={heads['num_q_heads']} Hkv={heads['num_kv_heads']} D={heads['head_dim']}"
        + (f", {page_size}-token pages" if {"decode", "paged"} & set(ops) else "")
        + f", backends: {', '.join(backends) or '(none)'}"
        + (f"; fp8 KV-cache rows for {', '.join(fp8_backends(backends, ops, dtype, device))}" if fp8 else ""))
    if fp8:
        result["notes"].append(fp8_note(dtype, cfg, device))
    for note in notes:
        result["notes"].append(note)
        log(f"note: {note}")
    for b, info in backend_info.items():
        if not info["available"]:
            log(f"  {b}: unavailable ({info['reason']})")

    def save():
        outputs.write_all(result, out_dir, plots=False)

    r = _Runner(cfg, device, dtype, quick)
    failures: dict = {}
    try:
        if cfg.crosscheck:
            t0 = time.perf_counter()
            try:
                rows, failures = crosscheck(backends, device, dtype, quick, log, ops,
                                            anchor_names=_anchor_names(cfg, "prefill", device, quick), heads=heads,
                                            page_size=page_size)
            except Exception as e:  # noqa: BLE001 - the timing can still say something
                msg = f"cross-check aborted: {type(e).__name__}: {_first_line(e)}"
                rows = [dict(op="-", case="-", backend="-", ok=False, error=msg, max_abs_err=None)]
                result["notes"].append(msg)
            if fp8:
                try:
                    rows += crosscheck_fp8(backends, device, dtype, quick, log, ops, failures, heads=heads,
                                           page_size=page_size)
                except Exception as e:  # noqa: BLE001 - the timing can still say something
                    msg = f"fp8 cross-check aborted: {type(e).__name__}: {_first_line(e)}"
                    rows.append(dict(op="-", case="-", backend="-", ok=False, error=msg, max_abs_err=None,
                                     kv_dtype=FP8_NAME))
                    result["notes"].append(msg)
            result["crosscheck"] = rows
            compared, skipped = crosscheck_plan(list(backend_info), device, dtype, ops)
            if fp8:
                c8, s8 = crosscheck_plan_fp8(list(backend_info), device, dtype, ops)
                compared, skipped = compared + c8, skipped + s8
            compared = [c for c in compared if c[0] in backends]
            skipped = [x for x in skipped if x[0] in backends or x[1] is None]
            result["crosscheck_skipped"] = [dict(backend=b, op=o, reason=why) for b, o, why in skipped]
            log(report.crosscheck_table(rows, dtype))
            log(report.crosscheck_plan_text(compared, skipped))
            log(f"(cross-check took {time.perf_counter() - t0:.1f} s, including any JIT builds)")
            _free(device)
            save()

        case_lists = {"prefill": (cs.quick_prefill_cases if quick else cs.standard_prefill_cases)(heads),
                      "decode": (cs.quick_decode_cases if quick else cs.standard_decode_cases)(heads, page_size),
                      "paged": (cs.quick_paged_cases if quick else cs.standard_paged_cases)(heads, page_size)}
        fi_note = flashinfer_note(cfg, ops, device, quick)
        if fi_note:
            result["notes"].append(fi_note)
            log(f"note: {fi_note}")
        total = sum(len(case_lists[o]) for o in ops) + (1 if "decode" in ops else 0)
        bar = _progress(total, cfg.progress)
        # a forced redraw per row is fine on a terminal, noise in a log file
        emit = lambda s: bar.set_postfix_str(s, refresh=sys.stderr.isatty())  # noqa: E731
        t_bench = r.t0 = time.perf_counter()
        try:
            if "decode" in ops and device.type != "cuda":
                result["notes"].append(
                    "no copy-bandwidth anchor on CPU: the quick decode cases fit in the CPU caches, "
                    "so their TB/s is not comparable with a DRAM copy")
            if _wants_copy(cfg, ops, device):
                emit("copy bandwidth")
                row = _base_row("copy", None, anc.COPY_ANCHOR, "anchor")
                copy_bytes = anc.copy_buffer_bytes(device)
                row["case"] = f"{copy_bytes >> 20} MiB D2D copy"
                r.timed(row, lambda: anc.prepare_copy(device, copy_bytes)[0], work_bytes=2 * copy_bytes)
                result["rows"].append(row)
                if row["status"] == "ok":
                    result["copy_bandwidth_tbps"] = row["tbps"]
                else:
                    log(f"copy bandwidth: {row['status']}: {row['error']}")
                _free(device)
            if "decode" in ops:
                bar.update(1)
            for op in ops:
                anchor_names = _anchor_names(cfg, op, device, quick)
                bench_case = {"prefill": _bench_prefill_case, "decode": _bench_decode_case,
                              "paged": _bench_paged_case}[op]
                work = [(case, bench_case) for case in case_lists[op]]
                if op == "decode" and anc.FI_DECODE_FP8 in anchor_names:
                    # FlashInfer's fp8 decode kernel is not among the prebuilt ones: its JIT build
                    # (minutes) comes after every other decode row, so a stage cap cuts only it
                    anchor_names = [a for a in anchor_names if a != anc.FI_DECODE_FP8]
                    work += [(case, _bench_decode_fi_fp8) for case in case_lists[op]]
                    bar.total = (bar.total or 0) + len(case_lists[op])
                for case, bench_case in work:
                    try:
                        for row in bench_case(r, case, backends, anchor_names, failures, emit):
                            result["rows"].append(row)
                    except Exception as e:  # noqa: BLE001 - e.g. out of memory building inputs
                        row = _base_row(op, case, "(inputs)", "setup")
                        row.update(status="error", error=f"{type(e).__name__}: {_first_line(e)}")
                        result["rows"].append(row)
                        log(f"{op} {case.label}: case setup failed: {row['error']}")
                    _free(device)
                    finalize_rows(result["rows"], result["copy_bandwidth_tbps"])
                    save()
                    bar.update(1)
        finally:
            bar.close()
        result["bench_seconds"] = time.perf_counter() - t_bench
        result["complete"] = True
    except KeyboardInterrupt:
        result["notes"].append("interrupted: partial results")
        log("interrupted: writing partial results")
    finally:
        result["rows"] = grouped_rows(result["rows"])
        finalize_rows(result["rows"], result["copy_bandwidth_tbps"])
        paths = outputs.write_all(result, out_dir, plots=cfg.plots, log=log)
    for op in ops:
        log(report.text_table(result["rows"], op, result["copy_bandwidth_tbps"]))
    if result.get("bench_seconds") is not None:
        log(f"timing took {result['bench_seconds']:.1f} s")
    log("wrote " + ", ".join(str(p) for p in paths))
    return result


def _progress(total: int, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency, but a bar is not worth failing for
        return _NoBar()
    # into a pipe or log file, redraw rarely: each redraw is a new line there
    interactive = sys.stderr.isatty()
    return tqdm(total=total, desc="bench", unit="case", disable=not enabled, file=sys.stderr,
                dynamic_ncols=True, leave=interactive is False, mininterval=0.1 if interactive else 5.0)


def grouped_rows(rows: list[dict]) -> list[dict]:
    """The rows with those of one (op, case) together, in the order each case first appears
    (rows timed in a later pass, e.g. FlashInfer's fp8 decode, join their case)."""
    first: dict[tuple, int] = {}
    for i, r in enumerate(rows):
        first.setdefault((r["op"], r["case"]), i)
    return sorted(rows, key=lambda r: first[(r["op"], r["case"])])


class _NoBar:
    total = 0

    def update(self, n=1):
        pass

    def set_postfix_str(self, s, refresh=True):
        pass

    def close(self):
        pass


def results_exit_code(result: dict) -> int:
    """0 when every cross-check passed; 1 if one failed (timing errors don't fail the run)."""
    bad = [r for r in result.get("crosscheck", []) if not r.get("ok") and r.get("kind") != "anchor"]
    return 1 if bad else 0


def load(path) -> dict:
    with open(path) as f:
        return json.load(f)
