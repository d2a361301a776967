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
from fp8_problem import FP8, fp8_problem, torch_quant  # noqa: E402
from minipaged.triton import configs, ops  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU tests need TRITON_INTERPRET=1")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                                reason="needs a CUDA device and TRITON_INTERPRET unset")
NEG_INF = float("-inf")
DEV = "cpu" if INTERPRET else "cuda"


# ----------------------------------------------------------------- quantisation truth


def _e4m3_finite_values() -> torch.Tensor:
    """All finite e4m3fn values in increasing order (no NaN codes, one zero)."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    vals = vals[torch.isfinite(vals)]
    return torch.unique(vals)  # sorted, +-0 merged


def _special_values() -> torch.Tensor:
    """fp32 values at every rounding edge of e4m3 (for a scale of 1)."""
    v = _e4m3_finite_values()
    pos = v[v >= 0]
    mids = (pos[1:] + pos[:-1]) / 2  # exact in fp32: the ties
    up = torch.nextafter(mids, torch.tensor(float("inf")))
    down = torch.nextafter(mids, torch.tensor(0.0))
    step = 2.0 ** -9
    sub = torch.arange(0, 2 ** -6 + step, step / 4)  # quarter steps through the subnormals
    tiny = torch.tensor([1e-30, 1e-40, 2.0 ** -149, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -11,
                         2.0 ** -10 + 2.0 ** -30, 2.0 ** -6 - 2.0 ** -30])
    big = torch.tensor([448.0, 448.0001, 455.0, 463.99, 464.0, 464.01, 470.0, 479.99, 480.0, 500.0,
                        1e4, 3e38, float("inf")])
    mag = torch.cat([v.abs(), pos, mids, up, down, sub, tiny, big, torch.nextafter(big, torch.tensor(0.0))])
    return torch.cat([mag, -mag, torch.tensor([0.0, -0.0, float("nan"), -float("nan")])])


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
    vals = _special_values() * scale
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
    pos = _e4m3_finite_values()
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


# ----------------------------------------------------------------- oracle


def _attend(q, k, v, diag, causal, scale, low_dtype=None):
    """q [n, Hq, D] of one sequence, k/v [L, Hkv, D] fp64 (dequantised), same device.
    Row i sees key j iff j < L (and j <= i + diag when causal). low_dtype None: fp64
    (o, lse); else K/V rounded to low_dtype, matmuls in it, fp32 softmax. The GQA
    group's query heads are stacked as rows of their KV head (no K/V copies per
    query head: long GPU contexts stay small)."""
    n, Hq, D = q.shape
    L, Hkv = k.shape[0], k.shape[1]
    dev = k.device
    if L == 0:
        return (torch.zeros(n, Hq, D, dtype=torch.float64, device=dev),
                torch.full((n, Hq), NEG_INF, dtype=torch.float64, device=dev))
    group = Hq // Hkv
    # row r of KV head h: position r // group, query head h * group + r % group
    qq = q.to(dev).view(n, Hkv, group, D).permute(1, 0, 2, 3).reshape(Hkv, n * group, D)
    kk, vv = k.permute(1, 0, 2), v.permute(1, 0, 2)  # [Hkv, L, D]
    if low_dtype is None:
        s = torch.matmul(qq.double(), kk.transpose(1, 2)) * scale
    else:
        qq, kk, vv = qq.to(low_dtype), kk.to(low_dtype), vv.to(low_dtype)
        s = torch.matmul(qq, kk.transpose(1, 2)).float() * scale
    if causal:
        rows = (torch.arange(n * group, device=dev) // group)[:, None]
        cols = torch.arange(L, device=dev)[None, :]
        s = s.masked_fill(cols > rows + diag, NEG_INF)
    lse = torch.logsumexp(s.double(), -1)  # [Hkv, n * group]
    p = torch.softmax(s, -1).nan_to_num(0.0)
    o = torch.matmul(p, vv) if low_dtype is None else torch.matmul(p.to(low_dtype), vv)
    o = o.double().view(Hkv, n, group, D).permute(1, 0, 2, 3).reshape(n, Hq, D)
    return o, lse.view(Hkv, n, group).permute(1, 0, 2).reshape(n, Hq)


def _reference(q, deq_k, deq_v, cu_q, causal, scale, low_dtype=None):
    Tq, Hq, D = q.shape
    o = torch.zeros(Tq, Hq, D, dtype=torch.float64)
    lse = torch.full((Tq, Hq), NEG_INF, dtype=torch.float64)
    cu = cu_q.tolist()
    for s in range(len(cu) - 1):
        a, b = cu[s], cu[s + 1]
        if b > a:
            k, v = deq_k[s], deq_v[s]
            so, sl = _attend(q[a:b], k, v, k.shape[0] - (b - a), causal, scale, low_dtype)
            o[a:b], lse[a:b] = so.cpu(), sl.cpu()
    return o, lse


def _check(out, lse, q, deq_k, deq_v, cu_q, causal, scale, what):
    truth, truth_lse = _reference(q, deq_k, deq_v, cu_q.cpu(), causal, scale)
    base, _ = _reference(q, deq_k, deq_v, cu_q.cpu(), causal, scale, low_dtype=q.dtype)
    out = out.cpu()
    assert out.dtype == q.dtype and out.shape == truth.shape, what
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    if out.numel():
        err = (out.double() - truth).abs().max().item()
        ref_err = (base - truth).abs().max().item()
        floor = 2e-3 * max(1.0, truth.abs().max().item())
        assert err <= 2 * ref_err + floor, f"{what}: max err {err:.3e} vs low-precision {ref_err:.3e}"
    empty = torch.isneginf(truth_lse)
    assert (out[empty] == 0).all(), f"{what}: a row with no key is not zero"
    if lse is not None:
        lse = lse.cpu()
        assert lse.dtype == torch.float32 and lse.shape == truth_lse.shape, what
        assert torch.equal(torch.isneginf(lse), empty), f"{what}: -inf lse pattern differs"
        assert not torch.isnan(lse).any(), what
        if (~empty).any():
            d = (lse.double() - truth_lse)[~empty].abs()
            assert (d <= 2e-3 * (1 + truth_lse[~empty].abs())).all(), f"{what}: lse err {d.max().item():.3e}"


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
                splits=None):
    (q, kc, vc, tables, cu_q, ctx, ks, vs, dk, dv) = _fp8_problem(
        [1] * len(ctxs), ctxs, Hq, Hkv, D, page, dtype, seed, scales, writer)
    scale = 1.0 / math.sqrt(D)
    configs.set_override("decode_splits", splits)
    try:
        out, lse = ops.decode(q, kc, vc, tables, ctx, scale, True, ks, vs)
        plain = ops.decode(q, kc, vc, tables, ctx, scale, False, ks, vs)
    finally:
        configs.set_override("decode_splits", None)
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, out)
    _check(out, lse, q, dk, dv, cu_q, False, scale,
           f"fp8 decode ctx{ctxs[:6]} H{Hq}/{Hkv} D{D} p{page} {scales} {writer} splits={splits}")
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


# ----------------------------------------------------------------- GPU


GPU_PAGED = [
    ([1, 4, 17, 0, 300, 1], [32768, 1000, 4111, 5, 2048, 0], 32, 8, 128, 16),
    ([1, 4, 1, 4], [32768, 32768, 97, 16], 16, 2, 128, 256),
    ([17, 1], [1023, 9000], 16, 16, 64, 1),
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
