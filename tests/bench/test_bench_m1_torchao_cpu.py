"""bench/bench_m1_torchao.py without a GPU: the command line, the ratios and targets, the accuracy check, the
Markdown report and plot from synthetic results, and that importing the script needs neither CUDA nor torchao.
The GPU run is the benchmark (tests/bench/test_bench_m1_torchao_cuda.py runs it once, small)."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from _m1_torchao_bench import BENCH, load_bench


@pytest.fixture
def bench(monkeypatch):
    """bench/bench_m1_torchao.py as a module (see tests/_m1_torchao_bench.py)."""
    return load_bench(monkeypatch)[0]


@pytest.fixture
def report(bench):
    """bench/_m1_torchao_report.py, as the script imported it."""
    return sys.modules["_m1_torchao_report"]


def point(report, shape, m, time_us, weight_bytes=None, errors=None, timing_method=None, notes=None):
    weight_bytes = weight_bytes or {name: 1000 for name in time_us}
    return {"shape": shape, "M": m, "time_us": time_us, "errors": errors or {}, "weight_bytes": weight_bytes,
            "timing_method": timing_method or {name: "graph" for name in time_us}, "timing_notes": notes or {},
            "derived": report.derive(time_us, weight_bytes)}


def results(bench, points, torchao=None, fp8=False, m_values=(1,)):
    return {"device": "NVIDIA H100 80GB HBM3", "device_slug": "nvidia-h100-80gb-hbm3", "torch_version": "2.11.0",
            "cuda_version": "13.0", "git_commit": "0123456789abcdef0123", "git_dirty": True, "l2_bytes": 50 * 2**20,
            "hbm_GBps_datasheet": 3350.0, "pdl": True, "timing": {"replays": 25},
            "tolerances": dict(bench.TOLERANCES), "fp8": fp8, "m_values": list(m_values), "points": points,
            "torchao": torchao or {"enabled": True, "version": "0.17.0", "config": "Int8WeightOnlyConfig()",
                                   "fullgraph": True, "compile": "torch.compile(fn, fullgraph=True, dynamic=False)",
                                   "left_out": None},
            "elapsed_s": 42.5, "torchao_compile_s": 20.25}


# ----------------------------------------------------------------------------------------------------
# import, command line


def test_import_needs_neither_cuda_nor_torchao():
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torchao' or name.startswith('torchao.'):\n"
            "            raise ModuleNotFoundError('torchao blocked by the test')\n"
            "sys.meta_path.insert(0, Block())\n"
            "import torch, bench_m1_torchao as b\n"
            "assert not torch.cuda.is_initialized(), 'import initialized CUDA'\n"
            "assert 'torchao' not in sys.modules\n"
            "assert b.parse_args([]).m_values == [1]\n"
            "print('imported')\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(BENCH), str(BENCH.parent), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("imported")


def test_parse_args_defaults(bench):
    args = bench.parse_args([])
    assert [s for s, _, _ in args.shape_list] == ["l3-8b-qkv", "l3-8b-o", "l3-8b-gate_up", "l3-8b-down",
                                                  "l3-70b-qkv", "l3-70b-o", "l3-70b-gate_up", "l3-70b-down"]
    assert args.m_values == [1] and args.torchao is True and args.fp8 is False and args.replays == 25
    assert pathlib.Path(args.out) == BENCH / "results"


def test_parse_args_options(bench):
    args = bench.parse_args(["--shapes", "8b-o,70b-down", "--m", "16,1,2,1", "--fp8", "--no-torchao",
                             "--replays", "7", "--out", "/tmp/x"])
    assert args.shape_list == [("l3-8b-o", 4096, 4096), ("l3-70b-down", 8192, 28672)]
    assert args.m_values == [1, 2, 16] and args.fp8 and args.torchao is False
    assert args.replays == 7 and args.out == "/tmp/x"


@pytest.mark.parametrize("argv", [["--m", "0"], ["--m", "1,x"], ["--shapes", "405b"], ["--replays", "0"],
                                  ["--bogus"]])
def test_parse_args_refuses(bench, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_main_without_cuda_exits_with_reason(bench):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--shapes", "8b-o", "--no-torchao"])
    assert str(exc.value.code).startswith("bench_m1_torchao.py: needs a CUDA device")


# ----------------------------------------------------------------------------------------------------
# ratios, targets, failures


def test_derive(report, bench):
    d = report.derive({"w8a8": 10.0, "torchao_int8wo": 12.0, "bf16": 20.0},
                     {"w8a8": 16_793_600, "torchao_int8wo": 16_785_408, "bf16": 33_554_432})
    r = d["ratios"]
    assert r["w8a8_x_torchao"] == pytest.approx(1.2) and r["w8a8_x_bf16"] == pytest.approx(2.0)
    assert r["w8a8_fp8_x_torchao"] is None and r["w8a8_fp8_x_bf16"] is None
    assert d["weight_TBps"]["w8a8"] == pytest.approx(1.67936)
    assert d["weight_TBps"]["bf16"] == pytest.approx(1.6777216)
    assert set(d["weight_TBps"]) == {"w8a8", "torchao_int8wo", "bf16"}
    # a method that was not timed gives no ratio, not a zero
    assert report.derive({"w8a8": 10.0, "bf16": 20.0}, {})["ratios"]["w8a8_x_torchao"] is None


def test_evaluate_target_statuses(report, bench):
    met = [point(report, "a", 1, {"w8a8": 10.0, "torchao_int8wo": 11.0}),
           point(report, "b", 1, {"w8a8": 10.0, "torchao_int8wo": 10.0})]
    t = report.evaluate_target(met, "w8a8_x_torchao", 1)
    assert t["status"] == "met" and t["worst"] == ("b", 1.0) and t["n"] == 2 and t["missing"] == []
    assert t["geomean"] == pytest.approx(1.1 ** 0.5)

    not_met = met + [point(report, "c", 1, {"w8a8": 10.0, "torchao_int8wo": 8.6})]
    t = report.evaluate_target(not_met, "w8a8_x_torchao", 1)
    assert t["status"] == "NOT met" and t["worst"][0] == "c" and t["worst"][1] == pytest.approx(0.86)

    incomplete = met + [point(report, "d", 1, {"w8a8": 10.0}, errors={"torchao_int8wo": "boom"})]
    t = report.evaluate_target(incomplete, "w8a8_x_torchao", 1)
    assert t["status"] == "incomplete" and t["missing"] == ["d"] and t["n"] == 2

    t = report.evaluate_target([point(report, "a", 1, {"w8a8": 10.0, "bf16": 20.0})], "w8a8_x_torchao", 1)
    assert t["status"] == "not measured" and t["worst"] is None and t["geomean"] is None
    # the points of another M do not count
    t = report.evaluate_target(not_met + [point(report, "a", 2, {"w8a8": 10.0, "torchao_int8wo": 5.0})],
                              "w8a8_x_torchao", 2)
    assert t["status"] == "NOT met" and t["n"] == 1 and t["worst"] == ("a", 0.5)


def test_evaluate_targets_per_m_and_fp8(report, bench):
    pts = [point(report, s, m, {"w8a8": 10.0, "w8a8_fp8": 9.0, "torchao_int8wo": 12.0, "bf16": 20.0})
           for s in ("a", "b") for m in (1, 8)]
    got = report.evaluate_targets(results(bench, pts, m_values=(1, 8)))
    assert [(t["key"], t["M"]) for t in got] == [("w8a8_x_torchao", 1), ("w8a8_x_torchao", 8),
                                                 ("w8a8_x_bf16", 1), ("w8a8_x_bf16", 8)]
    assert all(t["status"] == "met" for t in got)
    got = report.evaluate_targets(results(bench, pts, fp8=True, m_values=(1, 8)))
    fp8 = [t for t in got if t["key"] == "w8a8_fp8_x_torchao"]
    assert len(fp8) == 2 and fp8[0]["worst"][1] == pytest.approx(12.0 / 9.0)


def test_own_failures(report, bench):
    pts = [point(report, "a", 1, {"bf16": 20.0}, errors={"torchao_int8wo": "ImportError: x",
                                                       "w8a8": "AccuracyError: 0.2"}),
           point(report, "b", 1, {"w8a8": 10.0, "bf16": 20.0}, errors={"torchao_int8wo": "quantize_ failed"})]
    assert bench.own_failures(results(bench, pts)) == ["w8a8 at a M=1: AccuracyError: 0.2"]


# ----------------------------------------------------------------------------------------------------
# accuracy check (on the CPU implementations)


def test_check_output_and_reference(bench):
    import cutlass_w8a8 as cw

    torch.manual_seed(0)
    linear = torch.nn.Linear(512, 256, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    x = torch.randn(1, 512, dtype=torch.bfloat16)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        ref = bench.fp32_reference(x, linear.weight)
        assert torch.get_float32_matmul_precision() == "high"  # restored
    finally:
        torch.set_float32_matmul_precision(previous)
    assert ref.dtype == torch.float32 and ref.shape == (1, 256)
    exact = (x.double() @ linear.weight.double().t())
    assert torch.allclose(ref.double(), exact, rtol=1e-5, atol=1e-5)

    rel, err = bench.check_output("w8a8", cw.W8A8Linear.from_float(linear)(x), ref)
    assert err is None and 0 < rel < bench.TOLERANCES["w8a8"]
    rel, err = bench.check_output("bf16", linear(x), ref)
    assert err is None and 0 <= rel < bench.TOLERANCES["bf16"]
    # a wrong output (another weight's) and a NaN are errors, not timings
    rel, err = bench.check_output("w8a8", torch.nn.functional.linear(x, torch.randn_like(linear.weight)), ref)
    assert rel > 0.5 and err.startswith("AccuracyError: relative Frobenius error")
    nan = torch.full((1, 256), float("nan"), dtype=torch.bfloat16)
    assert bench.check_output("torchao_int8wo", nan, ref)[1] is not None


# ----------------------------------------------------------------------------------------------------
# report


def sample(report, bench):
    pts = [point(report, "l3-8b-qkv", 1, {"w8a8": 9.6, "torchao_int8wo": 9.3, "bf16": 15.0},
                 {"w8a8": 25_190_400, "torchao_int8wo": 25_178_112, "bf16": 50_331_648}),
           point(report, "l3-8b-o", 1, {"w8a8": 7.0, "torchao_int8wo": 8.4, "bf16": 11.0},
                 timing_method={"w8a8": "graph", "torchao_int8wo": "eager", "bf16": "graph"},
                 notes={"torchao_int8wo": "graph capture failed (RuntimeError: x); CUDA events around eager calls"}),
           point(report, "l3-8b-down", 1, {"w8a8": 12.0, "bf16": 30.0},
                 errors={"torchao_int8wo": "AccuracyError: relative Frobenius error 0.9"})]
    return results(bench, pts)


def test_render_markdown(report, bench):
    md = report.render_markdown(sample(report, bench))
    assert md.startswith("# W8A8Linear at M = 1 against torchao int8 weight-only + torch.compile: "
                         "NVIDIA H100 80GB HBM3\n")
    assert "torch 2.11.0 (CUDA 13.0), git 0123456789ab (dirty)" in md and "torchao 0.17.0" in md
    assert "Int8WeightOnlyConfig()" in md and "fullgraph=True, dynamic=False" in md
    assert ("- M = 1: `W8A8Linear` >= 1.0x torchao int8 weight-only + compile on every shape: **NOT met** "
            "(worst: l3-8b-qkv, 0.969x;") in md
    assert "- M = 1: `W8A8Linear` >= 1.0x bf16 `nn.Linear` on every shape: **met** (worst: l3-8b-qkv, 1.562x;" in md
    assert ("| shape | M | W8A8Linear us | ao int8wo us | bf16 us | W8A8Linear x ao int8wo | W8A8Linear x bf16 "
            "| W8A8Linear TB/s | ao int8wo TB/s | bf16 TB/s |") in md
    assert "| l3-8b-qkv | 1 | 9.6 | 9.3 | 15.0 | 0.97 | 1.56 | 2.62 | 2.71 | 3.36 |" in md
    assert "| l3-8b-o | 1 | 7.0 | 8.4† | 11.0 | 1.20 | 1.57 |" in md  # eager-timed cell marked
    assert "| l3-8b-down | 1 | 12.0 | – | 30.0 | – | 2.50 |" in md
    assert "## Timed eagerly" in md and "`torchao_int8wo` at l3-8b-o M=1: graph capture failed" in md
    assert "`torchao_int8wo` at l3-8b-down M=1: `AccuracyError: relative Frobenius error 0.9`" in md
    assert "W8A8Linear 0.05, ao int8wo 0.05, bf16 0.02" in md and "fp8" not in md
    assert "- Elapsed 42.5 s, torchao's first calls (compiles) 20.2 s of it." in md


def test_render_markdown_without_torchao(report, bench):
    pts = [point(report, "l3-8b-o", 1, {"w8a8": 7.0, "bf16": 11.0})]
    res = results(bench, pts, torchao={"enabled": False, "reason": "torchao does not import (ModuleNotFoundError)"})
    res["torchao_compile_s"] = None
    md = report.render_markdown(res)
    assert "- torchao: not timed (torchao does not import (ModuleNotFoundError))." in md
    assert "compile on every shape: **not measured** (no ratio; geomean –x over 0 shapes)" in md
    assert "ao int8wo us" not in md and "**met** (worst: l3-8b-o, 1.571x;" in md
    assert "## Methods that did not run" not in md
    assert "- Elapsed 42.5 s.\n" in md


def test_plot(report, bench, tmp_path, capsys):
    path = tmp_path / "m1.png"
    report.plot_results(sample(report, bench), str(path))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not path.exists() and "matplotlib is not installed" in capsys.readouterr().out
    else:
        assert path.stat().st_size > 0
