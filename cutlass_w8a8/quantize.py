"""`quantize_`, the in-place swap of a model's `nn.Linear` layers for `W8A8Linear`, and the one answer to
"can this Linear be quantized" (`shape_supported`, `refuse_quantized_weight`) that `W8A8Linear`,
`quantize_` and the checkpoint loader share."""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
from torch import nn

from .config import W8A8Config
from .ops._limits import GEMM_ALIGN

__all__ = ["quantize_", "shape_supported", "refuse_quantized_weight"]


def shape_supported(out_features: int, in_features: int) -> bool:
    """Whether a Linear of these sizes can be a `W8A8Linear`: N and K positive multiples of 16
    (``ops._limits.GEMM_ALIGN``, the GEMM kernels' alignment)."""
    return all(v > 0 and v % GEMM_ALIGN == 0 for v in (out_features, in_features))


_8BIT_DTYPES = tuple(getattr(torch, n) for n in ("int8", "uint8", "float8_e4m3fn", "float8_e5m2",
                                                 "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n))


def refuse_quantized_weight(where: str, linear: nn.Module, fqn: Optional[str] = None) -> None:
    """Raise when a Linear already holds quantized weights: quantizing its integers again as if they were
    floats gives a silently wrong model (int8 values loaded into nn.Linear by a loader that ignored the
    checkpoint's scales, or a compressed-tensors layer that transformers has not decompressed yet)."""
    w = getattr(linear, "weight", None)
    if isinstance(w, torch.Tensor) and (w.dtype in _8BIT_DTYPES or not w.is_floating_point()):
        raise TypeError(
            f"{where}: `linear`{f' {fqn}' if fqn else ''} already holds {w.dtype} weights (a quantized checkpoint loaded into "
            "nn.Linear?); quantizing them again would treat the integers as float weights and ignore their "
            "scales. Load the checkpoint with cutlass_w8a8.from_pretrained(path) instead.")



def quantize_(model: nn.Module, config: Optional[W8A8Config] = None,
              filter_fn: Optional[Callable[[nn.Module, str], bool]] = None, *, tp_group=None,
              tp_plan: Optional[dict] = None) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` by a `W8A8Linear`, in place (torchao's ``quantize_`` shape).

    Parameters
    ----------
    model : nn.Module
        Modified in place; a bare ``nn.Linear`` cannot be swapped in place, so its replacement is returned.
    config : W8A8Config, optional
        Quantized dtype and output dtype; default int8.
    filter_fn : callable, optional
        ``filter_fn(module, fqn) -> bool``; only linears for which it returns True are swapped.
    tp_group : torch.distributed.ProcessGroup, optional
        Also shard the model for tensor parallelism over this group, after quantizing it (per-channel scales
        come from the full weights): `cutlass_w8a8.distributed.tensor_parallel_` with ``tp_plan``. Linears the
        plan names become column- / row-parallel layers (`W8A8Linear` ones `ColumnParallelW8A8Linear` /
        `RowParallelW8A8Linear`, those left in float their float counterparts), everything else stays
        replicated. Every rank calls ``quantize_`` on an identical model. Default None: no sharding.
    tp_plan : dict, optional
        ``{name suffix: "colwise" | "rowwise"}`` (see `cutlass_w8a8.distributed.plan`); default
        `cutlass_w8a8.distributed.LLAMA_TP_PLAN` (q/k/v/qkv/gate/up/gate_up colwise, o/down rowwise).

    Returns
    -------
    nn.Module
        ``model`` (or the replacement of a bare linear).

    Linears whose K or N is not a multiple of 16, and linears whose weight is shared with another module (an
    ``lm_head`` tied to the input embedding), are left as they are, with a warning.

    Raises
    ------
    TypeError
        A selected Linear already holds int8 / fp8 weights (a quantized checkpoint loaded into ``nn.Linear``):
        load such checkpoints with `cutlass_w8a8.from_pretrained`.
    ValueError
        With ``tp_group``: ``model`` is a bare Linear (shard it with ``ColumnParallelW8A8Linear.from_float`` /
        ``RowParallelW8A8Linear.from_float``), or as `cutlass_w8a8.distributed.tensor_parallel_` (the same error
        on every rank).
    """
    config = config or W8A8Config()
    if tp_plan is not None and tp_group is None:
        raise TypeError("quantize_: `tp_plan` is given without `tp_group`")
    if tp_group is not None and isinstance(model, nn.Linear):
        raise ValueError("quantize_: `tp_group` needs a model whose linears have names for `tp_plan` to match; "
                         "shard a bare Linear with ColumnParallelW8A8Linear.from_float / "
                         "RowParallelW8A8Linear.from_float")

    tied = _tied_to_other_modules(model)

    def eligible(linear: nn.Linear, fqn: str) -> bool:
        if getattr(linear, "_tp", None) is not None:  # a float tensor-parallel shard (cutlass_w8a8.distributed)
            raise TypeError(f"quantize_: {fqn or 'the model'} is already a tensor-parallel shard "
                            f"({type(linear).__name__}); quantize the full model, with tp_group=..., instead")
        if filter_fn is not None and not filter_fn(linear, fqn):
            return False
        refuse_quantized_weight("quantize_", linear, fqn)
        if id(linear.weight) in tied:
            warnings.warn(f"quantize_: leaving {fqn} in float: its weight is shared with {tied[id(linear.weight)]} "
                          "(tied embeddings); quantizing it would untie them", stacklevel=3)
            return False
        n, k = linear.weight.shape
        if not shape_supported(n, k):
            warnings.warn(f"quantize_: leaving {fqn or 'the model'} in float: in_features={k} and "
                          f"out_features={n} must be multiples of 16", stacklevel=3)
            return False
        return True

    from .linear import W8A8Linear

    if isinstance(model, nn.Linear):
        return W8A8Linear.from_float(model, config) if eligible(model, "") else model

    def swap(module: nn.Module, prefix: str) -> None:
        for name, child in list(module.named_children()):
            fqn = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.Linear):
                if eligible(child, fqn):
                    setattr(module, name, W8A8Linear.from_float(child, config))
            else:
                swap(child, fqn)

    swap(model, "")
    if tp_group is not None:
        from .distributed.plan import tensor_parallel_

        tensor_parallel_(model, tp_group, tp_plan)
    # A transformers model gets a compressed-tensors quantization_config describing its W8A8Linear layers, so
    # that its own save_pretrained writes a checkpoint transformers, vLLM and from_pretrained read back right.
    from .checkpoints.save import attach_quantization_config

    attach_quantization_config(model)
    return model


def _tied_to_other_modules(model: nn.Module) -> dict:
    """``{id(weight): owner name}`` for Linear weights that another, non-Linear module also holds (tied
    embeddings)."""
    owners: dict = {}
    for name, module in model.named_modules(remove_duplicate=False):
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and not isinstance(module, nn.Linear):
            owners.setdefault(id(w), name)
    return {id(m.weight): owners[id(m.weight)] for m in model.modules()
            if isinstance(m, nn.Linear) and id(m.weight) in owners}
