"""Fuzz cases for scaled_mm, shared by tests/gemm/test_fuzz.py (hypothesis) and scripts/fuzz.py (the long run).

A `Case` describes one legal call: shapes, operand dtype, output dtype, scale kinds and shapes, bias, the
functional or ``out=`` form, the layouts (a, b and out as windows of wider buffers, with 16-byte aligned
offsets and pitches) and the kind of operand values. `run_case` builds the operands from the case's seed,
calls `cutlass_w8a8.scaled_mm`, and checks the result against the float64 reference from dequantized
operands (cutlass_w8a8/testing/references.py) with the tolerance model there, plus: the output's shape, dtype and device, that
``out=`` returns ``out`` itself, and that the padding around a windowed ``out`` is untouched.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Optional

import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import EPS32, assert_close_to_reference, fp8_accum_bound, rand_operand, rand_scale, reference, ulp

# fp8 cases are checked with an extra allowance on sum_k |a_k b_k| (the `accum_rel` term of
# assert_close_to_reference), cutlass_w8a8.testing.references.fp8_accum_bound(K): the fp8 kernels accumulate in the tensor cores
# with fast accumulation, so their error scales with the sum of |terms|. scripts/fuzz.py prints the largest
# allowance any fp8 case needed ("fp8 accum_rel needed"), to compare with the bound.

DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
OUT_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
VALUE_KINDS = ("uniform", "extreme", "sparse", "constant")
# scale_a shapes: per-token "m1" = (M, 1), "m" = (M,); per-tensor "1" = (1,), "11" = (1, 1), "0d" = ()
SA_PER_TOKEN, SA_PER_TENSOR = ("m1", "m"), ("1", "11", "0d")
# scale_b shapes: per-channel "n" = (N,), "1n" = (1, N); per-tensor "1" = (1,), "0d" = ()
SB_PER_CHANNEL, SB_PER_TENSOR = ("n", "1n"), ("1", "0d")
# M on both sides of every dispatch bucket boundary (csrc/gemm/sm90/scaled_mm_sm90_dispatch.cuh) and the ends
M_EDGES = (1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1023, 1024, 1025, 4096, 8191, 8192)


@dataclasses.dataclass(frozen=True)
class Case:
    """One legal scaled_mm call. Sizes in elements; pads and offsets are extra elements per row of the
    wider buffer the operand is a window of (multiples of 16 bytes, so every layout is legal)."""

    m: int
    n: int
    k: int
    dtype: str = "int8"          # key of DTYPES
    out_dtype: str = "bf16"      # key of OUT_DTYPES
    sa: str = "m1"               # scale_a shape kind (see SA_*)
    sb: str = "n"                # scale_b shape kind (see SB_*)
    bias: bool = False
    use_out: bool = False        # the out= form instead of the functional one
    a_off: int = 0               # a = a_buf[:, a_off:a_off + K], a_buf row pitch K + a_off + a_pad
    a_pad: int = 0
    b_off: int = 0               # b = w_buf[:, b_off:b_off + K].t(), w_buf is [N, K + b_off + b_pad]
    b_pad: int = 0
    out_off: int = 0             # out = out_buf[:, out_off:out_off + N] (elements of the output dtype)
    out_pad: int = 0
    values: str = "uniform"      # key of VALUE_KINDS
    seed: int = 0

    def describe(self) -> str:
        return ("Case(" + ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
                + ")")


def _operand(shape, dtype, values, device, g):
    """8-bit operand of `shape` filled according to the value kind."""
    if values == "uniform":
        return rand_operand(shape, dtype, device, g)
    lo, hi = (-128.0, 127.0) if dtype == torch.int8 else (-448.0, 448.0)
    if values == "constant":  # the largest product, no cancellation: the accumulator's worst case
        return torch.full(shape, lo, device=device).to(dtype)
    if values == "extreme":  # only the two ends of the range, random signs
        pick = torch.randint(0, 2, shape, device=device, generator=g).bool()
        return torch.where(pick, torch.tensor(lo, device=device), torch.tensor(hi, device=device)).to(dtype)
    x = rand_operand(shape, dtype, device, g)  # sparse: ~90% zeros
    keep = torch.rand(shape, device=device, generator=g) < 0.1
    return torch.where(keep, x, torch.zeros((), dtype=dtype, device=device))


def _window(t: torch.Tensor, off: int, pad: int, g, fill=None) -> torch.Tensor:
    """`t` [R, C] copied into the columns [off, off + C) of a wider [R, off + C + pad] buffer."""
    rows, cols = t.shape
    if fill is None:  # garbage of the same dtype around the window
        buf = torch.randint(-100, 100, (rows, off + cols + pad), device=t.device, generator=g).to(t.dtype)
    else:
        buf = torch.full((rows, off + cols + pad), fill, dtype=t.dtype, device=t.device)
    view = buf[:, off:off + cols]
    view.copy_(t)
    return view


def _scale(kind: str, m: int, n: int, mag: float, device, g) -> torch.Tensor:
    shape = {"m1": (m, 1), "m": (m,), "n": (n,), "1n": (1, n), "1": (1,), "11": (1, 1), "0d": ()}[kind]
    return rand_scale(shape, device, mag, g)


def _magnitude(x: torch.Tensor) -> float:
    return max(float(x.float().abs().mean()), 1e-3)


def build(case: Case, device) -> dict:
    """The operands of `case` on `device`: a, b ([K, N] column-major view), scale_a, scale_b, bias, out
    (None for the functional form) and out_buf (the wider buffer around out, or None)."""
    g = torch.Generator(device=device).manual_seed(case.seed)
    dtype, out_dtype = DTYPES[case.dtype], OUT_DTYPES[case.out_dtype]
    a = _operand((case.m, case.k), dtype, case.values, device, g)
    w = _operand((case.n, case.k), dtype, case.values, device, g)
    # Scales that keep |D| near 1..10 whatever the value kind (worst case, constant operands: 16 sqrt(K)),
    # far from the float16 limit; the product of the two magnitudes is 16 / (E|a| E|b| sqrt(K)).
    mag = (1.0 / (_magnitude(a) * _magnitude(w) * math.sqrt(case.k))) ** 0.5 * 4 if case.m else 1.0
    sa = _scale(case.sa, case.m, case.n, mag, device, g)
    sb = _scale(case.sb, case.m, case.n, mag, device, g)
    bias = (torch.randn(case.n, device=device, generator=g) * 4).to(out_dtype) if case.bias else None
    if case.a_off or case.a_pad:
        a = _window(a, case.a_off, case.a_pad, g)
    if case.b_off or case.b_pad:
        w = _window(w, case.b_off, case.b_pad, g)
    out = out_buf = None
    if case.use_out:
        out = torch.full((case.m, case.n), float("nan"), dtype=out_dtype, device=device)  # poison
        if case.out_off or case.out_pad:
            out = _window(out, case.out_off, case.out_pad, g, fill=7.0)
            out_buf = out._base
    return dict(a=a, b=w.t(), scale_a=sa, scale_b=sb, bias=bias, out=out, out_buf=out_buf,
                out_dtype=out_dtype)


def fp8_accum_rel_needed(out: torch.Tensor, ref, dtype: torch.dtype) -> float:
    """Diagnostic only: the smallest `accum_rel` with which assert_close_to_reference would accept `out`
    (0 when the bound without it already holds), from the same terms as the bound in cutlass_w8a8/testing/references.py."""
    o = out.to(torch.float64)
    base = (torch.maximum(ulp(ref.d, dtype), ulp(o, dtype)) + 4 * EPS32 * ref.mag
            + ref.k * 2.0 ** -52 * ref.abs_terms)
    excess = ((o - ref.d).abs() - base).clamp_min(0)
    if not excess.numel():
        return 0.0
    zero = ref.abs_terms == 0  # all terms 0: any excess at all cannot be an accumulation error
    if bool((excess[zero] > 0).any()):
        return math.inf
    return float((excess / torch.where(zero, torch.ones_like(ref.abs_terms), ref.abs_terms)).max())


def run_case(case: Case, device, ref_device=None, fp8_accum_rel: Optional[float] = None,
             stats: Optional[dict] = None) -> None:
    """Run one case and check it; raises AssertionError (with the case in the message) on any mismatch.

    ref_device: where the float64 reference is computed (default: `device`). stats: if given, fp8 cases add
    their needed allowance to stats["fp8_accum_rel_needed"] (the running maximum).
    """
    ops = build(case, device)
    a, b, sa, sb, bias, out = ops["a"], ops["b"], ops["scale_a"], ops["scale_b"], ops["bias"], ops["out"]
    out_dtype = ops["out_dtype"]
    what = case.describe()
    if out is not None:
        ret = cw.scaled_mm(a, b, sa, sb, bias=bias, out=out)
        assert ret is out, f"{what}: out= must return `out` itself"
    else:
        out = cw.scaled_mm(a, b, sa, sb, out_dtype, bias)
    assert out.shape == (case.m, case.n) and out.dtype == out_dtype, f"{what}: got {out.shape} {out.dtype}"
    assert out.device == a.device, f"{what}: output on {out.device}, a on {a.device}"
    if ops["out_buf"] is not None:
        buf = ops["out_buf"]
        left, right = buf[:, :case.out_off], buf[:, case.out_off + case.n:]
        assert bool((left == 7).all()) and bool((right == 7).all()), f"{what}: wrote outside the out window"
    rd = torch.device(ref_device) if ref_device is not None else a.device
    ref = reference(a.to(rd), b.to(rd), sa.to(rd), sb.to(rd), None if bias is None else bias.to(rd))
    out_r = out.to(rd)
    is_fp8 = DTYPES[case.dtype] == torch.float8_e4m3fn
    if is_fp8 and stats is not None:
        stats["fp8_accum_rel_needed"] = max(stats.get("fp8_accum_rel_needed", 0.0),
                                            fp8_accum_rel_needed(out_r, ref, out_dtype))
        # the same as a fraction of the per-case bound K * 2**-13 (1.0 = the bound is exactly used up)
        stats["fp8_bound_fraction"] = max(stats.get("fp8_bound_fraction", 0.0),
                                          fp8_accum_rel_needed(out_r, ref, out_dtype) / fp8_accum_bound(case.k))
    rel = (fp8_accum_bound(case.k) if fp8_accum_rel is None else fp8_accum_rel) if is_fp8 else 0.0
    assert_close_to_reference(out_r, ref, out_dtype, accum_rel=rel, what=what)


# ---- random cases for the long run (scripts/fuzz.py): the same space as the hypothesis strategies -----

def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, max(lo, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))))


def random_case(rng: random.Random, dtypes=("int8", "fp8"), max_m=8192, max_n=16384, max_k=16384) -> Case:
    """A random legal case: M in [1, max_m] (30% on a dispatch bucket edge, else log-uniform), N and K
    multiples of 16 up to max_n / max_k (log-uniform, 15% at 16 or the maximum), every scale kind and shape,
    bias or not, both output dtypes, functional or out=, random aligned windows, four value kinds."""
    if rng.random() < 0.3:
        m = rng.choice([e for e in M_EDGES if e <= max_m] or [max_m])
    else:
        m = _log_uniform(rng, 1, max_m)

    def mult16(hi):
        if rng.random() < 0.15:
            return rng.choice((16, hi // 16 * 16))
        return 16 * _log_uniform(rng, 1, hi // 16)

    n, k = mult16(max_n), mult16(max_k)
    per_token, per_channel = rng.random() < 0.5, rng.random() < 0.5
    use_out = rng.random() < 0.5
    windowed = rng.random() < 0.3
    return Case(
        m=m, n=n, k=k, dtype=rng.choice(tuple(dtypes)), out_dtype=rng.choice(tuple(OUT_DTYPES)),
        sa=rng.choice(SA_PER_TOKEN if per_token else SA_PER_TENSOR),
        sb=rng.choice(SB_PER_CHANNEL if per_channel else SB_PER_TENSOR),
        bias=rng.random() < 0.5, use_out=use_out,
        a_off=16 * rng.randrange(3) if windowed else 0, a_pad=16 * rng.randrange(3) if windowed else 0,
        b_off=16 * rng.randrange(3) if windowed else 0, b_pad=16 * rng.randrange(3) if windowed else 0,
        out_off=8 * rng.randrange(3) if windowed and use_out else 0,
        out_pad=8 * rng.randrange(3) if windowed and use_out else 0,
        values=rng.choices(VALUE_KINDS, weights=(70, 10, 10, 10))[0], seed=rng.randrange(2 ** 31))
