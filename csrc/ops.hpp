// The CUDA implementations of the tensor ops, registered in torch_bindings.cpp (the graph-update op is declared in
// graphs/graph_nodes.hpp). Schemas and docs: the Python op definitions (cutlass_w8a8/ops).
#pragma once

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>

namespace cutlass_w8a8 {

// gemm/scaled_mm_entry.cu
// fp8_fast_accum (the schema's, default ops/_limits.py FP8_FAST_ACCUM): row-wise fp8 on sm90 chooses among the
// fast-accumulation configs (true) or the accurate ones (false); kernel_api.h cw8a8_scaled_mm_args.fp8_fast_accum.
at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                     const at::Tensor& scale_b, at::ScalarType out_dtype, const std::optional<at::Tensor>& bias,
                     bool fp8_fast_accum);
void scaled_mm_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                   const at::Tensor& scale_b, const std::optional<at::Tensor>& bias, bool fp8_fast_accum);
void scaled_mm_config_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                          const at::Tensor& scale_b, const std::optional<at::Tensor>& bias, int64_t config);

// gemm/w8a8_linear.cu: a W8A8Linear forward (activation quantization + scaled_mm) in one op
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                       const std::optional<at::Tensor>& input_scale, const std::optional<at::Tensor>& bias,
                       at::ScalarType out_dtype, bool fp8_fast_accum);

// models/decode_layer.cpp: one layer of the reference decoder (models/llama.py) in one op call, for eager decoding
at::Tensor decode_layer(const std::optional<at::Tensor>& h, at::Tensor& residual, const at::Tensor& input_norm,
                        const at::Tensor& post_norm, double eps, const at::Tensor& qkv_w,
                        const std::optional<at::Tensor>& qkv_ws, const std::optional<at::Tensor>& qkv_is,
                        const at::Tensor& o_w, const std::optional<at::Tensor>& o_ws,
                        const std::optional<at::Tensor>& o_is, const at::Tensor& gate_up_w,
                        const std::optional<at::Tensor>& gate_up_ws, const std::optional<at::Tensor>& gate_up_is,
                        const at::Tensor& down_w, const std::optional<at::Tensor>& down_ws,
                        const std::optional<at::Tensor>& down_is, at::Tensor& kv_cache, const at::Tensor& rope,
                        const at::Tensor& slots, const at::Tensor& positions, int64_t num_heads,
                        int64_t num_kv_heads, double softmax_scale);

// gemm/grouped_mm_entry.cu: the mixture-of-experts grouped GEMM (a [T, K] rows grouped by expert, b [E, K, N],
// offsets int32 [E] end rows); T <= grouped_decode_max_rows() runs the grouped decode kernel, larger T the sm90
// CUTLASS ptr-array grouped GEMM
at::Tensor grouped_scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                             const at::Tensor& scale_b, const at::Tensor& offsets, at::ScalarType out_dtype,
                             const std::optional<at::Tensor>& bias);
void grouped_scaled_mm_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                           const at::Tensor& scale_b, const at::Tensor& offsets,
                           const std::optional<at::Tensor>& bias);
// _grouped_scaled_mm_config: grouped_scaled_mm_out with entry `config` of the sm90 library's grouped table (tuning)
void grouped_scaled_mm_config_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                                  const at::Tensor& scale_b, const at::Tensor& offsets,
                                  const std::optional<at::Tensor>& bias, int64_t config);
int64_t grouped_decode_max_rows_op();

// gemm/decode/scaled_mm_decode.cu: M <= 16 GEMMs that stream the weights with every SM busy; linear_decode also
// quantizes x per token inside the kernel
at::Tensor scaled_mm_decode(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                            const at::Tensor& scale_b, at::ScalarType out_dtype,
                            const std::optional<at::Tensor>& bias);
void scaled_mm_decode_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                          const at::Tensor& scale_b, const std::optional<at::Tensor>& bias);
at::Tensor linear_decode(const at::Tensor& x, const at::Tensor& b, const at::Tensor& scale_b,
                         const std::optional<at::Tensor>& bias, at::ScalarType dtype);
void linear_decode_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& b, const at::Tensor& scale_b,
                       const std::optional<at::Tensor>& bias, at::ScalarType dtype);
// The input RMSNorm (residual add, per-token quantization) and the decode GEMM in one kernel: (out, residual_out).
std::tuple<at::Tensor, at::Tensor> add_rms_norm_linear_decode(const at::Tensor& x,
                                                              const std::optional<at::Tensor>& residual,
                                                              const at::Tensor& norm_weight, double eps,
                                                              const at::Tensor& b, const at::Tensor& scale_b,
                                                              const std::optional<at::Tensor>& bias,
                                                              at::ScalarType dtype);

// quant/quantize.cu
std::tuple<at::Tensor, at::Tensor> quantize_per_token(const at::Tensor& x, at::ScalarType dtype);
at::Tensor quantize_per_tensor(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype);
// quant/quantize_group.cu: dynamic 1 x 128 groups, (q [..., K], scale float32 [..., K / 128])
std::tuple<at::Tensor, at::Tensor> quantize_per_token_group(const at::Tensor& x, int64_t group_size,
                                                            at::ScalarType dtype);

// quant/rms_norm.cu, quant/silu_mul.cu: RMSNorm (with the residual add) and SiLU-and-mul, optionally fused with quantization
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor fused_add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
// group_size: 0 (per token, or per tensor with `scale`) or 128 (per 1 x 128 group: scale [..., K / 128])
std::tuple<at::Tensor, at::Tensor> rms_norm_quant(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                  at::ScalarType dtype, const std::optional<at::Tensor>& scale,
                                                  const std::optional<at::Tensor>& residual, int64_t group_size);
at::Tensor silu_mul(const at::Tensor& x);
std::tuple<at::Tensor, at::Tensor> silu_mul_quant(const at::Tensor& x, at::ScalarType dtype,
                                                  const std::optional<at::Tensor>& scale, int64_t group_size);

// attention/decode_attention.cu
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& slots,
                            const at::Tensor& positions, double softmax_scale);
void decode_attention_out(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                          const at::Tensor& slots, const at::Tensor& positions, double softmax_scale);
// The path decode_attention(_quant) takes for these sizes on `device` now: "fused" (one kernel, a cluster per row)
// or "split" (split + combine kernels); and the private switch that allows the fused path (returns the previous
// setting). Tests and benchmarks compare the two paths with them.
std::string decode_attention_path(int64_t device, int64_t batch, int64_t heads, int64_t kv_heads, int64_t seq_len,
                                  int64_t head_dim, at::ScalarType dtype);
bool set_decode_attention_fused(bool enabled);
// The query heads per CTA (G') decode_attention(_quant) runs for a GQA group of `group` = H / KVH query heads per KV
// head in this process (heads_per_cta: the largest of 8, 4, 2, 1 dividing the group and at most the cap, default 4
// or CUTLASS_W8A8_ATTN_HEADS_PER_CTA).
int64_t decode_attention_heads_per_cta(int64_t group);
// moe_router_route's launch for E experts of H in `dtype` on `device`: {cluster CTAs, H slices per 16-expert tile}
// ({0, 0} where clusters are not available: the op runs F.linear and moe_route). Tests use it to know which
// configuration they exercised.
std::vector<int64_t> moe_router_route_plan(int64_t device, int64_t experts, int64_t hidden, at::ScalarType dtype);
// decode_attention, rounded to q's dtype, then quantized per token (or with a static scale) for o_proj: (q, scales)
std::tuple<at::Tensor, at::Tensor> decode_attention_quant(const at::Tensor& q, const at::Tensor& kv_cache,
                                                          const at::Tensor& slots, const at::Tensor& positions,
                                                          double softmax_scale, at::ScalarType dtype,
                                                          const std::optional<at::Tensor>& scale);

// attention/rope_kv_cache.cu; q_norm / k_norm (both or neither): Qwen3's head norms, applied first
void rope_kv_cache_(at::Tensor& qkv, const at::Tensor& rope, at::Tensor& kv_cache, const at::Tensor& slots,
                    const at::Tensor& positions, int64_t num_heads, int64_t num_kv_heads,
                    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double eps);

// moe/routing.cu, moe/permute_quant.cu: the MoE routing around the grouped GEMMs (cutlass_w8a8/ops/moe.py)
std::tuple<at::Tensor, at::Tensor> moe_topk_softmax(const at::Tensor& router_logits, int64_t top_k, bool renormalize);
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& router_logits, int64_t top_k, c10::string_view scoring,
                                             const std::optional<at::Tensor>& correction_bias, int64_t n_group,
                                             int64_t topk_group, bool renormalize, double scaling_factor);
// moe/router_route.cu: the router GEMM and moe_route in one kernel at decode sizes
std::tuple<at::Tensor, at::Tensor> moe_router_route(const at::Tensor& x, const at::Tensor& router_weight, int64_t top_k,
                                                    c10::string_view scoring,
                                                    const std::optional<at::Tensor>& correction_bias, int64_t n_group,
                                                    int64_t topk_group, bool renormalize, double scaling_factor,
                                                    std::optional<at::ScalarType> logits_dtype);
// The post-attention norm (residual add, RMSNorm) folded into moe_router_route: (y, residual_out, topk_weights,
// topk_ids), bit for bit fused_add_rms_norm on a copy of residual, then moe_router_route(y, ...).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_rms_norm_moe_router_route(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& norm_weight, double eps,
    const at::Tensor& router_weight, int64_t top_k, c10::string_view scoring,
    const std::optional<at::Tensor>& correction_bias, int64_t n_group, int64_t topk_group, bool renormalize,
    double scaling_factor, std::optional<at::ScalarType> logits_dtype);
std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_align(const at::Tensor& topk_ids, int64_t num_experts);
std::tuple<at::Tensor, at::Tensor> moe_permute_quant(const at::Tensor& x, const at::Tensor& sorted_pairs,
                                                     int64_t top_k, at::ScalarType dtype,
                                                     const std::optional<at::Tensor>& scale, int64_t group_size);
at::Tensor moe_unpermute(const at::Tensor& y, const at::Tensor& dst_pos, const at::Tensor& topk_weights);
void moe_unpermute_out(at::Tensor& out, const at::Tensor& y, const at::Tensor& dst_pos,
                       const at::Tensor& topk_weights);
// moe/moe_decode.cu: the routed experts of a SwiGLU MoE layer at T * top_k <= 64 pairs in two or three kernels,
// equal bit for bit to moe_align -> moe_permute_quant -> grouped_scaled_mm -> silu_mul_quant -> grouped_scaled_mm ->
// moe_unpermute
at::Tensor moe_decode_experts(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                              const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w2,
                              const at::Tensor& w2_scale, int64_t group_size, at::ScalarType out_dtype);
// The path moe_decode_experts takes at T tokens, top_k, H, I and group_size in this process (own_quant, the rule
// the op launches by; it reads CUTLASS_W8A8_MOE_DECODE_PREP): "two-kernel" or "three-kernel". Tests and benchmarks
// use it to know which path they exercised.
std::string moe_decode_path(int64_t tokens, int64_t top_k, int64_t hidden, int64_t intermediate,
                            int64_t group_size);

}  // namespace cutlass_w8a8
