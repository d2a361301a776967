// Launcher of the fast prefill (dense + varlen): validates what the kernel
// relies on, then dispatches on dtype; the slice of that dtype (prefill/fast_*.cu) dispatches
// on head dim, causal and a shape heuristic.
#include <cmath>
#include <cstdint>

#include "prefill/dispatch.cuh"
#include "prefill/slice.h"

namespace minipaged {

cudaError_t launch_prefill_fast(const PrefillParams& p, cudaStream_t stream) {
  using namespace fast;
  if (p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0) return cudaErrorInvalidValue;
  if (p.batch < 0 || p.max_seqlen_q < 0 || p.max_seqlen_k < 0) return cudaErrorInvalidValue;
  // The kernels track the row max of raw scores, which is the max of the
  // scaled ones only for a positive scale.
  if (!(p.scale > 0.f) || !std::isfinite(p.scale)) return cudaErrorInvalidValue;
  // Every row is moved in 16-byte cp.async / vector stores, so every stride
  // that is actually used (its extent is > 1) must be a multiple of 8 elements.
  const bool varlen = p.cu_seqlens_q != nullptr;
  const bool many_b = !varlen && p.batch > 1;
  const bool many_q_rows = varlen || p.max_seqlen_q > 1;
  const bool many_k_rows = varlen || p.max_seqlen_k > 1;
  const struct { int64_t stride; bool used; } strides[] = {
      {p.q_batch_stride, many_b}, {p.q_head_stride, p.num_q_heads > 1}, {p.q_row_stride, many_q_rows},
      {p.k_batch_stride, many_b}, {p.k_head_stride, p.num_kv_heads > 1}, {p.k_row_stride, many_k_rows},
      {p.v_batch_stride, many_b}, {p.v_head_stride, p.num_kv_heads > 1}, {p.v_row_stride, many_k_rows},
      {p.o_batch_stride, many_b}, {p.o_head_stride, p.num_q_heads > 1}, {p.o_row_stride, many_q_rows}};
  for (const auto& s : strides)
    if (s.used && s.stride % 8 != 0) return cudaErrorMisalignedAddress;
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v) || !aligned16(p.o))
    return cudaErrorMisalignedAddress;
  switch (p.dtype) {
    case DType::kFloat16: return prefill_slice::dense<__half>(p, stream);
    case DType::kBFloat16: return prefill_slice::dense<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace minipaged
