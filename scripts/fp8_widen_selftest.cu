// Exhaustive check of the e4m3 -> f16/bf16 widenings of ptx/fp8.cuh on the GPU: the cvt path
// (fp8x8_widen) and the integer-pipe path of the FP8 TMA prefill's producer (fp8x8_widen_int),
// every code in every byte position, against an exact host decoding; and fp8x4_nan_bits, which
// must flag exactly the NaN codes (the integer path does not keep them).
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I src/minipaged/cuda/csrc \
//        scripts/fp8_widen_selftest.cu -o fp8_widen_selftest && ./fp8_widen_selftest
// (the host decodes with selftest_common.h's e4m3_to_double and from_bits).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "ptx/fp8.cuh"
#include "selftest_common.h"

// Thread i widens bytes (i + j) % 256, j = 0..7: code c visits every byte position.
__global__ void widen_all(uint32_t* out) {
  const int i = threadIdx.x;
  uint8_t b[8];
  for (int j = 0; j < 8; ++j) b[j] = uint8_t((i + j) & 255);
  uint2 w;
  memcpy(&w, b, 8);
  const uint4 r[4] = {minipaged::fp8x8_widen<__half>(w), minipaged::fp8x8_widen<__nv_bfloat16>(w),
                      minipaged::fp8x8_widen_int<__half>(w), minipaged::fp8x8_widen_int<__nv_bfloat16>(w)};
  for (int k = 0; k < 4; ++k) memcpy(out + (k * 256 + i) * 4, &r[k], 16);
  out[4 * 4 * 256 + i] = minipaged::fp8x4_nan_bits(w.x);
}

int main() {
  uint32_t* d = nullptr;
  const int words = 4 * 4 * 256 + 256;
  CHECK_CUDA(cudaMalloc(&d, words * 4));
  widen_all<<<1, 256>>>(d);
  CHECK_CUDA(cudaGetLastError());
  std::vector<uint32_t> h(words);
  CHECK_CUDA(cudaMemcpy(h.data(), d, words * 4, cudaMemcpyDeviceToHost));
  const char* names[4] = {"cvt f16", "cvt bf16", "int f16", "int bf16"};
  int bad = 0, checked = 0;
  for (int k = 0; k < 4; ++k) {
    const bool bf = k & 1, integer = k >= 2;
    for (int i = 0; i < 256; ++i)
      for (int j = 0; j < 8; ++j) {
        const uint8_t code = uint8_t((i + j) & 255);
        const double want = e4m3_to_double(code);
        if (integer && std::isnan(want)) continue;  // fp8x4_nan_bits routes NaN codes to the cvt path
        uint16_t bits;
        memcpy(&bits, reinterpret_cast<const uint8_t*>(&h[(k * 256 + i) * 4]) + 2 * j, 2);
        const double got = from_bits(bits, bf ? minipaged::DType::kBFloat16 : minipaged::DType::kFloat16);
        // exact, signed zeros included
        const bool ok = std::isnan(want) ? std::isnan(got) : (got == want && std::signbit(got) == std::signbit(want));
        ++checked;
        if (!ok && bad++ < 10)
          std::printf("FAIL %s code 0x%02x at byte %d: got %g (0x%04x), want %g\n", names[k], code, j, got, bits, want);
      }
  }
  for (int i = 0; i < 256; ++i)
    for (int j = 0; j < 4; ++j) {
      const uint8_t code = uint8_t((i + j) & 255);
      const bool flagged = (h[4 * 4 * 256 + i] >> (8 * j + 7)) & 1u;
      ++checked;
      if (flagged != std::isnan(e4m3_to_double(code)) && bad++ < 10)
        std::printf("FAIL nan_bits code 0x%02x at byte %d: flagged %d\n", code, j, int(flagged));
    }
  std::printf("%s: %d of %d checks failed\n", bad ? "FAILED" : "ALL PASS", bad, checked);
  return bad ? 1 : 0;
}
