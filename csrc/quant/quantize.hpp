// The activation quantizers of quantize.cu as launch functions, for ops that quantize on their way into a GEMM
// (w8a8_linear in gemm/w8a8_linear.cu). The tensors are trusted: the caller has checked dtypes, devices and shapes.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

namespace cutlass_w8a8::quant {

// [..., K] -> [M, K] rows with unit stride: a view when the leading dimensions flatten, else a copy.
at::Tensor rows_of(const at::Tensor& x);

// M rows of K elements to quantize: x (bf16 / fp16 / fp32) rows `x_stride` elements apart with unit column stride,
// into q (int8 or e4m3) rows `q_stride` apart.
struct Rows {
  const void* x;
  int64_t x_stride;
  void* q;
  int64_t q_stride;
  int64_t m;
  int k;
  at::ScalarType x_type;
};
Rows rows(const at::Tensor& x2, void* q, int64_t q_stride);

// Dynamic per-token: q[m, :] = sat(rne(x[m, :] / s[m])), s[m] = max |x[m, :]| / QMAX written to `scales` (M floats).
void launch_quantize_per_token(const Rows& r, float* scales, at::ScalarType dtype, cudaStream_t stream);

// Static per-tensor with the one float32 value at `scale` (device memory).
void launch_quantize_per_tensor(const Rows& r, const float* scale, at::ScalarType dtype, cudaStream_t stream);

// Dynamic per-token-group (quantize_group.cu), 1 x 128 groups: q[m, k] = sat(rne(x[m, k] / s[m, k / 128])),
// s[m, g] = max |x[m, 128 g .. 128 g + 127]| / QMAX written to scales[m * scale_stride + g]. r.k a multiple of 128.
void launch_quantize_per_token_group(const Rows& r, float* scales, int64_t scale_stride, at::ScalarType dtype,
                                     cudaStream_t stream);

}  // namespace cutlass_w8a8::quant
