"""Float references of the decoder for tests: `DequantizedLinear` (a `W8A8Linear` without its output rounding),
`DequantizedMoE` (a `cutlass_w8a8.W8A8MoE` likewise) and `float_reference` (a float32 copy of a `LlamaDecoder`)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..linear import W8A8Linear, quantize_activations
from ..ops._limits import BLOCK_SIZE
from .llama import LlamaDecoder
from .moe import route_topk

__all__ = ["DequantizedLinear", "DequantizedMoE", "float_reference"]


def _expand_blocks(scale: torch.Tensor, rows: int, cols: int, block_rows: int) -> torch.Tensor:
    """A per-group / per-block scale spread over the elements it scales: ``scale`` ``(ceil(rows / block_rows),
    cols / 128)`` -> ``(rows, cols)`` (``block_rows`` 1: 1 x 128 groups; 128: 128 x 128 blocks)."""
    out = scale.repeat_interleave(BLOCK_SIZE, dim=1)[:, :cols]
    return out.repeat_interleave(block_rows, dim=0)[:rows] if block_rows > 1 else out


class DequantizedLinear(nn.Module):
    """Float model of a `W8A8Linear`: the kernel's arithmetic without its rounding to the output dtype.

    ``y = dequant(quant(x)) @ dequant(weight).T + bias``, where ``quant`` is the layer's own activation quantizer
    (``torch.ops.cutlass_w8a8.quantize_per_token``, ``quantize_per_tensor`` with its static ``input_scale``, or
    ``quantize_per_token_group`` with 1 x 128 groups for a block-scaled layer) applied to ``x`` in the input's
    dtype, ``dequant(weight)`` is ``weight * weight_scale`` per channel, per tensor or per 128 x 128 block, and
    everything else runs in the input's dtype (float32 in `float_reference`). Shapes as `W8A8Linear`.
    """

    def __init__(self, mod: W8A8Linear):
        super().__init__()
        self.in_features, self.out_features, self.quant_dtype = mod.in_features, mod.out_features, mod.quant_dtype
        self.group_size = mod.group_size
        if self.group_size:
            scale = _expand_blocks(mod.weight_scale.float(), mod.out_features, mod.in_features, BLOCK_SIZE)
        else:
            scale = mod.weight_scale.reshape(-1, 1)
        self.register_buffer("weight", mod.weight.float() * scale)
        self.register_buffer("bias", mod.bias.float() if mod.bias is not None else None)
        self.register_buffer("input_scale", mod.input_scale.clone() if mod.input_scale is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        q, s = quantize_activations(x2, self.input_scale, self.quant_dtype, self.group_size)
        if self.group_size:
            s = _expand_blocks(s, *q.shape, 1)
        y = (q.to(x.dtype) * s.to(x.dtype)) @ self.weight.to(x.dtype).t()
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


class DequantizedMoE(nn.Module):
    """Float model of a `cutlass_w8a8.W8A8MoE`: its arithmetic without the roundings to the output dtype.

    ``forward(x (T, H), router_logits (T, E)) -> (T, H)`` in ``x``'s dtype (float32 in `float_reference`): routing
    `cutlass_w8a8.models.moe.route_topk` (softmax in float32, top-k, renormalized as the layer's ``renormalize``);
    for each routed pair (token t, expert e): ``h = dequant(quant(x[t])) @ dequant(w13[e]).T`` with the layer's own
    activation quantizer (`cutlass_w8a8.linear.quantize_activations`: per token, per tensor with ``a13_scale``, or
    per 1 x 128 group for block weights), ``a = silu(h[:I]) * h[I:]``, ``y = dequant(quant(a)) @ dequant(w2[e]).T``
    (``a2_scale``), and ``out[t] = sum_j w[t, j] * y_j``; everything after the quantizations in ``x``'s dtype.
    Weights dequantized per channel (``w * scale[e, :, None]``) or per 128 x 128 block. Buffers ``w13`` ``(E, 2I,
    H)`` and ``w2`` ``(E, H, I)`` float32 (gathered per pair: a reference for small sizes).
    """

    def __init__(self, mod: nn.Module):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = mod.num_experts, mod.top_k, mod.renormalize
        self.quant_dtype = mod.quant_dtype
        self.group_size = BLOCK_SIZE if mod.weight_block_size is not None else 0

        def dequant(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            if self.group_size:
                return torch.stack([w[e].float() * _expand_blocks(scale[e].float(), *w.shape[1:], BLOCK_SIZE)
                                    for e in range(w.shape[0])])
            return w.float() * scale.float().reshape(w.shape[0], -1, 1)

        self.register_buffer("w13", dequant(mod.w13, mod.w13_scale))
        self.register_buffer("w2", dequant(mod.w2, mod.w2_scale))
        for name in ("a13_scale", "a2_scale"):
            v = getattr(mod, name, None)
            self.register_buffer(name, v.clone() if v is not None else None)

    def _quant_dequant(self, x: torch.Tensor, scale: "torch.Tensor | None") -> torch.Tensor:
        q, s = quantize_activations(x, scale, self.quant_dtype, self.group_size)
        if self.group_size:
            s = _expand_blocks(s, *q.shape, 1)
        return q.to(x.dtype) * s.to(x.dtype)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = route_topk(router_logits, self.top_k, self.renormalize)
        t, k = ids.shape
        flat = ids.reshape(-1)
        xp = self._quant_dequant(x.reshape(t, -1).repeat_interleave(k, dim=0), self.a13_scale)
        h = torch.einsum("ph,pnh->pn", xp, self.w13[flat].to(x.dtype))
        gate, up = h.chunk(2, dim=-1)
        a = self._quant_dequant(torch.nn.functional.silu(gate) * up, self.a2_scale)
        y = torch.einsum("pi,phi->ph", a, self.w2[flat].to(x.dtype))
        out = (y.view(t, k, -1) * weights.to(x.dtype).unsqueeze(-1)).sum(dim=1)
        return out.reshape(x.shape)


def float_reference(model: LlamaDecoder, dtype: torch.dtype = torch.float32) -> LlamaDecoder:
    """A copy of ``model`` that computes in ``dtype`` (float32): the reference of tests.

    Float layers and the KV cache are cast to ``dtype``; every `W8A8Linear` becomes a `DequantizedLinear`
    and every `cutlass_w8a8.W8A8MoE` a `DequantizedMoE` (dequantized weights, activations quantized with the same
    op as the kernel path, products in ``dtype``). The copy has its own cache, with the contents of ``model``'s at the time of the call.

    Raises
    ------
    ValueError
        ``model`` is a tensor-parallel shard (``tp_size > 1``): a copy of one rank's shard is not the model.
    """
    if getattr(model, "tp_size", 1) > 1:
        raise ValueError(f"float_reference: `model` is a tensor-parallel shard (tp_size = {model.tp_size}); "
                         "build the reference from the unsharded model")
    ref = copy.deepcopy(model)
    try:
        from ..moe.layer import W8A8MoE
    except ImportError:  # a tree without the MoE package: no MoE layer to swap
        W8A8MoE = ()

    def swap(module: nn.Module) -> None:
        for name, child in list(module.named_children()):
            if isinstance(child, W8A8Linear):
                setattr(module, name, DequantizedLinear(child))
            elif W8A8MoE and isinstance(child, W8A8MoE):
                setattr(module, name, DequantizedMoE(child))
            else:
                swap(child)

    swap(ref)
    ref.to(dtype)
    ref.dtype = dtype
    for layer in ref.layers:
        torch._dynamo.mark_static_address(layer.self_attn.kv_cache)
    return ref
