"""`quantization_config_of` and `attach_quantization_config`: the compressed-tensors ``quantization_config`` that
describes a model's `W8A8Linear` / `W8A8MoE` layers, as `cutlass_w8a8.checkpoints.write.save_pretrained` writes
it (`quantize_` attaches it too, so that transformers' own ``model.save_pretrained`` writes it)."""

from __future__ import annotations

import sys
from typing import Optional

from torch import nn

from ..linear import W8A8Linear
from ..moe.layer import W8A8MoE
from ._moe import router_ignore
from ._scheme import BLOCK_SCHEME, LinearScheme, build_quantization_config, scheme_of

__all__ = ["attach_quantization_config", "quantization_config_of", "moe_scheme_of"]


def quantization_config_of(model: nn.Module) -> Optional[dict]:
    """The compressed-tensors ``quantization_config`` dict describing ``model``'s `W8A8Linear` modules, or None
    when it has none.

    All `W8A8Linear` sharing one scheme (llm-compressor's form): one group with ``targets: ["Linear"]`` and
    ``ignore`` listing every float ``nn.Linear`` by name. Several schemes: one group per scheme, its targets the
    module names, and no ignore list.
    """
    by_scheme = {}
    floats = []
    for name, m in model.named_modules():
        if isinstance(m, W8A8Linear):
            by_scheme.setdefault(scheme_of(m), []).append(name)
        elif isinstance(m, W8A8MoE):
            by_scheme.setdefault(moe_scheme_of(m), []).extend(_expert_linear_names(model, name, m))
        elif isinstance(m, nn.Linear):
            floats.append(name)
    if not by_scheme:
        return None
    if len(by_scheme) == 1:
        routers = router_ignore(model)
        return build_quantization_config([(next(iter(by_scheme)), ["Linear"])], floats + routers)
    return build_quantization_config(list(by_scheme.items()), [])


def moe_scheme_of(moe) -> LinearScheme:
    """The `LinearScheme` of a `W8A8MoE`'s expert linears, from its attributes."""
    if moe.weight_block_size is not None:
        return BLOCK_SCHEME
    return LinearScheme(quant_dtype=moe.w13.dtype, per_channel=True, static_input=moe.a13_scale is not None)


def _expert_linear_names(model: nn.Module, name: str, moe) -> list:
    """The per-expert linear names a `W8A8MoE` is written as (`_moe.moe_state_dict`'s tensors, less the leaf)."""
    from ._moe import moe_linear_names

    try:
        return moe_linear_names(model, name, moe, "cutlass_w8a8.save_pretrained")
    except ValueError:  # not in a known block: no layout (save_pretrained refuses it; attach_quantization_config
        return [name]  # must not raise, quantize_ calls it)


def attach_quantization_config(model: nn.Module) -> None:
    """Set ``model.config.quantization_config`` to the compressed-tensors dict describing ``model``'s `W8A8Linear`
    modules, so that transformers' own ``model.save_pretrained`` writes a checkpoint that loads back correctly
    (without it, the int8 / e4m3 weights are saved with no config and load into float layers).

    A no-op for a model that is not a transformers ``PreTrainedModel`` or holds no `W8A8Linear`. Cheap (one walk
    over the modules); transformers is not imported here (a model can only be a ``PreTrainedModel`` when it
    already is).
    """
    if "transformers" not in sys.modules:
        return
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return
    qc = quantization_config_of(model)
    if qc is not None:
        model.config.quantization_config = qc
