"""The benchmark grids (standard GPU grid, quick CPU grid, cross-check cases) and
the contiguous layouts the anchors read. The case classes and the input builders
are minipaged.testing's, shared with the tests."""

from __future__ import annotations

import random
from collections.abc import Mapping

import torch

from ..testing import (  # noqa: F401 - the cases and builders, re-exported for the runner
    DecodeCase,
    PagedCase,
    PrefillCase,
    cu_seqlens,
    make_decode_inputs,
    make_paged_inputs,
    make_prefill_inputs,
    paged_kv,
)

QWEN3_HEADS = dict(num_q_heads=16, num_kv_heads=8, head_dim=128)
QUICK_HEADS = dict(num_q_heads=4, num_kv_heads=2, head_dim=64)
# tokens per KV-cache page of the decode and paged grids (--page-size); prefill reads no pages
DEFAULT_PAGE_SIZE = 16


def grid_heads(quick: bool, heads: tuple[int, int, int | None] | None = None) -> dict:
    """The head layout a grid runs at: QUICK_HEADS or QWEN3_HEADS, or `heads` as --heads gives it
    (num_q_heads, num_kv_heads, head_dim), a head_dim of None keeping the grid's own."""
    default = QUICK_HEADS if quick else QWEN3_HEADS
    if heads is None:
        return dict(default)
    hq, hkv, d = heads
    return dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=default["head_dim"] if d is None else d)


def standard_paged_cases(heads: Mapping[str, int] = QWEN3_HEADS,
                         page_size: int = DEFAULT_PAGE_SIZE) -> list[PagedCase]:
    """paged_attention, Qwen3 heads (or `heads`), block size 16 (or `page_size`), pages scattered at random:
    chunked prefill (8 x 512 new over 4k cached; 1 x 2k new over 30k cached),
    speculative verification (B=32, 4 new tokens, 4k context; and one sequence at 32k,
    the latency-bound serving case, whose grid is a few CTAs unless the keys are split)
    and a mixed batch (one 2k chunk over 2k cached + 63 decodes at 4k context) in one
    launch."""
    return [
        PagedCase("chunked", (512,) * 8, (4096 + 512,) * 8, **heads, block_size=page_size),
        PagedCase("chunked", (2048,), (30720 + 2048,), **heads, block_size=page_size),
        PagedCase("spec", (4,) * 32, (4096,) * 32, **heads, block_size=page_size),
        PagedCase("spec", (4,), (32768,), **heads, block_size=page_size),
        PagedCase("mixed", (2048,) + (1,) * 63, (4096,) * 64, **heads, block_size=page_size),
    ]


def quick_paged_cases(heads: Mapping[str, int] = QUICK_HEADS, page_size: int = DEFAULT_PAGE_SIZE) -> list[PagedCase]:
    return [
        PagedCase("chunked", (32,) * 2, (96,) * 2, **heads, block_size=page_size),
        PagedCase("spec", (4,) * 4, (64,) * 4, **heads, block_size=page_size),
        PagedCase("mixed", (48,) + (1,) * 3, (96,) + (64,) * 3, **heads, block_size=page_size),
    ]


def crosscheck_paged_cases(quick: bool, heads: Mapping[str, int] | None = None,
                           page_size: int = DEFAULT_PAGE_SIZE) -> list[PagedCase]:
    """One call mixing a chunk over a prefix, a decode, an empty query, a fresh prompt
    (q_len == context) and a context one past a 16-token page. heads None: the grid's default layout.
    At another page_size one more sequence: a chunk of page_size + 2 queries ending a context of two
    pages and one token (so a chunk straddles a page boundary and a context crosses pages at any size)."""
    h = heads or grid_heads(quick)
    q_lens, lens = ((5, 1, 0, 20), (40, 17, 3, 20)) if quick else ((300, 1, 4, 0, 97), (1000, 4097, 1023, 16, 97))
    if page_size != DEFAULT_PAGE_SIZE:
        q_lens, lens = q_lens + (page_size + 2,), lens + (2 * page_size + 1,)
    return [PagedCase("mixed", q_lens, lens, **h, block_size=page_size)]


def standard_prefill_cases(heads: Mapping[str, int] = QWEN3_HEADS) -> list[PrefillCase]:
    """Causal prefill, Qwen3 heads (16 q, 8 kv, D=128) unless `heads` says otherwise: B=1 at 1k..16k
    and B=8 at 1k."""
    cases = [PrefillCase(1, n, n, **heads) for n in (1024, 4096, 8192, 16384)]
    cases.append(PrefillCase(8, 1024, 1024, **heads))
    return cases


def standard_decode_cases(heads: Mapping[str, int] = QWEN3_HEADS,
                          page_size: int = DEFAULT_PAGE_SIZE) -> list[DecodeCase]:
    """Paged decode, Qwen3 heads (or `heads`), block size 16 (or `page_size`): six rows where every
    context = L, then two uneven batches of 64 as a server sees them (the table as wide as the longest
    sequence), one 32k sequence last among 1k ones and lengths spread over 512-16384 (fixed seed)."""
    grid = [(1, 4096), (1, 32768), (8, 4096), (32, 4096), (64, 8192), (256, 1024)]
    cases = [DecodeCase(b, l, **heads, block_size=page_size) for b, l in grid]
    spread = random.Random(0)
    cases.append(DecodeCase.of((1024,) * 63 + (32768,), **heads, block_size=page_size))
    cases.append(DecodeCase.of([spread.randint(512, 16384) for _ in range(64)], **heads, block_size=page_size))
    return cases


def quick_prefill_cases(heads: Mapping[str, int] = QUICK_HEADS) -> list[PrefillCase]:
    return [PrefillCase(1, n, n, **heads) for n in (64, 128)]


def quick_decode_cases(heads: Mapping[str, int] = QUICK_HEADS, page_size: int = DEFAULT_PAGE_SIZE) -> list[DecodeCase]:
    return [DecodeCase(b, l, **heads, block_size=page_size) for b in (1, 4) for l in (64, 256)]


def crosscheck_prefill_cases(quick: bool, heads: Mapping[str, int] | None = None) -> list[PrefillCase]:
    """Odd lengths and a chunk after a cached prefix (Nq < Nk, bottom-right causal).
    heads None: the grid's default layout."""
    h = heads or grid_heads(quick)
    if quick:
        return [PrefillCase(1, 97, 97, **h), PrefillCase(2, 33, 80, **h)]
    return [PrefillCase(2, 1000, 1000, **h), PrefillCase(1, 300, 1023, **h)]


def crosscheck_decode_cases(quick: bool, heads: Mapping[str, int] | None = None,
                            page_size: int = DEFAULT_PAGE_SIZE) -> list[DecodeCase]:
    """Ragged contexts including an empty one and a partial last page. heads None: the grid's default layout.
    At another page_size one more context of two pages and one token (one that crosses pages at any size)."""
    h = heads or grid_heads(quick)
    lens = (0, 17, 100) if quick else (1, 17, 1000, 4097)
    if page_size != DEFAULT_PAGE_SIZE:
        lens += (2 * page_size + 1,)
    return [DecodeCase(len(lens), max(lens), **h, block_size=page_size, context_lens=lens)]


# ----------------------------------------------------------------------------- layouts for the anchors


def contiguous_kv(k_cache, v_cache, block_tables, context_len: int):
    """The same K/V as the paged cache, laid out [B, Hkv, L, D] contiguous (for the
    SDPA decode anchors). All sequences must have context_len tokens."""
    batch = block_tables.shape[0]
    bs = k_cache.shape[1]
    nb = (context_len + bs - 1) // bs
    idx = block_tables[:, :nb].long()

    def gather(cache):
        g = cache[idx]  # [B, nb, bs, Hkv, D]
        g = g.reshape(batch, nb * bs, cache.shape[2], cache.shape[3])[:, :context_len]
        return g.permute(0, 2, 1, 3).contiguous()

    return gather(k_cache), gather(v_cache)


def gather_varlen_kv(k_cache, v_cache, block_tables, context_lens):
    """The K/V of every sequence's context made contiguous and packed, [Tk, Hkv, D],
    with its cu_seqlens_k (what prefill_attention_varlen takes); context_lens a list."""
    bs = k_cache.shape[1]
    slots = []
    tables = block_tables.cpu()
    for s, n in enumerate(context_lens):
        t = torch.arange(int(n))
        slots.append(tables[s, t // bs].long() * bs + t % bs)
    idx = (torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long)).to(k_cache.device)

    def gather(cache):
        return cache.reshape(-1, cache.shape[2], cache.shape[3])[idx].contiguous()

    return gather(k_cache), gather(v_cache), cu_seqlens(context_lens, k_cache.device)


def paged_from_dense(k, v, block_size: int = DEFAULT_PAGE_SIZE):
    """Dense k, v [B, Hkv, N, D] written into a fresh paged cache with scattered pages
    (for anchors that read pages on the prefill grid). Returns
    (k_cache, v_cache, block_tables, context_lens) as minipaged.testing.paged_kv lays them out."""
    kv = paged_kv(None, k.shape[1], k.shape[3], block_size, k.dtype, k.device, seed=None, spare_blocks=0,
                  spare_columns=0, poison=False, keys=[x.transpose(0, 1) for x in k],
                  vals=[x.transpose(0, 1) for x in v])
    return kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens


# ----------------------------------------------------------------------------- FP8 caches

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# blocks quantised per step: bounds the fp32 temporary of a large cache (4096 x 16 x 8 x 128 x 4 B = 256 MiB)
_QUANT_CHUNK_BLOCKS = 4096


def kv_amax_scales(cache: torch.Tensor) -> torch.Tensor:
    """float32 [Hkv]: per KV head, the scale that maps the cache's largest finite |value|
    to 448 (NaN-poisoned slots are ignored). cache [num_blocks, block_size, Hkv, D]."""
    amax = torch.zeros(cache.shape[2], dtype=torch.float32, device=cache.device)
    for i in range(0, cache.shape[0], _QUANT_CHUNK_BLOCKS):
        part = cache[i:i + _QUANT_CHUNK_BLOCKS].float().abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
        amax = torch.maximum(amax, part.amax(dim=(0, 1, 3)))
    return (amax / FP8_MAX).clamp_min(1e-8)


def quantize_fp8(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8(clamp(cache / scale[h], -448, 448)) per KV head h, rounded to nearest even: the
    rule write_kv_cache follows (DESIGN "FP8 KV cache"), applied to a whole cache at once
    (NaN stays NaN, so poisoned slots stay poisoned)."""
    out = torch.empty(cache.shape, dtype=FP8, device=cache.device)
    s = scale.to(device=cache.device, dtype=torch.float32).view(1, 1, -1, 1)
    for i in range(0, cache.shape[0], _QUANT_CHUNK_BLOCKS):
        part = cache[i:i + _QUANT_CHUNK_BLOCKS].float() / s
        out[i:i + _QUANT_CHUNK_BLOCKS] = part.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return out


def fp8_caches(k_cache, v_cache, *, spread: bool = False):
    """(k_cache8, v_cache8, k_scale [Hkv], v_scale [Hkv]) from 16-bit caches, per-KV-head
    scales from each head's amax. spread=True multiplies head h's scales by 1 + 3h/(Hkv-1)
    (fewer fp8 levels for the later heads), so a kernel that applies one head's scale to
    another's K/V is off by up to 4x instead of by the few % random heads differ by."""
    ks, vs = kv_amax_scales(k_cache), kv_amax_scales(v_cache)
    hkv = k_cache.shape[2]
    if spread and hkv > 1:
        f = 1.0 + 3.0 * torch.arange(hkv, dtype=torch.float32, device=ks.device) / (hkv - 1)
        ks, vs = ks * f, vs * f.flip(0)
    return quantize_fp8(k_cache, ks), quantize_fp8(v_cache, vs), ks, vs


def dequantize_fp8(cache8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The values an fp8 cache stands for, in float32: stored x scale[h], as the torch oracle
    dequantises them (one fp32 rounding of the product)."""
    return cache8.float() * scale.to(device=cache8.device, dtype=torch.float32).view(1, 1, -1, 1)
