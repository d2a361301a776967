"""FP8 (float8_e4m3fn) KV cache in the Triton backend: quantisation in
write_kv_cache and on-the-fly dequantisation in decode and paged, called
directly from minipaged.triton.ops with float32 [Hkv] scales.

Quantisation is compared byte for byte with torch's own cast of the clamped
quotient, torch.clamp(x.float() / s, -448, 448).to(torch.float8_e4m3fn), on
ties, subnormals, values around 448 and random values.

Attention is compared with an fp64 oracle written here on the SAME fp8 cache,
dequantised exactly (k = k_cache.double() * k_scale[h]), so quantisation error
is never blamed on the kernel. Error bound as in test_triton_paged.py: within
twice the error of the same attention in plain PyTorch at q's precision (the
dequantised K/V rounded to q's dtype, matmuls in that dtype, fp32 softmax),
plus a small floor. Unused cache slots hold fp8 NaN bytes (0x7F / 0xFF, random
sign). The interpreter widens those to +-480 rather than NaN: a read of one
that enters the softmax is still caught on CPU, but one multiplied by an exact
zero weight is not; the GPU tests see real NaN.

CPU: interpreter, fp16 queries (its bf16 tl.dot is wrong). GPU: `pytest -m gpu
tests/test_triton_fp8.py` (bf16 and fp16, contexts up to 32k).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
from fp8_problem import FP8, check as _check, e4m3_finite_values, fp8_problem, special_values, torch_quant  # noqa: E402
import triton.language as tl  # noqa: E402

from minipaged.triton import configs, decode, ops  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU tests need TRITON_INTERPRET=1")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                                reason="needs a CUDA device and TRITON_INTERPRET unset")
DEV = "cpu" if INTERPRET else "cuda"


# ----------------------------------------------------------------- quantisation truth


def _as_tokens(vals: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    per = heads * head_dim
    n = -(-vals.numel() // per) * per
    out = torch.zeros(n, dtype=vals.dtype)
    out[: vals.numel()] = vals
    return out.view(-1, heads, head_dim)


def _write_and_compare(x: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, page: int,
                       what: str):
    """Write x as K and -x/3 as V through the kernel into NaN-byte caches at shuffled
    slots (some tokens padding, slot -1); compare the bytes with torch's cast."""
    T, H, D = x.shape
    g = torch.Generator().manual_seed(T)
    num_blocks = -(-(T + 5) // page) + 1
    kc = torch.full((num_blocks, page, H, D), 0x7F, dtype=torch.uint8).view(FP8).to(DEV)
    vc = kc.clone()
    slots = torch.randperm(num_blocks * page, generator=g)[:T].to(torch.int32)
    pad = torch.rand(T, generator=g) < 0.1
    slots[pad] = -1
    v = (-x / 3).to(x.dtype)
    ks, vs = k_scale.to(DEV), v_scale.to(DEV)
    ops.write_kv_cache(x.to(DEV), v.to(DEV), kc, vc, slots.to(DEV), ks, vs)
    kc, vc = kc.cpu(), vc.cpu()
    for cache, src, s, name in ((kc, x, k_scale, "K"), (vc, v, v_scale, "V")):
        flat = cache.view(-1, H, D).view(torch.uint8)
        got = flat[slots[~pad].long()]
        want = torch_quant(src[~pad], s).view(torch.uint8)
        # NaN has two encodings (sign); every other value must match bit for bit
        nan_want = (want & 0x7F) == 0x7F
        assert torch.equal((got & 0x7F) == 0x7F, nan_want), f"{what} {name}: NaN pattern"
        diff = (got != want) & ~nan_want
        if diff.any():
            i = diff.nonzero()[0].tolist()
            raise AssertionError(
                f"{what} {name}: {int(diff.sum())} bytes differ, first at {i}: x={src[~pad][tuple(i)].item()!r} "
                f"scale={s[i[1]].item()!r} got 0x{int(got[tuple(i)]):02x} want 0x{int(want[tuple(i)]):02x}")
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[slots[~pad].long()] = False
        assert (flat[untouched] == 0x7F).all(), f"{what} {name}: a slot no token maps to was written"


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs the interpreter or a GPU")
@pytest.mark.parametrize("scale", [1.0, 0.25, 2.0 ** 20], ids=["s1", "s0.25", "s2^20"])
def test_quantise_rounding_edges(scale):
    """Power-of-two scales keep x / s exact, so every tie, subnormal step and the
    clamp edge reach the rounding exactly as written (fp32 inputs)."""
    vals = special_values() * scale
    H, D = 4, 64
    x = _as_tokens(vals, H, D)
    s = torch.full((H,), scale, dtype=torch.float32)
    _write_and_compare(x, s, s * 2, 16, f"edges scale {scale}")


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs the interpreter or a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantise_random_per_head_scales(dtype):
    """Random magnitudes over 2**-24 .. 2**12 (subnormal to clamped) with distinct,
    non-power-of-two scales per KV head, in each input dtype."""
    g = torch.Generator().manual_seed(7)
    H, D, T = 8, 128, 48 if INTERPRET else 2048
    expo = torch.randint(-24, 13, (T, H, D), generator=g).float()
    mant = 1 + torch.rand(T, H, D, generator=g)
    sign = torch.where(torch.rand(T, H, D, generator=g) < 0.5, -1.0, 1.0)
    x = (sign * mant * 2.0 ** expo).to(dtype)
    s = (torch.rand(H, generator=g) * 3 + 0.01).float()
    s[0] = 1.0  # one plain head
    _write_and_compare(x, s, s.flip(0), 16, f"random {dtype}")


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs the interpreter or a GPU")
def test_quantise_ties_with_odd_scale():
    """Ties under a non-power-of-two scale: x chosen so that x / s rounds (in fp32,
    correctly) onto an e4m3 midpoint; the kernel must divide, not multiply by 1/s."""
    s = torch.tensor([3.0, 0.3, 7.1, 1 / 3], dtype=torch.float32)
    pos = e4m3_finite_values()
    pos = pos[pos > 0]
    mids = (pos[1:] + pos[:-1]) / 2
    cols = []
    for h in range(4):
        x = (mids * s[h]).float()
        # keep the x whose fp32 quotient lands exactly on the tie
        x = x[(x / s[h]) == mids]
        cols.append(x)
    n = min(c.numel() for c in cols)
    assert n > 20, "too few exact ties to test"
    x = torch.stack([c[:n] for c in cols], 1)  # [n, 4]
    x = torch.cat([x, -x])[:, :, None].expand(-1, -1, 16).contiguous()
    _write_and_compare(x, s, s, 1, "ties odd scale")


# ----------------------------------------------------------------- attention problems


def _fp8_problem(q_lens, ctxs, Hq, Hkv, D, page, dtype, seed=0, scales="per-head", writer="torch"):
    """fp8_problem on the test device; writer "triton": the cache is written by the
    Triton quantiser (and checked byte for byte against torch's cast)."""
    if writer not in ("torch", "triton"):
        raise ValueError(f"writer={writer!r}: must be 'torch' or 'triton'")
    return fp8_problem(q_lens, ctxs, Hq, Hkv, D, page, dtype, seed, scales, device=DEV,
                       write_kv=ops.write_kv_cache if writer == "triton" else None)


def _run_paged(q_lens, ctxs, Hq, Hkv, D, page, causal=True, dtype=torch.float16, seed=0,
               scales="per-head", writer="torch", **kw):
    (q, kc, vc, tables, cu_q, ctx, ks, vs, dk, dv) = _fp8_problem(
        q_lens, ctxs, Hq, Hkv, D, page, dtype, seed, scales, writer)
    scale = 1.0 / math.sqrt(D)
    out, lse = ops.paged(q, kc, vc, tables, cu_q, ctx, max(q_lens + [0]), causal, scale, True, ks, vs, **kw)
    what = f"fp8 paged q{q_lens[:6]} ctx{ctxs[:6]} H{Hq}/{Hkv} D{D} p{page} {scales} {writer} {kw}"
    _check(out, lse, q, dk, dv, cu_q, causal, scale, what)
    return out, lse, (q, kc, vc, tables, cu_q, ctx, ks, vs, dk, dv)


def _run_decode(ctxs, Hq, Hkv, D, page, dtype=torch.float16, seed=0, scales="per-head", writer="torch",
                splits=None, worklist=None, **modes):
    """Decode over an fp8 cache against the oracle on the same cache; splits / worklist / modes:
    configs overrides (decode_splits, decode_worklist, decode_fp8_words...) for the call."""
    (q, kc, vc, tables, cu_q, ctx, ks, vs, dk, dv) = _fp8_problem(
        [1] * len(ctxs), ctxs, Hq, Hkv, D, page, dtype, seed, scales, writer)
    scale = 1.0 / math.sqrt(D)
    with configs.overriding(decode_splits=splits, decode_worklist=worklist, **modes):
        out, lse = ops.decode(q, kc, vc, tables, ctx, scale, True, ks, vs)
        plain = ops.decode(q, kc, vc, tables, ctx, scale, False, ks, vs)
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, out)
    _check(out, lse, q, dk, dv, cu_q, False, scale,
           f"fp8 decode ctx{ctxs[:6]} H{Hq}/{Hkv} D{D} p{page} {scales} {writer} splits={splits} "
           f"worklist={worklist} {modes}")
    return out, lse


# ----------------------------------------------------------------- paged: CPU

CPU_PAGED = [
    # q_lens, context_lens, Hq, Hkv, D, page
    # decode rows, an empty run, q_len 4 and 17, q_len > ctx, ctx 0
    ([1, 0, 4, 17, 4, 1], [33, 5, 40, 50, 2, 0], 4, 2, 64, 16),
    ([1, 4, 17], [20, 9, 30], 8, 1, 64, 1),              # GQA 8, one token per page
    ([1, 17, 4], [300, 257, 5], 2, 2, 128, 256),         # Hq == Hkv, page > KV tile
]


@cpu_only
@pytest.mark.parametrize("case", CPU_PAGED, ids=lambda c: f"H{c[2]}-{c[3]}-D{c[4]}-p{c[5]}")
def test_fp8_paged_interpreter(case):
    _run_paged(*case)


@cpu_only
@pytest.mark.parametrize("writer", ["torch", "triton"])
def test_fp8_paged_equal_scales_and_writer_interpreter(writer):
    """[Hkv] scales all equal (what a scalar scale becomes), cache written by torch
    or by the kernel; not causal too."""
    _run_paged([1, 4, 17, 0], [30, 19, 17, 4], 8, 4, 64, 16, scales="equal", writer=writer, seed=1)
    if writer == "triton":
        _run_paged([2, 9], [41, 9], 4, 2, 64, 8, causal=False, writer=writer, seed=2)


@cpu_only
@pytest.mark.parametrize("splits", [3])
def test_fp8_paged_forced_splits_interpreter(splits):
    q_lens, ctxs = [1, 4, 17, 0, 2], [150, 61, 90, 7, 1]
    out, lse, _ = _run_paged(q_lens, ctxs, 4, 2, 64, 16, num_splits=splits, seed=3)
    one, one_lse, _ = _run_paged(q_lens, ctxs, 4, 2, 64, 16, num_splits=1, seed=3)
    assert (out.float() - one.float()).abs().max() <= 4e-3 * max(1.0, one.float().abs().max().item())


@cpu_only
def test_fp8_scales_matter_interpreter():
    """The checks can fail: the kernel's output judged against an oracle with one KV
    head's k_scale or v_scale off by 5% is rejected, and so is the output of a
    kernel launched with the wrong k_scale."""
    out, lse, (q, kc, vc, tables, cu_q, ctx, ks, vs, dk, dv) = _run_paged(
        [1, 4], [40, 30], 4, 2, 64, 16, seed=4)
    scale = 1 / math.sqrt(64)
    off = torch.tensor([1.05, 1.0], dtype=torch.float64, device=DEV)[None, :, None]
    with pytest.raises(AssertionError):
        _check(out, lse, q, [k * off for k in dk], dv, cu_q, True, scale, "k_scale[0] off")
    with pytest.raises(AssertionError):
        _check(out, lse, q, dk, [v * off.flip(1) for v in dv], cu_q, True, scale, "v_scale[1] off")
    out2, lse2 = ops.paged(q, kc, vc, tables, cu_q, ctx, 4, True, scale, True, ks.flip(0), vs)
    with pytest.raises(AssertionError):
        _check(out2, lse2, q, dk, dv, cu_q, True, scale, "k_scale swapped")


# ----------------------------------------------------------------- decode: CPU


@cpu_only
@pytest.mark.parametrize("splits", [1, 3])
def test_fp8_decode_interpreter(splits):
    _run_decode([17, 0, 97, 1, 64], 8, 2, 64, 16, splits=splits, seed=5)


@cpu_only
@pytest.mark.parametrize("words", [0, 2], ids=["f16", "planes"])
def test_fp8_decode_worklist_interpreter(words):
    """Work-list decode (configs.decode_worklist) on fp8 caches: one long sequence among short
    and empty ones split over the idle slots, through the fp16-dot loop and the planes loop."""
    _run_decode([300, 0, 17, 1, 33], 8, 2, 64, 16, splits=6, worklist=1, seed=21, decode_fp8_words=words)


@cpu_only
def test_fp8_decode_pages_and_groups_interpreter():
    _run_decode([20, 3, 0], 8, 1, 64, 1, seed=6)                       # GQA 8, page 1
    _run_decode([300, 1], 2, 2, 128, 256, seed=7, scales="equal")      # GQA 1, page 256
    _run_decode([33, 16], 4, 2, 64, 16, seed=8, writer="triton")


@cpu_only
def test_fp8_paged_equals_decode_interpreter():
    ctxs = [17, 0, 70, 1]
    (q, kc, vc, tables, _, ctx, ks, vs, dk, dv) = _fp8_problem(
        [1] * 4, ctxs, 4, 2, 64, 16, torch.float16, seed=9)
    cu = torch.arange(5, dtype=torch.int32)
    po, pl = ops.paged(q, kc, vc, tables, cu, ctx, 1, True, 0.125, True, ks, vs)
    do, dl = ops.decode(q, kc, vc, tables, ctx, 0.125, True, ks, vs)
    assert (po.float() - do.float()).abs().max() <= 4e-3 * max(1.0, do.float().abs().max().item())
    assert torch.equal(torch.isneginf(pl), torch.isneginf(dl))


def _f16_dots(dtype, q_mult, seed, on_gpu=False, f16=1, words=0):
    """configs.decode_fp8_f16 (f16 = 1: fp16 dots, the default; 0: tiles widened to q's
    dtype) and configs.decode_fp8_words (words = 1 or 2: full tiles read as int32 words, 2 the
    default; 0: the fp16 dots on tiles widened as dot operands): decode
    and a mixed paged batch (mode "decode": its q_len 1 rows through the decode kernel) with
    q scaled by q_mult, against the oracle."""
    ctxs = [1, 17, 97, 300, 0] if not on_gpu else [32768, 1, 4097, 16384, 0, 100]
    q_lens = [1] * (len(ctxs) - 1) + [0]
    (q, kc, vc, tables, cu_q, ctx, ks, vs, dk, dv) = _fp8_problem(
        [1] * len(ctxs), ctxs, 8, 2, 64 if not on_gpu else 128, 16, dtype, seed)
    q = (q.float() * q_mult).to(dtype)
    scale = 1.0 / math.sqrt(q.shape[-1])
    with configs.overriding(decode_fp8_f16=f16, decode_fp8_words=words, paged_mixed="decode"):
        out, lse = ops.decode(q, kc, vc, tables, ctx, scale, True, ks, vs)
        _check(out, lse, q, dk, dv, cu_q, False, scale, f"fp8 decode, fp16 dots, q x {q_mult} {dtype}")
        # paged: a 9-token chunk in front (so the mixed batch splits) and one empty sequence
        (pq, pkc, pvc, pt, pcu, pctx, pks, pvs, pdk, pdv) = _fp8_problem(
            [9] + q_lens, [40] + ctxs, 8, 2, 64, 16, dtype, seed + 1)
        pq = (pq.float() * q_mult).to(dtype)
        po, pl = ops.paged(pq, pkc, pvc, pt, pcu, pctx, 9, True, 0.125, True, pks, pvs)
        _check(po, pl, pq, pdk, pdv, pcu, True, 0.125, f"fp8 paged mode decode, fp16 dots, q x {q_mult}")


@cpu_only
@pytest.mark.parametrize("q_mult", [1.0, 3e3, 1e-5])
def test_fp8_decode_f16_dots_interpreter(q_mult):
    """The fp16-dot path for fp8 caches at every q magnitude: q's power-of-two shift brings
    large queries down into fp16's range and small ones up out of its subnormals."""
    _f16_dots(torch.float16, q_mult, seed=11)


def _paged_f16_dots(dtype, q_mult, seed):
    """Long chunks over FP8 pages through v2 with its fp16 dots forced (paged_fp8_f16), q scaled
    by q_mult, against the fp64 oracle."""
    q_lens, ctxs = [40, 1, 97, 0, 17], [90, 30, 97, 5, 200]
    (q, kc, vc, tables, cu_q, ctx, ks, vs, dk, dv) = _fp8_problem(q_lens, ctxs, 4, 2, 64, 16, dtype, seed)
    q = (q.float() * q_mult).to(dtype)
    with configs.overriding(paged_long_kernel="v2", paged_mixed="split", paged_fp8_f16=1):
        out, lse = ops.paged(q, kc, vc, tables, cu_q, ctx, 97, True, 0.125, True, ks, vs)
    _check(out, lse, q, dk, dv, cu_q, True, 0.125, f"fp8 paged v2, fp16 dots, {dtype}, q x {q_mult}")


@cpu_only
@pytest.mark.parametrize("q_mult", [1.0, 3e3, 1e-5])
def test_fp8_paged_long_f16_dots_interpreter(q_mult):
    """v2's fp16-dot path (off by default for bf16 until timed) at every q magnitude."""
    _paged_f16_dots(torch.float16, q_mult, seed=13)


@cpu_only
@pytest.mark.parametrize("words", [1, 2], ids=["words", "planes"])
@pytest.mark.parametrize("q_mult", [1.0, 3e3])
def test_fp8_decode_word_tiles_interpreter(q_mult, words):
    """configs.decode_fp8_words: the full tiles as int32 words widened in registers (integer
    widening under the interpreter, cvt on the GPU), interleaved back into one tile (1) or kept
    as four column planes (2), against the oracle."""
    _f16_dots(torch.float16, q_mult, seed=15, words=words)


@cpu_only
@pytest.mark.parametrize("words", [0, 2], ids=["f16", "planes"])
def test_fp8_decode_table_ahead_interpreter(words):
    """configs.decode_table_ahead on fp8 caches: the planes loop and the fp16-dot loop with the
    block ids read a tile ahead, decode and a mixed paged batch's decode rows, against the oracle."""
    with configs.overriding(decode_table_ahead=1):
        _f16_dots(torch.float16, 1.0, seed=17, words=words)


@triton.jit
def _widen_words_kernel(W, OUT, HW_CVT: tl.constexpr):
    rows = tl.arange(0, 8)
    cols = tl.arange(0, 8)
    w = tl.load(W + rows[:, None] * 8 + cols[None, :])
    h = decode._e4m3_words_to_f16(w, 8, 32, HW_CVT)
    tl.store(OUT + rows[:, None] * 32 + tl.arange(0, 32)[None, :], h)


def _widen_all_bytes(hw_cvt: bool, device):
    """Every e4m3 byte, in a shuffled order, through decode._e4m3_words_to_f16: the fp16 tile
    must equal torch's own fp8 -> fp16 cast element for element (NaN where torch has NaN)."""
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(3)).to(torch.uint8)
    words = perm.view(torch.int32).reshape(8, 8).contiguous().to(device)
    out = torch.empty(8, 32, dtype=torch.float16, device=device)
    _widen_words_kernel[(1,)](words, out, HW_CVT=hw_cvt)
    want = perm.view(torch.float8_e4m3fn).to(torch.float16).reshape(8, 32)
    got = out.cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN pattern differs"
    ok = ~torch.isnan(want)
    assert torch.equal(got[ok].view(torch.int16), want[ok].view(torch.int16)), "widened bits differ"


@cpu_only
def test_e4m3_words_widen_every_byte_interpreter():
    _widen_all_bytes(False, "cpu")


@cpu_only
def test_fp8_decode_widened_tiles_interpreter():
    """The path with configs.decode_fp8_f16 off (tiles widened to q's dtype) stays correct."""
    _f16_dots(torch.float16, 1.0, seed=13, f16=0)


# ----------------------------------------------------------------- GPU


GPU_PAGED = [
    ([1, 4, 17, 0, 300, 1], [32768, 1000, 4111, 5, 2048, 0], 32, 8, 128, 16),
    ([1, 4, 1, 4], [32768, 32768, 97, 16], 16, 2, 128, 256),
    ([17, 1], [1023, 9000], 16, 16, 64, 1),
    # decodes and speculative runs only, G 2, D 128: the packed 16-row tile (sm_90: 32 keys, 3 stages)
    ([4, 1, 0, 3, 4, 8], [4096, 97, 16, 3, 40, 0], 16, 8, 128, 16),
]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", GPU_PAGED, ids=lambda c: f"H{c[2]}-{c[3]}-D{c[4]}-p{c[5]}")
def test_fp8_paged_gpu(case, dtype):
    _run_paged(*case, dtype=dtype)
    _run_paged(*case, dtype=dtype, num_splits=7, scales="equal", writer="triton", seed=1)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_decode_gpu(dtype):
    ctxs = [32768, 1, 0, 4097, 16384, 100, 31999, 17]
    _run_decode(ctxs, 32, 8, 128, 16, dtype=dtype)
    _run_decode(ctxs, 16, 2, 128, 256, dtype=dtype, splits=16, writer="triton", scales="equal")
    _run_decode([8191, 3], 8, 8, 64, 1, dtype=dtype, splits=1)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_decode_worklist_gpu(dtype):
    """Work-list decode (configs.decode_worklist) on fp8 caches: one long sequence among 1k
    ones, and ragged lengths with empty contexts at page 1."""
    _run_decode([1024] * 63 + [32768], 16, 8, 128, 16, dtype=dtype, worklist=1, seed=22)
    _run_decode([0, 1, 17, 97, 1023, 4097, 31, 20480], 16, 8, 128, 1, dtype=dtype, worklist=1, seed=23)


@gpu
@needs_cuda
@pytest.mark.parametrize("q_mult", [1.0, 3e3, 1e-5, 1e6])
def test_fp8_decode_f16_dots_gpu(q_mult):
    """The fp16-dot path with bf16 queries, including magnitudes fp16 cannot hold (1e6)."""
    _f16_dots(torch.bfloat16, q_mult, seed=12, on_gpu=True)


@gpu
@needs_cuda
@pytest.mark.parametrize("q_mult", [1.0, 3e3, 1e-5, 1e6])
def test_fp8_paged_long_f16_dots_gpu(q_mult):
    """v2's fp16-dot path with bf16 queries, including magnitudes fp16 cannot hold (1e6)."""
    _paged_f16_dots(torch.bfloat16, q_mult, seed=14)


@gpu
@needs_cuda
def test_fp8_decode_widened_tiles_gpu():
    _f16_dots(torch.bfloat16, 1.0, seed=14, on_gpu=True, f16=0)


@gpu
@needs_cuda
@pytest.mark.parametrize("words", [1, 2], ids=["words", "planes"])
@pytest.mark.parametrize("q_mult", [1.0, 1e6])
def test_fp8_decode_word_tiles_gpu(q_mult, words):
    _f16_dots(torch.bfloat16, q_mult, seed=16, on_gpu=True, words=words)


@gpu
@needs_cuda
@pytest.mark.parametrize("hw_cvt", [True, False])
def test_e4m3_words_widen_every_byte_gpu(hw_cvt):
    _widen_all_bytes(hw_cvt, "cuda")


@cpu_only
def test_fp8_expanded_scalar_scales_interpreter():
    """A scalar scale expanded to [Hkv] (stride 0) reads like a dense one."""
    (q, kc, vc, tables, cu_q, ctx, ks, vs, dk, dv) = _fp8_problem(
        [1, 3], [21, 40], 4, 2, 64, 16, torch.float16, seed=10, scales="equal")
    ke, ve = ks[:1].expand(2), vs[:1].expand(2)
    assert ke.stride(0) == 0
    assert torch.equal(ops.decode(q[:2], kc, vc, tables, ctx, 0.125, False, ke, ve),
                       ops.decode(q[:2], kc, vc, tables, ctx, 0.125, False, ks, vs))
    assert torch.equal(ops.paged(q, kc, vc, tables, cu_q, ctx, 3, True, 0.125, False, ke, ve),
                       ops.paged(q, kc, vc, tables, cu_q, ctx, 3, True, 0.125, False, ks, vs))
    x = torch.randn(5, 2, 64).half()
    outs = []
    for a, b in ((ke, ve), (ks, vs)):
        c1, c2 = torch.zeros_like(kc), torch.zeros_like(vc)
        ops.write_kv_cache(x, x, c1, c2, torch.arange(5, dtype=torch.int32), a, b)
        outs.append(c1.view(torch.uint8))
    assert torch.equal(*outs)
