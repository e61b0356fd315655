// Shared helpers of the torch extension: argument checks, the current stream, device properties.
#pragma once

#include <cstdint>
#include <string>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

namespace cutlass_w8a8 {

// `at::cuda::getCurrentCUDAStream` is this same function re-exported by ATen/cuda/CUDAContext.h; we include
// the c10 header directly because CUDAContext.h drags in the cuBLAS/cuSPARSE headers.
inline cudaStream_t current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

// Compute capability and multiprocessor count of a device, read once per device and cached. These are
// host-side attribute queries: no stream work, so they are legal during CUDA-graph capture.
struct DeviceInfo {
  int major = 0;
  int minor = 0;
  int sm_count = 0;
};
const DeviceInfo& device_info(int device);

// Checks that name the argument: "scaled_mm: `scale_a` must be float32, got Half". TYPE raises TypeError in
// Python (wrong dtype), VALUE raises ValueError (wrong shape, layout, device or value).
#define CW8A8_CHECK_TYPE(cond, op, arg, ...) TORCH_CHECK_TYPE(cond, op, ": `", arg, "` ", __VA_ARGS__)
#define CW8A8_CHECK_VALUE(cond, op, arg, ...) TORCH_CHECK_VALUE(cond, op, ": `", arg, "` ", __VA_ARGS__)

// int8 products are at most 128 * 128 = 2^14 in magnitude, so an int32 sum of K of them cannot overflow while
// K * 2^14 <= 2^31 - 1, i.e. K <= 131071; the largest multiple of 16 below that is 131056 (ops.INT8_MAX_K).
constexpr int64_t kMaxInt8K = (int64_t{2147483647} / (128 * 128)) / 16 * 16;

// How Python prints a dtype ("torch.bfloat16") and a shape or strides ("(4, 64)", "(64,)"): for messages that
// must read the same from the C++ op and from the CPU / fake implementations in ops.py.
std::string py_dtype(at::ScalarType t);
std::string py_tuple(at::IntArrayRef v);

inline bool is_aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

}  // namespace cutlass_w8a8
