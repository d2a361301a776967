// The dense and varlen prefill kernels for __nv_bfloat16 queries (prefill/slice.cuh).
#include "prefill/slice.cuh"

MINIPAGED_PREFILL_DENSE_SLICE(__nv_bfloat16)
