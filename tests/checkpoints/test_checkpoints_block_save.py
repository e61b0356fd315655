"""Block-scaled fp8 models written by `cutlass_w8a8.checkpoints.save_pretrained` (compressed-tensors ``FP8_BLOCK``,
``weight_scale`` float32 ``[ceil(N / 128), K / 128]``): the config, the round trip through `from_pretrained` bit
for bit (from each of the three block formats and from ``quantize_``), transformers' own reader on the result,
and ``python -m cutlass_w8a8 quantize --scheme fp8-block``. Checkpoints from tests/_block_checkpoints.py; nothing
is downloaded.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
pytest.importorskip("safetensors")

import cutlass_w8a8 as cw  # noqa: E402
from cutlass_w8a8.checkpoints import cli, from_pretrained, quantization_config_of, save_pretrained  # noqa: E402

# block_ckpt: the checkpoint fixture, imported so that pytest finds it in this module
from _block_checkpoints import (  # noqa: E402, F401
    BLOCK, BLOCK_CHECKPOINTS, block_ckpt, expand_blocks, ids, logits, sqnr_db, stored_tensors, tiny_block_model,
    w8a8_modules)

BLOCK_CONFIG = cw.W8A8Config(dtype=torch.float8_e4m3fn, weight_block_size=(BLOCK, BLOCK))


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8)), k
    assert {n: type(m) for n, m in a.named_modules()} == {n: type(m) for n, m in b.named_modules()}


def _quantized_tiny(kind="llama"):
    model = tiny_block_model(kind, seed=3)
    return cw.quantize_(model, BLOCK_CONFIG, filter_fn=lambda m, fqn: fqn != "lm_head")


def test_quantization_config_is_compressed_tensors_fp8_block():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, preset_name_to_scheme

    qc = quantization_config_of(_quantized_tiny())
    assert qc["format"] == "float-quantized" and qc["quantization_status"] == "compressed"
    assert list(qc["config_groups"]) == ["group_0"] and qc["ignore"] == ["lm_head"]
    g = qc["config_groups"]["group_0"]
    assert g["targets"] == ["Linear"] and g["format"] == "float-quantized"
    preset = preset_name_to_scheme("FP8_BLOCK", ["Linear"])
    # the preset's own fields, compared as parsed objects: what model_dump writes for fields left at their default
    # differs between compressed-tensors releases (0.19 writes "zp_dtype": null, 0.20 leaves it out)
    for field in ("weights", "input_activations"):
        assert QuantizationArgs.model_validate(g[field]) == getattr(preset, field), field
    parsed = QuantizationConfig.model_validate(qc)
    assert QuantizationConfig.model_validate(parsed.model_dump(mode="json")) == parsed
    assert parsed.config_groups["group_0"].weights == preset.weights


@pytest.mark.parametrize("name", ["llama_ct", "qwen3_native_f32", "llama_native_bf16", "quantize_"])
def test_round_trip(block_ckpt, tmp_path, name):
    """compressed-tensors FP8_BLOCK (the default, except for a model loaded from a native checkpoint: asked for by
    ``format``)."""
    ours = _quantized_tiny("qwen3") if name == "quantize_" else from_pretrained(block_ckpt(name))
    save_pretrained(ours, tmp_path, **({"format": "compressed-tensors"} if "native" in name else {}))
    with open(tmp_path / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["config_groups"]["group_0"]["weights"]["strategy"] == "block"
    stored = stored_tensors(tmp_path)
    for n, m in w8a8_modules(ours).items():
        assert stored[f"{n}.weight_scale"].dtype == torch.float32  # float32, what the kernels use
        assert torch.equal(stored[f"{n}.weight_scale"], m.weight_scale)
        assert torch.equal(stored[f"{n}.weight"].view(torch.uint8), m.weight.view(torch.uint8))
        assert f"{n}.weight_scale_inv" not in stored and f"{n}.input_scale" not in stored

    back = from_pretrained(tmp_path)
    _assert_same_state(ours, back)
    assert torch.equal(logits(ours, ids()), logits(back, ids()))
    again = tmp_path / "again"  # the loaded model's own save_pretrained writes the same checkpoint
    back.save_pretrained(again)
    assert {k: v.view(torch.uint8) for k, v in stored_tensors(again).items()}.keys() == stored.keys()
    assert all(torch.equal(stored_tensors(again)[k].view(torch.uint8), v.view(torch.uint8)) for k, v in stored.items())


@pytest.mark.parametrize("name", ["llama_native_f32", "qwen3_native_bf16", "llama_native_bf16"])
def test_native_round_trip_is_byte_identical(block_ckpt, tmp_path, name):
    """A model loaded from a native checkpoint saves back in that format by default: the same tensor names, each
    tensor in its stored dtype (bf16 scales cast back from the layers' float32, exactly) and byte for byte the
    files', the config's quantization_config as the files had it; it loads back to the same model. The model's own
    config keeps describing its state_dict (compressed-tensors, ``weight_scale``), so transformers' own
    ``save_pretrained`` still writes a consistent compressed-tensors checkpoint."""
    src = block_ckpt(name)
    ours = from_pretrained(src)
    assert ours.config.quantization_config["quant_method"] == "compressed-tensors"
    save_pretrained(ours, tmp_path)
    with open(os.path.join(src, "config.json")) as f, open(tmp_path / "config.json") as g:
        assert json.load(g)["quantization_config"] == json.load(f)["quantization_config"]
    stored, original = stored_tensors(tmp_path), stored_tensors(src)
    assert stored.keys() == original.keys()
    for k, v in original.items():
        assert stored[k].dtype == v.dtype and torch.equal(stored[k].view(torch.uint8), v.view(torch.uint8)), k
    assert ours.config.quantization_config["quant_method"] == "compressed-tensors"
    back = from_pretrained(tmp_path)
    _assert_same_state(ours, back)
    again = tmp_path / "ct"
    ours.save_pretrained(again)
    with open(again / "config.json") as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "compressed-tensors"
    _assert_same_state(ours, from_pretrained(again))


def test_native_save_refusals(block_ckpt, tmp_path):
    """``format`` other than the two, ``native-fp8`` for a model not loaded from a native checkpoint, or for one with
    a layer the format cannot hold: ValueError naming it, nothing written."""
    with pytest.raises(ValueError, match=r"`format` must be one of \('compressed-tensors', 'native-fp8'\), got 'fp8'"):
        save_pretrained(_quantized_tiny(), tmp_path / "a", format="fp8")
    with pytest.raises(ValueError, match=r"`format` 'native-fp8' writes back a model loaded from a transformers-native "
                                         r"fp8 checkpoint .* this model was not loaded from one"):
        save_pretrained(_quantized_tiny(), tmp_path / "b", format="native-fp8")
    ours = from_pretrained(block_ckpt("llama_native_bf16"))  # lm_head in bf16: quantize it per channel
    cw.quantize_(ours, cw.W8A8Config(dtype=torch.float8_e4m3fn), filter_fn=lambda m, fqn: fqn == "lm_head")
    with pytest.raises(ValueError, match=r"W8A8Linear 'lm_head' is not block-scaled fp8 .* save with "
                                         r"format='compressed-tensors'"):
        save_pretrained(ours, tmp_path / "c")
    ours = from_pretrained(block_ckpt("qwen3_native_bf16"))  # bf16 scales: a float32 scale bf16 cannot hold
    q = ours.model.layers[0].self_attn.q_proj
    q.weight_scale[0, 0] = q.weight_scale[0, 0] * (1 + 2 ** -12)
    with pytest.raises(ValueError, match=r"the block scale 'model.layers.0.self_attn.q_proj.weight_scale_inv' holds "
                                         r"values that BF16, its dtype in the checkpoint it was loaded from, cannot "
                                         r"hold exactly"):
        save_pretrained(ours, tmp_path / "d")
    assert not any(os.path.exists(tmp_path / d) for d in "abcd")
    save_pretrained(ours, tmp_path / "d", format="compressed-tensors")  # float32 scales: written
    assert torch.equal(from_pretrained(tmp_path / "d").model.layers[0].self_attn.q_proj.weight_scale, q.weight_scale)


@pytest.mark.parametrize("name", ["llama_native_f32", "qwen3_ct"])
def test_transformers_reads_what_we_write(block_ckpt, tmp_path, name):
    """transformers' loader with compressed-tensors' dequantization reads our checkpoint with no missing or
    unexpected keys and the same weights: bit for bit where the scales are bf16 values (qwen3_ct), within the
    bf16 rounding of the float32 scales and of the product (2**-7 relative) otherwise. Its logits then differ from
    ours by its own fake quantization of the activations (compressed-tensors' per-group e4m3 rounding in bf16):
    measured 23.8 / 24.4 dB, the level of our logits against the float32 model (23.5-26.1 dB, as
    test_checkpoints_block.py states); held at >= 20 dB."""
    ours = from_pretrained(block_ckpt(name))
    save_pretrained(ours, tmp_path, format="compressed-tensors")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, dtype=torch.bfloat16, output_loading_info=True,
            quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    bf16_scales = BLOCK_CHECKPOINTS[name][2] == torch.bfloat16
    for n, m in w8a8_modules(ours).items():
        deq = m.weight.float() * expand_blocks(m.weight_scale, m.out_features, m.in_features)
        got = loaded.get_submodule(n).weight
        assert got.dtype == torch.bfloat16
        if bf16_scales:
            assert torch.equal(got, deq.to(torch.bfloat16)), n
        else:
            torch.testing.assert_close(got.float(), deq, rtol=2 ** -7, atol=0)
    assert sqnr_db(logits(loaded, ids()), logits(ours, ids())) >= 20.0


def test_save_mixes_block_and_channel_layers(tmp_path):
    """Block layers beside per-channel fp8 ones: one config group per scheme, targets by module name; the round
    trip keeps each layer's kind."""
    model = tiny_block_model("llama", seed=5)
    cw.quantize_(model, BLOCK_CONFIG, filter_fn=lambda m, fqn: ".mlp." in fqn)
    cw.quantize_(model, cw.W8A8Config(dtype=torch.float8_e4m3fn),
                 filter_fn=lambda m, fqn: ".self_attn." in fqn and isinstance(m, nn.Linear))
    qc = quantization_config_of(model)
    assert len(qc["config_groups"]) == 2
    strategies = sorted(g["weights"]["strategy"] for g in qc["config_groups"].values())
    assert strategies == ["block", "channel"]
    save_pretrained(model, tmp_path)
    back = from_pretrained(tmp_path)
    _assert_same_state(model, back)
    assert back.model.layers[0].mlp.up_proj.weight_block_size == (BLOCK, BLOCK)
    assert back.model.layers[0].self_attn.q_proj.weight_block_size is None


# ---------------------------------------------------------------------------------------------------------------
# the CLI


def _write_float_checkpoint(path, intermediate=320):
    """A tiny float Llama (MLP 320: down_proj K = 320 cannot be block-quantized) with a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from _block_checkpoints import VOCAB

    model = tiny_block_model("llama", seed=4, intermediate=intermediate)
    model.save_pretrained(path)
    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0").save_pretrained(path)


def test_cli_quantize_fp8_block(tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _write_float_checkpoint(src)
    assert cli.main(["quantize", str(src), str(dst), "--scheme", "fp8-block"]) == 0
    out = capsys.readouterr().out
    assert "12 linears quantized to fp8 (e4m3 128x128 weight blocks, dynamic 1x128 activation groups)" in out
    assert "3 left in torch.bfloat16 (2 with K not a multiple of 128: model.layers.0.mlp.down_proj, " \
           "model.layers.1.mlp.down_proj)" in out
    assert os.path.isfile(dst / "tokenizer.json")
    with open(dst / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["strategy"] == "block"
    assert qc["config_groups"]["group_0"]["input_activations"]["strategy"] == "group"
    model = from_pretrained(dst)
    mods = w8a8_modules(model)
    assert len(mods) == 12 and all(m.weight_block_size == (BLOCK, BLOCK) for m in mods.values())
    assert mods["model.layers.0.mlp.gate_proj"].weight_scale.shape == (3, 2)  # N = 320: a partial block
    floats = sorted(n for n, m in model.named_modules() if type(m) is nn.Linear)
    assert floats == ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expect = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    cw.quantize_(expect, BLOCK_CONFIG, filter_fn=lambda m, fqn: fqn != "lm_head" and m.in_features % BLOCK == 0)
    assert torch.equal(logits(model, ids()), logits(expect, ids()))


def test_cli_scheme_and_dtype_must_agree(tmp_path):
    with pytest.raises(SystemExit):
        cli.main([str(tmp_path / "src"), str(tmp_path / "dst"), "--scheme", "fp8-block", "--dtype", "int8"])
