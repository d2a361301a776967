"""Tests of the Triton paged-attention kernel (any mix of query lengths), return_lse
on every attention op, and merge_attention_states, against the fp64 oracle of
minipaged.testing (independent of minipaged.reference and of the kernels).

CPU: the kernels run under TRITON_INTERPRET=1 in fp16/fp32 (the interpreter's
bf16 tl.dot is wrong) with the interpreter's tiles: BLOCK_N = 16 keys and
BLOCK_M <= 32 packed (position, head) rows (configs.paged_config).
GPU: `pytest -m gpu tests/test_triton_paged.py` on the H200.

Error bound, minipaged.testing.assert_close: the kernel's max error against the
fp64 oracle is within twice that of the same attention written in plain PyTorch
in the input dtype (matmuls in fp16/bf16, softmax in fp32), plus a small floor.
"""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
from minipaged.triton import configs, ops  # noqa: E402
from minipaged.testing import (  # noqa: E402
    assert_close,
    attention_ref,
    cu_seqlens,
    make_varlen_inputs,
    paged_kv,
    paged_ref,
    randn,
    slot_mapping,
    VarlenCase,
)
from minipaged.triton.configs import PagedConfig  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU tests need TRITON_INTERPRET=1")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                                reason="needs a CUDA device and TRITON_INTERPRET unset")
NEG_INF = float("-inf")


# ----------------------------------------------------------------- data and check


def _cu(lens, device):
    return cu_seqlens(lens, device)


def _cache_from_dense(dense_k, dense_v, page, device, seed=0):
    """Per-sequence K/V [L, Hkv, D] on shuffled NaN-poisoned pages, -1 past the used
    table entries. -> (k_cache, v_cache, block_tables, context_lens)."""
    kv = paged_kv(None, dense_k[0].shape[1], dense_k[0].shape[2], page, dense_k[0].dtype, device, seed=seed,
                  spare_blocks=3, keys=dense_k, vals=dense_v)
    return kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens


def _problem(q_lens, ctxs, Hq, Hkv, D, page, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = paged_kv(ctxs, Hkv, D, page, dtype, device, gen=g, spare_blocks=3)
    q = randn((sum(q_lens), Hq, D), dtype, device, g)
    return q, kv.k_cache, kv.v_cache, kv.block_tables, _cu(q_lens, device), kv.context_lens, kv.keys, kv.vals


def _check(out, lse, q, dense_k, dense_v, cu_q, causal, scale, what):
    truth, truth_lse = paged_ref(q, dense_k, dense_v, cu_q, causal=causal, scale=scale)
    base, _ = paged_ref(q, dense_k, dense_v, cu_q, causal=causal, scale=scale, lowp=True)
    assert out.dtype == q.dtype, what
    assert_close(out, truth, base, what, lse=lse, truth_lse=truth_lse)


def _run(q_lens, ctxs, Hq, Hkv, D, page, causal, dtype, device, seed=0, scale=None, **kw):
    q, kc, vc, tables, cu_q, ctx, dk, dv = _problem(q_lens, ctxs, Hq, Hkv, D, page, dtype, device, seed)
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    out, lse = ops.paged(q, kc, vc, tables, cu_q, ctx, max(q_lens + [0]), causal, scale, True, **kw)
    what = f"paged q{q_lens[:8]} ctx{ctxs[:8]} Hq{Hq} Hkv{Hkv} D{D} page{page} causal{causal} {kw}"
    _check(out, lse, q, dk, dv, cu_q, causal, scale, what)
    return out, lse


@pytest.fixture(autouse=True)
def _new_paged_paths():
    """The tests of this file run the long-chunk kernel (v2, the default) with two-launch
    mixed batches through the short packed launch (not the default: configs.PAGED_MIXED is
    "decode"), so the split stays covered; the decode mode has tests of its own here, and the
    default path is what test_paged.py, test_crosscheck.py and the engine tests run."""
    with configs.overriding(paged_long_kernel="v2", paged_mixed="split"):
        yield


# ----------------------------------------------------------------- paged: CPU

CPU_PAGED = [
    # q_lens, context_lens, Hq, Hkv, D, page
    # decode rows, an empty run, short runs, a long chunk, q_len == ctx, q_len > ctx, ctx 0
    ([1, 0, 4, 70, 2, 8, 5, 3], [17, 5, 64, 97, 3, 8, 2, 0], 4, 2, 64, 16),
    ([3, 1, 97], [40, 1, 120], 8, 1, 64, 1),           # GQA 8, one token per page
    ([1, 6, 33], [300, 256, 257], 2, 2, 128, 256),      # Hq == Hkv, page > KV tile
    ([1, 7, 20], [31, 16, 47], 16, 1, 64, 8),           # MQA, pages smaller than a KV tile
]


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", CPU_PAGED, ids=lambda c: f"q{len(c[0])}-H{c[2]}-{c[3]}-D{c[4]}-p{c[5]}")
def test_paged_mixed_interpreter(case, causal, dtype):
    _run(*case, causal, dtype, "cpu")


@cpu_only
@pytest.mark.parametrize("page", [8, 32])
def test_paged_every_residue_interpreter(page):
    """Every residue of (context_len - q_len) mod BLOCK_N (16 on the interpreter),
    with contexts at, below and above page and tile boundaries."""
    bn = configs.paged_config(64, torch.float16, True, 8, 2, torch.device("cpu")).block_n
    q_lens = [1 + (r % 8) for r in range(bn)]
    ctxs = [q + r + bn * (r % 3) for r, q in enumerate(q_lens)]
    assert sorted((c - q) % bn for c, q in zip(ctxs, q_lens)) == list(range(bn))
    _run(q_lens, ctxs, 4, 2, 64, page, True, torch.float16, "cpu", seed=page)


@cpu_only
@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("causal", [True, False])
def test_paged_forced_splits_interpreter(splits, causal):
    """Split-KV + reduce: splits past the end of a short context stay empty."""
    q_lens, ctxs = [1, 4, 19, 0, 2], [150, 61, 90, 7, 1]
    out, lse = _run(q_lens, ctxs, 4, 2, 64, 16, causal, torch.float16, "cpu", num_splits=splits)
    one, one_lse = _run(q_lens, ctxs, 4, 2, 64, 16, causal, torch.float16, "cpu", num_splits=1)
    assert (out.float() - one.float()).abs().max() < 2e-3


@cpu_only
def test_paged_forced_splits_fp32_interpreter():
    _run([3, 1], [77, 200], 8, 2, 64, 4, True, torch.float32, "cpu", num_splits=4)


@cpu_only
@pytest.mark.parametrize("cfg", [PagedConfig(64, 32, 4, 1, False), PagedConfig(16, 16, 4, 1)],
                         ids=["m64n32-prefill-like", "m16n16"])
def test_paged_other_tiles_interpreter(cfg):
    """A prefill-like tile (several positions per program, a KV tile spanning two
    pages, block ids read a tile ahead) and the smallest one (a long chunk in many
    query tiles)."""
    _run([40, 1, 3], [100, 33, 3], 4, 2, 64, 16, True, torch.float16, "cpu", config=cfg)


@cpu_only
@pytest.mark.parametrize("gather", [0, 1, 2])
def test_paged_gather_variants_interpreter(gather, monkeypatch):
    """Every way of reading block ids (ops.PAGED_GATHER, the v1 kernel's), pages smaller
    and larger than the KV tile, with and without splits."""
    monkeypatch.setattr(ops, "PAGED_GATHER", gather)
    with configs.overriding(paged_long_kernel="v1", paged_mixed="one"):
        for page in (1, 4, 32):
            _run([1, 5, 21], [40, 37, 60], 4, 2, 64, page, True, torch.float16, "cpu", seed=page)
        _run([2, 9], [70, 9], 4, 2, 64, 4, True, torch.float16, "cpu", num_splits=3)


@cpu_only
def test_paged_v1_empty_contexts_read_no_table_entry_interpreter():
    """Every context 0 under a block table of no columns: ceil(0 / page) = 0 entries are read
    (DESIGN). The v1 prefill-like tile (block ids read a tile ahead, GATHER 2) read its first
    tile's id before the key loop, even when the loop has no key: past the end of the table (a
    segfault under the interpreter; on a GPU, a read of a zero-size allocation)."""
    g = torch.Generator().manual_seed(5)
    q = randn((41, 4, 64), torch.float16, "cpu", g)
    cache = torch.full((2, 16, 2, 64), float("nan"), dtype=torch.float16)
    tables = torch.empty((2, 0), dtype=torch.int32)
    cu_q, ctx = _cu([1, 40], "cpu"), torch.zeros(2, dtype=torch.int32)
    with configs.overriding(paged_long_kernel="v1", paged_mixed="one"):
        out, lse = ops.paged(q, cache, cache, tables, cu_q, ctx, 40, True, 0.125, True)
    _check(out, lse, q, [cache[0, :0]] * 2, [cache[0, :0]] * 2, cu_q, True, 0.125, "v1, contexts 0, no table column")


@cpu_only
def test_paged_head_dim_256_and_scale_interpreter():
    _run([2, 9], [30, 9], 4, 2, 256, 16, True, torch.float32, "cpu", scale=0.3)


@cpu_only
def test_paged_equals_decode_interpreter():
    """cu_seqlens_q = arange(B + 1): the same attention as decode."""
    ctxs = [17, 0, 97, 1, 64]
    q, kc, vc, tables, _, ctx, dk, dv = _problem([1] * 5, ctxs, 8, 2, 64, 16, torch.float16, "cpu", 3)
    cu_q = torch.arange(6, dtype=torch.int32)
    po, pl = ops.paged(q, kc, vc, tables, cu_q, ctx, 1, True, 0.125, True)
    do, dl = ops.decode(q, kc, vc, tables, ctx, 0.125, True)
    assert (po.float() - do.float()).abs().max() < 2e-3
    assert torch.equal(torch.isneginf(pl), torch.isneginf(dl))
    fin = torch.isfinite(dl)
    assert (pl[fin] - dl[fin]).abs().max() < 1e-3
    _check(po, pl, q, dk, dv, cu_q, True, 0.125, "paged as decode")


@cpu_only
def test_paged_without_lse_returns_tensor_interpreter():
    q, kc, vc, tables, cu_q, ctx, *_ = _problem([2, 1], [5, 9], 4, 2, 64, 16, torch.float16, "cpu")
    out = ops.paged(q, kc, vc, tables, cu_q, ctx, 2, True, 0.125)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    out2, _ = ops.paged(q, kc, vc, tables, cu_q, ctx, 2, True, 0.125, True)
    assert torch.equal(out, out2)
    # nothing to do at all: zeros and -inf without a launch
    empty = ops.paged(q[:0], kc, vc, tables, torch.zeros(3, dtype=torch.int32), ctx, 0, True, 0.1, True)
    assert empty[0].shape == (0, 4, 64) and empty[1].shape == (0, 4)


def test_paged_long_tile_on_sm90(monkeypatch):
    """Long chunks at D 128 over 16-bit pages with groups up to 2 take the one-warpgroup 64-row
    tile on sm_90 (two programs per SM); FP8 pages, larger groups and other GPUs keep the
    128-row prefill tile; short runs stay packed, 32-row packed tiles with 128 keys per step."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cap = {"cap": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: cap["cap"])
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)  # an H200
    dev = torch.device("cuda")

    def tile(group=2, kv_fp8=False, dtype=torch.bfloat16, D=128, maxq=512):
        c = configs.paged_config(D, dtype, True, maxq, group, dev, kv_fp8)
        return c.block_m, c.block_n, c.num_warps, c.num_stages, c.packed

    assert tile() == (64, 64, 4, 3, False)
    assert tile(group=1, dtype=torch.float16) == (64, 64, 4, 3, False)
    assert tile(kv_fp8=True)[:3] == (128, 64, 8)
    assert tile(group=4)[:3] == (128, 64, 8)
    assert tile(maxq=4)[4] is True
    # packed tiles of 32 rows read 128 keys per step there (16-bit pages), of 16 rows 32 keys in
    # 3 stages (16-bit pages; FP8 pages 64 keys capped at 128 registers, the same bytes in
    # flight); other sizes the decode tile's 64
    assert tile(group=8, maxq=4) == (32, 128, 4, 2, True)
    assert tile(group=2, maxq=16) == (32, 128, 4, 2, True)
    assert tile(group=2, maxq=4) == (16, 32, 4, 3, True)
    assert tile(group=2, maxq=1) == (16, 32, 4, 3, True)
    assert tile(group=2, maxq=4, kv_fp8=True) == (16, 64, 4, 3, True)
    assert configs.paged_config(128, torch.bfloat16, True, 1, 2, dev, True).maxnreg == 128
    assert configs.paged_config(128, torch.bfloat16, True, 1, 2, dev, False).maxnreg is None
    assert tile(group=8, maxq=2, kv_fp8=True, dtype=torch.float16) == (16, 64, 4, 3, True)
    assert tile(group=2, maxq=4, dtype=torch.float32) == (16, 32, 8, 2, True)   # the fp32 decode tile
    assert tile(group=2, maxq=4, D=64)[:2] == (16, 64)
    assert tile(group=8, maxq=8) == (64, 64, 4, 2, True)
    assert tile(group=8, maxq=4, kv_fp8=True)[:2] == (32, 64)
    assert tile(group=8, maxq=4, D=64)[:2] == (32, 64)
    cap["cap"] = (8, 0)
    assert tile()[:3] == (128, 64, 8)
    assert tile(group=8, maxq=4)[:2] == (32, 64)
    assert tile(group=2, maxq=4)[:2] == (16, 64)


def test_paged_num_splits_rule(monkeypatch):
    """Split count from shapes only (so a decode step can be graph-captured)."""
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)  # an H200
    dev = torch.device("cuda")

    def splits(S, Tq, maxq, Hkv, cap, group, D=128):
        cfg = (PagedConfig(max(16, 1 << (maxq * group - 1).bit_length()), 64, 4, 2, True)
               if maxq * group <= 64 else PagedConfig(128, 64, 8, 3, False))
        return configs.paged_num_splits(S, Tq, maxq, Hkv, cap, cfg, group, dev)

    assert splits(1, 4, 4, 8, 32768, 2) > 16          # B=1 speculative verify over 32k
    assert splits(1, 1, 1, 8, 32768, 2) > 16          # B=1 decode
    assert splits(1, 2048, 2048, 8, 32768, 2) == 1    # a 2k chunk over 30k cached fills the GPU
    assert splits(256, 256, 1, 8, 4096, 2) == 1       # a large decode batch fills it
    assert splits(1, 4, 4, 8, 64, 2) == 1             # one KV tile: nothing to split
    assert all(1 <= splits(s, s * q, q, h, c, 2) <= configs.MAX_SPLITS
               for s in (1, 7, 300) for q in (1, 4, 100) for h in (1, 8) for c in (16, 10 ** 6))


# ----------------------------------------------------------------- return_lse on the other ops


def _check_dense(out, lse, q, k, v, causal, scale, what):
    """Dense [B, H, N, D] output and [B, Hq, Nq] lse, one sequence at a time."""
    for b in range(q.shape[0]):
        seq = [x[b].transpose(0, 1) for x in (q, k, v)]
        truth, truth_lse = attention_ref(*seq, causal=causal, scale=scale)
        base, _ = attention_ref(*seq, causal=causal, scale=scale, lowp=True)
        assert_close(out[b].transpose(0, 1), truth, base, f"{what} b{b}", lse=lse[b].transpose(0, 1),
                     truth_lse=truth_lse)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_return_lse_interpreter(dtype, causal):
    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, Nq, Nk, D = 2, 4, 2, 29, 21, 64  # Nq > Nk: the first rows see nothing when causal
    q = torch.randn(B, Hq, Nq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Nk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Nk, D, generator=g).to(dtype)
    out, lse = ops.prefill(q, k, v, causal, 0.125, True)
    assert torch.equal(out, ops.prefill(q, k, v, causal, 0.125))
    _check_dense(out, lse, q, k, v, causal, 0.125, "prefill")
    # no key at all
    _, lse0 = ops.prefill(q, k[:, :, :0], v[:, :, :0], causal, 0.125, True)
    assert torch.isneginf(lse0).all()


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prefill_varlen_return_lse_interpreter(dtype):
    lq, lk = [17, 0, 9, 12], [17, 3, 30, 0]
    q, k, v, cu_q, cu_k = make_varlen_inputs(VarlenCase(tuple(lq), tuple(lk), 4, 1, 64), dtype, "cpu", seed=6)
    out, lse = ops.prefill_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), True, 0.125, True)
    ck = cu_k.tolist()
    dk = [k[ck[s]:ck[s + 1]] for s in range(len(lk))]
    dv = [v[ck[s]:ck[s + 1]] for s in range(len(lk))]
    _check(out, lse, q, dk, dv, cu_q, True, 0.125, "varlen lse")


@cpu_only
@pytest.mark.parametrize("splits,worklist", [(None, None), (1, None), (3, None), (3, 1), (64, 1)])
def test_decode_return_lse_interpreter(splits, worklist):
    """The lse of plain, forced-split and work-list decode (configs overrides), and the same
    output whether the lse is asked for or not."""
    ctxs = [17, 0, 97, 1]
    q, kc, vc, tables, cu_q, ctx, dk, dv = _problem([1] * 4, ctxs, 4, 2, 64, 16, torch.float16, "cpu", 9)
    with configs.overriding(decode_splits=splits, decode_worklist=worklist):
        out, lse = ops.decode(q, kc, vc, tables, ctx, 0.125, True)
        assert torch.equal(out, ops.decode(q, kc, vc, tables, ctx, 0.125))
    _check(out, lse, q, dk, dv, cu_q, False, 0.125, f"decode lse splits={splits} worklist={worklist}")


def _split_decode_identity(ctxs, cut, Hq, Hkv, D, page, dtype, device, splits=None):
    """Keys [0, cut) in one cache and [cut, L) in another (two tables): merging the
    two decodes' (o, lse) is the decode over all keys."""
    q, kc, vc, tables, cu_q, ctx, dk, dv = _problem([1] * len(ctxs), ctxs, Hq, Hkv, D, page, dtype,
                                                    device, seed=11)
    cuts = [cut(c) for c in ctxs]
    ka, va = [k[:c] for k, c in zip(dk, cuts)], [v[:c] for v, c in zip(dv, cuts)]
    kb, vb = [k[c:] for k, c in zip(dk, cuts)], [v[c:] for v, c in zip(dv, cuts)]
    kca, vca, ta, ca = _cache_from_dense(ka, va, page, device, seed=1)
    kcb, vcb, tb, cb = _cache_from_dense(kb, vb, page, device, seed=2)
    oa, la = ops.decode(q, kca, vca, ta, ca, 0.1, True)
    ob, lb = ops.decode(q, kcb, vcb, tb, cb, 0.1, True)
    om, lm = ops.merge_attention_states(oa, la, ob, lb)
    whole, whole_lse = ops.decode(q, kc, vc, tables, ctx, 0.1, True)
    # both sides round to the output dtype once: about one ulp apart
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    assert (om.float() - whole.float()).abs().max() <= tol
    assert torch.equal(torch.isneginf(lm), torch.isneginf(whole_lse))
    fin = torch.isfinite(whole_lse)
    assert (lm[fin] - whole_lse[fin]).abs().max() <= 1e-4 * (1 + whole_lse[fin].abs().max())
    _check(om, lm, q, dk, dv, cu_q, False, 0.1, "merged halves")


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_split_decode_merge_identity_interpreter(dtype):
    # cuts inside a page, on a page boundary, at 0 (one side empty) and at L, and a
    # sequence with no key at all (both sides empty)
    cuts = {50: 23, 64: 16, 9: 0, 20: 20, 0: 0}
    _split_decode_identity(list(cuts), lambda c: cuts[c], 4, 2, 64, 16, dtype, "cpu")


# ----------------------------------------------------------------- merge kernel


def _merge_truth(oa, la, ob, lb):
    la, lb = la.double(), lb.double()
    lse = torch.logaddexp(la, lb)
    wa = torch.where(torch.isneginf(la), 0.0, torch.exp(la - lse)).nan_to_num(0.0)
    wb = torch.where(torch.isneginf(lb), 0.0, torch.exp(lb - lse)).nan_to_num(0.0)
    o = (wa[..., None] * oa.double().nan_to_num(0.0) + wb[..., None] * ob.double().nan_to_num(0.0))
    return o, lse


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(37, 4, 64), (3, 5, 2, 128)], ids=["Tq-H-D", "B-N-H-D"])
def test_merge_attention_states(shape, dtype):
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("needs the interpreter or a GPU")
    device = "cuda" if not INTERPRET else "cpu"
    g = torch.Generator().manual_seed(sum(shape))
    oa = torch.randn(shape, generator=g).to(dtype).to(device)
    ob = torch.randn(shape, generator=g).to(dtype).to(device)
    la = (torch.randn(shape[:-1], generator=g) * 4).to(device)
    lb = (torch.randn(shape[:-1], generator=g) * 4).to(device)
    rows = la.numel()
    flat_a, flat_b = la.view(-1), lb.view(-1)
    flat_a[: rows // 4] = NEG_INF                     # only b saw keys
    flat_b[rows // 4: rows // 2] = NEG_INF            # only a saw keys
    flat_a[rows // 2: rows // 2 + 3] = NEG_INF        # neither did
    flat_b[rows // 2: rows // 2 + 3] = NEG_INF
    flat_a[-2:] = 80.0                                # far apart: one side's weight underflows
    flat_b[-2:] = -60.0
    # a side with no key contributes nothing, even if its o held NaN
    oa.view(-1, shape[-1])[: rows // 4] = float("nan")
    out, lse = ops.merge_attention_states(oa, la, ob, lb)
    to, tl_ = _merge_truth(oa, la, ob, lb)
    assert out.dtype == dtype and out.shape == oa.shape and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(tl_))
    both = (torch.isneginf(la) & torch.isneginf(lb))
    assert both.sum() == 3 and (out[both] == 0).all()
    fin = torch.isfinite(tl_)
    assert (lse.double()[fin] - tl_[fin]).abs().max() <= 1e-5 * (1 + tl_[fin].abs().max())
    # the output is rounded to o's dtype once, from fp32 math
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    assert (out.double() - to).abs().max() <= tol * (1 + to.abs().max())


# ----------------------------------------------------------------- GPU

GPU_DTYPES = [torch.bfloat16, torch.float16]

GPU_PAGED = [
    # q_lens, context_lens, Hq, Hkv, D, page
    ([1, 4, 4, 1, 8, 0, 2, 3], [4000, 4096, 37, 1, 2049, 100, 3, 0], 16, 8, 128, 16),   # decode + verify
    ([4096], [32768], 16, 8, 128, 16),                  # 4k chunk over 28k cached
    ([2048, 1, 4, 513], [30000, 32768, 17000, 600], 16, 8, 128, 16),
    ([1, 1, 4], [32768, 9000, 32768], 32, 8, 128, 1),   # GQA 4, page 1
    ([4, 1, 3, 0, 4], [4096, 4000, 33, 5, 129], 64, 8, 128, 16),  # GQA 8: a 32-row packed tile
    ([7, 300, 1], [5000, 300, 64], 16, 2, 64, 256),     # GQA 8, page 256
    ([97, 64, 1, 5], [1500, 64, 1, 4], 8, 8, 64, 32),   # Hq == Hkv
    ([3, 1000], [777, 1000], 16, 16, 128, 64),
    ([1, 2, 3, 4, 5, 6, 7, 8], [63, 64, 65, 127, 128, 129, 1023, 1025], 16, 1, 128, 16),  # MQA
]


@gpu
@needs_cuda
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", GPU_PAGED, ids=lambda c: f"S{len(c[0])}-q{max(c[0])}-L{max(c[1])}-"
                         f"{c[2]}-{c[3]}-{c[4]}-p{c[5]}")
def test_paged_gpu(case, dtype, causal):
    _run(*case, causal, dtype, "cuda", seed=len(case[0]))


# The default sm_90 route for long chunks: prefill_gluon's kernel (D 128, 16-bit pages of >= 16
# tokens, longest chunk >= configs.GLUON_PAGED_MIN_Q). The file's fixture pins v2; these lift it.
GLUON_PAGED = [
    # q_lens, context_lens, Hq, Hkv, page
    ([256] * 128, [256 + r for r in range(128)], 16, 8, 16),       # every residue of (ctx - q) mod 128
    ([300, 1, 4, 513, 0], [3000, 4096, 17, 600, 5], 16, 8, 16),    # long chunks beside decode rows
    ([1000, 257], [1000, 9000], 64, 8, 32),                         # GQA 8
    ([700], [4097], 16, 16, 64),                                    # Hq == Hkv
    ([400, 300], [1999, 300], 16, 8, 128),                          # a page per key tile
    ([333, 1024], [5000, 1031], 16, 2, 256),                        # pages larger than a tile
]


@gpu
@needs_cuda
@pytest.mark.parametrize("loader", ["ahead", "per-copy", "split", "split-serial"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", GLUON_PAGED, ids=lambda c: f"S{len(c[0])}-q{max(c[0])}-L{max(c[1])}-"
                         f"{c[2]}-{c[3]}-p{c[4]}")
def test_paged_gpu_gluon(case, dtype, causal, loader, monkeypatch):
    from minipaged.triton import prefill_gluon

    if torch.cuda.get_device_capability()[0] != 9 or not prefill_gluon.available():
        pytest.skip("the Gluon route is for sm_90 with a triton that has Gluon")
    ran = []
    launch = prefill_gluon.launch_paged
    monkeypatch.setattr(prefill_gluon, "launch_paged", lambda *a, **k: ran.append(1) or launch(*a, **k))
    q_lens, ctxs, hq, hkv, page = case
    # each loader: the block-table entries read a tile ahead, or per page copy; one warp for K
    # and V, or one for each
    with configs.overriding(paged_long_kernel=None, paged_mixed=None, gluon_table_ahead=int(loader != "per-copy"),
                            gluon_split_loader=int(loader.startswith("split")),
                            gluon_overlap=None if loader != "split-serial" else 0):
        out, lse = _run(q_lens, ctxs, hq, hkv, 128, page, causal, dtype, "cuda", seed=len(q_lens))
        assert ran, "the long chunks did not take the Gluon kernel"
        q, kc, vc, tables, cu_q, ctx, *_ = _problem(q_lens, ctxs, hq, hkv, 128, page, dtype, "cuda",
                                                   seed=len(q_lens))
        first = ops.paged(q, kc, vc, tables, cu_q, ctx, max(q_lens), causal, 0.088, True)
        again = ops.paged(q, kc, vc, tables, cu_q, ctx, max(q_lens), causal, 0.088, True)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1]), "not bitwise repeatable"


_SANITIZE_GLUON = """
import torch
from minipaged.testing import cu_seqlens, paged_kv, randn
from minipaged.triton import configs, ops, prefill_gluon, prefill_tma
dev, dt = "cuda", torch.bfloat16
g = torch.Generator().manual_seed(0)
# paged long chunks through each loader: ragged last pages, a block whose second warpgroup has
# no rows (q 300), a decode row beside them; NaN in spare slots, -1 past the used table entries
for page, split, ahead in ((16, 1, 1), (16, 0, 0), (128, 1, 1)):
    configs.set_override("gluon_split_loader", split)
    configs.set_override("gluon_table_ahead", ahead)
    q_lens, ctxs = [300, 1, 257], [1000, 77, 300]
    kv = paged_kv(ctxs, 2, 128, page, dt, dev, gen=g, spare_blocks=2, poison=True)
    q = randn((sum(q_lens), 4, 128), dt, dev, g)
    out, lse = ops.paged(q, kv.k_cache, kv.v_cache, kv.block_tables, cu_seqlens(q_lens, dev), kv.context_lens,
                         max(q_lens), True, 0.1, True)
    assert torch.isfinite(out).all() and prefill_gluon.paged_usable(q, kv.k_cache, kv.v_cache)
# the dense kernel, forced: Nq != Nk and a ragged last tile
q = randn((1, 4, 300, 128), dt, dev, g)
k = randn((1, 2, 700, 128), dt, dev, g)
out, lse = prefill_tma.try_prefill(q, k, k, True, 0.1, True, variant="gluon")
assert torch.isfinite(out).all()
torch.cuda.synchronize()
print("sanitize script done")
"""


@gpu
@needs_cuda
def test_paged_gpu_gluon_memcheck(tmp_path):
    # compute-sanitizer memcheck over the Gluon kernels (sm_90); racecheck does not model the
    # TMA copies and mbarriers they synchronise through
    from sanitizer import run_under_sanitizer

    from minipaged.triton import prefill_gluon

    if torch.cuda.get_device_capability()[0] != 9 or not prefill_gluon.available():
        pytest.skip("the Gluon kernels are for sm_90 with a triton that has Gluon")
    run_under_sanitizer("memcheck", tmp_path / "sanitize_gluon.py", _SANITIZE_GLUON)


@gpu
@needs_cuda
def test_paged_gpu_every_residue():
    bn = configs.paged_config(128, torch.bfloat16, True, 8, 2, torch.device("cuda")).block_n
    q_lens = [1 + (r % 8) for r in range(bn)]
    ctxs = [q + r + bn * (r % 5) for r, q in enumerate(q_lens)]
    _run(q_lens, ctxs, 16, 8, 128, 16, True, torch.bfloat16, "cuda")
    long_q = [100 + r for r in range(0, bn, 7)]  # prefill-like tile
    _run(long_q, [q + 3000 + r for r, q in enumerate(long_q)], 16, 8, 128, 16, True, torch.bfloat16, "cuda")


@gpu
@needs_cuda
@pytest.mark.parametrize("splits", [1, 3, 64])
def test_paged_gpu_forced_splits(splits):
    _run([1, 4, 700, 0], [20000, 3000, 4000, 9], 16, 4, 128, 16, True, torch.float16, "cuda",
         num_splits=splits)


@gpu
@needs_cuda
def test_paged_gpu_fp32():
    _run([1, 4, 200], [3000, 100, 700], 8, 2, 128, 16, True, torch.float32, "cuda")
    _run([1, 4, 200], [3000, 100, 700], 8, 2, 64, 256, False, torch.float32, "cuda")


@gpu
@needs_cuda
def test_paged_gpu_deterministic():
    """Bitwise identical over repeated runs: split and no-split, short and long."""
    for q_lens, ctxs in (([1, 4, 4], [32768, 9000, 100]), ([2048, 1], [30000, 777])):
        q, kc, vc, tables, cu_q, ctx, *_ = _problem(q_lens, ctxs, 16, 8, 128, 16, torch.bfloat16, "cuda")
        first = ops.paged(q, kc, vc, tables, cu_q, ctx, max(q_lens), True, 0.088, True)
        for _ in range(3):
            again = ops.paged(q, kc, vc, tables, cu_q, ctx, max(q_lens), True, 0.088, True)
            assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@gpu
@needs_cuda
def test_paged_gpu_matches_varlen_over_written_cache():
    """A cache filled by write_kv_cache: paged == prefill_varlen on the same K/V."""
    lens, page, Hq, Hkv, D = [1000, 1, 300, 2500], 16, 16, 8, 128
    g = torch.Generator().manual_seed(4)
    kv = paged_kv(lens, Hkv, D, page, torch.bfloat16, "cuda", gen=g, spare_blocks=2)
    k, v = torch.cat(kv.keys), torch.cat(kv.vals)
    q = randn((sum(lens), Hq, D), torch.bfloat16, "cuda", g)
    kc, vc = torch.full_like(kv.k_cache, float("nan")), torch.full_like(kv.v_cache, float("nan"))
    tables = kv.block_tables
    ops.write_kv_cache(k, v, kc, vc, slot_mapping(kv.tables, lens, page).cuda())
    cu = _cu(lens, "cuda")
    ctx = kv.context_lens
    po, pl = ops.paged(q, kc, vc, tables, cu, ctx, max(lens), True, 0.088, True)
    vo, vl = ops.prefill_varlen(q, k, v, cu, cu, max(lens), max(lens), True, 0.088, True)
    assert (po.float() - vo.float()).abs().max() < 2e-2
    assert (pl - vl).abs().max() < 1e-2


@gpu
@needs_cuda
def test_paged_gpu_cuda_graph_capture():
    """No host sync inside ops.paged: a mixed decode/verify step captures and replays."""
    q, kc, vc, tables, cu_q, ctx, *_ = _problem([1, 4, 1], [1000, 37, 2000], 16, 8, 128, 16,
                                                torch.bfloat16, "cuda")
    eager = ops.paged(q, kc, vc, tables, cu_q, ctx, 4, True, 0.088)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.paged(q, kc, vc, tables, cu_q, ctx, 4, True, 0.088)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.paged(q, kc, vc, tables, cu_q, ctx, 4, True, 0.088)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_return_lse_gpu(dtype):
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 16, 1500, 128, generator=g).to(dtype).cuda()
    k = torch.randn(2, 8, 1000, 128, generator=g).to(dtype).cuda()
    v = torch.randn(2, 8, 1000, 128, generator=g).to(dtype).cuda()
    out, lse = ops.prefill(q, k, v, True, 0.088, True)
    assert torch.equal(out, ops.prefill(q, k, v, True, 0.088))
    _check_dense(out, lse, q, k, v, True, 0.088, "prefill gpu")
    _split_decode_identity([4000, 31, 0, 2048], lambda c: c // 3, 16, 8, 128, 16, dtype, "cuda")


# ======================================================= long chunks (v2) and mixed batches
#
# Own oracle, independent of minipaged.testing's: each sequence's K/V read back from the
# cache through its table row by hand, dequantised for fp8 (stored value * scale of the
# KV head), attention in fp64 with the bottom-right causal mask. The low-precision twin
# (matmuls in the input dtype, softmax in fp32, P rounded to the input dtype) sets the
# error bound: the kernel may err at most twice as much, plus a floor for one rounding.

_FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}


def _read_back(cache, row, n, page, scale=None):
    idx = torch.arange(n, device=cache.device)
    blocks = row.to(cache.device).long()[idx // page]
    x = cache[blocks, idx % page].float()
    return x * scale.view(1, -1, 1) if scale is not None else x


def _attn(q, k, v, causal, scale, work):
    """One sequence: q [n, Hq, D], k/v [L, Hkv, D] (float) -> (o [n, Hq, D], lse [n, Hq])."""
    n, hq, d = q.shape
    L, hkv = k.shape[0], k.shape[1]
    o = torch.zeros(n, hq, d, dtype=torch.float64, device=q.device)
    lse = torch.full((n, hq), float("-inf"), dtype=torch.float64, device=q.device)
    if n == 0 or L == 0:
        return o, lse
    rep = hq // hkv
    kk = k.repeat_interleave(rep, 1).transpose(0, 1).to(work)   # [Hq, L, D]
    vv = v.repeat_interleave(rep, 1).transpose(0, 1).to(work)
    soft = torch.float64 if work == torch.float64 else torch.float32
    s = torch.matmul(q.transpose(0, 1).to(work), kk.transpose(1, 2)).to(soft) * scale   # [Hq, n, L]
    i = torch.arange(n, device=q.device).view(n, 1)
    j = torch.arange(L, device=q.device).view(1, L)
    seen = (j <= i + (L - n)) if causal else torch.ones(n, L, dtype=torch.bool, device=q.device)
    s = s.masked_fill(~seen, float("-inf"))
    has = seen.any(1).view(1, n, 1)
    m = torch.where(has, s.amax(-1, keepdim=True), torch.zeros_like(s[..., :1]))
    w = torch.exp(s - m)
    z = w.sum(-1, keepdim=True)
    p = w / torch.where(z > 0, z, torch.ones_like(z))
    o[:] = torch.matmul(p.to(work), vv).transpose(0, 1).double()
    lse[:] = torch.where(has, m + torch.log(torch.where(z > 0, z, torch.ones_like(z))),
                         torch.full_like(m, float("-inf"))).squeeze(-1).transpose(0, 1).double()
    return o, lse


def _oracle(q, kc, vc, tables, q_lens, ctxs, causal, scale, k_scale=None, v_scale=None, lowp=False):
    page = kc.shape[1]
    work = q.dtype if lowp else torch.float64
    outs, lses, at = [], [], 0
    for s, (n, L) in enumerate(zip(q_lens, ctxs)):
        k = _read_back(kc, tables[s], L, page, k_scale)
        v = _read_back(vc, tables[s], L, page, v_scale)
        o, lse = _attn(q[at:at + n].float(), k, v, causal, scale, work)
        outs.append(o)
        lses.append(lse)
        at += n
    return torch.cat(outs), torch.cat(lses)


def _verify(out, lse, q, kc, vc, tables, q_lens, ctxs, causal, scale, what, k_scale=None, v_scale=None):
    truth, truth_lse = _oracle(q, kc, vc, tables, q_lens, ctxs, causal, scale, k_scale, v_scale)
    base, _ = _oracle(q, kc, vc, tables, q_lens, ctxs, causal, scale, k_scale, v_scale, lowp=True)
    assert out.dtype == q.dtype and out.shape == q.shape, what
    o = out.double()
    assert torch.isfinite(o).all(), f"{what}: non-finite output"
    err = (o - truth).abs().max().item() if o.numel() else 0.0
    bound = 2.0 * (base - truth).abs().max().item() + _FLOOR[q.dtype] if o.numel() else 0.0
    assert err <= bound, f"{what}: max err {err:.3e} > {bound:.3e}"
    empty = torch.isneginf(truth_lse)
    assert (o[empty] == 0).all(), f"{what}: a row that sees no key is not exact zeros"
    assert lse.dtype == torch.float32 and torch.equal(torch.isneginf(lse), empty), f"{what}: -inf lse pattern"
    if (~empty).any():
        d = (lse.double() - truth_lse)[~empty].abs()
        assert (d <= 2e-3 * (1 + truth_lse[~empty].abs())).all(), f"{what}: lse err {d.max().item():.3e}"


def _fp8_cache(kv, device, seed):
    """The 16-bit cache of a paged_kv as fp8 with a distinct scale per KV head; NaN
    slots stay NaN."""
    hkv = kv.k_cache.shape[2]
    g = torch.Generator().manual_seed(seed)
    ks = (0.02 + torch.rand(hkv, generator=g) * 0.05).to(device)
    vs = (0.02 + torch.rand(hkv, generator=g) * 0.05).to(device)

    def q8(c, sc):
        return torch.clamp(c.float() / sc.view(1, 1, -1, 1), -448, 448).to(torch.float8_e4m3fn)

    return q8(kv.k_cache, ks), q8(kv.v_cache, vs), ks, vs


def _mixed(q_lens, ctxs, Hq, Hkv, D, page, causal, dtype, device, seed=0, fp8=False, **kw):
    g = torch.Generator().manual_seed(seed)
    kv = paged_kv(ctxs, Hkv, D, page, dtype, device, gen=g, spare_blocks=3)   # NaN slots, -1 tails
    q = randn((sum(q_lens), Hq, D), dtype, device, g)
    kc, vc, ks, vs = (*_fp8_cache(kv, device, seed),) if fp8 else (kv.k_cache, kv.v_cache, None, None)
    scale = 1.0 / math.sqrt(D)
    cu = _cu(q_lens, device)
    out, lse = ops.paged(q, kc, vc, kv.block_tables, cu, kv.context_lens, max(q_lens + [0]), causal, scale,
                         True, ks, vs, **kw)
    what = (f"q{q_lens[:8]} ctx{ctxs[:8]} H{Hq}/{Hkv} D{D} page{page} causal{causal} {dtype} fp8={fp8} {kw} "
            f"{dict(configs.OVERRIDES)}")
    _verify(out, lse, q, kc, vc, kv.block_tables, q_lens, ctxs, causal, scale, what, ks, vs)
    return out, lse


def _plan(q_lens, Hq=4, Hkv=2, D=64, page=16, device="cpu", width=8, contiguous=True):
    """The launches ops.paged makes for these query lengths (host only)."""
    kc = torch.zeros(4, page, Hkv, D, dtype=torch.float16, device=device)
    if not contiguous:
        kc = torch.zeros(4, page, Hkv, 2 * D, dtype=torch.float16, device=device)[..., :D]
    q = torch.zeros(sum(q_lens), Hq, D, dtype=torch.float16, device=device)
    tables = torch.zeros(len(q_lens), width, dtype=torch.int32, device=device)
    ok = ops._v2_usable(q, kc, kc, tables, len(q_lens))
    return ops._paged_launches(D, q.dtype, True, q.shape[0], len(q_lens), max(q_lens), Hq // Hkv,
                               torch.device(device), ok, None)


@cpu_only
def test_paged_launch_plans():
    """Which launches each batch gets (interpreter tiles: packed up to 32 rows, short
    launch up to 16 rows = 8 positions at group 2)."""
    kinds = lambda p: [(x.kernel, x.min_q, x.max_q, x.cfg.packed) for x in p]  # noqa: E731
    # the defaults, from the H200 A/B: the long-chunk kernel, a mixed batch's decodes through
    # the decode kernel
    assert (configs.PAGED_LONG_KERNEL, configs.PAGED_MIXED) == ("v2", "decode")
    with configs.overriding(paged_long_kernel=None, paged_mixed=None):
        assert kinds(_plan([40, 1])) == [("v2", 1, 0, False), ("decode", 0, 1, True)]
    assert kinds(_plan([4, 1, 4])) == [("v2", 0, 0, True)]                      # spec: one packed launch
    with configs.overriding(paged_long_kernel="v2", paged_mixed="split"):
        assert kinds(_plan([40, 40])) == [("v2", 0, 0, False)]                       # uniform chunks
        assert kinds(_plan([40, 1, 0, 4])) == [("v2", 8, 0, False), ("v1", 0, 8, True)]
        # 40 + 40 + 39 tokens: no sequence can have <= 8, so no short launch
        assert kinds(_plan([40, 40, 39])) == [("v2", 0, 0, False)]
        assert kinds(_plan([40, 40, 8])) == [("v2", 8, 0, False), ("v1", 0, 8, True)]
        # v2 needs the contiguous layout it bakes in, and at most PAGED_SEARCH^2 sequences
        assert kinds(_plan([40, 1], contiguous=False))[0][0] == "v1"
        assert kinds(_plan([40] + [1] * (configs.PAGED_SEARCH ** 2)))[0][0] == "v1"
    with configs.overriding(paged_long_kernel="v2", paged_mixed="one"):
        assert kinds(_plan([40, 1])) == [("v2", 0, 0, False)]
    with configs.overriding(paged_long_kernel="v1", paged_mixed="split"):
        assert kinds(_plan([40, 1])) == [("v1", 8, 0, False), ("v1", 0, 8, True)]
    with configs.overriding(paged_long_kernel="v2", paged_mixed="split", paged_short=(32, 16, 4, 1)):
        assert kinds(_plan([40, 1])) == [("v2", 16, 0, False), ("v1", 0, 16, True)]
    # q_len 1 rows through the decode kernel (tile: BLOCK_H rows, the decode BLOCK_N), the
    # rest of a batch with a long chunk through the long launch; short runs stay with it
    with configs.overriding(paged_long_kernel="v2", paged_mixed="decode"):
        assert kinds(_plan([40, 1, 0, 4])) == [("v2", 1, 0, False), ("decode", 0, 1, True)]
        assert kinds(_plan([40, 40])) == [("v2", 0, 0, False)]
        assert kinds(_plan([40, 40, 39])) == [("v2", 0, 0, False)]   # no room for a decode
        assert kinds(_plan([40, 40, 1])) == [("v2", 1, 0, False), ("decode", 0, 1, True)]
        assert kinds(_plan([4, 1, 4])) == [("v2", 0, 0, True)]       # no long chunk: one packed launch
        dec = _plan([40, 1], Hq=16, Hkv=2)[1].cfg                      # group 8
        assert (dec.block_m, dec.block_n) == (16, configs.decode_config(64, torch.float16,
                                                                        torch.device("cpu")).block_n)
        assert _plan([40, 1], Hq=32, Hkv=1)[1].cfg.block_m == 32       # BLOCK_H covers the group
    with configs.overriding(paged_long_kernel="v1", paged_mixed="decode"):
        assert kinds(_plan([40, 1])) == [("v1", 1, 0, False), ("decode", 0, 1, True)]
    assert configs.PAGED_MIXED_MODES == ("one", "split", "decode")
    with pytest.raises(ValueError, match="paged_mixed"):
        configs.set_override("paged_mixed", "three")


MIXED = [
    # decode rows, empty runs, a speculative run, long chunks (one with q_len > ctx:
    # its first rows see no key), an empty context, contexts across page/tile edges
    ([1, 0, 4, 45, 1, 2, 33, 0, 1], [17, 5, 64, 97, 1, 8, 20, 0, 0]),
]


@cpu_only
@pytest.mark.parametrize("page", [1, 16, 64])
def test_paged_mixed_pages_interpreter(page):
    """q_len 0/1/4/long in one call: the long launch (compact tile space) and the packed
    short launch, each skipping the other's sequences."""
    for q_lens, ctxs in MIXED:
        assert len(_plan(q_lens, page=page)) == 2
        _mixed(q_lens, ctxs, 4, 2, 64, page, True, torch.float16, "cpu", seed=page)


@cpu_only
@pytest.mark.parametrize("variant", [
    dict(paged_long_kernel="v1"),                     # v1 long launch skipping short sequences
    dict(paged_mixed="one"),                          # v2 over every sequence
    dict(paged_prefetch=0),                           # block ids read in the same iteration
    dict(paged_short=(32, 16, 4, 1)),                 # a wider short tile (16 positions)
], ids=["v1-split", "v2-one", "no-prefetch", "short32"])
def test_paged_mixed_variants_interpreter(variant):
    with configs.overriding(**variant):
        _mixed(*MIXED[0], 4, 2, 64, 16, True, torch.float16, "cpu", seed=1)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_paged_mixed_not_causal_interpreter(dtype):
    _mixed(*MIXED[0], 8, 2, 64, 16, False, dtype, "cpu", seed=2)


@cpu_only
@pytest.mark.parametrize("splits", [2, 5])
def test_paged_mixed_forced_splits_interpreter(splits):
    """Both launches split: the long launch's reduce runs over every row, then the short
    launch (and its own reduce) rewrites its sequences' rows."""
    _mixed(*MIXED[0], 4, 2, 64, 16, True, torch.float16, "cpu", seed=3, num_splits=splits)


@cpu_only
@pytest.mark.parametrize("ragged", [False, True], ids=["direct", "compact"])
def test_paged_long_every_residue_interpreter(ragged):
    """Every residue of (context_len - q_len) mod BLOCK_N (16 on the interpreter) on the
    long-chunk kernel: equal q_lens take the direct tile layout, ragged ones the compact
    tile space."""
    bn = configs.paged_config(64, torch.float16, True, 20, 2, torch.device("cpu")).block_n
    q_lens = [17 + (r % 5) if ragged else 20 for r in range(bn)]
    ctxs = [q + r + bn * (r % 3) for r, q in enumerate(q_lens)]
    assert sorted((c - q) % bn for c, q in zip(ctxs, q_lens)) == list(range(bn))
    assert [x.kernel for x in _plan(q_lens)][0] == "v2"
    _mixed(q_lens, ctxs, 4, 2, 64, 8, True, torch.float16, "cpu", seed=4)


@cpu_only
@pytest.mark.parametrize("ragged", [False, True], ids=["direct", "compact"])
def test_paged_long_program_orders_agree_interpreter(ragged):
    """The long-chunk kernel's two program orders (KV heads fastest on axis 0, the default, or
    heads on axis 1) run the same tiles: both within the oracle's bound, with the same bits,
    over 4 KV heads so that the head index really comes from axis 0 in one and axis 1 in the
    other; one long chunk and short runs beside it."""
    q_lens = [70, 20, 3] if ragged else [40, 40]
    ctxs = [90, 20, 33] if ragged else [40, 97]
    assert [x.kernel for x in _plan(q_lens, Hq=8, Hkv=4)][0] == "v2"
    outs = []
    for fastest in (1, 0):
        with configs.overriding(paged_heads_fastest=fastest):
            outs.append(_mixed(q_lens, ctxs, 8, 4, 64, 16, True, torch.float16, "cpu", seed=6))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@cpu_only
def test_paged_long_coarse_search_interpreter(monkeypatch):
    """A program finds its sequence in two passes when S > SEARCH (coarse steps of
    ceil(S / SEARCH) slot starts): 11 sequences with SEARCH 4."""
    monkeypatch.setattr(configs, "PAGED_SEARCH", 4)
    q_lens = [19, 0, 1, 40, 3, 17, 0, 33, 1, 2, 25]
    ctxs = [40, 3, 9, 40, 30, 17, 0, 60, 1, 2, 90]
    _mixed(q_lens, ctxs, 4, 2, 64, 16, True, torch.float16, "cpu", seed=5)


@cpu_only
@pytest.mark.parametrize("splits", [None, 3])
def test_paged_mixed_fp8_interpreter(splits):
    """fp8 caches (per-head scales) through both launches of a mixed batch."""
    kw = {} if splits is None else {"num_splits": splits}
    _mixed(*MIXED[0], 4, 2, 64, 16, True, torch.float16, "cpu", seed=6, fp8=True, **kw)


# ----------------------------------------------------------------- mixed mode "decode" (CPU)
#
# The q_len 1 sequences of a batch with a long chunk go through the decode kernel in its
# packed-query mode (decode.py PACKED_Q), the rest through the long launch with MIN_Q = 1.
# Outputs and every scratch buffer ops allocates are NaN-poisoned (_nan_scratch), so a row
# that neither launch writes, a partial that a skipped program was meant to write, or a
# reduce that merges a sequence it should skip shows up as non-finite or wrong.


class _NanTorch:
    """torch, except that empty() hands out NaN-filled floating tensors."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t


@contextlib.contextmanager
def _nan_scratch():
    saved = ops.torch
    ops.torch = _NanTorch()
    try:
        yield
    finally:
        ops.torch = saved


def _decode_mode(q_lens, ctxs, Hq, Hkv, D, page, causal, dtype, seed=0, **kw):
    """_mixed under mixed mode "decode", after checking that the call gets the two launches."""
    with configs.overriding(paged_long_kernel="v2", paged_mixed="decode"):
        kinds = [(x.kernel, x.min_q, x.max_q) for x in _plan(q_lens, Hq=Hq, Hkv=Hkv, D=D, page=page)]
        assert kinds == [("v2", 1, 0), ("decode", 0, 1)], kinds
        with _nan_scratch():
            return _mixed(q_lens, ctxs, Hq, Hkv, D, page, causal, dtype, "cpu", seed=seed, **kw)


DECODE_MIXED = [
    # q_lens, context_lens, Hq, Hkv, D, page: decodes (context 0, 1, on and off page and
    # tile edges), empty runs, runs of 2..16 and > 16 tokens (one with q_len > ctx)
    ([1, 0, 2, 45, 1, 16, 1, 0, 5, 1, 17], [17, 5, 64, 97, 1, 40, 0, 3, 9, 33, 12], 4, 2, 64, 16),
    ([1, 3, 8, 1, 0, 1], [1, 3, 50, 0, 2, 20], 16, 2, 64, 1),            # group 8, a page per key
    ([1, 40, 1, 2, 1], [129, 70, 256, 2, 16], 2, 2, 128, 128),           # group 1, D 128, page > tile
]


@cpu_only
@pytest.mark.parametrize("case", DECODE_MIXED, ids=["g2-D64-p16", "g8-D64-p1", "g1-D128-p128"])
def test_paged_decode_mode_interpreter(case):
    _decode_mode(*case, True, torch.float16, seed=11)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_paged_decode_mode_not_causal_interpreter(dtype):
    _decode_mode(*DECODE_MIXED[0], False, dtype, seed=12)


@cpu_only
@pytest.mark.parametrize("splits", [2, 5])
def test_paged_decode_mode_forced_splits_interpreter(splits):
    """Both launches split: the long launch's reduce writes every row (NaN for the decode
    rows, from poisoned partials), then the decode launch and its reduce rewrite exactly
    the decode rows; splits past a short context stay empty."""
    _decode_mode(*DECODE_MIXED[0], True, torch.float16, seed=13, num_splits=splits)


@cpu_only
@pytest.mark.parametrize("splits", [None, 3])
def test_paged_decode_mode_fp8_interpreter(splits):
    """fp8 caches: the decode kernel's fp8 path (per-head scales) on the packed rows."""
    kw = {} if splits is None else {"num_splits": splits}
    _decode_mode(*DECODE_MIXED[1], True, torch.float16, seed=14, fp8=True, **kw)


@cpu_only
@pytest.mark.parametrize("budget", [None, 6])
@pytest.mark.parametrize("case", DECODE_MIXED + [([1, 1, 40, 1, 0, 1], [300, 3, 60, 0, 9, 17], 4, 2, 64, 16)],
                         ids=["g2-D64-p16", "g8-D64-p1", "g1-D128-p128", "one-long"])
def test_paged_decode_mode_worklist_interpreter(case, budget):
    """configs.decode_worklist on a paged batch's decode rows: only the q_len 1 sequences take
    slots; the long launch writes the others. NaN-poisoned scratch, so a slot that no program
    fills or a reduce that merges a skipped sequence shows."""
    with configs.overriding(decode_worklist=1, decode_splits=budget):
        _decode_mode(*case, True, torch.float16, seed=16)
        _decode_mode(*case, True, torch.float16, seed=17, fp8=True)


@cpu_only
def test_paged_decode_mode_v1_and_fallbacks_interpreter():
    """With the v1 long kernel (what a non-contiguous cache gets) the long launch skips the
    decodes too; shapes that rule a q_len 1 sequence out, or a batch of short runs, keep
    one launch."""
    with configs.overriding(paged_long_kernel="v1", paged_mixed="decode"):
        assert [(x.kernel, x.min_q, x.max_q) for x in _plan([40, 1])] == [("v1", 1, 0), ("decode", 0, 1)]
        with _nan_scratch():
            _mixed([1, 33, 0, 1, 2], [40, 35, 0, 0, 2], 4, 2, 64, 16, True, torch.float16, "cpu", seed=15)
    with configs.overriding(paged_long_kernel="v2", paged_mixed="decode"):
        assert [x.kernel for x in _plan([40, 1], contiguous=False)] == ["v1", "decode"]
        # 40 + 40 + 2 tokens in 3 sequences: none can be a decode
        assert [x.kernel for x in _plan([40, 40, 2])] == ["v2"]
        assert [x.kernel for x in _plan([4, 1, 4])] == ["v2"]               # packed: one launch


# ----------------------------------------------------------------- long chunks and mixed batches: GPU

GPU_MIXED = [
    # the bench's mixed batch, with empty and speculative runs added
    ([2048] + [1] * 60 + [0, 4, 1], [4096] * 64),
    ([512] * 8, [4608] * 8),                                  # bench chunked (uniform: direct layout)
    ([700, 1, 4, 0, 129, 3000], [4000, 1, 4100, 9, 129, 2999]),   # q_len > ctx in the last one
]


@gpu
@needs_cuda
@pytest.mark.parametrize("page", [1, 16, 64, 128])
@pytest.mark.parametrize("case", GPU_MIXED, ids=["mixed", "chunked", "ragged"])
def test_paged_gpu_long_and_mixed(case, page):
    _mixed(*case, 16, 8, 128, page, True, torch.bfloat16, "cuda", seed=page)


@gpu
@needs_cuda
@pytest.mark.parametrize("variant", [
    dict(paged_long_kernel="v1", paged_mixed="one"), dict(paged_long_kernel="v1"), dict(paged_mixed="one"),
    dict(paged_prefetch=0), dict(paged=(64, 64, 4, 3)), dict(paged=(128, 32, 8, 4)),
    dict(paged_short=(32, 64, 4, 2)),
    dict(paged_mixed="decode"), dict(paged_long_kernel="v1", paged_mixed="decode"),
], ids=["old", "v1-split", "v2-one", "no-prefetch", "bm64", "bn32", "short32", "v2-decode", "v1-decode"])
def test_paged_gpu_variants(variant):
    """Every configuration the A/B script times, on the sm_90 tiles."""
    with configs.overriding(**variant):
        _mixed(*GPU_MIXED[0], 16, 8, 128, 16, True, torch.bfloat16, "cuda", seed=7)
        _mixed(*GPU_MIXED[2], 16, 8, 128, 16, False, torch.float16, "cuda", seed=8)


@gpu
@needs_cuda
@pytest.mark.parametrize("page", [1, 16, 128])
@pytest.mark.parametrize("case", GPU_MIXED, ids=["mixed", "chunked", "ragged"])
def test_paged_gpu_decode_mode(case, page):
    """Mixed mode "decode" on the sm_90 tiles, outputs and scratch NaN-poisoned."""
    with configs.overriding(paged_mixed="decode"), _nan_scratch():
        _mixed(*case, 16, 8, 128, page, True, torch.bfloat16, "cuda", seed=20 + page)


@gpu
@needs_cuda
@pytest.mark.parametrize("variant", [
    dict(dtype=torch.float16, causal=False), dict(num_splits=4), dict(num_splits=64), dict(fp8=True),
    dict(fp8=True, num_splits=3), dict(heads=(16, 2, 64)), dict(heads=(8, 8, 128)), dict(heads=(32, 8, 128)),
], ids=["fp16-full", "splits4", "splits64", "fp8", "fp8-splits3", "g8-D64", "g1", "g4"])
def test_paged_gpu_decode_mode_variants(variant):
    """Mixed mode "decode": both launches split (forced), fp8 caches, other GQA groups and
    head dims (the decode kernel's BLOCK_H per group)."""
    kw = dict(variant)
    dtype, causal = kw.pop("dtype", torch.bfloat16), kw.pop("causal", True)
    hq, hkv, d = kw.pop("heads", (16, 8, 128))
    q_lens, ctxs = [1, 700, 0, 1, 4, 1, 129, 1, 16], [1, 4000, 9, 0, 4100, 5000, 129, 32768, 17]
    with configs.overriding(paged_mixed="decode"), _nan_scratch():
        _mixed(q_lens, ctxs, hq, hkv, d, 16, causal, dtype, "cuda", seed=30, **kw)


@gpu
@needs_cuda
@pytest.mark.parametrize("variant", [dict(), dict(fp8=True), dict(heads=(16, 2, 64)), dict(budget=128)],
                         ids=["bf16", "fp8", "g8-D64", "S128"])
def test_paged_gpu_decode_mode_worklist(variant):
    """configs.decode_worklist on a paged batch's decode rows (one 32k decode among short ones
    and a 700-token chunk), scratch NaN-poisoned, and bitwise repeatable under a CUDA graph."""
    kw = dict(variant)
    hq, hkv, d = kw.pop("heads", (16, 8, 128))
    q_lens, ctxs = [1, 700, 0, 1, 4, 1, 129, 1, 16] + [1] * 40, [1, 4000, 9, 0, 4100, 5000, 129, 32768, 17] + [900] * 40
    with configs.overriding(paged_mixed="decode", decode_worklist=1, decode_splits=kw.pop("budget", None)):
        with _nan_scratch():
            _mixed(q_lens, ctxs, hq, hkv, d, 16, True, torch.bfloat16, "cuda", seed=31, **kw)
        if not kw:
            q, kc, vc, tables, cu_q, ctx, *_ = _problem(q_lens, ctxs, hq, hkv, d, 16, torch.bfloat16, "cuda")
            _graph_and_repeatable(q, kc, vc, tables, cu_q, ctx, max(q_lens))


def _graph_and_repeatable(q, kc, vc, tables, cu_q, ctx, max_q):
    """ops.paged under the current overrides: bitwise repeatable eagerly, and a CUDA graph
    captured after a warm-up on a side stream replays to the same bits. -> the eager output."""
    eager = ops.paged(q, kc, vc, tables, cu_q, ctx, max_q, True, 0.088)
    for _ in range(2):
        assert torch.equal(eager, ops.paged(q, kc, vc, tables, cu_q, ctx, max_q, True, 0.088))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.paged(q, kc, vc, tables, cu_q, ctx, max_q, True, 0.088)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.paged(q, kc, vc, tables, cu_q, ctx, max_q, True, 0.088)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    return eager


@gpu
@needs_cuda
def test_paged_gpu_decode_mode_graph_and_determinism():
    """Mixed mode "decode" (two launches, decided on the device) captures into a CUDA graph
    and is bitwise repeatable; its decode rows equal decode_attention on the same rows."""
    q_lens, ctxs = GPU_MIXED[0]
    q, kc, vc, tables, cu_q, ctx, *_ = _problem(q_lens, ctxs, 16, 8, 128, 16, torch.bfloat16, "cuda")
    with configs.overriding(paged_mixed="decode"):
        eager = _graph_and_repeatable(q, kc, vc, tables, cu_q, ctx, max(q_lens))
    decs = [s for s, n in enumerate(q_lens) if n == 1]
    rows = cu_q[torch.tensor(decs, device="cuda")].long()
    sel = torch.tensor(decs, device="cuda")
    alone = ops.decode(q[rows].contiguous(), kc, vc, tables[sel].contiguous(), ctx[sel].contiguous(), 0.088)
    # the same kernel on the same rows, with the split count of a 64-sequence batch
    # against that of the decodes alone: equal up to the split merge's rounding
    assert (eager[rows].float() - alone.float()).abs().max() <= 2e-2


@gpu
@needs_cuda
def test_paged_gpu_long_every_residue():
    """Every residue of (context_len - q_len) mod the sm_90 BLOCK_N, direct and compact."""
    bn = configs.paged_config(128, torch.bfloat16, True, 512, 2, torch.device("cuda")).block_n
    for ragged in (False, True):
        q_lens = [100 + (r % 7) * 13 if ragged else 160 for r in range(bn)]
        ctxs = [q + r + bn * (r % 4) for r, q in enumerate(q_lens)]
        _mixed(q_lens, ctxs, 16, 8, 128, 16, True, torch.bfloat16, "cuda", seed=9)


@gpu
@needs_cuda
@pytest.mark.parametrize("splits", [None, 4])
def test_paged_gpu_mixed_fp8(splits):
    kw = {} if splits is None else {"num_splits": splits}
    _mixed(*GPU_MIXED[2], 16, 8, 128, 16, True, torch.bfloat16, "cuda", seed=10, fp8=True, **kw)


@gpu
@needs_cuda
@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("page", [16, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_gpu_packed_fp8(dtype, page, splits):
    """FP8 pages through the packed tile alone (every query run fits it: decodes and speculative
    runs; on sm_90 at D 128 FP8's own 64-key tile): ragged contexts that end on many residues
    of 64 keys (4097, 97, 1023, 71, 130, 32768), a sequence with no context and no query, and
    one with a single token."""
    q_lens = [4, 1, 0, 3, 8, 2, 1, 4, 4]
    ctxs = [4097, 1, 0, 97, 16, 71, 32768, 1023, 130]
    if torch.cuda.get_device_capability()[0] == 9:
        cfg = configs.paged_config(128, dtype, True, max(q_lens), 2, torch.device("cuda"), True)
        assert (cfg.block_m, cfg.block_n, cfg.maxnreg) == (16, 64, 128)
    kw = {} if splits is None else {"num_splits": splits}
    with _nan_scratch():
        _mixed(q_lens, ctxs, 16, 8, 128, page, True, dtype, "cuda", seed=31, fp8=True, **kw)


@gpu
@needs_cuda
def test_paged_gpu_mixed_graph_and_determinism():
    """The two-launch mixed batch captures into a CUDA graph and is bitwise repeatable."""
    q_lens, ctxs = GPU_MIXED[0]
    q, kc, vc, tables, cu_q, ctx, *_ = _problem(q_lens, ctxs, 16, 8, 128, 16, torch.bfloat16, "cuda")
    _graph_and_repeatable(q, kc, vc, tables, cu_q, ctx, max(q_lens))


# ----------------------------------------------------------------- packed tiles through v2 (CPU)
#
# configs.paged_packed_kernel "v2" (the default): batches whose every query run fits one packed
# tile (decodes, speculative runs) through the long-chunk kernel's leaner loop instead of v1.

PACKED = [
    # q_lens, context_lens, Hq, Hkv, D, page: decodes and speculative runs (empty runs, q_len >
    # ctx, context 0, contexts on and off page and tile edges)
    ([1, 4, 0, 3, 1, 4, 2], [17, 64, 5, 2, 0, 97, 16], 4, 2, 64, 16),
    ([1, 2, 1, 3], [40, 1, 33, 120], 8, 1, 64, 1),             # group 8, one key per page
    ([4, 1, 6], [300, 256, 257], 2, 2, 128, 256),              # group 1, page > KV tile
    ([1, 1, 1, 1, 1], [31, 16, 47, 0, 9], 16, 1, 64, 8),       # MQA decodes, pages < KV tile
]


def _packed_v2(q_lens, ctxs, Hq, Hkv, D, page, causal, dtype, seed=0, **kw):
    with configs.overriding(paged_packed_kernel="v2"):
        plan = _plan(q_lens, Hq=Hq, Hkv=Hkv, D=D, page=page)
        assert [(x.kernel, x.cfg.packed) for x in plan] == [("v2", True)], plan
        with _nan_scratch():
            return _mixed(q_lens, ctxs, Hq, Hkv, D, page, causal, dtype, "cpu", seed=seed, **kw)


@cpu_only
def test_paged_packed_kernel_plans():
    """Packed batches take v2 by default and v1 under the knob; v2 only where its layout
    holds, and never for a forced packed tile."""
    assert configs.PAGED_PACKED_KERNEL == "v2"
    with configs.overriding(paged_packed_kernel="v1"):
        assert [x.kernel for x in _plan([4, 1, 4])] == ["v1"]
    with configs.overriding(paged_packed_kernel="v2"):
        assert [x.kernel for x in _plan([4, 1, 4])] == ["v2"]
        assert [x.kernel for x in _plan([4, 1, 4], contiguous=False)] == ["v1"]
        forced = ops._paged_launches(64, torch.float16, True, 9, 3, 4, 2, torch.device("cpu"), True,
                                     PagedConfig(16, 16, 4, 1))
        assert [x.kernel for x in forced] == ["v1"]
    with pytest.raises(ValueError, match="paged_packed_kernel"):
        configs.set_override("paged_packed_kernel", "v3")


@cpu_only
@pytest.mark.parametrize("case", PACKED, ids=["g2-D64-p16", "g8-D64-p1", "g1-D128-p256", "g16-D64-p8"])
def test_paged_packed_v2_interpreter(case):
    _packed_v2(*case, True, torch.float16, seed=21)


@cpu_only
@pytest.mark.parametrize("case", PACKED, ids=["g2-D64-p16", "g8-D64-p1", "g1-D128-p256", "g16-D64-p8"])
def test_paged_packed_v1_interpreter(case):
    """v1 still serves packed tiles over caches v2 cannot take (and under the knob)."""
    with configs.overriding(paged_packed_kernel="v1"), _nan_scratch():
        assert [x.kernel for x in _plan(case[0], Hq=case[2], Hkv=case[3], D=case[4], page=case[5])] == ["v1"]
        _mixed(*case, True, torch.float16, "cpu", seed=26)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_paged_packed_v2_not_causal_interpreter(dtype):
    _packed_v2(*PACKED[0], False, dtype, seed=22)


@cpu_only
@pytest.mark.parametrize("splits", [2, 5])
def test_paged_packed_v2_forced_splits_interpreter(splits):
    _packed_v2(*PACKED[0], True, torch.float16, seed=23, num_splits=splits)


@cpu_only
def test_paged_packed_v2_every_residue_interpreter():
    """Every residue of (context_len - q_len) mod BLOCK_N for speculative runs of 4."""
    bn = configs.paged_config(64, torch.float16, True, 4, 2, torch.device("cpu")).block_n
    q_lens = [4] * bn
    ctxs = [4 + r + bn * (r % 3) for r in range(bn)]
    assert sorted((c - q) % bn for c, q in zip(ctxs, q_lens)) == list(range(bn))
    _packed_v2(q_lens, ctxs, 4, 2, 64, 8, True, torch.float16, seed=24)


@cpu_only
@pytest.mark.parametrize("splits", [None, 3])
def test_paged_packed_v2_fp8_interpreter(splits):
    """fp8 caches (per-head scales) through v2's packed launch, with its fp16 dots forced (the
    default only for a bf16 q, which the interpreter cannot run)."""
    kw = {} if splits is None else {"num_splits": splits}
    with configs.overriding(paged_fp8_f16=1):
        _packed_v2(*PACKED[0], True, torch.float16, seed=25, fp8=True, **kw)
