"""The mixture-of-experts MLP of the reference decoder (Qwen3-MoE's sparse block): a router and the experts.

- `route_topk`: softmax over the experts in float32, the top-k, optionally renormalized (torch ops).
- `MoEExperts`: the float experts, ``gate_up_proj`` ``(E, 2I, H)`` and ``down_proj`` ``(E, H, I)`` parameters (the
  layout of transformers 5's fused experts, so `cutlass_w8a8.W8A8MoE.from_float` quantizes them), computed with
  ``torch._grouped_mm`` over the pairs sorted by expert where torch has it for the dtype, else per pair.
- `SparseMoeBlock`: ``gate`` (the router, an ``nn.Linear`` kept in the model dtype) and ``experts`` (a
  `MoEExperts`, a `cutlass_w8a8.W8A8MoE` in a W8A8 model, or `cutlass_w8a8.models.reference.DequantizedMoE` in the
  float reference); ``forward(x) = experts(x, gate(x))``, or, where a `cutlass_w8a8.W8A8MoE`'s
  ``router_route_applies`` (CUDA, T <= 16), ``experts(x, ids, weights)`` of ``experts.route_from_hidden(x,
  gate.weight)``: the router GEMM and the routing in one kernel (``moe_router_route``; ``gate`` itself is then not
  called, so hooks on it do not run). The decoder layer may fold its post-attention norm into that kernel:
  ``add_norm_route_applies`` / ``forward_add_norm`` (``add_rms_norm_moe_router_route``, behind the decoder's
  ``CUTLASS_W8A8_FUSED_NORM_ROUTER`` switch, models/layers.py).

Every step is a fixed sequence of kernels on tensors whose shapes depend on the batch only (no host sync, no
data-dependent shape), so the block captures into a CUDA graph like the rest of the decoder.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..ops._limits import NORM_DECODE_MAX_K
from ..ops.moe import add_rms_norm_moe_router_route

__all__ = ["MoEExperts", "SparseMoeBlock", "route_topk"]

# dtypes of cutlass_w8a8.ops.silu_mul (the fused SiLU*mul); others take the torch chain
_FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of ``router_logits`` ``(T, E)`` (any float dtype): ``(weights (T, top_k) float32, ids (T, top_k)
    int64)``, the ``top_k`` largest of ``softmax(router_logits.float())`` in descending order, divided by their sum
    when ``renormalize`` (Qwen3-MoE's ``norm_topk_prob``; Mixtral always). The semantics of
    `cutlass_w8a8.ops.moe_topk_softmax` (which returns int32 ids)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _grouped_mm_ok(x: torch.Tensor) -> bool:
    # torch._grouped_mm: bfloat16 (CPU; CUDA from sm80 on). Elsewhere the per-pair fallback.
    if not hasattr(torch, "_grouped_mm") or x.dtype is not torch.bfloat16:
        return False
    return x.device.type == "cpu" or (x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] >= 8)


class MoEExperts(nn.Module):
    """The float experts of one MoE block: SwiGLU experts ``down_e(silu(gate_e(x)) * up_e(x))``.

    Parameters ``gate_up_proj`` ``(E, 2I, H)`` (rows ``[0, I)`` the gate projection, ``[I, 2I)`` the up one) and
    ``down_proj`` ``(E, H, I)``, in the model dtype; attributes ``num_experts``, ``hidden_dim``,
    ``intermediate_dim``, ``top_k``, ``renormalize`` (as transformers' ``Qwen3MoeExperts`` names them).

    ``forward(x, router_logits)``: ``x`` ``(T, H)``, ``router_logits`` ``(T, E)``; routes with `route_topk` and
    returns ``(T, H)`` in ``x``'s dtype, ``out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` summed in float32
    (j ascending) and rounded once. The pairs are sorted by expert (a stable argsort), the group ends found by
    ``searchsorted``, both GEMMs are ``torch._grouped_mm`` over the sorted pairs (bfloat16 on the CPU or a CUDA
    device of compute capability >= 8), SiLU*mul is `cutlass_w8a8.ops.silu_mul`; other dtypes gather each pair's
    expert weights and multiply per pair (a reference for small sizes only: it copies the weights).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int,
                 renormalize: bool = True, device=None, dtype=None):
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_size, intermediate_size
        self.top_k, self.renormalize = top_k, renormalize
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, device=device,
                                                     dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, device=device,
                                                  dtype=dtype))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = route_topk(router_logits, self.top_k, self.renormalize)
        t, k = ids.shape
        flat = ids.reshape(-1)
        if _grouped_mm_ok(x):
            order = torch.argsort(flat, stable=True)  # position s of the sorted buffer holds pair order[s]
            offs = torch.searchsorted(flat[order], torch.arange(self.num_experts, device=x.device), right=True,
                                      out_int32=True)
            gate_up = torch._grouped_mm(x.index_select(0, order // k), self.gate_up_proj.transpose(1, 2), offs=offs)
            act = torch.ops.cutlass_w8a8.silu_mul(gate_up)
            y_sorted = torch._grouped_mm(act, self.down_proj.transpose(1, 2), offs=offs)
            # the inverse permutation by a scatter (no host sync), then the rows back in pair order: (T * k, H)
            inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
            y = y_sorted.index_select(0, inverse)
        else:
            xp = x.repeat_interleave(k, dim=0)  # pair p = t * k + j holds token t
            gate_up = torch.einsum("ph,pnh->pn", xp, self.gate_up_proj[flat])
            gate, up = gate_up.chunk(2, dim=-1)
            act = (torch.ops.cutlass_w8a8.silu_mul(gate_up) if x.dtype in _FUSED_DTYPES
                   else F.silu(gate) * up)
            y = torch.einsum("pi,phi->ph", act, self.down_proj[flat])
        out = (y.float().view(t, k, -1) * weights.unsqueeze(-1)).sum(dim=1)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"top_k={self.top_k}, renormalize={self.renormalize}")


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE's sparse MLP block: ``experts(x, gate(x))``.

    Submodules: ``gate``, the router ``nn.Linear(hidden, num_experts, bias=False)`` in the model dtype (never
    quantized: W8A8 recipes keep it in bf16), and ``experts`` (`MoEExperts`, `cutlass_w8a8.W8A8MoE` or
    `cutlass_w8a8.models.reference.DequantizedMoE`: any module called as ``experts(x (T, H), router_logits (T, E))
    -> (T, H)`` that routes itself). ``x``: float ``(T, hidden)``; returns ``(T, hidden)`` in ``x``'s dtype.
    """

    def __init__(self, config, device=None, dtype=None):
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False, device=device, dtype=dtype)
        self.experts = MoEExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                  config.num_experts_per_tok, config.norm_topk_prob, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        applies = getattr(self.experts, "router_route_applies", None)  # cutlass_w8a8.W8A8MoE's decode rule
        if applies is not None and self.gate.bias is None and applies(x, self.gate.weight):
            # the router GEMM and the routing in one kernel (moe_router_route); `gate` is not called
            topk_weights, topk_ids = self.experts.route_from_hidden(x, self.gate.weight)
            return self.experts(x, topk_ids, topk_weights)
        return self.experts(x, self.gate(x))

    def add_norm_route_applies(self, h: torch.Tensor, residual: Optional[torch.Tensor],
                               norm_weight: torch.Tensor) -> bool:
        """Whether `forward_add_norm` can take ``h`` and ``residual`` (the post-attention norm's inputs):
        `add_norm_route_applies` of this block's experts and ``gate`` (a bias-free one)."""
        return self.gate.bias is None and add_norm_route_applies(self.experts, self.gate.weight, h, residual,
                                                                 norm_weight)

    def forward_add_norm(self, h: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The post-attention norm and this block in one go where `add_norm_route_applies`: ``(out, residual_out)``
        with ``residual_out = residual + h`` (a new tensor; ``residual`` is not written) and ``out = forward(y)``,
        ``y = rms_norm(residual_out) * norm_weight``; the norm and the routing are one kernel (`add_norm_route`),
        the experts as in `forward`."""
        y, residual_out, topk_weights, topk_ids = add_norm_route(self.experts, self.gate.weight, h, residual,
                                                                 norm_weight, eps)
        return self.experts(y, topk_ids, topk_weights), residual_out


def add_norm_route_applies(experts, router_weight: torch.Tensor, h: torch.Tensor, residual: Optional[torch.Tensor],
                           norm_weight: torch.Tensor, logits_dtype: Optional[torch.dtype] = None) -> bool:
    """Whether `add_norm_route` can take the post-attention norm's inputs ``h`` and ``residual`` for a MoE block's
    ``experts`` and router weight: where the block would route with one kernel (``experts.router_route_applies`` of
    ``h`` and ``logits_dtype``: a `cutlass_w8a8.W8A8MoE`, CUDA, ``T <= 16``), ``H <= NORM_DECODE_MAX_K``, a
    ``residual`` of ``h``'s dtype,
    device and shape with unit-stride rows whose pitch is a multiple of 8 at a 16-byte aligned offset, and a
    contiguous ``(H,)`` ``norm_weight`` of ``h``'s dtype and device, 16-byte aligned (add_rms_norm_moe_router_route's
    contract, so the op never raises on a call it takes)."""
    applies = getattr(experts, "router_route_applies", None)
    if applies is None or residual is None or not applies(h, router_weight, logits_dtype):
        return False
    hidden = h.shape[1]
    if hidden > NORM_DECODE_MAX_K or residual.dtype != h.dtype or residual.device != h.device:
        return False
    if (tuple(residual.shape) != tuple(h.shape) or residual.stride(1) != 1
            or (residual.shape[0] > 1 and residual.stride(0) % 8 != 0)
            or residual.storage_offset() * residual.element_size() % 16 != 0):
        return False
    return (norm_weight.dtype == h.dtype and norm_weight.device == h.device
            and tuple(norm_weight.shape) == (hidden,) and norm_weight.is_contiguous()
            and norm_weight.storage_offset() * norm_weight.element_size() % 16 == 0)


def add_norm_route(experts, router_weight: torch.Tensor, h: torch.Tensor, residual: torch.Tensor,
                   norm_weight: torch.Tensor, eps: float, logits_dtype: Optional[torch.dtype] = None):
    """``(y, residual_out, topk_weights, topk_ids)``: `cutlass_w8a8.ops.moe.add_rms_norm_moe_router_route` with the
    routing of ``experts`` (a `cutlass_w8a8.W8A8MoE`: its ``top_k``, ``scoring``, ``correction_bias``, ``n_group``,
    ``topk_group``, ``renormalize``, ``scaling_factor``; logits in ``logits_dtype``, None: the model dtype, as
    ``route_from_hidden``), bit for bit ``fused_add_rms_norm`` on a copy of ``residual`` then
    ``experts.route_from_hidden(y, router_weight, logits_dtype)`` where `add_norm_route_applies`."""
    return add_rms_norm_moe_router_route(
        h, residual, norm_weight, eps, router_weight, experts.top_k, scoring=experts.scoring,
        correction_bias=experts.correction_bias, n_group=experts.n_group, topk_group=experts.topk_group,
        renormalize=experts.renormalize, scaling_factor=experts.scaling_factor, logits_dtype=logits_dtype)
