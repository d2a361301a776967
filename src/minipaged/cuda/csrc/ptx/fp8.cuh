// float8_e4m3fn (FP8 KV cache) conversions: fp32 -> e4m3 quantisation for
// write_kv_cache, and e4m3 -> f16 / bf16 widening for the attention kernels.
//
// e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits, no infinities, one NaN
// code per sign (0x7F / 0xFF), largest finite 448, smallest subnormal 2^-9.
// Every e4m3 value is exact in f16 and in bf16 (at most 4 significant bits,
// exponents 2^-9 .. 2^8), so widening loses nothing.
//
// sm_89+ have single instructions for both directions (cvt ... e4m3x2); below
// that a software path computes the same bits. The quantiser's software path is
// __host__ __device__ so that it can be checked on the CPU against torch's cast.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define MP_FP8_HD __host__ __device__ __forceinline__
#else
#define MP_FP8_HD inline
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define MINIPAGED_FP8_CVT 1
#else
#define MINIPAGED_FP8_CVT 0
#endif

namespace minipaged {

constexpr float kFp8Max = 448.f;

MP_FP8_HD uint32_t fp8_f32_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
}
MP_FP8_HD float fp8_bits_f32(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof(x));
  return x;
}

// Round-to-nearest-even of x to e4m3fn, saturating at +-448 (so +-inf -> +-448),
// NaN -> 0x7F with x's sign: exactly torch's `.to(float8_e4m3fn)` of
// clamp(x, -448, 448). Pure fp32/integer arithmetic; every multiply is by a
// power of two and exact, rintf rounds half to even.
MP_FP8_HD uint8_t fp8_e4m3_from_float_soft(float x) {
  const uint32_t u = fp8_f32_bits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);  // NaN
  const int ef = static_cast<int>(a >> 23);                        // biased fp32 exponent
  if (ef >= 127 + 9) return static_cast<uint8_t>(sign | 0x7eu);    // |x| >= 512 (inf too): saturate
  const float ax = fp8_bits_f32(a);
  uint32_t code;
  if (ef < 127 - 6) {
    // Below 2^-6 e4m3 is subnormal: multiples of 2^-9; n = 8 is 2^-6, code 8.
    code = static_cast<uint32_t>(rintf(ax * 512.f));
  } else {
    // |x| in [2^e, 2^(e+1)), e in -6..8: multiples of 2^(e-3). n in [8, 16];
    // n = 16 carries into the next exponent through the addition.
    const int e = ef - 127;
    const float n = rintf(ax * fp8_bits_f32(static_cast<uint32_t>(127 + 3 - e) << 23));
    code = static_cast<uint32_t>((e + 7) << 3) + static_cast<uint32_t>(n) - 8u;
  }
  if (code > 0x7eu) code = 0x7eu;  // past 448 (449..511 round to 448 or 480): saturate
  return static_cast<uint8_t>(sign | code);
}

#if defined(__CUDACC__)

// Two floats -> two e4m3 bytes (lo in the low byte) with the same semantics.
__device__ __forceinline__ uint16_t fp8x2_e4m3_from_float2(float lo, float hi) {
#if MINIPAGED_FP8_CVT
  uint16_t r;
  // .satfinite: out-of-range and infinite inputs become +-448, NaN stays NaN;
  // the first source operand goes to the upper byte.
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return static_cast<uint16_t>(fp8_e4m3_from_float_soft(lo) | (fp8_e4m3_from_float_soft(hi) << 8));
#endif
}

// Two e4m3 bytes (the low 16 bits of w) -> f16x2, the low byte in the low half.
__device__ __forceinline__ uint32_t fp8x2_to_f16x2(uint32_t w16) {
#if MINIPAGED_FP8_CVT
  uint32_t r;
  const uint16_t h = static_cast<uint16_t>(w16);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"(h));
  return r;
#else
  // Each byte moved to the top of its f16 half: sign to bit 15, exponent and
  // mantissa to bits 13..7 (shifted right by one), i.e. the e4m3 value times
  // 2^-8 as an f16 (subnormals included); the multiply by 256 restores it.
  const uint32_t spread = ((w16 & 0xff00u) << 16) | ((w16 & 0xffu) << 8);  // byte i at bits 16i+8..16i+15
  const uint32_t bits = (spread & 0x80008000u) | ((spread & 0x7f007f00u) >> 1);
  __half2 h2;
  memcpy(&h2, &bits, sizeof(h2));
  h2 = __hmul2(h2, __floats2half2_rn(256.f, 256.f));
  uint32_t r;
  memcpy(&r, &h2, sizeof(r));
  // 0x7F / 0xFF are NaN in e4m3fn (the shift above would make them +-480).
  if ((spread & 0x00007f00u) == 0x00007f00u) r |= 0x00007fffu;
  if ((spread & 0x7f000000u) == 0x7f000000u) r |= 0x7fff0000u;
  return r;
#endif
}

// Two e4m3 bytes -> the 16-bit pair an mma.sync of dtype T takes (exact).
template <typename T>
__device__ __forceinline__ uint32_t fp8x2_to_16x2(uint32_t w16);
template <>
__device__ __forceinline__ uint32_t fp8x2_to_16x2<__half>(uint32_t w16) {
  return fp8x2_to_f16x2(w16);
}
template <>
__device__ __forceinline__ uint32_t fp8x2_to_16x2<__nv_bfloat16>(uint32_t w16) {
  __half2 h;
  const uint32_t f = fp8x2_to_f16x2(w16);
  memcpy(&h, &f, sizeof(h));
  const float2 v = __half22float2(h);
  const __nv_bfloat162 b = __floats2bfloat162_rn(v.x, v.y);
  uint32_t r;
  memcpy(&r, &b, sizeof(r));
  return r;
}

// Sixteen e4m3 bytes -> sixteen floats (element i from byte i).
__device__ __forceinline__ void fp8x16_to_float(const uint4& u, float (&f)[16]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const uint32_t h = fp8x2_to_f16x2(j == 0 ? (w[i] & 0xffffu) : (w[i] >> 16));
      __half2 h2;
      memcpy(&h2, &h, sizeof(h2));
      const float2 v = __half22float2(h2);
      f[4 * i + 2 * j] = v.x;
      f[4 * i + 2 * j + 1] = v.y;
    }
  }
}

#endif  // __CUDACC__

}  // namespace minipaged
