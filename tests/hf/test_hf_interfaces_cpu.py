"""An `optimize_`d transformers model keeps transformers' interfaces (issue 33), on the CPU, for tiny Llama and
Qwen3 models (tests/_hf_tiny.py) in int8, fp8 and block fp8:

- ``state_dict()`` has the unoptimized model's keys, in its order, and its tensors bit for bit (norm weights
  included); transformers' own ``model.save_pretrained`` and ``cutlass_w8a8.save_pretrained`` write the same files,
  byte for byte, as for the unoptimized model (config.json included); ``cutlass_w8a8.from_pretrained`` of them gives
  the optimized logits back, and transformers' ``AutoModelForCausalLM.from_pretrained`` loads them with no missing,
  unexpected or mismatched keys;
- ``load_state_dict`` of the unfused layout fuses it again (same logits), and refuses what cannot be fused;
- ``q_proj`` / ``k_proj`` / ``v_proj`` / ``gate_proj`` / ``up_proj`` are read-only views of the fused weights;
- `cutlass_w8a8.unoptimize_` gives the transformers classes, the unoptimized logits and state dict back.
"""

import copy
import filecmp
import os
import warnings

import pytest
import torch
from torch import nn

import cutlass_w8a8 as cw

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from _hf_tiny import SCHEMES, quantized, tiny_model  # noqa: E402

from cutlass_w8a8.hf import RMSNormQuant, is_optimized, optimize_, unoptimize_  # noqa: E402

KINDS = ("llama", "qwen3")
CASES = [(k, s) for k in KINDS for s in SCHEMES]
IDS = [f"{k}-{s}" for k, s in CASES]
PARTS = {"self_attn": ("qkv_proj", ("q_proj", "k_proj", "v_proj")), "mlp": ("gate_up_proj", ("gate_proj", "up_proj"))}

_MODELS: dict = {}


def _pair(kind, scheme, seed=0):
    """``(unoptimized, optimized)``: fresh copies of a quantized tiny model (random norm weights) and of it
    `optimize_`d (without a warning)."""
    key = (kind, scheme, seed)
    if key not in _MODELS:
        q = quantized(tiny_model(kind, seed=seed), scheme)
        o = copy.deepcopy(q)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            optimize_(o)
        _MODELS[key] = (q, o)
    q, o = _MODELS[key]
    return copy.deepcopy(q), copy.deepcopy(o)


def _ids():
    return torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))


def _logits(model):
    with torch.no_grad():
        return model(_ids()).logits


def _assert_same_state(a, b):
    assert list(a) == list(b)  # the same keys in the same order
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def _same_files(a, b):
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    for n in names:
        assert filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False), n
    return names


def _transformers_load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, output_loading_info=True)


@pytest.mark.parametrize("kind,scheme", CASES, ids=IDS)
def test_state_dict_is_the_unoptimized_one(kind, scheme):
    q, o = _pair(kind, scheme)
    sq, so = q.state_dict(), o.state_dict()
    _assert_same_state(sq, so)
    assert "model.layers.0.input_layernorm.weight" in so and "model.layers.1.mlp.up_proj.weight_scale" in so
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in so)
    assert set(sq._metadata) == set(so._metadata)
    # the split weights are views of the fused rows (no copy of the 8-bit weights)
    fused = o.model.layers[0].self_attn.qkv_proj.weight
    assert so["model.layers.0.self_attn.k_proj.weight"].data_ptr() == fused[128:].data_ptr()


@pytest.mark.parametrize("kind,scheme", CASES, ids=IDS)
def test_save_pretrained_writes_the_unoptimized_checkpoint(tmp_path, kind, scheme):
    """transformers' ``model.save_pretrained`` and ``cw.save_pretrained`` of the optimized model: the files of
    the unoptimized model's ``save_pretrained``, byte for byte (config.json and generation_config.json included);
    loadable by us (same logits) and by transformers (no missing / unexpected / mismatched keys)."""
    q, o = _pair(kind, scheme)
    q.save_pretrained(tmp_path / "unopt")
    o.save_pretrained(tmp_path / "opt")
    cw.save_pretrained(o, tmp_path / "cw")
    assert "model.safetensors" in _same_files(tmp_path / "unopt", tmp_path / "opt")
    _same_files(tmp_path / "unopt", tmp_path / "cw")
    assert isinstance(o.model.layers[0].input_layernorm, RMSNormQuant)  # still optimized

    loaded = cw.from_pretrained(tmp_path / "opt")  # optimize=True by default
    assert is_optimized(loaded)
    assert torch.equal(_logits(loaded), _logits(o))
    assert torch.equal(_logits(cw.from_pretrained(tmp_path / "opt", optimize=False)), _logits(q))

    model, info = _transformers_load(tmp_path / "opt")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(model.model.layers[0].self_attn).__name__ == type(q.model.layers[0].self_attn).__name__


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_newcomer_path(tmp_path, scheme):
    """Issue 33's path: a checkpoint -> ``cw.from_pretrained`` (optimized) -> transformers' ``model.save_pretrained``
    -> ``cw.from_pretrained``: the same logits; the second checkpoint is byte for byte what the model loaded with
    ``optimize=False`` writes, and transformers loads it with no missing or unexpected keys."""
    q, _ = _pair("llama", scheme)
    cw.save_pretrained(q, tmp_path / "src")
    first = cw.from_pretrained(tmp_path / "src")
    assert is_optimized(first)
    first.save_pretrained(tmp_path / "again")
    second = cw.from_pretrained(tmp_path / "again")
    assert torch.equal(_logits(second), _logits(first))
    cw.from_pretrained(tmp_path / "src", optimize=False).save_pretrained(tmp_path / "plain")
    _same_files(tmp_path / "plain", tmp_path / "again")
    _, info = _transformers_load(tmp_path / "again")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


@pytest.mark.parametrize("kind,scheme", CASES, ids=IDS)
def test_load_state_dict_fuses_the_unfused_layout(kind, scheme):
    q, o = _pair(kind, scheme)
    want = _logits(o)
    assert o.load_state_dict(o.state_dict()) is not None
    assert torch.equal(_logits(o), want)
    # into an optimized model of other weights: it becomes this one (the load is not a no-op)
    _, other = _pair(kind, scheme, seed=1)
    assert not torch.equal(_logits(other), want)
    other.load_state_dict(q.state_dict())
    assert torch.equal(_logits(other), want)
    _assert_same_state(other.state_dict(), q.state_dict())


def _static_per_tensor(model, scales=(0.05, 0.05, 0.05)):
    """q / k / v and gate / up with per-tensor weight scales (different per part, so that the fused layer's scales
    are per channel) and static input scales ``scales`` (q, k, v; gate and up get the first)."""
    for layer in model.model.layers:
        for owner, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")), (layer.mlp, ("gate_proj", "up_proj"))):
            for i, name in enumerate(names):
                m = getattr(owner, name)
                s = (m.weight_scale.max() * (1 + 0.25 * i)).reshape(1)
                inp = torch.tensor([scales[i] if owner is layer.self_attn else scales[0]])
                setattr(owner, name, cw.W8A8Linear.from_quantized(m.weight, s, m.bias, input_scale=inp, dtype=m.dtype))
    return model


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_per_tensor_and_static_scales_round_trip(tmp_path, scheme):
    """Per-tensor weight scales become per-channel when fused; the state dict gives each part its one value back,
    and loading it fuses them again. The static input scale is shared with the RMSNormQuant before the layer."""
    q = _static_per_tensor(quantized(tiny_model("llama"), scheme))
    cw.checkpoints.attach_quantization_config(q)
    o = optimize_(copy.deepcopy(q))
    assert o.model.layers[0].self_attn.qkv_proj.weight_scale.numel() == 3 * 128
    _assert_same_state(q.state_dict(), o.state_dict())
    q.save_pretrained(tmp_path / "unopt")
    o.save_pretrained(tmp_path / "opt")
    _same_files(tmp_path / "unopt", tmp_path / "opt")
    want = _logits(o)
    fresh = optimize_(_static_per_tensor(quantized(tiny_model("llama", seed=1), scheme), scales=(0.07,) * 3))
    fresh.load_state_dict(o.state_dict())
    assert torch.equal(fresh.model.layers[0].input_layernorm.input_scale, torch.tensor([0.05]))  # the norm's, too
    assert torch.equal(_logits(fresh), want)
    _assert_same_state(fresh.state_dict(), q.state_dict())
    # load_state_dict(assign=True): the norm and the fused layer still share the (new) static scale
    fresh = optimize_(_static_per_tensor(quantized(tiny_model("llama", seed=1), scheme), scales=(0.07,) * 3))
    fresh.load_state_dict({k: v.clone() for k, v in o.state_dict().items()}, assign=True)
    assert torch.equal(fresh.model.layers[0].input_layernorm.input_scale, torch.tensor([0.05]))
    assert torch.equal(_logits(fresh), want)


def test_load_state_dict_refuses_what_cannot_be_fused():
    o = optimize_(_static_per_tensor(quantized(tiny_model("llama", layers=1), "int8")))
    sd = o.state_dict()
    sd["model.layers.0.self_attn.k_proj.input_scale"] = torch.tensor([0.07])
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.self_attn: cannot fuse the unfused tensors into "
                                           r"`qkv_proj`: the static per-tensor `input_scale` values differ .*"
                                           r"cutlass_w8a8\.unoptimize_\(model\)"):
        o.load_state_dict(sd)
    sd = o.state_dict()
    del sd["model.layers.0.mlp.up_proj.weight_scale"]
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.mlp: cannot fuse .*`weight_scale` is given for "
                                           r"\['gate_proj'\] but not for \['up_proj'\]"):
        o.load_state_dict(sd)
    sd = o.state_dict()
    sd["model.layers.0.self_attn.qkv_proj.weight"] = o.model.layers[0].self_attn.qkv_proj.weight
    with pytest.raises(RuntimeError, match=r"holds both the unfused q_proj/k_proj/v_proj tensors and the fused "
                                           r"`qkv_proj` ones"):
        o.load_state_dict(sd)


@pytest.mark.parametrize("kind,scheme", CASES, ids=IDS)
def test_parts_are_read_only_views(kind, scheme):
    q, o = _pair(kind, scheme)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    for lq, lo in zip(q.model.layers, o.model.layers):
        for owner, (fused_name, names) in PARTS.items():
            fused = getattr(getattr(lo, owner), fused_name)
            for name in names:
                ref, view = getattr(getattr(lq, owner), name), getattr(getattr(lo, owner), name)
                assert type(view) is cw.W8A8Linear and name not in getattr(lo, owner)._modules
                for buf in ("weight", "weight_scale", "bias", "input_scale"):
                    a, b = getattr(ref, buf), getattr(view, buf)
                    assert (a is None) == (b is None) and (a is None or (a.shape == b.shape and torch.equal(a, b)))
                assert view.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
                with torch.no_grad():
                    assert torch.equal(view(x), ref(x)), name
    attn, mlp = o.model.layers[0].self_attn, o.model.layers[0].mlp
    with pytest.raises(AttributeError, match=r"q_proj cannot be assigned: it is a read-only view of rows 0:128 of "
                                             r"the fused `qkv_proj` .*cutlass_w8a8\.unoptimize_\(model\)"):
        attn.q_proj = q.model.layers[0].self_attn.q_proj
    with pytest.raises(AttributeError, match=r"up_proj cannot be deleted: .*rows 256:512 .*unoptimize_"):
        del mlp.up_proj
    # any other missing name: torch's own error, untouched
    with pytest.raises(AttributeError, match=r"^'Fused\w+Attention' object has no attribute 'nope'$"):
        attn.nope  # noqa: B018
    assert torch.equal(_logits(o), _logits(_pair(kind, scheme)[1]))  # unchanged by all this


def test_no_view_once_the_fused_layer_is_replaced():
    _, o = _pair("llama", "int8")
    attn = o.model.layers[0].self_attn
    attn.qkv_proj = nn.Identity()
    with pytest.raises(AttributeError, match=r"object has no attribute 'k_proj': optimize_ fused q_proj/k_proj/v_proj "
                                             r"into `qkv_proj`, which is now Identity.*optimize=False.*"
                                             r"cutlass_w8a8\.unoptimize_\(model\)"):
        attn.k_proj  # noqa: B018
    with pytest.raises(ValueError, match=r"unoptimize_: model\.layers\.0\.self_attn\.qkv_proj is Identity, not the "
                                         r"W8A8Linear optimize_ made.*nothing was changed"):
        unoptimize_(o)
    assert isinstance(o.model.layers[1].input_layernorm, RMSNormQuant)


@pytest.mark.parametrize("kind,scheme", CASES, ids=IDS)
def test_unoptimize_restores_transformers(kind, scheme):
    q, o = _pair(kind, scheme)
    want = _logits(o)
    assert unoptimize_(o) is o
    assert not is_optimized(o)
    assert {n: type(m) for n, m in o.named_modules()} == {n: type(m) for n, m in q.named_modules()}
    assert torch.equal(_logits(o), _logits(q))  # transformers' RMSNorm and the separate GEMMs again
    _assert_same_state(o.state_dict(), q.state_dict())
    attn = o.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.v_proj.weight.untyped_storage().data_ptr()
    attn.q_proj = attn.q_proj  # plain modules again: assignable
    assert unoptimize_(o) is o and unoptimize_(q) is q  # no-ops
    optimize_(o)  # and optimized again
    assert torch.equal(_logits(o), want)


def test_unoptimize_refuses_a_non_module():
    with pytest.raises(TypeError, match=r"unoptimize_: `model` must be a torch.nn.Module, got dict"):
        cw.unoptimize_({})
    assert "unoptimize_" in cw.__all__


def test_moe_model_dense_parts_unfused(tmp_path):
    """A Qwen3-MoE model with a dense MLP layer and W8A8MoE experts: `cw.save_pretrained` (and
    `cw.checkpoints.save_pretrained`, whose MoE path passes its own state dict to transformers) write the files of
    the unoptimized model, byte for byte."""
    cfg = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                                      max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0,
                                      moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                                      decoder_sparse_step=2)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    inv_freq = model.model.rotary_emb.inv_freq.clone()  # float32, as transformers loads a bf16 checkpoint
    model.to(torch.bfloat16).model.rotary_emb.inv_freq = inv_freq
    q = cw.quantize_(model.eval(), filter_fn=lambda m, fqn: "lm_head" not in fqn)
    assert type(q.model.layers[1].mlp.experts).__name__ == "W8A8MoE"
    o = optimize_(copy.deepcopy(q))
    assert type(o.model.layers[0].mlp).__name__ == "FusedQwen3MoeMLP"
    cw.save_pretrained(q, tmp_path / "unopt")
    cw.save_pretrained(o, tmp_path / "opt")
    cw.checkpoints.save_pretrained(o, tmp_path / "plain")
    assert "model.safetensors" in _same_files(tmp_path / "unopt", tmp_path / "opt")
    _same_files(tmp_path / "unopt", tmp_path / "plain")
    assert torch.equal(_logits(cw.from_pretrained(tmp_path / "opt")), _logits(o))
