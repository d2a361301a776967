// Launcher of paged attention for any query length: packed varlen queries
// (cu_seqlens_q) against K/V caches [num_blocks, block_size, Hkv, D] read
// through block tables. It runs the fast prefill kernels (mma.sync, or wgmma in
// an sm_90a build on sm_90) with their paged K/V tile loader, so the mask,
// softmax and epilogue are the prefill ones: bottom-right causal per sequence
// (row i of a q_len-row sequence sees key j iff j < context_len - q_len + i + 1),
// exact zeros and lse -inf for a row that sees no key.
// Pure decode batches (every q_len 1) are routed to launch_decode by the
// binding, which owns the split-KV workspace. With the decode routing
// (paged_decode_routing, on by default) the q_len == 1 rows of any batch go to
// launch_decode too (launch_paged_routed_decodes, the caller's second launch), and
// so do, where GQA packing applies, the short runs of 2..16 queries
// (paged_spec_decode: the tensor-core decode kernel, else the packed kernel);
// this launcher keeps the rest, on the tiled kernel.
// FP8 caches (p.kv_fp8) have kernels of their own (prefill_slice::paged_fp8,
// prefill/slice.cuh).
// A batch that may mix short (q_len <= kPackMaxSeqlenQ) and long sequences
// runs two launches, the packed kernel for the short ones and the tiled one
// for the rest (launch_paged_split, prefill/dispatch.cuh); on an sm_90a build
// the tiled kernel of 16-bit caches with pages of >= 8 tokens is the
// warp-specialised TMA kernel (prefill/mainloop_ws.cuh).
// The kernels compile in the slices of prefill/paged_*_kv*.cu (prefill/slice.h), one per
// (q dtype, cache dtype); this unit checks, plans and calls them.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "prefill/dispatch.cuh"
#include "prefill/pack_split.h"
#include "prefill/slice.h"
#include "params.h"

namespace minipaged {
namespace {

cudaError_t dispatch_fp8(const PrefillParams& p, cudaStream_t stream) {
  if (p.k_scale == nullptr || p.v_scale == nullptr) return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kFloat16: return prefill_slice::paged_fp8<__half>(p, stream);
    case DType::kBFloat16: return prefill_slice::paged_fp8<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

bool paged_decode_routing(const PrefillParams& p) { return fast::paged_decode_routing_ok(p); }
bool paged_spec_decode(const PrefillParams& p) { return fast::paged_spec_decode_ok(p); }

cudaError_t launch_paged_routed_decodes(const PrefillParams& p, int cc_major, int requested_splits,
                                        DecodeWorkspaceFn workspace, void* ctx, cudaStream_t stream) {
  if (!fast::paged_decode_routing_ok(p) || p.batch <= 0 || p.max_seqlen_q <= 0) return cudaSuccess;
  auto run = [&](DecodeParams d) {
    const DecodePlan plan = decode_plan(d, requested_splits);
    const int64_t floats = decode_workspace_floats(d);
    if (floats > 0) {
      float* buffer = workspace(floats, ctx);
      if (buffer == nullptr) return cudaErrorMemoryAllocation;
      decode_set_workspace(d, buffer);
    }
    return launch_decode(d, plan, stream);
  };
  if (paged_min_seqlen_q(p) <= 1) {
    const cudaError_t err = run(paged_decode_params(p, cc_major));
    if (err != cudaSuccess) return err;
  }
  if (fast::paged_spec_decode_ok(p)) return run(paged_spec_decode_params(p, cc_major, fast::paged_spec_decode_max_q(p)));
  return cudaSuccess;
}

// Packed KV splits (PrefillParams::pack_splits). A packed CTA owns one (sequence, KV head)
// and is bound by its K/V stream: without splits a speculative batch of B sequences ran
// B * Hkv CTAs (8 at B=1) however long the context. Split until the packed grid fills the
// GPU once at the packed kernel's resident CTAs per SM, with at least kPackMinSplitKeys keys
// of the table's capacity per split (the decode kernels' sizing: the capacity is what the
// host knows; shorter contexts leave their last splits empty).
namespace {
constexpr int64_t kPackMinSplitKeys = 128;

// Resident CTAs per SM of the packed kernel for this call's dtype, head dim and cache (shared
// memory bounds the 16-bit one: 3 of 57 KB on sm_90, not 4), from the slice that compiles it.
template <typename T>
int pack_ctas_per_sm(const PrefillParams& p) {
  return p.kv_fp8 ? prefill_slice::packed_ctas_per_sm<T, true>(p.head_dim)
                  : prefill_slice::packed_ctas_per_sm<T, false>(p.head_dim);
}
}  // namespace

PackSplitPlan paged_pack_split_plan(const PrefillParams& p, int requested_splits) {
  using namespace fast;
  // Every packed config shares CfgPack's rows and keys per tile, whatever T, D and FP8.
  using Pack = CfgPack<__half, 128>;
  static_assert(Pack::kBlockM == Fp8KV<CfgPack<__nv_bfloat16, 64>>::kBlockM &&
                    Pack::kBlockN == Fp8KV<CfgPack<__nv_bfloat16, 64>>::kBlockN,
                "one packed row block and key tile for every packed config");
  PackSplitPlan plan;
  // (the FP8 dispatch packs under variants 0 and 4 only: a variant-3 FP8 call gets an unused plan)
  // (no plan either where the decode kernels take the short runs: paged_spec_decode_ok)
  if (p.num_kv_heads <= 0 || !paged_pack_ok(p) || paged_spec_decode_ok(p) || p.batch <= 0 || p.max_seqlen_q <= 0 ||
      p.max_blocks <= 0 || p.block_size <= 0 || (p.head_dim != 64 && p.head_dim != 128) ||
      paged_min_seqlen_q(p) > kPackMaxSeqlenQ)
    return plan;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int64_t rows = int64_t(std::min(p.max_seqlen_q, kPackMaxSeqlenQ)) * group;
  const int64_t m_blocks = (rows + Pack::kBlockM - 1) / Pack::kBlockM;
  const int64_t ctas = int64_t(p.batch) * p.num_kv_heads * m_blocks;
  const int64_t capacity = int64_t(p.max_blocks) * p.block_size;
  int64_t resident = 0;  // the occupancy query only when the count is not forced
  if (requested_splits <= 0)
    resident = int64_t(p.dtype == DType::kBFloat16 ? pack_ctas_per_sm<__nv_bfloat16>(p) : pack_ctas_per_sm<__half>(p)) *
               sm_count(p);
  const PackSplitCount count =
      pack_split_count(ctas, capacity, resident, requested_splits, Pack::kBlockN, kPackMinSplitKeys, kPackMaxSplits);
  if (count.splits <= 1 || m_blocks * count.splits > 65535) return plan;
  plan.splits = count.splits;
  plan.split_keys = count.split_keys;
  plan.rows = static_cast<int>(m_blocks * Pack::kBlockM);
  plan.workspace_floats = int64_t(p.batch) * p.num_kv_heads * plan.rows * count.splits * (p.head_dim + 1);
  return plan;
}

cudaError_t launch_prefill_paged(const PrefillParams& params, cudaStream_t stream) {
  using namespace fast;
  PrefillParams p = params;
  if (p.cu_seqlens_q == nullptr || p.block_tables == nullptr || p.context_lens == nullptr)
    return cudaErrorInvalidValue;
  if (p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0) return cudaErrorInvalidValue;
  if (p.batch < 0 || p.max_seqlen_q < 0 || p.max_blocks < 0) return cudaErrorInvalidValue;
  if (p.block_size <= 0 || (p.block_size & (p.block_size - 1)) != 0) return cudaErrorInvalidValue;
  // The kernels track the row max of raw scores, which is the max of the
  // scaled ones only for a positive scale.
  if (!(p.scale > 0.f) || !std::isfinite(p.scale)) return cudaErrorInvalidValue;
  // Sequences are located through cu_seqlens_q / the block table only.
  p.cu_seqlens_k = nullptr;
  p.qlen_filter = 0;  // set per launch by launch_paged_split
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = 0;
  p.lse_batch_stride = 0;
  p.max_seqlen_k = p.max_blocks * p.block_size;
  // 16-byte cp.async / vector stores: every stride in elements is a multiple
  // of 8 (of 16 for the byte strides of FP8 caches).
  const int64_t kv_align = p.kv_fp8 ? 16 : 8;
  const int64_t strides[] = {p.q_head_stride, p.q_row_stride, p.o_head_stride, p.o_row_stride};
  const int64_t kv_strides[] = {p.k_head_stride,  p.k_row_stride,  p.k_block_stride,
                                p.v_head_stride,  p.v_row_stride,  p.v_block_stride};
  for (const int64_t s : strides)
    if (s % 8 != 0) return cudaErrorMisalignedAddress;
  for (const int64_t s : kv_strides)
    if (s % kv_align != 0) return cudaErrorMisalignedAddress;
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v) || !aligned16(p.o))
    return cudaErrorMisalignedAddress;
  if (p.kv_fp8) return dispatch_fp8(p, stream);
  switch (p.dtype) {
    case DType::kFloat16: return prefill_slice::paged<__half>(p, stream);
    case DType::kBFloat16: return prefill_slice::paged<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace minipaged
