// The decode kernels for __nv_bfloat16 queries, head dim 64, 16-bit caches (decode/select.cuh).
#include "decode/select.cuh"

MINIPAGED_DECODE_INSTANTIATE(__nv_bfloat16, 64, false)
