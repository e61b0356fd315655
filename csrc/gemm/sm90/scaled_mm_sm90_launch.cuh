// Launching one sm90 CUTLASS 3.x GEMM kernel from a cw8a8_scaled_mm_args block, shared by the row-wise kernel
// (scaled_mm_sm90.cuh) and the block-scaled one (scaled_mm_sm90_blockwise.cuh): can_implement, the workspace from
// the caller's allocator, the shared-memory attribute once per device, the launch (with PDL where the kernel is
// safe under it), and the same launch described without launching it, for CUDA-graph node updates.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>

#include "gemm/kernel_api.h"

// Programmatic dependent launch (PDL) is only safe when every kernel launched with it executes
// griddepcontrol.wait before its first global-memory access; CUTLASS emits that wait only when
// CUTLASS_ENABLE_GDC_FOR_SM90 is defined and the target is sm_90a (cutlass/arch/grid_dependency_control.h).
// setup.py defines it for this library; refuse to build device code where the wait would be compiled out.
#include <cutlass/arch/grid_dependency_control.h>
#if defined(__CUDA_ARCH__) && !defined(CUTLASS_GDC_ENABLED)
#error "the sm90 kernels must be compiled for sm_90a with -DCUTLASS_ENABLE_GDC_FOR_SM90 (PDL launches need it)"
#endif

namespace cutlass_w8a8::sm90 {

namespace detail {

inline int fail(char* err, size_t err_len, const char* what, cutlass::Status st) {
  std::snprintf(err, err_len, "%s: %s", what, cutlass::cutlassGetStatusString(st));
  return 1;
}

}  // namespace detail

// One call's operands in the kernel's own frame (rows are the MMA's M), for the dense kernels' make_arguments.
// Without the swap the kernel's A is a [M, K], its B is b and D is row-major; with it (kSwapAB: D^T = B^T A^T) A is
// the weight, B the activations, the rows are N and D is column-major. Strides come from the caller's pitches, never
// recomputed from the shapes, so row-padded views (a slice of a wider buffer) are addressed correctly.
template <class ElementAB, class StrideA, class StrideB, class StrideD, bool kSwapAB>
struct DenseOperands {
  int64_t m, n;  // the kernel's rows and columns
  const ElementAB* a;
  const ElementAB* b;
  StrideA stride_a;
  StrideB stride_b;
  StrideD stride_d;

  explicit DenseOperands(const cw8a8_scaled_mm_args& p)
      : m(kSwapAB ? p.n : p.m),
        n(kSwapAB ? p.m : p.n),
        a(static_cast<ElementAB const*>(kSwapAB ? p.b : p.a)),
        b(static_cast<ElementAB const*>(kSwapAB ? p.a : p.b)) {
    const int64_t ld_a = kSwapAB ? p.ldb : p.lda;
    const int64_t ld_b = kSwapAB ? p.lda : p.ldb;
    stride_a = cute::make_stride(ld_a, cute::Int<1>{}, ld_a * m);
    stride_b = cute::make_stride(ld_b, cute::Int<1>{}, ld_b * n);
    if constexpr (kSwapAB) {
      stride_d = cute::make_stride(cute::Int<1>{}, p.ldd, p.ldd * n);
    } else {
      stride_d = cute::make_stride(p.ldd, cute::Int<1>{}, p.ldd * m);
    }
  }
};

// `Kernel` provides: GemmKernel, Gemm (its GemmUniversalAdapter), ClusterShape, kPdlSafe (whether every global
// read of the kernel waits on griddepcontrol, so that it may be launched behind a programmatic edge) and
// `static typename Gemm::Arguments make_arguments(const cw8a8_scaled_mm_args&)`.
template <class Kernel>
struct GemmLauncher {
  using GemmKernel = typename Kernel::GemmKernel;
  using Gemm = typename Kernel::Gemm;
  using ClusterShape = typename Kernel::ClusterShape;

  // cudaFuncSetAttribute(MaxDynamicSharedMemorySize) once per device for this kernel (GemmUniversalAdapter's
  // initialize() calls it on every launch: a driver call per GEMM on the host-bound path of small batches).
  static int ensure_smem_attribute(int device, char* err, size_t err_len) {
    constexpr int smem = GemmKernel::SharedStorageSize;
    if constexpr (smem < (48 << 10)) {
      return 0;
    } else {
      static std::atomic<uint64_t> done{0};  // bit d: set on device d (devices >= 64 are set every time)
      const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
      if (bit != 0 && (done.load(std::memory_order_acquire) & bit)) return 0;
      const cudaError_t ce = cudaFuncSetAttribute(reinterpret_cast<const void*>(&cutlass::device_kernel<GemmKernel>),
                                                  cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (ce != cudaSuccess) {
        std::snprintf(err, err_len, "cudaFuncSetAttribute: %s", cudaGetErrorString(ce));
        return 1;
      }
      done.fetch_or(bit, std::memory_order_acq_rel);
      return 0;
    }
  }

  // Describes the launch `run` would make, for a CUDA-graph node update (kernel_api.h, cw8a8_kernel_node).
  static int node(const cw8a8_scaled_mm_args& p, cw8a8_kernel_node* out, char* err, size_t err_len) {
    using Params = typename GemmKernel::Params;
    static_assert(sizeof(Params) <= CW8A8_NODE_PARAMS_BYTES, "CUTLASS Params larger than the node buffer");
    typename Gemm::Arguments args = Kernel::make_arguments(p);
    cutlass::Status st = Gemm::can_implement(args);
    if (st != cutlass::Status::kSuccess) return detail::fail(err, err_len, "CUTLASS can_implement", st);
    if (Gemm::get_workspace_size(args) != 0) {
      std::snprintf(err, err_len, "this config needs a workspace; its graph node cannot be updated in place");
      return 1;
    }
    // The same steps as GemmUniversalAdapter::initialize + run, without the launch.
    Params params = GemmKernel::to_underlying_arguments(args, nullptr);
    const dim3 grid = GemmKernel::get_grid_shape(params);
    const dim3 block = GemmKernel::get_block_shape();
    const int smem = GemmKernel::SharedStorageSize;
    void* func = reinterpret_cast<void*>(&cutlass::device_kernel<GemmKernel>);
    if (ensure_smem_attribute(p.device, err, err_len) != 0) return 1;
    out->func = func;
    out->grid[0] = grid.x, out->grid[1] = grid.y, out->grid[2] = grid.z;
    out->block[0] = block.x, out->block[1] = block.y, out->block[2] = block.z;
    out->cluster[0] = cute::size<0>(ClusterShape{});
    out->cluster[1] = cute::size<1>(ClusterShape{});
    out->cluster[2] = cute::size<2>(ClusterShape{});
    out->smem_bytes = static_cast<size_t>(smem);
    out->pdl_safe = Kernel::kPdlSafe ? 1 : 0;
    out->params_bytes = sizeof(Params);
    std::memcpy(out->params, &params, sizeof(Params));
    return 0;
  }

  static int run(const cw8a8_scaled_mm_args& p, cw8a8_alloc_fn alloc, void* alloc_ctx, char* err, size_t err_len) {
    typename Gemm::Arguments args = Kernel::make_arguments(p);

    cutlass::Status st = Gemm::can_implement(args);
    if (st != cutlass::Status::kSuccess) return detail::fail(err, err_len, "CUTLASS can_implement", st);

    const size_t ws_bytes = Gemm::get_workspace_size(args);
    void* ws = nullptr;
    if (ws_bytes > 0) {
      ws = alloc(alloc_ctx, ws_bytes);
      if (ws == nullptr) {
        std::snprintf(err, err_len, "could not allocate a %zu-byte workspace", ws_bytes);
        return 1;
      }
      st = GemmKernel::initialize_workspace(args, ws, p.stream, nullptr);
      if (st != cutlass::Status::kSuccess) return detail::fail(err, err_len, "CUTLASS initialize_workspace", st);
    }
    // GemmUniversalAdapter::initialize + run, with the shared-memory attribute set once per device instead of
    // on every call (see ensure_smem_attribute).
    if (ensure_smem_attribute(p.device, err, err_len) != 0) return 1;
    typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(args, ws);
    // With PDL the kernel may start (prologue: barriers, TMA descriptor prefetch) while the previous kernel
    // on the stream is finishing; its producer warps wait on griddepcontrol before loading A or B. A kernel
    // that is not PDL-safe (Kernel::kPdlSafe) is launched without it whatever p.pdl says.
    const bool pdl = p.pdl != 0 && Kernel::kPdlSafe;
    st = Gemm::run(params, p.stream, /*cuda_adapter=*/nullptr, /*launch_with_pdl=*/pdl);
    if (st != cutlass::Status::kSuccess) {
      cudaError_t ce = cudaGetLastError();
      std::snprintf(err, err_len, "CUTLASS run: %s (%s)", cutlass::cutlassGetStatusString(st),
                    cudaGetErrorString(ce));
      return 1;
    }
    cudaError_t ce = cudaGetLastError();
    if (ce != cudaSuccess) {
      std::snprintf(err, err_len, "kernel launch failed: %s", cudaGetErrorString(ce));
      return 1;
    }
    return 0;
  }
};

}  // namespace cutlass_w8a8::sm90
