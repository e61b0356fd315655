// sm90 scaled_mm configurations and the choice among them by problem shape.
//
// Each table entry is compiled once per output type, one file each under instantiations/ (written by
// generate_instantiations.py from the tables below: rerun it after editing a table). The tables are
// indexed by `select_config`, and a config can also be forced by index for tuning
// (bench/tune_sm90.py, through the private op cutlass_w8a8::_scaled_mm_config).
//
// Reading a config: Config<TileM, TileN, TileK, ClusterM, ClusterN, schedule, tile scheduler, swap A/B>,
// in the kernel's own frame (with the swap, the kernel's M is the weight's N and its N is the tokens).
#pragma once

#include <cstdint>
#include <tuple>

#include "scaled_mm_sm90_config.cuh"

namespace cutlass_w8a8::sm90 {

using S = Schedule;
using T = Scheduler;

// int8 x int8 -> int32 (and fp8 e4m3 x e4m3 -> fp32: the same byte widths, so the same tiles fit).
using Configs = std::tuple<
    // 0. M in [1, 16]: decode. Swapped, so the weight's N fills the 64-row MMA and the 16 tokens its N;
    //    the GEMM streams the weight, so deep K tiles keep many bytes in flight per SM.
    Config<64, 16, 256, 1, 1, S::kPingpong, T::kPersistent, true>,
    // 1. M in (16, 32]
    Config<64, 32, 256, 1, 1, S::kPingpong, T::kPersistent, true>,
    // 2. M in (32, 64]
    Config<64, 64, 256, 1, 1, S::kPingpong, T::kPersistent, true>,
    // 3. M in (64, 128]: tokens fill a 64-row MMA tile; N tiles of 128 give enough CTAs for 132 SMs.
    Config<64, 128, 128, 1, 1, S::kPingpong, T::kPersistent, false>,
    // 4. M in (128, 1024]: the balanced 128x128 tile, pairs of CTAs sharing B through TMA multicast.
    Config<128, 128, 128, 2, 1, S::kPingpong, T::kPersistent, false>,
    // 5. M > 1024: the largest tile that fits, both warpgroups on one tile.
    Config<128, 256, 128, 2, 1, S::kCooperative, T::kPersistent, false>>;

constexpr int kNumConfigs = static_cast<int>(std::tuple_size_v<Configs>);

// The bucket for a problem of M tokens, N channels and depth K. int8 and fp8 share the table.
inline int select_config(int64_t m, int64_t n, int64_t k) {
  (void)n;
  (void)k;
  if (m <= 16) return 0;
  if (m <= 32) return 1;
  if (m <= 64) return 2;
  if (m <= 128) return 3;
  if (m <= 1024) return 4;
  return 5;
}

}  // namespace cutlass_w8a8::sm90
