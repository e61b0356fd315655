// Programmatic dependent launch and the decode-GEMM bound: the switches and the rules that use them
// (core/launch_policy.hpp).
#include "core/launch_policy.hpp"
#include "core/limits.hpp"

#include <atomic>
#include <cstdlib>
#include <string>

#include <c10/util/Exception.h>

namespace cutlass_w8a8 {
namespace {

// -1: not read from the environment yet; 0 off; 1 on.
std::atomic<int> g_pdl{-1};
std::atomic<int64_t> g_decode_max_m{kDecodeGemmMaxM};

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

bool kernels_use_pdl(int device) {
  const DeviceInfo& info = device_info(device);
  return info.major * 10 + info.minor >= 90 && pdl_enabled();
}

int64_t decode_gemm_max_m() { return g_decode_max_m.load(std::memory_order_relaxed); }

int64_t set_decode_gemm_max_m(int64_t m) {
  TORCH_CHECK_VALUE(m >= 0 && m <= limits::kDecodeMaxM, "cutlass_w8a8._set_decode_gemm_max_m: `m` must be in [0, ",
                    limits::kDecodeMaxM, "] (the decode GEMM serves M <= ", limits::kDecodeMaxM,
                    "; 0 turns it off), got ", m);
  return g_decode_max_m.exchange(m, std::memory_order_relaxed);
}

bool scaled_mm_uses_decode(GemmBackend backend, int64_t m, bool recording) {
  return backend == GemmBackend::kSm90 && !recording && m <= decode_gemm_max_m();
}

}  // namespace cutlass_w8a8
