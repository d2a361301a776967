"""transformers' greedy tokens as the engine tests' reference, cached per (prompt, length), and the
seeded random prompts those tests draw."""

from __future__ import annotations

import torch

_cache: dict = {}


def hf_greedy(hf, prompt: list[int], max_new: int) -> list[int]:
    """The new tokens of transformers' greedy generate() (no EOS in the test checkpoints)."""
    key = (id(hf), tuple(prompt), max_new)
    if key not in _cache:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                              pad_token_id=0)
        _cache[key] = out[0, len(prompt):].tolist()
    return _cache[key]


def random_tokens(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
