// How the sm90 kernels apply the scales, once for the dense row-wise kernel (scaled_mm_sm90.cuh), the block-scaled
// one (scaled_mm_sm90_blockwise.cuh) and the grouped ones (grouped/grouped_sm90.cuh). csrc/gemm/EPILOGUES.md writes
// out the math.
//
//   ScaleEpilogue     the epilogue visitor trees (EVT), built from CUTLASS's own nodes (Sm90AccFetch,
//                     Sm90RowBroadcast / Sm90ColBroadcast, Sm90Compute, Sm90EVT), their arguments, and the
//                     collective epilogue that runs one (CUTLASS's CollectiveBuilder: D stored by TMA, no source C):
//                       RowwiseEVT  D = scale_tok * (scale_ch * float(acc)) + bias, rounded once to ElementD
//                       BlockEVT    D = acc + bias, rounded once (the block scales were applied in the mainloop)
//   BlockScaleLayout  the blockwise mainloop's K-major scale factors (cutlass::detail::Sm90BlockwiseScaleConfig):
//                     granularity 1 on the tokens' side, limits::kBlockSize (128) on the weight's side and along K
//
// Everything is in the kernel's own frame. Without the swap its rows are the tokens (A's M) and its columns the
// channels (B's N); with it (kSwapAB: D^T = B^T A^T) its rows are the channels and its columns the tokens. A value
// per row is a column broadcast (Sm90ColBroadcast), a value per column a row broadcast (Sm90RowBroadcast).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>

#include "core/limits.hpp"

namespace cutlass_w8a8::sm90 {

// kPtrArray: the grouped kernels' array-of-pointers broadcasts (CUTLASS's ptr-array form: element type T*, one
// pointer per group); the arguments then take `T const* const*` where the dense kernels take `T const*`.
template <class TileShape, class ElementD, bool kSwapAB, bool kPtrArray = false>
struct ScaleEpilogue {
  using ElementCompute = float;
  template <class T>
  using Input = cute::conditional_t<kPtrArray, T*, T>;

  // D: row-major, or column-major in the swapped frame (D^T stored column-major is D row-major); 16-byte TMA rows.
  using LayoutD = cute::conditional_t<kSwapAB, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;

  // A float32 vector broadcast along the kernel's rows (one value per column) or columns (one value per row). The
  // bool stride selects at run time between a vector (true) and a single scalar (false), so per-tensor and
  // per-token / per-channel scales share one kernel.
  using RowVector = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, Input<float>, ElementCompute,
                                                                cute::Stride<cute::_0, bool, cute::_0>>;
  using ColVector = cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, Input<float>, ElementCompute,
                                                                cute::Stride<bool, cute::_0, cute::_0>>;
  // Bias: one value per channel in the output type, or a null pointer for no bias (reads as zero).
  using BiasRow = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, Input<ElementD>, ElementCompute,
                                                              cute::Stride<cute::_0, cute::_1, cute::_0>>;
  using BiasCol = cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, Input<ElementD>, ElementCompute,
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
  using RowwiseEVT = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::multiply_add, ElementD, ElementCompute,
                                             cutlass::FloatRoundStyle::round_to_nearest>,
      ScaleTokens, ScaleChTimesAcc, Bias>;
  // D = acc + bias, rounded once to ElementD.
  using BlockEVT = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, ElementD, ElementCompute,
                                             cutlass::FloatRoundStyle::round_to_nearest>,
      Acc, Bias>;

  // The collective epilogue running `EVT` on accumulators of ElementAcc under the kernel's epilogue `Schedule` (the
  // ptr-array kernels take a layout pointer: one D stride per group).
  template <class ClusterShape, class ElementAcc, class Schedule, class EVT>
  using Collective = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementCompute, void, Input<LayoutD>, kAlignD,
      ElementD, Input<LayoutD>, kAlignD, Schedule, EVT>::CollectiveOp;

  using ScalePtr = typename RowVector::PtrRowType;  // float const* (dense) or float const* const* (ptr-array)
  using BiasPtr = typename BiasRow::PtrRowType;     // ElementD const* or ElementD const* const*

  // Arguments of a float32 broadcast: a vector (is_vector != 0: one value per row or column) or a single scalar.
  template <class Bcast>
  static typename Bcast::Arguments vector_args(ScalePtr ptr, int is_vector) {
    if constexpr (cute::is_same_v<Bcast, RowVector>) {
      return {ptr, 0.f, {cute::_0{}, is_vector != 0, cute::_0{}}};
    } else {
      return {ptr, 0.f, {is_vector != 0, cute::_0{}, cute::_0{}}};
    }
  }

  static typename Bias::Arguments bias_args(BiasPtr bias) { return {bias, ElementD(0.f), {}}; }

  // scale_tok: the tokens' scales (scale_a), per token when tok_vector; scale_ch: the channels' (scale_b), per
  // channel when ch_vector; bias: null for none. Whatever the swap: the frame is resolved here.
  static typename RowwiseEVT::Arguments rowwise_args(ScalePtr scale_tok, int tok_vector, ScalePtr scale_ch,
                                                     int ch_vector, BiasPtr bias) {
    return {
        vector_args<ScaleTokens>(scale_tok, tok_vector),
        {vector_args<ScaleChannels>(scale_ch, ch_vector), {}, {}},
        bias_args(bias),
        {},
    };
  }

  static typename BlockEVT::Arguments block_args(BiasPtr bias) {
    return {
        {},               // acc
        bias_args(bias),  // bias
        {},               // plus
    };
  }
};

// The blockwise mainloop's scale factors: K-major, element (row block i, k block kb) at i * KB + kb, i.e. the
// row-major [M, KB] and [ceil(N / 128), KB] tensors as given, with no transpose and no padding of M. CUTLASS copies
// them into shared memory with cp.async, one 4-byte element per thread, predicated on the tensor's bounds (a
// partial last tile reads nothing past the end).
template <class TileShape, bool kSwapAB>
struct BlockScaleLayout {
  static constexpr int kBlock = static_cast<int>(limits::kBlockSize);  // 128: the scale block along K and N
  // Scale granularity along the kernel's rows and columns: 1 on the tokens' side, kBlock on the weight's.
  static constexpr int kGranM = kSwapAB ? kBlock : 1;
  static constexpr int kGranN = kSwapAB ? 1 : kBlock;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<kGranM, kGranN, kBlock, cute::GMMA::Major::K,
                                                                  cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  // CUTLASS requires each granularity to divide its tile dimension, and the mainloop reads one scale per K tile:
  // TileK must be 128 and the weight's side of the tile (TileM swapped, TileN unswapped) a multiple of 128.
  static constexpr bool kTileK = cute::size<2>(TileShape{}) == kBlock;
  static constexpr bool kTileWeightSide =
      kSwapAB ? cute::size<0>(TileShape{}) % kBlock == 0 : cute::size<1>(TileShape{}) % kBlock == 0;
};

}  // namespace cutlass_w8a8::sm90
