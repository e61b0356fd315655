"""The cutlass_w8a8 ops: schemas, CPU reference implementations, fake kernels and typed wrappers.

The schemas live here (not in C++) so that a CPU-only install, which compiles nothing, still has the ops with
their reference implementations; `_C.so` adds the CUDA kernels when it is built (csrc/torch_bindings.cpp).

Ops in the ``torch.ops.cutlass_w8a8`` namespace:

- ``scaled_mm(a, b, scale_a, scale_b, out_dtype, bias=None) -> Tensor``
- ``scaled_mm_out(out, a, b, scale_a, scale_b, bias=None) -> ()``
- ``w8a8_linear(x, weight, weight_scale, input_scale=None, bias=None, out_dtype) -> Tensor``: a `W8A8Linear`
  forward in one call: quantize ``x (..., K)`` (per token, or per tensor with ``input_scale``), then the GEMM with
  the ``(N, K)`` weight
- ``decode_layer(h, residual, input_norm, post_norm, eps, qkv_w, qkv_ws, qkv_is, o_w, ..., down_is, kv_cache, rope,
  slots, positions, num_heads, num_kv_heads, softmax_scale) -> Tensor``: one layer of the reference decoder
  (`cutlass_w8a8.models.LlamaDecoderLayer`) in one call, for eager decoding; ``residual`` and ``kv_cache`` are
  updated in place
- ``quantize_per_token(x, dtype) -> (q, scale)``
- ``quantize_per_tensor(x, scale, dtype) -> q``
- ``rms_norm(x, weight, eps) -> y``: RMSNorm
- ``fused_add_rms_norm(x, residual, weight, eps) -> y``: ``residual += x`` in place, then RMSNorm of it (vLLM's)
- ``rms_norm_quant(x, weight, eps, dtype, scale=None, residual=None) -> (q, scale)``: either, then quantized
- ``silu_mul(x) -> y``: ``silu(gate) * up`` of ``x = [gate | up]``
- ``silu_mul_quant(x, dtype, scale=None) -> (q, scale)``: the same, then quantized
- ``decode_attention(q, kv_cache, slots, positions, softmax_scale) -> Tensor``
- ``decode_attention_out(out, q, kv_cache, slots, positions, softmax_scale) -> ()``
- ``rope_kv_cache_(qkv, rope, kv_cache, slots, positions, num_heads, num_kv_heads) -> ()``: rotary embedding of
  the q and k heads in place, then the k and v heads into the slot cache (the decoder's glue before attention)
- ``_scaled_mm_config(out, a, b, scale_a, scale_b, bias, config) -> ()``: force a kernel config (tuning only)
- ``scaled_mm_decode(a, b, scale_a, scale_b, out_dtype, bias=None) -> Tensor``: ``scaled_mm`` for M <= 16
- ``scaled_mm_decode_out(out, a, b, scale_a, scale_b, bias=None) -> ()``
- ``linear_decode(x, b, scale_b, bias, dtype) -> Tensor``: per-token quantization of x and the GEMM, one kernel
- ``linear_decode_out(out, x, b, scale_b, bias, dtype) -> ()``

Use the wrappers below: they check their arguments and raise ``TypeError`` (wrong dtype) or ``ValueError``
(wrong shape, layout, device or value) naming the argument. The C++ side repeats the checks, so direct
``torch.ops`` calls get the same errors.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from . import _ext

__all__ = ["scaled_mm", "quantize_int8", "quantize_fp8", "supports_fp8", "INT8_MAX_K", "decode_attention",
           "scaled_mm_decode", "linear_decode", "DECODE_MAX_M",
           "rms_norm", "rms_norm_quant", "silu_mul", "silu_mul_quant"]

# int8 products are at most 128 * 128 = 2**14 in magnitude, so an int32 sum of K of them cannot overflow
# while K * 2**14 <= 2**31 - 1, i.e. K <= 131071; the largest multiple of 16 below that is 131056.
INT8_MAX_K = (2**31 - 1) // (128 * 128) // 16 * 16

_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_AB_DTYPES = (torch.int8, torch.float8_e4m3fn)
_OUT_DTYPES = (torch.bfloat16, torch.float16)
_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ATTN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ATTN_MAX_HEAD_DIM = 256  # csrc/attention/decode_attention.cu: D a multiple of 8 in [8, 256]

_lib = torch.library.Library("cutlass_w8a8", "DEF")  # noqa: TOR901 (one definition block for the namespace)
_lib.define("scaled_mm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, ScalarType out_dtype, "
            "Tensor? bias=None) -> Tensor")
_lib.define("scaled_mm_out(Tensor(a!) out, Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, "
            "Tensor? bias=None) -> ()")
_lib.define("w8a8_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? input_scale, Tensor? bias, "
            "ScalarType out_dtype) -> Tensor")
_lib.define("decode_layer(Tensor? h, Tensor(a!) residual, Tensor input_norm, Tensor post_norm, float eps, "
            "Tensor qkv_w, Tensor? qkv_ws, Tensor? qkv_is, Tensor o_w, Tensor? o_ws, Tensor? o_is, "
            "Tensor gate_up_w, Tensor? gate_up_ws, Tensor? gate_up_is, Tensor down_w, Tensor? down_ws, "
            "Tensor? down_is, Tensor(b!) kv_cache, Tensor rope, Tensor slots, Tensor positions, int num_heads, "
            "int num_kv_heads, float softmax_scale) -> Tensor")
_lib.define("_scaled_mm_config(Tensor(a!) out, Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, "
            "Tensor? bias, int config) -> ()")
# Decode GEMMs, M <= 16 (csrc/gemm/decode/scaled_mm_decode.cu)
_lib.define("scaled_mm_decode(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, ScalarType out_dtype, "
            "Tensor? bias=None) -> Tensor")
_lib.define("scaled_mm_decode_out(Tensor(a!) out, Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, "
            "Tensor? bias=None) -> ()")
_lib.define("linear_decode(Tensor x, Tensor b, Tensor scale_b, Tensor? bias, ScalarType dtype) -> Tensor")
_lib.define("linear_decode_out(Tensor(a!) out, Tensor x, Tensor b, Tensor scale_b, Tensor? bias, "
            "ScalarType dtype) -> ()")
_lib.define("quantize_per_token(Tensor x, ScalarType dtype) -> (Tensor, Tensor)")
_lib.define("quantize_per_tensor(Tensor x, Tensor scale, ScalarType dtype) -> Tensor")
# Fused non-GEMM steps of a decoder layer (csrc/quant/fused_quant.cu); `residual` is updated in place.
# rms_norm without and with the residual are two ops: torch 2.13's inductor fails to lower an op that returns a
# single Tensor when its `Tensor(a!)?` argument is None (rms_norm_quant, returning two, is not affected).
_lib.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_lib.define("fused_add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor")
_lib.define("rms_norm_quant(Tensor x, Tensor weight, float eps, ScalarType dtype, Tensor? scale=None, "
            "Tensor(a!)? residual=None) -> (Tensor, Tensor)")
_lib.define("silu_mul(Tensor x) -> Tensor")
_lib.define("silu_mul_quant(Tensor x, ScalarType dtype, Tensor? scale=None) -> (Tensor, Tensor)")
_lib.define("decode_attention(Tensor q, Tensor kv_cache, Tensor slots, Tensor positions, float softmax_scale) "
            "-> Tensor")
_lib.define("decode_attention_out(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor slots, Tensor positions, "
            "float softmax_scale) -> ()")
# The glue between the qkv projection and decode_attention (csrc/attention/rope_kv_cache.cu): rotary embedding
# of the q and k heads in place, then the k and v heads written into the slot cache.
_lib.define("rope_kv_cache_(Tensor(a!) qkv, Tensor rope, Tensor(b!) kv_cache, Tensor slots, Tensor positions, "
            "int num_heads, int num_kv_heads) -> ()")
# CUDA-graph node update (cutlass_w8a8/graphs.py, UpdatableGraph.update_scaled_mm): no CPU or fake kernel, it
# changes an instantiated graph, not tensors
_lib.define("_graph_update_scaled_mm(int graph_exec, int record, Tensor out, Tensor a, Tensor b, Tensor scale_a, "
            "Tensor scale_b, Tensor? bias) -> ()")


# ----------------------------------------------------------------------------------------------------
# argument checks (shared by the wrappers, the CPU reference and the fake kernels)


def _fail_type(op: str, arg: str, msg: str) -> None:
    raise TypeError(f"{op}: `{arg}` {msg}")


def _fail_value(op: str, arg: str, msg: str) -> None:
    raise ValueError(f"{op}: `{arg}` {msg}")


def _misaligned(t: torch.Tensor, nbytes: int) -> bool:
    # The storage itself comes from an allocator that aligns to >= 256 bytes; a view's offset can break it.
    return (t.storage_offset() * t.element_size()) % nbytes != 0


def _check_bias_shape(op: str, bias, n: int) -> None:
    """A bias operand: None, or a contiguous ``(N,)`` vector (its dtype is checked with the output's)."""
    if bias is not None:
        if tuple(bias.shape) != (n,):
            _fail_value(op, "bias", f"must be [N] with N = {n}, got shape {tuple(bias.shape)}")
        if not bias.is_contiguous():
            _fail_value(op, "bias", "must be contiguous")


def _check_scaled_mm(op: str, a, b, scale_a, scale_b, out_dtype, bias, out=None) -> None:
    for name, t in (("a", a), ("b", b), ("scale_a", scale_a), ("scale_b", scale_b)):
        if not isinstance(t, torch.Tensor):
            _fail_type(op, name, f"must be a torch.Tensor, got {type(t).__name__}")
    if a.dtype not in _AB_DTYPES:
        _fail_type(op, "a", f"must be int8 or float8_e4m3fn, got {a.dtype}")
    if b.dtype != a.dtype:
        _fail_type(op, "b", f"must have a's dtype {a.dtype}, got {b.dtype}")
    if scale_a.dtype != torch.float32:
        _fail_type(op, "scale_a", f"must be float32, got {scale_a.dtype}")
    if scale_b.dtype != torch.float32:
        _fail_type(op, "scale_b", f"must be float32, got {scale_b.dtype}")
    if out is not None and out.dtype not in _OUT_DTYPES:
        _fail_type(op, "out", f"must be bfloat16 or float16, got {out.dtype}")
    if out_dtype not in _OUT_DTYPES:
        _fail_type(op, "out_dtype", f"must be torch.bfloat16 or torch.float16, got {out_dtype}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            _fail_type(op, "bias", f"must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.dtype != out_dtype:
            _fail_type(op, "bias", f"must have the output dtype {out_dtype}, got {bias.dtype}")
    if out is not None and not isinstance(out, torch.Tensor):
        _fail_type(op, "out", f"must be a torch.Tensor or None, got {type(out).__name__}")
    others = [("b", b), ("scale_a", scale_a), ("scale_b", scale_b)]
    if bias is not None:
        others.append(("bias", bias))
    if out is not None:
        others.append(("out", out))
    for name, t in others:
        if t.device != a.device:
            _fail_value(op, name, f"is on {t.device} but `a` is on {a.device}")

    if a.dim() != 2:
        _fail_value(op, "a", f"must be 2-D [M, K], got shape {tuple(a.shape)}")
    if b.dim() != 2:
        _fail_value(op, "b", f"must be 2-D [K, N], got shape {tuple(b.shape)}")
    m, k = a.shape
    n = b.shape[1]
    if b.shape[0] != k:
        _fail_value(op, "b", f"must be [K, N] with K = a.shape[1] = {k}, got shape {tuple(b.shape)}")
    if m >= 2**31:
        _fail_value(op, "a", f"M = a.shape[0] must be below 2**31, got {m}")
    if k <= 0 or k % 16 != 0:
        _fail_value(op, "a", f"K = a.shape[1] must be a positive multiple of 16, got {k}")
    if n <= 0 or n % 16 != 0:
        _fail_value(op, "b", f"N = b.shape[1] must be a positive multiple of 16, got {n}")
    if a.dtype == torch.int8 and k > INT8_MAX_K:
        _fail_value(op, "a", f"K = {k} can overflow the int32 accumulator; int8 needs K <= {INT8_MAX_K}")
    sa_ok = scale_a.numel() == 1 or tuple(scale_a.shape) in ((m, 1), (m,))
    if not sa_ok:
        _fail_value(op, "scale_a", f"must be [1] (per-tensor) or [M, 1] (per-token) with M = {m}, "
                    f"got shape {tuple(scale_a.shape)}")
    sb_ok = scale_b.numel() == 1 or tuple(scale_b.shape) in ((n,), (1, n), (n, 1))
    if not sb_ok:
        _fail_value(op, "scale_b", f"must be [1] (per-tensor), [N], [1, N] or [N, 1] (per-channel) with N = {n}, "
                    f"got shape {tuple(scale_b.shape)}")
    if not scale_a.is_contiguous():
        _fail_value(op, "scale_a", "must be contiguous")
    if not scale_b.is_contiguous():
        _fail_value(op, "scale_b", "must be contiguous")
    _check_bias_shape(op, bias, n)

    # Layouts the kernels can read (TMA: 16-byte aligned bases and row pitches). Padded rows are fine.
    if a.stride(1) != 1:
        _fail_value(op, "a", f"must be row-major (stride(1) == 1), got strides {a.stride()}")
    if m > 1 and a.stride(0) < k:
        _fail_value(op, "a", f"rows overlap: stride(0) = {a.stride(0)} < K = {k}")
    if m > 1 and a.stride(0) % 16 != 0:
        _fail_value(op, "a", f"stride(0) must be a multiple of 16 elements, got {a.stride(0)}")
    if b.stride(0) != 1:
        _fail_value(op, "b", "must be column-major [K, N] (the transpose of a row-major [N, K] weight, "
                    f"stride(0) == 1), got strides {b.stride()}")
    if b.stride(1) < k:
        _fail_value(op, "b", f"columns overlap: stride(1) = {b.stride(1)} < K = {k}")
    if b.stride(1) % 16 != 0:
        _fail_value(op, "b", f"stride(1) must be a multiple of 16 elements, got {b.stride(1)}")
    if _misaligned(a, 16):
        _fail_value(op, "a", f"data must be 16-byte aligned (storage offset {a.storage_offset()})")
    if _misaligned(b, 16):
        _fail_value(op, "b", f"data must be 16-byte aligned (storage offset {b.storage_offset()})")
    if out is not None:
        if tuple(out.shape) != (m, n):
            _fail_value(op, "out", f"must be [M, N] = [{m}, {n}], got shape {tuple(out.shape)}")
        if out.stride(1) != 1:
            _fail_value(op, "out", f"must be row-major (stride(1) == 1), got strides {out.stride()}")
        if m > 1 and out.stride(0) < n:
            _fail_value(op, "out", f"rows overlap: stride(0) = {out.stride(0)} < N = {n}")
        if m > 1 and out.stride(0) % 8 != 0:
            _fail_value(op, "out", f"stride(0) must be a multiple of 8 elements, got {out.stride(0)}")
        if _misaligned(out, 16):
            _fail_value(op, "out", f"data must be 16-byte aligned (storage offset {out.storage_offset()})")


def _check_w8a8_linear(x, weight, weight_scale, input_scale, bias, out_dtype) -> None:
    """The contract of w8a8_linear; csrc/gemm/w8a8_linear.cu raises the same messages on CUDA."""
    op = "w8a8_linear"
    for name, t in (("x", x), ("weight", weight), ("weight_scale", weight_scale)):
        if not isinstance(t, torch.Tensor):
            _fail_type(op, name, f"must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("input_scale", input_scale), ("bias", bias)):
        if t is not None and not isinstance(t, torch.Tensor):
            _fail_type(op, name, f"must be a torch.Tensor or None, got {type(t).__name__}")
    if x.dtype not in _X_DTYPES:
        _fail_type(op, "x", f"must be bfloat16, float16 or float32, got {x.dtype}")
    if weight.dtype not in _AB_DTYPES:
        _fail_type(op, "weight", f"must be int8 or float8_e4m3fn, got {weight.dtype}")
    if weight_scale.dtype != torch.float32:
        _fail_type(op, "weight_scale", f"must be float32, got {weight_scale.dtype}")
    if input_scale is not None and input_scale.dtype != torch.float32:
        _fail_type(op, "input_scale", f"must be float32, got {input_scale.dtype}")
    if out_dtype not in _OUT_DTYPES:
        _fail_type(op, "out_dtype", f"must be torch.bfloat16 or torch.float16, got {out_dtype}")
    if bias is not None and bias.dtype != out_dtype:
        _fail_type(op, "bias", f"must have the output dtype {out_dtype}, got {bias.dtype}")
    for name, t in (("weight", weight), ("weight_scale", weight_scale), ("input_scale", input_scale),
                    ("bias", bias)):
        if t is not None and t.device != x.device:
            _fail_value(op, name, f"is on {t.device} but `x` is on {x.device}")
    if x.dim() < 1:
        _fail_value(op, "x", "must have at least one dimension [..., K]")
    if weight.dim() != 2:
        _fail_value(op, "weight", f"must be 2-D [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k:
        _fail_value(op, "weight", f"must be [N, K] with K = x.shape[-1] = {x.shape[-1]}, got shape "
                    f"{tuple(weight.shape)}")
    if k <= 0 or k % 16 != 0:
        _fail_value(op, "weight", f"K = weight.shape[1] must be a positive multiple of 16, got {k}")
    if n <= 0 or n % 16 != 0:
        _fail_value(op, "weight", f"N = weight.shape[0] must be a positive multiple of 16, got {n}")
    if weight.dtype == torch.int8 and k > INT8_MAX_K:
        _fail_value(op, "weight", f"K = {k} can overflow the int32 accumulator; int8 needs K <= {INT8_MAX_K}")
    sb = weight_scale.numel()
    if weight_scale.dim() > 2 or not (sb == 1 or (sb == n and (weight_scale.dim() == 1 or 1 in weight_scale.shape))):
        _fail_value(op, "weight_scale", f"must hold 1 (per-tensor) or N = {n} (per-channel: (N,), (N, 1) or (1, N)) "
                    f"values, got shape {tuple(weight_scale.shape)}")
    if not weight_scale.is_contiguous():
        _fail_value(op, "weight_scale", "must be contiguous")
    if input_scale is not None and input_scale.numel() != 1:
        _fail_value(op, "input_scale", f"must hold one value (static per-tensor), got shape {tuple(input_scale.shape)}")
    _check_bias_shape(op, bias, n)
    if weight.stride(1) != 1:
        _fail_value(op, "weight", f"must be row-major [N, K] (stride(1) == 1), got strides {weight.stride()}")
    if weight.stride(0) < k:
        _fail_value(op, "weight", f"rows overlap: stride(0) = {weight.stride(0)} < K = {k}")
    if weight.stride(0) % 16 != 0:
        _fail_value(op, "weight", f"stride(0) must be a multiple of 16 elements, got {weight.stride(0)}")
    if _misaligned(weight, 16):
        _fail_value(op, "weight", f"data must be 16-byte aligned (storage offset {weight.storage_offset()})")


def _check_quant_input(op: str, x, dtype) -> None:
    if not isinstance(x, torch.Tensor):
        _fail_type(op, "x", f"must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _X_DTYPES:
        _fail_type(op, "x", f"must be bfloat16, float16 or float32, got {x.dtype}")
    if dtype not in _AB_DTYPES:
        _fail_type(op, "dtype", f"must be torch.int8 or torch.float8_e4m3fn, got {dtype}")
    if x.dim() < 1:
        _fail_value(op, "x", "must have at least one dimension [..., K]")


def _check_static_scale(op: str, x, scale) -> None:
    if not isinstance(scale, torch.Tensor):
        _fail_type(op, "scale", f"must be a torch.Tensor or None, got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        _fail_type(op, "scale", f"must be float32, got {scale.dtype}")
    if scale.device != x.device:
        _fail_value(op, "scale", f"is on {scale.device} but `x` is on {x.device}")
    if scale.numel() != 1:
        _fail_value(op, "scale", f"must hold one value (static per-tensor), got shape {tuple(scale.shape)}")


# Rows are blocks of one CUDA grid dimension (gridDim.x), and K an int in the kernels.
_MAX_ROWS = 2**31 - 1


def _check_rows_input(op: str, x) -> None:
    """`x` of the fused ops: a float tensor [..., K] with K > 0 and at most 2**31 - 1 rows."""
    if not isinstance(x, torch.Tensor):
        _fail_type(op, "x", f"must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _X_DTYPES:
        _fail_type(op, "x", f"must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() < 1:
        _fail_value(op, "x", "must have at least one dimension [..., K]")
    k = x.shape[-1]
    if k == 0:
        _fail_value(op, "x", f"must have a non-empty last dimension [..., K], got shape {tuple(x.shape)}")
    if k >= 2**31:
        _fail_value(op, "x", f"K = {k} must be below 2**31")
    rows = x.numel() // k
    if rows > _MAX_ROWS:
        _fail_value(op, "x", f"has {rows} rows; at most 2**31 - 1 are supported")


def _check_quant_dtype(op: str, dtype) -> None:
    if dtype not in _AB_DTYPES:
        _fail_type(op, "dtype", f"must be torch.int8 or torch.float8_e4m3fn, got {dtype}")


def _flat_row_stride(t: torch.Tensor) -> Optional[int]:
    """Stride between the rows of ``t`` seen as ``[M, K]`` without a copy (unit-stride rows whose leading
    dimensions merge), or None when that view does not exist. A ``[K]`` tensor is one row."""
    k = t.shape[-1]
    if k > 1 and t.stride(-1) != 1:
        return None
    stride = nxt = None
    for d in range(t.dim() - 2, -1, -1):
        if t.shape[d] == 1:
            continue
        if stride is not None and t.stride(d) != nxt:
            return None
        if stride is None:
            stride = t.stride(d)
        nxt = t.stride(d) * t.shape[d]
    return k if stride is None else stride


def _check_rms_norm(op: str, x, weight, eps, residual) -> None:
    _check_rows_input(op, x)
    k = x.shape[-1]
    if not isinstance(weight, torch.Tensor):
        _fail_type(op, "weight", f"must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype != x.dtype:
        _fail_type(op, "weight", f"must have x's dtype {x.dtype}, got {weight.dtype}")
    if weight.device != x.device:
        _fail_value(op, "weight", f"is on {weight.device} but `x` is on {x.device}")
    if weight.dim() != 1 or weight.shape[0] != k:
        _fail_value(op, "weight", f"must be [K] with K = {k}, got shape {tuple(weight.shape)}")
    if k > 1 and weight.stride(0) != 1:
        _fail_value(op, "weight", "must be contiguous")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        _fail_type(op, "eps", f"must be a float, got {type(eps).__name__}")
    if not 0.0 <= eps < float("inf"):
        _fail_value(op, "eps", f"must be a finite number >= 0, got {eps}")
    if residual is None:
        return
    if not isinstance(residual, torch.Tensor):
        _fail_type(op, "residual", f"must be a torch.Tensor or None, got {type(residual).__name__}")
    if residual.dtype != x.dtype:
        _fail_type(op, "residual", f"must have x's dtype {x.dtype}, got {residual.dtype}")
    if residual.device != x.device:
        _fail_value(op, "residual", f"is on {residual.device} but `x` is on {x.device}")
    if residual.shape != x.shape:
        _fail_value(op, "residual", f"must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    stride = _flat_row_stride(residual)
    if stride is None:
        _fail_value(op, "residual", "must be updatable in place as [M, K] rows (unit-stride rows whose leading "
                    f"dimensions merge), got strides {residual.stride()}")
    if x.numel() // k > 1 and stride < k:
        _fail_value(op, "residual", f"rows overlap: row stride {stride} < K = {k}")


def _check_silu_mul(op: str, x) -> None:
    _check_rows_input(op, x)
    if x.shape[-1] % 2 != 0:
        _fail_value(op, "x", "must have an even last dimension [..., 2 * I] (gate then up), "
                    f"got shape {tuple(x.shape)}")


def _check_decode_attention(op: str, q, kv_cache, slots, positions, softmax_scale, out=None) -> None:
    for name, t in (("q", q), ("kv_cache", kv_cache), ("slots", slots), ("positions", positions)):
        if not isinstance(t, torch.Tensor):
            _fail_type(op, name, f"must be a torch.Tensor, got {type(t).__name__}")
    if out is not None and not isinstance(out, torch.Tensor):
        _fail_type(op, "out", f"must be a torch.Tensor or None, got {type(out).__name__}")
    if q.dtype not in _ATTN_DTYPES:
        _fail_type(op, "q", f"must be bfloat16, float16 or float32, got {q.dtype}")
    if kv_cache.dtype != q.dtype:
        _fail_type(op, "kv_cache", f"must have q's dtype {q.dtype}, got {kv_cache.dtype}")
    if slots.dtype != torch.int64:
        _fail_type(op, "slots", f"must be int64, got {slots.dtype}")
    if positions.dtype != torch.int64:
        _fail_type(op, "positions", f"must be int64, got {positions.dtype}")
    if out is not None and out.dtype != q.dtype:
        _fail_type(op, "out", f"must have q's dtype {q.dtype}, got {out.dtype}")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, torch.SymFloat)):
        _fail_type(op, "softmax_scale", f"must be a float, got {type(softmax_scale).__name__}")
    if isinstance(softmax_scale, (int, float)) and not math.isfinite(softmax_scale):
        _fail_value(op, "softmax_scale", f"must be finite, got {softmax_scale}")
    others = [("kv_cache", kv_cache), ("slots", slots), ("positions", positions)]
    if out is not None:
        others.append(("out", out))
    for name, t in others:
        if t.device != q.device:
            _fail_value(op, name, f"is on {t.device} but `q` is on {q.device}")

    if q.dim() != 3:
        _fail_value(op, "q", f"must be 3-D (B, H, D), got shape {tuple(q.shape)}")
    b, h, d = q.shape
    if d <= 0 or d > _ATTN_MAX_HEAD_DIM or d % 8 != 0:
        _fail_value(op, "q", f"head dim D = q.shape[2] must be a multiple of 8 in [8, {_ATTN_MAX_HEAD_DIM}], "
                    f"got {d}")
    if h > 65535:
        _fail_value(op, "q", f"H = q.shape[1] must be at most 65535, got {h}")
    kv_shape = tuple(kv_cache.shape)
    if (kv_cache.dim() != 5 or kv_shape[0] < 1 or kv_shape[1] != 2 or kv_shape[2] < 1 or kv_shape[3] < 1
            or kv_shape[4] != d):
        _fail_value(op, "kv_cache", f"must be (num_slots, 2, KVH, S, D) with D = q.shape[2] = {d} and "
                    f"num_slots, KVH, S >= 1, got shape {kv_shape}")
    kvh, s = kv_shape[2], kv_shape[3]
    if h % kvh != 0:
        _fail_value(op, "kv_cache", f"KVH = kv_cache.shape[2] = {kvh} must divide H = q.shape[1] = {h}")
    if s >= 2**31:
        _fail_value(op, "kv_cache", f"S = kv_cache.shape[3] must be below 2**31, got {s}")
    if tuple(slots.shape) != (b,):
        _fail_value(op, "slots", f"must be (B,) with B = q.shape[0] = {b}, got shape {tuple(slots.shape)}")
    if tuple(positions.shape) != (b,):
        _fail_value(op, "positions", f"must be (B,) with B = q.shape[0] = {b}, got shape {tuple(positions.shape)}")
    if q.stride(2) != 1:
        _fail_value(op, "q", f"must have stride(2) == 1, got strides {q.stride()}")
    if not kv_cache.is_contiguous():
        _fail_value(op, "kv_cache", "must be contiguous")
    if _misaligned(kv_cache, 16):
        _fail_value(op, "kv_cache", f"data must be 16-byte aligned (storage offset {kv_cache.storage_offset()})")
    if out is not None:
        if tuple(out.shape) != (b, h * d):
            _fail_value(op, "out", f"must be (B, H * D) = ({b}, {h * d}), got shape {tuple(out.shape)}")
        if not out.is_contiguous():
            _fail_value(op, "out", "must be contiguous")


# ----------------------------------------------------------------------------------------------------
# CPU reference implementations: the kernels' arithmetic, in the kernels' order (csrc/gemm/EPILOGUES.md)


def _scaled_mm_reference(a, b, scale_a, scale_b, out_dtype, bias):
    # Exact products summed in float64 (exact for int8 at any legal K), then rounded to float32 as the
    # kernels' int32 -> float32 conversion (or fp32 accumulator) does.
    acc = (a.to(torch.float64) @ b.to(torch.float64)).to(torch.float32)
    d = (acc * scale_b.reshape(1, -1)) * scale_a.reshape(-1, 1)
    if bias is not None:
        d = d + bias.to(torch.float32)
    return d.to(out_dtype)


def _scaled_mm_cpu(a, b, scale_a, scale_b, out_dtype, bias=None):
    _check_scaled_mm("scaled_mm", a, b, scale_a, scale_b, out_dtype, bias)
    return _scaled_mm_reference(a, b, scale_a, scale_b, out_dtype, bias)


def _w8a8_linear_reference(x, weight, weight_scale, input_scale, bias, out_dtype):
    # quantize_per_token / quantize_per_tensor, then scaled_mm: the CUDA op's definition
    k, n = weight.shape[1], weight.shape[0]
    x2 = x.reshape(-1, k)
    if input_scale is None:
        q, scale_a = _quantize_per_token_cpu(x2, weight.dtype)
    else:
        q, scale_a = _quantize_rows(x2.to(torch.float32), input_scale.reshape(()), weight.dtype), input_scale
    y = _scaled_mm_reference(q, weight.t(), scale_a, weight_scale.reshape(-1), out_dtype, bias)
    return y.reshape(*x.shape[:-1], n)


def _w8a8_linear_cpu(x, weight, weight_scale, input_scale=None, bias=None, out_dtype=torch.bfloat16):
    _check_w8a8_linear(x, weight, weight_scale, input_scale, bias, out_dtype)
    return _w8a8_linear_reference(x, weight, weight_scale, input_scale, bias, out_dtype)


def _scaled_mm_out_cpu(out, a, b, scale_a, scale_b, bias=None):
    _check_scaled_mm("scaled_mm", a, b, scale_a, scale_b, out.dtype, bias, out)
    out.copy_(_scaled_mm_reference(a, b, scale_a, scale_b, out.dtype, bias))


def _scaled_mm_config_cpu(out, a, b, scale_a, scale_b, bias, config):
    _scaled_mm_out_cpu(out, a, b, scale_a, scale_b, bias)


def _quantize_rows(xf: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q = saturate(round_half_even(xf / scale)); q = 0 where scale == 0. float32 in, IEEE division."""
    y = torch.where(scale == 0, torch.zeros_like(xf), xf / torch.where(scale == 0, torch.ones_like(scale), scale))
    qmax = _QMAX[dtype]
    if dtype == torch.int8:
        q = torch.round(y).clamp(-128, 127).to(torch.int8)
    else:
        q = y.clamp(-qmax, qmax).to(dtype)
    return q.contiguous()  # as the CUDA kernels and the fake kernels: contiguous whatever x's layout


def _quantize_per_token_cpu(x, dtype):
    _check_quant_input("quantize_per_token", x, dtype)
    xf = x.to(torch.float32)
    if x.shape[-1] == 0:
        amax = torch.zeros(*x.shape[:-1], 1, dtype=torch.float32)
    else:
        amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = amax / torch.tensor(_QMAX[dtype], dtype=torch.float32)
    return _quantize_rows(xf, scale, dtype), scale


def _quantize_per_tensor_cpu(x, scale, dtype):
    _check_quant_input("quantize_per_tensor", x, dtype)
    _check_static_scale("quantize_per_tensor", x, scale)
    return _quantize_rows(x.to(torch.float32), scale.reshape(()), dtype)


# The fused ops' references are the unfused torch chains they replace, op for op, in x's dtype: so on the CPU
# the fused ops equal the chains bit for bit by construction (tests/test_fused_quant_cpu.py).


def _rms_norm_reference(x, weight, eps, residual):
    if residual is not None:
        residual.add_(x)  # vLLM's fused_add_rms_norm: residual = x + residual, rounded to x's dtype
        x = residual
    # F.rms_norm: float32 inside (mean of squares, rsqrt, times weight), rounded once to x's dtype
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps).contiguous()


def _silu_mul_reference(x):
    gate, up = x.chunk(2, dim=-1)
    # eager torch in x's dtype: silu rounded to it, then the product rounded to it
    return (torch.nn.functional.silu(gate) * up).contiguous()


def _quantize_fused(y, dtype, scale):
    """(q, scale) of the fused ops: quantize_per_token of y, or quantize_per_tensor with the static `scale`
    and that scale repeated per row ([..., 1]) as the second output."""
    if scale is None:
        return _quantize_per_token_cpu(y, dtype)
    per_row = scale.reshape(1).to(torch.float32).expand((*y.shape[:-1], 1)).contiguous()
    return _quantize_per_tensor_cpu(y, scale, dtype), per_row


def _rms_norm_cpu(x, weight, eps):
    _check_rms_norm("rms_norm", x, weight, eps, None)
    return _rms_norm_reference(x, weight, eps, None)


def _fused_add_rms_norm_cpu(x, residual, weight, eps):
    _check_rms_norm("fused_add_rms_norm", x, weight, eps, residual)
    return _rms_norm_reference(x, weight, eps, residual)


def _rms_norm_quant_cpu(x, weight, eps, dtype, scale=None, residual=None):
    _check_rms_norm("rms_norm_quant", x, weight, eps, residual)
    _check_quant_dtype("rms_norm_quant", dtype)
    if scale is not None:
        _check_static_scale("rms_norm_quant", x, scale)
    return _quantize_fused(_rms_norm_reference(x, weight, eps, residual), dtype, scale)


def _silu_mul_cpu(x):
    _check_silu_mul("silu_mul", x)
    return _silu_mul_reference(x)


def _silu_mul_quant_cpu(x, dtype, scale=None):
    _check_silu_mul("silu_mul_quant", x)
    _check_quant_dtype("silu_mul_quant", dtype)
    if scale is not None:
        _check_static_scale("silu_mul_quant", x, scale)
    return _quantize_fused(_silu_mul_reference(x), dtype, scale)


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


def _rope_kv_cache_cpu(qkv, rope, kv_cache, slots, positions, num_heads, num_kv_heads):
    """The torch formulation rope_kv_cache_ replaces: neox rotation of the q and k heads as a float32 complex
    multiply rounded once to qkv's dtype, then one index_put_ of the k and v heads into the cache."""
    _check_rope_kv_cache(qkv, rope, kv_cache, slots, positions, num_heads, num_kv_heads)
    b, _, d = qkv.shape
    if b == 0:
        return
    h = d // 2
    qk = qkv[:, : num_heads + num_kv_heads]
    pairs = qk.unflatten(-1, (2, h)).transpose(-1, -2)  # (B, N, D/2, 2): (x[j], x[j + D/2])
    xc = torch.view_as_complex(torch.empty(pairs.shape, dtype=torch.float32).copy_(pairs))
    pairs.copy_(torch.view_as_real(xc * torch.view_as_complex(rope.contiguous()).unsqueeze(1)))
    s = kv_cache.shape[3]
    heads = torch.arange(2 * num_kv_heads)
    index = (slots.unsqueeze(1) * (2 * num_kv_heads) + heads) * s + positions.unsqueeze(1)
    kv_cache.view(-1, d).index_put_((index,), qkv[:, num_heads:])


def _check_rope_kv_cache(qkv, rope, kv_cache, slots, positions, num_heads, num_kv_heads) -> None:
    op = "rope_kv_cache_"
    if qkv.dtype not in _ATTN_DTYPES:
        _fail_type(op, "qkv", f"must be bfloat16, float16 or float32, got {qkv.dtype}")
    if kv_cache.dtype != qkv.dtype:
        _fail_type(op, "kv_cache", "must have qkv's dtype")
    if rope.dtype != torch.float32:
        _fail_type(op, "rope", "must be float32")
    if qkv.dim() != 3 or qkv.shape[1] != num_heads + 2 * num_kv_heads or qkv.shape[2] % 2:
        _fail_value(op, "qkv", f"must be (B, num_heads + 2 num_kv_heads, D), got {tuple(qkv.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.shape[2] != num_kv_heads:
        _fail_value(op, "kv_cache", f"must be contiguous (slots, 2, num_kv_heads, S, D), got {tuple(kv_cache.shape)}")


def _decode_attention_cpu(q, kv_cache, slots, positions, softmax_scale):
    _check_decode_attention("decode_attention", q, kv_cache, slots, positions, softmax_scale)
    return _decode_attention_reference(q, kv_cache, slots, positions, softmax_scale)


def _decode_attention_out_cpu(out, q, kv_cache, slots, positions, softmax_scale):
    _check_decode_attention("decode_attention", q, kv_cache, slots, positions, softmax_scale, out)
    out.copy_(_decode_attention_reference(q, kv_cache, slots, positions, softmax_scale))


_lib.impl("scaled_mm", _scaled_mm_cpu, "CPU")
_lib.impl("scaled_mm_out", _scaled_mm_out_cpu, "CPU")
_lib.impl("w8a8_linear", _w8a8_linear_cpu, "CPU")
_lib.impl("_scaled_mm_config", _scaled_mm_config_cpu, "CPU")
_lib.impl("quantize_per_token", _quantize_per_token_cpu, "CPU")
_lib.impl("quantize_per_tensor", _quantize_per_tensor_cpu, "CPU")
_lib.impl("rms_norm", _rms_norm_cpu, "CPU")
_lib.impl("fused_add_rms_norm", _fused_add_rms_norm_cpu, "CPU")
_lib.impl("rms_norm_quant", _rms_norm_quant_cpu, "CPU")
_lib.impl("silu_mul", _silu_mul_cpu, "CPU")
_lib.impl("silu_mul_quant", _silu_mul_quant_cpu, "CPU")
_lib.impl("decode_attention", _decode_attention_cpu, "CPU")
_lib.impl("decode_attention_out", _decode_attention_out_cpu, "CPU")
_lib.impl("rope_kv_cache_", _rope_kv_cache_cpu, "CPU")


# ----------------------------------------------------------------------------------------------------
# fake (meta) kernels, for torch.compile and opcheck


@torch.library.register_fake("cutlass_w8a8::scaled_mm")
def _scaled_mm_fake(a, b, scale_a, scale_b, out_dtype, bias=None):
    _check_scaled_mm("scaled_mm", a, b, scale_a, scale_b, out_dtype, bias)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.register_fake("cutlass_w8a8::scaled_mm_out")
def _scaled_mm_out_fake(out, a, b, scale_a, scale_b, bias=None):
    _check_scaled_mm("scaled_mm", a, b, scale_a, scale_b, out.dtype, bias, out)


@torch.library.register_fake("cutlass_w8a8::w8a8_linear")
def _w8a8_linear_fake(x, weight, weight_scale, input_scale=None, bias=None, out_dtype=torch.bfloat16):
    _check_w8a8_linear(x, weight, weight_scale, input_scale, bias, out_dtype)
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype)


@torch.library.register_fake("cutlass_w8a8::_scaled_mm_config")
def _scaled_mm_config_fake(out, a, b, scale_a, scale_b, bias, config):
    _check_scaled_mm("scaled_mm", a, b, scale_a, scale_b, out.dtype, bias, out)


@torch.library.register_fake("cutlass_w8a8::quantize_per_token")
def _quantize_per_token_fake(x, dtype):
    _check_quant_input("quantize_per_token", x, dtype)
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.register_fake("cutlass_w8a8::quantize_per_tensor")
def _quantize_per_tensor_fake(x, scale, dtype):
    _check_quant_input("quantize_per_tensor", x, dtype)
    _check_static_scale("quantize_per_tensor", x, scale)
    return x.new_empty(x.shape, dtype=dtype)


@torch.library.register_fake("cutlass_w8a8::rms_norm")
def _rms_norm_fake(x, weight, eps):
    _check_rms_norm("rms_norm", x, weight, eps, None)
    return x.new_empty(x.shape)


@torch.library.register_fake("cutlass_w8a8::fused_add_rms_norm")
def _fused_add_rms_norm_fake(x, residual, weight, eps):
    _check_rms_norm("fused_add_rms_norm", x, weight, eps, residual)
    return x.new_empty(x.shape)


@torch.library.register_fake("cutlass_w8a8::rms_norm_quant")
def _rms_norm_quant_fake(x, weight, eps, dtype, scale=None, residual=None):
    _check_rms_norm("rms_norm_quant", x, weight, eps, residual)
    _check_quant_dtype("rms_norm_quant", dtype)
    if scale is not None:
        _check_static_scale("rms_norm_quant", x, scale)
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.register_fake("cutlass_w8a8::silu_mul")
def _silu_mul_fake(x):
    _check_silu_mul("silu_mul", x)
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.register_fake("cutlass_w8a8::silu_mul_quant")
def _silu_mul_quant_fake(x, dtype, scale=None):
    _check_silu_mul("silu_mul_quant", x)
    _check_quant_dtype("silu_mul_quant", dtype)
    if scale is not None:
        _check_static_scale("silu_mul_quant", x, scale)
    return (x.new_empty((*x.shape[:-1], x.shape[-1] // 2), dtype=dtype),
            x.new_empty((*x.shape[:-1], 1), dtype=torch.float32))


@torch.library.register_fake("cutlass_w8a8::rope_kv_cache_")
def _rope_kv_cache_fake(qkv, rope, kv_cache, slots, positions, num_heads, num_kv_heads):
    _check_rope_kv_cache(qkv, rope, kv_cache, slots, positions, num_heads, num_kv_heads)


@torch.library.register_fake("cutlass_w8a8::decode_attention")
def _decode_attention_fake(q, kv_cache, slots, positions, softmax_scale):
    _check_decode_attention("decode_attention", q, kv_cache, slots, positions, softmax_scale)
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


@torch.library.register_fake("cutlass_w8a8::decode_attention_out")
def _decode_attention_out_fake(out, q, kv_cache, slots, positions, softmax_scale):
    _check_decode_attention("decode_attention", q, kv_cache, slots, positions, softmax_scale, out)


# ----------------------------------------------------------------------------------------------------
# public wrappers


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """W8A8 GEMM with fused dequantization: ``D = scale_a * scale_b * (A @ B) + bias``.

    The products accumulate exactly in int32 (int8) or in float32 (float8_e4m3fn); the epilogue multiplies
    by ``scale_b`` then ``scale_a`` in float32, adds ``bias`` and rounds once to ``out_dtype``
    (csrc/gemm/EPILOGUES.md).

    Parameters
    ----------
    a : torch.Tensor
        ``(M, K)``, int8 or float8_e4m3fn, row-major (``stride(1) == 1``). Rows may be padded
        (``stride(0) >= K``, a multiple of 16) as in a slice of a wider buffer. Any ``M >= 0``.
    b : torch.Tensor
        ``(K, N)``, the dtype of ``a``, column-major: pass the ``(N, K)`` row-major weight as ``weight.t()``.
        K and N must be positive multiples of 16; for int8, ``K <= INT8_MAX_K`` (131056) so the int32
        accumulator cannot overflow.
    scale_a : torch.Tensor
        float32, ``(1,)`` per-tensor or ``(M, 1)`` per-token, contiguous, on ``a``'s device.
    scale_b : torch.Tensor
        float32, ``(1,)`` per-tensor or ``(N,)`` / ``(1, N)`` / ``(N, 1)`` per-channel (the last is what
        compressed-tensors checkpoints store and ``quantize_int8(weight)`` returns), contiguous.
    out_dtype : torch.dtype
        ``torch.bfloat16`` (default) or ``torch.float16``. Ignored when ``out`` is given.
    bias : torch.Tensor, optional
        ``(N,)`` in ``out_dtype``.
    out : torch.Tensor, optional
        ``(M, N)`` row-major destination (its dtype is the output dtype); written in place and returned.
        For static buffers, e.g. inside CUDA graphs.

    Returns
    -------
    torch.Tensor
        ``(M, N)`` in ``out_dtype``, on ``a``'s device.

    Raises
    ------
    TypeError
        A dtype is wrong (``a``, ``b``, scales, ``bias``, ``out_dtype``, ``out``).
    ValueError
        A shape, layout, alignment or device is wrong; the message names the argument.
    RuntimeError
        CUDA tensors were given but the CUDA extension is not built, or the device has no kernels.

    Examples
    --------
    >>> x_q, x_s = quantize_int8(x)                  # x: (M, K) bf16 -> per-token int8
    >>> y = scaled_mm(x_q, w_q.t(), x_s, w_s, torch.bfloat16, bias)
    """
    dtype = out.dtype if out is not None else out_dtype
    _check_scaled_mm("scaled_mm", a, b, scale_a, scale_b, dtype, bias, out)
    if a.is_cuda:
        _ext.require_cuda_ops("scaled_mm")
    if out is None:
        return torch.ops.cutlass_w8a8.scaled_mm(a, b, scale_a, scale_b, out_dtype, bias)
    torch.ops.cutlass_w8a8.scaled_mm_out(out, a, b, scale_a, scale_b, bias)
    return out


def _quantize(op: str, x: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype):
    _check_quant_input(op, x, dtype)
    if scale is not None:
        _check_static_scale(op, x, scale)
    if x.is_cuda:
        _ext.require_cuda_ops(op)
    if scale is None:
        return torch.ops.cutlass_w8a8.quantize_per_token(x, dtype)
    return torch.ops.cutlass_w8a8.quantize_per_tensor(x, scale, dtype), scale


def quantize_int8(x: torch.Tensor, scale: Optional[torch.Tensor] = None):
    """Quantize activations to int8: dynamic per-token, or static per-tensor when ``scale`` is given.

    Dynamic: ``scale[..., 0] = max_k |x[..., k]| / 127`` and ``q = clamp(round_half_even(x / scale),
    -128, 127)``, in float32; a row of zeros gets scale 0 and q = 0. Static: the same rounding with the
    given scale, saturating values outside [-128, 127]. One kernel launch, no host synchronisation.
    Non-finite inputs give unspecified results.

    Parameters
    ----------
    x : torch.Tensor
        ``(..., K)``, bfloat16, float16 or float32. Any leading dimensions; rows need not be packed.
    scale : torch.Tensor, optional
        float32 with one element (per-tensor), on ``x``'s device.

    Returns
    -------
    (q, scale) : tuple of torch.Tensor
        ``q``: int8, ``x``'s shape, contiguous. ``scale``: float32 ``(..., 1)`` (dynamic), or the given
        ``scale`` object (static).

    Raises
    ------
    TypeError
        ``x`` or ``scale`` has the wrong dtype.
    ValueError
        ``x`` has no dimension; ``scale`` is not one element or is on another device.
    """
    return _quantize("quantize_int8", x, scale, torch.int8)


def quantize_fp8(x: torch.Tensor, scale: Optional[torch.Tensor] = None):
    """Quantize activations to float8_e4m3fn: dynamic per-token, or static per-tensor with ``scale``.

    Dynamic: ``scale = max_k |x[..., k]| / 448`` (448 is the largest finite e4m3fn) and
    ``q = e4m3fn(clamp(x / scale, -448, 448))`` rounded to nearest even, in float32; a row of zeros gets
    scale 0. Static: the same with the given scale, saturating to +-448 rather than producing NaN.

    Parameters, returns and errors as :func:`quantize_int8`, with ``q`` of dtype ``torch.float8_e4m3fn``.
    """
    return _quantize("quantize_fp8", x, scale, torch.float8_e4m3fn)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RMSNorm over the last dimension, optionally after adding ``x`` into ``residual`` in place.

    Without ``residual``: ``y = F.rms_norm(x, (K,), weight, eps)``. With ``residual``, first
    ``residual += x`` in place (the sum rounded to ``x``'s dtype), then ``y = F.rms_norm(residual, ...)``:
    the semantics of vLLM's ``fused_add_rms_norm`` (csrc/layernorm_kernels.cu; SGLang's
    ``fused_add_rmsnorm``), whose decoder layers carry the residual stream this way, except that ``y`` is a
    new tensor rather than written over ``x``. (Two ops underneath: ``torch.ops.cutlass_w8a8.rms_norm`` and
    ``fused_add_rms_norm(x, residual, weight, eps)``.) ``F.rms_norm`` computes in float32,
    ``y = (s * rsqrt(mean(s^2) + eps)) * weight`` with ``s`` the input upcast, and rounds once to ``x``'s
    dtype; so does the CUDA kernel (one launch; grid rows x blocks per row), so the fused op equals the unfused
    ``residual += x; F.rms_norm(residual)`` chain up to the order of the float32 sum of squares: on the CPU
    (the reference implementation is that chain) bit for bit; on the GPU ``y`` may differ in the last bit of
    its dtype where the float32 value is within rounding error of a tie.

    Parameters
    ----------
    x : torch.Tensor
        ``(..., K)``, bfloat16, float16 or float32, ``K > 0``. Any layout (non-row-major inputs are copied).
    weight : torch.Tensor
        ``(K,)``, ``x``'s dtype and device, contiguous.
    eps : float
        Added to the mean of squares, in float32 (``float(eps)``); finite and ``>= 0``.
    residual : torch.Tensor, optional
        ``x``'s shape, dtype and device, rows of unit stride whose leading dimensions merge into ``M`` rows
        (e.g. contiguous, or a row slice of a wider buffer). Updated in place to ``x + residual``. Must not
        overlap ``x`` partially (the same tensor is fine: ``residual`` becomes ``2 x``); this is not checked.

    Returns
    -------
    torch.Tensor
        ``y``: ``x``'s shape and dtype, contiguous.

    Raises
    ------
    TypeError
        ``x``, ``weight`` or ``residual`` has the wrong dtype; ``eps`` is not a number.
    ValueError
        A shape, layout or device is wrong, ``K`` is 0, or ``eps`` is negative or not finite; the message
        names the argument.

    Notes
    -----
    Non-finite values behave as in ``F.rms_norm``: a NaN makes its whole row NaN; an infinity (or a sum of
    squares that overflows float32, from magnitudes near 1e19, possible in bfloat16) makes the row's
    ``rsqrt`` 0, so the row comes out 0 except NaN where the input was infinite. Other rows are unaffected.
    ``M = 0`` returns an empty tensor and launches nothing.

    Examples
    --------
    >>> h = embed(tokens); residual = h                       # first layer: nothing to add yet
    >>> x = rms_norm(h, norm.weight, 1e-5)
    >>> x = rms_norm(attn_out, norm2.weight, 1e-5, residual)  # residual += attn_out; x = norm2(residual)
    """
    _check_rms_norm("rms_norm", x, weight, eps, residual)
    if x.is_cuda:
        _ext.require_cuda_ops("rms_norm")
    if residual is None:
        return torch.ops.cutlass_w8a8.rms_norm(x, weight, float(eps))
    return torch.ops.cutlass_w8a8.fused_add_rms_norm(x, residual, weight, float(eps))


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype,
                   scale: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None):
    """`rms_norm` (with the optional in-place residual add) fused with activation quantization.

    ``y`` is computed exactly as by :func:`rms_norm`, rounded to ``x``'s dtype, and then quantized as
    :func:`quantize_int8` / :func:`quantize_fp8` quantize a stored ``y``: dynamic per token
    (``scale = max|y| / QMAX`` per row, QMAX 127 or 448) when ``scale`` is None, else static per tensor with
    ``scale``. The rounding of ``y`` to ``x``'s dtype before quantizing is deliberate: it makes
    ``rms_norm_quant`` equal the unfused chain ``rms_norm`` -> ``quantize_*`` bit for bit (on the GPU: the
    GPU's ``rms_norm`` followed by the GPU's quantization). One kernel launch (rows x blocks per row), no host
    synchronisation; the output is what `W8A8Linear` accepts as a `QuantizedActivation`. vLLM fuses the
    same steps (``rms_norm_dynamic_per_token_quant``, ``fused_add_rms_norm_static_fp8_quant``).

    Parameters
    ----------
    x, weight, eps, residual
        As :func:`rms_norm`; ``residual`` is updated in place to ``x + residual``.
    dtype : torch.dtype
        ``torch.int8`` or ``torch.float8_e4m3fn``.
    scale : torch.Tensor, optional
        float32 with one element (static per-tensor), on ``x``'s device. None: dynamic per-token.

    Returns
    -------
    (q, scale) : tuple of torch.Tensor
        ``q``: ``dtype``, ``x``'s shape, contiguous. ``scale``: float32 ``(..., 1)`` per-token scales
        (dynamic), or the given ``scale`` object (static), as :func:`quantize_int8` returns them.

    Raises
    ------
    TypeError
        As :func:`rms_norm`; ``dtype`` is not int8 / float8_e4m3fn; ``scale`` is not a float32 tensor.
    ValueError
        As :func:`rms_norm`; ``scale`` is not one element or is on another device.

    Notes
    -----
    A row with a non-finite ``y`` (see :func:`rms_norm`) gets an unspecified ``q`` and scale, as the
    quantization ops document; other rows are unaffected. The op itself
    (``torch.ops.cutlass_w8a8.rms_norm_quant``) returns per-row scales in both modes: in the static one the
    given value repeated, ``(..., 1)``.
    """
    _check_rms_norm("rms_norm_quant", x, weight, eps, residual)
    _check_quant_dtype("rms_norm_quant", dtype)
    if scale is not None:
        _check_static_scale("rms_norm_quant", x, scale)
    if x.is_cuda:
        _ext.require_cuda_ops("rms_norm_quant")
    q, s = torch.ops.cutlass_w8a8.rms_norm_quant(x, weight, float(eps), dtype, scale, residual)
    return q, (s if scale is None else scale)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: ``silu(gate) * up`` with ``gate, up = x.chunk(2, dim=-1)``.

    ``x`` is the output of a merged gate/up projection laid out ``[gate | up]`` (vLLM's
    ``MergedColumnParallelLinear``, as `LlamaMLP`'s ``gate_up_proj``; vLLM's and SGLang's ``silu_and_mul``).
    The result equals eager torch's ``F.silu(gate) * up`` in ``x``'s dtype: ``silu(g) = g / (1 + exp(-g))``
    in float32 rounded to ``x``'s dtype, then the product in float32 rounded to ``x``'s dtype. On the GPU the
    silu formula is torch's CUDA kernel's, so the op equals torch's CUDA chain bit for bit; the CPU reference
    is the CPU chain, whose vectorized ``exp`` can differ from the GPU's in the last float32 bit (so the two
    devices can differ in the last bit of ``x``'s dtype, rarely).

    Parameters
    ----------
    x : torch.Tensor
        ``(..., 2 * I)``, bfloat16, float16 or float32, ``I > 0``. Any layout (non-row-major inputs are
        copied).

    Returns
    -------
    torch.Tensor
        ``(..., I)`` in ``x``'s dtype, contiguous.

    Raises
    ------
    TypeError
        ``x`` is not a float tensor of those dtypes.
    ValueError
        ``x`` has no dimension, or its last dimension is 0 or odd.

    Notes
    -----
    Non-finite values follow torch elementwise: ``silu(+inf) = inf``, ``silu(-inf) = NaN`` (``-inf / inf``),
    ``silu(NaN) = NaN``, then IEEE products. ``M = 0`` returns an empty tensor and launches nothing.
    """
    _check_silu_mul("silu_mul", x)
    if x.is_cuda:
        _ext.require_cuda_ops("silu_mul")
    return torch.ops.cutlass_w8a8.silu_mul(x)


def silu_mul_quant(x: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor] = None):
    """:func:`silu_mul` fused with activation quantization (the input of a W8A8 ``down_proj``).

    ``y = silu(gate) * up`` as :func:`silu_mul` computes it, rounded to ``x``'s dtype, then quantized as
    :func:`quantize_int8` / :func:`quantize_fp8` quantize a stored ``y``: dynamic per token when ``scale`` is
    None, else static per tensor. Equal to the unfused chain ``silu_mul`` -> ``quantize_*`` bit for bit on
    the same device. One kernel launch: one block per row, or on sm90 a cluster of up to 8 for long rows.

    Parameters
    ----------
    x : torch.Tensor
        ``(..., 2 * I)`` ``[gate | up]``, bfloat16, float16 or float32, ``I > 0``.
    dtype : torch.dtype
        ``torch.int8`` or ``torch.float8_e4m3fn``.
    scale : torch.Tensor, optional
        float32 with one element (static per-tensor), on ``x``'s device. None: dynamic per-token.

    Returns
    -------
    (q, scale) : tuple of torch.Tensor
        ``q``: ``dtype``, ``(..., I)``, contiguous. ``scale``: float32 ``(..., 1)`` (dynamic), or the given
        ``scale`` object (static).

    Raises
    ------
    TypeError
        ``x``, ``dtype`` or ``scale`` has the wrong type or dtype.
    ValueError
        ``x``'s last dimension is 0 or odd; ``scale`` is not one element or is on another device.

    Notes
    -----
    A row with a non-finite ``y`` gets an unspecified ``q`` and scale; other rows are unaffected. The op
    itself returns per-row scales in both modes (static: the given value repeated, ``(..., 1)``).
    """
    _check_silu_mul("silu_mul_quant", x)
    _check_quant_dtype("silu_mul_quant", dtype)
    if scale is not None:
        _check_static_scale("silu_mul_quant", x, scale)
    if x.is_cuda:
        _ext.require_cuda_ops("silu_mul_quant")
    q, s = torch.ops.cutlass_w8a8.silu_mul_quant(x, dtype, scale)
    return q, (s if scale is None else scale)


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    softmax_scale: Optional[float] = None,
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode-step attention: one query token per sequence over positions ``0..positions[b]`` of its cache slot.

    For row ``b`` and query head ``h``, with ``G = H / KVH`` and key/value head ``kvh = h // G``::

        K, V = kv_cache[slots[b], 0, kvh], kv_cache[slots[b], 1, kvh]            # (S, D) each
        p = softmax(softmax_scale * K[:positions[b] + 1] @ q[b, h])               # float32, max-subtracted
        out[b, h * D:(h + 1) * D] = round(p @ V[:positions[b] + 1])               # rounded once to q's dtype

    Only those positions of those slots are read, so the cost grows with the real batch and the real sequence
    lengths, not with the cache's size (grouped-query attention without repeating the key/value heads).

    Parameters
    ----------
    q : torch.Tensor
        ``(B, H, D)``, bfloat16, float16 or float32. Any strides with ``stride(2) == 1``: e.g. the query heads
        of a fused qkv projection, ``qkv.view(B, H + 2 * KVH, D)[:, :H]`` (``stride(0) = (H + 2 KVH) D``).
        ``D`` a multiple of 8 in [8, 256].
    kv_cache : torch.Tensor
        ``(num_slots, 2, KVH, S, D)`` in ``q``'s dtype, contiguous, 16-byte aligned: index 0 of dimension 1
        holds the keys, 1 the values. ``KVH`` divides ``H``.
    slots : torch.Tensor
        ``(B,)`` int64 on ``q``'s device (any stride): the cache slot of each row, in ``[0, num_slots)``.
    positions : torch.Tensor
        ``(B,)`` int64 on ``q``'s device (any stride): the position of each row's token, in ``[0, S)``; the row
        attends to positions ``0..positions[b]`` inclusive (its own key and value must already be written).
    softmax_scale : float, optional
        Multiplies the scores before the softmax; default ``1 / sqrt(D)``. Finite.
    out : torch.Tensor, optional
        ``(B, H * D)`` contiguous destination in ``q``'s dtype, written in place and returned (static
        buffers, CUDA graphs).

    Returns
    -------
    torch.Tensor
        ``(B, H * D)``, contiguous, ``q``'s dtype and device: the heads of a row side by side, as
        ``o_proj`` takes them.

    Raises
    ------
    TypeError
        A wrong dtype (``q``, ``kv_cache``, ``slots``, ``positions``, ``out``) or a non-tensor argument.
    ValueError
        A wrong shape, stride, alignment, device, head dimension or ``softmax_scale``; the message names the
        argument.
    RuntimeError
        CUDA tensors were given but the CUDA extension is not built.

    Notes
    -----
    The values of ``slots`` and ``positions`` are not checked: that would need a device-to-host
    synchronisation (callers such as `cutlass_w8a8.runner.DecodeGraphRunner` check them on the host). On the
    GPU, out-of-range values are clamped into range (a wrong result, never an out-of-bounds read); on the CPU,
    an out-of-range slot raises from ``index_select`` and an out-of-range position gives an unspecified
    result.

    CUDA kernel (csrc/attention/decode_attention.cu): one block of 128 threads per (row, query head), so B = 1
    still runs H blocks. The positions are split between the block's threads, each group of threads keeping an
    online softmax (a running maximum, a running sum and a float32 accumulator, rescaled when the maximum
    grows: Milakov & Gimelshein [1]_); the partial results are merged at the end, rescaled to the common
    maximum, as flash-decoding [2]_ merges its splits. Block ``(b, h)`` reads only row ``b``'s inputs and
    writes only its output (a row-wise kernel whose CUDA-graph node can be shrunk to fewer rows). One launch
    on the current stream, no host synchronisation. The CPU implementation is the former reference math:
    ``index_select`` of the B slots, then ``F.scaled_dot_product_attention`` over all S positions with an
    additive ``-inf`` mask. The two agree to rounding (the order of the float32 sums differs).

    References
    ----------
    .. [1] M. Milakov and N. Gimelshein, "Online normalizer calculation for softmax", arXiv:1805.02867, 2018.
    .. [2] T. Dao, D. Haziza, F. Massa and G. Sizov, "Flash-Decoding for long-context inference", 2023.

    Examples
    --------
    >>> qkv = qkv_proj(x).view(B, H + 2 * KVH, D)           # rotary already applied, new K/V written
    >>> attn = decode_attention(qkv[:, :H], kv_cache, slots, positions)    # (B, H * D)
    >>> y = o_proj(attn)
    """
    if softmax_scale is None:
        valid = isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[2] > 0
        softmax_scale = 1.0 / math.sqrt(q.shape[2]) if valid else 1.0  # SDPA's default; a bad q fails below
    _check_decode_attention("decode_attention", q, kv_cache, slots, positions, softmax_scale, out)
    if q.is_cuda:
        _ext.require_cuda_ops("decode_attention")
    if out is None:
        return torch.ops.cutlass_w8a8.decode_attention(q, kv_cache, slots, positions, softmax_scale)
    torch.ops.cutlass_w8a8.decode_attention_out(out, q, kv_cache, slots, positions, softmax_scale)
    return out


# ----------------------------------------------------------------------------------------------------
# decode GEMMs (M <= 16): scaled_mm_decode and linear_decode (csrc/gemm/decode/scaled_mm_decode.cu)

DECODE_MAX_M = 16  # tokens (rows of a / x) the decode kernels serve: two mma token tiles of 8
_DECODE_MAX_K = 2**30  # K byte offsets are 32-bit in the decode kernels
_DECODE_X_DTYPES = (torch.bfloat16, torch.float16)


def _check_decode_m(op: str, arg: str, m: int) -> None:
    if not 1 <= m <= DECODE_MAX_M:
        _fail_value(op, arg, f"M = {arg}.shape[0] must be in [1, {DECODE_MAX_M}] (decode sizes; scaled_mm serves "
                    f"any M), got {m}")


def _check_scaled_mm_decode(op: str, a, b, scale_a, scale_b, out_dtype, bias, out=None) -> None:
    """scaled_mm's checks, then M in [1, 16] and K <= 2**30."""
    _check_scaled_mm(op, a, b, scale_a, scale_b, out_dtype, bias, out)
    _check_decode_m(op, "a", a.shape[0])
    if a.shape[1] > _DECODE_MAX_K:
        _fail_value(op, "a", f"K = {a.shape[1]} must be at most 2**30")


def _check_linear_decode(op: str, x, b, scale_b, bias, dtype, out=None) -> None:
    """The checks of csrc/gemm/decode/scaled_mm_decode.cu's linear_decode_out, in its order and wording."""
    for name, t in (("x", x), ("b", b), ("scale_b", scale_b)):
        if not isinstance(t, torch.Tensor):
            _fail_type(op, name, f"must be a torch.Tensor, got {type(t).__name__}")
    if out is not None and not isinstance(out, torch.Tensor):
        _fail_type(op, "out", f"must be a torch.Tensor or None, got {type(out).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        _fail_type(op, "bias", f"must be a torch.Tensor or None, got {type(bias).__name__}")
    # dtypes
    if x.dtype not in _DECODE_X_DTYPES:
        _fail_type(op, "x", f"must be bfloat16 or float16, got {x.dtype}")
    if dtype not in _AB_DTYPES:
        _fail_type(op, "dtype", f"must be torch.int8 or torch.float8_e4m3fn, got {dtype}")
    if b.dtype != dtype:
        _fail_type(op, "b", f"must have the quantized dtype {dtype}, got {b.dtype}")
    if scale_b.dtype != torch.float32:
        _fail_type(op, "scale_b", f"must be float32, got {scale_b.dtype}")
    if out is not None and out.dtype != x.dtype:
        _fail_type(op, "out", f"must have x's dtype {x.dtype}, got {out.dtype}")
    if bias is not None and bias.dtype != x.dtype:
        _fail_type(op, "bias", f"must have x's dtype {x.dtype}, got {bias.dtype}")
    # devices
    others = [("b", b), ("scale_b", scale_b)] + ([("out", out)] if out is not None else []) + \
        ([("bias", bias)] if bias is not None else [])
    for name, t in others:
        if t.device != x.device:
            _fail_value(op, name, f"is on {t.device} but `x` is on {x.device}")
    # shapes
    if x.dim() != 2:
        _fail_value(op, "x", f"must be 2-D [M, K], got shape {tuple(x.shape)}")
    if b.dim() != 2:
        _fail_value(op, "b", f"must be 2-D [K, N], got shape {tuple(b.shape)}")
    m, k = x.shape
    n = b.shape[1]
    if b.shape[0] != k:
        _fail_value(op, "b", f"must be [K, N] with K = x.shape[1] = {k}, got shape {tuple(b.shape)}")
    _check_decode_m(op, "x", m)
    if k <= 0 or k % 16 != 0:
        _fail_value(op, "x", f"K = x.shape[1] must be a positive multiple of 16, got {k}")
    if n <= 0 or n % 16 != 0:
        _fail_value(op, "b", f"N = b.shape[1] must be a positive multiple of 16, got {n}")
    if b.dtype == torch.int8 and k > INT8_MAX_K:
        _fail_value(op, "x", f"K = {k} can overflow the int32 accumulator; int8 needs K <= {INT8_MAX_K}")
    if k > _DECODE_MAX_K:
        _fail_value(op, "x", f"K = {k} must be at most 2**30")
    if not (scale_b.numel() == 1 or tuple(scale_b.shape) in ((n,), (1, n), (n, 1))):
        _fail_value(op, "scale_b", f"must be [1] (per-tensor), [N], [1, N] or [N, 1] (per-channel) with N = {n}, "
                    f"got shape {tuple(scale_b.shape)}")
    if not scale_b.is_contiguous():
        _fail_value(op, "scale_b", "must be contiguous")
    _check_bias_shape(op, bias, n)
    # layouts: b as scaled_mm's; x read with 16-byte loads
    if b.stride(0) != 1:
        _fail_value(op, "b", "must be column-major [K, N] (the transpose of a row-major [N, K] weight, "
                    f"stride(0) == 1), got strides {b.stride()}")
    if b.stride(1) < k:
        _fail_value(op, "b", f"columns overlap: stride(1) = {b.stride(1)} < K = {k}")
    if b.stride(1) % 16 != 0:
        _fail_value(op, "b", f"stride(1) must be a multiple of 16 elements, got {b.stride(1)}")
    if _misaligned(b, 16):
        _fail_value(op, "b", f"data must be 16-byte aligned (storage offset {b.storage_offset()})")
    if x.stride(1) != 1:
        _fail_value(op, "x", f"must be row-major (stride(1) == 1), got strides {x.stride()}")
    if m > 1 and x.stride(0) < k:
        _fail_value(op, "x", f"rows overlap: stride(0) = {x.stride(0)} < K = {k}")
    if m > 1 and x.stride(0) % 8 != 0:
        _fail_value(op, "x", f"stride(0) must be a multiple of 8 elements, got {x.stride(0)}")
    if _misaligned(x, 16):
        _fail_value(op, "x", f"data must be 16-byte aligned (storage offset {x.storage_offset()})")
    if out is not None:
        if tuple(out.shape) != (m, n):
            _fail_value(op, "out", f"must be [M, N] = [{m}, {n}], got shape {tuple(out.shape)}")
        if out.stride(1) != 1:
            _fail_value(op, "out", f"must be row-major (stride(1) == 1), got strides {out.stride()}")
        if m > 1 and out.stride(0) < n:
            _fail_value(op, "out", f"rows overlap: stride(0) = {out.stride(0)} < N = {n}")
        if m > 1 and out.stride(0) % 8 != 0:
            _fail_value(op, "out", f"stride(0) must be a multiple of 8 elements, got {out.stride(0)}")
        if _misaligned(out, 16):
            _fail_value(op, "out", f"data must be 16-byte aligned (storage offset {out.storage_offset()})")


# CPU implementations: scaled_mm's reference math, and for linear_decode the CPU per-token quantization first
# (the CUDA kernel equals quantize_per_token followed by scaled_mm_decode bit for bit; on the CPU that chain is
# the definition).


def _linear_decode_reference(x, b, scale_b, bias, dtype):
    q, scale = _quantize_per_token_cpu(x, dtype)
    return _scaled_mm_reference(q, b, scale, scale_b, x.dtype, bias)


def _scaled_mm_decode_cpu(a, b, scale_a, scale_b, out_dtype, bias=None):
    _check_scaled_mm_decode("scaled_mm_decode", a, b, scale_a, scale_b, out_dtype, bias)
    return _scaled_mm_reference(a, b, scale_a, scale_b, out_dtype, bias)


def _scaled_mm_decode_out_cpu(out, a, b, scale_a, scale_b, bias=None):
    _check_scaled_mm_decode("scaled_mm_decode", a, b, scale_a, scale_b, out.dtype, bias, out)
    out.copy_(_scaled_mm_reference(a, b, scale_a, scale_b, out.dtype, bias))


def _linear_decode_cpu(x, b, scale_b, bias, dtype):
    _check_linear_decode("linear_decode", x, b, scale_b, bias, dtype)
    return _linear_decode_reference(x, b, scale_b, bias, dtype)


def _linear_decode_out_cpu(out, x, b, scale_b, bias, dtype):
    _check_linear_decode("linear_decode", x, b, scale_b, bias, dtype, out)
    out.copy_(_linear_decode_reference(x, b, scale_b, bias, dtype))


_lib.impl("scaled_mm_decode", _scaled_mm_decode_cpu, "CPU")
_lib.impl("scaled_mm_decode_out", _scaled_mm_decode_out_cpu, "CPU")
_lib.impl("linear_decode", _linear_decode_cpu, "CPU")
_lib.impl("linear_decode_out", _linear_decode_out_cpu, "CPU")


@torch.library.register_fake("cutlass_w8a8::scaled_mm_decode")
def _scaled_mm_decode_fake(a, b, scale_a, scale_b, out_dtype, bias=None):
    _check_scaled_mm_decode("scaled_mm_decode", a, b, scale_a, scale_b, out_dtype, bias)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.register_fake("cutlass_w8a8::scaled_mm_decode_out")
def _scaled_mm_decode_out_fake(out, a, b, scale_a, scale_b, bias=None):
    _check_scaled_mm_decode("scaled_mm_decode", a, b, scale_a, scale_b, out.dtype, bias, out)


@torch.library.register_fake("cutlass_w8a8::linear_decode")
def _linear_decode_fake(x, b, scale_b, bias, dtype):
    _check_linear_decode("linear_decode", x, b, scale_b, bias, dtype)
    return x.new_empty((x.shape[0], b.shape[1]))


@torch.library.register_fake("cutlass_w8a8::linear_decode_out")
def _linear_decode_out_fake(out, x, b, scale_b, bias, dtype):
    _check_linear_decode("linear_decode", x, b, scale_b, bias, dtype, out)


def scaled_mm_decode(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`scaled_mm` for decode batches (M <= 16), written to stream the weights at the memory limit.

    Computes ``D = scale_a * scale_b * (A @ B) + bias`` exactly as :func:`scaled_mm` does: the products
    accumulate exactly in int32 (int8) or in float32 (float8_e4m3fn), then
    ``D = round(scale_a[m] * (scale_b[n] * float(acc)) + bias[n])`` in float32 with one rounding to
    ``out_dtype`` (csrc/gemm/EPILOGUES.md). For int8 the result therefore equals :func:`scaled_mm`'s bit for bit.
    At M <= 16 a GEMM is a stream of the ``N x K`` weight bytes; this kernel keeps every SM streaming (N / 16
    thread blocks of 8 warps, split along K when that is fewer than the SMs) where the CUTLASS kernels behind
    :func:`scaled_mm` run 64 to 96 tiles. Which one a model should call at which shape is for the caller to
    decide from ``bench/bench_decode_gemm.py``.

    Parameters
    ----------
    a : torch.Tensor
        ``(M, K)`` with ``1 <= M <= 16``, int8 or float8_e4m3fn, row-major (``stride(1) == 1``); rows may be
        padded (``stride(0) >= K``, a multiple of 16 elements, e.g. a slice of a wider buffer).
    b : torch.Tensor
        ``(K, N)``, ``a``'s dtype, column-major: the ``(N, K)`` row-major weight passed as ``weight.t()``
        (``stride(1)``, the weight's row pitch, a multiple of 16 and at least K; a column slice of a wider
        weight is fine). K and N positive multiples of 16 (K need not be a multiple of 64); int8 needs
        ``K <= INT8_MAX_K`` (131056), any dtype ``K <= 2**30``.
    scale_a : torch.Tensor
        float32, ``(1,)`` per-tensor or ``(M, 1)`` / ``(M,)`` per-token, contiguous.
    scale_b : torch.Tensor
        float32, ``(1,)`` per-tensor or ``(N,)`` / ``(1, N)`` / ``(N, 1)`` per-channel (the last is what
        compressed-tensors checkpoints store and ``quantize_int8(weight)`` returns), contiguous.
    out_dtype : torch.dtype
        ``torch.bfloat16`` (default) or ``torch.float16``; ignored when ``out`` is given.
    bias : torch.Tensor, optional
        ``(N,)`` in the output dtype, contiguous.
    out : torch.Tensor, optional
        ``(M, N)`` row-major destination (``stride(0)`` a multiple of 8 when M > 1, 16-byte aligned), written
        in place and returned.

    Returns
    -------
    torch.Tensor
        ``(M, N)`` in the output dtype, on ``a``'s device.

    Raises
    ------
    TypeError
        A dtype is wrong (``a``, ``b``, scales, ``bias``, ``out_dtype``, ``out``) or an argument is not a tensor.
    ValueError
        M outside [1, 16], or a shape, layout, alignment or device :func:`scaled_mm` rejects; the message names
        the argument.
    RuntimeError
        CUDA tensors were given but the CUDA extension is not built.
    NotImplementedError
        int8 on a GPU below compute capability 8.0, float8_e4m3fn below 8.9.

    Notes
    -----
    Kernel (csrc/gemm/decode/scaled_mm_decode.cu, csrc/gemm/decode/README.md): tensor-core ``mma.sync`` with 16 weight rows
    on the MMA's M and up to 8 tokens on its N (two token tiles for M > 8). The fragment layouts are those of the
    PTX ISA, "Matrix Fragments for mma.m16n8k32" (int8, and e4m3 on sm89) and "mma.m16n8k16" (f16, on sm90,
    where e4m3 pairs are converted to f16 exactly first): thread ``(g, t) = (lane / 4, lane % 4)`` holds 16
    contiguous K bytes of weight rows ``g`` and ``g + 8`` and of token ``g``; one 128-bit load each, since a dot
    product is unchanged when the same permutation of K is applied to both operands. The grid depends on N, K
    and the SM count only, and M is the kernel's first parameter, so the node of a captured CUDA graph follows
    ``UpdatableGraph.set_rows``. One launch (two when K is split), on the current stream, no host
    synchronization; a split-K workspace comes from the torch caching allocator. On sm90 with PDL on
    (:func:`cutlass_w8a8.set_pdl`) the kernel is launched with programmatic dependent launch and waits on
    ``griddepcontrol.wait`` before reading its inputs.

    fp8 accumulates in float32 tensor-core accumulators in another order than :func:`scaled_mm`'s kernels, so
    fp8 results agree with it to the accumulation bound of csrc/gemm/EPILOGUES.md, not bit for bit.

    Examples
    --------
    >>> x_q, x_s = quantize_int8(x)                  # x: (4, K) bf16 -> per-token int8
    >>> y = scaled_mm_decode(x_q, w_q.t(), x_s, w_s, torch.bfloat16, bias)
    """
    dtype = out.dtype if out is not None else out_dtype
    _check_scaled_mm_decode("scaled_mm_decode", a, b, scale_a, scale_b, dtype, bias, out)
    if a.is_cuda:
        _ext.require_cuda_ops("scaled_mm_decode")
    if out is None:
        return torch.ops.cutlass_w8a8.scaled_mm_decode(a, b, scale_a, scale_b, out_dtype, bias)
    torch.ops.cutlass_w8a8.scaled_mm_decode_out(out, a, b, scale_a, scale_b, bias)
    return out


def linear_decode(
    x: torch.Tensor,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    dtype: Optional[torch.dtype] = None,
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """A W8A8 linear for M <= 16 in one kernel: dynamic per-token quantization of ``x`` and the GEMM.

    Equal bit for bit to ``scaled_mm_decode(*quantize_per_token(x, dtype), b, scale_b, x.dtype, bias)``:
    every thread block computes each row's scale ``max_k |x[m, k]| / QMAX`` (QMAX 127 for int8, 448 for e4m3;
    float32, IEEE division, 0 for a row of zeros) and quantizes ``q = sat(round_half_even(x / scale))``
    exactly as :func:`quantize_int8` / :func:`quantize_fp8` do, then runs :func:`scaled_mm_decode`'s main loop
    and epilogue with ``scale_a = scale``. It saves the quantization kernel's launch and its round trip through
    memory, at the price of every thread block reading the ``M x K`` activations from L2 and repeating the
    ``M x K`` divisions: it wins at small M and loses at larger M (csrc/gemm/decode/README.md, "Crossover";
    ``bench/bench_decode_gemm.py`` measures it). The caller chooses.

    Parameters
    ----------
    x : torch.Tensor
        ``(M, K)`` with ``1 <= M <= 16``, bfloat16 or float16, row-major (``stride(1) == 1``), ``stride(0)`` a
        multiple of 8 elements when M > 1, 16-byte aligned. The output has ``x``'s dtype.
    b : torch.Tensor
        ``(K, N)`` weight in ``dtype``, column-major (``weight.t()`` of the ``(N, K)`` row-major weight); as in
        :func:`scaled_mm_decode`.
    scale_b : torch.Tensor
        float32, ``(1,)`` per-tensor or ``(N,)`` / ``(1, N)`` / ``(N, 1)`` per-channel (the last is what
        compressed-tensors checkpoints store and ``quantize_int8(weight)`` returns), contiguous.
    bias : torch.Tensor, optional
        ``(N,)`` in ``x``'s dtype, contiguous.
    dtype : torch.dtype, optional
        The quantized type, ``torch.int8`` or ``torch.float8_e4m3fn``; must be ``b``'s dtype. Default:
        ``b.dtype``.
    out : torch.Tensor, optional
        ``(M, N)`` row-major destination in ``x``'s dtype, written in place and returned.

    Returns
    -------
    torch.Tensor
        ``(M, N)`` in ``x``'s dtype.

    Raises
    ------
    TypeError
        ``x`` not bfloat16 / float16, ``dtype`` not int8 / float8_e4m3fn or not ``b``'s dtype, ``scale_b`` not
        float32, ``bias`` / ``out`` not in ``x``'s dtype, or an argument that is not a tensor.
    ValueError
        M outside [1, 16], or a wrong shape, layout, alignment or device; the message names the argument.
    RuntimeError
        CUDA tensors were given but the CUDA extension is not built.
    NotImplementedError
        int8 below compute capability 8.0, float8_e4m3fn below 8.9.

    Notes
    -----
    Non-finite values in ``x`` give unspecified results for their row, as in the quantization ops. The CPU
    implementation is the CPU chain ``quantize_per_token`` -> ``scaled_mm`` reference.
    """
    if dtype is None and isinstance(b, torch.Tensor):
        dtype = b.dtype
    _check_linear_decode("linear_decode", x, b, scale_b, bias, dtype, out)
    if x.is_cuda:
        _ext.require_cuda_ops("linear_decode")
    if out is None:
        return torch.ops.cutlass_w8a8.linear_decode(x, b, scale_b, bias, dtype)
    torch.ops.cutlass_w8a8.linear_decode_out(out, x, b, scale_b, bias, dtype)
    return out


def supports_fp8(device=None) -> bool:
    """Whether float8_e4m3fn ``scaled_mm`` can run on ``device`` (default: the current CUDA device).

    True on compute capability 9.0 with the sm90 kernels built (TORCH_CUDA_ARCH_LIST with 9.0a) and on 8.9
    with the sm89 kernels built (8.9 in the list); False otherwise, also without CUDA. Queries the device.
    """
    if not torch.cuda.is_available() or not _ext.cuda_ops_available():
        return False
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) == (9, 0):
        return _ext.kernel_library("_kernels_sm90") is not None
    if (major, minor) == (8, 9):
        return _ext.kernel_library("_kernels_sm89") is not None
    return False


# ----------------------------------------------------------------------------------------------------
# decode_layer: one layer of the reference decoder in one call (csrc/models/decode_layer.cpp)


def _check_decode_layer(residual, qkv_w, qkv_ws, qkv_is, o_w, o_ws, o_is, gate_up_w, gate_up_ws, gate_up_is,
                        down_w, down_ws, down_is, num_heads, num_kv_heads) -> None:
    """The layer-level contract of decode_layer (csrc/models/decode_layer.cpp raises the same messages); each step's
    own op checks the rest."""
    op = "decode_layer"
    projections = (("qkv_w", qkv_w, qkv_ws, qkv_is), ("o_w", o_w, o_ws, o_is),
                   ("gate_up_w", gate_up_w, gate_up_ws, gate_up_is), ("down_w", down_w, down_ws, down_is))
    if not isinstance(residual, torch.Tensor):
        _fail_type(op, "residual", f"must be a torch.Tensor, got {type(residual).__name__}")
    if residual.dtype not in _OUT_DTYPES:
        _fail_type(op, "residual", f"must be bfloat16 or float16, got {residual.dtype}")
    if residual.dim() != 2:
        _fail_value(op, "residual", f"must be 2-D (B, hidden), got shape {tuple(residual.shape)}")
    quantized = qkv_w.dtype in _AB_DTYPES
    for name, w, ws, is_ in projections:
        if quantized:
            if w.dtype != qkv_w.dtype:
                _fail_type(op, name, f"must have qkv_w's dtype {qkv_w.dtype} (all four projections 8-bit alike, or "
                           f"all in the model dtype), got {w.dtype}")
            if ws is None:
                _fail_value(op, name, "is 8-bit: its weight scale must be given")
        else:
            if w.dtype != residual.dtype:
                _fail_type(op, name, f"must have the model dtype {residual.dtype} (all four projections in the "
                           f"model dtype, or all 8-bit alike), got {w.dtype}")
            if ws is not None or is_ is not None:
                _fail_value(op, name, "is not 8-bit: it takes no weight or input scale")
    rows = qkv_w.shape[0]
    d = rows // (num_heads + 2 * num_kv_heads) if num_heads > 0 and num_kv_heads > 0 else 0
    if num_heads <= 0 or num_kv_heads <= 0 or d <= 0 or rows != (num_heads + 2 * num_kv_heads) * d:
        _fail_value(op, "qkv_w", f"must have (num_heads + 2 * num_kv_heads) * head_dim rows, got shape "
                    f"{tuple(qkv_w.shape)} for num_heads = {num_heads}, num_kv_heads = {num_kv_heads}")


def _decode_layer_impl(h, residual, input_norm, post_norm, eps, qkv_w, qkv_ws, qkv_is, o_w, o_ws, o_is, gate_up_w,
                       gate_up_ws, gate_up_is, down_w, down_ws, down_is, kv_cache, rope, slots, positions, num_heads,
                       num_kv_heads, softmax_scale):
    # The same op calls, in the same order, as LlamaDecoderLayer's Python path (the CUDA op calls the same C++
    # functions): so the three agree bit for bit on either device.
    _check_decode_layer(residual, qkv_w, qkv_ws, qkv_is, o_w, o_ws, o_is, gate_up_w, gate_up_ws, gate_up_is,
                        down_w, down_ws, down_is, num_heads, num_kv_heads)
    ops, dtype = torch.ops.cutlass_w8a8, residual.dtype
    quantized = qkv_w.dtype in _AB_DTYPES
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
    attn = ops.decode_attention(qkv[:, :num_heads], kv_cache, slots, positions, softmax_scale)
    attn_out = ops.w8a8_linear(attn, o_w, o_ws, o_is, None, dtype) if quantized else F.linear(attn, o_w)
    if quantized:
        q, s = ops.rms_norm_quant(attn_out, post_norm, eps, qtype, gate_up_is, residual)
    else:
        x = ops.fused_add_rms_norm(attn_out, residual, post_norm, eps)
    gu = project(gate_up_w, gate_up_ws, gate_up_is, x, q, s)
    if quantized:
        q, s = ops.silu_mul_quant(gu, qtype, down_is)
    else:
        x = ops.silu_mul(gu)
    return project(down_w, down_ws, down_is, x, q, s)


_lib.impl("decode_layer", _decode_layer_impl, "CPU")


@torch.library.register_fake("cutlass_w8a8::decode_layer")
def _decode_layer_fake(h, residual, input_norm, post_norm, eps, qkv_w, qkv_ws, qkv_is, o_w, o_ws, o_is, gate_up_w,
                       gate_up_ws, gate_up_is, down_w, down_ws, down_is, kv_cache, rope, slots, positions, num_heads,
                       num_kv_heads, softmax_scale):
    _check_decode_layer(residual, qkv_w, qkv_ws, qkv_is, o_w, o_ws, o_is, gate_up_w, gate_up_ws, gate_up_is,
                        down_w, down_ws, down_is, num_heads, num_kv_heads)
    return residual.new_empty((residual.shape[0], down_w.shape[0]))
