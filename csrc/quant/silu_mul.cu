// SiLU-and-multiply of a decoder layer's MLP, with or without the activation quantization that follows it:
//
//   silu_mul(x)                      y = silu(gate) * up with x = [gate | up] ([..., 2 * I] -> [..., I])
//   silu_mul_quant(x, dtype, scale,  the same y, then quantized to int8 / float8_e4m3fn: per token, per tensor
//                  group_size)       (static `scale`) or per 1 x 128 group of the row (group_size 128)
//
// Arithmetic, chosen so that each op equals torch's unfused chain in the tensor's dtype T (the CPU reference):
//
//   silu_mul       y = T(float(T(g / (1 + exp(-g)))) * float(u))        (F.silu(gate) * up in T: silu is
//                  rounded to T, then the product; the silu formula is torch's CUDA kernel's)
//   quantization   of float(y), i.e. of y AFTER its rounding to T, exactly as quantize_per_token /
//                  quantize_per_tensor (quantize.cu) or quantize_per_token_group (quantize_group.cu) would
//                  quantize the stored y: so fused == unfused chain.
//
// Kernel shape: row-wise, as rms_norm.cu's (grid (M, C, 1), blocks (x, *) touch row x only, no parameter
// depends on M; csrc/graphs/graph_nodes.hpp relies on it). One launch per call, on the current stream, no host
// synchronisation. The launch shapes and the shared tail (store or quantize y): quant/rowwise_reduce.cuh.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

#include "core/checks.hpp"
#include "ops.hpp"
#include "quant/rowwise_args.hpp"
#include "quant/rowwise_launch.hpp"
#include "quant/rowwise_reduce.cuh"

namespace cutlass_w8a8 {
namespace {

// --- SiLU and multiply -------------------------------------------------------------------------------

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

// y = silu(gate) * up of a row, for RowwiseOp (quant/rowwise_reduce.cuh, launched by launch_rowwise_op).
struct SiluMulRow {
  // x [M, 2 * I] rows, x_stride apart: gate = x[:, :I], up = x[:, I:]; out [M, I] contiguous (len = I); scales [M],
  // or [M, I / 128] (GroupOut).
  template <class T, class OutT>
  using Params = RowwiseIO<T, OutT>;

  // x and out 16-byte vectorizable.
  template <int kVecs, int kB, int C, class T, class OutT, int N>
  __device__ __forceinline__ static void regs(const Params<T, OutT>& p, int64_t row, Vec<T, N> (&y)[kVecs], int begin,
                                              int end) {
    using V = Vec<T, N>;
    const V* gate = reinterpret_cast<const V*>(p.x + row * p.x_stride);
    const V* up = reinterpret_cast<const V*>(p.x + row * p.x_stride + p.len);
    V u[kVecs];
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {  // all loads first, then the arithmetic
      const int idx = begin + threadIdx.x + i * kB;
      if (idx < end) {
        y[i] = gate[idx];
        u[i] = up[idx];
      }
    }
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (begin + threadIdx.x + i * kB < end) y[i] = silu_mul_vec<T, N>(y[i], u[i]);
    }
  }

  template <int N, int kB, class T, class OutT>
  __device__ __forceinline__ static auto loop(const Params<T, OutT>& p, int64_t row) {
    using V = Vec<T, N>;
    const V* gate = reinterpret_cast<const V*>(p.x + row * p.x_stride);
    const V* up = reinterpret_cast<const V*>(p.x + row * p.x_stride + p.len);
    return [=](int idx) { return silu_mul_vec<T, N>(gate[idx], up[idx]); };
  }
};

// --- host side ---------------------------------------------------------------------------------------

// ops/_checks.py check_silu_mul: x, with an even last dimension.
void check_silu_mul(const char* op, const at::Tensor& x) {
  quant::check_rows_input(op, x);
  CW8A8_CHECK_VALUE(x.size(-1) % 2 == 0, op, "x",
                    "must have an even last dimension [..., 2 * I] (gate then up), got shape ", py_tuple(x.sizes()));
}

// The checked op: allocates y (or q and the [..., 1] or [..., I / 128] scales), launches one kernel.
std::tuple<at::Tensor, at::Tensor> silu_mul_impl(const char* op, const at::Tensor& x,
                                                 std::optional<at::ScalarType> qtype,
                                                 const std::optional<at::Tensor>& scale, int64_t group_size = 0) {
  return quant::run_rowwise_op<SiluMulRow>(op, x, x.size(-1) / 2, qtype, scale, group_size,
                                        /*group_parts=*/group_size != 0, [](auto&) { return true; });
}

}  // namespace

at::Tensor silu_mul(const at::Tensor& x) {
  constexpr const char* op = "silu_mul";
  check_silu_mul(op, x);
  return std::get<0>(silu_mul_impl(op, x, std::nullopt, std::nullopt));
}

std::tuple<at::Tensor, at::Tensor> silu_mul_quant(const at::Tensor& x, at::ScalarType dtype,
                                                  const std::optional<at::Tensor>& scale, int64_t group_size) {
  constexpr const char* op = "silu_mul_quant";
  check_silu_mul(op, x);
  quant::check_quant_dtype(op, dtype);
  quant::check_group_quant(op, x, x.size(-1) / 2, scale, group_size);
  return silu_mul_impl(op, x, dtype, scale, group_size);
}

}  // namespace cutlass_w8a8
