"""FP8 (float8_e4m3fn) attention problems shared by test_cuda_fp8.py and test_triton_fp8.py:
real-valued K/V quantised into NaN-poisoned fp8 paged caches through shuffled block tables,
with the K/V the oracle must see, dequantised exactly from the cache's own bytes; the
quantiser's edge values, the fp64 oracle on those K/V and the one error rule.

Everything random is drawn on the host from one generator seeded by `seed`, in a fixed
order, so a seed names the same problem on every device and in both backends' tests.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

FP8 = torch.float8_e4m3fn
SCALE_MODES = ("per-head", "equal")


def torch_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, Hkv, D], scale float32 [Hkv] -> fp8 by torch's own cast of the clamped quotient."""
    return torch.clamp(x.float() / scale[None, :, None].to(x.device), -448.0, 448.0).to(FP8)


def poison(shape, g: torch.Generator) -> torch.Tensor:
    """fp8 NaN bytes (0x7F / 0xFF) with random sign, on the host."""
    b = torch.where(torch.rand(shape, generator=g) < 0.5, 0x7F, 0xFF).to(torch.uint8)
    return b.view(FP8)


def kv_scales(Hkv: int, mode: str, amp: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """float32 [Hkv] scales sized to the per-head magnitudes amp. "equal": one value for
    every head (what a scalar scale becomes; draws nothing); "per-head": near each head's
    own range times a distinct random factor."""
    if mode == "equal":
        return torch.full((Hkv,), float(amp.max()) * 4 / 448, dtype=torch.float32)
    if mode != "per-head":
        raise ValueError(f"scales={mode!r}: must be one of {SCALE_MODES}")
    return (amp * 4 / 448 * (0.5 + torch.rand(Hkv, generator=g))).float()


class Fp8Problem(NamedTuple):
    q: torch.Tensor            # [sum(q_lens), Hq, D] dtype
    k_cache: torch.Tensor      # [num_blocks, page, Hkv, D] fp8
    v_cache: torch.Tensor
    tables: torch.Tensor       # [len(ctxs), max_blocks] int32, -1 past each sequence's pages
    cu_q: torch.Tensor         # [len(q_lens) + 1] int32
    ctx: torch.Tensor          # [len(ctxs)] int32
    k_scale: torch.Tensor      # [Hkv] float32
    v_scale: torch.Tensor
    deq_k: list                # per sequence [ctx, Hkv, D] float64, read back from the cache
    deq_v: list


def _assert_bytes_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.equal(got, want):
        diff = got != want
        i = tuple(diff.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(diff.sum())} bytes differ from torch's cast, first at {i}: "
                             f"got 0x{int(got[i]):02x} want 0x{int(want[i]):02x}")


def fp8_problem(q_lens, ctxs, Hq, Hkv, D, page, dtype, seed=0, scales="per-head", *,
                device, write_kv: Callable | None = None) -> Fp8Problem:
    """K/V with a different magnitude per KV head, quantised into a NaN-byte fp8 cache
    through shuffled block tables (entries past each sequence's pages -1); every tensor
    returned lives on `device`.

    write_kv None: the cache bytes are torch's cast. Otherwise the backend's
    write_kv(k, v, k_cache, v_cache, slots_int32, k_scale, v_scale) writes them (on
    `device`) and must produce exactly torch's bytes. deq_k / deq_v are those bytes
    dequantised exactly in fp64 (an fp8 value times an fp32 scale is exact there), so
    the oracle sees the cache the kernel reads and quantisation error is never blamed
    on a kernel."""
    g = torch.Generator().manual_seed(seed)
    k_amp = 0.5 + 3 * torch.rand(Hkv, generator=g)
    v_amp = 0.1 + 5 * torch.rand(Hkv, generator=g)
    k_scale, v_scale = kv_scales(Hkv, scales, k_amp, g), kv_scales(Hkv, scales, v_amp, g)
    dense_k = [(torch.randn(c, Hkv, D, generator=g) * k_amp[None, :, None]).to(dtype) for c in ctxs]
    dense_v = [(torch.randn(c, Hkv, D, generator=g) * v_amp[None, :, None]).to(dtype) for c in ctxs]
    need = [-(-c // page) for c in ctxs]
    max_blocks = max(need + [1]) + 1
    num_blocks = sum(need) + 3
    kc = poison((num_blocks, page, Hkv, D), g)
    vc = poison((num_blocks, page, Hkv, D), g)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(ctxs), max_blocks), -1, dtype=torch.int32)
    slot_lists, nxt = [], 0
    for s, c in enumerate(ctxs):
        tables[s, : need[s]] = perm[nxt: nxt + need[s]].to(torch.int32)
        nxt += need[s]
        tok = torch.arange(c)
        slot_lists.append(tables[s].long()[tok // page] * page + tok % page)
    kc, vc = kc.to(device), vc.to(device)
    ks, vs = k_scale.to(device), v_scale.to(device)
    slots = torch.cat(slot_lists + [torch.zeros(0, dtype=torch.long)]).to(device)
    kk = torch.cat(dense_k + [torch.zeros(0, Hkv, D, dtype=dtype)]).to(device)
    vv = torch.cat(dense_v + [torch.zeros(0, Hkv, D, dtype=dtype)]).to(device)
    # indexing through uint8 views: fp8 index_put / gather need not exist on every torch
    flat_k, flat_v = kc.view(torch.uint8).view(-1, Hkv, D), vc.view(torch.uint8).view(-1, Hkv, D)
    want_k, want_v = torch_quant(kk, ks).view(torch.uint8), torch_quant(vv, vs).view(torch.uint8)
    if write_kv is None:
        flat_k[slots], flat_v[slots] = want_k, want_v
    else:
        write_kv(kk, vv, kc, vc, slots.to(torch.int32), ks, vs)
        _assert_bytes_equal(flat_k[slots], want_k, "write_kv K")
        _assert_bytes_equal(flat_v[slots], want_v, "write_kv V")
    deq_k = [flat_k[sl.to(device)].view(FP8).double() * ks.double()[None, :, None] for sl in slot_lists]
    deq_v = [flat_v[sl.to(device)].view(FP8).double() * vs.double()[None, :, None] for sl in slot_lists]
    q = torch.randn(sum(q_lens), Hq, D, generator=g).to(dtype).to(device)
    cu_q = torch.tensor([sum(q_lens[:i]) for i in range(len(q_lens) + 1)], dtype=torch.int32).to(device)
    ctx = torch.tensor(ctxs, dtype=torch.int32).to(device)
    return Fp8Problem(q, kc, vc, tables.to(device), cu_q, ctx, ks, vs, deq_k, deq_v)


# ----------------------------------------------------------------- quantisation truth

NEG_INF = float("-inf")


def e4m3_finite_values() -> torch.Tensor:
    """All finite e4m3fn values in increasing order (no NaN codes, one zero)."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    return torch.unique(vals[torch.isfinite(vals)])  # sorted, +-0 merged


def special_values() -> torch.Tensor:
    """fp32 values at every rounding edge of e4m3 (scale 1): the values, the ties (exact in
    fp32), their neighbours, quarter steps through the subnormals, the saturation edge, inf,
    NaN, both signs."""
    v = e4m3_finite_values()
    pos = v[v >= 0]
    mids = (pos[1:] + pos[:-1]) / 2
    up = torch.nextafter(mids, torch.tensor(float("inf")))
    down = torch.nextafter(mids, torch.tensor(0.0))
    step = 2.0 ** -9
    sub = torch.arange(0, 2 ** -6 + step, step / 4)
    tiny = torch.tensor([1e-30, 1e-40, 2.0 ** -149, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -11,
                         2.0 ** -10 + 2.0 ** -30, 2.0 ** -6 - 2.0 ** -30])
    big = torch.tensor([448.0, 448.0001, 455.0, 463.99, 464.0, 464.01, 470.0, 479.99, 480.0, 500.0,
                        511.99, 512.0, 1e4, 3e38, float("inf")])
    mag = torch.cat([v.abs(), pos, mids, up, down, sub, tiny, big, torch.nextafter(big, torch.tensor(0.0))])
    return torch.cat([mag, -mag, torch.tensor([0.0, -0.0, float("nan"), -float("nan")])])


# ----------------------------------------------------------------- oracle


def attend(q, k, v, diag, causal, scale, low_dtype=None):
    """q [n, Hq, D] of one sequence, k/v [L, Hkv, D] fp64 (dequantised), on k's device.
    Row i sees key j iff j < L (and j <= i + diag when causal). low_dtype None: fp64
    (o, lse); else q and K/V rounded to low_dtype, matmuls in it, fp32 softmax. The GQA
    group's query heads are stacked as rows of their KV head (no K/V copies per query head:
    long GPU contexts stay small)."""
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


def reference(q, deq_k, deq_v, cu_q, causal, scale, low_dtype=None):
    """Packed q [Tq, Hq, D] of the sequences cu_q over their dequantised K/V (deq_k[s],
    deq_v[s] [L_s, Hkv, D] fp64, all on one device) -> fp64 (o [Tq, Hq, D], lse [Tq, Hq]) on
    that device; bottom-right causal."""
    dev = deq_k[0].device if len(deq_k) else q.device
    Tq, Hq, D = q.shape
    o = torch.zeros(Tq, Hq, D, dtype=torch.float64, device=dev)
    lse = torch.full((Tq, Hq), NEG_INF, dtype=torch.float64, device=dev)
    cu = cu_q.tolist()
    for s in range(len(cu) - 1):
        a, b = cu[s], cu[s + 1]
        if b > a:
            k, v = deq_k[s], deq_v[s]
            o[a:b], lse[a:b] = attend(q[a:b], k, v, k.shape[0] - (b - a), causal, scale, low_dtype)
    return o, lse


def check(out, lse, q, deq_k, deq_v, cu_q, causal, scale, what):
    """out (and lse, when given) against the fp64 oracle: max error <= 2x that of the same
    attention in q's dtype + 2e-3 x max(1, |o|); rows that see no key exact zeros with lse
    -inf; lse within 2e-3 x (1 + |lse|)."""
    truth, truth_lse = reference(q, deq_k, deq_v, cu_q, causal, scale)
    base, _ = reference(q, deq_k, deq_v, cu_q, causal, scale, low_dtype=q.dtype)
    out = out.to(truth.device)
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
        lse = lse.to(truth.device)
        assert lse.dtype == torch.float32 and lse.shape == truth_lse.shape, what
        assert torch.equal(torch.isneginf(lse), empty), f"{what}: -inf lse pattern differs"
        assert not torch.isnan(lse).any(), what
        if (~empty).any():
            d = (lse.double() - truth_lse)[~empty].abs()
            assert (d <= 2e-3 * (1 + truth_lse[~empty].abs())).all(), f"{what}: lse err {d.max().item():.3e}"
