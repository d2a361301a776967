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

}  // namespace minipaged
