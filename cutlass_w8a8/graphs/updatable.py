"""`UpdatableGraph`: a `CapturedGraph` whose cutlass_w8a8 kernel nodes are resized and re-pointed in place.

The node records live in C++ (csrc/graphs/graph_nodes.cu); `cutlass_w8a8._ext` reaches them through the
extension's non-tensor ops with plain ints and lists (``_ext.graph_record_begin`` ... ``graph_release``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple, Optional, Union

import torch

from .. import _ext
from ..ops._checks import check_scaled_mm
from .captured import CapturedGraph

__all__ = ["GraphNode", "UpdatableGraph"]


class GraphNode(NamedTuple):
    """A cutlass_w8a8 kernel node of an `UpdatableGraph` (read `UpdatableGraph.nodes` again after updates).

    Attributes
    ----------
    record : int
        Id of the node's record (csrc/graphs/graph_nodes.cu).
    op : str
        The op that launched it. A GEMM node: ``"scaled_mm"`` (also for `W8A8Linear`'s GEMM); the only kind
        `UpdatableGraph.update_scaled_mm` rebinds. Row-wise nodes, resized by `UpdatableGraph.set_rows`:
        ``"quantize_per_token"``, ``"quantize_per_tensor"``, ``"rms_norm"``, ``"fused_add_rms_norm"``,
        ``"rms_norm_quant"``, ``"silu_mul"``, ``"silu_mul_quant"``, ``"decode_attention"``,
        ``"rope_kv_cache_"``; and the decode GEMMs ``"scaled_mm_decode"`` and ``"linear_decode"`` (one node,
        or two with a split-K reduce kernel, which M is a parameter of).
    rows : int
        M the node computes now.
    bound_rows : int
        M of the buffers it reads now: the most `UpdatableGraph.set_rows` may ask for.
    captured_rows : int
        M at capture.
    n, k : int
        The GEMM's N and K (0 for the other nodes).
    config : int
        The GEMM's kernel config at capture (its index in the sm90 table; -1 for the other nodes).
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
        As for `CapturedGraph`. ``fn``'s cutlass_w8a8 ops are the updatable nodes (`GraphNode.op` lists
        them); every other kernel (torch ops, Triton, Warp) keeps its captured shape, so after ``set_rows(m)``
        they still process all captured rows: read only the first m rows of outputs that depend on the
        resized ops.

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
    What an update may change (csrc/graphs/graph_nodes.cu): M, from 1 up to the M of the buffers the node is
    bound to (its captured M); for GEMMs also the operand, scale, bias and output tensors, with N, K, dtypes
    and device as captured. A GEMM node takes the config that dispatch picks for the new M when it has the
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

    def _new_graph(self) -> torch.cuda.CUDAGraph:
        try:
            return torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError as exc:
            raise RuntimeError(f"UpdatableGraph needs torch.cuda.CUDAGraph(keep_graph=True) (torch "
                               f"{torch.__version__} lacks it): {exc}") from None

    @contextlib.contextmanager
    def _around_capture(self) -> Iterator[None]:
        """The node recording, open exactly while the capture runs; its records are validated only when the
        capture succeeded."""
        first = _ext.graph_record_begin()
        ok = False
        try:
            yield
            ok = True
        finally:
            self._recorded = range(first, _ext.graph_record_end(check=ok))

    def _captured(self) -> None:
        graph_handle = self.graph.raw_cuda_graph()
        ids = [record for record in self._recorded if _ext.graph_record_info(record)[0].graph == graph_handle]
        # records of another thread's concurrent capture belong to no graph of ours
        mine = set(ids)
        _ext.graph_release([r for r in self._recorded if r not in mine])
        self._ids: list[int] = ids
        self._bound: dict[int, tuple] = {}  # record -> tensors an update bound (kept alive for the graph)
        self.graph.instantiate()
        self.graph_exec: int = self.graph.raw_cuda_graph_exec()
        self._live = True

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
            A CUDA call failed while updating, or the graph was reset.
        """
        self._check_live("set_rows")
        _ext.graph_set_rows(self.graph_exec, self._ids, int(rows))

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
        RuntimeError
            The graph was reset.
        """
        what = "UpdatableGraph.update_scaled_mm"
        self._check_live("update_scaled_mm")
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{what}: `out` must be a torch.Tensor, got {type(out).__name__}")
        check_scaled_mm(what, a, b, scale_a, scale_b, out.dtype, bias, out)
        if a.device != self.device:
            raise ValueError(f"{what}: `a` must be a CUDA tensor on the graph's device {self.device}, got {a.device}")
        record = node.record if isinstance(node, GraphNode) else int(self._ids[node])
        if record not in self._ids:
            raise ValueError(f"{what}: `node` (record {record}) is not a node of this graph")
        torch.ops.cutlass_w8a8._graph_update_scaled_mm(self.graph_exec, record, out, a, b, scale_a, scale_b, bias)
        self._bound[record] = (out, a, b, scale_a, scale_b, bias)

    def _check_live(self, what: str) -> None:
        if not self._live:
            raise RuntimeError(f"UpdatableGraph.{what}: the graph was reset; capture a new UpdatableGraph")

    def reset(self) -> None:
        """Destroy the graph (``CUDAGraph.reset``) and forget its node records; later updates raise."""
        _ext.graph_release(self._ids)
        self._live = False
        self._bound.clear()
        self.graph.reset()

    def replay(self) -> None:
        """Replay on the graph's device's current stream (no input copies)."""
        with torch.cuda.device(self.device):
            self.graph.replay()

    def __del__(self):
        try:
            _ext.graph_release(self._ids)
        except Exception:  # noqa: BLE001 (interpreter shutdown, or a capture that failed before any record)
            pass
