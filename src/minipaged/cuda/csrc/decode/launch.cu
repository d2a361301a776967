// Paged-KV decode (one query token per sequence), shared by the `cuda` and
// `cuda-wmma` backends: kernel choice, split planning and launch. Two kernels,
// the scalar one of decode/scalar.cuh (GQA groups of 1-2 heads) and the
// tensor-core one of decode/mma.cuh (groups of 3+ heads, and G = 2 at D = 128
// when the splits are long); decode/select.cuh (the kernels, compiled in slices by
// decode/kernels_*.cu) and decode_plan() choose. Both write the same split partials, merged
// by decode/reduce.cuh.
// With few CTAs (small batch, long context) the context is split (flash-decoding):
// each split writes a normalised partial output and its log2-sum-exp, and a
// second kernel merges them. The split count depends only on host-side shapes
// (B, Hkv, table capacity, SM count), never on context_lens, so the launch is
// graph-capturable and needs no host sync.
// FP8 caches (p.kv_fp8) have their own, smaller set of kernels (decode/select.cuh select_fp8).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <mutex>
#include <type_traits>
#include <vector>

#include "decode/reduce.cuh"
#include "decode/select.h"
#include "decode/worklist_plan.cuh"
#include "params.h"

#if MINIPAGED_DECODE_TRACE
// (decode/select.cuh: a trace build compiles every kernel in this translation unit)
#define MINIPAGED_DECODE_KERNELS_IN_ONE_TU 1
#include "decode/kernels_all.cuh"
#endif

namespace minipaged {
namespace {

constexpr int kMinTokensPerSplit = 128;
// The tensor-core kernel also serves G = 2 at D = 128 (16-bit and FP8 caches)
// once each split holds at least this many tokens (decode_plan). Below, its
// longer per-CTA prologue and merge lose to the scalar kernel
// (bench/results/nvidia-h200/decode_tilings.md, fifth session).
constexpr int kMinTokensPerSplitTensorCores = 256;
// Grids of more than half a wave of whole sequences (plan_splits): no split holds more than
// kMaxSplitBytes of K+V per KV head, so that a long sequence among short ones does not leave
// one CTA streaming it alone at the end of the call, and the CTAs of a call stay within
// kMaxSplitWaves waves of the resident slots (the CTAs past a short sequence's splits return
// at once, but each still passes through a slot).
#ifndef MINIPAGED_DECODE_SPLIT_BYTES
#define MINIPAGED_DECODE_SPLIT_BYTES (2 << 20)
#endif
#ifndef MINIPAGED_DECODE_SPLIT_WAVES
#define MINIPAGED_DECODE_SPLIT_WAVES 8
#endif
constexpr int64_t kMaxSplitBytes = MINIPAGED_DECODE_SPLIT_BYTES;
constexpr int64_t kMaxSplitWaves = MINIPAGED_DECODE_SPLIT_WAVES;

using DecodeKernel = void (*)(const DecodeParams);

// Benchmark-only bit above the tiling number (p.variant & 0xff): launch the
// reduction without programmatic dependent launch, to measure what PDL saves
// (bench/results/nvidia-h200/cuda_kernel_notes.md).
constexpr int kVariantNoPDL = 0x200;
// (Bit 0x400, the one-launch split reduction: decode/select.cuh kVariantFused.)
// Bit 0x800, timing only (decode_selftest): the split kernel without its
// reduction, to measure what the merge costs. The output is not written.
constexpr int kVariantNoReduce = 0x800;

// The tensor-core alternative to the scalar kernel for G = 2 at D = 128 with the default
// tiling (a packed-query call: always), both cache dtypes; {} elsewhere (decode/select.cuh
// has the kernels). decode_plan takes it when its splits are long
// (kMinTokensPerSplitTensorCores). The choice depends on the table width, the split count and
// (FP8: the short-ring rule) the page size only, so routed decode rows and a plain decode call
// with the same forced split count run the same kernel.
DecodePlan tensor_core_g2(const DecodeParams& p) {
  if (p.head_dim != 128 || p.num_kv_heads <= 0 || p.num_q_heads != 2 * p.num_kv_heads) return {};
  if (p.cu_seqlens_q == nullptr && (p.variant & 0xff) != 0) return {};
  if (p.kv_fp8 && (p.k_scale == nullptr || p.v_scale == nullptr)) return {};
  switch (p.dtype) {
    case DType::kFloat16:
      return p.kv_fp8 ? tensor_core_g2_for<__half, true>(p) : tensor_core_g2_for<__half, false>(p);
    case DType::kBFloat16:
      return p.kv_fp8 ? tensor_core_g2_for<__nv_bfloat16, true>(p) : tensor_core_g2_for<__nv_bfloat16, false>(p);
  }
  return {};
}

// select(TypeTag<T>{}, std::integral_constant<int, D>{}) for p's element type and head dim (64 or
// 128; select_kernel checks it): the one switch from runtime dtype and head dim to the
// templates of every selector below.
template <class T>
struct TypeTag {
  using type = T;
};
template <class Select>
DecodePlan by_dtype_and_dim(const DecodeParams& p, Select select) {
  using D64 = std::integral_constant<int, 64>;
  using D128 = std::integral_constant<int, 128>;
  const bool d128 = p.head_dim == 128;
  switch (p.dtype) {
    case DType::kFloat16: return d128 ? select(TypeTag<__half>{}, D128{}) : select(TypeTag<__half>{}, D64{});
    case DType::kBFloat16:
      return d128 ? select(TypeTag<__nv_bfloat16>{}, D128{}) : select(TypeTag<__nv_bfloat16>{}, D64{});
  }
  return {};
}

DecodePlan select_kernel(const DecodeParams& p) {
  if (p.head_dim != 64 && p.head_dim != 128) return {};
  if (p.kv_fp8 && (p.k_scale == nullptr || p.v_scale == nullptr)) return {};
  if ((p.max_seqlen_q >= 2 || p.cu_seqlens_q != nullptr) && p.num_kv_heads <= 0) return {};
  if (p.max_seqlen_q >= 2 && p.cu_seqlens_q == nullptr) return {};
  return by_dtype_and_dim(p, [&](auto t, auto d) {
    using T = typename decltype(t)::type;
    constexpr int D = decltype(d)::value;
    return p.kv_fp8 ? select_kernel_for<T, D, true>(p) : select_kernel_for<T, D, false>(p);
  });
}

// query() for (kernel, size) on the current device, computed once per (kernel, size, device)
// and kept (per query type): the host-side occupancy queries are not free, and a decode is
// planned once per layer per step.
template <class Query>
int cached_per_device(DecodeKernel kernel, int size, Query query) {
  struct Entry {
    DecodeKernel kernel;
    int size, device, value;
  };
  static std::mutex mu;
  static std::vector<Entry> cache;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) cudaGetLastError();
  std::lock_guard<std::mutex> lock(mu);
  for (const Entry& e : cache)
    if (e.kernel == kernel && e.size == size && e.device == device) return e.value;
  const int value = query();
  cache.push_back({kernel, size, device, value});
  return value;
}

// Resident blocks per SM for a kernel on the current device (cached_per_device). The first
// call per (kernel, device) also raises the kernel's dynamic shared-memory limit there.
int blocks_per_sm(const DecodePlan& k) {
  return cached_per_device(k.kernel, 0, [&] {
    // Static + dynamic shared memory over 48 KB needs the opt-in (the 3-stage
    // tilings: 48 KB of stages + 4 KB of merge buffers).
    if (k.smem_bytes > 0 &&
        cudaFuncSetAttribute(k.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem_bytes) != cudaSuccess)
      cudaGetLastError();
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k.kernel, k.threads, k.smem_bytes) != cudaSuccess) {
      cudaGetLastError();
      n = 0;
    }
    return std::max(n, 1);
  });
}

// CTAs per (sequence, KV head) of kernel k: the head chunks of a GQA group (short query runs:
// one, launch_decode checks that their rows fit).
int64_t row_chunks(const DecodeParams& p, const DecodePlan& k) {
  if (p.max_seqlen_q >= 2) return 1;
  const int64_t group = p.num_q_heads / std::max(p.num_kv_heads, 1);
  const int64_t g = std::max(k.group_tile, 1);
  return (group + g - 1) / g;
}

// Sets p.num_splits / tokens_per_split / split_min_tokens / split_align for kernel k
// (requested_splits > 0: that many for every sequence of at least as many iterations).
void plan_splits(DecodeParams& p, const DecodePlan& k, int requested_splits) {
  // Resident blocks per SM (cached), which also raises the shared-memory limit.
  const int resident = k.kernel != nullptr ? blocks_per_sm(k) : 1;
  const int64_t gchunks = row_chunks(p, k);
  const int64_t capacity = static_cast<int64_t>(p.max_blocks) * p.block_size;
  const int64_t iter = std::max(k.tokens_per_iter, 1);
  const auto round_up = [iter](int64_t n) { return (n + iter - 1) / iter * iter; };
  const int64_t ctas = static_cast<int64_t>(p.batch) * p.num_kv_heads * gchunks;
  const int64_t slots = static_cast<int64_t>(resident) * std::max(p.num_sms, 1);
  int64_t splits = 1;
  // Never cut a sequence into pieces shorter than kMinTokensPerSplit: the merge would cost more.
  int64_t min_tokens = round_up(kMinTokensPerSplit);
  if (requested_splits > 0) {
    splits = requested_splits;
    min_tokens = iter;
  } else if (k.kernel != nullptr) {
    if (ctas > 0 && 2 * ctas <= slots) {
      // Fill one wave of resident blocks, not more: a second, partial wave costs
      // more than it hides.
      splits = slots / ctas;
      splits = std::min<int64_t>(splits, std::max<int64_t>(1, capacity / kMinTokensPerSplit));
    } else if (ctas > 0) {
      const int64_t token_bytes = 2 * static_cast<int64_t>(p.head_dim) * (p.kv_fp8 ? 1 : 2);
      min_tokens = std::max(min_tokens, round_up(kMaxSplitBytes / token_bytes));
      splits = (capacity + min_tokens - 1) / min_tokens;
      splits = std::min<int64_t>(splits, std::max<int64_t>(1, kMaxSplitWaves * slots / ctas));
    }
  }
  splits = std::max<int64_t>(1, std::min<int64_t>(splits, kMaxSplits));
  // Plain decode over more than half a wave, in a wide table: a work list (decode_worklist_splits
  // per sequence), so that the splits short sequences leave idle go to the long ones.
  // Only the default kernels have a work-list twin (info_d, default_mma, fp8_wide_mma).
  const int64_t worklist_splits = requested_splits <= 0 && k.worklist_kernel != nullptr &&
                                          p.cu_seqlens_q == nullptr && p.max_seqlen_q < 2 &&
                                          decode_worklist_wanted(p.variant) && p.batch <= kWorklistMaxBatch
                                      ? decode_worklist_splits(ctas, slots, splits, capacity, min_tokens)
                                      : 0;
  if (worklist_splits > 0) splits = worklist_splits;
  decode_split_runs(p, capacity, splits, min_tokens, iter);
  p.worklist = 0;
  if (worklist_splits > 0 && p.num_splits >= 2 && static_cast<int64_t>(p.batch) * p.num_splits <= 65535) {
    p.worklist = p.batch * p.num_splits;
    DecodePlan twin = k;
    twin.kernel = k.worklist_kernel;
    blocks_per_sm(twin);  // raises the twin's shared-memory limit on this device
  }
}

// k, or its two-warp twin (decode/select.cuh two_warp_mma) where k is the default tensor-core plan of its cache
// dtype (the G >= 3 one on FP8 caches; plain or packed-query, two-launch) and the rule wants it
// (params.h decode_two_warp_wanted: off by default, flipped by kDecodeVariantTwoWarpToggle):
// where one CTA per (sequence, KV head, head chunk) already overflows a wave of k's CTAs, so the
// grid runs in one wave of the smaller CTAs, or fewer, instead of two or more, in a table of at
// most kDecodeTwoWarpMaxTableTokens tokens. The rule reads the batch, the heads, the table's
// width and the device; plain and packed-query calls share it. A forced split count keeps k, so
// that routed decode rows and a plain call on those sequences alone run the same kernel whatever
// their batch sizes (tests/test_cuda.py).
static_assert(3 * (kMaxSplitBytes / (2 * 128 * 2)) > kDecodeTwoWarpMaxTableTokens,
              "two_warp_mma has no work-list twin: its tables must stay narrower than a work list's");
DecodePlan with_two_warp(const DecodeParams& p, const DecodePlan& k, int requested_splits) {
  if (!decode_two_warp_wanted(p.kv_fp8, p.variant)) return k;
  if (requested_splits > 0 || k.kernel == nullptr || k.fused || p.max_seqlen_q >= 2) return k;
  if (static_cast<int64_t>(p.max_blocks) * p.block_size > kDecodeTwoWarpMaxTableTokens) return k;
  const int64_t ctas = static_cast<int64_t>(p.batch) * p.num_kv_heads * row_chunks(p, k);
  if (ctas <= static_cast<int64_t>(blocks_per_sm(k)) * std::max(p.num_sms, 1)) return k;
  const bool packed = p.cu_seqlens_q != nullptr;
  return by_dtype_and_dim(p, [&](auto t, auto d) {
    using T = typename decltype(t)::type;
    constexpr int D = decltype(d)::value;
    return p.kv_fp8 ? two_warp_twin_for<T, D, true>(k, packed) : two_warp_twin_for<T, D, false>(k, packed);
  });
}
}  // namespace

DecodePlan decode_plan(DecodeParams& p, int requested_splits) {
  const DecodePlan tc =
      p.max_seqlen_q >= 2 ? DecodePlan{} : with_two_warp(p, tensor_core_g2(p), requested_splits);
  if (tc.kernel != nullptr) {
    DecodeParams t = p;
    plan_splits(t, tc, requested_splits);
    if (t.tokens_per_split >= kMinTokensPerSplitTensorCores) {
      p.num_splits = t.num_splits;
      p.tokens_per_split = t.tokens_per_split;
      // (a short sequence in a long table: no split of it under the kernel's own minimum)
      p.split_min_tokens = std::max(t.split_min_tokens, kMinTokensPerSplitTensorCores);
      p.split_align = t.split_align;
      p.worklist = t.worklist;
      decode_set_split_guess(p);
      return tc;
    }
  }
  const DecodePlan k = with_two_warp(p, select_kernel(p), requested_splits);
  plan_splits(p, k, requested_splits);
  return k;
}

int64_t decode_split_counter_count(const DecodeParams& p, const DecodePlan& k) {
  if (!k.fused || p.num_splits <= 1 || p.num_kv_heads <= 0 || k.group_tile <= 0) return 0;
  const int64_t gchunks = (p.num_q_heads / p.num_kv_heads + k.group_tile - 1) / k.group_tile;
  return static_cast<int64_t>(p.batch) * p.num_kv_heads * gchunks;
}

namespace {
// kernel<<<grid, block, smem, stream>>>(p), as a programmatic dependent launch when `pdl`
// (sm_90+): its CTAs may start while the previous kernel on the stream drains, and its
// griddepcontrol.wait keeps the ordering. Captured into CUDA graphs as a programmatic edge.
cudaError_t launch_pdl(DecodeKernel kernel, dim3 grid, dim3 block, int smem, cudaStream_t stream, bool pdl,
                       const DecodeParams& p) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  if (pdl) {
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

// Sequences per CTA of a work list's merge grid: kWorklistMergeSeqs where that grid still gives
// every SM two CTAs, else one (smaller grouped grids timed slower: params.h
// kDecodeVariantWorklistGroupedMerge).
int worklist_merge_seqs_per_cta(const DecodeParams& p, int64_t reduce_rows) {
  const int64_t grouped_ctas = int64_t(p.num_q_heads) * ((reduce_rows + kWorklistMergeSeqs - 1) / kWorklistMergeSeqs);
  const bool by_rule = kDecodeWorklistGroupedMergeByDefault && grouped_ctas >= 2 * int64_t(std::max(p.num_sms, 1));
  return by_rule != ((p.variant & kDecodeVariantWorklistGroupedMerge) != 0) ? kWorklistMergeSeqs : 1;
}
}  // namespace

cudaError_t launch_decode(const DecodeParams& p, const DecodePlan& k, cudaStream_t stream) {
  if (p.batch == 0 || p.num_q_heads == 0) return cudaSuccess;
  if (p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0) return cudaErrorInvalidValue;
  if (p.block_size <= 0 || (p.block_size & (p.block_size - 1)) != 0) return cudaErrorInvalidValue;
  if (p.num_splits < 1 || (p.num_splits > 1 && (!p.partial_o || !p.partial_lse)))
    return cudaErrorInvalidValue;
  // A fused split kernel counts arrivals: without counters it cannot merge.
  if (k.fused && p.num_splits > 1 && p.split_counters == nullptr) return cudaErrorInvalidValue;
  // Short query runs: every (query, head) row of a KV group in one CTA of the tensor-core kernel.
  if (p.max_seqlen_q >= 2 &&
      (p.cu_seqlens_q == nullptr ||
       (k.kernel != nullptr && int64_t(p.max_seqlen_q) * (p.num_q_heads / p.num_kv_heads) > k.group_tile)))
    return cudaErrorInvalidValue;
  const int64_t reduce_rows = int64_t(p.batch) * decode_query_rows(p);
  const int64_t gchunks = row_chunks(p, k);
  if (reduce_rows > 65535 || p.num_kv_heads * gchunks > 65535) return cudaErrorInvalidConfiguration;
  if (k.kernel == nullptr) return cudaErrorNotSupported;
  const bool warps = decode_warp_merge_by_rule(p, reduce_rows) != ((p.variant & kDecodeVariantWarpMerge) != 0);
  if (warps && k.reduce_warps == nullptr) return cudaErrorInvalidValue;
  // (a work list: p.worklist slots of (sequence, split), decode/worklist.cuh)
  const dim3 grid(static_cast<unsigned>(p.num_kv_heads * gchunks), p.worklist > 0 ? p.worklist : p.batch,
                  p.worklist > 0 ? 1 : p.num_splits);
  cudaError_t err;
  if (p.worklist > 0) {
    // The plan first, then the split kernel behind it (programmatic dependent launch): its CTAs
    // are resident by the time the plan lands and wait for it in decode_slice.
    if (k.worklist_kernel == nullptr || k.worklist_reduce == nullptr || k.worklist_reduce_grouped == nullptr ||
        k.worklist_reduce_warps == nullptr || k.fused || p.worklist_plan == nullptr || p.batch > kWorklistMaxBatch ||
        p.worklist <= p.batch)
      return cudaErrorInvalidValue;
    decode_worklist_plan_kernel<<<1, kWorklistPlanThreads, 0, stream>>>(p);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    err = launch_pdl(k.worklist_kernel, grid, dim3(k.threads), k.smem_bytes, stream, p.cc_major >= 9, p);
  } else {
    k.kernel<<<grid, k.threads, k.smem_bytes, stream>>>(p);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess || p.num_splits == 1 || k.fused || (p.variant & kVariantNoReduce)) return err;
  // The reduction as a programmatic dependent launch: its CTAs are set up while the split
  // kernel drains instead of after it.
  const int seqs_per_cta = p.worklist > 0 && !warps ? worklist_merge_seqs_per_cta(p, reduce_rows) : 1;
  const int heads_per_cta = warps ? kReduceWarpHeads : 1;
  const dim3 reduce_grid((p.num_q_heads + heads_per_cta - 1) / heads_per_cta,
                         static_cast<unsigned>((reduce_rows + seqs_per_cta - 1) / seqs_per_cta));
  const auto reduce = p.worklist == 0      ? (warps ? k.reduce_warps : k.reduce)
                      : seqs_per_cta > 1 ? k.worklist_reduce_grouped
                                         : (warps ? k.worklist_reduce_warps : k.worklist_reduce);
  return launch_pdl(reduce, reduce_grid, dim3(kReduceThreads), 0, stream,
                    p.cc_major >= 9 && !(p.variant & kVariantNoPDL), p);
}

#if MINIPAGED_DECODE_TRACE
cudaError_t decode_trace_read(unsigned long long* split, unsigned long long* merge, unsigned long long* plan) {
  cudaError_t err = cudaMemcpyFromSymbol(split, g_decode_trace, sizeof(g_decode_trace));
  if (err == cudaSuccess) err = cudaMemcpyFromSymbol(merge, g_reduce_trace, sizeof(g_reduce_trace));
  if (err == cudaSuccess) err = cudaMemcpyFromSymbol(plan, g_plan_trace, sizeof(g_plan_trace));
  return err;
}

cudaError_t decode_trace_clear() {
  const auto zero = [](const auto& marks) {
    void* addr = nullptr;
    const cudaError_t err = cudaGetSymbolAddress(&addr, marks);
    return err == cudaSuccess ? cudaMemset(addr, 0, sizeof(marks)) : err;
  };
  cudaError_t err = zero(g_decode_trace);
  if (err == cudaSuccess) err = zero(g_reduce_trace);
  if (err == cudaSuccess) err = zero(g_plan_trace);
  return err;
}
#endif

}  // namespace minipaged
