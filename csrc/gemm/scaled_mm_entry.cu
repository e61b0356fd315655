// scaled_mm: argument checks and dispatch by compute capability to the per-architecture kernel library.
#include <dlfcn.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>

#include "core/common.hpp"
#include "gemm/scaled_mm_args.hpp"
#include "graphs/graph_nodes.hpp"
#include "gemm/kernel_api.h"
#include "ops.hpp"

namespace cutlass_w8a8 {
namespace {

constexpr const char* kOp = "scaled_mm";

// The per-architecture kernel libraries export C entry points (kernel_api.h). We dlopen them RTLD_LOCAL
// from this library's own directory and look the entry points up in that handle only: loaded into the
// global scope, a library's copies of C++ template symbols (libstdc++'s among them) would interpose on
// other libraries' and break them (seen: ostream << long crashing inside _C.so).
std::string own_directory() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&own_directory), &info) == 0 || info.dli_fname == nullptr) return ".";
  std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

struct ArchKernels {
  cw8a8_scaled_mm_fn scaled_mm = nullptr;
  cw8a8_num_configs_fn num_configs = nullptr;
  cw8a8_scaled_mm_node_fn node = nullptr;  // sm90 only: launch descriptions for CUDA-graph node updates
  std::string library;
  std::string error;  // why the library or its entry points are missing
};

ArchKernels load_kernels(const char* name, const char* scaled_mm_symbol, const char* num_configs_symbol) {
  ArchKernels k;
  k.library = own_directory() + "/" + name + ".so";
  void* handle = dlopen(k.library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* e = dlerror();
    k.error = e ? e : "dlopen failed";
    return k;
  }
  k.scaled_mm = reinterpret_cast<cw8a8_scaled_mm_fn>(dlsym(handle, scaled_mm_symbol));
  k.num_configs = reinterpret_cast<cw8a8_num_configs_fn>(dlsym(handle, num_configs_symbol));
  if (k.scaled_mm == nullptr || k.num_configs == nullptr) k.error = std::string("missing ") + scaled_mm_symbol;
  return k;
}

const ArchKernels& sm90_kernels() {
  static const ArchKernels k = [] {
    ArchKernels lib = load_kernels("_kernels_sm90", "cw8a8_sm90_scaled_mm", "cw8a8_sm90_num_configs");
    if (lib.error.empty()) {
      void* handle = dlopen(lib.library.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
      if (handle != nullptr) {
        lib.node = reinterpret_cast<cw8a8_scaled_mm_node_fn>(dlsym(handle, "cw8a8_sm90_scaled_mm_node"));
        dlclose(handle);  // drops the NOLOAD reference only; load_kernels' handle keeps the library loaded
      }
    }
    return lib;
  }();
  return k;
}
const ArchKernels& sm80_kernels() {
  static const ArchKernels k = load_kernels("_kernels_sm80", "cw8a8_sm80_scaled_mm", "cw8a8_sm80_num_configs");
  return k;
}
const ArchKernels& sm89_kernels() {
  static const ArchKernels k = load_kernels("_kernels_sm89", "cw8a8_sm89_scaled_mm", "cw8a8_sm89_num_configs");
  return k;
}

// CUTLASS_W8A8_FORCE_ARCH=sm80 sends int8 work on a Hopper GPU to the Ampere kernels (for testing that path
// where only Hopper machines are at hand); read once per process.
bool force_sm80() {
  static const bool forced = [] {
    const char* v = std::getenv("CUTLASS_W8A8_FORCE_ARCH");
    return v != nullptr && std::string(v) == "sm80";
  }();
  return forced;
}

// Programmatic dependent launch (PDL) for the sm90 GEMMs: with it a GEMM's CTAs start their prologue while
// the previous kernel on the stream finishes (the quantization kernels signal early), and wait on
// griddepcontrol before reading A, B or the scales. On unless CUTLASS_W8A8_PDL=0 at the first call;
// cw8a8_set_pdl (cutlass_w8a8.set_pdl) changes it for later launches. -1: not read yet.
std::atomic<int> g_pdl{-1};
constexpr int64_t kPdlMaxM = 16;  // PDL launches only for M (tokens) up to this; see scaled_mm_config_out

bool pdl_enabled() {
  int v = g_pdl.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* env = std::getenv("CUTLASS_W8A8_PDL");
    int from_env = (env == nullptr || std::string(env) != "0") ? 1 : 0;
    g_pdl.compare_exchange_strong(v, from_env, std::memory_order_relaxed);
    v = g_pdl.load(std::memory_order_relaxed);
  }
  return v != 0;
}

const ArchKernels& require(const ArchKernels& k, const char* what, const char* arch_list) {
  TORCH_CHECK(k.error.empty(), "cutlass_w8a8: the ", what, " kernels are not available: the package was built "
              "without them (TORCH_CUDA_ARCH_LIST must contain ", arch_list, ") or ", k.library,
              " failed to load: ", k.error);
  return k;
}

// Which kernel family serves this device and operand type. `vector_scales` is set for the CUTLASS 2.x
// kernels, whose broadcast visitors need per-row / per-column vectors.
const ArchKernels& kernels_for(int device, int ab_type, bool* vector_scales) {
  const DeviceInfo& info = device_info(device);
  const int cc = info.major * 10 + info.minor;
  *vector_scales = false;
  if (cc == 90 && !(force_sm80() && ab_type == CW8A8_AB_INT8)) return require(sm90_kernels(), "sm90", "9.0a");
  *vector_scales = true;
  if (ab_type == CW8A8_AB_INT8) {
    // compute_80 PTX runs on any later device, so every cc >= 8.0 has an int8 path.
    TORCH_CHECK_NOT_IMPLEMENTED(cc >= 80, "cutlass_w8a8.scaled_mm: int8 needs compute capability 8.0 or newer; "
                                "device ", device, " is ", info.major, ".", info.minor);
    return require(sm80_kernels(), "sm80 (int8)", "8.0, 8.6, 8.9 or 9.0a");
  }
  TORCH_CHECK_NOT_IMPLEMENTED(cc == 89, "cutlass_w8a8.scaled_mm: float8_e4m3fn needs compute capability 8.9 or "
                              "9.0; device ", device, " is ", info.major, ".", info.minor,
                              force_sm80() ? " (CUTLASS_W8A8_FORCE_ARCH=sm80 has no fp8 kernels)" : "");
  return require(sm89_kernels(), "sm89 (fp8)", "8.9");
}

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

const char* dtype_name(at::ScalarType t) { return c10::toString(t); }

bool is_8bit(at::ScalarType t) { return t == at::kChar || t == at::kFloat8_e4m3fn; }
bool is_out_type(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

void check_device(const at::Tensor& t, const char* name, const at::Tensor& a) {
  CW8A8_CHECK_VALUE(t.is_cuda(), kOp, name, "must be a CUDA tensor, got device ", t.device());
  CW8A8_CHECK_VALUE(t.device() == a.device(), kOp, name, "is on ", t.device(), " but `a` is on ", a.device());
}

// Validates everything the kernels rely on and fills the argument block (all but stream/config).
cw8a8_scaled_mm_args check_and_pack(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                                    const at::Tensor& scale_a, const at::Tensor& scale_b,
                                    const std::optional<at::Tensor>& bias) {
  // dtypes
  CW8A8_CHECK_TYPE(is_8bit(a.scalar_type()), kOp, "a", "must be int8 or float8_e4m3fn, got ",
                   dtype_name(a.scalar_type()));
  CW8A8_CHECK_TYPE(b.scalar_type() == a.scalar_type(), kOp, "b", "must have a's dtype ",
                   dtype_name(a.scalar_type()), ", got ", dtype_name(b.scalar_type()));
  CW8A8_CHECK_TYPE(scale_a.scalar_type() == at::kFloat, kOp, "scale_a", "must be float32, got ",
                   dtype_name(scale_a.scalar_type()));
  CW8A8_CHECK_TYPE(scale_b.scalar_type() == at::kFloat, kOp, "scale_b", "must be float32, got ",
                   dtype_name(scale_b.scalar_type()));
  CW8A8_CHECK_TYPE(is_out_type(out.scalar_type()), kOp, "out", "must be bfloat16 or float16, got ",
                   dtype_name(out.scalar_type()));
  if (bias) {
    CW8A8_CHECK_TYPE(bias->scalar_type() == out.scalar_type(), kOp, "bias", "must have the output dtype ",
                     dtype_name(out.scalar_type()), ", got ", dtype_name(bias->scalar_type()));
  }
  // devices
  CW8A8_CHECK_VALUE(a.is_cuda(), kOp, "a", "must be a CUDA tensor, got device ", a.device());
  check_device(b, "b", a);
  check_device(scale_a, "scale_a", a);
  check_device(scale_b, "scale_b", a);
  check_device(out, "out", a);
  if (bias) check_device(*bias, "bias", a);

  // shapes
  CW8A8_CHECK_VALUE(a.dim() == 2, kOp, "a", "must be 2-D [M, K], got ", a.sizes());
  CW8A8_CHECK_VALUE(b.dim() == 2, kOp, "b", "must be 2-D [K, N], got ", b.sizes());
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  CW8A8_CHECK_VALUE(b.size(0) == k, kOp, "b", "must be [K, N] with K = a.shape[1] = ", k, ", got ", b.sizes());
  CW8A8_CHECK_VALUE(m < (int64_t{1} << 31), kOp, "a", "M = a.shape[0] must be below 2**31, got ", m);
  CW8A8_CHECK_VALUE(k > 0 && k % 16 == 0, kOp, "a", "K = a.shape[1] must be a positive multiple of 16, got ", k);
  CW8A8_CHECK_VALUE(n > 0 && n % 16 == 0, kOp, "b", "N = b.shape[1] must be a positive multiple of 16, got ", n);
  if (a.scalar_type() == at::kChar) {
    CW8A8_CHECK_VALUE(k <= kMaxInt8K, kOp, "a", "K = ", k, " can overflow the int32 accumulator; int8 needs K <= ",
                      kMaxInt8K);
  }
  CW8A8_CHECK_VALUE(out.dim() == 2 && out.size(0) == m && out.size(1) == n, kOp, "out", "must be [M, N] = [", m,
                    ", ", n, "], got ", out.sizes());
  const int64_t sa_numel = scale_a.numel();
  const bool per_token = !(sa_numel == 1);
  CW8A8_CHECK_VALUE(sa_numel == 1 || (scale_a.dim() == 2 && scale_a.size(0) == m && scale_a.size(1) == 1) ||
                        (scale_a.dim() == 1 && scale_a.size(0) == m),
                    kOp, "scale_a", "must be [1] (per-tensor) or [M, 1] (per-token) with M = ", m, ", got ",
                    scale_a.sizes());
  const int64_t sb_numel = scale_b.numel();
  const bool per_channel = !(sb_numel == 1);
  CW8A8_CHECK_VALUE(sb_numel == 1 || (scale_b.dim() == 1 && scale_b.size(0) == n) ||
                        (scale_b.dim() == 2 && sb_numel == n && (scale_b.size(0) == 1 || scale_b.size(1) == 1)),
                    kOp, "scale_b", "must be [1] (per-tensor), [N], [1, N] or [N, 1] (per-channel) with N = ", n,
                    ", got ", scale_b.sizes());
  CW8A8_CHECK_VALUE(scale_a.is_contiguous(), kOp, "scale_a", "must be contiguous");
  CW8A8_CHECK_VALUE(scale_b.is_contiguous(), kOp, "scale_b", "must be contiguous");
  if (bias) {
    CW8A8_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n, kOp, "bias", "must be [N] with N = ", n, ", got ",
                      bias->sizes());
    CW8A8_CHECK_VALUE(bias->is_contiguous(), kOp, "bias", "must be contiguous");
  }

  // layouts: the kernels read A and B through TMA, which needs 16-byte aligned bases and row pitches.
  // Rows may be padded (a slice of a wider buffer): the leading stride is passed through, never assumed.
  const int64_t lda = a.stride(0), ldb = b.stride(1), ldd = out.stride(0);
  CW8A8_CHECK_VALUE(a.stride(1) == 1, kOp, "a", "must be row-major (stride(1) == 1), got strides ", a.strides());
  CW8A8_CHECK_VALUE(m <= 1 || lda >= k, kOp, "a", "rows overlap: stride(0) = ", lda, " < K = ", k);
  CW8A8_CHECK_VALUE(lda % 16 == 0 || m <= 1, kOp, "a", "stride(0) must be a multiple of 16 elements, got ", lda);
  CW8A8_CHECK_VALUE(b.stride(0) == 1, kOp, "b",
                    "must be column-major [K, N] (the transpose of a row-major [N, K] weight, stride(0) == 1), "
                    "got strides ", b.strides());
  CW8A8_CHECK_VALUE(ldb >= k, kOp, "b", "columns overlap: stride(1) = ", ldb, " < K = ", k);
  CW8A8_CHECK_VALUE(ldb % 16 == 0, kOp, "b", "stride(1) must be a multiple of 16 elements, got ", ldb);
  CW8A8_CHECK_VALUE(out.stride(1) == 1, kOp, "out", "must be row-major (stride(1) == 1), got strides ",
                    out.strides());
  CW8A8_CHECK_VALUE(m <= 1 || ldd >= n, kOp, "out", "rows overlap: stride(0) = ", ldd, " < N = ", n);
  CW8A8_CHECK_VALUE(ldd % 8 == 0 || m <= 1, kOp, "out", "stride(0) must be a multiple of 8 elements, got ", ldd);
  CW8A8_CHECK_VALUE(is_aligned(a.data_ptr(), 16), kOp, "a", "data must be 16-byte aligned (storage offset ",
                    a.storage_offset(), ")");
  CW8A8_CHECK_VALUE(is_aligned(b.data_ptr(), 16), kOp, "b", "data must be 16-byte aligned (storage offset ",
                    b.storage_offset(), ")");
  CW8A8_CHECK_VALUE(is_aligned(out.data_ptr(), 16), kOp, "out", "data must be 16-byte aligned (storage offset ",
                    out.storage_offset(), ")");

  cw8a8_scaled_mm_args args{};
  args.a = a.data_ptr();
  args.b = b.data_ptr();
  args.d = out.data_ptr();
  args.scale_a = scale_a.data_ptr<float>();
  args.scale_b = scale_b.data_ptr<float>();
  args.bias = bias ? bias->data_ptr() : nullptr;
  args.m = m;
  args.n = n;
  args.k = k;
  // A single-row operand may carry any stride(0); give the kernel a legal packed pitch instead.
  args.lda = m <= 1 ? (k + 15) / 16 * 16 : lda;
  args.ldb = ldb;
  args.ldd = m <= 1 ? (n + 7) / 8 * 8 : ldd;
  args.scale_a_per_token = per_token ? 1 : 0;
  args.scale_b_per_channel = per_channel ? 1 : 0;
  args.ab_type = a.scalar_type() == at::kChar ? CW8A8_AB_INT8 : CW8A8_AB_FP8_E4M3;
  args.out_type = out.scalar_type() == at::kBFloat16 ? CW8A8_OUT_BF16 : CW8A8_OUT_F16;
  args.device = a.device().index();
  args.config = -1;
  return args;
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

void run(cw8a8_scaled_mm_args& args, const at::Tensor& a, const ArchKernels& kernels, bool sm90) {
  args.sm_count = device_info(args.device).sm_count;
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

cw8a8_scaled_mm_args pack_scaled_mm_args(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                                         const at::Tensor& scale_a, const at::Tensor& scale_b,
                                         const std::optional<at::Tensor>& bias) {
  cw8a8_scaled_mm_args args = check_and_pack(out, a, b, scale_a, scale_b, bias);
  args.sm_count = device_info(args.device).sm_count;
  return args;
}

cw8a8_scaled_mm_node_fn sm90_scaled_mm_node_fn() {
  const ArchKernels& k = require(sm90_kernels(), "sm90", "9.0a");
  TORCH_CHECK(k.node != nullptr, "cutlass_w8a8: ", k.library, " has no cw8a8_sm90_scaled_mm_node (rebuild it)");
  return k.node;
}

void scaled_mm_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                   const at::Tensor& scale_b, const std::optional<at::Tensor>& bias) {
  scaled_mm_config_out(out, a, b, scale_a, scale_b, bias, -1);
}

void scaled_mm_config_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                          const at::Tensor& scale_b, const std::optional<at::Tensor>& bias, int64_t config) {
  cw8a8_scaled_mm_args args = check_and_pack(out, a, b, scale_a, scale_b, bias);
  launch_scaled_mm(args, a, scale_a, scale_b, bias, config);
}

void launch_scaled_mm(cw8a8_scaled_mm_args& args, const at::Tensor& a, const at::Tensor& scale_a,
                      const at::Tensor& scale_b, const std::optional<at::Tensor>& bias, int64_t config) {
  if (args.m == 0) return;
  c10::cuda::CUDAGuard guard(a.device());
  bool vector_scales = false;
  const ArchKernels& kernels = kernels_for(args.device, args.ab_type, &vector_scales);
  VectorOperands keep;
  if (vector_scales) {
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
  if (config >= 0) {
    const int count = kernels.num_configs(args.ab_type);
    TORCH_CHECK_VALUE(config < count, "_scaled_mm_config: `config` must be in [0, ", count, "), got ", config);
  }
  args.config = static_cast<int>(config);
  // Only the sm90 kernels wait on griddepcontrol; the CUTLASS 2.x ones must never be launched with PDL.
  // And only for M <= kPdlMaxM: measured on an H200 (bench/results/gemm_nvidia-h200.md, PDL columns, from a
  // sweep with PDL at every M), PDL sped up every shape at M <= 16 (GEMM 1.00-1.22x, W8A8Linear forward
  // 0.98-1.23x) but slowed most larger-M points (down to 0.76x for the GEMM and 0.63x for the forward).
  // Captured into an UpdatableGraph (graph_nodes::recording()), a GEMM launches with PDL at any M: its node is
  // meant to be resized, typically down to decode sizes, and an update cannot add the programmatic edge later.
  args.pdl = (!vector_scales && pdl_enabled() && (args.m <= kPdlMaxM || graph_nodes::recording())) ? 1 : 0;
  run(args, a, kernels, /*sm90=*/!vector_scales);
}

at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                     const at::Tensor& scale_b, at::ScalarType out_dtype, const std::optional<at::Tensor>& bias) {
  CW8A8_CHECK_TYPE(is_out_type(out_dtype), kOp, "out_dtype", "must be bfloat16 or float16, got ",
                   dtype_name(out_dtype));
  CW8A8_CHECK_VALUE(a.dim() == 2 && b.dim() == 2, kOp, "a", "and `b` must be 2-D, got ", a.sizes(), " and ",
                    b.sizes());
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options().dtype(out_dtype));
  scaled_mm_out(out, a, b, scale_a, scale_b, bias);
  return out;
}

std::string py_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    case at::kFloat8_e4m3fn: return "torch.float8_e4m3fn";
    case at::kFloat8_e5m2: return "torch.float8_e5m2";
    default: return std::string("torch.") + c10::toString(t);
  }
}

std::string py_tuple(at::IntArrayRef v) {
  std::string s = "(";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(v[i]);
  }
  return s + (v.size() == 1 ? ",)" : ")");
}

const DeviceInfo& device_info(int device) {
  static std::array<DeviceInfo, 64> cache{};
  static std::array<std::once_flag, 64> once;
  TORCH_CHECK(device >= 0 && device < 64, "cutlass_w8a8: device index ", device, " out of range");
  std::call_once(once[device], [device] {
    DeviceInfo& d = cache[device];
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.minor, cudaDevAttrComputeCapabilityMinor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.sm_count, cudaDevAttrMultiProcessorCount, device));
  });
  return cache[device];
}

}  // namespace cutlass_w8a8

// C entry points for Python (ctypes, cutlass_w8a8._ext): whether the sm90 GEMMs launch with PDL.
extern "C" __attribute__((visibility("default"))) int cw8a8_get_pdl() {
  return cutlass_w8a8::pdl_enabled() ? 1 : 0;
}
extern "C" __attribute__((visibility("default"))) int cw8a8_set_pdl(int enabled) {
  const int previous = cw8a8_get_pdl();
  cutlass_w8a8::g_pdl.store(enabled != 0 ? 1 : 0, std::memory_order_relaxed);
  return previous;
}
