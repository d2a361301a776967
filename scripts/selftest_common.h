// Host helpers shared by the torch-free kernel self tests (scripts/*_selftest.cu): CUDA error
// checks, fp16/bf16 bit conversions of the inputs and outputs they compare with fp64, and the
// exact value of an e4m3 byte (written from the format, independently of ptx/fp8.cuh).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
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

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; 0x7F / 0xFF are NaN.
static inline double e4m3_to_double(uint8_t b) {
  const int sign = b >> 7, e = (b >> 3) & 15, m = b & 7;
  if ((b & 0x7f) == 0x7f) return NAN;
  const double mag = e == 0 ? std::ldexp(double(m), -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return sign ? -mag : mag;
}
