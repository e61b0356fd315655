"""Reference models on cutlass_w8a8 layers: a Llama-style decoder for CUDA-graph decode (`llama`)."""

from . import llama
from .llama import (CONFIGS, LLAMA3_8B, SMALL, DequantizedLinear, LlamaConfig, LlamaDecoder, LlamaDecoderLayer,
                    float_reference, generate_greedy)

__all__ = list(llama.__all__)
