"""Tile edges and semantic rules of every backend, judged by the fp64 oracle of minipaged.testing.

Causal tile sweep: a kernel splits a query tile's keys into fully visible
tiles, a masked diagonal band and skipped tiles. An off-by-one at any of those
boundaries only shows for some residues of (Nk - Nq) mod BLOCK_N (the band's
end moves with Nk - Nq) and of Nq mod BLOCK_M (which rows a tile holds), and
only in a query tile that is not the last one (the last tile's band always
ends at Nk). So the sweep runs every residue 0..BLOCK_N of Nk - Nq, with Nq
spread over the residues mod BLOCK_M and always above 2 * BLOCK_M, dense and
varlen, causal and not. Tile sizes are read from the backend where they are
configurable (triton's prefill_config) and from the CUDA sources otherwise.

CPU (CI): torch and triton under TRITON_INTERPRET=1 (fp32 and fp16; the
interpreter's bf16 tl.dot is wrong). GPU (-m gpu): triton, cuda, cuda-wmma
with the real tiles, fp16 and bf16, plus every semantic rule of the decode
and write_kv_cache ops (negative slots, zero contexts, NaN-poisoned unused
pages and table entries, odd sizes, page sizes 1 and 256, Nq != Nk).
"""

from __future__ import annotations

import pytest
import torch

import minipaged as mp
from minipaged import registry
from minipaged.testing import (
    PrefillCase,
    VarlenCase,
    assert_close,
    assert_same_cache,
    decode_ref,
    gather_kv,
    make_prefill_inputs,
    make_varlen_inputs,
    make_write_inputs,
    paged_kv,
    prefill_ref,
    randn,
    slot_mapping,
    varlen_ref,
    visible_mask,
)

GPU = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="needs a CUDA device")]
GPU_BACKENDS = ["triton", "cuda", "cuda-wmma"]


def _cpu_backends():
    return [n for n in ("torch", "triton") if registry.all_backends()[n].is_available("cpu")[0]]


CPU_BACKENDS = _cpu_backends()
CPU_DTYPES = [torch.float32, torch.float16]
GPU_DTYPES = [torch.float16, torch.bfloat16]

# Key tiles of the CUDA kernels (csrc): prefill_wmma.cu kKvTile 16 with 32-row
# blocks; prefill_fast.cu on sm_90 wgmma 128x128 (large grids) or 64x64, mma.sync
# BLOCK_N 32/64 with BLOCK_M 64/128 elsewhere. 128 is a multiple of all of them.
_CUDA_TILES = {"cuda-wmma": (32, 16), "cuda": (128, 128)}


def _tiles(backend: str, head_dim: int, dtype, batch_heads: int, nq: int, device: str) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) the backend uses for this prefill (the largest when it picks by shape)."""
    if backend == "triton":
        from minipaged.triton.configs import prefill_config

        cfg = prefill_config(head_dim, dtype, True, batch_heads, nq, torch.device(device))
        return cfg.block_m, cfg.block_n
    if backend in _CUDA_TILES:
        return _CUDA_TILES[backend]
    return 16, 16  # torch has no tiles: sweep the interpreter's


def _sweep(block_m: int, block_n: int) -> list[tuple[int, int]]:
    """(Nq, Nk) with Nk - Nq taking every value 0..block_n and Nq every residue mod block_m
    (at least two full query tiles before the last, so some band ends before Nk)."""
    out = []
    for r in range(block_n + 1):
        nq = 2 * block_m + 1 + (r * 7 + 3) % block_m
        out.append((nq, nq + r))
    # the residues of Nq the diagonal sweep did not reach, at Nk - Nq = 1 (a one-key band tail)
    seen = {nq % block_m for nq, _ in out}
    for rm in range(block_m):
        if rm not in seen:
            nq = 2 * block_m + rm + (block_m if rm == 0 else 0)
            out.append((nq, nq + 1))
    return out


def _dense_case(backend, dtype, device, B, hq, hkv, D, nq, nk, causal, seed):
    q, k, v = make_prefill_inputs(PrefillCase(B, nq, nk, hq, hkv, D, causal), dtype, device, seed)
    out = mp.prefill_attention(q, k, v, causal=causal, backend=backend)
    truth, truth_lse = prefill_ref(q, k, v, causal=causal)
    # rows that see no key must be exact zeros: checked where truth_lse is -inf
    assert_close(out, truth, prefill_ref(q, k, v, causal=causal, lowp=True)[0],
                 f"{backend} {dtype} B{B} Hq{hq} Hkv{hkv} D{D} Nq{nq} Nk{nk} c{causal}", truth_lse=truth_lse)


def _varlen_case(backend, dtype, device, seqs, hq, hkv, D, causal, seed):
    case = VarlenCase(tuple(a for a, _ in seqs), tuple(b for _, b in seqs), hq, hkv, D, causal)
    q, k, v, cu_q, cu_k = make_varlen_inputs(case, dtype, device, seed)
    out = mp.prefill_attention_varlen(q, k, v, cu_q, cu_k, causal=causal, backend=backend)
    truth, truth_lse = varlen_ref(q, k, v, cu_q, cu_k, causal=causal)
    base, _ = varlen_ref(q, k, v, cu_q, cu_k, causal=causal, lowp=True)
    # per sequence, so a failure names the (Nq, Nk) that broke
    cq = cu_q.tolist()
    for s, (a, b) in enumerate(seqs):
        sl = slice(cq[s], cq[s + 1])
        assert_close(out[sl], truth[sl], base[sl], f"{backend} {dtype} varlen seq {s} Nq{a} Nk{b} c{causal}",
                     truth_lse=truth_lse[sl])


# --------------------------------------------------------------------------- CPU: causal tile sweep


def _cpu_params():
    return [pytest.param(b, dt, id=f"{b}-{str(dt)[6:]}") for b in CPU_BACKENDS for dt in CPU_DTYPES]


@pytest.mark.parametrize("backend,dtype", _cpu_params())
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_tile_sweep_cpu(backend, dtype, causal):
    D, hq, hkv = 64, 2, 1
    bm, bn = _tiles(backend, D, dtype, hq, 3 * 16, "cpu")
    for nq, nk in _sweep(bm, bn):
        _dense_case(backend, dtype, "cpu", 1, hq, hkv, D, nq, nk, causal, seed=nq * 131 + nk)


@pytest.mark.parametrize("backend,dtype", _cpu_params())
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_tile_sweep_cpu(backend, dtype, causal):
    D, hq, hkv = 64, 2, 1
    bm, bn = _tiles(backend, D, dtype, hq, 3 * 16, "cpu")
    seqs = _sweep(bm, bn)
    # Nq > Nk (leading rows see nothing), a sequence without keys, one without queries
    seqs += [(bm + 3, bm + 2), (2 * bm + 1, bm - 1), (bn + 5, 4), (7, 0), (0, 9)]
    _varlen_case(backend, dtype, "cpu", seqs, hq, hkv, D, causal, seed=len(seqs))


def test_sweep_hits_every_residue():
    # the sweep itself: a residue it skipped would let a band off-by-one through
    for bm, bn in ((16, 16), (32, 16), (64, 64), (128, 64), (128, 128)):
        pairs = _sweep(bm, bn)
        assert {(nk - nq) % bn for nq, nk in pairs} == set(range(bn))
        assert {nq % bm for nq, _ in pairs} == set(range(bm))
        assert all(nq > 2 * bm for nq, _ in pairs)


def test_oracle_mask_is_bottom_right():
    # the oracle's own mask, spelled out: row i of 3 sees keys j < 5 - 3 + i + 1
    m = visible_mask(3, 5, True)
    assert m.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert visible_mask(4, 2, True).tolist() == [[0, 0], [0, 0], [1, 0], [1, 1]]
    assert visible_mask(4, 2, True, row0=2, rows=2).tolist() == [[1, 0], [1, 1]]  # a chunk of rows
    # and its numbers: one key gives that key's value and lse = its score, no key gives zeros and -inf
    q = torch.randn(1, 2, 2, 64)
    k = torch.randn(1, 1, 1, 64)
    v = torch.randn(1, 1, 1, 64)
    o, lse = prefill_ref(q, k, v, causal=True)
    assert torch.equal(o[0, :, 0], torch.zeros(2, 64, dtype=torch.float64))
    assert torch.isneginf(lse[0, :, 0]).all()
    assert torch.allclose(o[0, :, 1], v[0, 0, 0].double().expand(2, 64))
    assert torch.allclose(lse[0, :, 1], (q[0, :, 1].double() @ k[0, 0, 0].double()) / 8)
    # GQA: query head h reads KV head h // (Hq // Hkv)
    q, k, v = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)
    o, _ = prefill_ref(q, k, v)
    assert torch.allclose(o[0, :, 0], v[0, [0, 0, 1, 1], 0].double())


# --------------------------------------------------------------------------- API rules no backend sees


def test_decode_rejects_context_lens_of_the_wrong_batch():
    q = torch.randn(3, 4, 64)
    kc = torch.randn(4, 16, 2, 64)
    tables = torch.zeros(3, 2, dtype=torch.int32)
    for n in (2, 4):
        with pytest.raises(ValueError, match=r"context_lens\.shape\[0\].*3"):
            mp.decode_attention(q, kc, kc.clone(), tables, torch.full((n,), 5, dtype=torch.int32), backend="torch")


def test_write_kv_cache_rejects_a_head_dim_mismatch():
    kc = torch.full((4, 16, 2, 128), float("nan"))
    k = torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match=r"head dim.*64.*128"):
        mp.write_kv_cache(k, k.clone(), kc, kc.clone(), torch.tensor([0, 1, 2]), backend="torch")
    assert torch.isnan(kc).all(), "a rejected write must not touch the cache"
    with pytest.raises(ValueError, match="KV heads"):
        mp.write_kv_cache(torch.randn(3, 4, 128), torch.randn(3, 4, 128), kc, kc.clone(),
                          torch.tensor([0, 1, 2]), backend="torch")


# --------------------------------------------------------------------------- paged inputs


def _decode_case(backend, dtype, device, lens, hq, hkv, D, page, seed, tail=-1):
    gen = torch.Generator().manual_seed(seed)
    # two pages nobody owns, every unowned slot NaN, `tail` past each row's pages
    kv = paged_kv(lens, hkv, D, page, dtype, device, gen=gen, spare_blocks=2, tail=tail)
    q = randn((len(lens), hq, D), dtype, device, gen)
    out = mp.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, backend=backend)
    # the oracle walks the pages itself (used entries only) and must find what was written
    keys, vals = gather_kv(kv.k_cache, kv.v_cache, kv.tables, lens)
    assert all(torch.equal(a, b) for a, b in zip(keys, kv.keys))
    truth, truth_lse = decode_ref(q, keys, vals)
    base, _ = decode_ref(q, keys, vals, lowp=True)
    for b, n in enumerate(lens):
        # context_len 0: exact zeros (truth_lse is -inf there)
        assert_close(out[b], truth[b], base[b], f"{backend} {dtype} decode seq {b} ctx {n} page {page} Hq{hq} "
                     f"Hkv{hkv} D{D}", truth_lse=truth_lse[b])


def _write_case(backend, dtype, device, T, hkv, D, page, slot_dtype, seed):
    """Scatter T tokens to shuffled slots of a NaN cache, about a quarter skipped with
    negative slots (-1 and other negatives); every other slot must stay NaN."""
    k, v, kc, vc, slots, want_k, want_v = make_write_inputs(T, hkv, D, -(-T // page) + 2, page, dtype, device,
                                                            seed=seed)
    mp.write_kv_cache(k, v, kc, vc, slots.to(slot_dtype), backend=backend)
    assert_same_cache(kc, want_k, f"{backend}: k_cache")
    assert_same_cache(vc, want_v, f"{backend}: v_cache")


# --------------------------------------------------------------------------- CPU: semantic rules, small


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("page", [1, 16, 256])
def test_decode_rules_cpu(backend, page):
    _decode_case(backend, torch.float16, "cpu", [17, 0, 97, 1, 0], 4, 2, 64, page, seed=page)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("page", [1, 16, 256])
def test_write_kv_cache_rules_cpu(backend, page):
    _write_case(backend, torch.float16, "cpu", 97, 2, 64, page, torch.int32, seed=page)


# --------------------------------------------------------------------------- GPU: causal tile sweep

# (B, Hq, Hkv, D): a small grid (triton halves BLOCK_M to 64, cuda takes the 64x64
# wgmma tile) and a large one (triton 128x64, cuda the 128x128 wgmma tile)
GPU_SWEEP_SHAPES = [(1, 4, 2, 64), (2, 48, 8, 128)]
GPU_SWEEP_M = GPU_SWEEP_N = 128


def _gpu_params(backends=GPU_BACKENDS, dtypes=GPU_DTYPES):
    return [pytest.param(b, dt, id=f"{b}-{str(dt)[6:]}", marks=gpu) for b in backends for dt in dtypes]


def _check_gpu_tiles(backend, D, dtype, batch_heads, nq):
    bm, bn = _tiles(backend, D, dtype, batch_heads, nq, "cuda")
    assert GPU_SWEEP_N % bn == 0 and bm <= GPU_SWEEP_M, (
        f"{backend} tiles {bm}x{bn} are outside what the sweep covers; widen GPU_SWEEP_M/N")


@pytest.mark.parametrize("backend,dtype", _gpu_params())
@pytest.mark.parametrize("shape", GPU_SWEEP_SHAPES, ids=lambda s: "B{}-Hq{}-Hkv{}-D{}".format(*s))
def test_prefill_tile_sweep_gpu(backend, dtype, shape):
    B, hq, hkv, D = shape
    for nq, nk in _sweep(GPU_SWEEP_M, GPU_SWEEP_N):
        _check_gpu_tiles(backend, D, dtype, B * hq, nq)
        _dense_case(backend, dtype, "cuda", B, hq, hkv, D, nq, nk, True, seed=nq * 131 + nk)
    for nq, nk in _sweep(GPU_SWEEP_M, GPU_SWEEP_N)[::9]:
        _dense_case(backend, dtype, "cuda", B, hq, hkv, D, nq, nk, False, seed=nq + nk)


@pytest.mark.parametrize("backend,dtype", _gpu_params())
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_tile_sweep_gpu(backend, dtype, causal):
    seqs = _sweep(GPU_SWEEP_M, GPU_SWEEP_N)
    seqs += [(200, 130), (257, 127), (129, 1), (33, 0), (0, 50), (1023, 1023), (97, 1500)]
    _varlen_case(backend, dtype, "cuda", seqs, 8, 2, 128, causal, seed=7)


@pytest.mark.parametrize("backend,dtype", _gpu_params(["triton"], [torch.float32]))
def test_prefill_tile_sweep_gpu_fp32(backend, dtype):
    # fp32 has its own triton tiles (64x64 at D 64, 64x32 at D 128) and a tight bound
    for D in (64, 128):
        for nq, nk in _sweep(64, 64):
            _dense_case(backend, dtype, "cuda", 1, 4, 2, D, nq, nk, True, seed=nq + nk + D)


# --------------------------------------------------------------------------- GPU: semantic rules

GPU_PREFILL_SIZES = [(17, 17), (97, 97), (1023, 1023), (17, 97), (97, 1023), (1023, 97), (97, 17), (1, 1023)]


@pytest.mark.parametrize("backend,dtype", _gpu_params())
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (16, 1)], ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
def test_prefill_odd_sizes_gpu(backend, dtype, causal, heads):
    for D in (64, 128):
        for nq, nk in GPU_PREFILL_SIZES:
            _dense_case(backend, dtype, "cuda", 2, heads[0], heads[1], D, nq, nk, causal, seed=nq + 3 * nk + D)


@pytest.mark.parametrize("backend,dtype", _gpu_params())
@pytest.mark.parametrize("page", [1, 16, 256])
@pytest.mark.parametrize("heads", [(8, 8), (16, 8), (32, 8), (16, 2), (16, 1)], ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
def test_decode_rules_gpu(backend, dtype, page, heads):
    lens = [17, 0, 97, 1023, 1, 0, 256, 257, 4000]
    for D in (64, 128):
        _decode_case(backend, dtype, "cuda", lens, heads[0], heads[1], D, page, seed=page + D + heads[0])


@pytest.mark.parametrize("backend,dtype", _gpu_params())
@pytest.mark.parametrize("page", [1, 16, 256])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_cache_rules_gpu(backend, dtype, page, slot_dtype):
    for T, hkv, D in ((17, 1, 64), (97, 2, 128), (1023, 8, 128)):
        _write_case(backend, dtype, "cuda", T, hkv, D, page, slot_dtype, seed=T + page)


@pytest.mark.parametrize("backend,dtype", _gpu_params())
def test_write_then_decode_gpu(backend, dtype):
    """K/V written by the backend's write_kv_cache, read by its decode, against the fp64 oracle."""
    gen = torch.Generator().manual_seed(11)
    lens, page, hq, hkv, D = [97, 0, 1023, 17], 16, 16, 2, 128
    kv = paged_kv(lens, hkv, D, page, dtype, "cuda", gen=gen, spare_blocks=2)
    kc, vc = torch.full_like(kv.k_cache, float("nan")), torch.full_like(kv.v_cache, float("nan"))
    mp.write_kv_cache(torch.cat(kv.keys), torch.cat(kv.vals), kc, vc, slot_mapping(kv.tables, lens, page).cuda(),
                      backend=backend)
    q = randn((len(lens), hq, D), dtype, "cuda", gen)
    out = mp.decode_attention(q, kc, vc, kv.block_tables, kv.context_lens, backend=backend)
    truth, truth_lse = decode_ref(q, kv.keys, kv.vals)
    assert_close(out, truth, decode_ref(q, kv.keys, kv.vals, lowp=True)[0], f"{backend} write+decode",
                 truth_lse=truth_lse)


def test_backends_scale_is_used_cpu():
    # a non-default scale must reach every CPU backend, not only its default 1/sqrt(D)
    q, k, v = make_prefill_inputs(PrefillCase(1, 19, 19, 2, 2, 64), torch.float32, "cpu", seed=5)
    for backend in CPU_BACKENDS:
        out = mp.prefill_attention(q, k, v, scale=0.3, backend=backend)
        assert_close(out, prefill_ref(q, k, v, scale=0.3)[0], prefill_ref(q, k, v, scale=0.3, lowp=True)[0],
                     f"{backend} scale 0.3")


# Last in the file: a kernel that follows such an entry faults and takes the CUDA context with it.
@pytest.mark.parametrize("backend,dtype", _gpu_params(dtypes=[torch.float16]))
@pytest.mark.parametrize("tail", [2**31 - 1, -(2**31)])
def test_decode_never_follows_unused_table_entries_gpu(backend, dtype, tail):
    # DESIGN: entries past ceil(context_len / block_size) "may hold anything"
    _decode_case(backend, dtype, "cuda", [17, 0, 1023, 5, 300], 16, 2, 128, 16, seed=3, tail=tail)
    torch.cuda.synchronize()
