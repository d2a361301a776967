// Paged-KV decode (one query token per sequence), shared by the `cuda` and
// `cuda-wmma` backends: kernel choice, split planning and launch. Two kernels,
// the scalar one of decode/scalar.cuh (GQA groups of 1-2 heads) and the
// tensor-core one of decode/mma.cuh (groups of 3+ heads, and G = 2 at D = 128
// when the splits are long); select_for_dim() and decode_plan() choose. Both
// write the same split partials, merged by decode/reduce.cuh.
// With few CTAs (small batch, long context) the context is split (flash-decoding):
// each split writes a normalised partial output and its log2-sum-exp, and a
// second kernel merges them. The split count depends only on host-side shapes
// (B, Hkv, table capacity, SM count), never on context_lens, so the launch is
// graph-capturable and needs no host sync.
// FP8 caches (p.kv_fp8) have their own, smaller set of kernels: select_fp8().
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <mutex>
#include <type_traits>
#include <vector>

#include "decode/mma.cuh"
#include "decode/reduce.cuh"
#include "decode/scalar.cuh"
#include "params.h"

// MINIPAGED_DECODE_BENCH_TILINGS=0 compiles only the kernels a default plan can pick (and
// their fused builds): the benchmarking tilings then fall back to the default. CI's compile
// test uses it to spend its minutes on the kernels that ship; every real build keeps them all.
#ifndef MINIPAGED_DECODE_BENCH_TILINGS
#define MINIPAGED_DECODE_BENCH_TILINGS 1
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

int group_tile(int group) {
  if (group <= 1) return 1;
  if (group <= 2) return 2;
  if (group <= 4) return 4;
  return 8;
}

using DecodeKernel = void (*)(const DecodeParams);

// Benchmark-only bit above the tiling number (p.variant & 0xff): launch the
// reduction without programmatic dependent launch, to measure what PDL saves
// (bench/results/nvidia-h200/cuda_kernel_notes.md).
constexpr int kVariantNoPDL = 0x200;
// Bit 0x400: the one-launch split reduction (the decode kernel's last CTA per
// (sequence, KV head, head chunk) merges the splits; DecodePlan::fused). Built
// for the default kernel of every (dtype, head dim, group) and for tilings
// 10 and 13-17; with another tiling the bit is ignored (plan.fused stays false).
// Not the default: measured slower than the two-launch reduction on most of
// the decode grid (bench/results/nvidia-h200/decode_tilings.md).
constexpr int kVariantFused = 0x400;
// Bit 0x800, timing only (decode_selftest): the split kernel without its
// reduction, to measure what the merge costs. The output is not written.
constexpr int kVariantNoReduce = 0x800;

// Scalar kernel (decode/scalar.cuh); AHEAD / MINB: its register-ring depth and
// minimum CTAs per SM (0 / 0: the PIPE / STAGES pipelines, no register cap).
// PQ: the packed-query instantiations (DecodeParams::cu_seqlens_q).
// TWIN: also the work-list twin (DecodePlan::worklist_kernel) of a plain, two-launch kernel.
template <typename T, int D, int G, int TPT, int U, bool PIPE = false, int STAGES = 0, bool FP8 = false,
          bool FUSED = false, int AHEAD = 0, int MINB = 0, bool PQ = false, bool TWIN = false>
DecodePlan info() {
  constexpr int kPieceElems = FP8 ? 16 : 8;  // cache elements per 16-byte piece
  DecodePlan k;
  k.kernel = paged_decode_kernel<T, D, G, TPT, U, PIPE, STAGES, FP8, FUSED, AHEAD, MINB, PQ>;
  k.reduce = decode_reduce_kernel<T, D, PQ>;
  if constexpr (TWIN && !FUSED && !PQ) {
    k.worklist_kernel = paged_decode_kernel<T, D, G, TPT, U, PIPE, STAGES, FP8, false, AHEAD, MINB, false, true>;
    k.worklist_reduce = decode_reduce_kernel<T, D, false, false, true>;
    k.worklist_reduce_grouped = decode_reduce_kernel<T, D, false, false, true, true>;
  }
  k.group_tile = G;
  k.threads = kWarps * 32;
  k.tokens_per_iter = kWarps * (32 / TPT) * U;
  k.smem_bytes = STAGES >= 2 ? STAGES * U * (D / (kPieceElems * TPT)) * 2 * kWarps * 32 * 16 : 0;
  k.fused = FUSED;
  return k;
}

// info<> with the fused reduction when `fused` (the tilings that have one).
template <typename T, int D, int G, int TPT, int U, bool PIPE = false, int STAGES = 0, bool FP8 = false,
          int AHEAD = 0, int MINB = 0>
DecodePlan info_f(bool fused) {
  return fused ? info<T, D, G, TPT, U, PIPE, STAGES, FP8, true, AHEAD, MINB>()
               : info<T, D, G, TPT, U, PIPE, STAGES, FP8, false, AHEAD, MINB>();
}

// info_f for the scalar kernels a default plan picks: the two-launch build with its work-list
// twin (only those have one: decode_plan takes a work list with them alone).
template <typename T, int D, int G, int TPT, int U, bool PIPE = false, int STAGES = 0, bool FP8 = false>
DecodePlan info_d(bool fused) {
  return fused ? info<T, D, G, TPT, U, PIPE, STAGES, FP8, true>()
               : info<T, D, G, TPT, U, PIPE, STAGES, FP8, false, 0, 0, false, true>();
}

// The tensor-core kernel (decode_mma.cuh): up to 16 query heads per CTA; WT
// tokens per warp per tile; MQ: short query runs (DecodeParams::max_seqlen_q), RB row blocks
// of 16 (query, head) rows; NW warps per CTA.
// TWIN: also the work-list twin of a plain, two-launch kernel.
template <typename T, int D, int STAGES, bool FP8 = false, bool FUSED = false, bool PQ = false, int WT = 16,
          bool MQ = false, int RB = 1, bool TWIN = false, int NW = decode_mma::kWarps>
DecodePlan info_mma() {
  DecodePlan k;
  k.kernel = decode_mma::paged_decode_mma_kernel<T, D, STAGES, FP8, FUSED, PQ, WT, MQ, RB, false, NW>;
  k.reduce = decode_reduce_kernel<T, D, PQ, MQ>;
  if constexpr (TWIN && !FUSED && !PQ && !MQ) {
    k.worklist_kernel = decode_mma::paged_decode_mma_kernel<T, D, STAGES, FP8, false, false, WT, false, RB, true, NW>;
    k.worklist_reduce = decode_reduce_kernel<T, D, false, false, true>;
    k.worklist_reduce_grouped = decode_reduce_kernel<T, D, false, false, true, true>;
  }
  k.group_tile = RB * decode_mma::kRows;
  k.threads = NW * 32;
  k.tokens_per_iter = NW / RB * WT;
  k.smem_bytes = decode_mma::Smem<D, STAGES, FP8, WT, RB, NW>::kBytes;
  k.fused = FUSED;
  return k;
}

template <typename T, int D, int STAGES, bool FP8 = false, bool TWIN = false>
DecodePlan info_mma_f(bool fused) {
  return fused ? info_mma<T, D, STAGES, FP8, true>() : info_mma<T, D, STAGES, FP8, false, false, 16, false, 1, TWIN>();
}

// The tensor-core kernel as every default picks it: a 4-stage ring of byte
// tiles on FP8 caches (3 CTAs per SM), 3 stages of 16-bit tiles otherwise; the
// packed-query instantiation (two-launch reduction) or the fused bit's choice.
template <typename T, int D, bool FP8, bool PQ>
DecodePlan default_mma(bool fused) {
  constexpr int kStages = FP8 ? 4 : 3;
  if constexpr (PQ) {
    return info_mma<T, D, kStages, FP8, false, true>();
  } else {
    return info_mma_f<T, D, kStages, FP8, true>(fused);
  }
}

// The tensor-core kernel in two-warp CTAs (32-token tiles), what with_two_warp swaps in for
// default_mma<T, D, FP8, PQ>(false): the plain build, or the packed-query one. No work-list twin:
// the rule's tables (at most kDecodeTwoWarpMaxTableTokens) are narrower than any that takes a
// work list (decode_worklist_splits: three 2 MB split caps). 16-bit caches: a 2-stage ring
// (tiling 22's kernel), 37 KB of shared memory against the 4-warp kernel's 100 KB, so 6 CTAs fit
// per SM against 2. FP8: 4 stages of byte tiles (FP8 tiling 23's), 36 KB against 68 KB, 6 CTAs
// per SM against 3.
template <typename T, int D, bool FP8, bool PQ>
DecodePlan two_warp_mma() {
  constexpr int kStages = FP8 ? 4 : 2;
  return info_mma<T, D, kStages, FP8, false, PQ, 16, false, 1, false, 2>();
}

// The tensor-core kernel on FP8 caches with 32 tokens per warp per tile and a
// 3-stage ring (the G = 2 default, tensor_core_g2_for; what FP8 tiling 18 runs): the
// packed-query instantiation, or the fused bit's choice.
template <typename T, int D, bool PQ>
DecodePlan fp8_wide_mma(bool fused) {
  if constexpr (PQ) {
    return info_mma<T, D, 3, true, false, true, 32>();
  } else {
    return fused ? info_mma<T, D, 3, true, true, false, 32>()
                 : info_mma<T, D, 3, true, false, false, 32, false, 1, true>();
  }
}

// FP8 caches: a 16-byte piece is 16 elements, so the scalar kernel spreads a
// row over D/16 threads (one piece each) and covers twice the tokens per load
// of the 16-bit tiling with the same bytes in flight. From 3 query heads per
// KV head up (both head dims) the tensor-core kernel runs; a stage of byte
// tiles takes half the shared memory of a 16-bit one, so its ring is 4 stages
// deep and 3 CTAs fit per SM (registers bound them; the 16-bit kernel fits 2).
// The 16-bit benchmarking tilings do not apply, except: 10/11
// force the tensor-core kernel, 12 the scalar one (2 heads per CTA: a larger
// group is covered by several CTAs per KV head, each re-reading its pages).
// FP8 tilings for the G = 2 scalar kernel, benchmarking only: the rows staged
// through shared memory with cp.async, as the 16-bit default does (more bytes
// in flight per SM than the register double buffer): 6: 2 token groups per
// warp, 3 stages; 7: 2 groups, 4 stages; 8: 4 groups, 3 stages.
// FP8 tilings 18 / 19, benchmarking only: the tensor-core kernel with 32
// tokens per warp per tile (one softmax step, barrier and page lookup per 128
// tokens), 3 / 2 stages, any group size.
template <typename T, int D>
DecodePlan select_fp8(const DecodeParams& p) {
  constexpr int TPT = D / 16;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int tiling = p.variant & 0xff;
  const bool fused = p.variant & kVariantFused;
#if MINIPAGED_DECODE_BENCH_TILINGS
  if (tiling == 18) return info_mma<T, D, 3, true, false, false, 32>();
  if (tiling == 19) return info_mma<T, D, 2, true, false, false, 32>();
  // the tensor-core kernel in two-warp CTAs (16 tokens per warp, 32-token tiles): 23, 4 stages;
  // 24, 6 stages
  if (tiling == 23) return two_warp_mma<T, D, true, false>();  // what the two-warp rule runs
  if (tiling == 24) return info_mma<T, D, 6, true, false, false, 16, false, 1, false, 2>();
#endif
  if (tiling == 10 || tiling == 11 || (tiling != 12 && group >= 3)) return default_mma<T, D, true, false>(fused);
  if (group == 1) return info_d<T, D, 1, TPT, 4, false, 0, true>(fused);
#if MINIPAGED_DECODE_BENCH_TILINGS
  // These three have no fused build: the bit is ignored (plan.fused stays false).
  if (group == 2) {
    if (tiling == 6) return info<T, D, 2, TPT, 2, false, 3, true>();
    if (tiling == 7) return info<T, D, 2, TPT, 2, false, 4, true>();
    if (tiling == 8) return info<T, D, 2, TPT, 4, false, 3, true>();
  }
#endif
  return info_d<T, D, 2, TPT, 2, true, 0, true>(fused);
}

// Whether the 16-bit default for a GQA group of `group` query heads per KV head is the
// tensor-core kernel (else the scalar one; G = 2 at D = 128 is decided per call by
// decode_plan / tensor_core_g2). Plain and packed-query calls share this rule.
template <int D>
constexpr bool default_tensor_cores(int group) {
  return group >= 3 || (D == 64 && group == 2);
}

// Tilings. Registers per thread grow with G * D / TPT (q and the accumulator
// live in registers), so larger groups spread a row over more threads.
// `variant` exposes alternatives of the common G <= 2, D = 128 case for tuning.
template <typename T, int D>
DecodePlan select_for_dim(const DecodeParams& p) {
  const int g = group_tile(p.num_q_heads / p.num_kv_heads);
  const int requested = p.variant & 0xff;
  const bool fused = p.variant & kVariantFused;
  // Tiling 12: the scalar kernel's default tiling even where 0 would pick tensor cores.
  const int tiling = requested == 12 ? 0 : requested;
  if (tiling == 10) return default_mma<T, D, false, false>(fused);  // tensor cores, any group size
#if MINIPAGED_DECODE_BENCH_TILINGS
  if (tiling == 11) return info_mma<T, D, 2>();
  // Tensor cores in two-warp CTAs (32-token tiles, half the ring: twice the CTAs per SM), any
  // group size: 20, 3 stages; 21, 4 stages; 22, 2 stages.
  if (tiling == 20) return info_mma<T, D, 3, false, false, false, 16, false, 1, false, 2>();
  if (tiling == 21) return info_mma<T, D, 4, false, false, false, 16, false, 1, false, 2>();
  if (tiling == 22) return two_warp_mma<T, D, false, false>();  // what the two-warp rule runs
#endif
  // Default kernel choice. From 3 query heads per KV head up, the scalar
  // kernel is bound by its G multiply-adds per cached element, so the
  // tensor-core kernel wins; at G=2 the scalar kernel stays ahead with few
  // sequences and, by its one-wave occupancy, with short contexts
  // (bench/results/nvidia-h200/cuda_kernel_notes.md has the measurements).
  // (G = 2 at D = 128 may still go to tensor cores: decode_plan, tensor_core_g2.)
  // At D = 64 the tensor-core kernel also wins at G = 2, on every row of the decode_selftest
  // grid (0.84-0.91x the scalar kernel's time; G = 4: 0.61-0.78x; G = 8: 0.31-0.64x;
  // bench/results/nvidia-h200/decode_d64_4a28ab1/).
  if (requested == 0 && default_tensor_cores<D>(p.num_q_heads / p.num_kv_heads))
    return default_mma<T, D, false, false>(fused);
  if constexpr (D == 128) {
    switch (g) {
      case 1:
        return info_d<T, D, 1, 8, 2>(fused);
      case 2:
        // Default: a row over 8 threads (two 16-byte pieces each) with a
        // 3-stage cp.async ring in shared memory (tiling 6): the fastest
        // tiling on every row of the decode_selftest grid on the H200
        // (bench/results/nvidia-h200/decode_tilings.md); 17 is the previous
        // default (a row over 16 threads, rows double-buffered in registers).
        switch (tiling) {
#if MINIPAGED_DECODE_BENCH_TILINGS
          case 1: return info<T, D, 2, 8, 4>();
          case 2: return info<T, D, 2, 16, 2>();
          case 3: return info<T, D, 2, 16, 4>();
          case 4: return info<T, D, 2, 8, 2>();
          case 5: return info<T, D, 2, 8, 2, true>();
          case 7: return info<T, D, 2, 16, 2, false, 4>();
          case 8: return info<T, D, 2, 16, 4, false, 3>();
          case 9: return info<T, D, 2, 16, 4, true>();
          // More K/V bytes requested ahead of use, for few sequences (one
          // wave of long splits): register rings without PIPE's buffer-swap
          // copy. Per thread ahead of compute / registers (sm_90a) / CTAs
          // per SM: 13: 64 B / 96 / 5 (PIPE's depth); 14: 128 B / 123 / 4;
          // 15: 96 B / 96 / 5 (one token group per warp, 3 iterations
          // ahead); 16: 224 B / 128 / 4 (7 iterations ahead).
          case 13: return info_f<T, D, 2, 16, 2, false, 0, false, 1>(fused);
          case 14: return info_f<T, D, 2, 16, 2, false, 0, false, 2>(fused);
          case 15: return info_f<T, D, 2, 16, 1, false, 0, false, 3>(fused);
          case 16: return info_f<T, D, 2, 16, 1, false, 0, false, 7>(fused);
          case 17: return info_f<T, D, 2, 16, 2, true>(fused);
#endif
          default: return info_d<T, D, 2, 8, 2, false, 3>(fused);
        }
      case 4:
#if MINIPAGED_DECODE_BENCH_TILINGS
        if (tiling == 7) return info<T, D, 4, 16, 2, false, 4>();
        if (tiling == 9) return info<T, D, 4, 16, 2, true>();
#endif
        return info_d<T, D, 4, 16, 2>(fused);
      default:
#if MINIPAGED_DECODE_BENCH_TILINGS
        // G = 8 holds 2 x 64 fp32 of q and accumulator per thread: only two
        // blocks fit per SM, so variant 7 keeps the in-flight rows in shared memory.
        if (tiling == 7) return info<T, D, 8, 16, 2, false, 4>();
#endif
        return info_d<T, D, 8, 16, 2>(fused);
    }
  } else {
    switch (g) {
      case 1: return info_d<T, D, 1, 8, 4>(fused);
      case 2: return info_d<T, D, 2, 8, 4>(fused);
      case 4: return info_d<T, D, 4, 8, 2>(fused);
      default: return info_d<T, D, 8, 8, 2>(fused);
    }
  }
}

// Packed queries (the paged decode routing): the kernels select_fp8 /
// select_for_dim pick with tiling 0 and the two-launch reduction, for every
// group size, in their packed-query instantiations. Only these exist with
// PQ, so `variant` is not read here: a change of those defaults must be
// made here too (the paged_ws selftest and tests/test_cuda.py compare routed
// rows with a plain decode call bit for bit, which catches a drift).
template <typename T, int D>
DecodePlan select_packed(const DecodeParams& p) {
  const int group = p.num_q_heads / p.num_kv_heads;
  if (p.kv_fp8) {
    constexpr int TPT = D / 16;
    if (group >= 3) return default_mma<T, D, true, true>(false);
    if (group == 1) return info<T, D, 1, TPT, 4, false, 0, true, false, 0, 0, true>();
    return info<T, D, 2, TPT, 2, true, 0, true, false, 0, 0, true>();
  }
  if (default_tensor_cores<D>(group)) return default_mma<T, D, false, true>(false);
  if constexpr (D == 128) {
    if (group == 1) return info<T, D, 1, 8, 2, false, 0, false, false, 0, 0, true>();
    return info<T, D, 2, 8, 2, false, 3, false, false, 0, 0, true>();
  } else {
    return info<T, D, 1, 8, 4, false, 0, false, false, 0, 0, true>();  // G = 1
  }
}

// The tensor-core alternative to the scalar kernel for G = 2 at D = 128 with the
// default tiling (a packed-query call: always), both cache dtypes; {} elsewhere.
// decode_plan takes it when its splits are long (kMinTokensPerSplitTensorCores).
// The choice depends on the table width and the split count only, so routed
// decode rows and a plain decode call with the same forced split count run the
// same kernel.
// On FP8 caches it runs 32 tokens per warp per tile with a 3-stage ring (FP8
// tiling 18: 0.83x the time of the 4-stage, 16-token tiling at B=64 L=8k, 0.96x
// at B=1 L=32k; bench/results/nvidia-h200/decode_tilings.md, sixth session),
// with the fused bit too (the fused build of the same kernel, so both
// reductions merge the same partials).
template <typename T>
DecodePlan tensor_core_g2_for(const DecodeParams& p) {
  const bool fused = p.variant & kVariantFused;
  if (p.cu_seqlens_q != nullptr)
    return p.kv_fp8 ? fp8_wide_mma<T, 128, true>(false) : default_mma<T, 128, false, true>(false);
  return p.kv_fp8 ? fp8_wide_mma<T, 128, false>(fused) : default_mma<T, 128, false, false>(fused);
}
DecodePlan tensor_core_g2(const DecodeParams& p) {
  if (p.head_dim != 128 || p.num_kv_heads <= 0 || p.num_q_heads != 2 * p.num_kv_heads) return {};
  if (p.cu_seqlens_q == nullptr && (p.variant & 0xff) != 0) return {};
  if (p.kv_fp8 && (p.k_scale == nullptr || p.v_scale == nullptr)) return {};
  switch (p.dtype) {
    case DType::kFloat16: return tensor_core_g2_for<__half>(p);
    case DType::kBFloat16: return tensor_core_g2_for<__nv_bfloat16>(p);
  }
  return {};
}

// Short query runs (DecodeParams::max_seqlen_q): the tensor-core kernel of a decode of the
// same cache, in its multi-query instantiation, whatever the group size: 3 stages of 16-bit
// tiles; on FP8 caches 32 tokens per warp and 3 stages at G = 2, D = 128 (the G = 2 FP8
// decode's tiling), else 4 stages of 16 (the G >= 3 one). Over 16 rows (max_seqlen_q x G, up
// to 32): two row blocks, each warp 32 tokens of a 64-token tile, so a stage holds the bytes
// of a decode's (16-bit: 3 stages) or of the G = 2 FP8 decode's half (FP8: 6 stages).
template <typename T, int D>
DecodePlan select_multi_query(const DecodeParams& p) {
  if (int64_t(p.max_seqlen_q) * (p.num_q_heads / p.num_kv_heads) > decode_mma::kRows)
    return p.kv_fp8 ? info_mma<T, D, 6, true, false, false, 32, true, 2>()
                    : info_mma<T, D, 3, false, false, false, 32, true, 2>();
  if (!p.kv_fp8) return info_mma<T, D, 3, false, false, false, 16, true>();
  if constexpr (D == 128) {
    if (p.num_q_heads == 2 * p.num_kv_heads) return info_mma<T, D, 3, true, false, false, 32, true>();
  }
  return info_mma<T, D, 4, true, false, false, 16, true>();
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
  const bool scales_missing = p.kv_fp8 && (p.k_scale == nullptr || p.v_scale == nullptr);
  if (p.max_seqlen_q >= 2) {
    if (p.cu_seqlens_q == nullptr || p.num_kv_heads <= 0 || scales_missing) return {};
    return by_dtype_and_dim(p, [&](auto t, auto d) {
      return select_multi_query<typename decltype(t)::type, decltype(d)::value>(p);
    });
  }
  if (p.cu_seqlens_q != nullptr) {
    if (p.num_kv_heads <= 0 || scales_missing) return {};
    return by_dtype_and_dim(p, [&](auto t, auto d) {
      return select_packed<typename decltype(t)::type, decltype(d)::value>(p);
    });
  }
  if (p.kv_fp8) {
    if (scales_missing) return {};
    return by_dtype_and_dim(p, [&](auto t, auto d) {
      return select_fp8<typename decltype(t)::type, decltype(d)::value>(p);
    });
  }
  return by_dtype_and_dim(p, [&](auto t, auto d) {
    return select_for_dim<typename decltype(t)::type, decltype(d)::value>(p);
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

// two_warp_mma<T, D, FP8, PQ>() where k is default_mma<T, D, FP8, PQ>(false), else k.
template <typename T, int D, bool FP8, bool PQ>
DecodePlan two_warp_if_default(const DecodePlan& k) {
  return k.kernel == default_mma<T, D, FP8, PQ>(false).kernel ? two_warp_mma<T, D, FP8, PQ>() : k;
}

// k, or its two-warp twin (two_warp_mma) where k is the default tensor-core plan of its cache
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
  return by_dtype_and_dim(p, [&](auto t, auto d) -> DecodePlan {
    using T = typename decltype(t)::type;
    constexpr int D = decltype(d)::value;
    if (p.cu_seqlens_q != nullptr)
      return p.kv_fp8 ? two_warp_if_default<T, D, true, true>(k) : two_warp_if_default<T, D, false, true>(k);
    return p.kv_fp8 ? two_warp_if_default<T, D, true, false>(k) : two_warp_if_default<T, D, false, false>(k);
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
  // (a work list: p.worklist slots of (sequence, split), decode/worklist.cuh)
  const dim3 grid(static_cast<unsigned>(p.num_kv_heads * gchunks), p.worklist > 0 ? p.worklist : p.batch,
                  p.worklist > 0 ? 1 : p.num_splits);
  cudaError_t err;
  if (p.worklist > 0) {
    // The plan first, then the split kernel behind it (programmatic dependent launch): its CTAs
    // are resident by the time the plan lands and wait for it in decode_slice.
    if (k.worklist_kernel == nullptr || k.worklist_reduce == nullptr || k.worklist_reduce_grouped == nullptr ||
        k.fused || p.worklist_plan == nullptr || p.batch > kWorklistMaxBatch || p.worklist <= p.batch)
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
  const int seqs_per_cta = p.worklist > 0 ? worklist_merge_seqs_per_cta(p, reduce_rows) : 1;
  const dim3 reduce_grid(p.num_q_heads, static_cast<unsigned>((reduce_rows + seqs_per_cta - 1) / seqs_per_cta));
  const auto reduce = p.worklist == 0 ? k.reduce : seqs_per_cta > 1 ? k.worklist_reduce_grouped : k.worklist_reduce;
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
