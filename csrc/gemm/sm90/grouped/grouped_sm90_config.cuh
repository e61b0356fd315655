// Configurations of the sm90 grouped (mixture-of-experts) GEMM, cw8a8_sm90_grouped_mm (gemm/kernel_api.h), and the
// choice among them. Light on purpose: the dispatcher (grouped_sm90.cu) includes it without the kernel templates.
//
// One small table per kernel family (the cw8a8_config_table ids: int8, fp8 row-wise, block-scaled fp8), two
// configs each, named by the bucket they serve:
//   *_Small: rows per expert (T / E on average) <= kSmallRowsPerExpert. Swapped (D^T = B^T A^T): the expert's
//            weight N fills the MMA's M side and the expert's few tokens its N side (32 columns), as the dense
//            decode-sized configs of scaled_mm_sm90_dispatch.cuh do.
//   *_Large: otherwise. Unswapped 128x128 cooperative tiles (the tile of CUTLASS examples 57 / 68), no cluster.
// Accumulation follows the dense tables: int8 accumulates exactly in int32; row-wise fp8 uses fast accumulation
// (csrc/gemm/EPILOGUES.md states its error); block fp8 promotes and scales every 128-deep K block (example 68's
// mainloop). Each (family, output type, config) is compiled in its own file, grouped_<family>_<bucket>_<out>.cu.
// Not tuned yet: the configs are first choices to be measured (bench/bench_moe.py).
#pragma once

#include <cstdint>
#include <tuple>

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
// Qwen3-30B-A3B w13 at 64 rows 0.70x, both at 32 rows 0.87-1.01x, and 1.09-1.20x at <= 16 rows; the *_Large 128-row
// tile reads each weight once per 128 rows (1.06-1.32x at 128 rows per expert).
constexpr int64_t kSmallRowsPerExpert = 16;

// int8 x int8 -> int32
using GInt8_Small = Config<64, 32, 256, 1, 1, GPP, GPE, true>;
using GInt8_Large = Config<128, 128, 128, 1, 1, GCO, GPE, false>;
using GInt8Configs = std::tuple<GInt8_Small, GInt8_Large>;

// fp8 e4m3 row-wise (per-token / per-tensor x per-channel / per-expert scales), fast accumulation
using GFp8_Small = Config<64, 32, 256, 1, 1, GPP, GPE, true, true>;
using GFp8_Large = Config<128, 128, 128, 1, 1, GCO, GPE, false, true>;
using GFp8Configs = std::tuple<GFp8_Small, GFp8_Large>;

// block-scaled fp8 (1x128 activation groups x 128x128 weight blocks): TileK 128, the weight's side a multiple of 128
using GFp8Block_Small = Config<128, 32, 128, 1, 1, GPP, GPE, true>;
using GFp8Block_Large = Config<128, 128, 128, 1, 1, GCO, GPE, false>;
using GFp8BlockConfigs = std::tuple<GFp8Block_Small, GFp8Block_Large>;

constexpr int kNumGroupedConfigs = 2;  // in every table; index 0 = *_Small, 1 = *_Large

inline const char* grouped_config_name(int table, int i) {
  static const char* const names[3][kNumGroupedConfigs] = {
      {"swap_64x32x256_c1x1_pingpong_persistent", "128x128x128_c1x1_cooperative_persistent"},
      {"swap_64x32x256_c1x1_pingpong_persistent_fastaccum", "128x128x128_c1x1_cooperative_persistent_fastaccum"},
      {"swap_128x32x128_c1x1_pingpong_persistent", "128x128x128_c1x1_cooperative_persistent"},
  };
  if (table < 0 || table > 2 || i < 0 || i >= kNumGroupedConfigs) return nullptr;
  return names[table][i];
}

// Index 0 (*_Small) when the average expert has at most kSmallRowsPerExpert rows, else 1 (*_Large).
inline int select_grouped(int64_t t, int64_t n, int64_t num_experts) {
  (void)n;
  const int64_t e = num_experts > 0 ? num_experts : 1;
  return t <= kSmallRowsPerExpert * e ? 0 : 1;
}

// Defined in grouped_sm90.cuh, instantiated one (ElementAB, ElementD, Config, block) per file. Returns 0 or writes
// an error message. kBlock: the block-scaled fp8 kernel (ElementAB is then cutlass::float_e4m3_t).
template <class ElementAB, class ElementD, class Cfg, bool kBlock>
int run_grouped_mm(const cw8a8_grouped_mm_args& args, cw8a8_alloc_fn alloc, void* alloc_ctx, char* err,
                   size_t err_len);

}  // namespace cutlass_w8a8::sm90::grouped
