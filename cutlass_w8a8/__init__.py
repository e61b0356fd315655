"""cutlass_w8a8: W8A8 (int8 / float8) linear layers for PyTorch on CUTLASS kernels, CUDA-graph safe.

Quick start::

    import torch, cutlass_w8a8 as cw
    model = cw.quantize_(model)                 # nn.Linear -> W8A8Linear (int8 weights, per-channel)
    y = model(x)                                # per-token int8 activations, fused-dequant GEMM
    model = cw.from_pretrained("Llama-3-8B-W8A8", device="cuda")  # a compressed-tensors checkpoint

README.md has the quick start; docs/GEMM.md the ops (`scaled_mm`, `quantize_int8`, ...), docs/GRAPHS.md the CUDA-graph
helpers.
"""

from . import ops  # noqa: F401 (defines the op schemas; must come before the compiled implementations load)
from . import _ext

_ext._load()
ops.register_cuda_fallback()  # without _C.so: CUDA tensors get "the CUDA extension is not built" from every op

from ._ext import cuda_ops_available, extension_status, pdl_enabled, set_pdl  # noqa: E402
from .ops import BLOCK_SIZE, DECODE_MAX_M, INT8_MAX_K, supports_fp8  # noqa: E402
from .ops import decode_attention, decode_attention_quant, rope_kv_cache_  # noqa: E402
from .ops import linear_decode, scaled_mm, scaled_mm_decode  # noqa: E402
from .ops import quantize_fp8, quantize_int8, rms_norm, rms_norm_quant, silu_mul, silu_mul_quant  # noqa: E402
from .ops import quantize_per_token_group  # noqa: E402
from .ops import grouped_scaled_mm, moe_align, moe_permute_quant, moe_topk_softmax, moe_unpermute  # noqa: E402
from .ops import moe_decode_experts, moe_route, moe_router_route  # noqa: E402
from .config import W8A8Config  # noqa: E402
from .linear import QuantizedActivation, W8A8Linear  # noqa: E402
from . import moe  # noqa: E402 (registers the MoE experts swap with quantize_)
from .moe import W8A8MoE  # noqa: E402
from . import checkpoints, distributed, graphs, models, runner  # noqa: E402
# quantize_ / tensor_parallel_ are api's: the module swap (cutlass_w8a8.quantize.quantize_), then tensor
# parallelism and the checkpoint annotation, which live in the layers above quantize.py
from .api import quantize_, tensor_parallel_  # noqa: E402
from . import hf  # noqa: E402
# from_pretrained / save_pretrained are hf's: the checkpoint loader then optimize_ (optimize=True by default), and the
# unfused layout for saving (checkpoints/ sits below hf/ and cannot call it)
from .hf import from_pretrained, generate, optimize_, save_pretrained, unoptimize_  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "scaled_mm",
    "scaled_mm_decode",
    "linear_decode",
    "DECODE_MAX_M",
    "quantize_int8",
    "quantize_fp8",
    "quantize_per_token_group",
    "BLOCK_SIZE",
    "decode_attention",
    "decode_attention_quant",
    "rope_kv_cache_",
    "rms_norm",
    "rms_norm_quant",
    "silu_mul",
    "silu_mul_quant",
    "grouped_scaled_mm",
    "moe_topk_softmax",
    "moe_route",
    "moe_router_route",
    "moe_align",
    "moe_permute_quant",
    "moe_unpermute",
    "moe_decode_experts",
    "supports_fp8",
    "INT8_MAX_K",
    "W8A8Linear",
    "QuantizedActivation",
    "W8A8Config",
    "W8A8MoE",
    "moe",
    "quantize_",
    "tensor_parallel_",
    "from_pretrained",
    "save_pretrained",
    "checkpoints",
    "distributed",
    "graphs",
    "models",
    "runner",
    "hf",
    "optimize_",
    "unoptimize_",
    "generate",
    "cuda_ops_available",
    "extension_status",
    "pdl_enabled",
    "set_pdl",
]
