"""Helpers shared by the parts of bench/bench_moe.py (the grouped GEMM, the experts layer, the whole MoE block):
error messages, relative errors, the interleaved graph timing of a point's methods and the eager timing.

bench/ is on sys.path when the script runs (``python bench/bench_moe.py``); the tests load this file by name."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Collection

import torch


def sync(device: str) -> None:
    """``torch.cuda.synchronize()`` on ``device == "cuda"``; nothing on the CPU (the tests' flow)."""
    if device == "cuda":
        torch.cuda.synchronize()


def short_error(exc: BaseException) -> str:
    """``"<ExceptionType>: <first line of the message>"``, at most 300 characters."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius norms, float64)."""
    out, ref = out.double(), ref.double()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-300))


def checked_rel_err(out: torch.Tensor, ref: torch.Tensor, bound: float, what: str, reference: str) -> float:
    """`rel_err` of ``out`` against ``ref``; raises `cutlass_w8a8.testing.report.AccuracyError` (naming ``what`` and
    ``reference``) unless it is below ``bound``: a bench never times a wrong result."""
    from cutlass_w8a8.testing.report import AccuracyError

    err = rel_err(out, ref)
    if not err < bound:
        raise AccuracyError(f"{what} relative error {err:.3g} vs {reference} (bound {bound:g})")
    return err


def time_cases(cases: dict, errors: dict, bu: Any, args: argparse.Namespace,
               optional: Collection[str]) -> dict[str, Any]:
    """``bu.bench_gpu_time_interleaved`` of ``cases`` (``name -> (fn, arg_sets)``) with ``args.replay_ms`` /
    ``args.replays``; a failure of a method in ``optional`` goes to ``errors[name]`` (any other is raised)."""
    def on_error(name: str, exc: BaseException) -> None:
        if name not in optional:
            raise exc
        errors[name] = short_error(exc)

    return bu.bench_gpu_time_interleaved(cases, replay_ms=args.replay_ms, replays=args.replays, on_error=on_error)


def time_eager(fns: dict[str, Callable[[], Any]], steps: int, warmup: int = 3,
               device: str = "cuda") -> dict[str, dict[str, float]]:
    """Milliseconds per eager call from CUDA events around each call (host launches included), the functions
    interleaved; median, and the host wall-clock per call of each function."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync(device)
    out = {}
    events = {n: [] for n in fns}
    walls = {n: 0.0 for n in fns}
    for _ in range(steps):
        for n, fn in fns.items():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            s.record()
            fn()
            e.record()
            walls[n] += time.perf_counter() - t0
            events[n].append((s, e))
    sync(device)
    for n, evs in events.items():
        out[n] = {"median_ms": statistics.median(s.elapsed_time(e) for s, e in evs),
                  "host_ms": walls[n] * 1e3 / steps}
    return out
