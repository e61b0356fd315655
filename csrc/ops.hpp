// The CUDA implementations registered in bindings.cpp. Schemas and docs: cutlass_w8a8/ops.py.
#pragma once

#include <optional>
#include <string>
#include <tuple>

#include <ATen/ATen.h>

namespace cutlass_w8a8 {

// scaled_mm_entry.cu
at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                     const at::Tensor& scale_b, at::ScalarType out_dtype, const std::optional<at::Tensor>& bias);
void scaled_mm_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                   const at::Tensor& scale_b, const std::optional<at::Tensor>& bias);
void scaled_mm_config_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                          const at::Tensor& scale_b, const std::optional<at::Tensor>& bias, int64_t config);

// quant/quantize.cu
std::tuple<at::Tensor, at::Tensor> quantize_per_token(const at::Tensor& x, at::ScalarType dtype);
at::Tensor quantize_per_tensor(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype);

}  // namespace cutlass_w8a8
