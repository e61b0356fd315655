"""`W8A8Config`: how `quantize_` quantizes each `nn.Linear` (torchao's config-object shape)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .ops._limits import AB_DTYPES, OUT_DTYPES

__all__ = ["W8A8Config"]


@dataclasses.dataclass(frozen=True)
class W8A8Config:
    """How `quantize_` quantizes each `nn.Linear`.

    Attributes
    ----------
    dtype : torch.dtype
        ``torch.int8`` (default) or ``torch.float8_e4m3fn``, for both weights and activations.
    out_dtype : torch.dtype, optional
        Output (and bias) dtype of the quantized layers, bfloat16 or float16. Default: the layer's weight
        dtype when it is one of those, else bfloat16; outputs are cast back to the input's dtype.
    """

    dtype: torch.dtype = torch.int8
    out_dtype: Optional[torch.dtype] = None

    def __post_init__(self):
        if self.dtype not in AB_DTYPES:
            raise TypeError(f"W8A8Config: `dtype` must be torch.int8 or torch.float8_e4m3fn, got {self.dtype}")
        if self.out_dtype is not None and self.out_dtype not in OUT_DTYPES:
            raise TypeError(f"W8A8Config: `out_dtype` must be torch.bfloat16 or torch.float16, got {self.out_dtype}")
