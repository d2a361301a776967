// Split-KV merge inside a thread-block cluster (sm_90): the splits of one
// (sequence, KV head, head chunk) are the CTAs of one cluster, launched with
// cluster dims (num_splits, 1, 1). Each CTA leaves its split's normalised
// partial and log2-sum-exp in its own shared memory; after one cluster
// barrier, CTA r merges slice r of the outputs over every split through
// distributed shared memory and writes it. This replaces the second kernel of
// the two-launch reduction (decode/reduce.cuh), which on a small batch costs
// 2-2.5 us of a 13 us call: it waits for the whole split grid, then reads the
// partials back through L2 (bench/results/nvidia-h200/decode_cluster/).
// Included by the decode kernels (scalar.cuh, mma.cuh) for their CLUSTER
// instantiations.
#pragma once
#include <cmath>
#include <cstdint>

#include "decode/common.cuh"

namespace minipaged {
namespace {

// Most splits one cluster merges: clusters above 8 CTAs are non-portable
// (cudaFuncAttributeNonPortableClusterSizeAllowed); sm_90 allows 16.
constexpr int kMaxClusterSplits = 16;

// All threads of all CTAs of the cluster; orders shared-memory writes before
// the barrier with reads after it, across the cluster.
__device__ __forceinline__ void cluster_barrier() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// The float at `local` (this CTA's shared memory) in cluster CTA `rank`.
__device__ __forceinline__ float ld_cluster_f32(const float* local, uint32_t rank) {
  float v = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(local));
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
#endif
  return v;
}

// merge_warps_and_store for a split of a cluster (p.num_splits > 1, the cluster
// rank is slice.split). sm_o is overwritten: warp 0's rows receive the split's
// normalised partial (each element is read and written by one thread only).
// The cross-split merge weighs split j by ex2(lse_j - max lse), as
// decode_reduce_kernel does, summing in split order (deterministic).
template <typename T, int kNumWarps, int kRowsPerCta, int D, bool kScaleOut = false, class DimOf = IdentityDim>
__device__ __forceinline__ void merge_warps_in_cluster(const DecodeParams& p, const DecodeSlice& slice,
                                                       const float* sm_m,  // [kNumWarps][kRowsPerCta]
                                                       const float* sm_l,  // [kNumWarps][kRowsPerCta]
                                                       float* sm_o,        // [kNumWarps][kRowsPerCta][D]
                                                       float out_scale = 1.f, DimOf dim_of = {}) {
  constexpr int kThreads = kNumWarps * 32;
  __shared__ float sm_lse[kRowsPerCta];  // the split's log2-sum-exp per row
  const int n = slice.ng * D;
  for (int idx = threadIdx.x; idx < n; idx += kThreads) {
    const int row = idx / D;
    const int col = idx - row * D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) mx = fmaxf(mx, sm_m[w * kRowsPerCta + row]);
    const float mref = mx == -INFINITY ? 0.f : mx;
    float L = 0.f, O = 0.f;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) {
      const float c = fast_exp2(sm_m[w * kRowsPerCta + row] - mref);
      L += sm_l[w * kRowsPerCta + row] * c;
      O += sm_o[(w * kRowsPerCta + row) * D + col] * c;
    }
    float out = L > 0.f ? O / L : 0.f;
    if constexpr (kScaleOut) out *= out_scale;
    sm_o[row * D + col] = out;
    if (col == 0) sm_lse[row] = L > 0.f ? mref + log2f(L) : -INFINITY;
  }
  cluster_barrier();  // every split's partial is in its shared memory

  const int S = p.num_splits;
  const int chunk = (n + S - 1) / S;
  const int lo = slice.split * chunk;
  const int hi = min(lo + chunk, n);
  for (int idx = lo + static_cast<int>(threadIdx.x); idx < hi; idx += kThreads) {
    const int row = idx / D;
    const int col = idx - row * D;
    float x[kMaxClusterSplits];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j) {
      x[j] = j < S ? ld_cluster_f32(sm_lse + row, j) : -INFINITY;
      mx = fmaxf(mx, x[j]);
    }
    const float mref = mx == -INFINITY ? 0.f : mx;
    float L = 0.f, O = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j) {
      if (j < S) {
        const float w = fast_exp2(x[j] - mref);  // 0 for an empty split
        L += w;
        O = fmaf(w, ld_cluster_f32(sm_o + row * D + col, j), O);
      }
    }
    const int h = slice.h0 + row;
    T* op = static_cast<T*>(p.o) + slice.row * p.o_batch_stride + h * p.o_head_stride;
    op[dim_of(col)] = Convert<T>::from_float(L > 0.f ? O / L : 0.f);
    if (p.lse != nullptr && col == 0)
      p.lse[slice.row * p.lse_batch_stride + h] = L > 0.f ? (mref + log2f(L)) * kLn2 : -INFINITY;
  }
  cluster_barrier();  // no CTA leaves while another still reads its shared memory
}

}  // namespace
}  // namespace minipaged
