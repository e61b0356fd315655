"""`W8A8MoE`: the experts of one mixture-of-experts block with 8-bit weights and activations (skeleton)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..config import W8A8Config
from ..ops._limits import BLOCK_SIZE

__all__ = ["W8A8MoE"]


def _blocks(v: int) -> int:
    return -(-v // BLOCK_SIZE)


class W8A8MoE(nn.Module):
    """Experts of one MoE block (skeleton: constructor and buffers final, forward to come)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 config: Optional[W8A8Config] = None, renormalize: bool = True, activation: str = "silu",
                 device=None, *, static_input_scale: bool = False):
        super().__init__()
        config = W8A8Config() if config is None else config
        e, h, i = num_experts, hidden_size, intermediate_size
        self.num_experts, self.top_k, self.hidden_size, self.intermediate_size = e, top_k, h, i
        self.renormalize, self.activation = bool(renormalize), activation
        self.quant_dtype = config.dtype
        self.dtype = config.out_dtype or torch.bfloat16
        self.weight_block_size = config.weight_block_size
        self.register_buffer("w13", torch.empty(e, 2 * i, h, dtype=config.dtype, device=device))
        self.register_buffer("w2", torch.empty(e, h, i, dtype=config.dtype, device=device))
        if self.weight_block_size is not None:
            s13, s2 = (e, _blocks(2 * i), _blocks(h)), (e, _blocks(h), _blocks(i))
        else:
            s13, s2 = (e, 2 * i), (e, h)
        self.register_buffer("w13_scale", torch.ones(s13, dtype=torch.float32, device=device))
        self.register_buffer("w2_scale", torch.ones(s2, dtype=torch.float32, device=device))
        self.register_buffer("a13_scale", torch.ones(1, dtype=torch.float32, device=device)
                             if static_input_scale else None)
        self.register_buffer("a2_scale", torch.ones(1, dtype=torch.float32, device=device)
                             if static_input_scale else None)

    def forward(self, hidden_states, router_logits_or_topk_ids, topk_weights=None):
        raise NotImplementedError("W8A8MoE.forward: skeleton")
