"""add_rms_norm_linear_decode on CPU tensors: the CPU implementation, argument checks, fake kernel and opcheck. The CUDA
kernel is tested in tests/gemm/test_norm_decode_cuda.py.

The CPU implementation is the chain the op replaces, rms_norm_quant's CPU implementation on a copy of the residual
(which becomes residual_out) then scaled_mm_decode's, so on the CPU the op equals that chain bit for bit by
construction; these tests pin that down together with the checks and the float64 accuracy of the result.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cutlass_w8a8 as cw
from cutlass_w8a8.ops import add_rms_norm_linear_decode
from cutlass_w8a8.testing.references import assert_close_to_reference, rand_operand, rand_scale, reference
from _opcheck import run_opcheck

OPS = torch.ops.cutlass_w8a8
AB_DTYPES = [torch.int8, torch.float8_e4m3fn]
XDTYPES = [torch.bfloat16, torch.float16]
EPS = 1e-6


def operands(m, n, k, dtype, xdtype, seed, residual=True, per_channel=True, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).to(xdtype)
    r = (torch.randn(m, k, generator=g) * 4).to(xdtype) if residual else None
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(xdtype)
    w = rand_operand((n, k), dtype, "cpu", g)
    sb = rand_scale((n,) if per_channel else (1,), "cpu", 1e-2, g)
    b = (torch.randn(n, generator=g) * 4).to(xdtype) if bias else None
    return x, r, nw, w, sb, b


def chain(x, r, nw, w, sb, b, dtype):
    stream = r.clone() if r is not None else None
    q, s = OPS.rms_norm_quant(x, nw, EPS, dtype, None, stream)
    return OPS.scaled_mm_decode(q, w.t(), s, sb, x.dtype, b), (x.clone() if stream is None else stream), q, s


@pytest.mark.parametrize("dtype", AB_DTYPES)
@pytest.mark.parametrize("xdtype", XDTYPES)
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 16])
def test_cpu_equals_rms_norm_quant_then_decode_gemm(dtype, xdtype, m):
    n, k = 48, 2048
    for i, (residual, per_channel, bias) in enumerate([(True, True, True), (False, True, False),
                                                       (True, False, False), (False, False, True)]):
        x, r, nw, w, sb, b = operands(m, n, k, dtype, xdtype, seed=m * 10 + i, residual=residual,
                                      per_channel=per_channel, bias=bias)
        r_before = r.clone() if r is not None else None
        what = f"M={m} {dtype} {xdtype} residual={residual} per_channel={per_channel} bias={bias}"
        out, r_out = add_rms_norm_linear_decode(x, r, nw, EPS, w.t(), sb, b, dtype)
        e_out, e_r, q, s = chain(x, r, nw, w, sb, b, dtype)
        assert out.dtype == xdtype and out.shape == (m, n) and r_out.shape == (m, k) and r_out.is_contiguous()
        assert torch.equal(out, e_out), what
        assert torch.equal(r_out, e_r), what
        if r is not None:
            assert torch.equal(r, r_before), f"residual was written: {what}"
            assert torch.equal(r_out, (r.float() + x.float()).to(xdtype)), what
        else:
            assert torch.equal(r_out, x) and r_out.data_ptr() != x.data_ptr(), what
        # accuracy from the dequantized operands (the quantized activations and their per-token scales)
        assert_close_to_reference(out, reference(q, w.t(), s, sb, b), xdtype, what=what)


def test_close_to_the_float_chain():
    """The whole op against float64 arithmetic on the unquantized rows: the error is the activation quantization's
    (half a step of max|y| / 127 per element, int8) times |w|, summed, plus the weights' own grid (exact here)."""
    m, n, k = 4, 64, 1024
    x, r, nw, w, sb, b = operands(m, n, k, torch.int8, torch.bfloat16, seed=3, bias=True)
    out, _ = add_rms_norm_linear_decode(x, r, nw, EPS, w.t(), sb, b)
    s = (r.double() + x.double())
    y = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * nw.double()
    wd = w.double() * sb.double().reshape(-1, 1)
    exact = y @ wd.t() + b.double()
    step = y.abs().amax(-1, keepdim=True) / 127
    # per element: half a quantization step of y, plus y's own bf16 rounding (2**-8 relative) before quantizing
    bound = (0.5 * step + y.abs() * 2**-8) @ wd.abs().t() + exact.abs() * 2**-7 + 1e-3
    assert ((out.double() - exact).abs() <= bound).all()


def test_dtype_defaults_to_the_weight_dtype():
    x, r, nw, w, sb, b = operands(3, 32, 64, torch.float8_e4m3fn, torch.bfloat16, seed=4)
    a = add_rms_norm_linear_decode(x, r, nw, EPS, w.t(), sb)
    e = add_rms_norm_linear_decode(x, r, nw, EPS, w.t(), sb, None, torch.float8_e4m3fn)
    assert torch.equal(a[0], e[0]) and torch.equal(a[1], e[1])


BAD = [
    (TypeError, "`x` must be bfloat16 or float16", dict(x=lambda kw: kw["x"].float())),
    (TypeError, "`residual` must have x's dtype", dict(residual=lambda kw: kw["residual"].half())),
    (TypeError, "`eps` must be a float", dict(eps="1e-6")),
    (TypeError, "`dtype` must be torch.int8 or torch.float8_e4m3fn", dict(dtype=torch.float16)),
    (ValueError, r"`x` M = x.shape\[0\] must be in \[1, 16\]", dict(x=torch.zeros(17, 64, dtype=torch.bfloat16),
                                                                     residual=None)),
    (ValueError, r"`x` must be 2-D \[M, K\]", dict(x=torch.zeros(1, 4, 64, dtype=torch.bfloat16), residual=None)),
    (ValueError, "`residual` must have x's shape", dict(residual=torch.zeros(4, 48, dtype=torch.bfloat16))),
    (ValueError, r"`norm_weight` must be \[K\] with K = 64", dict(norm_weight=torch.ones(1, 64, dtype=torch.bfloat16))),
    (ValueError, "`norm_weight` must be contiguous", dict(norm_weight=torch.ones(128, dtype=torch.bfloat16)[::2])),
    (ValueError, "`scale_b` must be \\[1\\] \\(per-tensor\\)", dict(scale_b=torch.ones(31))),
    (ValueError, r"`residual` must be row-major \(stride\(1\) == 1\)", dict(
        residual=lambda kw: torch.zeros(64, 4, dtype=torch.bfloat16).t())),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[1][:40])
def test_bad_input_names_the_argument(case):
    exc, what, change = case
    x, r, nw, w, sb, b = operands(4, 32, 64, torch.int8, torch.bfloat16, seed=5, bias=True)
    kw = dict(x=x, residual=r, norm_weight=nw, eps=EPS, b=w.t(), scale_b=sb, bias=b, dtype=torch.int8)
    kw.update({k: v(kw) if callable(v) else v for k, v in change.items()})
    if kw["eps"] == "1e-6":  # the dispatcher itself refuses a str for a float: only the check function sees it
        from cutlass_w8a8.ops import _checks
        with pytest.raises(exc, match=f"^add_rms_norm_linear_decode: {what}"):
            _checks.check_add_rms_norm_linear_decode(*kw.values())
        return
    with pytest.raises(exc, match=f"^add_rms_norm_linear_decode: {what}"):
        add_rms_norm_linear_decode(**kw)
    with pytest.raises(exc, match=f"^add_rms_norm_linear_decode: {what}"):  # the op itself, no wrapper
        OPS.add_rms_norm_linear_decode(*kw.values())


def test_fake_kernel_gives_shapes_and_dtypes():
    x, r, nw, w, sb, b = operands(6, 32, 64, torch.int8, torch.float16, seed=6, bias=True)
    with FakeTensorMode() as mode:
        fx, fr, fnw, fw, fsb, fb = (mode.from_tensor(t) for t in (x, r, nw, w, sb, b))
        out, r_out = OPS.add_rms_norm_linear_decode(fx, fr, fnw, EPS, fw.t(), fsb, fb, torch.int8)
        assert out.shape == (6, 32) and out.dtype == torch.float16
        assert r_out.shape == (6, 64) and r_out.dtype == torch.float16
        out, r_out = OPS.add_rms_norm_linear_decode(fx, None, fnw, EPS, fw.t(), fsb, None, torch.int8)
        assert out.shape == (6, 32) and r_out.shape == (6, 64)
        with pytest.raises(ValueError, match="add_rms_norm_linear_decode: `x` K = x.shape"):
            big = mode.from_tensor(torch.zeros(2, 8208, dtype=torch.float16))
            OPS.add_rms_norm_linear_decode(big, None, mode.from_tensor(torch.ones(8208, dtype=torch.float16)), EPS,
                                           mode.from_tensor(torch.zeros(32, 8208, dtype=torch.int8)).t(), fsb[:1],
                                           None, torch.int8)


@pytest.mark.parametrize("dtype", AB_DTYPES)
@pytest.mark.parametrize("residual", [True, False])
def test_opcheck_cpu(dtype, residual):
    x, r, nw, w, sb, b = operands(5, 32, 208, dtype, torch.bfloat16, seed=7, residual=residual, bias=residual)
    run_opcheck(OPS.add_rms_norm_linear_decode, (x, r, nw, EPS, w.t(), sb, b, dtype))


def test_exported():
    assert cw.ops.add_rms_norm_linear_decode is add_rms_norm_linear_decode
    assert "add_rms_norm_linear_decode" in cw.ops.__all__
