// The dense and varlen prefill kernels for __half queries (prefill/slice.cuh).
#include "prefill/slice.cuh"

MINIPAGED_PREFILL_DENSE_SLICE(__half)
