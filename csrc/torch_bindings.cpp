// CUDA implementations of the cutlass_w8a8 ops.
//
// The schemas are defined in Python (cutlass_w8a8/ops.py, one `torch.library.Library` block) rather than in
// a TORCH_LIBRARY block here, so that a CPU-only install, which builds no extension, still has the ops with
// their CPU reference implementations and fake (meta) kernels. This library only adds the CUDA kernels.
// It is loaded with torch.ops.load_library and needs no Python module init.
#include <torch/library.h>

#include "ops.hpp"

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
  m.impl("quantize_per_token", &cutlass_w8a8::quantize_per_token);
  m.impl("quantize_per_tensor", &cutlass_w8a8::quantize_per_tensor);
  m.impl("rms_norm", &cutlass_w8a8::rms_norm);
  m.impl("fused_add_rms_norm", &cutlass_w8a8::fused_add_rms_norm);
  m.impl("rms_norm_quant", &cutlass_w8a8::rms_norm_quant);
  m.impl("silu_mul", &cutlass_w8a8::silu_mul);
  m.impl("silu_mul_quant", &cutlass_w8a8::silu_mul_quant);
  m.impl("decode_attention", &cutlass_w8a8::decode_attention);
  m.impl("decode_attention_out", &cutlass_w8a8::decode_attention_out);
  m.impl("_graph_update_scaled_mm", &cutlass_w8a8::graph_nodes::graph_update_scaled_mm);
  m.impl("rope_kv_cache_", &cutlass_w8a8::rope_kv_cache_);
}
