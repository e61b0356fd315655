"""Block-scaled fp8 on the CPU (issue 26): the block GEMM's reference against a float64 reference of the
dequantized operands, quantize_per_token_group's rules, every refusal with the contract's exact message
(the spec's text, independent of docs/MISUSE.md), the fused ops with group_size=128, and the block-scaled
W8A8Linear (from_float, from_quantized, quantize_, dtype casts, state_dict, fusing, torch.compile).

The format (DeepSeek-V3, Qwen3-FP8, compressed-tensors FP8_BLOCK): e4m3 weight (N, K) with one float32 scale
per 128 x 128 block, (ceil(N/128), K/128), N-major; e4m3 activations with one scale per 1 x 128 group along K,
(M, K/128). The CUDA side is tests/gemm/test_block_fp8_cuda.py.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

import cutlass_w8a8 as cw
from cutlass_w8a8.distributed import fuse_w8a8
from cutlass_w8a8.linear import quantize_weight_blocks
from cutlass_w8a8.ops._roles import block_scaled
from cutlass_w8a8.testing.references import EPS32, assert_within, rand_operand, rand_scale, scale_magnitudes, ulp

OPS = torch.ops.cutlass_w8a8
FP8 = torch.float8_e4m3fn
BLOCK = cw.BLOCK_SIZE
QMAX = {torch.int8: 127.0, FP8: 448.0}
BLOCK_CFG = cw.W8A8Config(dtype=FP8, weight_block_size=(128, 128))


def nblocks(v: int) -> int:
    return -(-v // BLOCK)


def block_operands(m, n, k, seed=0, bias=True, out_dtype=torch.bfloat16):
    """Random block-scaled operands: a (M, K) e4m3, b = w.t() (K, N) with w (N, K) e4m3, scale_a (M, K/128),
    scale_b (ceil(N/128), K/128) float32 with values spread over [0.5, 1.5) x magnitude, bias (N,) or None."""
    g = torch.Generator().manual_seed(seed)
    a, w = rand_operand((m, k), FP8, "cpu", g), rand_operand((n, k), FP8, "cpu", g)
    ma, mb = scale_magnitudes(FP8, k)
    sa = rand_scale((m, k // BLOCK), "cpu", ma, g)
    sb = rand_scale((nblocks(n), k // BLOCK), "cpu", mb, g)
    b = torch.randn(n, generator=g).to(out_dtype) if bias else None
    return a, w.t(), sa, sb, b


def dequantized_reference(a, b, scale_a, scale_b, bias):
    """(D, bound terms) in float64 from the dequantized operands, by the format's definition:
    a[m, k] * sa[m, k // 128] and w[n, k] * sb[n // 128, k // 128]."""
    m, k = a.shape
    n = b.shape[1]
    sa = scale_a.double().repeat_interleave(BLOCK, dim=1)  # (M, K)
    sb = scale_b.double().repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1)  # (N, K)
    a_deq, w_deq = a.double() * sa, b.t().double() * sb
    d = a_deq @ w_deq.t()
    mag = d.abs()
    if bias is not None:
        d = d + bias.double()
        mag = mag + bias.double().abs()
    return d, mag, a_deq.abs() @ w_deq.abs().t()


def assert_block_close(out, a, b, scale_a, scale_b, bias, what=""):
    """|out - D| <= ulp(out dtype) + (K/128 + 4) eps32 sum|terms| + 2 eps32 |D|: one rounding to the output
    dtype; each 128-long partial rounded to float32 (exact products, one rounding), times the float32 product
    of the two scales (two roundings), summed over K/128 partials in float32 (one rounding each), the bias add
    in float32 (one more)."""
    d, mag, abs_terms = dequantized_reference(a, b, scale_a, scale_b, bias)
    o = out.double()
    assert not torch.isnan(o).any(), what
    kb = a.shape[1] // BLOCK
    bound = torch.maximum(ulp(d, out.dtype), ulp(o, out.dtype)) + (kb + 4) * EPS32 * abs_terms + 2 * EPS32 * mag
    assert_within(o, d, bound, what, "(m, n) = ")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def assert_bits_equal(x, y, what=""):
    assert x.dtype == y.dtype and x.shape == y.shape, (what, x.dtype, y.dtype, x.shape, y.shape)
    assert torch.equal(bits(x), bits(y)), what


def raises_exactly(exc, message, fn):
    """`fn()` raises `exc` whose message is exactly `message` (the contract's text)."""
    with pytest.raises(exc) as info:
        fn()
    assert str(info.value) == message


# ---- the block GEMM ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 7, 16, 100])
@pytest.mark.parametrize("n,k", [(208, 384), (256, 128), (16, 256), (384, 1024)])
@pytest.mark.parametrize("bias", [True, False])
def test_block_scaled_mm_matches_fp64_reference(m, n, k, bias):
    a, b, sa, sb, bias_t = block_operands(m, n, k, seed=m * 7 + n + k, bias=bias)
    assert block_scaled(a, b, sa, sb) or (k == BLOCK and n <= BLOCK)
    out = cw.scaled_mm(a, b, sa, sb, torch.bfloat16, bias_t)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert_block_close(out, a, b, sa, sb, bias_t, f"block scaled_mm M={m} N={n} K={k}")


def test_block_scaled_mm_float16_out_and_out_variants():
    a, b, sa, sb, bias = block_operands(12, 208, 384, seed=3, out_dtype=torch.float16)
    y = cw.scaled_mm(a, b, sa, sb, torch.float16, bias)
    assert_block_close(y, a, b, sa, sb, bias, "float16 out")
    out = torch.empty(12, 208, dtype=torch.float16)
    assert cw.scaled_mm(a, b, sa, sb, bias=bias, out=out) is out
    assert torch.equal(out, y)
    # the decode GEMM's CPU implementation is the same reference (M <= 16)
    assert torch.equal(cw.scaled_mm_decode(a, b, sa, sb, torch.float16, bias), y)
    d = torch.empty(12, 208, dtype=torch.float16)
    OPS._scaled_mm_config(d, a, b, sa, sb, bias, 0)
    assert torch.equal(d, y)


def test_block_scales_are_applied_per_block():
    """Each (row block, K block) scale multiplies exactly its 128 x 128 block: with unit operands and scales that
    are distinct powers of two, out[m, n] = sum_kb 128 sa[m, kb] sb[n // 128, kb], exactly."""
    m, n, k = 3, 208, 384
    a = torch.ones(m, k).to(FP8)
    w = torch.ones(n, k).to(FP8)
    sa = torch.tensor([[1.0, 2.0, 4.0], [0.5, 0.25, 0.125], [8.0, 1.0, 0.0]])
    sb = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]]) / 128  # exact sums, in float16's range
    out = cw.scaled_mm(a, w.t(), sa, sb, torch.float16)
    expect = torch.empty(m, n, dtype=torch.float64)
    for i in range(m):
        for j in range(n):
            expect[i, j] = sum(128 * sa[i, kb].item() * sb[j // 128, kb].item() for kb in range(3))
    assert torch.equal(out.double(), expect)


def test_block_detection_rule():
    """The one rule (ops/_roles.py block_scaled, csrc/core/checks is_block_scaled): 2-D scale_a with more than
    one column, or scale_b (ceil(N/128), ceil(K/128)) with more than one element and not (N, 1) / (1, N)."""
    def t(*shape):
        return torch.ones(*shape)

    a, b = t(4, 256).to(FP8), t(208, 256).to(FP8).t()
    assert block_scaled(a, b, t(4, 2), t(2, 2))
    assert block_scaled(a, b, t(4, 2), t(208))          # scale_a decides; scale_b's shape then fails the checks
    assert block_scaled(a, b, t(4, 1), t(2, 2))         # scale_b decides
    assert not block_scaled(a, b, t(4, 1), t(208, 1))    # per-token x per-channel
    assert not block_scaled(a, b, t(1), t(1))
    a1, b1 = t(4, 128).to(FP8), t(208, 128).to(FP8).t()
    assert block_scaled(a1, b1, t(4, 1), t(2, 1))       # K = 128: one K block, two row blocks
    a2, b2 = t(4, 128).to(FP8), t(96, 128).to(FP8).t()
    assert not block_scaled(a2, b2, t(4, 1), t(1, 1))    # one block: per-token x per-tensor, the same product
    a3, b3 = t(4, 256).to(FP8), t(16, 256).to(FP8).t()
    assert block_scaled(a3, b3, t(4, 1), t(1, 2))       # (1, 2) is not (1, N) = (1, 16)
    assert not block_scaled(a[None], b, t(4, 2), t(2, 2))  # not 2-D: the 2-D check reports it


def test_single_block_rowwise_equals_block_reference():
    """K = 128 and N <= 128: the rule calls (M, 1) x (1, 1) row-wise, and the row-wise GEMM is the block GEMM's
    product to float32 rounding."""
    a, b, sa, sb, bias = block_operands(9, 96, 128, seed=11)
    assert not block_scaled(a, b, sa, sb)
    assert_block_close(cw.scaled_mm(a, b, sa, sb, torch.bfloat16, bias), a, b, sa, sb, bias, "one block")


@pytest.mark.parametrize("m", [0, 5])
def test_block_fake_kernels(m):
    a, b, sa, sb, bias = block_operands(m, 208, 384)
    meta = [t.to("meta") for t in (a, b, sa, sb, bias)]
    out = OPS.scaled_mm(*meta[:4], torch.bfloat16, meta[4])
    assert out.shape == (m, 208) and out.dtype == torch.bfloat16 and out.device.type == "meta"
    q, s = OPS.quantize_per_token_group(torch.empty(m, 384, device="meta"), 128, FP8)
    assert q.shape == (m, 384) and q.dtype == FP8 and s.shape == (m, 3) and s.dtype == torch.float32
    with pytest.raises(ValueError, match="multiple of 128"):
        OPS.scaled_mm(meta[0][:, :144], meta[1][:144], meta[2][:, :2], meta[3][:, :2], torch.bfloat16, None)
    y = OPS.w8a8_linear(torch.empty(2, m, 384, device="meta"), meta[1].t(), meta[3], None, None, torch.float16)
    assert y.shape == (2, m, 208) and y.dtype == torch.float16


# ---- quantize_per_token_group --------------------------------------------------------------------------------


def group_input(m, k, dtype, seed=0):
    """Rows whose 128-groups have very different magnitudes (1e-3 .. 1e3), so a per-row scale would not do."""
    g = torch.Generator().manual_seed(seed)
    mags = 10.0 ** torch.randint(-3, 4, (m, k // BLOCK), generator=g).float()
    return (torch.randn(m, k, generator=g) * mags.repeat_interleave(BLOCK, dim=1)).to(dtype)


@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("qdtype", [FP8, torch.int8])
def test_group_scale_is_group_absmax_over_qmax(xdtype, qdtype):
    x = group_input(6, 512, xdtype, seed=1)
    q, s = cw.quantize_per_token_group(x, 128, qdtype)
    assert q.shape == x.shape and q.dtype == qdtype and q.is_contiguous()
    assert s.shape == (6, 4) and s.dtype == torch.float32 and s.is_contiguous()
    amax = x.float().view(6, 4, BLOCK).abs().amax(-1)
    assert torch.equal(s, amax / torch.full_like(amax, QMAX[qdtype]))  # IEEE division, as the kernels
    # the largest element of each group maps to +-QMAX
    assert torch.equal(q.float().view(6, 4, BLOCK).abs().amax(-1), torch.full((6, 4), QMAX[qdtype]))


@pytest.mark.parametrize("qdtype", [FP8, torch.int8])
def test_group_is_per_token_on_each_group(qdtype):
    """Bit for bit quantize_per_token applied to each 128-column slice: the per-token rules per group."""
    x = group_input(5, 384, torch.bfloat16, seed=2)
    q, s = OPS.quantize_per_token_group(x, 128, qdtype)
    for g in range(3):
        qg, sg = OPS.quantize_per_token(x[:, g * BLOCK:(g + 1) * BLOCK], qdtype)
        assert_bits_equal(q[:, g * BLOCK:(g + 1) * BLOCK], qg, f"group {g}")
        assert torch.equal(s[:, g:g + 1], sg)


def test_group_zeros_get_scale_zero():
    x = group_input(3, 384, torch.bfloat16, seed=3)
    x[0, 128:256] = 0  # one zero group
    x[2] = 0           # a zero row
    q, s = cw.quantize_per_token_group(x)
    assert s[0, 1] == 0 and s[2].eq(0).all() and s[0, 0] > 0 and s[0, 2] > 0 and s[1].gt(0).all()
    assert q[0, 128:256].float().eq(0).all() and q[2].float().eq(0).all()
    assert not torch.isnan(q.float()).any()


@pytest.mark.parametrize("qdtype", [FP8, torch.int8])
def test_group_round_trip_error(qdtype):
    """|x - q * s| per element: int8 within s / 2 (round to nearest); e4m3 within 2**-4 |x| (3 mantissa bits,
    round to nearest) or 2**-10 s (half the subnormal spacing 2**-9, in units of s); plus the float32
    rounding of x / s (2**-24 relative)."""
    x = group_input(8, 1024, torch.float32, seed=4)
    q, s = cw.quantize_per_token_group(x, 128, qdtype)
    sf = s.double().repeat_interleave(BLOCK, dim=1)
    err = (x.double() - q.double() * sf).abs()
    if qdtype == torch.int8:
        bound = sf / 2 + 2.0 ** -23 * x.double().abs()
    else:
        bound = torch.maximum(2.0 ** -4 * x.double().abs(), 2.0 ** -10 * sf) + 2.0 ** -23 * x.double().abs()
    assert_within(err, torch.zeros_like(err), bound, f"round trip {qdtype}")


def test_group_layouts():
    """(..., K) inputs, padded rows, a transposed (non-contiguous) input and M = 0: the per-row rules hold and
    the outputs are contiguous."""
    x = group_input(6, 512, torch.bfloat16, seed=5)
    q_ref, s_ref = cw.quantize_per_token_group(x[:, 128:384].contiguous())
    q, s = cw.quantize_per_token_group(x[:, 128:384])  # padded rows (stride 512)
    assert_bits_equal(q, q_ref) and torch.equal(s, s_ref)
    q3, s3 = cw.quantize_per_token_group(x.view(2, 3, 512))
    q2, s2 = cw.quantize_per_token_group(x)
    assert q3.shape == (2, 3, 512) and s3.shape == (2, 3, 4)
    assert_bits_equal(q3.view(6, 512), q2) and torch.equal(s3.view(6, 4), s2)
    xt = x.t().contiguous().t()
    qt, st = cw.quantize_per_token_group(xt)
    assert qt.is_contiguous() and torch.equal(st, s2) and torch.equal(bits(qt), bits(q2))
    q0, s0 = cw.quantize_per_token_group(torch.empty(0, 256))
    assert q0.shape == (0, 256) and s0.shape == (0, 2)


# ---- refusals: the contract's exact messages -----------------------------------------------------------------


def test_scaled_mm_block_refusals_in_order():
    a, b, sa, sb, _ = block_operands(4, 208, 256)
    i8a, i8b = torch.zeros(4, 256, dtype=torch.int8), torch.zeros(208, 256, dtype=torch.int8).t()
    for op in ("scaled_mm", "scaled_mm_decode"):
        f = cw.scaled_mm if op == "scaled_mm" else cw.scaled_mm_decode
        # 1. int8 with block scales (before the shape checks, with every scale shape wrong too)
        raises_exactly(TypeError, f"{op}: `a` must be float8_e4m3fn with block scales (scale_a [M, K/128], scale_b "
                       "[ceil(N/128), K/128]), got torch.int8", lambda: f(i8a, i8b, sa, sb[:1]))
        # 2. K not a multiple of 128 (before the scale shapes)
        a144, b144 = a[:, :144].contiguous(), b.t()[:, :144].contiguous().t()
        raises_exactly(ValueError, f"{op}: `a` K = a.shape[1] must be a multiple of 128 with block scales, got 144",
                       lambda: f(a144, b144, sa[:, :1].repeat(1, 3), sb))
        # 3. scale_a, then 4. scale_b
        raises_exactly(ValueError, f"{op}: `scale_a` must be [M, K/128] = [4, 2] (1x128 groups) with block scales, "
                       "got shape (4, 1)", lambda: f(a, b, sa[:, :1].contiguous(), sb))
        raises_exactly(ValueError, f"{op}: `scale_a` must be [M, K/128] = [4, 2] (1x128 groups) with block scales, "
                       "got shape (3, 2)", lambda: f(a, b, sa[:3], sb))
        raises_exactly(ValueError, f"{op}: `scale_b` must be [ceil(N/128), K/128] = [2, 2] (128x128 blocks) with "
                       "block scales, got shape (1, 2)", lambda: f(a, b, sa, sb[:1]))
        raises_exactly(ValueError, f"{op}: `scale_b` must be [ceil(N/128), K/128] = [2, 2] (128x128 blocks) with "
                       "block scales, got shape (208,)", lambda: f(a, b, sa, torch.ones(208)))
        # 5. contiguity: the existing message
        raises_exactly(ValueError, f"{op}: `scale_a` must be contiguous",
                       lambda: f(a, b, torch.ones(2, 4).t(), sb))
    out = torch.empty(4, 208, dtype=torch.bfloat16)
    raises_exactly(ValueError, "scaled_mm: `scale_b` must be [ceil(N/128), K/128] = [2, 2] (128x128 blocks) with "
                   "block scales, got shape (2, 1)", lambda: cw.scaled_mm(a, b, sa, sb[:, :1].contiguous(), out=out))


def test_quantize_per_token_group_refusals():
    x = torch.zeros(4, 256)
    raises_exactly(ValueError, "quantize_per_token_group: `group_size` must be 128, got 64",
                   lambda: cw.quantize_per_token_group(x, 64))
    raises_exactly(ValueError, "quantize_per_token_group: `x` K = x.shape[1] must be a multiple of group_size = 128, "
                   "got 144", lambda: cw.quantize_per_token_group(torch.zeros(4, 144)))
    raises_exactly(TypeError, "quantize_per_token_group: `dtype` must be torch.int8 or torch.float8_e4m3fn, got "
                   "torch.float16", lambda: cw.quantize_per_token_group(x, 128, torch.float16))
    raises_exactly(TypeError, "quantize_per_token_group: `x` must be bfloat16, float16 or float32, got torch.int32",
                   lambda: cw.quantize_per_token_group(x.int()))


def test_w8a8_linear_block_refusals():
    _, b, _, sb, _ = block_operands(4, 208, 256)
    w, x = b.t(), torch.zeros(4, 256, dtype=torch.bfloat16)
    raises_exactly(ValueError, "w8a8_linear: `input_scale` must be None with block weight scales (activations are "
                   "quantized per 1x128 group at run time), got a tensor",
                   lambda: OPS.w8a8_linear(x, w, sb, torch.ones(1), None, torch.bfloat16))
    raises_exactly(ValueError, "w8a8_linear: `weight` K = weight.shape[1] must be a multiple of 128 with block "
                   "scales, got 144",
                   lambda: OPS.w8a8_linear(x[:, :144], w[:, :144].contiguous(), sb, None, None, torch.bfloat16))
    # an int8 weight with a block-shaped scale is not block-scaled: the row-wise shape message
    raises_exactly(ValueError, "w8a8_linear: `weight_scale` must hold 1 (per-tensor) or N = 208 (per-channel: (N,), "
                   "(N, 1) or (1, N)) values, got shape (2, 2)",
                   lambda: OPS.w8a8_linear(x, w.view(torch.int8), sb, None, None, torch.bfloat16))


@pytest.mark.parametrize("op", ["rms_norm_quant", "silu_mul_quant"])
def test_fused_group_refusals(op):
    x, w = torch.zeros(4, 256, dtype=torch.bfloat16), torch.ones(256, dtype=torch.bfloat16)

    def call(x, scale=None, group_size=128):
        if op == "rms_norm_quant":
            return cw.rms_norm_quant(x, w[: x.shape[-1]], 1e-5, FP8, scale, group_size=group_size)
        return cw.silu_mul_quant(x, FP8, scale, group_size=group_size)

    call(x)  # legal
    raises_exactly(ValueError, f"{op}: `group_size` must be 0 (per-token) or 128, got 64", lambda: call(x, None, 64))
    raises_exactly(ValueError, f"{op}: `scale` must be None with group_size = 128 (dynamic per-group scales), got a "
                   "tensor", lambda: call(x, torch.ones(1)))
    row = 192 if op == "rms_norm_quant" else 96  # x (4, 192): the norm's rows, or silu_mul's halves
    raises_exactly(ValueError, f"{op}: `x` the output row length {row} must be a multiple of group_size = 128",
                   lambda: call(x[:, :192]))


def test_config_and_layer_refusals():
    raises_exactly(ValueError, "W8A8Config: `weight_block_size` must be None or (128, 128), got (128, 64)",
                   lambda: cw.W8A8Config(dtype=FP8, weight_block_size=(128, 64)))
    raises_exactly(ValueError, "W8A8Config: `weight_block_size` needs dtype=torch.float8_e4m3fn (block scales are "
                   "fp8 only), got dtype torch.int8", lambda: cw.W8A8Config(weight_block_size=(128, 128)))
    assert cw.W8A8Config(dtype=FP8, weight_block_size=[128, 128]).weight_block_size == (128, 128)
    with pytest.raises(ValueError, match="`in_features` must be a multiple of 128"):
        cw.W8A8Linear.from_float(nn.Linear(144, 32), BLOCK_CFG)
    with pytest.raises(ValueError, match="`static_input_scale` must be False"):
        cw.W8A8Linear.from_float(nn.Linear(256, 32), BLOCK_CFG, input_scale=torch.tensor(0.1))


# ---- the fused ops with group_size=128 -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quant_group_is_the_chain(dtype, with_residual):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 3, 384, generator=g).to(dtype)
    w = torch.randn(384, generator=g).to(dtype)
    r = torch.randn(2, 3, 384, generator=g).to(dtype) if with_residual else None
    r2 = r.clone() if with_residual else None
    q, s = cw.rms_norm_quant(x, w, 1e-5, FP8, None, r, group_size=128)
    y = cw.rms_norm(x, w, 1e-5, r2)
    q_ref, s_ref = cw.quantize_per_token_group(y)
    assert s.shape == (2, 3, 3)
    assert_bits_equal(q, q_ref, "rms_norm_quant group")
    assert torch.equal(s, s_ref)
    if with_residual:
        assert torch.equal(r, r2)


def test_silu_mul_quant_group_is_the_chain():
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    for qdtype in (FP8, torch.int8):
        q, s = cw.silu_mul_quant(x, qdtype, group_size=128)
        q_ref, s_ref = cw.quantize_per_token_group(cw.silu_mul(x), 128, qdtype)
        assert s.shape == (5, 2)
        assert_bits_equal(q, q_ref, f"silu_mul_quant group {qdtype}")
        assert torch.equal(s, s_ref)


# ---- W8A8Linear with block scales ----------------------------------------------------------------------------


def float_linear(k=512, n=336, bias=True, seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias).to(dtype)


def test_from_float_quantizes_each_block():
    lin = float_linear(384, 208)
    with torch.no_grad():
        lin.weight[128:, 256:] = 0  # a zero block (the partial row block's last K block)
    mod = cw.W8A8Linear.from_float(lin, BLOCK_CFG)
    assert mod.weight.dtype == FP8 and mod.weight.shape == (208, 384)
    assert mod.weight_scale.dtype == torch.float32 and mod.weight_scale.shape == (2, 3)
    assert mod.weight_block_size == (128, 128) and mod.group_size == 128 and mod.input_scale is None
    assert not mod.per_channel
    w = lin.weight.float()
    for i in range(2):
        for j in range(3):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert mod.weight_scale[i, j] == blk.abs().amax() / torch.tensor(448.0)
    assert mod.weight_scale[1, 2] == 0 and mod.weight[128:, 256:].float().eq(0).all()
    deq = mod.weight.double() * mod.weight_scale.double().repeat_interleave(128, 0)[:208].repeat_interleave(128, 1)
    err = (deq - w.double()).abs()
    sf = mod.weight_scale.double().repeat_interleave(128, 0)[:208].repeat_interleave(128, 1)
    assert_within(err, torch.zeros_like(err), torch.maximum(2.0 ** -4 * w.double().abs(), 2.0 ** -10 * sf)
                  + 2.0 ** -23 * w.double().abs(), "block weight round trip")
    # the helper on its own: any (N, K), partial blocks on both axes
    q, s = quantize_weight_blocks(torch.randn(200, 300))
    assert q.shape == (200, 300) and s.shape == (2, 3) and q.dtype == FP8


@pytest.mark.parametrize("bias", [True, False])
def test_block_forward_is_group_quantization_then_block_gemm(bias):
    lin = float_linear(bias=bias, seed=1)
    mod = cw.W8A8Linear.from_float(lin, BLOCK_CFG)
    x = torch.randn(2, 9, 512, dtype=torch.bfloat16)
    y = mod(x)
    assert y.shape == (2, 9, 336) and y.dtype == torch.bfloat16
    q, s = cw.quantize_per_token_group(x.reshape(-1, 512))
    chain = cw.scaled_mm(q, mod.weight.t(), s, mod.weight_scale, torch.bfloat16, mod.bias)
    assert torch.equal(y.reshape(-1, 336), chain)
    qa = mod.quantize_input(x)
    assert qa.scale.shape == (2, 9, 4) and qa.q.shape == (2, 9, 512)
    assert torch.equal(mod(qa), y)
    assert_block_close(y.reshape(-1, 336), q, mod.weight.t(), s, mod.weight_scale, mod.bias, "W8A8Linear block")


# SQNR of a block-scaled fp8 layer against its float layer (random bf16 Linear(512, 336), x ~ N(0, 1)): measured
# 28.6-28.9 dB over three seeds (rowwise fp8 28.6-28.8, int8 per-channel 41). 26 dB holds 2.6 dB under the lowest.
BLOCK_SQNR_DB = 26.0


def sqnr_db(y, ref):
    return (10 * torch.log10(ref.pow(2).mean() / (y.float() - ref).pow(2).mean())).item()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_layer_sqnr_against_float(seed):
    lin = float_linear(seed=seed)
    x = torch.randn(4, 9, 512, dtype=torch.bfloat16)
    y_float = lin(x).float()
    block = cw.W8A8Linear.from_float(lin, BLOCK_CFG)
    rowwise = cw.W8A8Linear.from_float(lin, cw.W8A8Config(dtype=FP8))
    s_block, s_row = sqnr_db(block(x), y_float), sqnr_db(rowwise(x), y_float)
    assert s_block >= BLOCK_SQNR_DB, f"block SQNR {s_block:.2f} dB"
    assert s_block >= s_row - 0.5, f"block {s_block:.2f} dB vs rowwise fp8 {s_row:.2f} dB"


@pytest.mark.parametrize("config", [BLOCK_CFG, cw.W8A8Config(dtype=FP8), cw.W8A8Config()],
                         ids=["block", "rowwise-fp8", "int8"])
def test_dtype_casts_keep_fp8_weight_and_float32_scales(config):
    """Casts never touch the 8-bit weight or the float32 scales, a cast to the layer's own dtype included
    (``.to(torch.bfloat16)`` on a bf16 layer used to cast both: the module's dtype probe saw no change)."""
    mod = cw.W8A8Linear.from_float(float_linear(384, 208), config)
    w, ws = mod.weight.clone(), mod.weight_scale.clone()
    x = torch.randn(3, 384, dtype=torch.bfloat16)
    for cast in (lambda m: m.half(), lambda m: m.to(torch.float16), lambda m: m.bfloat16(),
                 lambda m: m.to(torch.bfloat16), lambda m: m.float(), lambda m: m.to("cpu", torch.float16),
                 lambda m: nn.Sequential(m).to(torch.bfloat16)[0]):
        mod = cast(mod)
        assert mod.weight.dtype == config.dtype and torch.equal(bits(mod.weight), bits(w))
        assert mod.weight_scale.dtype == torch.float32 and torch.equal(mod.weight_scale, ws)
        assert mod.bias.dtype == mod.dtype
        assert mod(x).dtype == torch.bfloat16


def test_block_state_dict_round_trip():
    mod = cw.W8A8Linear.from_float(float_linear(384, 208, seed=3), BLOCK_CFG)
    sd = mod.state_dict()
    assert set(sd) == {"weight", "weight_scale", "bias"}
    assert sd["weight_scale"].shape == (2, 3) and sd["weight_scale"].dtype == torch.float32
    buf = io.BytesIO()
    torch.save(sd, buf)
    fresh = cw.W8A8Linear(384, 208, quant_dtype=FP8, weight_block_size=(128, 128))
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    x = torch.randn(5, 384, dtype=torch.bfloat16)
    assert torch.equal(fresh(x), mod(x))
    # bf16 scales (Qwen3-FP8's weight_scale_inv) load as float32, exactly
    sd16 = dict(sd, weight_scale=sd["weight_scale"].bfloat16())
    fresh.load_state_dict(sd16)
    assert fresh.weight_scale.dtype == torch.float32
    assert torch.equal(fresh.weight_scale, sd["weight_scale"].bfloat16().float())
    with pytest.raises(RuntimeError, match=r"`weight_scale` must be \[ceil\(N/128\), K/128\] = \[2, 3\]"):
        fresh.load_state_dict(dict(sd, weight_scale=torch.ones(208, 1)))
    assert "weight_block_size=(128, 128)" in repr(mod) and "per-group (1x128)" in repr(mod)


def test_from_quantized_block_scales():
    mod = cw.W8A8Linear.from_float(float_linear(384, 208, seed=4), BLOCK_CFG)
    x = torch.randn(3, 384, dtype=torch.bfloat16)
    again = cw.W8A8Linear.from_quantized(mod.weight, mod.weight_scale.double(), mod.bias)
    assert again.weight_block_size == (128, 128) and again.weight_scale.dtype == torch.float32
    assert again.weight is mod.weight  # no copy
    assert torch.equal(again(x), mod(x))
    # one block (N <= 128, K = 128): told from the shape it is per-tensor (the same product); named, it is a block
    w1, s1 = quantize_weight_blocks(torch.randn(96, 128))
    assert s1.shape == (1, 1)
    assert cw.W8A8Linear.from_quantized(w1, s1).weight_block_size is None
    one = cw.W8A8Linear.from_quantized(w1, s1, weight_block_size=(128, 128))
    assert one.weight_block_size == (128, 128) and one.weight_scale.shape == (1, 1)
    x1 = torch.randn(4, 128, dtype=torch.bfloat16)
    assert torch.equal(one(x1), cw.W8A8Linear.from_quantized(w1, s1)(x1))


def test_quantize_with_block_config_leaves_k_not_128_in_float():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(256, 208), nn.ReLU(), nn.Linear(208, 256), nn.Linear(256, 48)).bfloat16()
    with pytest.warns(UserWarning) as record:
        cw.quantize_(model, BLOCK_CFG)
    messages = [str(w.message) for w in record if "leaving" in str(w.message)]
    assert len(messages) == 1 and "'2'" in messages[0] and "in_features=208 must be a multiple of 128" in messages[0]
    assert isinstance(model[0], cw.W8A8Linear) and model[0].weight_block_size == (128, 128)
    assert type(model[2]) is nn.Linear
    assert isinstance(model[3], cw.W8A8Linear) and model[3].weight_scale.shape == (1, 2)  # N = 48: one row block
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    assert model(x).shape == (3, 48)


def test_fused_norm_feeds_block_layer():
    """rms_norm_quant(..., group_size=layer.group_size) gives the layer what it would quantize itself."""
    mod = cw.W8A8Linear.from_float(float_linear(384, 208, seed=6), BLOCK_CFG)
    h = torch.randn(2, 4, 384, dtype=torch.bfloat16)
    w = torch.randn(384, dtype=torch.bfloat16)
    qa = cw.QuantizedActivation(*cw.rms_norm_quant(h, w, 1e-5, mod.quant_dtype, mod.input_scale,
                                                   group_size=mod.group_size))
    assert torch.equal(mod(qa), mod(cw.rms_norm(h, w, 1e-5)))
    with pytest.raises(ValueError, match=r"`scale` must have shape \(2, 4, 3\) \(one per 1x128 group"):
        mod(cw.QuantizedActivation(*cw.rms_norm_quant(h, w, 1e-5, mod.quant_dtype)))


def test_fuse_block_layers():
    """Stacking block layers along N keeps each layer's blocks when every N but the last is a multiple of 128:
    the fused layer's outputs are the layers' outputs, bit for bit."""
    torch.manual_seed(7)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    q, k, v = (cw.W8A8Linear.from_float(nn.Linear(256, n).bfloat16(), BLOCK_CFG) for n in (256, 128, 80))
    fused, sizes = fuse_w8a8([q, k, v])
    assert sizes == [256, 128, 80] and fused.weight_block_size == (128, 128) and fused.weight_scale.shape == (4, 2)
    assert torch.equal(fused(x), torch.cat([q(x), k(x), v(x)], dim=-1))
    # a part other than the last with N not a multiple of 128 would share a row block with the next: refused
    with pytest.raises(ValueError, match="N = 80, not a multiple of 128"):
        fuse_w8a8([v, k])
    with pytest.raises(ValueError, match="block-scaled"):
        fuse_w8a8([q, cw.W8A8Linear.from_float(nn.Linear(256, 128).bfloat16(), cw.W8A8Config(dtype=FP8))])
    a, b = (cw.W8A8Linear.from_float(nn.Linear(128, 48).bfloat16(), BLOCK_CFG) for _ in range(2))
    with pytest.raises(ValueError, match="N = 48"):
        fuse_w8a8([a, b])


@torch.no_grad()
def test_torch_compile_fullgraph_block_layer():
    """A block-scaled layer (float input, and a QuantizedActivation from rms_norm_quant with group_size) traces
    into one graph and, run by aot_eager, equals eager bitwise."""
    mod = cw.W8A8Linear.from_float(float_linear(384, 208, seed=8), BLOCK_CFG)
    w = torch.randn(384, dtype=torch.bfloat16)

    def f(x):
        y = mod(x)
        q, s = cw.rms_norm_quant(x, w, 1e-5, FP8, None, group_size=128)
        return y, mod(cw.QuantizedActivation(q, s))

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in (3, 3, 7):
            x = torch.randn(m, 384, dtype=torch.bfloat16)
            for got, expect in zip(compiled(x), f(x)):
                assert torch.equal(got, expect)
