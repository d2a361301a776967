// The decode kernels for __half queries, head dim 128, FP8 caches (decode/select.cuh).
#include "decode/select.cuh"

MINIPAGED_DECODE_INSTANTIATE(__half, 128, true)
MINIPAGED_DECODE_INSTANTIATE_G2(__half, true)
