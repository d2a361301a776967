// Shape dispatch of the fast prefill kernels, shared by the dense/varlen
// slices (prefill/fast_*.cu) and the paged ones (prefill/paged_*_kv*.cu, through
// prefill/slice.cuh); kPaged picks the K/V tile loader of the same kernels. The launchers
// (prefill/fast.cu, prefill/paged.cu) include it for its host-side rules only.
#pragma once
#include <cmath>
#include <cstdint>

#include "prefill/mainloop_mma.cuh"
// The wgmma kernels exist only in an sm_90a build, which build.py marks with
// -DMINIPAGED_ENABLE_SM90A (MINIPAGED_DISABLE_WGMMA turns them off again, to
// measure or rule out that path). An sm_90a library runs on sm_90 devices only.
#if defined(MINIPAGED_ENABLE_SM90A) && !defined(MINIPAGED_DISABLE_WGMMA)
#define MINIPAGED_DISPATCH_WGMMA 1
#include "prefill/mainloop_wgmma.cuh"
#include "prefill/mainloop_ws.cuh"
#else
#define MINIPAGED_DISPATCH_WGMMA 0
#endif

namespace minipaged {
namespace fast {

// Block shapes (bench/results/prefill_ablation.md has the measurements):
//   kSmall: 4 warps x 16 rows, BLOCK_M 64, Q in registers -- twice the CTAs
//           when the grid would otherwise not fill the GPU
//   kLarge: 4 warps x 32 rows, BLOCK_M 128, BLOCK_N 32, Q re-read from shared
//           memory -- every K/V fragment feeds two m-tiles, which halves
//           ldmatrix traffic per MMA (shared-memory bandwidth bounds the 16-row
//           warp); BLOCK_N 32 keeps it within the register file without spills
// On sm_90 (sm_90a build) the wgmma and warp-specialised kernels below replace both.
template <typename T, int D>
using CfgSmall = PrefillCfg<T, D, 64, 4, 1, true, 2>;
template <typename T, int D>
using CfgLarge = PrefillCfg<T, D, 32, 4, 2, false, 2>;
// Paged, short queries with the GQA group packed into the rows (kPackGQA):
// 2 warps x 16 rows, BLOCK_N 32, 3 stages (56 KB at D=128: 3 CTAs per SM on sm_90,
// whose 228 KB do not hold a fourth with its 1 KB reserve). A decode-like CTA is bound by
// its K/V stream, so it is kept small: more CTAs per SM keep more tiles in flight, and
// fewer padding rows cost MMAs. Its keys split across CTAs where the grid would not fill
// the GPU (PrefillParams::pack_splits, paged_pack_split_plan in prefill/paged.cu).
template <typename T, int D>
using CfgPack = PrefillCfg<T, D, 32, 2, 1, true, 3>;
// Longest query run that takes the packed kernel (max_seqlen_q): speculative
// verification lengths; longer chunks have enough rows per query head.
constexpr int kPackMaxSeqlenQ = 16;

#if MINIPAGED_DISPATCH_WGMMA
// wgmma kernels: 2 warpgroups (BLOCK_M 128, BLOCK_N 128) or, for short grids,
// 1 warpgroup (BLOCK_M 64, BLOCK_N 64, two CTAs per SM); both pipelined.
template <typename T, int D>
using CfgWgmmaLarge = WgmmaCfg<T, D, 2, 1, true, 128>;
template <typename T, int D>
using CfgWgmmaSmall = WgmmaCfg<T, D, 1, 1, true, 64>;
// Dense and varlen K/V: the warp-specialised TMA kernel (BLOCK_M 128, BLOCK_N
// 128, 2 stages) once the grid holds at least half a wave of its CTAs (it
// already wins at B=1 N=1k, 128 CTAs on 132 SMs); below that the
// one-warpgroup wgmma kernel's smaller blocks. Consumer schedule, the best of
// the ablation (bench/results/prefill_ablation.md, run 6): ping-pong +
// intra-warpgroup overlap with N = 128 wgmma instructions, for causal and
// non-causal, D 64 and 128.
template <typename T, int D>
using CfgWs = WsCfg<T, D, 128, 2, true, true, true, false, false, false, false, true>;
// The same kernel over a grid whose K/V (every KV head of every sequence,
// max_seqlen_k keys each) do not fit in the L2: its items in sections of
// whole GQA groups whose K/V fit in half of it, one section after the other
// (ws_l2_section, ws_item). In the default order every wave sweeps all K/V
// from the diagonal down, so each wave evicts what the next one needs. At B=1
// N=16k the sections cut DRAM reads from 556 to 159 MB per call and, under
// the board's power cap, the energy per call by 2.4%
// (bench/results/nvidia-h200/l2_sections_317dffb/). MINIPAGED_DISABLE_L2_SECTIONS
// (a build flag, like MINIPAGED_DISABLE_WGMMA) turns it off, to measure it.
template <typename T, int D>
using CfgWsL2 = WsCfg<T, D, 128, 2, true, true, true, false, false, false, false, true, false, true>;
inline bool ws_l2_sections_pay(const PrefillParams& p) {
#if defined(MINIPAGED_DISABLE_L2_SECTIONS)
  return false;
#else
  const int64_t keys = p.cu_seqlens_k != nullptr ? p.total_k : int64_t(p.batch) * p.max_seqlen_k;
  const int64_t kv_bytes = keys * p.num_kv_heads * p.head_dim * 2 * 2;  // K and V, 2-byte elements
  return p.l2_bytes > 0 && kv_bytes > p.l2_bytes;
#endif
}
// A causal grid of at most one wave of CfgWs's CTAs (B=1 N=1k: 16 heads x 8 blocks on 132
// SMs) takes as long as its heaviest CTA, the last block's, with twice the average work. The
// same kernel with each CTA's two warpgroups on mirrored 64-row blocks (WsCfg::kMirror: block
// M-1-i and block i) gives every CTA about the average: 1.06-1.17x CfgWs on such grids (D 128;
// 1.13x at B=1 N=1k), and 1.06-1.47x the one-warpgroup kernel below half a wave, which it
// replaces there for causal prefill; 0.86x CfgWs at two waves (bench/results/nvidia-h200/mirror_4138ec0/,
// prefill_ablation.md run 12). MINIPAGED_DISABLE_WS_MIRROR (a build flag) turns it off, to
// measure it.
template <typename T, int D>
using CfgWsMirror = WsCfg<T, D, 128, 2, true, true, true, false, false, false, false, true, false, false, false, true>;
// Many short m-block rows (several sequences of at most kWsDynamicMaxSeqlenQ
// queries, at least kWsDynamicMinWaves waves of items): the same schedule in
// persistent CTAs that take their next item from a global counter (heaviest
// first) and stage O through a buffer of their own. It balances such batches
// better than the grid does, and loses on single long sequences, which stay
// on CfgWs (bench/results/prefill_ablation.md, run 7). Needs
// PrefillParams::sched_counters (the binding passes them).
template <typename T, int D>
using CfgWsDynamic = WsCfg<T, D, 128, 2, true, true, true, false, true, true, true, true>;
constexpr int kWsDynamicMaxSeqlenQ = 2048;
constexpr int kWsDynamicMinWaves = 4;
// Paged long chunks (16-bit caches, pages of >= 8 tokens): the same kernel
// with K/V pages loaded by TMA boxes through the block table, and a third
// ring stage: a key tile of small pages is many boxes whose latency two
// stages do not hide (page 16: 0.93 -> 1.03 of the dense kernel at B=8
// q=512, 0.82 -> 0.98 at q=2048 over 32k; bench/results/nvidia-h200/
// paged_ws3_1ad5ff9/). The dense kernel's tiles are one box per column block.
template <typename T, int D>
using CfgWsPaged = WsCfg<T, D, 128, 3, true, true, true, true, false, false, false, true>;
// Causal paged chunks whose work list is at most one wave (a prompt's first chunk of up to
// ~1k tokens at B=1): the same kernel on mirrored 64-row block pairs, as CfgWsMirror for
// dense/varlen (the pairs are of one sequence, so a cached prefix adds the same keys to both).
// It beats the plain schedule from half a wave and the one-warpgroup kernel below it, but for
// a 1-2% loss at 32 CTAs with no prefix (bench/results/nvidia-h200/paged_mirror_4a01a04/).
template <typename T, int D>
using CfgWsPagedMirror = WsCfg<T, D, 128, 3, true, true, true, true, false, false, false, true, true, false, false, true>;
// FP8 pages (e4m3) through the same kernel: 2 ring stages of 16-bit tiles plus 2 staging stages
// of e4m3 tiles, which producer warps 1-3 widen into the ring (WsCfg::kKv8; checked and timed by
// scripts/paged_ws_selftest.cu, variant ws_fp8). Faster than the mma.sync FP8 kernels on every
// chunk shape measured (bench/results/nvidia-h200/ws_fp8_928f617/); -DMINIPAGED_DISABLE_WS_FP8
// sends FP8 chunks back to them.
template <typename T, int D>
using CfgWsPaged8 = WsCfg<T, D, 128, 2, true, true, true, true, false, false, false, true, true, false, true>;
// FP8 causal work lists of at most one wave: CfgWsPaged8 on mirrored 64-row block pairs, as
// CfgWsPagedMirror for 16-bit pages. 1.02-1.13x the plain schedule from 32 to 128 CTAs, 0.77x at
// two waves (bench/results/nvidia-h200/paged_fp8_mirror_b28262d/).
template <typename T, int D>
using CfgWsPaged8Mirror = WsCfg<T, D, 128, 2, true, true, true, true, false, false, false, true, true, false, true, true>;
#endif

// Paged, a batch with q_lens on both sides of kPackMaxSeqlenQ (max_seqlen_q
// says there may be long ones; the host does not know the q_lens): two
// launches on the stream, `packed` for the sequences with q_len <=
// kPackMaxSeqlenQ (grid sized for that many rows) and `tiled` for the longer
// ones; each kernel's CTAs return at once for the other's sequences
// (PrefillParams::qlen_filter). Rows are written by exactly one launch.
// paged_min_seqlen_q (params.h): a batch whose every q_len exceeds kPackMaxSeqlenQ skips the
// packed launch.
template <class Packed, class Tiled>
cudaError_t launch_paged_split(const PrefillParams& p, Packed packed, Tiled tiled) {
  if (paged_min_seqlen_q(p) > kPackMaxSeqlenQ) return tiled(p);
  PrefillParams ps = p;
  ps.qlen_filter = kPackMaxSeqlenQ;
  ps.max_seqlen_q = kPackMaxSeqlenQ;
  const cudaError_t err = packed(ps);
  if (err != cudaSuccess) return err;
  PrefillParams pl = p;
  pl.qlen_filter = -kPackMaxSeqlenQ;
  return tiled(pl);
}

// The mixed-batch split and the TMA paged kernel. On by default (the H200
// selftest and A/B are in bench/results/); the switch stays so the
// benchmarks can time the cp.async wgmma path against them (variant 3
// forces them on whatever the default, variant 1/2 are the old choices).
constexpr bool kPagedNewPathsByDefault = true;

// Decode routing (issue #13): the q_len == 1 sequences of a paged batch run
// the decode kernels (split-K, DecodeParams::cu_seqlens_q) instead of the
// GQA-packed prefill kernel; where GQA packing applies, q_len 2..16 rows
// (speculative runs) the packed kernel in a config that skips q_len 1
// (WithMinSeqlenQ<.., 2>), longer rows the tiled kernel (TMA where it
// applies), else every q_len >= 2 row the tiled kernel (qlen_filter -1). Each
// launch's CTAs find their own sequences from cu_seqlens_q on the device
// (graph-safe, no host sync). The caller owns the decode launch and its split
// workspace (paged_decode_routing / paged_decode_params in params.h;
// binding.cpp and scripts/paged_ws_selftest.cu). On by default since its H200
// selftest (bench/results/nvidia-h200/selftests_*: the mixed batch in 0.99x
// of its parts, against 1.21x through the packed kernel); variant 4 forces it
// on (with the variant-3 paths), variant 3 gives the unrouted default.
constexpr bool kPagedDecodeRoutingByDefault = true;
constexpr int kPagedVariantDecodeRouting = 4;
inline bool paged_decode_routing_on(const PrefillParams& p) {
  return p.variant == kPagedVariantDecodeRouting || (p.variant == 0 && kPagedDecodeRoutingByDefault);
}
// Everything the routing needs besides the switch, from host-known values:
// the decode grid's z extent, and an lse layout the decode kernels write
// ([rows, Hq] with unit head stride).
inline bool paged_decode_routing_ok(const PrefillParams& p) {
  return paged_decode_routing_on(p) && p.batch <= 65535 && (p.lse == nullptr || p.lse_head_stride == 1);
}

// CTAs of a grid of Cfg's row blocks: every (sequence, query head, m-block of max_seqlen_q).
template <class Cfg>
int64_t row_block_grid(const PrefillParams& p) {
  return int64_t(p.batch) * p.num_q_heads * ((p.max_seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM);
}

#if MINIPAGED_DISPATCH_WGMMA
// CTAs of the paged TMA kernel's work list: every owned (sequence, m-block) pair, bounded from
// host-known values (ws_paged_work_bound), times the query heads.
template <class Cfg>
int64_t ws_paged_grid(const PrefillParams& p) {
  return ws_paged_work_bound(p, Cfg::kBlockM) * p.num_q_heads;
}

// Whether a causal grid or paged work list of `ctas` CTAs takes the mirrored pairs
// (CfgWsMirror, CfgWsPagedMirror, CfgWsPaged8Mirror): at most one wave.
inline bool ws_mirror_pays(int64_t ctas, int64_t sms) {
#if defined(MINIPAGED_DISABLE_WS_MIRROR)
  return false;
#else
  return ctas <= sms;
#endif
}
#endif

inline bool paged_new_paths(const PrefillParams& p) {
  return p.variant == 3 || p.variant == kPagedVariantDecodeRouting || (p.variant == 0 && kPagedNewPathsByDefault);
}

// The prefill half of a routed batch: q_len >= 2 only (the decode kernels own
// the q_len == 1 rows); nothing to launch when no sequence can be that long.
// pack_ok: rows of 2..kPackMaxSeqlenQ go to `packed_min2` (a packed config
// that skips q_len 1), or with spec_decode (paged_spec_decode_ok) to the decode
// kernels as well, longer ones to `tiled`.
template <class Packed, class Tiled>
cudaError_t launch_paged_routed_rest(const PrefillParams& p, bool pack_ok, bool spec_decode, Packed packed_min2,
                                     Tiled tiled) {
  if (p.max_seqlen_q <= 1) return cudaSuccess;
  if (pack_ok && paged_min_seqlen_q(p) <= kPackMaxSeqlenQ) {
    if (!spec_decode) {
      PrefillParams ps = p;
      ps.qlen_filter = kPackMaxSeqlenQ;
      ps.max_seqlen_q = std::min(p.max_seqlen_q, kPackMaxSeqlenQ);
      const cudaError_t err = packed_min2(ps);
      if (err != cudaSuccess) return err;
    }
    if (p.max_seqlen_q <= kPackMaxSeqlenQ) return cudaSuccess;
    PrefillParams pl = p;
    pl.qlen_filter = -kPackMaxSeqlenQ;
    return tiled(pl);
  }
  PrefillParams pr = p;
  pr.qlen_filter = -1;
  return tiled(pr);
}

// Paged, the tiled (one query head per CTA) kernels.
template <typename T, int D, bool kCausal>
cudaError_t dispatch_paged_tiled(const PrefillParams& p, cudaStream_t stream) {
#if MINIPAGED_DISPATCH_WGMMA
  const int64_t sms = sm_count(p);
  // The warp-specialised TMA kernel from half a wave of its CTAs (its grid is
  // the work list of the owned sequences), as for dense/varlen; causal work
  // lists of at most one wave on mirrored block pairs, at any size.
  if (paged_new_paths(p) && ws_paged_supported<CfgWsPaged<T, D>>(p)) {
    const int64_t ctas = ws_paged_grid<CfgWsPaged<T, D>>(p);
    if constexpr (kCausal) {
      if (ws_mirror_pays(ctas, sms)) return launch_prefill_ws_paged<CfgWsPagedMirror<T, D>, true>(p, stream);
    }
    if (2 * ctas >= sms) return launch_prefill_ws_paged<CfgWsPaged<T, D>, kCausal>(p, stream);
  }
  if (row_block_grid<CfgWgmmaLarge<T, D>>(p) >= 2 * sms) return launch_prefill_wgmma_cfg<CfgWgmmaLarge<T, D>, kCausal, true>(p, stream);
  return launch_prefill_wgmma_cfg<CfgWgmmaSmall<T, D>, kCausal, true>(p, stream);
#else
  // The small block only: the large one sits at the register limit already
  // and the paged loader's page ids push it into spills.
  return launch_prefill_cfg<CfgSmall<T, D>, kCausal, true>(p, stream);
#endif
}

// Whether the 16-bit paged dispatch sends short query runs (q_len <= kPackMaxSeqlenQ) to the
// GQA-packed kernel: a GQA group of at least 2, and a variant that packs by the tuned rule
// (benchmarking: 1 never packs, 2 packs every sequence, 3 the default choice with the new
// paths on). The packed KV split plan (paged_pack_split_plan) sizes for the same launches.
inline bool paged_pack_ok(const PrefillParams& p) {
  return (p.variant == 0 || p.variant == 3 || p.variant == kPagedVariantDecodeRouting) &&
         p.num_q_heads >= 2 * p.num_kv_heads;
}

// Speculative runs through the decode kernels: where a routed batch packs its short runs
// (q_len 2..kPackMaxSeqlenQ), the tensor-core decode kernel takes them instead of the packed
// prefill kernel (DecodeParams::max_seqlen_q; launch_paged_routed_decodes in prefill/paged.cu
// launches it). It streams K/V as a decode of the same cache does, so a short run costs about
// a decode step. Up to kSpecDecodeMaxRows (query, head) rows per KV head, all in one CTA: 16
// rows in one MMA row block, up to 32 in two (q_len <= 16 at G = 2, <= 8 at G = 4, <= 4 at
// G = 8; a batch whose max_seqlen_q x G is larger keeps the packed kernel for all its short
// runs). Two decode CTAs per KV head, each streaming its K/V, measured slower than the packed
// kernel at q_len 16 (bench/results/nvidia-h200/cuda_spec_decode_2731244/); one CTA with two
// row blocks reads the stream once. The decode grid's extents bound batch x max_seqlen_q.
constexpr bool kPagedSpecDecodeByDefault = true;
constexpr int kSpecDecodeMaxRows = 32;
// FP8 pages: past one MMA row block, each block's warps widen the same K/V bytes, which bounds
// the kernel once every SM holds its two CTAs. Within one wave of them (B x Hkv <= 2 x SMs) it
// took 0.49-0.80x the packed kernel's time on the H200, beyond it 1.17-1.24x
// (bench/results/nvidia-h200/cuda_spec_rows32_a48beea/): there FP8 runs of more than
// MINIPAGED_SPEC_DECODE_FP8_MAX_ROWS rows keep the packed kernel, which widens each element once
// per 32 rows (A/B builds set 32: the decode kernel at any batch).
#ifndef MINIPAGED_SPEC_DECODE_FP8_MAX_ROWS
#define MINIPAGED_SPEC_DECODE_FP8_MAX_ROWS 16
#endif
constexpr int kSpecDecodeFp8CtasPerSm = 2;
inline int64_t paged_spec_decode_max_rows(const PrefillParams& p) {
  const bool one_wave = int64_t(p.batch) * p.num_kv_heads <= int64_t(kSpecDecodeFp8CtasPerSm) * p.num_sms;
  return p.kv_fp8 && !one_wave ? MINIPAGED_SPEC_DECODE_FP8_MAX_ROWS : kSpecDecodeMaxRows;
}
inline int paged_spec_decode_max_q(const PrefillParams& p) { return std::min(p.max_seqlen_q, kPackMaxSeqlenQ); }
inline bool paged_spec_decode_ok(const PrefillParams& p) {
  if (!kPagedSpecDecodeByDefault || !paged_decode_routing_ok(p) || !paged_pack_ok(p) || p.num_kv_heads <= 0)
    return false;
  const int64_t max_q = paged_spec_decode_max_q(p);
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  return max_q >= 2 && paged_min_seqlen_q(p) <= kPackMaxSeqlenQ && max_q * group <= paged_spec_decode_max_rows(p) &&
         int64_t(p.batch) * max_q <= 65535 && (p.head_dim == 64 || p.head_dim == 128) &&
         (!p.kv_fp8 || (p.k_scale != nullptr && p.v_scale != nullptr));
}

template <typename T, int D, bool kCausal>
cudaError_t dispatch_paged(const PrefillParams& p, cudaStream_t stream) {
  const bool pack_ok = paged_pack_ok(p);
  auto packed = [&](const PrefillParams& q) {
    return launch_prefill_cfg<CfgPack<T, D>, kCausal, true, true>(q, stream);
  };
  auto tiled = [&](const PrefillParams& q) { return dispatch_paged_tiled<T, D, kCausal>(q, stream); };
  if (paged_decode_routing_ok(p)) {
    auto packed_min2 = [&](const PrefillParams& q) {
      return launch_prefill_cfg<WithMinSeqlenQ<CfgPack<T, D>, 2>, kCausal, true, true>(q, stream);
    };
    return launch_paged_routed_rest(p, pack_ok, paged_spec_decode_ok(p), packed_min2, tiled);
  }
  if (p.variant == 2 || (pack_ok && p.max_seqlen_q <= kPackMaxSeqlenQ)) return packed(p);
  if (!pack_ok || !paged_new_paths(p)) return tiled(p);
  return launch_paged_split(p, packed, tiled);
}

template <typename T, int D, bool kCausal, bool kPaged>
cudaError_t dispatch_shape(const PrefillParams& p, cudaStream_t stream) {
  if constexpr (kPaged) {
    return dispatch_paged<T, D, kCausal>(p, stream);
  } else {
#if MINIPAGED_DISPATCH_WGMMA
  {
    const int64_t wg_blocks = row_block_grid<CfgWgmmaLarge<T, D>>(p);
    const int64_t sms = sm_count(p);
    if constexpr (!kPaged) {
      if (ws_supported(p)) {
        if (2 * wg_blocks >= sms) {
          if (p.sched_counters != nullptr && p.batch > 1 && p.max_seqlen_q <= kWsDynamicMaxSeqlenQ &&
              row_block_grid<CfgWs<T, D>>(p) >= kWsDynamicMinWaves * sms)
            return launch_prefill_ws<CfgWsDynamic<T, D>, kCausal>(p, stream);
          if (ws_l2_sections_pay(p)) return launch_prefill_ws<CfgWsL2<T, D>, kCausal>(p, stream);
        }
        // causal, at most one wave: also below half a wave, where it beats the one-warpgroup kernel
        // (no non-causal instantiation: every block of a full grid carries the same work)
        if constexpr (kCausal) {
          if (ws_mirror_pays(row_block_grid<CfgWs<T, D>>(p), sms)) return launch_prefill_ws<CfgWsMirror<T, D>, kCausal>(p, stream);
        }
        if (2 * wg_blocks >= sms) return launch_prefill_ws<CfgWs<T, D>, kCausal>(p, stream);
      }
    }
    if (wg_blocks >= 2 * sms) return launch_prefill_wgmma_cfg<CfgWgmmaLarge<T, D>, kCausal, kPaged>(p, stream);
    return launch_prefill_wgmma_cfg<CfgWgmmaSmall<T, D>, kCausal, kPaged>(p, stream);
  }
#endif
  if constexpr (!kPaged) {
    // The large block needs about two waves of CTAs to keep every SM busy
    // through the causal tail; below that, halve the block and double the grid.
    if (row_block_grid<CfgLarge<T, D>>(p) >= 2 * sm_count(p)) return launch_prefill_cfg<CfgLarge<T, D>, kCausal, kPaged>(p, stream);
  }
  return launch_prefill_cfg<CfgSmall<T, D>, kCausal, kPaged>(p, stream);
  }
}

template <typename T, int D, bool kPaged>
cudaError_t dispatch_causal(const PrefillParams& p, cudaStream_t stream) {
  return p.causal ? dispatch_shape<T, D, true, kPaged>(p, stream) : dispatch_shape<T, D, false, kPaged>(p, stream);
}

template <typename T, bool kPaged>
cudaError_t dispatch_dim(const PrefillParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return dispatch_causal<T, 64, kPaged>(p, stream);
    case 128: return dispatch_causal<T, 128, kPaged>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

inline bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

}  // namespace fast
}  // namespace minipaged
