"""docs/MISUSE.md triggers for the module-level API: `quantize_`, `W8A8Linear.from_float` and what a `W8A8Linear`
is called on, the no-tensor fallback of the ops, and the checkpoints (`from_pretrained`, `save_pretrained`).

DEVICE_TRIGGERS maps a `cpu` row to a function of the device (the modules are built there: test_cpu_row runs it
with "cpu", test_row_on_cuda with "cuda"); CPU_TRIGGERS map a row to a function of nothing. The checkpoint
triggers need transformers / compressed-tensors and skip the row without them; the `device` rows fake the torch
build with unittest.mock, so they raise the same row on a GPU machine.
"""

from __future__ import annotations

import json
import os
import tempfile
from unittest import mock

import pytest
import torch
from torch import nn

import cutlass_w8a8 as cw


def _model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32)).to(device, torch.bfloat16)


def _layer(device):
    return cw.W8A8Linear(64, 32, device=device)


def _quantize_other_scheme(device):
    model = cw.quantize_(_model(device))  # int8
    cw.quantize_(model, cw.W8A8Config(dtype=torch.float8_e4m3fn))


DEVICE_TRIGGERS = {
    "quantize-config-type": lambda d: cw.quantize_(_model(d), "int8"),
    "quantize-filter-fn": lambda d: cw.quantize_(_model(d), filter_fn="lm_head"),
    "quantize-other-scheme": _quantize_other_scheme,
    "from-float-not-linear": lambda d: cw.W8A8Linear.from_float(nn.Conv1d(64, 32, 1).to(d)),
    "from-float-quantized": lambda d: cw.W8A8Linear.from_float(_layer(d)),
    "from-float-config-type": lambda d: cw.W8A8Linear.from_float(_model(d)[0], "fp8"),
    "linear-x-not-tensor": lambda d: _layer(d)([[0.0] * 64]),
    "linear-x-0d": lambda d: _layer(d)(torch.tensor(1.0, dtype=torch.bfloat16, device=d)),
}


# ---- checkpoints --------------------------------------------------------------------------------------------


def _from_pretrained_with_config(text: str):
    """from_pretrained of a directory whose config.json holds ``text`` (no weights: the config is read first)."""
    with tempfile.TemporaryDirectory() as path:
        with open(os.path.join(path, "config.json"), "w") as f:
            f.write(text)
        cw.from_pretrained(path)


def _config_value():
    pytest.importorskip("compressed_tensors")
    args = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False}
    qc = {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(args, strategy="banana"),
                                        "input_activations": dict(args, strategy="token", dynamic=True)}}}
    _from_pretrained_with_config(json.dumps({"model_type": "llama", "quantization_config": qc}))


def _device_cpu_torch():
    with mock.patch.object(torch.cuda, "is_available", return_value=False), \
            mock.patch.object(torch.backends.cuda, "is_built", return_value=False):
        cw.from_pretrained(".", device="cuda")


def _device_no_gpu():
    with mock.patch.object(torch.cuda, "is_available", return_value=False), \
            mock.patch.object(torch.backends.cuda, "is_built", return_value=True):
        cw.from_pretrained(".", device="cuda")


def _device_index():
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "device_count", return_value=1):
        cw.from_pretrained(".", device="cuda:1")


def _save_to_a_file():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.safetensors")
        with open(path, "w") as f:
            f.write("not a directory")
        cw.save_pretrained(model, path)


CPU_TRIGGERS = {
    "x-none": lambda: cw.quantize_int8(None),
    "quantize-model-type": lambda: cw.quantize_(None),
    "load-config-json": lambda: _from_pretrained_with_config('{"model_type": "llama",'),
    "load-config-value": _config_value,
    "load-device-cpu-torch": _device_cpu_torch,
    "load-device-no-gpu": _device_no_gpu,
    "load-device-index": _device_index,
    "save-path-file": _save_to_a_file,
}

CUDA_TRIGGERS: dict = {}
