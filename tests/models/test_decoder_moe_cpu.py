"""The reference decoder with Qwen3-MoE layers (issue 27) on the CPU (the ops' reference implementations): the config
checks, the float experts (torch._grouped_mm over the pairs sorted by expert against a float64 loop per token), the
q/k head norms (the cached keys against RMSNorm then rotary of the projected keys), the structure of the W8A8 model
(experts a `W8A8MoE`, routers left in bf16, no one-op layer), and the logits against the float32 model of the
dequantized weights (`float_reference`, `DequantizedMoE`).

Routing in the comparisons with the reference: the reference's routers are fed the model's own router logits
(forward hooks on ``mlp.gate``): a float32 router and a bf16 one pick different experts wherever two routing
probabilities are within rounding of each other, which moves a token's MLP output by a whole expert's share and is
not an error of the experts. What is compared is everything but the router's own matmul (a plain ``nn.Linear``).
The CUDA tests are in test_decoder_moe_cuda.py.
"""

import pytest
import torch
import torch.nn.functional as F

import cutlass_w8a8 as cw
from cutlass_w8a8.distributed import TensorParallelLlamaDecoder
from cutlass_w8a8.models import (QWEN3_30B_A3B, DequantizedMoE, LlamaConfig, LlamaDecoder, MoEExperts,
                                 SparseMoeBlock, float_reference)
from cutlass_w8a8.models.llama import _rope_
from cutlass_w8a8.models.moe import route_topk
from cutlass_w8a8.testing.references import rel_err

# 2 layers of width 256, 4 query and 2 key/value heads of 64 with head norms, 8 experts of 128 (top-2): every K a
# multiple of 128 (the block model).
TINY = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                   max_position=128, qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
MAX_BATCH, MAX_SEQ = 8, 32
QUANTS = ["int8", "fp8", "fp8-block"]
# eager step vs the float32 reference with the model's routing, relative Frobenius error of the logits: the dense
# decoder's bounds (tests/models/test_decoder_cuda.py); bf16 = the bf16 model vs its own float32 copy. Measured here on the
# CPU references over test_w8a8_close_to_float32_reference's steps: bf16 0.6-0.7%, int8 1.6-2.1%, fp8 4.3-5.4%,
# fp8-block 4.4-4.9%: the bounds leave ~2.8x.
EAGER_VS_FP32_REL = {None: 2e-2, "int8": 6e-2, "fp8": 1.5e-1, "fp8-block": 1.5e-1}


def tiny(quant=None, dtype=torch.bfloat16, **kw):
    return LlamaDecoder(TINY, quant, max_batch=MAX_BATCH, max_seq_len=MAX_SEQ, dtype=dtype, **kw)


def random_steps(n_steps, batch, seed=0):
    """``n_steps`` decode steps of ``batch`` sequences in distinct random slots at increasing positions."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(MAX_BATCH, generator=g)[:batch]
    start = torch.randint(0, MAX_SEQ - n_steps, (batch,), generator=g)
    return [(torch.randint(0, TINY.vocab_size, (batch,), generator=g), start + i, slots) for i in range(n_steps)]


def step_with_routing(model, ref, tok, pos, slots):
    """``(model logits, reference logits)`` of one step, the reference's routers fed the model's router logits: the
    model's ``gate`` of its MoE block's input (the block's forward runs moe_router_route instead of ``gate`` on CUDA
    at decode sizes; its logits are these within the op's summation-order bound, ops/moe.py)."""
    seen, handles = [], []
    for layer in model.layers:
        handles.append(layer.mlp.register_forward_hook(
            lambda m, i, out: seen.append(torch.nn.functional.linear(i[0], m.gate.weight).detach().clone())))
    try:
        out = model(tok, pos, slots)
    finally:
        for h in handles:
            h.remove()
    assert len(seen) == len(model.layers)
    handles = [layer.mlp.gate.register_forward_hook(lambda m, i, out, logits=logits: logits.to(out.dtype))
               for layer, logits in zip(ref.layers, seen)]
    try:
        expect = ref(tok, pos, slots)
    finally:
        for h in handles:
            h.remove()
    return out, expect


def _w8a8_moe_runs():
    try:
        ex = MoEExperts(8, 128, 128, 2)
        torch.nn.init.normal_(ex.gate_up_proj, std=0.02)
        torch.nn.init.normal_(ex.down_proj, std=0.02)
        layer = cw.W8A8MoE.from_float(ex.to(torch.bfloat16), cw.W8A8Config(), 2, True)
        layer(torch.randn(3, 128, dtype=torch.bfloat16), torch.randn(3, 8))
    except (AttributeError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


needs_w8a8_moe = pytest.mark.skipif(_w8a8_moe_runs() is not None,
                                    reason=f"cutlass_w8a8.W8A8MoE not complete in this tree: {_w8a8_moe_runs()}")


# ---- config ---------------------------------------------------------------------------------------------------------


def test_config():
    assert not LlamaConfig().is_moe and LlamaConfig().mlp_intermediate_size == 2816
    assert TINY.is_moe and TINY.mlp_intermediate_size == 128
    q = QWEN3_30B_A3B
    assert (q.num_layers, q.hidden_size, q.num_heads, q.num_kv_heads, q.head_dim, q.vocab_size) == (
        48, 2048, 32, 4, 128, 151936)
    assert (q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size, q.qk_norm, q.norm_topk_prob) == (
        128, 8, 768, True, True)
    for bad, word in (({"num_experts": 8, "num_experts_per_tok": 0, "moe_intermediate_size": 64}, "num_experts_per_tok"),
                      ({"num_experts": 8, "num_experts_per_tok": 9, "moe_intermediate_size": 64}, "num_experts_per_tok"),
                      ({"num_experts": 8, "num_experts_per_tok": 2}, "moe_intermediate_size"),
                      ({"num_experts": -1}, "num_experts")):
        with pytest.raises(ValueError, match=word):
            LlamaConfig(**bad)


def test_w8a8_size_checks_and_tp_refusal():
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        LlamaDecoder(TINY.replace(moe_intermediate_size=40), "int8", max_batch=2, max_seq_len=16)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        LlamaDecoder(TINY.replace(moe_intermediate_size=64), "fp8-block", max_batch=2, max_seq_len=16)
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        TensorParallelLlamaDecoder(TINY, None, max_batch=2, max_seq_len=16, tp_group=object())


# ---- the float experts ----------------------------------------------------------------------------------------------


def _experts_loop(ex, x, logits):
    """float64 loop per token and routed expert."""
    w, ids = route_topk(logits, ex.top_k, ex.renormalize)
    out = torch.zeros(x.shape, dtype=torch.float64)
    gu, dn = ex.gate_up_proj.double(), ex.down_proj.double()
    for t in range(x.shape[0]):
        for j in range(ex.top_k):
            e = int(ids[t, j])
            h = gu[e] @ x[t].double()
            a = F.silu(h[:ex.intermediate_dim]) * h[ex.intermediate_dim:]
            out[t] += float(w[t, j]) * (dn[e] @ a)
    return out


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 5, 16])
@torch.no_grad()
def test_moe_experts_against_loop(tokens, renormalize):
    """bf16 (torch._grouped_mm over sorted pairs) and float32 (per pair) against a float64 loop, with some experts
    empty (16 experts, top-3) and, at 16 tokens, every token on expert 0 among its three."""
    torch.manual_seed(tokens)
    ex = MoEExperts(16, 64, 32, 3, renormalize)
    torch.nn.init.normal_(ex.gate_up_proj, std=0.1)
    torch.nn.init.normal_(ex.down_proj, std=0.1)
    x = torch.randn(tokens, 64)
    logits = torch.randn(tokens, 16)
    if tokens == 16:
        logits[:, 0] += 10.0
    want = _experts_loop(ex, x, logits)
    got32 = ex(x, logits)
    assert got32.dtype == torch.float32 and rel_err(got32, want) < 1e-5
    ex16 = MoEExperts(16, 64, 32, 3, renormalize, dtype=torch.bfloat16)
    ex16.load_state_dict(ex.state_dict())
    want16 = _experts_loop(ex16, x.bfloat16(), logits)
    got16 = ex16(x.bfloat16(), logits)
    assert got16.dtype == torch.bfloat16 and rel_err(got16, want16) < 2e-2


def test_route_topk():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    w, ids = route_topk(logits, 2, True)
    assert ids.tolist() == [[1, 2]] and torch.allclose(w.sum(-1), torch.ones(1))
    p = torch.softmax(logits, -1)
    w, _ = route_topk(logits.bfloat16(), 2, False)
    assert w.dtype == torch.float32 and torch.allclose(w, p[:, [1, 2]], rtol=1e-2)


# ---- the bf16 model -------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_bf16_structure_and_head_norms():
    """Each layer: head norms, a SparseMoeBlock of float experts, the Python path; the keys cached by a step are
    rotary(k_norm(k)) of the projected keys (q_norm / k_norm weights made random to matter)."""
    model = tiny()
    layer = model.layers[0]
    assert isinstance(layer.mlp, SparseMoeBlock) and isinstance(layer.mlp.experts, MoEExperts)
    assert layer.mlp.experts.gate_up_proj.shape == (8, 256, 256) and layer.mlp.experts.down_proj.shape == (8, 256, 128)
    assert layer._layer_op_operands(torch.zeros(2, 256, dtype=torch.bfloat16)) is None
    attn = layer.self_attn
    g = torch.Generator().manual_seed(3)
    attn.q_norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    attn.k_norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    assert model.expert_nbytes() == 2 * 2 * (8 * 256 * 256 + 8 * 256 * 128)
    tok, pos, slots = torch.tensor([5, 7]), torch.tensor([3, 9]), torch.tensor([1, 4])
    x_seen = []
    h = attn.qkv_proj.register_forward_hook(lambda m, i, out: x_seen.append(out.clone()))
    model(tok, pos, slots)
    h.remove()
    qkv = x_seen[0].view(2, 8, 64)
    k = F.rms_norm(qkv[:, 4:6].float(), (64,), attn.k_norm.weight.float(), TINY.rms_norm_eps).to(torch.bfloat16)
    _rope_(k, model.rope_table.index_select(0, pos))
    cached = attn.kv_cache[slots, 0, :, pos]  # (2, KVH, D)
    assert rel_err(cached, k) < 1e-2
    v = qkv[:, 6:8]
    assert torch.equal(attn.kv_cache[slots, 1, :, pos], v)


@torch.no_grad()
def test_bf16_close_to_float32_reference():
    model = tiny()
    ref = float_reference(model)
    assert isinstance(ref.layers[0].mlp.experts, MoEExperts) and ref.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    for i, (tok, pos, slots) in enumerate(random_steps(4, 3)):
        out, expect = step_with_routing(model, ref, tok, pos, slots)
        err = rel_err(out, expect)
        assert err < EAGER_VS_FP32_REL[None], f"step {i}: relative error {err:.3g}"


# ---- the W8A8 models ------------------------------------------------------------------------------------------------


@needs_w8a8_moe
@pytest.mark.parametrize("quant", QUANTS)
@torch.no_grad()
def test_w8a8_structure(quant):
    model = tiny(quant)
    bf16 = tiny()
    mlp = model.layers[1].mlp
    assert isinstance(mlp.experts, cw.W8A8MoE) and type(mlp.gate) is torch.nn.Linear
    assert mlp.gate.weight.dtype == torch.bfloat16 and torch.equal(mlp.gate.weight, bf16.layers[1].mlp.gate.weight)
    assert isinstance(model.layers[1].self_attn.qkv_proj, cw.W8A8Linear)
    assert mlp.experts.w13.shape == (8, 256, 256) and mlp.experts.w2.shape == (8, 256, 128)
    assert mlp.experts.top_k == 2 and mlp.experts.renormalize is True
    assert model.layers[0]._layer_op_operands(torch.zeros(2, 256, dtype=torch.bfloat16)) is None
    assert 0 < model.expert_nbytes() < bf16.expert_nbytes()


@needs_w8a8_moe
@pytest.mark.parametrize("quant", QUANTS)
@torch.no_grad()
def test_w8a8_close_to_float32_reference(quant):
    """Eager steps (batch 5, 4 steps) against `float_reference` (DequantizedMoE, the same activation
    quantization), routed alike; and near the bf16 model."""
    model = tiny(quant)
    ref = float_reference(model)
    assert isinstance(ref.layers[0].mlp.experts, DequantizedMoE)
    for i, (tok, pos, slots) in enumerate(random_steps(4, 5)):
        out, expect = step_with_routing(model, ref, tok, pos, slots)
        assert out.shape == (5, TINY.vocab_size) and torch.isfinite(out).all()
        err = rel_err(out, expect)
        assert err < EAGER_VS_FP32_REL[quant], f"{quant} step {i}: relative error {err:.3g}"


@needs_w8a8_moe
@torch.no_grad()
def test_runner_padding_on_cpu():
    """DecodeGraphRunner (eager on the CPU) pads 3 rows to the bucket of 4: the rows' logits equal the unpadded
    step's up to the padding's effect on nothing (tokens route independently)."""
    from cutlass_w8a8.runner import DecodeGraphRunner

    model = tiny("int8")
    runner = DecodeGraphRunner(model, max_batch=4)
    tok, pos, slots = random_steps(1, 3)[0]
    model.reset_cache()
    padded = runner.step(tok, pos, slots, use_graph=False).clone()
    model.reset_cache()
    direct = model(tok, pos, slots)
    assert padded.shape == direct.shape and rel_err(padded, direct) < 1e-2


# ---- what a step launches (issue 36): the dense layer's attention side + the MoE part ----------------------------

# Per decoder layer, the ops that launch kernels (cutlass_w8a8.testing.op_calls; views left out), at decode sizes on
# CUDA. The attention side is the dense Llama layer's (checked against it below): the norm fused with the residual
# add and the quantization for qkv_proj, the qkv GEMM, one rotary op that also applies Qwen3's q / k head norms and
# writes the cache, the split-KV attention quantizing for o_proj, the o_proj GEMM. The MoE part: the post-attention
# norm fused with the residual add (bf16 output, the router's and the experts' input), moe_router_route (the bf16
# router GEMM and the routing in one kernel; before it, aten::mm and moe_route), moe_decode_experts (which quantizes
# x itself).
ATTENTION_SIDE = ["cutlass_w8a8::rms_norm_quant", "cutlass_w8a8::scaled_mm", "cutlass_w8a8::rope_kv_cache_",
                  "cutlass_w8a8::decode_attention_quant", "cutlass_w8a8::scaled_mm"]
MOE_PART = ["cutlass_w8a8::fused_add_rms_norm", "cutlass_w8a8::moe_router_route",
            "cutlass_w8a8::moe_decode_experts"]
DENSE_MLP = ["cutlass_w8a8::rms_norm_quant", "cutlass_w8a8::scaled_mm", "cutlass_w8a8::silu_mul_quant",
             "cutlass_w8a8::scaled_mm"]
STEP_HEAD = ["aten::index_select", "aten::embedding"]  # the step's rotary rows (once per step), the embedding
STEP_TAIL = ["cutlass_w8a8::fused_add_rms_norm", "aten::mm"]  # the final norm, the bf16 lm_head


def _step_ops(model, batch=2):
    from cutlass_w8a8.testing.op_calls import OpCalls

    tok, pos, slots = random_steps(1, batch)[0]
    with torch.no_grad(), OpCalls() as calls:
        model(tok, pos, slots)
    return calls.names


@needs_w8a8_moe
@pytest.mark.parametrize("quant", ["int8", "fp8"])
@pytest.mark.parametrize("batch", [1, 4])
def test_step_ops_per_layer(quant, batch, monkeypatch):
    """One W8A8 Qwen3-MoE step at decode sizes launches, per layer, the dense Llama layer's attention-side ops and
    the three MoE ops, nothing else (no head-norm kernel, copy, cast or fill): 8 ops, 11 CUDA kernels (the dense
    layer's attention side: 6, the MoE part: 5); before issue 36's cuts, 13 ops and 16 kernels at batch 1 (the two
    head norms and their copies back), 18 above, then 9 ops and 12 kernels (the router GEMM and moe_route apart).
    The experts take moe_decode_experts and the router moe_router_route as on CUDA at T * k <= 64 and T <= 16 (on
    the CPU `W8A8MoE.uses_decode_path` and `router_route_applies` are False: patched here; the ops have their CPU
    references)."""
    from cutlass_w8a8.testing.op_calls import cuda_kernels

    monkeypatch.setattr(cw.W8A8MoE, "uses_decode_path", lambda self, x, k: True)
    monkeypatch.setattr(cw.W8A8MoE, "router_route_applies", lambda self, x, w, logits_dtype=None: True)
    names = _step_ops(tiny(quant), batch)
    layer = ATTENTION_SIDE + MOE_PART
    assert names == STEP_HEAD + layer * TINY.num_layers + STEP_TAIL, names
    assert cuda_kernels(layer) == 11 and cuda_kernels(ATTENTION_SIDE) == 6

    dense = LlamaDecoder(TINY.replace(qk_norm=False, num_experts=0, num_experts_per_tok=0), quant,
                         max_batch=MAX_BATCH, max_seq_len=MAX_SEQ)
    for lyr in dense.layers:  # the Python path (decode_layer runs the same ops in one call)
        lyr.use_layer_op = False
    assert _step_ops(dense, batch) == STEP_HEAD + (ATTENTION_SIDE + DENSE_MLP) * TINY.num_layers + STEP_TAIL


@needs_w8a8_moe
@pytest.mark.parametrize("quant", [None, "int8"])
@torch.no_grad()
def test_fused_head_norms_equal_the_module_path(quant):
    """The head norms inside rope_kv_cache_ give the step the former path's logits and cache bit for bit (q_norm /
    k_norm run as modules, then copied back: `LlamaAttention._norm_heads_`, forced in the twin), over three steps
    with head-norm weights that are not ones; the module path, two rms_norm calls per layer more, is still what
    norms rope_kv_cache_ cannot apply (two different eps) take."""
    from cutlass_w8a8.testing.op_calls import OpCalls

    model, twin = tiny(quant), tiny(quant)
    g = torch.Generator().manual_seed(3)
    for ours, theirs in zip(model.layers, twin.layers):
        for name in ("q_norm", "k_norm"):
            w = getattr(ours.self_attn, name).weight
            w.copy_(1 + 0.5 * torch.randn(w.shape, generator=g))
            getattr(theirs.self_attn, name).weight.copy_(w)
        theirs.self_attn._fused_head_norms = lambda dtype: (None, None, -1.0)
    for tok, pos, slots in random_steps(3, 3, seed=5):
        with OpCalls() as ours_calls:
            out = model(tok, pos, slots)
        with OpCalls() as twin_calls:
            ref = twin(tok, pos, slots)
        norms = ours_calls.names.count("cutlass_w8a8::rms_norm")
        assert twin_calls.names.count("cutlass_w8a8::rms_norm") == norms + 2 * TINY.num_layers
        assert torch.equal(out, ref)
    for a, b in zip(model.layers, twin.layers):
        assert torch.equal(a.self_attn.kv_cache, b.self_attn.kv_cache)
    attn = model.layers[0].self_attn
    assert attn._fused_head_norms(torch.bfloat16)[0] is attn.q_norm.weight
    attn.k_norm.eps = attn.q_norm.eps * 2
    assert attn._fused_head_norms(torch.bfloat16) == (None, None, -1.0)
