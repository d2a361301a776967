"""CPU / CI: every CUDA source compiles with plain nvcc for sm_80 and sm_90a
(the wgmma kernels), ptxas reports no register spills, and the torch
binding parses.

No GPU is needed; the tests skip (with the reason) when nvcc is absent.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from minipaged.cuda import build

CSRC = build.CSRC
SOURCES = build.cuda_sources()  # relative to csrc: "decode/launch.cu", ...
# One nvcc run per source; with sm_90a in it the wgmma kernels are compiled
# (real code for sm_90a, __trap() stubs for sm_80). No plain sm_90: in this combined run it
# would get the sm_90a defines, a configuration no build uses (build.py builds H100/H200 as
# sm_90a), for a third ptxas pass in CI's slowest fixture.
ARCHS = ("80", "90a")
NVCC = build.nvcc_path()
# The translation units with kernels of their own (every launch path of the two backends).
# (decode/launch.cu: the work list's planner; decode/kernels_*.cu: the decode kernels in slices;
# prefill/fast_*.cu and prefill/paged_*_kv*.cu: the fast prefill kernels in slices, which the
# kernel-free launchers prefill/fast.cu and prefill/paged.cu call)
DECODE_KERNEL_SOURCES = tuple(s for s in SOURCES if s.startswith("decode/kernels_"))
PREFILL_LAUNCHERS = ("prefill/fast.cu", "prefill/paged.cu")
PREFILL_KERNEL_SOURCES = tuple(s for s in SOURCES if s.startswith(("prefill/fast_", "prefill/paged_")))
KERNEL_SOURCES = ("cache/write_kv.cu", "decode/launch.cu", "prefill/wmma.cu") + DECODE_KERNEL_SOURCES + \
    PREFILL_KERNEL_SOURCES

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA toolkit absent): cannot compile the CUDA sources")


# The decode's benchmarking-only tilings (forced through DecodeParams::variant by the selftest
# and A/B scripts, never by a default plan) are left out of this compile: they are a third of
# the decode kernels (decode/kernels_*.cu) and of CI's slowest fixture. Every real build keeps them.
EXTRA_FLAGS = ["-DMINIPAGED_DECODE_BENCH_TILINGS=0"]


@pytest.fixture(scope="module")
def nvcc_out(tmp_path_factory):
    """The folder of the `compiled` fixture's objects (build.compile_standalone names them)."""
    return tmp_path_factory.mktemp("nvcc")


@pytest.fixture(scope="module")
def compiled(nvcc_out):
    """Compile every source once for both archs (one nvcc run each, two at a time: CI has 2 cores)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = pool.map(lambda src: build.compile_standalone(CSRC / src, ARCHS, nvcc_out, EXTRA_FLAGS), SOURCES)
        return dict(zip(SOURCES, results))


def test_expected_sources_present():
    # The registry's two CUDA backends need all five launch paths.
    for name in (*KERNEL_SOURCES, *PREFILL_LAUNCHERS, "binding.cpp", "params.h"):
        assert (CSRC / name).exists(), f"{name} missing from {CSRC}"
    assert set(KERNEL_SOURCES) <= set(SOURCES)
    # cpp_extension names every object after its source's base name
    stems = [Path(s).stem for s in SOURCES] + ["binding"]
    assert len(set(stems)) == len(stems), stems


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES)
def test_nvcc_compiles_without_spills(compiled, source, arch):
    rc, log = compiled[source]
    assert rc == 0, f"nvcc failed for {source} (sm_{'/sm_'.join(ARCHS)}):\n{log[-4000:]}"
    kernels = [k for k in build.parse_ptxas(log) if k["arch"] == f"sm_{arch}"]
    if source in KERNEL_SOURCES:
        assert kernels, f"ptxas reported no sm_{arch} kernels for {source}:\n{log[-2000:]}"
    for k in kernels:
        assert k["spill_stores"] == 0 and k["spill_loads"] == 0, (
            f"{source} sm_{arch}: {k['kernel']} spills {k['spill_stores']} B stores / {k['spill_loads']} B loads"
        )


def _kernel_names(compiled, source, arch):
    """The mangled names of the kernels ptxas compiled from `source` for sm_`arch`."""
    rc, log = compiled[source]
    assert rc == 0, log[-4000:]
    return [k["kernel"] for k in build.parse_ptxas(log) if k["arch"] == f"sm_{arch}"]


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_decode_fp8_short_ring_kernels_compiled(compiled, arch):
    # The short-ring rule (params.h decode_fp8_short_ring_wanted; a variant bit or a build flag
    # turns it on) runs the G = 2 FP8 tensor-core kernel (32-token tiles) with a 2-stage ring in
    # place of 3 in every plan that takes it: plain with its work-list twin, fused, packed-query.
    # So every real build has both depths of all four, in the FP8 D = 128 slices only. (The
    # benchmarking tiling 19 is the plain 2-stage kernel alone, and this compile leaves it out.)
    def wide_fp8(source, stages):
        # paged_decode_mma_kernel<T, D, STAGES, FP8, FUSED, PQ, WT, MQ, RB, WL, NW>
        pattern = re.compile(rf"paged_decode_mma_kernelI(?:6__half|13__nv_bfloat16)Li128ELi{stages}ELb1E"
                             r"Lb([01])ELb([01])ELi32ELb0ELi1ELb([01])ELi4EE")
        return {m.groups() for n in _kernel_names(compiled, source, arch) if (m := pattern.search(n))}

    plans = {("0", "0", "0"), ("0", "0", "1"), ("1", "0", "0"), ("0", "1", "0")}  # (FUSED, PQ, WL)
    for source in DECODE_KERNEL_SOURCES:
        want = plans if source.endswith("_d128_kv8.cu") else set()
        assert wide_fp8(source, 3) == want, (source, wide_fp8(source, 3))
        assert wide_fp8(source, 2) == want, (source, wide_fp8(source, 2))


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_decode_worklist_kernels_compiled(compiled, arch):
    # The work list's one-CTA plan kernel (decode/worklist_plan.cuh) and the work-list twins of the
    # merge (decode_reduce_kernel<T, D, PQ = false, MQ = false, WL = true, GROUPED, WARPS>: two q
    # dtypes x two head dims; one sequence or kWorklistMergeSeqs per CTA, or one warp per head) ship
    # in every decode build, so that a plan may take a work list on any device. The planner is
    # decode/launch.cu's; the twins are compiled with the kernels of each (q dtype, head dim) slice
    # (anonymous-namespace names: compared from the template name on).
    def kernels(source):
        return _kernel_names(compiled, source, arch)

    # (launch.cu compiles only the planner: a decode kernel there would serialise the build again)
    planner = kernels("decode/launch.cu")
    assert len(planner) == 1 and "decode_worklist_plan_kernel" in planner[0], planner
    assert len(DECODE_KERNEL_SOURCES) == 8, DECODE_KERNEL_SOURCES  # 2 q dtypes x 2 head dims x 2 cache dtypes
    names = [n for src in DECODE_KERNEL_SOURCES for n in kernels(src)]
    assert not any("decode_worklist_plan_kernel" in n for n in names)
    for grouped, warps in ((0, 0), (1, 0), (0, 1)):
        tail = f"ELb0ELb0ELb1ELb{grouped}ELb{warps}EEEvNS_12DecodeParamsE"
        twins = {n[n.index("decode_reduce_kernel"):] for n in names if "decode_reduce_kernel" in n and n.endswith(tail)}
        assert len(twins) == 4, (grouped, warps, twins)


@needs_nvcc
@pytest.mark.parametrize("source", ["prefill/fast_f16.cu", "prefill/fast_bf16.cu", "prefill/paged_f16_kv16.cu",
                                    "prefill/paged_bf16_kv16.cu"])
def test_sm90a_build_has_real_wgmma_kernels(compiled, source):
    # In an sm_90a build the dispatcher references the wgmma kernels, so they are
    # compiled, and for sm_90a they are real code (elsewhere a __trap() stub of a
    # few registers that the dispatcher of that build never picks).
    rc, log = compiled[source]
    assert rc == 0
    wg = [k for k in build.parse_ptxas(log) if "prefill_wgmma_kernel" in k["kernel"]]
    real = [k for k in wg if k["arch"] == "sm_90a"]
    assert real and all(k["registers"] >= 64 for k in real), real
    assert all(k["registers"] < 32 for k in wg if k["arch"] != "sm_90a")


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_kernels_compile_once_in_slices(compiled, arch):
    # The launchers compile no kernel (one there would serialise the build again), and each
    # prefill kernel is compiled by exactly one slice: the slices split the work, not repeat it.
    def kernels(source):
        return _kernel_names(compiled, source, arch)

    for launcher in PREFILL_LAUNCHERS:
        assert kernels(launcher) == [], launcher
    # 2 q dtypes dense, 2 q dtypes x 2 cache dtypes paged
    assert len(PREFILL_KERNEL_SOURCES) == 6, PREFILL_KERNEL_SOURCES
    names = [n for src in PREFILL_KERNEL_SOURCES for n in kernels(src)]
    assert names and len(names) == len(set(names)), sorted(n for n in set(names) if names.count(n) > 1)
    # each slice holds only its own q dtype's kernels (the mangled element type)
    for src in PREFILL_KERNEL_SOURCES:
        other = "6__half" if "bf16" in src else "13__nv_bfloat16"
        assert not [n for n in kernels(src) if other in n], src


@needs_nvcc
def test_parse_ptxas_reads_a_real_report(compiled):
    rc, log = compiled["cache/write_kv.cu"]
    assert rc == 0
    kernels = build.parse_ptxas(log)
    assert all(k["registers"] and k["registers"] > 0 for k in kernels)
    assert any("write_kv_kernel" in k["kernel"] for k in kernels)


@needs_nvcc
def test_every_cross_unit_reference_is_defined(compiled, nvcc_out):
    # The launchers call the slices' entry points (select_kernel_for, prefill_slice::paged, ...)
    # through declarations only; a slice that lost an instantiation would leave an undefined
    # symbol that only the GPU machine's import of the extension would report. Every minipaged
    # symbol one object needs must be defined by another (a link of the kernel units, binding aside).
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) not found")
    assert all(rc == 0 for rc, _ in compiled.values())
    objects = sorted(Path(nvcc_out).glob("*.o"))
    assert len(objects) == len(SOURCES), objects
    defined, needed = set(), {}
    for obj in objects:
        listing = subprocess.run([nm, "-P", str(obj)], capture_output=True, text=True, check=True).stdout
        for line in listing.splitlines():
            name, kind = (line.split() + ["", ""])[:2]
            if "9minipaged" not in name:  # the Itanium mangling of namespace minipaged
                continue
            if kind == "U":
                needed.setdefault(name, []).append(obj.name)
            else:
                defined.add(name)
    # (the decode and prefill launchers need the slices: a check that finds nothing checks nothing)
    assert any("select_kernel_for" in n for n in needed) and any("prefill_slice" in n for n in needed), needed
    missing = {n: users for n, users in needed.items() if n not in defined}
    assert not missing, missing


@needs_nvcc
def test_decode_selftest_builds(compiled, nvcc_out, tmp_path):
    # scripts/decode_selftest.cu, the torch-free decode check and timing harness that the GPU calls
    # run (gpu_check.sh decode_selftest), compiles with gpu_check's selftest flags and links against
    # the decode units: a header change that breaks it, or a unit it needs that its build line
    # leaves out, fails here instead of in a GPU call. (Not run: it needs a GPU.)
    scripts = Path(__file__).resolve().parents[1] / "scripts"
    flags = re.search(r'^selftest_flags="([^"]*)"', (scripts / "gpu_check.sh").read_text(), re.M)
    assert flags, "gpu_check.sh no longer sets selftest_flags"
    decode_units = [s for s in SOURCES if s.startswith("decode/")]
    assert "decode/launch.cu" in decode_units and DECODE_KERNEL_SOURCES
    assert all(compiled[s][0] == 0 for s in decode_units)
    objects = [build.standalone_object(s, ARCHS, nvcc_out) for s in decode_units]
    exe = tmp_path / "decode_selftest"
    cmd = [NVCC, *flags.group(1).replace("$csrc", str(CSRC)).split(), str(scripts / "decode_selftest.cu"),
           *map(str, objects), "-o", str(exe), "-lgomp"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert exe.stat().st_size > 0


def _build_probe(tmp_path, name, source, compiler, *flags):
    """Compiles a host-only probe (`source`, a main reading stdin) against csrc; its path."""
    src = tmp_path / f"{name}.cu"
    src.write_text(source)
    exe = tmp_path / name
    proc = subprocess.run([compiler, *flags, "-std=c++17", "-I", str(CSRC), str(src), "-o", str(exe)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return exe


def _run_probe(exe, rows):
    """One stdin line per row (its fields space-separated) -> the probe's stdout lines."""
    feed = "".join(" ".join(map(str, r)) + "\n" for r in rows)
    return subprocess.run([str(exe)], input=feed, capture_output=True, text=True, check=True).stdout.splitlines()


# The packed kernel's KV split arithmetic (prefill/pack_split.h), compiled as plain C++: one
# line per shape on stdin ("ctas capacity resident requested"), "splits split_keys" out.
_PACK_SPLIT_MAIN = r"""
#include <cstdio>
#include "prefill/pack_split.h"
int main() {
  long long ctas, capacity, resident;
  int requested;
  while (std::scanf("%lld %lld %lld %d", &ctas, &capacity, &resident, &requested) == 4) {
    const minipaged::PackSplitCount c = minipaged::pack_split_count(ctas, capacity, resident, requested, 32, 128, 256);
    std::printf("%d %d\n", c.splits, c.split_keys);
  }
}
"""


def test_pack_split_plan_arithmetic(tmp_path):
    """Every split the plan makes covers whole 32-key tiles, starts inside the table, and together
    they cover it; unforced plans fill the resident CTA slots at most once with >= 128 keys a
    split (the shapes of the H200 rows: 8 CTAs at B=1, 256 at B=32; 396 resident slots)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    # -x c++: the probe is plain C++ under the .cu name the helper gives it
    exe = _build_probe(tmp_path, "pack_split", _PACK_SPLIT_MAIN, cxx, "-x", "c++", "-O1")
    shapes = [(c, cap, res, req) for c in (1, 8, 104, 256, 512, 4096) for cap in (16, 33, 128, 4112, 32784, 131072)
              for res in (0, 396, 528) for req in (0, 1, 2, 3, 7, 64, 256, 1000)]
    out = _run_probe(exe, shapes)
    assert len(out) == len(shapes)
    for (ctas, cap, res, req), line in zip(shapes, out):
        splits, keys = map(int, line.split())
        what = f"ctas={ctas} capacity={cap} resident={res} requested={req}: {splits} x {keys}"
        if splits == 1:
            assert keys == 0, what
            continue
        assert 2 <= splits <= 256 and keys % 32 == 0 and keys > 0, what
        assert (splits - 1) * keys < cap <= splits * keys, what      # no empty split past the table
        if req > 0:
            assert splits <= req, what
        else:
            assert ctas * splits <= res and keys >= 128, what
    # the rows the H200 timed (3 resident 16-bit CTAs per SM x 132 SMs)
    want = {(8, 4112, 396, 0): (33, 128), (8, 32784, 396, 0): (49, 672), (256, 4112, 396, 0): (1, 0),
            (8, 32784, 396, 7): (7, 4704)}
    got = _run_probe(exe, want)
    assert len(got) == len(want)
    for shape, line in zip(want, got):
        assert tuple(map(int, line.split())) == want[shape], (shape, line)


def _torch_include_dirs():
    from torch.utils import cpp_extension

    return cpp_extension.include_paths()


def test_binding_parses_with_torch_headers(tmp_path):
    """binding.cpp against this machine's torch headers (syntax only: no CUDA torch needed to link)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    if NVCC is not None:
        cands.insert(0, str(Path(NVCC).resolve().parent.parent))
    cuda_inc = next((Path(c) / "include" for c in cands if c and (Path(c) / "include/cuda_runtime.h").exists()), None)
    if cuda_inc is None:
        pytest.skip("CUDA headers (cuda_runtime.h) not found")
    incs = _torch_include_dirs()
    if not any((Path(i) / "c10/cuda/CUDAGuard.h").exists() for i in incs):
        pytest.skip("this torch build ships no c10/cuda headers")
    # A CPU torch wheel ships c10/cuda headers but not the generated cmake
    # macros header they include; an empty stand-in is enough to parse.
    shim = tmp_path / "shim"
    if not any((Path(i) / "c10/cuda/impl/cuda_cmake_macros.h").exists() for i in incs):
        (shim / "c10/cuda/impl").mkdir(parents=True)
        (shim / "c10/cuda/impl/cuda_cmake_macros.h").write_text("#pragma once\n")
    std = "-std=c++20"
    cmd = [cxx, std, "-fsyntax-only", "-Wall", "-Werror=return-type", f"-I{shim}", f"-I{CSRC}", f"-I{cuda_inc}"]
    cmd += [f"-I{i}" for i in incs] + [str(CSRC / "binding.cpp")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_build_key_tracks_sources_and_flags(monkeypatch):
    pytest.importorskip("torch")
    k1 = build.build_key("90")
    assert build.build_key("90") == k1
    assert build.build_key("80") != k1  # the arch's gencode flag is part of the key
    monkeypatch.setenv("MINIPAGED_NVCC_FLAGS", "-DMINIPAGED_TEST_FLAG=1")
    assert build.build_key("90") != k1
    assert "-DMINIPAGED_TEST_FLAG=1" in build.nvcc_flags("90")
    assert "-gencode=arch=compute_90a,code=sm_90a" in build.nvcc_flags("90a")
    # the dispatcher picks the wgmma kernels only in an sm_90a build, told by this define
    assert "-DMINIPAGED_ENABLE_SM90A" in build.nvcc_flags("90a")
    assert "-DMINIPAGED_ENABLE_SM90A" not in build.nvcc_flags("90")


def test_ptxas_report_script_runs():
    script = Path(__file__).resolve().parents[1] / "scripts" / "ptxas_report.py"
    if not script.exists():
        pytest.skip("scripts/ptxas_report.py absent")
    if NVCC is None:
        pytest.skip("nvcc not found")
    env = dict(os.environ, PYTHONPATH=str(Path(build.__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, str(script), "--arch", "90", "cache/write_kv.cu"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"write_kv_kernel.*\s\d+\s", proc.stdout), proc.stdout


_BOUND_PROBE = r"""
#include <cstdio>
#include "params.h"
int main() {
  long long batch, total, max_q;
  while (std::scanf("%lld %lld %lld", &batch, &total, &max_q) == 3) {
    minipaged::PrefillParams p{};
    p.batch = static_cast<int>(batch);
    p.total_q = total;
    p.max_seqlen_q = static_cast<int>(max_q);
    std::printf("%lld\n", static_cast<long long>(minipaged::paged_min_seqlen_q(p)));
  }
  return 0;
}
"""


@needs_nvcc
def test_paged_min_seqlen_q_bounds_every_q_len(tmp_path):
    # The host skips the paged launches of row classes no sequence can be in (decode rows,
    # packed short runs) from this lower bound, so it must never exceed a real q_len. It must
    # be exact where the launches are skipped: a uniform batch and a single sequence.
    import random

    exe = _build_probe(tmp_path, "bound", _BOUND_PROBE, NVCC)
    rng = random.Random(7)
    batches = [[1], [0], [2048], [512] * 8, [4] * 32, [128] * 63, [2048] + [1] * 63, [1, 300, 16, 17, 4],
               [0, 0, 5], [17, 17, 16]]
    batches += [[rng.choice([0, 1, 2, 4, 16, 17, 97, 1023, 4096]) for _ in range(rng.randint(1, 40))]
                for _ in range(200)]
    rows = []
    for q_lens in batches:
        for extra in (0, 1, 1000):  # max_seqlen_q may exceed every real q_len
            rows.append((q_lens, max(q_lens) + extra))
    out = _run_probe(exe, [(len(q), sum(q), m) for q, m in rows])
    assert len(out) == len(rows)
    for (q_lens, max_q), got in zip(rows, map(int, out)):
        assert 0 <= got <= min(q_lens), (q_lens, max_q, got)
        if (max_q == max(q_lens) and len(set(q_lens)) == 1) or len(q_lens) == 1:
            assert got == min(q_lens), (q_lens, max_q, got)


# The decode split workspace with short query runs (params.h): decode_workspace_floats and
# decode_set_workspace against the layout the kernels index, partial row
# ((b * max_seqlen_q + i) * Hq + head) * num_splits + split of partial_o [.., D] then partial_lse;
# with a work list (wl = 1: batch x splits slots), its plan after them from a 16-byte boundary.
_WORKSPACE_PROBE = r"""
#include <cstdio>
#include "params.h"
int main() {
  int batch, hq, hkv, d, splits, max_q, wl;
  while (std::scanf("%d %d %d %d %d %d %d", &batch, &hq, &hkv, &d, &splits, &max_q, &wl) == 7) {
    minipaged::PrefillParams p{};
    p.batch = batch, p.num_q_heads = hq, p.num_kv_heads = hkv, p.head_dim = d, p.causal = true;
    minipaged::DecodeParams dp = max_q >= 2 ? minipaged::paged_spec_decode_params(p, 9, max_q)
                                            : minipaged::paged_decode_params(p, 9);
    dp.num_splits = splits;
    dp.worklist = wl ? batch * splits : 0;
    float* base = reinterpret_cast<float*>(4096);
    minipaged::decode_set_workspace(dp, base);
    const long long plan = dp.worklist_plan ? reinterpret_cast<float*>(dp.worklist_plan) - base : -1;
    std::printf("%d %lld %lld %lld %d %lld\n", minipaged::decode_query_rows(dp),
                static_cast<long long>(minipaged::decode_workspace_floats(dp)),
                static_cast<long long>(dp.partial_o - base), static_cast<long long>(dp.partial_lse - base),
                dp.max_seqlen_q == (max_q >= 2 ? max_q : 0) && dp.causal == (max_q >= 2), plan);
  }
  return 0;
}
"""


@needs_nvcc
def test_decode_workspace_layout_with_short_runs(tmp_path):
    exe = _build_probe(tmp_path, "workspace", _WORKSPACE_PROBE, NVCC)
    rows = [(b, hq, hkv, d, s, q, wl) for b in (1, 3, 64) for hq, hkv in ((16, 8), (32, 4), (8, 8)) for d in (64, 128)
            for s in (1, 2, 33, 256) for q in (0, 1, 2, 5, 16) for wl in (0, 1) if not wl or (q == 0 and s >= 3)]
    out = _run_probe(exe, rows)
    assert len(out) == len(rows)
    for (b, hq, hkv, d, s, q, wl), line in zip(rows, out):
        q_rows, floats, o_off, lse_off, fields_ok, plan = map(int, line.split())
        assert fields_ok == 1, (b, hq, q)
        want_rows = q if q >= 2 else 1
        partial_rows = b * want_rows * hq * s  # one per (sequence, query, head, split)
        assert q_rows == want_rows
        assert o_off == 0 and lse_off == partial_rows * d, (b, hq, d, s, q, lse_off)
        partials = 0 if s == 1 else partial_rows * (d + 1)
        if not wl:
            assert floats == partials and plan == -1, (b, hq, d, s, q, floats)
            continue
        # an int4 per slot (b x s of them) and an int2 per sequence, 16-byte aligned past the partials
        assert plan >= partials and plan % 4 == 0 and plan - partials < 4, (b, hq, d, s, plan)
        assert floats == plan + 4 * b * s + 2 * b, (b, hq, d, s, floats)


# Which speculative batches the tensor-core decode kernel takes (prefill/dispatch.cuh
# paged_spec_decode_ok), from the host-known values: "batch Hq Hkv D max_q total_q SMs fp8" in,
# 1 / 0 out.
_SPEC_ROUTE_PROBE = r"""
#include <cstdio>
#include "prefill/dispatch.cuh"
int main() {
  long long batch, hq, hkv, d, max_q, total_q, sms, fp8;
  while (std::scanf("%lld %lld %lld %lld %lld %lld %lld %lld", &batch, &hq, &hkv, &d, &max_q, &total_q, &sms,
                    &fp8) == 8) {
    static float scales[64];
    minipaged::PrefillParams p{};
    p.batch = batch, p.num_q_heads = hq, p.num_kv_heads = hkv, p.head_dim = d, p.max_seqlen_q = max_q;
    p.total_q = total_q, p.num_sms = sms, p.kv_fp8 = fp8 != 0, p.causal = true;
    if (fp8) p.k_scale = scales, p.v_scale = scales;
    std::printf("%d\n", minipaged::fast::paged_spec_decode_ok(p) ? 1 : 0);
  }
  return 0;
}
"""


# The decode's split arithmetic (decode/splits.h), host-compiled: one plan per stdin line
# ("capacity splits min_tokens align delta"), planned by decode_split_runs as the host plan does,
# its guess threshold then lowered by `delta` (a deliberately wrong plan, to show the check can
# fail). Every ctx in [0, capacity] is split by decode_seq_splits, the kernels' function, and by
# the rule written out again here without the guess; the first difference or broken invariant
# is printed, else "ok num_splits tokens_per_split split_guess_ctx".
_SPLITS_PROBE = r"""
#include <cstdio>
#include "decode/splits.h"
int main() {
  long long capacity, splits, min_tokens, align, delta;
  while (std::scanf("%lld %lld %lld %lld %lld", &capacity, &splits, &min_tokens, &align, &delta) == 5) {
    minipaged::DecodeParams p{};
    minipaged::decode_split_runs(p, capacity, splits, min_tokens, align);
    p.split_guess_ctx -= static_cast<int>(delta);
    const int cap = static_cast<int>(capacity);
    int bad_ctx = -1;
    const char* why = "";
    for (int ctx = 0; ctx <= cap && bad_ctx < 0; ++ctx) {
      const minipaged::SeqSplits got = minipaged::decode_seq_splits(p, ctx, cap);
      int n = (ctx + p.split_min_tokens - 1) / p.split_min_tokens;
      n = n < p.num_splits ? n : p.num_splits;
      n = n > 1 ? n : 1;
      const int run = n == 1 ? cap : ((ctx + n - 1) / n + p.split_align - 1) / p.split_align * p.split_align;
      if (got.count != n || got.run != run) why = "guess differs from the rule";
      else if (n > 1 && (long long)n * run < ctx) why = "runs do not cover ctx";
      else if (n > 1 && run % p.split_align != 0) why = "run not a multiple of split_align";
      else if ((long long)(n - 1) * run >= (cap > 0 ? cap : 1)) why = "a split starts past the table";
      else if (n > p.num_splits) why = "more splits than the grid";
      else continue;
      bad_ctx = ctx;
    }
    if (bad_ctx >= 0) std::printf("bad ctx=%d: %s\n", bad_ctx, why);
    else std::printf("ok %d %d %d\n", p.num_splits, p.tokens_per_split, p.split_guess_ctx);
  }
  return 0;
}
"""


@needs_nvcc
def test_decode_split_guess_matches_the_rule(tmp_path):
    # Past split_guess_ctx the kernels take the table-filling plan without dividing
    # (DecodeParams::split_guess_ctx): for every plan shape and every context length that must
    # be what the per-sequence rule gives, and the rule's runs must cover the context inside
    # the table. The threshold is also tight: one token lower and some context gets the wrong
    # split.
    exe = _build_probe(tmp_path, "splits", _SPLITS_PROBE, NVCC)
    plans = [(cap, s, t, a) for cap in (0, 1, 17, 97, 1023, 4096, 4097, 32768, 40960)
             for s in (1, 2, 3, 7, 32, 33, 64, 256)
             for t, a in ((128, 32), (128, 64), (256, 64), (256, 128), (4096, 64), (8192, 128), (64, 64))]
    out = _run_probe(exe, [(*plan, 0) for plan in plans])
    assert len(out) == len(plans)
    multi = 0
    for plan, line in zip(plans, out):
        assert line.startswith("ok "), (plan, line)
        num_splits, tokens_per_split, guess = map(int, line.split()[1:])
        assert 1 <= num_splits <= max(plan[1], 1) and (plan[0] == 0 or num_splits * tokens_per_split >= plan[0])
        multi += num_splits > 1
    assert multi > 100  # the sweep reaches split plans, not only one-split ones
    lowered = _run_probe(exe, [(*plan, 1) for plan in plans])
    tight = 0
    for plan, line, good in zip(plans, lowered, out):
        num_splits, _, guess = map(int, good.split()[1:])
        # (a one-split plan has no threshold; past the table's end one is never reached)
        if num_splits > 1 and guess <= plan[0]:
            assert line.startswith("bad "), (plan, line)
            tight += 1
    assert tight > 50


# Work-list splits (decode/splits.h: decode_worklist_run / decode_worklist_seq_splits; DecodeParams::
# worklist), as plain C++: one line per batch on stdin ("B slots capacity align min_tokens kind
# seed even"), the plan's run and each sequence's split count and run out.
_WORKLIST_PROBE = r"""
#include <cstdio>
#include <vector>
#include "decode/splits.h"
int main() {
  long long B, W, cap, align, min_tokens, kind, seed, even;
  while (std::scanf("%lld %lld %lld %lld %lld %lld %lld %lld", &B, &W, &cap, &align, &min_tokens, &kind, &seed,
                    &even) == 8) {
    std::vector<int> ctx(B);
    unsigned long long x = seed * 6364136223846793005ull + 1442695040888963407ull;
    for (long long b = 0; b < B; ++b) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      const long long r = static_cast<long long>((x >> 33) % static_cast<unsigned long long>(cap + 1));
      // 0: uniform; 1: one long sequence last among cap / 32; 2: random; 3: every cap / 32;
      // 4: random with zeros and full-table sequences mixed in
      ctx[b] = static_cast<int>(kind == 0 ? cap : kind == 1 ? (b == B - 1 ? cap : cap / 32)
                                : kind == 3 ? cap / 32 : kind == 4 ? (r % 3 == 0 ? 0 : r % 3 == 1 ? cap : r) : r);
    }
    minipaged::DecodeParams p{};
    p.batch = static_cast<int>(B);
    p.block_size = 1;
    p.max_blocks = static_cast<int>(cap);
    p.split_min_tokens = static_cast<int>(min_tokens);
    p.split_align = static_cast<int>(align);
    p.worklist = static_cast<int>(W);
    long long total = 0;
    for (int c : ctx) total += c;
    const long long t = minipaged::decode_worklist_run(p, total, 256);
    // the slot table as decode_worklist_plan_kernel writes it (first[], decode_worklist_owner,
    // pack), read back as the kernels do (unpack): every slot in use names its own split
    std::vector<int> first(B + 1, 0);
    std::vector<minipaged::SeqSplits> seq(B);
    for (long long b = 0; b < B; ++b) {
      seq[b] = minipaged::decode_worklist_seq_splits(ctx[b], t, align, even != 0);
      first[b + 1] = first[b] + seq[b].count;
    }
    const char* slots = "ok";
    for (int slot = 0; slot < W && B <= minipaged::kWorklistMaxBatch; ++slot) {
      minipaged::WorklistEntry e{-1, 0, 0, 0, 0, static_cast<int>(t)};
      if (slot < first[B]) {
        e.b = minipaged::decode_worklist_owner(first.data(), static_cast<int>(B), slot);
        e.first = first[e.b], e.split = slot - e.first, e.count = first[e.b + 1] - e.first, e.ctx = ctx[e.b];
        e.run = seq[e.b].run;
      }
      const minipaged::WorklistWords w = minipaged::decode_worklist_pack(e);
      const minipaged::WorklistEntry r = minipaged::decode_worklist_unpack(w.x, w.y, w.z, w.w);
      const bool in_use = slot < first[B];
      const bool own = r.b >= 0 && r.b < B && r.first == first[r.b] && r.first + r.split == slot &&
                       r.split < r.count && r.count == first[r.b + 1] - first[r.b] && r.ctx == ctx[r.b];
      const bool ok = in_use ? own && r.run == seq[r.b].run : r.b == -1 && r.count == 0 && r.run == t;
      if (!ok) slots = "BAD";
    }
    std::printf("%lld", t);
    for (long long b = 0; b < B; ++b) std::printf(" %d:%d:%d", ctx[b], seq[b].count, seq[b].run);
    std::printf(" slots:%s\n", slots);
  }
}
"""


@needs_nvcc
def test_decode_worklist_plan(tmp_path):
    # The work-list plan (DecodeParams::worklist, written by decode/worklist.cuh's one-CTA kernel)
    # must fit the grid's slots, cover every context in whole runs of the kernel's tile with no
    # empty split and no split past the table, never need more than one merge's 256 splits,
    # never cut a batch of equal lengths further than the per-sequence rule (n = ceil(ctx /
    # min_tokens)), and give a long sequence among short ones the short ones' idle slots: both
    # with each sequence spread evenly over its slots (the default: runs of at most t, none an
    # align step longer than ceil(ctx / n) needs) and with runs of the plan's t (variant bit
    # 0x8000); over B x S slots (the grid decode_plan launches) and over B + w slots (w a wave:
    # the bound total / (slots - B) at its tightest). The slot table the plan kernel writes (its owner
    # search and 9-bit packing, decode/splits.h) must read back every slot's own split.
    exe = _build_probe(tmp_path, "worklist", _WORKLIST_PROBE, NVCC)
    grids = [(s, None) for s in (2, 3, 4, 8, 33, 256)] + [(None, w) for w in (1, 66, 132)]
    rows = [(b, b * s if s else b + w, cap, align, mt, kind, seed, even)
            for b in (1, 2, 17, 64, 97, 256) for s, w in grids
            for cap, align, mt in ((32768, 128, 4096), (16384, 64, 4096), (4096, 32, 256), (97, 32, 128),
                                   (1023, 64, 8192), (262144, 128, 8192))
            for kind in range(5) for seed in (1, 2) for even in (0, 1)]
    out = _run_probe(exe, rows)
    assert len(out) == len(rows)
    one_long = {}
    for (b, slots, cap, align, mt, kind, seed, even), line in zip(rows, out):
        fields = line.split()
        t = int(fields[0])
        assert fields[-1] == "slots:ok", ("a slot entry does not read back", b, slots, cap, kind, seed)
        plan = [tuple(map(int, f.split(":"))) for f in fields[1:-1]]
        assert len(plan) == b
        assert t > 0 and t % align == 0, (rows, line)
        assert sum(n for _, n, _ in plan) <= slots, ("more splits than slots", b, slots, cap, kind, t)
        for ctx, n, run in plan:
            assert 1 <= n <= 256
            assert n <= max(1, -(-ctx // t)), ("more slots than runs of t need", ctx, n, t)
            if not even:
                assert run == t, ("a run other than the plan's", ctx, n, run, t)
            elif n > 1:
                assert 0 < run <= t and run % align == 0, ("a run longer than the plan's", ctx, n, run, t)
                assert run - align < -(-ctx // n), ("runs not spread evenly", ctx, n, run)
            assert n * run >= ctx, ("runs do not cover the context", ctx, n, run)
            assert ctx == 0 and n == 1 or (n - 1) * run < ctx, ("an empty split", ctx, n, run)
            assert (n - 1) * run < max(cap, 1), ("a split past the table", ctx, n, run)
            if kind == 0:
                assert n <= max(1, -(-ctx // mt)), ("equal lengths cut further than the rule", ctx, n, t, mt)
        if kind == 1 and b == 64 and slots in (128, 256, 64 + 66) and cap == 32768:
            long_n, short_n = plan[-1][1], plan[0][1]
            assert short_n == 1 and long_n >= 8, plan[-2:]  # 4 splits without the work list
            one_long[slots, seed, even] = long_n
    # the bench's one-long row (63 x 1k + one 32k), over 64 x 2 slots (decode_plan's least, where
    # the wave cap leaves 1-2 splits), 64 x 4 or 64 + 66: runs of the 1.5k mean length (a floor
    # of twice the mean, 3k runs and 11 splits, measured slower)
    assert one_long == {(w, seed, even): 22 for w in (128, 256, 130) for seed in (1, 2) for even in (0, 1)}, one_long


# decode_plan's work-list gate (decode/splits.h decode_worklist_splits), host code: one line
# per plan on stdin ("ctas slots splits capacity min_tokens"), the slots per sequence out.
_WORKLIST_GATE_PROBE = r"""
#include <cstdio>
#include "decode/splits.h"
int main() {
  long long ctas, slots, splits, capacity, min_tokens;
  while (std::scanf("%lld %lld %lld %lld %lld", &ctas, &slots, &splits, &capacity, &min_tokens) == 5)
    std::printf("%lld\n", static_cast<long long>(minipaged::decode_worklist_splits(ctas, slots, splits, capacity,
                                                                                   min_tokens)));
}
"""


@needs_nvcc
def test_decode_worklist_gate(tmp_path):
    # Which plain decode plans take a work list, and how many slots per sequence, on the shapes
    # the selftest and the bench time: 132 SMs, about 2 resident CTAs per SM of the G = 2
    # tensor-core kernel (264 slots), 16-bit D = 128 (a 2 MB split cap is 4096 tokens, FP8 8192).
    # Before c9baf75 the gate asked for 3+ splits after the wave cap, so the first three batches
    # below took none (the H100 selftest's "work list NOT TAKEN").
    exe = _build_probe(tmp_path, "worklist_gate", _WORKLIST_GATE_PROBE, NVCC)
    cases = [  # (CTAs, resident slots, splits after the wave cap, table tokens, split cap) -> slots per sequence
        ((128 * 16, 264, 1, 50016, 4096), 2),  # the selftest's work-list batch: one split after the cap
        ((128 * 8, 264, 2, 32768, 4096), 2),  # B=128 L=32k one long sequence
        ((256 * 8, 264, 1, 16384, 4096), 2),  # B=256 L=16k
        ((64 * 8, 264, 4, 32768, 4096), 4),  # B=64 L=32k: the cap's four kept
        ((32 * 8, 264, 8, 32768, 4096), 8),
        ((256 * 8, 264, 1, 16384, 8192), 0),  # FP8 at 16k: two caps wide
        ((64 * 8, 264, 2, 8192, 4096), 0),  # B=64 L=8k: two caps wide
        ((2048, 264, 1, 8193, 4096), 2),  # three caps by one token
        ((2048, 264, 1, 8192, 4096), 0),
        ((8 * 8, 264, 4, 32768, 4096), 0),  # within half a wave: per-sequence splits fill it
        ((132, 264, 4, 32768, 4096), 0),  # exactly half a wave
        ((133, 264, 4, 32768, 4096), 4),
        ((2048, 264, 1, 32768, 0), 0),  # (no cap: no plan to gate)
    ]
    out = _run_probe(exe, [shape for shape, _ in cases])
    assert [int(line) for line in out] == [want for _, want in cases], list(zip(cases, out))


# The split merge's rule (decode/splits.h decode_warp_merge_by_rule), host code: one line per
# launch on stdin ("merge rows, query heads, splits, SMs, work-list slots"), 1 for the warp merge.
_WARP_MERGE_RULE_PROBE = r"""
#include <cstdio>
#include "decode/splits.h"
int main() {
  long long rows;
  int heads, splits, sms, worklist;
  while (std::scanf("%lld %d %d %d %d", &rows, &heads, &splits, &sms, &worklist) == 5) {
    minipaged::DecodeParams p{};
    p.num_q_heads = heads, p.num_splits = splits, p.num_sms = sms, p.worklist = worklist;
    std::printf("%d\n", minipaged::decode_warp_merge_by_rule(p, rows) ? 1 : 0);
  }
}
"""


@needs_nvcc
def test_decode_warp_merge_rule(tmp_path):
    # Where the warp merge runs: its grid (rows x ceil(Hq / 8) CTAs) gives at least half the SMs
    # a CTA, rows have at most 4 splits, no work list. On 132 SMs with Qwen3-0.6B's 16 query heads
    # that is B >= 33; B=1 with 32 splits, slower as a warp merge
    # (bench/results/nvidia-h100/decode_warp_merge_e8e95bd/), keeps the CTA merge.
    exe = _build_probe(tmp_path, "warp_merge_rule", _WARP_MERGE_RULE_PROBE, NVCC)
    cases = [  # (merge rows, query heads, splits, SMs, work-list slots) -> warp merge
        ((1, 16, 32, 132, 0), 0),  # B=1 L=4k / 32k
        ((32, 16, 2, 132, 0), 0),  # 64 CTAs: under half of 132
        ((33, 16, 2, 132, 0), 1),  # 66 CTAs: exactly half
        ((64, 16, 2, 132, 0), 1),  # B=64 L=8k, the plan's 2 splits
        ((64, 16, 4, 132, 0), 1),
        ((64, 16, 5, 132, 0), 0),  # more than 4 splits per row
        ((256, 16, 2, 132, 0), 1),  # B=256 L=1k
        ((64, 16, 2, 132, 128), 0),  # a work list keeps its own merge
        ((9, 64, 2, 132, 0), 1),  # Qwen3-32B's 64 heads: 8 CTAs a row
        ((8, 64, 2, 132, 0), 0),
        ((10, 12, 3, 132, 0), 0),  # 12 heads: 2 CTAs a row, the second half empty
        ((160, 16, 3, 132, 0), 1),  # 10 short runs of up to 16 queries (test_paged_spec_kv_splits)
        ((29, 16, 2, 114, 0), 1),  # an H100 PCIe's 114 SMs: 58 CTAs
        ((28, 16, 2, 114, 0), 0),
        ((1, 16, 2, 0, 0), 1),  # (no SM count: one SM)
    ]
    out = _run_probe(exe, [shape for shape, _ in cases])
    assert [int(line) for line in out] == [want for _, want in cases], list(zip(cases, out))


# The FP8 short-ring rule (params.h decode_fp8_short_ring_wanted), host code: one line per call
# on stdin ("block size, variant"), 1 where the G = 2 FP8 tensor-core plan takes the 2-stage ring.
_SHORT_RING_PROBE = r"""
#include <cstdio>
#include "params.h"
int main() {
  int block_size, variant;
  while (std::scanf("%d %d", &block_size, &variant) == 2)
    std::printf("%d\n", minipaged::decode_fp8_short_ring_wanted(block_size, variant) ? 1 : 0);
}
"""


@needs_nvcc
@pytest.mark.parametrize("build_on", [False, True], ids=["default", "build-flag"])
def test_decode_fp8_short_ring_rule(tmp_path, build_on):
    # Off by default until its shuffled-page A/B (bench/results/nvidia-h100/decode_fp8_page_cause_f1ade67/):
    # bit 0x80000 turns it on for a call, MINIPAGED_DECODE_FP8_SHORT_RING=1 for a build (and the
    # bit then off); either way only over pages of 64+ tokens, where the 3-stage ring measured slower.
    # Other variant bits (the fused bit, a tiling, the two-warp bit) change nothing.
    flags = ["-DMINIPAGED_DECODE_FP8_SHORT_RING=1"] if build_on else []
    exe = _build_probe(tmp_path, "short_ring", _SHORT_RING_PROBE, NVCC, *flags)
    rows = [(bs, v) for bs in (1, 8, 16, 32, 64, 128, 256) for v in (0, 0x80000, 0x400, 0x80400, 0x20000, 0x80012)]
    out = _run_probe(exe, rows)
    want = [int(bs >= 64 and (build_on != bool(v & 0x80000))) for bs, v in rows]
    assert [int(line) for line in out] == want, list(zip(rows, out))


@needs_nvcc
def test_paged_spec_decode_route_rows(tmp_path):
    # Short runs of up to 32 (query, head) rows per KV head take the decode kernel (one MMA row
    # block to 16, two to 32); over FP8 pages runs of more than 16 rows only while the batch's
    # CTAs (B x Hkv) fit one wave of two per SM, the packed kernel beyond (the H200 A/B in
    # bench/results/nvidia-h200/cuda_spec_rows32_a48beea/). Uniform batches of q_len max_q.
    exe = _build_probe(tmp_path, "spec_route", _SPEC_ROUTE_PROBE, NVCC)
    rows = [(b, hq, hkv, d, q, b * q, sms, fp8) for b in (1, 32, 33, 64, 128) for hq, hkv in
            ((16, 8), (32, 8), (64, 8), (24, 8), (16, 1), (8, 8)) for d in (64, 128, 96) for q in (1, 2, 4, 8, 16, 17)
            for sms in (132, 0) for fp8 in (0, 1)]
    out = _run_probe(exe, rows)
    assert len(out) == len(rows)
    for (b, hq, hkv, d, q, total, sms, fp8), got in zip(rows, map(int, out)):
        g = hq // hkv
        rows_per_kv_head = min(q, 16) * g
        cap = 16 if fp8 and b * hkv > 2 * sms else 32
        want = g >= 2 and d in (64, 128) and 2 <= q <= 16 and rows_per_kv_head <= cap
        assert got == int(want), (b, hq, hkv, d, q, sms, fp8, got)


# --------------------------------------------------------------------------- build.load around the compiler
# CPU-only: torch's cpp_extension runs for real but its ninja step (and the library load) are stubbed, and
# CUDA_HOME points at a fake nvcc that only answers --version.


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """build.load() into a temporary cache with a stubbed compile step; the returned dict records the
    builds (`builds`), the libraries loaded (`loaded`) and how the next build ends (`fail`, `partial`);
    its `new_process()` forgets what this process built."""
    import torch
    from torch.utils import cpp_extension

    cuda_home = tmp_path / "cuda"
    (cuda_home / "bin").mkdir(parents=True)
    nvcc = cuda_home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 99.0'\n")
    nvcc.chmod(0o755)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(cuda_home))
    monkeypatch.delenv("PYTORCH_NVCC", raising=False)
    monkeypatch.delenv("MINIPAGED_NVCC_FLAGS", raising=False)
    monkeypatch.setenv("MINIPAGED_CACHE_DIR", str(tmp_path / "cache dir"))
    monkeypatch.setenv("MINIPAGED_CUDA_ARCH", "90a")
    state = {"builds": 0, "loaded": [], "fail": None, "partial": False}

    def new_process():
        # cpp_extension remembers every build of this process (by name) as build.load does
        monkeypatch.setattr(cpp_extension, "JIT_EXTENSION_VERSIONER", cpp_extension.ExtensionVersioner())
        monkeypatch.setattr(build, "_loaded", {})

    new_process()
    state["new_process"] = new_process

    def ninja_build(name, build_directory, **kw):
        state["builds"] += 1
        so = Path(build_directory) / f"{name}.so"
        so.write_bytes(b"\x7fELF" if state["partial"] else b"\x7fELF complete")
        if state["fail"]:
            raise state["fail"]

    def load_library(path):
        if not Path(path).exists():
            raise OSError(f"Could not load this library: {path}")
        assert Path(path).read_bytes().endswith(b"complete"), "loaded a half-written library"
        state["loaded"].append(path)

    monkeypatch.setattr(cpp_extension, "_write_ninja_file_and_build_library", ninja_build)
    monkeypatch.setattr(torch.ops, "load_library", load_library)
    return state


def test_failed_build_is_retried_with_the_compiler_error(fake_build):
    # A second call in the same process must build again, not load the library a failed build never made.
    fake_build["fail"] = RuntimeError("Error building extension: nvcc fatal   : Unknown option '--bogus'")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="Unknown option"):
            build.load()
    assert fake_build["builds"] == 2 and not fake_build["loaded"]
    fake_build["fail"] = None
    assert build.load() == fake_build["loaded"][0]


def test_stale_cpp_extension_lock_is_cleared(fake_build, monkeypatch):
    # A killed build leaves cpp_extension's baton file behind; its next build would wait on it forever.
    from torch.utils import cpp_extension

    def wait(self):
        raise AssertionError(f"waits forever on the stale {self.lock_file_path}")

    monkeypatch.setattr(cpp_extension.FileBaton, "wait", wait)
    directory = build.build_dir("90a")
    directory.mkdir(parents=True)
    (directory / "lock").touch()
    build.load()
    assert fake_build["builds"] == 1 and not (directory / "lock").exists()


def test_interrupted_rebuild_is_not_loaded(fake_build):
    build.load()
    lib = Path(fake_build["loaded"][0])
    fake_build["new_process"]()
    lib.unlink()  # the library went missing from a finished folder: rebuilt, and killed half-way
    fake_build["partial"], fake_build["fail"] = True, KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        build.load()
    fake_build["new_process"]()
    fake_build["partial"], fake_build["fail"] = False, None
    assert build.load() == str(lib)
    assert fake_build["builds"] == 3


def test_finished_cache_loads_without_the_lock(fake_build, monkeypatch):
    # a finished, read-only (shared, prebuilt) cache: the lock file cannot be created there
    import filelock

    path = build.load()
    fake_build["new_process"]()

    def no_lock(*a, **kw):
        raise PermissionError("read-only cache")

    monkeypatch.setattr(filelock, "FileLock", no_lock)
    assert build.load() == path and fake_build["builds"] == 1


def test_build_key_tracks_the_nvcc_version(fake_build, tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    key = build.build_key("90a")
    other = tmp_path / "cuda-other"
    (other / "bin").mkdir(parents=True)
    (other / "bin" / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 99.1'\n")
    (other / "bin" / "nvcc").chmod(0o755)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(other))
    assert build.build_key("90a") != key


def test_missing_build_nvcc_is_unavailable(fake_build, tmp_path, monkeypatch):
    # nvcc on PATH does not help: cpp_extension compiles with $CUDA_HOME/bin/nvcc
    from torch.utils import cpp_extension

    from minipaged.registry import BackendUnavailableError

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path / "nowhere"))
    with pytest.raises(BackendUnavailableError, match="nvcc not found at .*nowhere"):
        build.load()
    assert fake_build["builds"] == 0
