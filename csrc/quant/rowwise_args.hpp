// The host side shared by the row-wise ops (quantize_per_token / _per_tensor, rms_norm, fused_add_rms_norm,
// rms_norm_quant, silu_mul, silu_mul_quant): their outputs, and their argument contract on CUDA. The checks are
// those of cutlass_w8a8's CPU and fake implementations (cutlass_w8a8/ops/_roles.py and _checks.py: the
// row-wise x, the static scale, the quantized dtype, the flat row stride), in their order, with their exception types and
// first-line messages character for character. A CPU tensor given with CUDA ones fails the device check of the
// argument Python names ("`scale` is on cpu but `x` is on cuda:0").
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/ATen.h>

#include "core/checks.hpp"
#include "core/limits.hpp"
#include "quant/rowwise_reduce.cuh"

namespace cutlass_w8a8::quant {

static_assert(kGroupElems == limits::kBlockSize, "the fused ops' quantization groups are the block-scale groups");

inline bool is_row_dtype(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat; }

// `dtype`, the quantized output: int8 or float8_e4m3fn (TypeError).
inline void check_quant_dtype(const char* op, at::ScalarType dtype) {
  CW8A8_CHECK_TYPE(is_ab_dtype(dtype), op, "dtype", "must be torch.int8 or torch.float8_e4m3fn, got ",
                   py_dtype(dtype));
}

// `x` of quantize_per_token / quantize_per_tensor: bfloat16 / float16 / float32 [..., K] (K may be 0), then
// `dtype`. (K < 2**31 on top of Python's checks: the kernels hold K in an int.)
inline void check_quant_input(const char* op, const at::Tensor& x, at::ScalarType dtype) {
  CW8A8_CHECK_TYPE(is_row_dtype(x.scalar_type()), op, "x", "must be bfloat16, float16 or float32, got ",
                   py_dtype(x.scalar_type()));
  check_quant_dtype(op, dtype);
  CW8A8_CHECK_VALUE(x.dim() >= 1, op, "x", "must have at least one dimension [..., K]");
  CW8A8_CHECK_VALUE(x.size(-1) < limits::kMaxRowK, op, "x", "K = ", x.size(-1), " is too large");
}

// A static per-tensor `scale`: one float32 value on x's device.
inline void check_static_scale(const char* op, const at::Tensor& x, const at::Tensor& scale) {
  check_float32(op, "scale", scale);
  check_same_device(op, "scale", scale, "x", x);
  CW8A8_CHECK_VALUE(scale.numel() == 1, op, "scale", "must hold one value (static per-tensor), got shape ",
                    py_tuple(scale.sizes()));
}

// The quantization mode of rms_norm_quant / silu_mul_quant (ops/_checks.py _group_quant), after their dtype check:
// group_size 0 (per token, or per tensor with a static `scale`) or 128 (dynamic 1 x 128 groups of the output row of
// length `k`; `scale` must then be None).
inline void check_group_quant(const char* op, const at::Tensor& x, int64_t k, const std::optional<at::Tensor>& scale,
                              int64_t group_size) {
  CW8A8_CHECK_VALUE(group_size == 0 || group_size == limits::kBlockSize, op, "group_size", "must be 0 (per-token) or ",
                    limits::kBlockSize, ", got ", group_size);
  if (group_size != 0) {
    CW8A8_CHECK_VALUE(!scale.has_value(), op, "scale", "must be None with group_size = ", group_size,
                      " (dynamic per-group scales), got a tensor");
    CW8A8_CHECK_VALUE(k % group_size == 0, op, "x", "the output row length ", k,
                      " must be a multiple of group_size = ", group_size);
  } else if (scale.has_value()) {
    check_static_scale(op, x, *scale);
  }
}

// `x` of the fused ops: bfloat16 / float16 / float32 [..., K] with 0 < K < 2**31 and at most 2**31 - 1 rows
// (rows are blocks of gridDim.x, K an int in the kernels).
inline void check_rows_input(const char* op, const at::Tensor& x) {
  CW8A8_CHECK_TYPE(is_row_dtype(x.scalar_type()), op, "x", "must be bfloat16, float16 or float32, got ",
                   py_dtype(x.scalar_type()));
  CW8A8_CHECK_VALUE(x.dim() >= 1, op, "x", "must have at least one dimension [..., K]");
  const int64_t k = x.size(-1);
  CW8A8_CHECK_VALUE(k != 0, op, "x", "must have a non-empty last dimension [..., K], got shape ",
                    py_tuple(x.sizes()));
  CW8A8_CHECK_VALUE(k < limits::kMaxRowK, op, "x", "K = ", k, " must be below 2**31");
  const int64_t rows = x.numel() / k;
  CW8A8_CHECK_VALUE(rows <= limits::kMaxRows, op, "x", "has ", rows, " rows; at most 2**31 - 1 are supported");
}

// After the checks above (every other tensor is on x's device): the op was dispatched to CUDA because one of
// its tensors is a CUDA tensor, so this holds; kept as the kernels' own precondition.
inline void check_on_cuda(const char* op, const at::Tensor& x) { check_cuda(op, "x", x); }

// The stride between the rows of t seen as [M, K] without a copy (unit-stride rows whose leading dimensions
// merge), or -1 when that view does not exist. A [K] tensor is one row (stride K).
inline int64_t flat_row_stride(const at::Tensor& t) {
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

// The outputs of a row-wise op on x [..., K]: `out` [..., width] in `out_dtype`, and with `with_scales` the
// float32 scales [..., 1] per row (group_size 0) or [..., width / group_size] per group. Contiguous, from the
// caching allocator on x's device.
struct RowOutputs {
  at::Tensor out;
  at::Tensor scales;  // undefined without scales
};
inline RowOutputs empty_row_outputs(const at::Tensor& x, int64_t width, at::ScalarType out_dtype, bool with_scales,
                                    int64_t group_size = 0) {
  auto shape = x.sizes().vec();
  shape.back() = width;
  RowOutputs r;
  r.out = at::empty(shape, x.options().dtype(out_dtype));
  if (with_scales) {
    shape.back() = group_size != 0 ? width / group_size : 1;
    r.scales = at::empty(shape, x.options().dtype(at::kFloat));
  }
  return r;
}

// The kernels' names for x's dtype and the output (checked dtypes only).
inline RowElem row_elem(at::ScalarType t) {
  return t == at::kBFloat16 ? RowElem::kBFloat16 : t == at::kHalf ? RowElem::kHalf : RowElem::kFloat;
}
inline RowOut row_out(std::optional<at::ScalarType> q) {
  return !q.has_value() ? RowOut::kSame : *q == at::kChar ? RowOut::kInt8 : RowOut::kFp8;
}

}  // namespace cutlass_w8a8::quant
