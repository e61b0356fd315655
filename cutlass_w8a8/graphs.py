"""CUDA-graph capture helpers: warm up on a side stream, capture, then copy new inputs in and replay.

The pattern is the one flash-attention's decoding helper and vLLM's model runner use: static input buffers
that the graph reads, a warm-up outside the capture (so lazy initialisation, autotuning and allocator growth
do not happen inside it), an optional shared memory pool, and `copy_` of fresh inputs before each replay.
"""

from __future__ import annotations

import ctypes
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch

from . import _ext
from .ops import _check_scaled_mm

__all__ = ["CapturedGraph", "UpdatableGraph", "GraphNode"]


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

    _name = "CapturedGraph"

    def __init__(self, fn: Callable, example_inputs: Sequence[torch.Tensor], warmup: int = 3,
                 pool=None, stream: Optional[torch.cuda.Stream] = None):
        if not example_inputs or not all(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs):
            raise ValueError(f"{self._name}: `example_inputs` must be a non-empty sequence of CUDA tensors")
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
            self._capture(pool, stream if stream is not None else side)

    def _capture(self, pool, stream: torch.cuda.Stream) -> None:
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=stream):
            self.static_outputs = self.fn(*self.static_inputs)

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


class GraphNode(NamedTuple):
    """A cutlass_w8a8 kernel node of an `UpdatableGraph` (read `UpdatableGraph.nodes` again after updates).

    Attributes
    ----------
    record : int
        Id of the node's record (csrc/graphs/graph_nodes.cu).
    op : str
        The op that launched it: ``"scaled_mm"`` or a row-wise op (``"quantize_per_token"``,
        ``"quantize_per_tensor"``, the fused normalization/activation quantizers, ``"decode_attention"``).
    rows : int
        M the node computes now.
    bound_rows : int
        M of the buffers it reads now: the most `UpdatableGraph.set_rows` may ask for.
    captured_rows : int
        M at capture.
    n, k : int
        The GEMM's N and K (0 for row-wise nodes).
    config : int
        The GEMM's kernel config at capture (its index in the sm90 table; -1 for row-wise nodes).
    """

    record: int
    op: str
    rows: int
    bound_rows: int
    captured_rows: int
    n: int
    k: int
    config: int


class UpdatableGraph(CapturedGraph):
    """`CapturedGraph` whose cutlass_w8a8 kernels can be resized and re-pointed in place, without recapture.

    The graph is captured once with ``torch.cuda.CUDAGraph(keep_graph=True)`` while cutlass_w8a8 records the
    kernel node each of its ops adds (``cudaStreamGetCaptureInfo`` right after the launch), then instantiated.
    Afterwards `set_rows` changes M of every recorded node and `update_scaled_mm` binds a GEMM node to new
    operands: the kernel's parameters (CUTLASS's Params with their TMA descriptors, or the grid of a row-wise
    kernel) are rebuilt on the host and written into the executable graph with
    ``cudaGraphExecKernelNodeSetParams``. This is the method of NVIDIA's "Constructing CUDA Graphs with Dynamic
    Parameters" (CUDA developer blog, 2022): capture once, then update kernel nodes, which it measured faster
    than recapture + ``cudaGraphExecUpdate`` and than no graph. Updates affect later replays only; a replay
    already queued runs with the parameters it was launched with.

    Parameters
    ----------
    fn, example_inputs, warmup, pool, stream
        As for `CapturedGraph`. ``fn``'s cutlass_w8a8 ops are the updatable nodes; every other kernel (torch
        ops, Triton, Warp) keeps its captured shape, so after ``set_rows(m)`` they still process all captured
        rows: read only the first m rows of outputs that depend on the resized ops.

    Attributes
    ----------
    nodes : list of GraphNode
        The recorded nodes, in capture order.
    graph_exec : int
        The ``cudaGraphExec_t`` (``graph.raw_cuda_graph_exec()``).

    Raises
    ------
    RuntimeError
        The CUDA extension is not loaded, torch lacks ``CUDAGraph(keep_graph=True)``, another recording is
        open, or a recorded launch is not the kernel node it should be.

    Notes
    -----
    What an update may change (csrc/graphs/graph_nodes.cu): M, from 1 up to the M of the buffers the node is bound
    to (its captured M); for GEMMs also the operand, scale, bias and output tensors, with N, K, dtypes and
    device as captured. A GEMM node takes the config that dispatch picks for the new M when it has the
    captured config's cluster shape (a launch attribute an update keeps), else keeps the captured config,
    which is correct at any M. Programmatic-dependent-launch edges are part of the graph's topology and stay.

    Examples
    --------
    >>> layer = W8A8Linear.from_float(linear).cuda()
    >>> g = UpdatableGraph(layer, [torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)])
    >>> g.set_rows(5)                  # the quantizer and the GEMM now run 5 rows
    >>> y = g(x64)[:5]                 # rows 5.. of the output are stale
    """

    _name = "UpdatableGraph"

    def _capture(self, pool, stream: torch.cuda.Stream) -> None:
        try:
            self.graph = torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError as exc:
            raise RuntimeError(f"UpdatableGraph needs torch.cuda.CUDAGraph(keep_graph=True) (torch "
                               f"{torch.__version__} lacks it): {exc}") from None
        first = _ext.graph_record_begin()
        ok = False
        try:
            with torch.cuda.graph(self.graph, pool=pool, stream=stream):
                self.static_outputs = self.fn(*self.static_inputs)
            ok = True
        finally:
            end = _ext.graph_record_end(check=ok)
        graph_handle = self.graph.raw_cuda_graph()
        ids = []
        for record in range(first, end):
            info, _ = _ext.graph_record_info(record)
            if info.graph == graph_handle:
                ids.append(record)
        # records of another thread's concurrent capture belong to no graph of ours
        _ext.graph_release([r for r in range(first, end) if r not in set(ids)])
        self._ids = (ctypes.c_int64 * len(ids))(*ids)
        self._count = len(ids)
        self._bound: dict[int, tuple] = {}  # record -> tensors an update bound (kept alive for the graph)
        self.graph.instantiate()
        self.graph_exec = self.graph.raw_cuda_graph_exec()
        self._exec = ctypes.c_void_p(self.graph_exec)

    @property
    def nodes(self) -> list[GraphNode]:
        out = []
        for record in self._ids:
            info, op = _ext.graph_record_info(record)
            out.append(GraphNode(record, op, info.rows, info.bound_rows, info.captured_rows, info.n, info.k,
                                 info.config))
        return out

    def set_rows(self, rows: int) -> None:
        """Make every recorded node compute ``rows`` rows (M) in later replays.

        Parameters
        ----------
        rows : int
            In ``[1, min(node.bound_rows)]``.

        Raises
        ------
        ValueError
            ``rows`` is out of range for some node; no node was changed.
        RuntimeError
            A CUDA call failed while updating.
        """
        self._check_live("set_rows")
        _ext.graph_set_rows(self._exec, self._ids, self._count, int(rows))

    def update_scaled_mm(self, node: Union[int, GraphNode], out: torch.Tensor, a: torch.Tensor,
                         b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                         bias: Optional[torch.Tensor] = None) -> None:
        """Bind a recorded GEMM node to new operands (``scaled_mm(..., out=out)`` semantics) for later replays.

        Parameters
        ----------
        node : int or GraphNode
            An index into `nodes` or one of its entries; must be a ``"scaled_mm"`` node.
        out, a, b, scale_a, scale_b, bias : torch.Tensor
            As for `cutlass_w8a8.scaled_mm` with ``out=``: ``a`` (M, K) with M in [1, the node's captured M],
            ``b`` (K, N) column-major, ``out`` (M, N); N, K, the operand and output dtypes and the device as
            captured. The graph keeps references to them until the node is bound again.

        Raises
        ------
        TypeError, ValueError
            As for `scaled_mm`, or the new operands do not fit the captured node; the node is unchanged.
        """
        what = "UpdatableGraph.update_scaled_mm"
        self._check_live("update_scaled_mm")
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{what}: `out` must be a torch.Tensor, got {type(out).__name__}")
        _check_scaled_mm(what, a, b, scale_a, scale_b, out.dtype, bias, out)
        if a.device != self.device:
            raise ValueError(f"{what}: `a` must be a CUDA tensor on the graph's device {self.device}, got {a.device}")
        record = node.record if isinstance(node, GraphNode) else int(self._ids[node])
        if record not in list(self._ids):
            raise ValueError(f"UpdatableGraph.update_scaled_mm: `node` (record {record}) is not a node of this graph")
        torch.ops.cutlass_w8a8._graph_update_scaled_mm(self.graph_exec, record, out, a, b, scale_a, scale_b, bias)
        self._bound[record] = (out, a, b, scale_a, scale_b, bias)

    def _check_live(self, what: str) -> None:
        if self._exec is None:
            raise RuntimeError(f"UpdatableGraph.{what}: the graph was reset; capture a new UpdatableGraph")

    def reset(self) -> None:
        """Destroy the graph (``CUDAGraph.reset``) and forget its node records; later updates raise."""
        _ext.graph_release(list(self._ids))
        self._exec = None
        self._bound.clear()
        self.graph.reset()

    def replay(self) -> None:
        """Replay on the graph's device's current stream (no input copies)."""
        with torch.cuda.device(self.device):
            self.graph.replay()

    def __del__(self):
        try:
            _ext.graph_release(list(self._ids))
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass
