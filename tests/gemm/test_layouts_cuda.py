"""Layouts on the GPU: every view is either computed correctly or rejected with a ValueError naming it.

scaled_mm reads A [M, K] row-major and B [K, N] column-major (the transpose of a row-major [N, K] weight) and
writes D [M, N] row-major, through TMA: bases must be 16-byte aligned and leading strides multiples of 16
bytes (16 elements of A / B, 8 of D). Windows of wider buffers (padded rows, column and row offsets) that
keep those properties are legal and must be honoured; the rest must be rejected by both the Python wrapper
and the C++ entry (direct ``torch.ops`` calls). The quantization ops accept any layout (non-contiguous
inputs are read through their strides or copied first) and must match the CPU reference bit for bit.

Complements tests/gemm/test_scaled_mm_cuda.py (test_padded_views: one int8 window case; test_cpp_checks_match_python:
the C++ side of a few CPU BAD_CASES) with fp8, every operand's offsets, row windows, single-row pitches, and
each misaligned / non-contiguous view.
"""

import re

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import fp8_accum_bound
from cutlass_w8a8.testing.references import assert_close_to_reference, rand_operand, rand_scale, reference, scale_magnitudes

pytestmark = pytest.mark.cuda

DTYPES = [torch.int8, torch.float8_e4m3fn]
SENTINEL = 7.0


def scales(m, n, k, dtype, g):
    ma, mb = scale_magnitudes(dtype, k)
    return rand_scale((m, 1), "cuda", ma, g), rand_scale((n,), "cuda", mb, g)


def window(rows, cols, dtype, g, row_off=0, col_off=0, extra_rows=0, extra_cols=0):
    """A [rows, cols] window at (row_off, col_off) of a random [rows + row_off + extra_rows,
    cols + col_off + extra_cols] buffer; returns (view, buffer)."""
    buf = rand_operand((rows + row_off + extra_rows, cols + col_off + extra_cols), dtype, "cuda", g)
    return buf[row_off:row_off + rows, col_off:col_off + cols], buf


def check(out, a, w, sa, sb, bias, dtype, out_dtype, what):
    ref = reference(a, w.t(), sa, sb, bias)
    rel = fp8_accum_bound(ref.k) if dtype == torch.float8_e4m3fn else 0.0
    assert_close_to_reference(out, ref, out_dtype, accum_rel=rel, what=what)


# ---- legal windows: computed correctly, padding untouched ----------------------------------------------

# (a: row_off, col_off, extra_cols) (w: row_off, col_off, extra_cols) (out: row_off, col_off, extra_cols),
# all offsets and pitches multiples of 16 bytes.
WINDOWS = {
    "a cols offset": ((0, 32, 16), (0, 0, 0), (0, 0, 0)),
    "a rows offset": ((3, 0, 48), (0, 0, 0), (0, 0, 0)),
    "w cols offset": ((0, 0, 0), (0, 16, 16), (0, 0, 0)),
    "w rows offset (N window)": ((0, 0, 0), (5, 0, 32), (0, 0, 0)),
    "out cols offset": ((0, 0, 0), (0, 0, 0), (0, 8, 8)),
    "out rows offset": ((0, 0, 0), (0, 0, 0), (2, 0, 16)),
    "all windowed": ((1, 16, 32), (2, 32, 16), (1, 16, 24)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", sorted(WINDOWS))
@pytest.mark.parametrize("m", [5, 100, 1500])  # a swapped (small-M) config, a plain one, the largest tile
def test_windows_computed_correctly(case, m, dtype, out_dtype):
    (ar, ac, ax), (wr, wc, wx), (orow, oc, ox) = WINDOWS[case]
    n, k = 272, 528
    g = torch.Generator(device="cuda").manual_seed(m + len(case))
    a, _ = window(m, k, dtype, g, ar, ac, extra_rows=2, extra_cols=ax)
    w, _ = window(n, k, dtype, g, wr, wc, extra_rows=3, extra_cols=wx)
    sa, sb = scales(m, n, k, dtype, g)
    bias = (torch.randn(n, device="cuda", generator=g) * 4).to(out_dtype)
    out_buf = torch.full((m + orow + 2, n + oc + ox), SENTINEL, dtype=out_dtype, device="cuda")
    out = out_buf[orow:orow + m, oc:oc + n]
    out.fill_(float("nan"))
    ret = cw.scaled_mm(a, w.t(), sa, sb, bias=bias, out=out)
    assert ret is out
    check(out, a, w, sa, sb, bias, dtype, out_dtype, f"{case} M={m}")
    # everything outside the window keeps the sentinel
    mask = torch.ones_like(out_buf, dtype=torch.bool)
    mask[orow:orow + m, oc:oc + n] = False
    assert (out_buf[mask] == SENTINEL).all(), "scaled_mm wrote outside the out window"
    # the functional form on the same windows, and the op without the wrapper
    check(cw.scaled_mm(a, w.t(), sa, sb, out_dtype, bias), a, w, sa, sb, bias, dtype, out_dtype,
          f"{case} M={m} functional")
    out.fill_(float("nan"))
    torch.ops.cutlass_w8a8.scaled_mm_out(out, a, w.t(), sa, sb, bias)
    check(out, a, w, sa, sb, bias, dtype, out_dtype, f"{case} M={m} scaled_mm_out op")


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_row_with_any_pitch(dtype):
    """M = 1: the row pitch is irrelevant (a and out get a packed pitch), only the base must be aligned;
    a pitch that is not a multiple of 16 elements is therefore accepted for a and out."""
    n, k = 256, 1024
    g = torch.Generator(device="cuda").manual_seed(11)
    a_buf = rand_operand((4, k + 8), dtype, "cuda", g)  # pitch k + 8: not a multiple of 16
    a = a_buf[2:3, :k]                                  # offset 2 (k + 8) = 2064 bytes: aligned
    assert a.stride(0) % 16 != 0 and (a.storage_offset() * a.element_size()) % 16 == 0
    w = rand_operand((n, k), dtype, "cuda", g)
    sa, sb = scales(1, n, k, dtype, g)
    out_buf = torch.full((3, n + 4), SENTINEL, dtype=torch.bfloat16, device="cuda")  # pitch n + 4
    out = out_buf[2:3, :n]                                                          # 2 (n + 4) * 2 bytes
    assert out.stride(0) % 8 != 0 and (out.storage_offset() * 2) % 16 == 0
    cw.scaled_mm(a, w.t(), sa, sb, out=out)
    check(out, a, w, sa, sb, None, dtype, torch.bfloat16, "one row, odd pitch")
    assert (out_buf[:2] == SENTINEL).all() and (out_buf[2, n:] == SENTINEL).all()


# ---- illegal views: ValueError naming the argument, from the wrapper and from the C++ entry -------------


def _base(dtype, m=8, n=64, k=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = rand_operand((m, k), dtype, "cuda", g)
    w = rand_operand((n, k), dtype, "cuda", g)
    sa, sb = scales(m, n, k, dtype, g)
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    return dict(a=a, b=w.t(), scale_a=sa, scale_b=sb, bias=bias, out=out)


def _misaligned_rows(rows, cols, dtype, elem_off):
    """[rows, cols] with a legal pitch but a base `elem_off` elements past an aligned address."""
    pitch = cols + 16
    flat = torch.zeros(rows * pitch + elem_off, device="cuda").to(dtype)
    return flat[elem_off:].view(rows, pitch)[:, :cols]


BAD_VIEWS = {
    # name: (argument named in the error, message fragment, change(args) -> dict of replaced arguments)
    "a column-major": ("a", "must be row-major", lambda x: dict(a=x["a"].t().contiguous().t())),
    "a transposed view": ("a", "must be row-major", lambda x: dict(
        a=torch.zeros(x["a"].shape[1], x["a"].shape[0], device="cuda").to(x["a"].dtype).t())),
    "a rows overlap (expanded)": ("a", "rows overlap", lambda x: dict(a=x["a"][:1].expand(x["a"].shape))),
    "a bad row pitch": ("a", "stride(0) must be a multiple of 16", lambda x: dict(
        a=torch.zeros(8, 136, device="cuda").to(x["a"].dtype)[:, :128])),
    "a misaligned": ("a", "16-byte aligned", lambda x: dict(a=_misaligned_rows(8, 128, x["a"].dtype, 8))),
    "a every other column": ("a", "must be row-major", lambda x: dict(
        a=torch.zeros(8, 256, device="cuda").to(x["a"].dtype)[:, ::2])),
    "b row-major": ("b", "must be column-major", lambda x: dict(b=x["b"].contiguous())),
    "b columns overlap (expanded)": ("b", "columns overlap", lambda x: dict(
        b=x["b"][:, :1].expand(x["b"].shape))),
    "b bad pitch": ("b", "stride(1) must be a multiple of 16", lambda x: dict(
        b=torch.zeros(64, 136, device="cuda").to(x["a"].dtype)[:, :128].t())),
    "b misaligned": ("b", "16-byte aligned", lambda x: dict(b=_misaligned_rows(64, 128, x["a"].dtype, 8).t())),
    "scale_a non-contiguous": ("scale_a", "must be contiguous", lambda x: dict(
        scale_a=torch.rand(8, 2, device="cuda")[:, :1])),
    "scale_b non-contiguous": ("scale_b", "must be contiguous", lambda x: dict(
        scale_b=torch.rand(128, device="cuda")[::2])),
    "bias non-contiguous": ("bias", "must be contiguous", lambda x: dict(
        bias=torch.randn(128, device="cuda").to(torch.bfloat16)[::2])),
    "out column-major": ("out", "must be row-major", lambda x: dict(
        out=torch.empty(64, 8, dtype=torch.bfloat16, device="cuda").t())),
    "out rows overlap": ("out", "rows overlap", lambda x: dict(
        out=torch.empty(1, 64, dtype=torch.bfloat16, device="cuda").expand(8, 64))),
    "out bad row pitch": ("out", "stride(0) must be a multiple of 8", lambda x: dict(
        out=torch.empty(8, 68, dtype=torch.bfloat16, device="cuda")[:, :64])),
    "out misaligned": ("out", "16-byte aligned", lambda x: dict(
        out=torch.empty(8 * 72 + 4, dtype=torch.bfloat16, device="cuda")[4:].view(8, 72)[:, :64])),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(BAD_VIEWS))
def test_illegal_views_rejected(case, dtype):
    name, fragment, change = BAD_VIEWS[case]
    x = _base(dtype)
    x.update(change(x))
    pattern = f"scaled_mm: `{name}` .*{re.escape(fragment)}"
    with pytest.raises(ValueError, match=pattern):
        cw.scaled_mm(x["a"], x["b"], x["scale_a"], x["scale_b"], bias=x["bias"], out=x["out"])
    # straight to the C++ entry, both schemas
    with pytest.raises(ValueError, match=pattern):
        torch.ops.cutlass_w8a8.scaled_mm_out(x["out"], x["a"], x["b"], x["scale_a"], x["scale_b"], x["bias"])
    if name != "out":
        with pytest.raises(ValueError, match=f"scaled_mm: `{name}`"):
            torch.ops.cutlass_w8a8.scaled_mm(x["a"], x["b"], x["scale_a"], x["scale_b"], torch.bfloat16,
                                             x["bias"])


# ---- quantization: any layout, bit-exact against the CPU reference --------------------------------------


def _layouts(xdtype, g):
    base = (torch.randn(48, 1024 + 96, device="cuda", generator=g) * 3).to(xdtype)
    cube = (torch.randn(4, 6, 256, device="cuda", generator=g) * 3).to(xdtype)
    return {
        "padded rows": base[:, 96:],
        "rows and columns window": base[5:37, 32:32 + 512],
        "misaligned start": base[:, 1:1 + 1000],
        "transposed": base.t()[:512],
        "every other row": base[::2, :1024],
        "every other column": base[:, ::2],
        "expanded rows": base[:1, :512].expand(16, 512),
        "permuted 3-D": cube.permute(1, 0, 2),
        "3-D with a sliced last dim": cube[:, :, 64:192],
        "3-D transposed last dims": cube.transpose(1, 2),
    }


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("qdtype", DTYPES)
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_any_layout_bit_exact(xdtype, qdtype, static):
    quant = cw.quantize_int8 if qdtype == torch.int8 else cw.quantize_fp8
    g = torch.Generator(device="cuda").manual_seed(3)
    scale = torch.tensor([0.03], device="cuda")
    for name, x in _layouts(xdtype, g).items():
        assert not x.is_contiguous() or name == "padded rows"
        q, s = quant(x, scale) if static else quant(x)
        q_ref, s_ref = quant(x.cpu(), scale.cpu()) if static else quant(x.cpu())
        assert q.shape == x.shape and q.is_contiguous(), name
        diff = q.cpu().view(torch.uint8) != q_ref.view(torch.uint8)
        assert not diff.any(), f"{name}: {int(diff.sum())} of {q.numel()} values differ"
        if static:
            assert s is scale
        else:
            assert s.shape == (*x.shape[:-1], 1) and torch.equal(s.cpu(), s_ref), name
