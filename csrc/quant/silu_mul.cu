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

#include <c10/cuda/CUDAGuard.h>

#include "core/checks.hpp"
#include "graphs/graph_nodes.hpp"
#include "ops.hpp"
#include "quant/quantize.hpp"
#include "quant/rowwise_args.hpp"
#include "quant/rowwise_launch.hpp"
#include "quant/rowwise_reduce.cuh"

namespace cutlass_w8a8 {
namespace {

// --- SiLU and multiply -------------------------------------------------------------------------------

template <class T, class OutT>
struct SiluMulParams {
  const T* x;  // [M, 2 * I] rows, x_stride apart: gate = x[:, :I], up = x[:, I:]
  int64_t x_stride;
  OutT* out;  // [M, I] contiguous
  float* scales;              // [M], or [M, I / 128] (GroupOut)
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

// The row-wise kernels of quant/rowwise_reduce.cuh run these (launch_rowwise).
template <class T, class O>
struct SiluMulRow {
  using Params = SiluMulParams<T, typename O::type>;

  // One row (C = 1) or this block's part of it (C > 1) in registers: kVecs 16-byte vectors per thread of kB; x and
  // out 16-byte vectorizable.
  template <int kVecs, int kB, int C>
  __device__ __forceinline__ static void regs(const Params& p) {
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
    finish_regs<T, O, N, kVecs, kB, C>(g, begin, end, p.out + row * int64_t(p.half), p.scales, p.static_scale, row,
                                       p.half / kGroupElems);
  }


  template <int N, int kB>
  __device__ __forceinline__ static void loop(const Params& p) {
    using V = Vec<T, N>;
    const int64_t row = blockIdx.x;
    const V* gate = reinterpret_cast<const V*>(p.x + row * p.x_stride);
    const V* up = reinterpret_cast<const V*>(p.x + row * p.x_stride + p.half);
    auto produce = [&](int idx) { return silu_mul_vec<T, N>(gate[idx], up[idx]); };
    finish_loop<T, O, N, kB>(produce, p.half / N, p.out + row * int64_t(p.half), p.scales, p.static_scale, row,
                             p.half / kGroupElems);
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
  quant::check_on_cuda(op, x);
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t k = x.size(-1), m = x.numel() / k, half = k / 2;
  const quant::RowOutputs y =
      quant::empty_row_outputs(x, half, qtype.value_or(x.scalar_type()), qtype.has_value(), group_size);
  const at::Tensor& out = y.out;
  const at::Tensor& scales = y.scales;
  if (m == 0) return {out, scales};

  const at::Tensor x2 = quant::rows_of(x);
  const cudaStream_t stream = quant::launch_rowwise_op<SiluMulRow>(x, qtype, group_size, m, [&](auto t, auto o) {
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
    const int64_t part_multiple = IsGroup<O>::value ? kGroupElems / N : 1;  // no group across two cluster blocks
    return quant::RowwiseLaunch<SiluMulParams<T, OutT>>{p, p.half / N, vectorizable, part_multiple};
  });
  graph_nodes::note_rowwise_launch(stream, m, op);
  return {out, scales};
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
