// One-launch split merge through distributed shared memory (sm_90; DecodePlan::cluster, the
// A/B builds with MINIPAGED_DECODE_CLUSTER): the splits of one (sequence, KV head, head chunk)
// are the CTAs of one thread-block cluster, rank r being split r. Each CTA leaves its split's
// normalised partial output and log2-sum-exp in its own shared memory; after a cluster barrier,
// rank r merges the (row, 4-dim) output items r, r + C, r + 2C, ... by reading those items of
// all C partials over DSMEM, and writes o (and lse) itself. So a split decode needs no
// partial workspace, no arrival counter and no second launch, and the merge waits on a
// cluster barrier instead of a grid's completion plus a round trip to L2.
//
// The merge is decode_reduce_kernel's: the row max of the C log2-sum-exps, weights
// ex2(lse_j - max), o = sum_j w_j partial_j / sum_j w_j, in split order. A split past its
// sequence's splits (or past its context) leaves lse -inf, weight 0. A launch without a cluster
// is a cluster of one, whose merge returns the partial as it is (weight 1, sum 1).
#pragma once
#include <cmath>
#include <cstdint>

#include "decode/common.cuh"
#include "decode/reduce.cuh"
#include "ptx/cluster.cuh"
#include "ptx/misc.cuh"

namespace minipaged {
namespace {

constexpr int kMaxClusterSplits = 16;  // the non-portable cluster size limit of sm_90

// Called by every thread of every CTA of the cluster (it holds the cluster barriers), after the
// warps' online-softmax states are in shared memory (merge_warps_and_store's inputs).
template <typename T, int kNumWarps, int kRowsPerCta, int D, bool kScaleOut = false>
__device__ __forceinline__ void cluster_merge_and_store(const DecodeParams& p, const DecodeSlice& slice,
                                                        const float* sm_m,  // [kNumWarps][kRowsPerCta]
                                                        const float* sm_l,  // [kNumWarps][kRowsPerCta]
                                                        const float* sm_o,  // [kNumWarps][kRowsPerCta][D]
                                                        float out_scale = 1.f) {
  constexpr int kCols4 = D / 4;
  constexpr int kThreads = kNumWarps * 32;
  static_assert(kRowsPerCta * kCols4 <= kThreads, "one item per thread, even in a cluster of one");
  __shared__ float4 sm_part[kRowsPerCta * kCols4];  // this split's normalised partial [row][D]
  __shared__ float sm_lse[kRowsPerCta];              // and its log2-sum-exp per row
  const int ng = slice.ng;

  // This CTA's warps -> its split's partial (merge_warps_and_store's arithmetic).
  float* part = reinterpret_cast<float*>(sm_part);
  for (int idx = threadIdx.x; idx < ng * D; idx += kThreads) {
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
    part[row * D + col] = out;
    if (col == 0) sm_lse[row] = L > 0.f ? mref + log2f(L) : -INFINITY;
  }
  cluster_arrive_release();
  cluster_wait_acquire();  // every split's partial is in its CTA's shared memory

  const int rank = static_cast<int>(cluster_ctarank());
  const int splits = static_cast<int>(cluster_nctarank());
  const int items = ng * kCols4;
  const int item = rank + splits * static_cast<int>(threadIdx.x);
  const bool valid = item < items;
  const int row = valid ? item / kCols4 : 0;
  const int c4 = item - row * kCols4;
  // Every load first (predicated, independent), so that the 2C remote reads are in flight together.
  float x[kMaxClusterSplits];
  float4 v[kMaxClusterSplits];
#pragma unroll
  for (int j = 0; j < kMaxClusterSplits; ++j) {
    const bool on = valid && j < splits;
    x[j] = on ? ld_shared_cluster_f32(cluster_map_shared(sm_lse + row, j)) : -INFINITY;
    v[j] = on ? ld_shared_cluster_f32x4(cluster_map_shared(sm_part + row * kCols4 + c4, j))
              : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < kMaxClusterSplits; ++j) mx = fmaxf(mx, x[j]);
  const float mref = mx == -INFINITY ? 0.f : mx;
  float total = 0.f;
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int j = 0; j < kMaxClusterSplits; ++j) {
    if (j < splits) {  // (past them: weight ex2(-inf) = 0 times 0, skipped)
      const float w = fast_exp2(x[j] - mref);
      total += w;
      fma4(o, w, v[j]);
    }
  }
  // This CTA has read what it needs of the others: they may exit once every CTA has.
  cluster_arrive_release();
  if (valid) {
    const float inv = total > 0.f ? 1.f / total : 0.f;
    int out_row, h;
    int64_t split_row;
    decode_out_row<false>(p, slice, row, out_row, h, split_row);
    if (p.lse != nullptr && c4 == 0)
      p.lse[out_row * p.lse_batch_stride + h] = total > 0.f ? (mref + log2f(total)) * kLn2 : -INFINITY;
    T* op = static_cast<T*>(p.o) + out_row * p.o_batch_stride + h * p.o_head_stride + c4 * 4;
    store4(op, o, inv);
  }
  cluster_wait_acquire();  // no CTA's shared memory goes away while another may read it
}

}  // namespace
}  // namespace minipaged
