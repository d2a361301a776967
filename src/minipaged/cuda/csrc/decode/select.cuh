// Decode kernel selection per (element type, head dim, cache dtype): the templates that name
// the kernels of decode/scalar.cuh and decode/mma.cuh, and the entry points decode/launch.cu
// calls through decode/select.h. Each decode/kernels_*.cu instantiates the entry points of one
// (T, D, FP8), and with them compiles that slice of the kernels, so that a build compiles the
// slices in parallel instead of one translation unit holding every kernel.
#pragma once
#include <cstdint>
#include <type_traits>

#include "decode/mma.cuh"
#include "decode/reduce.cuh"
#include "decode/scalar.cuh"
#include "decode/select.h"
#include "params.h"

// MINIPAGED_DECODE_BENCH_TILINGS=0 compiles only the kernels a default plan can pick (and
// their fused builds): the benchmarking tilings then fall back to the default. CI's compile
// test uses it to spend its minutes on the kernels that ship; every real build keeps them all.
#ifndef MINIPAGED_DECODE_BENCH_TILINGS
#define MINIPAGED_DECODE_BENCH_TILINGS 1
#endif

namespace minipaged {
namespace decode_select {

inline int group_tile(int group) {
  if (group <= 1) return 1;
  if (group <= 2) return 2;
  if (group <= 4) return 4;
  return 8;
}

// Bit 0x400: the one-launch split reduction (the decode kernel's last CTA per
// (sequence, KV head, head chunk) merges the splits; DecodePlan::fused). Built
// for the default kernel of every (dtype, head dim, group) and for tilings
// 10 and 13-17; with another tiling the bit is ignored (plan.fused stays false).
// Not the default: measured slower than the two-launch reduction on most of
// the decode grid (bench/results/nvidia-h200/decode_tilings.md).
constexpr int kVariantFused = 0x400;

// The work-list merges of a plan with a work-list twin: one head per CTA, grouped, and warps.
template <typename T, int D>
void set_worklist_reduce(DecodePlan& k) {
  k.worklist_reduce = decode_reduce_kernel<T, D, false, false, true>;
  k.worklist_reduce_grouped = decode_reduce_kernel<T, D, false, false, true, true>;
  k.worklist_reduce_warps = decode_reduce_kernel<T, D, false, false, true, false, true>;
}

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
  k.reduce_warps = decode_reduce_kernel<T, D, PQ, false, false, false, true>;
  if constexpr (TWIN && !FUSED && !PQ) {
    k.worklist_kernel = paged_decode_kernel<T, D, G, TPT, U, PIPE, STAGES, FP8, false, AHEAD, MINB, false, true>;
    set_worklist_reduce<T, D>(k);
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
  k.reduce_warps = decode_reduce_kernel<T, D, PQ, MQ, false, false, true>;
  if constexpr (TWIN && !FUSED && !PQ && !MQ) {
    k.worklist_kernel = decode_mma::paged_decode_mma_kernel<T, D, STAGES, FP8, false, false, WT, false, RB, true, NW>;
    set_worklist_reduce<T, D>(k);
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
// STAGES-deep ring (the G = 2 default, tensor_core_g2_for: 3 stages, what FP8 tiling 18 runs;
// 2 under the short-ring rule, what tiling 19 runs): the packed-query instantiation, or the
// fused bit's choice.
template <typename T, int D, bool PQ, int STAGES = 3>
DecodePlan fp8_wide_mma(bool fused) {
  if constexpr (PQ) {
    return info_mma<T, D, STAGES, true, false, true, 32>();
  } else {
    return fused ? info_mma<T, D, STAGES, true, true, false, 32>()
                 : info_mma<T, D, STAGES, true, false, false, 32, false, 1, true>();
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
template <typename T, int D, bool FP8>
DecodePlan select_packed(const DecodeParams& p) {
  const int group = p.num_q_heads / p.num_kv_heads;
  if constexpr (FP8) {
    constexpr int TPT = D / 16;
    if (group >= 3) return default_mma<T, D, true, true>(false);
    if (group == 1) return info<T, D, 1, TPT, 4, false, 0, true, false, 0, 0, true>();
    return info<T, D, 2, TPT, 2, true, 0, true, false, 0, 0, true>();
  } else {
    if (default_tensor_cores<D>(group)) return default_mma<T, D, false, true>(false);
    if constexpr (D == 128) {
      if (group == 1) return info<T, D, 1, 8, 2, false, 0, false, false, 0, 0, true>();
      return info<T, D, 2, 8, 2, false, 3, false, false, 0, 0, true>();
    } else {
      return info<T, D, 1, 8, 4, false, 0, false, false, 0, 0, true>();  // G = 1
    }
  }
}

// Short query runs (DecodeParams::max_seqlen_q): the tensor-core kernel of a decode of the
// same cache, in its multi-query instantiation, whatever the group size: 3 stages of 16-bit
// tiles; on FP8 caches 32 tokens per warp and 3 stages at G = 2, D = 128 (the G = 2 FP8
// decode's tiling), else 4 stages of 16 (the G >= 3 one). Over 16 rows (max_seqlen_q x G, up
// to 32): two row blocks, each warp 32 tokens of a 64-token tile, so a stage holds the bytes
// of a decode's (16-bit: 3 stages) or of the G = 2 FP8 decode's half (FP8: 6 stages).
template <typename T, int D, bool FP8>
DecodePlan select_multi_query(const DecodeParams& p) {
  const bool two_blocks = int64_t(p.max_seqlen_q) * (p.num_q_heads / p.num_kv_heads) > decode_mma::kRows;
  if constexpr (!FP8) {
    return two_blocks ? info_mma<T, D, 3, false, false, false, 32, true, 2>()
                      : info_mma<T, D, 3, false, false, false, 16, true>();
  } else {
    if (two_blocks) return info_mma<T, D, 6, true, false, false, 32, true, 2>();
    if constexpr (D == 128) {
      if (p.num_q_heads == 2 * p.num_kv_heads) return info_mma<T, D, 3, true, false, false, 32, true>();
    }
    return info_mma<T, D, 4, true, false, false, 16, true>();
  }
}

// two_warp_mma<T, D, FP8, PQ>() where k is default_mma<T, D, FP8, PQ>(false), else k.
template <typename T, int D, bool FP8, bool PQ>
DecodePlan two_warp_if_default(const DecodePlan& k) {
  return k.kernel == default_mma<T, D, FP8, PQ>(false).kernel ? two_warp_mma<T, D, FP8, PQ>() : k;
}

}  // namespace decode_select

template <typename T, int D, bool FP8>
DecodePlan select_kernel_for(const DecodeParams& p) {
  using namespace decode_select;
  if (p.max_seqlen_q >= 2) return select_multi_query<T, D, FP8>(p);
  if (p.cu_seqlens_q != nullptr) return select_packed<T, D, FP8>(p);
  if constexpr (FP8) {
    return select_fp8<T, D>(p);
  } else {
    return select_for_dim<T, D>(p);
  }
}

// The tensor-core plan for G = 2 at D = 128 (decode/launch.cu tensor_core_g2 decides when).
// On FP8 caches it runs 32 tokens per warp per tile with a 3-stage ring (FP8 tiling 18: 0.83x
// the time of the 4-stage, 16-token tiling at B=64 L=8k, 0.96x at B=1 L=32k;
// bench/results/nvidia-h200/decode_tilings.md, sixth session), with the fused bit too (the
// fused build of the same kernel, so both reductions merge the same partials). Over pages of
// 64+ tokens the short-ring rule (params.h decode_fp8_short_ring_wanted) takes 2 stages.
template <typename T, bool FP8>
DecodePlan tensor_core_g2_for(const DecodeParams& p) {
  using namespace decode_select;
  const bool fused = p.variant & kVariantFused;
  const bool packed = p.cu_seqlens_q != nullptr;
  if constexpr (FP8) {
    if (decode_fp8_short_ring_wanted(p.block_size, p.variant))
      return packed ? fp8_wide_mma<T, 128, true, 2>(false) : fp8_wide_mma<T, 128, false, 2>(fused);
    return packed ? fp8_wide_mma<T, 128, true>(false) : fp8_wide_mma<T, 128, false>(fused);
  } else {
    return packed ? default_mma<T, 128, false, true>(false) : default_mma<T, 128, false, false>(fused);
  }
}

template <typename T, int D, bool FP8>
DecodePlan two_warp_twin_for(const DecodePlan& k, bool packed) {
  using namespace decode_select;
  return packed ? two_warp_if_default<T, D, FP8, true>(k) : two_warp_if_default<T, D, FP8, false>(k);
}

}  // namespace minipaged

// The explicit instantiations of one decode/kernels_*.cu. A trace build
// (MINIPAGED_DECODE_TRACE) keeps its marks in static __device__ arrays, one set per translation
// unit, so there decode/launch.cu includes every kernels_*.cu and they compile to nothing alone.
#if MINIPAGED_DECODE_TRACE && !defined(MINIPAGED_DECODE_KERNELS_IN_ONE_TU)
#define MINIPAGED_DECODE_INSTANTIATE(T, D, FP8)
#define MINIPAGED_DECODE_INSTANTIATE_G2(T, FP8)
#else
#define MINIPAGED_DECODE_INSTANTIATE(T, D, FP8)                                         \
  namespace minipaged {                                                                 \
  template DecodePlan select_kernel_for<T, D, FP8>(const DecodeParams&);                \
  template DecodePlan two_warp_twin_for<T, D, FP8>(const DecodePlan&, bool);            \
  }
#define MINIPAGED_DECODE_INSTANTIATE_G2(T, FP8) \
  namespace minipaged {                         \
  template DecodePlan tensor_core_g2_for<T, FP8>(const DecodeParams&); \
  }
#endif
