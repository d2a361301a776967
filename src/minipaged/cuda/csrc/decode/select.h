// The per-(element type, head dim, cache dtype) entry points of decode kernel selection,
// defined in decode/select.cuh and instantiated by decode/kernels_*.cu: decode/launch.cu plans
// and launches through them without compiling any kernel itself.
#pragma once
#include "params.h"

namespace minipaged {

// The kernel for p at T, D and the cache dtype (FP8: p.kv_fp8): short query runs
// (max_seqlen_q >= 2), packed queries (cu_seqlens_q), else a plain decode with p.variant's
// tiling. The caller has checked the head dim, the scales and the head counts.
template <typename T, int D, bool FP8>
DecodePlan select_kernel_for(const DecodeParams& p);

// The tensor-core plan for G = 2 at D = 128 (plain or packed-query; the fused bit's choice).
template <typename T, bool FP8>
DecodePlan tensor_core_g2_for(const DecodeParams& p);

// The two-warp twin of k where k is the default tensor-core plan of its cache dtype (the
// packed-query build when `packed`), else k.
template <typename T, int D, bool FP8>
DecodePlan two_warp_twin_for(const DecodePlan& k, bool packed);

}  // namespace minipaged
