"""bench/bench_gemm.py's torchao peers (``--torchao``): `make_torchao_peers` reads the flag and imports torchao,
`TorchaoPeers` quantizes a copy of each shape's bf16 ``nn.Linear`` per config and compiles the forward, and
`check_torchao` checks each peer's first call against the bf16 linear.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any, Callable, Optional

import torch

from _gemm_accuracy import FP8_LINEAR_REL_TOL, LINEAR_REL_TOL, rel_fro_error
from _gemm_methods import TORCHAO_FP8_METHODS, TORCHAO_METHODS, TORCHAO_PEERS, short_error

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

