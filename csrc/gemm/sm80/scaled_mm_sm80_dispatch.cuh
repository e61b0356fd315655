// Ampere/Ada scaled_mm configurations (CUTLASS 2.x) and the choice among them by M.
//
// Compiled one (operand, output, config) per file by csrc/gemm/generate_instantiations.py. int8 tables are
// built for every 8.x arch in TORCH_CUDA_ARCH_LIST (and as compute_80 PTX, which is how the forced sm80
// path runs on Hopper); fp8 needs sm89's e4m3 MMA and is built for 8.9 only.
//
// Reading a config: Config<threadblock M, N, K, warp M, warp N, stages>. Shared memory per CTA is
// stages * (TbM + TbN) * TbK bytes; the largest here (96 KiB) fits the 99 KiB of sm86/sm89.
#pragma once

#include <cstdint>
#include <tuple>

#include "gemm/sm80/scaled_mm_sm80.cuh"

namespace cutlass_w8a8::sm80 {

using Int8Configs = std::tuple<
    // 0. M in [1, 32]: a 32-row tile wastes least of the MMA on few tokens; 6 stages keep the weight
    //    stream (the whole cost at small M) in flight.
    Config<32, 64, 128, 32, 32, 6>,
    // 1. M in (32, 64]
    Config<64, 64, 128, 32, 32, 5>,
    // 2. M in (64, 128]
    Config<64, 128, 128, 64, 64, 4>,
    // 3. M > 128: CUTLASS's usual int8 tensor-core tile.
    Config<128, 128, 64, 64, 64, 5>>;

// e4m3 x e4m3 on sm89: the same byte widths, the same tiles.
using Fp8Configs = Int8Configs;

inline int select_config(int64_t m) {
  if (m <= 32) return 0;
  if (m <= 64) return 1;
  if (m <= 128) return 2;
  return 3;
}

}  // namespace cutlass_w8a8::sm80
