"""The benchmark harness: FLOP/byte counts, the timing function, the inputs the
grids build, the anchors computing the same attention as the oracle, and the
CPU quick mode end to end (tables, JSON schema, error rows)."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from minipaged import reference
from minipaged.benchmark import anchors as anc
from minipaged.benchmark import cases as cs
from minipaged.benchmark import flops, report, runner, timing

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- counts


def _brute_pairs(nq, nk, causal):
    return sum(1 for i in range(nq) for j in range(nk) if not causal or j < nk - nq + i + 1)


@pytest.mark.parametrize("causal", [True, False])
def test_visible_pairs_matches_the_mask(causal):
    for nq, nk in itertools.product([0, 1, 2, 5, 17, 33], [0, 1, 3, 17, 40]):
        assert flops.visible_pairs(nq, nk, causal) == _brute_pairs(nq, nk, causal), (nq, nk)


def test_prefill_flops_formulas():
    # Nq == Nk causal: exactly N(N+1)/2 pairs (not the N^2/2 approximation)
    b, h, n, d = 2, 16, 1024, 128
    assert flops.prefill_flops(b, h, n, n, d, causal=True) == 4 * b * h * d * n * (n + 1) // 2
    assert flops.prefill_flops(b, h, 300, 1023, d, causal=False) == 4 * b * h * 300 * 1023 * d
    # a chunk after a prefix: row i sees 723 + i + 1 keys
    assert flops.prefill_flops(1, 1, 300, 1023, 1, True) == 4 * sum(724 + i for i in range(300))
    assert cs.PrefillCase(8, 1024, 1024, 16, 8, 128).flops == 4 * 8 * 16 * 128 * 1024 * 1025 // 2


def test_decode_bytes_counts_only_real_tokens():
    hq, hkv, d, es = 16, 8, 128, 2
    lens = [1, 17, 4096]
    kv = sum(lens) * hkv * d * es * 2
    qo = len(lens) * hq * d * es * 2
    assert flops.decode_bytes(hq, hkv, d, lens, es) == kv + qo
    case = cs.DecodeCase(3, 4096, hq, hkv, d, 16, context_lens=tuple(lens))
    assert case.bytes(es) == kv + qo
    assert flops.decode_flops(hq, d, lens) == 4 * hq * d * sum(lens)
    assert flops.copy_bytes(10) == 20


# ----------------------------------------------------------------------------- timing


def test_percentile_and_summary():
    assert timing.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert timing.percentile([1.0, 2.0], 50) == 1.5
    assert timing.percentile([0.0, 10.0], 20) == pytest.approx(2.0)
    t = timing.summarize([5.0, 1.0, 3.0, 2.0, 4.0], warmup=1, cold_l2=False, clock="x")
    assert (t.min_ms, t.median_ms, t.reps) == (1.0, 3.0, 5)
    assert t.p20_ms <= t.median_ms <= t.p80_ms
    with pytest.raises(ValueError):
        timing.percentile([], 50)


def test_time_fn_on_cpu_counts_calls_and_measures_sleep():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    t = timing.time_fn(fn, device="cpu", reps=7, min_reps=2, warmup=2, max_time_s=0)
    assert t.reps == 7 and len(calls) == 2 + 7  # warm-up kept out of the figures
    assert t.clock == "perf_counter" and not t.cold_l2
    assert 2.0 <= t.min_ms <= t.median_ms <= t.p80_ms
    assert t.median_ms < 50


def test_time_fn_time_bound_keeps_min_reps():
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.02)

    t = timing.time_fn(slow, device="cpu", reps=100, min_reps=3, warmup=1, max_time_s=0.01)
    assert t.reps == 3 and len(calls) == 4
    with pytest.raises(ValueError):
        timing.time_fn(slow, device="cpu", reps=0)


@pytest.mark.parametrize("mode", [None, "read", "write"])
def test_cuda_path_flushes_between_event_pairs(monkeypatch, mode):
    """The CUDA branch, driven by a fake clock: warm-up and estimate calls stay
    out of the figures, and the L2 flush (read by default) lands before each
    start event."""
    log = []
    if mode is None:
        monkeypatch.delenv("MINIPAGED_BENCH_L2_FLUSH", raising=False)
    else:
        monkeypatch.setenv("MINIPAGED_BENCH_L2_FLUSH", mode)
    expected = "flush-write" if mode == "write" else "flush-read"

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            log.append("record")
            self.t = time.perf_counter()

        def elapsed_time(self, other):
            return (other.t - self.t) * 1000.0

    class FakeFlush:
        def zero_(self):
            log.append("flush-write")

        def sum(self):
            log.append("flush-read")

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    monkeypatch.setattr(timing, "_flush_buffer", lambda d: FakeFlush())

    def fn():
        log.append("fn")
        time.sleep(0.001)

    t = timing.time_fn(fn, device="cuda", reps=6, min_reps=2, warmup=2, max_time_s=0)
    assert t.clock == "cuda-events" and t.cold_l2 and t.reps == 6
    assert t.min_ms >= 1.0
    records = [i for i, x in enumerate(log) if x == "record"]
    timed = log[records[1] + 1:]  # after the estimate's event pair
    assert timed == [expected, "record", "fn", "record"] * 6
    assert log.count("fn") == 2 + 3 + 6  # warm-up, estimate, timed


def test_environment_records_versions_and_commit():
    env = timing.environment("cpu")
    for key in ("device_name", "torch", "triton", "cuda", "git_commit", "date_utc", "sm_count"):
        assert key in env
    assert env["torch"] == torch.__version__
    assert env["git_commit"]
    assert timing.device_slug("cpu") == "cpu"


# ----------------------------------------------------------------------------- grids and inputs


def test_standard_grids_are_the_documented_ones():
    pre = cs.standard_prefill_cases()
    assert [(c.batch, c.seqlen_q) for c in pre] == [(1, 1024), (1, 4096), (1, 8192), (1, 16384), (8, 1024)]
    assert all((c.num_q_heads, c.num_kv_heads, c.head_dim, c.causal) == (16, 8, 128, True) for c in pre)
    dec = cs.standard_decode_cases()
    assert [(c.batch, c.context_len) for c in dec] == [(1, 4096), (1, 32768), (8, 4096), (32, 4096),
                                                       (64, 8192), (256, 1024)]
    assert all(c.block_size == 16 and c.num_q_heads == 16 and c.num_kv_heads == 8 for c in dec)


def test_decode_inputs_scatter_pages_and_pad_tables():
    torch.manual_seed(0)
    case = cs.DecodeCase(3, 40, 4, 2, 64, 16, context_lens=(0, 17, 40))
    q, kc, vc, bt, cl = cs.make_decode_inputs(case, torch.float32, "cpu", pad_value=float("nan"))
    assert bt.dtype == torch.int32 and cl.tolist() == [0, 17, 40]
    used = [bt[b, : (n + 15) // 16].tolist() for b, n in enumerate(cl.tolist())]
    flat = sum(used, [])
    assert len(flat) == len(set(flat)) == 0 + 2 + 3 and all(0 <= x < kc.shape[0] for x in flat)
    assert bt[0].tolist() == [-1, -1, -1] and bt[1, 2].item() == -1
    # the slots no sequence owns are NaN; every real token is finite
    assert torch.isfinite(kc[bt[2, :3].long()].reshape(-1, 2, 64)[:40]).all()
    assert torch.isnan(kc[bt[1, 1].long(), 1:]).all()
    assert torch.isfinite(q).all()


def test_decode_inputs_uniform_case_uses_a_random_permutation():
    torch.manual_seed(0)
    case = cs.DecodeCase(4, 64, 4, 2, 64, 16)
    _, kc, _, bt, _ = cs.make_decode_inputs(case, torch.float16, "cpu")
    assert sorted(bt.flatten().tolist()) == sorted(set(bt.flatten().tolist()))
    assert bt.flatten().tolist() != sorted(bt.flatten().tolist())  # scattered, not in order
    assert kc.shape == (4 * 4 + 1, 16, 2, 64) and kc.dtype == torch.float16


# ----------------------------------------------------------------------------- anchors


def test_cpu_sdpa_prefill_anchor_is_the_same_attention():
    torch.manual_seed(0)
    case = cs.PrefillCase(1, 37, 37, 4, 2, 64)
    q, k, v = cs.make_prefill_inputs(case, torch.float32, "cpu")
    scale = 1 / math.sqrt(64)
    prep = anc.prepare_sdpa_prefill(anc.CPU_SDPA, q, k, v, causal=True, scale=scale)
    with prep.context():
        out = prep.fn()
    ref = reference.prefill(q, k, v, True, scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert "CPU" in prep.note  # the row says which kernel ran
    # the CUDA kernels' names are not given to CPU rows: FlashAttention does not run on CPU
    for name in ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient"):
        with pytest.raises(anc.AnchorSkipped, match="CUDA only"):
            anc.prepare_sdpa_prefill(name, q, k, v, causal=True, scale=scale)
    assert anc.anchors_for("prefill", torch.device("cpu")) == (anc.CPU_SDPA,)
    assert anc.anchors_for("decode", torch.device("cpu")) == (anc.CPU_SDPA,)  # no copy anchor on CPU


def test_sdpa_decode_anchor_matches_the_paged_oracle():
    torch.manual_seed(0)
    case = cs.DecodeCase(3, 50, 8, 2, 64, 16)
    q, kc, vc, bt, cl = cs.make_decode_inputs(case, torch.float32, "cpu")
    k4, v4 = cs.contiguous_kv(kc, vc, bt, case.context_len)
    assert k4.shape == (3, 2, 50, 64)
    scale = 0.125
    prep = anc.prepare_sdpa_decode(anc.CPU_SDPA, q, k4, v4, scale=scale)
    with prep.context():
        out = prep.fn().reshape(3, 8, 64)
    torch.testing.assert_close(out, reference.decode(q, kc, vc, bt, cl, scale), atol=1e-5, rtol=1e-5)


def test_copy_anchor_moves_bytes():
    prep, moved = anc.prepare_copy(torch.device("cpu"), 1 << 20)
    assert moved == 2 << 20
    prep.fn()


# ----------------------------------------------------------------------------- rows and report


def _cfg(**kw):
    return runner.BenchConfig(log=lambda s: None, **kw)


def test_failing_kernel_records_an_error_row():
    r = runner._Runner(_cfg(quick=True), torch.device("cpu"), torch.float32, True)

    def boom():
        raise RuntimeError("kernel exploded\nsecond line")

    case = cs.PrefillCase(1, 8, 8, 2, 1, 64)
    row = r.timed(runner._base_row("prefill", case, "x", "backend"), lambda: anc.Prepared(fn=boom))
    assert row["status"] == "error" and row["error"] == "RuntimeError: kernel exploded"
    ok = r.timed(runner._base_row("prefill", case, "y", "backend"),
                 lambda: anc.Prepared(fn=lambda: None), work_flops=case.flops)
    assert ok["status"] == "ok" and ok["reps"] >= 2 and ok["tflops"] > 0
    table = report.text_table([row, ok], "prefill")
    assert "ERROR: RuntimeError: kernel exploded" in table


def test_a_build_failure_skips_every_backend_of_that_extension():
    keys = runner._failure_keys("cuda", "prefill", RuntimeError("Error building extension 'minipaged_cuda'"))
    assert ("cuda", "decode") in keys and ("cuda-wmma", "prefill") in keys
    assert not any(b in ("torch", "triton") for b, _ in keys)
    assert runner._failure_keys("triton", "decode", ValueError("bad shape")) == [("triton", "decode")]
    assert runner._failure_keys("triton", "prefill", RuntimeError("CompilationError at 3:4")) == [
        ("triton", "prefill")]


def test_flex_rows_stop_compiling_past_the_cap():
    r = runner._Runner(_cfg(quick=True), torch.device("cpu"), torch.float32, True)
    case = cs.PrefillCase(1, 16, 16, 2, 1, 64)
    rows = list(runner._bench_prefill_case(r, case, [], ["flex"], {}, lambda s: None))
    assert rows[0]["status"] == "skipped" and "CUDA only" in rows[0]["error"]  # CPU: no compile
    r.flex_compile_s = r.FLEX_COMPILE_CAP_S + 1
    rows = list(runner._bench_prefill_case(r, case, [], ["flex"], {}, lambda s: None))
    assert rows[0]["status"] == "skipped" and "compile budget" in rows[0]["error"]


def test_ratio_to_best_anchor_and_copy_fraction():
    rows = []
    for backend, kind, ms in [("a", "backend", 2.0), ("f", "anchor", 1.0), ("g", "anchor", 4.0)]:
        row = runner._base_row("decode", cs.DecodeCase(1, 16, 2, 1, 64), backend, kind)
        row.update(median_ms=ms, tbps=1.0 / ms)
        rows.append(row)
    broken = runner._base_row("decode", cs.DecodeCase(1, 16, 2, 1, 64), "h", "anchor")
    broken.update(status="error", error="x")
    runner.finalize_rows(rows + [broken], copy_tbps=2.0)
    assert rows[0]["vs_best_anchor"] == pytest.approx(0.5)  # best anchor 1 ms / 2 ms
    assert rows[1]["vs_best_anchor"] == pytest.approx(1.0)
    assert rows[0]["pct_copy_bw"] == pytest.approx(25.0)
    assert broken["vs_best_anchor"] is None


def test_json_is_strict_even_with_nan(tmp_path):
    result = dict(schema=runner.SCHEMA, env=timing.environment("cpu"),
                  config=dict(dtype="float32", quick=True), backends={},
                  crosscheck=[dict(op="prefill", case="c", backend="b", max_abs_err=float("nan"),
                                   tol=1.0, ok=False, error=None, note="NaN in the output")],
                  rows=[], copy_bandwidth_tbps=None, notes=[], complete=True)
    paths = report.write_all(result, tmp_path, plots=False)
    data = json.loads(paths[0].read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    assert data["crosscheck"][0]["max_abs_err"] is None
    assert "FAIL (NaN in the output)" in paths[1].read_text()


def test_plots_rerender_from_json(quick_run, tmp_path):
    pytest.importorskip("matplotlib")
    from minipaged.benchmark import plots

    _, out, _ = quick_run
    assert plots.main([str(out), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "prefill.png").stat().st_size > 1000 and (tmp_path / "decode.png").exists()
    data = json.loads((tmp_path / "results.json").read_text())
    assert not any(n.startswith("plots skipped") for n in data["notes"])
    assert "## Decode" in (tmp_path / "results.md").read_text()


def test_plots_skip_with_a_note_without_matplotlib(tmp_path, monkeypatch):
    from minipaged.benchmark import plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    made, why = plots.make_plots({"rows": [], "env": {}, "config": {}}, tmp_path)
    assert made == [] and "matplotlib" in why


# ----------------------------------------------------------------------------- the quick mode, end to end

_ROW_KEYS = {"op", "case", "shape", "backend", "kind", "status", "error", "note", "median_ms", "min_ms",
             "p20_ms", "p80_ms", "mean_ms", "reps", "flops", "bytes", "tflops", "tbps",
             "vs_best_anchor", "pct_copy_bw"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """`minipaged bench --quick` in a fresh process (as a user runs it: the CLI
    itself must switch the Triton interpreter on)."""
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "minipaged.benchmark.cli", "--quick", "--out", str(out),
                           "--no-progress", "--no-plots"],
                          capture_output=True, text=True, env=env, timeout=600, cwd=str(REPO))
    return proc, out, time.perf_counter() - t0


def test_quick_mode_runs_and_prints_tables(quick_run):
    proc, out, seconds = quick_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "Cross-check against the torch oracle" in text
    assert "== Prefill" in text and "== Decode" in text
    # CPU: no copy-bandwidth figure, no "% copy BW" column (the cases fit in the CPU caches)
    assert "device copy bandwidth" not in text and "% copy BW" not in text
    assert "sdpa-flash" not in text and "sdpa-cpu*" in text
    assert "exact causal FLOPs" in text and "unmasked" not in text
    assert "compared with the torch oracle: triton (prefill, decode)" in text or "triton" not in text
    assert seconds < 240  # the brief asks < 2 minutes; leave slack for a loaded CI box


def test_quick_mode_json_schema(quick_run):
    proc, out, _ = quick_run
    data = json.loads((out / "results.json").read_text())
    assert data["schema"] == runner.SCHEMA and data["complete"] is True
    for key in ("device_name", "sm_count", "torch", "triton", "cuda", "git_commit", "date_utc"):
        assert key in data["env"]
    assert data["config"]["quick"] is True and data["config"]["dtype"] == "float32"
    rows = data["rows"]
    assert rows and all(_ROW_KEYS <= set(r) for r in rows)
    ok = [r for r in rows if r["status"] == "ok"]
    for r in ok:
        assert r["p20_ms"] <= r["median_ms"] <= r["p80_ms"] and r["min_ms"] <= r["median_ms"]
        assert r["reps"] >= 1
    torch_rows = [r for r in ok if r["backend"] == "torch"]
    assert {r["op"] for r in torch_rows} == {"prefill", "decode"}
    assert len(torch_rows) == len(cs.quick_prefill_cases()) + len(cs.quick_decode_cases())
    for r in torch_rows:
        if r["op"] == "prefill":
            assert r["tflops"] > 0 and r["flops"] == cs.PrefillCase(**r["shape"]).flops
        else:
            assert r["tbps"] > 0 and r["bytes"] == flops.decode_bytes(
                r["shape"]["num_q_heads"], r["shape"]["num_kv_heads"], r["shape"]["head_dim"],
                r["shape"]["context_lens"], 4)
    # the CPU SDPA anchor gives every row a ratio; no %-of-copy on CPU
    assert any(r["backend"] == anc.CPU_SDPA and r["status"] == "ok" for r in rows)
    assert all(r["vs_best_anchor"] is not None for r in ok if r["op"] in ("prefill", "decode"))
    assert data["copy_bandwidth_tbps"] is None and all(r["pct_copy_bw"] is None for r in rows)
    assert not any(r["backend"] == anc.COPY_ANCHOR for r in rows)
    # Triton rows ran in the interpreter, unless triton is not installed at all
    if data["backends"]["triton"]["available"] or data["env"]["triton"]:
        tri = [r for r in rows if r["backend"] == "triton"]
        assert tri and all(r["status"] == "ok" for r in tri), tri
        assert data["env"]["triton_interpret"] is True
    xc = data["crosscheck"]
    assert xc and all(r["ok"] for r in xc), xc
    assert any(r["backend"] == anc.CPU_SDPA and r.get("kind") == "anchor" for r in xc)
    md = (out / "results.md").read_text()
    assert data["env"]["git_commit"] in md and "| case | backend |" in md


def test_bench_scripts_help():
    for script in ("bench_prefill.py", "bench_decode.py"):
        proc = subprocess.run([sys.executable, str(REPO / "bench" / script), "--help"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "--backends" in proc.stdout, proc.stderr


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_time_fn_cuda_events_cold_l2():
    x = torch.randn(4096, 4096, device="cuda")
    t = timing.time_fn(lambda: x @ x, device="cuda", reps=20, warmup=2, max_time_s=1.0)
    assert t.clock == "cuda-events" and t.cold_l2 and t.reps == 20
    assert 0 < t.min_ms <= t.median_ms
    env = timing.environment("cuda")
    assert env["sm_count"] > 0 and env["l2_cache_bytes"] > 0


@pytest.mark.gpu
def test_quick_bench_on_gpu(tmp_path):
    """The GPU branches of the runner on small shapes: CUDA events, SDPA anchors,
    copy bandwidth, every available backend (no FlexAttention: its compile is slow)."""
    lines = []
    cfg = runner.BenchConfig(quick=True, out=str(tmp_path), anchors=["sdpa-flash", "sdpa-cudnn", "copy"],
                             reps=10, max_time_s=0.05, plots=False, progress=False, log=lines.append)
    result = runner.run_bench(cfg)
    assert result["complete"] and result["env"]["sm_count"] > 0
    assert result["config"]["dtype"] == "bfloat16"
    rows = result["rows"]
    assert all(r["clock"] in ("cuda-events", "cuda-graph") for r in rows if r["status"] == "ok")
    # decode kernels are timed as graph replays (the torch oracle syncs, so it stays eager)
    for r in rows:
        if r["status"] == "ok" and r["op"] == "decode" and r["backend"] in ("triton", "cuda", "sdpa-flash"):
            assert r["clock"] == "cuda-graph", r
        if r["status"] == "ok" and r["op"] == "prefill":
            assert r["clock"] == "cuda-events", r
    for r in rows:
        if r["kind"] == "backend":
            assert r["status"] in ("ok", "skipped"), r
    assert any(r["backend"] == "sdpa-flash" and r["status"] == "ok" for r in rows)
    assert result["copy_bandwidth_tbps"] > 0.5  # any datacenter GPU copies faster than this
    assert all(r["ok"] for r in result["crosscheck"]), result["crosscheck"]
    assert (tmp_path / "results.json").exists()


def test_run_goes_on_when_the_crosscheck_itself_breaks(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("oracle import failed")

    monkeypatch.setattr(runner, "crosscheck", broken)
    # run_bench switches the Triton interpreter on for CPU runs: keep that out of other tests
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    lines = []
    cfg = runner.BenchConfig(op="prefill", backends=["torch"], anchors=[], quick=True, out=str(tmp_path),
                             reps=2, max_time_s=0, plots=False, progress=False, log=lines.append)
    result = runner.run_bench(cfg)
    assert result["complete"] and runner.results_exit_code(result) == 1
    assert "cross-check aborted: RuntimeError: oracle import failed" in result["notes"]
    assert [r["status"] for r in result["rows"]] == ["ok"] * len(cs.quick_prefill_cases())
    assert any("ERROR: cross-check aborted" in line for line in lines)
