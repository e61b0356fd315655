"""In-place updates of captured cutlass_w8a8 kernel nodes (UpdatableGraph): new M, new operands, bad updates.

Every replay is checked against the float64 reference from the dequantized operands, on fresh random inputs,
with the output rows the update excludes poisoned (NaN) first: they must stay untouched.
"""

import pytest
import torch
from torch import nn

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import assert_close_to_reference, rand_operand, rand_scale, reference, scale_magnitudes
from cutlass_w8a8.graphs import UpdatableGraph

pytestmark = pytest.mark.cuda

K, N = 512, 768


def _fp8_ok():
    return cw.supports_fp8()


def linear(dtype=torch.int8, static=False, bias=True, k=K, n=N, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias).to("cuda", torch.bfloat16)
    scale = torch.tensor([0.05], device="cuda") if static else None
    return cw.W8A8Linear.from_float(lin, cw.W8A8Config(dtype=dtype), input_scale=scale)


def layer_reference(mod, x):
    if mod.input_scale is None:
        q, s = torch.ops.cutlass_w8a8.quantize_per_token(x, mod.quant_dtype)
    else:
        q, s = torch.ops.cutlass_w8a8.quantize_per_tensor(x, mod.input_scale, mod.quant_dtype), mod.input_scale
    return reference(q, mod.weight.t(), s, mod.weight_scale, mod.bias)


def accum_rel(mod):
    from cutlass_w8a8.testing.references import fp8_accum_bound
    return fp8_accum_bound(mod.in_features) if mod.quant_dtype == torch.float8_e4m3fn else 0.0


def check_rows(g, mod, m, seed, what):
    """Fresh input in all captured rows, NaN in the output, replay at m rows: rows < m right, rows >= m NaN."""
    x = torch.randn(g.static_inputs[0].shape, device="cuda", dtype=torch.bfloat16,
                    generator=torch.Generator("cuda").manual_seed(seed))
    g.static_inputs[0].copy_(x)
    g.static_outputs.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    out = g.static_outputs
    assert_close_to_reference(out[:m], layer_reference(mod, x[:m]), torch.bfloat16, accum_rel(mod), what=what)
    assert torch.isnan(out[m:].float()).all(), f"{what}: rows >= {m} were written"


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("static", [False, True])
@torch.no_grad()
def test_set_rows_linear(dtype, static):
    """Captured at M = 64; M walks across the decode buckets and back (the GEMM's config changes with M)."""
    if dtype == torch.float8_e4m3fn and not _fp8_ok():
        pytest.skip("no fp8 kernels on this device")
    mod = linear(dtype, static)
    g = UpdatableGraph(mod, [torch.randn(64, K, device="cuda", dtype=torch.bfloat16)])
    ops = [node.op for node in g.nodes]
    assert ops == ["quantize_per_tensor" if static else "quantize_per_token", "scaled_mm"], ops
    assert all(node.captured_rows == 64 for node in g.nodes)
    for i, m in enumerate([64, 1, 5, 16, 17, 33, 63, 2, 64]):
        g.set_rows(m)
        assert all(node.rows == m for node in g.nodes)
        check_rows(g, mod, m, seed=i, what=f"{dtype} static={static} M={m}")


@torch.no_grad()
def test_set_rows_keeps_cluster_config():
    """Captured at M = 512 (int8: 128x128 tiles, 2x1 clusters, whose cluster dims are a launch attribute of
    the node); smaller M that dispatch would give a 1x1-cluster config keeps the captured config, and all
    results stay right, so the cluster attribute survived the updates."""
    mod = linear(torch.int8, k=1024, n=4096)
    g = UpdatableGraph(mod, [torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)])
    gemm = [node for node in g.nodes if node.op == "scaled_mm"][0]
    assert gemm.config == 4, gemm  # Int8Configs entry 4: Config<128, 128, 128, 2, 1, ...>
    for i, m in enumerate([200, 8, 129, 1, 512]):
        g.set_rows(m)
        check_rows(g, mod, m, seed=i, what=f"cluster 2x1, M={m}")


@torch.no_grad()
def test_set_rows_with_pdl_edges():
    """M <= 16 GEMMs launch with programmatic dependent launch after the quantizer (an edge of the graph):
    after updates, 20 replays with new inputs each still read the quantizer's finished output."""
    mod = linear(torch.int8, k=4096, n=4096)
    prev = cw.set_pdl(True)
    try:
        g = UpdatableGraph(mod, [torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)])
    finally:
        cw.set_pdl(prev)
    for i in range(20):
        m = [3, 16, 1, 9][i % 4]
        g.set_rows(m)
        check_rows(g, mod, m, seed=100 + i, what=f"PDL replay {i}, M={m}")


def _gemm_operands(m, dtype, gen, k=K, n=N):
    mag_a, mag_b = scale_magnitudes(dtype, k)
    a = rand_operand((m, k), dtype, "cuda", gen)
    w = rand_operand((n, k), dtype, "cuda", gen)
    return (a, w.t(), rand_scale((m, 1), "cuda", mag_a, gen), rand_scale((n,), "cuda", mag_b, gen),
            torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen))


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@torch.no_grad()
def test_update_scaled_mm_new_operands(dtype):
    """A graph that runs scaled_mm(out=) on static buffers is re-pointed to new tensors of another M; the
    old output buffer is left alone, the new one holds the new product."""
    if dtype == torch.float8_e4m3fn and not _fp8_ok():
        pytest.skip("no fp8 kernels on this device")
    gen = torch.Generator("cuda").manual_seed(0)
    a, b, sa, sb, bias = _gemm_operands(48, dtype, gen)
    out = torch.empty(48, N, device="cuda", dtype=torch.bfloat16)
    g = UpdatableGraph(lambda a_: cw.scaled_mm(a_, b, sa, sb, bias=bias, out=out), [a])
    node = [n_ for n_ in g.nodes if n_.op == "scaled_mm"][0]
    accum = 0.0
    if dtype == torch.float8_e4m3fn:
        from cutlass_w8a8.testing.references import fp8_accum_bound
        accum = fp8_accum_bound(K)
    for i, m in enumerate([7, 48, 1, 30]):
        a2, b2, sa2, sb2, bias2 = _gemm_operands(m, dtype, gen)
        out2 = torch.full((m, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        out.fill_(float("nan"))
        g.update_scaled_mm(node, out2, a2, b2, sa2, sb2, bias2)
        g.replay()
        torch.cuda.synchronize()
        assert_close_to_reference(out2, reference(a2, b2, sa2, sb2, bias2), torch.bfloat16, accum,
                                  what=f"update {i}, M={m}")
        assert torch.isnan(out.float()).all(), f"update {i}: the captured output was written"
    # per-tensor scales and no bias are allowed too
    a2, b2, _, _, _ = _gemm_operands(5, dtype, gen)
    sa1, sb1 = torch.tensor([0.01], device="cuda"), torch.tensor([0.02], device="cuda")
    out2 = torch.empty(5, N, device="cuda", dtype=torch.bfloat16)
    g.update_scaled_mm(node, out2, a2, b2, sa1, sb1)
    g.replay()
    torch.cuda.synchronize()
    assert_close_to_reference(out2, reference(a2, b2, sa1, sb1), torch.bfloat16, accum, what="per-tensor")


@torch.no_grad()
def test_bad_updates_raise_and_change_nothing():
    mod = linear(torch.int8)
    g = UpdatableGraph(mod, [torch.randn(32, K, device="cuda", dtype=torch.bfloat16)])
    g.set_rows(9)
    check_rows(g, mod, 9, seed=0, what="before")
    for rows in (0, 33, -1):
        with pytest.raises(ValueError, match=r"`rows` must be in \[1, 32\]"):
            g.set_rows(rows)
    gemm = [n_ for n_ in g.nodes if n_.op == "scaled_mm"][0]
    quant = [n_ for n_ in g.nodes if n_.op != "scaled_mm"][0]
    gen = torch.Generator("cuda").manual_seed(1)
    a, b, sa, sb, _ = _gemm_operands(33, torch.int8, gen, k=K, n=N)
    out = torch.empty(33, N, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"`a` must have M = a.shape\[0\] in \[1, 32\]"):
        g.update_scaled_mm(gemm, out, a, b, sa, sb)
    a, b, sa, sb, _ = _gemm_operands(4, torch.int8, gen, k=K, n=N + 16)
    with pytest.raises(ValueError, match="`b` must keep the captured N"):
        g.update_scaled_mm(gemm, torch.empty(4, N + 16, device="cuda", dtype=torch.bfloat16), a, b, sa, sb)
    a, b, sa, sb, _ = _gemm_operands(4, torch.int8, gen)
    with pytest.raises(TypeError, match="captured output dtype"):
        g.update_scaled_mm(gemm, torch.empty(4, N, device="cuda", dtype=torch.float16), a, b, sa, sb)
    if _fp8_ok():
        a8, b8, sa8, sb8, _ = _gemm_operands(4, torch.float8_e4m3fn, gen)
        with pytest.raises(TypeError, match="captured operand dtype"):
            g.update_scaled_mm(gemm, torch.empty(4, N, device="cuda", dtype=torch.bfloat16), a8, b8, sa8, sb8)
    with pytest.raises(ValueError, match="must be a CUDA tensor on the graph's device"):
        g.update_scaled_mm(gemm, torch.empty(4, N, dtype=torch.bfloat16), a.cpu(), b.cpu(), sa.cpu(), sb.cpu())
    with pytest.raises(ValueError, match="not a checked scaled_mm node"):
        g.update_scaled_mm(quant, torch.empty(4, N, device="cuda", dtype=torch.bfloat16), a, b, sa, sb)
    with pytest.raises(ValueError, match="must be column-major"):
        g.update_scaled_mm(gemm, torch.empty(4, N, device="cuda", dtype=torch.bfloat16), a, b.contiguous(), sa, sb)
    # nothing changed: the graph still runs 9 rows into its own buffers
    assert [n_.rows for n_ in g.nodes] == [9, 9]
    check_rows(g, mod, 9, seed=2, what="after the rejected updates")
    g.reset()
    with pytest.raises(RuntimeError, match="was reset"):
        g.set_rows(3)


@torch.no_grad()
def test_graph_without_our_ops_and_capture_errors():
    """A graph with no cutlass_w8a8 kernel has no nodes; a failed capture leaves no recording open."""
    g = UpdatableGraph(lambda x: x * 2, [torch.randn(8, 16, device="cuda")])
    assert g.nodes == []
    g.set_rows(3)  # nothing to update

    def broken(x):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        UpdatableGraph(broken, [torch.randn(8, 16, device="cuda")], warmup=0)
    mod = linear(torch.int8)
    g2 = UpdatableGraph(mod, [torch.randn(8, K, device="cuda", dtype=torch.bfloat16)])
    assert len(g2.nodes) == 2


@torch.no_grad()
def test_update_is_cheap_on_the_host():
    """Not a speed goal (bench/bench_graph_update.py measures that): a no-change set_rows is a no-op and a
    changing one touches only the recorded nodes."""
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)]).to("cuda", torch.bfloat16)
    cw.quantize_(model)
    g = UpdatableGraph(model, [torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)])
    assert len(g.nodes) == 8
    for m in (64, 3, 3, 40):
        g.set_rows(m)
        assert {n_.rows for n_ in g.nodes} == {m}
