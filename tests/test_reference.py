"""The torch backend (the library's oracle) against the independent fp64 oracle of minipaged.testing.

The torch backend is what other backends are often compared with, so it is
itself judged only by code that shares nothing with minipaged.reference: the
fp64 truth and the low-precision baseline both come from minipaged.testing.
"""

import math

import pytest
import torch
from hypothesis import given

import minipaged as mp
from minipaged.testing import (
    DecodeCase,
    PrefillCase,
    assert_close,
    decode_ref,
    gather_kv,
    make_decode_inputs,
    make_prefill_inputs,
    make_varlen_inputs,
    prefill_ref,
    slot_mapping,
    varlen_ref,
)
from strategies import decode_cases, prefill_cases, varlen_cases

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def attention_fp64(q, k, v, causal, scale=None):
    return prefill_ref(q, k, v, causal=causal, scale=scale)[0]


def _check_prefill(case, dtype, seed=0):
    q, k, v = make_prefill_inputs(case, dtype, "cpu", seed)
    out = mp.prefill_attention(q, k, v, causal=case.causal, backend="torch")
    assert out.dtype == dtype and out.shape == q.shape
    ref, ref_lse = prefill_ref(q, k, v, causal=case.causal)
    base, _ = prefill_ref(q, k, v, causal=case.causal, lowp=True)
    assert_close(out, ref, base, f"{case} {dtype}", truth_lse=ref_lse)


@pytest.mark.parametrize("dtype", DTYPES)
@given(case=prefill_cases())
def test_prefill_matches_fp64(dtype, case):
    _check_prefill(case, dtype)


def test_fp32_is_tight():
    # fp32 end to end: the oracle must be within fp32 rounding, not just the loose bound.
    case = PrefillCase(2, 97, 131, 8, 2, 128, True)
    q, k, v = make_prefill_inputs(case, torch.float32, "cpu", 1)
    out = mp.prefill_attention(q, k, v, backend="torch")
    ref = attention_fp64(q, k, v, True)
    assert (out.double() - ref).abs().max().item() < 1e-5


def test_rows_without_keys_are_exact_zeros():
    q = torch.randn(1, 4, 9, 64)
    k = torch.randn(1, 2, 3, 64)
    v = torch.randn(1, 2, 3, 64)
    out = mp.prefill_attention(q, k, v, backend="torch")
    # Nq=9 > Nk=3: rows 0..5 see j < 3 - 9 + i + 1 <= 0 keys
    assert torch.equal(out[:, :, :6], torch.zeros_like(out[:, :, :6]))
    assert (out[:, :, 6:].abs().sum(-1) > 0).all()
    assert not torch.isnan(out).any()


def test_empty_key_sequence_gives_zeros():
    q = torch.randn(1, 2, 5, 64)
    k = torch.randn(1, 2, 0, 64)
    out = mp.prefill_attention(q, k, k.clone(), backend="torch")
    assert torch.equal(out, torch.zeros_like(q))


def test_bottom_right_causal_single_query_is_full_attention():
    # Nq == 1 is decode: the one row sees every key.
    q, k, v = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 33, 64), torch.randn(1, 2, 33, 64)
    a = mp.prefill_attention(q, k, v, causal=True, backend="torch")
    b = mp.prefill_attention(q, k, v, causal=False, backend="torch")
    torch.testing.assert_close(a, b)


def test_scale_is_used():
    q, k, v = torch.randn(1, 2, 7, 64), torch.randn(1, 2, 7, 64), torch.randn(1, 2, 7, 64)
    out = mp.prefill_attention(q, k, v, scale=0.3, backend="torch")
    ref = attention_fp64(q, k, v, True, scale=0.3)
    assert (out.double() - ref).abs().max() < 1e-5
    default = mp.prefill_attention(q, k, v, backend="torch")
    assert (default.double() - attention_fp64(q, k, v, True, scale=1 / math.sqrt(64))).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@given(case=varlen_cases())
def test_varlen_matches_dense_fp64(dtype, case):
    q, k, v, cu_q, cu_k = make_varlen_inputs(case, dtype, "cpu")
    out = mp.prefill_attention_varlen(q, k, v, cu_q, cu_k, causal=case.causal, backend="torch")
    assert out.shape == q.shape and out.dtype == dtype
    ref, ref_lse = varlen_ref(q, k, v, cu_q, cu_k, causal=case.causal)
    base, _ = varlen_ref(q, k, v, cu_q, cu_k, causal=case.causal, lowp=True)
    # per sequence, so a failure names the one that broke
    cq = cu_q.tolist()
    for s in range(case.batch):
        sl = slice(cq[s], cq[s + 1])
        assert_close(out[sl], ref[sl], base[sl], f"seq {s} of {case}", truth_lse=ref_lse[sl])


@pytest.mark.parametrize("dtype", DTYPES)
@given(case=decode_cases())
def test_decode_matches_fp64(dtype, case):
    q, kc, vc, tables, lens = make_decode_inputs(case, dtype, "cpu")
    out, lse = mp.decode_attention(q, kc, vc, tables, lens, return_lse=True, backend="torch")
    assert out.shape == q.shape and out.dtype == dtype
    keys, vals = gather_kv(kc, vc, tables, lens)
    ref, ref_lse = decode_ref(q, keys, vals)
    base, _ = decode_ref(q, keys, vals, lowp=True)
    for b in range(case.batch):
        assert_close(out[b], ref[b], base[b], f"seq {b} of {case}", lse=lse[b], truth_lse=ref_lse[b])


@pytest.mark.parametrize("budget", [1, 3 * 64 * 2 * 32, 64 * 2 * 32 * 20])
def test_decode_in_runs_of_sequences(monkeypatch, budget):
    # A batch whose one padded gather would pass the budget runs in runs of whole sequences:
    # budget 1 gives each sequence its own run, the others split the batch where its long
    # sequences fall. Same values as one gather, and each sequence against fp64.
    from minipaged import reference

    case = DecodeCase(9, 0, 4, 2, 32, block_size=4, context_lens=(5, 0, 130, 1, 17, 0, 64, 97, 3))
    q, kc, vc, tables, lens = make_decode_inputs(case, torch.float32, "cpu", seed=5)
    whole, whole_lse = reference.decode(q, kc, vc, tables, lens, 0.2, return_lse=True)
    monkeypatch.setattr(reference, "_DECODE_GATHER_ELEMENTS", budget)
    out, lse = reference.decode(q, kc, vc, tables, lens, 0.2, return_lse=True)
    torch.testing.assert_close(out, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-6, atol=1e-6)
    keys, vals = gather_kv(kc, vc, tables, lens)
    ref, ref_lse = decode_ref(q, keys, vals, scale=0.2)
    base, _ = decode_ref(q, keys, vals, lowp=True, scale=0.2)
    for b in range(case.batch):
        assert_close(out[b], ref[b], base[b], f"seq {b}, budget {budget}", lse=lse[b], truth_lse=ref_lse[b])


@given(case=decode_cases(max_ctx=64))
def test_write_then_decode_roundtrip(case):
    """write_kv_cache into a NaN pool at the slots a block table implies, then
    decode reads exactly those tokens back."""
    q, kc, vc, tables, lens = make_decode_inputs(case, torch.float32, "cpu")
    dense_k, dense_v = gather_kv(kc, vc, tables, lens)
    k_new, v_new = torch.cat(dense_k), torch.cat(dense_v)
    slot = slot_mapping(tables, lens, case.block_size)
    # a skipped token (negative slot) must not be written anywhere
    marker = torch.full((1, case.num_kv_heads, case.head_dim), 7.0)
    k_new = torch.cat([k_new, marker])
    v_new = torch.cat([v_new, marker])
    slot = torch.cat([slot, torch.tensor([-1])])
    k2 = torch.full_like(kc, float("nan"))
    v2 = torch.full_like(vc, float("nan"))
    mp.write_kv_cache(k_new, v_new, k2, v2, slot, backend="torch")
    assert not (k2 == 7.0).any()
    out_a = mp.decode_attention(q, kc, vc, tables, lens, backend="torch")
    out_b = mp.decode_attention(q, k2, v2, tables, lens, backend="torch")
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=0)


def test_non_contiguous_inputs():
    base = torch.randn(2, 40, 4, 64)  # [B, N, H, D] viewed as [B, H, N, D]
    q = base.transpose(1, 2)
    k = torch.randn(2, 40, 2, 64).transpose(1, 2)
    v = torch.randn(2, 2, 64, 40).transpose(-1, -2)  # last dim not stride 1
    out = mp.prefill_attention(q, k, v, backend="torch")
    ref = attention_fp64(q, k, v, True)
    assert (out.double() - ref).abs().max() < 1e-5
