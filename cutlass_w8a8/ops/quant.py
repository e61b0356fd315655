"""The quantization ops' public wrappers: `quantize_int8` and `quantize_fp8` (ops ``quantize_per_token`` and
``quantize_per_tensor``), and `quantize_per_token_group` (block-scaled fp8 activations).

Each wrapper calls its op once and returns; the op checks its arguments (C++ on CUDA, `_checks.py` on the CPU
and in the fake kernels) and raises errors that name the op and the argument (docs/MISUSE.md).
"""

from __future__ import annotations

from typing import Optional

import torch
from ._schema import OVERLOADS as _op

__all__ = ["quantize_int8", "quantize_fp8", "quantize_per_token_group"]


def _quantize(x: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype):
    if scale is None:
        return _op.quantize_per_token(x, dtype)
    return _op.quantize_per_tensor(x, scale, dtype), scale


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
        ``x`` has no dimension; ``scale`` is not one element or is on another device. The messages name the op
        called: ``quantize_per_token`` (dynamic) or ``quantize_per_tensor`` (static).
    RuntimeError
        ``x`` or ``scale`` is not a tensor (torch's dispatcher names it); CUDA tensors were given but the CUDA
        extension is not built.
    """
    return _quantize(x, scale, torch.int8)


def quantize_fp8(x: torch.Tensor, scale: Optional[torch.Tensor] = None):
    """Quantize activations to float8_e4m3fn: dynamic per-token, or static per-tensor with ``scale``.

    Dynamic: ``scale = max_k |x[..., k]| / 448`` (448 is the largest finite e4m3fn) and
    ``q = e4m3fn(clamp(x / scale, -448, 448))`` rounded to nearest even, in float32; a row of zeros gets
    scale 0. Static: the same with the given scale, saturating to +-448 rather than producing NaN.

    Parameters, returns and errors as :func:`quantize_int8`, with ``q`` of dtype ``torch.float8_e4m3fn``.
    """
    return _quantize(x, scale, torch.float8_e4m3fn)


def quantize_per_token_group(x: torch.Tensor, group_size: int = 128, dtype: torch.dtype = torch.float8_e4m3fn):
    """Quantize activations dynamically per 1 x ``group_size`` group along K: the activation side of block-scaled
    fp8 GEMMs (DeepSeek-V3's format: 1x128 activation groups against 128x128 weight blocks; transformers'
    ``finegrained_fp8``, compressed-tensors' ``FP8_BLOCK`` with ``group_size: 128`` input activations).

    For each row m and group g (columns ``g * group_size`` to ``(g + 1) * group_size - 1``):
    ``scale[m, g] = max |x[m, group g]| / QMAX`` (QMAX 448 for float8_e4m3fn, 127 for int8; float32, IEEE
    division) and ``q = sat(round_half_even(x / scale[m, g]))`` in float32, the rules of :func:`quantize_fp8` /
    :func:`quantize_int8` applied per group; a group of zeros gets scale 0 and q = 0. One kernel launch on CUDA,
    no host synchronisation. ``scaled_mm(q, weight.t(), scale, weight_scale, ...)`` takes the result as its
    block-scaled ``a`` / ``scale_a``. Non-finite inputs give unspecified results for their group.

    Parameters
    ----------
    x : torch.Tensor
        ``(M, K)`` (leading dimensions ``(..., K)`` are accepted as rows), bfloat16, float16 or float32; rows
        need not be packed (the layouts :func:`quantize_fp8` accepts). K must be a multiple of ``group_size``.
    group_size : int
        The group length along K; only 128 (`cutlass_w8a8.ops._limits.BLOCK_SIZE`).
    dtype : torch.dtype
        ``torch.float8_e4m3fn`` (default, what block-scaled ``scaled_mm`` takes) or ``torch.int8``.

    Returns
    -------
    (q, scale) : tuple of torch.Tensor
        ``q``: ``dtype``, ``x``'s shape, contiguous. ``scale``: float32 ``(M, K / group_size)`` (``(...,
        K / group_size)``), contiguous; ``x[m, k] ~= q[m, k] * scale[m, k // group_size]``.

    Raises
    ------
    TypeError
        ``x`` is not bfloat16 / float16 / float32; ``dtype`` is not int8 / float8_e4m3fn.
    ValueError
        ``x`` has no dimension; ``group_size`` is not 128; K is not a multiple of ``group_size``. The messages
        name ``quantize_per_token_group`` and the argument (docs/MISUSE.md).
    RuntimeError
        ``x`` is not a tensor or ``group_size`` not an int (torch's dispatcher names it); CUDA tensors were
        given but the CUDA extension is not built.

    Examples
    --------
    >>> q, s = quantize_per_token_group(x)           # x: (M, K) bf16 -> e4m3 (M, K), s (M, K / 128)
    >>> y = scaled_mm(q, w_q.t(), s, w_s, torch.bfloat16)   # w_s: (ceil(N / 128), K / 128)
    """
    return _op.quantize_per_token_group(x, group_size, dtype)
