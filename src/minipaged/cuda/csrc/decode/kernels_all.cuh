// Every decode/kernels_*.cu, for a translation unit that must hold all the decode kernels
// itself: decode/launch.cu in a trace build (decode/select.cuh) and selftests that compile the
// decode into their own translation unit. A new slice is added here and nowhere else.
#pragma once
#include "decode/kernels_bf16_d128_kv16.cu"
#include "decode/kernels_bf16_d128_kv8.cu"
#include "decode/kernels_bf16_d64_kv16.cu"
#include "decode/kernels_bf16_d64_kv8.cu"
#include "decode/kernels_f16_d128_kv16.cu"
#include "decode/kernels_f16_d128_kv8.cu"
#include "decode/kernels_f16_d64_kv16.cu"
#include "decode/kernels_f16_d64_kv8.cu"
