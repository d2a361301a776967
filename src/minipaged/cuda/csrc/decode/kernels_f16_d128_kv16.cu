// The decode kernels for __half queries, head dim 128, 16-bit caches (decode/select.cuh).
#include "decode/select.cuh"

MINIPAGED_DECODE_INSTANTIATE(__half, 128, false)
MINIPAGED_DECODE_INSTANTIATE_G2(__half, false)
