"""Loads bench/bench_m1_torchao.py for tests/bench/test_bench_m1_torchao_{cpu,cuda}.py. The script imports its sibling
modules (bench/_gemm_*.py, bench/_m1_torchao_report.py) as top-level modules, bench/ being on sys.path when it
runs as ``python bench/bench_m1_torchao.py``; here they are loaded from their files and registered in
``sys.modules`` for one test (pytest's ``monkeypatch``), without touching sys.path."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
# The script's sibling modules, in import order.
HELPERS = ("_gemm_methods", "_gemm_accuracy", "_gemm_torchao", "_m1_torchao_report")


def load_bench(monkeypatch):
    """``(bench_m1_torchao, _m1_torchao_report)`` as modules, registered in sys.modules until the test ends."""
    def load(name):
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, mod)
        spec.loader.exec_module(mod)
        return mod

    for name in HELPERS:
        load(name)
    return load("bench_m1_torchao"), sys.modules["_m1_torchao_report"]
