// RMSNorm, with the residual add of a decoder layer and with the activation quantization that follows it:
//
//   rms_norm(x, weight, eps)                      y = rms_norm(x) * weight
//   fused_add_rms_norm(x, residual, weight, eps)  residual += x in place; y = rms_norm(residual) * weight
//   rms_norm_quant(x, weight, eps, dtype,         either of those y (residual optional), then quantized to
//                  scale, residual, group_size)   int8 / float8_e4m3fn: per token, per tensor (static `scale`)
//                                                 or per 1 x 128 group of the row (group_size 128)
//
// (rms_norm and fused_add_rms_norm are two ops rather than one with an optional mutable residual: torch 2.13's
// inductor fails to lower a single-Tensor-returning op whose `Tensor(a!)?` argument is None.)
//
// Arithmetic, chosen so that each op equals torch's unfused chain in the tensor's dtype (the CPU reference
// in cutlass_w8a8's ops is that chain):
//
//   residual add   r = T(float(x) + float(r))                           (torch's `residual += x` in T)
//   rms_norm       inv = 1 / sqrt(sum_k(float(s)^2) / K + float(eps));  y = T((float(s) * inv) * float(w))
//                  (F.rms_norm: float32 inside, one rounding to T at the end; s = r, or x without residual)
//   quantization   of float(y), i.e. of y AFTER its rounding to T, exactly as quantize_per_token /
//                  quantize_per_tensor (quantize.cu) or quantize_per_token_group (quantize_group.cu) would
//                  quantize the stored y: so fused == unfused chain.
//
// The float32 sum of squares runs in a fixed order (each thread's elements, a butterfly over lanes and warps,
// then the blocks of a cluster in rank order) that depends only on K, the dtype, the row's alignment and the
// device, never on M: results are deterministic and independent of the batch. It is neither the CPU's
// summation order nor torch's CUDA rms_norm's, and torch's CPU rsqrt is not 1 / sqrt, so y can differ from
// those in the last bit of T where the float32 value lies within a few float32 roundings of a tie
// (tests/ops/test_fused_quant_cuda.py bounds that; all that follows y, the quantization included, is bit-exact).
//
// Kernel shape (csrc/graphs/graph_nodes.hpp relies on it; the same for silu_mul.cu): every kernel is row-wise,
// grid (M, C, 1) with C = 1, or the C blocks of a thread block cluster that share a long row (sm90; the cluster
// shape is compiled into the kernel); blocks (x, *) read and write row x only (and residual row x), and no
// parameter depends on M. One launch per call, on the current stream, no host synchronisation, outputs from the
// caching allocator. The launch shapes and the shared tail (store or quantize y): quant/rowwise_reduce.cuh.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

#include "core/checks.hpp"
#include "ops.hpp"
#include "quant/rowwise_args.hpp"
#include "quant/rowwise_launch.hpp"
#include "quant/rms_norm_row.cuh"
#include "quant/rowwise_reduce.cuh"

namespace cutlass_w8a8 {
namespace {

// --- RMSNorm (with the residual add) ------------------------------------------------------------------

// The kernel argument: x [M, K] rows, x_stride apart (residual may legally be x itself); out [M, K] contiguous
// (len = K); scales [M] (quantized outputs only), or [M, K / 128] (GroupOut).
template <class T, class OutT>
struct RmsNormParams : RowwiseIO<T, OutT> {
  T* residual;  // [M, K] rows, updated in place; nullptr: no residual
  int64_t residual_stride;
  const T* weight;  // [K]
  float eps;
};

// add_residual, normalize, inverse_rms: quant/rms_norm_row.cuh (shared with the decode GEMM's fused norm).

// y = rms_norm(s) * weight of a row (s = x, or the updated residual), for RowwiseOp (quant/rowwise_reduce.cuh,
// launched by launch_rowwise_op).
struct RmsNormRow {
  template <class T, class OutT>
  using Params = RmsNormParams<T, OutT>;

  // x, residual, weight and out 16-byte vectorizable.
  template <int kVecs, int kB, int C, class T, class OutT, int N>
  __device__ __forceinline__ static void regs(const Params<T, OutT>& p, int64_t row, Vec<T, N> (&s)[kVecs],
                                              int begin, int end) {
    using V = Vec<T, N>;
    const V* xr = reinterpret_cast<const V*>(p.x + row * p.x_stride);
    T* rr = p.residual != nullptr ? p.residual + row * p.residual_stride : nullptr;
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int idx = begin + threadIdx.x + i * kB;
      if (idx < end) {
        s[i] = xr[idx];
        ss += add_residual<T, N>(s[i], rr != nullptr ? rr + int64_t(idx) * N : nullptr);
      }
    }
    const float inv_rms = inverse_rms(ClusterReduce<C>::run(block_sum<kB>(ss), SumOp{}), p.len, p.eps);
    const V* wv = reinterpret_cast<const V*>(p.weight);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int idx = begin + threadIdx.x + i * kB;
      if (idx < end) s[i] = normalize<T, N>(s[i], wv[idx], inv_rms);  // s[i] now holds y
    }
  }

  // Any row length; N elements per access (N = 1: any alignment). Passes: residual add and sum of squares; then y
  // from the stored residual (or x) for the amax (dynamic) and again for the output.
  template <int N, int kB, class T, class OutT>
  __device__ __forceinline__ static auto loop(const Params<T, OutT>& p, int64_t row) {
    using V = Vec<T, N>;
    const V* xr = reinterpret_cast<const V*>(p.x + row * p.x_stride);
    T* rr = p.residual != nullptr ? p.residual + row * p.residual_stride : nullptr;
    const int nvec = p.len / N;

    float ss = 0.f;
    for (int idx = threadIdx.x; idx < nvec; idx += kB) {
      V s = xr[idx];
      ss += add_residual<T, N>(s, rr != nullptr ? rr + int64_t(idx) * N : nullptr);
    }
    const float inv_rms = inverse_rms(block_sum<kB>(ss), p.len, p.eps);
    // Each thread reads back only the residual elements it wrote itself: program order makes them visible.
    const V* src = rr != nullptr ? reinterpret_cast<const V*>(rr) : xr;
    const V* wv = reinterpret_cast<const V*>(p.weight);
    return [=](int idx) { return normalize<T, N>(src[idx], wv[idx], inv_rms); };
  }
};

// --- host side ---------------------------------------------------------------------------------------

// py_float (how Python prints eps): core/checks.

// ops/_checks.py check_rms_norm: x, then weight, eps and the optional residual (which must be writable as [M, K] rows).
void check_rms_norm(const char* op, const at::Tensor& x, const at::Tensor& weight, double eps,
                    const std::optional<at::Tensor>& residual) {
  quant::check_rows_input(op, x);
  const int64_t k = x.size(-1);
  CW8A8_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), op, "weight", "must have x's dtype ",
                   py_dtype(x.scalar_type()), ", got ", py_dtype(weight.scalar_type()));
  check_same_device(op, "weight", weight, "x", x);
  CW8A8_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == k, op, "weight", "must be [K] with K = ", k,
                    ", got shape ", py_tuple(weight.sizes()));
  CW8A8_CHECK_VALUE(weight.stride(0) == 1 || k == 1, op, "weight", "must be contiguous");
  CW8A8_CHECK_VALUE(eps >= 0.0 && eps < INFINITY, op, "eps", "must be a finite number >= 0, got ", py_float(eps));
  if (!residual.has_value()) return;
  const at::Tensor& r = *residual;
  CW8A8_CHECK_TYPE(r.scalar_type() == x.scalar_type(), op, "residual", "must have x's dtype ",
                   py_dtype(x.scalar_type()), ", got ", py_dtype(r.scalar_type()));
  check_same_device(op, "residual", r, "x", x);
  CW8A8_CHECK_VALUE(r.sizes() == x.sizes(), op, "residual", "must have x's shape ", py_tuple(x.sizes()), ", got ",
                    py_tuple(r.sizes()));
  const int64_t rs = quant::flat_row_stride(r);
  CW8A8_CHECK_VALUE(rs >= 0, op, "residual",
                    "must be updatable in place as [M, K] rows (unit-stride rows whose leading dimensions "
                    "merge), got strides ",
                    py_tuple(r.strides()));
  CW8A8_CHECK_VALUE(x.numel() / k <= 1 || rs >= k, op, "residual", "rows overlap: row stride ", rs, " < K = ", k);
}

// The checked op: allocates y (or q and the [..., 1] or [..., K / 128] scales), launches one kernel.
std::tuple<at::Tensor, at::Tensor> rms_norm_impl(const char* op, const at::Tensor& x, const at::Tensor& weight,
                                                 double eps, std::optional<at::ScalarType> qtype,
                                                 const std::optional<at::Tensor>& scale,
                                                 const std::optional<at::Tensor>& residual, int64_t group_size = 0) {
  const int64_t k = x.size(-1);
  const at::Tensor* r = residual.has_value() ? &*residual : nullptr;
  const int64_t r_stride = r != nullptr ? quant::flat_row_stride(*r) : 0;
  // No group across two cluster blocks. The launch shape fixes the order of the float32 sum of squares, so it must
  // not depend on the output: with the group rule for group-quantized outputs only, rms_norm took an 8-block
  // cluster where rms_norm_quant(group_size=128) took the register or loop kernel (16-bit K = 8320, 40064, ...:
  // cluster parts of 130, 626 vectors), and the two sums, hence inv_rms and y, could differ in the last bit,
  // breaking fused == quantize_per_token_group(rms_norm(...)) bit for bit. So every output of a row whose K could
  // be group-quantized (K % 128 == 0) follows the group rule, whatever the output.
  const bool group_parts = k % kGroupElems == 0;
  return quant::run_rowwise_op<RmsNormRow>(op, x, k, qtype, scale, group_size, group_parts, [&](auto& p) {
    using T = typename std::decay_t<decltype(p)>::elem_type;
    constexpr int N = 16 / sizeof(T);
    p.residual = r != nullptr ? reinterpret_cast<T*>(r->data_ptr()) : nullptr;
    p.residual_stride = r_stride;
    p.weight = reinterpret_cast<const T*>(weight.data_ptr());  // contiguous (checked)
    p.eps = static_cast<float>(eps);
    return is_aligned(p.weight, 16) &&
           (p.residual == nullptr || (p.residual_stride % N == 0 && is_aligned(p.residual, 16)));
  });
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
                                                  const std::optional<at::Tensor>& residual, int64_t group_size) {
  constexpr const char* op = "rms_norm_quant";
  check_rms_norm(op, x, weight, eps, residual);
  quant::check_quant_dtype(op, dtype);
  quant::check_group_quant(op, x, x.size(-1), scale, group_size);
  return rms_norm_impl(op, x, weight, eps, dtype, scale, residual, group_size);
}

}  // namespace cutlass_w8a8
