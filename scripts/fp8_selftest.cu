// Torch-free self test of the `cuda` kernels on FP8 (float8_e4m3fn) KV caches:
// write_kv_cache quantisation, decode (scalar and tensor-core kernels, split
// and unsplit) and paged attention (GQA-packed and plain blocks).
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fopenmp \
//        -DMINIPAGED_ENABLE_SM90A -I src/minipaged/cuda/csrc scripts/fp8_selftest.cu \
//        src/minipaged/cuda/csrc/prefill/paged*.cu src/minipaged/cuda/csrc/decode/launch.cu \
//        src/minipaged/cuda/csrc/decode/kernels_*.cu src/minipaged/cuda/csrc/cache/write_kv.cu \
//        -o fp8_selftest -lgomp
//   ./fp8_selftest check    every case
//   ./fp8_selftest small    a few tiny cases (for compute-sanitizer)
//
// The cache is written by the CUDA quantiser from random K/V with per-head
// scales and its bytes compared with the host's software quantiser (ptx/fp8.cuh,
// checked against torch's cast on every fp32 input), so on sm_89+ the cvt
// instruction path is compared with the software one. Unused cache slots hold
// NaN bytes, unused table entries -1, outputs are poisoned with NaN (padded
// head rows must stay NaN), and attention is compared with an fp64 reference
// on the exactly dequantised cache. Exit status 0 only if every check passed.
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
#include <vector>

#include "params.h"
#include "ptx/fp8.cuh"
#include "selftest_common.h"

using minipaged::DType;

struct Case {
  const char* name;
  DType dtype;
  int hq, hkv, d, block_size;
  bool causal;
  std::vector<int> q_lens, ctx_lens;  // all q_lens 1: also run as decode
};

static int run_case(const Case& c) {
  const DType dt = c.dtype;
  const int D = c.d, bs = c.block_size, S = int(c.q_lens.size()), H = c.hkv;
  std::vector<int> cq(S + 1, 0);
  for (int s = 0; s < S; ++s) cq[s + 1] = cq[s] + c.q_lens[s];
  const int Tq = cq[S];
  const int max_q = S ? *std::max_element(c.q_lens.begin(), c.q_lens.end()) : 0;
  std::mt19937 rng(31 + D + c.hq * 5 + Tq + bs);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.5f, 2.f);

  std::vector<int> nblk(S);
  int used = 0, max_blocks = 1, tokens = 0;
  for (int s = 0; s < S; ++s) {
    nblk[s] = (c.ctx_lens[s] + bs - 1) / bs;
    used += nblk[s];
    tokens += c.ctx_lens[s];
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
  auto slot_of = [&](int s, int j) { return int64_t(table[size_t(s) * max_blocks + j / bs]) * bs + j % bs; };

  // New K/V rows (q's dtype) with per-head magnitudes, their slots, and scales near each head's range.
  std::vector<float> amp_k(H), amp_v(H), ks(H), vs(H);
  for (int h = 0; h < H; ++h) {
    amp_k[h] = ud(rng), amp_v[h] = ud(rng) * 2;
    ks[h] = amp_k[h] * 4 / 448 * ud(rng), vs[h] = amp_v[h] * 4 / 448 * ud(rng);
  }
  const size_t row = size_t(H) * D;
  std::vector<uint16_t> hk(std::max(tokens, 1) * row), hv(std::max(tokens, 1) * row);
  std::vector<int64_t> slots(std::max(tokens, 1));
  {
    int t = 0;
    for (int s = 0; s < S; ++s)
      for (int j = 0; j < c.ctx_lens[s]; ++j, ++t) {
        slots[t] = slot_of(s, j);
        for (int h = 0; h < H; ++h)
          for (int d = 0; d < D; ++d) {
            hk[t * row + h * D + d] = to_bits(nd(rng) * amp_k[h], dt);
            hv[t * row + h * D + d] = to_bits(nd(rng) * amp_v[h], dt);
          }
      }
  }
  const size_t cache_bytes = size_t(num_blocks) * bs * row;
  uint8_t *dkc, *dvc;
  uint16_t *dk, *dv, *dq, *dout;
  float *dks, *dvs, *dlse, *dpart;
  int64_t* dslots;
  int32_t *dcq, *dtable, *dctx;
  CHECK_CUDA(cudaMalloc(&dkc, cache_bytes));
  CHECK_CUDA(cudaMalloc(&dvc, cache_bytes));
  CHECK_CUDA(cudaMemset(dkc, 0x7f, cache_bytes));  // NaN bytes in every slot not written
  CHECK_CUDA(cudaMemset(dvc, 0xff, cache_bytes));
  CHECK_CUDA(cudaMalloc(&dk, hk.size() * 2));
  CHECK_CUDA(cudaMalloc(&dv, hv.size() * 2));
  CHECK_CUDA(cudaMalloc(&dslots, slots.size() * 8));
  CHECK_CUDA(cudaMalloc(&dks, H * 4));
  CHECK_CUDA(cudaMalloc(&dvs, H * 4));
  CHECK_CUDA(cudaMemcpy(dk, hk.data(), hk.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dv, hv.data(), hv.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dslots, slots.data(), slots.size() * 8, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dks, ks.data(), H * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dvs, vs.data(), H * 4, cudaMemcpyHostToDevice));

  minipaged::WriteKVParams w{};
  w.k = dk, w.v = dv, w.k_cache = dkc, w.v_cache = dvc, w.slot_mapping = dslots, w.slot_is_int64 = true;
  w.k_token_stride = w.v_token_stride = row, w.k_head_stride = w.v_head_stride = D;
  w.kc_block_stride = w.vc_block_stride = int64_t(bs) * row;
  w.kc_token_stride = w.vc_token_stride = row, w.kc_head_stride = w.vc_head_stride = D;
  w.num_slots = int64_t(num_blocks) * bs, w.num_tokens = tokens, w.num_kv_heads = H, w.head_dim = D;
  w.block_size = bs, w.elem_bytes = 2, w.cache_fp8 = true, w.src_dtype = dt, w.k_scale = dks, w.v_scale = dvs;
  CHECK_CUDA(minipaged::launch_write_kv_cache(w, 0));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> kc(cache_bytes), vc(cache_bytes);
  CHECK_CUDA(cudaMemcpy(kc.data(), dkc, cache_bytes, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(vc.data(), dvc, cache_bytes, cudaMemcpyDeviceToHost));
  int failures = 0;
  long bad_bytes = 0;
  for (int t = 0; t < tokens; ++t)
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < D; ++d) {
        const size_t src = t * row + h * D + d, dst = size_t(slots[t]) * row + h * D + d;
        bad_bytes += kc[dst] != minipaged::fp8_e4m3_from_float_soft(from_bits(hk[src], dt) / ks[h]);
        bad_bytes += vc[dst] != minipaged::fp8_e4m3_from_float_soft(from_bits(hv[src], dt) / vs[h]);
      }
  if (bad_bytes) ++failures;
  std::printf("%s  %-28s write_kv_cache: %ld bytes differ from the software quantiser\n",
              bad_bytes ? "FAIL" : "PASS", c.name, bad_bytes);

  // fp64 reference on the dequantised cache
  const float scale = 1.f / std::sqrt(float(D));
  const int group = c.hq / H;
  std::vector<uint16_t> hq(std::max<size_t>(size_t(Tq) * c.hq * D, 8));
  for (auto& x : hq) x = to_bits(nd(rng), dt);
  std::vector<double> ref(size_t(Tq) * c.hq * D), ref_lse(size_t(Tq) * c.hq);
  double ref_max = 1.0;
#pragma omp parallel for collapse(2) schedule(dynamic) reduction(max : ref_max)
  for (int s = 0; s < S; ++s)
    for (int hh = 0; hh < c.hq; ++hh) {
      const int ctx = c.ctx_lens[s], ql = c.q_lens[s], kvh = hh / group;
      std::vector<double> sc(std::max(ctx, 1)), acc(D);
      for (int i = 0; i < ql; ++i) {
        const int t = cq[s] + i;
        const int vis = c.causal ? std::min(ctx, std::max(0, ctx - ql + i + 1)) : ctx;
        double mx = -INFINITY;
        for (int j = 0; j < vis; ++j) {
          double dot = 0;
          const size_t ko = size_t(slot_of(s, j)) * row + size_t(kvh) * D;
          for (int d = 0; d < D; ++d)
            dot += double(from_bits(hq[(size_t(t) * c.hq + hh) * D + d], dt)) * e4m3_to_double(kc[ko + d]) * ks[kvh];
          sc[j] = dot * scale;
          mx = std::max(mx, sc[j]);
        }
        double l = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int j = 0; j < vis; ++j) {
          const double pj = std::exp(sc[j] - mx);
          l += pj;
          const size_t vo = size_t(slot_of(s, j)) * row + size_t(kvh) * D;
          for (int d = 0; d < D; ++d) acc[d] += pj * e4m3_to_double(vc[vo + d]) * vs[kvh];
        }
        for (int d = 0; d < D; ++d) {
          const double r = vis ? acc[d] / l : 0.0;
          ref[(size_t(t) * c.hq + hh) * D + d] = r;
          ref_max = std::max(ref_max, std::fabs(r));
        }
        ref_lse[size_t(t) * c.hq + hh] = vis ? mx + std::log(l) : -INFINITY;
      }
    }

  const int o_pad = 16;  // after each output head row; must stay NaN
  const int64_t o_head = D + o_pad, o_row = int64_t(c.hq) * o_head;
  const size_t o_elems = std::max<size_t>(size_t(Tq) * o_row, 8), lse_elems = std::max<size_t>(size_t(Tq) * c.hq, 1);
  CHECK_CUDA(cudaMalloc(&dq, hq.size() * 2));
  CHECK_CUDA(cudaMalloc(&dout, o_elems * 2));
  CHECK_CUDA(cudaMalloc(&dlse, lse_elems * 4));
  CHECK_CUDA(cudaMalloc(&dcq, (S + 1) * 4));
  CHECK_CUDA(cudaMalloc(&dtable, table.size() * 4));
  CHECK_CUDA(cudaMalloc(&dctx, std::max(S, 1) * 4));
  CHECK_CUDA(cudaMemcpy(dq, hq.data(), hq.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dcq, cq.data(), (S + 1) * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dtable, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dctx, c.ctx_lens.data(), S * 4, cudaMemcpyHostToDevice));
  int dev = 0, num_sms = 0, cc = 0;
  CHECK_CUDA(cudaGetDevice(&dev));
  CHECK_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev));
  CHECK_CUDA(cudaDeviceGetAttribute(&cc, cudaDevAttrComputeCapabilityMajor, dev));

  const double atol = (dt == DType::kBFloat16 ? 1.5e-2 : 3e-3) * ref_max;
  const double rtol = dt == DType::kBFloat16 ? 2e-2 : 5e-3;
  std::vector<uint16_t> hout(o_elems);
  std::vector<float> hlse(lse_elems);
  auto compare = [&](const char* what) {
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemcpy(hout.data(), dout, o_elems * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(hlse.data(), dlse, lse_elems * 4, cudaMemcpyDeviceToHost));
    double max_err = 0, max_lse_err = 0;
    long bad = 0;
    for (int t = 0; t < Tq; ++t)
      for (int hh = 0; hh < c.hq; ++hh) {
        for (int d = 0; d < o_head; ++d) {
          const float got = from_bits(hout[t * o_row + hh * o_head + d], dt);
          if (d >= D) {
            bad += !std::isnan(got);  // padding written
            continue;
          }
          const double r = ref[(size_t(t) * c.hq + hh) * D + d];
          const double err = std::fabs(double(got) - r);
          if (!(err <= atol + rtol * std::fabs(r))) ++bad;
          if (std::isfinite(err)) max_err = std::max(max_err, err);
        }
        const double rl = ref_lse[size_t(t) * c.hq + hh], gl = hlse[size_t(t) * c.hq + hh];
        if (std::isinf(rl)) {
          bad += !(std::isinf(gl) && gl < 0);
        } else {
          const double e = std::fabs(gl - rl);
          bad += !(e <= 2e-3 * (1 + std::fabs(rl)));
          if (std::isfinite(e)) max_lse_err = std::max(max_lse_err, e);
        }
      }
    failures += bad != 0;
    std::printf("%s  %-28s %-22s max err %.3e (ref max %.2f)  lse err %.3e  %ld bad\n", bad ? "FAIL" : "PASS",
                c.name, what, max_err, ref_max, max_lse_err, bad);
  };

  minipaged::PrefillParams p{};
  p.q = dq, p.k = dkc, p.v = dvc, p.o = dout, p.lse = dlse;
  p.q_row_stride = int64_t(c.hq) * D, p.q_head_stride = D;
  p.k_block_stride = p.v_block_stride = int64_t(bs) * row;
  p.k_row_stride = p.v_row_stride = row, p.k_head_stride = p.v_head_stride = D;
  p.o_row_stride = o_row, p.o_head_stride = o_head;
  p.lse_row_stride = c.hq, p.lse_head_stride = 1;
  p.cu_seqlens_q = dcq, p.block_tables = dtable, p.context_lens = dctx;
  p.block_table_stride = max_blocks, p.block_size = bs, p.max_blocks = max_blocks;
  p.batch = S, p.num_q_heads = c.hq, p.num_kv_heads = H, p.head_dim = D, p.max_seqlen_q = max_q;
  p.scale = scale, p.causal = c.causal, p.dtype = dt, p.num_sms = num_sms;
  p.kv_fp8 = true, p.k_scale = dks, p.v_scale = dvs;
  for (int variant : {1, 2}) {
    p.variant = variant;
    CHECK_CUDA(cudaMemset(dout, 0xFF, o_elems * 2));
    CHECK_CUDA(cudaMemset(dlse, 0xFF, lse_elems * 4));
    CHECK_CUDA(minipaged::launch_prefill_paged(p, 0));
    compare(variant == 1 ? "paged (plain block)" : "paged (GQA-packed)");
  }

  if (max_q == 1 && Tq == S) {
    minipaged::DecodeParams q{};
    q.q = dq, q.k_cache = dkc, q.v_cache = dvc, q.o = dout, q.block_tables = dtable, q.context_lens = dctx;
    q.lse = dlse, q.lse_batch_stride = c.hq;
    q.q_batch_stride = int64_t(c.hq) * D, q.q_head_stride = D, q.o_batch_stride = o_row, q.o_head_stride = o_head;
    q.k_block_stride = q.v_block_stride = int64_t(bs) * row;
    q.k_token_stride = q.v_token_stride = row, q.k_head_stride = q.v_head_stride = D;
    q.block_table_stride = max_blocks, q.batch = S, q.num_q_heads = c.hq, q.num_kv_heads = H, q.head_dim = D;
    q.block_size = bs, q.max_blocks = max_blocks, q.scale = scale, q.dtype = dt, q.num_sms = num_sms;
    q.cc_major = cc, q.kv_fp8 = true, q.k_scale = dks, q.v_scale = dvs;
    for (int variant : {0, 10, 12})
      for (int splits : {0, 1, 5}) {
        q.variant = variant;
        const minipaged::DecodePlan plan = minipaged::decode_plan(q, splits);
        CHECK_CUDA(cudaMalloc(&dpart, std::max<int64_t>(minipaged::decode_workspace_floats(q), 1) * 4));
        minipaged::decode_set_workspace(q, dpart);
        CHECK_CUDA(cudaMemset(dout, 0xFF, o_elems * 2));
        CHECK_CUDA(cudaMemset(dlse, 0xFF, lse_elems * 4));
        CHECK_CUDA(minipaged::launch_decode(q, plan, 0));
        char what[64];
        std::snprintf(what, sizeof what, "decode v%d splits %d", variant, q.num_splits);
        compare(what);
        CHECK_CUDA(cudaDeviceSynchronize());
        CHECK_CUDA(cudaFree(dpart));
      }
  }
  for (void* ptr : {(void*)dkc, (void*)dvc, (void*)dk, (void*)dv, (void*)dslots, (void*)dks, (void*)dvs, (void*)dq,
                    (void*)dout, (void*)dlse, (void*)dcq, (void*)dtable, (void*)dctx})
    CHECK_CUDA(cudaFree(ptr));
  return failures;
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "check";
  const DType f16 = DType::kFloat16, b16 = DType::kBFloat16;
  std::vector<Case> cases;
  if (mode == "small") {
    cases = {{"small decode H4/2 D64 p16", f16, 4, 2, 64, 16, true, {1, 1, 1}, {17, 0, 70}},
             {"small decode H8/1 D128 p1", b16, 8, 1, 128, 1, true, {1, 1}, {33, 5}},
             {"small paged H4/2 D128 p16", f16, 4, 2, 128, 16, true, {1, 4, 17, 0}, {20, 9, 30, 3}}};
  } else if (mode == "check") {
    for (DType dt : {f16, b16})
      for (int D : {64, 128})
        for (auto hh : {std::pair<int, int>{8, 8}, {8, 4}, {8, 2}, {16, 2}})
          for (int bs : {1, 16, 256}) {
            const bool bf = dt == b16;
            cases.push_back({bf ? "decode bf16" : "decode fp16", dt, hh.first, hh.second, D, bs, true,
                             {1, 1, 1, 1, 1, 1}, {0, 1, 17, 97, 1023, 4097}});
            cases.push_back({bf ? "paged bf16" : "paged fp16", dt, hh.first, hh.second, D, bs, bs != 16,
                             {1, 2, 3, 8, 0, 97, 300, 5}, {17, 2, 1023, 64, 5, 1023, 300, 3}});
          }
  } else {
    std::fprintf(stderr, "usage: %s check|small\n", argv[0]);
    return 2;
  }
  int failures = 0;
  for (const Case& c : cases) {
    std::printf("-- %s H%d/%d D%d page %d %s\n", c.name, c.hq, c.hkv, c.d, c.block_size,
                c.causal ? "causal" : "not causal");
    failures += run_case(c);
  }
  std::printf("%s: %d failing checks\n", failures ? "FAILED" : "ALL PASSED", failures);
  return failures ? 1 : 0;
}
