"""grouped_scaled_mm on the CPU (issue 27): the reference against a per-expert loop of scaled_mm's CPU reference, bit
for bit (row-wise and block fp8 scales, bias, both output dtypes, empty experts, all rows on one expert, T = 1,
rows past offsets[-1]), the out= variant, the offsets errors, opcheck and the fake kernel."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import rand_operand, rand_scale, scale_magnitudes
from _opcheck import run_opcheck  # opcheck without test_schema for fp8 operands (torch.allclose has no fp8)

OPS = torch.ops.cutlass_w8a8
FP8 = torch.float8_e4m3fn


def routing(t, e, kind, g):
    """int32 offsets [E] for T rows: "random" (some experts empty), "one" (every row on one expert), "first_last"
    (the first and last experts empty), "tail" (the last rows routed to no expert: offsets[-1] < T)."""
    if kind == "one":
        counts = torch.zeros(e, dtype=torch.int64)
        counts[e // 2] = t
    elif kind == "first_last":
        counts = torch.zeros(e, dtype=torch.int64)
        inner = torch.randint(0, e - 2, (t,), generator=g) + 1
        counts += torch.bincount(inner, minlength=e)
    elif kind == "tail":
        routed = max(t - 3, 0)
        counts = torch.bincount(torch.randint(0, e, (routed,), generator=g), minlength=e)
    else:
        ids = torch.randint(0, e, (t,), generator=g)
        ids[ids == 1] = 0  # expert 1 empty
        counts = torch.bincount(ids, minlength=e)
    return counts.cumsum(0).to(torch.int32)


def operands(t, k, n, e, dtype, *, sa_shape="token", sb_shape="channel", bias=False, out_dtype=torch.bfloat16,
             block=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = rand_operand((t, k), dtype, "cpu", g)
    w = rand_operand((e, n, k), dtype, "cpu", g)
    ma, mb = scale_magnitudes(dtype, k)
    if block:
        sa = rand_scale((t, k // 128), "cpu", ma, g)
        sb = rand_scale((e, (n + 127) // 128, k // 128), "cpu", mb, g)
    else:
        sa = rand_scale({"token": (t, 1), "token1d": (t,), "tensor": (1,), "scalar": ()}[sa_shape], "cpu", ma, g)
        sb = rand_scale({"channel": (e, n), "expert": (e,), "expert2d": (e, 1)}[sb_shape], "cpu", mb, g)
    b = torch.randn(e, n, generator=g).to(out_dtype) if bias else None
    return a, w.transpose(1, 2), sa, sb, b


def per_expert_loop(a, b, sa, sb, offsets, out_dtype, bias):
    """The expected result: scaled_mm's CPU reference on each expert's rows (zero rows elsewhere)."""
    t, n, e = a.shape[0], b.shape[2], b.shape[0]
    out = torch.zeros(t, n, dtype=out_dtype)
    start = 0
    for i, end in enumerate(offsets.tolist()):
        if end > start:
            if sb.dim() == 3:
                sa_e, sb_e = sa[start:end], sb[i]
            else:
                sa_e = sa.reshape(-1)[start:end].reshape(-1, 1) if sa.numel() != 1 else sa.reshape(1)
                sb_e = sb[i] if sb.dim() == 2 and sb.shape[1] == n else sb.reshape(-1)[i:i + 1]
            out[start:end] = OPS.scaled_mm(a[start:end], b[i], sa_e, sb_e, out_dtype,
                                           bias[i] if bias is not None else None)
        start = end
    return out


@pytest.mark.parametrize("dtype", [torch.int8, FP8])
@pytest.mark.parametrize("kind", ["random", "one", "first_last", "tail"])
@pytest.mark.parametrize("scales", [("token", "channel"), ("tensor", "expert"), ("token1d", "expert2d"),
                                    ("scalar", "channel")])
def test_matches_per_expert_scaled_mm(dtype, kind, scales):
    t, k, n, e = 37, 64, 48, 6
    a, b, sa, sb, bias = operands(t, k, n, e, dtype, sa_shape=scales[0], sb_shape=scales[1], bias=True)
    offsets = routing(t, e, kind, torch.Generator().manual_seed(1))
    got = cw.grouped_scaled_mm(a, b, sa, sb, offsets, torch.bfloat16, bias)
    assert got.shape == (t, n) and got.dtype == torch.bfloat16 and got.is_contiguous()
    assert torch.equal(got, per_expert_loop(a, b, sa, sb, offsets, torch.bfloat16, bias))
    if kind == "tail":
        assert int(offsets[-1]) < t and (got[int(offsets[-1]):] == 0).all()


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_block_fp8_matches_per_expert_scaled_mm(out_dtype, bias):
    t, k, n, e = 21, 256, 208, 5  # N = 208: a partial last weight block
    a, b, sa, sb, bb = operands(t, k, n, e, FP8, block=True, bias=bias, out_dtype=out_dtype)
    offsets = routing(t, e, "random", torch.Generator().manual_seed(2))
    got = cw.grouped_scaled_mm(a, b, sa, sb, offsets, out_dtype, bb)
    assert got.dtype == out_dtype
    assert torch.equal(got, per_expert_loop(a, b, sa, sb, offsets, out_dtype, bb))


@pytest.mark.parametrize("t", [1, 2])
def test_one_or_two_rows(t):
    a, b, sa, sb, bias = operands(t, 32, 16, 3, torch.int8, out_dtype=torch.float16, bias=True)
    for offsets in ([0, t, t], [t, t, t], [0, 0, t]):
        off = torch.tensor(offsets, dtype=torch.int32)
        got = cw.grouped_scaled_mm(a, b, sa, sb, off, torch.float16, bias)
        assert torch.equal(got, per_expert_loop(a, b, sa, sb, off, torch.float16, bias))


def test_zero_rows():
    a, b, sa, sb, _ = operands(0, 32, 16, 3, torch.int8)
    got = cw.grouped_scaled_mm(a, b, sa, sb, torch.zeros(3, dtype=torch.int32), torch.bfloat16)
    assert got.shape == (0, 16) and got.dtype == torch.bfloat16


def test_out_variant_leaves_unrouted_rows():
    t, n = 20, 32
    a, b, sa, sb, bias = operands(t, 64, n, 4, FP8, bias=True)
    offsets = torch.tensor([5, 5, 12, 16], dtype=torch.int32)
    out = torch.full((t, n), 7.0, dtype=torch.bfloat16)
    ret = cw.grouped_scaled_mm(a, b, sa, sb, offsets, torch.bfloat16, bias, out=out)
    assert ret is out
    assert torch.equal(out[:16], per_expert_loop(a, b, sa, sb, offsets, torch.bfloat16, bias)[:16])
    assert (out[16:] == 7.0).all()


def test_padded_a_rows_and_padded_experts():
    """a as a window of a wider buffer (stride(0) > K) and experts with padding between them."""
    t, k, n, e = 9, 64, 32, 3
    g = torch.Generator().manual_seed(5)
    buf = rand_operand((t, k + 32), torch.int8, "cpu", g)
    a = buf[:, :k]
    wbuf = rand_operand((e, n + 16, k + 16), torch.int8, "cpu", g)
    b = wbuf[:, :n, :k].transpose(1, 2)
    sa = rand_scale((t, 1), "cpu", 0.01, g)
    sb = rand_scale((e, n), "cpu", 0.01, g)
    offsets = torch.tensor([2, 6, 9], dtype=torch.int32)
    got = cw.grouped_scaled_mm(a, b, sa, sb, offsets, torch.bfloat16)
    assert torch.equal(got, per_expert_loop(a, b, sa, sb, offsets, torch.bfloat16, None))


@pytest.mark.parametrize("offsets, bad", [([3, 2, 9], "offsets[1] = 2 after 3"), ([3, 5, 11], "offsets[2] = 11 after 5"),
                                          ([-1, 5, 9], "offsets[0] = -1 after 0")])
def test_bad_offsets_raise_naming_offsets(offsets, bad):
    a, b, sa, sb, _ = operands(10, 32, 16, 3, torch.int8)
    with pytest.raises(ValueError, match=r"^grouped_scaled_mm: `offsets` must be non-decreasing values in \[0, T\] "
                       r"with T = 10 \(the end row of each expert's group\), got " + bad.replace("[", r"\[")
                       .replace("]", r"\]") + "$"):
        cw.grouped_scaled_mm(a, b, sa, sb, torch.tensor(offsets, dtype=torch.int32), torch.bfloat16)


def _errors_cases():
    a, b, sa, sb, bias = operands(8, 64, 32, 4, torch.int8)
    off = torch.tensor([2, 4, 6, 8], dtype=torch.int32)
    w = b.transpose(1, 2)  # (E, N, K)
    return [
        ("offsets int64", (a, b, sa, sb, off.long()), TypeError, "`offsets` must be int32, got torch.int64"),
        ("offsets shape", (a, b, sa, sb, off[:3]), ValueError, r"`offsets` must be \[E\] = \[4\]"),
        ("b 2-D", (a, b[0], sa, sb, off), ValueError, r"`b` must be 3-D \[E, K, N\]"),
        ("b not transposed", (a, w.contiguous().reshape(4, 64, 32), sa, sb, off), ValueError,
         r"`b` must be \[E, K, N\] with stride\(1\) == 1"),
        ("b K", (a[:, :32], b, sa, sb, off), ValueError, r"`b` must be \[E, K, N\] with K = a.shape\[1\] = 32"),
        ("scale_b shape", (a, b, sa, sb[:, :16], off), ValueError, r"`scale_b` must be \[E, N\] \(per-channel\)"),
        ("scale_a shape", (a, b, sa[:5], sb, off), ValueError, r"`scale_a` must be \[1\] \(per-tensor\), \[T\]"),
        ("block int8", (a, b, torch.ones(8, 0), torch.ones(4, 1, 0), off), TypeError,
         "`a` must be float8_e4m3fn with block scales"),
        ("E too large", (a, torch.zeros(1025, 32, 64, dtype=torch.int8).transpose(1, 2), sa, sb, off), ValueError,
         r"`b` E = b.shape\[0\] must be in \[1, 1024\], got 1025"),
    ]


@pytest.mark.parametrize("case", _errors_cases(), ids=lambda c: c[0])
def test_argument_errors(case):
    _, args, exc, msg = case
    with pytest.raises(exc, match="^grouped_scaled_mm: " + msg):
        OPS.grouped_scaled_mm(*args, torch.bfloat16, None)
    with FakeTensorMode() as mode:  # the fake kernel raises the same
        fake_args = [mode.from_tensor(x) for x in args]
        with pytest.raises(exc, match="^grouped_scaled_mm: " + msg):
            OPS.grouped_scaled_mm(*fake_args, torch.bfloat16, None)


def _opcheck_cases():
    cases = []
    a, b, sa, sb, bias = operands(19, 64, 48, 5, torch.int8, bias=True)
    off = routing(19, 5, "random", torch.Generator().manual_seed(3))
    cases.append(("int8 per-token bias", OPS.grouped_scaled_mm, (a, b, sa, sb, off, torch.bfloat16, bias)))
    a, b, sa, sb, _ = operands(19, 64, 48, 5, FP8, sa_shape="tensor", sb_shape="expert")
    cases.append(("fp8 per-tensor per-expert f16", OPS.grouped_scaled_mm, (a, b, sa, sb, off, torch.float16, None)))
    out = torch.empty(19, 48, dtype=torch.float16)
    cases.append(("out fp8", OPS.grouped_scaled_mm_out, (out, a, b, sa, sb, off, None)))
    a, b, sa, sb, bias = operands(19, 256, 208, 5, FP8, block=True, bias=True)
    cases.append(("block bias", OPS.grouped_scaled_mm, (a, b, sa, sb, off, torch.bfloat16, bias)))
    out = torch.empty(19, 208, dtype=torch.bfloat16)
    cases.append(("config block", OPS._grouped_scaled_mm_config, (out, a, b, sa, sb, off, bias, 2)))
    a, b, sa, sb, _ = operands(0, 64, 48, 5, torch.int8)
    cases.append(("T=0", OPS.grouped_scaled_mm, (a, b, sa, sb, torch.zeros(5, dtype=torch.int32), torch.bfloat16,
                                                  None)))
    return cases


@pytest.mark.parametrize("case", _opcheck_cases(), ids=lambda c: c[0])
def test_opcheck_cpu(case):
    _, op, args = case
    run_opcheck(op, args)


def test_fake_shapes():
    a, b, sa, sb, bias = operands(11, 64, 32, 3, torch.int8, bias=True, out_dtype=torch.float16)
    off = torch.tensor([3, 3, 11], dtype=torch.int32)
    with FakeTensorMode() as mode:
        fa, fb, fsa, fsb, fbias, foff = (mode.from_tensor(x) for x in (a, b, sa, sb, bias, off))
        y = OPS.grouped_scaled_mm(fa, fb, fsa, fsb, foff, torch.float16, fbias)
        assert y.shape == (11, 32) and y.dtype == torch.float16 and y.is_contiguous()
    ma = [x.to("meta") for x in (a, b, sa, sb, off)]
    y = OPS.grouped_scaled_mm(*ma, torch.float16, bias.to("meta"))
    assert y.device.type == "meta" and y.shape == (11, 32)


def test_compile_cpu():
    a, b, sa, sb, bias = operands(13, 64, 32, 4, torch.int8, bias=True)
    off = torch.tensor([2, 2, 9, 13], dtype=torch.int32)
    f = torch.compile(lambda *args: cw.grouped_scaled_mm(*args, torch.bfloat16, bias), fullgraph=True)
    assert torch.equal(f(a, b, sa, sb, off), cw.grouped_scaled_mm(a, b, sa, sb, off, torch.bfloat16, bias))
