"""Fake (meta) kernels of the ops, for torch.compile, opcheck and meta tensors: the op's checks (`_checks.py`,
the same as the CPU implementations'), then empty outputs of the right shape and dtype, contiguous as the
kernels write them."""

from __future__ import annotations

import torch

from . import _checks as C
from . import _checks_moe as CM
from ._limits import FP8_FAST_ACCUM


def _fake(op: str):
    return torch.library.register_fake(f"cutlass_w8a8::{op}")


def _gemm_pair(op: str, check) -> None:
    """Fakes of a scaled_mm-shaped op and its out= variant (`check` is its contract)."""

    @_fake(op)
    def functional(a, b, scale_a, scale_b, out_dtype, bias=None):
        check(op, a, b, scale_a, scale_b, out_dtype, bias)
        return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)

    @_fake(op + "_out")
    def out_variant(out, a, b, scale_a, scale_b, bias=None):
        check(op, a, b, scale_a, scale_b, out.dtype, bias, out)


_gemm_pair("scaled_mm_decode", C.check_scaled_mm_decode)


@_fake("scaled_mm")
def _scaled_mm(a, b, scale_a, scale_b, out_dtype, bias=None, fp8_fast_accum=FP8_FAST_ACCUM):
    C.check_scaled_mm("scaled_mm", a, b, scale_a, scale_b, out_dtype, bias)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@_fake("scaled_mm_out")
def _scaled_mm_out(out, a, b, scale_a, scale_b, bias=None, fp8_fast_accum=FP8_FAST_ACCUM):
    C.check_scaled_mm("scaled_mm", a, b, scale_a, scale_b, out.dtype, bias, out)


@_fake("grouped_scaled_mm")
def _grouped_scaled_mm(a, b, scale_a, scale_b, offsets, out_dtype, bias=None):
    C.check_grouped_scaled_mm("grouped_scaled_mm", a, b, scale_a, scale_b, offsets, out_dtype, bias)
    return a.new_empty((a.shape[0], b.shape[2]), dtype=out_dtype)


@_fake("grouped_scaled_mm_out")
def _grouped_scaled_mm_out(out, a, b, scale_a, scale_b, offsets, bias=None):
    C.check_grouped_scaled_mm("grouped_scaled_mm", a, b, scale_a, scale_b, offsets, out.dtype, bias, out)


@_fake("_grouped_scaled_mm_config")
def _grouped_scaled_mm_config(out, a, b, scale_a, scale_b, offsets, bias, config):
    C.check_grouped_scaled_mm("grouped_scaled_mm", a, b, scale_a, scale_b, offsets, out.dtype, bias, out)


@_fake("_scaled_mm_config")
def _scaled_mm_config(out, a, b, scale_a, scale_b, bias, config):
    C.check_scaled_mm("scaled_mm", a, b, scale_a, scale_b, out.dtype, bias, out)


@_fake("w8a8_linear")
def _w8a8_linear(x, weight, weight_scale, input_scale=None, bias=None, out_dtype=torch.bfloat16,
                 fp8_fast_accum=FP8_FAST_ACCUM):
    C.check_w8a8_linear(x, weight, weight_scale, input_scale, bias, out_dtype)
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype)


@_fake("linear_decode")
def _linear_decode(x, b, scale_b, bias, dtype):
    C.check_linear_decode("linear_decode", x, b, scale_b, bias, dtype)
    return x.new_empty((x.shape[0], b.shape[1]))


@_fake("linear_decode_out")
def _linear_decode_out(out, x, b, scale_b, bias, dtype):
    C.check_linear_decode("linear_decode", x, b, scale_b, bias, dtype, out)


@_fake("add_rms_norm_linear_decode")
def _add_rms_norm_linear_decode(x, residual, norm_weight, eps, b, scale_b, bias, dtype):
    C.check_add_rms_norm_linear_decode(x, residual, norm_weight, eps, b, scale_b, bias, dtype)
    return x.new_empty((x.shape[0], b.shape[1])), x.new_empty(x.shape)


@_fake("quantize_per_token")
def _quantize_per_token(x, dtype):
    C.check_quantize("quantize_per_token", x, dtype)
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@_fake("quantize_per_token_group")
def _quantize_per_token_group(x, group_size, dtype):
    C.check_quantize_group(x, group_size, dtype)
    return (x.new_empty(x.shape, dtype=dtype),
            x.new_empty((*x.shape[:-1], x.shape[-1] // group_size), dtype=torch.float32))


def _fused_scale(y_shape, group_size):
    """The scale output of the fused quantizing ops: (..., 1), or (..., K / group_size) for K = y's row."""
    return (*y_shape[:-1], y_shape[-1] // group_size if group_size else 1)


@_fake("quantize_per_tensor")
def _quantize_per_tensor(x, scale, dtype):
    C.check_quantize("quantize_per_tensor", x, dtype, scale)
    return x.new_empty(x.shape, dtype=dtype)


@_fake("rms_norm")
def _rms_norm(x, weight, eps):
    C.check_rms_norm("rms_norm", x, weight, eps, None)
    return x.new_empty(x.shape)


@_fake("fused_add_rms_norm")
def _fused_add_rms_norm(x, residual, weight, eps):
    C.check_rms_norm("fused_add_rms_norm", x, weight, eps, residual)
    return x.new_empty(x.shape)


@_fake("rms_norm_quant")
def _rms_norm_quant(x, weight, eps, dtype, scale=None, residual=None, group_size=0):
    C.check_rms_norm_quant(x, weight, eps, dtype, scale, residual, group_size)
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(_fused_scale(x.shape, group_size), dtype=torch.float32)


@_fake("silu_mul")
def _silu_mul(x):
    C.check_silu_mul("silu_mul", x)
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@_fake("silu_mul_quant")
def _silu_mul_quant(x, dtype, scale=None, group_size=0):
    C.check_silu_mul_quant(x, dtype, scale, group_size)
    y_shape = (*x.shape[:-1], x.shape[-1] // 2)
    return x.new_empty(y_shape, dtype=dtype), x.new_empty(_fused_scale(y_shape, group_size), dtype=torch.float32)


@_fake("decode_attention")
def _decode_attention(q, kv_cache, slots, positions, softmax_scale):
    C.check_decode_attention("decode_attention", q, kv_cache, slots, positions, softmax_scale)
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


@_fake("decode_attention_out")
def _decode_attention_out(out, q, kv_cache, slots, positions, softmax_scale):
    C.check_decode_attention("decode_attention", q, kv_cache, slots, positions, softmax_scale, out)


@_fake("decode_attention_quant")
def _decode_attention_quant(q, kv_cache, slots, positions, softmax_scale, dtype, scale=None):
    C.check_decode_attention_quant(q, kv_cache, slots, positions, softmax_scale, dtype, scale)
    return (q.new_empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=dtype),
            q.new_empty((q.shape[0], 1), dtype=torch.float32))


@_fake("rope_kv_cache_")
def _rope_kv_cache(qkv, rope, kv_cache, slots, positions, num_heads, num_kv_heads, q_norm=None, k_norm=None,
                   eps=-1.0):
    C.check_rope_kv_cache(qkv, rope, kv_cache, slots, positions, num_heads, num_kv_heads, q_norm, k_norm, eps)


@_fake("decode_layer")
def _decode_layer(h, residual, input_norm, post_norm, eps, qkv_w, qkv_ws, qkv_is, o_w, o_ws, o_is, gate_up_w,
                  gate_up_ws, gate_up_is, down_w, down_ws, down_is, kv_cache, rope, slots, positions, num_heads,
                  num_kv_heads, softmax_scale):
    C.check_decode_layer(residual, qkv_w, qkv_ws, qkv_is, o_w, o_ws, o_is, gate_up_w, gate_up_ws, gate_up_is,
                         down_w, down_ws, down_is, num_heads, num_kv_heads)
    return residual.new_empty((residual.shape[0], down_w.shape[0]))


# ---- MoE routing --------------------------------------------------------------------------------------------


@_fake("moe_topk_softmax")
def _moe_topk_softmax(router_logits, top_k, renormalize):
    CM.check_moe_topk_softmax(router_logits, top_k, renormalize)
    t = router_logits.shape[0]
    return (router_logits.new_empty((t, top_k), dtype=torch.float32),
            router_logits.new_empty((t, top_k), dtype=torch.int32))


@_fake("moe_route")
def _moe_route(router_logits, top_k, scoring="softmax", correction_bias=None, n_group=1, topk_group=1,
               renormalize=True, scaling_factor=1.0):
    CM.check_moe_route(router_logits, top_k, scoring, correction_bias, n_group, topk_group, renormalize,
                      scaling_factor)
    t = router_logits.shape[0]
    return (router_logits.new_empty((t, top_k), dtype=torch.float32),
            router_logits.new_empty((t, top_k), dtype=torch.int32))


@_fake("moe_router_route")
def _moe_router_route(x, router_weight, top_k, scoring="softmax", correction_bias=None, n_group=1, topk_group=1,
                      renormalize=True, scaling_factor=1.0, logits_dtype=None):
    CM.check_moe_router_route(x, router_weight, top_k, scoring, correction_bias, n_group, topk_group, renormalize,
                              scaling_factor, logits_dtype)
    t = x.shape[0]
    return (x.new_empty((t, top_k), dtype=torch.float32), x.new_empty((t, top_k), dtype=torch.int32))


@_fake("add_rms_norm_moe_router_route")
def _add_rms_norm_moe_router_route(x, residual, norm_weight, eps, router_weight, top_k, scoring="softmax",
                                   correction_bias=None, n_group=1, topk_group=1, renormalize=True,
                                   scaling_factor=1.0, logits_dtype=None):
    CM.check_norm_router_route(x, residual, norm_weight, eps, router_weight, top_k, scoring, correction_bias, n_group,
                               topk_group, renormalize, scaling_factor, logits_dtype)
    t = x.shape[0]
    return (x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty((t, top_k), dtype=torch.float32),
            x.new_empty((t, top_k), dtype=torch.int32))


@_fake("moe_align")
def _moe_align(topk_ids, num_experts):
    CM.check_moe_align(topk_ids, num_experts)
    pairs = topk_ids.shape[0] * topk_ids.shape[1]
    return (topk_ids.new_empty((pairs,), dtype=torch.int32), topk_ids.new_empty((pairs,), dtype=torch.int32),
            topk_ids.new_empty((num_experts,), dtype=torch.int32))


@_fake("moe_permute_quant")
def _moe_permute_quant(x, sorted_pairs, top_k, dtype, scale=None, group_size=0):
    CM.check_moe_permute_quant(x, sorted_pairs, top_k, dtype, scale, group_size)
    y_shape = (x.shape[0] * top_k, x.shape[1])
    return x.new_empty(y_shape, dtype=dtype), x.new_empty(_fused_scale(y_shape, group_size), dtype=torch.float32)


@_fake("moe_unpermute")
def _moe_unpermute(y, dst_pos, topk_weights):
    CM.check_moe_unpermute(y, dst_pos, topk_weights)
    return y.new_empty((topk_weights.shape[0], y.shape[1]))


@_fake("moe_unpermute_out")
def _moe_unpermute_out(out, y, dst_pos, topk_weights):
    CM.check_moe_unpermute(y, dst_pos, topk_weights, out)


@_fake("moe_decode_experts")
def _moe_decode_experts(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, group_size, out_dtype):
    CM.check_moe_decode_experts(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, group_size, out_dtype)
    return x.new_empty((x.shape[0], x.shape[1]), dtype=out_dtype)
