"""scaled_mm_decode and linear_decode on CPU tensors: reference implementations, argument checks, fake kernels
and opcheck. Runs in CI (no GPU); the CUDA kernels are tested in tests/gemm/test_decode_gemm_cuda.py.

The CPU implementations are scaled_mm's reference math (and, for linear_decode, the CPU per-token quantization
first), so on the CPU scaled_mm_decode equals scaled_mm and linear_decode equals quantize_per_token followed by
scaled_mm_decode, bit for bit, by construction; these tests pin that down together with the checks.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import assert_close_to_reference, rand_operand, rand_scale, reference, scale_magnitudes
from _opcheck import run_opcheck  # opcheck, with fp8's test_schema replaced by a mutation check

OPS = torch.ops.cutlass_w8a8
AB_DTYPES = [torch.int8, torch.float8_e4m3fn]
OUT_DTYPES = [torch.bfloat16, torch.float16]
SCALE_KINDS = [(True, True), (True, False), (False, True), (False, False)]  # (per_token, per_channel)


def problem(m, n, k, dtype=torch.int8, per_token=True, per_channel=True, bias=False, out_dtype=torch.bfloat16,
            seed=0):
    g = torch.Generator().manual_seed(seed)
    a = rand_operand((m, k), dtype, "cpu", g)
    w = rand_operand((n, k), dtype, "cpu", g)
    ma, mb = scale_magnitudes(dtype, k)
    sa = rand_scale((m, 1) if per_token else (1,), "cpu", ma, g)
    sb = rand_scale((n,) if per_channel else (1,), "cpu", mb, g)
    b = (torch.randn(n, generator=g) * 4).to(out_dtype) if bias else None
    return a, w, sa, sb, b


def activations(m, k, xdtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * 3).to(xdtype)


# ---- references -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", AB_DTYPES)
@pytest.mark.parametrize("m", range(1, 17))
def test_scaled_mm_decode_cpu_equals_scaled_mm(dtype, m):
    """Every M of the op's range, every scale kind, bias or not, both output dtypes; K not a multiple of 64."""
    n, k = 48, 208
    for i, (per_token, per_channel) in enumerate(SCALE_KINDS):
        for bias in (False, True):
            for out_dtype in OUT_DTYPES:
                a, w, sa, sb, b = problem(m, n, k, dtype, per_token, per_channel, bias, out_dtype, seed=m * 10 + i)
                out = cw.scaled_mm_decode(a, w.t(), sa, sb, out_dtype, b)
                assert out.dtype == out_dtype and out.shape == (m, n)
                assert torch.equal(out, cw.scaled_mm(a, w.t(), sa, sb, out_dtype, b))
                assert_close_to_reference(out, reference(a, w.t(), sa, sb, b), out_dtype,
                                          what=f"M={m} {dtype} {per_token} {per_channel} {bias} {out_dtype}")


def test_scaled_mm_decode_out_writes_every_element_and_returns_out():
    a, w, sa, sb, b = problem(7, 32, 64, bias=True)
    out = torch.full((7, 32), float("nan"), dtype=torch.bfloat16)
    assert cw.scaled_mm_decode(a, w.t(), sa, sb, bias=b, out=out) is out
    assert torch.equal(out, cw.scaled_mm(a, w.t(), sa, sb, torch.bfloat16, b))


def test_scaled_mm_decode_padded_and_strided_views():
    """Padded a rows, a K window of a wider weight, a padded out: read through their strides."""
    m, n, k = 5, 32, 96
    g = torch.Generator().manual_seed(3)
    a = rand_operand((m, k + 32), torch.int8, "cpu", g)[:, 16:16 + k]
    w = rand_operand((n, k + 48), torch.int8, "cpu", g)[:, 32:32 + k]
    sa, sb = rand_scale((m, 1), "cpu", 1e-3, g), rand_scale((n,), "cpu", 1e-3, g)
    out_buf = torch.full((m, n + 16), 7.0, dtype=torch.bfloat16)
    out = out_buf[:, 8:8 + n]
    cw.scaled_mm_decode(a, w.t(), sa, sb, out=out)
    assert torch.equal(out, cw.scaled_mm(a.contiguous(), w.contiguous().t(), sa, sb))
    assert (out_buf[:, :8] == 7).all() and (out_buf[:, 8 + n:] == 7).all()


@pytest.mark.parametrize("dtype", AB_DTYPES)
@pytest.mark.parametrize("xdtype", OUT_DTYPES)
@pytest.mark.parametrize("m", [1, 2, 8, 9, 16])
def test_linear_decode_cpu_equals_quantize_then_gemm(dtype, xdtype, m):
    n, k = 48, 272
    x = activations(m, k, xdtype, seed=m)
    x[m // 2] = 0  # a row of zeros: scale 0, q = 0, output = bias
    g = torch.Generator().manual_seed(m + 100)
    w = rand_operand((n, k), dtype, "cpu", g)
    for per_channel in (True, False):
        sb = rand_scale((n,) if per_channel else (1,), "cpu", 1e-2, g)
        for bias in (None, torch.randn(n, generator=g).to(xdtype)):
            y = cw.linear_decode(x, w.t(), sb, bias, dtype)
            q, s = OPS.quantize_per_token(x, dtype)
            assert y.dtype == xdtype and y.shape == (m, n)
            assert torch.equal(y, cw.scaled_mm_decode(q, w.t(), s, sb, xdtype, bias))
            if bias is not None:
                assert torch.equal(y[m // 2], bias)


def test_linear_decode_dtype_defaults_to_the_weight_dtype_and_out_form():
    x = activations(3, 64)
    w = rand_operand((32, 64), torch.float8_e4m3fn, "cpu")
    sb = torch.full((32,), 0.01)
    y = cw.linear_decode(x, w.t(), sb)
    assert torch.equal(y, cw.linear_decode(x, w.t(), sb, None, torch.float8_e4m3fn))
    out = torch.full((3, 32), float("nan"), dtype=torch.bfloat16)
    assert cw.linear_decode(x, w.t(), sb, out=out) is out
    assert torch.equal(out, y)


def test_linear_decode_close_to_the_float_linear():
    """End to end: int8 W8A8 of a float linear stays within quantization error of it."""
    torch.manual_seed(0)
    x = torch.randn(4, 512, dtype=torch.bfloat16)
    lin = torch.nn.Linear(512, 64, bias=True, dtype=torch.bfloat16)
    layer = cw.W8A8Linear.from_float(lin)
    y = cw.linear_decode(x, layer.weight.t(), layer.weight_scale, layer.bias)
    ref = lin(x).float()
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert rel < 3e-2
    assert torch.equal(y, layer(x))  # W8A8Linear's CPU forward is the same quantize -> scaled_mm chain


# ---- argument checks ----------------------------------------------------------------------------------------


def _gemm_ok():
    a, w, sa, sb, b = problem(4, 32, 64, bias=True)
    return dict(a=a, b=w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, bias=b)


GEMM_BAD = {
    "M = 0": (ValueError, "`a` M = a.shape", dict(a=torch.zeros(0, 64, dtype=torch.int8),
                                                  scale_a=torch.ones(1))),
    "M = 17": (ValueError, "`a` M = a.shape", dict(a=torch.zeros(17, 64, dtype=torch.int8),
                                                   scale_a=torch.ones(1))),
    "a wrong dtype": (TypeError, "`a`", dict(a=torch.zeros(4, 64))),
    "K not multiple of 16": (ValueError, "`a`", dict(a=torch.zeros(4, 40, dtype=torch.int8),
                                                     b=torch.zeros(32, 40, dtype=torch.int8).t())),
    "b row-major": (ValueError, "`b`", dict(b=torch.zeros(64, 32, dtype=torch.int8))),
    "scale_a wrong shape": (ValueError, "`scale_a`", dict(scale_a=torch.ones(3, 1))),
    "out_dtype float32": (TypeError, "`out_dtype`", dict(out_dtype=torch.float32)),
}


@pytest.mark.parametrize("case", sorted(GEMM_BAD))
def test_scaled_mm_decode_bad_input(case):
    exc, what, change = GEMM_BAD[case]
    kwargs = {**_gemm_ok(), **change}
    with pytest.raises(exc, match=f"^scaled_mm_decode: {what}"):
        cw.scaled_mm_decode(**kwargs)
    with pytest.raises(exc, match=f"^scaled_mm_decode: {what}"):  # the op itself, no wrapper
        OPS.scaled_mm_decode(*kwargs.values())


def test_scaled_mm_decode_k_bound_for_fp8():
    k = 2**30 + 16
    a = torch.empty(1, k, dtype=torch.float8_e4m3fn, device="meta")
    w = torch.empty(16, k, dtype=torch.float8_e4m3fn, device="meta")
    one = torch.ones(1, device="meta")
    with pytest.raises(ValueError, match=r"scaled_mm_decode: `a` K = 1073741840 must be at most 2\*\*30"):
        cw.scaled_mm_decode(a, w.t(), one, one)


def _linear_ok():
    x = activations(4, 64)
    w = rand_operand((32, 64), torch.int8, "cpu")
    return dict(x=x, b=w.t(), scale_b=torch.full((32,), 0.01), bias=torch.zeros(32, dtype=torch.bfloat16),
                dtype=torch.int8)


LINEAR_BAD = {
    "x float32": (TypeError, "`x` must be bfloat16 or float16", dict(x=torch.zeros(4, 64))),
    "dtype float16": (TypeError, "`dtype` must be torch.int8", dict(dtype=torch.float16)),
    "dtype not b's": (TypeError, "`b` must have the quantized dtype", dict(dtype=torch.float8_e4m3fn)),
    "scale_b float16": (TypeError, "`scale_b` must be float32", dict(scale_b=torch.ones(32, dtype=torch.float16))),
    "bias float32": (TypeError, "`bias` must have x's dtype", dict(bias=torch.zeros(32))),
    "M = 0": (ValueError, "`x` M = x.shape", dict(x=torch.zeros(0, 64, dtype=torch.bfloat16))),
    "M = 17": (ValueError, "`x` M = x.shape", dict(x=torch.zeros(17, 64, dtype=torch.bfloat16))),
    "x 3-D": (ValueError, "`x` must be 2-D", dict(x=torch.zeros(1, 4, 64, dtype=torch.bfloat16))),
    "K mismatch": (ValueError, "`b` must be \\[K, N\\] with K = x.shape\\[1\\]",
                   dict(x=torch.zeros(4, 48, dtype=torch.bfloat16))),
    "K not multiple of 16": (ValueError, "`x` K = x.shape\\[1\\] must be a positive multiple of 16",
                             dict(x=torch.zeros(4, 40, dtype=torch.bfloat16),
                                  b=torch.zeros(32, 40, dtype=torch.int8).t())),
    "N not multiple of 16": (ValueError, "`b` N = b.shape\\[1\\]",
                             dict(b=torch.zeros(24, 64, dtype=torch.int8).t(), scale_b=torch.ones(1),
                                  bias=None)),
    "int8 K bound": (ValueError, "`x` K = 131072 can overflow",
                     dict(x=torch.zeros(1, 131072, dtype=torch.bfloat16),
                          b=torch.zeros(16, 131072, dtype=torch.int8).t(), scale_b=torch.ones(1), bias=None)),
    "scale_b wrong shape": (ValueError, "`scale_b` must be \\[1\\]", dict(scale_b=torch.ones(16))),
    "bias wrong length": (ValueError, "`bias` must be \\[N\\]", dict(bias=torch.zeros(16, dtype=torch.bfloat16))),
    "b row-major": (ValueError, "`b` must be column-major", dict(b=torch.zeros(64, 32, dtype=torch.int8))),
    "b bad pitch": (ValueError, "`b` stride\\(1\\) must be a multiple of 16",
                    dict(b=torch.zeros(32, 72, dtype=torch.int8)[:, :64].t())),
    "x column-major": (ValueError, "`x` must be row-major",
                       dict(x=torch.zeros(64, 4, dtype=torch.bfloat16).t())),
    "x rows overlap": (ValueError, "`x` rows overlap",
                       dict(x=torch.zeros(1, 64, dtype=torch.bfloat16).expand(4, 64))),
    "x bad row pitch": (ValueError, "`x` stride\\(0\\) must be a multiple of 8",
                        dict(x=torch.zeros(4, 68, dtype=torch.bfloat16)[:, :64])),
    "x misaligned": (ValueError, "`x` data must be 16-byte aligned",
                     dict(x=torch.zeros(4 * 72 + 4, dtype=torch.bfloat16)[4:].view(4, 72)[:, :64])),
    "b on meta": (ValueError, "`b` is on meta but `x` is on cpu",
                  dict(b=torch.zeros(32, 64, dtype=torch.int8, device="meta").t())),
}


@pytest.mark.parametrize("case", sorted(LINEAR_BAD))
def test_linear_decode_bad_input(case):
    exc, what, change = LINEAR_BAD[case]
    kwargs = {**_linear_ok(), **change}
    with pytest.raises(exc, match=f"^linear_decode: {what}"):
        cw.linear_decode(**kwargs)
    if all(isinstance(v, torch.Tensor) for k, v in kwargs.items() if k not in ("bias", "dtype")):
        with pytest.raises(exc, match=f"^linear_decode: {what}"):  # the op itself, no wrapper
            OPS.linear_decode(*kwargs.values())


def test_linear_decode_bad_out():
    kw = _linear_ok()
    for out, exc, what in [
        (torch.empty(4, 32), TypeError, "`out` must have x's dtype"),
        (torch.empty(5, 32, dtype=torch.bfloat16), ValueError, r"`out` must be \[M, N\]"),
        (torch.empty(32, 4, dtype=torch.bfloat16).t(), ValueError, "`out` must be row-major"),
        (torch.empty(4, 36, dtype=torch.bfloat16)[:, :32], ValueError, r"`out` stride\(0\)"),
    ]:
        with pytest.raises(exc, match=f"^linear_decode: {what}"):
            cw.linear_decode(**kw, out=out)


def test_linear_decode_non_tensor_gets_the_dispatcher_error():
    """The wrapper is thin: a non-tensor `x` or `out` is torch's dispatcher error naming the argument."""
    kw = _linear_ok()
    expected = r"cutlass_w8a8::{}\(\) Expected a value of type 'Tensor' for argument '{}'"
    with pytest.raises(RuntimeError, match=expected.format("linear_decode", "x")):
        cw.linear_decode(**{**kw, "x": [[0.0] * 64] * 4})
    with pytest.raises(RuntimeError, match=expected.format("linear_decode_out", "out")):
        cw.linear_decode(**kw, out=[0.0])


# ---- fake kernels and opcheck ------------------------------------------------------------------------------


def test_fake_kernels_give_shapes_and_dtypes():
    a, w, sa, sb, b = problem(6, 32, 64, bias=True, out_dtype=torch.float16)
    x = activations(6, 64, torch.float16)
    with FakeTensorMode() as mode:
        fa, fw, fsa, fsb, fb, fx = (mode.from_tensor(t) for t in (a, w, sa, sb, b, x))
        y = OPS.scaled_mm_decode(fa, fw.t(), fsa, fsb, torch.float16, fb)
        assert y.shape == (6, 32) and y.dtype == torch.float16
        z = OPS.linear_decode(fx, fw.t(), fsb, fb, torch.int8)
        assert z.shape == (6, 32) and z.dtype == torch.float16
        with pytest.raises(ValueError, match="linear_decode: `x` M = x.shape"):
            OPS.linear_decode(mode.from_tensor(torch.zeros(17, 64, dtype=torch.float16)), fw.t(), fsb, fb,
                              torch.int8)


def opcheck_cases():
    a, w, sa, sb, b = problem(5, 32, 208, bias=True)
    a8, w8, sa8, sb8, _ = problem(12, 48, 64, torch.float8_e4m3fn, per_token=False, per_channel=False)
    x = activations(5, 208)
    xh = activations(12, 64, torch.float16)
    return [
        ("scaled_mm_decode int8", OPS.scaled_mm_decode, (a, w.t(), sa, sb, torch.bfloat16, b)),
        ("scaled_mm_decode fp8", OPS.scaled_mm_decode, (a8, w8.t(), sa8, sb8, torch.float16, None)),
        ("scaled_mm_decode_out", OPS.scaled_mm_decode_out, (torch.empty(5, 32, dtype=torch.bfloat16), a, w.t(),
                                                            sa, sb, b)),
        ("linear_decode int8", OPS.linear_decode, (x, w.t(), sb, b, torch.int8)),
        ("linear_decode fp8", OPS.linear_decode, (xh, w8.t(), sb8, None, torch.float8_e4m3fn)),
        ("linear_decode_out", OPS.linear_decode_out, (torch.empty(5, 32, dtype=torch.bfloat16), x, w.t(), sb, b,
                                                      torch.int8)),
    ]


@pytest.mark.parametrize("case", opcheck_cases(), ids=lambda c: c[0])
def test_opcheck_cpu(case):
    _, op, args = case
    run_opcheck(op, args)


def test_exported_names():
    assert cw.DECODE_MAX_M == 16
    assert cw.scaled_mm_decode is cw.ops.scaled_mm_decode and cw.linear_decode is cw.ops.linear_decode
    assert {"scaled_mm_decode", "linear_decode", "DECODE_MAX_M"} <= set(cw.__all__)


# ---- the benchmark script's report (its GPU run must not fail at the end) -------------------------------------


def _bench_module():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "bench_decode_gemm.py"
    spec = importlib.util.spec_from_file_location("bench_decode_gemm", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_report_renders(tmp_path):
    bench = _bench_module()
    args = bench.parse_args(["--shapes", "8b-o,70b-down", "--m", "1,16", "--fp8"])
    assert [s[0] for s in args.shape_list] == ["l3-8b-o", "l3-70b-down"] and args.m_values == [1, 16]
    assert len(bench.parse_args([]).shape_list) == 8
    points = []
    for shape, n, k in args.shape_list:
        for m in args.m_values:
            times = {name: 0.01 * (i + 1) for i, name in enumerate(bench.METHODS + bench.FP8_METHODS)}
            if m == 16:
                del times["linear_decode_fp8"]
            points.append({"shape": shape, "N": n, "K": k, "M": m, "time_ms": times,
                           "errors": {"linear_decode_fp8": "RuntimeError: x"} if m == 16 else {},
                           "derived": bench.derive(m, n, k, times, 3350.0)})
    d, t = points[0]["derived"], points[0]["time_ms"]
    assert d["decode_x_scaled_mm"] == pytest.approx(t["scaled_mm"] / t["decode"])
    assert d["fused_x_unfused"] == pytest.approx(t["quant_decode"] / t["linear_decode"])
    assert d["dispatched_x_scaled_mm"] == pytest.approx(t["scaled_mm"] / t["dispatched"])
    assert d["pct_hbm"]["decode"] == pytest.approx(100 * 4096 * 4096 / 0.02e-3 / 1e12 * 1e3 / 3350.0)
    results = {"device": "NVIDIA H100 80GB HBM3", "device_slug": "nvidia-h100-80gb-hbm3", "sm_count": 132,
               "torch_version": torch.__version__, "cuda_version": "13.0", "git_commit": None, "l2_bytes": 50 * 2**20,
               "hbm_GBps_datasheet": 3350.0, "read_GBps": 3000.0, "pdl": True, "timing": {"replays": 25},
               "points": points}
    from cutlass_w8a8.testing.timers import geomean

    report = bench.render_markdown(results, geomean)
    for heading in ("## Times", "## Weight streaming rate", "## Target: every W8A8 GEMM", "## Geomean ratios",
                    "## Fused quantization", "## Methods that did not run"):
        assert heading in report
    # the read-rate target: dispatched at 0.03 ms per call over a 3000 GB/s read rate: l3-8b-o streams its weights at
    # 19% of it, l3-70b-down at 261%, beyond the measured peak: INVALID (not judged), never met
    assert round(100 * 4096 * 4096 / 0.03e-3 / 3000e9) == 19 and round(100 * 8192 * 28672 / 0.03e-3 / 3000e9) == 261
    assert ("- M = 1: worst l3-8b-o at 19% of 3000 GB/s (INVALID (l3-70b-down at 261% of the measured read rate = "
            "2.61 is beyond its physical bound (<= 1)))") in report
    assert "l3-70b-down 261% INVALID" in report and "NOT met" not in report and "(met)" not in report
    # and above the datasheet HBM bandwidth in the rate table (decode at 0.02 ms: 350% of 3350 GB/s)
    assert "(351%) INVALID" in report
    # a run whose rates are all possible is judged: both shapes below 85% of a 20 TB/s read rate
    lines = bench.read_rate_target(points, 20000.0).splitlines()
    assert len(lines) == 2 and all("(NOT met)" in ln and "INVALID" not in ln for ln in lines)
    bench.plot_results(results, str(tmp_path / "plot.png"))  # draws, or says that matplotlib is missing
