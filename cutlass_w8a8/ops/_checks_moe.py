"""The MoE ops' argument contract (moe_topk_softmax, moe_route, moe_align, moe_permute_quant, moe_unpermute),
composed from the operand roles of `_roles.py` as `_checks.py` does for the other ops; csrc/moe/routing.cu and
permute_quant.cu raise the same messages in the same order."""

from __future__ import annotations

__all__ = ["MOE_SCORINGS", "check_moe_align", "check_moe_permute_quant", "check_moe_route", "check_moe_topk_softmax",
           "check_moe_unpermute"]

import math

import torch

from ._checks import _group_quant
from ._limits import MAX_ROW_K, MAX_ROWS, MOE_MAX_EXPERTS, MOE_MAX_GROUPS
from ._roles import (contiguous, exact_shape, fail_type, fail_value, float_input, limit_text, quant_dtype, row_input,
                     same_device, tensor_arg)


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
    if scoring not in MOE_SCORINGS:
        fail_value(op, "scoring", f"must be 'softmax' or 'sigmoid', got '{scoring}'")
    tensor_arg(op, "correction_bias", correction_bias, optional=True)
    if correction_bias is not None:
        if correction_bias.dtype != torch.float32:
            fail_type(op, "correction_bias", f"must be float32, got {correction_bias.dtype}")
        same_device(op, "router_logits", router_logits, [("correction_bias", correction_bias)])
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
