// One-launch split merge through distributed shared memory (sm_90; DecodePlan::cluster, the
// A/B builds with MINIPAGED_DECODE_CLUSTER): the splits of one (sequence, KV head, head chunk)
// are the CTAs of one thread-block cluster, rank r being split r, and rank r merges the output
// items (row, 4 dims) r, r + C, r + 2C, ... of the C splits and writes them (and lse) itself.
// So a split decode needs no partial workspace, no arrival counter and no second launch, and
// the merge waits for the cluster's CTAs instead of a grid's completion plus a round trip to L2.
// Two ways of moving the partials (the kernel's CLUSTER template value):
//   kClusterPull (1): each CTA leaves its normalised partial and log2-sum-exp in its own shared
//     memory; after a cluster barrier (release / acquire, a MEMBAR.GPU on each CTA's side)
//     every CTA loads its items of all C partials over DSMEM; a second barrier keeps each
//     CTA's shared memory alive until all have read it.
//   kClusterPush (2): each CTA stores every item of its partial into the shared memory of the
//     rank that merges it, and every log2-sum-exp into all ranks, with st.async, which counts
//     the bytes on the receiver's mbarrier; a rank merges once its barrier has seen all its
//     bytes. No MEMBAR: both cluster barrier arrivals are relaxed (one after the mbarriers'
//     initialisation at the kernel's start, behind fence.mbarrier_init, one before exit).
//
// The merge is decode_reduce_kernel's: the row max of the C log2-sum-exps, weights
// ex2(lse_j - max), o = sum_j w_j partial_j / sum_j w_j, in split order; both ways give the
// same bits. A split past its sequence's splits (or its context) has lse -inf, weight 0. A
// launch without a cluster is a cluster of one, whose merge returns the partial as it is.
#pragma once
#include <cmath>
#include <cstdint>

#include "decode/common.cuh"
#include "decode/reduce.cuh"
#include "ptx/cluster.cuh"
#include "ptx/ldmatrix.cuh"
#include "ptx/misc.cuh"
#include "ptx/tma.cuh"

namespace minipaged {
namespace {

constexpr int kMaxClusterSplits = 16;  // the non-portable cluster size limit of sm_90
constexpr int kClusterPull = 1;
constexpr int kClusterPush = 2;

// This CTA's split, output item (row, dims 4 c4 .. 4 c4 + 3): its warps' states combined per
// element as merge_warps_and_store combines them (merge_warps_element), times out_scale (FP8
// caches), and the row's log2-sum-exp.
template <int kNumWarps, int kRowsPerCta, int D, bool kScaleOut>
__device__ __forceinline__ float4 split_partial_item(const float* sm_m, const float* sm_l, const float* sm_o, int row,
                                                     int c4, float out_scale, float& lse) {
  float out[4];
  float mref, L;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    out[k] = merge_warps_element<kNumWarps, kRowsPerCta, D>(sm_m, sm_l, sm_o, row, 4 * c4 + k, mref, L);
    if constexpr (kScaleOut) out[k] *= out_scale;
  }
  lse = L > 0.f ? mref + log2f(L) : -INFINITY;
  return make_float4(out[0], out[1], out[2], out[3]);
}

// Merges item (row, c4) from the partials x[j] (log2-sum-exp) and v[j] of splits j < splits
// (the entries past them are never read) and stores o and, for c4 == 0, lse.
template <typename T>
__device__ __forceinline__ void merge_cluster_item(const DecodeParams& p, const DecodeSlice& slice, int row, int c4,
                                                   int splits, const float (&x)[kMaxClusterSplits],
                                                   const float4 (&v)[kMaxClusterSplits]) {
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < kMaxClusterSplits; ++j)
    if (j < splits) mx = fmaxf(mx, x[j]);
  const float mref = mx == -INFINITY ? 0.f : mx;
  float total = 0.f;
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int j = 0; j < kMaxClusterSplits; ++j) {
    if (j < splits) {
      const float w = fast_exp2(x[j] - mref);
      total += w;
      fma4(o, w, v[j]);
    }
  }
  const float inv = total > 0.f ? 1.f / total : 0.f;
  int out_row, h;
  int64_t split_row;
  decode_out_row<false>(p, slice, row, out_row, h, split_row);
  if (p.lse != nullptr && c4 == 0)
    p.lse[out_row * p.lse_batch_stride + h] = total > 0.f ? (mref + log2f(total)) * kLn2 : -INFINITY;
  store4(static_cast<T*>(p.o) + out_row * p.o_batch_stride + h * p.o_head_stride + c4 * 4, o, inv);
}

// This rank's items (rank + k * splits for k = threadIdx.x, threadIdx.x + kThreads, ...; a
// decode's G rows: at most one per thread): load(j, item, k, row, x_j, v_j) fetches split j's
// log2-sum-exp and partial of the item for every j < kMaxClusterSplits (the entries past
// `splits` are never read), all before merge_cluster_item uses any.
template <typename T, int kThreads, int kCols4, class Load>
__device__ __forceinline__ void merge_rank_items(const DecodeParams& p, const DecodeSlice& slice, int items, int rank,
                                                 int splits, Load load) {
  for (int k = threadIdx.x; rank + k * splits < items; k += kThreads) {
    const int item = rank + k * splits;
    const int row = item / kCols4;
    float x[kMaxClusterSplits];
    float4 v[kMaxClusterSplits];
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j) load(j, item, k, row, x[j], v[j]);
    merge_cluster_item<T>(p, slice, row, item - row * kCols4, splits, x, v);
  }
}

// kClusterPull. Called by every thread of every CTA of the cluster (it holds the cluster
// barriers), after the warps' states are in shared memory (merge_warps_and_store's inputs).
template <typename T, int kNumWarps, int kRowsPerCta, int D, bool kScaleOut = false>
__device__ __forceinline__ void cluster_pull_merge_and_store(const DecodeParams& p, const DecodeSlice& slice,
                                                             const float* sm_m,  // [kNumWarps][kRowsPerCta]
                                                             const float* sm_l,  // [kNumWarps][kRowsPerCta]
                                                             const float* sm_o,  // [kNumWarps][kRowsPerCta][D]
                                                             float out_scale = 1.f) {
  constexpr int kCols4 = D / 4;
  constexpr int kThreads = kNumWarps * 32;
  __shared__ float4 sm_part[kRowsPerCta * kCols4];  // this split's normalised partial [row][D / 4]
  __shared__ float sm_lse[kRowsPerCta];              // and its log2-sum-exp per row
  const int ng = slice.ng;
  const int items = ng * kCols4;
  for (int it = threadIdx.x; it < items; it += kThreads) {
    const int row = it / kCols4;
    float lse;
    sm_part[it] = split_partial_item<kNumWarps, kRowsPerCta, D, kScaleOut>(sm_m, sm_l, sm_o, row, it - row * kCols4,
                                                                          out_scale, lse);
    if (it == row * kCols4) sm_lse[row] = lse;
  }
  cluster_arrive_release();
  cluster_wait_acquire();  // every split's partial is in its CTA's shared memory

  const int rank = static_cast<int>(cluster_ctarank());
  const int splits = static_cast<int>(cluster_nctarank());
  // every load first (independent), so that the 2C remote reads are in flight together
  merge_rank_items<T, kThreads, kCols4>(p, slice, items, rank, splits,
                                        [&](int j, int item, int, int row, float& x, float4& v) {
                                          const bool on = j < splits;
                                          x = on ? ld_shared_cluster_f32(cluster_map_shared(sm_lse + row, j))
                                                 : -INFINITY;
                                          v = on ? ld_shared_cluster_f32x4(cluster_map_shared(sm_part + item, j))
                                                 : make_float4(0.f, 0.f, 0.f, 0.f);
                                        });
  // This CTA has read what it needs of the others (the release orders those reads before the
  // arrival); no CTA's shared memory goes away while another may still read it.
  cluster_arrive_release();
  cluster_wait_acquire();
}

// kClusterPush: what a rank receives, [source split][...], and the mbarrier that counts it.
template <int kRowsPerCta, int D>
struct ClusterPushSmem {
  static constexpr int kItems = kRowsPerCta * D / 4;
  uint64_t bar;
  float lse[kMaxClusterSplits][kRowsPerCta];
  // source j's k-th item for this rank at o[j * slots + k], slots = ceil(items / C)
  float4 o[kItems + kMaxClusterSplits];
};
template <int kRowsPerCta, int D>
__device__ __forceinline__ ClusterPushSmem<kRowsPerCta, D>& cluster_push_smem() {
  __shared__ ClusterPushSmem<kRowsPerCta, D> sm;
  return sm;
}

// kClusterPush, at the kernel's start (every thread; ng as the slice has it, the same in every
// CTA of the cluster): the receiving mbarrier expects C log2-sum-exps per row and C partials of
// each of this rank's items; the relaxed arrive here is waited on in the merge, before the
// first st.async, so that no store reaches a barrier before its initialisation.
template <int kRowsPerCta, int D>
__device__ __forceinline__ void cluster_push_begin(int ng) {
#if MINIPAGED_WGMMA_DEVICE
  if (threadIdx.x == 0) {
    auto& sm = cluster_push_smem<kRowsPerCta, D>();
    const int rank = static_cast<int>(cluster_ctarank());
    const int splits = static_cast<int>(cluster_nctarank());
    const int items = ng * (D / 4);
    const int mine = items > rank ? (items - 1 - rank) / splits + 1 : 0;
    const uint32_t bar = smem_u32(&sm.bar);
    mbar_init(bar, 1);
    mbar_fence_init();
    mbar_arrive_expect_tx(bar, static_cast<uint32_t>(splits * (mine * 16 + ng * 4)));
  }
  cluster_arrive_relaxed();
#else
  __trap();  // (the push merge is built for sm_90a only)
#endif
}

template <typename T, int kNumWarps, int kRowsPerCta, int D, bool kScaleOut = false>
__device__ __forceinline__ void cluster_push_merge_and_store(const DecodeParams& p, const DecodeSlice& slice,
                                                             const float* sm_m, const float* sm_l, const float* sm_o,
                                                             float out_scale = 1.f) {
#if MINIPAGED_WGMMA_DEVICE
  constexpr int kCols4 = D / 4;
  constexpr int kThreads = kNumWarps * 32;
  auto& sm = cluster_push_smem<kRowsPerCta, D>();
  const int rank = static_cast<int>(cluster_ctarank());
  const int splits = static_cast<int>(cluster_nctarank());
  const int ng = slice.ng;
  const int items = ng * kCols4;
  const int slots = (items + splits - 1) / splits;
  const uint32_t bar = smem_u32(&sm.bar);
  const uint32_t o_base = smem_u32(sm.o);
  const uint32_t lse_base = smem_u32(&sm.lse[0][0]);
  cluster_wait_acquire();  // (cluster_push_begin's arrive) every rank's barrier expects its bytes
  for (int it = threadIdx.x; it < items; it += kThreads) {
    const int row = it / kCols4;
    float lse;
    const float4 part = split_partial_item<kNumWarps, kRowsPerCta, D, kScaleOut>(sm_m, sm_l, sm_o, row,
                                                                                it - row * kCols4, out_scale, lse);
    const int dst = it % splits;
    st_async_f32x4(cluster_map_shared(o_base + (rank * slots + it / splits) * 16, dst), part,
                   cluster_map_shared(bar, dst));
    if (it == row * kCols4) {
      for (int j = 0; j < splits; ++j)
        st_async_f32(cluster_map_shared(lse_base + (rank * kRowsPerCta + row) * 4, j), lse,
                     cluster_map_shared(bar, j));
    }
  }
  // every partial of this rank's items, and every log2-sum-exp, has landed (cluster scope:
  // other CTAs' st.async complete the phase)
  mbar_wait<true>(bar, 0);
  // (unconditional loads, no branch per split: past the splits, source 0's entries again)
  merge_rank_items<T, kThreads, kCols4>(p, slice, items, rank, splits,
                                        [&](int j, int, int k, int row, float& x, float4& v) {
                                          const int src = j < splits ? j : 0;
                                          x = sm.lse[src][row];
                                          v = sm.o[src * slots + k];
                                        });
  // Every rank has received all its bytes before it arrives, so once all have arrived no
  // st.async of any CTA is still in flight: then a CTA may exit.
  cluster_arrive_relaxed();
  cluster_wait_acquire();
#else
  __trap();
#endif
}

}  // namespace
}  // namespace minipaged
