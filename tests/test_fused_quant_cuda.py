"""The fused non-GEMM kernels (csrc/quant/rms_norm.cu, silu_mul.cu over rowwise_reduce.cuh) against the CPU references and the unfused chains.

What is compared exactly, and why it can be:

- GPU vs the CPU reference (the torch chain on the CPU), bit for bit, on "exact inputs": random inputs built
  so that no step depends on the order of a float32 sum or on the last bit of an exp or rsqrt, which differ
  between torch's CPU code, its CUDA code and our kernels (see `exact_norm_rows` and `exact_silu_input`).
  The outputs start as poisoned memory (`poison_allocator`), so an element the kernel fails to write shows.
- fused vs the unfused chain on the GPU (``rms_norm_quant == quantize(rms_norm(...))``, ``silu_mul_quant ==
  quantize(silu_mul(...))``), bit for bit on any input: the kernels compute the same y, then quantize it
  with quantize.cu's arithmetic.
- the residual add (``residual += x``), bit for bit on any input: one rounding of an exact sum.
- on general (Gaussian) inputs, GPU vs CPU and vs torch's CUDA ops: y within one unit in the last place of
  its dtype, and equal but for a small fraction of near-ties (the order of the float32 sum of squares and the
  rsqrt / exp implementations differ).
"""

import math

import pytest
import torch
import torch.nn.functional as F

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import ulp

pytestmark = pytest.mark.cuda

DEV = "cuda"
OPS = torch.ops.cutlass_w8a8
QDTYPES = [torch.int8, torch.float8_e4m3fn]
XDTYPES = [torch.bfloat16, torch.float16, torch.float32]
QUANT = {torch.int8: cw.quantize_int8, torch.float8_e4m3fn: cw.quantize_fp8}
EPS = 1e-5
# (quantized dtype or None, static scale or None): the unquantized op, dynamic and static, int8 and fp8
MODES = [(None, None), (torch.int8, None), (torch.int8, 0.05), (torch.float8_e4m3fn, None),
         (torch.float8_e4m3fn, 0.05)]
MODE_IDS = ["float", "int8-dynamic", "int8-static", "fp8-dynamic", "fp8-static"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bits_equal(got, expect, what=""):
    got = got.cpu()
    assert got.shape == expect.shape and got.dtype == expect.dtype, (
        f"{what}: {tuple(got.shape)} {got.dtype} vs {tuple(expect.shape)} {expect.dtype}")
    diff = bits(got) != bits(expect)
    if diff.any():
        idx = tuple(diff.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(diff.sum())} of {diff.numel()} elements differ; first at {list(idx)}: "
                             f"{got[idx].item()!r} vs {expect[idx].item()!r}")


def seed_of(*parts) -> int:
    return sum((i + 1) * hash(str(p)) % 1000003 for i, p in enumerate(parts)) % (2**31)


def poison_allocator(*nbytes, byte=0xFF):
    """Leave blocks of these sizes in the caching allocator filled with `byte`: the op's next allocations of
    those sizes reuse them, so outputs start as garbage instead of (often) zeros. Best effort; with two
    different bytes, an element the kernel does not write differs from the expected value in one of them."""
    torch.cuda.empty_cache()
    blocks = [torch.full((max(int(n), 1),), byte, dtype=torch.uint8, device=DEV) for n in nbytes]
    del blocks


POISON = (0xFF, 0x7E)


def out_bytes(shape, dtype, qdtype):
    """Bytes of the outputs of an op on x of `shape`: y or q, and the scales."""
    n = math.prod(shape)
    rows = n // shape[-1] if shape[-1] else 0
    return [n * (torch.empty(0, dtype=qdtype or dtype).element_size()), rows * 4]


# ----------------------------------------------------------------------------------------------------
# exact inputs


def _four_squares(n: int, cap: int):
    """(a, b, c, d), a >= b >= c >= d >= 0, a <= cap, with a^2 + b^2 + c^2 + d^2 = n; None if there is none."""
    a = min(math.isqrt(n), cap)
    while a >= 0 and n - a * a <= 3 * a * a:
        r1 = n - a * a
        b = min(math.isqrt(r1), a)
        while b >= 0 and r1 - b * b <= 2 * b * b:
            r2 = r1 - b * b
            c = min(math.isqrt(r2), b)
            while c >= 0 and r2 - c * c <= c * c:
                d = math.isqrt(r2 - c * c)
                if d * d == r2 - c * c:
                    return a, b, c, d
                c -= 1
            b -= 1
        a -= 1
    return None


def exact_norm_rows(shape, gen, eps):
    """Random integer rows ``s`` (float64, shape `shape`) with ``sum(s^2) = K * (4**j - eps)`` exactly, j in
    {1, 2, 3} per row (where eight entries of at most 192 can make up the remainder), |s| <= 192. Then in
    float32 the sum of squares is exact in any order (< 2**24), the mean plus eps is 4**j, its rsqrt is 2**-j
    on the CPU and the GPU alike, and ``y = (s * 2**-j) * w`` is one rounding of an exact product: every
    implementation of the chain gives the same bits.
    ``eps * K`` must be an integer (eps = 1/16 with K a multiple of 16, or eps = 0)."""
    k = shape[-1]
    m = math.prod(shape[:-1])
    assert k >= 9 and float(eps * k).is_integer()
    rows = []
    while len(rows) < m:
        j = int(torch.randint(1, 4, (1,), generator=gen))
        target = int(k * (4**j - eps))
        # uniform integers in [-a, a] have E[n^2] = a (a + 1) / 3: the largest a with that <= 0.95 of the mean
        # square leaves a remainder that eight entries of at most 192 can carry (two sums of four squares)
        a = max(1, int((math.sqrt(1 + 12 * 0.95 * (4**j - eps)) - 1) / 2))
        body = torch.randint(-a, a + 1, (k - 8,), generator=gen, dtype=torch.int64)
        rest = target - int((body * body).sum())
        if rest < 0:
            continue
        halves = (_four_squares(rest // 2, 192), _four_squares(rest - rest // 2, 192))
        if None in halves:
            continue
        tail = halves[0] + halves[1]
        signs = torch.randint(0, 2, (8,), generator=gen) * 2 - 1
        row = torch.cat([body, torch.tensor(tail) * signs])
        rows.append(row[torch.randperm(k, generator=gen)])
    return torch.stack(rows).to(torch.float64).reshape(shape)


def exact_y(s, w, eps):
    """The exact y of `exact_norm_rows` rows in w's dtype: (s * 2**-j) * w, one rounding."""
    inv = 1.0 / torch.sqrt((s * s).mean(-1, keepdim=True) + eps)  # exactly 2**-j in float64
    return ((s * inv) * w.double()).to(w.dtype)


def _silu_ambiguous(gate, rel=2.0**-18):
    """Where silu(gate), exactly (float64), is within `rel` of a rounding tie of gate's dtype: there a float32
    silu a few ulps off (CPU vectorized exp vs CUDA expf) may round either way."""
    g = gate.double()
    v = g / (1 + torch.exp(-g))
    return bits((v * (1 - rel)).to(gate.dtype)) != bits((v * (1 + rel)).to(gate.dtype))


def exact_silu_input(shape, dtype, gen):
    """x = [gate | up] in bfloat16 / float16 with no silu(gate) near a rounding tie (resampled until so). The
    product of two such values is exact in float32, so the chain's bits do not depend on the exp used."""
    half = shape[-1] // 2
    gate = (torch.randn(*shape[:-1], half, generator=gen) * 3).to(dtype)
    for _ in range(50):
        amb = _silu_ambiguous(gate)
        if not amb.any():
            break
        gate[amb] = (torch.randn(int(amb.sum()), generator=gen) * 3).to(dtype)
    assert not _silu_ambiguous(gate).any()
    up = (torch.randn(*shape[:-1], half, generator=gen) * 2).to(dtype)
    return torch.cat([gate, up], dim=-1)


# ----------------------------------------------------------------------------------------------------
# RMSNorm (with the residual add), with and without quantization: GPU == CPU on exact inputs


def check_norm_exact(shape, dtype, qdtype, scale, with_residual, layout="contiguous"):
    gen = torch.Generator().manual_seed(seed_of(shape, dtype, qdtype, scale, with_residual, layout))
    k = shape[-1]
    eps = 1.0 / 16 if k % 16 == 0 else 0.0
    s = exact_norm_rows(shape, gen, eps)
    w = (torch.rand(k, generator=gen) * 1.5 + 0.25).to(dtype)
    if with_residual:
        r64 = torch.randint(-32, 33, shape, generator=gen).to(torch.float64)
        x, r = (s - r64).to(dtype), r64.to(dtype)
    else:
        x, r = s.to(dtype), None
    static = torch.tensor([scale]) if scale is not None else None

    # the CPU reference: the torch chain; first check that it computes the exact y the inputs were built for
    y_cpu = F.rms_norm(s.to(dtype), (k,), w, eps)
    assert_bits_equal(y_cpu, exact_y(s, w, eps), "CPU chain vs exact y (the construction)")
    r_cpu = r.clone() if r is not None else None
    if qdtype is None:
        ref = (cw.rms_norm(x, w, eps, r_cpu), None)
    else:
        ref = OPS.rms_norm_quant(x, w, eps, qdtype, static, r_cpu)

    for byte in POISON:
        xd, wd = x.to(DEV), w.to(DEV)
        rd = r.to(DEV, copy=True) if r is not None else None
        if layout == "misaligned":  # one element into wider buffers: the scalar fallback kernels
            xd = torch.cat([torch.zeros(*shape[:-1], 1, dtype=dtype, device=DEV), xd], -1)[..., 1:]
            wd = torch.cat([torch.zeros(1, dtype=dtype, device=DEV), wd])[1:]
            if rd is not None:
                rd = torch.cat([torch.zeros(*shape[:-1], 1, dtype=dtype, device=DEV), rd], -1)[..., 1:]
        sd = static.to(DEV) if static is not None else None
        poison_allocator(*out_bytes(shape, dtype, qdtype), byte=byte)
        if qdtype is None:
            got = (cw.rms_norm(xd, wd, eps, rd), None)
        else:
            got = OPS.rms_norm_quant(xd, wd, eps, qdtype, sd, rd)
        what = f"{shape} {dtype} {qdtype} scale={scale} residual={with_residual} {layout} poison={byte:#x}"
        assert_bits_equal(got[0], ref[0], f"{what}: y / q")
        if qdtype is not None:
            assert_bits_equal(got[1], ref[1], f"{what}: scales")
        if r is not None:
            assert_bits_equal(rd, r_cpu, f"{what}: residual")


NORM_SHAPES = [(1, 16), (7, 4096), (33, 14336), (2, 3, 4096), (2, 24576), (3, 40000), (2, 70000), (5, 100),
               (4, 17), (6, 2064)]


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("dtype", XDTYPES, ids=str)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_rms_norm_exact_vs_cpu(shape, dtype, mode, with_residual):
    """Every kernel path (csrc/quant/rowwise_reduce.cuh, "launch_rowwise"): K = 16, 2064 and 4096 (the decoder's hidden
    size): one block holding the row in registers (1, 2 and 2 vectors per thread); 14336, 24576 and 40000
    (the intermediate size among them): on sm90 a cluster of 8 blocks for bfloat16 / float16 (1, 2 and 4
    vectors per thread), one block for float32 and on older GPUs (512 threads for float32 at 14336); 70000
    (longer than any register kernel holds: the vectorized loop); 100 and 17 (not a multiple of the vector:
    the scalar loop)."""
    check_norm_exact(shape, dtype, mode[0], mode[1], with_residual)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(9, 4096), (3, 14336)], ids=str)
def test_rms_norm_exact_vs_cpu_misaligned(shape, dtype, mode):
    """x, weight and residual starting one element into their buffers: the scalar fallback at large K."""
    check_norm_exact(shape, dtype, mode[0], mode[1], True, layout="misaligned")


# ----------------------------------------------------------------------------------------------------
# SiLU-and-mul, with and without quantization: GPU == CPU on exact inputs


SILU_SHAPES = [(1, 16), (7, 4096), (33, 28672), (5, 14336), (3, 57344), (2, 3, 512), (3, 80000), (2, 140000),
               (5, 100), (4, 2)]


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SILU_SHAPES, ids=str)
def test_silu_mul_exact_vs_cpu(shape, dtype, mode):
    """I = 8 .. 7168: one block holding the row in registers; 14336, 28672, 40000: on sm90 a cluster of 8
    (1, 2 and 4 vectors per thread); 70000: the vectorized loop; 50 and 1: the scalar loop."""
    qdtype, scale = mode
    gen = torch.Generator().manual_seed(seed_of(shape, dtype, qdtype, scale))
    x = exact_silu_input(shape, dtype, gen)
    static = torch.tensor([scale]) if scale is not None else None
    gate, up = x.chunk(2, dim=-1)
    y_chain = F.silu(gate) * up
    exact = (_exact_silu(gate).double() * up.double()).to(dtype)
    assert_bits_equal(y_chain, exact, "CPU chain vs exact y (the construction)")
    ref = (cw.silu_mul(x), None) if qdtype is None else OPS.silu_mul_quant(x, qdtype, static)
    out_shape = (*shape[:-1], shape[-1] // 2)
    for byte in POISON:
        xd = x.to(DEV)
        poison_allocator(*out_bytes(out_shape, dtype, qdtype), byte=byte)
        got = (cw.silu_mul(xd), None) if qdtype is None else OPS.silu_mul_quant(
            xd, qdtype, static.to(DEV) if static is not None else None)
        what = f"{shape} {dtype} {qdtype} scale={scale} poison={byte:#x}"
        assert_bits_equal(got[0], ref[0], f"{what}: y / q")
        if qdtype is not None:
            assert_bits_equal(got[1], ref[1], f"{what}: scales")


def _exact_silu(gate):
    g = gate.double()
    return (g / (1 + torch.exp(-g))).to(gate.dtype)


@pytest.mark.parametrize("shape", [(7, 4096), (3, 28672), (5, 100)], ids=str)
def test_silu_mul_float32_close_to_cpu(shape):
    """float32: the CPU's vectorized exp and CUDA's expf differ in the last bits, so a few float32 ulps."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed_of(shape))) * 3
    torch.testing.assert_close(cw.silu_mul(x.to(DEV)).cpu(), cw.silu_mul(x), rtol=4e-6, atol=0)
    q, s = cw.silu_mul_quant(x.to(DEV), torch.int8)
    q_ref, s_ref = cw.silu_mul_quant(x, torch.int8)
    torch.testing.assert_close(s.cpu(), s_ref, rtol=4e-6, atol=0)
    assert (q.cpu().int() - q_ref.int()).abs().max() <= 1


# ----------------------------------------------------------------------------------------------------
# any input: fused == unfused chain on the GPU; GPU ~ CPU and torch's CUDA ops


def gaussian(shape, dtype, seed, scale=3.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(shape, device=DEV, generator=g) * scale).to(dtype)
    w = (torch.rand(shape[-1], device=DEV, generator=g) + 0.5).to(dtype)
    r = (torch.randn(shape, device=DEV, generator=g) * scale).to(dtype)
    return x, w, r


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("qdtype", QDTYPES, ids=str)
@pytest.mark.parametrize("dtype", XDTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 16), (64, 4096), (16, 14336), (4, 40000), (8, 100), (2, 3, 2048)],
                         ids=str)
def test_fused_equals_the_unfused_chain_on_the_gpu(shape, dtype, qdtype, static):
    x, w, r = gaussian(shape, dtype, seed_of(shape, dtype, qdtype, static))
    scale = torch.tensor([0.04], device=DEV) if static else None
    r1, r2 = r.clone(), r.clone()
    for res1, res2 in ((None, None), (r1, r2)):
        q, s = cw.rms_norm_quant(x, w, EPS, qdtype, scale, res1)
        q_ref, s_ref = QUANT[qdtype](cw.rms_norm(x, w, EPS, res2), scale)
        assert_bits_equal(q, q_ref.cpu(), f"rms_norm_quant residual={res1 is not None}")
        if not static:
            assert_bits_equal(s, s_ref.cpu(), "scales")
    assert_bits_equal(r1, r2.cpu(), "residual")
    assert_bits_equal(r1, (r + x).cpu(), "residual == torch's x + residual")
    xs = x if shape[-1] % 2 == 0 else x[..., :-1]
    q, s = cw.silu_mul_quant(xs, qdtype, scale)
    q_ref, s_ref = QUANT[qdtype](cw.silu_mul(xs), scale)
    assert_bits_equal(q, q_ref.cpu(), "silu_mul_quant")
    if not static:
        assert_bits_equal(s, s_ref.cpu(), "silu_mul_quant scales")


def assert_within_one_ulp(got, ref, dtype, max_fraction, what):
    """Elementwise |got - ref| <= one ulp of dtype (float32: a relative 2**-18, the float32 sums of squares
    being rounded in another order), and unequal at most in `max_fraction` of the elements."""
    got, ref = got.cpu().double(), ref.cpu().double()
    if dtype == torch.float32:
        bound = ref.abs() * 2.0**-18
    else:
        bound = ulp(ref, dtype)
    err = (got - ref).abs()
    assert (err <= bound).all(), f"{what}: max error {float(err.max())} beyond one ulp"
    frac = float((got != ref).double().mean())
    assert frac <= max_fraction, f"{what}: {frac:.2e} of the elements differ (bound {max_fraction:.0e})"


# The differences are near-ties: y whose float32 value is within a few float32 roundings of a tie of the
# dtype. Measured on an H100 (2026-11-23, 64 x 4096 and 16 x 14336): rms_norm differed from torch's CPU and
# CUDA rms_norm in at most 1.5e-5 (bfloat16) and 7e-5 (float16) of the elements, silu_mul from both chains in
# none; float32 rms_norm in 13-27% of them (by an ulp or two). The bounds are loose on purpose: the fraction
# grows with the dtype's precision and the float32 error, not with the seed.
NEAR_TIE_FRACTION = {torch.bfloat16: 2e-3, torch.float16: 1e-2, torch.float32: 1.0}


@pytest.mark.parametrize("dtype", XDTYPES, ids=str)
@pytest.mark.parametrize("shape", [(64, 4096), (16, 14336), (8, 100)], ids=str)
def test_gaussian_inputs_within_one_ulp_of_torch(shape, dtype):
    x, w, r = gaussian(shape, dtype, seed_of("gauss", shape, dtype))
    k = shape[-1]
    y = cw.rms_norm(x, w, EPS)
    for ref, who in ((F.rms_norm(x.cpu(), (k,), w.cpu(), EPS), "CPU"), (F.rms_norm(x, (k,), w, EPS), "CUDA")):
        assert_within_one_ulp(y, ref, dtype, NEAR_TIE_FRACTION[dtype], f"rms_norm vs torch's {who} F.rms_norm")
    gate, up = x[..., : k // 2 * 2].chunk(2, dim=-1)
    h = cw.silu_mul(x[..., : k // 2 * 2])
    for ref, who in (((F.silu(gate.cpu()) * up.cpu()), "CPU"), (F.silu(gate) * up, "CUDA")):
        assert_within_one_ulp(h, ref, dtype, NEAR_TIE_FRACTION[dtype], f"silu_mul vs torch's {who} chain")


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
