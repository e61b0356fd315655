// The activation quantizers of quantize.cu as launch functions, for ops that quantize on their way into a GEMM
// (w8a8_linear in linear.cu). The tensors are trusted: the caller has checked dtypes, devices and shapes.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

namespace cutlass_w8a8::quant {

// [..., K] -> [M, K] rows with unit stride: a view when the leading dimensions flatten, else a copy.
at::Tensor rows_of(const at::Tensor& x);

// Dynamic per-token: q2[m, :] = sat(rne(x2[m, :] / s[m])), s[m] = max |x2[m, :]| / QMAX, written to `scales` ([M],
// float32). x2: [M, K] bf16 / fp16 / fp32 with unit column stride; q2: [M, K] of `dtype` (int8 or e4m3).
void launch_quantize_per_token(const at::Tensor& x2, at::Tensor& q2, at::Tensor& scales, at::ScalarType dtype,
                               cudaStream_t stream);

// Static per-tensor with the one-element float32 `scale`.
void launch_quantize_per_tensor(const at::Tensor& x2, at::Tensor& q2, const at::Tensor& scale, at::ScalarType dtype,
                                cudaStream_t stream);

}  // namespace cutlass_w8a8::quant
