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
in the model dtype (the layout `cutlass_w8a8.decode_attention` reads), and the rotary table ``(S, D / 2, 2)``
float32 made by the model's own ``rotary_emb`` at positions ``0 .. S - 1`` (so Llama 3 / YaRN / linear rope scaling
and ``attention_scaling`` are the model's).

Numerics against transformers' eager step on the same prefix: the same GEMMs on the same quantized activations
up to bf16 rounding differences elsewhere: the rotary embedding is computed in float32 and rounded once
(transformers rounds ``cos`` / ``sin`` to the model dtype and each product), the residual add is fused into the
norm, attention is split-KV with a float32 online softmax instead of SDPA's kernel. Logits differ by bf16 noise
(the tests bound it and compare greedy tokens allowing only near-ties; tests/hf/test_hf_decode_step_cpu.py).

Left padding: transformers' prefill leaves a left-padded row's prompt at cache columns ``pad .. L - 1``.
`DecodeStep.load_prefill` moves each row's keys and values to columns ``0 .. L - pad - 1``, so that column = the
token's position (``position_ids = cumsum(attention_mask) - 1``) and the decode attention of a row reads its
columns ``0 .. position``, none of the padding.

Supported (`DecodeStep.why_not`): decoder-only models whose decoder layers are all ones `optimize_` fused
(Llama, Mistral without a sliding window, Qwen2, Qwen3): fused ``qkv_proj`` `W8A8Linear` (any granularity, a bias
allowed), a SiLU ``gate_up_proj`` MLP, RMSNorms, a softmax scale of ``head_dim ** -0.5``, ``head_dim`` a multiple of
8 up to 256, all on one device in bfloat16 / float16. Mixture-of-experts layers (Qwen3-MoE, Mixtral) are not: their
models keep transformers' step.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..models.config import LlamaConfig
from ..models.layers import LlamaDecoderLayer, RMSNorm, StepContext
from .optimize import FusedGateUpMLP, FusedQKVAttention

__all__ = ["DecodeStep"]


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
        ``(S, D / 2, 2)`` float32 ``(cos, sin)`` from the model's ``rotary_emb``.

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
            layer.mlp.gate_up_proj, layer.mlp.down_proj = hf.mlp.gate_up_proj, hf.mlp.down_proj
            attn.kv_cache = None
            self.layers.append(layer)
        self.embed_tokens = base.embed_tokens
        self.norm = _our_norm(base.norm)
        self.lm_head = model.lm_head
        self.rope_table = self._rope_table(base.rotary_emb, head_dim)
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
                return (f"`{where}.self_attn` ({type(attn).__name__}) is not fused: run cutlass_w8a8.optimize_ "
                        "on a W8A8 model first")
            if not isinstance(mlp, FusedGateUpMLP) or not mlp._cw_silu_quant:
                return (f"`{where}.mlp` ({type(mlp).__name__}) is not a fused SiLU gate_up MLP with a W8A8 "
                        "down_proj (mixture-of-experts layers keep transformers' step)")
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
            if layer.mlp.gate_up_proj.weight.device != device:
                return f"`{where}` is on {layer.mlp.gate_up_proj.weight.device}, the embedding on {device}"
        return None

    # ---- cache ------------------------------------------------------------------------------------------

    def _rope_table(self, rotary_emb: nn.Module, head_dim: int) -> torch.Tensor:
        """``(S, D / 2, 2)`` float32: the model's rotary ``(cos, sin)`` at positions ``0 .. S - 1`` (its
        ``attention_scaling`` included), of the first half of ``D`` (transformers' layout repeats it)."""
        pos = torch.arange(self.max_cache_len, device=self.device)[None]
        probe = torch.zeros((), dtype=torch.float32, device=self.device)
        with torch.no_grad():
            cos, sin = rotary_emb(probe, pos)
        half = head_dim // 2
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
