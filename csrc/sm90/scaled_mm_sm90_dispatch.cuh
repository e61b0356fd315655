// sm90 scaled_mm configurations and the choice among them by problem shape.
//
// Each shipped table entry is compiled once per output type, one file each under instantiations/ (written
// by generate_instantiations.py from the tables below: rerun it after editing a table). The tuning
// candidates are compiled (bfloat16 output only) when the package is built with CUTLASS_W8A8_TUNE=1; then a
// config can be forced by index for bench/tune_sm90.py through the private op
// cutlass_w8a8::_scaled_mm_config. Index i < size(shipped) names shipped entry i; the candidates follow.
//
// Reading a config: Config<TileM, TileN, TileK, ClusterM, ClusterN, schedule, tile scheduler, swap A/B
// [, fp8 fast accumulation]>, in the kernel's own frame: with the swap, the kernel's M is the weight's N
// and its N is the tokens.
#pragma once

#include <cstdint>
#include <tuple>

#include "scaled_mm_sm90_config.cuh"

namespace cutlass_w8a8::sm90 {

using S = Schedule;
using T = Scheduler;
constexpr S PP = S::kPingpong;
constexpr S CO = S::kCooperative;
constexpr T PE = T::kPersistent;
constexpr T SK = T::kStreamK;

// ---- int8 x int8 -> int32 ------------------------------------------------------------------------------

using Int8Configs = std::tuple<
    // 0. M in [1, 16]: decode. Swapped, so the weight's N fills the 64-row MMA and the 16 tokens its N;
    //    the GEMM streams the weight, so deep K tiles keep many bytes in flight per SM.
    Config<64, 16, 256, 1, 1, PP, PE, true>,
    // 1. M in (16, 32]
    Config<64, 32, 256, 1, 1, PP, PE, true>,
    // 2. M in (32, 64]
    Config<64, 64, 256, 1, 1, PP, PE, true>,
    // 3. M in (64, 128]: tokens fill a 64-row MMA tile; N tiles of 128 give enough CTAs for 132 SMs.
    Config<64, 128, 128, 1, 1, PP, PE, false>,
    // 4. M in (128, 1024]: the balanced 128x128 tile, pairs of CTAs sharing B through TMA multicast.
    Config<128, 128, 128, 2, 1, PP, PE, false>,
    // 5. M > 1024: the largest tile that fits, both warpgroups on one tile.
    Config<128, 256, 128, 2, 1, CO, PE, false>>;

// Inline so the tables are visible to the dispatcher; each bucket's choice is explained in the table.
inline int select_int8(int64_t m, int64_t n, int64_t k) {
  (void)n;
  (void)k;
  if (m <= 16) return 0;
  if (m <= 32) return 1;
  if (m <= 64) return 2;
  if (m <= 128) return 3;
  if (m <= 1024) return 4;
  return 5;
}

// ---- fp8 e4m3 x e4m3 -> fp32 ---------------------------------------------------------------------------
// Without fast accumulation the mainloop adds the tensor cores' partial sums into float32 registers every
// 4 MMAs, so TileK must be 4 * 32 = 128 and the accumulators take twice the registers: tiles whose
// accumulator would not fit twice (128x256 cooperative) spill.

using Fp8Configs = std::tuple<
    // 0. M in [1, 16]: as int8, with TileK = 128 (the promotion interval).
    Config<64, 16, 128, 1, 1, PP, PE, true>,
    // 1. M in (16, 32]
    Config<64, 32, 128, 1, 1, PP, PE, true>,
    // 2. M in (32, 64]
    Config<64, 64, 128, 1, 1, PP, PE, true>,
    // 3. M in (64, 128]
    Config<64, 128, 128, 1, 1, PP, PE, false>,
    // 4. M in (128, 1024]
    Config<128, 128, 128, 2, 1, PP, PE, false>,
    // 5. M > 1024: 128x128 cooperative keeps both accumulator copies in registers.
    Config<128, 128, 128, 2, 1, CO, PE, false>>;

inline int select_fp8(int64_t m, int64_t n, int64_t k) { return select_int8(m, n, k); }

// ---- tuning candidates (bfloat16 output; built with CUTLASS_W8A8_TUNE=1) ----------------------------
// Stream-K needs the cooperative schedule on sm90, hence tile M 128 for those.

using Int8TuneCandidates = std::tuple<
    Config<64, 16, 128, 1, 1, PP, PE, true>,
    Config<128, 16, 256, 1, 1, CO, PE, true>,
    Config<128, 16, 256, 1, 1, CO, SK, true>,
    Config<128, 16, 128, 1, 1, CO, SK, true>,
    Config<64, 16, 256, 2, 1, PP, PE, true>,
    Config<64, 32, 128, 1, 1, PP, PE, true>,
    Config<128, 32, 256, 1, 1, CO, PE, true>,
    Config<128, 32, 256, 1, 1, CO, SK, true>,
    Config<64, 64, 128, 1, 1, PP, PE, true>,
    Config<128, 64, 128, 1, 1, CO, PE, true>,
    Config<128, 64, 128, 1, 1, CO, SK, true>,
    Config<128, 128, 128, 1, 1, CO, PE, true>,
    Config<64, 128, 256, 1, 1, PP, PE, false>,
    Config<64, 256, 128, 1, 1, PP, PE, false>,
    Config<128, 128, 128, 2, 1, CO, PE, false>,
    Config<128, 128, 128, 1, 2, PP, PE, false>,
    Config<128, 128, 128, 1, 1, CO, SK, false>,
    Config<128, 256, 128, 1, 2, CO, PE, false>,
    Config<256, 128, 128, 2, 1, CO, PE, false>,
    Config<256, 128, 128, 1, 2, CO, PE, false>,
    Config<128, 256, 128, 2, 1, CO, SK, false>>;

using Fp8TuneCandidates = std::tuple<
    Config<128, 16, 128, 1, 1, CO, PE, true>,
    Config<128, 16, 128, 1, 1, CO, SK, true>,
    Config<128, 32, 128, 1, 1, CO, PE, true>,
    Config<128, 64, 128, 1, 1, CO, PE, true>,
    Config<128, 128, 128, 1, 1, CO, PE, true>,
    Config<128, 128, 128, 1, 2, PP, PE, false>,
    Config<128, 128, 128, 1, 2, CO, PE, false>,
    Config<128, 128, 128, 1, 1, CO, SK, false>,
    Config<128, 256, 128, 2, 1, CO, PE, false>,
    // fast accumulation
    Config<64, 16, 256, 1, 1, PP, PE, true, true>,
    Config<64, 32, 256, 1, 1, PP, PE, true, true>,
    Config<64, 64, 256, 1, 1, PP, PE, true, true>,
    Config<128, 128, 128, 2, 1, PP, PE, false, true>,
    Config<128, 128, 128, 2, 1, CO, PE, false, true>,
    Config<128, 256, 128, 2, 1, CO, PE, false, true>,
    Config<256, 128, 128, 2, 1, CO, PE, false, true>>;

template <class Tuple>
constexpr int size_of() {
  return static_cast<int>(std::tuple_size_v<Tuple>);
}

}  // namespace cutlass_w8a8::sm90
