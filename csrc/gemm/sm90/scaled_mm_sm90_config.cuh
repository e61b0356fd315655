// Kernel configuration vocabulary for the sm90 (Hopper) scaled_mm kernels: what a config names, and the
// declaration of the function each instantiation file defines. Light on purpose: the dispatcher includes
// this without pulling in the kernel templates (scaled_mm_sm90.cuh).
#pragma once

#include <cstdio>
#include <string>
#include <tuple>
#include <type_traits>

#include <cute/layout.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/epilogue/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

#include "gemm/kernel_api.h"
#include "gemm/config_index.hpp"

namespace cutlass_w8a8::sm90 {

enum class Schedule {
  kPingpong,     // two consumer warpgroups, each on its own tile; one's epilogue overlaps the other's MMA
  kCooperative,  // two consumer warpgroups split one tile along M (tile M >= 128)
};

// The tile scheduler: data-parallel persistent tiles only. There is no stream-K: CUTLASS 4.2's sm90 stream-K
// scheduler does not compile with CUTLASS_ENABLE_GDC_FOR_SM90, which PDL needs, and it rarely won anyway (the
// tuning candidates in scaled_mm_sm90_dispatch.cuh say by how much).
enum class Scheduler {
  kPersistent,
};

// One kernel configuration. `SwapAB` computes D^T = B^T A^T: the weight's N then sits on the MMA's M side,
// which the small-M (decode) buckets need because the MMA's M is at least 64 while its N can be 8.
// `FastAccum` (fp8 only) keeps the whole K loop in the tensor cores' own accumulator instead of adding it
// into a float32 accumulator every 4 MMAs (128 products); it is faster and less exact (csrc/gemm/EPILOGUES.md).
// `Swizzle` is the persistent tile scheduler's max_swizzle_size (1, 2, 4 or 8; CUTLASS's default 1): consecutive
// work tiles walk up to that many tiles across the raster direction before moving along it, so the CTAs of a
// wave share more A and B tiles in L2. A runtime argument of the same kernel: configs that differ only in it
// are compiled together (generate_instantiations.py puts them in one file).
// `Waves` (fp8 with promotion only: block-scaled, or row-wise without FastAccum; TileK 128) runs the mainloop of
// wave_mainloop.cuh: CUTLASS's fp8 collective whose consumer computes each warpgroup's rows in waves of 64 (one
// WGMMA M atom) into one 64-row temporary accumulator, promoted into the float32 accumulator after every 128-deep k
// tile, instead of a temporary the size of the whole tile. The same arithmetic per element as CUTLASS's mainloop,
// with room for 128 x 128 rows per warpgroup (256x128 cooperative, 128x128 pingpong) without spilling.
// `WaveN` (with Waves only; 0: the tile's N) narrows the waves along N as well: the warpgroup's WGMMA atom is 64 x
// WaveN (WaveN dividing TileN), so a warpgroup's 64 x TileN rows run as TileN / WaveN waves of 64 x WaveN through one
// temporary of WaveN / 2 registers (128x256 cooperative or 64x256 pingpong with WaveN 128: 128 + 64 registers, where
// CUTLASS's collectives need 128 + 128 and spill, or refuse the tile). The same arithmetic per element again.
template <int TileM, int TileN, int TileK, int ClusterM, int ClusterN, Schedule Sched, Scheduler TileSched,
          bool SwapAB, bool FastAccum = false, int Swizzle = 1, bool Waves = false, int WaveN = 0>
struct Config {
  using TileShape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  using ClusterShape = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  static constexpr Schedule kSchedule = Sched;
  static constexpr Scheduler kScheduler = TileSched;
  static constexpr bool kSwapAB = SwapAB;
  static constexpr bool kFastAccum = FastAccum;
  static constexpr int kSwizzle = Swizzle;
  static constexpr bool kWaves = Waves;
  static constexpr int kWaveN = WaveN;
  static_assert(WaveN == 0 || (Waves && WaveN % 8 == 0 && TileN % (WaveN == 0 ? 1 : WaveN) == 0 && WaveN < TileN),
                "WaveN: 0, or (with Waves) a multiple of 8 dividing TileN and smaller than it");
  static_assert(Swizzle == 1 || Swizzle == 2 || Swizzle == 4 || Swizzle == 8, "max_swizzle_size: 1, 2, 4 or 8");
};

inline const char* schedule_name(Schedule s) { return s == Schedule::kPingpong ? "pingpong" : "cooperative"; }

// A config's name in the tables' name exports (cw8a8_sm90_config_name, cw8a8_sm90_grouped_config_name; kernel_api.h):
// "[swap_]<tile M>x<N>x<K>_c<cluster M>x<N>_<pingpong|cooperative>_persistent[_fastaccum][_waves][_swizzle<S>]".
template <class Cfg>
std::string config_name() {
  using namespace cute;
  char buf[128];
  // "_persistent": the tile scheduler (the only one now); kept so that names match earlier sweeps' results.
  // "_waves": the wave mainloop (Config's Waves, wave_mainloop.cuh); "_waves_n<W>" with waves WaveN wide along N.
  // "_swizzle<S>": the tile scheduler's max_swizzle_size, named only when it is not CUTLASS's default 1.
  std::snprintf(buf, sizeof(buf), "%s%dx%dx%d_c%dx%d_%s_persistent%s%s", Cfg::kSwapAB ? "swap_" : "",
                int(size<0>(typename Cfg::TileShape{})), int(size<1>(typename Cfg::TileShape{})),
                int(size<2>(typename Cfg::TileShape{})), int(size<0>(typename Cfg::ClusterShape{})),
                int(size<1>(typename Cfg::ClusterShape{})), schedule_name(Cfg::kSchedule),
                Cfg::kFastAccum ? "_fastaccum" : "", Cfg::kWaves ? "_waves" : "");
  std::string name = buf;
  if (Cfg::kWaveN != 0) name += "_n" + std::to_string(Cfg::kWaveN);
  if (Cfg::kSwizzle != 1) name += "_swizzle" + std::to_string(Cfg::kSwizzle);
  return name;
}

// index_of<Cfg, Table> (gemm/config_index.hpp): a config's position in a dispatch table, by name.
using ::cutlass_w8a8::gemm::index_of;

// Defined in scaled_mm_sm90.cuh, instantiated one (ElementAB, ElementD, Config) per file under
// instantiations/ (shipped configs) and instantiations_tune/ (tuning candidates). Returns 0 or writes an
// error message.
template <class ElementAB, class ElementD, class Cfg>
int run_scaled_mm(const cw8a8_scaled_mm_args& args, cw8a8_alloc_fn alloc, void* alloc_ctx, char* err,
                  size_t err_len);

// Also defined there and instantiated with it: the launch run_scaled_mm would make, described for a CUDA-graph
// node update (kernel_api.h).
template <class ElementAB, class ElementD, class Cfg>
int scaled_mm_node(const cw8a8_scaled_mm_args& args, cw8a8_kernel_node* node, char* err, size_t err_len);

// The block-scaled fp8 GEMM (cw8a8_scaled_mm_args.scale_block = 1, float8_e4m3fn operands): defined in
// scaled_mm_sm90_blockwise.cuh, instantiated one (ElementD, Config) per file under instantiations/
// (fp8block_<bucket>_<out>.cu), with its graph-node description beside it. A block Config is read as the others
// are, in the kernel's own frame; it never uses fast accumulation (the mainloop promotes and scales the tensor
// cores' partial sums at every 128-element K block).
template <class ElementD, class Cfg>
int run_scaled_mm_block(const cw8a8_scaled_mm_args& args, cw8a8_alloc_fn alloc, void* alloc_ctx, char* err,
                        size_t err_len);
template <class ElementD, class Cfg>
int scaled_mm_block_node(const cw8a8_scaled_mm_args& args, cw8a8_kernel_node* node, char* err, size_t err_len);

}  // namespace cutlass_w8a8::sm90
