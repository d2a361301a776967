// Split-KV reduction of paged decode (flash-decoding): merges the normalised
// partial outputs and log2-sum-exps that the split CTAs of either decode kernel
// wrote. Included by decode/select.cuh (the kernel slices) and decode/launch.cu.
#pragma once
#include <cmath>
#include <cstdint>

#include "decode/common.cuh"
#include "decode/trace.cuh"
#include "ptx/misc.cuh"
#include "split_merge.cuh"

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
static_assert(kWorklistMaxSplits == kMaxSplits, "a work list's splits fit one merge");
// Split rows one chain of decode_reduce_kernel covers: thread (r, col) of
// that kernel accumulates splits r, r + ROWS, ... of its four dims.
template <int D>
constexpr int kReduceRows = kReduceThreads / (D / 4);

// Split rows per reduction thread loaded before the weights are known: all of
// them up to 4 * ROWS splits (32 at D = 128, 64 at D = 64).
constexpr int kPrefetch = 4;

// acc += w * v, one fmaf per component: the single update every merge chain
// (two-launch and fused) applies, so both round identically.
__device__ __forceinline__ void fma4(float4& acc, float w, const float4& v) {
  acc.x = fmaf(w, v.x, acc.x);
  acc.y = fmaf(w, v.y, acc.y);
  acc.z = fmaf(w, v.z, acc.z);
  acc.w = fmaf(w, v.w, acc.w);
}

// The four output dims o * inv at op[0..3], in T.
template <typename T>
__device__ __forceinline__ void store4(T* op, const float4& o, float inv) {
  op[0] = Convert<T>::from_float(o.x * inv);
  op[1] = Convert<T>::from_float(o.y * inv);
  op[2] = Convert<T>::from_float(o.z * inv);
  op[3] = Convert<T>::from_float(o.w * inv);
}

// The q / o / lse row of merge grid row b: b itself, or the packed row of a packed-query (PQ) or
// short-run (MQ: b = sequence * max_seqlen_q + query) decode row.
template <bool PQ, bool MQ>
__device__ __forceinline__ int merge_out_row(const DecodeParams& p, int b) {
  if constexpr (MQ) {
    const int seq = b / p.max_seqlen_q;
    return p.cu_seqlens_q[seq] + (b - seq * p.max_seqlen_q);
  } else if constexpr (PQ) {
    return p.cu_seqlens_q[b];
  }
  return b;
}

// Output float4 col of a merged (row, query head h): o / total into o, and (col 0) the row's
// natural-log lse from its log2 max mref and weight sum total. Every merge ends here.
template <typename T>
__device__ __forceinline__ void store_merged(const DecodeParams& p, int out_row, int h, int col, const float4& o,
                                             float mref, float total) {
  const float inv = total > 0.f ? 1.f / total : 0.f;
  if (p.lse != nullptr && col == 0)
    p.lse[out_row * p.lse_batch_stride + h] = total > 0.f ? (mref + log2f(total)) * kLn2 : -INFINITY;
  store4(static_cast<T*>(p.o) + out_row * p.o_batch_stride + h * p.o_head_stride + col * 4, o, inv);
}

// The merge of one (row b, query head h) over its S >= 2 split rows, whose partials start at
// partial row row0 (the caller has waited for the split kernel): every thread of the CTA, its
// shared memory sm_w [kReduceThreads], sm_warp [kReduceThreads / 32], sm_o [ROWS][D / 4].
// PQ / MQ: b is the reduce grid's row, mapped to its packed output row.
template <typename T, int D, bool PQ, bool MQ>
__device__ __forceinline__ void merge_split_rows(const DecodeParams& p, int h, int b, int S, int64_t row0,
                                                 float* sm_w, float* sm_warp,
                                                 float4 (*sm_o)[D / 4]) {  // [kReduceThreads / (D / 4)]
  constexpr int LANES = D / 4;                  // threads covering one split row
  constexpr int ROWS = kReduceThreads / LANES;  // split rows in flight per round
  constexpr int kRedWarps = kReduceThreads / 32;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;

  // The first kPrefetch split rows of this thread's chain are requested together
  // with the log-sum-exps: one round trip to L2 instead of two before the sums
  // can start (0.7 of the 2.3 us this merge took at B=1 on the H200,
  // bench/results/nvidia-h200/decode_merge/). The arithmetic below is unchanged
  // (same operands, same order).
  const int col = tid % LANES;
  const int r = tid / LANES;
  const float4* po = reinterpret_cast<const float4*>(p.partial_o + row0 * D) + col;
  float4 pre[kPrefetch];
#pragma unroll
  for (int i = 0; i < kPrefetch; ++i) {
    const int s = r + i * ROWS;
    pre[i] = s < S ? po[static_cast<int64_t>(s) * LANES] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const float x = tid < S ? p.partial_lse[row0 + tid] : -INFINITY;
  const float mx = block_max<kRedWarps>(x, sm_warp);
  const float mref = mx == -INFINITY ? 0.f : mx;
  const float w = fast_exp2(x - mref);  // 0 for empty splits and tid >= S
  sm_w[tid] = w;
  float L = w;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
  __syncthreads();  // sm_w complete; every thread has read sm_warp (max)
  if (lane == 0) sm_warp[warp] = L;

  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int i = 0; i < kPrefetch; ++i) {
    const int s = r + i * ROWS;
    if (s < S) fma4(acc, sm_w[s], pre[i]);
  }
#pragma unroll 8
  for (int s = r + kPrefetch * ROWS; s < S; s += ROWS) fma4(acc, sm_w[s], po[static_cast<int64_t>(s) * LANES]);
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
    // Packed queries: the row is looked up here, not kept live through the
    // loop (one register more spills at sm_80's 32-register cap).
    store_merged<T>(p, merge_out_row<PQ, MQ>(p, b), h, col, o, mref, total);
  }
}

// The weights of one merge row, by one warp: sm_w[s] = ex2(lse_s - mref) for the S splits
// (lane j takes splits j, 32 + j, ...), mref the row max (0 if every split is empty), total their
// sum as warp butterflies over splits [32i, 32i + 32) added in order: decode_reduce_kernel's
// weights bit for bit. Partials come from other CTAs: read at L2 (.cg), never from a line this
// SM's L1 may hold from an earlier call.
struct SplitWeights {
  float mref, total;
};
__device__ __forceinline__ SplitWeights warp_split_weights(const float* lse, int S, float* sm_w) {
  constexpr int kChunks = kMaxSplits / 32;
  const int lane = threadIdx.x & 31;
  float x[kChunks];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int s = i * 32 + lane;
    x[i] = s < S ? __ldcg(lse + s) : -INFINITY;
    mx = fmaxf(mx, x[i]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  const float mref = mx == -INFINITY ? 0.f : mx;
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    if (i * 32 < S) {  // a chunk past S adds +0: skipping it is exact
      const float w = fast_exp2(x[i] - mref);
      if (i * 32 + lane < S) sm_w[i * 32 + lane] = w;
      float L = w;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
      total += L;
    }
  }
  return {mref, total};
}

// One (row b, query head h) merge by one warp, for the merge grid of one warp per query head
// (params.h kDecodeVariantWarpMerge): merge_split_rows' arithmetic operation for operation (the
// row max; weights ex2(lse_s - max); their sum as warp butterflies over splits [32i, 32i + 32)
// added in order; per output float4, ROWS fma chains over splits r, r + ROWS, ... added in chain
// order; o * (1 / sum)), so that it, the CTA merge and the fused one agree bitwise. The CTA merge
// spends 256 threads and two barriers on a row of a few splits; a warp needs neither barrier,
// and a grid of one CTA per 8 heads has an eighth of the CTAs. Lane c < D / 4 owns output float4
// c and runs all ROWS chains of it. sm_w: this warp's kMaxSplits weights.
template <typename T, int D, bool PQ, bool MQ>
__device__ __forceinline__ void merge_split_row_warp(const DecodeParams& p, int h, int b, int S, int64_t row0,
                                                     float* sm_w) {
  constexpr int LANES = D / 4;
  constexpr int ROWS = kReduceRows<D>;
  constexpr int kPre = ROWS < 8 ? ROWS : 8;  // split rows requested with the log-sum-exps
  static_assert(LANES <= 32, "one lane per output float4");
  const int lane = threadIdx.x & 31;
  const bool owner = lane < LANES;
  const float4* po = reinterpret_cast<const float4*>(p.partial_o + row0 * D) + (owner ? lane : 0);
  float4 pre[kPre];
#pragma unroll
  for (int s = 0; s < kPre; ++s)
    pre[s] = owner && s < S ? __ldcg(po + static_cast<int64_t>(s) * LANES) : make_float4(0.f, 0.f, 0.f, 0.f);
  const SplitWeights sw = warp_split_weights(p.partial_lse + row0, S, sm_w);
  __syncwarp();
  if (!owner) return;
  float4 acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    acc[r] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < S) fma4(acc[r], sm_w[r], r < kPre ? pre[r] : __ldcg(po + static_cast<int64_t>(r) * LANES));
  }
  for (int k0 = ROWS; k0 < S; k0 += ROWS) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
      if (k0 + r < S) fma4(acc[r], sm_w[k0 + r], __ldcg(po + static_cast<int64_t>(k0 + r) * LANES));
  }
  float4 o = acc[0];
#pragma unroll
  for (int r = 1; r < ROWS; ++r) o.x += acc[r].x, o.y += acc[r].y, o.z += acc[r].z, o.w += acc[r].w;
  store_merged<T>(p, merge_out_row<PQ, MQ>(p, b), h, lane, o, sw.mref, sw.total);
}

// Query heads per CTA of the warp-per-head merge grid (decode_reduce_kernel's WARPS, splits.h):
// a warp each.
static_assert(kReduceWarpHeads == kReduceThreads / 32, "one warp per query head");

// PQ (packed queries, DecodeParams::cu_seqlens_q): only decode-row sequences
// are merged, into their packed row; the other CTAs return at once.
// MQ (short query runs, DecodeParams::max_seqlen_q): blockIdx.y is (sequence b,
// query i) as b * max_seqlen_q + i, merged into row cu_seqlens_q[b] + i when
// sequence b is a short run of more than i queries.
// WL: a work list's merge (DecodeParams::worklist, the plan's per-sequence entries).
// GROUPED (WL only; variant bit kDecodeVariantWorklistGroupedMerge): blockIdx.y covers
// kWorklistMergeSeqs sequences, so that a batch of short sequences, nearly all of one slot,
// dispatches a quarter of the CTAs; the CTA merges those of its sequences that took 2+ slots
// one after the other.
// WARPS (params.h kDecodeVariantWarpMerge): blockIdx.x covers kReduceWarpHeads query heads, one
// warp each (merge_split_row_warp), instead of one head per CTA.
template <typename T, int D, bool PQ = false, bool MQ = false, bool WL = false, bool GROUPED = false,
          bool WARPS = false>
__global__ void __launch_bounds__(kReduceThreads) decode_reduce_kernel(const DecodeParams p) {
  static_assert(!WL || (!PQ && !MQ), "work lists: plain decode");
  static_assert(!GROUPED || WL, "grouped merges: work lists");
  static_assert(!(GROUPED && WARPS), "a grouped merge has one head per CTA");
  constexpr int LANES = D / 4;                  // threads covering one split row
  constexpr int ROWS = kReduceThreads / LANES;  // split rows in flight per round
  constexpr int kRedWarps = kReduceThreads / 32;
  // (the warp merge's weights, kMaxSplits per warp, share the buffer of the CTA merge's)
  __shared__ float sm_w[WARPS ? kReduceWarpHeads * kMaxSplits : kReduceThreads];
  __shared__ float sm_warp[kRedWarps];
  __shared__ float4 sm_o[WARPS ? 1 : ROWS][LANES];
  reduce_trace(kRtEntry);
  reduce_trace(kRtSm);
  if constexpr (GROUPED) {
    const int h = blockIdx.x;
    // Entries first when the early merge is on (the planner's grid completed before any split
    // CTA passed its own wait, so they are in L2), else after the wait, as below.
    if (!decode_worklist_early_merge(p)) griddep_wait();
    __shared__ int2 sm_seq[kWorklistMergeSeqs];
    const int b0 = static_cast<int>(blockIdx.y) * kWorklistMergeSeqs;
    if (threadIdx.x < kWorklistMergeSeqs)
      sm_seq[threadIdx.x] = b0 + static_cast<int>(threadIdx.x) < p.batch
                                ? decode_worklist_seq(p, b0 + static_cast<int>(threadIdx.x))
                                : make_int2(1, 0);
    __syncthreads();
    bool merged = false;
#pragma unroll
    for (int i = 0; i < kWorklistMergeSeqs; ++i) {
      const int2 e = sm_seq[i];  // (slots, first slot); CTA-uniform
      if (e.x == 1) continue;
      if (merged) {
        __syncthreads();  // the last merge's threads are done with the shared buffers
      } else {
        griddep_wait();  // (once: the split grid has completed and its partials are visible)
        reduce_trace(kRtWaited);
      }
      merged = true;
      merge_split_rows<T, D, false, false>(p, h, b0 + i, e.x, e.y + static_cast<int64_t>(h) * p.worklist, sm_w,
                                           sm_warp, sm_o);
    }
    reduce_trace(kRtExit);
    return;
  }
  // cu_seqlens_q is an input of the call, not an output of the split kernel:
  // it is read before the wait.
  const int seq = MQ ? static_cast<int>(blockIdx.y) / p.max_seqlen_q : static_cast<int>(blockIdx.y);
  if constexpr (MQ) {
    const int q_len = p.cu_seqlens_q[seq + 1] - p.cu_seqlens_q[seq];
    if (q_len < 2 || q_len > p.max_seqlen_q || static_cast<int>(blockIdx.y) - seq * p.max_seqlen_q >= q_len) return;
  } else if constexpr (PQ) {
    if (p.cu_seqlens_q[blockIdx.y + 1] - p.cu_seqlens_q[blockIdx.y] != 1) return;
  }
  // The sequence's own split count (so is context_lens): one split wrote o and lse itself.
  const int capacity = p.max_blocks * p.block_size;
  // WL: the partial rows of this sequence, head h and split s at row0_of_head0 + h * worklist + s
  int S;
  [[maybe_unused]] int64_t row0_of_head0 = 0;
  if constexpr (WL) {
    // The plan's grid completed before any split CTA passed its own wait (decode_slice), and
    // this grid launches only once every split CTA has passed it and triggered (just after that
    // wait, or at its loop's end without the early trigger) or
    // exited: the plan's entries are in L2 by then, and decode_worklist_seq reads them there.
    // Without the early read (params.h kDecodeVariantWorklistEarlyMerge flips it), every CTA,
    // those of one-slot sequences included, sits out the whole split kernel before it returns.
    if (!decode_worklist_early_merge(p)) griddep_wait();
    const int2 e = decode_worklist_seq(p, seq);
    S = e.x;
    row0_of_head0 = e.y;
  } else {
    S = decode_seq_splits(p, min(p.context_lens[seq], capacity), capacity).count;
  }
  if (S == 1) {
    reduce_trace(kRtExit);
    return;
  }
  // Launched early (programmatic dependent launch): wait until the split
  // kernel has finished and its partials are visible.
  griddep_wait();
  reduce_trace(kRtWaited);
  const int warp = threadIdx.x >> 5;
  const int h = WARPS ? static_cast<int>(blockIdx.x) * kReduceWarpHeads + warp : static_cast<int>(blockIdx.x);
  const int b = blockIdx.y;
  const int64_t row0 = WL ? row0_of_head0 + static_cast<int64_t>(h) * p.worklist
                          : (static_cast<int64_t>(b) * p.num_q_heads + h) * p.num_splits;
  if constexpr (WARPS) {
    if (h < p.num_q_heads) merge_split_row_warp<T, D, PQ, MQ>(p, h, b, S, row0, sm_w + warp * kMaxSplits);
  } else {
    merge_split_rows<T, D, PQ, MQ>(p, h, b, S, row0, sm_w, sm_warp, sm_o);
  }
  reduce_trace(kRtExit);
}


// One-launch split reduction (variant bit kVariantFused of decode/select.cuh):
// called by every CTA of a decode kernel after it stored its partials. Each CTA
// arrives on the counter of its (sequence, KV head, head chunk); the CTA that
// arrives last merges the splits of its ng query heads and writes o (and lse),
// then puts the counter back to 0, so every call, and every replay of a CUDA
// graph, finds the counters zero. Every CTA of a sequence's splits arrives (the CTAs past
// them return before any work), so a completed call never leaves a counter non-zero.
//
// The merge reproduces decode_reduce_kernel's arithmetic operation for
// operation, in split order (not arrival order), so that the two paths agree
// bitwise: the row max; weights ex2(lse_s - max); their sum as 8 warp
// butterflies over splits [32i, 32i + 32) added in warp order; per output dim,
// ROWS fma chains over splits r, r + ROWS, ... added in chain order; then
// o * (1 / sum). Only the thread layout differs (this CTA's threads, not 256).
//
// sm_w: [ng][kMaxSplits] floats, sm_mref/sm_total: [ng]; the caller's shared
// memory, free once the partials are stored.
template <typename T, int D, int kThreads>
__device__ __forceinline__ void fused_split_reduce(const DecodeParams& p, const DecodeSlice& slice, float* sm_w,
                                                   float* sm_mref, float* sm_total) {
  constexpr int ROWS = kReduceRows<D>;  // chains per output float4, as in decode_reduce_kernel
  constexpr int LANES = D / 4;          // float4 columns per head row
  constexpr int IPW = 32 / ROWS;        // float4 items per warp per pass
  constexpr int kWarpsHere = kThreads / 32;
  static_assert(32 % ROWS == 0, "the chains of an item share a warp");
  __shared__ int sm_last;
  const int tid = threadIdx.x;
  const int S = slice.num_splits;  // the CTAs past them returned without arriving
  __syncthreads();  // every partial of this CTA is stored
  if (tid == 0) {
    int* counter = p.split_counters + static_cast<int64_t>(slice.b) * gridDim.x + blockIdx.x;
    __threadfence();  // release: the CTA's partials (ordered by the barrier) before its arrival
    const int arrived = atomicAdd(counter, 1);
    const int last = arrived == S - 1;
    if (last) {
      atomicExch(counter, 0);  // every split has arrived: ready for the next call
      __threadfence();         // acquire: the other CTAs' partials, before the barrier below
    }
    sm_last = last;
  }
  __syncthreads();
  if (!sm_last) return;

  const int ng = slice.ng;
  const int stride = p.num_splits;  // partial rows per head row in the workspace (no work list: fused)
  const int64_t row_base = (static_cast<int64_t>(slice.b) * p.num_q_heads + slice.h0) * stride;
  const int lane = tid & 31, warp = tid >> 5;

  // Weights, one warp per head row.
  for (int row = warp; row < ng; row += kWarpsHere) {
    const SplitWeights sw = warp_split_weights(p.partial_lse + row_base + static_cast<int64_t>(row) * stride, S,
                                               sm_w + row * kMaxSplits);
    if (lane == 0) {
      sm_mref[row] = sw.mref;
      sm_total[row] = sw.total;
    }
  }
  __syncthreads();

  // Outputs: ROWS consecutive lanes own the ROWS chains of one float4 item
  // (head row, 4 dims), so every lane streams its chain's splits with several
  // loads in flight, and the chain-0 lane adds the others' sums in chain order
  // through shuffles. The loop is warp-uniform (full-mask shuffles).
  const int r = lane % ROWS;
  const int first_lane = lane - r;
  const int items = ng * LANES;
  const float4* po = reinterpret_cast<const float4*>(p.partial_o);
  for (int base = warp * IPW; base < items; base += kWarpsHere * IPW) {
    const int item = base + lane / ROWS;
    const bool valid = item < items;
    const int row = valid ? item / LANES : 0;
    const int col = item - row * LANES;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (valid) {
      const float4* src = po + (row_base + static_cast<int64_t>(row) * stride) * LANES + col;
      const float* w = sm_w + row * kMaxSplits;
#pragma unroll 8
      for (int s = r; s < S; s += ROWS) fma4(acc, w[s], __ldcg(src + static_cast<int64_t>(s) * LANES));
    }
    // decode_reduce_kernel: o = chain 0, then += chains 1 .. ROWS-1 in order
    // (a chain without splits adds +0 there too).
    float4 o = acc;
#pragma unroll
    for (int j = 1; j < ROWS; ++j) {
      const int src_lane = first_lane + j;
      const float ox = __shfl_sync(0xffffffffu, acc.x, src_lane);
      const float oy = __shfl_sync(0xffffffffu, acc.y, src_lane);
      const float oz = __shfl_sync(0xffffffffu, acc.z, src_lane);
      const float ow = __shfl_sync(0xffffffffu, acc.w, src_lane);
      o.x += ox, o.y += oy, o.z += oz, o.w += ow;
    }
    if (valid && r == 0) store_merged<T>(p, slice.row, slice.h0 + row, col, o, sm_mref[row], sm_total[row]);
  }
}

}  // namespace
}  // namespace minipaged
