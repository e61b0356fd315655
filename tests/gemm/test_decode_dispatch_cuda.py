"""scaled_mm's decode dispatch: at M <= decode_gemm_max_m() (sm90) scaled_mm, scaled_mm_out, w8a8_linear and
W8A8Linear run the decode GEMM (csrc/gemm/decode) instead of CUTLASS (the rule: csrc/core/launch_policy.hpp).

- The bound: default 8 on sm90, settable in [0, 16] (ValueError otherwise), restored by every test.
- int8: the dispatched result equals both the decode op and the CUTLASS kernels bit for bit (exact int32
  accumulation, one epilogue), at every M in 1..16, with and without bias, per-tensor / per-token scales.
- fp8: the dispatched result is the decode op's bit for bit at M <= the bound, and close to the float64
  reference (the accumulation allowance of fp8_accum_bound).
- CUDA graphs: a captured dispatched GEMM replays equal to eager with new inputs; while an UpdatableGraph
  records, scaled_mm keeps its CUTLASS node (kind 1: its operands can be rebound), even at M = 1.
Outputs are poisoned (NaN) before each call; inputs are fresh random tensors.
"""

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.graphs import UpdatableGraph, capture
from cutlass_w8a8.testing.references import assert_close_to_reference, fp8_accum_bound, rand_operand, rand_scale, reference, scale_magnitudes

pytestmark = pytest.mark.sm90

OPS = torch.ops.cutlass_w8a8
DTYPES = [torch.int8, pytest.param(torch.float8_e4m3fn, id="fp8")]


@pytest.fixture
def bound():
    """Yields the setter; restores the bound found at the start."""
    previous = cw._ext.set_decode_gemm_max_m(8)
    yield cw._ext.set_decode_gemm_max_m
    cw._ext.set_decode_gemm_max_m(previous)


def problem(m, n, k, dtype, per_token=True, bias=False, out_dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = rand_operand((m, k), dtype, "cuda", g)
    w = rand_operand((n, k), dtype, "cuda", g)
    ma, mb = scale_magnitudes(dtype, k)
    sa = rand_scale((m, 1) if per_token else (1,), "cuda", ma, g)
    sb = rand_scale((n,), "cuda", mb, g)
    b = (torch.randn(n, device="cuda", generator=g) * 4).to(out_dtype) if bias else None
    return a, w, sa, sb, b


def poisoned_out(m, n, out_dtype):
    return torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)


def test_default_bound_and_setter(bound):
    assert cw._ext.decode_gemm_max_m() == 8
    assert bound(16) == 8
    assert cw._ext.decode_gemm_max_m() == 16
    assert bound(0) == 16
    for bad in (-1, 17):
        with pytest.raises(ValueError, match=r"_set_decode_gemm_max_m: `m` must be in \[0, 16\]"):
            bound(bad)
    assert cw._ext.decode_gemm_max_m() == 0


@pytest.mark.parametrize("nk", [(4096, 4096), (272, 4112), (1024, 14336)], ids=["4096x4096", "split-K", "1024x14336"])
def test_int8_dispatch_equals_decode_and_cutlass(bound, nk):
    n, k = nk
    for m in range(1, 17):
        per_token, bias = m % 2 == 0, m % 3 == 0
        out_dtype = torch.bfloat16 if m % 4 < 2 else torch.float16
        a, w, sa, sb, b = problem(m, n, k, torch.int8, per_token, bias, out_dtype, seed=m)
        bound(8)
        out = poisoned_out(m, n, out_dtype)
        cw.scaled_mm(a, w.t(), sa, sb, out_dtype, b, out=out)
        dispatched_fn = cw.scaled_mm(a, w.t(), sa, sb, out_dtype, b)
        decode = OPS.scaled_mm_decode(a, w.t(), sa, sb, out_dtype, b)
        bound(0)
        cutlass = cw.scaled_mm(a, w.t(), sa, sb, out_dtype, b)
        assert torch.equal(out, dispatched_fn), f"M={m}: scaled_mm out= and functional forms differ"
        assert torch.equal(out, decode), f"M={m}: dispatched scaled_mm differs from scaled_mm_decode"
        assert torch.equal(out, cutlass), f"M={m}: dispatched scaled_mm differs from the CUTLASS kernels"
        assert_close_to_reference(out, reference(a, w.t(), sa, sb, b), out_dtype, what=f"M={m}")


@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
def test_fp8_dispatch(bound, m):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9 or newer")
    n, k = 4096, 4096
    a, w, sa, sb, b = problem(m, n, k, torch.float8_e4m3fn, True, True, torch.bfloat16, seed=m)
    out = poisoned_out(m, n, torch.bfloat16)
    cw.scaled_mm(a, w.t(), sa, sb, torch.bfloat16, b, out=out)
    if m <= 8:
        assert torch.equal(out, OPS.scaled_mm_decode(a, w.t(), sa, sb, torch.bfloat16, b))
    else:
        bound(0)
        assert torch.equal(out, cw.scaled_mm(a, w.t(), sa, sb, torch.bfloat16, b))
    assert_close_to_reference(out, reference(a, w.t(), sa, sb, b), torch.bfloat16, accum_rel=fp8_accum_bound(k),
                              what=f"fp8 M={m}")


@pytest.mark.parametrize("m", [1, 4, 8])
def test_w8a8_linear_uses_dispatch(bound, m):
    """W8A8Linear's op (quantize, then the dispatched GEMM) equals quantize_per_token + scaled_mm_decode."""
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randint(-128, 128, (6144, 4096), device="cuda", generator=g, dtype=torch.int8)
    sw = torch.rand(6144, device="cuda", generator=g) * 1e-3 + 1e-4
    y = OPS.w8a8_linear(x, w, sw, None, None, torch.bfloat16)
    q, s = OPS.quantize_per_token(x, torch.int8)
    assert torch.equal(y, OPS.scaled_mm_decode(q, w.t(), s, sw, torch.bfloat16))


def test_graph_replay_of_dispatched_gemm(bound):
    m, n, k = 2, 4096, 4096
    a, w, sa, sb, _ = problem(m, n, k, torch.int8, seed=1)
    static_a, static_sa = a.clone(), sa.clone()
    out = poisoned_out(m, n, torch.bfloat16)
    graph, _ = capture(lambda: cw.scaled_mm(static_a, w.t(), static_sa, sb, torch.bfloat16, out=out))
    for seed in (2, 3):
        a2, _, sa2, _, _ = problem(m, n, k, torch.int8, seed=seed)
        static_a.copy_(a2)
        static_sa.copy_(sa2)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, cw.scaled_mm(a2, w.t(), sa2, sb, torch.bfloat16))


def test_recording_keeps_cutlass_node(bound):
    """An UpdatableGraph's GEMM node must stay rebindable (update_scaled_mm): recorded launches never take the
    decode path, even at M = 1."""
    m, n, k = 1, 4096, 4096
    a, w, sa, sb, _ = problem(m, n, k, torch.int8, seed=4)
    g = UpdatableGraph(lambda a_: cw.scaled_mm(a_, w.t(), sa, sb, torch.bfloat16), [a])
    nodes = [(node.op, node.config >= 0) for node in g.nodes]
    assert nodes == [("scaled_mm", True)], f"expected one CUTLASS scaled_mm node, got {nodes}"
    a2, _, _, _, _ = problem(m, n, k, torch.int8, seed=5)
    y = g(a2)
    torch.cuda.synchronize()
    assert torch.equal(y, cw.scaled_mm(a2, w.t(), sa, sb, torch.bfloat16))
