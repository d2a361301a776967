// What the split-KV merges share: decode's (decode/reduce.cuh) and that of the packed
// short-query prefill (prefill/mainloop_mma.cuh, PrefillParams::pack_splits).
#pragma once
#include <cuda_runtime.h>

namespace minipaged {

// The largest x over the CTA's kWarps warps (each thread's x; a butterfly per warp, then the
// warps' maxima in warp order, so every thread returns the same value). sm_warp: kWarps
// floats of shared memory, which the caller may reuse only after its next barrier.
template <int kWarps>
__device__ __forceinline__ float block_max(float x, float* sm_warp) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  const int tid = threadIdx.x;
  if ((tid & 31) == 0) sm_warp[tid >> 5] = x;
  __syncthreads();
  float mx = sm_warp[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) mx = fmaxf(mx, sm_warp[w]);
  return mx;
}

}  // namespace minipaged
