// Work-list decode (DecodeParams::worklist > 0): the plan that hands the splits short
// sequences leave idle to the long ones of the same batch. One CTA derives it from
// context_lens (decode_worklist_plan_kernel, decode/worklist_plan.cuh) and writes it to DecodeParams::worklist_plan;
// the split kernel, launched behind it with programmatic dependent launch, and the merge then
// read one entry each instead of every CTA scanning the whole batch.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "decode/splits.h"
#include "decode/trace.cuh"
#include "params.h"
#include "ptx/misc.cuh"

namespace minipaged {

// The entry of work slot `slot` (one 16-byte load; the planner grid must have completed:
// griddep_wait). Read at L2: the planner wrote it after this CTA may have started.
__device__ __forceinline__ WorklistEntry decode_worklist_slot(const DecodeParams& p, int slot) {
  const int4 e = __ldcg(reinterpret_cast<const int4*>(p.worklist_plan) + slot);
  return decode_worklist_unpack(e.x, e.y, e.z, e.w);
}

// The per-sequence entries (slots, first slot), after the slot entries.
__device__ __forceinline__ int2* decode_worklist_seqs(const DecodeParams& p) {
  return reinterpret_cast<int2*>(p.worklist_plan + 4 * static_cast<int64_t>(p.worklist));
}

// Slots and first slot of sequence b.
__device__ __forceinline__ int2 decode_worklist_seq(const DecodeParams& p, int b) {
  return __ldcg(decode_worklist_seqs(p) + b);
}

}  // namespace minipaged
