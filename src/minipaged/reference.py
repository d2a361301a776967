"""The `torch` backend: plain PyTorch with fp32 softmax. It is the oracle.

Vectorised over heads and tokens; the only Python loop is over the sequences
of a varlen batch, so it also serves the engine on CPU at small sizes.
Arguments arrive already checked by `minipaged.api`.
"""

from __future__ import annotations

import torch


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D] -> fp32 [B, Hq, Nq, D].

    GQA without repeating K/V: query heads are viewed as [Hkv, group] so that
    head h meets KV head h // group, exactly as the kernels index it.
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    if Nk == 0:
        return torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qf = q.float().reshape(B, Hkv, group, Nq, D)
    kf, vf = k.float(), v.float()
    scores = torch.einsum("bhgqd,bhkd->bhgqk", qf, kf) * scale
    if causal:
        # bottom-right alignment: row i sees key j iff j < Nk - Nq + i + 1
        rows = torch.arange(Nq, device=q.device).unsqueeze(1)
        cols = torch.arange(Nk, device=q.device).unsqueeze(0)
        visible = cols <= rows + (Nk - Nq)
    else:
        visible = torch.ones(Nq, Nk, dtype=torch.bool, device=q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    # A row with no visible key would be softmax(all -inf) = NaN; DESIGN wants
    # exact zeros, so give it a finite max and zero weights instead.
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("bhgqk,bhkd->bhgqd", p, vf)
    out = torch.where(denom > 0, out / denom.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(out))
    return out.reshape(B, Hq, Nq, D)


def prefill(q, k, v, causal, scale):
    """q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D] -> o [B, Hq, Nq, D] (dtype of q)."""
    return _attend(q, k, v, causal, scale).to(q.dtype)


def prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale):
    """q [Tq, Hq, D], k/v [Tk, Hkv, D], cu_seqlens_* int32 [S+1] -> o [Tq, Hq, D]."""
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    for s in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[s], cq[s + 1], ck[s], ck[s + 1]
        if q1 == q0:
            continue
        # [n, H, D] -> [1, H, n, D]
        qs = q[q0:q1].transpose(0, 1).unsqueeze(0)
        ks = k[k0:k1].transpose(0, 1).unsqueeze(0)
        vs = v[k0:k1].transpose(0, 1).unsqueeze(0)
        out[q0:q1] = _attend(qs, ks, vs, causal, scale)[0].transpose(0, 1).to(q.dtype)
    return out


def decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """q [B, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_tables int32
    [B, max_blocks]; context_lens int32 [B] -> o [B, Hq, D]."""
    B, Hq, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    max_len = int(context_lens.max().item()) if B > 0 else 0
    if max_len == 0:
        return torch.zeros_like(q)
    pos = torch.arange(max_len, device=q.device)
    valid = pos.unsqueeze(0) < context_lens.unsqueeze(1).long()  # [B, L]
    # Entries past a sequence's own length may hold anything (e.g. -1): never
    # follow them, point the gather at block 0 and mask the result instead.
    blk = block_tables.long()[:, pos // block_size]
    blk = torch.where(valid, blk, torch.zeros_like(blk))
    off = (pos % block_size).unsqueeze(0).expand(B, -1)
    k = k_cache[blk, off].float()  # [B, L, Hkv, D]
    v = v_cache[blk, off].float()
    group = Hq // Hkv
    qf = q.float().reshape(B, Hkv, group, D)
    scores = torch.einsum("bhgd,blhd->bhgl", qf, k) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    # masked_fill(0) also stops NaN in unread cache slots leaking through 0 * NaN
    v = v.masked_fill(~valid[:, :, None, None], 0.0)
    out = torch.einsum("bhgl,blhd->bhgd", p, v)
    out = torch.where(denom > 0, out / denom.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(out))
    return out.reshape(B, Hq, D).to(q.dtype)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping):
    """k/v [T, Hkv, D] -> k_cache/v_cache [num_blocks, block_size, Hkv, D] at
    slot = block * block_size + offset; a negative slot skips its token."""
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    keep = slots >= 0
    slots = slots[keep]
    blk, off = slots // block_size, slots % block_size
    k_cache[blk, off] = k[keep].to(k_cache.dtype)
    v_cache[blk, off] = v[keep].to(v_cache.dtype)
