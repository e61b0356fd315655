// The per-architecture kernel libraries (gemm/kernel_api.h), found and opened once: which library serves a
// device, and whether fp8 GEMMs can run on it.
#pragma once

#include <string>

#include "core/device.hpp"
#include "gemm/kernel_api.h"

namespace cutlass_w8a8 {

// One opened library's entry points. `error` says why the library or an entry point is missing (then the
// pointers are null).
struct KernelLibrary {
  cw8a8_scaled_mm_fn scaled_mm = nullptr;
  cw8a8_num_configs_fn num_configs = nullptr;
  cw8a8_scaled_mm_node_fn node = nullptr;  // sm90 only: launch descriptions for CUDA-graph node updates
  cw8a8_grouped_mm_fn grouped_mm = nullptr;  // sm90 only: the MoE grouped GEMM (null in a library built before it)
  cw8a8_num_configs_fn grouped_num_configs = nullptr;  // sm90 only: its tables' sizes (tuning builds add candidates)
  std::string library;                     // the file
  std::string error;
};

// The library that runs scaled_mm for `backend` = gemm_backend(device, fp8). Raises NotImplementedError when the
// device has no kernels for the operand type ("cutlass_w8a8.scaled_mm: int8 needs compute capability 8.0 or
// newer; device 0 is 7.5"), RuntimeError when the library was not built or failed to load.
const KernelLibrary& scaled_mm_library(int device, GemmBackend backend, bool fp8);

// The sm90 library's node entry (CUDA-graph kernel-node updates); raises when the library or the entry is missing.
cw8a8_scaled_mm_node_fn sm90_scaled_mm_node_fn();

// The sm90 library's grouped GEMM entry (cw8a8_sm90_grouped_mm, grouped_scaled_mm); raises when the library or the
// entry is missing.
cw8a8_grouped_mm_fn sm90_grouped_mm_fn();

// Entries of the sm90 grouped GEMM's table `table` (a cw8a8_config_table; cw8a8_sm90_grouped_num_configs): the shipped
// configs, then any tuning candidates built in. Raises when the library or the entry is missing.
int sm90_grouped_num_configs(int table);

// Whether float8_e4m3fn scaled_mm runs on `device`: the fp8 backend exists there (9.0: sm90, 8.9: sm89) and its
// library loaded. Never raises for a valid device.
bool supports_fp8(int device);

}  // namespace cutlass_w8a8
