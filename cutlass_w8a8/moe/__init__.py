"""Mixture-of-experts layers: `W8A8MoE` (the experts of one MoE block with 8-bit weights and activations), the table
of the transformers MoE families it serves (`cutlass_w8a8.moe.families`) and `quantize_`'s swap of their experts
(`cutlass_w8a8.moe.hf`), registered with `quantize_` here, at package import (``import cutlass_w8a8`` imports this
package)."""

from ..quantize import register_module_swap
from .families import FAMILIES, MoeFamily, family_of
from .hf import EXPERTS_SWAP
from .layer import W8A8MoE, quantize_expert_weights

register_module_swap(EXPERTS_SWAP)

__all__ = ["FAMILIES", "MoeFamily", "W8A8MoE", "family_of", "quantize_expert_weights"]
