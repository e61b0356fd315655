// The sm90 scaled_mm kernel: a CUTLASS 3.x TMA warp-specialized GEMM whose epilogue (an epilogue
// visitor tree, EVT) applies both scales and the bias in one pass over the accumulators.
// The math is written out in csrc/gemm/EPILOGUES.md.
#pragma once

#include <cstdint>

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
#include "gemm/sm90/scaled_mm_sm90_launch.cuh"  // also the GDC guard: PDL launches need -DCUTLASS_ENABLE_GDC_FOR_SM90

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
    args.scheduler.max_swizzle_size = Cfg::kSwizzle;  // raster: CUTLASS heuristic (along M if more N tiles)
    return args;
  }

  // Every global read of the row-wise kernels waits on griddepcontrol (CUTLASS_ENABLE_GDC_FOR_SM90): the producer
  // warp before loading A and B; the epilogue's scale and bias loads come after the mainloop has consumed them.
  static constexpr bool kPdlSafe = true;
};

template <class ElementAB, class ElementD, class Cfg>
int run_scaled_mm(const cw8a8_scaled_mm_args& args, cw8a8_alloc_fn alloc, void* alloc_ctx, char* err,
                  size_t err_len) {
  return GemmLauncher<ScaledMmKernel<ElementAB, ElementD, Cfg>>::run(args, alloc, alloc_ctx, err, err_len);
}

template <class ElementAB, class ElementD, class Cfg>
int scaled_mm_node(const cw8a8_scaled_mm_args& args, cw8a8_kernel_node* node, char* err, size_t err_len) {
  return GemmLauncher<ScaledMmKernel<ElementAB, ElementD, Cfg>>::node(args, node, err, err_len);
}

}  // namespace cutlass_w8a8::sm90
