// The decode kernels for __half queries, head dim 64, FP8 caches (decode/select.cuh).
#include "decode/select.cuh"

MINIPAGED_DECODE_INSTANTIATE(__half, 64, true)
