"""compressed-tensors checkpoints: what `cutlass_w8a8.checkpoints.from_pretrained` cannot run exactly raises,
naming the field (c), and the paths that used to corrupt silently now raise or work (d).

Checkpoints are written by compressed-tensors itself from tiny random models in temporary directories
(tests/_checkpoints.py); nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
pytest.importorskip("safetensors")

import cutlass_w8a8 as cw  # noqa: E402
from cutlass_w8a8.checkpoints import from_pretrained, save_pretrained  # noqa: E402

# ckpt: the checkpoint fixture, imported so that pytest finds it in this module
from _checkpoints import (  # noqa: E402, F401
    _ids, _logits, _quantized_tiny, _transformers_load, _w8a8_modules, ckpt, copy_with_config)


# ---------------------------------------------------------------------------------------------------------------
# (c): what cannot run exactly raises, naming the field


def _group(cfg):
    return cfg["quantization_config"]["config_groups"]["group_0"]


def _set(path_keys, value):
    def edit(cfg):
        d = cfg["quantization_config"]
        for k in path_keys[:-1]:
            d = d[k]
        d[path_keys[-1]] = value
    return edit


G0 = ("config_groups", "group_0")
QC = "quantization_config"
UNSUPPORTED = {
    "group weights": (lambda c: _group(c)["weights"].update(strategy="group", group_size=16),
                      f"{QC}.config_groups.group_0.weights.strategy = 'group' is not supported "
                      "(supported: 'channel', 'tensor'; 'block' with type 'float')"),
    # int8 weights in blocks: block scales are fp8 only (the fp8 block refusals: test_checkpoints_block_refusals.py)
    "int8 block weights": (lambda c: _group(c)["weights"].update(strategy="block", block_structure=[16, 16]),
                           f"{QC}.config_groups.group_0.weights.type = 'int' is not supported (supported: 'float' "
                           "with strategy 'block'"),
    "asymmetric weights": (_set(G0 + ("weights", "symmetric"), False),
                           f"{QC}.config_groups.group_0.weights.symmetric = False"),
    "asymmetric activations": (_set(G0 + ("input_activations", "symmetric"), False),
                               f"{QC}.config_groups.group_0.input_activations.symmetric = False"),
    "4-bit weights": (_set(G0 + ("weights", "num_bits"), 4), f"{QC}.config_groups.group_0.weights.num_bits = 4"),
    "pack-quantized": (lambda c: (c[QC].update(format="pack-quantized"), _group(c).pop("format")),
                       f"{QC}.format = 'pack-quantized' is not supported"),
    "group format": (_set(G0 + ("format",), "nvfp4-pack-quantized"),
                     f"{QC}.config_groups.group_0.format = 'nvfp4-pack-quantized'"),
    "weight-only": (_set(G0 + ("input_activations",), None), f"{QC}.config_groups.group_0.input_activations = None"),
    "dynamic per-tensor activations": (
        _set(G0 + ("input_activations", "strategy"), "tensor"),
        f"{QC}.config_groups.group_0.input_activations.strategy = 'tensor' is not supported"),
    "float activations, int weights": (
        _set(G0 + ("input_activations", "type"), "float"),
        f"{QC}.config_groups.group_0.input_activations.type = 'float'"),
    "output activations": (
        lambda c: _group(c).update(output_activations=dict(_group(c)["input_activations"])),
        f"{QC}.config_groups.group_0.output_activations = "),
    "kv cache": (_set(("kv_cache_scheme",), {"num_bits": 8, "type": "float", "strategy": "tensor",
                                             "dynamic": False, "symmetric": True}),
                 f"{QC}.kv_cache_scheme = "),
    "transform": (_set(("transform_config",), {"config_groups": {"u": {"type": "hadamard", "apply": []}}}),
                  f"{QC}.transform_config = "),
    "sparsity": (_set(("sparsity_config",), {"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}),
                 f"{QC}.sparsity_config = "),
    "frozen (dense) weights": (_set(("quantization_status",), "frozen"), f"{QC}.quantization_status = 'frozen'"),
    "another quant method": (_set(("quant_method",), "awq"), f"{QC}.quant_method = 'awq' is not supported "
                             "(supported: 'compressed-tensors'; 'fp8'"),
    "embedding targeted": (_set(G0 + ("targets",), ["Linear", "Embedding"]),
                           "module 'model.embed_tokens' (nn.Embedding) is targeted by "
                           f"{QC}.config_groups.group_0.targets"),
    "N not a multiple of 16": (
        lambda c: (c.update(vocab_size=250), c[QC].update(ignore=[])),
        "module 'lm_head' (nn.Linear, in_features=64, out_features=250) is targeted"),
    "config says float, tensors are int8": (
        lambda c: (_group(c)["weights"].update(type="float"), _group(c)["input_activations"].update(type="float"),
                   _group(c).update(format="float-quantized")),
        "checkpoint tensor 'model.layers.0.self_attn.q_proj.weight' is I8 [64, 64]; group 'group_0' implies F8_E4M3"),
    "static config, no input_scale stored": (
        lambda c: _group(c)["input_activations"].update(dynamic=False, strategy="tensor"),
        "the checkpoint has no tensor 'model.layers.0.self_attn.q_proj.input_scale'"),
    "a stored int8 Linear ignored by the config": (
        _set(("ignore",), ["lm_head", "model.layers.0.self_attn.q_proj"]),
        "checkpoint tensor 'model.layers.0.self_attn.q_proj.weight' (I8) belongs to no targeted nn.Linear"),
    "no quantization config": (lambda c: c.pop(QC), "config.json has no quantization_config"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_checkpoint_raises_naming_the_field(ckpt, tmp_path, case):
    edit, message = UNSUPPORTED[case]
    path = copy_with_config(ckpt("llama_int8_dynamic"), tmp_path / "edited", lambda c: (edit(c), None)[1])
    with pytest.raises(ValueError) as e:
        from_pretrained(path)
    assert str(e.value).startswith("cutlass_w8a8.from_pretrained: ")
    assert message in str(e.value)


def test_unsupported_in_compression_config_names_that_key(ckpt, tmp_path):
    def edit(c):
        qc = c.pop(QC)
        qc["config_groups"]["group_0"]["weights"]["num_bits"] = 4
        c["compression_config"] = qc
    path = copy_with_config(ckpt("llama_int8_dynamic"), tmp_path / "edited", edit)
    with pytest.raises(ValueError, match=r"compression_config\.config_groups\.group_0\.weights\.num_bits = 4"):
        from_pretrained(path)


def test_refused_arguments(ckpt):
    path = ckpt("llama_int8_dynamic")
    with pytest.raises(TypeError, match="`dtype` must be torch.bfloat16 or torch.float16"):
        from_pretrained(path, dtype=torch.float32)
    for kw in ({"device_map": "cpu"}, {"torch_dtype": torch.bfloat16},
               {"quantization_config": transformers.CompressedTensorsConfig(dequantize=True)}):
        with pytest.raises(TypeError, match=f"`{next(iter(kw))}` cannot be passed through"):
            from_pretrained(path, **kw)


@pytest.mark.parametrize("form", ["flat", "nested"])
def test_older_compression_config_key(ckpt, tmp_path, form):
    """Older compressed-tensors wrote `compression_config`, which transformers ignores (it would load the int8
    weights into bf16 layers); it is translated to `quantization_config` before loading."""
    src = ckpt("qwen2_int8_static")

    def edit(c):
        qc = c.pop(QC)
        c["compression_config"] = qc if form == "flat" else {"quantization_config": qc, "sparsity_config": {}}
    path = copy_with_config(src, tmp_path / form, edit)
    a, b = from_pretrained(path), from_pretrained(src)
    assert "compression_config" not in a.config.to_dict()
    assert a.config.quantization_config["config_groups"] == b.config.quantization_config["config_groups"]
    assert torch.equal(_logits(a, _ids()), _logits(b, _ids()))


# ---------------------------------------------------------------------------------------------------------------
# (d): the silent-corruption paths now raise or work


def test_quantize_refuses_a_compressed_model_loaded_by_transformers(ckpt):
    model = _transformers_load(ckpt("llama_int8_dynamic"), dtype=torch.bfloat16)  # kept compressed: int8 Linears
    with pytest.raises(TypeError, match=r"cutlass_w8a8\.from_pretrained"):
        cw.quantize_(model)

@pytest.mark.parametrize("writer", ["model.save_pretrained", "save_pretrained"])
def test_plain_transformers_loads_a_quantize_d_model(tmp_path, writer):
    """Silent-corruption case (b): a quantize_d model saved by transformers' own save_pretrained (quantize_
    attached the compressed-tensors config) loads back with its scales, not as int8 values in bf16 layers."""
    ours = _quantized_tiny()
    if writer == "save_pretrained":
        save_pretrained(ours, tmp_path)
    else:
        assert "quantization_config" in ours.config.to_dict()  # attached by quantize_
        ours.save_pretrained(tmp_path)
    loaded, info = _transformers_load(tmp_path, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    for n, m in _w8a8_modules(ours).items():
        lin = loaded.get_submodule(n)
        assert lin.weight.dtype == torch.int8 and torch.equal(lin.weight, m.weight)
        # compressed-tensors creates the scale parameters in the model dtype: our float32 scales rounded to bf16
        assert torch.equal(lin.weight_scale.reshape(-1), m.weight_scale.to(torch.bfloat16))
        assert (lin.bias is None) == (m.bias is None)
        assert m.bias is None or torch.equal(lin.bias, m.bias)
    assert torch.equal(loaded.lm_head.weight, ours.lm_head.weight)


def _assert_still_quantized(model, dtype):
    mods = _w8a8_modules(model)
    assert mods
    for m in mods.values():
        assert m.weight.dtype in (torch.int8, torch.float8_e4m3fn) and m.weight_scale.dtype == torch.float32
        assert m.dtype == dtype
        assert m.input_scale is None or m.input_scale.dtype == torch.float32


@pytest.mark.parametrize("source", ["quantize_", "from_pretrained"])
@pytest.mark.parametrize("cast", ["half", "to(float16)", "float"])
def test_dtype_casts_keep_8bit_weights(ckpt, source, cast):
    model = _quantized_tiny() if source == "quantize_" else from_pretrained(ckpt("qwen2_int8_static"))
    before = {n: (m.weight.clone(), m.weight_scale.clone()) for n, m in _w8a8_modules(model).items()}
    if cast == "half":
        model = model.half()
    elif cast == "to(float16)":
        model = model.to(torch.float16)
    else:
        model = model.float()
    _assert_still_quantized(model, torch.bfloat16 if cast == "float" else torch.float16)
    for n, m in _w8a8_modules(model).items():
        assert torch.equal(m.weight.view(torch.uint8), before[n][0].view(torch.uint8))
        assert torch.equal(m.weight_scale, before[n][1])
    logits = _logits(model, _ids())
    assert logits.dtype == (torch.float32 if cast == "float" else torch.float16)
    assert torch.isfinite(logits).all()

