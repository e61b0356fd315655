"""Block-scaled fp8 on an sm90 GPU (issue 26), at the layer level: the block W8A8Linear against the float64
reference of its dequantized operands at M across the decode and CUTLASS paths, quantize_per_token_group and
the block weight quantization equal to the CPU bit for bit, the fused norm feeding a block layer, CUDA-graph
capture (CapturedGraph, UpdatableGraph.set_rows) and torch.compile equal to eager.

The GEMM kernels themselves are tested by tests/gemm/test_scaled_mm_block_cuda.py (CUTLASS blockwise configs) and the
decode helper's tests (decode GEMM, group-quantization kernel); the CPU side is tests/gemm/test_block_fp8_cpu.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cutlass_w8a8 as cw
from cutlass_w8a8.graphs import UpdatableGraph
from cutlass_w8a8.linear import quantize_weight_blocks
from cutlass_w8a8.testing.references import EPS32, assert_within, fp8_accum_bound, ulp

pytestmark = pytest.mark.sm90

FP8 = torch.float8_e4m3fn
BLOCK = 128
BLOCK_CFG = cw.W8A8Config(dtype=FP8, weight_block_size=(128, 128))


def bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def block_layer(k=1024, n=720, bias=True, seed=0, device="cuda"):
    """A block-scaled fp8 W8A8Linear (N = 720: a partial last row block) from a random bf16 Linear."""
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias).to(device, torch.bfloat16)
    return cw.W8A8Linear.from_float(lin, BLOCK_CFG)


def block_reference(q, s, mod):
    """(D, bound) of the layer on quantized activations q (M, K), s (M, K/128), in float64 from the dequantized
    operands. The bound: one rounding to bf16; float32 scaling and summing of the K/128 block partials
    ((K/128 + 4) eps32 sum|terms|); and Hopper's fp8 tensor-core accumulation within each 128-long block
    (`fp8_accum_bound(128)` of the block's terms, the decode GEMM's exact accumulation needs none)."""
    n = mod.out_features
    sa = s.double().repeat_interleave(BLOCK, dim=1)
    sb = mod.weight_scale.double().repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1)
    a_deq, w_deq = q.double() * sa, mod.weight.double() * sb
    d = a_deq @ w_deq.t()
    mag = d.abs()
    if mod.bias is not None:
        d = d + mod.bias.double()
        mag = mag + mod.bias.double().abs()
    abs_terms = a_deq.abs() @ w_deq.abs().t()
    kb = q.shape[1] // BLOCK
    return d, ((kb + 4) * EPS32 + fp8_accum_bound(BLOCK)) * abs_terms + 2 * EPS32 * mag


def assert_layer_close(y, x, mod, what):
    """y = mod(x) on CUDA against the float64 reference of its own (CUDA) quantized activations."""
    q, s = cw.quantize_per_token_group(x.reshape(-1, mod.in_features))
    d, bound = block_reference(q, s, mod)
    o = y.reshape(-1, mod.out_features).double()
    assert not torch.isnan(o).any(), what
    assert_within(o, d, bound + torch.maximum(ulp(d, y.dtype), ulp(o, y.dtype)), what, "(m, n) = ")


@pytest.mark.parametrize("m", [1, 7, 16, 100, 1024])
@pytest.mark.parametrize("bias", [True, False])
@torch.no_grad()
def test_block_layer_matches_fp64_reference(m, bias):
    mod = block_layer(bias=bias, seed=m)
    assert mod.weight.is_cuda and mod.weight_scale.shape == (6, 8) and mod.weight_scale.dtype == torch.float32
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    y = mod(x)
    assert y.shape == (m, 720) and y.dtype == torch.bfloat16
    assert_layer_close(y, x, mod, f"block W8A8Linear M={m} bias={bias}")
    # the layer is its two ops: group quantization, then the block GEMM
    q, s = cw.quantize_per_token_group(x)
    assert torch.equal(y, cw.scaled_mm(q, mod.weight.t(), s, mod.weight_scale, torch.bfloat16, mod.bias))
    assert torch.equal(mod(mod.quantize_input(x)), y)


@torch.no_grad()
def test_block_layer_leading_dims_and_float16():
    mod = block_layer(seed=3).half()
    assert mod.weight.dtype == FP8 and mod.weight_scale.dtype == torch.float32 and mod.bias.dtype == torch.float16
    x = torch.randn(2, 5, 1024, device="cuda", dtype=torch.float16)
    y = mod(x)
    assert y.shape == (2, 5, 720) and y.dtype == torch.float16
    assert_layer_close(y, x, mod, "float16 layer, (2, 5, K) input")
    assert torch.equal(y.reshape(10, 720), mod(x.reshape(10, 1024)))


@torch.no_grad()
def test_block_weight_quantization_equals_cpu():
    """from_float on a CUDA Linear gives the CPU's weight and block scales bit for bit (plain torch, IEEE
    division, the same rounding)."""
    torch.manual_seed(4)
    lin = nn.Linear(1024, 720).to(torch.bfloat16)
    cpu = cw.W8A8Linear.from_float(lin, BLOCK_CFG)
    gpu = cw.W8A8Linear.from_float(lin.cuda(), BLOCK_CFG)
    assert torch.equal(bits(gpu.weight.cpu()), bits(cpu.weight))
    assert torch.equal(gpu.weight_scale.cpu(), cpu.weight_scale)
    w = torch.randn(200, 300, device="cuda") * 10
    q, s = quantize_weight_blocks(w)
    q_cpu, s_cpu = quantize_weight_blocks(w.cpu())
    assert torch.equal(bits(q.cpu()), bits(q_cpu)) and torch.equal(s.cpu(), s_cpu)


@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("qdtype", [FP8, torch.int8])
@torch.no_grad()
def test_quantize_per_token_group_equals_cpu(xdtype, qdtype):
    """The CUDA op equals the CPU reference bit for bit: q and the (M, K/128) scales, with groups of very
    different magnitudes, a zero group and a zero row, on packed, padded and misaligned rows."""
    g = torch.Generator().manual_seed(5)
    m, k = 37, 1024
    mags = 10.0 ** torch.randint(-3, 4, (m, k // BLOCK), generator=g).float()
    x = torch.randn(m, k, generator=g) * mags.repeat_interleave(BLOCK, dim=1)
    x[3, 256:384] = 0
    x[5] = 0
    x = x.to(xdtype)
    q_cpu, s_cpu = cw.quantize_per_token_group(x, 128, qdtype)
    padded = torch.zeros(m, k + 64, dtype=xdtype, device="cuda")
    padded[:, :k] = x.cuda()
    shifted = torch.zeros(m, k + 8, dtype=xdtype, device="cuda")  # rows start one element into a row
    shifted[:, 1:k + 1] = x.cuda()
    for name, t in (("packed", x.cuda()), ("padded", padded[:, :k]), ("misaligned", shifted[:, 1:k + 1])):
        assert torch.equal(t.cpu(), x)
        q, s = cw.quantize_per_token_group(t, 128, qdtype)
        assert q.shape == (m, k) and s.shape == (m, k // BLOCK) and q.is_contiguous() and s.is_contiguous()
        assert torch.equal(bits(q.cpu()), bits(q_cpu)), f"{name}: q differs"
        assert torch.equal(s.cpu(), s_cpu), f"{name}: scales differ"


@torch.no_grad()
def test_fused_norm_feeds_block_layer_on_cuda():
    """rms_norm_quant with the layer's group_size gives the layer what it would quantize itself, bit for bit."""
    mod = block_layer(seed=6)
    h = torch.randn(9, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    qa = cw.QuantizedActivation(*cw.rms_norm_quant(h, w, 1e-5, mod.quant_dtype, None, group_size=mod.group_size))
    assert qa.scale.shape == (9, 8)
    assert torch.equal(mod(qa), mod(cw.rms_norm(h, w, 1e-5)))


def block_mlp(seed=7):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.SiLU(), nn.Linear(2048, 1024)).to("cuda", torch.bfloat16)
    return cw.quantize_(model, BLOCK_CFG)


@pytest.mark.parametrize("m", [1, 8, 16, 100])
@torch.no_grad()
def test_captured_graph_equals_eager(m):
    """A CapturedGraph of two block layers (and the SiLU between) replays the eager kernels: equal bitwise, on
    fresh inputs, without host synchronisation."""
    model = block_mlp()
    assert all(isinstance(model[i], cw.W8A8Linear) and model[i].weight_block_size == (128, 128) for i in (0, 2))
    x0 = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    inputs = [torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        g = cw.graphs.CapturedGraph(model, [x0])
        outs = [g(x).clone() for x in inputs]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for i, (x, out) in enumerate(zip(inputs, outs)):
        assert torch.equal(out, model(x)), f"replay {i}, M={m}"
    assert_layer_close(outs[0], model[1](model[0](inputs[0])), model[2], f"graph M={m}")


@torch.no_grad()
def test_updatable_graph_set_rows_block_layer():
    """An UpdatableGraph of a block layer records the group quantizer and the block GEMM; set_rows resizes both:
    rows < m right (float64 reference), rows >= m untouched."""
    mod = block_layer(seed=8)
    g = UpdatableGraph(mod, [torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)])
    ops = [node.op for node in g.nodes]
    assert ops == ["quantize_per_token_group", "scaled_mm"], ops
    for i, m in enumerate([64, 1, 5, 16, 17, 33, 2, 64]):
        g.set_rows(m)
        assert all(node.rows == m for node in g.nodes)
        x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(i))
        g.static_inputs[0].copy_(x)
        g.static_outputs.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        out = g.static_outputs
        assert_layer_close(out[:m], x[:m], mod, f"set_rows({m})")
        assert torch.isnan(out[m:].float()).all(), f"set_rows({m}): rows >= {m} were written"


@torch.no_grad()
def test_torch_compile_fullgraph_block_layers():
    """torch.compile(fullgraph=True) of two block layers with nothing between them calls the eager kernels:
    equal bitwise (default mode, then reduce-overhead, which replays a CUDA graph)."""
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024)).to("cuda", torch.bfloat16)
    model = cw.quantize_(model, BLOCK_CFG)
    compiled = torch.compile(model, fullgraph=True)
    for m in (16, 16, 33, 4):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(compiled(x), model(x)), f"M={m}"
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for i in range(4):
        x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(compiled(x), model(x)), f"reduce-overhead call {i}"
