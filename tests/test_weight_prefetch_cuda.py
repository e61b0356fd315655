"""The L2 weight prefetch of the sm90 decode GEMMs (csrc/sm90/weight_prefetch_mainloop.cuh).

The swapped (small-M) configs prefetch their first weight tile into L2 as each thread block starts, before
griddepcontrol.wait, so with PDL the prefetch may run while the previous kernel still writes. A prefetch
must never change a result: these tests compare it bit for bit with the GEMM launched without it, on
shapes with partial tiles, and with the weight itself written by the kernel right before the GEMM.
"""

import pytest
import torch

import cutlass_w8a8 as cw
from _helpers import assert_close_to_reference, reference


@pytest.fixture
def prefetch():
    """Yields a function that sets the prefetch on or off; restores the setting found at the start."""
    previous = cw.set_weight_prefetch(True)
    yield cw.set_weight_prefetch
    cw.set_weight_prefetch(previous)


@pytest.mark.skipif(cw.cuda_ops_available(), reason="checks the message without the CUDA extension")
def test_set_weight_prefetch_without_extension_raises():
    with pytest.raises(RuntimeError, match="set_weight_prefetch: the CUDA extension is not loaded"):
        cw.set_weight_prefetch(True)
    assert cw.weight_prefetch_enabled() is False


@pytest.mark.cuda
def test_set_weight_prefetch_returns_previous_setting(prefetch):
    assert prefetch(False) is True
    assert cw.weight_prefetch_enabled() is False
    assert prefetch(True) is False
    assert cw.weight_prefetch_enabled() is True


def _operands(m, n, k, qdtype, gen):
    if qdtype == torch.int8:
        a = torch.randint(-128, 128, (m, k), dtype=torch.int8, device="cuda", generator=gen)
        w = torch.randint(-128, 128, (n, k), dtype=torch.int8, device="cuda", generator=gen)
    else:
        a = (torch.randn(m, k, device="cuda", generator=gen) * 4).to(qdtype)
        w = (torch.randn(n, k, device="cuda", generator=gen) * 4).to(qdtype)
    sa = torch.rand(m, 1, device="cuda", generator=gen) * 1e-3 + 1e-4
    sb = torch.rand(n, device="cuda", generator=gen) * 1e-3 + 1e-4
    return a, w, sa, sb


# Every swapped bucket (M <= 128), tile-aligned and ragged N and K (N = 4104: a partial 64-row weight tile;
# K = 4112: a partial k-tile), few and many tiles (N = 512: 8 thread blocks; N = 28672: more tiles than SMs).
@pytest.mark.sm90
@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("m", [1, 16, 17, 64, 128])
@pytest.mark.parametrize("n,k", [(4096, 4096), (4104, 4112), (512, 8192), (28672, 1024)])
def test_prefetch_matches_no_prefetch(prefetch, qdtype, m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n + k)
    a, w, sa, sb = _operands(m, n, k, qdtype, gen)
    out_on = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    out_off = out_on.clone()
    cw.scaled_mm(a, w.t(), sa, sb, out=out_on)
    prefetch(False)
    cw.scaled_mm(a, w.t(), sa, sb, out=out_off)
    prefetch(True)
    torch.cuda.synchronize()
    assert torch.equal(out_on, out_off), f"M={m} N={n} K={k}: the prefetch changed the result"
    if qdtype == torch.int8:  # exact accumulation: the result is also right, not just unchanged
        assert_close_to_reference(out_on, reference(a, w.t(), sa, sb, None), torch.bfloat16)


@pytest.mark.sm90
@pytest.mark.parametrize("m", [1, 16])
def test_weight_written_by_previous_kernel(prefetch, m):
    """The quantization kernel writes the weight and the PDL-launched GEMM right after it prefetches that
    same memory (the caching allocator hands the weight buffer of the previous round back); the GEMM must
    see the new weight, never lines of the old one."""
    gen = torch.Generator(device="cuda").manual_seed(11 + m)
    n, k = 2048, 4096
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8, device="cuda", generator=gen)
    sa = torch.rand(m, 1, device="cuda", generator=gen) * 1e-3 + 1e-4
    pdl_before = cw.set_pdl(True)
    try:
        for i in range(4):
            w_src = torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16) * (1 + i)
            torch.cuda.synchronize()
            wq, sw = torch.ops.cutlass_w8a8.quantize_per_token(w_src, torch.int8)  # writes the weight
            got = cw.scaled_mm(a, wq.t(), sa, sw.view(-1), torch.bfloat16)  # prefetches it at once
            torch.cuda.synchronize()
            want = reference(a, wq.t(), sa, sw.view(-1), None)
            assert_close_to_reference(got, want, torch.bfloat16)
            del wq, sw, got
    finally:
        cw.set_pdl(pdl_before)
