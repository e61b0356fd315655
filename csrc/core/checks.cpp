// The CUDA ops' argument checks by operand role (core/checks.hpp).
#include "core/checks.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace cutlass_w8a8 {

std::string py_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    case at::kFloat8_e4m3fn: return "torch.float8_e4m3fn";
    case at::kFloat8_e5m2: return "torch.float8_e5m2";
    default: return std::string("torch.") + c10::toString(t);
  }
}

std::string py_float(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[40];
  for (int digits = 1; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof(buf), "%.*e", digits - 1, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  // buf: [-]d[.ddd]e(+|-)XX
  std::string s(buf);
  const bool negative = s[0] == '-';
  if (negative) s.erase(0, 1);
  const size_t e = s.find('e');
  const int exponent = std::atoi(s.c_str() + e + 1);
  std::string mantissa = s.substr(0, e), digits;
  for (char c : mantissa) {
    if (c != '.') digits += c;
  }
  std::string out;
  if (exponent < -4 || exponent >= 16) {
    out = digits.substr(0, 1) + (digits.size() > 1 ? "." + digits.substr(1) : "");
    const int a = exponent < 0 ? -exponent : exponent;
    out += std::string("e") + (exponent < 0 ? "-" : "+") + (a < 10 ? "0" : "") + std::to_string(a);
  } else if (exponent < 0) {
    out = "0." + std::string(-exponent - 1, '0') + digits;
  } else {
    if (digits.size() < static_cast<size_t>(exponent) + 1) digits.append(exponent + 1 - digits.size(), '0');
    const std::string whole = digits.substr(0, exponent + 1), frac = digits.substr(exponent + 1);
    out = whole + "." + (frac.empty() ? "0" : frac);
  }
  return negative ? "-" + out : out;
}

std::string py_tuple(at::IntArrayRef v) {
  std::string s = "(";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(v[i]);
  }
  return s + (v.size() == 1 ? ",)" : ")");
}

void check_same_device(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                       const at::Tensor& ref) {
  CW8A8_CHECK_VALUE(t.device() == ref.device(), op, name, "is on ", t.device(), " but `", ref_name, "` is on ",
                    ref.device());
}

void check_same_device(const char* op, const char* name, const std::optional<at::Tensor>& t, const char* ref_name,
                       const at::Tensor& ref) {
  if (t) check_same_device(op, name, *t, ref_name, ref);
}

void check_cuda(const char* op, const char* name, const at::Tensor& t) {
  CW8A8_CHECK_VALUE(t.is_cuda(), op, name, "must be a CUDA tensor, got device ", t.device());
}

void check_ab_dtype(const char* op, const char* name, const at::Tensor& t) {
  CW8A8_CHECK_TYPE(is_ab_dtype(t.scalar_type()), op, name, "must be int8 or float8_e4m3fn, got ",
                   py_dtype(t.scalar_type()));
}

void check_float32(const char* op, const char* name, const at::Tensor& t) {
  CW8A8_CHECK_TYPE(t.scalar_type() == at::kFloat, op, name, "must be float32, got ", py_dtype(t.scalar_type()));
}

void check_out_dtype_arg(const char* op, const char* name, at::ScalarType t) {
  CW8A8_CHECK_TYPE(is_out_dtype(t), op, name, "must be torch.bfloat16 or torch.float16, got ", py_dtype(t));
}

void check_bias_dtype(const char* op, const std::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  if (!bias) return;
  CW8A8_CHECK_TYPE(bias->scalar_type() == out_dtype, op, "bias", "must have the output dtype ", py_dtype(out_dtype),
                   ", got ", py_dtype(bias->scalar_type()));
}

void check_gemm_operands(const char* op, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                         const at::Tensor& scale_b, const at::Tensor* offsets, at::ScalarType out_dtype,
                         const std::optional<at::Tensor>& bias, const at::Tensor* out) {
  // dtypes
  check_ab_dtype(op, "a", a);
  CW8A8_CHECK_TYPE(b.scalar_type() == a.scalar_type(), op, "b", "must have a's dtype ", py_dtype(a.scalar_type()),
                   ", got ", py_dtype(b.scalar_type()));
  check_float32(op, "scale_a", scale_a);
  check_float32(op, "scale_b", scale_b);
  if (offsets != nullptr) {
    CW8A8_CHECK_TYPE(offsets->scalar_type() == at::kInt, op, "offsets", "must be int32, got ",
                     py_dtype(offsets->scalar_type()));
  }
  if (out != nullptr) {
    CW8A8_CHECK_TYPE(is_out_dtype(out->scalar_type()), op, "out", "must be bfloat16 or float16, got ",
                     py_dtype(out->scalar_type()));
  }
  check_out_dtype_arg(op, "out_dtype", out_dtype);
  check_bias_dtype(op, bias, out_dtype);
  // devices: everything on a's (a CPU tensor among CUDA ones gets here too)
  check_same_device(op, "b", b, "a", a);
  check_same_device(op, "scale_a", scale_a, "a", a);
  check_same_device(op, "scale_b", scale_b, "a", a);
  if (offsets != nullptr) check_same_device(op, "offsets", *offsets, "a", a);
  check_same_device(op, "bias", bias, "a", a);
  if (out != nullptr) check_same_device(op, "out", *out, "a", a);
  check_cuda(op, "a", a);  // only reached with every tensor on the CPU, which the CUDA kernel never is given
}

void check_contiguous(const char* op, const char* name, const at::Tensor& t) {
  CW8A8_CHECK_VALUE(t.is_contiguous(), op, name, "must be contiguous");
}

void check_gemm_dim(const char* op, const char* arg, const char* what, int64_t v) {
  CW8A8_CHECK_VALUE(v > 0 && v % limits::kGemmAlign == 0, op, arg, what, " must be a positive multiple of ",
                    limits::kGemmAlign, ", got ", v);
}

void check_int8_k(const char* op, const char* arg, at::ScalarType ab, int64_t k) {
  if (ab != at::kChar) return;
  CW8A8_CHECK_VALUE(k <= limits::kInt8MaxK, op, arg, "K = ", k,
                    " can overflow the int32 accumulator; int8 needs K <= ", limits::kInt8MaxK);
}

void check_scale_b_shape(const char* op, const char* name, const at::Tensor& t, int64_t n) {
  const bool ok = t.numel() == 1 || (t.dim() == 1 && t.size(0) == n) ||
                  (t.dim() == 2 && ((t.size(0) == 1 && t.size(1) == n) || (t.size(0) == n && t.size(1) == 1)));
  CW8A8_CHECK_VALUE(ok, op, name, "must be [1] (per-tensor), [N], [1, N] or [N, 1] (per-channel) with N = ", n,
                    ", got shape ", py_tuple(t.sizes()));
}

void check_bias_shape(const char* op, const std::optional<at::Tensor>& bias, int64_t n) {
  if (!bias) return;
  CW8A8_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n, op, "bias", "must be [N] with N = ", n, ", got shape ",
                    py_tuple(bias->sizes()));
  CW8A8_CHECK_VALUE(bias->is_contiguous(), op, "bias", "must be contiguous");
}

namespace {
// ceil(v / 128): the 128-wide blocks of v elements, the last one possibly partial.
int64_t scale_blocks(int64_t v) { return (v + limits::kBlockSize - 1) / limits::kBlockSize; }
}  // namespace

bool is_block_weight_scale(const at::Tensor& weight_scale, int64_t n, int64_t k) {
  if (weight_scale.dim() != 2 || weight_scale.numel() <= 1) return false;
  const int64_t rows = weight_scale.size(0), cols = weight_scale.size(1);
  return rows == scale_blocks(n) && cols == scale_blocks(k) && !(rows == n && cols == 1) && !(rows == 1 && cols == n);
}

bool is_block_scaled(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b) {
  if (a.dim() != 2 || b.dim() != 2) return false;
  if (scale_a.dim() == 2 && scale_a.size(1) > 1) return true;
  return is_block_weight_scale(scale_b, b.size(1), a.size(1));
}

bool is_block_weight_scaled(const at::Tensor& weight, const at::Tensor& weight_scale) {
  return weight.dim() == 2 && weight.scalar_type() == at::kFloat8_e4m3fn &&
         is_block_weight_scale(weight_scale, weight.size(0), weight.size(1));
}

void check_block_scales(const char* op, const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& scale_b,
                        int64_t m, int64_t k, int64_t n, int64_t experts) {
  const bool grouped = experts >= 0;  // grouped_scaled_mm: T rows, scale_b [E, NB, KB]
  const char* rows = grouped ? "T" : "M";
  const char* e_dim = grouped ? "E, " : "";
  CW8A8_CHECK_TYPE(a.scalar_type() == at::kFloat8_e4m3fn, op, "a", "must be float8_e4m3fn with block scales (scale_a [",
                   rows, ", K/128], scale_b [", e_dim, "ceil(N/128), K/128]), got ", py_dtype(a.scalar_type()));
  CW8A8_CHECK_VALUE(k % limits::kBlockSize == 0, op, "a", "K = a.shape[1] must be a multiple of ", limits::kBlockSize,
                    " with block scales, got ", k);
  const int64_t kb = k / limits::kBlockSize, nb = scale_blocks(n);
  CW8A8_CHECK_VALUE(scale_a.dim() == 2 && scale_a.size(0) == m && scale_a.size(1) == kb, op, "scale_a", "must be [",
                    rows, ", K/128] = [", m, ", ", kb, "] (1x128 groups) with block scales, got shape ",
                    py_tuple(scale_a.sizes()));
  const bool sb_ok = grouped ? scale_b.dim() == 3 && scale_b.size(0) == experts && scale_b.size(1) == nb &&
                                   scale_b.size(2) == kb
                             : scale_b.dim() == 2 && scale_b.size(0) == nb && scale_b.size(1) == kb;
  CW8A8_CHECK_VALUE(sb_ok, op, "scale_b", "must be [", e_dim, "ceil(N/128), K/128] = [",
                    grouped ? std::to_string(experts) + ", " : std::string(), nb, ", ", kb,
                    "] (128x128 blocks) with block scales, got shape ", py_tuple(scale_b.sizes()));
}

void check_row_major(const char* op, const char* name, const at::Tensor& t, int64_t width, const char* width_name,
                     int64_t multiple) {
  const int64_t rows = t.size(0), pitch = t.stride(0);
  CW8A8_CHECK_VALUE(t.stride(1) == 1, op, name, "must be row-major (stride(1) == 1), got strides ",
                    py_tuple(t.strides()));
  CW8A8_CHECK_VALUE(rows <= 1 || pitch >= width, op, name, "rows overlap: stride(0) = ", pitch, " < ", width_name,
                    " = ", width);
  CW8A8_CHECK_VALUE(rows <= 1 || pitch % multiple == 0, op, name, "stride(0) must be a multiple of ", multiple,
                    " elements, got ", pitch);
}

void check_column_major_b(const char* op, const char* name, const at::Tensor& b, int64_t k) {
  const int64_t ldb = b.stride(1);
  CW8A8_CHECK_VALUE(b.stride(0) == 1, op, name,
                    "must be column-major [K, N] (the transpose of a row-major [N, K] weight, stride(0) == 1), "
                    "got strides ", py_tuple(b.strides()));
  CW8A8_CHECK_VALUE(ldb >= k, op, name, "columns overlap: stride(1) = ", ldb, " < K = ", k);
  CW8A8_CHECK_VALUE(ldb % limits::kGemmAlign == 0, op, name, "stride(1) must be a multiple of ", limits::kGemmAlign,
                    " elements, got ", ldb);
}

void check_aligned16(const char* op, const char* name, const at::Tensor& t) {
  CW8A8_CHECK_VALUE(is_aligned(t.data_ptr(), 16), op, name, "data must be 16-byte aligned (storage offset ",
                    t.storage_offset(), ")");
}

void check_out_matrix(const char* op, const at::Tensor& out, int64_t m, int64_t n) {
  CW8A8_CHECK_VALUE(out.dim() == 2 && out.size(0) == m && out.size(1) == n, op, "out", "must be [M, N] = [", m,
                    ", ", n, "], got shape ", py_tuple(out.sizes()));
  check_row_major(op, "out", out, n, "N", 8);
  check_aligned16(op, "out", out);
}

}  // namespace cutlass_w8a8
