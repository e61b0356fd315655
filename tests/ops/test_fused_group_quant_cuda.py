"""rms_norm_quant / silu_mul_quant with group_size=128 on the GPU (csrc/quant/rms_norm.cu, silu_mul.cu; the per-group
tail GroupOut of quant/rowwise_reduce.cuh): the output row quantized per 1 x 128 group, scale (..., K / 128).

- fused == unfused chain on the GPU, bit for bit on any input: ``rms_norm_quant(..., group_size=128) ==
  quantize_per_token_group(rms_norm(...))`` and the same for silu_mul (the kernels round y to x's dtype, then
  quantize it with quantize_group.cu's arithmetic).
- GPU == CPU reference bit for bit on the exact inputs of _fused_quant_cuda.py (where no step depends on the
  order of a float32 sum or on the last bit of an exp / rsqrt), outputs poisoned first.
- Row lengths that take every launch shape in group mode: one block holding the row in registers (128 ..
  4096 elements; 8320 bf16, whose 8-block cluster parts of 130 vectors would split a group, so the register
  kernel), an 8-block cluster on sm90 (14336, 24576: parts of whole groups), the vectorized loop (70016 and
  40064: every dtype) and the scalar loop (misaligned rows).
- The C++ checks of the new argument, with the CPU implementation's messages.
"""

import pytest
import torch

import cutlass_w8a8 as cw

from _fused_quant_cuda import (DEV, EPS, OPS, POISON, QDTYPES, XDTYPES, assert_bits_equal, exact_norm_rows,
                               exact_silu_input, gaussian, poison_allocator, seed_of)

pytestmark = pytest.mark.cuda

G = 128


def out_bytes_group(shape, qdtype):
    """Bytes of q and of the (..., K / 128) scales of an op whose output row has shape[-1] elements."""
    n = 1
    for d in shape:
        n *= d
    return [n * torch.empty(0, dtype=qdtype).element_size(), n // G * 4]


# ---- fused == unfused chain on the GPU, any input -----------------------------------------------------------

NORM_SHAPES = [(1, 128), (7, 4096), (5, 8320), (33, 14336), (2, 24576), (3, 70016), (2, 3, 1024)]


@pytest.mark.parametrize("qdtype", QDTYPES, ids=str)
@pytest.mark.parametrize("dtype", XDTYPES, ids=str)
@pytest.mark.parametrize("shape", NORM_SHAPES + [(128, 40064)], ids=str)
def test_rms_norm_quant_groups_equal_the_chain(shape, dtype, qdtype):
    """K = 8320 and 40064 (16-bit x): rms_norm alone could take an 8-block cluster there (parts of 130 and 626
    vectors) while the group-quantized op cannot, so the two summed the squares in different orders and y differed
    in the last bit on some rows (a float32 emulation of the two orders at 40064: inv_rms differed on 1 row in 6, a
    q on 1 row in 50). 128 rows make that regression show on almost every run; rms_norm.cu now picks one launch
    shape per K for all its outputs."""
    x, w, r = gaussian(shape, dtype, seed_of("norm-group", shape, dtype, qdtype))
    x.view(-1, shape[-1])[0, :G] = 0  # a group of zeros: y 0 there, scale 0, q 0
    r.view(-1, shape[-1])[0, :G] = 0
    r1, r2 = r.clone(), r.clone()
    for res1, res2 in ((None, None), (r1, r2)):
        q, s = cw.rms_norm_quant(x, w, EPS, qdtype, None, res1, group_size=G)
        q_ref, s_ref = cw.quantize_per_token_group(cw.rms_norm(x, w, EPS, res2), G, qdtype)
        what = f"{shape} {dtype} {qdtype} residual={res1 is not None}"
        assert s.shape == (*shape[:-1], shape[-1] // G), what
        assert_bits_equal(q, q_ref.cpu(), f"{what}: q")
        assert_bits_equal(s, s_ref.cpu(), f"{what}: scales")
    assert_bits_equal(r1, r2.cpu(), "residual")


@pytest.mark.parametrize("qdtype", QDTYPES, ids=str)
@pytest.mark.parametrize("dtype", XDTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 256), (7, 8192), (5, 16640), (16, 28672), (3, 49152), (2, 140032),
                                   (2, 3, 2048)], ids=str)
def test_silu_mul_quant_groups_equal_the_chain(shape, dtype, qdtype):
    """I = 128 .. 4096 (registers), 8320 (bf16: registers, the cluster parts would split a group), 14336 and 24576
    (sm90: clusters of 8 for 16-bit x), 70016 (the vectorized loop)."""
    x, _, _ = gaussian(shape, dtype, seed_of("silu-group", shape, dtype, qdtype))
    q, s = cw.silu_mul_quant(x, qdtype, group_size=G)
    q_ref, s_ref = cw.quantize_per_token_group(cw.silu_mul(x), G, qdtype)
    assert s.shape == (*shape[:-1], shape[-1] // 2 // G)
    assert_bits_equal(q, q_ref.cpu(), f"{shape} {dtype} {qdtype}: q")
    assert_bits_equal(s, s_ref.cpu(), f"{shape} {dtype} {qdtype}: scales")


@pytest.mark.parametrize("qdtype", QDTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_misaligned_rows_equal_the_chain(dtype, qdtype):
    """x (and residual) one element into wider buffers: the scalar loop kernels, a warp per group."""
    m, k = 6, 4096
    x, w, r = gaussian((m, k + 1), dtype, seed_of("misaligned-group", dtype, qdtype))
    x, r = x[:, 1:], r[:, 1:]
    w = w[1:].contiguous()
    r1, r2 = r.clone(), r.clone()
    q, s = cw.rms_norm_quant(x, w, EPS, qdtype, None, r1, group_size=G)
    q_ref, s_ref = cw.quantize_per_token_group(cw.rms_norm(x, w, EPS, r2), G, qdtype)
    assert_bits_equal(q, q_ref.cpu(), "rms_norm_quant q")
    assert_bits_equal(s, s_ref.cpu(), "rms_norm_quant scales")
    xs = x[:, : 2 * 2048]
    q, s = cw.silu_mul_quant(xs, qdtype, group_size=G)
    q_ref, s_ref = cw.quantize_per_token_group(cw.silu_mul(xs), G, qdtype)
    assert_bits_equal(q, q_ref.cpu(), "silu_mul_quant q")
    assert_bits_equal(s, s_ref.cpu(), "silu_mul_quant scales")


# ---- GPU == CPU on exact inputs ------------------------------------------------------------------------------


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("qdtype", QDTYPES, ids=str)
@pytest.mark.parametrize("dtype", XDTYPES, ids=str)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_rms_norm_quant_groups_exact_vs_cpu(shape, dtype, qdtype, with_residual):
    gen = torch.Generator().manual_seed(seed_of("exact-norm-group", shape, dtype, qdtype, with_residual))
    k = shape[-1]
    eps = 1.0 / 16
    s = exact_norm_rows(shape, gen, eps)
    w = (torch.rand(k, generator=gen) * 1.5 + 0.25).to(dtype)
    if with_residual:
        r64 = torch.randint(-32, 33, shape, generator=gen).to(torch.float64)
        x, r = (s - r64).to(dtype), r64.to(dtype)
    else:
        x, r = s.to(dtype), None
    r_cpu = r.clone() if r is not None else None
    ref = OPS.rms_norm_quant(x, w, eps, qdtype, None, r_cpu, G)
    for byte in POISON:
        rd = r.to(DEV, copy=True) if r is not None else None
        poison_allocator(*out_bytes_group(shape, qdtype), byte=byte)
        got = OPS.rms_norm_quant(x.to(DEV), w.to(DEV), eps, qdtype, None, rd, G)
        what = f"{shape} {dtype} {qdtype} residual={with_residual} poison={byte:#x}"
        assert_bits_equal(got[0], ref[0], f"{what}: q")
        assert_bits_equal(got[1], ref[1], f"{what}: scales")
        if r is not None:
            assert_bits_equal(rd, r_cpu, f"{what}: residual")


@pytest.mark.parametrize("qdtype", QDTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 256), (7, 8192), (5, 16640), (16, 28672), (2, 140032)], ids=str)
def test_silu_mul_quant_groups_exact_vs_cpu(shape, dtype, qdtype):
    gen = torch.Generator().manual_seed(seed_of("exact-silu-group", shape, dtype, qdtype))
    x = exact_silu_input(shape, dtype, gen)
    ref = OPS.silu_mul_quant(x, qdtype, None, G)
    out_shape = (*shape[:-1], shape[-1] // 2)
    for byte in POISON:
        poison_allocator(*out_bytes_group(out_shape, qdtype), byte=byte)
        got = OPS.silu_mul_quant(x.to(DEV), qdtype, None, G)
        what = f"{shape} {dtype} {qdtype} poison={byte:#x}"
        assert_bits_equal(got[0], ref[0], f"{what}: q")
        assert_bits_equal(got[1], ref[1], f"{what}: scales")


# ---- graphs and checks ---------------------------------------------------------------------------------------


@torch.no_grad()
def test_updatable_graph_set_rows():
    """Both ops stay row-wise nodes in group mode: set_rows shrinks them, each M equals the eager call."""
    m, k = 16, 4096
    x0, w, r0 = gaussian((m, k), torch.bfloat16, seed_of("graph-group"))

    def fn(x, r, h):
        q, s = cw.rms_norm_quant(x, w, EPS, torch.float8_e4m3fn, None, r, group_size=G)
        q2, s2 = cw.silu_mul_quant(h, torch.float8_e4m3fn, group_size=G)
        return q, s, q2, s2

    h0 = gaussian((m, 2 * k), torch.bfloat16, seed_of("graph-group-h"))[0]
    graph = cw.graphs.UpdatableGraph(fn, [x0, r0.clone(), h0])
    assert {node.op for node in graph.nodes} == {"rms_norm_quant", "silu_mul_quant"}, graph.nodes
    for i, rows in enumerate((16, 1, 7, 16)):
        graph.set_rows(rows)
        x, _, r = gaussian((m, k), torch.bfloat16, seed_of("graph-group", i))
        h = gaussian((m, 2 * k), torch.bfloat16, seed_of("graph-group-h", i))[0]
        r_graph, r_eager = r.clone(), r[:rows].clone()
        got = graph(x, r_graph, h)
        want = fn(x[:rows], r_eager, h[:rows])
        for g_t, w_t, name in zip(got, want, ("q", "scales", "silu q", "silu scales")):
            assert_bits_equal(g_t[:rows], w_t.cpu(), f"rows={rows}: {name}")


def test_cpp_checks_name_the_argument():
    x, w, _ = gaussian((4, 256), torch.bfloat16, seed_of("checks-group"))
    fp8 = torch.float8_e4m3fn
    with pytest.raises(ValueError, match=r"^rms_norm_quant: `group_size` must be 0 \(per-token\) or 128, got 64$"):
        OPS.rms_norm_quant(x, w, EPS, fp8, None, None, 64)
    with pytest.raises(ValueError, match=r"^rms_norm_quant: `scale` must be None with group_size = 128 \(dynamic "
                                         r"per-group scales\), got a tensor$"):
        OPS.rms_norm_quant(x, w, EPS, fp8, torch.ones(1, device=DEV), None, G)
    with pytest.raises(ValueError, match=r"^rms_norm_quant: `x` the output row length 192 must be a multiple of "
                                         r"group_size = 128$"):
        OPS.rms_norm_quant(x[:, :192], w[:192], EPS, fp8, None, None, G)
    with pytest.raises(ValueError, match=r"^silu_mul_quant: `group_size` must be 0 \(per-token\) or 128, got 1$"):
        OPS.silu_mul_quant(x, fp8, None, 1)
    with pytest.raises(ValueError, match=r"^silu_mul_quant: `x` the output row length 64 must be a multiple of "
                                         r"group_size = 128$"):
        OPS.silu_mul_quant(x[:, :128], fp8, None, G)
    with pytest.raises(ValueError, match=r"^silu_mul_quant: `scale` must be None with group_size = 128"):
        OPS.silu_mul_quant(x, fp8, torch.ones(1, device=DEV), G)
