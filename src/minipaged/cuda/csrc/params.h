// Kernel parameter blocks shared by the launchers and the one binding file.
// Torch-free on purpose: every .cu here builds with plain nvcc (CI compiles
// them for sm_80 and sm_90 without torch).
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace minipaged {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1 };

// Prefill, dense or varlen. Strides are in elements; the last dim is contiguous.
// Dense:  q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D]; cu_seqlens_* == nullptr and
//         every sequence has seqlen_q = max_seqlen_q, seqlen_k = max_seqlen_k.
// Varlen: q [Tq, Hq, D], k/v [Tk, Hkv, D]; sequence b spans rows
//         [cu_seqlens_q[b], cu_seqlens_q[b+1]) and the *_batch_stride fields are 0.
// Causal masking is bottom-right aligned: row i sees key j iff j < Nk - Nq + i + 1.
// Rows that see no key are written as exact zeros.
struct PrefillParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  int64_t o_batch_stride, o_head_stride, o_row_stride;
  const int32_t* cu_seqlens_q;  // [batch + 1] or nullptr (dense)
  const int32_t* cu_seqlens_k;  // [batch + 1] or nullptr (dense)
  // Optional log-sum-exp output (float32, natural log, -inf for a row that sees
  // no key): element (b, h, i) at lse + b*lse_batch_stride + h*lse_head_stride
  // + (q_begin + i)*lse_row_stride. nullptr: not computed, no cost.
  float* lse;
  int64_t lse_batch_stride, lse_head_stride, lse_row_stride;
  // Paged K/V (launch_prefill_paged only; nullptr otherwise). k/v then point at
  // caches [num_blocks, block_size, Hkv, D]: key j of sequence b is token
  // j % block_size of block block_tables[b * block_table_stride + j / block_size];
  // k_row_stride / v_row_stride are the token strides, k_block_stride /
  // v_block_stride the block strides, and seqlen_k = context_lens[b] (clamped
  // to max_blocks * block_size). Only the first ceil(seqlen_k / block_size)
  // table entries are read.
  const int32_t* block_tables;
  const int32_t* context_lens;
  int64_t block_table_stride;
  int64_t k_block_stride, v_block_stride;
  int block_size;  // power of two, 1..256
  int max_blocks;
  int variant;     // paged, benchmarking only: 0 tuned choice, 1 never pack GQA groups, 2 always
  int batch;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;       // 64 or 128
  int max_seqlen_q;   // dense: Nq
  int max_seqlen_k;   // dense: Nk
  float scale;        // softmax scale (1/sqrt(D) by default), not yet multiplied by log2(e)
  bool causal;
  DType dtype;
  int num_sms;        // multiprocessors on the device, for launch heuristics
};

// All return cudaSuccess or the launch error; they never synchronize.
cudaError_t launch_prefill_wmma(const PrefillParams& p, cudaStream_t stream);
cudaError_t launch_prefill_fast(const PrefillParams& p, cudaStream_t stream);
// Varlen queries (cu_seqlens_q) against paged K/V (block_tables, context_lens):
// the fast prefill mainloop with a gathering K/V tile loader.
cudaError_t launch_prefill_paged(const PrefillParams& p, cudaStream_t stream);

}  // namespace minipaged
