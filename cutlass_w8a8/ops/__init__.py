"""The cutlass_w8a8 ops: schemas (`_schema`), limits (`_limits`), argument checks (`_checks`, by operand role in
`_roles`), CPU implementations (`_reference`), fake kernels (`_fake`), and the public wrappers by family:
`gemm` (scaled_mm, scaled_mm_decode, linear_decode, add_rms_norm_linear_decode, supports_fp8), `quant` (quantize_int8, quantize_fp8,
quantize_per_token_group),
`norm_act` (rms_norm, rms_norm_quant, silu_mul, silu_mul_quant), `attention` (decode_attention,
decode_attention_quant, rope_kv_cache_).

Importing this package defines every op of ``torch.ops.cutlass_w8a8`` with its CPU and fake kernels;
``cutlass_w8a8/__init__.py`` then loads `_C.so` (the CUDA kernels) and, if that failed, calls
`register_cuda_fallback`. The op list is in `_schema`'s docstring.
"""

from . import _schema  # noqa: I001 (the schemas first: the implementations below register against them)
from . import _fake, _reference  # noqa: F401 (register the CPU and fake kernels)
from ._checks import check_scaled_mm
from ._limits import BLOCK_SIZE, DECODE_MAX_M, INT8_MAX_K
from ._schema import register_cuda_fallback
from .attention import decode_attention, decode_attention_quant, rope_kv_cache_
from .gemm import add_rms_norm_linear_decode, linear_decode, scaled_mm, scaled_mm_decode, supports_fp8
from .moe import (add_rms_norm_moe_router_route, grouped_scaled_mm, moe_align, moe_decode_experts, moe_permute_quant, moe_route, moe_router_route,
                  moe_topk_softmax, moe_unpermute)
from .norm_act import rms_norm, rms_norm_quant, silu_mul, silu_mul_quant
from .quant import quantize_fp8, quantize_int8, quantize_per_token_group

__all__ = ["scaled_mm", "scaled_mm_decode", "linear_decode", "add_rms_norm_linear_decode", "supports_fp8", "quantize_int8", "quantize_fp8",
           "quantize_per_token_group", "BLOCK_SIZE",
           "rms_norm", "rms_norm_quant", "silu_mul", "silu_mul_quant", "decode_attention", "decode_attention_quant",
           "rope_kv_cache_", "grouped_scaled_mm", "moe_topk_softmax", "moe_route", "moe_router_route", "add_rms_norm_moe_router_route", "moe_align", "moe_permute_quant", "moe_unpermute", "moe_decode_experts", "INT8_MAX_K", "DECODE_MAX_M", "check_scaled_mm", "register_cuda_fallback"]
