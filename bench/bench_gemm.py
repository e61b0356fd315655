"""W8A8 GEMM sweep: cutlass_w8a8 against cuBLAS bf16, torch._int_mm and torch._scaled_mm, on Llama-3 linears.

For every (shape, M) point, on the current CUDA device, in one process:

- ``bf16``: ``torch.matmul(x, w.t())``, x ``(M, K)`` and w ``(N, K)`` bfloat16 (cuBLAS).
- ``int_mm_scaled``: ``torch._int_mm(a, w.t())`` then ``(acc.float() * scale_a * scale_b).to(bf16)``,
  scale_a ``(M, 1)`` and scale_b ``(1, N)`` float32. torch refuses M <= 16; the error is recorded.
- ``torch_fp8_rowwise``: ``torch._scaled_mm`` on float8_e4m3fn with row-wise scales, bf16 out.
- ``ours_int8`` / ``ours_fp8``: ``cutlass_w8a8.scaled_mm(a, w.t(), scale_a (M, 1), scale_b (N,), bf16)``.
- ``linear_bf16`` / ``linear_w8a8``: ``nn.Linear(K, N, bias=False)`` in bf16 and its
  ``W8A8Linear.from_float`` (per-token int8 quantization of x plus the GEMM) on x.
- ``quant_int8``: that quantization alone.
- ``ours_int8_nopdl`` / ``linear_w8a8_nopdl``: ``ours_int8`` and ``linear_w8a8`` captured with programmatic
  dependent launch off (``cutlass_w8a8.set_pdl(False)``), to show what PDL is worth; the other rows use
  the default (on).
- ``linear_w8a8_fp8``: ``W8A8Linear.from_float`` of the same linear with ``W8A8Config(dtype=float8_e4m3fn)``
  (per-token fp8 quantization of x plus our fp8 GEMM), with ``--fp8``.
- torchao peers, with ``--torchao`` (default: on when ``import torchao`` works): a copy of the bf16
  ``nn.Linear`` quantized by ``torchao.quantization.quantize_`` with ``Int8WeightOnlyConfig()``
  (``torchao_int8wo``), ``Int8DynamicActivationInt8WeightConfig()`` (``torchao_int8dq``) and, with ``--fp8`` on
  compute capability >= 8.9, ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``
  (``torchao_fp8row``), each called through ``torch.compile`` (default mode, ``fullgraph=True``; without
  it only where dynamo reports a graph break). Compiled on the first call of a point, outside any capture,
  then warmed up, captured and timed like every other method; dynamo's automatic dynamic shapes compile each
  config twice per shape (M = the first value, then M dynamic), and its caches are reset between shapes. A
  config that fails to construct, or fails at every M of the first shape, is printed once and left out.

Timing (cutlass_w8a8.testing.timers.bench_gpu_time): CUDA-graph replay of R calls over rotating copies of the
inputs that together exceed twice the L2, so each call starts with a cold L2; median replay time / R. The
methods of a point are all captured first and their timed replays interleaved (see `time_methods`).
Before the timings of a point, ours is checked against a bf16 GEMM of the dequantized operands, and the
quantized linears (ours and torchao's) against the bf16 ``nn.Linear``.

Writes ``gemm_<device>.json`` (raw numbers), ``gemm_<device>.md`` (tables) and ``gemm_<device>.png``
(speedup over bf16 and TOPS against M) to ``--out``.

Examples::

    python bench/bench_gemm.py                       # full sweep
    python bench/bench_gemm.py --quick --shapes 8b   # Llama-3-8B shapes, 6 values of M
    python bench/bench_gemm.py --m 1,128,4096 --no-fp8
    python bench/bench_gemm.py --quick --no-torchao     # without the torchao columns
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
from typing import Any, Callable, Optional

import torch

from cutlass_w8a8.testing.cli import int_list
from cutlass_w8a8.testing.report import provenance, publish, require_cuda_extension
from cutlass_w8a8.testing.shapes import SHAPES, select_shapes

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
QUICK_MS = (1, 16, 64, 256, 1024, 4096)
# Upper bounds (inclusive) of the M groups of the summary table: decode, mid-size batches, prefill.
M_GROUP_BOUNDS = (16, 512, None)

# torchao peers: (method, torchao.quantization config class, label). See `TorchaoPeers`.
TORCHAO_PEERS = (
    ("torchao_int8wo", "Int8WeightOnlyConfig", "int8 weight-only"),
    ("torchao_int8dq", "Int8DynamicActivationInt8WeightConfig", "int8 dynamic activation, int8 weight"),
    ("torchao_fp8row", "Float8DynamicActivationFloat8WeightConfig", "fp8 dynamic activation, fp8 weight, per row"),
)
TORCHAO_METHODS = tuple(name for name, _, _ in TORCHAO_PEERS)
TORCHAO_FP8_METHODS = frozenset({"torchao_fp8row"})

METHODS = ("bf16", "int_mm_scaled", "torch_fp8_rowwise", "ours_int8", "ours_fp8", "linear_bf16", "linear_w8a8",
           "linear_w8a8_fp8", "quant_int8", "ours_int8_nopdl", "linear_w8a8_nopdl") + TORCHAO_METHODS
# Methods whose failure is recorded instead of aborting the run (torch's own limits, an fp8 build missing,
# the torchao peers).
OPTIONAL_METHODS = frozenset({"int_mm_scaled", "torch_fp8_rowwise", "ours_fp8", "linear_w8a8_fp8", *TORCHAO_METHODS})

# Relative Frobenius error bounds. The GEMM against the dequantized operands differs only by bf16
# rounding; the quantized linear also carries int8 quantization error (about 1% on these random inputs).
GEMM_REL_TOL = 2e-2
LINEAR_REL_TOL = 5e-2
# fp8 (e4m3, 3 mantissa bits) linears against bf16: both operands rounded to e4m3, about 2.6% rms each.
FP8_LINEAR_REL_TOL = 1e-1


class AccuracyError(RuntimeError):
    """A cutlass_w8a8 result is too far from its reference: the timings would be meaningless."""


# ----------------------------------------------------------------------------------------------------
# command line


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark cutlass_w8a8 W8A8 GEMMs against cuBLAS bf16, torch._int_mm and "
                    "torch._scaled_mm on Llama-3-8B/70B linear shapes (cold-L2 CUDA-graph timing).")
    ms = parser.add_mutually_exclusive_group()
    ms.add_argument("--m", type=int_list(), default=None, metavar="LIST",
                    help=f"comma-separated M values (default: {','.join(map(str, DEFAULT_MS))})")
    ms.add_argument("--quick", action="store_true", help=f"M in {{{','.join(map(str, QUICK_MS))}}}")
    parser.add_argument("--shapes", default=None, metavar="LIST",
                        help="comma-separated substrings; keep the shapes whose name contains one "
                             f"(names: {', '.join(s[0] for s in SHAPES)})")
    parser.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True,
                        help="also time cutlass_w8a8 with float8_e4m3fn operands (default: on)")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results"), metavar="DIR",
                        help="output folder for gemm_<device>.{json,md,png} (default: bench/results)")
    parser.add_argument("--replays", type=int, default=25, help="timed CUDA-graph replays per measurement")
    parser.add_argument("--replay-ms", type=float, default=1.0,
                        help="target duration of one replay in ms; sets the calls per replay")
    parser.add_argument("--rotate-gb", type=float, default=4.0,
                        help="memory cap in GiB for the rotating input copies of one measurement")
    parser.add_argument("--peak-tops", type=float, default=None,
                        help="dense int8/fp8 peak in TOPS for %%peak (default: from the device name)")
    parser.add_argument("--seed", type=int, default=0, help="torch random seed")
    parser.add_argument("--pdl-ab", action=argparse.BooleanOptionalAction, default=True,
                        help="also time ours and W8A8Linear with PDL off, on sm90 (default: on)")
    parser.add_argument("--torchao", action=argparse.BooleanOptionalAction, default=None,
                        help="also time torchao's int8 weight-only, int8 dynamic and fp8 row-wise linears under "
                             "torch.compile (default: on when torchao imports)")
    args = parser.parse_args(argv)
    if args.replays < 1:
        parser.error("--replays must be >= 1")
    args.m_values = sorted(set(args.m or (QUICK_MS if args.quick else DEFAULT_MS)))
    args.shape_list = select_shapes(args.shapes)
    if not args.shape_list:
        parser.error(f"--shapes {args.shapes!r} matches none of {', '.join(s[0] for s in SHAPES)}")
    return args


# ----------------------------------------------------------------------------------------------------
# inputs and the timed callables


@dataclasses.dataclass
class Weights:
    """The ``(N, K)`` weights of one shape: bf16, int8 and fp8 copies, per-channel scale ``(N,)`` float32,
    the bf16 ``nn.Linear`` with its int8 ``W8A8Linear`` and (when asked for) its fp8 one, or why that one
    could not be built, and the torchao peers' quantized copies of the linear by method name."""

    w_bf16: torch.Tensor
    w_int8: torch.Tensor
    w_fp8: torch.Tensor
    scale_b: torch.Tensor
    linear: torch.nn.Module
    qlinear: torch.nn.Module
    qlinear_fp8: Optional[torch.nn.Module] = None
    qlinear_fp8_error: Optional[str] = None
    torchao: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Activations:
    """The ``(M, K)`` activations of one point: bf16, int8 and fp8, and a per-token scale ``(M, 1)`` float32."""

    x_bf16: torch.Tensor
    a_int8: torch.Tensor
    a_fp8: torch.Tensor
    scale_a: torch.Tensor


def _random_int8(*shape: int) -> torch.Tensor:
    return torch.randint(-128, 128, shape, dtype=torch.int8, device="cuda")


def _random_fp8(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.bfloat16, device="cuda").to(torch.float8_e4m3fn)


def _random_scales(*shape: int) -> torch.Tensor:
    """Positive float32 scales, uniform in [0.5e-3, 1.5e-3)."""
    return (torch.rand(*shape, dtype=torch.float32, device="cuda") + 0.5) * 1e-3


def make_weights(n: int, k: int, w8a8_linear: type, fp8_config: Any = None) -> Weights:
    """Random weights of one shape; ``fp8_config`` (a ``W8A8Config`` with fp8) also builds the fp8 linear."""
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    wts = Weights(w_bf16=torch.randn(n, k, dtype=torch.bfloat16, device="cuda"), w_int8=_random_int8(n, k),
                  w_fp8=_random_fp8(n, k), scale_b=_random_scales(n), linear=linear,
                  qlinear=w8a8_linear.from_float(linear))
    if fp8_config is not None:
        try:
            wts.qlinear_fp8 = w8a8_linear.from_float(linear, fp8_config)
        except Exception as exc:  # noqa: BLE001 (a build without fp8 kernels: recorded, not fatal)
            wts.qlinear_fp8_error = short_error(exc)
    return wts


def make_activations(m: int, k: int) -> Activations:
    return Activations(x_bf16=torch.randn(m, k, dtype=torch.bfloat16, device="cuda"), a_int8=_random_int8(m, k),
                       a_fp8=_random_fp8(m, k), scale_a=_random_scales(m, 1))


def bf16_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, w.t())


def int_mm_scaled(a: torch.Tensor, w: torch.Tensor, scale_a: torch.Tensor, scale_b_row: torch.Tensor) -> torch.Tensor:
    return (torch._int_mm(a, w.t()).float() * scale_a * scale_b_row).to(torch.bfloat16)


def torch_fp8_rowwise(a: torch.Tensor, w: torch.Tensor, scale_a: torch.Tensor,
                      scale_b_row: torch.Tensor) -> torch.Tensor:
    return torch._scaled_mm(a, w.t(), scale_a=scale_a, scale_b=scale_b_row, out_dtype=torch.bfloat16)


def module_forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def quantize_tokens(x: torch.Tensor):
    """The activation quantization of `W8A8Linear`'s forward: dynamic per-token int8."""
    return torch.ops.cutlass_w8a8.quantize_per_token(x, torch.int8)


def without_pdl(fn: Callable, set_pdl: Callable[[bool], bool]) -> Callable:
    """``fn`` with the sm90 GEMMs launched without PDL (the setting is read at launch, so also at capture)."""

    def call(*args):
        previous = set_pdl(False)
        try:
            return fn(*args)
        finally:
            set_pdl(previous)

    return call


def build_methods(scaled_mm: Callable, wts: Weights, act: Activations, fp8: bool,
                  set_pdl: Optional[Callable[[bool], bool]] = None) -> dict[str, tuple[Callable, tuple]]:
    """``name -> (fn, args)`` for every method of the point but the torchao peers (`TorchaoPeers.methods`),
    in `METHODS` order; ``fn(*args)`` is timed. The ``*_nopdl`` methods are left out when ``set_pdl`` is
    None, ``ours_fp8`` and ``linear_w8a8_fp8`` without ``fp8`` (the latter also when it was not built)."""

    def ours(a, w, scale_a, scale_b):
        return scaled_mm(a, w.t(), scale_a, scale_b, torch.bfloat16)

    scale_b_row = wts.scale_b.view(1, -1)
    methods = {
        "bf16": (bf16_matmul, (act.x_bf16, wts.w_bf16)),
        "int_mm_scaled": (int_mm_scaled, (act.a_int8, wts.w_int8, act.scale_a, scale_b_row)),
        "torch_fp8_rowwise": (torch_fp8_rowwise, (act.a_fp8, wts.w_fp8, act.scale_a, scale_b_row)),
        "ours_int8": (ours, (act.a_int8, wts.w_int8, act.scale_a, wts.scale_b)),
        "ours_fp8": (ours, (act.a_fp8, wts.w_fp8, act.scale_a, wts.scale_b)),
        "linear_bf16": (module_forward, (wts.linear, act.x_bf16)),
        "linear_w8a8": (module_forward, (wts.qlinear, act.x_bf16)),
        "linear_w8a8_fp8": (module_forward, (wts.qlinear_fp8, act.x_bf16)),
        "quant_int8": (quantize_tokens, (act.x_bf16,)),
    }
    if set_pdl is not None:
        methods["ours_int8_nopdl"] = (without_pdl(ours, set_pdl), methods["ours_int8"][1])
        methods["linear_w8a8_nopdl"] = (without_pdl(module_forward, set_pdl), methods["linear_w8a8"][1])
    if not fp8:
        del methods["ours_fp8"]
    if not fp8 or wts.qlinear_fp8 is None:
        del methods["linear_w8a8_fp8"]
    return methods


def short_error(exc: BaseException) -> str:
    """The first line of an exception's message, with its type, at most 300 characters."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


# ----------------------------------------------------------------------------------------------------
# accuracy guard


def rel_fro_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref||_F / ||ref||_F`` in float32."""
    ref = ref.float()
    return (torch.linalg.vector_norm(out.float() - ref) / torch.linalg.vector_norm(ref)).item()


def dequantized_reference(a: torch.Tensor, w: torch.Tensor, scale_a: torch.Tensor,
                          scale_b: torch.Tensor) -> torch.Tensor:
    """bf16 GEMM of the dequantized operands: ``(a * scale_a) @ (w * scale_b[:, None]).t()``, ``(M, N)``."""
    a_deq = (a.float() * scale_a).to(torch.bfloat16)
    w_deq = (w.float() * scale_b.reshape(-1, 1)).to(torch.bfloat16)
    return a_deq @ w_deq.t()


def check_accuracy(methods: dict, errors: dict[str, str], where: str) -> dict[str, float]:
    """Check ours (and the quantized linears) before timing; returns relative errors by method.

    Raises AccuracyError above `GEMM_REL_TOL` (`LINEAR_REL_TOL` for ``linear_w8a8``, `FP8_LINEAR_REL_TOL` for
    ``linear_w8a8_fp8``, against ``linear_bf16``). A failing first call of an optional method is recorded in
    ``errors`` and the method is dropped from ``methods``. The torchao peers are checked by `check_torchao`.
    """
    rel = {}
    for name in ("ours_int8", "ours_fp8"):
        if name not in methods:
            continue
        fn, args = methods[name]
        try:
            out = fn(*args)
        except Exception as exc:  # noqa: BLE001 (any failure of an optional method is a result)
            if name not in OPTIONAL_METHODS:
                raise
            errors[name] = short_error(exc)
            del methods[name]
            continue
        rel[name] = rel_fro_error(out, dequantized_reference(*args))
    ref_fn, ref_args = methods["linear_bf16"]
    ref = ref_fn(*ref_args)
    for name in ("linear_w8a8", "linear_w8a8_fp8"):
        if name not in methods:
            continue
        fn, args = methods[name]
        try:
            out = fn(*args)
        except Exception as exc:  # noqa: BLE001
            if name not in OPTIONAL_METHODS:
                raise
            errors[name] = short_error(exc)
            del methods[name]
            continue
        rel[name] = rel_fro_error(out, ref)
    tols = {"linear_w8a8": LINEAR_REL_TOL, "linear_w8a8_fp8": FP8_LINEAR_REL_TOL}
    for name, err in rel.items():
        tol = tols.get(name, GEMM_REL_TOL)
        if not err < tol:  # also catches NaN
            raise AccuracyError(f"{where}: {name} relative Frobenius error {err:.3g} is not below {tol:g}")
    return rel


# ----------------------------------------------------------------------------------------------------
# torchao peers


def import_torchao() -> tuple[Optional[Any], str]:
    """``(torchao, its version)``, or ``(None, why it does not import)``."""
    try:
        import torchao
        import torchao.quantization  # noqa: F401
    except Exception as exc:  # noqa: BLE001 (not installed, or a torchao that fails on this torch)
        return None, short_error(exc)
    return torchao, str(getattr(torchao, "__version__", "unknown"))


def torchao_forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What a torchao column times, through ``torch.compile``: the quantized module's forward."""
    return module(x)


class TorchaoPeers:
    """The torchao columns of a sweep: each config of `TORCHAO_PEERS` applied to a copy of every shape's bf16
    ``nn.Linear``, called through ``torch.compile(torchao_forward, fullgraph=True)`` (one compiled function
    per config, so that each keeps its own fallback).

    A config that fails to construct or to quantize, or whose every point of the first shape failed, is
    printed once and left out of the rest of the run (`disabled`); a failure at some points only is recorded
    in those points' errors, as for the other optional methods.
    """

    def __init__(self, ao: Any, version: str, fp8: bool):
        self.ao, self.version = ao, version
        self.names = [name for name in TORCHAO_METHODS if fp8 or name not in TORCHAO_FP8_METHODS]
        self.labels = {name: label for name, _, label in TORCHAO_PEERS}
        self.disabled: dict[str, str] = {}
        self.fullgraph = {name: True for name in self.names}
        self.compiled = {name: torch.compile(torchao_forward, fullgraph=True) for name in self.names}
        self.config_repr: dict[str, str] = {}
        self._ok_in_shape: set[str] = set()
        self._first_error: dict[str, str] = {}
        self._shapes_done = 0
        # Each shape compiles each config about twice (M = 1, then M dynamic) and a fallback may add some:
        # stay clear of dynamo's per-function recompile limit, past which it would silently run eagerly.
        for key in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, key):
                setattr(torch._dynamo.config, key, max(getattr(torch._dynamo.config, key), 64))
                break

    def active(self) -> list[str]:
        return [name for name in self.names if name not in self.disabled]

    def config(self, name: str) -> Any:
        """A new config object of the peer, its defaults but the fp8 one's per-row granularity."""
        q = self.ao.quantization
        class_name = next(cls for method, cls, _ in TORCHAO_PEERS if method == name)
        kwargs = {}
        if name in TORCHAO_FP8_METHODS:
            per_row = getattr(q, "PerRow", None)
            if per_row is None:  # older torchao
                from torchao.quantization.granularity import PerRow as per_row
            kwargs["granularity"] = per_row()
        return getattr(q, class_name)(**kwargs)

    def disable(self, name: str, msg: str) -> None:
        self.disabled[name] = msg
        print(f"bench_gemm.py: torchao column `{name}` left out: {msg}", flush=True)

    def quantize(self, linear: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """A new shape: fresh dynamo caches, and ``linear`` quantized by each active config (on copies)."""
        torch._dynamo.reset()  # the previous shape's compiled code and its automatic-dynamic state go
        self._ok_in_shape.clear()
        modules = {}
        precision = torch.get_float32_matmul_precision()
        for name in self.active():
            try:
                config = self.config(name)
                self.config_repr.setdefault(name, repr(config))
                module = copy.deepcopy(linear)
                self.ao.quantization.quantize_(module, config)
                modules[name] = module
            except Exception as exc:  # noqa: BLE001
                self.disable(name, f"construction failed: {short_error(exc)}")
            finally:
                # set_inductor_config=True (torchao's default) also sets float32 matmul precision "high";
                # keep the process's setting for the other methods (bf16 and int8: unaffected anyway).
                torch.set_float32_matmul_precision(precision)
        return modules

    def methods(self, modules: dict[str, torch.nn.Module], x: torch.Tensor) -> dict[str, tuple[Callable, tuple]]:
        return {name: (self.compiled[name], (module, x)) for name, module in modules.items()
                if name not in self.disabled}

    def first_call(self, name: str, args: tuple) -> tuple[Optional[torch.Tensor], Optional[str]]:
        """Compile (when needed) and run one peer: ``(output, None)`` or ``(None, error)``. A fullgraph
        compile that dynamo refuses (a graph break) is retried once, and from then on, without fullgraph."""
        try:
            return self.compiled[name](*args), None
        except Exception as exc:  # noqa: BLE001
            if self.fullgraph[name] and isinstance(exc, getattr(torch._dynamo.exc, "Unsupported", ())):
                print(f"bench_gemm.py: torchao `{name}`: fullgraph=True failed ({short_error(exc)}); "
                      "compiling it without fullgraph", flush=True)
                self.fullgraph[name] = False
                self.compiled[name] = torch.compile(torchao_forward)
                return self.first_call(name, args)
            return None, short_error(exc)

    def record(self, name: str, error: Optional[str], where: str) -> None:
        """The outcome of a peer's first call at one point; the first error of each peer is printed."""
        if error is None:
            self._ok_in_shape.add(name)
        elif name not in self._first_error:
            self._first_error[name] = error
            print(f"bench_gemm.py: torchao `{name}` failed at {where}: {error}", flush=True)

    def end_shape(self, shape: str) -> None:
        """After the first shape, leave out the peers that failed at every point of it."""
        self._shapes_done += 1
        if self._shapes_done == 1:
            for name in self.active():
                if name not in self._ok_in_shape:
                    self.disable(name, f"failed at every M of {shape}: {self._first_error.get(name, '?')}")

    def summary(self) -> dict[str, Any]:
        return {"enabled": True, "version": self.version,
                "compile": "torch.compile(default mode), dynamo automatic dynamic shapes, caches reset per shape",
                "configs": {name: {"label": self.labels[name], "config": self.config_repr.get(name),
                                   "fullgraph": self.fullgraph[name], "left_out": self.disabled.get(name)}
                            for name in self.names}}


def check_torchao(methods: dict, errors: dict[str, str], where: str, peers: TorchaoPeers) -> dict[str, float]:
    """First call (the compile) of each torchao peer of the point, checked against the bf16 ``nn.Linear``
    (`LINEAR_REL_TOL`, `FP8_LINEAR_REL_TOL` for fp8); a failure or an error above the bound is recorded in
    ``errors`` and drops the peer from ``methods``. Returns relative errors by method."""
    rel: dict[str, float] = {}
    ref = None
    for name in TORCHAO_METHODS:
        if name not in methods:
            continue
        args = methods[name][1]
        out, err = peers.first_call(name, args)
        methods[name] = (peers.compiled[name], args)  # the fallback compile, if one was made
        if err is None:
            if ref is None:
                ref_fn, ref_args = methods["linear_bf16"]
                ref = ref_fn(*ref_args)
            rel[name] = rel_fro_error(out, ref)
            tol = FP8_LINEAR_REL_TOL if name in TORCHAO_FP8_METHODS else LINEAR_REL_TOL
            if not rel[name] < tol:
                err = f"AccuracyError: relative Frobenius error {rel[name]:.3g} against nn.Linear is not below {tol:g}"
        peers.record(name, err, where)
        if err is not None:
            errors[name] = err
            del methods[name]
    return rel


# ----------------------------------------------------------------------------------------------------
# the sweep


def time_methods(methods: dict, errors: dict[str, str], bu: Any, l2_bytes: int,
                 args: argparse.Namespace) -> tuple[dict[str, float], dict[str, dict]]:
    """Time every method not already in ``errors``; ``(ms per call by method, timing details by method)``.

    All methods of the point are captured first and their timed replays interleaved
    (`bench_utils.bench_gpu_time_interleaved`), so every method runs under the same clocks. Timing them one
    after the other made the same kernel differ by up to 25% at large M on an H200, depending on its place
    in the sequence (2026-11-21: ``ours_int8`` against ``ours_int8_nopdl``, identical launches at M > 16).
    """
    max_bytes = int(args.rotate_gb * 2**30)
    cases = {}
    for name, (fn, fn_args) in methods.items():
        if name in errors:
            continue
        try:
            fn(*fn_args)  # first call: torch's unsupported shapes fail here, not inside a capture
        except Exception as exc:  # noqa: BLE001
            if name not in OPTIONAL_METHODS:
                raise
            errors[name] = short_error(exc)
            continue
        try:
            cases[name] = (fn, bu.rotating_arg_sets(fn_args, l2_bytes, max_bytes))
        except Exception as exc:  # noqa: BLE001 (e.g. a module that cannot be deep-copied)
            if name not in OPTIONAL_METHODS:
                raise
            errors[name] = short_error(exc)

    def on_error(name: str, exc: BaseException) -> None:
        if name not in OPTIONAL_METHODS:
            raise exc
        errors[name] = short_error(exc)

    timings = bu.bench_gpu_time_interleaved(cases, replay_ms=args.replay_ms, replays=args.replays,
                                            on_error=on_error)
    cases.clear()
    times = {name: t.median_ms for name, t in timings.items()}
    details = {name: {"calls_per_replay": t.calls_per_replay, "copies": t.copies, "min_ms": t.min_ms,
                      "max_ms": t.max_ms} for name, t in timings.items()}
    return times, details


def derive(m: int, n: int, k: int, times: dict[str, float], copy_gbps: float,
           peak_tops: Optional[float], read_gbps: Optional[float] = None) -> dict[str, Any]:
    """Derived numbers of one point: times in us, TOPS (1e12 ops/s, 2*M*N*K ops), weight GB/s (1e9 B/s,
    N*K bytes per call), and speedups (baseline time / our time). Missing inputs give None.

    ``quant_visible_share`` is the part of the ``W8A8Linear`` forward that the GEMM alone does not account
    for, ``1 - t(ours_int8) / t(linear_w8a8)``: what the quantization adds once its launch overlaps the GEMM's
    (``quant_share_of_linear_w8a8`` is the quantization kernel's own time over the forward's)."""

    def ratio(num: str, den: str) -> Optional[float]:
        return times[num] / times[den] if num in times and den in times else None

    def tops(name: str) -> Optional[float]:
        return 2 * m * n * k / (times[name] * 1e-3) / 1e12 if name in times else None

    ours_tops = tops("ours_int8")
    # quantization traffic: read x (bf16), write q (int8) and one float32 scale per token
    quant_gbps = (3 * m * k + 4 * m) / (times["quant_int8"] * 1e-3) / 1e9 if "quant_int8" in times else None
    weight_gbps = n * k / (times["ours_int8"] * 1e-3) / 1e9 if "ours_int8" in times else None
    return {
        "time_us": {name: ms * 1e3 for name, ms in times.items()},
        "ours_tops": ours_tops,
        "ours_pct_peak": 100 * ours_tops / peak_tops if ours_tops is not None and peak_tops else None,
        "ours_weight_GBps": weight_gbps,
        "ours_weight_GBps_over_copy": weight_gbps / copy_gbps if weight_gbps is not None else None,
        "ours_weight_GBps_over_read": weight_gbps / read_gbps if weight_gbps is not None and read_gbps else None,
        "ours_x_bf16": ratio("bf16", "ours_int8"),
        "ours_x_torch_fp8": ratio("torch_fp8_rowwise", "ours_int8"),
        "ours_x_int_mm": ratio("int_mm_scaled", "ours_int8"),
        "linear_w8a8_x_bf16": ratio("linear_bf16", "linear_w8a8"),
        "quant_GBps": quant_gbps,
        "quant_GBps_over_copy": quant_gbps / copy_gbps if quant_gbps is not None else None,
        "quant_share_of_linear_w8a8": ratio("quant_int8", "linear_w8a8"),
        "quant_visible_share": (1 - times["ours_int8"] / times["linear_w8a8"]
                                if "ours_int8" in times and "linear_w8a8" in times else None),
        "pdl_gain_ours_int8": ratio("ours_int8_nopdl", "ours_int8"),
        "pdl_gain_linear_w8a8": ratio("linear_w8a8_nopdl", "linear_w8a8"),
        "ours_fp8_tops": tops("ours_fp8"),
        "ours_fp8_x_bf16": ratio("bf16", "ours_fp8"),
        "ours_fp8_x_torch_fp8": ratio("torch_fp8_rowwise", "ours_fp8"),
        "linear_w8a8_fp8_x_bf16": ratio("linear_bf16", "linear_w8a8_fp8"),
        # torchao peers: their time / our W8A8Linear forward's (quantization included), > 1: ours is faster
        "linear_w8a8_x_torchao_int8wo": ratio("torchao_int8wo", "linear_w8a8"),
        "linear_w8a8_x_torchao_int8dq": ratio("torchao_int8dq", "linear_w8a8"),
        "linear_w8a8_x_torchao_fp8row": ratio("torchao_fp8row", "linear_w8a8"),
        "linear_w8a8_fp8_x_torchao_fp8row": ratio("torchao_fp8row", "linear_w8a8_fp8"),
    }


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a convenience; the sweep runs without it
        return None
    # disable=None: no bar when stderr is not a terminal (a log file would get one line of carriage returns)
    return tqdm(total=total, unit="pt", dynamic_ncols=True, disable=None)


def run_sweep(args: argparse.Namespace, cw: Any, bu: Any, peers: Optional[TorchaoPeers] = None,
              torchao_note: Optional[str] = None) -> dict[str, Any]:
    """Measure every (shape, M) point; returns the results dict that `main` writes.

    ``peers``: the torchao columns (None: none, ``torchao_note`` says why)."""
    name = torch.cuda.get_device_name()
    l2_bytes = bu.l2_cache_bytes()
    peak = args.peak_tops if args.peak_tops is not None else bu.dense_peak_tops(name)
    copy_gbps = bu.copy_bandwidth_gbps()
    read_gbps = bu.read_bandwidth_gbps()
    results = {
        **provenance(name, REPO_ROOT),
        "l2_bytes": l2_bytes,
        "copy_GBps": copy_gbps,
        "read_GBps": read_gbps,
        "pdl": bool(cw.pdl_enabled()),
        "peak_tops": peak,
        "timing": {"method": "CUDA-graph replay over rotating input copies (> 2x L2), median replay / calls",
                   "replays": args.replays, "replay_ms": args.replay_ms, "rotate_gb": args.rotate_gb,
                   "order": "the methods of a point captured first, their timed replays interleaved"},
        "tolerances": {"gemm_rel_fro": GEMM_REL_TOL, "linear_rel_fro": LINEAR_REL_TOL},
        "fp8": args.fp8,
        "torchao": {"enabled": False, "reason": torchao_note},
        "m_values": args.m_values,
        "shapes": [{"name": s, "N": n, "K": k} for s, n, k in args.shape_list],
        "points": [],
    }
    bar = _progress(len(args.shape_list) * len(args.m_values))
    try:
        fp8_config = cw.W8A8Config(dtype=torch.float8_e4m3fn) if args.fp8 else None
        for shape, n, k in args.shape_list:
            wts = make_weights(n, k, cw.W8A8Linear, fp8_config)
            if peers is not None:
                wts.torchao = peers.quantize(wts.linear)
            for m in args.m_values:
                if bar is not None:
                    bar.set_postfix_str(f"{shape} M={m}")
                results["points"].append(measure_point(shape, m, n, k, wts, args, cw, bu, l2_bytes, copy_gbps, peak,
                                                      read_gbps, peers))
                if bar is not None:
                    bar.update()
            if peers is not None:
                peers.end_shape(shape)
            del wts
            torch.cuda.empty_cache()
    finally:
        if bar is not None:
            bar.close()
        if peers is not None:
            results["torchao"] = peers.summary()
    return results


def measure_point(shape: str, m: int, n: int, k: int, wts: Weights, args: argparse.Namespace, cw: Any, bu: Any,
                  l2_bytes: int, copy_gbps: float, peak: Optional[float],
                  read_gbps: Optional[float] = None, peers: Optional[TorchaoPeers] = None) -> dict[str, Any]:
    """Check and time one (shape, M) point; times in ms per call."""
    act = make_activations(m, k)
    set_pdl = cw.set_pdl if args.pdl_ab and torch.cuda.get_device_capability() == (9, 0) else None
    methods = build_methods(cw.scaled_mm, wts, act, args.fp8, set_pdl)
    errors: dict[str, str] = {}
    if args.fp8 and wts.qlinear_fp8_error is not None:
        errors["linear_w8a8_fp8"] = wts.qlinear_fp8_error
    if peers is not None:
        methods.update(peers.methods(wts.torchao, act.x_bf16))
    rel = check_accuracy(methods, errors, f"{shape} M={m}")
    if peers is not None:
        rel.update(check_torchao(methods, errors, f"{shape} M={m}", peers))
    times, details = time_methods(methods, errors, bu, l2_bytes, args)
    del methods, act
    torch.cuda.empty_cache()
    return {"shape": shape, "N": n, "K": k, "M": m, "time_ms": times, "errors": errors, "rel_err": rel,
            "timing": details, "derived": derive(m, n, k, times, copy_gbps, peak, read_gbps)}


# ----------------------------------------------------------------------------------------------------
# reports


def _fmt(value: Optional[float], spec: str) -> str:
    return "–" if value is None else format(value, spec)


def point_table(points: list[dict]) -> str:
    """Markdown table, one row per (shape, M)."""
    rows = ["| M | shape | ours us | TOPS | %peak | weight GB/s | x bf16 | x fp8-torch | x int_mm | fp8 x fp8-torch "
            "| linear x bf16 | quant GB/s | quant share | quant visible | PDL gain | linear PDL gain |",
            "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        d = p["derived"]
        rows.append(f"| {p['M']} | {p['shape']} | {_fmt(d['time_us'].get('ours_int8'), '.1f')} "
                    f"| {_fmt(d['ours_tops'], '.1f')} | {_fmt(d['ours_pct_peak'], '.1f')} "
                    f"| {_fmt(d['ours_weight_GBps'], '.0f')} | {_fmt(d['ours_x_bf16'], '.2f')} "
                    f"| {_fmt(d['ours_x_torch_fp8'], '.2f')} | {_fmt(d['ours_x_int_mm'], '.2f')} "
                    f"| {_fmt(d['ours_fp8_x_torch_fp8'], '.2f')} | {_fmt(d['linear_w8a8_x_bf16'], '.2f')} "
                    f"| {_fmt(d['quant_GBps'], '.0f')} | {_fmt(d['quant_share_of_linear_w8a8'], '.2f')} "
                    f"| {_fmt(d.get('quant_visible_share'), '.2f')} | {_fmt(d.get('pdl_gain_ours_int8'), '.2f')} "
                    f"| {_fmt(d.get('pdl_gain_linear_w8a8'), '.2f')} |")
    return "\n".join(rows)


def torchao_table(points: list[dict]) -> str:
    """Markdown table, one row per (shape, M): our W8A8Linear forwards and the torchao peers in us, and the
    peers' time over ours."""
    names = ("linear_w8a8", "linear_w8a8_fp8", *TORCHAO_METHODS)
    heads = ("linear us", "fp8 linear us", "ao int8wo us", "ao int8dq us", "ao fp8row us")
    columns = _present(points, TORCHAO_COLUMNS)
    rows = ["| M | shape | " + " | ".join(heads) + " | " + " | ".join(c for c, _ in columns) + " |",
            "|---:|:---|" + "---:|" * (len(heads) + len(columns))]
    for p in points:
        d = p["derived"]
        cells = [_fmt(d["time_us"].get(name), ".1f") for name in names]
        cells += [_fmt(d.get(key), ".2f") for _, key in columns]
        rows.append(f"| {p['M']} | {p['shape']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def torchao_notes(results: dict[str, Any]) -> list[str]:
    """Header lines on the torchao columns: version, configs, compile mode, and what was left out."""
    info = results.get("torchao") or {}
    if not info.get("enabled"):
        return [f"- torchao columns: none ({info.get('reason') or 'not run'})"]
    lines = [f"- torchao {info['version']}: a copy of the bf16 `nn.Linear` quantized by `torchao.quantization."
             f"quantize_`, called through {info['compile']}. x ao <config> = the torchao module's time / our "
             "`W8A8Linear` forward's (quantization included; int8, or fp8 for `fp8 x ao fp8row`): > 1, ours is faster."]
    for name, c in info["configs"].items():
        state = f"left out: {c['left_out']}" if c.get("left_out") else f"fullgraph={c['fullgraph']}"
        lines.append(f"  - `{name}` ({c['label']}): `{c.get('config') or '?'}`; {state}")
    return lines


def m_groups(points: list[dict]) -> list[tuple[str, list[dict]]]:
    """Points split by `M_GROUP_BOUNDS`, each labelled with the range of M it holds, e.g. ``"1–16"``."""
    groups, lower = [], 0
    for upper in M_GROUP_BOUNDS:
        members = [p for p in points if p["M"] > lower and (upper is None or p["M"] <= upper)]
        if members:
            ms = sorted({p["M"] for p in members})
            groups.append((f"{ms[0]}–{ms[-1]}" if len(ms) > 1 else str(ms[0]), members))
        lower = upper if upper is not None else lower
    return groups


SUMMARY_COLUMNS = (("x bf16", "ours_x_bf16"), ("x fp8-torch", "ours_x_torch_fp8"), ("x int_mm", "ours_x_int_mm"),
                   ("fp8 x bf16", "ours_fp8_x_bf16"), ("fp8 x fp8-torch", "ours_fp8_x_torch_fp8"),
                   ("linear w8a8 x bf16", "linear_w8a8_x_bf16"), ("PDL gain", "pdl_gain_ours_int8"),
                   ("linear PDL gain", "pdl_gain_linear_w8a8"))
# Shown only where some point has them: the fp8 W8A8Linear and the torchao peers (W8A8Linear over them).
OPTIONAL_SUMMARY_COLUMNS = (("fp8 linear x bf16", "linear_w8a8_fp8_x_bf16"),
                            ("linear x ao int8wo", "linear_w8a8_x_torchao_int8wo"),
                            ("linear x ao int8dq", "linear_w8a8_x_torchao_int8dq"),
                            ("linear x ao fp8row", "linear_w8a8_x_torchao_fp8row"),
                            ("fp8 linear x ao fp8row", "linear_w8a8_fp8_x_torchao_fp8row"))
TORCHAO_COLUMNS = (("x ao int8wo", "linear_w8a8_x_torchao_int8wo"), ("x ao int8dq", "linear_w8a8_x_torchao_int8dq"),
                   ("x ao fp8row", "linear_w8a8_x_torchao_fp8row"),
                   ("fp8 x ao fp8row", "linear_w8a8_fp8_x_torchao_fp8row"))


def _present(points: list[dict], columns) -> tuple:
    return tuple(c for c in columns if any(p["derived"].get(c[1]) is not None for p in points))


def summary_table(points: list[dict], geomean: Callable) -> str:
    """Markdown table of geomean speedups per M group (a cell counts the points where both times exist)."""
    columns = SUMMARY_COLUMNS + _present(points, OPTIONAL_SUMMARY_COLUMNS)
    rows = ["| M | points | " + " | ".join(c for c, _ in columns) + " |",
            "|:---|---:|" + "---:|" * len(columns)]
    for label, members in m_groups(points):
        cells = [_fmt(geomean([p["derived"][key] for p in members if p["derived"].get(key) is not None]), ".2f")
                 for _, key in columns]
        rows.append(f"| {label} | {len(members)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def error_notes(points: list[dict]) -> str:
    """One line per method that failed somewhere: the values of M and the first message."""
    failed: dict[str, tuple[list[int], str]] = {}
    for p in points:
        for name, msg in p["errors"].items():
            ms, first = failed.setdefault(name, ([], msg))
            if p["M"] not in ms:
                ms.append(p["M"])
    return "\n".join(f"- `{name}` did not run at M in {{{', '.join(map(str, sorted(ms)))}}}: `{msg}`"
                     for name, (ms, msg) in failed.items())


def render_markdown(results: dict[str, Any], geomean: Callable) -> str:
    """The whole report: a header, the per-point table, the summary and any baseline that did not run."""
    commit = results.get("git_commit")
    commit_text = f"git {commit[:12]}{' (dirty)' if results.get('git_dirty') else ''}" if commit else "git: n/a"
    peak = results.get("peak_tops")
    lines = [
        f"# W8A8 GEMM benchmark: {results['device']}",
        "",
        f"- torch {results['torch_version']} (CUDA {results['cuda_version']}), {commit_text}",
        f"- L2 {results['l2_bytes'] / 2**20:.0f} MiB; device copy bandwidth {results['copy_GBps']:.0f} GB/s "
        f"(bytes read + written), read-only bandwidth {_fmt(results.get('read_GBps'), '.0f')} GB/s "
        f"(a float32 max-reduction); dense int8/fp8 peak {_fmt(peak, '.0f')} TOPS",
        f"- programmatic dependent launch (PDL) of our GEMMs: {'on' if results.get('pdl') else 'off'}. "
        "PDL gain = time with PDL off / time with it on (ours, and the whole W8A8Linear forward).",
        "- ours = `cutlass_w8a8.scaled_mm`, int8, per-token x per-channel scales, bf16 out. Times are "
        "cold-L2 CUDA-graph replays over rotating input copies, median of "
        f"{results['timing']['replays']} replays; the replays of a point's methods are interleaved, so all run "
        "under the same clocks.",
        "- x bf16 / x fp8-torch / x int_mm: time of cuBLAS bf16 / `torch._scaled_mm` fp8 row-wise / "
        "`torch._int_mm` + scaling, divided by ours (> 1: ours is faster). Weight GB/s: N*K bytes per call.",
        "- quant share: the quantization kernel's time / the W8A8Linear forward's; quant visible: "
        "1 - GEMM time / forward time, what quantizing adds to the forward.",
        *torchao_notes(results),
        "",
        "## Per shape and M",
        "",
        point_table(results["points"]),
        "",
        "## Geomean speedups by M",
        "",
        summary_table(results["points"], geomean),
    ]
    if _present(results["points"], TORCHAO_COLUMNS):
        lines += ["", "## W8A8Linear against torchao, per shape and M", "", torchao_table(results["points"])]
    notes = error_notes(results["points"])
    if notes:
        lines += ["", "## Baselines that did not run", "", notes]
    return "\n".join(lines) + "\n"


def plot_results(results: dict[str, Any], path: str) -> None:
    """PNG: speedup of ours (int8) over bf16 against M, and our TOPS against M; one line per shape."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, (ax_speed, ax_tops) = plt.subplots(1, 2, figsize=(13, 5))
    for shape in dict.fromkeys(p["shape"] for p in results["points"]):
        pts = sorted((p for p in results["points"] if p["shape"] == shape), key=lambda p: p["M"])
        for ax, key in ((ax_speed, "ours_x_bf16"), (ax_tops, "ours_tops")):
            xy = [(p["M"], p["derived"][key]) for p in pts if p["derived"][key] is not None]
            if xy:
                ax.plot(*zip(*xy), marker="o", markersize=3, label=shape)
    ax_speed.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax_speed.set_ylabel("speedup over bf16 cuBLAS (x)")
    ax_speed.set_title("cutlass_w8a8 int8 vs torch.matmul bf16")
    ax_tops.set_yscale("log")
    ax_tops.set_ylabel("TOPS (2·M·N·K / time)")
    ax_tops.set_title("cutlass_w8a8 int8 throughput")
    if results.get("peak_tops"):
        ax_tops.axhline(results["peak_tops"], color="gray", linestyle="--", linewidth=1)
        ax_tops.annotate("dense peak", xy=(0.01, results["peak_tops"]), xycoords=("axes fraction", "data"),
                         va="bottom", fontsize=8, color="gray")
    for ax in (ax_speed, ax_tops):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel("M (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    ax_speed.legend(fontsize=8)
    fig.suptitle(f"W8A8 GEMM, {results['device']}, torch {results['torch_version']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------


def make_torchao_peers(args: argparse.Namespace) -> tuple[Optional[TorchaoPeers], Optional[str]]:
    """The torchao columns `--torchao` asks for: ``(peers, None)``, or ``(None, why there are none)``
    (printed). Without the flag they are on when torchao imports."""
    if args.torchao is False:
        return None, "--no-torchao"
    ao, version = import_torchao()
    if ao is None:
        note = f"torchao does not import ({version})"
        print(f"bench_gemm.py: no torchao columns: {note}" + (" although --torchao asked for them" if args.torchao
                                                              else ""), flush=True)
        return None, note
    fp8 = args.fp8 and torch.cuda.get_device_capability() >= (8, 9)
    if args.fp8 and not fp8:
        print("bench_gemm.py: torchao fp8 row-wise left out: it needs compute capability >= 8.9", flush=True)
    print(f"bench_gemm.py: torchao {version}: timing torchao_int8wo, torchao_int8dq"
          + (", torchao_fp8row" if fp8 else "") + " (torch.compile, fullgraph)", flush=True)
    return TorchaoPeers(ao, version, fp8), None


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    cw = require_cuda_extension("bench_gemm.py")
    from cutlass_w8a8.testing import timers as bu
    peers, torchao_note = make_torchao_peers(args)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        try:
            results = run_sweep(args, cw, bu, peers, torchao_note)
        except AccuracyError as exc:
            sys.exit(f"bench_gemm.py: aborted, wrong results: {exc}")
    publish(results, render_markdown(results, bu.geomean), args.out, "gemm", plot_results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
