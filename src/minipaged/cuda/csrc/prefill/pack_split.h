// The arithmetic of the packed kernel's KV split plan (paged_pack_split_plan in
// prefill/paged.cu): plain C++, no CUDA and no torch, so the CPU tests compile and check it.
#pragma once
#include <algorithm>
#include <cstdint>

namespace minipaged {

struct PackSplitCount {
  int splits = 1;
  int split_keys = 0;  // a multiple of block_n; 0 without a split
};

// Splits of `ctas` packed CTAs over a block table of `capacity` keys. requested > 0 forces
// about that many; otherwise enough to fill `resident_ctas` slots once, with at least
// min_split_keys keys of the capacity per split. At most max_splits, and no split starts past
// the capacity: split s covers keys [s * split_keys, (s + 1) * split_keys). {1, 0}: no split.
inline PackSplitCount pack_split_count(int64_t ctas, int64_t capacity, int64_t resident_ctas, int requested,
                                       int block_n, int64_t min_split_keys, int max_splits) {
  PackSplitCount out;
  if (ctas <= 0 || capacity <= 0 || block_n <= 0 || min_split_keys <= 0) return out;
  int64_t splits = requested > 0 ? requested
                                 : std::min(resident_ctas / ctas, (capacity + min_split_keys - 1) / min_split_keys);
  splits = std::min<int64_t>(splits, max_splits);
  if (splits <= 1) return out;
  const int64_t tiles = (capacity + block_n - 1) / block_n;
  const int64_t split_keys = (tiles + splits - 1) / splits * block_n;
  splits = (capacity + split_keys - 1) / split_keys;
  if (splits <= 1) return out;
  out.splits = static_cast<int>(splits);
  out.split_keys = static_cast<int>(split_keys);
  return out;
}

}  // namespace minipaged
