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

import _moe_decode


def _model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32)).to(device, torch.bfloat16)


def _layer(device):
    return cw.W8A8Linear(64, 32, device=device)


def _quantize_other_scheme(device):
    model = cw.quantize_(_model(device))  # int8
    cw.quantize_(model, cw.W8A8Config(dtype=torch.float8_e4m3fn))


def _moe(device):
    return cw.W8A8MoE(8, 2, 256, 128, device=device)


def _moe_call(device, what):
    x = torch.randn(4, 256, device=device).to(torch.bfloat16)
    logits = torch.randn(4, 8, device=device)
    ids = torch.tensor([[0, 1]] * 4, device=device)
    w = torch.full((4, 2), 0.5, device=device)
    args = {"hidden": (x[:, :128], logits), "logits": (x, logits[:, :4]), "ids-as-logits": (x, ids),
            "weights": (x, ids, w[:, :1])}[what]
    _moe(device)(*args)


def _quantize_int8_experts(device):
    # a transformers-named block (quantize_ matches MixtralSparseMoeBlock by class name) whose experts hold int8
    class MixtralSparseMoeBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Module()
            self.gate.top_k = 2
            self.experts = nn.Module()
            self.experts.gate_up_proj = nn.Parameter(torch.zeros(4, 64, 32, dtype=torch.int8, device=device),
                                                     requires_grad=False)
            self.experts.down_proj = nn.Parameter(torch.zeros(4, 32, 32, dtype=torch.int8, device=device),
                                                  requires_grad=False)

    cw.quantize_(nn.Sequential(MixtralSparseMoeBlock()))


DEVICE_TRIGGERS = {
    "moe-layer-sizes": lambda d: cw.W8A8MoE(8, 2, 200, 128, device=d),
    "moe-layer-top-k": lambda d: cw.W8A8MoE(8, 9, 256, 128, device=d),
    "moe-layer-hidden-states": lambda d: _moe_call(d, "hidden"),
    "moe-layer-router-logits": lambda d: _moe_call(d, "logits"),
    "moe-layer-logits-dtype": lambda d: _moe_call(d, "ids-as-logits"),
    "moe-layer-topk-weights-shape": lambda d: _moe_call(d, "weights"),
    "moe-layer-from-float-quantized": lambda d: cw.W8A8MoE.from_float(_moe(d), None, 2),
    "moe-layer-from-8bit": _quantize_int8_experts,
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


def _from_pretrained_a_file():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.safetensors")
        with open(path, "w") as f:
            f.write("not a directory")
        cw.from_pretrained(path)


def _save_unloadable():
    """A quantized tiny Llama whose layer-0 q_proj moved to a name the architecture does not have."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = cw.quantize_(transformers.LlamaForCausalLM(config).to(torch.bfloat16), cw.W8A8Config(),
                         filter_fn=lambda m, fqn: fqn != "lm_head")
    attn = model.model.layers[0].self_attn
    attn.qkv_proj = attn.q_proj
    del attn.q_proj
    with tempfile.TemporaryDirectory() as d:
        cw.save_pretrained(model, os.path.join(d, "out"))


CPU_TRIGGERS = {
    "x-none": lambda: cw.quantize_int8(None),
    "quantize-model-type": lambda: cw.quantize_(None),
    "load-config-json": lambda: _from_pretrained_with_config('{"model_type": "llama",'),
    "load-config-value": _config_value,
    "load-device-cpu-torch": _device_cpu_torch,
    "load-device-no-gpu": _device_no_gpu,
    "load-device-index": _device_index,
    "save-path-file": _save_to_a_file,
    "load-path-file": _from_pretrained_a_file,
    "load-device-gpu": lambda: cw.from_pretrained(".", device="gpu"),
    "save-unloadable": _save_unloadable,
}

CUDA_TRIGGERS: dict = {}


# ---- MoE routing: moe_topk_softmax, moe_align, moe_permute_quant, moe_unpermute --------------------------------


def _i32(*shape, d="cpu"):
    return torch.zeros(*shape, dtype=torch.int32, device=d)


def _unpermute(d, y=None, dst=None, w=None, **kw):
    """moe_unpermute with T = 2, top_k = 2, H = 8 legal operands on device d, one replaced."""
    y = torch.zeros(4, 8, device=d) if y is None else y
    dst = _i32(4, d=d) if dst is None else dst
    w = torch.zeros(2, 2, device=d) if w is None else w
    return cw.moe_unpermute(y, dst, w, **kw)


def _permute(d, x=None, sp=None, top_k=2, dtype=torch.int8, group_size=None):
    x = torch.zeros(2, 128, dtype=torch.bfloat16, device=d) if x is None else x
    sp = _i32(4, d=d) if sp is None else sp
    return cw.moe_permute_quant(x, sp, top_k, dtype, None, group_size)


_MOE_DEVICE_TRIGGERS = {
    "moe-logits-dtype": lambda d: cw.moe_topk_softmax(torch.zeros(2, 4, dtype=torch.float64, device=d), 1),
    "moe-logits-shape": lambda d: cw.moe_topk_softmax(torch.zeros(2, 3, 4, device=d), 1),
    "moe-logits-experts": lambda d: cw.moe_topk_softmax(torch.zeros(2, 1025, device=d), 1),
    "moe-top-k": lambda d: cw.moe_topk_softmax(torch.zeros(2, 4, device=d), 5),
    "moe-ids-dtype": lambda d: cw.moe_align(torch.zeros(2, 2, device=d), 4),
    "moe-ids-shape": lambda d: cw.moe_align(_i32(4, d=d), 4),
    "moe-num-experts": lambda d: cw.moe_align(_i32(2, 2, d=d), 0),
    "moe-permute-x-shape": lambda d: _permute(d, x=torch.zeros(2, 2, 128, device=d)),
    "moe-pairs-dtype": lambda d: _permute(d, sp=torch.zeros(4, dtype=torch.int64, device=d)),
    "moe-permute-top-k": lambda d: _permute(d, top_k=0),
    "moe-pairs-shape": lambda d: _permute(d, sp=_i32(3, d=d)),
    "moe-permute-dtype": lambda d: _permute(d, dtype=torch.float16),
    "moe-permute-group-k": lambda d: _permute(d, x=torch.zeros(2, 64, device=d), dtype=torch.float8_e4m3fn,
                                              group_size=128),
    "moe-y-dtype": lambda d: _unpermute(d, y=_i32(4, 8, d=d)),
    "moe-dst-dtype": lambda d: _unpermute(d, dst=torch.zeros(4, device=d)),
    "moe-weights-dtype": lambda d: _unpermute(d, w=torch.zeros(2, 2, dtype=torch.bfloat16, device=d)),
    "moe-out-dtype": lambda d: _unpermute(d, out=torch.zeros(2, 8, dtype=torch.bfloat16, device=d)),
    "moe-weights-shape": lambda d: _unpermute(d, w=torch.zeros(4, device=d)),
    "moe-y-shape": lambda d: _unpermute(d, y=torch.zeros(5, 8, device=d)),
    "moe-dst-shape": lambda d: _unpermute(d, dst=_i32(5, d=d)),
    "moe-out-shape": lambda d: _unpermute(d, out=torch.zeros(2, 9, device=d)),
    "moe-out-contiguous": lambda d: _unpermute(d, out=torch.zeros(8, 2, device=d).t()),
}
DEVICE_TRIGGERS.update(_MOE_DEVICE_TRIGGERS)


def _route(d, e=8, k=2, **kw):
    """moe_route on (2, E) float32 logits on device d with the keyword arguments given."""
    return cw.moe_route(torch.zeros(2, e, device=d), k, **kw)


DEVICE_TRIGGERS.update({
    "moe-route-scoring": lambda d: _route(d, scoring="tanh"),
    "moe-route-bias-dtype": lambda d: _route(d, correction_bias=torch.zeros(8, dtype=torch.bfloat16, device=d)),
    "moe-route-bias-shape": lambda d: _route(d, correction_bias=torch.zeros(7, device=d)),
    "moe-route-n-group": lambda d: _route(d, e=66, n_group=33),
    "moe-route-n-group-divide": lambda d: _route(d, n_group=3),
    "moe-route-topk-group": lambda d: _route(d, n_group=4, topk_group=5),
    "moe-route-top-k-groups": lambda d: _route(d, k=3, n_group=4, topk_group=1),
    "moe-route-scaling": lambda d: _route(d, scaling_factor=float("inf")),
})

def _router_route(d, x=None, w=None, k=2, **kw):
    """moe_router_route on x (2, 64) bf16 and router_weight (8, 64) bf16 on device d, with the changes given."""
    x = torch.zeros(2, 64, dtype=torch.bfloat16, device=d) if x is None else x
    w = torch.zeros(8, 64, dtype=torch.bfloat16, device=d) if w is None else w
    return cw.moe_router_route(x, w, k, **kw)


_BF16 = torch.bfloat16
DEVICE_TRIGGERS.update({
    "moe-rr-x-dtype": lambda d: _router_route(d, x=torch.zeros(2, 64, device=d)),
    "moe-rr-x-shape": lambda d: _router_route(d, x=torch.zeros(2, 1, 64, dtype=_BF16, device=d)),
    "moe-rr-x-rows": lambda d: _router_route(d, x=torch.zeros(17, 64, dtype=_BF16, device=d)),
    "moe-rr-x-h": lambda d: _router_route(d, x=torch.zeros(2, 96, dtype=_BF16, device=d)),
    "moe-rr-weight-dtype": lambda d: _router_route(d, w=torch.zeros(8, 64, device=d)),
    "moe-rr-weight-shape": lambda d: _router_route(d, w=torch.zeros(8, 128, dtype=_BF16, device=d)),
    "moe-rr-weight-experts": lambda d: _router_route(d, w=torch.zeros(1025, 64, dtype=_BF16, device=d)),
    "moe-rr-layout": lambda d: _router_route(d, x=torch.zeros(2, 128, dtype=_BF16, device=d)[:, ::2]),
    "moe-rr-aligned": lambda d: _router_route(d, w=torch.zeros(8 * 64 + 8, dtype=_BF16, device=d)[1:513].view(8, 64)),
    "moe-rr-logits-dtype": lambda d: _router_route(d, logits_dtype=torch.float16),
    "moe-rr-top-k": lambda d: _router_route(d, k=9),
    "moe-rr-n-group-divide": lambda d: _router_route(d, n_group=3),
})


def _norm_router(d, x=None, residual=None, norm_weight=None, eps=1e-6, w=None, k=2, **kw):
    """cw.ops.add_rms_norm_moe_router_route on x and residual (2, 64) bf16, norm_weight (64,) bf16, eps 1e-6 and
    router_weight (8, 64) bf16 on device d, with the changes given."""
    x = torch.zeros(2, 64, dtype=_BF16, device=d) if x is None else x
    residual = torch.zeros(2, 64, dtype=_BF16, device=d) if residual is None else residual
    norm_weight = torch.ones(64, dtype=_BF16, device=d) if norm_weight is None else norm_weight
    w = torch.zeros(8, 64, dtype=_BF16, device=d) if w is None else w
    return cw.ops.add_rms_norm_moe_router_route(x, residual, norm_weight, eps, w, k, **kw)


def _norm_router_h(d):
    h = 8256
    return _norm_router(d, x=torch.zeros(2, h, dtype=_BF16, device=d), residual=torch.zeros(2, h, dtype=_BF16, device=d),
                        norm_weight=torch.ones(h, dtype=_BF16, device=d), w=torch.zeros(8, h, dtype=_BF16, device=d))


DEVICE_TRIGGERS.update({
    "norm-rr-x-rows": lambda d: _norm_router(d, x=torch.zeros(17, 64, dtype=_BF16, device=d)),
    "norm-rr-h-range": _norm_router_h,
    "norm-rr-residual-dtype": lambda d: _norm_router(d, residual=torch.zeros(2, 64, dtype=torch.float16, device=d)),
    "norm-rr-residual-shape": lambda d: _norm_router(d, residual=torch.zeros(3, 64, dtype=_BF16, device=d)),
    "norm-rr-residual-layout": lambda d: _norm_router(d, residual=torch.zeros(2, 68, dtype=_BF16, device=d)[:, :64]),
    "norm-rr-norm-weight-dtype": lambda d: _norm_router(d, norm_weight=torch.ones(64, device=d)),
    "norm-rr-norm-weight-shape": lambda d: _norm_router(d, norm_weight=torch.ones(32, dtype=_BF16, device=d)),
    "norm-rr-norm-weight-misaligned": lambda d: _norm_router(d, norm_weight=torch.ones(72, dtype=_BF16,
                                                                                       device=d)[4:68]),
    "norm-rr-eps": lambda d: _norm_router(d, eps=-1.0),
})

CPU_TRIGGERS.update({
    "moe-logits-too-many-rows": lambda: cw.moe_topk_softmax(torch.empty(2**31, 8, device="meta"), 2),
    "moe-ids-too-many": lambda: cw.moe_align(torch.empty(2**28, 8, dtype=torch.int32, device="meta"), 8),
    "moe-permute-rows": lambda: _permute("meta", x=torch.empty(2**30, 128, dtype=torch.bfloat16, device="meta"),
                                         sp=_i32(0, d="meta"), top_k=4),
    "moe-y-too-many-rows": lambda: _unpermute("meta", y=torch.empty(2**31, 8, device="meta"),
                                              w=torch.empty(2**31, 1, device="meta")),
    "moe-y-h-too-large": lambda: _unpermute("meta", y=torch.empty(4, 2**31, device="meta")),
})

# moe_decode_experts: the triggers live with the op's tests (tests/_moe_decode.py)
DEVICE_TRIGGERS.update(_moe_decode.DEVICE_TRIGGERS)
CPU_TRIGGERS.update(_moe_decode.META_TRIGGERS)

CUDA_TRIGGERS.update({
    "moe-pairs-device": lambda: _permute("cuda", sp=_i32(4)),
    "moe-weights-device": lambda: _unpermute("cuda", w=torch.zeros(2, 2)),
    "moe-route-bias-device": lambda: _route("cuda", correction_bias=torch.zeros(8)),
    "moe-rr-weight-device": lambda: _router_route("cuda", w=torch.zeros(8, 64, dtype=torch.bfloat16)),
    "moe-rr-bias-device": lambda: _router_route("cuda", correction_bias=torch.zeros(8)),
    "norm-rr-residual-device": lambda: _norm_router("cuda", residual=torch.zeros(2, 64, dtype=_BF16)),
})


# ---- grouped_scaled_mm ----------------------------------------------------------------------------------------


def _grouped_operands(d, t=8, k=64, n=32, e=4):
    g = torch.Generator(device=d).manual_seed(0)
    a = torch.randint(-8, 8, (t, k), dtype=torch.int8, device=d, generator=g)
    w = torch.randint(-8, 8, (e, n, k), dtype=torch.int8, device=d, generator=g)
    return dict(a=a, b=w.transpose(1, 2), scale_a=torch.rand(t, 1, device=d, generator=g) * 0.01,
                scale_b=torch.rand(e, n, device=d, generator=g) * 0.01,
                offsets=torch.tensor([2, 4, 6, 8], dtype=torch.int32, device=d)[:e],
                out_dtype=torch.bfloat16, bias=torch.zeros(e, n, dtype=torch.bfloat16, device=d), out=None)


def _grouped(d, **change):
    """cw.grouped_scaled_mm on legal operands on device d with `change` applied (a callable gets the operands)."""
    kw = _grouped_operands(d)
    for key, v in change.items():
        kw[key] = v(kw) if callable(v) else v
    return cw.grouped_scaled_mm(kw["a"], kw["b"], kw["scale_a"], kw["scale_b"], kw["offsets"], kw["out_dtype"],
                                kw["bias"], out=kw["out"])


def _grouped_fp8(kw):
    kw["a"], kw["b"] = kw["a"].to(torch.float8_e4m3fn), kw["b"].to(torch.float8_e4m3fn)
    return kw


def _grouped_block_scale_a(d):
    kw = _grouped_fp8(_grouped_operands(d, k=256))
    return _grouped(d, a=kw["a"], b=kw["b"], scale_b=torch.ones(4, 1, 2, device=d))


def _grouped_block_scale_b(d):
    kw = _grouped_fp8(_grouped_operands(d, k=256))
    return _grouped(d, a=kw["a"], b=kw["b"], scale_a=torch.ones(8, 2, device=d), scale_b=torch.ones(5, 1, 2, device=d))


def _grouped_padded_weights(d):
    wbuf = torch.zeros(4, 32, 72, dtype=torch.int8, device=d)
    return _grouped(d, b=wbuf[:, :, :64].transpose(1, 2))


DEVICE_TRIGGERS.update({
    "grouped-a-dtype": lambda d: _grouped(d, a=lambda kw: kw["a"].half()),
    "grouped-b-dtype": lambda d: _grouped(d, b=lambda kw: kw["b"].to(torch.float8_e4m3fn)),
    "grouped-offsets-dtype": lambda d: _grouped(d, offsets=lambda kw: kw["offsets"].long()),
    "grouped-offsets-device": lambda d: _grouped(d, offsets=lambda kw: kw["offsets"].to(
        "meta" if d == "cpu" else "cpu")),
    "grouped-b-not-3d": lambda d: _grouped(d, b=lambda kw: kw["b"][0]),
    "grouped-k-mismatch": lambda d: _grouped(d, a=lambda kw: kw["a"][:, :32]),
    "grouped-n-not-16": lambda d: _grouped(d, b=lambda kw: kw["b"][:, :, :24], scale_b=torch.ones(4, 24, device=d),
                                           bias=None),
    "grouped-e-range": lambda d: _grouped(d, b=torch.zeros(1025, 32, 64, dtype=torch.int8, device=d).transpose(1, 2)),
    "grouped-offsets-shape": lambda d: _grouped(d, offsets=lambda kw: kw["offsets"][:3]),
    "grouped-scale_a-shape": lambda d: _grouped(d, scale_a=lambda kw: kw["scale_a"][:5]),
    "grouped-scale_b-shape": lambda d: _grouped(d, scale_b=lambda kw: kw["scale_b"][0]),
    "grouped-block-a-int8": lambda d: _grouped(d, scale_b=torch.ones(4, 1, 1, device=d)),
    "grouped-block-scale_a-shape": _grouped_block_scale_a,
    "grouped-block-scale_b-shape": _grouped_block_scale_b,
    "grouped-offsets-noncontig": lambda d: _grouped(d, offsets=torch.arange(8, dtype=torch.int32, device=d)[::2]),
    "grouped-bias-shape": lambda d: _grouped(d, bias=lambda kw: kw["bias"][0]),
    "grouped-b-layout": lambda d: _grouped(d, b=lambda kw: kw["b"].transpose(1, 2).reshape(4, 64, 32)),
    "grouped-b-pitch": _grouped_padded_weights,
    "grouped-b-experts-overlap": lambda d: _grouped(d, b=lambda kw: kw["b"][:1].expand(4, 64, 32)),
    "grouped-out-shape": lambda d: _grouped(d, out=torch.zeros(8, 16, dtype=torch.bfloat16, device=d)),
    "grouped-out-noncontig": lambda d: _grouped(d, out=torch.zeros(8, 48, dtype=torch.bfloat16, device=d)[:, :32]),
})

CPU_TRIGGERS.update({
    # CPU only: the CUDA kernels clamp device offsets instead (no host synchronisation)
    "grouped-offsets-values": lambda: _grouped("cpu", offsets=torch.tensor([2, 1, 6, 8], dtype=torch.int32)),
})
