// Parameter blocks and launchers of the decode and KV-cache kernels, shared by
// decode.cu / cache.cu and the one binding file. Torch-free (plain nvcc / g++).
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "params.h"

namespace minipaged {

// Paged decode: one query token per sequence against its paged KV history.
// q [B, Hq, D]; caches [num_blocks, block_size, Hkv, D] (any strides, last dim
// contiguous, 16-byte aligned rows); block_tables int32 [B, max_blocks];
// context_lens int32 [B]; o [B, Hq, D].
struct DecodeParams {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  void* o;
  const int32_t* block_tables;
  const int32_t* context_lens;
  // split-KV workspace, used when num_splits > 1:
  // partial_o [B, Hq, num_splits, D] (normalised), partial_lse [B, Hq, num_splits] (log2 domain)
  float* partial_o;
  float* partial_lse;
  // Optional log-sum-exp output [B, Hq] (float32, natural log, -inf for an
  // empty context), row b at lse + b * lse_batch_stride; nullptr: not written.
  float* lse;
  int64_t lse_batch_stride;
  int64_t q_batch_stride, q_head_stride;
  int64_t o_batch_stride, o_head_stride;
  int64_t k_block_stride, k_token_stride, k_head_stride;
  int64_t v_block_stride, v_token_stride, v_head_stride;
  int64_t block_table_stride;
  int batch;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;        // 64 or 128
  int block_size;      // power of two, 1..256
  int max_blocks;      // block_tables.shape[1]
  int num_splits;      // filled by decode_plan()
  int tokens_per_split;
  float scale;         // softmax scale, not yet multiplied by log2(e)
  DType dtype;
  int num_sms;
  int cc_major;        // compute capability of the device (9: programmatic dependent launch)
  int variant;         // 0: tuned default; >0 selects alternative tilings (benchmarking only)
};

// Chooses num_splits / tokens_per_split from B, Hkv, the table capacity
// (max_blocks * block_size) and the SM count; reads no device memory.
// `requested_splits` > 0 forces a split count (benchmarking).
void decode_plan(DecodeParams& p, int requested_splits);

// Launches decode (plus the split-KV reduction when num_splits > 1). Never syncs.
cudaError_t launch_decode(const DecodeParams& p, cudaStream_t stream);

// Scatter new K/V rows into the paged caches: row t goes to slot
// slot_mapping[t] = block * block_size + offset; a negative slot is skipped.
struct WriteKVParams {
  const void* k;
  const void* v;
  void* k_cache;
  void* v_cache;
  const void* slot_mapping;  // int32 or int64 [T]
  bool slot_is_int64;
  int64_t k_token_stride, k_head_stride;
  int64_t v_token_stride, v_head_stride;
  int64_t kc_block_stride, kc_token_stride, kc_head_stride;
  int64_t vc_block_stride, vc_token_stride, vc_head_stride;
  int64_t num_slots;  // num_blocks * block_size: slots at or past it are skipped too
  int num_tokens;
  int num_kv_heads;
  int head_dim;
  int block_size;
  int elem_bytes;  // 2 (fp16/bf16) or 4
};

cudaError_t launch_write_kv_cache(const WriteKVParams& p, cudaStream_t stream);

}  // namespace minipaged
