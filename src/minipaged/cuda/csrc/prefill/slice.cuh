// The definitions behind prefill/slice.h. Each prefill/fast_*.cu and prefill/paged_*_kv*.cu
// unit includes this header and instantiates one slice (MINIPAGED_PREFILL_*_SLICE below), so
// every kernel template is compiled in exactly one unit of the extension.
#pragma once
#include "prefill/dispatch.cuh"
#include "prefill/slice.h"

namespace minipaged {
namespace prefill_slice {

template <typename T>
cudaError_t dense(const PrefillParams& p, cudaStream_t stream) {
  return fast::dispatch_dim<T, false>(p, stream);
}

template <typename T>
cudaError_t paged(const PrefillParams& p, cudaStream_t stream) {
  return fast::dispatch_dim<T, true>(p, stream);
}

// FP8 caches: short queries run the GQA-packed mma.sync block with FP8 K/V tiles (Fp8KV<>,
// prefill/mainloop_mma.cuh) on every arch; longer ones the warp-specialised TMA kernel that
// widens e4m3 pages in shared memory (CfgWsPaged8, mirrored block pairs for causal work lists
// of at most one wave) on an sm_90a build with pages of >= 8 tokens, else the small mma.sync
// block. Causal is a runtime flag of the FP8 kernels (kCausal = true, p.causal).
template <typename T, int D>
cudaError_t paged_fp8_dim(const PrefillParams& p, cudaStream_t stream) {
  using namespace fast;
  const bool pack_ok = (p.variant == 0 || p.variant == kPagedVariantDecodeRouting) &&
                       p.num_q_heads >= 2 * p.num_kv_heads;
  auto packed = [&](const PrefillParams& q) {
    return launch_prefill_cfg<Fp8KV<CfgPack<T, D>>, true, true, true>(q, stream);
  };
  auto tiled = [&](const PrefillParams& q) {
#if MINIPAGED_DISPATCH_WGMMA && !defined(MINIPAGED_DISABLE_WS_FP8)
    if (ws_paged_supported<CfgWsPaged8<T, D>>(q)) {
      if (!q.causal) return launch_prefill_ws_paged<CfgWsPaged8<T, D>, false>(q, stream);
      if (ws_mirror_pays(ws_paged_grid<CfgWsPaged8<T, D>>(q), sm_count(q)))
        return launch_prefill_ws_paged<CfgWsPaged8Mirror<T, D>, true>(q, stream);
      return launch_prefill_ws_paged<CfgWsPaged8<T, D>, true>(q, stream);
    }
#endif
    return launch_prefill_cfg<Fp8KV<CfgSmall<T, D>>, true, true>(q, stream);
  };
  if (paged_decode_routing_ok(p)) {
    auto packed_min2 = [&](const PrefillParams& q) {
      return launch_prefill_cfg<WithMinSeqlenQ<Fp8KV<CfgPack<T, D>>, 2>, true, true, true>(q, stream);
    };
    return launch_paged_routed_rest(p, pack_ok, paged_spec_decode_ok(p), packed_min2, tiled);
  }
  if (p.variant == 2 || (pack_ok && p.max_seqlen_q <= kPackMaxSeqlenQ)) return packed(p);
  if (!pack_ok) return tiled(p);
  return launch_paged_split(p, packed, tiled);
}

template <typename T>
cudaError_t paged_fp8(const PrefillParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return paged_fp8_dim<T, 64>(p, stream);
    case 128: return paged_fp8_dim<T, 128>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <class Cfg>
int packed_ctas_per_sm_of() {
  static int cached[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 1;
  if (cached[device] == 0) {
    auto kernel = fast::prefill_fast_kernel<fast::WithMinSeqlenQ<Cfg, 2>, true, true, true>;
    int blocks = 0;
    if (Cfg::kSmemBytes > 48 * 1024)
      (void)cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, Cfg::kThreads, Cfg::kSmemBytes) != cudaSuccess) {
      (void)cudaGetLastError();
      blocks = 1;
    }
    cached[device] = blocks > 0 ? blocks : 1;
  }
  return cached[device];
}

template <typename T, bool kFp8>
int packed_ctas_per_sm(int head_dim) {
  using fast::CfgPack;
  if constexpr (kFp8)
    return head_dim == 128 ? packed_ctas_per_sm_of<fast::Fp8KV<CfgPack<T, 128>>>()
                           : packed_ctas_per_sm_of<fast::Fp8KV<CfgPack<T, 64>>>();
  else
    return head_dim == 128 ? packed_ctas_per_sm_of<CfgPack<T, 128>>() : packed_ctas_per_sm_of<CfgPack<T, 64>>();
}

}  // namespace prefill_slice
}  // namespace minipaged

#define MINIPAGED_PREFILL_DENSE_SLICE(T)                                                   \
  namespace minipaged {                                                                    \
  template cudaError_t prefill_slice::dense<T>(const PrefillParams&, cudaStream_t);        \
  }
#define MINIPAGED_PREFILL_PAGED_SLICE(T)                                                   \
  namespace minipaged {                                                                    \
  template cudaError_t prefill_slice::paged<T>(const PrefillParams&, cudaStream_t);        \
  template int prefill_slice::packed_ctas_per_sm<T, false>(int);                           \
  }
#define MINIPAGED_PREFILL_PAGED_FP8_SLICE(T)                                               \
  namespace minipaged {                                                                    \
  template cudaError_t prefill_slice::paged_fp8<T>(const PrefillParams&, cudaStream_t);    \
  template int prefill_slice::packed_ctas_per_sm<T, true>(int);                            \
  }
