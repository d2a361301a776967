// Split-KV reduction of paged decode (flash-decoding): merges the normalised
// partial outputs and log2-sum-exps that the split CTAs of either decode kernel
// wrote. Included by decode/launch.cu only.
#pragma once
#include <cmath>
#include <cstdint>

#include "decode/common.cuh"
#include "ptx/misc.cuh"

namespace minipaged {
namespace {

// Most splits of one row: one log-sum-exp per reduction thread.
constexpr int kMaxSplits = 256;

// Merges the splits of one (sequence, query head), parallel over the splits:
// a CTA of kReduceThreads reads ROWS split rows at once, each as D/4 float4s,
// so the whole [num_splits, D] slab is requested in a few dependent rounds
// instead of one round per split. The max, the weights and the row sums are
// combined in a fixed order, so the result is deterministic.
constexpr int kReduceThreads = 256;
static_assert(kMaxSplits <= kReduceThreads, "one log-sum-exp per thread");

template <typename T, int D>
__global__ void __launch_bounds__(kReduceThreads) decode_reduce_kernel(const DecodeParams p) {
  constexpr int LANES = D / 4;                  // threads covering one split row
  constexpr int ROWS = kReduceThreads / LANES;  // split rows in flight per round
  constexpr int kRedWarps = kReduceThreads / 32;
  __shared__ float sm_w[kReduceThreads];
  __shared__ float sm_warp[kRedWarps];
  __shared__ float4 sm_o[ROWS][LANES];
  // Launched early (programmatic dependent launch): wait until the split
  // kernel has finished and its partials are visible.
  griddep_wait();
  const int h = blockIdx.x;
  const int b = blockIdx.y;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int S = p.num_splits;
  const int64_t row0 = (static_cast<int64_t>(b) * p.num_q_heads + h) * S;

  const float x = tid < S ? p.partial_lse[row0 + tid] : -INFINITY;
  float mx = x;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (lane == 0) sm_warp[warp] = mx;
  __syncthreads();
  mx = sm_warp[0];
#pragma unroll
  for (int w = 1; w < kRedWarps; ++w) mx = fmaxf(mx, sm_warp[w]);
  const float mref = mx == -INFINITY ? 0.f : mx;
  const float w = fast_exp2(x - mref);  // 0 for empty splits and tid >= S
  sm_w[tid] = w;
  float L = w;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
  __syncthreads();  // sm_w complete; every thread has read sm_warp (max)
  if (lane == 0) sm_warp[warp] = L;

  const int col = tid % LANES;
  const int r = tid / LANES;
  const float4* po = reinterpret_cast<const float4*>(p.partial_o + row0 * D) + col;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
  for (int s = r; s < S; s += ROWS) {
    const float ws = sm_w[s];
    const float4 v = po[static_cast<int64_t>(s) * LANES];
    acc.x = fmaf(ws, v.x, acc.x);
    acc.y = fmaf(ws, v.y, acc.y);
    acc.z = fmaf(ws, v.z, acc.z);
    acc.w = fmaf(ws, v.w, acc.w);
  }
  sm_o[r][col] = acc;
  __syncthreads();
  if (r == 0) {
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < kRedWarps; ++i) total += sm_warp[i];
    float4 o = sm_o[0][col];
#pragma unroll
    for (int i = 1; i < ROWS; ++i) {
      const float4 v = sm_o[i][col];
      o.x += v.x, o.y += v.y, o.z += v.z, o.w += v.w;
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    if (p.lse != nullptr && col == 0)
      p.lse[b * p.lse_batch_stride + h] = total > 0.f ? (mref + log2f(total)) * kLn2 : -INFINITY;
    T* op = static_cast<T*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + col * 4;
    op[0] = Convert<T>::from_float(o.x * inv);
    op[1] = Convert<T>::from_float(o.y * inv);
    op[2] = Convert<T>::from_float(o.z * inv);
    op[3] = Convert<T>::from_float(o.w * inv);
  }
}

}  // namespace
}  // namespace minipaged
