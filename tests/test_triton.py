"""Tests of the `triton` backend, called through the public API, against the fp64 oracle.

Without a GPU the kernels run in the Triton interpreter (fp16/fp32 only: the
interpreter's bf16 tl.dot is wrong). CI runs this file as its own process:

    TRITON_INTERPRET=1 PYTHONPATH=src pytest tests/test_triton.py

(the module also sets TRITON_INTERPRET=1 itself when no CUDA device is
present, which works as long as nothing imported minipaged.triton before).
GPU tests: `pytest -m gpu tests/test_triton.py` on the H200.

Error bound, as FlashAttention's tests: the kernel's error against the fp64
oracle of minipaged.testing (written independently of minipaged.reference, so a
wrong torch backend can neither pass itself off as the truth nor widen the
bound) must be within twice the error that plain low-precision PyTorch math
(the same attention with matmuls in fp16/bf16) makes against that oracle,
plus a small absolute floor.
"""

from __future__ import annotations

import itertools
import math
import os
from fractions import Fraction

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import minipaged as mp  # noqa: E402
from minipaged.triton import configs  # noqa: E402
from minipaged.testing import (  # noqa: E402
    DecodeCase,
    PrefillCase,
    VarlenCase,
    assert_close,
    assert_same_cache,
    decode_ref,
    gather_kv,
    make_decode_inputs,
    make_prefill_inputs,
    make_varlen_inputs,
    make_write_inputs,
    prefill_ref,
    strided_copy,
    varlen_ref,
)

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from minipaged.triton.decode import _worklist_plan  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU tests need TRITON_INTERPRET=1")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                                reason="needs a CUDA device and TRITON_INTERPRET unset")


# ----------------------------------------------------------------- prefill


def _run_prefill(B, Hq, Hkv, Nq, Nk, D, causal, dtype, device, noncontig=False, scale=None):
    q, k, v = make_prefill_inputs(PrefillCase(B, Nq, Nk, Hq, Hkv, D, causal), dtype, device,
                                  seed=1000 * Nq + Nk + Hq)
    if noncontig:
        q, k, v = strided_copy(q), strided_copy(k), strided_copy(v)
        assert not q.is_contiguous() and q.stride(-1) == 1
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    out = mp.prefill_attention(q, k, v, causal=causal, scale=scale, backend="triton")
    assert out.shape == (B, Hq, Nq, D) and out.dtype == dtype
    truth, truth_lse = prefill_ref(q, k, v, causal=causal, scale=scale)
    baseline, _ = prefill_ref(q, k, v, causal=causal, scale=scale, lowp=True)
    # rows that see no key must be exact zeros: checked where truth_lse is -inf
    assert_close(out, truth, baseline, f"prefill B{B} Hq{Hq} Hkv{Hkv} Nq{Nq} Nk{Nk} D{D} c{causal}",
                 truth_lse=truth_lse)
    return out


CPU_PREFILL = [
    # B, Hq, Hkv, Nq, Nk, D, causal
    (1, 2, 1, 17, 17, 64, True),
    (2, 4, 2, 97, 97, 64, True),
    (1, 8, 1, 33, 33, 64, True),      # GQA 8
    (1, 16, 1, 17, 17, 64, True),     # GQA 16 (MQA)
    (1, 4, 4, 20, 50, 128, True),     # chunk after a cached prefix (Nq < Nk)
    (1, 4, 2, 50, 20, 64, True),      # Nq > Nk: the first 30 rows see nothing
    (2, 2, 1, 31, 45, 64, False),
    (1, 2, 1, 45, 31, 128, False),
    (1, 2, 1, 1, 37, 64, True),       # a single query row
    (1, 2, 1, 5, 0, 64, True),        # no keys at all
    (1, 2, 1, 5, 0, 64, False),
]


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", CPU_PREFILL, ids=lambda c: "-".join(map(str, c)))
def test_prefill_interpreter(case, dtype):
    _run_prefill(*case, dtype=dtype, device="cpu")


def _lazy_rescale_case(threshold, dtype, device, causal):
    """configs.prefill_lazy_rescale: keys whose scale ramps up along the sequence, so a row's
    max grows past the threshold several times (rescaled tiles) and also by less (skipped
    ones), against the fp64 oracle and the plain bound; also varlen."""
    g = torch.Generator().manual_seed(21)
    B, Hq, Hkv, N, D = 1, 4, 2, 160, 64
    q = torch.randn(B, Hq, N, D, generator=g).to(device=device, dtype=dtype)
    ramp = torch.linspace(0.2, 3.0, N).view(1, 1, N, 1)
    k = (torch.randn(B, Hkv, N, D, generator=g) * ramp).to(device=device, dtype=dtype)
    v = torch.randn(B, Hkv, N, D, generator=g).to(device=device, dtype=dtype)
    scale = 1.0 / math.sqrt(D)
    with configs.overriding(prefill_lazy_rescale=threshold):
        out = mp.prefill_attention(q, k, v, causal=causal, scale=scale, backend="triton")
        qv, kv_, vv = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))
        cu = torch.tensor([0, 70, N], dtype=torch.int32, device=device)
        out_v = mp.prefill_attention_varlen(qv, kv_, vv, cu, cu, max_seqlen_q=90, max_seqlen_k=90, causal=causal,
                                            scale=scale, backend="triton")
    truth, truth_lse = prefill_ref(q, k, v, causal=causal, scale=scale)
    baseline, _ = prefill_ref(q, k, v, causal=causal, scale=scale, lowp=True)
    assert_close(out, truth, baseline, f"lazy rescale {threshold} causal={causal}", truth_lse=truth_lse)
    vt, _ = varlen_ref(qv, kv_, vv, cu, cu, causal=causal, scale=scale)
    vb, _ = varlen_ref(qv, kv_, vv, cu, cu, causal=causal, scale=scale, lowp=True)
    assert_close(out_v, vt, vb, f"lazy rescale {threshold} varlen causal={causal}")


@cpu_only
@pytest.mark.parametrize("threshold", [1, 8, 12])
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_lazy_rescale_interpreter(threshold, causal):
    _lazy_rescale_case(threshold, torch.float16, "cpu", causal)


def test_prefill_lazy_rescale_override_range():
    for bad in (-1, 13):
        with pytest.raises(ValueError, match="prefill_lazy_rescale"):
            configs.set_override("prefill_lazy_rescale", bad)
    assert configs.prefill_lazy_rescale() == configs.PREFILL_LAZY_RESCALE


@cpu_only
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_noncontiguous_interpreter(causal):
    _run_prefill(2, 4, 2, 23, 29, 64, causal, torch.float16, "cpu", noncontig=True)


@cpu_only
def test_head_dim_256_interpreter():
    """D=256 is beyond the public API's 64/128 but the kernels take it."""
    _run_prefill(1, 2, 1, 21, 21, 256, True, torch.float32, "cpu")


@cpu_only
def test_prefill_custom_scale_interpreter():
    _run_prefill(1, 2, 1, 19, 19, 64, True, torch.float32, "cpu", scale=0.37)


# ----------------------------------------------------------------- varlen


def _run_varlen(seqlens_q, seqlens_k, Hq, Hkv, D, causal, dtype, device, noncontig=False):
    case = VarlenCase(tuple(seqlens_q), tuple(seqlens_k), Hq, Hkv, D, causal)
    q, k, v, cu_q, cu_k = make_varlen_inputs(case, dtype, device, seed=sum(seqlens_q) * 31 + sum(seqlens_k))
    if noncontig:
        q, k, v = strided_copy(q), strided_copy(k), strided_copy(v)
    scale = 1.0 / math.sqrt(D)
    out = mp.prefill_attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=max(seqlens_q),
                                      max_seqlen_k=max(seqlens_k), causal=causal, scale=scale, backend="triton")
    assert out.shape == q.shape and out.dtype == dtype
    truth, truth_lse = varlen_ref(q, k, v, cu_q, cu_k, causal=causal, scale=scale)
    baseline, _ = varlen_ref(q, k, v, cu_q, cu_k, causal=causal, scale=scale, lowp=True)
    assert_close(out, truth, baseline, f"varlen q{seqlens_q} k{seqlens_k} c{causal}", truth_lse=truth_lse)
    return out


CPU_VARLEN = [
    # seqlens_q, seqlens_k, Hq, Hkv, D, causal
    ([17, 5, 33], [17, 20, 33], 4, 2, 64, True),
    ([17, 0, 9, 1], [17, 3, 30, 1], 4, 1, 64, True),     # an empty query sequence
    ([12, 7], [4, 0], 2, 1, 64, True),                    # Nq > Nk and Nk = 0
    ([23, 6], [11, 40], 8, 2, 128, False),
]


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", CPU_VARLEN, ids=lambda c: f"{c[0]}-{c[1]}-{c[5]}")
def test_varlen_interpreter(case, dtype):
    _run_varlen(*case, dtype=dtype, device="cpu")


@cpu_only
def test_varlen_noncontiguous_interpreter():
    _run_varlen([13, 21], [13, 30], 4, 2, 64, True, torch.float16, "cpu", noncontig=True)


@cpu_only
def test_varlen_matches_dense_interpreter():
    """Dense and varlen share one kernel body: one sequence must give the same bits."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, 29, 64).half()
    k = torch.randn(1, 2, 41, 64).half()
    v = torch.randn(1, 2, 41, 64).half()
    dense = mp.prefill_attention(q, k, v, scale=0.125, backend="triton")
    cu_q = torch.tensor([0, 29], dtype=torch.int32)
    cu_k = torch.tensor([0, 41], dtype=torch.int32)
    var = mp.prefill_attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                      cu_q, cu_k, scale=0.125, backend="triton")
    assert torch.equal(dense[0].transpose(0, 1), var)


# ----------------------------------------------------------------- paged decode


def _run_decode(context_lens, Hq, Hkv, D, page, dtype, device, noncontig=False, splits=None,
                worklist=None, return_lse=False):
    """The triton decode of a fresh batch checked against the fp64 oracle; splits / worklist
    force the split count (a work list's budget) and the work list (configs overrides)."""
    case = DecodeCase.of(context_lens, Hq, Hkv, D, page, spare_blocks=3)
    q, kc, vc, tables, ctx = make_decode_inputs(case, dtype, device, seed=sum(context_lens) + page)
    if noncontig:
        q, kc, vc = strided_copy(q), strided_copy(kc), strided_copy(vc)
    scale = 1.0 / math.sqrt(D)
    with configs.overriding(decode_splits=splits, decode_worklist=worklist):
        got = mp.decode_attention(q, kc, vc, tables, ctx, scale=scale, backend="triton", return_lse=return_lse)
    out, lse = got if return_lse else (got, None)
    assert out.shape == q.shape and out.dtype == dtype
    keys, vals = gather_kv(kc, vc, tables, ctx)
    truth, truth_lse = decode_ref(q, keys, vals, scale=scale)
    baseline, _ = decode_ref(q, keys, vals, scale=scale, lowp=True)
    # context_len 0: exact zeros (truth_lse is -inf there)
    assert_close(out, truth, baseline, f"decode ctx{context_lens[:6]} Hq{Hq} Hkv{Hkv} page{page}",
                 lse=lse, truth_lse=truth_lse)
    return out


CPU_DECODE = [
    # context_lens, Hq, Hkv, D, page
    ([17, 0, 97, 1], 4, 2, 64, 16),
    ([33, 16, 5], 8, 1, 64, 1),          # GQA 8, one token per page
    ([40, 100], 16, 1, 64, 4),           # GQA 16 (MQA)
    ([300, 7], 2, 2, 64, 256),           # page larger than the KV tile
    ([0, 0], 4, 4, 64, 16),              # nothing to read at all
    ([61, 130], 8, 2, 128, 32),          # GQA 4, D 128
]


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", CPU_DECODE, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[4]}")
def test_decode_interpreter(case, dtype):
    _run_decode(*case, dtype=dtype, device="cpu")


@cpu_only
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_decode_splits_interpreter(splits):
    _run_decode([97, 0, 33, 200], 4, 2, 64, 16, torch.float16, "cpu", splits=splits)


@cpu_only
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("case", CPU_DECODE, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[4]}")
def test_decode_table_ahead_same_bits_interpreter(case, splits):
    """configs.decode_table_ahead: the full tiles' block ids read a tile ahead and carried (pages
    smaller and larger than the key tile, empty splits, empty contexts, -1 table entries past
    each context). Same tiles, same order: the bits of the default path, and each checked
    against the fp64 oracle by _run_decode."""
    base = _run_decode(*case, torch.float16, "cpu", splits=splits)
    with configs.overriding(decode_table_ahead=1):
        ahead = _run_decode(*case, torch.float16, "cpu", splits=splits)
    assert torch.equal(base, ahead)


@cpu_only
def test_decode_head_dim_256_interpreter():
    _run_decode([19, 40], 4, 2, 256, 16, torch.float32, "cpu")


@cpu_only
def test_decode_noncontiguous_interpreter():
    _run_decode([29, 64], 4, 2, 64, 8, torch.float16, "cpu", noncontig=True)


# context_lens, Hq, Hkv, D, page, split budget S: one long sequence among short ones (first,
# last), empty contexts around it, equal lengths, pages smaller and larger than the key tile,
# a budget of one (every sequence in one slot: the kernel writes every output itself) and
# budgets larger than a sequence's tiles
CPU_WORKLIST = [
    ([2000] + [16] * 7, 4, 2, 64, 16, 8),
    ([17] * 5 + [1023], 8, 1, 64, 1, 6),
    ([0, 97, 0, 1, 300], 4, 2, 64, 16, 5),
    ([0, 0, 0], 4, 2, 64, 16, 3),
    ([64] * 4, 4, 4, 64, 16, 6),
    ([300, 7, 513], 2, 2, 64, 256, 7),
    ([40, 100, 33], 16, 1, 128, 4, 1),
    ([5, 1023], 4, 2, 64, 8, 64),
    ([700, 3, 0, 250], 4, 2, 64, 1, 40),
]


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", CPU_WORKLIST, ids=lambda c: f"{len(c[0])}x{max(c[0])}-{c[1]}-{c[2]}-p{c[4]}-S{c[5]}")
def test_decode_worklist_interpreter(case, dtype):
    """configs.decode_worklist: every program maps its slot to (sequence, split) from
    context_lens; output and lse against the fp64 oracle (NaN-poisoned unused cache slots)."""
    *problem, budget = case
    _run_decode(*problem, dtype, "cpu", splits=budget, worklist=1, return_lse=True)


@triton.jit
def _worklist_probe(context_lens, num_rows_of, n_out, ends_out, num_splits, BLOCK_B: tl.constexpr,
                    BLOCK_N: tl.constexpr, cu_seqlens_q=None, PACKED_Q: tl.constexpr = False):
    """Program b stores the work-list plan of batch b (row b of context_lens, num_rows_of[b] long;
    PACKED_Q: of cu_seqlens_q too, BLOCK_B + 1 per batch)."""
    b = tl.program_id(0)
    num_rows = tl.load(num_rows_of + b)
    if PACKED_Q:
        cu_seqlens_q += b * (BLOCK_B + 1)
    _, n, ends = _worklist_plan(context_lens + b * BLOCK_B, num_rows, num_splits, BLOCK_B, BLOCK_N, cu_seqlens_q,
                                PACKED_Q)
    offs = tl.arange(0, BLOCK_B)
    tl.store(n_out + b * BLOCK_B + offs, n)
    tl.store(ends_out + b * BLOCK_B + offs, ends)


def _worklist_counts(context_lens, budget, block_n):
    """The work list's slots per sequence, from decode.py's definition in exact fractions:
    max(1, ceil(ctx * S / total - 1/4)), at most the sequence's tiles."""
    total = sum(context_lens)
    counts = []
    for c in context_lens:
        want = math.ceil(Fraction(c * budget, total) - Fraction(1, 4)) if total else 0
        counts.append(max(1, min(want, -(-c // block_n))))
    return counts


@cpu_only
def test_decode_worklist_plan_interpreter():
    """decode._worklist_plan, the plan the kernel and its reduce derive on the device, against
    the definition over random batches (one long among short, spread, equal, empty): its slot
    counts and running ends, every batch within batch + S slots, no sequence beyond S splits,
    and equal lengths near the plain plan's round(S / B)."""
    import random

    rng = random.Random(5)
    block_b, block_n = 64, 32
    for budget in (1, 3, 66, 128):
        batches = [[1024] * 63 + [32768], [0] * 5, [7] * 64, [1] * 2, [2 ** 31 - 1, 1, 0]]
        for _ in range(60):
            b = rng.randint(2, block_b)
            kind = rng.choice(["spread", "one-long", "equal", "with-empty"])
            if kind == "spread":
                batches.append([rng.randint(1, 20000) for _ in range(b)])
            elif kind == "one-long":
                lens = [rng.randint(1, 2000) for _ in range(b)]
                lens[rng.randrange(b)] = rng.randint(20000, 200000)
                batches.append(lens)
            elif kind == "equal":
                batches.append([rng.randint(1, 9000)] * b)
            else:
                batches.append([rng.choice([0, rng.randint(1, 5000)]) for _ in range(b)])
        lens = torch.full((len(batches), block_b), -7, dtype=torch.int32)  # past num_rows: never read
        for i, batch in enumerate(batches):
            lens[i, :len(batch)] = torch.tensor(batch, dtype=torch.int32)
        rows = torch.tensor([len(batch) for batch in batches], dtype=torch.int32)
        n = torch.full_like(lens, -1)
        ends = torch.full_like(lens, -1)
        _worklist_probe[(len(batches),)](lens, rows, n, ends, budget, BLOCK_B=block_b, BLOCK_N=block_n)
        for i, batch in enumerate(batches):
            want = _worklist_counts(batch, budget, block_n)
            got = n[i, :len(batch)].tolist()
            assert got == want, (budget, batch[:8], got[:8], want[:8])
            assert n[i, len(batch):].eq(0).all()
            assert ends[i].tolist() == torch.cumsum(n[i], 0).tolist()
            assert sum(want) <= len(batch) + budget, (budget, batch[:8])
            assert max(want) <= max(budget, 1)
            if len(set(batch)) == 1 and batch[0] >= block_n * budget:
                assert abs(want[0] - max(1.0, budget / len(batch))) <= 0.75
    # a paged batch's decode rows (PACKED_Q): only the q_len 1 sequences take slots, planned as
    # a batch of those alone
    for budget in (1, 5, 66):
        q_lens = [[rng.choice([0, 1, 1, 1, 4, 300]) for _ in range(rng.randint(2, block_b))] for _ in range(40)]
        batches = [[rng.choice([0, rng.randint(1, 30000)]) for _ in ql] for ql in q_lens]
        lens = torch.full((len(batches), block_b), -7, dtype=torch.int32)
        cu = torch.full((len(batches), block_b + 1), -7, dtype=torch.int32)
        for i, (ql, batch) in enumerate(zip(q_lens, batches)):
            lens[i, :len(batch)] = torch.tensor(batch, dtype=torch.int32)
            cu[i, :len(ql) + 1] = torch.tensor([0, *itertools.accumulate(ql)], dtype=torch.int32)
        rows = torch.tensor([len(batch) for batch in batches], dtype=torch.int32)
        n = torch.full_like(lens, -1)
        ends = torch.full_like(lens, -1)
        _worklist_probe[(len(batches),)](lens, rows, n, ends, budget, BLOCK_B=block_b, BLOCK_N=block_n,
                                         cu_seqlens_q=cu, PACKED_Q=True)
        for i, (ql, batch) in enumerate(zip(q_lens, batches)):
            decodes = [c for q, c in zip(ql, batch) if q == 1]
            want = iter(_worklist_counts(decodes, budget, block_n))
            assert n[i, :len(batch)].tolist() == [next(want) if q == 1 else 0 for q in ql], (budget, ql[:8])
            assert ends[i].tolist() == torch.cumsum(n[i], 0).tolist()
    # one 32k sequence among 63 of 1k (the bench's one-long row) with an H200's budget of 66
    # slots per KV head: 22 splits for the long one, one for each short one
    assert _worklist_counts([1024] * 63 + [32768], 66, 32) == [1] * 63 + [22]


def test_decode_worklist_selection(monkeypatch):
    """configs.decode_worklist: by default only where the plain plan can leave one program more
    than WORKLIST_MIN_SPAN keys of the table (the standard grid's two uneven batches of 64, not
    its rows of equal lengths); forced on, only for 2..MAX_WORKLIST_BATCH sequences (one has
    nothing to balance, the plan's lanes are bounded); forced off, never."""
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)  # an H200's plain plan
    cpu = torch.device("cpu")

    def takes(batch, capacity, num_kv_heads=8, block_n=64):
        return configs.decode_worklist(batch, num_kv_heads, capacity, block_n, cpu)

    # the standard decode grid (bench cases): equal lengths keep the plain plan...
    assert not any(takes(b, cap) for b, cap in [(1, 4096), (1, 32768), (8, 4096), (32, 4096), (64, 8192),
                                                (256, 1024)])
    # ...the uneven batches of 64 (one 32k among 1k ones; 512..16384, table 16368 wide) take it
    assert takes(64, 32768) and takes(64, 16368)
    # small batches split a wide table by themselves (B=8: 8 splits of 4k)
    assert not takes(8, 32768)
    assert takes(32, 32768) and not takes(32, 16384)
    assert not takes(configs.MAX_WORKLIST_BATCH + 1, 1 << 20)
    # the split counts: a batch of one's budget under the work list, else the batch's own
    assert configs.decode_split_plan(64, 8, 32768, 64, cpu) == (True, configs.decode_num_splits(1, 8, 32768, 64, cpu))
    assert configs.decode_split_plan(64, 8, 8192, 64, cpu) == (False, configs.decode_num_splits(64, 8, 8192, 64, cpu))
    assert configs.decode_split_plan(1, 8, 32768, 64, cpu) == (False, configs.decode_num_splits(1, 8, 32768, 64, cpu))
    with configs.overriding(decode_worklist=1):
        assert [takes(b, 64) for b in (1, 2, configs.MAX_WORKLIST_BATCH,
                                       configs.MAX_WORKLIST_BATCH + 1)] == [False, True, True, False]
    with configs.overriding(decode_worklist=0):
        assert not takes(64, 32768)


def test_num_splits_heuristic_no_sync(monkeypatch):
    """The split count depends on shapes only (so decode can be graph-captured)."""
    from minipaged.triton.configs import MAX_SPLITS, decode_num_splits

    monkeypatch.setattr(configs, "sm_count", lambda device: 132)  # an H200
    dev = torch.device("cpu")
    assert decode_num_splits(1, 8, 32768, 64, dev) > 1
    assert decode_num_splits(1, 1, 16, 64, dev) == 1         # too short to split
    assert decode_num_splits(4096, 8, 32768, 64, dev) == 1   # the batch fills the machine
    assert all(1 <= decode_num_splits(b, h, n, 64, dev) <= MAX_SPLITS
               for b in (1, 3, 64) for h in (1, 8) for n in (0, 1, 1000, 10 ** 6))


# ----------------------------------------------------------------- write_kv_cache


def _run_write(T, Hkv, D, page, num_blocks, dtype, device, noncontig=False):
    k, v, kc, vc, slots, want_k, want_v = make_write_inputs(T, Hkv, D, num_blocks, page, dtype, device,
                                                            seed=T * 13 + page, any_negative=False)
    if noncontig:
        k, v = strided_copy(k), strided_copy(v)
    mp.write_kv_cache(k, v, kc, vc, slots, backend="triton")
    assert_same_cache(kc, want_k, "k_cache")
    assert_same_cache(vc, want_v, "v_cache")


@cpu_only
@pytest.mark.parametrize("page", [1, 16, 256])
def test_write_kv_cache_interpreter(page):
    _run_write(37, 3, 64, page, num_blocks=max(4, 80 // page + 2), dtype=torch.float16, device="cpu")


@cpu_only
def test_write_kv_cache_noncontiguous_interpreter():
    _run_write(19, 2, 128, 16, num_blocks=4, dtype=torch.float32, device="cpu", noncontig=True)


# ----------------------------------------------------------------- GPU

GPU_DTYPES = [torch.bfloat16, torch.float16]

GPU_PREFILL = [
    (1, 16, 8, 1024, 1024, 128, True),
    (2, 16, 8, 4096, 4096, 128, True),
    (1, 8, 1, 1023, 2047, 64, True),     # MQA, chunked prefill after a prefix
    (2, 32, 8, 97, 1500, 128, False),
    (1, 4, 2, 1500, 97, 128, True),      # most rows see nothing
    (3, 16, 4, 777, 777, 64, True),
    (1, 16, 16, 2049, 2049, 128, False),
    (1, 8, 2, 17, 0, 128, True),
]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", GPU_PREFILL, ids=lambda c: "-".join(map(str, c)))
def test_prefill_gpu(case, dtype):
    _run_prefill(*case, dtype=dtype, device="cuda")


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32])
@pytest.mark.parametrize("case", [(1, 4, 2, 300, 300, 128, True), (1, 4, 1, 130, 257, 64, False)])
def test_prefill_gpu_fp32(case, dtype):
    _run_prefill(*case, dtype=dtype, device="cuda")


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_lazy_rescale_gpu(dtype, causal):
    _lazy_rescale_case(8, dtype, "cuda", causal)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_prefill_noncontiguous_gpu(dtype):
    _run_prefill(2, 16, 8, 1000, 1200, 128, True, dtype, "cuda", noncontig=True)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_gpu(dtype, causal):
    _run_varlen([1000, 1, 0, 2500, 77, 4000], [1000, 513, 9, 2500, 1200, 4000], 16, 8, 128, causal,
                dtype, "cuda")
    _run_varlen([300, 2], [0, 7], 8, 1, 64, causal, dtype, "cuda", noncontig=True)


GPU_DECODE = [
    # context_lens, Hq, Hkv, D, page
    ([1, 4000, 0, 1500, 2048, 17, 3333, 1024], 16, 8, 128, 16),
    ([1200, 4097, 0, 31], 32, 8, 128, 1),
    ([5000, 300], 16, 1, 128, 256),
    ([2000, 999, 4096], 8, 8, 64, 256),
    ([3000, 1, 2222], 16, 2, 64, 32),
    ([32768], 16, 8, 128, 16),
    # 8 sequences x 8 KV heads: sm_90's 32-key tile (configs.decode_config), ragged, empty, page 1
    ([0, 1, 17, 97, 1023, 4097, 31, 2048], 16, 8, 128, 16),
    ([1023, 0, 33, 4097, 5, 64, 65, 300], 16, 8, 128, 1),
]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", GPU_DECODE, ids=lambda c: f"{len(c[0])}x{max(c[0])}-{c[1]}-{c[2]}-{c[3]}-{c[4]}")
def test_decode_gpu(case, dtype):
    _run_decode(*case, dtype=dtype, device="cuda")


@gpu
@needs_cuda
def test_decode_gpu_batch_fills_machine():
    # B * Hkv large enough that the heuristic uses one split (the direct-output path)
    lens = torch.randint(0, 1500, (128,), generator=torch.Generator().manual_seed(3)).tolist()
    _run_decode(lens, 16, 8, 128, 16, torch.bfloat16, "cuda")


@gpu
@needs_cuda
@pytest.mark.parametrize("splits", [1, 7, 64])
def test_decode_gpu_forced_splits(splits):
    _run_decode([2500, 0, 900, 17], 16, 4, 128, 16, torch.float16, "cuda", splits=splits)


# uneven batches as a server sees them: one long sequence among short ones (the bench's
# one-long row, and at B=256), lengths spread over 512-16384, ragged lengths with empty
# contexts at page 1, and D 64
GPU_WORKLIST = [
    ([1024] * 63 + [32768], 16, 8, 128, 16),
    ([int(x) for x in torch.randint(512, 16385, (64,), generator=torch.Generator().manual_seed(0))], 16, 8, 128, 16),
    ([1000] * 200 + [0] * 55 + [20000], 16, 8, 128, 16),
    ([0, 1, 17, 97, 1023, 4097, 31, 20480], 16, 8, 128, 1),
    ([3000, 1, 2222, 0, 65], 16, 2, 64, 32),
]


@gpu
@needs_cuda
@pytest.mark.parametrize("budget", [None, 128], ids=["default", "S128"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", GPU_WORKLIST, ids=lambda c: f"{len(c[0])}x{max(c[0])}-{c[2]}-{c[3]}-{c[4]}")
def test_decode_worklist_gpu(case, dtype, budget):
    """configs.decode_worklist on uneven batches, output and lse against the fp64 oracle."""
    _run_decode(*case, dtype, "cuda", splits=budget, worklist=1, return_lse=True)


@gpu
@needs_cuda
def test_decode_worklist_gpu_largest_batch():
    """The largest batch a work list takes (configs.MAX_WORKLIST_BATCH: a 1024-lane plan), one
    40k sequence among short ones."""
    lens = torch.randint(0, 2001, (configs.MAX_WORKLIST_BATCH - 1,), generator=torch.Generator().manual_seed(1))
    _run_decode(lens.tolist() + [40000], 16, 8, 128, 16, torch.bfloat16, "cuda", worklist=1, return_lse=True)


@gpu
@needs_cuda
def test_decode_gpu_fp32_noncontiguous():
    _run_decode([700, 1300], 8, 2, 128, 16, torch.float32, "cuda", noncontig=True)


@gpu
@needs_cuda
@pytest.mark.parametrize("worklist", [None, 1], ids=["plain", "worklist"])
def test_decode_cuda_graph_capture(worklist):
    """Decode issues no host sync, so it can be captured and replayed; the replay follows new
    context lengths written into the captured tensor (the work list re-plans on the device)."""
    q, kc, vc, tables, ctx = make_decode_inputs(DecodeCase.of([1000, 37, 2000], 16, 8, 128, 16),
                                                torch.bfloat16, "cuda")
    def run():
        # check_values=False: the value checks sync with the host, which capture forbids
        return mp.decode_attention(q, kc, vc, tables, ctx, scale=0.088, backend="triton", check_values=False)

    with configs.overriding(decode_worklist=worklist):
        eager = run()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()  # warm-up compiles outside capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
        # shorter lengths, so every sequence stays within its table row's blocks
        ctx.copy_(torch.tensor([999, 20, 1500], dtype=ctx.dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, run())


@gpu
@needs_cuda
@pytest.mark.parametrize("page", [1, 16, 256])
def test_write_kv_cache_gpu(page):
    _run_write(3000, 8, 128, page, num_blocks=4000 // page + 4, dtype=torch.bfloat16, device="cuda")
    _run_write(500, 2, 64, page, num_blocks=600 // page + 4, dtype=torch.float16, device="cuda",
               noncontig=True)
