"""Timing helpers shared by the scripts in ``bench/`` (GEMM sweep, decoder benchmark); writing their results
is `cutlass_w8a8.testing.report`.

The timer, :func:`bench_gpu_time`, replays a CUDA graph that calls the function under test several times
over rotating copies of its inputs, so that every call starts with a cold L2 and the host launch overhead
is amortised over the replay. Nothing here touches the GPU at import time.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import statistics
import subprocess
from typing import Any, Callable, Optional, Sequence

import torch

from ..graphs import capture

__all__ = [
    "DEFAULT_L2_BYTES",
    "DENSE_PEAK_TOPS",
    "GpuTiming",
    "HBM_BANDWIDTH_GBPS",
    "bench_gpu_time",
    "copy_bandwidth_gbps",
    "cuda_kernel_times",
    "dense_peak_tops",
    "device_slug",
    "geomean",
    "git_commit",
    "hbm_bandwidth_gbps",
    "l2_cache_bytes",
    "rotating_arg_sets",
    "rotation_count",
    "tensor_bytes",
]

# Assumed L2 size when torch does not report one (``L2_cache_size`` reads 50 MiB on an H100 SXM).
DEFAULT_L2_BYTES = 64 * 2**20

# Dense (no 2:4 sparsity) int8 / fp8 tensor-core peaks in TOPS (= TFLOPS for fp8), from the NVIDIA H100
# datasheet (https://www.nvidia.com/en-us/data-center/h100/) and H200 datasheet
# (https://www.nvidia.com/en-us/data-center/h200/). The datasheets print the sparse figures (3,958 for
# SXM, 3,026 for H100 PCIe); dense is half. Matched in order against torch.cuda.get_device_name():
# the SXM entries come last so that the PCIe part is not taken for them. Unknown devices get no peak.
DENSE_PEAK_TOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 1513.0),
    ("H100", 1979.0),  # H100 SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200", 1979.0),  # H200 SXM ("NVIDIA H200")
)


def dense_peak_tops(device_name: str) -> Optional[float]:
    """Dense int8/fp8 peak of a device in TOPS (see `DENSE_PEAK_TOPS`), or None when unknown.

    NVL variants are left unknown: their datasheet clocks differ from the SXM parts.
    """
    if "NVL" in device_name:
        return None
    for key, tops in DENSE_PEAK_TOPS:
        if key in device_name:
            return tops
    return None


# HBM bandwidth in GB/s (1e9 B/s) from the same datasheets: H100 SXM 3.35 TB/s, H100 NVL 3.9 TB/s, H100 PCIe
# 2 TB/s (https://www.nvidia.com/en-us/data-center/h100/); H200 SXM and H200 NVL 4.8 TB/s
# (https://www.nvidia.com/en-us/data-center/h200/). Matched in order against torch.cuda.get_device_name()
# ("NVIDIA H100 80GB HBM3" is the SXM part, hence PCIe and NVL first). Unknown devices get no figure.
HBM_BANDWIDTH_GBPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),
    ("H200", 4800.0),
)


def hbm_bandwidth_gbps(device_name: str) -> Optional[float]:
    """Datasheet HBM bandwidth of a device in GB/s (see `HBM_BANDWIDTH_GBPS`), or None when unknown."""
    for key, gbps in HBM_BANDWIDTH_GBPS:
        if key in device_name:
            return gbps
    return None


def device_slug(device_name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``: lowercased, runs of non-alphanumerics -> '-'."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "unknown"


def git_commit(path: str) -> tuple[Optional[str], Optional[bool]]:
    """``(commit hash, dirty)`` of the git checkout holding ``path``; ``(None, None)`` without git or commits.

    ``CUTLASS_W8A8_GIT_COMMIT`` in the environment overrides it (dirty unknown): for a copy of the working
    tree whose ``.git`` is not the source's (scripts/gpu_run.sh sets it from ``.whl/COMMIT`` when present).
    """
    import os

    override = os.environ.get("CUTLASS_W8A8_GIT_COMMIT")
    if override:
        return override, None
    def git(*cmd: str) -> Optional[str]:
        try:
            res = subprocess.run(["git", "-C", path, *cmd], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return res.stdout.strip() if res.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, (bool(status) if status is not None else None)


def geomean(values: Sequence[float]) -> Optional[float]:
    """Geometric mean of positive numbers; None for an empty sequence."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


# ----------------------------------------------------------------------------------------------------
# rotating inputs


def l2_cache_bytes(device: Optional[torch.device] = None) -> int:
    """The device's L2 size in bytes as torch reports it, else `DEFAULT_L2_BYTES` (64 MiB)."""
    props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    size = int(getattr(props, "L2_cache_size", 0) or 0)
    return size if size > 0 else DEFAULT_L2_BYTES


def tensor_bytes(obj: Any) -> int:
    """Bytes held by a tensor, or by a module's parameters and buffers; 0 for anything else.

    A wrapper tensor subclass (torchao's quantized weights) counts the tensors it holds
    (``__tensor_flatten__``), not its logical size in its outer dtype.
    """
    if isinstance(obj, torch.Tensor):
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        if is_traceable_wrapper_subclass(obj):
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, name)) for name in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, torch.nn.Module):
        return sum(tensor_bytes(t) for t in (*obj.parameters(), *obj.buffers()))
    return 0


def rotation_count(set_bytes: int, l2_bytes: int, max_bytes: int, min_copies: int = 2,
                   max_copies: int = 1024) -> int:
    """Number of input copies so that together they exceed twice the L2.

    Returns ``max(min_copies, floor(2 * l2_bytes / set_bytes) + 1)`` copies, capped at ``max_copies``
    and so that the copies hold at most ``max_bytes`` bytes (but never fewer than one). Sizes in bytes.
    """
    if set_bytes <= 0:
        return 1
    want = min(max(min_copies, 2 * l2_bytes // set_bytes + 1), max_copies)
    return max(1, min(want, max_bytes // set_bytes))


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, torch.nn.Module):
        return copy.deepcopy(obj)
    return obj


def rotating_arg_sets(args: Sequence[Any], l2_bytes: int, max_bytes: int = 4 * 2**30,
                      min_copies: int = 2) -> list[tuple]:
    """``args`` followed by copies with their own storage (tensors cloned, modules deep-copied).

    The count comes from :func:`rotation_count` on the bytes of all tensor and module arguments; other
    arguments (dtypes, ints) are shared. ``max_bytes`` bounds the memory of all copies together (bytes).
    """
    args = tuple(args)
    n = rotation_count(sum(tensor_bytes(a) for a in args), l2_bytes, max_bytes, min_copies)
    return [args] + [tuple(_clone(a) for a in args) for _ in range(n - 1)]


# ----------------------------------------------------------------------------------------------------
# timing


@dataclasses.dataclass(frozen=True)
class GpuTiming:
    """What :func:`bench_gpu_time` measured. Times are milliseconds per call of the function."""

    median_ms: float
    min_ms: float
    max_ms: float
    calls_per_replay: int
    copies: int
    replays: int


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream() -> torch.cuda.Stream:
    # One warm-up/capture stream per device for the whole process: every new stream would get its own
    # cuBLAS workspace from torch, kept until exit.
    device = torch.cuda.current_device()
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


def _capture(fn: Callable, arg_sets: Sequence[tuple], calls: int, stream: torch.cuda.Stream,
             warmup: int) -> torch.cuda.CUDAGraph:
    """A graph of ``calls`` calls of ``fn`` over the rotating sets, after ``warmup`` eager runs of them all."""
    def run() -> None:
        for i in range(calls):
            fn(*arg_sets[i % len(arg_sets)])  # outputs are dropped: the graph pool reuses their memory

    graph, _ = capture(run, (), warmup=warmup, stream=stream)
    return graph


def _time_replays(graph: torch.cuda.CUDAGraph, replays: int) -> list[float]:
    """Milliseconds of each of ``replays`` back-to-back replays, from CUDA events on the current stream."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def bench_gpu_time(fn: Callable, arg_sets: Sequence[tuple], *, replay_ms: float = 1.0, replays: int = 25,
                   warmup_replays: int = 3, max_calls_per_replay: int = 512) -> GpuTiming:
    """GPU time of ``fn(*args)`` with a cold L2, by CUDA-graph replay over rotating input sets.

    The method is FlashInfer's ``flashinfer.testing.bench_gpu_time_with_cudagraph(cold_l2_cache=True)``:
    ``fn`` is called R times inside one captured CUDA graph, call ``i`` on ``arg_sets[i % len(arg_sets)]``,
    so that (with copies that together exceed the L2, see :func:`rotating_arg_sets`) each call reads
    inputs that are not in L2, and the one graph launch is amortised over R calls. Each replay is timed
    with a pair of CUDA events; the result is the median replay time divided by R.

    Steps: one eager call per input set on a side stream (lazy initialisation, cuBLAS workspaces, and
    errors surface here, outside the capture); a capture of one pass over the sets to estimate the time
    per call; R chosen as a multiple of ``len(arg_sets)`` so that a replay lasts about ``replay_ms``
    (at most ``max_calls_per_replay`` calls, at least one pass); ``warmup_replays`` untimed replays;
    ``replays`` timed ones.

    Parameters
    ----------
    fn : callable
        Runs on the current stream without host synchronisation (it is captured into a graph).
    arg_sets : sequence of tuple
        One or more argument tuples with distinct storage, e.g. from :func:`rotating_arg_sets`.
    replay_ms : float
        Target duration of one replay, in milliseconds.
    replays, warmup_replays : int
        Timed and untimed graph replays.
    max_calls_per_replay : int
        Upper bound on R.

    Returns
    -------
    GpuTiming
        Milliseconds per call (median, min and max over replays), with R, the copy count and replays.
    """
    if not arg_sets:
        raise ValueError("bench_gpu_time: `arg_sets` must hold at least one argument tuple")
    graph, calls = _prepare_graph(fn, arg_sets, replay_ms, max_calls_per_replay)
    if warmup_replays > 0:
        _time_replays(graph, warmup_replays)
    times = [t / calls for t in _time_replays(graph, replays)]
    del graph
    return GpuTiming(median_ms=statistics.median(times), min_ms=min(times), max_ms=max(times),
                     calls_per_replay=calls, copies=len(arg_sets), replays=replays)


def _prepare_graph(fn: Callable, arg_sets: Sequence[tuple], replay_ms: float,
                   max_calls_per_replay: int) -> tuple[torch.cuda.CUDAGraph, int]:
    """The eager warm-up and the capture of :func:`bench_gpu_time`: ``(graph of R calls, R)``."""
    n = len(arg_sets)
    stream = _side_stream()
    graph = _capture(fn, arg_sets, n, stream, warmup=1)  # the warm-up: one eager call per input set
    _time_replays(graph, 1)
    per_call = min(_time_replays(graph, 3)) / n
    passes = max(1, min(math.ceil(replay_ms / max(per_call * n, 1e-6)), max_calls_per_replay // n))
    calls = passes * n
    if calls != n:
        del graph
        graph = _capture(fn, arg_sets, calls, stream, warmup=0)
    return graph, calls


def bench_gpu_time_interleaved(cases: dict, *, replay_ms: float = 1.0, replays: int = 25,
                               warmup_replays: int = 3, max_calls_per_replay: int = 512,
                               on_error: Optional[Callable[[str, BaseException], None]] = None) -> dict:
    """:func:`bench_gpu_time` for several functions at once, their replays interleaved.

    ``cases`` maps a name to ``(fn, arg_sets)``. Each function is warmed up and captured as in
    :func:`bench_gpu_time`; then the timed replays go round-robin over the functions (replay i of every
    function before replay i + 1 of any), so they all run under the same clocks. Why: on an H200 the same
    GEMM timed at different places of a sequence of whole-method measurements differed by up to 25% at
    large M (2026-11-21), the chip's clock under its power limit depending on what ran just before (ncu:
    1.42 GHz during a sustained 8192^3 int8 GEMM, 1.85 GHz on small ones).

    A function whose warm-up or capture raises is passed to ``on_error(name, exc)`` (re-raised when
    ``on_error`` is None) and left out. Returns ``name -> GpuTiming``.
    """
    graphs: dict = {}
    for name, (fn, arg_sets) in cases.items():
        if not arg_sets:
            raise ValueError(f"bench_gpu_time_interleaved: `{name}` has no argument sets")
        try:
            graphs[name] = (*_prepare_graph(fn, arg_sets, replay_ms, max_calls_per_replay), len(arg_sets))
        except Exception as exc:  # noqa: BLE001 (the caller decides which failures are results)
            if on_error is None:
                raise
            on_error(name, exc)
    for _ in range(warmup_replays):
        for graph, _, _ in graphs.values():
            graph.replay()
    events = {name: [] for name in graphs}
    for _ in range(replays):
        for name, (graph, _, _) in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    out = {}
    for name, (graph, calls, copies) in graphs.items():
        times = [start.elapsed_time(end) / calls for start, end in events[name]]
        out[name] = GpuTiming(median_ms=statistics.median(times), min_ms=min(times), max_ms=max(times),
                              calls_per_replay=calls, copies=copies, replays=replays)
    return out


def cuda_kernel_times(step: Callable[[], Any]) -> list[tuple[str, float]]:
    """``(kernel name, microseconds)`` of every GPU kernel (and memcpy / memset) of one call of ``step``, from
    torch.profiler's CUDA activity, after one unprofiled call (warm-up). Raises what the profiler raises."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def copy_bandwidth_gbps(nbytes: int = 2**30, replays: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s (1e9 bytes/s), counting bytes read plus bytes written.

    Times ``dst.copy_(src)`` on ``nbytes``-byte buffers (default 1 GiB, far beyond any L2) with
    :func:`bench_gpu_time`; the median of ``replays`` replays.
    """
    # float32 elements: a copy of 1-byte elements read 2.77 TB/s on an H200 here (2026-11-21), well under
    # the ~4.3 TB/s recorded for large float copies on that machine, so it is not a ceiling.
    src = torch.randn(nbytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    timing = bench_gpu_time(lambda d, s: d.copy_(s), [(dst, src)], replays=replays)
    return 2 * nbytes / (timing.median_ms * 1e-3) / 1e9


def read_bandwidth_gbps(nbytes: int = 2**30, replays: int = 10) -> float:
    """Device read bandwidth in GB/s (1e9 bytes/s): ``x.amax()`` over an ``nbytes``-byte float32 tensor
    (default 1 GiB), timed with :func:`bench_gpu_time`, median of ``replays``. A streaming read with a
    negligible write, the access pattern of a GEMM at small M, which mostly reads its weight."""
    x = torch.randn(nbytes // 4, dtype=torch.float32, device="cuda")
    timing = bench_gpu_time(lambda t: t.amax(), [(x,)], replays=replays)
    return nbytes / (timing.median_ms * 1e-3) / 1e9
