"""minipaged: FlashAttention-style prefill and paged-KV decode for Qwen3-shaped models.

Each op runs on one of the backends "torch" (the oracle), "triton", "cuda" and
"cuda-wmma"; see `available_backends()`. Importing this package builds no CUDA
and compiles no Triton kernel: backends load on first use.
"""

from .api import (
    decode_attention,
    merge_attention_states,
    paged_attention,
    prefill_attention,
    prefill_attention_varlen,
    write_kv_cache,
)
from .paged_cache import CacheFullError, PagedKVCache
from .registry import Backend, BackendUnavailableError, available_backends, get_backend, use_backend

__version__ = "0.1.0"

__all__ = [
    "prefill_attention",
    "prefill_attention_varlen",
    "decode_attention",
    "paged_attention",
    "merge_attention_states",
    "write_kv_cache",
    "PagedKVCache",
    "CacheFullError",
    "Backend",
    "BackendUnavailableError",
    "available_backends",
    "get_backend",
    "use_backend",
]
