// Standalone, torch-free correctness harness for the cuda-wmma prefill launcher.
//
// Build (from the repo root):
//   nvcc -O2 -gencode=arch=compute_90,code=sm_90 -I src/minipaged/cuda/csrc \
//        scripts/wmma_selftest.cu src/minipaged/cuda/csrc/prefill/wmma.cu -o wmma_selftest
// Run:  ./wmma_selftest          all cases
//       ./wmma_selftest small    only the small cases (for compute-sanitizer memcheck/racecheck)
//       ./wmma_selftest time     all cases + one rough timing figure
// Exit status 0 iff every case passes.
//
// Each case fills random q/k/v (normal, fixed seed) in fp16 or bf16, in one of three
// layouts (dense BHSD, dense BSHD through strides, varlen THD with a padded row stride),
// poisons the output with NaN, runs launch_prefill_wmma and compares with a CPU
// reference in double on the same rounded inputs. Pass criteria:
//   - every output element the kernel owns was written (no NaN left), and the padding
//     between rows of a strided output was NOT written (still NaN);
//   - rows that see no key are exactly zero;
//   - max |out - ref| <= 2 * max |emul - ref| + 1 ulp(max |ref|), where emul is the same
//     algorithm in the low precision (P rounded to the input type, output rounded):
//     the FlashAttention-style bound relative to what the precision itself costs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "params.h"

using minipaged::DType;
using minipaged::PrefillParams;

#define CUDA_CHECK(expr)                                                                  \
  do {                                                                                    \
    cudaError_t err_ = (expr);                                                            \
    if (err_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr,                   \
                   cudaGetErrorString(err_));                                             \
      std::exit(2);                                                                       \
    }                                                                                     \
  } while (0)

namespace {

// ---- host-side low-precision conversions (bit patterns stored as uint16_t) ----
float bits_to_float(uint16_t bits, DType dtype) {
  if (dtype == DType::kFloat16) {
    __half_raw raw;
    raw.x = bits;
    return __half2float(__half(raw));
  }
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_bits(float f, DType dtype) {
  if (dtype == DType::kFloat16) {
    __half_raw raw = __half_raw(__float2half_rn(f));
    return raw.x;
  }
  // bf16, round to nearest even (no NaN inputs here)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

double round_to(double x, DType dtype) {
  return bits_to_float(float_to_bits(static_cast<float>(x), dtype), dtype);
}

struct Rng {
  uint64_t state;
  explicit Rng(uint64_t seed) : state(seed * 0x9E3779B97F4A7C15ull + 1) {}
  double uniform() {  // (0, 1)
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return ((state >> 11) + 0.5) * (1.0 / 9007199254740992.0);
  }
  double normal() { return std::sqrt(-2.0 * std::log(uniform())) * std::cos(6.283185307179586 * uniform()); }
};

enum class Layout { kBHSD, kBSHD, kTHD };

// A [B, H, N, D] (dense) or [T, H, D] (varlen) tensor described by explicit strides.
struct Tensor {
  int64_t batch_stride = 0, head_stride = 0, row_stride = 0;
  std::vector<uint16_t> host;
  int64_t index(int b, int h, int64_t row, int d) const {
    return b * batch_stride + h * head_stride + row * row_stride + d;
  }
};

// rows: dense N (per batch) or varlen T (total). row_pad: extra elements per row (THD).
Tensor make_tensor(Layout layout, int B, int H, int64_t rows, int D, int row_pad) {
  Tensor t;
  int64_t size = 0;
  switch (layout) {
    case Layout::kBHSD:
      t.row_stride = D;
      t.head_stride = rows * D;
      t.batch_stride = H * rows * D;
      size = B * t.batch_stride;
      break;
    case Layout::kBSHD:
      t.head_stride = D;
      t.row_stride = static_cast<int64_t>(H) * D;
      t.batch_stride = rows * H * D;
      size = B * t.batch_stride;
      break;
    case Layout::kTHD:
      t.head_stride = D;
      t.row_stride = static_cast<int64_t>(H) * D + row_pad;
      t.batch_stride = 0;
      size = rows * t.row_stride;
      break;
  }
  t.host.assign(std::max<int64_t>(size, 1), 0xFFFF);  // 0xFFFF is a NaN in fp16 and bf16
  return t;
}

struct Case {
  std::string name;
  DType dtype;
  int head_dim;
  int num_q_heads, num_kv_heads;
  bool causal;
  Layout layout;
  std::vector<int> q_lens, k_lens;  // dense: all equal; varlen: per sequence
  double scale = 0.0;               // 0 => 1/sqrt(D)
  bool small = false;
};

struct Seq {
  int q_len, k_len;
  int64_t q_row0, k_row0;  // varlen offsets (0 for dense)
  int b;                   // dense batch index (0 for varlen)
};

bool run_case(const Case& c, uint64_t seed) {
  const bool varlen = c.layout == Layout::kTHD;
  const int D = c.head_dim;
  const int Hq = c.num_q_heads, Hkv = c.num_kv_heads;
  const int num_seqs = static_cast<int>(c.q_lens.size());
  const int max_q = *std::max_element(c.q_lens.begin(), c.q_lens.end());
  const int max_k = *std::max_element(c.k_lens.begin(), c.k_lens.end());
  const double scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(static_cast<double>(D));

  std::vector<Seq> seqs;
  std::vector<int32_t> cu_q(1, 0), cu_k(1, 0);
  for (int s = 0; s < num_seqs; ++s) {
    Seq q{c.q_lens[s], c.k_lens[s], varlen ? cu_q.back() : 0, varlen ? cu_k.back() : 0, varlen ? 0 : s};
    seqs.push_back(q);
    cu_q.push_back(cu_q.back() + c.q_lens[s]);
    cu_k.push_back(cu_k.back() + c.k_lens[s]);
  }
  const int B = varlen ? 1 : num_seqs;
  const int64_t q_rows = varlen ? cu_q.back() : max_q;
  const int64_t k_rows = varlen ? cu_k.back() : max_k;
  const int pad = varlen ? 3 : 0;  // odd padding: strides need not be multiples of anything

  Tensor q = make_tensor(c.layout, B, Hq, q_rows, D, pad);
  Tensor k = make_tensor(c.layout, B, Hkv, k_rows, D, pad + 2);
  Tensor v = make_tensor(c.layout, B, Hkv, k_rows, D, pad + 5);
  Tensor o = make_tensor(c.layout, B, Hq, q_rows, D, pad);  // stays all-NaN: the poison

  // Fill only the elements that belong to the tensors; padding stays NaN so that a
  // kernel reading it would poison its own output.
  Rng rng(seed);
  auto fill = [&](Tensor& t, int H, int64_t rows) {
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h)
        for (int64_t r = 0; r < rows; ++r)
          for (int d = 0; d < D; ++d) t.host[t.index(b, h, r, d)] = float_to_bits(static_cast<float>(rng.normal()), c.dtype);
  };
  fill(q, Hq, q_rows);
  fill(k, Hkv, k_rows);
  fill(v, Hkv, k_rows);

  auto upload = [](const Tensor& t) {
    void* ptr = nullptr;
    CUDA_CHECK(cudaMalloc(&ptr, t.host.size() * 2));
    CUDA_CHECK(cudaMemcpy(ptr, t.host.data(), t.host.size() * 2, cudaMemcpyHostToDevice));
    return ptr;
  };
  void* dq = upload(q);
  void* dk = upload(k);
  void* dv = upload(v);
  void* dout = upload(o);
  int32_t *dcu_q = nullptr, *dcu_k = nullptr;
  if (varlen) {
    CUDA_CHECK(cudaMalloc(&dcu_q, cu_q.size() * 4));
    CUDA_CHECK(cudaMalloc(&dcu_k, cu_k.size() * 4));
    CUDA_CHECK(cudaMemcpy(dcu_q, cu_q.data(), cu_q.size() * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dcu_k, cu_k.data(), cu_k.size() * 4, cudaMemcpyHostToDevice));
  }

  PrefillParams p{};
  p.q = dq;
  p.k = dk;
  p.v = dv;
  p.o = dout;
  p.q_batch_stride = q.batch_stride; p.q_head_stride = q.head_stride; p.q_row_stride = q.row_stride;
  p.k_batch_stride = k.batch_stride; p.k_head_stride = k.head_stride; p.k_row_stride = k.row_stride;
  p.v_batch_stride = v.batch_stride; p.v_head_stride = v.head_stride; p.v_row_stride = v.row_stride;
  p.o_batch_stride = o.batch_stride; p.o_head_stride = o.head_stride; p.o_row_stride = o.row_stride;
  p.cu_seqlens_q = dcu_q;
  p.cu_seqlens_k = dcu_k;
  p.batch = num_seqs;
  p.num_q_heads = Hq;
  p.num_kv_heads = Hkv;
  p.head_dim = D;
  p.max_seqlen_q = max_q;
  p.max_seqlen_k = max_k;
  p.scale = static_cast<float>(scale);
  p.causal = c.causal;
  p.dtype = c.dtype;
  p.num_sms = 0;

  CUDA_CHECK(minipaged::launch_prefill_wmma(p, nullptr));
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> out_host(o.host.size());
  CUDA_CHECK(cudaMemcpy(out_host.data(), dout, out_host.size() * 2, cudaMemcpyDeviceToHost));

  // ---- CPU reference ----
  const int group = Hq / Hkv;
  double err = 0, err_emul = 0, max_ref = 0;
  int64_t unwritten = 0, zero_rows = 0, bad_zero_rows = 0;
  std::vector<bool> owned(out_host.size(), false);
  std::vector<double> scores, probs, ref(D), emul(D);
  for (const Seq& s : seqs) {
    for (int h = 0; h < Hq; ++h) {
      const int kvh = h / group;
      for (int i = 0; i < s.q_len; ++i) {
        // Bottom-right causal: row i sees key j iff j < Nk - Nq + i + 1.
        int visible = s.k_len;
        if (c.causal) visible = std::max(0, std::min(s.k_len, s.k_len - s.q_len + i + 1));
        scores.assign(visible, 0.0);
        double m = -INFINITY;
        for (int j = 0; j < visible; ++j) {
          double acc = 0;
          for (int d = 0; d < D; ++d)
            acc += bits_to_float(q.host[q.index(s.b, h, s.q_row0 + i, d)], c.dtype) *
                   bits_to_float(k.host[k.index(s.b, kvh, s.k_row0 + j, d)], c.dtype);
          scores[j] = acc * scale;
          m = std::max(m, scores[j]);
        }
        double l = 0;
        probs.assign(visible, 0.0);
        for (int j = 0; j < visible; ++j) {
          probs[j] = std::exp(scores[j] - m);
          l += probs[j];
        }
        std::fill(ref.begin(), ref.end(), 0.0);
        std::fill(emul.begin(), emul.end(), 0.0);
        for (int j = 0; j < visible; ++j) {
          const double p_low = round_to(probs[j], c.dtype);  // P~ as the kernel feeds WMMA
          for (int d = 0; d < D; ++d) {
            const double vv = bits_to_float(v.host[v.index(s.b, kvh, s.k_row0 + j, d)], c.dtype);
            ref[d] += probs[j] * vv;
            emul[d] += p_low * vv;
          }
        }
        bool row_is_zero_row = visible == 0;
        zero_rows += row_is_zero_row;
        bool row_bad_zero = false;
        for (int d = 0; d < D; ++d) {
          const int64_t idx = o.index(s.b, h, s.q_row0 + i, d);
          owned[idx] = true;
          const double r = l > 0 ? ref[d] / l : 0.0;
          const double e = l > 0 ? round_to(emul[d] / l, c.dtype) : 0.0;
          const float got = bits_to_float(out_host[idx], c.dtype);
          if (std::isnan(got)) {
            ++unwritten;
            continue;
          }
          if (row_is_zero_row && !(got == 0.0f)) row_bad_zero = true;
          err = std::max(err, std::fabs(got - r));
          err_emul = std::max(err_emul, std::fabs(e - r));
          max_ref = std::max(max_ref, std::fabs(r));
        }
        bad_zero_rows += row_bad_zero;
      }
    }
  }
  // Padding (not owned by any output element) must be untouched.
  int64_t stray_writes = 0;
  for (size_t idx = 0; idx < out_host.size(); ++idx)
    if (!owned[idx] && out_host[idx] != 0xFFFF) ++stray_writes;

  const double ulp = max_ref * (c.dtype == DType::kFloat16 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7));
  const double tol = 2 * err_emul + ulp;
  const bool pass = unwritten == 0 && stray_writes == 0 && bad_zero_rows == 0 && err <= tol;
  std::printf("%-4s %-58s max_err %.3e  lowprec_ref_err %.3e  tol %.3e  unwritten %lld  stray %lld  "
              "zero_rows %lld (bad %lld)\n",
              pass ? "PASS" : "FAIL", c.name.c_str(), err, err_emul, tol, (long long)unwritten,
              (long long)stray_writes, (long long)zero_rows, (long long)bad_zero_rows);

  CUDA_CHECK(cudaFree(dq));
  CUDA_CHECK(cudaFree(dk));
  CUDA_CHECK(cudaFree(dv));
  CUDA_CHECK(cudaFree(dout));
  if (varlen) {
    CUDA_CHECK(cudaFree(dcu_q));
    CUDA_CHECK(cudaFree(dcu_k));
  }
  return pass;
}

Case dense(const char* name, DType dtype, int D, int B, int Hq, int Hkv, int Nq, int Nk, bool causal,
           Layout layout = Layout::kBHSD, double scale = 0.0, bool small = false) {
  return Case{name, dtype, D, Hq, Hkv, causal, layout, std::vector<int>(B, Nq), std::vector<int>(B, Nk),
              scale, small};
}

Case varlen_case(const char* name, DType dtype, int D, int Hq, int Hkv, bool causal, std::vector<int> q_lens,
                 std::vector<int> k_lens, bool small = false) {
  return Case{name, dtype, D, Hq, Hkv, causal, Layout::kTHD, q_lens, k_lens, 0.0, small};
}

// Launcher argument checks: these return before any kernel runs.
bool check_rejections() {
  PrefillParams p{};
  p.batch = 1; p.num_q_heads = 4; p.num_kv_heads = 2; p.max_seqlen_q = 4; p.max_seqlen_k = 4;
  p.dtype = DType::kFloat16; p.scale = 1.0f;
  bool ok = true;
  p.head_dim = 96;
  ok &= minipaged::launch_prefill_wmma(p, nullptr) == cudaErrorInvalidValue;
  p.head_dim = 128; p.num_kv_heads = 3;
  ok &= minipaged::launch_prefill_wmma(p, nullptr) == cudaErrorInvalidValue;
  p.num_kv_heads = 2; p.max_seqlen_q = 0;  // empty: success, nothing launched
  ok &= minipaged::launch_prefill_wmma(p, nullptr) == cudaSuccess;
  std::printf("%-4s launcher rejects head_dim 96 / Hq %% Hkv != 0, accepts empty\n", ok ? "PASS" : "FAIL");
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const bool only_small = mode == "small";
  const DType f16 = DType::kFloat16, bf16 = DType::kBFloat16;

  std::vector<Case> cases = {
      // small ones first: these are the ones the sanitizers run
      dense("dense f16 D64 B1 Hq4 Hkv2 Nq=Nk=17 causal", f16, 64, 1, 4, 2, 17, 17, true, Layout::kBHSD, 0.0, true),
      dense("dense bf16 D128 B2 Hq2 Hkv1 Nq17 Nk33 causal BSHD", bf16, 128, 2, 2, 1, 17, 33, true, Layout::kBSHD,
            0.0, true),
      varlen_case("varlen f16 D128 Hq4 Hkv2 q[17,0,5,40,3] k[20,3,0,33,9] causal", f16, 128, 4, 2, true,
                  {17, 0, 5, 40, 3}, {20, 3, 0, 33, 9}, true),
      varlen_case("varlen bf16 D64 Hq2 Hkv2 q[7,33] k[40,1] noncausal", bf16, 64, 2, 2, false, {7, 33}, {40, 1},
                  true),
      // the rest
      dense("dense f16 D128 B2 Hq16 Hkv8 Nq=Nk=97 causal", f16, 128, 2, 16, 8, 97, 97, true),
      dense("dense bf16 D128 B2 Hq16 Hkv8 Nq=Nk=97 causal", bf16, 128, 2, 16, 8, 97, 97, true),
      dense("dense bf16 D64 B1 Hq4 Hkv4 Nq=Nk=17 causal (MHA)", bf16, 64, 1, 4, 4, 17, 17, true),
      dense("dense f16 D128 B1 Hq8 Hkv1 Nq17 Nk97 causal (GQA8, Nq<Nk)", f16, 128, 1, 8, 1, 17, 97, true),
      dense("dense bf16 D128 B1 Hq2 Hkv1 Nq97 Nk17 causal (Nq>Nk)", bf16, 128, 1, 2, 1, 97, 17, true),
      dense("dense f16 D64 B1 Hq8 Hkv1 Nq97 Nk17 causal (Nq>Nk)", f16, 64, 1, 8, 1, 97, 17, true),
      dense("dense f16 D64 B3 Hq6 Hkv3 Nq33 Nk50 noncausal BSHD", f16, 64, 3, 6, 3, 33, 50, false, Layout::kBSHD),
      dense("dense bf16 D128 B1 Hq4 Hkv2 Nq50 Nk33 noncausal scale0.3", bf16, 128, 1, 4, 2, 50, 33, false,
            Layout::kBHSD, 0.3),
      dense("dense f16 D128 B1 Hq16 Hkv2 Nq1 Nk1023 causal (decode-like)", f16, 128, 1, 16, 2, 1, 1023, true),
      dense("dense f16 D128 B1 Hq2 Hkv2 Nq=Nk=1023 causal", f16, 128, 1, 2, 2, 1023, 1023, true),
      dense("dense bf16 D64 B1 Hq2 Hkv1 Nq=Nk=1023 causal", bf16, 64, 1, 2, 1, 1023, 1023, true),
      varlen_case("varlen f16 D128 Hq16 Hkv8 q[17,0,97,1,40,3] k[17,5,120,1,31,0] causal", f16, 128, 16, 8, true,
                  {17, 0, 97, 1, 40, 3}, {17, 5, 120, 1, 31, 0}),
      varlen_case("varlen bf16 D128 Hq16 Hkv8 q[17,0,97,1,40,3] k[17,5,120,1,31,0] causal", bf16, 128, 16, 8,
                  true, {17, 0, 97, 1, 40, 3}, {17, 5, 120, 1, 31, 0}),
      varlen_case("varlen bf16 D64 Hq8 Hkv8 q[33,64,1] k[33,64,200] noncausal", bf16, 64, 8, 8, false,
                  {33, 64, 1}, {33, 64, 200}),
      varlen_case("varlen f16 D64 Hq8 Hkv2 q[100,16,31] k[100,48,31] causal", f16, 64, 8, 2, true, {100, 16, 31},
                  {100, 48, 31}),
  };

  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);

  int failed = 0, ran = 0;
  uint64_t seed = 1;
  failed += !check_rejections();
  for (const Case& c : cases) {
    if (only_small && !c.small) continue;
    failed += !run_case(c, seed++);
    ++ran;
  }

  if (mode == "time") {
    // Rough figure only (teaching kernel, no speed target): median of 10, warm L2.
    const int B = 1, Hq = 16, Hkv = 8, N = 2048, D = 128;
    const size_t q_elems = size_t(B) * Hq * N * D, kv_elems = size_t(B) * Hkv * N * D;
    void *dq, *dk, *dv, *dout;
    CUDA_CHECK(cudaMalloc(&dq, q_elems * 2));
    CUDA_CHECK(cudaMalloc(&dk, kv_elems * 2));
    CUDA_CHECK(cudaMalloc(&dv, kv_elems * 2));
    CUDA_CHECK(cudaMalloc(&dout, q_elems * 2));
    CUDA_CHECK(cudaMemset(dq, 0x11, q_elems * 2));  // small finite fp16 values
    CUDA_CHECK(cudaMemset(dk, 0x11, kv_elems * 2));
    CUDA_CHECK(cudaMemset(dv, 0x11, kv_elems * 2));
    PrefillParams p{};
    p.q = dq; p.k = dk; p.v = dv; p.o = dout;
    p.q_row_stride = D; p.q_head_stride = int64_t(N) * D; p.q_batch_stride = int64_t(Hq) * N * D;
    p.k_row_stride = D; p.k_head_stride = int64_t(N) * D; p.k_batch_stride = int64_t(Hkv) * N * D;
    p.v_row_stride = D; p.v_head_stride = int64_t(N) * D; p.v_batch_stride = int64_t(Hkv) * N * D;
    p.o_row_stride = D; p.o_head_stride = int64_t(N) * D; p.o_batch_stride = int64_t(Hq) * N * D;
    p.batch = B; p.num_q_heads = Hq; p.num_kv_heads = Hkv; p.head_dim = D;
    p.max_seqlen_q = N; p.max_seqlen_k = N; p.scale = 0.088f; p.causal = true; p.dtype = DType::kFloat16;
    cudaEvent_t start, stop;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    std::vector<float> ms;
    for (int it = 0; it < 12; ++it) {
      CUDA_CHECK(cudaEventRecord(start));
      CUDA_CHECK(minipaged::launch_prefill_wmma(p, nullptr));
      CUDA_CHECK(cudaEventRecord(stop));
      CUDA_CHECK(cudaEventSynchronize(stop));
      float t = 0;
      CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
      if (it >= 2) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    const double flops = 4.0 * B * Hq * double(N) * N * D / 2;  // causal: half the matrix
    std::printf("time: causal fp16 B1 Hq16 Hkv8 N2048 D128: median %.3f ms (%.1f TFLOP/s), warm L2, rough\n",
                med, flops / (med * 1e-3) / 1e12);
    CUDA_CHECK(cudaFree(dq));
    CUDA_CHECK(cudaFree(dk));
    CUDA_CHECK(cudaFree(dv));
    CUDA_CHECK(cudaFree(dout));
  }

  std::printf("%s: %d case(s) run, %d failed\n", failed ? "FAIL" : "PASS", ran, failed);
  return failed ? 1 : 0;
}
