"""add_rms_norm_moe_router_route's CUDA kernel (csrc/moe/router_route.cu, router_norm_route_kernel*: the post-attention
norm folded into moe_router_route's cluster kernel) against the two ops it replaces, fused_add_rms_norm on a copy of
the residual then moe_router_route, bit for bit:

- every T from 1 to 16 at the Qwen3-MoE dims (H 2048 / 4096, E 128 / 64, top-8 / top-2), softmax and sigmoid with a
  correction bias, bfloat16 and float16: y, residual_out, topk_weights and topk_ids equal (every CTA sums the squares
  in fused_add_rms_norm's order, and the router's plan, sums and routing are moe_router_route's), `residual` left
  unchanged, outputs from poisoned memory;
- the other families (Mixtral's E 8 in two H slices, DeepSeek-V3's E 256 at H 7168 with float32 logits and grouped
  top-k, E 1024) at T 1 / 9 / 16, wherever the op runs its kernel or its fallback;
- which kernel ran (the profiler): the fused one at the Qwen3 dims (one-slice 8-CTA kernel at H 2048 E 128; the
  general kernel for Mixtral's slices; the 16-CTA one at H 4096 E 128 where clusters of 16 are resident);
- graph replay (side-stream warm-up, sync debug mode "error") equal to eager with new inputs between replays;
- the decoder with CUTLASS_W8A8_FUSED_NORM_ROUTER=1 against the switch off: logits equal bit for bit (a process each
  is not needed: the switch is read at each layer call).
"""

from __future__ import annotations

import math

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.ops import add_rms_norm_moe_router_route
from _fused_quant_cuda import poison_allocator, replay_and_eager

pytestmark = pytest.mark.cuda

DEV = "cuda"
EPS = 1e-6
OPS = torch.ops.cutlass_w8a8

# (H, E, top_k): Qwen3-30B-A3B, Qwen3-235B-A22B (E 128 x H 4096 = 1 MiB: the wide plan), OLMoE-like E 64, top-2
DIMS = [(2048, 128, 8), (4096, 128, 8), (2048, 64, 2), (4096, 64, 8)]
SCORINGS = {"softmax": dict(renormalize=True), "sigmoid": dict(scoring="sigmoid", renormalize=True,
                                                                scaling_factor=2.5)}
# (name, H, E, top_k, routing kwargs, logits dtype)
FAMILIES = [
    ("mixtral", 4096, 8, 2, dict(renormalize=True), None),
    ("deepseek_v3", 7168, 256, 8, dict(scoring="sigmoid", n_group=8, topk_group=4, renormalize=True,
                                       scaling_factor=2.5), torch.float32),
    ("glm4_5", 5120, 160, 8, dict(scoring="sigmoid", renormalize=True, scaling_factor=2.5), torch.float32),
    ("mixtral_slices", 2112, 8, 2, dict(renormalize=True), None),
    ("limits", 256, 1024, 16, dict(scoring="sigmoid", n_group=32, topk_group=4, renormalize=True), None),
]


def _inputs(t, e, h, dtype, seed, biased):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, h, generator=g) * 2).to(DEV, dtype)
    r = (torch.randn(t, h, generator=g) * 4).to(DEV, dtype)
    nw = (1 + 0.2 * torch.randn(h, generator=g)).to(DEV, dtype)
    w = (torch.randn(e, h, generator=g) / math.sqrt(h)).to(DEV, dtype)
    bias = (torch.randn(e, generator=g) * 0.05).to(DEV) if biased else None
    return x, r, nw, w, bias


def _chain(x, r, nw, w, k, **kw):
    stream = r.clone()
    y = OPS.fused_add_rms_norm(x, stream, nw, EPS)
    return (y, stream) + tuple(cw.moe_router_route(y, w, k, **kw))


def _check(x, r, nw, w, k, what, **kw):
    r_before = r.clone()
    t, h = x.shape
    poison_allocator(t * h * x.element_size(), t * h * x.element_size(), t * k * 4, t * k * 4)
    got = add_rms_norm_moe_router_route(x, r, nw, EPS, w, k, **kw)
    want = _chain(x, r, nw, w, k, **kw)
    assert torch.equal(r, r_before), f"{what}: residual was written"
    for i, (a, b, name) in enumerate(zip(got, want, ("y", "residual_out", "topk_weights", "topk_ids"))):
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous(), (what, name)
        bad = (a != b).reshape(a.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
        assert torch.equal(a, b), f"{what}: {name} differs in rows {bad}"
    return got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scoring", list(SCORINGS))
@pytest.mark.parametrize("dims", DIMS, ids=[f"h{h}_e{e}_k{k}" for h, e, k in DIMS])
def test_bitwise_equal_to_the_two_ops_every_t(dims, scoring, dtype):
    h, e, k = dims
    for t in range(1, 17):
        x, r, nw, w, bias = _inputs(t, e, h, dtype, seed=31 * t + e + h, biased=scoring == "sigmoid")
        _check(x, r, nw, w, k, f"T={t} H={h} E={e} k={k} {scoring} {dtype}", correction_bias=bias,
               **SCORINGS[scoring])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 9, 16])
@pytest.mark.parametrize("fam", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_bitwise_equal_other_families(fam, t, dtype):
    name, h, e, k, kw, ldt = fam
    biased = kw.get("scoring") == "sigmoid"
    x, r, nw, w, bias = _inputs(t, e, h, dtype, seed=7 * t + e, biased=biased)
    _check(x, r, nw, w, k, f"{name} T={t} {dtype}", correction_bias=bias, logits_dtype=ldt, **kw)


def test_strided_rows_and_residual_aliasing_x():
    """x and residual row-strided views (pitch H + 64), and residual = x itself (read only: the same bits)."""
    h, e, k, t = 2048, 128, 8, 5
    g = torch.Generator().manual_seed(5)
    x = torch.randn(t, h + 64, generator=g).to(DEV, torch.bfloat16)[:, 64:]
    r = (torch.randn(t, h + 64, generator=g) * 4).to(DEV, torch.bfloat16)[:, 64:]
    nw = (1 + 0.2 * torch.randn(h, generator=g)).to(DEV, torch.bfloat16)
    w = (torch.randn(e, h, generator=g) / math.sqrt(h)).to(DEV, torch.bfloat16)
    _check(x, r, nw, w, k, "strided")
    _check(x, x, nw, w, k, "aliased")


def _kernel_names(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [evt.name for evt in prof.events() if evt.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("h, e, k", [(2048, 128, 8), (4096, 8, 2), (2112, 8, 2), (4096, 128, 8), (7168, 256, 8)])
@pytest.mark.parametrize("t", [1, 16])
def test_the_fused_kernel_runs(h, e, k, t):
    """The op launches one router_norm_route_kernel* (and no rms_norm kernel) at the Qwen3 / Mixtral dims: the
    8-CTA one-slice kernel, the general kernel (Mixtral at H 4096 / 2112: two slices), and at the 1 MiB routers
    (E 128 x H 4096; DeepSeek-V3 at T 1) the 16-CTA one on 132-SM sm90 parts; DeepSeek-V3's H 7168 at T 16 needs
    16 x 7176 x 2 bytes of y rows besides the router's 48 KiB, above 227 KiB: the two ops."""
    props = torch.cuda.get_device_properties(DEV)
    if props.major < 9:
        pytest.skip("no clusters before sm90: the two ops")
    x, r, nw, w, _ = _inputs(t, e, h, torch.bfloat16, seed=1, biased=False)
    add_rms_norm_moe_router_route(x, r, nw, EPS, w, k)  # warm-up (lazy loading, attributes)
    names = _kernel_names(lambda: add_rms_norm_moe_router_route(x, r, nw, EPS, w, k))
    if not names:
        pytest.skip("the profiler recorded no CUDA kernels here (no CUPTI)")
    fused = [n for n in names if "router_norm_route_kernel" in n]
    ctas, slices = cw._ext.moe_router_route_plan(torch.cuda.current_device(), e, h, torch.bfloat16)
    base = 4 * (8 * (2 if t > 8 else 1) * 128 + (-(-t // ctas)) * slices * e + min(8, -(-t // ctas)) * e)
    need = -(-base // 16) * 16 + t * (h + 8) * 2 + 9 * 16 * 4
    if need > 227 * 1024:
        assert not fused and any("router_route_kernel" in n for n in names), names
        return
    if ctas == 16 and not fused:
        pytest.skip("no cluster of 16 CTAs with the y rows resident here: the two ops")
    assert len(fused) == 1 and len(names) == 1, names
    if ctas == 8 and slices == 1:
        assert "router_norm_route_kernel_one_slice" in fused[0], fused
    else:
        assert "router_norm_route_kernel_one_slice" not in fused[0], fused


@pytest.mark.parametrize("t", [1, 8, 16])
def test_graph_replay_equals_eager(t):
    h, e, k = 2048, 128, 8
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(e, h, generator=g) / math.sqrt(h)).to(DEV, torch.bfloat16)
    w2 = (torch.randn(64, 4096, generator=g) / 64).to(DEV, torch.bfloat16)
    nw = (1 + 0.2 * torch.randn(h, generator=g)).to(DEV, torch.bfloat16)
    nw2 = (1 + 0.2 * torch.randn(4096, generator=g)).to(DEV, torch.bfloat16)
    x = torch.zeros(t, h, dtype=torch.bfloat16, device=DEV)
    r = torch.zeros(t, h, dtype=torch.bfloat16, device=DEV)
    x2 = torch.zeros(t, 4096, dtype=torch.bfloat16, device=DEV)
    bias = torch.zeros(64, device=DEV)

    def step():
        return (add_rms_norm_moe_router_route(x, r, nw, EPS, w, k)
                + add_rms_norm_moe_router_route(x2, x2, nw2, EPS, w2, 4, scoring="sigmoid", correction_bias=bias))

    def draw():
        return [torch.randn(t, h, generator=g).to(DEV, torch.bfloat16),
                (torch.randn(t, h, generator=g) * 4).to(DEV, torch.bfloat16),
                torch.randn(t, 4096, generator=g).to(DEV, torch.bfloat16), (torch.randn(64, generator=g) * 0.05).to(DEV)]

    inputs = [draw() for _ in range(3)]
    results = replay_and_eager(step, (x, r, x2, bias), inputs)
    for i, (replayed, eager) in enumerate(results):
        for j, (a, b) in enumerate(zip(replayed, eager)):
            assert torch.equal(a, b), f"replay {i}, output {j}"
    assert not torch.equal(results[0][1][3], results[1][1][3])  # the replays saw the new inputs
    x.copy_(inputs[-1][0])
    r.copy_(inputs[-1][1])
    want = _chain(x, r, nw, w, k)
    for a, b in zip(results[-1][0][:4], want):
        assert torch.equal(a, b)


def test_zero_tokens_and_device_errors():
    w = torch.zeros(8, 64, dtype=torch.bfloat16, device=DEV)
    z = torch.zeros(0, 64, dtype=torch.bfloat16, device=DEV)
    nw = torch.ones(64, dtype=torch.bfloat16, device=DEV)
    y, ro, tw, ti = add_rms_norm_moe_router_route(z, z, nw, EPS, w, 2)
    assert y.shape == ro.shape == (0, 64) and tw.shape == ti.shape == (0, 2) and tw.device.type == "cuda"
    x = torch.zeros(2, 64, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match=r"add_rms_norm_moe_router_route: `residual` is on cpu but `x` is on cuda"):
        add_rms_norm_moe_router_route(x, x.cpu(), nw, EPS, w, 2)
    with pytest.raises(ValueError, match=r"add_rms_norm_moe_router_route: `norm_weight` is on cpu but `x` is on cuda"):
        add_rms_norm_moe_router_route(x, x, nw.cpu(), EPS, w, 2)


@pytest.mark.parametrize("quant", ["int8", "fp8"])
@pytest.mark.parametrize("batch", [1, 4, 16])
@torch.no_grad()
def test_decoder_logits_equal_switch_on_off(quant, batch, monkeypatch):
    """A W8A8 Qwen3-MoE-shaped decoder (H 2048, E 128, top-8) on CUDA: CUTLASS_W8A8_FUSED_NORM_ROUTER=1 against the
    switch off, three steps, logits equal bit for bit (two models with the same weights and caches)."""
    from cutlass_w8a8.models import LlamaConfig, LlamaDecoder

    if quant == "fp8" and not cw.ops.supports_fp8():
        pytest.skip("no fp8 here")
    cfg = LlamaConfig(vocab_size=512, hidden_size=2048, intermediate_size=1024, num_layers=2, num_heads=16,
                      num_kv_heads=4, max_position=256, qk_norm=True, num_experts=128, num_experts_per_tok=8,
                      moe_intermediate_size=256)
    models = [LlamaDecoder(cfg, quant, max_batch=16, max_seq_len=64, device=DEV, seed=3) for _ in range(2)]
    g = torch.Generator().manual_seed(batch)
    slots = torch.randperm(16, generator=g)[:batch].to(DEV)
    start = torch.randint(0, 60, (batch,), generator=g)
    for i in range(3):
        tok = torch.randint(0, cfg.vocab_size, (batch,), generator=g).to(DEV)
        pos = (start + i).to(DEV)
        monkeypatch.setenv("CUTLASS_W8A8_FUSED_NORM_ROUTER", "1")
        a = models[0](tok, pos, slots)
        monkeypatch.setenv("CUTLASS_W8A8_FUSED_NORM_ROUTER", "0")
        b = models[1](tok, pos, slots)
        assert torch.equal(a, b), f"step {i}"
