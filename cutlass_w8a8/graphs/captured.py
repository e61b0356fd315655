"""`CapturedGraph`: ``fn(*inputs)`` captured once (`capture`), then ``copy_`` of new inputs and replay."""

from __future__ import annotations

from typing import Callable, ContextManager, Optional, Sequence

import torch

from .capture import capture

__all__ = ["CapturedGraph"]


class CapturedGraph:
    """``fn(*inputs)`` captured into a ``torch.cuda.CUDAGraph`` with static inputs and outputs.

    Parameters
    ----------
    fn : callable
        Takes CUDA tensors and returns a tensor or a tuple of tensors. It must not synchronise the host;
        every cutlass_w8a8 op qualifies.
    example_inputs : sequence of torch.Tensor
        Shapes, dtypes and devices of the static inputs; their values are copied in (the graph reads clones).
    warmup : int
        Eager calls before the capture, on the capture stream (default 3).
    pool : optional
        A graph memory pool handle (``torch.cuda.graph_pool_handle()`` or ``other.graph.pool()``) to share
        memory between several graphs, e.g. one per batch-size bucket.
    stream : torch.cuda.Stream, optional
        The warm-up and capture stream, on the inputs' device; by default a new side stream of that device.

    Attributes
    ----------
    graph : torch.cuda.CUDAGraph
    static_inputs : list of torch.Tensor
        The buffers the graph reads; ``copy_`` into them and `replay` is what a call does.
    static_outputs : torch.Tensor or tuple of torch.Tensor
        What the captured call returned; each replay overwrites them.
    device : torch.device
        The inputs' device: warm-up, capture and replay run there (torch's default capture stream is made
        once, on whichever device was current at the first capture, so it is not used).

    Raises
    ------
    ValueError
        ``example_inputs`` is empty or holds something other than CUDA tensors.

    Notes
    -----
    Calling the object copies its arguments into the static inputs (``copy_``, on the current stream) and
    replays the graph. The returned tensors are the graph's static outputs: the next call overwrites them,
    so clone what must outlive it.
    """

    _name = "CapturedGraph"

    def __init__(self, fn: Callable, example_inputs: Sequence[torch.Tensor], warmup: int = 3,
                 pool=None, stream: Optional[torch.cuda.Stream] = None):
        if not example_inputs or not all(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs):
            raise ValueError(f"{self._name}: `example_inputs` must be a non-empty sequence of CUDA tensors")
        self.fn = fn
        self.static_inputs = [x.detach().clone() for x in example_inputs]
        self.device = self.static_inputs[0].device
        self.graph, self.static_outputs = capture(fn, self.static_inputs, warmup=warmup, pool=pool, stream=stream,
                                                  graph=self._new_graph(), around_capture=self._around_capture())
        self._captured()

    # hooks of UpdatableGraph
    def _new_graph(self) -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph()

    def _around_capture(self) -> Optional[ContextManager]:
        return None

    def _captured(self) -> None:
        pass

    def __call__(self, *inputs: torch.Tensor):
        if len(inputs) != len(self.static_inputs):
            raise ValueError(f"{self._name}: expected {len(self.static_inputs)} inputs, got {len(inputs)}")
        for i, (dst, src) in enumerate(zip(self.static_inputs, inputs)):
            if src.shape != dst.shape:
                raise ValueError(f"{self._name}: input {i} must have shape {tuple(dst.shape)}, got {tuple(src.shape)}")
        with torch.cuda.device(self.device):  # copies and replay on the graph's device's current stream
            for dst, src in zip(self.static_inputs, inputs):
                dst.copy_(src, non_blocking=True)
            self.graph.replay()
        return self.static_outputs
