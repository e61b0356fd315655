// C entry points of the sm90 kernel library (see csrc/gemm/kernel_api.h): choose a config from the table of the
// arguments (int8, fp8, block-scaled fp8: cw8a8_config_table_of) and run it, or describe its launch.
#include <cstdio>
#include <string>
#include <type_traits>
#include <utility>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cutlass/numeric_types.h>

#include "gemm/sm90/scaled_mm_sm90_dispatch.cuh"

// The TMA descriptor encoder every sm90 launch calls (twice for A and B, once for D). CUTLASS resolves it through
// cudaGetDriverEntryPointByVersion on every call (cutlass/cuda_host_adapter.hpp). setup.py compiles this library
// with CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL and -DcuTensorMapEncodeTiled=cw8a8_cuTensorMapEncodeTiled, so
// CUTLASS calls this function instead (cuda.h's declaration is renamed with it): the entry point is resolved once
// per process, and the library still has no link-time dependency on libcuda.
extern "C" CUresult cw8a8_cuTensorMapEncodeTiled(CUtensorMap* tensor_map, CUtensorMapDataType data_type,
                                                 cuuint32_t rank, void* address, const cuuint64_t* dims,
                                                 const cuuint64_t* strides, const cuuint32_t* box,
                                                 const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
                                                 CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2_promotion,
                                                 CUtensorMapFloatOOBfill oob_fill) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t ce = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                                            &found);
    return ce == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)
               : nullptr;
  }();
  if (encode == nullptr) return CUDA_ERROR_NOT_FOUND;
  return encode(tensor_map, data_type, rank, address, dims, strides, box, element_strides, interleave, swizzle,
                l2_promotion, oob_fill);
}

namespace cutlass_w8a8::sm90 {
namespace {

// Which tables' tuning candidates this build compiled (setup.py: CUTLASS_W8A8_TUNE=1 all, or a list of tables).
#ifdef CUTLASS_W8A8_TUNE_INT8
constexpr bool kTuneInt8 = true;
#else
constexpr bool kTuneInt8 = false;
#endif
#ifdef CUTLASS_W8A8_TUNE_FP8
constexpr bool kTuneFp8 = true;
#else
constexpr bool kTuneFp8 = false;
#endif
#ifdef CUTLASS_W8A8_TUNE_FP8_BLOCK
constexpr bool kTuneFp8Block = true;
#else
constexpr bool kTuneFp8Block = false;
#endif

// The config tables, keyed by their operand type (int8_t, cutlass::float_e4m3_t) or BlockFp8 (block-scaled fp8):
// the shipped configs, the tuning candidates (kTuned: compiled into this build), the choice by shape, and the kernel
// functions of a config.
struct BlockFp8 {};

template <class ShippedConfigs, bool kTunedIn, class TuneCandidates, int (*kSelect)(int64_t, int64_t, int64_t, int)>
struct TableOf {
  using Shipped = ShippedConfigs;
  static constexpr bool kTuned = kTunedIn;
  using Candidates = TuneCandidates;
  // fp8_fast_accum: only the row-wise fp8 table chooses by it (Tables<float_e4m3_t> below)
  static int select(int64_t m, int64_t n, int64_t k, int sms, bool /*fp8_fast_accum*/) { return kSelect(m, n, k, sms); }
};

// The row-wise fp8 table: fast-accumulation or accurate rows (select_fp8, kernel_api.h fp8_fast_accum).
struct Fp8TableOf {
  using Shipped = Fp8Configs;
  static constexpr bool kTuned = kTuneFp8;
  using Candidates = Fp8TuneCandidates;
  static int select(int64_t m, int64_t n, int64_t k, int sms, bool fp8_fast_accum) {
    return select_fp8(m, n, k, sms, fp8_fast_accum);
  }
};

// The kernel functions of the row-wise tables' configs: scaled_mm_sm90.cuh's ScaledMmKernel on ElementAB operands.
template <class ElementAB>
struct RowwiseKernels {
  template <class ElementD, class Cfg>
  static int run(const cw8a8_scaled_mm_args& a, cw8a8_alloc_fn alloc, void* ctx, char* err, size_t err_len) {
    return run_scaled_mm<ElementAB, ElementD, Cfg>(a, alloc, ctx, err, err_len);
  }
  template <class ElementD, class Cfg>
  static int node(const cw8a8_scaled_mm_args& a, cw8a8_kernel_node* node, char* err, size_t err_len) {
    return scaled_mm_node<ElementAB, ElementD, Cfg>(a, node, err, err_len);
  }
};

// The block-scaled table's: scaled_mm_sm90_blockwise.cuh's BlockScaledMmKernel.
struct BlockKernels {
  template <class ElementD, class Cfg>
  static int run(const cw8a8_scaled_mm_args& a, cw8a8_alloc_fn alloc, void* ctx, char* err, size_t err_len) {
    return run_scaled_mm_block<ElementD, Cfg>(a, alloc, ctx, err, err_len);
  }
  template <class ElementD, class Cfg>
  static int node(const cw8a8_scaled_mm_args& a, cw8a8_kernel_node* node, char* err, size_t err_len) {
    return scaled_mm_block_node<ElementD, Cfg>(a, node, err, err_len);
  }
};

template <class Key>
struct Tables;
template <>
struct Tables<int8_t> : TableOf<Int8Configs, kTuneInt8, Int8TuneCandidates, select_int8>, RowwiseKernels<int8_t> {};
template <>
struct Tables<cutlass::float_e4m3_t> : Fp8TableOf, RowwiseKernels<cutlass::float_e4m3_t> {};
template <>
struct Tables<BlockFp8> : TableOf<Fp8BlockConfigs, kTuneFp8Block, Fp8BlockTuneCandidates, select_fp8_block>,
                          BlockKernels {};

// Calls f(Cfg{}) with Cfg entry `index` of `Table` (configs are empty tag types); -1 when the index is not in it.
template <class Table, class F, size_t... I>
int visit_index(int index, F&& f, std::index_sequence<I...>) {
  int rc = -1;
  ((index == static_cast<int>(I) ? (rc = f(std::tuple_element_t<I, Table>{}), 0) : 0), ...);
  return rc;
}

// Calls f(Cfg{}) with the config of table index `index` (shipped entries, then tuning candidates).
template <class Key, class ElementD, class F>
int visit_typed(int index, F&& f, char* err, size_t err_len) {
  using Tb = Tables<Key>;
  constexpr int shipped = size_of<typename Tb::Shipped>();
  if (index < shipped) {
    return visit_index<typename Tb::Shipped>(index, f, std::make_index_sequence<shipped>{});
  }
  if constexpr (Tb::kTuned && std::is_same_v<ElementD, cutlass::bfloat16_t>) {
    constexpr int candidates = size_of<typename Tb::Candidates>();
    return visit_index<typename Tb::Candidates>(index - shipped, f, std::make_index_sequence<candidates>{});
  }
  std::snprintf(err, err_len, "sm90 scaled_mm: config %d is a tuning candidate, built only with bfloat16 output "
                "by CUTLASS_W8A8_TUNE=1 or a CUTLASS_W8A8_TUNE list naming its table (int8, fp8, fp8-block)", index);
  return 1;
}

// The table index args.config, or the one dispatch chooses for the shape when it is negative.
template <class Key>
int config_index(const cw8a8_scaled_mm_args& args) {
  return args.config >= 0 ? args.config
                          : Tables<Key>::select(args.m, args.n, args.k, args.sm_count, args.fp8_fast_accum != 0);
}

// Calls f.template operator()<ElementD>() for the output type of args; an error for an unknown type.
template <class F>
int visit_out(const cw8a8_scaled_mm_args& args, F&& f, char* err, size_t err_len) {
  switch (args.out_type) {
    case CW8A8_OUT_BF16:
      return f(cutlass::bfloat16_t{});
    case CW8A8_OUT_F16:
      return f(cutlass::half_t{});
    default:
      std::snprintf(err, err_len, "sm90 scaled_mm: unsupported output type %d", args.out_type);
      return 1;
  }
}

template <class Key>
int run_table(const cw8a8_scaled_mm_args& args, cw8a8_alloc_fn alloc, void* ctx, char* err, size_t err_len) {
  const int index = config_index<Key>(args);
  return visit_out(args, [&](auto d) {
    using ElementD = decltype(d);
    return visit_typed<Key, ElementD>(index, [&](auto cfg) {
      return Tables<Key>::template run<ElementD, decltype(cfg)>(args, alloc, ctx, err, err_len);
    }, err, err_len);
  }, err, err_len);
}

template <class Key>
int node_table(const cw8a8_scaled_mm_args& args, cw8a8_kernel_node* node, char* err, size_t err_len) {
  const int index = config_index<Key>(args);
  node->config = index;
  return visit_out(args, [&](auto d) {
    using ElementD = decltype(d);
    return visit_typed<Key, ElementD>(index, [&](auto cfg) {
      return Tables<Key>::template node<ElementD, decltype(cfg)>(args, node, err, err_len);
    }, err, err_len);
  }, err, err_len);
}

// Calls f(Key{}) with the table key of the arguments (cw8a8_config_table_of); an error for an unknown operand type,
// or block scales with int8 operands (the caller's checks refuse those first).
template <class F>
int visit_table(const cw8a8_scaled_mm_args& args, F&& f, char* err, size_t err_len) {
  if (args.ab_type != CW8A8_AB_INT8 && args.ab_type != CW8A8_AB_FP8_E4M3) {
    std::snprintf(err, err_len, "sm90 scaled_mm: unsupported operand type %d", args.ab_type);
    return 1;
  }
  switch (cw8a8_config_table_of(&args)) {
    case CW8A8_TABLE_INT8:
      return f(int8_t{});
    case CW8A8_TABLE_FP8:
      return f(cutlass::float_e4m3_t{});
    case CW8A8_TABLE_FP8_BLOCK:
      if (args.ab_type == CW8A8_AB_FP8_E4M3) return f(BlockFp8{});
      [[fallthrough]];
    default:
      std::snprintf(err, err_len, "sm90 scaled_mm: block scales need float8_e4m3fn operands (operand type %d)",
                    args.ab_type);
      return 1;
  }
}

template <class Key>
int num_configs() {
  using Tb = Tables<Key>;
  return size_of<typename Tb::Shipped>() + (Tb::kTuned ? size_of<typename Tb::Candidates>() : 0);
}

template <class Table, size_t... I>
const std::string* names_of(std::index_sequence<I...>) {
  static const std::string names[] = {config_name<std::tuple_element_t<I, Table>>()...};
  return names;
}

template <class Key>
const char* name_of(int index) {
  using Tb = Tables<Key>;
  constexpr int shipped = size_of<typename Tb::Shipped>();
  constexpr int candidates = size_of<typename Tb::Candidates>();
  if (index < 0 || index >= num_configs<Key>()) return nullptr;
  if (index < shipped) return names_of<typename Tb::Shipped>(std::make_index_sequence<shipped>{})[index].c_str();
  if constexpr (candidates == 0) {  // (an empty table has no names array)
    return nullptr;
  } else {
    return names_of<typename Tb::Candidates>(std::make_index_sequence<candidates>{})[index - shipped].c_str();
  }
}

}  // namespace
}  // namespace cutlass_w8a8::sm90

extern "C" {

__attribute__((visibility("default"))) int cw8a8_sm90_scaled_mm(const cw8a8_scaled_mm_args* args,
                                                                 cw8a8_alloc_fn alloc, void* alloc_ctx,
                                                                 char* err, size_t err_len) {
  using namespace cutlass_w8a8::sm90;
  return visit_table(*args, [&](auto key) {
    return run_table<decltype(key)>(*args, alloc, alloc_ctx, err, err_len);
  }, err, err_len);
}

__attribute__((visibility("default"))) int cw8a8_sm90_scaled_mm_node(const cw8a8_scaled_mm_args* args,
                                                                      cw8a8_kernel_node* node,
                                                                      cudaGraphExec_t exec,
                                                                      cudaGraphNode_t graph_node, char* err,
                                                                      size_t err_len) {
  using namespace cutlass_w8a8::sm90;
  const int rc = visit_table(*args, [&](auto key) {
    return node_table<decltype(key)>(*args, node, err, err_len);
  }, err, err_len);
  if (rc != 0 || exec == nullptr) return rc;
  void* params[] = {node->params};
  cudaKernelNodeParams kp{};
  kp.func = node->func;
  kp.gridDim = dim3(node->grid[0], node->grid[1], node->grid[2]);
  kp.blockDim = dim3(node->block[0], node->block[1], node->block[2]);
  kp.sharedMemBytes = static_cast<unsigned>(node->smem_bytes);
  kp.kernelParams = params;
  kp.extra = nullptr;
  const cudaError_t ce = cudaGraphExecKernelNodeSetParams(exec, graph_node, &kp);
  if (ce != cudaSuccess) {
    std::snprintf(err, err_len, "cudaGraphExecKernelNodeSetParams: %s", cudaGetErrorString(ce));
    return 1;
  }
  return 0;
}

// `table`: a cw8a8_config_table (0 int8, 1 fp8, 2 block-scaled fp8); 0 configs / NULL for any other value.
__attribute__((visibility("default"))) int cw8a8_sm90_num_configs(int table) {
  using namespace cutlass_w8a8::sm90;
  switch (table) {
    case CW8A8_TABLE_INT8: return num_configs<int8_t>();
    case CW8A8_TABLE_FP8: return num_configs<cutlass::float_e4m3_t>();
    case CW8A8_TABLE_FP8_BLOCK: return num_configs<BlockFp8>();
    default: return 0;
  }
}

// The index select_int8 / select_fp8 / select_fp8_block return for a shape (the config scaled_mm runs there when it
// does not take the decode GEMM; the fp8 table's among its fast-accumulation rows when fp8_fast_accum != 0, else its
// accurate ones), for bench/tune_sm90.py's comparison against the shipped choice; -1 for an unknown table.
// sm_count <= 0 reads as 132 (an H100 SXM), as in the select functions.
__attribute__((visibility("default"))) int cw8a8_sm90_select_config(int table, int64_t m, int64_t n, int64_t k,
                                                                     int sm_count, int fp8_fast_accum) {
  using namespace cutlass_w8a8::sm90;
  const bool fast = fp8_fast_accum != 0;
  switch (table) {
    case CW8A8_TABLE_INT8: return Tables<int8_t>::select(m, n, k, sm_count, fast);
    case CW8A8_TABLE_FP8: return Tables<cutlass::float_e4m3_t>::select(m, n, k, sm_count, fast);
    case CW8A8_TABLE_FP8_BLOCK: return Tables<BlockFp8>::select(m, n, k, sm_count, fast);
    default: return -1;
  }
}

__attribute__((visibility("default"))) const char* cw8a8_sm90_config_name(int table, int i) {
  using namespace cutlass_w8a8::sm90;
  switch (table) {
    case CW8A8_TABLE_INT8: return name_of<int8_t>(i);
    case CW8A8_TABLE_FP8: return name_of<cutlass::float_e4m3_t>(i);
    case CW8A8_TABLE_FP8_BLOCK: return name_of<BlockFp8>(i);
    default: return nullptr;
  }
}

}  // extern "C"
