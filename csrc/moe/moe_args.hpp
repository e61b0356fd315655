// The argument contract of the MoE routing ops on CUDA: moe_topk_softmax, moe_route, moe_align, moe_permute_quant,
// moe_unpermute(_out). The same checks as cutlass_w8a8/ops/_checks.py (check_moe_*), in its order, with its
// exception types and first-line messages character for character (docs/MISUSE.md; tests/test_misuse_table.py
// runs every row on both). The quantization arguments of moe_permute_quant are silu_mul_quant's
// (quant/rowwise_args.hpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

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
inline void check_route(const char* op, const at::Tensor& logits, int64_t top_k, c10::string_view scoring,
                        const std::optional<at::Tensor>& bias, int64_t n_group, int64_t topk_group,
                        double scaling_factor) {
  const int64_t e = check_router_logits_top_k(op, logits, top_k);
  CW8A8_CHECK_VALUE(scoring == "softmax" || scoring == "sigmoid", op, "scoring",
                    "must be 'softmax' or 'sigmoid', got '", std::string(scoring), "'");
  if (bias.has_value()) {
    CW8A8_CHECK_TYPE(bias->scalar_type() == at::kFloat, op, "correction_bias", "must be float32, got ",
                     py_dtype(bias->scalar_type()));
    check_same_device(op, "correction_bias", *bias, "router_logits", logits);
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

}  // namespace cutlass_w8a8::moe
