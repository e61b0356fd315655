"""`cutlass_w8a8.optimize_` on tiny quantized MoE models with shared experts (tests/_moe_models.py), on the CPU:
GLM-4.5 (``Glm4MoeDecoderLayer``: q / k / v bias, partial rotary, optional q / k norms, a dense first layer, a
shared expert without gate) and Qwen2-MoE (a shared expert times a sigmoid gate), int8 and block fp8:

- structure: the attention's q / k / v -> ``qkv_proj`` (biases stacked), the dense MLP's and the MoE blocks' shared
  experts' gate / up -> ``gate_up_proj``; the input norms and the dense layer's post-attention norm ->
  `RMSNormQuant`; the MoE block's router, routed experts and shared-expert gate, and the norm before the block, left
  as they are;
- logits bit for bit equal to the quantized-only model's (the tiny models' RMSNorm weights are transformers' 1s,
  where the fused norm and transformers' agree bit for bit: tests/hf/test_hf_optimize_cpu.py; GLM's q / k norms, not
  fused, get random weights);
- ``cw.save_pretrained`` of the optimized model writes the quantized-only model's files byte for byte, and
  ``cw.from_pretrained`` of them gives the optimized logits back (and, with ``optimize=False``, the unoptimized
  ones);
- `unoptimize_` gives transformers' classes, logits and state dict back, and `optimize_` again the optimized logits.
"""

import warnings

import pytest
import torch

import cutlass_w8a8 as cw

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from _hf_tiny import SCHEMES  # noqa: E402
from _moe_models import VOCAB, tiny_moe_model  # noqa: E402
from test_hf_interfaces_cpu import _same_files  # noqa: E402
from test_hf_optimize_cpu import _optimized  # noqa: E402

from cutlass_w8a8.hf import RMSNormQuant, is_optimized, optimize_, unoptimize_  # noqa: E402
from cutlass_w8a8.hf.optimize import FusedGateUpMLP, FusedQKVAttention  # noqa: E402

# (kind, config overrides): GLM-4.5 as its checkpoints (attention_bias), and with q / k norms (use_qk_norm: GLM-4.5's
# config option, off in the released checkpoints); Qwen2-MoE (q / k / v bias always)
CASES = {"glm4_moe": dict(attention_bias=True), "glm4_moe-qk_norm": dict(attention_bias=True, use_qk_norm=True),
         "qwen2_moe": {}}
SHARED = {"glm4_moe": "shared_experts", "qwen2_moe": "shared_expert"}


def _quantized(case, scheme):
    """The tiny ``case`` model, biases and q / k norm weights random, quantized with ``scheme`` (``lm_head`` in
    bf16)."""
    kind = case.split("-")[0]
    model = tiny_moe_model(kind, **CASES[case])
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.bias"):
                p.copy_((0.05 * torch.randn(p.shape, generator=gen)).to(p.dtype))
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_((1 + 0.1 * torch.randn(p.shape, generator=gen)).to(p.dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Qwen2-MoE's shared_expert_gate (N = 1) stays in float
        cw.quantize_(model, SCHEMES[scheme], filter_fn=lambda m, fqn: fqn != "lm_head")
    return model


def _logits(model):
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("scheme", ["int8", "fp8-block"])
@pytest.mark.parametrize("case", list(CASES))
def test_moe_model_fuses_attention_dense_mlp_and_shared_experts(case, scheme):
    kind = case.split("-")[0]
    q = _quantized(case, scheme)
    o = _optimized(q)
    assert is_optimized(o)
    for i, (lq, lo) in enumerate(zip(q.model.layers, o.model.layers)):
        a, b = lq.self_attn, lo.self_attn
        assert isinstance(b, FusedQKVAttention) and type(b).__name__ == f"Fused{type(a).__name__}"
        assert torch.equal(b.qkv_proj.weight, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
        assert torch.equal(b.qkv_proj.bias, torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
        assert isinstance(lo.input_layernorm, RMSNormQuant)
        assert (getattr(b, "q_norm", None) is not None) == (case == "glm4_moe-qk_norm")
        m, n = lq.mlp, lo.mlp
        if isinstance(n, FusedGateUpMLP):  # GLM-4.5's dense first layer (first_k_dense_replace = 1)
            assert kind == "glm4_moe" and i == 0 and n._cw_silu_quant
            assert torch.equal(n.gate_up_proj.weight, torch.cat([m.gate_proj.weight, m.up_proj.weight]))
            assert isinstance(lo.post_attention_layernorm, RMSNormQuant)
            continue
        # the MoE block: its router and routed experts as they were, the norm before it not fused (the router and
        # the experts read its float output), the shared experts fused as a gate_up MLP
        assert type(n) is type(m) and isinstance(n.experts, cw.W8A8MoE) and type(n.gate) is type(m.gate)
        assert not isinstance(lo.post_attention_layernorm, RMSNormQuant)
        sq, so = getattr(m, SHARED[kind]), getattr(n, SHARED[kind])
        assert isinstance(so, FusedGateUpMLP) and type(so).__bases__[1] is type(sq) and so._cw_silu_quant
        assert torch.equal(so.gate_up_proj.weight, torch.cat([sq.gate_proj.weight, sq.up_proj.weight]))
        if kind == "qwen2_moe":
            assert type(n.shared_expert_gate) is torch.nn.Linear  # the sigmoid gate (N = 1), float
    assert list(o.state_dict()) == list(q.state_dict())
    assert torch.equal(_logits(o), _logits(q))


@pytest.mark.parametrize("scheme", ["int8", "fp8-block"])
@pytest.mark.parametrize("case", ["glm4_moe", "qwen2_moe"])
def test_moe_model_save_load_and_unoptimize_round_trip(tmp_path, case, scheme):
    q = _quantized(case, scheme)
    o = _optimized(q)
    want = _logits(o)
    assert torch.equal(want, _logits(q))
    cw.save_pretrained(q, tmp_path / "unopt")
    cw.save_pretrained(o, tmp_path / "opt")
    assert "model.safetensors" in _same_files(tmp_path / "unopt", tmp_path / "opt")
    loaded = cw.from_pretrained(tmp_path / "opt")  # optimize=True by default
    assert is_optimized(loaded)
    assert isinstance(getattr(loaded.model.layers[1].mlp, SHARED[case]), FusedGateUpMLP)
    assert torch.equal(_logits(loaded), want)
    assert torch.equal(_logits(cw.from_pretrained(tmp_path / "opt", optimize=False)), _logits(q))

    assert unoptimize_(o) is o and not is_optimized(o)
    assert {n: type(m) for n, m in o.named_modules()} == {n: type(m) for n, m in q.named_modules()}
    sq, so = q.state_dict(), o.state_dict()
    assert list(sq) == list(so)
    for k in sq:
        assert sq[k].dtype == so[k].dtype and torch.equal(sq[k].view(torch.uint8), so[k].view(torch.uint8)), k
    assert torch.equal(_logits(o), _logits(q))
    optimize_(o)
    assert isinstance(getattr(o.model.layers[1].mlp, SHARED[case]), FusedGateUpMLP)
    assert torch.equal(_logits(o), want)


def test_a_module_named_like_a_moe_block_is_not_taken_for_one():
    """Which modules are MoE blocks is the family table's answer (`cutlass_w8a8.moe.families.family_of`), not a class
    name test: a layer's ``mlp`` replaced by a module of no family row whose name contains "Moe" gets optimize_'s
    "left as is" note like any other unrecognised MLP, while the family's own blocks are still passed over silently."""
    model = tiny_moe_model("qwen3_moe")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cw.quantize_(model, SCHEMES["int8"], filter_fn=lambda m, fqn: fqn != "lm_head")

    class MyMoeThing(torch.nn.Module):
        def forward(self, x):
            return x

    layers = model.model.layers
    layers[0].mlp = MyMoeThing()
    with pytest.warns(UserWarning) as record:
        optimize_(model)
    text = " ".join(str(w.message) for w in record)
    assert "its mlp is MyMoeThing, not Qwen3MoeMLP" in text
    assert "Qwen3MoeSparseMoeBlock" not in text  # the other layers' blocks: passed over without a note
