"""compressed-tensors checkpoints written by `cutlass_w8a8.checkpoints.save_pretrained` (e): the round trip
through our writer, the quantization_config forms, what the writer refuses, and the round trip on CUDA.

Models are tiny random transformers models quantized by `quantize_` (tests/_checkpoints.py); nothing is
downloaded.
"""

from __future__ import annotations

import json

import pytest
import torch
from packaging.version import Version
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
pytest.importorskip("safetensors")

import cutlass_w8a8 as cw  # noqa: E402
from cutlass_w8a8.checkpoints import (  # noqa: E402
    attach_quantization_config, from_pretrained, quantization_config_of, save_pretrained)

# ckpt: the checkpoint fixture, imported so that pytest finds it in this module
from _checkpoints import (  # noqa: E402, F401
    _ids, _logits, _quantized_tiny, _transformers_load, _w8a8_modules, ckpt, stored_tensors, tiny_model)


# ---------------------------------------------------------------------------------------------------------------
# (e): round trip through our writer


def _mixed_schemes(model):
    """Make the layers of a quantize_d tiny model use three schemes: layer 0 attention static per-tensor
    activations, layer 1 MLP per-tensor weights, the rest as quantize_ made them."""
    for name, m in list(_w8a8_modules(model).items()):
        parent, _, child = name.rpartition(".")
        if name.startswith("model.layers.0.self_attn"):
            new = cw.W8A8Linear.from_quantized(m.weight, m.weight_scale, m.bias,
                                               input_scale=torch.tensor([0.0123]), dtype=m.dtype)
        elif name.startswith("model.layers.1.mlp"):
            w = m.weight.float() * m.weight_scale[:, None]
            q, s = torch.ops.cutlass_w8a8.quantize_per_token(w.reshape(1, -1), m.quant_dtype)
            new = cw.W8A8Linear.from_quantized(q.reshape(w.shape), s.reshape(1), m.bias, dtype=m.dtype)
        else:
            continue
        setattr(model.get_submodule(parent), child, new)
    return model


def _round_scales_to_bf16(model):
    for m in _w8a8_modules(model).values():
        m.weight_scale.copy_(m.weight_scale.to(torch.bfloat16).float())
        if m.input_scale is not None:
            m.input_scale.copy_(m.input_scale.to(torch.bfloat16).float())
    return model


# From transformers 5.23 on, `CompressedTensorsConfig(dequantize=True)` builds a dense model: each checkpoint
# weight is dequantized as it loads into a plain nn.Linear, no quantization scheme or activation quantization is
# attached, and a static layer's `input_scale` has no parameter to load into, so transformers reports it as an
# unexpected key (for compressed-tensors' own checkpoints too: test_transformers_dequantize_and_static_input_scales).
# Before 5.23 it attached compressed-tensors' quantized modules (with an input_scale) and then decompressed them.
TRANSFORMERS_DENSE_DEQUANTIZE = Version(transformers.__version__).release >= (5, 23)


ROUND_TRIP = {
    "qwen2 int8": lambda: _quantized_tiny("qwen2", torch.int8),
    "llama fp8": lambda: _quantized_tiny("llama", torch.float8_e4m3fn),
    "qwen2 three schemes": lambda: _mixed_schemes(_quantized_tiny("qwen2", torch.int8)),
}


@pytest.mark.parametrize("bf16_scales", [True, False], ids=["bf16-representable scales", "float32 scales"])
@pytest.mark.parametrize("case", list(ROUND_TRIP))
def test_round_trip(tmp_path, case, bf16_scales):
    ours = ROUND_TRIP[case]()
    if bf16_scales:
        _round_scales_to_bf16(ours)
    save_pretrained(ours, tmp_path)
    with open(tmp_path / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quantization_status"] == "compressed"
    stored = stored_tensors(tmp_path)
    assert all(v.dtype == torch.float32 for k, v in stored.items() if k.endswith("_scale"))

    # transformers' loader as it loads any compressed-tensors checkpoint (kept compressed): no missing, unexpected or
    # mismatched keys
    _, info = _transformers_load(tmp_path, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # decompressing: weights equal ours dequantized (exactly when the scales are bf16 values; else within the bf16
    # rounding of the scales, 2**-8 relative). No missing keys; the static layers' input_scale are unexpected from
    # transformers 5.23 on (TRANSFORMERS_DENSE_DEQUANTIZE)
    loaded, info = _transformers_load(tmp_path, dtype=torch.bfloat16, output_loading_info=True,
                                      quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    assert not info["missing_keys"] and not info["mismatched_keys"]
    static = {f"{n}.input_scale" for n, m in _w8a8_modules(ours).items() if m.input_scale is not None}
    assert set(info["unexpected_keys"]) == (static if TRANSFORMERS_DENSE_DEQUANTIZE else set())
    for n, m in _w8a8_modules(ours).items():
        deq = (m.weight.float() * m.weight_scale.reshape(-1, 1)).to(torch.bfloat16)
        got = loaded.get_submodule(n).weight
        assert got.dtype == torch.bfloat16
        if bf16_scales:
            assert torch.equal(got, deq), n
        else:
            torch.testing.assert_close(got.float(), deq.float(), rtol=2 ** -7, atol=0)

    # ours: the same buffers bit for bit, the same logits
    back = from_pretrained(tmp_path)
    sa, sb = ours.state_dict(), back.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8)), k
    assert {n: type(m) for n, m in ours.named_modules()} == {n: type(m) for n, m in back.named_modules()}
    assert torch.equal(_logits(ours, _ids()), _logits(back, _ids()))
    # and the loaded model saves again to the same checkpoint
    model_dir = tmp_path / "again"
    back.save_pretrained(model_dir)
    again = stored_tensors(model_dir)
    assert again.keys() == stored.keys() and all(torch.equal(again[k].view(torch.uint8), stored[k].view(torch.uint8))
                                                 for k in stored)


def test_transformers_dequantize_and_static_input_scales(ckpt):
    """The difference TRANSFORMERS_DENSE_DEQUANTIZE describes is transformers', not our writer's: a static checkpoint
    written by compressed-tensors itself loads the same way (no unexpected key kept compressed; every input_scale
    unexpected when decompressed from transformers 5.23 on)."""
    path = ckpt("qwen2_int8_static")
    static = {k for k in stored_tensors(path) if k.endswith(".input_scale")}
    assert len(static) == 14
    _, info = _transformers_load(path, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    _, info = _transformers_load(path, dtype=torch.bfloat16, output_loading_info=True,
                                 quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    assert not info["missing_keys"]
    assert set(info["unexpected_keys"]) == (static if TRANSFORMERS_DENSE_DEQUANTIZE else set())


def test_quantization_config_forms():
    from compressed_tensors.quantization import QuantizationConfig

    one = quantization_config_of(_quantized_tiny("llama"))
    assert one["format"] == "int-quantized" and one["quantization_status"] == "compressed"
    assert list(one["config_groups"]) == ["group_0"] and one["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert one["ignore"] == ["lm_head"]
    w, a = one["config_groups"]["group_0"]["weights"], one["config_groups"]["group_0"]["input_activations"]
    assert (w["type"], w["strategy"], w["dynamic"], w["symmetric"], w["num_bits"]) == ("int", "channel", False, True, 8)
    assert (a["type"], a["strategy"], a["dynamic"]) == ("int", "token", True)

    mixed = _mixed_schemes(_quantized_tiny("qwen2"))
    many = quantization_config_of(mixed)
    assert len(many["config_groups"]) == 3 and many["ignore"] == []
    targets = sorted(t for g in many["config_groups"].values() for t in g["targets"])
    assert targets == sorted(_w8a8_modules(mixed))
    for qc in (one, many):
        assert QuantizationConfig.model_validate(qc).model_dump(mode="json") | {"version": qc["version"]} == qc

    fp8 = quantization_config_of(_quantized_tiny("llama", torch.float8_e4m3fn))
    assert fp8["format"] == "float-quantized"
    assert quantization_config_of(tiny_model("llama")) is None


def test_save_pretrained_refuses_non_transformers_models(tmp_path):
    model = cw.quantize_(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).to(torch.bfloat16))
    with pytest.raises(TypeError, match="must be a transformers PreTrainedModel, got Sequential"):
        save_pretrained(model, tmp_path)
    with pytest.raises(ValueError, match="holds no W8A8Linear"):
        save_pretrained(tiny_model("llama"), tmp_path)
    attach_quantization_config(model)  # no-op
    float_model = tiny_model("llama")
    attach_quantization_config(float_model)
    assert getattr(float_model.config, "quantization_config", None) is None


# ---------------------------------------------------------------------------------------------------------------
# CUDA (skip without a GPU and the extension)


@pytest.mark.cuda
def test_cuda_save_round_trip(ckpt, tmp_path):
    gpu = from_pretrained(ckpt("qwen2_int8_static"), device=torch.device("cuda"))
    save_pretrained(gpu, tmp_path)
    back = from_pretrained(tmp_path, device="cuda")
    sa, sb = gpu.state_dict(), back.state_dict()
    for k in sa:
        assert torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8)), k
    assert torch.equal(_logits(gpu, _ids().cuda()), _logits(back, _ids().cuda()))
