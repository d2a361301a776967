// Device helpers shared by the two decode kernels (scalar.cuh, mma.cuh) and
// their split reduction (reduce.cuh).
#pragma once
#include <cstdint>
#include <type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "decode/splits.h"
#include "decode/trace.cuh"
#include "decode/worklist.cuh"
#include "params.h"
#include "ptx/fp8.cuh"
#include "ptx/misc.cuh"
#include "ptx/mma.cuh"

namespace minipaged {

// log2(e): softmax runs in base 2 so that exp becomes one ex2 instruction; the
// scale is folded into q once per CTA instead of once per score.
constexpr float kLog2e = 1.4426950408889634f;
// ln(2): converts a log2-domain log-sum-exp to the natural log the API returns.
constexpr float kLn2 = 0.6931471805599453f;

// Eight packed 16-bit values -> eight floats.
template <typename T>
struct Convert;

template <>
struct Convert<__nv_bfloat16> {
  // bf16 is the top half of an fp32: widening is a shift / mask, no cvt.
  __device__ __forceinline__ static void to_float8(const uint4& u, float (&f)[8]) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  __device__ __forceinline__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

template <>
struct Convert<__half> {
  __device__ __forceinline__ static void to_float8(const uint4& u, float (&f)[8]) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h;
      memcpy(&h, &w[i], sizeof(h));
      const float2 v = __half22float2(h);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
  __device__ __forceinline__ static float to_float(__half x) { return __half2float(x); }
  __device__ __forceinline__ static __half from_float(float x) { return __float2half_rn(x); }
};

// One 16-byte piece of a cache row -> floats: 8 elements of T, or 16 e4m3
// bytes (FP8: exact, through f16).
template <typename T, bool kFp8>
struct Piece {
  static constexpr int kElems = kFp8 ? 16 : 8;
  __device__ __forceinline__ static void to_float(const uint4& u, float (&f)[kElems]) {
    if constexpr (kFp8) {
      fp8x16_to_float(u, f);
    } else {
      Convert<T>::to_float8(u, f);
    }
  }
};

// What one decode CTA owns, from the launch grid (split, KV head x head chunk,
// sequence): tokens [start, end) of sequence b's context and query heads
// [h0, h0 + ng) of KV head kvh's group. Shared by both decode kernels.
// row: the q / o / lse row of the sequence (b, or cu_seqlens_q[b] with packed
// queries; -1 there for a sequence that is not a decode row: the CTA returns).
// MQ (DecodeParams::max_seqlen_q, the tensor-core kernel only): the CTA owns
// the ng = q_len x G (query, head) rows of KV head kvh's group instead (h0 is
// the group's first head, row the sequence's first q row, -1 for a sequence
// whose q_len is not 2..max_seqlen_q); ctx is the context length.
struct DecodeSlice {
  int split, kvh, b, h0, ng;
  int num_splits;  // splits of this sequence (DecodeParams::split_min_tokens)
  int start, end;  // token range; empty when the split starts past the context
  int capacity;    // max_blocks * block_size: what the block table can address
  int table_end;   // end of the split's run in the table (start + its length, at most capacity)
  int part0;       // worklist: the slot of the sequence's split 0 (its partial rows start there)
  int row;
  int q_len, ctx;  // MQ only
  int group;        // query heads per KV head
  float inv_group;  // MQ only: 1 / group, for query_of_row
};

// The query of MQ row `row` (row / group for 0 <= row < 32, 1 <= group <= 16) without an
// integer division, which costs a CTA about twenty instructions each time: (row + 1/2) / group
// lies at least 1/32 from an integer, far more than the rounding of the product.
__device__ __forceinline__ int query_of_row(int row, float inv_group) {
  return static_cast<int>((static_cast<float>(row) + 0.5f) * inv_group);
}

// PQ: packed queries (DecodeParams::cu_seqlens_q), the instantiations the
// paged decode routing runs; false compiles to the plain decode as before.
// MQ: short query runs (DecodeParams::max_seqlen_q); implies packed queries.
// decode_slice_head: what the CTA's place in the grid gives, without a load;
// decode_slice_range: the rest; decode_slice: both.
template <bool PQ = false, bool MQ = false>
__device__ __forceinline__ DecodeSlice decode_slice_head(const DecodeParams& p, int heads_per_cta) {
  // Grid (Hkv x head chunks, B, num_splits): every sequence's first split launches before any
  // second one, so the CTAs past a short sequence's splits return in the grid's tail.
  DecodeSlice s;
  s.split = blockIdx.z;
  const int num_gchunks = gridDim.x / p.num_kv_heads;
  s.kvh = blockIdx.x / num_gchunks;
  const int gchunk = blockIdx.x - s.kvh * num_gchunks;
  s.b = blockIdx.y;
  const int group = p.num_q_heads / p.num_kv_heads;
  s.group = group;
  if constexpr (!MQ) {
    s.h0 = s.kvh * group + gchunk * heads_per_cta;
    s.ng = min(heads_per_cta, group - gchunk * heads_per_cta);
  }
  s.capacity = p.max_blocks * p.block_size;
  s.row = s.b;
  return s;
}

// The token range of the slice's split, in runs of `run` tokens of a sequence of ctx tokens.
__device__ __forceinline__ void decode_slice_set_run(DecodeSlice& s, int ctx, int run) {
  s.start = s.split * run;
  s.end = min(ctx, s.start + run);
  s.table_end = min(s.capacity, s.start + run);
}

// The fields of a slice that depend on device inputs (context_lens; cu_seqlens_q with PQ / MQ).
template <bool PQ = false, bool MQ = false>
__device__ __forceinline__ void decode_slice_range(const DecodeParams& p, DecodeSlice& s) {
  // api.py guarantees context_len <= capacity; the clamp keeps a bad value from
  // walking off the block table.
  const int ctx = min(p.context_lens[s.b], s.capacity);
  const SeqSplits splits = decode_seq_splits(p, ctx, s.capacity);
  s.num_splits = splits.count;
  decode_slice_set_run(s, ctx, splits.run);
  if constexpr (MQ) {
    const int q0 = p.cu_seqlens_q[s.b];
    s.q_len = p.cu_seqlens_q[s.b + 1] - q0;
    s.h0 = s.kvh * s.group;
    s.inv_group = 1.f / static_cast<float>(s.group);
    // one CTA per (sequence, KV head): launch_decode checks max_seqlen_q x G <= heads_per_cta
    const bool short_run = s.q_len >= 2 && s.q_len <= p.max_seqlen_q;
    s.ng = short_run ? s.q_len * s.group : 0;
    s.ctx = ctx;
    s.row = s.ng > 0 ? q0 : -1;
  } else if constexpr (PQ) {
    const int q0 = p.cu_seqlens_q[s.b];
    s.row = p.cu_seqlens_q[s.b + 1] - q0 == 1 ? q0 : -1;
  }
}


// Whether the split kernels trigger their merge's launch as they start (params.h
// kDecodeVariantEarlyTrigger) rather than as their loop ends. CTA-uniform.
__device__ __forceinline__ bool decode_early_trigger(const DecodeParams& p) {
  return kDecodeEarlyTriggerByDefault != ((p.variant & kDecodeVariantEarlyTrigger) != 0);
}

// Whether a work list's merge reads its sequence's plan entry before its wait for the split
// kernel (params.h kDecodeVariantWorklistEarlyMerge). CTA-uniform.
__device__ __forceinline__ bool decode_worklist_early_merge(const DecodeParams& p) {
  return kDecodeWorklistEarlyMergeByDefault != ((p.variant & kDecodeVariantWorklistEarlyMerge) != 0);
}

// WL (the work-list twins of the plain decode kernels, DecodePlan::worklist_kernel): the grid
// is (Hkv x head chunks, DecodeParams::worklist) and blockIdx.y a work slot, whose entry the
// plan kernel (decode/worklist.cuh) wrote; the kernels without it never look at the plan.
template <bool PQ = false, bool MQ = false, bool WL = false>
__device__ __forceinline__ DecodeSlice decode_slice(const DecodeParams& p, int heads_per_cta) {
  static_assert(!WL || (!PQ && !MQ), "work lists: plain decode");
  DecodeSlice s = decode_slice_head<PQ, MQ>(p, heads_per_cta);
  if constexpr (WL) {
    griddep_wait();  // decode_worklist_plan_kernel has written the plan
    decode_trace(kTrPlanWaited);
    // (after the wait: the merge's early read of the plan needs the planner's grid complete)
    if (decode_early_trigger(p)) griddep_launch_dependents();
    const WorklistEntry e = decode_worklist_slot(p, blockIdx.y);
    // a slot past every split: split 1 of 1, which decode_split_unused turns away
    s.b = e.b < 0 ? 0 : e.b;
    s.row = s.b;
    s.split = e.b < 0 ? 1 : e.split;
    s.num_splits = e.count;
    s.part0 = e.first;
    decode_slice_set_run(s, e.ctx, e.run);
  } else {
    if (decode_early_trigger(p)) griddep_launch_dependents();
    decode_slice_range<PQ, MQ>(p, s);
  }
  return s;
}

// Row of the split partials (partial_o / partial_lse) of query head `head` of a slice;
// split_row as decode_out_row gives it. WL: a work list's, [Hq, worklist] by slot.
template <bool WL = false>
__device__ __forceinline__ int64_t decode_partial_row(const DecodeParams& p, const DecodeSlice& s, int head,
                                                      int64_t split_row) {
  if constexpr (WL) return static_cast<int64_t>(head) * p.worklist + s.part0 + s.split;
  return split_row * p.num_splits + s.split;
}

// Whether a packed-query CTA of this slice has nothing to do (not a decode row).
template <bool PQ, bool MQ = false>
__device__ __forceinline__ bool decode_slice_skipped(const DecodeSlice& s) {
  if constexpr (PQ || MQ) return s.row < 0;
  return false;
}

// Whether the slice's split is past its sequence's splits (never split 0). `split > 0` comes
// first, so that a first split does not wait for context_lens here.
__device__ __forceinline__ bool decode_split_unused(const DecodeSlice& s) {
  return s.split > 0 && s.split >= s.num_splits;
}

// Where row `row` (0..ng) of a slice's merged output goes: its q / o / lse row and query head,
// and its split-workspace row before the split index.
template <bool MQ>
__device__ __forceinline__ void decode_out_row(const DecodeParams& p, const DecodeSlice& s, int row, int& out_row,
                                               int& head, int64_t& split_row) {
  if constexpr (MQ) {
    const int qi = query_of_row(row, s.inv_group);
    head = s.h0 + (row - qi * s.group);
    out_row = s.row + qi;
    split_row = (static_cast<int64_t>(s.b) * p.max_seqlen_q + qi) * p.num_q_heads + head;
  } else {
    head = s.h0 + row;
    out_row = s.row;
    split_row = static_cast<int64_t>(s.b) * p.num_q_heads + head;
  }
}

// Last step of both decode kernels: combine the online-softmax states that the
// CTA's warps left in shared memory (row max m and sum l in log2 units, and the
// unnormalised output o, per warp and query-head row) and store the result:
// the output itself with one split, else the split's normalised partial and,
// once per row, its log2-sum-exp for decode_reduce_kernel. Every element is
// produced by one thread, walking the warps in a fixed order.
// kScaleOut (FP8 caches): the output is also multiplied by out_scale, the KV
// head's v_scale (V was accumulated as stored), partials included, so the
// split reduction needs no change. dim_of(c) is the output dim that column c
// of sm_o holds (the tensor-core kernel keeps FP8 outputs in a permuted order).
struct IdentityDim {
  __device__ __forceinline__ int operator()(int c) const { return c; }
};
// Column col of row `row` with the warps' states combined (the row max as reference, weights
// ex2(m_w - max), summed in warp order): O / L (0 for a row that saw no key), and the row's
// reference max mref and sum L, whose log2-sum-exp is mref + log2(L).
template <int kNumWarps, int kRowsPerCta, int D>
__device__ __forceinline__ float merge_warps_element(const float* sm_m, const float* sm_l, const float* sm_o, int row,
                                                     int col, float& mref, float& L) {
  float mx = -INFINITY;
#pragma unroll
  for (int w = 0; w < kNumWarps; ++w) mx = fmaxf(mx, sm_m[w * kRowsPerCta + row]);
  mref = mx == -INFINITY ? 0.f : mx;
  L = 0.f;
  float O = 0.f;
#pragma unroll
  for (int w = 0; w < kNumWarps; ++w) {
    const float c = fast_exp2(sm_m[w * kRowsPerCta + row] - mref);
    L += sm_l[w * kRowsPerCta + row] * c;
    O += sm_o[(w * kRowsPerCta + row) * D + col] * c;
  }
  return L > 0.f ? O / L : 0.f;
}
template <typename T, int kNumWarps, int kRowsPerCta, int D, bool kScaleOut = false, class DimOf = IdentityDim,
          bool WL = false>
__device__ __forceinline__ void merge_warps_and_store(const DecodeParams& p, const DecodeSlice& slice,
                                                      const float* sm_m,  // [kNumWarps][kRowsPerCta]
                                                      const float* sm_l,  // [kNumWarps][kRowsPerCta]
                                                      const float* sm_o,  // [kNumWarps][kRowsPerCta][D]
                                                      float out_scale = 1.f, DimOf dim_of = {})
{
  for (int idx = threadIdx.x; idx < slice.ng * D; idx += kNumWarps * 32) {
    const int row = idx / D;
    const int col = idx - row * D;
    const int d = dim_of(col);
    float mref, L;
    float out = merge_warps_element<kNumWarps, kRowsPerCta, D>(sm_m, sm_l, sm_o, row, col, mref, L);
    if constexpr (kScaleOut) out *= out_scale;
    int out_row, h;
    int64_t split_row;
    decode_out_row<false>(p, slice, row, out_row, h, split_row);
    if (slice.num_splits == 1) {
      T* op = static_cast<T*>(p.o) + out_row * p.o_batch_stride + h * p.o_head_stride;
      op[d] = Convert<T>::from_float(out);
      if (p.lse != nullptr && d == 0)
        p.lse[out_row * p.lse_batch_stride + h] = L > 0.f ? (mref + log2f(L)) * kLn2 : -INFINITY;
    } else {
      const int64_t prow = decode_partial_row<WL>(p, slice, h, split_row);
      p.partial_o[prow * D + d] = out;
      if (d == 0) p.partial_lse[prow] = L > 0.f ? mref + log2f(L) : -INFINITY;
    }
  }
}

// merge_warps_and_store for the short query runs of the tensor-core kernel (MQ): up to 32 rows,
// not a decode's 1-2 real ones, so the epilogue's cost grows with the rows and, at low
// occupancy, every CTA's life with it. MQ = false: the same merge for a decode's rows (one
// query, ng heads; the tensor-core kernel's MINIPAGED_DECODE_ROW_MERGE), WL: a work list's
// partial rows. Row r's partials are those of warps r / kRowsPerBlock + kRowBlocks * j (the
// warps of its row block) at row r % kRowsPerBlock. The first ng threads turn each row's warp
// maxima into weights (in place in sm_m) and sums (in sm_l, at the row's first partial) and
// find its output place once. Then warp w merges rows w, w + kNumWarps, ...: each lane takes
// D / 32 consecutive columns, one vector load per partial row, one reciprocal of the row sum per
// row, one vector store (columns in the output's order) or, where dim_of permutes them (FP8
// caches), a store per element. The per-element arithmetic (per-warp weights summed in warp
// order, scaled by the row's 1 / L) is merge_warps_and_store's with the division taken once per
// row.
// kOStride: floats between the rows of sm_o (D or more, a multiple of D / 32).
template <typename T, int kNumWarps, int kRowsPerBlock, int kRowBlocks, int D, int kOStride, bool kScaleOut,
          class DimOf, bool MQ = true, bool WL = false>
__device__ __forceinline__ void merge_query_rows_and_store(const DecodeParams& p, const DecodeSlice& slice,
                                                           float* sm_m,        // [kNumWarps][kRowsPerBlock]
                                                           float* sm_l,        // [kNumWarps][kRowsPerBlock]
                                                           const float* sm_o,  // [kNumWarps][kRowsPerBlock][kOStride]
                                                           float out_scale, DimOf dim_of) {
  constexpr int kCols = D / 32;  // consecutive columns per lane
  constexpr int kRows = kRowBlocks * kRowsPerBlock;
  constexpr int kPartials = kNumWarps / kRowBlocks;  // warps per row block
  static_assert(kCols == 2 || kCols == 4, "D 64 or 128");
  static_assert(kOStride % kCols == 0 && kRows <= kNumWarps * 32 && kNumWarps % kRowBlocks == 0,
                "vector rows; one pre-pass thread per row; whole row blocks");
  using Vec = std::conditional_t<kCols == 4, float4, float2>;
  constexpr bool kPermuted = !std::is_same_v<DimOf, IdentityDim>;
  // sm_m / sm_l / sm_o slot of row r's j-th partial
  const auto slot = [](int r, int j) {
    return (r / kRowsPerBlock + kRowBlocks * j) * kRowsPerBlock + r % kRowsPerBlock;
  };
  __shared__ int64_t sm_dst[kRows];  // o element offset of the row (one split) or its partial row
  const int tid = threadIdx.x;

  if (tid < slice.ng) {
    const int row = tid;
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kPartials; ++j) mx = fmaxf(mx, sm_m[slot(row, j)]);
    const float mref = mx == -INFINITY ? 0.f : mx;
    float L = 0.f;
#pragma unroll
    for (int j = 0; j < kPartials; ++j) {
      const float c = fast_exp2(sm_m[slot(row, j)] - mref);
      L += sm_l[slot(row, j)] * c;
      sm_m[slot(row, j)] = c;
    }
    sm_l[slot(row, 0)] = L;
    int out_row, h;
    int64_t split_row;
    decode_out_row<MQ>(p, slice, row, out_row, h, split_row);
    if (slice.num_splits == 1) {
      sm_dst[row] = out_row * p.o_batch_stride + h * p.o_head_stride;
      if (p.lse != nullptr) p.lse[out_row * p.lse_batch_stride + h] = L > 0.f ? (mref + log2f(L)) * kLn2 : -INFINITY;
    } else {
      const int64_t prow = decode_partial_row<WL>(p, slice, h, split_row);
      sm_dst[row] = prow * D;
      p.partial_lse[prow] = L > 0.f ? mref + log2f(L) : -INFINITY;
    }
  }
  __syncthreads();
  const int warp = tid >> 5;
  const int col0 = (tid & 31) * kCols;
  // Vector stores of the output need its rows kCols elements aligned (the bindings allocate o
  // contiguous, so they are); partial rows are D floats from the workspace's aligned base.
  const bool o_vec = ((reinterpret_cast<uintptr_t>(p.o) | static_cast<uintptr_t>(p.o_batch_stride) * sizeof(T) |
                       static_cast<uintptr_t>(p.o_head_stride) * sizeof(T)) &
                      (kCols * sizeof(T) - 1)) == 0;
  for (int row = warp; row < slice.ng; row += kNumWarps) {  // warp-uniform
    float O[kCols];
#pragma unroll
    for (int j = 0; j < kCols; ++j) O[j] = 0.f;
#pragma unroll
    for (int j = 0; j < kPartials; ++j) {
      const int sl = slot(row, j);
      const float c = sm_m[sl];
      const Vec v = *reinterpret_cast<const Vec*>(sm_o + sl * kOStride + col0);
      const float* e = reinterpret_cast<const float*>(&v);
#pragma unroll
      for (int k = 0; k < kCols; ++k) O[k] += e[k] * c;
    }
    const float L = sm_l[slot(row, 0)];
    float inv = L > 0.f ? 1.f / L : 0.f;
    if constexpr (kScaleOut) inv *= out_scale;
    float out[kCols];
#pragma unroll
    for (int k = 0; k < kCols; ++k) out[k] = O[k] * inv;
    const int64_t dst = sm_dst[row];
    if (slice.num_splits == 1) {
      T* op = static_cast<T*>(p.o) + dst;
      if (!kPermuted && o_vec) {
        if constexpr (kCols == 4) {
          *reinterpret_cast<uint2*>(op + col0) = make_uint2(pack2<T>(out[0], out[1]), pack2<T>(out[2], out[3]));
        } else {
          *reinterpret_cast<uint32_t*>(op + col0) = pack2<T>(out[0], out[1]);
        }
      } else {
#pragma unroll
        for (int k = 0; k < kCols; ++k) op[dim_of(col0 + k)] = Convert<T>::from_float(out[k]);
      }
    } else {
      float* pp = p.partial_o + dst;
      if constexpr (!kPermuted) {
        *reinterpret_cast<Vec*>(pp + col0) = *reinterpret_cast<const Vec*>(out);
      } else {
#pragma unroll
        for (int k = 0; k < kCols; ++k) pp[dim_of(col0 + k)] = out[k];
      }
    }
  }
}

}  // namespace minipaged
