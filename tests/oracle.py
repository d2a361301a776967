"""An fp64 attention oracle written independently of minipaged.reference.

Nothing here imports minipaged: the mask, the GQA head mapping, the
"no visible key gives zeros" rule and the paged gather are re-derived from
DESIGN.md, so that a bug in the library's torch backend cannot hide itself by
also being the yardstick (it is judged by this file too).

The error bound follows FlashAttention's tests: a kernel may be off from the
fp64 truth by a small multiple of what the same attention computed plainly in
the low precision is off, plus a small absolute floor. The multiple is taken
of the low-precision error, never of a difference between two library
backends, so a wrong oracle cannot widen its own bound.
"""

from __future__ import annotations

import math

import torch

# How many times the plain low-precision error a kernel may make, and the floor
# under it (tile-order summation and a final rounding to the output dtype).
ERR_FACTOR = 2.0
ERR_FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}


def visible_mask(nq: int, nk: int, causal: bool, device=None) -> torch.Tensor:
    """bool [nq, nk]: query row i sees key j iff j < nk - nq + i + 1 (bottom-right causal)."""
    i = torch.arange(nq, device=device).view(nq, 1)
    j = torch.arange(nk, device=device).view(1, nk)
    if not causal:
        return torch.ones(nq, nk, dtype=torch.bool, device=device)
    return j < (nk - nq) + i + 1


def _kv_for_heads(x: torch.Tensor, hq: int) -> torch.Tensor:
    """[B, Hkv, N, D] -> [B, Hq, N, D]: query head h reads KV head h // (Hq // Hkv)."""
    hkv = x.shape[1]
    assert hq % hkv == 0
    idx = torch.tensor([h // (hq // hkv) for h in range(hq)], device=x.device)
    return x.index_select(1, idx)


def attention_fp64(q, k, v, causal: bool, scale: float | None = None) -> torch.Tensor:
    """q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D] (any dtype) -> float64 [B, Hq, Nq, D]."""
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    qd = q.detach().to(torch.float64)
    kd = _kv_for_heads(k.detach().to(torch.float64), Hq)
    vd = _kv_for_heads(v.detach().to(torch.float64), Hq)
    out = torch.zeros(B, Hq, Nq, D, dtype=torch.float64, device=q.device)
    if Nq == 0 or Nk == 0:
        return out
    seen = visible_mask(Nq, Nk, causal, q.device)
    s = torch.einsum("bhid,bhjd->bhij", qd, kd) * scale
    s = torch.where(seen, s, torch.full_like(s, -math.inf))
    has_key = seen.any(dim=1)  # [Nq]
    # rows with a key: the usual max-shifted softmax; rows without: zeros
    m = torch.where(has_key.view(1, 1, Nq, 1), s.amax(-1, keepdim=True), torch.zeros_like(s[..., :1]))
    w = torch.exp(s - m)  # exp(-inf) = 0 for hidden keys
    z = w.sum(-1, keepdim=True)
    out = torch.einsum("bhij,bhjd->bhid", w, vd) / torch.where(z > 0, z, torch.ones_like(z))
    return out


def attention_lowp(q, k, v, causal: bool, scale: float | None = None) -> torch.Tensor:
    """The same attention as a plain PyTorch user would write it in q's dtype:
    matmuls in that dtype, softmax in fp32, P rounded to the dtype. float64 out."""
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    dt = q.dtype
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if Nq == 0 or Nk == 0:
        return torch.zeros(B, Hq, Nq, D, dtype=torch.float64, device=q.device)
    kk, vv = _kv_for_heads(k, Hq), _kv_for_heads(v, Hq)
    s = torch.matmul(q, kk.transpose(-1, -2)).float() * scale
    s = s.masked_fill(~visible_mask(Nq, Nk, causal, q.device), -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0).to(dt)
    return torch.matmul(p, vv).to(torch.float64)


def check(out, truth, lowp, what: str = "", factor: float = ERR_FACTOR, floor: float | None = None) -> float:
    """max|out - truth| <= factor * max|lowp - truth| + floor; NaN/inf anywhere fails. Returns the error."""
    assert torch.isfinite(out).all(), f"{what}: non-finite output ({int((~torch.isfinite(out)).sum())} elements)"
    assert out.shape == truth.shape, f"{what}: shape {tuple(out.shape)} != {tuple(truth.shape)}"
    if out.numel() == 0:
        return 0.0
    floor = ERR_FLOOR[out.dtype] if floor is None else floor
    o = out.to(torch.float64)
    t = truth.to(device=o.device, dtype=torch.float64)
    err = (o - t).abs().max().item()
    base = (lowp.to(device=o.device, dtype=torch.float64) - t).abs().max().item()
    bound = factor * base + floor
    assert err <= bound, f"{what}: max err {err:.3e} > bound {bound:.3e} (low-precision error {base:.3e})"
    return err


# --------------------------------------------------------------------------- packed / paged layouts


def split_varlen(x: torch.Tensor, cu: list[int], s: int) -> torch.Tensor:
    """Sequence s of a packed [T, H, D] tensor as dense [1, H, n, D]."""
    return x[cu[s]: cu[s + 1]].permute(1, 0, 2).unsqueeze(0)


def varlen_fp64(q, k, v, cu_q: list[int], cu_k: list[int], causal: bool, scale=None, lowp: bool = False):
    """Per-sequence oracle of a packed batch -> float64 [Tq, Hq, D]."""
    fn = attention_lowp if lowp else attention_fp64
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for s in range(len(cu_q) - 1):
        if cu_q[s + 1] == cu_q[s]:
            continue
        o = fn(split_varlen(q, cu_q, s), split_varlen(k, cu_k, s), split_varlen(v, cu_k, s), causal, scale)
        out[cu_q[s]: cu_q[s + 1]] = o[0].permute(1, 0, 2)
    return out


def gather_pages(cache: torch.Tensor, table_row: list[int], n: int) -> torch.Tensor:
    """Token t of a sequence lives at page table_row[t // page], offset t % page.
    cache [num_blocks, page, Hkv, D] -> [1, Hkv, n, D]."""
    page = cache.shape[1]
    blk = torch.tensor([table_row[t // page] for t in range(n)], dtype=torch.long, device=cache.device)
    off = torch.tensor([t % page for t in range(n)], dtype=torch.long, device=cache.device)
    return cache[blk, off].permute(1, 0, 2).unsqueeze(0)


def decode_fp64(q, k_cache, v_cache, tables: list[list[int]], lens: list[int], scale=None, lowp: bool = False):
    """q [B, Hq, D] against paged caches -> float64 [B, Hq, D]."""
    fn = attention_lowp if lowp else attention_fp64
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b, n in enumerate(lens):
        kd, vd = gather_pages(k_cache, tables[b], n), gather_pages(v_cache, tables[b], n)
        out[b] = fn(q[b: b + 1].unsqueeze(2), kd, vd, False, scale)[0, :, 0]
    return out
