"""Programmatic dependent launch (PDL) of the sm90 GEMMs.

With PDL (used for M <= 16) a GEMM may be scheduled before the kernel ahead of it on the stream has finished
(the quantization kernels let it be scheduled as soon as all their blocks have started), so these tests
check the two hazards PDL could open, eagerly and inside CUDA graphs, with fresh inputs each time:

- read after write: the GEMM reads q and the per-token scales while the quantization kernel that writes
  them may still be running;
- write after read: the GEMM writes its output over the very activations the quantization kernel is
  reading (out aliases x).

Each result must equal, bit for bit, the same GEMM launched without PDL after a device synchronisation.
"""

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import assert_close_to_reference, fp8_accum_bound, reference


@pytest.fixture
def pdl():
    """Yields a function that sets PDL on or off; restores the setting found at the start."""
    previous = cw.set_pdl(True)
    yield cw.set_pdl
    cw.set_pdl(previous)


@pytest.mark.skipif(cw.cuda_ops_available(), reason="checks the message without the CUDA extension")
def test_set_pdl_without_extension_raises():
    with pytest.raises(RuntimeError, match="set_pdl: the CUDA extension is not loaded"):
        cw.set_pdl(True)
    assert cw.pdl_enabled() is False


@pytest.mark.cuda
def test_set_pdl_returns_previous_setting(pdl):
    assert pdl(False) is True
    assert cw.pdl_enabled() is False
    assert pdl(True) is False
    assert cw.pdl_enabled() is True


def _weights(n, k, qdtype, gen):
    w = torch.randn(n, k, device="cuda", generator=gen)
    wq, sw = torch.ops.cutlass_w8a8.quantize_per_token(w, qdtype)
    return wq, sw.view(-1)


def _quant_then_gemm_in_place(x, wq, sw, qdtype):
    """q, s = quantize(x); x[:] = scaled_mm(q, w) (N == K, so the output overwrites the input)."""
    q, s = torch.ops.cutlass_w8a8.quantize_per_token(x, qdtype)
    cw.scaled_mm(q, wq.t(), s, sw, out=x)
    return x


def _expected(x, wq, sw, qdtype, pdl):
    """The chain on a copy of x with PDL off and a synchronisation between the two kernels."""
    pdl(False)
    try:
        q, s = torch.ops.cutlass_w8a8.quantize_per_token(x.clone(), qdtype)
        torch.cuda.synchronize()
        out = cw.scaled_mm(q, wq.t(), s, sw, x.dtype)
        torch.cuda.synchronize()
        return out, q, s
    finally:
        pdl(True)


QDTYPES = [torch.int8, torch.float8_e4m3fn]


# PDL is used for M <= 16 (1, 8, 16 here); 96 and 512 check that the larger-M configs, launched without it
# after a quantization kernel that still signals early, are unaffected.
@pytest.mark.sm90
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("m", [1, 8, 16, 96, 512])
def test_pdl_chain_eager_matches_serialized(pdl, qdtype, m):
    if qdtype == torch.float8_e4m3fn and not cw.supports_fp8():
        pytest.skip("no fp8 kernels on this device")
    gen = torch.Generator(device="cuda").manual_seed(m)
    k = 4096
    wq, sw = _weights(k, k, qdtype, gen)
    for i in range(3):
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16) * (1 + i)
        want, q, s = _expected(x, wq, sw, qdtype, pdl)
        got = _quant_then_gemm_in_place(x, wq, sw, qdtype)
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"M={m} call {i}: PDL result differs from the serialized one"
    # and the serialized result is itself right
    assert_close_to_reference(want, reference(q, wq.t(), s, sw, None), torch.bfloat16,
                              accum_rel=fp8_accum_bound(k) if qdtype == torch.float8_e4m3fn else 0.0)


@pytest.mark.sm90
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("m", [1, 16, 512])
def test_pdl_chain_in_graph_matches_serialized(pdl, qdtype, m):
    if qdtype == torch.float8_e4m3fn and not cw.supports_fp8():
        pytest.skip("no fp8 kernels on this device")
    gen = torch.Generator(device="cuda").manual_seed(100 + m)
    k = 4096
    wq, sw = _weights(k, k, qdtype, gen)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        _quant_then_gemm_in_place(x.clone(), wq, sw, qdtype)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        # two rounds, so a GEMM also follows a GEMM (CUTLASS's own early trigger) inside the graph
        _quant_then_gemm_in_place(x, wq, sw, qdtype)
        _quant_then_gemm_in_place(x, wq, sw, qdtype)
    for i in range(6):
        fresh = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        once, _, _ = _expected(fresh, wq, sw, qdtype, pdl)
        want, _, _ = _expected(once, wq, sw, qdtype, pdl)
        x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(x, want), f"M={m} replay {i}: PDL graph result differs from the serialized one"


@pytest.mark.sm90
def test_gemm_after_torch_producer_reads_new_operand(pdl):
    """A PDL-launched GEMM right after a torch kernel that writes its A operand (no early trigger there)."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    m, n, k = 16, 4096, 8192
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, device="cuda", generator=gen)
    sa = torch.rand(m, 1, device="cuda", generator=gen) * 1e-3 + 1e-4
    sb = torch.rand(n, device="cuda", generator=gen) * 1e-3 + 1e-4
    a = torch.empty(m, k, dtype=torch.int8, device="cuda")
    for i in range(4):
        src = torch.randint(-128, 128, (m, k), dtype=torch.int8, device="cuda", generator=gen)
        torch.cuda.synchronize()
        a.copy_(src)  # torch's copy kernel, then our GEMM with PDL
        got = cw.scaled_mm(a, w.t(), sa, sb, torch.bfloat16)
        torch.cuda.synchronize()
        pdl(False)
        want = cw.scaled_mm(src, w.t(), sa, sb, torch.bfloat16)
        pdl(True)
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"call {i}: the GEMM read A before the copy into it had finished"
