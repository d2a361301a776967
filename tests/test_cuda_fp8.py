"""FP8 (float8_e4m3fn) KV caches in the hand-written CUDA kernels (minipaged.cuda.ops):
write_kv_cache quantisation, the scalar and tensor-core decode kernels and the paged
(prefill mainloop) kernels, called directly with float32 [Hkv] scales.

Quantisation is compared byte for byte with torch's own cast of the clamped quotient,
torch.clamp(x.float() / s, -448, 448).to(torch.float8_e4m3fn).

Attention is compared with an fp64 oracle written here on the SAME fp8 cache,
dequantised exactly (k = k_cache.double() * k_scale[h]), so quantisation error is never
blamed on a kernel. Bound: within twice the error of the same attention in plain
PyTorch at q's precision (K/V rounded to q's dtype, matmuls in it, fp32 softmax), plus
a small floor. Unused cache slots hold fp8 NaN bytes (0x7F / 0xFF, random sign) and
block-table entries past a sequence's pages are -1.

CPU (CI): the quantiser's software path (ptx/fp8.cuh, the sm_80 build) compiled for the
host and compared with torch on rounding edges and random bit patterns, and the FP8
tile layouts (permutations, bank conflicts) checked from the same header.
GPU: `pytest -m gpu tests/test_cuda_fp8.py` (builds the extension once).
"""

from __future__ import annotations

import ctypes
import math
import re
import shutil
import subprocess

import pytest
import torch

from fp8_problem import FP8, check as _check, e4m3_finite_values, fp8_problem, special_values, torch_quant
from minipaged.cuda import build

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ----------------------------------------------------------------- quantisation truth


def _assert_same_bytes(got: torch.Tensor, want: torch.Tensor, what: str, src=None):
    """uint8 tensors; the two NaN codes (sign) are accepted for each other."""
    got, want = got.cpu(), want.cpu()
    nan_want = (want & 0x7F) == 0x7F
    assert torch.equal((got & 0x7F) == 0x7F, nan_want), f"{what}: NaN pattern differs"
    diff = (got != want) & ~nan_want
    if diff.any():
        i = tuple(diff.nonzero()[0].tolist())
        x = "" if src is None else f" x={src.cpu()[i].item()!r}"
        raise AssertionError(f"{what}: {int(diff.sum())} bytes differ, first at {i}:{x} "
                             f"got 0x{int(got[i]):02x} want 0x{int(want[i]):02x}")


# ----------------------------------------------------------------- CPU: the header on the host

_HOST_SRC = r"""
#include "ptx/fp8.cuh"
using namespace minipaged;
extern "C" void quant(const float* x, const float* s, unsigned char* out, long n) {
  for (long i = 0; i < n; ++i) out[i] = fp8_e4m3_from_float_soft(x[i] / s[i]);
}
extern "C" unsigned k_off(int d, int row, int chunk) { return d == 128 ? fp8_tile_k_off<128>(row, chunk) : fp8_tile_k_off<64>(row, chunk); }
extern "C" unsigned v_off(int d, int row, int chunk) { return d == 128 ? fp8_tile_v_off<128>(row, chunk) : fp8_tile_v_off<64>(row, chunk); }
extern "C" int o_dim(int d, int dt, int n) { return d == 128 ? fp8_o_dim<128>(dt, n) : fp8_o_dim<64>(dt, n); }
extern "C" int q_chunk(int kk, int t) { int c, b; fp8_q_chunk(kk, t, c, b); return c * 16 + b; }
"""


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    d = tmp_path_factory.mktemp("fp8host")
    (d / "fp8host.cpp").write_text(_HOST_SRC)
    so = d / "fp8host.so"
    proc = subprocess.run([cxx, "-std=c++17", "-O2", "-shared", "-fPIC", f"-I{build.CSRC}", str(d / "fp8host.cpp"),
                           "-o", str(so)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lib = ctypes.CDLL(str(so))
    for f in (lib.k_off, lib.v_off):
        f.restype = ctypes.c_uint
    return lib


def _host_quant(lib, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    x, s = x.float().contiguous(), s.float().expand_as(x).contiguous()
    out = torch.empty(x.shape, dtype=torch.uint8)
    lib.quant(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(s.data_ptr()), ctypes.c_void_p(out.data_ptr()),
              ctypes.c_long(x.numel()))
    return out


@pytest.mark.parametrize("scale", [1.0, 0.25, 2.0 ** 20, 3.0, 0.3])
def test_soft_quantiser_matches_torch_on_edges(host_lib, scale):
    x = special_values() * scale
    s = torch.tensor(scale, dtype=torch.float32)
    want = torch.clamp(x / s, -448, 448).to(FP8).view(torch.uint8)
    _assert_same_bytes(_host_quant(host_lib, x, s), want, f"edges x{scale}", x)


def test_soft_quantiser_matches_torch_on_random_bits(host_lib):
    """Random fp32 bit patterns (every exponent, NaN and inf included) and random scales."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2 ** 31, 2 ** 31, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    for s in (torch.ones(()), torch.rand(x.shape, generator=g) * 5 + 1e-3):
        want = torch.clamp(x / s, -448, 448).to(FP8).view(torch.uint8)
        _assert_same_bytes(_host_quant(host_lib, x, s), want, "random bits", x)


def test_soft_quantiser_check_can_fail(host_lib):
    x = torch.tensor([1.0625, 3.0])  # 1.0625 is the tie between 1.0 and 1.125: even -> 1.0
    wrong = torch.clamp(x * 1.0001, -448, 448).to(FP8).view(torch.uint8)
    with pytest.raises(AssertionError):
        _assert_same_bytes(_host_quant(host_lib, x, torch.ones(())), wrong, "control")


@pytest.mark.parametrize("D", [64, 128])
def test_fp8_tile_layouts(host_lib, D):
    """The layouts the FP8 MMA paths rely on (ptx/fp8.cuh): the tile swizzles are
    bijections onto the tile; the K reads of a quarter warp (rows g, g+8 of two key
    groups, chunk t of a 64-dim block, 16 bytes) and the V reads (rows 2t + c, D/8 bytes
    at g*D/8) hit distinct banks (V at D = 64: at most 2-way); Q's permuted chunks
    address the same dims as K's words; O's dim permutation is a bijection."""
    rows, chunks = 64, D // 16
    for off in (host_lib.k_off, host_lib.v_off):
        offs = {off(D, r, c) for r in range(rows) for c in range(chunks)}
        assert offs == {16 * i for i in range(rows * chunks)}, "swizzle is not a bijection"

    def conflicts(addrs, width):
        # shared memory serves 128 bytes per wavefront: accesses of `width` bytes
        # from 128 // width lanes go together; count the worst bank multiplicity
        per = 128 // width
        worst = 1
        for i in range(0, 32, per):
            words = {}
            for a in addrs[i:i + per]:
                for b in range(a // 4, (a + width) // 4):
                    words.setdefault(b % 32, set()).add(b)
            worst = max(worst, max(len(v) for v in words.values()))
        return worst

    for blk in range(D // 64):
        for key0 in range(0, 64, 8):
            addrs = [host_lib.k_off(D, key0 + lane // 4, blk * 4 + lane % 4) for lane in range(32)]
            assert conflicts(addrs, 16) == 1, f"K reads conflict (D={D}, block {blk}, keys {key0})"
    for row0 in (0, 16, 32, 48):
        for r in range(4):
            addrs = []
            for lane in range(32):
                g, t = lane // 4, lane % 4
                row = row0 + 2 * t + (r & 1) + (r >> 1) * 8
                if D == 128:
                    addrs.append(host_lib.v_off(D, row, g))
                else:
                    addrs.append(host_lib.v_off(D, row, g >> 1) + (g & 1) * 8)
            assert conflicts(addrs, D // 8) <= (1 if D == 128 else 2), f"V reads conflict (D={D}, slot {r})"
    # the k order: dims of K word j of chunk (4 blk + t) == dims of Q's permuted chunk
    seen = []
    for kk in range(D // 16):
        blk, j = kk // 4, kk % 4
        for t in range(4):
            k_dims = [64 * blk + 16 * t + 4 * j + e for e in range(4)]
            cb = host_lib.q_chunk(kk, t)
            q_dims = [(cb // 16) * 8 + (cb % 16) // 2 + e for e in range(4)]
            assert k_dims == q_dims, (kk, t, k_dims, q_dims)
            seen += k_dims
    assert sorted(seen) == list(range(D))
    assert sorted(host_lib.o_dim(D, dt, n) for dt in range(D // 8) for n in range(8)) == list(range(D))


# ----------------------------------------------------------------- GPU problems


def _ops():
    from minipaged.cuda import ops

    return ops


def _fp8_problem(q_lens, ctxs, Hq, Hkv, D, page, dtype, seed=0, scales="per-head", writer="torch"):
    """fp8_problem on the GPU; writer "cuda": the cache is written by the CUDA quantiser
    (and checked byte for byte against torch's cast)."""
    if writer not in ("torch", "cuda"):
        raise ValueError(f"writer={writer!r}: must be 'torch' or 'cuda'")
    return fp8_problem(q_lens, ctxs, Hq, Hkv, D, page, dtype, seed, scales, device="cuda",
                       write_kv=_ops().write_kv_cache if writer == "cuda" else None)


CTXS = [0, 1, 17, 97, 1023, 4097]
HEADS = [(8, 8), (8, 4), (8, 2), (16, 2)]  # GQA 1, 2, 4, 8
DTYPES = [torch.float16, torch.bfloat16]


def _run_decode(ctxs, Hq, Hkv, D, page, dtype, seed=0, scales="per-head", writer="torch", **kw):
    q, kc, vc, tables, cu, ctx, ks, vs, dk, dv = _fp8_problem([1] * len(ctxs), ctxs, Hq, Hkv, D, page, dtype,
                                                              seed, scales, writer)
    scale = 1.0 / math.sqrt(D)
    ops = _ops()
    out, lse = ops.decode(q, kc, vc, tables, ctx, scale, True, ks, vs, **kw)
    plain = ops.decode(q, kc, vc, tables, ctx, scale, False, ks, vs, **kw)
    assert torch.equal(plain, out), "o depends on return_lse"
    _check(out, lse, q, dk, dv, cu, False, scale,
           f"fp8 decode ctx{ctxs} H{Hq}/{Hkv} D{D} p{page} {dtype} {scales} {writer} {kw}")
    return out, lse, (q, kc, vc, tables, cu, ctx, ks, vs, dk, dv)


def _run_paged(q_lens, ctxs, Hq, Hkv, D, page, dtype, causal=True, seed=0, scales="per-head", **kw):
    q, kc, vc, tables, cu, ctx, ks, vs, dk, dv = _fp8_problem(q_lens, ctxs, Hq, Hkv, D, page, dtype, seed, scales)
    scale = 1.0 / math.sqrt(D)
    ops = _ops()
    out, lse = ops.paged(q, kc, vc, tables, cu, ctx, max(q_lens + [0]), causal, scale, True, ks, vs, **kw)
    plain = ops.paged(q, kc, vc, tables, cu, ctx, max(q_lens + [0]), causal, scale, False, ks, vs, **kw)
    assert torch.equal(plain, out), "o depends on return_lse"
    _check(out, lse, q, dk, dv, cu, causal, scale,
           f"fp8 paged q{q_lens} ctx{ctxs} H{Hq}/{Hkv} D{D} p{page} {dtype} causal={causal} {scales} {kw}")
    return out, lse, (q, kc, vc, tables, cu, ctx, ks, vs, dk, dv)


# ----------------------------------------------------------------- GPU: write_kv_cache


def _write_and_compare(x, k_scale, v_scale, page, what, slot_dtype=torch.int32):
    """x [T, H, D] as K and -x/3 as V into NaN-byte caches at shuffled slots (some -1)."""
    T, H, D = x.shape
    g = torch.Generator().manual_seed(T)
    num_blocks = -(-(T + 5) // page) + 1
    kc = torch.full((num_blocks, page, H, D), 0x7F, dtype=torch.uint8).view(FP8).cuda()
    vc = kc.clone()
    slots = torch.randperm(num_blocks * page, generator=g)[:T]
    pad = torch.rand(T, generator=g) < 0.1
    slots[pad] = -1
    v = (-x / 3).to(x.dtype)
    x, v = x.cuda(), v.cuda()
    ks, vs = k_scale.cuda(), v_scale.cuda()
    _ops().write_kv_cache(x, v, kc, vc, slots.to(slot_dtype).cuda(), ks, vs)
    keep = (~pad).cuda()
    used = slots[~pad].cuda()
    for cache, src, s, name in ((kc, x, ks, "K"), (vc, v, vs, "V")):
        flat = cache.view(-1, H, D).view(torch.uint8)
        _assert_same_bytes(flat[used], torch_quant(src[keep], s).view(torch.uint8), f"{what} {name}", src[keep])
        untouched = torch.ones(flat.shape[0], dtype=torch.bool, device="cuda")
        untouched[used] = False
        assert (flat[untouched] == 0x7F).all(), f"{what} {name}: a slot no token maps to was written"


@gpu
@needs_cuda
@pytest.mark.parametrize("scale", [1.0, 0.25, 2.0 ** 20])
@pytest.mark.parametrize("page", [1, 16, 256])
def test_write_kv_rounding_edges(scale, page):
    """Power-of-two scales keep x / s exact: every tie, subnormal step and the clamp
    edge reach the rounding as written (fp32 inputs), int32 and int64 slots."""
    vals = special_values() * scale
    H, D = 4, 64
    per = H * D
    x = torch.zeros(-(-vals.numel() // per) * per)
    x[: vals.numel()] = vals
    x = x.view(-1, H, D)
    s = torch.full((H,), scale, dtype=torch.float32)
    _write_and_compare(x, s, s * 2, page, f"edges scale {scale} page {page}")
    _write_and_compare(x, s, s * 2, page, f"edges scale {scale} page {page} int64", slot_dtype=torch.int64)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
def test_write_kv_random_per_head_scales(dtype, D):
    """Magnitudes 2**-24 .. 2**12 (subnormal to saturated) with distinct non-power-of-two
    scales per KV head; also through a misaligned view (the one-element path)."""
    g = torch.Generator().manual_seed(7)
    H, T = 8, 2048
    expo = torch.randint(-24, 13, (T, H, D), generator=g).float()
    mant = 1 + torch.rand(T, H, D, generator=g)
    sign = torch.where(torch.rand(T, H, D, generator=g) < 0.5, -1.0, 1.0)
    x = (sign * mant * 2.0 ** expo).to(dtype)
    s = (torch.rand(H, generator=g) * 3 + 0.01).float()
    s[0] = 1.0
    _write_and_compare(x, s, s.flip(0), 16, f"random {dtype} D{D}")
    # rows that are not 16-byte aligned: a view one element into a wider buffer
    # (on the GPU already: .cuda() of a view with gaps would make it contiguous)
    wide = torch.zeros(T, H, D + 1, dtype=dtype, device="cuda")
    wide[:, :, 1:] = x.cuda()
    _write_and_compare(wide[:, :, 1:], s, s, 16, f"misaligned {dtype} D{D}")


@gpu
@needs_cuda
def test_write_kv_ties_with_odd_scale():
    """x chosen so that the fp32 quotient x / s lands exactly on an e4m3 tie under a
    non-power-of-two scale: a kernel that multiplies by 1/s instead of dividing fails."""
    s = torch.tensor([3.0, 0.3, 7.1, 1 / 3], dtype=torch.float32)
    pos = e4m3_finite_values()
    pos = pos[pos > 0]
    mids = (pos[1:] + pos[:-1]) / 2
    cols = []
    for h in range(4):
        x = (mids * s[h]).float()
        cols.append(x[(x / s[h]) == mids])
    n = min(c.numel() for c in cols)
    assert n > 20
    x = torch.stack([c[:n] for c in cols], 1)
    x = torch.cat([x, -x])[:, :, None].expand(-1, -1, 16).contiguous()
    _write_and_compare(x, s, s, 1, "ties odd scale")


# ----------------------------------------------------------------- GPU: decode


@gpu
@needs_cuda
@pytest.mark.parametrize("page", [1, 16, 256])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"H{h[0]}-{h[1]}")
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_fp8_decode(dtype, D, heads, page):
    """The default kernel (scalar for GQA 1-2, tensor cores from 3), then the other one
    forced (variant 10: tensor cores; 12: scalar), each with its split heuristic and with
    forced split counts; scalar scales on one of them."""
    Hq, Hkv = heads
    _run_decode(CTXS, Hq, Hkv, D, page, dtype, seed=page + D)
    other = 12 if Hq // Hkv >= 3 else 10
    _run_decode(CTXS, Hq, Hkv, D, page, dtype, seed=page + D + 1, variant=other, scales="equal")
    _run_decode(CTXS, Hq, Hkv, D, page, dtype, seed=page + D + 2, num_splits=3)
    _run_decode(CTXS, Hq, Hkv, D, page, dtype, seed=page + D + 3, num_splits=16, variant=other)


@gpu
@needs_cuda
@pytest.mark.parametrize("tiling", [6, 7, 8])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_fp8_decode_staged_tilings(dtype, D, page, tiling):
    """The fp8 cp.async tilings of the GQA-2 scalar kernel (decode/select.cuh select_fp8:
    rows staged through shared memory), with the split heuristic and forced splits."""
    _run_decode(CTXS, 8, 4, D, page, dtype, seed=page + D + tiling, variant=tiling)
    _run_decode(CTXS, 8, 4, D, page, dtype, seed=page + D + tiling + 1, num_splits=5, variant=tiling,
                scales="equal")


@gpu
@needs_cuda
@pytest.mark.parametrize("tiling", [23, 24])
@pytest.mark.parametrize("heads", [(8, 2), (16, 2), (8, 4)], ids=["G4", "G8", "G2"])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_fp8_decode_two_warp_tilings(dtype, D, page, heads, tiling):
    """The tensor-core kernel on fp8 caches in two-warp CTAs (decode/select.cuh select_fp8 23: 4
    stages, 24: 6; 32-token tiles), with the split heuristic and forced splits."""
    _run_decode(CTXS + [31, 32, 33], *heads, D, page, dtype, seed=page + D + tiling, variant=tiling)
    _run_decode(CTXS + [31, 32, 33], *heads, D, page, dtype, seed=page + D + tiling + 1, num_splits=5,
                variant=tiling, scales="equal")


@gpu
@needs_cuda
@pytest.mark.parametrize("heads", [(32, 8), (64, 8)], ids=["G4", "G8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_fp8_decode_two_warp_rule(dtype, heads):
    """The two-warp rule (off by default; variant 0x20000 flips it) at a batch whose
    (sequence, KV head) pairs overflow a wave of 4-warp CTAs: short, empty and odd lengths in a
    table of exactly the rule's 1024-token cap (64 pages of 16: the longest sequence takes 63,
    fp8_problem adds a spare column), where the two plans run different kernels and so differ in
    bits, and the same with one 30000-token sequence (a table that takes a work list), past the
    cap, where the bit must change nothing. Both plans against the oracle."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = 3 * sms // heads[1] + 3
    short = [(0, 1, 17, 97, 192, 1007, 300)[b % 7] for b in range(batch - 1)]
    for last in (1008, 30000):
        out, _, (_, _, _, tables, *_) = _run_decode(short + [last], *heads, 128, 16, dtype, seed=batch + last)
        assert (tables.shape[1] * 16 > 1024) == (last > 1008)
        flipped, _, _ = _run_decode(short + [last], *heads, 128, 16, dtype, seed=batch + last, variant=0x20000)
        if last > 1008:
            assert torch.equal(out, flipped), f"last {last}: the rule's bit changed the result past the cap"
        else:
            assert not torch.equal(out, flipped), f"last {last}: the rule's bit did not change the kernel"


# paged_decode_mma_kernel<T, D, STAGES, FP8, FUSED, PQ, WT, MQ, RB, WL, NW>: the template
# arguments of a launched kernel's demangled name, as the profiler reports it
_MMA_ARGS = re.compile(r"paged_decode_mma_kernel<([^<>]*)>")


def _wide_fp8_stages(fn) -> set[int]:
    """The ring depths of the FP8 32-token tensor-core decode kernels (D 128) that fn() launches,
    read from the kernel names in a torch profiler trace. Fails if the trace holds no decode
    kernel at all (a profiler that records no names must not pass for "no wide kernel")."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "paged_decode" in e.name]
    assert names, "the profiler recorded no decode kernel"
    stages = set()
    for name in names:
        if m := _MMA_ARGS.search(name):
            args = [a.strip().removeprefix("(int)").removeprefix("(bool)") for a in m.group(1).split(",")]
            if args[1] == "128" and args[3] in ("true", "1") and args[6] == "32":
                stages.add(int(args[2]))
    return stages


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_fp8_decode_short_ring_rule(dtype):
    """The short-ring rule (off by default; variant 0x80000 flips it): over 64-token pages the G = 2
    FP8 tensor-core kernel with 32-token tiles runs a 2-stage ring in place of 3, in the plain
    plan, the fused one, a work-list batch and the paged route's decode rows; over 16-token pages
    the bit changes nothing. The profiler's kernel names tell the rings apart. Every call is
    checked against the oracle, and each batch must take the wide kernel without the bit too (a
    30000-token sequence: long splits)."""
    ctxs = [30000, 1, 0, 4097, 17, 1023]
    uneven = [17, 0, 1, 300, 8193, 1023] * 14 + [30000]  # more than half a wave: a work list
    for page, flipped in ((64, 2), (16, 3)):
        for bits in (0, 0x400):  # two-launch, fused
            seed = page + bits
            assert _wide_fp8_stages(lambda: _run_decode(ctxs, 16, 8, 128, page, dtype, seed=seed, variant=bits)) == {3}
            assert _wide_fp8_stages(
                lambda: _run_decode(ctxs, 16, 8, 128, page, dtype, seed=seed, variant=bits | 0x80000)) == {flipped}
        assert _wide_fp8_stages(lambda: _run_decode(uneven, 16, 8, 128, page, dtype, seed=3, variant=0x80000)) == {
            flipped}
        # a mixed batch: its q_len == 1 rows run the packed-query decode build, the chunk a prefill kernel
        q_lens, paged_ctxs = [1, 1, 1, 40, 1, 1], [30000, 1, 17, 4097, 300, 1023]
        for bits, stages in ((0, 3), (0x80000, flipped)):
            assert _wide_fp8_stages(lambda: _run_paged(q_lens, paged_ctxs, 16, 8, 128, page, dtype, seed=5,
                                                       variant=bits)) == {stages}


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_fp8_decode_long_contexts_and_writer(dtype):
    """32k contexts (many splits), the cache written by the CUDA quantiser, Qwen3 heads."""
    ctxs = [32768, 1, 0, 4097, 16384, 100, 31999, 17]
    _run_decode(ctxs, 16, 8, 128, 16, dtype, writer="cuda")
    _run_decode(ctxs, 32, 8, 128, 16, dtype, writer="cuda", seed=1)
    _run_decode([8191, 3], 8, 8, 64, 1, dtype, num_splits=1, seed=2)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_fp8_decode_uneven_batch(dtype):
    """More CTAs than half a wave: splits capped by bytes, each sequence split by its own
    length (one long sequence last among short and empty ones)."""
    _run_decode([17, 0, 1, 300, 8193, 1023] * 14 + [30000], 16, 8, 128, 16, dtype, seed=3)


@gpu
@needs_cuda
def test_fp8_decode_scales_matter():
    """The checks can fail: an oracle with one head's k_scale or v_scale off by 5% rejects
    the output, and so does the oracle for a kernel given swapped scales."""
    for variant in (0, 10):  # scalar (GQA 2) and tensor cores
        out, lse, (q, kc, vc, tables, cu, ctx, ks, vs, dk, dv) = _run_decode(
            [40, 300], 4, 2, 128, 16, torch.float16, seed=4, variant=variant)
        scale = 1 / math.sqrt(128)
        off = torch.tensor([1.05, 1.0], dtype=torch.float64, device="cuda")[None, :, None]
        with pytest.raises(AssertionError):
            _check(out, lse, q, [k * off for k in dk], dv, cu, False, scale, "k_scale[0] off")
        with pytest.raises(AssertionError):
            _check(out, lse, q, dk, [v * off.flip(1) for v in dv], cu, False, scale, "v_scale[1] off")
        out2, lse2 = _ops().decode(q, kc, vc, tables, ctx, scale, True, ks.flip(0), vs.flip(0), variant=variant)
        with pytest.raises(AssertionError):
            _check(out2, lse2, q, dk, dv, cu, False, scale, "scales swapped")


@gpu
@needs_cuda
@pytest.mark.parametrize("variant", [0, 10, 12])
def test_fp8_decode_deterministic(variant):
    _, _, (q, kc, vc, tables, cu, ctx, ks, vs, _, _) = _run_decode(
        [4097, 1023, 17], 16, 2, 128, 16, torch.bfloat16, seed=5, variant=variant)
    ops = _ops()
    outs = [ops.decode(q, kc, vc, tables, ctx, 0.0883, True, ks, vs, variant=variant) for _ in range(4)]
    for o, l in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(l, outs[0][1])


@gpu
@needs_cuda
def test_fp8_decode_cuda_graph():
    """Decode with FP8 caches captured in a CUDA graph and replayed on new queries."""
    _, _, (q, kc, vc, tables, cu, ctx, ks, vs, dk, dv) = _run_decode(
        [4097, 17, 0], 16, 2, 128, 16, torch.bfloat16, seed=6)
    ops = _ops()
    static_q = q.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ops.decode(static_q, kc, vc, tables, ctx, 0.0883, False, ks, vs)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = ops.decode(static_q, kc, vc, tables, ctx, 0.0883, False, ks, vs)
    new_q = torch.randn_like(q)
    static_q.copy_(new_q)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, ops.decode(new_q, kc, vc, tables, ctx, 0.0883, False, ks, vs))


# ----------------------------------------------------------------- GPU: paged


PAGED_QLENS = [1, 2, 3, 4, 5, 6, 7, 8, 0, 97, 300, 5]
PAGED_CTXS = [17, 2, 3, 1023, 97, 4097, 8, 64, 5, 1023, 300, 3]  # last: q_len > context


@gpu
@needs_cuda
@pytest.mark.parametrize("page", [1, 16, 256])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"H{h[0]}-{h[1]}")
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_fp8_paged(dtype, D, heads, page):
    """q_len 1..8, long chunks, empty and q_len > context runs in one batch: the tuned
    choice (GQA-packed for short queries), then never packed and always packed,
    not causal, scalar scales."""
    Hq, Hkv = heads
    _run_paged(PAGED_QLENS, PAGED_CTXS, Hq, Hkv, D, page, dtype, seed=page + D)
    _run_paged(PAGED_QLENS, PAGED_CTXS, Hq, Hkv, D, page, dtype, seed=page + D + 1, variant=1, scales="equal")
    _run_paged(PAGED_QLENS[:9], PAGED_CTXS[:9], Hq, Hkv, D, page, dtype, seed=page + D + 2, variant=2)
    _run_paged(PAGED_QLENS, PAGED_CTXS, Hq, Hkv, D, page, dtype, causal=False, seed=page + D + 3)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_fp8_paged_every_tile_residue(dtype):
    """(context - q_len) through every residue of the key tiles (32 and 64)."""
    q_lens = [1 + (i % 9) for i in range(64)]
    ctxs = [q + 64 + i for i, q in enumerate(q_lens)]
    for variant in (1, 2):
        _run_paged(q_lens, ctxs, 16, 2, 128, 16, dtype, seed=10 + variant, variant=variant)


@gpu
@needs_cuda
@pytest.mark.parametrize("splits", [0, 3, 64])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_fp8_paged_spec_kv_splits(dtype, page, splits):
    """KV splits over FP8 pages (0: the planner's count): speculative runs and decode rows,
    q_len > context, an empty sequence, contexts up to 32k; bit for bit repeatable. At G 2 the
    decode kernel's two row blocks take the runs (16 x 2 rows), at G 8 the packed kernel
    (16 x 8)."""
    q_lens, ctxs = [4, 1, 0, 3, 8, 16, 5, 4], [4097, 1, 0, 97, 71, 1023, 3, 32768]
    for Hq, Hkv in ((16, 8), (32, 4)):
        out, _, args = _run_paged(q_lens, ctxs, Hq, Hkv, 128, page, dtype, seed=40 + splits, num_splits=splits)
        q, kc, vc, tables, cu, ctx, ks, vs, *_ = args
        again = _ops().paged(q, kc, vc, tables, cu, ctx, 16, True, 1.0 / math.sqrt(128), False, ks, vs,
                             num_splits=splits)
        assert torch.equal(again, out)


@gpu
@needs_cuda
@pytest.mark.parametrize("heads,max_q", [((16, 8), 8), ((16, 4), 4), ((32, 4), 2), ((16, 8), 16), ((16, 4), 8),
                                         ((32, 4), 4), ((24, 8), 10)],
                         ids=["G2", "G4", "G8", "G2-32", "G4-32", "G8-32", "G3-30"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("splits", [0, 1, 5])
def test_fp8_paged_spec_decode_rows(heads, max_q, D, splits):
    """Speculative runs over FP8 pages through the tensor-core decode kernel: up to 16 rows in
    one MMA row block (32 tokens per warp at G 2 D 128, 16 elsewhere), up to 32 in two (32
    tokens per warp): q_len 0, 1, 2..max in one batch (max x G rows), runs longer than their
    context; bit for bit repeatable."""
    q_lens, ctxs = [max_q, 2, 0, 1, max_q - 1, min(3, max_q), max_q, 2], [4097, 2, 5, 1, 97, 1, 300, 0]
    dtype = torch.bfloat16 if D == 128 else torch.float16
    for causal in (True, False):
        out, _, args = _run_paged(q_lens, ctxs, *heads, D, 16, dtype, causal=causal, seed=50 + D + splits,
                                  num_splits=splits)
    q, kc, vc, tables, cu, ctx, ks, vs, *_ = args
    again = _ops().paged(q, kc, vc, tables, cu, ctx, max_q, False, 1.0 / math.sqrt(D), False, ks, vs,
                         num_splits=splits)
    assert torch.equal(again, out)


@gpu
@needs_cuda
@pytest.mark.parametrize("page", [8, 16, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_fp8_paged_tma_key_tile_residues(dtype, page):
    """Chunks over FP8 pages of >= 8 tokens run the sm_90 TMA kernel (128-key tiles, widened
    in shared memory; the mma.sync FP8 kernels elsewhere): (context - q_len) through every
    residue mod 128, chunks of 1..200 rows, never packed (variant 1)."""
    q_lens = [1 + (37 * i) % 200 for i in range(128)]
    ctxs = [q + i for i, q in enumerate(q_lens)]
    _run_paged(q_lens, ctxs, 8, 2, 128, page, dtype, seed=20 + page, variant=1)


@gpu
@needs_cuda
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_fp8_paged_tma_long_chunks(dtype, D):
    """Long chunks over long cached prefixes (many key tiles per m-block, the staging and
    ring parities wrapping many times), pages of 8 (16 TMA boxes per key tile) and 256,
    causal and not, q_len > context and an empty chunk in the same batch."""
    q_lens, ctxs = [1023, 517, 0, 129, 300], [4097, 517 + 1111, 50, 129 + 127, 200]
    for page in (8, 256):
        _run_paged(q_lens, ctxs, 16, 8, D, page, dtype, seed=30 + page + D)
        _run_paged(q_lens, ctxs, 16, 8, D, page, dtype, causal=False, seed=31 + page + D)


@gpu
@needs_cuda
@pytest.mark.parametrize("q_lens, ctxs, heads, page", [
    ([1023], [1023], (16, 8), 16),
    ([1023], [4097], (16, 8), 64),
    ([300, 700, 0, 97], [300, 1500, 40, 97], (8, 2), 8),
    ([191], [65], (16, 8), 256),
], ids=["first-chunk", "prefix", "varlen", "q>ctx"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_fp8_paged_one_wave_chunks(dtype, q_lens, ctxs, heads, page):
    """Causal FP8 chunks whose work list is at most one wave (a prompt's first chunk at B=1):
    the TMA kernel on mirrored 64-row block pairs on sm_90a, against the oracle, repeatable."""
    out, _, (q, kc, vc, tables, cu, ctx, ks, vs, _, _) = _run_paged(q_lens, ctxs, *heads, 128, page, dtype,
                                                                      seed=sum(q_lens) + page)
    again = _ops().paged(q, kc, vc, tables, cu, ctx, max(q_lens), True, 1.0 / math.sqrt(128), False, ks, vs)
    assert torch.equal(again, out), "a second call differs"


@gpu
@needs_cuda
def test_fp8_paged_decode_batch_equals_decode_and_is_deterministic():
    """A pure decode batch through paged runs the decode kernels: identical bytes; and
    repeated paged calls are bitwise identical."""
    out, lse, (q, kc, vc, tables, cu, ctx, ks, vs, _, _) = _run_paged(
        [1, 1, 1], [4097, 0, 97], 16, 2, 128, 16, torch.float16, seed=12)
    d_out, d_lse = _ops().decode(q, kc, vc, tables, ctx, 1 / math.sqrt(128), True, ks, vs)
    assert torch.equal(out, d_out) and torch.equal(lse, d_lse)
    out, lse, (q, kc, vc, tables, cu, ctx, ks, vs, _, _) = _run_paged(
        PAGED_QLENS, PAGED_CTXS, 16, 2, 128, 16, torch.bfloat16, seed=13, variant=1)
    for _ in range(3):
        o2, l2 = _ops().paged(q, kc, vc, tables, cu, ctx, 300, True, 1 / math.sqrt(128), True, ks, vs, variant=1)
        assert torch.equal(o2, out) and torch.equal(l2, lse)


@gpu
@needs_cuda
def test_fp8_paged_scales_matter():
    out, lse, (q, kc, vc, tables, cu, ctx, ks, vs, dk, dv) = _run_paged(
        [1, 4, 97], [40, 30, 200], 4, 2, 128, 16, torch.float16, seed=14, variant=1)
    scale = 1 / math.sqrt(128)
    off = torch.tensor([1.05, 1.0], dtype=torch.float64, device="cuda")[None, :, None]
    with pytest.raises(AssertionError):
        _check(out, lse, q, [k * off for k in dk], dv, cu, True, scale, "k_scale[0] off")
    with pytest.raises(AssertionError):
        _check(out, lse, q, dk, [v * off.flip(1) for v in dv], cu, True, scale, "v_scale[1] off")


@gpu
@needs_cuda
def test_fp8_binding_rejects_bad_scales():
    """Memory-safety checks of the binding: FP8 caches need float32 [Hkv] scales on the
    device; 16-bit caches take none."""
    q, kc, vc, tables, cu, ctx, ks, vs, _, _ = _fp8_problem([1, 1], [20, 3], 4, 2, 64, 16, torch.float16)
    ops = _ops()
    with pytest.raises(ValueError, match="k_scale"):
        ops.decode(q, kc, vc, tables, ctx, 0.125, False, ks[:1], vs)
    with pytest.raises(ValueError):
        ops.decode(q, kc, vc, tables, ctx, 0.125, False, None, None)
    with pytest.raises(TypeError):
        ops.decode(q, kc, vc, tables, ctx, 0.125, False, ks.double(), vs)
    k16 = torch.zeros(kc.shape, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError):
        ops.decode(q, k16, k16, tables, ctx, 0.125, False, ks, vs)
    with pytest.raises(ValueError):
        ops.write_kv_cache(q[:, :2], q[:, :2], kc, vc, torch.zeros(2, dtype=torch.int32, device="cuda"), ks.cpu(), vs)
