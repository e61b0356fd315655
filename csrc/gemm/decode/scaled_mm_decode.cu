// scaled_mm_decode and linear_decode, host side: argument checks, the split of K, the workspace and the launches.
// The kernels and their design: decode_kernels.cuh; the reasoning and estimates: README.md.
//
//   scaled_mm_decode: D[M, N] = round(scale_a[m] * (scale_b[n] * float(acc[m, n])) + bias[n]),
//                     acc = A[M, K] @ W[N, K]^T (int8: exact int32; e4m3: float32)
//   linear_decode:    the same with A = quantize_per_token(x) computed inside the kernel, bit for bit as
//                     csrc/quant/quantize.cu computes it (so the two paths give identical D).
//   add_rms_norm_linear_decode: the same with A = rms_norm_quant(x, norm_weight, eps, dtype, None, residual)'s q
//                     (K <= 8192), and residual_out = residual + x (out of place), bit for bit that chain.
//   block scales:     scaled_mm_decode with e4m3 operands, scale_a [M, K/128] and scale_b [ceil(N/128), K/128]
//                     (core/checks.hpp is_block_scaled; cw8a8_scaled_mm_args.scale_block from scaled_mm):
//                     D[m, n] = round(sum_kb scale_a[m, kb] * scale_b[n / 128, kb] * acc_kb[m, n] + bias[n]),
//                     acc_kb the float32 dot product over K group kb. linear_decode has no block path: its
//                     scale_b check refuses a [ceil(N/128), K/128] scale (w8a8_linear quantizes per group and
//                     runs this GEMM instead).
//
// Checks: scaled_mm_decode makes scaled_mm's (gemm/scaled_mm_args.hpp, under its own name), then M in [1, 16] and
// K <= 2**30; linear_decode makes ops/_checks.py check_linear_decode, in its order and wording. Whether the device runs
// them: core/device.hpp's gemm_backend; PDL: core/launch_policy.hpp's kernels_use_pdl.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "core/checks.hpp"
#include "core/device.hpp"
#include "core/launch.hpp"
#include "core/launch_policy.hpp"
#include "core/limits.hpp"
#include "gemm/decode/decode_host.cuh"
#include "gemm/decode/decode_kernels.cuh"
#include "gemm/scaled_mm_args.hpp"
#include "graphs/graph_nodes.hpp"
#include "ops.hpp"
#include "quant/rowwise_args.hpp"

namespace cutlass_w8a8 {
namespace {

constexpr const char* kGemmOp = "scaled_mm_decode";
constexpr const char* kLinearOp = "linear_decode";
constexpr const char* kNormOp = "add_rms_norm_linear_decode";

// --- checks ------------------------------------------------------------------------------------------------

// "`arg` M = arg.shape[0] must be in [1, 16] (decode sizes; scaled_mm serves any M), got {m}"
void check_decode_m(const char* op, const char* arg, int64_t m) {
  CW8A8_CHECK_VALUE(m >= 1 && m <= limits::kDecodeMaxM, op, arg, "M = ", arg, ".shape[0] must be in [1, ",
                    limits::kDecodeMaxM, "] (decode sizes; scaled_mm serves any M), got ", m);
}

void check_decode_k(const char* op, const char* arg, int64_t k) {
  CW8A8_CHECK_VALUE(k <= limits::kDecodeMaxK, op, arg, "K = ", k, " must be at most 2**30");
}

// ops/_checks.py check_scaled_mm_decode: scaled_mm's checks, then M and K. `out` null: the functional op.
void check_scaled_mm_decode(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                            const at::Tensor& scale_b, at::ScalarType out_dtype,
                            const std::optional<at::Tensor>& bias, const at::Tensor* out) {
  check_scaled_mm(kGemmOp, a, b, scale_a, scale_b, out_dtype, bias, out);
  check_decode_m(kGemmOp, "a", a.size(0));
  check_decode_k(kGemmOp, "a", a.size(1));
}

// "`name` must have x's dtype {x.dtype}, got {t.dtype}" (TypeError)
void check_x_dtype(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x) {
  CW8A8_CHECK_TYPE(t.scalar_type() == x.scalar_type(), op, name, "must have x's dtype ", py_dtype(x.scalar_type()),
                   ", got ", py_dtype(t.scalar_type()));
}

// The shape checks both fused ops make on x (M, K) and b (K, N), in ops/_checks.py's order: both 2-D, b's K equal to
// x's, M a decode size, K and N GEMM dimensions, int8's K rule. Returns {M, K, N}.
std::tuple<int64_t, int64_t, int64_t> check_x_b_shapes(const char* op, const at::Tensor& x, const at::Tensor& b) {
  CW8A8_CHECK_VALUE(x.dim() == 2, op, "x", "must be 2-D [M, K], got shape ", py_tuple(x.sizes()));
  CW8A8_CHECK_VALUE(b.dim() == 2, op, "b", "must be 2-D [K, N], got shape ", py_tuple(b.sizes()));
  const int64_t m = x.size(0), k = x.size(1), n = b.size(1);
  CW8A8_CHECK_VALUE(b.size(0) == k, op, "b", "must be [K, N] with K = x.shape[1] = ", k, ", got shape ",
                    py_tuple(b.sizes()));
  check_decode_m(op, "x", m);
  check_gemm_dim(op, "x", "K = x.shape[1]", k);
  check_gemm_dim(op, "b", "N = b.shape[1]", n);
  check_int8_k(op, "x", b.scalar_type(), k);
  return {m, k, n};
}

// The checks both fused ops make after the shapes, in ops/_checks.py's order: scale_b's and bias's shapes for N,
// then the layouts: b as scaled_mm's, x row-major and 16-byte aligned (read with 16-byte loads).
void check_b_terms_and_layouts(const char* op, const at::Tensor& x, const at::Tensor& b, const at::Tensor& scale_b,
                               const std::optional<at::Tensor>& bias, int64_t k, int64_t n) {
  check_scale_b_shape(op, "scale_b", scale_b, n);
  check_contiguous(op, "scale_b", scale_b);
  check_bias_shape(op, bias, n);
  check_column_major_b(op, "b", b, k);
  check_aligned16(op, "b", b);
  check_row_major(op, "x", x, k, "K", 8);
  check_aligned16(op, "x", x);
}

// ops/_checks.py check_linear_decode: x (M, K) bfloat16 / float16 where scaled_mm has a; b, scale_b, bias and out as
// scaled_mm's, with bias and out in x's dtype. `out` null: the functional op.
void check_linear_decode(const at::Tensor& x, const at::Tensor& b, const at::Tensor& scale_b,
                         const std::optional<at::Tensor>& bias, at::ScalarType dtype, const at::Tensor* out) {
  constexpr const char* op = kLinearOp;
  // dtypes
  CW8A8_CHECK_TYPE(is_out_dtype(x.scalar_type()), op, "x", "must be bfloat16 or float16, got ",
                   py_dtype(x.scalar_type()));
  quant::check_quant_dtype(op, dtype);
  CW8A8_CHECK_TYPE(b.scalar_type() == dtype, op, "b", "must have the quantized dtype ", py_dtype(dtype), ", got ",
                   py_dtype(b.scalar_type()));
  check_float32(op, "scale_b", scale_b);
  if (out != nullptr) check_x_dtype(op, "out", *out, x);
  if (bias) check_x_dtype(op, "bias", *bias, x);
  // devices
  check_same_device(op, "b", b, "x", x);
  check_same_device(op, "scale_b", scale_b, "x", x);
  if (out != nullptr) check_same_device(op, "out", *out, "x", x);
  check_same_device(op, "bias", bias, "x", x);
  check_cuda(op, "x", x);  // holds after the device checks: the op reached CUDA through one of its tensors
  // shapes
  const auto [m, k, n] = check_x_b_shapes(op, x, b);
  check_decode_k(op, "x", k);
  check_b_terms_and_layouts(op, x, b, scale_b, bias, k, n);
  if (out != nullptr) check_out_matrix(op, *out, m, n);
}

// ops/_checks.py check_add_rms_norm_linear_decode, in its order and wording: linear_decode's contract for x, b,
// scale_b and bias, with residual (optional) and norm_weight in x's dtype, eps, K <= 8192 and no block scales.
void check_add_rms_norm_linear_decode(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                      const at::Tensor& norm_weight, double eps, const at::Tensor& b,
                                      const at::Tensor& scale_b, const std::optional<at::Tensor>& bias,
                                      at::ScalarType dtype) {
  constexpr const char* op = kNormOp;
  // dtypes
  CW8A8_CHECK_TYPE(is_out_dtype(x.scalar_type()), op, "x", "must be bfloat16 or float16, got ",
                   py_dtype(x.scalar_type()));
  if (residual) check_x_dtype(op, "residual", *residual, x);
  check_x_dtype(op, "norm_weight", norm_weight, x);
  quant::check_quant_dtype(op, dtype);
  CW8A8_CHECK_TYPE(b.scalar_type() == dtype, op, "b", "must have the quantized dtype ", py_dtype(dtype), ", got ",
                   py_dtype(b.scalar_type()));
  check_float32(op, "scale_b", scale_b);
  if (bias) check_x_dtype(op, "bias", *bias, x);
  // devices
  check_same_device(op, "residual", residual, "x", x);
  check_same_device(op, "norm_weight", norm_weight, "x", x);
  check_same_device(op, "b", b, "x", x);
  check_same_device(op, "scale_b", scale_b, "x", x);
  check_same_device(op, "bias", bias, "x", x);
  check_cuda(op, "x", x);
  // values and shapes
  CW8A8_CHECK_VALUE(eps >= 0.0 && eps < INFINITY, op, "eps", "must be a finite number >= 0, got ", py_float(eps));
  const auto [m, k, n] = check_x_b_shapes(op, x, b);
  CW8A8_CHECK_VALUE(k <= limits::kNormDecodeMaxK, op, "x", "K = x.shape[1] must be at most ",
                    limits::kNormDecodeMaxK, " (the rows rms_norm_quant normalizes in one block), got ", k);
  if (residual) {
    CW8A8_CHECK_VALUE(residual->sizes() == x.sizes(), op, "residual", "must have x's shape ", py_tuple(x.sizes()),
                      ", got ", py_tuple(residual->sizes()));
  }
  CW8A8_CHECK_VALUE(norm_weight.dim() == 1 && norm_weight.size(0) == k, op, "norm_weight", "must be [K] with K = ", k,
                    ", got shape ", py_tuple(norm_weight.sizes()));
  CW8A8_CHECK_VALUE(!is_block_weight_scale(scale_b, n, k), op, "scale_b", "block scales ", py_tuple(scale_b.sizes()),
                    " are not supported (the fused norm quantizes per token): use rms_norm_quant(group_size=128) "
                    "and scaled_mm");
  check_b_terms_and_layouts(op, x, b, scale_b, bias, k, n);
  // layouts of the norm's operands: residual and norm_weight read with 16-byte loads
  if (residual) {
    check_row_major(op, "residual", *residual, k, "K", 8);
    check_aligned16(op, "residual", *residual);
  }
  check_contiguous(op, "norm_weight", norm_weight);
  check_aligned16(op, "norm_weight", norm_weight);
}

// The clear error for a device the kernels cannot run on (int8 mma.sync needs 8.0, fp8 mma.sync 8.9).
void check_backend(const char* op, int device, bool fp8) {
  if (gemm_backend(device, fp8) != GemmBackend::kNone) return;
  const DeviceInfo& info = device_info(device);
  if (fp8) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, "cutlass_w8a8.", op, ": float8_e4m3fn needs compute capability 8.9 or "
                                "newer (fp8 mma.sync); device ", device, " is ", info.major, ".", info.minor);
  }
  TORCH_CHECK_NOT_IMPLEMENTED(false, "cutlass_w8a8.", op, ": int8 needs compute capability 8.0 or newer; device ",
                              device, " is ", info.major, ".", info.minor);
}

// --- launch ------------------------------------------------------------------------------------------------

// Split of K across CTAs (README.md, "Parallelism"): none when the N / 16 row tiles already give every SM a CTA;
// otherwise enough splits for about two CTAs per SM, each split keeping all 8 warps busy (at least 8 blocks of
// 256 bytes). Depends on N, K and the SM count only (never on M).
int choose_splits(int64_t n, int64_t k, int sms, int* blocks_per_split) {
  const int64_t tiles = n / kRows;
  const int64_t nblk = (k + kBlockBytes - 1) / kBlockBytes;
  int64_t splits = 1;
  if (tiles < sms) {
    splits = std::min<int64_t>((2 * static_cast<int64_t>(sms) + tiles - 1) / tiles, nblk / kWarps);
    splits = std::max<int64_t>(splits, 1);
  }
  int64_t bps = (nblk + splits - 1) / splits;
  bps = (bps + kWarps - 1) / kWarps * kWarps;
  splits = (nblk + bps - 1) / bps;
  TORCH_CHECK(bps <= INT32_MAX && splits <= 65535, "cutlass_w8a8 decode: K = ", k, " is too large");
  *blocks_per_split = static_cast<int>(bps);
  return static_cast<int>(splits);
}

template <class P, class... KArgs>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, cudaStream_t stream, bool pdl, int64_t m,
            const P& p) {
  C10_CUDA_CHECK(launch_kernel(kernel, grid, block, 0, stream, pdl, m, p));
}

// L2 prefetch per weight row before the PDL wait (decode_kernels.cuh): what the CTAs resident at once (about two
// per SM) can ask for within half of L2, so that the prefetched bytes are not evicted before the loads use them;
// a multiple of the 256-byte block. Only a prefix of a longer split: on an H100 (bench_decode_gemm, cold-L2 graph
// replays) prefetching whole rows slowed the K = 4096 projections (Llama-3-8B qkv 9.9 -> 11.1 us, o 7.4 -> 8.5 us:
// every load then follows its own prefetch), while a 6 KiB prefix of the K = 14336 down projection's rows sped it
// up (22.1 -> 20.5 us). 0 when the split fits the prefix or the weight rows are not 16-byte aligned.
uint32_t choose_prefetch_bytes(const DeviceInfo& info, int64_t ldw, int blocks_per_split) {
  if (ldw % 16 != 0 || info.l2_bytes <= 0) return 0;
  const int64_t resident_rows = 2 * static_cast<int64_t>(info.sm_count) * kRows;
  int64_t per_row = static_cast<int64_t>(info.l2_bytes) / 2 / resident_rows;
  per_row = per_row / kBlockBytes * kBlockBytes;
  if (per_row <= 0 || static_cast<int64_t>(blocks_per_split) * kBlockBytes <= per_row) return 0;
  return static_cast<uint32_t>(per_row);
}

template <class AB, class OutT, class XT, bool kBlockScaled = false, class P>
void launch_typed(const char* op, int64_t m, const P& p, cudaStream_t stream, bool pdl) {
  const dim3 grid(static_cast<unsigned>(p.n / kRows), static_cast<unsigned>(p.splits));
  if (m <= 8) {
    launch(decode_gemm_kernel<AB, OutT, 1, XT, kBlockScaled>, grid, dim3(kThreads), stream, pdl, m, p);
  } else {
    launch(decode_gemm_kernel<AB, OutT, 2, XT, kBlockScaled>, grid, dim3(kThreads), stream, pdl, m, p);
  }
  graph_nodes::note_m_param_launch(stream, m, op, kMainParams);
  if (p.splits > 1) {
    const dim3 rgrid(static_cast<unsigned>((p.n + kReduceThreads - 1) / kReduceThreads));
    launch(decode_reduce_kernel<typename AB::Acc, OutT, kBlockScaled>, rgrid, dim3(kReduceThreads), stream, pdl, m,
           static_cast<const DecodeParams&>(p));
    graph_nodes::note_m_param_launch(stream, m, op, kReduceParams);
  }
}

// The parameters both ops share, from checked tensors: the activations `act` (M, K) (8-bit a, or x), the weight
// operand b = w.t() (K, N), scale_b, bias and out (M, N). scale_a is the caller's.
DecodeParams common_params(const at::Tensor& act, const at::Tensor& b, const at::Tensor& scale_b,
                           const std::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t m = act.size(0);
  DecodeParams p{};
  p.a = act.data_ptr();
  p.lda = m <= 1 ? 0 : act.stride(0);
  p.w = static_cast<const uint8_t*>(b.data_ptr());
  p.ldw = b.stride(1);
  p.scale_b = scale_b.data_ptr<float>();
  p.bias = bias ? bias->data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.ldo = m <= 1 ? 0 : out.stride(0);
  p.n = b.size(1);
  p.k = static_cast<int>(act.size(1));
  p.scale_b_per_channel = scale_b.numel() == 1 ? 0 : 1;
  return p;
}

// Fills the M-independent launch fields shared by both ops, allocates the split-K workspace, launches.
// `xt` is the type of linear_decode's x, or Undefined for scaled_mm_decode. `block`: e4m3 with block scales
// (scaled_mm_decode only; p.scale_a [M, K/128], p.scale_b [ceil(N/128), K/128]). `norm`: add_rms_norm_linear_decode,
// whose `p` is the DecodeParams part of a NormDecodeParams (the kernel gets the whole block).
void run(const char* op, int64_t m, DecodeParams& p, at::ScalarType ab, at::ScalarType out_type,
         at::ScalarType xt, const at::Tensor& like, bool block = false, bool norm = false) {
  const int device = like.device().index();
  const bool fused = xt != at::ScalarType::Undefined;  // linear_decode: x's type is the output type
  TORCH_CHECK(!block || (!fused && ab == at::kFloat8_e4m3fn), "cutlass_w8a8.", op,
              ": block scales need float8_e4m3fn operands and quantized activations");  // the callers' checks hold it
  check_backend(op, device, ab == at::kFloat8_e4m3fn);
  c10::cuda::CUDAGuard guard(like.device());
  const DeviceInfo& info = device_info(device);
  p.splits = choose_splits(p.n, p.k, info.sm_count, &p.blocks_per_split);
  p.prefetch_bytes = choose_prefetch_bytes(info, p.ldw, p.blocks_per_split);
  p.prefetch_ctas = 2 * static_cast<uint32_t>(info.sm_count);
  at::Tensor workspace;
  if (p.splits > 1) {
    const int64_t partial_bytes = static_cast<int64_t>(p.splits) * kMaxTokens * p.n * 4;
    workspace = at::empty({partial_bytes + kMaxTokens * 4}, like.options().dtype(at::kByte));
    p.partials = workspace.data_ptr();
    if (fused) {
      p.scales_out = reinterpret_cast<float*>(static_cast<uint8_t*>(workspace.data_ptr()) + partial_bytes);
      p.scale_a = p.scales_out;
      p.scale_a_per_token = 1;
    }
  }
  cudaStream_t stream = current_stream(like);
  const bool pdl = kernels_use_pdl(device);
  auto with_types = [&](auto ab_tag, auto out_tag) {
    using AB = decltype(ab_tag);
    using OutT = decltype(out_tag);
    if (fused && norm) {
      launch_typed<AB, OutT, NormX<OutT>>(op, m, static_cast<const NormDecodeParams&>(p), stream, pdl);
    } else if (fused) {
      launch_typed<AB, OutT, OutT>(op, m, p, stream, pdl);
    } else if constexpr (std::is_same_v<AB, Fp8Ab>) {
      if (block) {
        launch_typed<AB, OutT, void, true>(op, m, p, stream, pdl);
      } else {
        launch_typed<AB, OutT, void>(op, m, p, stream, pdl);
      }
    } else {
      launch_typed<AB, OutT, void>(op, m, p, stream, pdl);
    }
  };
  with_decode_types(ab == at::kChar, out_type == at::kBFloat16, with_types);
}

// The checked ops.
void run_scaled_mm_decode(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                          const at::Tensor& scale_b, const std::optional<at::Tensor>& bias) {
  DecodeParams p = common_params(a, b, scale_b, bias, out);
  p.scale_a = scale_a.data_ptr<float>();
  p.scale_a_per_token = scale_a.numel() == 1 ? 0 : 1;
  const bool block = is_block_scaled(a, b, scale_a, scale_b);  // checked by check_scaled_mm: e4m3, K % 128 == 0
  run(kGemmOp, a.size(0), p, a.scalar_type(), out.scalar_type(), at::ScalarType::Undefined, a, block);
}

void run_linear_decode(at::Tensor& out, const at::Tensor& x, const at::Tensor& b, const at::Tensor& scale_b,
                       const std::optional<at::Tensor>& bias, at::ScalarType dtype) {
  DecodeParams p = common_params(x, b, scale_b, bias, out);
  p.scale_a = nullptr;  // computed in the kernel (the workspace when K is split)
  p.scale_a_per_token = 1;
  run(kLinearOp, x.size(0), p, dtype, out.scalar_type(), x.scalar_type(), x);
}

void run_add_rms_norm_linear_decode(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& x,
                                    const std::optional<at::Tensor>& residual, const at::Tensor& norm_weight,
                                    double eps, const at::Tensor& b, const at::Tensor& scale_b,
                                    const std::optional<at::Tensor>& bias, at::ScalarType dtype) {
  const int64_t m = x.size(0);
  NormDecodeParams p{};
  static_cast<DecodeParams&>(p) = common_params(x, b, scale_b, bias, out);
  p.scale_a = nullptr;  // computed in the kernel (the workspace when K is split)
  p.scale_a_per_token = 1;
  p.residual = residual ? residual->data_ptr() : nullptr;
  p.ldr = residual && m > 1 ? residual->stride(0) : 0;
  p.residual_out = residual_out.data_ptr();
  p.ldro = m <= 1 ? 0 : residual_out.stride(0);
  p.norm_weight = norm_weight.data_ptr();
  p.eps = static_cast<float>(eps);
  run(kNormOp, m, p, dtype, out.scalar_type(), x.scalar_type(), x, false, true);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> add_rms_norm_linear_decode(const at::Tensor& x,
                                                              const std::optional<at::Tensor>& residual,
                                                              const at::Tensor& norm_weight, double eps,
                                                              const at::Tensor& b, const at::Tensor& scale_b,
                                                              const std::optional<at::Tensor>& bias,
                                                              at::ScalarType dtype) {
  check_add_rms_norm_linear_decode(x, residual, norm_weight, eps, b, scale_b, bias, dtype);
  at::Tensor out = at::empty({x.size(0), b.size(1)}, x.options());
  at::Tensor residual_out = at::empty({x.size(0), x.size(1)}, x.options());
  run_add_rms_norm_linear_decode(out, residual_out, x, residual, norm_weight, eps, b, scale_b, bias, dtype);
  return {out, residual_out};
}

void launch_scaled_mm_decode(const cw8a8_scaled_mm_args& args, const at::Tensor& a) {
  DecodeParams p{};
  set_decode_operands(p, args, args.m);
  run(kGemmOp, args.m, p, args.ab_type == CW8A8_AB_INT8 ? at::kChar : at::kFloat8_e4m3fn,
      args.out_type == CW8A8_OUT_BF16 ? at::kBFloat16 : at::kHalf, at::ScalarType::Undefined, a,
      args.scale_block != 0);
}

void scaled_mm_decode_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                          const at::Tensor& scale_b, const std::optional<at::Tensor>& bias) {
  check_scaled_mm_decode(a, b, scale_a, scale_b, out.scalar_type(), bias, &out);
  run_scaled_mm_decode(out, a, b, scale_a, scale_b, bias);
}

at::Tensor scaled_mm_decode(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                            const at::Tensor& scale_b, at::ScalarType out_dtype,
                            const std::optional<at::Tensor>& bias) {
  check_scaled_mm_decode(a, b, scale_a, scale_b, out_dtype, bias, nullptr);
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options().dtype(out_dtype));
  run_scaled_mm_decode(out, a, b, scale_a, scale_b, bias);
  return out;
}

void linear_decode_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& b, const at::Tensor& scale_b,
                       const std::optional<at::Tensor>& bias, at::ScalarType dtype) {
  check_linear_decode(x, b, scale_b, bias, dtype, &out);
  run_linear_decode(out, x, b, scale_b, bias, dtype);
}

at::Tensor linear_decode(const at::Tensor& x, const at::Tensor& b, const at::Tensor& scale_b,
                         const std::optional<at::Tensor>& bias, at::ScalarType dtype) {
  check_linear_decode(x, b, scale_b, bias, dtype, nullptr);
  at::Tensor out = at::empty({x.size(0), b.size(1)}, x.options());
  run_linear_decode(out, x, b, scale_b, bias, dtype);
  return out;
}

}  // namespace cutlass_w8a8
