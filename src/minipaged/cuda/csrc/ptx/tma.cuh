// sm_90 asynchronous-copy and synchronisation wrappers for the warp-specialised
// prefill (prefill/mainloop_ws.cuh): TMA tensor loads (cp.async.bulk.tensor),
// shared-memory mbarriers with transaction counts, register reallocation
// between warpgroups (setmaxnreg) and named barriers.
//
// Everything here needs sm_90 (setmaxnreg: sm_90a); the bodies exist only when
// the device pass has the sm_90a feature set (MINIPAGED_WGMMA_DEVICE, from
// ptx/wgmma.cuh), so the header can be included by translation units that are
// also compiled for sm_80.
#pragma once
#include <cstdint>

#include "ptx/wgmma.cuh"

namespace minipaged {

#if MINIPAGED_WGMMA_DEVICE

// ---- mbarrier (shared::cta, 64-bit) ----
// A barrier completes a phase when its pending arrivals reach zero and its
// pending transaction bytes reach zero; the phase bit then flips. Waiters name
// the parity of the phase they wait for, so a fresh barrier (phase 0 running)
// already satisfies a wait on parity 1: producers start their "slot is empty"
// waits on parity 1 and need no pre-arrival.
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}
// Makes the initialisations visible to the async proxy (TMA complete_tx) and
// to the other threads; followed by a CTA barrier at the call site.
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// One arrival plus the byte count that asynchronous copies must still deliver
// (complete_tx) before this phase can complete.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// kClusterScope: acquire at cluster scope, for a phase that other CTAs of the cluster complete
// (their st.async complete_tx): the default CTA-scope acquire would not order their stores
// before this thread's later reads.
template <bool kClusterScope = false>
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  if constexpr (kClusterScope) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } else {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
  return done != 0;
}
// try_wait already suspends the thread for a hardware-chosen time, so the
// loop does not spin hot.
template <bool kClusterScope = false>
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait<kClusterScope>(bar, parity)) {
  }
}

// ---- TMA ----
// The tensor map lives in kernel parameter space (__grid_constant__); its
// generic address is what cp.async.bulk.tensor takes.
__device__ __forceinline__ void tma_prefetch_desc(const void* tmap) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tmap)) : "memory");
}
// 4-D tile load global -> shared, completion signalled on `bar` as
// transaction bytes. Coordinates are in elements, innermost first; boxes
// that reach past the tensor's extent are zero-filled (and still count their
// full size towards the transaction bytes).
__device__ __forceinline__ void tma_load_4d(uint32_t smem_dst, const void* tmap, uint32_t bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(smem_dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// 5-D: the same, one more coordinate.
__device__ __forceinline__ void tma_load_5d(uint32_t smem_dst, const void* tmap, uint32_t bar, int c0, int c1,
                                            int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n" ::"r"(smem_dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

// ---- generic-proxy shared-memory writes read later by TMA/wgmma ----
// 16 zero bytes at a shared address (16-byte aligned).
__device__ __forceinline__ void st_shared_zero16(uint32_t addr) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0u) : "memory");
}
// 16 bytes at a shared address (16-byte aligned).
__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
// (fence_proxy_async_smem, ptx/wgmma.cuh, then hands such writes to wgmma.)

// ---- register reallocation (warpgroup-collective; counts multiple of 8, 24..256) ----
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg range");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg range");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// ---- named barriers (id 0 is __syncthreads'; count is a multiple of 32) ----
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Arrives without waiting: the signalling half of a producer/consumer hand-off
// between warpgroups (ping-pong scheduling).
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

#endif  // MINIPAGED_WGMMA_DEVICE

}  // namespace minipaged
