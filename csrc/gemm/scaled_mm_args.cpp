// scaled_mm's argument checks and argument block (gemm/scaled_mm_args.hpp).
#include "gemm/scaled_mm_args.hpp"

#include "core/checks.hpp"
#include "core/device.hpp"
#include "core/limits.hpp"

namespace cutlass_w8a8 {

void check_scaled_mm(const char* op, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                     const at::Tensor& scale_b, at::ScalarType out_dtype, const std::optional<at::Tensor>& bias,
                     const at::Tensor* out) {
  // dtypes, then devices (core/checks.hpp, shared with grouped_scaled_mm)
  check_gemm_operands(op, a, b, scale_a, scale_b, /*offsets=*/nullptr, out_dtype, bias, out);

  // shapes
  CW8A8_CHECK_VALUE(a.dim() == 2, op, "a", "must be 2-D [M, K], got shape ", py_tuple(a.sizes()));
  CW8A8_CHECK_VALUE(b.dim() == 2, op, "b", "must be 2-D [K, N], got shape ", py_tuple(b.sizes()));
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  CW8A8_CHECK_VALUE(b.size(0) == k, op, "b", "must be [K, N] with K = a.shape[1] = ", k, ", got shape ",
                    py_tuple(b.sizes()));
  CW8A8_CHECK_VALUE(m < limits::kMaxM, op, "a", "M = a.shape[0] must be below 2**31, got ", m);
  check_gemm_dim(op, "a", "K = a.shape[1]", k);
  check_gemm_dim(op, "b", "N = b.shape[1]", n);
  check_int8_k(op, "a", a.scalar_type(), k);
  if (is_block_scaled(a, b, scale_a, scale_b)) {
    check_block_scales(op, a, scale_a, scale_b, m, k, n);
  } else {
    const bool sa_ok = scale_a.numel() == 1 ||
                       (scale_a.dim() == 2 && scale_a.size(0) == m && scale_a.size(1) == 1) ||
                       (scale_a.dim() == 1 && scale_a.size(0) == m);
    CW8A8_CHECK_VALUE(sa_ok, op, "scale_a", "must be [1] (per-tensor) or [M, 1] (per-token) with M = ", m,
                      ", got shape ", py_tuple(scale_a.sizes()));
    check_scale_b_shape(op, "scale_b", scale_b, n);
  }
  check_contiguous(op, "scale_a", scale_a);
  check_contiguous(op, "scale_b", scale_b);
  check_bias_shape(op, bias, n);

  // layouts: the kernels read A and B through TMA, which needs 16-byte aligned bases and row pitches. Rows may
  // be padded (a slice of a wider buffer): the leading stride is passed through, never assumed.
  check_row_major(op, "a", a, k, "K", limits::kGemmAlign);
  check_column_major_b(op, "b", b, k);
  check_aligned16(op, "a", a);
  check_aligned16(op, "b", b);
  if (out != nullptr) check_out_matrix(op, *out, m, n);
}

cw8a8_scaled_mm_args pack_scaled_mm(const GemmOperands& g) {
  cw8a8_scaled_mm_args args{};
  args.a = g.a;
  args.b = g.b;
  args.d = g.d;
  args.scale_a = g.scale_a;
  args.scale_b = g.scale_b;
  args.bias = g.bias;
  args.m = g.m;
  args.n = g.n;
  args.k = g.k;
  // A single-row operand may carry any stride(0); give the kernel a legal packed pitch instead.
  args.lda = g.m <= 1 ? (g.k + 15) / 16 * 16 : g.lda;
  args.ldb = g.ldb;
  args.ldd = g.m <= 1 ? (g.n + 7) / 8 * 8 : g.ldd;
  args.scale_block = g.scale_block ? 1 : 0;
  args.scale_a_per_token = g.scale_a_per_token && !g.scale_block ? 1 : 0;
  args.scale_b_per_channel = g.scale_b_per_channel && !g.scale_block ? 1 : 0;
  args.ab_type = g.ab == at::kChar ? CW8A8_AB_INT8 : CW8A8_AB_FP8_E4M3;
  args.out_type = g.out == at::kBFloat16 ? CW8A8_OUT_BF16 : CW8A8_OUT_F16;
  args.device = g.device;
  args.sm_count = device_info(g.device).sm_count;
  args.config = -1;
  // the ops set it from their argument (kernel_api.h); graph updates keep the captured one
  args.fp8_fast_accum = limits::kFp8FastAccumDefault != 0 ? 1 : 0;
  return args;
}

cw8a8_scaled_mm_args pack_scaled_mm(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                                    const at::Tensor& scale_a, const at::Tensor& scale_b,
                                    const std::optional<at::Tensor>& bias) {
  GemmOperands g;
  g.m = a.size(0);
  g.n = b.size(1);
  g.k = a.size(1);
  g.ab = a.scalar_type();
  g.out = out.scalar_type();
  g.a = a.data_ptr();
  g.lda = a.stride(0);
  g.b = b.data_ptr();
  g.ldb = b.stride(1);
  g.d = out.data_ptr();
  g.ldd = out.stride(0);
  g.scale_block = is_block_scaled(a, b, scale_a, scale_b);
  g.scale_a = scale_a.data_ptr<float>();
  g.scale_a_per_token = !g.scale_block && scale_a.numel() != 1;
  g.scale_b = scale_b.data_ptr<float>();
  g.scale_b_per_channel = !g.scale_block && scale_b.numel() != 1;
  g.bias = bias ? bias->data_ptr() : nullptr;
  g.device = a.device().index();
  return pack_scaled_mm(g);
}

cw8a8_scaled_mm_args check_and_pack_scaled_mm(const char* op, const at::Tensor& out, const at::Tensor& a,
                                              const at::Tensor& b, const at::Tensor& scale_a,
                                              const at::Tensor& scale_b, const std::optional<at::Tensor>& bias) {
  check_scaled_mm(op, a, b, scale_a, scale_b, out.scalar_type(), bias, &out);
  return pack_scaled_mm(out, a, b, scale_a, scale_b, bias);
}

}  // namespace cutlass_w8a8
