"""FLOP and byte counts for the benchmarked ops, written once and used everywhere.

Prefill uses *exact causal FLOPs*, the one definition every table, plot and
the README use: the two matmuls (QK^T and PV, 2 FLOPs per multiply-add each,
so 4*D per pair) over exactly the (query, key) pairs the mask keeps; masked
pairs, softmax and scaling are not counted. A kernel that skips masked tiles
is credited only for the pairs it had to compute.
Decode is memory-bound, so its figure of merit is bytes: the K and V rows a
sequence really has (its context length), plus q read and o written.
Paged attention (any q_len per sequence over a paged cache) is counted the same
way per sequence: exact causal FLOPs of its (q_len, context_len) pair, and the
bytes of its context's K and V plus its q rows read and o rows written.
An FP8 (float8_e4m3fn) cache is counted at what is really read: 1 byte per cached
K/V element (kv_elem_bytes=1), q and o at their own 16-bit size; the per-KV-head
float32 scales (8 bytes per KV head per call) are left out.
"""

from __future__ import annotations

from typing import Iterable


def visible_pairs(num_queries: int, num_keys: int, causal: bool) -> int:
    """Number of (query row, key) pairs that are not masked for one (batch, head).

    Causal is bottom-right aligned (DESIGN.md): row i sees key j iff
    j < num_keys - num_queries + i + 1, so row i sees
    clamp(num_keys - num_queries + i + 1, 0, num_keys) keys.
    """
    if num_queries < 0 or num_keys < 0:
        raise ValueError(f"lengths must be >= 0, got Nq={num_queries}, Nk={num_keys}")
    if not causal:
        return num_queries * num_keys
    offset = num_keys - num_queries
    # Row i sees offset + i + 1 keys (never more than Nk, since i < Nq), or none
    # while that is <= 0: an arithmetic series from the first row that sees a key.
    first_row = max(0, -offset)
    rows = num_queries - first_row
    if rows <= 0:
        return 0
    lo = offset + first_row + 1
    hi = num_keys
    return (lo + hi) * rows // 2


def prefill_flops(batch: int, num_q_heads: int, num_queries: int, num_keys: int,
                  head_dim: int, causal: bool = True) -> int:
    """Matmul FLOPs of attention forward: 2 matmuls x 2 FLOPs x D per visible pair."""
    return 4 * batch * num_q_heads * head_dim * visible_pairs(num_queries, num_keys, causal)


def decode_bytes(num_q_heads: int, num_kv_heads: int, head_dim: int,
                 context_lens: Iterable[int], elem_bytes: int, kv_elem_bytes: int | None = None) -> int:
    """Bytes a paged decode step must move: K and V of every cached token each
    sequence really has, q read once and o written once (block tables ignored).
    elem_bytes: q/o element size; kv_elem_bytes: cache element size (None: elem_bytes)."""
    lens = [int(x) for x in context_lens]
    batch = len(lens)
    kv_es = elem_bytes if kv_elem_bytes is None else kv_elem_bytes
    kv = 2 * num_kv_heads * head_dim * kv_es * sum(lens)
    q_and_o = 2 * batch * num_q_heads * head_dim * elem_bytes
    return kv + q_and_o


def decode_flops(num_q_heads: int, head_dim: int, context_lens: Iterable[int]) -> int:
    """Matmul FLOPs of one decode step (reported for reference; decode is bandwidth-bound)."""
    return 4 * num_q_heads * head_dim * sum(int(x) for x in context_lens)


def paged_flops(num_q_heads: int, head_dim: int, q_lens: Iterable[int],
                context_lens: Iterable[int], causal: bool = True) -> int:
    """Matmul FLOPs of one paged_attention call: per sequence, 4*D per visible pair of
    its q_len new rows against its whole context (new tokens included, bottom-right causal)."""
    pairs = sum(visible_pairs(int(nq), int(nk), causal) for nq, nk in zip(q_lens, context_lens, strict=True))
    return 4 * num_q_heads * head_dim * pairs


def paged_bytes(num_q_heads: int, num_kv_heads: int, head_dim: int, q_lens: Iterable[int],
                context_lens: Iterable[int], elem_bytes: int, kv_elem_bytes: int | None = None) -> int:
    """Bytes one paged_attention call must move: K and V of every context token once,
    each query row read once and each output row written once (tables ignored).
    kv_elem_bytes: cache element size (None: elem_bytes, the q/o size)."""
    q_lens, context_lens = [int(x) for x in q_lens], [int(x) for x in context_lens]
    if len(q_lens) != len(context_lens):
        raise ValueError(f"{len(q_lens)} q_lens but {len(context_lens)} context_lens")
    kv_es = elem_bytes if kv_elem_bytes is None else kv_elem_bytes
    kv = 2 * num_kv_heads * head_dim * kv_es * sum(context_lens)
    q_and_o = 2 * num_q_heads * head_dim * elem_bytes * sum(q_lens)
    return kv + q_and_o


def copy_bytes(num_bytes: int) -> int:
    """A device-to-device copy of num_bytes reads and writes each byte once."""
    return 2 * num_bytes
