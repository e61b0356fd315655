// Ampere/Ada scaled_mm configurations (CUTLASS 2.x) and the choice among them by M.
//
// Every config has a name by the bucket it serves (`Int8_M32`: M in [1, 32]) and is compiled once per output
// type, one file each named after it (sm80/instantiations/int8_M32_bf16.cu, sm89/instantiations/fp8_M32_bf16.cu),
// by csrc/gemm/generate_instantiations.py from this header: rerun it after editing a table. The tables' order
// is a runtime contract: a table index is what select_config returns and what the private op
// cutlass_w8a8::_scaled_mm_config forces. int8 tables are built for every 8.x arch in TORCH_CUDA_ARCH_LIST
// (and as compute_80 PTX, which is how the forced sm80 path runs on Hopper); fp8 needs sm89's e4m3 MMA and is
// built for 8.9 only.
//
// Reading a config: Config<threadblock M, N, K, warp M, warp N, stages>. Shared memory per CTA is
// stages * (TbM + TbN) * TbK bytes; the largest here (96 KiB) fits the 99 KiB of sm86/sm89.
#pragma once

#include <cstdint>
#include <tuple>
#include <type_traits>

#include "gemm/sm80/scaled_mm_sm80_config.cuh"

namespace cutlass_w8a8::sm80 {

// ---- int8 x int8 -> int32 (sm80, sm86, sm89) ----------------------------------------------------------

// M in [1, 32]: a 32-row tile wastes least of the MMA on few tokens; 6 stages keep the weight stream (the
// whole cost at small M) in flight.
using Int8_M32 = Config<32, 64, 128, 32, 32, 6>;
// M in (32, 64]
using Int8_M64 = Config<64, 64, 128, 32, 32, 5>;
// M in (64, 128]
using Int8_M128 = Config<64, 128, 128, 64, 64, 4>;
// M > 128: CUTLASS's usual int8 tensor-core tile.
using Int8_MLarge = Config<128, 128, 64, 64, 64, 5>;

// Table indices 0..3, in this order.
using Int8Configs = std::tuple<Int8_M32, Int8_M64, Int8_M128, Int8_MLarge>;

// ---- e4m3 x e4m3 -> fp32 (sm89) -------------------------------------------------------------------------
// The same byte widths as int8, so the same tiles, bucket for bucket.

using Fp8_M32 = Int8_M32;
using Fp8_M64 = Int8_M64;
using Fp8_M128 = Int8_M128;
using Fp8_MLarge = Int8_MLarge;

using Fp8Configs = std::tuple<Fp8_M32, Fp8_M64, Fp8_M128, Fp8_MLarge>;

// The table index for M, in Int8Configs and (the same table) Fp8Configs.
inline int select_config(int64_t m) {
  static_assert(std::is_same_v<Int8Configs, Fp8Configs>, "select_config serves both tables: split it");
  if (m <= 32) return index_of<Int8_M32, Int8Configs>;
  if (m <= 64) return index_of<Int8_M64, Int8Configs>;
  if (m <= 128) return index_of<Int8_M128, Int8Configs>;
  return index_of<Int8_MLarge, Int8Configs>;
}

}  // namespace cutlass_w8a8::sm80
