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

import pytest
import torch
import torch.nn.functional as F

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import ulp

from _fused_quant_cuda import (
    DEV, EPS, MODE_IDS, MODES, OPS, POISON, QDTYPES, QUANT, XDTYPES, assert_bits_equal, exact_norm_rows,
    exact_silu_input, exact_y, gaussian, out_bytes, poison_allocator, seed_of)

pytestmark = pytest.mark.cuda


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

