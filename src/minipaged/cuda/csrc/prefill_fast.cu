// Launcher of the fast prefill (dense + varlen): validates what the kernel
// relies on, then dispatches on dtype, head dim, causal and a shape heuristic.
#include <cmath>
#include <cstdint>

#include "prefill_fast.cuh"
#if !defined(MINIPAGED_DISABLE_WGMMA)
// The wgmma kernels are real code only in an sm_90a build (the JIT build picks
// sm_90a on sm_90 devices because mma_wgmma.cuh tests __CUDA_ARCH_FEAT_SM90_ALL);
// in any other build they are __trap() stubs that the dispatcher never selects.
#include "fast_wgmma.cuh"
#endif

namespace minipaged {
namespace fast {

// Block shapes (bench/results/prefill_ablation.md has the measurements):
//   kSmall: 4 warps x 16 rows, BLOCK_M 64, Q in registers -- twice the CTAs
//           when the grid would otherwise not fill the GPU
//   kLarge: 4 warps x 32 rows, BLOCK_M 128, BLOCK_N 32, Q re-read from shared
//           memory -- every K/V fragment feeds two m-tiles, which halves
//           ldmatrix traffic per MMA (shared-memory bandwidth bounds the 16-row
//           warp); BLOCK_N 32 keeps it at 253 registers without spills
// On sm_90 (sm_90a build) the wgmma kernels below replace both.
template <typename T, int D>
using CfgSmall = PrefillCfg<T, D, 64, 4, 1, true, 2>;
template <typename T, int D>
using CfgLarge = PrefillCfg<T, D, 32, 4, 2, false, 2>;

#if !defined(MINIPAGED_DISABLE_WGMMA)
// wgmma kernels: 2 warpgroups (BLOCK_M 128, BLOCK_N 128) or, for short grids,
// 1 warpgroup (BLOCK_M 64, BLOCK_N 64, two CTAs per SM); both pipelined.
template <typename T, int D>
using CfgWgmmaLarge = WgmmaCfg<T, D, 2, 1, true, 128>;
template <typename T, int D>
using CfgWgmmaSmall = WgmmaCfg<T, D, 1, 1, true, 64>;

// sm_90a code runs on compute capability 9.0 only.
inline bool device_is_sm90() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) return false;
  return major == 9 && minor == 0;
}

// Whether this library holds real wgmma code: without an sm_90a target the
// kernel body is a 4-register __trap() stub. Asked once per instantiation.
template <typename T, int D, bool kCausal>
bool wgmma_kernels_built() {
  cudaFuncAttributes large{}, small{};
  if (cudaFuncGetAttributes(&large, prefill_wgmma_kernel<CfgWgmmaLarge<T, D>, kCausal>) != cudaSuccess ||
      cudaFuncGetAttributes(&small, prefill_wgmma_kernel<CfgWgmmaSmall<T, D>, kCausal>) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return large.numRegs >= 32 && small.numRegs >= 32;
}
#endif

template <typename T, int D, bool kCausal>
cudaError_t dispatch_shape(const PrefillParams& p, cudaStream_t stream) {
#if !defined(MINIPAGED_DISABLE_WGMMA)
  static const bool wgmma_ok_on_sm90 = wgmma_kernels_built<T, D, kCausal>();
  if (device_is_sm90() && wgmma_ok_on_sm90) {
    const int64_t wg_blocks = int64_t(p.batch) * p.num_q_heads *
                              ((p.max_seqlen_q + CfgWgmmaLarge<T, D>::kBlockM - 1) / CfgWgmmaLarge<T, D>::kBlockM);
    const int sms = p.num_sms > 0 ? p.num_sms : 132;
    if (wg_blocks >= 2 * int64_t(sms)) return launch_prefill_wgmma_cfg<CfgWgmmaLarge<T, D>, kCausal>(p, stream);
    return launch_prefill_wgmma_cfg<CfgWgmmaSmall<T, D>, kCausal>(p, stream);
  }
#endif
  const int64_t large_blocks = int64_t(p.batch) * p.num_q_heads *
                               ((p.max_seqlen_q + CfgLarge<T, D>::kBlockM - 1) / CfgLarge<T, D>::kBlockM);
  const int num_sms = p.num_sms > 0 ? p.num_sms : 132;
  // The large block needs about two waves of CTAs to keep every SM busy
  // through the causal tail; below that, halve the block and double the grid.
  if (large_blocks >= 2 * int64_t(num_sms)) return launch_prefill_cfg<CfgLarge<T, D>, kCausal>(p, stream);
  return launch_prefill_cfg<CfgSmall<T, D>, kCausal>(p, stream);
}

template <typename T, int D>
cudaError_t dispatch_causal(const PrefillParams& p, cudaStream_t stream) {
  return p.causal ? dispatch_shape<T, D, true>(p, stream) : dispatch_shape<T, D, false>(p, stream);
}

template <typename T>
cudaError_t dispatch_dim(const PrefillParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return dispatch_causal<T, 64>(p, stream);
    case 128: return dispatch_causal<T, 128>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

inline bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

}  // namespace fast

cudaError_t launch_prefill_fast(const PrefillParams& p, cudaStream_t stream) {
  using namespace fast;
  if (p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0) return cudaErrorInvalidValue;
  if (p.batch < 0 || p.max_seqlen_q < 0 || p.max_seqlen_k < 0) return cudaErrorInvalidValue;
  if (!std::isfinite(p.scale)) return cudaErrorInvalidValue;
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
    case DType::kFloat16: return dispatch_dim<__half>(p, stream);
    case DType::kBFloat16: return dispatch_dim<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace minipaged
