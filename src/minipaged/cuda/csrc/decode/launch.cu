// Paged-KV decode (one query token per sequence), shared by the `cuda` and
// `cuda-wmma` backends. Two kernels: the scalar one below (GQA groups of 1-2
// heads) and the tensor-core one of decode_mma.cuh (groups of 3+ heads);
// select_for_dim() chooses.
// Both write the same split partials, merged by decode_reduce_kernel.
//
// One CTA per (split, KV head, query-head chunk, sequence). All query heads of
// a GQA group (up to G = 8 per CTA) are processed together, so a KV head's pages
// are streamed from memory once for the whole group. Decode is memory-bound, so
// the kernel is organised around keeping 16-byte loads in flight:
//   * a token row (D elements) is read by TPT threads, each holding D/TPT
//     contiguous-in-16-byte-pieces elements; a warp covers 32/TPT tokens per
//     load and U such token groups per iteration, and K and V of all of them are
//     requested before the first one is used;
//   * block-table entries for the next iteration are fetched while the current
//     one computes, so the page lookup is off the critical path;
//   * every (warp, token slot) keeps its own online-softmax state in registers;
//     the states are merged once at the end (shuffles, then shared memory).
// Scores are in base 2: q is pre-multiplied by scale*log2(e) and exp is ex2.
// With few CTAs (small batch, long context) the context is split (flash-decoding):
// each split writes a normalised partial output and its log2-sum-exp, and a
// second kernel merges them. The split count depends only on host-side shapes
// (B, Hkv, table capacity, SM count), never on context_lens, so the launch is
// graph-capturable and needs no host sync.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <mutex>
#include <utility>
#include <vector>

#include "common.cuh"
#include "decode_mma.cuh"
#include "kernels.h"

namespace minipaged {
namespace {

constexpr int kWarps = 4;
constexpr int kMinTokensPerSplit = 128;
constexpr int kMaxSplits = 256;

// STAGES == 0: K/V rows go straight to registers (PIPE: double-buffered).
// STAGES >= 2: rows are staged through shared memory with cp.async, STAGES-1
// iterations ahead. Each thread only ever reads back the bytes it copied
// itself, so the pipeline needs cp.async.wait_group but no block barrier, and
// the in-flight data costs shared memory instead of registers.
template <typename T, int D, int G, int TPT, int U, bool PIPE, int STAGES>
__global__ void __launch_bounds__(kWarps * 32)
paged_decode_kernel(const DecodeParams p) {
  constexpr int VEC = D / (8 * TPT);  // 16-byte pieces per thread per token row
  static_assert(VEC >= 1 && VEC * 8 * TPT == D, "TPT must divide D/8");
  constexpr int DPT = 8 * VEC;         // elements of a row held by one thread
  constexpr int SLOTS = 32 / TPT;      // tokens a warp covers per load
  constexpr int TOK_WARP = SLOTS * U;  // tokens per warp per iteration
  constexpr int TOK_CTA = kWarps * TOK_WARP;

  __shared__ float sm_m[kWarps][G];
  __shared__ float sm_l[kWarps][G];
  __shared__ float sm_acc[kWarps][G][D];
  extern __shared__ uint4 stage_smem[];  // [STAGES][U][VEC][2][threads], STAGES >= 2 only

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int slot = lane / TPT;
  const int lt = lane % TPT;

  const DecodeSlice slice = decode_slice(p, G);
  const int kvh = slice.kvh, b = slice.b, h0 = slice.h0, ng = slice.ng;
  const int start = slice.start, end = slice.end, capacity = slice.capacity;
  // Block-table reads are bounded by the table, not by ctx, so they need not
  // wait for context_lens; entries past ctx are read but never followed.
  const int table_end = min(capacity, start + p.tokens_per_split);

  // Element offset of this thread's v-th 16-byte piece inside a row: the TPT
  // lanes of a slot read 16*TPT contiguous bytes per instruction.
  auto dim_of = [&](int v) { return v * TPT * 8 + lt * 8; };

  float q[G][DPT];
  {
    const T* qp = static_cast<const T*>(p.q) + b * p.q_batch_stride + h0 * p.q_head_stride;
    const float qscale = p.scale * kLog2e;
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          q[g][v * 8 + e] =
              g < ng ? Convert<T>::to_float(qp[g * p.q_head_stride + dim_of(v) + e]) * qscale : 0.f;
        }
      }
    }
  }

  float acc[G][DPT];
  float m[G], l[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int d = 0; d < DPT; ++d) acc[g][d] = 0.f;
  }

  const int log2_bs = __ffs(p.block_size) - 1;
  const int bs_mask = p.block_size - 1;
  const int32_t* bt = p.block_tables + b * p.block_table_stride;
  const T* kbase = static_cast<const T*>(p.k_cache) + kvh * p.k_head_stride + lt * 8;
  const T* vbase = static_cast<const T*>(p.v_cache) + kvh * p.v_head_stride + lt * 8;

  // Issues the K/V row loads of the U token groups at `base` (pages already known).
  auto issue = [&](int base, const int (&pg)[U], uint4 (&kr)[U][VEC], uint4 (&vr)[U][VEC]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int tok = base + u * SLOTS + slot;
      if (tok < end) {
        const int64_t in_page = tok & bs_mask;
        const T* kp = kbase + pg[u] * p.k_block_stride + in_page * p.k_token_stride;
        const T* vp = vbase + pg[u] * p.v_block_stride + in_page * p.v_token_stride;
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          kr[u][v] = ld_stream_16(kp + v * TPT * 8);
          vr[u][v] = ld_stream_16(vp + v * TPT * 8);
        }
      } else {
#pragma unroll
        for (int v = 0; v < VEC; ++v) kr[u][v] = vr[u][v] = make_uint4(0, 0, 0, 0);
      }
    }
  };
  auto fetch_pages = [&](int base, int (&pg)[U]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int tok = base + u * SLOTS + slot;
      pg[u] = tok < table_end ? __ldg(bt + (tok >> log2_bs)) : 0;
    }
  };

  // cp.async staging: thread t's piece (stage, u, v, k|v) at a stride of the
  // block size, so a warp's 32 pieces are 512 contiguous bytes (no conflicts).
  auto staged = [&](int st, int u, int v, int kv) -> uint4* {
    return stage_smem + ((((st * U + u) * VEC + v) * 2 + kv) * (kWarps * 32) + threadIdx.x);
  };
  auto issue_async = [&](int base, const int (&pg)[U], int st) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int tok = base + u * SLOTS + slot;
      const bool valid = tok < end;
      const int64_t in_page = tok & bs_mask;
      const T* kp = valid ? kbase + pg[u] * p.k_block_stride + in_page * p.k_token_stride : kbase;
      const T* vp = valid ? vbase + pg[u] * p.v_block_stride + in_page * p.v_token_stride : vbase;
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        cp_async_16(staged(st, u, v, 0), kp + v * TPT * 8, valid);
        cp_async_16(staged(st, u, v, 1), vp + v * TPT * 8, valid);
      }
    }
  };

  int tok_base = start + warp * TOK_WARP;
  int page[U];  // pages of the next token groups to be loaded
  uint4 kr[U][VEC], vr[U][VEC];
  int stage = 0;
  fetch_pages(tok_base, page);
  if constexpr (STAGES >= 2) {
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
      issue_async(tok_base + st * TOK_CTA, page, st);
      cp_async_commit();
      fetch_pages(tok_base + (st + 1) * TOK_CTA, page);
    }
  } else if constexpr (PIPE) {
    // Register double buffering: the rows of iteration i+1 are requested
    // before iteration i is computed.
    issue(tok_base, page, kr, vr);
    fetch_pages(tok_base + TOK_CTA, page);
  }

  for (; tok_base < end; tok_base += TOK_CTA) {
    uint4 nk[U][VEC], nv[U][VEC];
    if constexpr (STAGES >= 2) {
      int st_next = stage + STAGES - 1;
      if (st_next >= STAGES) st_next -= STAGES;
      issue_async(tok_base + (STAGES - 1) * TOK_CTA, page, st_next);
      cp_async_commit();
      fetch_pages(tok_base + STAGES * TOK_CTA, page);
      cp_async_wait<STAGES - 1>();  // this iteration's group has landed
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          kr[u][v] = *staged(stage, u, v, 0);
          vr[u][v] = *staged(stage, u, v, 1);
        }
      }
      stage = stage + 1 == STAGES ? 0 : stage + 1;
    } else if constexpr (PIPE) {
      issue(tok_base + TOK_CTA, page, nk, nv);
      fetch_pages(tok_base + 2 * TOK_CTA, page);
    } else {
      issue(tok_base, page, kr, vr);
      // Next iteration's pages, while this iteration's rows are in flight.
      fetch_pages(tok_base + TOK_CTA, page);
    }

    float s[G][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int g = 0; g < G; ++g) s[g][u] = 0.f;
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        float kf[8];
        Convert<T>::to_float8(kr[u][v], kf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
          for (int e = 0; e < 8; ++e) s[g][u] = fmaf(q[g][v * 8 + e], kf[e], s[g][u]);
        }
      }
    }
#pragma unroll
    for (int off = TPT / 2; off > 0; off >>= 1) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int u = 0; u < U; ++u) s[g][u] += __shfl_xor_sync(0xffffffffu, s[g][u], off);
      }
    }

    float pr[G][U];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mx = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (tok_base + u * SLOTS + slot >= end) s[g][u] = -INFINITY;
        mx = fmaxf(mx, s[g][u]);
      }
      // While nothing was seen mx is -inf; 0 as the reference keeps ex2 away from inf-inf.
      const float mref = mx == -INFINITY ? 0.f : mx;
      const float alpha = fast_exp2(m[g] - mref);
      float sum = 0.f;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        pr[g][u] = fast_exp2(s[g][u] - mref);
        sum += pr[g][u];
      }
      l[g] = l[g] * alpha + sum;
      m[g] = mx;
#pragma unroll
      for (int d = 0; d < DPT; ++d) acc[g][d] *= alpha;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        float vf[8];
        Convert<T>::to_float8(vr[u][v], vf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[g][v * 8 + e] = fmaf(pr[g][u], vf[e], acc[g][v * 8 + e]);
        }
      }
    }
    if constexpr (PIPE && STAGES < 2) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          kr[u][v] = nk[u][v];
          vr[u][v] = nv[u][v];
        }
      }
    }
  }
  if constexpr (STAGES >= 2) cp_async_wait<0>();  // no copy may outlive the block
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Let the reduction grid launch while this one drains; it still waits for
  // this grid's completion (griddepcontrol.wait) before reading partials.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif

  // Merge the token slots of the warp: lanes with the same lt hold the same dims.
#pragma unroll
  for (int off = TPT; off < 32; off <<= 1) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[g], off);
      const float lo = __shfl_xor_sync(0xffffffffu, l[g], off);
      const float mn = fmaxf(m[g], mo);
      const float mref = mn == -INFINITY ? 0.f : mn;
      const float a = fast_exp2(m[g] - mref);
      const float c = fast_exp2(mo - mref);
      l[g] = l[g] * a + lo * c;
      m[g] = mn;
#pragma unroll
      for (int d = 0; d < DPT; ++d) {
        const float other = __shfl_xor_sync(0xffffffffu, acc[g][d], off);
        acc[g][d] = acc[g][d] * a + other * c;
      }
    }
  }
  if (slot == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
#pragma unroll
        for (int e = 0; e < 8; ++e) sm_acc[warp][g][dim_of(v) + e] = acc[g][v * 8 + e];
      }
      if (lt == 0) {
        sm_m[warp][g] = m[g];
        sm_l[warp][g] = l[g];
      }
    }
  }
  __syncthreads();

  merge_warps_and_store<T, kWarps, G, D>(p, slice, &sm_m[0][0], &sm_l[0][0], &sm_acc[0][0][0]);
}

// Merges the splits of one (sequence, query head), parallel over the splits:
// a CTA of kReduceThreads reads ROWS split rows at once, each as D/4 float4s,
// so the whole [num_splits, D] slab is requested in a few dependent rounds
// instead of one round per split. The max, the weights and the row sums are
// combined in a fixed order, so the result is deterministic.
constexpr int kReduceThreads = 256;
static_assert(kMaxSplits <= kReduceThreads, "one log-sum-exp per thread");

template <typename T, int D>
__global__ void __launch_bounds__(kReduceThreads) decode_reduce_kernel(const DecodeParams p) {
  constexpr int LANES = D / 4;                  // threads covering one split row
  constexpr int ROWS = kReduceThreads / LANES;  // split rows in flight per round
  constexpr int kRedWarps = kReduceThreads / 32;
  __shared__ float sm_w[kReduceThreads];
  __shared__ float sm_warp[kRedWarps];
  __shared__ float4 sm_o[ROWS][LANES];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched early (programmatic dependent launch): wait until the split
  // kernel has finished and its partials are visible.
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const int h = blockIdx.x;
  const int b = blockIdx.y;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int S = p.num_splits;
  const int64_t row0 = (static_cast<int64_t>(b) * p.num_q_heads + h) * S;

  const float x = tid < S ? p.partial_lse[row0 + tid] : -INFINITY;
  float mx = x;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (lane == 0) sm_warp[warp] = mx;
  __syncthreads();
  mx = sm_warp[0];
#pragma unroll
  for (int w = 1; w < kRedWarps; ++w) mx = fmaxf(mx, sm_warp[w]);
  const float mref = mx == -INFINITY ? 0.f : mx;
  const float w = fast_exp2(x - mref);  // 0 for empty splits and tid >= S
  sm_w[tid] = w;
  float L = w;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
  __syncthreads();  // sm_w complete; every thread has read sm_warp (max)
  if (lane == 0) sm_warp[warp] = L;

  const int col = tid % LANES;
  const int r = tid / LANES;
  const float4* po = reinterpret_cast<const float4*>(p.partial_o + row0 * D) + col;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
  for (int s = r; s < S; s += ROWS) {
    const float ws = sm_w[s];
    const float4 v = po[static_cast<int64_t>(s) * LANES];
    acc.x = fmaf(ws, v.x, acc.x);
    acc.y = fmaf(ws, v.y, acc.y);
    acc.z = fmaf(ws, v.z, acc.z);
    acc.w = fmaf(ws, v.w, acc.w);
  }
  sm_o[r][col] = acc;
  __syncthreads();
  if (r == 0) {
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < kRedWarps; ++i) total += sm_warp[i];
    float4 o = sm_o[0][col];
#pragma unroll
    for (int i = 1; i < ROWS; ++i) {
      const float4 v = sm_o[i][col];
      o.x += v.x, o.y += v.y, o.z += v.z, o.w += v.w;
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    if (p.lse != nullptr && col == 0)
      p.lse[b * p.lse_batch_stride + h] = total > 0.f ? (mref + log2f(total)) * kLn2 : -INFINITY;
    T* op = static_cast<T*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + col * 4;
    op[0] = Convert<T>::from_float(o.x * inv);
    op[1] = Convert<T>::from_float(o.y * inv);
    op[2] = Convert<T>::from_float(o.z * inv);
    op[3] = Convert<T>::from_float(o.w * inv);
  }
}

int group_tile(int group) {
  if (group <= 1) return 1;
  if (group <= 2) return 2;
  if (group <= 4) return 4;
  return 8;
}

using DecodeKernel = void (*)(const DecodeParams);

// Benchmark-only bit above the tiling number (p.variant & 0xff): launch the
// reduction without programmatic dependent launch (worth ~0.8 us at B=1, L=32k
// on the H200).
constexpr int kVariantNoPDL = 0x200;

struct KernelInfo {
  DecodeKernel kernel = nullptr;
  DecodeKernel reduce = nullptr;
  int group_tile = 1;
  int tokens_per_iter = 32;  // tokens a CTA covers per loop iteration (split sizes are multiples)
  int smem_bytes = 0;        // dynamic shared memory
};

template <typename T, int D, int G, int TPT, int U, bool PIPE = false, int STAGES = 0>
KernelInfo info() {
  KernelInfo k;
  k.kernel = paged_decode_kernel<T, D, G, TPT, U, PIPE, STAGES>;
  k.reduce = decode_reduce_kernel<T, D>;
  k.group_tile = G;
  k.tokens_per_iter = kWarps * (32 / TPT) * U;
  k.smem_bytes = STAGES >= 2 ? STAGES * U * (D / (8 * TPT)) * 2 * kWarps * 32 * 16 : 0;
  return k;
}

// The tensor-core kernel (decode_mma.cuh): up to 16 query heads per CTA.
template <typename T, int D, int STAGES>
KernelInfo info_mma() {
  KernelInfo k;
  k.kernel = decode_mma::paged_decode_mma_kernel<T, D, STAGES>;
  k.reduce = decode_reduce_kernel<T, D>;
  k.group_tile = decode_mma::kRows;
  k.tokens_per_iter = decode_mma::kTileTokens;
  k.smem_bytes = decode_mma::Smem<D, STAGES>::kBytes;
  return k;
}

// Tilings. Registers per thread grow with G * D / TPT (q and the accumulator
// live in registers), so larger groups spread a row over more threads.
// `variant` exposes alternatives of the common G <= 2, D = 128 case for tuning.
template <typename T, int D>
KernelInfo select_for_dim(const DecodeParams& p) {
  const int g = group_tile(p.num_q_heads / p.num_kv_heads);
  const int requested = p.variant & 0xff;
  // Tiling 12: the scalar kernel's default tiling even where 0 would pick tensor cores.
  const int tiling = requested == 12 ? 0 : requested;
  if (tiling == 10) return info_mma<T, D, 3>();  // tensor cores, any group size
  if (tiling == 11) return info_mma<T, D, 2>();
  // Default kernel choice. From 3 query heads per KV head up, the scalar
  // kernel is bound by its G multiply-adds per cached element: the tensor-core
  // kernel is 1.7x (G=4) to 3.4x (G=5, 8) faster on the H200 and reaches 4.07
  // TB/s at B=32 L=4k. At G=2 the scalar kernel stays: it is ahead with few
  // sequences (B=1 L=32k: 40.1 vs 41.3 us) and, by its one-wave occupancy, with
  // short contexts (B=64 L=192: 18.6 vs 22.9 us; the engine's B=64 decode:
  // 22.5k vs 20.3k tok/s), and only 3% behind at B=64 L=8k (507 vs 494 us).
  // bench/results/nvidia-h200/decode_diag.
  if (requested == 0 && D == 128 && p.num_q_heads / p.num_kv_heads >= 3) return info_mma<T, D, 3>();
  if constexpr (D == 128) {
    switch (g) {
      case 1:
        return info<T, D, 1, 8, 2>();
      case 2:
        // Default: a row over 16 threads (one 16-byte piece each, 96 registers,
        // 5 CTAs/SM) with the next iteration's rows double-buffered in
        // registers. H200, B=1 L=32k, clean cold L2, graph replay: 40.7 us
        // against 43.6 for the former default (now 4), 42.5 for Triton; it also
        // won at B=1 L=4k, B=8 L=4k and B=64 L=8k (scripts/decode_diag.py).
        switch (tiling) {
          case 1: return info<T, D, 2, 8, 4>();
          case 2: return info<T, D, 2, 16, 2>();
          case 3: return info<T, D, 2, 16, 4>();
          case 4: return info<T, D, 2, 8, 2>();
          case 5: return info<T, D, 2, 8, 2, true>();
          case 6: return info<T, D, 2, 8, 2, false, 3>();
          case 7: return info<T, D, 2, 16, 2, false, 4>();
          case 8: return info<T, D, 2, 16, 4, false, 3>();
          case 9: return info<T, D, 2, 16, 4, true>();
          default: return info<T, D, 2, 16, 2, true>();
        }
      case 4:
        if (tiling == 7) return info<T, D, 4, 16, 2, false, 4>();
        if (tiling == 9) return info<T, D, 4, 16, 2, true>();
        return info<T, D, 4, 16, 2>();
      default:
        // G = 8 holds 2 x 64 fp32 of q and accumulator per thread: only two
        // blocks fit per SM, so variant 7 keeps the in-flight rows in shared memory.
        if (tiling == 7) return info<T, D, 8, 16, 2, false, 4>();
        return info<T, D, 8, 16, 2>();
    }
  } else {
    switch (g) {
      case 1: return info<T, D, 1, 8, 4>();
      case 2: return info<T, D, 2, 8, 4>();
      case 4: return info<T, D, 4, 8, 2>();
      default: return info<T, D, 8, 8, 2>();
    }
  }
}

KernelInfo select_kernel(const DecodeParams& p) {
  if (p.head_dim != 64 && p.head_dim != 128) return {};
  const bool d128 = p.head_dim == 128;
  switch (p.dtype) {
    case DType::kFloat16: return d128 ? select_for_dim<__half, 128>(p) : select_for_dim<__half, 64>(p);
    case DType::kBFloat16:
      return d128 ? select_for_dim<__nv_bfloat16, 128>(p) : select_for_dim<__nv_bfloat16, 64>(p);
  }
  return {};
}

// Resident blocks per SM for a kernel on the current device (cached: the
// occupancy query is host-only but not free, and decode runs once per layer
// per step). The first call per (kernel, device) also raises the kernel's
// dynamic shared-memory limit there.
int blocks_per_sm(const KernelInfo& k) {
  static std::mutex mu;
  static std::vector<std::pair<std::pair<DecodeKernel, int>, int>> cache;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) cudaGetLastError();
  const auto key = std::make_pair(k.kernel, device);
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& e : cache)
    if (e.first == key) return e.second;
  // Static + dynamic shared memory over 48 KB needs the opt-in (the 3-stage
  // tilings: 48 KB of stages + 4 KB of merge buffers).
  if (k.smem_bytes > 0 &&
      cudaFuncSetAttribute(k.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem_bytes) != cudaSuccess)
    cudaGetLastError();
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k.kernel, kWarps * 32, k.smem_bytes) != cudaSuccess) {
    cudaGetLastError();
    n = 0;
  }
  n = std::max(n, 1);
  cache.emplace_back(key, n);
  return n;
}

}  // namespace

void decode_plan(DecodeParams& p, int requested_splits) {
  const int group = p.num_q_heads / std::max(p.num_kv_heads, 1);
  const KernelInfo k = select_kernel(p);
  const int g = std::max(k.group_tile, 1);
  const int64_t gchunks = (group + g - 1) / g;
  const int64_t capacity = static_cast<int64_t>(p.max_blocks) * p.block_size;
  int64_t splits = 1;
  if (requested_splits > 0) {
    splits = requested_splits;
  } else if (k.kernel != nullptr) {
    // Fill one wave of resident blocks, not more: a second, partial wave costs
    // more than it hides (measured on the H200). Never cut a sequence into
    // pieces shorter than kMinTokensPerSplit: the merge would cost more.
    const int64_t ctas = static_cast<int64_t>(p.batch) * p.num_kv_heads * gchunks;
    const int64_t slots = static_cast<int64_t>(blocks_per_sm(k)) * std::max(p.num_sms, 1);
    if (ctas > 0 && 2 * ctas <= slots) {
      splits = slots / ctas;
      splits = std::min<int64_t>(splits, std::max<int64_t>(1, capacity / kMinTokensPerSplit));
    }
  }
  splits = std::max<int64_t>(1, std::min<int64_t>(splits, kMaxSplits));
  if (capacity == 0) {
    p.num_splits = 1;
    p.tokens_per_split = 0;
    return;
  }
  splits = std::min<int64_t>(splits, capacity);
  int64_t per_split = (capacity + splits - 1) / splits;
  const int64_t iter = std::max(k.tokens_per_iter, 1);
  if (splits > 1) per_split = (per_split + iter - 1) / iter * iter;  // whole CTA iterations
  p.tokens_per_split = static_cast<int>(per_split);
  p.num_splits = static_cast<int>((capacity + per_split - 1) / per_split);
}

cudaError_t launch_decode(const DecodeParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.num_q_heads == 0) return cudaSuccess;
  if (p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0) return cudaErrorInvalidValue;
  if (p.block_size <= 0 || (p.block_size & (p.block_size - 1)) != 0) return cudaErrorInvalidValue;
  if (p.num_splits < 1 || (p.num_splits > 1 && (!p.partial_o || !p.partial_lse)))
    return cudaErrorInvalidValue;
  if (p.batch > 65535) return cudaErrorInvalidConfiguration;
  const KernelInfo k = select_kernel(p);
  if (k.kernel == nullptr) return cudaErrorNotSupported;
  blocks_per_sm(k);  // also raises the dynamic shared-memory limit where needed
  const int gchunks = (p.num_q_heads / p.num_kv_heads + k.group_tile - 1) / k.group_tile;
  const dim3 grid(p.num_splits, p.num_kv_heads * gchunks, p.batch);
  k.kernel<<<grid, kWarps * 32, k.smem_bytes, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.num_splits == 1) return err;
  // Programmatic dependent launch (sm_90+): the reduction's CTAs are set up
  // while the split kernel drains instead of after it; griddepcontrol.wait in
  // the reduction keeps the ordering. Captured into CUDA graphs as a
  // programmatic edge.
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(p.num_q_heads, p.batch);
  cfg.blockDim = dim3(kReduceThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  if (p.cc_major >= 9 && !(p.variant & kVariantNoPDL)) {
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&cfg, k.reduce, p);
}

}  // namespace minipaged
