// Thread-block clusters (sm_90+): the CTA's rank in its cluster, the cluster barrier, and loads
// from another CTA's shared memory (distributed shared memory). Below sm_90 a launch has no
// cluster: every CTA is a cluster of one, so rank 0 of 1, the barrier is a CTA barrier and
// "another CTA's" shared memory is the CTA's own.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "ptx/ldmatrix.cuh"  // smem_u32

namespace minipaged {

__device__ __forceinline__ uint32_t cluster_ctarank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
#else
  return 0;
#endif
}

__device__ __forceinline__ uint32_t cluster_nctarank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
  return n;
#else
  return 1;
#endif
}

// Every thread of every CTA of the cluster calls both, in this order, at the same point of its
// code (.aligned): the shared-memory writes before the arrive are visible to every CTA of the
// cluster after the wait.
__device__ __forceinline__ void cluster_arrive_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#else
  __syncthreads();
#endif
}
__device__ __forceinline__ void cluster_wait_acquire() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// The arrive without memory ordering (no MEMBAR): for a barrier that orders nothing but
// execution, or whose data is ordered otherwise (mbarrier transactions, fence.mbarrier_init).
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#else
  __syncthreads();
#endif
}

// The shared::cluster address, in the CTA of rank `rank`, of this CTA's shared-memory address
// `local` (a shared::cta address): the same variable there.
__device__ __forceinline__ uint32_t cluster_map_shared(uint32_t local, uint32_t rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
#else
  return local;
#endif
}
__device__ __forceinline__ uint32_t cluster_map_shared(const void* smem, uint32_t rank) {
  return cluster_map_shared(smem_u32(smem), rank);
}

__device__ __forceinline__ float ld_shared_cluster_f32(uint32_t addr) {
  float v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
#else
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
#endif
  return v;
}

__device__ __forceinline__ float4 ld_shared_cluster_f32x4(uint32_t addr) {
  float4 v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
#else
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
#endif
  return v;
}

// 16-byte store into the shared memory of a CTA of the cluster (remote_addr from
// cluster_map_shared, 16-byte aligned) that completes 16 transaction bytes on the mbarrier at
// remote_bar there: the receiver learns of the data from its own barrier, and the sender needs
// no fence. 4-byte form below.
__device__ __forceinline__ void st_async_f32x4(uint32_t remote_addr, const float4& v, uint32_t remote_bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                   remote_addr),
               "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(__float_as_uint(v.z)),
               "r"(__float_as_uint(v.w)), "r"(remote_bar)
               : "memory");
#endif
}
__device__ __forceinline__ void st_async_f32(uint32_t remote_addr, float v, uint32_t remote_bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(remote_addr),
               "r"(__float_as_uint(v)), "r"(remote_bar)
               : "memory");
#endif
}

}  // namespace minipaged
