// The decode kernels for __nv_bfloat16 queries, head dim 128, FP8 caches (decode/select.cuh).
#include "decode/select.cuh"

MINIPAGED_DECODE_INSTANTIATE(__nv_bfloat16, 128, true)
MINIPAGED_DECODE_INSTANTIATE_G2(__nv_bfloat16, true)
