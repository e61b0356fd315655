"""docs/MISUSE.md triggers for decode_attention, decode_attention_quant, rope_kv_cache_, rms_norm /
rms_norm_quant / silu_mul / silu_mul_quant: DEVICE_TRIGGERS (a function of the device), CPU_TRIGGERS and
CUDA_TRIGGERS (functions of nothing), as in tests/_misuse_triggers_gemm.py, whose argument helpers they use.
"""

from __future__ import annotations

import torch

import cutlass_w8a8 as cw
from _misuse_triggers_gemm import _changed, _other_device

DEVICE_TRIGGERS: dict = {}
CPU_TRIGGERS: dict = {}
CUDA_TRIGGERS: dict = {}

# ---- decode_attention, rope_kv_cache_ -----------------------------------------------------------------------


def attn_operands(device="cpu"):
    """Legal decode_attention arguments: B = 2, H = 4, KVH = 2, D = 16, S = 8, q a strided view of qkv."""
    qkv = torch.randn(2, 8, 16, device=device).to(torch.bfloat16)
    return dict(q=qkv[:, :4], kv_cache=torch.randn(3, 2, 2, 8, 16, device=device).to(torch.bfloat16),
                slots=torch.tensor([2, 0], device=device), positions=torch.tensor([0, 7], device=device),
                softmax_scale=None, out=None)


def attn(device="cpu", **change):
    """cw.decode_attention on legal arguments with `change` applied (a callable value gets the arguments)."""
    kw = _changed(attn_operands(device), change)
    return cw.decode_attention(kw["q"], kw["kv_cache"], kw["slots"], kw["positions"], kw["softmax_scale"],
                               out=kw["out"])


def attn_meta(h=4, s=8):
    """cw.decode_attention on meta tensors: sizes no memory could hold."""
    q = torch.empty(1, h, 16, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(1, 2, 1, s, 16, device="meta", dtype=torch.bfloat16)
    idx = torch.zeros(1, dtype=torch.int64, device="meta")
    return cw.decode_attention(q, kv, idx, idx)


def attn_op(out=None, **change):
    """torch.ops.cutlass_w8a8.decode_attention(_out) on legal CUDA arguments with `change`."""
    kw = _changed(attn_operands("cuda"), change)
    args = (kw["q"], kw["kv_cache"], kw["slots"], kw["positions"], 0.25)
    if out is not None:
        return torch.ops.cutlass_w8a8.decode_attention_out(out, *args)
    return torch.ops.cutlass_w8a8.decode_attention(*args)


DEVICE_TRIGGERS.update({
    "attn-not-tensor": lambda d: attn(d, q=lambda kw: kw["q"].tolist()),
    "attn-out-not-tensor": lambda d: attn(d, out=[0.0]),
    "attn-q-dtype": lambda d: attn(d, q=lambda kw: kw["q"].int()),
    "attn-kv-dtype": lambda d: attn(d, kv_cache=lambda kw: kw["kv_cache"].float()),
    "attn-slots-dtype": lambda d: attn(d, slots=lambda kw: kw["slots"].int()),
    "attn-positions-dtype": lambda d: attn(d, positions=lambda kw: kw["positions"].int()),
    "attn-out-dtype": lambda d: attn(d, out=torch.empty(2, 64, device=d)),
    "attn-scale-type": lambda d: attn(d, softmax_scale="0.25"),
    "attn-scale-finite": lambda d: attn(d, softmax_scale=float("nan")),
    "attn-device-other": lambda d: attn(d, kv_cache=lambda kw: kw["kv_cache"].to(_other_device(d))),
    "attn-q-not-3d": lambda d: attn(d, q=lambda kw: kw["q"].flatten(1)),
    "attn-head-dim": lambda d: attn(d, q=lambda kw: kw["q"][..., :12]),
    "attn-kv-shape": lambda d: attn(d, kv_cache=lambda kw: kw["kv_cache"][:, 0]),
    "attn-kv-heads": lambda d: attn(d, kv_cache=torch.zeros(3, 2, 3, 8, 16, dtype=torch.bfloat16, device=d)),
    "attn-slots-shape": lambda d: attn(d, slots=torch.tensor([0, 1, 2], device=d)),
    "attn-positions-shape": lambda d: attn(d, positions=lambda kw: kw["positions"][None]),
    "attn-q-stride": lambda d: attn(d, q=lambda kw: kw["q"].transpose(1, 2).contiguous().transpose(1, 2)),
    "attn-kv-noncontig": lambda d: attn(d, kv_cache=lambda kw: kw["kv_cache"].transpose(0, 1).contiguous()
                                        .transpose(0, 1)),
    "attn-kv-misaligned": lambda d: attn(d, kv_cache=torch.zeros(3 * 2 * 2 * 8 * 16 + 4, dtype=torch.bfloat16,
                                                                 device=d)[4:].view(3, 2, 2, 8, 16)),
    "attn-out-shape": lambda d: attn(d, out=torch.empty(2, 32, dtype=torch.bfloat16, device=d)),
    "attn-out-noncontig": lambda d: attn(d, out=torch.empty(64, 2, dtype=torch.bfloat16, device=d).t()),
})

CPU_TRIGGERS.update({
    "attn-too-many-heads": lambda: attn_meta(h=65536),
    "attn-seq-len": lambda: attn_meta(s=2**30),
})

CUDA_TRIGGERS.update({
    "attn-cpu-slots": lambda: attn("cuda", slots=lambda kw: kw["slots"].cpu()),
    "attn-op-q-dtype": lambda: attn_op(q=lambda kw: kw["q"].int()),
    "attn-op-cpu-q": lambda: attn_op(q=lambda kw: kw["q"].cpu()),
    "attn-op-kv-shape": lambda: attn_op(kv_cache=lambda kw: kw["kv_cache"][:, 0]),
    "attn-op-q-stride": lambda: attn_op(q=lambda kw: kw["q"].transpose(1, 2).contiguous().transpose(1, 2)),
    "attn-op-out-shape": lambda: attn_op(out=torch.empty(2, 32, dtype=torch.bfloat16, device="cuda")),
})


def attnq(device="cpu", **change):
    """cw.decode_attention_quant on decode_attention's legal arguments, int8 with a static scale, with `change`
    applied (a callable value gets the arguments)."""
    kw = attn_operands(device)
    kw.update(dtype=torch.int8, scale=torch.tensor([0.01], device=device))
    kw = _changed(kw, change)
    return cw.decode_attention_quant(kw["q"], kw["kv_cache"], kw["slots"], kw["positions"], kw["softmax_scale"],
                                     kw["dtype"], kw["scale"])


def attnq_meta(h=4, s=8):
    """cw.decode_attention_quant on meta tensors: sizes no memory could hold."""
    q = torch.empty(1, h, 16, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(1, 2, 1, s, 16, device="meta", dtype=torch.bfloat16)
    idx = torch.zeros(1, dtype=torch.int64, device="meta")
    return cw.decode_attention_quant(q, kv, idx, idx)


DEVICE_TRIGGERS.update({
    "attnq-not-tensor": lambda d: attnq(d, q=lambda kw: kw["q"].tolist()),
    "attnq-q-dtype": lambda d: attnq(d, q=lambda kw: kw["q"].int()),
    "attnq-kv-dtype": lambda d: attnq(d, kv_cache=lambda kw: kw["kv_cache"].float()),
    "attnq-slots-dtype": lambda d: attnq(d, slots=lambda kw: kw["slots"].int()),
    "attnq-positions-dtype": lambda d: attnq(d, positions=lambda kw: kw["positions"].int()),
    "attnq-softmax-scale-type": lambda d: attnq(d, softmax_scale="0.25"),
    "attnq-softmax-scale-finite": lambda d: attnq(d, softmax_scale=float("inf")),
    "attnq-device-other": lambda d: attnq(d, kv_cache=lambda kw: kw["kv_cache"].to(_other_device(d))),
    "attnq-q-not-3d": lambda d: attnq(d, q=lambda kw: kw["q"].flatten(1)),
    "attnq-head-dim": lambda d: attnq(d, q=lambda kw: kw["q"][..., :12]),
    "attnq-kv-shape": lambda d: attnq(d, kv_cache=lambda kw: kw["kv_cache"][:, 0]),
    "attnq-kv-heads": lambda d: attnq(d, kv_cache=torch.zeros(3, 2, 3, 8, 16, dtype=torch.bfloat16, device=d)),
    "attnq-slots-shape": lambda d: attnq(d, slots=torch.tensor([0, 1, 2], device=d)),
    "attnq-positions-shape": lambda d: attnq(d, positions=lambda kw: kw["positions"][None]),
    "attnq-q-stride": lambda d: attnq(d, q=lambda kw: kw["q"].transpose(1, 2).contiguous().transpose(1, 2)),
    "attnq-kv-noncontig": lambda d: attnq(d, kv_cache=lambda kw: kw["kv_cache"].transpose(0, 1).contiguous()
                                          .transpose(0, 1)),
    "attnq-kv-misaligned": lambda d: attnq(d, kv_cache=torch.zeros(3 * 2 * 2 * 8 * 16 + 4, dtype=torch.bfloat16,
                                                                   device=d)[4:].view(3, 2, 2, 8, 16)),
    "attnq-dtype": lambda d: attnq(d, dtype=torch.float16),
    "attnq-scale-not-tensor": lambda d: attnq(d, scale=0.1),
    "attnq-scale-dtype": lambda d: attnq(d, scale=lambda kw: kw["scale"].half()),
    "attnq-scale-device-other": lambda d: attnq(d, scale=lambda kw: kw["scale"].to(_other_device(d))),
    "attnq-scale-shape": lambda d: attnq(d, scale=torch.ones(2, device=d)),
})

CPU_TRIGGERS.update({
    "attnq-too-many-heads": lambda: attnq_meta(h=65536),
    "attnq-seq-len": lambda: attnq_meta(s=2**30),
})

CUDA_TRIGGERS.update({
    "attnq-cpu-slots": lambda: attnq("cuda", slots=lambda kw: kw["slots"].cpu()),
    "attnq-scale-device-cpu": lambda: attnq("cuda", scale=torch.ones(1)),
})


def rope(device="cpu", heads=(4, 2), norms=False, **change):
    """cw.rope_kv_cache_ on legal arguments (B = 2, H = 4, KVH = 2, D = 16, S = 8, 3 slots; with `norms`, bfloat16
    (16,) q_norm and k_norm weights and eps 1e-6) with `change`."""
    kw = dict(qkv=torch.randn(2, 8, 16, device=device).to(torch.bfloat16),
              rope=torch.randn(2, 8, 2, device=device),
              kv_cache=torch.zeros(3, 2, 2, 8, 16, dtype=torch.bfloat16, device=device),
              slots=torch.tensor([2, 0], device=device), positions=torch.tensor([0, 7], device=device))
    if norms:
        kw.update(q_norm=torch.ones(16, dtype=torch.bfloat16, device=device),
                  k_norm=torch.ones(16, dtype=torch.bfloat16, device=device), eps=1e-6)
    kw = _changed(kw, change)
    extra = (kw["q_norm"], kw["k_norm"], kw["eps"]) if norms else ()
    return cw.rope_kv_cache_(kw["qkv"], kw["rope"], kw["kv_cache"], kw["slots"], kw["positions"], *heads, *extra)


DEVICE_TRIGGERS.update({
    "rope-qkv-dtype": lambda d: rope(d, qkv=lambda kw: kw["qkv"].int()),
    "rope-kv-dtype": lambda d: rope(d, kv_cache=lambda kw: kw["kv_cache"].float()),
    "rope-rope-dtype": lambda d: rope(d, rope=lambda kw: kw["rope"].half()),
    "rope-slots-dtype": lambda d: rope(d, slots=lambda kw: kw["slots"].int()),
    "rope-positions-dtype": lambda d: rope(d, positions=lambda kw: kw["positions"].int()),
    "rope-device": lambda d: rope(d, kv_cache=lambda kw: kw["kv_cache"].to(_other_device(d))),
    "rope-heads": lambda d: rope(d, heads=(4, 0)),
    "rope-qkv-shape": lambda d: rope(d, heads=(5, 2)),
    "rope-qkv-layout": lambda d: rope(d, qkv=lambda kw: kw["qkv"].transpose(0, 1).contiguous().transpose(0, 1)),
    "rope-kv-shape": lambda d: rope(d, kv_cache=lambda kw: kw["kv_cache"][:, :, :1]),
    "rope-rope-shape": lambda d: rope(d, rope=lambda kw: kw["rope"][:, :4]),
    "rope-rope-width": lambda d: rope(d, rope=torch.randn(2, 9, 2, device=d)),
    "rope-slots-shape": lambda d: rope(d, slots=torch.tensor([0, 1, 2], device=d)),
    "rope-positions-shape": lambda d: rope(d, positions=lambda kw: kw["positions"][None]),
    "rope-kv-empty": lambda d: rope(d, kv_cache=torch.zeros(3, 2, 2, 0, 16, dtype=torch.bfloat16, device=d)),
    "rope-norm-alone": lambda d: rope(d, norms=True, k_norm=None),
    "rope-norm-dtype": lambda d: rope(d, norms=True, k_norm=lambda kw: kw["k_norm"].float()),
    "rope-norm-device": lambda d: rope(d, norms=True, q_norm=lambda kw: kw["q_norm"].to(_other_device(d))),
    "rope-norm-shape": lambda d: rope(d, norms=True, q_norm=lambda kw: kw["q_norm"][:8]),
    "rope-norm-eps": lambda d: rope(d, norms=True, eps=-1.0),
})

CUDA_TRIGGERS["rope-op-cpu-qkv"] = lambda: rope("cuda", qkv=lambda kw: kw["qkv"].cpu())




# ---- rms_norm, rms_norm_quant, silu_mul, silu_mul_quant ----------------------------------------------------


def _x(device="cpu"):
    return torch.zeros(4, 16, dtype=torch.bfloat16, device=device)


def _w(device="cpu"):
    return torch.ones(16, dtype=torch.bfloat16, device=device)



DEVICE_TRIGGERS.update({
    "fused-x-not-tensor": lambda d: cw.rms_norm([1.0], _w(d), 1e-5),
    "fused-x-dtype": lambda d: cw.rms_norm(torch.zeros(4, 16, dtype=torch.float64, device=d), _w(d), 1e-5),
    "fused-x-0d": lambda d: cw.silu_mul(torch.tensor(1.0, device=d)),
    "fused-x-empty-k": lambda d: cw.rms_norm(torch.zeros(4, 0, device=d), torch.zeros(0, device=d), 1e-5),
    "silu-odd": lambda d: cw.silu_mul(torch.zeros(4, 7, device=d)),
    "norm-weight-not-tensor": lambda d: cw.rms_norm(_x(d), [1.0] * 16, 1e-5),
    "norm-weight-dtype": lambda d: cw.rms_norm(_x(d), torch.ones(16, device=d), 1e-5),
    "norm-weight-device": lambda d: cw.rms_norm(_x(d), _w(_other_device(d)), 1e-5),
    "norm-weight-shape": lambda d: cw.rms_norm(_x(d), _w(d)[:8], 1e-5),
    "norm-weight-noncontig": lambda d: cw.rms_norm(_x(d), torch.ones(32, dtype=torch.bfloat16, device=d)[::2], 1e-5),
    "norm-eps-type": lambda d: cw.rms_norm(_x(d), _w(d), "1e-5"),
    "norm-eps-value": lambda d: cw.rms_norm(_x(d), _w(d), -1.0),
    "residual-not-tensor": lambda d: cw.rms_norm(_x(d), _w(d), 1e-5, 0.0),
    "residual-dtype": lambda d: cw.rms_norm(_x(d), _w(d), 1e-5, torch.zeros(4, 16, device=d)),
    "residual-device": lambda d: cw.rms_norm(_x(d), _w(d), 1e-5, _x(_other_device(d))),
    "residual-shape": lambda d: cw.rms_norm(_x(d), _w(d), 1e-5, torch.zeros(4, 8, dtype=torch.bfloat16, device=d)),
    "residual-layout": lambda d: cw.rms_norm(_x(d), _w(d), 1e-5,
                                             torch.zeros(16, 4, dtype=torch.bfloat16, device=d).t()),
    "residual-rows-overlap": lambda d: cw.rms_norm(_x(d), _w(d), 1e-5,
                                                   torch.zeros(1, 16, dtype=torch.bfloat16, device=d).expand(4, 16)),
    "fused-quant-dtype": lambda d: cw.rms_norm_quant(_x(d), _w(d), 1e-5, torch.float16),
    "fused-scale-not-tensor": lambda d: cw.silu_mul_quant(_x(d), torch.int8, 0.1),
    "fused-scale-dtype": lambda d: cw.silu_mul_quant(_x(d), torch.int8, torch.ones(1, dtype=torch.float16,
                                                                                   device=d)),
    "fused-scale-shape": lambda d: cw.rms_norm_quant(_x(d), _w(d), 1e-5, torch.int8, torch.ones(2, device=d)),
    "fused-group-size": lambda d: cw.rms_norm_quant(_x(d), _w(d), 1e-5, torch.int8, group_size=64),
    "fused-group-scale": lambda d: cw.silu_mul_quant(_x(d), torch.float8_e4m3fn, torch.ones(1, device=d),
                                                     group_size=128),
    "fused-group-k": lambda d: cw.rms_norm_quant(_x(d), _w(d), 1e-5, torch.float8_e4m3fn, group_size=128),
})

CPU_TRIGGERS.update({
    "fused-x-k-too-large": lambda: cw.rms_norm(torch.empty(1, 2**31, device="meta"),
                                               torch.empty(2**31, device="meta"), 1e-5),
    "fused-x-too-many-rows": lambda: cw.silu_mul(torch.empty(2**31, 2, device="meta")),
})

CUDA_TRIGGERS.update({
    "norm-weight-cpu": lambda: cw.rms_norm(_x("cuda"), _w(), 1e-5),
    "fused-scale-device-cpu": lambda: cw.silu_mul_quant(_x("cuda"), torch.int8, torch.ones(1)),
    "op-fused-x-cpu": lambda: torch.ops.cutlass_w8a8.rms_norm(_x(), _w("cuda"), 1e-5),
    "op-residual-shape": lambda: torch.ops.cutlass_w8a8.fused_add_rms_norm(
        _x("cuda"), torch.zeros(4, 8, dtype=torch.bfloat16, device="cuda"), _w("cuda"), 1e-5),
    "op-silu-odd": lambda: torch.ops.cutlass_w8a8.silu_mul(torch.zeros(4, 7, device="cuda")),
    "op-fused-quant-dtype": lambda: torch.ops.cutlass_w8a8.rms_norm_quant(_x("cuda"), _w("cuda"), 1e-5,
                                                                          torch.float16, None, None),
})
