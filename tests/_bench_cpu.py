"""Support shared by the CPU tests of the bench/ scripts: a script loaded from its file under its own module name.
The benchmarks themselves need a GPU; these tests keep their pieces honest between GPU runs."""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
import sys
import time

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


@contextlib.contextmanager
def loaded_bench(name: str):
    """bench/{name}.py executed as module ``name``, which is put in ``sys.modules`` (the scripts import their
    siblings by name) for the duration of the ``with`` block and removed after. Yields the module."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, name, mod)
        spec.loader.exec_module(mod)
        yield mod


@contextlib.contextmanager
def loaded_benches(*names: str):
    """bench/{name}.py for each of ``names``, executed in that order (a script after the siblings it imports by
    name), each put in ``sys.modules`` under its name for the duration of the ``with`` block and removed after.
    Yields ``{name: module}``."""
    mods = {}
    with pytest.MonkeyPatch.context() as mp:
        for name in names:
            spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
            mod = importlib.util.module_from_spec(spec)
            mp.setitem(sys.modules, name, mod)
            spec.loader.exec_module(mod)
            mods[name] = mod
        yield mods


class FakeEvent:
    """Stand-in for ``torch.cuda.Event`` on the CPU: ``record`` notes ``time.perf_counter()`` and ``elapsed_time``
    returns the wall time between two recorded events in milliseconds (the unit CUDA events report)."""

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3
