// Torch-free self test and timing of the paged decode (decode/launch.cu): the
// two-launch split reduction, the one-launch fused reduction (variant bit
// 0x400), the register-ring tilings 13-16, the fp8 cp.async tilings 6-8, the
// fp8 tensor-core tilings 10 and 18-19 (32 tokens per warp) and the two-warp tensor-core
// tilings 20-22 (16-bit) and 23-24 (fp8).
//
//   nvcc -std=c++17 -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a -DMINIPAGED_ENABLE_SM90A \
//        -Xcompiler -fopenmp -I src/minipaged/cuda/csrc scripts/decode_selftest.cu \
//        src/minipaged/cuda/csrc/decode/launch.cu src/minipaged/cuda/csrc/decode/kernels_*.cu \
//        -o decode_selftest -lgomp
//   ./decode_selftest check          every case (exit status 0 only if all pass;
//                                    DECODE_CHECK_TILINGS="20,22" checks only those tilings;
//                                    DECODE_CHECK_BITS=0x20000 ORs variant bits into every call)
//   ./decode_selftest small          a few tiny cases, for compute-sanitizer
//   ./decode_selftest time [reps]    the standard decode grid, every tiling, both reductions
//                                    (DECODE_TIME_TILINGS="0,6" times only those tilings;
//                                    DECODE_TIME_HEADS="16,4,64" another Hq,Hkv,D;
//                                    DECODE_TIME_SPLITS, _SHAPES, _KV, _VARIANTS: see time_mode)
//   built with -DMINIPAGED_DECODE_TRACE=1, `time` also prints one traced replay per row: when
//   the CTAs start, land their first and last K/V tiles, finish, and when the merge runs
//   (decode/trace.cuh; quantiles over CTAs, and how many CTAs each SM ran)
//   ./decode_selftest roofline [reps] the fastest plain read of each grid row's bytes, timed
//                                    the same way: the bound no decode kernel beats here
//                                    (16-byte loads, and whole pages through a bulk-copy ring)
//   ./decode_selftest paged_read [reps] the large-batch rows' paged K/V read with no math: per
//                                    KV head as the decode reads it, 2, 4 or 8 heads' rows at a
//                                    time, balanced over the SMs, and contiguous (the layout's
//                                    and the grid's cost); and each KV head's page as one
//                                    tensor-copy (TMA) box, per (sequence, KV head) and balanced,
//                                    each checked once to read exactly the batch's bytes
//   time and paged_read take DECODE_PAGE_ORDER=sorted or contiguous: each sequence's pages read
//   in address order, or laid out as one run (page_order)
//
// check / small: caches filled with NaN (16-bit 0x7fff, e4m3 0x7f) except the
// slots of real tokens, pages in shuffled order, table entries past a
// sequence's pages -1, outputs poisoned with NaN (the 16 padding elements after
// each output head row must stay NaN), and an fp64 host reference on the values
// as stored (FP8: exactly dequantised). Every (tiling, forced split count) runs
// with the two-launch and the fused reduction: both against the reference, and
// fused against two-launch bitwise (o and lse), with every arrival counter back
// at zero after the call. Then repeated calls on one stream (split counts
// changing between calls, no host sync), and one CUDA graph of the fused call
// (and one of the two-launch call) captured once and replayed 100 times (small:
// 10), each replay's output checked bitwise.
//
// time: B=1 L=4k, B=1 L=32k, B=8 L=4k, B=32 L=4k, B=64 L=8k, B=256 L=1k;
// Hq/Hkv/D 16/8/128, bf16, page 16, pages scattered over the cache; then the
// same grid on fp8 caches (finite e4m3 bytes, scales 0.25; TB/s at 1 byte per
// cached element) for the fp8 default, its fused build, tilings 6-8, 10 (both
// reductions), 18 and 19. Each
// configuration is one CUDA graph holding the decode call(s); between replays
// a 256 MB read-only flush kernel runs OUTSIDE the graph, between the event
// pairs (so the L2 holds no decode data and no dirty lines, as `minipaged
// bench` does); median / p20 / p80 of `reps` (>= 50) replays, in µs and in
// TB/s of K+V read + q read + o written. The graph of one tiny kernel is timed
// the same way (the floor of every row). Rows "no-reduce" (variant bit 0x800)
// time the split kernel without its merge, to measure what the merge costs;
// their output is not written and not checked.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "decode/trace.cuh"
#include "params.h"
#include "ptx/cp_async.cuh"
#include "ptx/fp8.cuh"
#include "ptx/misc.cuh"
#include "ptx/tensor_map.h"
#include "ptx/tma.cuh"
#include "selftest_common.h"

using minipaged::DType;

namespace {

constexpr int kFused = 0x400;
constexpr int kNoPDL = 0x200;
constexpr int kNoReduce = 0x800;  // timing only: the split kernel without its merge (o not written)
// the work list toggled against its default (params.h): kWorklistOn / kWorklistOff give the plan
// with / without it whichever the default is
constexpr int kWorklistOn = minipaged::kDecodeWorklistByDefault ? 0 : minipaged::kDecodeVariantWorklistToggle;
constexpr int kWorklistOff = minipaged::kDecodeWorklistByDefault ? minipaged::kDecodeVariantWorklistToggle : 0;
constexpr int kOPad = 16;  // NaN elements after each output head row
constexpr int kMaxCounters = 1 << 20;

// Cheap unit-variance noise (uniform on [-sqrt 3, sqrt 3]): the caches of the
// check mode hold up to ~80 M values per problem.
struct Noise {
  uint64_t x;
  explicit Noise(uint64_t seed) : x(seed * 0x9e3779b97f4a7c15ull + 1) {}
  float operator()() {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return (int32_t(x >> 32) * (1.f / 2147483648.f)) * 1.7320508f;
  }
};

struct Prob {
  std::string name;
  DType dt;
  bool fp8;
  int hq, hkv, d, bs;
  std::vector<int> ctx;
};

// Device state of one problem plus its host mirror and fp64 reference.
struct Setup {
  Prob pr;
  int B = 0, max_blocks = 1, num_blocks = 0;
  int64_t row = 0;  // elements (16-bit) or bytes (fp8) per token row of a cache
  std::vector<int32_t> table;
  std::vector<uint16_t> kc16, vc16, q;  // host mirrors
  std::vector<uint8_t> kc8, vc8;
  std::vector<float> ks, vs;
  std::vector<double> ref, ref_lse;
  double ref_max = 1.0;
  void *dk = nullptr, *dv = nullptr;
  uint16_t *dq = nullptr, *dout = nullptr;
  float *dlse = nullptr, *dpart = nullptr, *dks = nullptr, *dvs = nullptr;
  int32_t *dtable = nullptr, *dctx = nullptr;
  int64_t o_head = 0, o_row = 0, o_elems = 0, lse_elems = 0;
};

int g_num_sms = 0, g_cc = 0;

// Words of split workspace for B sequences of hq heads at any plan (up to 256 splits, a work
// list's plan included): what decode_workspace_floats asks at most.
size_t workspace_words(int B, int hq, int D) {
  const size_t partials = size_t(std::max(B, 1)) * hq * 256 * (D + 1);
  return (partials + 3) / 4 * 4 + 4 * size_t(std::max(B, 1)) * 256 + 2 * size_t(std::max(B, 1));
}
int g_replays = 100;  // graph replays per check (small mode: fewer, for the sanitizers)
int g_check_bits = 0;  // DECODE_CHECK_BITS: variant bits OR-ed into every checked call (check / small)
int32_t* g_counters = nullptr;  // zeroed once; every fused call must leave it zero

Setup make_setup(const Prob& pr, uint32_t seed) {
  Setup s;
  s.pr = pr;
  s.B = int(pr.ctx.size());
  const int bs = pr.bs, H = pr.hkv, D = pr.d;
  std::mt19937 rng(seed);
  Noise nd(seed);
  std::uniform_real_distribution<float> ud(0.5f, 2.f);
  std::vector<int> nblk(s.B);
  int used = 0;
  for (int b = 0; b < s.B; ++b) {
    nblk[b] = (pr.ctx[b] + bs - 1) / bs;
    used += nblk[b];
    s.max_blocks = std::max(s.max_blocks, nblk[b] + 1);  // at least one -1 past the longest
  }
  s.num_blocks = used + 3;
  std::vector<int> perm(s.num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  s.table.assign(size_t(s.B) * s.max_blocks, -1);
  int nxt = 0;
  for (int b = 0; b < s.B; ++b)
    for (int j = 0; j < nblk[b]; ++j) s.table[size_t(b) * s.max_blocks + j] = perm[nxt++];
  s.row = int64_t(H) * D;
  const size_t slots = size_t(s.num_blocks) * bs;
  auto slot_of = [&](int b, int j) { return size_t(s.table[size_t(b) * s.max_blocks + j / bs]) * bs + j % bs; };
  // Keys with a per-head spread, so that softmax rows are far from uniform.
  std::vector<float> amp(H);
  for (int h = 0; h < H; ++h) amp[h] = 1.5f * ud(rng);
  if (pr.fp8) {
    s.kc8.assign(slots * s.row, 0x7f);
    s.vc8.assign(slots * s.row, 0x7f);
    s.ks.resize(H), s.vs.resize(H);
    for (int h = 0; h < H; ++h) s.ks[h] = amp[h] * 4 / 448 * ud(rng), s.vs[h] = 4.f / 448 * ud(rng);
  } else {
    s.kc16.assign(slots * s.row, 0x7fff);
    s.vc16.assign(slots * s.row, 0x7fff);
  }
  for (int b = 0; b < s.B; ++b)
    for (int j = 0; j < pr.ctx[b]; ++j) {
      const size_t base = slot_of(b, j) * s.row;
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) {
          const float kv = nd() * amp[h], vv = nd();
          if (pr.fp8) {
            s.kc8[base + h * D + d] = minipaged::fp8_e4m3_from_float_soft(kv / s.ks[h]);
            s.vc8[base + h * D + d] = minipaged::fp8_e4m3_from_float_soft(vv / s.vs[h]);
          } else {
            s.kc16[base + h * D + d] = to_bits(kv, pr.dt);
            s.vc16[base + h * D + d] = to_bits(vv, pr.dt);
          }
        }
    }
  s.q.resize(std::max<size_t>(size_t(s.B) * pr.hq * D, 8));
  for (auto& x : s.q) x = to_bits(nd(), pr.dt);
  if (pr.fp8 && pr.dt == DType::kBFloat16) {
    // bf16 q beyond f16's range and deep in its subnormals (the tensor-core kernel
    // moves q to f16 by a power of two per head), k_scale compensating, so that
    // scores keep their size: heads of KV head h are scaled by 2^e(h), its K by 2^-e(h).
    const int exps[] = {20, -26, 0, 13, -13};
    for (int h = 0; h < H; ++h) s.ks[h] = std::ldexp(s.ks[h], -exps[h % 5]);
    for (int b = 0; b < s.B; ++b)
      for (int hh = 0; hh < pr.hq; ++hh)
        for (int d = 0; d < D; ++d) {
          uint16_t& x = s.q[(size_t(b) * pr.hq + hh) * D + d];
          x = to_bits(std::ldexp(from_bits(x, pr.dt), exps[(hh / (pr.hq / H)) % 5]), pr.dt);
        }
  }

  // fp64 reference
  const double scale = 1.0 / std::sqrt(double(D));
  const int group = pr.hq / H;
  s.ref.assign(size_t(s.B) * pr.hq * D, 0.0);
  s.ref_lse.assign(size_t(s.B) * pr.hq, -INFINITY);
  auto kval = [&](size_t i, int h) {
    return pr.fp8 ? e4m3_to_double(s.kc8[i]) * s.ks[h] : double(from_bits(s.kc16[i], pr.dt));
  };
  auto vval = [&](size_t i, int h) {
    return pr.fp8 ? e4m3_to_double(s.vc8[i]) * s.vs[h] : double(from_bits(s.vc16[i], pr.dt));
  };
  double ref_max = 1.0;
#pragma omp parallel for collapse(2) schedule(dynamic) reduction(max : ref_max)
  for (int b = 0; b < s.B; ++b)
    for (int hh = 0; hh < pr.hq; ++hh) {
      const int ctx = pr.ctx[b], kvh = hh / group;
      if (ctx == 0) continue;
      std::vector<double> sc(ctx), acc(D, 0.0), qd(D);
      for (int d = 0; d < D; ++d) qd[d] = from_bits(s.q[(size_t(b) * pr.hq + hh) * D + d], pr.dt);
      double mx = -INFINITY;
      for (int j = 0; j < ctx; ++j) {
        const size_t ko = slot_of(b, j) * s.row + size_t(kvh) * D;
        double dot = 0;
        for (int d = 0; d < D; ++d) dot += qd[d] * kval(ko + d, kvh);
        sc[j] = dot * scale;
        mx = std::max(mx, sc[j]);
      }
      double l = 0;
      for (int j = 0; j < ctx; ++j) {
        const double pj = std::exp(sc[j] - mx);
        l += pj;
        const size_t vo = slot_of(b, j) * s.row + size_t(kvh) * D;
        for (int d = 0; d < D; ++d) acc[d] += pj * vval(vo + d, kvh);
      }
      for (int d = 0; d < D; ++d) {
        const double r = acc[d] / l;
        s.ref[(size_t(b) * pr.hq + hh) * D + d] = r;
        ref_max = std::max(ref_max, std::fabs(r));
      }
      s.ref_lse[size_t(b) * pr.hq + hh] = mx + std::log(l);
    }
  s.ref_max = ref_max;

  const size_t cache_bytes = slots * s.row * (pr.fp8 ? 1 : 2);
  CHECK_CUDA(cudaMalloc(&s.dk, std::max<size_t>(cache_bytes, 16)));
  CHECK_CUDA(cudaMalloc(&s.dv, std::max<size_t>(cache_bytes, 16)));
  CHECK_CUDA(cudaMemcpy(s.dk, pr.fp8 ? (void*)s.kc8.data() : (void*)s.kc16.data(), cache_bytes, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(s.dv, pr.fp8 ? (void*)s.vc8.data() : (void*)s.vc16.data(), cache_bytes, cudaMemcpyHostToDevice));
  if (pr.fp8) {
    CHECK_CUDA(cudaMalloc(&s.dks, H * 4));
    CHECK_CUDA(cudaMalloc(&s.dvs, H * 4));
    CHECK_CUDA(cudaMemcpy(s.dks, s.ks.data(), H * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(s.dvs, s.vs.data(), H * 4, cudaMemcpyHostToDevice));
  }
  s.o_head = D + kOPad;
  s.o_row = int64_t(pr.hq) * s.o_head;
  s.o_elems = std::max<int64_t>(s.B * s.o_row, 8);
  s.lse_elems = std::max<int64_t>(int64_t(s.B) * pr.hq, 1);
  CHECK_CUDA(cudaMalloc(&s.dq, s.q.size() * 2));
  CHECK_CUDA(cudaMemcpy(s.dq, s.q.data(), s.q.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&s.dout, s.o_elems * 2));
  CHECK_CUDA(cudaMalloc(&s.dlse, s.lse_elems * 4));
  // Partials for the most splits any plan makes (256).
  CHECK_CUDA(cudaMalloc(&s.dpart, workspace_words(s.B, pr.hq, D) * 4));
  CHECK_CUDA(cudaMalloc(&s.dtable, s.table.size() * 4));
  CHECK_CUDA(cudaMemcpy(s.dtable, s.table.data(), s.table.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&s.dctx, std::max(s.B, 1) * 4));
  CHECK_CUDA(cudaMemcpy(s.dctx, pr.ctx.data(), s.B * 4, cudaMemcpyHostToDevice));
  return s;
}

void free_setup(Setup& s) {
  for (void* p : {s.dk, s.dv, (void*)s.dq, (void*)s.dout, (void*)s.dlse, (void*)s.dpart, (void*)s.dks, (void*)s.dvs,
                  (void*)s.dtable, (void*)s.dctx})
    if (p) CHECK_CUDA(cudaFree(p));
}

minipaged::DecodeParams params_of(const Setup& s, bool with_lse) {
  const Prob& pr = s.pr;
  minipaged::DecodeParams p{};
  p.q = s.dq, p.k_cache = s.dk, p.v_cache = s.dv, p.o = s.dout;
  p.block_tables = s.dtable, p.context_lens = s.dctx;
  p.lse = with_lse ? s.dlse : nullptr, p.lse_batch_stride = pr.hq;
  p.q_batch_stride = int64_t(pr.hq) * pr.d, p.q_head_stride = pr.d;
  p.o_batch_stride = s.o_row, p.o_head_stride = s.o_head;
  p.k_block_stride = p.v_block_stride = int64_t(pr.bs) * s.row;
  p.k_token_stride = p.v_token_stride = s.row;
  p.k_head_stride = p.v_head_stride = pr.d;
  p.block_table_stride = s.max_blocks;
  p.batch = s.B, p.num_q_heads = pr.hq, p.num_kv_heads = pr.hkv, p.head_dim = pr.d;
  p.block_size = pr.bs, p.max_blocks = s.max_blocks;
  p.scale = 1.f / std::sqrt(float(pr.d));
  p.dtype = pr.dt, p.num_sms = g_num_sms, p.cc_major = g_cc;
  p.kv_fp8 = pr.fp8, p.k_scale = s.dks, p.v_scale = s.dvs;
  return p;
}

// Plans and points the params at the workspace; false if the kernel is missing.
bool plan_call(const Setup& s, minipaged::DecodeParams& p, int variant, int splits, minipaged::DecodePlan& plan) {
  p.variant = variant;
  plan = minipaged::decode_plan(p, splits);
  if (plan.kernel == nullptr) return false;
  minipaged::decode_set_workspace(p, s.dpart);
  const int64_t n = minipaged::decode_split_counter_count(p, plan);
  if (n > kMaxCounters) {
    std::fprintf(stderr, "need %lld counters\n", (long long)n);
    std::exit(2);
  }
  p.split_counters = n > 0 ? g_counters : nullptr;
  return true;
}

struct Result {
  std::vector<uint16_t> o;
  std::vector<float> lse;
  int splits = 0;
  bool fused = false;
  bool worklist = false;  // the plan was a work list (DecodeParams::worklist)
  int threads = 0;        // the plan's CTA size (64: a two-warp plan, which has no fused build)
};

void poison(const Setup& s, cudaStream_t st) {
  CHECK_CUDA(cudaMemsetAsync(s.dout, 0xFF, s.o_elems * 2, st));
  CHECK_CUDA(cudaMemsetAsync(s.dlse, 0xFF, s.lse_elems * 4, st));
}

void fetch(const Setup& s, Result& r, cudaStream_t st) {
  r.o.resize(s.o_elems);
  r.lse.resize(s.lse_elems);
  CHECK_CUDA(cudaMemcpyAsync(r.o.data(), s.dout, s.o_elems * 2, cudaMemcpyDeviceToHost, st));
  CHECK_CUDA(cudaMemcpyAsync(r.lse.data(), s.dlse, s.lse_elems * 4, cudaMemcpyDeviceToHost, st));
  CHECK_CUDA(cudaStreamSynchronize(st));
}

bool run(const Setup& s, int variant, int splits, bool with_lse, cudaStream_t st, Result& r) {
  minipaged::DecodeParams p = params_of(s, with_lse);
  minipaged::DecodePlan plan;
  if (!plan_call(s, p, variant, splits, plan)) return false;
  poison(s, st);
  CHECK_CUDA(minipaged::launch_decode(p, plan, st));
  CHECK_CUDA(cudaGetLastError());
  fetch(s, r, st);
  r.splits = p.num_splits;
  r.fused = plan.fused && p.num_splits > 1;
  r.worklist = p.worklist > 0;
  r.threads = plan.threads;
  return true;
}

int counters_nonzero(int64_t n) {
  std::vector<int32_t> h(std::max<int64_t>(n, 1));
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaMemcpy(h.data(), g_counters, n * 4, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += h[i] != 0;
  return bad;
}

// Against the fp64 reference: |err| <= atol + rtol |ref|, padding NaN, lse.
long compare_ref(const Setup& s, const Result& r, bool with_lse, double* max_err) {
  const Prob& pr = s.pr;
  const bool bf = pr.dt == DType::kBFloat16;
  // bf16 / fp16 rounding of o and of P in the tensor-core kernel, with margin.
  const double atol = (bf ? 1.5e-2 : 3e-3) * s.ref_max, rtol = bf ? 2e-2 : 5e-3;
  long bad = 0;
  *max_err = 0;
  for (int b = 0; b < s.B; ++b)
    for (int h = 0; h < pr.hq; ++h) {
      for (int d = 0; d < s.o_head; ++d) {
        const float got = from_bits(r.o[b * s.o_row + h * s.o_head + d], pr.dt);
        if (d >= pr.d) {
          bad += !std::isnan(got);
          continue;
        }
        const double ref = s.ref[(size_t(b) * pr.hq + h) * pr.d + d];
        const double err = std::fabs(double(got) - ref);
        if (!(err <= atol + rtol * std::fabs(ref))) ++bad;
        if (std::isfinite(err)) *max_err = std::max(*max_err, err);
      }
      if (!with_lse) continue;
      const double rl = s.ref_lse[size_t(b) * pr.hq + h], gl = r.lse[size_t(b) * pr.hq + h];
      if (std::isinf(rl)) {
        bad += !(std::isinf(gl) && gl < 0);
      } else {
        bad += !(std::fabs(gl - rl) <= 2e-3 * (1 + std::fabs(rl)));
      }
    }
  return bad;
}

bool same_bits(const Result& a, const Result& b, bool with_lse) {
  return a.o == b.o && (!with_lse || std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * 4) == 0);
}

int g_failures = 0;
void report(bool ok, const std::string& what) {
  if (!ok) ++g_failures;
  std::printf("%s  %s\n", ok ? "PASS" : "FAIL", what.c_str());
}

// A CUDA graph of one planned decode call on stream st (its launches, no sync), instantiated.
cudaGraphExec_t capture_decode(const minipaged::DecodeParams& p, const minipaged::DecodePlan& plan,
                               cudaStream_t st, cudaGraph_t& g) {
  cudaGraphExec_t ge;
  CHECK_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  CHECK_CUDA(minipaged::launch_decode(p, plan, st));
  CHECK_CUDA(cudaStreamEndCapture(st, &g));
  CHECK_CUDA(cudaGraphInstantiate(&ge, g, 0));
  return ge;
}

// One eager call (variant, forced splits, with lse) into `eager`, then the same call captured
// once in a CUDA graph and replayed g_replays times, outputs poisoned before each: how many
// replays differ from the eager call's bits.
int graph_replays_differing(const Setup& s, int variant, int splits, cudaStream_t st, Result& eager) {
  minipaged::DecodeParams p = params_of(s, true);
  minipaged::DecodePlan plan;
  plan_call(s, p, variant, splits, plan);
  run(s, variant, splits, true, st, eager);
  cudaGraph_t g;
  const cudaGraphExec_t ge = capture_decode(p, plan, st, g);
  int bad = 0;
  for (int i = 0; i < g_replays; ++i) {
    poison(s, st);
    CHECK_CUDA(cudaGraphLaunch(ge, st));
    Result r;
    fetch(s, r, st);
    bad += !same_bits(eager, r, true);
  }
  CHECK_CUDA(cudaGraphExecDestroy(ge));
  CHECK_CUDA(cudaGraphDestroy(g));
  return bad;
}

// The integers of a comma list in environment variable `name` (none if unset).
std::vector<int> env_ints(const char* name) {
  std::vector<int> out;
  const char* env = std::getenv(name);
  for (const char* at = env; at != nullptr && *at != '\0';) {
    out.push_back(std::atoi(at));
    at = std::strchr(at, ',');
    if (at != nullptr) ++at;
  }
  return out;
}

// DECODE_PAGE_ORDER, how the timed batches' pages lie in the pool (time and paged_read):
// "shuffled" (default), the pool in random order, as the standard grid has it; "sorted", the same
// random placement but each sequence's table ascending, so a CTA reads its pages in address order;
// "contiguous", sequence b's pages one run, in order. Apart, they price the scattering itself and
// the order its pages are read in (decode_paged_read_9614a0d/: the paged read trails a contiguous
// one by 1.1-1.9%).
const char* page_order() {
  const char* env = std::getenv("DECODE_PAGE_ORDER");
  return env != nullptr && *env != '\0' ? env : "shuffled";
}

// The order above applied to a shuffled pool of B tables of `pages` entries (perm, row-major).
// The shuffle stays in every case, so the random stream after it (rand lengths) is unchanged.
// (main refuses any other value of DECODE_PAGE_ORDER before a mode runs)
void order_pages(std::vector<int32_t>& perm, int pages) {
  const std::string order = page_order();
  if (order == "sorted") {
    for (size_t b = 0; b < perm.size(); b += pages) std::sort(perm.begin() + b, perm.begin() + b + pages);
  } else if (order == "contiguous") {
    std::iota(perm.begin(), perm.end(), 0);
  }
}

// A row label's suffix naming a page order other than the default.
std::string page_order_label() {
  const std::string order = page_order();
  return order == "shuffled" ? "" : " " + order;
}

// Tilings worth running for a problem: the default, the tensor-core and the
// scalar kernel, and the register rings where they exist (G=2, D=128, 16-bit).
std::vector<int> tilings_for(const Prob& pr) {
  std::vector<int> v = {0, 10, 12};
  if (!pr.fp8) v.insert(v.end(), {20, 21, 22});  // tensor cores in two-warp CTAs
  if (!pr.fp8 && pr.d == 128 && pr.hq / pr.hkv == 2) v.insert(v.end(), {13, 14, 15, 16, 17});
  if (pr.fp8 && pr.hq / pr.hkv == 2) v.insert(v.end(), {6, 7, 8});  // the fp8 cp.async tilings
  if (pr.fp8) v.insert(v.end(), {18, 19, 23, 24});  // tensor cores: 32 tokens per warp; two-warp CTAs
  // DECODE_CHECK_TILINGS (a comma list): check only those of them (a new tiling's GPU call)
  if (const std::vector<int> keep = env_ints("DECODE_CHECK_TILINGS"); !keep.empty())
    v.erase(std::remove_if(v.begin(), v.end(),
                           [&](int t) { return std::find(keep.begin(), keep.end(), t) == keep.end(); }),
            v.end());
  return v;
}

// check_problem on a problem already set up (its caller owns s). bits: OR-ed into every variant
// run (kWorklistOn: every plan a work list where the gate allows).
void check_setup(const Setup& s, const std::vector<int>& split_list, bool deep, int bits) {
  const Prob& pr = s.pr;
  std::printf("-- %s  %s H%d/%d D%d page %d, %d sequences\n", pr.name.c_str(),
              pr.fp8 ? "fp8" : (pr.dt == DType::kBFloat16 ? "bf16" : "fp16"), pr.hq, pr.hkv, pr.d, pr.bs, s.B);
  cudaStream_t st;
  CHECK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  for (int tiling : tilings_for(pr)) {
    const int t = tiling | bits | g_check_bits;
    long bad_ref = 0, bad_bits = 0, bad_counters = 0, runs = 0, fused_runs = 0;
    double worst = 0;
    std::string splits_seen;
    for (int sp : split_list) {
      Result two, one;
      if (!run(s, t, sp, true, st, two)) {
        report(false, "no kernel for tiling " + std::to_string(t));
        break;
      }
      double e;
      bad_ref += compare_ref(s, two, true, &e) != 0;
      worst = std::max(worst, e);
      run(s, t | kFused, sp, true, st, one);
      bad_ref += compare_ref(s, one, true, &e) != 0;
      worst = std::max(worst, e);
      runs += 2;
      // The split heuristic follows the kernel's occupancy, which the fused
      // tail can change (tiling 13): bits are comparable at equal split counts, and not
      // against a work list (fused plans never take one: their splits' runs differ).
      if (one.fused && one.splits == two.splits && !two.worklist && one.threads == two.threads) {
        ++fused_runs;
        bad_bits += !same_bits(two, one, true);
        minipaged::DecodeParams p = params_of(s, true);
        minipaged::DecodePlan plan;
        plan_call(s, p, t | kFused, sp, plan);
        bad_counters += counters_nonzero(minipaged::decode_split_counter_count(p, plan)) != 0;
      }
      if (splits_seen.size() < 60) splits_seen += std::to_string(two.splits) + " ";
    }
    char buf[320];
    std::snprintf(buf, sizeof buf,
                  "%-26s tiling %2d: %ld runs vs fp64 (max err %.2e, ref max %.2f): %ld bad; fused vs two-launch "
                  "bitwise in %ld runs: %ld differ; counters left non-zero: %ld  [splits %s]",
                  pr.name.c_str(), tiling, runs, worst, s.ref_max, bad_ref, fused_runs, bad_bits, bad_counters,
                  splits_seen.c_str());
    report(bad_ref == 0 && bad_bits == 0 && bad_counters == 0, buf);
    // o without lse must be the same bits as o with it.
    {
      Result a, b;
      run(s, t | kFused, 5, true, st, a);
      run(s, t | kFused, 5, false, st, b);
      report(a.o == b.o,
             pr.name + " tiling " + std::to_string(tiling) + " fused: o without lse == o with lse (5 splits)");
    }
  }
  if (deep) {
    // Repeated fused calls on one stream, no host sync, split count changing.
    const int t = 0;
    Result ref5;
    run(s, t, 5, true, st, ref5);
    const int seq[] = {3, 64, 7, 1, 16, 5};
    for (int rep = 0; rep < 2; ++rep)
      for (int sp : seq) {
        minipaged::DecodeParams p = params_of(s, true);
        minipaged::DecodePlan plan;
        plan_call(s, p, t | kFused, sp, plan);
        poison(s, st);
        CHECK_CUDA(minipaged::launch_decode(p, plan, st));
      }
    Result last;
    fetch(s, last, st);
    report(same_bits(ref5, last, true) && counters_nonzero(kMaxCounters) == 0,
           pr.name + ": 12 back-to-back fused calls (splits 3/64/7/1/16/5 x2): last == two-launch bits, counters zero");

    // One graph, captured once, replayed 100 times.
    for (int variant : {t | kFused, t}) {
      Result eager;
      const int bad = graph_replays_differing(s, variant, 7, st, eager);
      const int left = counters_nonzero(kMaxCounters);
      double e;
      report(bad == 0 && left == 0 && compare_ref(s, eager, true, &e) == 0,
             pr.name + (variant & kFused ? ": fused" : ": two-launch") + " graph, " + std::to_string(g_replays) +
                 " replays: " +
                 std::to_string(bad) + " differ from the eager call, " + std::to_string(left) +
                 " counters non-zero");
    }
  }
  CHECK_CUDA(cudaStreamDestroy(st));
}

void check_problem(const Prob& pr, const std::vector<int>& split_list, bool deep, uint32_t seed, int bits = 0) {
  Setup s = make_setup(pr, seed);
  check_setup(s, split_list, deep, bits);
  free_setup(s);
}

// Work lists (DecodeParams::worklist): a batch whose plan takes one where asked (128 sequences
// over 8 or 16 KV heads are more than half a wave of every kernel, and the table is 3+
// split-byte caps wide; where the wave cap leaves one or two splits per sequence, the work list
// takes two slots per sequence, decode/launch.cu plan_splits): short,
// empty and odd-length sequences around two long ones. Every tiling, two-launch and fused, with
// the work list (kWorklistOn) against the fp64 reference (check_problem, the heuristic's split
// count); the plan checked to be a work list, its CUDA graph replayed bitwise the eager call,
// and the same batch without it (kWorklistOff) within the reference's bound too. The merge with
// its grouping flipped (variant bit kDecodeVariantWorklistGroupedMerge: four sequences per CTA
// where the default takes one, or the reverse) must give the default's bits, eager and in every
// graph replay.
// every_tiling false (small mode, for the sanitizers): the default tiling's checks only.
void check_worklist_problem(const Prob& pr, uint32_t seed, bool every_tiling = true) {
  Setup s = make_setup(pr, seed);
  if (every_tiling) check_setup(s, {0}, false, kWorklistOn);
  cudaStream_t st;
  CHECK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  Result eager, plain;
  const int bad = graph_replays_differing(s, kWorklistOn, 0, st, eager);
  double e0 = 0, e1 = 0;
  const long bad_ref = compare_ref(s, eager, true, &e0);
  run(s, kWorklistOff, 0, true, st, plain);
  const long bad_plain = compare_ref(s, plain, true, &e1);
  Result grouped;
  const int bad_grouped = graph_replays_differing(s, kWorklistOn ^ minipaged::kDecodeVariantWorklistGroupedMerge, 0,
                                                  st, grouped);
  const bool grouped_same = grouped.worklist && same_bits(grouped, eager, true);
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "%s: work list %s (%d splits), %ld bad vs fp64 (max err %.2e); graph: %d of %d replays differ; "
                "without it: %ld bad (max err %.2e); merge grouping flipped: %s, %d of its replays differ",
                pr.name.c_str(), eager.worklist ? "taken" : "NOT TAKEN", eager.splits, bad_ref, e0, bad, g_replays,
                bad_plain, e1, grouped_same ? "bitwise" : "DIFFERS", bad_grouped);
  report(eager.worklist && !plain.worklist && bad == 0 && bad_ref == 0 && bad_plain == 0 && grouped_same &&
             bad_grouped == 0,
         buf);
  CHECK_CUDA(cudaStreamDestroy(st));
  free_setup(s);
}

void check_worklist_problems(uint32_t seed) {
  std::vector<int> ctx;
  const int pattern[] = {0, 1, 17, 97, 1023, 300, 129, 640};
  for (int b = 0; b < 128; ++b) ctx.push_back(pattern[b % 8]);
  ctx[5] = 50001, ctx[77] = 4097;  // (FP8 at D = 64: splits of 16k tokens, 2 MB of K+V per KV head)
  const DType f16 = DType::kFloat16, b16 = DType::kBFloat16;
  for (int bs : {1, 16, 256})  // (page 256 over 8 KV heads)
    check_worklist_problem({"worklist G2 D128 H" + std::to_string(bs == 256 ? 8 : 16) + " p" + std::to_string(bs), b16,
                            false, bs == 256 ? 16 : 32, bs == 256 ? 8 : 16, 128, bs, ctx},
                           seed++);
  for (DType dt : {b16, f16})
    for (int D : {64, 128})
      for (auto hh : {std::pair<int, int>{32, 16}, {64, 16}})
        for (bool fp8 : {false, true})
          check_worklist_problem({std::string("worklist ") + (fp8 ? "fp8 " : "") + (dt == b16 ? "bf16" : "fp16") +
                                      " G" + std::to_string(hh.first / hh.second) + " D" + std::to_string(D),
                                  dt, fp8, hh.first, hh.second, D, 16, ctx},
                                 seed++);
}


// ------------------------------------------------------------------ timing

__global__ void flush_kernel(const uint4* __restrict__ buf, size_t n, unsigned* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcg(buf + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // keeps the loads; never true for the zero buffer
}

__global__ void empty_kernel(int* x) {
  if (threadIdx.x == 1024) *x = 0;
}

__global__ void fill_kernel(uint16_t* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 0x9e3779b1u ^ seed;
    h ^= h >> 15, h *= 0x2c1b3c6du, h ^= h >> 12;
    const float f = (int(h & 0xffff) - 32768) * (2.f / 32768.f);
    const __nv_bfloat16 b = __float2bfloat16(f);
    x[i] = *reinterpret_cast<const uint16_t*>(&b);
  }
}

// Finite e4m3 bytes of magnitude 0.25..3.75 (exponent field 5..8), random sign.
__global__ void fill_fp8_kernel(uint8_t* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 0x9e3779b1u ^ seed;
    h ^= h >> 15, h *= 0x2c1b3c6du, h ^= h >> 12;
    x[i] = uint8_t((h & 0x80u) | ((5u + ((h >> 8) & 3u)) << 3) | ((h >> 10) & 7u));
  }
}

struct Timing {
  double med, p20, p80;
};

// The zeroed 256 MB buffer the timed modes read between replays, and the word its flush
// kernel may write (never, for zeros) so that the reads are kept.
struct L2Flush {
  uint4* buf = nullptr;
  size_t n16 = (256u << 20) / 16;
  unsigned* sink = nullptr;
};

L2Flush make_l2_flush() {
  L2Flush f;
  CHECK_CUDA(cudaMalloc(&f.buf, f.n16 * 16));
  CHECK_CUDA(cudaMemset(f.buf, 0, f.n16 * 16));
  CHECK_CUDA(cudaMalloc(&f.sink, 4));
  return f;
}

void free_l2_flush(const L2Flush& f) {
  CHECK_CUDA(cudaFree(f.buf));
  CHECK_CUDA(cudaFree(f.sink));
}

// Untimed (flush, replay) pairs before the timed ones: DECODE_TIME_WARMUP, default 50. With 3
// bare replays, a row's first config could read 10% slow on an H100, its replays bimodal
// (bench/results/nvidia-h100/decode_worklist_early_merge_32e566e): the GPU had idled while the
// host built the row.
int time_warmup() {
  static const int n = [] {
    const char* env = std::getenv("DECODE_TIME_WARMUP");
    return env != nullptr ? std::max(0, std::atoi(env)) : 50;
  }();
  return n;
}

Timing time_graph(cudaGraphExec_t ge, cudaStream_t st, int reps, const L2Flush& fl) {
  std::vector<cudaEvent_t> a(reps), b(reps);
  for (int i = 0; i < reps; ++i) {
    CHECK_CUDA(cudaEventCreate(&a[i]));
    CHECK_CUDA(cudaEventCreate(&b[i]));
  }
  for (int i = 0; i < 3; ++i) CHECK_CUDA(cudaGraphLaunch(ge, st));
  for (int i = 0; i < time_warmup(); ++i) {
    flush_kernel<<<g_num_sms * 8, 512, 0, st>>>(fl.buf, fl.n16, fl.sink);
    CHECK_CUDA(cudaGraphLaunch(ge, st));
  }
  for (int i = 0; i < reps; ++i) {
    flush_kernel<<<g_num_sms * 8, 512, 0, st>>>(fl.buf, fl.n16, fl.sink);
    CHECK_CUDA(cudaEventRecord(a[i], st));
    CHECK_CUDA(cudaGraphLaunch(ge, st));
    CHECK_CUDA(cudaEventRecord(b[i], st));
  }
  CHECK_CUDA(cudaStreamSynchronize(st));
  std::vector<double> t(reps);
  for (int i = 0; i < reps; ++i) {
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a[i], b[i]));
    t[i] = ms * 1e3;
    CHECK_CUDA(cudaEventDestroy(a[i]));
    CHECK_CUDA(cudaEventDestroy(b[i]));
  }
  std::sort(t.begin(), t.end());
  auto q = [&](double f) { return t[std::min<size_t>(t.size() - 1, size_t(f * (t.size() - 1) + 0.5))]; };
  return {q(0.5), q(0.2), q(0.8)};
}

// Captures launch(st) (launches on st, no sync) in a CUDA graph and times its replays as
// time_graph does; the graph is destroyed after.
template <class Launch>
Timing time_captured(cudaStream_t st, int reps, const L2Flush& fl, Launch&& launch) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CHECK_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  launch(st);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaStreamEndCapture(st, &g));
  CHECK_CUDA(cudaGraphInstantiate(&ge, g, 0));
  const Timing t = time_graph(ge, st, reps, fl);
  CHECK_CUDA(cudaGraphExecDestroy(ge));
  CHECK_CUDA(cudaGraphDestroy(g));
  return t;
}

// Times and prints the graph of one empty kernel: the floor under every timed row.
void print_graph_floor(cudaStream_t st, int reps, const L2Flush& fl) {
  int* dummy;
  CHECK_CUDA(cudaMalloc(&dummy, 4));
  const Timing t = time_captured(st, reps, fl, [&](cudaStream_t s) { empty_kernel<<<1, 32, 0, s>>>(dummy); });
  std::printf("graph of one empty kernel (the floor of every row): median %.2f us\n", t.med);
  CHECK_CUDA(cudaFree(dummy));
}

#if MINIPAGED_DECODE_TRACE
// One traced graph replay after a flush (a build with -DMINIPAGED_DECODE_TRACE=1): the work-list
// planner's entry and exit (when it ran), the split kernel's marks (decode/trace.cuh) as quantiles
// over the CTAs that reached each, in us from the first entry, then the merge kernel's, and how
// many CTAs each SM ran. The marks are zeroed first: CTAs that return early (unused splits,
// one-split merges) reach only entry and exit.
void print_trace(cudaGraphExec_t ge, cudaStream_t st, const L2Flush& fl, int split_ctas, int merge_ctas) {
  using minipaged::kTraceMaxCtas;
  static std::vector<unsigned long long> sp(size_t(kTraceMaxCtas) * minipaged::kTrMarks),
      mg(size_t(kTraceMaxCtas) * minipaged::kRtMarks), pl(minipaged::kPtMarks);
  flush_kernel<<<g_num_sms * 8, 512, 0, st>>>(fl.buf, fl.n16, fl.sink);
  CHECK_CUDA(cudaStreamSynchronize(st));
  CHECK_CUDA(minipaged::decode_trace_clear());
  CHECK_CUDA(cudaGraphLaunch(ge, st));
  CHECK_CUDA(cudaStreamSynchronize(st));
  CHECK_CUDA(minipaged::decode_trace_read(sp.data(), mg.data(), pl.data()));
  split_ctas = std::min(split_ctas, kTraceMaxCtas);
  merge_ctas = std::min(merge_ctas, kTraceMaxCtas);
  unsigned long long t0 = pl[minipaged::kPtEntry] != 0 ? pl[minipaged::kPtEntry] : ~0ull;
  for (int c = 0; c < split_ctas; ++c) {
    const unsigned long long e = sp[size_t(c) * minipaged::kTrMarks + minipaged::kTrEntry];
    if (e != 0) t0 = std::min(t0, e);
  }
  auto us = [&](unsigned long long t) { return (double(t) - double(t0)) * 1e-3; };
  if (pl[minipaged::kPtEntry] != 0)
    std::printf("  trace %-18s entry %7.2f  exit %7.2f us\n", "worklist plan", us(pl[minipaged::kPtEntry]),
                us(pl[minipaged::kPtExit]));
  auto quantiles = [&](const char* name, const std::vector<unsigned long long>& v, int n, int stride, int mark) {
    std::vector<double> x;
    for (int c = 0; c < n; ++c)
      if (v[size_t(c) * stride + mark] != 0) x.push_back(us(v[size_t(c) * stride + mark]));
    if (x.empty()) {
      std::printf("  trace %-18s (no CTA)\n", name);
      return;
    }
    std::sort(x.begin(), x.end());
    auto q = [&](double f) { return x[std::min<size_t>(x.size() - 1, size_t(f * (x.size() - 1) + 0.5))]; };
    std::printf("  trace %-18s min %7.2f  p10 %7.2f  p50 %7.2f  p90 %7.2f  max %7.2f us  (%zu CTAs)\n", name,
                x.front(), q(0.1), q(0.5), q(0.9), x.back(), x.size());
  };
  quantiles("split entry", sp, split_ctas, minipaged::kTrMarks, minipaged::kTrEntry);
  quantiles("split plan waited", sp, split_ctas, minipaged::kTrMarks, minipaged::kTrPlanWaited);
  quantiles("split first tile", sp, split_ctas, minipaged::kTrMarks, minipaged::kTrFirstTile);
  quantiles("split last tile", sp, split_ctas, minipaged::kTrMarks, minipaged::kTrLastTile);
  quantiles("split loop done", sp, split_ctas, minipaged::kTrMarks, minipaged::kTrLoopDone);
  quantiles("split exit", sp, split_ctas, minipaged::kTrMarks, minipaged::kTrExit);
  if (merge_ctas > 0) {
    quantiles("merge entry", mg, merge_ctas, minipaged::kRtMarks, minipaged::kRtEntry);
    quantiles("merge waited", mg, merge_ctas, minipaged::kRtMarks, minipaged::kRtWaited);
    quantiles("merge exit", mg, merge_ctas, minipaged::kRtMarks, minipaged::kRtExit);
  }
  std::vector<int> per_sm(1024, 0);
  for (int c = 0; c < split_ctas; ++c) ++per_sm[sp[size_t(c) * minipaged::kTrMarks + minipaged::kTrSm] & 1023];
  std::vector<int> hist(64, 0);
  for (int n : per_sm) ++hist[std::min(n, 63)];
  std::printf("  trace SMs by split CTAs run:");
  for (int k = 1; k < 64; ++k)
    if (hist[k] > 0) std::printf(" %d SMs x %d", hist[k], k);
  std::printf("\n");
}
#endif

int time_mode(int reps) {
  reps = std::max(reps, 50);
  // DECODE_TIME_HEADS="hq,hkv,D" times another head layout (default 16,8,128, the grid's).
  int hq = 16, hkv = 8, D = 128;
  if (const char* env = std::getenv("DECODE_TIME_HEADS")) {
    if (std::sscanf(env, "%d,%d,%d", &hq, &hkv, &D) != 3 || hkv <= 0 || hq % hkv != 0 || (D != 64 && D != 128)) {
      std::fprintf(stderr, "DECODE_TIME_HEADS must be hq,hkv,D with hkv | hq and D 64 or 128, got %s\n", env);
      return 2;
    }
  }
  // DECODE_TIME_PAGE, tokens per page (default 16, the grid's): a power of two up to 1024. Larger
  // pages make each sequence's K/V fewer, longer contiguous runs, so rows at several page sizes
  // price the scattering that the paged layout costs against contiguous K/V.
  int bs = 16;
  if (const char* env = std::getenv("DECODE_TIME_PAGE")) {
    bs = std::atoi(env);
    if (bs <= 0 || bs > 1024 || (bs & (bs - 1)) != 0) {
      std::fprintf(stderr, "DECODE_TIME_PAGE must be a power of two from 1 to 1024, got %s\n", env);
      return 2;
    }
  }
  // skew (DECODE_TIME_SKEW=1 adds these rows): 1, every sequence L / 32 long but the last, L;
  // 2, lengths uniform in [L / 32, L] (fixed seed); 3, every sequence L / 32 long; 4, every
  // sequence L / 4 long. L is the table capacity in every case (3, 4: a table sized for longer
  // sequences, as a captured graph's).
  struct Shape {
    int B, L, skew = 0;
  };
  std::vector<Shape> shapes = {{1, 4096}, {1, 32768}, {8, 4096}, {32, 4096}, {64, 8192}, {256, 1024}};
  if (const char* env = std::getenv("DECODE_TIME_SKEW"); env != nullptr && std::atoi(env) != 0)
    shapes.insert(shapes.end(), {{64, 32768, 1}, {64, 16384, 2}, {32, 32768, 2}, {8, 32768, 2}, {256, 4096, 2},
                                 {1, 32768, 3}, {8, 32768, 3}, {64, 32768, 3}, {256, 16384, 3}, {64, 32768, 4},
                                 {32, 32768}, {256, 16384, 1}, {128, 32768, 1}});
  // DECODE_TIME_EXTRA_SHAPES (a comma list of B*1000000+L, L a multiple of 16): more rows, e.g.
  // 64000192 for B=64 L=192 (short contexts at large batch), each at every skew of
  // DECODE_TIME_EXTRA_SKEWS (a comma list; default 0, equal lengths; 2: random lengths, whose
  // longest run a one-wave plan cannot rebalance).
  std::vector<int> extra_skews = env_ints("DECODE_TIME_EXTRA_SKEWS");
  if (extra_skews.empty()) extra_skews = {0};
  for (const int key : env_ints("DECODE_TIME_EXTRA_SHAPES"))
    for (const int skew : extra_skews) shapes.push_back({key / 1000000, key % 1000000, skew});
  cudaStream_t st;
  CHECK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const L2Flush fl = make_l2_flush();
  print_graph_floor(st, reps, fl);
  std::printf("heads Hq/Hkv/D %d/%d/%d, page %d\n", hq, hkv, D, bs);
  std::printf("flush: 256 MB read kernel outside the graph, between the event pairs; %d replays per row after %d "
              "untimed (flush, replay) pairs\n",
              reps, time_warmup());
  std::printf("%-12s %-22s %6s %6s %9s %9s %9s %8s  %s\n", "case", "config", "splits", "CTAs", "med us", "p20 us",
              "p80 us", "TB/s", "check");
  std::vector<int> variants;
  for (int t = 0; t <= 17; ++t) variants.push_back(t);
  variants.insert(variants.end(), {20, 21, 22});
  // DECODE_TIME_TILINGS (a comma list) keeps the rows of those tilings only: an A/B of two
  // builds in one GPU call spends its seconds on the kernels that differ.
  const std::vector<int> tilings = env_ints("DECODE_TIME_TILINGS");
  auto tiling_selected = [&](int v) {
    return tilings.empty() || std::find(tilings.begin(), tilings.end(), v & 0xff) != tilings.end();
  };
  // DECODE_TIME_SPLITS (a comma list): each row also timed at those forced split counts, after
  // the heuristic's (a split sweep of the plan; counts the plan clamps away are skipped).
  std::vector<int> time_splits = {0};
  for (const int n : env_ints("DECODE_TIME_SPLITS"))
    if (n > 0) time_splits.push_back(n);
  float* dscale;  // k_scale = v_scale = 0.25 for every KV head (fp8 rows)
  {
    const std::vector<float> sc(hkv, 0.25f);
    CHECK_CUDA(cudaMalloc(&dscale, hkv * sizeof(float)));
    CHECK_CUDA(cudaMemcpy(dscale, sc.data(), hkv * sizeof(float), cudaMemcpyHostToDevice));
  }
  // 16-bit rows (every tiling, both reductions), then fp8 rows (default, fused, cp.async tilings 6-8,
  // the tensor-core kernel with both reductions, and with 32 tokens per warp: 18, 19).
  // DECODE_TIME_SHAPES (a comma list of B*1000000+L, e.g. 1032768 for B=1 L=32k) and
  // DECODE_TIME_KV (16 or 8: the 16-bit or the fp8 rows only) narrow the grid, and
  // DECODE_TIME_VARIANTS (a comma list of exact variant values) replaces each row's configs:
  // what an ncu run of one kernel needs (scripts/gpu_check.sh decode_ncu).
  const std::vector<int> shape_keys = env_ints("DECODE_TIME_SHAPES");
  const std::vector<int> kv_bits = env_ints("DECODE_TIME_KV");
  const std::vector<int> exact_variants = env_ints("DECODE_TIME_VARIANTS");
  for (const bool fp8 : {false, true})
  for (const Shape& sh : shapes) {
    if (!kv_bits.empty() && kv_bits[0] != (fp8 ? 8 : 16)) continue;
    if (!shape_keys.empty() &&
        std::find(shape_keys.begin(), shape_keys.end(), sh.B * 1000000 + sh.L) == shape_keys.end())
      continue;
    if (sh.L % bs != 0) {
      std::printf("B=%d L=%d: not a whole number of %d-token pages, skipped\n", sh.B, sh.L, bs);
      continue;
    }
    const int B = sh.B, L = sh.L, per_seq = L / bs;
    const int num_blocks = B * per_seq;
    const int64_t row = int64_t(hkv) * D;
    const size_t cache_elems = size_t(num_blocks) * bs * row;
    const int eb = fp8 ? 1 : 2;  // bytes per cached element
    void *dk, *dv;
    uint16_t *dq, *dout;
    float *dlse, *dpart;
    int32_t *dtable, *dctx;
    CHECK_CUDA(cudaMalloc(&dk, cache_elems * eb));
    CHECK_CUDA(cudaMalloc(&dv, cache_elems * eb));
    CHECK_CUDA(cudaMalloc(&dq, size_t(B) * hq * D * 2));
    CHECK_CUDA(cudaMalloc(&dout, size_t(B) * hq * D * 2));
    CHECK_CUDA(cudaMalloc(&dlse, size_t(B) * hq * 4));
    CHECK_CUDA(cudaMalloc(&dpart, workspace_words(B, hq, D) * 4));
    if (fp8) {
      fill_fp8_kernel<<<1024, 256>>>(static_cast<uint8_t*>(dk), cache_elems, 1);
      fill_fp8_kernel<<<1024, 256>>>(static_cast<uint8_t*>(dv), cache_elems, 2);
    } else {
      fill_kernel<<<1024, 256>>>(static_cast<uint16_t*>(dk), cache_elems, 1);
      fill_kernel<<<1024, 256>>>(static_cast<uint16_t*>(dv), cache_elems, 2);
    }
    fill_kernel<<<64, 256>>>(dq, size_t(B) * hq * D, 3);
    std::vector<int32_t> perm(num_blocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937 rng(7);
    std::shuffle(perm.begin(), perm.end(), rng);  // scattered pages
    order_pages(perm, per_seq);
    std::vector<int32_t> ctx(B, L);
    if (sh.skew == 4) {
      std::fill(ctx.begin(), ctx.end(), L / 4);
    } else if (sh.skew == 1 || sh.skew == 3) {
      std::fill(ctx.begin(), sh.skew == 1 ? ctx.end() - 1 : ctx.end(), L / 32);
    } else if (sh.skew == 2) {
      std::uniform_int_distribution<int> len(L / 32, L);
      for (int32_t& n : ctx) n = len(rng);
    }
    const double cached_tokens = std::accumulate(ctx.begin(), ctx.end(), 0.0);
    CHECK_CUDA(cudaMalloc(&dtable, perm.size() * 4));
    CHECK_CUDA(cudaMalloc(&dctx, B * 4));
    CHECK_CUDA(cudaMemcpy(dtable, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dctx, ctx.data(), B * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaDeviceSynchronize());
    const double bytes = 2.0 * cached_tokens * row * eb + 2.0 * B * hq * D * 2;
    std::vector<uint16_t> base_o, o(size_t(B) * hq * D);
    struct Twin {
      int variant, splits, threads;
      std::vector<uint16_t> o;
    };
    std::vector<Twin> two_launch_o;
    char cname[48];
    char lname[16];
    std::snprintf(lname, sizeof lname, L % 1024 == 0 ? "%dk" : "%d", L % 1024 == 0 ? L / 1024 : L);
    std::snprintf(cname, sizeof cname, "B=%d L=%s%s%s%s", B, lname,
                  sh.skew == 1 ? " 1long" : sh.skew == 2 ? " rand" : sh.skew == 3 ? " short" : sh.skew == 4 ? " quarter" : "",
                  fp8 ? " fp8" : "", page_order_label().c_str());
    std::vector<int> configs;
    if (fp8) {
      // 10: tensor cores; 18/19: 32 tokens per warp; 23/24: two-warp CTAs; the two-warp rule
      // flipped; the short-ring rule flipped (both reductions; it acts on pages of 64+ tokens)
      configs = {0, kFused, 6, 7, 8, 10, 10 | kFused, 18, 19, 23, 24, kNoReduce,
                 minipaged::kDecodeVariantTwoWarpToggle, minipaged::kDecodeVariantFp8ShortRing,
                 minipaged::kDecodeVariantFp8ShortRing | kFused};
    } else {
      for (int t : variants) configs.push_back(t), configs.push_back(t | kFused);
      configs.push_back(kNoPDL);
      configs.push_back(kNoReduce);
      configs.push_back(minipaged::kDecodeVariantTwoWarpToggle);  // the two-warp rule flipped
    }
    if (!exact_variants.empty()) configs = exact_variants;
    // The row's decode parameters at `variant`, before planning.
    auto params_at = [&](int variant) {
      minipaged::DecodeParams p{};
      p.q = dq, p.k_cache = dk, p.v_cache = dv, p.o = dout, p.block_tables = dtable, p.context_lens = dctx;
      p.lse = nullptr, p.lse_batch_stride = hq;
      p.q_batch_stride = int64_t(hq) * D, p.q_head_stride = D, p.o_batch_stride = int64_t(hq) * D, p.o_head_stride = D;
      p.k_block_stride = p.v_block_stride = int64_t(bs) * row, p.k_token_stride = p.v_token_stride = row;
      p.k_head_stride = p.v_head_stride = D, p.block_table_stride = per_seq;
      p.batch = B, p.num_q_heads = hq, p.num_kv_heads = hkv, p.head_dim = D, p.block_size = bs;
      p.max_blocks = per_seq, p.scale = 1.f / std::sqrt(float(D)), p.dtype = DType::kBFloat16;
      p.kv_fp8 = fp8, p.k_scale = fp8 ? dscale : nullptr, p.v_scale = fp8 ? dscale : nullptr;
      p.num_sms = g_num_sms, p.cc_major = g_cc, p.variant = variant;
      return p;
    };
    {  // where the gate allows a work list: the plan without it first (the others are checked
       // against it), then the same configs with it
      minipaged::DecodeParams probe = params_at(kWorklistOn);
      minipaged::decode_plan(probe, 0);
      if (probe.worklist > 0) {
        std::vector<int> both;
        for (int v : configs) both.push_back(v | kWorklistOff);
        for (int v : configs) both.push_back(v | kWorklistOn);
        configs = both;
      }
    }
    for (int v : configs)
    for (int forced : time_splits) {
      if (!tiling_selected(v)) continue;
      minipaged::DecodeParams p = params_at(v);
      minipaged::DecodePlan plan = minipaged::decode_plan(p, forced);
      if ((v & kFused) && !plan.fused) continue;  // this tiling has no fused build
      if (forced != 0 && p.num_splits != forced) continue;  // clamped to the heuristic's range
      minipaged::decode_set_workspace(p, dpart);
      const int64_t nc = minipaged::decode_split_counter_count(p, plan);
      p.split_counters = nc > 0 ? g_counters : nullptr;
      CHECK_CUDA(cudaMemsetAsync(dout, 0xFF, o.size() * 2, st));
      CHECK_CUDA(minipaged::launch_decode(p, plan, st));
      CHECK_CUDA(cudaMemcpyAsync(o.data(), dout, o.size() * 2, cudaMemcpyDeviceToHost, st));
      CHECK_CUDA(cudaStreamSynchronize(st));
      // Check: every config near tiling 0 (two-launch); fused bitwise its two-launch twin.
      std::string check = "ok";
      if (base_o.empty()) base_o = o;
      double worst = 0;
      bool nan = false;
      for (size_t i = 0; i < o.size(); ++i) {
        const float a = from_bits(o[i], DType::kBFloat16), b = from_bits(base_o[i], DType::kBFloat16);
        nan |= std::isnan(a);
        worst = std::max(worst, double(std::fabs(a - b)));
      }
      if ((v & kNoReduce) && p.num_splits > 1) {
        check = "timing only: no merge";  // one split writes o itself: checked as any row
      } else if (nan || worst > 2e-2) {
        check = "MISMATCH vs tiling 0", ++g_failures;
      }
      if (v & kFused) {
        for (auto& e : two_launch_o)
          if (e.variant == (v & ~kFused) && e.splits == p.num_splits && e.threads == plan.threads && e.o != o)
            check = "fused != two-launch bits", ++g_failures;
      } else if (p.worklist == 0) {  // (a work list's bits are not a fused plan's: its runs differ;
                                     // nor are a two-warp plan's, which has no fused twin)
        two_launch_o.push_back({v, p.num_splits, plan.threads, o});
      }
      cudaGraph_t g;
      const cudaGraphExec_t ge = capture_decode(p, plan, st, g);
      const Timing t = time_graph(ge, st, reps, fl);
      if (nc > 0 && counters_nonzero(nc) != 0) check = "counters left non-zero", ++g_failures;
      const int gchunks = (hq / hkv + plan.group_tile - 1) / plan.group_tile;
      char cfg[128];
      std::snprintf(cfg, sizeof cfg, "tiling %d%s%s%s%s%s%s%s%s%s%s%s", v & 0xff, plan.threads == 64 ? " 2warp" : "",
                    v & kFused ? " fused" : "",
                    v & kNoPDL ? " no-PDL" : "", v & kNoReduce ? " no-reduce" : "",
                    p.worklist > 0 ? " worklist" : (v & minipaged::kDecodeVariantWorklistToggle) ? " no-worklist" : "",
                    v & minipaged::kDecodeVariantWorklistFixedRuns ? " fixed-runs" : "",
                    v & minipaged::kDecodeVariantWorklistEarlyMerge ? " early-merge" : "",
                    v & minipaged::kDecodeVariantEarlyTrigger ? " early-trigger" : "",
                    v & minipaged::kDecodeVariantWorklistGroupedMerge ? " merge-grouping-flipped" : "",
                    v & minipaged::kDecodeVariantWarpMerge ? " warp-merge-flipped" : "",
                    v & minipaged::kDecodeVariantFp8ShortRing ? " short-ring-flipped" : "");
      // (a work list's grid: its slots, not B x splits)
      const int ctas = (p.worklist > 0 ? p.worklist : p.num_splits * B) * hkv * gchunks;
      std::printf("%-12s %-22s %6d %6d %9.2f %9.2f %9.2f %8.3f  %s\n", cname, cfg, p.num_splits, ctas, t.med, t.p20,
                  t.p80, bytes / (t.med * 1e-6) / 1e12, check.c_str());
      std::fflush(stdout);
#if MINIPAGED_DECODE_TRACE
      print_trace(ge, st, fl, ctas,
                  p.num_splits > 1 && !plan.fused && !(v & kNoReduce) ? hq * B : 0);
#endif
      CHECK_CUDA(cudaGraphExecDestroy(ge));
      CHECK_CUDA(cudaGraphDestroy(g));
    }
    for (void* ptr : {(void*)dk, (void*)dv, (void*)dq, (void*)dout, (void*)dlse, (void*)dpart, (void*)dtable,
                      (void*)dctx})
      CHECK_CUDA(cudaFree(ptr));
  }
  free_l2_flush(fl);
  CHECK_CUDA(cudaFree(dscale));
  CHECK_CUDA(cudaStreamDestroy(st));
  std::printf("%s: %d failing checks\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
  return g_failures ? 1 : 0;
}


// ------------------------------------------------------------------ roofline
// The fastest read of a decode row's bytes that this harness can time: a contiguous buffer
// streamed by every SM with U independent 16-byte loads in flight per thread, no math. A
// decode kernel reads the same bytes scattered over pages, after dependent reads of
// context_lens and the block table, and (when it splits) merges in a second kernel; each of
// those is added here one at a time, so the gaps between the rows price them.
//   depth: dependent cold loads before the stream (chain[0] -> chain[chain[0]] -> ...),
//          as context_lens / block-table reads precede the first K/V load;
//   the merge: a second kernel, launched with programmatic dependent launch like the decode's
//          reduction, that reads split partials written by the first one (Hq rows of
//          kRoofSplits partials of D+1 floats) and writes an Hq x D output.
constexpr int kRoofThreads = 256, kRoofSplits = 32, kRoofD = 128;

template <int U>
__global__ void __launch_bounds__(kRoofThreads) roof_read_kernel(const uint4* __restrict__ buf, size_t n16,
                                                                  const int* __restrict__ chain, int depth,
                                                                  int zero, float* __restrict__ partial,
                                                                  unsigned* sink) {
  int idx = 0;
  for (int i = 0; i < depth; ++i) idx = __ldcg(chain + idx);
  const size_t stride = size_t(gridDim.x) * kRoofThreads;
  size_t i = blockIdx.x * size_t(kRoofThreads) + threadIdx.x + size_t(idx) * zero;  // zero == 0 at run time
  uint32_t acc = 0;
  for (; i + (U - 1) * stride < n16; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = minipaged::ld_stream_16(buf + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n16; i += stride) {
    const uint4 v = minipaged::ld_stream_16(buf + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  minipaged::griddep_launch_dependents();
  if (acc == 0x9e3779b9u) *sink = acc;  // keeps every load
  const int rows = 16 * kRoofSplits;
  if (blockIdx.x < rows && threadIdx.x <= kRoofD) partial[blockIdx.x * (kRoofD + 1) + threadIdx.x] = float(acc & 7);
}

__global__ void __launch_bounds__(kRoofD) roof_merge_kernel(const float* __restrict__ partial, float* __restrict__ out) {
  minipaged::griddep_wait();
  const float* rows = partial + size_t(blockIdx.x) * kRoofSplits * (kRoofD + 1);
  float lse[kRoofSplits], part[kRoofSplits];
#pragma unroll
  for (int s = 0; s < kRoofSplits; ++s) {  // every load of the merge in one round trip
    lse[s] = rows[s * (kRoofD + 1) + kRoofD];
    part[s] = rows[s * (kRoofD + 1) + threadIdx.x];
  }
  float m = lse[0];
#pragma unroll
  for (int s = 1; s < kRoofSplits; ++s) m = fmaxf(m, lse[s]);
  float num = 0.f, den = 0.f;
#pragma unroll
  for (int s = 0; s < kRoofSplits; ++s) {
    const float w = exp2f(lse[s] - m);
    num += w * part[s];
    den += w;
  }
  out[blockIdx.x * kRoofD + threadIdx.x] = num / den;
}

// The same read through the copy engine: each CTA takes a contiguous range of CHUNK-byte pieces
// (as a split takes a range of pages) and streams them with one cp.async.bulk each into a
// STAGES-deep shared-memory ring guarded by mbarriers; all 256 threads read every piece out of
// shared memory before its slot is refilled. A page of all KV heads of a 16-token page is 32 KB
// of bf16 K (and as much V): this prices a decode that moves whole pages instead of 16-byte rows.
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

template <int kStages, int kChunk>
__global__ void __launch_bounds__(kRoofThreads) roof_bulk_kernel(const uint4* __restrict__ buf, size_t n16,
                                                                  const int* __restrict__ chain, int depth,
                                                                  int zero, float* __restrict__ partial,
                                                                  unsigned* sink) {
#if MINIPAGED_WGMMA_DEVICE  // the mbarrier wrappers exist in the sm_90a device pass only
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) uint64_t full[kStages];
  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const uint32_t bar_s = static_cast<uint32_t>(__cvta_generic_to_shared(full));
  const size_t n_chunks = n16 * 16 / kChunk;
  const size_t c0 = n_chunks * blockIdx.x / gridDim.x, c1 = n_chunks * (blockIdx.x + 1) / gridDim.x;
  const char* base = reinterpret_cast<const char*>(buf);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) minipaged::mbar_init(bar_s + 8u * s, 1);
    minipaged::mbar_fence_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int idx = 0;
    for (int i = 0; i < depth; ++i) idx = __ldcg(chain + idx);
    base += size_t(idx) * zero;  // zero == 0 at run time
    for (size_t c = c0; c < c1 && c < c0 + kStages; ++c) {
      const int s = int(c - c0);
      minipaged::mbar_arrive_expect_tx(bar_s + 8u * s, kChunk);
      bulk_g2s(ring_s + s * kChunk, base + c * kChunk, kChunk, bar_s + 8u * s);
    }
  }
  uint32_t acc = 0;
  for (size_t c = c0; c < c1; ++c) {
    const int s = int((c - c0) % kStages);
    minipaged::mbar_wait(bar_s + 8u * s, uint32_t((c - c0) / kStages) & 1u);
    const uint4* piece = reinterpret_cast<const uint4*>(ring + s * kChunk);
#pragma unroll
    for (int j = 0; j < kChunk / 16 / kRoofThreads; ++j) {
      const uint4 v = piece[j * kRoofThreads + threadIdx.x];
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    __syncthreads();  // every thread is done with slot s
    if (threadIdx.x == 0 && c + kStages < c1) {
      minipaged::mbar_arrive_expect_tx(bar_s + 8u * s, kChunk);
      bulk_g2s(ring_s + s * kChunk, base + (c + kStages) * kChunk, kChunk, bar_s + 8u * s);
    }
  }
  minipaged::griddep_launch_dependents();
  if (acc == 0x9e3779b9u) *sink = acc;
  const int rows = 16 * kRoofSplits;
  if (blockIdx.x < rows && threadIdx.x <= kRoofD) partial[blockIdx.x * (kRoofD + 1) + threadIdx.x] = float(acc & 7);
#endif
}

int roofline_mode(int reps) {
  reps = std::max(reps, 50);
  cudaStream_t st;
  CHECK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const L2Flush fl = make_l2_flush();
  int* chain;  // chain[0] = 1024, chain[1024] = 2048, chain[2048] = 0: one cache line (and 4 KB) apart
  {
    std::vector<int> h(4096, 0);
    h[0] = 1024, h[1024] = 2048;
    CHECK_CUDA(cudaMalloc(&chain, h.size() * 4));
    CHECK_CUDA(cudaMemcpy(chain, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
  }
  float *partial, *out;
  CHECK_CUDA(cudaMalloc(&partial, size_t(16) * kRoofSplits * (kRoofD + 1) * 4));
  CHECK_CUDA(cudaMemset(partial, 0, size_t(16) * kRoofSplits * (kRoofD + 1) * 4));
  CHECK_CUDA(cudaMalloc(&out, 16 * kRoofD * 4));
  // The K+V bytes of the grid's rows (Hkv 8, D 128): 16-bit and FP8 caches.
  struct Row {
    const char* name;
    double bytes;
  };
  const double per_token = 2.0 * 8 * 128;  // K+V elements per cached token
  const Row rows[] = {{"B=1 L=4k fp8", per_token * 4096},        {"B=1 L=4k", per_token * 4096 * 2},
                      {"B=1 L=32k fp8", per_token * 32768},      {"B=1 L=32k / B=8 L=4k", per_token * 32768 * 2},
                      {"B=32 L=4k", per_token * 131072 * 2},     {"B=64 L=8k fp8", per_token * 524288},
                      {"B=256 L=1k / B=64 L=8k fp8", per_token * 262144 * 4}, {"B=64 L=8k", per_token * 524288 * 2}};
  size_t max_bytes = 0;
  for (const Row& r : rows) max_bytes = std::max(max_bytes, size_t(r.bytes));
  uint4* buf;
  CHECK_CUDA(cudaMalloc(&buf, max_bytes));
  fill_kernel<<<1024, 256>>>(reinterpret_cast<uint16_t*>(buf), max_bytes / 2, 5);
  CHECK_CUDA(cudaDeviceSynchronize());
  print_graph_floor(st, reps, fl);
  std::printf("flush: 256 MB read kernel outside the graph, between the event pairs; %d replays per row after %d "
              "untimed (flush, replay) pairs\n",
              reps, time_warmup());
  std::printf("%-28s %9s %-34s %9s %9s %9s %8s\n", "row (K+V bytes)", "MB", "read", "med us", "p20 us", "p80 us",
              "TB/s");
  using KernelFn = void (*)(const uint4*, size_t, const int*, int, int, float*, unsigned*);
  struct Cfg {
    int u;  // loads in flight per thread; 0: the bulk-copy ring
    KernelFn fn;
    int stages = 0, chunk = 0;
  };
  const Cfg cfgs[] = {{2, roof_read_kernel<2>}, {4, roof_read_kernel<4>}, {8, roof_read_kernel<8>},
                      {16, roof_read_kernel<16>}};
  const Cfg bulk_cfgs[] = {{0, roof_bulk_kernel<4, 16384>, 4, 16384}, {0, roof_bulk_kernel<6, 16384>, 6, 16384},
                           {0, roof_bulk_kernel<12, 16384>, 12, 16384}, {0, roof_bulk_kernel<2, 32768>, 2, 32768},
                           {0, roof_bulk_kernel<3, 32768>, 3, 32768},  {0, roof_bulk_kernel<6, 32768>, 6, 32768},
                           {0, roof_bulk_kernel<8, 8192>, 8, 8192},    {0, roof_bulk_kernel<16, 8192>, 16, 8192}};
  for (const Cfg& c : bulk_cfgs)
    CHECK_CUDA(cudaFuncSetAttribute(c.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, c.stages * c.chunk));
  for (const Row& r : rows) {
    const size_t n16 = size_t(r.bytes) / 16;
    // 1. The best plain read over loads in flight per thread and CTAs per SM.
    auto time_read = [&](const Cfg& c, int ctas_per_sm, int depth, bool merge) {
      return time_captured(st, reps, fl, [&](cudaStream_t s) {
        c.fn<<<g_num_sms * ctas_per_sm, kRoofThreads, c.stages * c.chunk, s>>>(buf, n16, chain, depth, 0, partial,
                                                                                  fl.sink);
        CHECK_CUDA(cudaGetLastError());
        if (merge) {
          cudaLaunchConfig_t cfg = {};
          cfg.gridDim = dim3(16);
          cfg.blockDim = dim3(kRoofD);
          cfg.stream = s;
          cudaLaunchAttribute attr[1];
          attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
          attr[0].val.programmaticStreamSerializationAllowed = 1;
          cfg.attrs = attr;
          cfg.numAttrs = 1;
          CHECK_CUDA(cudaLaunchKernelEx(&cfg, roof_merge_kernel, static_cast<const float*>(partial), out));
        }
      });
    };
    auto print = [&](const char* what, const Timing& t) {
      std::printf("%-28s %9.2f %-34s %9.2f %9.2f %9.2f %8.3f\n", r.name, r.bytes / 1e6, what, t.med, t.p20, t.p80,
                  r.bytes / (t.med * 1e-6) / 1e12);
      std::fflush(stdout);
    };
    Timing best{1e30, 0, 0};
    const Cfg* best_c = nullptr;
    int best_k = 0;
    for (const Cfg& c : cfgs)
      for (int k : {1, 2, 4, 8}) {
        const Timing t = time_read(c, k, 0, false);
        char what[64];
        std::snprintf(what, sizeof what, "contiguous, %d loads x %d CTAs/SM", c.u, k);
        print(what, t);
        if (t.med < best.med) best = t, best_c = &c, best_k = k;
      }
    char what[64];
    std::snprintf(what, sizeof what, "BEST %d loads x %d CTAs/SM", best_c->u, best_k);
    print(what, best);
    // 2. The best read behind 1 and 2 dependent cold loads, then with the merge kernel.
    for (int depth : {1, 2}) {
      std::snprintf(what, sizeof what, "best + %d dependent load%s", depth, depth > 1 ? "s" : "");
      print(what, time_read(*best_c, best_k, depth, false));
    }
    print("best + merge kernel (PDL)", time_read(*best_c, best_k, 0, true));
    print("best + 2 dependent + merge (PDL)", time_read(*best_c, best_k, 2, true));
    // 3. The bulk-copy ring, 1 or 2 CTAs per SM where the ring fits twice.
    Timing best_bulk{1e30, 0, 0};
    const Cfg* best_b = nullptr;
    int best_bk = 0;
    for (const Cfg& c : bulk_cfgs)
      for (int k : {1, 2}) {
        if (k * c.stages * c.chunk > 220 * 1024) continue;
        const Timing t = time_read(c, k, 0, false);
        std::snprintf(what, sizeof what, "bulk %d x %d KB x %d CTAs/SM", c.stages, c.chunk / 1024, k);
        print(what, t);
        if (t.med < best_bulk.med) best_bulk = t, best_b = &c, best_bk = k;
      }
    std::snprintf(what, sizeof what, "BEST bulk %d x %d KB x %d CTAs/SM", best_b->stages, best_b->chunk / 1024, best_bk);
    print(what, best_bulk);
    print("best bulk + 1 dependent + merge", time_read(*best_b, best_bk, 1, true));
  }
  free_l2_flush(fl);
  for (void* ptr : {(void*)chain, (void*)partial, (void*)out, (void*)buf})
    CHECK_CUDA(cudaFree(ptr));
  CHECK_CUDA(cudaStreamDestroy(st));
  return 0;
}

// ------------------------------------------------------------------ paged_read
// A uniform 16-bit batch's K/V (Hkv 8, D 128, 16-token pages in shuffled order) read with no
// math, in six ways of dealing the work to CTAs. At B >= 32 the decode streams at the copy rate,
// a few percent behind cuDNN on contiguous K/V; this prices the page layout and the grid apart
// from the decode kernel:
//   0 head rows:   one CTA per (sequence, KV head), reading that head's 256-byte rows of each of
//                  its sequence's pages in table order: the decode's own grid and pattern (a page
//                  holds 16 such rows per tensor, 2 KB apart);
//   1, 2, 3:       as many CTAs, each reading 2, 4 or all 8 KV heads' rows of 1/2, 1/4 or 1/8 of
//                  its sequence's pages: the same bytes per CTA in 512-byte, 1 KB or 32 KB
//                  (whole page) contiguous pieces;
//   4 balanced:    head rows on k CTAs per SM, each CTA an equal, contiguous range of the batch's
//                  (sequence, KV head, page) pieces: no wave tail;
//   5 contiguous:  the same bytes as one buffer per tensor, in equal ranges on k CTAs per SM.
// Like the decode, each thread streams through a cp.async ring: S stages of one 16-byte piece of
// K and one of V, so 2 (S - 1) copies in flight per thread. CTAs per SM (k) are set with dynamic
// shared memory (the decode's 100 KB ring leaves two). Two more modes move whole head pages with
// the tensor-copy engine instead (paged_read_tma_kernel below):
//   6 TMA head pages: the grid of mode 0, each head page (a KV head's 16 rows of a page, 4 KB of
//                  K and as much V, 256-byte rows 2 KB apart) one cp.async.bulk.tensor box;
//   7 TMA balanced: the same boxes, equal ranges of head pages on k CTAs per SM (as mode 4).
constexpr int kPrThreads = 128, kPrHeads = 8, kPrRow16 = 16, kPrPage = 16, kPrCopyModes = 6, kPrModes = 8;
constexpr int kPrHeadPage16 = kPrPage * kPrRow16;    // 16-byte pieces of one head's rows of a page
constexpr int kPrPage16 = kPrHeadPage16 * kPrHeads;  // 16-byte pieces of a whole page
// Modes 0-3: one CTA per (sequence, KV head)'s worth of bytes.
__host__ __device__ constexpr bool paged_read_grouped(int mode) { return mode <= 3; }

// Head page u = (sequence * Hkv + head) * pages + j: a KV head's 16 rows of page j of its
// sequence. CTA cta's range [u0, u1) of them: one (sequence, KV head)'s pages (per_head: modes 0-3
// and 6, whose grid is B x Hkv) or an equal share of the batch's (modes 4 and 7).
constexpr int kPrTmaMaxUnits = 4096;  // a TMA CTA's block ids, staged in shared memory (16 KB)
__host__ __device__ __forceinline__ void paged_read_units(bool per_head, int cta, int grid, int num_seqs,
                                                          int log2_pages, long long& u0, long long& u1) {
  if (per_head) {
    u0 = (long long)cta << log2_pages;
    u1 = u0 + (1LL << log2_pages);
  } else {
    const long long total = ((long long)num_seqs * kPrHeads) << log2_pages;
    u0 = total * cta / grid;
    u1 = total * (cta + 1) / grid;
  }
}
__host__ __device__ __forceinline__ int paged_read_unit_block(long long u, const int* tables, int log2_pages) {
  const long long seq = (u >> log2_pages) / kPrHeads;
  return tables[(seq << log2_pages) + (u & ((1LL << log2_pages) - 1))];
}
__host__ __device__ __forceinline__ int paged_read_unit_head(long long u, int log2_pages) {
  return int((u >> log2_pages) % kPrHeads);
}

// Piece g of CTA cta's range [g0, g1) -> its index in K (and V). The host checks that each mode
// reads every piece once.
template <int MODE>
__host__ __device__ __forceinline__ size_t paged_read_at(long long g, long long g0, int cta, const int* tables,
                                                         int log2_pages) {
  if constexpr (MODE == 5) {
    return size_t(g);
  } else if constexpr (paged_read_grouped(MODE)) {
    const int pages = 1 << log2_pages;
    // CTA (sequence, u): heads [hg, hg + 1) * kGroup of pages [pp, pp + 1) * pages / kGroup,
    // u = hg * kGroup + pp; a token's rows of the group's heads are one contiguous piece
    constexpr int kGroup = 1 << MODE, kTokenPieces = kGroup * kPrRow16;
    const int seq = cta / kPrHeads, u = cta % kPrHeads, hg = u / kGroup, pp = u % kGroup;
    const long long off = g - g0;
    const int j = pp * (pages / kGroup) + int(off / (kPrPage * kTokenPieces));
    const int within = int(off % (kPrPage * kTokenPieces));
    const size_t blk = size_t(tables[size_t(seq) * pages + j]);
    return (blk * kPrPage + within / kTokenPieces) * (kPrHeads * kPrRow16) + hg * kTokenPieces +
           within % kTokenPieces;
  } else {  // balanced: g = head page * 256 + token * 16 + piece
    const int within = int(g % kPrHeadPage16);
    const long long u = g / kPrHeadPage16;
    const size_t blk = size_t(paged_read_unit_block(u, tables, log2_pages));
    return ((blk * kPrPage + within / kPrRow16) * kPrHeads + paged_read_unit_head(u, log2_pages)) * kPrRow16 +
           within % kPrRow16;
  }
}

// CTA cta's range of pieces [g0, g1): its head pages' (paged_read_units; the grouped modes read a
// (sequence, KV head)'s worth of bytes, if not that head's).
template <int MODE>
__host__ __device__ __forceinline__ void paged_read_range(int cta, int grid, int num_seqs, int log2_pages,
                                                          long long& g0, long long& g1) {
  paged_read_units(paged_read_grouped(MODE), cta, grid, num_seqs, log2_pages, g0, g1);
  g0 *= kPrHeadPage16;
  g1 *= kPrHeadPage16;
}

// True when the CTAs of `grid` read every piece of a batch's K exactly once.
template <int MODE>
bool paged_read_covers(int num_seqs, int log2_pages, int grid, const std::vector<int>& tables) {
  std::vector<int> hits(((size_t)num_seqs * kPrPage16) << log2_pages, 0);
  for (int cta = 0; cta < grid; ++cta) {
    long long g0, g1;
    paged_read_range<MODE>(cta, grid, num_seqs, log2_pages, g0, g1);
    for (long long g = g0; g < g1; ++g) {
      const size_t i = paged_read_at<MODE>(g, g0, cta, tables.data(), log2_pages);
      if (i >= hits.size()) return false;
      ++hits[i];
    }
  }
  return std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; });
}

template <int S, int MODE>
__global__ void __launch_bounds__(kPrThreads)
    paged_read_kernel(const uint4* __restrict__ k, const uint4* __restrict__ v, const int* __restrict__ tables,
                      int log2_pages, int num_seqs, unsigned* sink) {
  extern __shared__ __align__(16) uint4 pr_ring[];  // S stages x {K, V} x kPrThreads pieces (+ padding)
  long long g0, g1;
  paged_read_range<MODE>(blockIdx.x, gridDim.x, num_seqs, log2_pages, g0, g1);
  const long long batches = (g1 - g0 + kPrThreads - 1) / kPrThreads;
  // Batch b: piece g0 + b * kPrThreads + thread of K and of V into stage b % S, one commit group
  // per batch (empty past the end, so the wait below always counts S - 1 younger groups).
  auto issue = [&](long long b) {
    const long long g = g0 + b * kPrThreads + threadIdx.x;
    const bool ok = b < batches && g < g1;
    const size_t i = ok ? paged_read_at<MODE>(g, g0, blockIdx.x, tables, log2_pages) : 0;
    uint4* slot = pr_ring + (b % S) * 2 * kPrThreads + threadIdx.x;
    minipaged::cp_async_16(slot, k + i, ok);
    minipaged::cp_async_16(slot + kPrThreads, v + i, ok);
    minipaged::cp_async_commit();
  };
  for (int s = 0; s < S - 1; ++s) issue(s);
  uint32_t acc = 0;
  for (long long b = 0; b < batches; ++b) {
    issue(b + S - 1);
    minipaged::cp_async_wait<S - 1>();
    const uint4* slot = pr_ring + (b % S) * 2 * kPrThreads + threadIdx.x;  // this thread's own copies
    const uint4 x = slot[0], y = slot[kPrThreads];
    acc ^= x.x ^ x.y ^ x.z ^ x.w ^ y.x ^ y.y ^ y.z ^ y.w;
  }
  minipaged::cp_async_wait<0>();
  if (acc == 0x9e3779b9u) *sink = acc;  // keeps every load
}

// S stages of P head pages of K and of V, each one tensor-copy box (tmaps over [blocks, 16 tokens,
// Hkv, D] as (D, Hkv, tokens, blocks), box (D, 1, 16, 1)) into a ring guarded by one mbarrier per
// stage; thread 0 issues, all threads read every stage, a CTA barrier frees it. The CTA's block
// ids are staged in shared memory first (one dependent read at the start, as a split's table run),
// so that no issue waits on the table. xor_out (a check launch; null when timed): the XOR of
// every word read, to compare with the XOR of the batch's K and V (xor_pieces_kernel).
constexpr int kPrTmaAlign = 1024;  // the ring's start, rounded up (tensor copies want 128 bytes)
template <int S, int P>
__global__ void __launch_bounds__(kPrThreads)
    paged_read_tma_kernel(const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
                          const int* __restrict__ tables, int mode, int log2_pages, int num_seqs, unsigned* sink,
                          unsigned* xor_out) {
#if MINIPAGED_WGMMA_DEVICE  // the mbarrier and TMA wrappers exist in the sm_90a device pass only
  constexpr uint32_t kBox = kPrHeadPage16 * 16;  // bytes of one head page of one tensor
  // S x P x {K, V} boxes, then the block ids, then the S mbarriers: all dynamic, since static shared
  // memory would come on top of the opt-in maximum the host asks for
  extern __shared__ __align__(128) unsigned char pr_tma_smem[];
  const uint32_t raw_s = static_cast<uint32_t>(__cvta_generic_to_shared(pr_tma_smem));
  const uint32_t ring_s = (raw_s + kPrTmaAlign - 1) & ~uint32_t(kPrTmaAlign - 1);
  const uint4* pr_tma_ring = reinterpret_cast<const uint4*>(pr_tma_smem + (ring_s - raw_s));
  int* blocks = reinterpret_cast<int*>(pr_tma_smem + (ring_s - raw_s) + size_t(S) * P * 2 * kBox);
  const uint32_t bar_s = ring_s + uint32_t(S * P * 2 * kBox + kPrTmaMaxUnits * 4);
  long long u0, u1;
  paged_read_units(mode == 6, blockIdx.x, gridDim.x, num_seqs, log2_pages, u0, u1);
  const int units = int(u1 - u0);  // <= kPrTmaMaxUnits (the host checks)
  for (int i = threadIdx.x; i < units; i += kPrThreads) blocks[i] = paged_read_unit_block(u0 + i, tables, log2_pages);
  if (threadIdx.x == 0) {
    for (int st = 0; st < S; ++st) minipaged::mbar_init(bar_s + 8u * st, 1);
    minipaged::mbar_fence_init();
    minipaged::tma_prefetch_desc(&tk);
    minipaged::tma_prefetch_desc(&tv);
  }
  __syncthreads();
  const int n = (units + P - 1) / P;
  auto issue = [&](int b) {  // thread 0: stage b's head pages
    const int st = b % S, first = b * P, cnt = min(P, units - first);
    const uint32_t bar = bar_s + 8u * st;
    minipaged::mbar_arrive_expect_tx(bar, 2u * kBox * cnt);
    for (int p = 0; p < cnt; ++p) {
      const int blk = blocks[first + p], head = paged_read_unit_head(u0 + first + p, log2_pages);
      const uint32_t dst = ring_s + uint32_t((st * P + p) * 2) * kBox;
      minipaged::tma_load_4d(dst, &tk, bar, 0, head, 0, blk);
      minipaged::tma_load_4d(dst + kBox, &tv, bar, 0, head, 0, blk);
    }
  };
  if (threadIdx.x == 0)
    for (int b = 0; b < S && b < n; ++b) issue(b);
  uint32_t acc = 0;
  for (int b = 0; b < n; ++b) {
    const int st = b % S, pieces = min(P, units - b * P) * 2 * kPrHeadPage16;
    minipaged::mbar_wait(bar_s + 8u * st, uint32_t(b / S) & 1u);
    const uint4* stage = pr_tma_ring + size_t(st) * P * 2 * kPrHeadPage16;
    for (int j = threadIdx.x; j < pieces; j += kPrThreads) {
      const uint4 x = stage[j];
      acc ^= x.x ^ x.y ^ x.z ^ x.w;
    }
    __syncthreads();  // every thread is done with stage st
    if (threadIdx.x == 0 && b + S < n) issue(b + S);
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // keeps every load
  if (xor_out != nullptr) atomicXor(xor_out, acc);
#endif
}

// The XOR of every 32-bit word of K's and V's first n 16-byte pieces (a batch's pages, in any order).
__global__ void xor_pieces_kernel(const uint4* __restrict__ k, const uint4* __restrict__ v, size_t n, unsigned* out) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 x = k[i], y = v[i];
    acc ^= x.x ^ x.y ^ x.z ^ x.w ^ y.x ^ y.y ^ y.z ^ y.w;
  }
  atomicXor(out, acc);
}

struct PagedReadTmaCfg {
  int stages, pages;  // per stage
  void (*fn)(CUtensorMap, CUtensorMap, const int*, int, int, int, unsigned*, unsigned*);
};

struct PagedReadCfg {
  int mode, stages;
  void (*fn)(const uint4*, const uint4*, const int*, int, int, unsigned*);
};

// Mode M with rings of 4, 8, 16 and 24 stages.
template <int M>
void add_paged_read_configs(std::vector<PagedReadCfg>& cfgs) {
  cfgs.insert(cfgs.end(), {{M, 4, paged_read_kernel<4, M>}, {M, 8, paged_read_kernel<8, M>},
                           {M, 16, paged_read_kernel<16, M>}, {M, 24, paged_read_kernel<24, M>}});
}

// Every mode, in order.
template <int... M>
std::vector<PagedReadCfg> paged_read_configs(std::integer_sequence<int, M...>) {
  std::vector<PagedReadCfg> cfgs;
  (add_paged_read_configs<M>(cfgs), ...);
  return cfgs;
}

int paged_read_mode(int reps) {
  reps = std::max(reps, 50);
  cudaStream_t st;
  CHECK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const L2Flush fl = make_l2_flush();
  struct Row {
    int B, L;
  };
  // B=1 and B=8 have fewer (sequence, KV head) units than SMs: there only the balanced and
  // contiguous modes run (the decode splits those rows).
  const Row rows[] = {{1, 32768}, {8, 4096}, {32, 4096}, {64, 8192}, {256, 1024}};
  size_t max_pieces = 0;
  for (const Row& r : rows) max_pieces = std::max(max_pieces, size_t(r.B) * r.L / kPrPage * kPrPage16);
  uint4 *k, *v;
  int* tables;
  CHECK_CUDA(cudaMalloc(&k, max_pieces * 16));
  CHECK_CUDA(cudaMalloc(&v, max_pieces * 16));
  CHECK_CUDA(cudaMalloc(&tables, max_pieces / kPrPage16 * 4));
  unsigned* xor_got;
  CHECK_CUDA(cudaMalloc(&xor_got, 4));
  fill_kernel<<<1024, 256>>>(reinterpret_cast<uint16_t*>(k), max_pieces * 8, 1);
  fill_kernel<<<1024, 256>>>(reinterpret_cast<uint16_t*>(v), max_pieces * 8, 2);
  CHECK_CUDA(cudaDeviceSynchronize());
  int smem_sm = 0, smem_cta = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0));
  CHECK_CUDA(cudaDeviceGetAttribute(&smem_cta, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  const std::vector<PagedReadCfg> cfgs = paged_read_configs(std::make_integer_sequence<int, kPrCopyModes>{});
  const PagedReadTmaCfg tma_cfgs[] = {{4, 1, paged_read_tma_kernel<4, 1>},  {8, 1, paged_read_tma_kernel<8, 1>},
                                      {16, 1, paged_read_tma_kernel<16, 1>}, {4, 2, paged_read_tma_kernel<4, 2>},
                                      {8, 2, paged_read_tma_kernel<8, 2>},   {4, 4, paged_read_tma_kernel<4, 4>}};
  const char* mode_names[kPrModes] = {"head rows", "2-head rows", "4-head rows", "whole pages", "balanced",
                                      "contiguous", "TMA head pgs", "TMA balanced"};
  // The tensor maps of modes 6 and 7: K and V as (D, Hkv, 16 tokens, blocks) 16-bit elements.
  const minipaged::TensorMapEncodeFn encode = minipaged::tensor_map_encoder();
  CUtensorMap tmap_k{}, tmap_v{};
  bool tma_ok = encode != nullptr;
  {
    const cuuint64_t blocks = max_pieces / kPrPage16;
    const cuuint64_t dims[4] = {kPrRow16 * 8, kPrHeads, kPrPage, blocks};
    const cuuint64_t strides[3] = {kPrRow16 * 16, kPrHeads * kPrRow16 * 16, kPrPage16 * 16};  // bytes
    const cuuint32_t box[4] = {kPrRow16 * 8, 1, kPrPage, 1};
    const cuuint32_t unit[4] = {1, 1, 1, 1};
    for (auto [map, base] : {std::pair<CUtensorMap*, void*>{&tmap_k, k}, {&tmap_v, v}})
      tma_ok = tma_ok && encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, base, dims, strides, box, unit,
                                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
    if (!tma_ok) std::printf("paged_read: no tensor map (encode %s): the TMA modes do not run\n",
                             encode ? "failed" : "not found");
  }
  {  // every mode reads every piece once: 5 sequences of 64 shuffled pages, ungrouped modes on 7 CTAs
    std::vector<int> t(5 * 64);
    std::iota(t.begin(), t.end(), 0);
    std::mt19937 rng(3);
    std::shuffle(t.begin(), t.end(), rng);
    const int units = 5 * kPrHeads;
    // (the TMA modes 6 and 7 take modes 0's and 4's head pages through the same helpers, each as
    // one box; that a box holds those pieces, each launch checks on the device)
    const bool ok[kPrCopyModes] = {paged_read_covers<0>(5, 6, units, t), paged_read_covers<1>(5, 6, units, t),
                                   paged_read_covers<2>(5, 6, units, t), paged_read_covers<3>(5, 6, units, t),
                                   paged_read_covers<4>(5, 6, 7, t),     paged_read_covers<5>(5, 6, 7, t)};
    for (int m = 0; m < kPrCopyModes; ++m)
      if (!ok[m]) {
        std::printf("FAILED: paged_read mode %s does not read every piece once\n", mode_names[m]);
        return 1;
      }
  }
  for (const PagedReadCfg& c : cfgs)
    CHECK_CUDA(cudaFuncSetAttribute(c.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_cta));
  for (const PagedReadTmaCfg& c : tma_cfgs)
    CHECK_CUDA(cudaFuncSetAttribute(c.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_cta));
  print_graph_floor(st, reps, fl);
  std::printf("flush: 256 MB read kernel outside the graph, between the event pairs; %d replays per row after %d "
              "untimed (flush, replay) pairs; %d threads per CTA\n",
              reps, time_warmup(), kPrThreads);
  std::printf("%-14s %-12s %6s %7s %7s %9s %9s %9s %8s\n", "row", "mode", "stages", "CTAs/SM", "grid", "med us",
              "p20 us", "p80 us", "TB/s");
  for (const Row& r : rows) {
    const int pages = r.L / kPrPage, num_blocks = r.B * pages;
    int log2_pages = 0;
    while ((1 << log2_pages) < pages) ++log2_pages;
    std::vector<int> perm(num_blocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937 rng(7);
    std::shuffle(perm.begin(), perm.end(), rng);
    order_pages(perm, pages);
    CHECK_CUDA(cudaMemcpy(tables, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
    const double bytes = 2.0 * num_blocks * kPrPage16 * 16;
    char name[48];
    std::snprintf(name, sizeof name, "B=%d L=%d%s", r.B, r.L, page_order_label().c_str());
    Timing best[kPrModes];
    int best_s[kPrModes] = {}, best_k[kPrModes] = {};
    for (Timing& b : best) b = {1e30, 0, 0};
    for (const PagedReadCfg& c : cfgs)
      for (int ctas : {1, 2, 3, 4, 8}) {
        if (paged_read_grouped(c.mode) && r.B * kPrHeads < g_num_sms) continue;
        const int ring = c.stages * 2 * kPrThreads * 16;
        const int smem = std::min(smem_cta, smem_sm / ctas - 1024);  // 1 KB per CTA is reserved
        if (ring > smem) continue;
        int fit = 0;
        CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, c.fn, kPrThreads, smem));
        const int grid = paged_read_grouped(c.mode) ? r.B * kPrHeads : g_num_sms * fit;
        const Timing t = time_captured(st, reps, fl, [&](cudaStream_t s) {
          c.fn<<<grid, kPrThreads, smem, s>>>(k, v, tables, log2_pages, r.B, fl.sink);
        });
        std::printf("%-14s %-12s %6d %7d %7d %9.2f %9.2f %9.2f %8.3f\n", name, mode_names[c.mode], c.stages, fit,
                    grid, t.med, t.p20, t.p80, bytes / (t.med * 1e-6) / 1e12);
        std::fflush(stdout);
        if (t.med < best[c.mode].med) best[c.mode] = t, best_s[c.mode] = c.stages, best_k[c.mode] = fit;
      }
    int best_p[kPrModes] = {};  // TMA modes: head pages per stage
    unsigned xor_want = 0;
    CHECK_CUDA(cudaMemset(xor_got, 0, 4));
    xor_pieces_kernel<<<g_num_sms * 4, 256, 0, st>>>(k, v, size_t(num_blocks) * kPrPage16, xor_got);
    CHECK_CUDA(cudaMemcpyAsync(&xor_want, xor_got, 4, cudaMemcpyDeviceToHost, st));
    CHECK_CUDA(cudaStreamSynchronize(st));
    for (int mode : {6, 7})
      for (const PagedReadTmaCfg& c : tma_cfgs)
        for (int ctas : {1, 2, 3, 4, 8}) {
          if (!tma_ok || (mode == 6 && r.B * kPrHeads < g_num_sms)) continue;
          const int need =
              kPrTmaAlign + c.stages * c.pages * 2 * kPrHeadPage16 * 16 + kPrTmaMaxUnits * 4 + c.stages * 8;
          const int smem = std::min(smem_cta, smem_sm / ctas - 1024);
          if (need > smem) continue;
          int fit = 0;
          CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, c.fn, kPrThreads, smem));
          const int grid = mode == 6 ? r.B * kPrHeads : g_num_sms * fit;
          const long long total = ((long long)r.B * kPrHeads) << log2_pages;
          if (mode == 7 && (total + grid - 1) / grid > kPrTmaMaxUnits) continue;
          // One check launch first: it must read exactly the batch's bytes (the same XOR).
          CHECK_CUDA(cudaMemset(xor_got, 0, 4));
          c.fn<<<grid, kPrThreads, smem, st>>>(tmap_k, tmap_v, tables, mode, log2_pages, r.B, fl.sink, xor_got);
          CHECK_CUDA(cudaStreamSynchronize(st));
          unsigned got = 0;
          CHECK_CUDA(cudaMemcpy(&got, xor_got, 4, cudaMemcpyDeviceToHost));
          if (got != xor_want) {
            std::printf("FAILED: paged_read %s %s %dx%d read other bytes (XOR %08x, want %08x)\n", name,
                        mode_names[mode], c.stages, c.pages, got, xor_want);
            return 1;
          }
          const Timing t = time_captured(st, reps, fl, [&](cudaStream_t s) {
            c.fn<<<grid, kPrThreads, smem, s>>>(tmap_k, tmap_v, tables, mode, log2_pages, r.B, fl.sink, nullptr);
          });
          std::printf("%-14s %-12s %3dx%-2d %7d %7d %9.2f %9.2f %9.2f %8.3f\n", name, mode_names[mode], c.stages,
                      c.pages, fit, grid, t.med, t.p20, t.p80, bytes / (t.med * 1e-6) / 1e12);
          std::fflush(stdout);
          if (t.med < best[mode].med)
            best[mode] = t, best_s[mode] = c.stages, best_k[mode] = fit, best_p[mode] = c.pages;
        }
    for (int m = 0; m < kPrModes; ++m)
      if (best_s[m] != 0)
        std::printf("%-14s BEST %-12s %d stages%s, %d CTAs/SM: %.2f us (%.3f TB/s), %.3fx contiguous\n", name,
                    mode_names[m], best_s[m],
                    best_p[m] ? (" x " + std::to_string(best_p[m]) + " head pages").c_str() : "", best_k[m],
                    best[m].med, bytes / (best[m].med * 1e-6) / 1e12, best[m].med / best[5].med);
  }
  free_l2_flush(fl);
  for (void* ptr : {(void*)k, (void*)v, (void*)tables, (void*)xor_got}) CHECK_CUDA(cudaFree(ptr));
  CHECK_CUDA(cudaStreamDestroy(st));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "check";
  int dev = 0;
  CHECK_CUDA(cudaGetDevice(&dev));
  CHECK_CUDA(cudaDeviceGetAttribute(&g_num_sms, cudaDevAttrMultiProcessorCount, dev));
  CHECK_CUDA(cudaDeviceGetAttribute(&g_cc, cudaDevAttrComputeCapabilityMajor, dev));
  CHECK_CUDA(cudaMalloc(&g_counters, kMaxCounters * 4));
  CHECK_CUDA(cudaMemset(g_counters, 0, kMaxCounters * 4));
  if (const char* env = std::getenv("DECODE_CHECK_BITS")) g_check_bits = static_cast<int>(std::strtol(env, nullptr, 0));
  if (const std::string order = page_order(); order != "shuffled" && order != "sorted" && order != "contiguous") {
    std::printf("DECODE_PAGE_ORDER=%s: want shuffled, sorted or contiguous\n", order.c_str());
    return 2;
  }
  if (mode == "time") return time_mode(argc > 2 ? std::atoi(argv[2]) : 100);
  if (mode == "roofline") return roofline_mode(argc > 2 ? std::atoi(argv[2]) : 100);
  if (mode == "paged_read") return paged_read_mode(argc > 2 ? std::atoi(argv[2]) : 100);
  const DType f16 = DType::kFloat16, b16 = DType::kBFloat16;
  // small: the sanitizers' cases; small_worklist: its work-list case alone (racecheck takes
  // minutes over the whole of small)
  if (mode == "small" || mode == "small_worklist") {
    g_replays = 10;
    if (mode == "small") {
      check_problem({"small G2 D128 p16", b16, false, 4, 2, 128, 16, {0, 17, 300}}, {1, 3}, true, 1);
      check_problem({"small G4 D64 p1", f16, false, 8, 2, 64, 1, {5, 130}}, {4}, false, 2);
      check_problem({"small fp8 G2 D64 p16", b16, true, 4, 2, 64, 16, {40, 0}}, {3}, false, 3);
    }
    {
      std::vector<int> ctx(128, 97);
      ctx[0] = 0, ctx[1] = 17, ctx[3] = 12289;
      check_worklist_problem({"small worklist G2 D128 p16", b16, false, 32, 16, 128, 16, ctx}, 6, false);
    }
  } else if (mode == "check") {
    const std::vector<int> odd = {0, 1, 17, 97, 1023, 4097, 32768};
    const std::vector<int> splits = {0, 1, 2, 3, 7, 16, 64};
    uint32_t seed = 10;
    // Every forced split count 1..64 on one mixed batch (fused vs two-launch bitwise in each).
    {
      std::vector<int> all;
      for (int i = 1; i <= 64; ++i) all.push_back(i);
      check_problem({"splits 1..64 G2 D128 p16", b16, false, 16, 8, 128, 16, {0, 1, 17, 97, 1023, 4097}}, all,
                    true, seed++);
    }
    // Every context empty: each split writes lse -inf, the merge writes zeros.
    check_problem({"all empty G2 D128 p16", b16, false, 16, 8, 128, 16, {0, 0, 0}}, {0, 1, 5}, false, seed++);
    check_worklist_problems(seed);
    seed += 100;
    for (DType dt : {f16, b16})
      for (int D : {64, 128})
        for (auto hh : {std::pair<int, int>{8, 8}, {16, 8}, {16, 4}, {16, 2}})
          for (int bs : {1, 16, 256}) {
            const std::string nm = std::string(dt == b16 ? "bf16" : "fp16") + " G" + std::to_string(hh.first / hh.second);
            check_problem({nm, dt, false, hh.first, hh.second, D, bs, odd}, splits, bs == 16 && D == 128, seed++);
          }
    // FP8 caches: the fused reduction on their kernels too.
    // Both q dtypes: the tensor-core kernel moves a bf16 q to f16 with per-head powers of two.
    for (DType dt : {b16, f16})
      for (int D : {64, 128})
        for (auto hh : {std::pair<int, int>{8, 8}, {16, 8}, {16, 2}})
          check_problem({std::string(dt == b16 ? "fp8 bf16 G" : "fp8 fp16 G") + std::to_string(hh.first / hh.second),
                         dt, true, hh.first, hh.second, D, 16, {0, 1, 17, 97, 1023, 4097}},
                        splits, dt == b16 && D == 128 && hh.first == 16 && hh.second == 8, seed++);
    // The short-ring rule flipped over 64-token pages (params.h decode_fp8_short_ring_wanted): the
    // G = 2 FP8 tensor-core kernel with a 2-stage ring wherever its splits are long enough.
    for (DType dt : {b16, f16})
      check_problem({std::string(dt == b16 ? "fp8 bf16" : "fp8 fp16") + " G2 D128 p64 short ring", dt, true, 16, 8,
                     128, 64, {0, 1, 17, 97, 1023, 4097, 30000}},
                    splits, dt == b16, seed++, minipaged::kDecodeVariantFp8ShortRing);
  } else {
    std::fprintf(stderr, "usage: %s check|small|time|roofline|paged_read [reps]\n", argv[0]);
    return 2;
  }
  std::printf("%s: %d failing checks\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
  return g_failures ? 1 : 0;
}
