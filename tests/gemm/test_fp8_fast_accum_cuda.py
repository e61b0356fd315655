"""Row-wise fp8 with fp8_fast_accum=False (issue 37): the sm90 accurate configs (Fp8_*_Accurate, promoted every 128 of
K) at every M bucket of select_fp8, against the float64 reference of the dequantized operands.

Bound: the tensor cores' error now covers one 128-deep K block at a time (fp8_accum_bound(128) of sum|terms|, the
per-product 14-bit figure derived in cutlass_w8a8/testing/references.py), plus the float32 sum of the K / 128 promoted
partials and the epilogue ((K / 128 + 4) float32 roundoffs of sum|terms|); assert_close_to_reference adds the output
ulp. With fast accumulation the allowance is fp8_accum_bound(K), K / 128 times larger.
"""

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import (EPS32, assert_close_to_reference, fp8_accum_bound, rand_operand,
                                             rand_scale, reference, scale_magnitudes)

pytestmark = pytest.mark.sm90

FP8 = torch.float8_e4m3fn
# Crosses every bucket of select_fp8's accurate rows: [1, 16], (16, 64], (64, 128], (128, 256], (256, 1024), >= 1024.
M_BUCKETS = [9, 16, 17, 64, 65, 128, 129, 256, 257, 1023, 1024, 2048]


@pytest.fixture(autouse=True)
def _needs_fp8_kernels():
    if not cw.supports_fp8():
        pytest.skip("the sm90 fp8 kernels are not available in this build")


@pytest.fixture
def cutlass_only():
    """The decode GEMM off (scaled_mm runs the CUTLASS kernels at every M); the bound restored afterwards."""
    previous = cw._ext.set_decode_gemm_max_m(0)
    yield
    cw._ext.set_decode_gemm_max_m(previous)


@pytest.mark.parametrize("m", M_BUCKETS)
@pytest.mark.parametrize("nk", [(768, 1024), (1024, 7168)], ids=["N768-K1024", "N1024-K7168"])
@torch.no_grad()
def test_accurate_buckets_match_fp64_reference(cutlass_only, m, nk):
    n, k = nk
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n + k)
    a, w = rand_operand((m, k), FP8, "cuda", g), rand_operand((n, k), FP8, "cuda", g)
    ma, mb = scale_magnitudes(FP8, k)
    sa, sb = rand_scale((m, 1), "cuda", ma, g), rand_scale((n,), "cuda", mb, g)
    bias = (torch.randn(n, device="cuda", generator=g) * 4).to(torch.bfloat16)
    ref = reference(a, w.t(), sa, sb, bias)
    rel = fp8_accum_bound(128) + (k // 128 + 4) * EPS32
    for out in (None, torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")):
        y = cw.scaled_mm(a, w.t(), sa, sb, torch.bfloat16, bias, out=out, fp8_fast_accum=False)
        assert_close_to_reference(y, ref, torch.bfloat16, accum_rel=rel, what=f"accurate M={m} N={n} K={k}")
