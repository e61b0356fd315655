// The routing of a mixture-of-experts layer around its grouped GEMMs (cutlass_w8a8/ops/moe.py documents the ops):
//
//   moe_topk_softmax   router logits [T, E] -> the top_k experts of each token and their softmax weights
//   moe_route          the same with transformers' other routers: sigmoid scores, a correction bias for the
//                      selection, grouped top-k, renormalization and a scaling factor (moe_topk_softmax is its
//                      softmax case; both run route_kernel)
//   moe_align          topk_ids [T, k] -> the T * k (token, expert) pairs sorted by expert (stable counting sort),
//                      the inverse permutation and the end row of each expert's group
//   moe_unpermute      the experts' outputs in that order -> out[t] = sum_j w[t, j] * y[dst_pos[t * k + j]]
//
// (moe_permute_quant, the gather fused with the activation quantization, is in permute_quant.cu: it runs the
// row-wise kernels of quant/rowwise_reduce.cuh.)
//
// Every op: one launch on the current stream, outputs from the caching allocator, no host synchronisation, grid
// and parameters fixed by the shapes (never by the routing), so a captured CUDA graph replays with new logits.
// Device data (ids, positions) is never trusted for addressing: out-of-range values are routed nowhere or
// clamped, as the CPU implementations (ops/_reference.py) define.
//
// The launches are not recorded for UpdatableGraph.set_rows (graphs/graph_nodes.hpp): in a graph whose row-wise
// nodes are updated to fewer rows, these kernels run over every captured token, as torch's kernels there do.
// Each token's routing, rows and sum depend on that token alone, so the real tokens' results are right and the
// padded tokens only cost time.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

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

// --- moe_topk_softmax / moe_route ---------------------------------------------------------------------------------
//
// One warp per token (kTopkWarps per block), each with E floats of shared memory: route_row (moe/route_row.cuh, the
// routing shared with moe_router_route) on the logits read from global memory as float32.

using moe_routing::kFullMask;
using moe_routing::RouteArgs;

constexpr int kTopkWarps = 4;

template <class T, bool kSigmoid>
__global__ void __launch_bounds__(kTopkWarps * 32) route_kernel(const T* __restrict__ logits, RouteArgs a) {
  extern __shared__ float topk_smem[];
  allow_dependent_launch();
  wait_for_producers();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = int64_t(blockIdx.x) * kTopkWarps + warp;
  if (t >= a.rows) return;  // a whole warp; the kernel has no block-wide barrier
  const T* src = logits + t * a.stride0;
  const int64_t stride1 = a.stride1;
  auto logit = [&](int i) { return to_float(src[i * stride1]); };
  moe_routing::route_row<kSigmoid>(logit, topk_smem + warp * a.e, a, t, lane);
}

// --- moe_align --------------------------------------------------------------------------------------------------
//
// One block of kAlignThreads. Bucket b of pair p = ids[p] when in [0, E), else E (unrouted, after every expert).
// The pairs are split into `groups` contiguous segments, one per warp (warp w < groups), so the stable order is:
// segment by segment, and within a segment in steps of 32 pairs, lane by lane.
//   1. counts[w][b]: pairs of segment w in bucket b (per step, __match_any_sync groups the lanes of one bucket;
//      the lowest such lane adds their count: no atomics, so no order to race on);
//   2. totals per bucket, an exclusive scan over buckets (start of each bucket; offsets = inclusive ends);
//   3. counts[w][b] := start[b] + pairs of bucket b in segments < w (a scan down each column);
//   4. each warp walks its segment again: position = counts[w][b] + the rank of its lane among the step's lanes of
//      bucket b; then the lowest lane advances counts[w][b].
// Deterministic: nothing depends on scheduling. Shared memory: (groups + 1) * (E + 1) ints, under 48 KB (groups =
// 32, or fewer for E > 371: 10 at E = 1024), so any T * k works in one block (a warp walks ceil(P / groups)
// pairs twice: 64K pairs at E = 128 is 2048 per warp).

constexpr int kAlignThreads = 1024;
constexpr int kAlignWarps = kAlignThreads / 32;
constexpr int kAlignSmemInts = 12224;  // dynamic shared memory budget: 48 KB less the static warp_sums

int align_groups(int buckets) {
  const int g = (kAlignSmemInts - buckets) / buckets;
  return g < kAlignWarps ? g : kAlignWarps;
}

template <class I>
__global__ void __launch_bounds__(kAlignThreads)
    align_kernel(const I* __restrict__ ids, int64_t stride0, int64_t stride1, int k, int64_t pairs, int e,
                 int groups, int* __restrict__ sorted_pairs, int* __restrict__ dst_pos, int* __restrict__ offsets) {
  extern __shared__ int align_smem[];
  __shared__ int warp_sums[kAlignWarps];
  allow_dependent_launch();
  wait_for_producers();
  const int buckets = e + 1;
  int* counts = align_smem;                  // [groups][buckets]
  int* starts = align_smem + groups * buckets;  // [buckets]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const unsigned lanes_below = (1u << lane) - 1u;

  for (int i = tid; i < groups * buckets; i += kAlignThreads) counts[i] = 0;
  __syncthreads();

  const int64_t seg = (pairs + groups - 1) / groups;
  const int64_t begin = warp * seg;
  const int64_t end = begin + seg < pairs ? begin + seg : pairs;
  auto bucket_of = [&](int64_t p) {
    const int64_t t = p / k;
    const int64_t j = p - t * k;
    const I id = ids[t * stride0 + j * stride1];
    return (id >= 0 && id < e) ? static_cast<int>(id) : e;
  };

  // 1. per-segment counts
  if (warp < groups) {
    int* mine = counts + warp * buckets;
    for (int64_t base = begin; base < end; base += 32) {
      const int64_t p = base + lane;
      const bool valid = p < end;
      const int b = valid ? bucket_of(p) : -1;
      const unsigned peers = __match_any_sync(kFullMask, b);
      if (valid && (peers & lanes_below) == 0) mine[b] += __popc(peers);
      __syncwarp();
    }
  }
  __syncthreads();

  // 2. bucket totals, then their exclusive scan (thread tid owns buckets [tid * per, tid * per + per))
  for (int b = tid; b < buckets; b += kAlignThreads) {
    int s = 0;
    for (int g = 0; g < groups; ++g) s += counts[g * buckets + b];
    starts[b] = s;
  }
  __syncthreads();
  const int per = (buckets + kAlignThreads - 1) / kAlignThreads;
  const int first = tid * per;
  int local = 0;
  for (int i = 0; i < per; ++i) {
    if (first + i < buckets) local += starts[first + i];
  }
  int incl = local;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int v = __shfl_up_sync(kFullMask, incl, off);
    if (lane >= off) incl += v;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = warp_sums[lane];
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int v = __shfl_up_sync(kFullMask, w, off);
      if (lane >= off) w += v;
    }
    warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  int run = incl - local + (warp > 0 ? warp_sums[warp - 1] : 0);
  for (int i = 0; i < per; ++i) {
    const int b = first + i;
    if (b < buckets) {
      const int c = starts[b];
      starts[b] = run;
      run += c;
      if (b < e) offsets[b] = run;
    }
  }
  __syncthreads();

  // 3. each segment's first position in each bucket
  for (int b = tid; b < buckets; b += kAlignThreads) {
    int pos = starts[b];
    for (int g = 0; g < groups; ++g) {
      const int c = counts[g * buckets + b];
      counts[g * buckets + b] = pos;
      pos += c;
    }
  }
  __syncthreads();

  // 4. positions
  if (warp < groups) {
    int* next = counts + warp * buckets;
    for (int64_t base = begin; base < end; base += 32) {
      const int64_t p = base + lane;
      const bool valid = p < end;
      const int b = valid ? bucket_of(p) : -1;
      const unsigned peers = __match_any_sync(kFullMask, b);
      if (valid) {
        const int pos = next[b] + __popc(peers & lanes_below);
        sorted_pairs[pos] = static_cast<int>(p);
        dst_pos[p] = b < e ? pos : -1;
      }
      __syncwarp();  // every lane has read next[b] before it moves
      if (valid && (peers & lanes_below) == 0) next[b] += __popc(peers);
      __syncwarp();
    }
  }
}

// --- moe_unpermute ---------------------------------------------------------------------------------------------
//
// One block per token t; each thread owns N-element column vectors of the row. acc = 0, then for j = 0 .. k-1 with
// d = dst_pos[t * k + j] in [0, T * k): acc += w[t, j] * y[d] (the product and the sum each rounded to float32,
// never fused: the CPU reference's operations), then one rounding to T.

constexpr int kUnpermuteThreads = 256;

template <class T, int N>
__global__ void __launch_bounds__(kUnpermuteThreads)
    unpermute_kernel(const T* __restrict__ y, int64_t y_stride, const int* __restrict__ dst_pos,
                     const float* __restrict__ weights, int k, int64_t n, int h, T* __restrict__ out) {
  allow_dependent_launch();
  wait_for_producers();
  using V = Vec<T, N>;
  const int64_t t = blockIdx.x;
  const int nvec = h / N;
  V* out_row = reinterpret_cast<V*>(out + t * h);
  for (int v = threadIdx.x; v < nvec; v += kUnpermuteThreads) {
    float acc[N];
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i] = 0.f;
    for (int j = 0; j < k; ++j) {
      const int d = dst_pos[t * k + j];
      if (d < 0 || d >= n) continue;
      const float w = weights[t * k + j];
      const V yv = reinterpret_cast<const V*>(y + d * y_stride)[v];
#pragma unroll
      for (int i = 0; i < N; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w, to_float(yv.v[i])));
    }
    V o;
#pragma unroll
    for (int i = 0; i < N; ++i) o.v[i] = from_float<T>(acc[i]);
    out_row[v] = o;
  }
}

template <class F>
void dispatch_float(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kBFloat16: f(__nv_bfloat16{}); break;
    case at::kHalf: f(__half{}); break;
    default: f(float{}); break;  // float32: the checks admit nothing else
  }
}

void unpermute_impl(const char* op, at::Tensor& out, const at::Tensor& y, const at::Tensor& dst_pos,
                    const at::Tensor& topk_weights) {
  const int64_t t = topk_weights.size(0), k = topk_weights.size(1), h = y.size(1);
  if (t == 0 || h == 0) return;
  const at::Tensor y2 = y.stride(1) == 1 || h == 1 ? y : y.contiguous();
  const at::Tensor d2 = dst_pos.contiguous();
  const at::Tensor w2 = topk_weights.contiguous();
  const bool pdl = kernels_use_pdl(y.get_device());
  cudaStream_t stream = current_stream(y);
  dispatch_float(y.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = 16 / sizeof(T);
    const T* yp = reinterpret_cast<const T*>(y2.data_ptr());
    T* op_out = reinterpret_cast<T*>(out.data_ptr());
    const int64_t y_stride = y2.size(0) > 1 ? y2.stride(0) : h;
    const bool vectorizable = h % N == 0 && y_stride % N == 0 && is_aligned(yp, 16) && is_aligned(op_out, 16);
    auto kernel = vectorizable ? unpermute_kernel<T, N> : unpermute_kernel<T, 1>;
    C10_CUDA_CHECK(launch_kernel(kernel, dim3(static_cast<unsigned>(t)), dim3(kUnpermuteThreads), 0, stream, pdl,
                                 yp, y_stride, d2.data_ptr<int>(), w2.data_ptr<float>(), static_cast<int>(k),
                                 t * k, static_cast<int>(h), op_out));
  });
}

// moe_topk_softmax and moe_route, checked: one route_kernel launch (none for T = 0).
std::tuple<at::Tensor, at::Tensor> route_impl(const at::Tensor& logits, int64_t top_k, bool sigmoid,
                                              const std::optional<at::Tensor>& bias, int64_t n_group,
                                              int64_t topk_group, bool renormalize, double scaling_factor) {
  const int64_t t = logits.size(0), e = logits.size(1);
  const auto opts = logits.options();
  at::Tensor weights = at::empty({t, top_k}, opts.dtype(at::kFloat));
  at::Tensor ids = at::empty({t, top_k}, opts.dtype(at::kInt));
  if (t == 0) return {weights, ids};
  RouteArgs a{};
  a.rows = t;
  a.stride0 = logits.stride(0);
  a.stride1 = logits.stride(1);
  a.e = static_cast<int>(e);
  a.k = static_cast<int>(top_k);
  a.bias = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  a.bias_stride = bias.has_value() ? bias->stride(0) : 0;
  a.n_group = static_cast<int>(n_group);
  a.group_size = static_cast<int>(e / n_group);
  a.topk_group = static_cast<int>(topk_group);
  a.renormalize = renormalize;
  // torch adds DeepSeek-V3's `+ 1e-20` (a Python float) and multiplies by routed_scaling_factor as float32 values
  // cast from the doubles
  a.renorm_eps = sigmoid ? static_cast<float>(1e-20) : 0.f;
  a.scale = static_cast<float>(scaling_factor);
  a.weights = weights.data_ptr<float>();
  a.ids = ids.data_ptr<int>();
  const bool pdl = kernels_use_pdl(logits.get_device());
  cudaStream_t stream = current_stream(logits);
  const unsigned blocks = static_cast<unsigned>((t + kTopkWarps - 1) / kTopkWarps);
  const size_t smem = sizeof(float) * kTopkWarps * static_cast<size_t>(e);  // <= 16 KB (E <= 1024)
  dispatch_float(logits.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    auto kernel = sigmoid ? route_kernel<T, true> : route_kernel<T, false>;
    C10_CUDA_CHECK(launch_kernel(kernel, dim3(blocks), dim3(kTopkWarps * 32), smem, stream, pdl,
                                 reinterpret_cast<const T*>(logits.data_ptr()), a));
  });
  return {weights, ids};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> moe_topk_softmax(const at::Tensor& router_logits, int64_t top_k,
                                                    bool renormalize) {
  constexpr const char* op = "moe_topk_softmax";
  moe::check_topk_softmax(op, router_logits, top_k);
  check_cuda(op, "router_logits", router_logits);
  c10::cuda::CUDAGuard guard(router_logits.device());
  return route_impl(router_logits, top_k, false, std::nullopt, 1, 1, renormalize, 1.0);
}

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& router_logits, int64_t top_k, c10::string_view scoring,
                                             const std::optional<at::Tensor>& correction_bias, int64_t n_group,
                                             int64_t topk_group, bool renormalize, double scaling_factor) {
  constexpr const char* op = "moe_route";
  moe::check_route(op, router_logits, top_k, scoring, correction_bias, n_group, topk_group, scaling_factor);
  check_cuda(op, "router_logits", router_logits);
  c10::cuda::CUDAGuard guard(router_logits.device());
  return route_impl(router_logits, top_k, scoring == "sigmoid", correction_bias, n_group, topk_group, renormalize,
                    scaling_factor);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_align(const at::Tensor& topk_ids, int64_t num_experts) {
  constexpr const char* op = "moe_align";
  moe::check_align(op, topk_ids, num_experts);
  check_cuda(op, "topk_ids", topk_ids);
  c10::cuda::CUDAGuard guard(topk_ids.device());
  const int64_t k = topk_ids.size(1), pairs = topk_ids.size(0) * k;
  const auto opts = topk_ids.options().dtype(at::kInt);
  at::Tensor sorted_pairs = at::empty({pairs}, opts);
  at::Tensor dst_pos = at::empty({pairs}, opts);
  at::Tensor offsets = at::empty({num_experts}, opts);
  // Launched for P = 0 too: it writes the (zero) offsets.
  const int e = static_cast<int>(num_experts);
  const int groups = align_groups(e + 1);
  const size_t smem = sizeof(int) * static_cast<size_t>(groups + 1) * static_cast<size_t>(e + 1);
  const bool pdl = kernels_use_pdl(topk_ids.get_device());
  cudaStream_t stream = current_stream(topk_ids);
  auto launch = [&](auto tag) {
    using I = decltype(tag);
    C10_CUDA_CHECK(launch_kernel(align_kernel<I>, dim3(1), dim3(kAlignThreads), smem, stream, pdl,
                                 reinterpret_cast<const I*>(topk_ids.data_ptr()), topk_ids.stride(0),
                                 topk_ids.stride(1), static_cast<int>(k), pairs, e, groups,
                                 sorted_pairs.data_ptr<int>(), dst_pos.data_ptr<int>(), offsets.data_ptr<int>()));
  };
  if (topk_ids.scalar_type() == at::kInt) {
    launch(int32_t{});
  } else {
    launch(int64_t{});
  }
  return {sorted_pairs, dst_pos, offsets};
}

at::Tensor moe_unpermute(const at::Tensor& y, const at::Tensor& dst_pos, const at::Tensor& topk_weights) {
  constexpr const char* op = "moe_unpermute";
  moe::check_unpermute(op, y, dst_pos, topk_weights, std::nullopt);
  check_cuda(op, "y", y);
  c10::cuda::CUDAGuard guard(y.device());
  at::Tensor out = at::empty({topk_weights.size(0), y.size(1)}, y.options());
  unpermute_impl(op, out, y, dst_pos, topk_weights);
  return out;
}

void moe_unpermute_out(at::Tensor& out, const at::Tensor& y, const at::Tensor& dst_pos,
                       const at::Tensor& topk_weights) {
  constexpr const char* op = "moe_unpermute";
  moe::check_unpermute(op, y, dst_pos, topk_weights, out);
  check_cuda(op, "y", y);
  c10::cuda::CUDAGuard guard(y.device());
  unpermute_impl(op, out, y, dst_pos, topk_weights);
}

}  // namespace cutlass_w8a8
