"""The top-level entry points that compose the layers below them: ``cutlass_w8a8.quantize_`` (the module swap of
`cutlass_w8a8.quantize`, then tensor parallelism and the checkpoint annotation) and ``cutlass_w8a8.tensor_parallel_``
(`cutlass_w8a8.distributed.tensor_parallel_`).

Layering: this module sits above ``distributed/`` and ``checkpoints/`` (as ``hf/`` does) and calls them; nothing in
the package imports it but ``cutlass_w8a8/__init__.py``. `cutlass_w8a8.quantize.quantize_` stays a pure module swap
(config in, modules swapped, as torchao's): the layers below (models/, the checkpoint loader) call that one.
"""

from __future__ import annotations

from typing import Callable, Optional

from torch import nn

from .checkpoints.save import attach_quantization_config
from .config import W8A8Config
from .distributed.plan import tensor_parallel_
from .quantize import check_quantize_args
from .quantize import quantize_ as _swap_modules

__all__ = ["quantize_", "tensor_parallel_"]


def quantize_(model: nn.Module, config: Optional[W8A8Config] = None,
              filter_fn: Optional[Callable[[nn.Module, str], bool]] = None, *, tp_group=None,
              tp_plan: Optional[dict] = None) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` by a `W8A8Linear`, in place (torchao's ``quantize_`` shape), then
    optionally shard it for tensor parallelism, and describe it for transformers' ``save_pretrained``.

    Three steps, each the owner's:

    1. `cutlass_w8a8.quantize.quantize_` (the module swap): ``model``, ``config`` and ``filter_fn``, the rules of
       which linears and mixture-of-experts blocks are swapped or left in float (with a warning pointing at the
       line calling this function), and its errors, are all as documented there.
    2. With ``tp_group``: `cutlass_w8a8.tensor_parallel_` ``(model, tp_group, tp_plan)``.
    3. A transformers model gets a compressed-tensors ``config.quantization_config`` describing its `W8A8Linear`
       layers (`cutlass_w8a8.checkpoints.save.attach_quantization_config`), so that its own ``save_pretrained``
       writes a checkpoint that transformers, vLLM and `cutlass_w8a8.from_pretrained` read back right.

    Parameters
    ----------
    model, config, filter_fn
        As in `cutlass_w8a8.quantize.quantize_` (step 1): ``model`` (``nn.Module``) is modified in place, or
        replaced and returned when it is a bare ``nn.Linear``; ``config`` (`W8A8Config`, default int8);
        ``filter_fn(module, fqn) -> bool`` picks the linears to swap.
    tp_group : torch.distributed.ProcessGroup or cutlass_w8a8.distributed.TPContext, optional
        Also shard the model for tensor parallelism over this group, after quantizing it (per-channel scales
        come from the full weights): `cutlass_w8a8.tensor_parallel_` with ``tp_plan``. Linears the plan names
        become column- / row-parallel layers (`W8A8Linear` ones `ColumnParallelW8A8Linear` /
        `RowParallelW8A8Linear`, those left in float their float counterparts), everything else stays
        replicated. Every rank calls ``quantize_`` on an identical model. Default None: no sharding.
    tp_plan : dict, optional
        ``{name suffix: "colwise" | "rowwise"}`` (see `cutlass_w8a8.distributed.plan`); default
        `cutlass_w8a8.distributed.LLAMA_TP_PLAN` (q/k/v/qkv/gate/up/gate_up and MLA's q_b/kv_b colwise, o/down
        rowwise, lm_head "vocab": column-parallel over the vocabulary with its logits gathered, where it splits).
        `W8A8MoE` experts are split over their intermediate size (`cutlass_w8a8.distributed.TensorParallelW8A8MoE`).

    Returns
    -------
    nn.Module
        ``model`` (or the replacement of a bare linear).

    Raises
    ------
    TypeError
        As `cutlass_w8a8.quantize.quantize_` (checked first); ``tp_plan`` without ``tp_group``.
    ValueError
        As `cutlass_w8a8.quantize.quantize_`. With ``tp_group``: ``model`` is a bare Linear (shard it with
        ``ColumnParallelW8A8Linear.from_float`` / ``RowParallelW8A8Linear.from_float``), or as
        `cutlass_w8a8.tensor_parallel_` (the same error on every rank).
    """
    config = check_quantize_args(model, config, filter_fn)
    if tp_plan is not None and tp_group is None:
        raise TypeError("quantize_: `tp_plan` is given without `tp_group`")
    if tp_group is not None and isinstance(model, nn.Linear):
        raise ValueError("quantize_: `tp_group` needs a model whose linears have names for `tp_plan` to match; "
                         "shard a bare Linear with ColumnParallelW8A8Linear.from_float / "
                         "RowParallelW8A8Linear.from_float")
    # stacklevel 3: the swap's warnings point at the line calling this function, not at this file
    model = _swap_modules(model, config, filter_fn, stacklevel=3)
    if tp_group is not None:
        tensor_parallel_(model, tp_group, tp_plan)
    attach_quantization_config(model)
    return model
