// sm90 scaled_mm configurations and the choice among them by problem shape: int8, fp8 (per-tensor / per-token /
// per-channel scales) and block-scaled fp8, one table each.
//
// Every shipped config has a name by the bucket it serves (`Int8_M32`: M in [1, 32]) and is compiled once per
// output type, one file each under instantiations/ named after it (`int8_M32_bf16.cu`, written by
// generate_instantiations.py from the headers: rerun it after editing a table). The tables list those names;
// their order is a runtime contract: a table index is what select_int8 / select_fp8 / select_fp8_block return,
// what the private op cutlass_w8a8::_scaled_mm_config forces (bench/tune_sm90.py; the table is the one of its
// arguments, kernel_api.h cw8a8_config_table_of) and what a CUDA-graph record stores. Index
// i < size(shipped) names shipped entry i; the tuning candidates follow, compiled (bfloat16 output only, one
// file each under instantiations_tune/ named by kernel) when the package is built with CUTLASS_W8A8_TUNE=1, or
// with the table named in it (CUTLASS_W8A8_TUNE=fp8-block: only the block table's; then the other tables'
// candidate indices are refused with an error naming the setting).
//
// Reading a config: Config<TileM, TileN, TileK, ClusterM, ClusterN, schedule, tile scheduler, swap A/B
// [, fp8 fast accumulation [, scheduler swizzle [, wave mainloop [, wave N]]]]>, in the kernel's own frame: with the
// swap, the kernel's M is the weight's N and its N is the tokens.
#pragma once

#include <cstdint>
#include <tuple>

#include "gemm/sm90/scaled_mm_sm90_config.cuh"

namespace cutlass_w8a8::sm90 {

using S = Schedule;
using T = Scheduler;
constexpr S PP = S::kPingpong;
constexpr S CO = S::kCooperative;
constexpr T PE = T::kPersistent;

// The tables below were chosen by bench/tune_sm90.py on an H200 (bench/results/tune_nvidia-h200_*.md, the
// 2026-11-21 sweep, whose configs' replays are interleaved so that all run under the same clocks): each
// bucket's config is the one with the best geomean time over the eight Llama-3 8B/70B shapes at that M,
// refined by N and K where a shipped config won on the large shapes by 4% or more.

// ---- int8 x int8 -> int32 ------------------------------------------------------------------------------

// M in [1, 32]: decode. Swapped, so the weight's N fills the 64-row MMA and the tokens its N (16); the GEMM
// streams the weight, and deep K tiles keep many bytes in flight per SM. Within 3% of the best swapped tile at
// every M <= 32 (128-row cooperative and stream-K variants tie or lose).
using Int8_M32 = Config<64, 16, 256, 1, 1, PP, PE, true>;
// M in (32, 64]: the same with 32 token columns.
using Int8_M64 = Config<64, 32, 256, 1, 1, PP, PE, true>;
// M in (64, 128]: 64 token columns; K 128 beats K 256 here (more stages in flight).
using Int8_M128 = Config<64, 64, 128, 1, 1, PP, PE, true>;
// M > 128 when Int8_MLarge's tiles would leave much of their last wave idle (select_int8): unswapped, tokens
// on a 64-row MMA tile, twice as many CTAs as Int8_MLarge.
using Int8_MLarge_FewTiles = Config<64, 128, 128, 1, 1, PP, PE, false>;
// M > 128 otherwise: the 128x128 pingpong tile, pairs of CTAs sharing B through TMA multicast. Within 2.3% of
// the per-point best in geomean at every M >= 512; the 128x256 cooperative tile that the earlier sweep kept
// for M >= 4096 on the largest shapes measured 0-7% slower here.
using Int8_MLarge = Config<128, 128, 128, 2, 1, PP, PE, false>;

// Table indices 0..4, in this order (see the top of this file).
using Int8Configs = std::tuple<Int8_M32, Int8_M64, Int8_M128, Int8_MLarge_FewTiles, Int8_MLarge>;

// Share of the CTA slots of the last wave that `tiles` persistent work tiles keep busy on `sms` SMs (1: the
// tiles fill whole waves).
inline double wave_fill(int64_t tiles, int sms) {
  const int64_t waves = (tiles + sms - 1) / sms;
  return waves > 0 ? static_cast<double>(tiles) / static_cast<double>(waves * sms) : 1.0;
}

// The int8 table's choice, and the block-scaled table's for M <= 128 (they share their buckets): M in [1, 32], (32, 64]
// and (64, 128] to M32, M64 and M128; M > 128 to `Large` (128 x 128 tiles in clusters of two CTAs, along M when
// `pairs_along_m`, else along N: the cluster pads that side's tiles to pairs) unless `FewTiles` (64 x 128 tiles, no
// cluster: twice the tiles) fills its last wave better by more than 0.05 on `sm_count` SMs (0: unknown, taken as an
// H100's / H200's 132). Returns the index of the chosen config in `Table`.
template <class M32, class M64, class M128, class FewTiles, class Large, class Table>
int select_by_m_and_wave_fill(int64_t m, int64_t n, int sm_count, bool pairs_along_m) {
  if (m <= 32) return index_of<M32, Table>;
  if (m <= 64) return index_of<M64, Table>;
  if (m <= 128) return index_of<M128, Table>;
  const int64_t tiles_n = (n + 127) / 128;
  const int64_t tiles_m_large = (m + 127) / 128;
  const int sms = sm_count > 0 ? sm_count : 132;
  const double fill_few = wave_fill(((m + 63) / 64) * tiles_n, sms);
  const double fill_large = pairs_along_m ? wave_fill((tiles_m_large + 1) / 2 * 2 * tiles_n, sms)
                                          : wave_fill(tiles_m_large * ((tiles_n + 1) / 2 * 2), sms);
  return fill_few > fill_large + 0.05 ? index_of<FewTiles, Table> : index_of<Large, Table>;
}

// For M > 128, Int8_MLarge (128x128 tiles) unless Int8_MLarge_FewTiles (64x128, twice the tiles) fills its
// waves better by more than 0.05. In the sweep this picks the faster of the two at every one of its 48 points
// with M > 128 (8B qkv at M = 512: 21.4 vs 24.4 us; 8B o at M = 256: 10.5 vs 14.7 us; 70B o at M = 256: 27.7
// vs 28.9 us), where the rule it replaces (64x128 for M <= 256 unless N * K >= 2^27) lost up to 14% at 4 of
// them. Returns an index into Int8Configs.
inline int select_int8(int64_t m, int64_t n, int64_t k, int sm_count) {
  (void)k;
  return select_by_m_and_wave_fill<Int8_M32, Int8_M64, Int8_M128, Int8_MLarge_FewTiles, Int8_MLarge, Int8Configs>(
      m, n, sm_count, /*pairs_along_m=*/true);
}

// ---- fp8 e4m3 x e4m3 -> fp32 ---------------------------------------------------------------------------
// The fast-accumulation rows (fp8_fast_accum = 1, today's default: cutlass_w8a8/ops/_limits.py FP8_FAST_ACCUM); the
// accurate rows follow them. Fast accumulation: in the sweep it beat the configs that promote the
// tensor cores' partial sums into float32 every 4 MMAs by 5-30% at every M (those need TileK = 128 and twice
// the accumulator registers). vLLM's sm90 fp8 kernels make the same choice. The error it allows is stated
// in csrc/gemm/EPILOGUES.md and tested in tests/gemm/test_scaled_mm_cuda.py.

// M in [1, 16]
using Fp8_M16 = Config<64, 16, 256, 1, 1, PP, PE, true, true>;
// M in (16, 64]
using Fp8_M64 = Config<64, 32, 256, 1, 1, PP, PE, true, true>;
// M in (64, 128]
using Fp8_M128 = Config<64, 64, 256, 1, 1, PP, PE, true, true>;
// M > 128 (but Fp8_MLarge_KBig's bucket): 128x128 pingpong, cluster 2x1; within 1.4% of the per-point best in
// geomean at every M in (128, 2048].
using Fp8_MLarge = Config<128, 128, 128, 2, 1, PP, PE, false, true>;
// M >= 2048 with K >= 8192: 128x256 cooperative, cluster 2x1. At M = 4096 and 8192 it beat Fp8_MLarge on every
// K >= 8192 shape, by 3-13% (70B down at M = 8192: 2623 vs 2955 us), and tied or won (by up to 6.6%) at
// M = 2048; on the K = 4096 shapes it lost up to 6%, so those keep Fp8_MLarge.
using Fp8_MLarge_KBig = Config<128, 256, 128, 2, 1, CO, PE, false, true>;

// The accurate rows (issue 37; scaled_mm's fp8_fast_accum=False, cw8a8_scaled_mm_args.fp8_fast_accum = 0): the tensor
// cores' partial sums promoted into float32 once per 128 of K (TileK 128), the same products in the same K order in
// every config. Each bucket's config is the promoted one with the best geomean over the eight Llama-3 shapes in the
// H200 sweeps (bench/results/tune_nvidia-h200_fp8.md's promoted candidates, tune_nvidia-h200_fp8_promotion.md,
// tune_nvidia-h200_fp8_waves.md); the small-M rows are provisional until the wave candidates below are timed.
// M in [1, 16]: 1.100x the per-point best (fast accumulation included) at M = 16.
using Fp8_M16_Accurate = Config<128, 16, 128, 1, 1, CO, PE, true>;
// M in (16, 64]: 1.187x in geomean over M = 32 and 64.
using Fp8_M64_Accurate = Config<128, 32, 128, 1, 1, CO, PE, true>;
// M in (64, 128]: 1.156x at M = 128.
using Fp8_M128_Accurate = Config<128, 64, 128, 1, 1, CO, PE, true>;
// M in (128, 256]: 1.143x at M = 256 (tune_nvidia-h200_fp8_promotion.md).
using Fp8_M256_Accurate = Config<128, 128, 128, 1, 1, CO, PE, true>;
// M in (256, 1024): 1.22x at M = 512 (64 + 64 registers per consumer thread; the promoted 128x128 pingpong tile
// spills and ran 4.4x).
using Fp8_M1024_Accurate = Config<128, 128, 128, 1, 2, CO, PE, false>;
// M >= 1024: 256x128 cooperative with the wave mainloop (wave_mainloop.cuh), bit-identical to CUTLASS's promoted
// kernels; 1.087x (M = 1024) and 1.045x (M = 4096) the fast-accumulation configs' time on the Llama-3-70B shapes
// (tune_nvidia-h200_fp8_waves.md), where the best CUTLASS promoted config took 1.24-1.26x.
using Fp8_MLarge_Accurate = Config<256, 128, 128, 2, 1, CO, PE, false, false, 1, true>;

// M in (128, 1024) where waves_n_fill_ok (select_fp8, issue 37): 128x256 cooperative with the wave mainloop's waves
// along N too (WaveN 128: each warpgroup's 64 x 256 rows in two 64 x 128 waves, 128 + 64 registers), one token tile of
// 128 rows over N / 256 CTAs. Bit-identical to the promoted 128x128 rows (32 of 32 points of the sweep).
using Fp8_MMid_Accurate_WavesN = Config<128, 256, 128, 1, 1, CO, PE, false, false, 1, true, 128>;

// Table indices 0..11, in this order (see the top of this file): the fast-accumulation rows, then the accurate ones.
using Fp8Configs = std::tuple<Fp8_M16, Fp8_M64, Fp8_M128, Fp8_MLarge, Fp8_MLarge_KBig, Fp8_M16_Accurate,
                              Fp8_M64_Accurate, Fp8_M128_Accurate, Fp8_M256_Accurate, Fp8_M1024_Accurate,
                              Fp8_MLarge_Accurate, Fp8_MMid_Accurate_WavesN>;

// Rows of a tile that the busiest SM computes when `tiles_m` x `tiles_n` persistent tiles of `tile_m` rows run on
// `sms` SMs, the N tiles padded to pairs when `pairs_along_n` (a 1x2 cluster): rounds of tiles times their rows.
inline int64_t busiest_sm_rows(int64_t tiles_m, int64_t tiles_n, int64_t tile_m, int sms, bool pairs_along_n = true) {
  const int64_t tiles = tiles_m * (pairs_along_n ? (tiles_n + 1) / 2 * 2 : tiles_n);
  return (tiles + sms - 1) / sms * tile_m;
}

// The 128x256 wave tiles (Fp8Block_MMid_WavesN, Fp8_MMid_Accurate_WavesN) when their busiest SM computes no more of the
// output than the 128x128 1x2 tile's busiest SM (rounds of tiles times tile area; N tiles padded to pairs with a 1x2
// cluster), give or take `slack_pct` percent: then one pass over the weight with half the CTAs won at every such point
// of the H200 sweeps at M > 128 (bench/results/tune_nvidia-h200_fp8-block_waves_n.md: block fp8 0.806-0.994 of the
// shipped time at 18 of 18 points with M 256-1024, 1.035-1.106 at 2 of 4 at M = 128; row-wise accurate 0.849-0.963 at 6
// of 6 with M 256-512; tune_nvidia-h200_fp8-block_waves_n_mlarge.md: 0.909-0.974 at 20 of 20 points with M 2048 / 4096,
// 5 of them at 1.01-1.02x the area). Where it leaves the busiest SM 1.14-2x the area it lost (1.03-2.32x, or to the
// 128x128 tile by 7-19%), but for M = 2048, N = 7168, K = 16384 (1.14x: 0.981, the fastest tile there); at 1.04x (N =
// 51200, M = 1024) it took 0.975, at 1.08x (M = 512) 1.001.
inline bool waves_n_fill_ok(int64_t m, int64_t n, int sms, bool pairs_along_n, int slack_pct = 0) {
  constexpr int64_t kTileM = 128, kWideN = 256, kNarrowN = 128;
  const int64_t tiles_m = (m + kTileM - 1) / kTileM;
  const int64_t wide_n = (n + kWideN - 1) / kWideN;
  const int64_t wide_rows = busiest_sm_rows(tiles_m, wide_n, kTileM, sms, pairs_along_n);
  const int64_t narrow_rows = busiest_sm_rows(tiles_m, (n + kNarrowN - 1) / kNarrowN, kTileM, sms);
  // the busiest SM's output elements
  return wide_rows * kWideN * 100 <= narrow_rows * kNarrowN * (100 + slack_pct);
}

// Returns an index into Fp8Configs: among the fast-accumulation rows when `fast_accum`, else the accurate ones
// (M in (128, 1024): Fp8_MMid_Accurate_WavesN where waves_n_fill_ok).
inline int select_fp8(int64_t m, int64_t n, int64_t k, int sm_count, bool fast_accum) {
  if (!fast_accum) {
    if (m <= 16) return index_of<Fp8_M16_Accurate, Fp8Configs>;
    if (m <= 64) return index_of<Fp8_M64_Accurate, Fp8Configs>;
    if (m <= 128) return index_of<Fp8_M128_Accurate, Fp8Configs>;
    if (m < 1024 && waves_n_fill_ok(m, n, sm_count > 0 ? sm_count : 132, /*pairs_along_n=*/false)) {
      return index_of<Fp8_MMid_Accurate_WavesN, Fp8Configs>;
    }
    if (m <= 256) return index_of<Fp8_M256_Accurate, Fp8Configs>;
    if (m < 1024) return index_of<Fp8_M1024_Accurate, Fp8Configs>;
    return index_of<Fp8_MLarge_Accurate, Fp8Configs>;
  }
  if (m <= 16) return index_of<Fp8_M16, Fp8Configs>;
  if (m <= 64) return index_of<Fp8_M64, Fp8Configs>;
  if (m <= 128) return index_of<Fp8_M128, Fp8Configs>;
  if (m >= 2048 && k >= 8192) return index_of<Fp8_MLarge_KBig, Fp8Configs>;
  return index_of<Fp8_MLarge, Fp8Configs>;
}

// ---- block-scaled fp8: e4m3 x e4m3, 1x128 activation groups x 128x128 weight blocks ---------------------
// Its own table (kernel_api.h: CW8A8_TABLE_FP8_BLOCK), run by scaled_mm_sm90_blockwise.cuh, chosen by measurement
// (below).
// Constraints: TileK is 128 (one scale per K tile); the weight's side of a tile must be a multiple of 128 (its
// scale granularity), so the swapped configs have TileM = 128, twice the row-wise small-M configs' 64, and half as
// many CTAs at a given N (N = 4096: 32 weight tiles). They rely on deep pipelines instead: TileK 128 keeps a stage
// at 16 KiB of weight plus the token tile, so ~12 stages (~200 KiB) are in flight per SM. Pingpong unless noted:
// the cooperative kernel cannot be launched with PDL (scaled_mm_sm90_blockwise.cuh, kPdlSafe), and the small-M
// buckets are the ones that launch with it. No fast accumulation exists for this mainloop.

// Measured on an H200 (bench/tune_sm90.py --dtypes fp8-block, 2026-11-27: bench/results/tune_nvidia-h200_fp8-block.md,
// the 13 DeepSeek-V3 / Qwen3 shapes at M = 16 .. 8192, configs' replays interleaved); each bucket names its evidence.

// M in [1, 32] (M <= decode_gemm_max_m() goes to the decode GEMM unless it is off or an UpdatableGraph records):
// swapped, the weight's N on a 128-row tile and the tokens on a 16-column tile; one pass over the weight, 16 + 16
// accumulators per thread. Best at 13 of 13 shapes at M = 16 and at 11 of 13 at M = 32 (geomean 0.926 of the
// 32-column tile's time there: twice the CTAs).
using Fp8Block_M32 = Config<128, 16, 128, 1, 1, PP, PE, true>;
// M in (32, 64]: the same with 32 token columns (best at 11 of 13 at M = 64).
using Fp8Block_M64 = Config<128, 32, 128, 1, 1, PP, PE, true>;
// M in (64, 128], and M > 128 when its busiest SM has far fewer rows to compute than Fp8Block_MLarge's
// (select_fp8_block, block_few_tiles_pay): unswapped, tokens on a 64-row tile, weight on a 128-column tile (one
// consumer warpgroup per tile, 64 + 64 accumulators per thread). At M = 128: 0.852 of the swapped 128x64 tile's time in
// geomean (no shape slower), which the first table shipped.
using Fp8Block_M128 = Config<64, 128, 128, 1, 1, PP, PE, false>;
// M > 128 otherwise: 128x128 cooperative (two warpgroups split the 128 token rows: 64 + 64 accumulators each, the
// most the blockwise mainloop's second accumulator set leaves room for; a 128x128 pingpong tile spills), pairs of
// CTAs along N sharing the token tile through TMA multicast (CUTLASS example 67's cluster). The H200 sweep preferred
// no cluster by 2-8% at M >= 512 (geomean 0.923 at M = 1024, 0.980 at 8192), but on the H100 the no-cluster tile
// then ran 8% (M = 4096) and 13% (M = 8192) slower in geomean over the same shapes (bench/results/
// gemm_block_table1_6025f1a_* against gemm_block_table2_b6fde77_*, two H100 runs), so the cluster stays: neither
// GPU loses more than 2-8% with it. Launched without PDL (the cooperative blockwise kernel's scale loads do not wait on
// griddepcontrol; M > 16 launches without it anyway, except while an UpdatableGraph records).
using Fp8Block_MLarge = Config<128, 128, 128, 1, 2, CO, PE, false>;
// M >= 1024 when Fp8Block_MMid_WavesN does not fill the SMs and its busiest SM has at most 1.05x Fp8Block_MLarge's rows
// to compute (select_fp8_block): 256x128 cooperative with the wave mainloop (wave_mainloop.cuh: each warpgroup's 128
// token rows in two 64-row waves through one temporary accumulator, 128 + 64 registers, no spills), pairs of CTAs along
// N sharing the token tile as Fp8Block_MLarge's. Bit-identical to Fp8Block_MLarge (and to every block config) at all 15
// points of the H200 sweep (bench/results/tune_nvidia-h200_fp8-block_waves.md, 2026-11-29, DeepSeek-V3 shapes at M =
// 256 / 1024 / 4096). Where the rule of 2026-11-29 picked it (all 5 shapes at M = 1024, 4 of 5 at M = 4096) it took
// 0.818-0.958 of the shipped time (geomean 0.901 at M = 1024, 0.941 at M = 4096 over those 4); where it did not, it
// lost: 1.163x at M = 4096, N = 2112 (3 rounds of 256 rows per SM against 5 of 128: 1.2x the work) and 1.03-2.46x at
// every M = 256 point. Cluster 1x2 rather than the sweep's best-by-1% 1x1 (geomean 0.890 vs 0.901 at M = 1024, 0.986 vs
// 0.982 at 4096): the H100 ran Fp8Block_MLarge's tile 8-13% slower without its cluster (above). Launched without PDL
// (cooperative).
using Fp8Block_MLarge_Waves = Config<256, 128, 128, 1, 2, CO, PE, false, false, 1, true>;

// Fp8Block_MMid_WavesN: M > 128 where waves_n_fill_ok (with 5% slack; select_fp8_block, issue 37);
// Fp8Block_M128_WavesN: not selected (slower everywhere in the sweep: 1.02-1.90x the shipped time at M 128-1024). 256
// weight columns per tile, the tile CUTLASS 4.2's blockwise collective refuses ("Accumulator and scaleB must have same
// shape"), with the wave mainloop's waves along N too (WaveN 128: each warpgroup's 64 x 256 rows in two 64 x 128 waves,
// each one 128-column scale block; 128 + 64 registers, no spills). One pass over the weight with half the CTAs of the
// 128x128 tile; pairs along N share the token tile (Fp8Block_MLarge's cluster). Bit-identical to every block config (52
// of 52 points of the sweep).
using Fp8Block_MMid_WavesN = Config<128, 256, 128, 1, 2, CO, PE, false, false, 1, true, 128>;
using Fp8Block_M128_WavesN = Config<64, 256, 128, 1, 1, PP, PE, false, false, 1, true, 128>;

// Table indices 0..6, in this order (see the top of this file).
using Fp8BlockConfigs = std::tuple<Fp8Block_M32, Fp8Block_M64, Fp8Block_M128, Fp8Block_MLarge, Fp8Block_MLarge_Waves,
                                   Fp8Block_MMid_WavesN, Fp8Block_M128_WavesN>;

// Fp8Block_M128 (64x128 tiles, no cluster) over Fp8Block_MLarge (128x128, 1x2) at M > 128 when its busiest SM has at
// most 1/1.4 of the rows to compute: per row, the one-warpgroup 64-row tile took 1.27-1.56x the 128-row tile's time in
// the H200 sweeps (M 256-2048, where the two tiles' busiest SMs had 0.5 and 0.83-0.93 of each other's rows). Over the
// 143 points of the three block sweeps with M > 128 this rule picks the slower of the two at 4, by at most 3.3%; the
// wave-fill rule it replaces (select_by_m_and_wave_fill, still the int8 table's) picked it at 20, by up to 25% (M =
// 2048, N = 2112: 5 rounds of 64 rows against 3 of 128).
inline bool block_few_tiles_pay(int64_t m, int64_t n, int sms) {
  const int64_t tiles_n = (n + 127) / 128;
  const int64_t few_rows = busiest_sm_rows((m + 63) / 64, tiles_n, 64, sms, /*pairs_along_n=*/false);
  const int64_t large_rows = busiest_sm_rows((m + 127) / 128, tiles_n, 128, sms);
  constexpr int64_t kFewRowCostTenths = 14, kLargeRowCostTenths = 10;  // 1.4x per row
  return few_rows * kFewRowCostTenths <= large_rows * kLargeRowCostTenths;
}

// Returns an index into Fp8BlockConfigs. M <= 128: by M (select_by_m_and_wave_fill's buckets). M > 128:
// Fp8Block_MMid_WavesN where waves_n_fill_ok with 5% slack (issue 37; measured at M 256-4096). Else at M >= 1024
// Fp8Block_MLarge_Waves unless its 256-row tiles leave the busiest SM more than 1.05x the rows of Fp8Block_MLarge's
// 128-row tiles (at equal rows it took 0.94-0.96 of the shipped time in the sweep; 1.02x rows still won at 0.948-0.958,
// 1.2x lost at 1.163). Else Fp8Block_M128 where block_few_tiles_pay, Fp8Block_MLarge otherwise. Over the 65 points of
// the two waves-along-N sweeps with M > 128 (every shipped block tile timed), it is within 1.9% of the fastest of the
// four at every point (geomean 1.0000 at M 256-512, 1.0003 at 1024, 1.0007 at 2048-4096), where the rule it replaces
// lost up to 25% (geomean 1.011, 1.020, 1.060).
inline int select_fp8_block(int64_t m, int64_t n, int64_t k, int sm_count) {
  (void)k;
  const int sms = sm_count > 0 ? sm_count : 132;
  if (m <= 128) {
    return select_by_m_and_wave_fill<Fp8Block_M32, Fp8Block_M64, Fp8Block_M128, Fp8Block_M128, Fp8Block_MLarge,
                                     Fp8BlockConfigs>(m, n, sm_count, /*pairs_along_m=*/false);
  }
  if (waves_n_fill_ok(m, n, sms, /*pairs_along_n=*/true, /*slack_pct=*/5)) {
    return index_of<Fp8Block_MMid_WavesN, Fp8BlockConfigs>;
  }
  if (m >= 1024) {
    const int64_t tiles_n = (n + 127) / 128;
    const int64_t waves_rows = busiest_sm_rows((m + 255) / 256, tiles_n, 256, sms);
    const int64_t large_rows = busiest_sm_rows((m + 127) / 128, tiles_n, 128, sms);
    if (waves_rows * 100 <= large_rows * 105) return index_of<Fp8Block_MLarge_Waves, Fp8BlockConfigs>;
  }
  return block_few_tiles_pay(m, n, sms) ? index_of<Fp8Block_M128, Fp8BlockConfigs>
                                        : index_of<Fp8Block_MLarge, Fp8BlockConfigs>;
}

// ---- tuning candidates (bfloat16 output; built with CUTLASS_W8A8_TUNE=1, or =int8,fp8,fp8-block: some tables) --
// Everything the sweep measures besides the shipped configs. No stream-K: CUTLASS 4.2's sm90 stream-K
// scheduler does not compile with CUTLASS_ENABLE_GDC_FOR_SM90, which PDL needs (its const is_last_tile
// binds a member to a non-const reference, sm90_tile_scheduler_stream_k.hpp:337). Its candidates (six int8,
// two fp8, all cooperative) were best at only 5 of 192 points of the earlier sweep: 3 int8 points at M >=
// 4096 by under 1%, 2 fp8 points with promotion, which no shipped fp8 config uses (git history of
// bench/results/tune_nvidia-h200_*.md).

using Int8TuneCandidates = std::tuple<
    Config<64, 16, 128, 1, 1, PP, PE, true>,
    Config<128, 16, 256, 1, 1, CO, PE, true>,
    Config<64, 16, 256, 2, 1, PP, PE, true>,
    Config<64, 32, 128, 1, 1, PP, PE, true>,
    Config<128, 32, 256, 1, 1, CO, PE, true>,
    Config<64, 64, 256, 1, 1, PP, PE, true>,
    Config<128, 64, 128, 1, 1, CO, PE, true>,
    Config<128, 128, 128, 1, 1, CO, PE, true>,
    Config<64, 128, 256, 1, 1, PP, PE, false>,
    Config<64, 256, 128, 1, 1, PP, PE, false>,
    Config<128, 128, 128, 2, 1, CO, PE, false>,
    Config<128, 128, 128, 1, 2, PP, PE, false>,
    Config<128, 256, 128, 1, 2, CO, PE, false>,
    Config<256, 128, 128, 2, 1, CO, PE, false>,
    Config<256, 128, 128, 1, 2, CO, PE, false>,
    Config<128, 256, 128, 2, 1, CO, PE, false>>;

using Fp8TuneCandidates = std::tuple<
    // with promotion to float32 every 4 MMAs (TileK 128)
    Config<64, 16, 128, 1, 1, PP, PE, true>,
    Config<64, 32, 128, 1, 1, PP, PE, true>,
    Config<64, 64, 128, 1, 1, PP, PE, true>,
    Config<64, 128, 128, 1, 1, PP, PE, false>,
    Config<128, 128, 128, 2, 1, PP, PE, false>,
    // (the swapped 128x16 / 128x32 / 128x64 / 128x128 and the 128x128 1x2 cooperative tiles are shipped: the
    // Fp8_*_Accurate rows)
    Config<128, 128, 128, 2, 1, CO, PE, false>,
    Config<128, 128, 128, 1, 2, PP, PE, false>,
    Config<128, 256, 128, 2, 1, CO, PE, false>,
    // fast accumulation
    Config<128, 128, 128, 2, 1, CO, PE, false, true>,
    Config<256, 128, 128, 2, 1, CO, PE, false, true>,
    // with promotion every 128 of K by the wave mainloop (wave_mainloop.cuh: 64-row waves share one temporary
    // accumulator, so 128 rows per warpgroup fit): the fast-accumulation 256x128 (shipped: Fp8_MLarge_Accurate) and
    // the shipped 128x128 tiles. Both compile without spills (nvcc 13.0 -Xptxas -v, sm_90a), where CUTLASS's promoted
    // 256x128 cooperative 2x1 tile spills 848 bytes.
    Config<128, 128, 128, 2, 1, PP, PE, false, false, 1, true>,
    // Accurate candidates for M <= 512 (issue 37: for the accurate rows of Fp8Configs, select_fp8), the wave mainloop
    // with one 64-row wave per cooperative warpgroup (64 + 64 registers, as CUTLASS's promoted cooperative tiles, which
    // do not spill either): the 128x128 tile with and without CTA pairs along M, the 128x64 tile (twice the CTAs at M
    // <= 512), and the swapped 128x128 tile (the weight's N on the MMA's M), the twin of the best promoted config
    // measured at M = 256 (swap_128x128x128_c1x1_cooperative_persistent, 1.143x the per-point best:
    // bench/results/tune_nvidia-h200_fp8_promotion.md). Not timed yet; each compiles without spills (nvcc 13.0 -Xptxas
    // -v, sm_90a: 168 registers).
    Config<128, 128, 128, 1, 1, CO, PE, false, false, 1, true>,
    Config<128, 128, 128, 2, 1, CO, PE, false, false, 1, true>,
    Config<128, 64, 128, 2, 1, CO, PE, false, false, 1, true>,
    Config<128, 128, 128, 1, 1, CO, PE, true, false, 1, true>,
    // Waves along N as well (Config's WaveN, issue 37): 256 columns per tile in two 64 x 128 waves per warpgroup (128 +
    // 64 registers): 64x256 pingpong (the 128x256 cooperative form ships as Fp8_MMid_Accurate_WavesN). Compiled without
    // spills (nvcc 13.0 -Xptxas -v, sm_90a), not timed yet. The 128x256 cooperative form in clusters (the shipped one
    // has none): pairs along M sharing the weight tile, as the fast-accumulation 128x256 2x1 tile that ran 4-7% faster
    // than the accurate 1x1 one at M 1024-4096 (tune_nvidia-h200_fp8_accurate_mlarge.md, where the 1x1 form tied the
    // shipped 256x128 wave tile), and pairs along N sharing the token tile. Not timed yet; both compile without spills
    // (nvcc 13.0 sm_90a, 168 registers).
    Config<64, 256, 128, 1, 1, PP, PE, false, false, 1, true, 128>,
    Config<128, 256, 128, 2, 1, CO, PE, false, false, 1, true, 128>,
    Config<128, 256, 128, 1, 2, CO, PE, false, false, 1, true, 128>>;

// Block-scaled candidates (TileK 128, the weight's side a multiple of 128, no fast accumulation), chosen after the
// first H100 run (M >= 256 at 0.73-0.95x torch's cuBLASLt blockwise GEMM). Each consumer warpgroup holds its
// accumulator twice (the running float32 sum and the current K block's tensor-core partials): 64x128 per warpgroup
// is 64 + 64 registers per thread, and every config below compiles without spills (nvcc 13.0 -Xptxas -v, sm_90a).
// 128x128 per warpgroup would need 256 of the 240 a consumer thread gets: the 128x128 pingpong and 256x128
// cooperative tiles spill (576 / 572 bytes) with CUTLASS's mainloop, and CUTLASS 4.2 refuses a 128x256 one
// ("Accumulator and scaleB must have same shape", fp8_accumulation.hpp). Those tiles are listed with the wave mainloop
// only (Config's last argument, wave_mainloop.cuh: one 64-row temporary per warpgroup, 128 + 64 registers). Swizzle
// variants run the kernel of the config they vary (one compile; a shipped kernel's variants are compiled in its file).
using Fp8BlockTuneCandidates = std::tuple<
    // M >= 256, unswapped: the cooperative 128x128 tile without a cluster, with 2x1 (CTA pairs along M share the
    // weight tile: the weight is the larger operand whenever M < N), and the shipped 1x2 with L2 swizzles
    Config<128, 128, 128, 1, 1, CO, PE, false>,
    Config<128, 128, 128, 2, 1, CO, PE, false>,
    Config<128, 128, 128, 2, 1, CO, PE, false, false, 8>,
    Config<128, 128, 128, 1, 2, CO, PE, false, false, 4>,
    Config<128, 128, 128, 1, 2, CO, PE, false, false, 8>,
    // the 64x128 pingpong tile (one warpgroup per tile, epilogue overlapped) in clusters, and swizzled
    Config<64, 128, 128, 2, 1, PP, PE, false>,
    Config<64, 128, 128, 1, 2, PP, PE, false>,
    Config<64, 128, 128, 1, 1, PP, PE, false, false, 8>,
    // M in (64, 256], swapped: 128 weight rows split over two warpgroups (64 + 64 registers at 128 token columns)
    Config<128, 64, 128, 1, 1, CO, PE, true>,
    Config<128, 64, 128, 1, 1, PP, PE, true>,
    Config<128, 128, 128, 1, 1, CO, PE, true>,
    // M >= 256, unswapped, the wave mainloop: 128 token rows per warpgroup in two waves of 64 (128 + 64 registers;
    // each compiles without spills, nvcc 13.0 -Xptxas -v). 256x128 cooperative (no cluster; pairs along M sharing the
    // weight tile; pairs along N sharing the token tile: shipped, Fp8Block_MLarge_Waves) and 128x128 pingpong (no
    // cluster; pairs along M).
    Config<256, 128, 128, 1, 1, CO, PE, false, false, 1, true>,
    Config<256, 128, 128, 2, 1, CO, PE, false, false, 1, true>,
    Config<128, 128, 128, 1, 1, PP, PE, false, false, 1, true>,
    Config<128, 128, 128, 2, 1, PP, PE, false, false, 1, true>,
    // Waves along N as well (Config's WaveN, issue 37): 256 weight columns per tile (the tile CUTLASS 4.2's collective
    // refuses) in two 64 x 128 waves per warpgroup, each wave one 128-column scale block: 128x256 cooperative (no
    // cluster; pairs along N sharing the token tile) and 64x256 pingpong, for M in (64, 1024), where the 128-wide
    // tiles give the SMs 1.9-3.9 tiles each at N 7168-32768 (M 128) and each weight tile is read by every token tile.
    // (The 1x2 cooperative and the 64x256 pingpong forms are in the shipped table: Fp8Block_*_WavesN.) Not compiled
    // here (its 1x2 twin is, without spills), not timed yet. And the 128x256 tile in pairs along M sharing the weight
    // tile (32 KiB a stage, twice the token tile's): for M >= 1024, where the shipped 1x2 form runs (2026-11-30) and
    // the fast-accumulation row-wise 128x256 tile, in 2x1 pairs, ran 4-7% faster than the accurate 1x1 one
    // (tune_nvidia-h200_fp8_accurate_mlarge.md). Not timed yet; compiles without spills (nvcc 13.0 sm_90a, 168
    // registers).
    Config<128, 256, 128, 1, 1, CO, PE, false, false, 1, true, 128>,
    Config<128, 256, 128, 2, 1, CO, PE, false, false, 1, true, 128>>;

template <class Tuple>
constexpr int size_of() {
  return static_cast<int>(std::tuple_size_v<Tuple>);
}

}  // namespace cutlass_w8a8::sm90
