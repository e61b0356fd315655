// C entry points of the sm90 grouped (mixture-of-experts) GEMM (gemm/kernel_api.h, cw8a8_grouped_mm_fn): choose a
// config of the arguments' table (grouped_sm90_config.cuh) and run it (grouped_sm90.cuh). The instantiations live in
// grouped_<family>_<bucket>_<out>.cu beside this file.
#include <cstdint>
#include <cstdio>

#include <cutlass/numeric_types.h>

#include "gemm/kernel_api.h"
#include "gemm/sm90/grouped/grouped_sm90_config.cuh"

namespace cutlass_w8a8::sm90::grouped {
namespace {

template <class ElementAB, class ElementD, class Small, class Large, bool kBlock>
int run_index(int index, const cw8a8_grouped_mm_args& args, cw8a8_alloc_fn alloc, void* ctx, char* err,
              size_t err_len) {
  if (index == 0) return run_grouped_mm<ElementAB, ElementD, Small, kBlock>(args, alloc, ctx, err, err_len);
  return run_grouped_mm<ElementAB, ElementD, Large, kBlock>(args, alloc, ctx, err, err_len);
}

template <class ElementD>
int run_out(int table, int index, const cw8a8_grouped_mm_args& args, cw8a8_alloc_fn alloc, void* ctx, char* err,
            size_t err_len) {
  switch (table) {
    case CW8A8_TABLE_INT8:
      return run_index<int8_t, ElementD, GInt8_Small, GInt8_Large, false>(index, args, alloc, ctx, err, err_len);
    case CW8A8_TABLE_FP8:
      return run_index<cutlass::float_e4m3_t, ElementD, GFp8_Small, GFp8_Large, false>(index, args, alloc, ctx, err,
                                                                                         err_len);
    default:
      return run_index<cutlass::float_e4m3_t, ElementD, GFp8Block_Small, GFp8Block_Large, true>(index, args, alloc,
                                                                                                   ctx, err, err_len);
  }
}

int table_of(const cw8a8_grouped_mm_args& args) {
  return args.scale_block ? CW8A8_TABLE_FP8_BLOCK : args.ab_type;
}

}  // namespace
}  // namespace cutlass_w8a8::sm90::grouped

extern "C" {

__attribute__((visibility("default"))) int cw8a8_sm90_grouped_mm(const cw8a8_grouped_mm_args* args,
                                                                  cw8a8_alloc_fn alloc, void* alloc_ctx, char* err,
                                                                  size_t err_len) {
  using namespace cutlass_w8a8::sm90::grouped;
  const cw8a8_grouped_mm_args& p = *args;
  if (p.t == 0 || p.num_experts == 0) return 0;
  // The caller validates everything; these are the conditions the TMA descriptors need, kept as a last guard.
  if (p.k % 16 != 0 || p.n % 8 != 0 || p.lda % 16 != 0 || p.ldb % 16 != 0 || p.ldd % 8 != 0 ||
      (p.scale_block && p.k % 128 != 0) || (p.scale_block && p.ab_type != CW8A8_AB_FP8_E4M3) ||
      p.t > INT32_MAX || p.n > INT32_MAX || p.k > INT32_MAX || p.num_experts > INT32_MAX) {
    std::snprintf(err, err_len, "grouped_mm: unsupported shape (T=%lld, N=%lld, K=%lld, E=%lld, lda=%lld, ldb=%lld, "
                  "ldd=%lld): K and lda must be multiples of 16 (128 for block scales), N and ldd of 8",
                  (long long)p.t, (long long)p.n, (long long)p.k, (long long)p.num_experts, (long long)p.lda,
                  (long long)p.ldb, (long long)p.ldd);
    return 1;
  }
  const int table = table_of(p);
  int index = p.config;
  if (index >= kNumGroupedConfigs) {
    std::snprintf(err, err_len, "grouped_mm: config %d is not in [0, %d)", index, kNumGroupedConfigs);
    return 1;
  }
  if (index < 0) index = select_grouped(p.t, p.n, p.num_experts);
  if (p.out_type == CW8A8_OUT_BF16) return run_out<cutlass::bfloat16_t>(table, index, p, alloc, alloc_ctx, err, err_len);
  return run_out<cutlass::half_t>(table, index, p, alloc, alloc_ctx, err, err_len);
}

// The grouped table's size (every table has kNumGroupedConfigs entries) and entry names, for benchmarks (ctypes).
__attribute__((visibility("default"))) int cw8a8_sm90_grouped_num_configs(int table) {
  return table >= 0 && table <= 2 ? cutlass_w8a8::sm90::grouped::kNumGroupedConfigs : 0;
}

__attribute__((visibility("default"))) const char* cw8a8_sm90_grouped_config_name(int table, int i) {
  return cutlass_w8a8::sm90::grouped::grouped_config_name(table, i);
}

}  // extern "C"
