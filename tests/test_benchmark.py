"""The benchmark harness: FLOP/byte counts, the timing function, the inputs the
grids build, the anchors computing the same attention as the oracle, and the
CPU quick mode end to end (tables, JSON schema, error rows)."""

from __future__ import annotations

import dataclasses
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
from minipaged.api import MAX_BLOCK_SIZE
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


def test_paged_flops_and_bytes_by_hand():
    """The standard paged cases' counts, computed here from the definitions."""
    hq, hkv, d, es = 16, 8, 128, 2
    chunked, long_chunk, spec, spec1, mixed = cs.standard_paged_cases()
    # 8 x 512 new over 4096 cached: row i sees 4096 + i + 1 keys
    pairs = 512 * 4096 + 512 * 513 // 2
    assert pairs == 2228480
    assert chunked.flops == 4 * hq * d * 8 * pairs
    assert chunked.bytes(es) == 2 * hkv * d * es * 8 * 4608 + 2 * hq * d * es * 8 * 512 == 184549376
    assert long_chunk.flops == 4 * hq * d * (2048 * 30720 + 2048 * 2049 // 2)
    # 4 speculative tokens over a 4096 context: 4093 + 4094 + 4095 + 4096 pairs
    assert spec.flops == 4 * hq * d * 32 * (4093 + 4094 + 4095 + 4096)
    assert spec.bytes(es) == 2 * hkv * d * es * 32 * 4096 + 2 * hq * d * es * 32 * 4
    assert spec1.flops == 4 * hq * d * (32765 + 32766 + 32767 + 32768)
    assert spec1.bytes(es) == 2 * hkv * d * es * 32768 + 2 * hq * d * es * 4
    # one 2k chunk over 2k cached + 63 decodes, each decode row sees its whole context
    assert mixed.flops == 4 * hq * d * (2048 * 2048 + 2048 * 2049 // 2 + 63 * 4096)
    assert mixed.bytes(es) == 2 * hkv * d * es * 64 * 4096 + 2 * hq * d * es * (2048 + 63)
    assert (chunked.decode_like, spec.decode_like, spec1.decode_like, mixed.decode_like) == (False, True, True, False)
    assert mixed.chunk_seqs == [0] and mixed.decode_seqs == list(range(1, 64))
    assert [c.label for c in cs.standard_paged_cases()] == [
        "chunked B=8 q=512 L=4608", "chunked B=1 q=2048 L=32768", "spec B=32 q=4 L=4096",
        "spec B=1 q=4 L=32768", "mixed q=2048 L=4096 + 63 decodes L=4096"]


def test_paged_flops_match_the_mask_on_ragged_sequences():
    q_lens, ctx = (5, 1, 0, 20, 3), (40, 17, 3, 20, 2)  # the last: more queries than keys
    brute = sum(_brute_pairs(nq, nk, True) for nq, nk in zip(q_lens, ctx))
    assert flops.paged_flops(3, 64, q_lens, ctx) == 4 * 3 * 64 * brute
    assert flops.paged_flops(3, 64, q_lens, ctx, causal=False) == 4 * 3 * 64 * sum(a * b for a, b in zip(q_lens, ctx))
    assert flops.paged_bytes(4, 2, 64, q_lens, ctx, 4) == 2 * 2 * 64 * 4 * sum(ctx) + 2 * 4 * 64 * 4 * sum(q_lens)
    with pytest.raises(ValueError):
        flops.paged_bytes(4, 2, 64, (1, 2), (3,), 2)
    with pytest.raises(ValueError):
        cs.PagedCase("x", (1, 2), (3,), 4, 2, 64)


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
    assert [(c.batch, c.context_len) for c in dec[:6]] == [(1, 4096), (1, 32768), (8, 4096), (32, 4096),
                                                           (64, 8192), (256, 1024)]
    assert all(c.uniform for c in dec[:6]) and not any(c.uniform for c in dec[6:])
    # the uneven batches: one 32k sequence last among 1k ones; 64 lengths spread over 512-16384
    assert dec[6].lens == (1024,) * 63 + (32768,) and dec[6].context_len == 32768
    assert dec[7].batch == 64 and 512 <= min(dec[7].lens) and max(dec[7].lens) <= 16384
    assert dec[7].lens == cs.standard_decode_cases()[7].lens  # the same lengths every run
    assert len({c.label for c in dec}) == len(dec) and all(len(c.label) < 40 for c in dec)
    assert all(c.block_size == 16 and c.num_q_heads == 16 and c.num_kv_heads == 8 for c in dec)


def test_decode_inputs_scatter_pages_and_pad_tables():
    torch.manual_seed(0)
    case = cs.DecodeCase(3, 40, 4, 2, 64, 16, context_lens=(0, 17, 40))
    q, kc, vc, bt, cl = cs.make_decode_inputs(case, torch.float32, "cpu", poison=True)
    assert bt.dtype == torch.int32 and cl.tolist() == [0, 17, 40]
    used = [bt[b, : (n + 15) // 16].tolist() for b, n in enumerate(cl.tolist())]
    flat = sum(used, [])
    assert len(flat) == len(set(flat)) == 0 + 2 + 3 and all(0 <= x < kc.shape[0] for x in flat)
    assert bt[0].tolist() == [-1, -1, -1, -1] and bt[1, 2:].tolist() == [-1, -1] and bt[2, 3].item() == -1
    # the slots no sequence owns are NaN; every real token is finite
    assert torch.isfinite(kc[bt[2, :3].long()].reshape(-1, 2, 64)[:40]).all()
    assert torch.isnan(kc[bt[1, 1].long(), 1:]).all()
    assert torch.isfinite(q).all()


def test_decode_inputs_uniform_case_uses_a_random_permutation():
    torch.manual_seed(0)
    case = cs.DecodeCase(4, 64, 4, 2, 64, 16)
    # as the runner times it: no spare table column (the split heuristics read the capacity)
    _, kc, _, bt, _ = cs.make_decode_inputs(case, torch.float16, "cpu", seed=None, poison=False, spare_columns=0)
    assert bt.shape == (4, 4) and torch.isfinite(kc).all()
    assert sorted(bt.flatten().tolist()) == sorted(set(bt.flatten().tolist()))
    assert bt.flatten().tolist() != sorted(bt.flatten().tolist())  # scattered, not in order
    assert kc.shape == (4 * 4 + 1, 16, 2, 64) and kc.dtype == torch.float16


def test_paged_inputs_and_the_contiguous_copies():
    torch.manual_seed(0)
    case = cs.PagedCase("mixed", (5, 1, 0, 20), (40, 17, 3, 20), 4, 2, 64)
    q, kc, vc, bt, cu, cl = cs.make_paged_inputs(case, torch.float32, "cpu", poison=True)
    assert q.shape == (26, 4, 64) and cu.tolist() == [0, 5, 6, 6, 26] and cl.tolist() == [40, 17, 3, 20]
    assert cu.dtype == bt.dtype == cl.dtype == torch.int32
    k, v, cu_k = cs.gather_varlen_kv(kc, vc, bt, [40, 17, 3, 20])
    assert k.shape == (80, 2, 64) and cu_k.tolist() == [0, 40, 57, 60, 80]
    assert torch.isfinite(k).all() and torch.isfinite(v).all()  # no NaN slot was gathered
    # token t of sequence s lives in page bt[s, t // 16] at offset t % 16
    for s, t in [(0, 0), (0, 39), (1, 16), (2, 2), (3, 19)]:
        page = int(bt[s, t // 16])
        assert torch.equal(k[int(cu_k[s]) + t], kc[page, t % 16])
        assert torch.equal(v[int(cu_k[s]) + t], vc[page, t % 16])


def test_paged_from_dense_round_trips():
    torch.manual_seed(0)
    k, v = torch.randn(2, 3, 37, 8), torch.randn(2, 3, 37, 8)
    kc, vc, bt, cl = cs.paged_from_dense(k, v, block_size=16)
    assert kc.shape == (6, 16, 3, 8) and cl.tolist() == [37, 37]
    k4, v4 = cs.contiguous_kv(kc, vc, bt, 37)
    assert torch.equal(k4, k) and torch.equal(v4, v)


def test_flashinfer_page_layout_by_hand():
    bt = torch.tensor([[7, 2, -1], [-1, -1, -1], [4, 0, 5]], dtype=torch.int32)
    cl = torch.tensor([17, 0, 48], dtype=torch.int32)
    indptr, indices, last = anc.flashinfer_page_layout(bt, cl, 16)
    assert indptr.tolist() == [0, 2, 2, 5]
    assert indices.tolist() == [7, 2, 4, 0, 5]
    assert last.tolist() == [1, 0, 16]
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32


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


def _fp64_chunk_attention(q4, k4, v4, scale):
    """q [B, Hq, Nq, D] against k, v [B, Hkv, Nk, D], bottom-right causal, in fp64, by loops."""
    b, hq, nq, d = q4.shape
    hkv, nk = k4.shape[1], k4.shape[2]
    out = torch.zeros(b, hq, nq, d, dtype=torch.float64)
    for h in range(hq):
        kh, vh = k4[:, h // (hq // hkv)].double(), v4[:, h // (hq // hkv)].double()
        s = torch.einsum("bqd,bkd->bqk", q4[:, h].double(), kh) * scale
        allowed = torch.arange(nk)[None, :] < (nk - nq + torch.arange(nq)[:, None] + 1)
        s = s.masked_fill(~allowed, float("-inf"))
        out[:, h] = torch.softmax(s, dim=-1) @ vh
    return out


def test_cpu_sdpa_paged_anchor_is_bottom_right_causal():
    torch.manual_seed(0)
    q4, k4, v4 = torch.randn(2, 4, 5, 64), torch.randn(2, 2, 23, 64), torch.randn(2, 2, 23, 64)
    prep = anc.prepare_sdpa_paged(anc.CPU_SDPA, q4, k4, v4, scale=0.125)
    with prep.context():
        out = prep.fn()
    torch.testing.assert_close(out.double(), _fp64_chunk_attention(q4, k4, v4, 0.125), atol=1e-5, rtol=1e-5)
    assert "bottom-right" in prep.note
    # the top-left mask SDPA's is_causal means would differ: the test can tell them apart
    top_left = torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=0.125,
                                                                enable_gqa=True)
    assert (top_left - out).abs().max() > 0.1
    with pytest.raises(anc.AnchorSkipped, match="CUDA only"):
        anc.prepare_sdpa_paged("sdpa-flash", q4, k4, v4, scale=0.125)


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


def _paged_row(case, backend, kind, ms, role=None, of=None):
    row = runner._base_row("paged", case, backend, kind)
    row.update(median_ms=ms, role=role, of_backend=of)
    return row


def test_paged_ratios_and_their_targets():
    chunk = cs.PagedCase("chunked", (32,) * 2, (96,) * 2, 4, 2, 64)
    spec = cs.PagedCase("spec", (4,) * 4, (64,) * 4, 4, 2, 64)
    mixed = cs.PagedCase("mixed", (48, 1, 1), (96, 64, 64), 4, 2, 64)
    rows = [_paged_row(chunk, "triton", "backend", 2.0), _paged_row(chunk, "triton dense", "anchor", 1.9, "dense", "triton"),
            _paged_row(chunk, "flashinfer-paged", "anchor", 2.5, "flashinfer"),
            _paged_row(chunk, "sdpa-cpu", "anchor", 1.0, "sdpa"),
            _paged_row(spec, "triton", "backend", 1.2), _paged_row(spec, "triton decode", "anchor", 1.0, "decode", "triton"),
            _paged_row(mixed, "triton", "backend", 3.0),
            _paged_row(mixed, "triton chunk-paged", "anchor", 2.0, "chunk-paged", "triton"),
            _paged_row(mixed, "triton chunk-dense", "anchor", 1.5, "chunk-dense", "triton"),
            _paged_row(mixed, "triton decodes", "anchor", 1.0, "decodes", "triton"),
            _paged_row(mixed, "triton dense", "anchor", 4.0, "dense", "triton"),
            _paged_row(mixed, "cuda", "backend", 1.0)]  # no anchors of its own: no ratios
    runner.finalize_rows(rows, copy_tbps=None)
    c, s_, m, other = rows[0], rows[4], rows[6], rows[-1]
    assert c["speed_vs_dense"] == pytest.approx(0.95) and c["speed_vs_flashinfer"] == pytest.approx(1.25)
    assert c["vs_best_anchor"] == pytest.approx(0.5)  # SDPA and FlashInfer only; the backend's own are not "best"
    assert s_["time_vs_decode"] == pytest.approx(1.2) and s_["speed_vs_dense"] is None
    assert m["time_vs_split"] == pytest.approx(3.0 / (1.5 + 1.0)) and m["speed_vs_dense"] == pytest.approx(4 / 3)
    assert all(other[k] is None for k in ("speed_vs_dense", "time_vs_split", "time_vs_decode"))
    assert report.meets_target("speed_vs_dense", 0.95, "chunked") is True
    assert report.meets_target("time_vs_split", 1.2, "mixed") is False
    assert report.meets_target("speed_vs_dense", 1.3, "mixed") is None  # shown, not judged
    lines = report.paged_targets_lines(rows)
    assert "triton chunked B=2 q=32 L=96: speed vs dense = 0.95 (target >= 0.9: met)" in lines
    assert "triton mixed q=48 L=96 + 2 decodes L=64: time/(chunk+decodes) = 1.20 (target <= 1.1: MISSED)" in lines
    assert not any("speed vs dense" in x and "mixed" in x for x in lines)
    md = report.markdown_table(rows, "paged")
    for header in ("median µs", "speed vs dense >=0.9", "speed vs FlashInfer >=1.0", "time/decode <=1.3",
                   "time/(chunk+decodes) <=1.1"):
        assert header in md
    assert "0.95 ok" in md and "1.20 MISS" in md and "| 1.33 |" in md


def test_same_backend_anchor_rows_record_the_work_they_count():
    """A paged anchor row's shape["part"] is what its FLOPs and bytes count: the spec row's
    plain decode (one query per sequence), not the speculative batch."""
    r = runner._Runner(_cfg(quick=True, reps=1, max_time_s=0), torch.device("cpu"), torch.float32, True)
    rows = []
    for case in cs.quick_paged_cases():
        rows += runner._bench_paged_case(r, case, ["torch"], [anc.SAME_BACKEND], {}, lambda s: None)
    anchors = [x for x in rows if x["kind"] == "anchor"]
    assert {x["role"] for x in anchors} == {"dense", "decode", "chunk-paged", "chunk-dense", "decodes"}
    for x in anchors:
        assert x["status"] == "ok", x
        part = x["shape"]["part"]
        q_lens = part.get("q_lens", [1] * len(part["context_lens"]))  # a DecodeCase: one query each
        h, d = part["num_q_heads"], part["head_dim"]
        assert x["flops"] == flops.paged_flops(h, d, q_lens, part["context_lens"]), x["backend"]
        assert x["bytes"] == flops.paged_bytes(h, part["num_kv_heads"], d, q_lens, part["context_lens"], 4)


# ----------------------------------------------------------------------------- FlashInfer (a fake on CPU)


def _fi_attend(q, k, v, causal, scale):
    """fp64 attention of one request in FlashInfer's terms: q [Nq, Hq, D], k, v [Nk, Hkv, D]."""
    nq, hq, _ = q.shape
    nk, hkv, _ = k.shape
    g = hq // hkv
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(g, 1)) * scale
    if causal:
        allowed = torch.arange(nk)[None, :] < (nk - nq + torch.arange(nq)[:, None] + 1)
        s = s.masked_fill(~allowed[None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v.double().repeat_interleave(g, 1))


class _FakeFlashInfer:
    """The three wrappers with FlashInfer 0.7's signatures (keyword names checked: no
    **kwargs), computing in fp64 from the CSR page layout alone, so a wrong conversion
    of our block tables shows up as a wrong output. `skew` breaks the last-page length."""

    __version__ = "fake"

    def __init__(self, skew=0):
        fake = self

        def pages_to_kv(cache, indptr, indices, last, s, page_size):
            ids = indices[indptr[s]:indptr[s + 1]].long()
            n = 0 if len(ids) == 0 else (len(ids) - 1) * page_size + int(last[s]) + fake.skew
            return cache[ids].reshape(-1, cache.shape[2], cache.shape[3])[:n]

        class Paged:
            def __init__(self, ws, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                         paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                         backend="auto"):
                assert kv_layout == "NHD"
                if use_cuda_graph:
                    assert all(torch.is_tensor(b) for b in (qo_indptr_buf, paged_kv_indptr_buf,
                                                           paged_kv_indices_buf, paged_kv_last_page_len_buf))

            def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                     num_kv_heads, head_dim_qk, page_size, causal=False, sm_scale=None, q_data_type=None,
                     kv_data_type=None):
                self.p = (qo_indptr.cpu(), paged_kv_indptr.cpu(), paged_kv_indices.cpu(),
                          paged_kv_last_page_len.cpu(), page_size, causal, sm_scale)

            def run(self, q, paged_kv_cache, out=None):
                qo, indptr, indices, last, ps, causal, scale = self.p
                kc, vc = paged_kv_cache
                o = torch.cat([_fi_attend(q[qo[s]:qo[s + 1]], pages_to_kv(kc, indptr, indices, last, s, ps),
                                          pages_to_kv(vc, indptr, indices, last, s, ps), causal, scale)
                               for s in range(len(qo) - 1)]).to(q.dtype)
                out.copy_(o)
                return out

        class Ragged:
            def __init__(self, ws, kv_layout="NHD", backend="auto"):
                assert kv_layout == "NHD"

            def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, causal=False,
                     sm_scale=None, q_data_type=None, kv_data_type=None):
                self.p = (qo_indptr.cpu(), kv_indptr.cpu(), causal, sm_scale)

            def run(self, q, k, v, out=None):
                qo, kv, causal, scale = self.p
                o = torch.cat([_fi_attend(q[qo[s]:qo[s + 1]], k[kv[s]:kv[s + 1]], v[kv[s]:kv[s + 1]], causal, scale)
                               for s in range(len(qo) - 1)])
                out.copy_(o.to(q.dtype))
                return out

        class Decode:
            def __init__(self, ws, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                         paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                         paged_kv_last_page_len_buffer=None, backend="auto"):
                fake.decode_tensor_cores.append(use_tensor_cores)

            def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                     pos_encoding_mode="NONE", sm_scale=None, q_data_type=None, kv_data_type=None):
                self.p = (indptr.cpu(), indices.cpu(), last_page_len.cpu(), page_size, sm_scale)

            def run(self, q, paged_kv_cache, out=None, k_scale=None, v_scale=None):
                indptr, indices, last, ps, scale = self.p
                kc, vc = paged_kv_cache
                if kc.dtype == torch.float8_e4m3fn:  # FlashInfer's fp8 decode: one float scale per cache
                    assert isinstance(k_scale, float) and isinstance(v_scale, float)
                    kc, vc = kc.double() * k_scale * fake.scale_error, vc.double() * v_scale
                else:
                    assert k_scale is None and v_scale is None
                o = torch.cat([_fi_attend(q[s:s + 1], pages_to_kv(kc, indptr, indices, last, s, ps),
                                          pages_to_kv(vc, indptr, indices, last, s, ps), False, scale)
                               for s in range(q.shape[0])])
                out.copy_(o.to(q.dtype))
                return out

        self.skew = skew
        self.scale_error = 1.0  # != 1: the fp8 decode misapplies k_scale
        self.decode_tensor_cores = []
        self.BatchPrefillWithPagedKVCacheWrapper = Paged
        self.BatchPrefillWithRaggedKVCacheWrapper = Ragged
        self.BatchDecodeWithPagedKVCacheWrapper = Decode


@pytest.fixture
def fake_flashinfer(monkeypatch):
    fake = _FakeFlashInfer()
    monkeypatch.setattr(anc, "_fi_state", (fake, ""))
    monkeypatch.setattr(anc, "flashinfer_available", lambda device: (True, ""))
    monkeypatch.setattr(anc, "_fi_workspace", lambda device: torch.zeros(16, dtype=torch.uint8))
    return fake


def test_flashinfer_anchors_on_our_pages_compute_our_attention(fake_flashinfer):
    """Block tables -> FlashInfer's indptr/indices/last_page_len, and the wrappers' calls,
    judged by the runner's comparison with the torch backend on every grid."""
    r = runner._Runner(_cfg(quick=True, seed=3), torch.device("cpu"), torch.float32, True)
    emit = lambda s: None  # noqa: E731
    paged_rows = []
    for case in cs.quick_paged_cases():
        paged_rows += list(runner._bench_paged_case(r, case, ["torch"], [anc.FI_PAGED], {}, emit))
    fi = [x for x in paged_rows if x["backend"] == anc.FI_PAGED]
    assert len(fi) == 3 and all(x["status"] == "ok" for x in fi), fi
    assert all("agrees with torch" in x["note"] and "the same pages" in x["note"] for x in fi)
    pre = list(runner._bench_prefill_case(r, cs.PrefillCase(2, 37, 37, 4, 2, 64), ["torch"],
                                          [anc.FI_RAGGED, anc.FI_PAGED], {}, emit))
    dec = list(runner._bench_decode_case(r, cs.DecodeCase(3, 50, 4, 2, 64, 16, context_lens=(1, 17, 50)),
                                         ["torch"], [anc.FI_DECODE, anc.FI_DECODE_TC], {}, emit))
    for rows, names in ((pre, [anc.FI_RAGGED, anc.FI_PAGED]), (dec, [anc.FI_DECODE, anc.FI_DECODE_TC])):
        got = {x["backend"]: x for x in rows if x["kind"] == "anchor"}
        assert sorted(got) == sorted(names)
        assert all(x["status"] == "ok" and "agrees with torch" in x["note"] for x in got.values()), got
    assert fake_flashinfer.decode_tensor_cores == [False, True]
    runner.finalize_rows(paged_rows, None)
    chunk_row = next(x for x in paged_rows if x["backend"] == "torch" and x["shape"]["kind"] == "chunked")
    assert chunk_row["speed_vs_flashinfer"] is not None


def test_a_wrong_flashinfer_layout_is_an_error_row(fake_flashinfer):
    fake_flashinfer.skew = -1  # every sequence loses its last key
    r = runner._Runner(_cfg(quick=True), torch.device("cpu"), torch.float32, True)
    case = cs.PagedCase("spec", (4,) * 2, (40,) * 2, 4, 2, 64)
    rows = list(runner._bench_paged_case(r, case, ["torch"], [anc.FI_PAGED], {}, lambda s: None))
    fi = [x for x in rows if x["backend"] == anc.FI_PAGED]
    assert fi[0]["status"] == "error" and "differs from torch" in fi[0]["error"], fi


def test_flashinfer_not_importable_is_skipped_and_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises ImportError
    monkeypatch.setattr(anc, "_fi_state", None)
    gpu = torch.device("cuda")  # a device object only: nothing runs on it
    ok, why = anc.flashinfer_available(gpu)
    assert not ok and "not importable" in why
    cfg = _cfg()
    ops = list(runner.OPS_ALL)
    note = runner.flashinfer_note(cfg, ops, gpu)
    assert all(n in note for n in anc.FLASHINFER_ANCHORS if n not in anc.FP8_ANCHORS) and "env.sh" in note
    # the fp8 decode anchor belongs to --kv-cache-dtype fp8 runs only
    assert anc.FI_DECODE_FP8 not in note
    assert anc.FI_DECODE_FP8 in runner.flashinfer_note(_cfg(kv_cache_dtype="fp8"), ["decode"], gpu)
    assert runner._anchor_names(cfg, "paged", gpu) == [anc.SAME_BACKEND, "sdpa-flash", "sdpa-cudnn"]
    assert anc.FI_RAGGED not in runner._anchor_names(cfg, "prefill", gpu)
    assert runner.flashinfer_note(_cfg(anchors=["sdpa-flash"]), ops, gpu) is None  # none asked for
    assert runner.flashinfer_note(cfg, ["decode"], gpu).count("flashinfer-") == 2
    with pytest.raises(anc.AnchorSkipped, match="not importable"):
        anc._flashinfer(gpu)
    assert "CUDA only" in runner.flashinfer_note(cfg, ops, torch.device("cpu"))


def test_quick_grid_leaves_flashinfer_out_unless_named(monkeypatch):
    """Importable FlashInfer on a GPU: the standard grid times it; the quick grid (D=64, whose
    kernels the bundle does not prebuild) only when --anchors names it."""
    monkeypatch.setattr(anc, "flashinfer_available", lambda device: (True, ""))
    gpu = torch.device("cuda")
    assert anc.FI_PAGED in runner._anchor_names(_cfg(), "paged", gpu)
    assert anc.FI_PAGED not in runner._anchor_names(_cfg(), "paged", gpu, quick=True)
    assert runner._anchor_names(_cfg(anchors=[anc.FI_PAGED]), "paged", gpu, quick=True) == [anc.FI_PAGED]
    assert runner.flashinfer_note(_cfg(), list(runner.OPS_ALL), gpu) is None
    assert "quick grid" in runner.flashinfer_note(_cfg(), list(runner.OPS_ALL), gpu, quick=True)
    assert runner.flashinfer_note(_cfg(anchors=[anc.FI_DECODE]), ["decode"], gpu, quick=True) is None


def test_json_is_strict_even_with_nan(tmp_path):
    result = dict(schema=runner.SCHEMA, env=timing.environment("cpu"),
                  config=dict(dtype="float32", quick=True), backends={},
                  crosscheck=[dict(op="prefill", case="c", backend="b", max_abs_err=float("nan"),
                                   tol=1.0, ok=False, error=None, note="NaN in the output")],
                  rows=[], copy_bandwidth_tbps=None, notes=[], complete=True)
    from minipaged.benchmark import outputs

    paths = outputs.write_all(result, tmp_path, plots=False)
    data = json.loads(paths[0].read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    assert data["crosscheck"][0]["max_abs_err"] is None
    assert "FAIL (NaN in the output)" in paths[1].read_text()


def test_plots_rerender_from_json(quick_run, tmp_path):
    pytest.importorskip("matplotlib")
    from minipaged.benchmark import outputs

    _, out, _ = quick_run
    assert outputs.main([str(out), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "prefill.png").stat().st_size > 1000 and (tmp_path / "decode.png").exists()
    data = json.loads((tmp_path / "results.json").read_text())
    assert not any(n.startswith("plots skipped") for n in data["notes"])
    assert "## Decode" in (tmp_path / "results.md").read_text()


def test_report_and_plots_do_not_import_each_other():
    # outputs.py is the one module that writes both; a cycle would come back through it
    import ast
    import inspect

    from minipaged.benchmark import plots

    for mod, other in ((report, "plots"), (plots, "report")):
        tree = ast.parse(inspect.getsource(mod))
        names = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        assert other not in names and f"minipaged.benchmark.{other}" not in names, (mod.__name__, names)


def test_git_commit_honours_the_environment(monkeypatch):
    monkeypatch.setenv("MINIPAGED_GIT_COMMIT", "0123abc")
    assert timing.git_commit() == "0123abc"
    assert timing.environment("cpu")["git_commit"] == "0123abc"


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
    # two timed calls per row instead of the quick default's five: the rows, the cross-check and
    # the files are the same, and CI's two cores spend half a minute less here
    proc = subprocess.run([sys.executable, "-m", "minipaged.benchmark.cli", "--quick", "--out", str(out),
                           "--no-progress", "--no-plots", "--reps", "2"],
                          capture_output=True, text=True, env=env, timeout=600, cwd=str(REPO))
    return proc, out, time.perf_counter() - t0


def test_quick_mode_runs_and_prints_tables(quick_run):
    proc, out, seconds = quick_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "Cross-check against the torch oracle" in text
    assert "== Prefill" in text and "== Decode" in text and "== Paged attention" in text
    # CPU: no copy-bandwidth figure, no "% copy BW" column (the cases fit in the CPU caches)
    assert "device copy bandwidth" not in text and "% copy BW" not in text
    assert "sdpa-flash" not in text and "sdpa-cpu*" in text
    assert "exact causal FLOPs" in text and "unmasked" not in text
    assert "compared with the torch oracle: triton (prefill, decode, paged)" in text or "triton" not in text
    assert "FlashInfer anchors not timed" in text and "CUDA only" in text
    assert seconds < 240  # the brief asks < 2 minutes; leave slack for a loaded CI box


def test_quick_mode_json_schema(quick_run):
    proc, out, _ = quick_run
    data = json.loads((out / "results.json").read_text())
    assert data["schema"] == runner.SCHEMA and data["complete"] is True
    for key in ("device_name", "sm_count", "torch", "triton", "cuda", "git_commit", "date_utc"):
        assert key in data["env"]
    assert data["config"]["quick"] is True and data["config"]["dtype"] == "float32"
    assert data["config"]["page_size"] == 16
    rows = data["rows"]
    assert rows and all(_ROW_KEYS <= set(r) for r in rows)
    ok = [r for r in rows if r["status"] == "ok"]
    for r in ok:
        assert r["p20_ms"] <= r["median_ms"] <= r["p80_ms"] and r["min_ms"] <= r["median_ms"]
        assert r["reps"] >= 1
    torch_rows = [r for r in ok if r["backend"] == "torch"]
    assert {r["op"] for r in torch_rows} == {"prefill", "decode", "paged"}
    assert len(torch_rows) == len(cs.quick_prefill_cases()) + len(cs.quick_decode_cases()) + len(cs.quick_paged_cases())
    for r in torch_rows:
        if r["op"] == "prefill":
            assert r["tflops"] > 0 and r["flops"] == cs.PrefillCase(**r["shape"]).flops
        elif r["op"] == "paged":
            case = next(c for c in cs.quick_paged_cases() if c.label == r["case"])
            assert r["flops"] == case.flops and r["bytes"] == case.bytes(4)
            assert r["tflops"] > 0 and r["tbps"] > 0 and 0 < r["median_ms"] < 1000
        else:
            assert r["tbps"] > 0 and r["bytes"] == flops.decode_bytes(
                r["shape"]["num_q_heads"], r["shape"]["num_kv_heads"], r["shape"]["head_dim"],
                r["shape"]["context_lens"], 4)
    # the CPU SDPA anchor gives every row a ratio; no %-of-copy on CPU
    assert any(r["backend"] == anc.CPU_SDPA and r["status"] == "ok" for r in rows)
    assert all(r["vs_best_anchor"] is not None for r in ok if r["op"] in ("prefill", "decode"))
    assert data["copy_bandwidth_tbps"] is None and all(r["pct_copy_bw"] is None for r in rows)
    # every paged backend row has the ratio its case kind is judged by, from anchors of this run
    paged = [r for r in ok if r["op"] == "paged" and r["kind"] == "backend"]
    assert {r["backend"] for r in paged} >= {"torch"}
    for r in paged:
        key = {"chunked": "speed_vs_dense", "spec": "time_vs_decode", "mixed": "time_vs_split"}[r["shape"]["kind"]]
        assert r[key] is not None and 0 < r[key] < 1e4, r
    paged_anchors = [r for r in rows if r["op"] == "paged" and r["kind"] == "anchor" and r["status"] == "ok"]
    assert paged_anchors and all("agrees with torch" in r["note"] for r in paged_anchors), paged_anchors
    assert any("FlashInfer anchors not timed" in n for n in data["notes"])
    assert not any(r["backend"].startswith("flashinfer") for r in rows)
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
    assert "## Paged attention" in md and "speed vs dense >=0.9" in md and "time/(chunk+decodes) <=1.1" in md
    assert "Targets measured" in md


def test_op_paged_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    cfg = runner.BenchConfig(op="paged", backends=["torch"], anchors=[anc.SAME_BACKEND], quick=True,
                             out=str(tmp_path), reps=1, max_time_s=0, crosscheck=False, plots=False,
                             progress=False, log=lambda s: None)
    result = runner.run_bench(cfg)
    assert {r["op"] for r in result["rows"]} == {"paged"}
    assert [r["case"] for r in result["rows"] if r["kind"] == "backend"] == [c.label for c in cs.quick_paged_cases()]
    roles = {r["role"] for r in result["rows"] if r["kind"] == "anchor"}
    assert roles == {"dense", "decode", "chunk-paged", "chunk-dense", "decodes"}
    assert all(r["status"] == "ok" for r in result["rows"]), result["rows"]
    assert not any("FlashInfer" in n for n in result["notes"])  # none was asked for


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU: FlashInfer anchors do not exist there")
@pytest.mark.parametrize("argv, words", [
    (["--anchors", "flashinfer-paged"], ["flashinfer-paged", "CUDA only"]),
    (["--anchors", "flashinfer-decode-tc"], ["flashinfer-decode-tc", "CUDA only"]),
    (["--op", "prefill", "--anchors", "same-backend"], ["same-backend", "paged"]),
    (["--op", "nope"], ["--op"]),
])
def test_bench_refuses_anchors_that_cannot_run(argv, words, capsys, tmp_path, monkeypatch):
    from minipaged import cli

    def not_run(*a, **k):
        raise AssertionError("the benchmark ran before the arguments were checked")

    monkeypatch.setattr(runner, "_run", not_run)
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    try:
        rc = cli.main(["bench", "--out", str(tmp_path), *argv])
    except SystemExit as e:  # argparse's own refusal of a --op choice
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    line = [x for x in err.splitlines() if x.startswith("error") or "error:" in x][-1]
    assert all(w in line for w in words), line


def test_bench_scripts_help():
    # each script's --help as its own __main__, in one interpreter (one torch import, not three)
    code = (
        "import runpy, sys\n"
        "for script in sys.argv[1:]:\n"
        "    sys.argv = [script, '--help']\n"
        "    try:\n"
        "        runpy.run_path(script, run_name='__main__')\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), (script, e.code)\n"
        "    print('=== done', script, flush=True)\n"
    )
    scripts = [str(REPO / "bench" / s) for s in ("bench_prefill.py", "bench_decode.py", "bench_paged.py")]
    proc = subprocess.run([sys.executable, "-c", code, *scripts], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = proc.stdout.split("=== done")
    assert len(parts) == 4 and all("--backends" in part for part in parts[:3]), proc.stdout[-3000:]


def test_decode_time_table_script(tmp_path, capsys):
    # scripts/decode_time_table.py: rows of decode_selftest `time` logs (the printf layout, long
    # case names included) to one table of medians over the logs and ratios to each case's first
    # config; a row whose check failed is marked and makes the exit status 1.
    import importlib.util

    spec = importlib.util.spec_from_file_location("decode_time_table", REPO / "scripts" / "decode_time_table.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclass looks its module up there)
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    def row(case, config, splits, ctas, med, check):  # decode_selftest's printf of a timed row
        return "%-12s %-22s %6d %6d %9.2f %9.2f %9.2f %8.3f  %s\n" % (case, config, splits, ctas, med, med - 0.1,
                                                                      med + 0.1, 1.0, check)

    head = "graph of one empty kernel (the floor of every row): median 3.71 us\ncase  config  splits\n"
    rows = [
        [("B=1 L=4k", "tiling 0", 32, 256, 13.0, "ok"), ("B=1 L=4k", "tiling 0 cluster-push", 16, 128, 11.7, "ok"),
         ("B=64 L=32k 1long fp8", "tiling 0 no-worklist", 4, 2048, 200.0, "ok"),
         ("B=64 L=32k 1long fp8", "tiling 0 worklist-mean", 4, 1560, 150.0, "ok"),
         ("B=64 L=32k quarter fp8", "tiling 0 no-worklist", 4, 2048, 40.0, "ok"),
         ("B=64 L=32k quarter fp8", "tiling 0 worklist", 4, 2048, 41.0, "ok")],
        [("B=1 L=4k", "tiling 0", 32, 256, 13.4, "ok"), ("B=1 L=4k", "tiling 0 cluster-push", 16, 128, 11.9, "ok"),
         ("B=64 L=32k 1long fp8", "tiling 0 no-worklist", 4, 2048, 202.0, "ok"),
         ("B=64 L=32k 1long fp8", "tiling 0 worklist-mean", 4, 1560, 151.0, "timing only: no merge")],
    ]
    paths = []
    for i, log in enumerate(rows):
        path = tmp_path / f"time{i}.log"
        path.write_text(head + "".join(row(*r) for r in log))
        paths.append(str(path))
    assert mod.main(paths) == 0
    out = capsys.readouterr().out
    # every row has the header's columns: 8 cells
    assert all(x.count("|") == 9 for x in out.splitlines() if x.startswith("|")), out
    line = next(x for x in out.splitlines() if "cluster-push" in x)
    assert line == f"| B=1 L=4k | tiling 0 cluster-push | 16 | 128 | 11.70 | 11.90 | 11.80 | {11.8 / 13.2:.3f} |", line
    line = next(x for x in out.splitlines() if "worklist-mean" in x)
    assert line.startswith("| B=64 L=32k 1long fp8 | tiling 0 worklist-mean | 4 | 1560 | 150.00 | 151.00 | 150.50 |")
    assert line.endswith(f"| {150.5 / 201.0:.3f} |"), line
    # (the wide equal-length rows: one log holds them)
    line = next(x for x in out.splitlines() if "quarter" in x and "| tiling 0 worklist |" in x)
    want = f"| B=64 L=32k quarter fp8 | tiling 0 worklist | 4 | 2048 | 41.00 | - | 41.00 | {41 / 40:.3f} |"
    assert line == want, line
    # a config that disagreed with the baseline
    bad = tmp_path / "bad.log"
    bad.write_text(row("B=1 L=4k", "tiling 0", 32, 256, 13.0, "ok")
                   + row("B=1 L=4k", "tiling 0 cluster", 16, 128, 11.0, "MISMATCH vs tiling 0"))
    assert mod.main([str(bad)]) == 1
    assert "tiling 0 cluster **check failed**" in capsys.readouterr().out
    # a config timed twice in one log (e.g. two variants with one label) keeps one cell per row
    twice = tmp_path / "twice.log"
    twice.write_text(row("B=1 L=4k", "tiling 0", 32, 256, 13.0, "ok")
                     + row("B=1 L=4k", "tiling 0", 32, 256, 12.0, "ok"))
    assert mod.main([str(twice)]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| B=1")]
    assert [x.split(" | ")[4] for x in lines] == ["13.00", "12.00"], lines
    empty = tmp_path / "empty.log"
    empty.write_text(head)
    assert mod.main([str(empty)]) == 2
    assert mod.main([str(tmp_path / "missing.log")]) == 2
    assert "error:" in capsys.readouterr().err


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


@pytest.mark.gpu
def test_quick_paged_bench_on_gpu(tmp_path):
    """The paged rows' GPU branches: graph replays for the decode-like case, anchors compared
    with a backend's output, every target ratio measured where its anchors ran."""
    cfg = runner.BenchConfig(op="paged", quick=True, out=str(tmp_path),
                             anchors=[anc.SAME_BACKEND, "sdpa-flash", "sdpa-cudnn"], reps=10, max_time_s=0.05,
                             plots=False, progress=False, log=lambda s: None)
    result = runner.run_bench(cfg)
    rows = result["rows"]
    assert all(r["ok"] for r in result["crosscheck"]), result["crosscheck"]
    backend_rows = [r for r in rows if r["kind"] == "backend"]
    assert {r["backend"] for r in backend_rows if r["status"] == "ok"} >= {"triton"}
    assert not any(r["backend"] == "torch" for r in backend_rows)  # oracle rows: CPU quick grid only
    for r in rows:
        if r["kind"] == "backend":
            assert r["status"] in ("ok", "skipped"), r
        elif r["status"] == "ok":
            assert "agrees with" in r["note"], r
        if r["status"] == "ok" and r["shape"]["kind"] == "spec" and r["backend"] in ("triton", "cuda"):
            assert r["clock"] == "cuda-graph", r
    for r in backend_rows:
        if r["status"] == "ok":
            key = {"chunked": "speed_vs_dense", "spec": "time_vs_decode", "mixed": "time_vs_split"}[r["shape"]["kind"]]
            assert r[key] is not None, r


@pytest.mark.gpu
def test_flashinfer_anchors_on_gpu():
    """Real FlashInfer (skipped unless importable: source .anchors/flashinfer/env.sh), bf16
    D=128 as its bundle prebuilds: every wrapper runs on our data and agrees with a backend."""
    if not anc.flashinfer_available(torch.device("cuda"))[0]:
        pytest.skip(anc.flashinfer_available(torch.device("cuda"))[1])
    r = runner._Runner(_cfg(), torch.device("cuda"), torch.bfloat16, False)
    emit = lambda s: None  # noqa: E731
    h = cs.QWEN3_HEADS
    backends = runner.select_backends(_cfg(), torch.device("cuda"))[0]
    rows = []
    for case in (cs.PagedCase("chunked", (300,) * 2, (1000,) * 2, **h), cs.PagedCase("spec", (4,) * 8, (1000,) * 8, **h),
                 cs.PagedCase("mixed", (200, 1, 1, 1), (500, 17, 1000, 64), **h)):
        rows += list(runner._bench_paged_case(r, case, backends, [anc.FI_PAGED], {}, emit))
    rows += list(runner._bench_prefill_case(r, cs.PrefillCase(2, 1000, 1000, **h), backends,
                                            [anc.FI_RAGGED, anc.FI_PAGED], {}, emit))
    rows += list(runner._bench_decode_case(r, cs.DecodeCase(4, 1000, **h, context_lens=(1, 17, 1000, 333)),
                                           backends, [anc.FI_DECODE, anc.FI_DECODE_TC], {}, emit))
    fi = [x for x in rows if x["backend"].startswith("flashinfer")]
    assert len(fi) == 3 + 2 + 2
    assert all(x["status"] == "ok" and "agrees with" in x["note"] for x in fi), fi


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


# ----------------------------------------------------------------------------- FP8 KV caches (--kv-cache-dtype fp8)

FP8 = torch.float8_e4m3fn


def test_fp8_bytes_count_one_byte_per_cached_element():
    hq, hkv, d = 16, 8, 128
    # the standard grid's B=64 L=8192: 1 GiB of fp8 K+V, q and o in bf16
    case = cs.DecodeCase(64, 8192, hq, hkv, d)
    got = flops.decode_bytes(hq, hkv, d, case.lens, 2, kv_elem_bytes=1)
    assert got == 2 * 8 * 128 * 64 * 8192 + 2 * 64 * 16 * 128 * 2 == 1074266112
    # against the 16-bit count: the K/V part halves, q and o stay
    assert case.bytes(2) - got == 2 * 8 * 128 * 64 * 8192  # K and V: one byte saved per element
    assert flops.decode_bytes(hq, hkv, d, case.lens, 2, kv_elem_bytes=None) == case.bytes(2)
    q_lens, ctx = (5, 1, 0, 20), (40, 17, 3, 20)
    assert flops.paged_bytes(hq, hkv, d, q_lens, ctx, 2, kv_elem_bytes=1) == \
        2 * hkv * d * 1 * sum(ctx) + 2 * hq * d * 2 * sum(q_lens)


def test_fp8_cache_quantisation_follows_the_write_rule(monkeypatch):
    """cases.quantize_fp8 stores exactly what the oracle's write_kv_cache stores (per-head
    division, clamp at 448, round to nearest even), chunked or not; amax scales ignore NaN."""
    g = torch.Generator().manual_seed(0)
    mag = torch.tensor([0.01, 1.0, 300.0]).view(1, 1, 3, 1)  # three KV heads, far apart in size
    cache = (torch.randn(5, 4, 3, 8, generator=g) * mag).to(torch.bfloat16)
    cache[1, 2] = float("nan")  # a poisoned slot
    ks = cs.kv_amax_scales(cache)
    finite = cache.float().nan_to_num(0.0).abs()
    assert torch.equal(ks, finite.amax(dim=(0, 1, 3)) / 448.0) and ks.dtype == torch.float32
    q8 = cs.quantize_fp8(cache, ks)
    assert q8.dtype == FP8 and q8.shape == cache.shape
    want = reference.quantize_fp8(cache.reshape(-1, 3, 8), ks).reshape(cache.shape)
    assert torch.equal(q8.view(torch.uint8), want.view(torch.uint8))
    assert torch.isnan(q8[1, 2].float()).all() and not torch.isnan(q8[0].float()).any()
    # each head's largest |value| lands on 448; the rest within half an fp8 step (2^-4 relative)
    deq = cs.dequantize_fp8(q8, ks)
    assert torch.equal(q8.float().nan_to_num(0.0).abs().amax(dim=(0, 1, 3)), torch.full((3,), 448.0))
    ok = ~torch.isnan(cache.float()) & (cache.float().abs() > 2.0 ** -6 * 448 * ks.view(1, 1, 3, 1))
    rel = ((deq - cache.float()).abs() / cache.float().abs())[ok]
    assert rel.max() <= 2.0 ** -4 + 1e-6
    monkeypatch.setattr(cs, "_QUANT_CHUNK_BLOCKS", 2)  # the chunked path writes the same bytes
    assert torch.equal(cs.quantize_fp8(cache, ks).view(torch.uint8), q8.view(torch.uint8))
    # spread=True: head scales 1x .. 4x apart on top of the amax (the cross-check's caches)
    k8, v8, ks2, vs2 = cs.fp8_caches(cache, cache, spread=True)
    assert torch.allclose(ks2 / ks, torch.tensor([1.0, 2.5, 4.0])) and torch.allclose(vs2 / ks, torch.tensor([4.0, 2.5, 1.0]))


def _fake_backend(name, wrong_head_scale: bool):
    """A registry Backend on CPU running the torch oracle, optionally applying KV head 0's scales
    to every head (the bug a per-head cross-check must catch)."""
    from minipaged.registry import Backend, BackendOps

    def fix(s):
        return s[:1].expand_as(s).contiguous() if (wrong_head_scale and s is not None) else s

    def decode(q, kc, vc, bt, cl, scale, rl=False, k_scale=None, v_scale=None):
        return reference.decode(q, kc, vc, bt, cl, scale, rl, fix(k_scale), fix(v_scale))

    def paged(q, kc, vc, bt, cu, cl, mq, causal, scale, rl=False, k_scale=None, v_scale=None):
        return reference.paged(q, kc, vc, bt, cu, cl, mq, causal, scale, rl, fix(k_scale), fix(v_scale))

    ops = BackendOps(prefill=reference.prefill, prefill_varlen=reference.prefill_varlen, decode=decode, paged=paged,
                     write_kv_cache=reference.write_kv_cache)
    return Backend(name=name, load=lambda: ops, devices=("cpu",), availability=lambda d: (True, "test"),
                   dtypes=("float16", "bfloat16", "float32"), head_dims=(64, 128, 256), fp8_kv=True)


def test_fp8_crosscheck_compares_on_the_same_fp8_cache_and_can_fail(monkeypatch):
    from minipaged import registry

    monkeypatch.setitem(registry._BACKENDS, "good8", _fake_backend("good8", False))
    monkeypatch.setitem(registry._BACKENDS, "bad8", _fake_backend("bad8", True))
    registry.reset_caches()
    try:
        failures = {}
        rows = runner.crosscheck_fp8(["torch", "good8", "bad8"], torch.device("cpu"), torch.float16, True,
                                     lambda s: None, ("decode", "paged"), failures)
    finally:
        registry.reset_caches()
    by = {(r["op"], r["backend"]): r for r in rows}
    assert set(by) == {(op, b) for op in ("decode", "paged") for b in ("torch", "good8", "bad8")}
    assert all(r["kv_dtype"] == report.FP8_NAME for r in rows)
    for op in ("decode", "paged"):
        assert by[(op, "torch")]["ok"] and by[(op, "torch")]["max_abs_err"] < 1e-2
        assert by[(op, "good8")]["ok"], by[(op, "good8")]
        # the wrong head scale is off by far more than fp8 rounding (which is nobody's fault here)
        bad = by[(op, "bad8")]
        assert not bad["ok"] and bad["max_abs_err"] > 10 * bad["tol"], bad
    assert failures == {}
    text = report.crosscheck_table(rows)
    assert "decode fp8" in text and "paged fp8" in text and "2 failing" in text


def test_fp8_ratios_vs_best_anchor_and_targets():
    """speed-up vs 16-bit pairs each fp8 row with its own 16-bit row; fp8 rows are judged against
    fp8 anchors and 16-bit rows against 16-bit ones; the fp8 time target applies on its cases."""
    big, small = cs.DecodeCase(64, 8192, 16, 8, 128), cs.DecodeCase(8, 4096, 16, 8, 128)
    rows = []

    def add(case, backend, kind, ms, fp8_of=None, op="decode"):
        row = runner._base_row(op, case, backend, kind)
        row.update(median_ms=ms)
        if fp8_of:
            row.update(kv_dtype=report.FP8_NAME, of_16bit=fp8_of)
        rows.append(row)
        return row

    cuda16, cuda8 = add(big, "cuda", "backend", 1.0), add(big, "cuda fp8", "backend", 0.5, "cuda")
    tri16, tri8 = add(big, "triton", "backend", 1.0), add(big, "triton fp8", "backend", 0.6, "triton")
    fi16 = add(big, anc.FI_DECODE, "anchor", 1.25)
    fi8 = add(big, anc.FI_DECODE_FP8, "anchor", 0.625, anc.FI_DECODE)
    other = add(small, "cuda fp8", "backend", 0.1, "cuda")  # its 16-bit row is missing
    paged = cs.PagedCase("spec", (4,) * 2, (64,) * 2, 4, 2, 64)
    p16, p8 = add(paged, "triton", "backend", 2.0, op="paged"), add(paged, "triton fp8", "backend", 1.6, "triton", "paged")
    add(paged, "triton decode", "anchor", 1.0, op="paged")["of_backend"] = "triton"
    rows[-1]["role"] = "decode"
    runner.finalize_rows(rows, None)
    assert cuda8["speed_vs_16bit"] == pytest.approx(2.0) and tri8["speed_vs_16bit"] == pytest.approx(1 / 0.6)
    assert fi8["speed_vs_16bit"] == pytest.approx(2.0) and other["speed_vs_16bit"] is None
    assert cuda16["speed_vs_16bit"] is None
    assert cuda8["vs_best_anchor"] == pytest.approx(0.625 / 0.5)  # the fp8 anchor, not the 16-bit one
    assert cuda16["vs_best_anchor"] == pytest.approx(1.25) and tri16["vs_best_anchor"] == pytest.approx(1.25)
    assert p8["speed_vs_16bit"] == pytest.approx(1.25) and p8["time_vs_decode"] is None
    assert p16["time_vs_decode"] == pytest.approx(2.0)
    assert report.fp8_verdict(cuda8) is True and report.fp8_verdict(tri8) is False
    assert report.fp8_verdict(fi8) is None and report.fp8_verdict(other) is None  # anchor; not a target case
    table = report.text_table(rows, "decode")
    assert "speed-up vs 16-bit" in table and "2.00x ok" in table and "1.67x MISS" in table
    assert "cuda fp8 B=64 L=8192: fp8 / 16-bit time = 0.50 (target <= 0.55: met)" in table
    assert "triton fp8 B=64 L=8192: fp8 / 16-bit time = 0.60 (target <= 0.55: MISSED)" in table
    assert "speed-up vs 16-bit" in report.text_table(rows, "paged")
    assert "speed-up vs 16-bit" not in report.text_table([cuda16, tri16, fi16], "decode")


def test_flashinfer_fp8_decode_anchor_on_our_fp8_pages(fake_flashinfer):
    cfg = _cfg(quick=True, kv_cache_dtype="fp8")
    r = runner._Runner(cfg, torch.device("cpu"), torch.float16, True)
    case = cs.DecodeCase(3, 50, 4, 2, 64, 16, context_lens=(1, 17, 50))
    assert anc.FI_DECODE_FP8 in runner._anchor_names(cfg, "decode", torch.device("cuda"))
    assert anc.FI_DECODE_FP8 not in runner._anchor_names(_cfg(), "decode", torch.device("cuda"))
    rows = list(runner._bench_decode_case(r, case, ["torch"], [anc.FI_DECODE, anc.FI_DECODE_FP8], {}, lambda s: None))
    got = {x["backend"]: x for x in rows}
    assert set(got) == {"torch", "torch fp8", anc.FI_DECODE, anc.FI_DECODE_FP8}
    fi8 = got[anc.FI_DECODE_FP8]
    assert fi8["status"] == "ok" and "agrees with torch" in fi8["note"] and "scalar k_scale" in fi8["note"], fi8
    assert fi8["kv_dtype"] == report.FP8_NAME and fi8["of_16bit"] == anc.FI_DECODE
    assert fi8["bytes"] == got["torch fp8"]["bytes"] == flops.decode_bytes(4, 2, 64, (1, 17, 50), 2, kv_elem_bytes=1)
    assert got["torch"]["bytes"] == case.bytes(2)
    # the run times it in a pass after every other decode row, on the same inputs rebuilt from the seed
    later = list(runner._bench_decode_fi_fp8(r, case, ["torch"], [], {}, lambda s: None))
    assert len(later) == 1 and later[0]["status"] == "ok" and later[0]["bytes"] == fi8["bytes"], later
    assert later[0]["note"] == fi8["note"]  # same scalar scales: same quantised cache
    mixed = [dict(op="decode", case="a", n=0), dict(op="decode", case="b", n=1), dict(op="paged", case="a", n=2),
             dict(op="decode", case="a", n=3)]
    assert [x["n"] for x in runner.grouped_rows(mixed)] == [0, 3, 1, 2]
    fake_flashinfer.scale_error = 1.5  # a misapplied k_scale must not pass as an anchor
    rows = list(runner._bench_decode_case(r, case, ["torch"], [anc.FI_DECODE_FP8], {}, lambda s: None))
    bad = next(x for x in rows if x["backend"] == anc.FI_DECODE_FP8)
    assert bad["status"] == "error" and "differs from torch" in bad["error"], bad


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU: the quick grid and its dtype default")
@pytest.mark.parametrize("argv, words", [
    (["--kv-cache-dtype", "fp16"], ["--kv-cache-dtype", "'fp16'", "auto", "fp8"]),
    (["--kv-cache-dtype", ""], ["--kv-cache-dtype", "''"]),
    (["--kv-cache-dtype", "fp8", "--op", "prefill"], ["--kv-cache-dtype fp8", "--op prefill"]),
    (["--kv-cache-dtype", "fp8", "--dtype", "float32"], ["--kv-cache-dtype fp8", "float32", "bfloat16"]),
    (["--anchors", "flashinfer-decode-fp8", "--op", "decode"], ["flashinfer-decode-fp8"]),
])
def test_bench_rejects_bad_kv_cache_dtype(argv, words, capsys, tmp_path, monkeypatch):
    _assert_bench_refuses(argv, words, capsys, tmp_path, monkeypatch)


def _assert_bench_refuses(argv, words, capsys, tmp_path, monkeypatch):
    """`minipaged bench ARGV` exits 2 with one `error:` line holding every word, before any case runs."""
    from minipaged import cli

    def not_run(*a, **k):
        raise AssertionError("the benchmark ran before the arguments were checked")

    monkeypatch.setattr(runner, "_run", not_run)
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    rc = cli.main(["bench", "--out", str(tmp_path), *argv])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "error:" in x]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(w in lines[0] for w in words), lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU: only torch and triton exist there")
def test_bench_fp8_with_no_fp8_backend_is_an_error(capsys, tmp_path, monkeypatch):
    from minipaged import cli, registry

    monkeypatch.setitem(registry._BACKENDS, "torch", dataclasses.replace(registry._BACKENDS["torch"], fp8_kv=False))
    monkeypatch.setattr(runner, "_run", lambda *a, **k: pytest.fail("ran before the check"))
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    rc = cli.main(["bench", "--out", str(tmp_path), "--backends", "torch", "--kv-cache-dtype", "fp8"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and err.startswith("error: --kv-cache-dtype fp8"), err
    assert "torch has no float8_e4m3fn KV-cache kernels" in err and "triton" in err


def test_op_paged_with_fp8_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    cfg = runner.BenchConfig(op="paged", backends=["torch"], anchors=[], quick=True, out=str(tmp_path), reps=1,
                             max_time_s=0, plots=False, progress=False, log=lambda s: None, kv_cache_dtype="fp8")
    result = runner.run_bench(cfg)
    assert result["config"]["kv_cache_dtype"] == "fp8" and result["config"]["dtype"] == "float16"
    rows = result["rows"]
    fp8 = [r for r in rows if r["kv_dtype"] == report.FP8_NAME]
    assert [r["case"] for r in fp8] == [c.label for c in cs.quick_paged_cases()]
    for r, case in zip(fp8, cs.quick_paged_cases()):
        assert r["backend"] == "torch fp8" and r["status"] == "ok" and r["of_16bit"] == "torch", r
        assert r["bytes"] == flops.paged_bytes(4, 2, 64, case.q_lens, case.context_lens, 2, kv_elem_bytes=1)
        base = next(x for x in rows if x["backend"] == "torch" and x["case"] == r["case"])
        assert r["speed_vs_16bit"] == pytest.approx(base["median_ms"] / r["median_ms"])
    xc = [r for r in result["crosscheck"] if r.get("kv_dtype") == report.FP8_NAME]
    assert [r["op"] for r in xc] == ["paged"] and xc[0]["ok"]
    md = (tmp_path / "results.md").read_text()
    assert "torch fp8" in md and "speed-up vs 16-bit" in md and "| paged fp8 |" in md


@pytest.fixture(scope="module")
def quick_fp8_run(tmp_path_factory):
    """`minipaged bench --quick --op decode --kv-cache-dtype fp8` in a fresh process (torch and the
    Triton interpreter, float16 by default)."""
    out = tmp_path_factory.mktemp("bench_fp8")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "minipaged.benchmark.cli", "--quick", "--op", "decode",
                           "--kv-cache-dtype", "fp8", "--out", str(out), "--no-progress", "--no-plots",
                           "--reps", "1", "--max-time", "0"],
                          capture_output=True, text=True, env=env, timeout=600, cwd=str(REPO))
    return proc, out


def test_quick_fp8_decode_rows_in_json_and_markdown(quick_fp8_run):
    proc, out = quick_fp8_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert data["config"]["kv_cache_dtype"] == "fp8" and data["config"]["dtype"] == "float16"
    rows = data["rows"]
    names = ["torch"] + (["triton"] if data["backends"]["triton"]["available"] else [])
    for case in cs.quick_decode_cases():
        for name in names:
            r8 = next(r for r in rows if r["case"] == case.label and r["backend"] == f"{name} fp8")
            r16 = next(r for r in rows if r["case"] == case.label and r["backend"] == name)
            assert r8["status"] == "ok" and r8["kv_dtype"] == "float8_e4m3fn" and r8["of_16bit"] == name, r8
            assert r16["kv_dtype"] is None
            assert r8["bytes"] == flops.decode_bytes(4, 2, 64, case.lens, 2, kv_elem_bytes=1)
            assert r16["bytes"] == case.bytes(2) and r8["tbps"] > 0
            assert r8["speed_vs_16bit"] == pytest.approx(r16["median_ms"] / r8["median_ms"])
    xc = [r for r in data["crosscheck"] if r.get("kv_dtype") == "float8_e4m3fn"]
    assert {r["backend"] for r in xc} == set(names) and all(r["ok"] for r in xc), xc
    assert any(n.startswith("fp8 rows") for n in data["notes"])
    md = (out / "results.md").read_text()
    assert "| decode fp8 |" in md and "| torch fp8 |" in md and "speed-up vs 16-bit" in md
    assert "== Decode" in proc.stdout and "torch fp8" in proc.stdout


def test_fp8_accuracy_script_on_cpu(tmp_path):
    """bench/bench_fp8_accuracy.py on a tiny Qwen3 with the torch backend: teacher-forced decode
    logits line up with transformers' (an off-by-one position would give O(1) errors), the fp8
    cache really is read at decode positions and not at the prefill's."""
    out = tmp_path / "acc.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO / "src"))
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_fp8_accuracy.py"), "--device", "cpu",
                           "--backend", "torch", "--tiny", "--init-std", "0.1", "--prompt-lens", "9,33",
                           "--decode-steps", "3", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=str(REPO))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["errors"] == [] and data["prompt_lens"] == [9, 33] and data["decode_steps"] == 3
    t = data["backends"]["torch"]
    assert t["fp8_engine"]["kv_cache_dtype"] == "float8_e4m3fn" and t["bf16_engine"]["kv_cache_dtype"] == "bfloat16"
    assert t["fp8_engine"]["k_scale_min_max"][0] > 0
    dec = {k: t[k]["decode"] for k in ("bf16_vs_fp32", "fp8_vs_fp32", "fp8_vs_bf16")}
    assert all(d["rows"] == 2 * 3 for d in dec.values())
    floor = data["hf_bf16_vs_fp32"]["decode"]["rel_l2"]
    assert 0 < dec["bf16_vs_fp32"]["rel_l2"] < 3 * floor + 0.01 and dec["bf16_vs_fp32"]["top1"] >= 0.8
    assert dec["bf16_vs_fp32"]["rel_l2"] < dec["fp8_vs_fp32"]["rel_l2"] < 0.25
    assert dec["fp8_vs_bf16"]["rel_l2"] > 1e-3  # the fp8 pages were read
    assert t["fp8_vs_bf16"]["prefill_last"]["rel_l2"] == 0.0  # prefill attends over the fresh 16-bit K/V
    bad = subprocess.run([sys.executable, str(REPO / "bench" / "bench_fp8_accuracy.py"), "--device", "cpu",
                          "--backend", "nope", "--tiny"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --backends: unknown backend 'nope'")


def test_run_times_flashinfer_fp8_last_and_groups_it_with_its_case(fake_flashinfer, tmp_path, monkeypatch):
    """The whole run with the fp8 FlashInfer anchor (as a GPU run lists it; faked on CPU): its rows
    come after every other decode row is timed, and land in their case's group in the tables."""
    real = anc.anchors_for
    monkeypatch.setattr(anc, "anchors_for", lambda op, device: real(op, device) + ((anc.FI_DECODE_FP8,)
                                                                                    if op == "decode" else ()))
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    order = []
    timed = runner._Runner.timed

    def spy(self, row, *a, **k):
        order.append((row["case"], row["backend"]))
        return timed(self, row, *a, **k)

    monkeypatch.setattr(runner._Runner, "timed", spy)
    cfg = runner.BenchConfig(op="decode", backends=["torch"], anchors=[anc.FI_DECODE_FP8], quick=True,
                             out=str(tmp_path), reps=1, max_time_s=0, plots=False, progress=False,
                             log=lambda s: None, kv_cache_dtype="fp8")
    result = runner.run_bench(cfg)
    labels = [c.label for c in cs.quick_decode_cases()]
    fi_at = [i for i, (_, b) in enumerate(order) if b == anc.FI_DECODE_FP8]
    assert len(fi_at) == len(labels) and min(fi_at) > max(i for i, (_, b) in enumerate(order) if b == "torch fp8")
    rows = result["rows"]
    assert [r["case"] for r in rows] == [lab for lab in labels for _ in range(3)]  # torch, torch fp8, FI fp8
    fi = [r for r in rows if r["backend"] == anc.FI_DECODE_FP8]
    assert all(r["status"] == "ok" and "agrees with torch" in r["note"] for r in fi), fi
    # the fp8 rows' vs best anchor is against FlashInfer's fp8 decode, measured in the same run
    for r in rows:
        if r["backend"] == "torch fp8":
            f = next(x for x in fi if x["case"] == r["case"])
            assert r["vs_best_anchor"] == pytest.approx(f["median_ms"] / r["median_ms"])


# ----------------------------------------------------------------------------- --heads


def _layout(shape: dict) -> tuple[int, int, int]:
    return shape["num_q_heads"], shape["num_kv_heads"], shape["head_dim"]


def test_heads_reach_every_grid_and_keep_the_grid_head_dim():
    assert cs.grid_heads(False) == cs.QWEN3_HEADS and cs.grid_heads(True) == cs.QUICK_HEADS
    assert _layout(cs.grid_heads(False, (32, 8, None))) == (32, 8, 128)  # no D: the standard grid's
    assert _layout(cs.grid_heads(True, (32, 8, None))) == (32, 8, 64)  # ... and the quick grid's
    assert _layout(cs.grid_heads(True, (64, 8, 128))) == (64, 8, 128)
    for quick, grids in ((True, (cs.quick_prefill_cases, cs.quick_decode_cases, cs.quick_paged_cases)),
                         (False, (cs.standard_prefill_cases, cs.standard_decode_cases, cs.standard_paged_cases))):
        h = cs.grid_heads(quick, (12, 3, 256))
        cases = [c for grid in grids for c in grid(h)]
        cases += [c for f in (cs.crosscheck_prefill_cases, cs.crosscheck_decode_cases, cs.crosscheck_paged_cases)
                  for c in f(quick, h)]
        assert cases and {_layout(c.shape()) for c in cases} == {(12, 3, 256)}
        # without `heads`, today's layouts (the lengths of the grids unchanged by a layout)
        default = [c for grid in grids for c in grid()] + cs.crosscheck_decode_cases(quick)
        assert {_layout(c.shape()) for c in default} == {_layout(cs.grid_heads(quick))}
        assert [c.label for grid in grids for c in grid()] == [c.label for grid in grids for c in grid(h)]


def test_heads_parse_and_reach_the_config():
    import argparse

    from minipaged.benchmark import cli as bench_cli

    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    assert bench_cli._config(parser.parse_args(["--heads", "32/8"]), None).heads == (32, 8, None)
    assert bench_cli._config(parser.parse_args(["--heads", "64/8/128"]), None).heads == (64, 8, 128)
    assert bench_cli._config(parser.parse_args([]), None).heads is None
    assert runner.heads_text((32, 8, None)) == "32/8" and runner.heads_text((64, 8, 128)) == "64/8/128"
    # the help states the defaults the grids really use
    text = " ".join(parser.format_help().split())
    for h in (cs.QWEN3_HEADS, cs.QUICK_HEADS):
        assert runner.heads_text(_layout(h)) in text


def test_default_out_dir_names_a_layout_other_than_the_grid_default():
    cpu = torch.device("cpu")
    assert runner.default_out_dir(cpu, True, cs.grid_heads(True)) == runner.default_out_dir(cpu, True)
    assert runner.default_out_dir(cpu, False, cs.grid_heads(False, (16, 8, None))).name == "cpu"
    assert runner.default_out_dir(cpu, True, cs.grid_heads(True, (8, 2, None))).name == "cpu-quick-h8x2x64"
    assert runner.default_out_dir(cpu, False, cs.grid_heads(False, (32, 8, None))).name == "cpu-h32x8x128"


def test_quick_run_with_heads_times_and_records_that_layout(tmp_path, monkeypatch):
    """`bench --quick --heads 8/2` (torch only, one call per row): every timed and cross-checked row
    is at 8/2/64, the work counted is that layout's, and the default folder names the layout."""
    from minipaged import cli

    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["bench", "--quick", "--heads", "8/2", "--backends", "torch", "--reps", "1", "--max-time", "0",
                   "--no-plots", "--no-progress"])
    assert rc == 0
    found = list((tmp_path / runner.DEFAULT_OUT_ROOT).glob("*/results.json"))
    assert len(found) == 1 and found[0].parent.name.endswith("-quick-h8x2x64"), found
    data = json.loads(found[0].read_text())
    assert data["config"]["heads"] == dict(num_q_heads=8, num_kv_heads=2, head_dim=64)
    # no --page-size: 16-token pages, and no page suffix on the folder
    assert data["config"]["page_size"] == 16 and "-p" not in found[0].parent.name
    assert {r["shape"]["block_size"] for r in data["rows"] + data["crosscheck"] if r["op"] != "prefill"} == {16}
    rows, xc = data["rows"], data["crosscheck"]
    assert {r["op"] for r in rows} == {"prefill", "decode", "paged"}
    assert {_layout(r["shape"]) for r in rows + xc} == {(8, 2, 64)}
    assert xc and all(r["ok"] for r in xc), xc
    h = cs.grid_heads(True, (8, 2, None))
    torch_rows = [r for r in rows if r["backend"] == "torch"]
    want = cs.quick_prefill_cases(h) + cs.quick_decode_cases(h) + cs.quick_paged_cases(h)
    assert [r["case"] for r in torch_rows] == [c.label for c in want]
    assert all(r["status"] == "ok" and r["flops"] == c.flops for r, c in zip(torch_rows, want)), torch_rows
    assert want[0].flops == 2 * cs.quick_prefill_cases()[0].flops  # twice the default's query heads
    assert "Hq=8 Hkv=2 D=64" in (found[0].parent / "results.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU: only torch and triton exist there")
@pytest.mark.parametrize("argv, words", [
    (["--heads", "32"], ["--heads", "HQ/HKV", "'32'"]),
    (["--heads", "32/x"], ["--heads", "'32/x'"]),
    (["--heads", "8/2/64/1"], ["--heads", "'8/2/64/1'"]),
    (["--heads", "8/2/"], ["--heads", "'8/2/'"]),
    (["--heads", "0/8"], ["--heads 0/8", "HQ", ">= 1"]),
    (["--heads=8/-2"], ["--heads 8/-2", "HKV", ">= 1"]),
    (["--heads", "8/2/0"], ["--heads 8/2/0", "D", ">= 1"]),
    (["--heads", "12/8"], ["--heads 12/8", "HQ=12", "not a multiple of HKV=8"]),
    (["--heads", "8/2/96", "--backends", "torch"], ["--backends torch", "D=96", "64, 128, 256"]),
    (["--heads", "8/2/96"], ["no backend", "D=96", "torch", "triton"]),
    (["--heads", "4/2/96", "--backends", "none", "--anchors", "sdpa-cpu"], ["oracle", "D=96", "--no-crosscheck"]),
])
def test_bench_rejects_bad_heads(argv, words, capsys, tmp_path, monkeypatch):
    _assert_bench_refuses(argv, words, capsys, tmp_path, monkeypatch)


@pytest.fixture
def narrow_backend(monkeypatch):
    """A CPU backend ("narrow", the torch kernels) declaring the cuda backend's head dims (64, 128),
    with triton off, so that the default backends here are torch and narrow."""
    from minipaged import registry

    assert registry._BACKENDS["cuda"].head_dims == (64, 128)
    monkeypatch.setitem(registry._BACKENDS, "narrow", dataclasses.replace(
        registry._BACKENDS["torch"], name="narrow", head_dims=(64, 128), availability=lambda d: (True, "test")))
    monkeypatch.setitem(registry._BACKENDS, "triton", dataclasses.replace(
        registry._BACKENDS["triton"], availability=lambda d: (False, "off in this test")))
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    registry.reset_caches()
    yield "narrow"
    monkeypatch.undo()
    registry.reset_caches()  # (the cached availability of the patched triton must not outlive the test)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU: the default backends are torch and the double")
def test_a_named_backend_that_cannot_run_the_head_dim_is_refused(narrow_backend, capsys, tmp_path, monkeypatch):
    from minipaged import cli

    monkeypatch.setattr(runner, "_run", lambda *a, **k: pytest.fail("ran before the check"))
    rc = cli.main(["bench", "--out", str(tmp_path), "--backends", "torch,narrow", "--heads", "8/2/256"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and err.startswith("error: --backends narrow cannot run"), err
    assert "D=256" in err and "--heads 8/2/256" in err and "64, 128" in err and "torch" not in err
    # at the quick grid's own D=64 it runs
    plan = runner.check_config(_cfg(backends=["narrow"], quick=True, out=str(tmp_path), heads=(8, 2, None)))
    assert plan.backends == ["narrow"] and plan.notes == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU: the default backends are torch and the double")
def test_a_default_backend_that_cannot_run_the_head_dim_is_left_out_with_a_note(narrow_backend, tmp_path):
    logged = []
    cfg = runner.BenchConfig(op="decode", anchors=[], quick=True, out=str(tmp_path), reps=1, max_time_s=0,
                             plots=False, progress=False, log=logged.append, heads=(4, 2, 256))
    assert runner.check_config(dataclasses.replace(cfg, heads=None)).backends == ["torch", "narrow"]
    result = runner.run_bench(cfg)
    assert result["config"]["backends"] == ["torch"]
    assert {r["backend"] for r in result["rows"]} == {"torch"}
    assert {_layout(r["shape"]) for r in result["rows"] + result["crosscheck"]} == {(4, 2, 256)}
    note = next(n for n in result["notes"] if "narrow" in n)
    assert "D=256" in note and "narrow supports head dims 64, 128 only" in note
    assert f"note: {note}" in logged and note in (tmp_path / "results.md").read_text()


# ----------------------------------------------------------------------------- --page-size


def test_page_size_reaches_the_decode_and_paged_grids_and_their_crosschecks():
    assert cs.DEFAULT_PAGE_SIZE == 16 and MAX_BLOCK_SIZE == 256
    for quick, grids in ((True, (cs.quick_decode_cases, cs.quick_paged_cases)),
                         (False, (cs.standard_decode_cases, cs.standard_paged_cases))):
        h = cs.grid_heads(quick)
        default = [c for grid in grids for c in grid(h)]
        default_xc = cs.crosscheck_decode_cases(quick) + cs.crosscheck_paged_cases(quick)
        assert {c.block_size for c in default + default_xc} == {16}  # today's pages without the flag
        for ps in (1, 64, 256):
            cases = [c for grid in grids for c in grid(h, ps)]
            assert {c.block_size for c in cases} == {ps}
            # the timed grids keep their lengths; only the page changes
            assert [c.label for c in cases] == [c.label for c in default]
            dec, = cs.crosscheck_decode_cases(quick, h, ps)
            paged, = cs.crosscheck_paged_cases(quick, None, ps)
            assert dec.block_size == paged.block_size == ps and _layout(paged.shape()) == _layout(h)
            # one more sequence crossing two pages at any page size: 2 pages + 1 token
            assert dec.lens == default_xc[0].lens + (2 * ps + 1,)
            assert paged.context_lens == default_xc[1].context_lens + (2 * ps + 1,)
            assert paged.q_lens == default_xc[1].q_lens + (ps + 2,)
        # the prefill grid reads no pages: it has no page size to take
        assert cs.crosscheck_prefill_cases(quick) == cs.crosscheck_prefill_cases(quick, h)


@pytest.mark.parametrize("page_size", [1, 64])
def test_decode_and_paged_caches_have_the_page_size(page_size):
    """The caches the inputs builders make from the grid's cases really have `page_size` tokens a page
    (k_cache.shape[1]), and the anchors' layouts read the same tokens from them."""
    torch.manual_seed(0)
    for case in cs.quick_decode_cases(page_size=page_size) + cs.crosscheck_decode_cases(True, page_size=page_size):
        q, kc, vc, bt, cl = cs.make_decode_inputs(case, torch.float32, "cpu", seed=None, poison=False,
                                                  spare_columns=0)
        assert kc.shape[1] == vc.shape[1] == page_size
        assert bt.shape[1] == -(-case.context_len // page_size)
        if case.uniform:
            k4, _ = cs.contiguous_kv(kc, vc, bt, case.context_len)
            t = case.context_len - 1  # the last token of sequence 0
            assert torch.equal(k4[0, :, t], kc[int(bt[0, t // page_size]), t % page_size])
    for case in cs.quick_paged_cases(page_size=page_size) + cs.crosscheck_paged_cases(True, page_size=page_size):
        _, kc, vc, bt, _, cl = cs.make_paged_inputs(case, torch.float32, "cpu", seed=None, poison=False)
        assert kc.shape[1] == vc.shape[1] == page_size
        k, _, cu_k = cs.gather_varlen_kv(kc, vc, bt, cl.tolist())
        s, t = case.batch - 1, case.context_lens[-1] - 1
        assert torch.equal(k[int(cu_k[s]) + t], kc[int(bt[s, t // page_size]), t % page_size])
        indptr, _, last = anc.flashinfer_page_layout(bt, cl, kc.shape[1])
        assert indptr[-1].item() == sum(-(-n // page_size) for n in case.context_lens)
        assert last[-1].item() == (t % page_size) + 1


def test_page_size_parse_and_reach_the_config():
    import argparse

    from minipaged.benchmark import cli as bench_cli

    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    assert bench_cli._config(parser.parse_args([]), None).page_size == cs.DEFAULT_PAGE_SIZE
    assert runner.BenchConfig().page_size == cs.DEFAULT_PAGE_SIZE
    assert bench_cli._config(parser.parse_args(["--page-size", "64"]), None).page_size == 64
    text = " ".join(parser.format_help().split())
    assert "--page-size N" in text and "1 to 256" in text and "default 16" in text and "prefill" in text
    assert "-p<N>" in text
    assert runner.check_page_size(1) == 1 and runner.check_page_size(256) == 256
    for bad, exc in ((0, ValueError), (3, ValueError), (512, ValueError), (-16, ValueError), (16.0, TypeError),
                     (True, TypeError), ("16", TypeError), (None, TypeError)):
        with pytest.raises(exc, match="--page-size"):
            runner.check_page_size(bad)


def test_default_out_dir_names_a_page_size_other_than_16():
    cpu = torch.device("cpu")
    assert runner.default_out_dir(cpu, True, None, 16) == runner.default_out_dir(cpu, True)
    assert runner.default_out_dir(cpu, True, cs.grid_heads(True), 64).name == "cpu-quick-p64"
    assert runner.default_out_dir(cpu, False, None, 1).name == "cpu-p1"
    assert runner.default_out_dir(cpu, True, cs.grid_heads(True, (8, 2, None)), 256).name == "cpu-quick-h8x2x64-p256"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU: the quick grid")
@pytest.mark.parametrize("argv, words", [
    (["--page-size", "0"], ["--page-size", "power of two from 1 to 256", "got 0"]),
    (["--page-size", "3"], ["--page-size", "power of two", "got 3"]),
    (["--page-size", "512"], ["--page-size", "1 to 256", "got 512"]),
    (["--page-size", "-16"], ["--page-size", "got -16"]),
    (["--page-size=-16", "--op", "prefill"], ["--page-size", "got -16"]),  # refused even where it is unused
    (["--page-size", "1" + "0" * 400], ["--page-size", "401-digit"]),
])
def test_bench_rejects_bad_page_size(argv, words, capsys, tmp_path, monkeypatch):
    _assert_bench_refuses(argv, words, capsys, tmp_path, monkeypatch)
    assert not list(tmp_path.iterdir())  # refused before the results folder is touched


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU: the quick grid, torch and the Triton interpreter")
@pytest.mark.parametrize("op, page_size", [("decode", 1), ("decode", 64), ("paged", 1), ("paged", 64)])
def test_quick_run_at_a_page_size_records_it_and_passes_the_crosschecks(op, page_size, tmp_path, monkeypatch,
                                                                        capsys):
    """`bench --quick --op OP --page-size N --kv-cache-dtype fp8` (torch and the Triton interpreter, float16,
    one call per row): every row and cross-check (the fp8 one included) is at N-token pages, the caches
    timed really have N tokens a page, the cross-checks pass and the default folder ends in -pN."""
    from minipaged import cli

    made = []
    build = {"decode": cs.make_decode_inputs, "paged": cs.make_paged_inputs}[op]

    def spy(case, *a, **k):
        out = build(case, *a, **k)
        made.append((case.block_size, out[1].shape[1], out[2].shape[1]))
        return out

    monkeypatch.setattr(cs, build.__name__, spy)
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["bench", "--quick", "--op", op, "--page-size", str(page_size), "--kv-cache-dtype", "fp8",
                   "--reps", "1", "--max-time", "0", "--no-plots", "--no-progress"])
    assert rc == 0
    assert f"D=64, {page_size}-token pages, backends: " in capsys.readouterr().out  # the run's header line
    found = list((tmp_path / runner.DEFAULT_OUT_ROOT).glob("*/results.json"))
    assert len(found) == 1 and found[0].parent.name == f"cpu-quick-p{page_size}", found
    data = json.loads(found[0].read_text())
    assert data["config"]["page_size"] == page_size and data["config"]["dtype"] == "float16"
    rows, xc = data["rows"], data["crosscheck"]
    assert {r["op"] for r in rows} == {op} and {r["shape"]["block_size"] for r in rows + xc} == {page_size}
    # the cross-check and the timed grid built every cache at that page size
    assert made and set(made) == {(page_size,) * 3}
    names = ["torch"] + (["triton"] if data["backends"]["triton"]["available"] else [])
    assert {(r["backend"], r.get("kv_dtype")) for r in xc} == {(n, k) for n in names for k in (None, "float8_e4m3fn")}
    assert all(r["ok"] for r in xc), xc
    want = (cs.quick_decode_cases if op == "decode" else cs.quick_paged_cases)(page_size=page_size)
    for name in names + [f"{n} fp8" for n in names]:
        got = [r for r in rows if r["backend"] == name]
        assert [r["case"] for r in got] == [c.label for c in want] and all(r["status"] == "ok" for r in got), got
    assert not [r for r in rows if r["status"] == "error"]
    assert f"block size {page_size}, pages scattered" in (found[0].parent / "results.md").read_text()
