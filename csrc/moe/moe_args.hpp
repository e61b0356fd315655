// The argument contract of the MoE ops on CUDA: moe_topk_softmax, moe_route, moe_router_route (router_route.cu),
// moe_align, moe_permute_quant, moe_unpermute(_out) and moe_decode_experts (the fused decode path, csrc/moe/moe_decode.cu). The same checks as cutlass_w8a8/ops/_checks.py (check_moe_*), in its order, with its
// exception types and first-line messages character for character (docs/MISUSE.md; tests/test_misuse_table.py
// runs every row on both). The quantization arguments of moe_permute_quant are silu_mul_quant's
// (quant/rowwise_args.hpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include <ATen/ATen.h>

#include "core/checks.hpp"
#include "core/limits.hpp"
#include "quant/rowwise_args.hpp"

namespace cutlass_w8a8::moe {

constexpr const char* kMaxRowsText = "2**31 - 1";  // limits::kMaxRows as the messages write it

// moe_topk_softmax and moe_route: router_logits [T, E] bfloat16 / float16 / float32 (1 <= E <= 1024, any strides),
// then 1 <= top_k <= E. Returns E.
inline int64_t check_router_logits_top_k(const char* op, const at::Tensor& logits, int64_t top_k) {
  CW8A8_CHECK_TYPE(quant::is_row_dtype(logits.scalar_type()), op, "router_logits",
                   "must be bfloat16, float16 or float32, got ", py_dtype(logits.scalar_type()));
  CW8A8_CHECK_VALUE(logits.dim() == 2, op, "router_logits", "must be 2-D [T, E], got shape ",
                    py_tuple(logits.sizes()));
  const int64_t t = logits.size(0), e = logits.size(1);
  CW8A8_CHECK_VALUE(e >= 1 && e <= limits::kMoeMaxExperts, op, "router_logits",
                    "E = router_logits.shape[1] must be in [1, ", limits::kMoeMaxExperts, "], got ", e);
  CW8A8_CHECK_VALUE(t <= limits::kMaxRows, op, "router_logits", "has ", t, " rows; at most ", kMaxRowsText,
                    " are supported");
  CW8A8_CHECK_VALUE(top_k >= 1 && top_k <= e, op, "top_k", "must be in [1, E] with E = ", e, ", got ", top_k);
  return e;
}

inline void check_topk_softmax(const char* op, const at::Tensor& logits, int64_t top_k) {
  check_router_logits_top_k(op, logits, top_k);
}

// moe_route: the logits and top_k as above; scoring "softmax" or "sigmoid"; correction_bias float32 [E] on the
// logits' device (any stride); 1 <= n_group <= 32 dividing E into groups of at least 2 experts (n_group 1: no
// groups); 1 <= topk_group <= n_group; top_k <= topk_group * E / n_group; scaling_factor finite.
// The routing arguments of moe_route for E experts (top_k already in [1, E]); the bias on `ref`'s device.
inline void check_routing_spec(const char* op, int64_t e, const char* ref_name, const at::Tensor& ref, int64_t top_k,
                               c10::string_view scoring, const std::optional<at::Tensor>& bias, int64_t n_group,
                               int64_t topk_group, double scaling_factor) {
  CW8A8_CHECK_VALUE(scoring == "softmax" || scoring == "sigmoid", op, "scoring",
                    "must be 'softmax' or 'sigmoid', got '", std::string(scoring), "'");
  if (bias.has_value()) {
    CW8A8_CHECK_TYPE(bias->scalar_type() == at::kFloat, op, "correction_bias", "must be float32, got ",
                     py_dtype(bias->scalar_type()));
    check_same_device(op, "correction_bias", *bias, ref_name, ref);
    CW8A8_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == e, op, "correction_bias", "must be [E] = [", e,
                      "], got shape ", py_tuple(bias->sizes()));
  }
  CW8A8_CHECK_VALUE(n_group >= 1 && n_group <= limits::kMoeMaxGroups, op, "n_group", "must be in [1, ",
                    limits::kMoeMaxGroups, "], got ", n_group);
  CW8A8_CHECK_VALUE(n_group == 1 || (e % n_group == 0 && e / n_group >= 2), op, "n_group", "must divide E = ", e,
                    " into groups of at least 2 experts, got ", n_group);
  CW8A8_CHECK_VALUE(topk_group >= 1 && topk_group <= n_group, op, "topk_group",
                    "must be in [1, n_group] with n_group = ", n_group, ", got ", topk_group);
  const int64_t kept = topk_group * (e / n_group);
  CW8A8_CHECK_VALUE(top_k <= kept, op, "top_k", "must be at most topk_group * E / n_group = ", kept,
                    " (the experts of the kept groups), got ", top_k);
  CW8A8_CHECK_VALUE(std::isfinite(scaling_factor), op, "scaling_factor", "must be a finite number");
}

inline void check_route(const char* op, const at::Tensor& logits, int64_t top_k, c10::string_view scoring,
                        const std::optional<at::Tensor>& bias, int64_t n_group, int64_t topk_group,
                        double scaling_factor) {
  const int64_t e = check_router_logits_top_k(op, logits, top_k);
  check_routing_spec(op, e, "router_logits", logits, top_k, scoring, bias, n_group, topk_group, scaling_factor);
}

// moe_router_route: x [T, H] bfloat16 / float16, T <= kMoeRouterRouteMaxT, H a positive multiple of
// kMoeRouterHMultiple; router_weight [E, H] of x's dtype on x's device, 1 <= E <= 1024; both with unit-stride rows
// whose pitch is a multiple of 8 elements, 16-byte aligned; logits_dtype none, x's dtype or float32;
// 1 <= top_k <= E; then moe_route's routing arguments (the bias on x's device).
inline void check_router_route(const char* op, const at::Tensor& x, const at::Tensor& w, int64_t top_k,
                               c10::string_view scoring, const std::optional<at::Tensor>& bias, int64_t n_group,
                               int64_t topk_group, double scaling_factor,
                               std::optional<at::ScalarType> logits_dtype) {
  const at::ScalarType xt = x.scalar_type();
  CW8A8_CHECK_TYPE(xt == at::kBFloat16 || xt == at::kHalf, op, "x", "must be bfloat16 or float16, got ",
                   py_dtype(xt));
  CW8A8_CHECK_VALUE(x.dim() == 2, op, "x", "must be 2-D [T, H], got shape ", py_tuple(x.sizes()));
  const int64_t t = x.size(0), h = x.size(1);
  CW8A8_CHECK_VALUE(t <= limits::kMoeRouterRouteMaxT, op, "x", "has ", t, " rows (tokens); at most ",
                    limits::kMoeRouterRouteMaxT,
                    " are supported (decode sizes: use the router GEMM and moe_route above)");
  CW8A8_CHECK_VALUE(h > 0 && h % limits::kMoeRouterHMultiple == 0, op, "x",
                    "H = x.shape[1] must be a positive multiple of ", limits::kMoeRouterHMultiple, ", got ", h);
  CW8A8_CHECK_TYPE(w.scalar_type() == xt, op, "router_weight", "must have x's dtype ", py_dtype(xt), ", got ",
                   py_dtype(w.scalar_type()));
  check_same_device(op, "router_weight", w, "x", x);
  CW8A8_CHECK_VALUE(w.dim() == 2 && w.size(1) == h, op, "router_weight", "must be 2-D [E, H] with H = ", h,
                    ", got shape ", py_tuple(w.sizes()));
  const int64_t e = w.size(0);
  CW8A8_CHECK_VALUE(e >= 1 && e <= limits::kMoeMaxExperts, op, "router_weight",
                    "E = router_weight.shape[0] must be in [1, ", limits::kMoeMaxExperts, "], got ", e);
  const std::pair<const char*, const at::Tensor*> mats[2] = {{"x", &x}, {"router_weight", &w}};
  for (const auto& [name, m] : mats) {
    CW8A8_CHECK_VALUE(m->stride(1) == 1 && (m->size(0) <= 1 || m->stride(0) % 8 == 0), op, name,
                      "must have unit-stride rows with a row pitch that is a multiple of 8 elements, got strides ",
                      py_tuple(m->strides()));
    check_aligned16(op, name, *m);
  }
  if (logits_dtype.has_value()) {
    CW8A8_CHECK_TYPE(*logits_dtype == xt || *logits_dtype == at::kFloat, op, "logits_dtype",
                     "must be None, x's dtype (", py_dtype(xt), ") or torch.float32, got ", py_dtype(*logits_dtype));
  }
  CW8A8_CHECK_VALUE(top_k >= 1 && top_k <= e, op, "top_k", "must be in [1, E] with E = ", e, ", got ", top_k);
  check_routing_spec(op, e, "x", x, top_k, scoring, bias, n_group, topk_group, scaling_factor);
}

// add_rms_norm_moe_router_route: x (the hidden states h) and router_weight as check_router_route (in its order), then
// H <= kNormDecodeMaxK (rms_norm.cu's one-block register rows: the order of its sum of squares); residual [T, H] of
// x's dtype on x's device with x's row layout, 16-byte aligned; norm_weight [H] of x's dtype on x's device,
// contiguous, 16-byte aligned; eps finite and >= 0.
inline void check_norm_router_route(const char* op, const at::Tensor& x, const at::Tensor& residual,
                                    const at::Tensor& norm_weight, double eps, const at::Tensor& w, int64_t top_k,
                                    c10::string_view scoring, const std::optional<at::Tensor>& bias, int64_t n_group,
                                    int64_t topk_group, double scaling_factor,
                                    std::optional<at::ScalarType> logits_dtype) {
  check_router_route(op, x, w, top_k, scoring, bias, n_group, topk_group, scaling_factor, logits_dtype);
  const at::ScalarType xt = x.scalar_type();
  const int64_t h = x.size(1);
  CW8A8_CHECK_VALUE(h <= limits::kNormDecodeMaxK, op, "x", "H = x.shape[1] must be at most ",
                    limits::kNormDecodeMaxK, " (the rows fused_add_rms_norm normalizes in one block), got ", h);
  CW8A8_CHECK_TYPE(residual.scalar_type() == xt, op, "residual", "must have x's dtype ", py_dtype(xt), ", got ",
                   py_dtype(residual.scalar_type()));
  check_same_device(op, "residual", residual, "x", x);
  CW8A8_CHECK_VALUE(residual.sizes() == x.sizes(), op, "residual", "must have x's shape ", py_tuple(x.sizes()),
                    ", got ", py_tuple(residual.sizes()));
  CW8A8_CHECK_VALUE(residual.stride(1) == 1 && (residual.size(0) <= 1 || residual.stride(0) % 8 == 0), op,
                    "residual",
                    "must have unit-stride rows with a row pitch that is a multiple of 8 elements, got strides ",
                    py_tuple(residual.strides()));
  check_aligned16(op, "residual", residual);
  CW8A8_CHECK_TYPE(norm_weight.scalar_type() == xt, op, "norm_weight", "must have x's dtype ", py_dtype(xt),
                   ", got ", py_dtype(norm_weight.scalar_type()));
  check_same_device(op, "norm_weight", norm_weight, "x", x);
  CW8A8_CHECK_VALUE(norm_weight.dim() == 1 && norm_weight.size(0) == h, op, "norm_weight", "must be [H] with H = ",
                    h, ", got shape ", py_tuple(norm_weight.sizes()));
  check_contiguous(op, "norm_weight", norm_weight);
  check_aligned16(op, "norm_weight", norm_weight);
  CW8A8_CHECK_VALUE(eps >= 0.0 && eps < INFINITY, op, "eps", "must be a finite number >= 0, got ", py_float(eps));
}

// moe_align: topk_ids [T, top_k] int32 / int64 (any strides), 1 <= num_experts <= 1024, at most 2**31 - 1 pairs.
inline void check_align(const char* op, const at::Tensor& ids, int64_t num_experts) {
  CW8A8_CHECK_TYPE(ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong, op, "topk_ids",
                   "must be int32 or int64, got ", py_dtype(ids.scalar_type()));
  CW8A8_CHECK_VALUE(ids.dim() == 2, op, "topk_ids", "must be 2-D [T, top_k], got shape ", py_tuple(ids.sizes()));
  CW8A8_CHECK_VALUE(num_experts >= 1 && num_experts <= limits::kMoeMaxExperts, op, "num_experts", "must be in [1, ",
                    limits::kMoeMaxExperts, "], got ", num_experts);
  const int64_t pairs = ids.size(0) * ids.size(1);
  CW8A8_CHECK_VALUE(pairs <= limits::kMaxRows, op, "topk_ids", "has ", pairs,
                    " (token, expert) pairs; at most ", kMaxRowsText, " are supported");
}

// moe_permute_quant: x [T, H] (the row-wise ops' x), sorted_pairs int32 [T * top_k] on x's device, top_k >= 1,
// then silu_mul_quant's dtype, scale and group_size checks (with the row length H).
inline void check_permute_quant(const char* op, const at::Tensor& x, const at::Tensor& sorted_pairs, int64_t top_k,
                                at::ScalarType dtype, const std::optional<at::Tensor>& scale, int64_t group_size) {
  quant::check_rows_input(op, x);
  CW8A8_CHECK_VALUE(x.dim() == 2, op, "x", "must be 2-D [T, H], got shape ", py_tuple(x.sizes()));
  CW8A8_CHECK_TYPE(sorted_pairs.scalar_type() == at::kInt, op, "sorted_pairs", "must be int32, got ",
                   py_dtype(sorted_pairs.scalar_type()));
  check_same_device(op, "sorted_pairs", sorted_pairs, "x", x);
  CW8A8_CHECK_VALUE(top_k >= 1, op, "top_k", "must be at least 1, got ", top_k);
  const int64_t t = x.size(0);
  const int64_t n = t * top_k;
  CW8A8_CHECK_VALUE(n <= limits::kMaxRows, op, "top_k", "T * top_k = ", n, " rows with T = x.shape[0] = ", t,
                    "; at most ", kMaxRowsText, " are supported");
  CW8A8_CHECK_VALUE(sorted_pairs.dim() == 1 && sorted_pairs.size(0) == n, op, "sorted_pairs",
                    "must be [T * top_k] = [", n, "] with T = x.shape[0] = ", t, ", got shape ",
                    py_tuple(sorted_pairs.sizes()));
  quant::check_quant_dtype(op, dtype);
  quant::check_group_quant(op, x, x.size(1), scale, group_size);
}

// moe_unpermute(_out): y [T * top_k, H] float, dst_pos int32 [T * top_k], topk_weights float32 [T, top_k], out
// [T, H] contiguous in y's dtype, all on y's device.
inline void check_unpermute(const char* op, const at::Tensor& y, const at::Tensor& dst_pos,
                            const at::Tensor& topk_weights, const std::optional<at::Tensor>& out) {
  CW8A8_CHECK_TYPE(quant::is_row_dtype(y.scalar_type()), op, "y", "must be bfloat16, float16 or float32, got ",
                   py_dtype(y.scalar_type()));
  CW8A8_CHECK_TYPE(dst_pos.scalar_type() == at::kInt, op, "dst_pos", "must be int32, got ",
                   py_dtype(dst_pos.scalar_type()));
  CW8A8_CHECK_TYPE(topk_weights.scalar_type() == at::kFloat, op, "topk_weights", "must be float32, got ",
                   py_dtype(topk_weights.scalar_type()));
  if (out.has_value()) {
    CW8A8_CHECK_TYPE(out->scalar_type() == y.scalar_type(), op, "out", "must have y's dtype ",
                     py_dtype(y.scalar_type()), ", got ", py_dtype(out->scalar_type()));
  }
  check_same_device(op, "dst_pos", dst_pos, "y", y);
  check_same_device(op, "topk_weights", topk_weights, "y", y);
  check_same_device(op, "out", out, "y", y);
  CW8A8_CHECK_VALUE(topk_weights.dim() == 2, op, "topk_weights", "must be 2-D [T, top_k], got shape ",
                    py_tuple(topk_weights.sizes()));
  const int64_t t = topk_weights.size(0), k = topk_weights.size(1);
  const int64_t n = t * k;
  CW8A8_CHECK_VALUE(y.dim() == 2 && y.size(0) == n, op, "y", "must be 2-D [T * top_k, H] with T * top_k = ", n,
                    " (T, top_k = topk_weights.shape), got shape ", py_tuple(y.sizes()));
  const int64_t h = y.size(1);
  CW8A8_CHECK_VALUE(n <= limits::kMaxRows, op, "y", "has ", n, " rows; at most ", kMaxRowsText, " are supported");
  CW8A8_CHECK_VALUE(h < limits::kMaxRowK, op, "y", "H = ", h, " must be below 2**31");
  CW8A8_CHECK_VALUE(dst_pos.dim() == 1 && dst_pos.size(0) == n, op, "dst_pos", "must be [T * top_k] = [", n,
                    "], got shape ", py_tuple(dst_pos.sizes()));
  if (out.has_value()) {
    CW8A8_CHECK_VALUE(out->dim() == 2 && out->size(0) == t && out->size(1) == h, op, "out", "must be [T, H] = [", t,
                      ", ", h, "], got shape ", py_tuple(out->sizes()));
    CW8A8_CHECK_VALUE(out->is_contiguous(), op, "out", "must be contiguous");
  }
}

// moe_decode_experts (ops/_checks_moe.py check_moe_decode_experts, in its order): the dtypes (TypeError: x bfloat16 /
// float16 / float32, topk_ids int32 / int64, topk_weights float32, w13 int8 / float8_e4m3fn, w2 of w13's dtype, the
// scales float32, out_dtype bfloat16 / float16), group_size 0 or 128 (128: float8_e4m3fn w13, TypeError), every
// tensor on x's device, then the shapes (ValueError): x [T, H]; topk_ids [T, top_k] with top_k >= 1;
// topk_weights [T, top_k]; T * top_k <= kMoeDecodeMaxPairs; w13 [E, 2I, H] with 1 <= E <= kMoeMaxExperts, H and I
// positive multiples of kGemmAlign (at most kInt8MaxK for int8); w2 [E, H, I]; the scales (group_size 0: [E, N]
// per channel, [E] or [E, 1] per expert; 128: H and I multiples of 128, [E, ceil(2I/128), H/128] and
// [E, ceil(H/128), I/128] blocks); w13, w13_scale, w2, w2_scale contiguous. x and topk_ids may have any strides,
// topk_weights too (the host function makes what it reads contiguous). The device (CUDA, sm90) is the caller's.
inline void check_expert_scale(const char* op, const char* name, const at::Tensor& scale, int64_t e, int64_t n,
                               const char* n_name) {
  const bool ok = (scale.dim() == 2 && scale.size(0) == e && (scale.size(1) == n || scale.size(1) == 1)) ||
                  (scale.dim() == 1 && scale.size(0) == e);
  CW8A8_CHECK_VALUE(ok, op, name, "must be [E, ", n_name, "] (per-channel), [E] or [E, 1] (per-expert) with E = ", e,
                    ", ", n_name, " = ", n, " (group_size = 0), got shape ", py_tuple(scale.sizes()));
}

inline void check_decode_experts(const char* op, const at::Tensor& x, const at::Tensor& topk_ids,
                                 const at::Tensor& topk_weights, const at::Tensor& w13, const at::Tensor& w13_scale,
                                 const at::Tensor& w2, const at::Tensor& w2_scale, int64_t group_size,
                                 at::ScalarType out_dtype) {
  constexpr int64_t kBlock = limits::kBlockSize;
  CW8A8_CHECK_TYPE(quant::is_row_dtype(x.scalar_type()), op, "x", "must be bfloat16, float16 or float32, got ",
                   py_dtype(x.scalar_type()));
  CW8A8_CHECK_TYPE(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong, op, "topk_ids",
                   "must be int32 or int64, got ", py_dtype(topk_ids.scalar_type()));
  CW8A8_CHECK_TYPE(topk_weights.scalar_type() == at::kFloat, op, "topk_weights", "must be float32, got ",
                   py_dtype(topk_weights.scalar_type()));
  check_ab_dtype(op, "w13", w13);
  CW8A8_CHECK_TYPE(w2.scalar_type() == w13.scalar_type(), op, "w2", "must have w13's dtype ",
                   py_dtype(w13.scalar_type()), ", got ", py_dtype(w2.scalar_type()));
  check_float32(op, "w13_scale", w13_scale);
  check_float32(op, "w2_scale", w2_scale);
  check_out_dtype_arg(op, "out_dtype", out_dtype);
  CW8A8_CHECK_VALUE(group_size == 0 || group_size == kBlock, op, "group_size", "must be 0 (per-token) or ", kBlock,
                    " (block fp8), got ", group_size);
  CW8A8_CHECK_TYPE(group_size == 0 || w13.scalar_type() == at::kFloat8_e4m3fn, op, "w13",
                   "must be float8_e4m3fn with group_size = ", kBlock, " (block fp8), got ",
                   py_dtype(w13.scalar_type()));
  check_same_device(op, "topk_ids", topk_ids, "x", x);
  check_same_device(op, "topk_weights", topk_weights, "x", x);
  check_same_device(op, "w13", w13, "x", x);
  check_same_device(op, "w13_scale", w13_scale, "x", x);
  check_same_device(op, "w2", w2, "x", x);
  check_same_device(op, "w2_scale", w2_scale, "x", x);

  CW8A8_CHECK_VALUE(x.dim() == 2, op, "x", "must be 2-D [T, H], got shape ", py_tuple(x.sizes()));
  const int64_t t = x.size(0), h = x.size(1);
  CW8A8_CHECK_VALUE(topk_ids.dim() == 2 && topk_ids.size(0) == t, op, "topk_ids",
                    "must be 2-D [T, top_k] with T = x.shape[0] = ", t, ", got shape ", py_tuple(topk_ids.sizes()));
  const int64_t k = topk_ids.size(1);
  CW8A8_CHECK_VALUE(k >= 1, op, "topk_ids", "top_k = topk_ids.shape[1] must be at least 1, got ", k);
  CW8A8_CHECK_VALUE(topk_weights.dim() == 2 && topk_weights.size(0) == t && topk_weights.size(1) == k, op,
                    "topk_weights", "must be [T, top_k] = [", t, ", ", k, "] (topk_ids' shape), got shape ",
                    py_tuple(topk_weights.sizes()));
  CW8A8_CHECK_VALUE(t * k <= limits::kMoeDecodeMaxPairs, op, "topk_ids", "has T * top_k = ", t * k,
                    " (token, expert) pairs; the decode path serves at most ", limits::kMoeDecodeMaxPairs,
                    " (larger batches run the grouped chain)");
  CW8A8_CHECK_VALUE(w13.dim() == 3, op, "w13", "must be 3-D [E, 2I, H], got shape ", py_tuple(w13.sizes()));
  const int64_t e = w13.size(0), i2 = w13.size(1);
  CW8A8_CHECK_VALUE(e >= 1 && e <= limits::kMoeMaxExperts, op, "w13", "E = w13.shape[0] must be in [1, ",
                    limits::kMoeMaxExperts, "], got ", e);
  CW8A8_CHECK_VALUE(w13.size(2) == h, op, "w13", "must be [E, 2I, H] with H = x.shape[1] = ", h, ", got shape ",
                    py_tuple(w13.sizes()));
  check_gemm_dim(op, "x", "H = x.shape[1]", h);
  const int64_t i = i2 / 2;
  CW8A8_CHECK_VALUE(i2 > 0 && i2 % (2 * limits::kGemmAlign) == 0, op, "w13",
                    "2I = w13.shape[1] must be twice a positive multiple of ", limits::kGemmAlign,
                    " (gate and up rows of I each), got ", i2);
  check_int8_k(op, "x", w13.scalar_type(), h);
  check_int8_k(op, "w2", w13.scalar_type(), i);
  CW8A8_CHECK_VALUE(w2.dim() == 3 && w2.size(0) == e && w2.size(1) == h && w2.size(2) == i, op, "w2",
                    "must be [E, H, I] = [", e, ", ", h, ", ", i, "], got shape ", py_tuple(w2.sizes()));
  if (group_size != 0) {
    CW8A8_CHECK_VALUE(h % kBlock == 0, op, "x", "H = x.shape[1] must be a multiple of ", kBlock,
                      " with group_size = ", kBlock, ", got ", h);
    CW8A8_CHECK_VALUE(i % kBlock == 0, op, "w13", "I = w13.shape[1] / 2 must be a multiple of ", kBlock,
                      " with group_size = ", kBlock, ", got ", i);
    const int64_t i2b = (i2 + kBlock - 1) / kBlock, hb = (h + kBlock - 1) / kBlock;
    CW8A8_CHECK_VALUE(w13_scale.dim() == 3 && w13_scale.size(0) == e && w13_scale.size(1) == i2b &&
                          w13_scale.size(2) == h / kBlock,
                      op, "w13_scale", "must be [E, ceil(2I/128), H/128] = [", e, ", ", i2b, ", ", h / kBlock,
                      "] (128x128 blocks) with group_size = ", kBlock, ", got shape ", py_tuple(w13_scale.sizes()));
    CW8A8_CHECK_VALUE(w2_scale.dim() == 3 && w2_scale.size(0) == e && w2_scale.size(1) == hb &&
                          w2_scale.size(2) == i / kBlock,
                      op, "w2_scale", "must be [E, ceil(H/128), I/128] = [", e, ", ", hb, ", ", i / kBlock,
                      "] (128x128 blocks) with group_size = ", kBlock, ", got shape ", py_tuple(w2_scale.sizes()));
  } else {
    check_expert_scale(op, "w13_scale", w13_scale, e, i2, "2I");
    check_expert_scale(op, "w2_scale", w2_scale, e, h, "H");
  }
  check_contiguous(op, "w13", w13);
  check_contiguous(op, "w13_scale", w13_scale);
  check_contiguous(op, "w2", w2);
  check_contiguous(op, "w2_scale", w2_scale);
  check_aligned16(op, "w13", w13);  // the kernels' 16-byte weight loads
  check_aligned16(op, "w2", w2);
}

}  // namespace cutlass_w8a8::moe
