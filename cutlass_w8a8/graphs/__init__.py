"""CUDA graphs of cutlass_w8a8 ops: the one warm-up + capture (`capture`), replay with new inputs
(`CapturedGraph`) and in-place updates of the captured kernels (`UpdatableGraph`, `GraphNode`).

The pattern is the one flash-attention's decoding helper and vLLM's model runner use: static input buffers
that the graph reads, a warm-up outside the capture (so lazy initialisation, autotuning and allocator growth
do not happen inside it), an optional shared memory pool, and `copy_` of fresh inputs before each replay.
"""

from .capture import capture
from .captured import CapturedGraph
from .updatable import GraphNode, UpdatableGraph

__all__ = ["CapturedGraph", "UpdatableGraph", "GraphNode", "capture"]
