"""FP8 (float8_e4m3fn) attention problems shared by test_cuda_fp8.py and test_triton_fp8.py:
real-valued K/V quantised into NaN-poisoned fp8 paged caches through shuffled block tables,
with the K/V the oracle must see, dequantised exactly from the cache's own bytes.

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
