"""FP8 (float8_e4m3fn) KV caches through the public API, PagedKVCache and the engine (issue #15).

Every backend with FP8 kernels is compared with an fp64 oracle computed on the SAME fp8 cache
(dequantised exactly), so quantisation error is never blamed on a kernel; quantisation itself
must be bit-exact against torch's own cast of the clamped value.
"""

from __future__ import annotations

import math

import pytest
import torch

import minipaged as mp
from minipaged import registry
from minipaged.testing import assert_close

FP8 = torch.float8_e4m3fn
NAN8 = 0x7F  # a float8_e4m3fn NaN bit pattern


def _fp8_backends(device="cpu"):
    return [n for n, b in registry.all_backends().items() if b.fp8_kv and b.is_available(device)[0]]


CPU = _fp8_backends()


def _quant_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x.float() / scale[:, None], -448.0, 448.0).to(FP8)


def _fp8_cache(ctx_lens, *, Hkv=2, D=64, block_size=4, seed=0, k_scale=None, v_scale=None, device="cpu"):
    """Scattered pages, unused slots NaN (fp8's own NaN), -1 past the used table entries.
    Returns the caches, tables, lens and the exact fp32 K/V each sequence holds."""
    g = torch.Generator().manual_seed(seed)
    used = [-(-n // block_size) for n in ctx_lens]
    num_blocks = sum(used) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(ctx_lens), max(used + [1]) + 1), -1, dtype=torch.int32)
    kc = torch.full((num_blocks, block_size, Hkv, D), NAN8, dtype=torch.uint8).view(FP8)
    vc = kc.clone()
    k_scale = torch.full((Hkv,), 0.05) if k_scale is None else k_scale
    v_scale = torch.full((Hkv,), 0.02) if v_scale is None else v_scale
    exact_k, exact_v, at = [], [], 0
    for s, n in enumerate(ctx_lens):
        k = _quant_ref(torch.randn(n, Hkv, D, generator=g) * 5, k_scale)
        v = _quant_ref(torch.randn(n, Hkv, D, generator=g) * 2, v_scale)
        exact_k.append(k.double() * k_scale.double()[:, None])
        exact_v.append(v.double() * v_scale.double()[:, None])
        for j in range(used[s]):
            blk = perm[at]
            at += 1
            tables[s, j] = blk
            lo, hi = j * block_size, min(n, (j + 1) * block_size)
            kc[blk, : hi - lo] = k[lo:hi]
            vc[blk, : hi - lo] = v[lo:hi]
    dev = dict(device=device)
    return dict(k_cache=kc.to(**dev), v_cache=vc.to(**dev), block_tables=tables.to(**dev),
                context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
                k_scale=k_scale.to(**dev), v_scale=v_scale.to(**dev), keys=exact_k, vals=exact_v)


def _oracle(q, keys, vals, q_lens, causal=True, flash_dtype=None):
    """o [Tq, Hq, D] over the exact dequantised K/V; zeros for rows that see no key. fp64,
    or with flash_dtype the same attention in a flash kernel's precision (the error bound's
    baseline): K/V rounded to flash_dtype, fp32 scores and softmax, P rounded to it, fp32 PV,
    o rounded to it."""
    work = torch.float64 if flash_dtype is None else torch.float32
    low = (lambda t: t) if flash_dtype is None else (lambda t: t.to(flash_dtype).to(work))  # noqa: E731
    q = q.cpu().to(work)
    Tq, Hq, D = q.shape
    o = torch.zeros(Tq, Hq, D, dtype=work)
    at = 0
    for k, v, nq in zip(keys, vals, q_lens):
        n = k.shape[0]
        group = Hq // k.shape[1]
        kk, vv = low(k).to(work).repeat_interleave(group, 1), low(v).to(work).repeat_interleave(group, 1)
        for i in range(nq):
            hi = n - nq + i + 1 if causal else n
            if hi > 0:
                w = torch.softmax(torch.einsum("hd,jhd->hj", q[at + i], kk[:hi]) / math.sqrt(D), -1)
                o[at + i] = torch.einsum("hj,jhd->hd", low(w), vv[:hi])
        at += nq
    return o if flash_dtype is None else o.to(flash_dtype)


# ------------------------------------------------------------------ quantisation


@pytest.mark.parametrize("backend", CPU)
def test_write_kv_cache_quantises_bit_exactly(backend):
    g = torch.Generator().manual_seed(1)
    T, Hkv, D = 37, 2, 64
    k = torch.randn(T, Hkv, D, generator=g) * 40
    # ties, subnormals, saturation, exact values
    k[0, 0, :6] = torch.tensor([448.0, 464.0, -1e6, 2.0 ** -9, 3 * 2.0 ** -10, 0.0])
    k[1, 0, :4] = torch.tensor([1.0625, 1.1875, -1.0625, 17.0])  # halfway cases between fp8 neighbours
    k, v = k.half(), (k * 0.3).half()
    ks, vs = torch.tensor([1.0, 0.5]), torch.tensor([0.25, 2.0])
    kc = torch.full((12, 4, Hkv, D), NAN8, dtype=torch.uint8).view(FP8)
    vc = kc.clone()
    slots = torch.randperm(48, generator=g)[:T]
    slots[5] = -1
    mp.write_kv_cache(k, v, kc, vc, slots, k_scale=ks, v_scale=vs, backend=backend)
    keep = slots >= 0
    blk, off = slots[keep] // 4, slots[keep] % 4
    assert torch.equal(kc[blk, off].view(torch.uint8), _quant_ref(k[keep], ks).view(torch.uint8))
    assert torch.equal(vc[blk, off].view(torch.uint8), _quant_ref(v[keep], vs).view(torch.uint8))
    untouched = torch.ones(12, 4, dtype=torch.bool)
    untouched[blk, off] = False
    assert (kc[untouched].view(torch.uint8) == NAN8).all(), "a skipped slot or an unused one was written"
    # a scalar scale means the same scale for every KV head
    kc2, vc2 = kc.clone(), vc.clone()
    mp.write_kv_cache(k, v, kc2, vc2, slots, k_scale=0.5, v_scale=torch.tensor(2.0), backend=backend)
    assert torch.equal(kc2[blk, off].view(torch.uint8), _quant_ref(k[keep], torch.full((2,), 0.5)).view(torch.uint8))


# ------------------------------------------------------------------ attention over fp8 caches


@pytest.mark.parametrize("backend", CPU)
@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_and_paged_on_fp8_cache_match_the_oracle(backend, block_size):
    ctx = [1, 9, 33, 0]
    p = _fp8_cache(ctx, block_size=block_size, seed=block_size)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 4, 64, generator=g).half()
    args = dict(k_cache=p["k_cache"], v_cache=p["v_cache"], block_tables=p["block_tables"],
                context_lens=p["context_lens"], k_scale=p["k_scale"], v_scale=p["v_scale"], backend=backend)
    o = mp.decode_attention(q, **args)
    ref = _oracle(q, p["keys"], p["vals"], [1, 1, 1, 1])
    assert not torch.isnan(o).any()
    assert (o.double() - ref).abs().max().item() < 4e-3
    q_lens = [1, 4, 17, 0]
    qp = torch.randn(sum(q_lens), 4, 64, generator=g).half()
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    for causal in (True, False):
        o = mp.paged_attention(qp, cu_seqlens_q=cu, causal=causal, **args)
        ref = _oracle(qp, p["keys"], p["vals"], q_lens, causal=causal)
        assert (o.double() - ref).abs().max().item() < 4e-3, causal
    # the scale is applied: doubling k_scale sharpens the softmax, doubling v_scale doubles o
    o1 = mp.decode_attention(q, **{**args, "v_scale": p["v_scale"] * 2})
    torch.testing.assert_close(o1.float(), 2 * mp.decode_attention(q, **args).float(), atol=4e-3, rtol=1e-2)


@pytest.mark.parametrize("backend", CPU)
def test_fp8_engine_style_round_trip_equals_16bit_cache_within_quantisation(backend):
    """write_kv_cache into an fp8 cache, then paged attention: close to the same over a 16-bit cache."""
    g = torch.Generator().manual_seed(5)
    T, Hkv, D, bs = 21, 2, 64, 4
    k, v = torch.randn(T, Hkv, D, generator=g).half(), torch.randn(T, Hkv, D, generator=g).half()
    q = torch.randn(T, 4, D, generator=g).half()
    slots = torch.arange(T)
    tables = torch.arange(6, dtype=torch.int32)[None]
    lens, cu = torch.tensor([T], dtype=torch.int32), torch.tensor([0, T], dtype=torch.int32)
    c16 = [torch.zeros(6, bs, Hkv, D, dtype=torch.float16) for _ in range(2)]
    c8 = [torch.zeros(6, bs, Hkv, D, dtype=FP8) for _ in range(2)]
    ks = (k.float().abs().amax(dim=(0, 2)) / 448)
    vs = (v.float().abs().amax(dim=(0, 2)) / 448)
    mp.write_kv_cache(k, v, *c16, slots, backend=backend)
    mp.write_kv_cache(k, v, *c8, slots, k_scale=ks, v_scale=vs, backend=backend)
    o16 = mp.paged_attention(q, *c16, tables, cu, lens, backend=backend)
    o8 = mp.paged_attention(q, *c8, tables, cu, lens, k_scale=ks, v_scale=vs, backend=backend)
    rel = ((o8.float() - o16.float()).norm() / o16.float().norm()).item()
    assert 0 < rel < 0.08, rel  # e4m3 keeps 3 mantissa bits: a few percent, never zero


# ------------------------------------------------------------------ bad input


def _bad_args():
    p = _fp8_cache([5, 3])
    q = torch.randn(2, 4, 64).half()
    return q, p


@pytest.mark.parametrize("mutate, exc, words", [
    (lambda q, p: dict(k_scale=0.0), ValueError, ["k_scale", "positive"]),
    (lambda q, p: dict(v_scale=float("inf")), ValueError, ["v_scale", "finite"]),
    (lambda q, p: dict(k_scale=-1.0), ValueError, ["k_scale"]),
    (lambda q, p: dict(k_scale=torch.tensor([1.0, 0.0])), ValueError, ["k_scale", "positive"]),
    (lambda q, p: dict(k_scale=torch.tensor([1.0, float("nan")])), ValueError, ["k_scale"]),
    (lambda q, p: dict(k_scale=torch.ones(3)), ValueError, ["k_scale", "[Hkv]"]),
    (lambda q, p: dict(k_scale=torch.ones(2, dtype=torch.float64)), TypeError, ["k_scale", "float32"]),
    (lambda q, p: dict(k_scale=torch.ones(2, device="meta")), ValueError, ["k_scale", "meta"]),
    (lambda q, p: dict(k_scale=True), TypeError, ["k_scale"]),
    (lambda q, p: dict(k_scale="1"), TypeError, ["k_scale"]),
])
def test_bad_scales_are_rejected(mutate, exc, words):
    q, p = _bad_args()
    base = dict(k_scale=p["k_scale"], v_scale=p["v_scale"])
    for call in ("decode", "write"):
        with pytest.raises(exc) as e:
            if call == "decode":
                mp.decode_attention(q, p["k_cache"], p["v_cache"], p["block_tables"], p["context_lens"],
                                    backend="torch", **{**base, **mutate(q, p)})
            else:
                mp.write_kv_cache(q[:, :2], q[:, :2], p["k_cache"], p["v_cache"], torch.tensor([0, 1]),
                                  backend="torch", **{**base, **mutate(q, p)})
        for w in words:
            assert w in str(e.value), (w, str(e.value))


def test_scale_with_a_16bit_cache_and_dtype_rules():
    kc = torch.randn(4, 4, 2, 64).half()
    q = torch.randn(2, 4, 64).half()
    tables = torch.tensor([[0], [1]], dtype=torch.int32)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="float8_e4m3fn caches only"):
        mp.decode_attention(q, kc, kc, tables, lens, k_scale=0.5)
    with pytest.raises(ValueError, match="float8_e4m3fn caches only"):
        mp.write_kv_cache(q[:, :2], q[:, :2], kc, kc, torch.tensor([0, 1]), v_scale=0.5)
    k8 = kc.to(FP8)
    with pytest.raises(TypeError, match="float16 or bfloat16 with a float8_e4m3fn cache"):
        mp.decode_attention(q.float(), k8, k8, tables, lens)
    with pytest.raises(TypeError, match="v_cache must have the dtype of k_cache"):
        mp.decode_attention(q, k8, kc, tables, lens)
    # default scale 1.0
    torch.testing.assert_close(mp.decode_attention(q, k8, k8, tables, lens),
                               mp.decode_attention(q, k8, k8, tables, lens, k_scale=1.0, v_scale=1.0))


def test_auto_skips_backends_without_fp8_kernels(monkeypatch):
    """On CUDA tensors auto would pick cuda first; with an fp8 cache and a cuda backend without FP8
    kernels (patched: the real one has them) it must pick the next one that has them, and that
    backend asked for by name must be refused with the reason."""
    import dataclasses

    registry.reset_caches()
    fake = {n: dataclasses.replace(b, availability=lambda d: (True, "patched"), fp8_kv=b.fp8_kv and n != "cuda")
            for n, b in registry._BACKENDS.items()}
    monkeypatch.setattr(registry, "_BACKENDS", fake)
    monkeypatch.delenv("MINIPAGED_BACKEND", raising=False)
    monkeypatch.delenv("MINIPAGED_DECODE_BACKEND", raising=False)
    try:
        assert registry.resolve("decode", "cuda").name == "cuda"
        assert registry.resolve("decode", "cuda", fp8_kv=True).name == "triton"
        with pytest.raises(mp.BackendUnavailableError, match="no float8_e4m3fn KV-cache kernels"):
            registry.bind("cuda", "cuda", fp8_kv=True)
    finally:
        registry.reset_caches()


# ------------------------------------------------------------------ PagedKVCache and the engine


def test_paged_kv_cache_fp8_scales():
    c = mp.PagedKVCache(3, 2, 64, num_blocks=4, dtype=FP8, k_scale=0.5, v_scale=torch.tensor([1.0, 2.0]))
    assert c.is_fp8 and c.k_scales.shape == (3, 2) and c.k_scales.dtype == torch.float32
    assert (c.k_scales == 0.5).all() and c.v_scales[2].tolist() == [1.0, 2.0]
    c = mp.PagedKVCache(1, 2, 64, num_blocks=4, dtype=FP8)
    assert (c.k_scales == 1).all() and (c.v_scales == 1).all()
    with pytest.raises(ValueError, match="float8_e4m3fn caches only"):
        mp.PagedKVCache(1, 2, 64, num_blocks=4, dtype=torch.float16, k_scale=0.5)
    with pytest.raises(ValueError, match="positive"):
        mp.PagedKVCache(1, 2, 64, num_blocks=4, dtype=FP8, k_scale=0.0)
    with pytest.raises(ValueError, match="shape"):
        mp.PagedKVCache(2, 2, 64, num_blocks=4, dtype=FP8, v_scale=torch.ones(3, 2))


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=97, max_position_embeddings=256)


def test_engine_fp8_calibrates_scales_and_stays_close_to_bf16():
    from minipaged.engine import Engine

    kw = dict(dtype=torch.bfloat16, device="cpu", backend="torch", num_blocks=64, block_size=4)
    e8 = Engine(TINY, kv_cache_dtype="fp8", **kw)
    e16 = Engine(TINY, **kw)
    assert e8.cache.dtype == FP8 and (e8.cache.k_scales == 1).all()
    e8.warmup()
    assert (e8.cache.k_scales != 1).any() and e8._calibrate_kv, "warm-up must not fix the scales"
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [4, 5, 6, 60, 61]]
    out8 = e8.generate(prompts, max_new_tokens=5, ignore_eos=True)
    scales = e8.cache.k_scales.clone()
    assert not e8._calibrate_kv and (scales > 0).all()
    e8.generate([[50, 51, 52]], max_new_tokens=2, ignore_eos=True)
    assert torch.equal(e8.cache.k_scales, scales), "scales are fixed after the first prompt step"
    out16 = e16.generate(prompts, max_new_tokens=5, ignore_eos=True)
    agree = sum(a == b for x, y in zip(out8, out16) for a, b in zip(x, y)) / 10
    assert agree >= 0.6, (out8, out16)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Engine(TINY, kv_cache_dtype="int8", **kw)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        Engine(TINY, kv_cache_dtype="fp8", **{**kw, "dtype": torch.float32})


def test_engine_fp8_calibration_leaves_room_for_later_tokens():
    """Scales fixed on a one-token first prompt (its amax per KV head from one vector) must not
    clip the K/V of later, longer prompts at +-448: the amax maps to 448 / 8. With the amax
    mapped to 448 itself, hundreds of later values saturated here."""
    from minipaged.engine import Engine
    from minipaged.engine.model import FP8_CALIBRATION_HEADROOM, FP8_MAX

    eng = Engine(TINY, dtype=torch.bfloat16, device="cpu", backend="torch", num_blocks=64, block_size=4,
                 kv_cache_dtype="fp8")
    for c in (*eng.cache.k_caches, *eng.cache.v_caches):
        c.zero_()
    eng.generate([[7]], max_new_tokens=1)
    first_amax = [c.float().abs().amax().item() for c in (*eng.cache.k_caches, *eng.cache.v_caches)]
    # the first prompt's largest value lands on 448 / 8, exactly up to the division's rounding
    assert first_amax == pytest.approx([FP8_MAX / FP8_CALIBRATION_HEADROOM] * len(first_amax), rel=2 ** -3)
    eng.generate([list(range(1, 90))], max_new_tokens=4, ignore_eos=True)
    for c in (*eng.cache.k_caches, *eng.cache.v_caches):
        values = c.float().abs()
        assert (values == FP8_MAX).sum() == 0, f"{int((values == FP8_MAX).sum())} later K/V values saturated"
        assert values.amax() > FP8_MAX / FP8_CALIBRATION_HEADROOM, "later tokens did go past the first amax"


def test_engine_fp8_reads_checkpoint_scales():
    from minipaged.engine import Engine, Qwen3Config
    from minipaged.engine.loader import random_state_dict

    cfg = Qwen3Config.from_any(TINY)
    state = random_state_dict(cfg, seed=0, dtype=torch.bfloat16, device=torch.device("cpu"))
    for i in range(cfg.num_hidden_layers):
        state[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.01 * (i + 1))
        state[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([0.02, 0.03])
    eng = Engine.from_state_dict(cfg, state, dtype=torch.bfloat16, device="cpu", backend="torch", num_blocks=32,
                                 kv_cache_dtype="fp8")
    assert not eng._calibrate_kv
    assert eng.cache.k_scales[:, 0].tolist() == pytest.approx([0.01, 0.02])
    assert eng.cache.v_scales[1].tolist() == pytest.approx([0.02, 0.03])
    eng.generate([[1, 2, 3]], max_new_tokens=2)
    assert eng.cache.k_scales[:, 0].tolist() == pytest.approx([0.01, 0.02]), "checkpoint scales never change"
    del state["model.layers.1.self_attn.v_scale"]
    with pytest.raises(ValueError, match="some layers"):
        Engine.from_state_dict(cfg, state, dtype=torch.bfloat16, device="cpu", backend="torch", num_blocks=32,
                               kv_cache_dtype="fp8")


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_paged_gpu(backend, dtype):
    if backend not in _fp8_backends("cuda"):
        pytest.skip(f"{backend} has no FP8 kernels on CUDA here")
    ctx = [1, 4096, 32768, 100, 0]
    q_lens = [1, 4, 1, 64, 0]
    g = torch.Generator().manual_seed(8)
    k_scale = torch.rand(8, generator=g) * 0.1 + 0.01
    v_scale = torch.rand(8, generator=g) * 0.05 + 0.01
    p = _fp8_cache(ctx, Hkv=8, D=128, block_size=16, seed=7, device="cuda", k_scale=k_scale, v_scale=v_scale)
    q = torch.randn(sum(q_lens), 16, 128, generator=g).to("cuda", dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    o = mp.paged_attention(q, p["k_cache"], p["v_cache"], p["block_tables"], cu, p["context_lens"],
                           k_scale=p["k_scale"], v_scale=p["v_scale"], backend=backend)
    ref = _oracle(q, p["keys"], p["vals"], q_lens)
    # The bound follows what a flash kernel's arithmetic gets in `dtype`, not a fixed number
    # (|o| reaches ~3 here, where one bf16 ulp is 0.016).
    assert_close(o, ref, _oracle(q, p["keys"], p["vals"], q_lens, flash_dtype=dtype), f"fp8 paged {backend} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_engine_fp8_gpu(backend):
    """The engine on an fp8 cache on the GPU (CUDA-graph decode, chunked prompts that cross
    blocks, prefix hits): scales calibrated on the first prompt step and then fixed, the
    picks close to the same engine's on a bf16 cache, every block returned at the end."""
    from minipaged.engine import Engine

    if backend not in _fp8_backends("cuda"):
        pytest.skip(f"{backend} has no FP8 kernels on CUDA here")
    kw = dict(dtype=torch.bfloat16, device="cuda", backend=backend, num_blocks=256, block_size=16,
              max_num_batched_tokens=64)
    e8 = Engine(TINY, kv_cache_dtype="fp8", **kw)
    e16 = Engine(TINY, **kw)
    shared = list(range(1, 41))
    prompts = [shared + [50, 51], shared + [60, 61, 62], [(7 * i) % 97 for i in range(97)]]
    out8 = e8.generate(prompts, max_new_tokens=8, ignore_eos=True)
    scales = e8.cache.k_scales.clone()
    assert not e8._calibrate_kv and (scales > 0).all() and torch.isfinite(scales).all()
    out16 = e16.generate(prompts, max_new_tokens=8, ignore_eos=True)
    assert e8.stats.cuda_graph and e8.stats.prefix_hit_tokens > 0, e8.stats
    agree = sum(a == b for x, y in zip(out8, out16) for a, b in zip(x, y)) / sum(len(x) for x in out8)
    assert agree >= 0.6, (out8, out16)
    e8.generate([[5, 6, 7]], max_new_tokens=2, ignore_eos=True)
    assert torch.equal(e8.cache.k_scales, scales), "scales are fixed after the first prompt step"
    assert e8.cache.num_free_blocks == e8.cache.num_blocks
