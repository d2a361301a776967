"""Greedy and temperature / top-k / top-p sampling over a batch of last-token logits."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..api import integer_number, real_number


def check_sampling(temperature: Any, top_p: Any, top_k: Any = 0) -> tuple[float, float, int]:
    """temperature a finite float >= 0 (0: greedy), top_p a float in (0, 1], top_k an int >= 0
    (0: no cut). NaN and inf are rejected here because on CUDA they would reach torch.multinomial
    as a device-side assert."""
    for name, val in (("temperature", temperature), ("top_p", top_p)):
        if not real_number(val):
            raise TypeError(f"{name} must be a float, got {type(val).__name__}")
    if not integer_number(top_k):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite float >= 0 (0 is greedy), got {temperature}")
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 keeps every token), got {top_k}")
    return float(temperature), float(top_p), int(top_k)


def sample(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    generators: list[torch.Generator] | None = None,
) -> torch.Tensor:
    """logits [B, V] -> token ids int64 [B].

    temperature 0 is greedy (argmax; ties go to the lowest id, like torch.argmax
    and transformers). Otherwise: softmax(logits / temperature); with top_k > 0 keep
    the tokens at least as likely as the k-th most likely one (ties with it stay, as in
    transformers' TopKLogitsWarper) and renormalise; then keep the smallest set of
    tokens whose probability mass reaches top_p (the most likely token is always kept),
    renormalise and draw with `generator`, or row i with `generators[i]` (per-request
    RNGs: a row's draw does not depend on the other rows). top_k and top_p compose in
    that order, as in transformers and vLLM.
    """
    temperature, top_p, top_k = check_sampling(temperature, top_p, top_k)
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    # Shifting by the max first keeps a tiny temperature from overflowing to inf - inf = NaN;
    # the floor keeps it representable in fp32 (below it the draw is greedy in effect).
    z = logits.float()
    probs = torch.softmax((z - z.amax(dim=-1, keepdim=True)) / max(temperature, 1e-30), dim=-1)
    if 0 < top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[..., -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if top_p < 1.0:
        sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
        # mass strictly before each token; a token is dropped once that mass already reaches top_p
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_probs)
    if generators is not None:
        if len(generators) != probs.shape[0]:
            raise ValueError(f"generators has {len(generators)} entries for {probs.shape[0]} rows")
        return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)])
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
