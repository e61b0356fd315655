"""`GraphGenerator` with ``step="cw"`` (`cutlass_w8a8.hf.DecodeStep`: the package's decoder-layer code over an
optimized transformers model's own modules) on the CPU, where the same steps run eagerly (the ops' CPU references),
on tiny transformers models (tests/_hf_tiny.py):

- greedy tokens agree with ``model.generate`` (`_hf_tiny.check_greedy_against_transformers`: equal tokens on equal
  prefixes except near-ties within the two paths' measured logit difference, logits within the scheme's
  ``logits_rel_tol``), for a left-padded batch in a larger bucket, every supported family and scheme;
- a left-padded row gives the tokens and logits the same prompt gives alone without padding (the prefill's keys
  and values moved to column 0);
- ``"auto"`` picks it for an optimized model and says why not for others; ``"cw"`` on a model it cannot run is a
  ValueError with the reason; nothing of the model is copied or changed;
- a batch above the buckets reallocates the shared cache.
"""

import pytest
import torch

import cutlass_w8a8 as cw

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from _hf_tiny import (MIN_CHECKED, QK_GAIN, check_greedy_against_transformers, left_padded_batch,  # noqa: E402
                      optimized, optimized_moe_step, rel_err, tiny_model)

from cutlass_w8a8.hf import DecodeStep, GraphGenerator  # noqa: E402
from cutlass_w8a8.hf.optimize import FusedGateUpMLP  # noqa: E402

CACHE = 48
NEW = 12


def _model(kind="llama", scheme="int8", qk_gain=QK_GAIN, layers=2):
    return optimized(kind, scheme, qk_gain=qk_gain, layers=layers)


_batch = left_padded_batch


@pytest.mark.parametrize("kind,scheme", [("llama", "int8"), ("llama", "fp8"), ("qwen3", "fp8"), ("qwen2", "int8"),
                                         ("mistral", "fp8-block"), ("qwen3", "fp8-block")])
def test_greedy_agrees_with_transformers(kind, scheme):
    model = _model(kind, scheme)
    ids, am = _batch()
    gen = GraphGenerator(model, max_cache_len=CACHE)
    assert gen.step == "cw" and gen.step_reason is None and not gen.use_graphs
    gen.record_logits = True
    ours = gen.generate(ids, NEW, attention_mask=am)
    assert gen.bucket_size(3) == 4 and gen._cw.slots == 8  # the largest default bucket's slots, shared
    cache = transformers.StaticCache(config=model.config, max_cache_len=CACHE)
    ref = model.generate(ids, attention_mask=am, past_key_values=cache, max_new_tokens=NEW, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    checked = check_greedy_against_transformers(ours, gen.logits_history, ref, ids.shape[1], scheme=scheme)
    assert checked >= MIN_CHECKED, f"only {checked} token steps compared on equal prefixes"
    # a second call (the cache reused, the prefill reloaded) gives the same tokens
    assert torch.equal(gen.generate(ids, NEW, attention_mask=am), ours)


def test_left_padded_row_equals_the_prompt_alone():
    """Row 1 of the batch has 3 pads: its tokens and logits equal those of its 4-token prompt run alone. The CPU
    references are row-wise, so the match is exact; a decode step that attends to the padding columns or writes
    at the wrong column changes the logits."""
    model = _model("llama", "int8")
    ids, am = _batch()
    gen = GraphGenerator(model, max_cache_len=CACHE)
    gen.record_logits = True
    batch = gen.generate(ids, NEW, attention_mask=am)
    batch_logits = [x[1].clone() for x in gen.logits_history]
    alone = gen.generate(ids[1:2, 3:], NEW)
    assert torch.equal(batch[1, 7:], alone[0, 4:])
    for i, (a, b) in enumerate(zip(batch_logits, gen.logits_history)):
        assert rel_err(a, b[0]) < 1e-6, f"step {i}"


def test_step_matches_the_transformers_step_on_one_prefix():
    """The first decode step's logits of both steps from the same prefill (same prefix, no divergence yet)."""
    model = _model("qwen2", "int8", qk_gain=1.0)
    ids, am = _batch()
    ours = GraphGenerator(model, max_cache_len=CACHE, step="cw")
    theirs = GraphGenerator(model, max_cache_len=CACHE, step="transformers")
    ours.prefill(ids, am)
    theirs.prefill(ids, am)
    tok = torch.tensor([5, 6, 7])
    a, b = ours.decode(tok).float(), theirs.decode(tok).float()
    for r in range(3):
        assert rel_err(a[r], b[r]) < 0.05, f"row {r}"


def test_auto_choice_and_refusals():
    bf16 = tiny_model("llama", layers=1)
    gen = GraphGenerator(bf16, max_cache_len=CACHE)
    assert gen.step == "transformers"
    assert "`model.model.layers.0.self_attn` (LlamaAttention) is not fused" in gen.step_reason
    with pytest.raises(ValueError, match=r"step='cw' cannot run this model: `model.model.layers.0.self_attn` "
                                         r"\(LlamaAttention\) is not fused: run cutlass_w8a8.optimize_"):
        GraphGenerator(bf16, step="cw")
    with pytest.raises(ValueError, match=r"`step` must be one of \('auto', 'cw', 'transformers'\), got 'fast'"):
        GraphGenerator(bf16, step="fast")
    model = _model("llama", "int8", layers=1)
    assert GraphGenerator(model, step="transformers").step_reason is None
    model.config.sliding_window = 16
    assert "sliding-window attention" in DecodeStep.why_not(model)
    # the "cw" step's prefill runs any attention implementation transformers has
    model = _model("llama", "int8", layers=1)
    model.config._attn_implementation = "flex_attention"
    assert GraphGenerator(model).step == "cw"


def test_shares_the_model_and_changes_nothing():
    model = _model("qwen3", "int8", layers=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    gen = GraphGenerator(model, max_cache_len=CACHE)
    step = gen._cw
    layer, hf = step.layers[0], model.model.layers[0]
    assert layer.self_attn.qkv_proj is hf.self_attn.qkv_proj and layer.mlp.down_proj is hf.mlp.down_proj
    assert layer.input_layernorm.weight is hf.input_layernorm.weight
    assert layer.self_attn.q_norm.weight is hf.self_attn.q_norm.weight
    assert step.embed_tokens is model.model.embed_tokens and step.lm_head is model.lm_head
    gen.generate(*_batch()[:1], 3)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert grads == {n: p.requires_grad for n, p in model.named_parameters()}
    # the rotary table is the model's rotary_emb at positions 0 .. S - 1
    pos = torch.tensor([[0, 5, CACHE - 1]])
    cos, sin = model.model.rotary_emb(torch.zeros((), dtype=torch.float32), pos)
    half = cos.shape[-1] // 2
    assert torch.equal(step.rope_table[pos[0], :, 0], cos[0, :, :half])
    assert torch.equal(step.rope_table[pos[0], :, 1], sin[0, :, :half])


def test_batch_above_the_buckets_reallocates_the_cache():
    model = _model("llama", "int8", layers=1)
    gen = GraphGenerator(model, max_cache_len=CACHE, max_batch=2)
    ids, am = _batch(b=2)
    two = gen.generate(ids, 4, attention_mask=am)
    assert gen._cw.slots == 2
    ids3 = torch.cat([ids, ids[:1]])
    three = gen.generate(ids3, 4, attention_mask=torch.cat([am, am[:1]]))
    assert gen._cw.slots == 3 and list(gen._buckets) == [3]
    assert torch.equal(three[:2], two) and torch.equal(three[2], two[0])


def test_generate_wrapper_takes_step():
    model = _model("llama", "int8", layers=1)
    ids, _ = _batch(b=1)
    cw.generate(model, ids, 3, max_cache_len=CACHE)
    assert model.__dict__["_cw_graph_generator"].step == "cw"
    cw.generate(model, ids, 3, step="transformers")
    assert model.__dict__["_cw_graph_generator"].step == "transformers"


# ---- MoE models (tests/_moe_models.py): DecodeStep's MoeMLP over the blocks' own router, W8A8MoE and shared expert --

MOE_CASES = [("qwen3_moe", "int8"), ("mixtral", "fp8"), ("qwen2_moe", "int8"), ("qwen3_moe", "fp8-block"),
             ("glm4_moe", "int8"), ("glm4_moe", "fp8"), ("glm4_moe", "fp8-block")]


@pytest.mark.parametrize("kind,scheme", MOE_CASES)
def test_moe_step_logits_match_the_transformers_step_teacher_forced(kind, scheme):
    """The CUDA file's `_moe_cw_teacher_forced_case` with the steps run eagerly on the CPU: DecodeStep's logits
    against transformers' forward on the same prefixes (same tokens fed), within ``logits_rel_tol(scheme)``, a router
    near-tie ending a row's comparison (`_hf_tiny.routing_flip`)."""
    import test_hf_generate_graph_cuda as gpu_cases

    gpu_cases._moe_cw_teacher_forced_case(kind, scheme, "cpu", steps=8)


# the greedy run of both paths and an eager re-run: ~10-20 s on 2 CPU cores for Qwen (full runs only), ~3 s for the
# tiny GLM-4.5
@pytest.mark.parametrize("kind,scheme", [pytest.param("qwen3_moe", "int8", marks=pytest.mark.full),
                                         pytest.param("qwen2_moe", "fp8", marks=pytest.mark.full),
                                         ("glm4_moe", "int8"), ("glm4_moe", "fp8-block")])
def test_moe_greedy_agrees_with_transformers(kind, scheme):
    import test_hf_generate_graph_cuda as gpu_cases

    gpu_cases._moe_cw_greedy_case(kind, scheme, "cpu")


def _moe(kind, scheme="int8"):
    import test_hf_generate_graph_cuda as gpu_cases

    return gpu_cases._moe_model(kind, scheme, "cpu", **gpu_cases.MOE_CW_OVERRIDES.get(kind, {}))


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe"])
def test_moe_auto_picks_the_cw_step_and_shares_the_blocks(kind):
    import warnings

    from cutlass_w8a8.hf import optimize_
    from cutlass_w8a8.hf.decode_step import MoeMLP

    model = _moe(kind)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert "is not fused: run cutlass_w8a8.optimize_" in DecodeStep.why_not(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimize_(model)
    assert DecodeStep.why_not(model) is None
    # optimize_ keeps transformers' interfaces: the same state dict, the MoE blocks' modules untouched
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    ids, _ = _batch(b=1)
    cw.generate(model, ids, 2, max_cache_len=CACHE, pad_token_id=0)
    gen = model.__dict__["_cw_graph_generator"]
    assert gen.step == "cw" and gen.step_reason is None and not gen.use_graphs
    step = gen._cw
    head_dim = model.model.layers[0].self_attn.head_dim
    rotary = int(head_dim * model.config.rope_parameters.get("partial_rotary_factor", 1.0))
    assert step.rotary_dim == rotary and step.rope_table.shape == (CACHE, rotary // 2, 2)
    assert (rotary < head_dim) == (kind == "glm4_moe")  # GLM-4.5: partial rotary, R = head_dim / 2
    for i, (layer, hf) in enumerate(zip(step.layers, model.model.layers)):
        assert layer.self_attn.qkv_proj is hf.self_attn.qkv_proj
        if kind == "glm4_moe" and i == 0:  # first_k_dense_replace = 1: a dense, fused gate_up MLP
            assert isinstance(hf.mlp, FusedGateUpMLP) and layer.mlp.gate_up_proj is hf.mlp.gate_up_proj
            continue
        assert isinstance(layer.mlp, MoeMLP)
        assert layer.mlp.experts is hf.mlp.experts and isinstance(hf.mlp.experts, cw.W8A8MoE)
        assert layer.mlp.gate.weight is hf.mlp.gate.weight
        if kind == "qwen2_moe":
            assert layer.mlp.shared_expert is hf.mlp.shared_expert
            assert layer.mlp.shared_expert_gate is hf.mlp.shared_expert_gate
            assert isinstance(hf.mlp.shared_expert, FusedGateUpMLP)  # optimize_ fused the shared expert
        elif kind == "glm4_moe":  # a shared expert without gate; the router's logits in float32
            assert layer.mlp.shared_expert is hf.mlp.shared_experts and layer.mlp.shared_expert_gate is None
            assert isinstance(hf.mlp.shared_experts, FusedGateUpMLP)
            # (transformers 5.24 keeps the router weight in float32, 5.17 in the model dtype: both compute in float32)
            assert layer.mlp.gate.logits_dtype == torch.float32
        else:
            assert layer.mlp.shared_expert is None and layer.mlp.shared_expert_gate is None
            assert layer.mlp.gate.logits_dtype is None
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_moe_why_not_names_what_is_not_served():
    import warnings

    from cutlass_w8a8.hf import optimize_

    def opt(model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return optimize_(model)

    ds = opt(_moe("deepseek_v3"))
    assert DecodeStep.why_not(ds) == ("`model.model.layers.0.self_attn` (DeepseekV3Attention) is multi-head latent "
                                      "attention (MLA), which DecodeStep does not run: the model keeps transformers' "
                                      "step")
    gen = GraphGenerator(ds, max_cache_len=CACHE)
    assert gen.step == "transformers" and "multi-head latent attention (MLA)" in gen.step_reason
    olmoe = opt(_moe("olmoe"))
    assert "`model.model.layers.0` (OlmoeDecoderLayer) is not a decoder layer cutlass_w8a8.optimize_ fuses" in (
        DecodeStep.why_not(olmoe))
    # experts left in float (a bf16 model only optimized in its attention would not be; here: the experts put back)
    model = opt(_moe("qwen3_moe"))
    block = model.model.layers[1].mlp
    w8 = block.experts
    block.experts = torch.nn.Identity()
    assert DecodeStep.why_not(model) == ("`model.model.layers.1.mlp.experts` (Identity) is not a W8A8MoE (quantize "
                                         "the model with cutlass_w8a8.quantize_ first; a routing moe_route does not "
                                         "compute leaves it in float)")
    block.experts = w8
    # a router whose routing no longer matches the experts' (changed after quantize_)
    block.gate.top_k = 3
    assert DecodeStep.why_not(model) == ("`model.model.layers.1.mlp.experts` routes with top_k = 2, its router with 3 "
                                         "(the router changed after quantize_)")
    block.gate.top_k = 2
    assert DecodeStep.why_not(model) is None
    with pytest.raises(ValueError, match=r"step='cw' cannot run this model: `model.model.layers.0.self_attn` "
                                         r"\(DeepseekV3Attention\) is multi-head latent attention"):
        GraphGenerator(ds, step="cw")


def test_moe_families_table_matches_the_family_rows():
    """Each `MOE_FAMILIES` record names a `cutlass_w8a8.moe.families` row; GLM-4.5's router logits in float32, the
    others' in the input's dtype; a bad record is refused."""
    from cutlass_w8a8.hf.decode_step import MOE_FAMILIES, MoeBlockForward
    from cutlass_w8a8.moe.families import FAMILIES

    rows = {f.name: f for f in FAMILIES}
    for name, spec in MOE_FAMILIES.items():
        assert isinstance(spec, MoeBlockForward) and name in rows, name
    assert MOE_FAMILIES["GLM-4.5"] == MoeBlockForward(router_logits="float32")
    assert all(spec.router_logits == "input" for name, spec in MOE_FAMILIES.items() if name != "GLM-4.5")
    with pytest.raises(ValueError, match="`router_logits` must be 'input' or 'float32', got 'bf16'"):
        MoeBlockForward("bf16")


def test_glm_why_not_names_the_router_shared_experts_and_rotary(monkeypatch):
    """A GLM-4.5 model DecodeStep would run otherwise than transformers is refused with the reason: a block-forward
    record whose router logits dtype disagrees with the router weight's, a block without its shared experts, a
    rotary embedding wider than a head or of odd width."""
    import warnings

    from cutlass_w8a8.hf import decode_step as ds
    from cutlass_w8a8.hf import optimize_

    model = _moe("glm4_moe")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimize_(model)
    assert DecodeStep.why_not(model) is None
    where = "`model.model.layers.1.mlp`"
    gate = model.model.layers[1].mlp.gate
    gate.weight.data = gate.weight.data.float()  # as transformers 5.24 keeps it (5.17: in the model dtype)
    monkeypatch.setitem(ds.MOE_FAMILIES, "GLM-4.5", ds.MoeBlockForward("input"))
    assert DecodeStep.why_not(model) == ("`model.model.layers.1.mlp.gate.weight` is torch.float32; its GLM-4.5 router "
                                         "computes its logits in the dtype of its input (torch.bfloat16), which "
                                         "DecodeStep's MoeRouter reproduces only for a weight of that dtype")
    monkeypatch.setitem(ds.MOE_FAMILIES, "GLM-4.5", ds.MoeBlockForward("float32"))
    assert DecodeStep.why_not(model) is None
    block = model.model.layers[1].mlp
    shared = block.shared_experts
    block.shared_experts = None
    assert DecodeStep.why_not(model) == (f"{where} (Glm4MoeMoE) has no shared experts module `shared_experts`, which "
                                         "its GLM-4.5 block forward adds")
    block.shared_experts = shared

    rotary = model.model.rotary_emb

    class Widened(torch.nn.Module):  # the model's rotary embedding, `extra` features wider
        def __init__(self, extra):
            super().__init__()
            self.inner, self.extra = rotary, extra

        def forward(self, x, position_ids):
            cos, sin = self.inner(x, position_ids)
            pad = cos.new_ones(*cos.shape[:-1], self.extra)
            return torch.cat((cos, pad), -1), torch.cat((sin, 0 * pad), -1)

    for extra, width in ((33, 65), (34, 66), (1, 33)):
        model.model.rotary_emb = Widened(extra)
        assert DecodeStep.why_not(model) == (f"`model.model.rotary_emb` gives a rotary width of {width} for "
                                             "`model.model.layers.0.self_attn.head_dim` 64; the step rotates an even "
                                             "width R in [2, head_dim] of each head")
    model.model.rotary_emb = Widened(32)  # R = 64 = head_dim: served (as a full rotary embedding)
    assert DecodeStep.why_not(model) is None
    model.model.rotary_emb = rotary
    step = DecodeStep(model, CACHE)
    assert step.rotary_dim == 32 and step.rope_table.shape == (CACHE, 16, 2)
    assert not any(layer.use_layer_op for layer in step.layers)  # partial rotary: the Python path


# Per layer, the ops of a Qwen3-MoE DecodeStep at decode sizes (issue 36; tests/models/test_decoder_moe_cpu.py pins
# the reference decoder's, the same list): the dense layer's attention side, with Qwen3's q / k head norms applied
# inside rope_kv_cache_, then the MoE part (the fused post-attention norm, moe_router_route: the router GEMM and the
# routing in one kernel, moe_decode_experts).
MOE_LAYER_OPS = ["cutlass_w8a8::rms_norm_quant", "cutlass_w8a8::scaled_mm", "cutlass_w8a8::rope_kv_cache_",
                 "cutlass_w8a8::decode_attention_quant", "cutlass_w8a8::scaled_mm", "cutlass_w8a8::fused_add_rms_norm",
                 "cutlass_w8a8::moe_router_route", "cutlass_w8a8::moe_decode_experts"]


@pytest.mark.parametrize("batch", [1, 3])
def test_qwen3_moe_step_ops_per_layer(batch, monkeypatch):
    """DecodeStep of an optimized int8 Qwen3-MoE model launches per layer the eight ops of `MOE_LAYER_OPS` (11 CUDA
    kernels), nothing else: no head-norm kernel, copy, cast or fill. The experts take moe_decode_experts and the
    router moe_router_route as on CUDA at T * k <= 64 and T <= 16 (on the CPU `W8A8MoE.uses_decode_path` and
    `router_route_applies` are False: patched here)."""
    from cutlass_w8a8.testing.op_calls import OpCalls, cuda_kernels

    step = optimized_moe_step(_moe("qwen3_moe"), CACHE, batch, monkeypatch)
    rows = torch.arange(batch)
    tokens, positions = rows + 1, rows + 2
    with torch.no_grad(), OpCalls() as calls:
        step(tokens, positions, rows)
    n = len(step.layers)
    assert calls.names == (["aten::index_select", "aten::embedding"] + MOE_LAYER_OPS * n
                           + ["cutlass_w8a8::fused_add_rms_norm", "aten::mm"]), calls.names
    assert cuda_kernels(MOE_LAYER_OPS) == 11


def test_glm_step_routes_with_the_routers_current_correction_bias():
    """A device move after quantize_ ends the sharing of the router's correction bias with its W8A8MoE (both modules
    move their own tensor); a bias loaded into the router afterwards must still be the one the decode step routes
    with: DecodeStep re-ties the experts' bias to the router's (W8A8MoE.tie_correction_bias), sharing its storage
    again where it is float32 on the experts' device."""
    import test_hf_generate_graph_cuda as gpu_cases

    model = gpu_cases._moe_optimized("glm4_moe", "int8", "cpu")
    block = next(m for m in model.modules() if type(m).__name__ == "Glm4MoeMoE")
    experts, router_bias = block.experts, block.gate.e_score_correction_bias
    # what model.to(device) leaves: two tensors with the same values, not shared
    experts._buffers["correction_bias"] = experts.correction_bias.clone()
    with torch.no_grad():
        router_bias.copy_(torch.linspace(-0.5, 0.5, router_bias.numel()).reshape(router_bias.shape))
    assert not torch.equal(experts.correction_bias, router_bias.float().reshape(-1))
    DecodeStep(model, 32)
    assert torch.equal(experts.correction_bias, router_bias.float().reshape(-1))
    if router_bias.dtype == torch.float32:  # shared again: a later load into the router is seen
        assert experts.correction_bias.data_ptr() == router_bias.data_ptr()
        with torch.no_grad():
            router_bias.add_(1.0)
        assert torch.equal(experts.correction_bias, router_bias.reshape(-1))


def test_tie_correction_bias_errors():
    model = _moe("glm4_moe")
    experts = next(m for m in model.modules() if isinstance(m, cw.W8A8MoE))
    e = experts.num_experts
    with pytest.raises(ValueError, match=f"`bias` must have E = {e} elements"):
        experts.tie_correction_bias(torch.zeros(e + 1))
    with pytest.raises(TypeError, match="`bias` must be a floating-point tensor"):
        experts.tie_correction_bias(torch.zeros(e, dtype=torch.int32))
    plain = next(m for m in _moe("qwen3_moe").modules() if isinstance(m, cw.W8A8MoE))
    with pytest.raises(ValueError, match="routes without a correction bias"):
        plain.tie_correction_bias(torch.zeros(plain.num_experts))
