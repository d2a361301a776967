// sm_90a variant of the fast prefill: the two GEMMs of every K/V tile run as
// warpgroup MMAs (wgmma) that read their shared-memory operands once per
// warpgroup (64 rows) instead of once per warp, which removes the
// shared-memory bandwidth limit of the mma.sync kernel (prefill/mainloop_mma.cuh).
//
//   S[64 x 64]  = Q K^T : wgmma, A = Q and B = K straight from shared memory
//   softmax             : the wgmma accumulator layout of each warp equals the
//                         mma.sync m16n8 C layout, so masking, online softmax
//                         and epilogue are the mma.sync ones (prefill/softmax.cuh)
//   O[64 x D]  += P V   : wgmma, A = P from registers (16-bit, C->A reuse),
//                         B = V from shared memory as an MN-major operand
//
// Tiles are stored in the canonical 128-byte-swizzle layout: 64-element column
// blocks of [rows][128 B], 16-byte chunk c of row r at chunk (c ^ (r & 7)).
// Loads stay on cp.async issued by the consumer threads (no TMA, no warp
// specialisation): a 2-stage ring, or 3 stages when P V of tile t-1 is left
// running under the softmax of tile t (kPipelined).
#pragma once
#include <cstdint>
#include <type_traits>

#include "params.h"
#include "prefill/common.cuh"
#include "prefill/softmax.cuh"
#include "ptx/cp_async.cuh"
#include "ptx/ldmatrix.cuh"
#include "ptx/wgmma.cuh"

namespace minipaged {
namespace fast {

template <typename T_, int kD_, int kWarpGroups_, int kMinBlocks_ = 1, bool kPipelined_ = false,
          int kBlockN_ = 64>
struct WgmmaCfg {
  using T = T_;
  static constexpr int kMinBlocks = kMinBlocks_;  // __launch_bounds__ occupancy hint
  // Pipelined: the P V wgmma of tile t-1 runs while tile t's softmax executes
  // (issue order QK_t, PV_{t-1}; wait for QK_t only). Needs a third K/V stage,
  // because V_{t-1} is still being read while tile t+1 streams in.
  static constexpr bool kPipelined = kPipelined_;
  static constexpr int kStages = kPipelined ? 3 : 2;
  static constexpr int kD = kD_;
  static constexpr int kBlockN = kBlockN_;  // 64 or 128 keys per tile (S: 32 or 64 registers)
  static constexpr int kWarpGroups = kWarpGroups_;
  static constexpr int kThreads = 128 * kWarpGroups;
  static constexpr int kBlockM = 64 * kWarpGroups;
  static constexpr int kChunks = kD / 8;
  static constexpr int kColBlocks = kD / 64;
  static constexpr int kTileBytes = kBlockN * kD * 2;
  static constexpr int kStageBytes = 2 * kTileBytes;  // K tile, then V tile
  static constexpr int kQBytes = kBlockM * kD * 2;
  static constexpr int kSmemBytes = kStages * kStageBytes + kQBytes + 1024;  // +1024: atom alignment
  static_assert(kD == 64 || kD == 128, "head dim");
  static_assert(kBlockN == 64 || kBlockN == 128, "key tile");
  static_assert(kThreads % kChunks == 0 && (kThreads / kChunks) % 8 == 0, "copy layout");
};

// Byte offset of (row, 16-byte chunk) in a [kRows][kD] tile, 128-byte-swizzle canonical layout.
template <int kRows>
__device__ __forceinline__ uint32_t sw128_off(int row, int chunk) {
  return uint32_t((chunk >> 3) * (kRows * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

template <class Cfg, int kRows>
__device__ __forceinline__ void load_tile_sw128(uint32_t smem_tile, const typename Cfg::T* gmem,
                                                int64_t row_stride, int row0, int num_rows,
                                                int tid) {
  constexpr int kIters = kRows * Cfg::kChunks / Cfg::kThreads;
  constexpr int kRowStep = Cfg::kThreads / Cfg::kChunks;
  static_assert(kRows * Cfg::kChunks % Cfg::kThreads == 0, "copy layout");
  const int r = tid / Cfg::kChunks;
  const int c = tid % Cfg::kChunks;
  const uint32_t dst = smem_tile + sw128_off<kRows>(r, c);
  const typename Cfg::T* src = gmem + int64_t(row0 + r) * row_stride + c * 8;
  const int64_t src_step = int64_t(kRowStep) * row_stride;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const bool in_range = row0 + r + it * kRowStep < num_rows;
    cp_async_16(dst + it * kRowStep * 128, in_range ? src + it * src_step : gmem, in_range);
  }
}

template <class Cfg, bool kCausal, bool kPaged = false>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks) prefill_wgmma_kernel(const PrefillParams p) {
#if MINIPAGED_WGMMA_DEVICE
  using T = typename Cfg::T;
  constexpr int kD = Cfg::kD;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kNT = kBlockN / 8;
  constexpr int kCB = Cfg::kColBlocks;

  extern __shared__ __align__(128) unsigned char smem_raw[];  // realigned to 1024 below
  const uint32_t raw_u32 = smem_u32(smem_raw);
  const uint32_t smem_base = (raw_u32 + 1023u) & ~1023u;
  unsigned char* smem_ptr = smem_raw + (smem_base - raw_u32);
  const uint32_t s_q = smem_base + Cfg::kStages * Cfg::kStageBytes;
  T* s_q_ptr = reinterpret_cast<T*>(smem_ptr + Cfg::kStages * Cfg::kStageBytes);

  const int head = blockIdx.x;
  const int batch = blockIdx.y;
  const int m_block = gridDim.z - 1 - blockIdx.z;  // heaviest causal blocks first
  const int m_start = m_block * kBlockM;

  const SeqInfo seq = seq_info<kPaged>(p, batch);
  const int q_begin = seq.q_begin, k_begin = seq.k_begin;
  const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
  if (m_start >= seqlen_q) return;

  const int kv_head = head / (p.num_q_heads / p.num_kv_heads);
  const HeadPointers<T> ptrs = head_pointers<T>(p, batch, head, kv_head, q_begin, k_begin);
  const T* q_ptr = ptrs.q;
  const T* k_ptr = ptrs.k;
  const T* v_ptr = ptrs.v;
  T* o_ptr = ptrs.o;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int warp_group = warp / 4;
  // Warp w of warpgroup g owns rows 64g + 16w' .. +15 of the block, i.e. 16 * warp.
  const int warp_row0 = warp * 16;
  const int m_rows = min(kBlockM, seqlen_q - m_start);

  const int diag = seqlen_k - seqlen_q;
  int n_end = seqlen_k;
  if (kCausal) n_end = min(n_end, m_start + m_rows + diag);
  if (n_end <= 0) {
    for (int idx = tid; idx < m_rows * Cfg::kChunks; idx += Cfg::kThreads) {
      const int r = idx / Cfg::kChunks, c = idx % Cfg::kChunks;
      *reinterpret_cast<uint4*>(o_ptr + int64_t(m_start + r) * p.o_row_stride + c * 8) =
          make_uint4(0, 0, 0, 0);
    }
    write_empty_lse(p, batch, head, q_begin + m_start, m_rows, tid, Cfg::kThreads);
    return;
  }
  const int n_tiles = (n_end + kBlockN - 1) / kBlockN;

  std::conditional_t<kPaged, PagedKVLoader<Cfg, kBlockN>, NoLoader> pager;
  const int32_t* table = kPaged ? p.block_tables + batch * p.block_table_stride : nullptr;
  if constexpr (kPaged) pager.fetch(p, table, (n_tiles - 1) * kBlockN, seqlen_k, tid);
  auto load_kv = [&](int t, int stage) {
    const int n0 = (n_tiles - 1 - t) * kBlockN;
    const uint32_t k_dst = smem_base + stage * Cfg::kStageBytes;
    if constexpr (kPaged) {
      auto off = [](int row, int chunk) { return sw128_off<kBlockN>(row, chunk); };
      pager.issue(k_dst, k_dst + Cfg::kTileBytes, k_ptr, v_ptr, p, n0, seqlen_k, tid, off, off);
      if (t + 1 < n_tiles) pager.fetch(p, table, n0 - kBlockN, seqlen_k, tid);
    } else {
      load_tile_sw128<Cfg, kBlockN>(k_dst, k_ptr, p.k_row_stride, n0, seqlen_k, tid);
      load_tile_sw128<Cfg, kBlockN>(k_dst + Cfg::kTileBytes, v_ptr, p.v_row_stride, n0, seqlen_k,
                                    tid);
    }
  };

  load_tile_sw128<Cfg, kBlockM>(s_q, q_ptr + int64_t(m_start) * p.q_row_stride, p.q_row_stride, 0,
                                m_rows, tid);
  cp_async_commit();
  load_kv(0, 0);
  cp_async_commit();

  // Descriptors. K-major operands (Q, K): 8-row groups 1024 B apart; a k16 step
  // moves 32 B inside the 128-byte atom, then to the next column block.
  // V (MN-major): 64-wide N blocks kBlockN*128 B apart, 8-key groups 1024 B apart.
  const uint32_t q_wg = s_q + warp_group * 64 * 128;
  auto q_desc = [&](int kk) {
    return wgmma_desc_sw128(q_wg + (kk >> 2) * (kBlockM * 128) + (kk & 3) * 32, 16, 1024);
  };
  auto k_desc = [&](uint32_t k_tile, int kk) {
    return wgmma_desc_sw128(k_tile + (kk >> 2) * (kBlockN * 128) + (kk & 3) * 32, 16, 1024);
  };
  auto v_desc = [&](uint32_t v_tile, int cb, int kk) {
    // N = 64 per instruction spans a single atom column, so only the 8-key group
    // stride matters; it is given in both fields (their roles differ between
    // K-major and MN-major operands).
    return wgmma_desc_sw128(v_tile + cb * (kBlockN * 128) + kk * 16 * 128, 1024, 1024);
  };

  float acc_o[kCB][8][4];
#pragma unroll
  for (int cb = 0; cb < kCB; ++cb)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[cb][j][e] = 0.f;
  // O's n8 tile dt is column block dt / 8 of the accumulators.
  auto o_frag = [&](int, int dt, int e) -> float& { return acc_o[dt >> 3][dt & 7][e]; };
  auto fence_o = [&] {
#pragma unroll
    for (int cb = 0; cb < kCB; ++cb) fence_operand(acc_o[cb]);
  };
  // O += P V for the kBlockN keys of the V tile at v_tile (issue only).
  auto issue_pv = [&](const uint32_t (&pf)[kBlockN / 16][4], uint32_t v_tile) {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
#pragma unroll
      for (int cb = 0; cb < kCB; ++cb)
        wgmma_m64n64k16_rs_tb<T>(acc_o[cb], pf[kk], v_desc(v_tile, cb, kk));
  };

  const float scale_log2 = p.scale * 1.4426950408889634f;  // positive: the launchers check
  FragSoftmax<1> sm;
  sm.init();
  const int g = lane >> 2;
  const int tq = (lane & 3) * 2;
  // Pipelined: P of the previous tile, waiting for its P V wgmma (A operand registers).
  uint32_t p_prev[kBlockN / 16][4] = {};

  auto tile_step = [&](int t, auto mask_tag) {
    constexpr bool kMask = decltype(mask_tag)::value;
    constexpr bool kPipe = Cfg::kPipelined;
    const int stage = kPipe ? t % 3 : t & 1;
    cp_async_wait<0>();
    fence_proxy_async_smem();  // cp.async data -> visible to the async proxy (wgmma)
    __syncthreads();
    // Pipelined: stage (t+1)%3 last held tile t-2, whose P V finished in iteration t-1.
    if (t + 1 < n_tiles) load_kv(t + 1, kPipe ? (t + 1) % 3 : stage ^ 1);
    cp_async_commit();
    const uint32_t k_tile = smem_base + stage * Cfg::kStageBytes;
    const int n0 = (n_tiles - 1 - t) * kBlockN;

    // ---- S = Q K^T (pipelined: then P V of tile t-1 behind it) ----
    float acc_s[kNT / 8][8][4];  // [64-key half][n8 block][fragment]
    auto s_frag = [&](int, int nt, int e) -> float& { return acc_s[nt >> 3][nt & 7][e]; };
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s_frag(0, nt, e) = 0.f;
    fence_operand(acc_s);
    if constexpr (kPipe) {
      fence_operand(p_prev);
      fence_o();
    }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk)
#pragma unroll
      for (int nb = 0; nb < kNT / 8; ++nb)
        wgmma_m64n64k16_ss<T>(acc_s[nb], q_desc(kk), k_desc(k_tile + nb * 64 * 128, kk));
    wgmma_commit();
    if (kPipe && t > 0) {
      issue_pv(p_prev, smem_base + ((t + 2) % 3) * Cfg::kStageBytes + Cfg::kTileBytes);
      wgmma_commit();
      wgmma_wait<1>();  // groups retire in order: S_t is ready, P V of t-1 may still run
    } else {
      wgmma_wait<0>();
    }
    fence_operand(acc_s);

    // ---- mask, online softmax ----
    if constexpr (kMask)
      mask_tile<1, kNT, kCausal>(s_frag, m_start + warp_row0, n0, seqlen_k, diag, g, tq, [](int r) { return r; });
    float tile_max[1][2];
    sm.template tile_max<kNT>(s_frag, tile_max);
    if constexpr (!kPipe) {
      if (sm.need_rescale(tile_max, scale_log2)) sm.template rescale<kCB * 8>(tile_max, scale_log2, o_frag);
      sm.template exp_and_sum<kNT>(s_frag, scale_log2);
      uint32_t p_frag[kBlockN / 16][4];
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) pack_p<T>(s_frag, 0, kk, p_frag[kk]);

      // ---- O += P V ----
      fence_operand(p_frag);
      fence_o();
      wgmma_fence();
      issue_pv(p_frag, k_tile + Cfg::kTileBytes);
      wgmma_commit();
      wgmma_wait<0>();
      fence_o();
    } else {
      // O is still an operand of the running P V: its rescale waits below.
      float alpha[2] = {1.f, 1.f};
      const bool rescale = move_max_lazy(sm, tile_max, scale_log2, alpha);
      sm.template exp_and_sum<kNT>(s_frag, scale_log2);
      // O and the previous P may be touched only after their wgmma retired. The
      // operand fence keeps the exponentials above the wait (ptxas would
      // otherwise sink them below it and lose the overlap with P V).
      fence_operand(acc_s);
      wgmma_wait<0>();
      fence_operand(p_prev);
      fence_o();
      rescale_o_pack_p<T, kCB * 8>(rescale, alpha, o_frag, s_frag, p_prev);
    }
  };

  int t = 0;
  for (; t < n_tiles; ++t) {
    const int n0 = (n_tiles - 1 - t) * kBlockN;
    const bool full = n0 + kBlockN <= seqlen_k && (!kCausal || n0 + kBlockN - 1 <= m_start + diag);
    if (full) break;
    tile_step(t, MaskOn{});
  }
  for (; t < n_tiles; ++t) tile_step(t, MaskOff{});
  if constexpr (Cfg::kPipelined) {
    // P V of the last tile.
    fence_operand(p_prev);
    fence_o();
    wgmma_fence();
    issue_pv(p_prev, smem_base + ((n_tiles - 1) % 3) * Cfg::kStageBytes + Cfg::kTileBytes);
    wgmma_commit();
    wgmma_wait<0>();
    fence_o();
  }
  cp_async_wait<0>();

  // Epilogue: the Q area is reused as a row-major (XOR-swizzled) staging tile;
  // the other warpgroup may still be reading its Q rows, hence the barrier.
  __syncthreads();
  epilogue_rows<T, kCB * 8, true>(sm, o_frag, scale_log2, p, batch, head, q_begin + m_start, warp_row0, m_rows, lane,
                                  [&](int r, int dt, uint32_t pair) {
                                    *reinterpret_cast<uint32_t*>(s_q_ptr + r * kD + ((dt ^ (r & 7)) << 3) + tq) = pair;
                                  });
  __syncwarp();
#pragma unroll
  for (int it = 0; it < 16 * Cfg::kChunks / 32; ++it) {
    const int idx = lane + it * 32;
    const int r = idx / Cfg::kChunks, c = idx % Cfg::kChunks;
    const int row = warp_row0 + r;
    if (row < m_rows) {
      *reinterpret_cast<uint4*>(o_ptr + int64_t(m_start + row) * p.o_row_stride + c * 8) =
          *reinterpret_cast<const uint4*>(s_q_ptr + row * kD + ((c ^ (row & 7)) << 3));
    }
  }
#else
  __trap();  // built without sm_90a: the launcher never selects this kernel
#endif
}

template <class Cfg, bool kCausal, bool kPaged = false>
cudaError_t launch_prefill_wgmma_cfg(const PrefillParams& p, cudaStream_t stream) {
  const int m_blocks = (p.max_seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
  if (m_blocks == 0 || p.batch == 0 || p.num_q_heads == 0) return cudaSuccess;
  if (m_blocks > 65535 || p.batch > 65535) return cudaErrorInvalidConfiguration;
  auto kernel = prefill_wgmma_kernel<Cfg, kCausal, kPaged>;
  constexpr int kSmem = Cfg::kSmemBytes;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  const dim3 grid(p.num_q_heads, p.batch, m_blocks);
  kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace fast
}  // namespace minipaged
