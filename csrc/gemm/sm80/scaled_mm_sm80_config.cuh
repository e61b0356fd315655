// Kernel configuration vocabulary for the Ampere/Ada scaled_mm kernels (CUTLASS 2.x): what a config names, and
// the declaration of the function each instantiation file defines. Light on purpose: the dispatcher and the
// library entry include this without the kernel templates (scaled_mm_sm80.cuh), so that every kernel is
// compiled once, in its own instantiation file.
#pragma once

#include <tuple>
#include <type_traits>

#include <cutlass/gemm_coord.h>

#include "gemm/kernel_api.h"

namespace cutlass_w8a8::sm80 {

// One configuration: threadblock tile, warp tile (K equal to the threadblock's), pipeline stages.
template <int TbM, int TbN, int TbK, int WarpM, int WarpN, int Stages_>
struct Config {
  using ThreadblockShape = cutlass::gemm::GemmShape<TbM, TbN, TbK>;
  using WarpShape = cutlass::gemm::GemmShape<WarpM, WarpN, TbK>;
  static constexpr int kStages = Stages_;
};

// Index of config `Cfg` in the std::tuple `Table`; a compile error unless it occurs exactly once (as the sm90
// index_of: the two arch libraries share no header).
template <class Cfg, class... Cs>
constexpr int index_in(const std::tuple<Cs...>*) {
  constexpr bool same[] = {std::is_same_v<Cfg, Cs>...};
  int index = -1;
  for (int i = 0; i < static_cast<int>(sizeof...(Cs)); ++i) {
    if (same[i]) index = index == -1 ? i : -2;
  }
  return index;
}
template <class Cfg, class Table>
struct IndexOf {
  static constexpr int value = index_in<Cfg>(static_cast<const Table*>(nullptr));
  static_assert(value >= 0, "the config is not in the table, or is in it more than once");
};
template <class Cfg, class Table>
inline constexpr int index_of = IndexOf<Cfg, Table>::value;

// Defined in scaled_mm_sm80.cuh, instantiated one (ArchTag, ElementAB, ElementD, Config) per file under
// sm80/instantiations/ (int8, Sm80) and sm89/instantiations/ (e4m3, Sm89). Returns 0 or writes an error message.
template <class ArchTag, class ElementAB, class ElementD, class Cfg>
int run_scaled_mm(const cw8a8_scaled_mm_args& args, cw8a8_alloc_fn alloc, void* alloc_ctx, char* err,
                  size_t err_len);

}  // namespace cutlass_w8a8::sm80
