// Paged decode on tensor cores, for GQA groups of 4 or more query heads.
//
// The scalar kernel (decode/scalar.cuh) spends G multiply-adds per cached element per
// CTA; from G = 4 up that, not memory, bounds it. Here the query heads of one
// KV group are the M = 16 rows of an mma.m16n8k16 tile (rows past the group are
// zero), so a KV group of up to 16 heads costs one MMA row block:
//   S = Q K^T    ldmatrix + mma.sync, fp32 accumulators, scores stay in registers
//   softmax      online, on the fragments (a head's row lives in one quad)
//   O += P V     P re-packed to 16-bit in registers, V through ldmatrix.trans
// Each of the 4 warps owns WT = 16 tokens of every 64-token tile (32 of 128 in
// the FP8 benchmarking tilings; NW = 2 warps: 16 of every 32-token tile) and keeps
// its own running max / sum / O; the warps are merged once at the end, as in the
// scalar kernel. Short query runs of more than 16 rows (MQ, RB = 2) split the
// warps over two row blocks first: each block's two warps own 32 tokens of every
// 64-token tile. K/V rows are
// gathered through the block table with cp.async into a STAGES-deep ring of
// XOR-swizzled shared tiles (one barrier per tile); every row is addressed on
// its own, and a run of rows inside one page shares its table entry.
//
// FP8 caches (FP8): the ring holds the e4m3 bytes as loaded (half the bytes of
// a 16-bit tile) and the MMA operands are widened in registers, exactly, to f16
// whatever q's type (ptx/fp8.cuh: the widening to bf16 costs four times the
// instructions, and the widening, not memory, bounded the kernel). A bf16 q is
// moved to f16 once per CTA by a power of two per head, which the score scale
// undoes; P is rounded to f16. k_scale is folded into the score scale and
// v_scale into the output.
#pragma once
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "decode/common.cuh"
#include "decode/reduce.cuh"
#include "decode/trace.cuh"
#include "params.h"
#include "ptx/cp_async.cuh"
#include "ptx/fp8.cuh"
#include "ptx/ldmatrix.cuh"
#include "ptx/misc.cuh"
#include "ptx/mma.cuh"

// 1: the prologue tiles' block-table entries are read before context_lens arrives (bounded by the
// split and the table, as the scalar kernel's are), so a CTA's first K/V loads wait on one
// dependent global read instead of two. On by default: on the H200 it timed within noise of 0
// (bench/results/nvidia-h200/decode_early_108a7a1/), it checks and sanitizes clean, and it takes one
// dependent read off a latency-bound path; 0 keeps the old order for A/B runs.
#ifndef MINIPAGED_DECODE_EARLY_TABLE
#define MINIPAGED_DECODE_EARLY_TABLE 1
#endif
// 1: the prologue requests a tile for every ring stage, not STAGES - 1: at the start of a call,
// when every CTA waits on its first tile, STAGES tiles per CTA are in flight instead of
// STAGES - 1 (the loop then refills from the second tile on). 0: the old order, for A/B runs.
#ifndef MINIPAGED_DECODE_FULL_PROLOGUE
#define MINIPAGED_DECODE_FULL_PROLOGUE 1
#endif
// 1: the warp merge stores only the query-head rows the CTA owns (ng of the 16 MMA rows) in
// shared memory. 0: all 16 (the old epilogue), for A/B runs.
#ifndef MINIPAGED_DECODE_REAL_ROWS
#define MINIPAGED_DECODE_REAL_ROWS 1
#endif
// Short query runs (MQ), and decodes merged as they are (MINIPAGED_DECODE_ROW_MERGE), 1: the merge
// buffer's rows are D + 8 floats apart, so a warp's O stores (8 real rows at once, not a G 2
// decode's 1-2) spread over the banks instead of hitting one 8 ways: 1-2% off the H200 spec rows
// at B=128 L=1k and B=32 L=4k (bench/results/nvidia-h200/cuda_spec_decode_2731244/). 0: unpadded,
// for A/B runs.
#ifndef MINIPAGED_MQ_PAD
#define MINIPAGED_MQ_PAD 1
#endif

// How a decode's rows (not MQ's, which always take it) are merged across warps at the end:
// 1 (default), through merge_query_rows_and_store (per-row weights once, vector loads and
// stores); 0, merge_warps_and_store (every warp's weight recomputed per element, a cost that grows
// with G), for A/B runs. A fused kernel and its two-launch twin always merge alike, so their
// partials, and outputs, stay the same bits. The row merge never lost in
// bench/results/nvidia-h100/decode_two_warp_ab_2716344 (its rm2 build is this default; its rm1
// build merged only the two-warp kernels' rows that way).
#ifndef MINIPAGED_DECODE_ROW_MERGE
#define MINIPAGED_DECODE_ROW_MERGE 1
#endif

namespace minipaged {
namespace decode_mma {

// Warps per CTA of the default instantiations. NW = 2 (one row block, either cache) halves a CTA's
// tile and ring, so twice the CTAs fit per SM: a grid of short contexts over many (sequence,
// KV head) pairs then runs in one wave instead of two (decode/launch.cu, with_two_warp).
constexpr int kWarps = 4;
constexpr int kRows = 16;          // query heads per CTA (one MMA row block)

// WT: tokens per warp per tile (16, or 32 for FP8 caches: one softmax step,
// barrier and page lookup per 32 tokens; the G = 2 FP8 default, decode/select.cuh).
// RB: MMA row blocks per CTA (2: short query runs of up to 32 rows; the warps split the rows
// before the tokens, so a tile is kWarps / RB * WT tokens).
template <int D, int STAGES, bool FP8 = false, int WT = 16, int RB = 1, int NW = kWarps>
struct Smem {
  static constexpr int kTileElems = NW / RB * WT * D;
  static constexpr int kTileBytes = kTileElems * (FP8 ? 1 : 2);
  static constexpr int kStageBytes = 2 * kTileBytes;  // K tile then V tile
  static constexpr int kQBytes = RB * kRows * D * 2;
  static constexpr int kMergeBytes = NW * kRows * (D + 2) * 4;  // O, m, l per warp (fp32)
  static constexpr int kRingBytes = STAGES * kStageBytes;
  static_assert(kMergeBytes <= kRingBytes, "the merge buffers reuse the ring");
  // +256: the base is rounded up to 256 bytes for the XOR address stepping.
  static constexpr int kBytes = kRingBytes + kQBytes + 256;
};

// Byte offset of (row, 16-byte chunk) in a [rows][D] 16-bit tile: chunks are
// XOR-swizzled by the row so that ldmatrix and cp.async hit 8 bank groups.
template <int D>
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
  return static_cast<uint32_t>((row * D + ((chunk ^ (row & 7)) << 3)) * 2);
}

// Column c of an FP8 O fragment row (n tile c / 8, column c % 8) holds dim fp8_o_dim.
template <int D>
struct FragDimOf {
  __device__ __forceinline__ int operator()(int c) const { return fp8_o_dim<D>(c >> 3, c & 7); }
};

// Minimum CTAs per SM of the FUSED kernels (0: none, the unfused kernels). An
// explicit minimum lifts ptxas' rounding down to an occupancy step, which made
// the D=64 tail spill on sm_80; shared memory bounds the 16-bit kernels'
// residency anyway. The FP8 ring fits 3 CTAs per SM: on sm_90 ask for the 168
// registers that keep 3 (unasked, the tail took 195); on sm_80 that spills.
// The 32-token FP8 tiling needs about 200 registers: 2 CTAs per SM, no minimum.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr int kFusedMinBlocksFp8 = 1;
#else
constexpr int kFusedMinBlocksFp8 = 3;
#endif
// Minimum CTAs per SM of the short-query-run kernels (MQ) on sm_80: their shared memory keeps
// 2 per SM, and without the bound ptxas rounded the FP8 one-block kernel down to 168 registers
// and spilled. 0 elsewhere (sm_90a compiles them without spills and is left as measured).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr int kMqMinBlocks = 2;
#else
constexpr int kMqMinBlocks = 0;
#endif
// Minimum CTAs per SM of the work-list twins (WL) on sm_80: unbounded, ptxas rounded the
// D = 64 one to 96 registers and spilled; 1 lifts that rounding. 0 on sm_90a, as their bases.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr int kWorklistMinBlocks = 1;
#else
constexpr int kWorklistMinBlocks = 0;
#endif

// The A fragments of a bf16 tile (rows g: words 0, 2; rows g + 8: words 1, 3;
// KS k steps) -> f16 fragments of the same rows, row r times 2^e_r with e_r
// from the row's largest finite |q| (ptx/fp8.cuh; the quad of lanes holding a
// row agrees on it). inv_scale[r] = 2^-e_r.
template <int KS>
__device__ __forceinline__ void bf16_rows_to_f16(uint32_t (&a)[KS][4], float (&inv_scale)[2]) {
  float amax[2] = {0.f, 0.f};
#pragma unroll
  for (int kk = 0; kk < KS; ++kk)
#pragma unroll
    for (int w = 0; w < 4; ++w) amax[w & 1] = fmaxf(amax[w & 1], bf16x2_abs_max(a[kk][w]));
  float scale[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xffffffffu, amax[r], 1));
    amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xffffffffu, amax[r], 2));
    const int e = f16_exponent(amax[r]);
    scale[r] = exp2i(e);
    inv_scale[r] = exp2i(-e);
  }
#pragma unroll
  for (int kk = 0; kk < KS; ++kk)
#pragma unroll
    for (int w = 0; w < 4; ++w) a[kk][w] = bf16x2_to_f16x2(a[kk][w], scale[w & 1]);
}

// FUSED: the last CTA of each (sequence, KV head, head chunk) merges the splits
// (fused_split_reduce) instead of a second kernel.
// PQ: packed queries (DecodeParams::cu_seqlens_q, the paged decode routing):
// a CTA of a sequence that is not a decode row returns before any load.
// MQ: short query runs (DecodeParams::max_seqlen_q, speculative verification routed
// from paged attention): the 16 MMA rows are the q_len x G (query, head) pairs of
// one KV group, each masked at its own query's last key. The K/V stream and the
// tile loop are a decode's: the rows a decode leaves as padding carry the extra
// queries.
// RB = 2 (MQ only): 32 rows, two MMA row blocks. Warp w computes row block w % 2 over token
// slice w / 2 of each tile, so every K/V tile is read from shared memory by two warps and a
// warp's registers hold one row block, as in a decode (two blocks per warp would spill).
// WL: the work-list twin (decode_slice; DecodePlan::worklist_kernel).
template <typename T, int D, int STAGES, bool FP8 = false, bool FUSED = false, bool PQ = false, int WT = 16,
          bool MQ = false, int RB = 1, bool WL = false, int NW = kWarps>
__global__ void __launch_bounds__(NW * 32, FUSED ? (FP8 && WT == 16 ? kFusedMinBlocksFp8 : 1)
                                                 : (MQ ? kMqMinBlocks : (WL ? kWorklistMinBlocks : 0)))
    paged_decode_mma_kernel(const DecodeParams p) {
  static_assert(WT == 16 || (WT == 32 && (FP8 || RB == 2)), "32 tokens per warp: FP8 caches or two row blocks");
  static_assert(RB == 1 || (RB == 2 && MQ), "two row blocks: short query runs only");
  static_assert(NW == kWarps || (NW == 2 && RB == 1 && !FUSED), "two-warp CTAs: one row block, two launches");
  using S = Smem<D, STAGES, FP8, WT, RB, NW>;
  constexpr int kCtaThreads = NW * 32;
  constexpr int kTile = NW / RB * WT;  // tokens per pipeline stage
  using KV = std::conditional_t<FP8, uint8_t, T>;     // cache element
  using MT = std::conditional_t<FP8, __half, T>;      // the MMA operand type
  constexpr int kEPC = 16 / static_cast<int>(sizeof(KV));  // elements per 16-byte chunk
  constexpr int kChunks = D / kEPC;              // 16-byte chunks per row
  constexpr int kRowStep = kCtaThreads / kChunks;  // rows one copy pass covers
  constexpr int kCopyIters = kTile / kRowStep;
  constexpr int kDT = D / 8;                     // n-tiles of O per warp
  static_assert(kTile % kRowStep == 0 && kRowStep % 4 == 0, "copy layout");

  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t pad = ((raw + 255u) & ~255u) - raw;
  unsigned char* smem = smem_raw + pad;
  const uint32_t ring = raw + pad;
  const uint32_t s_q = ring + S::kRingBytes;

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int rb = warp % RB;  // the warp's MMA row block
  const int tw = warp / RB;  // and its WT-token slice of every tile
  decode_trace(kTrEntry);
  decode_trace(kTrSm);

  static_assert(!((PQ || MQ || WL) && FUSED), "packed queries and work lists run the two-launch reduction");
  const DecodeSlice slice = decode_slice<PQ, MQ, WL>(p, kRows);
  // A split past its sequence's splits returns before it requests anything (CTA-uniform).
  if (decode_split_unused(slice)) {
    decode_trace(kTrExit);
    return;
  }
  const int kvh = slice.kvh, b = slice.b, h0 = slice.h0, ng = slice.ng;
  const int start = slice.start, end = slice.end;

  const int log2_bs = __ffs(p.block_size) - 1;
  const int bs_mask = p.block_size - 1;
  const int32_t* bt = p.block_tables + b * p.block_table_stride;
  // Thread tid copies chunk c of the kCopyIters consecutive rows from r0 of
  // every tile. With pages of at least kCopyIters tokens and a split that
  // starts on a multiple of kCopyIters (decode_plan's splits are whole tiles)
  // those rows share one page: one table entry and one pair of wide
  // multiplies per tile (page_runs).
  const int c = tid % kChunks;
  const int r0 = tid / kChunks * kCopyIters;
  const bool page_runs = p.block_size >= kCopyIters && start % kCopyIters == 0;
  // The run a split of a sequence that fills the table covers (DecodeParams::tokens_per_split),
  // known before context_lens arrives: the early table reads below assume it, and are used
  // only if the sequence's own run (decode_seq_splits) turns out to be the same.
  const int guess_start = slice.split * p.tokens_per_split;
  const int guess_end = min(slice.capacity, guess_start + p.tokens_per_split);
  const bool guess_page_runs = p.block_size >= kCopyIters && guess_start % kCopyIters == 0;
  // MINIPAGED_DECODE_EARLY_TABLE: the prologue tiles' entries, read here, ahead of any use of
  // context_lens (and of the packed-query skip); an entry past the context is read but never
  // followed (its rows are past `end`).
  constexpr bool kEarlyTable = MINIPAGED_DECODE_EARLY_TABLE != 0;
  // Tiles the prologue requests (MINIPAGED_DECODE_FULL_PROLOGUE).
  // 16-bit caches only: an FP8 tile's longer compute makes the CTA work through its STAGES
  // landed tiles with one request in flight, which measured 0.3-0.6% slower on the H200.
  constexpr bool kFullPrologue = MINIPAGED_DECODE_FULL_PROLOGUE != 0 && STAGES >= 2 && !FP8;
  constexpr int kPrologueTiles = kFullPrologue ? STAGES : STAGES - 1;
  [[maybe_unused]] int first_pages[kPrologueTiles > 0 ? kPrologueTiles : 1];
  if constexpr (kEarlyTable) {
#pragma unroll
    for (int st = 0; st < kPrologueTiles; ++st) {
      const int tok0 = guess_start + st * kTile + r0;
      first_pages[st] = guess_page_runs && tok0 < guess_end ? __ldg(bt + (tok0 >> log2_bs)) : 0;
    }
  }
  if (decode_slice_skipped<PQ, MQ>(slice)) {  // CTA-uniform, before any barrier
    decode_trace(kTrExit);
    return;
  }
  // (entries past the guess's end were not read: the guess holds if the runs are the same)
  const bool early_pages_hold = start == guess_start && slice.table_end == guess_end;
  const int n_tiles = end > start ? (end - start + kTile - 1) / kTile : 0;
  const int k_block_stride = static_cast<int>(p.k_block_stride), k_token_stride = static_cast<int>(p.k_token_stride);
  const int v_block_stride = static_cast<int>(p.v_block_stride), v_token_stride = static_cast<int>(p.v_token_stride);
  const KV* kbase = static_cast<const KV*>(p.k_cache) + kvh * p.k_head_stride + c * kEPC;
  const KV* vbase = static_cast<const KV*>(p.v_cache) + kvh * p.v_head_stride + c * kEPC;

  // Gathers the K and V rows of tile t into ring stage `stage`; rows past `end`
  // are zero-filled without being read (their scores are masked below).
  // Row `row` of the tile at `kdst` / `vdst` from kp / vp (zero-filled, not read, unless valid).
  auto copy_row = [&](uint32_t kdst, uint32_t vdst, int row, const KV* kp, const KV* vp, bool valid) {
    if constexpr (FP8) {
      cp_async_16(kdst + fp8_tile_k_off<D>(row, c), kp, valid);
      cp_async_16(vdst + fp8_tile_v_off<D>(row, c), vp, valid);
    } else {
      cp_async_16(kdst + swz<D>(row, c), kp, valid);
      cp_async_16(vdst + swz<D>(row, c), vp, valid);
    }
  };
  // 32-bit strides (the binding checks they fit): one wide multiply per pointer.
  // A row past `end` follows no table entry and points at page 0 (never
  // dereferenced: cp.async zero-fills it).
  // The page_runs copy of tile t into ring stage `stage`, its page entry already read.
  auto copy_page_run = [&](int t, int stage, int page_entry) {
    const uint32_t kdst = ring + stage * S::kStageBytes;
    const uint32_t vdst = kdst + S::kTileBytes;
    const int tok0 = start + t * kTile + r0;
    const int page = tok0 < end ? page_entry : 0;
    const int in_page = tok0 & bs_mask;
    const KV* kp = kbase + (mul_wide(page, k_block_stride) + in_page * k_token_stride);
    const KV* vp = vbase + (mul_wide(page, v_block_stride) + in_page * v_token_stride);
#pragma unroll
    for (int it = 0; it < kCopyIters; ++it)
      copy_row(kdst, vdst, r0 + it, kp + it * k_token_stride, vp + it * v_token_stride, tok0 + it < end);
  };
  auto load_tile = [&](int t, int stage) {
    const int tok0 = start + t * kTile + r0;
    if (page_runs) {
      copy_page_run(t, stage, tok0 < end ? __ldg(bt + (tok0 >> log2_bs)) : 0);
    } else {
      const uint32_t kdst = ring + stage * S::kStageBytes;
      const uint32_t vdst = kdst + S::kTileBytes;
#pragma unroll
      for (int it = 0; it < kCopyIters; ++it) {
        const int tok = tok0 + it;
        const bool valid = tok < end;
        const int page = valid ? __ldg(bt + (tok >> log2_bs)) : 0;
        const int in_page = tok & bs_mask;
        copy_row(kdst, vdst, r0 + it, kbase + (mul_wide(page, k_block_stride) + in_page * k_token_stride),
                 vbase + (mul_wide(page, v_block_stride) + in_page * v_token_stride), valid);
      }
    }
  };

  // Prologue: Q rows (heads past the group are zeros), then STAGES-1 tiles.
  // MQ: row r is head r % G of query r / G.
  const int group = slice.group;
  {
    const T* qp = static_cast<const T*>(p.q) + slice.row * p.q_batch_stride + h0 * p.q_head_stride;
    for (int idx = tid; idx < RB * kRows * (D / 8); idx += kCtaThreads) {
      const int row = idx / (D / 8), ch = idx % (D / 8);
      const bool valid = row < ng;
      if constexpr (MQ) {
        const int qi = query_of_row(row, slice.inv_group);
        const T* src = valid ? qp + qi * p.q_batch_stride + (row - qi * group) * p.q_head_stride + ch * 8 : qp;
        cp_async_16(s_q + swz<D>(row, ch), src, valid);
      } else {
        cp_async_16(s_q + swz<D>(row, ch), valid ? qp + row * p.q_head_stride + ch * 8 : qp, valid);
      }
    }
    cp_async_commit();
  }
#pragma unroll
  for (int st = 0; st < kPrologueTiles; ++st) {
    if (st < n_tiles) {
      if (kEarlyTable && page_runs && early_pages_hold)
        copy_page_run(st, st, first_pages[st]);
      else
        load_tile(st, st);
    }
    cp_async_commit();
  }

  const int lm_row8 = lane & 7;
  const int lm_bit3 = (lane >> 3) & 1;
  const int lm_bit4 = lane >> 4;
  const int g = lane >> 2;        // fragment rows g and g + 8
  const int tq = (lane & 3) * 2;  // fragment column pair
  uint32_t q_frag[D / 16][4];
  float row_scale[2] = {1.f, 1.f};  // what undoes bf16_rows_to_f16 on rows g, g + 8
  cp_async_wait<kPrologueTiles>();  // the Q group has landed
  __syncthreads();
  // Row block rb starts 16 rows in: the swizzle repeats every 8 rows.
  const uint32_t s_q_rb = s_q + static_cast<uint32_t>(rb * kRows * D * 2);
  if constexpr (FP8) {
    const auto q_off = [](int row, int chunk) { return swz<D>(row, chunk); };
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) fp8_q_frag(s_q_rb, g, kk, lane & 3, q_off, q_frag[kk]);
    if constexpr (std::is_same_v<T, __nv_bfloat16>) bf16_rows_to_f16(q_frag, row_scale);
  } else {
    const uint32_t q_lm = s_q_rb + swz<D>(lm_row8 + lm_bit3 * 8, lm_bit4);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(q_frag[kk], q_lm ^ uint32_t(kk << 5));
  }
  // K (B operand of Q K^T): this warp's tokens 0-7 / 8-15 x chunk 2kk / 2kk+1 (WT = 32: and
  // 16-31, 16 rows on).
  const uint32_t k_lm = ring + swz<D>(tw * WT + lm_row8 + lm_bit4 * 8, lm_bit3);
  // V (B operand of P V, transposed): tokens 0-7 / 8-15 x chunk 2dp / 2dp+1.
  const uint32_t v_lm = ring + S::kTileBytes + swz<D>(tw * WT + lm_row8 + lm_bit3 * 8, lm_bit4);
  constexpr uint32_t kKeyBlockBytes = 16 * D * 2;  // 16 rows of a 16-bit tile

  float scale_log2 = p.scale * kLog2e;
  if constexpr (FP8) scale_log2 *= p.k_scale[kvh];
  const float row_scale_log2[2] = {scale_log2 * row_scale[0], scale_log2 * row_scale[1]};
  float acc_o[kDT][4];
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[dt][e] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};  // running max (log2 units) of rows g, g + 8
  float l[2] = {0.f, 0.f};              // this thread's share of the row sums
  // Keys rows g, g + 8 see: the split's, and with MQ and causal, those up to their query's
  // place at the end of the context (bottom-right).
  int row_end[2] = {end, end};
  if constexpr (MQ) {
    if (p.causal) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int qi = query_of_row(rb * kRows + g + 8 * h, slice.inv_group);
        row_end[h] = min(end, slice.ctx - slice.q_len + qi + 1);
      }
    }
  }

  for (int t = 0; t < n_tiles; ++t) {
    const int stage = t % STAGES;
    // Groups complete in commit order: tile t's is done once at most the STAGES - 2 tiles
    // requested after it (STAGES - 1 at t = 0 after a full prologue) are pending.
    if (kFullPrologue && t == 0)
      cp_async_wait<STAGES - 1>();
    else
      cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile t landed for everyone; tile t-1's stage is free
    if (t == 0) decode_trace(kTrFirstTile);
    if (t == n_tiles - 1) decode_trace(kTrLastTile);
    // Refill tile t-1's stage with tile t + STAGES - 1 (a full prologue already requested it at t = 0).
    if (!kFullPrologue || t > 0) {
      if (t + STAGES - 1 < n_tiles) load_tile(t + STAGES - 1, (t + STAGES - 1) % STAGES);
      cp_async_commit();
    }

    const uint32_t k_stage = k_lm + stage * S::kStageBytes;
    const uint32_t v_stage = v_lm + stage * S::kStageBytes;
    constexpr int kNT = WT / 8;  // 8-key n-tiles of S per warp
    float s[kNT][4];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
    if constexpr (FP8) {
      const uint32_t kt = ring + stage * S::kStageBytes;
#pragma unroll
      for (int blk = 0; blk < D / 64; ++blk) {
        uint4 kw[kNT];  // keys g, g + 8, ... of this warp
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) kw[nt] = lds128(kt + fp8_tile_k_off<D>(tw * WT + nt * 8 + g, blk * 4 + (lane & 3)));
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) {
            uint32_t b0, b1;
            fp8_k_frag(kw[nt], j, b0, b1);
            mma_16816<MT>(s[nt], q_frag[blk * 4 + j], b0, b1);
          }
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int kb = 0; kb < WT / 16; ++kb) {
          uint32_t bk[4];
          ldmatrix_x4(bk, (k_stage + kb * kKeyBlockBytes) ^ uint32_t(kk << 5));
          mma_16816<T>(s[2 * kb], q_frag[kk], bk[0], bk[1]);
          mma_16816<T>(s[2 * kb + 1], q_frag[kk], bk[2], bk[3]);
        }
      }
    }
    const int tok0 = start + t * kTile + tw * WT;
    float alpha[2];
    bool max_moved = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = m[h];
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int tok = tok0 + nt * 8 + tq + e;
          float& x = s[nt][2 * h + e];
          x = tok < (MQ ? row_end[h] : end) ? x * row_scale_log2[h] : -INFINITY;
          mx = fmaxf(mx, x);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // A row that has seen only masked tokens keeps reference 0: ex2(-inf) = 0.
      const float mref = mx == -INFINITY ? 0.f : mx;
      alpha[h] = fast_exp2(m[h] - mref);
      max_moved |= mx != m[h];
      m[h] = mx;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[nt][2 * h + e];
          x = fast_exp2(x - mref);
          sum += x;
        }
      l[h] = l[h] * alpha[h] + sum;
    }
    // After the first tiles a running max rarely moves, and where none of the
    // warp's rows moved every alpha is 1: the O rescale (kDT * 4 multiplies
    // per thread, for 16 rows however few heads are real) is skipped, warp-uniformly.
    if (__any_sync(0xffffffffu, max_moved)) {
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        acc_o[dt][0] *= alpha[0];
        acc_o[dt][1] *= alpha[0];
        acc_o[dt][2] *= alpha[1];
        acc_o[dt][3] *= alpha[1];
      }
    }
#pragma unroll
    for (int kb = 0; kb < WT / 16; ++kb) {
      // The m16n8 C fragments of two 8-token halves form an m16n8k16 A fragment.
      uint32_t a[4];
      a[0] = pack2<MT>(s[2 * kb][0], s[2 * kb][1]);
      a[1] = pack2<MT>(s[2 * kb][2], s[2 * kb][3]);
      a[2] = pack2<MT>(s[2 * kb + 1][0], s[2 * kb + 1][1]);
      a[3] = pack2<MT>(s[2 * kb + 1][2], s[2 * kb + 1][3]);
      if constexpr (FP8) {
        uint32_t vw[4][D / 32];
        fp8_load_v_rows<D>(ring + stage * S::kStageBytes + S::kTileBytes, tw * WT + kb * 16, g, lane & 3, vw);
        fp8_pv<D>(vw, [&](int dt, uint32_t b0, uint32_t b1) { mma_16816<MT>(acc_o[dt], a, b0, b1); });
      } else {
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t bv[4];
          ldmatrix_x4_trans(bv, (v_stage + kb * kKeyBlockBytes) ^ uint32_t(dp << 5));
          mma_16816<T>(acc_o[2 * dp], a, bv[0], bv[1]);
          mma_16816<T>(acc_o[2 * dp + 1], a, bv[2], bv[3]);
        }
      }
    }
  }
  cp_async_wait<0>();
  decode_trace(kTrLoopDone);
  if (!decode_early_trigger(p)) griddep_launch_dependents();  // (else decode_slice did)
  __syncthreads();  // every warp is done with the ring: it becomes the merge buffer

  // A decode's rows through the short-query-run merge (MINIPAGED_DECODE_ROW_MERGE): per-row
  // weights once, vector loads and stores, instead of every weight recomputed per element; its
  // buffer rows padded as MQ's are (a G 8 decode stores 8 real rows too).
  constexpr bool kRowMerge = MQ || MINIPAGED_DECODE_ROW_MERGE != 0;
  constexpr int kOStride = kRowMerge && MINIPAGED_MQ_PAD != 0 ? D + 8 : D;  // floats between sm_o rows
  static_assert(NW * kRows * (kOStride + 2) * 4 <= S::kRingBytes, "the merge buffers reuse the ring");
  float* sm_o = reinterpret_cast<float*>(smem);  // [NW][kRows][kOStride]
  float* sm_m = sm_o + NW * kRows * kOStride;    // [NW][kRows]
  float* sm_l = sm_m + NW * kRows;               // [NW][kRows]
  constexpr bool kRealRows = MINIPAGED_DECODE_REAL_ROWS != 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float lsum = l[h];
    lsum += __shfl_xor_sync(0xffffffffu, lsum, 1);
    lsum += __shfl_xor_sync(0xffffffffu, lsum, 2);
    const int row = g + 8 * h;
    // Rows past the CTA's ng heads are padding the merge never reads: at G = 2 storing them
    // was 8x the shared-memory stores, every one an 8-way bank conflict (rows D floats apart).
    if (kRealRows && rb * kRows + row >= ng) continue;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      float2 v = make_float2(acc_o[dt][2 * h], acc_o[dt][2 * h + 1]);
      *reinterpret_cast<float2*>(sm_o + (warp * kRows + row) * kOStride + dt * 8 + tq) = v;
    }
    if ((lane & 3) == 0) {
      sm_m[warp * kRows + row] = m[h];
      sm_l[warp * kRows + row] = lsum;
    }
  }
  __syncthreads();

  if constexpr (kRowMerge) {
    if constexpr (FP8) {
      merge_query_rows_and_store<T, NW, kRows, RB, D, kOStride, true, FragDimOf<D>, MQ, WL>(
          p, slice, sm_m, sm_l, sm_o, p.v_scale[kvh], FragDimOf<D>{});
    } else {
      merge_query_rows_and_store<T, NW, kRows, RB, D, kOStride, false, IdentityDim, MQ, WL>(
          p, slice, sm_m, sm_l, sm_o, 1.f, IdentityDim{});
    }
  } else if constexpr (FP8) {
    merge_warps_and_store<T, NW, kRows, D, true, FragDimOf<D>, WL>(p, slice, sm_m, sm_l, sm_o, p.v_scale[kvh],
                                                                     FragDimOf<D>{});
  } else {
    merge_warps_and_store<T, NW, kRows, D, false, IdentityDim, WL>(p, slice, sm_m, sm_l, sm_o);
  }
  if constexpr (FUSED) {
    // The merge buffers are free once the partials are stored: weights in sm_o, max / sum in sm_m / sm_l.
    static_assert(NW * D >= kMaxSplits, "sm_o holds kRows rows of split weights");
    if (slice.num_splits > 1) fused_split_reduce<T, D, kCtaThreads>(p, slice, sm_o, sm_m, sm_l);
  }
  decode_trace(kTrExit);
}

}  // namespace decode_mma
}  // namespace minipaged
