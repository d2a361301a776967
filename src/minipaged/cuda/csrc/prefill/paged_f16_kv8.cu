// The paged attention kernels for __half queries over FP8 caches (prefill/slice.cuh).
#include "prefill/slice.cuh"

MINIPAGED_PREFILL_PAGED_FP8_SLICE(__half)
