"""The cutlass_w8a8 ops: schemas, CPU reference implementations, fake kernels and typed wrappers.

The schemas live here (not in C++) so that a CPU-only install, which compiles nothing, still has the ops with
their reference implementations; `_C.so` adds the CUDA kernels when it is built (csrc/bindings.cpp).

Ops in the ``torch.ops.cutlass_w8a8`` namespace:

- ``scaled_mm(a, b, scale_a, scale_b, out_dtype, bias=None) -> Tensor``
- ``scaled_mm_out(out, a, b, scale_a, scale_b, bias=None) -> ()``
- ``quantize_per_token(x, dtype) -> (q, scale)``
- ``quantize_per_tensor(x, scale, dtype) -> q``
- ``_scaled_mm_config(out, a, b, scale_a, scale_b, bias, config) -> ()``: force a kernel config (tuning only)

Use the wrappers below: they check their arguments and raise ``TypeError`` (wrong dtype) or ``ValueError``
(wrong shape, layout, device or value) naming the argument. The C++ side repeats the checks, so direct
``torch.ops`` calls get the same errors.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _ext

__all__ = ["scaled_mm", "quantize_int8", "quantize_fp8", "supports_fp8", "INT8_MAX_K"]

# int8 products are at most 128 * 128 = 2**14 in magnitude, so an int32 sum of K of them cannot overflow
# while K * 2**14 <= 2**31 - 1, i.e. K <= 131071; the largest multiple of 16 below that is 131056.
INT8_MAX_K = (2**31 - 1) // (128 * 128) // 16 * 16

_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_AB_DTYPES = (torch.int8, torch.float8_e4m3fn)
_OUT_DTYPES = (torch.bfloat16, torch.float16)
_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_lib = torch.library.Library("cutlass_w8a8", "DEF")  # noqa: TOR901 (one definition block for the namespace)
_lib.define("scaled_mm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, ScalarType out_dtype, "
            "Tensor? bias=None) -> Tensor")
_lib.define("scaled_mm_out(Tensor(a!) out, Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, "
            "Tensor? bias=None) -> ()")
_lib.define("_scaled_mm_config(Tensor(a!) out, Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, "
            "Tensor? bias, int config) -> ()")
_lib.define("quantize_per_token(Tensor x, ScalarType dtype) -> (Tensor, Tensor)")
_lib.define("quantize_per_tensor(Tensor x, Tensor scale, ScalarType dtype) -> Tensor")


# ----------------------------------------------------------------------------------------------------
# argument checks (shared by the wrappers, the CPU reference and the fake kernels)


def _fail_type(op: str, arg: str, msg: str) -> None:
    raise TypeError(f"{op}: `{arg}` {msg}")


def _fail_value(op: str, arg: str, msg: str) -> None:
    raise ValueError(f"{op}: `{arg}` {msg}")


def _misaligned(t: torch.Tensor, nbytes: int) -> bool:
    # The storage itself comes from an allocator that aligns to >= 256 bytes; a view's offset can break it.
    return (t.storage_offset() * t.element_size()) % nbytes != 0


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
    sb_ok = scale_b.numel() == 1 or tuple(scale_b.shape) in ((n,), (1, n))
    if not sb_ok:
        _fail_value(op, "scale_b", f"must be [1] (per-tensor), [N] or [1, N] (per-channel) with N = {n}, "
                    f"got shape {tuple(scale_b.shape)}")
    if not scale_a.is_contiguous():
        _fail_value(op, "scale_a", "must be contiguous")
    if not scale_b.is_contiguous():
        _fail_value(op, "scale_b", "must be contiguous")
    if bias is not None:
        if tuple(bias.shape) != (n,):
            _fail_value(op, "bias", f"must be [N] with N = {n}, got shape {tuple(bias.shape)}")
        if not bias.is_contiguous():
            _fail_value(op, "bias", "must be contiguous")

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


# ----------------------------------------------------------------------------------------------------
# CPU reference implementations: the kernels' arithmetic, in the kernels' order (csrc/EPILOGUES.md)


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


_lib.impl("scaled_mm", _scaled_mm_cpu, "CPU")
_lib.impl("scaled_mm_out", _scaled_mm_out_cpu, "CPU")
_lib.impl("_scaled_mm_config", _scaled_mm_config_cpu, "CPU")
_lib.impl("quantize_per_token", _quantize_per_token_cpu, "CPU")
_lib.impl("quantize_per_tensor", _quantize_per_tensor_cpu, "CPU")


# ----------------------------------------------------------------------------------------------------
# fake (meta) kernels, for torch.compile and opcheck


@torch.library.register_fake("cutlass_w8a8::scaled_mm")
def _scaled_mm_fake(a, b, scale_a, scale_b, out_dtype, bias=None):
    _check_scaled_mm("scaled_mm", a, b, scale_a, scale_b, out_dtype, bias)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.register_fake("cutlass_w8a8::scaled_mm_out")
def _scaled_mm_out_fake(out, a, b, scale_a, scale_b, bias=None):
    _check_scaled_mm("scaled_mm", a, b, scale_a, scale_b, out.dtype, bias, out)


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
    (csrc/EPILOGUES.md).

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
        float32, ``(1,)`` per-tensor or ``(N,)`` / ``(1, N)`` per-channel, contiguous.
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
