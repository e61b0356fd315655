"""`W8A8MoE` on the CPU (the MoE ops' references): the layer against a float64 reference of its dequantized
weights with the same activation quantization, both forward modes (router logits; transformers' top-k ids and
weights), `from_float` against `W8A8Linear.from_float` per expert, the refusals, dtype casts and state_dict, and
`quantize_` on tiny random Qwen3-MoE, Qwen2-MoE and Mixtral models (tests/_moe_models.py): logits against the
dequantized reference (SQNR), greedy tokens identical, warnings and errors; torch.compile(fullgraph=True).

The reference (`_moe_models.FakeQuantExperts`) is written from the layer's definition, not from the ops: the
dequantized weights in float64, activations quantized per token (per 1 x 128 group for block fp8, per tensor
when static) as `W8A8Linear` does, each GEMM's output rounded to bf16, ``silu(gate) * up`` in bf16, the top-k sum
in float32. The ops' CPU references round their float32 accumulators and scales once more, so the layer may
differ from it by one bf16 ulp in an intermediate, rarely; measured here: bit for bit at every tested shape.
"""

from __future__ import annotations

import copy
import shutil
import warnings

import pytest
import torch
from torch import nn

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import rel_err

transformers = pytest.importorskip("transformers")

from _moe_models import (EXPERTS, HIDDEN, KINDS, MOE_I, TOP_K, VOCAB, FakeQuantExperts,  # noqa: E402
                         dequantized_reference, moe_blocks, tiny_moe_config, tiny_moe_model)

FP8 = torch.float8_e4m3fn
SCHEMES = {
    "int8": cw.W8A8Config(dtype=torch.int8),
    "fp8": cw.W8A8Config(dtype=FP8),
    "fp8-block": cw.W8A8Config(dtype=FP8, weight_block_size=(128, 128)),
}
# The layer vs its float64 reference (rel. Frobenius error). Measured 0 (bit for bit) on the CPU for every scheme,
# T and mode below; the bound leaves room for an intermediate rounded one bf16 ulp apart (float32 vs float64
# accumulation of the ops' references) and its effect on the next quantization. A wrong expert, scale or weight
# gives errors of order 1.
LAYER_REL_ERR = 2e-3
# quantize_d bf16 models: logits vs the dequantized reference (float64 layers, same activation quantization,
# the rest of the model the same bf16 modules). Measured 35.5 dB (Qwen3-MoE int8: one attention output one bf16
# ulp apart, which moves later activations' quantization and one routing choice) to inf (bit for bit).
MODEL_SQNR_DB = 30.0
# ... and vs the bf16 model itself (the quantization error): measured 30.9-35.2 dB int8, 21.7-24.2 dB fp8 / block.
VS_BF16_SQNR_DB = {"int8": 28.0, "fp8": 18.0, "fp8-block": 18.0}
# float32 models (no bf16 ties in logits or routers): greedy tokens identical to the reference's, logits over the
# generated sequence measured 45.8 dB to inf.
FLOAT32_MODEL_SQNR_DB = 40.0
NEW_TOKENS = 6
PROMPT = 8

needs_cxx = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                               reason="torch.compile on the CPU needs a C++ compiler (g++, c++ or clang++)")


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    """10 log10(|ref|^2 / |x - ref|^2) in dB, float64 (inf when equal)."""
    x, ref = x.double(), ref.double()
    noise = (x - ref).pow(2).sum()
    return float("inf") if noise == 0 else float(10 * torch.log10(ref.pow(2).sum() / noise))


def experts_module(kind="qwen3_moe", seed=0, dtype=torch.bfloat16):
    """A transformers experts module (fused 3-D gate_up_proj [8, 256, 256] / down_proj [8, 256, 128]) and its
    block, from the first layer of a tiny model."""
    model = tiny_moe_model(kind, seed=seed, dtype=dtype)
    block = moe_blocks(model)[0][1]
    return block.experts, block


def layer(scheme="int8", seed=0, **kw):
    experts, _ = experts_module(seed=seed)
    return cw.W8A8MoE.from_float(experts, SCHEMES[scheme], TOP_K, True, **kw)


def inputs(t, seed=1, e=EXPERTS, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, HIDDEN, generator=g).to(dtype), 2 * torch.randn(t, e, generator=g))


def routing(kind: str, t: int, seed=2):
    """(topk_ids int64 [t, 2], topk_weights bf16 [t, 2]): 'random' (distinct experts per token), 'one-expert'
    (every token's first choice expert 3, second expert 5: six experts empty), 'unrouted' (expert parallelism's
    -1 for some second choices)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(t)])
    if kind == "one-expert":
        ids = torch.tensor([[3, 5]]).repeat(t, 1)
    elif kind == "unrouted":
        ids[::2, 1] = -1
    w = torch.rand(t, TOP_K, generator=g)
    return ids, (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------
# construction


@pytest.mark.parametrize("scheme", SCHEMES)
def test_buffers(scheme):
    cfg = SCHEMES[scheme]
    mod = cw.W8A8MoE(EXPERTS, TOP_K, HIDDEN, MOE_I, cfg)
    e, h, i = EXPERTS, HIDDEN, MOE_I
    want = {"w13": ((e, 2 * i, h), cfg.dtype), "w2": ((e, h, i), cfg.dtype)}
    if scheme == "fp8-block":
        want |= {"w13_scale": ((e, 2, 2), torch.float32), "w2_scale": ((e, 2, 1), torch.float32)}
    else:
        want |= {"w13_scale": ((e, 2 * i), torch.float32), "w2_scale": ((e, h), torch.float32)}
    got = {k: (tuple(v.shape), v.dtype) for k, v in mod.state_dict().items()}
    assert got == want
    assert mod.a13_scale is None and mod.a2_scale is None
    assert mod.group_size == (128 if scheme == "fp8-block" else 0)
    assert mod.dtype == torch.bfloat16 and mod.quant_dtype == cfg.dtype
    if scheme != "fp8-block":
        static = cw.W8A8MoE(EXPERTS, TOP_K, HIDDEN, MOE_I, cfg, static_input_scale=True)
        sd = static.state_dict()
        assert (sd["a13_scale"].shape, sd["a2_scale"].shape) == ((1,), (1,))
        assert sd["a13_scale"].dtype == torch.float32


def test_block_partial_row_blocks():
    """N = 2I and H need not be multiples of 128 for the weight's row blocks, but K (H for w13, I for w2) must:
    I = 128, H = 384 gives w13_scale [E, 2, 3] and w2_scale [E, 3, 1]."""
    mod = cw.W8A8MoE(4, 2, 384, 128, SCHEMES["fp8-block"])
    assert tuple(mod.w13_scale.shape) == (4, 2, 3) and tuple(mod.w2_scale.shape) == (4, 3, 1)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(num_experts=0), ValueError, "`num_experts` must be a positive int"),
    (dict(top_k=9), ValueError, r"`top_k` = 9 must be <= num_experts = 8"),
    (dict(hidden_size=200), ValueError, r"`hidden_size` = 200 must be a multiple of 16"),
    (dict(intermediate_size=64, config=SCHEMES["fp8-block"]), ValueError,
     r"`intermediate_size` = 64 must be a multiple of 128 with weight_block_size"),
    (dict(activation="gelu"), ValueError, "`activation` must be 'silu'"),
    (dict(config="int8"), TypeError, "`config` must be a cutlass_w8a8.W8A8Config"),
    (dict(config=SCHEMES["fp8-block"], static_input_scale=True), ValueError,
     "`static_input_scale` must be False with weight_block_size"),
    (dict(scoring="softplus"), ValueError, r"`scoring` must be one of \('softmax', 'sigmoid'\), got 'softplus'"),
    (dict(n_group=0), ValueError, "`n_group` must be a positive int, got 0"),
    (dict(n_group=3), ValueError, "`n_group` = 3 must divide num_experts = 8"),
    (dict(n_group=4, topk_group=5), ValueError, "`topk_group` = 5 must be <= n_group = 4"),
    (dict(top_k=3, n_group=4, topk_group=1), ValueError,
     r"`top_k` = 3 must be <= topk_group \* num_experts / n_group = 2"),
    (dict(scaling_factor=0.0), ValueError, "`scaling_factor` must be a finite positive float, got 0.0"),
    (dict(scaling_factor=float("inf")), ValueError, "`scaling_factor` must be a finite positive float"),
    (dict(correction_bias=torch.zeros(7)), ValueError,
     r"`correction_bias` must have num_experts = 8 elements \(\[E\]\), got shape \(7,\)"),
    (dict(correction_bias=torch.zeros(8, dtype=torch.int32)), TypeError,
     r"`correction_bias` must be a floating-point tensor \[E\], got torch.int32"),
])
def test_constructor_refusals(kwargs, exc, match):
    args = dict(num_experts=EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, intermediate_size=MOE_I) | kwargs
    with pytest.raises(exc, match=match):
        cw.W8A8MoE(**args)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_from_float_quantizes_each_expert_as_w8a8linear(scheme):
    """w13[e] / w2[e] and their scales equal, bit for bit, W8A8Linear.from_float of expert e's gate_up and down
    weights (per-channel absmax / 127 or / 448, or 128 x 128 blocks)."""
    experts, _ = experts_module()
    mod = cw.W8A8MoE.from_float(experts, SCHEMES[scheme], TOP_K, False)
    assert (mod.top_k, mod.renormalize, mod.dtype) == (TOP_K, False, torch.bfloat16)
    for e in (0, 5, EXPERTS - 1):
        for w, q, s in ((experts.gate_up_proj[e], mod.w13[e], mod.w13_scale[e]),
                        (experts.down_proj[e], mod.w2[e], mod.w2_scale[e])):
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
            with torch.no_grad():
                lin.weight.copy_(w)
            ref = cw.W8A8Linear.from_float(lin, SCHEMES[scheme])
            assert torch.equal(q.view(torch.uint8), ref.weight.view(torch.uint8))
            assert torch.equal(s, ref.weight_scale.reshape(s.shape))


def test_from_float_out_dtype():
    experts, _ = experts_module(dtype=torch.float16)
    assert cw.W8A8MoE.from_float(experts, None, TOP_K).dtype == torch.float16
    assert cw.W8A8MoE.from_float(experts, cw.W8A8Config(out_dtype=torch.bfloat16), TOP_K).dtype == torch.bfloat16
    experts32, _ = experts_module(dtype=torch.float32)
    assert cw.W8A8MoE.from_float(experts32, None, TOP_K).dtype == torch.bfloat16


class _Experts(nn.Module):
    def __init__(self, gu, dn, act=None):
        super().__init__()
        self.gate_up_proj, self.down_proj = nn.Parameter(gu, requires_grad=False), nn.Parameter(dn, requires_grad=False)
        if act is not None:
            self.act_fn = act


def _transposed():
    experts, _ = experts_module()
    experts.is_transposed = True
    return experts


@pytest.mark.parametrize("make, kw, exc, match", [
    (lambda: nn.Linear(16, 16), {}, TypeError, r"must hold 3-D `gate_up_proj` \[E, 2I, H\] and `down_proj`"),
    (lambda: _Experts(torch.zeros(2, 32, 16, dtype=torch.int8), torch.zeros(2, 16, 16, dtype=torch.int8)), {},
     TypeError, r"`experts.gate_up_proj` holds torch.int8 values"),
    (lambda: _Experts(torch.zeros(2, 32, 16), torch.zeros(2, 16, 32)), {}, ValueError,
     r"`experts.down_proj` must be \[E, H, I\] = \[2, 16, 16\]"),
    (lambda: _Experts(torch.zeros(2, 32, 16), torch.zeros(2, 16, 16), nn.GELU()), {}, ValueError,
     "`experts.act_fn` must be SiLU"),
    (_transposed, {}, ValueError, "`experts.is_transposed` must be False"),
    (lambda: experts_module()[0], dict(a13_scale=torch.ones(1)), ValueError, "give both `a13_scale` and `a2_scale`"),
    (lambda: layer(), {}, TypeError, "`experts` is already a W8A8MoE"),
    (lambda: experts_module()[0], dict(top_k=None), ValueError, r"`top_k` must be given \(Qwen3MoeExperts has no"),
])
def test_from_float_refusals(make, kw, exc, match):
    kw = dict(top_k=TOP_K) | kw
    with pytest.raises(exc, match=match):
        cw.W8A8MoE.from_float(make(), None, renormalize=True, **kw)


def test_extra_repr():
    assert repr(layer("fp8-block")).startswith(
        "W8A8MoE(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128, renormalize=True, "
        "scoring=softmax, n_group=1, topk_group=1, scaling_factor=1.0, correction_bias=False, activation=silu, "
        "dtype=torch.bfloat16, quant_dtype=torch.float8_e4m3fn, weight_block_size=(128, 128), "
        "activations=dynamic per-group (1x128))")
    assert "activations=dynamic per-token" in repr(layer("int8"))
    routed = layer("int8", scoring="sigmoid", n_group=4, topk_group=2, scaling_factor=2.5,
                   correction_bias=torch.zeros(EXPERTS))
    assert ("renormalize=True, scoring=sigmoid, n_group=4, topk_group=2, scaling_factor=2.5, correction_bias=True, "
            "activation=silu") in repr(routed)


# ---------------------------------------------------------------------------------------------------------------
# forward


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("t", [1, 7, 64])
def test_router_logits_mode_matches_reference(scheme, t):
    mod = layer(scheme)
    ref = FakeQuantExperts(mod, torch.float64)
    x, logits = inputs(t)
    y = mod(x, logits)
    assert y.dtype == torch.bfloat16 and y.shape == (t, HIDDEN)
    r = ref(x, logits)
    assert rel_err(y.float(), r.float()) <= LAYER_REL_ERR, (scheme, t)
    # the router of the layer: renormalized top-2 of the float32 softmax (a layer without renormalization differs)
    mod.renormalize = False
    assert rel_err(mod(x, logits).float(), r.float()) > 10 * LAYER_REL_ERR


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("route", ["random", "one-expert", "unrouted"])
@pytest.mark.parametrize("t", [1, 9, 64])
def test_topk_mode_matches_reference(scheme, route, t):
    """transformers' call, experts(hidden, top_k_index int64, top_k_weights bf16): empty experts, every token on
    the same two experts, unrouted -1 ids (their pairs contribute nothing)."""
    mod = layer(scheme)
    ref = FakeQuantExperts(mod, torch.float64)
    x, _ = inputs(t)
    ids, w = routing(route, t)
    y = mod(x, ids, w)
    r = ref(x, ids, w)
    assert y.dtype == torch.bfloat16 and y.shape == (t, HIDDEN)
    assert rel_err(y.float(), r.float()) <= LAYER_REL_ERR, (scheme, route, t)
    assert torch.equal(mod(x, ids.to(torch.int32), w.float()), y)  # int32 ids, float32 weights: the same
    if route == "unrouted":  # token 0's second expert dropped: only its first expert's output, weighted
        only_first = ref(x[:1], ids[:1, :1], w[:1, :1])
        assert rel_err(y[:1].float(), only_first.float()) <= LAYER_REL_ERR


def test_static_activation_scales():
    experts, _ = experts_module()
    mod = cw.W8A8MoE.from_float(experts, SCHEMES["int8"], TOP_K, True, a13_scale=torch.tensor([0.03]),
                                a2_scale=torch.tensor(0.002))
    assert mod.a13_scale.shape == (1,) and "static per-tensor" in repr(mod)
    x, logits = inputs(16)
    r = FakeQuantExperts(mod, torch.float64)(x, logits)
    y = mod(x, logits)
    assert rel_err(y.float(), r.float()) <= LAYER_REL_ERR
    dynamic = cw.W8A8MoE.from_float(experts, SCHEMES["int8"], TOP_K, True)
    assert not torch.equal(dynamic(x, logits), y)


def test_shapes_and_dtypes():
    """[..., H] inputs with [..., E] logits or [T, k] ids; the output has hidden_states' shape and dtype
    (float32 in, float32 out; the GEMMs run in the layer's bf16)."""
    mod = layer("int8")
    x, logits = inputs(6)
    y = mod(x, logits)
    y3 = mod(x.reshape(2, 3, HIDDEN), logits.reshape(2, 3, EXPERTS))
    assert y3.shape == (2, 3, HIDDEN) and torch.equal(y3.reshape(6, HIDDEN), y)
    ids, w = routing("random", 6)
    assert torch.equal(mod(x.reshape(2, 3, HIDDEN), ids, w).reshape(6, HIDDEN), mod(x, ids, w))
    x32 = x.float()
    y32 = mod(x32, logits)
    assert y32.dtype == torch.float32
    r = FakeQuantExperts(mod, torch.float64)(x32, logits)
    assert r.dtype == torch.float32 and rel_err(y32, r) <= LAYER_REL_ERR
    assert mod(x.half(), logits).dtype == torch.float16
    assert mod(x[:0], logits[:0]).shape == (0, HIDDEN)
    assert mod(x[:0], ids[:0], w[:0]).shape == (0, HIDDEN)


def _bad_inputs():
    x, logits = inputs(4)
    ids, w = routing("random", 4)
    return [
        ((x[:, :128], logits), ValueError, r"`hidden_states` must be \[\.\.\., hidden_size = 256\]"),
        ((x.to(torch.int32), logits), TypeError, "`hidden_states` must be floating point"),
        (([1.0], logits), TypeError, "`hidden_states` must be a torch.Tensor"),
        ((x, logits[:, :4]), ValueError, r"`router_logits_or_topk_ids` \(router logits\) must be \[T = 4, E = 8\]"),
        ((x, ids), TypeError, "`router_logits_or_topk_ids` must be floating-point router logits"),
        ((x, ids.float(), w), TypeError, "`topk_ids` .* must be int32 or int64"),
        ((x, ids[:3], w[:3]), ValueError, r"`topk_ids` must be \[T = 4, k\]"),
        ((x, ids, w[:, :1]), ValueError, "`topk_weights` must have topk_ids' shape"),
        ((x, ids, ids), TypeError, "`topk_weights` must be floating point"),
        ((x, ids, w.tolist()), TypeError, "`topk_weights` must be a torch.Tensor"),
        ((x.to("meta"), logits), ValueError, "`hidden_states` is on meta but the layer is on cpu"),
        ((x, logits.to("meta")), ValueError, "`router_logits_or_topk_ids` is on meta but `hidden_states` is on cpu"),
    ]


@pytest.mark.parametrize("i", range(len(_bad_inputs())))
def test_forward_refusals(i):
    args, exc, match = _bad_inputs()[i]
    with pytest.raises(exc, match=match):
        layer("int8")(*args)


def test_routing_arguments_are_held():
    """The router-logits-mode routing: held as given; the correction bias a non-persistent float32 buffer (the
    state dict gains no key: transformers' routers hold the persistent one), the caller's float32 tensor itself
    (from_float shares the router's buffer), a float32 copy of another dtype, moved with the layer, never cast."""
    bias = torch.randn(EXPERTS)
    mod = layer("fp8-block", scoring="sigmoid", n_group=2, topk_group=1, scaling_factor=2.5, correction_bias=bias)
    assert (mod.scoring, mod.n_group, mod.topk_group, mod.scaling_factor) == ("sigmoid", 2, 1, 2.5)
    assert mod.correction_bias is bias
    assert set(mod.state_dict()) == {"w13", "w13_scale", "w2", "w2_scale"}
    assert set(layer("int8").state_dict()) == set(mod.state_dict()) and layer("int8").correction_bias is None
    mod.half()
    assert mod.correction_bias.dtype == torch.float32 and torch.equal(mod.correction_bias, bias)
    mod.to("meta")
    assert mod.correction_bias.device.type == "meta"
    b16 = bias.to(torch.bfloat16)
    copied = cw.W8A8MoE(EXPERTS, TOP_K, HIDDEN, MOE_I, correction_bias=b16.reshape(1, EXPERTS))
    assert copied.correction_bias.dtype == torch.float32 and copied.correction_bias.shape == (EXPERTS,)
    assert torch.equal(copied.correction_bias, b16.float().reshape(EXPERTS))
    param = nn.Parameter(bias.reshape(1, EXPERTS), requires_grad=False)  # Ernie-4.5-MoE's [1, E] parameter
    viewed = cw.W8A8MoE(EXPERTS, TOP_K, HIDDEN, MOE_I, correction_bias=param)
    assert viewed.correction_bias.shape == (EXPERTS,) and viewed.correction_bias.data_ptr() == param.data_ptr()


def test_dtype_casts_and_state_dict():
    """A model's .to(float16) / .float() never touch the 8-bit weights or float32 scales (as W8A8Linear); the
    state_dict loads into a fresh layer that then computes the same."""
    mod = layer("fp8-block")
    w13 = mod.w13.clone()
    mod.half()
    assert mod.dtype == torch.float16 and mod.w13.dtype == FP8 and mod.w13_scale.dtype == torch.float32
    assert torch.equal(mod.w13.view(torch.uint8), w13.view(torch.uint8))
    mod.float()
    assert mod.dtype == torch.float16 and mod.w2_scale.dtype == torch.float32
    mod.to(torch.bfloat16)
    assert mod.dtype == torch.bfloat16
    fresh = cw.W8A8MoE(EXPERTS, TOP_K, HIDDEN, MOE_I, SCHEMES["fp8-block"])
    fresh.load_state_dict(mod.state_dict())
    x, logits = inputs(5)
    assert torch.equal(fresh(x, logits), mod(x, logits))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=[pytest.mark.full, needs_cxx])])
@pytest.mark.parametrize("scheme", ["int8", "fp8-block"])
def test_torch_compile_fullgraph(scheme, backend):
    """One graph per mode (every op has a fake), equal to eager bit for bit (the ops are the same calls); inductor
    (C++ on the CPU, ~20 s of CPU per process when its cache is cold) in the full run."""
    mod = layer(scheme)
    torch._dynamo.reset()
    compiled = torch.compile(mod, fullgraph=True, backend=backend)
    for t in (3, 11):
        x, logits = inputs(t, seed=t)
        assert torch.equal(compiled(x, logits), mod(x, logits))
        ids, w = routing("random", t)
        assert torch.equal(compiled(x, ids, w), mod(x, ids, w))


# ---------------------------------------------------------------------------------------------------------------
# quantize_ on transformers models


def _quantize(model, scheme, **kw):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = cw.quantize_(model, SCHEMES[scheme], filter_fn=lambda m, fqn: "lm_head" not in fqn, **kw)
    assert out is model
    return [str(w.message) for w in rec]


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_swaps_experts(kind):
    model = tiny_moe_model(kind)
    gates = {n: b.gate.weight.clone() for n, b in moe_blocks(model)}
    messages = _quantize(model, "int8")
    blocks = moe_blocks(model)
    assert len(blocks) == 2
    for name, block in blocks:
        ex = block.experts
        assert type(ex) is cw.W8A8MoE, name
        assert (ex.num_experts, ex.top_k, ex.hidden_size, ex.intermediate_size) == (EXPERTS, TOP_K, HIDDEN, MOE_I)
        assert ex.renormalize is (kind != "qwen2_moe")  # Mixtral always; Qwen norm_topk_prob (False for Qwen2 here)
        assert ex.dtype == torch.bfloat16
        # the router stays as it was, in bf16
        assert block.gate.weight.dtype == torch.bfloat16 and torch.equal(block.gate.weight, gates[name])
        assert "Router" in type(block.gate).__name__
        if kind == "qwen2_moe":
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert type(getattr(block.shared_expert, proj)) is cw.W8A8Linear
            assert type(block.shared_expert_gate) is nn.Linear  # N = 1
    assert type(model.model.layers[0].self_attn.q_proj) is cw.W8A8Linear
    assert type(model.lm_head) is nn.Linear
    if kind == "qwen2_moe":
        assert len(messages) == 2 and all("shared_expert_gate' in float" in m for m in messages), messages
    else:
        assert messages == []


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_logits_bf16(kind, scheme):
    base = tiny_moe_model(kind)
    model = copy.deepcopy(base)
    _quantize(model, scheme)
    ref = dequantized_reference(model, torch.float64)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, ref_logits, bf16_logits = (m(ids).logits.float() for m in (model, ref, base))
    assert sqnr_db(logits, ref_logits) >= MODEL_SQNR_DB, (kind, scheme)
    assert sqnr_db(logits, bf16_logits) >= VS_BF16_SQNR_DB[scheme], (kind, scheme)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_greedy_tokens(kind, scheme):
    """float32 models (W8A8 layers compute in bf16 inside; routers, attention, norms and lm_head in float32: no
    ties among bf16 logits): greedy generate gives the reference model's tokens, logits close over them."""
    model = tiny_moe_model(kind, dtype=torch.float32)
    _quantize(model, scheme)
    ref = dequantized_reference(model, torch.float64)
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        ref_tokens = ref.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        assert tokens.shape == (1, PROMPT + NEW_TOKENS)
        assert torch.equal(tokens, ref_tokens), (kind, scheme)
        logits, ref_logits = model(tokens).logits, ref(tokens).logits
    assert sqnr_db(logits, ref_logits) >= FLOAT32_MODEL_SQNR_DB


class _OtherMoE(nn.Module):
    """An MoE module quantize_ does not know: 3-D expert weights, a Linear router."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(64, 16)
        self.w1 = nn.Parameter(torch.randn(16, 64, 64))

    def forward(self, x):
        return x


def test_quantize_leaves_other_moe_with_warning():
    model = nn.Sequential(nn.Linear(64, 64), _OtherMoE())
    with pytest.warns(UserWarning, match=r"leaving module '1' \(_OtherMoE\) in float: it holds 3-D expert "
                                         r"parameters \(w1\)"):
        cw.quantize_(model)
    assert type(model[1]) is _OtherMoE and model[1].w1.dtype == torch.float32
    assert type(model[1].router) is cw.W8A8Linear  # its Linears are still quantized
    assert type(model[0]) is cw.W8A8Linear
    conv = nn.Sequential(nn.Conv1d(16, 16, 3), nn.Linear(64, 64))  # 3-D weights, not experts: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cw.quantize_(conv)


def test_quantize_experts_left_in_float():
    """Experts whose I is not a multiple of 128 with block fp8, or whose activation is not SiLU, stay float with a
    warning naming the module and its class; filter_fn can leave them out."""
    import transformers

    config = tiny_moe_config("qwen3_moe")
    config.moe_intermediate_size = 64
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match=r"leaving module 'model.layers.0.mlp.experts' \(Qwen3MoeExperts\) in float: "
                                         r"hidden size H = 256 and intermediate size I = 64 must be multiples of 128"):
        cw.quantize_(model, SCHEMES["fp8-block"])
    assert type(model.model.layers[1].mlp.experts).__name__ == "Qwen3MoeExperts"
    assert type(model.model.layers[1].self_attn.o_proj) is cw.W8A8Linear

    model = tiny_moe_model("mixtral")
    model.model.layers[1].mlp.experts.act_fn = nn.GELU()
    with pytest.warns(UserWarning, match=r"leaving module 'model.layers.1.mlp.experts' \(MixtralExperts\) in float: "
                                         "its activation is GELU"):
        cw.quantize_(model)
    assert type(model.model.layers[0].mlp.experts) is cw.W8A8MoE
    assert type(model.model.layers[1].mlp.experts).__name__ == "MixtralExperts"

    model = tiny_moe_model("qwen3_moe")
    asked = []
    cw.quantize_(model, filter_fn=lambda m, fqn: asked.append(fqn) or not fqn.endswith("experts"))
    assert "model.layers.0.mlp.experts" in asked
    assert all(type(b.experts).__name__ == "Qwen3MoeExperts" for _, b in moe_blocks(model))


def test_quantize_already_quantized():
    model = tiny_moe_model("qwen3_moe")
    _quantize(model, "int8")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # 2 layers x 4 attention projections; 2 W8A8MoE
    with pytest.warns(UserWarning, match=r"already quantized: its 8 W8A8Linear layer\(s\) and 2 W8A8MoE layer\(s\) "
                                         "match `config`"):
        cw.quantize_(model, SCHEMES["int8"], filter_fn=lambda m, fqn: "lm_head" not in fqn)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match=r"asks for dtype=torch.float8_e4m3fn but module 'model.layers.0.mlp.experts' "
                                         "is already a W8A8MoE with quant_dtype=torch.int8"):
        cw.quantize_(model, SCHEMES["fp8"], filter_fn=lambda m, fqn: "experts" in fqn)


def test_quantize_refuses_integer_experts():
    model = tiny_moe_model("mixtral")
    ex = model.model.layers[0].mlp.experts
    ex.gate_up_proj = nn.Parameter(torch.zeros(ex.gate_up_proj.shape, dtype=torch.int8), requires_grad=False)
    with pytest.raises(TypeError, match=r"`experts` module 'model.layers.0.mlp.experts' \(MixtralExperts\) "
                                        "already holds torch.int8 `gate_up_proj` weights"):
        cw.quantize_(model)
