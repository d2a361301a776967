"""Greedy and temperature / top-k / top-p sampling over a batch of last-token logits, after
repetition, frequency and presence penalties."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from ..api import integer_number, real_number


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling, checked (make_sampling_params). The defaults are greedy, no cut, no
    penalty."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


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


def make_sampling_params(temperature: Any = 0.0, top_p: Any = 1.0, top_k: Any = 0, presence_penalty: Any = 0.0,
                         frequency_penalty: Any = 0.0, repetition_penalty: Any = 1.0) -> SamplingParams:
    """check_sampling's rules, plus presence_penalty and frequency_penalty finite floats in [-2, 2]
    (OpenAI's and vLLM's range; 0: off) and repetition_penalty a finite float > 0 (1: off)."""
    temperature, top_p, top_k = check_sampling(temperature, top_p, top_k)
    for name, val in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty),
                      ("repetition_penalty", repetition_penalty)):
        if not real_number(val):
            raise TypeError(f"{name} must be a float, got {type(val).__name__}")
    for name, val in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not (math.isfinite(val) and -2.0 <= val <= 2.0):
            raise ValueError(f"{name} must be in [-2, 2] (0 is off), got {val}")
    # > 0 also as the float32 the penalty is applied in: 1e-50 became 0.0 there, logits / 0 became inf and NaN,
    # and torch.multinomial failed mid-generation (on a GPU: a device-side assert)
    # (2**-150 is half float32's smallest subnormal: anything at or below it rounds to 0.0)
    if not (math.isfinite(repetition_penalty) and repetition_penalty > 2.0**-150):
        raise ValueError(f"repetition_penalty must be a finite float > 0 (1 is off; at least float32's smallest, "
                         f"about 1.4e-45), got {repetition_penalty}")
    return SamplingParams(temperature, top_p, top_k, float(presence_penalty), float(frequency_penalty),
                          float(repetition_penalty))


def apply_penalties(logits: torch.Tensor, params: Seq[SamplingParams], token_ids: Seq[Seq[int]],
                    prompt_lens: Seq[int]) -> torch.Tensor:
    """logits [B, V] -> fp32 logits with each row's penalties applied (a new tensor; rows without
    penalties are unchanged). Row i's tokens so far are token_ids[i], the first prompt_lens[i] of
    them its prompt.

    repetition_penalty r (transformers' and vLLM's rule): every token id in the prompt or the output
    has its logit divided by r when positive, multiplied by r when negative. Then, over the output
    tokens only (OpenAI's and vLLM's rule): logit -= frequency_penalty * count + presence_penalty *
    (count > 0)."""
    z = logits.float().clone()
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return z
    dev, vocab = z.device, z.shape[-1]
    # every penalised row's tokens in one padded [P, L] tensor (padding: a spare column `vocab`), so
    # that one scatter counts them all
    width = max(len(token_ids[i]) for i in rows)
    ids = torch.tensor([list(token_ids[i]) + [vocab] * (width - len(token_ids[i])) for i in rows],
                       dtype=torch.int64, device=dev).reshape(len(rows), width)
    starts = torch.tensor([prompt_lens[i] for i in rows], device=dev)[:, None]
    out_ids = torch.where(torch.arange(width, device=dev)[None] >= starts, ids, vocab)
    ones = torch.ones(out_ids.shape, device=dev)
    counts = torch.zeros(len(rows), vocab + 1, device=dev).scatter_add_(1, out_ids, ones)[:, :vocab]
    seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=dev).scatter_(1, ids, True)[:, :vocab]
    sub = z[rows]
    rep = torch.tensor([params[i].repetition_penalty for i in rows], device=dev)[:, None]
    sub = torch.where(seen, torch.where(sub < 0, sub * rep, sub / rep), sub)
    freq = torch.tensor([params[i].frequency_penalty for i in rows], device=dev)[:, None]
    pres = torch.tensor([params[i].presence_penalty for i in rows], device=dev)[:, None]
    # a small repetition_penalty can push a logit past float32's range (10 / 1e-38): inf - inf is NaN in
    # the sampler's max shift, which torch.multinomial refuses (on a GPU: a device-side assert)
    fmax = torch.finfo(torch.float32).max
    z[rows] = (sub - freq * counts - pres * (counts > 0).to(sub.dtype)).clamp(-fmax, fmax)
    return z


def _per_row(name: str, value: Any, rows: int) -> list:
    """One value for every row, or a list / tuple of one per row."""
    if isinstance(value, (list, tuple)):
        if len(value) != rows:
            raise ValueError(f"{name} has {len(value)} entries for {rows} rows")
        return list(value)
    return [value] * rows


def sample(
    logits: torch.Tensor,
    *,
    temperature: float | Seq[float] = 0.0,
    top_p: float | Seq[float] = 1.0,
    top_k: int | Seq[int] = 0,
    generator: torch.Generator | None = None,
    generators: Seq[torch.Generator | None] | None = None,
) -> torch.Tensor:
    """logits [B, V] -> token ids int64 [B].

    temperature, top_p and top_k are one value for every row or a list of one per row.
    temperature 0 is greedy (argmax; ties go to the lowest id, like torch.argmax
    and transformers). Otherwise: softmax(logits / temperature); with top_k > 0 keep
    the tokens at least as likely as the k-th most likely one (ties with it stay, as in
    transformers' TopKLogitsWarper) and renormalise; then keep the smallest set of
    tokens whose probability mass reaches top_p (the most likely token is always kept),
    renormalise and draw with `generator`, or row i with `generators[i]` (per-request
    RNGs: a row's draw does not depend on the other rows; None for a greedy row). top_k
    and top_p compose in that order, as in transformers and vLLM.
    """
    rows = logits.shape[0]
    params = [SamplingParams(*check_sampling(t, p, k))
              for t, p, k in zip(_per_row("temperature", temperature, rows), _per_row("top_p", top_p, rows),
                                 _per_row("top_k", top_k, rows))]
    if generators is not None and len(generators) != rows:
        raise ValueError(f"generators has {len(generators)} entries for {rows} rows")
    return sample_checked(logits, params, generator=generator, generators=generators)


def sample_checked(
    logits: torch.Tensor,
    params: Seq[SamplingParams],
    *,
    generator: torch.Generator | None = None,
    generators: Seq[torch.Generator | None] | None = None,
) -> torch.Tensor:
    """sample() with one checked SamplingParams per row (the engine checks a request's once, not
    every step). Penalties are not applied here (apply_penalties)."""
    rows = logits.shape[0]
    drawn_rows = [i for i, p in enumerate(params) if p.temperature > 0.0]
    if not drawn_rows:
        return logits.argmax(dim=-1)
    every_row = len(drawn_rows) == rows
    z = logits.float() if every_row else logits[drawn_rows].float()
    dev = z.device
    vocab = z.shape[-1]
    temps = torch.tensor([params[i].temperature for i in drawn_rows], device=dev)
    top_ps = torch.tensor([params[i].top_p for i in drawn_rows], device=dev)
    # top_k >= vocab keeps every token; clamped so that a huge one (2**70) is not an int64 overflow mid-step
    top_ks = torch.tensor([min(params[i].top_k, vocab) for i in drawn_rows], device=dev)
    # Shifting by the max first keeps a tiny temperature from overflowing to inf - inf = NaN;
    # the floor keeps it representable in fp32 (below it the draw is greedy in effect).
    probs = torch.softmax((z - z.amax(dim=-1, keepdim=True)) / temps.clamp(min=1e-30)[:, None], dim=-1)
    cut_k = ((top_ks > 0) & (top_ks < vocab))[:, None]
    cut_p = (top_ps < 1.0)[:, None]
    if bool(cut_k.any()) or bool(cut_p.any()):
        sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
        if bool(cut_k.any()):
            kth = sorted_probs.gather(-1, (top_ks.clamp(1, vocab) - 1)[:, None])
            sorted_probs = sorted_probs.masked_fill(cut_k & (sorted_probs < kth), 0.0)
            sorted_probs = torch.where(cut_k, sorted_probs / sorted_probs.sum(dim=-1, keepdim=True), sorted_probs)
        if bool(cut_p.any()):
            # mass strictly before each token; a token is dropped once that mass already reaches top_p
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop = cut_p & (mass_before >= top_ps[:, None])
            # the most likely token always stays: a top_p below float32's range (1e-50) is 0.0 here, which
            # dropped every token, and torch.multinomial failed on the empty distribution
            drop[:, 0] = False
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_probs)
    if generators is not None:
        drawn = torch.cat([torch.multinomial(probs[j], 1, generator=generators[i]) for j, i in enumerate(drawn_rows)])
    else:
        drawn = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    if every_row:
        return drawn
    out = logits.argmax(dim=-1)  # (the greedy rows' picks; only needed when some rows are greedy)
    out[drawn_rows] = drawn
    return out
