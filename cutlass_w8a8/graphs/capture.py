"""`capture`: the one warm-up + CUDA-graph capture of cutlass_w8a8 (graphs, the decode runner, the bench timers).

The pattern is the one flash-attention's decoding helper and vLLM's model runner use: a few eager calls on a
side stream first (lazy initialisation, kernel selection, allocator growth and per-stream workspaces happen
there, outside the capture), then the capture on that same stream, optionally into a shared memory pool.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch

__all__ = ["capture"]


def capture(fn: Callable, inputs: Sequence[Any] = (), *, warmup: int = 3, pool=None,
            stream: Optional[torch.cuda.Stream] = None, graph: Optional[torch.cuda.CUDAGraph] = None,
            around_capture: Optional[ContextManager] = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm ``fn(*inputs)`` up on a side stream, then capture one call of it into a CUDA graph.

    Steps, all under ``torch.cuda.device(device)``: the side stream waits for the device's current stream;
    ``warmup`` eager calls ``fn(*inputs)`` run on it; the current stream waits for them; one call is captured
    with ``torch.cuda.graph(graph, pool=pool, stream=side)``. The graph is not replayed.

    Parameters
    ----------
    fn : callable
        Called as ``fn(*inputs)``; must not synchronise the host while capturing (every cutlass_w8a8 op
        qualifies). Its return value is the graph's static output.
    inputs : sequence
        The arguments, passed as they are (the static input buffers: later replays read them). ``device`` is
        the device of the first CUDA tensor among them, else that of ``stream``, else the current device.
    warmup : int
        Eager calls before the capture (default 3; 0: none).
    pool : optional
        A graph memory pool (``torch.cuda.graph_pool_handle()`` or ``other_graph.pool()``) shared with other
        graphs, e.g. one per batch-size bucket; default: a private pool.
    stream : torch.cuda.Stream, optional
        The side stream, for warm-up and capture, on ``device``; default a new stream of ``device``. Pass a
        long-lived one when capturing often: torch keeps a cuBLAS workspace per stream until exit.
    graph : torch.cuda.CUDAGraph, optional
        The graph to capture into, e.g. ``torch.cuda.CUDAGraph(keep_graph=True)``; default a new one.
    around_capture : context manager, optional
        Entered just before the capture and left just after it (also when it raises), not around the
        warm-up: e.g. `UpdatableGraph`'s recording of the kernel nodes.

    Returns
    -------
    (torch.cuda.CUDAGraph, object)
        The captured graph and what the captured call of ``fn`` returned.

    Raises
    ------
    RuntimeError
        From CUDA or torch when ``fn`` does something a capture cannot hold (a host sync, a legacy-stream
        launch); the warm-up's own errors propagate as ``fn`` raised them.
    """
    device = _device_of(inputs, stream)
    graph = torch.cuda.CUDAGraph() if graph is None else graph
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device=device) if stream is None else stream
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn(*inputs)
        current.wait_stream(side)
        with around_capture if around_capture is not None else contextlib.nullcontext(), _no_gc():
            with torch.cuda.graph(graph, pool=pool, stream=side):
                outputs = fn(*inputs)
    return graph, outputs


@contextlib.contextmanager
def _no_gc():
    """Python's cyclic garbage collector off while a capture runs. Garbage cycles can hold CUDA graphs (an
    exception's traceback keeps the frame of a failed call alive, and with it the graphs in its locals); if a
    collection triggered by an allocation inside ``fn`` destroys one mid-capture, its ``cudaGraphExecDestroy``
    is illegal during stream capture and invalidates the capture ("operation not permitted when stream is
    capturing", then "operation failed due to a previous error during capture"). torch.cuda.graph no longer
    runs gc.collect() at capture start by default, so the cycles are left to the next collection after it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _device_of(inputs: Sequence[Any], stream: Optional[torch.cuda.Stream]) -> torch.device:
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.is_cuda:
            return x.device
    if stream is not None:
        return stream.device
    return torch.device("cuda", torch.cuda.current_device())
