// w8a8_linear: a W8A8Linear forward in one op call. The activations x [..., K] are quantized (dynamic per-token,
// or static per-tensor with input_scale) into a temporary (one allocation for q and its per-token scales) and the
// scaled_mm GEMM runs on them with the [N, K] weight: two kernel launches (quant/quantize.cu, then the arch's GEMM
// library through launch_scaled_mm, gemm/scaled_mm_args.hpp), one dispatcher call, the argument checks once, here.
// The result equals quantize_per_token / quantize_per_tensor followed by
// scaled_mm(q, weight.t(), scale, weight_scale, out_dtype, bias) bit for bit.
//
// Block weight scales (e4m3 weight [N, K], weight_scale float32 [ceil(N/128), ceil(K/128)]: DeepSeek-V3 /
// compressed-tensors FP8_BLOCK; core/checks.hpp is_block_weight_scaled, ops/_roles.py block_weight_scaled): x is
// quantized per 1 x 128 group (quant/quantize_group.cu) into the temporary (q [M, K], then scales [M, K/128]) and the
// block-scaled GEMM runs (cw8a8_scaled_mm_args.scale_block): equal to quantize_per_token_group(x, 128, e4m3)
// followed by scaled_mm(q, weight.t(), scales, weight_scale, out_dtype, bias) bit for bit. input_scale must then
// be None and K a multiple of 128.
//
// The messages are the ones the CPU and fake implementations raise (Python's _check_w8a8_linear): dtypes and
// shapes are printed as Python prints them.
#include <optional>

#include <c10/cuda/CUDAGuard.h>

#include "core/checks.hpp"
#include "core/device.hpp"
#include "core/limits.hpp"
#include "gemm/scaled_mm_args.hpp"
#include "ops.hpp"
#include "quant/quantize.hpp"

namespace cutlass_w8a8 {
namespace {

constexpr const char* kOp = "w8a8_linear";

bool is_float_act(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat; }

void check(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
           const std::optional<at::Tensor>& input_scale, const std::optional<at::Tensor>& bias,
           at::ScalarType out_dtype) {
  // dtypes
  CW8A8_CHECK_TYPE(is_float_act(x.scalar_type()), kOp, "x", "must be bfloat16, float16 or float32, got ",
                   py_dtype(x.scalar_type()));
  check_ab_dtype(kOp, "weight", weight);
  check_float32(kOp, "weight_scale", weight_scale);
  if (input_scale) check_float32(kOp, "input_scale", *input_scale);
  check_out_dtype_arg(kOp, "out_dtype", out_dtype);
  check_bias_dtype(kOp, bias, out_dtype);
  // devices: everything on x's (a CPU tensor among CUDA ones gets here too)
  check_same_device(kOp, "weight", weight, "x", x);
  check_same_device(kOp, "weight_scale", weight_scale, "x", x);
  check_same_device(kOp, "input_scale", input_scale, "x", x);
  check_same_device(kOp, "bias", bias, "x", x);
  // shapes
  CW8A8_CHECK_VALUE(x.dim() >= 1, kOp, "x", "must have at least one dimension [..., K]");
  CW8A8_CHECK_VALUE(weight.dim() == 2, kOp, "weight", "must be 2-D [N, K], got shape ", py_tuple(weight.sizes()));
  const int64_t n = weight.size(0), k = weight.size(1);
  CW8A8_CHECK_VALUE(x.size(-1) == k, kOp, "weight", "must be [N, K] with K = x.shape[-1] = ", x.size(-1),
                    ", got shape ", py_tuple(weight.sizes()));
  check_gemm_dim(kOp, "weight", "K = weight.shape[1]", k);
  check_gemm_dim(kOp, "weight", "N = weight.shape[0]", n);
  check_int8_k(kOp, "weight", weight.scalar_type(), k);
  const int64_t sb = weight_scale.numel();
  if (is_block_weight_scaled(weight, weight_scale)) {
    CW8A8_CHECK_VALUE(!input_scale, kOp, "input_scale", "must be None with block weight scales (activations are "
                      "quantized per 1x128 group at run time), got a tensor");
    CW8A8_CHECK_VALUE(k % limits::kBlockSize == 0, kOp, "weight", "K = weight.shape[1] must be a multiple of ",
                      limits::kBlockSize, " with block scales, got ", k);
  } else {
    CW8A8_CHECK_VALUE(weight_scale.dim() <= 2 && (sb == 1 || (sb == n && (weight_scale.dim() == 1 ||
                                                                           weight_scale.size(0) == 1 ||
                                                                           weight_scale.size(1) == 1))),
                      kOp, "weight_scale", "must hold 1 (per-tensor) or N = ", n,
                      " (per-channel: (N,), (N, 1) or (1, N)) values, got shape ", py_tuple(weight_scale.sizes()));
  }
  check_contiguous(kOp, "weight_scale", weight_scale);
  if (input_scale) {
    CW8A8_CHECK_VALUE(input_scale->numel() == 1, kOp, "input_scale",
                      "must hold one value (static per-tensor), got shape ", py_tuple(input_scale->sizes()));
  }
  check_bias_shape(kOp, bias, n);
  // the weight's layout: read through TMA as the column-major B = weight.t()
  const int64_t ldw = weight.stride(0);
  CW8A8_CHECK_VALUE(weight.stride(1) == 1, kOp, "weight", "must be row-major [N, K] (stride(1) == 1), got strides ",
                    py_tuple(weight.strides()));
  CW8A8_CHECK_VALUE(ldw >= k, kOp, "weight", "rows overlap: stride(0) = ", ldw, " < K = ", k);
  CW8A8_CHECK_VALUE(ldw % limits::kGemmAlign == 0, kOp, "weight", "stride(0) must be a multiple of ",
                    limits::kGemmAlign, " elements, got ", ldw);
  check_aligned16(kOp, "weight", weight);
}

}  // namespace

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                       const std::optional<at::Tensor>& input_scale, const std::optional<at::Tensor>& bias,
                       at::ScalarType out_dtype, bool fp8_fast_accum) {
  check(x, weight, weight_scale, input_scale, bias, out_dtype);
  const int64_t n = weight.size(0), k = weight.size(1);
  c10::cuda::CUDAGuard guard(x.device());
  // x as [M, K] rows: x itself when it is 2-D with unit column stride (no new tensor on the common path)
  const at::Tensor x2 = x.dim() == 2 && (x.stride(1) == 1 || x.size(0) == 0) ? x : quant::rows_of(x);
  const int64_t m = x2.size(0);
  CW8A8_CHECK_VALUE(m < (int64_t{1} << 31), kOp, "x", "has ", m, " rows; at most 2**31 - 1 are supported");
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  at::Tensor out = at::empty(out_shape, x.options().dtype(out_dtype));
  if (m == 0) return out;

  // One temporary for the quantized rows and their dynamic scales: q [M, K] then, 16-byte aligned, M floats
  // (per token) or M x K/128 floats (block weight scales: per 1 x 128 group, row-major); none with input_scale.
  const at::ScalarType qtype = weight.scalar_type();
  const bool block = is_block_weight_scaled(weight, weight_scale);
  const int64_t groups = k / limits::kBlockSize;
  const int64_t q_bytes = (m * k + 15) / 16 * 16;
  const int64_t scale_count = input_scale ? 0 : block ? m * groups : m;
  at::Tensor workspace = at::empty({q_bytes + 4 * scale_count}, x.options().dtype(at::kByte));
  auto* q = static_cast<uint8_t*>(workspace.data_ptr());
  float* token_scales = input_scale ? nullptr : reinterpret_cast<float*>(q + q_bytes);
  const cudaStream_t stream = current_stream(x);
  const quant::Rows rows{x2.data_ptr(), x2.stride(0), q, k, m, static_cast<int>(k), x.scalar_type()};
  if (input_scale) {
    quant::launch_quantize_per_tensor(rows, input_scale->data_ptr<float>(), qtype, stream);
  } else if (block) {
    quant::launch_quantize_per_token_group(rows, token_scales, groups, qtype, stream);
  } else {
    quant::launch_quantize_per_token(rows, token_scales, qtype, stream);
  }

  // The argument block of scaled_mm(q, weight.t(), scale_a, weight_scale, out_dtype, bias): every operand is
  // checked above or made here (q and out are contiguous [M, K] / [M, N], 16-byte aligned, K and N multiples
  // of 16, so their pitches are legal for any M).
  GemmOperands g;
  g.m = m;
  g.n = n;
  g.k = k;
  g.ab = qtype;
  g.out = out_dtype;
  g.a = q;
  g.lda = k;
  g.b = weight.data_ptr();
  g.ldb = weight.stride(0);
  g.d = out.data_ptr();
  g.ldd = n;
  g.scale_a = input_scale ? input_scale->data_ptr<float>() : token_scales;
  g.scale_a_per_token = !input_scale && !block;
  g.scale_b = weight_scale.data_ptr<float>();
  g.scale_b_per_channel = weight_scale.numel() != 1 && !block;
  g.scale_block = block;
  g.bias = bias ? bias->data_ptr() : nullptr;
  g.device = x.device().index();
  cw8a8_scaled_mm_args args = pack_scaled_mm(g);
  args.fp8_fast_accum = fp8_fast_accum ? 1 : 0;
  launch_scaled_mm(args, x, input_scale ? *input_scale : at::Tensor(), weight_scale, bias);
  return out;
}

}  // namespace cutlass_w8a8
