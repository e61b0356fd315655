// Configurations of the sm90 grouped (mixture-of-experts) GEMM, cw8a8_sm90_grouped_mm (gemm/kernel_api.h), and the
// choice among them. Light on purpose: the dispatcher (grouped_sm90.cu) includes it without the kernel templates.
//
// One small table per kernel family (the cw8a8_config_table ids: int8, fp8 row-wise, block-scaled fp8), three
// configs each, named by the bucket of average rows per expert (T / E) they serve:
//   *_Small: <= kSmallRowsPerExpert. Swapped (D^T = B^T A^T): the expert's weight N fills the MMA's M side and the
//            expert's few tokens its N side (32 columns), as the dense decode-sized configs of
//            scaled_mm_sm90_dispatch.cuh do.
//   *_Mid:   <= kMidRowsPerExpert. 64x128 pingpong tiles, one weight pass per 64 tokens of an expert, where the
//            128-row tile would be half empty.
//   *_Large: above. 128x256 cooperative tiles, no cluster: int8 (exact int32 sums) and fp8 row-wise (fast
//            accumulation: 128 accumulator registers a thread) on CUTLASS's mainloop; block fp8 on the wave mainloop
//            with waves 128 wide along N (wave_mainloop.cuh: each warpgroup's 64 x 256 rows in two 64 x 128 waves, so
//            CUTLASS's blockwise sums in half the accumulator registers).
// Accumulation follows the dense tables: int8 accumulates exactly in int32; row-wise fp8 uses fast accumulation
// (csrc/gemm/EPILOGUES.md states its error); block fp8 promotes and scales every 128-deep K block (example 68's
// mainloop). Each (family, output type, config) is compiled in its own file, grouped_<family>_<bucket>_<out>.cu.
// Measured: bench/bench_moe.py, the *_Mid / fp8 *_Large choice on an H200 (2026-11-30, below), then int8's *_Mid /
// *_Large and block fp8's *_Large (2026-11-30, sixteenth session, below).
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>

#include <cutlass/numeric_types.h>

#include "gemm/kernel_api.h"
#include "gemm/sm90/scaled_mm_sm90_config.cuh"

namespace cutlass_w8a8::sm90::grouped {

using S = Schedule;
constexpr S GPP = S::kPingpong;
constexpr S GCO = S::kCooperative;
constexpr Scheduler GPE = Scheduler::kPersistent;

// Average rows per expert up to which the swapped *_Small configs run. Their 32-token tiles re-read the expert's
// weight once per 32 rows, so past ~32 rows per expert they read it twice or more: on an H100 (bench_moe, 59d6a17,
// when this was 64) Mixtral w13 at 64 rows per expert took 748 us against torch's fp8 grouped GEMM's 367 (0.49x),
// Qwen3-30B-A3B w13 at 64 rows 0.70x, both at 32 rows 0.87-1.01x, and 1.09-1.20x at <= 16 rows; the 128-row tile
// (then the only other config) read each weight once per 128 rows (1.06-1.32x at 128 rows per expert).
constexpr int64_t kSmallRowsPerExpert = 16;

// Average rows per expert up to which the *_Mid configs run (above kSmallRowsPerExpert). On an H200 (2026-11-30,
// bench/results/moe_grouped_candidates_nvidia-h200.md: Qwen3-30B-A3B, Mixtral-8x7B and DeepSeek-V3 w13 / w2 at T 512,
// 1024 and 4096, then-shipped tables against the candidates, forced, same run) the 64x128 pingpong tile was the
// fastest or within 2% of it at the 12 fp8 / block points with 32 and 64 rows per expert, 1.04-1.36x the 128x128
// cooperative tile (at 16 rows, DeepSeek-V3 T 512, 1.00-1.05x *_Small, which keeps that point). From 128 rows it was
// slower than the family's *_Large at 18 of the 20 points (0.70-0.97x; block fp8 1.17x at Mixtral w13 and 1.02x at
// DeepSeek-V3 w2, both 128 rows per expert).
constexpr int64_t kMidRowsPerExpert = 64;

// int8 x int8 -> int32. On an H200 (2026-11-30, sixteenth session, bench/results/
// moe_grouped_int8_block_nvidia-h200.md: Qwen3-30B-A3B, Mixtral-8x7B and DeepSeek-V3 w13 / w2 at T 512-8192, every
// entry forced, same run), against the 128x128 cooperative tile then shipped for both buckets: *_Mid (64x128
// pingpong) 1.08-1.35x at the 6 points with 32-64 rows per expert; *_Large (128x256 cooperative) 1.04-1.38x at 15 of
// the 16 points with 128-2048 rows per expert, 0.99x at Mixtral w2 T 4096. Every int8 entry equals every other bit
// for bit (exact sums, one epilogue).
using GInt8_Small = Config<64, 32, 256, 1, 1, GPP, GPE, true>;
using GInt8_Mid = Config<64, 128, 128, 1, 1, GPP, GPE, false>;
using GInt8_Large = Config<128, 256, 128, 1, 1, GCO, GPE, false>;

// fp8 e4m3 row-wise (per-token / per-tensor x per-channel / per-expert scales), fast accumulation. *_Large: the
// 128x256 tile was 1.05-1.39x the 128x128 one at 9 of the 10 points with 128-1024 rows per expert of the run above
// (0.99x at Mixtral w2, 1024 rows).
using GFp8_Small = Config<64, 32, 256, 1, 1, GPP, GPE, true, true>;
using GFp8_Mid = Config<64, 128, 128, 1, 1, GPP, GPE, false, true>;
using GFp8_Large = Config<128, 256, 128, 1, 1, GCO, GPE, false, true>;

// block-scaled fp8 (1x128 activation groups x 128x128 weight blocks): TileK 128, the weight's side a multiple of 128
using GFp8Block_Small = Config<128, 32, 128, 1, 1, GPP, GPE, true>;
using GFp8Block_Mid = Config<64, 128, 128, 1, 1, GPP, GPE, false>;
// *_Large: the wave mainloop's 128x256 tile with waves along N (the dense block table's tile at M in (128, 1024]),
// 1.02-1.35x the 128x128 cooperative tile (CUTLASS's blockwise mainloop, shipped before) at the 16 points with
// 128-2048 rows per expert of the run above; its outputs equal that tile's bit for bit (the same products in the same
// K order, one promotion per 128 of K: tests/gemm/test_grouped_mm_cuda.py).
using GFp8Block_Large = Config<128, 256, 128, 1, 1, GCO, GPE, false, false, 1, true, 128>;

// Tuning candidates (bfloat16 output; built with CUTLASS_W8A8_TUNE=1, or with `grouped` in its list: setup.py
// defines CUTLASS_W8A8_TUNE_GROUPED and compiles instantiations_tune/grouped_*.cu, which generate_instantiations.py
// writes from these tables). They follow a table's shipped entries (indices 3, 4, ...), reached only through the
// tuning op _grouped_scaled_mm_config (bench/bench_moe.py --grouped-configs); select_grouped never picks them.
// Issue 37: the wave mainloop (wave_mainloop.cuh, Config's 11th argument) on the ptr-array collectives, 256x128
// cooperative tiles whose warpgroups hold 128 token rows each in two 64-row waves (128 + 64 accumulator registers), for
// T >= 512 where the experts have >= 128 rows each. Row-wise: CUTLASS's promoted 128x128 cooperative tile (64 + 64
// registers, no waves) is listed too: the bit-for-bit reference of the wave kernel (same products, same K order, one
// promotion per 128 of K), as the shipped row-wise configs use fast accumulation. Each wave tile without a cluster
// and with CTA pairs along M (2x1: the pair's two 256-row tiles of one expert share its weight tile through TMA
// multicast; CUTLASS's group scheduler keeps a cluster's tiles in one group). Every one compiles without spills (nvcc
// 13.0 -Xptxas -v, sm_90a: 168 registers, as the shipped grouped kernels).
// The 128x256 tile with waves along N too (Config's WaveN 128: each warpgroup's 64 x 256 rows in two 64 x 128 waves),
// which the dense block and accurate row-wise tables run at M in (128, 1024] where it fills the SMs (2026-11-30):
// one pass over an expert's weight tile per 128 tokens, half the CTAs of the 128x128 tile. Both compile without spills
// (nvcc 13.0 -Xptxas -v, sm_90a: 168 registers); not timed yet.
// Then (2026-11-30) for the points still below 1.2x torch on an H200 (bench/results/moe_grouped_waves_nvidia-h200.md):
// Qwen3-30B-A3B w2 (E 128, N 2048, K 768) at T 512-1024, 32-64 rows per expert, memory-bound (96 us for 201 MB of
// weights, 2.1 TB/s), fp8 1.13x; Mixtral-8x7B w13 (E 8, N 28672, K 4096, 128-1024 rows per expert, compute-bound)
// block 1.10-1.12x, fp8 1.19x at T 1024; Mixtral w2 block 1.17x. Row-wise with fast accumulation, as the shipped
// row-wise entries (so not bit-comparable with the promoted reference; bench_moe reports n/a), block promoted:
//   swapped 128x64 pingpong: the *_Small layout (weight N on the MMA's M, tokens on its N) with 64 token columns in
//     place of 32, so 64 rows per expert read the weight once; TileM 128 (not *_Small's fp8 64x32x256), as the block
//     kernel needs the weight's side a multiple of 128 and TileK 128: one shape for both families;
//   128x128 with a 2x1 cluster: each weight tile multicast to two token tiles of one expert (compute-bound w13);
//   the 64x128 pingpong and fp8's 128x256 cooperative tiles of the same list are now the shipped *_Mid / fp8 *_Large.
// Each compiles without spills (nvcc 13.0 -Xptxas -v, sm_90a: 168 registers). Timed on an H200
// (bench/results/moe_grouped_candidates_nvidia-h200.md): the swapped 128x64 tile took 0.99-1.03x the 64x128 tile's
// time at 16-32 rows per expert and 1.05-1.50x from 64 rows; the 2x1 clusters ran at 0.57-0.95x the 128x128 tile's
// speed. Fp8's former *_Large (128x128 cooperative, fast accumulation) stays listed for the next A/B.
// int8 (2026-11-30): the 64x128 pingpong and 128x256 cooperative tiles (TileK 128 as the dense int8 configs of these
// tiles: a 128x256x256 stage, 96 KB, would leave room for two) were listed here, timed against the 128x128
// cooperative tile then shipped for *_Mid and *_Large, and are now the shipped *_Mid and *_Large (above); the 128x128
// tile stays listed for the next A/B. Every int8 entry equals the shipped *_Large bit for bit
// (tests/gemm/test_grouped_mm_cuda.py).
// Block fp8's former *_Large (128x128 cooperative, CUTLASS's blockwise mainloop) stays listed likewise: the bit-for-bit
// reference of the wave kernels (bench_moe's reference for row-wise fp8 is its promoted 128x128 candidate above).
// Row-wise fp8 (2026-11-30, sixteenth session): the *_Small and *_Mid tiles with promotion (CUTLASS's accurate fp8
// mainloop, one promotion per 128 of K), so that with the promoted 128x128 and the 128x256 wave-N tiles (0.88-1.12x
// the shipped fast-accumulation dispatch at 128+ rows per expert, bench/results/moe_grouped_int8_block_nvidia-h200.md)
// a whole accurate row-wise grouped table can be timed against the shipped one (issue 37: accurate row-wise fp8 by
// default). Both compile without spills (nvcc 13.0 -Xptxas -v, sm_90a: 168 registers); not timed yet.
using GInt8TuneCandidates = std::tuple<
    Config<128, 128, 128, 1, 1, GCO, GPE, false>>;
using GFp8TuneCandidates = std::tuple<
    Config<128, 128, 128, 1, 1, GCO, GPE, false>,
    Config<256, 128, 128, 1, 1, GCO, GPE, false, false, 1, true>,
    Config<256, 128, 128, 2, 1, GCO, GPE, false, false, 1, true>,
    Config<128, 256, 128, 1, 1, GCO, GPE, false, false, 1, true, 128>,
    Config<128, 64, 128, 1, 1, GPP, GPE, true, true>,
    Config<128, 128, 128, 2, 1, GCO, GPE, false, true>,
    Config<128, 128, 128, 1, 1, GCO, GPE, false, true>,
    Config<64, 32, 256, 1, 1, GPP, GPE, true>,
    Config<64, 128, 128, 1, 1, GPP, GPE, false>>;
using GFp8BlockTuneCandidates = std::tuple<
    Config<256, 128, 128, 1, 1, GCO, GPE, false, false, 1, true>,
    Config<256, 128, 128, 2, 1, GCO, GPE, false, false, 1, true>,
    Config<128, 64, 128, 1, 1, GPP, GPE, true>,
    Config<128, 128, 128, 2, 1, GCO, GPE, false>,
    Config<128, 128, 128, 1, 1, GCO, GPE, false>>;

#ifdef CUTLASS_W8A8_TUNE_GROUPED
constexpr bool kTuneGrouped = true;
#else
constexpr bool kTuneGrouped = false;
#endif

constexpr int kNumGroupedConfigs = 3;  // shipped, in every table; index 0 = *_Small, 1 = *_Mid, 2 = *_Large

// One grouped table: its operand type, scaling, shipped configs and tuning candidates (compiled when kTuneGrouped).
template <class ElementAB_, bool kBlock_, class Small_, class Mid_, class Large_, class Candidates_>
struct GroupedTable {
  using ElementAB = ElementAB_;
  static constexpr bool kBlock = kBlock_;
  using Shipped = std::tuple<Small_, Mid_, Large_>;
  using Candidates = Candidates_;
  static constexpr int kCandidates = static_cast<int>(std::tuple_size_v<Candidates>);
  static constexpr int kSize = kNumGroupedConfigs + (kTuneGrouped ? kCandidates : 0);
};

// Calls f(Table{}) for a cw8a8_config_table id (int8, fp8 row-wise, block-scaled fp8); -1 for another id.
template <class F>
int visit_grouped_table(int table, F&& f) {
  switch (table) {
    case CW8A8_TABLE_INT8:
      return f(GroupedTable<int8_t, false, GInt8_Small, GInt8_Mid, GInt8_Large, GInt8TuneCandidates>{});
    case CW8A8_TABLE_FP8:
      return f(GroupedTable<cutlass::float_e4m3_t, false, GFp8_Small, GFp8_Mid, GFp8_Large, GFp8TuneCandidates>{});
    case CW8A8_TABLE_FP8_BLOCK:
      return f(GroupedTable<cutlass::float_e4m3_t, true, GFp8Block_Small, GFp8Block_Mid, GFp8Block_Large,
                            GFp8BlockTuneCandidates>{});
    default:
      return -1;
  }
}

// Entries of grouped table `table` in this build (0 for an unknown table).
inline int grouped_num_configs(int table) {
  const int n = visit_grouped_table(table, [](auto tb) { return decltype(tb)::kSize; });
  return n < 0 ? 0 : n;
}

namespace detail {
template <class Tuple, size_t... I>
const std::string* grouped_names(std::index_sequence<I...>) {
  static const std::string names[] = {config_name<std::tuple_element_t<I, Tuple>>()...};
  return names;
}
}  // namespace detail

// Name of entry i of grouped table `table` (scaled_mm_sm90_config.cuh's config_name), nullptr past the end.
inline const char* grouped_config_name(int table, int i) {
  if (i < 0 || i >= grouped_num_configs(table)) return nullptr;
  const std::string* name = nullptr;
  visit_grouped_table(table, [&](auto tb) {
    using Tb = decltype(tb);
    if (i < kNumGroupedConfigs) {
      name = &detail::grouped_names<typename Tb::Shipped>(std::make_index_sequence<kNumGroupedConfigs>{})[i];
    } else if constexpr (Tb::kCandidates > 0) {
      name = &detail::grouped_names<typename Tb::Candidates>(
          std::make_index_sequence<Tb::kCandidates>{})[i - kNumGroupedConfigs];
    }
    return 0;
  });
  return name != nullptr ? name->c_str() : nullptr;
}

// By the average rows per expert (T / E): index 0 (*_Small) up to kSmallRowsPerExpert, 1 (*_Mid) up to
// kMidRowsPerExpert, else 2 (*_Large).
inline int select_grouped(int64_t t, int64_t n, int64_t num_experts) {
  (void)n;
  const int64_t e = num_experts > 0 ? num_experts : 1;
  return t <= kSmallRowsPerExpert * e ? 0 : (t <= kMidRowsPerExpert * e ? 1 : 2);
}

// Defined in grouped_sm90.cuh, instantiated one (ElementAB, ElementD, Config, block) per file. Returns 0 or writes
// an error message. kBlock: the block-scaled fp8 kernel (ElementAB is then cutlass::float_e4m3_t).
template <class ElementAB, class ElementD, class Cfg, bool kBlock>
int run_grouped_mm(const cw8a8_grouped_mm_args& args, cw8a8_alloc_fn alloc, void* alloc_ctx, char* err,
                   size_t err_len);

}  // namespace cutlass_w8a8::sm90::grouped
