// decode_layer: one decoder layer of the reference Llama decoder (cutlass_w8a8/models/llama.py,
// LlamaDecoderLayer) in one op call, for eager decoding. It launches exactly the kernels the layer's Python code
// launches through its op calls -- the fused norms, the four GEMMs, rotary + cache write, decode attention (with
// o_proj's quantization folded in for 8-bit weights), the activation -- by calling the same C++ functions in the same order, so results are bit-identical to the
// Python path; what it removes is the host cost of ten Python-to-dispatcher crossings per layer (the eager step
// of a small batch is host-bound: tens of microseconds per crossing on the GPU machines here).
//
// Projections: all four 8-bit (int8 or float8_e4m3fn [N, K] weights with float32 weight scales and optional
// static input scales: the W8A8 path, activations quantized by the fused norm / SiLU ops) or all in the model
// dtype (plain x @ w^T through at::linear, as nn.Linear: the bf16 model). Biases are not supported (the decoder has none).
// Block-scaled fp8 layers (2-D weight scales [ceil(N/128), K/128]) are not served here: the decoder runs their Python
// path (LlamaDecoderLayer._layer_op_operands), which quantizes per 1 x 128 group. Given to this op anyway, their GEMM
// refuses the per-token activation scales this op makes (scaled_mm: "`scale_a` must be [M, K/128] ..."). The fused
// ops are called with group_size 0 (per token, or per tensor with a static input scale).
// CUDA-graph capture and node recording work as for the individual ops (the same launch functions record).
#include <optional>
#include <tuple>

#include <ATen/ATen.h>

#include "core/checks.hpp"
#include "core/limits.hpp"
#include "ops.hpp"

namespace cutlass_w8a8 {
namespace {

constexpr const char* kOp = "decode_layer";

struct Proj {
  const char* name;
  const at::Tensor& w;
  const std::optional<at::Tensor>& ws;  // weight scale (8-bit weights only)
  const std::optional<at::Tensor>& is;  // static input scale (8-bit weights only), or none: per-token
};

// x @ w^T for a float projection; for an 8-bit one, the GEMM of already quantized activations (q, per-token
// scale s, or the static input scale).
at::Tensor project(const Proj& p, const at::Tensor& x, const at::Tensor& q, const at::Tensor& s,
                   at::ScalarType dtype) {
  if (!is_ab_dtype(p.w.scalar_type())) return at::linear(x, p.w);  // what nn.Linear (no bias) calls
  // decode_layer has no fp8_fast_accum argument: the package default (core/limits.hpp, pinned to ops/_limits.py)
  return scaled_mm(q, p.w.t(), p.is ? *p.is : s, *p.ws, dtype, std::nullopt, limits::kFp8FastAccumDefault != 0);
}

}  // namespace

at::Tensor decode_layer(const std::optional<at::Tensor>& h, at::Tensor& residual, const at::Tensor& input_norm,
                        const at::Tensor& post_norm, double eps, const at::Tensor& qkv_w,
                        const std::optional<at::Tensor>& qkv_ws, const std::optional<at::Tensor>& qkv_is,
                        const at::Tensor& o_w, const std::optional<at::Tensor>& o_ws,
                        const std::optional<at::Tensor>& o_is, const at::Tensor& gate_up_w,
                        const std::optional<at::Tensor>& gate_up_ws, const std::optional<at::Tensor>& gate_up_is,
                        const at::Tensor& down_w, const std::optional<at::Tensor>& down_ws,
                        const std::optional<at::Tensor>& down_is, at::Tensor& kv_cache, const at::Tensor& rope,
                        const at::Tensor& slots, const at::Tensor& positions, int64_t num_heads,
                        int64_t num_kv_heads, double softmax_scale) {
  const Proj qkv{"qkv_w", qkv_w, qkv_ws, qkv_is}, o{"o_w", o_w, o_ws, o_is};
  const Proj gate_up{"gate_up_w", gate_up_w, gate_up_ws, gate_up_is}, down{"down_w", down_w, down_ws, down_is};
  const at::ScalarType dtype = residual.scalar_type();
  CW8A8_CHECK_TYPE(dtype == at::kBFloat16 || dtype == at::kHalf, kOp, "residual",
                   "must be bfloat16 or float16, got ", py_dtype(dtype));
  CW8A8_CHECK_VALUE(residual.dim() == 2, kOp, "residual", "must be 2-D (B, hidden), got shape ",
                    py_tuple(residual.sizes()));
  const bool quantized = is_ab_dtype(qkv_w.scalar_type());
  const at::ScalarType qtype = qkv_w.scalar_type();
  for (const Proj* p : {&qkv, &o, &gate_up, &down}) {
    if (quantized) {
      CW8A8_CHECK_TYPE(p->w.scalar_type() == qtype, kOp, p->name, "must have qkv_w's dtype ", py_dtype(qtype),
                       " (all four projections 8-bit alike, or all in the model dtype), got ",
                       py_dtype(p->w.scalar_type()));
      CW8A8_CHECK_VALUE(p->ws.has_value(), kOp, p->name, "is 8-bit: its weight scale must be given");
    } else {
      CW8A8_CHECK_TYPE(p->w.scalar_type() == dtype, kOp, p->name, "must have the model dtype ", py_dtype(dtype),
                       " (all four projections in the model dtype, or all 8-bit alike), got ",
                       py_dtype(p->w.scalar_type()));
      CW8A8_CHECK_VALUE(!p->ws.has_value() && !p->is.has_value(), kOp, p->name,
                        "is not 8-bit: it takes no weight or input scale");
    }
  }
  const int64_t b = residual.size(0);
  const int64_t d = num_kv_heads > 0 && num_heads > 0 ? qkv_w.size(0) / (num_heads + 2 * num_kv_heads) : 0;
  CW8A8_CHECK_VALUE(num_heads > 0 && num_kv_heads > 0 && d > 0 && qkv_w.size(0) == (num_heads + 2 * num_kv_heads) * d,
                    kOp, "qkv_w", "must have (num_heads + 2 * num_kv_heads) * head_dim rows, got shape ",
                    py_tuple(qkv_w.sizes()), " for num_heads = ", num_heads, ", num_kv_heads = ", num_kv_heads);

  // input_layernorm, with the residual add (vLLM's fused_add_rms_norm) after the first layer
  at::Tensor x, q, s;
  if (quantized) {
    std::tie(q, s) = h ? rms_norm_quant(*h, input_norm, eps, qtype, qkv_is, residual, 0)
                       : rms_norm_quant(residual, input_norm, eps, qtype, qkv_is, std::nullopt, 0);
  } else {
    x = h ? fused_add_rms_norm(*h, residual, input_norm, eps) : rms_norm(residual, input_norm, eps);
  }
  // attention: qkv projection, rotary + cache write, decode attention over the slot's positions, o_proj
  at::Tensor qkv_out = project(qkv, x, q, s, dtype).view({b, num_heads + 2 * num_kv_heads, d});
  rope_kv_cache_(qkv_out, rope, kv_cache, slots, positions, num_heads, num_kv_heads, std::nullopt, std::nullopt, 0.0);
  // o_proj: for 8-bit weights, attention's output comes quantized for it (decode_attention_quant, the same q and
  // scales as quantizing the stored row), as the Python path's LlamaAttention does
  at::Tensor attn_out;
  if (quantized) {
    std::tie(q, s) = decode_attention_quant(qkv_out.narrow(1, 0, num_heads), kv_cache, slots, positions,
                                            softmax_scale, qtype, o_is);
    attn_out = project(o, x, q, s, dtype);
  } else {
    attn_out = at::linear(decode_attention(qkv_out.narrow(1, 0, num_heads), kv_cache, slots, positions,
                                           softmax_scale), o_w);
  }
  // post_attention_layernorm (residual += attn_out), then the SwiGLU MLP
  if (quantized) {
    std::tie(q, s) = rms_norm_quant(attn_out, post_norm, eps, qtype, gate_up_is, residual, 0);
  } else {
    x = fused_add_rms_norm(attn_out, residual, post_norm, eps);
  }
  const at::Tensor gu = project(gate_up, x, q, s, dtype);
  if (quantized) {
    std::tie(q, s) = silu_mul_quant(gu, qtype, down_is, 0);
  } else {
    x = silu_mul(gu);
  }
  return project(down, x, q, s, dtype);
}

}  // namespace cutlass_w8a8
