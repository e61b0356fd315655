"""Several GPUs: work on cuda:1 runs on cuda:1, mixed devices are rejected, graphs captured on cuda:1 replay.

Every test needs at least two CUDA devices (skipped otherwise; checked when the test runs, not at import).
The ops take their device from their tensors, never from the current device: the C++ entry points set a
device guard and launch on the tensors' device's current stream.
"""

import pytest
import torch
from torch import nn

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import fp8_accum_bound
from cutlass_w8a8.testing.references import assert_close_to_reference, rand_operand, rand_scale, reference, scale_magnitudes

pytestmark = pytest.mark.cuda

DTYPES = [torch.int8, torch.float8_e4m3fn]
QUANT = {torch.int8: cw.quantize_int8, torch.float8_e4m3fn: cw.quantize_fp8}


@pytest.fixture(autouse=True)
def two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
    torch.cuda.set_device(0)
    yield
    torch.cuda.set_device(0)


def problem(m, n, k, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    a = rand_operand((m, k), dtype, device, g)
    w = rand_operand((n, k), dtype, device, g)
    ma, mb = scale_magnitudes(dtype, k)
    sa, sb = rand_scale((m, 1), device, ma, g), rand_scale((n,), device, mb, g)
    bias = (torch.randn(n, device=device, generator=g) * 4).to(torch.bfloat16)
    return dict(a=a, b=w.t(), scale_a=sa, scale_b=sb, bias=bias)


def check(out, p, dtype, what):
    ref = reference(p["a"].cpu(), p["b"].cpu(), p["scale_a"].cpu(), p["scale_b"].cpu(), p["bias"].cpu())
    rel = fp8_accum_bound(ref.k) if dtype == torch.float8_e4m3fn else 0.0
    assert_close_to_reference(out.cpu(), ref, torch.bfloat16, accum_rel=rel, what=what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 100, 2048])
def test_ops_on_second_device(m, dtype):
    """With cuda:0 current, ops on cuda:1 tensors compute on cuda:1, correctly, and leave the current
    device alone; the results equal those of the same call on cuda:0 bit for bit (same kernels)."""
    p1 = problem(m, 512, 1024, dtype, "cuda:1", seed=m)
    p0 = {k: v.to("cuda:0") for k, v in p1.items()}
    with torch.cuda.device(0):
        y1 = cw.scaled_mm(p1["a"], p1["b"], p1["scale_a"], p1["scale_b"], torch.bfloat16, p1["bias"])
        out1 = torch.empty(m, 512, dtype=torch.bfloat16, device="cuda:1")
        cw.scaled_mm(p1["a"], p1["b"], p1["scale_a"], p1["scale_b"], bias=p1["bias"], out=out1)
        x1 = torch.randn(m, 1024, device="cuda:1", dtype=torch.bfloat16)
        q1, s1 = QUANT[dtype](x1)
        qs1, _ = QUANT[dtype](x1, torch.tensor([0.02], device="cuda:1"))
        assert torch.cuda.current_device() == 0
    assert y1.device == out1.device == q1.device == s1.device == qs1.device == torch.device("cuda:1")
    torch.cuda.synchronize(1)
    check(y1, p1, dtype, f"cuda:1 M={m}")
    check(out1, p1, dtype, f"cuda:1 out= M={m}")
    y0 = cw.scaled_mm(p0["a"], p0["b"], p0["scale_a"], p0["scale_b"], torch.bfloat16, p0["bias"])
    assert torch.equal(y0.cpu(), y1.cpu())
    q_ref, s_ref = QUANT[dtype](x1.cpu())
    assert torch.equal(q1.cpu().view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s1.cpu(), s_ref)


def test_second_device_side_stream():
    """Work goes to cuda:1's current stream: ready once that stream alone is synchronised."""
    p = problem(512, 2048, 4096, torch.int8, "cuda:1", seed=3)
    s = torch.cuda.Stream(device=1)
    torch.cuda.synchronize(1)
    with torch.cuda.stream(s):  # also makes cuda:1 current
        out = torch.full((512, 2048), float("nan"), dtype=torch.bfloat16, device="cuda:1")
        for _ in range(3):
            cw.scaled_mm(p["a"], p["b"], p["scale_a"], p["scale_b"], bias=p["bias"], out=out)
    s.synchronize()
    check(out, p, torch.int8, "cuda:1 side stream")


def test_w8a8_linear_on_second_device():
    torch.manual_seed(0)
    lin = nn.Linear(512, 256).to("cuda:1", torch.bfloat16)
    mod = cw.W8A8Linear.from_float(lin)
    assert mod.weight.device == torch.device("cuda:1")
    x = torch.randn(7, 512, device="cuda:1", dtype=torch.bfloat16)
    with torch.cuda.device(0):
        y = mod(x)
    assert y.device == torch.device("cuda:1")
    q, s = torch.ops.cutlass_w8a8.quantize_per_token(x, torch.int8)
    ref = reference(q.cpu(), mod.weight.t().cpu(), s.cpu(), mod.weight_scale.cpu(), mod.bias.cpu())
    assert_close_to_reference(y.cpu(), ref, torch.bfloat16, what="W8A8Linear on cuda:1")


@pytest.mark.parametrize("name", ["b", "scale_a", "scale_b", "bias", "out"])
def test_mixed_devices_rejected(name):
    """Each argument on cuda:1 while `a` is on cuda:0: ValueError naming it, from the wrapper and the op."""
    p = problem(8, 64, 128, torch.int8, "cuda:0")
    p["out"] = torch.empty(8, 64, dtype=torch.bfloat16, device="cuda:0")
    p[name] = p[name].to("cuda:1")
    match = f"scaled_mm: `{name}` is on cuda:1 but `a` is on cuda:0"
    with pytest.raises(ValueError, match=match):
        cw.scaled_mm(p["a"], p["b"], p["scale_a"], p["scale_b"], bias=p["bias"], out=p["out"])
    with pytest.raises(ValueError, match=match):
        torch.ops.cutlass_w8a8.scaled_mm_out(p["out"], p["a"], p["b"], p["scale_a"], p["scale_b"], p["bias"])
    if name != "out":
        with pytest.raises(ValueError, match=match):
            torch.ops.cutlass_w8a8.scaled_mm(p["a"], p["b"], p["scale_a"], p["scale_b"], torch.bfloat16,
                                             p["bias"])


def test_a_on_second_device_others_on_first_rejected():
    p = problem(8, 64, 128, torch.int8, "cuda:0")
    a1 = p["a"].to("cuda:1")
    with pytest.raises(ValueError, match="scaled_mm: `b` is on cuda:0 but `a` is on cuda:1"):
        cw.scaled_mm(a1, p["b"], p["scale_a"], p["scale_b"])
    with pytest.raises(ValueError, match="scaled_mm: `b` is on cuda:0 but `a` is on cuda:1"):
        torch.ops.cutlass_w8a8.scaled_mm(a1, p["b"], p["scale_a"], p["scale_b"], torch.bfloat16, None)


def test_quantize_static_scale_on_other_device_rejected():
    x = torch.randn(4, 64, device="cuda:1")
    scale = torch.tensor([0.1], device="cuda:0")
    with pytest.raises(ValueError, match="quantize_per_tensor: `scale` is on cuda:0 but `x` is on cuda:1"):
        cw.quantize_int8(x, scale)
    with pytest.raises(ValueError, match="quantize_per_tensor: `scale` is on cuda:0 but `x` is on cuda:1"):
        torch.ops.cutlass_w8a8.quantize_per_tensor(x, scale, torch.int8)


# ---- CUDA graphs on cuda:1 --------------------------------------------------------------------------------


def mlp_on(device, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 1024), nn.SiLU(), nn.Linear(1024, 512)).to(device, torch.bfloat16)
    return cw.quantize_(model)


def check_graph_replays(graph, model, device, replays=4):
    """New inputs each replay; the replay must equal the eager model bit for bit (same kernels) and stay
    within tolerance of the last layer's float64 reference. A graph that captured nothing (work launched
    outside the capture) would return the capture-time output again and fail here."""
    for i in range(replays):
        x = torch.randn(16, 512, device=device, dtype=torch.bfloat16) * (i + 1)
        out = graph(x).clone()
        eager = model(x)
        assert out.device == torch.device(device)
        assert torch.equal(out, eager), f"replay {i} differs from eager"
        h = model[1](model[0](x))
        q, s = torch.ops.cutlass_w8a8.quantize_per_token(h, torch.int8)
        ref = reference(q, model[2].weight.t(), s, model[2].weight_scale, model[2].bias)
        assert_close_to_reference(out, ref, torch.bfloat16, what=f"{device} replay {i}")


def _capture_once_on_first_device():
    """torch.cuda.graph creates its default capture stream once per process, on the device current at the
    first capture: do one capture on cuda:0 first, as any earlier test or user code may have done."""
    m0 = mlp_on("cuda:0", seed=1)
    cw.graphs.CapturedGraph(m0, [torch.randn(4, 512, device="cuda:0", dtype=torch.bfloat16)])


def test_graph_captured_on_second_device():
    """Capture under torch.cuda.device(1), replay there with fresh inputs."""
    _capture_once_on_first_device()
    model = mlp_on("cuda:1")
    with torch.cuda.device(1):
        g = cw.graphs.CapturedGraph(model, [torch.randn(16, 512, device="cuda:1", dtype=torch.bfloat16)])
        check_graph_replays(g, model, "cuda:1")


def test_graph_captured_on_second_device_explicit_stream():
    """The same with a capture stream on cuda:1 passed explicitly (does not depend on torch's default)."""
    _capture_once_on_first_device()
    model = mlp_on("cuda:1")
    s = torch.cuda.Stream(device=1)
    with torch.cuda.device(1):
        g = cw.graphs.CapturedGraph(model, [torch.randn(16, 512, device="cuda:1", dtype=torch.bfloat16)], stream=s)
        check_graph_replays(g, model, "cuda:1")


def test_graph_on_second_device_while_first_is_current():
    """CapturedGraph takes its device from its inputs: capture and replay with cuda:0 current."""
    _capture_once_on_first_device()
    model = mlp_on("cuda:1")
    with torch.cuda.device(0):
        g = cw.graphs.CapturedGraph(model, [torch.randn(16, 512, device="cuda:1", dtype=torch.bfloat16)])
        check_graph_replays(g, model, "cuda:1")
        assert torch.cuda.current_device() == 0
