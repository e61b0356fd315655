// The C entry points of an Ampere/Ada kernel library (csrc/gemm/kernel_api.h), for one operand type and arch.
#pragma once

#include <cstdio>
#include <string>
#include <utility>

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

template <class Cfg>
std::string config_name() {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "%dx%dx%d_warp%dx%d_%dstage", Cfg::ThreadblockShape::kM,
                Cfg::ThreadblockShape::kN, Cfg::ThreadblockShape::kK, Cfg::WarpShape::kM, Cfg::WarpShape::kN,
                Cfg::kStages);
  return buf;
}

template <class Table, size_t... I>
const char* name_of(int i, std::index_sequence<I...>) {
  static const std::string names[] = {config_name<std::tuple_element_t<I, Table>>()...};
  return (i >= 0 && i < static_cast<int>(sizeof...(I))) ? names[i].c_str() : nullptr;
}

}  // namespace cutlass_w8a8::sm80
