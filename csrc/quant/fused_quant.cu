// Fused non-GEMM steps of a decoder layer, with or without the activation quantization that follows them:
//
//   rms_norm(x, weight, eps)                      y = rms_norm(x) * weight
//   fused_add_rms_norm(x, residual, weight, eps)  residual += x in place; y = rms_norm(residual) * weight
//   rms_norm_quant(x, weight, eps, dtype,         either of those y (residual optional), then quantized to
//                  scale, residual)               int8 / float8_e4m3fn
//   silu_mul(x)                                   y = silu(gate) * up with x = [gate | up]
//   silu_mul_quant(x, dtype, scale)               the same y, then quantized
//
// (rms_norm and fused_add_rms_norm are two ops rather than one with an optional mutable residual: torch 2.13's
// inductor fails to lower a single-Tensor-returning op whose `Tensor(a!)?` argument is None.)
//
// Arithmetic, chosen so that each op equals torch's unfused chain in the tensor's dtype (the CPU reference
// in cutlass_w8a8/ops.py is that chain):
//
//   residual add   r = T(float(x) + float(r))                           (torch's `residual += x` in T)
//   rms_norm       inv = 1 / sqrt(sum_k(float(s)^2) / K + float(eps));  y = T((float(s) * inv) * float(w))
//                  (F.rms_norm: float32 inside, one rounding to T at the end; s = r, or x without residual)
//   silu_mul       y = T(float(T(g / (1 + exp(-g)))) * float(u))        (F.silu(gate) * up in T: silu is
//                  rounded to T, then the product; the silu formula is torch's CUDA kernel's)
//   quantization   of float(y), i.e. of y AFTER its rounding to T, exactly as quantize_per_token /
//                  quantize_per_tensor (quantize.cu) would quantize the stored y: so fused == unfused chain.
//
// The float32 sum of squares runs in a fixed order (each thread's elements, a butterfly over lanes and warps,
// then the blocks of a cluster in rank order) that depends only on K, the dtype, the row's alignment and the
// device, never on M: results are deterministic and independent of the batch. It is neither the CPU's
// summation order nor torch's CUDA rms_norm's, and torch's CPU rsqrt is not 1 / sqrt, so y can differ from
// those in the last bit of T where the float32 value lies within a few float32 roundings of a tie
// (tests/test_fused_quant_cuda.py bounds that; all that follows y, the quantization included, is bit-exact).
//
// Kernel shape (csrc/graphs/graph_nodes.hpp relies on it): every kernel is row-wise, grid (M, C, 1) with C = 1, or the
// C blocks of a thread block cluster that share a long row (sm90; the cluster shape is compiled into the
// kernel); blocks (x, *) read and write row x only (and residual row x), and no parameter depends on M. One
// launch per call, on the current stream, no host synchronisation, outputs from the caching allocator.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cooperative_groups.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>

#include "core/common.hpp"
#include "graphs/graph_nodes.hpp"
#include "ops.hpp"
#include "quant/quant_common.cuh"

namespace cutlass_w8a8 {
namespace {

// --- element types ---------------------------------------------------------------------------------

template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// The output of the unquantized ops: y itself, in x's dtype T.
template <class T>
struct FloatOut {
  using type = T;
};

template <class O>
struct IsQuant : std::true_type {};
template <class T>
struct IsQuant<FloatOut<T>> : std::false_type {};

// --- cluster-wide reductions (sm90) -------------------------------------------------------------------
//
// A row too long for one block to finish quickly at small M (decode) is split over a cluster of C blocks
// along grid y (thread block clusters: sm90 and newer). The blocks' partial sums or maxima meet through
// distributed shared memory: block rank r publishes its value, every block reads ranks 0 .. C-1 in that
// order, so the result is deterministic and the same in every block. C = 1: the block's own value.

template <int C>
struct ClusterReduce {
  template <class Op>
  __device__ __forceinline__ static float run(float block_value, Op op) {
    if constexpr (C == 1) {
      return block_value;
    } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      __shared__ float slot, result;
      cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
      if (threadIdx.x == 0) slot = block_value;
      cluster.sync();
      if (threadIdx.x == 0) {
        float total = *cluster.map_shared_rank(&slot, 0);
#pragma unroll
        for (int r = 1; r < C; ++r) total = op(total, *cluster.map_shared_rank(&slot, r));
        result = total;
      }
      // Every block has read every slot before any block rewrites its own or exits; also publishes `result`
      // to this block's threads (a cluster barrier is a block barrier too).
      cluster.sync();
      return result;
#else
      return block_value;  // not reached: cluster kernels launch only where their sm90 code was built
#endif
    }
  }
};

struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// --- the shared tail: y (rounded to T) -> output row -------------------------------------------------
//
// Unquantized: store y. Quantized: scale = max|y| / QMAX (dynamic; `static_scale` null) or *static_scale,
// written to scales[row] either way, then q = sat(rne(y / scale)) (quantize_one), as quantize.cu does.

// y held in registers: kVecs vectors of N elements per thread, vector idx = begin + threadIdx.x + i * kB, valid
// below `end`: this block's part [begin, end) of the row, of a cluster of C blocks (C = 1: the whole row).
template <class T, class O, int N, int kVecs, int kB, int C>
__device__ __forceinline__ void finish_regs(const Vec<T, N> (&y)[kVecs], int begin, int end,
                                            typename O::type* out_row, float* scales, const float* static_scale,
                                            int64_t row) {
  if constexpr (!IsQuant<O>::value) {
    auto* out = reinterpret_cast<Vec<T, N>*>(out_row);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int idx = begin + threadIdx.x + i * kB;
      if (idx < end) out[idx] = y[i];
    }
  } else {
    using OV = Vec<typename O::type, N>;
    float scale;
    if (static_scale == nullptr) {  // uniform over the block and the cluster: all take the same branch
      float amax = 0.f;
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        if (begin + threadIdx.x + i * kB < end) {
#pragma unroll
          for (int j = 0; j < N; ++j) amax = fmaxf(amax, fabsf(to_float(y[i].v[j])));
        }
      }
      scale = ClusterReduce<C>::run(block_max<kB>(amax), MaxOp{}) / O::kMax;
    } else {
      scale = *static_scale;
    }
    if (threadIdx.x == 0 && blockIdx.y == 0) scales[row] = scale;
    auto* out = reinterpret_cast<OV*>(out_row);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int idx = begin + threadIdx.x + i * kB;
      if (idx < end) {
        OV o;
#pragma unroll
        for (int j = 0; j < N; ++j) o.v[j] = quantize_one<O>(to_float(y[i].v[j]), scale);
        out[idx] = o;
      }
    }
  }
}

// y recomputed by `produce(idx)` on each pass over the row (rows too long for registers, or misaligned).
template <class T, class O, int N, int kB, class Produce>
__device__ __forceinline__ void finish_loop(Produce produce, int nvec, typename O::type* out_row, float* scales,
                                            const float* static_scale, int64_t row) {
  using V = Vec<T, N>;
  if constexpr (!IsQuant<O>::value) {
    auto* out = reinterpret_cast<V*>(out_row);
    for (int idx = threadIdx.x; idx < nvec; idx += kB) out[idx] = produce(idx);
  } else {
    using OV = Vec<typename O::type, N>;
    float scale;
    if (static_scale == nullptr) {
      float amax = 0.f;
      for (int idx = threadIdx.x; idx < nvec; idx += kB) {
        const V y = produce(idx);
#pragma unroll
        for (int j = 0; j < N; ++j) amax = fmaxf(amax, fabsf(to_float(y.v[j])));
      }
      scale = block_max<kB>(amax) / O::kMax;
    } else {
      scale = *static_scale;
    }
    if (threadIdx.x == 0) scales[row] = scale;
    auto* out = reinterpret_cast<OV*>(out_row);
    for (int idx = threadIdx.x; idx < nvec; idx += kB) {
      const V y = produce(idx);
      OV o;
#pragma unroll
      for (int j = 0; j < N; ++j) o.v[j] = quantize_one<O>(to_float(y.v[j]), scale);
      out[idx] = o;
    }
  }
}

// Cluster kernels carry their cluster shape in the binary (__cluster_dims__), so a plain <<<grid, block>>>
// launch, a captured graph node and a node updated to fewer rows (gridDim.x) all keep it. The attribute exists
// for sm90 only: the device passes for older targets compile these kernels without it, and to a trap.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define CW8A8_CLUSTER_DIMS(x, y, z) __cluster_dims__(x, y, z)
#define CW8A8_HAS_CLUSTERS 1
#else
#define CW8A8_CLUSTER_DIMS(x, y, z)
#define CW8A8_HAS_CLUSTERS 0
#endif

// Vector indices [begin, end) of block y of a row of nvec vectors split over C blocks.
template <int C>
__device__ __forceinline__ void block_part(int nvec, int& begin, int& end) {
  const int per_block = (nvec + C - 1) / C;
  begin = C == 1 ? 0 : static_cast<int>(blockIdx.y) * per_block;
  end = C == 1 ? nvec : min(nvec, begin + per_block);
}

// --- RMSNorm (with the residual add) ------------------------------------------------------------------

template <class T, class OutT>
struct RmsNormParams {
  const T* x;  // [M, K] rows, x_stride apart (not __restrict__: residual may legally be x itself)
  int64_t x_stride;
  T* residual;  // [M, K] rows, updated in place; nullptr: no residual
  int64_t residual_stride;
  const T* weight;  // [K]
  OutT* out;        // [M, K] contiguous
  float* scales;    // [M] (quantized outputs only)
  const float* static_scale;  // one float32 (static per-tensor), or nullptr (dynamic per-token)
  float eps;
  int k;
};

// s = x, or residual = s = T(x + residual); returns sum of float(s)^2 over the vector.
template <class T, int N>
__device__ __forceinline__ float add_residual(Vec<T, N>& s, T* residual_vec_ptr) {
  if (residual_vec_ptr != nullptr) {
    auto* rp = reinterpret_cast<Vec<T, N>*>(residual_vec_ptr);
    const Vec<T, N> r = *rp;
#pragma unroll
    for (int j = 0; j < N; ++j) s.v[j] = from_float<T>(to_float(s.v[j]) + to_float(r.v[j]));
    *rp = s;
  }
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const float f = to_float(s.v[j]);
    ss += __fmul_rn(f, f);  // the square rounded on its own (as torch's pow), not fused into the sum
  }
  return ss;
}

template <class T, int N>
__device__ __forceinline__ Vec<T, N> normalize(const Vec<T, N>& s, const Vec<T, N>& w, float inv_rms) {
  Vec<T, N> y;
#pragma unroll
  for (int j = 0; j < N; ++j) y.v[j] = from_float<T>(__fmul_rn(__fmul_rn(to_float(s.v[j]), inv_rms), to_float(w.v[j])));
  return y;
}

__device__ __forceinline__ float inverse_rms(float sum_sq, int k, float eps) {
  // F.rms_norm: rsqrt(mean(s^2) + eps), the mean as sum / K; IEEE division and square root.
  return 1.f / sqrtf(sum_sq / static_cast<float>(k) + eps);
}

// One row (C = 1) or this block's part of it (C > 1) in registers: kVecs 16-byte vectors per thread of kB; x,
// residual, weight and out 16-byte vectorizable.
template <class T, class O, int kVecs, int kB, int C>
__device__ __forceinline__ void rms_norm_row(const RmsNormParams<T, typename O::type>& p) {
  constexpr int N = 16 / sizeof(T);
  using V = Vec<T, N>;
  const int64_t row = blockIdx.x;
  const V* xr = reinterpret_cast<const V*>(p.x + row * p.x_stride);
  T* rr = p.residual != nullptr ? p.residual + row * p.residual_stride : nullptr;
  int begin, end;
  block_part<C>(p.k / N, begin, end);

  V s[kVecs];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int idx = begin + threadIdx.x + i * kB;
    if (idx < end) {
      s[i] = xr[idx];
      ss += add_residual<T, N>(s[i], rr != nullptr ? rr + int64_t(idx) * N : nullptr);
    }
  }
  const float inv_rms = inverse_rms(ClusterReduce<C>::run(block_sum<kB>(ss), SumOp{}), p.k, p.eps);
  const V* wv = reinterpret_cast<const V*>(p.weight);
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int idx = begin + threadIdx.x + i * kB;
    if (idx < end) s[i] = normalize<T, N>(s[i], wv[idx], inv_rms);  // s[i] now holds y
  }
  finish_regs<T, O, N, kVecs, kB, C>(s, begin, end, p.out + row * int64_t(p.k), p.scales, p.static_scale, row);
}

template <class T, class O, int kVecs, int kB>
__global__ void __launch_bounds__(kB) rms_norm_regs_kernel(const RmsNormParams<T, typename O::type> p) {
  allow_dependent_launch();
  rms_norm_row<T, O, kVecs, kB, 1>(p);
}

template <class T, class O, int kVecs, int kB, int C>
__global__ void CW8A8_CLUSTER_DIMS(1, C, 1) __launch_bounds__(kB)
    rms_norm_cluster_kernel(const RmsNormParams<T, typename O::type> p) {
#if CW8A8_HAS_CLUSTERS
  allow_dependent_launch();
  rms_norm_row<T, O, kVecs, kB, C>(p);
#else
  __trap();
#endif
}

// Any row length; N elements per access (N = 1: any alignment). Passes: residual add and sum of squares;
// then y from the stored residual (or x) for the amax (dynamic) and again for the output.
template <class T, class O, int N, int kB>
__global__ void __launch_bounds__(kB) rms_norm_loop_kernel(const RmsNormParams<T, typename O::type> p) {
  allow_dependent_launch();
  using V = Vec<T, N>;
  const int64_t row = blockIdx.x;
  const V* xr = reinterpret_cast<const V*>(p.x + row * p.x_stride);
  T* rr = p.residual != nullptr ? p.residual + row * p.residual_stride : nullptr;
  const int nvec = p.k / N;

  float ss = 0.f;
  for (int idx = threadIdx.x; idx < nvec; idx += kB) {
    V s = xr[idx];
    ss += add_residual<T, N>(s, rr != nullptr ? rr + int64_t(idx) * N : nullptr);
  }
  const float inv_rms = inverse_rms(block_sum<kB>(ss), p.k, p.eps);
  // Each thread reads back only the residual elements it wrote itself: program order makes them visible.
  const V* src = rr != nullptr ? reinterpret_cast<const V*>(rr) : xr;
  const V* wv = reinterpret_cast<const V*>(p.weight);
  auto produce = [&](int idx) { return normalize<T, N>(src[idx], wv[idx], inv_rms); };
  finish_loop<T, O, N, kB>(produce, nvec, p.out + row * int64_t(p.k), p.scales, p.static_scale, row);
}

// --- SiLU and multiply -------------------------------------------------------------------------------

template <class T, class OutT>
struct SiluMulParams {
  const T* x;  // [M, 2 * I] rows, x_stride apart: gate = x[:, :I], up = x[:, I:]
  int64_t x_stride;
  OutT* out;  // [M, I] contiguous
  float* scales;
  const float* static_scale;
  int half;  // I
};

template <class T, int N>
__device__ __forceinline__ Vec<T, N> silu_mul_vec(const Vec<T, N>& g, const Vec<T, N>& u) {
  Vec<T, N> y;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const float gf = to_float(g.v[j]);
    // torch's silu (aten/src/ATen/native/cuda/ActivationSiluKernel.cu): x / (1 + exp(-x)) in float32,
    // rounded to T; then the product of two T values in float32, rounded to T (torch's mul in T).
    const T act = from_float<T>(gf / (1.f + expf(-gf)));
    y.v[j] = from_float<T>(__fmul_rn(to_float(act), to_float(u.v[j])));
  }
  return y;
}

template <class T, class O, int kVecs, int kB, int C>
__device__ __forceinline__ void silu_mul_row(const SiluMulParams<T, typename O::type>& p) {
  constexpr int N = 16 / sizeof(T);
  using V = Vec<T, N>;
  const int64_t row = blockIdx.x;
  const V* gate = reinterpret_cast<const V*>(p.x + row * p.x_stride);
  const V* up = reinterpret_cast<const V*>(p.x + row * p.x_stride + p.half);
  int begin, end;
  block_part<C>(p.half / N, begin, end);
  V g[kVecs], u[kVecs];
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {  // all loads first, then the arithmetic
    const int idx = begin + threadIdx.x + i * kB;
    if (idx < end) {
      g[i] = gate[idx];
      u[i] = up[idx];
    }
  }
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    if (begin + threadIdx.x + i * kB < end) g[i] = silu_mul_vec<T, N>(g[i], u[i]);  // g[i] now holds y
  }
  finish_regs<T, O, N, kVecs, kB, C>(g, begin, end, p.out + row * int64_t(p.half), p.scales, p.static_scale, row);
}

template <class T, class O, int kVecs, int kB>
__global__ void __launch_bounds__(kB) silu_mul_regs_kernel(const SiluMulParams<T, typename O::type> p) {
  allow_dependent_launch();
  silu_mul_row<T, O, kVecs, kB, 1>(p);
}

template <class T, class O, int kVecs, int kB, int C>
__global__ void CW8A8_CLUSTER_DIMS(1, C, 1) __launch_bounds__(kB)
    silu_mul_cluster_kernel(const SiluMulParams<T, typename O::type> p) {
#if CW8A8_HAS_CLUSTERS
  allow_dependent_launch();
  silu_mul_row<T, O, kVecs, kB, C>(p);
#else
  __trap();
#endif
}

template <class T, class O, int N, int kB>
__global__ void __launch_bounds__(kB) silu_mul_loop_kernel(const SiluMulParams<T, typename O::type> p) {
  allow_dependent_launch();
  using V = Vec<T, N>;
  const int64_t row = blockIdx.x;
  const V* gate = reinterpret_cast<const V*>(p.x + row * p.x_stride);
  const V* up = reinterpret_cast<const V*>(p.x + row * p.x_stride + p.half);
  auto produce = [&](int idx) { return silu_mul_vec<T, N>(gate[idx], up[idx]); };
  finish_loop<T, O, N, kB>(produce, p.half / N, p.out + row * int64_t(p.half), p.scales, p.static_scale, row);
}

// --- launch ------------------------------------------------------------------------------------------
//
// Per row of nvec 16-byte vectors, chosen from K, the dtype, the alignment and the device only (never M, so a
// row's result does not depend on the batch, and a captured node stays valid for fewer rows):
//
//   bfloat16 / float16, 1024 < nvec <= 8192 (K in (8192, 65536]), sm90 code built and running:
//     a cluster of C = 8 blocks of 256 threads per row (grid (M, 8)), each holding its part in registers
//     (1, 2 or 4 vectors per thread). One block per row is latency-bound at decode sizes: on an H100
//     silu_mul_quant of one 14336-wide bfloat16 row took 11.0 us on one SM (the whole row's exp and division
//     on it) and 3.8 us on a cluster of 8 (the unfused torch chain: 7.1 us).
//   otherwise, nvec <= 4096: one block per row holding it in registers, 1 to 8 vectors per thread of 256, or
//     8 of 512 threads (as quantize.cu's per-token kernel).
//   longer rows: one block looping over global memory (vectorized); misaligned rows: element by element.

constexpr int kBlock = 256;
constexpr int kWideBlock = 512;

// Calls launch(kVecs constant, kBlock constant) for the one-block register kernel that fits `nvec` vectors, or
// returns false when none does.
template <class F>
bool with_register_config(int64_t nvec, F&& launch) {
  const int64_t per_thread = (nvec + kBlock - 1) / kBlock;
  if (per_thread <= 1) {
    launch(std::integral_constant<int, 1>{}, std::integral_constant<int, kBlock>{});
  } else if (per_thread <= 2) {
    launch(std::integral_constant<int, 2>{}, std::integral_constant<int, kBlock>{});
  } else if (per_thread <= 4) {
    launch(std::integral_constant<int, 4>{}, std::integral_constant<int, kBlock>{});
  } else if (per_thread <= 8) {
    launch(std::integral_constant<int, 8>{}, std::integral_constant<int, kBlock>{});
  } else if (nvec <= int64_t(kWideBlock) * 8) {
    launch(std::integral_constant<int, 8>{}, std::integral_constant<int, kWideBlock>{});
  } else {
    return false;
  }
  return true;
}

// Calls launch(kVecs, C constants) for the cluster kernel that fits `nvec` vectors (C blocks of kBlock threads,
// kVecs vectors each), or returns false for rows that one block serves as fast (<= 4 vectors per thread: on an
// H100 rms_norm_quant of 4096-wide bfloat16 rows took 4.1 us in one block, 5.3 us in a cluster of two, whose
// two cluster-wide reductions cost more than the split saves) or that are too long (> 8192 vectors).
template <class F>
bool with_cluster_config(int64_t nvec, F&& launch) {
  using std::integral_constant;
  if (nvec <= 4 * kBlock) return false;
  if (nvec <= 8 * kBlock) {
    launch(integral_constant<int, 1>{}, integral_constant<int, 8>{});
  } else if (nvec <= 16 * kBlock) {
    launch(integral_constant<int, 2>{}, integral_constant<int, 8>{});
  } else if (nvec <= 32 * kBlock) {
    launch(integral_constant<int, 4>{}, integral_constant<int, 8>{});
  } else {
    return false;
  }
  return true;
}

// Whether this device runs the cluster kernels: they were built for it (the sm90 device code, with its
// cluster shape, is what got loaded) and it has clusters. Read once per device from a representative kernel.
bool clusters_available(int device) {
  static std::atomic<int> cached[64] = {};  // 0: not read yet, 1: no, 2: yes
  if (device < 0 || device >= 64) return false;
  int v = cached[device].load(std::memory_order_relaxed);
  if (v == 0) {
    cudaFuncAttributes attr{};
    void (*kernel)(RmsNormParams<__nv_bfloat16, int8_t>) =
        rms_norm_cluster_kernel<__nv_bfloat16, Int8Out, 1, kBlock, 8>;
    const cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
    if (err != cudaSuccess) cudaGetLastError();  // a failed query means "no", not an error of the next launch
    const bool ok = err == cudaSuccess && attr.requiredClusterHeight == 8;
    v = ok ? 2 : 1;
    cached[device].store(v, std::memory_order_relaxed);
  }
  return v == 2;
}

template <class T, class O>
void launch_rms_norm(const RmsNormParams<T, typename O::type>& p, int64_t m, bool vectorizable, bool clusters,
                     cudaStream_t stream) {
  constexpr int N = 16 / sizeof(T);
  const int64_t nvec = p.k / N;
  bool launched = false;
  if constexpr (!std::is_same_v<T, float>) {
    if (vectorizable && clusters) {
      launched = with_cluster_config(nvec, [&](auto vecs, auto c) {
        const dim3 grid(static_cast<unsigned>(m), decltype(c)::value);
        rms_norm_cluster_kernel<T, O, decltype(vecs)::value, kBlock, decltype(c)::value>
            <<<grid, kBlock, 0, stream>>>(p);
      });
    }
  }
  const dim3 grid(static_cast<unsigned>(m));
  if (!launched && vectorizable) {
    launched = with_register_config(nvec, [&](auto vecs, auto block) {
      rms_norm_regs_kernel<T, O, decltype(vecs)::value, decltype(block)::value><<<grid, block.value, 0, stream>>>(p);
    });
  }
  if (!launched) {
    if (vectorizable) {
      rms_norm_loop_kernel<T, O, N, kBlock><<<grid, kBlock, 0, stream>>>(p);
    } else {
      rms_norm_loop_kernel<T, O, 1, kBlock><<<grid, kBlock, 0, stream>>>(p);
    }
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class T, class O>
void launch_silu_mul(const SiluMulParams<T, typename O::type>& p, int64_t m, bool vectorizable, bool clusters,
                     cudaStream_t stream) {
  constexpr int N = 16 / sizeof(T);
  const int64_t nvec = p.half / N;
  bool launched = false;
  if constexpr (!std::is_same_v<T, float>) {
    if (vectorizable && clusters) {
      launched = with_cluster_config(nvec, [&](auto vecs, auto c) {
        const dim3 grid(static_cast<unsigned>(m), decltype(c)::value);
        silu_mul_cluster_kernel<T, O, decltype(vecs)::value, kBlock, decltype(c)::value>
            <<<grid, kBlock, 0, stream>>>(p);
      });
    }
  }
  const dim3 grid(static_cast<unsigned>(m));
  if (!launched && vectorizable) {
    launched = with_register_config(nvec, [&](auto vecs, auto block) {
      silu_mul_regs_kernel<T, O, decltype(vecs)::value, decltype(block)::value><<<grid, block.value, 0, stream>>>(p);
    });
  }
  if (!launched) {
    if (vectorizable) {
      silu_mul_loop_kernel<T, O, N, kBlock><<<grid, kBlock, 0, stream>>>(p);
    } else {
      silu_mul_loop_kernel<T, O, 1, kBlock><<<grid, kBlock, 0, stream>>>(p);
    }
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Calls f(T{}, O{}) with T the element type of x and O the output: FloatOut<T> (no quantization), Int8Out or
// Fp8Out.
template <class F>
void dispatch_types(at::ScalarType x_type, std::optional<at::ScalarType> q_type, F&& f) {
  auto with_out = [&](auto t) {
    using T = decltype(t);
    if (!q_type.has_value()) {
      f(t, FloatOut<T>{});
    } else if (*q_type == at::kChar) {
      f(t, Int8Out{});
    } else {
      f(t, Fp8Out{});
    }
  };
  switch (x_type) {
    case at::kBFloat16: with_out(__nv_bfloat16{}); break;
    case at::kHalf: with_out(__half{}); break;
    default: with_out(float{}); break;
  }
}

// --- argument checks (the Python wrappers in cutlass_w8a8/ops.py make the same ones first) ----------------

constexpr int64_t kMaxRows = (int64_t{1} << 31) - 1;  // gridDim.x

void check_x(const char* op, const at::Tensor& x) {
  const auto xt = x.scalar_type();
  CW8A8_CHECK_TYPE(xt == at::kBFloat16 || xt == at::kHalf || xt == at::kFloat, op, "x",
                   "must be bfloat16, float16 or float32, got ", c10::toString(xt));
  CW8A8_CHECK_VALUE(x.is_cuda(), op, "x", "must be a CUDA tensor, got device ", x.device());
  CW8A8_CHECK_VALUE(x.dim() >= 1, op, "x", "must have at least one dimension [..., K]");
  CW8A8_CHECK_VALUE(x.size(-1) > 0, op, "x", "must have a non-empty last dimension [..., K], got shape ",
                    x.sizes());
  CW8A8_CHECK_VALUE(x.size(-1) < (int64_t{1} << 31), op, "x", "K = ", x.size(-1), " must be below 2**31");
  CW8A8_CHECK_VALUE(x.numel() / x.size(-1) <= kMaxRows, op, "x", "has ", x.numel() / x.size(-1),
                    " rows; at most 2**31 - 1 are supported");
}

void check_quant(const char* op, const at::Tensor& x, at::ScalarType dtype, const std::optional<at::Tensor>& scale) {
  CW8A8_CHECK_TYPE(dtype == at::kChar || dtype == at::kFloat8_e4m3fn, op, "dtype",
                   "must be int8 or float8_e4m3fn, got ", c10::toString(dtype));
  if (scale.has_value()) {
    const at::Tensor& s = *scale;
    CW8A8_CHECK_TYPE(s.scalar_type() == at::kFloat, op, "scale", "must be float32, got ",
                     c10::toString(s.scalar_type()));
    CW8A8_CHECK_VALUE(s.device() == x.device(), op, "scale", "is on ", s.device(), " but `x` is on ", x.device());
    CW8A8_CHECK_VALUE(s.numel() == 1, op, "scale", "must hold one value (static per-tensor), got shape ",
                      s.sizes());
  }
}

// The stride between the rows of t seen as [M, K] without a copy (leading dimensions that merge, unit-stride
// rows), or -1 when that view does not exist.
int64_t flat_row_stride(const at::Tensor& t) {
  const int64_t k = t.size(-1);
  if (k > 1 && t.stride(-1) != 1) return -1;
  int64_t stride = -1, next = 0;
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (stride >= 0 && t.stride(d) != next) return -1;
    if (stride < 0) stride = t.stride(d);
    next = t.stride(d) * t.size(d);
  }
  return stride >= 0 ? stride : k;
}

void check_rms_norm(const char* op, const at::Tensor& x, const at::Tensor& weight, double eps,
                    const std::optional<at::Tensor>& residual) {
  check_x(op, x);
  const int64_t k = x.size(-1);
  CW8A8_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), op, "weight", "must have x's dtype ",
                   c10::toString(x.scalar_type()), ", got ", c10::toString(weight.scalar_type()));
  CW8A8_CHECK_VALUE(weight.device() == x.device(), op, "weight", "is on ", weight.device(), " but `x` is on ",
                    x.device());
  CW8A8_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == k, op, "weight", "must be [K] with K = ", k,
                    ", got shape ", weight.sizes());
  CW8A8_CHECK_VALUE(weight.stride(0) == 1 || k == 1, op, "weight", "must be contiguous");
  CW8A8_CHECK_VALUE(eps >= 0.0 && eps < INFINITY, op, "eps", "must be a finite number >= 0, got ", eps);
  if (residual.has_value()) {
    const at::Tensor& r = *residual;
    CW8A8_CHECK_TYPE(r.scalar_type() == x.scalar_type(), op, "residual", "must have x's dtype ",
                     c10::toString(x.scalar_type()), ", got ", c10::toString(r.scalar_type()));
    CW8A8_CHECK_VALUE(r.device() == x.device(), op, "residual", "is on ", r.device(), " but `x` is on ",
                      x.device());
    CW8A8_CHECK_VALUE(r.sizes() == x.sizes(), op, "residual", "must have x's shape ", x.sizes(), ", got ",
                      r.sizes());
    const int64_t rs = flat_row_stride(r);
    CW8A8_CHECK_VALUE(rs >= 0, op, "residual",
                      "must be updatable in place as [M, K] rows (unit-stride rows whose leading dimensions "
                      "merge), got strides ",
                      r.strides());
    CW8A8_CHECK_VALUE(r.numel() / k <= 1 || rs >= k, op, "residual", "rows overlap: row stride ", rs, " < K = ",
                      k);
  }
}

// [..., K] -> [M, K] rows with unit stride: a view when the leading dims flatten, else a copy.
at::Tensor rows_of(const at::Tensor& x, int64_t m) {
  at::Tensor x2 = x.reshape({m, x.size(-1)});
  if (m > 0 && x2.stride(1) != 1) x2 = x2.contiguous();
  return x2;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_impl(const char* op, const at::Tensor& x, const at::Tensor& weight,
                                                 double eps, std::optional<at::ScalarType> qtype,
                                                 const std::optional<at::Tensor>& scale,
                                                 const std::optional<at::Tensor>& residual) {
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t k = x.size(-1), m = x.numel() / k;
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(qtype.value_or(x.scalar_type())));
  at::Tensor scales;
  if (qtype.has_value()) {
    auto shape = x.sizes().vec();
    shape.back() = 1;
    scales = at::empty(shape, x.options().dtype(at::kFloat));
  }
  if (m == 0) return {out, scales};

  const at::Tensor x2 = rows_of(x, m);
  const at::Tensor* r = residual.has_value() ? &*residual : nullptr;
  const int64_t r_stride = r != nullptr ? flat_row_stride(*r) : 0;
  const bool clusters = clusters_available(x.get_device());
  cudaStream_t stream = current_stream(x);
  dispatch_types(x.scalar_type(), qtype, [&](auto t, auto o) {
    using T = decltype(t);
    using O = decltype(o);
    using OutT = typename O::type;
    constexpr int N = 16 / sizeof(T);
    RmsNormParams<T, OutT> p;
    p.x = reinterpret_cast<const T*>(x2.data_ptr());
    p.x_stride = x2.stride(0);
    p.residual = r != nullptr ? reinterpret_cast<T*>(r->data_ptr()) : nullptr;
    p.residual_stride = r_stride;
    p.weight = reinterpret_cast<const T*>(weight.data_ptr());  // contiguous (checked)
    p.out = reinterpret_cast<OutT*>(out.data_ptr());
    p.scales = qtype.has_value() ? scales.data_ptr<float>() : nullptr;
    p.static_scale = scale.has_value() ? scale->data_ptr<float>() : nullptr;
    p.eps = static_cast<float>(eps);
    p.k = static_cast<int>(k);
    const bool vectorizable =
        k % N == 0 && p.x_stride % N == 0 && is_aligned(p.x, 16) && is_aligned(p.weight, 16) &&
        is_aligned(p.out, N * sizeof(OutT)) &&
        (p.residual == nullptr || (p.residual_stride % N == 0 && is_aligned(p.residual, 16)));
    launch_rms_norm<T, O>(p, m, vectorizable, clusters, stream);
  });
  graph_nodes::note_rowwise_launch(stream, m, op);
  return {out, scales};
}

void check_silu_mul(const char* op, const at::Tensor& x) {
  check_x(op, x);
  CW8A8_CHECK_VALUE(x.size(-1) % 2 == 0, op, "x",
                    "must have an even last dimension [..., 2 * I] (gate then up), got shape ", x.sizes());
}

std::tuple<at::Tensor, at::Tensor> silu_mul_impl(const char* op, const at::Tensor& x,
                                                 std::optional<at::ScalarType> qtype,
                                                 const std::optional<at::Tensor>& scale) {
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t k = x.size(-1), m = x.numel() / k, half = k / 2;
  auto shape = x.sizes().vec();
  shape.back() = half;
  at::Tensor out = at::empty(shape, x.options().dtype(qtype.value_or(x.scalar_type())));
  at::Tensor scales;
  if (qtype.has_value()) {
    shape.back() = 1;
    scales = at::empty(shape, x.options().dtype(at::kFloat));
  }
  if (m == 0) return {out, scales};

  const at::Tensor x2 = rows_of(x, m);
  const bool clusters = clusters_available(x.get_device());
  cudaStream_t stream = current_stream(x);
  dispatch_types(x.scalar_type(), qtype, [&](auto t, auto o) {
    using T = decltype(t);
    using O = decltype(o);
    using OutT = typename O::type;
    constexpr int N = 16 / sizeof(T);
    SiluMulParams<T, OutT> p;
    p.x = reinterpret_cast<const T*>(x2.data_ptr());
    p.x_stride = x2.stride(0);
    p.out = reinterpret_cast<OutT*>(out.data_ptr());
    p.scales = qtype.has_value() ? scales.data_ptr<float>() : nullptr;
    p.static_scale = scale.has_value() ? scale->data_ptr<float>() : nullptr;
    p.half = static_cast<int>(half);
    const bool vectorizable = half % N == 0 && p.x_stride % N == 0 && is_aligned(p.x, 16) &&
                              is_aligned(p.out, N * sizeof(OutT));
    launch_silu_mul<T, O>(p, m, vectorizable, clusters, stream);
  });
  graph_nodes::note_rowwise_launch(stream, m, op);
  return {out, scales};
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  constexpr const char* op = "rms_norm";
  check_rms_norm(op, x, weight, eps, std::nullopt);
  return std::get<0>(rms_norm_impl(op, x, weight, eps, std::nullopt, std::nullopt, std::nullopt));
}

at::Tensor fused_add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  constexpr const char* op = "fused_add_rms_norm";
  const std::optional<at::Tensor> r = residual;
  check_rms_norm(op, x, weight, eps, r);
  return std::get<0>(rms_norm_impl(op, x, weight, eps, std::nullopt, std::nullopt, r));
}

std::tuple<at::Tensor, at::Tensor> rms_norm_quant(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                  at::ScalarType dtype, const std::optional<at::Tensor>& scale,
                                                  const std::optional<at::Tensor>& residual) {
  constexpr const char* op = "rms_norm_quant";
  check_rms_norm(op, x, weight, eps, residual);
  check_quant(op, x, dtype, scale);
  return rms_norm_impl(op, x, weight, eps, dtype, scale, residual);
}

at::Tensor silu_mul(const at::Tensor& x) {
  constexpr const char* op = "silu_mul";
  check_silu_mul(op, x);
  return std::get<0>(silu_mul_impl(op, x, std::nullopt, std::nullopt));
}

std::tuple<at::Tensor, at::Tensor> silu_mul_quant(const at::Tensor& x, at::ScalarType dtype,
                                                  const std::optional<at::Tensor>& scale) {
  constexpr const char* op = "silu_mul_quant";
  check_silu_mul(op, x);
  check_quant(op, x, dtype, scale);
  return silu_mul_impl(op, x, dtype, scale);
}

}  // namespace cutlass_w8a8
