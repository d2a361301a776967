// What the mma.sync and wgmma prefill mainloops share before the math: where
// a sequence lives (dense, varlen, paged) and the paged K/V tile gatherer.
#pragma once
#include <cstdint>
#include <type_traits>

#include "params.h"
#include "ptx/cp_async.cuh"

namespace minipaged {
namespace fast {

// Paged counterpart of load_tile_async for the K and V tiles of one sequence:
// key j is token j % block_size of cache block table[j / block_size]. Rows at
// or past num_rows are zero-filled and never looked up, so table entries past
// ceil(num_rows / block_size) (which may be -1) are not read.
// The page ids of a tile are fetched one tile ahead (fetch() right after the
// previous tile's copies were issued), so the table round trip overlaps a
// whole tile of math instead of stalling the copy. Tiles must be issued in
// order (fetch(t), issue(t), fetch(t+1), issue(t+1), ...), which both kernels do.
// `dst_off(row, chunk)` is the byte offset of a 16-byte chunk in the shared
// tile (the mma.sync and wgmma kernels swizzle differently).
template <class Cfg, int kRows>
struct PagedKVLoader {
  static constexpr int kIters = kRows * Cfg::kChunks / Cfg::kThreads;
  static constexpr int kRowStep = Cfg::kThreads / Cfg::kChunks;
  static_assert(Cfg::kThreads % Cfg::kChunks == 0 && kIters >= 1, "copy layout");
  using T = typename Cfg::T;
  int page[kIters];

  // row0 is a multiple of kRows, so with block_size >= kRows the tile lies in one page.
  __device__ __forceinline__ void fetch(const PrefillParams& p, const int32_t* table, int row0, int num_rows,
                                        int tid) {
    const int log2_bs = __ffs(p.block_size) - 1;
    if (p.block_size >= kRows) {
      const int pg = row0 < num_rows ? __ldg(table + (row0 >> log2_bs)) : 0;
#pragma unroll
      for (int it = 0; it < kIters; ++it) page[it] = pg;
    } else {
      const int r = tid / Cfg::kChunks;
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int j = row0 + r + it * kRowStep;
        page[it] = j < num_rows ? __ldg(table + (j >> log2_bs)) : 0;
      }
    }
  }

  template <class DstOff>
  __device__ __forceinline__ void issue(uint32_t k_tile, uint32_t v_tile, const T* k_head, const T* v_head,
                                        const PrefillParams& p, int row0, int num_rows, int tid,
                                        DstOff dst_off) const {
    const int r = tid / Cfg::kChunks;
    const int c = tid % Cfg::kChunks;
    const int bs_mask = p.block_size - 1;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int row = r + it * kRowStep;
      const int j = row0 + row;
      const bool valid = j < num_rows;
      const int64_t in_page = j & bs_mask;
      const T* kp = valid ? k_head + int64_t(page[it]) * p.k_block_stride + in_page * p.k_row_stride + c * 8 : k_head;
      const T* vp = valid ? v_head + int64_t(page[it]) * p.v_block_stride + in_page * p.v_row_stride + c * 8 : v_head;
      const uint32_t off = dst_off(row, c);
      cp_async_16(k_tile + off, kp, valid);
      cp_async_16(v_tile + off, vp, valid);
    }
  }
};
struct NoLoader {};

// A kernel config whose paged launches skip the sequences of fewer than kMin
// query rows (another launch owns them: the decode routing's q_len == 1 rows).
template <class Base, int kMin>
struct WithMinSeqlenQ : Base {
  static constexpr int kMinSeqlenQ = kMin;
};
// Cfg::kMinSeqlenQ where the config has one, else 0 (no lower bound).
template <class Cfg, class = void>
struct MinSeqlenQ {
  static constexpr int value = 0;
};
template <class Cfg>
struct MinSeqlenQ<Cfg, std::void_t<decltype(Cfg::kMinSeqlenQ)>> {
  static constexpr int value = Cfg::kMinSeqlenQ;
};

// Where sequence `batch` lives and how long it is, for the three layouts.
struct SeqInfo {
  int q_begin, k_begin, seqlen_q, seqlen_k;
};
template <bool kPaged, int kMinSeqlenQ = 0>
__device__ __forceinline__ SeqInfo seq_info(const PrefillParams& p, int batch) {
  SeqInfo s{0, 0, p.max_seqlen_q, p.max_seqlen_k};
  if (p.cu_seqlens_q != nullptr) {
    s.q_begin = p.cu_seqlens_q[batch];
    s.seqlen_q = p.cu_seqlens_q[batch + 1] - s.q_begin;
  }
  if constexpr (kPaged) {
    // api.py guarantees 0 <= context_len <= capacity; the clamp keeps a bad
    // value from walking off the block table.
    s.seqlen_k = min(max(p.context_lens[batch], 0), p.max_blocks * p.block_size);
    // A split mixed batch (launch_prefill_paged): the other launch owns this
    // sequence; q_len 0 makes every CTA of it return before any work.
    if (p.qlen_filter != 0 && (s.seqlen_q <= abs(p.qlen_filter)) != (p.qlen_filter > 0)) s.seqlen_q = 0;
    if constexpr (kMinSeqlenQ > 0) {
      if (s.seqlen_q < kMinSeqlenQ) s.seqlen_q = 0;
    }
  } else if (p.cu_seqlens_k != nullptr) {
    s.k_begin = p.cu_seqlens_k[batch];
    s.seqlen_k = p.cu_seqlens_k[batch + 1] - s.k_begin;
  }
  return s;
}

}  // namespace fast
}  // namespace minipaged
