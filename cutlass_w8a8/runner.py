"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket, as vLLM's model runner does.

At batch 1 a decoder step is hundreds of small kernel launches; replaying them from a captured graph removes
the per-launch host cost. `DecodeGraphRunner` captures one graph per bucket of batch sizes (vLLM's
``cudagraph_capture_sizes``: 1, 2, 4, then multiples of 8), largest first, into one shared memory pool; a
step copies its inputs into static buffers, pads the batch up to its bucket, replays, and returns the first
B rows of the graph's output. Batches above the largest bucket run eagerly.

Padded rows are harmless by construction: they carry a pad token at position 0 in the model's scratch cache
slot (`LlamaDecoder.scratch_slot`), the one slot that no sequence owns, so they write nowhere a real row
reads, and each row of every kernel of the step depends only on its own inputs.

Nothing in a step synchronises the host with the device or uses the legacy default stream explicitly: inputs
go through pinned host buffers with non-blocking copies on the caller's current stream, the replay runs on
that stream, and outputs stay on the device.
"""

from __future__ import annotations

import bisect
import time
from typing import Callable, Optional, Sequence, Union

import torch

from . import _ext
from .graphs import UpdatableGraph, capture
from .moe import W8A8MoE
from .ops._limits import MOE_DECODE_MAX_PAIRS

__all__ = ["DecodeGraphRunner", "GraphPool", "bucket_for", "bucket_sizes", "cuda_graph_batch_sizes",
           "dispatch_bounds", "with_dispatch_bounds"]

_IntsLike = Union[torch.Tensor, Sequence[int]]


def cuda_graph_batch_sizes(max_batch: int) -> list[int]:
    """Batch-size buckets to capture: 1, 2, 4, then the multiples of 8 up to ``max_batch`` (vLLM's scheme).

    vLLM's default ``cudagraph_capture_sizes`` are ``[1, 2, 4] + list(range(8, max + 1, 8))`` (the constant
    ``_BATCH_SIZES_TO_CAPTURE = [1, 2, 4] + [8 * i for i in range(1, 1025)]`` of its GPU model runner).
    When ``max_batch`` is not one of those sizes it is added as the last bucket, so every batch up to it
    has a graph (e.g. ``12 -> [1, 2, 4, 8, 12]``).
    """
    if max_batch < 1:
        raise ValueError(f"cuda_graph_batch_sizes: `max_batch` must be >= 1, got {max_batch}")
    sizes = [b for b in (1, 2, 4) if b <= max_batch] + list(range(8, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def dispatch_bounds(model: Optional[torch.nn.Module] = None) -> list[int]:
    """The batch sizes B at which a decode step of ``model`` changes kernel family between B and B + 1 rows,
    ascending: the rows of every cutlass_w8a8 GEMM give the same bits at any M within one family (issue 37; int8 at
    any M at all), so a bucket set containing these sizes makes every bucket's graph equal the unpadded eager step.

    - the dense decode bound, `cutlass_w8a8._ext.decode_gemm_max_m` (``scaled_mm``, ``w8a8_linear`` and
      ``W8A8Linear`` send M <= it to the decode GEMM on sm90, larger M to CUTLASS: csrc/core/launch_policy.hpp owns
      the rule; absent when the CUDA ops are not loaded or the decode path is off);
    - for every `cutlass_w8a8.W8A8MoE` in ``model``, ``MOE_DECODE_MAX_PAIRS // top_k`` tokens: its decode path
      (``moe_decode_experts``) or, in the chain, the grouped decode GEMM serve ``T * top_k <= 64`` (token, expert)
      rows (``MOE_DECODE_MAX_PAIRS``; the grouped decode GEMM's ``_grouped_decode_max_rows()``, also 64), the
      CUTLASS grouped GEMM more.

    Parameters
    ----------
    model : torch.nn.Module, optional
        The decode-step module (its submodules are searched for `W8A8MoE`); None: the dense bound only.

    Returns
    -------
    list of int
        Distinct positive batch sizes, ascending (empty on the CPU, where one reference serves every M).
    """
    bounds = set()
    dense = _ext.decode_gemm_max_m()
    if dense > 0:
        bounds.add(dense)
    if model is not None:
        # rows of the grouped GEMM's decode kernel (csrc/gemm/decode/grouped_decode.cu owns the number)
        grouped = int(torch.ops.cutlass_w8a8._grouped_decode_max_rows()) if _ext.cuda_ops_available() else 0
        for mod in model.modules():
            if isinstance(mod, W8A8MoE):
                bounds.update(rows // mod.top_k for rows in (MOE_DECODE_MAX_PAIRS, grouped))
    return sorted(b for b in bounds if b > 0)


def with_dispatch_bounds(sizes: Sequence[int], bounds: Sequence[int]) -> list[int]:
    """``sizes`` (batch-size buckets) with every bound ``b`` of ``bounds`` (`dispatch_bounds`) below the largest
    bucket added, ascending and distinct: the one rule that makes each bucket hold batches of one kernel family.

    A batch B runs in the smallest bucket W >= B; eager runs B rows, the graph W rows. When a bound b lies in
    [B, W) the two run different GEMM kernels (fp8: different accumulation orders, different bits). With b itself a
    bucket no bucket straddles it. A bound at or above the largest bucket needs nothing: every bucket is then on
    its lower side, and larger batches run eagerly, unpadded.

    Raises
    ------
    ValueError
        ``sizes`` is empty or holds a size below 1.
    """
    sizes = sorted(set(int(s) for s in sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"with_dispatch_bounds: `sizes` must be positive batch sizes, got {sizes}")
    return sorted(set(sizes) | {int(b) for b in bounds if 1 <= b < sizes[-1]})


def bucket_sizes(model: Optional[torch.nn.Module], max_batch: int, sizes: Optional[Sequence[int]] = None) -> list[int]:
    """The buckets a decode-graph runner captures: ``sizes`` (default `cuda_graph_batch_sizes` ``(max_batch)``) with
    the model's `dispatch_bounds` added (`with_dispatch_bounds`). The one place `DecodeGraphRunner` and
    `cutlass_w8a8.hf.GraphGenerator` get their bucket sets from."""
    base = cuda_graph_batch_sizes(max_batch) if sizes is None else sizes
    return with_dispatch_bounds(base, dispatch_bounds(model))


def bucket_for(sizes: Sequence[int], batch: int) -> Optional[int]:
    """The smallest of the ascending bucket ``sizes`` holding ``batch`` rows, or None above the largest (the one
    rule of `DecodeGraphRunner.bucket` and `cutlass_w8a8.hf.GraphGenerator.bucket_size`)."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


class GraphPool:
    """The memory pool and the side stream that the CUDA graphs of a set of batch-size buckets share (vLLM's and
    flash-attention's decoding pattern): each graph is captured by `cutlass_w8a8.graphs.capture` (warm-up, then the
    capture, on the side stream) into the one pool, so the buckets' graphs reuse each other's memory (only one
    replays at a time). Used by `DecodeGraphRunner` and `cutlass_w8a8.hf.GraphGenerator`.

    The stream and the pool are created on first use (no CUDA call before that); `reset` makes the next capture
    start a new pool (a recapture of every bucket), keeping the stream.

    Attributes
    ----------
    device : torch.device
    pool : tuple or None
        ``torch.cuda.graph_pool_handle()`` of the graphs captured so far (None before the first).
    stream : torch.cuda.Stream or None
        The side stream of warm-ups and captures (None before the first).
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.pool = None
        self.stream: Optional[torch.cuda.Stream] = None

    def handles(self) -> tuple:
        """``(pool, stream)``, created if not yet: for a capture that is not `capture`'s (an `UpdatableGraph`)."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=self.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool, self.stream

    def reset(self) -> None:
        """Start a new pool at the next capture (the graphs captured before keep theirs while they live)."""
        self.pool = None

    def capture(self, fn: Callable, inputs: Sequence = (), *, warmup: int):
        """`cutlass_w8a8.graphs.capture` ``(fn, inputs, warmup=warmup)`` into this pool on this stream:
        ``(graph, static outputs)``."""
        pool, stream = self.handles()
        return capture(fn, inputs, warmup=warmup, pool=pool, stream=stream)


def _slice_rows(out, n: int):
    if isinstance(out, torch.Tensor):
        return out[:n]
    return tuple(o[:n] for o in out)


class DecodeGraphRunner:
    """Bucketed CUDA-graph replay of a decoder's decode step.

    Parameters
    ----------
    model : torch.nn.Module
        A decode-step module such as `cutlass_w8a8.models.LlamaDecoder`: ``model(token_ids, positions,
        slots) -> logits``, all three ``(B,)`` int64 on its device, with attributes ``max_batch`` (real cache
        slots), ``scratch_slot`` (the slot for padded rows), ``max_seq_len`` and ``device``. Its step must not
        synchronise the host and must only use fixed-shape tensors (every cutlass_w8a8 op qualifies).
    max_batch : int, optional
        Largest captured bucket (default and maximum: ``model.max_batch``). Larger batches run eagerly.
    sizes : sequence of int, optional
        The buckets; default `cuda_graph_batch_sizes` ``(max_batch)``. The model's `dispatch_bounds` below the
        largest are added (`bucket_sizes`), so that a bucket's graph and the eager step of any batch it holds run
        the same GEMM kernels and give the same bits (issue 37).
    postprocess : callable, optional
        ``postprocess(logits (b, vocab)) -> Tensor or tuple of Tensors`` (first dimension b), run after the
        model inside the same graph, e.g. temperature scaling and sampling with Triton, CuPy or Warp kernels
        launched on torch's current stream. It is first called eagerly on the capture stream (warm-up), so
        it may cache per-stream objects then.
    use_graphs : bool, optional
        Capture graphs (default: when the model is on a CUDA device). Without graphs every step runs
        eagerly with the same padding, which is how the tests compare replay with eager.
    warmup : int
        Eager steps per bucket on the capture stream before its capture (default 2).
    pad_token_id : int
        Token id of padded rows (default 0).
    mode : {"buckets", "exact"}
        ``"buckets"`` (default): one graph per bucket, batches padded up to their bucket. ``"exact"``: one
        `cutlass_w8a8.graphs.UpdatableGraph` captured at ``max_batch`` for the batches above ``exact_floor`` (the
        largest of `dispatch_bounds` below ``max_batch``; 8 on sm90 for a dense model: the decode GEMM's bound),
        and buckets (`bucket_sizes` of ``exact_floor``) for the batches up to it, so that each graph's GEMMs run
        the kernel family eager runs; before a step whose batch B (above ``exact_floor``)
        differs from the last one, every cutlass_w8a8 kernel node of it is updated in place to B rows
        (``UpdatableGraph.set_rows``; `cutlass_w8a8.graphs.GraphNode` lists those ops): the quantizers and
        GEMMs, the fused norms (which also do the residual adds) and activation quantizers, the rotary
        embedding with the cache write (the row-wise op ``rope_kv_cache_``) and decode attention run at the
        real batch. The remaining kernels run over all ``max_batch`` rows, padded rows included: torch's
        (the token embedding, the gather of the rotary table, bf16 projections such as the default
        ``lm_head``) and ``postprocess``'s. Needs torch's ``CUDAGraph(keep_graph=True)``.

    Attributes
    ----------
    sizes : list of int
        The buckets, ascending (mode ``"exact"``: those up to ``exact_floor``, then ``max_batch``).
    exact_floor : int
        Mode ``"exact"``: the largest batch that does not run in the `UpdatableGraph` (0 when every batch does;
        always 0 in mode ``"buckets"``).
    graphs : dict of int to torch.cuda.CUDAGraph
        One graph per bucket (empty without graphs).
    pool : tuple
        The memory pool the graphs share (``torch.cuda.graph_pool_handle()``).
    capture_seconds : float
        Wall-clock time of `capture`, seconds.
    capture_seconds_per_size : dict of int to float
        Warm-up plus capture time of each bucket, seconds.

    Notes
    -----
    The returned tensors are views of the graph's static outputs (of the shared postprocess buffers, if it
    writes into its own): the next step overwrites them, so clone what must outlive it. Replays of the
    graphs must not overlap (they share the pool), which holds when steps run on one stream.

    A tensor-parallel model (`cutlass_w8a8.distributed.TensorParallelLlamaDecoder`) is captured the same
    way on every rank, its NCCL all-reduces inside the graphs (torch.distributed collectives are capturable; keep
    NVLink multicast off: ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``). Every rank must build its
    runner with the same arguments and call ``step`` with the same inputs in the same order (the batch decides
    which graph, hence which collectives, run). On the CPU (gloo) steps run eagerly.

    Host inputs (lists, CPU tensors) are written into one of ``ring`` pinned buffers and copied with
    ``non_blocking=True``; before a buffer is reused the runner waits for its previous copy, i.e. it blocks
    only when the device is ``ring`` steps behind the host. Device inputs are copied device to device.

    Examples
    --------
    >>> model = LlamaDecoder(SMALL, quant="int8", max_batch=32, device="cuda")
    >>> runner = DecodeGraphRunner(model)                  # captures 1, 2, 4, 8, 16, 24, 32
    >>> logits = runner.step([5, 17, 3], [0, 0, 0], [0, 1, 2])   # padded to 4, sliced back to 3 rows
    """

    ring = 4

    def __init__(self, model: torch.nn.Module, max_batch: Optional[int] = None, *,
                 sizes: Optional[Sequence[int]] = None, postprocess: Optional[Callable] = None,
                 use_graphs: Optional[bool] = None, warmup: int = 2, pad_token_id: int = 0,
                 mode: str = "buckets"):
        if mode not in ("buckets", "exact"):
            raise ValueError(f"DecodeGraphRunner: `mode` must be 'buckets' or 'exact', got {mode!r}")
        self.mode = mode
        self.model = model
        self.device = torch.device(model.device)
        max_batch = model.max_batch if max_batch is None else max_batch
        if not 1 <= max_batch <= model.max_batch:
            raise ValueError(f"DecodeGraphRunner: `max_batch` must be in [1, model.max_batch = {model.max_batch}], "
                             f"got {max_batch}")
        if mode == "exact" and sizes is not None:
            raise ValueError("DecodeGraphRunner: `sizes` is for mode='buckets'; mode='exact' captures max_batch only")
        if sizes is not None and (not sizes or min(sizes) < 1 or max(sizes) > model.max_batch):
            raise ValueError(f"DecodeGraphRunner: `sizes` must be in [1, {model.max_batch}], got {sorted(set(sizes))}")
        bounds = dispatch_bounds(model)
        # mode "exact": the UpdatableGraph serves the batches above the largest dispatch bound below max_batch (one
        # kernel family: its nodes are resized within it); the batches up to that bound get buckets of their own
        # (an UpdatableGraph records CUTLASS GEMM nodes at every M, while eager runs the decode GEMM up to its bound:
        # when that bound reaches max_batch, no batch can use the UpdatableGraph and every batch gets a bucket)
        self.exact_floor = 0
        if mode == "exact":
            below = [b for b in bounds if b < max_batch]
            self.exact_floor = max_batch if _ext.decode_gemm_max_m() >= max_batch else max(below, default=0)
            sizes = bucket_sizes(model, self.exact_floor) if self.exact_floor else []
            if self.exact_floor < max_batch:
                sizes.append(max_batch)
        else:
            sizes = bucket_sizes(model, max_batch, sizes)
        if use_graphs is None:
            use_graphs = self.device.type == "cuda"
        if use_graphs and self.device.type != "cuda":
            raise ValueError("DecodeGraphRunner: CUDA graphs need a model on a CUDA device")
        self.sizes = list(sizes)
        self.max_size = self.sizes[-1]
        self.postprocess = postprocess
        self.use_graphs = use_graphs
        self.warmup = warmup
        self._pad_token_id = pad_token_id
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict = {}
        self._graph_pool = GraphPool(self.device)
        self.capture_seconds = 0.0
        self.capture_seconds_per_size: dict[int, float] = {}
        self.exact_graph: Optional[UpdatableGraph] = None
        self._rows = 0  # rows the exact graph's nodes run now

        n = self.max_size
        # Static inputs, (n, 3): row i holds (token id, position, slot) of batch row i, so the first b rows of
        # every field are one contiguous block (one copy per step). Every graph reads the first b rows.
        self._static = torch.empty(n, 3, dtype=torch.int64, device=self.device)
        # What padded rows get: the pad token, position 0, the scratch slot (host and device copies).
        self._pad_host = torch.tensor([[pad_token_id, 0, model.scratch_slot]], dtype=torch.int64).repeat(n, 1)
        self._pad = self._pad_host.to(self.device)
        self._static.copy_(self._pad)
        pinned = self.device.type == "cuda"
        self._host = [torch.empty(n, 3, dtype=torch.int64, pin_memory=pinned) for _ in range(self.ring)]
        self._host_events = [torch.cuda.Event() if pinned else None for _ in range(self.ring)]
        self._host_next = 0
        self._arange = torch.arange(max(n, model.max_batch), dtype=torch.int64, device=self.device)
        if use_graphs:
            self.capture()

    @property
    def pool(self):
        """The memory pool the graphs share (`GraphPool`; None before the first capture)."""
        return self._graph_pool.pool

    @property
    def pad_token_id(self) -> int:
        """Token id of padded rows; may be changed between steps (the graphs read it as input data)."""
        return self._pad_token_id

    @pad_token_id.setter
    def pad_token_id(self, value: int) -> None:
        self._pad_token_id = int(value)
        self._pad_host[:, 0].fill_(self._pad_token_id)
        self._pad[:, 0].fill_(self._pad_token_id)

    # ------------------------------------------------------------------------------------------------

    def _forward(self, b: int):
        return self._forward_rows(self._static[:b])

    def _forward_rows(self, static: torch.Tensor):
        out = self.model(static[:, 0], static[:, 1], static[:, 2])
        return self.postprocess(out) if self.postprocess is not None else out

    @torch.no_grad()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first, into one shared pool (a second call recaptures).

        Each bucket is first run ``warmup`` times eagerly on the capture stream (lazy initialisation, kernel
        selection and compilation of external kernels happen there, outside the capture), then captured on
        it (`cutlass_w8a8.graphs.capture`; mode ``"exact"``: one `UpdatableGraph` at ``max_batch``, then the buckets
        up to ``exact_floor``). The static inputs hold
        padding during warm-up and capture, so only the scratch cache slot is written.
        """
        self.graphs.clear()
        self.outputs.clear()
        self._graph_pool.reset()
        pool, stream = self._graph_pool.handles()
        self._static.copy_(self._pad)
        t_all = time.perf_counter()
        if self.mode == "exact" and self.exact_floor < self.max_size:
            n = self.max_size
            self.exact_graph = None
            graph = UpdatableGraph(self._forward_rows, [self._static[:n]], warmup=self.warmup, pool=pool,
                                   stream=stream)
            self._static = graph.static_inputs[0]  # steps write the graph's own input buffer
            self.exact_graph, self._rows = graph, n
            self.graphs[n], self.outputs[n] = graph.graph, graph.static_outputs
            self.capture_seconds_per_size[n] = time.perf_counter() - t_all
        for b in reversed(self.sizes):
            if b in self.graphs:
                continue
            t0 = time.perf_counter()
            self.graphs[b], self.outputs[b] = self._graph_pool.capture(self._forward_rows, [self._static[:b]],
                                                                       warmup=self.warmup)
            self.capture_seconds_per_size[b] = time.perf_counter() - t0
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t_all

    def bucket(self, batch: int) -> Optional[int]:
        """The smallest bucket holding ``batch`` rows, or None above the largest (eager): `bucket_for`."""
        return bucket_for(self.sizes, batch)

    # ------------------------------------------------------------------------------------------------

    def _host_rows(self, token_ids, positions, slots, n: int) -> list[torch.Tensor]:
        rows = []
        for name, v in (("token_ids", token_ids), ("positions", positions), ("slots", slots)):
            if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                raise ValueError(f"DecodeGraphRunner.step: `{name}` is on {v.device} but `token_ids` is host "
                                 "data: pass all three on the device or all on the host")
            t = torch.as_tensor(v, dtype=torch.int64) if v is not None else torch.arange(n, dtype=torch.int64)
            if t.shape != (n,):
                raise ValueError(f"DecodeGraphRunner.step: `{name}` must be ({n},), got {tuple(t.shape)}")
            rows.append(t)
        pos, slot = rows[1], rows[2]
        if n and (int(pos.min()) < 0 or int(pos.max()) >= self.model.max_seq_len):
            raise ValueError(f"DecodeGraphRunner.step: `positions` must be in [0, {self.model.max_seq_len})")
        if n and (int(slot.min()) < 0 or int(slot.max()) >= self.model.max_batch):
            raise ValueError(f"DecodeGraphRunner.step: `slots` must be in [0, {self.model.max_batch})")
        return rows

    def _load(self, token_ids, positions, slots, n: int, width: int) -> None:
        """Fill ``_static[:width]``: the n real rows, then padding."""
        if isinstance(token_ids, torch.Tensor) and token_ids.device.type != "cpu":
            for name, v in (("positions", positions), ("slots", slots)):
                if v is not None and not (isinstance(v, torch.Tensor) and v.device == token_ids.device):
                    raise ValueError(f"DecodeGraphRunner.step: `{name}` must be on {token_ids.device} like `token_ids`")
            if token_ids.shape != (n,) or positions.shape != (n,) or (slots is not None and slots.shape != (n,)):
                raise ValueError("DecodeGraphRunner.step: `token_ids`, `positions` and `slots` must be (B,)")
            self._static[:n, 0].copy_(token_ids)
            self._static[:n, 1].copy_(positions)
            self._static[:n, 2].copy_(self._arange[:n] if slots is None else slots)
            if width > n:
                self._static[n:width].copy_(self._pad[n:width])
            return
        rows = self._host_rows(token_ids, positions, slots, n)
        i = self._host_next
        self._host_next = (i + 1) % self.ring
        host, event = self._host[i], self._host_events[i]
        if event is not None and not event.query():
            event.synchronize()  # the device is `ring` steps behind: wait for this buffer's last copy
        for c, t in enumerate(rows):
            host[:n, c] = t
        if width > n:
            host[n:width] = self._pad_host[n:width]
        # contiguous pinned source and destination: one asynchronous copy (a strided or pageable source
        # would be staged through pageable memory, which may synchronise)
        self._static[:width].copy_(host[:width], non_blocking=True)
        if event is not None:
            event.record()

    @torch.no_grad()
    def step(self, token_ids: _IntsLike, positions: _IntsLike, slots: Optional[_IntsLike] = None, *,
             use_graph: bool = True):
        """One decode step of B sequences.

        Parameters
        ----------
        token_ids, positions : torch.Tensor or sequence of int
            ``(B,)`` token ids and 0-based positions. Either all inputs are tensors on the model's device
            (copied device to device, not checked) or all are host values (lists or CPU tensors, checked on
            the host, then copied through pinned memory).
        slots : torch.Tensor or sequence of int, optional
            ``(B,)`` distinct cache slots in ``[0, model.max_batch)``; default ``0..B-1``.
        use_graph : bool
            Replay the bucket's graph (default); False runs the same padded step eagerly.

        Returns
        -------
        torch.Tensor or tuple of torch.Tensor
            The model's (or ``postprocess``'s) outputs for the B real rows: ``(B, ...)`` views of static
            buffers, valid until the next step. Above the largest bucket: fresh tensors from an eager step.
        """
        n = len(token_ids)
        if n < 1:
            raise ValueError("DecodeGraphRunner.step: the batch is empty")
        width = self.bucket(n)
        if width is None:  # above the largest bucket: eager, unpadded
            if n > self.model.max_batch:
                raise ValueError(f"DecodeGraphRunner.step: batch {n} exceeds the cache's {self.model.max_batch} slots")
            if isinstance(token_ids, torch.Tensor) and token_ids.device.type != "cpu":
                tok, pos = token_ids, positions
                slot = slots if slots is not None else self._arange[:n]
            else:
                rows = self._host_rows(token_ids, positions, slots, n)
                pinned = self.device.type == "cuda"
                tok, pos, slot = (r.pin_memory().to(self.device, non_blocking=True) if pinned else r for r in rows)
            out = self.model(tok, pos, slot)
            return self.postprocess(out) if self.postprocess is not None else out
        self._load(token_ids, positions, slots, n, width)
        if use_graph and self.use_graphs:
            if self.exact_graph is not None and width == self.max_size and n != self._rows:
                self.exact_graph.set_rows(n)
                self._rows = n
            self.graphs[width].replay()
            out = self.outputs[width]
        else:
            out = self._forward(width)
        return _slice_rows(out, n)

    __call__ = step

    def graph_pool_bytes(self) -> Optional[int]:
        """Bytes reserved by the graphs' private memory pool (None without graphs or on older torch)."""
        if not self.graphs or self.pool is None:
            return None
        try:
            snapshot = torch.cuda.memory_snapshot()
            pool_id = tuple(int(v) for v in self.pool)
            return sum(seg.get("total_size", 0) for seg in snapshot
                       if tuple(int(v) for v in seg.get("segment_pool_id", ())) == pool_id)
        except Exception:  # noqa: BLE001 (best effort, reporting only)
            return None
