"""mp.paged_attention, return_lse and mp.merge_attention_states through the public API.

Every backend that can run here is judged against the fp64 oracle of
minipaged.testing (per sequence, its own mask, fed the K/V that were written,
not read back from the cache), not against reference.py. Unused cache slots are
NaN and table entries past the used ones are -1, so a kernel that reads what it
must not read fails.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import minipaged as mp
from minipaged import registry
from minipaged.testing import assert_close, cu_seqlens, paged_kv, paged_ref, randn

NAN = float("nan")


def _backends(device="cpu"):
    out = []
    for name in ("torch", "triton", "cuda", "cuda-wmma"):
        if registry.all_backends()[name].is_available(device)[0]:
            out.append(name)
    return out


CPU_BACKENDS = _backends("cpu")


# ------------------------------------------------------------------ problem and oracle


def make_paged(q_lens, ctx_lens, *, Hq=4, Hkv=2, D=64, block_size=4, dtype=torch.float32, device="cpu", seed=0,
               spare_blocks=3):
    """A paged batch with pages scattered at random, every unused slot NaN, -1 past the used entries."""
    g = torch.Generator().manual_seed(seed)
    kv = paged_kv(ctx_lens, Hkv, D, block_size, dtype, device, gen=g, spare_blocks=spare_blocks)
    q = randn((sum(q_lens), Hq, D), dtype, device, g)
    return dict(q=q, k_cache=kv.k_cache, v_cache=kv.v_cache, block_tables=kv.block_tables,
                cu_seqlens_q=cu_seqlens(q_lens, device), context_lens=kv.context_lens, keys=kv.keys, vals=kv.vals)


def oracle(p, *, causal=True, scale=None, lowp=False):
    """fp64 (o [Tq, Hq, D], lse [Tq, Hq]) from the K/V that were written (not the cache)."""
    return paged_ref(p["q"], p["keys"], p["vals"], p["cu_seqlens_q"], causal=causal, scale=scale, lowp=lowp)


def check_against_oracle(p, o, lse=None, *, causal=True, what=""):
    truth, truth_lse = oracle(p, causal=causal)
    assert o.dtype == p["q"].dtype and o.shape == p["q"].shape, what
    assert_close(o, truth, oracle(p, causal=causal, lowp=True)[0], what, lse=lse, truth_lse=truth_lse)


def _args(p, **kw):
    return dict(q=p["q"], k_cache=p["k_cache"], v_cache=p["v_cache"], block_tables=p["block_tables"],
                cu_seqlens_q=p["cu_seqlens_q"], context_lens=p["context_lens"], **kw)


# ------------------------------------------------------------------ semantics

MIXES = [
    # (q_lens, ctx_lens): decode rows, speculative runs, long chunks, empty and no-key rows
    ([1, 1, 1], [1, 7, 16]),
    ([4, 2, 8], [4, 19, 33]),
    ([0, 17, 1, 5], [9, 40, 3, 5]),
    ([23], [23]),                 # whole-prompt prefill through the cache
    ([5, 3], [3, 0]),             # q_len > context: the first rows see no key; context 0 gives zeros
    ([0, 0], [4, 0]),
]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("q_lens, ctx_lens", MIXES)
@pytest.mark.parametrize("causal", [True, False])
def test_paged_matches_fp64_oracle(backend, q_lens, ctx_lens, causal):
    dtype = torch.float32
    p = make_paged(q_lens, ctx_lens, dtype=dtype, seed=sum(q_lens) + 7 * len(ctx_lens))
    o, lse = mp.paged_attention(**_args(p), causal=causal, return_lse=True, backend=backend)
    # -inf lse and exact zeros where a row sees no key, the lse bound elsewhere
    check_against_oracle(p, o, lse, causal=causal, what=f"{backend} q{q_lens} ctx{ctx_lens} c{causal}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("Hq, Hkv", [(2, 2), (4, 2), (8, 1)])
def test_paged_page_sizes_and_gqa(backend, block_size, Hq, Hkv):
    dtype = torch.float16
    p = make_paged([3, 1, 9], [17, 5, 40], Hq=Hq, Hkv=Hkv, block_size=block_size, dtype=dtype, seed=block_size)
    o = mp.paged_attention(**_args(p), backend=backend)
    check_against_oracle(p, o, what=f"{backend} page {block_size} Hq{Hq} Hkv{Hkv}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_paged_causal_residues(backend):
    """(context_len - q_len) over every residue of a 16-key tile, q_len over short and long."""
    dtype = torch.float32
    q_lens = [1, 2, 4, 7, 16, 17] * 3
    offsets = list(range(17))
    ctx = [ql + offsets[i % 17] + 16 * (i % 2) for i, ql in enumerate(q_lens)]
    p = make_paged(q_lens, ctx, Hq=2, Hkv=1, D=64, block_size=8, dtype=dtype, seed=3)
    check_against_oracle(p, mp.paged_attention(**_args(p), backend=backend), what=f"{backend} residues")


# ------------------------------------------------------------------ identities


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_paged_with_one_query_per_sequence_equals_decode(backend):
    p = make_paged([1] * 5, [1, 8, 9, 31, 64], block_size=8, dtype=torch.float16, seed=11)
    o_p, lse_p = mp.paged_attention(**_args(p), return_lse=True, backend=backend)
    o_d, lse_d = mp.decode_attention(p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["context_lens"],
                                     return_lse=True, backend=backend)
    torch.testing.assert_close(o_p, o_d, atol=2e-3, rtol=0)
    torch.testing.assert_close(lse_p, lse_d, atol=1e-3, rtol=0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
def test_paged_over_written_cache_equals_varlen(backend, causal):
    """Fill a cache with write_kv_cache, then paged == prefill_attention_varlen on the same K/V."""
    g = torch.Generator().manual_seed(5)
    dtype, Hq, Hkv, D, bs = torch.float16, 4, 2, 64, 4
    q_lens, ctx = [3, 0, 9, 1], [10, 4, 9, 6]
    cache = mp.PagedKVCache(1, Hkv, D, num_blocks=32, block_size=bs, dtype=dtype)
    cache.k_caches[0].fill_(NAN)
    cache.v_caches[0].fill_(NAN)
    ks, vs, slots = [], [], []
    for s, n in enumerate(ctx):
        slots.append(cache.allocate(s, n))
        ks.append(torch.randn(n, Hkv, D, generator=g).to(dtype))
        vs.append(torch.randn(n, Hkv, D, generator=g).to(dtype))
    k, v = torch.cat(ks), torch.cat(vs)
    mp.write_kv_cache(k, v, cache.k_caches[0], cache.v_caches[0], torch.cat(slots), backend=backend)
    q = torch.randn(sum(q_lens), Hq, D, generator=g).to(dtype)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(ctx).cumsum(0).tolist()], dtype=torch.int32)
    ids = list(range(len(ctx)))
    o_p = mp.paged_attention(q, cache.k_caches[0], cache.v_caches[0], cache.block_tables(ids), cu_q,
                             cache.context_lens(ids), causal=causal, backend=backend)
    o_v = mp.prefill_attention_varlen(q, k, v, cu_q, cu_k, causal=causal, backend=backend)
    torch.testing.assert_close(o_p, o_v, atol=2e-3, rtol=0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_split_keys_and_merge_equals_whole(backend):
    """Non-causal attention over keys [0, a) and [a, n) merged by their lse equals the whole."""
    dtype = torch.float32
    n, a, bs = 29, 12, 4
    p = make_paged([3, 1], [n, n], dtype=dtype, block_size=bs, seed=2)
    whole, lse_w = mp.paged_attention(**_args(p), causal=False, return_lse=True, backend=backend)
    tables = p["block_tables"]
    # second half: a table that starts at key a (a is a multiple of bs)
    tail = torch.full_like(tables, -1)
    tail[:, : tables.shape[1] - a // bs] = tables[:, a // bs:]
    lens_a = torch.full((2,), a, dtype=torch.int32)
    o1, l1 = mp.paged_attention(**{**_args(p), "context_lens": lens_a}, causal=False, return_lse=True, backend=backend)
    o2, l2 = mp.paged_attention(**{**_args(p), "block_tables": tail, "context_lens": lens_a.fill_(n - a)},
                                causal=False, return_lse=True, backend=backend)
    o, lse = mp.merge_attention_states(o1, l1, o2, l2)
    torch.testing.assert_close(o, whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, lse_w, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_return_lse_on_every_op(backend):
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 4, 5, 64, generator=g)
    k = torch.randn(2, 2, 7, 64, generator=g)
    v = torch.randn(2, 2, 7, 64, generator=g)
    o, lse = mp.prefill_attention(q, k, v, return_lse=True, backend=backend)
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32
    # lse = log sum_j exp(scale q.k_j) over the visible keys, in fp64
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double().repeat_interleave(2, 1)) / 8.0
    mask = torch.arange(7)[None, :] <= torch.arange(5)[:, None] + 2
    ref = torch.logsumexp(s.masked_fill(~mask, -math.inf), -1)
    torch.testing.assert_close(lse.double(), ref, atol=1e-4, rtol=0)
    assert torch.equal(mp.prefill_attention(q, k, v, backend=backend), o)
    # no keys: zeros and -inf
    o0, l0 = mp.prefill_attention(q, k[:, :, :0], v[:, :, :0], return_lse=True, backend=backend)
    assert (o0 == 0).all() and torch.isneginf(l0).all()
    # varlen: rows match the dense call per sequence
    qv, kv, vv = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))
    cu_q, cu_k = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)
    ov, lv = mp.prefill_attention_varlen(qv, kv, vv, cu_q, cu_k, return_lse=True, backend=backend)
    torch.testing.assert_close(lv, lse[0].transpose(0, 1), atol=1e-5, rtol=0)
    # decode, context 0 gives -inf
    p = make_paged([1, 1], [6, 0], seed=4)
    od, ld = mp.decode_attention(p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["context_lens"],
                                 return_lse=True, backend=backend)
    _, ref_lse = oracle(p)
    assert torch.isneginf(ld[1]).all() and (od[1] == 0).all()
    torch.testing.assert_close(ld[0].double(), ref_lse[0], atol=1e-4, rtol=0)


def test_merge_empty_sides_and_dtypes():
    g = torch.Generator().manual_seed(1)
    o_a = torch.randn(3, 2, 8, generator=g).half()
    o_b = torch.randn(3, 2, 8, generator=g).half()
    lse_a = torch.randn(3, 2, generator=g)
    lse_b = torch.randn(3, 2, generator=g)
    lse_a[0] = -math.inf           # one side empty: the other side unchanged
    lse_a[1] = lse_b[1] = -math.inf  # both empty: zeros and -inf, no NaN
    o_a[0] = 0
    o_a[1] = o_b[1] = 0
    o, lse = mp.merge_attention_states(o_a, lse_a, o_b, lse_b)
    assert o.dtype == torch.float16 and lse.dtype == torch.float32
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(o[0], o_b[0])
    assert (o[1] == 0).all() and torch.isneginf(lse[1]).all()
    w_a = torch.exp(lse_a[2].double() - torch.logaddexp(lse_a[2], lse_b[2]).double())
    ref = w_a[:, None] * o_a[2].double() + (1 - w_a[:, None]) * o_b[2].double()
    torch.testing.assert_close(o[2].double(), ref, atol=2e-3, rtol=0)


def _merge_backends(device):
    # merge_attention_states has torch and triton kernels; the cuda backends run triton's
    return _backends(device)


def _check_merge_ignores_empty_sides(backend, device, dtype):
    # The o rows of a side that saw no key are garbage (NaN here, as an uninitialised split
    # buffer may hold): they must not reach the output, whichever side is empty.
    g = torch.Generator().manual_seed(7)
    o_a = torch.randn(4, 3, 64, generator=g).to(device, dtype)
    o_b = torch.randn(4, 3, 64, generator=g).to(device, dtype)
    lse_a = torch.randn(4, 3, generator=g).to(device)
    lse_b = torch.randn(4, 3, generator=g).to(device)
    lse_a[0] = -math.inf
    o_a[0] = NAN                          # only b saw keys: o = o_b exactly
    lse_b[1] = -math.inf
    o_b[1] = NAN                          # only a saw keys: o = o_a exactly
    lse_a[2] = lse_b[2] = -math.inf
    o_a[2] = o_b[2] = NAN                 # neither: zeros and -inf
    o, lse = mp.merge_attention_states(o_a, lse_a, o_b, lse_b, backend=backend)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert torch.equal(o[0], o_b[0]) and torch.equal(o[1], o_a[1])
    assert (o[2] == 0).all() and torch.isneginf(lse[2]).all()
    torch.testing.assert_close(lse[:2], torch.stack([lse_b[0], lse_a[1]]))
    w_a = torch.exp(lse_a[3].double() - torch.logaddexp(lse_a[3].double(), lse_b[3].double()))
    ref = w_a[:, None] * o_a[3].double() + (1 - w_a[:, None]) * o_b[3].double()
    # inputs are exact in fp64: the only error is rounding the fp32 merge to the output dtype
    rtol = {torch.bfloat16: 2**-8, torch.float16: 2**-11}.get(dtype, 1e-6)
    torch.testing.assert_close(o[3].double(), ref, atol=1e-6, rtol=rtol)


@pytest.mark.parametrize("backend", _merge_backends("cpu"))
def test_merge_ignores_the_o_of_empty_sides(backend):
    _check_merge_ignores_empty_sides(backend, "cpu", torch.float16 if backend == "triton" else torch.float32)


def _check_merge_precision_at_large_lse(backend, device, level):
    # Partials of long or large-scale rows have |lse| in the hundreds and more. Weights taken as
    # exp(lse_a - logaddexp(lse_a, lse_b)) with the fp32 logaddexp carry its ulp (|lse| * 2^-24) as a
    # relative error (3e-3 at 1e4); from the inputs' difference they stay at fp32 rounding.
    g = torch.Generator().manual_seed(11)
    o_a, o_b = torch.randn(64, 4, 64, generator=g), torch.randn(64, 4, 64, generator=g)
    lse_a, lse_b = level + torch.randn(64, 4, generator=g), level + torch.randn(64, 4, generator=g)
    o, _ = mp.merge_attention_states(*(t.to(device) for t in (o_a, lse_a, o_b, lse_b)), backend=backend)
    w_a = torch.sigmoid(lse_a.double() - lse_b.double()).unsqueeze(-1)
    ref = w_a * o_a.double() + (1 - w_a) * o_b.double()
    torch.testing.assert_close(o.cpu().double(), ref, atol=2e-6, rtol=0)


@pytest.mark.parametrize("backend", _merge_backends("cpu"))
@pytest.mark.parametrize("level", [0.0, 100.0, 1e4])
def test_merge_weights_do_not_lose_precision_at_large_lse(backend, level):
    _check_merge_precision_at_large_lse(backend, "cpu", level)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton", "cuda", "cuda-wmma"])
@pytest.mark.parametrize("level", [0.0, 100.0, 1e4])
def test_merge_weights_do_not_lose_precision_at_large_lse_gpu(backend, level):
    if not torch.cuda.is_available() or backend not in _merge_backends("cuda"):
        pytest.skip(f"{backend} unavailable on cuda")
    _check_merge_precision_at_large_lse(backend, "cuda", level)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton", "cuda", "cuda-wmma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_merge_ignores_the_o_of_empty_sides_gpu(backend, dtype):
    if not torch.cuda.is_available() or backend not in _merge_backends("cuda"):
        pytest.skip(f"{backend} unavailable on cuda")
    _check_merge_ignores_empty_sides(backend, "cuda", dtype)


# ------------------------------------------------------------------ bad input


def _good():
    return make_paged([2, 1], [5, 9], seed=0)


@pytest.mark.parametrize("mutate, exc, words", [
    (lambda a: {**a, "q": a["q"].double()}, TypeError, ["q", "float64"]),
    (lambda a: {**a, "k_cache": a["k_cache"].half()}, TypeError, ["k_cache", "dtype"]),
    (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].long()}, TypeError, ["cu_seqlens_q", "int32"]),
    (lambda a: {**a, "block_tables": a["block_tables"].long()}, TypeError, ["block_tables", "int32"]),
    (lambda a: {**a, "context_lens": a["context_lens"].long()}, TypeError, ["context_lens", "int32"]),
    (lambda a: {**a, "cu_seqlens_q": torch.tensor([0, 2], dtype=torch.int32)}, ValueError, ["len(cu_seqlens_q)"]),
    (lambda a: {**a, "context_lens": a["context_lens"][:1]}, ValueError, ["context_lens.shape[0]"]),
    (lambda a: {**a, "cu_seqlens_q": torch.tensor([1, 2, 3], dtype=torch.int32)}, ValueError, ["start at 0"]),
    (lambda a: {**a, "cu_seqlens_q": torch.tensor([0, 3, 2], dtype=torch.int32)}, ValueError, ["non-decreasing"]),
    (lambda a: {**a, "cu_seqlens_q": torch.tensor([0, 1, 2], dtype=torch.int32)}, ValueError, ["cu_seqlens_q[-1]"]),
    (lambda a: {**a, "context_lens": torch.tensor([5, -1], dtype=torch.int32)}, ValueError, [">= 0"]),
    (lambda a: {**a, "context_lens": torch.tensor([5, 999], dtype=torch.int32)}, ValueError, ["capacity"]),
    (lambda a: {**a, "block_tables": a["block_tables"].fill_(-1)}, ValueError, ["block_tables[0, 0]=-1"]),
    (lambda a: {**a, "block_tables": a["block_tables"] + 100}, ValueError, ["outside [0, num_blocks"]),
    (lambda a: {**a, "q": a["q"][:, :3]}, ValueError, ["Hq % Hkv"]),
    (lambda a: {**a, "q": a["q"][..., :32]}, ValueError, ["head dim"]),
    (lambda a: {**a, "q": a["q"][None]}, ValueError, ["q", "3-D"]),
    (lambda a: {**a, "v_cache": a["v_cache"][:1]}, ValueError, ["v_cache", "shape"]),
    (lambda a: {**a, "k_cache": a["k_cache"][:, :3], "v_cache": a["v_cache"][:, :3]}, ValueError, ["power of two"]),
    (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].to("meta")}, ValueError, ["device"]),
    (lambda a: {**a, "max_seqlen_q": 1}, ValueError, ["max_seqlen_q=1 is below"]),
    (lambda a: {**a, "max_seqlen_q": -2}, ValueError, ["max_seqlen_q"]),
    (lambda a: {**a, "causal": 1}, TypeError, ["causal"]),
    (lambda a: {**a, "return_lse": "yes"}, TypeError, ["return_lse"]),
    (lambda a: {**a, "scale": 0.0}, ValueError, ["scale"]),
    (lambda a: {**a, "q": "q"}, TypeError, ["q", "Tensor"]),
])
def test_paged_rejects(mutate, exc, words):
    p = _good()
    args = mutate(_args(p))
    with pytest.raises(exc) as e:
        mp.paged_attention(**args, backend="torch")
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("mutate, exc, words", [
    (lambda a, la, b, lb: (a, la.half(), b, lb), TypeError, ["lse_a", "float32"]),
    (lambda a, la, b, lb: (a, la, b.float(), lb), TypeError, ["o_b", "dtype"]),
    (lambda a, la, b, lb: (a, la[:, :1], b, lb), ValueError, ["lse_a", "shape"]),
    (lambda a, la, b, lb: (a, la, b[:1], lb), ValueError, ["o_b", "shape"]),
    (lambda a, la, b, lb: (a.int(), la, b, lb), TypeError, ["o_a"]),
    (lambda a, la, b, lb: (a, la, b, "x"), TypeError, ["lse_b", "Tensor"]),
])
def test_merge_rejects(mutate, exc, words):
    o = torch.randn(3, 2, 8).half()
    lse = torch.randn(3, 2)
    with pytest.raises(exc) as e:
        mp.merge_attention_states(*mutate(o, lse, o.clone(), lse.clone()))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


# ------------------------------------------------------------------ GPU


def _gpu_backends():
    return [b for b in _backends("cuda") if b != "torch"] if torch.cuda.is_available() else []


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda", "cuda-wmma"])
@pytest.mark.parametrize("dtype, D, block_size", [
    (torch.bfloat16, 128, 16), (torch.bfloat16, 64, 1), (torch.float16, 128, 256), (torch.float16, 64, 64)])
def test_paged_gpu_mixed_batches(backend, dtype, D, block_size):
    if backend not in _gpu_backends():
        pytest.skip(f"{backend} unavailable")
    rnd = random.Random(block_size * 7 + D)
    q_lens = [0, 1, 1, 4, 8, 97, 300, 1] + [rnd.choice([1, 2, 4, 64, 129]) for _ in range(6)]
    ctx = [max(ql + rnd.randrange(0, 900), 0) for ql in q_lens]
    ctx[0], ctx[2] = 17, 0
    p = make_paged(q_lens, ctx, Hq=8, Hkv=2, D=D, block_size=block_size, dtype=dtype, device="cuda",
                   seed=block_size + D)
    for causal in (True, False):
        o, lse = mp.paged_attention(**_args(p), causal=causal, return_lse=True, backend=backend)
        check_against_oracle(p, o, lse, causal=causal, what=f"{backend} {dtype} D{D} page {block_size} c{causal}")
        again = mp.paged_attention(**_args(p), causal=causal, backend=backend)
        assert torch.equal(o, again), "paged attention must be bitwise deterministic"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("case", ["chunk_long_context", "spec_verify", "mixed"])
def test_paged_gpu_serving_shapes(backend, case):
    if backend not in _gpu_backends():
        pytest.skip(f"{backend} unavailable")
    if case == "chunk_long_context":
        q_lens, ctx = [2048], [32768]
    elif case == "spec_verify":
        q_lens, ctx = [4] * 32, [4096 - i for i in range(32)]
    else:
        q_lens, ctx = [2048] + [1] * 15, [4096] * 16
    dtype = torch.bfloat16
    p = make_paged(q_lens, ctx, Hq=16, Hkv=8, D=128, block_size=16, dtype=dtype, device="cuda", seed=len(q_lens))
    o = mp.paged_attention(**_args(p), backend=backend)
    ref = mp.paged_attention(**{k: (v.float() if k in ("q", "k_cache", "v_cache") else v) for k, v in _args(p).items()},
                             backend="torch")
    err = (o.float() - ref).abs().max().item()
    assert not torch.isnan(o).any() and err < 3e-2, err
