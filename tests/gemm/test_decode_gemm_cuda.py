"""scaled_mm_decode and linear_decode on the GPU (csrc/gemm/decode/scaled_mm_decode.cu).

- Against the float64 reference from dequantized operands (cutlass_w8a8/testing/references.py, assert_close_to_reference): int8
  accumulates exactly, so the only error is the float32 epilogue and the final rounding; fp8 adds the
  accumulation allowance fp8_accum_bound(K). Outputs are poisoned (NaN) first, so every element must be
  written; inputs are fresh random tensors per case.
- Every M in 1..16 (one and two token tiles), the Llama-3-8B decode shapes, small and odd N and K (K % 64 != 0,
  N below one tile per SM: the split-K path with its second kernel), per-tensor and per-token / per-channel
  scales, bias or not, bf16 / fp16 out, int8 and fp8, strided weights and padded rows.
- int8 results equal cw.scaled_mm's bit for bit (both accumulate exactly and share the epilogue's float32
  order of operations); linear_decode equals quantize_per_token followed by scaled_mm_decode bit for bit.
- CUDA-graph capture and replay with new inputs, UpdatableGraph.set_rows on the M-parameter nodes, PDL on and
  off, the current stream, opcheck.
"""

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import rand_operand, rand_scale, scale_magnitudes
from _opcheck import run_opcheck
from test_scaled_mm_cuda import check, problem  # the operands and the float64-reference check of scaled_mm's tests

pytestmark = pytest.mark.cuda

OPS = torch.ops.cutlass_w8a8
DTYPES = [torch.int8, pytest.param(torch.float8_e4m3fn, id="fp8")]
OUT_DTYPES = [torch.bfloat16, torch.float16]
SCALE_KINDS = [(True, True), (True, False), (False, True), (False, False)]  # (per_token, per_channel)
LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K): qkv, o, gate_up, down


def fp8_supported() -> bool:
    return torch.cuda.get_device_capability() >= (8, 9)


@pytest.fixture(autouse=True)
def _skip_fp8_where_unsupported(request):
    params = request.node.callspec.params if hasattr(request.node, "callspec") else {}
    if params.get("dtype") == torch.float8_e4m3fn and not fp8_supported():
        pytest.skip("fp8 mma needs compute capability 8.9 or newer")


def activations(m, k, xdtype=torch.bfloat16, seed=0, zero_row=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(m, k, device="cuda", generator=g) * 2).to(xdtype)
    if zero_row is not None:
        x[zero_row] = 0
    return x


def decode(a, w, sa, sb, b, out_dtype, out=None):
    """scaled_mm_decode into a NaN-poisoned output (`out` or a new one)."""
    if out is None:
        out = torch.empty(a.shape[0], w.shape[0], dtype=out_dtype, device="cuda")
    out.fill_(float("nan"))
    return cw.scaled_mm_decode(a, w.t(), sa, sb, out_dtype, b, out=out)


# ---- against the float64 reference --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nk", [(2176, 4112), (272, 4112)], ids=["tiles>=SMs", "split-K"])
@pytest.mark.parametrize("m", range(1, 17))
def test_every_m(dtype, nk, m):
    """Every M, every scale kind, bias or not, both output dtypes; K % 64 = 16 (the tail), N with and without
    the split along K (2176 / 16 = 136 row tiles; 272 / 16 = 17)."""
    n, k = nk
    for i, (per_token, per_channel) in enumerate(SCALE_KINDS):
        for bias in (False, True):
            for out_dtype in OUT_DTYPES:
                args = problem(m, n, k, dtype, per_token, per_channel, bias, out_dtype, seed=1000 * m + 10 * i + bias)
                out = decode(*args, out_dtype)
                check(out, *args, out_dtype, f"M={m} N={n} K={k} {dtype} per_token={per_token} "
                                             f"per_channel={per_channel} bias={bias} {out_dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nk", LLAMA3_8B, ids=lambda nk: f"{nk[0]}x{nk[1]}")
@pytest.mark.parametrize("m", [1, 2, 4, 8, 9, 16])
def test_llama_shapes(dtype, nk, m):
    n, k = nk
    args = problem(m, n, k, dtype, True, True, True, torch.bfloat16, seed=n + k + m)
    out = decode(*args, torch.bfloat16)
    check(out, *args, torch.bfloat16, f"M={m} N={n} K={k} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [16, 48, 1024, 2048])
@pytest.mark.parametrize("k", [64, 128, 4112, 8192])
@pytest.mark.parametrize("m", [1, 7, 16])
def test_small_and_odd_shapes(dtype, n, k, m):
    """One to a few row tiles (the split path when K holds at least 8 blocks of 256 bytes per split) and K that
    is one block, two blocks, or not a multiple of 64."""
    per_token = m % 2 == 1
    args = problem(m, n, k, dtype, per_token, not per_token, m != 7, torch.float16, seed=n * k + m)
    out = decode(*args, torch.float16)
    check(out, *args, torch.float16, f"M={m} N={n} K={k} {dtype}")


def test_int8_largest_k_exact():
    """K = INT8_MAX_K of constant -128 x -128: the largest accumulator, 131056 * 16384 = 8191 * 2**18 < 2**31,
    exact in int32 and in float32. N = 32 splits K across 64 CTAs, whose partial sums the second kernel adds."""
    k = cw.INT8_MAX_K
    a = torch.full((3, k), -128, dtype=torch.int8, device="cuda")
    w = torch.full((32, k), -128, dtype=torch.int8, device="cuda")
    one = torch.ones(1, device="cuda")
    scale = torch.tensor([2.0 ** -20], device="cuda")
    out = cw.scaled_mm_decode(a, w.t(), scale, one, torch.bfloat16)
    expected = torch.tensor(131056 * 16384 * 2.0 ** -20, dtype=torch.float64).to(torch.bfloat16).item()
    assert (out == expected).all(), out[0, :4]
    assert torch.equal(out, cw.scaled_mm(a, w.t(), scale, one, torch.bfloat16))


# ---- layouts ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_weight_padded_rows_and_padded_out(dtype):
    """a with padded rows, the weight as a K window of a wider buffer (b.stride(1) > K) and as a block of rows of
    a bigger weight, out as a window of a wider buffer: all read and written through their strides."""
    m, n, k = 11, 1040, 4112
    g = torch.Generator(device="cuda").manual_seed(7)
    a = rand_operand((m, k + 48), dtype, "cuda", g)[:, 16:16 + k]
    w_window = rand_operand((n, k + 64), dtype, "cuda", g)[:, 32:32 + k]
    w_rows = rand_operand((3 * n, k), dtype, "cuda", g)[n:2 * n]
    ma, mb = scale_magnitudes(dtype, k)
    sa, sb = rand_scale((m, 1), "cuda", ma, g), rand_scale((n,), "cuda", mb, g)
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    for w in (w_window, w_rows):
        out_buf = torch.full((m, n + 24), 7.0, dtype=torch.bfloat16, device="cuda")
        out = out_buf[:, 8:8 + n]
        decode(a, w, sa, sb, bias, torch.bfloat16, out=out)
        check(out, a, w, sa, sb, bias, torch.bfloat16, f"strided weight {tuple(w.stride())}")
        assert (out_buf[:, :8] == 7).all() and (out_buf[:, 8 + n:] == 7).all()
        if dtype == torch.int8:
            assert torch.equal(out, cw.scaled_mm(a, w.t(), sa, sb, torch.bfloat16, bias))


def test_single_row_any_stride():
    """A one-row slice may carry any stride(0); only row 0 is read."""
    k, n = 4096, 512
    g = torch.Generator(device="cuda").manual_seed(8)
    a = rand_operand((6, k + 8), torch.int8, "cuda", g)[2:3, :k]  # stride K + 8, 16-byte aligned start
    w = rand_operand((n, k), torch.int8, "cuda", g)
    ma, mb = scale_magnitudes(torch.int8, k)
    sa, sb = rand_scale((1, 1), "cuda", ma, g), rand_scale((n,), "cuda", mb, g)
    out = decode(a, w, sa, sb, None, torch.bfloat16)
    check(out, a, w, sa, sb, None, torch.bfloat16, "one-row slice")


# ---- bit-for-bit equalities ----------------------------------------------------------------------------------


@pytest.mark.parametrize("nk", [(6144, 4096), (4096, 14336), (272, 4112), (1024, 4096), (16, 64)],
                         ids=lambda nk: f"{nk[0]}x{nk[1]}")
def test_int8_equals_scaled_mm_bitwise(nk):
    """Both accumulate exactly in int32 and apply round(s_a * (s_b * float(acc)) + c) with the same float32
    operations, so the outputs are identical, whatever the kernels' tiling. scaled_mm is held on its CUTLASS
    kernels (decode bound 0): at M <= decode_gemm_max_m() it would otherwise run this very kernel."""
    n, k = nk
    previous = cw._ext.set_decode_gemm_max_m(0)
    try:
        _int8_equals_cutlass(n, k)
    finally:
        cw._ext.set_decode_gemm_max_m(previous)


def _int8_equals_cutlass(n, k):
    for m in range(1, 17):
        for i, (per_token, per_channel) in enumerate(SCALE_KINDS):
            bias = (m + i) % 2 == 0
            out_dtype = OUT_DTYPES[(m // 2 + i) % 2]
            a, w, sa, sb, b = problem(m, n, k, torch.int8, per_token, per_channel, bias, out_dtype, seed=m * 7 + i)
            ours = decode(a, w, sa, sb, b, out_dtype)
            theirs = cw.scaled_mm(a, w.t(), sa, sb, out_dtype, b)
            if not torch.equal(ours, theirs):
                idx = tuple((ours != theirs).nonzero()[0].tolist())
                raise AssertionError(f"M={m} N={n} K={k} per_token={per_token} per_channel={per_channel} "
                                     f"bias={bias} {out_dtype}: {int((ours != theirs).sum())} elements differ, "
                                     f"e.g. at {idx}: {ours[idx].item()} vs {theirs[idx].item()}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("xdtype", OUT_DTYPES)
@pytest.mark.parametrize("nk", [(4096, 4096), (272, 4112), (1024, 4096), (16, 64), (48, 14336)],
                         ids=lambda nk: f"{nk[0]}x{nk[1]}")
def test_linear_decode_equals_quantize_then_gemm(dtype, xdtype, nk):
    """linear_decode(x) == scaled_mm_decode(quantize_per_token(x)) bit for bit: the same quantized values and
    scales (a zero row included: scale 0, q = 0), the same MMAs per warp, the same sums and epilogue; with the
    split along K too (272 x 4112, 1024 x 4096: the in-kernel scales go through the workspace)."""
    n, k = nk
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = rand_operand((n, k), dtype, "cuda", g)
    for m in (1, 2, 5, 8, 9, 16):
        x = activations(m, k, xdtype, seed=m + n, zero_row=m // 2 if m > 1 else None)
        for per_channel in (True, False):
            sb = rand_scale((n,) if per_channel else (1,), "cuda", 1e-2, g)
            for bias in (None, torch.randn(n, device="cuda", generator=g).to(xdtype)):
                what = f"M={m} N={n} K={k} {dtype} {xdtype} per_channel={per_channel} bias={bias is not None}"
                out = torch.full((m, n), float("nan"), dtype=xdtype, device="cuda")
                cw.linear_decode(x, w.t(), sb, bias, dtype, out=out)
                q, s = OPS.quantize_per_token(x, dtype)
                chain = cw.scaled_mm_decode(q, w.t(), s, sb, xdtype, bias)
                assert torch.equal(out, chain), what
                check(out, q, w, s, sb, bias, xdtype, what)


def test_linear_decode_padded_x_rows():
    m, k, n = 6, 4096, 2048
    g = torch.Generator(device="cuda").manual_seed(9)
    x_buf = (torch.randn(m, k + 24, device="cuda", generator=g)).to(torch.bfloat16)
    x = x_buf[:, 8:8 + k]  # stride K + 24 (a multiple of 8), starts 16 bytes in
    w = rand_operand((n, k), torch.int8, "cuda", g)
    sb = rand_scale((n,), "cuda", 1e-3, g)
    y = cw.linear_decode(x, w.t(), sb)
    q, s = OPS.quantize_per_token(x, torch.int8)
    assert torch.equal(y, cw.scaled_mm_decode(q, w.t(), s, sb, torch.bfloat16))


# ---- graphs, streams, PDL -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nk", [(4096, 4096), (1024, 4096)], ids=["4096x4096", "split-K"])
@torch.no_grad()
def test_graph_capture_and_replay_with_new_inputs(dtype, nk):
    """Both ops captured (warm-up on a side stream), replayed with new inputs copied in, without host
    synchronization; each replay equals the eager call on the same inputs."""
    n, k, m = nk[0], nk[1], 12
    g = torch.Generator(device="cuda").manual_seed(11)
    w = rand_operand((n, k), dtype, "cuda", g)
    sb = rand_scale((n,), "cuda", 1e-2, g)
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)

    def fn(x, a, sa):
        return cw.linear_decode(x, w.t(), sb, bias), cw.scaled_mm_decode(a, w.t(), sa, sb, torch.bfloat16, bias)

    def inputs(seed):
        x = activations(m, k, seed=seed)
        a, s = OPS.quantize_per_token(x, dtype)
        return x, a, s

    graph = cw.graphs.CapturedGraph(fn, list(inputs(0)))
    for i in range(1, 4):
        new = inputs(i)
        torch.cuda.set_sync_debug_mode("error")  # neither the replay nor the eager ops synchronize the host
        try:
            y_lin, y_mm = graph(*new)
            e_lin, e_mm = fn(*new)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(y_lin, e_lin) and torch.equal(y_mm, e_mm), f"replay {i}"
        assert torch.equal(y_lin, y_mm), f"replay {i}: linear_decode != quantize + scaled_mm_decode"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nk", [(4096, 4096), (1024, 4096)], ids=["4096x4096", "split-K"])
@torch.no_grad()
def test_updatable_graph_set_rows(dtype, nk):
    """Captured at M = 16; set_rows rewrites the kernels' first parameter (M) of every node (the split-K
    reduce kernel's too), and each M's replay equals the eager call on the first M rows."""
    n, k = nk
    g = torch.Generator(device="cuda").manual_seed(12)
    w = rand_operand((n, k), dtype, "cuda", g)
    sb = rand_scale((n,), "cuda", 1e-2, g)

    def fn(x, a, sa):
        return cw.linear_decode(x, w.t(), sb), cw.scaled_mm_decode(a, w.t(), sa, sb)

    x16 = activations(16, k, seed=0)
    a16, s16 = OPS.quantize_per_token(x16, dtype)
    graph = cw.graphs.UpdatableGraph(fn, [x16, a16, s16])
    ops = {node.op for node in graph.nodes}
    assert ops == {"linear_decode", "scaled_mm_decode"}, graph.nodes
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    split = n // 16 < sms and k // 2048 >= 2  # csrc/gemm/decode/scaled_mm_decode.cu, choose_splits
    assert len(graph.nodes) == (4 if split else 2), graph.nodes  # a split adds a reduce node per op
    for i, m in enumerate([16, 1, 5, 8, 9, 3, 16]):
        graph.set_rows(m)
        x = activations(16, k, seed=100 + i)
        a, s = OPS.quantize_per_token(x, dtype)
        y_lin, y_mm = graph(x, a, s)
        e_lin, e_mm = fn(x[:m], a[:m], s[:m])
        assert torch.equal(y_lin[:m], e_lin), f"linear_decode M={m}"
        assert torch.equal(y_mm[:m], e_mm), f"scaled_mm_decode M={m}"


def test_pdl_on_and_off_give_identical_results():
    a, w, sa, sb, b = problem(9, 4096, 4096, torch.int8, bias=True, seed=13)
    x = activations(9, 4096, seed=13)
    prev = cw.set_pdl(False)
    try:
        off = (cw.scaled_mm_decode(a, w.t(), sa, sb, bias=b), cw.linear_decode(x, w.t(), sb, b))
        cw.set_pdl(True)
        on = (cw.scaled_mm_decode(a, w.t(), sa, sb, bias=b), cw.linear_decode(x, w.t(), sb, b))
    finally:
        cw.set_pdl(prev)
    assert torch.equal(off[0], on[0]) and torch.equal(off[1], on[1])


def test_runs_on_current_stream():
    a, w, sa, sb, b = problem(16, 2048, 8192, torch.int8, bias=True, seed=14)
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        out = torch.full((16, 2048), float("nan"), dtype=torch.bfloat16, device="cuda")
        for _ in range(3):
            cw.scaled_mm_decode(a, w.t(), sa, sb, bias=b, out=out)
    s.synchronize()
    check(out, a, w, sa, sb, b, torch.bfloat16, "side stream")


def test_results_change_with_inputs():
    a, w, sa, sb, _ = problem(4, 1024, 1024, torch.int8, seed=15)
    y1 = cw.scaled_mm_decode(a, w.t(), sa, sb)
    y2 = cw.scaled_mm_decode(rand_operand(a.shape, torch.int8, "cuda"), w.t(), sa, sb)
    assert not torch.equal(y1, y2)


# ---- errors and opcheck -------------------------------------------------------------------------------------


def test_cpp_checks_name_the_argument():
    """Direct op calls (no Python wrapper) are rejected by the C++ checks, naming the argument."""
    a, w, sa, sb, b = problem(4, 32, 64, torch.int8, bias=True, seed=16)
    x = activations(4, 64)
    with pytest.raises(ValueError, match=r"^scaled_mm_decode: `a` M = a.shape\[0\] must be in \[1, 16\]"):
        OPS.scaled_mm_decode(torch.zeros(17, 64, dtype=torch.int8, device="cuda"), w.t(), sa[:1], sb,
                             torch.bfloat16, b)
    with pytest.raises(TypeError, match="^scaled_mm_decode: `a` must be int8 or float8_e4m3fn"):
        OPS.scaled_mm_decode(a.half(), w.t(), sa, sb, torch.bfloat16, b)
    with pytest.raises(ValueError, match="^scaled_mm_decode: `b` must be column-major"):
        OPS.scaled_mm_decode(a, w.t().contiguous(), sa, sb, torch.bfloat16, b)
    with pytest.raises(ValueError, match="^scaled_mm_decode: `scale_a` is on cpu but `a` is on cuda"):
        OPS.scaled_mm_decode(a, w.t(), sa.cpu(), sb, torch.bfloat16, b)
    with pytest.raises(TypeError, match="^linear_decode: `x` must be bfloat16 or float16"):
        OPS.linear_decode(x.float(), w.t(), sb, b, torch.int8)
    with pytest.raises(TypeError, match="^linear_decode: `b` must have the quantized dtype"):
        OPS.linear_decode(x, w.t(), sb, b, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"^linear_decode: `x` M = x.shape\[0\] must be in \[1, 16\]"):
        OPS.linear_decode(torch.zeros(17, 64, dtype=torch.bfloat16, device="cuda"), w.t(), sb, b, torch.int8)
    with pytest.raises(ValueError, match=r"^linear_decode: `x` stride\(0\) must be a multiple of 8"):
        OPS.linear_decode(torch.zeros(4, 68, dtype=torch.bfloat16, device="cuda")[:, :64], w.t(), sb, b,
                          torch.int8)


def test_fp8_refused_below_sm89():
    if fp8_supported():
        pytest.skip("the device has fp8 mma")
    a, w, sa, sb, _ = problem(2, 32, 64, torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="float8_e4m3fn needs compute capability 8.9"):
        cw.scaled_mm_decode(a, w.t(), sa, sb)


def opcheck_cases():
    out = []
    for dtype in (torch.int8, torch.float8_e4m3fn):
        if dtype == torch.float8_e4m3fn and not fp8_supported():
            continue
        a, w, sa, sb, b = problem(5, 272, 4112, dtype, bias=True, seed=17)
        a2, w2, sa2, sb2, _ = problem(12, 1024, 256, dtype, per_token=False, per_channel=False, seed=18)
        x = activations(5, 4112, seed=19)
        xh = activations(12, 256, torch.float16, seed=20)
        d = torch.empty(5, 272, dtype=torch.bfloat16, device="cuda")
        out += [
            (OPS.scaled_mm_decode, (a, w.t(), sa, sb, torch.bfloat16, b)),
            (OPS.scaled_mm_decode, (a2, w2.t(), sa2, sb2, torch.float16, None)),
            (OPS.scaled_mm_decode_out, (d, a, w.t(), sa, sb, b)),
            (OPS.linear_decode, (x, w.t(), sb, b, dtype)),
            (OPS.linear_decode, (xh, w2.t(), sb2, None, dtype)),
            (OPS.linear_decode_out, (d, x, w.t(), sb, b, dtype)),
        ]
    return out


def test_opcheck_cuda():
    for op, args in opcheck_cases():
        try:
            run_opcheck(op, args)
        except Exception as exc:
            raise AssertionError(f"opcheck failed for {op} on {[getattr(t, 'dtype', t) for t in args]}: {exc}") \
                from exc
