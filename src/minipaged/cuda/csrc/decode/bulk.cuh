// Paged decode on sm_90a for batches too small to fill the GPU, groups of 1-2
// query heads. Included by decode/launch.cu (and scripts/decode_bulk_probe.cu).
//
// Where the time of a small decode goes is latency, not arithmetic: a CTA of the
// register-ring kernels keeps a few KB in flight, so the K/V stream of one
// sequence reaches HBM speed only after many dependent round trips, and the
// split-KV merge is a second kernel that waits for the first and reads its
// partials back. This kernel removes both:
//   * one producer warp per CTA copies every cached (token, KV head) row of its
//     split with its own cp.async.bulk (16 K rows and 16 V rows per ring stage,
//     one row per lane), completion counted in bytes on the stage's mbarrier: a
//     CTA keeps STAGES x 8 KB in flight (bf16, D 128) at no register cost, so
//     one CTA per SM streams at HBM speed from its first microsecond;
//   * NCW consumer warps take the stages round robin, each with its own online
//     softmax; a stage's 16 tokens x G heads of scores are summed over the 32
//     lanes (each lane holds D/32 dims) by one reduce-scatter, so lane l ends up
//     with the score of (head l / 16, token l % 16);
//   * the splits of one (sequence, KV head) are one thread-block cluster: each
//     CTA leaves its merged state in shared memory and, after a cluster barrier,
//     CTA r combines slice r of the outputs over all splits through distributed
//     shared memory. No partials in global memory, no second launch.
// Rows past the context are never copied; the stale bytes of a partial stage's
// tail are masked out of the scores (-inf) and skipped in P V.
// FP8 caches: rows of e4m3 bytes, widened to fp32 in registers (exact);
// k_scale is folded into q's pre-scale and v_scale into the output.
#pragma once
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "decode/common.cuh"
#include "ptx/cp_async.cuh"
#include "ptx/tma.cuh"

namespace minipaged {
namespace {
namespace bulk {

constexpr int kRows = 16;        // tokens per ring stage
constexpr int kMaxCluster = 16;  // splits one cluster merges (non-portable above 8)

template <int D, bool FP8>
struct Geo {
  static constexpr int kElemBytes = FP8 ? 1 : 2;
  static constexpr int kRowBytes = D * kElemBytes;        // one cached (token, head) row
  static constexpr int kStageBytes = 2 * kRows * kRowBytes;  // K rows, then V rows
  static constexpr int kDpl = D / 32;                     // dims per lane
  static_assert(kRowBytes % 16 == 0, "bulk copies move multiples of 16 bytes");
};

template <int D, bool FP8, int G, int NCW, int STAGES>
constexpr int smem_bytes() {
  return STAGES * Geo<D, FP8>::kStageBytes + 2 * STAGES * 8 +
         4 * (2 * NCW * G + NCW * G * D + 2 * G + G * D);
}

#if MINIPAGED_WGMMA_DEVICE
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void cluster_sync_all() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// The shared::cluster address of `addr` (a shared::cta address of this CTA) in CTA `rank`.
__device__ __forceinline__ uint32_t cluster_map(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ float ld_cluster_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

// DPL dims of one cached row at shared address `addr` -> floats.
template <typename T, bool FP8, int DPL>
__device__ __forceinline__ void load_row(uint32_t addr, float (&f)[DPL]) {
  static_assert(DPL == 2 || DPL == 4, "D 64 or 128");
  if constexpr (FP8) {
    uint32_t w;
    if constexpr (DPL == 4) {
      asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(w) : "r"(addr));
    } else {
      uint16_t h;
      asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(h) : "r"(addr));
      w = h;
    }
    __half2 h0;
    const uint32_t c0 = fp8x2_to_f16x2<0>(w);
    memcpy(&h0, &c0, 4);
    const float2 a = __half22float2(h0);
    f[0] = a.x, f[1] = a.y;
    if constexpr (DPL == 4) {
      __half2 h1;
      const uint32_t c1 = fp8x2_to_f16x2<1>(w);
      memcpy(&h1, &c1, 4);
      const float2 b = __half22float2(h1);
      f[2] = b.x, f[3] = b.y;
    }
  } else {
    uint32_t w[DPL / 2];
    if constexpr (DPL == 4) {
      asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(w[0]), "=r"(w[1]) : "r"(addr));
    } else {
      asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(w[0]) : "r"(addr));
    }
#pragma unroll
    for (int i = 0; i < DPL / 2; ++i) {
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
      } else {
        __half2 h;
        memcpy(&h, &w[i], 4);
        const float2 v = __half22float2(h);
        f[2 * i] = v.x, f[2 * i + 1] = v.y;
      }
    }
  }
}

// One halving step of reduce_scatter: values [0, 2 HALF) -> [0, HALF).
template <int HALF, int N>
__device__ __forceinline__ void halve(float (&v)[N], int lane) {
  const bool upper = lane & HALF;
#pragma unroll
  for (int k = 0; k < HALF; ++k) {
    const float send = upper ? v[k] : v[k + HALF];
    const float keep = upper ? v[k + HALF] : v[k];
    v[k] = keep + __shfl_xor_sync(0xffffffffu, send, HALF);
  }
  if constexpr (HALF > 1) halve<HALF / 2>(v, lane);
}

// Sums each of the N values over the warp's 32 lanes; lane l returns the sum of
// value l % N (N = 16 or 32). Halving exchange: at each step a lane keeps the
// half of its values whose index bit matches its lane bit and adds its partner's
// copy of that half: N - 1 shuffles for N sums instead of 5 N.
template <int N>
__device__ __forceinline__ float reduce_scatter(float (&v)[N], int lane) {
  static_assert(N == 16 || N == 32, "16 or 32 values");
  if constexpr (N == 16) {
#pragma unroll
    for (int k = 0; k < 16; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], 16);
  }
  halve<N / 2>(v, lane);
  return v[0];
}
#endif  // MINIPAGED_WGMMA_DEVICE

// Grid (num_splits, num_kv_heads, batch). With num_splits > 1 the launch has
// cluster dims (num_splits, 1, 1), num_splits <= kMaxCluster, and the splits
// merge in the cluster. G = the GQA group (1 or 2), all of it per CTA.
// COPY 0: one cp.async.bulk per row (completion as transaction bytes); 1: 16-byte
// cp.async by the producer warp's lanes, each lane's completion an arrival
// (cp.async.mbarrier.arrive.noinc).
template <typename T, int D, int G, bool FP8, int NCW, int STAGES, int COPY = 0>
__global__ void __launch_bounds__((NCW + 1) * 32, 1) decode_bulk_kernel(const __grid_constant__ DecodeParams p) {
#if MINIPAGED_WGMMA_DEVICE
  using Gm = Geo<D, FP8>;
  constexpr int RB = Gm::kRowBytes;
  constexpr int SB = Gm::kStageBytes;
  constexpr int DPL = Gm::kDpl;
  constexpr int NV = G * kRows;  // scores per stage
  constexpr int kThreads = (NCW + 1) * 32;
  static_assert(G == 1 || G == 2, "groups of 1-2 query heads");
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t ring = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t bars = ring + STAGES * SB;
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (STAGES + s); };
  float* sm_m = reinterpret_cast<float*>(smem + STAGES * SB + 16 * STAGES);  // [NCW][G]
  float* sm_l = sm_m + NCW * G;                                               // [NCW][G]
  float* sm_o = sm_l + NCW * G;                                               // [NCW][G][D]
  float* cta_m = sm_o + NCW * G * D;                                          // [G]
  float* cta_l = cta_m + G;                                                   // [G]
  float* cta_o = cta_l + G;                                                   // [G][D]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const DecodeSlice slice = decode_slice<false>(p, G);
  if (tid == 0) {
#pragma unroll 1
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full(s), COPY == 0 ? 1 : 32);
      mbar_init(empty(s), 32);  // every lane of the consuming warp
    }
    mbar_fence_init();
  }
  __syncthreads();
  const int nst = slice.end > slice.start ? (slice.end - slice.start + kRows - 1) / kRows : 0;

  if (warp == NCW) {
    const int shift = __ffs(p.block_size) - 1;
    const int32_t* table = p.block_tables + slice.b * p.block_table_stride;
    const int64_t eb = Gm::kElemBytes;
    if constexpr (COPY == 0) {
      // Producer: lane r < 16 copies K row r of each stage, lane 16 + r its V row.
      const int r = lane & (kRows - 1);
      const bool is_v = lane >= kRows;
      const char* base = static_cast<const char*>(is_v ? p.v_cache : p.k_cache) +
                         slice.kvh * (is_v ? p.v_head_stride : p.k_head_stride) * eb;
      const int64_t bstride = (is_v ? p.v_block_stride : p.k_block_stride) * eb;
      const int64_t tstride = (is_v ? p.v_token_stride : p.k_token_stride) * eb;
      const uint32_t dst0 = ring + (is_v ? kRows * RB : 0) + r * RB;
#pragma unroll 1
      for (int i = 0; i < nst; ++i) {
        const int s = i % STAGES;
        const int t0 = slice.start + i * kRows;
        const int tok = t0 + r;
        const int nvalid = min(kRows, slice.end - t0);
        // The table entry is read before the slot is free: its latency overlaps the wait.
        const int blk = r < nvalid ? table[tok >> shift] : 0;
        mbar_wait(empty(s), ((i / STAGES) & 1) ^ 1);
        if (lane == 0) mbar_arrive_expect_tx(full(s), static_cast<uint32_t>(nvalid * 2 * RB));
        if (r < nvalid)
          bulk_g2s(dst0 + s * SB, base + blk * bstride + (tok & (p.block_size - 1)) * tstride, RB, full(s));
      }
    } else {
      // Producer: the stage's 32 rows x RB / 16 chunks of 16 bytes, lane-strided, so
      // that each instruction copies whole rows; each lane then arrives once.
      constexpr int kChunksPerRow = RB / 16;
      constexpr int kChunks = 2 * kRows * kChunksPerRow;
      static_assert(kChunks % 32 == 0, "whole warp instructions");
      const char* kbase = static_cast<const char*>(p.k_cache) + slice.kvh * p.k_head_stride * eb;
      const char* vbase = static_cast<const char*>(p.v_cache) + slice.kvh * p.v_head_stride * eb;
#pragma unroll 1
      for (int i = 0; i < nst; ++i) {
        const int s = i % STAGES;
        const int t0 = slice.start + i * kRows;
        const int nvalid = min(kRows, slice.end - t0);
        mbar_wait(empty(s), ((i / STAGES) & 1) ^ 1);
#pragma unroll
        for (int j = 0; j < kChunks / 32; ++j) {
          const int c = j * 32 + lane;
          const int row = c / kChunksPerRow;  // 0..15 K, 16..31 V
          const int col = c - row * kChunksPerRow;
          const int r = row & (kRows - 1);
          if (r < nvalid) {
            const int tok = t0 + r;
            const int blk = table[tok >> shift];
            const bool is_v = row >= kRows;
            const char* src = (is_v ? vbase : kbase) + blk * ((is_v ? p.v_block_stride : p.k_block_stride) * eb) +
                              (tok & (p.block_size - 1)) * ((is_v ? p.v_token_stride : p.k_token_stride) * eb) +
                              col * 16;
            cp_async_16(ring + s * SB + row * RB + col * 16, src, true);
          }
        }
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full(s)) : "memory");
      }
    }
  } else {
    // Consumers. q for this lane's dims, times scale * log2(e) (FP8: * k_scale).
    float qs = p.scale * kLog2e;
    if constexpr (FP8) qs *= p.k_scale[slice.kvh];
    float q[G][DPL];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const T* qp = static_cast<const T*>(p.q) + slice.row * p.q_batch_stride + (slice.h0 + g) * p.q_head_stride +
                    lane * DPL;
#pragma unroll
      for (int d = 0; d < DPL; ++d) q[g][d] = Convert<T>::to_float(qp[d]) * qs;
    }
    float m[G], l[G], acc[G][DPL];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      m[g] = -INFINITY, l[g] = 0.f;
#pragma unroll
      for (int d = 0; d < DPL; ++d) acc[g][d] = 0.f;
    }
    const int my_t = lane & (kRows - 1);
    const int my_g = G == 2 ? lane >> 4 : 0;
    const uint32_t lane_off = lane * DPL * Gm::kElemBytes;
#pragma unroll 1
    for (int i = warp; i < nst; i += NCW) {
      const int s = i % STAGES;
      const int nvalid = min(kRows, slice.end - (slice.start + i * kRows));
      const uint32_t kb = ring + s * SB + lane_off;
      const uint32_t vb = kb + kRows * RB;
      mbar_wait(full(s), (i / STAGES) & 1);
      float part[NV];
#pragma unroll
      for (int t = 0; t < kRows; ++t) {
        float kf[DPL];
        load_row<T, FP8, DPL>(kb + t * RB, kf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          float a = q[g][0] * kf[0];
#pragma unroll
          for (int d = 1; d < DPL; ++d) a = fmaf(q[g][d], kf[d], a);
          part[g * kRows + t] = a;
        }
      }
      float sc = reduce_scatter<NV>(part, lane);
      sc = my_t < nvalid ? sc : -INFINITY;  // stale rows of a partial stage
      float mt = sc;
#pragma unroll
      for (int off = kRows / 2; off > 0; off /= 2) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, off));
      float m_new[G], alpha[G];
      if constexpr (G == 2) {
        const float mo = __shfl_xor_sync(0xffffffffu, mt, 16);
        m_new[0] = fmaxf(m[0], my_g == 0 ? mt : mo);
        m_new[1] = fmaxf(m[1], my_g == 0 ? mo : mt);
      } else {
        m_new[0] = fmaxf(m[0], mt);
      }
      const float pr = fast_exp2(sc - (G == 2 && my_g == 1 ? m_new[G - 1] : m_new[0]));
      float ps = pr;
#pragma unroll
      for (int off = kRows / 2; off > 0; off /= 2) ps += __shfl_xor_sync(0xffffffffu, ps, off);
      float ps_g[G];
      if constexpr (G == 2) {
        const float po = __shfl_xor_sync(0xffffffffu, ps, 16);
        ps_g[0] = my_g == 0 ? ps : po;
        ps_g[1] = my_g == 0 ? po : ps;
      } else {
        ps_g[0] = ps;
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        alpha[g] = fast_exp2(m[g] - m_new[g]);  // m = -inf on the first stage: 0
        l[g] = fmaf(l[g], alpha[g], ps_g[g]);
        m[g] = m_new[g];
#pragma unroll
        for (int d = 0; d < DPL; ++d) acc[g][d] *= alpha[g];
      }
#pragma unroll
      for (int t = 0; t < kRows; ++t) {
        if (t < nvalid) {
          float vf[DPL];
          load_row<T, FP8, DPL>(vb + t * RB, vf);
#pragma unroll
          for (int g = 0; g < G; ++g) {
            const float pt = __shfl_sync(0xffffffffu, pr, g * kRows + t);
#pragma unroll
            for (int d = 0; d < DPL; ++d) acc[g][d] = fmaf(pt, vf[d], acc[g][d]);
          }
        }
      }
      mbar_arrive(empty(s));
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (lane == 0) sm_m[warp * G + g] = m[g], sm_l[warp * G + g] = l[g];
#pragma unroll
      for (int d = 0; d < DPL; ++d) sm_o[(warp * G + g) * D + lane * DPL + d] = acc[g][d];
    }
  }
  __syncthreads();

  // The CTA's state: its warps merged in a fixed order.
  const bool clustered = p.num_splits > 1;
  float out_scale = 1.f;
  if constexpr (FP8) out_scale = p.v_scale[slice.kvh];
  for (int idx = tid; idx < G * D; idx += kThreads) {
    const int g = idx / D, d = idx - g * D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < NCW; ++w) mx = fmaxf(mx, sm_m[w * G + g]);
    const float mref = mx == -INFINITY ? 0.f : mx;
    float L = 0.f, O = 0.f;
#pragma unroll
    for (int w = 0; w < NCW; ++w) {
      const float c = fast_exp2(sm_m[w * G + g] - mref);
      L = fmaf(sm_l[w * G + g], c, L);
      O = fmaf(sm_o[(w * G + g) * D + d], c, O);
    }
    if (clustered) {
      cta_o[idx] = O;
      if (d == 0) cta_m[g] = mx, cta_l[g] = L;
    } else {
      const int h = slice.h0 + g;
      T* op = static_cast<T*>(p.o) + slice.row * p.o_batch_stride + h * p.o_head_stride;
      op[d] = Convert<T>::from_float(L > 0.f ? O / L * out_scale : 0.f);
      if (p.lse != nullptr && d == 0)
        p.lse[slice.row * p.lse_batch_stride + h] = L > 0.f ? (mref + log2f(L)) * kLn2 : -INFINITY;
    }
  }

  if (clustered) {
    cluster_sync_all();  // every split's state is in its shared memory
    const int S = p.num_splits;
    const int chunk = (G * D + S - 1) / S;
    const int lo = slice.split * chunk, hi = min(lo + chunk, G * D);
    const uint32_t m_addr = static_cast<uint32_t>(__cvta_generic_to_shared(cta_m));
    const uint32_t l_addr = static_cast<uint32_t>(__cvta_generic_to_shared(cta_l));
    const uint32_t o_addr = static_cast<uint32_t>(__cvta_generic_to_shared(cta_o));
    for (int idx = lo + tid; idx < hi; idx += kThreads) {
      const int g = idx / D, d = idx - g * D;
      float mj[kMaxCluster];
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < kMaxCluster; ++j) {
        mj[j] = j < S ? ld_cluster_f32(cluster_map(m_addr + 4 * g, j)) : -INFINITY;
        mx = fmaxf(mx, mj[j]);
      }
      const float mref = mx == -INFINITY ? 0.f : mx;
      float L = 0.f, O = 0.f;
#pragma unroll
      for (int j = 0; j < kMaxCluster; ++j) {
        if (j < S) {
          const float c = fast_exp2(mj[j] - mref);
          L = fmaf(ld_cluster_f32(cluster_map(l_addr + 4 * g, j)), c, L);
          O = fmaf(ld_cluster_f32(cluster_map(o_addr + 4 * idx, j)), c, O);
        }
      }
      const int h = slice.h0 + g;
      T* op = static_cast<T*>(p.o) + slice.row * p.o_batch_stride + h * p.o_head_stride;
      op[d] = Convert<T>::from_float(L > 0.f ? O / L * out_scale : 0.f);
      if (p.lse != nullptr && d == 0)
        p.lse[slice.row * p.lse_batch_stride + h] = L > 0.f ? (mref + log2f(L)) * kLn2 : -INFINITY;
    }
    cluster_sync_all();  // no CTA leaves while another still reads its shared memory
  }
#else
  __trap();
#endif
}

}  // namespace bulk
}  // namespace
}  // namespace minipaged
