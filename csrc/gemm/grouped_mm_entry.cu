// grouped_scaled_mm / grouped_scaled_mm_out (issue 27, mixture-of-experts) and the tuning op _grouped_scaled_mm_config
// (a forced entry of the sm90 library's grouped table; bench/bench_moe.py --grouped-configs): check (the contract of
// cutlass_w8a8/ops/_checks.py check_grouped_scaled_mm, same messages in the same order), pack a
// cw8a8_grouped_mm_args (gemm/kernel_api.h), and dispatch: T <= grouped_decode_max_rows() to the grouped decode
// GEMM (gemm/decode/grouped_decode.hpp), larger T to the sm90 library's CUTLASS ptr-array grouped GEMM
// (cw8a8_sm90_grouped_mm, gemm/kernel_libraries.hpp). sm90 only. Nothing here reads `offsets`: both kernels clamp
// them on the device, so the op never synchronises with the host and captures into a CUDA graph.
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include <c10/cuda/CUDAGuard.h>

#include "core/checks.hpp"
#include "core/device.hpp"
#include "core/launch_policy.hpp"
#include "core/limits.hpp"
#include "gemm/decode/grouped_decode.hpp"
#include "gemm/kernel_api.h"
#include "gemm/kernel_libraries.hpp"
#include "graphs/graph_nodes.hpp"
#include "ops.hpp"

namespace cutlass_w8a8 {
namespace {

constexpr const char* kOp = "grouped_scaled_mm";

void check_grouped_scaled_mm(const char* op, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                             const at::Tensor& scale_b, const at::Tensor& offsets, at::ScalarType out_dtype,
                             const std::optional<at::Tensor>& bias, const at::Tensor* out) {
  // dtypes, then devices: scaled_mm's (core/checks.hpp), with the offsets
  check_gemm_operands(op, a, b, scale_a, scale_b, &offsets, out_dtype, bias, out);

  // shapes
  CW8A8_CHECK_VALUE(a.dim() == 2, op, "a", "must be 2-D [T, K], got shape ", py_tuple(a.sizes()));
  CW8A8_CHECK_VALUE(b.dim() == 3, op, "b", "must be 3-D [E, K, N] (each expert's [N, K] weight transposed), got shape ",
                    py_tuple(b.sizes()));
  const int64_t t = a.size(0), k = a.size(1), e = b.size(0), n = b.size(2);
  CW8A8_CHECK_VALUE(b.size(1) == k, op, "b", "must be [E, K, N] with K = a.shape[1] = ", k, ", got shape ",
                    py_tuple(b.sizes()));
  CW8A8_CHECK_VALUE(t < limits::kMaxM, op, "a", "T = a.shape[0] must be below 2**31, got ", t);
  check_gemm_dim(op, "a", "K = a.shape[1]", k);
  check_gemm_dim(op, "b", "N = b.shape[2]", n);
  CW8A8_CHECK_VALUE(e >= 1 && e <= limits::kMoeMaxExperts, op, "b", "E = b.shape[0] must be in [1, ",
                    limits::kMoeMaxExperts, "], got ", e);
  check_int8_k(op, "a", a.scalar_type(), k);
  CW8A8_CHECK_VALUE(offsets.dim() == 1 && offsets.size(0) == e, op, "offsets", "must be [E] = [", e,
                    "] (the end row of each expert's group), got shape ", py_tuple(offsets.sizes()));
  if (is_grouped_block_scaled(scale_b)) {  // scaled_mm's block-scale checks (core/checks.hpp): T rows, E experts
    check_block_scales(op, a, scale_a, scale_b, t, k, n, /*experts=*/e);
  } else {
    const bool sa_ok = scale_a.numel() == 1 || (scale_a.dim() == 1 && scale_a.size(0) == t) ||
                       (scale_a.dim() == 2 && scale_a.size(0) == t && scale_a.size(1) == 1);
    CW8A8_CHECK_VALUE(sa_ok, op, "scale_a", "must be [1] (per-tensor), [T] or [T, 1] (per-token) with T = ", t,
                      ", got shape ", py_tuple(scale_a.sizes()));
    const bool sb_ok = (scale_b.dim() == 2 && scale_b.size(0) == e && (scale_b.size(1) == n || scale_b.size(1) == 1)) ||
                       (scale_b.dim() == 1 && scale_b.size(0) == e);
    CW8A8_CHECK_VALUE(sb_ok, op, "scale_b", "must be [E, N] (per-channel), [E] or [E, 1] (per-expert) with E = ", e,
                      ", N = ", n, ", or [E, ceil(N/128), K/128] (block fp8), got shape ", py_tuple(scale_b.sizes()));
  }
  check_contiguous(op, "scale_a", scale_a);
  check_contiguous(op, "scale_b", scale_b);
  check_contiguous(op, "offsets", offsets);
  if (bias) {
    CW8A8_CHECK_VALUE(bias->dim() == 2 && bias->size(0) == e && bias->size(1) == n, op, "bias", "must be [E, N] = [",
                      e, ", ", n, "], got shape ", py_tuple(bias->sizes()));
    check_contiguous(op, "bias", *bias);
  }

  // layouts (TMA: 16-byte aligned bases and pitches)
  check_row_major(op, "a", a, k, "K", limits::kGemmAlign);
  CW8A8_CHECK_VALUE(b.stride(1) == 1, op, "b",
                    "must be [E, K, N] with stride(1) == 1 (w.transpose(1, 2) of a row-major [E, N, K] weight), got "
                    "strides ", py_tuple(b.strides()));
  CW8A8_CHECK_VALUE(b.stride(2) >= k, op, "b", "columns overlap: stride(2) = ", b.stride(2), " < K = ", k);
  CW8A8_CHECK_VALUE(b.stride(2) % limits::kGemmAlign == 0, op, "b", "stride(2) must be a multiple of ",
                    limits::kGemmAlign, " elements, got ", b.stride(2));
  if (e > 1) {
    CW8A8_CHECK_VALUE(b.stride(0) >= n * b.stride(2), op, "b", "experts overlap: stride(0) = ", b.stride(0),
                      " < N * stride(2) = ", n * b.stride(2));
    CW8A8_CHECK_VALUE(b.stride(0) % limits::kGemmAlign == 0, op, "b", "stride(0) must be a multiple of ",
                      limits::kGemmAlign, " elements, got ", b.stride(0));
  }
  check_aligned16(op, "a", a);
  check_aligned16(op, "b", b);
  if (out != nullptr) {
    CW8A8_CHECK_VALUE(out->dim() == 2 && out->size(0) == t && out->size(1) == n, op, "out", "must be [T, N] = [", t,
                      ", ", n, "], got shape ", py_tuple(out->sizes()));
    check_contiguous(op, "out", *out);
    check_aligned16(op, "out", *out);
  }
}

// Workspace from the torch caching allocator (stream-ordered; the graph's private pool while capturing). Every
// allocation of one call is kept until the call returns, so a second one can never reuse the first's memory.
struct GroupedWorkspace {
  at::Device device;
  std::vector<at::Tensor> buffers;
  std::string error;
};

// CUTLASS_W8A8_ZERO_WORKSPACE=1 (scripts/sanitize.py sets it under initcheck only): zero the grouped workspace.
// The grouped kernel writes its per-SM TMA descriptors there with tensormap.cp_fenceproxy, which compute-sanitizer's
// initcheck does not count as a write, so every later read of a descriptor was reported as uninitialized (H200,
// CUDA 13.0: one 128-byte slot per CTA, base + 128 * blockIdx); a plain memset first marks the slots written. Off by
// default: an extra memset per call for a tool's blind spot. Read once per process.
bool zero_grouped_workspace() {
  static const bool on = [] {
    const char* v = std::getenv("CUTLASS_W8A8_ZERO_WORKSPACE");
    return v != nullptr && v[0] == '1';
  }();
  return on;
}

void* allocate_grouped_workspace(void* ctx, size_t bytes) {
  auto* ws = static_cast<GroupedWorkspace*>(ctx);
  try {
    const auto options = at::TensorOptions().dtype(at::kByte).device(ws->device);
    const int64_t n = static_cast<int64_t>(bytes);
    ws->buffers.push_back(zero_grouped_workspace() ? at::zeros({n}, options) : at::empty({n}, options));
    return ws->buffers.back().data_ptr();
  } catch (const std::exception& e) {
    ws->error = e.what();
    return nullptr;
  }
}

cw8a8_grouped_mm_args pack_grouped(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                                   const at::Tensor& scale_a, const at::Tensor& scale_b, const at::Tensor& offsets,
                                   const std::optional<at::Tensor>& bias) {
  cw8a8_grouped_mm_args args{};
  const int64_t t = a.size(0), k = a.size(1), e = b.size(0), n = b.size(2);
  args.a = a.data_ptr();
  args.b = b.data_ptr();
  args.d = out.data_ptr();
  args.scale_a = scale_a.data_ptr<float>();
  args.scale_b = scale_b.data_ptr<float>();
  args.bias = bias ? bias->data_ptr() : nullptr;
  args.offsets = offsets.data_ptr<int32_t>();
  args.t = t;
  args.n = n;
  args.k = k;
  args.num_experts = e;
  // A single-row operand may carry any stride(0); give the kernels a legal packed pitch instead.
  args.lda = t <= 1 ? (k + 15) / 16 * 16 : a.stride(0);
  args.ldb = b.stride(2);
  args.ldd = n;  // out is contiguous
  args.stride_b_e = e > 1 ? b.stride(0) : n * b.stride(2);
  args.scale_block = is_grouped_block_scaled(scale_b) ? 1 : 0;
  args.scale_a_per_token = !args.scale_block && scale_a.numel() != 1 ? 1 : 0;
  args.scale_b_per_channel = !args.scale_block && scale_b.dim() == 2 && scale_b.size(1) == n ? 1 : 0;
  args.ab_type = a.scalar_type() == at::kChar ? CW8A8_AB_INT8 : CW8A8_AB_FP8_E4M3;
  args.out_type = out.scalar_type() == at::kBFloat16 ? CW8A8_OUT_BF16 : CW8A8_OUT_F16;
  args.device = a.device().index();
  args.sm_count = device_info(args.device).sm_count;
  args.config = -1;
  args.pdl = 0;
  return args;
}

// config < 0: the dispatch's choice (the grouped decode GEMM at few rows, else the sm90 library's select_grouped);
// config >= 0 (_grouped_scaled_mm_config, tuning only): that entry of the sm90 library's grouped table, whatever T.
void launch_grouped(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                    const at::Tensor& scale_b, const at::Tensor& offsets, const std::optional<at::Tensor>& bias,
                    int64_t config = -1) {
  c10::cuda::CUDAGuard guard(a.device());
  const int device = a.device().index();
  const DeviceInfo& info = device_info(device);
  TORCH_CHECK_NOT_IMPLEMENTED(info.major == 9 && info.minor == 0,
                              "cutlass_w8a8.grouped_scaled_mm: needs compute capability 9.0 (sm90: the grouped "
                              "kernels use wgmma and TMA); device ", device, " is ", info.major, ".", info.minor);
  if (a.size(0) == 0) return;
  cw8a8_grouped_mm_args args = pack_grouped(out, a, b, scale_a, scale_b, offsets, bias);
  args.stream = current_stream(a);
  // Neither kernel's launch can be rewritten by an UpdatableGraph node update (T is in the shapes; the CUTLASS
  // path has a workspace): refuse to be recorded rather than leave a node behind.
  graph_nodes::refuse_launch(args.stream, kOp);
  if (config >= 0) {  // an index into the grouped table of the arguments (int8, fp8 or block-scaled fp8)
    const int count = sm90_grouped_num_configs(cw8a8_grouped_table_of(&args));
    TORCH_CHECK_VALUE(config < count, "_grouped_scaled_mm_config: `config` must be in [0, ", count, "), got ", config);
    args.config = static_cast<int>(config);
  } else if (args.t <= grouped_decode_max_rows() && args.k <= (int64_t{1} << 30)) {
    args.pdl = kernels_use_pdl(device) ? 1 : 0;
    launch_grouped_decode(args);
    return;
  }
  // The CUTLASS ptr-array kernels are launched without PDL (csrc/gemm/sm90/grouped/grouped_sm90.cuh says why).
  const cw8a8_grouped_mm_fn fn = sm90_grouped_mm_fn();
  GroupedWorkspace ws{a.device(), {}, {}};
  char err[512] = {0};
  const int rc = fn(&args, allocate_grouped_workspace, &ws, err, sizeof(err));
  TORCH_CHECK(rc == 0, "cutlass_w8a8.grouped_scaled_mm (T=", args.t, ", N=", args.n, ", K=", args.k, ", E=",
              args.num_experts, "): ", err, ws.error.empty() ? "" : ": ", ws.error);
}

}  // namespace

at::Tensor grouped_scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                             const at::Tensor& scale_b, const at::Tensor& offsets, at::ScalarType out_dtype,
                             const std::optional<at::Tensor>& bias) {
  check_grouped_scaled_mm(kOp, a, b, scale_a, scale_b, offsets, out_dtype, bias, /*out=*/nullptr);
  at::Tensor out = at::empty({a.size(0), b.size(2)}, a.options().dtype(out_dtype));
  launch_grouped(out, a, b, scale_a, scale_b, offsets, bias);
  return out;
}

void grouped_scaled_mm_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                           const at::Tensor& scale_b, const at::Tensor& offsets,
                           const std::optional<at::Tensor>& bias) {
  check_grouped_scaled_mm(kOp, a, b, scale_a, scale_b, offsets, out.scalar_type(), bias, &out);
  launch_grouped(out, a, b, scale_a, scale_b, offsets, bias);
}

void grouped_scaled_mm_config_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                                  const at::Tensor& scale_b, const at::Tensor& offsets,
                                  const std::optional<at::Tensor>& bias, int64_t config) {
  check_grouped_scaled_mm(kOp, a, b, scale_a, scale_b, offsets, out.scalar_type(), bias, &out);
  launch_grouped(out, a, b, scale_a, scale_b, offsets, bias, config);
}

int64_t grouped_decode_max_rows_op() { return grouped_decode_max_rows(); }

}  // namespace cutlass_w8a8
