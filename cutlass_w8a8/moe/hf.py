"""transformers' MoE blocks and `W8A8MoE`: which experts modules `quantize_` swaps, and the routing they keep.

transformers 5 holds the experts of Qwen2-MoE, Qwen3-MoE and Mixtral blocks as one module with fused 3-D
parameters, ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``, called by its block as
``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` after the block's router (``gate``).
A `W8A8MoE` takes the same call, so `quantize_` replaces the block's ``experts`` child and leaves the router in
its float dtype. Qwen2-MoE's shared expert is a plain SwiGLU MLP of ``nn.Linear`` layers, quantized as Linears.

The swap is registered with `cutlass_w8a8.quantize` (`register_module_swap`) when this module is imported: the
layering rule keeps quantize.py from importing moe/, which sits above it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import W8A8Config
from ..ops._limits import BLOCK_SIZE, GEMM_ALIGN
from ..quantize import ModuleSwap, register_module_swap
from .layer import W8A8MoE

__all__ = ["SUPPORTED_BLOCKS", "block_routing", "expert_parameters", "is_supported_block"]

# transformers' sparse-MoE block classes whose ``experts`` child quantize_ swaps (matched by class name along the
# MRO, so subclasses count, without importing transformers)
SUPPORTED_BLOCKS = ("Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "MixtralSparseMoeBlock")
_MIXTRAL = "MixtralSparseMoeBlock"
# parameter names of fused or per-expert weights in the MoE modules of transformers and others
_EXPERT_NAMES = ("gate_up_proj", "down_proj", "up_proj", "gate_proj", "w1", "w2", "w3")


def _class_names(module: nn.Module) -> set:
    return {c.__name__ for c in type(module).__mro__}


def is_supported_block(module: nn.Module) -> bool:
    """Whether ``module`` is (a subclass of) one of transformers' `SUPPORTED_BLOCKS`."""
    return bool(_class_names(module) & set(SUPPORTED_BLOCKS))


def block_routing(block: nn.Module) -> tuple:
    """``(top_k, renormalize)`` of a supported block's router: ``gate.top_k``; Mixtral always renormalizes the
    top-k probabilities, Qwen2-/Qwen3-MoE when ``gate.norm_topk_prob``. ValueError when the router lacks them."""
    gate = getattr(block, "gate", None)
    top_k = getattr(gate, "top_k", None)
    if not isinstance(top_k, int):
        raise ValueError(f"quantize_: the router `gate` of {type(block).__name__} has no int `top_k` (got "
                         f"{type(gate).__name__}); cannot build its W8A8MoE")
    if _MIXTRAL in _class_names(block):
        return top_k, True
    norm = getattr(gate, "norm_topk_prob", None)
    if not isinstance(norm, bool):
        raise ValueError(f"quantize_: the router `gate` of {type(block).__name__} has no bool `norm_topk_prob`; "
                         "cannot tell whether it renormalizes the top-k weights")
    return top_k, norm


def expert_parameters(module: nn.Module) -> list:
    """Names of ``module``'s own 3-D parameters when it looks like an MoE experts module (a 3-D parameter and an
    expert-ish name: ``num_experts`` attribute, "expert" in its class name, or a parameter named like an expert
    projection); convolutions excluded. ``[]`` otherwise."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return []
    names = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
    if not names:
        return []
    expertish = (hasattr(module, "num_experts") or "expert" in type(module).__name__.lower()
                 or any(n in _EXPERT_NAMES for n in names))
    return names if expertish else []


class _TransformersExpertsSwap(ModuleSwap):
    """`quantize_`'s swap of transformers' experts for `W8A8MoE` (see the module docstring)."""

    def claims(self, parent: nn.Module, name: str, module: nn.Module) -> bool:
        if isinstance(module, W8A8MoE):
            return True
        return (name == "experts" and is_supported_block(parent)) or bool(expert_parameters(module))

    def is_quantized(self, module: nn.Module) -> bool:
        return isinstance(module, W8A8MoE)

    def swap(self, parent: nn.Module, name: str, module: nn.Module, fqn: str, config: W8A8Config):
        what = f"module {fqn!r} ({type(module).__name__})"
        if not (name == "experts" and is_supported_block(parent)):
            params = ", ".join(expert_parameters(module)) or "none"
            return None, (f"quantize_: leaving {what} in float: it holds 3-D expert parameters ({params}) but is "
                          f"not the experts of a transformers {' / '.join(SUPPORTED_BLOCKS)}, the MoE blocks "
                          "quantize_ swaps for W8A8MoE")
        gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not isinstance(gu, torch.Tensor) or not isinstance(dn, torch.Tensor) or gu.dim() != 3 or dn.dim() != 3:
            return None, (f"quantize_: leaving {what} in float: it has no 3-D `gate_up_proj` / `down_proj` "
                          "(transformers 5's fused experts)")
        for pname, t in (("gate_up_proj", gu), ("down_proj", dn)):
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
        top_k, renormalize = block_routing(parent)
        return W8A8MoE.from_float(module, config, top_k, renormalize), None


register_module_swap(_TransformersExpertsSwap())
