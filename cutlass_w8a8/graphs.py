"""CUDA-graph capture helpers: warm up on a side stream, capture, then copy new inputs in and replay.

The pattern is the one flash-attention's decoding helper and vLLM's model runner use: static input buffers
that the graph reads, a warm-up outside the capture (so lazy initialisation, autotuning and allocator growth
do not happen inside it), an optional shared memory pool, and `copy_` of fresh inputs before each replay.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

__all__ = ["CapturedGraph"]


class CapturedGraph:
    """``fn(*inputs)`` captured into a ``torch.cuda.CUDAGraph`` with static inputs and outputs.

    Parameters
    ----------
    fn : callable
        Takes CUDA tensors and returns a tensor or a tuple of tensors. It must not synchronise the host;
        every cutlass_w8a8 op qualifies.
    example_inputs : sequence of torch.Tensor
        Shapes, dtypes and devices of the static inputs; their values are copied in.
    warmup : int
        Eager calls on a side stream before the capture (default 3).
    pool : optional
        A graph memory pool handle (``torch.cuda.graph_pool_handle()`` or ``other.graph.pool()``) to share
        memory between several graphs, e.g. one per batch-size bucket.
    stream : torch.cuda.Stream, optional
        The capture stream, on the inputs' device; by default a side stream of that device.

    Notes
    -----
    Calling the object copies its arguments into the static inputs (``copy_``, on the current stream) and
    replays the graph. The returned tensors are the graph's static outputs: the next call overwrites them,
    so clone what must outlive it.
    """

    def __init__(self, fn: Callable, example_inputs: Sequence[torch.Tensor], warmup: int = 3,
                 pool=None, stream: Optional[torch.cuda.Stream] = None):
        if not example_inputs or not all(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs):
            raise ValueError("CapturedGraph: `example_inputs` must be a non-empty sequence of CUDA tensors")
        self.fn = fn
        self.static_inputs = [x.detach().clone() for x in example_inputs]
        self.device = device = self.static_inputs[0].device
        # Everything on the inputs' device: its current stream, a side stream of its own, and a capture
        # stream of its own (torch's default capture stream is made once, on whichever device was current at
        # the first capture, so an input on cuda:1 would otherwise be captured from cuda:0's stream).
        with torch.cuda.device(device):
            side = torch.cuda.Stream(device=device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    fn(*self.static_inputs)
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool, stream=stream if stream is not None else side):
                self.static_outputs = fn(*self.static_inputs)

    def __call__(self, *inputs: torch.Tensor):
        if len(inputs) != len(self.static_inputs):
            raise ValueError(f"CapturedGraph: expected {len(self.static_inputs)} inputs, got {len(inputs)}")
        for i, (dst, src) in enumerate(zip(self.static_inputs, inputs)):
            if src.shape != dst.shape:
                raise ValueError(f"CapturedGraph: input {i} must have shape {tuple(dst.shape)}, got {tuple(src.shape)}")
        with torch.cuda.device(self.device):  # copies and replay on the graph's device's current stream
            for dst, src in zip(self.static_inputs, inputs):
                dst.copy_(src, non_blocking=True)
            self.graph.replay()
        return self.static_outputs
