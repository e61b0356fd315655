"""compressed-tensors checkpoints loaded by `cutlass_w8a8.checkpoints.from_pretrained`: the stored tensors, the
logits and greedy tokens against the checkpoint dequantized by the tests from its files (a, b), sharded files,
options.
What it refuses is in test_checkpoints_refusals.py, our writer in test_checkpoints_save.py, the CLI in
test_checkpoints_cli.py.

Checkpoints are written by compressed-tensors itself (and by llm-compressor's ``oneshot`` where it imports) from
tiny random Llama / Qwen2 models, in temporary directories; nothing is downloaded. On the CPU the layers run the
reference ops (float64 GEMMs), so the models are tiny.

Accuracy (measured on the CPU, torch 2.13, the same with transformers 5.17 / compressed-tensors 0.19 and
transformers 5.24 / compressed-tensors 0.20; the SQNR of our logits, bf16 model, against the reference
`_checkpoints.decompressed_reference`: a plain transformers model holding the weights dequantized from the
safetensors files, ``q * weight_scale``, with our activation quantization applied to each quantized Linear's input,
per token or with the stored ``input_scale`` as the checkpoint's config says, its sums in float64; no transformers
quantizer is involved, so the reference does not change with transformers' compressed-tensors integration):

=========================  ======================  ========================
checkpoint                 vs bf16 model, float64   vs all-float32 model
                           quantized linears
=========================  ======================  ========================
llama int8 dynamic         61.7 dB                  42.2 dB
qwen2 fp8 dynamic          inf (equal)              32.7 dB
qwen2 int8 static          inf (equal)              40.4 dB
llama fp8 static, tensor   inf (equal)              33.3 dB
qwen2 int8 tensor weights  inf (equal)              42.4 dB
llama SmoothQuant + GPTQ   inf (equal)              41.5 dB
=========================  ======================  ========================

The first column is the same math as ours without our float32 roundings (a float64 sum against our exact sum
rounded to float32 and scaled): the bf16 outputs differ only where a rounding flips, so it is held at >= 50 dB (a
per-token scale of absmax / 127.5 instead of / 127, compressed-tensors' own convention, measures 40.6 dB for llama
int8 dynamic, 31.1 dB for qwen2 fp8 dynamic). It is the same with oneDNN / MKL / ATen held to AVX2 or AVX-512
without AMX, 1 or 2 threads (with a float32 reference, summed in the CPU's BLAS order, it was 59.0-71.6 dB where it
is now equal). The second column is the accuracy of a bf16 model against exact arithmetic and is held at >= 35 dB
(int8) / >= 28 dB (fp8). The SmoothQuant + GPTQ row is from before the float64 reference (llm-compressor is not
installed here).
"""


from __future__ import annotations

import os

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
pytest.importorskip("safetensors")

import cutlass_w8a8 as cw  # noqa: E402
from cutlass_w8a8.checkpoints import from_pretrained  # noqa: E402

# ckpt: the checkpoint fixture, imported so that pytest finds it in this module
from _checkpoints import (  # noqa: E402, F401
    CT_CHECKPOINTS, _ids, _logits, _w8a8_modules, assert_greedy_tokens_agree, ckpt, decompressed_reference, sqnr_db,
    stored_tensors)

# dB; see the module docstring
SQNR_MIN_SAME_MATH = 50.0
SQNR_MIN_FLOAT32 = {torch.int8: 35.0, torch.float8_e4m3fn: 28.0}


# ---------------------------------------------------------------------------------------------------------------
# (a), (b): against the checkpoint dequantized from its files (decompressed_reference)


ALL_CHECKPOINTS = list(CT_CHECKPOINTS) + ["llama_int8_smoothquant_gptq"]


def _expect(name):
    if name == "llama_int8_smoothquant_gptq":
        return torch.int8, False, True
    return CT_CHECKPOINTS[name][2:]


@pytest.mark.parametrize("name", ALL_CHECKPOINTS)
def test_layers_hold_the_stored_tensors(ckpt, name):
    path = ckpt(name)
    quant_dtype, static, per_channel = _expect(name)
    model = from_pretrained(path)
    stored = stored_tensors(path)
    mods = _w8a8_modules(model)
    assert sorted(mods) == sorted(k[: -len(".weight_scale")] for k in stored if k.endswith(".weight_scale"))
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight.dtype == torch.bfloat16
    for n, m in mods.items():
        assert m.quant_dtype == quant_dtype and m.per_channel == per_channel
        assert (m.input_scale is not None) == static
        assert torch.equal(m.weight.view(torch.uint8), stored[f"{n}.weight"].view(torch.uint8))
        assert m.weight_scale.dtype == torch.float32
        assert torch.equal(m.weight_scale, stored[f"{n}.weight_scale"].float().reshape(-1))
        if static:
            assert m.input_scale.dtype == torch.float32
            assert torch.equal(m.input_scale, stored[f"{n}.input_scale"].float().reshape(-1))
        if f"{n}.bias" in stored:
            assert torch.equal(m.bias, stored[f"{n}.bias"])
        else:
            assert m.bias is None
    assert model.hf_quantizer is None and not hasattr(model, "ct_decompress_hook")
    assert not model._forward_pre_hooks and not model.training
    assert isinstance(model.config.quantization_config, dict)


@pytest.mark.parametrize("name", ALL_CHECKPOINTS)
def test_logits_match_decompressed_checkpoint(ckpt, name):
    path = ckpt(name)
    quant_dtype = _expect(name)[0]
    ids = _ids()
    ours = _logits(from_pretrained(path), ids)
    same_math = sqnr_db(ours, _logits(decompressed_reference(path), ids))
    full32 = sqnr_db(ours, _logits(decompressed_reference(path, full_float32=True), ids))
    print(f"{name}: SQNR {same_math:.1f} dB vs bf16 model with float64 linears, {full32:.1f} dB vs float32 model")
    assert same_math >= SQNR_MIN_SAME_MATH
    assert full32 >= SQNR_MIN_FLOAT32[quant_dtype]


@pytest.mark.parametrize("name", ALL_CHECKPOINTS)
def test_greedy_tokens_match_decompressed_checkpoint(ckpt, name):
    path = ckpt(name)
    ours, ref = from_pretrained(path), decompressed_reference(path)
    assert_greedy_tokens_agree(ours, ref, _ids(seed=10, batch=1, seq=8), 16, SQNR_MIN_SAME_MATH)


def test_sharded_checkpoint_loads_like_single_file(ckpt):
    path = ckpt("llama_int8_dynamic_sharded")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    a, b = from_pretrained(path), from_pretrained(ckpt("llama_int8_dynamic"))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8)), k


def test_output_loading_info_passes_through(ckpt):
    model, info = from_pretrained(ckpt("llama_int8_dynamic"), output_loading_info=True)
    assert _w8a8_modules(model)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_model_cls_and_lazy_imports(ckpt):
    import subprocess
    import sys

    model = from_pretrained(ckpt("llama_int8_dynamic"), model_cls=transformers.LlamaForCausalLM)
    assert type(model) is transformers.LlamaForCausalLM and len(_w8a8_modules(model)) == 14
    code = ("import sys, torch, cutlass_w8a8.checkpoints as c; "
            "c.attach_quantization_config(torch.nn.Linear(16, 16)); "
            "assert not {'transformers', 'compressed_tensors'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_float16_model(ckpt):
    path = ckpt("qwen2_int8_static")
    model = from_pretrained(path, dtype=torch.float16)
    assert all(m.dtype == torch.float16 and m.weight_scale.dtype == torch.float32
               for m in _w8a8_modules(model).values())
    logits = _logits(model, _ids())
    assert logits.dtype == torch.float16
    assert sqnr_db(logits, _logits(from_pretrained(path), _ids())) > 30



# ---------------------------------------------------------------------------------------------------------------
# CUDA (skip without a GPU and the extension)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["llama_int8_dynamic", "qwen2_int8_static", "qwen2_fp8_dynamic"])
def test_cuda_load_matches_cpu(ckpt, name):
    """GPU vs CPU logits. The W8A8 GEMMs agree within an output ulp (int8 exactly accumulated; fp8 with fast
    accumulation over K <= 128); attention, norms and the bf16 lm_head run other kernels, so the logits are
    compared by SQNR, >= 35 dB: the same math in another order measures 59 dB or more on the CPU (module
    docstring), and a wrong scale or activation quantization falls to about 40 dB or less. Not yet run: written
    on a machine without a GPU."""
    path = ckpt(name)
    if _expect(name)[0] == torch.float8_e4m3fn and not cw.supports_fp8():
        pytest.skip("no fp8 kernels on this device")
    gpu = from_pretrained(path, device="cuda")
    assert all(m.weight.is_cuda and m.weight_scale.is_cuda for m in _w8a8_modules(gpu).values())
    ids = _ids()
    got = _logits(gpu, ids.cuda()).cpu()
    want = _logits(from_pretrained(path), ids)
    assert sqnr_db(got, want) >= 35.0
