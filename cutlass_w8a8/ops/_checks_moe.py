"""The MoE ops' argument contract (moe_topk_softmax, moe_route, moe_router_route, moe_align, moe_permute_quant,
moe_unpermute, moe_decode_experts), composed from the operand roles of `_roles.py` as `_checks.py` does for the other ops;
csrc/moe/moe_args.hpp (called by routing.cu, permute_quant.cu and moe_decode.cu) raises the same messages in the
same order."""

from __future__ import annotations

__all__ = ["MOE_SCORINGS", "check_moe_align", "check_moe_decode_experts", "check_moe_permute_quant", "check_moe_route",
           "check_moe_router_route", "check_moe_topk_softmax", "check_moe_unpermute", "check_norm_router_route"]

import math

import torch

from ._checks import _group_quant
from ._limits import (BLOCK_SIZE, GEMM_ALIGN, MAX_ROW_K, MAX_ROWS, MOE_DECODE_MAX_PAIRS, MOE_MAX_EXPERTS,
                      MOE_MAX_GROUPS, MOE_ROUTER_H_MULTIPLE, MOE_ROUTER_ROUTE_MAX_T, NORM_DECODE_MAX_K, blocks)
from ._roles import (aligned16, contiguous, eight_bit, exact_shape, fail_type, fail_value, float32_scale, float_input,
                     gemm_size, int8_k_bound, limit_text, output_dtype, quant_dtype, row_input, same_device, tensor_arg,
                     x_dtype, eps_type)


# ---- MoE routing (csrc/moe/routing.cu raises the same messages in the same order) -------------------------


def _router_logits_top_k(op: str, router_logits, top_k) -> int:
    """router_logits [T, E] float (1 <= E <= MOE_MAX_EXPERTS, any strides), then 1 <= top_k <= E; returns E."""
    tensor_arg(op, "router_logits", router_logits)
    float_input(op, "router_logits", router_logits)
    if router_logits.dim() != 2:
        fail_value(op, "router_logits", f"must be 2-D [T, E], got shape {tuple(router_logits.shape)}")
    t, e = router_logits.shape
    if not 1 <= e <= MOE_MAX_EXPERTS:
        fail_value(op, "router_logits", f"E = router_logits.shape[1] must be in [1, {MOE_MAX_EXPERTS}], got {e}")
    if t > MAX_ROWS:
        fail_value(op, "router_logits", f"has {t} rows; at most {limit_text(MAX_ROWS)} are supported")
    if not 1 <= top_k <= e:
        fail_value(op, "top_k", f"must be in [1, E] with E = {e}, got {top_k}")
    return e


def check_moe_topk_softmax(router_logits, top_k, renormalize) -> None:
    """moe_topk_softmax: router_logits [T, E] float (1 <= E <= MOE_MAX_EXPERTS, any strides), 1 <= top_k <= E."""
    _router_logits_top_k("moe_topk_softmax", router_logits, top_k)


MOE_SCORINGS = ("softmax", "sigmoid")


def check_moe_route(router_logits, top_k, scoring, correction_bias, n_group, topk_group, renormalize,
                    scaling_factor) -> None:
    """moe_route: moe_topk_softmax's router_logits and top_k; scoring "softmax" or "sigmoid"; correction_bias None
    or float32 [E] on router_logits' device (any stride); 1 <= n_group <= MOE_MAX_GROUPS dividing E into groups of
    at least 2 experts (any E when n_group is 1); 1 <= topk_group <= n_group; top_k at most the experts of the
    kept groups, topk_group * E / n_group; scaling_factor finite."""
    op = "moe_route"
    e = _router_logits_top_k(op, router_logits, top_k)
    _routing_spec(op, e, "router_logits", router_logits, top_k, scoring, correction_bias, n_group, topk_group,
                  scaling_factor)


def _routing_spec(op: str, e: int, ref_name: str, ref, top_k, scoring, correction_bias, n_group, topk_group,
                  scaling_factor) -> None:
    """moe_route's routing arguments for E experts (top_k already in [1, E]); ``correction_bias`` on ``ref``'s
    device (the message names ``ref_name``)."""
    if scoring not in MOE_SCORINGS:
        fail_value(op, "scoring", f"must be 'softmax' or 'sigmoid', got '{scoring}'")
    tensor_arg(op, "correction_bias", correction_bias, optional=True)
    if correction_bias is not None:
        if correction_bias.dtype != torch.float32:
            fail_type(op, "correction_bias", f"must be float32, got {correction_bias.dtype}")
        same_device(op, ref_name, ref, [("correction_bias", correction_bias)])
        exact_shape(op, "correction_bias", correction_bias, "E", (e,))
    if not 1 <= n_group <= MOE_MAX_GROUPS:
        fail_value(op, "n_group", f"must be in [1, {MOE_MAX_GROUPS}], got {n_group}")
    if n_group > 1 and (e % n_group != 0 or e // n_group < 2):
        fail_value(op, "n_group", f"must divide E = {e} into groups of at least 2 experts, got {n_group}")
    if not 1 <= topk_group <= n_group:
        fail_value(op, "topk_group", f"must be in [1, n_group] with n_group = {n_group}, got {topk_group}")
    kept = topk_group * (e // n_group)
    if top_k > kept:
        fail_value(op, "top_k", f"must be at most topk_group * E / n_group = {kept} (the experts of the kept "
                   f"groups), got {top_k}")
    if not math.isfinite(scaling_factor):
        fail_value(op, "scaling_factor", "must be a finite number")


#: x / router_weight dtypes of moe_router_route (the mma's 16-bit operands).
ROUTER_DTYPES = (torch.bfloat16, torch.float16)


def check_moe_router_route(x, router_weight, top_k, scoring, correction_bias, n_group, topk_group, renormalize,
                           scaling_factor, logits_dtype) -> None:
    """moe_router_route: x [T, H] bfloat16 / float16 with T <= MOE_ROUTER_ROUTE_MAX_T and H a positive multiple of
    MOE_ROUTER_H_MULTIPLE; router_weight [E, H] of x's dtype on x's device, 1 <= E <= MOE_MAX_EXPERTS; both with
    unit-stride rows whose pitch is a multiple of 8 elements, 16-byte aligned; logits_dtype None, x's dtype or
    float32; 1 <= top_k <= E; then moe_route's routing arguments (correction_bias on x's device)."""
    _router_route_args("moe_router_route", x, router_weight, top_k, scoring, correction_bias, n_group, topk_group,
                       scaling_factor, logits_dtype)


def _pitched_rows(op: str, name: str, m) -> None:
    """The router kernels' row reads: unit-stride rows whose pitch is a multiple of 8 elements, 16-byte aligned."""
    if m.stride(1) != 1 or (m.shape[0] > 1 and m.stride(0) % 8 != 0):
        fail_value(op, name, f"must have unit-stride rows with a row pitch that is a multiple of 8 elements, got "
                   f"strides {tuple(m.stride())}")
    aligned16(op, name, m)


def _router_route_args(op, x, router_weight, top_k, scoring, correction_bias, n_group, topk_group, scaling_factor,
                       logits_dtype) -> None:
    """check_moe_router_route's checks under the name `op` (add_rms_norm_moe_router_route runs them first)."""
    tensor_arg(op, "x", x)
    float_input(op, "x", x, ROUTER_DTYPES)
    if x.dim() != 2:
        fail_value(op, "x", f"must be 2-D [T, H], got shape {tuple(x.shape)}")
    t, h = x.shape
    if t > MOE_ROUTER_ROUTE_MAX_T:
        fail_value(op, "x", f"has {t} rows (tokens); at most {MOE_ROUTER_ROUTE_MAX_T} are supported (decode sizes: "
                   "use the router GEMM and moe_route above)")
    if h == 0 or h % MOE_ROUTER_H_MULTIPLE != 0:
        fail_value(op, "x", f"H = x.shape[1] must be a positive multiple of {MOE_ROUTER_H_MULTIPLE}, got {h}")
    tensor_arg(op, "router_weight", router_weight)
    x_dtype(op, "router_weight", router_weight, x)
    same_device(op, "x", x, [("router_weight", router_weight)])
    if router_weight.dim() != 2 or router_weight.shape[1] != h:
        fail_value(op, "router_weight", f"must be 2-D [E, H] with H = {h}, got shape {tuple(router_weight.shape)}")
    e = router_weight.shape[0]
    if not 1 <= e <= MOE_MAX_EXPERTS:
        fail_value(op, "router_weight", f"E = router_weight.shape[0] must be in [1, {MOE_MAX_EXPERTS}], got {e}")
    for name, m in (("x", x), ("router_weight", router_weight)):
        _pitched_rows(op, name, m)
    if logits_dtype is not None and logits_dtype not in (x.dtype, torch.float32):
        fail_type(op, "logits_dtype", f"must be None, x's dtype ({x.dtype}) or torch.float32, got {logits_dtype}")
    if not 1 <= top_k <= e:
        fail_value(op, "top_k", f"must be in [1, E] with E = {e}, got {top_k}")
    _routing_spec(op, e, "x", x, top_k, scoring, correction_bias, n_group, topk_group, scaling_factor)


def check_norm_router_route(x, residual, norm_weight, eps, router_weight, top_k, scoring, correction_bias, n_group,
                            topk_group, renormalize, scaling_factor, logits_dtype) -> None:
    """add_rms_norm_moe_router_route: x (the hidden states h) and router_weight as moe_router_route (its checks, in
    its order), then H <= NORM_DECODE_MAX_K (fused_add_rms_norm's one-block rows: the order of its sum of squares);
    residual [T, H] of x's dtype on x's device with x's row layout, 16-byte aligned; norm_weight [H] of x's dtype on
    x's device, contiguous, 16-byte aligned; eps a finite number >= 0 (csrc/moe/moe_args.hpp check_norm_router_route
    raises the same)."""
    op = "add_rms_norm_moe_router_route"
    _router_route_args(op, x, router_weight, top_k, scoring, correction_bias, n_group, topk_group, scaling_factor,
                       logits_dtype)
    h = x.shape[1]
    if h > NORM_DECODE_MAX_K:
        fail_value(op, "x", f"H = x.shape[1] must be at most {NORM_DECODE_MAX_K} (the rows fused_add_rms_norm "
                   f"normalizes in one block), got {h}")
    tensor_arg(op, "residual", residual)
    x_dtype(op, "residual", residual, x)
    same_device(op, "x", x, [("residual", residual)])
    if tuple(residual.shape) != tuple(x.shape):
        fail_value(op, "residual", f"must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    _pitched_rows(op, "residual", residual)
    tensor_arg(op, "norm_weight", norm_weight)
    x_dtype(op, "norm_weight", norm_weight, x)
    same_device(op, "x", x, [("norm_weight", norm_weight)])
    if norm_weight.dim() != 1 or norm_weight.shape[0] != h:
        fail_value(op, "norm_weight", f"must be [H] with H = {h}, got shape {tuple(norm_weight.shape)}")
    contiguous(op, "norm_weight", norm_weight)
    aligned16(op, "norm_weight", norm_weight)
    eps_type(op, eps)
    if not 0.0 <= eps < float("inf"):
        fail_value(op, "eps", f"must be a finite number >= 0, got {float(eps)}")


def check_moe_align(topk_ids, num_experts) -> None:
    """moe_align: topk_ids [T, top_k] int32 / int64 (at most 2**31 - 1 pairs), 1 <= num_experts <= 1024."""
    op = "moe_align"
    tensor_arg(op, "topk_ids", topk_ids)
    if topk_ids.dtype not in (torch.int32, torch.int64):
        fail_type(op, "topk_ids", f"must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.dim() != 2:
        fail_value(op, "topk_ids", f"must be 2-D [T, top_k], got shape {tuple(topk_ids.shape)}")
    if not 1 <= num_experts <= MOE_MAX_EXPERTS:
        fail_value(op, "num_experts", f"must be in [1, {MOE_MAX_EXPERTS}], got {num_experts}")
    pairs = topk_ids.shape[0] * topk_ids.shape[1]
    if pairs > MAX_ROWS:
        fail_value(op, "topk_ids", f"has {pairs} (token, expert) pairs; at most {limit_text(MAX_ROWS)} are supported")


def check_moe_permute_quant(x, sorted_pairs, top_k, dtype, scale, group_size=0) -> None:
    """moe_permute_quant: x [T, H] float (the row-wise ops' x), sorted_pairs int32 [T * top_k] on x's device,
    top_k >= 1, then the quantization of silu_mul_quant (dtype, then the static scale or group_size 128)."""
    op = "moe_permute_quant"
    row_input(op, x)
    if x.dim() != 2:
        fail_value(op, "x", f"must be 2-D [T, H], got shape {tuple(x.shape)}")
    tensor_arg(op, "sorted_pairs", sorted_pairs)
    if sorted_pairs.dtype != torch.int32:
        fail_type(op, "sorted_pairs", f"must be int32, got {sorted_pairs.dtype}")
    same_device(op, "x", x, [("sorted_pairs", sorted_pairs)])
    if top_k < 1:
        fail_value(op, "top_k", f"must be at least 1, got {top_k}")
    t = x.shape[0]
    n = t * top_k
    if n > MAX_ROWS:
        fail_value(op, "top_k", f"T * top_k = {n} rows with T = x.shape[0] = {t}; at most "
                   f"{limit_text(MAX_ROWS)} are supported")
    exact_shape(op, "sorted_pairs", sorted_pairs, "T * top_k", (n,), f"with T = x.shape[0] = {t}")
    quant_dtype(op, dtype)
    _group_quant(op, x, x.shape[1], scale, group_size)


def check_moe_unpermute(y, dst_pos, topk_weights, out=None) -> None:
    """moe_unpermute(_out): y [T * top_k, H] float, dst_pos int32 [T * top_k], topk_weights float32 [T, top_k],
    out [T, H] contiguous in y's dtype."""
    op = "moe_unpermute"
    for name, t in (("y", y), ("dst_pos", dst_pos), ("topk_weights", topk_weights)):
        tensor_arg(op, name, t)
    tensor_arg(op, "out", out, optional=True)
    float_input(op, "y", y)
    if dst_pos.dtype != torch.int32:
        fail_type(op, "dst_pos", f"must be int32, got {dst_pos.dtype}")
    if topk_weights.dtype != torch.float32:
        fail_type(op, "topk_weights", f"must be float32, got {topk_weights.dtype}")
    if out is not None and out.dtype != y.dtype:
        fail_type(op, "out", f"must have y's dtype {y.dtype}, got {out.dtype}")
    same_device(op, "y", y, [("dst_pos", dst_pos), ("topk_weights", topk_weights), ("out", out)])
    if topk_weights.dim() != 2:
        fail_value(op, "topk_weights", f"must be 2-D [T, top_k], got shape {tuple(topk_weights.shape)}")
    t, k = topk_weights.shape
    n = t * k
    if y.dim() != 2 or y.shape[0] != n:
        fail_value(op, "y", f"must be 2-D [T * top_k, H] with T * top_k = {n} (T, top_k = topk_weights.shape), "
                   f"got shape {tuple(y.shape)}")
    h = y.shape[1]
    if n > MAX_ROWS:
        fail_value(op, "y", f"has {n} rows; at most {limit_text(MAX_ROWS)} are supported")
    if h >= MAX_ROW_K:
        fail_value(op, "y", f"H = {h} must be below {limit_text(MAX_ROW_K)}")
    exact_shape(op, "dst_pos", dst_pos, "T * top_k", (n,))
    if out is not None:
        exact_shape(op, "out", out, "T, H", (t, h))
        contiguous(op, "out", out)


# ---- the fused decode path (csrc/moe/moe_args.hpp check_decode_experts raises the same messages in the same order)


def _expert_scale(op: str, name: str, scale, e: int, n: int, n_name: str) -> None:
    """A row-wise weight scale of moe_decode_experts (group_size 0): [E, N] per channel, [E] or [E, 1] per expert."""
    if tuple(scale.shape) not in ((e, n), (e,), (e, 1)):
        fail_value(op, name, f"must be [E, {n_name}] (per-channel), [E] or [E, 1] (per-expert) with E = {e}, "
                   f"{n_name} = {n} (group_size = 0), got shape {tuple(scale.shape)}")


def check_moe_decode_experts(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, group_size, out_dtype) -> None:
    """moe_decode_experts: x [T, H] bfloat16 / float16 / float32 (any strides); topk_ids [T, top_k] int32 / int64
    (any strides), top_k >= 1, T * top_k <= MOE_DECODE_MAX_PAIRS; topk_weights float32 of topk_ids' shape; w13
    [E, 2I, H] int8 / float8_e4m3fn and w2 [E, H, I] of w13's dtype, contiguous (1 <= E <= MOE_MAX_EXPERTS, H and I
    positive multiples of GEMM_ALIGN, at most INT8_MAX_K for int8); float32 contiguous scales: group_size 0 per
    channel ([E, 2I] / [E, H]) or per expert ([E] / [E, 1]), group_size 128 (float8_e4m3fn only, H and I multiples
    of 128) 128x128 blocks ([E, ceil(2I/128), H/128] / [E, ceil(H/128), I/128]); out_dtype bfloat16 / float16; every
    tensor on x's device. In this order: the tensors, the dtypes (TypeError), group_size, the devices, the shapes,
    the scales, the layouts (ValueError)."""
    op = "moe_decode_experts"
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w13", w13),
                    ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        tensor_arg(op, name, t)
    float_input(op, "x", x)
    if topk_ids.dtype not in (torch.int32, torch.int64):
        fail_type(op, "topk_ids", f"must be int32 or int64, got {topk_ids.dtype}")
    if topk_weights.dtype != torch.float32:
        fail_type(op, "topk_weights", f"must be float32, got {topk_weights.dtype}")
    eight_bit(op, "w13", w13)
    if w2.dtype != w13.dtype:
        fail_type(op, "w2", f"must have w13's dtype {w13.dtype}, got {w2.dtype}")
    float32_scale(op, "w13_scale", w13_scale)
    float32_scale(op, "w2_scale", w2_scale)
    output_dtype(op, out_dtype)
    if group_size not in (0, BLOCK_SIZE):
        fail_value(op, "group_size", f"must be 0 (per-token) or {BLOCK_SIZE} (block fp8), got {group_size}")
    if group_size and w13.dtype != torch.float8_e4m3fn:
        fail_type(op, "w13", f"must be float8_e4m3fn with group_size = {BLOCK_SIZE} (block fp8), got {w13.dtype}")
    same_device(op, "x", x, [("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w13", w13),
                             ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)])

    if x.dim() != 2:
        fail_value(op, "x", f"must be 2-D [T, H], got shape {tuple(x.shape)}")
    t, h = x.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        fail_value(op, "topk_ids", f"must be 2-D [T, top_k] with T = x.shape[0] = {t}, got shape "
                   f"{tuple(topk_ids.shape)}")
    k = topk_ids.shape[1]
    if k < 1:
        fail_value(op, "topk_ids", f"top_k = topk_ids.shape[1] must be at least 1, got {k}")
    exact_shape(op, "topk_weights", topk_weights, "T, top_k", (t, k), "(topk_ids' shape)")
    if t * k > MOE_DECODE_MAX_PAIRS:
        fail_value(op, "topk_ids", f"has T * top_k = {t * k} (token, expert) pairs; the decode path serves at most "
                   f"{MOE_DECODE_MAX_PAIRS} (larger batches run the grouped chain)")
    if w13.dim() != 3:
        fail_value(op, "w13", f"must be 3-D [E, 2I, H], got shape {tuple(w13.shape)}")
    e, i2 = w13.shape[0], w13.shape[1]
    if not 1 <= e <= MOE_MAX_EXPERTS:
        fail_value(op, "w13", f"E = w13.shape[0] must be in [1, {MOE_MAX_EXPERTS}], got {e}")
    if w13.shape[2] != h:
        fail_value(op, "w13", f"must be [E, 2I, H] with H = x.shape[1] = {h}, got shape {tuple(w13.shape)}")
    gemm_size(op, "x", "H = x.shape[1]", h)
    i = i2 // 2
    if i2 % (2 * GEMM_ALIGN) != 0 or i2 == 0:
        fail_value(op, "w13", f"2I = w13.shape[1] must be twice a positive multiple of {GEMM_ALIGN} (gate and up "
                   f"rows of I each), got {i2}")
    int8_k_bound(op, "x", w13.dtype, h)
    int8_k_bound(op, "w2", w13.dtype, i)
    exact_shape(op, "w2", w2, "E, H, I", (e, h, i))
    if group_size:
        if h % BLOCK_SIZE != 0:
            fail_value(op, "x", f"H = x.shape[1] must be a multiple of {BLOCK_SIZE} with group_size = {BLOCK_SIZE}, "
                       f"got {h}")
        if i % BLOCK_SIZE != 0:
            fail_value(op, "w13", f"I = w13.shape[1] / 2 must be a multiple of {BLOCK_SIZE} with group_size = "
                       f"{BLOCK_SIZE}, got {i}")
        exact_shape(op, "w13_scale", w13_scale, "E, ceil(2I/128), H/128", (e, blocks(i2), h // BLOCK_SIZE),
                    f"(128x128 blocks) with group_size = {BLOCK_SIZE}")
        exact_shape(op, "w2_scale", w2_scale, "E, ceil(H/128), I/128", (e, blocks(h), i // BLOCK_SIZE),
                    f"(128x128 blocks) with group_size = {BLOCK_SIZE}")
    else:
        _expert_scale(op, "w13_scale", w13_scale, e, i2, "2I")
        _expert_scale(op, "w2_scale", w2_scale, e, h, "H")
    contiguous(op, "w13", w13)
    contiguous(op, "w13_scale", w13_scale)
    contiguous(op, "w2", w2)
    contiguous(op, "w2_scale", w2_scale)
    aligned16(op, "w13", w13)  # the kernels' 16-byte weight loads
    aligned16(op, "w2", w2)
