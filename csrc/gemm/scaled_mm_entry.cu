// scaled_mm / scaled_mm_out / _scaled_mm_config: check and pack once (gemm/scaled_mm_args.hpp), send decode sizes to
// the decode GEMM (gemm/decode; the bound: core/launch_policy.hpp), else pick the kernel library by the device's GEMM
// backend (core/device.hpp, gemm/kernel_libraries.hpp), decide PDL
// (core/launch_policy.hpp), launch, and record the launch for CUDA-graph node updates (graphs/graph_nodes.hpp).
#include <optional>
#include <string>

#include <c10/cuda/CUDAGuard.h>

#include "core/checks.hpp"
#include "core/device.hpp"
#include "core/launch_policy.hpp"
#include "gemm/kernel_api.h"
#include "gemm/kernel_libraries.hpp"
#include "gemm/scaled_mm_args.hpp"
#include "graphs/graph_nodes.hpp"
#include "ops.hpp"

namespace cutlass_w8a8 {
namespace {

constexpr const char* kOp = "scaled_mm";

// Workspace from the torch caching allocator: stream-ordered, and taken from the graph's private pool
// while a CUDA graph is being captured.
struct TorchWorkspace {
  at::Device device;
  at::Tensor buffer;
  std::string error;
};

void* allocate_workspace(void* ctx, size_t bytes) {
  auto* ws = static_cast<TorchWorkspace*>(ctx);
  try {
    ws->buffer = at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).device(ws->device));
    return ws->buffer.data_ptr();
  } catch (const std::exception& e) {
    ws->error = e.what();
    return nullptr;
  }
}

// The CUTLASS 2.x epilogue reads scales and bias as 16-byte vectors: expand one-value scales to vectors and
// copy any vector whose address is not 16-byte aligned. The temporaries are stream-ordered allocations, so
// they stay valid for the kernel (and are taken from the graph's pool while capturing).
struct VectorOperands {
  at::Tensor scale_a, scale_b, bias;
};

at::Tensor aligned_vector(const at::Tensor& t, int64_t length) {
  at::Tensor v = t.numel() == 1 && length != 1 ? t.reshape({1}).expand({length}).contiguous() : t;
  return is_aligned(v.data_ptr(), 16) ? v : v.clone();
}

void run(cw8a8_scaled_mm_args& args, const at::Tensor& a, const KernelLibrary& kernels, bool sm90) {
  args.stream = current_stream(a);
  TorchWorkspace ws{a.device(), {}, {}};
  char err[512] = {0};
  int rc = kernels.scaled_mm(&args, allocate_workspace, &ws, err, sizeof(err));
  TORCH_CHECK(rc == 0, "cutlass_w8a8.scaled_mm (M=", args.m, ", N=", args.n, ", K=", args.k, "): ", err,
              ws.error.empty() ? "" : ": ", ws.error);
  // Only the sm90 library describes its launches for graph-node updates; a workspace (none of the shipped
  // configs has one) would be a second allocation the node update cannot redo.
  if (sm90) {
    graph_nodes::note_gemm_launch(args.stream, args, ws.buffer.defined());
  } else {
    graph_nodes::refuse_launch(args.stream, "scaled_mm on the CUTLASS 2.x (sm80 / sm89) kernels");
  }
}

}  // namespace

void launch_scaled_mm(cw8a8_scaled_mm_args& args, const at::Tensor& a, const at::Tensor& scale_a,
                      const at::Tensor& scale_b, const std::optional<at::Tensor>& bias, int64_t config) {
  if (args.m == 0) return;
  c10::cuda::CUDAGuard guard(a.device());
  const bool fp8 = args.ab_type == CW8A8_AB_FP8_E4M3;
  const GemmBackend backend = gemm_backend(args.device, fp8);
  // Only the sm90 library and the decode GEMM (on sm90) implement block scales. CUTLASS_W8A8_FORCE_ARCH=sm80 keeps
  // row-wise fp8 on the sm90 kernels (there is no Ampere fp8), but block mode is refused as on a non-sm90 device:
  // the switch is how Hopper machines test the other architectures' behaviour.
  if (args.scale_block) {
    const DeviceInfo& info = device_info(args.device);
    TORCH_CHECK_NOT_IMPLEMENTED(backend == GemmBackend::kSm90 && !force_sm80(), kOp,
                                ": block-scaled fp8 (scale_a [M, K/128], scale_b [ceil(N/128), K/128]) needs an sm90 "
                                "GPU; this device is sm_", info.major, info.minor,
                                force_sm80() ? " run as sm80 (CUTLASS_W8A8_FORCE_ARCH=sm80)" : "");
  }
  const KernelLibrary& kernels = scaled_mm_library(args.device, backend, fp8);
  const bool sm90 = backend == GemmBackend::kSm90;
  if (config < 0 && scaled_mm_uses_decode(backend, args.m, graph_nodes::recording())) {
    launch_scaled_mm_decode(args, a);
    return;
  }
  VectorOperands keep;
  if (!sm90) {
    if (scale_a.defined()) {  // undefined: args.scale_a is already a 16-byte aligned vector of M scales
      keep.scale_a = aligned_vector(scale_a, args.m);
      args.scale_a = keep.scale_a.data_ptr<float>();
    }
    keep.scale_b = aligned_vector(scale_b, args.n);
    args.scale_b = keep.scale_b.data_ptr<float>();
    args.scale_a_per_token = 1;
    args.scale_b_per_channel = 1;
    if (bias) {
      keep.bias = aligned_vector(*bias, args.n);
      args.bias = keep.bias.data_ptr();
    }
  }
  if (config >= 0) {  // an index into the table of the arguments (int8, fp8 or block-scaled fp8)
    const int count = kernels.num_configs(cw8a8_config_table_of(&args));
    TORCH_CHECK_VALUE(config < count, "_scaled_mm_config: `config` must be in [0, ", count, "), got ", config);
  }
  args.config = static_cast<int>(config);
  args.pdl = gemm_uses_pdl(backend, args.m, graph_nodes::recording()) ? 1 : 0;
  run(args, a, kernels, sm90);
}

void scaled_mm_config_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                          const at::Tensor& scale_b, const std::optional<at::Tensor>& bias, int64_t config) {
  cw8a8_scaled_mm_args args = check_and_pack_scaled_mm(kOp, out, a, b, scale_a, scale_b, bias);
  launch_scaled_mm(args, a, scale_a, scale_b, bias, config);
}

void scaled_mm_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                   const at::Tensor& scale_b, const std::optional<at::Tensor>& bias, bool fp8_fast_accum) {
  cw8a8_scaled_mm_args args = check_and_pack_scaled_mm(kOp, out, a, b, scale_a, scale_b, bias);
  args.fp8_fast_accum = fp8_fast_accum ? 1 : 0;
  launch_scaled_mm(args, a, scale_a, scale_b, bias);
}

at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                     const at::Tensor& scale_b, at::ScalarType out_dtype, const std::optional<at::Tensor>& bias,
                     bool fp8_fast_accum) {
  check_scaled_mm(kOp, a, b, scale_a, scale_b, out_dtype, bias, /*out=*/nullptr);
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options().dtype(out_dtype));
  cw8a8_scaled_mm_args args = pack_scaled_mm(out, a, b, scale_a, scale_b, bias);
  args.fp8_fast_accum = fp8_fast_accum ? 1 : 0;
  launch_scaled_mm(args, a, scale_a, scale_b, bias);
  return out;
}

}  // namespace cutlass_w8a8
