// The decode kernels for __half queries, head dim 64, 16-bit caches (decode/select.cuh).
#include "decode/select.cuh"

MINIPAGED_DECODE_INSTANTIATE(__half, 64, false)
