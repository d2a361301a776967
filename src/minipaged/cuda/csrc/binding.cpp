// The one torch binding of the minipaged CUDA kernels. It registers the
// custom ops of the `minipaged_cuda` namespace (schemas here, CUDA kernels
// below; the fake/meta implementations live in minipaged/cuda/ops.py), fills
// the torch-free parameter blocks from tensor strides and launches on the
// current stream. Includes are kept to the dispatcher and tensor headers
// (no torch/extension.h, no pybind11) because they dominate the JIT build time.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "params.h"

// Validation lives in one layer: api.py checks every DESIGN rule and names
// the argument. The checks here are only those that keep a direct torch.ops
// call from making a kernel read or write out of bounds (devices, dtypes,
// ranks, matching shapes, contiguity of what is indexed linearly); rules the
// launchers enforce themselves (head dims, GQA ratio, power-of-two block
// sizes, grid limits) come back as a launch error. Values in device memory
// (cu_seqlens, block tables, context_lens) are trusted: checking them needs a
// sync, which api.py does unless its caller opts out.
// Errors are thrown from this library (not through c10's torchCheckFail) and
// never while a device guard is alive; the Python exception type follows the
// DESIGN rules: TypeError for dtypes, ValueError for shapes/values,
// RuntimeError for a launch failure. Messages are assembled with std::string
// and std::to_string only: formatting integers through an ostream inside this
// library crashed the process on the H200 image (its libstdc++ locale facets
// do not match the headers the extension is compiled against), while plain
// string insertion works.
namespace mp_msg {
inline void append(std::string& out, const char* s) { out += s; }
inline void append(std::string& out, const std::string& s) { out += s; }
inline void append(std::string& out, c10::ScalarType t) { out += c10::toString(t); }
inline void append(std::string& out, const c10::Device& d) { out += d.str(); }
template <typename I, typename = std::enable_if_t<std::is_integral_v<I>>>
inline void append(std::string& out, I v) {
  out += std::to_string(v);
}
template <typename... Args>
std::string cat(const Args&... args) {
  std::string out;
  (append(out, args), ...);
  return out;
}
}  // namespace mp_msg

#define MP_FAIL(kind, ...) \
  throw ::c10::kind({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, ::mp_msg::cat(__VA_ARGS__))
#define MP_CHECK(cond, ...) \
  do {                      \
    if (!(cond)) MP_FAIL(Error, __VA_ARGS__); \
  } while (0)
#define MP_CHECK_VALUE(cond, ...) \
  do {                            \
    if (!(cond)) MP_FAIL(ValueError, __VA_ARGS__); \
  } while (0)
#define MP_CHECK_TYPE(cond, ...) \
  do {                           \
    if (!(cond)) MP_FAIL(TypeError, __VA_ARGS__); \
  } while (0)

namespace {

using minipaged::DType;

DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      MP_FAIL(TypeError, "minipaged cuda: ", name, " must be float16 or bfloat16, got ", t.scalar_type());
  }
}

void check_cuda_tensor(const at::Tensor& t, const char* name, const at::Tensor& like) {
  MP_CHECK_VALUE(t.is_cuda(), "minipaged cuda: ", name, " must be a CUDA tensor");
  MP_CHECK_VALUE(t.device() == like.device(), "minipaged cuda: ", name, " is on ", t.device(),
              " but q is on ", like.device());
  MP_CHECK_VALUE(t.dim() == 0 || t.stride(-1) == 1 || t.size(-1) <= 1, "minipaged cuda: ", name,
              " must have a contiguous last dim");
}

void check_launch(cudaError_t err, const char* what) {
  MP_CHECK(err == cudaSuccess, "minipaged cuda: ", what, " failed: ", cudaGetErrorName(err), " (",
              cudaGetErrorString(err), ")");
}

// Device attributes do not change while the process runs: read each once per device.
template <cudaDeviceAttr kAttr>
int cached_device_attr(int device, const char* name, int fallback) {
  static int cache[128] = {0};
  if (device < 0 || device >= 128) return fallback;
  if (cache[device] == 0) {
    int n = 0;
    check_launch(cudaDeviceGetAttribute(&n, kAttr, device), name);
    cache[device] = n;
  }
  return cache[device];
}

int num_sms(int device) {
  return cached_device_attr<cudaDevAttrMultiProcessorCount>(device, "cudaDeviceGetAttribute(multiProcessorCount)",
                                                            132);
}

int l2_bytes(int device) {
  return cached_device_attr<cudaDevAttrL2CacheSize>(device, "cudaDeviceGetAttribute(l2CacheSize)", 0);
}

int cc_major(int device) {
  return cached_device_attr<cudaDevAttrComputeCapabilityMajor>(
      device, "cudaDeviceGetAttribute(computeCapabilityMajor)", 0);
}

bool rows_aligned16(const at::Tensor& t) {
  if ((reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) != 0) return false;
  for (int64_t i = 0; i + 1 < t.dim(); ++i) {
    if (t.size(i) > 1 && (t.stride(i) * t.element_size()) % 16 != 0) return false;
  }
  return true;
}

using PrefillLauncher = cudaError_t (*)(const minipaged::PrefillParams&, cudaStream_t);

// Zeroed int32 counters for a kernel that leaves them zero (defined below, with the rules).
enum CounterPool { kDecodeSplitCounters = 0, kPrefillSchedCounters = 1 };
cudaError_t zeroed_counters(CounterPool pool, int device, cudaStream_t stream, int64_t count, int32_t** out);
using OutLse = std::tuple<at::Tensor, at::Tensor>;

// The lse output of an op over q: float32 of q's shape without its last dim
// when asked for, else an empty placeholder (the schemas always return two
// tensors; the kernels skip the lse work when its pointer is null).
at::Tensor new_lse(const at::Tensor& q, bool return_lse) {
  const auto sizes = q.sizes();
  return return_lse ? q.new_empty(sizes.slice(0, sizes.size() - 1), q.options().dtype(at::kFloat))
                    : q.new_empty({0}, q.options().dtype(at::kFloat));
}

OutLse run_prefill(PrefillLauncher launch, const char* launcher_name, const at::Tensor& q,
                       const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& cu_seqlens_q,
                       const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q,
                       int64_t max_seqlen_k, bool causal, double scale, bool return_lse) {
  const bool varlen = cu_seqlens_q.has_value();
  check_cuda_tensor(q, "q", q);
  check_cuda_tensor(k, "k", q);
  check_cuda_tensor(v, "v", q);
  const DType dtype = dtype_of(q, "q");
  MP_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "minipaged cuda: q, k, v must share one dtype");
  const int64_t rank = varlen ? 3 : 4;
  MP_CHECK_VALUE(q.dim() == rank && k.dim() == rank && v.dim() == rank, "minipaged cuda: ",
                 varlen ? "varlen q/k/v must be 3-D [T,H,D]" : "dense q/k/v must be 4-D [B,H,N,D]");
  MP_CHECK_VALUE(v.sizes() == k.sizes() && k.size(-1) == q.size(-1) && (varlen || k.size(0) == q.size(0)),
                 "minipaged cuda: k and v must have one shape, with q's head dim (and batch)");
  // o is a fresh contiguous tensor of q's shape: its strides are known before it exists.
  minipaged::PrefillParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  if (varlen) {
    const at::Tensor& cq = *cu_seqlens_q;
    const at::Tensor& ck = *cu_seqlens_k;
    MP_CHECK_TYPE(cq.scalar_type() == at::kInt && ck.scalar_type() == at::kInt,
                "minipaged cuda: cu_seqlens must be int32");
    MP_CHECK_VALUE(cq.is_contiguous() && ck.is_contiguous(), "minipaged cuda: cu_seqlens must be contiguous");
    MP_CHECK_VALUE(cq.numel() == ck.numel() && cq.numel() >= 1,
                   "minipaged cuda: cu_seqlens_q and cu_seqlens_k must both have S+1 >= 1 entries");
    check_cuda_tensor(cq, "cu_seqlens_q", q);
    check_cuda_tensor(ck, "cu_seqlens_k", q);
    p.cu_seqlens_q = cq.data_ptr<int32_t>();
    p.cu_seqlens_k = ck.data_ptr<int32_t>();
    p.batch = static_cast<int>(cq.numel() - 1);
    p.num_q_heads = static_cast<int>(q.size(1));
    p.num_kv_heads = static_cast<int>(k.size(1));
    p.head_dim = static_cast<int>(q.size(2));
    p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = 0;
    p.q_row_stride = q.stride(0), p.q_head_stride = q.stride(1);
    p.k_row_stride = k.stride(0), p.k_head_stride = k.stride(1);
    p.v_row_stride = v.stride(0), p.v_head_stride = v.stride(1);
    p.o_row_stride = q.size(1) * q.size(2), p.o_head_stride = q.size(2);
    p.max_seqlen_q = static_cast<int>(max_seqlen_q);
    p.max_seqlen_k = static_cast<int>(max_seqlen_k);
    p.total_q = q.size(0), p.total_k = k.size(0);
    // lse [Tq, Hq]
    p.lse_batch_stride = 0, p.lse_head_stride = 1, p.lse_row_stride = q.size(1);
  } else {
    p.cu_seqlens_q = p.cu_seqlens_k = nullptr;
    p.batch = static_cast<int>(q.size(0));
    p.num_q_heads = static_cast<int>(q.size(1));
    p.num_kv_heads = static_cast<int>(k.size(1));
    p.head_dim = static_cast<int>(q.size(3));
    p.q_batch_stride = q.stride(0), p.q_head_stride = q.stride(1), p.q_row_stride = q.stride(2);
    p.k_batch_stride = k.stride(0), p.k_head_stride = k.stride(1), p.k_row_stride = k.stride(2);
    p.v_batch_stride = v.stride(0), p.v_head_stride = v.stride(1), p.v_row_stride = v.stride(2);
    p.o_batch_stride = q.size(1) * q.size(2) * q.size(3), p.o_head_stride = q.size(2) * q.size(3);
    p.o_row_stride = q.size(3);
    p.max_seqlen_q = static_cast<int>(q.size(2));
    p.max_seqlen_k = static_cast<int>(k.size(2));
    // lse [B, Hq, Nq]
    p.lse_batch_stride = q.size(1) * q.size(2), p.lse_head_stride = q.size(2), p.lse_row_stride = 1;
  }
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  p.dtype = dtype;
  p.num_sms = num_sms(q.get_device());
  p.l2_bytes = l2_bytes(q.get_device());
  at::Tensor o, lse;
  cudaError_t err = cudaSuccess;
  {
    c10::cuda::CUDAGuard guard(q.device());
    o = q.new_empty(q.sizes());
    lse = new_lse(q, return_lse);
    p.lse = return_lse ? lse.data_ptr<float>() : nullptr;
    if (o.numel() > 0) {
      p.o = o.data_ptr();
      const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
      // The sm_90 dispatch may pick the dynamic persistent kernel (prefill/dispatch.cuh).
      if (launch == &minipaged::launch_prefill_fast && cc_major(q.get_device()) >= 9)
        err = zeroed_counters(kPrefillSchedCounters, q.get_device(), stream, 2, &p.sched_counters);
      if (err == cudaSuccess) err = launch(p, stream);
    }
  }
  check_launch(err, launcher_name);
  return {o, lse};
}

OutLse prefill_fast(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                    bool return_lse) {
  return run_prefill(&minipaged::launch_prefill_fast, "launch_prefill_fast", q, k, v, std::nullopt,
                     std::nullopt, 0, 0, causal, scale, return_lse);
}

OutLse prefill_wmma(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                    bool return_lse) {
  return run_prefill(&minipaged::launch_prefill_wmma, "launch_prefill_wmma", q, k, v, std::nullopt,
                     std::nullopt, 0, 0, causal, scale, return_lse);
}

OutLse prefill_varlen_fast(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                           int64_t max_seqlen_k, bool causal, double scale, bool return_lse) {
  return run_prefill(&minipaged::launch_prefill_fast, "launch_prefill_fast", q, k, v, cu_seqlens_q,
                     cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, return_lse);
}

OutLse prefill_varlen_wmma(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                           int64_t max_seqlen_k, bool causal, double scale, bool return_lse) {
  return run_prefill(&minipaged::launch_prefill_wmma, "launch_prefill_wmma", q, k, v, cu_seqlens_q,
                     cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, return_lse);
}

using OptTensor = std::optional<at::Tensor>;

// FP8 caches: the per-KV-head scales the kernels read (k_scale[h], v_scale[h]
// for every h < Hkv): float32, 1-D, contiguous, num_kv_heads elements, on
// `like`'s device. 16-bit caches take none. Returns whether the caches are FP8.
bool check_kv_scales(const at::Tensor& k_cache, const at::Tensor& v_cache, const OptTensor& k_scale,
                     const OptTensor& v_scale, int64_t num_kv_heads, const at::Tensor& like) {
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  MP_CHECK_TYPE(v_cache.scalar_type() == k_cache.scalar_type(),
                "minipaged cuda: k_cache and v_cache must share one dtype, got ", k_cache.scalar_type(), " and ",
                v_cache.scalar_type());
  if (!fp8) {
    MP_CHECK_VALUE(!k_scale.has_value() && !v_scale.has_value(),
                   "minipaged cuda: k_scale/v_scale apply to float8_e4m3fn caches only, the caches are ",
                   k_cache.scalar_type());
    return false;
  }
  MP_CHECK_VALUE(k_scale.has_value() && v_scale.has_value(),
                 "minipaged cuda: float8_e4m3fn caches need k_scale and v_scale (float32 [Hkv])");
  for (const at::Tensor* s : {&*k_scale, &*v_scale}) {
    const char* name = s == &*k_scale ? "k_scale" : "v_scale";
    check_cuda_tensor(*s, name, like);
    MP_CHECK_TYPE(s->scalar_type() == at::kFloat, "minipaged cuda: ", name, " must be float32, got ",
                  s->scalar_type());
    MP_CHECK_VALUE(s->dim() == 1 && s->size(0) == num_kv_heads && s->is_contiguous(), "minipaged cuda: ", name,
                   " must be a contiguous float32 [Hkv] = [", num_kv_heads, "] tensor");
  }
  return true;
}

// Memory-safety checks shared by decode and paged: q [rows, Hq, D] against
// caches [num_blocks, block_size, Hkv, D] (q's dtype, or float8_e4m3fn with
// k_scale/v_scale) and an int32 block table and context_lens with `seqs` rows.
// Returns whether the caches are FP8.
bool check_paged_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t seqs,
                        const char* op, const OptTensor& k_scale, const OptTensor& v_scale) {
  check_cuda_tensor(q, "q", q);
  check_cuda_tensor(k_cache, "k_cache", q);
  check_cuda_tensor(v_cache, "v_cache", q);
  check_cuda_tensor(block_tables, "block_tables", q);
  check_cuda_tensor(context_lens, "context_lens", q);
  dtype_of(q, "q");
  MP_CHECK_VALUE(k_cache.dim() == 4, "minipaged cuda: ", op, " wants caches [num_blocks,block_size,Hkv,D]");
  const bool fp8 = check_kv_scales(k_cache, v_cache, k_scale, v_scale, k_cache.size(2), q);
  MP_CHECK_TYPE(fp8 || (k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type()),
                "minipaged cuda: the caches must have q's dtype or be float8_e4m3fn");
  MP_CHECK_VALUE(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "minipaged cuda: ", op,
                 " wants q [T,Hq,D] and caches [num_blocks,block_size,Hkv,D]");
  MP_CHECK_TYPE(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
                "minipaged cuda: block_tables and context_lens must be int32");
  MP_CHECK_VALUE(context_lens.dim() == 1 && context_lens.is_contiguous(),
                 "minipaged cuda: context_lens must be a contiguous 1-D tensor");
  MP_CHECK_VALUE(block_tables.dim() == 2, "minipaged cuda: block_tables must be 2-D");
  MP_CHECK_VALUE(v_cache.sizes() == k_cache.sizes() && k_cache.size(3) == q.size(2),
                 "minipaged cuda: k_cache and v_cache must have one shape, with q's head dim");
  MP_CHECK_VALUE(block_tables.size(0) == seqs && context_lens.size(0) == seqs, "minipaged cuda: ", op,
                 ": block_tables/context_lens have ", block_tables.size(0), "/", context_lens.size(0),
                 " rows, expected ", seqs);
  // The kernels stream cache rows in 16-byte pieces and walk a table row with
  // unit stride; mp.* hands them contiguous caches and tables (api.py is the one
  // place that makes tensors kernel-ready), a direct torch.ops call must too.
  MP_CHECK_VALUE(rows_aligned16(k_cache) && rows_aligned16(v_cache) && k_cache.stride(-1) == 1 &&
                     v_cache.stride(-1) == 1,
                 "minipaged cuda: ", op, " wants caches with unit-stride, 16-byte aligned rows (contiguous)");
  MP_CHECK_VALUE(block_tables.size(1) <= 1 || block_tables.stride(1) == 1, "minipaged cuda: ", op,
                 " wants block_tables rows with unit stride");
  // The tensor-core decode kernel steps through pages with 32-bit block and token strides.
  MP_CHECK_VALUE(std::max(k_cache.stride(0), v_cache.stride(0)) <= INT32_MAX, "minipaged cuda: ", op,
                 " wants cache blocks of at most 2^31 - 1 elements");
  return fp8;
}

// Counters that kernels find zero and leave zero: the arrival counters of the
// one-launch split reduction (decode variant bit 0x400; its last CTA per group
// puts its counter back) and the work-item counter of the dynamic persistent
// prefill (PrefillParams::sched_counters; its last CTA resets it). Zeroed once,
// when allocated. One buffer per (pool, device, stream): calls on one stream
// run one after another, calls on two streams could interleave their arrivals,
// and a pool per kind of kernel keeps a decode from ever sharing a prefill's. A
// CUDA graph keeps the pointer it was captured with (and is replayed, like
// anything captured on that stream, in stream order with other work using
// it), so a buffer is never freed or reused for something else: a larger
// request allocates a new one and keeps the old alive. Allocation goes around
// the caching allocator (plain cudaMalloc, permitted during a capture by a
// relaxed capture mode) and the zero fill never joins a capture: on a
// capturing stream it runs on a private stream and is waited for.
// The split-KV workspace of a planned decode (partial_o, then partial_lse):
// allocated from torch's caching allocator for this call and pointed to by p;
// an undefined tensor when the plan does not split.
at::Tensor decode_split_workspace(const at::Tensor& q, minipaged::DecodeParams& p) {
  const int64_t floats = minipaged::decode_workspace_floats(p);
  if (floats == 0) return {};
  at::Tensor workspace = q.new_empty({floats}, q.options().dtype(at::kFloat));
  minipaged::decode_set_workspace(p, workspace.data_ptr<float>());
  return workspace;
}

// The split workspaces of a routed paged call's decode launches (launch_paged_routed_decodes),
// from torch's caching allocator, held until the launches are enqueued.
struct RoutedWorkspaces {
  const at::Tensor* like;
  std::vector<at::Tensor> held;
  static float* allocate(int64_t floats, void* ctx) {
    auto* self = static_cast<RoutedWorkspaces*>(ctx);
    self->held.push_back(self->like->new_empty({floats}, self->like->options().dtype(at::kFloat)));
    return self->held.back().data_ptr<float>();
  }
};

cudaError_t zeroed_counters(CounterPool pool, int device, cudaStream_t stream, int64_t count, int32_t** out) {
  struct Entry {
    CounterPool pool;
    int device;
    cudaStream_t stream;
    int32_t* ptr;
    int64_t count;
  };
  static std::mutex mu;
  static std::vector<Entry> entries;
  std::lock_guard<std::mutex> lock(mu);
  for (Entry& e : entries) {
    if (e.pool == pool && e.device == device && e.stream == stream && e.count >= count) {
      *out = e.ptr;
      return cudaSuccess;
    }
  }
  Entry* slot = nullptr;
  for (Entry& e : entries)
    if (e.pool == pool && e.device == device && e.stream == stream) slot = &e;
  const int64_t n = std::max<int64_t>({count, int64_t{4096}, slot ? 2 * slot->count : 0});
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t err = cudaStreamIsCapturing(stream, &capture);
  if (err != cudaSuccess) return err;
  int32_t* ptr = nullptr;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  err = cudaThreadExchangeStreamCaptureMode(&mode);
  if (err != cudaSuccess) return err;
  err = cudaMalloc(&ptr, n * sizeof(int32_t));
  if (err == cudaSuccess) {
    if (capture == cudaStreamCaptureStatusNone) {
      err = cudaMemsetAsync(ptr, 0, n * sizeof(int32_t), stream);
    } else {
      cudaStream_t side = nullptr;
      err = cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
      if (err == cudaSuccess) {
        err = cudaMemsetAsync(ptr, 0, n * sizeof(int32_t), side);
        const cudaError_t sync = cudaStreamSynchronize(side);
        if (err == cudaSuccess) err = sync;
        cudaStreamDestroy(side);
      }
    }
    if (err != cudaSuccess) cudaFree(ptr);
  }
  cudaStreamCaptureMode restore = mode;
  cudaThreadExchangeStreamCaptureMode(&restore);
  if (err != cudaSuccess) return err;
  if (slot != nullptr) {
    // The old buffer stays allocated (a captured graph may hold it); new calls use the larger one.
    slot->ptr = ptr;
    slot->count = n;
  } else {
    entries.push_back({pool, device, stream, ptr, n});
  }
  *out = ptr;
  return cudaSuccess;
}

// Decode proper (checks done): one query row per sequence.
OutLse run_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t num_splits,
                  int64_t variant, bool return_lse, bool fp8, const OptTensor& k_scale, const OptTensor& v_scale) {
  const DType dtype = dtype_of(q, "q");
  at::Tensor o, lse;
  cudaError_t err = cudaSuccess;
  {
    c10::cuda::CUDAGuard guard(q.device());
    const at::Tensor& bt = block_tables;
    o = q.new_empty(q.sizes());
    lse = new_lse(q, return_lse);
    minipaged::DecodeParams p{};
    p.q = q.data_ptr();
    p.k_cache = k_cache.data_ptr();
    p.v_cache = v_cache.data_ptr();
    p.o = o.data_ptr();
    p.lse = return_lse ? lse.data_ptr<float>() : nullptr;
    p.lse_batch_stride = q.size(1);
    p.block_tables = bt.data_ptr<int32_t>();
    p.context_lens = context_lens.data_ptr<int32_t>();
    p.q_batch_stride = q.stride(0), p.q_head_stride = q.stride(1);
    p.o_batch_stride = o.stride(0), p.o_head_stride = o.stride(1);
    p.k_block_stride = k_cache.stride(0), p.k_token_stride = k_cache.stride(1);
    p.k_head_stride = k_cache.stride(2);
    p.v_block_stride = v_cache.stride(0), p.v_token_stride = v_cache.stride(1);
    p.v_head_stride = v_cache.stride(2);
    p.block_table_stride = bt.stride(0);
    p.batch = static_cast<int>(q.size(0));
    p.num_q_heads = static_cast<int>(q.size(1));
    p.num_kv_heads = static_cast<int>(k_cache.size(2));
    p.head_dim = static_cast<int>(q.size(2));
    p.block_size = static_cast<int>(k_cache.size(1));
    p.max_blocks = static_cast<int>(bt.size(1));
    p.scale = static_cast<float>(scale);
    p.dtype = dtype;
    p.num_sms = num_sms(q.get_device());
    p.cc_major = cc_major(q.get_device());
    p.variant = static_cast<int>(variant);
    p.kv_fp8 = fp8;
    p.k_scale = fp8 ? k_scale->data_ptr<float>() : nullptr;
    p.v_scale = fp8 ? v_scale->data_ptr<float>() : nullptr;
    if (o.numel() > 0) {
      const minipaged::DecodePlan plan = minipaged::decode_plan(p, static_cast<int>(num_splits));
      const at::Tensor workspace = decode_split_workspace(q, p);
      const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
      const int64_t counters = minipaged::decode_split_counter_count(p, plan);
      if (counters > 0) err = zeroed_counters(kDecodeSplitCounters, q.get_device(), stream, counters, &p.split_counters);
      if (err == cudaSuccess) err = minipaged::launch_decode(p, plan, stream);
    }
  }
  check_launch(err, "launch_decode");
  return {o, lse};
}

OutLse decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t num_splits,
              int64_t variant, bool return_lse, const OptTensor& k_scale, const OptTensor& v_scale) {
  const bool fp8 =
      check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, q.size(0), "decode", k_scale, v_scale);
  return run_decode(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, variant, return_lse, fp8,
                    k_scale, v_scale);
}

// Paged attention for any query length. A pure decode batch (every q_len 1:
// max_seqlen_q == 1 and one query row per sequence) runs the decode kernels, so
// that paged == decode exactly there; everything else runs the prefill kernels
// with the paged K/V loader, except, with the decode routing (on by default;
// variant 4 forces it, prefill/dispatch.cuh), the q_len == 1 rows of a mixed
// batch and its short runs (paged_spec_decode), which run the decode kernels
// (more launches on the stream).
OutLse paged(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
             const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q, const at::Tensor& context_lens,
             int64_t max_seqlen_q, bool causal, double scale, bool return_lse, int64_t num_splits,
             int64_t variant, const OptTensor& k_scale, const OptTensor& v_scale) {
  check_cuda_tensor(cu_seqlens_q, "cu_seqlens_q", q);
  MP_CHECK_TYPE(cu_seqlens_q.scalar_type() == at::kInt, "minipaged cuda: cu_seqlens_q must be int32");
  MP_CHECK_VALUE(cu_seqlens_q.dim() == 1 && cu_seqlens_q.is_contiguous() && cu_seqlens_q.numel() >= 1,
                 "minipaged cuda: cu_seqlens_q must be a contiguous 1-D tensor of S+1 >= 1 entries");
  const int64_t seqs = cu_seqlens_q.numel() - 1;
  const bool fp8 =
      check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, seqs, "paged", k_scale, v_scale);
  // An upper bound of every q_len; only the grid depends on it (rows past a
  // sequence's own q_len are skipped), so any value that survives the cast to
  // int (and the grid arithmetic) is safe.
  MP_CHECK_VALUE(max_seqlen_q >= 0 && max_seqlen_q <= (int64_t{1} << 24),
                 "minipaged cuda: max_seqlen_q must be in [0, 2^24], got ", max_seqlen_q);
  if (max_seqlen_q == 1 && q.size(0) == seqs)
    return run_decode(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, variant,
                      return_lse, fp8, k_scale, v_scale);
  const DType dtype = dtype_of(q, "q");
  at::Tensor o, lse;
  cudaError_t err = cudaSuccess;
  const char* launcher = "launch_prefill_paged";  // named in the error of a failed launch
  {
    c10::cuda::CUDAGuard guard(q.device());
    const at::Tensor& bt = block_tables;
    o = q.new_empty(q.sizes());
    lse = new_lse(q, return_lse);
    minipaged::PrefillParams p{};
    p.q = q.data_ptr();
    p.k = k_cache.data_ptr();
    p.v = v_cache.data_ptr();
    p.o = o.data_ptr();
    p.lse = return_lse ? lse.data_ptr<float>() : nullptr;
    p.lse_batch_stride = 0, p.lse_head_stride = 1, p.lse_row_stride = q.size(1);
    p.cu_seqlens_q = cu_seqlens_q.data_ptr<int32_t>();
    p.cu_seqlens_k = nullptr;
    p.block_tables = bt.data_ptr<int32_t>();
    p.context_lens = context_lens.data_ptr<int32_t>();
    p.block_table_stride = bt.stride(0);
    p.q_row_stride = q.stride(0), p.q_head_stride = q.stride(1);
    p.o_row_stride = o.stride(0), p.o_head_stride = o.stride(1);
    p.k_block_stride = k_cache.stride(0), p.k_row_stride = k_cache.stride(1), p.k_head_stride = k_cache.stride(2);
    p.v_block_stride = v_cache.stride(0), p.v_row_stride = v_cache.stride(1), p.v_head_stride = v_cache.stride(2);
    p.batch = static_cast<int>(seqs);
    p.num_q_heads = static_cast<int>(q.size(1));
    p.num_kv_heads = static_cast<int>(k_cache.size(2));
    p.head_dim = static_cast<int>(q.size(2));
    p.block_size = static_cast<int>(k_cache.size(1));
    p.max_blocks = static_cast<int>(bt.size(1));
    p.max_seqlen_q = static_cast<int>(max_seqlen_q);
    // Extents of the sm_90 TMA maps (q rows, cache blocks).
    p.total_q = q.size(0);
    p.num_blocks = k_cache.size(0);
    p.scale = static_cast<float>(scale);
    p.causal = causal;
    p.dtype = dtype;
    p.num_sms = num_sms(q.get_device());
    // (the warp-merge and short-ring bits flip rules of the routed decode launches; the rest picks paths)
    constexpr int64_t kRoutedDecodeBits = minipaged::kDecodeVariantWarpMerge | minipaged::kDecodeVariantFp8ShortRing;
    p.variant = static_cast<int>(variant & ~kRoutedDecodeBits);
    p.decode_variant = static_cast<int>(variant & kRoutedDecodeBits);
    p.kv_fp8 = fp8;
    p.k_scale = fp8 ? k_scale->data_ptr<float>() : nullptr;
    p.v_scale = fp8 ? v_scale->data_ptr<float>() : nullptr;
    // KV splits of the packed short-query launches and their workspace, from this call's
    // torch allocator (a graph keeps the pointer; a forced num_splits applies here as well
    // as to the decode rows).
    at::Tensor pack_workspace;
    const minipaged::PackSplitPlan pack = minipaged::paged_pack_split_plan(p, static_cast<int>(num_splits));
    if (pack.splits > 1 && o.numel() > 0) {
      pack_workspace = q.new_empty({pack.workspace_floats}, q.options().dtype(at::kFloat));
      p.pack_splits = pack.splits;
      p.pack_split_keys = pack.split_keys;
      p.pack_rows = pack.rows;
      p.pack_partial_o = pack_workspace.data_ptr<float>();
      p.pack_partial_lse = p.pack_partial_o + pack.workspace_floats / (p.head_dim + 1) * p.head_dim;
    }
    if (o.numel() > 0 && seqs > 0 && max_seqlen_q > 0) {
      const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
      // Decode routing: launch_prefill_paged keeps the rows the decode kernels
      // do not take (and checks strides and alignment before anything runs),
      // then the q_len == 1 rows, and the short runs where paged_spec_decode,
      // run the decode kernels with their split-K plans and workspaces, as the
      // decode op would, on the same stream. Which sequence is which is decided
      // on the device.
      err = minipaged::launch_prefill_paged(p, stream);
      if (err == cudaSuccess) {
        RoutedWorkspaces workspaces{&q, {}};
        err = minipaged::launch_paged_routed_decodes(p, cc_major(q.get_device()), static_cast<int>(num_splits),
                                                     &RoutedWorkspaces::allocate, &workspaces, stream);
        if (err != cudaSuccess) launcher = "launch_decode (paged decode routing)";
      }
    }
  }
  check_launch(err, launcher);
  return {o, lse};
}

void write_kv_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& slot_mapping, const OptTensor& k_scale, const OptTensor& v_scale) {
  check_cuda_tensor(k, "k", k);
  check_cuda_tensor(v, "v", k);
  check_cuda_tensor(k_cache, "k_cache", k);
  check_cuda_tensor(v_cache, "v_cache", k);
  check_cuda_tensor(slot_mapping, "slot_mapping", k);
  MP_CHECK_VALUE(k.dim() == 3 && v.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "minipaged cuda: write_kv_cache wants k/v [T,Hkv,D] and caches [num_blocks,block_size,Hkv,D]");
  MP_CHECK_VALUE(k_cache.dim() == 4, "minipaged cuda: write_kv_cache wants caches [num_blocks,block_size,Hkv,D]");
  const bool fp8 = check_kv_scales(k_cache, v_cache, k_scale, v_scale, k_cache.size(2), k);
  const bool src_ok = k.scalar_type() == at::kHalf || k.scalar_type() == at::kBFloat16 || k.scalar_type() == at::kFloat;
  MP_CHECK_TYPE(k.scalar_type() == v.scalar_type() && (fp8 ? src_ok : k.scalar_type() == k_cache.scalar_type()),
                "minipaged cuda: k and v must share one dtype, the caches' (or float16/bfloat16/float32 with "
                "float8_e4m3fn caches), got ", k.scalar_type(), " and ", v.scalar_type(), " for ",
                k_cache.scalar_type(), " caches");
  MP_CHECK_TYPE(slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt,
              "minipaged cuda: slot_mapping must be int32 or int64");
  MP_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.is_contiguous(),
              "minipaged cuda: slot_mapping must be a contiguous 1-D tensor");
  MP_CHECK_VALUE(v.sizes() == k.sizes() && slot_mapping.numel() == k.size(0),
                 "minipaged cuda: k, v and slot_mapping must have one row per token (k and v one shape)");
  MP_CHECK_VALUE(v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2),
                 "minipaged cuda: k_cache and v_cache must have one shape, with k's Hkv and head dim");
  minipaged::WriteKVParams p{};
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr();
  p.slot_is_int64 = slot_mapping.scalar_type() == at::kLong;
  p.k_token_stride = k.stride(0), p.k_head_stride = k.stride(1);
  p.v_token_stride = v.stride(0), p.v_head_stride = v.stride(1);
  p.kc_block_stride = k_cache.stride(0), p.kc_token_stride = k_cache.stride(1), p.kc_head_stride = k_cache.stride(2);
  p.vc_block_stride = v_cache.stride(0), p.vc_token_stride = v_cache.stride(1), p.vc_head_stride = v_cache.stride(2);
  p.num_tokens = static_cast<int>(k.size(0));
  p.num_kv_heads = static_cast<int>(k.size(1));
  p.head_dim = static_cast<int>(k.size(2));
  p.block_size = static_cast<int>(k_cache.size(1));
  p.num_slots = k_cache.size(0) * k_cache.size(1);
  p.elem_bytes = static_cast<int>(k.element_size());
  p.cache_fp8 = fp8;
  p.src_dtype = k.scalar_type() == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat16;
  p.k_scale = fp8 ? k_scale->data_ptr<float>() : nullptr;
  p.v_scale = fp8 ? v_scale->data_ptr<float>() : nullptr;
  cudaError_t err = cudaSuccess;
  {
    c10::cuda::CUDAGuard guard(k.device());
    err = minipaged::launch_write_kv_cache(p, c10::cuda::getCurrentCUDAStream(k.get_device()).stream());
  }
  check_launch(err, "launch_write_kv_cache");
}



}  // namespace

TORCH_LIBRARY(minipaged_cuda, m) {
  // Every attention op returns (o, lse); lse is an empty placeholder unless
  // return_lse is true (then float32, q's shape without its last dim).
  m.def("prefill_fast(Tensor q, Tensor k, Tensor v, bool causal, float scale, bool return_lse=False) -> (Tensor, Tensor)");
  m.def("prefill_wmma(Tensor q, Tensor k, Tensor v, bool causal, float scale, bool return_lse=False) -> (Tensor, Tensor)");
  m.def(
      "prefill_varlen_fast(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, bool causal, float scale, bool return_lse=False) -> (Tensor, Tensor)");
  m.def(
      "prefill_varlen_wmma(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, bool causal, float scale, bool return_lse=False) -> (Tensor, Tensor)");
  m.def(
      "decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
      "float scale, int num_splits=0, int variant=0, bool return_lse=False, Tensor? k_scale=None, "
      "Tensor? v_scale=None) -> (Tensor, Tensor)");
  m.def(
      "paged(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor cu_seqlens_q, "
      "Tensor context_lens, int max_seqlen_q, bool causal, float scale, bool return_lse=False, "
      "int num_splits=0, int variant=0, Tensor? k_scale=None, Tensor? v_scale=None) -> (Tensor, Tensor)");
  m.def(
      "write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
      "Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
}

TORCH_LIBRARY_IMPL(minipaged_cuda, CUDA, m) {
  m.impl("prefill_fast", &prefill_fast);
  m.impl("prefill_wmma", &prefill_wmma);
  m.impl("prefill_varlen_fast", &prefill_varlen_fast);
  m.impl("prefill_varlen_wmma", &prefill_varlen_wmma);
  m.impl("decode", &decode);
  m.impl("paged", &paged);
  m.impl("write_kv_cache", &write_kv_cache);
}
