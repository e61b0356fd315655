"""W8A8Linear at M = 1 (decode) against torchao int8 weight-only + torch.compile, on the Llama-3 linear shapes.

Issue 18's target: ``W8A8Linear`` at M = 1 >= 1.0x torchao int8 weight-only + compile on every Llama-3 8B/70B
shape, activation quantization included. For every shape of `cutlass_w8a8.testing.shapes.SHAPES` (the names
of bench/bench_gemm.py and bench/bench_decode_gemm.py) and every M of ``--m`` (default 1), on the current
CUDA device, all methods built from ONE bf16 ``nn.Linear(K, N, bias=False)`` (its default random init) and
called on fresh ``x = randn(M, K)`` bfloat16:

- ``w8a8``: ``cutlass_w8a8.W8A8Linear.from_float(linear)`` (default `W8A8Config`: int8, per-channel weight
  scales, dynamic per-token activation quantization), called eagerly: its forward is the activation
  quantization plus the GEMM.
- ``w8a8_fp8`` (``--fp8``, compute capability >= 8.9): the same with ``W8A8Config(dtype=float8_e4m3fn)``.
- ``torchao_int8wo``: a deep copy of the linear quantized by ``torchao.quantization.quantize_(m,
  Int8WeightOnlyConfig())`` (torchao's defaults), called through ``torch.compile(fn, fullgraph=True,
  dynamic=False)`` (default mode: no max-autotune; static shapes, so every (shape, M) gets kernels
  specialized to it, torchao's best case; dynamo's caches are reset per shape). It is compiled by its first
  call, then run once on every rotating copy, all before any graph capture.
- ``bf16``: the bf16 ``nn.Linear`` itself (``F.linear``, cuBLAS), the reference point.

Correctness first: each method's output is compared with the fp32 reference ``x.float() @ W.float().t()``
(W: the linear's bf16 weight, fp32 matmul precision "highest"); a relative Frobenius error at or above its
bound (bench/_gemm_accuracy.py: `LINEAR_REL_TOL` for the int8 methods, `FP8_LINEAR_REL_TOL` for fp8,
`GEMM_REL_TOL` for bf16) is recorded as an error of that point and the method is not timed.

Timing: `cutlass_w8a8.testing.timers.bench_gpu_time_interleaved`: CUDA-graph replays of R calls over rotating
copies of the input AND the module (weights included, together > 2x the L2), so every call streams its
weights from HBM; median of ``--replays`` replays; the methods of a point are captured first and their timed
replays interleaved. A method whose warm-up or capture fails is timed instead with CUDA events around eager
calls over the same copies (`time_eager`; host launch overhead included) and marked so in the JSON and the table.

Reported per point: us per call, ``w8a8 x torchao`` = t(torchao_int8wo) / t(w8a8) (> 1: ours faster),
``w8a8 x bf16`` = t(bf16) / t(w8a8), weight TB/s (1e12 B/s) per method = bytes of the module's parameters and
buffers (`timers.tensor_bytes`, torchao's packed tensors counted by what they hold) / time; and a line per
target (bench/_m1_torchao_report.py `TARGETS`) per M: met / NOT met / incomplete / not measured, with the worst shape.

torchao missing or failing: the reason is printed and recorded, w8a8 and bf16 are still timed (exit 0).
Exit status 1 only when one of our methods (or bf16) failed or was too inaccurate at some point.

Writes ``m1_torchao_<device>.json``, ``.md`` and (with matplotlib) ``.png`` to ``--out`` (default
bench/results), and prints the elapsed time.

Examples::

    python bench/bench_m1_torchao.py                       # 8 shapes, M = 1
    python bench/bench_m1_torchao.py --shapes 8b --m 1,2,4,8,16 --fp8
    python bench/bench_m1_torchao.py --no-torchao
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch

from cutlass_w8a8.testing.cli import finish_sweep_args, int_list
from cutlass_w8a8.testing.report import provenance, publish, require_cuda_extension
from cutlass_w8a8.testing.shapes import SHAPES
from cutlass_w8a8.testing.timers import GpuTiming

# bench/ is on sys.path (python bench/bench_m1_torchao.py): the accuracy bounds, the torchao config names and
# the compiled forward are bench_gemm.py's.
from _gemm_accuracy import FP8_LINEAR_REL_TOL, GEMM_REL_TOL, LINEAR_REL_TOL, rel_fro_error
from _gemm_methods import TORCHAO_PEERS, module_forward, short_error
from _gemm_torchao import import_torchao, torchao_forward
from _m1_torchao_report import METHODS, fmt, derive, evaluate_targets, plot_results, render_markdown

SCRIPT = "bench_m1_torchao.py"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Relative Frobenius error bounds against the fp32 reference, by method (bench/_gemm_accuracy.py's).
TOLERANCES = {"w8a8": LINEAR_REL_TOL, "w8a8_fp8": FP8_LINEAR_REL_TOL, "torchao_int8wo": LINEAR_REL_TOL,
              "bf16": GEMM_REL_TOL}
# Failures of these make the exit status 1; torchao's are results (it may be missing or broken).
OWN_METHODS = ("w8a8", "w8a8_fp8", "bf16")
TORCHAO_CONFIG = next(cls for name, cls, _ in TORCHAO_PEERS if name == "torchao_int8wo")
ROTATE_BYTES = 4 * 2**30  # cap on the rotating copies of one method (bytes)
EAGER_MIN_CALLS = 16  # calls per timed replay of the eager fallback (rounded up to whole passes over the copies)


# ----------------------------------------------------------------------------------------------------
# command line


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line; adds ``m_values`` (sorted, unique) and ``shape_list`` ((name, N, K) tuples)."""
    parser = argparse.ArgumentParser(
        description="Time W8A8Linear at M = 1 against torchao int8 weight-only + torch.compile and bf16 "
                    "nn.Linear on the Llama-3 8B/70B linear shapes (cold-L2 CUDA-graph timing).")
    parser.add_argument("--shapes", default=None, metavar="LIST",
                        help="comma-separated substrings; keep the shapes whose name contains one "
                             f"(names: {', '.join(s[0] for s in SHAPES)})")
    parser.add_argument("--m", type=int_list(), default=[1], metavar="LIST",
                        help="comma-separated token counts M (default: 1), e.g. 1,2,4,8,16")
    parser.add_argument("--fp8", action="store_true", help="also time W8A8Linear with float8_e4m3fn (cc >= 8.9)")
    parser.add_argument("--torchao", action=argparse.BooleanOptionalAction, default=True,
                        help="time torchao int8 weight-only + torch.compile (default: on; left out with a "
                             "printed reason when torchao does not import)")
    parser.add_argument("--replays", type=int, default=25, help="timed CUDA-graph replays per method and point")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results"), metavar="DIR",
                        help="output folder for m1_torchao_<device>.{json,md,png} (default: bench/results)")
    parser.add_argument("--seed", type=int, default=0, help="torch random seed")
    return finish_sweep_args(parser, parser.parse_args(argv))


# ----------------------------------------------------------------------------------------------------
# accuracy and failures (no GPU needed; the ratios, targets and report are in bench/_m1_torchao_report.py)


def own_failures(results: dict[str, Any]) -> list[str]:
    """``"<method> at <shape> M=<m>: <error>"`` for each failure of `OWN_METHODS` (the exit status is 1 when any)."""
    return [f"{name} at {p['shape']} M={p['M']}: {msg}" for p in results["points"]
            for name, msg in p["errors"].items() if name in OWN_METHODS]


def check_output(name: str, out: torch.Tensor, ref: torch.Tensor) -> tuple[float, Optional[str]]:
    """``(relative Frobenius error of out against ref, None)``, or with an ``AccuracyError: ...`` message when
    the error is not below ``TOLERANCES[name]`` (NaN included). ``out`` ``(M, N)`` any float dtype, ``ref``
    ``(M, N)`` float32."""
    rel = rel_fro_error(out, ref)
    tol = TOLERANCES[name]
    if not rel < tol:
        return rel, f"AccuracyError: relative Frobenius error {rel:.3g} against the fp32 reference is not below {tol:g}"
    return rel, None


def fp32_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x.float() @ weight.float().t()``, ``(M, N)`` float32, with fp32 matmul precision "highest" (no TF32,
    whatever torchao's ``set_inductor_config`` set); x ``(M, K)``, weight ``(N, K)``."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        return x.float() @ weight.float().t()
    finally:
        torch.set_float32_matmul_precision(previous)


# ----------------------------------------------------------------------------------------------------
# GPU: the torchao column, timing, the sweep


class TorchaoInt8WO:
    """torchao int8 weight-only: ``quantize_(deepcopy(linear), Int8WeightOnlyConfig())`` per shape, called through
    one ``torch.compile(torchao_forward, fullgraph=True, dynamic=False)`` (retried without fullgraph, once and
    for the rest of the run, when dynamo reports a graph break). Left out of the rest of the run (`left_out`)
    when it fails at every M of the first shape."""

    def __init__(self, ao: Any, version: str):
        self.ao, self.version = ao, version
        self.fullgraph = True
        self.compiled = torch.compile(torchao_forward, fullgraph=True, dynamic=False)
        self.config_repr: Optional[str] = None
        self.left_out: Optional[str] = None
        self.compile_s = 0.0
        self._shapes, self._ok, self._first_error = 0, False, None
        for key in ("recompile_limit", "cache_size_limit"):  # one compile per M of a shape, and spare
            if hasattr(torch._dynamo.config, key):
                setattr(torch._dynamo.config, key, max(getattr(torch._dynamo.config, key), 64))
                break

    def quantize(self, linear: torch.nn.Module) -> tuple[Optional[torch.nn.Module], Optional[str]]:
        """A new shape: dynamo's caches reset, ``(quantized copy of linear, None)`` or ``(None, error)``."""
        torch._dynamo.reset()
        precision = torch.get_float32_matmul_precision()
        try:
            config = getattr(self.ao.quantization, TORCHAO_CONFIG)()
            self.config_repr = self.config_repr or repr(config)
            module = copy.deepcopy(linear)
            self.ao.quantization.quantize_(module, config)
            return module, None
        except Exception as exc:  # noqa: BLE001 (a torchao that fails here is a result)
            return None, f"quantize_ failed: {short_error(exc)}"
        finally:
            torch.set_float32_matmul_precision(precision)  # set_inductor_config=True sets "high"

    def first_call(self, module: torch.nn.Module, x: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[str]]:
        """Compile and run once: ``(output, None)`` or ``(None, error)``; adds the seconds to `compile_s`."""
        t0 = time.perf_counter()
        try:
            while True:
                try:
                    out = self.compiled(module, x)
                    torch.cuda.synchronize()
                    return out, None
                except Exception as exc:  # noqa: BLE001 (a torchao that fails here is a result)
                    if not (self.fullgraph and isinstance(exc, getattr(torch._dynamo.exc, "Unsupported", ()))):
                        return None, short_error(exc)
                    print(f"{SCRIPT}: torchao fullgraph=True failed ({short_error(exc)}); compiling without it",
                          flush=True)
                    self.fullgraph = False
                    self.compiled = torch.compile(torchao_forward, dynamic=False)
        finally:
            self.compile_s += time.perf_counter() - t0

    def end_shape(self, shape: str, ok: bool, error: Optional[str]) -> None:
        self._shapes += 1
        self._ok = self._ok or ok
        self._first_error = self._first_error or error
        if self._shapes == 1 and not self._ok:
            self.left_out = f"failed at every M of {shape}: {self._first_error}"
            print(f"{SCRIPT}: torchao left out: {self.left_out}", flush=True)

    def summary(self) -> dict[str, Any]:
        return {"enabled": True, "version": self.version, "config": self.config_repr, "fullgraph": self.fullgraph,
                "compile": f"torch.compile(fn, fullgraph={self.fullgraph}, dynamic=False), default mode",
                "left_out": self.left_out}


def time_eager(fn: Callable, arg_sets: list[tuple], replays: int, warmup: int = 2) -> GpuTiming:
    """The fallback timer for a method whose CUDA-graph timing failed: CUDA events around ``calls`` eager calls
    (whole passes over ``arg_sets``, at least `EAGER_MIN_CALLS`), median of ``replays``; ms per call, host
    launch overhead included (the GPU waits for the host when the calls are shorter than their launches)."""
    n = len(arg_sets)
    calls = n * max(1, math.ceil(EAGER_MIN_CALLS / n))

    def one() -> None:
        for i in range(calls):
            fn(*arg_sets[i % n])

    for _ in range(warmup):
        one()
    events = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        one()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) / calls for s, e in events]
    return GpuTiming(median_ms=statistics.median(times), min_ms=min(times), max_ms=max(times),
                     calls_per_replay=calls, copies=n, replays=replays)


def time_cases(cases: dict[str, tuple[Callable, list[tuple]]], replays: int, bu: Any
               ) -> tuple[dict[str, GpuTiming], dict[str, str], dict[str, str], dict[str, str]]:
    """Time ``cases`` (name -> ``(fn, rotating arg sets)``) with ``bu.bench_gpu_time_interleaved``; a case whose
    warm-up or capture raises is timed with `time_eager` instead. Returns ``(timings, timing method by name
    ("graph" or "eager"), why each eager one is, errors of the cases that neither way could time)``."""
    graph_errors: dict[str, str] = {}
    timings = bu.bench_gpu_time_interleaved(cases, replays=replays,
                                            on_error=lambda name, exc: graph_errors.__setitem__(name, short_error(exc)))
    method = {name: "graph" for name in timings}
    notes, errors = {}, {}
    for name, why in graph_errors.items():
        try:
            timings[name] = time_eager(*cases[name], replays=replays)
            method[name], notes[name] = "eager", f"CUDA-graph timing failed ({why}); CUDA events around eager calls"
        except Exception as exc:  # noqa: BLE001
            errors[name] = f"CUDA-graph timing failed ({why}); eager timing failed too: {short_error(exc)}"
    return timings, method, notes, errors


def measure_point(shape: str, n: int, k: int, m: int, modules: dict[str, torch.nn.Module],
                  ao: Optional[TorchaoInt8WO], args: argparse.Namespace, bu: Any, l2_bytes: int) -> dict[str, Any]:
    """Check, then time, every method of ``modules`` (name -> module on CUDA) at one (shape, M)."""
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    ref = fp32_reference(x, modules["bf16"].weight)
    errors: dict[str, str] = {}
    rel: dict[str, float] = {}
    fns: dict[str, Callable] = {}
    compile_s = None
    for name, module in modules.items():
        if name == "torchao_int8wo":
            before = ao.compile_s
            out, err = ao.first_call(module, x)
            compile_s, fn = ao.compile_s - before, ao.compiled
        else:
            fn = module_forward
            try:
                out, err = fn(module, x), None
            except Exception as exc:  # noqa: BLE001 (recorded; own failures make the exit status 1)
                out, err = None, short_error(exc)
        if err is None:
            rel[name], err = check_output(name, out, ref)
        if err is not None:
            errors[name] = err
        else:
            fns[name] = fn
    cases, warm_s = {}, None
    for name, fn in fns.items():
        try:
            sets = bu.rotating_arg_sets((modules[name], x), l2_bytes, ROTATE_BYTES)
            if name == "torchao_int8wo":  # any recompile for a copy happens now, not inside a capture
                t0 = time.perf_counter()
                for s in sets:
                    fn(*s)
                torch.cuda.synchronize()
                warm_s = time.perf_counter() - t0
            cases[name] = (fn, sets)
        except Exception as exc:  # noqa: BLE001
            errors[name] = f"rotating copies: {short_error(exc)}"
    timings, method, notes, timing_errors = time_cases(cases, args.replays, bu)
    errors.update(timing_errors)
    del cases
    time_us = {name: timings[name].median_ms * 1e3 for name in METHODS if name in timings}
    weight_bytes = {name: bu.tensor_bytes(mod) for name, mod in modules.items()}
    return {"shape": shape, "N": n, "K": k, "M": m, "time_us": time_us, "timing_method": method,
            "timing_notes": notes, "errors": errors, "rel_err": rel, "weight_bytes": weight_bytes,
            "timing": {name: {"calls_per_replay": t.calls_per_replay, "copies": t.copies,
                              "min_us": t.min_ms * 1e3, "max_us": t.max_ms * 1e3} for name, t in timings.items()},
            "torchao_compile_s": compile_s, "torchao_warm_s": warm_s, "derived": derive(time_us, weight_bytes)}


def build_modules(n: int, k: int, cw: Any, fp8: bool, ao: Optional[TorchaoInt8WO],
                  errors: dict[str, str]) -> dict[str, torch.nn.Module]:
    """name -> module of one shape, all from one bf16 ``nn.Linear(k, n, bias=False)``; what fails to build goes
    to ``errors`` (recorded at every M of the shape)."""
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    modules = {"w8a8": cw.W8A8Linear.from_float(linear)}
    if fp8:
        try:
            modules["w8a8_fp8"] = cw.W8A8Linear.from_float(linear, cw.W8A8Config(dtype=torch.float8_e4m3fn))
        except Exception as exc:  # noqa: BLE001 (a build without fp8 kernels)
            errors["w8a8_fp8"] = short_error(exc)
    if ao is not None and ao.left_out is None:
        module, err = ao.quantize(linear)
        if err is None:
            modules["torchao_int8wo"] = module
        else:
            errors["torchao_int8wo"] = err
    modules["bf16"] = linear
    return modules


def run(args: argparse.Namespace, cw: Any, bu: Any, ao: Optional[TorchaoInt8WO], ao_note: Optional[str],
        t_start: float) -> dict[str, Any]:
    """Every (shape, M) point; returns the results dict (`render_markdown`'s input)."""
    name = torch.cuda.get_device_name()
    l2_bytes = bu.l2_cache_bytes()
    fp8 = args.fp8 and torch.cuda.get_device_capability() >= (8, 9)
    if args.fp8 and not fp8:
        print(f"{SCRIPT}: --fp8 left out: it needs compute capability >= 8.9", flush=True)
    results = {
        **provenance(name, REPO_ROOT),
        "l2_bytes": l2_bytes,
        "hbm_GBps_datasheet": bu.hbm_bandwidth_gbps(name),
        "pdl": bool(cw.pdl_enabled()),
        "timing": {"method": "CUDA-graph replay over rotating copies of x and the module (> 2x L2), median "
                             "replay / calls; eager CUDA events where the graph timing failed",
                   "replays": args.replays, "order": "the methods of a point captured first, replays interleaved"},
        "tolerances": dict(TOLERANCES),
        "fp8": fp8,
        "torchao": {"enabled": False, "reason": ao_note},
        "m_values": args.m_values,
        "shapes": [{"name": s, "N": n, "K": k} for s, n, k in args.shape_list],
        "points": [],
    }
    for shape, n, k in args.shape_list:
        build_errors: dict[str, str] = {}
        modules = build_modules(n, k, cw, fp8, ao, build_errors)
        ao_ok, ao_err = False, build_errors.get("torchao_int8wo")
        for m in args.m_values:
            p = measure_point(shape, n, k, m, modules, ao, args, bu, l2_bytes)
            p["errors"] = {**build_errors, **p["errors"]}
            ao_ok = ao_ok or "torchao_int8wo" in p["time_us"]
            ao_err = ao_err or p["errors"].get("torchao_int8wo")
            results["points"].append(p)
            t, r = p["time_us"], p["derived"]["ratios"]
            print(f"{shape:>15} M={m:>2}: w8a8 {fmt(t.get('w8a8'), '.1f')} us, ao int8wo "
                  f"{fmt(t.get('torchao_int8wo'), '.1f')} us, bf16 {fmt(t.get('bf16'), '.1f')} us; w8a8 x ao "
                  f"{fmt(r['w8a8_x_torchao'], '.3f')}, x bf16 {fmt(r['w8a8_x_bf16'], '.3f')}", flush=True)
            for meth, msg in p["errors"].items():
                print(f"{SCRIPT}: {meth} at {shape} M={m}: {msg}", flush=True)
        if ao is not None and ao.left_out is None:
            ao.end_shape(shape, ao_ok, ao_err)
        del modules
        torch.cuda.empty_cache()
    if ao is not None:
        results["torchao"] = ao.summary()
        results["torchao_compile_s"] = ao.compile_s
    results["elapsed_s"] = time.perf_counter() - t_start
    return results


def make_torchao(args: argparse.Namespace) -> tuple[Optional[TorchaoInt8WO], Optional[str], Optional[str]]:
    """``(column, None, version)``, or ``(None, why there is none, None)`` (printed)."""
    if not args.torchao:
        return None, "--no-torchao", None
    ao, version = import_torchao()
    if ao is None:
        note = f"torchao does not import ({version})"
        print(f"{SCRIPT}: no torchao column: {note}", flush=True)
        return None, note, None
    if not hasattr(ao.quantization, TORCHAO_CONFIG):
        note = f"torchao {version} has no torchao.quantization.{TORCHAO_CONFIG}"
        print(f"{SCRIPT}: no torchao column: {note}", flush=True)
        return None, note, version
    return TorchaoInt8WO(ao, version), None, version


def main(argv: Optional[list[str]] = None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    cw = require_cuda_extension(SCRIPT)
    from cutlass_w8a8.testing import timers as bu
    ao, ao_note, ao_version = make_torchao(args)
    print(f"{SCRIPT}: {torch.cuda.get_device_name()}, torch {torch.__version__}, torchao {ao_version or '-'}; "
          f"{len(args.shape_list)} shapes x M in {args.m_values}", flush=True)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        results = run(args, cw, bu, ao, ao_note, t_start)
    results["targets"] = evaluate_targets(results)
    publish(results, render_markdown(results), args.out, "m1_torchao", plot_results)
    failures = own_failures(results)
    for f in failures:
        print(f"{SCRIPT}: FAILED: {f}", flush=True)
    print(f"{SCRIPT}: elapsed {time.perf_counter() - t_start:.1f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
