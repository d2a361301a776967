// sm_90a warp-specialised prefill (issue #16): TMA ring, warp specialisation
// with setmaxnreg, ping-pong scheduling of the two consumer warpgroups and
// intra-warpgroup overlap of the two GEMMs with the softmax.
//
// CTA = 3 warpgroups, BLOCK_M = 128 query rows, BLOCK_N keys per tile:
//   warpgroup 0 (producer): gives its registers away (setmaxnreg.dec); one
//     thread issues every TMA load: Q once, then K_t and V_t of each tile into
//     a kStages-deep ring. The other 127 threads exit.
//   warpgroups 1, 2 (consumers): take the registers (setmaxnreg.inc); each owns
//     64 query rows and runs wgmma + online softmax on them (S = Q K^T from
//     shared memory, P kept in registers as the A operand of O += P V).
//
// Synchronisation, per ring slot s (all mbarriers in shared memory):
//   k_full[s], v_full[s]   1 arrival (the producer's expect_tx) + the tile's
//                          TMA bytes; consumers wait on them.
//   k_empty[s], v_empty[s] one arrival per consumer warp, after its wgmma that
//                          read the slot retired; the producer waits on them
//                          before it overwrites the slot.
//   q_full                 Q of the block, waited once per work item.
//   q_empty                (persistent only) one arrival per consumer warp once
//                          the item's last QK^T retired: Q may be reloaded.
//   item_full / item_empty (dynamic persistent only) the item-id ring: the
//                          producer's one arrival / every consumer thread's.
// K and V of a tile have separate barriers so S = Q K^T can start before V
// lands and K's slot is handed back before P V runs.
//
// Persistent (WsCfg kPersistent): a grid of one CTA per SM walks the work
// items (head, batch, m-block) with a stride of gridDim.x, heaviest m-blocks
// first; producer and consumers compute the same item sequence, skip the same
// empty ones, and keep counting ring tiles and items across them, so every
// barrier parity continues where the last item left it. kDynamic: after the
// first wave the producer takes item ids from a global counter and passes each
// to the consumers through a 2-slot ring in shared memory (item_full /
// item_empty mbarriers; -1 ends the walk). kStagedO: O goes through a buffer
// of its own into coalesced 16-byte stores.
//
// Consumer schedules (WsCfg flags, each one step of the ablation):
//   serial      per tile: QK^T, wait, softmax, PV, wait.
//   pipelined   one "GEMM phase" per tile issues QK^T(t) and PV(t-1) together;
//               the O rescale of tile t waits until PV(t-1) has retired.
//     + kOverlap   wait only for QK^T(t) (wgmma.wait_group 1): the softmax of
//                  tile t runs while PV(t-1) is still on the tensor cores.
//     + kPingPong  named barriers 3 and 4 hand the GEMM phase back and forth
//                  between the two consumer warpgroups, so one warpgroup's
//                  softmax runs under the other's GEMMs instead of both
//                  competing for the tensor cores at the same moment.
//   kWide       either schedule with N = 128 wgmma instructions (QK^T over the
//               128-key tile, PV over D = 128) instead of pairs of N = 64 ones.
//
// Tiles run from the last key tile to the first, as in the cp.async kernel:
// the diagonal / tail tiles that need masking come first, then unmasked ones.
//
// Tensor maps (host: make_ws_tensor_map) are 4-D (D, rows, heads, batch),
// box (64, box rows, 1, 1), 128-byte swizzle: one box is one 64-column block
// of the canonical sw128 layout the wgmma descriptors expect. Rows past the
// tensor's end are zero-filled by TMA. Varlen uses batch extent 1 and rows =
// total tokens; a tile's rows past its own sequence then read the next
// sequence's (finite) K/V, which the mask turns into P = 0.
//
// Paged K/V (WsCfg kPaged; launch_prefill_ws_paged): the caches
// [num_blocks, block_size, Hkv, D] are 5-D maps (make_ws_paged_map) whose box
// is a page's min(block_size, BLOCK_N) keys over every 64-column block, laid
// out as interleaved atoms (WsCfg::kKvInterleave), and warp 0 of the producer
// warpgroup loads a key tile as one box per page (lane i: page i of the tile,
// read from the block table one tile ahead). Block sizes >= 8 only: the
// 128-byte swizzle pattern is defined for a destination on a 1024-byte
// boundary (PTX ISA, "Swizzling Modes": base offset (dstMem / 128) % 8
// otherwise), and a page's run of >= 8 keys starts on an atom, so the boxes of
// a tile lay it out exactly as the descriptors read it (block_size >= BLOCK_N:
// one box, the key-group coordinate is the tile's offset inside its page). Table entries past
// ceil(context_len / block_size) are never read and their boxes not issued
// (expect_tx counts the boxes issued). Only key tile 0 (the first one walked)
// can reach past context_len: its V rows from there on (stale page slots, or
// never written) are zeroed by the producer warp after the TMA lands, because
// P = 0 times a NaN there would still be NaN; K rows there are masked.
// The grid is a flat work list (blockIdx.y): the (sequence, m-block) pairs of
// the sequences the launch owns (PrefillParams::qlen_filter), found by a warp
// scan of cu_seqlens_q, so the decode rows of a mixed batch cost no CTAs here.
//
// FP8 pages (WsCfg kKv8, e4m3 caches with per-KV-head scales): wgmma reads both
// operands of Q K^T and V's of P V from shared memory in q's 16-bit type, so
// the pages are widened there. Warp 0 of the producer warpgroup loads a key
// tile's pages as bytes into a 2-slot staging ring (sk_full / sv_full: TMA
// bytes; sk_empty / sv_empty: the widening warps are done with the slot), one
// 4-D box per page, [keys][D bytes]. Warps 1-3 (the 96 threads the 16-bit
// producer leaves idle) widen each staged tile into the 16-bit ring slot once
// the consumers released it (k_empty / v_empty), in the interleaved sw128
// layout the TMA boxes would have written: cvt.rn.f16x2.e4m3x2, then for bf16
// two exact widenings to fp32 and one narrowing. Keys at or past seqlen_k
// become zeros (no v_tail fix-up), the stores are fenced into the async proxy
// and each widening warp arrives once on k_full / v_full. The consumers are the
// 16-bit ones: k_scale of the KV head folds into the score scale, v_scale into
// 1/l of the epilogue. Two 16-bit ring stages plus two staging stages fit the
// shared memory that three 16-bit stages take (225 KB).
#pragma once
#include <cuda.h>  // CUtensorMap and the encode enums (types only: no -lcuda)
#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "params.h"
#include "prefill/common.cuh"
#include "prefill/mainloop_wgmma.cuh"  // sw128_off, the descriptor conventions
#include "prefill/softmax.cuh"
#include "ptx/fp8.cuh"
#include "ptx/tensor_map.h"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"

// FP8 producer widening (WsCfg::kKv8), A/B knobs: MINIPAGED_WS8_WIDEN 1 converts with cvt, 2 on the
// integer pipe (ptx/fp8.cuh fp8x8_widen_int; measured slower); _INFLIGHT 16-byte units per thread
// in flight (4 needs the 56 producer registers below); _UNROLL 0 unrolls the unit loop
// (bench/results/nvidia-h200/ws_fp8_928f617/, ws8_ab_6230e97/).
#ifndef MINIPAGED_WS8_WIDEN
#define MINIPAGED_WS8_WIDEN 1
#endif
#ifndef MINIPAGED_WS8_INFLIGHT
#define MINIPAGED_WS8_INFLIGHT 4
#endif
#ifndef MINIPAGED_WS8_UNROLL
#define MINIPAGED_WS8_UNROLL 1
#endif
// FP8 producer registers (multiple of 8); the consumers get what is left: 40 -> 232, 56 -> 224.
#ifndef MINIPAGED_WS8_PRODUCER_REGS
#define MINIPAGED_WS8_PRODUCER_REGS 56
#endif
// 1: FP8 pages under a bf16 q multiply in f16 (WsCfg::Tm; q moved into f16's range per warp).
#ifndef MINIPAGED_WS8_F16_MMA
#define MINIPAGED_WS8_F16_MMA 1
#endif

namespace minipaged {
namespace fast {

template <typename T_, int kD_, int kBlockN_ = 128, int kStages_ = 2, bool kPingPong_ = true, bool kOverlap_ = true,
          bool kPipelined_ = true, bool kPaged_ = false, bool kPersistent_ = false, bool kDynamic_ = false,
          bool kStagedO_ = false, bool kWide_ = false, bool kKvInterleave_ = kPaged_, bool kL2Sections_ = false,
          bool kKv8_ = false, bool kMirror_ = false>
struct WsCfg {
  using T = T_;
  static constexpr int kD = kD_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr bool kPipelined = kPipelined_ || kPingPong_ || kOverlap_;
  static constexpr bool kPingPong = kPingPong_;
  static constexpr bool kOverlap = kOverlap_;
  static constexpr bool kPaged = kPaged_;
  // Persistent: one CTA per SM walks work items (head, batch, m-block), the
  // heaviest causal m-blocks first; Q is handed back to the producer as soon as
  // an item's last QK^T retired, so the next item's Q and K/V loads run under
  // the current item's last softmax, PV and epilogue (O goes straight from
  // registers to global memory).
  static constexpr bool kPersistent = kPersistent_;
  static_assert(!(kPaged && kPersistent), "the paged work list is not persistent");
  // Persistent refinements (ablation): kDynamic hands items out through a
  // global counter (the producer takes the next one when it has issued the
  // current item's loads; items still go heaviest first) instead of the
  // static stride; kStagedO stages O in a buffer of its own, so the epilogue
  // writes coalesced 16-byte rows although Q's buffer holds the next item.
  static constexpr bool kDynamic = kDynamic_;
  static constexpr bool kStagedO = kStagedO_;
  static_assert(kPersistent || !(kDynamic || kStagedO), "persistent refinements");
  // kWide: N = 128 wgmma instructions where the tile allows (QK^T over 128
  // keys, PV over D = 128) instead of pairs of N = 64 ones, so each reads its
  // A operand (Q from shared memory, P from registers) once.
  static constexpr bool kWideQK = kWide_ && kBlockN_ == 128;
  static constexpr bool kWidePV = kWide_ && kD_ == 128;
  // K/V tile layout in shared memory, as 1024-byte sw128 atoms of 8 keys x 64
  // columns. Panels (dense): column block c holds keys 0..kBlockN-1, atom
  // (group g, c) at c * kBlockN * 128 + g * 1024, which one box of kBlockN
  // rows per column block writes. Interleaved (paged): atom (g, c) at
  // (g * kColBlocks + c) * 1024, so a page's keys over every column block are
  // one contiguous run that one 5-D box writes (one TMA per page instead of
  // one per page and column block). The wgmma descriptors take either: the
  // 8-key group stride is their SBO, the column-block stride V's LBO.
  static constexpr bool kKvInterleave = kKvInterleave_;
  // The dense/varlen grid walks its items in L2 sections of whole GQA groups
  // (ws_item), so that a wave's K/V stay in L2 when all of them do not fit
  // (prefill/dispatch.cuh, CfgWsL2).
  static constexpr bool kL2Sections = kL2Sections_;
  static_assert(!kL2Sections || (!kPaged_ && !kPersistent_), "sections: the dense/varlen grid only");
  static_assert(!kKvInterleave || kPaged_, "only the paged producer writes interleaved tiles");
  // kMirror: a CTA owns two 64-row blocks of one (sequence, head) from opposite ends of the
  // sequence, block M-1-i for warpgroup 0 and block i for warpgroup 1 (M = ceil(seqlen_q / 64),
  // i = the CTA's pair index), instead of 128 consecutive rows. Under causal masking block i's
  // keys are a prefix of block M-1-i's, so one stream of key tiles (block M-1-i's, walked from
  // the top) serves both: warpgroup 1 passes the tiles above its own keys through empty
  // ping-pong phases (it waits for each slot to fill and releases it) and computes the rest.
  // Every CTA then carries about the same work, where consecutive rows make the last block's
  // CTA twice as long as the average: what bounds a causal grid of about one wave
  // (B=1 N=1k: 16 heads x 8 blocks on 132 SMs). Q arrives as two 64-row boxes. Dispatched for
  // dense/varlen grids and 16-bit paged work lists of at most one wave (prefill/dispatch.cuh); over
  // FP8 pages (kKv8: the widening warps fill the ring as for any tile) a selftest variant
  // (scripts/paged_ws_selftest.cu ws_fp8_mirror, time1w) until measured.
  static constexpr bool kMirror = kMirror_;
  static_assert(!kMirror || (!kPersistent_ && !kL2Sections_ && (kPingPong_ || kOverlap_ || kPipelined_)),
                "mirrored pairs: a grid (dense, varlen or paged), a pipelined schedule");
  // FP8 pages (e4m3 caches, PrefillParams::kv_fp8): warp 0 of the producer warpgroup loads each
  // key tile's pages as bytes into a staging ring of kStStages K and V byte tiles (one TMA box
  // per page, [keys][kD bytes], no swizzle); warps 1-3 widen them to T in registers and store
  // them into the T ring in the layout the descriptors read, zeros for keys at or past
  // seqlen_k. The consumers are the 16-bit ones, with k_scale folded into the score scale and
  // v_scale into 1/l.
  static constexpr bool kKv8 = kKv8_;
  // The MMA operand type. FP8 pages under a bf16 q may multiply in f16 (MINIPAGED_WS8_F16_MMA): the
  // widening is then one cvt per pair instead of four conversions, and each consumer warp moves its
  // 16 rows of Q in shared memory into f16's range by a power of two (kQToF16) that its score
  // scale undoes, as the mma.sync FP8 kernels do.
  using Tm = std::conditional_t<kKv8_ && MINIPAGED_WS8_F16_MMA != 0, __half, T_>;
  static constexpr bool kQToF16 = !std::is_same_v<Tm, T_>;
  static_assert(!kKv8 || (kPaged_ && kKvInterleave_), "FP8 pages: the paged kernel, interleaved tiles");
  static constexpr int kStStages = kKv8 ? 2 : 0;
  static constexpr int kStTileBytes = kBlockN_ * kD_;  // one staged K or V tile of e4m3 bytes
  static constexpr int kWidenWarps = 3;
  static constexpr int kKvGroupStride = kKvInterleave ? (kD_ / 64) * 1024 : 1024;
  static constexpr int kKvColStride = kKvInterleave ? 1024 : kBlockN_ * 128;
  static constexpr int kConsumerWGs = 2;
  static constexpr int kConsumerWarps = 4 * kConsumerWGs;
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  static constexpr int kBlockM = 64 * kConsumerWGs;
  static constexpr int kChunks = kD / 8;
  static constexpr int kColBlocks = kD / 64;
  // 128 * 24 + 256 * 240 = 64512 of the SM's 65536 registers (one CTA per SM); FP8 pages move 16
  // of them to the producer warps, which widen two 16-byte units at a time (128 * 40 + 256 * 232).
  static constexpr int kProducerRegs = kKv8 ? MINIPAGED_WS8_PRODUCER_REGS : 24;
  static constexpr int kConsumerRegs = kKv8 ? (252 - MINIPAGED_WS8_PRODUCER_REGS / 2) / 8 * 8 : 240;
  static constexpr int kTileBytes = kBlockN * kD * 2;  // one K or one V tile
  static constexpr int kQBytes = kBlockM * kD * 2;
  static constexpr int kQBoxRows = kMirror ? 64 : kBlockM;  // rows of one Q box (per column block)
  // Layout from the 1024-aligned base: Q | K ring | V ring | [O] | mbarriers | [item ids].
  static constexpr int kKOff = kQBytes;
  static constexpr int kVOff = kKOff + kStages * kTileBytes;
  static constexpr int kStOff = kVOff + kStages * kTileBytes;  // FP8: staged K tiles, then staged V tiles
  static constexpr int kOOff = kStOff + 2 * kStStages * kStTileBytes;
  static constexpr int kBarOff = kOOff + (kStagedO ? kQBytes : 0);
  // Paged: one more, v_tail (the V TMA of key tile 0 when it needs zeroing).
  // Persistent: one more, q_empty (both consumer warpgroups are done with Q).
  // Dynamic: item_full / item_empty of a 2-slot ring of item ids.
  static constexpr int kItemSlots = 2;
  // FP8: sk_full / sv_full / sk_empty / sv_empty per staging slot.
  static constexpr int kNumBars = 1 + 4 * kStages + (kPaged || kPersistent ? 1 : 0) + (kDynamic ? 2 * kItemSlots : 0) +
                                  4 * kStStages;
  static constexpr int kItemOff = kBarOff + 8 * kNumBars;
  static constexpr int kSmemBytes = kItemOff + (kDynamic ? 4 * kItemSlots : 0) + 1024;  // +1024: base realignment
  // Named barriers: 0 is __syncthreads; 1, 2: per-consumer-warpgroup epilogue;
  // 3, 4: the ping-pong scheduler (warpgroup w waits on 3 + w before its GEMMs).
  static constexpr int kBarEpilogue = 1;
  static constexpr int kBarSched = 3;
  static_assert(kD == 64 || kD == 128, "head dim");
  static_assert(kBlockN == 64 || kBlockN == 128, "key tile (S: 32 or 64 registers per thread)");
  static_assert(kStages >= 2, "ring");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory per block");
};

struct WsParams {
  PrefillParams p;
  CUtensorMap tm_q, tm_k, tm_v;
  // Dynamic persistent configs: {next item past the first wave, CTAs done},
  // both zero at launch; the last CTA to finish zeroes them again.
  int* sched;
  // kL2Sections: (batch, q head) pairs per section of the work list (ws_item).
  int section_hb;
};

// kL2Sections work item w (of m_blocks * batch * num_q_heads) -> (q head,
// batch, m-block): the (batch, q head) pairs in sections of section_hb
// consecutive pairs (whole GQA groups), one section's items before the next
// section's, and within a section every pair's last (under causal the
// heaviest) m-block first, pairs fastest.
__device__ __forceinline__ void ws_item(int w, int m_blocks, int num_q_heads, int batch, int section_hb, int& head,
                                        int& b, int& m_block) {
  const int hb_total = batch * num_q_heads;
  const int section = w / (section_hb * m_blocks);
  const int first = section * section_hb;
  const int size = min(section_hb, hb_total - first);
  const int within = w - first * m_blocks;
  const int rank = within / size;
  const int hb = first + (within - rank * size);
  head = hb % num_q_heads;
  b = hb / num_q_heads;
  m_block = m_blocks - 1 - rank;
}

// Whether sequence `ql` rows long belongs to this launch (qlen_filter).
__device__ __forceinline__ bool ws_owned(const PrefillParams& p, int ql) {
  return ql > 0 && (p.qlen_filter == 0 || ((ql <= abs(p.qlen_filter)) == (p.qlen_filter > 0)));
}

// Work item w of a paged launch (warp-collective, every lane active): the
// owned sequences' m-blocks in sequence order, each sequence's last (under
// causal the heaviest) block first. false: w is past the list.
template <int kBlockM>
__device__ __forceinline__ bool ws_paged_work_item(const PrefillParams& p, int w, int& batch, int& m_block) {
  const int lane = threadIdx.x & 31;
  int base = 0;  // blocks of the sequences before this group of 32
  for (int b0 = 0; b0 < p.batch; b0 += 32) {
    const int b = b0 + lane;
    int blocks = 0;
    if (b < p.batch) {
      const int ql = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
      blocks = ws_owned(p, ql) ? (ql + kBlockM - 1) / kBlockM : 0;
    }
    int incl = blocks;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    const int total = __shfl_sync(0xffffffffu, incl, 31);
    if (w < base + total) {
      const int src = __ffs(__ballot_sync(0xffffffffu, w < base + incl)) - 1;
      const int first = base + __shfl_sync(0xffffffffu, incl - blocks, src);
      const int n = __shfl_sync(0xffffffffu, blocks, src);
      batch = b0 + src;
      m_block = n - 1 - (w - first);
      return true;
    }
    base += total;
  }
  return false;
}

template <class Cfg, bool kCausal>
__global__ void __launch_bounds__(Cfg::kThreads, 1) prefill_ws_kernel(const __grid_constant__ WsParams wp) {
#if MINIPAGED_WGMMA_DEVICE
  using T = typename Cfg::T;
  using Tm = typename Cfg::Tm;  // the MMA operand type (T unless Cfg::kQToF16)
  constexpr int kD = Cfg::kD;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kStages = Cfg::kStages;
  constexpr int kNT = kBlockN / 8;
  constexpr int kCB = Cfg::kColBlocks;
  const PrefillParams& p = wp.p;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t raw_u32 = smem_u32(smem_raw);
  const uint32_t smem_base = (raw_u32 + 1023u) & ~1023u;  // sw128 atoms need 1024-byte alignment
  unsigned char* smem_ptr = smem_raw + (smem_base - raw_u32);
  const uint32_t s_q = smem_base;
  const uint32_t bars = smem_base + Cfg::kBarOff;
  auto q_full = [&] { return bars; };
  auto k_full = [&](int s) { return bars + 8u * (1 + s); };
  auto v_full = [&](int s) { return bars + 8u * (1 + kStages + s); };
  auto k_empty = [&](int s) { return bars + 8u * (1 + 2 * kStages + s); };
  auto v_empty = [&](int s) { return bars + 8u * (1 + 3 * kStages + s); };
  auto v_tail = [&] { return bars + 8u * (1 + 4 * kStages); };   // paged only
  auto q_empty = [&] { return bars + 8u * (1 + 4 * kStages); };  // persistent only (never both)
  auto item_full = [&](int i) { return bars + 8u * (2 + 4 * kStages + i); };  // dynamic only
  auto item_empty = [&](int i) { return bars + 8u * (2 + 4 * kStages + Cfg::kItemSlots + i); };
  volatile int* item_ids = reinterpret_cast<volatile int*>(smem_ptr + Cfg::kItemOff);
  auto k_slot = [&](int s) { return smem_base + Cfg::kKOff + s * Cfg::kTileBytes; };
  auto v_slot = [&](int s) { return smem_base + Cfg::kVOff + s * Cfg::kTileBytes; };
  // FP8 only: the staging ring of e4m3 tiles and its barriers (after v_tail).
  constexpr int kSt = Cfg::kStStages;
  auto sk_full = [&](int st) { return bars + 8u * (2 + 4 * kStages + st); };
  auto sv_full = [&](int st) { return bars + 8u * (2 + 4 * kStages + kSt + st); };
  auto sk_empty = [&](int st) { return bars + 8u * (2 + 4 * kStages + 2 * kSt + st); };
  auto sv_empty = [&](int st) { return bars + 8u * (2 + 4 * kStages + 3 * kSt + st); };
  auto st_k = [&](int st) { return smem_base + Cfg::kStOff + st * Cfg::kStTileBytes; };
  auto st_v = [&](int st) { return smem_base + Cfg::kStOff + (kSt + st) * Cfg::kStTileBytes; };

  const int tid = threadIdx.x;
  // Warp-uniform by construction (a broadcast from lane 0), so the compiler can keep the
  // warpgroup index and everything derived from it (descriptors, barrier addresses, ring
  // slots) in uniform registers instead of per-thread ones.
  const int warp = __shfl_sync(0xffffffffu, tid / 32, 0);
  const int lane = tid % 32;

  // The work item's geometry: set once from blockIdx, or per item by a
  // persistent CTA (the lambdas below read these by reference).
  int head = 0, batch = 0, m_start = 0, q_begin = 0, k_begin = 0, seqlen_q = 0, seqlen_k = 0;
  int kv_head = 0, m_rows = 0, diag = 0, n_end = 0, n_tiles = 0;
  // Cfg::kMirror: the first row and the row count of warpgroup 1's block (warpgroup 0's are
  // m_start and m_rows; 0 rows when the pair is the middle block of an odd count).
  int m_start1 = 0, m_rows1 = 0;
  T* o_ptr = nullptr;
  // false: the m-block (kMirror: the pair of blocks) starts past its sequence's last query row
  // (nothing to do).
  auto set_item = [&](int h, int b, int m_block) -> bool {
    head = h;
    batch = b;
    const SeqInfo seq = seq_info<Cfg::kPaged>(p, batch);
    q_begin = seq.q_begin, k_begin = seq.k_begin;
    seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    if constexpr (Cfg::kMirror) {
      const int blocks64 = (seqlen_q + 63) / 64;
      if (2 * m_block >= blocks64) return false;
      m_start = (blocks64 - 1 - m_block) * 64;
      m_rows = min(64, seqlen_q - m_start);
      m_start1 = m_block * 64;
      m_rows1 = m_start1 == m_start ? 0 : 64;  // below the last block: a whole one
    } else {
      m_start = m_block * kBlockM;
      if (m_start >= seqlen_q) return false;
      m_rows = min(kBlockM, seqlen_q - m_start);
    }
    kv_head = head / (p.num_q_heads / p.num_kv_heads);
    o_ptr = static_cast<T*>(p.o) + batch * p.o_batch_stride + int64_t(q_begin) * p.o_row_stride +
            head * p.o_head_stride;
    diag = seqlen_k - seqlen_q;
    n_end = seqlen_k;
    // (kMirror: warpgroup 0's block is the later one, so its keys cover warpgroup 1's)
    if (kCausal) n_end = min(n_end, m_start + m_rows + diag);
    n_tiles = n_end > 0 ? (n_end + kBlockN - 1) / kBlockN : 0;
    return true;
  };
  // No row of the item sees a key: zeros (and -inf lse), no pipeline at all.
  auto write_empty_rows = [&](int row0, int rows, int t0, int threads) {
    for (int idx = t0; idx < rows * Cfg::kChunks; idx += threads) {
      const int r = idx / Cfg::kChunks, c = idx % Cfg::kChunks;
      *reinterpret_cast<uint4*>(o_ptr + int64_t(row0 + r) * p.o_row_stride + c * 8) = make_uint4(0, 0, 0, 0);
    }
    write_empty_lse(p, batch, head, q_begin + row0, rows, t0, threads);
  };
  auto write_empty_item = [&](int t0, int threads) {
    write_empty_rows(m_start, m_rows, t0, threads);
    if constexpr (Cfg::kMirror) write_empty_rows(m_start1, m_rows1, t0, threads);
  };
  auto tile_n0 = [&](int t) { return (n_tiles - 1 - t) * kBlockN; };
  // Persistent work list: item w = (m-block rank, then batch, then head), rank
  // 0 the last m-block (under causal the heaviest) of every sequence.
  const int m_blocks_max = (p.max_seqlen_q + kBlockM - 1) / kBlockM;
  const int num_items = m_blocks_max * p.batch * p.num_q_heads;
  auto set_item_w = [&](int w) -> bool {
    const int hb = p.batch * p.num_q_heads;
    const int rank = w / hb, rest = w - rank * hb;
    return set_item(rest % p.num_q_heads, rest / p.num_q_heads, m_blocks_max - 1 - rank);
  };

  if constexpr (!Cfg::kPersistent) {
    int b = blockIdx.y;
    // heaviest causal blocks first (kMirror: pair 0 holds the last block)
    int m_block = Cfg::kMirror ? int(blockIdx.z) : int(gridDim.z - 1 - blockIdx.z);
    int h = blockIdx.x;
    if constexpr (Cfg::kPaged) {
      if (!ws_paged_work_item<kBlockM>(p, blockIdx.y, b, m_block)) return;
    } else if constexpr (Cfg::kL2Sections) {
      // The grid issues its CTAs in linear block order: that order is the work list's.
      const int w = int(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
      ws_item(w, int(gridDim.z), p.num_q_heads, p.batch, wp.section_hb, h, b, m_block);
    }
    if (!set_item(h, b, m_block)) return;
    if (n_end <= 0) {
      write_empty_item(tid, Cfg::kThreads);
      return;
    }
  }

  if (tid == 0) {
    mbar_init(q_full(), 1);
    // FP8: the widening warps fill the ring, one arrival each; else the TMA's expect_tx.
    constexpr uint32_t kFillArrivals = Cfg::kKv8 ? Cfg::kWidenWarps : 1;
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(k_full(s), kFillArrivals);
      mbar_init(v_full(s), kFillArrivals);
      mbar_init(k_empty(s), Cfg::kConsumerWarps);
      mbar_init(v_empty(s), Cfg::kConsumerWarps);
    }
    if constexpr (Cfg::kPaged) mbar_init(v_tail(), 1);
#pragma unroll
    for (int st = 0; st < kSt; ++st) {
      mbar_init(sk_full(st), 1);
      mbar_init(sv_full(st), 1);
      mbar_init(sk_empty(st), Cfg::kWidenWarps);
      mbar_init(sv_empty(st), Cfg::kWidenWarps);
    }
    if constexpr (Cfg::kPersistent) mbar_init(q_empty(), Cfg::kConsumerWarps);
    if constexpr (Cfg::kDynamic) {
#pragma unroll
      for (int i = 0; i < Cfg::kItemSlots; ++i) {
        mbar_init(item_full(i), 1);
        mbar_init(item_empty(i), Cfg::kConsumerWGs * 128);
      }
    }
    mbar_fence_init();
  }
  __syncthreads();  // the last CTA-wide barrier: the roles diverge below

  const int warp_group = warp / 4;
  // The item's Q (one thread of the producer): per 64-column block the block's rows, or under
  // Cfg::kMirror warpgroup 0's 64 rows and then warpgroup 1's (the middle block of an odd count:
  // the same rows again, unused). q_b: the batch coordinate (0 for packed rows).
  auto load_q = [&](int q_b) {
    mbar_arrive_expect_tx(q_full(), Cfg::kQBytes);
#pragma unroll
    for (int cb = 0; cb < kCB; ++cb) {
      tma_load_4d(s_q + cb * (kBlockM * 128), &wp.tm_q, q_full(), cb * 64, q_begin + m_start, head, q_b);
      if constexpr (Cfg::kMirror)
        tma_load_4d(s_q + cb * (kBlockM * 128) + 64 * 128, &wp.tm_q, q_full(), cb * 64, q_begin + m_start1, head,
                    q_b);
    }
  };

  if (warp_group == 0) {
    // ---------------- producer ----------------
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if constexpr (Cfg::kPaged) {
      if (warp == 0) {
        if (lane == 0) {
          tma_prefetch_desc(&wp.tm_q);
          tma_prefetch_desc(&wp.tm_k);
          tma_prefetch_desc(&wp.tm_v);
          load_q(0);
        }
        const int32_t* table = p.block_tables + int64_t(batch) * p.block_table_stride;
        const int bs = p.block_size;
        const int log2_bs = __ffs(bs) - 1;
        const int box_rows = min(bs, kBlockN);
        const int boxes = kBlockN / box_rows;  // pages per key tile
        const int used_pages = (seqlen_k + bs - 1) >> log2_bs;
        // A page's first key in the tile's layout: FP8, [keys][kD bytes] in the staging ring;
        // 16-bit, interleaved atoms in the ring (box_rows is a multiple of 8).
        const uint32_t lane_off = Cfg::kKv8 ? uint32_t(lane * box_rows * kD)
                                            : uint32_t(lane * box_rows / 8) * Cfg::kKvGroupStride;
        const uint32_t box_bytes = Cfg::kKv8 ? uint32_t(box_rows * kD) : uint32_t(box_rows) * 128u * kCB;
        // This lane's page of tile t, -1: no box (past the used table entries).
        auto page_of = [&](int t) {
          const int pi = (tile_n0(t) >> log2_bs) + lane;
          const int pg = (lane < boxes && pi < used_pages) ? __ldg(table + pi) : -1;
          return pg;
        };
        // One page's box of key tile t's K or V at dst (row: the tile's first key in its page).
        auto load_box = [&](uint32_t dst, const CUtensorMap* map, uint32_t bar, int row, int pg) {
          if constexpr (Cfg::kKv8) {
            tma_load_4d(dst, map, bar, 0, kv_head, row, pg);
          } else if constexpr (Cfg::kKvInterleave) {
            tma_load_5d(dst, map, bar, 0, 0, kv_head * kCB, row >> 3, pg);
          } else {
#pragma unroll
            for (int cb = 0; cb < kCB; ++cb) tma_load_4d(dst + cb * (kBlockN * 128), map, bar, cb * 64, row, kv_head, pg);
          }
        };
        // Rows of key tile 0 at or past seqlen_k (> 0: its V rows there get zeroed; FP8: the
        // widening warps write those zeros).
        const int tail_rows = Cfg::kKv8 ? 0 : tile_n0(0) + kBlockN - seqlen_k;
        const int fix_at = min(1, n_tiles - 1);  // after tile 1's copies are in flight
        // The boxes land in the ring (16-bit) or in the staging ring (FP8).
        constexpr int kRing = Cfg::kKv8 ? kSt : kStages;
        int pg = page_of(0);
        for (int t = 0; t < n_tiles; ++t) {
          const int s = t % kRing;
          const uint32_t parity = ((t / kRing) & 1) ^ 1;  // as in the dense producer below
          const int pg_next = t + 1 < n_tiles ? page_of(t + 1) : -1;
          // A negative entry inside the used range is bad input: no box (never a TMA coordinate).
          const bool issue = pg >= 0;
          const uint32_t bytes = uint32_t(__popc(__ballot_sync(0xffffffffu, issue))) * box_bytes;
          const int row = tile_n0(t) & (bs - 1);  // 0 unless a page holds several tiles
          const uint32_t k_bar = Cfg::kKv8 ? sk_full(s) : k_full(s);
          mbar_wait(Cfg::kKv8 ? sk_empty(s) : k_empty(s), parity);
          if (lane == 0) mbar_arrive_expect_tx(k_bar, bytes);
          __syncwarp();
          if (issue) load_box((Cfg::kKv8 ? st_k(s) : k_slot(s)) + lane_off, &wp.tm_k, k_bar, row, pg);
          const uint32_t v_bar = Cfg::kKv8 ? sv_full(s) : ((t == 0 && tail_rows > 0) ? v_tail() : v_full(s));
          mbar_wait(Cfg::kKv8 ? sv_empty(s) : v_empty(s), parity);
          if (lane == 0) mbar_arrive_expect_tx(v_bar, bytes);
          __syncwarp();
          if (issue) load_box((Cfg::kKv8 ? st_v(s) : v_slot(s)) + lane_off, &wp.tm_v, v_bar, row, pg);
          if (tail_rows > 0 && t == fix_at) {
            // Whole 128-byte rows: the swizzle only permutes chunks inside a row.
            mbar_wait(v_tail(), 0);
#pragma unroll
            for (int cb = 0; cb < kCB; ++cb)
              for (int i = (kBlockN - tail_rows) * 8 + lane; i < kBlockN * 8; i += 32) {
                const int r = i >> 3;  // key row, then its 16-byte chunk i & 7
                st_shared_zero16(v_slot(0) + (r >> 3) * Cfg::kKvGroupStride + cb * Cfg::kKvColStride +
                                 ((r & 7) * 8 + (i & 7)) * 16);
              }
            fence_proxy_async_smem();
            __syncwarp();
            if (lane == 0) mbar_arrive(v_full(0));
          }
          pg = pg_next;
        }
      } else if constexpr (Cfg::kKv8) {
        if (warp <= Cfg::kWidenWarps) {
          // Widening: 32 bytes of T (two sw128 chunks) per 16 staged bytes. Keys at or
          // past seqlen_k (stale page slots, pages never loaded) become zeros: P = 0 times a NaN
          // there would still be NaN.
          constexpr int kGS = Cfg::kKvGroupStride, kCS = Cfg::kKvColStride;
          const int wt = tid - 32;  // 0 .. 32 * kWidenWarps - 1
          // 16-byte units (16 columns of one key row), kInFlight loads in flight per thread: one in
          // flight left the consumers waiting (2.9x the 16-bit time against 1.9x at bf16).
          // Unit u -> (row, unit c16 of the row): 8 consecutive lanes (one shared-memory phase of a
          // 16-byte access) take 4 units of a 64-column block from each of two adjacent rows, and
          // at D = 128 the second row from the other block: the loads then cover 32 distinct
          // banks of the staged rows (128 bytes apart) and the stores 8 distinct chunk slots
          // (adjacent rows' swizzles differ in the lowest bit).
          constexpr int kUnits = kBlockN * (kD / 16);
          constexpr int kWT = 32 * Cfg::kWidenWarps;
          auto unit_pos = [&](int u, int& row, int& c16) {
            const int row_lo = (u >> 2) & 1;
            if constexpr (kD == 128) {
              row = (u >> 4) * 2 + row_lo;
              c16 = ((row_lo ^ (u >> 3)) & 1) * 4 + (u & 3);
            } else {
              row = u >> 2;
              c16 = u & 3;
            }
          };
          constexpr int kInFlight = MINIPAGED_WS8_INFLIGHT;
          auto widen = [&](uint32_t src, uint32_t dst, int valid_rows) {
#if MINIPAGED_WS8_UNROLL
#pragma unroll 1
#else
#pragma unroll
#endif
            for (int u0 = wt; u0 < kUnits; u0 += kInFlight * kWT) {
              int row[kInFlight], c16[kInFlight];
              uint4 x[kInFlight];
#pragma unroll
              for (int i = 0; i < kInFlight; ++i) {
                unit_pos(u0 + i * kWT, row[i], c16[i]);
                x[i] = make_uint4(0u, 0u, 0u, 0u);
                if (u0 + i * kWT < kUnits && row[i] < valid_rows) x[i] = lds128(src + uint32_t(row[i] * kD + c16[i] * 16));
              }
#pragma unroll
              for (int i = 0; i < kInFlight; ++i) {
                if (u0 + i * kWT >= kUnits) break;
                const uint2 w0 = make_uint2(x[i].x, x[i].y), w1 = make_uint2(x[i].z, x[i].w);
                uint4 out0, out1;
#if MINIPAGED_WS8_WIDEN == 2
                // OR of the four words: a NaN byte always shows; a false alarm only costs the cvt path
                if (fp8x4_nan_bits(x[i].x | x[i].y | x[i].z | x[i].w) == 0u) {
                  out0 = fp8x8_widen_int<Tm>(w0), out1 = fp8x8_widen_int<Tm>(w1);
                } else
#endif
                {
                  out0 = fp8x8_widen<Tm>(w0), out1 = fp8x8_widen<Tm>(w1);
                }
                const int r = row[i], j = 2 * (c16[i] & 3);  // first chunk within the 64-column block
                const uint32_t at = dst + uint32_t((c16[i] >> 2) * kCS + (r >> 3) * kGS + (r & 7) * 128);
                st_shared_v4(at + uint32_t((j ^ (r & 7)) << 4), out0);
                st_shared_v4(at + uint32_t(((j + 1) ^ (r & 7)) << 4), out1);
              }
            }
            fence_proxy_async_smem();
            __syncwarp();
          };
          for (int t = 0; t < n_tiles; ++t) {
            const int st = t % kSt, s = t % kStages;
            const uint32_t st_parity = (t / kSt) & 1;
            const uint32_t empty_parity = ((t / kStages) & 1) ^ 1;
            const int valid_rows = seqlen_k - tile_n0(t);
            mbar_wait(sk_full(st), st_parity);
            mbar_wait(k_empty(s), empty_parity);
            widen(st_k(st), k_slot(s), valid_rows);
            if (lane == 0) {
              mbar_arrive(sk_empty(st));
              mbar_arrive(k_full(s));
            }
            mbar_wait(sv_full(st), st_parity);
            mbar_wait(v_empty(s), empty_parity);
            widen(st_v(st), v_slot(s), valid_rows);
            if (lane == 0) {
              mbar_arrive(sv_empty(st));
              mbar_arrive(v_full(s));
            }
          }
        }
      }
    } else if (warp == 0 && lane == 0) {
      tma_prefetch_desc(&wp.tm_q);
      tma_prefetch_desc(&wp.tm_k);
      tma_prefetch_desc(&wp.tm_v);
      // Ring tiles and items this CTA has loaded before: slot and phase
      // parities continue across a persistent CTA's items.
      int tc0 = 0, item_no = 0;
      auto produce_item = [&] {
        // Dense: (row, batch) coordinates; varlen: rows of the packed tensor, batch extent 1.
        const int q_b = p.cu_seqlens_q != nullptr ? 0 : batch;
        const int k_b = p.cu_seqlens_k != nullptr ? 0 : batch;
        // Q of the previous item must be done with (completion item_no - 1 of q_empty).
        if constexpr (Cfg::kPersistent) {
          if (item_no > 0) mbar_wait(q_empty(), uint32_t((item_no - 1) & 1));
        }
        load_q(q_b);
        for (int t = 0; t < n_tiles; ++t) {
          const int tg = tc0 + t;
          const int s = tg % kStages;
          // Round r of slot s waits for the consumers' release of round r - 1,
          // i.e. phase parity (r - 1) & 1; round 0 passes on the fresh barrier.
          const uint32_t parity = ((tg / kStages) & 1) ^ 1;
          const int row = k_begin + tile_n0(t);
          mbar_wait(k_empty(s), parity);
          mbar_arrive_expect_tx(k_full(s), Cfg::kTileBytes);
#pragma unroll
          for (int cb = 0; cb < kCB; ++cb)
            tma_load_4d(k_slot(s) + cb * (kBlockN * 128), &wp.tm_k, k_full(s), cb * 64, row, kv_head, k_b);
          mbar_wait(v_empty(s), parity);
          mbar_arrive_expect_tx(v_full(s), Cfg::kTileBytes);
#pragma unroll
          for (int cb = 0; cb < kCB; ++cb)
            tma_load_4d(v_slot(s) + cb * (kBlockN * 128), &wp.tm_v, v_full(s), cb * 64, row, kv_head, k_b);
        }
      };
      // Persistent: work item w, unless its m-block is past its sequence or
      // sees no key (the consumers skip the same ones).
      auto produce_w = [&](int w) {
        if (!set_item_w(w) || n_end <= 0) return;
        produce_item();
        tc0 += n_tiles;
        ++item_no;
      };
      if constexpr (Cfg::kDynamic) {
        // Item k of this CTA: the first wave by blockIdx, then the counter. Its
        // id goes to the consumers through slot k % 2 (the mbarrier arrive
        // releases the store), -1 ends the walk.
        for (int k = 0;; ++k) {
          int w = k == 0 ? int(blockIdx.x) : int(gridDim.x) + atomicAdd(wp.sched, 1);
          if (w >= num_items) w = -1;
          const int is = k % Cfg::kItemSlots;
          mbar_wait(item_empty(is), uint32_t(((k / Cfg::kItemSlots) & 1) ^ 1));
          item_ids[is] = w;
          mbar_arrive(item_full(is));
          if (w < 0) break;
          produce_w(w);
        }
        // Every CTA that stops taking items counts itself; the last one resets
        // the counters for the next launch (no other CTA reads them any more).
        if (atomicAdd(wp.sched + 1, 1) == int(gridDim.x) - 1) {
          atomicExch(wp.sched, 0);
          atomicExch(wp.sched + 1, 0);
        }
      } else if constexpr (Cfg::kPersistent) {
        // The consumers walk the same items.
        for (int w = blockIdx.x; w < num_items; w += gridDim.x) produce_w(w);
      } else {
        produce_item();
      }
    }
    // Nothing waits for the producer: the CTA (and its shared memory) lives
    // until the consumers finish, and they wait for every byte they read.
    return;
  }

  // ---------------- consumers ----------------
  setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int cw = warp_group - 1;          // consumer warpgroup 0 or 1
  const int warp_row0 = (warp - 4) * 16;  // the warp's 16 rows of the block
  int wg_row0 = 0;                        // the warpgroup's first row (per item)
  // Per item: the block's rows as this warpgroup sees them, row r of the block (r in
  // [64 cw, 64 cw + 64)) being query row row_base + r of the sequence, present iff
  // r < row_limit; and the first tile (in walk order) holding keys of its rows. Else than
  // under Cfg::kMirror's warpgroup 1 these are m_start, m_rows and 0.
  int row_base = 0, row_limit = 0, t_first = 0;

  const uint32_t q_wg = s_q + cw * 64 * 128;
  // Operand descriptors, built once: the descriptor of an address inside a
  // tile is the tile's descriptor plus (offset >> 4) in its 14-bit start
  // address field (shared memory ends below 256 KB, so the field never carries
  // into the next). Each wgmma then costs one 32-bit add of a constant to the
  // low word (the ring slot's offset is added once per tile) instead of masks
  // and shifts on a new address; a 64-bit add would cost a carry chain, since
  // the compiler cannot know that it never carries.
  auto desc_at = [](uint64_t desc, uint32_t offset) {
    return (desc & 0xFFFFFFFF00000000ull) | uint32_t(uint32_t(desc) + (offset >> 4));
  };
  const uint64_t q_desc0 = wgmma_desc_sw128(q_wg, 16, 1024);
  constexpr int kGS = Cfg::kKvGroupStride, kCS = Cfg::kKvColStride;
  const uint64_t k_desc0 = wgmma_desc_sw128(k_slot(0), 16, kGS);
  const uint64_t v_desc0 = wgmma_desc_sw128(v_slot(0), 1024, kGS);
  // Both 64-column blocks of V in one descriptor: LBO steps from one to the next.
  const uint64_t v_desc_wide0 = wgmma_desc_sw128(v_slot(0), kCS, kGS);
  // Q's descriptors are the same for every item and tile of the warpgroup: their low words are
  // computed once.
  uint32_t q_lo[kD / 16];
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk)
    q_lo[kk] = uint32_t(desc_at(q_desc0, (kk >> 2) * (kBlockM * 128) + (kk & 3) * 32));
  auto q_desc = [&](int kk) { return (q_desc0 & 0xFFFFFFFF00000000ull) | q_lo[kk]; };
  // Ring slot s, keys nb * 64 .. (64 or 128 of them), k step kk.
  auto k_desc = [&](int s, int nb, int kk) {
    return desc_at(desc_at(k_desc0, s * Cfg::kTileBytes), nb * 8 * kGS + (kk >> 2) * kCS + (kk & 3) * 32);
  };
  auto v_desc = [&](int s, int cb, int kk) {
    return desc_at(desc_at(v_desc0, s * Cfg::kTileBytes), cb * kCS + kk * 2 * kGS);
  };
  auto v_desc_wide = [&](int s, int kk) {
    return desc_at(desc_at(v_desc_wide0, s * Cfg::kTileBytes), kk * 2 * kGS);
  };
  // One arrival per warp, after the warp's wgmma_wait: the warpgroup's MMA
  // that read the slot has retired, so the producer may overwrite it.
  auto release = [&](uint32_t bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };
  // Ping-pong: a warpgroup waits for its turn before a GEMM phase and hands
  // the turn to the other after issuing it. Every consumer warpgroup runs
  // n_tiles + 1 phases; warpgroup 1 pre-arrives on warpgroup 0's barrier (so
  // warpgroup 0 goes first) and skips its last hand-over, which leaves both
  // barriers with as many arrivals as waits.
  auto sched_wait = [&] {
    if constexpr (Cfg::kPingPong) named_bar_sync(Cfg::kBarSched + cw, 256);
  };
  auto sched_signal = [&](bool last_phase) {
    if constexpr (Cfg::kPingPong) {
      if (!(last_phase && cw == 1)) named_bar_arrive(Cfg::kBarSched + (1 - cw), 256);
    }
  };

  float acc_o[kCB][8][4];
  auto o_frag = [&](int, int dt, int e) -> float& { return acc_o[dt >> 3][dt & 7][e]; };
  auto fence_o = [&] {
#pragma unroll
    for (int cb = 0; cb < kCB; ++cb) fence_operand(acc_o[cb]);
  };

  // positive: the launchers check. FP8 pages: a stored K element times k_scale[kv_head] is its
  // value, so the scale takes k_scale; v_scale[kv_head] multiplies O with 1/l.
  float scale_log2 = p.scale * 1.4426950408889634f;
  float out_scale = 1.f;
  if constexpr (Cfg::kKv8) {
    scale_log2 *= p.k_scale[kv_head];
    out_scale = p.v_scale[kv_head];
  }
  const float scale_log2_base = scale_log2;
  FragSoftmax<1> sm;
  const int g = lane >> 2;
  const int tq = (lane & 3) * 2;

  float acc_s[kNT / 8][8][4];
  auto s_frag = [&](int, int nt, int e) -> float& { return acc_s[nt >> 3][nt & 7][e]; };
  uint32_t p_frag[kBlockN / 16][4];
  // Ring tiles and items this CTA consumed before (as in the producer). Unsigned: the slot
  // and phase of tile t are then a mask and a shift, not a signed division with fixups.
  uint32_t tc0 = 0;
  int item_no = 0;
  auto slot = [&](int t) { return int((tc0 + uint32_t(t)) % kStages); };
  auto phase = [&](int t) { return ((tc0 + uint32_t(t)) / kStages) & 1u; };

  // S = Q K^T of tile t into acc_s (issued, not waited for).
  auto issue_qk = [&](int t) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s_frag(0, nt, e) = 0.f;
    fence_operand(acc_s);
    wgmma_fence();
    if constexpr (Cfg::kWideQK) {
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) wgmma_m64n128k16_ss<Tm>(acc_s, q_desc(kk), k_desc(slot(t), 0, kk));
    } else {
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk)
#pragma unroll
        for (int nb = 0; nb < kNT / 8; ++nb)
          wgmma_m64n64k16_ss<Tm>(acc_s[nb], q_desc(kk), k_desc(slot(t), nb, kk));
    }
    wgmma_commit();
  };
  // O += P V of tile t, P from p_frag (issued, not waited for).
  auto issue_pv = [&](int t) {
    fence_operand(p_frag);
    fence_o();
    wgmma_fence();
    if constexpr (Cfg::kWidePV) {
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk)
        wgmma_m64n128k16_rs_tb<Tm>(acc_o, p_frag[kk], v_desc_wide(slot(t), kk));
    } else {
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk)
#pragma unroll
        for (int cb = 0; cb < kCB; ++cb)
          wgmma_m64n64k16_rs_tb<Tm>(acc_o[cb], p_frag[kk], v_desc(slot(t), cb, kk));
    }
    wgmma_commit();
  };
  // Mask and online softmax of acc_s (tile t). Touches neither O nor p_frag,
  // so it may run while a PV wgmma still reads them; the O factor is kept in
  // alpha until finish_tile applies it.
  float alpha[2] = {1.f, 1.f};
  bool rescale_pending = false;
  auto softmax_tile = [&](int t, auto mask_tag) {
    if constexpr (decltype(mask_tag)::value)
      mask_tile<1, kNT, kCausal>(s_frag, row_base + warp_row0, tile_n0(t), seqlen_k, diag, g, tq,
                                 [](int r) { return r; });
    float tile_max[1][2];
    sm.template tile_max<kNT>(s_frag, tile_max);
    rescale_pending = move_max_lazy(sm, tile_max, scale_log2, alpha);
    sm.template exp_and_sum<kNT>(s_frag, scale_log2);
  };
  // After the previous PV retired: O takes the tile's factor, P is packed.
  auto finish_tile = [&] { rescale_o_pack_p<Tm, kCB * 8>(rescale_pending, alpha, o_frag, s_frag, p_frag); };

  int n_masked = 0;
  auto softmax_any = [&](int t) {
    if (t < n_masked) softmax_tile(t, MaskOn{});
    else softmax_tile(t, MaskOff{});
  };
  // Persistent: after the item's last QK^T retired, Q goes back to the producer.
  auto q_done = [&](int t) {
    if constexpr (Cfg::kPersistent) {
      if (t == n_tiles - 1) release(q_empty());
    }
  };

  // Cfg::kQToF16: this warp's 16 rows of Q (bf16, TMA-loaded) in place as f16 times 2^e, e from
  // their largest finite |q| over the rows inside the sequence (exact but for elements more than
  // 2^28 below it; rows past the sequence only ever reach their own discarded outputs); the
  // warp's score scale takes 2^-e. The warpgroup's MMAs read all 64 rows: a barrier of its 128
  // threads (the epilogue's, idle until then) follows the conversion.
  auto q_to_f16 = [&] {
    const int r0 = cw * 64 + (warp & 3) * 16;  // the warp's first row in the Q block
    constexpr int kPerLane = 16 * 8 * kCB / 32;  // 16-byte chunks per lane
    uint4 x[kPerLane];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int idx = lane + 32 * i, cb = idx >> 7, rr = (idx >> 3) & 15, c = idx & 7;
      x[i] = lds128(s_q + uint32_t(cb * (kBlockM * 128) + (r0 + rr) * 128 + c * 16));
      if (row_base + r0 + rr < seqlen_q)
        amax = fmaxf(fmaxf(fmaxf(amax, bf16x2_abs_max(x[i].x)), fmaxf(bf16x2_abs_max(x[i].y), bf16x2_abs_max(x[i].z))),
                     bf16x2_abs_max(x[i].w));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const int e = f16_exponent(amax);
    const float up = exp2i(e);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int idx = lane + 32 * i, cb = idx >> 7, rr = (idx >> 3) & 15, c = idx & 7;
      st_shared_v4(s_q + uint32_t(cb * (kBlockM * 128) + (r0 + rr) * 128 + c * 16),
                   make_uint4(bf16x2_to_f16x2(x[i].x, up), bf16x2_to_f16x2(x[i].y, up),
                              bf16x2_to_f16x2(x[i].z, up), bf16x2_to_f16x2(x[i].w, up)));
    }
    fence_proxy_async_smem();
    named_bar_sync(Cfg::kBarEpilogue + cw, 128);
    scale_log2 = scale_log2_base * exp2i(-e);
  };

  auto consume_item = [&] {
    row_base = m_start;
    row_limit = m_rows;
    if constexpr (Cfg::kMirror) {
      t_first = 0;
      if (cw == 1) {
        row_base = m_start1 - 64;
        row_limit = 64 + m_rows1;
        int wg_end = seqlen_k;
        if (kCausal) wg_end = min(wg_end, m_start1 + m_rows1 + diag);
        const int wg_tiles = m_rows1 > 0 && wg_end > 0 ? (wg_end + kBlockN - 1) / kBlockN : 0;
        t_first = n_tiles - wg_tiles;
      }
    }
    wg_row0 = row_base + cw * 64;
#pragma unroll
    for (int cb = 0; cb < kCB; ++cb)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[cb][j][e] = 0.f;
    sm.init();
    rescale_pending = false;
    // Leading tiles (from the last key tile down) that need the mask for this
    // warpgroup's rows: tail tiles past seqlen_k and, under causal, the diagonal.
    n_masked = 0;
    while (n_masked < n_tiles) {
      const int n0 = tile_n0(n_masked);
      const bool full = n0 + kBlockN <= seqlen_k && (!kCausal || n0 + kBlockN - 1 <= wg_row0 + diag);
      if (full) break;
      ++n_masked;
    }
    if constexpr (Cfg::kPingPong) {
      if (cw == 1) named_bar_arrive(Cfg::kBarSched + 0, 256);
    }

    mbar_wait(q_full(), uint32_t(item_no & 1));
    if constexpr (Cfg::kQToF16) q_to_f16();

    if constexpr (!Cfg::kPipelined) {
      // Step 1 of the ablation: each tile's two GEMMs back to back.
      for (int t = 0; t < n_tiles; ++t) {
        mbar_wait(k_full(slot(t)), phase(t));
        issue_qk(t);
        wgmma_wait<0>();
        fence_operand(acc_s);
        release(k_empty(slot(t)));
        q_done(t);
        softmax_any(t);
        finish_tile();
        mbar_wait(v_full(slot(t)), phase(t));
        issue_pv(t);
        wgmma_wait<0>();
        fence_o();
        release(v_empty(slot(t)));
      }
    } else {
      // kMirror: warpgroup 1 runs the phases of the tiles above its keys (t < t_first) empty,
      // taking its turn and releasing each slot once it is full (a release before the fill
      // could count towards the slot's previous round), so both warpgroups run n_tiles + 1
      // phases; with no tile of its own only the last phase's turn remains.
      const int t0 = Cfg::kMirror ? t_first : 0;
      if constexpr (Cfg::kMirror) {
        for (int t = 0; t < t0; ++t) {
          mbar_wait(k_full(slot(t)), phase(t));
          release(k_empty(slot(t)));
          mbar_wait(v_full(slot(t)), phase(t));
          release(v_empty(slot(t)));
          sched_wait();
          sched_signal(false);
        }
      }
      if (!Cfg::kMirror || t0 < n_tiles) {
        // Phase t0: QK^T of the first tile alone.
        mbar_wait(k_full(slot(t0)), phase(t0));
        sched_wait();
        issue_qk(t0);
        sched_signal(false);
        wgmma_wait<0>();
        fence_operand(acc_s);
        release(k_empty(slot(t0)));
        q_done(t0);
        softmax_any(t0);
        finish_tile();
        // Phases t0 + 1 .. n_tiles - 1: QK^T(t) and PV(t-1) issued together.
        for (int t = t0 + 1; t < n_tiles; ++t) {
          mbar_wait(k_full(slot(t)), phase(t));
          mbar_wait(v_full(slot(t - 1)), phase(t - 1));
          sched_wait();
          issue_qk(t);
          issue_pv(t - 1);
          sched_signal(false);
          if constexpr (Cfg::kOverlap) {
            wgmma_wait<1>();  // groups retire in order: QK^T(t) is done, PV(t-1) may not be
            fence_operand(acc_s);
            release(k_empty(slot(t)));
            q_done(t);
            softmax_any(t);
            wgmma_wait<0>();
            fence_o();
            fence_operand(p_frag);
            release(v_empty(slot(t - 1)));
          } else {
            wgmma_wait<0>();
            fence_operand(acc_s);
            fence_o();
            fence_operand(p_frag);
            release(k_empty(slot(t)));
            release(v_empty(slot(t - 1)));
            q_done(t);
            softmax_any(t);
          }
          finish_tile();
        }
        // Phase n_tiles: PV of the last tile alone.
        mbar_wait(v_full(slot(n_tiles - 1)), phase(n_tiles - 1));
        sched_wait();
        issue_pv(n_tiles - 1);
        sched_signal(true);
        wgmma_wait<0>();
        fence_o();
        release(v_empty(slot(n_tiles - 1)));
      } else {
        sched_wait();
        sched_signal(true);
      }
    }

    // ---- epilogue ----
    // O through shared memory (`buf`, sw128 like Q: each thread's 4-byte
    // writes of 8 rows land in 8 different 16-byte chunks) into coalesced
    // 16-byte rows; each warp writes and reads back only its own 16 rows.
    auto store_o_staged = [&](unsigned char* buf) {
      epilogue_rows<T, kCB * 8, true>(
          sm, o_frag, scale_log2, p, batch, head, q_begin + row_base, warp_row0, row_limit, lane,
          [&](int r, int dt, uint32_t pair) {
            const uint32_t off = sw128_off<kBlockM>(r, dt) + tq * 2;
            *reinterpret_cast<uint32_t*>(buf + off) = pair;
          },
          out_scale);
      __syncwarp();
#pragma unroll
      for (int it = 0; it < 16 * Cfg::kChunks / 32; ++it) {
        const int idx = lane + it * 32;
        const int r = idx / Cfg::kChunks, c = idx % Cfg::kChunks;
        const int row = warp_row0 + r;
        if (row < row_limit) {
          *reinterpret_cast<uint4*>(o_ptr + int64_t(row_base + row) * p.o_row_stride + c * 8) =
              *reinterpret_cast<const uint4*>(buf + sw128_off<kBlockM>(row, c));
        }
      }
    };
    if constexpr (Cfg::kStagedO) {
      // A buffer of its own: __syncwarp orders this item's writes after the
      // warp's reads of the previous item's O.
      __syncwarp();
      store_o_staged(smem_ptr + Cfg::kOOff);
    } else if constexpr (Cfg::kPersistent) {
      // Straight from the C fragments (4-byte stores, two rows per thread): Q's
      // shared memory already holds the next item's Q.
      epilogue_rows<T, kCB * 8, false>(sm, o_frag, scale_log2, p, batch, head, q_begin + row_base, warp_row0, row_limit,
                                       lane, [&](int r, int dt, uint32_t pair) {
                                         T* row_ptr = o_ptr + int64_t(row_base + r) * p.o_row_stride + tq;
                                         *reinterpret_cast<uint32_t*>(row_ptr + dt * 8) = pair;
                                       });
    } else {
      // In the warpgroup's own Q rows: the barrier keeps the writes behind the
      // warpgroup's last wgmma read of Q.
      named_bar_sync(Cfg::kBarEpilogue + cw, 128);
      store_o_staged(smem_ptr);
    }
  };  // consume_item

  // Persistent: work item w (an item that sees no key gets zeros, no pipeline).
  auto consume_w = [&](int w) {
    if (!set_item_w(w)) return;
    if (n_end <= 0) {
      write_empty_item(tid - 128, Cfg::kConsumerWGs * 128);
      return;
    }
    consume_item();
    tc0 += n_tiles;
    ++item_no;
  };
  if constexpr (Cfg::kDynamic) {
    for (int k = 0;; ++k) {
      const int is = k % Cfg::kItemSlots;
      mbar_wait(item_full(is), uint32_t((k / Cfg::kItemSlots) & 1));
      const int w = item_ids[is];
      // Every consumer thread arrives after its own read (no __syncwarp hand-off):
      // once per item, and compute-sanitizer's racecheck can follow it.
      mbar_arrive(item_empty(is));
      if (w < 0) break;
      consume_w(w);
    }
  } else if constexpr (Cfg::kPersistent) {
    for (int w = blockIdx.x; w < num_items; w += gridDim.x) consume_w(w);
  } else {
    consume_item();
  }
#else
  __trap();  // built without sm_90a: never launched
#endif
}

// Host: a 4-D tensor map (D, rows, heads, batch) over a 16-bit tensor with
// the given element strides, box (64, box_rows, 1, 1), 128-byte swizzle,
// zero fill out of bounds. `encode` is cuTensorMapEncodeTiled, obtained from
// the driver at run time (cudaGetDriverEntryPoint*), so nothing links -lcuda.

inline CUresult make_ws_tensor_map(TensorMapEncodeFn encode, CUtensorMap* map, const void* base, DType dtype,
                                   int head_dim, int64_t rows, int64_t heads, int64_t batch, int64_t row_stride,
                                   int64_t head_stride, int64_t batch_stride, int box_rows) {
  // A dimension of extent 1 is never stepped over, but TMA still wants its
  // stride to be a multiple of 16 bytes below 2^40: give it the packed value.
  if (heads == 1) head_stride = rows * row_stride;
  if (batch == 1) batch_stride = heads * head_stride;
  const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(rows), cuuint64_t(heads), cuuint64_t(batch)};
  // Byte strides of dims 1..3 (dim 0 is contiguous); TMA wants multiples of 16.
  const cuuint64_t strides[3] = {cuuint64_t(row_stride * 2), cuuint64_t(head_stride * 2),
                                 cuuint64_t(batch_stride * 2)};
  const cuuint32_t box[4] = {64, cuuint32_t(box_rows), 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUtensorMapDataType dt =
      dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return encode(map, dt, 4, const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

// Host: the paged caches [num_blocks, block_size, heads, D] as the 5-D map
// (64 columns, 8 keys, heads x column blocks, block_size / 8 key groups,
// blocks) with box (64, 8, D / 64, box_rows / 8, 1): one box is a page's
// box_rows keys over every column block, laid out as interleaved sw128 atoms
// (WsCfg::kKvInterleave). Folding heads and column blocks into one dimension
// of stride 128 bytes needs each token's heads packed (head stride D).
inline CUresult make_ws_paged_map(TensorMapEncodeFn encode, CUtensorMap* map, const void* base, DType dtype,
                                  int head_dim, int block_size, int64_t heads, int64_t num_blocks, int64_t row_stride,
                                  int64_t block_stride, int box_rows) {
  const int col_blocks = head_dim / 64;
  if (num_blocks == 1) block_stride = int64_t(block_size) * row_stride;
  const cuuint64_t dims[5] = {64, 8, cuuint64_t(heads * col_blocks), cuuint64_t(block_size / 8),
                              cuuint64_t(num_blocks)};
  const cuuint64_t strides[4] = {cuuint64_t(row_stride * 2), 128, cuuint64_t(row_stride * 16),
                                 cuuint64_t(block_stride * 2)};
  const cuuint32_t box[5] = {64, 8, cuuint32_t(col_blocks), cuuint32_t(box_rows / 8), 1};
  const cuuint32_t elem_strides[5] = {1, 1, 1, 1, 1};
  const CUtensorMapDataType dt =
      dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return encode(map, dt, 5, const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

// Host: FP8 caches [num_blocks, block_size, heads, D] (e4m3 bytes; strides in bytes) as the 4-D
// map (D, heads, block_size, blocks) with box (D, 1, box_rows, 1): one box is one head's
// box_rows keys of a page, [keys][D bytes] in shared memory without swizzle (WsCfg::kKv8
// stages them there and widens them into the ring).
inline CUresult make_ws_paged_map8(TensorMapEncodeFn encode, CUtensorMap* map, const void* base, int head_dim,
                                   int block_size, int64_t heads, int64_t num_blocks, int64_t head_stride,
                                   int64_t row_stride, int64_t block_stride, int box_rows) {
  if (heads == 1) head_stride = head_dim;
  if (num_blocks == 1) block_stride = int64_t(block_size) * row_stride;
  const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(heads), cuuint64_t(block_size),
                              cuuint64_t(num_blocks)};
  const cuuint64_t strides[3] = {cuuint64_t(head_stride), cuuint64_t(row_stride), cuuint64_t(block_stride)};
  const cuuint32_t box[4] = {cuuint32_t(head_dim), 1, cuuint32_t(box_rows), 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<void*>(base), dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

// Whether the warp-specialised kernel can take p: TMA needs rows to exist
// (an empty K/V tensor has no map) and 16-byte strides, which the fast
// launcher has checked already.
inline bool ws_supported(const PrefillParams& p) {
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int64_t rows_q = varlen ? p.total_q : p.max_seqlen_q;
  const int64_t rows_k = varlen ? p.total_k : p.max_seqlen_k;
  return p.block_tables == nullptr && rows_q > 0 && rows_k > 0 && tensor_map_encoder() != nullptr;
}

// kL2Sections: (batch, q head) pairs per section, as many whole GQA groups as
// keep the K/V of the section's KV heads (max_seqlen_k keys each) within half
// of l2_bytes, in sections of equal size; every pair if that fits.
inline int ws_l2_section(const PrefillParams& p, int64_t l2_bytes) {
  const int group = p.num_q_heads / p.num_kv_heads;
  const int64_t kv_pairs = int64_t(p.batch) * p.num_kv_heads;
  const int64_t per_kv_head = 2 * int64_t(p.max_seqlen_k) * p.head_dim * 2;
  const int64_t fit = per_kv_head > 0 ? std::max<int64_t>(1, (l2_bytes / 2) / per_kv_head) : kv_pairs;
  if (fit >= kv_pairs) return int(kv_pairs * group);
  const int64_t sections = (kv_pairs + fit - 1) / fit;
  return int((kv_pairs + sections - 1) / sections * group);
}
// The L2 size ws_l2_section assumes: PrefillParams::l2_bytes (else the device's) unless this
// is > 0 (ws_selftest's WS_L2_MB; nothing else sets it).
inline int64_t g_ws_l2_bytes_override = 0;

// The kernel with Cfg on PrefillParams (dense or varlen); maps built per call.
template <class Cfg, bool kCausal>
cudaError_t launch_prefill_ws(const PrefillParams& pp, cudaStream_t stream) {
  const int m_blocks = (pp.max_seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
  if (m_blocks == 0 || pp.batch == 0 || pp.num_q_heads == 0) return cudaSuccess;
  if (m_blocks > 65535 || pp.batch > 65535) return cudaErrorInvalidConfiguration;
  const TensorMapEncodeFn enc = tensor_map_encoder();
  if (enc == nullptr) return cudaErrorNotSupported;
  const bool varlen = pp.cu_seqlens_q != nullptr;
  const int64_t rows_q = varlen ? pp.total_q : pp.max_seqlen_q;
  const int64_t rows_k = varlen ? pp.total_k : pp.max_seqlen_k;
  const int64_t batch = varlen ? 1 : pp.batch;
  if (rows_q <= 0 || rows_k <= 0) return cudaErrorInvalidValue;
  WsParams wp{};
  wp.p = pp;
  // (kMirror: a CTA's pair of 64-row blocks is as many CTAs as 128-row blocks, ceil(ceil(n / 64) / 2))
  CUresult r = make_ws_tensor_map(enc, &wp.tm_q, pp.q, pp.dtype, Cfg::kD, rows_q, pp.num_q_heads, batch,
                                  pp.q_row_stride, pp.q_head_stride, pp.q_batch_stride, Cfg::kQBoxRows);
  if (r == CUDA_SUCCESS)
    r = make_ws_tensor_map(enc, &wp.tm_k, pp.k, pp.dtype, Cfg::kD, rows_k, pp.num_kv_heads, batch, pp.k_row_stride,
                           pp.k_head_stride, pp.k_batch_stride, Cfg::kBlockN);
  if (r == CUDA_SUCCESS)
    r = make_ws_tensor_map(enc, &wp.tm_v, pp.v, pp.dtype, Cfg::kD, rows_k, pp.num_kv_heads, batch, pp.v_row_stride,
                           pp.v_head_stride, pp.v_batch_stride, Cfg::kBlockN);
  if (r != CUDA_SUCCESS) return cudaErrorInvalidValue;
  auto kernel = prefill_ws_kernel<Cfg, kCausal>;
  constexpr int kSmem = Cfg::kSmemBytes;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  dim3 grid(pp.num_q_heads, pp.batch, m_blocks);
  if constexpr (Cfg::kL2Sections) {
    if (int64_t(m_blocks) * pp.batch * pp.num_q_heads > INT_MAX) return cudaErrorInvalidConfiguration;  // ws_item is int
    int64_t l2 = g_ws_l2_bytes_override > 0 ? g_ws_l2_bytes_override : pp.l2_bytes;
    if (l2 <= 0) {
      int dev = 0, bytes = 0;
      if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&bytes, cudaDevAttrL2CacheSize, dev) != cudaSuccess)
        return cudaErrorInvalidValue;
      l2 = bytes;
    }
    wp.section_hb = ws_l2_section(pp, l2);
  }
  if constexpr (Cfg::kDynamic) {
    // the caller's zeroed counters (PrefillParams::sched_counters): a per-launch
    // buffer, so concurrent launches on other streams never share one
    wp.sched = pp.sched_counters;
    if (wp.sched == nullptr) return cudaErrorInvalidValue;
  }
  if constexpr (Cfg::kPersistent) {
    // One resident CTA per SM (the shared memory and registers allow one).
    const int64_t items = int64_t(m_blocks) * pp.batch * pp.num_q_heads;
    if (items > INT_MAX) return cudaErrorInvalidConfiguration;
    grid = dim3(unsigned(std::min<int64_t>(items, sm_count(pp))), 1, 1);
  }
  kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(wp);
  return cudaGetLastError();
}

// Paged launches: an upper bound of the work items (owned (sequence, m-block)
// pairs) from what the host knows. An owned sequence of ql rows has
// ceil(ql / kBlockM) <= (ql + kBlockM - 1) / kBlockM blocks, the owned q_lens
// sum to at most total_q, and a launch that owns only q_len > N has at most
// total_q / (N + 1) sequences.
inline int64_t ws_paged_work_bound(const PrefillParams& p, int block_m) {
  if (p.batch <= 0 || p.total_q <= 0 || p.max_seqlen_q <= 0) return 0;
  int64_t seqs = std::min<int64_t>(p.batch, p.total_q);
  if (p.qlen_filter < 0) seqs = std::min<int64_t>(seqs, p.total_q / (1 - int64_t(p.qlen_filter)));
  const int64_t per_seq = (p.max_seqlen_q + block_m - 1) / block_m;
  return std::min<int64_t>((p.total_q + int64_t(block_m - 1) * seqs) / block_m, seqs * per_seq);
}

// Whether the paged TMA kernel can take p (16-bit caches, pages of >= 8
// tokens, the extents of the maps known, a work list within grid.y).
template <class Cfg>
inline bool ws_paged_supported(const PrefillParams& p) {
  return p.block_tables != nullptr && p.cu_seqlens_q != nullptr && p.kv_fp8 == Cfg::kKv8 &&
         (!Cfg::kKv8 || (p.k_scale != nullptr && p.v_scale != nullptr)) && p.block_size >= 8 &&
         p.block_size <= 256 && p.total_q > 0 && p.num_blocks > 0 && p.num_blocks <= INT32_MAX &&
         ws_paged_work_bound(p, Cfg::kBlockM) <= 65535 && tensor_map_encoder() != nullptr &&
         (!Cfg::kKvInterleave || (p.k_head_stride == p.head_dim && p.v_head_stride == p.head_dim));
}

// The paged kernel (Cfg::kPaged) on launch_prefill_paged's PrefillParams:
// q packed varlen (total_q rows), caches through block tables.
template <class Cfg, bool kCausal>
cudaError_t launch_prefill_ws_paged(const PrefillParams& pp, cudaStream_t stream) {
  static_assert(Cfg::kPaged, "paged config");
  if (pp.num_q_heads == 0) return cudaSuccess;
  const int64_t works = ws_paged_work_bound(pp, Cfg::kBlockM);
  if (works == 0) return cudaSuccess;
  if (works > 65535) return cudaErrorInvalidConfiguration;
  if (pp.block_size < 8 || pp.num_blocks <= 0) return cudaErrorInvalidValue;
  const TensorMapEncodeFn enc = tensor_map_encoder();
  if (enc == nullptr) return cudaErrorNotSupported;
  WsParams wp{};
  wp.p = pp;
  const int box = std::min(pp.block_size, Cfg::kBlockN);
  CUresult r = make_ws_tensor_map(enc, &wp.tm_q, pp.q, pp.dtype, Cfg::kD, pp.total_q, pp.num_q_heads, 1,
                                  pp.q_row_stride, pp.q_head_stride, 0, Cfg::kQBoxRows);
  if constexpr (Cfg::kKv8) {
    if (!pp.kv_fp8 || pp.k_scale == nullptr || pp.v_scale == nullptr) return cudaErrorInvalidValue;
    if (r == CUDA_SUCCESS)
      r = make_ws_paged_map8(enc, &wp.tm_k, pp.k, Cfg::kD, pp.block_size, pp.num_kv_heads, pp.num_blocks,
                             pp.k_head_stride, pp.k_row_stride, pp.k_block_stride, box);
    if (r == CUDA_SUCCESS)
      r = make_ws_paged_map8(enc, &wp.tm_v, pp.v, Cfg::kD, pp.block_size, pp.num_kv_heads, pp.num_blocks,
                             pp.v_head_stride, pp.v_row_stride, pp.v_block_stride, box);
  } else if constexpr (Cfg::kKvInterleave) {
    if (pp.k_head_stride != Cfg::kD || pp.v_head_stride != Cfg::kD) return cudaErrorInvalidValue;
    if (r == CUDA_SUCCESS)
      r = make_ws_paged_map(enc, &wp.tm_k, pp.k, pp.dtype, Cfg::kD, pp.block_size, pp.num_kv_heads, pp.num_blocks,
                            pp.k_row_stride, pp.k_block_stride, box);
    if (r == CUDA_SUCCESS)
      r = make_ws_paged_map(enc, &wp.tm_v, pp.v, pp.dtype, Cfg::kD, pp.block_size, pp.num_kv_heads, pp.num_blocks,
                            pp.v_row_stride, pp.v_block_stride, box);
  } else {
    if (r == CUDA_SUCCESS)
      r = make_ws_tensor_map(enc, &wp.tm_k, pp.k, pp.dtype, Cfg::kD, pp.block_size, pp.num_kv_heads, pp.num_blocks,
                             pp.k_row_stride, pp.k_head_stride, pp.k_block_stride, box);
    if (r == CUDA_SUCCESS)
      r = make_ws_tensor_map(enc, &wp.tm_v, pp.v, pp.dtype, Cfg::kD, pp.block_size, pp.num_kv_heads, pp.num_blocks,
                             pp.v_row_stride, pp.v_head_stride, pp.v_block_stride, box);
  }
  if (r != CUDA_SUCCESS) return cudaErrorInvalidValue;
  auto kernel = prefill_ws_kernel<Cfg, kCausal>;
  constexpr int kSmem = Cfg::kSmemBytes;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  const dim3 grid(pp.num_q_heads, unsigned(works), 1);
  kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(wp);
  return cudaGetLastError();
}

}  // namespace fast
}  // namespace minipaged
