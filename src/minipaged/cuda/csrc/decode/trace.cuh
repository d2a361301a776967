// Timing-only instrumentation of the decode kernels (MINIPAGED_DECODE_TRACE=1, the
// decode_selftest `trace` build; off in every build that ships, where it compiles to nothing).
// Thread 0 of each CTA stores the global timer at marked points of its life and the SM it ran
// on, so a one-wave call can be read as a timeline: when CTAs start, when their first and last
// K/V tiles land, when they finish, and when the split merge starts after them.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#ifndef MINIPAGED_DECODE_TRACE
#define MINIPAGED_DECODE_TRACE 0
#endif

namespace minipaged {

// Split kernel marks: entry, first tile landed, last tile landed, loop done, partials stored
// (or an early return), the SM, and a work-list twin's return from its wait for the planner.
// Merge kernel marks: entry, after griddepcontrol.wait, exit.
enum DecodeTraceMark : int {
  kTrEntry,
  kTrFirstTile,
  kTrLastTile,
  kTrLoopDone,
  kTrExit,
  kTrSm,
  kTrPlanWaited,
  kTrMarks = 8
};
enum ReduceTraceMark : int { kRtEntry, kRtWaited, kRtExit, kRtSm, kRtMarks = 4 };
// Work-list planner marks (its one CTA): entry, every slot written.
enum PlanTraceMark : int { kPtEntry, kPtExit, kPtMarks = 2 };
constexpr int kTraceMaxCtas = 1 << 15;

#if MINIPAGED_DECODE_TRACE
// Copies the marks of the last traced call: split [kTraceMaxCtas][kTrMarks], merge
// [kTraceMaxCtas][kRtMarks], planner [kPtMarks] (decode/launch.cu, which in a trace build holds
// every kernel: decode/select.cuh). A mark no CTA reached reads 0 after decode_trace_clear.
cudaError_t decode_trace_read(unsigned long long* split, unsigned long long* merge, unsigned long long* plan);
// Zeroes every mark, so that a CTA that returns early (an unused split, a one-split merge) shows
// no stale mark of an earlier call.
cudaError_t decode_trace_clear();
#endif
#if MINIPAGED_DECODE_TRACE && defined(__CUDACC__)
static __device__ unsigned long long g_decode_trace[kTraceMaxCtas * kTrMarks];
static __device__ unsigned long long g_reduce_trace[kTraceMaxCtas * kRtMarks];
static __device__ unsigned long long g_plan_trace[kPtMarks];

__device__ __forceinline__ unsigned long long trace_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned trace_smid() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
__device__ __forceinline__ int trace_cta() {
  return static_cast<int>(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
}
__device__ __forceinline__ void decode_trace(int mark) {
  const int cta = trace_cta();
  if (threadIdx.x == 0 && cta < kTraceMaxCtas)
    g_decode_trace[cta * kTrMarks + mark] = mark == kTrSm ? trace_smid() : trace_now();
}
__device__ __forceinline__ void reduce_trace(int mark) {
  const int cta = trace_cta();
  if (threadIdx.x == 0 && cta < kTraceMaxCtas)
    g_reduce_trace[cta * kRtMarks + mark] = mark == kRtSm ? trace_smid() : trace_now();
}
__device__ __forceinline__ void plan_trace(int mark) {
  if (threadIdx.x == 0) g_plan_trace[mark] = trace_now();
}
#else
__device__ __forceinline__ void decode_trace(int) {}
__device__ __forceinline__ void reduce_trace(int) {}
__device__ __forceinline__ void plan_trace(int) {}
#endif

}  // namespace minipaged
