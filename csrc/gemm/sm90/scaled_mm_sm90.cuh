// The sm90 scaled_mm kernel: a CUTLASS 3.x TMA warp-specialized GEMM whose epilogue (an epilogue
// visitor tree, EVT: ScaleEpilogue::RowwiseEVT, scaled_mm_sm90_epilogue.cuh) applies both scales and the bias in
// one pass over the accumulators. The math is written out in csrc/gemm/EPILOGUES.md.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>

#include "gemm/sm90/scaled_mm_sm90_config.cuh"
#include "gemm/sm90/scaled_mm_sm90_gemm.cuh"  // GemmTypes: the CUTLASS types of every sm90 kernel
#include "gemm/sm90/scaled_mm_sm90_launch.cuh"  // also the GDC guard: PDL launches need -DCUTLASS_ENABLE_GDC_FOR_SM90

namespace cutlass_w8a8::sm90 {

// The row-wise kernel's CUTLASS types (scaled_mm_sm90_gemm.cuh): the plain mainloop, the epilogue
// D = scale_tok * (scale_ch * float(acc)) + bias rounded once (ScaleEpilogue::RowwiseEVT), one problem on the
// persistent tile scheduler (Scheduler::kPersistent, the only one).
template <class ElementAB, class ElementD, class Cfg>
using ScaledMmTypes = GemmTypes<ElementAB, ElementD, Cfg, /*kBlock=*/false, /*kPtrArray=*/false,
                                cute::Shape<int, int, int, int>, cutlass::gemm::PersistentScheduler>;

template <class ElementAB, class ElementD, class Cfg>
struct ScaledMmKernel : ScaledMmTypes<ElementAB, ElementD, Cfg> {
  using Types = ScaledMmTypes<ElementAB, ElementD, Cfg>;
  using typename Types::Epilogue, typename Types::EpilogueEVT, typename Types::Gemm;
  using typename Types::StrideA, typename Types::StrideB, typename Types::StrideD;
  using Types::kSwapAB;

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
