"""The quantization ops' public wrappers: `quantize_int8` and `quantize_fp8` (ops ``quantize_per_token`` and
``quantize_per_tensor``).

Each wrapper calls its op once and returns; the op checks its arguments (C++ on CUDA, `_checks.py` on the CPU
and in the fake kernels) and raises errors that name the op and the argument (docs/MISUSE.md).
"""

from __future__ import annotations

from typing import Optional

import torch
from ._schema import OVERLOADS as _op

__all__ = ["quantize_int8", "quantize_fp8"]


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
