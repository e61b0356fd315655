// The one boundary between Python and the CUDA code of _C.
//
// Tensor ops: their schemas are defined in Python (one `torch.library.Library` DEF block in cutlass_w8a8/ops) rather
// than in a TORCH_LIBRARY block here, so that a CPU-only install, which builds no extension, still has the ops with
// their CPU reference implementations and fake (meta) kernels. This library adds their CUDA kernels.
//
// Non-tensor ops (status, PDL, the decode-GEMM bound, CUDA-graph records): defined here, with catch-all kernels (they take no tensors, so
// they need no dispatch key); a CPU-only install simply does not have them, and cutlass_w8a8/_ext.py says so.
// Handles (cudaGraph_t, cudaGraphExec_t) cross as int.
//
// The library is loaded with torch.ops.load_library and needs no Python module init.
#include <string>
#include <tuple>
#include <vector>

#include <torch/library.h>

#include "core/launch_policy.hpp"
#include "gemm/kernel_libraries.hpp"
#include "graphs/graph_nodes.hpp"
#include "ops.hpp"

namespace cutlass_w8a8 {
namespace {

bool get_pdl_op() { return pdl_enabled(); }
bool set_pdl_op(bool enabled) { return set_pdl(enabled); }
int64_t get_decode_gemm_max_m_op() { return decode_gemm_max_m(); }
int64_t set_decode_gemm_max_m_op(int64_t m) { return set_decode_gemm_max_m(m); }
bool supports_fp8_op(int64_t device) {
  TORCH_CHECK_VALUE(device >= 0, "cutlass_w8a8._supports_fp8: `device` must be a CUDA device index, got ", device);
  return supports_fp8(static_cast<int>(device));
}

int64_t graph_record_begin_op() { return graph_nodes::record_begin(); }
int64_t graph_record_end_op(bool check) { return graph_nodes::record_end(check); }

// (kind, device, graph, rows, bound_rows, captured_rows, n, k, config), op name
std::tuple<std::vector<int64_t>, std::string> graph_record_info_op(int64_t record) {
  const graph_nodes::RecordInfo r = graph_nodes::record_info(record);
  return {{r.kind, r.device, r.graph, r.rows, r.bound_rows, r.captured_rows, r.n, r.k, r.config}, r.op};
}

void graph_set_rows_op(int64_t graph_exec, at::IntArrayRef records, int64_t rows) {
  graph_nodes::set_rows(graph_exec, records, rows);
}
void graph_release_op(at::IntArrayRef records) { graph_nodes::release(records); }
bool graph_exec_update_op(int64_t graph_exec, int64_t graph) { return graph_nodes::exec_update(graph_exec, graph); }

}  // namespace
}  // namespace cutlass_w8a8

TORCH_LIBRARY_FRAGMENT(cutlass_w8a8, m) {
  using namespace cutlass_w8a8;
  m.def("_get_pdl() -> bool", &get_pdl_op);
  m.def("_set_pdl(bool enabled) -> bool", &set_pdl_op);
  m.def("_get_decode_gemm_max_m() -> int", &get_decode_gemm_max_m_op);
  m.def("_set_decode_gemm_max_m(int m) -> int", &set_decode_gemm_max_m_op);
  m.def("_supports_fp8(int device) -> bool", &supports_fp8_op);
  // decode attention's path for given sizes ("fused" / "split") and the switch that allows the fused one
  m.def("_decode_attention_path(int device, int batch, int heads, int kv_heads, int seq_len, int head_dim, "
        "ScalarType dtype) -> str", &decode_attention_path);
  m.def("_set_decode_attention_fused(bool enabled) -> bool", &set_decode_attention_fused);
  // decode attention's query heads per CTA for a GQA group size (heads_per_cta)
  m.def("_decode_attention_heads_per_cta(int group) -> int", &decode_attention_heads_per_cta);
  // moe_router_route's cluster size and H slices for given sizes
  m.def("_moe_router_route_plan(int device, int experts, int hidden, ScalarType dtype) -> int[]",
        &moe_router_route_plan);
  // moe_decode_experts' path for given sizes ("two-kernel" / "three-kernel")
  m.def("_moe_decode_path(int tokens, int top_k, int hidden, int intermediate, int group_size) -> str",
        &moe_decode_path);
  // the largest T grouped_scaled_mm sends to the grouped decode kernel (tests pick T on both sides of it)
  m.def("_grouped_decode_max_rows() -> int", &grouped_decode_max_rows_op);
  m.def("_graph_record_begin() -> int", &graph_record_begin_op);
  m.def("_graph_record_end(bool check) -> int", &graph_record_end_op);
  m.def("_graph_record_info(int record) -> (int[], str)", &graph_record_info_op);
  m.def("_graph_set_rows(int graph_exec, int[] records, int rows) -> ()", &graph_set_rows_op);
  m.def("_graph_release(int[] records) -> ()", &graph_release_op);
  m.def("_graph_exec_update(int graph_exec, int graph) -> bool", &graph_exec_update_op);
}

TORCH_LIBRARY_IMPL(cutlass_w8a8, CUDA, m) {
  m.impl("scaled_mm", &cutlass_w8a8::scaled_mm);
  m.impl("scaled_mm_out", &cutlass_w8a8::scaled_mm_out);
  m.impl("_scaled_mm_config", &cutlass_w8a8::scaled_mm_config_out);
  m.impl("w8a8_linear", &cutlass_w8a8::w8a8_linear);
  m.impl("decode_layer", &cutlass_w8a8::decode_layer);
  m.impl("scaled_mm_decode", &cutlass_w8a8::scaled_mm_decode);
  m.impl("scaled_mm_decode_out", &cutlass_w8a8::scaled_mm_decode_out);
  m.impl("linear_decode", &cutlass_w8a8::linear_decode);
  m.impl("linear_decode_out", &cutlass_w8a8::linear_decode_out);
  m.impl("add_rms_norm_linear_decode", &cutlass_w8a8::add_rms_norm_linear_decode);
  m.impl("quantize_per_token", &cutlass_w8a8::quantize_per_token);
  m.impl("quantize_per_tensor", &cutlass_w8a8::quantize_per_tensor);
  m.impl("quantize_per_token_group", &cutlass_w8a8::quantize_per_token_group);
  m.impl("rms_norm", &cutlass_w8a8::rms_norm);
  m.impl("fused_add_rms_norm", &cutlass_w8a8::fused_add_rms_norm);
  m.impl("rms_norm_quant", &cutlass_w8a8::rms_norm_quant);
  m.impl("silu_mul", &cutlass_w8a8::silu_mul);
  m.impl("silu_mul_quant", &cutlass_w8a8::silu_mul_quant);
  m.impl("decode_attention", &cutlass_w8a8::decode_attention);
  m.impl("decode_attention_out", &cutlass_w8a8::decode_attention_out);
  m.impl("decode_attention_quant", &cutlass_w8a8::decode_attention_quant);
  m.impl("_graph_update_scaled_mm", &cutlass_w8a8::graph_nodes::graph_update_scaled_mm);
  m.impl("rope_kv_cache_", &cutlass_w8a8::rope_kv_cache_);
  m.impl("grouped_scaled_mm", &cutlass_w8a8::grouped_scaled_mm);
  m.impl("grouped_scaled_mm_out", &cutlass_w8a8::grouped_scaled_mm_out);
  m.impl("_grouped_scaled_mm_config", &cutlass_w8a8::grouped_scaled_mm_config_out);
  m.impl("moe_topk_softmax", &cutlass_w8a8::moe_topk_softmax);
  m.impl("moe_route", &cutlass_w8a8::moe_route);
  m.impl("moe_router_route", &cutlass_w8a8::moe_router_route);
  m.impl("add_rms_norm_moe_router_route", &cutlass_w8a8::add_rms_norm_moe_router_route);
  m.impl("moe_align", &cutlass_w8a8::moe_align);
  m.impl("moe_permute_quant", &cutlass_w8a8::moe_permute_quant);
  m.impl("moe_unpermute", &cutlass_w8a8::moe_unpermute);
  m.impl("moe_unpermute_out", &cutlass_w8a8::moe_unpermute_out);
  m.impl("moe_decode_experts", &cutlass_w8a8::moe_decode_experts);
}
