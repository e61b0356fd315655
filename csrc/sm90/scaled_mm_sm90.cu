// C entry points of the sm90 kernel library (see csrc/kernel_api.h): choose a config and run it.
#include <cstdio>
#include <string>
#include <type_traits>
#include <utility>

#include <cutlass/numeric_types.h>

#include "scaled_mm_sm90_dispatch.cuh"

namespace cutlass_w8a8::sm90 {
namespace {

#ifdef CUTLASS_W8A8_TUNE
constexpr bool kTuneBuild = true;
#else
constexpr bool kTuneBuild = false;
#endif

template <class ElementAB>
struct Tables;
template <>
struct Tables<int8_t> {
  using Shipped = Int8Configs;
  using Candidates = Int8TuneCandidates;
  static int select(int64_t m, int64_t n, int64_t k, int sms) { return select_int8(m, n, k, sms); }
};
template <>
struct Tables<cutlass::float_e4m3_t> {
  using Shipped = Fp8Configs;
  using Candidates = Fp8TuneCandidates;
  static int select(int64_t m, int64_t n, int64_t k, int sms) { return select_fp8(m, n, k, sms); }
};

// Runs entry `index` of `Table`; returns -1 when the index is not in it.
template <class ElementAB, class ElementD, class Table, size_t... I>
int run_index(int index, const cw8a8_scaled_mm_args& args, cw8a8_alloc_fn alloc, void* ctx, char* err,
              size_t err_len, std::index_sequence<I...>) {
  int rc = -1;
  ((index == static_cast<int>(I)
        ? (rc = run_scaled_mm<ElementAB, ElementD, std::tuple_element_t<I, Table>>(args, alloc, ctx, err,
                                                                                    err_len),
           0)
        : 0),
   ...);
  return rc;
}

template <class ElementAB, class ElementD>
int run_typed(int index, const cw8a8_scaled_mm_args& args, cw8a8_alloc_fn alloc, void* ctx, char* err,
              size_t err_len) {
  using Tb = Tables<ElementAB>;
  constexpr int shipped = size_of<typename Tb::Shipped>();
  if (index < shipped) {
    return run_index<ElementAB, ElementD, typename Tb::Shipped>(
        index, args, alloc, ctx, err, err_len, std::make_index_sequence<shipped>{});
  }
  if constexpr (kTuneBuild && std::is_same_v<ElementD, cutlass::bfloat16_t>) {
    constexpr int candidates = size_of<typename Tb::Candidates>();
    return run_index<ElementAB, ElementD, typename Tb::Candidates>(
        index - shipped, args, alloc, ctx, err, err_len, std::make_index_sequence<candidates>{});
  }
  std::snprintf(err, err_len, "sm90 scaled_mm: config %d is a tuning candidate, built only with "
                "CUTLASS_W8A8_TUNE=1 and bfloat16 output", index);
  return 1;
}

template <class ElementAB>
int run_ab(const cw8a8_scaled_mm_args& args, cw8a8_alloc_fn alloc, void* ctx, char* err, size_t err_len) {
  const int index =
      args.config >= 0 ? args.config : Tables<ElementAB>::select(args.m, args.n, args.k, args.sm_count);
  switch (args.out_type) {
    case CW8A8_OUT_BF16:
      return run_typed<ElementAB, cutlass::bfloat16_t>(index, args, alloc, ctx, err, err_len);
    case CW8A8_OUT_F16:
      return run_typed<ElementAB, cutlass::half_t>(index, args, alloc, ctx, err, err_len);
    default:
      std::snprintf(err, err_len, "sm90 scaled_mm: unsupported output type %d", args.out_type);
      return 1;
  }
}

template <class ElementAB>
int num_configs() {
  using Tb = Tables<ElementAB>;
  return size_of<typename Tb::Shipped>() + (kTuneBuild ? size_of<typename Tb::Candidates>() : 0);
}

const char* schedule_name(Schedule s) { return s == Schedule::kPingpong ? "pingpong" : "cooperative"; }
const char* scheduler_name(Scheduler s) { return s == Scheduler::kPersistent ? "persistent" : "streamk"; }

template <class Cfg>
std::string config_name() {
  using namespace cute;
  char buf[128];
  std::snprintf(buf, sizeof(buf), "%s%dx%dx%d_c%dx%d_%s_%s%s", Cfg::kSwapAB ? "swap_" : "",
                int(size<0>(typename Cfg::TileShape{})), int(size<1>(typename Cfg::TileShape{})),
                int(size<2>(typename Cfg::TileShape{})), int(size<0>(typename Cfg::ClusterShape{})),
                int(size<1>(typename Cfg::ClusterShape{})), schedule_name(Cfg::kSchedule),
                scheduler_name(Cfg::kScheduler), Cfg::kFastAccum ? "_fastaccum" : "");
  return buf;
}

template <class Table, size_t... I>
const std::string* names_of(std::index_sequence<I...>) {
  static const std::string names[] = {config_name<std::tuple_element_t<I, Table>>()...};
  return names;
}

template <class ElementAB>
const char* name_of(int index) {
  using Tb = Tables<ElementAB>;
  constexpr int shipped = size_of<typename Tb::Shipped>();
  constexpr int candidates = size_of<typename Tb::Candidates>();
  if (index < 0 || index >= num_configs<ElementAB>()) return nullptr;
  if (index < shipped) return names_of<typename Tb::Shipped>(std::make_index_sequence<shipped>{})[index].c_str();
  return names_of<typename Tb::Candidates>(std::make_index_sequence<candidates>{})[index - shipped].c_str();
}

}  // namespace
}  // namespace cutlass_w8a8::sm90

extern "C" {

__attribute__((visibility("default"))) int cw8a8_sm90_scaled_mm(const cw8a8_scaled_mm_args* args,
                                                                 cw8a8_alloc_fn alloc, void* alloc_ctx,
                                                                 char* err, size_t err_len) {
  using namespace cutlass_w8a8::sm90;
  switch (args->ab_type) {
    case CW8A8_AB_INT8:
      return run_ab<int8_t>(*args, alloc, alloc_ctx, err, err_len);
    case CW8A8_AB_FP8_E4M3:
      return run_ab<cutlass::float_e4m3_t>(*args, alloc, alloc_ctx, err, err_len);
    default:
      std::snprintf(err, err_len, "sm90 scaled_mm: unsupported operand type %d", args->ab_type);
      return 1;
  }
}

__attribute__((visibility("default"))) int cw8a8_sm90_num_configs(int ab_type) {
  using namespace cutlass_w8a8::sm90;
  return ab_type == CW8A8_AB_INT8 ? num_configs<int8_t>() : num_configs<cutlass::float_e4m3_t>();
}

__attribute__((visibility("default"))) const char* cw8a8_sm90_config_name(int ab_type, int i) {
  using namespace cutlass_w8a8::sm90;
  return ab_type == CW8A8_AB_INT8 ? name_of<int8_t>(i) : name_of<cutlass::float_e4m3_t>(i);
}

}  // extern "C"
