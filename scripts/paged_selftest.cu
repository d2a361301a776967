// Torch-free self test of the `cuda` paged attention kernels (launch_prefill_paged
// and the paged instantiations of the fast prefill kernels), with their lse.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fopenmp \
//        -DMINIPAGED_ENABLE_SM90A -I src/minipaged/cuda/csrc scripts/paged_selftest.cu \
//        src/minipaged/cuda/csrc/prefill/paged*.cu src/minipaged/cuda/csrc/decode/launch.cu \
//        src/minipaged/cuda/csrc/decode/kernels_*.cu -o paged_selftest -lgomp
//   (the decode kernels: launch_prefill_paged's callers route q_len 1 rows to them)
//   (sm_80: -gencode=arch=compute_80,code=sm_80 and no -DMINIPAGED_ENABLE_SM90A)
//   ./paged_selftest check [name filter]   every case, every kernel variant
//   ./paged_selftest small                 a few tiny cases (for compute-sanitizer)
//
// Every case builds shuffled pages, poisons every unused cache slot with NaN and
// every unused block-table entry with -1, poisons the output (with padded head
// rows that must stay NaN) and the lse, and compares with a double-precision
// CPU reference on the same 16-bit inputs: the output elementwise
// (|err| <= atol + rtol |ref|), lse to 2e-3 absolute; rows that see no key must
// be exact zeros with lse -inf. Exit status 0 only if every check passed.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "params.h"
#include "selftest_common.h"
#include "prefill/dispatch.cuh"

using minipaged::DType;
using minipaged::PrefillParams;


using LaunchFn = cudaError_t (*)(const PrefillParams&, cudaStream_t);
namespace mf = minipaged::fast;

// Forced kernel choices (the dispatcher picks wgmma on sm_90, mma.sync elsewhere).
template <int D, bool kCausal>
cudaError_t mma_small_typed(const PrefillParams& p, cudaStream_t s) {
  return p.dtype == DType::kBFloat16
             ? mf::launch_prefill_cfg<mf::CfgSmall<__nv_bfloat16, D>, kCausal, true>(p, s)
             : mf::launch_prefill_cfg<mf::CfgSmall<__half, D>, kCausal, true>(p, s);
}
cudaError_t mma_small(const PrefillParams& p, cudaStream_t s) {
  if (p.head_dim == 128) return p.causal ? mma_small_typed<128, true>(p, s) : mma_small_typed<128, false>(p, s);
  return p.causal ? mma_small_typed<64, true>(p, s) : mma_small_typed<64, false>(p, s);
}
// GQA-packed rows (the dispatcher's choice for max_seqlen_q <= 16), forced for any length.
template <int D, bool kCausal>
cudaError_t mma_pack_typed(const PrefillParams& p, cudaStream_t s) {
  return p.dtype == DType::kBFloat16
             ? mf::launch_prefill_cfg<mf::CfgPack<__nv_bfloat16, D>, kCausal, true, true>(p, s)
             : mf::launch_prefill_cfg<mf::CfgPack<__half, D>, kCausal, true, true>(p, s);
}
cudaError_t mma_pack(const PrefillParams& p, cudaStream_t s) {
  if (p.head_dim == 128) return p.causal ? mma_pack_typed<128, true>(p, s) : mma_pack_typed<128, false>(p, s);
  return p.causal ? mma_pack_typed<64, true>(p, s) : mma_pack_typed<64, false>(p, s);
}
#if defined(MINIPAGED_ENABLE_SM90A)
template <template <typename, int> class Cfg, int D, bool kCausal>
cudaError_t wg_typed(const PrefillParams& p, cudaStream_t s) {
  return p.dtype == DType::kBFloat16
             ? mf::launch_prefill_wgmma_cfg<Cfg<__nv_bfloat16, D>, kCausal, true>(p, s)
             : mf::launch_prefill_wgmma_cfg<Cfg<__half, D>, kCausal, true>(p, s);
}
template <template <typename, int> class Cfg>
cudaError_t wg(const PrefillParams& p, cudaStream_t s) {
  if (p.head_dim == 128) return p.causal ? wg_typed<Cfg, 128, true>(p, s) : wg_typed<Cfg, 128, false>(p, s);
  return p.causal ? wg_typed<Cfg, 64, true>(p, s) : wg_typed<Cfg, 64, false>(p, s);
}
#endif

struct Variant {
  const char* name;
  LaunchFn fn;
  bool needs_sm90;
};
static const Variant kVariants[] = {
    {"dispatch", minipaged::launch_prefill_paged, false},
    {"mma_m64", mma_small, false},
    {"mma_pack", mma_pack, false},
#if defined(MINIPAGED_ENABLE_SM90A)
    {"wgmma_m64", wg<mf::CfgWgmmaSmall>, true},
    {"wgmma_m128", wg<mf::CfgWgmmaLarge>, true},
#endif
};

struct Case {
  std::string name;
  DType dtype;
  int hq, hkv, d, block_size;
  bool causal;
  std::vector<int> q_lens, ctx_lens;
  float scale;  // 0 -> 1/sqrt(D)
};

static bool g_is_sm90 = false;

// Builds the inputs and the reference once, then runs every selected variant.
static int run_case(const Case& c, const std::string& filter) {
  const DType dt = c.dtype;
  const int D = c.d, bs = c.block_size, S = int(c.q_lens.size());
  const int o_pad = 8;  // extra elements after each (token, head) output row; must stay NaN
  std::vector<int> cq(S + 1, 0);
  for (int s = 0; s < S; ++s) cq[s + 1] = cq[s] + c.q_lens[s];
  const int Tq = cq[S];
  const int max_q = S ? *std::max_element(c.q_lens.begin(), c.q_lens.end()) : 0;

  std::mt19937 rng(977 + D * 3 + c.hq * 7 + Tq + bs);
  std::normal_distribution<float> nd(0.f, 1.f);
  // Pages: sequence s uses ceil(ctx/bs) blocks drawn from a shuffled pool with
  // spare blocks; its table row is padded with -1 past what it uses (plus one
  // more column of -1 for everybody).
  std::vector<int> nblk(S);
  int used = 0, max_blocks = 1;
  for (int s = 0; s < S; ++s) {
    nblk[s] = (c.ctx_lens[s] + bs - 1) / bs;
    used += nblk[s];
    max_blocks = std::max(max_blocks, nblk[s] + 1);
  }
  const int num_blocks = used + 3;
  std::vector<int> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> table(size_t(S) * max_blocks, -1);
  int nxt = 0;
  for (int s = 0; s < S; ++s)
    for (int b = 0; b < nblk[s]; ++b) table[size_t(s) * max_blocks + b] = perm[nxt++];

  const size_t tok_elems = size_t(c.hkv) * D;
  const size_t cache_elems = size_t(num_blocks) * bs * tok_elems;
  std::vector<uint16_t> hk(cache_elems, 0xFFFF), hv(cache_elems, 0xFFFF);  // NaN everywhere unused
  auto slot = [&](int s, int j) {
    const int blk = table[size_t(s) * max_blocks + j / bs];
    return (size_t(blk) * bs + j % bs) * tok_elems;
  };
  for (int s = 0; s < S; ++s)
    for (int j = 0; j < c.ctx_lens[s]; ++j)
      for (size_t e = 0; e < tok_elems; ++e) {
        hk[slot(s, j) + e] = to_bits(nd(rng), dt);
        hv[slot(s, j) + e] = to_bits(nd(rng), dt);
      }
  const size_t q_elems = size_t(Tq) * c.hq * D;
  std::vector<uint16_t> hq_(q_elems);
  for (auto& x : hq_) x = to_bits(nd(rng), dt);
  const int64_t o_head = D + o_pad, o_row = int64_t(c.hq) * o_head;
  const size_t o_elems = size_t(Tq) * o_row;
  const size_t lse_elems = size_t(Tq) * c.hq;

  // fp64 reference, on the 16-bit values widened once
  std::vector<float> kf(cache_elems), vf(cache_elems), qf(q_elems);
#pragma omp parallel for
  for (long long i = 0; i < (long long)cache_elems; ++i) {
    kf[i] = from_bits(hk[i], dt);
    vf[i] = from_bits(hv[i], dt);
  }
  for (size_t i = 0; i < q_elems; ++i) qf[i] = from_bits(hq_[i], dt);
  const float scale = c.scale != 0.f ? c.scale : 1.f / std::sqrt(float(D));
  const int group = c.hq / c.hkv;
  std::vector<double> ref(q_elems), ref_lse(lse_elems);
  std::vector<int> visible_of(size_t(Tq) * c.hq);
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int s = 0; s < S; ++s)
    for (int h = 0; h < c.hq; ++h) {
      const int ctx = c.ctx_lens[s], ql = c.q_lens[s];
      std::vector<double> sc(std::max(ctx, 1)), acc(D);
      for (int i = 0; i < ql; ++i) {
        const int t = cq[s] + i;
        int vis = ctx;
        if (c.causal) vis = std::min(ctx, std::max(0, ctx - ql + i + 1));
        visible_of[size_t(t) * c.hq + h] = vis;
        double mx = -INFINITY;
        for (int j = 0; j < vis; ++j) {
          double dot = 0;
          const size_t ko = slot(s, j) + size_t(h / group) * D;
          for (int d = 0; d < D; ++d)
            dot += double(qf[(size_t(t) * c.hq + h) * D + d]) * kf[ko + d];
          sc[j] = dot * scale;
          mx = std::max(mx, sc[j]);
        }
        double l = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int j = 0; j < vis; ++j) {
          const double pj = std::exp(sc[j] - mx);
          l += pj;
          const size_t vo = slot(s, j) + size_t(h / group) * D;
          for (int d = 0; d < D; ++d) acc[d] += pj * vf[vo + d];
        }
        for (int d = 0; d < D; ++d) ref[(size_t(t) * c.hq + h) * D + d] = vis ? acc[d] / l : 0.0;
        ref_lse[size_t(t) * c.hq + h] = vis ? mx + std::log(l) : -INFINITY;
      }
    }

  uint16_t *dq, *dk, *dv, *dout;
  float* dlse;
  int32_t *dcq, *dtable, *dctx;
  CHECK_CUDA(cudaMalloc(&dq, std::max<size_t>(q_elems, 8) * 2));
  CHECK_CUDA(cudaMalloc(&dk, cache_elems * 2));
  CHECK_CUDA(cudaMalloc(&dv, cache_elems * 2));
  CHECK_CUDA(cudaMalloc(&dout, std::max<size_t>(o_elems, 8) * 2));
  CHECK_CUDA(cudaMalloc(&dlse, std::max<size_t>(lse_elems, 1) * 4));
  CHECK_CUDA(cudaMalloc(&dcq, (S + 1) * 4));
  CHECK_CUDA(cudaMalloc(&dtable, std::max<size_t>(table.size(), 1) * 4));
  CHECK_CUDA(cudaMalloc(&dctx, std::max(S, 1) * 4));
  CHECK_CUDA(cudaMemcpy(dq, hq_.data(), q_elems * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dk, hk.data(), cache_elems * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dv, hv.data(), cache_elems * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dcq, cq.data(), (S + 1) * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dtable, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dctx, c.ctx_lens.data(), S * 4, cudaMemcpyHostToDevice));
  int dev = 0, num_sms = 0;
  CHECK_CUDA(cudaGetDevice(&dev));
  CHECK_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev));

  PrefillParams p{};
  p.q = dq; p.k = dk; p.v = dv; p.o = dout; p.lse = dlse;
  p.q_row_stride = int64_t(c.hq) * D; p.q_head_stride = D;
  p.k_block_stride = p.v_block_stride = int64_t(bs) * tok_elems;
  p.k_row_stride = p.v_row_stride = tok_elems;
  p.k_head_stride = p.v_head_stride = D;
  p.o_row_stride = o_row; p.o_head_stride = o_head;
  p.lse_row_stride = c.hq; p.lse_head_stride = 1; p.lse_batch_stride = 0;
  p.cu_seqlens_q = dcq; p.block_tables = dtable; p.context_lens = dctx;
  p.block_table_stride = max_blocks; p.block_size = bs; p.max_blocks = max_blocks;
  p.batch = S; p.num_q_heads = c.hq; p.num_kv_heads = c.hkv; p.head_dim = D;
  p.max_seqlen_q = max_q; p.max_seqlen_k = max_blocks * bs;
  // Extents of the sm_90 TMA maps, as the binding sets them: the dispatch may take the paged TMA kernel.
  p.total_q = Tq; p.num_blocks = num_blocks;
  p.scale = scale; p.causal = c.causal; p.dtype = dt; p.num_sms = num_sms;

  const double atol = dt == DType::kBFloat16 ? 1e-2 : 1.5e-3;
  const double rtol = dt == DType::kBFloat16 ? 2e-2 : 4e-3;
  int failures = 0;
  std::vector<uint16_t> hout(o_elems);
  std::vector<float> hlse(lse_elems);
  for (const Variant& var : kVariants) {
    if (var.needs_sm90 && !g_is_sm90) continue;
    if (!filter.empty() && std::string(var.name).find(filter) == std::string::npos) continue;
    CHECK_CUDA(cudaMemset(dout, 0xFF, std::max<size_t>(o_elems, 8) * 2));
    CHECK_CUDA(cudaMemset(dlse, 0xFF, std::max<size_t>(lse_elems, 1) * 4));
    // launch_prefill_paged zeroes the batch strides; the forced variants read them as given (0).
    CHECK_CUDA(var.fn(p, 0));
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemcpy(hout.data(), dout, o_elems * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(hlse.data(), dlse, lse_elems * 4, cudaMemcpyDeviceToHost));
    double max_err = 0, max_lse_err = 0;
    long long bad = 0, bad_zero = 0, nan_count = 0, bad_lse = 0, bad_pad = 0;
    for (int t = 0; t < Tq; ++t)
      for (int h = 0; h < c.hq; ++h) {
        const int vis = visible_of[size_t(t) * c.hq + h];
        const size_t oo = size_t(t) * o_row + size_t(h) * o_head;
        for (int d = 0; d < D; ++d) {
          const float got = from_bits(hout[oo + d], dt);
          if (std::isnan(got)) { ++nan_count; continue; }
          if (vis == 0) { bad_zero += got != 0.f || std::signbit(got); continue; }
          const double r = ref[(size_t(t) * c.hq + h) * D + d];
          const double err = std::fabs(double(got) - r);
          max_err = std::max(max_err, err);
          bad += err > atol + rtol * std::fabs(r);
        }
        for (int d = D; d < D + o_pad; ++d) bad_pad += hout[oo + d] != 0xFFFF;
        const float gl = hlse[size_t(t) * c.hq + h];
        const double rl = ref_lse[size_t(t) * c.hq + h];
        if (vis == 0) {
          bad_lse += !(std::isinf(gl) && gl < 0);
        } else {
          const double e = std::fabs(double(gl) - rl);
          if (!(e <= 2e-3 + 1e-4 * std::fabs(rl))) ++bad_lse;
          if (std::isfinite(e)) max_lse_err = std::max(max_lse_err, e);
        }
      }
    const bool ok = !bad && !bad_zero && !nan_count && !bad_lse && !bad_pad;
    std::printf("%-4s %-11s %-58s err=%.2e lse_err=%.2e bad=%lld zero=%lld nan=%lld lse=%lld pad=%lld\n",
                ok ? "PASS" : "FAIL", var.name, c.name.c_str(), max_err, max_lse_err, bad, bad_zero, nan_count,
                bad_lse, bad_pad);
    std::fflush(stdout);
    failures += !ok;
  }
  cudaFree(dq); cudaFree(dk); cudaFree(dv); cudaFree(dout); cudaFree(dlse);
  cudaFree(dcq); cudaFree(dtable); cudaFree(dctx);
  return failures;
}

static std::string dname(DType d) { return d == DType::kBFloat16 ? "bf16" : "fp16"; }

static std::vector<Case> check_cases() {
  const DType bf = DType::kBFloat16, fp = DType::kFloat16;
  std::vector<Case> cs;
  // q_len mixes over cached prefixes: decode rows, speculative runs, long chunks,
  // empty sequences, a sequence whose q_len exceeds its context (rows with no key),
  // a context of 0, contexts at page and tile boundaries.
  const std::vector<int> mix_q = {0, 1, 4, 97, 1023, 1, 4, 0, 97, 33, 5};
  const std::vector<int> mix_c = {64, 1, 260, 97, 1023 + 700, 4097, 4, 0, 50, 33 + 256, 0};
  for (int bs : {1, 16, 64, 256})
    for (DType dt : {bf, fp})
      for (bool causal : {true, false}) {
        const int D = (bs == 16 || bs == 256) ? 128 : 64;
        const int hq = dt == bf ? 16 : 8, hkv = dt == bf ? 8 : 1;  // GQA 2, 8
        cs.push_back({"mix " + dname(dt) + " D" + std::to_string(D) + " bs" + std::to_string(bs) +
                          (causal ? " causal" : " noncausal") + " Hq" + std::to_string(hq) + "/" + std::to_string(hkv),
                      dt, hq, hkv, D, bs, causal, mix_q, mix_c, 0.f});
      }
  // Every residue of (context_len - q_len) mod 128 (covers BLOCK_N 64 and 128),
  // for a short run (q_len 5) and a chunk that spans tiles (q_len 70).
  for (int ql : {5, 70}) {
    std::vector<int> q, c;
    for (int r = 0; r < 128; ++r) {
      q.push_back(ql);
      c.push_back(ql + r + (r % 3) * 128);
    }
    for (int bs : {1, 16, 128}) {
      cs.push_back({"residues q" + std::to_string(ql) + " bf16 D128 bs" + std::to_string(bs) + " MHA", bf, 4, 4, 128,
                    bs, true, q, c, 0.f});
    }
    cs.push_back({"residues q" + std::to_string(ql) + " fp16 D64 bs32 gqa8", fp, 8, 1, 64, 32, true, q, c, 0.f});
  }
  // Speculative-length batches (max_seqlen_q <= 16: the dispatcher packs GQA groups).
  cs.push_back({"spec bf16 D128 bs16 gqa2", bf, 16, 8, 128, 16, true, {4, 1, 16, 0, 7, 3}, {4100, 1, 300, 9, 64, 2}, 0.f});
  cs.push_back({"spec fp16 D128 bs1 gqa8", fp, 32, 4, 128, 1, true, {8, 2, 5}, {1000, 2, 64}, 0.f});
  cs.push_back({"spec bf16 D64 bs256 gqa4 noncausal", bf, 8, 2, 64, 256, false, {3, 16}, {700, 16}, 0.f});
  cs.push_back({"spec fp16 D64 bs64 gqa3 q>ctx", fp, 6, 2, 64, 64, true, {12, 6}, {5, 129}, 0.f});
  // Other page sizes, GQA 1, odd scales, q_len > context.
  cs.push_back({"bs2 fp16 D128 gqa1 causal", fp, 3, 3, 128, 2, true, {17, 1, 300, 2}, {17, 900, 301, 1}, 0.f});
  cs.push_back({"bs8 bf16 D64 gqa2 scale=0.05", bf, 4, 2, 64, 8, true, {130, 7}, {500, 7}, 0.05f});
  cs.push_back({"bs128 bf16 D128 gqa8 noncausal scale=2", bf, 8, 1, 128, 128, false, {64, 129}, {129, 64}, 2.f});
  cs.push_back({"bs4 fp16 D64 q>ctx causal", fp, 2, 1, 64, 4, true, {200, 300, 0}, {130, 0, 5}, 0.f});
  cs.push_back({"bs16 bf16 D128 long chunk", bf, 16, 8, 128, 16, true, {2048, 1}, {2048 + 3000, 3001}, 0.f});
  return cs;
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "check";
  const std::string filter = argc > 2 ? argv[2] : "";
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  g_is_sm90 = prop.major == 9 && prop.minor == 0;
  std::printf("device: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  int failures = 0, cases = 0;
  if (mode == "check") {
    {  // the kernels track the max of raw scores: the launcher admits a positive scale only
      static int32_t dummy[2] = {0, 0};  // never read: the launcher returns first
      PrefillParams bad{};
      bad.cu_seqlens_q = bad.block_tables = bad.context_lens = dummy;
      bad.num_q_heads = bad.num_kv_heads = bad.batch = 1;
      bad.head_dim = 64;
      bad.block_size = 16;
      for (const float sc : {-0.3f, 0.f}) {
        bad.scale = sc;
        const bool ok = minipaged::launch_prefill_paged(bad, nullptr) == cudaErrorInvalidValue;
        std::printf("%s  scale=%g rejected by launch_prefill_paged\n", ok ? "PASS" : "FAIL", sc);
        failures += !ok, ++cases;
      }
    }
    for (const Case& c : check_cases()) failures += run_case(c, filter), ++cases;
  } else if (mode == "small") {
    const DType bf = DType::kBFloat16, fp = DType::kFloat16;
    const std::vector<Case> small = {
        {"small bf16 D128 bs16 causal", bf, 4, 2, 128, 16, true, {0, 1, 4, 70}, {5, 1, 67, 150}, 0.f},
        {"small fp16 D64 bs1 noncausal", fp, 2, 1, 64, 1, false, {3, 65, 0}, {70, 65, 0}, 0.f},
        {"small bf16 D64 bs256 causal q>ctx", bf, 2, 2, 64, 256, true, {90, 2}, {30, 300}, 0.f},
        {"small spec fp16 D128 bs16 gqa4", fp, 8, 2, 128, 16, true, {4, 1, 0, 9}, {70, 1, 3, 5}, 0.f},
    };
    for (const Case& c : small) failures += run_case(c, filter), ++cases;
  } else {
    std::fprintf(stderr, "usage: %s check|small [variant filter]\n", argv[0]);
    return 2;
  }
  std::printf("%s (%d failures over %d cases)\n", failures == 0 ? "ALL PASS" : "SOME FAILED", failures, cases);
  return failures == 0 ? 0 : 1;
}
