"""The fused row-wise ops' public wrappers: `rms_norm`, `rms_norm_quant`, `silu_mul`, `silu_mul_quant`.

Each wrapper calls its op once and returns; the op checks its arguments (C++ on CUDA, `_checks.py` on the CPU
and in the fake kernels) and raises errors that name the op and the argument (docs/MISUSE.md).
"""

from __future__ import annotations

from typing import Optional

import torch
from ._schema import OVERLOADS as _op

__all__ = ["rms_norm", "rms_norm_quant", "silu_mul", "silu_mul_quant"]


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
        ``x``, ``weight`` or ``residual`` has the wrong dtype.
    ValueError
        A shape, layout or device is wrong, ``K`` is 0, or ``eps`` is negative or not finite; the message
        names the op (``fused_add_rms_norm`` when ``residual`` is given) and the argument.
    RuntimeError
        An argument is not of its schema type (a non-tensor, an ``eps`` that is not a number: torch's
        dispatcher names it); CUDA tensors were given but the CUDA extension is not built.

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
    if residual is None:
        return _op.rms_norm(x, weight, eps)
    return _op.fused_add_rms_norm(x, residual, weight, eps)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype,
                   scale: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
                   group_size: int = 0):
    """`rms_norm` (with the optional in-place residual add) fused with activation quantization.

    ``y`` is computed exactly as by :func:`rms_norm`, rounded to ``x``'s dtype, and then quantized as
    :func:`quantize_int8` / :func:`quantize_fp8` quantize a stored ``y``: dynamic per token
    (``scale = max|y| / QMAX`` per row, QMAX 127 or 448) when ``scale`` is None, else static per tensor with
    ``scale``; with ``group_size=128``, dynamic per 1 x 128 group of each row as
    :func:`quantize_per_token_group` (the activations of a block-scaled fp8 `W8A8Linear`, whose ``group_size``
    attribute says which to pass). The rounding of ``y`` to ``x``'s dtype before quantizing is deliberate: it
    makes ``rms_norm_quant`` equal the unfused chain ``rms_norm`` -> ``quantize_*`` bit for bit (on the GPU: the
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
        float32 with one element (static per-tensor), on ``x``'s device. None: dynamic per-token (or per group).
    group_size : int
        0 (default): per-token (or per-tensor with ``scale``). 128: dynamic per 1 x 128 group; K must be a
        multiple of 128 and ``scale`` None.

    Returns
    -------
    (q, scale) : tuple of torch.Tensor
        ``q``: ``dtype``, ``x``'s shape, contiguous. ``scale``: float32 ``(..., 1)`` per-token scales
        (dynamic), ``(..., K / 128)`` per-group scales (``group_size=128``), or the given ``scale`` object
        (static), as :func:`quantize_int8` / :func:`quantize_per_token_group` return them.

    Raises
    ------
    TypeError
        As :func:`rms_norm`; ``dtype`` is not int8 / float8_e4m3fn; ``scale`` is not float32.
    ValueError
        As :func:`rms_norm`; ``scale`` is not one element or is on another device; ``group_size`` is not 0 or
        128; with ``group_size=128``, ``scale`` is given or K is not a multiple of 128.

    Notes
    -----
    A row with a non-finite ``y`` (see :func:`rms_norm`) gets an unspecified ``q`` and scale, as the
    quantization ops document; other rows are unaffected. The op itself
    (``torch.ops.cutlass_w8a8.rms_norm_quant``) returns per-row scales in both modes: in the static one the
    given value repeated, ``(..., 1)``.
    """
    q, s = _op.rms_norm_quant(x, weight, eps, dtype, scale, residual, group_size)
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
    return _op.silu_mul(x)


def silu_mul_quant(x: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor] = None,
                   group_size: int = 0):
    """:func:`silu_mul` fused with activation quantization (the input of a W8A8 ``down_proj``).

    ``y = silu(gate) * up`` as :func:`silu_mul` computes it, rounded to ``x``'s dtype, then quantized as
    :func:`quantize_int8` / :func:`quantize_fp8` quantize a stored ``y``: dynamic per token when ``scale`` is
    None, else static per tensor; with ``group_size=128`` dynamic per 1 x 128 group of ``y``'s rows as
    :func:`quantize_per_token_group` (I a multiple of 128, ``scale`` None). Equal to the unfused chain
    ``silu_mul`` -> ``quantize_*`` bit for bit on the same device. One kernel launch: one block per row, or on sm90 a cluster of up to 8 for long rows.

    Parameters
    ----------
    x : torch.Tensor
        ``(..., 2 * I)`` ``[gate | up]``, bfloat16, float16 or float32, ``I > 0``.
    dtype, scale, group_size
        As :func:`rms_norm_quant`: the quantized dtype, the static per-tensor scale or None (dynamic), and 0
        (per-token) or 128 (per 1 x 128 group of the output row).

    Returns
    -------
    (q, scale) : tuple of torch.Tensor
        ``q``: ``dtype``, ``(..., I)``, contiguous. ``scale``: float32 ``(..., 1)`` (dynamic), ``(..., I / 128)``
        (``group_size=128``), or the given ``scale`` object (static).

    Raises
    ------
    TypeError
        ``x``, ``dtype`` or ``scale`` has the wrong dtype (a non-tensor is torch's dispatcher ``RuntimeError``).
    ValueError
        ``x``'s last dimension is 0 or odd; ``scale`` is not one element or is on another device; ``group_size``
        is not 0 or 128; with ``group_size=128``, ``scale`` is given or I is not a multiple of 128.

    Notes
    -----
    A row with a non-finite ``y`` gets an unspecified ``q`` and scale; other rows are unaffected. The op
    itself returns per-row scales in both modes (static: the given value repeated, ``(..., 1)``).
    """
    q, s = _op.silu_mul_quant(x, dtype, scale, group_size)
    return q, (s if scale is None else scale)
