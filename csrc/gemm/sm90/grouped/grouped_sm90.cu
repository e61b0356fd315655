// C entry points of the sm90 grouped (mixture-of-experts) GEMM (gemm/kernel_api.h, cw8a8_grouped_mm_fn): choose a
// config of the arguments' table (grouped_sm90_config.cuh) and run it (grouped_sm90.cuh). The instantiations live in
// grouped_<family>_<bucket>_<out>.cu beside this file.
#include <cstdint>
#include <cstdio>
#include <tuple>
#include <type_traits>
#include <utility>

#include <cutlass/numeric_types.h>

#include "gemm/kernel_api.h"
#include "gemm/sm90/grouped/grouped_sm90_config.cuh"

namespace cutlass_w8a8::sm90::grouped {
namespace {

// Calls run(Cfg{}) with entry `i` of the tuple Candidates (a table's shipped configs or its tuning candidates; i in
// range: the entry checked it).
template <class Candidates, class Run, size_t... I>
int run_candidate(int i, Run&& run, std::index_sequence<I...>) {
  int rc = 1;
  ((i == static_cast<int>(I) ? (rc = run(std::tuple_element_t<I, Candidates>{}), 0) : 0), ...);
  return rc;
}

// Runs entry `index` of table Tb (its shipped configs, then its tuning candidates when this build compiled them) with
// ElementD output; tuning candidates exist with bfloat16 output only.
template <class Tb, class ElementD>
int run_entry(int index, const cw8a8_grouped_mm_args& args, cw8a8_alloc_fn alloc, void* ctx, char* err,
              size_t err_len) {
  using AB = typename Tb::ElementAB;
  auto run = [&](auto cfg) {
    return run_grouped_mm<AB, ElementD, decltype(cfg), Tb::kBlock>(args, alloc, ctx, err, err_len);
  };
  if (index < kNumGroupedConfigs) {
    return run_candidate<typename Tb::Shipped>(index, run, std::make_index_sequence<kNumGroupedConfigs>{});
  }
  if constexpr (kTuneGrouped && Tb::kCandidates > 0 && std::is_same_v<ElementD, cutlass::bfloat16_t>) {
    return run_candidate<typename Tb::Candidates>(index - kNumGroupedConfigs, run,
                                                  std::make_index_sequence<Tb::kCandidates>{});
  }
  std::snprintf(err, err_len, "grouped_mm: config %d is a tuning candidate, built only with bfloat16 output by "
                "CUTLASS_W8A8_TUNE=1 or a CUTLASS_W8A8_TUNE list naming grouped", index);
  return 1;
}

template <class ElementD>
int run_out(int table, int index, const cw8a8_grouped_mm_args& args, cw8a8_alloc_fn alloc, void* ctx, char* err,
            size_t err_len) {
  return visit_grouped_table(table, [&](auto tb) {
    return run_entry<decltype(tb), ElementD>(index, args, alloc, ctx, err, err_len);
  });
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
  const int table = cw8a8_grouped_table_of(&p);
  if (grouped_num_configs(table) == 0) {
    std::snprintf(err, err_len, "grouped_mm: unsupported operand type %d", p.ab_type);
    return 1;
  }
  int index = p.config;
  if (index >= grouped_num_configs(table)) {
    std::snprintf(err, err_len, "grouped_mm: config %d is not in [0, %d)", index, grouped_num_configs(table));
    return 1;
  }
  if (index < 0) index = select_grouped(p.t, p.n, p.num_experts);
  if (p.out_type == CW8A8_OUT_BF16) return run_out<cutlass::bfloat16_t>(table, index, p, alloc, alloc_ctx, err, err_len);
  return run_out<cutlass::half_t>(table, index, p, alloc, alloc_ctx, err, err_len);
}

// A grouped table's size (its kNumGroupedConfigs shipped entries, then the tuning candidates this build compiled; 0
// for an unknown table: read by _grouped_scaled_mm_config's range check) and its entry names (benchmarks, ctypes).
__attribute__((visibility("default"))) int cw8a8_sm90_grouped_num_configs(int table) {
  return cutlass_w8a8::sm90::grouped::grouped_num_configs(table);
}

__attribute__((visibility("default"))) const char* cw8a8_sm90_grouped_config_name(int table, int i) {
  return cutlass_w8a8::sm90::grouped::grouped_config_name(table, i);
}

}  // extern "C"
