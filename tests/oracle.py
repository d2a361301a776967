"""The fp64 oracle for test files written against the old tests/oracle.py
(test_transformers_integration.py): thin wrappers over minipaged.testing, which
holds the one oracle and the one error bound."""

from __future__ import annotations

from minipaged.testing import ERR_FACTOR, ERR_FLOOR, assert_close, prefill_ref, visible_mask

__all__ = ["ERR_FACTOR", "ERR_FLOOR", "attention_fp64", "attention_lowp", "check", "visible_mask"]


def attention_fp64(q, k, v, causal: bool, scale: float | None = None):
    """q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D] -> float64 o [B, Hq, Nq, D]."""
    return prefill_ref(q, k, v, causal=causal, scale=scale)[0]


def attention_lowp(q, k, v, causal: bool, scale: float | None = None):
    return prefill_ref(q, k, v, causal=causal, scale=scale, lowp=True)[0]


def check(out, truth, lowp, what: str = "", factor: float = ERR_FACTOR, floor: float | None = None) -> float:
    return assert_close(out, truth, lowp, what, factor=factor, floor=floor)
