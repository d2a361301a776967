// FA2-style causal/non-causal prefill on mma.sync (sm_80+; also the sm_90 path).
//
// One CTA owns BLOCK_M query rows of one (batch, query head); each warp owns
// 16 * kMTiles of those rows for the whole kernel. Per K/V tile of kBlockN keys:
//   S = Q K^T   ldmatrix + mma.m16n8k16, fp32 accumulators, S never leaves registers
//   softmax     online, on the accumulator fragments; a row lives in one quad,
//               so row max/sum need two xor-shuffles; scale*log2(e) folded into exp2
//   O += P V    P is re-packed to 16-bit in registers: the m16n8 C fragment of two
//               adjacent n-tiles is exactly the m16n8k16 A fragment (FA2's trick);
//               V goes through ldmatrix.trans
// K/V tiles stream through a kStages-deep cp.async ring (the load of tile t+1
// overlaps the math of tile t). Shared memory rows are XOR-swizzled in 16-byte
// chunks so that ldmatrix and cp.async touch 8 distinct bank groups.
// Key tiles are walked from the last to the first: the tiles that need a mask
// (the causal diagonal and the Nk tail) come first, then a mask-free loop.
// Tiles entirely above the causal diagonal are never loaded.
//
// kPaged selects the K/V tile loader: dense rows (k + j * row_stride) or rows
// gathered through a block table from paged caches (launch_prefill_paged);
// everything after the copy (MMAs, mask, softmax, epilogue) is shared.
// kPackGQA (short queries): a CTA owns one KV head instead of one query head,
// and its rows are the (query row, head) pairs of that head's GQA group,
// packed row = query_row * group + head_in_group, so the group's K/V pages are
// streamed once for all of its heads (the decode kernels' trick, for q_len > 1).
//
// FP8 K/V (Cfg = Fp8KV<...>, paged only): the K/V tiles are e4m3 bytes as
// loaded from the cache (half the shared memory and bytes of a 16-bit tile);
// the MMA operands are widened to f16 in registers after plain shared loads,
// in the permuted layouts of ptx/fp8.cuh (Q's fragments are read in K's order;
// O holds dims permuted until the epilogue puts them back). A bf16 q moves to
// f16 by one power of two per warp, P is rounded to f16. The KV head's
// k_scale (and q's power of two) is folded into the score scale and its
// v_scale into 1/l. Causal is a
// runtime flag there (p.causal), which halves the instantiations: a
// non-causal call runs the causal kernel with a diagonal past every key.
#pragma once
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "params.h"
#include "prefill/common.cuh"
#include "prefill/softmax.cuh"
#include "ptx/cp_async.cuh"
#include "ptx/fp8.cuh"
#include "ptx/ldmatrix.cuh"
#include "ptx/misc.cuh"
#include "ptx/mma.cuh"
#include "split_merge.cuh"

namespace minipaged {
namespace fast {

template <typename T_, int kD_, int kBlockN_, int kWarps_, int kMTiles_, bool kQInRegs_,
          int kStages_, bool kSwizzle_ = true, int kMinBlocks_ = 1, bool kLazyRescale_ = true>
struct PrefillCfg {
  using T = T_;
  static constexpr int kD = kD_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kMTiles = kMTiles_;
  static constexpr bool kQInRegs = kQInRegs_;
  static constexpr int kStages = kStages_;
  static constexpr bool kSwizzle = kSwizzle_;
  static constexpr int kMinBlocks = kMinBlocks_;  // __launch_bounds__ occupancy hint
  static constexpr bool kLazyRescale = kLazyRescale_;
  static constexpr bool kKV8 = false;  // FP8 K/V tiles: Fp8KV<> below

  static constexpr int kThreads = kWarps * 32;
  static constexpr int kWarpRows = 16 * kMTiles;
  static constexpr int kBlockM = kWarps * kWarpRows;
  static constexpr int kChunks = kD / 8;  // 16-byte chunks per row
  static constexpr int kTileElems = kBlockN * kD;
  static constexpr int kStageElems = 2 * kTileElems;  // K tile, then V tile
  static constexpr int kQElems = kBlockM * kD;
  // Q is only needed until it sits in registers, so with two stages it borrows
  // stage 1 (which the first loop iteration refills); the output is staged in
  // the same place at the end, after the last barrier.
  static constexpr bool kQAliased = kQInRegs && kStages == 2 && kQElems <= kStageElems;
  static constexpr int kSmemElems =
      kQAliased ? kStages * kStageElems : kStages * kStageElems + kQElems;
  // +256: the kernel rounds its base up to 256 bytes, which the XOR address
  // stepping (chunk_pair_step) relies on.
  static constexpr int kSmemBytes = kSmemElems * 2 + 256;

  static_assert(kD == 64 || kD == 128 || kD == 256, "head dim");
  static_assert(kBlockN % 16 == 0, "kBlockN");
  static_assert(kStages >= 1 && kStages <= 4, "stages");
  static_assert((kBlockN * kChunks) % kThreads == 0, "K/V tile copy must split evenly");
  static_assert((kBlockM * kChunks) % kThreads == 0, "Q tile copy must split evenly");
};

// The configuration `Base` with FP8 (e4m3) K/V tiles: kStages stages of a K
// and a V byte tile, then the 16-bit Q tile (never aliased with a stage).
// Q must live in registers: its fragments are read once, in K's permuted order.
template <class Base>
struct Fp8KV : Base {
  static constexpr bool kKV8 = true;
  static constexpr int kTileBytes8 = Base::kBlockN * Base::kD;
  static constexpr int kStageBytes8 = 2 * kTileBytes8;
  static constexpr bool kQAliased = false;
  static constexpr int kSmemBytes = Base::kStages * kStageBytes8 + Base::kQElems * 2 + 256;
  static_assert(Base::kQInRegs && Base::kStages >= 2, "FP8 K/V: Q in registers, a pipelined ring");
  static_assert(Base::kD == 64 || Base::kD == 128, "FP8 K/V: head dim 64 or 128");
  static_assert(Base::kBlockN * (Base::kD / 16) % Base::kThreads == 0, "FP8 tile copy must split evenly");
};

// Bytes of one pipeline stage (a K and a V tile).
template <class Cfg>
__host__ __device__ constexpr uint32_t kv_stage_bytes() {
  if constexpr (Cfg::kKV8) {
    return Cfg::kStageBytes8;
  } else {
    return Cfg::kStageElems * 2;
  }
}

// Paged FP8 K/V tile gatherer: rows of kD / 16 chunks of e4m3 bytes.
template <class Cfg, int kRows>
using PagedKV8Loader = PagedTileLoader<Cfg::kThreads, Cfg::kD / 16, kRows, uint8_t>;

// Element offset of (row, 16-byte chunk) in a [rows][kD] shared tile.
template <class Cfg>
__device__ __forceinline__ int smem_off(int row, int chunk) {
  if constexpr (Cfg::kSwizzle) {
    return row * Cfg::kD + ((chunk ^ (row & 7)) << 3);
  } else {
    return row * Cfg::kD + (chunk << 3);
  }
}

// Copies rows [row0, row0 + kRows) of a global [rows][kD] matrix (row stride in
// elements) into a shared tile; rows at or past `num_rows` are zero-filled.
// Each thread keeps one 16-byte column chunk and walks rows kThreads/kChunks
// apart; that step is a multiple of 8, so the swizzle is the same every step.
template <class Cfg, int kRows>
__device__ __forceinline__ void load_tile_async(uint32_t smem_tile, const typename Cfg::T* gmem,
                                                int64_t row_stride, int row0, int num_rows,
                                                int tid) {
  constexpr int kIters = kRows * Cfg::kChunks / Cfg::kThreads;
  constexpr int kRowStep = Cfg::kThreads / Cfg::kChunks;
  static_assert(Cfg::kThreads % Cfg::kChunks == 0, "copy layout");
  const int r = tid / Cfg::kChunks;
  const int c = tid % Cfg::kChunks;
  const uint32_t dst = smem_tile + smem_off<Cfg>(r, c) * 2;
  const typename Cfg::T* src = gmem + int64_t(row0 + r) * row_stride + c * 8;
  const int64_t src_step = int64_t(kRowStep) * row_stride;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const bool in_range = row0 + r + it * kRowStep < num_rows;
    // With a row step that is a multiple of 8 the swizzle repeats every step.
    const uint32_t d = kRowStep % 8 == 0 ? dst + it * kRowStep * Cfg::kD * 2
                                         : smem_tile + smem_off<Cfg>(r + it * kRowStep, c) * 2;
    cp_async_16(d, in_range ? src + it * src_step : gmem, in_range);
  }
}

// ldmatrix addresses: for a fixed row set, stepping the logical 16-byte chunk
// pair index kk (chunks 2kk, 2kk+1) only flips address bits 5..7 under the XOR
// swizzle (rows are >= 128-byte aligned), so one base per operand suffices.
template <class Cfg>
__device__ __forceinline__ uint32_t chunk_pair_step(uint32_t base, int kk) {
  if constexpr (Cfg::kSwizzle) {
    return base ^ uint32_t(kk << 5);
  } else {
    return base + uint32_t(kk << 5);
  }
}

// Q rows [0, num_rows) of a block whose row r lives at gmem + row_off(r);
// rows at or past num_rows are zero-filled.
template <class Cfg, int kRows, class RowOff>
__device__ __forceinline__ void load_rows_async(uint32_t smem_tile, const typename Cfg::T* gmem, int num_rows,
                                                int tid, RowOff row_off) {
  constexpr int kIters = kRows * Cfg::kChunks / Cfg::kThreads;
  constexpr int kRowStep = Cfg::kThreads / Cfg::kChunks;
  const int r = tid / Cfg::kChunks;
  const int c = tid % Cfg::kChunks;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int row = r + it * kRowStep;
    const bool in_range = row < num_rows;
    cp_async_16(smem_tile + smem_off<Cfg>(row, c) * 2, in_range ? gmem + row_off(row) + c * 8 : gmem, in_range);
  }
}

template <class Cfg, bool kCausal, bool kPaged = false, bool kPack = false>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    prefill_fast_kernel(const PrefillParams p) {
  using T = typename Cfg::T;
  constexpr int kD = Cfg::kD;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kMT = Cfg::kMTiles;
  constexpr int kNT = kBlockN / 8;  // n-tiles of S per warp
  constexpr int kDT = kD / 8;       // n-tiles of O per warp
  constexpr bool kKV8 = Cfg::kKV8;
  using MT = std::conditional_t<kKV8, __half, T>;  // MMA operands: f16 over FP8 tiles (ptx/fp8.cuh)
  static_assert(!kKV8 || (kPaged && kCausal), "FP8 K/V: paged only, causal as a runtime flag");

  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t raw_u32 = smem_u32(smem_raw);
  T* smem = reinterpret_cast<T*>(smem_raw + (((raw_u32 + 255u) & ~255u) - raw_u32));
  T* s_q;
  if constexpr (kKV8) {
    s_q = reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(smem) + Cfg::kStages * Cfg::kStageBytes8);
  } else {
    s_q = Cfg::kQAliased ? smem + Cfg::kStageElems : smem + Cfg::kStages * Cfg::kStageElems;
  }

  int head = blockIdx.x;
  const int batch = blockIdx.y;
  // A splitting packed launch (PrefillParams::pack_splits; its launcher leaves 1 in p when it
  // does not split): blockIdx.z = m-block slot * splits + split.
  int splits = 1, split = 0;
  if constexpr (kPack) {
    if (p.pack_splits > 1) splits = p.pack_splits, split = blockIdx.z % splits;
  }
  // Reverse order: under causal masking the last query blocks carry the most
  // keys, so they are dispatched first and the short ones fill the tail.
  const int m_block = gridDim.z / splits - 1 - blockIdx.z / splits;
  const int m_start = m_block * kBlockM;

  const SeqInfo seq = seq_info<kPaged, MinSeqlenQ<Cfg>::value>(p, batch);
  const int q_begin = seq.q_begin, k_begin = seq.k_begin;
  const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
  const int group = p.num_q_heads / p.num_kv_heads;
  // Rows of the sequence in this kernel's row space (packed: query rows x group).
  const int total_rows = kPack ? seqlen_q * group : seqlen_q;
  if (m_start >= total_rows) return;

  // Packed: blockIdx.x is the KV head, `head` the group's first query head.
  const int kv_head = kPack ? blockIdx.x : head / group;
  if constexpr (kPack) head = kv_head * group;
  // Query row of (packed) row r, and the offsets of row r from the row-0 pointers.
  auto qrow = [&](int r) { return kPack ? r / group : r; };
  auto q_off = [&](int r) -> int64_t {
    return kPack ? int64_t(r / group) * p.q_row_stride + (r % group) * p.q_head_stride : int64_t(r) * p.q_row_stride;
  };
  auto o_off = [&](int r) -> int64_t {
    return kPack ? int64_t(r / group) * p.o_row_stride + (r % group) * p.o_head_stride : int64_t(r) * p.o_row_stride;
  };
  const HeadPointers<T> ptrs = head_pointers<T>(p, batch, head, kv_head, q_begin, k_begin);
  const T* q_ptr = ptrs.q;
  const T* k_ptr = ptrs.k;
  const T* v_ptr = ptrs.v;
  T* o_ptr = ptrs.o;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int warp_row0 = warp * Cfg::kWarpRows;  // first row of this warp inside the block
  const int m_rows = min(kBlockM, total_rows - m_start);

  // Row i sees key j iff j <= i + diag (bottom-right aligned causal mask).
  // FP8 kernels are compiled causal only; not causal, every key of a row is
  // visible, which a diagonal past the last key gives.
  const int diag = (kKV8 && !p.causal) ? (1 << 30) : seqlen_k - seqlen_q;
  int n_end = seqlen_k;
  if (kCausal) n_end = min(n_end, qrow(m_start + m_rows - 1) + 1 + diag);
  // Keys [k_lo, k_hi) are this CTA's: all it may see, or its split's share of them. A split
  // leaves its rows' normalised partial O and log2-sum-exp (-inf where a row saw no key)
  // for the merge kernel, which alone writes o and lse.
  int k_lo = 0, k_hi = n_end;
  auto partial_row = [&](int r) {
    return ((int64_t(batch) * p.num_kv_heads + kv_head) * p.pack_rows + m_start + r) * splits + split;
  };
  if constexpr (kPack) {
    if (splits > 1) {
      k_lo = split * p.pack_split_keys;
      k_hi = min(n_end, k_lo + p.pack_split_keys);
      if (k_hi <= k_lo) {
        // The merge reads no partial O of a split whose log2-sum-exp is -inf.
        for (int r = tid; r < m_rows; r += Cfg::kThreads) p.pack_partial_lse[partial_row(r)] = -INFINITY;
        return;
      }
    }
  }
  if (n_end <= 0) {
    // No row of this block sees any key: exact zeros.
    for (int idx = tid; idx < m_rows * Cfg::kChunks; idx += Cfg::kThreads) {
      const int r = idx / Cfg::kChunks, c = idx % Cfg::kChunks;
      *reinterpret_cast<uint4*>(o_ptr + o_off(m_start + r) + c * 8) = make_uint4(0, 0, 0, 0);
    }
    if constexpr (kPack) {
      if (p.lse != nullptr)
        for (int r = tid; r < m_rows; r += Cfg::kThreads)
          p.lse[batch * p.lse_batch_stride + int64_t(q_begin + qrow(m_start + r)) * p.lse_row_stride +
                (head + (m_start + r) % group) * p.lse_head_stride] = -INFINITY;
    } else {
      write_empty_lse(p, batch, head, q_begin + m_start, m_rows, tid, Cfg::kThreads);
    }
    return;
  }
  const int n_tiles = (k_hi - k_lo + kBlockN - 1) / kBlockN;

  constexpr uint32_t kRowBytes = kD * 2;
  constexpr uint32_t kStageBytes = kv_stage_bytes<Cfg>();
  const uint32_t smem_base = smem_u32(smem);
  const uint32_t s_q_u32 = smem_u32(s_q);
  std::conditional_t<kPaged, std::conditional_t<kKV8, PagedKV8Loader<Cfg, kBlockN>, PagedKVLoader<Cfg, kBlockN>>,
                     NoLoader>
      pager;
  const int32_t* table = kPaged ? p.block_tables + batch * p.block_table_stride : nullptr;
  if constexpr (kPaged) pager.fetch(p, table, k_lo + (n_tiles - 1) * kBlockN, seqlen_k, tid);
  auto load_kv = [&](int t, int stage) {
    const int n0 = k_lo + (n_tiles - 1 - t) * kBlockN;
    const uint32_t k_dst = smem_base + stage * kStageBytes;
    if constexpr (kKV8) {
      pager.issue(k_dst, k_dst + Cfg::kTileBytes8, static_cast<const uint8_t*>(p.k) + kv_head * p.k_head_stride,
                  static_cast<const uint8_t*>(p.v) + kv_head * p.v_head_stride, p, n0, seqlen_k, tid,
                  [](int row, int chunk) { return fp8_tile_k_off<Cfg::kD>(row, chunk); },
                  [](int row, int chunk) { return fp8_tile_v_off<Cfg::kD>(row, chunk); });
      if (t + 1 < n_tiles) pager.fetch(p, table, n0 - kBlockN, seqlen_k, tid);
    } else if constexpr (kPaged) {
      auto off = [](int row, int chunk) { return uint32_t(smem_off<Cfg>(row, chunk) * 2); };
      pager.issue(k_dst, k_dst + Cfg::kTileElems * 2, k_ptr, v_ptr, p, n0, seqlen_k, tid, off, off);
      if (t + 1 < n_tiles) pager.fetch(p, table, n0 - kBlockN, seqlen_k, tid);
    } else {
      load_tile_async<Cfg, kBlockN>(k_dst, k_ptr, p.k_row_stride, n0, seqlen_k, tid);
      load_tile_async<Cfg, kBlockN>(k_dst + Cfg::kTileElems * 2, v_ptr, p.v_row_stride, n0,
                                    seqlen_k, tid);
    }
  };

  // Prologue: Q (group 0), then K/V tiles 0 .. kStages-2 (one group each).
  if constexpr (kPack) {
    load_rows_async<Cfg, kBlockM>(s_q_u32, q_ptr, m_rows, tid, [&](int r) { return q_off(m_start + r); });
  } else {
    load_tile_async<Cfg, kBlockM>(s_q_u32, q_ptr + int64_t(m_start) * p.q_row_stride,
                                  p.q_row_stride, 0, m_rows, tid);
  }
  cp_async_commit();
  load_kv(0, 0);
  cp_async_commit();
#pragma unroll
  for (int st = 1; st + 1 < Cfg::kStages; ++st) {
    if (st < n_tiles) load_kv(st, st);
    cp_async_commit();
  }

  // ldmatrix.x4: lane l supplies the address of row (l & 7) of 8x8 matrix l / 8.
  const int lm_row8 = lane & 7;
  const int lm_bit3 = (lane >> 3) & 1;
  const int lm_bit4 = lane >> 4;
  // Q (A operand): matrices = rows 0-7 / 8-15 x chunk 2kk / 2kk+1.
  const uint32_t q_lm = s_q_u32 + smem_off<Cfg>(warp_row0 + lm_row8 + lm_bit3 * 8, lm_bit4) * 2;
  // K (B operand of QK^T, non-transposed): keys 0-7 / 8-15 x chunk 2kk / 2kk+1.
  const uint32_t k_lm = smem_base + smem_off<Cfg>(lm_row8 + lm_bit4 * 8, lm_bit3) * 2;
  // V (B operand of PV, transposed): keys 0-7 / 8-15 x chunk 2dp / 2dp+1.
  const uint32_t v_lm =
      smem_base + Cfg::kTileElems * 2 + smem_off<Cfg>(lm_row8 + lm_bit3 * 8, lm_bit4) * 2;

  uint32_t q_frag[Cfg::kQInRegs ? kMT : 1][Cfg::kQInRegs ? kD / 16 : 1][4];
  int q_exp = 0;  // FP8 with a bf16 q: the warp's Q fragments hold q * 2^q_exp, in f16
  if constexpr (Cfg::kQInRegs) {
    cp_async_wait<(Cfg::kStages > 1 ? Cfg::kStages - 1 : 1)>();  // Q only
    __syncthreads();
    if constexpr (kKV8) {
      const auto q_tile_off = [](int row, int chunk) { return uint32_t(smem_off<Cfg>(row, chunk) * 2); };
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk)
          fp8_q_frag(s_q_u32, warp_row0 + mt * 16 + (lane >> 2), kk, lane & 3, q_tile_off, q_frag[mt][kk]);
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        // f16 MMAs over the e4m3 tiles (ptx/fp8.cuh): one power of two for the
        // warp's rows, so that it folds into the score scale.
        float amax = 0.f;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int kk = 0; kk < kD / 16; ++kk)
#pragma unroll
            for (int w = 0; w < 4; ++w) amax = fmaxf(amax, bf16x2_abs_max(q_frag[mt][kk][w]));
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        q_exp = f16_exponent(amax);
        const float q_scale = exp2i(q_exp);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int kk = 0; kk < kD / 16; ++kk)
#pragma unroll
            for (int w = 0; w < 4; ++w) q_frag[mt][kk][w] = bf16x2_to_f16x2(q_frag[mt][kk][w], q_scale);
      }
    } else {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk)
          ldmatrix_x4(q_frag[mt][kk], chunk_pair_step<Cfg>(q_lm + mt * 16 * kRowBytes, kk));
    }
    // Stage 1 (where Q may live) is refilled only after the first loop barrier.
  }

  float acc_o[kMT][kDT][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.f;

  // Scores are kept raw; the running max is tracked in raw units and scaled
  // once per row (the launchers admit only a positive scale).
  float scale_log2 = p.scale * 1.4426950408889634f;
  if constexpr (kKV8) scale_log2 *= p.k_scale[kv_head] * exp2i(-q_exp);
  FragSoftmax<kMT> sm;
  sm.init();
  auto o_frag = [&](int mt, int dt, int e) -> float& { return acc_o[mt][dt][e]; };

  const int g = lane >> 2;        // fragment row (and row + 8)
  const int tq = (lane & 3) * 2;  // fragment column pair

  auto tile_step = [&](int t, auto mask_tag) {
    constexpr bool kMask = decltype(mask_tag)::value;
    // One barrier per tile: once tile t has landed (only the kStages-2 newer
    // copies may still be in flight) and every warp has finished tile t-1,
    // the stage tile t-1 used is refilled with tile t+kStages-1.
    const int stage = t % Cfg::kStages;
    if constexpr (Cfg::kStages >= 2) {
      cp_async_wait<Cfg::kStages - 2>();
      __syncthreads();
      const int t_load = t + Cfg::kStages - 1;
      if (t_load < n_tiles) load_kv(t_load, t_load % Cfg::kStages);
      cp_async_commit();
    } else {
      cp_async_wait<0>();
      __syncthreads();
    }
    const uint32_t k_stage = k_lm + stage * kStageBytes;
    const uint32_t v_stage = v_lm + stage * kStageBytes;
    const int n0 = k_lo + (n_tiles - 1 - t) * kBlockN;

    // ---- S = Q K^T ----
    float acc_s[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[mt][nt][e] = 0.f;
    if constexpr (kKV8) {
      const uint32_t kt = smem_base + stage * kStageBytes;
#pragma unroll
      for (int blk = 0; blk < kD / 64; ++blk) {
#pragma unroll
        for (int np = 0; np < kBlockN / 16; ++np) {
          uint4 kw[2];  // keys 16 np + g and 16 np + 8 + g
#pragma unroll
          for (int h = 0; h < 2; ++h) kw[h] = lds128(kt + fp8_tile_k_off<kD>(np * 16 + h * 8 + g, blk * 4 + (lane & 3)));
#pragma unroll
          for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              uint32_t b0, b1;
              fp8_k_frag(kw[h], j, b0, b1);
#pragma unroll
              for (int mt = 0; mt < kMT; ++mt) mma_16816<MT>(acc_s[mt][2 * np + h], q_frag[mt][blk * 4 + j], b0, b1);
            }
          }
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          if constexpr (Cfg::kQInRegs) {
#pragma unroll
            for (int e = 0; e < 4; ++e) a[mt][e] = q_frag[mt][kk][e];
          } else {
            ldmatrix_x4(a[mt], chunk_pair_step<Cfg>(q_lm + mt * 16 * kRowBytes, kk));
          }
        }
#pragma unroll
        for (int np = 0; np < kBlockN / 16; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, chunk_pair_step<Cfg>(k_stage + np * 16 * kRowBytes, kk));
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            mma_16816<T>(acc_s[mt][2 * np], a[mt], b[0], b[1]);
            mma_16816<T>(acc_s[mt][2 * np + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }

    auto s_frag = [&](int mt, int nt, int e) -> float& { return acc_s[mt][nt][e]; };
    // ---- mask (diagonal / tail tiles only) ----
    if constexpr (kMask)
      mask_tile<kMT, kNT, kCausal>(s_frag, m_start + warp_row0, n0, seqlen_k, diag, g, tq, qrow);

    // ---- online softmax on the fragments ----
    float tile_max[kMT][2];
    sm.template tile_max<kNT>(s_frag, tile_max);
    // Move the reference maximum (and rescale O) only when needed (always, without kLazyRescale).
    bool rescale = true;
    if constexpr (Cfg::kLazyRescale) rescale = sm.need_rescale(tile_max, scale_log2);
    if (rescale) sm.template rescale<kDT>(tile_max, scale_log2, o_frag);
    sm.template exp_and_sum<kNT>(s_frag, scale_log2);

    // ---- O += P V ----
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) pack_p<MT>(s_frag, mt, kk, a[mt]);
      if constexpr (kKV8) {
        uint32_t vw[4][kD / 32];
        fp8_load_v_rows<kD>(smem_base + stage * kStageBytes + Cfg::kTileBytes8, kk * 16, g, lane & 3, vw);
        fp8_pv<kD>(vw, [&](int dt, uint32_t b0, uint32_t b1) {
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) mma_16816<MT>(acc_o[mt][dt], a[mt], b0, b1);
        });
      } else {
#pragma unroll
        for (int dp = 0; dp < kD / 16; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, chunk_pair_step<Cfg>(v_stage + kk * 16 * kRowBytes, dp));
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            mma_16816<T>(acc_o[mt][2 * dp], a[mt], b[0], b[1]);
            mma_16816<T>(acc_o[mt][2 * dp + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }

    if constexpr (Cfg::kStages == 1) {
      // Single buffer: everyone must be done with it before it is refilled.
      __syncthreads();
      if (t + 1 < n_tiles) load_kv(t + 1, 0);
      cp_async_commit();
    }
  };

  // A tile needs no mask when every key in it exists and, under causal, is
  // visible to the first row of the block (hence to all of its rows).
  int t = 0;
  for (; t < n_tiles; ++t) {
    const int n0 = k_lo + (n_tiles - 1 - t) * kBlockN;
    const bool full = n0 + kBlockN <= seqlen_k && (!kCausal || n0 + kBlockN - 1 <= qrow(m_start) + diag);
    if (full) break;
    tile_step(t, MaskOn{});
  }
  for (; t < n_tiles; ++t) tile_step(t, MaskOff{});
  cp_async_wait<0>();  // drain the trailing (empty) group

  if constexpr (kPack) {
    if (splits > 1) {
      // fp32 partials straight from the fragments: O / l (FP8: times v_scale, O's columns in
      // fp8_o_dim's order), and the row's log2-sum-exp in the scaled scores' units.
      const float v_scale = kKV8 ? p.v_scale[kv_head] : 1.f;
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float l = sm.row_total(mt, h);
          const int r = warp_row0 + mt * 16 + g + h * 8;
          if (r >= m_rows) continue;
          const int64_t prow = partial_row(r);
          const float inv = l > 0.f ? v_scale / l : 0.f;
          float* po = p.pack_partial_o + prow * kD;
#pragma unroll
          for (int dt = 0; dt < kDT; ++dt) {
            const float o0 = acc_o[mt][dt][2 * h] * inv, o1 = acc_o[mt][dt][2 * h + 1] * inv;
            if constexpr (kKV8) {
              po[fp8_o_dim<kD>(dt, tq)] = o0;
              po[fp8_o_dim<kD>(dt, tq + 1)] = o1;
            } else {
              *reinterpret_cast<float2*>(po + dt * 8 + tq) = make_float2(o0, o1);
            }
          }
          if ((lane & 3) == 0)
            p.pack_partial_lse[prow] = l > 0.f ? sm.row_ref(mt, h, scale_log2) + log2f(l) : -INFINITY;
        }
      return;
    }
  }

  // ---- epilogue: O / l, staged through shared memory for 16-byte stores ----
  // The warp writes only its own rows of the Q area. When that area is stage
  // 1, other warps may still be reading it for the last tile.
  if constexpr (Cfg::kQAliased) __syncthreads();
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float l = sm.row_total(mt, h);
      const float inv = l > 0.f ? 1.f / l : 0.f;  // no visible key -> exact zeros
      const int r = warp_row0 + mt * 16 + g + h * 8;
      if (p.lse != nullptr && (lane & 3) == 0 && r < m_rows) {
        const float ref = sm.row_ref(mt, h, scale_log2);
        const int pr = m_start + r;
        p.lse[batch * p.lse_batch_stride + (kPack ? head + pr % group : head) * p.lse_head_stride +
              int64_t(q_begin + qrow(pr)) * p.lse_row_stride] = row_lse(ref, l);
      }
      if constexpr (kKV8) {
        // O's columns are dims in the permuted order of fp8_o_dim; V was used as stored.
        pack_o_row<T, kDT>(o_frag, mt, h, inv * p.v_scale[kv_head], [&](int dt, uint32_t pair) {
          const int d0 = fp8_o_dim<kD>(dt, tq), d1 = fp8_o_dim<kD>(dt, tq + 1);
          reinterpret_cast<uint16_t*>(s_q + smem_off<Cfg>(r, d0 >> 3))[d0 & 7] = uint16_t(pair & 0xffffu);
          reinterpret_cast<uint16_t*>(s_q + smem_off<Cfg>(r, d1 >> 3))[d1 & 7] = uint16_t(pair >> 16);
        });
      } else {
        pack_o_row<T, kDT>(o_frag, mt, h, inv, [&](int dt, uint32_t pair) {
          *reinterpret_cast<uint32_t*>(s_q + smem_off<Cfg>(r, dt) + tq) = pair;
        });
      }
    }
  __syncwarp();
#pragma unroll
  for (int it = 0; it < Cfg::kWarpRows * Cfg::kChunks / 32; ++it) {
    const int idx = lane + it * 32;
    const int r = idx / Cfg::kChunks, c = idx % Cfg::kChunks;
    const int row = warp_row0 + r;
    if (row < m_rows) {
      *reinterpret_cast<uint4*>(o_ptr + o_off(m_start + row) + c * 8) =
          *reinterpret_cast<const uint4*>(s_q + smem_off<Cfg>(row, c));
    }
  }
}

// Merges the KV splits of a packed launch (PrefillParams::pack_splits) into o and lse: one
// CTA per packed row of the split kernel's grid (x: row in the sequence's packed row space,
// y: sequence, z: KV head), which skips the same sequences. The row's splits are read in
// parallel: thread (chain, col) sums splits chain, chain + kChains, ... of one float4 column,
// so a row of S splits takes S / kChains dependent loads per thread, not S. Fixed order
// throughout (the result does not depend on which split finished first):
// w_s = 2^(lse_s - max_s lse_s), o = sum_s w_s o_s / sum_s w_s; a row that no split saw a key
// of gets exact zeros and lse -inf.
constexpr int kPackMergeThreads = 256;
constexpr int kPackMaxSplits = kPackMergeThreads;  // one split's weight per thread
template <class Cfg>
__global__ void __launch_bounds__(kPackMergeThreads) pack_split_merge_kernel(const PrefillParams p) {
  using T = typename Cfg::T;
  constexpr int kLanes = Cfg::kD / 4;                   // float4 columns of a row
  constexpr int kChains = kPackMergeThreads / kLanes;   // splits read at once per column
  constexpr int kWarps = kPackMergeThreads / 32;
  __shared__ float sm_w[kPackMaxSplits];
  __shared__ float sm_warp[kWarps];
  __shared__ float4 sm_acc[kChains][kLanes];
  const int pr = blockIdx.x, batch = blockIdx.y, kv_head = blockIdx.z;
  const SeqInfo seq = seq_info<true, MinSeqlenQ<Cfg>::value>(p, batch);
  const int group = p.num_q_heads / p.num_kv_heads;
  if (pr >= seq.seqlen_q * group) return;
  const int S = p.pack_splits;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t row0 = ((int64_t(batch) * p.num_kv_heads + kv_head) * p.pack_rows + pr) * S;

  // The row's max log2-sum-exp, then each split's weight and their sum.
  const float x = tid < S ? p.pack_partial_lse[row0 + tid] : -INFINITY;
  const float mx = block_max<kWarps>(x, sm_warp);
  const float w = x == -INFINITY ? 0.f : exp2f(x - mx);
  sm_w[tid] = w;
  float sum = w;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  __syncthreads();  // sm_w is complete and every thread has read the max from sm_warp
  if (lane == 0) sm_warp[warp] = sum;

  const int chain = tid / kLanes, col = tid % kLanes;
  const float4* po = reinterpret_cast<const float4*>(p.pack_partial_o + row0 * Cfg::kD) + col;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int s = chain; s < S; s += kChains) {
    const float ws = sm_w[s];
    if (ws > 0.f) {  // an empty split's O was never written
      const float4 v = po[int64_t(s) * kLanes];
      acc.x = fmaf(ws, v.x, acc.x), acc.y = fmaf(ws, v.y, acc.y);
      acc.z = fmaf(ws, v.z, acc.z), acc.w = fmaf(ws, v.w, acc.w);
    }
  }
  sm_acc[chain][col] = acc;
  __syncthreads();
  if (chain != 0) return;
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kWarps; ++i) total += sm_warp[i];
#pragma unroll
  for (int c = 1; c < kChains; ++c) {
    const float4 v = sm_acc[c][col];
    acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w;
  }
  const float inv = total > 0.f ? 1.f / total : 0.f;
  const int q_row = seq.q_begin + pr / group, head = kv_head * group + pr % group;
  T* o = static_cast<T*>(p.o) + int64_t(q_row) * p.o_row_stride + head * p.o_head_stride + col * 4;
  *reinterpret_cast<uint2*>(o) = make_uint2(pack2<T>(acc.x * inv, acc.y * inv), pack2<T>(acc.z * inv, acc.w * inv));
  if (col == 0 && p.lse != nullptr)
    p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + int64_t(q_row) * p.lse_row_stride] =
        total > 0.f ? (mx + log2f(total)) * 0.6931471805599453f : -INFINITY;
}

template <class Cfg, bool kCausal, bool kPaged = false, bool kPack = false>
cudaError_t launch_prefill_cfg(const PrefillParams& params, cudaStream_t stream) {
  PrefillParams p = params;
  const int64_t rows = int64_t(p.max_seqlen_q) * (kPack ? p.num_q_heads / p.num_kv_heads : 1);
  const int64_t m_blocks = (rows + Cfg::kBlockM - 1) / Cfg::kBlockM;
  if (m_blocks == 0 || p.batch == 0 || p.num_q_heads == 0) return cudaSuccess;
  if (m_blocks > 65535 || p.batch > 65535) return cudaErrorInvalidConfiguration;
  // KV splits: only where the caller's workspace holds this grid's rows.
  int splits = 1;
  if constexpr (kPack) {
    if (p.pack_splits > 1 && p.pack_partial_o != nullptr && p.pack_partial_lse != nullptr &&
        p.pack_splits <= kPackMaxSplits && p.pack_split_keys > 0 && p.pack_split_keys % Cfg::kBlockN == 0 &&
        m_blocks * Cfg::kBlockM <= p.pack_rows && m_blocks * p.pack_splits <= 65535 && p.num_kv_heads <= 65535)
      splits = p.pack_splits;
  }
  p.pack_splits = splits;
  auto kernel = prefill_fast_kernel<Cfg, kCausal, kPaged, kPack>;
  constexpr int kSmem = Cfg::kSmemBytes;
  if (kSmem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(kPack ? p.num_kv_heads : p.num_q_heads, p.batch, unsigned(m_blocks * splits));
  kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(p);
  if constexpr (kPack) {
    if (splits > 1) {
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
      const dim3 merge_grid(unsigned(m_blocks * Cfg::kBlockM), p.batch, p.num_kv_heads);
      pack_split_merge_kernel<Cfg><<<merge_grid, kPackMergeThreads, 0, stream>>>(p);
    }
  }
  return cudaGetLastError();
}

}  // namespace fast
}  // namespace minipaged
