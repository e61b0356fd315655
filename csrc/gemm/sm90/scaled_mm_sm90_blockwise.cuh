// The sm90 block-scaled fp8 GEMM: CUTLASS's own blockwise-scaling mainloop
// (sm90_mma_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp, the FP8Blockwise kernel schedules) with
// K-major scale factors (BlockScaleLayout), and an epilogue visitor tree that adds the bias and rounds once
// (ScaleEpilogue::BlockEVT; both in scaled_mm_sm90_epilogue.cuh, shared with the row-wise and grouped kernels).
//
// Operands (kernel_api.h, scale_block = 1; KB = K / 128):
//   A        the activations, e4m3 [M, K] row-major with pitch lda (never recomputed: padded rows work)
//   B        the weight, e4m3 [N, K] row-major with pitch ldb (the [K, N] column-major operand of scaled_mm)
//   scale_a  float32 [M, KB] row-major: one scale per token and 128-element K group (granularity 1 x 128)
//   scale_b  float32 [ceil(N / 128), KB] row-major: one scale per 128 x 128 weight block
// The mainloop multiplies each 128-deep K block's partial sums (promoted out of the tensor cores every 4 MMAs of
// K 32) by scale_a * scale_b and adds them into a float32 accumulator; the epilogue adds the bias (converted to
// float32) and rounds once to bfloat16 / float16. csrc/gemm/EPILOGUES.md writes out the math.
//
// In the kernel's own frame (Config<...> reads the same way as the row-wise table) the unswapped kernel has the
// tokens as rows (scale granularity 1) and the weight's N as columns (granularity 128, so TileN must be a multiple
// of 128); the swapped one computes D^T = B^T A^T with the weight's N as rows (granularity 128: TileM a multiple
// of 128) and the tokens as columns (granularity 1: TileN 16, 32, 64, ...). CUTLASS requires each granularity to
// divide its tile dimension.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "gemm/sm90/scaled_mm_sm90_config.cuh"
#include "gemm/sm90/scaled_mm_sm90_epilogue.cuh"  // ScaleEpilogue::BlockEVT, BlockScaleLayout (shared with grouped/)
#include "gemm/sm90/scaled_mm_sm90_launch.cuh"  // also the GDC guard: PDL launches need -DCUTLASS_ENABLE_GDC_FOR_SM90

namespace cutlass_w8a8::sm90 {

namespace detail {

// CUTLASS's kernel and epilogue schedule tags of the blockwise-scaled fp8 kernels for a Schedule.
template <Schedule S>
struct BlockScheduleTypes {
  static constexpr bool kPingpong = S == Schedule::kPingpong;
  using Kernel = cute::conditional_t<kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8Blockwise,
                                     cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>;
  using Epilogue = cute::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                                       cutlass::epilogue::TmaWarpSpecializedCooperative>;
};

}  // namespace detail

template <class ElementD, class Cfg>
struct BlockScaledMmKernel {
  using ElementAB = cutlass::float_e4m3_t;
  using ElementAcc = float;
  static constexpr bool kSwapAB = Cfg::kSwapAB;
  using TileShape = typename Cfg::TileShape;
  using ClusterShape = typename Cfg::ClusterShape;
  using Sched = detail::BlockScheduleTypes<Cfg::kSchedule>;
  using TileSchedulerTag = cutlass::gemm::PersistentScheduler;  // Scheduler::kPersistent, the only one

  static_assert(!Cfg::kFastAccum, "the blockwise mainloop always promotes (fast accumulation is not an option)");

  // The K-major scale factors (scaled_mm_sm90_epilogue.cuh): granularity 1 x 128 on the tokens' side, 128 x 128 on
  // the weight's.
  using Scales = BlockScaleLayout<TileShape, kSwapAB>;
  static_assert(Scales::kTileK,
                "TileK must be 128: the mainloop reads one scale per K tile and promotes once per K tile");
  static_assert(Scales::kTileWeightSide,
                "the weight's side of the tile (TileM swapped, TileN unswapped) must be a multiple of 128");
  using ScaleConfig = typename Scales::ScaleConfig;
  using LayoutSFA = typename Scales::LayoutSFA;
  using LayoutSFB = typename Scales::LayoutSFB;

  using LayoutA = cutlass::layout::RowMajor;     // K-major, as the 8-bit wgmma requires
  using LayoutB = cutlass::layout::ColumnMajor;  // K-major
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<ElementAB>::value;  // 16-byte TMA rows

  // The epilogue (scaled_mm_sm90_epilogue.cuh): D = acc + bias, rounded once to ElementD (the scales were applied
  // in the mainloop); the bias is one value per channel (the kernel's columns unswapped, its rows swapped) or none.
  using Epilogue = ScaleEpilogue<TileShape, ElementD, kSwapAB>;
  using EpilogueEVT = typename Epilogue::BlockEVT;
  using CollectiveEpilogue =
      typename Epilogue::template Collective<ClusterShape, ElementAcc, typename Sched::Epilogue, EpilogueEVT>;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, cute::tuple<LayoutA, LayoutSFA>, kAlignAB,
      ElementAB, cute::tuple<LayoutB, LayoutSFB>, kAlignAB, ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Sched::Kernel>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                          CollectiveEpilogue, TileSchedulerTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  using StrideA = typename GemmKernel::StrideA;
  using StrideB = typename GemmKernel::StrideB;
  using StrideD = typename GemmKernel::StrideD;

  // PDL: the pingpong kernel's producer warps (TMA loads of A and B, cp.async of the scales) all wait on
  // griddepcontrol before their first load. CUTLASS 4.2's cooperative kernel does not make the scale-loading warp
  // (ProducerWarpRole::MainloopAux in sm90_gemm_tma_warpspecialized_cooperative.hpp) wait, so behind a
  // programmatic edge it could read scale_a before the quantizer that writes it has finished: cooperative configs
  // are launched without PDL (GemmLauncher::run), and a graph node captured with a PDL edge is never switched to
  // one (graphs/graph_nodes.cu, cw8a8_kernel_node.pdl_safe).
  static constexpr bool kPdlSafe = Sched::kPingpong;

  // The CUTLASS arguments of one call: the operands in the kernel's frame (DenseOperands, scaled_mm_sm90_launch.cuh:
  // strides from the caller's pitches), the scale factors (contiguous, checked by the caller, so their layouts
  // follow from M, N and K) and the epilogue's bias.
  static typename Gemm::Arguments make_arguments(const cw8a8_scaled_mm_args& p) {
    const DenseOperands<ElementAB, StrideA, StrideB, StrideD, kSwapAB> op(p);
    const int m = static_cast<int>(op.m);  // the kernel's rows
    const int n = static_cast<int>(op.n);  // the kernel's columns
    const int k = static_cast<int>(p.k);
    const float* sf_a = kSwapAB ? p.scale_b : p.scale_a;  // the kernel rows' scales
    const float* sf_b = kSwapAB ? p.scale_a : p.scale_b;  // the kernel columns' scales
    const auto problem = cute::make_shape(m, n, k, 1);
    LayoutSFA layout_sfa = ScaleConfig::tile_atom_to_shape_SFA(problem);
    LayoutSFB layout_sfb = ScaleConfig::tile_atom_to_shape_SFB(problem);

    typename EpilogueEVT::Arguments evt_args = Epilogue::block_args(static_cast<ElementD const*>(p.bias));

    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, k, 1},
        {op.a, op.stride_a, op.b, op.stride_b, sf_a, layout_sfa, sf_b, layout_sfb},
        {evt_args, nullptr, op.stride_d, static_cast<ElementD*>(p.d), op.stride_d},
    };
    args.hw_info.device_id = p.device;
    args.hw_info.sm_count = p.sm_count;
    args.scheduler.max_swizzle_size = Cfg::kSwizzle;  // raster: CUTLASS heuristic (along M if more N tiles)
    return args;
  }
};

template <class ElementD, class Cfg>
int run_scaled_mm_block(const cw8a8_scaled_mm_args& args, cw8a8_alloc_fn alloc, void* alloc_ctx, char* err,
                        size_t err_len) {
  return GemmLauncher<BlockScaledMmKernel<ElementD, Cfg>>::run(args, alloc, alloc_ctx, err, err_len);
}

template <class ElementD, class Cfg>
int scaled_mm_block_node(const cw8a8_scaled_mm_args& args, cw8a8_kernel_node* node, char* err, size_t err_len) {
  return GemmLauncher<BlockScaledMmKernel<ElementD, Cfg>>::node(args, node, err, err_len);
}

}  // namespace cutlass_w8a8::sm90
