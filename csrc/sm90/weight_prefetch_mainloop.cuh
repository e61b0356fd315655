// A CUTLASS sm90 TMA mainloop that also prefetches the weight into L2 at kernel start, for the swapped
// (decode) configs.
//
// Why: at small M the GEMM streams the weight, and the kernel is latency-bound before it is bandwidth-bound
// (ncu, 8B o_proj at M = 1: 64 CTAs, 38% of DRAM bandwidth). The TMA pipeline keeps only `Stages` k-tiles
// in flight per CTA. An L2 prefetch of the CTA's first weight tile puts many more bytes in flight at once.
// And with PDL (scaled_mm_entry.cu), the CTAs start while the previous kernel (typically the activation
// quantization) is still running: CUTLASS's kernels call the mainloop's load_init in every thread before
// the producer warp's griddepcontrol.wait (sm90_gemm_tma_warpspecialized_{pingpong,cooperative}.hpp), so a
// prefetch issued there overlaps the weight's DRAM traffic with the previous kernel.
//
// Why it is safe before griddepcontrol.wait: a prefetch only moves lines into L2, and L2 is the GPU's point
// of coherence, so a line prefetched while the previous kernel still writes it cannot be read stale. The
// GEMM's own TMA loads, which feed the MMAs, still come after the wait.
//
// Which tile: with a 1x1 cluster, the persistent scheduler (sm90_tile_scheduler.hpp) gives CTA b its
// first tile at linear index b, and when the kernel's N (the tokens, in the swapped frame) fits one tile,
// linear index b is row tile b whatever the raster order. Other cases skip the prefetch; a wrong guess
// would only cost bandwidth, never correctness.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

namespace cutlass_w8a8::sm90 {

template <class Base>
struct WeightPrefetchMainloop : Base {
  using TileShape = typename Base::TileShape;
  static_assert(cute::size(typename Base::DispatchPolicy::ClusterShape{}) == 1,
                "the first-tile mapping above assumes a 1x1 cluster");

  struct Arguments : Base::Arguments {
    // L2 bytes the whole grid may prefetch (0: none); each CTA takes an equal share, in k-tiles of its
    // first weight tile, at least one.
    uint32_t prefetch_bytes = 0;
  };
  struct Params : Base::Params {
    uint32_t prefetch_bytes = 0;
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                                  void* workspace) {
    return {Base::to_underlying_arguments(problem_shape, args, workspace), args.prefetch_bytes};
  }

  // Thread 128 is the first thread of the first consumer warpgroup, which has nothing to do until the
  // first k-tile lands; the producer warp (threads 0-31) is left to start its loads without delay.
  static constexpr int kPrefetchThread = 128;

  template <class ProblemShapeMNKL>
  CUTLASS_DEVICE auto load_init(ProblemShapeMNKL const& problem_shape_mnkl, Params const& params) const {
    auto inputs = Base::load_init(problem_shape_mnkl, params);
    if (params.prefetch_bytes != 0 && static_cast<int>(threadIdx.x) == kPrefetchThread) {
      prefetch_first_tile(cute::get<0>(inputs), cute::get<1>(problem_shape_mnkl), params);
    }
    return inputs;
  }

 private:
  // gA_mkl: the kernel's A (the weight, in the swapped frame) tiled as (BLK_M, BLK_K, m, k, l).
  template <class TensorA>
  CUTLASS_DEVICE static void prefetch_first_tile(TensorA const& gA_mkl, int n, Params const& params) {
    constexpr int kTileN = cute::size<1>(TileShape{});
    if (n > kTileN) return;  // more than one column of tiles: the first-tile mapping does not hold
    // One of gridDim.x, gridDim.y is 1 for a 1x1 cluster (tile_scheduler_params.h, get_grid_shape).
    const uint32_t cta = blockIdx.x + blockIdx.y * gridDim.x;
    const uint32_t ctas = gridDim.x * gridDim.y;
    const int tiles_m = static_cast<int>(cute::size<2>(gA_mkl));
    const int k_tiles = static_cast<int>(cute::size<3>(gA_mkl));
    if (cta >= static_cast<uint32_t>(tiles_m)) return;
    constexpr uint32_t kTileBytes = cute::size<0>(TileShape{}) * cute::size<2>(TileShape{}) *
                                    cutlass::sizeof_bits<typename Base::ElementA>::value / 8;
    const uint32_t active = ctas < static_cast<uint32_t>(tiles_m) ? ctas : static_cast<uint32_t>(tiles_m);
    uint32_t k_pf = params.prefetch_bytes / (active * kTileBytes);
    k_pf = k_pf < 1 ? 1 : k_pf;
    k_pf = k_pf > static_cast<uint32_t>(k_tiles) ? static_cast<uint32_t>(k_tiles) : k_pf;

    auto block_tma = params.tma_load_a.get_slice(0);
    cute::Tensor tAgA = block_tma.partition_S(gA_mkl(cute::_, cute::_, cta, cute::_, 0));  // (TMA,TMA_M,TMA_K,k)
    for (uint32_t k = 0; k < k_pf; ++k) {
      cute::prefetch(params.tma_load_a, tAgA(cute::_, cute::_, cute::_, k));
    }
  }
};

}  // namespace cutlass_w8a8::sm90
