// The per-architecture kernel libraries: opened once, RTLD_LOCAL, from this library's own directory.
//
// They export C entry points (gemm/kernel_api.h). We look the entry points up in our own handle only: loaded into
// the global scope, a library's copies of C++ template symbols (libstdc++'s among them) would interpose on other
// libraries' and break them (seen: ostream << long crashing inside _C.so).
#include "gemm/kernel_libraries.hpp"

#include <dlfcn.h>

#include <c10/util/Exception.h>

namespace cutlass_w8a8 {
namespace {

std::string own_directory() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&own_directory), &info) == 0 || info.dli_fname == nullptr) return ".";
  std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

KernelLibrary open_library(const char* name, const char* scaled_mm_symbol, const char* num_configs_symbol,
                           const char* node_symbol) {
  KernelLibrary k;
  k.library = own_directory() + "/" + name + ".so";
  void* handle = dlopen(k.library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* e = dlerror();
    k.error = e ? e : "dlopen failed";
    return k;
  }
  k.scaled_mm = reinterpret_cast<cw8a8_scaled_mm_fn>(dlsym(handle, scaled_mm_symbol));
  k.num_configs = reinterpret_cast<cw8a8_num_configs_fn>(dlsym(handle, num_configs_symbol));
  if (k.scaled_mm == nullptr || k.num_configs == nullptr) {
    k.error = std::string("missing ") + scaled_mm_symbol;
    return k;
  }
  if (node_symbol != nullptr) k.node = reinterpret_cast<cw8a8_scaled_mm_node_fn>(dlsym(handle, node_symbol));
  // Optional (only the sm90 library exports it, and one built before it does not): the MoE grouped GEMM.
  k.grouped_mm = reinterpret_cast<cw8a8_grouped_mm_fn>(dlsym(handle, "cw8a8_sm90_grouped_mm"));
  k.grouped_num_configs = reinterpret_cast<cw8a8_num_configs_fn>(dlsym(handle, "cw8a8_sm90_grouped_num_configs"));
  return k;
}

const KernelLibrary& sm90_library() {
  static const KernelLibrary k =
      open_library("_kernels_sm90", "cw8a8_sm90_scaled_mm", "cw8a8_sm90_num_configs", "cw8a8_sm90_scaled_mm_node");
  return k;
}
const KernelLibrary& sm80_library() {
  static const KernelLibrary k =
      open_library("_kernels_sm80", "cw8a8_sm80_scaled_mm", "cw8a8_sm80_num_configs", nullptr);
  return k;
}
// Built for sm_89 only (setup.py: -gencode=arch=compute_89,code=sm_89): of the kSm89 devices it serves 8.9.
const KernelLibrary& sm89_library() {
  static const KernelLibrary k =
      open_library("_kernels_sm89", "cw8a8_sm89_scaled_mm", "cw8a8_sm89_num_configs", nullptr);
  return k;
}

bool sm89_library_runs_on(int device) {
  const DeviceInfo& info = device_info(device);
  return info.major == 8 && info.minor == 9;
}

const KernelLibrary& require(const KernelLibrary& k, const char* what, const char* arch_list) {
  TORCH_CHECK(k.error.empty(), "cutlass_w8a8: the ", what, " kernels are not available: the package was built "
              "without them (TORCH_CUDA_ARCH_LIST must contain ", arch_list, ") or ", k.library,
              " failed to load: ", k.error);
  return k;
}

}  // namespace

const KernelLibrary& scaled_mm_library(int device, GemmBackend backend, bool fp8) {
  if (backend == GemmBackend::kSm90) return require(sm90_library(), "sm90", "9.0a");
  const DeviceInfo& info = device_info(device);
  if (!fp8) {
    TORCH_CHECK_NOT_IMPLEMENTED(backend == GemmBackend::kSm80, "cutlass_w8a8.scaled_mm: int8 needs compute "
                                "capability 8.0 or newer; device ", device, " is ", info.major, ".", info.minor);
    return require(sm80_library(), "sm80 (int8)", "8.0, 8.6, 8.9 or 9.0a");
  }
  TORCH_CHECK_NOT_IMPLEMENTED(backend == GemmBackend::kSm89 && sm89_library_runs_on(device),
                              "cutlass_w8a8.scaled_mm: float8_e4m3fn needs compute capability 8.9 or 9.0; device ",
                              device, " is ", info.major, ".", info.minor,
                              force_sm80() ? " (CUTLASS_W8A8_FORCE_ARCH=sm80 has no fp8 kernels)" : "");
  return require(sm89_library(), "sm89 (fp8)", "8.9");
}

cw8a8_scaled_mm_node_fn sm90_scaled_mm_node_fn() {
  const KernelLibrary& k = require(sm90_library(), "sm90", "9.0a");
  TORCH_CHECK(k.node != nullptr, "cutlass_w8a8: ", k.library, " has no cw8a8_sm90_scaled_mm_node (rebuild it)");
  return k.node;
}

cw8a8_grouped_mm_fn sm90_grouped_mm_fn() {
  const KernelLibrary& k = require(sm90_library(), "sm90", "9.0a");
  TORCH_CHECK(k.grouped_mm != nullptr, "cutlass_w8a8: ", k.library, " has no cw8a8_sm90_grouped_mm (rebuild it)");
  return k.grouped_mm;
}

int sm90_grouped_num_configs(int table) {
  const KernelLibrary& k = require(sm90_library(), "sm90", "9.0a");
  TORCH_CHECK(k.grouped_num_configs != nullptr, "cutlass_w8a8: ", k.library,
              " has no cw8a8_sm90_grouped_num_configs (rebuild it)");
  return k.grouped_num_configs(table);
}

bool supports_fp8(int device) {
  switch (gemm_backend(device, /*fp8=*/true)) {
    case GemmBackend::kSm90: return sm90_library().error.empty();
    case GemmBackend::kSm89: return sm89_library_runs_on(device) && sm89_library().error.empty();
    default: return false;
  }
}

}  // namespace cutlass_w8a8
