// Host helpers shared by the torch-free kernel self tests (scripts/*_selftest.cu): CUDA error
// checks and fp16/bf16 bit conversions of the inputs and outputs they compare with fp64.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "params.h"

#define CHECK_CUDA(expr)                                                                           \
  do {                                                                                             \
    cudaError_t err_ = (expr);                                                                     \
    if (err_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(err_), __FILE__,      \
                   __LINE__, cudaGetErrorString(err_));                                            \
      std::exit(2);                                                                                \
    }                                                                                              \
  } while (0)

static inline uint16_t to_bits(float x, minipaged::DType dt) {
  uint16_t b;
  if (dt == minipaged::DType::kBFloat16) {
    const __nv_bfloat16 h = __float2bfloat16(x);
    std::memcpy(&b, &h, 2);
  } else {
    const __half h = __float2half(x);
    std::memcpy(&b, &h, 2);
  }
  return b;
}

static inline float from_bits(uint16_t b, minipaged::DType dt) {
  if (dt == minipaged::DType::kBFloat16) {
    __nv_bfloat16 h;
    std::memcpy(&h, &b, 2);
    return __bfloat162float(h);
  }
  __half h;
  std::memcpy(&h, &b, 2);
  return __half2float(h);
}
