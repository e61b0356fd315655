"""scaled_mm on the GPU against the float64 reference from dequantized operands.

Tolerance (cutlass_w8a8/testing/references.py, assert_close_to_reference): int8 products accumulate exactly in int32, so the
only error is the float32 epilogue and the final rounding: one unit in the last place of the output dtype
plus 4 float32 roundoffs of |D|. fp8 adds the tensor cores' accumulation error, K * 2**-13 of
sum_k |a_k b_k| (cutlass_w8a8.testing.references.fp8_accum_bound, derived there).
"""

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import assert_close_to_reference, fp8_accum_bound, rand_operand, rand_scale, reference, scale_magnitudes

pytestmark = pytest.mark.cuda

# Crosses every bucket boundary of the sm90 dispatch table (and typical future ones) on both sides.
M_SWEEP = [1, 2, 3, 8, 15, 16, 17, 24, 31, 32, 33, 48, 63, 64, 65, 96, 127, 128, 129, 192, 255, 256, 257,
           511, 512, 513, 1023, 1024, 1025, 2047, 2048, 2049, 4096, 4097, 8192]
SCALE_KINDS = [(True, True), (True, False), (False, True), (False, False)]  # (per_token, per_channel)
DTYPES = [torch.int8, pytest.param(torch.float8_e4m3fn, id="fp8")]


@pytest.fixture(autouse=True)
def _skip_fp8_where_unsupported(request):
    dtype = request.node.callspec.params.get("dtype") if hasattr(request.node, "callspec") else None
    if dtype == torch.float8_e4m3fn and not cw.supports_fp8():
        pytest.skip("fp8 kernels not available on this device/build")


def problem(m, n, k, dtype, per_token=True, per_channel=True, bias=False, out_dtype=torch.bfloat16, seed=0):
    """Random (a, w, sa, sb, bias) on the GPU: operands of ``dtype``, per-token / per-tensor and per-channel /
    per-tensor float32 scales, a bias of ``out_dtype`` or None (tests/gemm/test_decode_gemm_cuda.py uses it too)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = rand_operand((m, k), dtype, "cuda", g)
    w = rand_operand((n, k), dtype, "cuda", g)
    ma, mb = scale_magnitudes(dtype, k)
    sa = rand_scale((m, 1) if per_token else (1,), "cuda", ma, g)
    sb = rand_scale((n,) if per_channel else (1,), "cuda", mb, g)
    b = (torch.randn(n, device="cuda", generator=g) * 4).to(out_dtype) if bias else None
    return a, w, sa, sb, b


def check(out, a, w, sa, sb, b, out_dtype, what):
    """``out`` against the float64 reference of a @ w.T from the dequantized operands (fp8: with the accumulation
    allowance fp8_accum_bound(K)); tests/gemm/test_decode_gemm_cuda.py uses it too."""
    ref = reference(a, w.t(), sa, sb, b)
    rel = fp8_accum_bound(a.shape[1]) if a.dtype == torch.float8_e4m3fn else 0.0
    assert_close_to_reference(out, ref, out_dtype, accum_rel=rel, what=what)


def run_and_check(a, w, sa, sb, b, out_dtype, what, out=None):
    if out is None:
        out = torch.empty(a.shape[0], w.shape[0], dtype=out_dtype, device="cuda")
    out.fill_(float("nan"))  # poison: every element must be written
    cw.scaled_mm(a, w.t(), sa, sb, out_dtype, b, out=out)
    check(out, a, w, sa, sb, b, out_dtype, what)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", M_SWEEP)
def test_m_sweep(dtype, m):
    """Every bucket, every scale kind, bias or not, both output dtypes, on one mid-size (N, K)."""
    n, k = 768, 1024
    for i, (per_token, per_channel) in enumerate(SCALE_KINDS):
        for bias in (False, True):
            for out_dtype in (torch.bfloat16, torch.float16):
                args = problem(m, n, k, dtype, per_token, per_channel, bias, out_dtype, seed=m * 100 + i)
                run_and_check(*args, out_dtype, f"M={m} per_token={per_token} per_channel={per_channel} "
                                                f"bias={bias} {out_dtype}")


# Buckets chosen by N and K as well as M (csrc/gemm/sm90/scaled_mm_sm90_dispatch.cuh), each on both sides of its
# boundary. int8 at M > 128 picks 64x128 or 128x128 tiles by how well they fill the waves of 132 SMs: 64x128
# for (256, 4096), (512, 6144) and (512, 6160); 128x128 for (129, 6144), (256, 8192), (512, 4096) and
# (1024, 6144). fp8: M >= 2048 with K >= 8192.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(129, 6144, 1024), (256, 4096, 1024), (256, 8192, 1040), (512, 6144, 1024),
                                   (512, 6160, 1008), (512, 4096, 1024), (1024, 6144, 1024),
                                   (2047, 1040, 8192), (2048, 1040, 8192), (2048, 528, 8176), (2049, 272, 8208)])
def test_shape_dependent_buckets(dtype, m, n, k):
    args = problem(m, n, k, dtype, True, True, True, torch.bfloat16, seed=m + n + k)
    run_and_check(*args, torch.bfloat16, f"M={m} N={n} K={k}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 16, 64, 256, 4096])
@pytest.mark.parametrize("nk", [(6144, 4096), (4096, 14336), (28672, 4096), (16, 16), (48, 4096), (4096, 48),
                                (1040, 272)])
def test_model_and_odd_shapes(dtype, m, nk):
    n, k = nk
    args = problem(m, n, k, dtype, True, True, True, torch.bfloat16, seed=n + k + m)
    run_and_check(*args, torch.bfloat16, f"M={m} N={n} K={k}")


def test_functional_form_allocates_bf16_by_default():
    a, w, sa, sb, b = problem(33, 256, 512, torch.int8, True, True, True, torch.bfloat16, seed=1)
    out = cw.scaled_mm(a, w.t(), sa, sb, bias=b)
    assert out.dtype == torch.bfloat16 and out.shape == (33, 256) and out.is_contiguous()
    ref = reference(a, w.t(), sa, sb, b)
    assert_close_to_reference(out, ref, torch.bfloat16, what="functional")


def test_m_zero_returns_empty():
    a, w, sa, sb, _ = problem(0, 256, 512, torch.int8, False, True, False, torch.bfloat16, seed=2)
    assert cw.scaled_mm(a, w.t(), sa, sb).shape == (0, 256)
    assert torch.ops.cutlass_w8a8.scaled_mm(a, w.t(), sa, sb, torch.bfloat16, None).shape == (0, 256)


def test_padded_views():
    """Slices of wider buffers for a, b and out: the kernels honour the leading strides."""
    m, n, k = 100, 256, 512
    g = torch.Generator(device="cuda").manual_seed(3)
    a_buf = rand_operand((m, k + 64), torch.int8, "cuda", g)
    w_buf = rand_operand((n, k + 32), torch.int8, "cuda", g)
    a, w = a_buf[:, 16:16 + k], w_buf[:, :k]  # offsets and pitches stay multiples of 16 bytes
    ma, mb = scale_magnitudes(torch.int8, k)
    sa, sb = rand_scale((m, 1), "cuda", ma, g), rand_scale((n,), "cuda", mb, g)
    out_buf = torch.empty(m, n + 24, dtype=torch.bfloat16, device="cuda")
    out_buf.fill_(7.0)
    out = out_buf[:, 8:8 + n]
    run_and_check(a, w, sa, sb, None, torch.bfloat16, "padded views", out=out)
    # the padding around the written window is untouched
    assert (out_buf[:, :8] == 7).all() and (out_buf[:, 8 + n:] == 7).all()


def test_single_row_any_stride():
    """A one-row slice keeps the parent's stride(0); the kernel must still read it right."""
    g = torch.Generator(device="cuda").manual_seed(4)
    a_buf = rand_operand((8, 1024 + 16), torch.int8, "cuda", g)
    a = a_buf[5:6, :1024]
    w = rand_operand((512, 1024), torch.int8, "cuda", g)
    ma, mb = scale_magnitudes(torch.int8, 1024)
    sa, sb = rand_scale((1, 1), "cuda", ma, g), rand_scale((512,), "cuda", mb, g)
    run_and_check(a, w, sa, sb, None, torch.bfloat16, "one-row slice")


def test_results_change_with_inputs():
    """Guards against a kernel that ignores its inputs (e.g. reads stale buffers)."""
    a, w, sa, sb, b = problem(64, 256, 512, torch.int8, True, True, False, torch.bfloat16, seed=5)
    y1 = cw.scaled_mm(a, w.t(), sa, sb)
    a2 = rand_operand(a.shape, torch.int8, "cuda")
    y2 = cw.scaled_mm(a2, w.t(), sa, sb)
    assert not torch.equal(y1, y2)


def test_runs_on_current_stream():
    """Work goes to the current stream: results are ready once that stream is synchronised."""
    a, w, sa, sb, b = problem(256, 1024, 2048, torch.int8, True, True, True, torch.bfloat16, seed=6)
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        out = torch.full((256, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
        for _ in range(3):
            cw.scaled_mm(a, w.t(), sa, sb, bias=b, out=out)
    s.synchronize()
    ref = reference(a, w.t(), sa, sb, b)
    assert_close_to_reference(out, ref, torch.bfloat16, what="side stream")


# ---- bad input with CUDA tensors ---------------------------------------------------------------------

def test_mixed_devices_rejected():
    a, w, sa, sb, b = problem(4, 32, 64, torch.int8, True, True, True, torch.bfloat16, seed=7)
    cases = {
        "b": dict(b=w.t().cpu()),
        "scale_a": dict(scale_a=sa.cpu()),
        "scale_b": dict(scale_b=sb.cpu()),
        "bias": dict(bias=b.cpu()),
    }
    for name, change in cases.items():
        kwargs = dict(a=a, b=w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, bias=b)
        kwargs.update(change)
        with pytest.raises(ValueError, match=f"`{name}` is on cpu"):
            cw.scaled_mm(**kwargs)
        # straight to the op: the C++ checks name the argument too
        with pytest.raises(ValueError, match=f"`{name}`"):
            torch.ops.cutlass_w8a8.scaled_mm(*kwargs.values())


@pytest.mark.parametrize("case", [
    "b row-major", "a column-major", "a misaligned", "a bad row pitch", "K not multiple of 16",
    "N not multiple of 16", "scale_a wrong shape", "bias wrong dtype", "scale_b float64", "a wrong dtype"])
def test_cpp_checks_match_python(case):
    """The C++ entry rejects what the Python wrapper rejects, with the same argument named."""
    from test_ops_cpu import BAD_CASES

    exc, name, change = BAD_CASES[case]
    a, w, sa, sb, b = problem(4, 32, 64, torch.int8, True, True, True, torch.bfloat16, seed=8)
    kwargs = dict(a=a, b=w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, bias=b)
    cpu_kwargs = change(a.cpu(), w.cpu(), sa.cpu(), sb.cpu(), b.cpu())
    kwargs.update({k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in cpu_kwargs.items()})
    # .cuda() of a sliced view copies it densely; rebuild layout-specific cases on the device
    if case == "a misaligned":
        kwargs["a"] = torch.zeros(4 * 80 + 8, dtype=torch.int8, device="cuda")[8:].view(4, 80)[:, :64]
    if case == "a bad row pitch":
        kwargs["a"] = torch.zeros(4, 72, dtype=torch.int8, device="cuda")[:, :64]
    if case == "a column-major":
        kwargs["a"] = a.t().contiguous().t()
    if case == "b row-major":
        kwargs["b"] = w.t().contiguous()
    with pytest.raises(exc, match=f"scaled_mm: {name}"):
        torch.ops.cutlass_w8a8.scaled_mm(*kwargs.values())


def test_opcheck_cuda():
    a, w, sa, sb, b = problem(24, 256, 512, torch.int8, True, True, True, torch.bfloat16, seed=9)
    out = torch.empty(24, 256, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(2, 12, 512, dtype=torch.bfloat16, device="cuda")
    for op, args in [
        (torch.ops.cutlass_w8a8.scaled_mm, (a, w.t(), sa, sb, torch.bfloat16, b)),
        (torch.ops.cutlass_w8a8.scaled_mm, (a, w.t(), sa[:1], sb[:1], torch.float16, None)),
        (torch.ops.cutlass_w8a8.scaled_mm_out, (out, a, w.t(), sa, sb, b)),
        (torch.ops.cutlass_w8a8.quantize_per_token, (x, torch.int8)),
        (torch.ops.cutlass_w8a8.quantize_per_tensor, (x, torch.tensor([0.02], device="cuda"), torch.int8)),
    ]:
        torch.library.opcheck(op, args)
