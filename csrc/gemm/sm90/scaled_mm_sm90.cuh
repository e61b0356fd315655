// The sm90 scaled_mm kernel: a CUTLASS 3.x TMA warp-specialized GEMM whose epilogue (an epilogue
// visitor tree, EVT: ScaleEpilogue::RowwiseEVT, scaled_mm_sm90_epilogue.cuh) applies both scales and the bias in
// one pass over the accumulators. The math is written out in csrc/gemm/EPILOGUES.md.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "gemm/sm90/scaled_mm_sm90_config.cuh"
#include "gemm/sm90/scaled_mm_sm90_epilogue.cuh"  // ScaleEpilogue: the EVTs of every sm90 kernel
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
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<ElementAB>::value;  // 16-byte TMA rows

  // The epilogue (scaled_mm_sm90_epilogue.cuh): D = scale_tok * (scale_ch * float(acc)) + bias, rounded once.
  using Epilogue = ScaleEpilogue<TileShape, ElementD, kSwapAB>;
  using EpilogueEVT = typename Epilogue::RowwiseEVT;
  using CollectiveEpilogue =
      typename Epilogue::template Collective<ClusterShape, ElementAcc, typename Sched::Epilogue, EpilogueEVT>;

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

  // The CUTLASS arguments of one call: the operands in the kernel's frame (DenseOperands, scaled_mm_sm90_launch.cuh:
  // strides from the caller's pitches) and the epilogue's scales and bias.
  static typename Gemm::Arguments make_arguments(const cw8a8_scaled_mm_args& p) {
    const DenseOperands<ElementAB, StrideA, StrideB, StrideD, kSwapAB> op(p);
    typename EpilogueEVT::Arguments evt_args = Epilogue::rowwise_args(
        p.scale_a, p.scale_a_per_token, p.scale_b, p.scale_b_per_channel, static_cast<ElementD const*>(p.bias));

    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {static_cast<int>(op.m), static_cast<int>(op.n), static_cast<int>(p.k), 1},
        {op.a, op.stride_a, op.b, op.stride_b},
        {evt_args, nullptr, op.stride_d, static_cast<ElementD*>(p.d), op.stride_d},
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
