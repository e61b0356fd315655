// C entry points of the sm90 kernel library (see csrc/kernel_api.h): choose a config and run it.
#include <cstdio>
#include <string>
#include <utility>

#include <cutlass/numeric_types.h>

#include "scaled_mm_sm90_dispatch.cuh"

namespace cutlass_w8a8::sm90 {
namespace {

template <class ElementAB, class ElementD, size_t... I>
int run_index(int index, const cw8a8_scaled_mm_args& args, cw8a8_alloc_fn alloc, void* ctx, char* err,
              size_t err_len, std::index_sequence<I...>) {
  int rc = -1;
  ((index == static_cast<int>(I)
        ? (rc = run_scaled_mm<ElementAB, ElementD, std::tuple_element_t<I, Configs>>(args, alloc, ctx, err,
                                                                                      err_len),
           0)
        : 0),
   ...);
  return rc;
}

template <class ElementAB>
int run_ab(int index, const cw8a8_scaled_mm_args& args, cw8a8_alloc_fn alloc, void* ctx, char* err,
           size_t err_len) {
  auto seq = std::make_index_sequence<kNumConfigs>{};
  switch (args.out_type) {
    case CW8A8_OUT_BF16:
      return run_index<ElementAB, cutlass::bfloat16_t>(index, args, alloc, ctx, err, err_len, seq);
    case CW8A8_OUT_F16:
      return run_index<ElementAB, cutlass::half_t>(index, args, alloc, ctx, err, err_len, seq);
    default:
      std::snprintf(err, err_len, "sm90 scaled_mm: unsupported output type %d", args.out_type);
      return 1;
  }
}

const char* schedule_name(Schedule s) { return s == Schedule::kPingpong ? "pingpong" : "cooperative"; }
const char* scheduler_name(Scheduler s) { return s == Scheduler::kPersistent ? "persistent" : "streamk"; }

template <class Cfg>
std::string config_name() {
  using namespace cute;
  char buf[128];
  std::snprintf(buf, sizeof(buf), "%s%dx%dx%d_c%dx%d_%s_%s", Cfg::kSwapAB ? "swap_" : "",
                int(size<0>(typename Cfg::TileShape{})), int(size<1>(typename Cfg::TileShape{})),
                int(size<2>(typename Cfg::TileShape{})), int(size<0>(typename Cfg::ClusterShape{})),
                int(size<1>(typename Cfg::ClusterShape{})), schedule_name(Cfg::kSchedule),
                scheduler_name(Cfg::kScheduler));
  return buf;
}

template <size_t... I>
const char* name_of(int index, std::index_sequence<I...>) {
  static const std::string names[] = {config_name<std::tuple_element_t<I, Configs>>()...};
  return (index >= 0 && index < static_cast<int>(sizeof...(I))) ? names[index].c_str() : nullptr;
}

}  // namespace
}  // namespace cutlass_w8a8::sm90

extern "C" {

__attribute__((visibility("default"))) int cw8a8_sm90_scaled_mm(const cw8a8_scaled_mm_args* args,
                                                                 cw8a8_alloc_fn alloc, void* alloc_ctx,
                                                                 char* err, size_t err_len) {
  using namespace cutlass_w8a8::sm90;
  int index = args->config >= 0 ? args->config : select_config(args->m, args->n, args->k);
  if (index >= kNumConfigs) {
    std::snprintf(err, err_len, "sm90 scaled_mm: config %d out of range (the table has %d)", index,
                  kNumConfigs);
    return 1;
  }
  switch (args->ab_type) {
    case CW8A8_AB_INT8:
      return run_ab<int8_t>(index, *args, alloc, alloc_ctx, err, err_len);
    case CW8A8_AB_FP8_E4M3:
      return run_ab<cutlass::float_e4m3_t>(index, *args, alloc, alloc_ctx, err, err_len);
    default:
      std::snprintf(err, err_len, "sm90 scaled_mm: unsupported operand type %d", args->ab_type);
      return 1;
  }
}

__attribute__((visibility("default"))) int cw8a8_sm90_num_configs(void) {
  return cutlass_w8a8::sm90::kNumConfigs;
}

__attribute__((visibility("default"))) const char* cw8a8_sm90_config_name(int ab_type, int i) {
  (void)ab_type;
  using namespace cutlass_w8a8::sm90;
  return name_of(i, std::make_index_sequence<kNumConfigs>{});
}

}  // extern "C"
