// Scalar paged decode kernel (CUDA cores), for GQA groups of 1-2 query heads
// (any group size when forced). Included by decode/select.cuh only.
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
//
// FP8 caches (FP8): a 16-byte piece holds 16 e4m3 elements instead of 8, so
// the same loads move twice the tokens; the pieces are widened to fp32 in
// registers (exact), the KV head's k_scale is folded into q's pre-scale and its
// v_scale into the output (merge_warps_and_store), so K and V are used as stored.
#pragma once
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "decode/common.cuh"
#include "decode/reduce.cuh"
#include "decode/trace.cuh"
#include "ptx/cp_async.cuh"
#include "ptx/misc.cuh"

namespace minipaged {
namespace {

constexpr int kWarps = 4;

// STAGES == 0: K/V rows go straight to registers (PIPE: double-buffered).
// STAGES >= 2: rows are staged through shared memory with cp.async, STAGES-1
// iterations ahead. Each thread only ever reads back the bytes it copied
// itself, so the pipeline needs cp.async.wait_group but no block barrier, and
// the in-flight data costs shared memory instead of registers.
// AHEAD >= 1 (with PIPE false, STAGES 0): a ring of AHEAD + 1 register buffers,
// the loop unrolled over the ring so that buffers are named statically: the
// rows of iteration i + AHEAD are requested before iteration i is computed, and
// no register copy waits on a load in flight (PIPE's buffer swap is a copy).
// MINB: minimum resident CTAs per SM asked of ptxas (caps the registers; 0:
// none, which is not the same as 1: ptxas then rounds to an occupancy step).
// FUSED: the last CTA of each (sequence, KV head, head chunk) merges the splits
// (fused_split_reduce) instead of a second kernel.
// PQ: packed queries (DecodeParams::cu_seqlens_q, the paged decode routing):
// a CTA of a sequence that is not a decode row returns before any load.
// WL: the work-list twin (decode_slice; DecodePlan::worklist_kernel).
template <typename T, int D, int G, int TPT, int U, bool PIPE, int STAGES, bool FP8 = false, bool FUSED = false,
          int AHEAD = 0, int MINB = 0, bool PQ = false, bool WL = false>
__global__ void __launch_bounds__(kWarps * 32, MINB)
paged_decode_kernel(const DecodeParams p) {
  using KV = std::conditional_t<FP8, uint8_t, T>;  // cache element
  constexpr int EPP = Piece<T, FP8>::kElems;      // cache elements per 16-byte piece
  constexpr int VEC = D / (EPP * TPT);  // 16-byte pieces per thread per token row
  static_assert(VEC >= 1 && VEC * EPP * TPT == D, "TPT must divide D / (elements per 16 bytes)");
  static_assert(AHEAD == 0 || (!PIPE && STAGES == 0), "the register ring replaces PIPE / STAGES");
  constexpr int DPT = EPP * VEC;       // elements of a row held by one thread
  constexpr int SLOTS = 32 / TPT;      // tokens a warp covers per load
  constexpr int TOK_WARP = SLOTS * U;  // tokens per warp per iteration
  constexpr int TOK_CTA = kWarps * TOK_WARP;

  __shared__ float sm_m[kWarps][G];
  __shared__ float sm_l[kWarps][G];
  __shared__ float sm_acc[kWarps][G][D];
  extern __shared__ uint4 stage_smem[];  // [STAGES][U][VEC][2][threads], STAGES >= 2 only
  decode_trace(kTrEntry);
  decode_trace(kTrSm);

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int slot = lane / TPT;
  const int lt = lane % TPT;

  static_assert(!(PQ && FUSED), "packed queries run the two-launch reduction");
  static_assert(!(WL && FUSED), "work lists run the two-launch reduction");
  DecodeSlice slice = decode_slice<PQ, false, WL>(p, G);
  // A split past its sequence's splits returns before it requests anything (CTA-uniform).
  if (decode_split_unused(slice)) {
    decode_trace(kTrExit);
    return;
  }
  const int log2_bs = __ffs(p.block_size) - 1;
  const int32_t* bt = p.block_tables + slice.b * p.block_table_stride;
  // The first pages of the run a split of a table-filling sequence covers
  // (DecodeParams::tokens_per_split), requested before context_lens arrives, and so before
  // the skip test; fetched again below (CTA-uniform) when this sequence's run differs.
  const int guess_start = slice.split * p.tokens_per_split;
  const int guess_end = min(slice.capacity, guess_start + p.tokens_per_split);
  // The guessed pages of the token groups of iteration `it` of the run.
  auto guess_pages = [&](int it, int (&pg)[U]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int tok = guess_start + it * TOK_CTA + warp * TOK_WARP + u * SLOTS + slot;
      pg[u] = tok < guess_end ? __ldg(bt + (tok >> log2_bs)) : 0;
    }
  };
  int page[U];  // pages of the next token groups to be loaded
  guess_pages(0, page);
  const int kvh = slice.kvh, h0 = slice.h0, ng = slice.ng;

  // Element offset of this thread's v-th 16-byte piece inside a row: the TPT
  // lanes of a slot read 16*TPT contiguous bytes per instruction.
  auto dim_of = [&](int v) { return v * TPT * EPP + lt * EPP; };

  if (decode_slice_skipped<PQ>(slice)) {  // CTA-uniform, before any barrier
    decode_trace(kTrExit);
    return;
  }
  float q[G][DPT];
  {
    const T* qp = static_cast<const T*>(p.q) + slice.row * p.q_batch_stride + h0 * p.q_head_stride;
    float qscale = p.scale * kLog2e;
    if constexpr (FP8) qscale *= p.k_scale[kvh];
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
#pragma unroll
        for (int e = 0; e < EPP; ++e) {
          q[g][v * EPP + e] =
              g < ng ? Convert<T>::to_float(qp[g * p.q_head_stride + dim_of(v) + e]) * qscale : 0.f;
        }
      }
    }
  }
  const int start = slice.start, end = slice.end;
  // Block-table reads are bounded by the split's run in the table, not by ctx; entries past
  // ctx are read but never followed.
  const int table_end = slice.table_end;

  float acc[G][DPT];
  float m[G], l[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int d = 0; d < DPT; ++d) acc[g][d] = 0.f;
  }

  const int bs_mask = p.block_size - 1;
  const KV* kbase = static_cast<const KV*>(p.k_cache) + kvh * p.k_head_stride + lt * EPP;
  const KV* vbase = static_cast<const KV*>(p.v_cache) + kvh * p.v_head_stride + lt * EPP;

  // Issues the K/V row loads of the U token groups at `base` (pages already known).
  auto issue = [&](int base, const int (&pg)[U], uint4 (&kr)[U][VEC], uint4 (&vr)[U][VEC]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int tok = base + u * SLOTS + slot;
      if (tok < end) {
        const int64_t in_page = tok & bs_mask;
        const KV* kp = kbase + pg[u] * p.k_block_stride + in_page * p.k_token_stride;
        const KV* vp = vbase + pg[u] * p.v_block_stride + in_page * p.v_token_stride;
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          kr[u][v] = ld_stream_16(kp + v * TPT * EPP);
          vr[u][v] = ld_stream_16(vp + v * TPT * EPP);
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
      const KV* kp = valid ? kbase + pg[u] * p.k_block_stride + in_page * p.k_token_stride : kbase;
      const KV* vp = valid ? vbase + pg[u] * p.v_block_stride + in_page * p.v_token_stride : vbase;
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        cp_async_16(staged(st, u, v, 0), kp + v * TPT * EPP, valid);
        cp_async_16(staged(st, u, v, 1), vp + v * TPT * EPP, valid);
      }
    }
  };

  // One iteration's online-softmax update with the K/V rows of the U token
  // groups at `base`: the body of both the register ring (AHEAD >= 1) and the
  // PIPE / STAGES loop.
  auto consume = [&](int base, const uint4 (&kr)[U][VEC], const uint4 (&vr)[U][VEC]) {
    float s[G][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int g = 0; g < G; ++g) s[g][u] = 0.f;
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        float kf[EPP];
        Piece<T, FP8>::to_float(kr[u][v], kf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
          for (int e = 0; e < EPP; ++e) s[g][u] = fmaf(q[g][v * EPP + e], kf[e], s[g][u]);
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
        if (base + u * SLOTS + slot >= end) s[g][u] = -INFINITY;
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
        float vf[EPP];
        Piece<T, FP8>::to_float(vr[u][v], vf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
          for (int e = 0; e < EPP; ++e) acc[g][v * EPP + e] = fmaf(pr[g][u], vf[e], acc[g][v * EPP + e]);
        }
      }
    }
  };

  int tok_base = start + warp * TOK_WARP;
  [[maybe_unused]] const int start_tok = tok_base;  // decode_trace's first-iteration test
  uint4 kr[U][VEC], vr[U][VEC];
  int stage = 0;
  if (start != guess_start || table_end != guess_end) fetch_pages(tok_base, page);
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

  if constexpr (AHEAD >= 1) {
    uint4 rk[AHEAD + 1][U][VEC], rv[AHEAD + 1][U][VEC];
#pragma unroll
    for (int a = 0; a < AHEAD; ++a) {
      issue(tok_base + a * TOK_CTA, page, rk[a], rv[a]);
      fetch_pages(tok_base + (a + 1) * TOK_CTA, page);
    }
    while (tok_base < end) {
#pragma unroll
      for (int r = 0; r <= AHEAD; ++r) {
        if (tok_base < end) {
          issue(tok_base + AHEAD * TOK_CTA, page, rk[(r + AHEAD) % (AHEAD + 1)], rv[(r + AHEAD) % (AHEAD + 1)]);
          fetch_pages(tok_base + (AHEAD + 1) * TOK_CTA, page);
          consume(tok_base, rk[r], rv[r]);
          tok_base += TOK_CTA;
        }
      }
    }
  }
  // The PIPE / STAGES loop (compiled out under the ring, which has consumed every token).
  for (; AHEAD == 0 && tok_base < end; tok_base += TOK_CTA) {
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
    if (tok_base + TOK_CTA >= end) decode_trace(kTrLastTile);  // thread 0's rows of it landed
    consume(tok_base, kr, vr);
    if (tok_base == start_tok) decode_trace(kTrFirstTile);
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
  decode_trace(kTrLoopDone);
  // Let the reduction grid launch while this one drains (unless decode_slice did at the
  // start); it still waits for this grid's completion (griddep_wait) before reading partials.
  if (!decode_early_trigger(p)) griddep_launch_dependents();

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
        for (int e = 0; e < EPP; ++e) sm_acc[warp][g][dim_of(v) + e] = acc[g][v * EPP + e];
      }
      if (lt == 0) {
        sm_m[warp][g] = m[g];
        sm_l[warp][g] = l[g];
      }
    }
  }
  __syncthreads();

  if constexpr (FP8) {
    merge_warps_and_store<T, kWarps, G, D, true, IdentityDim, WL>(p, slice, &sm_m[0][0], &sm_l[0][0],
                                                                   &sm_acc[0][0][0], p.v_scale[kvh]);
  } else {
    merge_warps_and_store<T, kWarps, G, D, false, IdentityDim, WL>(p, slice, &sm_m[0][0], &sm_l[0][0],
                                                                    &sm_acc[0][0][0]);
  }
  if constexpr (FUSED) {
    // The merge buffers are free once the partials are stored: weights in sm_acc, max / sum in sm_m / sm_l.
    static_assert(kWarps * D >= kMaxSplits, "sm_acc holds G rows of split weights");
    if (slice.num_splits > 1) fused_split_reduce<T, D, kWarps * 32>(p, slice, &sm_acc[0][0][0], &sm_m[0][0], &sm_l[0][0]);
  }
  decode_trace(kTrExit);
}

}  // namespace
}  // namespace minipaged
