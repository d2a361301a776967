"""GPU tests of the `cuda` and `cuda-wmma` backends against minipaged.reference.

Run on the H200: `PYTHONPATH=src pytest -m gpu tests/test_cuda.py`.
Errors are bounded FlashAttention-style: the kernel's distance to an fp32
reference on the same (low-precision) inputs may be at most twice the distance
of the torch reference computed in the same low precision, plus a small floor.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from minipaged import reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def ops():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from minipaged.cuda import ops as cuda_ops

    return cuda_ops


def _bound(out, ref_lp, ref32, what):
    """|out - ref32| <= 2 |ref_lp - ref32| + floor, elementwise maximum; also no NaN."""
    assert out.shape == ref32.shape, (out.shape, ref32.shape)
    assert not torch.isnan(out).any(), f"{what}: NaN in output"
    err = (out.float() - ref32).abs().max().item()
    ref_err = (ref_lp.float() - ref32).abs().max().item()
    floor = 1e-3 if out.dtype == torch.bfloat16 else 2e-4
    assert err <= 2 * ref_err + floor, f"{what}: max err {err:.3e} vs low-precision reference {ref_err:.3e}"


# --------------------------------------------------------------------------- paged decode


def _paged_problem(B, Hq, Hkv, D, block_size, context_lens, dtype, seed=0, extra_blocks=3):
    """Random q and caches; pages shuffled; unused slots and table entries poisoned (NaN / -1)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    blocks_per_seq = [(int(n) + block_size - 1) // block_size for n in context_lens]
    max_blocks = max(blocks_per_seq + [1]) + 1  # a spare column of -1 too
    num_blocks = sum(blocks_per_seq) + extra_blocks
    k_cache = torch.full((num_blocks, block_size, Hkv, D), float("nan"), dtype=dtype, device=dev)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(num_blocks, generator=g, device=dev).cpu().to(torch.int32)
    table = torch.full((B, max_blocks), -1, dtype=torch.int32)
    blk_idx, off_idx = [], []
    nxt = 0
    for b, nb in enumerate(blocks_per_seq):
        table[b, :nb] = perm[nxt : nxt + nb]
        nxt += nb
        pos = torch.arange(int(context_lens[b]))
        blk_idx.append(table[b, pos // block_size].long())
        off_idx.append(pos % block_size)
    blk = torch.cat(blk_idx).to(dev) if blk_idx else torch.zeros(0, dtype=torch.long, device=dev)
    off = torch.cat(off_idx).to(dev) if off_idx else torch.zeros(0, dtype=torch.long, device=dev)
    n = blk.numel()
    k_cache[blk, off] = torch.randn(n, Hkv, D, generator=g, device=dev).to(dtype)
    v_cache[blk, off] = torch.randn(n, Hkv, D, generator=g, device=dev).to(dtype)
    q = torch.randn(B, Hq, D, generator=g, device=dev).to(dtype)
    lens = torch.tensor(list(context_lens), dtype=torch.int32, device=dev)
    return q, k_cache, v_cache, table.to(dev), lens


def _poison_allocator(numel):
    """Leave NaN in the caching allocator's free blocks so an output element the
    kernel forgets to write shows up as NaN."""
    junk = torch.full((max(int(numel), 1) * 2,), float("nan"), device="cuda")
    del junk


def _check_decode(ops, q, kc, vc, bt, lens, scale, what, **kw):
    _poison_allocator(q.numel())
    out = ops.decode(q, kc, vc, bt, lens, scale, **kw)
    ref32 = reference.decode(q.float(), kc.float(), vc.float(), bt, lens, scale)
    ref_lp = reference.decode(q, kc, vc, bt, lens, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    _bound(out, ref_lp, ref32, what)
    zero = lens == 0
    if zero.any():
        assert (out[zero] == 0).all(), f"{what}: context_len 0 must give exact zeros"
    return out


HEADS = [(7, 7), (16, 8), (12, 3), (6, 2), (16, 2), (24, 1)]  # GQA 1, 2, 4, 3, 8, 24


MMA = 10  # decode.cu tiling 10: the tensor-core kernel (decode_mma.cuh), any group size
SCALAR = 12  # decode.cu tiling 12: the scalar kernel's default tiling for any group size
NO_PDL = 0x200  # decode.cu kVariantNoPDL: plain launch of the split reduction


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("variant", [0, MMA, SCALAR], ids=["default", "mma", "scalar"])
def test_decode_matches_reference(ops, dtype, heads, D, block_size, variant):
    Hq, Hkv = heads
    lens = [0, 1, 17, 1023, 1500]
    q, kc, vc, bt, cl = _paged_problem(len(lens), Hq, Hkv, D, block_size, lens, dtype, seed=D + block_size)
    _check_decode(ops, q, kc, vc, bt, cl, 1.0 / math.sqrt(D), f"{dtype} {heads} D{D} bs{block_size} v{variant}",
                  variant=variant)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [1, 2, 7, 64, 256])
@pytest.mark.parametrize("variant", [0, MMA], ids=["default", "mma"])
def test_decode_forced_splits(ops, dtype, num_splits, variant):
    lens = [3000, 0, 1, 257, 2048]
    q, kc, vc, bt, cl = _paged_problem(len(lens), 16, 8, 128, 16, lens, dtype, seed=num_splits)
    _check_decode(ops, q, kc, vc, bt, cl, 0.0883, f"splits={num_splits} v{variant}", num_splits=num_splits,
                  variant=variant)


@pytest.mark.parametrize("variant", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, SCALAR, NO_PDL])
@pytest.mark.parametrize("B,L", [(1, 4097), (9, 333)])
def test_decode_variants(ops, variant, B, L):
    lens = [L - 7 * b for b in range(B)]
    q, kc, vc, bt, cl = _paged_problem(B, 16, 8, 128, 16, lens, torch.bfloat16, seed=variant)
    _check_decode(ops, q, kc, vc, bt, cl, 0.0883, f"variant {variant}", variant=variant)


@pytest.mark.parametrize("variant", [0, 7, 9, 10, 11, SCALAR])
@pytest.mark.parametrize("heads", [(32, 8), (40, 8), (64, 8), (128, 4)], ids=["G4", "G5", "G8", "G32"])
def test_decode_variants_large_groups(ops, variant, heads):
    lens = [4097, 0, 333, 16]
    q, kc, vc, bt, cl = _paged_problem(len(lens), heads[0], heads[1], 128, 16, lens, torch.float16, seed=variant)
    _check_decode(ops, q, kc, vc, bt, cl, 0.0883, f"{heads} variant {variant}", variant=variant)


def test_decode_long_single_sequence_splits(ops):
    # B=1 with a long context takes the split-KV path through the heuristic.
    q, kc, vc, bt, cl = _paged_problem(1, 16, 8, 128, 16, [20000], torch.bfloat16, seed=5)
    _check_decode(ops, q, kc, vc, bt, cl, 0.0883, "B=1 L=20000")


def test_decode_strided_inputs(ops):
    # q sliced out of a fused qkv projection and caches that are views of one
    # [num_blocks, 2, block_size, Hkv, D] tensor: strides are taken, not assumed.
    torch.manual_seed(3)
    B, Hq, Hkv, D, bs = 5, 16, 8, 128, 16
    lens = [40, 0, 129, 16, 5]
    q0, kc0, vc0, bt, cl = _paged_problem(B, Hq, Hkv, D, bs, lens, torch.float16, seed=11)
    qkv = torch.randn(B, Hq + 2 * Hkv, D, device="cuda", dtype=torch.float16)
    qkv[:, :Hq] = q0
    q = qkv[:, :Hq]
    kv = torch.stack([kc0, vc0], dim=1)
    kc, vc = kv[:, 0], kv[:, 1]
    assert not q.is_contiguous() and not kc.is_contiguous()
    out = _check_decode(ops, q, kc, vc, bt, cl, 0.07, "strided")
    assert torch.equal(out, ops.decode(q0, kc0, vc0, bt, cl, 0.07))


def test_decode_rejects_bad_input(ops):
    q, kc, vc, bt, cl = _paged_problem(2, 4, 2, 128, 16, [5, 9], torch.bfloat16)
    with pytest.raises(TypeError):
        ops.decode(q.float(), kc.float(), vc.float(), bt, cl, 0.1)
    q96 = torch.randn(2, 4, 96, device="cuda", dtype=torch.bfloat16)
    kc96 = torch.randn(kc.shape[0], 16, 2, 96, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head dim"):
        ops.decode(q96, kc96, kc96, bt, cl, 0.1)


_CPP_ERRORS_SCRIPT = textwrap.dedent(
    """
    import torch
    from minipaged.cuda import ops  # builds/loads the library
    raw = torch.ops.minipaged_cuda
    dev, bf = "cuda", torch.bfloat16
    bt = torch.zeros(2, 4, dtype=torch.int32, device=dev)
    cl = torch.tensor([5, 9], dtype=torch.int32, device=dev)
    kc = torch.randn(4, 16, 2, 128, device=dev, dtype=bf)
    cases = {
        "decode_fp32": lambda: raw.decode(torch.randn(2, 4, 128, device=dev), kc.float(), kc.float(), bt, cl, 0.1, 0, 0),
        "decode_d96": lambda: raw.decode(torch.randn(2, 4, 96, device=dev, dtype=bf),
                                         torch.randn(4, 16, 2, 96, device=dev, dtype=bf),
                                         torch.randn(4, 16, 2, 96, device=dev, dtype=bf), bt, cl, 0.1, 0, 0),
        "prefill_fast_d96": lambda: raw.prefill_fast(*[torch.randn(1, 2, 8, 96, device=dev, dtype=bf)] * 3, True, 0.1),
        "prefill_wmma_d96": lambda: raw.prefill_wmma(*[torch.randn(1, 2, 8, 96, device=dev, dtype=bf)] * 3, True, 0.1),
        "write_kv_int16": lambda: raw.write_kv_cache(kc[0], kc[0], kc, kc, torch.zeros(16, dtype=torch.int16, device=dev)),
    }
    for name, fn in cases.items():
        print("CASE", name, flush=True)
        try:
            fn()
            torch.cuda.synchronize()
            print("RESULT", name, "no-error", flush=True)
        except Exception as e:
            print("RESULT", name, type(e).__name__, str(e).splitlines()[0][:160], flush=True)
    # the context must still be usable
    print("ALIVE", float(torch.ones(3, device=dev).sum()), flush=True)
    """
)


def test_cpp_errors_raise_cleanly(ops, tmp_path):
    """Bad input that reaches the C++ layer raises the DESIGN exception type (in a
    subprocess: a native crash must fail this test, not the whole session)."""
    script = tmp_path / "cpp_errors.py"
    script.write_text(_CPP_ERRORS_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-X", "faulthandler", str(script)], capture_output=True, text=True,
                          env=env, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    want = {"decode_fp32": "TypeError", "decode_d96": "ValueError", "prefill_fast_d96": "RuntimeError",
            "prefill_wmma_d96": "RuntimeError", "write_kv_int16": "TypeError"}
    for name, exc in want.items():
        assert f"RESULT {name} {exc}" in log, log[-4000:]
    assert "launch_prefill_fast failed" in log and "launch_prefill_wmma failed" in log
    assert "ALIVE 3.0" in log


# --------------------------------------------------------------------------- write_kv_cache


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "strided", "misaligned"])
def test_write_kv_cache(ops, dtype, block_size, index_dtype, layout):
    torch.manual_seed(block_size)
    T, Hkv, D = 97, 3, 128
    num_blocks = (2 * T + block_size - 1) // block_size + 2
    kc = torch.full((num_blocks, block_size, Hkv, D), float("nan"), dtype=dtype, device="cuda")
    vc = torch.full_like(kc, float("nan"))
    if layout == "contiguous":
        k = torch.randn(T, Hkv, D, device="cuda").to(dtype)
        v = torch.randn(T, Hkv, D, device="cuda").to(dtype)
    elif layout == "strided":  # k, v as slices of a fused [T, Hq + 2 Hkv, D] projection
        qkv = torch.randn(T, 5 + 2 * Hkv, D, device="cuda").to(dtype)
        k, v = qkv[:, 5 : 5 + Hkv], qkv[:, 5 + Hkv :]
    else:  # rows start 2 bytes off 16-byte alignment: the element-wise path
        big = torch.randn(T, Hkv, D + 1, device="cuda").to(dtype)
        k, v = big[:, :, 1:], big[:, :, :-1]
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:T].to(index_dtype)
    slots[::5] = -1  # skipped tokens
    ref_k, ref_v = kc.clone(), vc.clone()
    reference.write_kv_cache(k, v, ref_k, ref_v, slots)
    assert ops.write_kv_cache(k, v, kc, vc, slots) is None
    # NaN == NaN compare: untouched slots must still be NaN, written ones exact.
    assert torch.equal(kc.isnan(), ref_k.isnan()) and torch.equal(vc.isnan(), ref_v.isnan())
    written = ~ref_k.isnan()
    assert torch.equal(kc[written], ref_k[written]) and torch.equal(vc[written], ref_v[written])


def test_write_kv_cache_empty_and_all_skipped(ops):
    kc = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    k = torch.randn(0, 2, 64, device="cuda", dtype=torch.bfloat16)
    ops.write_kv_cache(k, k, kc, vc, torch.zeros(0, dtype=torch.int64, device="cuda"))
    k = torch.randn(5, 2, 64, device="cuda", dtype=torch.bfloat16)
    ops.write_kv_cache(k, k, kc, vc, torch.full((5,), -1, dtype=torch.int64, device="cuda"))
    assert (kc == 0).all() and (vc == 0).all()


# --------------------------------------------------------------------------- prefill

PREFILL_KINDS = ["fast", "wmma"]
PREFILL_SHAPES = [(1, 1), (17, 17), (97, 200), (200, 97), (129, 1023), (1023, 1023)]


def _prefill_fn(ops, kind, varlen=False):
    if varlen:
        return ops.prefill_varlen if kind == "fast" else ops.prefill_varlen_wmma
    return ops.prefill if kind == "fast" else ops.prefill_wmma


@pytest.mark.parametrize("kind", PREFILL_KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (8, 4), (8, 2), (16, 2)], ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("nq,nk", PREFILL_SHAPES)
def test_prefill_dense(ops, kind, dtype, heads, D, causal, nq, nk):
    Hq, Hkv = heads
    if nq * nk > 200 * 200 and (Hq, D) != (16, 128):
        pytest.skip("large shapes only for the Qwen3 head layout (keeps the suite short)")
    torch.manual_seed(nq + nk + D)
    B = 2
    q = torch.randn(B, Hq, nq, D, device="cuda").to(dtype)
    k = torch.randn(B, Hkv, nk, D, device="cuda").to(dtype)
    v = torch.randn(B, Hkv, nk, D, device="cuda").to(dtype)
    scale = 1 / math.sqrt(D)
    _poison_allocator(q.numel())
    out = _prefill_fn(ops, kind)(q, k, v, causal, scale)
    ref32 = reference.prefill(q.float(), k.float(), v.float(), causal, scale)
    ref_lp = reference.prefill(q, k, v, causal, scale)
    _bound(out, ref_lp, ref32, f"prefill {kind} {dtype} {heads} D{D} causal={causal} {nq}x{nk}")
    if causal and nq > nk:  # rows that see no key
        assert (out[:, :, : nq - nk] == 0).all()


@pytest.mark.parametrize("kind", PREFILL_KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_dense_strided(ops, kind, dtype):
    # q, k, v as [B, N, H, D] tensors transposed to [B, H, N, D] (no copy).
    torch.manual_seed(7)
    B, N, Hq, Hkv, D = 2, 77, 8, 2, 128
    q = torch.randn(B, N, Hq, D, device="cuda").to(dtype).transpose(1, 2)
    k = torch.randn(B, N, Hkv, D, device="cuda").to(dtype).transpose(1, 2)
    v = torch.randn(B, N, Hkv, D, device="cuda").to(dtype).transpose(1, 2)
    out = _prefill_fn(ops, kind)(q, k, v, True, 0.1)
    _bound(out, reference.prefill(q, k, v, True, 0.1),
           reference.prefill(q.float(), k.float(), v.float(), True, 0.1), f"strided {kind}")


@pytest.mark.parametrize("kind", PREFILL_KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("D", [64, 128])
def test_prefill_varlen(ops, kind, dtype, causal, D):
    torch.manual_seed(D)
    seq_q = [17, 0, 1, 300, 64, 5]
    seq_k = [17, 0, 40, 300, 1000, 3]  # Nq < Nk (chunked prefill) and Nq > Nk (empty rows)
    Hq, Hkv = 16, 8
    cu_q = torch.tensor([0] + list(torch.tensor(seq_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(seq_k).cumsum(0)), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(seq_q), Hq, D, device="cuda").to(dtype)
    k = torch.randn(sum(seq_k), Hkv, D, device="cuda").to(dtype)
    v = torch.randn(sum(seq_k), Hkv, D, device="cuda").to(dtype)
    _poison_allocator(q.numel())
    args = (cu_q, cu_k, max(seq_q), max(seq_k), causal, 1 / math.sqrt(D))
    out = _prefill_fn(ops, kind, varlen=True)(q, k, v, *args)
    ref32 = reference.prefill_varlen(q.float(), k.float(), v.float(), *args)
    ref_lp = reference.prefill_varlen(q, k, v, *args)
    _bound(out, ref_lp, ref32, f"varlen {kind} {dtype} causal={causal} D{D}")


# --------------------------------------------------------------------------- determinism


def _repeat_identical(fn, n=20):
    first = fn()
    for _ in range(n - 1):
        again = fn()
        assert torch.equal(first, again), "output changed between identical runs"


@pytest.mark.parametrize("B,L", [(1, 9000), (33, 700)])  # split-KV path, single-pass path
@pytest.mark.parametrize("heads", [(16, 8), (64, 8)], ids=["G2", "G8"])
def test_decode_bitwise_deterministic(ops, B, L, heads):
    lens = [L - b for b in range(B)]
    q, kc, vc, bt, cl = _paged_problem(B, heads[0], heads[1], 128, 16, lens, torch.bfloat16, seed=1)
    _repeat_identical(lambda: ops.decode(q, kc, vc, bt, cl, 0.0883))


@pytest.mark.parametrize("kind", PREFILL_KINDS)
def test_prefill_bitwise_deterministic(ops, kind):
    torch.manual_seed(0)
    q = torch.randn(2, 16, 333, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 8, 333, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    _repeat_identical(lambda: _prefill_fn(ops, kind)(q, k, v, True, 0.0883))
    cu = torch.tensor([0, 100, 333], dtype=torch.int32, device="cuda")
    qv, kv, vv = q[0].transpose(0, 1).contiguous(), k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()
    _repeat_identical(lambda: _prefill_fn(ops, kind, True)(qv, kv, vv, cu, cu, 233, 233, True, 0.0883))


def test_write_kv_cache_bitwise_deterministic(ops):
    torch.manual_seed(0)
    k = torch.randn(300, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(64 * 16, device="cuda")[:300]

    def run():
        kc = torch.zeros(64, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        ops.write_kv_cache(k, v, kc, vc, slots)
        return torch.cat([kc, vc])

    _repeat_identical(run)


# --------------------------------------------------------------------------- compile / graphs


def test_torch_compile_fullgraph(ops):
    torch._dynamo.reset()
    q, kc, vc, bt, cl = _paged_problem(3, 16, 8, 128, 16, [100, 0, 2000], torch.bfloat16, seed=9)
    k_new = torch.randn(3, 8, 128, device="cuda", dtype=torch.bfloat16)
    # write a new token into each sequence's first unused slot of its last page
    slots = torch.tensor([-1, -1, -1], dtype=torch.int64, device="cuda")

    def step(q, kc, vc, bt, cl, k_new, slots):
        ops.write_kv_cache(k_new, k_new, kc, vc, slots)
        return ops.decode(q, kc, vc, bt, cl, 0.0883) * 2

    eager = step(q, kc, vc, bt, cl, k_new, slots)
    compiled = torch.compile(step, fullgraph=True)
    out = compiled(q, kc, vc, bt, cl, k_new, slots)
    assert torch.equal(out, eager)
    # the mutation must survive functionalization: write real slots through the compiled graph
    kc2, vc2 = kc.clone(), vc.clone()
    real = torch.tensor([int(bt[0, 0]) * 16 + 4, -1, -1], dtype=torch.int64, device="cuda")
    compiled(q, kc2, vc2, bt, cl, k_new, real)
    blk, off = divmod(int(real[0]), 16)
    assert torch.equal(kc2[blk, off], k_new[0])


def test_cuda_graph_capture_replay(ops):
    q, kc, vc, bt, cl = _paged_problem(4, 16, 8, 128, 16, [1, 500, 3000, 64], torch.bfloat16, seed=2)
    for splits in (0, 1):  # heuristic (split-KV here) and single pass
        static_q = q.clone()
        static_cl = cl.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up on the side stream, as torch recommends
                ops.decode(static_q, kc, vc, bt, static_cl, 0.0883, num_splits=splits)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = ops.decode(static_q, kc, vc, bt, static_cl, 0.0883, num_splits=splits)
        for trial in range(3):
            static_q.copy_(torch.randn_like(q))
            static_cl.copy_(torch.tensor([1 + trial, 500 - trial, 3000 - 7 * trial, 0], dtype=torch.int32))
            graph.replay()
            torch.cuda.synchronize()
            eager = ops.decode(static_q, kc, vc, bt, static_cl, 0.0883, num_splits=splits)
            assert torch.equal(static_out, eager)
            assert (static_out[3] == 0).all()


@pytest.mark.parametrize("splits", [0, 3, 256])
def test_decode_pdl_launch_is_bitwise_plain_launch(ops, splits):
    # The reduction launched early (programmatic dependent launch) must read
    # the same, complete partials as one launched after the split kernel.
    q, kc, vc, bt, cl = _paged_problem(2, 16, 8, 128, 16, [9000, 1], torch.bfloat16, seed=11)
    a = _check_decode(ops, q, kc, vc, bt, cl, 0.0883, f"PDL splits={splits}", num_splits=splits)
    b = ops.decode(q, kc, vc, bt, cl, 0.0883, num_splits=splits, variant=NO_PDL)
    assert torch.equal(a, b)


def test_public_api_backends(ops):
    import minipaged as mp

    q, kc, vc, bt, cl = _paged_problem(3, 16, 8, 128, 16, [5, 0, 300], torch.bfloat16, seed=4)
    ref = reference.decode(q, kc, vc, bt, cl, 1 / math.sqrt(128))
    for backend in ("cuda", "cuda-wmma"):
        out = mp.decode_attention(q, kc, vc, bt, cl, backend=backend)
        assert (out.float() - ref.float()).abs().max().item() < 3e-2


# --------------------------------------------------------------------------- compute-sanitizer

_SANITIZE_SCRIPT = textwrap.dedent(
    """
    import torch
    from minipaged.cuda import ops
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    which = __import__("sys").argv[1].split(",")
    if "decode" in which:
        for B, Hq, Hkv, D, bs, L, splits in [(2, 4, 2, 128, 16, 37, 0), (1, 16, 2, 64, 1, 300, 3),
                                             (3, 8, 8, 128, 256, 513, 0), (2, 16, 2, 128, 16, 100, 0)]:
            nb = B * ((L + bs - 1) // bs) + 1
            kc = torch.randn(nb, bs, Hkv, D, device=dev, dtype=dt)
            vc = torch.randn_like(kc)
            bt = torch.randperm(nb, device=dev)[: B * ((L + bs - 1) // bs)].view(B, -1).int()
            cl = torch.tensor([L - i for i in range(B)], dtype=torch.int32, device=dev)
            q = torch.randn(B, Hq, D, device=dev, dtype=dt)
            ops.decode(q, kc, vc, bt, cl, 0.1, num_splits=splits)
            if (Hq // Hkv, D) in ((2, 128), (8, 128)):
                for variant in (1, 3, 4, 5, 6, 7, 8, 9, 12, 0x200):  # other tilings; plain reduce launch
                    ops.decode(q, kc, vc, bt, cl, 0.1, num_splits=2, variant=variant)
            for variant in (10, 11):  # the tensor-core kernel, every shape
                for splits in (0, 2):
                    ops.decode(q, kc, vc, bt, cl, 0.1, num_splits=splits, variant=variant)
    if "write_kv" in which:
        for T, Hkv, D, bs in [(13, 2, 128, 16), (5, 3, 64, 1)]:
            kc = torch.zeros(8, bs, Hkv, D, device=dev, dtype=dt)
            vc = torch.zeros_like(kc)
            k = torch.randn(T, Hkv, D, device=dev, dtype=dt)
            slots = torch.randperm(8 * bs, device=dev)[:T]
            slots[0] = -1
            ops.write_kv_cache(k, k, kc, vc, slots)
            big = torch.randn(T, Hkv, D + 1, device=dev, dtype=dt)
            ops.write_kv_cache(big[..., 1:], big[..., :-1], kc, vc, slots.int())
    for kind in ("fast", "wmma"):
        if "prefill_" + kind not in which:
            continue
        dense = ops.prefill if kind == "fast" else ops.prefill_wmma
        var = ops.prefill_varlen if kind == "fast" else ops.prefill_varlen_wmma
        for nq, nk, D in [(17, 17, 128), (33, 70, 64), (40, 9, 128)]:
            q = torch.randn(1, 4, nq, D, device=dev, dtype=dt)
            k = torch.randn(1, 2, nk, D, device=dev, dtype=dt)
            dense(q, k, k, True, 0.1)
        cu = torch.tensor([0, 5, 5, 40], dtype=torch.int32, device=dev)
        q = torch.randn(40, 4, 128, device=dev, dtype=dt)
        k = torch.randn(40, 2, 128, device=dev, dtype=dt)
        var(q, k, k, cu, cu, 35, 35, True, 0.1)
    torch.cuda.synchronize()
    print("sanitize script done")
    """
)


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer(ops, tmp_path, tool):
    # one process per tool (torch start-up under the sanitizer is the slow part);
    # decode and write_kv run first so a prefill failure cannot hide theirs.
    kernels = "decode,write_kv,prefill_fast,prefill_wmma"
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
            cand = home and os.path.join(home, "bin", "compute-sanitizer")
            if cand and os.path.exists(cand):
                sanitizer = cand
    if sanitizer is None:
        pytest.skip("compute-sanitizer not found")
    script = tmp_path / "sanitize.py"
    script.write_text(_SANITIZE_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sanitizer, "--tool", tool, sys.executable, str(script), kernels]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    log = proc.stdout + proc.stderr
    assert "sanitize script done" in log, log[-4000:]
    # memcheck ends with "ERROR SUMMARY: 0 errors", racecheck with
    # "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
    clean = "ERROR SUMMARY: 0 errors" in log or "0 hazards displayed (0 errors, 0 warnings)" in log
    assert clean and proc.returncode == 0, log[-4000:]
