"""Shared test helpers: random operands, the float64 reference from dequantized operands, tolerances."""

from __future__ import annotations

import torch

# Mantissa bits of the output dtypes (for one unit in the last place).
_MANTISSA = {torch.bfloat16: 7, torch.float16: 10}
_MIN_EXP = {torch.bfloat16: -126, torch.float16: -14}
EPS32 = 2.0 ** -24  # unit roundoff of float32


def rand_operand(shape, dtype, device, generator=None):
    """Random 8-bit operand: int8 uniform over [-128, 127]; fp8 from N(0, 1) (clipped to e4m3 range)."""
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, dtype=torch.int8, device=device, generator=generator)
    x = torch.randn(shape, device=device, generator=generator).clamp(-448, 448)
    return x.to(dtype)


def rand_scale(shape, device, magnitude, generator=None):
    """Positive float32 scales in [0.5, 1.5) * magnitude."""
    return (torch.rand(shape, device=device, generator=generator) + 0.5) * magnitude


def scale_magnitudes(dtype, k):
    """Scales that keep |D| around 1..10 for random operands of depth k."""
    typical = 74.0 * 74.0 if dtype == torch.int8 else 1.0  # E|a*b| of the operands above
    mag = (1.0 / (typical * k ** 0.5)) ** 0.5 * 4
    return mag, mag


def reference(a, b, scale_a, scale_b, bias=None):
    """D = (a * scale_a) @ (b * scale_b) + bias in float64, from the dequantized operands.

    Returns (d, magnitude) where magnitude = |sum term| + |bias| bounds what the float32 epilogue rounds.
    """
    sa = scale_a.to(torch.float64).reshape(-1, 1)
    sb = scale_b.to(torch.float64).reshape(1, -1)
    prod = (a.to(torch.float64) * sa) @ (b.to(torch.float64) * sb)
    mag = prod.abs()
    if bias is not None:
        prod = prod + bias.to(torch.float64)
        mag = mag + bias.to(torch.float64).abs()
    return prod, mag


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of `dtype` at |x| (float64 in, float64 out)."""
    ax = x.abs().clamp_min(2.0 ** _MIN_EXP[dtype])
    _, e = torch.frexp(ax)  # ax = m * 2**e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(ax), (e - 1 - _MANTISSA[dtype]).to(torch.int32)).to(torch.float64)


def assert_close_to_reference(out, ref, mag, dtype, extra_rel=0.0, what=""):
    """|out - ref| <= ulp(dtype) + 4 * eps32 * mag + extra_rel * mag, elementwise; NaN never passes.

    The kernels accumulate int8 products exactly, convert to float32, apply two float32 multiplies and a
    float32 multiply-add (each <= 1 eps32 relative to the terms' magnitude `mag`) and round once to `dtype`
    (half an ulp); the reference's own rounding to `dtype` adds at most another half ulp. `extra_rel` is
    for fp8, whose float32 accumulation order is not exact (see tests/test_scaled_mm_cuda.py).
    """
    o = out.to(torch.float64)
    assert not torch.isnan(o).any(), f"{what}: NaN in output"
    bound = torch.maximum(ulp(ref, dtype), ulp(o, dtype)) + (4 * EPS32 + extra_rel) * mag
    err = (o - ref).abs()
    bad = err > bound
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements out of tolerance; first at {idx}: "
            f"out={o[tuple(idx)].item()!r} ref={ref[tuple(idx)].item()!r} bound={bound[tuple(idx)].item()!r}")
