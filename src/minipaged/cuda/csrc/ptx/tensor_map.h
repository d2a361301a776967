// Host side of TMA: cuTensorMapEncodeTiled, looked up in the driver at run time
// (cudaGetDriverEntryPoint*), so that nothing links -lcuda. <cuda.h> is included for
// CUtensorMap and the encode enums only. Used by the warp-specialised prefill's maps
// (prefill/mainloop_ws.cuh) and by the torch-free selftests.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

namespace minipaged {

using TensorMapEncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                       const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                       CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled from the driver, looked up once (nullptr if absent).
inline TensorMapEncodeFn tensor_map_encoder() {
  static const TensorMapEncodeFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                                             cudaEnableDefault, &found);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &ptr, cudaEnableDefault, &found);
#endif
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess ? reinterpret_cast<TensorMapEncodeFn>(ptr)
                                                                      : nullptr;
  }();
  return fn;
}

}  // namespace minipaged
