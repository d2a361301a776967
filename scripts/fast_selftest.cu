// Torch-free self test and timing harness for the `cuda` fast prefill.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 -Xcompiler -fopenmp \
//        -I src/minipaged/cuda/csrc scripts/fast_selftest.cu \
//        src/minipaged/cuda/csrc/prefill/fast*.cu -o fast_selftest
//   ./fast_selftest check [variant filter]
//                             correctness vs a CPU double reference (many shapes)
//   ./fast_selftest small     two tiny cases (for compute-sanitizer)
//   ./fast_selftest time [reps] [name filter]
//                             TFLOP/s, bf16 Hq=16 Hkv=8 D=128 causal, every variant
// With -DMINIPAGED_ENABLE_SM90A and -gencode arch=compute_90a,code=sm_90a the
// wgmma kernels are built too (dispatched on sm_90, checked and timed here).
//
// Outputs are poisoned with NaN (0xFFFF) before each launch, and written with
// a padded row stride so that any write outside the rows/columns it owns shows
// up as a clobbered pad. Exit status 0 only if every check passed.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "params.h"
#include "selftest_common.h"
#include "prefill/mainloop_mma.cuh"
#if defined(MINIPAGED_ENABLE_SM90A)
#include "prefill/mainloop_wgmma.cuh"
#include "prefill/mainloop_ws.cuh"
#endif

using minipaged::DType;
using minipaged::PrefillParams;


using LaunchFn = cudaError_t (*)(const PrefillParams&, cudaStream_t);

struct Case {
  std::string name;
  DType dtype;
  int hq, hkv, d;
  bool causal;
  bool varlen;
  std::vector<int> seqlens_q, seqlens_k;  // dense: one entry each, batch given by `batch`
  int batch;
  bool bnhd;  // dense only: q/k/v stored [B, N, H, D] (strided heads)
  float scale;  // 0 -> 1/sqrt(D)
};

// Runs one case through `fn` and compares with a double-precision reference.
static bool run_case(const Case& c, LaunchFn fn, const char* fn_name, bool verbose = true) {
  const DType dt = c.dtype;
  const int D = c.d;
  const int B = c.varlen ? int(c.seqlens_q.size()) : c.batch;
  std::vector<int> sq(B), sk(B), cq(B + 1, 0), ck(B + 1, 0);
  for (int b = 0; b < B; ++b) {
    sq[b] = c.varlen ? c.seqlens_q[b] : c.seqlens_q[0];
    sk[b] = c.varlen ? c.seqlens_k[b] : c.seqlens_k[0];
    cq[b + 1] = cq[b] + sq[b];
    ck[b + 1] = ck[b] + sk[b];
  }
  const int max_q = *std::max_element(sq.begin(), sq.end());
  const int max_k = *std::max_element(sk.begin(), sk.end());
  const int Tq = cq[B], Tk = ck[B];
  const int o_pad = 8;  // extra columns per output row that must stay NaN

  // Element (b, h, i, :) offsets.
  int64_t qs[3], ks[3], os[3];  // batch, head, row strides
  size_t q_elems, k_elems, o_elems;
  if (c.varlen) {
    qs[0] = 0; qs[1] = D; qs[2] = int64_t(c.hq) * D;
    ks[0] = 0; ks[1] = D; ks[2] = int64_t(c.hkv) * D;
    os[0] = 0; os[1] = D + o_pad; os[2] = int64_t(c.hq) * (D + o_pad);
    q_elems = size_t(Tq) * c.hq * D;
    k_elems = size_t(Tk) * c.hkv * D;
    o_elems = size_t(Tq) * c.hq * (D + o_pad);
  } else if (c.bnhd) {
    qs[0] = int64_t(max_q) * c.hq * D; qs[1] = D; qs[2] = int64_t(c.hq) * D;
    ks[0] = int64_t(max_k) * c.hkv * D; ks[1] = D; ks[2] = int64_t(c.hkv) * D;
    os[0] = int64_t(c.hq) * max_q * (D + o_pad); os[1] = int64_t(max_q) * (D + o_pad); os[2] = D + o_pad;
    q_elems = size_t(B) * max_q * c.hq * D;
    k_elems = size_t(B) * max_k * c.hkv * D;
    o_elems = size_t(B) * c.hq * max_q * (D + o_pad);
  } else {
    qs[0] = int64_t(c.hq) * max_q * D; qs[1] = int64_t(max_q) * D; qs[2] = D;
    ks[0] = int64_t(c.hkv) * max_k * D; ks[1] = int64_t(max_k) * D; ks[2] = D;
    os[0] = int64_t(c.hq) * max_q * (D + o_pad); os[1] = int64_t(max_q) * (D + o_pad); os[2] = D + o_pad;
    q_elems = size_t(B) * c.hq * max_q * D;
    k_elems = size_t(B) * c.hkv * max_k * D;
    o_elems = size_t(B) * c.hq * max_q * (D + o_pad);
  }
  auto q_off = [&](int b, int h, int i) {
    return c.varlen ? (cq[b] + i) * qs[2] + h * qs[1] : b * qs[0] + h * qs[1] + i * qs[2];
  };
  auto k_off = [&](int b, int h, int j) {
    return c.varlen ? (ck[b] + j) * ks[2] + h * ks[1] : b * ks[0] + h * ks[1] + j * ks[2];
  };
  auto o_off = [&](int b, int h, int i) {
    return c.varlen ? (cq[b] + i) * os[2] + h * os[1] : b * os[0] + h * os[1] + i * os[2];
  };

  std::mt19937 rng(1234 + D + c.hq * 7 + Tq);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> hq_(q_elems), hk(k_elems), hv(k_elems);
  for (auto& x : hq_) x = to_bits(nd(rng), dt);
  for (auto& x : hk) x = to_bits(nd(rng), dt);
  for (auto& x : hv) x = to_bits(nd(rng), dt);

  uint16_t *dq, *dk, *dv, *dout;
  int32_t *dcq = nullptr, *dck = nullptr;
  CHECK_CUDA(cudaMalloc(&dq, std::max<size_t>(q_elems, 8) * 2));
  CHECK_CUDA(cudaMalloc(&dk, std::max<size_t>(k_elems, 8) * 2));
  CHECK_CUDA(cudaMalloc(&dv, std::max<size_t>(k_elems, 8) * 2));
  CHECK_CUDA(cudaMalloc(&dout, std::max<size_t>(o_elems, 8) * 2));
  CHECK_CUDA(cudaMemcpy(dq, hq_.data(), q_elems * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dk, hk.data(), k_elems * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dv, hv.data(), k_elems * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(dout, 0xFF, o_elems * 2));
  if (c.varlen) {
    CHECK_CUDA(cudaMalloc(&dcq, (B + 1) * 4));
    CHECK_CUDA(cudaMalloc(&dck, (B + 1) * 4));
    CHECK_CUDA(cudaMemcpy(dcq, cq.data(), (B + 1) * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dck, ck.data(), (B + 1) * 4, cudaMemcpyHostToDevice));
  }
  int dev = 0, num_sms = 0;
  CHECK_CUDA(cudaGetDevice(&dev));
  CHECK_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev));

  const float scale = c.scale != 0.f ? c.scale : 1.f / std::sqrt(float(D));
  PrefillParams p{};
  p.q = dq; p.k = dk; p.v = dv; p.o = dout;
  p.q_batch_stride = qs[0]; p.q_head_stride = qs[1]; p.q_row_stride = qs[2];
  p.k_batch_stride = ks[0]; p.k_head_stride = ks[1]; p.k_row_stride = ks[2];
  p.v_batch_stride = ks[0]; p.v_head_stride = ks[1]; p.v_row_stride = ks[2];
  p.o_batch_stride = os[0]; p.o_head_stride = os[1]; p.o_row_stride = os[2];
  p.cu_seqlens_q = dcq; p.cu_seqlens_k = dck;
  p.batch = B; p.num_q_heads = c.hq; p.num_kv_heads = c.hkv; p.head_dim = D;
  p.max_seqlen_q = max_q; p.max_seqlen_k = max_k; p.scale = scale; p.causal = c.causal;
  p.dtype = dt; p.num_sms = num_sms;
  p.total_q = Tq; p.total_k = Tk;
  CHECK_CUDA(fn(p, 0));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint16_t> hout(o_elems);
  CHECK_CUDA(cudaMemcpy(hout.data(), dout, o_elems * 2, cudaMemcpyDeviceToHost));

  // Reference (double) and comparison.
  const double atol = dt == DType::kBFloat16 ? 1e-2 : 1.5e-3;
  const double rtol = dt == DType::kBFloat16 ? 2e-2 : 4e-3;
  const int group = c.hq / c.hkv;
  double max_err = 0.0;
  long long bad = 0, bad_zero = 0, nan_count = 0, checked = 0;
#pragma omp parallel for collapse(2) schedule(dynamic) reduction(max : max_err) \
    reduction(+ : bad, bad_zero, nan_count, checked)
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < c.hq; ++h) {
      const int kvh = h / group;
      std::vector<double> s(std::max(sk[b], 1)), qrow(D), acc(D);
      for (int i = 0; i < sq[b]; ++i) {
        for (int d = 0; d < D; ++d) qrow[d] = from_bits(hq_[q_off(b, h, i) + d], dt);
        int visible = sk[b];
        if (c.causal) visible = std::min(sk[b], std::max(0, sk[b] - sq[b] + i + 1));
        double mx = -INFINITY;
        for (int j = 0; j < visible; ++j) {
          double dot = 0.0;
          const int64_t ko = k_off(b, kvh, j);
          for (int d = 0; d < D; ++d) dot += qrow[d] * from_bits(hk[ko + d], dt);
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        double l = 0.0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int j = 0; j < visible; ++j) {
          const double pj = std::exp(s[j] - mx);
          l += pj;
          const int64_t vo = k_off(b, kvh, j);
          for (int d = 0; d < D; ++d) acc[d] += pj * from_bits(hv[vo + d], dt);
        }
        const int64_t oo = o_off(b, h, i);
        for (int d = 0; d < D; ++d) {
          const double ref = visible > 0 ? acc[d] / l : 0.0;
          const float got = from_bits(hout[oo + d], dt);
          ++checked;
          if (std::isnan(got)) {
            ++nan_count;
            continue;
          }
          if (visible == 0) {
            if (got != 0.f) ++bad_zero;
            continue;
          }
          const double err = std::fabs(double(got) - ref);
          max_err = std::max(max_err, err);
          if (err > atol + rtol * std::fabs(ref)) ++bad;
        }
        for (int d = D; d < D + o_pad; ++d)
          if (hout[oo + d] != 0xFFFF) ++bad;  // pad clobbered
      }
    }
  // Dense: rows past max_q do not exist; varlen: every row belongs to a sequence.
  const bool ok = bad == 0 && bad_zero == 0 && nan_count == 0 && checked > 0;
  if (verbose || !ok)
    std::printf("%-4s %-14s %-44s max_err=%.3e bad=%lld zero_bad=%lld nan=%lld checked=%lld\n",
                ok ? "PASS" : "FAIL", fn_name, c.name.c_str(), max_err, bad, bad_zero, nan_count,
                checked);
  cudaFree(dq); cudaFree(dk); cudaFree(dv); cudaFree(dout);
  if (dcq) cudaFree(dcq);
  if (dck) cudaFree(dck);
  return ok;
}

// ---- variants timed side by side (bf16, D=128, causal) ----
namespace mf = minipaged::fast;
using bf16 = __nv_bfloat16;
template <class Cfg>
cudaError_t variant(const PrefillParams& p, cudaStream_t s) {
  return p.causal ? mf::launch_prefill_cfg<Cfg, true>(p, s) : mf::launch_prefill_cfg<Cfg, false>(p, s);
}
struct Variant {
  const char* name;
  LaunchFn fn;
};
#if defined(MINIPAGED_ENABLE_SM90A)
template <class Cfg>
cudaError_t wg_variant(const PrefillParams& p, cudaStream_t s) {
  return p.causal ? mf::launch_prefill_wgmma_cfg<Cfg, true>(p, s)
                  : mf::launch_prefill_wgmma_cfg<Cfg, false>(p, s);
}
// Any dtype / head dim, fixed warpgroup count: runs the whole check list.
template <int kWG, bool kPipe, int kBN>
cudaError_t wg_all(const PrefillParams& p, cudaStream_t s) {
  if (p.dtype == DType::kBFloat16)
    return p.head_dim == 128 ? wg_variant<mf::WgmmaCfg<bf16, 128, kWG, 1, kPipe, kBN>>(p, s)
                             : wg_variant<mf::WgmmaCfg<bf16, 64, kWG, 1, kPipe, kBN>>(p, s);
  return p.head_dim == 128 ? wg_variant<mf::WgmmaCfg<__half, 128, kWG, 1, kPipe, kBN>>(p, s)
                           : wg_variant<mf::WgmmaCfg<__half, 64, kWG, 1, kPipe, kBN>>(p, s);
}
// Warp-specialised TMA kernel: WsCfg<T, D, BLOCK_N, stages, ping-pong, overlap, pipelined>.
template <class Cfg>
cudaError_t ws_variant(const PrefillParams& p, cudaStream_t s) {
  return p.causal ? mf::launch_prefill_ws<Cfg, true>(p, s) : mf::launch_prefill_ws<Cfg, false>(p, s);
}
template <bool kPP, bool kOv, bool kPersist = false>
cudaError_t ws_all(const PrefillParams& p, cudaStream_t s) {
  if (p.dtype == DType::kBFloat16)
    return p.head_dim == 128 ? ws_variant<mf::WsCfg<bf16, 128, 128, 2, kPP, kOv, true, false, kPersist>>(p, s)
                             : ws_variant<mf::WsCfg<bf16, 64, 128, 2, kPP, kOv, true, false, kPersist>>(p, s);
  return p.head_dim == 128 ? ws_variant<mf::WsCfg<__half, 128, 128, 2, kPP, kOv, true, false, kPersist>>(p, s)
                           : ws_variant<mf::WsCfg<__half, 64, 128, 2, kPP, kOv, true, false, kPersist>>(p, s);
}
#endif
// PrefillCfg<T, D, BLOCK_N, warps, m-tiles per warp, Q in registers, stages, swizzle,
//            min CTAs per SM (launch bounds), lazy rescale>
static const Variant kVariants[] = {
    {"dispatch", minipaged::launch_prefill_fast},
    {"m64w4", variant<mf::PrefillCfg<bf16, 128, 64, 4, 1, true, 2, true, 1, true>>},
    {"m64w4_eager", variant<mf::PrefillCfg<bf16, 128, 64, 4, 1, true, 2, true, 1, false>>},
    {"m64w4_1stage", variant<mf::PrefillCfg<bf16, 128, 64, 4, 1, true, 1, true, 1, true>>},
    {"m64w4_3stage", variant<mf::PrefillCfg<bf16, 128, 64, 4, 1, true, 3, true, 1, true>>},
    {"m64w2x2_n32s3", variant<mf::PrefillCfg<bf16, 128, 32, 2, 2, false, 3, true, 1, true>>},
    {"m128w8", variant<mf::PrefillCfg<bf16, 128, 64, 8, 1, true, 2, true, 1, true>>},
    {"m128w4x2", variant<mf::PrefillCfg<bf16, 128, 64, 4, 2, false, 2, true, 1, true>>},
    {"m128w4x2_eager", variant<mf::PrefillCfg<bf16, 128, 64, 4, 2, false, 2, true, 1, false>>},
    {"m128w4x2_1stage", variant<mf::PrefillCfg<bf16, 128, 64, 4, 2, false, 1, true, 1, true>>},
    {"m128w4x2_n32", variant<mf::PrefillCfg<bf16, 128, 32, 4, 2, false, 2, true, 1, true>>},
    {"m128w4x2_n32s3", variant<mf::PrefillCfg<bf16, 128, 32, 4, 2, false, 3, true, 1, true>>},
    {"m256w8x2", variant<mf::PrefillCfg<bf16, 128, 64, 8, 2, false, 2, true, 1, true>>},
#if defined(MINIPAGED_ENABLE_SM90A)
    // WgmmaCfg<T, D, warpgroups, min CTAs/SM, pipelined (PV of t-1 under softmax of t), BLOCK_N>
    {"wgmma_m128wg2", wg_variant<mf::WgmmaCfg<bf16, 128, 2, 1, false, 64>>},
    {"wgmma_m128wg2_n128", wg_variant<mf::WgmmaCfg<bf16, 128, 2, 1, false, 128>>},
    {"wgmma_m128wg2_pipe", wg_variant<mf::WgmmaCfg<bf16, 128, 2, 1, true, 64>>},
    {"wgmma_m128wg2_pipe_n128", wg_variant<mf::WgmmaCfg<bf16, 128, 2, 1, true, 128>>},
    {"wgmma_m64wg1", wg_variant<mf::WgmmaCfg<bf16, 128, 1, 1, false, 64>>},
    {"wgmma_m64wg1_pipe", wg_variant<mf::WgmmaCfg<bf16, 128, 1, 1, true, 64>>},
    {"ws_serial", ws_variant<mf::WsCfg<bf16, 128, 128, 2, false, false, false>>},
    {"ws_pipe", ws_variant<mf::WsCfg<bf16, 128, 128, 2, false, false, true>>},
    {"ws_pingpong", ws_variant<mf::WsCfg<bf16, 128, 128, 2, true, false, true>>},
    {"ws_overlap", ws_variant<mf::WsCfg<bf16, 128, 128, 2, false, true, true>>},
    {"ws_pp_overlap", ws_variant<mf::WsCfg<bf16, 128, 128, 2, true, true, true>>},
    {"ws_pp_overlap_s3", ws_variant<mf::WsCfg<bf16, 128, 128, 3, true, true, true>>},
    {"ws_persist_pp_overlap", ws_variant<mf::WsCfg<bf16, 128, 128, 2, true, true, true, false, true>>},
    {"ws_persist_pingpong", ws_variant<mf::WsCfg<bf16, 128, 128, 2, true, false, true, false, true>>},
#endif
};

__global__ void fill_random(uint16_t* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
    const float u = (h & 0xFFFFFF) / float(0x1000000) * 2.f - 1.f;  // uniform [-1, 1)
    __nv_bfloat16 b = __float2bfloat16(u * 1.7f);
    x[i] = *reinterpret_cast<uint16_t*>(&b);
  }
}

static void time_mode(int reps, const std::string& filter) {
  int dev = 0, num_sms = 0;
  CHECK_CUDA(cudaGetDevice(&dev));
  CHECK_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev));
  struct Shape { int b, n; };
  const Shape shapes[] = {{1, 1024}, {1, 4096}, {1, 8192}, {1, 16384}, {8, 1024}};
  const int Hq = 16, Hkv = 8, D = 128;
  const size_t flush_bytes = size_t(256) << 20;  // > L2 (50 MB on H200): cold L2 per run
  void* flush;
  CHECK_CUDA(cudaMalloc(&flush, flush_bytes));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  std::printf("%-16s", "variant");
  for (const Shape& s : shapes) std::printf("  B=%d,N=%-6d", s.b, s.n);
  std::printf("   (TFLOP/s, bf16 Hq=16 Hkv=8 D=128 causal, median of %d, cold L2)\n", reps);
  for (const Variant& var : kVariants) {
    const std::string vname = var.name;
    if (!filter.empty() && vname != "dispatch" && vname.find(filter) == std::string::npos) continue;
    std::printf("%-16s", var.name);
    for (const Shape& s : shapes) {
      const size_t qn = size_t(s.b) * Hq * s.n * D, kn = size_t(s.b) * Hkv * s.n * D;
      uint16_t *q, *k, *v, *o;
      CHECK_CUDA(cudaMalloc(&q, qn * 2));
      CHECK_CUDA(cudaMalloc(&k, kn * 2));
      CHECK_CUDA(cudaMalloc(&v, kn * 2));
      CHECK_CUDA(cudaMalloc(&o, qn * 2));
      fill_random<<<1024, 256>>>(q, qn, 1);
      fill_random<<<1024, 256>>>(k, kn, 2);
      fill_random<<<1024, 256>>>(v, kn, 3);
      PrefillParams p{};
      p.q = q; p.k = k; p.v = v; p.o = o;
      p.q_batch_stride = int64_t(Hq) * s.n * D; p.q_head_stride = int64_t(s.n) * D; p.q_row_stride = D;
      p.k_batch_stride = int64_t(Hkv) * s.n * D; p.k_head_stride = int64_t(s.n) * D; p.k_row_stride = D;
      p.v_batch_stride = p.k_batch_stride; p.v_head_stride = p.k_head_stride; p.v_row_stride = D;
      p.o_batch_stride = p.q_batch_stride; p.o_head_stride = p.q_head_stride; p.o_row_stride = D;
      p.batch = s.b; p.num_q_heads = Hq; p.num_kv_heads = Hkv; p.head_dim = D;
      p.max_seqlen_q = s.n; p.max_seqlen_k = s.n; p.scale = 1.f / std::sqrt(float(D));
      p.causal = true; p.dtype = DType::kBFloat16; p.num_sms = num_sms;
      std::vector<float> ms;
      for (int r = 0; r < reps + 3; ++r) {
        CHECK_CUDA(cudaMemsetAsync(flush, r & 0xFF, flush_bytes));
        CHECK_CUDA(cudaEventRecord(e0));
        CHECK_CUDA(var.fn(p, 0));
        CHECK_CUDA(cudaEventRecord(e1));
        CHECK_CUDA(cudaEventSynchronize(e1));
        float t;
        CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
        if (r >= 3) ms.push_back(t);
      }
      std::sort(ms.begin(), ms.end());
      const double med = ms[ms.size() / 2];
      const double flops = 4.0 * s.b * Hq * double(s.n) * s.n * D / 2.0;
      std::printf("  %12.1f", flops / (med * 1e-3) / 1e12);
      std::fflush(stdout);
      cudaFree(q); cudaFree(k); cudaFree(v); cudaFree(o);
    }
    std::printf("\n");
  }
  cudaFree(flush);
}

static std::vector<Case> check_cases() {
  const DType bf = DType::kBFloat16, fp = DType::kFloat16;
  std::vector<Case> cs;
  // name, dtype, hq, hkv, d, causal, varlen, sq, sk, batch, bnhd, scale
  cs.push_back({"dense bf16 d128 causal 97x97 gqa2", bf, 4, 2, 128, true, false, {97}, {97}, 2, false, 0.f});
  cs.push_back({"dense fp16 d64 causal 17x1023 gqa8", fp, 8, 1, 64, true, false, {17}, {1023}, 1, false, 0.f});
  cs.push_back({"dense bf16 d128 causal 300x97 (Nq>Nk)", bf, 2, 2, 128, true, false, {300}, {97}, 1, false, 0.f});
  cs.push_back({"dense fp16 d128 noncausal 1023x517 gqa2", fp, 4, 2, 128, false, false, {1023}, {517}, 1, false, 0.f});
  cs.push_back({"dense bf16 d64 noncausal 17x17 mha", bf, 3, 3, 64, false, false, {17}, {17}, 3, false, 0.f});
  cs.push_back({"dense bf16 d128 causal 1023x1023 bnhd gqa2", bf, 4, 2, 128, true, false, {1023}, {1023}, 1, true, 0.f});
  cs.push_back({"dense fp16 d64 causal 257x700 bnhd gqa1", fp, 2, 2, 64, true, false, {257}, {700}, 2, true, 0.f});
  cs.push_back({"dense fp16 d128 causal 1x1 (decode-like)", fp, 2, 1, 128, true, false, {1}, {1}, 2, false, 0.f});
  cs.push_back({"dense bf16 d128 causal 130x130 scale=0.05", bf, 2, 1, 128, true, false, {130}, {130}, 1, false, 0.05f});
  cs.push_back({"dense fp16 d64 noncausal 64x64 scale=2.5", fp, 2, 2, 64, false, false, {64}, {64}, 1, false, 2.5f});
  cs.push_back({"varlen bf16 d128 causal gqa2", bf, 16, 8, 128, true, true, {17, 0, 300, 1023, 5}, {17, 5, 400, 1023, 2}, 0, false, 0.f});
  cs.push_back({"varlen fp16 d64 noncausal gqa8", fp, 8, 1, 64, false, true, {97, 1, 64, 0}, {33, 200, 64, 0}, 0, false, 0.f});
  cs.push_back({"varlen fp16 d128 causal gqa1", fp, 4, 4, 128, true, true, {129, 63, 250}, {129, 200, 250}, 0, false, 0.f});
  cs.push_back({"varlen bf16 d64 causal gqa2", bf, 4, 2, 64, true, true, {1000, 1, 7}, {1000, 1000, 3}, 0, false, 0.f});
  return cs;
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "check";
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  int failures = 0;
  if (mode == "check") {
    {  // the kernels track the max of raw scores: the launcher admits a positive scale only
      PrefillParams bad{};
      bad.num_q_heads = bad.num_kv_heads = bad.batch = 1;
      bad.head_dim = 64;
      for (const float sc : {-0.2f, 0.f}) {
        bad.scale = sc;
        const bool ok = minipaged::launch_prefill_fast(bad, nullptr) == cudaErrorInvalidValue;
        std::printf("%s  scale=%g rejected by launch_prefill_fast\n", ok ? "PASS" : "FAIL", sc);
        failures += !ok;
      }
    }
    // A filter (argv[2]) limits every list below to the variants whose name contains it.
    const std::string filter = argc > 2 ? argv[2] : "";
    const auto selected = [&](const char* name) { return filter.empty() || std::string(name).find(filter) != std::string::npos; };
    const auto check_all = [&](auto fn, const char* name) {
      if (!selected(name)) return;
      for (const Case& c : check_cases()) failures += !run_case(c, fn, name);
    };
    check_all(minipaged::launch_prefill_fast, "dispatch");
#if defined(MINIPAGED_ENABLE_SM90A)
    check_all(wg_all<1, false, 64>, "wg1_n64_all");
    check_all(wg_all<2, false, 64>, "wg2_n64_all");
    check_all(wg_all<1, true, 64>, "wg1p_n64_all");
    check_all(wg_all<2, true, 64>, "wg2p_n64_all");
    check_all(wg_all<2, true, 128>, "wg2p_n128_all");
    check_all(ws_all<true, true>, "ws_ppov_all");
    check_all(ws_all<false, false>, "ws_pipe_all");
    check_all(ws_all<true, true, true>, "ws_persist_ppov_all");
#endif
    // Every timed variant must also be correct (bf16, D=128, causal and not).
    const Case big = {"dense bf16 d128 causal 1023x1023 gqa2 b2", DType::kBFloat16, 4, 2, 128, true, false, {1023}, {1023}, 2, false, 0.f};
    const Case chunk = {"dense bf16 d128 causal 200x777 gqa8", DType::kBFloat16, 8, 1, 128, true, false, {200}, {777}, 1, true, 0.f};
    const Case vl = {"varlen bf16 d128 causal", DType::kBFloat16, 4, 2, 128, true, true, {17, 0, 300, 129}, {17, 5, 400, 129}, 0, false, 0.f};
    const Case nc = {"dense bf16 d128 noncausal 97x300", DType::kBFloat16, 4, 2, 128, false, false, {97}, {300}, 1, false, 0.f};
    for (const Variant& v : kVariants) {
      if (!selected(v.name)) continue;
      failures += !run_case(big, v.fn, v.name);
      failures += !run_case(chunk, v.fn, v.name);
      failures += !run_case(vl, v.fn, v.name);
      failures += !run_case(nc, v.fn, v.name);
    }
  } else if (mode == "small") {
    const Case a = {"small bf16 d128 causal 70x70 gqa2", DType::kBFloat16, 2, 1, 128, true, false, {70}, {70}, 1, false, 0.f};
    const Case b = {"small varlen fp16 d64 causal", DType::kFloat16, 2, 1, 64, true, true, {17, 0, 90}, {30, 3, 90}, 0, false, 0.f};
    const Case c = {"small bf16 d128 noncausal 130x70 m128", DType::kBFloat16, 2, 2, 128, false, false, {130}, {70}, 1, false, 0.f};
    failures += !run_case(a, minipaged::launch_prefill_fast, "dispatch");
    failures += !run_case(b, minipaged::launch_prefill_fast, "dispatch");
    failures += !run_case(c, kVariants[5].fn, kVariants[5].name);
    failures += !run_case(c, kVariants[11].fn, kVariants[11].name);
#if defined(MINIPAGED_ENABLE_SM90A)
    failures += !run_case(a, wg_all<2, true, 128>, "wg2p_n128_all");
    failures += !run_case(b, wg_all<2, true, 128>, "wg2p_n128_all");
    failures += !run_case(c, wg_all<1, true, 64>, "wg1p_n64_all");
    failures += !run_case(b, wg_all<2, false, 64>, "wg2_n64_all");
    failures += !run_case(a, ws_all<true, true>, "ws_ppov_all");
    failures += !run_case(b, ws_all<true, true>, "ws_ppov_all");
    failures += !run_case(c, ws_all<true, true>, "ws_ppov_all");
    failures += !run_case(a, ws_all<true, true, true>, "ws_persist_ppov_all");
    failures += !run_case(b, ws_all<true, true, true>, "ws_persist_ppov_all");
    failures += !run_case(c, ws_all<true, true, true>, "ws_persist_ppov_all");
#endif
  } else if (mode == "time") {
    time_mode(argc > 2 ? std::atoi(argv[2]) : 20, argc > 3 ? argv[3] : "");
  } else {
    std::fprintf(stderr, "usage: %s check|small|time [reps]\n", argv[0]);
    return 2;
  }
  std::printf("%s (%d failures)\n", failures == 0 ? "ALL PASS" : "SOME FAILED", failures);
  return failures == 0 ? 0 : 1;
}
