"""moe_router_route on the CPU (ops/_reference.py) and its dispatch rule (issue 36: the router GEMM and the routing
in one kernel at decode sizes):

- the op is ``moe_route(F.linear(x, w) in logits_dtype)`` bit for bit, for every routing family (Qwen3-MoE,
  Mixtral, OLMoE: logits in the model dtype; DeepSeek-V3 / GLM-4.5: sigmoid, correction bias, grouped top-k,
  float32 logits as transformers' ``F.linear(x.float(), w.float())``), with T from 0 to the limit;
- the fake kernel's shapes (opcheck runs the op's cases of tests/_moe_routing.py in test_moe_routing_cpu.py);
- `W8A8MoE.router_route_fits` / `router_route_pays` / `router_route_applies`: the decode rule (ops/_limits.py
  MOE_ROUTER_ROUTE_MAX_T), the speed rule (MOE_ROUTER_ROUTE_MIN_EXPERTS, MOE_ROUTER_ROUTE_MAX_WEIGHT_BYTES) and
  every layout the op refuses; `route_from_hidden` on the CPU is the two ops;
- the reference decoder's MoE block and DecodeStep's MoeMLP route through `route_from_hidden`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cutlass_w8a8 as cw
from cutlass_w8a8.ops._limits import (MOE_ROUTER_H_MULTIPLE, MOE_ROUTER_ROUTE_MAX_T, MOE_ROUTER_ROUTE_MAX_WEIGHT_BYTES,
                                      MOE_ROUTER_ROUTE_MIN_EXPERTS)

# (name, E, H, top_k, routing kwargs, logits_dtype)
FAMILIES = [
    ("qwen3_moe", 128, 256, 8, dict(renormalize=True), None),
    ("mixtral", 8, 128, 2, dict(renormalize=True), None),
    ("olmoe", 64, 128, 8, dict(renormalize=False), None),
    ("deepseek_v3", 256, 128, 8, dict(scoring="sigmoid", n_group=8, topk_group=4, renormalize=True,
                                      scaling_factor=2.5), torch.float32),
    ("glm4_5", 160, 128, 8, dict(scoring="sigmoid", renormalize=True, scaling_factor=2.5), torch.float32),
]


def _inputs(t, e, h, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w = (torch.randn(e, h, generator=g) / h**0.5).to(dtype)
    bias = torch.randn(e, generator=g) * 0.05
    return x, w, bias


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [0, 1, 7, MOE_ROUTER_ROUTE_MAX_T])
@pytest.mark.parametrize("fam", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_equals_linear_then_moe_route(fam, t, dtype):
    name, e, h, k, kw, logits_dtype = fam
    x, w, bias = _inputs(t, e, h, dtype)
    if kw.get("scoring") == "sigmoid":
        kw = {**kw, "correction_bias": bias}
    got = cw.moe_router_route(x, w, k, logits_dtype=logits_dtype, **kw)
    logits = F.linear(x, w) if logits_dtype is None else F.linear(x.float(), w.float())
    assert logits.dtype == (dtype if logits_dtype is None else torch.float32)
    want = cw.moe_route(logits, k, **kw)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape == (t, k)
        assert torch.equal(a, b), name


def test_logits_dtype_changes_the_rounding():
    """bf16 logits (x's dtype) and float32 logits are different routings of the same x: the logits are rounded to
    logits_dtype before the softmax (on these inputs at least one weight differs)."""
    x, w, _ = _inputs(16, 64, 128)
    w16, _ = cw.moe_router_route(x, w, 4, renormalize=False)
    w32, _ = cw.moe_router_route(x, w, 4, renormalize=False, logits_dtype=torch.float32)
    assert not torch.equal(w16, w32)
    assert torch.equal(w32, cw.moe_route(F.linear(x.float(), w.float()), 4, renormalize=False)[0])


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 128, dtype=torch.bfloat16)
        w = torch.empty(16, 128, dtype=torch.bfloat16)
        tw, ids = cw.moe_router_route(x, w, 3)
    assert tw.shape == ids.shape == (5, 3) and tw.dtype == torch.float32 and ids.dtype == torch.int32


def test_compile_fullgraph():
    x, w, _ = _inputs(3, 16, 128)
    fn = torch.compile(lambda a, b: cw.moe_router_route(a, b, 2), fullgraph=True, backend="eager")
    for a, b in zip(fn(x, w), cw.moe_router_route(x, w, 2)):
        assert torch.equal(a, b)


# ---- the dispatch rule ----------------------------------------------------------------------------------------


def _layer(e=16, h=128, top_k=2, **kw):
    return cw.W8A8MoE(e, top_k, h, 64, **kw)


def test_rule_fits_at_decode_sizes_only():
    layer = _layer()
    w = torch.zeros(16, 128, dtype=torch.bfloat16)
    for t in range(1, MOE_ROUTER_ROUTE_MAX_T + 1):
        assert layer.router_route_fits(torch.zeros(t, 128, dtype=torch.bfloat16), w)
    assert not layer.router_route_fits(torch.zeros(0, 128, dtype=torch.bfloat16), w)
    assert not layer.router_route_fits(torch.zeros(MOE_ROUTER_ROUTE_MAX_T + 1, 128, dtype=torch.bfloat16), w)
    assert layer.fused_router is True  # the default; False is the A/B switch (tests/moe/test_moe_router_route_cuda.py)
    # the CPU never takes it (the op's CPU implementation is the reference of the two ops, not a kernel)
    assert not layer.router_route_applies(torch.zeros(1, 128, dtype=torch.bfloat16), w)


def test_speed_rule_takes_the_measured_winners_only():
    """router_route_pays (ops/_limits.py's two bounds): the measured routers, Mixtral's 8 experts to Kimi-K2's
    5.25 MiB, take the fused op; fewer experts or a heavier router the two ops; the bounds themselves are inclusive."""
    pays = cw.W8A8MoE.router_route_pays
    meta = dict(dtype=torch.bfloat16, device="meta")
    for e, h in [(8, 4096), (64, 2048), (128, 2048), (160, 5120), (256, 7168), (384, 7168)]:  # Mixtral .. Kimi-K2
        assert pays(torch.empty(e, h, **meta)), (e, h)
    assert pays(torch.empty(MOE_ROUTER_ROUTE_MIN_EXPERTS, 64, **meta))
    assert not pays(torch.empty(MOE_ROUTER_ROUTE_MIN_EXPERTS - 1, 64, **meta))
    h = MOE_ROUTER_ROUTE_MAX_WEIGHT_BYTES // (2 * 512)
    assert pays(torch.empty(512, h, **meta)) and not pays(torch.empty(512, h + 64, **meta))
    assert not pays(torch.empty(384, 7168, dtype=torch.float32, device="meta"))  # 10.5 MiB in float32
    assert not pays(torch.empty(128, 2048, 1, **meta))  # not a matrix


@pytest.mark.parametrize("why", ["x_float32", "weight_dtype", "weight_shape", "h_multiple", "logits_dtype",
                                 "x_strided", "weight_pitch", "weight_offset", "x_3d"])
def test_rule_refuses_what_the_op_refuses(why):
    """Every call the rule sends to the fused op is one the op accepts: each layout it refuses raises in the op."""
    e, h = 16, 128
    layer = _layer(e, h)
    x = torch.zeros(2, h, dtype=torch.bfloat16)
    w = torch.zeros(e, h, dtype=torch.bfloat16)
    ld = None
    if why == "x_float32":
        x = x.float()
    elif why == "weight_dtype":
        w = w.half()
    elif why == "weight_shape":
        w = torch.zeros(e + 1, h, dtype=torch.bfloat16)
    elif why == "h_multiple":
        layer = _layer(e, 96)
        x, w = torch.zeros(2, 96, dtype=torch.bfloat16), torch.zeros(e, 96, dtype=torch.bfloat16)
    elif why == "logits_dtype":
        ld = torch.float16
    elif why == "x_strided":
        x = torch.zeros(2, 2 * h, dtype=torch.bfloat16)[:, ::2]
    elif why == "weight_pitch":
        w = torch.zeros(e, h + 4, dtype=torch.bfloat16)[:, :h]
    elif why == "weight_offset":
        w = torch.zeros(e * h + 8, dtype=torch.bfloat16)[1:1 + e * h].view(e, h)
    elif why == "x_3d":
        x = x.unsqueeze(0)
    assert not layer.router_route_fits(x, w, ld)
    if why != "weight_shape":  # a router of another E is the layer's misuse, not the op's (it routes E + 1)
        with pytest.raises((TypeError, ValueError), match="moe_router_route: `"):
            cw.moe_router_route(x, w, 2, logits_dtype=ld)


def test_route_from_hidden_on_cpu_is_the_two_ops():
    layer = _layer(16, 128, 4, renormalize=False, scoring="sigmoid", n_group=4, topk_group=2,
                   correction_bias=torch.randn(16) * 0.1)
    x, w, _ = _inputs(5, 16, 128)
    for ld in (None, torch.float32):
        got = layer.route_from_hidden(x, w, ld)
        logits = F.linear(x, w) if ld is None else F.linear(x.float(), w.float())
        for a, b in zip(got, layer.route(logits)):
            assert torch.equal(a, b)
        # and the op (what CUDA runs at decode sizes) gives the same on the CPU
        op = cw.moe_router_route(x, w, 4, scoring="sigmoid", correction_bias=layer.correction_bias, n_group=4,
                                 topk_group=2, renormalize=False, logits_dtype=ld)
        for a, b in zip(got, op):
            assert torch.equal(a, b)


def test_router_route_plan_needs_the_extension():
    """cutlass_w8a8._ext.moe_router_route_plan names itself when the CUDA extension is not loaded."""
    if cw.cuda_ops_available():
        pytest.skip("the CUDA extension is loaded here")
    with pytest.raises(RuntimeError, match="moe_router_route_plan: the CUDA extension is not loaded"):
        cw._ext.moe_router_route_plan(0, 128, 2048, torch.bfloat16)
