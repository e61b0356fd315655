// The C entry points of an Ampere/Ada kernel library (csrc/gemm/kernel_api.h), for one operand type and arch.
// The kernels themselves are compiled in the instantiation files; this only chooses and calls one.
#pragma once

#include <cstdio>
#include <tuple>
#include <utility>

#include <cutlass/arch/arch.h>
#include <cutlass/numeric_types.h>

#include "gemm/sm80/scaled_mm_sm80_dispatch.cuh"

namespace cutlass_w8a8::sm80 {

template <class ArchTag, class ElementAB, class ElementD, class Table, size_t... I>
int run_index(int index, const cw8a8_scaled_mm_args& args, cw8a8_alloc_fn alloc, void* ctx, char* err,
              size_t err_len, std::index_sequence<I...>) {
  int rc = -1;
  ((index == static_cast<int>(I)
        ? (rc = run_scaled_mm<ArchTag, ElementAB, ElementD, std::tuple_element_t<I, Table>>(args, alloc, ctx,
                                                                                           err, err_len),
           0)
        : 0),
   ...);
  return rc;
}

// cw8a8_<arch>_scaled_mm of a library built for operand type `ab_type` (named `lib` in messages).
template <class ArchTag, class ElementAB, class Table>
int scaled_mm(const cw8a8_scaled_mm_args* args, cw8a8_alloc_fn alloc, void* ctx, char* err, size_t err_len,
              int ab_type, const char* lib) {
  if (args->ab_type != ab_type) {
    std::snprintf(err, err_len, "%s: operand type %d is not built into this library", lib, args->ab_type);
    return 1;
  }
  constexpr int count = static_cast<int>(std::tuple_size_v<Table>);
  const int index = args->config >= 0 ? args->config : select_config(args->m);
  if (index >= count) {
    std::snprintf(err, err_len, "%s: config %d out of range", lib, index);
    return 1;
  }
  auto seq = std::make_index_sequence<count>{};
  if (args->out_type == CW8A8_OUT_BF16) {
    return run_index<ArchTag, ElementAB, cutlass::bfloat16_t, Table>(index, *args, alloc, ctx, err, err_len, seq);
  }
  return run_index<ArchTag, ElementAB, cutlass::half_t, Table>(index, *args, alloc, ctx, err, err_len, seq);
}

// cw8a8_<arch>_num_configs: the size of `Table` for the library's operand type `built`, 0 for any other.
template <class Table>
int num_configs(int ab_type, int built) {
  return ab_type == built ? static_cast<int>(std::tuple_size_v<Table>) : 0;
}

}  // namespace cutlass_w8a8::sm80
