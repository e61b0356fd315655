"""DeepSeek-V3's native fp8 checkpoints (issue 35): `cutlass_w8a8.checkpoints.from_pretrained` keeps them 8-bit
and `save_pretrained` writes them back byte for byte.

The checkpoints are written by tests/_deepseek_checkpoints.py from the layout's description (per-expert
``mlp.experts.{e}.{gate,up,down}_proj`` with ``weight_scale_inv``, shared experts, a dense first layer, MLA
projections with ``kv_a_proj_with_mqa`` N = 576, the router in bf16 and its ``e_score_correction_bias`` in
float32, a multi-token-prediction layer, three shards), from transformers' own ``DeepseekV3Config`` /
``DeepseekV3ForCausalLM``; ``ue8m0``: DeepSeek-V3.1's power-of-two scales. Nothing is downloaded.

The reference is the checkpoint dequantized by tests/_deepseek_checkpoints.py from its safetensors tensors (weight
times block scale, float64) in a plain transformers model: ``same math``, its experts and quantized linears
computing in float64 with our activation quantization (e4m3 per 1 x 128 group) and rounding points; ``float``,
the dequantized weights in transformers' own float32 modules with exact activations. Routers (sigmoid scores,
correction bias, grouped top-k, scaling) run transformers' own code in both and ours.

Measured (CPU, torch 2.13, transformers 5.24; ``pytest -s`` prints them): logits vs the same-math reference 86.4 dB
with float32 scales, 66.7 dB with ue8m0 scales (83.6 / 67.5 dB with transformers 5.17); vs the float model 21.5 / 21.4 dB, the same as the reference's own
(||L - Lf|| / ||Ls - Lf|| 1.000 / 1.000); layer by layer (teacher-forced) within the rounding bounds, worst 85.6 /
85.3 dB. The logits thresholds: test_logits_match_dequantized_checkpoint.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("compressed_tensors")

import cutlass_w8a8 as cw  # noqa: E402
from cutlass_w8a8.checkpoints import from_pretrained, save_pretrained  # noqa: E402

from _checkpoints import logits, sqnr_db, stored_tensors, token_ids  # noqa: E402
from _moe_models import pin_routing, record_routing  # noqa: E402
from _tp_scenarios import TP_VS_TP1_ACCURACY  # noqa: E402
from _moe_bounds import assert_each_layer_within_bounds  # noqa: E402
from _deepseek_checkpoints import (EXPERTS, LAYERS, MOE_I, VOCAB, file_reference, mtp_names,  # noqa: E402
                                   write_native_deepseek)

CHECKPOINTS = {"native": {}, "native_ue8m0": {"ue8m0": True}}
SQNR_MIN_SAME_MATH = 30.0
# e4m3 rounds to 3 mantissa bits: a relative error uniform in +-2**-4, 2**-4 / sqrt(3) = 3.6 % rms per quantized
# tensor. Each token's path through the tiny model quantizes 7 GEMM inputs a layer (q_a, q_b, kv_a, kv_b, o, the
# MLP's two), 14 in all: sqrt(14) x 3.6 % = 13.5 % if they add up independently at unit gain; held at 20 %.
FLOAT_REL_MAX = 0.2
MTP_WARNING = (r"dropped the 77 tensors of the multi-token-prediction layer\(s\) model.layers.2 "
               r"\(num_nextn_predict_layers = 1 after num_hidden_layers = 2\)")


@pytest.fixture(scope="module")
def ds_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_ckpts")
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = write_native_deepseek(str(root / name), **CHECKPOINTS[name])
        return cache[name]

    return get


def _load(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return from_pretrained(path, **kw)


def ids(seed=2, batch=2, seq=24):
    return token_ids(seed, batch, seq, VOCAB)


def _u8(t):
    return t.view(torch.uint8)


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(_u8(sa[k]), _u8(sb[k])), k


# ---- loading ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_loads_kept_8bit_with_the_stored_tensors(ds_ckpt, name):
    """Every routed-experts module a block-scaled `W8A8MoE` with DeepSeek's routing, every other e4m3 linear (MLA
    projections, the dense first layer, the shared experts) a block `W8A8Linear`; the 8-bit weights byte for byte
    and the scales as stored (float32); routers, norms, embeddings and lm_head float as stored; the MTP layer left
    out with one warning."""
    path = ds_ckpt(name)
    with pytest.warns(UserWarning, match=MTP_WARNING) as record:
        model = from_pretrained(path)
    assert sum("multi-token-prediction" in str(w.message) for w in record) == 1
    stored = stored_tensors(path)
    for k in mtp_names(stored):
        del stored[k]
    assert type(model).__name__ == "DeepseekV3ForCausalLM" and len(model.model.layers) == LAYERS

    moes = {n: m for n, m in model.named_modules() if isinstance(m, cw.W8A8MoE)}
    assert sorted(moes) == ["model.layers.1.mlp.experts"]
    m = moes["model.layers.1.mlp.experts"]
    router = model.model.layers[1].mlp.gate
    assert (m.num_experts, m.top_k, m.hidden_size, m.intermediate_size) == (EXPERTS, 2, 256, MOE_I)
    assert m.weight_block_size == (128, 128) and m.quant_dtype == torch.float8_e4m3fn
    assert (m.scoring, m.n_group, m.topk_group, m.scaling_factor, m.renormalize) == ("sigmoid", 2, 1, 2.5, True)
    # the router's own loaded bias, shared (the layer's router-logits mode sees what the router holds)
    assert m.correction_bias.data_ptr() == router.e_score_correction_bias.data_ptr()
    base = "model.layers.1.mlp.experts"
    for e in range(EXPERTS):
        g, u, d = (f"{base}.{e}.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
        assert torch.equal(_u8(m.w13[e]), _u8(torch.cat([stored[f"{g}.weight"], stored[f"{u}.weight"]])))
        assert torch.equal(_u8(m.w2[e]), _u8(stored[f"{d}.weight"]))
        assert m.w13_scale.dtype == torch.float32
        s13 = torch.cat([stored[f"{g}.weight_scale_inv"], stored[f"{u}.weight_scale_inv"]])
        assert torch.equal(m.w13_scale[e], s13)
        assert torch.equal(m.w2_scale[e], stored[f"{d}.weight_scale_inv"])

    linears = {n: l for n, l in model.named_modules() if isinstance(l, cw.W8A8Linear)}
    want = {k[: -len(".weight")] for k, v in stored.items() if v.dtype == torch.float8_e4m3fn and ".experts." not in k}
    assert set(linears) == want
    assert len(want) == 5 * LAYERS + 3 + 3  # MLA x 2 layers, the dense MLP, the shared experts
    for n, lin in linears.items():
        assert lin.weight_block_size == (128, 128), n
        assert torch.equal(_u8(lin.weight), _u8(stored[f"{n}.weight"])), n
        assert lin.weight_scale.dtype == torch.float32 and torch.equal(lin.weight_scale,
                                                                        stored[f"{n}.weight_scale_inv"]), n
    kv_a = linears["model.layers.0.self_attn.kv_a_proj_with_mqa"]
    assert (kv_a.out_features, tuple(kv_a.weight_scale.shape)) == (576, (5, 2))  # a partial 128-row block
    assert type(model.model.layers[0].mlp).__name__ == "DeepseekV3MLP"  # first_k_dense_replace = 1

    # the router as transformers holds it: float32 in 5.24 (its keep-in-float32 list), bf16 in 5.17; exact either way
    assert torch.equal(router.weight, stored["model.layers.1.mlp.gate.weight"].to(router.weight.dtype))
    bias = router.e_score_correction_bias  # float32 in both (transformers 5.17 builds it bf16, loads it float32)
    assert bias.dtype == torch.float32 and torch.equal(bias, stored["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert bool(router.e_score_correction_bias.abs().min() > 0)
    for n in ("model.layers.0.self_attn.kv_a_layernorm", "model.layers.1.self_attn.q_a_layernorm", "model.norm"):
        assert torch.equal(model.get_submodule(n).weight, stored[f"{n}.weight"]), n
    assert type(model.lm_head) is nn.Linear and torch.equal(model.lm_head.weight, stored["lm_head.weight"])
    assert not model.training and getattr(model, "hf_quantizer", None) is None
    if name == "native_ue8m0":
        for k, v in stored.items():
            if k.endswith("weight_scale_inv"):
                assert bool((torch.frexp(v)[0] == 0.5).all()), k


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_each_layer_matches_its_reference(ds_ckpt, name):
    """Teacher-forced, every W8A8MoE (with DeepSeek's routing computed by transformers' router in float64) and every
    W8A8Linear (MLA projections, kv_a_proj_with_mqa's partial block included) against its float64 counterpart in the
    reference dequantized from the files, within the bounds derived from the roundings (tests/_moe_bounds.py, the
    same as for the other MoE families)."""
    path = ds_ckpt(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = from_pretrained(path)
    worst, count = assert_each_layer_within_bounds(ours, file_reference(path),
                                                   file_reference(path, full_float32=True).double(), ids())
    assert count == 1 + 5 * LAYERS + 3 + 3
    print(f"\nDeepSeek-V3 checkpoint layers (CPU): {name:<13} worst {worst:.1f} dB over {count} layers")


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_logits_match_dequantized_checkpoint(ds_ckpt, name):
    """The whole model: ours's logits L against the same-math reference Ls at SQNR_MIN_SAME_MATH, and both against
    the float model Lf (the dequantized weights, exact activations, float32): ||L - Lf|| <= 1.25 ||Ls - Lf|| (ours
    is no less accurate than the reference, the 25 % for the sampling variation of rounding noise, as in
    tests/distributed/test_tp_cpu.py) and ||Ls - Lf|| / ||Lf|| < FLOAT_REL_MAX (the reference is the quantized
    model of these weights)."""
    path = ds_ckpt(name)
    x = ids()
    ours = logits(_load(path), x).double()
    same_ref = logits(file_reference(path), x).double()
    lf = logits(file_reference(path, full_float32=True, act_quant=False), x).double()
    same = sqnr_db(ours, same_ref)
    e_ours, e_ref = float((ours - lf).norm()), float((same_ref - lf).norm())
    print(f"\nDeepSeek-V3 checkpoint SQNR (CPU): {name:<13} {same:6.1f} dB vs the same math in float64, "
          f"{sqnr_db(ours, lf):6.1f} dB vs the float32 model; ||L - Lf|| / ||Ls - Lf|| = {e_ours / e_ref:.3f}, "
          f"||Ls - Lf|| / ||Lf|| = {e_ref / float(lf.norm()):.3f}")
    assert same >= SQNR_MIN_SAME_MATH
    assert e_ours <= TP_VS_TP1_ACCURACY * e_ref
    assert e_ref / float(lf.norm()) < FLOAT_REL_MAX


def test_the_mtp_layer_is_left_out_and_nothing_else(ds_ckpt, tmp_path):
    """Only ``model.layers.{num_hidden_layers}`` is the MTP layer: without ``num_nextn_predict_layers`` its e4m3
    tensors belong to no linear of the model, and the loader refuses them as any stray 8-bit tensor."""
    from _block_checkpoints import copy_checkpoint

    path = copy_checkpoint(ds_ckpt("native"), tmp_path / "c", lambda c: c.update(num_nextn_predict_layers=0))
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model.layers.2.[a-z_.0-9]+' \(F8_E4M3\) belongs to no "
                                         r"nn.Linear of DeepseekV3ForCausalLM"):
        _load(path)
    no_mtp = write_native_deepseek(str(tmp_path / "no_mtp"), mtp=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no MTP tensors: no warning
        from_pretrained(no_mtp)


# ---- saving -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_save_round_trip_is_byte_identical(ds_ckpt, tmp_path, name):
    """`save_pretrained` of the loaded model writes DeepSeek's layout back: every tensor of the files (less the MTP
    layer, which the model does not hold) under its name, in its stored dtype (the bf16 router weight that
    transformers holds in float32 cast back, exactly) and byte for byte; config.json's quantization_config as it
    was (``scale_fmt`` included). It loads back to the same model and logits, without an MTP warning."""
    src = ds_ckpt(name)
    ours = _load(src)
    save_pretrained(ours, tmp_path)
    with open(os.path.join(src, "config.json")) as f, open(tmp_path / "config.json") as g:
        qc_src, qc_out = json.load(f)["quantization_config"], json.load(g)["quantization_config"]
    assert qc_out == qc_src and qc_out.get("scale_fmt") == ("ue8m0" if "ue8m0" in name else None)
    stored, original = stored_tensors(tmp_path), stored_tensors(src)
    mtp = mtp_names(original)
    assert mtp and not mtp_names(stored)
    assert stored.keys() == original.keys() - set(mtp)
    for k, v in stored.items():
        assert v.dtype == original[k].dtype and torch.equal(_u8(v), _u8(original[k])), k
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = from_pretrained(tmp_path)
    _same_state(ours, back)
    assert torch.equal(logits(ours, ids()), logits(back, ids()))


def test_top_level_api_round_trip(ds_ckpt, tmp_path):
    """``cw.from_pretrained`` (which runs ``optimize_``: it leaves DeepSeek's decoder layers as they are, with a
    warning) and ``cw.save_pretrained`` give the same byte-identical files."""
    src = ds_ckpt("native_ue8m0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = cw.from_pretrained(src)
    cw.save_pretrained(ours, tmp_path)
    stored, original = stored_tensors(tmp_path), stored_tensors(src)
    assert stored.keys() == original.keys() - set(mtp_names(original))
    assert all(stored[k].dtype == v.dtype and torch.equal(_u8(stored[k]), _u8(v)) for k, v in original.items()
               if k in stored)


def test_save_as_compressed_tensors(ds_ckpt, tmp_path):
    """``format="compressed-tensors"``: FP8_BLOCK, the experts per expert with ``weight_scale`` (float32), the shared
    experts and MLA projections as block linears, the router (float) not a target; read back to the same model."""
    ours = _load(ds_ckpt("native"))
    save_pretrained(ours, tmp_path, format="compressed-tensors")
    with open(tmp_path / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["config_groups"]["group_0"]["weights"]["strategy"] == "block" and "lm_head" in qc["ignore"]
    stored = stored_tensors(tmp_path)
    assert stored["model.layers.1.mlp.experts.7.down_proj.weight_scale"].dtype == torch.float32
    assert "model.layers.1.mlp.shared_experts.up_proj.weight_scale" in stored
    assert stored["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert not any(k.endswith("weight_scale_inv") for k in stored)
    back = _load(tmp_path)
    _same_state(ours, back)
    assert torch.equal(logits(ours, ids()), logits(back, ids()))


# ---- refusals -----------------------------------------------------------------------------------------------


def _edit(tmp_path, **kw):
    return write_native_deepseek(str(tmp_path / "edited"), **kw)


def _fuse_experts(tensors, cfg):
    base = "model.layers.1.mlp.experts"
    for leaf in ("weight", "weight_scale_inv"):
        gu = torch.stack([torch.cat([tensors.pop(f"{base}.{e}.gate_proj.{leaf}"),
                                     tensors.pop(f"{base}.{e}.up_proj.{leaf}")]) for e in range(EXPERTS)])
        dn = torch.stack([tensors.pop(f"{base}.{e}.down_proj.{leaf}") for e in range(EXPERTS)])
        suffix = "" if leaf == "weight" else "_scale_inv"
        tensors[f"{base}.gate_up_proj{suffix}"], tensors[f"{base}.down_proj{suffix}"] = gu, dn


def _not_a_power_of_two(tensors, cfg):
    k = "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"
    tensors[k] = tensors[k].clone()
    tensors[k][1, 0] *= 1.5


# case: (writer keyword arguments, message)
REFUSALS = {
    "fused experts": (dict(edit=_fuse_experts),
                      "the checkpoint stores the experts of 'model.layers.1.mlp' fused "
                      "('model.layers.1.mlp.experts.gate_up_proj'); they are read as per-expert tensors "
                      "('model.layers.1.mlp.experts.0.gate_proj.weight', ...)"),
    "expert without weight_scale_inv": (
        dict(edit=lambda t, c: t.pop("model.layers.1.mlp.experts.5.down_proj.weight_scale_inv")),
        "the checkpoint has no tensor 'model.layers.1.mlp.experts.5.down_proj.weight_scale_inv', which "
        "quantization_config.weight_block_size = [128, 128] implies for expert 5 of the 8 experts of "
        "'model.layers.1.mlp' (DeepseekV3MoE)"),
    "MLA projection without weight_scale_inv": (
        dict(edit=lambda t, c: t.pop("model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv")),
        "the checkpoint has no tensor 'model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv', the block "
        "scale of the e4m3 weight 'model.layers.0.self_attn.kv_a_proj_with_mqa.weight'"),
    "kv_a_proj_with_mqa scale without its partial block": (
        dict(edit=lambda t, c: t.update({"model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv":
                                         torch.ones(4, 2)})),
        "checkpoint tensor 'model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv' is F32 [4, 2]; "
        "quantization_config.weight_block_size = [128, 128] implies F32 or BF16 or F16 [5, 2] = [ceil(N/128), "
        "ceil(K/128)] for N = 576, K = 256"),
    "64 x 64 blocks": (dict(edit=lambda t, c: c["quantization_config"].update(weight_block_size=[64, 64])),
                       "quantization_config.weight_block_size = [64, 64] is not supported (supported: [128, 128])"),
    "ue8m0 scale not a power of two": (
        dict(ue8m0=True, edit=_not_a_power_of_two),
        "checkpoint tensor 'model.layers.1.mlp.experts.3.up_proj.weight_scale_inv' holds "),
    "another scale_fmt": (dict(edit=lambda t, c: c["quantization_config"].update(scale_fmt="e5m2")),
                          "quantization_config.scale_fmt = 'e5m2' is not supported"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_field(tmp_path, case):
    kw, message = REFUSALS[case]
    path = _edit(tmp_path, **kw)
    with pytest.raises(ValueError) as e:
        _load(path)
    assert str(e.value).startswith("cutlass_w8a8.from_pretrained: ")
    assert message in str(e.value), str(e.value)
    if case == "ue8m0 scale not a power of two":
        assert "at block [1, 0], which is not a power of two, but quantization_config.scale_fmt = 'ue8m0'" in \
            str(e.value)


def test_save_refuses_a_scale_ue8m0_cannot_hold(ds_ckpt, tmp_path):
    """A model loaded from a ue8m0 checkpoint whose scale was changed to a value that is no power of two is not
    written in that format (the file would lie about its scales); compressed-tensors (float32 scales) is."""
    ours = _load(ds_ckpt("native_ue8m0"))
    ours.model.layers[0].self_attn.o_proj.weight_scale[0, 1] *= 3
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model.layers.0.self_attn.o_proj.weight_scale_inv' "
                                         r"holds .* at block \[0, 1\], which is not a power of two"):
        save_pretrained(ours, tmp_path / "a")
    assert not os.path.exists(tmp_path / "a")
    save_pretrained(ours, tmp_path / "b", format="compressed-tensors")
    assert os.path.isfile(tmp_path / "b" / "config.json")



# ---- CUDA (skip without a GPU and the extension) -------------------------------------------------------------


@pytest.mark.sm90
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_cuda_load_matches_cpu_and_saves_back(ds_ckpt, tmp_path, name):
    """Loaded on the GPU (the grouped GEMMs are sm90 only): the CPU load's bytes; each W8A8MoE / W8A8Linear on the
    inputs its CPU twin saw agrees with it at >= 40 dB and the logits at >= 25 dB (test_checkpoints_moe.py's
    test_cuda_load_matches_cpu says why) with the GPU model's routers returning the CPU model's routing
    (`pin_routing`): this tiny model's grouped sigmoid routing has near-ties that the GPU's other rounding flips,
    each moving a token by a whole expert (the ue8m0 checkpoint measured 23.9 dB unpinned on an H200); saved from
    the GPU, the files are byte-identical to the source's (less the MTP layer)."""
    path = ds_ckpt(name)
    cpu, gpu = _load(path), _load(path, device="cuda")
    sc, sg = cpu.state_dict(), gpu.state_dict()
    assert sc.keys() == sg.keys()
    for k in sc:
        assert sg[k].is_cuda and torch.equal(_u8(sc[k]), _u8(sg[k].cpu())), k
    assert gpu.model.layers[1].mlp.experts.correction_bias.is_cuda
    seen = {}

    def keep(n):
        def hook(mod, args, out):
            seen[n] = (tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args), out.clone())
        return hook

    mods = {n for n, m in cpu.named_modules() if isinstance(m, (cw.W8A8MoE, cw.W8A8Linear))}
    hooks = [cpu.get_submodule(n).register_forward_hook(keep(n)) for n in mods]
    routing, unhook = record_routing(cpu)
    x = ids()
    want = logits(cpu, x)
    unhook()
    for h in hooks:
        h.remove()
    with torch.no_grad():
        for n in sorted(mods):
            args, out = seen[n]
            got = gpu.get_submodule(n)(*(a.cuda() if isinstance(a, torch.Tensor) else a for a in args))
            assert got.is_cuda and got.dtype == out.dtype and got.shape == out.shape, n
            assert sqnr_db(got.cpu(), out) >= 40.0, (n, sqnr_db(got.cpu(), out))
    unpin = pin_routing(gpu, routing)  # routed as the CPU model was: see the docstring
    got = logits(gpu, x.cuda()).cpu()
    unpin()
    assert sqnr_db(got, want) >= 25.0, sqnr_db(got, want)
    save_pretrained(gpu, tmp_path)
    stored, original = stored_tensors(tmp_path), stored_tensors(path)
    assert stored.keys() == original.keys() - set(mtp_names(original))
    for k, v in stored.items():
        assert v.dtype == original[k].dtype and torch.equal(_u8(v), _u8(original[k])), k
