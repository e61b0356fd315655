"""add_rms_norm_linear_decode on the GPU (csrc/gemm/decode/decode_kernels.cuh, NormX): the residual add, the input
RMSNorm, its per-token quantization and the decode GEMM in one kernel.

- Bit for bit equal to the chain it replaces, rms_norm_quant(x, w, eps, dtype, None, r) on a copy r of the residual
  (which becomes residual_out) followed by scaled_mm_decode(q, b, scale, scale_b, x.dtype, bias): every M in 1..16,
  K 2048 / 4096 / 8192 and small K, N a multiple of the 16-row tile with and without the split-K path (N / 16 below
  the SM count), int8 and fp8, bf16 and fp16, bias or not, per-channel and per-tensor weight scales, residual given
  or None, a zero row (scale 0).
- Against the float64 reference from the dequantized operands (q, its scale, the weight and its scale): int8
  accumulates exactly, fp8 adds fp8_accum_bound(K) (cutlass_w8a8/testing/references.py).
- residual is only read (residual_out is a new tensor), padded residual rows, graph capture and replay with new
  inputs, PDL on and off, the current stream, the C++ errors, opcheck.
"""

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.ops import add_rms_norm_linear_decode
from cutlass_w8a8.testing.references import assert_close_to_reference, fp8_accum_bound, rand_operand, rand_scale, reference
from _opcheck import run_opcheck

pytestmark = pytest.mark.cuda

OPS = torch.ops.cutlass_w8a8
DTYPES = [torch.int8, pytest.param(torch.float8_e4m3fn, id="fp8")]
XDTYPES = [torch.bfloat16, torch.float16]
EPS = 1e-6


@pytest.fixture(autouse=True)
def _skip_fp8_where_unsupported(request):
    params = request.node.callspec.params if hasattr(request.node, "callspec") else {}
    if params.get("dtype") == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 mma needs compute capability 8.9 or newer")


def rows(m, k, xdtype, g, scale=1.0):
    return (torch.randn(m, k, device="cuda", generator=g) * scale).to(xdtype)


def operands(m, n, k, dtype, xdtype, seed, residual=True, per_channel=True, bias=False, zero_row=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = rows(m, k, xdtype, g, 2.0)
    r = rows(m, k, xdtype, g, 4.0) if residual else None
    if zero_row is not None:  # s = 0 on that row: inv_rms = 1 / sqrt(eps), y = 0, scale 0, q = 0
        x[zero_row] = 0
        if r is not None:
            r[zero_row] = 0
    nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).to(xdtype)
    w = rand_operand((n, k), dtype, "cuda", g)
    sb = rand_scale((n,) if per_channel else (1,), "cuda", 1e-2, g)
    b = (torch.randn(n, device="cuda", generator=g) * 4).to(xdtype) if bias else None
    return x, r, nw, w, sb, b


def chain(x, r, nw, w, sb, b, dtype):
    """rms_norm_quant (residual updated in place on a copy) then scaled_mm_decode: (out, residual_out, q, scale)."""
    stream = r.clone() if r is not None else None
    q, s = OPS.rms_norm_quant(x, nw, EPS, dtype, None, stream)
    out = cw.scaled_mm_decode(q, w.t(), s, sb, x.dtype, b)
    return out, (x.clone() if stream is None else stream), q, s


def check_against_float64(out, q, s, w, sb, b, what):
    ref = reference(q, w.t(), s, sb, b)
    rel = fp8_accum_bound(q.shape[1]) if q.dtype == torch.float8_e4m3fn else 0.0
    assert_close_to_reference(out, ref, out.dtype, accum_rel=rel, what=what)


def sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


# ---- bit for bit the chain, and against the float64 reference -------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("xdtype", XDTYPES)
@pytest.mark.parametrize("k", [2048, 4096, 8192])
@pytest.mark.parametrize("n", [6144, 1040, 272], ids=["N6144", "N1040-split", "N272-split"])
def test_equals_rms_norm_quant_then_decode_gemm(dtype, xdtype, k, n):
    """Every M in 1..16; N 6144 (a CTA per 16 rows, >= the SMs: no split), 1040 and 272 (65 and 17 tiles: not a
    power of two, below the SM count: K split across CTAs, the in-kernel scales through the workspace)."""
    for m in range(1, 17):
        for residual in (True, False):
            bias = m % 2 == 1
            per_channel = m % 3 != 0
            x, r, nw, w, sb, b = operands(m, n, k, dtype, xdtype, seed=m * 31 + k + n, residual=residual,
                                          per_channel=per_channel, bias=bias, zero_row=m // 2 if m > 2 else None)
            r_before = r.clone() if r is not None else None
            what = f"M={m} N={n} K={k} {dtype} {xdtype} residual={residual} bias={bias} per_channel={per_channel}"
            out, r_out = add_rms_norm_linear_decode(x, r, nw, EPS, w.t(), sb, b, dtype)
            e_out, e_r, q, s = chain(x, r, nw, w, sb, b, dtype)
            assert torch.equal(r_out, e_r), f"residual_out: {what}"
            assert torch.equal(out, e_out), f"out: {what}"
            if r is not None:
                assert torch.equal(r, r_before), f"residual was written: {what}"
            if m in (1, 7, 16):
                check_against_float64(out, q, s, w, sb, b, what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [16, 64, 1040, 2064])
def test_small_and_odd_k(dtype, k):
    """K below one 256-thread pass of 8-element vectors, K % 64 != 0, K not a multiple of 2048 (the last chunk
    partial), a thread with more vectors than others (2064 / 8 = 258 vectors)."""
    n = 96
    for m in (1, 5, 16):
        x, r, nw, w, sb, b = operands(m, n, k, dtype, torch.bfloat16, seed=k + m, bias=True)
        out, r_out = add_rms_norm_linear_decode(x, r, nw, EPS, w.t(), sb, b, dtype)
        e_out, e_r, q, s = chain(x, r, nw, w, sb, b, dtype)
        assert torch.equal(r_out, e_r) and torch.equal(out, e_out), f"M={m} K={k}"
        check_against_float64(out, q, s, w, sb, b, f"M={m} K={k}")


def test_padded_rows_and_one_row_any_stride():
    m, k, n = 6, 4096, 2048
    g = torch.Generator(device="cuda").manual_seed(9)
    x = rows(m, k + 24, torch.bfloat16, g)[:, 8:8 + k]  # stride K + 24, 16 bytes in
    r = rows(m, k + 40, torch.bfloat16, g)[:, 16:16 + k]
    nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).to(torch.bfloat16)
    w = rand_operand((n, k), torch.int8, "cuda", g)
    sb = rand_scale((n,), "cuda", 1e-3, g)
    out, r_out = add_rms_norm_linear_decode(x, r, nw, EPS, w.t(), sb)
    e_out, e_r, _, _ = chain(x, r, nw, w, sb, None, torch.int8)
    assert torch.equal(out, e_out) and torch.equal(r_out, e_r)
    assert r_out.is_contiguous()
    # one row: its stride(0) is never used
    x1 = rows(1, k + 8, torch.bfloat16, g)[:, :k]
    out1, r1 = add_rms_norm_linear_decode(x1, r[:1], nw, EPS, w.t(), sb)
    e1, er1, _, _ = chain(x1, r[:1], nw, w, sb, None, torch.int8)
    assert torch.equal(out1, e1) and torch.equal(r1, er1)


# ---- graphs, streams, PDL -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nk", [(4096, 4096), (1024, 4096)], ids=["4096x4096", "split-K"])
@torch.no_grad()
def test_graph_capture_and_replay_with_new_inputs(dtype, nk):
    """Captured (warm-up on a side stream), replayed with new inputs copied in, without host synchronization; each
    replay equals the eager call and the chain on the same inputs."""
    n, k, m = nk[0], nk[1], 12
    x0, r0, nw, w, sb, bias = operands(m, n, k, dtype, torch.bfloat16, seed=11, bias=True)

    def fn(x, r):
        return add_rms_norm_linear_decode(x, r, nw, EPS, w.t(), sb, bias, dtype)

    graph = cw.graphs.CapturedGraph(fn, [x0, r0])
    for i in range(1, 4):
        x, r, *_ = operands(m, n, k, dtype, torch.bfloat16, seed=11 + i)
        torch.cuda.set_sync_debug_mode("error")  # neither the replay nor the eager op synchronizes the host
        try:
            y, y_r = graph(x, r)
            e, e_r = fn(x, r)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(y, e) and torch.equal(y_r, e_r), f"replay {i}"
        c, c_r, _, _ = chain(x, r, nw, w, sb, bias, dtype)
        assert torch.equal(y, c) and torch.equal(y_r, c_r), f"replay {i}: != rms_norm_quant + scaled_mm_decode"


def test_pdl_on_and_off_give_identical_results():
    x, r, nw, w, sb, b = operands(9, 4096, 4096, torch.int8, torch.bfloat16, seed=13, bias=True)
    prev = cw.set_pdl(False)
    try:
        off = add_rms_norm_linear_decode(x, r, nw, EPS, w.t(), sb, b)
        cw.set_pdl(True)
        on = add_rms_norm_linear_decode(x, r, nw, EPS, w.t(), sb, b)
        # behind a producer kernel on the stream: the PDL wait covers x and residual
        x2 = x * 2
        on2 = add_rms_norm_linear_decode(x2, r, nw, EPS, w.t(), sb, b)
    finally:
        cw.set_pdl(prev)
    assert torch.equal(off[0], on[0]) and torch.equal(off[1], on[1])
    e2, er2, _, _ = chain(x2, r, nw, w, sb, b, torch.int8)
    assert torch.equal(on2[0], e2) and torch.equal(on2[1], er2)


def test_runs_on_current_stream():
    x, r, nw, w, sb, b = operands(16, 2048, 8192, torch.int8, torch.bfloat16, seed=14, bias=True)
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        for _ in range(3):
            out, r_out = add_rms_norm_linear_decode(x, r, nw, EPS, w.t(), sb, b)
    s.synchronize()
    e, e_r, _, _ = chain(x, r, nw, w, sb, b, torch.int8)
    assert torch.equal(out, e) and torch.equal(r_out, e_r)


# ---- errors and opcheck -------------------------------------------------------------------------------------


def test_cpp_checks_name_the_argument():
    x, r, nw, w, sb, b = operands(4, 64, 64, torch.int8, torch.bfloat16, seed=15)
    op = OPS.add_rms_norm_linear_decode
    with pytest.raises(TypeError, match="^add_rms_norm_linear_decode: `x` must be bfloat16 or float16"):
        op(x.float(), r, nw, EPS, w.t(), sb, None, torch.int8)
    with pytest.raises(TypeError, match="^add_rms_norm_linear_decode: `residual` must have x's dtype"):
        op(x, r.half(), nw, EPS, w.t(), sb, None, torch.int8)
    with pytest.raises(ValueError, match=r"^add_rms_norm_linear_decode: `eps` must be a finite number >= 0, got -1.0"):
        op(x, r, nw, -1.0, w.t(), sb, None, torch.int8)
    big = torch.zeros(2, 8208, dtype=torch.bfloat16, device="cuda")
    wbig = torch.zeros(32, 8208, dtype=torch.int8, device="cuda")
    with pytest.raises(ValueError, match=r"^add_rms_norm_linear_decode: `x` K = x.shape\[1\] must be at most 8192"):
        op(big, None, big[0], EPS, wbig.t(), sb[:1], None, torch.int8)
    with pytest.raises(ValueError, match="^add_rms_norm_linear_decode: `scale_b` block scales"):
        wf = torch.zeros(256, 256, dtype=torch.float8_e4m3fn, device="cuda")
        xf = torch.zeros(2, 256, dtype=torch.bfloat16, device="cuda")
        op(xf, None, xf[0], EPS, wf.t(), torch.ones(2, 2, device="cuda"), None, torch.float8_e4m3fn)


def test_opcheck_cuda():
    cases = []
    for dtype in (torch.int8, torch.float8_e4m3fn):
        if dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
            continue
        x, r, nw, w, sb, b = operands(5, 272, 4112, dtype, torch.bfloat16, seed=19, bias=True)
        xh, _, nwh, w2, sb2, _ = operands(12, 256, 256, dtype, torch.float16, seed=20, residual=False,
                                          per_channel=False)
        cases += [(x, r, nw, EPS, w.t(), sb, b, dtype), (xh, None, nwh, EPS, w2.t(), sb2, None, dtype)]
    for args in cases:
        run_opcheck(OPS.add_rms_norm_linear_decode, args)
