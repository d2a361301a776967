// write_kv_cache: scatter new K/V rows into the paged caches.
// One thread moves one 16-byte piece of one (token, KV head) row of K and the
// same piece of V; rows go to slot = block * block_size + offset, and a
// negative (or out-of-range) slot skips the token. Inputs and caches may have
// any strides as long as the last dim is contiguous; when a pointer or stride
// is not 16-byte aligned the same kernel runs with element-sized pieces.
#include <algorithm>

#include "params.h"

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
  return p.slot_is_int64 ? launch_index<int64_t>(p, log2_bs, stream)
                         : launch_index<int32_t>(p, log2_bs, stream);
}

}  // namespace minipaged
