"""`W8A8Config`: how `quantize_` quantizes each `nn.Linear` (torchao's config-object shape)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .ops._limits import AB_DTYPES, BLOCK_SIZE, OUT_DTYPES

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
    weight_block_size : tuple of int, optional
        ``(128, 128)``: block-scaled fp8 (DeepSeek-V3 / compressed-tensors ``FP8_BLOCK``): one weight scale per
        128 x 128 block, float32 ``(ceil(N / 128), K / 128)``, and activations quantized per 1 x 128 group at
        run time; needs ``dtype=torch.float8_e4m3fn``, and linears whose K is a multiple of 128 (others are left
        in float by `quantize_`). A list ``[128, 128]`` (a checkpoint config's) is accepted and stored as a tuple.
        None (default): per-channel weight scales, per-token activations.

    Raises
    ------
    TypeError
        ``dtype`` or ``out_dtype`` is not supported.
    ValueError
        ``weight_block_size`` is not None or (128, 128), or is given with ``dtype`` other than
        float8_e4m3fn.
    """

    dtype: torch.dtype = torch.int8
    out_dtype: Optional[torch.dtype] = None
    weight_block_size: Optional[tuple] = None

    def __post_init__(self):
        if self.dtype not in AB_DTYPES:
            raise TypeError(f"W8A8Config: `dtype` must be torch.int8 or torch.float8_e4m3fn, got {self.dtype}")
        if self.out_dtype is not None and self.out_dtype not in OUT_DTYPES:
            raise TypeError(f"W8A8Config: `out_dtype` must be torch.bfloat16 or torch.float16, got {self.out_dtype}")
        if self.weight_block_size is not None:
            block = tuple(self.weight_block_size) if isinstance(self.weight_block_size, (list, tuple)) else None
            if block != (BLOCK_SIZE, BLOCK_SIZE):
                raise ValueError(f"W8A8Config: `weight_block_size` must be None or ({BLOCK_SIZE}, {BLOCK_SIZE}), "
                                 f"got {self.weight_block_size!r}")
            if self.dtype != torch.float8_e4m3fn:
                raise ValueError("W8A8Config: `weight_block_size` needs dtype=torch.float8_e4m3fn (block scales are "
                                 f"fp8 only), got dtype {self.dtype}")
            object.__setattr__(self, "weight_block_size", block)
