"""The ops' argument contract, composed per op from the operand roles of `_roles.py`.

Used by the CPU implementations (`_reference.py`), the fake kernels (`_fake.py`) and the CUDA-graph updates
(`cutlass_w8a8.graphs`); on CUDA the C++ ops make the same checks, in the same order, with the same first-line
messages (docs/MISUSE.md; tests/test_misuse_table.py holds both to it). Every failure names its op and
argument: ``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong shape, layout, alignment, device
or value: ``"scaled_mm: `a` must be 2-D [M, K], got shape (1, 4, 64)"``.
"""

from __future__ import annotations

import math

import torch

from ._limits import (AB_DTYPES, ATTN_DTYPES, ATTN_HEAD_DIM_MULTIPLE, ATTN_MAX_HEAD_DIM, ATTN_MAX_HEADS,
                      ATTN_MAX_SEQ, BLOCK_SIZE, DECODE_MAX_K, DECODE_X_DTYPES, GEMM_ALIGN, MAX_M, NORM_DECODE_MAX_K,
                      OUT_DTYPES)
from ._limits import MOE_MAX_EXPERTS
from ._roles import (aligned16, bias_vector, block_scale_shaped, block_scaled, block_scales, block_weight_scaled, contiguous, cxx_dtype,
                     exact_shape,
                     cxx_list, grouped_block_scaled, decode_m, eight_bit, float32_scale,
                     float_input, gemm_shapes, gemm_size, int8_k_bound, out_matrix, output_dtype, per_channel_scale,
                     limit_text, quant_dtype, row_input, row_major, same_device, static_scale, tensor_arg,
                     weight_columns, fail_type, fail_value, flat_row_stride, expert_weights, x_dtype, eps_type)

__all__ = ["check_scaled_mm", "check_scaled_mm_decode", "check_grouped_scaled_mm", "check_linear_decode",
           "check_add_rms_norm_linear_decode", "check_w8a8_linear",
           "check_quantize", "check_quantize_group", "check_rms_norm", "check_rms_norm_quant", "check_silu_mul",
           "check_silu_mul_quant",
           "check_decode_attention", "check_decode_attention_quant", "check_rope_kv_cache", "check_decode_layer",
           "fail_type", "fail_value"]


# ---- GEMMs --------------------------------------------------------------------------------------------------


def _gemm_operand_dtypes(op: str, a, b, scale_a, scale_b) -> None:
    """The GEMMs' operand dtypes, in the order the C++ entries check them: a 8-bit (int8 or fp8 e4m3), b of a's
    dtype, scale_a and scale_b float32. Raises TypeError naming the argument."""
    eight_bit(op, "a", a)
    if b.dtype != a.dtype:
        fail_type(op, "b", f"must have a's dtype {a.dtype}, got {b.dtype}")
    float32_scale(op, "scale_a", scale_a)
    float32_scale(op, "scale_b", scale_b)


def _gemm_out_dtypes(op: str, out_dtype, bias, out) -> None:
    """The GEMMs' output-side dtypes, in the order the C++ entries check them: out (when given) bfloat16 or
    float16, `out_dtype` an output dtype, bias (optional tensor) of `out_dtype`, out a tensor. Raises TypeError
    naming the argument."""
    if out is not None and out.dtype not in OUT_DTYPES:
        fail_type(op, "out", f"must be bfloat16 or float16, got {out.dtype}")
    output_dtype(op, out_dtype)
    tensor_arg(op, "bias", bias, optional=True)
    if bias is not None and bias.dtype != out_dtype:
        fail_type(op, "bias", f"must have the output dtype {out_dtype}, got {bias.dtype}")
    tensor_arg(op, "out", out, optional=True)


def check_scaled_mm(op: str, a, b, scale_a, scale_b, out_dtype, bias, out=None) -> None:
    """scaled_mm(_out) and _scaled_mm_config (op names the caller: "scaled_mm", "scaled_mm_decode",
    "graph_update_scaled_mm", ...). `out_dtype` is ``out.dtype`` when `out` is given. Block-scaled calls
    (`_roles.block_scaled`) check the block scale shapes where row-wise calls check theirs."""
    for name, t in (("a", a), ("b", b), ("scale_a", scale_a), ("scale_b", scale_b)):
        tensor_arg(op, name, t)
    _gemm_operand_dtypes(op, a, b, scale_a, scale_b)
    _gemm_out_dtypes(op, out_dtype, bias, out)
    same_device(op, "a", a, [("b", b), ("scale_a", scale_a), ("scale_b", scale_b), ("bias", bias), ("out", out)])

    m, k, n = gemm_shapes(op, "a", a, b)
    if m >= MAX_M:
        fail_value(op, "a", f"M = a.shape[0] must be below {limit_text(MAX_M)}, got {m}")
    gemm_size(op, "a", "K = a.shape[1]", k)
    gemm_size(op, "b", "N = b.shape[1]", n)
    int8_k_bound(op, "a", a.dtype, k)
    if block_scaled(a, b, scale_a, scale_b):
        block_scales(op, a, scale_a, scale_b, m, k, n)
    else:
        if not (scale_a.numel() == 1 or tuple(scale_a.shape) in ((m, 1), (m,))):
            fail_value(op, "scale_a", f"must be [1] (per-tensor) or [M, 1] (per-token) with M = {m}, "
                       f"got shape {tuple(scale_a.shape)}")
        if not (scale_b.numel() == 1 or tuple(scale_b.shape) in ((n,), (1, n), (n, 1))):
            fail_value(op, "scale_b", f"must be [1] (per-tensor), [N], [1, N] or [N, 1] (per-channel) with N = {n}, "
                       f"got shape {tuple(scale_b.shape)}")
    contiguous(op, "scale_a", scale_a)
    contiguous(op, "scale_b", scale_b)
    bias_vector(op, bias, n)
    # Layouts the kernels can read (TMA: 16-byte aligned bases and row pitches). Padded rows are fine.
    row_major(op, "a", a, m, k, "K", GEMM_ALIGN)
    weight_columns(op, b, k)
    aligned16(op, "a", a)
    aligned16(op, "b", b)
    if out is not None:
        out_matrix(op, out, m, n)


def check_fp8_fast_accum(op: str, fp8_fast_accum) -> None:
    """The ``fp8_fast_accum`` argument of scaled_mm(_out) and w8a8_linear: a bool (True: row-wise fp8 on sm90 runs
    the fast-accumulation configs; False: the accurate ones; ignored by int8, block-scaled fp8 and the decode GEMM,
    which always accumulate exactly or promote). torch's dispatcher turns None or a number into a bool before any
    kernel of the op (C++, CPU or fake) sees it (a string it refuses with a RuntimeError naming the argument), so
    this check runs before the op: in the wrapper `scaled_mm` and in `W8A8Config`."""
    if not isinstance(fp8_fast_accum, bool):
        fail_type(op, "fp8_fast_accum", f"must be a bool (True: fast accumulation, False: accurate), got "
                  f"{type(fp8_fast_accum).__name__}")


def check_scaled_mm_decode(op: str, a, b, scale_a, scale_b, out_dtype, bias, out=None) -> None:
    """scaled_mm's checks, then M in [1, DECODE_MAX_M] and K <= DECODE_MAX_K."""
    check_scaled_mm(op, a, b, scale_a, scale_b, out_dtype, bias, out)
    decode_m(op, "a", a.shape[0])
    if a.shape[1] > DECODE_MAX_K:
        fail_value(op, "a", f"K = {a.shape[1]} must be at most {limit_text(DECODE_MAX_K)}")


def check_grouped_scaled_mm(op: str, a, b, scale_a, scale_b, offsets, out_dtype, bias, out=None) -> None:
    """grouped_scaled_mm(_out): a (T, K) 8-bit rows grouped by expert, b (E, K, N) the experts' weights
    (`_roles.expert_weights`), offsets int32 (E,); row-wise scales (scale_a (), (1,), (T,), (T, 1); scale_b (E, N),
    (E,), (E, 1)) or block fp8 (scale_b 3-D: scale_a (T, K/128), scale_b (E, ceil(N/128), K/128)); bias (E, N);
    out (T, N) contiguous. csrc/gemm/grouped_mm_entry.cu raises the same messages in the same order. The values
    of `offsets` are not checked here (device data: the CPU reference checks them, the CUDA kernels clamp them)."""
    for name, t in (("a", a), ("b", b), ("scale_a", scale_a), ("scale_b", scale_b), ("offsets", offsets)):
        tensor_arg(op, name, t)
    _gemm_operand_dtypes(op, a, b, scale_a, scale_b)
    if offsets.dtype != torch.int32:
        fail_type(op, "offsets", f"must be int32, got {offsets.dtype}")
    _gemm_out_dtypes(op, out_dtype, bias, out)
    same_device(op, "a", a, [("b", b), ("scale_a", scale_a), ("scale_b", scale_b), ("offsets", offsets),
                             ("bias", bias), ("out", out)])

    if a.dim() != 2:
        fail_value(op, "a", f"must be 2-D [T, K], got shape {tuple(a.shape)}")
    if b.dim() != 3:
        fail_value(op, "b", f"must be 3-D [E, K, N] (each expert's [N, K] weight transposed), got shape "
                   f"{tuple(b.shape)}")
    t, k = a.shape
    e, n = b.shape[0], b.shape[2]
    if b.shape[1] != k:
        fail_value(op, "b", f"must be [E, K, N] with K = a.shape[1] = {k}, got shape {tuple(b.shape)}")
    if t >= MAX_M:
        fail_value(op, "a", f"T = a.shape[0] must be below {limit_text(MAX_M)}, got {t}")
    gemm_size(op, "a", "K = a.shape[1]", k)
    gemm_size(op, "b", "N = b.shape[2]", n)
    if not 1 <= e <= MOE_MAX_EXPERTS:
        fail_value(op, "b", f"E = b.shape[0] must be in [1, {MOE_MAX_EXPERTS}], got {e}")
    int8_k_bound(op, "a", a.dtype, k)
    exact_shape(op, "offsets", offsets, "E", (e,), "(the end row of each expert's group)")
    if grouped_block_scaled(scale_b):
        block_scales(op, a, scale_a, scale_b, t, k, n, experts=e)
    else:
        if not (scale_a.numel() == 1 or tuple(scale_a.shape) in ((t,), (t, 1))):
            fail_value(op, "scale_a", f"must be [1] (per-tensor), [T] or [T, 1] (per-token) with T = {t}, got shape "
                       f"{tuple(scale_a.shape)}")
        if tuple(scale_b.shape) not in ((e, n), (e,), (e, 1)):
            fail_value(op, "scale_b", f"must be [E, N] (per-channel), [E] or [E, 1] (per-expert) with E = {e}, "
                       f"N = {n}, or [E, ceil(N/128), K/128] (block fp8), got shape {tuple(scale_b.shape)}")
    contiguous(op, "scale_a", scale_a)
    contiguous(op, "scale_b", scale_b)
    contiguous(op, "offsets", offsets)
    if bias is not None:
        exact_shape(op, "bias", bias, "E, N", (e, n))
        contiguous(op, "bias", bias)
    row_major(op, "a", a, t, k, "K", GEMM_ALIGN)
    expert_weights(op, b, k, n)
    aligned16(op, "a", a)
    aligned16(op, "b", b)
    if out is not None:
        exact_shape(op, "out", out, "T, N", (t, n))
        contiguous(op, "out", out)
        aligned16(op, "out", out)


def _decode_sizes(op: str, x, b) -> tuple:
    """The decode GEMM's (M, K, N) from x (M, K) and b (K, N), checked: M in [1, DECODE_MAX_M], K and N sizes,
    int8's K bound (linear_decode and add_rms_norm_linear_decode, in their C++ order)."""
    m, k, n = gemm_shapes(op, "x", x, b)
    decode_m(op, "x", m)
    gemm_size(op, "x", "K = x.shape[1]", k)
    gemm_size(op, "b", "N = b.shape[1]", n)
    int8_k_bound(op, "x", b.dtype, k)
    return m, k, n


def _decode_layouts(op: str, x, b, m: int, k: int) -> None:
    """The layouts the decode GEMM reads with 16-byte loads: b as scaled_mm's (column-major weight), x row-major with
    a row pitch that is a multiple of 8 elements, both 16-byte aligned."""
    weight_columns(op, b, k)
    aligned16(op, "b", b)
    row_major(op, "x", x, m, k, "K", 8)
    aligned16(op, "x", x)


def check_linear_decode(op: str, x, b, scale_b, bias, dtype, out=None) -> None:
    """linear_decode(_out): x (M, K) bfloat16 / float16 quantized to `dtype`, then scaled_mm_decode's GEMM."""
    for name, t in (("x", x), ("b", b), ("scale_b", scale_b)):
        tensor_arg(op, name, t)
    tensor_arg(op, "out", out, optional=True)
    tensor_arg(op, "bias", bias, optional=True)
    float_input(op, "x", x, DECODE_X_DTYPES)
    quant_dtype(op, dtype)
    if b.dtype != dtype:
        fail_type(op, "b", f"must have the quantized dtype {dtype}, got {b.dtype}")
    float32_scale(op, "scale_b", scale_b)
    for name, t in (("out", out), ("bias", bias)):
        x_dtype(op, name, t, x)
    same_device(op, "x", x, [("b", b), ("scale_b", scale_b), ("out", out), ("bias", bias)])
    m, k, n = _decode_sizes(op, x, b)
    if k > DECODE_MAX_K:
        fail_value(op, "x", f"K = {k} must be at most {limit_text(DECODE_MAX_K)}")
    per_channel_scale(op, "scale_b", scale_b, n)
    bias_vector(op, bias, n)
    _decode_layouts(op, x, b, m, k)
    if out is not None:
        out_matrix(op, out, m, n)


def check_add_rms_norm_linear_decode(x, residual, norm_weight, eps, b, scale_b, bias, dtype) -> None:
    """add_rms_norm_linear_decode: x (M, K) bfloat16 / float16 and residual (M, K) or None added, RMS-normalized
    with norm_weight (K,) and eps, quantized per token to `dtype`, then linear_decode's GEMM; K <= 8192."""
    op = "add_rms_norm_linear_decode"
    for name, t in (("x", x), ("norm_weight", norm_weight), ("b", b), ("scale_b", scale_b)):
        tensor_arg(op, name, t)
    tensor_arg(op, "residual", residual, optional=True)
    tensor_arg(op, "bias", bias, optional=True)
    # dtypes
    float_input(op, "x", x, DECODE_X_DTYPES)
    for name, t in (("residual", residual), ("norm_weight", norm_weight)):
        x_dtype(op, name, t, x)
    eps_type(op, eps)
    quant_dtype(op, dtype)
    if b.dtype != dtype:
        fail_type(op, "b", f"must have the quantized dtype {dtype}, got {b.dtype}")
    float32_scale(op, "scale_b", scale_b)
    x_dtype(op, "bias", bias, x)
    same_device(op, "x", x, [("residual", residual), ("norm_weight", norm_weight), ("b", b), ("scale_b", scale_b),
                             ("bias", bias)])
    # values and shapes
    if not 0.0 <= eps < float("inf"):
        fail_value(op, "eps", f"must be a finite number >= 0, got {eps}")
    m, k, n = _decode_sizes(op, x, b)
    if k > NORM_DECODE_MAX_K:
        fail_value(op, "x", f"K = x.shape[1] must be at most {NORM_DECODE_MAX_K} (the rows rms_norm_quant "
                   f"normalizes in one block), got {k}")
    if residual is not None and tuple(residual.shape) != tuple(x.shape):
        fail_value(op, "residual", f"must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if tuple(norm_weight.shape) != (k,):
        fail_value(op, "norm_weight", f"must be [K] with K = {k}, got shape {tuple(norm_weight.shape)}")
    if block_scale_shaped(n, k, scale_b):
        fail_value(op, "scale_b", f"block scales {tuple(scale_b.shape)} are not supported (the fused norm quantizes "
                   "per token): use rms_norm_quant(group_size=128) and scaled_mm")
    per_channel_scale(op, "scale_b", scale_b, n)
    bias_vector(op, bias, n)
    _decode_layouts(op, x, b, m, k)  # residual and norm_weight: below
    if residual is not None:
        row_major(op, "residual", residual, m, k, "K", 8)
        aligned16(op, "residual", residual)
    contiguous(op, "norm_weight", norm_weight)
    aligned16(op, "norm_weight", norm_weight)


def check_w8a8_linear(x, weight, weight_scale, input_scale, bias, out_dtype) -> None:
    """w8a8_linear: x (..., K) float, weight (N, K) row-major 8-bit; csrc/gemm/w8a8_linear.cu raises the same.
    With block weight scales (`_roles.block_weight_scaled`) `input_scale` must be None and K a multiple of 128,
    checked where the row-wise weight_scale shape is."""
    op = "w8a8_linear"
    for name, t in (("x", x), ("weight", weight), ("weight_scale", weight_scale)):
        tensor_arg(op, name, t)
    tensor_arg(op, "input_scale", input_scale, optional=True)
    tensor_arg(op, "bias", bias, optional=True)
    float_input(op, "x", x)
    eight_bit(op, "weight", weight)
    float32_scale(op, "weight_scale", weight_scale)
    float32_scale(op, "input_scale", input_scale)
    output_dtype(op, out_dtype)
    if bias is not None and bias.dtype != out_dtype:
        fail_type(op, "bias", f"must have the output dtype {out_dtype}, got {bias.dtype}")
    same_device(op, "x", x, [("weight", weight), ("weight_scale", weight_scale), ("input_scale", input_scale),
                              ("bias", bias)])
    if x.dim() < 1:
        fail_value(op, "x", "must have at least one dimension [..., K]")
    if weight.dim() != 2:
        fail_value(op, "weight", f"must be 2-D [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k:
        fail_value(op, "weight", f"must be [N, K] with K = x.shape[-1] = {x.shape[-1]}, got shape "
                   f"{tuple(weight.shape)}")
    gemm_size(op, "weight", "K = weight.shape[1]", k)
    gemm_size(op, "weight", "N = weight.shape[0]", n)
    int8_k_bound(op, "weight", weight.dtype, k)
    sb = weight_scale.numel()
    if block_weight_scaled(weight, weight_scale):
        if input_scale is not None:
            fail_value(op, "input_scale", "must be None with block weight scales (activations are quantized per "
                       "1x128 group at run time), got a tensor")
        if k % BLOCK_SIZE != 0:
            fail_value(op, "weight", f"K = weight.shape[1] must be a multiple of {BLOCK_SIZE} with block scales, "
                       f"got {k}")
    elif weight_scale.dim() > 2 or not (sb == 1 or (sb == n and (weight_scale.dim() == 1 or 1 in weight_scale.shape))):
        fail_value(op, "weight_scale", f"must hold 1 (per-tensor) or N = {n} (per-channel: (N,), (N, 1) or (1, N)) "
                   f"values, got shape {tuple(weight_scale.shape)}")
    contiguous(op, "weight_scale", weight_scale)
    if input_scale is not None and input_scale.numel() != 1:
        fail_value(op, "input_scale", f"must hold one value (static per-tensor), got shape {tuple(input_scale.shape)}")
    bias_vector(op, bias, n)
    row_major(op, "weight", weight, n, k, "K", GEMM_ALIGN, form="row-major [N, K]", always=True)
    aligned16(op, "weight", weight)


# ---- row-wise ops -------------------------------------------------------------------------------------------


def check_quantize(op: str, x, dtype, scale=None) -> None:
    """quantize_per_token (scale None) and quantize_per_tensor: x (..., K) float, a static scale of one value."""
    tensor_arg(op, "x", x)
    float_input(op, "x", x)
    quant_dtype(op, dtype)
    if x.dim() < 1:
        fail_value(op, "x", "must have at least one dimension [..., K]")
    if scale is not None:
        static_scale(op, x, scale)


def check_quantize_group(x, group_size, dtype) -> None:
    """quantize_per_token_group: quantize_per_token's checks of x (..., K) and dtype, then group_size = 128
    and K a multiple of it."""
    op = "quantize_per_token_group"
    check_quantize(op, x, dtype)
    if group_size != BLOCK_SIZE:
        fail_value(op, "group_size", f"must be {BLOCK_SIZE}, got {group_size}")
    if x.shape[-1] % group_size != 0:
        fail_value(op, "x", f"K = x.shape[1] must be a multiple of group_size = {group_size}, got {x.shape[-1]}")


def _group_quant(op: str, x, k: int, scale, group_size) -> None:
    """The quantization mode of rms_norm_quant / silu_mul_quant: group_size 0 (per-token, or per-tensor with
    the static `scale`) or 128 (dynamic 1 x 128 groups of the output row of length `k`)."""
    if group_size not in (0, BLOCK_SIZE):
        fail_value(op, "group_size", f"must be 0 (per-token) or {BLOCK_SIZE}, got {group_size}")
    if group_size:
        if scale is not None:
            fail_value(op, "scale", f"must be None with group_size = {group_size} (dynamic per-group scales), got a "
                       "tensor")
        if k % group_size != 0:
            fail_value(op, "x", f"the output row length {k} must be a multiple of group_size = {group_size}")
    elif scale is not None:
        static_scale(op, x, scale)


def check_rms_norm(op: str, x, weight, eps, residual) -> None:
    """rms_norm (residual None), fused_add_rms_norm, and the norm part of rms_norm_quant."""
    row_input(op, x)
    k = x.shape[-1]
    tensor_arg(op, "weight", weight)
    x_dtype(op, "weight", weight, x)
    same_device(op, "x", x, [("weight", weight)])
    if weight.dim() != 1 or weight.shape[0] != k:
        fail_value(op, "weight", f"must be [K] with K = {k}, got shape {tuple(weight.shape)}")
    if k > 1 and weight.stride(0) != 1:
        fail_value(op, "weight", "must be contiguous")
    eps_type(op, eps)
    if not 0.0 <= eps < float("inf"):
        fail_value(op, "eps", f"must be a finite number >= 0, got {eps}")
    if residual is None:
        return
    tensor_arg(op, "residual", residual, optional=True)
    x_dtype(op, "residual", residual, x)
    same_device(op, "x", x, [("residual", residual)])
    if residual.shape != x.shape:
        fail_value(op, "residual", f"must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    stride = flat_row_stride(residual)
    if stride is None:
        fail_value(op, "residual", "must be updatable in place as [M, K] rows (unit-stride rows whose leading "
                   f"dimensions merge), got strides {residual.stride()}")
    if x.numel() // k > 1 and stride < k:
        fail_value(op, "residual", f"rows overlap: row stride {stride} < K = {k}")


def check_rms_norm_quant(x, weight, eps, dtype, scale, residual, group_size=0) -> None:
    op = "rms_norm_quant"
    check_rms_norm(op, x, weight, eps, residual)
    quant_dtype(op, dtype)
    _group_quant(op, x, x.shape[-1], scale, group_size)


def check_silu_mul(op: str, x) -> None:
    """silu_mul and the activation part of silu_mul_quant: x (..., 2 * I) = [gate | up]."""
    row_input(op, x)
    if x.shape[-1] % 2 != 0:
        fail_value(op, "x", "must have an even last dimension [..., 2 * I] (gate then up), "
                   f"got shape {tuple(x.shape)}")


def check_silu_mul_quant(x, dtype, scale, group_size=0) -> None:
    op = "silu_mul_quant"
    check_silu_mul(op, x)
    quant_dtype(op, dtype)
    _group_quant(op, x, x.shape[-1] // 2, scale, group_size)


# ---- attention ----------------------------------------------------------------------------------------------


def check_decode_attention(op: str, q, kv_cache, slots, positions, softmax_scale, out=None) -> None:
    """decode_attention(_out): q (B, H, D), kv_cache (num_slots, 2, KVH, S, D), slots and positions (B,) int64."""
    for name, t in (("q", q), ("kv_cache", kv_cache), ("slots", slots), ("positions", positions)):
        tensor_arg(op, name, t)
    tensor_arg(op, "out", out, optional=True)
    float_input(op, "q", q, ATTN_DTYPES)
    if kv_cache.dtype != q.dtype:
        fail_type(op, "kv_cache", f"must have q's dtype {q.dtype}, got {kv_cache.dtype}")
    for name, t in (("slots", slots), ("positions", positions)):
        if t.dtype != torch.int64:
            fail_type(op, name, f"must be int64, got {t.dtype}")
    if out is not None and out.dtype != q.dtype:
        fail_type(op, "out", f"must have q's dtype {q.dtype}, got {out.dtype}")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, torch.SymFloat)):
        fail_type(op, "softmax_scale", f"must be a float, got {type(softmax_scale).__name__}")
    if isinstance(softmax_scale, (int, float)) and not math.isfinite(softmax_scale):
        fail_value(op, "softmax_scale", f"must be finite, got {softmax_scale}")
    same_device(op, "q", q, [("kv_cache", kv_cache), ("slots", slots), ("positions", positions), ("out", out)])

    if q.dim() != 3:
        fail_value(op, "q", f"must be 3-D (B, H, D), got shape {tuple(q.shape)}")
    b, h, d = q.shape
    if d <= 0 or d > ATTN_MAX_HEAD_DIM or d % ATTN_HEAD_DIM_MULTIPLE != 0:
        fail_value(op, "q", f"head dim D = q.shape[2] must be a multiple of {ATTN_HEAD_DIM_MULTIPLE} in "
                   f"[{ATTN_HEAD_DIM_MULTIPLE}, {ATTN_MAX_HEAD_DIM}], got {d}")
    if h > ATTN_MAX_HEADS:
        fail_value(op, "q", f"H = q.shape[1] must be at most {ATTN_MAX_HEADS}, got {h}")
    kv_shape = tuple(kv_cache.shape)
    if (kv_cache.dim() != 5 or kv_shape[0] < 1 or kv_shape[1] != 2 or kv_shape[2] < 1 or kv_shape[3] < 1
            or kv_shape[4] != d):
        fail_value(op, "kv_cache", f"must be (num_slots, 2, KVH, S, D) with D = q.shape[2] = {d} and "
                   f"num_slots, KVH, S >= 1, got shape {kv_shape}")
    kvh, s = kv_shape[2], kv_shape[3]
    if h % kvh != 0:
        fail_value(op, "kv_cache", f"KVH = kv_cache.shape[2] = {kvh} must divide H = q.shape[1] = {h}")
    if s >= ATTN_MAX_SEQ:
        fail_value(op, "kv_cache", f"S = kv_cache.shape[3] must be below {limit_text(ATTN_MAX_SEQ)}, got {s}")
    for name, t in (("slots", slots), ("positions", positions)):
        if tuple(t.shape) != (b,):
            fail_value(op, name, f"must be (B,) with B = q.shape[0] = {b}, got shape {tuple(t.shape)}")
    if q.stride(2) != 1:
        fail_value(op, "q", f"must have stride(2) == 1, got strides {q.stride()}")
    contiguous(op, "kv_cache", kv_cache)
    aligned16(op, "kv_cache", kv_cache)
    if out is not None:
        if tuple(out.shape) != (b, h * d):
            fail_value(op, "out", f"must be (B, H * D) = ({b}, {h * d}), got shape {tuple(out.shape)}")
        contiguous(op, "out", out)


def check_decode_attention_quant(q, kv_cache, slots, positions, softmax_scale, dtype, scale) -> None:
    """decode_attention_quant: decode_attention's checks (no `out`), then the quantized `dtype`, then the
    static `scale` (None, or float32 with one value on q's device)."""
    op = "decode_attention_quant"
    check_decode_attention(op, q, kv_cache, slots, positions, softmax_scale)
    quant_dtype(op, dtype)
    if scale is not None:
        static_scale(op, q, scale, ref_name="q")


def check_rope_kv_cache(qkv, rope, kv_cache, slots, positions, num_heads, num_kv_heads, q_norm=None, k_norm=None,
                        eps=-1.0) -> None:
    """rope_kv_cache_: csrc/attention/rope_kv_cache.cu's checks, in its order and wording (C++ dtype names and
    bracketed sizes), except its first device check ("`qkv` must be a CUDA tensor")."""
    op = "rope_kv_cache_"
    for name, t in (("qkv", qkv), ("rope", rope), ("kv_cache", kv_cache), ("slots", slots),
                    ("positions", positions)):
        tensor_arg(op, name, t)
    if qkv.dtype not in ATTN_DTYPES:
        fail_type(op, "qkv", f"must be bfloat16, float16 or float32, got {cxx_dtype(qkv.dtype)}")
    if kv_cache.dtype != qkv.dtype:
        fail_type(op, "kv_cache", "must have qkv's dtype")
    if rope.dtype != torch.float32:
        fail_type(op, "rope", "must be float32")
    for name, t in (("slots", slots), ("positions", positions)):
        if t.dtype != torch.int64:
            fail_type(op, name, "must be int64")
    if any(t.device != qkv.device for t in (rope, kv_cache, slots, positions)):
        fail_value(op, "qkv", "and `rope`, `kv_cache`, `slots`, `positions` must be on one device")
    if num_heads <= 0 or num_kv_heads <= 0:
        fail_value(op, "num_heads", "and `num_kv_heads` must be positive")
    if qkv.dim() != 3 or qkv.shape[1] != num_heads + 2 * num_kv_heads:
        fail_value(op, "qkv", f"must be (B, num_heads + 2 num_kv_heads, D), got {cxx_list(qkv.shape)}")
    b, d = qkv.shape[0], qkv.shape[2]
    if d < 2 or d % 2 != 0 or qkv.stride(2) != 1 or qkv.stride(1) != d:
        fail_value(op, "qkv", f"must have contiguous heads of even D (strides (*, D, 1)), got strides "
                   f"{cxx_list(qkv.stride())}")
    if not (kv_cache.dim() == 5 and kv_cache.shape[1] == 2 and kv_cache.shape[2] == num_kv_heads
            and kv_cache.shape[4] == d and kv_cache.is_contiguous()):
        fail_value(op, "kv_cache", f"must be contiguous (slots, 2, num_kv_heads, S, D), got "
                   f"{cxx_list(kv_cache.shape)}")
    # the rotary width R = 2 rope.shape[1] (partial rotary, GLM's partial_rotary_factor): 2 <= R <= D
    if not (rope.dim() == 3 and rope.shape[0] == b and 1 <= rope.shape[1] <= d // 2 and rope.shape[2] == 2
            and rope.is_contiguous()):
        fail_value(op, "rope", f"must be contiguous (B, R / 2, 2) with 1 <= R / 2 <= D / 2 = {d // 2}, got "
                   f"{cxx_list(rope.shape)}")
    for name, t in (("slots", slots), ("positions", positions)):
        if t.dim() != 1 or t.shape[0] != b:
            fail_value(op, name, f"must be (B,), got {cxx_list(t.shape)}")
    if kv_cache.shape[0] == 0 or kv_cache.shape[3] == 0:
        fail_value(op, "kv_cache", "must not be empty")
    # the head norms: both or neither, (D,) contiguous in qkv's dtype on its device; eps finite and >= 0
    if (q_norm is None) != (k_norm is None):
        fail_value(op, "q_norm", "and `k_norm` must be given together (Qwen3's head norms) or both be None")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is None:
            continue
        tensor_arg(op, name, w)
        if w.dtype != qkv.dtype:
            fail_type(op, name, "must have qkv's dtype")
        if w.device != qkv.device:
            fail_value(op, name, "must be on qkv's device")
        if w.dim() != 1 or w.shape[0] != d or w.stride(0) != 1:
            fail_value(op, name, f"must be contiguous (D,) = [{d}], got {cxx_list(w.shape)}")
    if q_norm is not None and not (eps >= 0.0 and math.isfinite(eps)):
        fail_value(op, "eps", "must be given with q_norm and k_norm, a finite number >= 0")


# ---- decode_layer -------------------------------------------------------------------------------------------


def check_decode_layer(residual, qkv_w, qkv_ws, qkv_is, o_w, o_ws, o_is, gate_up_w, gate_up_ws, gate_up_is,
                       down_w, down_ws, down_is, num_heads, num_kv_heads) -> None:
    """The layer-level contract of decode_layer (csrc/models/decode_layer.cpp raises the same messages); each
    step's own op checks the rest."""
    op = "decode_layer"
    projections = (("qkv_w", qkv_w, qkv_ws, qkv_is), ("o_w", o_w, o_ws, o_is),
                   ("gate_up_w", gate_up_w, gate_up_ws, gate_up_is), ("down_w", down_w, down_ws, down_is))
    tensor_arg(op, "residual", residual)
    if residual.dtype not in OUT_DTYPES:
        fail_type(op, "residual", f"must be bfloat16 or float16, got {residual.dtype}")
    if residual.dim() != 2:
        fail_value(op, "residual", f"must be 2-D (B, hidden), got shape {tuple(residual.shape)}")
    quantized = qkv_w.dtype in AB_DTYPES
    for name, w, ws, is_ in projections:
        if quantized:
            if w.dtype != qkv_w.dtype:
                fail_type(op, name, f"must have qkv_w's dtype {qkv_w.dtype} (all four projections 8-bit alike, or "
                          f"all in the model dtype), got {w.dtype}")
            if ws is None:
                fail_value(op, name, "is 8-bit: its weight scale must be given")
        else:
            if w.dtype != residual.dtype:
                fail_type(op, name, f"must have the model dtype {residual.dtype} (all four projections in the "
                          f"model dtype, or all 8-bit alike), got {w.dtype}")
            if ws is not None or is_ is not None:
                fail_value(op, name, "is not 8-bit: it takes no weight or input scale")
    rows = qkv_w.shape[0]
    d = rows // (num_heads + 2 * num_kv_heads) if num_heads > 0 and num_kv_heads > 0 else 0
    if num_heads <= 0 or num_kv_heads <= 0 or d <= 0 or rows != (num_heads + 2 * num_kv_heads) * d:
        fail_value(op, "qkv_w", f"must have (num_heads + 2 * num_kv_heads) * head_dim rows, got shape "
                   f"{tuple(qkv_w.shape)} for num_heads = {num_heads}, num_kv_heads = {num_kv_heads}")
