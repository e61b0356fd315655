"""The quick / full split of the test matrix. ``CUTLASS_W8A8_FULL_TESTS=1`` (scripts/gpu_run.sh sets it) runs
everything; without it the tests marked ``full`` skip (tests/conftest.py), so that the README's CPU command stays
quick: the parametrizations beyond the quick set (`quick_or_full`), inductor's C++ compiles, and the repeated
dynamic-shape AOT traces of `opcheck`."""

from __future__ import annotations

import os

import pytest

#: The switch, read once.
FULL_TESTS = os.environ.get("CUTLASS_W8A8_FULL_TESTS", "") not in ("", "0")
FULL_SKIP_REASON = "heavy matrix: runs with CUTLASS_W8A8_FULL_TESTS=1 (the GPU run sets it)"


def quick_or_full(values, quick) -> list:
    """``values`` as parametrize entries: those in ``quick`` as they are, the others as ``pytest.param`` with the
    ``full`` mark (same ids). A tuple value is one entry of a multi-argument parametrize."""
    return [v if v in quick else
            pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.full) for v in values]


#: torch.library.opcheck's checks (`torch.library.opcheck`'s test_utils).
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
_AOT_CHECKED: set = set()


def opcheck(op, args, test_utils=OPCHECK_UTILS) -> None:
    """``torch.library.opcheck(op, args, test_utils=...)``, where test_aot_dispatch_dynamic (an AOT-autograd trace
    with dynamic shapes: about 95 % of opcheck's CPU time, ~60 ms a call) runs, in the quick CPU run, for the first
    argument set of each op in this process only; the full run (``CUTLASS_W8A8_FULL_TESTS=1``) runs it for every
    one. The other checks (schema, autograd registration, the fake against the real kernel) run for every call."""
    import torch

    key = getattr(op, "_name", None) or getattr(op, "_qualified_op_name", None) or str(op)
    if not FULL_TESTS and "test_aot_dispatch_dynamic" in test_utils:
        if key in _AOT_CHECKED:
            test_utils = tuple(u for u in test_utils if u != "test_aot_dispatch_dynamic")
        else:
            _AOT_CHECKED.add(key)
    torch.library.opcheck(op, args, test_utils=test_utils)
