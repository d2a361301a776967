// cuda-wmma prefill: the teaching kernel of the MiniPaged-Qwen article
// (shared/seed/000_bce0681716fd1ef5.txt, sections 7-17), kept faithful.
//
// Structure, exactly as the article lays it out:
//   grid (ceil(Nq / 32), Hq, B), 64 threads = 2 warps, 16 query rows per warp (sec. 7);
//   each warp owns one WarpStorage carved out of raw dynamic shared memory (sec. 8);
//   Q is staged once (sec. 9), then KV is streamed in tiles of 16 keys (sec. 10):
//     K tile -> ws->kv (sec. 11), S = Q K^T as D/16 accumulated WMMA steps with K read
//     col_major, i.e. no transpose (sec. 12), mask + online softmax by lanes 0-15, one row
//     per lane (sec. 13), V tile overwrites ws->kv (sec. 14), P V as D/16 WMMA column
//     blocks (sec. 15), output = output * alpha + tile_out (sec. 16);
//   one division by the row sum at the very end.
//
// What this file adds to the article, without changing that structure:
//   - any GQA ratio, head dim 64 or 128 (template), fp16 or bf16 (WMMA, fp32 accumulate);
//   - arbitrary lengths: out-of-range Q/K/V rows are zero-filled, out-of-range keys masked;
//   - bottom-right causal for Nq != Nk, and a causal early stop of the KV loop;
//   - rows that see no key write exact zeros (row_sum == 0), never NaN;
//   - explicit strides and optional cu_seqlens (varlen);
//   - an optional log-sum-exp output, written after the final division;
//   - __syncwarp() between the phases: the article omits them, but lanes of a warp
//     hand data to each other through shared memory, so each hand-off needs a barrier.
// No speed target: loads are scalar and every intermediate lives in shared memory, on
// purpose, so that each line maps to a paragraph of the article.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cmath>
#include <cstdint>

#include "params.h"

namespace minipaged {
namespace {

using namespace nvcuda;

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = 2;                           // sec. 7
constexpr int kRowsPerWarp = 16;                            // one WMMA M
constexpr int kRowsPerBlock = kWarpsPerBlock * kRowsPerWarp;  // 32
constexpr int kThreads = kWarpsPerBlock * kWarpSize;          // 64
constexpr int kKvTile = 16;                                 // B_c, sec. 10
constexpr int kMma = 16;                                    // WMMA 16x16x16

// The article's QwenMmaWarpStorage (sec. 8), generalised over the element type and D.
// For half and D = 128 it is byte for byte the article's 26304 bytes per warp.
template <typename T, int D>
struct __align__(16) WarpStorage {
  T q[kRowsPerWarp * D];               // Q tile, loaded once, reused for every KV tile
  T kv[kKvTile * D];                   // K tile, then overwritten by the V tile
  float scores[kRowsPerWarp * kKvTile];  // S_t = Q K_t^T (fp32 accumulator)
  T probs[kRowsPerWarp * kKvTile];     // P~_t, unnormalised, in the input type for WMMA
  float tile_out[kRowsPerWarp * D];    // P~_t V_t
  float output[kRowsPerWarp * D];      // O~ (not yet divided by the row sum)
  float row_max[kRowsPerWarp];         // m_i
  float row_sum[kRowsPerWarp];         // l_i
  float alpha[kRowsPerWarp];           // exp(m_old - m_new), per row, this tile
};

static_assert(sizeof(WarpStorage<half, 128>) == 26304, "article sec. 8.1: 26304 bytes per warp");
// load/store_matrix_sync need 256-bit aligned pointers. Every field offset is a multiple
// of 32 bytes, and so is the struct size, so warp 1's storage stays aligned too.
static_assert(sizeof(WarpStorage<half, 128>) % 32 == 0, "warp storage must keep 32B alignment");
static_assert(sizeof(WarpStorage<half, 64>) % 32 == 0, "warp storage must keep 32B alignment");
static_assert(sizeof(WarpStorage<__nv_bfloat16, 64>) % 32 == 0, "warp storage must keep 32B alignment");

template <typename T>
struct Convert;
template <>
struct Convert<half> {
  static __device__ __forceinline__ float to_float(half x) { return __half2float(x); }
  static __device__ __forceinline__ half from_float(float x) { return __float2half_rn(x); }
};
template <>
struct Convert<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

template <typename T, int D>
// The explicit minimum of 1 block per SM matters: with the thread count alone,
// nvcc 13.0's ptxas caps the fp16 D=128 sm_90 instance at 64 registers and spills.
__global__ void __launch_bounds__(kThreads, 1) prefill_wmma_kernel(const PrefillParams p) {
  static_assert(D % kMma == 0, "head dim must be a multiple of the WMMA K (16)");
  constexpr int kDSteps = D / kMma;  // 8 for Qwen3's D = 128 (sec. 12.2)
  using Storage = WarpStorage<T, D>;
  using Cvt = Convert<T>;

  // sec. 8: one raw buffer, each warp takes its own slice; warps never share data,
  // so there is no __syncthreads anywhere and a warp may leave early on its own.
  extern __shared__ __align__(128) unsigned char raw_smem[];

  // sec. 7: thread hierarchy.
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int b = blockIdx.z;
  const int qh = blockIdx.y;
  const int kvh = qh / (p.num_q_heads / p.num_kv_heads);  // GQA, any ratio (sec. 6)
  const int q_start = blockIdx.x * kRowsPerBlock + warp * kRowsPerWarp;

  // Dense: every sequence has the max lengths. Varlen: sequence b is a row range of the
  // packed [T, H, D] tensors and the grid is sized for the longest one.
  int64_t q_row0 = 0, k_row0 = 0;
  int q_len = p.max_seqlen_q;
  int kv_len = p.max_seqlen_k;
  if (p.cu_seqlens_q != nullptr) {
    q_row0 = p.cu_seqlens_q[b];
    q_len = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
  }
  if (p.cu_seqlens_k != nullptr) {
    k_row0 = p.cu_seqlens_k[b];
    kv_len = p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
  }
  if (q_start >= q_len) return;  // this warp's 16 rows lie past its sequence

  Storage* ws = reinterpret_cast<Storage*>(raw_smem) + warp;

  const T* query = static_cast<const T*>(p.q) + b * p.q_batch_stride + qh * p.q_head_stride +
                   q_row0 * p.q_row_stride;
  const T* key = static_cast<const T*>(p.k) + b * p.k_batch_stride + kvh * p.k_head_stride +
                 k_row0 * p.k_row_stride;
  const T* value = static_cast<const T*>(p.v) + b * p.v_batch_stride + kvh * p.v_head_stride +
                   k_row0 * p.v_row_stride;
  T* out = static_cast<T*>(p.o) + b * p.o_batch_stride + qh * p.o_head_stride +
           q_row0 * p.o_row_stride;

  // The article folds no constant here; we fold log2(e) so exp2f gives e^(x * scale).
  const float scale_log2 = p.scale * 1.4426950408889634f;

  // sec. 9: the whole warp stages its 16 x D Q tile once; rows past the sequence are
  // zero so the WMMA inputs are finite (those rows are never written back).
  for (int i = lane; i < kRowsPerWarp * D; i += kWarpSize) {
    const int row = i / D;
    const int d = i % D;
    const int qi = q_start + row;
    ws->q[i] = qi < q_len ? query[qi * p.q_row_stride + d] : Cvt::from_float(0.0f);
    ws->output[i] = 0.0f;
  }
  // sec. 9.1: one softmax state per query row, so only lanes 0-15 have work here.
  if (lane < kRowsPerWarp) {
    ws->row_max[lane] = -INFINITY;
    ws->row_sum[lane] = 0.0f;
  }

  // Bottom-right causal alignment: row qi sees key j iff j < kv_len - q_len + qi + 1.
  const int causal_offset = kv_len - q_len;
  // Causal early stop: no row of this warp sees a key at or past kv_end.
  int kv_end = kv_len;
  if (p.causal) {
    const int last_row = min(q_start + kRowsPerWarp, q_len) - 1;
    kv_end = max(0, min(kv_len, causal_offset + last_row + 1));
  }

  __syncwarp();  // Q tile and softmax state visible to the whole warp

  // sec. 10: stream KV in tiles of 16 keys.
  for (int k_start = 0; k_start < kv_end; k_start += kKvTile) {
    // sec. 11: global K -> ws->kv. Keys past kv_end are zero (and masked below).
    for (int i = lane; i < kKvTile * D; i += kWarpSize) {
      const int row = i / D;
      const int d = i % D;
      const int ki = k_start + row;
      ws->kv[i] = ki < kv_end ? key[ki * p.k_row_stride + d] : Cvt::from_float(0.0f);
    }
    __syncwarp();

    // sec. 12: S_t = Q K_t^T, accumulated over D/16 slices of the head dim (12.2).
    // K sits row-major [16, D] in shared memory; read as a col_major matrix_b it *is*
    // K^T [D, 16] with leading dimension D, so no transpose is needed (12.3).
    wmma::fragment<wmma::accumulator, kMma, kMma, kMma, float> score_frag;
    wmma::fill_fragment(score_frag, 0.0f);
#pragma unroll
    for (int step = 0; step < kDSteps; ++step) {
      const int d = step * kMma;
      wmma::fragment<wmma::matrix_a, kMma, kMma, kMma, T, wmma::row_major> q_frag;
      wmma::fragment<wmma::matrix_b, kMma, kMma, kMma, T, wmma::col_major> k_frag;
      wmma::load_matrix_sync(q_frag, ws->q + d, D);
      wmma::load_matrix_sync(k_frag, ws->kv + d, D);
      wmma::mma_sync(score_frag, q_frag, k_frag, score_frag);
    }
    // sec. 13: fragments are opaque per-lane register layouts, so go through shared
    // memory to let one lane own one row.
    wmma::store_matrix_sync(ws->scores, score_frag, kKvTile, wmma::mem_row_major);
    __syncwarp();

    // sec. 13: mask + online softmax, lane r owns query row r.
    if (lane < kRowsPerWarp) {
      const int qi = q_start + lane;
      const int causal_limit = causal_offset + qi + 1;
      const int visible_end = p.causal ? min(kv_len, causal_limit) : kv_len;

      // Scores in the log2 domain; masked keys (causal or past kv_len) become -inf.
      float s[kKvTile];
      float tile_max = -INFINITY;
#pragma unroll
      for (int c = 0; c < kKvTile; ++c) {
        const int kj = k_start + c;
        s[c] = kj < visible_end ? ws->scores[lane * kKvTile + c] * scale_log2 : -INFINITY;
        tile_max = fmaxf(tile_max, s[c]);
      }
      const float m_old = ws->row_max[lane];
      const float m_new = fmaxf(m_old, tile_max);
      // alpha = e^(m_old - m_new); 0 while the row has seen nothing (m_old = -inf),
      // which also avoids (-inf) - (-inf) = NaN when this tile is fully masked too.
      const float alpha = m_old == -INFINITY ? 0.0f : exp2f(m_old - m_new);
      float tile_sum = 0.0f;
#pragma unroll
      for (int c = 0; c < kKvTile; ++c) {
        // A masked key contributes exactly 0, even when m_new is still -inf.
        const float prob = s[c] == -INFINITY ? 0.0f : exp2f(s[c] - m_new);
        ws->probs[lane * kKvTile + c] = Cvt::from_float(prob);
        tile_sum += prob;
      }
      ws->row_max[lane] = m_new;
      ws->row_sum[lane] = alpha * ws->row_sum[lane] + tile_sum;  // l_new = alpha l_old + sum p
      ws->alpha[lane] = alpha;
    }
    // Also orders the K reads of the QK^T loop before the V stores below.
    __syncwarp();

    // sec. 14: K is dead, V reuses the same buffer (non-overlapping lifetimes).
    // Zero-fill matters here: a masked key has p = 0, and 0 * garbage could be NaN.
    for (int i = lane; i < kKvTile * D; i += kWarpSize) {
      const int row = i / D;
      const int d = i % D;
      const int ki = k_start + row;
      ws->kv[i] = ki < kv_end ? value[ki * p.v_row_stride + d] : Cvt::from_float(0.0f);
    }
    __syncwarp();

    // sec. 15: P~_t [16,16] x V_t [16,D]. The reduction dim is already 16, so the D/16
    // steps produce separate 16-column blocks of tile_out instead of accumulating.
#pragma unroll
    for (int step = 0; step < kDSteps; ++step) {
      const int d = step * kMma;
      wmma::fragment<wmma::matrix_a, kMma, kMma, kMma, T, wmma::row_major> p_frag;
      wmma::fragment<wmma::matrix_b, kMma, kMma, kMma, T, wmma::row_major> v_frag;
      wmma::fragment<wmma::accumulator, kMma, kMma, kMma, float> out_frag;
      wmma::load_matrix_sync(p_frag, ws->probs, kKvTile);
      wmma::load_matrix_sync(v_frag, ws->kv + d, D);
      wmma::fill_fragment(out_frag, 0.0f);
      wmma::mma_sync(out_frag, p_frag, v_frag, out_frag);
      wmma::store_matrix_sync(ws->tile_out + d, out_frag, D, wmma::mem_row_major);
    }
    __syncwarp();

    // sec. 16: O~_new = alpha O~_old + P~_t V_t. Still unnormalised.
    // The next iteration's writes (kv, scores, probs, alpha, tile_out) all come after
    // at least one more __syncwarp, so no barrier is needed at the end of the body.
    for (int i = lane; i < kRowsPerWarp * D; i += kWarpSize) {
      const int row = i / D;
      ws->output[i] = ws->output[i] * ws->alpha[row] + ws->tile_out[i];
    }
  }
  __syncwarp();

  // End of sec. 16: O = O~ / l, once. A row that saw no key has l == 0 and writes
  // exact zeros (a row that saw any key has l >= 1: its max contributes e^0).
  for (int i = lane; i < kRowsPerWarp * D; i += kWarpSize) {
    const int row = i / D;
    const int d = i % D;
    const int qi = q_start + row;
    if (qi < q_len) {
      const float l = ws->row_sum[row];
      out[qi * p.o_row_stride + d] = Cvt::from_float(l > 0.0f ? ws->output[i] / l : 0.0f);
    }
  }
  // Not in the article: the optional log-sum-exp (natural log) of each row,
  // from the log2-domain max and sum the loop above already keeps.
  if (p.lse != nullptr && lane < kRowsPerWarp && q_start + lane < q_len) {
    const float l = ws->row_sum[lane];
    p.lse[b * p.lse_batch_stride + qh * p.lse_head_stride + (q_row0 + q_start + lane) * p.lse_row_stride] =
        l > 0.0f ? (ws->row_max[lane] + log2f(l)) * 0.6931471805599453f : -INFINITY;
  }
}

template <typename T, int D>
cudaError_t launch_typed(const PrefillParams& p, cudaStream_t stream) {
  const size_t smem_bytes = kWarpsPerBlock * sizeof(WarpStorage<T, D>);
  auto kernel = prefill_wmma_kernel<T, D>;
  // 52608 bytes for D = 128 (sec. 8.1) is over the 48 KiB default: opt in. Cheap, and
  // doing it per launch keeps it right on every device the caller may switch to.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem_bytes));
  if (err != cudaSuccess) return err;
  const dim3 grid((p.max_seqlen_q + kRowsPerBlock - 1) / kRowsPerBlock, p.num_q_heads, p.batch);
  kernel<<<grid, kThreads, smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_prefill_wmma(const PrefillParams& p, cudaStream_t stream) {
  if (p.num_kv_heads <= 0 || p.num_q_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0 ||
      p.batch < 0 || p.max_seqlen_q < 0 || p.max_seqlen_k < 0) {
    return cudaErrorInvalidValue;
  }
  if (p.num_q_heads > 65535 || p.batch > 65535) return cudaErrorInvalidValue;  // grid y/z
  if (p.batch == 0 || p.max_seqlen_q == 0) return cudaSuccess;  // empty output: nothing to do
  const bool fp16 = p.dtype == DType::kFloat16;
  if (!fp16 && p.dtype != DType::kBFloat16) return cudaErrorInvalidValue;
  switch (p.head_dim) {
    case 64:
      return fp16 ? launch_typed<half, 64>(p, stream) : launch_typed<__nv_bfloat16, 64>(p, stream);
    case 128:
      return fp16 ? launch_typed<half, 128>(p, stream) : launch_typed<__nv_bfloat16, 128>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace minipaged
