"""Mixture-of-experts layers: `W8A8MoE` (the experts of one MoE block with 8-bit weights and activations) and the
transformers integration (`cutlass_w8a8.moe.hf`: which MoE blocks `quantize_` swaps, and how; importing this
package registers that swap with `quantize_`)."""

from . import hf  # noqa: F401 (registers the experts swap with quantize_)
from .layer import W8A8MoE, quantize_expert_weights

__all__ = ["W8A8MoE", "quantize_expert_weights"]
