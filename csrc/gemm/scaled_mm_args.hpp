// scaled_mm's argument contract and its argument block, once: checked and packed here for the ops that run a
// W8A8 GEMM (scaled_mm / scaled_mm_out / _scaled_mm_config in gemm/scaled_mm_entry.cu, w8a8_linear in
// gemm/w8a8_linear.cu, the decode GEMM's scaled_mm_decode) and for CUDA-graph node updates (graphs/graph_nodes.cu).
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/ATen.h>

#include "gemm/kernel_api.h"

namespace cutlass_w8a8 {

// ops/_checks.py check_scaled_mm, in its order and wording, with `op` naming the op in the messages:
//   a        (M, K) int8 or float8_e4m3fn, row-major (stride(1) == 1; stride(0) >= K, a multiple of 16 for M > 1),
//            16-byte aligned; M < 2**31, K a positive multiple of 16 (int8: K <= 131056)
//   b        (K, N) a's dtype, column-major (the [N, K] row-major weight's .t()), N a positive multiple of 16
//   scale_a  float32, one value or (M, 1) / (M,), contiguous
//   scale_b  float32, one value or (N,) / (1, N) / (N, 1), contiguous
//            or, block-scaled fp8 (core/checks.hpp is_block_scaled): a and b float8_e4m3fn, K a multiple of 128,
//            scale_a (M, K/128) (1x128 groups of a) and scale_b (ceil(N/128), K/128) (128x128 blocks of the weight),
//            both contiguous (check_block_scales, where the row-wise scale shapes are checked)
//   bias     None or (N,) of the output dtype, contiguous
//   out      nullptr (the functional op: then `out_dtype` is checked) or (M, N) bfloat16 / float16, row-major
//            (pitch a multiple of 8 elements), 16-byte aligned
// Every tensor on a's device. TypeError for dtypes, ValueError for the rest.
void check_scaled_mm(const char* op, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                     const at::Tensor& scale_b, at::ScalarType out_dtype, const std::optional<at::Tensor>& bias,
                     const at::Tensor* out);

// The operands of one GEMM D[M, N] = A[M, K] @ B[K, N] as the kernels read them, already checked.
struct GemmOperands {
  int64_t m = 0, n = 0, k = 0;
  at::ScalarType ab = at::kChar;         // int8 or float8_e4m3fn
  at::ScalarType out = at::kBFloat16;    // bfloat16 or float16
  const void* a = nullptr;               // row m at a + m * lda
  int64_t lda = 0;
  const void* b = nullptr;               // the [N, K] row-major weight: row n at b + n * ldb
  int64_t ldb = 0;
  void* d = nullptr;                     // row m at d + m * ldd
  int64_t ldd = 0;
  const float* scale_a = nullptr;        // M values (per token) or one
  bool scale_a_per_token = false;
  const float* scale_b = nullptr;        // N values (per channel) or one
  bool scale_b_per_channel = false;
  bool scale_block = false;              // block-scaled fp8: scale_a [M, K/128], scale_b [ceil(N/128), K/128],
                                         // row-major (kernel_api.h); the two flags above are then false
  const void* bias = nullptr;            // N values of the output type, or null
  int device = 0;
};

// Fills the argument block: the one place that maps dtypes to the kernel_api.h enums, reads the SM count and
// gives a single-row operand a legal packed pitch. Stream, config and PDL are left for the launch.
cw8a8_scaled_mm_args pack_scaled_mm(const GemmOperands& g);

// pack_scaled_mm of scaled_mm's tensors (a (M, K), b (K, N), out (M, N)), already checked by check_scaled_mm.
cw8a8_scaled_mm_args pack_scaled_mm(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                                    const at::Tensor& scale_a, const at::Tensor& scale_b,
                                    const std::optional<at::Tensor>& bias);

// check_scaled_mm (with out's dtype as the output dtype), then pack_scaled_mm of the tensors.
cw8a8_scaled_mm_args check_and_pack_scaled_mm(const char* op, const at::Tensor& out, const at::Tensor& a,
                                              const at::Tensor& b, const at::Tensor& scale_a,
                                              const at::Tensor& scale_b, const std::optional<at::Tensor>& bias);

// Runs a packed argument block whose operands are already checked (gemm/scaled_mm_entry.cu): at decode sizes the
// decode GEMM (core/launch_policy.hpp's scaled_mm_uses_decode; never with a forced `config`), else picks the kernel
// library for the device (and the Ampere/Ada vector-scale form; block-scaled fp8 off sm90: NotImplementedError),
// takes PDL from core/launch_policy.hpp, launches
// on the current stream of `a`'s device and records the launch for CUDA-graph node updates. `config` < 0 lets the
// library choose by shape. `scale_a` may be an undefined tensor when args.scale_a points to M per-token scales at
// a 16-byte aligned address. Does nothing for M = 0.
void launch_scaled_mm(cw8a8_scaled_mm_args& args, const at::Tensor& a, const at::Tensor& scale_a,
                      const at::Tensor& scale_b, const std::optional<at::Tensor>& bias, int64_t config = -1);

// The decode GEMM (gemm/decode/scaled_mm_decode.cu) on a packed, checked argument block with 1 <= M <= 16, on the
// current stream of `a`'s device; its split-K workspace (if any) from the caching allocator.
void launch_scaled_mm_decode(const cw8a8_scaled_mm_args& args, const at::Tensor& a);

}  // namespace cutlass_w8a8
