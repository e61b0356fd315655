// Device properties and the architecture ladder (core/device.hpp).
#include "core/device.hpp"

#include <array>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

#include <c10/cuda/CUDAException.h>

namespace cutlass_w8a8 {
namespace {

constexpr int kMaxDevices = 64;

// The cluster probe: compiled with cluster dimensions only in device passes for sm90 or newer, exactly as the
// cluster kernels of quant/ are, so its attributes say what those kernels got on this device.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define CW8A8_PROBE_CLUSTER_DIMS __cluster_dims__(1, 8, 1)
#else
#define CW8A8_PROBE_CLUSTER_DIMS
#endif
__global__ void CW8A8_PROBE_CLUSTER_DIMS cluster_probe_kernel() {}
#undef CW8A8_PROBE_CLUSTER_DIMS

}  // namespace

// CUTLASS_W8A8_FORCE_ARCH=sm80 sends int8 work on a Hopper GPU to the Ampere kernels (for testing that path
// where only Hopper machines are at hand); read once per process.
bool force_sm80() {
  static const bool forced = [] {
    const char* v = std::getenv("CUTLASS_W8A8_FORCE_ARCH");
    return v != nullptr && std::string(v) == "sm80";
  }();
  return forced;
}

const DeviceInfo& device_info(int device) {
  static std::array<DeviceInfo, kMaxDevices> cache{};
  static std::array<std::once_flag, kMaxDevices> once;
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "cutlass_w8a8: device index ", device, " out of range");
  std::call_once(once[device], [device] {
    DeviceInfo& d = cache[device];
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.minor, cudaDevAttrComputeCapabilityMinor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.sm_count, cudaDevAttrMultiProcessorCount, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.l2_bytes, cudaDevAttrL2CacheSize, device));
  });
  return cache[device];
}

GemmBackend gemm_backend(int device, bool fp8) {
  const DeviceInfo& info = device_info(device);
  const int cc = info.major * 10 + info.minor;
  if (cc == 90 && (fp8 || !force_sm80())) return GemmBackend::kSm90;
  if (fp8) return cc >= 89 ? GemmBackend::kSm89 : GemmBackend::kNone;
  return cc >= 80 ? GemmBackend::kSm80 : GemmBackend::kNone;
}

bool clusters_available(int device) {
  static std::atomic<int> cached[kMaxDevices] = {};  // 0: not read yet, 1: no, 2: yes
  if (device < 0 || device >= kMaxDevices) return false;
  int v = cached[device].load(std::memory_order_relaxed);
  if (v == 0) {
    cudaFuncAttributes attr{};
    const cudaError_t err = cudaFuncGetAttributes(&attr, cluster_probe_kernel);
    if (err != cudaSuccess) cudaGetLastError();  // a failed query means "no", not an error of the next launch
    v = (err == cudaSuccess && attr.requiredClusterHeight == 8) ? 2 : 1;
    cached[device].store(v, std::memory_order_relaxed);
  }
  return v == 2;
}

}  // namespace cutlass_w8a8
