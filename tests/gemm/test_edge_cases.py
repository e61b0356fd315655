"""Edge sizes: M = 0, 1, 17, 8191; K = 16; N = 16; and the int8 depth bound INT8_MAX_K.

The bound: an int8 product is at most (-128) * (-128) = 2**14 in magnitude, so the int32 accumulator of K
products cannot overflow while K * 2**14 <= 2**31 - 1, i.e. K <= 131071; K must also be a multiple of 16,
so the largest legal K is INT8_MAX_K = 131056. Larger K is rejected (ValueError naming `a`); fp8 accumulates
in float32 and has no such bound. At K = INT8_MAX_K the worst-case operands (every element -128, so every
product is +2**14 and nothing cancels) must give exactly K * 2**14 = 2147221504, which the tests check
bit for bit with power-of-two scales (exact in the float32 epilogue).
"""

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import assert_close_to_reference, fp8_accum_bound, rand_operand, rand_scale, reference, scale_magnitudes

INT32_MAX = 2 ** 31 - 1
MAX_PRODUCT = 128 * 128
EDGE_M = [0, 1, 17, 8191]
# (N, K): the smallest of each, together and each with a larger other (larger on the GPU)
EDGE_NK_CPU = [(16, 16), (16, 256), (256, 16)]
EDGE_NK_CUDA = [(16, 16), (16, 4096), (4096, 16)]


def operands(m, n, k, dtype, device, seed, out_dtype=torch.bfloat16):
    g = torch.Generator(device=device).manual_seed(seed)
    a = rand_operand((m, k), dtype, device, g)
    w = rand_operand((n, k), dtype, device, g)
    ma, mb = scale_magnitudes(dtype, k)
    sa = rand_scale((m, 1), device, ma, g)
    sb = rand_scale((n,), device, mb, g)
    bias = (torch.randn(n, device=device, generator=g) * 4).to(out_dtype)
    return a, w, sa, sb, bias


def check_edge(m, n, k, dtype, device, use_out):
    out_dtype = torch.float16 if (m + n + k) % 2 else torch.bfloat16
    a, w, sa, sb, bias = operands(m, n, k, dtype, device, seed=m + 7 * n + 13 * k, out_dtype=out_dtype)
    if use_out:
        out = torch.full((m, n), float("nan"), dtype=out_dtype, device=device)
        assert cw.scaled_mm(a, w.t(), sa, sb, bias=bias, out=out) is out
    else:
        out = cw.scaled_mm(a, w.t(), sa, sb, out_dtype, bias)
    assert out.shape == (m, n) and out.dtype == out_dtype and out.device == a.device
    ref = reference(a, w.t(), sa, sb, bias)  # float64, on the operands' device
    rel = fp8_accum_bound(k) if dtype == torch.float8_e4m3fn else 0.0
    assert_close_to_reference(out, ref, out_dtype, accum_rel=rel, what=f"M={m} N={n} K={k} {dtype}")


def worst_case(m, k, out_dtype, device):
    """a = -128 everywhere; b's columns alternate -128 (sum +K 2**14, the largest) and 127 (sum -K 16256,
    the most negative); power-of-two scales bring |D| near 1 without rounding. Returns the operands and the
    exact expected output (computed in float64, rounded once to out_dtype)."""
    n = 16
    a = torch.full((m, k), -128, dtype=torch.int8, device=device)
    col = torch.tensor([-128, 127] * (n // 2), dtype=torch.int8, device=device)
    w = col[:, None].expand(n, k).contiguous()  # [N, K] row-major weight
    sa = torch.tensor([2.0 ** -17], device=device)
    sb = torch.full((n,), 2.0 ** -14, device=device)
    exact = k * -128.0 * col.double().cpu()  # every row of A @ B, exactly
    assert exact.abs().max() <= INT32_MAX  # the premise: representable in int32
    expected = (exact * 2.0 ** -17 * 2.0 ** -14).to(out_dtype).expand(m, n)
    return a, w, sa, sb, expected


# ---- CPU: the reference op and the argument checks --------------------------------------------------


def test_int8_max_k_is_the_largest_safe_multiple_of_16():
    k = cw.INT8_MAX_K
    assert k % 16 == 0
    assert k * MAX_PRODUCT <= INT32_MAX < (k + 16) * MAX_PRODUCT


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("nk", EDGE_NK_CPU)
@pytest.mark.parametrize("m", EDGE_M)
def test_edge_sizes_cpu(m, nk, dtype):
    check_edge(m, *nk, dtype, "cpu", use_out=m % 2 == 1)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_worst_case_at_max_k_is_exact_cpu(out_dtype):
    a, w, sa, sb, expected = worst_case(1, cw.INT8_MAX_K, out_dtype, "cpu")
    out = cw.scaled_mm(a, w.t(), sa, sb, out_dtype)
    assert torch.equal(out, expected), (out, expected)


@pytest.mark.parametrize("k", [cw.INT8_MAX_K + 16, 131072])
def test_int8_k_above_bound_rejected_cpu(k):
    a = torch.zeros(1, k, dtype=torch.int8)
    w = torch.zeros(16, k, dtype=torch.int8)
    sa, sb = torch.ones(1), torch.ones(16)
    msg = f"scaled_mm: `a` K = {k} can overflow the int32 accumulator; int8 needs K <= {cw.INT8_MAX_K}"
    with pytest.raises(ValueError, match=msg.replace("[", r"\[")):
        cw.scaled_mm(a, w.t(), sa, sb)
    with pytest.raises(ValueError, match="`a` K = "):
        torch.ops.cutlass_w8a8.scaled_mm(a, w.t(), sa, sb, torch.bfloat16, None)


def test_fp8_has_no_k_bound_cpu():
    """float32 accumulation cannot overflow for any K the shapes allow: K = 131072 is accepted."""
    k = 131072
    a, w, sa, sb, bias = operands(1, 16, k, torch.float8_e4m3fn, "cpu", seed=3)
    out = cw.scaled_mm(a, w.t(), sa, sb, torch.bfloat16, bias)
    ref = reference(a, w.t(), sa, sb, bias)
    assert_close_to_reference(out, ref, torch.bfloat16, accum_rel=fp8_accum_bound(k), what="fp8 K=131072")


@pytest.mark.parametrize("per_token", [False, True])
def test_m_zero_forms_cpu(per_token):
    a, w, sa, sb, bias = operands(0, 32, 64, torch.int8, "cpu", seed=4)
    sa = sa if per_token else torch.ones(1)
    assert cw.scaled_mm(a, w.t(), sa, sb, torch.float16, bias.half()).shape == (0, 32)
    out = torch.empty(0, 32, dtype=torch.bfloat16)
    assert cw.scaled_mm(a, w.t(), sa, sb, bias=bias, out=out) is out


@pytest.mark.parametrize("quant", [cw.quantize_int8, cw.quantize_fp8])
@pytest.mark.parametrize("shape", [(0, 64), (3, 0), (2, 0, 16), (1, 1), (5, 17)])
def test_quantize_edge_shapes_cpu(quant, shape):
    x = torch.randn(shape, dtype=torch.bfloat16)
    q, s = quant(x)
    assert q.shape == x.shape and s.shape == (*shape[:-1], 1)
    if shape[-1] == 0:
        assert (s == 0).all()
    q2, s2 = quant(x, torch.tensor([0.1]))
    assert q2.shape == x.shape


# ---- GPU ------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("nk", EDGE_NK_CUDA)
@pytest.mark.parametrize("m", EDGE_M)
def test_edge_sizes_cuda(m, nk, dtype):
    for use_out in (False, True):
        check_edge(m, *nk, dtype, "cuda", use_out)


@pytest.mark.cuda
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 24, 100, 2048])  # dispatch buckets 0, 1, 3, 5: different kernels' K loops
def test_worst_case_at_max_k_is_exact_cuda(m, out_dtype):
    """At the largest legal K the int32 accumulator holds K * 2**14 without wrapping, in every kernel."""
    a, w, sa, sb, expected = worst_case(m, cw.INT8_MAX_K, out_dtype, "cuda")
    out = cw.scaled_mm(a, w.t(), sa, sb, out_dtype)
    assert torch.equal(out.cpu(), expected), f"M={m}: {out[0].tolist()} != {expected[0].tolist()}"
    # the C++ entry accepts the same bound as the Python checks
    out2 = torch.ops.cutlass_w8a8.scaled_mm(a, w.t(), sa, sb, out_dtype, None)
    assert torch.equal(out2.cpu(), expected)


@pytest.mark.cuda
@pytest.mark.parametrize("k", [cw.INT8_MAX_K + 16, 131072])
def test_int8_k_above_bound_rejected_cuda(k):
    a = torch.zeros(1, k, dtype=torch.int8, device="cuda")
    w = torch.zeros(16, k, dtype=torch.int8, device="cuda")
    sa, sb = torch.ones(1, device="cuda"), torch.ones(16, device="cuda")
    with pytest.raises(ValueError, match=f"scaled_mm: `a` K = {k} can overflow"):
        cw.scaled_mm(a, w.t(), sa, sb)
    # straight to the C++ entry: its own bound (kMaxInt8K) must agree
    with pytest.raises(ValueError, match=f"scaled_mm: `a` K = {k} can overflow.*K <= {cw.INT8_MAX_K}"):
        torch.ops.cutlass_w8a8.scaled_mm(a, w.t(), sa, sb, torch.bfloat16, None)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 100])
def test_fp8_deep_k_cuda(m):
    """fp8 at K = 131072 (beyond the int8 bound): accepted, and the float32 accumulation stays in tolerance,
    both for random operands and for the constant worst case (no cancellation)."""
    k = 131072
    a, w, sa, sb, bias = operands(m, 16, k, torch.float8_e4m3fn, "cuda", seed=5)
    for what, (aa, ww) in {"random": (a, w),
                           "constant -448": (torch.full_like(a, -448.0), torch.full_like(w, -448.0))}.items():
        s_a = sa if what == "random" else torch.full_like(sa, 2.0 ** -20)
        s_b = sb if what == "random" else torch.full_like(sb, 2.0 ** -20)
        out = cw.scaled_mm(aa, ww.t(), s_a, s_b, torch.bfloat16, bias)
        ref = reference(aa.cpu(), ww.t().cpu(), s_a.cpu(), s_b.cpu(), bias.cpu())
        assert_close_to_reference(out.cpu(), ref, torch.bfloat16, accum_rel=fp8_accum_bound(k),
                                  what=f"fp8 K={k} M={m} {what}")


@pytest.mark.cuda
@pytest.mark.parametrize("quant", [cw.quantize_int8, cw.quantize_fp8])
@pytest.mark.parametrize("shape", [(0, 64), (3, 0), (2, 0, 16), (1, 1), (5, 17), (8191, 16)])
@pytest.mark.parametrize("static", [False, True])
def test_quantize_edge_shapes_cuda(quant, shape, static):
    """The GPU quantization gives the CPU reference's shapes and values, bit for bit, on empty and tiny
    inputs too (a row of K = 0 has scale 0 on the CPU)."""
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    x = (torch.randn(shape, device="cuda", generator=g) * 3).to(torch.bfloat16)
    scale = torch.tensor([0.05], device="cuda") if static else None
    q, s = quant(x, scale) if static else quant(x)
    q_ref, s_ref = quant(x.cpu(), scale.cpu()) if static else quant(x.cpu())
    assert q.shape == q_ref.shape and q.dtype == q_ref.dtype and q.device == x.device
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s.cpu(), s_ref)
