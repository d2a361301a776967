// The paged attention kernels for __half queries over 16-bit caches (prefill/slice.cuh).
#include "prefill/slice.cuh"

MINIPAGED_PREFILL_PAGED_SLICE(__half)
