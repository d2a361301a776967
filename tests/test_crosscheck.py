"""Every available backend against the fp64 oracle, on hypothesis-drawn cases.

CPU (CI): the torch backend, plus Triton when TRITON_INTERPRET=1 (fp16/fp32
only: the interpreter's bf16 tl.dot is wrong). GPU (`-m gpu`, ideally with
HYPOTHESIS_PROFILE=gpu): torch, triton, cuda and cuda-wmma in fp16/bf16 at
larger sizes, NaN-poisoned caches, page sizes 1..256 and contexts past 1k.
As soon as a backend exists and is available, it is cross-checked here.

Hypothesis rarely draws the one residue that breaks a tile boundary, so every
test also runs explicit examples of the edges (_EXAMPLES): causal cases with
(Nk - Nq) mod BLOCK_N == 1 and == BLOCK_N - 1 where the diagonal band of a
non-last query tile ends one key into a new tile (BLOCK_N 16 under the
interpreter; 16, 32, 64 and 128 on the GPU), Nq > Nk, empty sequences, and
decode contexts one past a page or a KV tile.
"""

import contextlib
import os

import pytest
import torch
from hypothesis import example, given

import minipaged as mp
from minipaged import registry
from minipaged.testing import (
    DecodeCase,
    PagedCase,
    PrefillCase,
    VarlenCase,
    assert_close,
    decode_ref,
    gather_kv,
    make_decode_inputs,
    make_paged_inputs,
    make_prefill_inputs,
    make_varlen_inputs,
    paged_ref,
    prefill_ref,
    randn,
    slot_mapping,
    varlen_ref,
)
from strategies import decode_cases, paged_cases, prefill_cases, varlen_cases


def _backends(device: str, op: str):
    out = []
    for name, b in registry.all_backends().items():
        if op in b.provides and b.is_available(device)[0]:
            out.append(name)
    return out


def _params(device: str, op: str):
    marks = [pytest.mark.gpu] if device == "cuda" else []
    dtypes = [torch.float16, torch.bfloat16] if device == "cuda" else [torch.float32, torch.float16, torch.bfloat16]
    params = []
    for name in _backends(device, op):
        b = registry.all_backends()[name]
        for dt in dtypes:
            if str(dt).replace("torch.", "") not in b.dtypes:
                continue
            if device == "cpu" and name == "triton" and dt == torch.bfloat16:
                continue  # interpreter bf16 dot is wrong; bf16 Triton is checked on the GPU
            params.append(pytest.param(name, dt, id=f"{name}-{str(dt)[6:]}", marks=marks))
    return params or [pytest.param(None, None, marks=[*marks, pytest.mark.skip(reason=f"no backend for {op} on {device}")])]


_GPU = torch.cuda.is_available()
_SIZES = dict(
    prefill=dict(max_len=1100, max_batch=3, max_kv_heads=4) if _GPU else dict(max_len=80, max_batch=2, max_kv_heads=2),
    varlen=dict(max_len=700, max_seqs=5, max_kv_heads=4) if _GPU else dict(max_len=50, max_seqs=3, max_kv_heads=2),
    decode=dict(max_ctx=2100, max_batch=8, max_kv_heads=4) if _GPU else dict(max_ctx=120, max_batch=4, max_kv_heads=2),
    paged=dict(max_ctx=3000, max_chunk=600, max_seqs=8, max_kv_heads=4, tile=64) if _GPU
    else dict(max_ctx=100, max_chunk=40, max_seqs=4, max_kv_heads=2, tile=16),
)


def _head_dims(backend):
    return tuple(d for d in (64, 128) if d in registry.all_backends()[backend].head_dims)


def _run_prefill(backend, dtype, device, case):
    q, k, v = make_prefill_inputs(case, dtype, device, seed=hash(case) % 1000)
    out = mp.prefill_attention(q, k, v, causal=case.causal, backend=backend)
    assert out.dtype == dtype
    ref, ref_lse = prefill_ref(q, k, v, causal=case.causal)
    base, _ = prefill_ref(q, k, v, causal=case.causal, lowp=True)
    assert_close(out, ref, base, f"{backend} {case}", truth_lse=ref_lse)


def _run_varlen(backend, dtype, device, case):
    q, k, v, cu_q, cu_k = make_varlen_inputs(case, dtype, device, seed=hash(case) % 1000)
    out = mp.prefill_attention_varlen(q, k, v, cu_q, cu_k, causal=case.causal, backend=backend)
    assert out.dtype == dtype
    ref, ref_lse = varlen_ref(q, k, v, cu_q, cu_k, causal=case.causal)
    base, _ = varlen_ref(q, k, v, cu_q, cu_k, causal=case.causal, lowp=True)
    cq = cu_q.tolist()
    for s in range(case.batch):
        sl = slice(cq[s], cq[s + 1])
        assert_close(out[sl], ref[sl], base[sl], f"{backend} seq {s} of {case}", truth_lse=ref_lse[sl])


def _run_decode(backend, dtype, device, case):
    q, kc, vc, tables, lens = make_decode_inputs(case, dtype, device, seed=hash(case) % 1000, poison=True)
    keys, vals = gather_kv(kc, vc, tables, lens)
    ref, ref_lse = decode_ref(q, keys, vals)
    base, _ = decode_ref(q, keys, vals, lowp=True)
    for plan, scope in _decode_plans(backend):
        with scope:
            out = mp.decode_attention(q, kc, vc, tables, lens, backend=backend)
        assert out.dtype == dtype
        for b in range(case.batch):
            assert_close(out[b], ref[b], base[b], f"{backend} ({plan}) seq {b} of {case}", truth_lse=ref_lse[b])


def _decode_plans(backend):
    """(name, context) of each plan to check a backend's decode under: its default, and for
    triton also the work-list plan, forced (by default it takes only wide tables at large batch:
    configs.decode_worklist)."""
    plans = [("default plan", contextlib.nullcontext())]
    if backend == "triton":
        from minipaged.triton import configs

        plans.append(("work list", configs.overriding(decode_worklist=1)))
    return plans


def _run_write(backend, dtype, device, case):
    q, kc, vc, tables, lens = make_decode_inputs(case, dtype, device, seed=1, poison=False)
    T = case.tokens
    gen = torch.Generator().manual_seed(2)
    k = randn((T, case.num_kv_heads, case.head_dim), dtype, device, gen)
    v = randn((T, case.num_kv_heads, case.head_dim), dtype, device, gen)
    # every token's slot under the table, with every third token skipped (-1)
    slot = slot_mapping(tables, lens, case.block_size).to(device)
    slot[::3] = -1
    want_k, want_v = kc.clone(), vc.clone()
    mp.write_kv_cache(k, v, want_k, want_v, slot, backend="torch")
    mp.write_kv_cache(k, v, kc, vc, slot.to(torch.int32), backend=backend)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v), f"{backend}: caches differ from torch's write"


def _run_paged(backend, dtype, device, case):
    q, kc, vc, tables, cu_q, lens = make_paged_inputs(case, dtype, device, seed=hash(case) % 1000, poison=True)
    keys, vals = gather_kv(kc, vc, tables, lens)
    ref, ref_lse = paged_ref(q, keys, vals, cu_q, causal=case.causal)
    base, _ = paged_ref(q, keys, vals, cu_q, causal=case.causal, lowp=True)
    cq = cu_q.tolist()
    # (a batch's decode rows may run the decode kernel: its plans too)
    for plan, scope in _decode_plans(backend):
        with scope:
            out, lse = mp.paged_attention(q, kc, vc, tables, cu_q, lens, causal=case.causal, return_lse=True,
                                          backend=backend)
        assert out.dtype == dtype and lse.dtype == torch.float32
        for s in range(case.batch):
            sl = slice(cq[s], cq[s + 1])
            assert_close(out[sl], ref[sl], base[sl], f"{backend} ({plan}) seq {s} of {case}", lse=lse[sl],
                         truth_lse=ref_lse[sl])


_RUNNERS = {"prefill": _run_prefill, "prefill_varlen": _run_varlen, "decode": _run_decode, "write_kv_cache": _run_write,
            "paged": _run_paged}


# Every backend here takes head dims 64 and 128 (the strategies draw no others).
assert all(set(_head_dims(b)) == {64, 128} for b in registry.all_backends())
_STRATEGIES = {
    "prefill": prefill_cases(**_SIZES["prefill"]),
    "prefill_varlen": varlen_cases(**_SIZES["varlen"]),
    "decode": decode_cases(**_SIZES["decode"]),
    "write_kv_cache": decode_cases(max_ctx=200, max_batch=4),
    "paged": paged_cases(**_SIZES["paged"]),
}

P, V = PrefillCase, VarlenCase


def Dc(lens, hkv, group, head_dim, block_size, spare_blocks):  # noqa: N802 - reads like the other two
    return DecodeCase.of(lens, hkv * group, hkv, head_dim, block_size, spare_blocks)


_EXAMPLES = {
    # (batch, Nq, Nk, Hq, Hkv, D, causal): Nq > 2 tiles so a band ends before Nk
    ("prefill", "cpu"): [P(1, 33, 34, 2, 1, 64, True), P(1, 47, 64, 2, 1, 64, True),
                         P(1, 40, 55, 2, 1, 64, True), P(1, 50, 20, 1, 1, 64, True)],
    ("prefill", "cuda"): [P(1, 300, 301, 4, 2, 128, True), P(1, 257, 322, 4, 2, 64, True),
                          P(2, 385, 514, 32, 4, 128, True), P(1, 1023, 1024, 4, 1, 128, True),
                          P(1, 300, 427, 4, 2, 64, True), P(1, 1023, 97, 4, 2, 128, True)],
    # (seqlens_q, seqlens_k, Hq, Hkv, D, causal)
    ("prefill_varlen", "cpu"): [V((33, 40, 20, 0), (34, 57, 5, 3), 2, 1, 64, True),
                                V((35, 7), (50, 0), 2, 1, 64, True)],
    ("prefill_varlen", "cuda"): [V((300, 257, 385, 129, 50), (301, 322, 514, 256, 20), 4, 2, 128, True),
                                 V((200, 0, 600), (231, 9, 663), 8, 2, 64, True)],
    # (context_lens, Hkv, group, D, block_size, spare_blocks)
    ("decode", "cpu"): [Dc((17, 0, 97, 1), 1, 2, 64, 1, 2), Dc((33, 257, 16), 2, 2, 64, 256, 1),
                        Dc((65, 0), 1, 8, 128, 16, 3)],
    ("decode", "cuda"): [Dc((1023, 0, 1, 257, 2049), 2, 2, 128, 1, 2), Dc((129, 4097), 1, 8, 64, 256, 1),
                         Dc((17, 97, 1025), 4, 4, 128, 16, 3)],
    ("write_kv_cache", "cpu"): [Dc((17, 0, 97), 2, 1, 64, 1, 2), Dc((33,), 1, 2, 128, 256, 1)],
    ("write_kv_cache", "cuda"): [Dc((17, 0, 97), 2, 1, 64, 1, 2), Dc((199, 1), 4, 2, 128, 256, 1)],
    # (kind, q_lens, context_lens, Hq, Hkv, D, block_size, causal): every kind in one batch, a chunk
    # whose band ends one key into a new tile, q_len > context, a context one past a page
    ("paged", "cpu"): [PagedCase("mixed", (0, 1, 4, 33, 5), (9, 17, 20, 50, 3), 2, 1, 64, 4, True),
                       PagedCase("mixed", (40, 1), (57, 1), 4, 2, 64, 16, True, 2),
                       PagedCase("mixed", (3, 19), (3, 0), 2, 2, 64, 1, False)],
    ("paged", "cuda"): [PagedCase("mixed", (0, 1, 4, 300, 8), (17, 2049, 4097, 1025, 8), 8, 2, 128, 16, True),
                        PagedCase("mixed", (257, 1), (322, 1), 4, 1, 64, 256, True, 2),
                        PagedCase("mixed", (129, 2, 1), (129, 2, 3000), 16, 8, 128, 1, False)],
}


def _make_test(op: str, device: str):
    def body(backend, dtype, case):
        if os.environ.get("MINIPAGED_LOG_EXAMPLES"):
            # each drawn case before it runs: a case that hangs the GPU is the last one printed
            print(f"\n[{op} {backend} {dtype}] {case}", flush=True)
        _RUNNERS[op](backend, dtype, device, case)

    test = given(case=_STRATEGIES[op])(body)
    for ex in _EXAMPLES.get((op, device), []):
        test = example(case=ex)(test)
    test = pytest.mark.parametrize("backend,dtype", _params(device, op))(test)
    test.__name__ = f"test_{op}_{device}"
    return test


for _op in _RUNNERS:
    for _dev in ("cpu", "cuda"):
        globals()[f"test_{_op}_{_dev}"] = _make_test(_op, _dev)
