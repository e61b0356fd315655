"""Reference models on cutlass_w8a8 layers: a Llama-style decoder for CUDA-graph decode.

Modules: `config` (`LlamaConfig`, `SMALL`, `LLAMA3_8B`), `llama` (the decoder and its layers), `reference`
(float references for tests), `generation` (`generate_greedy`).
"""

from . import config, generation, llama, reference
from .config import CONFIGS, LLAMA3_8B, SMALL, LlamaConfig
from .generation import generate_greedy
from .llama import LlamaDecoder, LlamaDecoderLayer
from .reference import DequantizedLinear, float_reference

__all__ = [
    "CONFIGS",
    "LLAMA3_8B",
    "SMALL",
    "DequantizedLinear",
    "LlamaConfig",
    "LlamaDecoder",
    "LlamaDecoderLayer",
    "float_reference",
    "generate_greedy",
]
