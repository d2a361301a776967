// Mask, online softmax and epilogue on C fragments, shared by the mma.sync
// (prefill/mainloop_mma.cuh) and wgmma (prefill/mainloop_wgmma.cuh) mainloops.
//
// Both hold S = Q K^T and O in the m16n8 C-fragment layout: each warp owns m
// tiles of 16 rows, and a thread holds rows g = lane / 4 and g + 8 (h = 0, 1) of
// every m tile, columns tq = 2 (lane % 4) and tq + 1 of every n8 tile. (A wgmma
// accumulator, per warp, is exactly that layout.) So a row lives in one quad:
// row max and row sum need two xor-shuffles. The kernels reach their fragments
// through accessors s(mt, nt, e) / o(mt, dt, e) -> float&, which hide how they
// group the n8 tiles (mma.sync: [m][n8], wgmma: [64-column block][8][4]).
//
// Scores are kept raw: the running max is tracked in raw units and scaled once
// per row, scale * log2(e) is folded into the exp2. That is the max of the
// scaled scores only because the launchers admit a positive scale only.
#pragma once
#include <cmath>
#include <cstdint>

#include "params.h"
#include "ptx/misc.cuh"
#include "ptx/mma.cuh"

namespace minipaged {
namespace fast {

// Lazy rescaling tolerates a stale row max this far (log2 units) below the true one.
constexpr float kRescaleLog2 = 8.f;
// Raw value of a masked score (it scales to -inf).
constexpr float kMasked = -INFINITY;

struct MaskOn { static constexpr bool value = true; };
struct MaskOff { static constexpr bool value = false; };

// Natural-log log-sum-exp of a row from its reference (log2 units of the
// scaled scores) and its sum of 2^(s - ref); -inf when the row saw no key.
__device__ __forceinline__ float row_lse(float ref_log2, float sum) {
  return sum > 0.f ? (ref_log2 + log2f(sum)) * 0.6931471805599453f : -INFINITY;
}

// -inf for rows [row0, row0 + rows) of (batch, head): a block that sees no key.
__device__ __forceinline__ void write_empty_lse(const PrefillParams& p, int batch, int head, int row0,
                                                int rows, int tid, int threads) {
  if (p.lse == nullptr) return;
  float* lse = p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride;
  for (int r = tid; r < rows; r += threads) lse[int64_t(row0 + r) * p.lse_row_stride] = -INFINITY;
}

// Masks the scores of a diagonal / tail tile: key col exists iff col < seqlen_k
// and, under causal, row r sees it iff col <= qrow(r) + diag (bottom-right
// aligned; qrow maps a packed GQA row to its query row). `row0` is the warp's
// first row in the kernel's row space, `n0` the tile's first key.
template <int kMT, int kNT, bool kCausal, class S, class QRow>
__device__ __forceinline__ void mask_tile(S s, int row0, int n0, int seqlen_k, int diag, int g, int tq,
                                          QRow qrow) {
  // Key col is visible to row iff col < seqlen_k and (causal) col <= qrow(row) + diag, i.e.
  // col < one limit per row; compared in the thread's own column offsets nt * 8 + (e & 1),
  // which are constants: one compare and one select per element.
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + mt * 16 + g + h * 8;
      int limit = seqlen_k;
      if (kCausal) limit = min(limit, qrow(row) + diag + 1);
      limit -= n0 + tq;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c)
          if (nt * 8 + c >= limit) s(mt, nt, h * 2 + c) = kMasked;
    }
}

// Online-softmax state of the 2 * kMT rows a thread holds.
template <int kMT>
struct FragSoftmax {
  float row_max[kMT][2];  // raw units
  float row_sum[kMT][2];  // this thread's partial sums; quad-reduced in row_total()

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        row_max[mt][h] = kMasked;
        row_sum[mt][h] = 0.f;
      }
  }

  // Row max of the tile's kNT n8 tiles (and the running max), over the quad.
  template <int kNT, class S>
  __device__ __forceinline__ void tile_max(S s, float (&tmax)[kMT][2]) const {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float ext = row_max[mt][h];
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) ext = fmaxf(ext, fmaxf(s(mt, nt, 2 * h), s(mt, nt, 2 * h + 1)));
        ext = fmaxf(ext, __shfl_xor_sync(0xffffffffu, ext, 1));
        tmax[mt][h] = fmaxf(ext, __shfl_xor_sync(0xffffffffu, ext, 2));
      }
  }

  // Whether any row of the warp must move its reference max. Lazy mode keeps a
  // stale reference while the true max exceeds it by at most kRescaleLog2
  // (p <= 2^kRescaleLog2, harmless in fp32 and in 16-bit P); the final 1/l
  // uses the same reference, so the result is exact. The decision is
  // warp-uniform, so the common case skips the O multiply.
  __device__ __forceinline__ bool need_rescale(const float (&tmax)[kMT][2], float scale_log2) const {
    bool need = false;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) need |= tmax[mt][h] * scale_log2 - row_max[mt][h] * scale_log2 > kRescaleLog2;
    return __any_sync(0xffffffffu, need);
  }

  // Moves row (mt, h) to the reference tmax; returns the factor its O must take.
  __device__ __forceinline__ float move_max(int mt, int h, float tmax, float scale_log2) {
    // A row that has seen only masked keys keeps base 0: exp2(-inf - 0) = 0.
    const float base = (tmax == kMasked) ? 0.f : tmax * scale_log2;
    const float alpha = fast_exp2(row_max[mt][h] * scale_log2 - base);
    row_max[mt][h] = tmax;
    row_sum[mt][h] *= alpha;
    return alpha;
  }

  // move_max for every row, scaling O right away (o(mt, dt, e), kDT n8 tiles).
  template <int kDT, class O>
  __device__ __forceinline__ void rescale(const float (&tmax)[kMT][2], float scale_log2, O o) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float alpha = move_max(mt, h, tmax[mt][h], scale_log2);
        scale_o_row<kDT>(o, mt, h, alpha);
      }
  }

  template <int kDT, class O>
  __device__ __forceinline__ static void scale_o_row(O o, int mt, int h, float alpha) {
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      o(mt, dt, 2 * h) *= alpha;
      o(mt, dt, 2 * h + 1) *= alpha;
    }
  }

  // S -> P = 2^(s * scale_log2 - ref) in place, accumulating the row sums.
  template <int kNT, class S>
  __device__ __forceinline__ void exp_and_sum(S s, float scale_log2) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float base = (row_max[mt][h] == kMasked) ? 0.f : row_max[mt][h] * scale_log2;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          const float p0 = fast_exp2(fmaf(s(mt, nt, 2 * h), scale_log2, -base));
          const float p1 = fast_exp2(fmaf(s(mt, nt, 2 * h + 1), scale_log2, -base));
          s(mt, nt, 2 * h) = p0;
          s(mt, nt, 2 * h + 1) = p1;
          sum += p0 + p1;
        }
        row_sum[mt][h] += sum;
      }
  }

  // Epilogue: the row's whole sum l (quad-reduced) ...
  __device__ __forceinline__ float row_total(int mt, int h) const {
    float l = row_sum[mt][h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    return l;
  }
  // ... and its reference in log2 units of the scaled scores, for the lse.
  __device__ __forceinline__ float row_ref(int mt, int h, float scale_log2) const {
    return row_max[mt][h] == kMasked ? 0.f : row_max[mt][h] * scale_log2;
  }
};

// The m16n8k16 A fragment of P for k step kk (keys 16kk .. 16kk+15) of m tile
// mt: the C fragments of n8 tiles 2kk and 2kk+1, packed to 16 bits (FA2's
// register reuse: no trip through shared memory).
template <typename T, class S>
__device__ __forceinline__ void pack_p(S s, int mt, int kk, uint32_t (&a)[4]) {
  a[0] = pack2<T>(s(mt, 2 * kk, 0), s(mt, 2 * kk, 1));
  a[1] = pack2<T>(s(mt, 2 * kk, 2), s(mt, 2 * kk, 3));
  a[2] = pack2<T>(s(mt, 2 * kk + 1, 0), s(mt, 2 * kk + 1, 1));
  a[3] = pack2<T>(s(mt, 2 * kk + 1, 2), s(mt, 2 * kk + 1, 3));
}

// Row (mt, h) of O times inv, packed to 16 bits: put(dt, pair) per n8 tile,
// pair = columns tq, tq + 1 of n8 tile dt.
template <typename T, int kDT, class O, class Put>
__device__ __forceinline__ void pack_o_row(O o, int mt, int h, float inv, Put put) {
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt) put(dt, pack2<T>(o(mt, dt, 2 * h) * inv, o(mt, dt, 2 * h + 1) * inv));
}

// The pipelined wgmma kernels' tile step on FragSoftmax<1> (16 rows per warp),
// split around the wait for the PV wgmma that still reads O and the previous P:
// before it, the lazy max move (whether the warp moves its reference; if so
// alpha takes each row's O factor) ...
__device__ __forceinline__ bool move_max_lazy(FragSoftmax<1>& sm, const float (&tile_max)[1][2], float scale_log2,
                                              float (&alpha)[2]) {
  const bool rescale = sm.need_rescale(tile_max, scale_log2);
  if (rescale) {
#pragma unroll
    for (int h = 0; h < 2; ++h) alpha[h] = sm.move_max(0, h, tile_max[0][h], scale_log2);
  }
  return rescale;
}
// ... after it, O takes the factors and the tile's P (kKSteps k steps of 16
// keys) is packed into the A fragments of the next PV.
template <typename T, int kDT, int kKSteps, class O, class S>
__device__ __forceinline__ void rescale_o_pack_p(bool rescale, const float (&alpha)[2], O o, S s,
                                                 uint32_t (&p)[kKSteps][4]) {
  if (rescale) {
#pragma unroll
    for (int h = 0; h < 2; ++h) FragSoftmax<1>::scale_o_row<kDT>(o, 0, h, alpha[h]);
  }
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) pack_p<T>(s, 0, kk, p[kk]);
}

// The epilogue of a thread's two rows of m tile 0 of FragSoftmax<1> (the
// wgmma kernels' 16 rows per warp): row r = row0 + g + 8h. Its lse (natural
// log, when p.lse) by one lane of the quad for rows < m_rows, at query row
// q_row0 + r of (batch, head); its O row times out_scale / l (0 for a row that saw no
// key), packed to 16 bits, to put(r, dt, pair) for every row when kPutAll (a
// staging tile copied out row by row later), else for rows < m_rows only.
template <typename T, int kDT, bool kPutAll, class O, class Put>
__device__ __forceinline__ void epilogue_rows(const FragSoftmax<1>& sm, O o, float scale_log2, const PrefillParams& p,
                                              int batch, int head, int q_row0, int row0, int m_rows, int lane,
                                              Put put, float out_scale = 1.f) {
  const int g = lane >> 2;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = sm.row_total(0, h);
    const float inv = l > 0.f ? out_scale / l : 0.f;
    const int r = row0 + g + h * 8;
    if (p.lse != nullptr && (lane & 3) == 0 && r < m_rows) {
      const float ref = sm.row_ref(0, h, scale_log2);
      p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + int64_t(q_row0 + r) * p.lse_row_stride] =
          row_lse(ref, l);
    }
    if (kPutAll || r < m_rows) pack_o_row<T, kDT>(o, 0, h, inv, [&](int dt, uint32_t pair) { put(r, dt, pair); });
  }
}

}  // namespace fast
}  // namespace minipaged
