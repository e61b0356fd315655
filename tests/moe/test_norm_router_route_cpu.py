"""add_rms_norm_moe_router_route on CPU tensors (issue 36: the post-attention norm folded into the router kernel):
the CPU implementation, the checks, the fake kernel, opcheck. The CUDA kernel: tests/moe/test_norm_router_route_cuda.py.

The CPU implementation is the chain the op replaces, fused_add_rms_norm's CPU implementation on a copy of the residual
(which becomes residual_out) then moe_router_route's, so on the CPU the op equals that chain bit for bit by
construction; these tests pin that down (every routing family, T from 0 to the limit, both dtypes), that `residual`
is left unchanged, the outputs' layout, the fake kernel's shapes and the limits the op shares with moe_router_route.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cutlass_w8a8 as cw
from cutlass_w8a8.ops import add_rms_norm_moe_router_route
from cutlass_w8a8.ops._limits import MOE_ROUTER_ROUTE_MAX_T, NORM_DECODE_MAX_K
from _opcheck import run_opcheck
from test_moe_router_route_cpu import FAMILIES as ROUTER_FAMILIES

OPS = torch.ops.cutlass_w8a8
EPS = 1e-6

# (name, E, H, top_k, routing kwargs, logits_dtype): moe_router_route's CPU test rows but GLM-4.5's
FAMILIES = [f for f in ROUTER_FAMILIES if f[0] != "glm4_5"]


def _inputs(t, e, h, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, h, generator=g) * 2).to(dtype)
    r = (torch.randn(t, h, generator=g) * 4).to(dtype)
    nw = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    w = (torch.randn(e, h, generator=g) / h**0.5).to(dtype)
    bias = torch.randn(e, generator=g) * 0.05
    return x, r, nw, w, bias


def _chain(x, r, nw, w, k, **kw):
    stream = r.clone()
    y = OPS.fused_add_rms_norm(x, stream, nw, EPS)
    return (y, stream) + tuple(cw.moe_router_route(y, w, k, **kw))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [0, 1, 7, MOE_ROUTER_ROUTE_MAX_T])
@pytest.mark.parametrize("fam", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_equals_fused_add_rms_norm_then_router_route(fam, t, dtype):
    name, e, h, k, kw, ldt = fam
    x, r, nw, w, bias = _inputs(t, e, h, dtype, seed=t + e)
    kw = {**kw, "logits_dtype": ldt}
    if kw.get("scoring") == "sigmoid":
        kw["correction_bias"] = bias
    r_before = r.clone()
    got = add_rms_norm_moe_router_route(x, r, nw, EPS, w, k, **kw)
    want = _chain(x, r, nw, w, k, **kw)
    assert torch.equal(r, r_before), "residual must not be written"
    shapes = [(t, h), (t, h), (t, k), (t, k)]
    dtypes = [dtype, dtype, torch.float32, torch.int32]
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == shapes[i] and a.dtype == dtypes[i] and a.is_contiguous(), (name, i)
        assert torch.equal(a, b), f"{name}: output {i}"
    # y against the float64 norm of residual + x (one rounding of s and one of y, each half an ulp of its dtype)
    if t:
        s = (r.float() + x.float()).to(dtype)
        assert torch.equal(got[1], s)
        sd = s.double()
        y64 = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + EPS) * nw.double()
        ulp = torch.finfo(dtype).eps
        assert ((got[0].double() - y64).abs() <= 2 * ulp * y64.abs() + 1e-30).all(), name


def test_residual_aliasing_x_and_strided_views():
    """residual may be x itself (the first layer's stream) and both may be row-strided views with a pitch that is a
    multiple of 8: the same results as the chain on contiguous copies."""
    x, r, nw, w, _ = _inputs(5, 64, 128, seed=3)
    got = add_rms_norm_moe_router_route(x, x, nw, EPS, w, 4)
    want = _chain(x, x.clone(), nw, w, 4)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    buf = torch.zeros(5, 192, dtype=torch.bfloat16)
    buf[:, 64:] = r
    view = buf[:, 64:]
    got = add_rms_norm_moe_router_route(x, view, nw, EPS, w, 4)
    want = _chain(x, r.clone(), nw, w, 4)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(buf[:, 64:], r)


def test_limits_and_errors():
    x, r, nw, w, _ = _inputs(2, 8, 64)
    with pytest.raises(ValueError, match=r"add_rms_norm_moe_router_route: `x` has 17 rows"):
        add_rms_norm_moe_router_route(torch.zeros(17, 64, dtype=torch.bfloat16), r, nw, EPS, w, 2)
    h = NORM_DECODE_MAX_K
    ok = add_rms_norm_moe_router_route(torch.zeros(1, h, dtype=torch.bfloat16), torch.zeros(1, h, dtype=torch.bfloat16),
                                       torch.ones(h, dtype=torch.bfloat16), EPS, torch.zeros(8, h, dtype=torch.bfloat16), 2)
    assert ok[0].shape == (1, h)
    h += 64
    with pytest.raises(ValueError, match=rf"`x` H = x.shape\[1\] must be at most {NORM_DECODE_MAX_K}"):
        add_rms_norm_moe_router_route(torch.zeros(1, h, dtype=torch.bfloat16), torch.zeros(1, h, dtype=torch.bfloat16),
                                      torch.ones(h, dtype=torch.bfloat16), EPS, torch.zeros(8, h, dtype=torch.bfloat16), 2)
    with pytest.raises(TypeError, match=r"`router_weight` must have x's dtype"):
        add_rms_norm_moe_router_route(x, r, nw, EPS, w.float(), 2)
    with pytest.raises(TypeError, match=r"`x` must be bfloat16 or float16"):
        add_rms_norm_moe_router_route(x.float(), r.float(), nw.float(), EPS, w.float(), 2)
    with pytest.raises(ValueError, match=r"`eps` must be a finite number >= 0, got inf"):
        add_rms_norm_moe_router_route(x, r, nw, float("inf"), w, 2)
    with pytest.raises(ValueError, match=r"`top_k` must be in \[1, E\]"):
        add_rms_norm_moe_router_route(x, r, nw, EPS, w, 9)


def test_fake_shapes_and_checks():
    x, r, nw, w, bias = _inputs(6, 16, 128, torch.float16)
    with FakeTensorMode() as mode:
        fx, fr, fnw, fw = (mode.from_tensor(t) for t in (x, r, nw, w))
        y, ro, tw, ti = OPS.add_rms_norm_moe_router_route(fx, fr, fnw, EPS, fw, 4)
        assert y.shape == ro.shape == (6, 128) and y.dtype == ro.dtype == torch.float16
        assert tw.shape == ti.shape == (6, 4) and tw.dtype == torch.float32 and ti.dtype == torch.int32
        with pytest.raises(ValueError, match=r"add_rms_norm_moe_router_route: `norm_weight` must be \[H\]"):
            OPS.add_rms_norm_moe_router_route(fx, fr, fnw[:64], EPS, fw, 4)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_opcheck_cpu(scoring):
    x, r, nw, w, bias = _inputs(5, 16, 128, seed=7)
    run_opcheck(OPS.add_rms_norm_moe_router_route,
                (x, r, nw, EPS, w, 4, scoring, bias if scoring == "sigmoid" else None, 1, 1, True, 1.0, None))


def test_exported():
    assert cw.ops.add_rms_norm_moe_router_route is add_rms_norm_moe_router_route
    assert "add_rms_norm_moe_router_route" in cw.ops.__all__
    assert "add_rms_norm_moe_router_route" in cw.ops.moe.__all__
