// moe_router_route (cutlass_w8a8/ops/moe.py documents it): a MoE layer's router GEMM and its routing in one kernel, at
// decode sizes (T <= 16 tokens):
//
//   logits = round_to(logits_dtype, x [T, H] @ router_weight [E, H]^T, accumulated in float32)
//   (topk_weights, topk_ids) = moe_route(logits, ...)            (route_row, moe/route_row.cuh: the same code)
//
// One thread-block cluster of kClusterCtas = 8 CTAs (sm90), no global workspace and no counter:
//   1. CTA r computes the logits of experts [r * Es, (r + 1) * Es) (Es = ceil(E / 8) rounded up to 16) for every
//      token: per 16-expert tile, its 8 warps split H into 64-element chunks (warp w: chunks w, w + 8, ...), each
//      chunk 4 bf16 / fp16 mma.sync m16n8k16 per 8-token tile with float32 accumulation; then the 8 warps' partial
//      sums are added in warp order (a fixed order: a token's logits depend neither on T nor on scheduling);
//   2. each logit, rounded to logits_dtype (x's dtype, or float32 for DeepSeek-V3 / GLM's float32 router linear),
//      is written through distributed shared memory into the CTA that routes its token (token t: CTA t % 8);
//   3. cluster barrier; each CTA routes its tokens, one warp per token, with route_row on the logits in its shared
//      memory, and writes topk_weights / topk_ids.
// (A first cluster barrier, arrived at the start and waited before the GEMM, makes sure every CTA of the cluster
// runs before its shared memory is written.)
//
// Lane (g, q) of a warp (g = lane / 4, q = lane % 4) loads 16 consecutive elements of H from expert rows g and g + 8
// and from token g: 32-byte loads, four lanes covering 128 contiguous bytes of a row. The mma's k index is a
// permutation of those: step j of the chunk takes the lane's elements [4j, 4j + 4) as its k {2q, 2q+1, 2q+8, 2q+9},
// for the weight rows and the tokens alike, so each product x[t, k] * w[e, k] is formed once (a permuted dot
// product). The summation order differs from cuBLAS's: ops/moe.py's moe_router_route states the bound.
//
// Time, H200 (2026-11-29, before the batched loads and route_row's redux rounds; CUDA graph of 20 calls, median):
// Qwen3-30B-A3B (E 128, H 2048, top-8) 8.1 us, of which the routing ~6 (6.8 us at H 64); cuBLAS's x @ W^T alone 4.7
// and moe_route alone 6.1. DeepSeek-V3 dims (E 256, H 7168) 17.5 us against cuBLAS 5.8 + moe_route 7.5: with 8 warps
// and two chunks of loads in flight a CTA read its 460 KB at ~46 GB/s (Nsight Compute at T 1: 8 CTAs, SM-active
// busy ~40% of the elapsed cycles, warps stalled on L1TEX). A warp now issues kBatch chunks' loads before their mma.
//
// Devices without clusters (before sm90) get the two-kernel path inside the op (at::linear in logits_dtype, then
// route_kernel): the same result up to the summation order of the logits.
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cooperative_groups.h>

#include "core/checks.hpp"
#include "core/device.hpp"
#include "core/launch.hpp"
#include "core/launch_policy.hpp"
#include "moe/moe_args.hpp"
#include "moe/route_row.cuh"
#include "ops.hpp"
#include "quant/rowwise_reduce.cuh"

namespace cutlass_w8a8 {
namespace {

using moe_routing::RouteArgs;

constexpr int kClusterCtas = 8;
constexpr int kRRWarps = 8;
constexpr int kRRThreads = kRRWarps * 32;
constexpr int kChunk = 64;   // H elements per warp step (4 lanes x 16)
constexpr int kTileE = 16;   // experts per mma tile (M)
constexpr int kTileT = 8;    // tokens per mma tile (N)
constexpr int kBatch = 4;    // chunks a warp loads before their mma (32 chunks of Qwen3's H 2048: one batch)

struct RouterRouteParams {
  const void* x;      // [T, H], unit column stride, 16-byte aligned rows
  int64_t x_stride;
  const void* w;      // [E, H], same
  int64_t w_stride;
  int t, h, e;
  int e_per_cta;      // multiple of kTileE
  int tokens_per_cta; // ceil(T / kClusterCtas)
  bool round_logits;  // round the float32 sums to T (logits_dtype = x's dtype); else keep float32
  RouteArgs a;
};

template <class T>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// 16 elements (32 bytes) at p as 8 registers of 2 elements; zeros when !valid.
__device__ __forceinline__ void load16(uint32_t (&r)[8], const void* p, bool valid) {
  uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;
  if (valid) {
    lo = __ldg(reinterpret_cast<const uint4*>(p));
    hi = __ldg(reinterpret_cast<const uint4*>(p) + 1);
  }
  r[0] = lo.x; r[1] = lo.y; r[2] = lo.z; r[3] = lo.w;
  r[4] = hi.x; r[5] = hi.y; r[6] = hi.z; r[7] = hi.w;
}

// Shared memory (floats): partial [kRRWarps][NT][kTileE * kTileT], logits [tokens_per_cta][E], rows
// [route warps][E] (route warps = min(kRRWarps, tokens_per_cta)).
template <class T, int NT, bool kSigmoid>
__global__ void CW8A8_CLUSTER_DIMS(kClusterCtas, 1, 1) __launch_bounds__(kRRThreads)
    router_route_kernel(const RouterRouteParams p) {
#if CW8A8_HAS_CLUSTERS
  extern __shared__ float rr_smem[];
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  float* partial = rr_smem;
  float* logits = partial + kRRWarps * NT * kTileE * kTileT;
  float* rows = logits + p.tokens_per_cta * p.e;
  const int e0 = rank * p.e_per_cta;
  const int e1 = min(e0 + p.e_per_cta, p.e);
  const char* wbytes = static_cast<const char*>(p.w);
  const char* xbytes = static_cast<const char*>(p.x);
  const int64_t row_bytes = int64_t(p.h) * sizeof(T);

  allow_dependent_launch();
  // Every CTA of the cluster must have started before another writes into its shared memory: arrive now, wait
  // after the prefetches (the CTAs of a cluster start together, so the wait is short).
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  // The router weight is not written by the previous kernel: start its reads from HBM before waiting on it.
  for (int e = e0; e < e1; ++e) {
    for (int64_t off = int64_t(threadIdx.x) * 128; off < row_bytes; off += int64_t(kRRThreads) * 128) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(wbytes + e * p.w_stride * sizeof(T) + off));
    }
  }
  wait_for_producers();
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");

  const int chunks = p.h / kChunk;
  for (int m0 = e0; m0 < e1; m0 += kTileE) {
    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    const bool ra = m0 + g < p.e, rb = m0 + g + 8 < p.e;
    const char* wa = wbytes + (m0 + g) * p.w_stride * sizeof(T) + q * 16 * sizeof(T);
    const char* wb = wa + 8 * p.w_stride * sizeof(T);
    // kBatch chunks' loads issued before their math (one memory latency per batch, not per chunk); the mma order
    // per warp is still chunk w, w + 8, w + 16, ...
    for (int c0 = warp; c0 < chunks; c0 += kRRWarps * kBatch) {
      uint32_t ar[kBatch][8], br[kBatch][8], xr[kBatch][NT][8];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int c = c0 + u * kRRWarps;
        const bool in = c < chunks;
        const int64_t kb = int64_t(c) * kChunk * sizeof(T);
        load16(ar[u], wa + kb, ra && in);
        load16(br[u], wb + kb, rb && in);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const int tok = n * kTileT + g;
          load16(xr[u][n], xbytes + tok * p.x_stride * sizeof(T) + q * 16 * sizeof(T) + kb, in && tok < p.t);
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (c0 + u * kRRWarps >= chunks) break;  // warp-uniform
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t a[4] = {ar[u][2 * j], br[u][2 * j], ar[u][2 * j + 1], br[u][2 * j + 1]};
#pragma unroll
          for (int n = 0; n < NT; ++n) mma_16x8x16<T>(acc[n], a, xr[u][n][2 * j], xr[u][n][2 * j + 1]);
        }
      }
    }
    // the warps' partial sums, then their sum in warp order
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      float* mine = partial + (warp * NT + n) * kTileE * kTileT;
      mine[g * kTileT + 2 * q] = acc[n][0];
      mine[g * kTileT + 2 * q + 1] = acc[n][1];
      mine[(g + 8) * kTileT + 2 * q] = acc[n][2];
      mine[(g + 8) * kTileT + 2 * q + 1] = acc[n][3];
    }
    __syncthreads();
    if (threadIdx.x < NT * kTileE * kTileT) {
      const int n = threadIdx.x / (kTileE * kTileT), idx = threadIdx.x % (kTileE * kTileT);
      const int expert = m0 + idx / kTileT, tok = n * kTileT + idx % kTileT;
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < kRRWarps; ++w) s += partial[(w * NT + n) * kTileE * kTileT + idx];
      if (expert < e1 && tok < p.t) {
        const float v = p.round_logits ? to_float(from_float<T>(s)) : s;
        float* dst = cluster.map_shared_rank(logits, tok % kClusterCtas);
        dst[(tok / kClusterCtas) * p.e + expert] = v;
      }
    }
    __syncthreads();  // partial is reused by the next tile
  }
  cluster.sync();  // every logit of this CTA's tokens has arrived (and no CTA exits while others write to it)

  const int route_warps = min(kRRWarps, p.tokens_per_cta);
  if (warp < route_warps) {
    float* row = rows + warp * p.e;
    for (int i = warp; i < p.tokens_per_cta; i += route_warps) {
      const int t = rank + i * kClusterCtas;
      if (t >= p.t) break;
      const float* lg = logits + i * p.e;
      auto logit = [&](int k) { return lg[k]; };
      moe_routing::route_row<kSigmoid>(logit, row, p.a, t, lane);
      __syncwarp();  // the next token reuses row
    }
  }
#else
  __trap();  // not reached: launched only where clusters_available
#endif
}

size_t router_route_smem(int nt, int tokens_per_cta, int e) {
  const int route_warps = tokens_per_cta < kRRWarps ? tokens_per_cta : kRRWarps;
  return sizeof(float) * (static_cast<size_t>(kRRWarps) * nt * kTileE * kTileT +
                          static_cast<size_t>(tokens_per_cta + route_warps) * e);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> moe_router_route(const at::Tensor& x, const at::Tensor& router_weight, int64_t top_k,
                                                    c10::string_view scoring,
                                                    const std::optional<at::Tensor>& correction_bias, int64_t n_group,
                                                    int64_t topk_group, bool renormalize, double scaling_factor,
                                                    std::optional<at::ScalarType> logits_dtype) {
  constexpr const char* op = "moe_router_route";
  moe::check_router_route(op, x, router_weight, top_k, scoring, correction_bias, n_group, topk_group, scaling_factor,
                          logits_dtype);
  check_cuda(op, "x", x);
  c10::cuda::CUDAGuard guard(x.device());
  const at::ScalarType ldt = logits_dtype.value_or(x.scalar_type());
  const bool sigmoid = scoring == "sigmoid";
  const int64_t t = x.size(0), h = x.size(1), e = router_weight.size(0);
  const int device = x.get_device();
  if (!clusters_available(device)) {  // before sm90: the router GEMM, then moe_route's kernel
    const at::Tensor logits = at::linear(x.to(ldt), router_weight.to(ldt));
    return moe_route(logits, top_k, scoring, correction_bias, n_group, topk_group, renormalize, scaling_factor);
  }
  const auto opts = x.options();
  at::Tensor weights = at::empty({t, top_k}, opts.dtype(at::kFloat));
  at::Tensor ids = at::empty({t, top_k}, opts.dtype(at::kInt));
  if (t == 0) return {weights, ids};

  RouterRouteParams p{};
  p.x = x.data_ptr();
  p.x_stride = t > 1 ? x.stride(0) : h;
  p.w = router_weight.data_ptr();
  p.w_stride = e > 1 ? router_weight.stride(0) : h;
  p.t = static_cast<int>(t);
  p.h = static_cast<int>(h);
  p.e = static_cast<int>(e);
  const int64_t per = (e + kClusterCtas - 1) / kClusterCtas;
  p.e_per_cta = static_cast<int>((per + kTileE - 1) / kTileE * kTileE);
  p.tokens_per_cta = static_cast<int>((t + kClusterCtas - 1) / kClusterCtas);
  p.round_logits = ldt != at::kFloat;
  RouteArgs& a = p.a;
  a.rows = t;
  a.e = static_cast<int>(e);
  a.k = static_cast<int>(top_k);
  a.bias = correction_bias.has_value() ? correction_bias->data_ptr<float>() : nullptr;
  a.bias_stride = correction_bias.has_value() ? correction_bias->stride(0) : 0;
  a.n_group = static_cast<int>(n_group);
  a.group_size = static_cast<int>(e / n_group);
  a.topk_group = static_cast<int>(topk_group);
  a.renormalize = renormalize;
  a.renorm_eps = sigmoid ? static_cast<float>(1e-20) : 0.f;  // as route_impl (routing.cu)
  a.scale = static_cast<float>(scaling_factor);
  a.weights = weights.data_ptr<float>();
  a.ids = ids.data_ptr<int>();

  const int nt = t > kTileT ? 2 : 1;
  const size_t smem = router_route_smem(nt, p.tokens_per_cta, p.e);  // <= 24 KB (T <= 16, E <= 1024)
  const bool pdl = kernels_use_pdl(device);
  cudaStream_t stream = current_stream(x);
  auto launch = [&](auto tag, auto nt_c, auto sig_c) {
    using T = decltype(tag);
    auto kernel = router_route_kernel<T, decltype(nt_c)::value, decltype(sig_c)::value>;
    C10_CUDA_CHECK(launch_kernel(kernel, dim3(kClusterCtas), dim3(kRRThreads), smem, stream, pdl, p));
  };
  auto by_nt = [&](auto tag, auto sig_c) {
    if (nt == 1) {
      launch(tag, std::integral_constant<int, 1>{}, sig_c);
    } else {
      launch(tag, std::integral_constant<int, 2>{}, sig_c);
    }
  };
  auto by_sig = [&](auto tag) {
    if (sigmoid) {
      by_nt(tag, std::true_type{});
    } else {
      by_nt(tag, std::false_type{});
    }
  };
  if (x.scalar_type() == at::kBFloat16) {
    by_sig(__nv_bfloat16{});
  } else {
    by_sig(__half{});
  }
  return {weights, ids};
}

}  // namespace cutlass_w8a8
