// Kernel configuration vocabulary for the Ampere/Ada scaled_mm kernels (CUTLASS 2.x): what a config names, and
// the declaration of the function each instantiation file defines. Light on purpose: the dispatcher and the
// library entry include this without the kernel templates (scaled_mm_sm80.cuh), so that every kernel is
// compiled once, in its own instantiation file.
#pragma once

#include <tuple>
#include <type_traits>

#include <cutlass/gemm_coord.h>

#include "gemm/kernel_api.h"
#include "gemm/config_index.hpp"

namespace cutlass_w8a8::sm80 {

// One configuration: threadblock tile, warp tile (K equal to the threadblock's), pipeline stages.
template <int TbM, int TbN, int TbK, int WarpM, int WarpN, int Stages_>
struct Config {
  using ThreadblockShape = cutlass::gemm::GemmShape<TbM, TbN, TbK>;
  using WarpShape = cutlass::gemm::GemmShape<WarpM, WarpN, TbK>;
  static constexpr int kStages = Stages_;
};

// index_of<Cfg, Table> (gemm/config_index.hpp): a config's position in a dispatch table, by name.
using ::cutlass_w8a8::gemm::index_of;

// Defined in scaled_mm_sm80.cuh, instantiated one (ArchTag, ElementAB, ElementD, Config) per file under
// sm80/instantiations/ (int8, Sm80) and sm89/instantiations/ (e4m3, Sm89). Returns 0 or writes an error message.
template <class ArchTag, class ElementAB, class ElementD, class Cfg>
int run_scaled_mm(const cw8a8_scaled_mm_args& args, cw8a8_alloc_fn alloc, void* alloc_ctx, char* err,
                  size_t err_len);

}  // namespace cutlass_w8a8::sm80
