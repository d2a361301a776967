// The one place for the kernels' parameter blocks and launcher declarations,
// shared by every launcher and the one binding file (binding.cpp). Torch-free
// on purpose: every .cu here builds with plain nvcc (CI compiles them for
// sm_80 and sm_90a without torch).
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace minipaged {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1 };

// Prefill, dense or varlen. Strides are in elements; the last dim is contiguous.
// Dense:  q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D]; cu_seqlens_* == nullptr and
//         every sequence has seqlen_q = max_seqlen_q, seqlen_k = max_seqlen_k.
// Varlen: q [Tq, Hq, D], k/v [Tk, Hkv, D]; sequence b spans rows
//         [cu_seqlens_q[b], cu_seqlens_q[b+1]) and the *_batch_stride fields are 0.
// Causal masking is bottom-right aligned: row i sees key j iff j < Nk - Nq + i + 1.
// Rows that see no key are written as exact zeros.
struct PrefillParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  int64_t o_batch_stride, o_head_stride, o_row_stride;
  const int32_t* cu_seqlens_q;  // [batch + 1] or nullptr (dense)
  const int32_t* cu_seqlens_k;  // [batch + 1] or nullptr (dense)
  // Optional log-sum-exp output (float32, natural log, -inf for a row that sees
  // no key): element (b, h, i) at lse + b*lse_batch_stride + h*lse_head_stride
  // + (q_begin + i)*lse_row_stride. nullptr: not computed, no cost.
  float* lse;
  int64_t lse_batch_stride, lse_head_stride, lse_row_stride;
  // Paged K/V (launch_prefill_paged only; nullptr otherwise). k/v then point at
  // caches [num_blocks, block_size, Hkv, D]: key j of sequence b is token
  // j % block_size of block block_tables[b * block_table_stride + j / block_size];
  // k_row_stride / v_row_stride are the token strides, k_block_stride /
  // v_block_stride the block strides, and seqlen_k = context_lens[b] (clamped
  // to max_blocks * block_size). Only the first ceil(seqlen_k / block_size)
  // table entries are read.
  const int32_t* block_tables;
  const int32_t* context_lens;
  int64_t block_table_stride;
  int64_t k_block_stride, v_block_stride;
  int block_size;  // power of two, 1..256
  int max_blocks;
  int variant;     // paged, benchmarking only: 0 tuned choice, 1 never pack GQA groups, 2 always,
                   // 3 tuned choice with the paths not yet GPU-checked (prefill/dispatch.cuh),
                   // 4 as 3 plus the decode routing (paged_decode_routing below)
  int decode_variant;  // paged, tests and benchmarking only: the DecodeParams::variant bits of its routed
                       // decode launches (paged_decode_params; the binding takes kDecodeVariantWarpMerge
                       // and kDecodeVariantFp8ShortRing)
  int batch;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;       // 64 or 128
  int max_seqlen_q;   // dense: Nq
  int max_seqlen_k;   // dense: Nk
  // Varlen: rows of the packed q and k/v tensors (cu_seqlens_*[batch] as the host
  // knows it without reading the device), the extents of the sm_90 TMA maps.
  int64_t total_q, total_k;
  float scale;        // softmax scale (1/sqrt(D) by default), not yet multiplied by log2(e)
  bool causal;
  DType dtype;
  int num_sms;        // multiprocessors on the device, for launch heuristics
  // L2 bytes of the device (0: unknown). Dense/varlen on sm_90: a grid whose K/V
  // do not fit half of it runs its work in L2 sections (prefill/dispatch.cuh).
  int64_t l2_bytes;
  // FP8 K/V (launch_prefill_paged only): the caches hold float8_e4m3fn bytes
  // (k_row_stride and the other K/V strides then count bytes) and the real
  // value of a stored element of KV head h is stored * k_scale[h] (v_scale[h]
  // for V); k_scale/v_scale are float32 [num_kv_heads]. false: 16-bit K/V of
  // `dtype`, the scales unused.
  bool kv_fp8;
  const float* k_scale;
  const float* v_scale;
  // Paged only, set by launch_prefill_paged when it splits a mixed batch into
  // two launches: 0 every sequence; N > 0 only sequences with q_len <= N;
  // N < 0 only sequences with q_len > -N. The kernels' CTAs of the other
  // sequences exit before any work (the q_lens live on the device only).
  int qlen_filter;
  // Paged only: blocks of the caches (k/v shape [0]); the extent of the sm_90
  // TMA maps of the caches. 0 (unknown): the TMA kernel is not used.
  int64_t num_blocks;
  // Two int32 zeros on the device, owned by this launch (not shared with one
  // that may run concurrently): the work-item counter of the dynamic
  // persistent warp-specialised configs, which leave them zero again (the
  // binding passes a per-stream pair to sm_90 prefill calls). nullptr: the
  // dispatch never picks those configs.
  int* sched_counters;
  // Paged only, the GQA-packed short-query kernel (prefill/dispatch.cuh CfgPack): KV splits,
  // flash-decoding for speculative runs. With pack_splits > 1 every (sequence, KV head,
  // m-block) CTA of a packed launch becomes pack_splits CTAs; split s takes keys
  // [s * pack_split_keys, (s + 1) * pack_split_keys) and writes its rows' normalised
  // partial O and log2-sum-exp, which the launch's merge kernel combines into o and lse.
  // Partials of packed row r of (sequence b, KV head h) and split s sit at row
  // ((b * num_kv_heads + h) * pack_rows + r) * pack_splits + s of pack_partial_o
  // [.., D] and pack_partial_lse; a packed launch whose m-blocks cover more than pack_rows
  // rows does not split. The binding fills these from paged_pack_split_plan.
  // 0 or 1: no split (tiled kernels ignore these fields).
  int pack_splits;
  int pack_split_keys;  // a multiple of every packed config's kBlockN
  int pack_rows;
  float* pack_partial_o;
  float* pack_partial_lse;
};

// KV splits of the GQA-packed paged kernel for the short query runs of p (see
// PrefillParams::pack_splits), from host-known values only (a CUDA graph replays
// it with other q_lens): enough CTAs to fill the GPU once, each at least
// kPackMinSplitKeys keys of the table's capacity. splits <= 1: no split and no
// workspace. Defined in prefill/paged.cu.
struct PackSplitPlan {
  int splits = 1;
  int split_keys = 0;
  int rows = 0;                 // PrefillParams::pack_rows
  int64_t workspace_floats = 0; // pack_partial_o then pack_partial_lse
};
PackSplitPlan paged_pack_split_plan(const PrefillParams& p, int requested_splits);

// All return cudaSuccess or the launch error; they never synchronize.
cudaError_t launch_prefill_wmma(const PrefillParams& p, cudaStream_t stream);
cudaError_t launch_prefill_fast(const PrefillParams& p, cudaStream_t stream);
// Varlen queries (cu_seqlens_q) against paged K/V (block_tables, context_lens):
// the fast prefill mainloop with a gathering K/V tile loader.
cudaError_t launch_prefill_paged(const PrefillParams& p, cudaStream_t stream);

// Paged decode: one query token per sequence against its paged KV history.
// q [B, Hq, D]; caches [num_blocks, block_size, Hkv, D] (any strides, last dim
// contiguous, 16-byte aligned rows); block_tables int32 [B, max_blocks];
// context_lens int32 [B]; o [B, Hq, D].
struct DecodeParams {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  void* o;
  const int32_t* block_tables;
  const int32_t* context_lens;
  // split-KV workspace, used when num_splits > 1 (sequence b's first n rows of each head):
  // partial_o [B, Hq, num_splits, D] (normalised), partial_lse [B, Hq, num_splits] (log2 domain)
  float* partial_o;
  float* partial_lse;
  // Optional log-sum-exp output [B, Hq] (float32, natural log, -inf for an
  // empty context), row b at lse + b * lse_batch_stride; nullptr: not written.
  float* lse;
  int64_t lse_batch_stride;
  int64_t q_batch_stride, q_head_stride;
  int64_t o_batch_stride, o_head_stride;
  int64_t k_block_stride, k_token_stride, k_head_stride;
  int64_t v_block_stride, v_token_stride, v_head_stride;
  int64_t block_table_stride;
  int batch;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;        // 64 or 128
  int block_size;      // power of two, 1..256
  int max_blocks;      // block_tables.shape[1]
  // Split-KV, filled by decode_plan(): num_splits CTAs per (sequence, KV head chunk) at most.
  // A sequence of ctx tokens (clamped to the table) takes n = min(num_splits, ceil(ctx /
  // split_min_tokens)) of them (at least 1), each a run of ceil(ctx / n) tokens rounded up to
  // split_align (the kernel's tokens per iteration); the CTAs past its n return at once. So a
  // short sequence in a table sized for long ones neither splits into slivers nor leaves its
  // CTAs idle, and a long sequence among short ones is split although the host does not know
  // the lengths. tokens_per_split: the split of a sequence that fills the table, the size the
  // kernels guess before context_lens arrives (n = 1: the whole table).
  int num_splits;
  int tokens_per_split;
  int split_min_tokens;
  int split_align;
  int split_guess_ctx;  // from ctx > split_guess_ctx on, a sequence's splits are the guess's
  // > 0 (decode_plan: plain decode over more than half a wave of CTAs in a table 3+ split-byte
  // caps wide, when decode_worklist_wanted):
  // the grid's y is `worklist` work slots per KV head chunk (batch * num_splits of them), not
  // (batch, split). A first one-CTA kernel (decode/worklist.cuh) derives the plan from
  // context_lens into worklist_plan: runs of t >= ceil(total / (worklist - batch)) tokens
  // (decode_worklist_run has the other bounds), sequence b takes n_b = ceil(ctx_b / t) slots,
  // consecutive in b order, so sum n_b <= worklist. The idle CTAs of short sequences thus
  // split the long ones. Partials are [Hq, worklist] rows (head h, slot) instead of
  // [B, Hq, splits].
  int worklist;
  // The plan (worklist > 0): int4 per slot, then int2 per sequence, after the partials in the
  // split workspace (decode_set_workspace).
  int32_t* worklist_plan;
  float scale;         // softmax scale, not yet multiplied by log2(e)
  DType dtype;
  int num_sms;
  int cc_major;        // compute capability of the device (9: programmatic dependent launch)
  int variant;         // 0: tuned default; >0 selects alternative tilings (benchmarking only)
  // FP8 caches: float8_e4m3fn bytes (the cache strides count bytes); a stored
  // element of KV head h is worth stored * k_scale[h] (V: v_scale[h]);
  // k_scale/v_scale are float32 [num_kv_heads]. false: caches of `dtype`.
  bool kv_fp8;
  const float* k_scale;
  const float* v_scale;
  // One-launch split reduction (DecodePlan::fused with num_splits > 1): int32
  // arrival counters, decode_split_counter_count() of them, zero before the
  // call and zero again after it (the last CTA of each group resets its own).
  // nullptr otherwise.
  int32_t* split_counters;
  // Packed queries (the q_len == 1 rows of a paged batch, paged_decode_params):
  // int32 [batch + 1]. Sequence b is then handled only if
  // cu_seqlens_q[b+1] - cu_seqlens_q[b] == 1, and its q, o and lse row is
  // cu_seqlens_q[b] (q/o/lse_batch_stride are the row strides of the packed
  // [total_q, Hq, D] / [total_q, Hq] tensors); the CTAs of every other sequence,
  // split reduction included, return without writing. Block tables,
  // context_lens and the split workspace stay indexed by sequence. decode_plan
  // then picks the tiling-0 kernels with the two-launch reduction whatever
  // `variant` says (the only instantiations that read this field).
  // nullptr: plain decode, row b is sequence b.
  const int32_t* cu_seqlens_q;
  // Short query runs (speculative verification; the paged routing, paged_spec_decode_params):
  // with max_seqlen_q >= 2 and cu_seqlens_q, sequence b is handled iff 2 <= q_len <= max_seqlen_q
  // (q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b]). The (query i, head j) pairs of one KV group,
  // q_len * G <= 32 of them, are the rows r = i * G + j of one tensor-core kernel CTA; query i
  // (q/o/lse row cu_seqlens_q[b] + i) sees keys [0, context_len - q_len + i + 1) when causal
  // (bottom-right, as paged attention) and every key otherwise. The split workspace holds
  // max_seqlen_q query rows per sequence: partial row ((b * max_seqlen_q + i) * Hq + head) *
  // num_splits + split. 0: one query per sequence (every field above as described there).
  int max_seqlen_q;
  bool causal;
};

// The kernels one decode call runs and how, chosen once by decode_plan.
struct DecodePlan {
  void (*kernel)(const DecodeParams) = nullptr;  // nullptr: no kernel for this head_dim / dtype
  void (*reduce)(const DecodeParams) = nullptr;  // the split-KV reduction
  int group_tile = 1;        // query heads per CTA
  int tokens_per_iter = 32;  // tokens a CTA covers per loop iteration (split sizes are multiples)
  int smem_bytes = 0;        // dynamic shared memory
  int threads = 128;         // threads per CTA of kernel and worklist_kernel
  // The kernel merges the splits itself (its last CTA per group, through
  // p.split_counters) and `reduce` is not launched.
  bool fused = false;
  // The twins of kernel and reduce for a work-list plan (DecodeParams::worklist > 0; the
  // default two-launch kernels only, nullptr elsewhere): the same kernels with the slot mapping
  // of decode/worklist.cuh compiled in, so that the kernels without it stay as they were.
  void (*worklist_kernel)(const DecodeParams) = nullptr;
  void (*worklist_reduce)(const DecodeParams) = nullptr;
  void (*worklist_reduce_grouped)(const DecodeParams) = nullptr;  // kWorklistMergeSeqs per CTA
  // reduce and worklist_reduce with one warp per query head (kDecodeVariantWarpMerge)
  void (*reduce_warps)(const DecodeParams) = nullptr;
  void (*worklist_reduce_warps)(const DecodeParams) = nullptr;
};

// Chooses the kernel (dtype, head dim, GQA group, p.variant) and
// num_splits / tokens_per_split from B, Hkv, the table capacity
// (max_blocks * block_size) and the SM count; reads no device memory. Also
// raises the chosen kernel's dynamic shared-memory limit on the current device.
// `requested_splits` > 0 forces a split count (benchmarking).
DecodePlan decode_plan(DecodeParams& p, int requested_splits);

// The decode work list (DecodeParams::worklist) wherever decode_plan's gate allows one: on by
// default, since it takes one long sequence among short ones to 0.51-0.66x of its time without
// it and costs the gated rows of equal or random lengths 0-1.3%, short sequences in a wide
// table 3-6% (bench/results/nvidia-h100/decode_worklist_gate_c9baf75).
// A build with -DMINIPAGED_DECODE_WORKLIST_DEFAULT=0 (e.g. through MINIPAGED_NVCC_FLAGS) turns
// it off for a whole-grid A/B; the variant bit kDecodeVariantWorklistToggle (benchmarking and
// tests) flips it for one call either way.
#ifndef MINIPAGED_DECODE_WORKLIST_DEFAULT
#define MINIPAGED_DECODE_WORKLIST_DEFAULT 1
#endif
constexpr bool kDecodeWorklistByDefault = MINIPAGED_DECODE_WORKLIST_DEFAULT != 0;
constexpr int kDecodeVariantWorklistToggle = 0x1000;
// A work list's sequences spread their context evenly over their slots by default
// (decode_worklist_seq_splits); this bit gives them runs of the plan's t tokens instead, the
// last shorter, for an A/B (on an H100 the even runs took FP8 B=32 L=32k random lengths from
// 1.062x to 1.016x of the plan without a work list, other rows within 0.3%:
// bench/results/nvidia-h100/decode_worklist_evenruns_c44c088).
constexpr int kDecodeVariantWorklistFixedRuns = 0x8000;
// Early merge and early trigger, on by default together (each bit flips its own for one call;
// MINIPAGED_DECODE_WORKLIST_EARLY_MERGE=0 / MINIPAGED_DECODE_EARLY_TRIGGER=0 turn them off for a
// build). Early merge: a work list's merge CTAs read their sequence's plan entry before they wait
// for the split kernel, so those of one-slot sequences return at once, as the plain merge's do.
// Early trigger: the split kernels let their merge grid launch (griddepcontrol.launch_dependents)
// as each CTA starts (a work list's after its plan wait: the early read needs the planner's grid
// complete), not as its loop ends, so the merge's CTAs are resident before the split kernel
// drains. No merge CTA reads a partial before the split grid has completed either way.
// On an H100, in one binary: each alone left every row within noise; together they took the
// gated work-list rows 0-2% faster, none slower (one long FP8 sequence among 127: 133.0 -> 130.4
// us, short sequences in a wide table 1.031 -> 1.024 of the plan without a list) and the other
// rows within noise (bench/results/nvidia-h100/decode_early_trigger_221aba8).
#ifndef MINIPAGED_DECODE_WORKLIST_EARLY_MERGE
#define MINIPAGED_DECODE_WORKLIST_EARLY_MERGE 1
#endif
constexpr int kDecodeVariantWorklistEarlyMerge = 0x4000;
constexpr bool kDecodeWorklistEarlyMergeByDefault = MINIPAGED_DECODE_WORKLIST_EARLY_MERGE != 0;
#ifndef MINIPAGED_DECODE_EARLY_TRIGGER
#define MINIPAGED_DECODE_EARLY_TRIGGER 1
#endif
constexpr int kDecodeVariantEarlyTrigger = 0x2000;
constexpr bool kDecodeEarlyTriggerByDefault = MINIPAGED_DECODE_EARLY_TRIGGER != 0;
// Grouped merge (on by default where it pays, decode/launch.cu worklist_merge_seqs_per_cta; this
// bit flips the choice for one call, MINIPAGED_DECODE_WORKLIST_GROUPED_MERGE=0 turns it off for a
// build): a work list's merge grid takes kWorklistMergeSeqs (4) sequences per CTA instead of one,
// and each CTA merges those of its sequences that took 2+ slots in turn. A per-CTA trace
// (bench/results/nvidia-h100/decode_trace_2500b1e) put the cost of short sequences in a wide
// table in the merge: B=256 L=16k dispatches 4,096 merge CTAs after the split kernel's last CTA
// exits, nearly all of which return at once. Timed in one binary
// (bench/results/nvidia-h100/decode_grouped_merge_2bb6e7f), grouping was faster at B=256 and
// B=128, mixed at B=64 and slower at B=32, where the grouped grid (128 CTAs) is smaller than the
// GPU; hence the rule: grouped only where its grid still gives every SM two CTAs.
#ifndef MINIPAGED_DECODE_WORKLIST_GROUPED_MERGE
#define MINIPAGED_DECODE_WORKLIST_GROUPED_MERGE 1
#endif
constexpr int kDecodeVariantWorklistGroupedMerge = 0x10000;
constexpr bool kDecodeWorklistGroupedMergeByDefault = MINIPAGED_DECODE_WORKLIST_GROUPED_MERGE != 0;
// Two-warp CTAs (decode/launch.cu with_two_warp): the default tensor-core plan (16-bit caches;
// FP8 ones from G 3) runs its kernel in CTAs of 2 warps (benchmarking tilings 22 and, FP8, 23:
// 6 CTAs per SM against 2, FP8 3) wherever one CTA per (sequence, KV head, head chunk) already
// overflows a wave of the 4-warp kernel's CTAs, in a table of at most
// kDecodeTwoWarpMaxTableTokens tokens: a two-warp CTA streams its run at half the 4-warp CTA's
// rate in one wave, so past short contexts the longest run decides (16-bit at 8k tokens and FP8
// batches of random lengths up to 16k read slower: bench/results/nvidia-h100/
// decode_two_warp_ab_2716344). Per cache dtype, MINIPAGED_DECODE_TWO_WARP (16-bit) and
// MINIPAGED_DECODE_TWO_WARP_FP8 turn it on for a build; the bit flips it for a call. Off for
// both: 16-bit lost B=64 L=512 at random lengths (decode_two_warp_short_rand_da69756), FP8 under
// the cap lost B=64-256 L=1008 at random lengths by 3-6% and B=128 L=1008 at equal ones by 8%,
// where 2.6 waves of 4-warp CTAs become 1.3 of two-warp ones (decode_two_warp_fp8_cap_454c3f8).
// The cap may be raised for a benchmarking build (MINIPAGED_DECODE_TWO_WARP_MAX_TABLE_TOKENS, up
// to the static_assert in with_two_warp).
#ifndef MINIPAGED_DECODE_TWO_WARP
#define MINIPAGED_DECODE_TWO_WARP 0
#endif
#ifndef MINIPAGED_DECODE_TWO_WARP_FP8
#define MINIPAGED_DECODE_TWO_WARP_FP8 0
#endif
#ifndef MINIPAGED_DECODE_TWO_WARP_MAX_TABLE_TOKENS
#define MINIPAGED_DECODE_TWO_WARP_MAX_TABLE_TOKENS 1024
#endif
constexpr int64_t kDecodeTwoWarpMaxTableTokens = MINIPAGED_DECODE_TWO_WARP_MAX_TABLE_TOKENS;
constexpr int kDecodeVariantTwoWarpToggle = 0x20000;
inline bool decode_two_warp_wanted(bool kv_fp8, int variant) {
  const bool by_default = kv_fp8 ? MINIPAGED_DECODE_TWO_WARP_FP8 != 0 : MINIPAGED_DECODE_TWO_WARP != 0;
  return by_default != ((variant & kDecodeVariantTwoWarpToggle) != 0);
}
// Warp merge: the split merge runs one warp per (sequence, query head) and one CTA per 8 heads
// (decode/reduce.cuh merge_split_row_warp, the same arithmetic bit for bit) instead of one
// 256-thread CTA per (sequence, query head). decode/splits.h decode_warp_merge_by_rule picks it where
// many rows have few splits each; the bit flips that choice for a call (a work list then takes
// the warp merge in place of its own).
constexpr int kDecodeVariantWarpMerge = 0x40000;
// Short FP8 ring: the G = 2 FP8 tensor-core kernel (32-token tiles, decode/select.cuh
// fp8_wide_mma) with a 2-stage ring in place of 3 over pages of at least
// kDecodeFp8ShortRingMinPage tokens. With the same bytes at the same addresses, the 3-stage ring
// took 1.04x its 16-token-page time over 64-token pages, and the 2-stage ring 0.99x: ahead of
// both (H100, contiguous pages, B=32 and B=64: bench/results/nvidia-h100/
// decode_fp8_page_cause_f1ade67). Off until shuffled pages on every grid row say the same;
// MINIPAGED_DECODE_FP8_SHORT_RING turns it on for a build, the bit flips it for a call (plain,
// work-list, fused and packed-query plans alike).
#ifndef MINIPAGED_DECODE_FP8_SHORT_RING
#define MINIPAGED_DECODE_FP8_SHORT_RING 0
#endif
constexpr int kDecodeFp8ShortRingMinPage = 64;
constexpr int kDecodeVariantFp8ShortRing = 0x80000;
inline bool decode_fp8_short_ring_wanted(int block_size, int variant) {
  const bool on = (MINIPAGED_DECODE_FP8_SHORT_RING != 0) != ((variant & kDecodeVariantFp8ShortRing) != 0);
  return on && block_size >= kDecodeFp8ShortRingMinPage;
}
inline bool decode_worklist_wanted(int variant) {
  return kDecodeWorklistByDefault != ((variant & kDecodeVariantWorklistToggle) != 0);
}

// Arrival counters a fused plan needs (one per sequence, KV head and head
// chunk); 0 when the plan is not fused or does not split.
int64_t decode_split_counter_count(const DecodeParams& p, const DecodePlan& plan);

// Launches the planned decode (plus the split-KV reduction when
// num_splits > 1) for the p that decode_plan filled. Never syncs.
cudaError_t launch_decode(const DecodeParams& p, const DecodePlan& plan, cudaStream_t stream);

// Paged decode routing (issue #13, on by default; prefill/dispatch.cuh has the switch,
// kPagedDecodeRoutingByDefault, and PrefillParams variant 4 forces it on):
// whether launch_prefill_paged(p) leaves every q_len == 1 sequence of p to the
// decode kernels, decided from what the host knows (the q_lens live on the
// device: each kernel's CTAs find their own sequences). When true the caller
// runs, on the same stream, launch_prefill_paged(p) and launch_decode with
// d = paged_decode_params(p, ...) and decode_plan(d, ...) (plus the split
// workspace that plan needs). They write disjoint rows (the prefill kernels
// keep only q_len >= 2), so either order is correct; binding.cpp runs the
// prefill launcher first because it also validates strides and alignment.
// Defined in prefill/paged.cu. The caller may skip launch_decode where no
// q_len can be 1 (paged_min_seqlen_q(p) >= 2).
bool paged_decode_routing(const PrefillParams& p);

// The least q_len any sequence of paged p can have, from what the host knows:
// the q_lens of its `batch` sequences sum to total_q (cu_seqlens_q ends at Tq)
// and none exceeds max_seqlen_q. A uniform batch (every chunk one length) or a
// single sequence thereby skips the launches of row classes it cannot hold
// (the decode rows, the packed short runs), each an empty grid that costs a
// few microseconds even in a CUDA graph.
inline int64_t paged_min_seqlen_q(const PrefillParams& p) {
  if (p.batch <= 0) return 0;
  const int64_t rest = int64_t(p.batch - 1) * p.max_seqlen_q;
  return p.total_q > rest ? p.total_q - rest : 0;
}

// The decode parameters of the q_len == 1 rows of paged p (see
// DecodeParams::cu_seqlens_q); workspace, counters and the plan are the
// caller's. Decode semantics equal paged ones for such a row, causal or not:
// its one query is the last of the context and sees all context_lens[b] keys.
inline DecodeParams paged_decode_params(const PrefillParams& p, int cc_major) {
  DecodeParams d{};
  d.q = p.q;
  d.k_cache = p.k;
  d.v_cache = p.v;
  d.o = p.o;
  d.block_tables = p.block_tables;
  d.context_lens = p.context_lens;
  d.cu_seqlens_q = p.cu_seqlens_q;
  d.lse = p.lse;
  d.lse_batch_stride = p.lse_row_stride;  // head stride 1 (paged_decode_routing requires it)
  d.q_batch_stride = p.q_row_stride, d.q_head_stride = p.q_head_stride;
  d.o_batch_stride = p.o_row_stride, d.o_head_stride = p.o_head_stride;
  d.k_block_stride = p.k_block_stride, d.k_token_stride = p.k_row_stride, d.k_head_stride = p.k_head_stride;
  d.v_block_stride = p.v_block_stride, d.v_token_stride = p.v_row_stride, d.v_head_stride = p.v_head_stride;
  d.block_table_stride = p.block_table_stride;
  d.batch = p.batch;
  d.num_q_heads = p.num_q_heads;
  d.num_kv_heads = p.num_kv_heads;
  d.head_dim = p.head_dim;
  d.block_size = p.block_size;
  d.max_blocks = p.max_blocks;
  d.scale = p.scale;
  d.dtype = p.dtype;
  d.num_sms = p.num_sms;
  d.cc_major = cc_major;
  d.variant = p.decode_variant;
  d.kv_fp8 = p.kv_fp8;
  d.k_scale = p.k_scale;
  d.v_scale = p.v_scale;
  return d;
}

// Query rows per sequence in a decode call's split workspace and reduction grid.
inline int decode_query_rows(const DecodeParams& d) { return d.max_seqlen_q >= 2 ? d.max_seqlen_q : 1; }

// Floats of the partials (partial_o then partial_lse) of a planned decode; 0 without splits.
inline int64_t decode_partial_floats(const DecodeParams& d) {
  if (d.num_splits <= 1) return 0;
  return static_cast<int64_t>(d.batch) * decode_query_rows(d) * d.num_q_heads * d.num_splits * (d.head_dim + 1);
}

// 4-byte words of split workspace a planned decode needs (the partials, then a work list's
// plan: 4 per slot and 2 per sequence, from a 16-byte boundary); 0 without splits.
inline int64_t decode_workspace_floats(const DecodeParams& d) {
  const int64_t partials = decode_partial_floats(d);
  if (d.worklist <= 0 || partials == 0) return partials;
  return (partials + 3) / 4 * 4 + 4 * static_cast<int64_t>(d.worklist) + 2 * static_cast<int64_t>(d.batch);
}

// Points d's partial_o / partial_lse (and worklist_plan) into `workspace`, 16-byte aligned,
// of decode_workspace_floats(d) words.
inline void decode_set_workspace(DecodeParams& d, float* workspace) {
  d.partial_o = workspace;
  d.partial_lse = workspace + static_cast<int64_t>(d.batch) * decode_query_rows(d) * d.num_q_heads * d.num_splits *
                                  d.head_dim;
  d.worklist_plan = d.worklist > 0 ? reinterpret_cast<int32_t*>(workspace + (decode_partial_floats(d) + 3) / 4 * 4)
                                   : nullptr;
}

// The decode parameters of the short runs (q_len 2..max_seqlen_q) of paged p, for the
// tensor-core decode kernel (DecodeParams::max_seqlen_q); as paged_decode_params otherwise.
inline DecodeParams paged_spec_decode_params(const PrefillParams& p, int cc_major, int max_seqlen_q) {
  DecodeParams d = paged_decode_params(p, cc_major);
  d.max_seqlen_q = max_seqlen_q;
  d.causal = p.causal;
  return d;
}

// Whether the routed launches of paged p (paged_decode_routing) give its short query runs
// (q_len 2..16) to the tensor-core decode kernel (paged_spec_decode_params) instead of the
// GQA-packed prefill kernel; launch_prefill_paged then leaves them alone. Defined in
// prefill/paged.cu, from host-known values.
bool paged_spec_decode(const PrefillParams& p);

// Everything a routed paged call (paged_decode_routing(p)) launches after launch_prefill_paged(p),
// on the same stream: the decode kernels for its q_len == 1 rows, where some sequence can have
// q_len 1, and for its short runs, where paged_spec_decode(p); each with decode_plan's split plan
// (requested_splits as there) and a split workspace of `floats` floats from workspace(floats,
// ctx), which must stay valid until the launches have run (in stream order) and may return
// nullptr for cudaErrorMemoryAllocation. The one owner of that sequence for binding.cpp and the
// selftests. Defined in prefill/paged.cu.
using DecodeWorkspaceFn = float* (*)(int64_t floats, void* ctx);
cudaError_t launch_paged_routed_decodes(const PrefillParams& p, int cc_major, int requested_splits,
                                        DecodeWorkspaceFn workspace, void* ctx, cudaStream_t stream);

// Scatter new K/V rows into the paged caches: row t goes to slot
// slot_mapping[t] = block * block_size + offset; a negative slot is skipped.
struct WriteKVParams {
  const void* k;
  const void* v;
  void* k_cache;
  void* v_cache;
  const void* slot_mapping;  // int32 or int64 [T]
  bool slot_is_int64;
  int64_t k_token_stride, k_head_stride;
  int64_t v_token_stride, v_head_stride;
  int64_t kc_block_stride, kc_token_stride, kc_head_stride;
  int64_t vc_block_stride, vc_token_stride, vc_head_stride;
  int64_t num_slots;  // num_blocks * block_size: slots at or past it are skipped too
  int num_tokens;
  int num_kv_heads;
  int head_dim;
  int block_size;
  int elem_bytes;  // of k/v: 2 (fp16/bf16) or 4
  // FP8 caches: each element is stored as e4m3(k / k_scale[h]) (v / v_scale[h]),
  // rounded to nearest even and saturated at +-448; k/v are then float16
  // (src_dtype kFloat16), bfloat16 (kBFloat16) or float32 (elem_bytes 4), and
  // the cache strides count bytes. false: a plain copy of elem_bytes elements.
  bool cache_fp8;
  DType src_dtype;  // of k/v when elem_bytes == 2 (fp8 caches only)
  const float* k_scale;
  const float* v_scale;
};

cudaError_t launch_write_kv_cache(const WriteKVParams& p, cudaStream_t stream);


}  // namespace minipaged
