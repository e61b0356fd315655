// The sm90 fp8 mainloop with waves of one WGMMA atom (64 rows, and with kAtomN 64 x kAtomN): CUTLASS's own fp8 mainloop
// collective with only its consumer side (`mma`) and its TiledMma's atom replaced, so that a consumer warpgroup keeps
// ONE one-atom temporary accumulator instead of a second copy of its whole tile.
//
// Derived from (everything but `mma` and, with kAtomN, `TiledMma` is theirs: load / load_auxiliary, pipelines,
// shared-memory layouts, Arguments, Params, to_underlying_arguments, can_implement, mma_tail):
//   - block-scaled fp8: CUTLASS 4.2's CollectiveMma<MainloopSm90TmaGmmaWarpSpecializedBlockwiseFP8, ...>
//     (cutlass/gemm/collective/sm90_mma_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp), the
//     CollectiveBuilder's CollectiveOp for the KernelTmaWarpSpecialized{Cooperative,Pingpong}FP8Blockwise schedules;
//   - row-wise fp8 with promotion: CollectiveMma<MainloopSm90TmaGmmaWarpSpecializedFP8, ...>
//     (sm90_mma_tma_gmma_ss_warpspecialized_fp8.hpp), the CollectiveOp for KernelTmaWarpSpecialized{Cooperative,
//     Pingpong} (not FP8FastAccum) on e4m3 operands;
//   - the grouped (ptr-array) forms of both, the CollectiveOps for KernelPtrArrayTmaWarpSpecialized{Cooperative,
//     Pingpong}[FP8Blockwise]: MainloopSm90ArrayTmaGmmaWarpSpecializedBlockwise
//     (sm90_mma_array_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp) and
//     MainloopSm90ArrayTmaGmmaWarpSpecializedFP8 (sm90_mma_array_tma_gmma_ss_warpspecialized_fp8.hpp). Their `mma` is
//     the dense one's, statement for statement (CUTLASS 4.2; the blockwise one also guards k_tile_count == 0, which the
//     loop below never enters), with the same signature, members (TensorStorage, SmemLayoutSFA / SFB, ScaleMsPerTile,
//     ScalePromotionInterval) and stage protocol; the per-group work (tensormap updates for the next group's A / B
//     pointers, the scale pointers' layouts) is all on the producer side (tensormaps_*, load, load_auxiliary) and in
//     the kernel, so the consumer below serves them unchanged.
// Method: DeepGEMM's two-level accumulation (github.com/deepseek-ai/DeepGEMM, sm90 fp8 GEMM: WGMMA over one 128-deep K
// block into a temporary, then FFMA into the float32 accumulator with both scales), whose 256-row tiles let each math
// warpgroup reuse one WGMMA accumulator over its 64-row waves. Written here with CuTe primitives; no code copied.
//
// Why: CUTLASS's two mainloops hold a temporary accumulator of the SAME shape as the main one (GmmaFP8Accumulation,
// fp8_accumulation.hpp), so a consumer warpgroup's 128 x 128 rows (256 x 128 cooperative, 128 x 128 pingpong) need
// 128 + 128 float registers per thread and spill (and CUTLASS 4.2 refuses a blockwise 128 x 256 tile: "Accumulator and
// scaleB must have same shape"). Here each k tile (TileK = 128, one scale per k tile) runs per wave w, one atom of the
// warpgroup's (MMA_M, MMA_N) atoms in M-major order: 64 rows each, and the tile's N wide (MMA_N = 1) unless kAtomN
// narrows the atom to 64 x kAtomN (MMA_N = TileN / kAtomN; a wave then never straddles two scale blocks along N):
//
//   temp  = sum over the 4 k blocks (K 32 each, in order) of A[rows of w] x B   (WGMMA, ScaleOut::Zero on block 0)
//   wait for the WGMMAs
//   block:    main[w] += temp * scale    scale = scale_a(row, k tile) * scale_b(n block, k tile), combined and
//                                        applied exactly as GmmaFP8Accumulation::scale does in CUTLASS's collective
//                                        on its tiles with one scale along a side (with scales varying along both
//                                        sides: temp * (scale_a * scale_b), below)
//   row-wise: main[w] += temp            (GmmaFP8Accumulation::promote_core; the scales stay in the epilogue)
//
// so 128 x 128 rows per warpgroup (or 64 x 256 in two 64 x 128 waves) take 128 (main) + 64 (temp) registers. With
// scales on both sides varying within the tile (kAtomN waves of a block tile) the wave's one weight-side scale is
// combined with the token-side ones first, temp * (scale_a * scale_b): the expression GmmaFP8Accumulation uses when one
// side has a single scale per tile, so the same bits as every other block tile. While one warpgroup promotes (FFMA),
// the other's WGMMAs keep the tensor cores busy (cooperative: two warpgroups on one tile; pingpong: the other
// warpgroup is in its epilogue or its own mainloop).
//
// Result: the same products in the same K order, one promotion per k tile, the same float32 expressions as CUTLASS's
// collective on its one-scale-per-side tiles (TileK 128: its promotion interval of 4 MMAs is one k tile, so it never
// has a residue), so each element depends only on its own row of A, column of B and scales: not on M, the tile shape or
// the number of waves. The main accumulator starts from zero (clear), where CUTLASS's collective adds into the kernel's
// uninitialized fragment.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/collective_builder.hpp>

namespace cutlass_w8a8::sm90 {

namespace wave_detail {

// Entry `i` of mode `Mode` of a warpgroup's (MMA, MMA_M, MMA_N, ...) tensor (the accumulator or scale fragments, or
// the A / B operands' descriptors): that mode narrowed to the size-1 mode of entry i, the rank kept, as cute::gemm
// dispatches on it ((V,M) x (V,N) => (V,M,N)). `i` is a cute::Int: the register offsets are static.
template <int Mode, class TensorT, class I>
CUTLASS_DEVICE auto atom_slice(TensorT&& t, I i) {
  using namespace cute;
  auto const& l = t.layout();
  return make_tensor(t.data() + layout<Mode>(l)(i),
                     make_layout(replace<Mode>(l.shape(), _1{}), replace<Mode>(l.stride(), _0{})));
}

// Wave (m, n) of an (MMA, MMA_M, MMA_N) tensor: one 64 x atom-N block of the warpgroup's rows.
template <class TensorT, class M, class N>
CUTLASS_DEVICE auto wave_rows(TensorT&& t, M m, N n) {
  return atom_slice<2>(atom_slice<1>(t, m), n);
}

// The collective's TiledMma with its WGMMA atom narrowed to N = AtomN (the same operand types, majors and warpgroup
// layout): the tile's N is then covered by TileN / AtomN atoms (MMA_N), each one wave of the consumer below.
template <class TiledMmaT, int AtomN, class TileShape, class = void>
struct NarrowTiledMma {
  using type = TiledMmaT;  // AtomN 0: the collective's own
};
template <class Atom, class AtomLayout, class Permutation, int AtomN, class TileShape>
struct NarrowTiledMma<cute::TiledMMA<Atom, AtomLayout, Permutation>, AtomN, TileShape, cute::enable_if_t<AtomN != 0>> {
  using Op = decltype(cute::GMMA::ss_op_selector<
                      typename Atom::ValTypeA, typename Atom::ValTypeB, typename Atom::ValTypeC,
                      cute::Shape<cute::_64, cute::Int<AtomN>, cute::tuple_element_t<2, TileShape>>,
                      cute::GMMA::Major::K, cute::GMMA::Major::K>());
  using type = cute::TiledMMA<cute::MMA_Atom<Op>, AtomLayout, Permutation>;
};

}  // namespace wave_detail

// `Base`: the CollectiveBuilder's CollectiveOp (MainloopSm90TmaGmmaWarpSpecializedBlockwiseFP8 when kBlockScaled, else
// MainloopSm90TmaGmmaWarpSpecializedFP8). GemmUniversal calls `collective_mainloop.mma(...)` on the CollectiveMainloop
// type it is given, so this `mma` hides the base's; everything else is inherited unchanged.
// `kAtomN` (0: the base's atom, the tile's N): the WGMMA atom's N, so that waves run along N too (TileN / kAtomN of
// them per 64 rows). GemmUniversal builds the accumulators and the epilogue's partition from `TiledMma`, which this
// type redefines; the base's producer side never reads it (its shared memory holds the same element types).
template <class Base, bool kBlockScaled, int kAtomN = 0>
struct WaveMainloop : Base {
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::Params;
  using typename Base::TileShape;
  using TiledMma = typename wave_detail::NarrowTiledMma<typename Base::TiledMma, kAtomN, TileShape>::type;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::ElementAccumulator;

  static_assert(cute::size<2>(TileShape{}) == 128,
                "the wave mainloop promotes once per k tile: TileK must be 128 (one block scale, CUTLASS's promotion "
                "interval of 4 MMAs of K 32)");
  static_assert(cute::size<2>(TileShape{}) / cute::tile_size<2>(TiledMma{}) == 4, "4 MMAs of K 32 per k tile");

  // Consumer side: the k tiles of one work tile, `accum` ((MMA, MMA_M, MMA_N) per thread, MMA_M x MMA_N waves of one
  // 64 x atom-N atom each) zeroed and then accumulated. Stage protocol as the base's (the kernel calls the base's
  // mma_tail after this): every stage but the last is released here, the last one by mma_tail.
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum, int k_tile_count,
                          int thread_idx, TensorStorage& shared_tensors, Params const& mainloop_params) {
    using namespace cute;
    (void)mainloop_params;
    if constexpr (kBlockScaled) {
      using ElementBlockScale = typename Base::ElementBlockScale;
      using SmemLayoutSFA = typename Base::SmemLayoutSFA;
      using SmemLayoutSFB = typename Base::SmemLayoutSFB;
      constexpr int kScaleMsPerTile = Base::ScaleMsPerTile;
      constexpr int kScaleNsPerTile = Base::ScaleNsPerTile;
      static_assert(Base::ScalePromotionInterval == 4, "one promotion per k tile (ScaleGranularityK 128)");

      // The scale factors' shared memory seen as (BLK_M, BLK_N, (BLK_K, PIPE)), broadcast along the other side, and
      // partitioned as the accumulators are: the base collective's views.
      Tensor sSFA = make_tensor(make_smem_ptr(shared_tensors.smem_SFA.data()),
                                make_layout(make_shape(get<0>(shape(SmemLayoutSFA{})), get<1>(TileShape{}),
                                                       make_shape(get<1>(shape(SmemLayoutSFA{})),
                                                                  get<2>(shape(SmemLayoutSFA{})))),
                                            make_stride(get<0>(stride(SmemLayoutSFA{})), _0{},
                                                        make_stride(get<1>(stride(SmemLayoutSFA{})),
                                                                    get<2>(stride(SmemLayoutSFA{}))))));
      Tensor sSFB = make_tensor(make_smem_ptr(shared_tensors.smem_SFB.data()),
                                make_layout(make_shape(get<0>(TileShape{}), get<0>(shape(SmemLayoutSFB{})),
                                                       make_shape(get<1>(shape(SmemLayoutSFB{})),
                                                                  get<2>(shape(SmemLayoutSFB{})))),
                                            make_stride(_0{}, get<0>(stride(SmemLayoutSFB{})),
                                                        make_stride(get<1>(stride(SmemLayoutSFB{})),
                                                                    get<2>(stride(SmemLayoutSFB{}))))));
      TiledMma tiled_mma;
      Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA);  // (MMA, MMA_M, MMA_N, (MMA_K, PIPE))
      Tensor tCsSFB = tiled_mma.get_slice(thread_idx).partition_C(sSFB);
      Tensor tCrSFA = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));  // (MMA, MMA_M, MMA_N)
      Tensor tCrSFB = make_tensor_like<ElementBlockScale>(tCsSFB(_, _, _, _0{}));
      CUTE_STATIC_ASSERT_V(shape(tCrSFA) == shape(accum));  // scale fragments and accumulators: the same shape
      CUTE_STATIC_ASSERT_V(shape(tCrSFB) == shape(accum));

      // The k tile's scales into registers and combined, as CUTLASS's collective combines them: one side's product
      // taken once per k tile when the other side has a single scale in the tile.
      auto load_scales = [&](int read_stage) {
        copy(tCsSFA(_, _, _, make_coord(_0{}, read_stage)), tCrSFA);
        copy(tCsSFB(_, _, _, make_coord(_0{}, read_stage)), tCrSFB);
        if constexpr (kScaleMsPerTile == 1 && kScaleNsPerTile == 1) {
          tCrSFA(_0{}) = tCrSFA(_0{}) * tCrSFB(_0{});
        }
        if constexpr (kScaleMsPerTile > 1 && kScaleNsPerTile == 1) {
          ElementBlockScale scale_b = tCrSFB(_0{});
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(filter_zeros(tCrSFA)); i++) {
            filter_zeros(tCrSFA)(i) = filter_zeros(tCrSFA)(i) * scale_b;
          }
        }
        if constexpr (kScaleMsPerTile == 1 && kScaleNsPerTile > 1) {
          ElementBlockScale scale_a = tCrSFA(_0{});
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(filter_zeros(tCrSFB)); i++) {
            filter_zeros(tCrSFB)(i) = filter_zeros(tCrSFB)(i) * scale_a;
          }
        }
      };
      // A wave's columns share one weight-side scale when its atom is at most one scale block wide.
      constexpr int kGranularityN = int(cute::size<1>(TileShape{})) / kScaleNsPerTile;
      constexpr int kWaveN = int(cute::tile_size<1>(TiledMma{}));
      static_assert(!(kScaleMsPerTile > 1 && kScaleNsPerTile > 1) || kGranularityN % kWaveN == 0,
                    "a wave must not straddle two scale blocks along N (promote takes one column-side scale a wave)");
      // main[wave] += temp * scale: GmmaFP8Accumulation::scale_core's expressions, on the wave's rows and columns.
      // With several scales along both sides (waves along N), the wave's one column-side scale is combined with the
      // row-side ones first, temp * (scale_a * scale_b), as load_scales combines them for the one-column-scale tiles:
      // the same float32 expression, so the same bits as those tiles.
      auto promote = [&](auto& main_w, auto const& temp, auto m, auto n) {
        if constexpr (kScaleMsPerTile == 1 && kScaleNsPerTile == 1) {
          ElementAccumulator const scale_ab = tCrSFA(_0{});
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(main_w); ++i) main_w(i) += temp(i) * scale_ab;
        } else if constexpr (kScaleMsPerTile > 1 && kScaleNsPerTile == 1) {
          auto sfa_w = wave_detail::wave_rows(tCrSFA, m, n);
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(main_w); ++i) main_w(i) += temp(i) * sfa_w(i);
        } else if constexpr (kScaleMsPerTile == 1 && kScaleNsPerTile > 1) {
          auto sfb_w = wave_detail::wave_rows(tCrSFB, m, n);
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(main_w); ++i) main_w(i) += temp(i) * sfb_w(i);
        } else {
          auto sfa_w = wave_detail::wave_rows(tCrSFA, m, n);
          ElementBlockScale const scale_b = wave_detail::wave_rows(tCrSFB, m, n)(_0{});
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(main_w); ++i) main_w(i) += temp(i) * (sfa_w(i) * scale_b);
        }
      };
      mma_waves(pipeline, smem_pipe_read, accum, k_tile_count, thread_idx, shared_tensors, load_scales, promote);
    } else {
      // Row-wise: a plain add (GmmaFP8Accumulation::promote_core); the per-token / per-channel scales are the
      // epilogue's.
      auto promote = [](auto& main_w, auto const& temp, auto, auto) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(main_w); ++i) main_w(i) += temp(i);
      };
      mma_waves(pipeline, smem_pipe_read, accum, k_tile_count, thread_idx, shared_tensors, [](int) {}, promote);
    }
  }

 private:
  // The pipelined k loop shared by both forms: per k tile, per wave, the WGMMAs into the one temporary, a wait, then
  // `promote(main_w, temp, m, n)` (main_w: the wave's atom of the accumulator). `load_scales(stage)` runs while the
  // first wave's WGMMAs are in flight (the stage is released only after it).
  template <class FrgTensorC, class LoadScales, class Promote>
  CUTLASS_DEVICE void mma_waves(MainloopPipeline& pipeline, PipelineState& smem_pipe_read, FrgTensorC& accum,
                                int k_tile_count, int thread_idx, TensorStorage& shared_tensors,
                                LoadScales&& load_scales, Promote&& promote) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "C tensor must be rmem resident.");
    static_assert(rank(SmemLayoutA{}) == 3 && rank(SmemLayoutB{}) == 3, "Smem layout must be rank 3.");

    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (BLK_M, BLK_K, PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (BLK_N, BLK_K, PIPE)

    constexpr int kMmaWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    Layout warp_group_thread_layout = make_layout(Int<kMmaWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    int warp_group_idx = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(warp_group_thread_layout(warp_group_idx));
    Tensor tCsA = thread_mma.partition_A(sA);           // (MMA, MMA_M, MMA_K, PIPE)
    Tensor tCsB = thread_mma.partition_B(sB);           // (MMA, MMA_N, MMA_K, PIPE)
    Tensor tCrA = thread_mma.make_fragment_A(tCsA);     // descriptors
    Tensor tCrB = thread_mma.make_fragment_B(tCsB);
    CUTE_STATIC_ASSERT_V(size<1>(tCsA) == size<1>(accum));  // M atoms: the waves along M
    CUTE_STATIC_ASSERT_V(size<1>(tCsB) == size<2>(accum));  // N atoms: the waves along N (1 unless kAtomN)
    CUTE_STATIC_ASSERT_V(size<2>(tCsA) == size<2>(tCsB));   // K blocks
    constexpr int kWavesM = decltype(size<1>(accum))::value;
    constexpr int kWavesN = decltype(size<2>(accum))::value;
    constexpr int kWaves = kWavesM * kWavesN;
    constexpr int kKBlocks = decltype(size<2>(tCrA))::value;

    // One wave's temporary accumulator: (MMA, _1, _1), 64 rows x atom N / 128 threads = atom N / 2 registers.
    Tensor temp = make_fragment_like(wave_detail::wave_rows(accum, _0{}, _0{}));
    clear(accum);

    auto barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.consumer_wait(smem_pipe_read, barrier_token);
      int read_stage = smem_pipe_read.index();
      for_each(make_int_sequence<kWaves>{}, [&](auto w) {
        auto m = Int<decltype(w)::value / kWavesN>{};  // waves in M-major order (one wave per M atom: as before)
        auto n = Int<decltype(w)::value % kWavesN>{};
        warpgroup_fence_operand(temp);
        warpgroup_arrive();
        tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
        CUTLASS_PRAGMA_UNROLL
        for (int k_block = 0; k_block < kKBlocks; ++k_block) {
          // (V, 1) x (V, 1) => (V, 1, 1): the wave's 64 rows and atom-N columns, the k block's 32 of K, in CUTLASS's
          // order
          cute::gemm(tiled_mma, wave_detail::atom_slice<1>(tCrA(_, _, k_block, read_stage), m),
                     wave_detail::atom_slice<1>(tCrB(_, _, k_block, read_stage), n), temp);
          tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
        if constexpr (decltype(w)::value == 0) {
          load_scales(read_stage);
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(temp);
        if constexpr (decltype(w)::value == kWaves - 1) {
          // The stage's operands and scales are consumed: hand it back to the producer (all but the work tile's last
          // stage, which the base's mma_tail releases), and look at the next one before promoting.
          if (k_tile_count > 1) {
            pipeline.consumer_release(smem_pipe_read);
          }
          ++smem_pipe_read;
          barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
        }
        auto main_w = wave_detail::wave_rows(accum, m, n);
        promote(main_w, temp, m, n);
      });
    }
    warpgroup_fence_operand(accum);
  }
};

}  // namespace cutlass_w8a8::sm90
