"""GPU tests of the `cuda` and `cuda-wmma` backends against minipaged.reference.

Run on the H200: `PYTHONPATH=src pytest -m gpu tests/test_cuda.py`.
Errors are bounded FlashAttention-style: the kernel's distance to an fp32
reference on the same (low-precision) inputs may be at most twice the distance
of the torch reference computed in the same low precision, plus a small floor.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from minipaged import reference
from sanitizer import SRC, run_under_sanitizer

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]


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


def _varlen_problem(seq_q, seq_k, num_q_heads, num_kv_heads, head_dim, dtype, gen):
    """Packed random q [Tq, Hq, D], k, v [Tk, Hkv, D] and the int32 cu_seqlens of both sides."""
    from minipaged.testing import cu_seqlens

    q = torch.randn(sum(seq_q), num_q_heads, head_dim, device="cuda", generator=gen).to(dtype)
    k = torch.randn(sum(seq_k), num_kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    v = torch.randn(sum(seq_k), num_kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    return q, k, v, cu_seqlens(seq_q, "cuda"), cu_seqlens(seq_k, "cuda")


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


MMA = 10  # decode/select.cuh tiling 10: the tensor-core kernel (decode/mma.cuh), any group size
SCALAR = 12  # decode/select.cuh tiling 12: the scalar kernel's default tiling for any group size
NO_PDL = 0x200  # decode/launch.cu kVariantNoPDL: plain launch of the split reduction
# params.h kDecodeVariantWorklistToggle: the decode work list toggled against its default (on) where
# the plan's gate allows one
WORKLIST_TOGGLE = 0x1000
# params.h kDecodeVariantEarlyTrigger / kDecodeVariantWorklistEarlyMerge: the split kernels' merge
# trigger at the loop's end instead of the CTA's start, a work list's merge reading its plan entry
# after its wait instead of before (each flipped against its default, on)
EARLY_TRIGGER = 0x2000
EARLY_MERGE = 0x4000
# params.h kDecodeVariantWorklistGroupedMerge: flips whether a work list's merge CTAs take four
# sequences each (by default only where that grid still gives every SM two CTAs)
GROUPED_MERGE = 0x10000
# params.h kDecodeVariantTwoWarpToggle: flips the rule (off by default) that runs
# the default tensor-core plan in two-warp CTAs where one CTA per (sequence, KV head) overflows a
# wave of the 4-warp kernel's, in tables of at most TWO_WARP_MAX_TABLE_TOKENS tokens (params.h
# kDecodeTwoWarpMaxTableTokens); decode/select.cuh tilings 20-22: that kernel forced, 3 / 4 / 2 stages
TWO_WARP = 0x20000
TWO_WARP_MAX_TABLE_TOKENS = 1024
# params.h kDecodeVariantWarpMerge: flips decode/splits.h decode_warp_merge_by_rule, the choice between
# the split merge with one warp per (sequence, query head) and 8 heads per CTA and the CTA merge,
# which give the same bits
WARP_MERGE = 0x40000
TWO_WARP_TILINGS = (20, 21, 22)


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


@pytest.mark.parametrize("variant", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 17, SCALAR, NO_PDL])
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(16, 8), (32, 8), (64, 8), (7, 7), (12, 3)], ids=["G2", "G4", "G8", "G1", "G4b"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("tiling", TWO_WARP_TILINGS)
def test_decode_two_warp_tilings(ops, dtype, heads, D, block_size, tiling):
    # the tensor-core kernel in two-warp CTAs (32-token tiles): empty, one-token and odd lengths,
    # every residue of a length mod the tile, forced splits that cut inside a tile run
    lens = [0, 1, 17, 31, 32, 33, 97, 1023, 2000]
    q, kc, vc, bt, cl = _paged_problem(len(lens), *heads, D, block_size, lens, dtype, seed=tiling + D)
    for num_splits in (0, 1, 7):
        _check_decode(ops, q, kc, vc, bt, cl, 1.0 / math.sqrt(D),
                      f"two-warp tiling {tiling} {dtype} {heads} D{D} bs{block_size} s{num_splits}",
                      variant=tiling, num_splits=num_splits)


def _batch_over_one_wave(num_kv_heads):
    """A batch whose (sequence, KV head) pairs overflow a wave of 4-warp tensor-core CTAs (2 per
    SM) on this GPU, so that the two-warp rule fires when flipped on."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return 2 * sms // num_kv_heads + 3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(16, 8), (32, 8), (64, 8)], ids=["G2", "G4", "G8"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("past_cap", [False, True], ids=["at-cap", "past-cap"])
def test_decode_two_warp_rule(ops, dtype, heads, D, past_cap):
    # the rule at its default and flipped (TWO_WARP) at a batch past one wave of the D 128 4-warp
    # kernel's CTAs, with short, empty and odd lengths, in a table of exactly the rule's cap (64
    # pages of 16: the longest sequence takes 63, _paged_problem adds a spare column) or one page
    # wider (the longest takes 64): both calls against the oracle; at the cap, from G 4 (where the
    # default plan is the tensor-core one), D 128 runs different kernels, so their bits differ,
    # while at D 64 (more CTAs per SM) the batch fits a wave and the bit must change nothing, as
    # it must past the cap; a graph replay gives the eager call's bits
    B = _batch_over_one_wave(heads[1])
    longest = TWO_WARP_MAX_TABLE_TOKENS - (0 if past_cap else 16)
    lens = [(0, 1, 17, 97, 192, 1007, 300)[b % 7] for b in range(B - 1)] + [longest]
    q, kc, vc, bt, cl = _paged_problem(B, *heads, D, 16, lens, dtype, seed=B + D)
    assert (bt.shape[1] * 16 > TWO_WARP_MAX_TABLE_TOKENS) == past_cap
    scale = 1.0 / math.sqrt(D)
    what = f"two-warp rule {dtype} {heads} D{D} B{B} width {bt.shape[1]}"
    out = _check_decode(ops, q, kc, vc, bt, cl, scale, what)
    flipped = _check_decode(ops, q, kc, vc, bt, cl, scale, what + " flipped", variant=TWO_WARP)
    if past_cap or D == 64:
        assert torch.equal(out, flipped), f"{what}: the rule's bit changed the result where it must not fire"
    elif heads[0] // heads[1] >= 4:
        assert not torch.equal(out, flipped), f"{what}: the rule's bit did not change the kernel"
    static_out = torch.empty_like(out)
    graph = torch.cuda.CUDAGraph()
    ops.decode(q, kc, vc, bt, cl, scale)  # (warm-up outside capture)
    with torch.cuda.graph(graph):
        static_out.copy_(ops.decode(q, kc, vc, bt, cl, scale))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, out), f"{what}: graph replay differs from the eager call"


@pytest.mark.parametrize("heads", [(16, 8), (32, 8), (64, 8)], ids=["G2", "G4", "G8"])
def test_paged_routed_rows_past_one_wave(ops, heads):
    # routed decode rows (packed-query kernels) in a mixed batch whose (sequence, KV head) pairs
    # overflow a wave of 4-warp CTAs, at the heuristic's split count: against the oracle, and bit
    # for bit the plain decode of those sequences alone, a batch past the wave too, so that a
    # batch-dependent kernel choice (the two-warp rule, whichever its default) picks the same
    # kernel for both (one split: every context fits one)
    B = _batch_over_one_wave(heads[1]) + 1
    S_q, S_ctx = [300] + [1] * (B - 1), [2000] + [(1, 17, 97, 192, 1023)[b % 5] for b in range(B - 1)]
    q, kc, vc, bt, cu, cl = _paged_case(S_q, S_ctx, *heads, 128, 16, torch.bfloat16, seed=B)
    o, lse = _check_paged(ops, q, kc, vc, bt, cu, cl, True, 0.0883, f"routed past one wave {heads} B{B}",
                          variant=ROUTED)
    o2, l2 = ops.paged(q, kc, vc, bt, cu, cl, 300, True, 0.0883, True, variant=ROUTED)
    od, ld = ops.decode(q[300:].contiguous(), kc, vc, bt[1:].contiguous(), cl[1:].contiguous(), 0.0883, True)
    assert torch.equal(od, o2[300:]) and torch.equal(ld, l2[300:]), "routed decode rows != decode op"


def test_decode_long_single_sequence_splits(ops):
    # B=1 with a long context takes the split-KV path through the heuristic.
    q, kc, vc, bt, cl = _paged_problem(1, 16, 8, 128, 16, [20000], torch.bfloat16, seed=5)
    _check_decode(ops, q, kc, vc, bt, cl, 0.0883, "B=1 L=20000")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("table_width", [0, 2048], ids=["tight", "wide"])
@pytest.mark.parametrize("variant", [0, MMA, SCALAR, WORKLIST_TOGGLE, MMA | WORKLIST_TOGGLE],
                         ids=["default", "mma", "scalar", "worklist-toggled", "mma-worklist-toggled"])
def test_decode_uneven_batch_splits(ops, dtype, table_width, variant):
    # More CTAs than half a wave of resident slots on any current GPU: the planner caps each
    # split's K/V bytes from the table width, and each sequence takes the splits its own length
    # needs (DecodeParams::split_min_tokens): one long sequence last among short, empty and
    # one-token ones. "wide": a table with room for 32k tokens, most of it -1, as a captured
    # graph's is.
    lens = [17, 0, 1, 300, 4096, 4097, 1023] * 12 + [20000]
    q, kc, vc, bt, cl = _paged_problem(len(lens), 16, 8, 128, 16, lens, dtype, seed=21)
    if table_width:
        pad = torch.full((bt.shape[0], table_width - bt.shape[1]), -1, dtype=bt.dtype, device=bt.device)
        bt = torch.cat([bt, pad], dim=1)
    _check_decode(ops, q, kc, vc, bt, cl, 0.0883, f"uneven batch {dtype} width {bt.shape[1]} v{variant}",
                  variant=variant)


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
    # head dims are the launcher's rule (api.py names it for users): a launch error here
    with pytest.raises(RuntimeError, match="launch_decode"):
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
        "prefill_fast_negative_scale": lambda: raw.prefill_fast(*[torch.randn(1, 2, 8, 64, device=dev, dtype=bf)] * 3,
                                                                True, -0.1),
        # k's head dim differs from q's: the kernel would read past k's rows
        "prefill_fast_k_d64": lambda: raw.prefill_fast(torch.randn(1, 2, 8, 128, device=dev, dtype=bf),
                                                       *[torch.randn(1, 2, 8, 64, device=dev, dtype=bf)] * 2, True, 0.1),
        "write_kv_int16": lambda: raw.write_kv_cache(kc[0], kc[0], kc, kc, torch.zeros(16, dtype=torch.int16, device=dev)),
        # cu_seqlens_q says 3 sequences, the table has 2 rows
        "paged_rows": lambda: raw.paged(torch.randn(6, 4, 128, device=dev, dtype=bf), kc, kc, bt,
                                        torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=dev),
                                        cl, 2, True, 0.1, False, 0, 0),
        "paged_cu_int64": lambda: raw.paged(torch.randn(6, 4, 128, device=dev, dtype=bf), kc, kc, bt,
                                            torch.tensor([0, 2, 6], device=dev), cl, 4, True, 0.1, False, 0, 0),
        "paged_block_size_3": lambda: raw.paged(torch.randn(6, 4, 128, device=dev, dtype=bf),
                                                torch.randn(4, 3, 2, 128, device=dev, dtype=bf),
                                                torch.randn(4, 3, 2, 128, device=dev, dtype=bf), bt,
                                                torch.tensor([0, 2, 6], dtype=torch.int32, device=dev),
                                                cl, 4, True, 0.1, False, 0, 0),
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
    # The binding raises TypeError/ValueError for what would break memory safety;
    # rules the launchers enforce (head dims, power-of-two pages, scale > 0 for
    # the prefill kernels) come back as RuntimeError launch failures.
    want = {"decode_fp32": "TypeError", "decode_d96": "RuntimeError", "prefill_fast_d96": "RuntimeError",
            "prefill_wmma_d96": "RuntimeError", "prefill_fast_negative_scale": "RuntimeError",
            "prefill_fast_k_d64": "ValueError", "write_kv_int16": "TypeError", "paged_rows": "ValueError",
            "paged_cu_int64": "TypeError", "paged_block_size_3": "RuntimeError"}
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


def test_binding_refuses_caches_and_tables_the_kernels_cannot_walk(ops):
    """api.py makes caches and tables kernel-ready; a direct ops call with a cache view whose
    rows are not 16-byte aligned, or a table with a column stride, is refused, not copied."""
    q, kc, vc, bt, cl = _paged_problem(2, 4, 2, 128, 16, [5, 9], torch.bfloat16)
    wide = torch.randn(*kc.shape[:-1], kc.shape[-1] + 1, device="cuda").to(kc.dtype)
    with pytest.raises((ValueError, RuntimeError), match="16-byte aligned rows"):
        ops.decode(q, wide[..., 1:], vc, bt, cl, 0.1)
    strided_bt = torch.stack([bt, bt], dim=-1)[..., 0]
    assert strided_bt.stride(1) == 2
    with pytest.raises((ValueError, RuntimeError), match="block_tables must have a contiguous last dim"):
        ops.decode(q, kc, vc, strided_bt, cl, 0.1)
    o = ops.decode(q, kc, vc, bt.contiguous(), cl, 0.1)  # the context is still usable
    assert torch.isfinite(o).all()


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


# Many short sequences: on sm_90 the dispatch runs the dynamic persistent warp-specialised
# kernel here (prefill/dispatch.cuh CfgWsDynamic: batch > 1, max_seqlen_q <= 2048, at least
# four waves of 128-row items on the SMs), whose CTAs take work items from a counter that the
# binding hands over zeroed and the kernel leaves zeroed. Against the fp64 oracle, then the
# same call again, eagerly and replayed from a CUDA graph, bit for bit (a counter left
# non-zero would skip items: rows of NaN poison or zeros).
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", ["varlen", "dense"])
def test_prefill_many_short_sequences(ops, dtype, D, causal, layout):
    from minipaged.testing import assert_close, prefill_ref, varlen_ref

    gen = torch.Generator(device="cuda").manual_seed(D + causal)
    Hq, Hkv, scale = 16, 8, 1 / math.sqrt(D)
    if layout == "varlen":
        seq_q = [1024, 1023, 977, 1, 2048, 129, 1024, 1000, 640, 17]
        seq_k = [1024, 1100, 977, 1, 2048, 129, 2000, 1000, 640, 3]  # Nk > Nq, and Nq > Nk (empty rows)
        q, k, v, cu_q, cu_k = _varlen_problem(seq_q, seq_k, Hq, Hkv, D, dtype, gen)
        args = (cu_q, cu_k, max(seq_q), max(seq_k), causal, scale)
        run = lambda: ops.prefill_varlen(q, k, v, *args)  # noqa: E731
        truth, _ = varlen_ref(q, k, v, cu_q, cu_k, causal=causal, scale=scale)
        lowp, _ = varlen_ref(q, k, v, cu_q, cu_k, causal=causal, scale=scale, lowp=True)
    else:
        B, N = 8, 1023
        q = torch.randn(B, Hq, N, D, device="cuda", generator=gen).to(dtype)
        k = torch.randn(B, Hkv, N, D, device="cuda", generator=gen).to(dtype)
        v = torch.randn(B, Hkv, N, D, device="cuda", generator=gen).to(dtype)
        run = lambda: ops.prefill(q, k, v, causal, scale)  # noqa: E731
        truth, _ = prefill_ref(q, k, v, causal=causal, scale=scale)
        lowp, _ = prefill_ref(q, k, v, causal=causal, scale=scale, lowp=True)
    _poison_allocator(q.numel())
    out = run()
    assert_close(out, truth, lowp, f"many short {layout} {dtype} D{D} causal={causal}")
    for _ in range(3):
        assert torch.equal(run(), out), "a second call differs (scheduler counters not reset?)"
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up on the capture stream: its counters are allocated outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            static_out = run()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, out), "graph replay differs from the eager call"


def _check_long_prefill(ops, what, B, Hq, Hkv, D, nq, nk, causal, dtype, seed):
    """A long dense (nq, nk: one length each, B sequences) or varlen (one length per sequence)
    prefill against the float64 oracle, one KV head's query heads at a time to keep the oracle's
    scores small, on NaN-poisoned memory; then a second call, bit for bit."""
    from minipaged.testing import assert_close, prefill_ref, varlen_ref

    gen = torch.Generator(device="cuda").manual_seed(seed)
    group, scale = Hq // Hkv, 1 / math.sqrt(D)
    if len(nq) == 1:
        q = torch.randn(B, Hq, nq[0], D, device="cuda", generator=gen).to(dtype)
        k = torch.randn(B, Hkv, nk[0], D, device="cuda", generator=gen).to(dtype)
        v = torch.randn(B, Hkv, nk[0], D, device="cuda", generator=gen).to(dtype)
        run = lambda: ops.prefill(q, k, v, causal, scale)  # noqa: E731

        def ref(h, lowp):
            kh = slice(h // group, h // group + 1)
            return prefill_ref(q[:, h:h + group], k[:, kh], v[:, kh], causal=causal, scale=scale, lowp=lowp)[0]
    else:
        q, k, v, cu_q, cu_k = _varlen_problem(nq, nk, Hq, Hkv, D, dtype, gen)
        args = (cu_q, cu_k, max(nq), max(nk), causal, scale)
        run = lambda: ops.prefill_varlen(q, k, v, *args)  # noqa: E731

        def ref(h, lowp):
            kh = slice(h // group, h // group + 1)
            return varlen_ref(q[:, h:h + group], k[:, kh], v[:, kh], cu_q, cu_k, causal=causal, scale=scale,
                              lowp=lowp)[0]

    _poison_allocator(q.numel())
    out = run()
    for h in range(0, Hq, group):
        part = out.narrow(1, h, group)  # the head axis of both layouts
        assert_close(part, ref(h, False), ref(h, True), f"{what}, q heads {h}..{h + group - 1}")
    assert torch.equal(run(), out), "a second call differs"


# Long prompts whose K/V (and Q, O) exceed the L2 (60 MiB on the H200), on the sm_90
# warp-specialised kernel: dense 10k (1,280 items of 128 rows over 16 heads) and
# varlen over three sequences whose items interleave.
@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_prefill_long_beyond_l2(ops, layout):
    if layout == "dense":
        nq = nk = [10240]
    else:
        nq, nk = [8192, 3000, 2049], [8192, 5000, 2049]
    _check_long_prefill(ops, f"long {layout}", 1, 16, 8, 128, nq, nk, True, torch.bfloat16, seed=11)


# Grids whose K/V do not fit in the L2, which the sm_90 dispatch runs in L2 sections of whole
# GQA groups (prefill/dispatch.cuh, CfgWsL2): B=1 N=16k (8 KV heads in sections of 3, 3, 2),
# five fp16 sequences of 1000 queries over 8192 keys without a mask at D=64 (G=1), and a varlen
# batch at G=4 with Nq < Nk in one sequence.
_L2_CASES = {
    "dense16k": dict(B=1, Hq=16, Hkv=8, D=128, nq=[16384], nk=[16384], causal=True, dtype=torch.bfloat16),
    "dense-b5-d64-full": dict(B=5, Hq=8, Hkv=8, D=64, nq=[1000], nk=[8192], causal=False, dtype=torch.float16),
    "varlen-g4": dict(B=3, Hq=32, Hkv=8, D=128, nq=[12000, 4000, 7000], nk=[12000, 9000, 7000], causal=True,
                      dtype=torch.bfloat16),
}


@pytest.mark.parametrize("case", list(_L2_CASES))
def test_prefill_l2_sections(ops, case):
    c = _L2_CASES[case]
    keys = sum(c["nk"]) if len(c["nk"]) > 1 else c["B"] * c["nk"][0]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    assert keys * c["Hkv"] * c["D"] * 2 * 2 > l2, "the K/V must exceed the L2 for the sectioned order to run"
    _check_long_prefill(ops, case, c["B"], c["Hq"], c["Hkv"], c["D"], c["nq"], c["nk"], c["causal"], c["dtype"],
                        seed=len(case))


# Grids of at most one wave of 128-row items on the sm_90 warp-specialised kernel (between
# half a wave, where prefill/dispatch.cuh starts to take it, and 132 CTAs at Hq=16, D=128):
# no other test lands there. Dense causal and full, Nq < Nk, and a varlen batch of one
# sequence; the float64 oracle, then a second call.
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("nq,nk", [(1024, 1024), (1000, 1000), (600, 1000), (897, 2049)])
def test_prefill_one_wave(ops, causal, nq, nk):
    from minipaged.testing import assert_close, cu_seqlens, prefill_ref

    gen = torch.Generator(device="cuda").manual_seed(nq + nk)
    Hq, Hkv, D, dtype = 16, 8, 128, torch.bfloat16
    scale = 1 / math.sqrt(D)
    assert 66 <= Hq * -(-nq // 128) <= 132  # the one-wave range on 132 SMs
    q = torch.randn(1, Hq, nq, D, device="cuda", generator=gen).to(dtype)
    k = torch.randn(1, Hkv, nk, D, device="cuda", generator=gen).to(dtype)
    v = torch.randn(1, Hkv, nk, D, device="cuda", generator=gen).to(dtype)
    _poison_allocator(q.numel())
    out = ops.prefill(q, k, v, causal, scale)
    truth = prefill_ref(q, k, v, causal=causal, scale=scale, lowp=False)[0]
    lowp = prefill_ref(q, k, v, causal=causal, scale=scale, lowp=True)[0]
    assert_close(out, truth, lowp, f"one wave {nq}x{nk} causal={causal}")
    assert torch.equal(ops.prefill(q, k, v, causal, scale), out), "a second call differs"
    # the same problem as a varlen batch of one sequence, against the same oracle rows
    qv, kv, vv = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))
    args = (cu_seqlens([nq], "cuda"), cu_seqlens([nk], "cuda"), nq, nk, causal, scale)
    out_v = ops.prefill_varlen(qv, kv, vv, *args)
    assert_close(out_v, truth[0].transpose(0, 1), lowp[0].transpose(0, 1), f"one wave varlen {nq}x{nk} causal={causal}")


# The one-wave range as a varlen batch of unequal sequences. A causal grid there runs each CTA on
# two 64-row blocks from opposite ends of its sequence (sm_90: WsCfg::kMirror): a cached prefix,
# rows that see no key, an odd count of 64-row blocks (the middle one alone), a sequence shorter
# than the longest (pairs past its blocks), the lse, and a second call.
@pytest.mark.parametrize("seq_q,seq_k", [([1000, 333], [1000, 2000]), ([777, 900], [700, 901])],
                         ids=["prefix", "empty-rows"])
def test_prefill_one_wave_varlen(ops, seq_q, seq_k):
    from minipaged.testing import assert_close, cu_seqlens, varlen_ref

    gen = torch.Generator(device="cuda").manual_seed(sum(seq_q))
    Hq, Hkv, D, dtype, scale = 8, 4, 128, torch.bfloat16, 0.0883
    assert 66 <= len(seq_q) * Hq * -(-max(seq_q) // 128) <= 132  # the one-wave range on 132 SMs
    q = torch.randn(sum(seq_q), Hq, D, device="cuda", generator=gen).to(dtype)
    k = torch.randn(sum(seq_k), Hkv, D, device="cuda", generator=gen).to(dtype)
    v = torch.randn(sum(seq_k), Hkv, D, device="cuda", generator=gen).to(dtype)
    cu_q, cu_k = cu_seqlens(seq_q, "cuda"), cu_seqlens(seq_k, "cuda")
    _poison_allocator(q.numel())
    args = (cu_q, cu_k, max(seq_q), max(seq_k), True, scale)
    out, lse = ops.prefill_varlen(q, k, v, *args, True)
    truth, lse64 = varlen_ref(q, k, v, cu_q, cu_k, causal=True, scale=scale)
    lowp = varlen_ref(q, k, v, cu_q, cu_k, causal=True, scale=scale, lowp=True)[0]
    assert_close(out, truth, lowp, f"one wave varlen {seq_q}x{seq_k}")
    _check_lse(lse, lse64, f"one wave varlen {seq_q}x{seq_k}")
    assert torch.equal(ops.prefill_varlen(q, k, v, *args), out), "a second call differs"


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
    # Cached tokens cover the longest context of every trial (slots past them are NaN).
    q, kc, vc, bt, cl = _paged_problem(4, 16, 8, 128, 16, [3, 500, 3000, 64], torch.bfloat16, seed=2)
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
            assert torch.isfinite(static_out[:3]).all()
            assert torch.equal(static_out, eager)
            assert (static_out[3] == 0).all()


def _reference_decode_by_length(q, k_cache, v_cache, block_tables, context_lens, scale, longest=4096):
    """reference.decode over the sequences of up to `longest` tokens in one call and each longer
    one alone: its gather pads every sequence to the batch's longest (128 sequences, one of 30k
    tokens, 16 KV heads at fp32: a 31 GB gather)."""
    lens = context_lens.tolist()
    short = [b for b, n in enumerate(lens) if n <= longest]
    groups = ([short] if short else []) + [[b] for b, n in enumerate(lens) if n > longest]
    out = torch.empty_like(q)
    for group in groups:
        idx = torch.tensor(group, device=q.device)
        out[idx] = reference.decode(q[idx], k_cache, v_cache, block_tables[idx], context_lens[idx], scale)
    return out


@pytest.mark.parametrize("variant", [0, WORKLIST_TOGGLE], ids=["default", "worklist-toggled"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_decode_worklist_graph_follows_lengths(ops, fp8, variant):
    # A batch the plan gives a work list (decode/launch.cu plan_splits: 128 sequences over 16 KV
    # heads are more than half a wave, in a table 3+ split-byte caps wide; the wave cap leaves
    # one or two splits per sequence, and the work list 2 slots per sequence:
    # scripts/decode_selftest.cu checks which plan runs), with the work list and without
    # (whichever the default, the toggle gives the other): a work list's plan is derived on the
    # device from context_lens, so a captured graph replayed with other lengths (one long
    # sequence moving around the batch, empty ones) must give the eager call's bits, within the
    # oracle's bound.
    B = 128
    lens = [97, 0, 1, 300, 17, 1023, 640, 129] * (B // 8)
    lens[5] = 30000
    # room for every length a trial gives (a length past its table's pages is the caller's bug)
    pages_for = [30000 if b in (0, 1, 2, 5) else 1024 for b in range(B)]
    q, kc, vc, bt, cl = _paged_problem(B, 32, 16, 128, 16, pages_for, torch.bfloat16, seed=31)
    kw = dict(variant=variant)
    if fp8:
        kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        scales = torch.full((16,), 0.5, device="cuda")
        kw.update(k_scale=scales, v_scale=scales)
    static_cl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            ops.decode(q, kc, vc, bt, static_cl, 0.0883, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = ops.decode(q, kc, vc, bt, static_cl, 0.0883, **kw)
    for trial, long_at in enumerate((5, 0, 2, 1)):
        new = [(17 * trial + b) % 700 for b in range(B)]
        new[long_at] = 30000 - trial
        new[(long_at + 3) % B] = 0
        static_cl.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        eager = ops.decode(q, kc, vc, bt, static_cl, 0.0883, **kw)
        assert torch.equal(static_out, eager), f"trial {trial}: graph replay differs from the eager call"
        assert (eager[(long_at + 3) % B] == 0).all()
        if fp8:
            k32, v32 = kc.float() * 0.5, vc.float() * 0.5
            ref32 = _reference_decode_by_length(q.float(), k32, v32, bt, static_cl, 0.0883)
            ref_lp = _reference_decode_by_length(q, k32.to(q.dtype), v32.to(q.dtype), bt, static_cl, 0.0883)
        else:
            ref32 = _reference_decode_by_length(q.float(), kc.float(), vc.float(), bt, static_cl, 0.0883)
            ref_lp = _reference_decode_by_length(q, kc, vc, bt, static_cl, 0.0883)
        _bound(eager, ref_lp, ref32, f"variant {variant:#x} trial {trial}")


@pytest.mark.parametrize("splits", [0, 3, 256])
def test_decode_pdl_launch_is_bitwise_plain_launch(ops, splits):
    # The reduction launched early (programmatic dependent launch) must read
    # the same, complete partials as one launched after the split kernel.
    q, kc, vc, bt, cl = _paged_problem(2, 16, 8, 128, 16, [9000, 1], torch.bfloat16, seed=11)
    a = _check_decode(ops, q, kc, vc, bt, cl, 0.0883, f"PDL splits={splits}", num_splits=splits)
    b = ops.decode(q, kc, vc, bt, cl, 0.0883, num_splits=splits, variant=NO_PDL)
    assert torch.equal(a, b)


@pytest.mark.parametrize("flip", [EARLY_TRIGGER, EARLY_MERGE, EARLY_TRIGGER | EARLY_MERGE, NO_PDL, GROUPED_MERGE,
                                  GROUPED_MERGE | EARLY_MERGE, WARP_MERGE, WARP_MERGE | EARLY_MERGE],
                         ids=["trigger", "merge", "both", "no-pdl", "grouped", "grouped-late-merge", "warp",
                              "warp-late-merge"])
@pytest.mark.parametrize("shape", ["b1", "worklist", "worklist-b136"])
def test_decode_merge_launch_order_is_bitwise(ops, flip, shape):
    # Where the split kernel lets its merge launch, whether a work list's merge reads its plan
    # entry before its wait, and how many sequences each merge CTA takes must not change what the
    # merge computes: the same bits either way.
    # "worklist": one long sequence among short ones in a wide table (the plan's gate opens); 41
    # sequences merge one per CTA by default, 136 four per CTA (on 132 SMs or fewer).
    if shape == "b1":
        lens, width = [9000], 0
    else:
        lens, width = [17, 0, 1, 300, 1023] * (8 if shape == "worklist" else 27) + [20000], 2048
    q, kc, vc, bt, cl = _paged_problem(len(lens), 16, 8, 128, 16, lens, torch.bfloat16, seed=17)
    if width:
        pad = torch.full((bt.shape[0], width - bt.shape[1]), -1, dtype=bt.dtype, device=bt.device)
        bt = torch.cat([bt, pad], dim=1)
    a = _check_decode(ops, q, kc, vc, bt, cl, 0.0883, f"merge launch {shape}")
    for _ in range(3):
        b = ops.decode(q, kc, vc, bt, cl, 0.0883, variant=flip)
        assert torch.equal(a, b), f"{shape} variant {flip:#x}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("heads", [(16, 8), (64, 8), (12, 3), (7, 7)], ids=["G2", "G8", "Hq12", "G1"])
@pytest.mark.parametrize("splits", [0, 2, 9, 40, 256])
def test_decode_warp_merge_is_bitwise(ops, dtype, D, heads, splits):
    # The warp merge computes the CTA merge's operations in the same order: the same o and lse
    # bits at every split count (40 and 256: more splits than one warp's lanes, and chains of
    # several splits), head dim (D 64: 16 chains per output float4), and a head count that
    # leaves the last merge CTA part empty (12 heads, 8 per CTA).
    lens = [4097, 0, 1, 333, 2000]
    q, kc, vc, bt, cl = _paged_problem(len(lens), heads[0], heads[1], D, 16, lens, dtype, seed=D + splits)
    scale = 1.0 / math.sqrt(D)
    b = _check_decode(ops, q, kc, vc, bt, cl, scale, f"warp merge {heads} D{D} splits={splits}",
                      num_splits=splits, variant=WARP_MERGE)
    a, la = ops.decode(q, kc, vc, bt, cl, scale, True, num_splits=splits)
    b2, lb = ops.decode(q, kc, vc, bt, cl, scale, True, num_splits=splits, variant=WARP_MERGE)
    assert torch.equal(a, b) and torch.equal(a, b2) and torch.equal(la, lb), f"{heads} D{D} splits={splits}"


@pytest.mark.parametrize("splits", [2, 4, 5])
def test_decode_warp_merge_rule_is_bitwise(ops, splits):
    # 80 sequences of 16 query heads: the merge rule takes the warp merge for 2 or 4 splits
    # (160 merge CTAs, at least half of any Hopper's SMs) and the CTA merge for 5; the bit flips
    # it either way. Both must match the oracle and each other bit for bit.
    g = torch.Generator().manual_seed(splits)
    lens = torch.randint(1, 2500, (80,), generator=g).tolist()
    lens[3], lens[40] = 0, 1
    q, kc, vc, bt, cl = _paged_problem(len(lens), 16, 8, 128, 16, lens, torch.bfloat16, seed=31 + splits)
    a = _check_decode(ops, q, kc, vc, bt, cl, 0.0883, f"merge rule splits={splits}", num_splits=splits)
    b = _check_decode(ops, q, kc, vc, bt, cl, 0.0883, f"merge rule flipped splits={splits}", num_splits=splits,
                      variant=WARP_MERGE)
    assert torch.equal(a, b), f"splits={splits}"


def test_public_api_backends(ops):
    import minipaged as mp

    q, kc, vc, bt, cl = _paged_problem(3, 16, 8, 128, 16, [5, 0, 300], torch.bfloat16, seed=4)
    ref = reference.decode(q, kc, vc, bt, cl, 1 / math.sqrt(128))
    for backend in ("cuda", "cuda-wmma"):
        out = mp.decode_attention(q, kc, vc, bt, cl, backend=backend)
        assert (out.float() - ref.float()).abs().max().item() < 3e-2


# --------------------------------------------------------------------------- compute-sanitizer

# The paged part of the sanitizer scripts: each (Hq, Hkv, D, page, q_lens, ctx) on shuffled
# pages (K and V the same cache, table entries past a sequence's pages -1), causal and not;
# keyword arguments go to ops.paged.
_SANITIZE_PAGED_CASES = textwrap.dedent(
    """
    def paged_cases(ops, dev, dt, cases, **kw):
        import torch
        for Hq, Hkv, D, bs, q_lens, ctx in cases:
            nblk = [(c + bs - 1) // bs for c in ctx]
            nb = sum(nblk) + 1
            kc = torch.randn(nb, bs, Hkv, D, device=dev, dtype=dt)
            perm = torch.randperm(nb).tolist()
            bt = torch.full((len(ctx), max(nblk) + 1), -1, dtype=torch.int32)
            for i, n in enumerate(nblk):
                bt[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
                perm = perm[n:]
            cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=dev)
            q = torch.randn(sum(q_lens), Hq, D, device=dev, dtype=dt)
            cl = torch.tensor(ctx, dtype=torch.int32, device=dev)
            for causal in (True, False):
                ops.paged(q, kc, kc, bt.to(dev), cu, cl, max(q_lens), causal, 0.1, True, **kw)
    """
)

_SANITIZE_SCRIPT = _SANITIZE_PAGED_CASES + textwrap.dedent(
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
    if "paged" in which:
        paged_cases(ops, dev, dt, [(4, 2, 128, 16, [0, 1, 4, 70], [5, 1, 67, 150]),
                                   (2, 1, 64, 1, [3, 65, 0], [70, 65, 0]),
                                   (2, 2, 64, 256, [90, 2], [30, 300])])
        # speculative runs and their KV splits and merges, through the tensor-core decode kernel
        # (G 2, q_len <= 5: 10 rows, one row block; G 4, q_len <= 8: 32 rows, two) and the packed
        # prefill kernel (G 8, q_len 16): the plan's count, then forced counts that leave splits
        # past a context empty
        spec = [(16, 8, 128, 16, [4, 3, 0, 5], [300, 4, 0, 3]), (16, 4, 64, 1, [8, 2, 5], [40, 700, 3]),
                (8, 1, 64, 1, [2, 16], [40, 700])]
        paged_cases(ops, dev, dt, spec)
        paged_cases(ops, dev, dt, spec, num_splits=7)
        # the same over FP8 pages (q is bf16, the scales per KV head)
        for Hq, Hkv, D, bs, q_lens, ctx in spec:
            nb = sum((c + bs - 1) // bs for c in ctx) + 1
            k8 = torch.randn(nb, bs, Hkv, D, device=dev).to(torch.float8_e4m3fn)
            bt = torch.randint(0, nb, (len(ctx), (max(ctx) + bs - 1) // bs), device=dev, dtype=torch.int32)
            sc = torch.full((Hkv,), 0.5, device=dev)
            cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=dev)
            q = torch.randn(sum(q_lens), Hq, D, device=dev, dtype=dt)
            cl = torch.tensor(ctx, dtype=torch.int32, device=dev)
            for splits in (0, 7):
                ops.paged(q, k8, k8, bt, cu, cl, max(q_lens), True, 0.1, True, sc, sc, num_splits=splits)
        q = torch.randn(3, 4, 128, device=dev, dtype=dt)  # pure decode batch through paged, with lse
        kc = torch.randn(8, 16, 2, 128, device=dev, dtype=dt)
        bt = torch.arange(8, dtype=torch.int32, device=dev).view(2, 4)[[0, 1, 0]].contiguous()
        ops.paged(q, kc, kc, bt, torch.arange(4, dtype=torch.int32, device=dev),
                  torch.tensor([5, 64, 0], dtype=torch.int32, device=dev), 1, True, 0.1, True)
        ops.decode(q, kc, kc, bt, torch.tensor([5, 64, 0], dtype=torch.int32, device=dev), 0.1, True, num_splits=3)
    for kind in ("fast", "wmma"):
        if "prefill_" + kind not in which:
            continue
        dense = ops.prefill if kind == "fast" else ops.prefill_wmma
        var = ops.prefill_varlen if kind == "fast" else ops.prefill_varlen_wmma
        for nq, nk, D in [(17, 17, 128), (33, 70, 64), (40, 9, 128)]:
            q = torch.randn(1, 4, nq, D, device=dev, dtype=dt)
            k = torch.randn(1, 2, nk, D, device=dev, dtype=dt)
            dense(q, k, k, True, 0.1)
        dense(q, k, k, True, 0.1, True)
        cu = torch.tensor([0, 5, 5, 40], dtype=torch.int32, device=dev)
        q = torch.randn(40, 4, 128, device=dev, dtype=dt)
        k = torch.randn(40, 2, 128, device=dev, dtype=dt)
        var(q, k, k, cu, cu, 35, 35, True, 0.1)
        var(q, k, k, cu, cu, 35, 35, True, 0.1, True)
    torch.cuda.synchronize()
    print("sanitize script done")
    """
)


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer(ops, tmp_path, tool):
    # one process per tool (torch start-up under the sanitizer is the slow part);
    # decode and write_kv run first so a prefill failure cannot hide theirs.
    run_under_sanitizer(tool, tmp_path / "sanitize.py", _SANITIZE_SCRIPT,
                         "decode,write_kv,paged,prefill_fast,prefill_wmma")


# --------------------------------------------------------------------------- paged attention / lse
#
# The oracle below is written here, independently of minipaged.reference: it
# gathers each sequence's K/V through its block table and runs plain softmax
# attention in float64 (the truth) or, for the error bound, in the input dtype
# the way a FlashAttention kernel rounds (16-bit Q K^T with fp32 accumulation,
# 16-bit P into P V).


def _seq_kv(kc, vc, bt_row, ctx):
    bs = kc.shape[1]
    pos = torch.arange(ctx, device=kc.device)
    blk = bt_row[pos // bs].long()
    return kc[blk, pos % bs], vc[blk, pos % bs]  # [ctx, Hkv, D]


def _paged_oracle(q, kc, vc, bt, cu, ctx_lens, causal, scale, low_precision=False, chunk=512):
    """o [Tq, Hq, D] (float32 of the chosen math) and lse [Tq, Hq] (float64 math, natural log)."""
    Tq, Hq, D = q.shape
    Hkv = kc.shape[2]
    o = torch.zeros(Tq, Hq, D, dtype=torch.float32, device=q.device)
    lse = torch.full((Tq, Hq), float("-inf"), dtype=torch.float64, device=q.device)
    cu_l, ctx_l = cu.tolist(), ctx_lens.tolist()
    for s in range(len(ctx_l)):
        q0, q1, ctx = cu_l[s], cu_l[s + 1], ctx_l[s]
        ql = q1 - q0
        if ql == 0 or ctx == 0:
            continue
        k, v = _seq_kv(kc, vc, bt[s], ctx)
        k = k.repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)  # [Hq, ctx, D]
        v = v.repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)
        for r0 in range(0, ql, chunk):
            r1 = min(ql, r0 + chunk)
            qs = q[q0 + r0 : q0 + r1].transpose(0, 1)  # [Hq, rows, D]
            if low_precision:
                sc = (qs @ k.transpose(1, 2)).float() * scale
            else:
                sc = (qs.double() @ k.double().transpose(1, 2)) * scale
            rows = torch.arange(r0, r1, device=q.device)[:, None]
            cols = torch.arange(ctx, device=q.device)[None, :]
            vis = cols < ctx - ql + rows + 1 if causal else torch.ones_like(cols, dtype=torch.bool)
            sc = sc.masked_fill(~vis, float("-inf"))
            seen = vis.any(dim=1)  # [rows]
            m = sc.amax(dim=-1, keepdim=True).masked_fill(~seen[None, :, None], 0)
            p = torch.exp(sc - m)
            l = p.sum(-1, keepdim=True)
            if low_precision:
                out = (p.to(q.dtype) @ v).float() / l.clamp_min(1e-30)
            else:
                out = (p @ v.double()) / l.clamp_min(1e-300)
            out = out.masked_fill(~seen[None, :, None], 0)
            o[q0 + r0 : q0 + r1] = out.transpose(0, 1).float()
            row_lse = (m + torch.log(l)).squeeze(-1).double().masked_fill(~seen[None, :], float("-inf"))
            lse[q0 + r0 : q0 + r1] = row_lse.transpose(0, 1)
    return o, lse


def _paged_case(S_q, S_ctx, Hq, Hkv, D, bs, dtype, seed=0):
    """Packed q [Tq,Hq,D] and poisoned paged caches (see _paged_problem) for these q_lens/contexts."""
    _, kc, vc, bt, cl = _paged_problem(len(S_ctx), Hq, Hkv, D, bs, S_ctx, dtype, seed=seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    q = torch.randn(sum(S_q), Hq, D, generator=g, device="cuda").to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(S_q).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    return q, kc, vc, bt, cu, cl


def _check_lse(lse, lse64, what):
    assert lse.dtype == torch.float32 and lse.shape == lse64.shape, (lse.dtype, lse.shape, lse64.shape)
    empty = torch.isinf(lse64)
    assert torch.equal(torch.isneginf(lse), empty), f"{what}: lse must be -inf exactly where a row sees no key"
    if (~empty).any():
        err = (lse.double() - lse64)[~empty].abs().max().item()
        assert err <= 2e-3, f"{what}: lse max err {err:.3e}"


def _check_paged(ops, q, kc, vc, bt, cu, cl, causal, scale, what, max_q=None, variant=0, num_splits=0):
    max_q = max_q if max_q is not None else int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    _poison_allocator(q.numel())
    o, lse = ops.paged(q, kc, vc, bt, cu, cl, max_q, causal, scale, True, variant=variant, num_splits=num_splits)
    o64, lse64 = _paged_oracle(q, kc, vc, bt, cu, cl, causal, scale)
    o_lp, _ = _paged_oracle(q, kc, vc, bt, cu, cl, causal, scale, low_precision=True)
    assert o.dtype == q.dtype and o.shape == q.shape
    _bound(o, o_lp, o64, what)
    _check_lse(lse, lse64, what)
    empty = torch.isneginf(lse64)
    assert (o[empty] == 0).all(), f"{what}: rows that see no key must be exact zeros"
    # without lse: the same output, bit for bit
    assert torch.equal(ops.paged(q, kc, vc, bt, cu, cl, max_q, causal, scale, variant=variant, num_splits=num_splits),
                       o), f"{what}: o depends on return_lse"
    return o, lse


PAGED_MIX_Q = [0, 1, 4, 97, 1023, 5, 0, 33]
PAGED_MIX_CTX = [64, 1, 260, 97 + 100, 1023 + 700, 3, 0, 33 + 255]  # q_len 5 > context 3: rows with no key


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(16, 8), (8, 1), (4, 4)], ids=["G2", "G8", "G1"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16, 64, 256])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_paged_matches_oracle(ops, dtype, heads, D, block_size, causal):
    if D == 64 and heads != (16, 8) and block_size not in (1, 256):
        pytest.skip("D=64 sweeps every head layout only at page sizes 1 and 256 (keeps the suite short)")
    q, kc, vc, bt, cu, cl = _paged_case(PAGED_MIX_Q, PAGED_MIX_CTX, *heads, D, block_size, dtype, seed=D + block_size)
    _check_paged(ops, q, kc, vc, bt, cu, cl, causal, 1 / math.sqrt(D),
                 f"paged {dtype} {heads} D{D} bs{block_size} causal={causal}")


@pytest.mark.parametrize("q_len", [5, 70])
def test_paged_every_tile_residue(ops, q_len):
    # every (context_len - q_len) mod 128 (the largest key tile), 2 pages of 64 per tile boundary
    ctx = [q_len + r + (r % 3) * 128 for r in range(128)]
    q, kc, vc, bt, cu, cl = _paged_case([q_len] * 128, ctx, 4, 2, 128, 16, torch.bfloat16, seed=q_len)
    _check_paged(ops, q, kc, vc, bt, cu, cl, True, 0.0883, f"residues q_len={q_len}")


@pytest.mark.parametrize("S_q,S_ctx", [([4096], [32768]), ([2048, 1, 7], [30000, 30000, 17000]),
                                       ([1000, 3000, 0, 64], [1000, 9000, 100, 20000])],
                         ids=["4k-over-32k", "2k-over-30k-mixed", "mixed"])
def test_paged_long(ops, S_q, S_ctx):
    q, kc, vc, bt, cu, cl = _paged_case(S_q, S_ctx, 16, 8, 128, 16, torch.bfloat16, seed=len(S_q))
    _check_paged(ops, q, kc, vc, bt, cu, cl, True, 0.0883, f"long {S_q} over {S_ctx}")


PAGED_PACK = {"default": 0, "unpacked": 1, "packed": 2}  # PrefillParams.variant: GQA-packed rows or not


@pytest.mark.parametrize("variant", PAGED_PACK.values(), ids=PAGED_PACK.keys())
@pytest.mark.parametrize("heads", [(16, 8), (32, 4), (12, 4), (4, 4)], ids=["G2", "G8", "G3", "G1"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_short_queries(ops, variant, heads, block_size, dtype):
    # speculative-verification lengths (the default packs each GQA group into the rows)
    S_q, S_ctx = [4, 1, 16, 0, 7, 3, 2], [4100, 1, 300, 9, 64, 2, 1500]
    q, kc, vc, bt, cu, cl = _paged_case(S_q, S_ctx, *heads, 128, block_size, dtype, seed=block_size)
    for causal in (True, False):
        o, lse = ops.paged(q, kc, vc, bt, cu, cl, 16, causal, 0.0883, True, variant=variant)
        o64, lse64 = _paged_oracle(q, kc, vc, bt, cu, cl, causal, 0.0883)
        o_lp, _ = _paged_oracle(q, kc, vc, bt, cu, cl, causal, 0.0883, low_precision=True)
        what = f"short q {heads} bs{block_size} v{variant} causal={causal}"
        _bound(o, o_lp, o64, what)
        _check_lse(lse, lse64, what)
        assert (o[torch.isneginf(lse64)] == 0).all()


def test_paged_scale_and_max_seqlen_over_actual(ops):
    # a large scale and a max_seqlen_q above every q_len
    q, kc, vc, bt, cu, cl = _paged_case([17, 300, 2], [600, 300, 2], 8, 2, 128, 32, torch.float16, seed=3)
    _check_paged(ops, q, kc, vc, bt, cu, cl, True, 0.2, "scale 0.2", max_q=512)
    # the prefill kernels track the max of raw scores: only a positive scale is theirs (api.py
    # rejects scale <= 0 for users; a direct call gets the launcher's error, not wrong numbers)
    with pytest.raises(RuntimeError, match="launch_prefill_paged"):
        ops.paged(q, kc, vc, bt, cu, cl, 512, True, -0.2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(16, 8), (32, 4), (8, 8)], ids=["G2", "G8", "G1"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_pure_decode_equals_decode(ops, dtype, heads, block_size):
    lens = [0, 1, 17, 1023, 5000]
    q, kc, vc, bt, cl = _paged_problem(len(lens), heads[0], heads[1], 128, block_size, lens, dtype, seed=7)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda")
    for causal in (True, False):
        o, lse = ops.paged(q, kc, vc, bt, cu, cl, 1, causal, 0.0883, True)
        od, lsed = ops.decode(q, kc, vc, bt, cl, 0.0883, True)
        assert torch.equal(o, od) and torch.equal(lse, lsed)
    # q_len-1 rows through the prefill kernels (max_seqlen_q 2 forces them there) agree closely
    o2, lse2 = ops.paged(q, kc, vc, bt, cu, cl, 2, True, 0.0883, True)
    o64, lse64 = _paged_oracle(q, kc, vc, bt, cu, cl, True, 0.0883)
    o_lp, _ = _paged_oracle(q, kc, vc, bt, cu, cl, True, 0.0883, low_precision=True)
    _bound(o2, o_lp, o64, "q_len 1 through the prefill kernel")
    _check_lse(lse2, lse64, "q_len 1 through the prefill kernel")


def test_paged_equals_varlen_on_written_cache(ops):
    # K/V written by write_kv_cache; paged over the cache vs prefill_varlen on the contiguous K/V
    torch.manual_seed(5)
    Hq, Hkv, D, bs = 16, 8, 128, 16
    q_lens, ctx = [300, 1, 77], [1300, 40, 77]
    k = torch.randn(sum(ctx), Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    nblk = [(c + bs - 1) // bs for c in ctx]
    kc = torch.full((sum(nblk) + 2, bs, Hkv, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    vc = torch.full_like(kc, float("nan"))
    perm = torch.randperm(kc.shape[0]).tolist()
    bt = torch.full((3, max(nblk) + 1), -1, dtype=torch.int32)
    slots = []
    for s, n in enumerate(nblk):
        bt[s, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
        pos = torch.arange(ctx[s])
        slots.append(bt[s, pos // bs].long() * bs + pos % bs)
    bt = bt.cuda()
    ops.write_kv_cache(k, v, kc, vc, torch.cat(slots).cuda())
    cu_k = torch.tensor([0] + list(torch.tensor(ctx).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    cu_q = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), Hq, D, device="cuda", dtype=torch.bfloat16)
    cl = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    for causal in (True, False):
        o, lse = ops.paged(q, kc, vc, bt, cu_q, cl, max(q_lens), causal, 0.0883, True)
        ov, lsev = ops.prefill_varlen(q, k, v, cu_q, cu_k, max(q_lens), max(ctx), causal, 0.0883, True)
        assert (o.float() - ov.float()).abs().max().item() < 1e-2
        assert (lse - lsev).abs().max().item() < 1e-4


def test_paged_bitwise_deterministic(ops):
    q, kc, vc, bt, cu, cl = _paged_case(PAGED_MIX_Q, PAGED_MIX_CTX, 16, 8, 128, 16, torch.bfloat16, seed=2)
    _repeat_identical(lambda: ops.paged(q, kc, vc, bt, cu, cl, 1023, True, 0.0883))
    _repeat_identical(lambda: ops.paged(q, kc, vc, bt, cu, cl, 1023, True, 0.0883, True)[1])


def test_paged_empty_inputs(ops):
    q, kc, vc, bt, cu, cl = _paged_case([0, 0], [5, 0], 4, 2, 128, 16, torch.bfloat16)
    o, lse = ops.paged(q, kc, vc, bt, cu, cl, 0, True, 0.1, True)
    assert o.shape == (0, 4, 128) and lse.shape == (0, 4)
    q, kc, vc, bt, cu, cl = _paged_case([3], [0], 4, 2, 128, 16, torch.bfloat16)
    o, lse = ops.paged(q, kc, vc, bt, cu, cl, 3, True, 0.1, True)
    assert (o == 0).all() and torch.isneginf(lse).all()


def test_paged_torch_compile_and_cuda_graph(ops):
    q, kc, vc, bt, cu, cl = _paged_case([5, 1, 40], [300, 1, 2000], 16, 8, 128, 16, torch.bfloat16, seed=4)
    eager_o, eager_lse = ops.paged(q, kc, vc, bt, cu, cl, 40, True, 0.0883, True)
    torch._dynamo.reset()

    def f(q, kc, vc, bt, cu, cl):
        o, lse = ops.paged(q, kc, vc, bt, cu, cl, 40, True, 0.0883, True)
        return o * 2, lse + 1

    co, clse = torch.compile(f, fullgraph=True)(q, kc, vc, bt, cu, cl)
    assert torch.equal(co, eager_o * 2) and torch.equal(clse, eager_lse + 1)
    static_q = q.clone()
    ops.paged(static_q, kc, vc, bt, cu, cl, 40, True, 0.0883)  # warm-up (kernel attributes)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_o = ops.paged(static_q, kc, vc, bt, cu, cl, 40, True, 0.0883)
    static_q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_o, ops.paged(static_q, kc, vc, bt, cu, cl, 40, True, 0.0883))


@pytest.mark.parametrize("kind", PREFILL_KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nq,nk", [(97, 200), (200, 97), (1023, 1023), (1, 1)])
def test_prefill_return_lse(ops, kind, dtype, nq, nk):
    torch.manual_seed(nq)
    B, Hq, Hkv, D = 2, 16, 8, 128
    q = torch.randn(B, Hq, nq, D, device="cuda").to(dtype)
    k = torch.randn(B, Hkv, nk, D, device="cuda").to(dtype)
    v = torch.randn(B, Hkv, nk, D, device="cuda").to(dtype)
    for causal in (True, False):
        o, lse = _prefill_fn(ops, kind)(q, k, v, causal, 0.0883, True)
        assert torch.equal(o, _prefill_fn(ops, kind)(q, k, v, causal, 0.0883))
        # the same problem as one paged-oracle call per batch entry (dense = varlen with equal lengths)
        for b in range(B):
            kc = k[b].transpose(0, 1).unsqueeze(1).contiguous()  # [nk, 1, Hkv, D]: page size 1
            bt = torch.arange(nk, dtype=torch.int32, device="cuda")[None]
            cu = torch.tensor([0, nq], dtype=torch.int32, device="cuda")
            cl = torch.tensor([nk], dtype=torch.int32, device="cuda")
            vc = v[b].transpose(0, 1).unsqueeze(1).contiguous()
            _, lse64 = _paged_oracle(q[b].transpose(0, 1), kc, vc, bt, cu, cl, causal, 0.0883)
            _check_lse(lse[b].transpose(0, 1), lse64, f"prefill {kind} lse {dtype} {nq}x{nk} causal={causal}")


@pytest.mark.parametrize("kind", PREFILL_KINDS)
def test_prefill_varlen_return_lse(ops, kind):
    torch.manual_seed(1)
    seq_q, seq_k = [17, 0, 1, 300, 64, 5], [17, 0, 40, 300, 1000, 3]
    Hq, Hkv, D = 16, 8, 64
    cu_q = torch.tensor([0] + list(torch.tensor(seq_q).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(seq_k).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(seq_q), Hq, D, device="cuda").to(torch.float16)
    k = torch.randn(sum(seq_k), Hkv, D, device="cuda").to(torch.float16)
    v = torch.randn_like(k)
    # K/V as a page-size-1 cache: token t of the packed K/V is block t
    kc, vc = k.unsqueeze(1), v.unsqueeze(1)
    bt = torch.zeros(len(seq_k), max(seq_k), dtype=torch.int32, device="cuda")
    for s, n in enumerate(seq_k):
        bt[s, :n] = torch.arange(int(cu_k[s]), int(cu_k[s]) + n, dtype=torch.int32)
    cl = torch.tensor(seq_k, dtype=torch.int32, device="cuda")
    fn = _prefill_fn(ops, kind, varlen=True)
    for causal in (True, False):
        o, lse = fn(q, k, v, cu_q, cu_k, max(seq_q), max(seq_k), causal, 0.125, True)
        assert torch.equal(o, fn(q, k, v, cu_q, cu_k, max(seq_q), max(seq_k), causal, 0.125))
        _, lse64 = _paged_oracle(q, kc, vc, bt, cu_q, cl, causal, 0.125)
        _check_lse(lse, lse64, f"varlen {kind} lse causal={causal}")


@pytest.mark.parametrize("variant", [0, MMA, SCALAR], ids=["default", "mma", "scalar"])
@pytest.mark.parametrize("num_splits", [0, 1, 7])
@pytest.mark.parametrize("heads", [(16, 8), (32, 4)], ids=["G2", "G8"])
def test_decode_return_lse(ops, variant, num_splits, heads):
    lens = [0, 1, 17, 1023, 9000]
    q, kc, vc, bt, cl = _paged_problem(len(lens), heads[0], heads[1], 128, 16, lens, torch.bfloat16, seed=variant)
    o, lse = ops.decode(q, kc, vc, bt, cl, 0.0883, True, num_splits=num_splits, variant=variant)
    assert torch.equal(o, ops.decode(q, kc, vc, bt, cl, 0.0883, num_splits=num_splits, variant=variant))
    cu = torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda")
    _, lse64 = _paged_oracle(q, kc, vc, bt, cu, cl, False, 0.0883)
    _check_lse(lse, lse64, f"decode lse variant={variant} splits={num_splits}")


# =========================================================================== paged TMA kernel, mixed-batch split
#
# (issues #13/#16) On sm_90a, long paged chunks over 16-bit caches with pages of >= 8 tokens run the
# warp-specialised kernel with its K/V pages loaded as TMA boxes (prefill/mainloop_ws.cuh, kPaged);
# a batch that mixes q_len <= 16 and longer rows runs two launches, the GQA-packed kernel for the
# short ones and the tiled kernel for the rest (prefill/dispatch.cuh, launch_paged_split). Checked
# against this file's fp64 oracle (_paged_oracle / _check_paged) with NaN-poisoned unused slots and
# -1 past the used table entries (_paged_case). scripts/paged_ws_selftest.cu is the torch-free twin.
# Both paths are the default (dispatch.cuh kPagedNewPathsByDefault); PrefillParams variant 3 forces
# them on whatever that default, so every call below passes it.
NEW_PATHS = 3

WS_MIX_Q = [1, 1, 17, 97, 1023, 2048, 4, 130, 0, 200, 16, 17, 1, 33]
WS_MIX_CTX = [0, 1, 17, 1023, 1023, 4097, 97, 97, 17, 0, 4097, 4097, 4097, 1]  # q > ctx: rows with no key
WS_LAYOUTS = {8: ((16, 8), 128), 16: ((8, 1), 64), 64: ((4, 4), 128), 128: ((16, 8), 64), 256: ((8, 1), 128),
              4: ((16, 8), 128)}  # page size -> (Hq, Hkv), D; 4 runs the cp.async fallback


@pytest.mark.parametrize("block_size", list(WS_LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_paged_ws_page_sizes(ops, block_size, dtype, causal):
    heads, D = WS_LAYOUTS[block_size]
    q, kc, vc, bt, cu, cl = _paged_case(WS_MIX_Q, WS_MIX_CTX, *heads, D, block_size, dtype, seed=block_size + D)
    _check_paged(ops, q, kc, vc, bt, cu, cl, causal, 1 / math.sqrt(D),
                 f"ws mix {dtype} {heads} D{D} bs{block_size} causal={causal}", variant=NEW_PATHS)


@pytest.mark.parametrize("q_len", [70, 129])
@pytest.mark.parametrize("block_size", [8, 256])
def test_paged_ws_every_tile_residue(ops, q_len, block_size):
    # every (context_len - q_len) mod 128 (BLOCK_N of the TMA kernel): the tail tile's zeroed V rows
    ctx = [q_len + r + (r % 3) * 128 for r in range(128)]
    q, kc, vc, bt, cu, cl = _paged_case([q_len] * 128, ctx, 4, 2, 128, block_size, torch.float16, seed=q_len)
    _check_paged(ops, q, kc, vc, bt, cu, cl, True, 0.0883, f"ws residues q_len={q_len} bs{block_size}",
                 variant=NEW_PATHS)


# Causal work lists of at most one wave run on mirrored 64-row block pairs (dispatch.cuh
# CfgWsPagedMirror): a prompt's first chunk, a chunk over a cached prefix, an odd count of
# 64-row blocks, q_len 0 and short runs beside the chunks, rows that see no key; by default
# (variant 0) as the engine calls it, and a repeat bit for bit.
@pytest.mark.parametrize("q_lens,ctx_lens,heads,block_size", [
    ([1000], [1000], (16, 8), 16),
    ([1023], [4097], (16, 8), 64),
    ([300, 700, 0, 97], [300, 1500, 40, 97], (8, 2), 8),
    ([191], [65], (16, 8), 256),
], ids=["first-chunk", "prefix", "varlen", "q>ctx"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_one_wave_chunks(ops, q_lens, ctx_lens, heads, block_size, dtype):
    D = 128
    q, kc, vc, bt, cu, cl = _paged_case(q_lens, ctx_lens, *heads, D, block_size, dtype, seed=sum(q_lens))
    o, _ = _check_paged(ops, q, kc, vc, bt, cu, cl, True, 1 / math.sqrt(D),
                        f"one wave {q_lens}x{ctx_lens} {dtype} bs{block_size}")
    assert torch.equal(ops.paged(q, kc, vc, bt, cu, cl, max(q_lens), True, 1 / math.sqrt(D)), o), \
        "a second call differs"


def test_paged_mixed_batch_split_rows(ops):
    # the bench's mixed row (one 2k chunk + 63 decodes at 4k context, page 16): against the oracle,
    # and every row bit for bit what a call holding only its own kind of sequence gives (each row is
    # written by exactly one of the two launches, by the same kernel as when alone)
    S_q, S_ctx = [2048] + [1] * 63, [4096] * 64
    q, kc, vc, bt, cu, cl = _paged_case(S_q, S_ctx, 16, 8, 128, 16, torch.bfloat16, seed=11)
    o, lse = _check_paged(ops, q, kc, vc, bt, cu, cl, True, 0.0883, "mixed 2k chunk + 63 decodes", variant=NEW_PATHS)
    cu1 = torch.tensor([0, 2048], dtype=torch.int32, device="cuda")
    o1, l1 = ops.paged(q[:2048].contiguous(), kc, vc, bt[:1].contiguous(), cu1, cl[:1].contiguous(), 2048, True,
                       0.0883, True, variant=NEW_PATHS)
    assert torch.equal(o1, o[:2048]) and torch.equal(l1, lse[:2048])
    # max_seqlen_q 2 keeps the decode rows on the prefill (packed) kernel instead of the decode kernels
    cud = torch.arange(64, dtype=torch.int32, device="cuda")
    od, ld = ops.paged(q[2048:].contiguous(), kc, vc, bt[1:].contiguous(), cud, cl[1:].contiguous(), 2, True,
                       0.0883, True, variant=NEW_PATHS)
    assert torch.equal(od, o[2048:]) and torch.equal(ld, lse[2048:])


@pytest.mark.parametrize("heads", [(16, 8), (32, 4), (8, 8)], ids=["G2", "G8", "G1"])
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_paged_mixed_split_spec_and_chunks(ops, heads, block_size):
    # q_lens on both sides of 16 (the packed kernel's limit), contexts below and above q_len
    S_q = [1, 300, 16, 17, 4, 1, 1, 2, 9, 0, 129]
    S_ctx = [500, 1000, 700, 17, 4, 1, 4097, 2, 3000, 10, 100]
    q, kc, vc, bt, cu, cl = _paged_case(S_q, S_ctx, *heads, 128, block_size, torch.bfloat16, seed=block_size)
    for causal in (True, False):
        _check_paged(ops, q, kc, vc, bt, cu, cl, causal, 0.0883, f"split {heads} bs{block_size} causal={causal}",
                     variant=NEW_PATHS)
    _repeat_identical(lambda: ops.paged(q, kc, vc, bt, cu, cl, 300, True, 0.0883, True, variant=NEW_PATHS)[0])


def test_paged_ws_long_context(ops):
    # the chunked-prefill shapes of the bench at reduced head count: 2k new over 30k cached, 8 x 512 over 4k
    for S_q, S_ctx in (([2048], [32768]), ([512] * 8, [4608] * 8)):
        q, kc, vc, bt, cu, cl = _paged_case(S_q, S_ctx, 4, 2, 128, 16, torch.bfloat16, seed=len(S_q))
        _check_paged(ops, q, kc, vc, bt, cu, cl, True, 0.0883, f"ws long {S_q[0]}x{len(S_q)} over {S_ctx[0]}",
                     variant=NEW_PATHS)


_SANITIZE_PAGED_WS = _SANITIZE_PAGED_CASES + textwrap.dedent(
    """
    import torch
    from minipaged.cuda import ops
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    paged_cases(ops, dev, dt, [(4, 2, 128, 8, [0, 1, 70, 150], [5, 1, 67, 300]),
                               (2, 1, 64, 256, [130, 3], [400, 70]),
                               (4, 2, 64, 16, [1, 40, 1, 4, 17], [33, 97, 0, 9, 17]),
                               (2, 2, 128, 128, [200, 1], [130, 129])], variant=3)
    torch.cuda.synchronize()
    print("sanitize script done")
    """
)


@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_compute_sanitizer_paged_ws(ops, tmp_path, tool):
    run_under_sanitizer(tool, tmp_path / "sanitize_paged_ws.py", _SANITIZE_PAGED_WS)


# =========================================================================== paged decode routing
#
# (issue #13) With the decode routing on (the default, prefill/dispatch.cuh
# kPagedDecodeRoutingByDefault; PrefillParams variant 4 forces it, 3 gives the unrouted paths) the q_len == 1 rows of a paged batch run the
# decode kernels (split-K, DecodeParams.cu_seqlens_q: a decode CTA of any other sequence returns at
# once), q_len 2..16 the GQA-packed kernel in a config that skips q_len 1 (where packing applies)
# and longer rows the tiled kernel (TMA on sm_90a), launches on one stream, which sequence is which
# decided on the device. Same oracle, poisoning and cases as the block above.
# scripts/paged_ws_selftest.cu (routed, routed_s1, routed_s3, rt_vs_dec) is the torch-free twin.
ROUTED = 4
ROUTED_LAYOUTS = {**WS_LAYOUTS, 1: ((16, 4), 128)}  # page 1: tensor-core decode (G4), cp.async prefill


@pytest.mark.parametrize("block_size", list(ROUTED_LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_paged_routed_page_sizes(ops, block_size, dtype, causal):
    heads, D = ROUTED_LAYOUTS[block_size]
    q, kc, vc, bt, cu, cl = _paged_case(WS_MIX_Q, WS_MIX_CTX, *heads, D, block_size, dtype, seed=block_size + D + 1)
    _check_paged(ops, q, kc, vc, bt, cu, cl, causal, 1 / math.sqrt(D),
                 f"routed mix {dtype} {heads} D{D} bs{block_size} causal={causal}", variant=ROUTED)


ROUTED_SPEC_Q = [1, 300, 16, 17, 4, 1, 1, 2, 9, 0, 129, 1, 1]
ROUTED_SPEC_CTX = [500, 1000, 700, 17, 4, 1, 4097, 2, 3000, 10, 100, 0, 1]  # decode rows at context 0 and 1 too


@pytest.mark.parametrize("heads", [(16, 8), (16, 4), (32, 4), (8, 8)], ids=["G2", "G4", "G8", "G1"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_paged_routed_spec_and_chunks(ops, heads, D, block_size):
    # every decode kernel the routed planner picks: scalar G1 and tensor cores (G >= 2) at D64,
    # scalar G1/G2 and tensor cores (G >= 3) at D128; q_lens 0, 1, 2..16 and longer in one batch
    q, kc, vc, bt, cu, cl = _paged_case(ROUTED_SPEC_Q, ROUTED_SPEC_CTX, *heads, D, block_size, torch.bfloat16,
                                        seed=block_size + D)
    for causal in (True, False):
        _check_paged(ops, q, kc, vc, bt, cu, cl, causal, 1 / math.sqrt(D),
                     f"routed {heads} D{D} bs{block_size} causal={causal}", variant=ROUTED)
    _repeat_identical(lambda: ops.paged(q, kc, vc, bt, cu, cl, 300, True, 0.0883, True, variant=ROUTED)[0])


# Speculative runs (q_len 2..16) and decode rows, at contexts that end on many residues of the
# packed kernel's 32-key tiles and of its split sizes, a q_len 5 over 3 keys (rows that see no
# key), an empty sequence and a context of 32k
SPEC_Q = [4, 1, 0, 3, 8, 2, 16, 4, 5, 4]
SPEC_CTX = [4097, 1, 0, 97, 16, 71, 1023, 130, 3, 32768]


@pytest.mark.parametrize("splits", [0, 1, 2, 3, 7, 64, 256])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_spec_kv_splits(ops, dtype, block_size, splits):
    # KV splits (0: the planner's count, which splits this batch too) against the fp64 oracle,
    # causal and not, bit for bit repeatable: at G 2 D 128 the decode kernel's two row blocks
    # (16 x 2 rows) by default and the packed kernel under variant 3; at G 8 D 64 (16 x 8 rows)
    # the packed kernel. The decode kernel's merge grid has 10 x 16 (sequence, query) rows, so
    # the merge rule (decode/splits.h) merges 2 and 3 splits with a warp per head, 7 and more with a CTA
    for heads, D, variant in (((16, 8), 128, 0), ((16, 8), 128, 3), ((32, 4), 64, 0)):
        q, kc, vc, bt, cu, cl = _paged_case(SPEC_Q, SPEC_CTX, *heads, D, block_size, dtype, seed=splits + block_size)
        for causal in (True, False):
            _check_paged(ops, q, kc, vc, bt, cu, cl, causal, 1 / math.sqrt(D),
                         f"spec splits={splits} {heads} D{D} bs{block_size} v{variant} causal={causal}",
                         num_splits=splits, variant=variant)
    _repeat_identical(lambda: ops.paged(q, kc, vc, bt, cu, cl, 16, True, 0.125, True, num_splits=splits)[1], n=5)


@pytest.mark.parametrize("splits", [2, 4, 5])
def test_paged_routed_merge_rule_flip_is_bitwise(ops, splits):
    # The routed decode launches of a paged call merge their splits by decode_warp_merge_by_rule
    # (decode/splits.h), and bit 0x40000 flips it for them as in decode. 48 sequences, half one
    # query (packed-query merge rows: 48) and half short runs of 2-4 (4 x 48 (sequence, query)
    # rows), take the warp merge at 2 and 4 splits and the CTA merge at 5 (16 heads: half of
    # any Hopper's SMs from 33 rows). Rule and flip must match the oracle and each other bit for bit.
    g = torch.Generator().manual_seed(splits)
    q_lens = [1 if i % 2 == 0 else 2 + i % 3 for i in range(48)]
    ctx = [q + int(n) for q, n in zip(q_lens, torch.randint(0, 3000, (48,), generator=g))]
    ctx[4], ctx[7] = 1, 3  # one key for a decode row; a run of 3 over its own 3 keys
    q, kc, vc, bt, cu, cl = _paged_case(q_lens, ctx, 16, 8, 128, 16, torch.bfloat16, seed=40 + splits)
    o, lse = _check_paged(ops, q, kc, vc, bt, cu, cl, True, 0.0883, f"routed merge rule splits={splits}",
                          num_splits=splits)
    o2, lse2 = _check_paged(ops, q, kc, vc, bt, cu, cl, True, 0.0883, f"routed merge flipped splits={splits}",
                            num_splits=splits, variant=WARP_MERGE)
    assert torch.equal(o, o2) and torch.equal(lse, lse2), f"splits={splits}"


@pytest.mark.parametrize("B, ctx", [(1, 32768), (1, 4096), (4, 1000), (32, 4096)])
def test_paged_spec_batches_split_by_default(ops, B, ctx):
    # the serving shapes of speculative verification (q_len 4), which the planner splits: one
    # sequence at 32k keys used to be 8 CTAs on 132 SMs; the split count must not change o
    # beyond rounding (against 1 split and the oracle)
    q, kc, vc, bt, cu, cl = _paged_case([4] * B, [ctx] * B, 16, 8, 128, 16, torch.bfloat16, seed=B)
    o, lse = _check_paged(ops, q, kc, vc, bt, cu, cl, True, 0.0883, f"spec B={B} L={ctx}")
    o1, lse1 = _check_paged(ops, q, kc, vc, bt, cu, cl, True, 0.0883, f"spec B={B} L={ctx} 1 split", num_splits=1)
    assert (lse - lse1).abs().max().item() < 1e-4


# Speculative runs through the tensor-core decode kernel (csrc/prefill/dispatch.cuh
# paged_spec_decode_ok: max_seqlen_q x G <= 32 (query, head) rows per KV head, one CTA; up to
# 16 in one MMA row block, more in two). Each GQA width at the longest run it takes (G3: 30 of
# the 32 rows; G16: one query per row block) and, "-16", at the longest one block takes;
# q_len 0, 1, 2..max in one batch, runs longer than their context (2-3 over 1 key, 2 over none:
# rows that see no key), contexts on many residues of the 64-key tiles and 4097. Longer runs
# (test_paged_spec_kv_splits' q_len 16 at G 8) take the packed prefill kernel.
SPEC_DECODE_HEADS = {"G2": ((16, 8), 16), "G4": ((16, 4), 8), "G8": ((32, 4), 4), "G3": ((24, 8), 10),
                     "G16": ((16, 1), 2), "G2-16": ((16, 8), 8), "G8-16": ((32, 4), 2)}


@pytest.mark.parametrize("layout", SPEC_DECODE_HEADS.keys())
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("splits", [0, 1, 5])
def test_paged_spec_decode_rows(ops, layout, D, block_size, splits):
    heads, max_q = SPEC_DECODE_HEADS[layout]
    S_q = [max_q, 2, 0, 1, max_q - 1, min(3, max_q), max_q, 2, max_q]
    S_ctx = [4097, 2, 5, 1, 97, 1, 300, 0, max_q + 63]
    dtype = torch.bfloat16 if D == 128 else torch.float16
    q, kc, vc, bt, cu, cl = _paged_case(S_q, S_ctx, *heads, D, block_size, dtype, seed=block_size + D + splits)
    for causal in (True, False):
        _check_paged(ops, q, kc, vc, bt, cu, cl, causal, 1 / math.sqrt(D),
                     f"spec decode {layout} D{D} bs{block_size} s{splits} causal={causal}", max_q=max_q,
                     num_splits=splits)
    _repeat_identical(lambda: ops.paged(q, kc, vc, bt, cu, cl, max_q, True, 0.0883, True, num_splits=splits)[0])


def _rows_of(cu, pick):
    ql = (cu[1:] - cu[:-1]).tolist()
    seqs = [s for s, n in enumerate(ql) if pick(n)]
    rows = [int(cu[s]) + i for s in seqs for i in range(ql[s])]
    return seqs, torch.tensor(rows, dtype=torch.long, device=cu.device)


@pytest.mark.parametrize("splits", [0, 1, 5])
def test_paged_routed_mixed_batch_rows(ops, splits):
    # the bench's mixed row (one 2k chunk + 63 decodes at 4k context, page 16) against the oracle,
    # and bit for bit: the decode rows what the decode op gives on them alone with the same split
    # count (routed decode = the plain decode kernels), the chunk rows what a call holding only the
    # chunk gives
    S_q, S_ctx = [2048] + [1] * 63, [4096] * 64
    q, kc, vc, bt, cu, cl = _paged_case(S_q, S_ctx, 16, 8, 128, 16, torch.bfloat16, seed=12)
    o, lse = _check_paged(ops, q, kc, vc, bt, cu, cl, True, 0.0883, f"routed 2k chunk + 63 decodes s{splits}",
                          variant=ROUTED)
    if splits:
        o2, l2 = ops.paged(q, kc, vc, bt, cu, cl, 2048, True, 0.0883, True, num_splits=splits, variant=ROUTED)
        od, ld = ops.decode(q[2048:].contiguous(), kc, vc, bt[1:].contiguous(), cl[1:].contiguous(), 0.0883, True,
                            num_splits=splits)
        assert torch.equal(od, o2[2048:]) and torch.equal(ld, l2[2048:]), "routed decode rows != decode op"
        assert torch.equal(o2[:2048], o[:2048]), "the decode split count changed the chunk rows"
    cu1 = torch.tensor([0, 2048], dtype=torch.int32, device="cuda")
    o1, l1 = ops.paged(q[:2048].contiguous(), kc, vc, bt[:1].contiguous(), cu1, cl[:1].contiguous(), 2048, True,
                       0.0883, True, variant=ROUTED)
    assert torch.equal(o1, o[:2048]) and torch.equal(l1, lse[:2048])


@pytest.mark.parametrize("heads", [(16, 8), (16, 2)], ids=["G2", "G8"])
@pytest.mark.parametrize("D", [64, 128])
def test_paged_routed_decode_rows_match_decode_op(ops, heads, D):
    # decode rows scattered between spec rows and chunks: each bitwise the decode op's on those
    # sequences alone (forced split count, same table width), so the routed (packed-query) kernel
    # choice follows the plain one's at both head dims
    q, kc, vc, bt, cu, cl = _paged_case(ROUTED_SPEC_Q, ROUTED_SPEC_CTX, *heads, D, 16, torch.float16, seed=3)
    o, lse = ops.paged(q, kc, vc, bt, cu, cl, 300, True, 0.0883, True, num_splits=3, variant=ROUTED)
    seqs, rows = _rows_of(cu, lambda n: n == 1)
    idx = torch.tensor(seqs, dtype=torch.long, device="cuda")
    od, ld = ops.decode(q[rows].contiguous(), kc, vc, bt[idx].contiguous(), cl[idx].contiguous(), 0.0883, True,
                        num_splits=3)
    assert torch.equal(od, o[rows]) and torch.equal(ld, lse[rows])


# Which sequences are decode rows or short runs, and how long, is read on the device: a call
# captured once and replayed with other q_lens (same total, same max_seqlen_q bound) must match
# an eager call on them and the oracle. "routed": decode rows, short runs and chunks (max 64: the
# short runs take the packed kernel); "spec": a speculative batch (max 8 at G 2: the decode
# kernel's short-run rows, with decode rows and an empty sequence in the later replays).
GRAPH_REPLAYS = {
    "routed": ([600, 4097, 33, 0, 1, 900, 2000, 70], 64, ROUTED, 21,
               ([1, 1, 40, 1, 1, 5, 1, 1], [40, 1, 1, 1, 5, 1, 1, 1], [2, 3, 1, 1, 1, 1, 42, 0])),
    "spec": ([600, 4097, 33, 9, 1, 900, 2000, 70], 8, 0, 23,
             ([4, 4, 4, 4, 4, 4, 4, 4], [8, 2, 1, 0, 8, 5, 2, 6], [2, 3, 8, 8, 1, 1, 7, 2])),
}


@pytest.mark.parametrize("which", GRAPH_REPLAYS.keys())
def test_paged_routed_cuda_graph_replay(ops, which):
    S_ctx, max_q, variant, seed, variants = GRAPH_REPLAYS[which]
    q, kc, vc, bt, cu, cl = _paged_case(variants[0], S_ctx, 16, 8, 128, 16, torch.bfloat16, seed=seed)
    static_q, static_cu = q.clone(), cu.clone()
    call = lambda: ops.paged(static_q, kc, vc, bt, static_cu, cl, max_q, True, 0.0883, True,  # noqa: E731
                             variant=variant)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_o, static_lse = call()
    for trial, S_q in enumerate(variants):
        assert sum(S_q) == q.shape[0]
        static_q.copy_(torch.randn_like(q.float()).to(q.dtype))
        static_cu.copy_(torch.tensor([0] + list(torch.tensor(S_q).cumsum(0).tolist()), dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        eager_o, eager_lse = call()
        assert torch.equal(static_o, eager_o) and torch.equal(static_lse, eager_lse), f"replay {trial}"
        _check_paged(ops, static_q, kc, vc, bt, static_cu, cl, True, 0.0883, f"{which} graph q_lens {S_q}",
                     max_q=max_q, variant=variant)


@pytest.mark.parametrize("heads", [(8, 8), (8, 4), (16, 2)], ids=["G1", "G2", "G8"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("page", [1, 16])
def test_paged_routed_fp8(ops, heads, D, page):  # ops: the fixture's skip without a GPU
    # FP8 caches: the FP8 decode kernels (scalar G1/G2, tensor cores from G3) on the decode rows,
    # the FP8 tiled kernel on the rest; test_cuda_fp8's fp64 oracle on the dequantised cache bytes
    from test_cuda_fp8 import _run_paged

    Hq, Hkv = heads
    for causal in (True, False):
        _run_paged(ROUTED_SPEC_Q, ROUTED_SPEC_CTX, Hq, Hkv, D, page, torch.bfloat16, causal=causal,
                   seed=page + D + int(causal), variant=ROUTED)
