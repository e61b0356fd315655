"""Property-based fuzzing of scaled_mm with hypothesis: every legal call must match the float64 reference.

The space (cutlass_w8a8/testing/fuzz.py, `Case`): M, N, K (N and K multiples of 16), int8 and fp8 operands, bfloat16 and
float16 outputs, per-tensor / per-token scale_a and per-tensor / per-channel scale_b in each accepted shape,
bias or not, the functional and the out= form, a, b and out as 16-byte aligned windows of wider buffers, and
four kinds of operand values (uniform, the two range ends, 90% zeros, and the constant worst case).

- `test_fuzz_cpu`: the CPU reference op, small sizes (M <= 64, N, K <= 256), in CI.
- `test_fuzz_cuda`: the GPU kernels over the full ranges (M <= 8192, N, K <= 16384), reference on the GPU.

A fixed number of derandomized examples keeps runs reproducible; `CW8A8_FUZZ_EXAMPLES` changes the count.
The long run (>= 1000 cases, every failure listed) is scripts/fuzz.py.
"""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cutlass_w8a8.testing.references import fp8_accum_bound
from cutlass_w8a8.testing.fuzz import (DTYPES, OUT_DTYPES, SA_PER_TENSOR, SA_PER_TOKEN, SB_PER_CHANNEL,
                   SB_PER_TENSOR, VALUE_KINDS, Case, run_case)

# fp8 cases on/off in one place (e.g. while the fp8 tolerance is being checked).
FP8_ENABLED = True
EXAMPLES = int(os.environ.get("CW8A8_FUZZ_EXAMPLES", "25"))

FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                         print_blob=True, suppress_health_check=list(HealthCheck))


@st.composite
def cases(draw, max_m: int, max_n: int, max_k: int):
    """Legal scaled_mm cases with M in [1, max_m] and N, K multiples of 16 up to max_n, max_k."""
    m = draw(st.integers(1, max_m))
    n = 16 * draw(st.integers(1, max_n // 16))
    k = 16 * draw(st.integers(1, max_k // 16))
    dtype = draw(st.sampled_from(sorted(DTYPES) if FP8_ENABLED else ["int8"]))
    per_token, per_channel = draw(st.booleans()), draw(st.booleans())
    use_out = draw(st.booleans())
    pad = st.sampled_from([0, 16, 32])
    out_pad = st.sampled_from([0, 8, 16]) if use_out else st.just(0)
    return Case(
        m=m, n=n, k=k, dtype=dtype, out_dtype=draw(st.sampled_from(sorted(OUT_DTYPES))),
        sa=draw(st.sampled_from(SA_PER_TOKEN if per_token else SA_PER_TENSOR)),
        sb=draw(st.sampled_from(SB_PER_CHANNEL if per_channel else SB_PER_TENSOR)),
        bias=draw(st.booleans()), use_out=use_out,
        a_off=draw(pad), a_pad=draw(pad), b_off=draw(pad), b_pad=draw(pad),
        out_off=draw(out_pad), out_pad=draw(out_pad),
        values=draw(st.sampled_from(VALUE_KINDS)), seed=draw(st.integers(0, 2 ** 31 - 1)))


@FUZZ_SETTINGS
@given(case=cases(max_m=64, max_n=256, max_k=256))
def test_fuzz_cpu(case):
    """The CPU reference op against cutlass_w8a8.testing.references.reference: the shared arithmetic and tolerance model."""
    run_case(case, "cpu")


@pytest.mark.cuda
@FUZZ_SETTINGS
@given(case=cases(max_m=8192, max_n=16384, max_k=16384))
def test_fuzz_cuda(case):
    """The GPU kernels over the full ranges; the float64 reference is computed on the GPU too."""
    run_case(case, "cuda")


def test_fp8_tolerance_grows_with_k():
    """The fp8 allowance is K * 2**-13 of sum|terms| (cutlass_w8a8.testing.references.fp8_accum_bound)."""
    assert fp8_accum_bound(16) == 16 * 2.0 ** -13
    assert fp8_accum_bound(4096) == 2 * fp8_accum_bound(2048)
    assert isinstance(FP8_ENABLED, bool)


def test_fuzz_checks_detect_a_wrong_result(monkeypatch):
    """The fuzz check is not vacuous: a result off by a few units in the last place is reported."""
    import cutlass_w8a8 as cw

    real = cw.scaled_mm

    def off_by_a_bit(*args, **kwargs):
        out = real(*args, **kwargs)
        out[0, 0] = out[0, 0].float() * (1 + 2.0 ** -5) + 1
        return out

    monkeypatch.setattr(cw, "scaled_mm", off_by_a_bit)
    with pytest.raises(AssertionError, match="out of tolerance"):
        run_case(Case(m=3, n=16, k=32, seed=1), "cpu")


def test_fuzz_checks_detect_writes_outside_the_window(monkeypatch):
    import cutlass_w8a8 as cw

    real = cw.scaled_mm

    def spill(*args, out=None, **kwargs):
        real(*args, out=out, **kwargs)
        out._base[:, -1] = 0  # scribble on the padding
        return out

    monkeypatch.setattr(cw, "scaled_mm", spill)
    with pytest.raises(AssertionError, match="outside the out window"):
        run_case(Case(m=3, n=16, k=32, use_out=True, out_pad=8, seed=1), "cpu")
