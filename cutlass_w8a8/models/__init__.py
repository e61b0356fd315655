"""Reference models on cutlass_w8a8 layers: a Llama-style decoder for CUDA-graph decode.

Modules: `config` (`LlamaConfig`, `SMALL`, `LLAMA3_8B`, `QWEN3_30B_A3B`), `llama` (the decoder), `layers` (its
decoder-layer modules and `StepContext`, public: `cutlass_w8a8.hf.DecodeStep` runs them over other weights),
`moe` (the Qwen3-MoE sparse block and its float experts), `reference` (float references for tests), `generation`
(`generate_greedy`).
"""

from . import config, generation, layers, llama, moe, reference
from .config import CONFIGS, LLAMA3_8B, QWEN3_30B_A3B, SMALL, LlamaConfig
from .generation import generate_greedy
from .layers import LlamaAttention, LlamaDecoderLayer, LlamaMLP, RMSNorm, StepContext
from .llama import LlamaDecoder
from .moe import MoEExperts, SparseMoeBlock
from .reference import DequantizedLinear, DequantizedMoE, float_reference

__all__ = [
    "CONFIGS",
    "LLAMA3_8B",
    "QWEN3_30B_A3B",
    "SMALL",
    "DequantizedLinear",
    "DequantizedMoE",
    "LlamaConfig",
    "LlamaAttention",
    "LlamaDecoder",
    "LlamaDecoderLayer",
    "LlamaMLP",
    "RMSNorm",
    "StepContext",
    "MoEExperts",
    "SparseMoeBlock",
    "float_reference",
    "generate_greedy",
]
