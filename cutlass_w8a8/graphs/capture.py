"""`capture`: the one warm-up + CUDA-graph capture of cutlass_w8a8 (graphs, the decode runner, the bench timers).

The pattern is the one flash-attention's decoding helper and vLLM's model runner use: a few eager calls on a
side stream first (lazy initialisation, kernel selection, allocator growth happen there, outside the capture), then
the capture on that same stream, optionally into a shared memory pool.

The cuBLAS workspaces are the exception, handled the way torch's own CUDA-graph trees handle them
(``torch._inductor.cudagraph_trees.clear_cublass_cache``). torch keeps one cuBLAS workspace per (handle, stream),
allocated on first use from the caching allocator. A graph that records a cuBLAS GEMM bakes that workspace's
address into its kernel node, but does not own the memory. ``torch._C._cuda_clearCublasWorkspaces()`` then frees
it, while the graph still uses it. torch.compile's ``mode="reduce-overhead"`` calls that function around every
warm-up and recording, and torch's ``CUDAGraph`` reset calls it for its stream.

So a graph captured here after warming up on the side stream could later write its GEMM workspace into memory the
allocator had handed to another tensor. Suspected on an H100 (2026-11-27): a W8A8 decode graph (its bf16 lm_head
GEMM) interleaved with compiled transformers models in one process ended in an illegal address inside a compiled
step. Such discussions as pytorch/pytorch#193402 and #192061 describe the same lifetime problem.

`capture` therefore clears the workspaces just before the capture begins and again just after it ends. The
workspace a captured GEMM needs is then allocated during the capture from the graph's memory pool, where it stays
reserved while the graph lives. Clearing afterwards keeps later eager GEMMs off the pool's memory.

Like the graph trees, the clear drops every stream's cached workspace, not only the side stream's. A graph that
another library captured with a workspace from the general pool is exposed to this exactly as it already is to
torch.compile's ``reduce-overhead`` mode.
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
        long-lived one when capturing often: torch keeps a cuBLAS handle per stream until exit.
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
            _clear_cublas_workspaces()  # the captured GEMMs' workspace: allocated in the graph's pool (module doc)
            try:
                with torch.cuda.graph(graph, pool=pool, stream=side):
                    outputs = fn(*inputs)
            finally:
                _clear_cublas_workspaces()
    return graph, outputs


def _clear_cublas_workspaces() -> None:
    """``torch._C._cuda_clearCublasWorkspaces()`` (what torch's CUDA-graph trees call around a recording); a no-op
    on a torch without it."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


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
