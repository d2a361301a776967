// write_kv_cache: scatter new K/V rows into the paged caches.
// One thread moves one 16-byte piece of one (token, KV head) row of K and the
// same piece of V; rows go to slot = block * block_size + offset, and a
// negative (or out-of-range) slot skips the token. Inputs and caches may have
// any strides as long as the last dim is contiguous; when a pointer or stride
// is not 16-byte aligned the same kernel runs with element-sized pieces.
// FP8 caches (p.cache_fp8): each thread quantises 8 consecutive elements (or
// one, when the rows are not aligned for 8-byte stores) of one (token, KV head)
// row of K and of V: e4m3(x / scale[h]) with an IEEE division (not a multiply
// by 1/scale, which rounds differently) and round-to-nearest-even saturation.
#include <algorithm>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "params.h"
#include "ptx/fp8.cuh"

namespace minipaged {
namespace {

template <typename Index, typename Piece>
__global__ void __launch_bounds__(256) write_kv_kernel(const WriteKVParams p, int log2_bs) {
  const int pieces_per_row = p.head_dim * p.elem_bytes / static_cast<int>(sizeof(Piece));
  const int64_t total = static_cast<int64_t>(p.num_tokens) * p.num_kv_heads * pieces_per_row;
  const Index* slots = static_cast<const Index*>(p.slot_mapping);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / pieces_per_row;
    const int piece = static_cast<int>(i - row * pieces_per_row);
    const int64_t t = row / p.num_kv_heads;
    const int64_t h = row - t * p.num_kv_heads;
    const int64_t slot = static_cast<int64_t>(slots[t]);
    if (slot < 0 || slot >= p.num_slots) continue;
    const int64_t block = slot >> log2_bs;
    const int64_t offset = slot & ((int64_t{1} << log2_bs) - 1);
    const int64_t eb = p.elem_bytes;
    const char* ks = static_cast<const char*>(p.k) + (t * p.k_token_stride + h * p.k_head_stride) * eb;
    const char* vs = static_cast<const char*>(p.v) + (t * p.v_token_stride + h * p.v_head_stride) * eb;
    char* kd = static_cast<char*>(p.k_cache) +
               (block * p.kc_block_stride + offset * p.kc_token_stride + h * p.kc_head_stride) * eb;
    char* vd = static_cast<char*>(p.v_cache) +
               (block * p.vc_block_stride + offset * p.vc_token_stride + h * p.vc_head_stride) * eb;
    const Piece kval = reinterpret_cast<const Piece*>(ks)[piece];
    const Piece vval = reinterpret_cast<const Piece*>(vs)[piece];
    reinterpret_cast<Piece*>(kd)[piece] = kval;
    reinterpret_cast<Piece*>(vd)[piece] = vval;
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }
bool aligned8(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 7) == 0; }

__device__ __forceinline__ float src_to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float src_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float src_to_float(float x) { return x; }

// EPT source elements at `src` -> EPT e4m3 bytes at `dst` (EPT 8: one 8-byte
// store, the source read in 16-byte pieces; EPT 1: one byte).
template <typename Src, int EPT>
__device__ __forceinline__ void quantise_piece(const Src* src, uint8_t* dst, float scale) {
  if constexpr (EPT == 8) {
    alignas(16) Src x[8];
#pragma unroll
    for (int i = 0; i < static_cast<int>(8 * sizeof(Src) / 16); ++i)
      reinterpret_cast<uint4*>(x)[i] = reinterpret_cast<const uint4*>(src)[i];
    uint32_t w[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t lo = fp8x2_e4m3_from_float2(__fdiv_rn(src_to_float(x[4 * i]), scale),
                                                 __fdiv_rn(src_to_float(x[4 * i + 1]), scale));
      const uint32_t hi = fp8x2_e4m3_from_float2(__fdiv_rn(src_to_float(x[4 * i + 2]), scale),
                                                 __fdiv_rn(src_to_float(x[4 * i + 3]), scale));
      w[i] = lo | (hi << 16);
    }
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  } else {
    static_assert(EPT == 1, "8 or 1 elements per thread");
    *dst = static_cast<uint8_t>(fp8x2_e4m3_from_float2(__fdiv_rn(src_to_float(*src), scale), 0.f));
  }
}

template <typename Index, typename Src, int EPT>
__global__ void __launch_bounds__(256) write_kv_fp8_kernel(const WriteKVParams p, int log2_bs) {
  const int pieces_per_row = p.head_dim / EPT;
  const int64_t total = static_cast<int64_t>(p.num_tokens) * p.num_kv_heads * pieces_per_row;
  const Index* slots = static_cast<const Index*>(p.slot_mapping);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / pieces_per_row;
    const int64_t e0 = static_cast<int64_t>(i - row * pieces_per_row) * EPT;
    const int64_t t = row / p.num_kv_heads;
    const int64_t h = row - t * p.num_kv_heads;
    const int64_t slot = static_cast<int64_t>(slots[t]);
    if (slot < 0 || slot >= p.num_slots) continue;
    const int64_t block = slot >> log2_bs;
    const int64_t offset = slot & ((int64_t{1} << log2_bs) - 1);
    const Src* ks = static_cast<const Src*>(p.k) + t * p.k_token_stride + h * p.k_head_stride + e0;
    const Src* vs = static_cast<const Src*>(p.v) + t * p.v_token_stride + h * p.v_head_stride + e0;
    uint8_t* kd = static_cast<uint8_t*>(p.k_cache) + block * p.kc_block_stride + offset * p.kc_token_stride +
                  h * p.kc_head_stride + e0;
    uint8_t* vd = static_cast<uint8_t*>(p.v_cache) + block * p.vc_block_stride + offset * p.vc_token_stride +
                  h * p.vc_head_stride + e0;
    quantise_piece<Src, EPT>(ks, kd, p.k_scale[h]);
    quantise_piece<Src, EPT>(vs, vd, p.v_scale[h]);
  }
}

template <typename Index, typename Src>
cudaError_t launch_fp8(const WriteKVParams& p, int log2_bs, cudaStream_t stream) {
  const int64_t eb = sizeof(Src);
  // 8 elements per thread: 16-byte source pieces and 8-byte cache pieces.
  const bool vec = p.head_dim % 8 == 0 && aligned16(p.k) && aligned16(p.v) && aligned8(p.k_cache) &&
                   aligned8(p.v_cache) && (p.k_token_stride * eb) % 16 == 0 && (p.k_head_stride * eb) % 16 == 0 &&
                   (p.v_token_stride * eb) % 16 == 0 && (p.v_head_stride * eb) % 16 == 0 &&
                   p.kc_block_stride % 8 == 0 && p.kc_token_stride % 8 == 0 && p.kc_head_stride % 8 == 0 &&
                   p.vc_block_stride % 8 == 0 && p.vc_token_stride % 8 == 0 && p.vc_head_stride % 8 == 0;
  const int ept = vec ? 8 : 1;
  const int64_t total = static_cast<int64_t>(p.num_tokens) * p.num_kv_heads * (p.head_dim / ept);
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, int64_t{1} << 20);
  if (blocks == 0) return cudaSuccess;
  if (vec) {
    write_kv_fp8_kernel<Index, Src, 8><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(p, log2_bs);
  } else {
    write_kv_fp8_kernel<Index, Src, 1><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(p, log2_bs);
  }
  return cudaGetLastError();
}

template <typename Index>
cudaError_t launch_fp8_index(const WriteKVParams& p, int log2_bs, cudaStream_t stream) {
  if (p.k_scale == nullptr || p.v_scale == nullptr) return cudaErrorInvalidValue;
  if (p.elem_bytes == 4) return launch_fp8<Index, float>(p, log2_bs, stream);
  if (p.elem_bytes != 2) return cudaErrorNotSupported;
  return p.src_dtype == DType::kBFloat16 ? launch_fp8<Index, __nv_bfloat16>(p, log2_bs, stream)
                                         : launch_fp8<Index, __half>(p, log2_bs, stream);
}

template <typename Index>
cudaError_t launch_index(const WriteKVParams& p, int log2_bs, cudaStream_t stream) {
  const int64_t eb = p.elem_bytes;
  const bool vec16 = aligned16(p.k) && aligned16(p.v) && aligned16(p.k_cache) && aligned16(p.v_cache) &&
                     (p.head_dim * eb) % 16 == 0 && (p.k_token_stride * eb) % 16 == 0 &&
                     (p.k_head_stride * eb) % 16 == 0 && (p.v_token_stride * eb) % 16 == 0 &&
                     (p.v_head_stride * eb) % 16 == 0 && (p.kc_block_stride * eb) % 16 == 0 &&
                     (p.kc_token_stride * eb) % 16 == 0 && (p.kc_head_stride * eb) % 16 == 0 &&
                     (p.vc_block_stride * eb) % 16 == 0 && (p.vc_token_stride * eb) % 16 == 0 &&
                     (p.vc_head_stride * eb) % 16 == 0;
  const int64_t piece_bytes = vec16 ? 16 : eb;
  const int64_t total = static_cast<int64_t>(p.num_tokens) * p.num_kv_heads * (p.head_dim * eb / piece_bytes);
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, int64_t{1} << 20);
  if (vec16) {
    write_kv_kernel<Index, uint4><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(p, log2_bs);
  } else if (eb == 2) {
    write_kv_kernel<Index, uint16_t><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(p, log2_bs);
  } else if (eb == 4) {
    write_kv_kernel<Index, uint32_t><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(p, log2_bs);
  } else {
    return cudaErrorNotSupported;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_write_kv_cache(const WriteKVParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0 || p.num_kv_heads == 0) return cudaSuccess;
  if (p.block_size <= 0 || (p.block_size & (p.block_size - 1)) != 0) return cudaErrorInvalidValue;
  int log2_bs = 0;
  while ((1 << log2_bs) < p.block_size) ++log2_bs;
  if (p.cache_fp8)
    return p.slot_is_int64 ? launch_fp8_index<int64_t>(p, log2_bs, stream)
                           : launch_fp8_index<int32_t>(p, log2_bs, stream);
  return p.slot_is_int64 ? launch_index<int64_t>(p, log2_bs, stream)
                         : launch_index<int32_t>(p, log2_bs, stream);
}

}  // namespace minipaged
