// The per-(q dtype, cache dtype) entry points of the fast prefill kernels, defined in
// prefill/slice.cuh and instantiated by prefill/fast_*.cu and prefill/paged_*_kv*.cu: the
// launchers (prefill/fast.cu, prefill/paged.cu) check, plan and call them without compiling any
// kernel themselves, so the kernels build in parallel units.
#pragma once
#include "params.h"

namespace minipaged {
namespace prefill_slice {

// Dense and varlen prefill of T queries (head dim 64 or 128, causal or not).
template <typename T>
cudaError_t dense(const PrefillParams& p, cudaStream_t stream);

// Paged attention of T queries over 16-bit caches of T.
template <typename T>
cudaError_t paged(const PrefillParams& p, cudaStream_t stream);

// Paged attention of T queries over FP8 (e4m3) caches; the caller has checked the scales.
template <typename T>
cudaError_t paged_fp8(const PrefillParams& p, cudaStream_t stream);

// Resident CTAs per SM of the GQA-packed kernel (its KV-split twin) at this head dim over
// 16-bit (kFp8 false) or FP8 caches, from the occupancy calculator, once per device.
template <typename T, bool kFp8>
int packed_ctas_per_sm(int head_dim);

}  // namespace prefill_slice
}  // namespace minipaged
