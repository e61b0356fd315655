"""The CPU implementations of the ops: the kernels' arithmetic in the kernels' order (csrc/gemm/EPILOGUES.md),
each after its op's checks (`_checks.py`). Registered for the CPU dispatch key at import.

The fused ops' references are the unfused torch chains they replace, op for op, in x's dtype, so on the CPU the
fused ops equal the chains bit for bit by construction (tests/ops/test_fused_quant_cpu.py). decode_layer's CPU
implementation is the same op calls, in the same order, as `LlamaDecoderLayer`'s Python path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _checks as C
from . import _checks_moe as CM
from ._limits import AB_DTYPES, BLOCK_SIZE, FP8_FAST_ACCUM, QMAX
from ._roles import block_scaled, block_weight_scaled, grouped_block_scaled
from ._schema import lib

# ---- GEMMs --------------------------------------------------------------------------------------------------


def scaled_mm_reference(a, b, scale_a, scale_b, out_dtype, bias):
    """``round(scale_a * (scale_b * float32(a @ b)) + bias)``; `a` (M, K), `b` (K, N) 8-bit, checked."""
    # Exact products summed in float64 (exact for int8 at any legal K), then rounded to float32 as the
    # kernels' int32 -> float32 conversion (or fp32 accumulator) does.
    acc = (a.to(torch.float64) @ b.to(torch.float64)).to(torch.float32)
    d = (acc * scale_b.reshape(1, -1)) * scale_a.reshape(-1, 1)
    if bias is not None:
        d = d + bias.to(torch.float32)
    return d.to(out_dtype)


def block_scaled_mm_reference(a, b, scale_a, scale_b, out_dtype, bias):
    """Block-scaled fp8, checked operands: `a` (M, K) e4m3, `b` (K, N) e4m3, `scale_a` (M, K/128) and `scale_b`
    (ceil(N/128), K/128) float32, K a multiple of 128:

        out[m, n] = round_out( sum_kb  p_kb[m, n] * (scale_a[m, kb] * scale_b[n // 128, kb])  + bias[n] )

    with p_kb the dot product over K block kb (128 e4m3 products, exact in float64, rounded once to float32:
    the kernels' float32 partial accumulator), the sum over kb in float32 in order of kb, the bias added in
    float32, one rounding to `out_dtype`."""
    m, k = a.shape
    n = b.shape[1]
    sb = scale_b.repeat_interleave(BLOCK_SIZE, dim=0)[:n]  # (N, KB): each weight row's block scales
    acc = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    for kb in range(k // BLOCK_SIZE):
        ks = slice(kb * BLOCK_SIZE, (kb + 1) * BLOCK_SIZE)
        part = (a[:, ks].to(torch.float64) @ b[ks].to(torch.float64)).to(torch.float32)
        acc = acc + part * (scale_a[:, kb].reshape(m, 1) * sb[:, kb].reshape(1, n))
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(out_dtype)


def gemm_reference(a, b, scale_a, scale_b, out_dtype, bias):
    """The reference of a checked scaled_mm-shaped call: block-scaled or row-wise."""
    if block_scaled(a, b, scale_a, scale_b):
        return block_scaled_mm_reference(a, b, scale_a, scale_b, out_dtype, bias)
    return scaled_mm_reference(a, b, scale_a, scale_b, out_dtype, bias)


def _gemm_pair(op: str, check):
    """The CPU functional and out= implementations of a scaled_mm-shaped op (`check` is its contract)."""

    def functional(a, b, scale_a, scale_b, out_dtype, bias=None):
        check(op, a, b, scale_a, scale_b, out_dtype, bias)
        return gemm_reference(a, b, scale_a, scale_b, out_dtype, bias)

    def out_variant(out, a, b, scale_a, scale_b, bias=None):
        check(op, a, b, scale_a, scale_b, out.dtype, bias, out)
        out.copy_(gemm_reference(a, b, scale_a, scale_b, out.dtype, bias))

    return functional, out_variant


_scaled_mm_decode, _scaled_mm_decode_out = _gemm_pair("scaled_mm_decode", C.check_scaled_mm_decode)


# scaled_mm(_out): the reference accumulates in float32 from exact products whatever `fp8_fast_accum` says (the flag
# chooses between two sm90 kernel families; the dispatcher has made it a bool, see C.check_fp8_fast_accum).
def _scaled_mm(a, b, scale_a, scale_b, out_dtype, bias=None, fp8_fast_accum=FP8_FAST_ACCUM):
    C.check_scaled_mm("scaled_mm", a, b, scale_a, scale_b, out_dtype, bias)
    return gemm_reference(a, b, scale_a, scale_b, out_dtype, bias)


def _scaled_mm_out(out, a, b, scale_a, scale_b, bias=None, fp8_fast_accum=FP8_FAST_ACCUM):
    C.check_scaled_mm("scaled_mm", a, b, scale_a, scale_b, out.dtype, bias, out)
    out.copy_(gemm_reference(a, b, scale_a, scale_b, out.dtype, bias))


def _scaled_mm_config(out, a, b, scale_a, scale_b, bias, config):
    _scaled_mm_out(out, a, b, scale_a, scale_b, bias)


def _w8a8_linear(x, weight, weight_scale, input_scale=None, bias=None, out_dtype=torch.bfloat16,
                 fp8_fast_accum=FP8_FAST_ACCUM):
    C.check_w8a8_linear(x, weight, weight_scale, input_scale, bias, out_dtype)
    # quantize_per_token / quantize_per_tensor (quantize_per_token_group with block weight scales), then
    # scaled_mm: the CUDA op's definition
    k, n = weight.shape[1], weight.shape[0]
    x2 = x.reshape(-1, k)
    if block_weight_scaled(weight, weight_scale):
        q, scale_a = quantize_groups(x2, BLOCK_SIZE, weight.dtype)
        y = block_scaled_mm_reference(q, weight.t(), scale_a, weight_scale, out_dtype, bias)
        return y.reshape(*x.shape[:-1], n)
    if input_scale is None:
        q, scale_a = _quantize_per_token(x2, weight.dtype)
    else:
        q, scale_a = quantize_rows(x2.to(torch.float32), input_scale.reshape(()), weight.dtype), input_scale
    y = scaled_mm_reference(q, weight.t(), scale_a, weight_scale.reshape(-1), out_dtype, bias)
    return y.reshape(*x.shape[:-1], n)


def grouped_offsets(offsets, t: int) -> list:
    """The values of a checked int32 `offsets` [E] (the end row of each expert's group) as a list; raises
    ValueError naming `offsets` unless they are non-decreasing within [0, T]. The CUDA kernels cannot check device
    data without a host synchronisation: they clamp instead (c[e] = min(T, max(c[e - 1], offsets[e])), c[-1] = 0)."""
    values = [int(v) for v in offsets.tolist()]
    prev = 0
    for e, v in enumerate(values):
        if v < prev or v > t:
            raise ValueError(f"grouped_scaled_mm: `offsets` must be non-decreasing values in [0, T] with T = {t} (the "
                             f"end row of each expert's group), got offsets[{e}] = {v} after {prev}")
        prev = v
    return values


def grouped_scaled_mm_reference(a, b, scale_a, scale_b, offsets, out_dtype, bias, out=None):
    """grouped_scaled_mm of checked operands: for each expert e with rows [offsets[e - 1], offsets[e]) (offsets[-1]
    read as 0), those rows of the result are scaled_mm's (or block fp8's) reference of the rows of `a`, the
    expert's weight b[e] (K, N) and its scales and bias; every expert's math is its dense reference's (exact
    products in float64, float32 scaling, one rounding to out_dtype). Rows >= offsets[E - 1] are left as they are
    in `out`, or zero in a fresh result."""
    t, n = a.shape[0], b.shape[2]
    ends = grouped_offsets(offsets, t)
    result = torch.zeros(t, n, dtype=out_dtype, device=a.device) if out is None else out
    block = grouped_block_scaled(scale_b)
    per_token = scale_a.numel() != 1
    per_channel = scale_b.dim() == 2 and scale_b.shape[1] == n
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            rows = slice(start, end)
            be = bias[e] if bias is not None else None
            if block:
                y = block_scaled_mm_reference(a[rows], b[e], scale_a[rows], scale_b[e], out_dtype, be)
            else:
                sa = scale_a.reshape(-1)[rows] if per_token else scale_a.reshape(1)
                sb = scale_b[e].reshape(-1) if per_channel else scale_b.reshape(-1)[e:e + 1]
                y = scaled_mm_reference(a[rows], b[e], sa, sb, out_dtype, be)
            result[rows] = y
        start = end
    return result


def _grouped_scaled_mm(a, b, scale_a, scale_b, offsets, out_dtype, bias=None):
    C.check_grouped_scaled_mm("grouped_scaled_mm", a, b, scale_a, scale_b, offsets, out_dtype, bias)
    return grouped_scaled_mm_reference(a, b, scale_a, scale_b, offsets, out_dtype, bias)


def _grouped_scaled_mm_out(out, a, b, scale_a, scale_b, offsets, bias=None):
    C.check_grouped_scaled_mm("grouped_scaled_mm", a, b, scale_a, scale_b, offsets, out.dtype, bias, out)
    grouped_scaled_mm_reference(a, b, scale_a, scale_b, offsets, out.dtype, bias, out)


def _grouped_scaled_mm_config(out, a, b, scale_a, scale_b, offsets, bias, config):
    _grouped_scaled_mm_out(out, a, b, scale_a, scale_b, offsets, bias)


# linear_decode: the CPU per-token quantization, then scaled_mm's reference (the CUDA kernel equals
# quantize_per_token followed by scaled_mm_decode bit for bit; on the CPU that chain is the definition).


def _linear_decode_reference(x, b, scale_b, bias, dtype):
    q, scale = _quantize_per_token(x, dtype)
    return scaled_mm_reference(q, b, scale, scale_b, x.dtype, bias)


def _same_args_pair(op: str, check, reference):
    """The CPU functional and out= implementations of an op whose out= variant takes the functional's
    arguments after ``out`` (linear_decode, decode_attention)."""

    def functional(*args):
        check(op, *args)
        return reference(*args)

    def out_variant(out, *args):
        check(op, *args, out)
        out.copy_(reference(*args))

    return functional, out_variant


_linear_decode, _linear_decode_out = _same_args_pair("linear_decode", C.check_linear_decode,
                                                     _linear_decode_reference)



def _add_rms_norm_linear_decode(x, residual, norm_weight, eps, b, scale_b, bias, dtype):
    """The CPU chain the fused op replaces, op for op: rms_norm_quant(x, norm_weight, eps, dtype, None, r) on a copy r
    of the residual (which it updates in place to s = residual + x: residual_out), then scaled_mm_decode's reference
    with the per-token scales. Without a residual, s = x and residual_out is a copy of x."""
    C.check_add_rms_norm_linear_decode(x, residual, norm_weight, eps, b, scale_b, bias, dtype)
    stream = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        stream.copy_(x)
        y = _rms_norm_reference(x, norm_weight, eps, None)
    else:
        stream.copy_(residual)
        y = _rms_norm_reference(x, norm_weight, eps, stream)  # stream += x in x's dtype
    q, scale = _quantize_fused(y, dtype, None)
    return scaled_mm_reference(q, b, scale, scale_b, x.dtype, bias), stream


# ---- quantization -------------------------------------------------------------------------------------------


def quantize_rows(xf: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q = saturate(round_half_even(xf / scale)); q = 0 where scale == 0. float32 in, IEEE division."""
    y = torch.where(scale == 0, torch.zeros_like(xf), xf / torch.where(scale == 0, torch.ones_like(scale), scale))
    qmax = QMAX[dtype]
    if dtype == torch.int8:
        q = torch.round(y).clamp(-128, 127).to(torch.int8)
    else:
        q = y.clamp(-qmax, qmax).to(dtype)
    return q.contiguous()  # as the CUDA kernels and the fake kernels: contiguous whatever x's layout


def _quantize_per_token(x, dtype):
    C.check_quantize("quantize_per_token", x, dtype)
    xf = x.to(torch.float32)
    if x.shape[-1] == 0:
        amax = torch.zeros(*x.shape[:-1], 1, dtype=torch.float32)
    else:
        amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = amax / torch.tensor(QMAX[dtype], dtype=torch.float32)
    return quantize_rows(xf, scale, dtype), scale


def quantize_groups(x, group_size, dtype):
    """(q, scale) of x (..., K) in 1 x group_size groups along K (K a multiple of group_size): per group
    scale = absmax / QMAX (float32, IEEE division; 0 for a group of zeros, whose q is 0), q = sat(rne(x / scale))
    as quantize_per_token does per row. q has x's shape, scale is (..., K / group_size); both contiguous."""
    k = x.shape[-1]
    xf = x.to(torch.float32).reshape(*x.shape[:-1], k // group_size, group_size)
    scale = xf.abs().amax(dim=-1, keepdim=True) / torch.tensor(QMAX[dtype], dtype=torch.float32, device=x.device)
    q = quantize_rows(xf, scale, dtype).reshape(x.shape)
    return q, scale.reshape(*x.shape[:-1], k // group_size).contiguous()


def _quantize_per_token_group(x, group_size, dtype):
    C.check_quantize_group(x, group_size, dtype)
    return quantize_groups(x, group_size, dtype)


def _quantize_per_tensor(x, scale, dtype):
    C.check_quantize("quantize_per_tensor", x, dtype, scale)
    return quantize_rows(x.to(torch.float32), scale.reshape(()), dtype)


def _quantize_fused(y, dtype, scale, group_size=0):
    """(q, scale) of the fused ops: quantize_per_token of y, quantize_per_token_group of y (group_size 128:
    scale (..., K / 128)), or quantize_per_tensor with the static `scale` and that scale repeated per row
    ([..., 1]) as the second output."""
    if group_size:
        return quantize_groups(y, group_size, dtype)
    if scale is None:
        return _quantize_per_token(y, dtype)
    per_row = scale.reshape(1).to(torch.float32).expand((*y.shape[:-1], 1)).contiguous()
    return _quantize_per_tensor(y, scale, dtype), per_row


# ---- rms_norm, silu_mul -------------------------------------------------------------------------------------


def _rms_norm_reference(x, weight, eps, residual):
    if residual is not None:
        residual.add_(x)  # vLLM's fused_add_rms_norm: residual = x + residual, rounded to x's dtype
        x = residual
    # F.rms_norm: float32 inside (mean of squares, rsqrt, times weight), rounded once to x's dtype
    return F.rms_norm(x, (x.shape[-1],), weight, eps).contiguous()


def _silu_mul_reference(x):
    gate, up = x.chunk(2, dim=-1)
    # eager torch in x's dtype: silu rounded to it, then the product rounded to it
    return (F.silu(gate) * up).contiguous()


def _rms_norm(x, weight, eps):
    C.check_rms_norm("rms_norm", x, weight, eps, None)
    return _rms_norm_reference(x, weight, eps, None)


def _fused_add_rms_norm(x, residual, weight, eps):
    C.check_rms_norm("fused_add_rms_norm", x, weight, eps, residual)
    return _rms_norm_reference(x, weight, eps, residual)


def _rms_norm_quant(x, weight, eps, dtype, scale=None, residual=None, group_size=0):
    C.check_rms_norm_quant(x, weight, eps, dtype, scale, residual, group_size)
    return _quantize_fused(_rms_norm_reference(x, weight, eps, residual), dtype, scale, group_size)


def _silu_mul(x):
    C.check_silu_mul("silu_mul", x)
    return _silu_mul_reference(x)


def _silu_mul_quant(x, dtype, scale=None, group_size=0):
    C.check_silu_mul_quant(x, dtype, scale, group_size)
    return _quantize_fused(_silu_mul_reference(x), dtype, scale, group_size)


# ---- attention ----------------------------------------------------------------------------------------------


def _decode_attention_reference(q, kv_cache, slots, positions, softmax_scale):
    # What LlamaAttention computed before this op existed: gather the B whole slots, then SDPA over all S
    # positions with an additive mask (0 where s <= position, else -inf, in q's dtype), the G = H / KVH
    # query heads of a key/value head as G queries. The CPU decoder's results are unchanged by the op.
    b, h, d = q.shape
    if b == 0 or h == 0:
        return q.new_empty((b, h * d))
    kvh, s = kv_cache.shape[2], kv_cache.shape[3]
    kv = kv_cache.index_select(0, slots)  # (B, 2, KVH, S, D)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    neg_inf = torch.full((), float("-inf"), dtype=q.dtype, device=q.device)
    mask = torch.where(torch.arange(s, device=q.device) <= positions.unsqueeze(1), zero, neg_inf)  # (B, S)
    qg = q.unflatten(1, (kvh, h // kvh))  # (B, KVH, G, D)
    out = F.scaled_dot_product_attention(qg, kv[:, 0], kv[:, 1], attn_mask=mask[:, None, None, :],
                                         scale=softmax_scale)
    return out.reshape(b, h * d).contiguous()


_decode_attention, _decode_attention_out = _same_args_pair("decode_attention", C.check_decode_attention,
                                                           _decode_attention_reference)


def _decode_attention_quant(q, kv_cache, slots, positions, softmax_scale, dtype, scale=None):
    """decode_attention rounded to q's dtype, then quantized as quantize_per_token (scale None) or
    quantize_per_tensor with the static scale (the scales returned (B, 1) either way): the composition itself,
    so on the CPU the fused op equals the two ops bit for bit by construction."""
    C.check_decode_attention_quant(q, kv_cache, slots, positions, softmax_scale, dtype, scale)
    return _quantize_fused(_decode_attention_reference(q, kv_cache, slots, positions, softmax_scale), dtype, scale)


def _rope_kv_cache(qkv, rope, kv_cache, slots, positions, num_heads, num_kv_heads, q_norm=None, k_norm=None,
                   eps=-1.0):
    """The torch formulation rope_kv_cache_ replaces: with q_norm / k_norm, the rms_norm of the q heads and of the k
    heads copied back into qkv (rounded to its dtype: the chain the fused op replaces); then the neox rotation of
    the first R = 2 rope.shape[1] elements of the q and k heads (pairs (x[j], x[j + R/2]); x[R:] unchanged: partial
    rotary when R < D) as a float32 complex multiply rounded once to qkv's dtype, then one index_put_ of the k and v
    heads into the cache."""
    C.check_rope_kv_cache(qkv, rope, kv_cache, slots, positions, num_heads, num_kv_heads, q_norm, k_norm, eps)
    b, _, d = qkv.shape
    if b == 0:
        return
    if q_norm is not None:
        for heads, w in ((qkv[:, :num_heads], q_norm), (qkv[:, num_heads:num_heads + num_kv_heads], k_norm)):
            heads.copy_(_rms_norm_reference(heads, w, eps, None))
    h = rope.shape[1]  # R / 2: the rotary width R is rope's (partial rotary when R < D; x[R:] passes through)
    qk = qkv[:, : num_heads + num_kv_heads, : 2 * h]
    pairs = qk.unflatten(-1, (2, h)).transpose(-1, -2)  # (B, N, R/2, 2): (x[j], x[j + R/2])
    xc = torch.view_as_complex(torch.empty(pairs.shape, dtype=torch.float32).copy_(pairs))
    pairs.copy_(torch.view_as_real(xc * torch.view_as_complex(rope).unsqueeze(1)))
    s = kv_cache.shape[3]
    heads = torch.arange(2 * num_kv_heads)
    index = (slots.unsqueeze(1) * (2 * num_kv_heads) + heads) * s + positions.unsqueeze(1)
    kv_cache.view(-1, d).index_put_((index,), qkv[:, num_heads:])


# ---- decode_layer -------------------------------------------------------------------------------------------


def decode_layer(h, residual, input_norm, post_norm, eps, qkv_w, qkv_ws, qkv_is, o_w, o_ws, o_is, gate_up_w,
                 gate_up_ws, gate_up_is, down_w, down_ws, down_is, kv_cache, rope, slots, positions, num_heads,
                 num_kv_heads, softmax_scale):
    """One decoder layer through the ops (the CPU implementation of decode_layer). The same op calls, in the
    same order, as LlamaDecoderLayer's Python path (the CUDA op calls the same C++ functions): so the three
    agree bit for bit on either device."""
    C.check_decode_layer(residual, qkv_w, qkv_ws, qkv_is, o_w, o_ws, o_is, gate_up_w, gate_up_ws, gate_up_is,
                         down_w, down_ws, down_is, num_heads, num_kv_heads)
    ops, dtype = torch.ops.cutlass_w8a8, residual.dtype
    quantized = qkv_w.dtype in AB_DTYPES
    qtype = qkv_w.dtype

    def project(w, ws, is_, x, q, s):
        if not quantized:
            return F.linear(x, w)
        return ops.scaled_mm(q, w.t(), s if is_ is None else is_, ws, dtype, None)

    x = q = s = None
    if quantized:
        q, s = (ops.rms_norm_quant(h, input_norm, eps, qtype, qkv_is, residual) if h is not None
                else ops.rms_norm_quant(residual, input_norm, eps, qtype, qkv_is, None))
    else:
        x = (ops.fused_add_rms_norm(h, residual, input_norm, eps) if h is not None
             else ops.rms_norm(residual, input_norm, eps))
    b = residual.shape[0]
    qkv = project(qkv_w, qkv_ws, qkv_is, x, q, s).view(b, num_heads + 2 * num_kv_heads, -1)
    ops.rope_kv_cache_(qkv, rope, kv_cache, slots, positions, num_heads, num_kv_heads)
    heads = qkv[:, :num_heads]
    if quantized:  # attention quantizing its output for o_proj (LlamaAttention with a W8A8Linear o_proj)
        q, s = ops.decode_attention_quant(heads, kv_cache, slots, positions, softmax_scale, qtype, o_is)
        attn_out = project(o_w, o_ws, o_is, None, q, s)
        q, s = ops.rms_norm_quant(attn_out, post_norm, eps, qtype, gate_up_is, residual)
    else:
        attn_out = F.linear(ops.decode_attention(heads, kv_cache, slots, positions, softmax_scale), o_w)
        x = ops.fused_add_rms_norm(attn_out, residual, post_norm, eps)
    gu = project(gate_up_w, gate_up_ws, gate_up_is, x, q, s)
    if quantized:
        q, s = ops.silu_mul_quant(gu, qtype, down_is)
    else:
        x = ops.silu_mul(gu)
    return project(down_w, down_ws, down_is, x, q, s)


# ---- MoE routing --------------------------------------------------------------------------------------------


def moe_topk_softmax_reference(router_logits, top_k, renormalize):
    """(topk_weights float32 [T, top_k], topk_ids int32 [T, top_k]) of checked router logits [T, E]: softmax over
    E in float32; the top_k experts ranked by logit, descending, the lower expert index first on equal logits
    (a stable sort; softmax is increasing, so this is the ranking of the probabilities before their rounding);
    renormalize divides the chosen probabilities by their float32 sum taken in rank order. moe_route's softmax
    case without bias, groups or scaling (the same code)."""
    return moe_route_reference(router_logits, top_k, "softmax", None, 1, 1, renormalize, 1.0)


def moe_route_reference(router_logits, top_k, scoring="softmax", correction_bias=None, n_group=1, topk_group=1,
                        renormalize=True, scaling_factor=1.0):
    """(topk_weights float32 [T, top_k], topk_ids int32 [T, top_k]) of checked operands (ops/moe.py's moe_route
    states the contract), as torch ops that run on any device:

    - score = softmax(float32 logits) over E, or sigmoid(float32 logits) (torch's kernels of that device);
    - choice = score + correction_bias (score without one); the ranking key is choice, except for softmax without
      a bias: the logit itself (softmax is increasing: moe_topk_softmax's order);
    - n_group > 1: group score = choice[a] + choice[b], a and b the group's first two experts by (key descending,
      index ascending); the topk_group groups by (group score descending, group index ascending) are kept;
    - the top_k experts of the kept groups by (key descending, index ascending): stable sorts;
    - weight = score[id]; renormalize divides by their float32 sum taken in selection order (+ 1e-20 for sigmoid,
      as DeepSeek-V3's router); then times float32(scaling_factor)."""
    logits = router_logits.to(torch.float32).contiguous()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias
    key = logits if (scoring == "softmax" and correction_bias is None) else choice
    t, e = logits.shape
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # [T, E]
    if n_group > 1:
        size = e // n_group
        first_two = torch.sort(key.view(t, n_group, size), dim=-1, descending=True, stable=True).indices[..., :2]
        top2 = choice.view(t, n_group, size).gather(2, first_two)
        group_score = top2[..., 0] + top2[..., 1]
        groups = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        kept = torch.zeros(t, n_group, dtype=torch.int8, device=logits.device).scatter_(1, groups, 1)
        excluded = (1 - kept).repeat_interleave(size, dim=1).gather(1, order)  # [T, E] in ranking order
        # the kept experts first, each part still in ranking order (a stable sort by the flag)
        order = order.gather(1, torch.sort(excluded, dim=-1, stable=True).indices)
    ids = order[:, :top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        total = weights[:, 0]
        for j in range(1, top_k):  # j ascending, one float32 addition at a time (the kernel's order)
            total = total + weights[:, j]
        if scoring == "sigmoid":
            total = total + 1e-20
        weights = weights / total.unsqueeze(1)
    weights = weights * scaling_factor
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def moe_align_reference(topk_ids, num_experts):
    """(sorted_pairs, dst_pos, offsets) of checked topk_ids [T, k]: pair p = t * k + j goes to bucket
    topk_ids[t, j] when in [0, num_experts), else to bucket num_experts (unrouted, after every expert); a stable
    sort of the pairs by bucket (ties: increasing p). sorted_pairs[s] = the pair at position s, dst_pos[p] = its
    position (-1 when unrouted), offsets[e] = the number of pairs in buckets <= e. All int32."""
    ids = topk_ids.reshape(-1).to(torch.int64)
    routed = (ids >= 0) & (ids < num_experts)
    bucket = torch.where(routed, ids, torch.full_like(ids, num_experts))
    order = torch.sort(bucket, stable=True).indices
    dst = torch.empty_like(order)
    dst[order] = torch.arange(order.numel(), dtype=order.dtype, device=order.device)
    dst = torch.where(routed, dst, torch.full_like(dst, -1))
    offsets = torch.bincount(bucket, minlength=num_experts + 1)[:num_experts].cumsum(0)
    return order.to(torch.int32), dst.to(torch.int32), offsets.to(torch.int32)


def moe_permute_quant_reference(x, sorted_pairs, top_k, dtype, scale=None, group_size=0):
    """(q, scale) of checked operands: row s = x[sorted_pairs[s] // top_k] (a pair index outside [0, T * top_k)
    clamped into it, as the CUDA kernel does: it cannot check device data), quantized as silu_mul_quant
    quantizes its y (per token; per tensor with `scale`, scale repeated per row; per 1x128 group)."""
    n = sorted_pairs.numel()
    src = sorted_pairs.to(torch.int64).clamp(0, max(n - 1, 0)) // top_k
    return _quantize_fused(x.index_select(0, src), dtype, scale, group_size)


def moe_unpermute_reference(y, dst_pos, topk_weights):
    """out [T, H] in y's dtype of checked operands: out[t] = sum over j = 0 .. k-1, in float32, one j at a time,
    of topk_weights[t, j] * float32(y[dst_pos[t*k+j]]) (product rounded, then the sum), skipping positions
    outside [0, T*k) (-1: an unrouted pair); one rounding to y's dtype."""
    t, k = topk_weights.shape
    n, h = t * k, y.shape[1]
    pos = dst_pos.to(torch.int64).reshape(t, k)
    valid = (pos >= 0) & (pos < n)
    yf = y.to(torch.float32)
    acc = torch.zeros(t, h, dtype=torch.float32, device=y.device)
    for j in range(k):
        rows = yf.index_select(0, pos[:, j].clamp(0, max(n - 1, 0)))
        acc = torch.where(valid[:, j:j + 1], acc + topk_weights[:, j:j + 1] * rows, acc)
    return acc.to(y.dtype)


def moe_decode_experts_reference(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, group_size, out_dtype):
    """moe_decode_experts of checked operands: the unfused chain that `W8A8MoE.forward` runs, op for op through the
    CPU references above (so equal to it bit for bit by construction): moe_align, moe_permute_quant (per token, or
    per 1x128 group), grouped_scaled_mm with w13, silu_mul_quant in out_dtype, grouped_scaled_mm with w2,
    moe_unpermute. Returns (T, H) out_dtype, zeros for a token with no routed pair."""
    k = topk_ids.shape[1]
    sorted_pairs, dst_pos, offsets = moe_align_reference(topk_ids, w13.shape[0])
    q, s = moe_permute_quant_reference(x, sorted_pairs, k, w13.dtype, None, group_size)
    y13 = grouped_scaled_mm_reference(q, w13.transpose(1, 2), s, w13_scale, offsets, out_dtype, None)
    q2, s2 = _quantize_fused(_silu_mul_reference(y13), w13.dtype, None, group_size)
    y2 = grouped_scaled_mm_reference(q2, w2.transpose(1, 2), s2, w2_scale, offsets, out_dtype, None)
    return moe_unpermute_reference(y2, dst_pos, topk_weights)


def _moe_topk_softmax(router_logits, top_k, renormalize):
    CM.check_moe_topk_softmax(router_logits, top_k, renormalize)
    return moe_topk_softmax_reference(router_logits, top_k, renormalize)


def _moe_route(router_logits, top_k, scoring="softmax", correction_bias=None, n_group=1, topk_group=1,
               renormalize=True, scaling_factor=1.0):
    CM.check_moe_route(router_logits, top_k, scoring, correction_bias, n_group, topk_group, renormalize,
                      scaling_factor)
    return moe_route_reference(router_logits, top_k, scoring, correction_bias, n_group, topk_group, renormalize,
                               scaling_factor)


def moe_router_route_reference(x, router_weight, top_k, scoring="softmax", correction_bias=None, n_group=1,
                               topk_group=1, renormalize=True, scaling_factor=1.0, logits_dtype=None):
    """moe_router_route of checked operands: ``F.linear`` in ``logits_dtype`` (x's dtype when None: transformers'
    Qwen / Mixtral / OLMoE routers; float32 for DeepSeek-V3 / GLM-4.5's ``F.linear(x.float(), w.float())``), then
    `moe_route_reference` on those logits."""
    dt = x.dtype if logits_dtype is None else logits_dtype
    logits = F.linear(x.to(dt), router_weight.to(dt))
    return moe_route_reference(logits, top_k, scoring, correction_bias, n_group, topk_group, renormalize,
                               scaling_factor)


def _moe_router_route(x, router_weight, top_k, scoring="softmax", correction_bias=None, n_group=1, topk_group=1,
                      renormalize=True, scaling_factor=1.0, logits_dtype=None):
    CM.check_moe_router_route(x, router_weight, top_k, scoring, correction_bias, n_group, topk_group, renormalize,
                              scaling_factor, logits_dtype)
    return moe_router_route_reference(x, router_weight, top_k, scoring, correction_bias, n_group, topk_group,
                                      renormalize, scaling_factor, logits_dtype)


def _add_rms_norm_moe_router_route(x, residual, norm_weight, eps, router_weight, top_k, scoring="softmax",
                                   correction_bias=None, n_group=1, topk_group=1, renormalize=True,
                                   scaling_factor=1.0, logits_dtype=None):
    """The CPU chain the fused op replaces, op for op: fused_add_rms_norm(x, r, norm_weight, eps) on a copy r of the
    residual (which it turns into residual_out = residual + x in x's dtype), then moe_router_route(y, ...)."""
    CM.check_norm_router_route(x, residual, norm_weight, eps, router_weight, top_k, scoring, correction_bias, n_group,
                               topk_group, renormalize, scaling_factor, logits_dtype)
    stream = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    stream.copy_(residual)
    y = _fused_add_rms_norm(x, stream, norm_weight, eps)
    weights, ids = _moe_router_route(y, router_weight, top_k, scoring, correction_bias, n_group, topk_group,
                                     renormalize, scaling_factor, logits_dtype)
    return y, stream, weights, ids


def _moe_align(topk_ids, num_experts):
    CM.check_moe_align(topk_ids, num_experts)
    return moe_align_reference(topk_ids, num_experts)


def _moe_permute_quant(x, sorted_pairs, top_k, dtype, scale=None, group_size=0):
    CM.check_moe_permute_quant(x, sorted_pairs, top_k, dtype, scale, group_size)
    return moe_permute_quant_reference(x, sorted_pairs, top_k, dtype, scale, group_size)


def _moe_unpermute(y, dst_pos, topk_weights):
    CM.check_moe_unpermute(y, dst_pos, topk_weights)
    return moe_unpermute_reference(y, dst_pos, topk_weights)


def _moe_unpermute_out(out, y, dst_pos, topk_weights):
    CM.check_moe_unpermute(y, dst_pos, topk_weights, out)
    out.copy_(moe_unpermute_reference(y, dst_pos, topk_weights))


def _moe_decode_experts(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, group_size, out_dtype):
    CM.check_moe_decode_experts(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, group_size, out_dtype)
    return moe_decode_experts_reference(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, group_size,
                                        out_dtype)


for _name, _fn in (
        ("moe_topk_softmax", _moe_topk_softmax), ("moe_route", _moe_route), ("moe_router_route", _moe_router_route),
        ("add_rms_norm_moe_router_route", _add_rms_norm_moe_router_route),
        ("moe_align", _moe_align),
        ("moe_permute_quant", _moe_permute_quant), ("moe_unpermute", _moe_unpermute),
        ("moe_unpermute_out", _moe_unpermute_out), ("moe_decode_experts", _moe_decode_experts)):
    lib.impl(_name, _fn, "CPU")


for _name, _fn in (
        ("scaled_mm", _scaled_mm), ("scaled_mm_out", _scaled_mm_out), ("_scaled_mm_config", _scaled_mm_config),
        ("w8a8_linear", _w8a8_linear), ("scaled_mm_decode", _scaled_mm_decode),
        ("scaled_mm_decode_out", _scaled_mm_decode_out), ("linear_decode", _linear_decode),
        ("linear_decode_out", _linear_decode_out), ("add_rms_norm_linear_decode", _add_rms_norm_linear_decode),
        ("quantize_per_token", _quantize_per_token),
        ("quantize_per_token_group", _quantize_per_token_group),
        ("quantize_per_tensor", _quantize_per_tensor), ("rms_norm", _rms_norm),
        ("fused_add_rms_norm", _fused_add_rms_norm), ("rms_norm_quant", _rms_norm_quant), ("silu_mul", _silu_mul),
        ("silu_mul_quant", _silu_mul_quant), ("decode_attention", _decode_attention),
        ("decode_attention_out", _decode_attention_out), ("decode_attention_quant", _decode_attention_quant),
        ("rope_kv_cache_", _rope_kv_cache),
        ("decode_layer", decode_layer), ("grouped_scaled_mm", _grouped_scaled_mm),
        ("grouped_scaled_mm_out", _grouped_scaled_mm_out), ("_grouped_scaled_mm_config", _grouped_scaled_mm_config)):
    lib.impl(_name, _fn, "CPU")
