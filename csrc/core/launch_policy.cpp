// Programmatic dependent launch: the one switch and the rules that use it (core/launch_policy.hpp).
#include "core/launch_policy.hpp"

#include <atomic>
#include <cstdlib>
#include <string>

namespace cutlass_w8a8 {
namespace {

// -1: not read from the environment yet; 0 off; 1 on.
std::atomic<int> g_pdl{-1};

}  // namespace

bool pdl_enabled() {
  int v = g_pdl.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* env = std::getenv("CUTLASS_W8A8_PDL");
    const int from_env = (env == nullptr || std::string(env) != "0") ? 1 : 0;
    g_pdl.compare_exchange_strong(v, from_env, std::memory_order_relaxed);
    v = g_pdl.load(std::memory_order_relaxed);
  }
  return v != 0;
}

bool set_pdl(bool enabled) {
  const bool previous = pdl_enabled();
  g_pdl.store(enabled ? 1 : 0, std::memory_order_relaxed);
  return previous;
}

bool gemm_uses_pdl(GemmBackend backend, int64_t m, bool recording) {
  return backend == GemmBackend::kSm90 && pdl_enabled() && (m <= kPdlMaxM || recording);
}

bool decode_uses_pdl(int device) {
  const DeviceInfo& info = device_info(device);
  return info.major * 10 + info.minor >= 90 && pdl_enabled();
}

}  // namespace cutlass_w8a8
