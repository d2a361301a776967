"""The `torch` backend: plain PyTorch with fp32 softmax. It is the oracle.

Vectorised over heads and tokens; the only Python loop is over the sequences
of a varlen or paged batch, so it also serves the engine on CPU at small sizes.
Arguments arrive already checked by `minipaged.api`.
"""

from __future__ import annotations

import torch

from .registry import BackendOps

_NEG_INF = float("-inf")


def _softmax_av(scores: torch.Tensor, visible: torch.Tensor, v: torch.Tensor, eq: str):
    """Masked fp32 softmax of `scores` times v (einsum `eq`); returns (o fp32, lse fp32 [..., rows]).

    A row with no visible key would be softmax(all -inf) = NaN; DESIGN wants
    exact zeros (and lse -inf), so it gets a finite max and zero weights instead.
    """
    scores = scores.masked_fill(~visible, _NEG_INF)
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.einsum(eq, p, v)
    out = torch.where(denom > 0, out / denom.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(out))
    lse = torch.where(denom > 0, row_max + torch.log(denom), torch.full_like(denom, _NEG_INF)).squeeze(-1)
    return out, lse


def _bottom_right(nq: int, nk: int, device) -> torch.Tensor:
    """[nq, nk] bool: row i sees key j iff j < nk - nq + i + 1."""
    rows = torch.arange(nq, device=device).unsqueeze(1)
    cols = torch.arange(nk, device=device).unsqueeze(0)
    return cols <= rows + (nk - nq)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D] -> (o fp32 [B, Hq, Nq, D], lse fp32 [B, Hq, Nq]).

    GQA without repeating K/V: query heads are viewed as [Hkv, group] so that
    head h meets KV head h // group, exactly as the kernels index it.
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    if Nk == 0:
        return (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
                torch.full((B, Hq, Nq), _NEG_INF, dtype=torch.float32, device=q.device))
    qf = q.float().reshape(B, Hkv, group, Nq, D)
    scores = torch.einsum("bhgqd,bhkd->bhgqk", qf, k.float()) * scale
    if causal:
        visible = _bottom_right(Nq, Nk, q.device)
    else:
        visible = torch.ones(Nq, Nk, dtype=torch.bool, device=q.device)
    out, lse = _softmax_av(scores, visible, v.float(), "bhgqk,bhkd->bhgqd")
    return out.reshape(B, Hq, Nq, D), lse.reshape(B, Hq, Nq)


def _result(o: torch.Tensor, lse: torch.Tensor, return_lse: bool):
    return (o, lse) if return_lse else o


def prefill(q, k, v, causal, scale, return_lse=False):
    """q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D] -> o [B, Hq, Nq, D] (dtype of q), lse [B, Hq, Nq]."""
    o, lse = _attend(q, k, v, causal, scale)
    return _result(o.to(q.dtype), lse, return_lse)


def prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, return_lse=False):
    """q [Tq, Hq, D], k/v [Tk, Hkv, D], cu_seqlens_* int32 [S+1] -> o [Tq, Hq, D], lse [Tq, Hq]."""
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:2], _NEG_INF, dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[s], cq[s + 1], ck[s], ck[s + 1]
        if q1 == q0:
            continue
        # [n, H, D] -> [1, H, n, D]
        qs = q[q0:q1].transpose(0, 1).unsqueeze(0)
        ks = k[k0:k1].transpose(0, 1).unsqueeze(0)
        vs = v[k0:k1].transpose(0, 1).unsqueeze(0)
        o_s, lse_s = _attend(qs, ks, vs, causal, scale)
        out[q0:q1] = o_s[0].transpose(0, 1).to(q.dtype)
        lse[q0:q1] = lse_s[0].transpose(0, 1)
    return _result(out, lse, return_lse)


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _dequant(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """fp32 values of cache rows [..., Hkv, D]: exact, times the per-KV-head scale [Hkv] for fp8."""
    x = x.float()
    return x if scale is None else x * scale[:, None]


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[T, Hkv, D] -> float8_e4m3fn: x / scale[h], saturated at +-448, rounded to nearest even."""
    return torch.clamp(x.float() / scale[:, None], -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _gather(cache: torch.Tensor, table_row: torch.Tensor, n: int, scale: torch.Tensor | None) -> torch.Tensor:
    """The first n tokens of one sequence, [n, Hkv, D] fp32, read through its table row.
    Only the first ceil(n / block_size) entries are touched (the rest may hold -1)."""
    block_size = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    blocks = table_row[: -(-n // block_size)].long()[pos // block_size]
    return _dequant(cache[blocks, pos % block_size], scale)


def paged(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, causal, scale,
          return_lse=False, k_scale=None, v_scale=None):
    """q [Tq, Hq, D] (S sequences packed by cu_seqlens_q int32 [S+1]); caches
    [num_blocks, block_size, Hkv, D]; block_tables int32 [S, max_blocks]; context_lens int32 [S]
    (whole KV length, new tokens included) -> o [Tq, Hq, D], lse [Tq, Hq].

    Row i of sequence s (q_len rows) sees key j iff j < context_len - q_len + i + 1 (causal)."""
    Tq, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((Tq, Hq), _NEG_INF, dtype=torch.float32, device=q.device)
    cq, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for s, n in enumerate(lens):
        q0, q1 = cq[s], cq[s + 1]
        nq = q1 - q0
        if nq == 0 or n == 0:
            continue
        k = _gather(k_cache, block_tables[s], n, k_scale)  # [n, Hkv, D]
        v = _gather(v_cache, block_tables[s], n, v_scale)
        qf = q[q0:q1].float().reshape(nq, Hkv, group, D)
        scores = torch.einsum("qhgd,khd->hgqk", qf, k) * scale
        visible = _bottom_right(nq, n, q.device) if causal else torch.ones(nq, n, dtype=torch.bool, device=q.device)
        o_s, lse_s = _softmax_av(scores, visible, v, "hgqk,khd->hgqd")
        out[q0:q1] = o_s.permute(2, 0, 1, 3).reshape(nq, Hq, D).to(q.dtype)
        lse[q0:q1] = lse_s.permute(2, 0, 1).reshape(nq, Hq)
    return _result(out, lse, return_lse)


# Gathered K elements per pass of decode: a batch whose padded [B, max_len, Hkv, D] gather would
# pass it runs in runs of whole sequences, each padded to its own longest, so that one long
# sequence among many short ones (a GPU test's wide table) does not need tens of GB.
_DECODE_GATHER_ELEMENTS = 1 << 27


def decode(q, k_cache, v_cache, block_tables, context_lens, scale, return_lse=False, k_scale=None, v_scale=None):
    """q [B, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_tables int32
    [B, max_blocks]; context_lens int32 [B] -> o [B, Hq, D], lse [B, Hq].

    Vectorised over the batch (one gather of every sequence's pages, masked), in runs of
    sequences where one gather would exceed _DECODE_GATHER_ELEMENTS."""
    B, Hq, D = q.shape
    row = k_cache.shape[2] * D
    lens = context_lens.tolist()
    max_len = max(lens, default=0)
    if B * max_len * row <= _DECODE_GATHER_ELEMENTS:
        return _decode_rows(q, k_cache, v_cache, block_tables, context_lens, max_len, scale, return_lse, k_scale,
                            v_scale)
    outs, lses = [], []
    start = 0
    while start < B:
        end, longest = start + 1, lens[start]
        while end < B and (end + 1 - start) * max(longest, lens[end]) * row <= _DECODE_GATHER_ELEMENTS:
            longest = max(longest, lens[end])
            end += 1
        o, lse = _decode_rows(q[start:end], k_cache, v_cache, block_tables[start:end], context_lens[start:end],
                              longest, scale, True, k_scale, v_scale)
        outs.append(o)
        lses.append(lse)
        start = end
    return _result(torch.cat(outs), torch.cat(lses), return_lse)


def _decode_rows(q, k_cache, v_cache, block_tables, context_lens, max_len, scale, return_lse, k_scale, v_scale):
    B, Hq, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    if max_len == 0:
        return _result(torch.zeros_like(q), torch.full((B, Hq), _NEG_INF, dtype=torch.float32, device=q.device),
                       return_lse)
    pos = torch.arange(max_len, device=q.device)
    valid = pos.unsqueeze(0) < context_lens.unsqueeze(1).long()  # [B, L]
    # Entries past a sequence's own length may hold anything (e.g. -1): never
    # follow them, point the gather at block 0 and mask the result instead.
    blk = block_tables.long()[:, pos // block_size]
    blk = torch.where(valid, blk, torch.zeros_like(blk))
    off = (pos % block_size).unsqueeze(0).expand(B, -1)
    k = _dequant(k_cache[blk, off], k_scale)  # [B, L, Hkv, D]
    # masked_fill(0) stops NaN in unread cache slots leaking through 0 * NaN
    v = _dequant(v_cache[blk, off], v_scale).masked_fill(~valid[:, :, None, None], 0.0)
    qf = q.float().reshape(B, Hkv, Hq // Hkv, D)
    scores = torch.einsum("bhgd,blhd->bhgl", qf, k) * scale
    out, lse = _softmax_av(scores, valid[:, None, None, :], v, "bhgl,blhd->bhgd")
    return _result(out.reshape(B, Hq, D).to(q.dtype), lse.reshape(B, Hq), return_lse)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """k/v [T, Hkv, D] -> k_cache/v_cache [num_blocks, block_size, Hkv, D] at
    slot = block * block_size + offset; a negative slot skips its token. An fp8 cache
    stores k / k_scale[h] (v / v_scale[h]) saturated and rounded to nearest even."""
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    keep = slots >= 0
    slots = slots[keep]
    blk, off = slots // block_size, slots % block_size
    if k_scale is not None:
        k_cache[blk, off] = quantize_fp8(k[keep], k_scale)
        v_cache[blk, off] = quantize_fp8(v[keep], v_scale)
    else:
        k_cache[blk, off] = k[keep].to(k_cache.dtype)
        v_cache[blk, off] = v[keep].to(v_cache.dtype)


def merge_attention_states(o_a, lse_a, o_b, lse_b):
    """o_* [..., Hq, D], lse_* fp32 [..., Hq] over disjoint key sets -> (o, lse) of their union.
    Rows where both sides saw no key (both lse -inf) give zeros and -inf, never NaN."""
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(lse)
    # exp(lse_a - lse) = sigmoid(lse_a - lse_b): from the difference of the inputs, not from the
    # rounded lse, whose fp32 ulp (|lse| * 2^-24) would become a relative error of the weights
    # (where both are -inf, d is NaN: the weights there are set to 0)
    d = lse_a - lse_b
    w_a = torch.where(finite, torch.sigmoid(d), torch.zeros_like(lse)).unsqueeze(-1)
    w_b = torch.where(finite, torch.sigmoid(-d), torch.zeros_like(lse)).unsqueeze(-1)
    # a side of weight 0 (it saw no key) contributes exactly 0 whatever its o holds: an
    # uninitialised or NaN-poisoned row must not turn 0 * NaN into the output
    o = torch.where(w_a > 0, w_a * o_a.float(), 0.0) + torch.where(w_b > 0, w_b * o_b.float(), 0.0)
    return o.to(o_a.dtype), lse


OPS = BackendOps(
    prefill=prefill,
    prefill_varlen=prefill_varlen,
    decode=decode,
    paged=paged,
    write_kv_cache=write_kv_cache,
    merge_attention_states=merge_attention_states,
)
