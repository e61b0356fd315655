"""bench/bench_m1_torchao.py on a GPU, small: the timing fallback (`time_cases`), and the script run end to end on
one shape in a subprocess (its torch.compile and torchao's inductor settings stay out of the test process).
Structure and accuracy only; no speed is asserted."""

import json
import os
import subprocess
import sys

import pytest
import torch

from _m1_torchao_bench import BENCH, load_bench
from cutlass_w8a8.testing.timers import device_slug

pytestmark = pytest.mark.cuda


def test_time_cases_falls_back_to_eager_timing(monkeypatch):
    bench, _ = load_bench(monkeypatch)
    from cutlass_w8a8.testing import timers as bu

    x = torch.randn(1 << 18, device="cuda")
    sets = bu.rotating_arg_sets((x,), l2_bytes=1 << 20, max_bytes=1 << 26)

    def refuses_capture(t):  # a clean refusal inside the capture: no CUDA error is left behind
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("not capturable")
        return t * 2

    def broken(t):
        raise ValueError("refused")

    cases = {"ok": (lambda t: t + 1, sets), "eager": (refuses_capture, sets), "broken": (broken, sets)}
    timings, method, notes, errors = bench.time_cases(cases, 5, bu)
    assert set(timings) == {"ok", "eager"} and method == {"ok": "graph", "eager": "eager"}
    assert "not capturable" in notes["eager"] and set(notes) == {"eager"}
    assert set(errors) == {"broken"} and "refused" in errors["broken"]
    eager = timings["eager"]
    assert eager.copies == len(sets) and eager.calls_per_replay % len(sets) == 0
    assert eager.calls_per_replay >= bench.EAGER_MIN_CALLS and eager.replays == 5
    assert 0 < eager.min_ms <= eager.median_ms <= eager.max_ms


def run_script(tmp_path, *extra):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH.parent), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, str(BENCH / "bench_m1_torchao.py"), "--shapes", "l3-8b-o", "--replays", "3",
                          "--out", str(tmp_path), *extra], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    assert "bench_m1_torchao.py: elapsed" in res.stdout
    slug = device_slug(torch.cuda.get_device_name())
    with open(tmp_path / f"m1_torchao_{slug}.json") as f:
        results = json.load(f)
    report = (tmp_path / f"m1_torchao_{slug}.md").read_text(encoding="utf-8")
    assert report.startswith("# W8A8Linear at M = ") and torch.cuda.get_device_name() in report.splitlines()[0]
    return results, report


def check_timed(point, name, tol):
    assert point["time_us"][name] > 0 and point["timing_method"][name] in ("graph", "eager")
    assert 0 < point["rel_err"][name] < tol
    assert point["weight_bytes"][name] > 0 and point["derived"]["weight_TBps"][name] > 0


def test_script_without_torchao(tmp_path):
    import cutlass_w8a8 as cw

    results, report = run_script(tmp_path, "--m", "1,4", "--fp8", "--no-torchao")
    assert results["torchao"] == {"enabled": False, "reason": "--no-torchao"}
    assert [(p["shape"], p["M"]) for p in results["points"]] == [("l3-8b-o", 1), ("l3-8b-o", 4)]
    fp8 = results["fp8"] and cw.supports_fp8()
    for p in results["points"]:
        assert p["errors"] == {} or (not fp8 and set(p["errors"]) == {"w8a8_fp8"})
        check_timed(p, "w8a8", results["tolerances"]["w8a8"])
        check_timed(p, "bf16", results["tolerances"]["bf16"])
        if fp8:
            check_timed(p, "w8a8_fp8", results["tolerances"]["w8a8_fp8"])
        # int8 weights (+ float32 scales), bf16 weights
        assert p["weight_bytes"]["w8a8"] == 4096 * 4096 + 4 * 4096 and p["weight_bytes"]["bf16"] == 2 * 4096 * 4096
        assert p["derived"]["ratios"]["w8a8_x_bf16"] > 0 and p["derived"]["ratios"]["w8a8_x_torchao"] is None
    statuses = {(t["key"], t["M"]): t["status"] for t in results["targets"]}
    assert statuses[("w8a8_x_torchao", 1)] == statuses[("w8a8_x_torchao", 4)] == "not measured"
    assert statuses[("w8a8_x_bf16", 1)] in ("met", "NOT met")
    assert "torchao: not timed (--no-torchao)" in report


def test_script_with_torchao(tmp_path):
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is not importable (scripts/gpu_run.sh puts it on PYTHONPATH from .whl/)")
    results, report = run_script(tmp_path)
    (p,) = results["points"]
    assert results["torchao"]["enabled"] and results["torchao"]["version"]
    check_timed(p, "w8a8", results["tolerances"]["w8a8"])
    # torchao may fail on some torch/torchao pair: then its failure is recorded, not a crash, and not timed
    if "torchao_int8wo" in p["errors"]:
        assert "torchao_int8wo" not in p["time_us"]
    else:
        check_timed(p, "torchao_int8wo", results["tolerances"]["torchao_int8wo"])
        assert p["torchao_compile_s"] > 0 and p["derived"]["ratios"]["w8a8_x_torchao"] > 0
        assert "W8A8Linear x ao int8wo" in report
