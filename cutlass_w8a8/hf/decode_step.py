"""`DecodeStep`: the decode step of an `optimize_`d transformers model run with the package's own decoder-layer code
(`cutlass_w8a8.models.layers.LlamaDecoderLayer`) over the model's own modules, the step `GraphGenerator` captures
with ``step="cw"``.

Why: replayed from a CUDA graph, transformers' decode step still launches its rotary embedding (a handful of
element-wise kernels per layer), the cache's ``index_copy_``, ``scaled_dot_product_attention`` over every cache
column with a mask, and the residual adds and casts as separate kernels. On an H100 at Llama-3-8B dims
(bench/results/hf_decode_*) that step took 5.08 ms/token against 3.58 for the package's own decoder on the same
kernels for the projections. This step launches what the package's decoder launches: per layer the RMSNorm fused
with the residual add and the activation quantization, the fused qkv GEMM, one kernel for rotary + the KV write
(`cutlass_w8a8.rope_kv_cache_`), split-KV decode attention reading only each row's written positions with
``o_proj``'s quantization in its last kernel (`cutlass_w8a8.decode_attention_quant`), the ``o_proj`` GEMM, the
fused norm, the gate_up GEMM, ``silu_mul_quant`` and the down GEMM; for per-token / per-tensor W8A8 projections
without bias all of it in one op call (``torch.ops.cutlass_w8a8.decode_layer``).

What is shared with the transformers model (no weight is copied): the token embedding, every `W8A8Linear`
(``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``), the norm weights (input, post-attention, Qwen3's
per-head q / k norms, the final norm) and ``lm_head``. What it owns: a KV cache per layer, ``(slots, 2, KVH, S, D)``
in the model dtype (the layout `cutlass_w8a8.decode_attention` reads), and the rotary table ``(S, R / 2, 2)``
float32 made by the model's own ``rotary_emb`` at positions ``0 .. S - 1`` (so Llama 3 / YaRN / linear rope scaling
and ``attention_scaling`` are the model's), ``R`` the rotary width that embedding produces (its ``cos``'s last
dimension): ``D``, or ``D * partial_rotary_factor`` for GLM-4.5, whose transformers attention rotates the first ``R``
features of each head and passes the rest (`cutlass_w8a8.rope_kv_cache_` takes the ``(B, R / 2, 2)`` rows).

Numerics against transformers' eager step on the same prefix: the same GEMMs on the same quantized activations
up to bf16 rounding differences elsewhere: the rotary embedding is computed in float32 and rounded once
(transformers rounds ``cos`` / ``sin`` to the model dtype and each product), the residual add is fused into the
norm, attention is split-KV with a float32 online softmax instead of SDPA's kernel. Logits differ by bf16 noise
(the tests bound it and compare greedy tokens allowing only near-ties; tests/hf/test_hf_decode_step_cpu.py).

Left padding: transformers' prefill leaves a left-padded row's prompt at cache columns ``pad .. L - 1``.
`DecodeStep.load_prefill` moves each row's keys and values to columns ``0 .. L - pad - 1``, so that column = the
token's position (``position_ids = cumsum(attention_mask) - 1``) and the decode attention of a row reads its
columns ``0 .. position``, none of the padding.

Mixture-of-experts layers (`MOE_FAMILIES`: Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE, GLM-4.5; each with a
`MoeBlockForward` record of its block's forward): the attention side as above; the MLP is `MoeMLP` over the block's
own modules: the post-attention norm fused with the residual add gives the normed hidden state in the model dtype
(`W8A8MoE` quantizes its own input, per routed pair), the router's logits ``F.linear(x, gate.weight)`` in the
model dtype, or ``F.linear(x.float(), gate.weight.float())`` for a ``"float32"`` record (GLM-4.5's router), as
transformers' routers compute them, the routing by
`cutlass_w8a8.moe_route` with the routing `W8A8MoE` holds (read from the router by `quantize_`: ``W8A8MoE.route``;
`why_not` checks it against the router, `cutlass_w8a8.moe.families.read_routing`), the experts
``W8A8MoE(x, topk_ids, topk_weights)``, plus the block's shared expert (its own SwiGLU module of `W8A8Linear` layers,
fused by `optimize_`: Qwen2-MoE's times ``sigmoid(shared_expert_gate(x))``, GLM-4.5's as it is). Numerics against transformers' block: the same
experts on the same quantized activations; the routing weights stay float32 (transformers' Qwen routers round them
to the model dtype), and a near-tie of a router can pick another expert than transformers' on hidden states that
differ by bf16 noise (the tests treat it as a token near-tie: tests/_hf_tiny.py's ``routing_flip``).

Supported (`DecodeStep.why_not`): decoder-only models whose decoder layers are all ones `optimize_` fused
(Llama, Mistral without a sliding window, Qwen2, Qwen3; the attention side of Qwen3-MoE, Mixtral, Qwen2-MoE and
GLM-4.5 / 4.6, partial rotary included):
fused ``qkv_proj`` `W8A8Linear` (any granularity, a bias allowed), a SiLU ``gate_up_proj`` MLP or a sparse-MoE block
of `MOE_FAMILIES` with `W8A8MoE` experts (its router and shared experts as its record says), RMSNorms, a softmax
scale of ``head_dim ** -0.5``, ``head_dim`` a multiple of 8 up to 256, an even rotary width ``R <= head_dim``, all
on one device in bfloat16 / float16. Not: multi-head latent attention (DeepSeek-V2 / V3, ...),
OLMoE's attention (q / k norms over all heads at once: `optimize_` does not fuse it), other attention layers
`optimize_` does not fuse, the MoE blocks of other families; their models keep transformers' step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..linear import W8A8Linear
from ..models.config import LlamaConfig
from ..models.layers import LlamaDecoderLayer, RMSNorm, StepContext
from ..models.moe import add_norm_route, add_norm_route_applies
from ..moe.families import family_of, read_routing
from ..moe.layer import W8A8MoE
from .optimize import SUPPORTED_LAYERS, FusedGateUpMLP, FusedQKVAttention

__all__ = ["DecodeStep", "MoeMLP", "MoeBlockForward", "MOE_FAMILIES"]

@dataclasses.dataclass(frozen=True)
class MoeBlockForward:
    """How a family's transformers sparse-MoE block computes its forward around the routing and the routed experts
    (what `MoeMLP` reproduces; the routing itself is the `cutlass_w8a8.moe.families` row's, which `W8A8MoE.route`
    applies).

    Attributes
    ----------
    router_logits : str
        ``"input"``: the router's logits are ``F.linear(x, weight)`` in the dtype of the block's input (Qwen /
        Mixtral / OLMoE routers, whose weight is in the model dtype); ``"float32"``: ``F.linear(x.float(),
        weight.float())`` (GLM-4.5's ``Glm4MoeTopkRouter``, whose weight transformers keeps in float32).

    The shared experts are the row's (`cutlass_w8a8.moe.families.SharedExperts`, their one owner): with a gate
    (Qwen2-MoE) their output times ``sigmoid(gate(x))`` is added to the routed experts', without (GLM-4.5) as it is.
    """

    router_logits: str

    def __post_init__(self):
        if self.router_logits not in ("input", "float32"):
            raise ValueError(f"MoeBlockForward: `router_logits` must be 'input' or 'float32', got "
                             f"{self.router_logits!r}")

    @property
    def logits_dtype(self) -> Optional[torch.dtype]:
        """The dtype of the router's logits for `W8A8MoE.route_from_hidden`: None (the input's) or float32."""
        return torch.float32 if self.router_logits == "float32" else None


#: The `cutlass_w8a8.moe.families` rows (by name) whose sparse-MoE block forward `MoeMLP` reproduces, each with how
#: the block computes around its routing (`MoeBlockForward`): a router of one ``weight`` ``[E, H]`` without bias
#: whose logits are computed as the record says, the row's routing (`W8A8MoE.route`: softmax top-k; GLM-4.5's
#: sigmoid + correction bias + groups + renormalize + ``routed_scaling_factor``), the experts called with the top-k
#: ids and weights, plus the row's shared experts (times the sigmoid of their gate where the row has one). Other rows' blocks compute otherwise
#: (DeepSeek-V3's attention is MLA; Laguna's logits are soft-capped, its block scales its output) or are untested
#: here: not served (`DecodeStep.why_not` names the row).
MOE_FAMILIES = {
    "Qwen2-MoE": MoeBlockForward(router_logits="input"),
    "Qwen3-MoE": MoeBlockForward(router_logits="input"),
    "Mixtral": MoeBlockForward(router_logits="input"),
    "OLMoE": MoeBlockForward(router_logits="input"),
    "GLM-4.5": MoeBlockForward(router_logits="float32"),
}


def _decoder(model: nn.Module):
    """transformers' base model under a causal LM (``model.model``), or None."""
    base = getattr(model, "model", None)
    return base if isinstance(base, nn.Module) else None


def _norm_eps(norm) -> Optional[float]:
    """The epsilon of an RMSNorm module (ours, transformers' or `RMSNormQuant`), or None for another module."""
    eps = getattr(norm, "variance_epsilon", None)
    w = getattr(norm, "weight", None)
    if isinstance(eps, float) and isinstance(w, torch.Tensor) and w.dim() == 1:
        return eps
    return None


def _our_norm(norm: nn.Module) -> RMSNorm:
    """Our `RMSNorm` holding ``norm``'s own weight Parameter (shared, not copied)."""
    w = norm.weight
    with torch.device("meta"):
        out = RMSNorm(w.shape[0], float(norm.variance_epsilon), dtype=w.dtype)
    out.weight = w if isinstance(w, nn.Parameter) else nn.Parameter(w, requires_grad=False)
    return out


class MoeRouter(nn.Module):
    """The routing of a `MoeMLP`: ``forward(x)`` with ``x`` ``(T, H)`` in the model dtype returns
    ``(router_logits (T, E), topk_weights float32 (T, k), topk_ids int32 (T, k))``, transformers 5 routers' triple:
    logits `logits` (``F.linear(x, weight)`` in ``x``'s dtype, or in float32 for a ``logits_dtype`` float32 router),
    then ``experts.route`` (`cutlass_w8a8.moe_route` with the experts' routing). ``weight``: the transformers
    router's own Parameter (shared)."""

    def __init__(self, weight: torch.Tensor, experts: W8A8MoE, logits_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.logits_dtype = logits_dtype
        self._route = experts.route  # a bound method, not a second registration of the experts module

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The router logits ``(T, E)`` of ``x`` ``(T, H)``, as the transformers router computes them."""
        if self.logits_dtype is None:
            return F.linear(x, self.weight)
        return F.linear(x.to(self.logits_dtype), self.weight.to(self.logits_dtype))

    def forward(self, x: torch.Tensor):
        logits = self.logits(x)
        topk_weights, topk_ids = self._route(logits)
        return logits, topk_weights, topk_ids


class MoeMLP(nn.Module):
    """The MLP of a `DecodeStep` layer whose transformers ``mlp`` is a sparse-MoE block of `MOE_FAMILIES`, over the
    block's own modules (nothing copied), computing the block's forward as its `MoeBlockForward` record says.

    ``forward(x)``: ``x`` ``(T, H)`` in the model dtype (the post-attention norm's float output) -> ``(T, H)``:
    ``experts(x, ids, weights)`` with ``(_, weights, ids) = gate(x)`` (`MoeRouter`), or where
    ``experts.router_route_applies`` (CUDA, T <= 16, a router weight in the model dtype)
    ``(weights, ids) = experts.route_from_hidden(x, gate.weight, logits_dtype)`` (the same routing as one
    ``moe_router_route`` kernel), plus ``shared_expert(x)`` (``"gated"``: times ``sigmoid(shared_expert_gate(x))``;
    ``"plain"``: as it is).

    Attributes
    ----------
    forward_spec : MoeBlockForward
        The family's record in `MOE_FAMILIES`.
    gate : MoeRouter
    experts : W8A8MoE
        The block's experts module.
    shared_expert : nn.Module or None
        The block's shared expert(s) module (Qwen2-MoE's ``shared_expert``, GLM-4.5's ``shared_experts``; a fused
        gate_up MLP after `optimize_`), called as transformers calls it.
    shared_expert_gate : nn.Module or None
        Its gate (an ``nn.Linear`` of N = 1, left in float by `quantize_`), for a ``"gated"`` record.
    """

    def __init__(self, block: nn.Module):
        super().__init__()
        fam = family_of(block)
        self.forward_spec = MOE_FAMILIES[fam.name]
        self.experts = getattr(block, fam.layout.module)
        if fam.routing.correction_bias is not None:  # the experts route with the router's current bias (a device
            # move after quantize_ ends the two tensors' sharing: W8A8MoE.tie_correction_bias)
            bias = read_routing(block, fam, type(block).__name__).correction_bias
            if bias is not None:
                self.experts.tie_correction_bias(bias)
        self.gate = MoeRouter(getattr(block, fam.routing.router).weight, self.experts,
                              self.forward_spec.logits_dtype)
        shared = fam.shared_experts
        self.shared_expert = getattr(block, shared.module) if shared is not None else None
        self.shared_expert_gate = (getattr(block, shared.gate) if shared is not None and shared.gate is not None
                                   else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the router GEMM and the routing: one kernel (moe_router_route) at decode sizes on CUDA, else `gate`'s two
        # ops; both compute the logits in the dtype the family's router computes them in (MoeBlockForward)
        logits_dtype = self.gate.logits_dtype
        if self.experts.router_route_applies(x, self.gate.weight, logits_dtype):
            topk_weights, topk_ids = self.experts.route_from_hidden(x, self.gate.weight, logits_dtype)
        else:
            _, topk_weights, topk_ids = self.gate(x)
        return self._experts_and_shared(x, topk_ids, topk_weights)

    def add_norm_route_applies(self, h: torch.Tensor, residual: Optional[torch.Tensor],
                               norm_weight: torch.Tensor) -> bool:
        """Whether `forward_add_norm` can take the post-attention norm's inputs (models/moe.py
        `add_norm_route_applies` of the experts, the router weight and the record's logits dtype)."""
        return add_norm_route_applies(self.experts, self.gate.weight, h, residual, norm_weight,
                                      self.gate.logits_dtype)

    def forward_add_norm(self, h: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The post-attention norm folded into the router kernel (models/moe.py `add_norm_route`), then the experts
        and the shared expert as `forward` on y: ``(out, residual_out)``, ``residual`` not written."""
        # the logits in the dtype the family's router computes them in (GLM-4.5: float32), as `forward`
        y, residual_out, topk_weights, topk_ids = add_norm_route(self.experts, self.gate.weight, h, residual,
                                                                 norm_weight, eps, self.gate.logits_dtype)
        return self._experts_and_shared(y, topk_ids, topk_weights), residual_out

    def _experts_and_shared(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        out = self.experts(x, topk_ids, topk_weights)
        if self.shared_expert is not None:
            s = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                s = torch.sigmoid(self.shared_expert_gate(x)) * s
            out = out + s
        return out


def _why_not_moe(block: nn.Module, where: str) -> Optional[str]:
    """None when `MoeMLP` runs ``block`` (a decoder layer's ``mlp``) as its transformers forward does; else why."""
    fam = family_of(block)
    if fam is None:
        return (f"`{where}` ({type(block).__name__}) is neither a fused SiLU gate_up MLP with a "
                                   "W8A8 down_proj (run cutlass_w8a8.optimize_ on a W8A8 model first) nor a "
                                   "sparse-MoE block of a cutlass_w8a8.moe.families row")
    spec = MOE_FAMILIES.get(fam.name)
    if spec is None:
        return (f"`{where}` is a {fam.name} block ({type(block).__name__}), whose forward DecodeStep does not "
                f"run (it runs the blocks of {', '.join(MOE_FAMILIES)})")
    shared = fam.shared_experts  # the row's: DecodeStep adds them (times the sigmoid of the row's gate)
    if shared is not None:
        if not isinstance(getattr(block, shared.module, None), nn.Module):
            return (f"`{where}` ({type(block).__name__}) has no shared experts module `{shared.module}`, which its "
                    f"{fam.name} block forward adds")
        if shared.gate is not None and not isinstance(getattr(block, shared.gate, None), nn.Module):
            return (f"`{where}` ({type(block).__name__}) has no shared experts gate `{shared.gate}`, which its "
                    f"{fam.name} block forward applies")
    experts = getattr(block, fam.layout.module, None)
    if not isinstance(experts, W8A8MoE):
        return (f"`{where}.{fam.layout.module}` ({type(experts).__name__}) is not a W8A8MoE (quantize the model "
                "with cutlass_w8a8.quantize_ first; a routing moe_route does not compute leaves it in float)")
    router = getattr(block, fam.routing.router, None)
    w = getattr(router, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or tuple(w.shape) != (experts.num_experts,
                                                                             experts.hidden_size):
        return (f"`{where}.{fam.routing.router}` has no router weight [E, H] = [{experts.num_experts}, "
                f"{experts.hidden_size}]")
    if getattr(router, "bias", None) is not None:
        return f"`{where}.{fam.routing.router}` has a bias"
    if spec.router_logits == "input" and w.dtype != experts.dtype:
        return (f"`{where}.{fam.routing.router}.weight` is {w.dtype}; its {fam.name} router computes its logits in "
                f"the dtype of its input ({experts.dtype}), which DecodeStep's MoeRouter reproduces only for a weight "
                "of that dtype")
    try:
        args = read_routing(block, fam, where)
    except ValueError as e:
        return str(e)
    why = args.unserved()
    if why is not None:
        return f"`{where}`: {why}"
    held = {"top_k": experts.top_k, "renormalize": experts.renormalize, **{
        k: getattr(experts, k) for k in ("scoring", "n_group", "topk_group", "scaling_factor")}}
    want = {"top_k": args.top_k, "renormalize": args.renormalize, **{
        k: v for k, v in args.layer_kwargs().items() if k != "correction_bias"}}
    for k, v in want.items():
        if held[k] != v:
            return (f"`{where}.{fam.layout.module}` routes with {k} = {held[k]!r}, its router with {v!r} (the "
                    "router changed after quantize_)")
    if (args.correction_bias is None) != (experts.correction_bias is None):
        return f"`{where}`: the router's correction bias and the experts' disagree (one of them has none)"
    return None


def _is_mla(attn) -> bool:
    """Multi-head latent attention (DeepSeek-V2 / V3 and the models with their attention): low-rank q / kv."""
    return any(hasattr(attn, n) for n in ("kv_a_proj_with_mqa", "kv_lora_rank", "q_lora_rank"))


def _rotary_cos_sin(rotary_emb: nn.Module, positions: int, device) -> tuple:
    """The model's rotary embedding at positions ``0 .. positions - 1``: ``(cos, sin)``, each ``(1, positions, R)``
    float32, ``R`` the rotary width (``head_dim``, or ``head_dim * partial_rotary_factor`` for GLM-4.5, whose
    transformers ``apply_rotary_pos_emb`` rotates the first ``R`` features of each head and passes the rest). The
    one reader of ``R``: what the model's own rotary embedding produces."""
    pos = torch.arange(positions, device=device)[None]
    probe = torch.zeros((), dtype=torch.float32, device=device)
    with torch.no_grad():
        return rotary_emb(probe, pos)


class DecodeStep:
    """One decode step of an `optimize_`d transformers causal LM, through the package's decoder-layer code.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        An `optimize_`d causal LM that `why_not` accepts, in eval mode.
    max_cache_len : int
        Cache positions ``S`` (and rows of the rotary table); positions must stay below it.

    Attributes
    ----------
    slots : int
        Cache slots allocated so far (`allocate`); 0 before.
    max_cache_len : int
    rope_table : torch.Tensor
        ``(S, R / 2, 2)`` float32 ``(cos, sin)`` from the model's ``rotary_emb``, ``R`` its rotary width.
    rotary_dim : int
        ``R``: ``head_dim``, or less for a partial rotary embedding (GLM-4.5: ``head_dim * partial_rotary_factor``;
        the features from ``R`` on pass through unrotated).

    Raises
    ------
    ValueError
        `why_not` names a reason (the message is ``"DecodeStep: " + reason``).
    """

    def __init__(self, model: nn.Module, max_cache_len: int):
        why = self.why_not(model)
        if why is not None:
            raise ValueError(f"DecodeStep: {why}")
        base = _decoder(model)
        cfg = model.config
        first = base.layers[0].self_attn
        head_dim = int(first.head_dim)
        num_heads = int(cfg.num_attention_heads)
        num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or num_heads)
        self.model = model
        self.max_cache_len = int(max_cache_len)
        self.dtype = base.embed_tokens.weight.dtype
        self.device = base.embed_tokens.weight.device
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        # our layer modules, built on the meta device and then given the model's own modules and weights
        ours_cfg = LlamaConfig(vocab_size=int(cfg.vocab_size), hidden_size=int(cfg.hidden_size),
                               intermediate_size=1, num_layers=len(base.layers), num_heads=num_heads,
                               num_kv_heads=num_kv_heads, head_dim=head_dim,
                               rms_norm_eps=_norm_eps(base.norm), max_position=self.max_cache_len,
                               qk_norm=isinstance(getattr(first, "q_norm", None), nn.Module))
        self.layers = []
        for hf in base.layers:
            with torch.device("meta"):
                layer = LlamaDecoderLayer(ours_cfg, dtype=self.dtype)
            layer.input_layernorm = _our_norm(hf.input_layernorm)
            layer.post_attention_layernorm = _our_norm(hf.post_attention_layernorm)
            attn, hf_attn = layer.self_attn, hf.self_attn
            attn.qkv_proj, attn.o_proj = hf_attn.qkv_proj, hf_attn.o_proj
            if ours_cfg.qk_norm:
                attn.q_norm, attn.k_norm = _our_norm(hf_attn.q_norm), _our_norm(hf_attn.k_norm)
            if isinstance(hf.mlp, FusedGateUpMLP):
                layer.mlp.gate_up_proj, layer.mlp.down_proj = hf.mlp.gate_up_proj, hf.mlp.down_proj
            else:  # a sparse-MoE block of MOE_FAMILIES (why_not)
                layer.mlp = MoeMLP(hf.mlp)
            attn.kv_cache = None
            self.layers.append(layer)
        self.embed_tokens = base.embed_tokens
        self.norm = _our_norm(base.norm)
        self.lm_head = model.lm_head
        self.rope_table = self._rope_table(base.rotary_emb)
        self.rotary_dim = 2 * self.rope_table.shape[1]
        if self.rotary_dim != head_dim:
            # partial rotary (GLM-4.5): rope_kv_cache_ takes the (B, R / 2, 2) table; the one-op layer
            # (decode_layer) is left to the Python path, which calls rope_kv_cache_ itself
            for layer in self.layers:
                layer.use_layer_op = False
        self.slots = 0

    # ---- what is supported ------------------------------------------------------------------------------

    @staticmethod
    def why_not(model: nn.Module) -> Optional[str]:
        """None when `DecodeStep` can run ``model``; else the reason, naming the module or setting."""
        cfg = getattr(model, "config", None)
        base = _decoder(model)
        if cfg is None or base is None or getattr(cfg, "is_encoder_decoder", False):
            return "`model` is not a transformers decoder-only causal LM (no `model.model`)"
        for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
            if not isinstance(getattr(base, name, None), nn.Module):
                return f"`model.model` has no `{name}` module"
        if not isinstance(getattr(model, "lm_head", None), nn.Module):
            return "`model` has no `lm_head` module"
        rope_type = getattr(base.rotary_emb, "rope_type", "default")
        if rope_type in ("dynamic", "longrope"):
            return (f"`model.model.rotary_emb` is {rope_type!r} rope, whose frequencies change with the sequence "
                    "length (the step's rotary table is made once)")
        if _norm_eps(base.norm) is None:
            return f"`model.model.norm` ({type(base.norm).__name__}) is not an RMSNorm"
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            return f"the model has sliding-window attention (config.sliding_window = {cfg.sliding_window})"
        dtype = base.embed_tokens.weight.dtype
        if dtype not in (torch.bfloat16, torch.float16):
            return f"the model dtype is {dtype}, not bfloat16 / float16"
        device = base.embed_tokens.weight.device
        if len(base.layers) == 0:
            return "the model has no decoder layers"
        eps = None
        for i, layer in enumerate(base.layers):
            where = f"model.model.layers.{i}"
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if not isinstance(attn, FusedQKVAttention):
                if _is_mla(attn):
                    return (f"`{where}.self_attn` ({type(attn).__name__}) is multi-head latent attention (MLA), "
                            "which DecodeStep does not run: the model keeps transformers' step")
                if type(layer).__name__ not in SUPPORTED_LAYERS:
                    return (f"`{where}` ({type(layer).__name__}) is not a decoder layer cutlass_w8a8.optimize_ fuses "
                            f"(SUPPORTED_LAYERS), so its self_attn ({type(attn).__name__}) is not fused: the model "
                            "keeps transformers' step")
                return (f"`{where}.self_attn` ({type(attn).__name__}) is not fused: run cutlass_w8a8.optimize_ "
                        "on a W8A8 model first")
            if isinstance(mlp, FusedGateUpMLP):
                if not mlp._cw_silu_quant:
                    return (f"`{where}.mlp` ({type(mlp).__name__}) is not a fused SiLU gate_up MLP with a W8A8 "
                            "down_proj")
                mlp_device = mlp.gate_up_proj.weight.device
            else:
                why = _why_not_moe(mlp, f"{where}.mlp")
                if why is not None:
                    return why
                mlp_device = getattr(mlp, family_of(mlp).layout.module).w13.device
            if getattr(attn, "sliding_window", None):
                return f"`{where}.self_attn` has a sliding window"
            d = int(attn.head_dim)
            if d % 8 or not 8 <= d <= 256:
                return f"`{where}.self_attn.head_dim` is {d}; the decode attention needs a multiple of 8 in [8, 256]"
            if not math.isclose(float(attn.scaling), d ** -0.5, rel_tol=1e-6):
                return f"`{where}.self_attn.scaling` is {attn.scaling}, not head_dim ** -0.5"
            for n in ("input_layernorm", "post_attention_layernorm"):
                e = _norm_eps(getattr(layer, n, None))
                if e is None:
                    return f"`{where}.{n}` is not an RMSNorm"
                if eps is not None and e != eps:
                    return f"`{where}.{n}` has epsilon {e}, other norms {eps}"
                eps = e
            if mlp_device != device:
                return f"`{where}` is on {mlp_device}, the embedding on {device}"
        try:
            cos, sin = _rotary_cos_sin(base.rotary_emb, 1, device)
        except Exception as e:  # noqa: BLE001 -- a rotary module of another signature: named, not raised
            return (f"`model.model.rotary_emb` ({type(base.rotary_emb).__name__}) cannot be called as "
                    f"rotary_emb(x, position_ids) -> (cos, sin): {type(e).__name__}: {e}")
        if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor) and cos.dim() == 3
                and cos.shape == sin.shape and cos.shape[:2] == (1, 1)):
            return (f"`model.model.rotary_emb` ({type(base.rotary_emb).__name__}) does not return (cos, sin) of "
                    "shape (1, positions, R)")
        r = int(cos.shape[-1])
        for i, layer in enumerate(base.layers):
            d = int(layer.self_attn.head_dim)
            if r % 2 or not 2 <= r <= d:
                return (f"`model.model.rotary_emb` gives a rotary width of {r} for `model.model.layers.{i}."
                        f"self_attn.head_dim` {d}; the step rotates an even width R in [2, head_dim] of each head")
        return None

    # ---- cache ------------------------------------------------------------------------------------------

    def _rope_table(self, rotary_emb: nn.Module) -> torch.Tensor:
        """``(S, R / 2, 2)`` float32: the model's rotary ``(cos, sin)`` at positions ``0 .. S - 1`` (its
        ``attention_scaling`` included), of the first half of the rotary width ``R`` (transformers' layout repeats
        it; `_rotary_cos_sin`)."""
        cos, sin = _rotary_cos_sin(rotary_emb, self.max_cache_len, self.device)
        half = cos.shape[-1] // 2
        return torch.stack((cos[0, :, :half].float(), sin[0, :, :half].float()), dim=-1).contiguous()

    def allocate(self, slots: int) -> bool:
        """Allocate (zeroed) caches of ``slots`` sequences for every layer, unless at least that many are already
        allocated. Returns True when it allocated (buffers captured before are then stale)."""
        if slots <= self.slots:
            return False
        for layer in self.layers:
            layer.self_attn.kv_cache = None
        for layer in self.layers:
            layer.self_attn.kv_cache = torch.zeros(slots, 2, self.num_kv_heads, self.max_cache_len, self.head_dim,
                                                   dtype=self.dtype, device=self.device)
        self.slots = slots
        return True

    def load_prefill(self, cache, pads: Optional[torch.Tensor], length: int) -> None:
        """Copy the keys and values transformers' prefill wrote into ``cache`` (a ``DynamicCache``; each layer's
        ``keys`` / ``values`` ``(b, KVH, L, D)``) into slots ``0 .. b - 1``, row ``r`` shifted left by ``pads[r]``
        columns (``pads``: ``(b,)`` int64 on the device, the left padding of each row; None: no padding)."""
        for i, layer in enumerate(self.layers):
            kv = layer.self_attn.kv_cache
            cl = cache.layers[i]
            k, v = cl.keys, cl.values
            b = k.shape[0]
            if pads is not None:
                idx = (torch.arange(length, device=k.device)[None, :] + pads[:, None]).clamp_(max=length - 1)
                idx = idx[:, None, :, None].expand(b, k.shape[1], length, k.shape[3])
                k, v = k.gather(2, idx), v.gather(2, idx)
            kv[:b, 0, :, :length].copy_(k)
            kv[:b, 1, :, :length].copy_(v)

    # ---- the step ---------------------------------------------------------------------------------------

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One decode step: ``tokens``, ``positions``, ``slots`` ``(b,)`` int64 on the model's device (each row's
        token, its position = the cache column it is written to, its cache slot) -> logits ``(b, V)`` in the
        model dtype. Row ``r`` attends to columns ``0 .. positions[r]`` of its slot."""
        ctx = StepContext(self.rope_table.index_select(0, positions), slots, positions)
        h, residual = self.embed_tokens(tokens), None
        for layer in self.layers:
            h, residual = layer(h, ctx, residual)
        return self.lm_head(self.norm(h, residual, quant_for=self.lm_head))
