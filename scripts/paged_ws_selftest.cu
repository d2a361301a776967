// Torch-free self test and timing of paged attention through the sm_90a
// warp-specialised TMA kernel (prefill/mainloop_ws.cuh, WsCfg kPaged: K/V pages
// loaded as TMA boxes through the block table) and of the mixed-batch split
// (launch_paged_split, prefill/dispatch.cuh: the GQA-packed kernel for
// q_len <= kPackMaxSeqlenQ, the tiled kernel for longer rows, one stream).
//
//   nvcc -std=c++17 -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a -DMINIPAGED_ENABLE_SM90A \
//        -Xptxas -v -Xcompiler -fopenmp -I src/minipaged/cuda/csrc scripts/paged_ws_selftest.cu \
//        src/minipaged/cuda/csrc/prefill/paged*.cu -o /tmp/paged_ws_selftest -lgomp
//   (or add -DPAGED_WS_WITH_DECODE src/minipaged/cuda/csrc/decode/launch.cu and
//   src/minipaged/cuda/csrc/decode/kernels_*.cu: the decode kernels
//   then come from that translation unit instead of being compiled into this one)
//   ./paged_ws_selftest check [variant filter]   every case, every variant, vs fp64
//   ./paged_ws_selftest small                    tiny cases (for compute-sanitizer)
//   ./paged_ws_selftest time [reps]              TFLOP/s of the chunked-prefill shapes and the
//                                                mixed batch (one call vs chunk + decodes alone)
//   ./paged_ws_selftest time8 [reps]             ws_fp8 against the 16-bit TMA kernel, bf16 and fp16,
//                                                then its fp8 checks (small and a reduced timed shape)
//   ./paged_ws_selftest time1w [reps]            one-wave causal chunks: ws against ws_mirror (mirrored
//                                                64-row block pairs) and the dense kernels; ws_fp8 against
//                                                ws_fp8_mirror on FP8 pages of the same K/V
//
// Variants: dispatch (what the extension runs for a default call: the decode
// routing's launch_prefill_paged + decode pair, or launch_prefill_paged alone
// where the default does not route), dispatch_new (variant 3: the unrouted
// paths), ws (the
// paged TMA kernel forced for every sequence, decode rows included: pages of
// >= 8 tokens, 16-bit caches), ws_mirror (the same with mirrored 64-row block
// pairs, WsCfg::kMirror; the dispatch's choice for causal work lists of at most one wave), split_ws (the two-launch split forced with the
// TMA kernel as the tiled half), routed / routed_s1 / routed_s3 (the decode
// routing, PrefillParams variant 4: q_len == 1 rows through the decode kernels
// with the split heuristic / one split / three splits, the rest through
// launch_prefill_paged; every case, FP8 and page size 1 included), and
// rt_vs_dec (the routed decode rows bitwise equal to a plain decode call on
// those sequences). FP8 caches run through dispatch and routed (split the same
// way: the TMA kernel for chunks over pages of >= 8 tokens, else the mma.sync FP8
// kernels) and, with pages of >= 8 tokens, ws_fp8 (the TMA kernel over e4m3 pages,
// widened in shared memory, forced).
// Every case builds shuffled pages, poisons every unused cache slot with NaN
// (also the slots of a sequence's last page past its context) and every table
// entry past the used ones with -1, poisons the output (padded head rows
// must stay NaN) and the lse, and compares with a double-precision host
// reference on the same 16-bit / fp8 inputs: the output elementwise
// (|err| <= atol + rtol |ref|), lse to 2e-3 (+1e-4 relative); rows that see
// no key must be exact zeros with lse -inf. The dispatch variant also runs
// twice and must be bitwise identical. Exit status 0 only if all passed.
#include <cuda.h>
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
// The decode kernels, which the routed variants need: compiled into this
// translation unit unless the build links decode/launch.cu and decode/kernels_*.cu itself
// (-DPAGED_WS_WITH_DECODE).
#if !defined(PAGED_WS_WITH_DECODE)
#define MINIPAGED_DECODE_KERNELS_IN_ONE_TU 1
#include "decode/launch.cu"
#include "decode/kernels_all.cuh"
#endif

using minipaged::DType;
using minipaged::PrefillParams;
namespace mf = minipaged::fast;
using LaunchFn = cudaError_t (*)(const PrefillParams&, cudaStream_t);

// ---------------------------------------------------------------- forced kernels
// Launch<T, D, kCausal>::run for p's dtype, head dim and mask: the runtime flags of a case turned
// into the template arguments of one forced kernel.
template <template <typename, int, bool> class Launch>
static cudaError_t forced(const PrefillParams& p, cudaStream_t s) {
  auto dim = [&](auto t) {
    using T = decltype(t);
    if (p.head_dim == 128) return p.causal ? Launch<T, 128, true>::run(p, s) : Launch<T, 128, false>::run(p, s);
    return p.causal ? Launch<T, 64, true>::run(p, s) : Launch<T, 64, false>::run(p, s);
  };
  return p.dtype == DType::kBFloat16 ? dim(__nv_bfloat16{}) : dim(__half{});
}
// The paged TMA kernel in config Cfg<T, D>, as a Launch for forced<>.
template <template <typename, int> class Cfg>
struct WsPaged {
  template <typename T, int D, bool kCausal>
  struct Launch {
    static cudaError_t run(const PrefillParams& p, cudaStream_t s) {
      return mf::launch_prefill_ws_paged<Cfg<T, D>, kCausal>(p, s);
    }
  };
};
// The paged kernel with the dense kernel's panel layout of K/V tiles (one box per page and
// column block): the layout before the interleaved one (WsCfg::kKvInterleave), for the A/B.
template <typename T, int D>
using CfgWsPagedPanels = mf::WsCfg<T, D, 128, 2, true, true, true, true, false, false, false, true, false>;
template <typename T, int D, bool kCausal>
struct PackLaunch {
  static cudaError_t run(const PrefillParams& p, cudaStream_t s) {
    return mf::launch_prefill_cfg<mf::CfgPack<T, D>, kCausal, true, true>(p, s);
  }
};
// The paged kernel with a 3-stage K/V ring (224 KB of shared memory): whether one more tile in
// flight hides the per-box TMA latency of small pages.
template <typename T, int D>
using CfgWsPaged3 = mf::WsCfg<T, D, 128, 3, true, true, true, true, false, false, false, true>;
// The dispatch's own configs, all in prefill/dispatch.cuh: CfgWsPaged, CfgWsPagedMirror (causal
// work lists of at most one wave), CfgWsPaged8 (FP8 pages: e4m3 staged by TMA, widened to 16 bits
// in shared memory by producer warps 1-3) and CfgWsPaged8Mirror (its one-wave twin).
static cudaError_t ws_paged(const PrefillParams& p, cudaStream_t s) { return forced<WsPaged<mf::CfgWsPaged>::Launch>(p, s); }
static cudaError_t ws_mirror(const PrefillParams& p, cudaStream_t s) { return forced<WsPaged<mf::CfgWsPagedMirror>::Launch>(p, s); }
static cudaError_t ws_fp8(const PrefillParams& p, cudaStream_t s) { return forced<WsPaged<mf::CfgWsPaged8>::Launch>(p, s); }
static cudaError_t ws_fp8_mirror(const PrefillParams& p, cudaStream_t s) { return forced<WsPaged<mf::CfgWsPaged8Mirror>::Launch>(p, s); }
static cudaError_t ws_paged3(const PrefillParams& p, cudaStream_t s) { return forced<WsPaged<CfgWsPaged3>::Launch>(p, s); }
static cudaError_t ws_panels(const PrefillParams& p, cudaStream_t s) { return forced<WsPaged<CfgWsPagedPanels>::Launch>(p, s); }
static cudaError_t pack_paged(const PrefillParams& p, cudaStream_t s) { return forced<PackLaunch>(p, s); }
static cudaError_t split_ws(const PrefillParams& p, cudaStream_t s) {
  return mf::launch_paged_split(p, [&](const PrefillParams& q) { return pack_paged(q, s); },
                                [&](const PrefillParams& q) { return ws_paged(q, s); });
}
// The one-warpgroup-pair cp.async wgmma kernel: what the paged dispatch ran for long chunks before.
template <typename T, int D>
static cudaError_t wgmma_old(const PrefillParams& p, cudaStream_t s) {
  return mf::launch_prefill_wgmma_cfg<mf::CfgWgmmaLarge<T, D>, true, true>(p, s);
}
// The one-warpgroup cp.async wgmma kernel: what the paged dispatch ran below half a wave before the pairs.
template <typename T, int D>
static cudaError_t wgmma_small(const PrefillParams& p, cudaStream_t s) {
  return mf::launch_prefill_wgmma_cfg<mf::CfgWgmmaSmall<T, D>, true, true>(p, s);
}
// Dense varlen warp-specialised kernel on contiguous K/V (the timing anchor).
template <typename T, int D>
static cudaError_t ws_dense(const PrefillParams& p, cudaStream_t s) {
  return mf::launch_prefill_ws<mf::CfgWs<T, D>, true>(p, s);
}
// The same with mirrored block pairs (the dense dispatch's choice for causal grids of at most one wave).
template <typename T, int D>
static cudaError_t ws_dense_mirror(const PrefillParams& p, cudaStream_t s) {
  return mf::launch_prefill_ws<mf::CfgWsMirror<T, D>, true>(p, s);
}

// The dispatch with the paths that are off by default until checked here (variant 3).
static cudaError_t dispatch_new(const PrefillParams& p, cudaStream_t s) {
  PrefillParams q = p;
  q.variant = 3;
  return minipaged::launch_prefill_paged(q, s);
}

// The decode routing (on by default; PrefillParams variant 4 forces it): the
// q_len == 1 rows and the short runs through the decode kernels
// (launch_paged_routed_decodes, the sequence binding.cpp runs, with split
// workspaces from the two buffers below), the rest through launch_prefill_paged,
// one stream, no sync. kSplits: the decode split count (0: decode_plan's heuristic).
struct RoutedWorkspace {
  float* buffer[2] = {nullptr, nullptr};  // one per decode launch of a call
  int64_t floats[2] = {0, 0};
  int next = 0;
  // Grows during the warm-up calls only (cudaFree syncs).
  static float* allocate(int64_t n, void* ctx) {
    auto* self = static_cast<RoutedWorkspace*>(ctx);
    const int i = self->next++ % 2;
    if (n > self->floats[i]) {
      if (self->buffer[i]) CHECK_CUDA(cudaFree(self->buffer[i]));
      CHECK_CUDA(cudaMalloc(&self->buffer[i], n * sizeof(float)));
      self->floats[i] = n;
    }
    return self->buffer[i];
  }
};
static RoutedWorkspace g_routed_ws;
static int g_cc_major = 0;
static cudaError_t routed_call(const PrefillParams& p, cudaStream_t s, int splits, bool force = true) {
  PrefillParams q = p;
  if (force) q.variant = mf::kPagedVariantDecodeRouting;
  if (!minipaged::paged_decode_routing(q)) {
    if (force) return cudaErrorInvalidValue;  // every case here must route
    return minipaged::launch_prefill_paged(q, s);
  }
  // binding.cpp's order: the prefill half first (it validates strides and alignment), then the decodes.
  const cudaError_t perr = minipaged::launch_prefill_paged(q, s);
  if (perr != cudaSuccess) return perr;
  g_routed_ws.next = 0;
  return minipaged::launch_paged_routed_decodes(q, g_cc_major, splits, &RoutedWorkspace::allocate, &g_routed_ws, s);
}
template <int kSplits>
static cudaError_t routed(const PrefillParams& p, cudaStream_t s) {
  return routed_call(p, s, kSplits);
}
// What binding.cpp runs for a default call: the routed pair when the default
// routes this batch, launch_prefill_paged alone when it does not.
static cudaError_t dispatch_default(const PrefillParams& p, cudaStream_t s) {
  return routed_call(p, s, 0, /*force=*/false);
}

struct Variant {
  const char* name;
  LaunchFn fn;
  bool needs_tma;  // 16-bit caches with pages of >= 8 tokens
  bool fp8_tma = false;  // FP8 caches with pages of >= 8 tokens only
};
static const Variant kVariants[] = {
    {"dispatch", dispatch_default, false},
    {"dispatch_new", dispatch_new, false},
    {"ws", ws_paged, true},
    {"ws_mirror", ws_mirror, true},
    {"ws_panels", ws_panels, true},
    {"ws3", ws_paged3, true},
    {"split_ws", split_ws, true},
    {"routed", routed<0>, false},     // decode split heuristic
    {"routed_s1", routed<1>, false},  // one split: the decode kernel stores o itself
    {"routed_s3", routed<3>, false},  // three splits, uneven over most contexts
    {"ws_fp8", ws_fp8, false, true},
    {"ws_fp8_mirror", ws_fp8_mirror, false, true},
};

// ---------------------------------------------------------------- host data
// e4m3fn byte -> float (exact): sign, 4-bit exponent (bias 7), 3-bit mantissa.
struct Case {
  std::string name;
  DType dtype;
  int hq, hkv, d, block_size;
  bool causal;
  std::vector<int> q_lens, ctx_lens;
  bool fp8 = false;
  // > 0: query row t is scaled by 2^((t * 7) % (2 q_row_exp + 1) - q_row_exp), so the rows of a
  // warp span 2^(2 q_row_exp) (the f16 MMA path moves each warp's Q rows by one power of two).
  int q_row_exp = 0;
};

static std::string dname(DType d) { return d == DType::kBFloat16 ? "bf16" : "fp16"; }

// Device buffers and the fp64 reference of one case.
struct Built {
  Case c;
  int S = 0, Tq = 0, max_q = 0, max_blocks = 1, num_blocks = 0;
  std::vector<int> cq;
  std::vector<int32_t> table;
  size_t tok_elems = 0, cache_elems = 0, q_elems = 0, o_elems = 0, lse_elems = 0;
  int64_t o_head = 0, o_row = 0;
  std::vector<double> ref, ref_lse;
  std::vector<int> visible;
  void *dk = nullptr, *dv = nullptr;
  uint16_t *dq = nullptr, *dout = nullptr;
  float *dlse = nullptr, *dks = nullptr, *dvs = nullptr;
  int32_t *dcq = nullptr, *dtable = nullptr, *dctx = nullptr;
  bool shuffle_pages = true;  // false: each sequence's pages in pool order (the page-locality A/B)
  PrefillParams p{};
  static constexpr int kOPad = 8;  // elements after each (token, head) output row; must stay NaN

  // with_ref false: inputs only (timing).
  void build(const Case& cs, bool with_ref, unsigned seed) {
    c = cs;
    const DType dt = c.dtype;
    const int D = c.d, bs = c.block_size;
    S = int(c.q_lens.size());
    cq.assign(S + 1, 0);
    for (int s = 0; s < S; ++s) cq[s + 1] = cq[s] + c.q_lens[s];
    Tq = cq[S];
    max_q = S ? *std::max_element(c.q_lens.begin(), c.q_lens.end()) : 0;
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    // Pages from a shuffled pool with spare blocks; table rows padded with -1
    // past what each sequence uses (plus one more column of -1 for everybody).
    std::vector<int> nblk(S);
    int used = 0;
    for (int s = 0; s < S; ++s) {
      nblk[s] = (c.ctx_lens[s] + bs - 1) / bs;
      used += nblk[s];
      max_blocks = std::max(max_blocks, nblk[s] + 1);
    }
    num_blocks = used + 3;
    std::vector<int> perm(num_blocks);
    std::iota(perm.begin(), perm.end(), 0);
    if (shuffle_pages) std::shuffle(perm.begin(), perm.end(), rng);
    table.assign(size_t(S) * max_blocks, -1);
    int nxt = 0;
    for (int s = 0; s < S; ++s)
      for (int b = 0; b < nblk[s]; ++b) table[size_t(s) * max_blocks + b] = perm[nxt++];
    tok_elems = size_t(c.hkv) * D;
    cache_elems = size_t(num_blocks) * bs * tok_elems;
    auto slot = [&](int s, int j) {
      return (size_t(table[size_t(s) * max_blocks + j / bs]) * bs + j % bs) * tok_elems;
    };
    // Widened values for the reference; caches hold NaN wherever unused.
    std::vector<float> kf, vf;
    std::vector<uint16_t> hk16, hv16;
    std::vector<uint8_t> hk8, hv8;
    std::vector<float> ks(c.hkv, 1.f), vs(c.hkv, 1.f);
    if (c.fp8) {
      hk8.assign(cache_elems, 0x7F), hv8.assign(cache_elems, 0x7F);  // 0x7F: e4m3fn NaN
      for (int h = 0; h < c.hkv; ++h) ks[h] = 0.25f + 0.125f * h, vs[h] = 0.5f + 0.0625f * h;
    } else {
      hk16.assign(cache_elems, 0xFFFF), hv16.assign(cache_elems, 0xFFFF);
    }
    // fp8: exponents 3..8 only (|x| in [2^-4, 2^1 * 1.875]): finite, roughly unit scale.
    auto rand_e4m3 = [&]() -> uint8_t {
      const uint32_t r = rng();
      return uint8_t(((r & 1) << 7) | ((3 + (r >> 1) % 6) << 3) | ((r >> 8) & 7));
    };
    for (int s = 0; s < S; ++s)
      for (int j = 0; j < c.ctx_lens[s]; ++j)
        for (size_t e = 0; e < tok_elems; ++e) {
          if (c.fp8) {
            hk8[slot(s, j) + e] = rand_e4m3();
            hv8[slot(s, j) + e] = rand_e4m3();
          } else {
            hk16[slot(s, j) + e] = to_bits(nd(rng), dt);
            hv16[slot(s, j) + e] = to_bits(nd(rng), dt);
          }
        }
    q_elems = size_t(Tq) * c.hq * D;
    std::vector<uint16_t> hq(q_elems);
    for (size_t i = 0; i < q_elems; ++i) {
      float x = nd(rng);
      if (c.q_row_exp > 0) {
        const int t = int(i / (size_t(c.hq) * D));
        x = std::ldexp(x, (t * 7) % (2 * c.q_row_exp + 1) - c.q_row_exp);
      }
      hq[i] = to_bits(x, dt);
    }
    o_head = D + kOPad, o_row = int64_t(c.hq) * o_head;
    o_elems = size_t(Tq) * o_row;
    lse_elems = size_t(Tq) * c.hq;
    const float scale = 1.f / std::sqrt(float(D));
    if (with_ref) {
      kf.resize(cache_elems), vf.resize(cache_elems);
#pragma omp parallel for
      for (long long i = 0; i < (long long)cache_elems; ++i) {
        const int h = int((i / D) % c.hkv);
        kf[i] = c.fp8 ? float(e4m3_to_double(hk8[i])) * ks[h] : from_bits(hk16[i], dt);
        vf[i] = c.fp8 ? float(e4m3_to_double(hv8[i])) * vs[h] : from_bits(hv16[i], dt);
      }
      std::vector<float> qf(q_elems);
      for (size_t i = 0; i < q_elems; ++i) qf[i] = from_bits(hq[i], dt);
      const int group = c.hq / c.hkv;
      ref.assign(q_elems, 0.0), ref_lse.assign(lse_elems, 0.0), visible.assign(lse_elems, 0);
#pragma omp parallel for collapse(2) schedule(dynamic)
      for (int s = 0; s < S; ++s)
        for (int h = 0; h < c.hq; ++h) {
          const int ctx = c.ctx_lens[s], ql = c.q_lens[s];
          std::vector<double> sc(std::max(ctx, 1)), acc(D);
          for (int i = 0; i < ql; ++i) {
            const int t = cq[s] + i;
            int vis = ctx;
            if (c.causal) vis = std::min(ctx, std::max(0, ctx - ql + i + 1));
            visible[size_t(t) * c.hq + h] = vis;
            double mx = -INFINITY;
            for (int j = 0; j < vis; ++j) {
              const size_t ko = slot(s, j) + size_t(h / group) * D;
              double dot = 0;
              for (int d = 0; d < D; ++d) dot += double(qf[(size_t(t) * c.hq + h) * D + d]) * kf[ko + d];
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
    }
    const size_t kv_bytes = cache_elems * (c.fp8 ? 1 : 2);
    CHECK_CUDA(cudaMalloc(&dq, std::max<size_t>(q_elems, 8) * 2));
    CHECK_CUDA(cudaMalloc(&dk, kv_bytes));
    CHECK_CUDA(cudaMalloc(&dv, kv_bytes));
    CHECK_CUDA(cudaMalloc(&dout, std::max<size_t>(o_elems, 8) * 2));
    CHECK_CUDA(cudaMalloc(&dlse, std::max<size_t>(lse_elems, 1) * 4));
    CHECK_CUDA(cudaMalloc(&dcq, (S + 1) * 4));
    CHECK_CUDA(cudaMalloc(&dtable, std::max<size_t>(table.size(), 1) * 4));
    CHECK_CUDA(cudaMalloc(&dctx, std::max(S, 1) * 4));
    CHECK_CUDA(cudaMalloc(&dks, c.hkv * 4));
    CHECK_CUDA(cudaMalloc(&dvs, c.hkv * 4));
    CHECK_CUDA(cudaMemcpy(dq, hq.data(), q_elems * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dk, c.fp8 ? (void*)hk8.data() : (void*)hk16.data(), kv_bytes, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dv, c.fp8 ? (void*)hv8.data() : (void*)hv16.data(), kv_bytes, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dcq, cq.data(), (S + 1) * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dtable, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dctx, c.ctx_lens.data(), S * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dks, ks.data(), c.hkv * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dvs, vs.data(), c.hkv * 4, cudaMemcpyHostToDevice));
    int dev = 0, sms = 0;
    CHECK_CUDA(cudaGetDevice(&dev));
    CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    p = PrefillParams{};
    p.q = dq, p.k = dk, p.v = dv, p.o = dout, p.lse = dlse;
    p.q_row_stride = int64_t(c.hq) * D, p.q_head_stride = D;
    // fp8: the cache strides count bytes, which for 1-byte elements are elements too.
    p.k_block_stride = p.v_block_stride = int64_t(bs) * tok_elems;
    p.k_row_stride = p.v_row_stride = tok_elems;
    p.k_head_stride = p.v_head_stride = D;
    p.o_row_stride = o_row, p.o_head_stride = o_head;
    p.lse_row_stride = c.hq, p.lse_head_stride = 1, p.lse_batch_stride = 0;
    p.cu_seqlens_q = dcq, p.block_tables = dtable, p.context_lens = dctx;
    p.block_table_stride = max_blocks, p.block_size = bs, p.max_blocks = max_blocks;
    p.batch = S, p.num_q_heads = c.hq, p.num_kv_heads = c.hkv, p.head_dim = D;
    p.max_seqlen_q = max_q, p.max_seqlen_k = max_blocks * bs;
    p.total_q = Tq, p.num_blocks = num_blocks;
    p.scale = scale, p.causal = c.causal, p.dtype = dt, p.num_sms = sms;
    p.kv_fp8 = c.fp8;
    p.k_scale = c.fp8 ? dks : nullptr, p.v_scale = c.fp8 ? dvs : nullptr;
  }
  void poison() {
    CHECK_CUDA(cudaMemset(dout, 0xFF, std::max<size_t>(o_elems, 8) * 2));
    CHECK_CUDA(cudaMemset(dlse, 0xFF, std::max<size_t>(lse_elems, 1) * 4));
  }
  ~Built() {
    for (void* ptr : {(void*)dq, dk, dv, (void*)dout, (void*)dlse, (void*)dcq, (void*)dtable, (void*)dctx,
                      (void*)dks, (void*)dvs})
      if (ptr) cudaFree(ptr);
  }
};

// Compares the device output of b with its reference; prints one line.
static bool compare(const Built& b, const char* variant, bool bitwise_ok) {
  const Case& c = b.c;
  const DType dt = c.dtype;
  const int D = c.d;
  std::vector<uint16_t> hout(b.o_elems);
  std::vector<float> hlse(b.lse_elems);
  CHECK_CUDA(cudaMemcpy(hout.data(), b.dout, b.o_elems * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(hlse.data(), b.dlse, b.lse_elems * 4, cudaMemcpyDeviceToHost));
  const double atol = dt == DType::kBFloat16 ? 1e-2 : 1.5e-3;
  const double rtol = dt == DType::kBFloat16 ? 2e-2 : 4e-3;
  double max_err = 0, max_lse_err = 0;
  long long bad = 0, bad_zero = 0, nan_count = 0, bad_lse = 0, bad_pad = 0;
  for (int t = 0; t < b.Tq; ++t)
    for (int h = 0; h < c.hq; ++h) {
      const int vis = b.visible[size_t(t) * c.hq + h];
      const size_t oo = size_t(t) * b.o_row + size_t(h) * b.o_head;
      for (int d = 0; d < D; ++d) {
        const float got = from_bits(hout[oo + d], dt);
        if (std::isnan(got)) { ++nan_count; continue; }
        if (vis == 0) { bad_zero += got != 0.f || std::signbit(got); continue; }
        const double r = b.ref[(size_t(t) * c.hq + h) * D + d];
        const double err = std::fabs(double(got) - r);
        max_err = std::max(max_err, err);
        bad += !(err <= atol + rtol * std::fabs(r));
      }
      for (int d = D; d < D + Built::kOPad; ++d) bad_pad += hout[oo + d] != 0xFFFF;
      const float gl = hlse[size_t(t) * c.hq + h];
      const double rl = b.ref_lse[size_t(t) * c.hq + h];
      if (vis == 0) {
        bad_lse += !(std::isinf(gl) && gl < 0);
      } else {
        const double e = std::fabs(double(gl) - rl);
        if (!(e <= 2e-3 + 1e-4 * std::fabs(rl))) ++bad_lse;
        if (std::isfinite(e)) max_lse_err = std::max(max_lse_err, e);
      }
    }
  const bool ok = !bad && !bad_zero && !nan_count && !bad_lse && !bad_pad && bitwise_ok;
  std::printf("%-4s %-9s %-64s err=%.2e lse_err=%.2e bad=%lld zero=%lld nan=%lld lse=%lld pad=%lld%s\n",
              ok ? "PASS" : "FAIL", variant, c.name.c_str(), max_err, max_lse_err, bad, bad_zero, nan_count, bad_lse,
              bad_pad, bitwise_ok ? "" : " NOT-DETERMINISTIC");
  std::fflush(stdout);
  return ok;
}

// The routed decode rows must be, bit for bit, what a plain decode call gives
// on those sequences alone (same forced split count, same table capacity): the
// packed-query instantiations (select_packed, decode/select.cuh) must stay the
// tiling-0 kernels of plain decode. Outputs and lse of the q_len == 1 rows.
static bool routed_matches_decode(Built& b) {
  const Case& c = b.c;
  std::vector<int> dec;
  for (int s = 0; s < b.S; ++s)
    if (c.q_lens[s] == 1) dec.push_back(s);
  if (dec.empty()) return true;
  constexpr int kSplits = 3;
  b.poison();
  CHECK_CUDA(routed<kSplits>(b.p, 0));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint16_t> hout(b.o_elems);
  std::vector<float> hlse(b.lse_elems);
  CHECK_CUDA(cudaMemcpy(hout.data(), b.dout, b.o_elems * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(hlse.data(), b.dlse, b.lse_elems * 4, cudaMemcpyDeviceToHost));
  // The decode sequences alone: their q rows, table rows and contexts, compacted.
  const int n = int(dec.size());
  const size_t row_elems = size_t(c.hq) * c.d;
  std::vector<int32_t> table(size_t(n) * b.max_blocks), ctx(n);
  for (int i = 0; i < n; ++i) {
    std::copy_n(b.table.begin() + size_t(dec[i]) * b.max_blocks, b.max_blocks, table.begin() + size_t(i) * b.max_blocks);
    ctx[i] = c.ctx_lens[dec[i]];
  }
  uint16_t *dq = nullptr, *dout = nullptr;
  int32_t *dtable = nullptr, *dctx = nullptr;
  float *dlse = nullptr, *ws = nullptr;
  CHECK_CUDA(cudaMalloc(&dq, n * row_elems * 2));
  CHECK_CUDA(cudaMalloc(&dout, n * row_elems * 2));
  CHECK_CUDA(cudaMalloc(&dlse, size_t(n) * c.hq * 4));
  CHECK_CUDA(cudaMalloc(&dtable, table.size() * 4));
  CHECK_CUDA(cudaMalloc(&dctx, n * 4));
  for (int i = 0; i < n; ++i)
    CHECK_CUDA(cudaMemcpy(dq + i * row_elems, b.dq + size_t(b.cq[dec[i]]) * row_elems, row_elems * 2,
                          cudaMemcpyDeviceToDevice));
  CHECK_CUDA(cudaMemcpy(dtable, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dctx, ctx.data(), n * 4, cudaMemcpyHostToDevice));
  PrefillParams pp = b.p;
  pp.q = dq, pp.o = dout, pp.lse = dlse, pp.block_tables = dtable, pp.context_lens = dctx, pp.batch = n;
  pp.q_row_stride = pp.o_row_stride = int64_t(row_elems), pp.o_head_stride = c.d, pp.lse_row_stride = c.hq;
  minipaged::DecodeParams d = minipaged::paged_decode_params(pp, g_cc_major);
  d.cu_seqlens_q = nullptr;  // plain decode: row b is sequence b
  const minipaged::DecodePlan plan = minipaged::decode_plan(d, kSplits);
  const int64_t floats = minipaged::decode_workspace_floats(d);
  if (floats > 0) {
    CHECK_CUDA(cudaMalloc(&ws, floats * 4));
    minipaged::decode_set_workspace(d, ws);
  }
  CHECK_CUDA(minipaged::launch_decode(d, plan, 0));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint16_t> pout(n * row_elems);
  std::vector<float> plse(size_t(n) * c.hq);
  CHECK_CUDA(cudaMemcpy(pout.data(), dout, pout.size() * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(plse.data(), dlse, plse.size() * 4, cudaMemcpyDeviceToHost));
  long long diff = 0;
  for (int i = 0; i < n; ++i) {
    const int t = b.cq[dec[i]];
    for (int h = 0; h < c.hq; ++h) {
      diff += std::memcmp(&hlse[size_t(t) * c.hq + h], &plse[size_t(i) * c.hq + h], 4) != 0;
      for (int e = 0; e < c.d; ++e)
        diff += hout[size_t(t) * b.o_row + size_t(h) * b.o_head + e] != pout[i * row_elems + size_t(h) * c.d + e];
    }
  }
  for (void* ptr : {(void*)dq, (void*)dout, (void*)dlse, (void*)dtable, (void*)dctx, (void*)ws})
    if (ptr) CHECK_CUDA(cudaFree(ptr));
  const bool ok = diff == 0;
  std::printf("%-4s %-9s %-64s %d decode rows, %d splits, %lld elements differ from a plain decode call\n",
              ok ? "PASS" : "FAIL", "rt_vs_dec", c.name.c_str(), n, d.num_splits, diff);
  std::fflush(stdout);
  return ok;
}

static int run_case(const Case& c, const std::string& filter) {
  auto runs = [&](const Variant& var) {
    if (var.fp8_tma ? !(c.fp8 && c.block_size >= 8) : var.needs_tma && (c.fp8 || c.block_size < 8)) return false;
    return filter.empty() || std::string(var.name).find(filter) != std::string::npos;
  };
  const bool vs_decode = filter.empty() || std::string("routed_vs_decode").find(filter) != std::string::npos;
  // No variant of the filter applies: skip the case before its fp64 reference (the slow part).
  if (!vs_decode && std::none_of(std::begin(kVariants), std::end(kVariants), runs)) return 0;
  Built b;
  b.build(c, true, 977u + c.d * 3 + c.hq * 7 + c.block_size + unsigned(c.q_lens.size()) * 13);
  int failures = 0;
  for (const Variant& var : kVariants) {
    if (!runs(var)) continue;
    b.poison();
    CHECK_CUDA(var.fn(b.p, 0));
    CHECK_CUDA(cudaDeviceSynchronize());
    bool same = true;
    const std::string vn = var.name;
    if (vn.rfind("dispatch", 0) == 0 || vn.rfind("routed", 0) == 0) {  // bitwise repeatable
      std::vector<uint16_t> first(b.o_elems), second(b.o_elems);
      CHECK_CUDA(cudaMemcpy(first.data(), b.dout, b.o_elems * 2, cudaMemcpyDeviceToHost));
      CHECK_CUDA(var.fn(b.p, 0));
      CHECK_CUDA(cudaDeviceSynchronize());
      CHECK_CUDA(cudaMemcpy(second.data(), b.dout, b.o_elems * 2, cudaMemcpyDeviceToHost));
      same = first == second;
    }
    failures += !compare(b, var.name, same);
  }
  if (vs_decode) failures += !routed_matches_decode(b);
  return failures;
}

// ---------------------------------------------------------------- cases
static std::vector<Case> check_cases() {
  const DType bf = DType::kBFloat16, fp = DType::kFloat16;
  std::vector<Case> cs;
  // q_len 1..2048 over contexts 0/1/17/97/1023/4097: decode rows, speculative
  // runs, chunks, q_len > context (rows with no key), empty sequences.
  const std::vector<int> mix_q = {1, 1, 17, 97, 1023, 2048, 4, 130, 0, 200, 16, 17, 1, 33};
  const std::vector<int> mix_c = {0, 1, 17, 1023, 1023, 4097, 97, 97, 17, 0, 4097, 4097, 4097, 1};
  const int gqa[][2] = {{16, 8}, {8, 1}, {4, 4}};  // GQA 2, 8, 1
  int k = 0;
  for (int bs : {8, 16, 64, 128, 256, 1, 4})
    for (DType dt : {bf, fp})
      for (bool causal : {true, false}) {
        const int D = (k & 1) ? 64 : 128;
        const int* g = gqa[k % 3];
        ++k;
        cs.push_back({"mix " + dname(dt) + " D" + std::to_string(D) + " bs" + std::to_string(bs) +
                          (causal ? " causal" : " noncausal") + " Hq" + std::to_string(g[0]) + "/" + std::to_string(g[1]),
                      dt, g[0], g[1], D, bs, causal, mix_q, mix_c});
      }
  // Every residue of (context_len - q_len) mod 128 (BLOCK_N), for q_lens that
  // span one and two tiles (and a short one, which dispatch packs and ws tiles).
  int r0 = 0;
  for (int ql : {5, 70, 129}) {
    std::vector<int> q, c;
    for (int r = 0; r < 128; ++r) {
      q.push_back(ql);
      c.push_back(ql + r + (r % 3) * 128);
    }
    for (int bs : {8, 16, 128, 256}) {
      const DType dt = (r0 & 1) ? fp : bf;
      const int D = (r0 & 2) ? 64 : 128;
      ++r0;
      cs.push_back({"residues q" + std::to_string(ql) + " " + dname(dt) + " D" + std::to_string(D) + " bs" +
                        std::to_string(bs) + " gqa2",
                    dt, 4, 2, D, bs, true, q, c});
    }
  }
  // The bench's mixed batch: one 2k chunk + 63 decodes at 4k context, and a
  // mix with speculative rows on both sides of kPackMaxSeqlenQ.
  {
    std::vector<int> q(64, 1), c(64, 4096);
    q[0] = 2048;
    cs.push_back({"mixed 2k chunk + 63 decodes bf16 D128 bs16 Hq16/8", bf, 16, 8, 128, 16, true, q, c});
    std::vector<int> q2 = {1, 300, 16, 17, 4, 1, 1, 2, 9}, c2 = {500, 1000, 700, 17, 4, 1, 4097, 2, 3000};
    cs.push_back({"mixed spec/chunk fp16 D64 bs32 Hq8/2", fp, 8, 2, 64, 32, true, q2, c2});
    cs.push_back({"mixed spec/chunk bf16 D128 bs64 Hq8/1 noncausal", bf, 8, 1, 128, 64, false, q2, c2});
  }
  // Causal work lists of at most one wave (the dispatch runs them on mirrored block pairs):
  // one sequence with and without a cached prefix, odd lengths, q_len 0 and short runs beside
  // the chunks, q_len > context.
  cs.push_back({"one-wave bf16 D128 bs16 Hq16/8", bf, 16, 8, 128, 16, true, {1000}, {1000}});
  cs.push_back({"one-wave fp16 D128 bs64 Hq16/8 prefix", fp, 16, 8, 128, 64, true, {1023}, {4097}});
  cs.push_back({"one-wave fp16 D64 bs8 Hq8/2 varlen", fp, 8, 2, 64, 8, true, {300, 700, 0, 5, 97}, {300, 1500, 40, 5, 97}});
  cs.push_back({"one-wave bf16 D128 bs128 Hq4/1 varlen", bf, 4, 1, 128, 128, true, {129, 1023, 2, 17}, {4097, 1023, 1, 17}});
  cs.push_back({"one-wave bf16 D64 bs256 Hq16/8 q>ctx", bf, 16, 8, 64, 256, true, {191}, {65}});
  // Decode routing (the routed variants run every case; these add the decode
  // kernels the planner picks: scalar G1/G2/G4/G8 at D64, scalar G1/G2 and
  // tensor cores at D128, FP8 below): decode rows among spec rows 2..16,
  // chunks, q_len 0, contexts 0 / 1.
  {
    const std::vector<int> q = {1, 1, 2, 16, 1, 0, 17, 1, 3, 1, 1, 200};
    const std::vector<int> c = {4097, 0, 2, 3000, 1, 5, 17, 300, 3, 129, 1023, 1000};
    cs.push_back({"routed fp16 D128 bs16 Hq8/1", fp, 8, 1, 128, 16, true, q, c});
    cs.push_back({"routed bf16 D128 bs1 Hq16/4", bf, 16, 4, 128, 1, true, q, c});
    cs.push_back({"routed bf16 D128 bs8 Hq4/4 noncausal", bf, 4, 4, 128, 8, false, q, c});
    cs.push_back({"routed fp16 D64 bs256 Hq16/2", fp, 16, 2, 64, 256, true, q, c});
    cs.push_back({"routed bf16 D64 bs16 Hq12/3", bf, 12, 3, 64, 16, true, q, c});
    cs.push_back({"routed bf16 D64 bs8 Hq8/4 noncausal", bf, 8, 4, 64, 8, false, q, c});
    cs.push_back({"routed only decodes+empty fp16 D128 bs16 Hq16/8", fp, 16, 8, 128, 16, true, {1, 0, 1, 1}, {70, 9, 0, 1}});
    Case f1{"routed fp8 bf16 D128 bs16 Hq16/2", bf, 16, 2, 128, 16, true, q, c};
    f1.fp8 = true;
    cs.push_back(f1);
    Case f2{"routed fp8 fp16 D64 bs8 Hq4/4", fp, 4, 4, 64, 8, true, q, c};
    f2.fp8 = true;
    cs.push_back(f2);
    Case f3{"routed fp8 bf16 D64 bs256 Hq8/4 noncausal", bf, 8, 4, 64, 256, false, q, c};
    f3.fp8 = true;
    cs.push_back(f3);
  }
  // FP8 pages through the TMA kernel (ws_fp8; dispatch and routed run them too): the mix
  // cases and the residues of (context_len - q_len) mod 128 at every page size >= 8, both
  // dtypes, D 64 and 128, GQA 2, 8 and 1.
  {
    const size_t n16 = cs.size();
    for (size_t i = 0; i < n16; ++i) {
      const Case& c0 = cs[i];
      const bool mix = c0.name.rfind("mix ", 0) == 0, res = c0.name.rfind("residues q70", 0) == 0 ||
                                                            c0.name.rfind("residues q129", 0) == 0;
      const bool wave = c0.name.rfind("one-wave", 0) == 0;
      if (!(mix || res || wave) || c0.block_size < 8) continue;
      Case f = c0;
      f.name = "fp8 " + c0.name;
      f.fp8 = true;
      cs.push_back(f);
    }
  }
  // FP8 caches (dispatch: the mma.sync FP8 kernels, split the same way).
  {
    std::vector<int> q = {300, 1, 1, 4, 0, 17, 1, 129}, c = {1000, 4097, 1, 20, 5, 17, 0, 1023};
    Case f8{"fp8 mixed bf16 D128 bs16 Hq16/8", bf, 16, 8, 128, 16, true, q, c};
    f8.fp8 = true;
    cs.push_back(f8);
    Case f8b{"fp8 mixed fp16 D64 bs1 Hq8/2 noncausal", fp, 8, 2, 64, 1, false, q, c};
    f8b.fp8 = true;
    cs.push_back(f8b);
  }
  return cs;
}

static std::vector<Case> small_cases() {
  const DType bf = DType::kBFloat16, fp = DType::kFloat16;
  std::vector<Case> cs = {
      {"small bf16 D128 bs8 causal", bf, 4, 2, 128, 8, true, {0, 1, 70, 150}, {5, 1, 67, 300}},
      {"small fp16 D64 bs256 noncausal", fp, 2, 1, 64, 256, false, {130, 3}, {400, 70}},
      {"small bf16 D64 bs16 mixed", bf, 4, 2, 64, 16, true, {1, 40, 1, 4, 17}, {33, 97, 0, 9, 17}},
      {"small fp16 D128 bs128 q>ctx", fp, 2, 2, 128, 128, true, {200, 1}, {130, 129}},
  };
  cs.push_back({"small routed fp16 D128 bs16 Hq8/1", fp, 8, 1, 128, 16, true, {1, 3, 0, 1, 20}, {40, 3, 2, 0, 50}});
  Case f8{"small fp8 bf16 D64 bs16 mixed", bf, 4, 2, 64, 16, true, {1, 40, 3}, {70, 97, 5}};
  f8.fp8 = true;
  cs.push_back(f8);
  // ws_fp8: a page of 8 at D=128 (eight boxes per key tile), q_len > context, an empty sequence
  Case f8w{"small fp8 fp16 D128 bs8 causal", fp, 4, 2, 128, 8, true, {0, 1, 70, 200}, {5, 1, 67, 300}};
  f8w.fp8 = true;
  cs.push_back(f8w);
  // bf16 q rows spanning 2^-8 .. 2^8 over FP8 pages (the f16 MMA path's per-warp power of two)
  Case f8r{"small fp8 bf16 D128 bs16 q rows 2^+-8", bf, 4, 2, 128, 16, true, {150, 1, 33}, {300, 20, 40}};
  f8r.fp8 = true;
  f8r.q_row_exp = 8;
  cs.push_back(f8r);
  return cs;
}

// ---------------------------------------------------------------- timing
static void* g_flush = nullptr;
static const size_t kFlushBytes = size_t(256) << 20;

// Median of `reps` calls, each after a 256 MB write (cold L2).
template <class F>
static double median_ms(F&& launch, int reps) {
  if (g_flush == nullptr) CHECK_CUDA(cudaMalloc(&g_flush, kFlushBytes));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  for (int w = 0; w < 3; ++w) CHECK_CUDA(launch());
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    CHECK_CUDA(cudaMemsetAsync(g_flush, i & 0xFF, kFlushBytes, 0));
    CHECK_CUDA(cudaEventRecord(e0, 0));
    CHECK_CUDA(launch());
    CHECK_CUDA(cudaEventRecord(e1, 0));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float t = 0.f;
    CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaEventDestroy(e1));
  return ms[ms.size() / 2];
}

static double case_flops(const Case& c) {
  double pairs = 0;
  for (size_t s = 0; s < c.q_lens.size(); ++s)
    for (int i = 0; i < c.q_lens[s]; ++i)
      pairs += c.causal ? std::min(c.ctx_lens[s], std::max(0, c.ctx_lens[s] - c.q_lens[s] + i + 1)) : c.ctx_lens[s];
  return 4.0 * c.hq * c.d * pairs;
}

// The same K/V made contiguous ([Tk, Hkv, D], cu_seqlens_k) for the dense ws kernel.
struct Contig {
  void *dk = nullptr, *dv = nullptr;
  int32_t* dck = nullptr;
  PrefillParams p{};
  void build(const Built& b) {
    const Case& c = b.c;
    std::vector<int> ck(b.S + 1, 0);
    for (int s = 0; s < b.S; ++s) ck[s + 1] = ck[s] + c.ctx_lens[s];
    const size_t row_bytes = b.tok_elems * 2;
    CHECK_CUDA(cudaMalloc(&dk, std::max<size_t>(ck[b.S], 1) * row_bytes));
    CHECK_CUDA(cudaMalloc(&dv, std::max<size_t>(ck[b.S], 1) * row_bytes));
    for (int s = 0; s < b.S; ++s)
      for (int j = 0; j < c.ctx_lens[s]; j += c.block_size) {
        const int n = std::min(c.block_size, c.ctx_lens[s] - j);
        const size_t src = size_t(b.table[size_t(s) * b.max_blocks + j / c.block_size]) * c.block_size * row_bytes;
        CHECK_CUDA(cudaMemcpy(static_cast<char*>(dk) + (ck[s] + j) * row_bytes, static_cast<char*>(b.dk) + src,
                              n * row_bytes, cudaMemcpyDeviceToDevice));
        CHECK_CUDA(cudaMemcpy(static_cast<char*>(dv) + (ck[s] + j) * row_bytes, static_cast<char*>(b.dv) + src,
                              n * row_bytes, cudaMemcpyDeviceToDevice));
      }
    CHECK_CUDA(cudaMalloc(&dck, (b.S + 1) * 4));
    CHECK_CUDA(cudaMemcpy(dck, ck.data(), (b.S + 1) * 4, cudaMemcpyHostToDevice));
    p = b.p;
    p.block_tables = nullptr, p.context_lens = nullptr;
    p.k = dk, p.v = dv, p.cu_seqlens_k = dck;
    p.k_row_stride = p.v_row_stride = b.tok_elems;
    p.k_batch_stride = p.v_batch_stride = 0;
    p.max_seqlen_k = *std::max_element(c.ctx_lens.begin(), c.ctx_lens.end());
    p.total_k = ck[b.S];
    p.lse = nullptr;
  }
  ~Contig() {
    if (dk) cudaFree(dk);
    if (dv) cudaFree(dv);
    if (dck) cudaFree(dck);
  }
};

// Decode kernels on the decode rows of b (every q_len 1): the "decodes alone" anchor.
// splits: as decode_plan takes it (0: the heuristic, with its workspace).
static double time_decode(const Built& b, int reps, int splits = 1) {
  minipaged::DecodeParams q{};
  const Case& c = b.c;
  q.q = b.dq, q.k_cache = b.dk, q.v_cache = b.dv, q.o = b.dout, q.block_tables = b.dtable, q.context_lens = b.dctx;
  q.q_batch_stride = int64_t(c.hq) * c.d, q.q_head_stride = c.d, q.o_batch_stride = b.o_row, q.o_head_stride = b.o_head;
  q.k_block_stride = q.v_block_stride = int64_t(c.block_size) * b.tok_elems;
  q.k_token_stride = q.v_token_stride = b.tok_elems, q.k_head_stride = q.v_head_stride = c.d;
  q.block_table_stride = b.max_blocks, q.batch = b.S, q.num_q_heads = c.hq, q.num_kv_heads = c.hkv,
  q.head_dim = c.d;
  q.block_size = c.block_size, q.max_blocks = b.max_blocks, q.scale = b.p.scale, q.dtype = c.dtype;
  q.num_sms = b.p.num_sms, q.cc_major = 9;
  const minipaged::DecodePlan plan = minipaged::decode_plan(q, splits);
  float* ws = nullptr;
  const int64_t floats = minipaged::decode_workspace_floats(q);
  if (floats > 0) {
    CHECK_CUDA(cudaMalloc(&ws, floats * 4));
    minipaged::decode_set_workspace(q, ws);
  }
  const double t = median_ms([&] { return minipaged::launch_decode(q, plan, 0); }, reps);
  if (ws) CHECK_CUDA(cudaFree(ws));
  return t;
}

static int cmd_time(int reps) {
  const DType bf = DType::kBFloat16;
  int fails = 0;
  std::printf("chunked prefill over pages (bf16, Hq/Hkv/D 16/8/128, page 16, shuffled pages, causal, median of %d, "
              "cold L2), TFLOP/s\n", reps);
  std::printf("%-28s %10s %10s %12s %14s %10s %10s\n", "shape", "dispatch", "ws_paged", "wgmma_old", "dense_ws(ctg)",
              "disp/dense", "ws/dense");
  struct Shape { int b, q, L; };
  for (const Shape sh : {Shape{8, 512, 4608}, Shape{1, 2048, 32768}}) {
    Case c{"", bf, 16, 8, 128, 16, true, std::vector<int>(sh.b, sh.q), std::vector<int>(sh.b, sh.L)};
    Built b;
    b.build(c, false, 42u);
    b.p.lse = nullptr;
    Contig ctg;
    ctg.build(b);
    const double fl = case_flops(c);
    const double t_disp = median_ms([&] { return dispatch_new(b.p, 0); }, reps);
    const double t_ws = median_ms([&] { return ws_paged(b.p, 0); }, reps);
    const double t_old = median_ms([&] { return wgmma_old<__nv_bfloat16, 128>(b.p, 0); }, reps);
    const double t_dense = median_ms([&] { return ws_dense<__nv_bfloat16, 128>(ctg.p, 0); }, reps);
    auto tf = [&](double ms) { return fl / (ms * 1e-3) / 1e12; };
    char name[64];
    std::snprintf(name, sizeof name, "B=%d q=%d L=%d", sh.b, sh.q, sh.L);
    std::printf("%-28s %10.1f %10.1f %12.1f %14.1f %10.2f %10.2f\n", name, tf(t_disp), tf(t_ws), tf(t_old),
                tf(t_dense), t_dense / t_disp, t_dense / t_ws);
    // What limits ws_paged at page 16: a third ring stage (more boxes in flight), and the same
    // pages in pool order instead of shuffled (TLB and DRAM locality of a scattered pool).
    Built bo;
    bo.shuffle_pages = false;
    bo.build(c, false, 42u);
    bo.p.lse = nullptr;
    const double t_ws3 = median_ms([&] { return ws_paged3(b.p, 0); }, reps);
    const double t_ordered = median_ms([&] { return ws_paged(bo.p, 0); }, reps);
    const double t_ws_again = median_ms([&] { return ws_paged(b.p, 0); }, reps);
    const double t_dense_again = median_ms([&] { return ws_dense<__nv_bfloat16, 128>(ctg.p, 0); }, reps);
    std::printf("  %s: ws 3 stages %.1f (/dense %.3f); ws pool-order pages %.1f (/dense %.3f); ws again %.1f, "
                "dense again %.1f\n", name, tf(t_ws3), t_dense / t_ws3, tf(t_ordered), t_dense / t_ordered,
                tf(t_ws_again), tf(t_dense_again));
    std::fflush(stdout);
  }
  // Page-size sweep of the paged TMA kernel on the first shape: a key tile is kBlockN / page_size
  // boxes per column block, so this separates the per-box cost from the rest of the paging cost.
  {
    std::printf("page-size sweep, B=8 q=512 L=4608, TFLOP/s (/ dense_ws) of ws_paged (2 stages) | ws_paged3 (3 stages):");
    Case c{"", bf, 16, 8, 128, 16, true, std::vector<int>(8, 512), std::vector<int>(8, 4608)};
    double t_dense = 0;
    for (const int bs : {16, 32, 64, 128, 256}) {
      c.block_size = bs;
      Built b;
      b.build(c, false, 42u);
      b.p.lse = nullptr;
      if (t_dense == 0) {
        Contig ctg;
        ctg.build(b);
        t_dense = median_ms([&] { return ws_dense<__nv_bfloat16, 128>(ctg.p, 0); }, reps);
      }
      const double t = median_ms([&] { return ws_paged(b.p, 0); }, reps);
      const double t_ws3 = median_ms([&] { return ws_paged3(b.p, 0); }, reps);
      const double fl = case_flops(c);
      std::printf("  bs%d %.1f (%.3f) | %.1f (%.3f);", bs, fl / (t * 1e-3) / 1e12, t_dense / t,
                  fl / (t_ws3 * 1e-3) / 1e12, t_dense / t_ws3);
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  // Mixed batch: one call vs the chunk alone + the decodes alone.
  {
    std::vector<int> q(64, 1), cl(64, 4096);
    q[0] = 2048;
    Case mixed{"", bf, 16, 8, 128, 16, true, q, cl};
    Case chunk{"", bf, 16, 8, 128, 16, true, {2048}, {4096}};
    Case dec{"", bf, 16, 8, 128, 16, true, std::vector<int>(63, 1), std::vector<int>(63, 4096)};
    Built bm, bc, bd;
    bm.build(mixed, false, 7u);
    bc.build(chunk, false, 8u);
    bd.build(dec, false, 9u);
    bm.p.lse = bc.p.lse = bd.p.lse = nullptr;
    const double t_mixed_default = median_ms([&] { return dispatch_default(bm.p, 0); }, reps);
    const double t_mixed = median_ms([&] { return dispatch_new(bm.p, 0); }, reps);
    const double t_chunk = median_ms([&] { return dispatch_new(bc.p, 0); }, reps);
    const double t_dec_paged = median_ms([&] { return dispatch_new(bd.p, 0); }, reps);
    std::printf("mixed batch, default dispatch (decode routing): %.3f ms\n", t_mixed_default);
    std::printf("mixed 2k chunk + 63 decodes at 4k: one call %.3f ms; chunk alone %.3f ms + decodes alone "
                "(packed paged kernel) %.3f ms -> ratio %.2f (target <= 1.10)\n",
                t_mixed, t_chunk, t_dec_paged, t_mixed / (t_chunk + t_dec_paged));
    std::fflush(stdout);
    const double t_dec = time_decode(bd, reps);
    const double t_dec_split = time_decode(bd, reps, 0);
    const double best_dec = std::min({t_dec, t_dec_split, t_dec_paged});
    std::printf("  decode kernel on the 63 decodes: 1 split %.3f ms, split heuristic %.3f ms -> one call vs best "
                "separate %.2f\n", t_dec, t_dec_split, t_mixed / (t_chunk + best_dec));
    // The decode routing (variant 4): the decodes through the decode kernel (split heuristic) and the
    // chunk through the tiled kernel, two launches, one stream.
    const double t_routed = median_ms([&] { return routed<0>(bm.p, 0); }, reps);
    std::printf("mixed routed (decode routing, variant 4): one call %.3f ms -> ratio vs chunk alone + decodes alone "
                "(split-K decode kernel) %.2f (target <= 1.10), vs best separate %.2f\n",
                t_routed, t_routed / (t_chunk + t_dec_split), t_routed / (t_chunk + best_dec));
    std::fflush(stdout);
  }
  // A timing is worth nothing if that shape is wrong: check a reduced copy of each (fewer heads).
  {
    Case c1{"time-check B=2 q=512 L=4608 bs16 Hq2/1", bf, 2, 1, 128, 16, true, {512, 512}, {4608, 4608}};
    std::vector<int> q(16, 1), cl(16, 4096);
    q[0] = 2048;
    Case c2{"time-check mixed 2k + 15 decodes bs16 Hq4/2", bf, 4, 2, 128, 16, true, q, cl};
    fails += run_case(c1, "");
    fails += run_case(c2, "");
  }
  // (FP8 pages: time8, both dtypes, with its own checks.)
  return fails;
}

// FP8 pages through the TMA kernel against the 16-bit TMA kernel on the same shapes, both
// dtypes (the widening producer's cost), then the fp8 cases of `small` and a reduced copy.
static int cmd_time8(int reps) {
  std::printf("ws_fp8 vs ws_paged (16-bit), Hq/Hkv/D 16/8/128, page 16, causal, median of %d, cold L2, TFLOP/s "
              "(MINIPAGED_WS8_WIDEN %d)\n", reps, MINIPAGED_WS8_WIDEN);
  struct Shape { int b, q, L; };
  for (const DType dt : {DType::kBFloat16, DType::kFloat16}) {
    for (const Shape sh : {Shape{8, 512, 4608}, Shape{1, 2048, 32768}}) {
      Case c{"", dt, 16, 8, 128, 16, true, std::vector<int>(sh.b, sh.q), std::vector<int>(sh.b, sh.L)};
      Built b;
      b.build(c, false, 42u);
      b.p.lse = nullptr;
      Case c8 = c;
      c8.fp8 = true;
      Built b8;
      b8.build(c8, false, 42u);
      b8.p.lse = nullptr;
      const double fl = case_flops(c);
      auto tf = [&](double ms) { return fl / (ms * 1e-3) / 1e12; };
      const double t16 = median_ms([&] { return ws_paged(b.p, 0); }, reps);
      const double t8 = median_ms([&] { return ws_fp8(b8.p, 0); }, reps);
      const double t16b = median_ms([&] { return ws_paged(b.p, 0); }, reps);
      const double t8b = median_ms([&] { return ws_fp8(b8.p, 0); }, reps);
      std::printf("%s B=%d q=%d L=%d: ws_paged %.1f / %.1f, ws_fp8 %.1f / %.1f TFLOP/s; fp8 time / 16-bit %.3f\n",
                  dt == DType::kBFloat16 ? "bf16" : "fp16", sh.b, sh.q, sh.L, tf(t16), tf(t16b), tf(t8), tf(t8b),
                  std::min(t8, t8b) / std::min(t16, t16b));
      std::fflush(stdout);
    }
  }
  int fails = 0;
  for (const Case& c : small_cases())
    if (c.fp8) fails += run_case(c, "");
  Case c3{"time-check fp8 B=2 q=512 L=4608 bs16 Hq2/1", DType::kBFloat16, 2, 1, 128, 16, true, {512, 512}, {4608, 4608}};
  c3.fp8 = true;
  fails += run_case(c3, "");
  c3.name = "time-check fp8 fp16 B=2 q=512 L=4608 bs16 Hq2/1";
  c3.dtype = DType::kFloat16;
  fails += run_case(c3, "");
  return fails;
}

// Causal chunks whose grid is at most one wave of 128-row blocks (B=1, little or no cached prefix: a
// prompt's first chunk), where the heaviest block bounds the call: the paged kernel (ws) against
// its mirrored-pair twin (ws_mirror), and the dense kernel on the same K/V made contiguous, plain
// (CfgWs) and mirrored (CfgWsMirror, the dense dispatch's choice there). Each output is checked
// against the others before timing; two interleaved rounds.
static int cmd_time_one_wave(int reps) {
  const DType bf = DType::kBFloat16;
  std::printf("one-wave causal chunks (bf16, Hq/Hkv/D 16/8/128, page 16, shuffled pages, B=1, median of %d, cold L2), "
              "TFLOP/s\n", reps);
  struct Shape { int q, L; };
  int fails = 0;
  for (int round = 0; round < 2; ++round)
    for (const Shape sh : {Shape{1024, 1024}, Shape{768, 768}, Shape{512, 512}, Shape{256, 256}, Shape{512, 8192},
                           Shape{1024, 1536}, Shape{1024, 4096}, Shape{2048, 2048}}) {
      Case c{"", bf, 16, 8, 128, 16, true, std::vector<int>{sh.q}, std::vector<int>{sh.L}};
      Built b;
      b.build(c, false, 42u);
      b.p.lse = nullptr;
      Contig ctg;
      ctg.build(b);
      // fn(p) writes out.dout (the dense call too: Contig shares b's output buffer); each result is
      // copied out after its launch
      auto out_of = [&](LaunchFn fn, const PrefillParams& p, const Built& out) {
        CHECK_CUDA(fn(p, 0));
        CHECK_CUDA(cudaDeviceSynchronize());
        std::vector<uint16_t> h(out.o_elems);
        CHECK_CUDA(cudaMemcpy(h.data(), out.dout, out.o_elems * 2, cudaMemcpyDeviceToHost));
        return h;
      };
      const auto o_ws = out_of(ws_paged, b.p, b);
      const auto o_mirror = out_of(ws_mirror, b.p, b);
      const auto o_dense = out_of(ws_dense<__nv_bfloat16, 128>, ctg.p, b);
      double diff = 0;
      for (int t = 0; t < sh.q; ++t)
        for (int h = 0; h < 16; ++h)
          for (int d = 0; d < 128; ++d) {
            const size_t i = size_t(t) * b.p.o_row_stride + size_t(h) * b.p.o_head_stride + d;
            const double a = from_bits(o_mirror[i], bf);
            diff = std::max(diff, std::max(std::fabs(a - from_bits(o_ws[i], bf)), std::fabs(a - from_bits(o_dense[i], bf))));
            if (std::isnan(a)) diff = INFINITY;
          }
      if (!(diff <= 2e-2)) ++fails;
      const double fl = case_flops(c);
      auto tf = [&](double ms) { return fl / (ms * 1e-3) / 1e12; };
      const double t_ws = median_ms([&] { return ws_paged(b.p, 0); }, reps);
      const double t_mirror = median_ms([&] { return ws_mirror(b.p, 0); }, reps);
      const double t_wg1 = median_ms([&] { return wgmma_small<__nv_bfloat16, 128>(b.p, 0); }, reps);
      const double t_dense = median_ms([&] { return ws_dense<__nv_bfloat16, 128>(ctg.p, 0); }, reps);
      const double t_dense_mirror = median_ms([&] { return ws_dense_mirror<__nv_bfloat16, 128>(ctg.p, 0); }, reps);
      // FP8 pages (per-KV-head scales) of the same K/V: the plain schedule against the pairs
      Case c8 = c;
      c8.fp8 = true;
      Built b8;
      b8.build(c8, false, 42u);
      b8.p.lse = nullptr;
      const auto o8 = out_of(ws_fp8, b8.p, b8);
      const auto o8m = out_of(ws_fp8_mirror, b8.p, b8);
      double diff8 = 0;
      for (size_t i = 0; i < o8.size(); ++i) {
        const double a = from_bits(o8m[i], bf);
        diff8 = std::isnan(a) ? INFINITY : std::max(diff8, std::fabs(a - from_bits(o8[i], bf)));
      }
      if (!(diff8 <= 2e-2)) ++fails;
      const double t8 = median_ms([&] { return ws_fp8(b8.p, 0); }, reps);
      const double t8m = median_ms([&] { return ws_fp8_mirror(b8.p, 0); }, reps);
      std::printf("round %d  q=%d L=%d (%d CTAs): ws %.1f  wgmma_small %.1f  ws_mirror %.1f (x%.3f ws, x%.3f wgmma_small)  "
                  "dense_ws %.1f  dense_mirror %.1f  max|diff| %.2e%s | fp8: ws_fp8 %.1f  ws_fp8_mirror %.1f (x%.3f)  "
                  "max|diff| %.2e%s\n", round, sh.q, sh.L, 16 * ((sh.q + 127) / 128),
                  tf(t_ws), tf(t_wg1), tf(t_mirror), t_ws / t_mirror, t_wg1 / t_mirror, tf(t_dense), tf(t_dense_mirror),
                  diff, diff <= 2e-2 ? "" : "  MISMATCH", tf(t8), tf(t8m), t8 / t8m, diff8, diff8 <= 2e-2 ? "" : "  MISMATCH");
    }
  return fails;
}

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a log cut by a stage cap keeps every finished line
  const std::string mode = argc > 1 ? argv[1] : "check";
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  g_cc_major = prop.major;
  if (prop.major != 9 || prop.minor != 0) {
    std::fprintf(stderr, "needs an sm_90 device\n");
    return 2;
  }
  int failures = 0, cases = 0;
  if (mode == "check") {
    const std::string filter = argc > 2 ? argv[2] : "";
    for (const Case& c : check_cases()) failures += run_case(c, filter), ++cases;
  } else if (mode == "small") {
    for (const Case& c : small_cases()) failures += run_case(c, ""), ++cases;
  } else if (mode == "profile") {
    // One launch of the paged TMA kernel (page 16) and one of the dense kernel on the same K/V
    // made contiguous, B=8 q=512 L=4608: for ncu -k regex:prefill_ws.
    Case c{"", DType::kBFloat16, 16, 8, 128, 16, true, std::vector<int>(8, 512), std::vector<int>(8, 4608)};
    Built b;
    b.build(c, false, 42u);
    b.p.lse = nullptr;
    Contig ctg;
    ctg.build(b);
    CHECK_CUDA(ws_paged(b.p, 0));
    CHECK_CUDA(ws_panels(b.p, 0));
    CHECK_CUDA((ws_dense<__nv_bfloat16, 128>(ctg.p, 0)));
    CHECK_CUDA(cudaDeviceSynchronize());
    std::printf("profile: launched ws_paged, ws_panels and ws_dense\n");
  } else if (mode == "time8") {
    failures = cmd_time8(argc > 2 ? std::atoi(argv[2]) : 20);
    cases = 4;
  } else if (mode == "time") {
    failures = cmd_time(argc > 2 ? std::atoi(argv[2]) : 20);
    cases = 2;
  } else if (mode == "time1w") {
    failures = cmd_time_one_wave(argc > 2 ? std::atoi(argv[2]) : 40);
    cases = 32;
  } else {
    std::fprintf(stderr, "usage: %s check [variant filter] | small | time [reps] | time8 [reps] | time1w [reps] | profile\n",
                 argv[0]);
    return 2;
  }
  std::printf("%s (%d failures over %d cases)\n", failures == 0 ? "ALL PASS" : "SOME FAILED", failures, cases);
  return failures == 0 ? 0 : 1;
}
