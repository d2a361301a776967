// What the mma.sync and wgmma prefill mainloops share before the math: where
// a sequence lives (dense, varlen, paged) and the paged K/V tile gatherer.
#pragma once
#include <cstdint>
#include <type_traits>

#include "params.h"
#include "ptx/cp_async.cuh"

namespace minipaged {
namespace fast {

// SMs a launch sizes its grid for (the H200's 132 when the caller did not say).
inline int64_t sm_count(const PrefillParams& p) { return p.num_sms > 0 ? p.num_sms : 132; }

// Paged counterpart of load_tile_async for the K and V tiles of one sequence:
// key j is token j % block_size of cache block table[j / block_size]. Rows at
// or past num_rows are zero-filled and never looked up, so table entries past
// ceil(num_rows / block_size) (which may be -1) are not read.
// The page ids of a tile are fetched one tile ahead (fetch() right after the
// previous tile's copies were issued), so the table round trip overlaps a
// whole tile of math instead of stalling the copy. Tiles must be issued in
// order (fetch(t), issue(t), fetch(t+1), issue(t+1), ...), which the kernels do.
// A row is kChunks 16-byte chunks of Elem (16-bit or e4m3 caches);
// `k_off(row, chunk)` / `v_off(row, chunk)` are the byte offsets of a chunk in
// the shared K / V tile (each kernel swizzles its own way).
template <int kThreads, int kChunks, int kRows, typename Elem>
struct PagedTileLoader {
  static constexpr int kIters = kRows * kChunks / kThreads;
  static constexpr int kRowStep = kThreads / kChunks;
  static constexpr int kChunkElems = 16 / int(sizeof(Elem));
  static_assert(kThreads % kChunks == 0 && kIters >= 1, "copy layout");
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
      const int r = tid / kChunks;
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int j = row0 + r + it * kRowStep;
        page[it] = j < num_rows ? __ldg(table + (j >> log2_bs)) : 0;
      }
    }
  }

  template <class KOff, class VOff>
  __device__ __forceinline__ void issue(uint32_t k_tile, uint32_t v_tile, const Elem* k_head, const Elem* v_head,
                                        const PrefillParams& p, int row0, int num_rows, int tid, KOff k_off,
                                        VOff v_off) const {
    const int r = tid / kChunks;
    const int c = tid % kChunks;
    const int bs_mask = p.block_size - 1;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int row = r + it * kRowStep;
      const int j = row0 + row;
      const bool valid = j < num_rows;
      const int64_t in_page = j & bs_mask;
      const Elem* kp =
          valid ? k_head + int64_t(page[it]) * p.k_block_stride + in_page * p.k_row_stride + c * kChunkElems : k_head;
      const Elem* vp =
          valid ? v_head + int64_t(page[it]) * p.v_block_stride + in_page * p.v_row_stride + c * kChunkElems : v_head;
      cp_async_16(k_tile + k_off(row, c), kp, valid);
      cp_async_16(v_tile + v_off(row, c), vp, valid);
    }
  }
};
// The 16-bit caches' loader of a kernel config.
template <class Cfg, int kRows>
using PagedKVLoader = PagedTileLoader<Cfg::kThreads, Cfg::kChunks, kRows, typename Cfg::T>;
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

// Row 0 of sequence `batch` in q and o (query head `head`) and in k and v (KV
// head `kv_head`), for the dense and varlen layouts (q_begin / k_begin: the
// sequence's first packed row; 0 when dense). Paged kernels reach K and V
// through the block table instead and take q and o only.
template <typename T>
struct HeadPointers {
  const T* q;
  const T* k;
  const T* v;
  T* o;
};
template <typename T>
__device__ __forceinline__ HeadPointers<T> head_pointers(const PrefillParams& p, int batch, int head, int kv_head,
                                                         int q_begin, int k_begin) {
  return {static_cast<const T*>(p.q) + batch * p.q_batch_stride + int64_t(q_begin) * p.q_row_stride +
              head * p.q_head_stride,
          static_cast<const T*>(p.k) + batch * p.k_batch_stride + int64_t(k_begin) * p.k_row_stride +
              kv_head * p.k_head_stride,
          static_cast<const T*>(p.v) + batch * p.v_batch_stride + int64_t(k_begin) * p.v_row_stride +
              kv_head * p.v_head_stride,
          static_cast<T*>(p.o) + batch * p.o_batch_stride + int64_t(q_begin) * p.o_row_stride +
              head * p.o_head_stride};
}

}  // namespace fast
}  // namespace minipaged
