"""`quantize_`, the in-place swap of a model's `nn.Linear` layers for `W8A8Linear`: a pure module swap (config in,
modules swapped, as torchao's), with no tensor parallelism and no checkpoint annotation. The top-level
``cutlass_w8a8.quantize_`` (`cutlass_w8a8.api`) adds both after it.

The answer to "can this Linear be quantized" (`shape_supported`, `refuse_quantized_weight`) is `cutlass_w8a8.linear`'s
(what `W8A8Linear` accepts), re-exported here for `quantize_`'s callers and the checkpoint loader."""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
from torch import nn

from .config import W8A8Config
from .linear import W8A8Linear, refuse_quantized_weight, shape_supported
from .ops._limits import BLOCK_SIZE

__all__ = ["quantize_", "check_quantize_args", "shape_supported", "refuse_quantized_weight", "ModuleSwap",
           "register_module_swap"]


class ModuleSwap:
    """A kind of module that `quantize_` swaps besides ``nn.Linear`` (the experts of MoE blocks: `W8A8MoE`).

    The layering rule keeps this file from importing the layers above it (``cutlass_w8a8.moe``), so such a layer
    registers its swap here with `register_module_swap` when it is imported (``import cutlass_w8a8`` imports
    them all). `quantize_` asks each registered swap, in order, about every child module that is not a Linear:

    - ``claims(parent, name, module) -> bool``: the swap handles ``parent.<name>`` (float or already quantized);
      then ``filter_fn`` is asked about it as about a Linear;
    - ``is_quantized(module) -> bool``: it is already quantized; it must then match ``config`` as a `W8A8Linear`
      does (its ``quant_dtype``, ``dtype`` and ``weight_block_size`` attributes), else ValueError;
    - ``swap(parent, name, module, fqn, config) -> (replacement, None)`` or ``(None, reason)``: the quantized
      module, set on ``parent`` by `quantize_`, or None and why it stays in float (warned at the caller's line;
      its children are then visited as usual). It raises for modules that must not be quantized.
    """

    def claims(self, parent: nn.Module, name: str, module: nn.Module) -> bool:
        raise NotImplementedError

    def is_quantized(self, module: nn.Module) -> bool:
        raise NotImplementedError

    def swap(self, parent: nn.Module, name: str, module: nn.Module, fqn: str, config: W8A8Config):
        raise NotImplementedError


_MODULE_SWAPS: list = []


def register_module_swap(swap: ModuleSwap) -> None:
    """Register a `ModuleSwap` with `quantize_` (once per object; registering it again does nothing)."""
    if not isinstance(swap, ModuleSwap):
        raise TypeError(f"register_module_swap: `swap` must be a ModuleSwap, got {type(swap).__name__}")
    if swap not in _MODULE_SWAPS:
        _MODULE_SWAPS.append(swap)


def _claimed(parent: nn.Module, name: str, module: nn.Module) -> Optional[ModuleSwap]:
    for swap in _MODULE_SWAPS:
        if swap.claims(parent, name, module):
            return swap
    return None


def check_quantize_args(model: nn.Module, config: Optional[W8A8Config],
                        filter_fn: Optional[Callable[[nn.Module, str], bool]]) -> W8A8Config:
    """`quantize_`'s argument checks (the TypeErrors listed there); returns ``config`` or the default
    ``W8A8Config()``. The top-level ``cutlass_w8a8.quantize_`` runs them before its own (``tp_group``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_: `model` must be a torch.nn.Module, got {type(model).__name__}")
    if config is None:
        config = W8A8Config()
    elif not isinstance(config, W8A8Config):
        raise TypeError(f"quantize_: `config` must be a cutlass_w8a8.W8A8Config, got {type(config).__name__} "
                        f"({config!r}); e.g. quantize_(model, W8A8Config(dtype=torch.int8)) or "
                        "W8A8Config(dtype=torch.float8_e4m3fn)")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"quantize_: `filter_fn` must be callable as filter_fn(module, fqn) -> bool, got "
                        f"{type(filter_fn).__name__}")
    return config


def quantize_(model: nn.Module, config: Optional[W8A8Config] = None,
              filter_fn: Optional[Callable[[nn.Module, str], bool]] = None, *, stacklevel: int = 2) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` by a `W8A8Linear`, in place (torchao's ``quantize_`` shape): the
    module swap alone. ``cutlass_w8a8.quantize_`` (`cutlass_w8a8.api.quantize_`) is this, then tensor parallelism
    (``tp_group=``) and the checkpoint annotation of a transformers model.

    Parameters
    ----------
    model : nn.Module
        Modified in place; a bare ``nn.Linear`` cannot be swapped in place, so its replacement is returned.
    config : W8A8Config, optional
        Quantized dtype and output dtype; default int8.
    filter_fn : callable, optional
        ``filter_fn(module, fqn) -> bool``; only linears for which it returns True are swapped. It is also asked
        about the `W8A8Linear` layers already in ``model`` (those it selects must match ``config``, below).
    stacklevel : int
        Of the warnings (default 2: the line calling ``quantize_``); a wrapper adds one per frame it adds.

    Returns
    -------
    nn.Module
        ``model`` (or the replacement of a bare linear).

    Linears whose K or N is not a multiple of 16 (with ``config.weight_block_size``, whose K is not a multiple
    of 128), and linears whose weight is shared with another module (an
    ``lm_head`` tied to the input embedding), are left as they are, with a warning naming the module
    (``module 'lm_head'``) that points at the line calling ``quantize_``.

    Mixture-of-experts blocks: the ``experts`` child of the transformers blocks of `cutlass_w8a8.moe.families`
    (Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4.5, OLMoE and the other rows; fused 3-D ``gate_up_proj`` /
    ``down_proj``) becomes a `W8A8MoE` (`W8A8MoE.from_float`, its routing read from the block's router: top-k,
    renormalization, scoring, grouped top-k, scaling factor, correction bias); the router stays in float, shared
    experts (Qwen2-MoE's ``shared_expert``, DeepSeek-V3's ``shared_experts``) are quantized as Linears, and so are
    DeepSeek-V3's attention projections (``q_a_proj`` ... ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``), plain
    Linears whose attention math stays transformers'. A router whose routing ``moe_route`` does not compute leaves
    its block's experts in float with a warning. ``filter_fn`` is asked about each
    ``experts`` module as about a Linear. Experts whose H or I is not a multiple of 16 (128 with
    ``weight_block_size``) or whose activation is not SiLU, and any other module holding 3-D expert parameters,
    are left in float with a warning naming the module and its class. The swap is registered by
    ``cutlass_w8a8.moe`` (`register_module_swap`); `W8A8MoE` layers already in ``model`` follow the rules of
    `W8A8Linear` ones below.

    `W8A8Linear` layers already in ``model`` (a model quantized before, or loaded with `from_pretrained`) are
    never quantized again: their float weights are gone. Those that ``filter_fn`` selects must match ``config``
    (its ``dtype``, and its ``out_dtype`` when given), else ValueError; when they all match and no float Linear
    was swapped, the call changes nothing and warns that the model is already quantized. Quantizing parts of a
    model with different configs (mixed schemes) works when each call's ``filter_fn`` selects only its part.

    Raises
    ------
    TypeError
        ``model`` is not an ``nn.Module``, ``config`` not a `W8A8Config` (``quantize_(model, "int8")``: pass
        ``W8A8Config(dtype=torch.int8)``), ``filter_fn`` not callable; a selected Linear already holds int8 / fp8
        weights (a quantized checkpoint loaded into ``nn.Linear``), or selected MoE experts hold them: load such
        checkpoints with `cutlass_w8a8.from_pretrained`.
    ValueError
        A `W8A8Linear` already in ``model`` that ``filter_fn`` selects does not match ``config`` (the message
        names the module).
    """
    config = check_quantize_args(model, config, filter_fn)

    tied = _tied_to_other_modules(model)
    # Why a Linear stays in float, emitted once the walk is done with `stacklevel`: the warning points at the
    # caller's line, not at this file (the walk below recurses, so no fixed stacklevel would from there).
    left_in_float: list = []

    def eligible(linear: nn.Linear, fqn: str) -> bool:
        if getattr(linear, "_tp", None) is not None:  # a float tensor-parallel shard (cutlass_w8a8.distributed)
            raise TypeError(f"quantize_: {fqn or 'the model'} is already a tensor-parallel shard "
                            f"({type(linear).__name__}); quantize the full model, with tp_group=..., instead")
        if filter_fn is not None and not filter_fn(linear, fqn):
            return False
        refuse_quantized_weight("quantize_", linear, fqn)
        what = f"module {fqn!r}" if fqn else "the model"
        if id(linear.weight) in tied:
            left_in_float.append(f"quantize_: leaving {what} in float: its weight is shared with module "
                                 f"{tied[id(linear.weight)]!r} (tied embeddings); quantizing it would untie them")
            return False
        n, k = linear.weight.shape
        if not shape_supported(n, k):
            left_in_float.append(f"quantize_: leaving {what} in float: in_features={k} and out_features={n} "
                                 "must be multiples of 16")
            return False
        if not shape_supported(n, k, config.weight_block_size):
            left_in_float.append(f"quantize_: leaving {what} in float: in_features={k} must be a multiple of "
                                 f"{BLOCK_SIZE} for weight_block_size={config.weight_block_size} (1x{BLOCK_SIZE} "
                                 "activation groups)")
            return False
        return True

    if isinstance(model, nn.Linear):
        new = W8A8Linear.from_float(model, config) if eligible(model, "") else model
        for message in left_in_float:
            warnings.warn(message, stacklevel=stacklevel)
        return new

    swapped = 0
    already: dict = {}  # class name -> count of the already-quantized layers that match config

    def swap(module: nn.Module, prefix: str) -> None:
        nonlocal swapped
        for name, child in list(module.named_children()):
            fqn = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.Linear):
                if eligible(child, fqn):
                    setattr(module, name, W8A8Linear.from_float(child, config))
                    swapped += 1
            elif isinstance(child, W8A8Linear):
                if filter_fn is None or filter_fn(child, fqn):
                    _refuse_other_scheme(child, fqn, config)
                    already[type(child).__name__] = already.get(type(child).__name__, 0) + 1
            else:
                kind = _claimed(module, name, child)  # a registered ModuleSwap (MoE experts)
                if kind is None or (filter_fn is not None and not filter_fn(child, fqn)):
                    swap(child, fqn)
                elif kind.is_quantized(child):
                    _refuse_other_scheme(child, fqn, config)
                    already[type(child).__name__] = already.get(type(child).__name__, 0) + 1
                else:
                    new, why = kind.swap(module, name, child, fqn, config)
                    if new is None:
                        left_in_float.append(why)
                        swap(child, fqn)
                    else:
                        setattr(module, name, new)
                        swapped += 1

    if isinstance(model, W8A8Linear):
        if filter_fn is None or filter_fn(model, ""):
            _refuse_other_scheme(model, "", config)
            already["W8A8Linear"] = 1
    else:
        swap(model, "")
    for message in left_in_float:
        warnings.warn(message, stacklevel=stacklevel)
    if already and not swapped:
        layers = " and ".join(f"{n} {cls} layer(s)" for cls, n in already.items())
        warnings.warn(f"quantize_: the model is already quantized: its {layers} match "
                      "`config` and no float nn.Linear was left to quantize, so nothing changed",
                      stacklevel=stacklevel)
    return model


def _refuse_other_scheme(layer: nn.Module, fqn: str, config: W8A8Config) -> None:
    """Raise ValueError when the `W8A8Linear` (or `ModuleSwap`-quantized layer, e.g. `W8A8MoE`) ``layer`` (module
    ``fqn`` of the model) is not what ``config`` would make of its float module: its float weights are gone, so it
    cannot be quantized again."""
    have = [("dtype", config.dtype, "quant_dtype", layer.quant_dtype)]
    if config.out_dtype is not None:
        have.append(("out_dtype", config.out_dtype, "dtype", layer.dtype))
    # block-scaled fp8 (W8A8Config.weight_block_size / W8A8Linear.weight_block_size), where present
    have.append(("weight_block_size", getattr(config, "weight_block_size", None), "weight_block_size",
                 getattr(layer, "weight_block_size", None)))
    # row-wise fp8's accumulation (W8A8Linear.fp8_fast_accum; layers without it, e.g. W8A8MoE, are not asked)
    have.append(("fp8_fast_accum", config.fp8_fast_accum, "fp8_fast_accum",
                 getattr(layer, "fp8_fast_accum", config.fp8_fast_accum)))
    for cname, want, lname, got in have:
        if want != got:
            what = f"module {fqn!r}" if fqn else "`model`"
            raise ValueError(
                f"quantize_: `config` asks for {cname}={want} but {what} is already a {type(layer).__name__} with "
                f"{lname}={got}; its float weights are gone, so it cannot be quantized again. Quantize the float "
                "model (reload it) with this config, or leave the module out with filter_fn")


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
