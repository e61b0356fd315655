"""CUDA-graph capture and replay of W8A8 layers, checked against the float64 reference on every replay."""

import pytest
import torch
from torch import nn

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import assert_close_to_reference, reference

pytestmark = pytest.mark.cuda


def w8a8_mlp(d=512, hidden=1024, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(d, hidden), nn.SiLU(), nn.Linear(hidden, d)).to("cuda", torch.bfloat16)
    return cw.quantize_(model)


def layer_reference(mod, x):
    q, s = torch.ops.cutlass_w8a8.quantize_per_token(x, mod.quant_dtype)
    return reference(q, mod.weight.t(), s, mod.weight_scale, mod.bias)


def mlp_reference(model, x):
    """Eager W8A8 pass with the first layer's output rounded as the graph does, then the last layer's
    float64 reference; checks the graph's final output to the last layer's tolerance."""
    h = model[1](model[0](x))
    return layer_reference(model[2], h)


def check_replays(graph, make_input, ref_fn, replays=5):
    for i in range(replays):
        x = make_input(i)
        out = graph(x)
        graph.static_outputs  # noqa: B018 (the same tensor object every replay)
        ref = ref_fn(x)
        assert_close_to_reference(out, ref, torch.bfloat16, what=f"replay {i}")


@pytest.mark.parametrize("m", [1, 16, 100, 512])
def test_linear_capture_replay(m):
    mod = w8a8_mlp()[0]
    make = lambda i: torch.randn(m, 512, device="cuda", dtype=torch.bfloat16) * (i + 1)  # noqa: E731
    g = cw.graphs.CapturedGraph(mod, [make(0)])
    check_replays(g, make, lambda x: layer_reference(mod, x))


@pytest.mark.parametrize("m", [1, 64])
def test_mlp_capture_replay(m):
    model = w8a8_mlp()
    make = lambda i: torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    g = cw.graphs.CapturedGraph(model, [make(0)])
    check_replays(g, make, lambda x: mlp_reference(model, x))
    # replay equals the eager call exactly: the same kernels on the same inputs
    x = make(99)
    assert torch.equal(g(x), model(x))


def test_capture_replay_without_host_sync():
    """No op syncs the host during capture or replay: sync debug mode turns any sync into an error."""
    model = w8a8_mlp()
    x0 = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    inputs = [torch.randn(8, 512, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    refs = [mlp_reference(model, x) for x in inputs]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        g = cw.graphs.CapturedGraph(model, [x0])
        outs = [g(x).clone() for x in inputs]
        eager = model(inputs[0])  # eager ops do not sync either
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for out, ref in zip(outs, refs):
        assert_close_to_reference(out, ref, torch.bfloat16, what="sync-debug replay")
    assert torch.equal(eager, outs[0])


def test_capture_inside_user_stream():
    model = w8a8_mlp()
    s = torch.cuda.Stream()
    x0 = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    with torch.cuda.stream(s):
        g = cw.graphs.CapturedGraph(model, [x0], stream=s)
        x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
        out = g(x).clone()
    s.synchronize()
    ref = mlp_reference(model, x)
    assert_close_to_reference(out, ref, torch.bfloat16, what="user-stream capture")


def test_graphs_share_a_pool():
    model = w8a8_mlp()
    pool = torch.cuda.graph_pool_handle()
    graphs = {m: cw.graphs.CapturedGraph(model, [torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)],
                                         pool=pool) for m in (32, 16, 8)}
    for m, g in graphs.items():
        x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
        ref = mlp_reference(model, x)
        assert_close_to_reference(g(x), ref, torch.bfloat16, what=f"pool bucket {m}")


def linear_stack():
    """Two W8A8 layers with nothing between them: compiled code calls exactly the same kernels as eager,
    so results must be bitwise equal (an elementwise op between them could be fused differently)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512)).to("cuda", torch.bfloat16)
    return cw.quantize_(model)


def test_torch_compile_fullgraph():
    model = linear_stack()
    compiled = torch.compile(model, fullgraph=True)
    for m in (16, 16, 33):
        x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(compiled(x), model(x))


def test_torch_compile_reduce_overhead():
    model = linear_stack()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for i in range(4):  # the first calls record, later ones replay the cudagraph
        x = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(compiled(x), model(x)), f"call {i}"
