// The Ampere/Ada scaled_mm kernel: a CUTLASS 2.x multistage tensor-core GEMM (mma.sync) with an epilogue
// visitor tree that applies both scales and the bias in one pass (math: csrc/gemm/EPILOGUES.md). int8 on sm80,
// sm86 and sm89; float8_e4m3fn on sm89.
//
// Scales reach these kernels as vectors (M values for A, N for B): the 2.x broadcast visitors read 16-byte
// vectors and have no scalar mode, so the caller expands per-tensor scales first (csrc/gemm/scaled_mm_entry.cu).
#pragma once

#include <cstdio>

// The 2.x visitor headers expect the GEMM headers before them (the order of CUTLASS's example 47).
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/gemm/device/gemm_universal.h>
#include <cutlass/gemm/threadblock/threadblock_swizzle.h>
#include <cutlass/epilogue/threadblock/fusion/visitors.hpp>
#include <cutlass/gemm/kernel/default_gemm_universal_with_visitor.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>

#include "gemm/sm80/scaled_mm_sm80_config.cuh"

namespace cutlass_w8a8::sm80 {

template <class ArchTag, class ElementAB, class ElementD, class Cfg>
struct ScaledMmKernel {
  static constexpr bool kIsInt8 = cute::is_same_v<ElementAB, int8_t>;
  using ElementAcc = cute::conditional_t<kIsInt8, int32_t, float>;
  using ElementCompute = float;
  // int8 MMAs saturate on overflow instead of wrapping (the K bound in the entry keeps them exact).
  using Operator = cute::conditional_t<kIsInt8, cutlass::arch::OpMultiplyAddSaturate, cutlass::arch::OpMultiplyAdd>;
  using InstructionShape = cutlass::gemm::GemmShape<16, 8, 32>;
  static constexpr int kAlignAB = 16;
  static constexpr int kAlignD = 8;

  using ThreadMap = cutlass::epilogue::threadblock::OutputTileThreadLayout<
      typename Cfg::ThreadblockShape, typename Cfg::WarpShape, ElementD, kAlignD, 1>;

  using Accum = cutlass::epilogue::threadblock::VisitorAccFetch;
  using ScaleA = cutlass::epilogue::threadblock::VisitorColBroadcast<ThreadMap, float,
                                                                      cute::Stride<cute::_1, cute::_0, int64_t>>;
  using ScaleB = cutlass::epilogue::threadblock::VisitorRowBroadcast<ThreadMap, float,
                                                                      cute::Stride<cute::_0, cute::_1, int64_t>>;
  // A null bias pointer reads as zeros.
  using Bias = cutlass::epilogue::threadblock::VisitorRowBroadcast<ThreadMap, ElementD,
                                                                    cute::Stride<cute::_0, cute::_1, int64_t>>;
  using ScaleBTimesAcc = cutlass::epilogue::threadblock::Sm80EVT<
      cutlass::epilogue::threadblock::VisitorCompute<cutlass::multiplies, ElementCompute, ElementCompute,
                                                     cutlass::FloatRoundStyle::round_to_nearest>,
      ScaleB, Accum>;
  using Result = cutlass::epilogue::threadblock::Sm80EVT<
      cutlass::epilogue::threadblock::VisitorCompute<cutlass::multiply_add, ElementD, ElementCompute,
                                                     cutlass::FloatRoundStyle::round_to_nearest>,
      ScaleA, ScaleBTimesAcc, Bias>;
  using StoreD = cutlass::epilogue::threadblock::VisitorAuxStore<
      ThreadMap, ElementD, cutlass::FloatRoundStyle::round_to_nearest, cute::Stride<int64_t, cute::_1, int64_t>>;
  using EpilogueEVT = cutlass::epilogue::threadblock::Sm80EVT<StoreD, Result>;

  using GemmKernel = typename cutlass::gemm::kernel::DefaultGemmWithVisitor<
      ElementAB, cutlass::layout::RowMajor, cutlass::ComplexTransform::kNone, kAlignAB,
      ElementAB, cutlass::layout::ColumnMajor, cutlass::ComplexTransform::kNone, kAlignAB,
      ElementD, cutlass::layout::RowMajor, kAlignD, ElementAcc, ElementCompute,
      cutlass::arch::OpClassTensorOp, ArchTag, typename Cfg::ThreadblockShape, typename Cfg::WarpShape,
      InstructionShape, EpilogueEVT, cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<8>,
      Cfg::kStages, Operator, 1>::GemmKernel;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  static int run(const cw8a8_scaled_mm_args& p, cw8a8_alloc_fn alloc, void* alloc_ctx, char* err,
                 size_t err_len) {
    using cute::_0;
    using cute::_1;
    auto const* bias = static_cast<ElementD const*>(p.bias);
    typename EpilogueEVT::Arguments evt_args{
        {
            {p.scale_a, 0.f, {_1{}, _0{}, p.m}},
            {{p.scale_b, 0.f, {_0{}, _1{}, p.n}}, {}, {}},
            {bias, ElementD(0.f), {_0{}, _1{}, p.n}},
            {},
        },
        {static_cast<ElementD*>(p.d), {p.ldd, _1{}, p.ldd * p.m}},
    };
    typename Gemm::Arguments args(
        cutlass::gemm::GemmUniversalMode::kGemm,
        cutlass::gemm::GemmCoord(static_cast<int>(p.m), static_cast<int>(p.n), static_cast<int>(p.k)),
        1,  // batch count
        evt_args, p.a, p.b, nullptr, nullptr,
        p.lda * p.m, p.ldb * p.n, 0, 0,  // batch strides (one batch)
        p.lda, p.ldb, 0, 0);

    Gemm gemm;
    cutlass::Status st = gemm.can_implement(args);
    if (st != cutlass::Status::kSuccess) {
      std::snprintf(err, err_len, "CUTLASS can_implement: %s", cutlass::cutlassGetStatusString(st));
      return 1;
    }
    const size_t ws_bytes = Gemm::get_workspace_size(args);
    void* ws = nullptr;
    if (ws_bytes > 0 && (ws = alloc(alloc_ctx, ws_bytes)) == nullptr) {
      std::snprintf(err, err_len, "could not allocate a %zu-byte workspace", ws_bytes);
      return 1;
    }
    st = gemm.initialize(args, ws, p.stream);
    if (st == cutlass::Status::kSuccess) st = gemm.run(p.stream);
    cudaError_t ce = cudaGetLastError();
    if (st != cutlass::Status::kSuccess || ce != cudaSuccess) {
      std::snprintf(err, err_len, "CUTLASS run: %s (%s)", cutlass::cutlassGetStatusString(st), cudaGetErrorString(ce));
      return 1;
    }
    return 0;
  }
};

template <class ArchTag, class ElementAB, class ElementD, class Cfg>
int run_scaled_mm(const cw8a8_scaled_mm_args& args, cw8a8_alloc_fn alloc, void* alloc_ctx, char* err,
                  size_t err_len) {
  return ScaledMmKernel<ArchTag, ElementAB, ElementD, Cfg>::run(args, alloc, alloc_ctx, err, err_len);
}

}  // namespace cutlass_w8a8::sm80
