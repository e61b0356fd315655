"""`W8A8Config`: how `quantize_` quantizes each `nn.Linear` (torchao's config-object shape)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .ops._checks import check_fp8_fast_accum
from .ops._limits import AB_DTYPES, BLOCK_SIZE, FP8_FAST_ACCUM, OUT_DTYPES

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
    fp8_fast_accum : bool
        Row-wise fp8 (``dtype=torch.float8_e4m3fn`` without ``weight_block_size``) on sm90: True runs the
        fast-accumulation GEMMs (the tensor cores' partial sums kept over the whole K loop), False the accurate ones
        (promoted into float32 every 128 of K). Measured, bf16 output, relative Frobenius error against float64: fast
        4.3-4.5e-3 (H100) / 3.5e-3 (H200), growing with K; accurate within the output rounding (1.7e-3), as block
        fp8 and the decode GEMM; accurate costs 1.09x (M = 1024) / 1.05x (M = 4096) the fast GEMMs' time (H200,
        Llama-3-70B shapes). Ignored by int8 (exact) and block fp8 (always promoted). Default
        ``cutlass_w8a8.ops._limits.FP8_FAST_ACCUM`` (True); the layers keep it as ``W8A8Linear.fp8_fast_accum``.
        A runtime choice: not written into checkpoints.

    Raises
    ------
    TypeError
        ``dtype`` or ``out_dtype`` is not supported, or ``fp8_fast_accum`` is not a bool.
    ValueError
        ``weight_block_size`` is not None or (128, 128), or is given with ``dtype`` other than
        float8_e4m3fn.
    """

    dtype: torch.dtype = torch.int8
    out_dtype: Optional[torch.dtype] = None
    weight_block_size: Optional[tuple] = None
    fp8_fast_accum: bool = FP8_FAST_ACCUM

    def __post_init__(self):
        check_fp8_fast_accum("W8A8Config", self.fp8_fast_accum)
        if self.dtype not in AB_DTYPES:
            raise TypeError(f"W8A8Config: `dtype` must be torch.int8 or torch.float8_e4m3fn, got {self.dtype}")
        if self.out_dtype is not None and self.out_dtype not in OUT_DTYPES:
            raise TypeError(f"W8A8Config: `out_dtype` must be torch.bfloat16 or torch.float16, got {self.out_dtype}")
        object.__setattr__(self, "weight_block_size",
                           self.check_weight_block_size("W8A8Config", self.weight_block_size, self.dtype))

    @staticmethod
    def check_weight_block_size(where: str, weight_block_size, dtype: torch.dtype,
                                dtype_arg: str = "dtype") -> Optional[tuple]:
        """The one validation of ``weight_block_size``, shared by this config and the layers that take it apart
        (`W8A8Linear`'s constructor and ``from_quantized``, which ask here): None, or ``(128, 128)`` (a list
        ``[128, 128]`` accepted) with ``dtype`` float8_e4m3fn. ``where`` and ``dtype_arg`` (the caller's name of the
        quantized dtype: ``"dtype"``, ``"quant_dtype"``) name the caller and its argument in the messages; ``dtype``
        None skips the dtype rule (a caller that checks its operand's dtype itself).

        Returns ``weight_block_size`` as a tuple, or None.

        Raises
        ------
        ValueError
            ``weight_block_size`` is neither None nor (128, 128), or is given with a ``dtype`` other than
            float8_e4m3fn.
        """
        if weight_block_size is None:
            return None
        block = tuple(weight_block_size) if isinstance(weight_block_size, (list, tuple)) else None
        if block != (BLOCK_SIZE, BLOCK_SIZE):
            raise ValueError(f"{where}: `weight_block_size` must be None or ({BLOCK_SIZE}, {BLOCK_SIZE}), got "
                             f"{weight_block_size!r}")
        if dtype is not None and dtype != torch.float8_e4m3fn:
            raise ValueError(f"{where}: `weight_block_size` needs {dtype_arg}=torch.float8_e4m3fn (block scales are fp8 "
                             f"only), got {dtype_arg} {dtype}")
        return block
