"""`fuse_w8a8`: full `W8A8Linear` layers that share an input (q / k / v, gate / up) stacked into one layer along N.

Fusion is not a tensor-parallel concern: `cutlass_w8a8.hf.optimize_` fuses a transformers model's projections with
it, and a fused layer is what ``ColumnParallelW8A8Linear.from_full(fused, tp, output_sizes=sizes)``
(`cutlass_w8a8.distributed`) splits matrix by matrix. This module sits at the layer of `cutlass_w8a8.linear`: it
imports nothing above it.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .linear import W8A8Linear
from .ops._limits import BLOCK_SIZE

__all__ = ["fuse_w8a8"]


def fuse_w8a8(layers: Sequence[W8A8Linear]) -> tuple[W8A8Linear, list[int]]:
    """Stack full `W8A8Linear` layers that share an input (``q``, ``k``, ``v``; ``gate``, ``up``) into one layer
    along N, and return it with its ``output_sizes``, ready for ``ColumnParallelW8A8Linear.from_full(fused,
    tp_group, output_sizes=sizes)``.

    Weight scales: kept per tensor ``(1,)`` when every layer has the same per-tensor scale; otherwise per channel
    ``(sum N,)``, each layer's per-tensor scale repeated over its rows (exact: the same scale multiplies the same
    rows). This is how a compressed-tensors checkpoint's per-tensor q / k / v scales become one fused layer.
    Block-scaled fp8 layers (all of them, or none) fuse by stacking their block scales' rows, exact when every
    layer but the last has N a multiple of 128 (each layer keeps its own row blocks; the last may end in a
    partial block); otherwise a fused block would mix two layers' rows under one scale, which is refused.
    Activations: all dynamic, or all static with the same ``input_scale`` (one activation quantization serves the
    fused GEMM). The weights are copied (concatenated).

    Raises
    ------
    ValueError
        Fewer than one layer; the layers differ in ``in_features``, ``quant_dtype``, ``dtype``, bias presence,
        activation quantization or block scaling; their static ``input_scale`` values differ; a block-scaled
        layer other than the last has N not a multiple of 128.
    """
    layers = list(layers)
    # a tensor-parallel shard (cutlass_w8a8.distributed) carries its group in `_tp`: its rows are a slice
    if not layers or not all(isinstance(m, W8A8Linear) and getattr(m, "_tp", None) is None for m in layers):
        raise ValueError("fuse_w8a8: `layers` must be one or more unsharded W8A8Linear")
    first = layers[0]
    for name in ("in_features", "quant_dtype", "dtype"):
        values = [getattr(m, name) for m in layers]
        if any(v != values[0] for v in values):
            raise ValueError(f"fuse_w8a8: the layers differ in `{name}`: {values}")
    for name in ("bias", "input_scale"):
        present = [m._buffers[name] is not None for m in layers]
        if any(p != present[0] for p in present):
            raise ValueError(f"fuse_w8a8: some layers have `{name}` and others do not: {present}")
    if first.input_scale is not None:
        scales = [float(m.input_scale.reshape(())) for m in layers]
        if any(v != scales[0] for v in scales):
            raise ValueError(f"fuse_w8a8: the layers' static `input_scale` values differ ({scales}): one activation "
                             "quantization cannot serve the fused GEMM (quantize them with one scale, or dynamically)")
    sizes = [m.out_features for m in layers]
    ws = [m.weight_scale for m in layers]
    blocks = [m.weight_block_size is not None for m in layers]
    if any(b != blocks[0] for b in blocks):
        raise ValueError(f"fuse_w8a8: some layers have block-scaled weights and others do not: {blocks}")
    if blocks[0]:
        for i, n in enumerate(sizes[:-1]):
            if n % BLOCK_SIZE:
                raise ValueError(f"fuse_w8a8: block-scaled layer {i} has N = {n}, not a multiple of {BLOCK_SIZE}: "
                                 "stacked under the next layer, its last row block would share a scale with that "
                                 "layer's rows (only the last layer may end in a partial block)")
        scale = torch.cat(ws, dim=0)
    elif all(w.numel() == 1 for w in ws) and all(torch.equal(w, ws[0]) for w in ws):
        scale = ws[0].clone()
    else:
        scale = torch.cat([w.expand(n) if w.numel() == 1 else w for w, n in zip(ws, sizes)])
    weight = torch.cat([m.weight for m in layers], dim=0)
    bias = torch.cat([m.bias for m in layers]) if first.bias is not None else None
    fused = W8A8Linear.from_quantized(weight, scale, bias=bias, input_scale=first.input_scale, dtype=first.dtype,
                                      weight_block_size=first.weight_block_size)
    return fused, sizes

