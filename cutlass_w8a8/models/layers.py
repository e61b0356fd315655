"""The decoder-layer modules of `cutlass_w8a8.models.LlamaDecoder`, public so that other decode steps can run the same
code over other weights (`cutlass_w8a8.hf.DecodeStep` runs them over an `optimize_`d transformers model's own
modules): `StepContext` (what the layers of one step share), `RMSNorm` (fused residual add and activation
quantization), `LlamaAttention` (rotary + KV write in one op, split-KV decode attention), `LlamaMLP` (SwiGLU with
the fused SiLU*mul quantization) and `LlamaDecoderLayer` (one op call, ``decode_layer``, when its projections
allow). Layout, fusions and numerics: `cutlass_w8a8.models.llama`'s docstring.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..linear import QuantizedActivation, W8A8Linear
from ..ops._limits import DECODE_MAX_M, NORM_DECODE_MAX_K
from .config import LlamaConfig
from .moe import SparseMoeBlock

__all__ = ["StepContext", "RMSNorm", "LlamaAttention", "LlamaMLP", "LlamaDecoderLayer", "fused_norm_qkv",
           "fused_norm_router"]


# The decoder's fused-norm switches (environment variables, "0" / unset: off, "1": on), all read by `_switch`. Both
# fusions give the same results bit for bit and both measured slower on an H200 (48-layer Qwen3-MoE decoder, int8
# graph, batch 1: 2.694 ms with both off, 2.875 with the qkv one, 3.053 with both; batch 8: 6.831 / 7.987 / 8.378;
# bench/results/decoder_moe_fused_norms_nvidia-h200.md), so both are off by default.
FUSED_NORM_QKV_ENV = "CUTLASS_W8A8_FUSED_NORM_QKV"
FUSED_NORM_ROUTER_ENV = "CUTLASS_W8A8_FUSED_NORM_ROUTER"


def _switch(env: str) -> bool:
    """The on / off switch ``env``, read from the environment at each call (a dictionary lookup; tests set it with
    monkeypatch). Unset, empty or ``0``: off; ``1``: on; any other value raises ValueError naming the variable."""
    value = os.environ.get(env, "0")
    if value not in ("", "0", "1"):
        raise ValueError(f"{env} must be 0 or 1, got {value!r}")
    return value == "1"


def fused_norm_qkv() -> bool:
    """Whether `LlamaDecoderLayer`'s Python path runs its input norm and ``qkv_proj`` as one
    `cutlass_w8a8.ops.add_rms_norm_linear_decode` kernel where it can: the switch ``CUTLASS_W8A8_FUSED_NORM_QKV``
    (`_switch`; off by default: measured slower, see above). Both give the same results bit for bit (the op equals
    rms_norm_quant followed by the decode GEMM)."""
    return _switch(FUSED_NORM_QKV_ENV)


class StepContext(NamedTuple):
    """What every layer of one decode step shares; computed once per step from the positions and slots.

    - ``rope``: ``(B, R // 2, 2)`` float32, ``(cos, sin)`` of each sequence's position; ``R`` the rotary width,
      ``head_dim`` or less (a partial rotary embedding, GLM-4.5: ``rope_kv_cache_`` rotates the pairs
      ``(x[j], x[j + R/2])``, ``j < R/2``, of each q / k head and passes ``x[R:]`` through).
    - ``slots``: ``(B,)`` int64, the cache slots the batch writes (at its positions) and reads.
    - ``positions``: ``(B,)`` int64, each sequence's position: attention reads cache positions ``0..position``.
    """

    rope: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor


def _rope_(x: torch.Tensor, rope: torch.Tensor) -> None:
    """Rotate ``x`` in place: ``(B, N, D)`` heads (a view into the qkv output), ``rope`` ``(B, D/2, 2)`` float32.

    The decoder's rotary code before the row-wise op ``rope_kv_cache_`` replaced it; the step no longer calls
    it: tests keep it as the torch reference of that op (tests/ops/test_rope_kv_cache.py). Hugging Face's "neox" rotation of the pairs ``(x[j], x[j + D/2])`` by the angle of frequency ``j``,
    computed in float32 and rounded once to ``x``'s dtype. Eager code multiplies complex numbers (three
    kernels: gather the pairs as float32, one complex multiply, scatter back); under ``torch.compile`` the
    real-arithmetic form is used, which inductor fuses into one kernel (it has no complex codegen).
    """
    h = x.shape[-1] // 2
    if torch.compiler.is_compiling():
        xf = x.float()
        x1, x2 = xf[..., :h], xf[..., h:]
        cos, sin = rope[..., 0].unsqueeze(1), rope[..., 1].unsqueeze(1)
        x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
        return
    pairs = x.unflatten(-1, (2, h)).transpose(-1, -2)  # (B, N, D/2, 2): (x[j], x[j + D/2])
    xc = torch.view_as_complex(torch.empty(pairs.shape, dtype=torch.float32, device=x.device).copy_(pairs))
    pairs.copy_(torch.view_as_real(xc * torch.view_as_complex(rope).unsqueeze(1)))


# Activation dtypes of the fused non-GEMM ops (cutlass_w8a8.ops.rms_norm, silu_mul, ...); other dtypes (a
# float64 reference) take the equivalent torch chain.
_FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fused_norm_router() -> bool:
    """Whether the MoE layers' post-attention norm is folded into the router kernel
    (`SparseMoeBlock.forward_add_norm`, ``add_rms_norm_moe_router_route``): the switch
    ``CUTLASS_W8A8_FUSED_NORM_ROUTER`` (`_switch`; off by default: measured slower, see `FUSED_NORM_QKV_ENV`'s
    comment). Either way the logits are the same bit for bit."""
    return _switch(FUSED_NORM_ROUTER_ENV)


def _quantized_for(linear: W8A8Linear, q: torch.Tensor, scale: torch.Tensor) -> QuantizedActivation:
    # A static layer gets its own (1,) input_scale back (the op repeats it per row): the GEMM then runs
    # exactly as when the layer quantizes a float input itself.
    return QuantizedActivation(q, scale if linear.input_scale is None else linear.input_scale)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension (``F.rms_norm``: float32 inside,
    rounded once to the input dtype). ``weight``: ``(hidden,)``.

    ``forward(x, residual=None, quant_for=None)`` is one fused kernel (`cutlass_w8a8.ops.rms_norm`,
    ``rms_norm_quant``):

    - ``residual``: ``x``'s shape; first ``residual += x`` in place (vLLM's ``fused_add_rms_norm``), then the
      norm of the sum. That is how the decoder carries its residual stream.
    - ``quant_for``: the layer that consumes the output. A `W8A8Linear` gets a `QuantizedActivation` made in
      the same kernel (`cutlass_w8a8.ops.rms_norm_quant` with the layer's ``quant_dtype``, ``input_scale`` and
      ``group_size``: per token, per tensor, or per 1 x 128 group for a block-scaled layer), equal to what the
      layer would make from the float output; anything else (None, ``nn.Linear``, `DequantizedLinear`) gets the
      float output.
    """

    def __init__(self, hidden: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
                quant_for: Optional[nn.Module] = None) -> Union[torch.Tensor, QuantizedActivation]:
        if x.dtype not in _FUSED_DTYPES:
            if residual is not None:
                residual.add_(x)
                x = residual
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if isinstance(quant_for, W8A8Linear):
            q, s = torch.ops.cutlass_w8a8.rms_norm_quant(x, self.weight, self.eps, quant_for.quant_dtype,
                                                         quant_for.input_scale, residual, quant_for.group_size)
            return _quantized_for(quant_for, q, s)
        if residual is None:
            return torch.ops.cutlass_w8a8.rms_norm(x, self.weight, self.eps)
        return torch.ops.cutlass_w8a8.fused_add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    """Grouped-query attention of one decode token per sequence over the KV cache.

    Submodules: ``qkv_proj`` (hidden -> ``(H + 2 KVH) * D``, rows ordered q heads, k heads, v heads, as vLLM's
    ``QKVParallelLinear``) and ``o_proj`` (``H * D`` -> hidden), both without bias.

    With ``config.qk_norm`` (Qwen3), ``q_norm`` and ``k_norm`` (`RMSNorm` of ``(D,)``) normalize every query and key
    head of the ``qkv_proj`` output before the rotary embedding, inside the rotary op (``rope_kv_cache_`` given
    their weights and eps: no kernel of their own); otherwise they are None. Norms of another kind, or of two
    different eps, run as modules first (a norm kernel each and the copies of the heads back into ``qkv``).

    Buffer ``kv_cache``: ``(num_slots, 2, KVH, max_seq_len, D)`` in the model dtype (index 0 keys, 1 values),
    set by `LlamaDecoder.allocate_cache`. Query head ``h`` reads key/value head ``h // (H / KVH)``.

    Attention reads positions ``0..position`` of each row's own slot only (split-KV CUDA kernels on the GPU; on
    the CPU, ``index_select`` of the slots and a masked ``scaled_dot_product_attention``); ``head_dim`` must be
    a multiple of 8 in [8, 256]. A per-token or per-tensor `W8A8Linear` ``o_proj`` whose output dtype is the
    model's (bfloat16 / float16) gets a `QuantizedActivation` from `cutlass_w8a8.ops.decode_attention_quant` (its
    ``quant_dtype`` and ``input_scale``: quantized in the attention's last kernel, the very values the layer would
    make from `cutlass_w8a8.ops.decode_attention`'s output); any other ``o_proj`` (a block-scaled one included:
    there is no group-quantizing attention, so it quantizes the float output itself, per 1 x 128 group) gets that
    float output.
    """

    def __init__(self, config: LlamaConfig, device=None, dtype=None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, config.qkv_size, bias=False, device=device, dtype=dtype)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False,
                                device=device, dtype=dtype)
        # Qwen3's head norms (config.qk_norm): RMSNorm over head_dim of every query / key head, before the rotary
        # embedding; None for Llama
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, device, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, device, dtype) if config.qk_norm else None
        self.register_buffer("kv_cache", None, persistent=False)

    def _norm_heads_(self, qkv: torch.Tensor) -> None:
        """``q_norm`` / ``k_norm`` of the query and key heads of ``qkv`` ``(B, H + 2 KVH, D)``, in place."""
        h, kvh = self.num_heads, self.num_kv_heads
        for heads, norm in ((qkv[:, :h], self.q_norm), (qkv[:, h:h + kvh], self.k_norm)):
            heads.copy_(norm(heads))

    def _fused_head_norms(self, dtype: torch.dtype) -> tuple:
        """``(q_norm weight, k_norm weight, eps)`` for ``rope_kv_cache_`` to apply, or ``(None, None, -1.0)`` when
        the rotary op must not (no head norms: Llama) or cannot (norms that are not our `RMSNorm` in ``dtype``
        with one eps: they run as modules first, `_norm_heads_`)."""
        qn, kn = self.q_norm, self.k_norm
        if (qn is not None and type(qn) is RMSNorm and type(kn) is RMSNorm and qn.eps == kn.eps
                and dtype in _FUSED_DTYPES and qn.weight.dtype == dtype and kn.weight.dtype == dtype):
            return qn.weight, kn.weight, qn.eps
        return None, None, -1.0

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.attend(self.qkv_proj(x), ctx)

    def attend(self, qkv: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The layer after ``qkv_proj``: ``qkv`` ``(B, (H + 2 KVH) * D)`` is its output (`LlamaDecoderLayer` computes
        it together with the input norm where it can, `fused_norm_qkv`); written in place (rotary)."""
        b = qkv.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = qkv.view(b, h + 2 * kvh, d)
        q_w, k_w, eps = self._fused_head_norms(qkv.dtype)
        if self.q_norm is not None and q_w is None:
            self._norm_heads_(qkv)
        # Qwen3's head norms (when fused), the rotary embedding of the q and k heads in place, and this step's keys
        # and values into the cache: one row-wise kernel over the B rows (on the CPU: the torch formulation, the
        # norms, a float32 complex multiply and one index_put_ of (B, 2 KVH) rows of D elements).
        torch.ops.cutlass_w8a8.rope_kv_cache_(qkv, ctx.rope, self.kv_cache, ctx.slots, ctx.positions, h, kvh,
                                              q_w, k_w, eps)
        # The query heads (a strided view of qkv) over positions 0..position of each row's slot: (B, H * D).
        # The ops themselves, whose fake kernels check the arguments under torch.compile; SDPA's default scale.
        o_proj = self.o_proj
        # bfloat16 / float16, the layer's output; per token or per tensor (a block layer takes the float output)
        if isinstance(o_proj, W8A8Linear) and qkv.dtype == o_proj.dtype and o_proj.weight_block_size is None:
            q, s = torch.ops.cutlass_w8a8.decode_attention_quant(qkv[:, :h], self.kv_cache, ctx.slots,
                                                                 ctx.positions, 1.0 / math.sqrt(d),
                                                                 o_proj.quant_dtype, o_proj.input_scale)
            return o_proj(_quantized_for(o_proj, q, s))
        out = torch.ops.cutlass_w8a8.decode_attention(qkv[:, :h], self.kv_cache, ctx.slots, ctx.positions,
                                                      1.0 / math.sqrt(d))
        return o_proj(out)


class LlamaMLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate) * up)`` with ``gate, up = gate_up_proj(x).chunk(2)`` (vLLM's
    ``MergedColumnParallelLinear`` layout: the gate rows first).

    ``silu(gate) * up`` is one fused kernel, which also quantizes for a `W8A8Linear` ``down_proj``
    (`cutlass_w8a8.ops.silu_mul_quant` with its ``quant_dtype``, ``input_scale`` and ``group_size``; else
    `cutlass_w8a8.ops.silu_mul`), with the same result as the torch chain followed by the layer's own
    quantization. ``x``: float ``(..., hidden)``, or a
    `QuantizedActivation` for a `W8A8Linear` ``gate_up_proj``.
    """

    def __init__(self, config: LlamaConfig, device=None, dtype=None):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False,
                                      device=device, dtype=dtype)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False,
                                   device=device, dtype=dtype)

    def forward(self, x: Union[torch.Tensor, QuantizedActivation]) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        down = self.down_proj
        if gate_up.dtype not in _FUSED_DTYPES:
            gate, up = gate_up.chunk(2, dim=-1)
            return down(F.silu(gate) * up)
        if isinstance(down, W8A8Linear):
            q, s = torch.ops.cutlass_w8a8.silu_mul_quant(gate_up, down.quant_dtype, down.input_scale,
                                                         down.group_size)
            return down(_quantized_for(down, q, s))
        return down(torch.ops.cutlass_w8a8.silu_mul(gate_up))


_decode_layer = torch.ops.cutlass_w8a8.decode_layer.default
_add_rms_norm_linear_decode = torch.ops.cutlass_w8a8.add_rms_norm_linear_decode.default


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(input_layernorm(h))``; ``h += mlp(post_attention_layernorm(h))``.

    The residual stream is carried as vLLM carries it: ``forward(h, ctx, residual)`` takes the previous
    layer's MLP output ``h`` and the stream before it, and returns ``(mlp_output, residual)``; each residual
    add is fused into the RMSNorm that follows it (in place on ``residual``), and each norm also quantizes
    for its W8A8 consumer (see `RMSNorm`). At the first layer ``residual`` is None and ``h`` (the embeddings)
    becomes the stream: it is updated in place. The stream after the layer is ``mlp_output + residual``,
    added by the next layer's (or the final) norm.

    When the four projections are all bias-free per-token / per-tensor `W8A8Linear` of one quantized dtype, or all
    bias-free ``nn.Linear`` in the model dtype, and the model dtype is bfloat16 or float16, the layer runs as one op
    call,
    ``torch.ops.cutlass_w8a8.decode_layer`` (csrc/models/decode_layer.cpp): the same kernels in the same order as the
    Python path below, so the same results bit for bit, but one Python-to-dispatcher crossing instead of ten,
    which is what an eager decode step of a small batch waits for. ``use_layer_op = False`` (an attribute of
    each layer) forces the Python path; any other projection type (`DequantizedLinear`, a float64 reference)
    takes it anyway, and so do block-scaled `W8A8Linear` projections (``decode_layer`` is not taught their group
    quantization: its activations are per token, which the block GEMM refuses), and Qwen3-MoE layers (head norms,
    ``mlp`` a `cutlass_w8a8.models.moe.SparseMoeBlock`, which gets the float output of the second norm).
    """

    def __init__(self, config: LlamaConfig, device=None, dtype=None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.self_attn = LlamaAttention(config, device, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.mlp = (SparseMoeBlock(config, device, dtype) if config.is_moe else LlamaMLP(config, device, dtype))
        self.use_layer_op = True

    def _layer_op_operands(self, h: torch.Tensor) -> Optional[list]:
        """decode_layer's operands from the first norm weight to kv_cache, or None when the layer must run its
        Python path: every projection a bias-free `W8A8Linear` without weight blocks (output dtype ``h.dtype``) or
        a bias-free ``nn.Linear`` in ``h.dtype``, all with weights of one dtype, ``h`` bfloat16 or float16. Read
        through the modules' dicts, without generators: this runs once per layer and step on the host-bound
        path."""
        dtype = h.dtype
        if not self.use_layer_op or (dtype is not torch.bfloat16 and dtype is not torch.float16):
            return None
        mods = self._modules
        attn, mlp = mods["self_attn"], mods["mlp"]
        if type(mlp) is not LlamaMLP or attn.q_norm is not None:  # Qwen3-MoE layers: the Python path
            return None
        norm1, norm2 = mods["input_layernorm"], mods["post_attention_layernorm"]
        if type(norm1) is not RMSNorm or type(norm2) is not RMSNorm or norm1.eps != norm2.eps:
            return None
        kv_cache = attn._buffers["kv_cache"]
        if kv_cache is None:
            return None
        out = [norm1._parameters["weight"], norm2._parameters["weight"], norm1.eps]
        wdtype = None
        for mod in (attn._modules["qkv_proj"], attn._modules["o_proj"], mlp._modules["gate_up_proj"],
                    mlp._modules["down_proj"]):
            kind = type(mod)
            if kind is W8A8Linear:
                b = mod._buffers
                if b["bias"] is not None or mod.dtype != dtype or mod.weight_block_size is not None:
                    return None
                w = b["weight"]
                out += (w, b["weight_scale"], b["input_scale"])
            elif kind is nn.Linear:
                p = mod._parameters
                w = p["weight"]
                if p["bias"] is not None or w.dtype != dtype:
                    return None
                out += (w, None, None)
            else:
                return None
            if wdtype is None:
                wdtype = w.dtype
            elif w.dtype != wdtype:  # all 8-bit alike, or all in the model dtype
                return None
        out.append(kv_cache)
        return out

    def _norm_qkv_operands(self, h: torch.Tensor) -> Optional[tuple]:
        """add_rms_norm_linear_decode's operands after ``residual`` (norm weight, eps, qkv weight.t(), weight scale,
        bias, quantized dtype), or None for the unfused path: the switch on (`fused_norm_qkv`), our `RMSNorm` and
        `LlamaAttention`, a `W8A8Linear` ``qkv_proj`` with dynamic per-token activations (no input_scale, no weight
        blocks) whose output dtype is ``h``'s, ``h`` (B, K) bfloat16 / float16 with B <= 16 and K <= 8192."""
        if not fused_norm_qkv():
            return None
        dtype = h.dtype
        if (dtype is not torch.bfloat16 and dtype is not torch.float16) or h.dim() != 2:
            return None
        if not 1 <= h.shape[0] <= DECODE_MAX_M or h.shape[1] > NORM_DECODE_MAX_K:
            return None
        mods = self._modules
        norm, attn = mods["input_layernorm"], mods["self_attn"]
        if type(norm) is not RMSNorm or type(attn) is not LlamaAttention:
            return None
        lin = attn._modules["qkv_proj"]
        if type(lin) is not W8A8Linear or lin.dtype != dtype or lin.weight_block_size is not None:
            return None
        b = lin._buffers
        w = norm._parameters["weight"]
        if b["input_scale"] is not None or w.dtype != dtype:
            return None
        return w, norm.eps, b["weight"].t(), b["weight_scale"], b["bias"], b["weight"].dtype

    def forward(self, h: torch.Tensor, ctx: StepContext,
                residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        operands = self._layer_op_operands(h)
        if operands is not None:
            attn = self._modules["self_attn"]
            stream = h if residual is None else residual
            out = _decode_layer(None if residual is None else h, stream, *operands, ctx.rope, ctx.slots,
                                ctx.positions, attn.num_heads, attn.num_kv_heads, 1.0 / math.sqrt(attn.head_dim))
            return out, stream
        fused = self._norm_qkv_operands(h)
        if fused is not None:
            # the input norm (with the residual add and the quantization) and qkv_proj in one kernel; the stream goes
            # on as its residual_out, a new tensor (the caller's residual, or h at the first layer, is not written)
            qkv, residual = _add_rms_norm_linear_decode(h, residual, *fused)
            h = self._modules["self_attn"].attend(qkv, ctx)
        else:
            qkv_proj = self.self_attn.qkv_proj
            if residual is None:
                residual = h
                x = self.input_layernorm(h, quant_for=qkv_proj)
            else:
                x = self.input_layernorm(h, residual, quant_for=qkv_proj)  # residual += h, then the norm
            h = self.self_attn(x, ctx)
        mlp = self.mlp
        norm2 = self.post_attention_layernorm
        if (hasattr(mlp, "forward_add_norm") and fused_norm_router() and type(norm2) is RMSNorm
                and mlp.add_norm_route_applies(h, residual, norm2.weight)):
            # the post-attention norm folded into the router kernel (SparseMoeBlock, hf's MoeMLP): a new residual
            # stream tensor
            return mlp.forward_add_norm(h, residual, norm2.weight, norm2.eps)
        # the MoE block quantizes inside its experts (per routed pair): it gets the float output
        x = self.post_attention_layernorm(h, residual, quant_for=getattr(mlp, "gate_up_proj", None))
        return mlp(x), residual
