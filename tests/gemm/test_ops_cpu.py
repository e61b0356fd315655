"""The ops on CPU tensors: reference implementations, argument checks, fake kernels. Runs in CI (no GPU)."""

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import assert_close_to_reference, rand_operand, rand_scale, reference, scale_magnitudes

from _full import opcheck

AB_DTYPES = [torch.int8, torch.float8_e4m3fn]
OUT_DTYPES = [torch.bfloat16, torch.float16]


def make_problem(m, n, k, dtype=torch.int8, per_token=True, per_channel=True, bias=False,
                 out_dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    a = rand_operand((m, k), dtype, device, g)
    w = rand_operand((n, k), dtype, device, g)
    ma, mb = scale_magnitudes(dtype, k)
    sa = rand_scale((m, 1) if per_token else (1,), device, ma, g)
    sb = rand_scale((n,) if per_channel else (1,), device, mb, g)
    b = torch.randn(n, device=device, generator=g).to(out_dtype) if bias else None
    return a, w, sa, sb, b


@pytest.mark.parametrize("dtype", AB_DTYPES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("per_token,per_channel", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("bias", [False, True])
def test_scaled_mm_cpu_matches_dequantized_reference(dtype, out_dtype, per_token, per_channel, bias):
    a, w, sa, sb, b = make_problem(37, 48, 160, dtype, per_token, per_channel, bias, out_dtype)
    out = cw.scaled_mm(a, w.t(), sa, sb, out_dtype, b)
    assert out.dtype == out_dtype and out.shape == (37, 48)
    ref = reference(a, w.t(), sa, sb, b)
    assert_close_to_reference(out, ref, out_dtype, what="cpu scaled_mm")


def test_scaled_mm_out_writes_every_element():
    a, w, sa, sb, b = make_problem(9, 32, 64, bias=True)
    out = torch.full((9, 32), float("nan"), dtype=torch.bfloat16)
    ret = cw.scaled_mm(a, w.t(), sa, sb, bias=b, out=out)
    assert ret is out
    ref = reference(a, w.t(), sa, sb, b)
    assert_close_to_reference(out, ref, torch.bfloat16, what="cpu scaled_mm out=")


def test_scaled_mm_m_zero():
    a, w, sa, sb, _ = make_problem(0, 32, 64, per_token=False)
    out = cw.scaled_mm(a, w.t(), sa, sb)
    assert out.shape == (0, 32)


@pytest.mark.parametrize("qdtype", AB_DTYPES)
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_per_token_reference(qdtype, xdtype):
    x = torch.randn(3, 5, 64).to(xdtype)
    x[1, 2] = 0  # a row of zeros
    quant = cw.quantize_int8 if qdtype == torch.int8 else cw.quantize_fp8
    q, s = quant(x)
    assert q.dtype == qdtype and q.shape == x.shape and s.shape == (3, 5, 1) and s.dtype == torch.float32
    qmax = 127.0 if qdtype == torch.int8 else 448.0
    amax = x.float().abs().amax(-1, keepdim=True)
    torch.testing.assert_close(s, amax / qmax, rtol=0, atol=0)
    assert s[1, 2].item() == 0 and (q[1, 2].float() == 0).all()
    # the largest element of each nonzero row maps to +-QMAX, and dequantization is close
    assert torch.equal(q.float().abs().amax(-1), torch.where(amax[..., 0] > 0, qmax, 0.0))
    deq = q.float() * s
    err = (deq - x.float()).abs()
    step = s if qdtype == torch.int8 else s * 32  # e4m3 has 3 mantissa bits: relative spacing 2**-3
    assert (err <= step / 2 + 1e-6 * x.float().abs()).all() if qdtype == torch.int8 else \
        (err <= x.float().abs() * 2.0 ** -4 + s * 2.0 ** -9).all()


@pytest.mark.parametrize("qdtype", AB_DTYPES)
def test_quantize_static_saturates(qdtype):
    x = torch.tensor([[0.0, 1.0, -1.0, 1e6, -1e6, 2.5, 3.5]], dtype=torch.float32)
    scale = torch.tensor([0.5])
    quant = cw.quantize_int8 if qdtype == torch.int8 else cw.quantize_fp8
    q, s = quant(x, scale)
    assert s is scale
    if qdtype == torch.int8:
        # round half to even: 2.5 / 0.5 = 5, 3.5 / 0.5 = 7; 1e6 saturates
        assert q.tolist() == [[0, 2, -2, 127, -128, 5, 7]]
    else:
        assert q.float().tolist() == [[0.0, 2.0, -2.0, 448.0, -448.0, 5.0, 7.0]]


# ---- argument checks: each raises a clear error naming the argument -----------------------------------

def _ok():
    return make_problem(4, 32, 64, bias=True)


BAD_CASES = {
    "a wrong dtype": (TypeError, "`a`", lambda a, w, sa, sb, b: dict(a=a.float())),
    "b dtype differs": (TypeError, "`b`", lambda a, w, sa, sb, b: dict(b=w.t().to(torch.float8_e4m3fn))),
    "scale_a float16": (TypeError, "`scale_a`", lambda a, w, sa, sb, b: dict(scale_a=sa.half())),
    "scale_b float64": (TypeError, "`scale_b`", lambda a, w, sa, sb, b: dict(scale_b=sb.double())),
    "out_dtype float32": (TypeError, "`out_dtype`", lambda a, w, sa, sb, b: dict(out_dtype=torch.float32)),
    "bias wrong dtype": (TypeError, "`bias`", lambda a, w, sa, sb, b: dict(bias=b.float())),
    "bias wrong length": (ValueError, "`bias`", lambda a, w, sa, sb, b: dict(bias=b[:16])),
    "a 3-D": (ValueError, "`a`", lambda a, w, sa, sb, b: dict(a=a[None])),
    "K mismatch": (ValueError, "`b`", lambda a, w, sa, sb, b: dict(b=w[:, :48].t())),
    "K not multiple of 16": (ValueError, "`a`", lambda a, w, sa, sb, b: dict(a=a[:, :40], b=w[:, :40].t())),
    "N not multiple of 16": (ValueError, "`b`", lambda a, w, sa, sb, b: dict(b=w[:24].t(), scale_b=sb[:24],
                                                                            bias=b[:24])),
    "scale_a wrong shape": (ValueError, "`scale_a`", lambda a, w, sa, sb, b: dict(scale_a=sa[:3])),
    "scale_b wrong shape": (ValueError, "`scale_b`", lambda a, w, sa, sb, b: dict(scale_b=sb[:16])),
    "scale_a non-contiguous": (ValueError, "`scale_a`",
                               lambda a, w, sa, sb, b: dict(scale_a=torch.rand(4, 2)[:, :1])),
    "b row-major": (ValueError, "`b`", lambda a, w, sa, sb, b: dict(b=w.t().contiguous())),
    "a column-major": (ValueError, "`a`", lambda a, w, sa, sb, b: dict(a=a.t().contiguous().t())),
    "a misaligned": (ValueError, "`a`", lambda a, w, sa, sb, b: dict(
        a=torch.randint(-8, 8, (4 * 80 + 8,), dtype=torch.int8)[8:].view(4, 80)[:, :64])),
    "a bad row pitch": (ValueError, "`a`", lambda a, w, sa, sb, b: dict(
        a=torch.randint(-8, 8, (4, 72), dtype=torch.int8)[:, :64])),
    "int8 K too large": (ValueError, "`a`", lambda a, w, sa, sb, b: dict(
        a=torch.zeros(1, cw.INT8_MAX_K + 16, dtype=torch.int8),
        b=torch.zeros(32, cw.INT8_MAX_K + 16, dtype=torch.int8).t(), scale_a=sa[:1])),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_scaled_mm_bad_input(case):
    exc, name, change = BAD_CASES[case]
    a, w, sa, sb, b = _ok()
    kwargs = dict(a=a, b=w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, bias=b)
    kwargs.update(change(a, w, sa, sb, b))
    with pytest.raises(exc, match=f"scaled_mm: {name}"):
        cw.scaled_mm(**kwargs)
    # the op itself (no wrapper) raises the same error
    if isinstance(kwargs["a"], torch.Tensor):
        with pytest.raises(exc, match=f"scaled_mm: {name}"):
            torch.ops.cutlass_w8a8.scaled_mm(*kwargs.values())


def test_non_tensor_argument_gets_the_dispatcher_error():
    """The wrappers are thin: a non-tensor where the schema says Tensor is torch's dispatcher error, naming the
    argument (a RuntimeError), before any implementation runs."""
    a, w, sa, sb, b = _ok()
    with pytest.raises(RuntimeError, match="Expected a value of type 'Tensor' for argument 'a'"):
        cw.scaled_mm(a.tolist(), w.t(), sa, sb)
    with pytest.raises(RuntimeError, match="Expected a value of type 'Tensor' for argument 'scale'"):
        cw.quantize_int8(torch.zeros(4, 16), 0.1)


def test_scaled_mm_bad_out():
    a, w, sa, sb, b = _ok()
    for out, exc, what in [
        (torch.empty(4, 32, dtype=torch.float32), TypeError, "`out` must be bfloat16"),
        (torch.empty(5, 32, dtype=torch.bfloat16), ValueError, r"`out` must be \[M, N\]"),
        (torch.empty(32, 4, dtype=torch.bfloat16).t(), ValueError, "`out` must be row-major"),
        (torch.empty(4, 36, dtype=torch.bfloat16)[:, :32], ValueError, "`out` stride"),
    ]:
        with pytest.raises(exc, match=what):
            cw.scaled_mm(a, w.t(), sa, sb, bias=b, out=out)


def test_quantize_bad_input():
    # the wrappers call the ops: their checks name the op (quantize_per_token, or quantize_per_tensor with a scale)
    with pytest.raises(TypeError, match="quantize_per_token: `x`"):
        cw.quantize_int8(torch.zeros(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="quantize_per_token: `x`"):
        cw.quantize_int8(torch.tensor(1.0))
    with pytest.raises(TypeError, match="quantize_per_tensor: `scale`"):
        cw.quantize_fp8(torch.zeros(4, 16), torch.ones(1, dtype=torch.float16))
    with pytest.raises(ValueError, match="quantize_per_tensor: `scale`"):
        cw.quantize_int8(torch.zeros(4, 16), torch.ones(2))
    with pytest.raises(TypeError, match="quantize_per_token: `dtype`"):
        torch.ops.cutlass_w8a8.quantize_per_token(torch.zeros(4, 16), torch.int32)


def test_opcheck_cpu():
    a, w, sa, sb, b = _ok()
    out = torch.empty(4, 32, dtype=torch.bfloat16)
    x = torch.randn(2, 3, 32, dtype=torch.bfloat16)
    for op, args in [
        (torch.ops.cutlass_w8a8.scaled_mm, (a, w.t(), sa, sb, torch.bfloat16, b)),
        (torch.ops.cutlass_w8a8.scaled_mm, (a, w.t(), sa[:1], sb[:1], torch.float16, None)),
        (torch.ops.cutlass_w8a8.scaled_mm_out, (out, a, w.t(), sa, sb, b)),
        (torch.ops.cutlass_w8a8.quantize_per_token, (x, torch.int8)),
        (torch.ops.cutlass_w8a8.quantize_per_token, (x, torch.float8_e4m3fn)),
        (torch.ops.cutlass_w8a8.quantize_per_tensor, (x, torch.tensor([0.02]), torch.int8)),
    ]:
        opcheck(op, args)


def test_cuda_tensors_without_extension_say_so(monkeypatch):
    # On a machine with CUDA tensors but no built extension every op must say what is missing.
    from cutlass_w8a8 import _ext
    from cutlass_w8a8.ops import _schema
    monkeypatch.setattr(_ext, "cuda_ops_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA extension is not built"):
        _ext.require_cuda_ops("scaled_mm")
    assert len(_schema.OPS) == len(set(_schema.OPS)) >= 20
    for op in _schema.OPS:  # the CUDA kernel register_cuda_fallback gives each op
        with pytest.raises(RuntimeError, match=f"^cutlass_w8a8\\.{op}: the CUDA extension is not built or not loaded"):
            _schema.extension_missing(op)(torch.zeros(1))


@pytest.mark.skipif(cw.cuda_ops_available(), reason="_C.so is loaded: the CUDA kernels are its own")
def test_cuda_fallback_is_registered_without_the_extension():
    """Without _C.so, import registered the fallback as every op's CUDA kernel (once): a CUDA call, here
    redispatched to the CUDA key on CPU tensors, gets the "not built" RuntimeError instead of torch's
    NotImplementedError."""
    from cutlass_w8a8.ops import _schema
    assert _schema.register_cuda_fallback() is False  # already done by `import cutlass_w8a8`
    for op in _schema.OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"cutlass_w8a8::{op}", "CUDA"), op
    a, w, sa, sb, b = _ok()
    cuda = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    with pytest.raises(RuntimeError, match="^cutlass_w8a8.scaled_mm: the CUDA extension is not built"):
        torch.ops.cutlass_w8a8.scaled_mm.default.redispatch(cuda, a, w.t(), sa, sb, torch.bfloat16, b)
    with pytest.raises(RuntimeError, match="^cutlass_w8a8.rms_norm: the CUDA extension is not built"):
        torch.ops.cutlass_w8a8.rms_norm.default.redispatch(cuda, torch.zeros(2, 16), torch.ones(16), 1e-5)
