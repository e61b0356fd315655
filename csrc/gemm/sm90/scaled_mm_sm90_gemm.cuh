// The CUTLASS types of an sm90 GEMM, once for the row-wise kernel (scaled_mm_sm90.cuh), the block-scaled one
// (scaled_mm_sm90_blockwise.cuh) and the grouped ones (grouped/grouped_sm90.cuh): from the operand and output types,
// a Config, the schedule tags, the scaling and the kernel's form, the accumulator, the operand layouts, the
// collective epilogue (ScaleEpilogue, scaled_mm_sm90_epilogue.cuh) and mainloop, the kernel and its device adapter.
// Each kernel adds its launch arguments (and the grouped ones their per-group arrays).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "gemm/sm90/scaled_mm_sm90_config.cuh"    // Schedule
#include "gemm/sm90/scaled_mm_sm90_epilogue.cuh"  // ScaleEpilogue, BlockScaleLayout
#include "gemm/sm90/wave_mainloop.cuh"            // WaveMainloop (Cfg::kWaves)

namespace cutlass_w8a8::sm90 {

// CUTLASS's kernel and epilogue schedule tags (Kernel, Epilogue) of a Schedule: pingpong or cooperative, the
// mainloop's kind (plain; fp8 fast accumulation, its own tags; blockwise-scaled) and, for the grouped kernels, the
// ptr-array form.
template <Schedule S, bool kFastAccum, bool kBlock, bool kPtrArray>
struct ScheduleTypes {
  static constexpr bool kPingpong = S == Schedule::kPingpong;
  template <class Plain, class FastAccum, class Blockwise>
  using Mainloop = cute::conditional_t<kBlock, Blockwise, cute::conditional_t<kFastAccum, FastAccum, Plain>>;
  using Pingpong = cute::conditional_t<
      kPtrArray,
      Mainloop<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
               cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
               cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise>,
      Mainloop<cutlass::gemm::KernelTmaWarpSpecializedPingpong,
               cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum,
               cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8Blockwise>>;
  using Cooperative = cute::conditional_t<
      kPtrArray,
      Mainloop<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
               cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
               cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>,
      Mainloop<cutlass::gemm::KernelTmaWarpSpecializedCooperative,
               cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
               cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>>;
  using Kernel = cute::conditional_t<kPingpong, Pingpong, Cooperative>;
  using Epilogue = cute::conditional_t<
      kPtrArray,
      cute::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                          cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>,
      cute::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                          cutlass::epilogue::TmaWarpSpecializedCooperative>>;
};

// kBlock: block-scaled fp8, CUTLASS's blockwise-scaling mainloop (the scales applied per 128-element K block) and the
// epilogue D = acc + bias (ScaleEpilogue::BlockEVT); else the plain mainloop and D = scale_tok * (scale_ch *
// float(acc)) + bias (RowwiseEVT), both rounded once to ElementD.
// kPtrArray: the grouped kernels' form, one pointer and stride per group (the epilogue's array-of-pointers
// broadcasts, layout pointers for the mainloop).
// ProblemShape and TileScheduler: GemmUniversal's (the grouped kernels name no tile scheduler).
template <class ElementAB_, class ElementD_, class Cfg, bool kBlock, bool kPtrArray, class ProblemShape_,
          class... TileScheduler>
struct GemmTypes {
  using ElementAB = ElementAB_;
  using ElementD = ElementD_;
  using Sched = ScheduleTypes<Cfg::kSchedule, Cfg::kFastAccum, kBlock, kPtrArray>;
  using ProblemShape = ProblemShape_;
  static constexpr bool kIsInt8 = cute::is_same_v<ElementAB, int8_t>;
  static constexpr bool kSwapAB = Cfg::kSwapAB;
  // int8 accumulates exactly in int32. fp8 accumulates in fp32 either way; "fast accumulation" skips the periodic
  // promotion of the tensor core's partial sums into a full fp32 accumulator (csrc/gemm/EPILOGUES.md), which the
  // blockwise mainloop always does.
  using ElementAcc = cute::conditional_t<kIsInt8, int32_t, float>;
  static_assert(!(kIsInt8 && Cfg::kFastAccum), "fast accumulation is an fp8 option");
  static_assert(!(kBlock && Cfg::kFastAccum),
                "the blockwise mainloop always promotes (fast accumulation is not an option)");
  static_assert(!kBlock || cute::is_same_v<ElementAB, cutlass::float_e4m3_t>, "block scales are fp8 only");
  static_assert(!Cfg::kWaves || (!kIsInt8 && !Cfg::kFastAccum),
                "the wave mainloop replaces the fp8 promotion (block-scaled, or row-wise without fast accumulation) of "
                "the dense and grouped kernels");
  using TileShape = typename Cfg::TileShape;
  using ClusterShape = typename Cfg::ClusterShape;

  // In the kernel's own frame the rows are the MMA's M. Without the swap, rows are tokens (A's M) and columns are
  // channels (B's N); with it, rows are channels and columns tokens, and D is column-major.
  using LayoutA = cutlass::layout::RowMajor;     // K-major, as the 8-bit wgmma requires
  using LayoutB = cutlass::layout::ColumnMajor;  // K-major
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<ElementAB>::value;  // 16-byte TMA rows

  // The blockwise mainloop's K-major scale factors (scaled_mm_sm90_epilogue.cuh): granularity 1 x 128 on the tokens'
  // side, 128 x 128 on the weight's. Named whatever the scaling (the grouped kernels' arrays hold them).
  using Scales = BlockScaleLayout<TileShape, kSwapAB>;
  using ScaleConfig = typename Scales::ScaleConfig;
  using LayoutSFA = typename Scales::LayoutSFA;
  using LayoutSFB = typename Scales::LayoutSFB;
  static_assert(!kBlock || Scales::kTileK,
                "TileK must be 128: the mainloop reads one scale per K tile and promotes once per K tile");
  static_assert(!kBlock || Scales::kTileWeightSide,
                "the weight's side of the tile (TileM swapped, TileN unswapped) must be a multiple of 128");

  using Epilogue = ScaleEpilogue<TileShape, ElementD, kSwapAB, kPtrArray>;
  using EpilogueEVT = cute::conditional_t<kBlock, typename Epilogue::BlockEVT, typename Epilogue::RowwiseEVT>;
  using CollectiveEpilogue =
      typename Epilogue::template Collective<ClusterShape, ElementAcc, typename Sched::Epilogue, EpilogueEVT>;

  // The mainloop's operand layouts: a layout (pointer, kPtrArray), with the scale factors' beside it (kBlock).
  template <class Layout>
  using Operand = cute::conditional_t<kPtrArray, Layout*, Layout>;
  using MainloopLayoutA =
      cute::conditional_t<kBlock, cute::tuple<Operand<LayoutA>, Operand<LayoutSFA>>, Operand<LayoutA>>;
  using MainloopLayoutB =
      cute::conditional_t<kBlock, cute::tuple<Operand<LayoutB>, Operand<LayoutSFB>>, Operand<LayoutB>>;
  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, MainloopLayoutA, kAlignAB, ElementAB,
      MainloopLayoutB, kAlignAB, ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Sched::Kernel>::CollectiveOp;
  // Cfg::kWaves: the same collective with the per-64-row-wave consumer (wave_mainloop.cuh; Cfg::kWaveN: its WGMMA atom
  // 64 x kWaveN, waves along N too); the kernel schedule, the
  // loads, pipelines and shared memory stay CUTLASS's (kPtrArray: the ptr-array collective, its per-group tensormap
  // updates included).
  using CollectiveMainloop =
      cute::conditional_t<Cfg::kWaves, WaveMainloop<BuiltMainloop, kBlock, Cfg::kWaveN>, BuiltMainloop>;

  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue, TileScheduler...>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  // One problem's operand strides (kPtrArray: the kernel takes an array of them, one per group).
  using StrideA = cute::remove_pointer_t<typename GemmKernel::StrideA>;
  using StrideB = cute::remove_pointer_t<typename GemmKernel::StrideB>;
  using StrideD = cute::remove_pointer_t<typename GemmKernel::StrideD>;
};

}  // namespace cutlass_w8a8::sm90
