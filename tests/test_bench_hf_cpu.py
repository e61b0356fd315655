"""bench/bench_hf.py's whole flow on the CPU (``--tiny``): build, quantize, static-cache prefill and decode, the
correctness checks, the interleaved timing loop and the reports. The GPU run is the benchmark; this keeps the
script working between GPU runs."""

import importlib.util
import json
import os

import pytest

pytest.importorskip("transformers")

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "bench_hf.py")


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_hf", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_hf_tiny(tmp_path):
    bench = load_bench()
    rc = bench.main(["--tiny", "--batches", "1,2", "--reps", "2", "--steps", "2", "--check-steps", "3",
                     "--prompt-len", "8", "--max-cache-len", "16", "--out", str(tmp_path)])
    assert rc == 0
    with open(tmp_path / "hf_decode_cpu.json") as f:
        res = json.load(f)
    assert res["tiny"] and res["modes"] == ["eager"] and res["dtypes"] == ["bf16", "int8", "fp8"]
    assert res["failures"] == []
    assert res["models"]["int8"]["w8a8_linears"] == res["models"]["fp8"]["w8a8_linears"] == 2 * 7
    assert res["models"]["bf16"]["w8a8_linears"] == 0
    for b in ("1", "2"):
        for m in ("bf16", "int8", "fp8"):
            t = res["points"][b][m]["eager"]
            assert t["reps"] == 2 and t["steps"] == 2 and 0 < t["min_ms"] <= t["median_ms"] <= t["max_ms"]
        for m, floor in (("int8", 30.0), ("fp8", 20.0)):  # the tiny model measured ~42 and ~32 dB
            assert res["accuracy"][b][m]["eager_sqnr_vs_bf16_db"] > floor
        assert res["derived"][b]["eager"]["int8_x_bf16"] > 0
    assert all(t["met"] is None for t in res["targets"])  # no timing claims on the CPU
    report = (tmp_path / "hf_decode_cpu.md").read_text()
    assert "not measurements" in report and "| 2 | eager |" in report
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (tmp_path / "hf_decode_cpu.png").exists() and "matplotlib is not installed" in report
    else:
        assert (tmp_path / "hf_decode_cpu.png").stat().st_size > 0


def test_bench_hf_args():
    bench = load_bench()
    args = bench.parse_args(["--quick", "--batches", "8,1,8", "--dtypes", "int8,bf16", "--no-compile"])
    assert (args.layers, args.batches, args.dtypes, args.modes) == (8, [1, 8], ["bf16", "int8"], ["eager"])
    assert bench.parse_args([]).modes == ["eager", "compiled"] and bench.parse_args([]).layers == 32
    assert bench.parse_args(["--tiny"]).modes == ["eager"]
    assert bench.parse_args(["--tiny", "--compile"]).modes == ["eager", "compiled"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--dtypes", "int4"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--max-cache-len", "40"])  # the 32-token prompt + 24 steps do not fit


def test_bench_hf_recheck(tmp_path):
    """--recheck re-evaluates the logits gates of a results file and keeps every measured value: a compiled
    SQNR below the gate becomes a failure, one above it none."""
    bench = load_bench()
    base = {"batches": [1], "modes": ["eager", "compiled"], "failures": ["batch 1 int8 compiled: RuntimeError: x"],
            "accuracy": {"1": {"bf16": {"compiled_vs_eager": {"worst_sqnr_db": 25.0, "max_abs": 0.3}},
                               "int8": {"compiled_vs_eager": {"worst_sqnr_db": 2.0, "max_abs": 1.0},
                                        "eager_sqnr_vs_bf16_db": 10.0}}}}
    path = tmp_path / "in.json"
    path.write_text(json.dumps(base))
    res = json.loads(path.read_text())
    bench.recheck(res, str(path))
    assert res["accuracy"]["1"]["bf16"]["compiled_vs_eager"]["ok"]
    assert not res["accuracy"]["1"]["int8"]["compiled_vs_eager"]["ok"] and res["accuracy"]["1"]["int8"]["w8a8_ok"]
    assert res["failures"][0] == "batch 1 int8 compiled: RuntimeError: x"  # a raised variant stays a failure
    assert len(res["failures"]) == 2 and "compiled vs eager logits SQNR 2.0 dB" in res["failures"][1]
    assert res["accuracy"]["1"]["int8"]["compiled_vs_eager"]["worst_sqnr_db"] == 2.0 and "in.json" in res["rechecked"]
