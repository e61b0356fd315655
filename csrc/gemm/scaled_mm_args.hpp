// The scaled_mm launch path shared by the ops that run a W8A8 GEMM (scaled_mm_entry.cu defines it):
// scaled_mm / scaled_mm_out, w8a8_linear (linear.cu) and the CUDA-graph node updates (graph_nodes.cu).
#pragma once

#include <optional>

#include <ATen/ATen.h>

#include "gemm/kernel_api.h"

namespace cutlass_w8a8 {

// Checks every scaled_mm argument (errors name scaled_mm's arguments) and fills the argument block, sm_count
// included; stream and config are left for the launch.
cw8a8_scaled_mm_args pack_scaled_mm_args(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                                         const at::Tensor& scale_a, const at::Tensor& scale_b,
                                         const std::optional<at::Tensor>& bias);

// Runs a packed argument block whose operands are already checked: picks the kernel library for the device
// (and the Ampere/Ada vector-scale form), decides PDL, launches on the current stream of `a`'s device and
// records the launch for CUDA-graph node updates. `config` < 0 lets the library choose by shape. `scale_a` may be
// an undefined tensor when args.scale_a points to M per-token scales at a 16-byte aligned address.
void launch_scaled_mm(cw8a8_scaled_mm_args& args, const at::Tensor& a, const at::Tensor& scale_a,
                      const at::Tensor& scale_b, const std::optional<at::Tensor>& bias, int64_t config = -1);

// The sm90 library's node entry (CUDA-graph kernel-node updates); raises when the library is missing.
cw8a8_scaled_mm_node_fn sm90_scaled_mm_node_fn();

}  // namespace cutlass_w8a8
