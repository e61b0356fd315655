"""The fused non-GEMM kernels (csrc/quant/rms_norm.cu, silu_mul.cu) beyond the exact comparisons of
test_fused_quant_cuda.py: the residual updated in place in a padded view, empty inputs, rows independent of the
batch, non-row-major inputs, non-finite rows, capture into a CUDA graph and replay, W8A8Linear on the fused
ops' output, and opcheck.
"""

import pytest
import torch

import cutlass_w8a8 as cw

from _fused_quant_cuda import (
    DEV, EPS, OPS, QDTYPES, assert_bits_equal, exact_norm_rows, exact_silu_input, gaussian, seed_of)

pytestmark = pytest.mark.cuda


# ----------------------------------------------------------------------------------------------------
# layouts, empty inputs, batch independence, non-finite values


def test_residual_in_place_in_a_padded_view():
    """A residual whose rows are 16 elements apart from its neighbour's end (a slice of a wider buffer): the
    vectorized kernel with a row stride; the padding stays as it was."""
    gen = torch.Generator().manual_seed(1)
    s = exact_norm_rows((12, 4096), gen, 1.0 / 16)
    r64 = torch.randint(-32, 33, (12, 4096), generator=gen).double()
    x, w = (s - r64).to(torch.bfloat16), (torch.rand(4096, generator=gen) + 0.5).to(torch.bfloat16)
    buf = torch.randn(12, 4096 + 16, generator=gen).to(torch.bfloat16)
    buf[:, 8:4104] = r64.to(torch.bfloat16)
    ref_r = buf[:, 8:4104].clone()
    q_ref, s_ref = cw.rms_norm_quant(x, w, 1.0 / 16, torch.int8, None, ref_r)
    bufd = buf.to(DEV)
    residual = bufd[:, 8:4104]
    ptr = residual.data_ptr()
    q, sc = cw.rms_norm_quant(x.to(DEV), w.to(DEV), 1.0 / 16, torch.int8, None, residual)
    assert residual.data_ptr() == ptr
    assert_bits_equal(residual, ref_r, "residual")
    assert_bits_equal(bufd[:, :8], buf[:, :8], "left padding")
    assert_bits_equal(bufd[:, 4104:], buf[:, 4104:], "right padding")
    assert_bits_equal(q, q_ref, "q")
    assert_bits_equal(sc, s_ref, "scales")


def test_zero_rows():
    w = torch.ones(64, dtype=torch.bfloat16, device=DEV)
    x = torch.empty(0, 64, dtype=torch.bfloat16, device=DEV)
    assert cw.rms_norm(x, w, EPS).shape == (0, 64)
    assert cw.rms_norm(x, w, EPS, torch.empty_like(x)).shape == (0, 64)
    for qdtype in QDTYPES:
        q, s = cw.rms_norm_quant(x, w, EPS, qdtype, None, torch.empty_like(x))
        assert q.shape == (0, 64) and q.dtype == qdtype and s.shape == (0, 1)
        q, s = cw.silu_mul_quant(torch.empty(2, 0, 64, device=DEV), qdtype, torch.ones(1, device=DEV))
        assert q.shape == (2, 0, 32)
        _, s_op = OPS.silu_mul_quant(torch.empty(0, 64, device=DEV), qdtype, torch.ones(1, device=DEV))
        assert s_op.shape == (0, 1)
    assert cw.silu_mul(x).shape == (0, 32)
    torch.cuda.synchronize()


@pytest.mark.parametrize("qdtype", QDTYPES, ids=str)
def test_rows_do_not_depend_on_the_batch(qdtype):
    """Row i's result is the same computed alone or among M rows (grid x = rows, nothing depends on M)."""
    x, w, r = gaussian((37, 4096), torch.bfloat16, 5)
    q, s = cw.rms_norm_quant(x, w, EPS, qdtype)
    g, gs = cw.silu_mul_quant(x, qdtype)
    y = cw.rms_norm(x, w, EPS)
    for i in (0, 17, 36):
        q1, s1 = cw.rms_norm_quant(x[i:i + 1], w, EPS, qdtype)
        assert_bits_equal(q1, q[i:i + 1].cpu())
        assert_bits_equal(s1, s[i:i + 1].cpu())
        g1, gs1 = cw.silu_mul_quant(x[i:i + 1], qdtype)
        assert_bits_equal(g1, g[i:i + 1].cpu())
        assert_bits_equal(gs1, gs[i:i + 1].cpu())
        assert_bits_equal(cw.rms_norm(x[i:i + 1], w, EPS), y[i:i + 1].cpu())


def test_non_row_major_inputs():
    x, w, _ = gaussian((4096, 6), torch.bfloat16, 6)
    xt = x.t()  # (6, 4096), column-major: copied to rows first
    w = w[:1].expand(4096).contiguous()
    assert_bits_equal(cw.rms_norm(xt, w, EPS), cw.rms_norm(xt.contiguous(), w, EPS).cpu())
    q, s = cw.silu_mul_quant(xt, torch.int8)
    q2, s2 = cw.silu_mul_quant(xt.contiguous(), torch.int8)
    assert_bits_equal(q, q2.cpu())
    assert_bits_equal(s, s2.cpu())


@pytest.mark.parametrize("qdtype", QDTYPES, ids=str)
def test_non_finite_rows(qdtype):
    """As on the CPU: a NaN makes its row NaN, an inf makes the row 0 with NaN at the inf, an overflowing sum
    of squares makes it 0; quantized rows with non-finite y are unspecified, the others exact."""
    gen = torch.Generator().manual_seed(7)
    s = exact_norm_rows((6, 256), gen, 1.0 / 16)
    x = s.to(torch.bfloat16)
    w = (torch.rand(256, generator=gen) + 0.5).to(torch.bfloat16)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    x[3] = 1e30
    y = cw.rms_norm(x.to(DEV), w.to(DEV), 1.0 / 16)
    torch.testing.assert_close(y.cpu(), cw.rms_norm(x, w, 1.0 / 16), rtol=0, atol=0, equal_nan=True)
    q, sc = cw.rms_norm_quant(x.to(DEV), w.to(DEV), 1.0 / 16, qdtype)
    q_ref, s_ref = cw.rms_norm_quant(x, w, 1.0 / 16, qdtype)
    for i in (0, 4, 5):
        assert_bits_equal(q[i], q_ref[i], f"row {i}")
        assert_bits_equal(sc[i], s_ref[i], f"row {i}")

    xs = exact_silu_input((4, 64), torch.bfloat16, gen)
    xs[1, 0], xs[2, 1], xs[3, 2] = float("inf"), float("-inf"), float("nan")
    xs[1, 32], xs[2, 33] = 2.0, 2.0
    torch.testing.assert_close(cw.silu_mul(xs.to(DEV)).cpu(), cw.silu_mul(xs), rtol=0, atol=0, equal_nan=True)
    g, gs = cw.silu_mul_quant(xs.to(DEV), qdtype)
    g_ref, gs_ref = cw.silu_mul_quant(xs, qdtype)
    assert_bits_equal(g[0], g_ref[0])
    assert_bits_equal(gs[0], gs_ref[0])


# ----------------------------------------------------------------------------------------------------
# CUDA graphs


@pytest.mark.parametrize("qdtype", QDTYPES, ids=str)
def test_cuda_graph_capture_and_replay(qdtype):
    """Every op captured into one torch.cuda.CUDAGraph (the residual update included), replayed with new
    inputs copied in: each replay equals the eager ops on those inputs, bit for bit; no host sync during the
    capture or the replays."""
    m, k, inter = 8, 4096, 2048
    gen = torch.Generator(device=DEV).manual_seed(8)

    def rnd(*shape, scale=2.0):
        return (torch.randn(*shape, device=DEV, generator=gen) * scale).to(torch.bfloat16)

    w = (torch.rand(k, device=DEV, generator=gen) + 0.5).to(torch.bfloat16)
    scale = torch.tensor([0.05], device=DEV)
    x, r, g = rnd(m, k), rnd(m, k), rnd(m, 2 * inter)

    def step(x, r, g):
        y = cw.rms_norm(x, w, EPS)
        q1, s1 = cw.rms_norm_quant(x, w, EPS, qdtype, None, r)  # r += x
        q2, _ = cw.rms_norm_quant(x, w, EPS, qdtype, scale)
        q3, s3 = cw.silu_mul_quant(g, qdtype)
        q4, _ = cw.silu_mul_quant(g, qdtype, scale)
        h = cw.silu_mul(g)
        y2 = cw.rms_norm(h, w[:inter], EPS)
        return y, q1, s1, q2, q3, s3, q4, h, y2, r

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(x, r.clone(), g)
    torch.cuda.current_stream().wait_stream(side)
    new = [(rnd(m, k, scale=i + 1.0), rnd(m, k), rnd(m, 2 * inter, scale=3.0)) for i in range(4)]
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    replays = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            outs = step(x, r, g)
        for nx, nr, ng in new:
            x.copy_(nx)
            r.copy_(nr)
            g.copy_(ng)
            graph.replay()
            replays.append([o.clone() for o in outs])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for i, ((nx, nr, ng), got) in enumerate(zip(new, replays)):
        expect = step(nx.clone(), nr.clone(), ng.clone())
        for j, (a, b) in enumerate(zip(got, expect)):
            assert_bits_equal(a, b.cpu(), f"replay {i}, output {j}")


# ----------------------------------------------------------------------------------------------------
# W8A8Linear on the fused ops' output


@pytest.mark.parametrize("qdtype", QDTYPES, ids=str)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("m", [4, 64])
def test_linear_on_fused_quantization_equals_linear_on_the_float_norm(qdtype, static, m):
    """``layer(QuantizedActivation(*rms_norm_quant(...)))`` == ``layer(rms_norm(...))`` bit for bit (M = 4:
    the GEMM launched with PDL right after the fused kernel; M = 64: without)."""
    if qdtype == torch.float8_e4m3fn and not cw.supports_fp8():
        pytest.skip("no fp8 kernels for this device")
    torch.manual_seed(0)
    lin = torch.nn.Linear(4096, 1024, bias=True).to(DEV, torch.bfloat16)
    layer = cw.W8A8Linear.from_float(lin, cw.W8A8Config(dtype=qdtype),
                                     input_scale=torch.tensor([0.03], device=DEV) if static else None)
    x, w, r = gaussian((m, 4096), torch.bfloat16, seed_of("linear", qdtype, static, m), scale=1.0)
    r2 = r.clone()
    y = layer(cw.QuantizedActivation(*cw.rms_norm_quant(x, w, EPS, layer.quant_dtype, layer.input_scale, r)))
    assert_bits_equal(y, layer(cw.rms_norm(x, w, EPS, r2)).cpu(), "norm + linear")
    g = gaussian((m, 2 * 4096), torch.bfloat16, 3, scale=1.0)[0]
    y = layer(cw.QuantizedActivation(*cw.silu_mul_quant(g, layer.quant_dtype, layer.input_scale)))
    assert_bits_equal(y, layer(cw.silu_mul(g)).cpu(), "silu_mul + linear")


# ----------------------------------------------------------------------------------------------------
# opcheck


def opcheck_cases():
    x, w, r = gaussian((3, 5, 64), torch.bfloat16, 11)
    x16, w16, r16 = gaussian((7, 4096), torch.float16, 12)
    x32, w32, r32 = gaussian((4, 48), torch.float32, 13)
    s = torch.tensor([0.05], device=DEV)
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


def test_opcheck_cuda():
    for name, op, args in opcheck_cases():
        try:
            torch.library.opcheck(op, args)
        except Exception as exc:
            raise AssertionError(f"opcheck failed for {name}: {exc}") from exc
