// The decode kernels for __nv_bfloat16 queries, head dim 128, 16-bit caches (decode/select.cuh).
#include "decode/select.cuh"

MINIPAGED_DECODE_INSTANTIATE(__nv_bfloat16, 128, false)
MINIPAGED_DECODE_INSTANTIATE_G2(__nv_bfloat16, false)
