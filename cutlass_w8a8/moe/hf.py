"""`quantize_`'s swap of transformers' MoE experts for `W8A8MoE`, for the blocks of `cutlass_w8a8.moe.families`.

transformers 5 holds the experts of each family's block as one module with fused 3-D parameters, ``gate_up_proj``
``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]`` (the row's `ExpertLayout`), called by its block as
``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` after the block's router. A `W8A8MoE`
takes the same call, so `quantize_` replaces the block's ``experts`` child and leaves the router in its float dtype;
the routing (for `W8A8MoE`'s router-logits mode, ``moe_route``: top-k, renormalization, scoring, grouped top-k,
scaling factor and the correction bias tensor) is read from the router as the row's `Routing` says
(`cutlass_w8a8.moe.families.read_routing`). The correction bias is the router's own tensor, shared with the layer
(not copied) when it is float32: it is the one transformers' state dict loads, so a state dict loaded into the
quantized model later reaches the layer too (a move to another device gives each module its own moved copy, equal
in value, as ``nn.Module.to`` does for any shared buffer); a router holding it in another dtype (transformers 5.17
builds it in the model's dtype) gives a float32 copy, whose values are the same. A routing ``moe_route`` does not compute
(`RoutingArgs.unserved`) leaves the experts in float with a warning. Shared experts (Qwen2-MoE's ``shared_expert``,
DeepSeek-V3's ``shared_experts``) are plain SwiGLU MLPs of ``nn.Linear`` layers, quantized as Linears.

`EXPERTS_SWAP` is registered with `cutlass_w8a8.quantize` (`register_module_swap`) by ``cutlass_w8a8.moe``'s
``__init__``, which ``import cutlass_w8a8`` runs: the layering rule keeps quantize.py from importing moe/, which sits
above it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import W8A8Config
from ..ops._limits import BLOCK_SIZE, GEMM_ALIGN
from ..quantize import ModuleSwap
from .families import block_classes, expert_parameters, family_of, read_routing
from .layer import W8A8MoE

__all__ = ["EXPERTS_SWAP", "ExpertsSwap"]


def _class_names(module: nn.Module) -> set:
    return {c.__name__ for c in type(module).__mro__}


def _family_experts(parent: nn.Module, name: str):
    """The `MoeFamily` whose experts ``parent.<name>`` is, or None."""
    fam = family_of(parent)
    return fam if fam is not None and name == fam.layout.module else None


class ExpertsSwap(ModuleSwap):
    """`quantize_`'s swap of the experts of the blocks of `cutlass_w8a8.moe.families.FAMILIES` for `W8A8MoE` (see the
    module docstring); other modules holding 3-D expert parameters are claimed too, and left in float with a
    warning."""

    def claims(self, parent: nn.Module, name: str, module: nn.Module) -> bool:
        if isinstance(module, W8A8MoE):
            return True
        return _family_experts(parent, name) is not None or bool(expert_parameters(module))

    def is_quantized(self, module: nn.Module) -> bool:
        return isinstance(module, W8A8MoE)

    def swap(self, parent: nn.Module, name: str, module: nn.Module, fqn: str, config: W8A8Config):
        what = f"module {fqn!r} ({type(module).__name__})"
        fam = _family_experts(parent, name)
        if fam is None:
            params = ", ".join(expert_parameters(module)) or "none"
            return None, (f"quantize_: leaving {what} in float: it holds 3-D expert parameters ({params}) but is "
                          f"not the experts of a transformers {' / '.join(block_classes())}, the MoE blocks "
                          "quantize_ swaps for W8A8MoE")
        lay = fam.layout
        gu, dn = getattr(module, lay.gate_up, None), getattr(module, lay.down, None)
        if not isinstance(gu, torch.Tensor) or not isinstance(dn, torch.Tensor) or gu.dim() != 3 or dn.dim() != 3:
            return None, (f"quantize_: leaving {what} in float: it has no 3-D `{lay.gate_up}` / `{lay.down}` "
                          "(transformers 5's fused experts)")
        for pname, t in ((lay.gate_up, gu), (lay.down, dn)):
            if not t.is_floating_point() or t.element_size() == 1:
                raise TypeError(f"quantize_: `experts` {what} already holds {t.dtype} `{pname}` weights (a quantized "
                                "checkpoint loaded into float experts?); quantizing them again would treat the "
                                "integers as float weights and ignore their scales. Load the checkpoint with "
                                "cutlass_w8a8.from_pretrained(path) instead.")
        act = getattr(module, "act_fn", None)
        if act is not None and not ({"SiLU", "SiLUActivation"} & _class_names(act)):
            return None, (f"quantize_: leaving {what} in float: its activation is {type(act).__name__}; W8A8MoE "
                          "runs SwiGLU (silu) experts only")
        e, i2, h = gu.shape
        i = i2 // 2
        align = BLOCK_SIZE if config.weight_block_size is not None else GEMM_ALIGN
        if i2 % 2 or h % align or i % align:
            block = (f" for weight_block_size={config.weight_block_size} (1x{BLOCK_SIZE} activation groups)"
                     if config.weight_block_size is not None else "")
            return None, (f"quantize_: leaving {what} in float: hidden size H = {h} and intermediate size I = {i} "
                          f"must be multiples of {align}{block}")
        routing = read_routing(parent, fam, "quantize_")
        why = routing.unserved()
        if why is not None:
            return None, f"quantize_: leaving {what} in float: {why}"
        return W8A8MoE.from_float(module, config, routing.top_k, routing.renormalize,
                                  gate_up=lay.gate_up, down=lay.down, **routing.layer_kwargs()), None


#: The one instance `cutlass_w8a8.moe` registers with `quantize_`.
EXPERTS_SWAP = ExpertsSwap()
