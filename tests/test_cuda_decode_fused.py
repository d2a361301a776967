"""GPU tests of the one-launch split reduction of the CUDA decode (decode/select.cuh
variant bit 0x400: the last CTA of each (sequence, KV head, head chunk) merges the
splits) and of the register-ring tilings 13-16, against an fp64 oracle written here.

Run on the H200: `PYTHONPATH=src pytest -m gpu tests/test_cuda_decode_fused.py`.
The fused reduction repeats the two-launch reduction's arithmetic in split order,
so the two must agree bitwise (o and lse); against fp64 the error may be at most
twice that of the same attention computed in the inputs' precision, plus a floor.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

FUSED = 0x400  # decode/select.cuh kVariantFused
MMA = 10  # tensor-core kernel, any group size
SCALAR = 12  # scalar kernel's default tiling, any group size
RINGS = (13, 14, 15, 16, 17)  # G=2, D=128 scalar tilings with a fused build: register rings, 17 the PIPE one
ODD = [0, 1, 17, 97, 1023, 4097]


@pytest.fixture(scope="module")
def ops():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from minipaged.cuda import ops as cuda_ops

    return cuda_ops


def _problem(Hq, Hkv, D, page, lens, dtype, seed=0, fp8=False):
    """q and paged caches with shuffled pages; every slot that holds no token is NaN and
    every table entry past a sequence's pages is -1. fp8: caches are float8_e4m3fn with
    per-head scales (the stored value times its scale is the real value)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    B = len(lens)
    nblk = [(n + page - 1) // page for n in lens]
    max_blocks = max(nblk + [1]) + 1
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=g, device=dev).cpu()
    table = torch.full((B, max_blocks), -1, dtype=torch.int32)
    nxt = 0
    for b, nb in enumerate(nblk):
        table[b, :nb] = perm[nxt : nxt + nb].to(torch.int32)
        nxt += nb
    kc = torch.full((num_blocks, page, Hkv, D), float("nan"), device=dev)
    vc = torch.full_like(kc, float("nan"))
    # Keys with a spread per head, so that the softmax rows are far from uniform.
    amp = 0.5 + 1.5 * torch.rand(Hkv, 1, generator=g, device=dev)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        pos = torch.arange(n)
        blk = table[b, pos // page].long().to(dev)
        off = (pos % page).to(dev)
        kc[blk, off] = torch.randn(n, Hkv, D, generator=g, device=dev) * amp
        vc[blk, off] = torch.randn(n, Hkv, D, generator=g, device=dev)
    q = torch.randn(B, Hq, D, generator=g, device=dev).to(dtype)
    ks = vs = None
    if fp8:
        ks = (amp.flatten() * 4 / 448).float()
        vs = torch.full((Hkv,), 4 / 448, device=dev)
        kc = (kc / ks.view(1, 1, -1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)  # NaN stays NaN
        vc = (vc / vs.view(1, 1, -1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    else:
        kc, vc = kc.to(dtype), vc.to(dtype)
    return q, kc, vc, table.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev), ks, vs


def _oracle(q, kc, vc, table, lens, scale, ks=None, vs=None, compute=torch.float64):
    """Attention of each sequence over its own tokens, gathered through the table, in
    `compute` precision (float64: the oracle; q's dtype: the low-precision yardstick).
    -> o [B,Hq,D] float64, lse [B,Hq] float64 (natural log, -inf for an empty context)."""
    B, Hq, D = q.shape
    page, Hkv = kc.shape[1], kc.shape[2]
    group = Hq // Hkv
    if ks is not None:  # dequantise the whole cache first: no fp8 gather needed
        kc = kc.double() * ks.double().view(1, 1, -1, 1)
        vc = vc.double() * vs.double().view(1, 1, -1, 1)
    o = torch.zeros(B, Hq, D, dtype=torch.float64, device=q.device)
    lse = torch.full((B, Hq), -math.inf, dtype=torch.float64, device=q.device)
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        blk = table[b, pos // page].long()
        k = kc[blk, pos % page]  # [n, Hkv, D]
        v = vc[blk, pos % page]
        k = k.to(compute).repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v.to(compute).repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].to(compute), k).double() * scale
        m = s.max(dim=1, keepdim=True).values
        p = torch.exp(s - m)
        l = p.sum(dim=1, keepdim=True)
        o[b] = torch.einsum("hn,nhd->hd", (p / l).to(compute), v).double()
        lse[b] = (m + torch.log(l)).squeeze(1)
    return o, lse


def _check(out, lse, ref, ref_lse, lp, what):
    """|out - ref| <= 2 |lp - ref| + floor (elementwise max), lse within 2e-3 relative."""
    assert not torch.isnan(out).any(), f"{what}: NaN in o"
    err = (out.double() - ref).abs().max().item()
    lp_err = (lp.to(out.dtype).double() - ref).abs().max().item()
    floor = 2e-3 if out.dtype == torch.bfloat16 else 4e-4
    assert err <= 2 * lp_err + floor, f"{what}: max err {err:.3e} vs low-precision computation {lp_err:.3e}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin) and (lse[~fin] < 0).all(), f"{what}: lse -inf pattern"
    lerr = (lse.double()[fin] - ref_lse[fin]).abs()
    assert (lerr <= 2e-3 * (1 + ref_lse[fin].abs())).all(), f"{what}: lse err {lerr.max().item():.3e}"


def _same(a, b):
    return all(torch.equal(x.view(torch.int16 if x.dtype != torch.float32 else torch.int32),
                           y.view(torch.int16 if y.dtype != torch.float32 else torch.int32)) for x, y in zip(a, b))


HEADS = [(8, 8), (16, 8), (16, 4), (16, 2), (12, 3)]  # GQA 1, 2, 4, 8, 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("page", [1, 16, 256])
def test_fused_matches_oracle_and_two_launch_bitwise(ops, dtype, heads, D, page):
    Hq, Hkv = heads
    q, kc, vc, bt, cl, _, _ = _problem(Hq, Hkv, D, page, ODD, dtype, seed=D + page + Hq)
    scale = 1 / math.sqrt(D)
    ref, ref_lse = _oracle(q, kc, vc, bt, cl, scale)
    lp, _ = _oracle(q, kc, vc, bt, cl, scale, compute=dtype)
    tilings = [0, MMA, SCALAR] + (list(RINGS) if (Hq // Hkv == 2 and D == 128) else [])
    for t in tilings:
        for splits in (0, 1, 3, 64):
            what = f"{dtype} H{Hq}/{Hkv} D{D} p{page} tiling {t} splits {splits}"
            two = ops.decode(q, kc, vc, bt, cl, scale, True, num_splits=splits, variant=t)
            one = ops.decode(q, kc, vc, bt, cl, scale, True, num_splits=splits, variant=t | FUSED)
            _check(*one, ref, ref_lse, lp, what + " fused")
            _check(*two, ref, ref_lse, lp, what + " two-launch")
            # The split heuristic (0) follows the kernel's occupancy, which the fused tail may
            # change (tiling 13): bits are comparable at a forced split count.
            if splits:
                assert _same(one, two), f"{what}: fused and two-launch differ"
            assert (one[0][cl == 0] == 0).all()


@pytest.mark.parametrize("splits", list(range(1, 65)))
def test_every_forced_split_count_bitwise(ops, splits):
    q, kc, vc, bt, cl, _, _ = _problem(16, 8, 128, 16, ODD, torch.bfloat16, seed=splits)
    two = ops.decode(q, kc, vc, bt, cl, 0.0883, True, num_splits=splits)
    one = ops.decode(q, kc, vc, bt, cl, 0.0883, True, num_splits=splits, variant=FUSED)
    assert _same(one, two), f"splits {splits}: fused and two-launch differ"
    if splits in (1, 2, 7, 64):
        ref, ref_lse = _oracle(q, kc, vc, bt, cl, 0.0883)
        lp, _ = _oracle(q, kc, vc, bt, cl, 0.0883, compute=torch.bfloat16)
        _check(*one, ref, ref_lse, lp, f"splits {splits}")


def test_o_without_lse_is_the_same_bits(ops):
    q, kc, vc, bt, cl, _, _ = _problem(16, 8, 128, 16, ODD, torch.bfloat16, seed=3)
    for t in (0, MMA, 14):
        with_lse, _ = ops.decode(q, kc, vc, bt, cl, 0.0883, True, num_splits=9, variant=t | FUSED)
        plain = ops.decode(q, kc, vc, bt, cl, 0.0883, False, num_splits=9, variant=t | FUSED)
        assert torch.equal(with_lse, plain)


def test_all_empty_contexts(ops):
    q, kc, vc, bt, cl, _, _ = _problem(16, 8, 128, 16, [0, 0, 0], torch.bfloat16, seed=4)
    bt = torch.full((3, 8), -1, dtype=torch.int32, device="cuda")  # capacity 8 pages, none used
    kc = torch.full((4, 16, 8, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    vc = kc.clone()
    for t in (0, MMA):
        o, lse = ops.decode(q, kc, vc, bt, cl, 0.0883, True, num_splits=5, variant=t | FUSED)
        assert (o == 0).all() and torch.isneginf(lse).all()


def test_repeated_calls_reset_counters(ops):
    """A counter left non-zero would make a later call merge too early (wrong o) or never (o unwritten)."""
    q, kc, vc, bt, cl, _, _ = _problem(16, 8, 128, 16, ODD, torch.bfloat16, seed=5)
    want = {s: ops.decode(q, kc, vc, bt, cl, 0.0883, True, num_splits=s) for s in (3, 64, 7, 1, 16)}
    for _ in range(3):
        outs = [(s, ops.decode(q, kc, vc, bt, cl, 0.0883, True, num_splits=s, variant=FUSED))
                for s in (3, 64, 7, 1, 16)]  # back to back, no sync
        for s, got in outs:
            assert _same(got, want[s]), f"splits {s}"


def test_two_streams(ops):
    """Counters are per (device, stream): concurrent calls on two streams must not share them."""
    q, kc, vc, bt, cl, _, _ = _problem(16, 8, 128, 16, ODD, torch.bfloat16, seed=6)
    want = ops.decode(q, kc, vc, bt, cl, 0.0883, True, num_splits=32)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = []
    for i in range(8):
        with torch.cuda.stream(streams[i % 2]):
            outs.append(ops.decode(q, kc, vc, bt, cl, 0.0883, True, num_splits=32, variant=FUSED))
    torch.cuda.synchronize()
    for got in outs:
        assert _same(got, want)


@pytest.mark.parametrize("variant", [FUSED, MMA | FUSED, 15 | FUSED])
def test_graph_captured_once_replayed_100_times(ops, variant):
    """The first fused call on torch's capture stream happens inside the capture: its
    counters are allocated and zeroed then, outside the graph."""
    # every replay's context lens stay within the tokens written (the rest of each page is NaN)
    q, kc, vc, bt, cl, _, _ = _problem(16, 8, 128, 16, [8, 500, 3000, 64], torch.bfloat16, seed=7)
    static_q, static_cl = q.clone(), cl.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_lse = ops.decode(static_q, kc, vc, bt, static_cl, 0.0883, True, num_splits=7,
                                            variant=variant)
    g = torch.Generator(device="cuda").manual_seed(8)
    for trial in range(100):
        static_q.copy_(torch.randn(q.shape, generator=g, device="cuda").to(q.dtype))
        static_cl.copy_(torch.tensor([1 + trial % 7, 500 - trial, 3000 - 7 * trial, 0], dtype=torch.int32))
        graph.replay()
        eager = ops.decode(static_q, kc, vc, bt, static_cl, 0.0883, True, num_splits=7, variant=variant & ~FUSED)
        assert _same((static_out, static_lse), eager), f"replay {trial}"
        assert (static_out[3] == 0).all()
    ref, ref_lse = _oracle(static_q, kc, vc, bt, static_cl, 0.0883)
    lp, _ = _oracle(static_q, kc, vc, bt, static_cl, 0.0883, compute=torch.bfloat16)
    _check(static_out, static_lse, ref, ref_lse, lp, "last replay")


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("heads", [(8, 8), (16, 8), (16, 2)], ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
def test_fp8_fused(ops, D, heads):
    Hq, Hkv = heads
    q, kc, vc, bt, cl, ks, vs = _problem(Hq, Hkv, D, 16, ODD, torch.bfloat16, seed=D + Hq, fp8=True)
    scale = 1 / math.sqrt(D)
    ref, ref_lse = _oracle(q, kc, vc, bt, cl, scale, ks, vs)
    lp, _ = _oracle(q, kc, vc, bt, cl, scale, ks, vs, compute=torch.bfloat16)
    for t in (0, MMA, SCALAR):
        for splits in (0, 3, 40):
            two = ops.decode(q, kc, vc, bt, cl, scale, True, ks, vs, num_splits=splits, variant=t)
            one = ops.decode(q, kc, vc, bt, cl, scale, True, ks, vs, num_splits=splits, variant=t | FUSED)
            _check(*one, ref, ref_lse, lp, f"fp8 H{Hq}/{Hkv} D{D} tiling {t} splits {splits}")
            if splits:  # the heuristic follows each kernel's occupancy
                assert _same(one, two), f"fp8 tiling {t} splits {splits}: fused and two-launch differ"


def test_paged_entry_point_takes_the_fused_bit(ops):
    """A pure decode batch through ops.paged runs the decode kernels, fused bit included."""
    q, kc, vc, bt, cl, _, _ = _problem(16, 8, 128, 16, ODD, torch.bfloat16, seed=9)
    cu = torch.arange(len(ODD) + 1, dtype=torch.int32, device="cuda")
    a = ops.paged(q, kc, vc, bt, cu, cl, 1, True, 0.0883, True, num_splits=11, variant=FUSED)
    b = ops.decode(q, kc, vc, bt, cl, 0.0883, True, num_splits=11)
    assert _same(a, b)
