// The CUDA ops' argument contract, by operand role. Every message reads, character for character, as the one
// the CPU and fake implementations raise in Python (cutlass_w8a8/ops/_checks.py): dtypes printed as Python
// prints a torch.dtype ("torch.bfloat16"), shapes and strides as Python tuples ("(4, 64)", "(64,)"), devices as
// torch.device ("cuda:0", "cpu").
//
// CW8A8_CHECK_TYPE raises TypeError in Python (a wrong dtype), CW8A8_CHECK_VALUE ValueError (a wrong shape,
// layout, device or value); both print "op: `arg` message".
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include <ATen/ATen.h>

#include "core/limits.hpp"

#define CW8A8_CHECK_TYPE(cond, op, arg, ...) TORCH_CHECK_TYPE(cond, op, ": `", arg, "` ", __VA_ARGS__)
#define CW8A8_CHECK_VALUE(cond, op, arg, ...) TORCH_CHECK_VALUE(cond, op, ": `", arg, "` ", __VA_ARGS__)

namespace cutlass_w8a8 {

// How Python prints a dtype ("torch.bfloat16") and a shape or strides ("(4, 64)", "(64,)").
std::string py_dtype(at::ScalarType t);
std::string py_tuple(at::IntArrayRef v);
// How Python prints a float (repr): the shortest digits that read back as v; positional notation for decimal
// exponents in [-4, 16), with ".0" on whole numbers, else "1e-05" / "1.5e+16"; "nan", "inf", "-inf".
std::string py_float(double v);

inline bool is_aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// GEMM operand dtypes (int8, float8_e4m3fn) and output dtypes (bfloat16, float16).
inline bool is_ab_dtype(at::ScalarType t) { return t == at::kChar || t == at::kFloat8_e4m3fn; }
inline bool is_out_dtype(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// ---- devices --------------------------------------------------------------------------------------------------
// "`name` is on {t.device} but `ref_name` is on {ref.device}" (ValueError). A CPU tensor given with CUDA ones
// reaches the CUDA kernel, so this is also the check that rejects it.
void check_same_device(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                       const at::Tensor& ref);
void check_same_device(const char* op, const char* name, const std::optional<at::Tensor>& t,
                       const char* ref_name, const at::Tensor& ref);  // no-op for nullopt
// "`name` must be a CUDA tensor, got device {t.device}" (ValueError).
void check_cuda(const char* op, const char* name, const at::Tensor& t);

// ---- dtypes (TypeError) ---------------------------------------------------------------------------------------
// A GEMM operand: "`name` must be int8 or float8_e4m3fn, got torch.int32"
void check_ab_dtype(const char* op, const char* name, const at::Tensor& t);
// "`name` must be float32, got torch.float16"
void check_float32(const char* op, const char* name, const at::Tensor& t);
// A dtype argument naming the output: "`name` must be torch.bfloat16 or torch.float16, got torch.float32"
void check_out_dtype_arg(const char* op, const char* name, at::ScalarType t);
// A GEMM bias in the output dtype: "`bias` must have the output dtype torch.bfloat16, got torch.float16"
// (no-op for nullopt).
void check_bias_dtype(const char* op, const std::optional<at::Tensor>& bias, at::ScalarType out_dtype);

// ---- GEMM operands ---------------------------------------------------------------------------------------------
// The dtypes and devices of a W8A8 GEMM's operands, shared by scaled_mm (gemm/scaled_mm_args.cpp) and
// grouped_scaled_mm (gemm/grouped_mm_entry.cu), in ops/_checks.py's order (_gemm_operand_dtypes, the offsets,
// _gemm_out_dtypes, same_device). TypeError: `a` int8 or float8_e4m3fn, `b` of a's dtype, `scale_a` and `scale_b`
// float32, `offsets` (grouped_scaled_mm's; null for scaled_mm) int32, `out` (null for the functional ops) bfloat16 or
// float16, `out_dtype` an output dtype, `bias` of out_dtype. ValueError: every tensor on a's device
// ("`b` is on cpu but `a` is on cuda:0"), then `a` a CUDA tensor.
void check_gemm_operands(const char* op, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                         const at::Tensor& scale_b, const at::Tensor* offsets, at::ScalarType out_dtype,
                         const std::optional<at::Tensor>& bias, const at::Tensor* out);

// ---- shapes and values (ValueError) ----------------------------------------------------------------------------
// "`name` must be contiguous"
void check_contiguous(const char* op, const char* name, const at::Tensor& t);
// A GEMM dimension: "`arg` {what} must be a positive multiple of 16, got {v}", what e.g. "K = a.shape[1]".
void check_gemm_dim(const char* op, const char* arg, const char* what, int64_t v);
// int8 K (ab: the operand dtype; nothing for fp8): "`arg` K = {k} can overflow the int32 accumulator; int8 needs
// K <= 131056" (limits::kInt8MaxK).
void check_int8_k(const char* op, const char* arg, at::ScalarType ab, int64_t k);
// A per-channel scale of the [K, N] weight b: one value, or N as (N,), (1, N) or (N, 1): "`name` must be [1]
// (per-tensor), [N], [1, N] or [N, 1] (per-channel) with N = {n}, got shape {shape}". Contiguity is separate.
void check_scale_b_shape(const char* op, const char* name, const at::Tensor& t, int64_t n);
// The bias operand's shape, as ops/_roles.py (bias shape): None, or a contiguous (N,) vector. Its dtype is
// checked with the other dtypes.
void check_bias_shape(const char* op, const std::optional<at::Tensor>& bias, int64_t n);

// ---- block-scaled fp8 (1x128 activation groups, 128x128 weight blocks; limits::kBlockSize) ---------------------
// The C++ owner of block-scale detection (ops/_roles.py is the Python one); every C++ caller asks these.
//
// Whether `weight_scale` holds 128x128 block scales of an [N, K] weight: with KB = ceil(K / 128), NB = ceil(N / 128),
// 2-D of shape (NB, KB), more than one element, and not a per-channel (N, 1) / (1, N).
bool is_block_weight_scale(const at::Tensor& weight_scale, int64_t n, int64_t k);
// Whether a scaled_mm call (a [M, K], b [K, N]) is block-scaled: the one detection rule, ops/_roles.py block_scaled.
// scale_a 2-D with more than one column, or is_block_weight_scale(scale_b, N, K). False unless a and b are 2-D.
bool is_block_scaled(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b);
// Whether w8a8_linear's weight [N, K] has block scales (ops/_roles.py block_weight_scaled): scaled_mm's rule for
// its weight operand: a float8_e4m3fn 2-D weight and is_block_weight_scale(weight_scale, N, K).
bool is_block_weight_scaled(const at::Tensor& weight, const at::Tensor& weight_scale);
// Whether a grouped_scaled_mm call is block-scaled (ops/_checks.py check_grouped_scaled_mm): a 3-D scale_b, the
// experts' [E, ceil(N/128), K/128] block scales (row-wise scale_b are [E, N], [E] or [E, 1]).
inline bool is_grouped_block_scaled(const at::Tensor& scale_b) { return scale_b.dim() == 3; }
// The shape checks of a block-scaled call, in place of the row-wise scale shapes (ops/_roles.py block_scales), in
// this order: a float8_e4m3fn (TypeError, "`a` must be float8_e4m3fn with block scales (scale_a [M, K/128], scale_b
// [ceil(N/128), K/128]), got torch.int8"), K a multiple of 128, scale_a [M, K/128], scale_b [ceil(N/128), K/128]
// (ValueError). Contiguity is separate. With `experts` >= 0, grouped_scaled_mm's (m = T rows, E = experts weights):
// scale_a [T, K/128] and scale_b [E, ceil(N/128), K/128], the messages naming T and E.
void check_block_scales(const char* op, const at::Tensor& a, const at::Tensor& scale_a, const at::Tensor& scale_b,
                        int64_t m, int64_t k, int64_t n, int64_t experts = -1);

// ---- layouts (ValueError) -------------------------------------------------------------------------------------
// Rows of a row-major matrix with `width` elements per row (`width_name`, e.g. "K"), read with 16-byte accesses:
// stride(1) == 1, and for more than one row stride(0) >= width and a multiple of `multiple` elements. Padded rows
// (a slice of a wider buffer) are fine: the stride is passed to the kernel, never assumed.
void check_row_major(const char* op, const char* name, const at::Tensor& t, int64_t width, const char* width_name,
                     int64_t multiple);
// b [K, N] column-major (the transpose of a row-major [N, K] weight): stride(0) == 1, stride(1) >= K and a
// multiple of 16 elements. Alignment is separate.
void check_column_major_b(const char* op, const char* name, const at::Tensor& b, int64_t k);
// "`name` data must be 16-byte aligned (storage offset {offset})"
void check_aligned16(const char* op, const char* name, const at::Tensor& t);
// A GEMM destination `out` [M, N]: its shape, then row-major rows (pitch a multiple of 8 elements), then its
// alignment, in Python's order.
void check_out_matrix(const char* op, const at::Tensor& out, int64_t m, int64_t n);

}  // namespace cutlass_w8a8
