// Single-instruction helpers: ex2.approx, streaming 16-byte loads and the
// programmatic-dependent-launch controls.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace minipaged {

// 2^x. ex2.approx maps -inf to +0, which is exactly what masked scores need.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 16-byte read of data that no thread of the kernel writes (.nc) and that is
// used once (no L1 allocation): the KV cache stream of decode.
// a * b as a 64-bit product of two 32-bit operands: one IMAD.WIDE. ptxas
// lowers the equivalent mul.lo.s64 of two sign-extended ints as a full
// 64 x 64-bit multiply (three IMADs).
__device__ __forceinline__ int64_t mul_wide(int a, int b) {
  int64_t r;
  asm("mul.wide.s32 %0, %1, %2;" : "=l"(r) : "r"(a), "r"(b));
  return r;
}

__device__ __forceinline__ uint4 ld_stream_16(const void* ptr) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(ptr));
  return r;
}

// Programmatic dependent launch (sm_90+; no-ops below): the primary grid lets
// its dependent grid start launching, and the dependent waits for the primary
// grid's completion and memory before it reads what that grid wrote.
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace minipaged
