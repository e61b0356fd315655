"""docs/MISUSE.md triggers for the GEMM family: scaled_mm and the quantizers, W8A8Linear and quantize_, the
CUDA graphs and their updates, scaled_mm_decode / linear_decode, w8a8_linear, block-scaled fp8 (the GEMMs,
quantize_per_token_group, w8a8_linear, W8A8Linear / W8A8Config), and two GPUs.

DEVICE_TRIGGERS maps a `cpu` row to a function of the device; CPU_TRIGGERS and CUDA_TRIGGERS map a row to a
function of nothing; TWO_GPU_TRIGGERS the `2 gpus` rows. The helpers (operands, _changed, misaligned,
_other_device) are shared with tests/_misuse_triggers_norm_attention.py.
"""

from __future__ import annotations

from unittest import mock

import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.runner import DecodeGraphRunner

# ---- triggers on CPU tensors, and on CUDA tensors for the rows both devices check ----------------------------
#
# DEVICE_TRIGGERS maps a `cpu` row to a function of the device that builds its tensors there: test_cpu_row runs
# it with "cpu" (the CPU implementations, ops/_checks.py), test_row_on_cuda with "cuda" (the C++ checks), and
# both must raise the row. Rows whose trigger needs meta tensors (sizes no memory holds) stay CPU-only.


def operands(device="cpu", m=4, n=32, k=64):
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randint(-8, 8, (m, k), dtype=torch.int8, device=device, generator=g)
    w = torch.randint(-8, 8, (n, k), dtype=torch.int8, device=device, generator=g)
    sa = torch.rand(m, 1, device=device, generator=g) * 0.01
    sb = torch.rand(n, device=device, generator=g) * 0.01
    bias = torch.randn(n, device=device, generator=g).to(torch.bfloat16)
    return dict(a=a, b=w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, bias=bias)


def _changed(kw, change):
    for key, v in change.items():
        kw[key] = v(kw) if callable(v) else v
    return kw


def mm(device="cpu", **change):
    """cw.scaled_mm on legal operands with `change` applied (a callable value gets the operands)."""
    kw = _changed(operands(device), change)
    out = kw.pop("out", None)
    return cw.scaled_mm(kw["a"], kw["b"], kw["scale_a"], kw["scale_b"], kw["out_dtype"], kw["bias"], out=out)


def _mm_fast_accum(device, value):
    """cw.scaled_mm on legal operands with fp8_fast_accum=value."""
    kw = operands(device)
    return cw.scaled_mm(kw["a"], kw["b"], kw["scale_a"], kw["scale_b"], kw["out_dtype"], kw["bias"],
                        fp8_fast_accum=value)


def misaligned(rows, cols, dtype, device="cpu", elem_off=8):
    pitch = cols + 16
    flat = torch.zeros(rows * pitch + elem_off, device=device).to(dtype)
    return flat[elem_off:].view(rows, pitch)[:, :cols]


def _other_device(device):
    """A device other than `device` that needs no memory on the CPU runs: meta for cpu, the CPU for cuda."""
    return "meta" if device == "cpu" else "cpu"


def _not_built():
    """The CUDA kernel every op gets when _C.so did not load (called directly: no CUDA tensor exists here)."""
    from cutlass_w8a8 import _ext
    from cutlass_w8a8.ops import _schema

    with mock.patch.object(_ext, "cuda_ops_available", return_value=False):
        _schema.extension_missing("scaled_mm")(torch.zeros(4, 64, dtype=torch.int8))


def _int8_k_bound(d):
    k = cw.INT8_MAX_K + 16
    return mm(d, a=torch.zeros(1, k, dtype=torch.int8, device=d), b=torch.zeros(32, k, dtype=torch.int8, device=d).t(),
              scale_a=torch.ones(1, device=d))


DEVICE_TRIGGERS = {
    "a-not-tensor": lambda d: mm(d, a=lambda kw: kw["a"].tolist()),
    "a-dtype": lambda d: mm(d, a=lambda kw: kw["a"].half()),
    "b-dtype": lambda d: mm(d, b=lambda kw: kw["b"].to(torch.float8_e4m3fn)),
    "scale_a-dtype": lambda d: mm(d, scale_a=lambda kw: kw["scale_a"].half()),
    "scale_b-dtype": lambda d: mm(d, scale_b=lambda kw: kw["scale_b"].double()),
    "out_dtype": lambda d: mm(d, out_dtype=torch.float32),
    "fp8_fast_accum-type": lambda d: _mm_fast_accum(d, None),
    "bias-dtype": lambda d: mm(d, bias=lambda kw: kw["bias"].float()),
    "bias-not-tensor": lambda d: mm(d, bias=0.5),
    "out-dtype": lambda d: mm(d, out=torch.empty(4, 32, device=d)),
    "device-other": lambda d: mm(d, b=lambda kw: kw["b"].to(_other_device(d))),
    "out-device-other": lambda d: mm(d, out=torch.empty(4, 32, dtype=torch.bfloat16, device=_other_device(d))),
    "a-not-2d": lambda d: mm(d, a=lambda kw: kw["a"][None]),
    "b-not-2d": lambda d: mm(d, b=lambda kw: kw["b"][None]),
    "k-mismatch": lambda d: mm(d, b=lambda kw: kw["b"][:48]),
    "k-not-16": lambda d: mm(d, a=lambda kw: kw["a"][:, :40], b=lambda kw: kw["b"][:40]),
    "n-not-16": lambda d: mm(d, b=lambda kw: kw["b"][:, :24], scale_b=lambda kw: kw["scale_b"][:24],
                             bias=lambda kw: kw["bias"][:24]),
    "int8-k-bound": _int8_k_bound,
    "scale_a-shape": lambda d: mm(d, scale_a=lambda kw: kw["scale_a"][:3]),
    "scale_b-shape": lambda d: mm(d, scale_b=lambda kw: kw["scale_b"][:16]),
    "scale_a-noncontig": lambda d: mm(d, scale_a=torch.rand(4, 2, device=d)[:, :1]),
    "scale_b-noncontig": lambda d: mm(d, scale_b=torch.rand(64, device=d)[::2]),
    "bias-length": lambda d: mm(d, bias=lambda kw: kw["bias"][:16]),
    "bias-noncontig": lambda d: mm(d, bias=torch.randn(64, device=d).to(torch.bfloat16)[::2]),
    "a-col-major": lambda d: mm(d, a=lambda kw: kw["a"].t().contiguous().t()),
    "a-rows-overlap": lambda d: mm(d, a=lambda kw: kw["a"][:1].expand(4, 64)),
    "a-row-pitch": lambda d: mm(d, a=torch.zeros(4, 72, dtype=torch.int8, device=d)[:, :64]),
    "a-misaligned": lambda d: mm(d, a=misaligned(4, 64, torch.int8, d)),
    "b-row-major": lambda d: mm(d, b=lambda kw: kw["b"].contiguous()),
    "b-cols-overlap": lambda d: mm(d, b=lambda kw: kw["b"][:, :1].expand(64, 32)),
    "b-pitch": lambda d: mm(d, b=torch.zeros(32, 72, dtype=torch.int8, device=d)[:, :64].t()),
    "b-misaligned": lambda d: mm(d, b=misaligned(32, 64, torch.int8, d).t()),
    "out-shape": lambda d: mm(d, out=torch.empty(5, 32, dtype=torch.bfloat16, device=d)),
    "out-col-major": lambda d: mm(d, out=torch.empty(32, 4, dtype=torch.bfloat16, device=d).t()),
    "out-rows-overlap": lambda d: mm(d, out=torch.empty(1, 32, dtype=torch.bfloat16, device=d).expand(4, 32)),
    "out-pitch": lambda d: mm(d, out=torch.empty(4, 36, dtype=torch.bfloat16, device=d)[:, :32]),
    "out-misaligned": lambda d: mm(d, out=misaligned(4, 32, torch.bfloat16, d, elem_off=4)),
    "x-not-tensor": lambda d: cw.quantize_int8([1.0]),
    "x-dtype": lambda d: cw.quantize_int8(torch.zeros(4, 16, dtype=torch.int32, device=d)),
    "x-0d": lambda d: cw.quantize_int8(torch.tensor(1.0, device=d)),
    "scale-not-tensor": lambda d: cw.quantize_int8(torch.zeros(4, 16, device=d), 0.1),
    "scale-dtype": lambda d: cw.quantize_fp8(torch.zeros(4, 16, device=d), torch.ones(1, dtype=torch.float16,
                                                                                       device=d)),
    "scale-shape": lambda d: cw.quantize_int8(torch.zeros(4, 16, device=d), torch.ones(2, device=d)),
    "scale-device-other": lambda d: cw.quantize_int8(torch.zeros(4, 16, device=d),
                                                     torch.ones(1, device=_other_device(d))),
    "quant-op-dtype": lambda d: torch.ops.cutlass_w8a8.quantize_per_token(torch.zeros(4, 16, device=d), torch.int32),
}

CPU_TRIGGERS = {
    "linear-features": lambda: cw.W8A8Linear(60, 32),
    "linear-dtype": lambda: cw.W8A8Linear(64, 32, dtype=torch.float32),
    "linear-quant-dtype": lambda: cw.W8A8Linear(64, 32, quant_dtype=torch.uint8),
    "linear-input": lambda: cw.W8A8Linear(64, 32)(torch.randn(2, 32, dtype=torch.bfloat16)),
    "config-dtype": lambda: cw.W8A8Config(dtype=torch.float16),
    "config-fp8-fast-accum": lambda: cw.W8A8Config(fp8_fast_accum=1),
    "graph-cpu-inputs": lambda: cw.graphs.CapturedGraph(lambda x: x, [torch.zeros(4)]),
    "runner-mode": lambda: DecodeGraphRunner(None, mode="fast"),
    "extension-not-built": _not_built,
}


# ---- triggers on the GPU ------------------------------------------------------------------------------


def _graph():
    return cw.graphs.CapturedGraph(lambda x: x * 2, [torch.zeros(4, 16, device="cuda")])


def _updatable():
    """An UpdatableGraph of one int8 W8A8Linear (K = 64, N = 32) captured at M = 8: quantizer, then GEMM."""
    lin = cw.W8A8Linear(64, 32, device="cuda")
    return cw.graphs.UpdatableGraph(lin, [torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)])


def _update(m=4, n=32, out_dtype=torch.bfloat16, device="cuda", node=1):
    g = _updatable()
    kw = operands(device, m=m, n=n)
    out = torch.empty(m, n, dtype=out_dtype, device=device)
    g.update_scaled_mm(node, out, kw["a"], kw["b"], kw["scale_a"], kw["scale_b"])


def _reset_then_update():
    g = _updatable()
    g.reset()
    g.set_rows(2)


def _config_out_of_range():
    kw = operands("cuda", m=100)
    out = torch.empty(100, 32, dtype=torch.bfloat16, device="cuda")
    torch.ops.cutlass_w8a8._scaled_mm_config(out, kw["a"], kw["b"], kw["scale_a"], kw["scale_b"], None, 10_000)


def _grouped_config_out_of_range():
    a = torch.zeros(4, 64, dtype=torch.int8, device="cuda")
    w = torch.zeros(2, 32, 64, dtype=torch.int8, device="cuda")
    offsets = torch.tensor([2, 4], dtype=torch.int32, device="cuda")
    out = torch.empty(4, 32, dtype=torch.bfloat16, device="cuda")
    torch.ops.cutlass_w8a8._grouped_scaled_mm_config(out, a, w.transpose(1, 2), torch.ones(4, 1, device="cuda"),
                                                     torch.ones(2, 32, device="cuda"), offsets, None, 10_000)


def op(device="cuda", **change):
    """torch.ops.cutlass_w8a8.scaled_mm (no wrapper) on legal CUDA operands with `change` applied."""
    kw = _changed(operands(device), change)
    return torch.ops.cutlass_w8a8.scaled_mm(kw["a"], kw["b"], kw["scale_a"], kw["scale_b"], kw["out_dtype"],
                                            kw["bias"])


CUDA_TRIGGERS = {
    "cpu-arg-cuda-a": lambda: mm("cuda", scale_a=lambda kw: kw["scale_a"].cpu()),
    "cpu-a-cuda-args": lambda: mm("cuda", a=lambda kw: kw["a"].cpu()),
    "scale-device-cpu": lambda: cw.quantize_int8(torch.zeros(4, 16, device="cuda"), torch.ones(1)),
    "graph-input-count": lambda: _graph()(torch.zeros(4, 16, device="cuda"), torch.zeros(1, device="cuda")),
    "graph-input-shape": lambda: _graph()(torch.zeros(5, 16, device="cuda")),
    "config-out-of-range": _config_out_of_range,
    "grouped-config-out-of-range": _grouped_config_out_of_range,
    "update-rows": lambda: _updatable().set_rows(9),
    "update-reset": _reset_then_update,
    "update-m": lambda: _update(m=9),
    "update-nk": lambda: _update(n=48),
    "update-out-dtype": lambda: _update(out_dtype=torch.float16),
    "update-device": lambda: _update(device="cpu"),
    "update-not-gemm": lambda: _update(node=0),
    "op-a-dtype": lambda: op(a=lambda kw: kw["a"].half()),
    "op-out_dtype": lambda: op(out_dtype=torch.float32),
    "op-not-2d": lambda: op(a=lambda kw: kw["a"][None]),
    "op-cpu-a": lambda: op(a=lambda kw: kw["a"].cpu()),
    "op-quant-scale-shape": lambda: torch.ops.cutlass_w8a8.quantize_per_tensor(
        torch.zeros(4, 16, device="cuda"), torch.ones(2, device="cuda"), torch.int8),
}


# ---- scaled_mm_decode, linear_decode ------------------------------------------------------------------------


def decode_mm(device="cpu", **change):
    """cw.scaled_mm_decode on legal operands (M = 4) with `change` applied."""
    kw = _changed(operands(device), change)
    return cw.scaled_mm_decode(kw["a"], kw["b"], kw["scale_a"], kw["scale_b"], kw["out_dtype"], kw["bias"])


def decode_lin(device="cpu", **change):
    """cw.linear_decode on legal arguments: x (4, 64) bf16, int8 w (32, 64), sb (32,), bf16 bias."""
    kw = operands(device)
    kw = dict(x=torch.zeros(4, 64, dtype=torch.bfloat16, device=device), b=kw["b"], scale_b=kw["scale_b"],
              bias=kw["bias"], dtype=None, out=None)
    kw = _changed(kw, change)
    return cw.linear_decode(kw["x"], kw["b"], kw["scale_b"], kw["bias"], kw["dtype"], out=kw["out"])


def _decode_k_too_large():
    k = 2**30 + 16
    one = torch.ones(1, device="meta")
    return cw.scaled_mm_decode(torch.empty(1, k, dtype=torch.float8_e4m3fn, device="meta"),
                               torch.empty(16, k, dtype=torch.float8_e4m3fn, device="meta").t(), one, one)


DEVICE_TRIGGERS.update({
    "decode-m-range": lambda d: decode_mm(d, a=torch.zeros(17, 64, dtype=torch.int8, device=d),
                                          scale_a=torch.ones(1, device=d)),
    "decode-b-row-major": lambda d: decode_mm(d, b=lambda kw: kw["b"].contiguous()),
    "linear-decode-x-dtype": lambda d: decode_lin(d, x=torch.zeros(4, 64, device=d)),
    "linear-decode-dtype": lambda d: decode_lin(d, dtype=torch.float16),
    "linear-decode-b-dtype": lambda d: decode_lin(d, dtype=torch.float8_e4m3fn),
    "linear-decode-bias-dtype": lambda d: decode_lin(d, bias=lambda kw: kw["bias"].float()),
    "linear-decode-out-dtype": lambda d: decode_lin(d, out=torch.empty(4, 32, device=d)),
    "linear-decode-device": lambda d: decode_lin(d, b=lambda kw: kw["b"].to(_other_device(d))),
    "linear-decode-m-range": lambda d: decode_lin(d, x=torch.zeros(17, 64, dtype=torch.bfloat16, device=d)),
    "linear-decode-k-mismatch": lambda d: decode_lin(d, x=torch.zeros(4, 48, dtype=torch.bfloat16, device=d)),
    "linear-decode-x-pitch": lambda d: decode_lin(d, x=torch.zeros(4, 68, dtype=torch.bfloat16, device=d)[:, :64]),
    "linear-decode-x-misaligned": lambda d: decode_lin(d, x=misaligned(4, 64, torch.bfloat16, d, elem_off=4)),
})

CPU_TRIGGERS["decode-k-too-large"] = _decode_k_too_large


def norm_lin(device="cpu", **change):
    """cw.ops.add_rms_norm_linear_decode on legal arguments: x and residual (4, 64) bf16, norm_weight (64,) bf16, eps
    1e-6, int8 w (32, 64), sb (32,), bf16 bias."""
    kw = operands(device)
    kw = dict(x=torch.zeros(4, 64, dtype=torch.bfloat16, device=device),
              residual=torch.zeros(4, 64, dtype=torch.bfloat16, device=device),
              norm_weight=torch.ones(64, dtype=torch.bfloat16, device=device), eps=1e-6, b=kw["b"],
              scale_b=kw["scale_b"], bias=kw["bias"], dtype=None)
    kw = _changed(kw, change)
    return cw.ops.add_rms_norm_linear_decode(kw["x"], kw["residual"], kw["norm_weight"], kw["eps"], kw["b"],
                                             kw["scale_b"], kw["bias"], kw["dtype"])


def _norm_lin_k(d):
    k = 8208
    return norm_lin(d, x=torch.zeros(2, k, dtype=torch.bfloat16, device=d), residual=None,
                    norm_weight=torch.ones(k, dtype=torch.bfloat16, device=d),
                    b=torch.zeros(32, k, dtype=torch.int8, device=d).t())


def _norm_lin_block(d):
    return norm_lin(d, x=torch.zeros(2, 256, dtype=torch.bfloat16, device=d), residual=None,
                    norm_weight=torch.ones(256, dtype=torch.bfloat16, device=d),
                    b=torch.zeros(256, 256, dtype=torch.float8_e4m3fn, device=d).t(),
                    scale_b=torch.ones(2, 2, device=d), bias=None)


DEVICE_TRIGGERS.update({
    "norm-decode-residual-dtype": lambda d: norm_lin(d, residual=lambda kw: kw["residual"].half()),
    "norm-decode-norm-weight-dtype": lambda d: norm_lin(d, norm_weight=lambda kw: kw["norm_weight"].float()),
    "norm-decode-eps": lambda d: norm_lin(d, eps=-1.0),
    "norm-decode-k-range": _norm_lin_k,
    "norm-decode-residual-shape": lambda d: norm_lin(d, residual=torch.zeros(3, 64, dtype=torch.bfloat16, device=d)),
    "norm-decode-norm-weight-shape": lambda d: norm_lin(d, norm_weight=torch.ones(32, dtype=torch.bfloat16,
                                                                                   device=d)),
    "norm-decode-block-scales": _norm_lin_block,
    "norm-decode-residual-pitch": lambda d: norm_lin(d, residual=torch.zeros(4, 68, dtype=torch.bfloat16,
                                                                             device=d)[:, :64]),
    "norm-decode-norm-weight-misaligned": lambda d: norm_lin(d, norm_weight=torch.ones(
        72, dtype=torch.bfloat16, device=d)[4:68]),
})

CUDA_TRIGGERS.update({
    "op-decode-m-range": lambda: torch.ops.cutlass_w8a8.scaled_mm_decode(
        torch.zeros(17, 64, dtype=torch.int8, device="cuda"), operands("cuda")["b"], torch.ones(1, device="cuda"),
        operands("cuda")["scale_b"], torch.bfloat16, None),
    "op-linear-decode-x-dtype": lambda: torch.ops.cutlass_w8a8.linear_decode(
        torch.zeros(4, 64, device="cuda"), operands("cuda")["b"], operands("cuda")["scale_b"], None, torch.int8),
    "op-linear-decode-dtype": lambda: torch.ops.cutlass_w8a8.linear_decode(
        torch.zeros(4, 64, dtype=torch.bfloat16, device="cuda"), operands("cuda")["b"],
        operands("cuda")["scale_b"], None, torch.float16),
})


# ---- w8a8_linear ------------------------------------------------------------------------------------------


def linear_op(device, **change):
    """torch.ops.cutlass_w8a8.w8a8_linear on legal arguments: x (4, 64) bf16, int8 weight (32, 64), (32,)
    weight_scale, no input_scale, bf16 bias; `change` applied (a callable value gets the arguments)."""
    kw = operands(device)
    kw = dict(x=torch.zeros(4, 64, dtype=torch.bfloat16, device=device), weight=kw["b"].t(),
              weight_scale=kw["scale_b"], input_scale=None, bias=kw["bias"], out_dtype=torch.bfloat16)
    kw = _changed(kw, change)
    return torch.ops.cutlass_w8a8.w8a8_linear(kw["x"], kw["weight"], kw["weight_scale"], kw["input_scale"],
                                              kw["bias"], kw["out_dtype"])


def _big_k(device):
    k = 131072
    return linear_op(device, x=torch.zeros(1, k, dtype=torch.bfloat16, device=device),
                     weight=torch.zeros(32, k, dtype=torch.int8, device=device))


W8A8_LINEAR_TRIGGERS = {
    "w8a8-x-dtype": lambda d: linear_op(d, x=torch.zeros(4, 64, dtype=torch.int32, device=d)),
    "w8a8-weight-dtype": lambda d: linear_op(d, weight=lambda kw: kw["weight"].half()),
    "w8a8-weight_scale-dtype": lambda d: linear_op(d, weight_scale=lambda kw: kw["weight_scale"].bfloat16()),
    "w8a8-input_scale-dtype": lambda d: linear_op(d, input_scale=torch.ones(1, dtype=torch.float16, device=d)),
    "w8a8-out_dtype": lambda d: linear_op(d, out_dtype=torch.float32, bias=None),
    "w8a8-bias-dtype": lambda d: linear_op(d, bias=lambda kw: kw["bias"].float()),
    "w8a8-device": lambda d: linear_op(d, weight=lambda kw: kw["weight"].to(_other_device(d))),
    "w8a8-x-0d": lambda d: linear_op(d, x=torch.tensor(1.0, dtype=torch.bfloat16, device=d)),
    "w8a8-weight-2d": lambda d: linear_op(d, weight=lambda kw: kw["weight"][None]),
    "w8a8-k-mismatch": lambda d: linear_op(d, weight=lambda kw: kw["weight"][:, :48]),
    "w8a8-k-not-16": lambda d: linear_op(d, x=lambda kw: kw["x"][:, :40], weight=lambda kw: kw["weight"][:, :40]),
    "w8a8-n-not-16": lambda d: linear_op(d, weight=lambda kw: kw["weight"][:24], weight_scale=lambda kw:
                                         kw["weight_scale"][:24].contiguous(), bias=None),
    "w8a8-int8-k-bound": _big_k,
    "w8a8-weight_scale-shape": lambda d: linear_op(d, weight_scale=torch.ones(2, device=d)),
    "w8a8-weight_scale-noncontig": lambda d: linear_op(d, weight_scale=torch.ones(64, device=d)[::2]),
    "w8a8-input_scale-shape": lambda d: linear_op(d, input_scale=torch.ones(2, device=d)),
    "w8a8-bias-shape": lambda d: linear_op(d, bias=lambda kw: kw["bias"][:16]),
    "w8a8-bias-noncontig": lambda d: linear_op(d, bias=torch.zeros(64, dtype=torch.bfloat16, device=d)[::2]),
    "w8a8-weight-col-major": lambda d: linear_op(d, weight=lambda kw: kw["weight"].t().contiguous().t()),
    "w8a8-weight-rows-overlap": lambda d: linear_op(d, weight=lambda kw: kw["weight"][:1].expand(32, 64)),
    "w8a8-weight-pitch": lambda d: linear_op(d, weight=torch.zeros(32, 72, dtype=torch.int8, device=d)[:, :64]),
    "w8a8-weight-misaligned": lambda d: linear_op(d, weight=misaligned(32, 64, torch.int8, device=d)),
}

DEVICE_TRIGGERS.update(W8A8_LINEAR_TRIGGERS)


def _quantize_8bit_linear():
    lin = torch.nn.Linear(64, 32)
    lin.weight = torch.nn.Parameter(torch.zeros(32, 64, dtype=torch.int8), requires_grad=False)
    return cw.quantize_(torch.nn.Sequential(lin))


CPU_TRIGGERS["linear-from-8bit"] = _quantize_8bit_linear


# ---- W8A8Linear on a QuantizedActivation ------------------------------------------------------------------


def _linear_on(q=None, scale=None):
    """An int8 W8A8Linear(64, 32) called on QuantizedActivation(q, scale); defaults are legal (M = 4)."""
    q = torch.zeros(4, 64, dtype=torch.int8) if q is None else q
    scale = torch.ones(4, 1) if scale is None else scale
    return cw.W8A8Linear(64, 32)(cw.QuantizedActivation(q, scale))


CPU_TRIGGERS.update({
    "linear-q-not-tensor": lambda: _linear_on(q=[0] * 64),
    "linear-scale-not-tensor": lambda: _linear_on(scale=0.5),
    "linear-q-dtype": lambda: _linear_on(q=torch.zeros(4, 64, dtype=torch.float8_e4m3fn)),
    "linear-scale-dtype": lambda: _linear_on(scale=torch.ones(4, 1, dtype=torch.float16)),
    "linear-q-k": lambda: _linear_on(q=torch.zeros(4, 32, dtype=torch.int8)),
    "linear-scale-shape": lambda: _linear_on(scale=torch.ones(4)),
    "linear-q-device": lambda: _linear_on(q=torch.zeros(4, 64, dtype=torch.int8, device="meta")),
    "linear-scale-device": lambda: _linear_on(scale=torch.ones(4, 1, device="meta")),
})


# ---- block-scaled fp8: scaled_mm / scaled_mm_decode, quantize_per_token_group, w8a8_linear, the layer -------


def block_operands(device="cpu", k=256, dtype=torch.float8_e4m3fn):
    """Legal block-scaled operands: a (4, K), b = w.t() with w (208, K) (a partial last row block), scale_a
    (4, K/128 rounded up), scale_b (2, K/128 rounded up)."""
    kb = (k + 127) // 128
    return dict(a=torch.zeros(4, k, device=device).to(dtype), b=torch.zeros(208, k, device=device).to(dtype).t(),
                scale_a=torch.ones(4, kb, device=device), scale_b=torch.ones(2, kb, device=device),
                out_dtype=torch.bfloat16, bias=None)


def block_mm(device="cpu", fn=None, k=256, dtype=torch.float8_e4m3fn, **change):
    """cw.scaled_mm (or `fn`) on block operands with `change` applied."""
    kw = _changed(block_operands(device, k, dtype), change)
    return (fn or cw.scaled_mm)(kw["a"], kw["b"], kw["scale_a"], kw["scale_b"], kw["out_dtype"], kw["bias"])


def block_linear_op(device, k=256, **change):
    """torch.ops.cutlass_w8a8.w8a8_linear with block weight scales: x (4, K) bf16, e4m3 weight (208, K),
    weight_scale (2, ceil(K/128)), no input_scale, no bias."""
    kw = block_operands(device, k)
    return linear_op(device, x=torch.zeros(4, k, dtype=torch.bfloat16, device=device), weight=kw["b"].t(),
                     weight_scale=kw["scale_b"], bias=None, **change)


def _fp8_zeros(*shape):
    return torch.zeros(*shape).to(torch.float8_e4m3fn)


DEVICE_TRIGGERS.update({
    "block-a-int8": lambda d: block_mm(d, dtype=torch.int8),
    "block-k-not-128": lambda d: block_mm(d, k=144),
    "block-scale_a-shape": lambda d: block_mm(d, scale_a=lambda kw: kw["scale_a"][:, :1].contiguous()),
    "block-scale_b-shape": lambda d: block_mm(d, scale_b=lambda kw: kw["scale_b"][:1]),
    "decode-block-scale_b-shape": lambda d: block_mm(d, fn=cw.scaled_mm_decode,
                                                     scale_b=lambda kw: kw["scale_b"][:1]),
    "group-x-dtype": lambda d: cw.quantize_per_token_group(torch.zeros(4, 128, dtype=torch.int32, device=d)),
    "group-dtype": lambda d: cw.quantize_per_token_group(torch.zeros(4, 128, device=d), 128, torch.float16),
    "group-size": lambda d: cw.quantize_per_token_group(torch.zeros(4, 128, device=d), 64),
    "group-k": lambda d: cw.quantize_per_token_group(torch.zeros(4, 144, device=d)),
    "w8a8-block-input_scale": lambda d: block_linear_op(d, input_scale=torch.ones(1, device=d)),
    "w8a8-block-k": lambda d: block_linear_op(d, k=144),
})


def _block_layer(**kw):
    return cw.W8A8Linear(256, 32, quant_dtype=torch.float8_e4m3fn, weight_block_size=(128, 128), **kw)


CPU_TRIGGERS.update({
    "linear-block-scale-shape": lambda: _block_layer()(cw.QuantizedActivation(_fp8_zeros(4, 256), torch.ones(4, 1))),
    "linear-block-size": lambda: cw.W8A8Linear(256, 32, quant_dtype=torch.float8_e4m3fn, weight_block_size=(64, 64)),
    "linear-block-dtype": lambda: cw.W8A8Linear(256, 32, weight_block_size=(128, 128)),
    "linear-block-k": lambda: cw.W8A8Linear(144, 32, quant_dtype=torch.float8_e4m3fn, weight_block_size=(128, 128)),
    "linear-block-static": lambda: _block_layer(static_input_scale=True),
    "from-quantized-block-dtype": lambda: cw.W8A8Linear.from_quantized(torch.zeros(208, 256, dtype=torch.int8),
                                                                       torch.ones(2, 2)),
    "from-quantized-block-shape": lambda: cw.W8A8Linear.from_quantized(_fp8_zeros(208, 256), torch.ones(3, 2),
                                                                       weight_block_size=(128, 128)),
    "from-quantized-block-k": lambda: cw.W8A8Linear.from_quantized(_fp8_zeros(208, 144), torch.ones(2, 2)),
    "from-quantized-block-input_scale": lambda: cw.W8A8Linear.from_quantized(_fp8_zeros(208, 256), torch.ones(2, 2),
                                                                             input_scale=torch.ones(1)),
    "config-block-size": lambda: cw.W8A8Config(dtype=torch.float8_e4m3fn, weight_block_size=(128, 64)),
    "config-block-dtype": lambda: cw.W8A8Config(weight_block_size=(128, 128)),
})


def _mixed_gpus():
    kw = operands("cuda:0")
    return cw.scaled_mm(kw["a"], kw["b"].to("cuda:1"), kw["scale_a"], kw["scale_b"])


TWO_GPU_TRIGGERS = {"mixed-gpus": _mixed_gpus}
