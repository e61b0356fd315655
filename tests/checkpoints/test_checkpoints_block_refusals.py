"""Block-scaled fp8 checkpoints that `cutlass_w8a8.checkpoints.from_pretrained` cannot run exactly raise a
ValueError naming the config field and its value (or the tensor / layer): transformers' native fp8 format
(``quant_method: fp8``) and compressed-tensors ``FP8_BLOCK``. Each case edits one field of a checkpoint written
by tests/_block_checkpoints.py (or one tensor), so that exactly that refusal fires; nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
pytest.importorskip("safetensors")

from cutlass_w8a8.checkpoints import from_pretrained  # noqa: E402

# block_ckpt: the checkpoint fixture, imported so that pytest finds it in this module
from _block_checkpoints import block_ckpt, copy_checkpoint  # noqa: E402, F401

QC = "quantization_config"
Q0 = "model.layers.0.self_attn.q_proj"


def _native(**fields):
    def edit(cfg):
        cfg[QC].update(fields)
    return edit


def _drop(key):
    return lambda t: t.pop(key)


def _set_tensor(key, value):
    def edit(t):
        t[key] = value(t)
    return edit


# case: (config edit, tensor edit, message); the base checkpoint is llama_native_bf16 (lm_head left in bf16 by
# modules_to_not_convert)
NATIVE = {
    "static activations": (_native(activation_scheme="static"), None,
                           f"{QC}.activation_scheme = 'static' is not supported (supported: 'dynamic'"),
    "64x64 blocks": (_native(weight_block_size=[64, 64]), None,
                     f"{QC}.weight_block_size = [64, 64] is not supported (supported: [128, 128])"),
    "per-tensor (no blocks)": (_native(weight_block_size=None), None,
                               f"{QC}.weight_block_size = None is not supported (supported: [128, 128])"),
    "e5m2": (_native(fmt="e5m2"), None, f"{QC}.fmt = 'e5m2' is not supported (supported: 'e4m3')"),
    # ue8m0 is read (power-of-two scales, exact in float32), and checked: this checkpoint's scales are absmax / 448
    "ue8m0 scales not powers of two": (_native(scale_fmt="ue8m0"), None,
                                       f"checkpoint tensor '{Q0}.weight_scale_inv' holds "),
    "other scale_fmt": (_native(scale_fmt="e8m0"), None,
                        f"{QC}.scale_fmt = 'e8m0' is not supported (supported: absent, 'float'"),
    "quantized embedding": (_native(modules_to_convert=["model.embed_tokens"]), None,
                            f"{QC}.modules_to_convert = ['model.embed_tokens'] is not supported"),
    "skip list not a list": (_native(modules_to_not_convert="lm_head"), None,
                             f"{QC}.modules_to_not_convert = 'lm_head' is not supported (supported: a list"),
    "skip list names a stored e4m3 layer": (
        _native(modules_to_not_convert=["lm_head", "mlp.down_proj"]), None,
        f"checkpoint tensor 'model.layers.0.mlp.down_proj.weight' is F8_E4M3 but {QC}.modules_to_not_convert "
        "pattern 'mlp.down_proj' leaves 'model.layers.0.mlp.down_proj' unquantized"),
    "missing block scale": (None, _drop(f"{Q0}.weight_scale_inv"),
                            f"the checkpoint has no tensor '{Q0}.weight_scale_inv', the block scale of the e4m3 "
                            f"weight '{Q0}.weight'"),
    "transposed block scale": (None, _set_tensor(f"{Q0}.weight_scale_inv", lambda t: t[f"{Q0}.weight_scale_inv"]
                                                 .t().contiguous()),
                               f"checkpoint tensor '{Q0}.weight_scale_inv' is BF16 [2, 4]; {QC}.weight_block_size "
                               "= [128, 128] implies F32 or BF16 or F16 [4, 2]"),
    "e8m0 scale tensor": (None, _set_tensor(f"{Q0}.weight_scale_inv", lambda t: t[f"{Q0}.weight_scale_inv"].float()
                                            .to(torch.float8_e8m0fnu)),
                          f"checkpoint tensor '{Q0}.weight_scale_inv' is F8_E8M0 [4, 2]"),
    "static activation scale tensor": (None, _set_tensor(f"{Q0}.activation_scale", lambda t: torch.ones(1)),
                                       f"checkpoint tensor '{Q0}.activation_scale' is not part of the block-fp8 "
                                       f"scheme of '{Q0}'"),
    "e5m2 weight": (None, _set_tensor(f"{Q0}.weight", lambda t: t[f"{Q0}.weight"].float().to(torch.float8_e5m2)),
                    f"checkpoint tensor '{Q0}.weight' is F8_E5M2; {QC}.fmt = 'e4m3' implies F8_E4M3"),
    "scale for a float weight": (None, _set_tensor("lm_head.weight_scale_inv", lambda t: torch.ones(3, 2)),
                                 "checkpoint tensor 'lm_head.weight_scale_inv' is stored for the BF16 (not e4m3) "
                                 "weight 'lm_head.weight'"),
    "stray expert tensor": (None, _set_tensor("model.layers.0.mlp.experts.0.weight_scale_inv",
                                              lambda t: torch.ones(1, 2)),
                            "checkpoint tensor 'model.layers.0.mlp.experts.0.weight_scale_inv' (F32) belongs to no "
                            "nn.Linear of LlamaForCausalLM"),
    "no e4m3 weight at all": (
        None, lambda t: [t.update({k: t[k].to(torch.bfloat16)}) or t.pop(k + "_scale_inv")
                         for k in [k for k, v in t.items() if v.dtype == torch.float8_e4m3fn]],
        f"no nn.Linear of LlamaForCausalLM has an e4m3 weight in the checkpoint ({QC}.quant_method = 'fp8')"),
}


@pytest.mark.parametrize("case", list(NATIVE))
def test_native_refusals(block_ckpt, tmp_path, case):
    edit_config, edit_tensors, message = NATIVE[case]
    path = copy_checkpoint(block_ckpt("llama_native_bf16"), tmp_path / "edited", edit_config, edit_tensors)
    with pytest.raises(ValueError) as e:
        from_pretrained(path)
    assert str(e.value).startswith("cutlass_w8a8.from_pretrained: ")
    assert message in str(e.value)


def test_native_k_not_a_multiple_of_128(block_ckpt):
    with pytest.raises(ValueError, match=r"module 'model\.layers\.0\.mlp\.down_proj' \(nn\.Linear, in_features=320, "
                                         r"out_features=256\) has block-scaled fp8 weights but K = 320 is not a "
                                         r"multiple of 128"):
        from_pretrained(block_ckpt("llama_native_f32_mlp320"))


def test_native_refuses_loader_only_arguments(block_ckpt):
    path = block_ckpt("llama_native_bf16")
    with pytest.raises(TypeError, match=r"\['output_loading_info'\] cannot be used here"):
        from_pretrained(path, output_loading_info=True)
    with pytest.raises(TypeError, match="`tp_plan` is given without `tp_group`"):
        from_pretrained(path, tp_plan={"q_proj": "colwise"})


G0 = f"{QC}.config_groups.group_0"


def _group(cfg):
    return cfg[QC]["config_groups"]["group_0"]


# case: (config edit, message); the base checkpoint is llama_ct (compressed-tensors FP8_BLOCK, nothing ignored)
CT = {
    "64x64 blocks": (lambda c: _group(c)["weights"].update(block_structure=[64, 64]),
                     f"{G0}.weights.block_structure = [64, 64] is not supported (supported: [128, 128])"),
    "static activations": (lambda c: _group(c)["input_activations"].update(dynamic=False, strategy="tensor",
                                                                           group_size=None),
                           f"{G0}.input_activations.dynamic = False is not supported (supported: true with block "
                           "weights"),
    "per-token activations": (lambda c: _group(c)["input_activations"].update(strategy="token", group_size=None),
                              f"{G0}.input_activations.strategy = 'token' is not supported (supported: 'group' "
                              "(group_size 128) with block weights)"),
    "1x64 activation groups": (lambda c: _group(c)["input_activations"].update(group_size=64),
                               f"{G0}.input_activations.group_size = 64 is not supported (supported: 128)"),
    "int8 blocks": (lambda c: (_group(c)["weights"].update(type="int"),
                               _group(c)["input_activations"].update(type="int")),
                    f"{G0}.weights.type = 'int' is not supported (supported: 'float' with strategy 'block'"),
}


@pytest.mark.parametrize("case", list(CT))
def test_compressed_tensors_block_refusals(block_ckpt, tmp_path, case):
    edit, message = CT[case]
    path = copy_checkpoint(block_ckpt("llama_ct"), tmp_path / "edited", lambda c: (edit(c), None)[1])
    with pytest.raises(ValueError) as e:
        from_pretrained(path)
    assert str(e.value).startswith("cutlass_w8a8.from_pretrained: ")
    assert message in str(e.value)


def test_compressed_tensors_block_scale_shape(block_ckpt, tmp_path):
    path = copy_checkpoint(block_ckpt("llama_ct"), tmp_path / "edited", None,
                           _set_tensor(f"{Q0}.weight_scale", lambda t: torch.ones(512, 1, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{Q0}\.weight_scale' is BF16 \[512, 1\]; group "
                                         r"'group_0' implies F32 or BF16 or F16 \[4, 2\]"):
        from_pretrained(path)


def test_compressed_tensors_k_not_a_multiple_of_128(block_ckpt):
    with pytest.raises(ValueError, match=r"module 'model\.layers\.0\.mlp\.down_proj' \(nn\.Linear, in_features=320, "
                                         r"out_features=256\) is targeted by quantization_config\.config_groups\."
                                         r"group_0\.targets = \['Linear'\] with block-scaled weights, but K = 320 is "
                                         r"not a multiple of 128"):
        from_pretrained(block_ckpt("llama_ct_mlp320"))
