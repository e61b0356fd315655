"""bench/bench_gemm.py's block-scaled fp8 comparison and fp8 accuracy report (issue 26) on the CPU: the command line,
the shapes, torch's scale layouts, the float64 reference against explicit block sums and the ops' CPU references,
the accuracy paths, the derived numbers and targets, and the reports rendered from a synthetic results dict. The
benchmark itself needs a GPU; this keeps its pieces honest between GPU runs."""

import importlib.util
import pathlib
import sys
from types import SimpleNamespace

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.shapes import BLOCK_SHAPES, SHAPES, select_shapes
from cutlass_w8a8.testing.timers import geomean

from _bench_cpu import loaded_benches

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
E4M3 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def bench():
    """bench/_gemm_*.py and bench_gemm.py, loaded from their files (they import their siblings by name: put in
    sys.modules for the duration of this module)."""
    with loaded_benches("_gemm_methods", "_gemm_accuracy", "_gemm_block", "_gemm_report", "_gemm_torchao",
                        "bench_gemm") as mods:
        yield SimpleNamespace(acc=mods["_gemm_accuracy"], block=mods["_gemm_block"], main=mods["bench_gemm"],
                              report=mods["_gemm_report"], methods=mods["_gemm_methods"])


# ---- command line and shapes ------------------------------------------------------------------------------------


def test_parse_args(bench):
    b = bench.main
    args = b.parse_args(["--block"])
    assert args.block and args.shape_list == list(BLOCK_SHAPES) and args.m_values[0] == 1
    assert args.m_values[-1] == 8192 and args.torchao is False
    args = b.parse_args(["--block", "--shapes", "q3-8b", "--quick"])
    assert [s for s, _, _ in args.shape_list] == ["q3-8b-qkv", "q3-8b-o", "q3-8b-gate_up", "q3-8b-down"]
    assert args.m_values == [1, 16, 64, 256, 1024, 4096]
    args = b.parse_args([])
    assert not args.block and args.block_columns and args.shape_list == list(SHAPES)
    assert b.parse_args(["--no-block-columns"]).block_columns is False
    for bad in (["--block", "--no-fp8"], ["--block", "--shapes", "l3-8b"], ["--block", "--torchao"]):
        with pytest.raises(SystemExit):
            b.parse_args(bad)


def test_block_shapes():
    """The issue's DeepSeek-V3 shapes and the Qwen3-8B / 32B projections (qkv and gate_up fused), every K a multiple
    of 128; names unique."""
    assert len({s for s, _, _ in BLOCK_SHAPES}) == len(BLOCK_SHAPES)
    assert all(k % 128 == 0 and n % 16 == 0 for _, n, k in BLOCK_SHAPES)
    dsv3 = {(n, k) for s, n, k in BLOCK_SHAPES if s.startswith("dsv3")}
    assert dsv3 == {(2112, 7168), (24576, 7168), (32768, 7168), (7168, 7168), (7168, 16384)}
    shapes = {s: (n, k) for s, n, k in BLOCK_SHAPES}
    for model, hidden, inter, heads, kv_heads in (("q3-8b", 4096, 12288, 32, 8), ("q3-32b", 5120, 25600, 64, 8)):
        assert shapes[f"{model}-qkv"] == ((heads + 2 * kv_heads) * 128, hidden)
        assert shapes[f"{model}-o"] == (hidden, heads * 128)
        assert shapes[f"{model}-gate_up"] == (2 * inter, hidden)
        assert shapes[f"{model}-down"] == (hidden, inter)
    assert select_shapes("dsv3-n7168", BLOCK_SHAPES) == [("dsv3-n7168-k7168", 7168, 7168),
                                                          ("dsv3-n7168-k16384", 7168, 16384)]
    assert select_shapes(None) == list(SHAPES)


# ---- torch's scale layouts ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 5])
def test_torch_scale_a_layout(bench, m):
    """BlockWise1x128 scale_a: the same (M, K/128) values, strides (1, M), also at M = 1 (where
    ``.t().contiguous().t()`` would keep strides (K/128, 1), which torch refuses)."""
    sa = torch.rand(m, 7)
    got = bench.block.torch_scale_a(sa)
    assert got.shape == (m, 7) and got.stride() == (1, m) and torch.equal(got, sa)
    assert got.clone().stride() == (1, m)  # the rotating copies keep the layout


@pytest.mark.parametrize("kb", [4, 5, 56])
def test_torch_scale_b_layout(bench, kb):
    """BlockWise128x128 scale_b for b = w.t(): (L4, ceil(N/128)) with strides (1, L4), L4 = K/128 rounded up to 4,
    the weight's (ceil(N/128), K/128) values transposed, the padding zero."""
    sb = torch.rand(3, kb) + 0.5
    got = bench.block.torch_scale_b(sb)
    l4 = -(-kb // 4) * 4
    assert got.shape == (l4, 3) and got.stride() == (1, l4)
    assert torch.equal(got[:kb], sb.t()) and not got[kb:].any()
    assert got.clone().stride() == (1, l4)


# ---- float64 reference and the error report ------------------------------------------------------------------------


def _operands(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(E4M3)
    w = torch.randn(n, k, generator=g).to(E4M3)
    return a, w, torch.rand(m, k // 128, generator=g) + 0.5, torch.rand(-(-n // 128), k // 128, generator=g) + 0.5


def test_fp64_reference_block_against_block_sums(bench):
    """The block reference equals the sum over K blocks of sa[m, kb] * sb[n // 128, kb] * (a_kb . w_kb), in float64,
    for a partial last N block, and its corner is the corner of the whole."""
    m, n, k = 5, 200, 384
    a, w, sa, sb = _operands(m, n, k)
    want = torch.zeros(m, n, dtype=torch.float64)
    for kb in range(k // 128):
        cols = slice(kb * 128, (kb + 1) * 128)
        dot = a[:, cols].double() @ w[:, cols].double().t()
        want += dot * sa[:, kb:kb + 1].double() * sb[torch.arange(n) // 128, kb].double()
    got = bench.acc.fp64_reference(a, w, sa, sb, block=True)
    assert got.dtype == torch.float64 and torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    corner = bench.acc.fp64_reference(a, w, sa, sb, block=True, rows=3, cols=130)
    assert corner.shape == (3, 130) and torch.allclose(corner, got[:3, :130], rtol=1e-12, atol=1e-12)


def test_fp64_reference_rowwise(bench):
    m, n, k = 4, 48, 64
    a, w, _, _ = _operands(m, n, 128)
    a, w = a[:, :k], w[:, :k]
    sa, sb = torch.rand(m, 1) + 0.5, torch.rand(n) + 0.5
    want = (a.double() * sa.double()) @ (w.double() * sb.double()[:, None]).t()
    assert torch.allclose(bench.acc.fp64_reference(a, w, sa, sb, block=False), want, rtol=1e-12, atol=0)
    one = torch.tensor([0.25])
    assert torch.allclose(bench.acc.fp64_reference(a, w, one, sb, block=False),
                          (a.double() * 0.25) @ (w.double() * sb.double()[:, None]).t(), rtol=1e-12, atol=0)


def test_error_stats(bench):
    ref = torch.tensor([[3.0, -4.0]], dtype=torch.float64)
    s = bench.acc.error_stats(torch.tensor([[3.0, -4.0, 99.0], [7.0, 7.0, 7.0]]), ref)  # cut to ref's corner
    assert s == {"rel_fro": 0.0, "max_over_rms": 0.0}
    s = bench.acc.error_stats(torch.tensor([[3.0, -3.5]]), ref)
    assert s["rel_fro"] == pytest.approx(0.5 / 5) and s["max_over_rms"] == pytest.approx(0.5 / (5 / 2 ** 0.5))


def test_fp8_paths_on_cpu(bench):
    """The accuracy paths through the ops' CPU references (the decode bound faked): CUTLASS and decode row-wise and
    block, each against its own float64 reference, at the bf16 floor (the CPU references accumulate in float32 and
    round once); torch's blockwise scaled_mm has no CPU kernel: recorded in `errors`, left out."""
    m, n, k = 6, 256, 384
    a, w, sa_b, sb_b = _operands(m, n, k, seed=1)
    sa, sb = torch.rand(m, 1) + 0.5, torch.rand(n) + 0.5
    blk = bench.block.BlockOperands(sa_b, sb_b, bench.block.torch_scale_a(sa_b), bench.block.torch_scale_b(sb_b))
    bounds = []
    fake = SimpleNamespace(scaled_mm=cw.scaled_mm, scaled_mm_decode=cw.scaled_mm_decode,
                           _ext=SimpleNamespace(set_decode_gemm_max_m=lambda v: bounds.append(v) or 8))
    paths = bench.block.accuracy_paths(fake, a, w, sa, sb, blk)
    assert list(paths) == ["ours_fp8", "ours_fp8_accurate", "cutlass_fp8", "cutlass_fp8_accurate", "decode_fp8",
                           "ours_block", "cutlass_block", "decode_block", "torch_fp8_rowwise", "torch_block"]
    errors = {}
    acc = bench.acc.fp8_path_errors(paths, errors, rows=4, cols=200)
    assert set(errors) <= {"torch_block", "torch_fp8_rowwise"} and "torch_block" in errors
    assert acc["corner"] == {"rows": 4, "cols": 200}
    assert bounds == [0, 8, 0, 8, 0, 8]  # the CUTLASS paths turned the decode path off and restored it
    for name in ("ours_fp8", "ours_fp8_accurate", "cutlass_fp8", "cutlass_fp8_accurate", "decode_fp8", "ours_block",
                 "cutlass_block", "decode_block"):
        floor = acc["bf16_floor_block" if "block" in name else "bf16_floor"]["rel_fro"]
        assert 1e-4 < floor < 4e-3
        assert abs(acc[name]["rel_fro"] - floor) < 1e-4, (name, acc[name], floor)
    # a wrong output is seen: the block output against the row-wise reference is far off
    wrong = {"x": (lambda *args: cw.scaled_mm(a, w.t(), sa_b, sb_b, torch.bfloat16), (),
                   bench.acc.Operands(a, w, sa, sb, False))}
    assert bench.acc.fp8_path_errors(wrong, {})["x"]["rel_fro"] > 0.1
    # above M = 16 there is no decode path
    big = bench.block.accuracy_paths(fake, a.repeat(3, 1), w, sa.repeat(3, 1), sb,
                                     bench.block.BlockOperands(sa_b.repeat(3, 1), sb_b, None, None))
    assert "decode_fp8" not in big and "decode_block" not in big
    # --no-fp8-accurate: no accurate path
    fast = bench.block.accuracy_paths(fake, a, w, sa, sb, None, accurate=False)
    assert list(fast) == ["ours_fp8", "cutlass_fp8", "decode_fp8", "torch_fp8_rowwise"]


def test_accurate_paths_ask_for_promotion(bench):
    """``ours_fp8_accurate`` (the timed method and its accuracy path) and ``cutlass_fp8_accurate`` call scaled_mm with
    fp8_fast_accum=False, the fast ones with the default; the CUTLASS one with the decode path off."""
    calls, bounds = [], []

    def scaled_mm(a, b, sa, sb, out_dtype, **kw):
        calls.append((kw.get("fp8_fast_accum", "default"), bounds[-1] if bounds else 8))
        return torch.zeros(a.shape[0], b.shape[1])

    def set_max(v):
        bounds.append(v)
        return 8

    fake = SimpleNamespace(scaled_mm=scaled_mm, scaled_mm_decode=None, _ext=SimpleNamespace(set_decode_gemm_max_m=set_max))
    a, w = torch.zeros(32, 128, dtype=E4M3), torch.zeros(64, 128, dtype=E4M3)
    paths = bench.block.accuracy_paths(fake, a, w, torch.ones(32, 1), torch.ones(64), None)
    for name in ("ours_fp8", "ours_fp8_accurate", "cutlass_fp8", "cutlass_fp8_accurate"):
        calls.clear()
        fn, args, _ = paths[name]
        fn(*args)
        want_accum = False if name.endswith("accurate") else "default"
        want_bound = 0 if name.startswith("cutlass") else 8
        assert calls == [(want_accum, want_bound)], (name, calls)
    wts = SimpleNamespace(w_bf16=None, w_int8=None, w_fp8=w, scale_b=torch.ones(64), linear=None, qlinear=None,
                          qlinear_fp8=None)
    act = SimpleNamespace(x_bf16=None, a_int8=None, a_fp8=a, scale_a=torch.ones(32, 1))
    methods = bench.methods.build_methods(scaled_mm, wts, act, True)
    assert list(methods).index("ours_fp8_accurate") == list(methods).index("ours_fp8") + 1
    calls.clear()
    fn, args = methods["ours_fp8_accurate"]
    fn(*args)
    assert calls == [(False, 8)] and args == methods["ours_fp8"][1]
    assert "ours_fp8_accurate" not in bench.methods.build_methods(scaled_mm, wts, act, True, fp8_accurate=False)
    assert "ours_fp8_accurate" not in bench.methods.build_methods(scaled_mm, wts, act, False)
    assert "ours_fp8_accurate" in bench.methods.OPTIONAL_METHODS


def test_block_methods_by_m(bench):
    """The kernel family the dispatch does not pick is added at M <= 16: CUTLASS (decode path off) up to the decode
    bound, the decode GEMM above it; none above 16; the block linear only when built."""
    fake = SimpleNamespace(scaled_mm=None, scaled_mm_decode=None, _ext=SimpleNamespace(set_decode_gemm_max_m=None))
    blk = bench.block.BlockOperands(None, None, None, None)
    w = torch.zeros(256, 128, dtype=E4M3)
    for m, extra in ((1, "ours_block_cutlass"), (8, "ours_block_cutlass"), (9, "ours_block_decode"),
                     (16, "ours_block_decode"), (17, None)):
        got = bench.block.block_methods(fake, w, torch.zeros(m, 128, dtype=E4M3), blk, None, None, 8)
        assert set(got) == {"ours_block", "torch_block"} | ({extra} if extra else set()), m
    got = bench.block.block_methods(fake, w, torch.zeros(2, 128, dtype=E4M3), blk, None, torch.nn.Identity(), 8)
    assert "linear_w8a8_block" in got


# ---- derived numbers, targets, reports ----------------------------------------------------------------------------


def test_derive_block(bench):
    m, n, k = 4, 7168, 7168
    times = {"ours_block": 0.020, "torch_block": 0.030, "ours_fp8": 0.019, "bf16": 0.035,
             "torch_fp8_rowwise": 0.024, "ours_block_cutlass": 0.025, "linear_w8a8_block": 0.024,
             "linear_w8a8_fp8": 0.022}
    d = bench.block.derive_block(m, n, k, times, read_gbps=3000.0, copy_gbps=2500.0)
    wbytes = n * k + 4 * 56 * 56
    assert bench.block.block_weight_bytes(n, k) == wbytes
    assert d["weight_GBps"] == pytest.approx(wbytes / 20e-6 / 1e9)
    assert d["weight_over_read"] == pytest.approx(d["weight_GBps"] / 3000.0)
    assert d["weight_over_copy"] == pytest.approx(d["weight_GBps"] / 2500.0)
    assert d["x_torch_block"] == pytest.approx(1.5) and d["x_ours_fp8"] == pytest.approx(0.95)
    assert d["x_bf16"] == pytest.approx(1.75) and d["torch_block_x_torch_fp8"] == pytest.approx(0.8)
    assert d["alt"] == "ours_block_cutlass" and d["alt_x_ours_block"] == pytest.approx(1.25)
    assert d["linear_x_linear_fp8"] == pytest.approx(22 / 24)
    assert d["time_us"]["ours_block"] == pytest.approx(20.0)
    assert d["tops"] == pytest.approx(2 * m * n * k / 20e-6 / 1e12)
    d = bench.block.derive_block(m, n, k, {"ours_fp8": 0.019}, None)
    assert d["x_torch_block"] is None and d["weight_GBps"] is None and d["alt"] is None


def _synthetic(bench, x_torch=1.3, read_frac=0.9, x_fp8_large=0.95, rel=1.9e-3):
    """Two shapes over M in {1, 16, 1024}: ours block x_torch times faster than torch at M >= 16 (torch fails at
    M = 1), the weight stream read_frac of the read rate at M <= 16, x_fp8_large of our row-wise fp8 at M = 1024,
    the block paths' relative error rel."""
    points = []
    read = 3000.0
    for shape, n, k in (("dsv3-n7168-k7168", 7168, 7168), ("q3-8b-o", 4096, 4096)):
        wbytes = bench.block.block_weight_bytes(n, k)
        for m in (1, 16, 1024):
            ours = wbytes / (read_frac * read * 1e9) * 1e3 if m <= 16 else 0.2
            times = {"ours_block": ours, "ours_fp8": ours * (x_fp8_large if m == 1024 else 1.0), "bf16": ours * 1.8,
                     "torch_fp8_rowwise": ours * 1.1}
            errors = {}
            if m == 1:
                errors["torch_block"] = "RuntimeError: scale_a must have strides (1, 1)"
                times["ours_block_cutlass"] = ours * 1.5
            else:
                times["torch_block"] = ours * x_torch
            acc = {"cutlass_block": {"rel_fro": rel * 0.9, "max_over_rms": 0.01},
                   "cutlass_fp8": {"rel_fro": 1.2e-3, "max_over_rms": 0.01},
                   "torch_block": {"rel_fro": 1.7e-3, "max_over_rms": 0.01},
                   "bf16_floor": {"rel_fro": 1.6e-3, "max_over_rms": 0.01},
                   "bf16_floor_block": {"rel_fro": 1.6e-3, "max_over_rms": 0.01}, "corner": {"rows": m, "cols": 1024}}
            if m <= 16:
                acc["decode_block"] = {"rel_fro": rel, "max_over_rms": 0.01}
            points.append({"shape": shape, "N": n, "K": k, "M": m, "time_ms": times, "errors": errors,
                           "accuracy": acc, "block": bench.block.derive_block(m, n, k, times, read)})
    results = {"device": "NVIDIA H100 80GB HBM3", "torch_version": torch.__version__, "cuda_version": "13.0",
               "git_commit": "0123456789abcdef", "git_dirty": False, "l2_bytes": 50 * 2**20, "copy_GBps": 2500.0,
               "read_GBps": read, "block_read_GBps": read, "pdl": True, "decode_gemm_max_m": 8,
               "timing": {"replays": 25}, "accuracy_corner": "256 x 1024",
               "shapes": [{"name": "dsv3-n7168-k7168", "N": 7168, "K": 7168},
                          {"name": "q3-8b-o", "N": 4096, "K": 4096}],
               "points": points}
    results["block_targets"] = bench.block.block_targets(points, geomean)
    return results


def _verdicts(results):
    return {t["key"]: t["met"] for t in results["block_targets"]}


def test_block_targets(bench):
    res = _synthetic(bench)
    assert _verdicts(res) == {"x_torch_min": True, "x_torch_geomean": True, "read_fraction": True,
                              "x_rowwise_large": True, "rel_err_cutlass_block": True, "rel_err_decode_block": True}
    t = {x["key"]: x for x in res["block_targets"]}
    assert t["x_torch_min"]["value"] == pytest.approx(1.3) and "4 points" in t["x_torch_min"]["detail"]
    assert t["read_fraction"]["value"] == pytest.approx(0.9)
    assert t["rel_err_decode_block"]["value"] == pytest.approx(1.9e-3)
    res = _synthetic(bench, x_torch=1.1, read_frac=0.8, x_fp8_large=0.85, rel=3e-3)
    assert _verdicts(res) == {"x_torch_min": True, "x_torch_geomean": False, "read_fraction": False,
                              "x_rowwise_large": False, "rel_err_cutlass_block": False, "rel_err_decode_block": False}
    res = _synthetic(bench, x_torch=0.9)
    assert _verdicts(res)["x_torch_min"] is False
    assert bench.block.block_targets([], geomean)[0]["met"] is None


def test_read_rate_above_the_measured_peak_is_invalid(bench):
    """A weight stream faster than the read rate measured in the same run (cold L2) is a broken measurement: the
    read-fraction target is INVALID (not judged), never met, and the "of read" cells say so."""
    res = _synthetic(bench, read_frac=1.07)
    t = {x["key"]: x for x in res["block_targets"]}
    assert t["read_fraction"]["met"] is None and "measured read rate = 1.07" in t["read_fraction"]["invalid"]
    assert t["x_torch_min"]["met"] is True and t["x_torch_min"]["invalid"] is None
    report = bench.block.render_block_markdown(res, geomean)
    line = next(ln for ln in report.splitlines() if ln.startswith("- weight stream / measured read rate"))
    assert "INVALID (" in line and ": met" not in line
    assert "| 1.07 INVALID |" in report
    assert "INVALID" not in bench.block.render_block_markdown(_synthetic(bench), geomean)


def test_render_block_markdown(bench):
    res = _synthetic(bench)
    report = bench.block.render_block_markdown(res, geomean)
    for heading in ("# Block-scaled fp8 GEMM benchmark: NVIDIA H100 80GB HBM3", "## Block-scaled fp8 per shape and M",
                    "## Block-scaled fp8: geomeans by M", "## fp8 accuracy against float64", "## Targets (issue 26)",
                    "## Block methods and accuracy paths that did not run"):
        assert heading in report, heading
    lines = report.splitlines()
    rows = [ln for ln in lines if ln.startswith("| 1 | dsv3-n7168-k7168 |")]
    assert len(rows) == 1 and "| – |" in rows[0]  # torch block n/a at M = 1
    assert "`torch_block` did not run at M in {1}: `RuntimeError: scale_a must have strides (1, 1)`" in report
    # "of read" only at M <= 16
    head = [ln for ln in lines if ln.startswith("| M | shape | ours block us")][0].split("|")
    col = [c.strip() for c in head].index("of read")
    def cells(m):
        return [ln.split("|")[col].strip() for ln in lines if ln.startswith((f"| {m} | dsv3", f"| {m} | q3"))]
    assert cells(1024) == ["–", "–"] and cells(16) == ["0.90", "0.90"]
    verdicts = [ln for ln in lines if "(target" in ln]
    assert len(verdicts) == 6 and all("): met" in ln for ln in verdicts)
    acc_head = [ln for ln in lines if ln.startswith("| M | shapes | ")]
    assert acc_head == ["| M | shapes | CUTLASS row-wise | CUTLASS block | decode block | torch block | bf16 floor |"]
    acc = [ln for ln in lines if ln.startswith("| 16 | 2 |") and "e-03" in ln]
    assert acc == ["| 16 | 2 | 1.20e-03 | 1.71e-03 | 1.90e-03 | 1.70e-03 | 1.60e-03 |"]
    # the full sweep's report: the block part follows the existing one, with its notes
    sections = "\n".join(bench.block.block_sections(res, geomean))
    assert "## Block-scaled fp8 and fp8 accuracy: what was measured" in sections
    no_block = {**res, "points": [{**p, "block": None} for p in res["points"]]}
    text = "\n".join(bench.block.block_sections(no_block, geomean))
    assert "## fp8 accuracy against float64" in text and "## Block-scaled fp8 per shape and M" not in text


def test_plot_block(bench, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "gemm_block.png"
    bench.block.plot_block(_synthetic(bench), str(path))
    assert path.stat().st_size > 0


def test_import_is_cpu_safe(bench):
    assert callable(bench.main.run_block_sweep) and callable(bench.main.measure_block_point)
    assert callable(bench.main.main)


# ---- the measuring flow, with the CUDA pieces faked ----------------------------------------------------------------


def _fake_env(bench, monkeypatch):
    """The sweep's CUDA pieces replaced for a CPU run: tensors made on the CPU, the timer calling each method once
    (a fixed time per method name), bandwidths and device queries constant, the decode bound and PDL switches
    recorded. The GEMMs, quantizers and layers are the real ops (their CPU references)."""
    from cutlass_w8a8.testing import timers

    monkeypatch.setattr(sys.modules["_gemm_methods"], "DEVICE", "cpu")
    for name, value in (("get_device_name", lambda *a: "NVIDIA H100 80GB HBM3"), ("empty_cache", lambda: None),
                        ("get_device_capability", lambda *a: (9, 0))):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(bench.main, "provenance", lambda device, root: {
        "device": device, "device_slug": "nvidia-h100-80gb-hbm3", "torch_version": torch.__version__,
        "cuda_version": "13.0", "git_commit": None})
    ms = {"ours_block": 0.010, "torch_block": 0.013, "ours_fp8": 0.0095, "ours_fp8_accurate": 0.012, "bf16": 0.018,
          "torch_fp8_rowwise": 0.0125}
    timed, reads = [], iter([3000.0, 3100.0] + [2900.0] * 8)

    def interleaved(cases, *, replay_ms, replays, on_error):
        out = {}
        for name, (fn, arg_sets) in cases.items():
            try:
                fn(*arg_sets[0])
            except Exception as exc:  # noqa: BLE001
                on_error(name, exc)
                continue
            timed.append(name)
            t = ms.get(name, 0.02)
            out[name] = timers.GpuTiming(median_ms=t, min_ms=t, max_ms=t, calls_per_replay=1, copies=len(arg_sets),
                                         replays=replays)
        return out

    bu = SimpleNamespace(l2_cache_bytes=lambda: 2**16, copy_bandwidth_gbps=lambda: 2500.0,
                         read_bandwidth_gbps=lambda: next(reads), dense_peak_tops=lambda name: 1979.0,
                         geomean=geomean, rotating_arg_sets=timers.rotating_arg_sets,
                         bench_gpu_time_interleaved=interleaved)
    bounds, pdl = [], []
    fake_cw = SimpleNamespace(scaled_mm=cw.scaled_mm, scaled_mm_decode=cw.scaled_mm_decode, W8A8Linear=cw.W8A8Linear,
                              W8A8Config=cw.W8A8Config, pdl_enabled=lambda: True,
                              set_pdl=lambda on: pdl.append(on) or True,
                              _ext=SimpleNamespace(decode_gemm_max_m=lambda: 8,
                                                   set_decode_gemm_max_m=lambda v: bounds.append(v) or 8))
    return bu, fake_cw, timed, bounds


def test_block_sweep_flow_on_cpu(bench, monkeypatch, tmp_path):
    """run_block_sweep end to end on a small shape at M = 1, 9 and 32 (the other kernel family: CUTLASS at M = 1,
    the decode GEMM at 9, none at 32): every method checked and timed or recorded as failed (torch's blockwise
    scaled_mm has no CPU kernel), the accuracy of every path, the block numbers, the targets, and the report
    files."""
    bu, fake_cw, timed, bounds = _fake_env(bench, monkeypatch)
    args = bench.main.parse_args(["--block", "--m", "1,9,32", "--out", str(tmp_path)])
    args.shape_list = [("tiny", 256, 384)]
    with torch.no_grad():
        res = bench.main.run_block_sweep(args, fake_cw, bu)
    assert [p["M"] for p in res["points"]] == [1, 9, 32]
    assert res["read_GBps"] == 3000.0 and res["read_GBps_end"] == 3100.0 and res["block_read_GBps"] == 3100.0
    for p in res["points"]:
        m = p["M"]
        assert "torch_block" in p["errors"] and "torch_block" not in p["time_ms"]
        want = {"ours_block", "ours_fp8", "ours_fp8_accurate", "bf16", "linear_w8a8_fp8", "linear_w8a8_block"}
        want |= {1: {"ours_block_cutlass"}, 9: {"ours_block_decode"}, 32: set()}[m]
        assert want <= set(p["time_ms"]), (m, p["time_ms"], p["errors"])
        assert not set(p["time_ms"]) - want - {"torch_fp8_rowwise"}
        acc = p["accuracy"]
        assert {"ours_block", "cutlass_block", "cutlass_fp8", "cutlass_fp8_accurate", "ours_fp8_accurate", "bf16_floor",
                "bf16_floor_block"} <= set(acc)
        assert ("decode_block" in acc) == (m <= 16)
        assert acc["cutlass_block"]["rel_fro"] < 4e-3 and acc["corner"] == {"rows": m, "cols": 256}
        assert p["rel_err"]["linear_w8a8_block"] < 0.1 and p["rel_err"]["linear_w8a8_fp8"] < 0.1
        b = p["block"]
        assert b["x_ours_fp8"] == pytest.approx(0.95) and b["x_bf16"] == pytest.approx(1.8)
        assert b["x_ours_fp8_accurate"] == pytest.approx(1.2) and b["time_us"]["ours_fp8_accurate"] == pytest.approx(12)
        assert b["weight_over_read"] == pytest.approx(b["weight_GBps"] / 3100.0)
        assert b["alt"] == {1: "ours_block_cutlass", 9: "ours_block_decode", 32: None}[m]
    assert 0 in bounds and bounds.count(0) == len([v for v in bounds if v == 8])  # every switch-off restored
    assert {t["key"] for t in res["block_targets"]} >= {"x_torch_min", "read_fraction", "rel_err_cutlass_block"}
    paths = bench.main.publish(res, bench.block.render_block_markdown(res, geomean), str(tmp_path), "gemm_block",
                               lambda r, path: open(path, "wb").close())
    assert paths["md"].endswith("gemm_block_nvidia-h100-80gb-hbm3.md")
    report = open(paths["md"]).read()
    assert "| 9 | tiny |" in report and "## fp8 accuracy against float64" in report
    assert "| ours fp8 acc us |" in report and "| x ours fp8 acc |" in report and "CUTLASS row-wise accurate" in report
    assert "ours_fp8_accurate" in res["methods"]
    # --no-fp8-accurate leaves the accurate row-wise method and paths out
    args = bench.main.parse_args(["--block", "--m", "32", "--no-fp8-accurate"])
    args.shape_list = [("tiny", 256, 384)]
    with torch.no_grad():
        res = bench.main.run_block_sweep(args, fake_cw, bu)
    p = res["points"][0]
    assert "ours_fp8_accurate" not in p["time_ms"] and "ours_fp8" in p["time_ms"]
    assert not {"ours_fp8_accurate", "cutlass_fp8_accurate"} & set(p["accuracy"])
    assert p["block"]["x_ours_fp8_accurate"] is None and "ours_fp8_accurate" not in res["methods"]


def test_full_sweep_flow_with_block_columns_on_cpu(bench, monkeypatch, tmp_path):
    """run_sweep (the full comparison, torchao off) with the block columns: the block methods timed beside the
    int8 / fp8 ones, every point's fp8 accuracy, the block numbers and targets, and the report's block part."""
    bu, fake_cw, timed, bounds = _fake_env(bench, monkeypatch)

    def rowwise_reference(a, w, scale_a, scale_b_row):  # torch 2.11's CPU _scaled_mm has no row-wise scales
        return ((a.float() @ w.float().t()) * scale_a * scale_b_row).to(torch.bfloat16)

    for module in ("_gemm_methods", "_gemm_block"):  # the timed method and the accuracy path
        monkeypatch.setattr(sys.modules[module], "torch_fp8_rowwise", rowwise_reference)
    args = bench.main.parse_args(["--m", "2,32", "--no-torchao", "--out", str(tmp_path)])
    args.shape_list = [("tiny", 256, 384)]
    with torch.no_grad():
        res = bench.main.run_sweep(args, fake_cw, bu, None, "off in this test")
    assert res["block_columns"] and res["decode_gemm_max_m"] == 8
    for p in res["points"]:
        assert {"ours_int8", "ours_fp8", "ours_block", "linear_w8a8_block", "ours_int8_nopdl"} <= set(p["time_ms"])
        assert ("ours_block_cutlass" in p["time_ms"]) == (p["M"] == 2)
        assert p["block"]["x_torch_block"] is None and p["block"]["x_ours_fp8"] == pytest.approx(0.95)
        assert {"cutlass_fp8", "cutlass_block"} <= set(p["accuracy"])
        assert p["derived"]["ours_x_bf16"] is not None
    report = bench.report.render_markdown(res, geomean) + "\n".join(bench.block.block_sections(res, geomean))
    assert "## Block-scaled fp8 per shape and M" in report and "| 32 | tiny |" in report
    # accurate row-wise fp8 beside the fast one: timed, checked against float64, its ratios, issue 37's targets
    for p in res["points"]:
        d = p["derived"]
        assert "ours_fp8_accurate" in p["time_ms"] and p["accuracy"]["cutlass_fp8_accurate"]["rel_fro"] < 4e-3
        assert d["ours_fp8_accurate_x_ours_fp8"] == pytest.approx(0.0095 / 0.012)
        assert d["ours_fp8_accurate_x_torch_fp8"] == pytest.approx(0.0125 / 0.012)
        assert d["ours_fp8_accurate_tops"] == pytest.approx(2 * p["M"] * 256 * 384 / 12e-6 / 1e12)
    assert res["fp8_accurate"] and res["fp8_fast_accum_default"] is True
    t = {x["key"]: x for x in res["fp8_accurate_targets"]}
    assert t["accurate_x_torch_min"]["met"] is None  # no point at M >= 128
    assert t["rel_err_fp8_accurate"]["met"] is True and t["rel_err_fp8_accurate"]["value"] < 2e-3
    assert "## Targets (issue 37): accurate row-wise fp8" in report and "`FP8_FAST_ACCUM`" in report
    args = bench.main.parse_args(["--m", "2", "--no-torchao", "--no-block-columns", "--no-fp8-accurate"])
    args.shape_list = [("tiny", 256, 384)]
    with torch.no_grad():
        res = bench.main.run_sweep(args, fake_cw, bu, None, "off")
    p = res["points"][0]
    assert "ours_fp8_accurate" not in p["time_ms"] and p["derived"]["ours_fp8_accurate_x_torch_fp8"] is None
    assert "fp8_accurate_targets" not in res and "Targets (issue 37)" not in bench.report.render_markdown(res, geomean)
    args = bench.main.parse_args(["--m", "2", "--no-torchao", "--no-block-columns"])
    args.shape_list = [("tiny", 256, 384)]
    with torch.no_grad():
        res = bench.main.run_sweep(args, fake_cw, bu, None, "off")
    p = res["points"][0]
    assert "ours_block" not in p["time_ms"] and "block" not in p and "cutlass_fp8" in p["accuracy"]
    assert "block_targets" not in res


# ---- bench/tune_sm90.py's block table ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tune():
    spec = importlib.util.spec_from_file_location("tune_sm90", BENCH / "tune_sm90.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tune_sm90_block_table(tune):
    """The tables are csrc/gemm/kernel_api.h's cw8a8_config_table ids; fp8-block sweeps the block shapes with group
    and block scale shapes; the command line refuses an unknown table."""
    header = (BENCH.parent / "csrc" / "gemm" / "kernel_api.h").read_text()
    for name, key in (("int8", "CW8A8_TABLE_INT8"), ("fp8", "CW8A8_TABLE_FP8"), ("fp8-block", "CW8A8_TABLE_FP8_BLOCK")):
        assert f"{key} = {tune.TABLES[name]}," in header, key
    assert tune.parse_args(["--dtypes", "int8,fp8-block"]).dtype_list == ["int8", "fp8-block"]
    with pytest.raises(SystemExit):
        tune.parse_args(["--dtypes", "fp8,int4"])
    assert tune.shapes_for("fp8-block", None) == list(BLOCK_SHAPES)
    assert tune.shapes_for("fp8", "70b") == [s for s in SHAPES if "70b" in s[0]]
    assert tune.scale_shapes("fp8-block", 3, 200, 384) == ((3, 3), (2, 3))
    assert tune.scale_shapes("int8", 3, 200, 384) == ((3, 1), (200,))
    points = [{"dtype": "fp8-block", "M": 16, "shape": s, "times_us": {"swap_128x16x128": t1, "swap_128x32x128": t2}}
              for s, t1, t2 in (("a", 10.0, 12.0), ("b", 11.0, 10.0))]
    text = tune.summarize(points, geomean)
    assert "## fp8-block: best config per point" in text and "| 16 | a | swap_128x16x128 | 10.0 |" in text


def test_tune_sm90_m_lists_and_vs_shipped(tune):
    """fp8-block sweeps its own M list unless --m is given; --m is checked; the vs-shipped section divides each
    config's time by the shipped choice's at the same point and counts the points each config won."""
    args = tune.parse_args(["--dtypes", "fp8,fp8-block"])
    assert args.m_list is None
    assert tune.m_values_for("fp8-block", None) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert tune.m_values_for("fp8", None) == tune.M_VALUES
    assert tune.m_values_for("fp8-block", tune.parse_args(["--m", "256,1024"]).m_list) == [256, 1024]
    for bad in ("x", "0", ","):
        with pytest.raises(SystemExit):
            tune.parse_args(["--m", bad])
    assert tune.parse_args(["--configs", "c2x1,swizzle"]).configs == "c2x1,swizzle"
    points = [{"dtype": "fp8-block", "M": 256, "shape": s, "shipped": "ship",
               "times_us": {"ship": ship, "cand": cand}}
              for s, ship, cand in (("a", 10.0, 8.0), ("b", 10.0, 12.5))]
    points.append({"dtype": "fp8-block", "M": 256, "shape": "c", "shipped": None, "times_us": {"ship": 1.0}})
    lines = tune.vs_shipped(points, "fp8-block", geomean)
    text = "\n".join(lines)
    assert "M = 256: 2 shapes; shipped: ship" in text
    assert "| cand | 1.000 | 0.800 | 1.250 | 2 | 1 |" in text and "| ship | 1.000 | 1.000 | 1.000 | 2 | 1 |" in text
    assert tune.vs_shipped(points, "int8", geomean) == []
    assert "every config against the shipped choice" in tune.summarize(points, geomean)


def test_tune_sm90_identical_to_reference(tune):
    """The bit-identity section counts, per config, the points where its output equaled the default's among those
    where it passed the check; --configs waves selects the wave-mainloop candidates by name."""
    points = [{"dtype": "fp8-block", "M": 256, "shape": s, "identical": ident}
              for s, ident in (("a", {"ship": True, "256x128x128_c1x1_cooperative_persistent_waves": True}),
                               ("b", {"ship": True, "256x128x128_c1x1_cooperative_persistent_waves": False}))]
    points.append({"dtype": "fp8-block", "M": 512, "shape": "c", "identical": {}})
    text = "\n".join(tune.identical_to_reference(points, "fp8-block"))
    assert "bit-identical to the reference's" in text
    assert "| 256x128x128_c1x1_cooperative_persistent_waves | 1 | 2 |" in text and "| ship | 2 | 2 |" in text
    assert tune.identical_to_reference(points, "fp8") == []
    assert tune.parse_args(["--configs", "waves"]).configs == "waves"
    assert tune.parse_args([]).reference is None
    assert tune.parse_args(["--reference", "128x128x128_c2x1_pingpong_persistent"]).reference.startswith("128x128")
    assert tune.plausible("256x128x128_c2x1_cooperative_persistent_waves", 256)


def test_point_table_marks_impossible_figures(bench):
    """bench_gemm's per-point table: a TOPS figure above the dense peak, or a share outside [0, 1], is marked INVALID
    (`cutlass_w8a8.testing.physical`); possible ones are not."""
    m, n, k = 4096, 8192, 8192
    times = {"ours_int8": 1.0, "quant_int8": 1.5, "linear_w8a8": 1.2}  # 550 TOPS; quant 1.25x the whole forward
    d = bench.main.derive(m, n, k, times, 2500.0, 100.0)
    assert d["ours_pct_peak"] == pytest.approx(2 * m * n * k / 1e-3 / 1e12)
    row = bench.report.point_table([{"M": m, "shape": "big", "derived": d}]).splitlines()[-1]
    cells = [c.strip() for c in row.split("|")]
    assert cells[5] == "549.8 INVALID" and cells[13] == "1.25 INVALID" and cells[14] == "0.17"
    ok = bench.main.derive(m, n, k, {"ours_int8": 1.0, "quant_int8": 0.1, "linear_w8a8": 1.1}, 2500.0, 1000.0)
    assert "INVALID" not in bench.report.point_table([{"M": m, "shape": "big", "derived": ok}])


# ---- accurate row-wise fp8 (issue 37) in the full sweep's report ---------------------------------------------------


def _accurate_points(bench, x_torch=1.05, rel=1.8e-3, x_torch_small=0.5):
    """Two Llama shapes at M in {16, 128, 4096}: ours accurate x_torch times faster than torch's row-wise _scaled_mm at
    M >= 128 (x_torch_small at M = 16, outside the target's range), 1.1x slower than our fast fp8, and the accurate
    CUTLASS path's error rel (the dispatched one's a little lower)."""
    points = []
    for shape, n, k in (("l3-8b-qkv", 6144, 4096), ("l3-70b-down", 8192, 28672)):
        for m in (16, 128, 4096):
            acc_t = 0.1
            times = {"ours_int8": 0.05, "ours_fp8": acc_t / 1.1, "ours_fp8_accurate": acc_t,
                     "torch_fp8_rowwise": acc_t * (x_torch if m >= 128 else x_torch_small)}
            d = bench.main.derive(m, n, k, times, 2500.0, 1979.0)
            accuracy = {"cutlass_fp8_accurate": {"rel_fro": rel if m == 4096 else 1.7e-3, "max_over_rms": 0.01},
                        "ours_fp8_accurate": {"rel_fro": 1.65e-3, "max_over_rms": 0.01}}
            points.append({"shape": shape, "N": n, "K": k, "M": m, "derived": d, "accuracy": accuracy, "errors": {}})
    return points


def test_fp8_accurate_targets(bench):
    """Issue 37's two lines for accurate row-wise fp8: the lowest x torch over M >= 128 and the highest error of the
    accurate paths; met, then each one missed; a missing number leaves a target unjudged."""
    t = {x["key"]: x for x in bench.report.fp8_accurate_targets(_accurate_points(bench))}
    assert t["accurate_x_torch_min"]["met"] is True and t["accurate_x_torch_min"]["value"] == pytest.approx(1.05)
    assert "4 points" in t["accurate_x_torch_min"]["detail"]  # M = 16 is outside the target
    assert t["rel_err_fp8_accurate"]["met"] is True and t["rel_err_fp8_accurate"]["value"] == pytest.approx(1.8e-3)
    assert "worst cutlass_fp8_accurate" in t["rel_err_fp8_accurate"]["detail"]
    t = {x["key"]: x for x in bench.report.fp8_accurate_targets(_accurate_points(bench, x_torch=0.96, rel=2.3e-3))}
    assert t["accurate_x_torch_min"]["met"] is False and t["accurate_x_torch_min"]["value"] == pytest.approx(0.96)
    assert t["rel_err_fp8_accurate"]["met"] is False and t["rel_err_fp8_accurate"]["value"] == pytest.approx(2.3e-3)
    none = bench.report.fp8_accurate_targets([{**p, "accuracy": {}} for p in _accurate_points(bench) if p["M"] < 128])
    assert [x["met"] for x in none] == [None, None]
    # the flip line names what stands in the way of FP8_FAST_ACCUM = False
    items = bench.report.fp8_accurate_targets(_accurate_points(bench, x_torch=0.96))
    line = bench.report.flip_line(items, True)
    assert "`FP8_FAST_ACCUM` (cutlass_w8a8/ops/_limits.py) was True" in line
    assert "not yet: ours accurate row-wise fp8 / torch row-wise `_scaled_mm`" in line and "is missed" in line
    assert "both targets above are met: both met in this run." in bench.report.flip_line(
        bench.report.fp8_accurate_targets(_accurate_points(bench)), True)
    assert "not judged" in bench.report.flip_line(none, True)
    assert "already the default" in bench.report.flip_line(items, False)


def test_render_markdown_fp8_accurate(bench):
    """The full sweep's report: the accurate columns per point and in the summary by M, issue 37's targets with their
    verdicts (one missed here) and the flip line."""
    points = _accurate_points(bench, x_torch=0.96)
    for p in points:
        p["time_ms"] = {}
        p["timing"] = {}
    results = {"device": "NVIDIA H200", "torch_version": torch.__version__, "cuda_version": "13.0",
               "git_commit": "0123456789abcdef", "git_dirty": False, "l2_bytes": 60 * 2**20, "copy_GBps": 3800.0,
               "read_GBps": 4200.0, "peak_tops": 1979.0, "pdl": True, "timing": {"replays": 25},
               "torchao": {"enabled": False, "reason": "off"}, "fp8_fast_accum_default": True, "points": points,
               "fp8_accurate_targets": bench.report.fp8_accurate_targets(points)}
    report = bench.report.render_markdown(results, geomean)
    lines = report.splitlines()
    head = [c.strip() for c in next(ln for ln in lines if ln.startswith("| M | shape | ours us")).split("|")]
    row = [c.strip() for c in next(ln for ln in lines if ln.startswith("| 4096 | l3-70b-down |")).split("|")]
    assert row[head.index("fp8 acc x fp8-torch")] == "0.96" and row[head.index("fp8 acc x fp8")] == "0.91"
    assert row[head.index("fp8 acc TOPS")] == f"{2 * 4096 * 8192 * 28672 / 0.1e-3 / 1e12:.1f}"
    summary = [c.strip() for c in next(ln for ln in lines if ln.startswith("| M | points |")).split("|")]
    assert "fp8 acc x fp8-torch" in summary and "fp8 acc x fp8" in summary
    assert "## Targets (issue 37): accurate row-wise fp8" in report
    verdicts = [ln for ln in lines if "(target" in ln]
    assert len(verdicts) == 2
    assert "0.960 (target >= 1)" in verdicts[0] and "): met" not in verdicts[0]
    assert "1.80e-03 (target <= 0.002): met" in verdicts[1]
    assert any(ln.startswith("- `FP8_FAST_ACCUM`") and "not yet" in ln for ln in lines)
