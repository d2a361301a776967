// float8_e4m3fn (FP8 KV cache) conversions: fp32 -> e4m3 quantisation for
// write_kv_cache, and e4m3 -> f16 (and fp32) widening for the attention kernels.
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
#include <type_traits>

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

// Two e4m3 bytes (bytes 2 HALF and 2 HALF + 1 of w) -> f16x2, the lower byte in
// the low half.
template <int HALF>
__device__ __forceinline__ uint32_t fp8x2_to_f16x2(uint32_t w) {
  static_assert(HALF == 0 || HALF == 1, "a 32-bit word has two halves");
#if MINIPAGED_FP8_CVT
  uint32_t r;
  // w split into its 16-bit halves in PTX, so that ptxas reads the upper one in
  // place (a .H1 operand) instead of shifting it down first.
  if constexpr (HALF == 0) {
    asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, lo;\n\t}" : "=r"(r) : "r"(w));
  } else {
    asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, hi;\n\t}" : "=r"(r) : "r"(w));
  }
  return r;
#else
  const uint32_t w16 = HALF == 0 ? w & 0xffffu : w >> 16;
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

// Eight e4m3 bytes (element i from byte i of w) -> eight T (__half or __nv_bfloat16) in the
// four words of a 16-byte chunk, element order kept. Exact for both: to bf16 through f16
// (one cvt per pair, then two widenings to fp32 and one narrowing, all exact).
template <typename T>
__device__ __forceinline__ uint4 fp8x8_widen(uint2 w) {
  uint32_t h[4] = {fp8x2_to_f16x2<0>(w.x), fp8x2_to_f16x2<1>(w.x), fp8x2_to_f16x2<0>(w.y), fp8x2_to_f16x2<1>(w.y)};
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 x;
      memcpy(&x, &h[i], sizeof(x));
      const float2 f = __half22float2(x);
      const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
      memcpy(&h[i], &b, sizeof(b));
    }
  }
  return make_uint4(h[0], h[1], h[2], h[3]);
}

// The same widening on the integer pipe, for the FP8 TMA prefill's producer warps: sm_90 runs
// conversions at 16 lanes per SM per clock, a unit the consumers' exp2 and P packing keep busy
// (to bf16 the cvt path above is two conversions per pair). Each byte is moved under T's
// exponent/mantissa split: read as T, the pattern is the e4m3 value times 2^-bias (f16: 2^-8,
// bf16: 2^-120; e4m3 subnormals land on T subnormals, still exact), and one multiply by the
// power of two restores it. The pattern of a NaN code (low seven bits set) would read as +-480:
// fp8x4_nan_bits finds those and the caller takes the cvt path for them.
__device__ __forceinline__ uint32_t fp8x4_nan_bits(uint32_t w) {
  return ((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u;  // byte i: bit 7 set iff its low 7 bits are
}
// Eight e4m3 bytes (no NaN codes) -> eight T in four words, element order kept.
template <typename T>
__device__ __forceinline__ uint4 fp8x8_widen_int(uint2 w) {
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  constexpr int kShift = kBf16 ? 4 : 1;  // 8 - 1 - T's exponent bits (bf16 8, f16 5) + e4m3's 4
  uint32_t h[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // bytes 2i, 2i + 1 of the eight at the top of the two 16-bit halves, zeros below
    const uint32_t lanes = __byte_perm(i < 2 ? w.x : w.y, 0u, (i & 1) ? 0x3424u : 0x1404u);
    const uint32_t bits = (lanes & 0x80008000u) | ((lanes & 0x7f007f00u) >> kShift);
    if constexpr (kBf16) {
      __nv_bfloat162 x;
      memcpy(&x, &bits, sizeof(x));
      x = __hmul2(x, __floats2bfloat162_rn(0x1p120f, 0x1p120f));
      memcpy(&h[i], &x, sizeof(x));
    } else {
      __half2 x;
      memcpy(&x, &bits, sizeof(x));
      x = __hmul2(x, __floats2half2_rn(256.f, 256.f));
      memcpy(&h[i], &x, sizeof(x));
    }
  }
  return make_uint4(h[0], h[1], h[2], h[3]);
}

// ---- q for f16 MMAs over FP8 K/V (decode/mma.cuh, prefill/mainloop_mma.cuh) ----
// e4m3 -> f16 is one instruction per pair, e4m3 -> bf16 four, so the mma.sync
// kernels multiply FP8 K/V in f16 whatever q's type. A bf16 q is moved into
// f16's range by a power of two 2^e chosen from its largest finite |q|: exact
// except for elements more than 2^28 below that largest one (f16 subnormals);
// the score scale takes 2^-e.

// The larger finite magnitude of a bf16x2 word's halves (inf counts as 0, NaN is skipped).
__device__ __forceinline__ float bf16x2_abs_max(uint32_t w) {
  const float x = fmaxf(fabsf(__uint_as_float(w << 16)), fabsf(__uint_as_float(w & 0xffff0000u)));
  return x == INFINITY ? 0.f : x;
}
// e with amax * 2^e < 2^15 (in [2^14, 2^15) for a normal amax), within +-60; 0 for amax = 0.
__device__ __forceinline__ int f16_exponent(float amax) {
  const int biased = static_cast<int>(__float_as_uint(amax) >> 23);  // amax < 2^(biased - 126)
  return amax > 0.f ? min(60, max(-60, 15 - (biased - 126))) : 0;
}
// 2^e for |e| <= 126.
__device__ __forceinline__ float exp2i(int e) { return __uint_as_float(static_cast<uint32_t>(127 + e) << 23); }
// A bf16x2 word times `scale` (a power of two) as f16x2, the low half staying low.
__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t w, float scale) {
  const __half2 h = __floats2half2_rn(__uint_as_float(w << 16) * scale, __uint_as_float(w & 0xffff0000u) * scale);
  uint32_t r;
  memcpy(&r, &h, sizeof(r));
  return r;
}

// Sixteen e4m3 bytes -> sixteen floats (element i from byte i).
__device__ __forceinline__ void fp8x16_to_float(const uint4& u, float (&f)[16]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const uint32_t h = j == 0 ? fp8x2_to_f16x2<0>(w[i]) : fp8x2_to_f16x2<1>(w[i]);
      __half2 h2;
      memcpy(&h2, &h, sizeof(h2));
      const float2 v = __half22float2(h2);
      f[4 * i + 2 * j] = v.x;
      f[4 * i + 2 * j + 1] = v.y;
    }
  }
}

#endif  // __CUDACC__

// ---- e4m3 tiles as m16n8k16 operands (decode/mma.cuh, prefill/mainloop_mma.cuh) ----
// ldmatrix moves 16-bit elements, so byte tiles are read with plain shared
// loads, in layouts chosen so that each thread's bytes are contiguous; the
// widening to 16 bits (exact) happens in registers. Thread (g = lane / 4,
// t = lane % 4) of a warp:
//   K (B operand of Q K^T, keys as columns): a dot product may sum the head dim
//     in any order, as long as Q and K use the same one. Within each 64-dim
//     block the thread reads dims 16t .. 16t+15 (one 16-byte chunk) of key row
//     g (and g + 8), and k step j of the block takes dims 16t+4j .. 16t+4j+3 as
//     its fragment's k indices {2t, 2t+1, 2t+8, 2t+9}: one 32-bit word, low
//     half b0, high half b1. Q's A fragment must be read in the same order
//     (fp8_q_chunk: the 16-bit chunk and byte offset of a k step).
//   V (B operand of P V, keys as rows): n tile dt column n is taken to be dim
//     n * (D/8) + dt, so the thread reads D/8 contiguous bytes (dims g*D/8 ..)
//     of each of its key rows {2t, 2t+1, 2t+8, 2t+9}, and a byte transpose
//     (prmt) pairs the rows per dim. O's C fragments then hold dims in that
//     permuted order (fp8_o_dim).
// Tiles are [rows][D] bytes, XOR-swizzled in 16-byte chunks so these reads hit
// distinct banks (K: a quarter warp reads rows 2i, 2i+1, so at D = 128 odd rows
// flip the 64-byte half; V: a quarter warp reads rows c + 2t, so bits 1-2 of the
// row pick the XOR; a 2-way conflict remains for V at D = 64).
template <int D>
MP_FP8_HD uint32_t fp8_tile_k_off(int row, int chunk) {
  const int c = D == 128 ? chunk ^ ((row & 1) << 2) : chunk;
  return static_cast<uint32_t>(row * D + (c << 4));
}
template <int D>
MP_FP8_HD uint32_t fp8_tile_v_off(int row, int chunk) {
  const int c = D == 128 ? chunk ^ (((row >> 1) & 3) << 1) : chunk ^ ((row >> 1) & 3);
  return static_cast<uint32_t>(row * D + (c << 4));
}
// The output dim that column n of O's n tile dt holds.
template <int D>
MP_FP8_HD int fp8_o_dim(int dt, int n) {
  return n * (D / 8) + dt;
}
// k step kk of the permuted K order: Q's elements for the thread's word lie in
// 16-bit chunk `chunk` (8 elements) of the row, at byte `byte` (0 or 8).
MP_FP8_HD void fp8_q_chunk(int kk, int t, int& chunk, int& byte) {
  chunk = (kk >> 2) * 8 + 2 * t + ((kk & 3) >> 1);
  byte = (kk & 1) * 8;
}

#if defined(__CUDACC__)

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 r;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr));
  return r;
}
__device__ __forceinline__ uint2 lds64(uint32_t addr) {
  uint2 r;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(r.x), "=r"(r.y) : "r"(addr));
  return r;
}

// Q's A fragment of k step kk (permuted K order) for rows r and r + 8 of a
// 16-bit tile whose 16-byte chunk (row, c) lies at off(row, c) bytes from base.
template <class Off>
__device__ __forceinline__ void fp8_q_frag(uint32_t base, int r, int kk, int t, Off off, uint32_t (&a)[4]) {
  int chunk, byte;
  fp8_q_chunk(kk, t, chunk, byte);
  const uint2 lo = lds64(base + off(r, chunk) + byte);
  const uint2 hi = lds64(base + off(r + 8, chunk) + byte);
  a[0] = lo.x;  // row r, k 2t, 2t+1
  a[1] = hi.x;  // row r+8
  a[2] = lo.y;  // row r, k 2t+8, 2t+9
  a[3] = hi.y;
}

// K chunk word j (k step 4 * block + j) -> the f16 B fragment (b0, b1) of one key.
__device__ __forceinline__ void fp8_k_frag(const uint4& chunk, int j, uint32_t& b0, uint32_t& b1) {
  const uint32_t w = j == 0 ? chunk.x : j == 1 ? chunk.y : j == 2 ? chunk.z : chunk.w;
  b0 = fp8x2_to_f16x2<0>(w);
  b1 = fp8x2_to_f16x2<1>(w);
}

// The thread's four V rows row0 + 2t + {0, 1, 8, 9} (D/8 bytes each, dims
// g*D/8 ..) of a V tile at `tile`.
template <int D>
__device__ __forceinline__ void fp8_load_v_rows(uint32_t tile, int row0, int g, int t, uint32_t (&vw)[4][D / 32]) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int row = row0 + 2 * t + (r & 1) + (r >> 1) * 8;
    if constexpr (D == 128) {
      const uint4 x = lds128(tile + fp8_tile_v_off<D>(row, g));
      vw[r][0] = x.x, vw[r][1] = x.y, vw[r][2] = x.z, vw[r][3] = x.w;
    } else {
      static_assert(D == 64, "FP8 tiles: head dim 64 or 128");
      const uint2 x = lds64(tile + fp8_tile_v_off<D>(row, g >> 1) + (g & 1) * 8);
      vw[r][0] = x.x, vw[r][1] = x.y;
    }
  }
}

// O += P V over 16 keys from the rows fp8_load_v_rows read: mma(dt, b0, b1)
// with f16 B fragments for every n tile dt (0 .. D/8 - 1), dt in the permuted
// order of fp8_o_dim.
template <int D, class Mma>
__device__ __forceinline__ void fp8_pv(const uint32_t (&vw)[4][D / 32], Mma mma) {
#pragma unroll
  for (int w = 0; w < D / 32; ++w) {
    // [row 2t byte i, row 2t+1 byte i] pairs for bytes 0, 1 (lo) and 2, 3 (hi); rows 2t+8, 2t+9 likewise.
    const uint32_t ab_lo = __byte_perm(vw[0][w], vw[1][w], 0x5140);
    const uint32_t ab_hi = __byte_perm(vw[0][w], vw[1][w], 0x7362);
    const uint32_t cd_lo = __byte_perm(vw[2][w], vw[3][w], 0x5140);
    const uint32_t cd_hi = __byte_perm(vw[2][w], vw[3][w], 0x7362);
    mma(4 * w + 0, fp8x2_to_f16x2<0>(ab_lo), fp8x2_to_f16x2<0>(cd_lo));
    mma(4 * w + 1, fp8x2_to_f16x2<1>(ab_lo), fp8x2_to_f16x2<1>(cd_lo));
    mma(4 * w + 2, fp8x2_to_f16x2<0>(ab_hi), fp8x2_to_f16x2<0>(cd_hi));
    mma(4 * w + 3, fp8x2_to_f16x2<1>(ab_hi), fp8x2_to_f16x2<1>(cd_hi));
  }
}

#endif  // __CUDACC__

}  // namespace minipaged
