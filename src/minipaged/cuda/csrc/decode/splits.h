// Split-KV arithmetic of the decode kernels, shared by the host plan (decode/launch.cu) and the
// kernels (decode/common.cuh, decode/reduce.cuh), and compiled on its own by the CPU tests'
// host probe (tests/test_cuda_build.py).
#pragma once
#include <algorithm>
#include <cstdint>

#include "params.h"

#if defined(__CUDACC__)
#define MINIPAGED_HD __host__ __device__ __forceinline__
#else
#define MINIPAGED_HD inline
#endif

namespace minipaged {

// Splits of a sequence of ctx tokens (0 <= ctx <= capacity) and the tokens of each, by the
// rule of DecodeParams::split_min_tokens. Past split_guess_ctx the table-filling plan holds
// (num_splits runs of tokens_per_split), so long sequences skip the two divisions.
struct SeqSplits {
  int count, run;
};
MINIPAGED_HD SeqSplits decode_seq_splits(const DecodeParams& p, int ctx, int capacity) {
  if (ctx > p.split_guess_ctx) return {p.num_splits, p.tokens_per_split};
#if defined(__CUDACC__)
  const int n = max(1, min(p.num_splits, (ctx + p.split_min_tokens - 1) / p.split_min_tokens));
#else
  const int n = std::max(1, std::min(p.num_splits, (ctx + p.split_min_tokens - 1) / p.split_min_tokens));
#endif
  if (n == 1) return {1, capacity};
  const int even = (ctx + n - 1) / n;
  return {n, (even + p.split_align - 1) / p.split_align * p.split_align};
}

// DecodeParams::split_guess_ctx of a plan whose other split fields are set: a sequence takes
// the table-filling plan's runs exactly when ceil(ctx / split_min_tokens) >= num_splits and
// ceil(ctx / num_splits), rounded up to split_align, is tokens_per_split (the most it can be),
// i.e. past both thresholds below. One split: always (its run is the whole table).
inline void decode_set_split_guess(DecodeParams& p) {
  if (p.num_splits <= 1) {
    p.split_guess_ctx = -1;
    return;
  }
  const int64_t all_splits = static_cast<int64_t>(p.num_splits - 1) * p.split_min_tokens;
  const int64_t full_runs = static_cast<int64_t>(p.num_splits) * (p.tokens_per_split - p.split_align);
  const int64_t guess = all_splits > full_runs ? all_splits : full_runs;
  p.split_guess_ctx = static_cast<int>(guess < INT32_MAX ? guess : INT32_MAX);
}

// The runs of a plan of `splits` splits (1..kMaxSplits) over a table of `capacity` tokens, each
// a multiple of `align` tokens and none shorter than `min_tokens` (a multiple of align):
// num_splits, tokens_per_split (the table-filling sequence's run), split_min_tokens,
// split_align and split_guess_ctx.
inline void decode_split_runs(DecodeParams& p, int64_t capacity, int64_t splits, int64_t min_tokens, int64_t align) {
  p.split_min_tokens = static_cast<int>(min_tokens);
  p.split_align = static_cast<int>(align);
  if (capacity == 0) {
    p.num_splits = 1;
    p.tokens_per_split = 0;
    p.split_guess_ctx = -1;
    return;
  }
  splits = splits < capacity ? splits : capacity;
  int64_t per_split = (capacity + splits - 1) / splits;
  if (splits > 1) per_split = (per_split + align - 1) / align * align;  // whole CTA iterations
  p.num_splits = static_cast<int>((capacity + per_split - 1) / per_split);
  // (one split, although rounding the run up to align took it past the table: the whole table)
  p.tokens_per_split = static_cast<int>(p.num_splits > 1 ? per_split : capacity);
  decode_set_split_guess(p);
}

// Work-list slots per sequence of a plain decode plan (decode_plan: the grid is B x that many
// slots), 0 for none. Only over more than half a wave of CTAs (`ctas` whole sequences against
// `slots` resident CTAs; below, the per-sequence splits fill the wave) and in a table at least
// three split caps (`min_tokens`) wide. Then max(splits, 2), `splits` being the plan's count
// after its wave cap: where the cap leaves one or two per sequence (batches of 8+ waves), 2B
// slots still cut every run to the batch's mean length (decode_worklist_run), so one long
// sequence does not stream alone through the end of the call.
MINIPAGED_HD int64_t decode_worklist_splits(int64_t ctas, int64_t slots, int64_t splits, int64_t capacity,
                                            int64_t min_tokens) {
  if (2 * ctas <= slots || min_tokens <= 0 || (capacity + min_tokens - 1) / min_tokens < 3) return 0;
  return splits < 2 ? 2 : splits;
}

// Work-list splits (DecodeParams::worklist > 0): the run of every split for a batch of
// `total` cached tokens. At least total / (worklist - batch), so that
// sum_b max(1, ceil(ctx_b / t)) <= total / t + batch <= worklist; at least the mean length up
// to split_min_tokens (the 2 MB cap of the per-sequence rule), so that a batch of equal lengths
// is cut no further than that rule cuts it, while a sequence much longer than the others is
// (a floor of twice the mean measured 1.13x slower on one long sequence among 63 short ones:
// bench/results/nvidia-h200/decode_worklist_a49fe9c/); and at least capacity / max_splits, so
// that no sequence needs more splits than one merge takes.
MINIPAGED_HD int64_t decode_worklist_run(const DecodeParams& p, int64_t total, int max_splits) {
  const int64_t extra = p.worklist - p.batch;  // >= 1: decode_plan sets worklist > batch
  const int64_t capacity = static_cast<int64_t>(p.max_blocks) * p.block_size;
  int64_t t = (total + extra - 1) / extra;
  int64_t floor = total / (p.batch > 0 ? p.batch : 1);
  if (floor > p.split_min_tokens) floor = p.split_min_tokens;
  if (t < floor) t = floor;
  if (t < (capacity + max_splits - 1) / max_splits) t = (capacity + max_splits - 1) / max_splits;
  if (t > capacity) t = capacity;  // (one split per sequence)
  t = (t + p.split_align - 1) / p.split_align * p.split_align;
  return t > 0 ? t : p.split_align;
}
// Slots of a sequence of ctx tokens (0 <= ctx <= capacity) under runs of t: at least 1.
MINIPAGED_HD int decode_worklist_count(int ctx, int64_t t) {
  const int64_t n = (static_cast<int64_t>(ctx) + t - 1) / t;
  return n < 1 ? 1 : static_cast<int>(n);
}
// The slots of a sequence of ctx tokens under the plan's run t (a multiple of align) and the
// run of each. `even` true (the default plan): decode_worklist_count(ctx, t) slots that share
// ctx evenly (ceil(ctx / n), rounded up to align: at most t), as the per-sequence rule's splits
// do (decode_seq_splits), so that a sequence of 1.5 t tokens is two runs of 0.75 t, not t and
// 0.5 t: runs of exactly t leave more CTAs at the longest run (FP8 pages, random lengths: 1.062x
// the plan without a work list, 1.016x with even runs). `even` false (variant bit
// kDecodeVariantWorklistFixedRuns, an A/B): runs of t, the last shorter.
// Rounding up to align may leave fewer slots than that count; the count returned is the run's
// own, so no slot is empty.
MINIPAGED_HD SeqSplits decode_worklist_seq_splits(int ctx, int64_t t, int64_t align, bool even) {
  const int n = decode_worklist_count(ctx, t);
  if (!even || n <= 1) return {n, static_cast<int>(t)};
  const int64_t run = ((static_cast<int64_t>(ctx) + n - 1) / n + align - 1) / align * align;
  return {decode_worklist_count(ctx, run), static_cast<int>(run)};
}

// The split merge's kernel (params.h kDecodeVariantWarpMerge flips the choice) for a merge grid
// of reduce_rows rows (sequences, or their (sequence, query) rows with short query runs): the
// warp merge (one warp per query head, kReduceWarpHeads heads per CTA) where its grid still gives
// half the SMs a CTA and no row has more than kWarpMergeMaxSplits splits, else one CTA per (row,
// query head). A warp merges its row's splits one after another, so a few rows of many splits
// (B=1: 16 heads of 32 splits on 2 CTAs instead of 16) merge slower; many rows of few splits skip
// the CTA merge's barriers and idle warps and launch an eighth of its CTAs. Work lists keep theirs:
// one long sequence's slots among short ones are that few-rows-many-splits case
// (bench/results/nvidia-h100/decode_warp_merge_e8e95bd).
constexpr int kReduceWarpHeads = 8;
constexpr int kWarpMergeMaxSplits = 4;
MINIPAGED_HD bool decode_warp_merge_by_rule(const DecodeParams& p, int64_t reduce_rows) {
  if (p.worklist > 0 || p.num_splits > kWarpMergeMaxSplits) return false;
  const int64_t ctas = reduce_rows * ((p.num_q_heads + kReduceWarpHeads - 1) / kReduceWarpHeads);
  return 2 * ctas >= (p.num_sms > 1 ? p.num_sms : 1);
}

// The plan's limits (decode/worklist.cuh): one sequence per planner thread, and the splits one
// merge takes (decode/reduce.cuh: kMaxSplits). A slot's entry packs b, split and count into 9
// bits each; b = kWorklistNoSeq marks a slot past every sequence's splits.
constexpr int kWorklistPlanThreads = 256;
constexpr int kWorklistMaxBatch = kWorklistPlanThreads;
constexpr int kWorklistMaxSplits = 256;
constexpr int kWorklistNoSeq = 511;
// Sequences per CTA of a grouped work-list merge (params.h kDecodeVariantWorklistGroupedMerge).
constexpr int kWorklistMergeSeqs = 4;
static_assert(kWorklistMaxBatch <= kWorklistNoSeq && kWorklistMaxSplits < 512, "9-bit fields");

struct WorklistEntry {
  int b;      // -1: the slot is past every sequence's splits
  int split;  // of sequence b
  int count;  // slots of sequence b
  int first;  // slot of split 0 of sequence b
  int ctx;    // context length of b, clamped to the table
  int run;    // tokens per split of sequence b (decode_worklist_seq_splits); the plan's run past them
};

// The four words of a slot's entry, as the plan kernel stores them (one 16-byte store, one
// 16-byte load): b | split << 9 | count << 18, ctx, first, run.
struct WorklistWords {
  int x, y, z, w;
};
MINIPAGED_HD WorklistWords decode_worklist_pack(const WorklistEntry& e) {
  const int b = e.b < 0 ? kWorklistNoSeq : e.b;
  return {b | e.split << 9 | e.count << 18, e.ctx, e.first, e.run};
}
MINIPAGED_HD WorklistEntry decode_worklist_unpack(int x, int y, int z, int w) {
  const int b = x & 511;
  return {b == kWorklistNoSeq ? -1 : b, (x >> 9) & 511, (x >> 18) & 511, z, y, w};
}

// The sequence whose slots hold `slot` (0 <= slot < first[batch], the slots in use): the last
// b < batch with first[b] <= slot, first[] increasing from first[0] = 0 (n_b >= 1).
MINIPAGED_HD int decode_worklist_owner(const int* first, int batch, int slot) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (first[mid] <= slot) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace minipaged
