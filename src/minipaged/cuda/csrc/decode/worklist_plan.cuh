// The work list's planner kernel (decode/worklist.cuh has the plan's layout and the split
// kernels' readers): one CTA that turns context_lens into DecodeParams::worklist_plan. Only
// decode/launch.cu, which launches it, includes this.
#pragma once
#include "decode/worklist.cuh"

namespace minipaged {

namespace {

// The plan, in one CTA of kWorklistPlanThreads: thread b owns sequence b. Runs of at most t
// tokens (decode_worklist_run, from the batch's total): sequence b takes n_b slots of its own
// run (decode_worklist_seq_splits: n_b <= max(1, ceil(ctx_b / t))), consecutive from
// first_b = n_0 + ... + n_{b-1}; the slots past the last sequence's are marked empty, so every
// slot of the grid has an entry.
__global__ void __launch_bounds__(kWorklistPlanThreads) decode_worklist_plan_kernel(const DecodeParams p) {
  plan_trace(kPtEntry);
  // The split kernel's CTAs may launch at once: they wait (griddep_wait) for this grid to finish.
  griddep_launch_dependents();
  constexpr int kPlanWarps = kWorklistPlanThreads / 32;
  __shared__ long long sm_sum[kPlanWarps];
  __shared__ int sm_scan[kPlanWarps];
  __shared__ int sm_first[kWorklistMaxBatch + 1];  // [batch]: slots in use
  __shared__ int sm_ctx[kWorklistMaxBatch];        // (the slot entries' lengths, not read twice)
  __shared__ int sm_run[kWorklistMaxBatch];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int capacity = p.max_blocks * p.block_size;
  const bool mine = tid < p.batch;
  const int ctx = mine ? max(0, min(p.context_lens[tid], capacity)) : 0;
  long long sum = ctx;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) sm_sum[warp] = sum;
  __syncthreads();
  long long total = 0;
#pragma unroll
  for (int w = 0; w < kPlanWarps; ++w) total += sm_sum[w];
  const int run = static_cast<int>(decode_worklist_run(p, total, kWorklistMaxSplits));
  const SeqSplits seq =
      decode_worklist_seq_splits(ctx, run, p.split_align, (p.variant & kDecodeVariantWorklistFixedRuns) == 0);
  const int n = mine ? seq.count : 0;
  int incl = n;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += v;
  }
  if (lane == 31) sm_scan[warp] = incl;
  __syncthreads();
  int first = incl - n;
  for (int w = 0; w < warp; ++w) first += sm_scan[w];
  if (mine) sm_first[tid] = first, sm_ctx[tid] = ctx, sm_run[tid] = seq.run;
  if (tid == p.batch - 1) sm_first[p.batch] = first + n;  // the slots in use
  if (mine) decode_worklist_seqs(p)[tid] = make_int2(n, first);
  __syncthreads();
  const int used = sm_first[p.batch];  // (launch_decode: 1 <= batch <= kWorklistMaxBatch)
  int4* slots = reinterpret_cast<int4*>(p.worklist_plan);
  for (int slot = tid; slot < p.worklist; slot += kWorklistPlanThreads) {
    WorklistEntry e{-1, 0, 0, 0, 0, run};
    if (slot < used) {
      e.b = decode_worklist_owner(sm_first, p.batch, slot);
      e.first = sm_first[e.b];
      e.split = slot - e.first;
      e.count = sm_first[e.b + 1] - e.first;
      e.ctx = sm_ctx[e.b];
      e.run = sm_run[e.b];
    }
    const WorklistWords w = decode_worklist_pack(e);
    slots[slot] = make_int4(w.x, w.y, w.z, w.w);
  }
#if MINIPAGED_DECODE_TRACE
  __syncthreads();  // (trace builds only: the exit mark after every thread's slots)
  plan_trace(kPtExit);
#endif
}

}  // namespace
}  // namespace minipaged
