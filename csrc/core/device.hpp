// What a CUDA device is and which GEMM code serves it: the one architecture ladder of the extension.
//
// Every answer is read once per device and cached (host-side attribute queries: no stream work, so legal during
// CUDA-graph capture, and no driver query on the hot path).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

namespace cutlass_w8a8 {

// `at::cuda::getCurrentCUDAStream` is this same function re-exported by ATen/cuda/CUDAContext.h; we include
// the c10 header directly because CUDAContext.h drags in the cuBLAS/cuSPARSE headers.
inline cudaStream_t current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

// Compute capability, multiprocessor count and L2 size of a device, read once per device and cached. Raises for
// a device index outside [0, 64).
struct DeviceInfo {
  int major = 0;
  int minor = 0;
  int sm_count = 0;
  int l2_bytes = 0;
};
const DeviceInfo& device_info(int device);

// The GEMM code family a device runs for an operand type (int8, or float8_e4m3fn with fp8 = true):
//   kSm90  compute capability 9.0 (wgmma, TMA, clusters: the sm90 library); int8 goes to kSm80 instead when
//          CUTLASS_W8A8_FORCE_ARCH=sm80 was set at the first query (tests the Ampere path on Hopper);
//   kSm89  fp8 on 8.9 or newer (fp8 mma.sync; the scaled_mm library of this family holds sm_89 code only, see
//          gemm/kernel_libraries.cpp, while the decode GEMM, compiled into _C, runs on any of these);
//   kSm80  int8 on 8.0 or newer (int8 mma.sync; compute_80 PTX runs on any later device);
//   kNone  nothing: int8 below 8.0, fp8 below 8.9.
// Used by scaled_mm (which library), the decode GEMMs (whether they run) and supports_fp8.
enum class GemmBackend { kNone, kSm80, kSm89, kSm90 };
GemmBackend gemm_backend(int device, bool fp8);
// Whether CUTLASS_W8A8_FORCE_ARCH=sm80 is in effect (for messages that explain a kNone).
bool force_sm80();

// Whether this device runs the thread-block-cluster kernels of _C: they were built for it (the sm90 device code,
// with its cluster shape, is what got loaded) and it has clusters. Read once per device from a probe kernel
// compiled with the same flags as the cluster kernels.
bool clusters_available(int device);

// supports_fp8(device): gemm/kernel_libraries.hpp (it also needs the fp8 kernel library to be loaded).

}  // namespace cutlass_w8a8
