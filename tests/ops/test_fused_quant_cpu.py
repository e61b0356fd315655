"""The fused non-GEMM ops on CPU tensors: rms_norm / fused_add_rms_norm / rms_norm_quant / silu_mul /
silu_mul_quant against the unfused torch chains they replace, the in-place residual, empty and odd inputs,
non-finite values, fake kernels and opcheck, and `W8A8Linear` on a `QuantizedActivation`. Runs in CI (no GPU);
the decoder's use of the fused path is tested in test_decoder_fused_path_cpu.py, the CUDA kernels in
test_fused_quant_cuda.py.

The CPU implementations *are* the unfused chains (``residual += x``, ``F.rms_norm``, ``F.silu(gate) * up``,
then ``quantize_int8`` / ``quantize_fp8``), so every comparison here is exact.
"""

import pytest
import torch
import torch.nn.functional as F

import cutlass_w8a8 as cw

from _full import opcheck
from _fused_quant_cpu import EPS, OPS, QDTYPES, QUANT, XDTYPES, assert_bits_equal, bits, chain_rms_norm, inputs

SHAPES = [(1, 16), (7, 64), (3, 5, 128), (4, 100), (2, 17), (16,)]


# ----------------------------------------------------------------------------------------------------
# against the unfused chains, exactly


@pytest.mark.parametrize("dtype", XDTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_equals_chain(dtype, shape, with_residual):
    x, w, r = inputs(shape, dtype)
    r0 = r.clone() if with_residual else None
    y_ref, r_ref = chain_rms_norm(x, w, EPS, r0)
    x0 = x.clone()
    y = cw.rms_norm(x, w, EPS, r if with_residual else None)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    assert_bits_equal(y, y_ref, "y")
    assert_bits_equal(x, x0, "x is not modified")
    if with_residual:
        assert_bits_equal(r, r_ref, "residual updated in place to x + residual")


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", XDTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quant_equals_chain(qdtype, dtype, shape, static, with_residual):
    x, w, r = inputs(shape, dtype, seed=1)
    scale = torch.tensor([0.013]) if static else None
    y_ref, r_ref = chain_rms_norm(x, w, EPS, r.clone() if with_residual else None)
    q_ref, s_ref = QUANT[qdtype](y_ref, scale)
    q, s = cw.rms_norm_quant(x, w, EPS, qdtype, scale, r if with_residual else None)
    assert q.dtype == qdtype and q.shape == x.shape and q.is_contiguous()
    assert_bits_equal(q, q_ref, "q")
    if static:
        assert s is scale  # as quantize_int8: the static scale object itself
        # the op returns the static scale repeated per row, so its output has one shape in both modes
        _, s_op = OPS.rms_norm_quant(x, w, EPS, qdtype, scale, None)
        assert s_op.shape == (*x.shape[:-1], 1) and bool((s_op == scale).all())
    else:
        assert s.shape == (*x.shape[:-1], 1) and s.dtype == torch.float32
        assert_bits_equal(s, s_ref, "scale")
    if with_residual:
        assert_bits_equal(r, r_ref, "residual")


@pytest.mark.parametrize("dtype", XDTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (5, 64), (2, 3, 200), (3, 2), (4, 34), (10,)])
def test_silu_mul_equals_chain(dtype, shape):
    x, _, _ = inputs(shape, dtype, seed=2)
    gate, up = x.chunk(2, dim=-1)
    y = cw.silu_mul(x)
    assert y.shape == (*shape[:-1], shape[-1] // 2) and y.dtype == dtype and y.is_contiguous()
    assert_bits_equal(y, F.silu(gate) * up, "silu_mul")


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", XDTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (5, 64), (2, 3, 200), (4, 34)])
@pytest.mark.parametrize("static", [False, True])
def test_silu_mul_quant_equals_chain(qdtype, dtype, shape, static):
    x, _, _ = inputs(shape, dtype, seed=3)
    gate, up = x.chunk(2, dim=-1)
    scale = torch.tensor([0.02]) if static else None
    q_ref, s_ref = QUANT[qdtype](F.silu(gate) * up, scale)
    q, s = cw.silu_mul_quant(x, qdtype, scale)
    assert_bits_equal(q, q_ref, "q")
    if static:
        assert s is scale
    else:
        assert_bits_equal(s, s_ref, "scale")


def test_silu_is_rounded_to_the_dtype_before_the_product():
    """torch's bf16 eager chain rounds silu(gate) to bf16 and then the product: not the float32 product."""
    x, _, _ = inputs((64, 512), torch.bfloat16, seed=4)
    gate, up = x.chunk(2, dim=-1)
    y = cw.silu_mul(x)
    once = (F.silu(gate.float()) * up.float()).to(torch.bfloat16)  # one rounding: not what torch does
    assert (bits(y) != bits(once)).any()
    assert_bits_equal(y, (F.silu(gate.float()).to(torch.bfloat16).float() * up.float()).to(torch.bfloat16))


def test_quantized_y_is_rounded_to_the_dtype_first():
    """The fused op quantizes y rounded to x's dtype, as the unfused chain stores it; quantizing the float32 y
    instead gives other codes (so the tests above can tell the two apart)."""
    x, w, _ = inputs((64, 4096), torch.bfloat16, seed=5)
    q, s = cw.rms_norm_quant(x, w, EPS, torch.int8)
    y32 = F.rms_norm(x.float(), (4096,), w.float(), EPS)
    q32, _ = cw.quantize_int8(y32)
    assert (q != q32).any()
    q_chain, s_chain = cw.quantize_int8(F.rms_norm(x, (4096,), w, EPS))
    assert torch.equal(q, q_chain) and torch.equal(s, s_chain)


def test_eps_is_added_in_float32():
    """eps enters as float32 (not rounded to x's dtype): visible on small inputs in float16."""
    x, w, _ = inputs((8, 256), torch.float16, seed=6, scale=3e-3)
    y = cw.rms_norm(x, w, 1e-5)
    xf = x.float()
    expect = (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + 1e-5) * w.float()).to(torch.float16)
    assert_bits_equal(y, expect)


# ----------------------------------------------------------------------------------------------------
# the residual


def test_residual_is_updated_in_place_in_a_padded_view():
    x, w, _ = inputs((6, 64), torch.bfloat16, seed=7)
    buf = torch.randn(6, 80).to(torch.bfloat16)
    before = buf.clone()
    residual = buf[:, 8:72]  # rows 80 apart: updatable in place
    ptr = residual.data_ptr()
    y_ref, r_ref = chain_rms_norm(x, w, EPS, residual.clone())
    q_ref, s_ref = cw.quantize_fp8(y_ref)
    q, s = cw.rms_norm_quant(x, w, EPS, torch.float8_e4m3fn, None, residual)
    assert residual.data_ptr() == ptr
    assert_bits_equal(residual, r_ref, "residual")
    assert_bits_equal(buf[:, :8], before[:, :8], "left padding untouched")
    assert_bits_equal(buf[:, 72:], before[:, 72:], "right padding untouched")
    assert_bits_equal(q, q_ref, "q")


def test_residual_same_tensor_as_x():
    """``residual is x``: x += x, then the norm of it (documented as allowed)."""
    x, w, _ = inputs((4, 64), torch.bfloat16, seed=8)
    expect_r = x + x
    y = cw.rms_norm(x, w, EPS, x)
    assert_bits_equal(x, expect_r)
    assert_bits_equal(y, F.rms_norm(expect_r, (64,), w, EPS))


def test_residual_chain_over_layers_equals_unfused_sums():
    """Three fused adds in a row carry the stream exactly as ``h = h + sublayer(...)`` does."""
    g = torch.Generator().manual_seed(9)
    outs = [(torch.randn(5, 64, generator=g) * 2).to(torch.bfloat16) for _ in range(4)]
    w = (torch.rand(64, generator=g) + 0.5).to(torch.bfloat16)
    residual = outs[0].clone()
    h = outs[0].clone()
    for o in outs[1:]:
        y = cw.rms_norm(o, w, EPS, residual)
        h = h + o
        assert_bits_equal(residual, h)
        assert_bits_equal(y, F.rms_norm(h, (64,), w, EPS))


# ----------------------------------------------------------------------------------------------------
# empty and odd inputs


def test_zero_rows():
    w = torch.ones(64, dtype=torch.bfloat16)
    x = torch.empty(0, 64, dtype=torch.bfloat16)
    assert cw.rms_norm(x, w, EPS).shape == (0, 64)
    assert cw.rms_norm(x, w, EPS, torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 64)
    q, s = cw.rms_norm_quant(x, w, EPS, torch.int8)
    assert q.shape == (0, 64) and s.shape == (0, 1)
    q, s = cw.rms_norm_quant(torch.empty(2, 0, 64, dtype=torch.bfloat16), w, EPS, torch.float8_e4m3fn,
                             torch.ones(1))
    assert q.shape == (2, 0, 64)
    assert cw.silu_mul(x).shape == (0, 32)
    q, s = cw.silu_mul_quant(x, torch.int8)
    assert q.shape == (0, 32) and s.shape == (0, 1)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: cw.silu_mul(torch.zeros(4, 7)), ValueError, r"silu_mul: `x` must have an even last dimension"),
    (lambda: cw.silu_mul_quant(torch.zeros(4, 0), torch.int8), ValueError,
     r"silu_mul_quant: `x` must have a non-empty"),
    (lambda: cw.rms_norm(torch.zeros(4, 0), torch.zeros(0), EPS), ValueError, r"rms_norm: `x` must have a non-empty"),
    (lambda: cw.rms_norm(torch.zeros(4, 8), torch.zeros(9), EPS), ValueError, r"rms_norm: `weight` must be \[K\]"),
    (lambda: cw.rms_norm(torch.zeros(4, 8), torch.zeros(8, dtype=torch.float16), EPS), TypeError,
     r"rms_norm: `weight` must have x's dtype"),
    (lambda: cw.rms_norm(torch.zeros(4, 8), torch.zeros(8), -1.0), ValueError, r"rms_norm: `eps` must be a finite"),
    (lambda: cw.rms_norm(torch.zeros(4, 8), torch.zeros(8), float("nan")), ValueError, r"rms_norm: `eps`"),
    (lambda: cw.rms_norm(torch.zeros(4, 8), torch.zeros(8), EPS, torch.zeros(8, 4).t()), ValueError,
     r"rms_norm: `residual` must be updatable in place"),
    (lambda: cw.rms_norm(torch.zeros(4, 8), torch.zeros(8), EPS, torch.zeros(4, 9)), ValueError,
     r"rms_norm: `residual` must have x's shape"),
    (lambda: cw.rms_norm_quant(torch.zeros(4, 8), torch.zeros(8), EPS, torch.float16), TypeError,
     r"rms_norm_quant: `dtype`"),
    (lambda: cw.silu_mul_quant(torch.zeros(4, 8), torch.int8, torch.ones(1, dtype=torch.float16)), TypeError,
     r"silu_mul_quant: `scale` must be float32"),
    (lambda: cw.silu_mul(torch.zeros(4, 8, dtype=torch.float64)), TypeError, r"silu_mul: `x` must be bfloat16"),
])
def test_bad_input_raises_naming_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_direct_op_calls_check_too():
    """The CPU implementations check like the wrappers (direct torch.ops calls), before touching residual."""
    x, w, r = inputs((4, 64), torch.bfloat16)
    r0 = r.clone()
    with pytest.raises(TypeError, match="rms_norm_quant: `dtype`"):
        OPS.rms_norm_quant(x, w, EPS, torch.float16, None, r)
    assert torch.equal(r, r0), "a rejected call must not have updated the residual"
    with pytest.raises(ValueError, match="fused_add_rms_norm: `residual` must have x's shape"):
        OPS.fused_add_rms_norm(x, r[:, :32], w, EPS)
    with pytest.raises(ValueError, match="silu_mul: `x` must have an even"):
        OPS.silu_mul(x[:, :63])
    with pytest.raises(ValueError, match="rms_norm: `weight`"):
        OPS.rms_norm(x, w[:32], EPS)


def test_non_row_major_x_is_read_as_its_values():
    x, _, _ = inputs((64, 6), torch.bfloat16, seed=10)
    _, w, _ = inputs((6, 64), torch.bfloat16, seed=10)
    xt = x.t()  # (6, 64), column-major
    assert_bits_equal(cw.rms_norm(xt, w, EPS), F.rms_norm(xt.contiguous(), (64,), w, EPS))
    assert_bits_equal(cw.silu_mul(xt), cw.silu_mul(xt.contiguous()))


# ----------------------------------------------------------------------------------------------------
# non-finite values (documented in the docstrings)


def test_rms_norm_inf_and_nan_rows():
    """As F.rms_norm: a NaN makes its row NaN; an inf makes the row's rsqrt 0, so the row is 0 except NaN at
    the inf; a sum of squares that overflows float32 also gives zeros. Other rows are unaffected."""
    x, w, _ = inputs((4, 64), torch.bfloat16, seed=11)
    clean = cw.rms_norm(x, w, EPS)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    x[3] = 1e30  # finite in bfloat16, squares overflow float32
    y = cw.rms_norm(x, w, EPS)
    assert_bits_equal(y[0], clean[0], "untouched row")
    assert torch.isnan(y[1]).all()
    assert torch.isnan(y[2, 7]) and (y[2, :7] == 0).all() and (y[2, 8:] == 0).all()
    assert (y[3] == 0).all()
    assert_bits_equal(y, F.rms_norm(x, (64,), w, EPS))


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_quantized_rows_with_non_finite_values_leave_other_rows_alone(qdtype):
    x, w, _ = inputs((4, 64), torch.bfloat16, seed=12)
    q0, s0 = cw.rms_norm_quant(x, w, EPS, qdtype)
    g0, gs0 = cw.silu_mul_quant(x, qdtype)
    x[1, 3] = float("nan")
    x[2, 40] = float("-inf")
    q, s = cw.rms_norm_quant(x, w, EPS, qdtype)
    g, gs = cw.silu_mul_quant(x, qdtype)
    for i in (0, 3):
        assert_bits_equal(q[i], q0[i])
        assert_bits_equal(s[i], s0[i])
        assert_bits_equal(g[i], g0[i])
        assert_bits_equal(gs[i], gs0[i])


def test_silu_mul_non_finite_elementwise():
    """torch's elementwise IEEE results: silu(+inf) = inf, silu(-inf) = -inf / inf = NaN, silu(NaN) = NaN."""
    gate = torch.tensor([[float("inf"), float("-inf"), float("nan"), -100.0, 2.0]], dtype=torch.bfloat16)
    up = torch.tensor([[2.0, 2.0, 2.0, 2.0, float("inf")]], dtype=torch.bfloat16)
    y = cw.silu_mul(torch.cat([gate, up], dim=-1))
    assert y[0, 0] == float("inf") and torch.isnan(y[0, 1]) and torch.isnan(y[0, 2])
    assert y[0, 3] == 0 and y[0, 4] == float("inf")


# ----------------------------------------------------------------------------------------------------
# fake kernels and opcheck


def opcheck_cases():
    x, w, r = inputs((3, 5, 64), torch.bfloat16, seed=13)
    x16, w16, r16 = inputs((7, 32), torch.float16, seed=14)
    x32, w32, r32 = inputs((4, 48), torch.float32, seed=15)
    s = torch.tensor([0.05])
    return [
        ("rms_norm bf16", OPS.rms_norm, (x, w, EPS)),
        ("rms_norm f32", OPS.rms_norm, (x32, w32, EPS)),
        ("fused_add_rms_norm bf16", OPS.fused_add_rms_norm, (x, r, w, EPS)),
        ("fused_add_rms_norm f16", OPS.fused_add_rms_norm, (x16, r16, w16, 1e-6)),
        ("rms_norm_quant int8 dynamic residual", OPS.rms_norm_quant, (x, w, EPS, torch.int8, None, r)),
        ("rms_norm_quant fp8 static", OPS.rms_norm_quant, (x16, w16, EPS, torch.float8_e4m3fn, s, None)),
        ("rms_norm_quant fp8 static residual", OPS.rms_norm_quant, (x32, w32, EPS, torch.float8_e4m3fn, s, r32)),
        ("rms_norm_quant M=0", OPS.rms_norm_quant, (x[:0], w, EPS, torch.int8, None, None)),
        ("silu_mul bf16", OPS.silu_mul, (x,)),
        ("silu_mul transposed", OPS.silu_mul, (x32.t(),)),
        ("silu_mul_quant int8 dynamic", OPS.silu_mul_quant, (x16, torch.int8, None)),
        ("silu_mul_quant fp8 static", OPS.silu_mul_quant, (x, torch.float8_e4m3fn, s)),
    ]


CASES = opcheck_cases()


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_opcheck_cpu(case):
    _, op, args = next(c for c in CASES if c[0] == case)
    opcheck(op, args)


def test_fake_kernels_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 3, 64, dtype=torch.bfloat16)
        w = torch.empty(64, dtype=torch.bfloat16)
        q, s = OPS.rms_norm_quant(x, w, EPS, torch.float8_e4m3fn, None, torch.empty_like(x))
        assert q.shape == (2, 3, 64) and q.dtype == torch.float8_e4m3fn and s.shape == (2, 3, 1)
        assert OPS.fused_add_rms_norm(x, torch.empty_like(x), w, EPS).shape == (2, 3, 64)
        q, s = OPS.silu_mul_quant(x, torch.int8, None)
        assert q.shape == (2, 3, 32) and s.shape == (2, 3, 1)
        with pytest.raises(ValueError, match="silu_mul: `x` must have an even"):
            OPS.silu_mul(torch.empty(2, 63))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.full)])
def test_compile_fullgraph_equals_eager(backend):
    """Under torch.compile the ops, the residual mutation included, give the eager results: traced through the
    fakes and functionalized (aot_eager), and lowered by inductor to C++ on the CPU (the full run: a cold inductor
    costs ~20 s of CPU per process). (A single-Tensor op with a `Tensor(a!)?` argument given None fails inductor's
    lowering in torch 2.13: why rms_norm and fused_add_rms_norm are two ops.)"""
    x, w, r = inputs((4, 64), torch.bfloat16, seed=16)

    def f(x, h):
        r = h * 2
        y0 = cw.rms_norm(x, w, EPS)
        y1 = cw.rms_norm(x, w, EPS, r)
        q, s = cw.rms_norm_quant(y1, w, EPS, torch.int8, None, r)
        g, gs = cw.silu_mul_quant(y0, torch.int8)
        return y0, y1, q, s, g, gs, r, cw.silu_mul(y1)

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    for got, expect in zip(compiled(x, r), f(x, r)):
        assert_bits_equal(got, expect)


# ----------------------------------------------------------------------------------------------------
# W8A8Linear on already-quantized activations


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("static", [False, True])
def test_linear_accepts_quantized_activation(qdtype, static):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48).to(torch.bfloat16)
    layer = cw.W8A8Linear.from_float(lin, cw.W8A8Config(dtype=qdtype),
                                     input_scale=torch.tensor([0.02]) if static else None)
    x, w, r = inputs((2, 3, 64), torch.bfloat16, seed=17)
    assert layer.quant_dtype == qdtype and (layer.input_scale is not None) == static

    qa = layer.quantize_input(x)
    assert isinstance(qa, cw.QuantizedActivation) and qa.shape == x.shape and qa.q.dtype == qdtype
    assert qa.scale.shape == ((1,) if static else (2, 3, 1))
    assert torch.equal(layer(qa), layer(x))

    # a fused op given the layer's dtype and scale: the same output as the layer on the float norm
    r2 = r.clone()
    fused = cw.QuantizedActivation(*cw.rms_norm_quant(x, w, EPS, layer.quant_dtype, layer.input_scale, r))
    y = layer(fused)
    assert y.shape == (2, 3, 48) and y.dtype == torch.bfloat16
    assert torch.equal(y, layer(cw.rms_norm(x, w, EPS, r2)))


def test_linear_quantized_activation_errors():
    layer = cw.W8A8Linear(64, 32)
    q = torch.zeros(4, 64, dtype=torch.int8)
    s = torch.ones(4, 1)
    for qa, exc, match in [
        (cw.QuantizedActivation(q.to(torch.float8_e4m3fn), s), TypeError, "`q` must have the layer's quant_dtype"),
        (cw.QuantizedActivation(q[:, :32], s), ValueError, "`q` must have the last dimension in_features = 64"),
        (cw.QuantizedActivation(q, s.half()), TypeError, "`scale` must be float32"),
        (cw.QuantizedActivation(q, torch.ones(4)), ValueError, r"`scale` must have one element \(per-tensor\)"),
        (cw.QuantizedActivation(q.tolist(), s), TypeError, "`q` must be a torch.Tensor"),
    ]:
        with pytest.raises(exc, match=match):
            layer(qa)
    assert layer(cw.QuantizedActivation(q, torch.ones(1))).shape == (4, 32)  # per-tensor


