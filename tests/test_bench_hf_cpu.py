"""bench/bench_hf.py's whole flow on the CPU (``--tiny``): build, quantize, optimize, static-cache prefill and
decode (eager, and cutlass_w8a8.generate's graph step run eagerly), the correctness checks, the warm-up times, the
interleaved timing loop and the reports. The GPU run is the benchmark; this keeps the
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
                     "--prompt-len", "8", "--max-cache-len", "16", "--out", str(tmp_path), "--dtypes",
                     "bf16,int8,fp8-block,int8-opt,fp8-block-opt"])
    assert rc == 0
    with open(tmp_path / "hf_decode_cpu.json") as f:
        res = json.load(f)
    models = ["bf16", "int8", "fp8-block", "int8-opt", "fp8-block-opt"]
    assert res["tiny"] and res["modes"] == ["eager", "graph"] and res["dtypes"] == models
    assert res["failures"] == [] and not res["full_size"]
    for m in models[1:]:
        assert res["models"][m]["w8a8_linears"] == 2 * (4 if m.endswith("-opt") else 7)  # qkv, o, gate_up, down
        assert res["models"][m]["optimized"] == m.endswith("-opt")
    assert res["models"]["bf16"]["w8a8_linears"] == 0
    for b in ("1", "2"):
        for m in models:
            for mode in ("eager", "graph"):
                t = res["points"][b][m][mode]
                assert t["reps"] == 2 and t["steps"] == 2 and 0 < t["min_ms"] <= t["median_ms"] <= t["max_ms"]
                assert res["warmup"][b][m][mode]["first_token_s"] > 0
            # the graph path's steps run the eager step's calls: equal logits
            assert res["accuracy"][b][m]["graph_vs_eager"]["max_abs"] == 0
        for m, floor in (("int8", 30.0), ("fp8-block", 20.0), ("int8-opt", 30.0), ("fp8-block-opt", 20.0)):
            # the tiny model measured ~36 dB (int8) and ~24 dB (block fp8)
            assert res["accuracy"][b][m]["eager_sqnr_vs_bf16_db"] > floor
        assert res["derived"][b]["eager"]["int8-opt"]["x_bf16_same_mode"] > 0
    assert res["targets"] and all(t["met"] is None for t in res["targets"])  # no timing claims on the CPU
    report = (tmp_path / "hf_decode_cpu.md").read_text(encoding="utf-8")
    assert "not measurements" in report and "| 2 | graph | fp8-block-opt |" in report
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (tmp_path / "hf_decode_cpu.png").exists() and "matplotlib is not installed" in report
    else:
        assert (tmp_path / "hf_decode_cpu.png").stat().st_size > 0


def test_bench_hf_args():
    bench = load_bench()
    args = bench.parse_args(["--quick", "--batches", "8,1,8", "--dtypes", "int8,bf16", "--no-compile"])
    assert (args.layers, args.batches, args.dtypes, args.modes) == (2, [1, 8], ["bf16", "int8"], ["eager", "graph"])
    quick = bench.parse_args(["--quick"])
    assert quick.dtypes == ["bf16", "int8", "int8-opt", "fp8-opt", "fp8-block-opt"] and (quick.reps, quick.steps) == (3, 12)
    assert bench.parse_args([]).modes == ["eager", "compiled", "graph"] and bench.parse_args([]).layers == 32
    assert len(bench.parse_args([]).dtypes) == 7
    assert bench.parse_args(["--tiny"]).modes == ["eager", "graph"]
    assert bench.parse_args(["--tiny", "--compile", "--no-graph"]).modes == ["eager", "compiled"]
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
    res = json.loads(path.read_text(encoding="utf-8"))
    bench.recheck(res, str(path))
    assert res["accuracy"]["1"]["bf16"]["compiled_vs_eager"]["ok"]
    assert not res["accuracy"]["1"]["int8"]["compiled_vs_eager"]["ok"] and res["accuracy"]["1"]["int8"]["w8a8_ok"]
    assert res["failures"][0] == "batch 1 int8 compiled: RuntimeError: x"  # a raised variant stays a failure
    assert len(res["failures"]) == 2 and "compiled vs eager logits SQNR 2.0 dB" in res["failures"][1]
    assert res["accuracy"]["1"]["int8"]["compiled_vs_eager"]["worst_sqnr_db"] == 2.0 and "in.json" in res["rechecked"]
