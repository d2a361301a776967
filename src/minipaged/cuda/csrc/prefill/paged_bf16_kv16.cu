// The paged attention kernels for __nv_bfloat16 queries over 16-bit caches (prefill/slice.cuh).
#include "prefill/slice.cuh"

MINIPAGED_PREFILL_PAGED_SLICE(__nv_bfloat16)
