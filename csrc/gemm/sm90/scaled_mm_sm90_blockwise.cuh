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

#include "gemm/sm90/scaled_mm_sm90_config.cuh"
#include "gemm/sm90/scaled_mm_sm90_gemm.cuh"  // GemmTypes (ScaleEpilogue::BlockEVT, BlockScaleLayout), as grouped/
#include "gemm/sm90/scaled_mm_sm90_launch.cuh"  // also the GDC guard: PDL launches need -DCUTLASS_ENABLE_GDC_FOR_SM90

namespace cutlass_w8a8::sm90 {

// The block-scaled kernel's CUTLASS types (scaled_mm_sm90_gemm.cuh): e4m3 operands, the blockwise mainloop with the
// K-major scale factors (BlockScaleLayout: granularity 1 x 128 on the tokens' side, 128 x 128 on the weight's; TileK
// 128, the weight's side of the tile a multiple of 128), the epilogue D = acc + bias rounded once to ElementD
// (ScaleEpilogue::BlockEVT: the scales were applied in the mainloop; the bias is one value per channel, the kernel's
// columns unswapped, its rows swapped, or none), one problem on the persistent tile scheduler.
template <class ElementD, class Cfg>
using BlockScaledMmTypes = GemmTypes<cutlass::float_e4m3_t, ElementD, Cfg, /*kBlock=*/true, /*kPtrArray=*/false,
                                     cute::Shape<int, int, int, int>, cutlass::gemm::PersistentScheduler>;

template <class ElementD, class Cfg>
struct BlockScaledMmKernel : BlockScaledMmTypes<ElementD, Cfg> {
  using Types = BlockScaledMmTypes<ElementD, Cfg>;
  using typename Types::ElementAB, typename Types::Sched, typename Types::Epilogue, typename Types::EpilogueEVT;
  using typename Types::Gemm, typename Types::ScaleConfig, typename Types::LayoutSFA, typename Types::LayoutSFB;
  using typename Types::StrideA, typename Types::StrideB, typename Types::StrideD;
  using Types::kSwapAB;

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
