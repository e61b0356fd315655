// moe_router_route (cutlass_w8a8/ops/moe.py documents it): a MoE layer's router GEMM and its routing in one kernel, at
// decode sizes (T <= 16 tokens):
//
//   logits = round_to(logits_dtype, x [T, H] @ router_weight [E, H]^T, accumulated in float32)
//   (topk_weights, topk_ids) = moe_route(logits, ...)            (route_row, moe/route_row.cuh: the same code)
//
// One thread-block cluster of C CTAs (sm90; C = 8, or 16 for routers of at least kWideRouterBytes where a
// non-portable cluster of 16 is resident), no global workspace and no counter:
//   1. the router's work is units (16-expert tile, H slice): `slices` (1..kMaxSlices) equal runs of 64-element
//      chunks of H per tile, unit u = (tile u / slices, slice u % slices); CTA r takes units r, r + C, ...; per unit
//      its 8 warps split the slice's chunks (warp w: the slice's chunks w, w + 8, ..., kBatch chunks' loads before
//      their mma), each chunk 4 bf16 / fp16 mma.sync m16n8k16 per 8-token tile with float32 accumulation; then the
//      8 warps' partial sums are added in warp order;
//   2. each unit's sums are written through distributed shared memory into the CTA that routes their token (token
//      t: CTA t % C), in the token's slot for that slice;
//   3. cluster barrier; each CTA adds its tokens' slices in slice order, rounds the logits to logits_dtype (x's
//      dtype, or float32 for DeepSeek-V3 / GLM's float32 router linear) and routes its tokens, one warp per token,
//      with route_row on the logits in its shared memory, and writes topk_weights / topk_ids.
// The slices and C come from E, H, the dtype and the device only (never T): a token's logits are a fixed-order sum,
// the same at any T, eager or replayed. With one slice (Qwen3-30B-A3B: 8 tiles over 8 CTAs) the sums are those of
// the former one-tile-per-CTA kernel. (A first cluster barrier, arrived at the start and waited before the GEMM,
// makes sure every CTA of the cluster runs before its shared memory is written.)
// The plan of 8 CTAs x 1 slice (Qwen3-30B-A3B, OLMoE) runs router_route_kernel_one_slice: the cluster in the binary,
// each logit rounded where its sum is formed (step 3 without the slice pass and its block barrier), no division by
// the slice count. That plan went from 6.18 to 6.37 us at T 1 on the H200 with the units; the SASS reading put it
// on the general kernel's slice pass and barrier after the cluster barrier and its division before the first load,
// and the one-slice kernel took it back: 6.38 -> 6.18 us at T 1 (OLMoE 6.01 -> 5.81; H200, tenth session,
// bench_moe_router.py, main's build and the new one alternating, two identical rounds).
//
// Lane (g, q) of a warp (g = lane / 4, q = lane % 4) loads 16 consecutive elements of H from expert rows g and g + 8
// and from token g: 32-byte loads, four lanes covering 128 contiguous bytes of a row. The mma's k index is a
// permutation of those: step j of the chunk takes the lane's elements [4j, 4j + 4) as its k {2q, 2q+1, 2q+8, 2q+9},
// for the weight rows and the tokens alike, so each product x[t, k] * w[e, k] is formed once (a permuted dot
// product). The summation order differs from cuBLAS's: ops/moe.py's moe_router_route states the bound.
//
// Time, H200 (2026-11-29, CUDA graph of 20 calls on the same x and weight, median; bench/results/
// moe_router_route_nvidia-h200.md): Qwen3-30B-A3B dims (E 128, H 2048, top-8) 8.2 us before the batched loads and
// route_row's redux rounds, 6.2 after (cuBLAS's x @ W^T alone 4.7, moe_route alone 4.2). E 256, H 7168 (DeepSeek-V3's
// router): 17.6 us, then 13.0, on 8 CTAs of 460 KB each (Nsight Compute at T 1 before: warps stalled on L1TEX, the
// 8 SMs busy ~40% of the elapsed cycles); hence the cluster of 16 CTAs for wide routers (not measured yet).
//
// add_rms_norm_moe_router_route (ops/moe.py): the MoE layer's post-attention norm folded in (router_route_body's
// kNorm, router_norm_route_kernel*): after the wait on the previous kernel every CTA computes s = h + residual and
// y = RMSNorm(s) * norm_weight of every token row with rms_norm.cu's arithmetic in its order (quant/rms_norm_row.cuh;
// H <= 8192: its one-block kernel of 256 threads, whose thread i sums vectors i, i + 256, ... then block_sum), keeps
// the y rows in shared memory (up to the device's opt-in size) and reads them for the GEMM instead of x; the CTA that
// routes token t (t % C) writes y and residual_out row t (new tensors: no CTA writes what another reads). The plan,
// the sums and the routing are moe_router_route's, so the op is bit for bit fused_add_rms_norm on a copy of residual
// then moe_router_route; where the y rows do not fit or no cluster of 16 with them is resident, it runs those two.
//
// Devices without clusters (before sm90) get the two-kernel path inside the op (at::linear in logits_dtype, then
// route_kernel): the same result up to the summation order of the logits.
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

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
#include "quant/rms_norm_row.cuh"
#include "quant/rowwise_reduce.cuh"

namespace cutlass_w8a8 {
namespace {

using moe_routing::RouteArgs;

constexpr int kClusterCtas = 8;       // the portable cluster: every router
constexpr int kWideClusterCtas = 16;  // routers of at least kWideRouterBytes where resident (non-portable size)
constexpr int64_t kWideRouterBytes = int64_t(1) << 20;
constexpr int kMaxSlices = 8;
constexpr int kMaxT = static_cast<int>(limits::kMoeRouterRouteMaxT);  // the op checks T against it
constexpr int kRRWarps = 8;
constexpr int kRRThreads = kRRWarps * 32;
constexpr int kChunk = 64;   // H elements per warp step (4 lanes x 16)
constexpr int kTileE = 16;   // experts per mma tile (M)
constexpr int kTileT = 8;    // tokens per mma tile (N)
constexpr int kBatch = 4;    // chunks a warp loads before their mma (32 chunks of Qwen3's H 2048: one batch)
static_assert(kBatch >= 1 && kBatch <= 8, "router_route_kernel: chunks' loads in flight per warp");

struct RouterRouteParams {
  const void* x;      // [T, H], unit column stride, 16-byte aligned rows
  int64_t x_stride;
  const void* w;      // [E, H], same
  int64_t w_stride;
  int t, h, e;
  int tiles;          // ceil(E / kTileE)
  int slices;         // H slices per tile (router_slices)
  int slice_chunks;   // chunks per slice: ceil((H / kChunk) / slices)
  int tokens_per_cta; // ceil(T / C)
  bool round_logits;  // round the float32 sums to T (logits_dtype = x's dtype); else keep float32
  RouteArgs a;
};

// add_rms_norm_moe_router_route's norm (router_route_body's kNorm): x and residual [T, H] (unit column stride,
// 16-byte aligned rows), weight [H]; y and residual_out [T, H] contiguous, written by the CTA that routes the row.
constexpr int kNormPad = 8;  // elements past H in each row of the y rows in shared memory (no 8-way bank conflicts)
struct RouterNormArgs {
  const void* residual;
  int64_t residual_stride;
  const void* weight;
  void* y;
  void* residual_out;
  float eps;
  int xs_offset;  // floats from the start of dynamic shared memory to the y rows (a multiple of 4)
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
[[maybe_unused]] __device__ __forceinline__ void load16(uint32_t (&r)[8], const void* p, bool valid) {
  uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;
  if (valid) {
    lo = __ldg(reinterpret_cast<const uint4*>(p));
    hi = __ldg(reinterpret_cast<const uint4*>(p) + 1);
  }
  r[0] = lo.x; r[1] = lo.y; r[2] = lo.z; r[3] = lo.w;
  r[4] = hi.x; r[5] = hi.y; r[6] = hi.z; r[7] = hi.w;
}

// load16 from shared memory (the kNorm body's y rows).
[[maybe_unused]] __device__ __forceinline__ void load16_shared(uint32_t (&r)[8], const void* p, bool valid) {
  uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;
  if (valid) {
    lo = reinterpret_cast<const uint4*>(p)[0];
    hi = reinterpret_cast<const uint4*>(p)[1];
  }
  r[0] = lo.x; r[1] = lo.y; r[2] = lo.z; r[3] = lo.w;
  r[4] = hi.x; r[5] = hi.y; r[6] = hi.z; r[7] = hi.w;
}

// kNorm: y = RMSNorm(x + residual) * weight of every token row, into shared memory (rows of H + kNormPad elements at
// xs_offset, then 8 x kMaxT + kMaxT floats for the block sums), with rms_norm.cu's float operations in its order for
// H <= 8192 (its one-block register kernel of 256 threads: thread i's vectors i, i + 256, ... summed in that order
// from 0, then block_sum; rms_norm_row.cuh), and the rows this CTA routes (t % C == rank) written to y and
// residual_out. The other CTAs compute the same rows and read nothing another CTA writes.
template <class T, int kC>
__device__ __forceinline__ void router_norm_rows(const RouterRouteParams& p, const RouterNormArgs& n, float* smem,
                                                 int rank) {
  static_assert(kRRThreads == 256, "rms_norm.cu's register kernel: blocks of 256 threads");
  constexpr int N = 16 / sizeof(T);
  using V = Vec<T, N>;
  T* xs = reinterpret_cast<T*>(smem + n.xs_offset);
  const int pitch = p.h + kNormPad;
  float(*warp_value)[kMaxT] = reinterpret_cast<float(*)[kMaxT]>(smem + n.xs_offset + p.t * pitch * sizeof(T) / 4);
  float* sums = &warp_value[kRRWarps][0];
  const int nvec = p.h / N;
  const char* xbytes = static_cast<const char*>(p.x);
  const char* rbytes = static_cast<const char*>(n.residual);
  float ss[kMaxT];
#pragma unroll
  for (int t = 0; t < kMaxT; ++t) {
    ss[t] = 0.f;
    if (t < p.t) {
      const V* xr = reinterpret_cast<const V*>(xbytes + t * p.x_stride * sizeof(T));
      const V* rr = reinterpret_cast<const V*>(rbytes + t * n.residual_stride * sizeof(T));
      for (int idx = threadIdx.x; idx < nvec; idx += kRRThreads) {
        V s = xr[idx];
        add_vec<T, N>(s, rr[idx]);
        ss[t] += sum_squares<T, N>(s);
        *reinterpret_cast<V*>(xs + t * pitch + idx * N) = s;
      }
    }
  }
  block_sum_rows<kRRThreads, kMaxT, kMaxT>(ss, p.t, warp_value, sums);  // ends with a block barrier
  const V* wv = reinterpret_cast<const V*>(n.weight);
  for (int t = 0; t < p.t; ++t) {
    const float inv_rms = inverse_rms(sums[t], p.h, n.eps);
    const bool mine = t % kC == rank;
    V* yo = reinterpret_cast<V*>(static_cast<T*>(n.y) + int64_t(t) * p.h);
    V* ro = reinterpret_cast<V*>(static_cast<T*>(n.residual_out) + int64_t(t) * p.h);
    for (int idx = threadIdx.x; idx < nvec; idx += kRRThreads) {
      V* slot = reinterpret_cast<V*>(xs + t * pitch + idx * N);
      const V s = *slot;
      const V y = normalize<T, N>(s, wv[idx], inv_rms);
      *slot = y;
      if (mine) {
        ro[idx] = s;
        yo[idx] = y;
      }
    }
  }
  __syncthreads();  // the y rows, read by every warp of the GEMM
}

// Shared memory (floats): partial [kRRWarps][NT][kTileE * kTileT], slots [tokens_per_cta][slices][E] (each slice's
// sums of the CTA's tokens; slice 0 then holds the logits), rows [route warps][E] (route warps = min(kRRWarps,
// tokens_per_cta)). Run by a cluster of kC CTAs.
//
// kOneSlice (the plan's slices == 1; router_route_kernel_one_slice): the unit is the tile (no division by the slice
// count in the unit loops), each logit is rounded where its sum is formed and written into its slot as the final
// value, so the pass that adds the slices after the cluster barrier and its block barrier are left out; the weight
// prefetch takes rows by warp and 128-byte lines by lane (no division). The same sums in the same order as the
// general path with one slice: the same bits.
//
// kNorm (add_rms_norm_moe_router_route): x is h, the residual is added and the rows normalized first
// (router_norm_rows, after the wait on the previous kernel), and the GEMM reads those y rows from shared memory.
template <class T, int NT, bool kSigmoid, int kC, bool kOneSlice, bool kNorm = false>
__device__ __forceinline__ void router_route_body(const RouterRouteParams p, const RouterNormArgs& nrm = {}) {
#if CW8A8_HAS_CLUSTERS
  extern __shared__ float rr_smem[];
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  float* partial = rr_smem;
  float* slots = partial + kRRWarps * NT * kTileE * kTileT;
  float* rows = slots + p.tokens_per_cta * (kOneSlice ? 1 : p.slices) * p.e;
  const char* wbytes = static_cast<const char*>(p.w);
  const char* xbytes = static_cast<const char*>(p.x);
  const int chunks = p.h / kChunk;
  const int units = kOneSlice ? p.tiles : p.tiles * p.slices;

  allow_dependent_launch();
  // Every CTA of the cluster must have started before another writes into its shared memory: arrive now, wait
  // after the prefetches (the CTAs of a cluster start together, so the wait is short).
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  // The router weight is not written by the previous kernel: start its reads from HBM before waiting on it (one
  // 128-byte line per chunk and row).
  if constexpr (kOneSlice) {
    for (int m0 = rank * kTileE; m0 < p.e; m0 += kC * kTileE) {
      for (int r = m0 + warp; r < min(m0 + kTileE, p.e); r += kRRWarps) {
        const char* row = wbytes + r * p.w_stride * sizeof(T);
        for (int l = lane; l < chunks; l += 32) {
          asm volatile("prefetch.global.L2 [%0];" ::"l"(row + int64_t(l) * kChunk * sizeof(T)));
        }
      }
    }
  } else {
    for (int u = rank; u < units; u += kC) {
      const int m0 = (u / p.slices) * kTileE, c_begin = (u % p.slices) * p.slice_chunks;
      const int rows_here = min(kTileE, p.e - m0), lines = min(p.slice_chunks, chunks - c_begin);
      for (int i = threadIdx.x; i < rows_here * lines; i += kRRThreads) {
        const char* line = wbytes + (m0 + i / lines) * p.w_stride * sizeof(T) +
                           int64_t(c_begin + i % lines) * kChunk * sizeof(T);
        asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
      }
    }
  }
  if constexpr (kNorm) {  // the norm weight is not written by the previous kernel either (H * 2 bytes: 128-byte lines)
    const char* nw = static_cast<const char*>(nrm.weight);
    for (int l = threadIdx.x; l < p.h * int(sizeof(T)) / 128; l += kRRThreads) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(nw + l * 128));
    }
  }
  wait_for_producers();
  if constexpr (kNorm) router_norm_rows<T, kC>(p, nrm, rr_smem, rank);
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");

  for (int u = rank; u < units; u += kC) {
    const int m0 = (kOneSlice ? u : u / p.slices) * kTileE, slice = kOneSlice ? 0 : u % p.slices;
    const int c_begin = kOneSlice ? 0 : slice * p.slice_chunks;
    const int c_end = kOneSlice ? chunks : min(c_begin + p.slice_chunks, chunks);
    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    const bool ra = m0 + g < p.e, rb = m0 + g + 8 < p.e;
    const char* wa = wbytes + (m0 + g) * p.w_stride * sizeof(T) + q * 16 * sizeof(T);
    const char* wb = wa + 8 * p.w_stride * sizeof(T);
    // kBatch chunks' loads issued before their math (one memory latency per batch, not per chunk); the mma order
    // per warp is chunk c_begin + w, + 8, + 16, ...
    for (int c0 = c_begin + warp; c0 < c_end; c0 += kRRWarps * kBatch) {
      uint32_t ar[kBatch][8], br[kBatch][8], xr[kBatch][NT][8];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int c = c0 + b * kRRWarps;
        const bool in = c < c_end;
        const int64_t kb = int64_t(c) * kChunk * sizeof(T);
        load16(ar[b], wa + kb, ra && in);
        load16(br[b], wb + kb, rb && in);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const int tok = n * kTileT + g;
          if constexpr (kNorm) {
            const T* xs = reinterpret_cast<const T*>(rr_smem + nrm.xs_offset);
            load16_shared(xr[b][n], xs + tok * (p.h + kNormPad) + q * 16 + c * kChunk, in && tok < p.t);
          } else {
            load16(xr[b][n], xbytes + tok * p.x_stride * sizeof(T) + q * 16 * sizeof(T) + kb, in && tok < p.t);
          }
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (c0 + b * kRRWarps >= c_end) break;  // warp-uniform
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t a[4] = {ar[b][2 * j], br[b][2 * j], ar[b][2 * j + 1], br[b][2 * j + 1]};
#pragma unroll
          for (int n = 0; n < NT; ++n) mma_16x8x16<T>(acc[n], a, xr[b][n][2 * j], xr[b][n][2 * j + 1]);
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
      if (expert < p.e && tok < p.t) {
        float* dst = cluster.map_shared_rank(slots, tok % kC);
        if constexpr (kOneSlice) s = p.round_logits ? to_float(from_float<T>(s)) : s;  // the final logit
        dst[((tok / kC) * (kOneSlice ? 1 : p.slices) + slice) * p.e + expert] = s;
      }
    }
    __syncthreads();  // partial is reused by the next unit
  }
  cluster.sync();  // every slice of this CTA's tokens has arrived (and no CTA exits while others write to it)

  if constexpr (!kOneSlice) {
    // the logits: the slices added in slice order, rounded to logits_dtype, into slice 0
    for (int i = 0; i < p.tokens_per_cta && rank + i * kC < p.t; ++i) {
      float* slot = slots + i * p.slices * p.e;
      for (int k = threadIdx.x; k < p.e; k += kRRThreads) {
        float s = slot[k];
        for (int sl = 1; sl < p.slices; ++sl) s += slot[sl * p.e + k];
        slot[k] = p.round_logits ? to_float(from_float<T>(s)) : s;
      }
    }
    __syncthreads();
  }

  const int route_warps = min(kRRWarps, p.tokens_per_cta);
  if (warp < route_warps) {
    float* row = rows + warp * p.e;
    for (int i = warp; i < p.tokens_per_cta; i += route_warps) {
      const int t = rank + i * kC;
      if (t >= p.t) break;
      const float* lg = slots + i * (kOneSlice ? 1 : p.slices) * p.e;
      auto logit = [&](int k) { return lg[k]; };
      moe_routing::route_row<kSigmoid>(logit, row, p.a, t, lane);
      __syncwarp();  // the next token reuses row
    }
  }
#else
  __trap();  // not reached: launched only where clusters_available
#endif
}

// Any plan: a cluster of kC CTAs from the launch attribute (kC > 8 needs the non-portable size).
template <class T, int NT, bool kSigmoid, int kC>
__global__ void __launch_bounds__(kRRThreads, 1) router_route_kernel(const RouterRouteParams p) {
  router_route_body<T, NT, kSigmoid, kC, false>(p);
}

// The portable plan with one slice (Qwen3-30B-A3B, OLMoE: 8 CTAs x 1 slice): the cluster of kClusterCtas in the
// binary (launched without the attribute, as the former one-tile-per-CTA kernel) and router_route_body's kOneSlice.
template <class T, int NT, bool kSigmoid>
__global__ void CW8A8_CLUSTER_DIMS(kClusterCtas, 1, 1) __launch_bounds__(kRRThreads, 1)
    router_route_kernel_one_slice(const RouterRouteParams p) {
  router_route_body<T, NT, kSigmoid, kClusterCtas, true>(p);
}

// add_rms_norm_moe_router_route's kernels: the two above with the norm (router_route_body's kNorm).
template <class T, int NT, bool kSigmoid, int kC>
__global__ void __launch_bounds__(kRRThreads, 1)
    router_norm_route_kernel(const RouterRouteParams p, const RouterNormArgs n) {
  router_route_body<T, NT, kSigmoid, kC, false, true>(p, n);
}

template <class T, int NT, bool kSigmoid>
__global__ void CW8A8_CLUSTER_DIMS(kClusterCtas, 1, 1) __launch_bounds__(kRRThreads, 1)
    router_norm_route_kernel_one_slice(const RouterRouteParams p, const RouterNormArgs n) {
  router_route_body<T, NT, kSigmoid, kClusterCtas, true, true>(p, n);
}

constexpr int64_t kMaxSlotBytes = 32 * 1024;  // slots: with partial and rows, at most 48 KiB of shared memory

size_t router_route_smem(int nt, int tokens_per_cta, int slices, int e) {
  const int route_warps = tokens_per_cta < kRRWarps ? tokens_per_cta : kRRWarps;
  return sizeof(float) * (static_cast<size_t>(kRRWarps) * nt * kTileE * kTileT +
                          (static_cast<size_t>(tokens_per_cta) * slices + route_warps) * e);
}

// H slices per 16-expert tile for a cluster of c CTAs, from E, H and c only (never T: the logits' summation order is
// a token's own). A unit is latency-bound: its warps load in rounds of kBatch chunks each, then it pays a fixed cost
// (two barriers, the warps' reduce, the DSMEM writes: counted as one round). The s in [1, kMaxSlices] with the least
// ceil(tiles x s / c) x (ceil(ceil(chunks / s) / (kRRWarps x kBatch)) + 1) -- units on the busiest CTA times the rounds
// of one -- serves; ties keep fewer slices. s stays within chunks / kRRWarps (a warp per chunk at least) and the
// slots of ceil(kMaxT / c) tokens within kMaxSlotBytes. E.g. c 8: Qwen3-30B-A3B (8 tiles, 32 chunks), OLMoE (4 tiles)
// and E 60 at H 1088 one slice, Mixtral (1 tile, 64 chunks) 2; c 16: DeepSeek-V3 (16 tiles, 112 chunks) and GLM-4.5
// (10 tiles, 80 chunks) 1, Kimi-K2 (24 tiles, 112 chunks) 2, E 128 at H 7168 2.
int router_slices(int tiles, int chunks, int e, int c) {
  const int64_t tokens_per_cta = (kMaxT + c - 1) / c;
  const int64_t per_round = int64_t(kRRWarps) * kBatch;
  auto cost = [&](int64_t s) {
    const int64_t units = (int64_t(tiles) * s + c - 1) / c;
    const int64_t slice_chunks = (chunks + s - 1) / s;
    return units * ((slice_chunks + per_round - 1) / per_round + 1);
  };
  int best = 1;
  int64_t best_cost = cost(1);
  for (int s = 2; s <= kMaxSlices; ++s) {
    if (chunks / s < kRRWarps || tokens_per_cta * s * e * int64_t(sizeof(float)) > kMaxSlotBytes) break;
    const int64_t v = cost(s);
    if (v < best_cost) {
      best = s;
      best_cost = v;
    }
  }
  return best;
}

// Whether at least one cluster of kWideClusterCtas CTAs of `kernel` (kRRThreads threads and `smem` bytes of dynamic
// shared memory each) can be resident on the current device. An unsupported configuration is an error of the query:
// not resident, and no error is left behind. The caller sets the non-portable cluster size first.
template <class... KArgs>
bool wide_cluster_fits(void (*kernel)(KArgs...), size_t smem) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(kWideClusterCtas);
  cfg.blockDim = dim3(kRRThreads);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = kWideClusterCtas;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    clusters = 0;
  }
  return clusters > 0;
}

// Whether a cluster of kWideClusterCtas CTAs of the router (!kNorm) or norm (kNorm) kernels can be resident: defined
// below, with the norm kernels' attributes.
template <class T, bool kNorm>
bool wide_cluster_resident(int device);

// The cluster size and H slices moe_router_route uses for E experts of H in `dtype` on `device` (the current device).
struct RouterPlan {
  int ctas;
  int slices;
};
RouterPlan router_plan(int device, int64_t e, int64_t h, at::ScalarType dtype) {
  const bool bf16 = dtype == at::kBFloat16;
  const bool wide = e * h * int64_t(c10::elementSize(dtype)) >= kWideRouterBytes &&
                    (bf16 ? wide_cluster_resident<__nv_bfloat16, false>(device)
                          : wide_cluster_resident<__half, false>(device));
  const int c = wide ? kWideClusterCtas : kClusterCtas;
  const int tiles = static_cast<int>((e + kTileE - 1) / kTileE);
  return {c, router_slices(tiles, static_cast<int>(h / kChunk), static_cast<int>(e), c)};
}

// The launch arguments of both ops for x [T, H] (T >= 1) and router_weight [E, H] under `plan` (router_plan),
// writing into weights / ids.
RouterRouteParams router_params(const at::Tensor& x, const at::Tensor& router_weight, int64_t top_k, bool sigmoid,
                                const std::optional<at::Tensor>& correction_bias, int64_t n_group, int64_t topk_group,
                                bool renormalize, double scaling_factor, at::ScalarType ldt, const RouterPlan& plan,
                                at::Tensor& weights, at::Tensor& ids) {
  const int64_t t = x.size(0), h = x.size(1), e = router_weight.size(0);
  RouterRouteParams p{};
  p.x = x.data_ptr();
  p.x_stride = t > 1 ? x.stride(0) : h;
  p.w = router_weight.data_ptr();
  p.w_stride = e > 1 ? router_weight.stride(0) : h;
  p.t = static_cast<int>(t);
  p.h = static_cast<int>(h);
  p.e = static_cast<int>(e);
  const int c = plan.ctas;
  p.tiles = static_cast<int>((e + kTileE - 1) / kTileE);
  p.slices = plan.slices;
  const int chunks = p.h / kChunk;
  p.slice_chunks = (chunks + p.slices - 1) / p.slices;
  p.tokens_per_cta = static_cast<int>((t + c - 1) / c);
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
  return p;
}

// Calls launch(T{}, NT constant, kSigmoid constant) for the dtype, the token tiles (nt 1 or 2) and the scoring.
template <class F>
void dispatch_router(bool bf16, int nt, bool sigmoid, F&& launch) {
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
  if (bf16) {
    by_sig(__nv_bfloat16{});
  } else {
    by_sig(__half{});
  }
}

// --- add_rms_norm_moe_router_route's launch: more than 48 KiB of shared memory (the y rows) ----------------------

// The device's opt-in shared memory per block, asked once per device.
int max_optin_smem(int device) {
  static std::array<std::atomic<int>, 64> known{};  // 0: not asked yet
  std::atomic<int>& v = known.at(static_cast<size_t>(device));
  int bytes = v.load(std::memory_order_acquire);
  if (bytes == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    v.store(bytes, std::memory_order_release);
  }
  return bytes;
}

// Sets a norm kernel's attributes once per (kernel, device): the opt-in shared memory, and for the clusters of 16 the
// non-portable cluster size.
void prepare_norm_kernel(const void* kernel, int device, bool wide) {
  static std::mutex mutex;
  static std::vector<std::pair<const void*, int>> done;
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& d : done) {
    if (d.first == kernel && d.second == device) return;
  }
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_optin_smem(device)));
  if (wide) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  done.emplace_back(kernel, device);
}

// Whether a cluster of kWideClusterCtas CTAs of every wide instantiation can be resident on the current device,
// asked once per (device, T) and cached. Both token tiles and both scorings: the cluster size must not depend on T
// or the routing (the slices follow it).
//   !kNorm: router_route_kernel<T, *, *, 16>; sets the kernels' non-portable cluster attribute first (a cluster above
//           8 CTAs needs it, to launch and to ask); asked at 48 KiB, the most router_route_smem gives (router_slices'
//           bound).
//   kNorm:  router_norm_route_kernel<T, *, *, 16>, with the most shared memory a CTA may have (then at any size;
//           prepare_norm_kernel sets both attributes). Where not, add_rms_norm_moe_router_route runs its two-op
//           composition.
template <class T, bool kNorm>
bool wide_cluster_resident(int device) {
  static std::array<std::atomic<int>, 64> state{};  // 0: not asked yet, 1: resident, 2: not
  std::atomic<int>& known = state.at(static_cast<size_t>(device));
  const int v = known.load(std::memory_order_acquire);
  if (v != 0) return v == 1;
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  if (known.load(std::memory_order_relaxed) != 0) return known.load(std::memory_order_relaxed) == 1;
  bool ok = true;
  auto ask = [&](auto kernel) {
    if (!ok) return;
    if constexpr (kNorm) {
      prepare_norm_kernel(reinterpret_cast<const void*>(kernel), device, true);
      ok = wide_cluster_fits(kernel, static_cast<size_t>(max_optin_smem(device)));
    } else {
      if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
        (void)cudaGetLastError();
        ok = false;
        return;
      }
      ok = wide_cluster_fits(kernel, 48 * 1024);
    }
  };
  if constexpr (kNorm) {
    ask(router_norm_route_kernel<T, 1, false, kWideClusterCtas>);
    ask(router_norm_route_kernel<T, 2, false, kWideClusterCtas>);
    ask(router_norm_route_kernel<T, 1, true, kWideClusterCtas>);
    ask(router_norm_route_kernel<T, 2, true, kWideClusterCtas>);
  } else {
    ask(router_route_kernel<T, 1, false, kWideClusterCtas>);
    ask(router_route_kernel<T, 2, false, kWideClusterCtas>);
    ask(router_route_kernel<T, 1, true, kWideClusterCtas>);
    ask(router_route_kernel<T, 2, true, kWideClusterCtas>);
  }
  known.store(ok ? 1 : 2, std::memory_order_release);
  return ok;
}

// Launches one grid of a cluster of kRRThreads-thread CTAs by the plan (router_plan): wide, wide_kernel on a cluster
// of kWideClusterCtas (the launch attribute, non-portable size); one slice, one_slice_kernel (its cluster of
// kClusterCtas is the kernel's own, __cluster_dims__); else kernel on a cluster of kClusterCtas (the launch
// attribute). prepare(kernel, wide) runs first on the kernel launched (the norm kernels' attributes).
template <class KWide, class KOneSlice, class K, class Prepare, class... Args>
void launch_by_plan(bool wide, int slices, KWide wide_kernel, KOneSlice one_slice_kernel, K kernel,
                    Prepare&& prepare, size_t smem, cudaStream_t stream, bool pdl, const Args&... args) {
  if (wide) {
    prepare(wide_kernel, true);
    C10_CUDA_CHECK(launch_kernel_cluster(wide_kernel, dim3(kWideClusterCtas), dim3(kRRThreads), smem, stream, pdl,
                                         dim3(kWideClusterCtas, 1, 1), args...));
  } else if (slices == 1) {
    prepare(one_slice_kernel, false);
    C10_CUDA_CHECK(launch_kernel(one_slice_kernel, dim3(kClusterCtas), dim3(kRRThreads), smem, stream, pdl, args...));
  } else {
    prepare(kernel, false);
    C10_CUDA_CHECK(launch_kernel_cluster(kernel, dim3(kClusterCtas), dim3(kRRThreads), smem, stream, pdl,
                                         dim3(kClusterCtas, 1, 1), args...));
  }
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

  const RouterPlan plan = router_plan(device, e, h, x.scalar_type());
  const RouterRouteParams p = router_params(x, router_weight, top_k, sigmoid, correction_bias, n_group, topk_group,
                                            renormalize, scaling_factor, ldt, plan, weights, ids);
  const bool wide = plan.ctas == kWideClusterCtas;
  const int nt = t > kTileT ? 2 : 1;
  const size_t smem = router_route_smem(nt, p.tokens_per_cta, p.slices, p.e);  // <= 48 KiB (router_slices)
  const bool pdl = kernels_use_pdl(device);
  cudaStream_t stream = current_stream(x);
  dispatch_router(x.scalar_type() == at::kBFloat16, nt, sigmoid, [&](auto tag, auto nt_c, auto sig_c) {
    using T = decltype(tag);
    constexpr int kNt = decltype(nt_c)::value;
    constexpr bool kSig = decltype(sig_c)::value;
    launch_by_plan(wide, p.slices, router_route_kernel<T, kNt, kSig, kWideClusterCtas>,
                   router_route_kernel_one_slice<T, kNt, kSig>, router_route_kernel<T, kNt, kSig, kClusterCtas>,
                   [](auto, bool) {}, smem, stream, pdl, p);
  });
  return {weights, ids};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_rms_norm_moe_router_route(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& norm_weight, double eps,
    const at::Tensor& router_weight, int64_t top_k, c10::string_view scoring,
    const std::optional<at::Tensor>& correction_bias, int64_t n_group, int64_t topk_group, bool renormalize,
    double scaling_factor, std::optional<at::ScalarType> logits_dtype) {
  constexpr const char* op = "add_rms_norm_moe_router_route";
  moe::check_norm_router_route(op, x, residual, norm_weight, eps, router_weight, top_k, scoring, correction_bias,
                               n_group, topk_group, scaling_factor, logits_dtype);
  check_cuda(op, "x", x);
  c10::cuda::CUDAGuard guard(x.device());
  const at::ScalarType ldt = logits_dtype.value_or(x.scalar_type());
  const bool sigmoid = scoring == "sigmoid";
  const int64_t t = x.size(0), h = x.size(1), e = router_weight.size(0);
  const int device = x.get_device();
  const auto opts = x.options();
  at::Tensor residual_out = at::empty({t, h}, opts);
  if (t == 0) {
    return {at::empty({0, h}, opts), residual_out, at::empty({0, top_k}, opts.dtype(at::kFloat)),
            at::empty({0, top_k}, opts.dtype(at::kInt))};
  }
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int nt = t > kTileT ? 2 : 1;
  bool fused = clusters_available(device);
  RouterPlan plan{0, 0};
  size_t smem = 0;
  int xs_offset = 0;
  if (fused) {
    plan = router_plan(device, e, h, x.scalar_type());
    const int c = plan.ctas;
    const int tokens_per_cta = static_cast<int>((t + c - 1) / c);
    const size_t base = router_route_smem(nt, tokens_per_cta, plan.slices, static_cast<int>(e));
    xs_offset = static_cast<int>((base + 15) / 16 * 4);
    smem = size_t(xs_offset) * 4 + size_t(t) * size_t(h + kNormPad) * x.element_size() +
           size_t(kRRWarps + 1) * kMaxT * sizeof(float);
    fused = smem <= static_cast<size_t>(max_optin_smem(device)) &&
            (plan.ctas != kWideClusterCtas ||
             (bf16 ? wide_cluster_resident<__nv_bfloat16, true>(device) : wide_cluster_resident<__half, true>(device)));
  }
  if (!fused) {  // before sm90, y rows above the shared memory, or no resident cluster of 16: the two ops
    residual_out.copy_(residual);
    at::Tensor y = fused_add_rms_norm(x, residual_out, norm_weight, eps);
    auto [weights, ids] = moe_router_route(y, router_weight, top_k, scoring, correction_bias, n_group, topk_group,
                                           renormalize, scaling_factor, logits_dtype);
    return {y, residual_out, weights, ids};
  }
  at::Tensor y = at::empty({t, h}, opts);
  at::Tensor weights = at::empty({t, top_k}, opts.dtype(at::kFloat));
  at::Tensor ids = at::empty({t, top_k}, opts.dtype(at::kInt));
  const RouterRouteParams p = router_params(x, router_weight, top_k, sigmoid, correction_bias, n_group, topk_group,
                                            renormalize, scaling_factor, ldt, plan, weights, ids);
  RouterNormArgs n{};
  n.residual = residual.data_ptr();
  n.residual_stride = t > 1 ? residual.stride(0) : h;
  n.weight = norm_weight.data_ptr();
  n.y = y.data_ptr();
  n.residual_out = residual_out.data_ptr();
  n.eps = static_cast<float>(eps);
  n.xs_offset = xs_offset;
  const bool wide = plan.ctas == kWideClusterCtas;
  const bool pdl = kernels_use_pdl(device);
  cudaStream_t stream = current_stream(x);
  dispatch_router(bf16, nt, sigmoid, [&](auto tag, auto nt_c, auto sig_c) {
    using T = decltype(tag);
    constexpr int kNt = decltype(nt_c)::value;
    constexpr bool kSig = decltype(sig_c)::value;
    auto prepare = [&](auto kernel, bool wide_cluster) {
      prepare_norm_kernel(reinterpret_cast<const void*>(kernel), device, wide_cluster);
    };
    launch_by_plan(wide, p.slices, router_norm_route_kernel<T, kNt, kSig, kWideClusterCtas>,
                   router_norm_route_kernel_one_slice<T, kNt, kSig>,
                   router_norm_route_kernel<T, kNt, kSig, kClusterCtas>, prepare, smem, stream, pdl, p, n);
  });
  return {y, residual_out, weights, ids};
}

std::vector<int64_t> moe_router_route_plan(int64_t device, int64_t experts, int64_t hidden, at::ScalarType dtype) {
  constexpr const char* op = "cutlass_w8a8._moe_router_route_plan";
  TORCH_CHECK_VALUE(device >= 0 && device < 64, op, ": `device` must be a CUDA device index, got ", device);
  TORCH_CHECK_VALUE(experts >= 1 && experts <= 1024, op, ": `experts` must be in [1, 1024], got ", experts);
  TORCH_CHECK_VALUE(hidden >= kChunk && hidden % kChunk == 0, op, ": `hidden` must be a positive multiple of ", kChunk,
                    ", got ", hidden);
  TORCH_CHECK_VALUE(dtype == at::kBFloat16 || dtype == at::kHalf, op, ": `dtype` must be bfloat16 or float16");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  if (!clusters_available(static_cast<int>(device))) return {0, 0};
  const RouterPlan plan = router_plan(static_cast<int>(device), experts, hidden, dtype);
  return {plan.ctas, plan.slices};
}

}  // namespace cutlass_w8a8
