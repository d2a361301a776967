// cp.async (sm_80+): 16-byte global -> shared copies that bypass the register
// file and L1. When `valid` is false the source is not read at all and the 16
// destination bytes are zero-filled, so tails past a length never leak
// garbage (or NaN) into the math.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace minipaged {

// Shared-memory address form. No memory clobber: its callers read the copied
// data back only through asm that is ordered after cp_async_wait anyway
// (ldmatrix, wgmma).
__device__ __forceinline__ void cp_async_16(uint32_t smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src),
               "r"(src_bytes));
}
// Generic-pointer form, with a memory clobber: its caller (the scalar decode
// kernel) reads the staged bytes with ordinary loads, which must not move
// across the copy.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most kPending of this thread's committed groups are in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace minipaged
