"""Shared test helpers: random operands, the float64 reference from dequantized operands, tolerances."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

# Mantissa bits and smallest normal exponent of the output dtypes (for one unit in the last place).
_MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
_MIN_EXP = {torch.bfloat16: -126, torch.float16: -14, torch.float32: -126}
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


class Reference(NamedTuple):
    d: torch.Tensor          # the float64 result
    mag: torch.Tensor        # |sum| + |bias|: what the kernels' float32 epilogue rounds
    abs_terms: torch.Tensor  # sum_k |a_k b_k| (dequantized): what accumulation errors scale with
    k: int


def reference(a, b, scale_a, scale_b, bias=None) -> Reference:
    """D = (a * scale_a) @ (b * scale_b) + bias in float64, from the dequantized operands."""
    sa = scale_a.to(torch.float64).reshape(-1, 1)
    sb = scale_b.to(torch.float64).reshape(1, -1)
    a_deq, b_deq = a.to(torch.float64) * sa, b.to(torch.float64) * sb
    d = a_deq @ b_deq
    mag = d.abs()
    if bias is not None:
        d = d + bias.to(torch.float64)
        mag = mag + bias.to(torch.float64).abs()
    return Reference(d, mag, a_deq.abs() @ b_deq.abs(), a.shape[1])


BLOCK = 128  # the block edge of block-scaled fp8 (cutlass_w8a8.BLOCK_SIZE)


def block_reference(a, b, scale_a, scale_b, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(D, bound) of a block-scaled fp8 GEMM: ``a`` (M, K) e4m3 with ``scale_a`` (M, K/128), ``b`` (K, N) e4m3 (the
    (N, K) weight as ``weight.t()``) with ``scale_b`` (ceil(N/128), K/128). D = (a * scale_a) @ (b * scale_b) + bias
    in float64 from the dequantized operands; ``bound`` the elementwise allowance besides the output's rounding
    (add one output ulp): float32 scaling and summing of the K/128 block partials ((K/128 + 4) eps32 of
    sum|terms|), Hopper's fp8 accumulation within a 128-long block (`fp8_accum_bound` (128)), and two float32
    roundoffs of |D| + |bias| in the epilogue. The bound of tests/gemm/test_scaled_mm_block_cuda.py."""
    k, n = b.shape
    a_deq = a.double() * scale_a.double().repeat_interleave(BLOCK, dim=1)
    b_deq = b.double() * scale_b.double().repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1).t()
    d = a_deq @ b_deq
    mag = d.abs()
    if bias is not None:
        d = d + bias.double()
        mag = mag + bias.double().abs()
    terms = a_deq.abs() @ b_deq.abs()
    return d, ((k // BLOCK + 4) * EPS32 + fp8_accum_bound(BLOCK)) * terms + 2 * EPS32 * mag


def fp8_accum_bound(k: int) -> float:
    """Allowance for the tensor cores' accumulation of fp8 products, relative to sum_k |a_k b_k|: K * 2**-13.

    Hopper's fp8 MMA aligns each product to the running sum and keeps about 14 mantissa bits of it
    (DeepSeek-V3 technical report, §3.3.2), so each of the K products can lose up to 2**-13 (one bit of
    slack) of a magnitude that is at most sum|terms|. The per-product, not per-instruction, count is what
    the GPU showed (H200, 2026-11-21): K = 16 random operands already erred by 2**-10 of sum|terms|, and K
    constant operands (-448 x -448) came out 1.2% (K = 656) to 1.8% (K = 131072) low, a truncation bias.
    The bound is loose for random signs and tight within a factor of 2 to 7 on those cases.
    """
    return k * 2.0 ** -13


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of `dtype` (bfloat16, float16, float32) at |x| (float64 in, float64 out);
    below the smallest normal, the ulp there."""
    ax = x.abs().clamp_min(2.0 ** _MIN_EXP[dtype])
    _, e = torch.frexp(ax)  # ax = m * 2**e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(ax), (e - 1 - _MANTISSA[dtype]).to(torch.int32)).to(torch.float64)


def assert_close_to_reference(out, ref: Reference, dtype, accum_rel=0.0, what=""):
    """Elementwise |out - ref| <= ulp(dtype) + 4 eps32 |D| + (K 2**-52 + accum_rel) sum|terms|; no NaN.

    - ulp: the kernel rounds once to `dtype` (half an ulp) and so does the reference (another half).
    - 4 eps32 |D|: int8 products accumulate exactly; the float32 epilogue converts the accumulator and
      applies a multiply and a multiply-add, each within one float32 roundoff of the terms' magnitude.
    - K 2**-52 sum|terms|: the float64 reference's own accumulation error (products of dequantized operands
      carry up to 64 significant bits); it matters only where D is near 0, e.g. an accumulator of exactly 0.
    - accum_rel sum|terms|: for float32 accumulation (fp8), whose error scales with the terms, not with D.
    """
    # The arithmetic runs under the tensors' own device: on 2 GPUs with cuda:0 current and the tensors on
    # cuda:1 the bound came out ~0 (2026-11-21, H200 x2), the ulp term lost, while the output was right.
    guard = torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext()
    with guard:
        return _check(out, ref, dtype, accum_rel, what)


def _check(out, ref: Reference, dtype, accum_rel, what):
    o = out.to(torch.float64)
    assert not torch.isnan(o).any(), f"{what}: NaN in output"
    bound = (torch.maximum(ulp(ref.d, dtype), ulp(o, dtype)) + 4 * EPS32 * ref.mag
             + (ref.k * 2.0 ** -52 + accum_rel) * ref.abs_terms)
    assert_within(o, ref.d, bound, what)


def assert_within(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str = "",
                  index_name: str = "") -> None:
    """Raise AssertionError unless ``|out - ref| <= bound`` elementwise (float64 tensors of one shape).

    The message counts the elements out of tolerance and shows the first, its index prefixed by
    ``index_name`` (e.g. ``"(b, h, d) = "``), with ``out``, ``ref`` and ``bound`` there.
    """
    bad = (out - ref).abs() > bound
    if bad.any():
        idx = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements out of tolerance; first at {index_name}"
            f"{list(idx)}: out={out[idx].item()!r} ref={ref[idx].item()!r} bound={bound[idx].item()!r}")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ``||out - ref|| / ||ref||``, computed in float64."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())
