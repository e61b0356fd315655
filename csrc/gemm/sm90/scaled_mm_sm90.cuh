// The sm90 scaled_mm kernel: a CUTLASS 3.x TMA warp-specialized GEMM whose epilogue (an epilogue
// visitor tree, EVT) applies both scales and the bias in one pass over the accumulators.
// The math is written out in csrc/gemm/EPILOGUES.md.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "gemm/sm90/scaled_mm_sm90_config.cuh"

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

// CUTLASS's kernel and epilogue schedule tags for a Schedule; the fp8 fast-accumulation kernels are their own tags.
template <Schedule S, bool Fp8FastAccum>
struct ScheduleTypes {
  static constexpr bool kPingpong = S == Schedule::kPingpong;
  using Pingpong = cute::conditional_t<Fp8FastAccum, cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum,
                                       cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
  using Cooperative = cute::conditional_t<Fp8FastAccum, cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
                                          cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using Kernel = cute::conditional_t<kPingpong, Pingpong, Cooperative>;
  using Epilogue = cute::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                                       cutlass::epilogue::TmaWarpSpecializedCooperative>;
};

inline int fail(char* err, size_t err_len, const char* what, cutlass::Status st) {
  std::snprintf(err, err_len, "%s: %s", what, cutlass::cutlassGetStatusString(st));
  return 1;
}

}  // namespace detail

template <class ElementAB, class ElementD, class Cfg>
struct ScaledMmKernel {
  static constexpr bool kIsInt8 = cute::is_same_v<ElementAB, int8_t>;
  static constexpr bool kSwapAB = Cfg::kSwapAB;
  using ElementAcc = cute::conditional_t<kIsInt8, int32_t, float>;
  using ElementCompute = float;
  using TileShape = typename Cfg::TileShape;
  using ClusterShape = typename Cfg::ClusterShape;
  // fp8 accumulates in fp32 either way; "fast accumulation" skips the periodic promotion of the tensor
  // core's partial sums into a full fp32 accumulator (csrc/gemm/EPILOGUES.md). int8 accumulates exactly.
  static_assert(!(kIsInt8 && Cfg::kFastAccum), "fast accumulation is an fp8 option");
  using Sched = detail::ScheduleTypes<Cfg::kSchedule, Cfg::kFastAccum>;
  using TileSchedulerTag = cutlass::gemm::PersistentScheduler;  // Scheduler::kPersistent, the only one

  // In the kernel's own frame the rows are the MMA's M. Without the swap, rows are tokens (A's M) and
  // columns are channels (B's N); with it, rows are channels and columns tokens, and D is column-major.
  using LayoutA = cutlass::layout::RowMajor;     // K-major, as the 8-bit wgmma requires
  using LayoutB = cutlass::layout::ColumnMajor;  // K-major
  using LayoutD = cute::conditional_t<kSwapAB, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<ElementAB>::value;  // 16-byte TMA rows
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;

  // Broadcast of a float32 vector along the kernel's rows (one value per column) or columns (one value
  // per row). The bool stride selects at run time between a vector (true) and a single scalar (false),
  // so per-tensor and per-token/per-channel scales share one kernel.
  using RowVector = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, float, float,
                                                                cute::Stride<cute::_0, bool, cute::_0>>;
  using ColVector = cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, float, float,
                                                                cute::Stride<bool, cute::_0, cute::_0>>;
  // Bias: one value per channel in the output type, or a null pointer for no bias (reads as zero).
  using BiasRow = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, ElementD, float,
                                                              cute::Stride<cute::_0, cute::_1, cute::_0>>;
  using BiasCol = cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, ElementD, float,
                                                              cute::Stride<cute::_1, cute::_0, cute::_0>>;

  using ScaleTokens = cute::conditional_t<kSwapAB, RowVector, ColVector>;
  using ScaleChannels = cute::conditional_t<kSwapAB, ColVector, RowVector>;
  using Bias = cute::conditional_t<kSwapAB, BiasCol, BiasRow>;

  // D = scale_tok * (scale_ch * float(acc)) + bias, rounded once to ElementD.
  using Acc = cutlass::epilogue::fusion::Sm90AccFetch;
  using ScaleChTimesAcc = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, ElementCompute, ElementCompute,
                                             cutlass::FloatRoundStyle::round_to_nearest>,
      ScaleChannels, Acc>;
  using EpilogueEVT = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::multiply_add, ElementD, ElementCompute,
                                             cutlass::FloatRoundStyle::round_to_nearest>,
      ScaleTokens, ScaleChTimesAcc, Bias>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementCompute, void, LayoutD, kAlignD,
      ElementD, LayoutD, kAlignD, typename Sched::Epilogue, EpilogueEVT>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA, kAlignAB, ElementAB, LayoutB,
      kAlignAB, ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Sched::Kernel>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                          CollectiveEpilogue, TileSchedulerTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  using StrideA = typename GemmKernel::StrideA;
  using StrideB = typename GemmKernel::StrideB;
  using StrideD = typename GemmKernel::StrideD;

  // Arguments of a float32 broadcast: a vector (one value per row or column) or a single scalar.
  template <class Bcast>
  static typename Bcast::Arguments vector_args(const float* ptr, int is_vector) {
    if constexpr (cute::is_same_v<Bcast, RowVector>) {
      return {ptr, 0.f, {cute::_0{}, is_vector != 0, cute::_0{}}};
    } else {
      return {ptr, 0.f, {is_vector != 0, cute::_0{}, cute::_0{}}};
    }
  }

  // The CUTLASS arguments of one call. Strides come from the caller's tensors, never recomputed from the
  // shapes, so row-padded views (a slice of a wider buffer) are addressed correctly.
  static typename Gemm::Arguments make_arguments(const cw8a8_scaled_mm_args& p) {
    const int64_t m = kSwapAB ? p.n : p.m;  // the kernel's rows
    const int64_t n = kSwapAB ? p.m : p.n;  // the kernel's columns
    auto const* ptr_a = static_cast<ElementAB const*>(kSwapAB ? p.b : p.a);
    auto const* ptr_b = static_cast<ElementAB const*>(kSwapAB ? p.a : p.b);
    const int64_t ld_a = kSwapAB ? p.ldb : p.lda;
    const int64_t ld_b = kSwapAB ? p.lda : p.ldb;

    StrideA stride_a = cute::make_stride(ld_a, cute::Int<1>{}, ld_a * m);
    StrideB stride_b = cute::make_stride(ld_b, cute::Int<1>{}, ld_b * n);
    StrideD stride_d;
    if constexpr (kSwapAB) {
      stride_d = cute::make_stride(cute::Int<1>{}, p.ldd, p.ldd * n);
    } else {
      stride_d = cute::make_stride(p.ldd, cute::Int<1>{}, p.ldd * m);
    }

    typename ScaleTokens::Arguments scale_tok_args = vector_args<ScaleTokens>(p.scale_a, p.scale_a_per_token);
    typename ScaleChannels::Arguments scale_ch_args =
        vector_args<ScaleChannels>(p.scale_b, p.scale_b_per_channel);
    typename Bias::Arguments bias_args{static_cast<ElementD const*>(p.bias), ElementD(0.f), {}};

    typename EpilogueEVT::Arguments evt_args{
        scale_tok_args,
        {scale_ch_args, {}, {}},
        bias_args,
        {},
    };

    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {static_cast<int>(m), static_cast<int>(n), static_cast<int>(p.k), 1},
        {ptr_a, stride_a, ptr_b, stride_b},
        {evt_args, nullptr, stride_d, static_cast<ElementD*>(p.d), stride_d},
    };
    args.hw_info.device_id = p.device;
    args.hw_info.sm_count = p.sm_count;
    return args;
  }

  // Describes the launch `run` would make, for a CUDA-graph node update (kernel_api.h, cw8a8_kernel_node).
  static int node(const cw8a8_scaled_mm_args& p, cw8a8_kernel_node* out, char* err, size_t err_len) {
    using Params = typename GemmKernel::Params;
    static_assert(sizeof(Params) <= CW8A8_NODE_PARAMS_BYTES, "CUTLASS Params larger than the node buffer");
    typename Gemm::Arguments args = make_arguments(p);
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
    out->params_bytes = sizeof(Params);
    std::memcpy(out->params, &params, sizeof(Params));
    return 0;
  }

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

  static int run(const cw8a8_scaled_mm_args& p, cw8a8_alloc_fn alloc, void* alloc_ctx, char* err,
                 size_t err_len) {
    typename Gemm::Arguments args = make_arguments(p);

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
    // on the stream is finishing; its producer warps wait on griddepcontrol before loading A or B.
    st = Gemm::run(params, p.stream, /*cuda_adapter=*/nullptr, /*launch_with_pdl=*/p.pdl != 0);
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

template <class ElementAB, class ElementD, class Cfg>
int run_scaled_mm(const cw8a8_scaled_mm_args& args, cw8a8_alloc_fn alloc, void* alloc_ctx, char* err,
                  size_t err_len) {
  return ScaledMmKernel<ElementAB, ElementD, Cfg>::run(args, alloc, alloc_ctx, err, err_len);
}

template <class ElementAB, class ElementD, class Cfg>
int scaled_mm_node(const cw8a8_scaled_mm_args& args, cw8a8_kernel_node* node, char* err, size_t err_len) {
  return ScaledMmKernel<ElementAB, ElementD, Cfg>::node(args, node, err, err_len);
}

}  // namespace cutlass_w8a8::sm90
