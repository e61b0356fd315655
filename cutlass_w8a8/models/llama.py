"""A Llama-style decoder for batched decode steps over a preallocated KV cache, on `W8A8Linear` or bf16 layers.

The model follows vLLM's layout of Llama: fused ``qkv_proj`` and ``gate_up_proj`` projections, RMSNorm,
rotary position embeddings (the "neox" half-split rotation of Hugging Face's ``LlamaForCausalLM``),
grouped-query attention and a SwiGLU MLP. One call is one decode step: every sequence of the batch brings
one token, its position and the cache slot (row) that holds its keys and values.

Everything a step does is a fixed sequence of kernels on tensors of fixed shape: one row-wise op
(``rope_kv_cache_``) rotates the new queries and keys and writes the keys and values at each row's (slot,
position), read on the device; attention (`cutlass_w8a8.ops.decode_attention`) reads each row's positions
``0..position``; nothing reads a value back to the host.
A step can therefore be captured into a CUDA graph (`cutlass_w8a8.runner.DecodeGraphRunner`) or compiled
with ``torch.compile(fullgraph=True)``.

Weights are random, drawn from a seeded generator on the model's device: nothing is downloaded. The bf16
and W8A8 models built from the same config and seed share their float weights (the W8A8 model quantizes
exactly the weights the bf16 model uses), so they can be compared.

Block-scaled fp8 (``quant="fp8-block"``, DeepSeek-V3's format): every decoder projection a `W8A8Linear` with one
weight scale per 128 x 128 block and activations quantized per 1 x 128 group at run time. The fused projections
are quantized as one weight: with the parts' N multiples of 128 (q, k, v heads of 128 dims; Llama-3-8B's MLP of
14336 = 112 x 128) no block straddles two parts, so this is exactly the parts quantized one by one (where a part's
N is not, a block spans the boundary and takes the larger absmax of the two: still a valid block layer, not the
parts' own quantization). The fused norms and SiLU*mul quantize per group for them (``group_size=128``);
attention, which has no group-quantizing variant, hands ``o_proj`` its float output.

Qwen3-MoE (a config with ``num_experts > 0``, e.g. `cutlass_w8a8.models.QWEN3_30B_A3B`): each layer's MLP is a
`cutlass_w8a8.models.moe.SparseMoeBlock` (a bf16 router ``gate`` and the experts: `MoEExperts` in the bf16 model,
`cutlass_w8a8.W8A8MoE` from the same float weights in a W8A8 one, the router left in the model dtype); with
``qk_norm`` attention norms every query and key head (``q_norm`` / ``k_norm``, RMSNorm over ``head_dim``) before
the rotary embedding. Such layers take the Python path (not the one-op ``decode_layer``).

Examples
--------
>>> from cutlass_w8a8.models import LlamaDecoder, SMALL
>>> model = LlamaDecoder(SMALL, quant="int8", max_batch=8, device="cuda")
>>> logits = model(token_ids, positions, slots)        # (B,), (B,), (B,) int64 -> (B, vocab) bf16
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..config import W8A8Config
from ..linear import QuantizedActivation, W8A8Linear
from ..ops._limits import BLOCK_SIZE
from ..quantize import quantize_
from .config import LlamaConfig
from .moe import MoEExperts, SparseMoeBlock

__all__ = ["LlamaDecoder", "LlamaDecoderLayer"]

_QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# quant name -> W8A8Config fields (dtype, weight_block_size): per-channel int8 / fp8, or 128 x 128 block fp8
_QUANT_SCHEMES = {"int8": (torch.int8, None), "fp8": (torch.float8_e4m3fn, None),
                  "fp8-block": (torch.float8_e4m3fn, (BLOCK_SIZE, BLOCK_SIZE))}
_MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------------
# modules


class _StepContext(NamedTuple):
    """What every layer of one decode step shares; computed once per step from the positions and slots.

    - ``rope``: ``(B, head_dim // 2, 2)`` float32, ``(cos, sin)`` of each sequence's position.
    - ``slots``: ``(B,)`` int64, the cache slots the batch writes (at its positions) and reads.
    - ``positions``: ``(B,)`` int64, each sequence's position: attention reads cache positions ``0..position``.
    """

    rope: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor


def _rope_(x: torch.Tensor, rope: torch.Tensor) -> None:
    """Rotate ``x`` in place: ``(B, N, D)`` heads (a view into the qkv output), ``rope`` ``(B, D/2, 2)`` float32.

    The decoder's rotary code before the row-wise op ``rope_kv_cache_`` replaced it; the step no longer calls
    it: tests keep it as the torch reference of that op (tests/test_rope_kv_cache.py). Hugging Face's "neox" rotation of the pairs ``(x[j], x[j + D/2])`` by the angle of frequency ``j``,
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
    head of the ``qkv_proj`` output in place before the rotary embedding (one norm kernel each, plus the copies of
    the strided heads in and out); otherwise they are None.

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

    def forward(self, x: torch.Tensor, ctx: _StepContext) -> torch.Tensor:
        b = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(b, h + 2 * kvh, d)
        if self.q_norm is not None:
            self._norm_heads_(qkv)
        # Rotary embedding of the q and k heads in place, and this step's keys and values into the cache: one
        # row-wise kernel over the B rows (on the CPU: the torch formulation, a float32 complex multiply and one
        # index_put_ of (B, 2 KVH) rows of D elements).
        torch.ops.cutlass_w8a8.rope_kv_cache_(qkv, ctx.rope, self.kv_cache, ctx.slots, ctx.positions, h, kvh)
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

    def forward(self, h: torch.Tensor, ctx: _StepContext,
                residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        operands = self._layer_op_operands(h)
        if operands is not None:
            attn = self._modules["self_attn"]
            stream = h if residual is None else residual
            out = _decode_layer(None if residual is None else h, stream, *operands, ctx.rope, ctx.slots,
                                ctx.positions, attn.num_heads, attn.num_kv_heads, 1.0 / math.sqrt(attn.head_dim))
            return out, stream
        qkv_proj = self.self_attn.qkv_proj
        if residual is None:
            residual = h
            x = self.input_layernorm(h, quant_for=qkv_proj)
        else:
            x = self.input_layernorm(h, residual, quant_for=qkv_proj)  # residual += h, then the norm
        h = self.self_attn(x, ctx)
        mlp = self.mlp
        # the MoE block quantizes inside its experts (per routed pair): it gets the float output
        x = self.post_attention_layernorm(h, residual, quant_for=getattr(mlp, "gate_up_proj", None))
        return mlp(x), residual


def _quantize_moe_experts(mod: nn.Module, w8a8: W8A8Config) -> nn.Module:
    """Replace the `MoEExperts` of every `SparseMoeBlock` in ``mod`` by ``cutlass_w8a8.W8A8MoE.from_float`` of them
    (``w8a8``'s dtype, per-channel or 128 x 128 block weights), in place; returns ``mod``."""
    blocks = [m for m in mod.modules() if isinstance(m, SparseMoeBlock) and isinstance(m.experts, MoEExperts)]
    if blocks:
        from ..moe.layer import W8A8MoE

        for block in blocks:
            experts = block.experts
            block.experts = W8A8MoE.from_float(experts, w8a8, experts.top_k, experts.renormalize)
    return mod


def _quant_scheme(quant) -> Optional[str]:
    """The name in `_QUANT_SCHEMES` of ``quant`` (None, "bf16", "none", a name, or torch.int8 / float8_e4m3fn)."""
    if quant is None or quant == "bf16" or quant == "none":
        return None
    if isinstance(quant, str) and quant in _QUANT_SCHEMES:
        return quant
    for name, dtype in _QUANT_DTYPES.items():
        if quant is dtype:
            return name
    raise ValueError(f"LlamaDecoder: `quant` must be None, 'int8', 'fp8' or 'fp8-block', got {quant!r}")


class LlamaDecoder(nn.Module):
    """Llama-style decoder whose ``forward`` is one decode step of a batch over a preallocated KV cache.

    Parameters
    ----------
    config : LlamaConfig
        Dimensions; see `SMALL`, `LLAMA3_8B` and `QWEN3_30B_A3B` (Qwen3-MoE: head norms, mixture-of-experts MLPs
        whose experts become `cutlass_w8a8.W8A8MoE` under ``quant``, their routers staying in ``dtype``; no tensor
        parallelism: ``tp_group`` raises NotImplementedError).
    quant : {None, "int8", "fp8", "fp8-block"}
        None: every linear is a float ``nn.Linear`` in ``dtype``. "int8" / "fp8": the linears of the decoder
        layers are `W8A8Linear` (per-channel weights, dynamic per-token activations), quantized from the
        very float weights the ``quant=None`` model of the same seed has. "fp8-block": block-scaled fp8
        `W8A8Linear` (``W8A8Config(dtype=torch.float8_e4m3fn, weight_block_size=(128, 128))``: a scale per
        128 x 128 weight block, activations per 1 x 128 group), from the same float weights; needs
        ``hidden_size``, ``num_heads * head_dim`` and ``intermediate_size`` (the projections' K) to be multiples
        of 128.
    max_batch : int
        Number of cache slots (sequences the cache can hold). One more slot, ``scratch_slot = max_batch``,
        is kept for padded rows: a padded row writes its keys and values there and nowhere else.
    max_seq_len : int, optional
        Cache length in tokens, a multiple of 16 (default ``min(config.max_position, 2048)``). On the GPU,
        attention reads only positions ``0..position`` of each row, so its cost grows with the positions, not
        with this length (the CPU reference still reads all of it, masked).
    device : torch.device or str, optional
        Where the weights, the cache and the random generator live (default: CPU).
    dtype : torch.dtype
        Activation, cache and float-weight dtype: bfloat16 (default) or float16; float32 for ``quant=None``.
    seed : int
        Seed of the generator of the random weights (normal, std ``config.init_std``; norms are ones).
    quant_lm_head : bool
        Also quantize ``lm_head`` (default False: the logits stay a bf16 GEMM, as most W8A8 recipes keep it).
    tp_group : torch.distributed.ProcessGroup, optional
        Build this rank's tensor-parallel shard (`cutlass_w8a8.distributed.decoder`): attention heads and MLP
        split over the group, one all-reduce after ``o_proj`` and one after ``down_proj``, embedding replicated, the
        KV cache holding this rank's ``num_kv_heads / tp`` heads (one head, replicated, when ``num_kv_heads < tp``).
        Every rank passes the same arguments; the weights are the shards of the unsharded model of the same seed.
        Default None: no tensor parallelism. ``tp_size`` (optional) is checked against the group's size on every
        rank. ``tp_lm_head``: None (default) shards ``lm_head`` over the vocabulary (its logits all-gathered) when
        ``vocab_size`` is divisible by the world size, True always, False keeps it replicated.

    Attributes
    ----------
    embed_tokens : nn.Embedding
        ``(vocab_size, hidden_size)``.
    layers : nn.ModuleList of LlamaDecoderLayer
    norm : RMSNorm
    lm_head : nn.Linear or W8A8Linear
        ``hidden_size -> vocab_size``, no bias.
    scratch_slot : int
        The cache slot of padded rows (``max_batch``).

    Notes
    -----
    ``forward(token_ids, positions, slots=None)`` takes ``(B,)`` integer tensors on the model's device
    (token ids, 0-based positions, cache slots; ``slots`` defaults to ``0..B-1``) and returns the logits,
    ``(B, vocab_size)`` in ``dtype``. It writes the keys and values of the B tokens at ``(slot, position)``
    before attending, so a sequence is fed token by token from position 0 (prefill = decode steps, see
    `generate_greedy`). Positions and slots are not checked on the device (that would need a host sync):
    ``0 <= position < max_seq_len`` and ``0 <= slot <= max_batch`` are the caller's duty; two rows of one
    step must not share a slot unless both are padding.

    The cache is stored per layer as ``(max_batch + 1, 2, num_kv_heads, max_seq_len, head_dim)``; a step
    runs `cutlass_w8a8.ops.decode_attention` on it, which reads positions ``0..position`` of each row's slot,
    the ``G = num_heads / num_kv_heads`` query heads of a key/value head sharing it (no head is repeated).
    """

    def __init__(self, config: LlamaConfig, quant: Union[None, str, torch.dtype] = None, *, max_batch: int = 8,
                 max_seq_len: Optional[int] = None, device=None, dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0, quant_lm_head: bool = False, tp_group=None, tp_size: Optional[int] = None,
                 tp_lm_head: Optional[bool] = None):
        super().__init__()
        scheme = _quant_scheme(quant)
        if dtype not in _MODEL_DTYPES:
            raise TypeError(f"LlamaDecoder: `dtype` must be bfloat16, float16 or float32, got {dtype}")
        if scheme is not None and dtype == torch.float32:
            raise TypeError("LlamaDecoder: W8A8 layers output bfloat16 or float16; use that `dtype` with `quant`")
        if scheme is not None:
            sizes = {"hidden_size": config.hidden_size, "qkv_size": config.qkv_size,
                     "num_heads * head_dim": config.num_heads * config.head_dim,
                     ("moe_intermediate_size" if config.is_moe else "intermediate_size"):
                         config.mlp_intermediate_size}
            if quant_lm_head:
                sizes["vocab_size"] = config.vocab_size
            for name, v in sizes.items():
                if v % 16:
                    raise ValueError(f"LlamaDecoder: W8A8 layers need multiples of 16, `{name}` is {v}")
        if scheme == "fp8-block":
            # the K of qkv / gate_up (and lm_head), o_proj, down_proj: the block GEMM's K is a multiple of 128
            for name, v in (("hidden_size", config.hidden_size),
                            ("num_heads * head_dim", config.num_heads * config.head_dim),
                            ("moe_intermediate_size" if config.is_moe else "intermediate_size",
                             config.mlp_intermediate_size)):
                if v % BLOCK_SIZE:
                    raise ValueError(f"LlamaDecoder: quant='fp8-block' needs the projections' K to be multiples of "
                                     f"{BLOCK_SIZE}, `{name}` is {v}")
        if tp_group is not None and config.is_moe:
            raise NotImplementedError("LlamaDecoder: tensor parallelism of the mixture-of-experts layers "
                                      f"(num_experts = {config.num_experts}) is not implemented; pass tp_group=None")
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.config = config
        self.quant = scheme
        self.dtype = dtype
        gen = torch.Generator(device=device).manual_seed(seed)
        w8a8 = None
        if scheme is not None:
            qdtype, block = _QUANT_SCHEMES[scheme]
            w8a8 = W8A8Config(dtype=qdtype, out_dtype=dtype, weight_block_size=block)
        # Tensor parallelism (cutlass_w8a8.distributed.decoder): checked across ranks before anything is built;
        # each layer is built full (the same weights as the unsharded model of this seed), then sharded.
        self.tp_rank, self.tp_size, self._tp = 0, 1, None
        shard = None
        if tp_group is not None:
            from ..distributed.decoder import DecoderSharder
            from ..distributed._common import _GroupRef

            shard = DecoderSharder(config, tp_group, self.quant, dtype, tp_size, tp_lm_head)
            self.tp_rank, self.tp_size, self._tp = shard.rank, shard.world, _GroupRef(tp_group)

        def build(factory: Callable[..., nn.Module], quantize: bool) -> nn.Module:
            # Float module on the meta device, materialised where it lives, filled from the seeded
            # generator in a fixed order (so bf16 and W8A8 models of one seed share weights), then quantized.
            with torch.device("meta"):
                mod = factory(dtype=dtype)
            mod = mod.to_empty(device=device)
            with torch.no_grad():
                for sub in mod.modules():
                    if isinstance(sub, RMSNorm):
                        sub.weight.fill_(1.0)
                    elif isinstance(sub, (nn.Linear, nn.Embedding)):
                        sub.weight.normal_(0.0, config.init_std, generator=gen)
                    elif isinstance(sub, MoEExperts):
                        sub.gate_up_proj.normal_(0.0, config.init_std, generator=gen)
                        sub.down_proj.normal_(0.0, config.init_std, generator=gen)
            if quantize and w8a8 is not None:
                mod = _quantize_moe_experts(mod, w8a8)
                # the MoE routers (`mlp.gate`) stay in the model dtype
                mod = quantize_(mod, w8a8, filter_fn=lambda m, fqn: not fqn.endswith("mlp.gate"))
            return mod

        self.embed_tokens = build(lambda dtype: nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype),
                                  False)
        layer_of = (lambda m: m) if shard is None else shard
        self.layers = nn.ModuleList(layer_of(build(lambda dtype: LlamaDecoderLayer(config, dtype=dtype), True))
                                    for _ in range(config.num_layers))
        self.norm = build(lambda dtype: RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype), False)
        self.lm_head = build(lambda dtype: nn.Linear(config.hidden_size, config.vocab_size, bias=False,
                                                     dtype=dtype), quant_lm_head)
        if shard is not None and shard.tp_lm_head:
            self.lm_head = shard.shard_lm_head(self.lm_head)
        self.requires_grad_(False)

        # Rotary table: (max_position, D/2, 2) float32 (cos, sin), angles in float32 as Hugging Face's.
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.int64,
                                                             device=device).float() / config.head_dim))
        angles = torch.outer(torch.arange(config.max_position, device=device, dtype=torch.float32), inv_freq)
        self.register_buffer("rope_table", torch.stack((angles.cos(), angles.sin()), dim=-1), persistent=False)
        self.allocate_cache(max_batch, max_seq_len)

    # ------------------------------------------------------------------------------------------------
    # cache

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def tp_group(self):
        """The tensor-parallel process group (None when unsharded, ``tp_size == 1``)."""
        return self._tp.group if self._tp is not None else None

    def allocate_cache(self, max_batch: int, max_seq_len: Optional[int] = None) -> None:
        """(Re)allocate the zeroed KV cache of every layer for ``max_batch`` sequences (+1 scratch slot) of
        ``max_seq_len`` tokens (a multiple of 16, at most ``config.max_position``; default
        ``min(config.max_position, 2048)``). Drops the previous cache."""
        cfg = self.config
        max_seq_len = max_seq_len if max_seq_len is not None else min(cfg.max_position, 2048)
        if max_batch < 1:
            raise ValueError(f"LlamaDecoder: `max_batch` must be >= 1, got {max_batch}")
        if max_seq_len < 16 or max_seq_len % 16 or max_seq_len > cfg.max_position:
            raise ValueError(f"LlamaDecoder: `max_seq_len` must be a multiple of 16 in [16, max_position = "
                             f"{cfg.max_position}], got {max_seq_len}")
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.scratch_slot = max_batch
        device, dtype = self.device, self.dtype
        for layer in self.layers:
            layer.self_attn.kv_cache = None
        for layer in self.layers:
            cache = torch.zeros(max_batch + 1, 2, layer.self_attn.num_kv_heads, max_seq_len, cfg.head_dim,
                                device=device, dtype=dtype)  # this rank's key/value heads under tensor parallelism
            # A fixed address that the step mutates: tell torch.compile (cudagraph trees) it is static,
            # as Hugging Face's StaticCache does.
            torch._dynamo.mark_static_address(cache)
            layer.self_attn.register_buffer("kv_cache", cache, persistent=False)

    def reset_cache(self) -> None:
        """Zero every layer's KV cache (in place: captured graphs keep working)."""
        for layer in self.layers:
            layer.self_attn.kv_cache.zero_()

    def cache_nbytes(self) -> int:
        """Bytes of the KV cache of all layers."""
        return sum(layer.self_attn.kv_cache.numel() * layer.self_attn.kv_cache.element_size()
                   for layer in self.layers)

    def weight_nbytes(self, include_embedding: bool = True) -> int:
        """Bytes of the weights (parameters and the buffers of W8A8 layers), without cache and tables.

        ``include_embedding=False`` leaves out the token embedding, of which a step reads only B rows: the
        rest is what every step reads in full.
        """
        skip = {"rope_table"}
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        for name, b in self.named_buffers():
            if name.split(".")[-1] not in skip and not name.endswith("kv_cache"):
                total += b.numel() * b.element_size()
        if not include_embedding:
            total -= self.embed_tokens.weight.numel() * self.embed_tokens.weight.element_size()
        return total

    def expert_nbytes(self) -> int:
        """Bytes of the experts' weights (and scales) of every MoE layer; 0 for a dense model. A step reads only the
        experts its tokens are routed to: ``weight_nbytes(False) - expert_nbytes()`` plus that share of this."""
        total = 0
        for layer in self.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is not None:
                total += sum(t.numel() * t.element_size() for t in (*experts.parameters(), *experts.buffers()))
        return total

    # ------------------------------------------------------------------------------------------------
    # step

    def _context(self, positions: torch.Tensor, slots: torch.Tensor) -> _StepContext:
        return _StepContext(self.rope_table.index_select(0, positions), slots, positions)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One decode step.

        Parameters
        ----------
        token_ids : torch.Tensor
            ``(B,)`` int64 (or int32) token ids on the model's device.
        positions : torch.Tensor
            ``(B,)`` int64 (or int32) 0-based positions of the tokens, ``< max_seq_len``.
        slots : torch.Tensor, optional
            ``(B,)`` int64 (or int32) cache slots, ``<= max_batch``; default ``0..B-1``.

        Returns
        -------
        torch.Tensor
            ``(B, vocab_size)`` logits in the model dtype.
        """
        if token_ids.dim() != 1 or positions.shape != token_ids.shape:
            raise ValueError(f"LlamaDecoder: `token_ids` and `positions` must both be (B,), got "
                             f"{tuple(token_ids.shape)} and {tuple(positions.shape)}")
        positions = positions.long()
        if slots is None:
            slots = torch.arange(token_ids.shape[0], device=token_ids.device)
        elif slots.shape != token_ids.shape:
            raise ValueError(f"LlamaDecoder: `slots` must be (B,) = {tuple(token_ids.shape)}, got {tuple(slots.shape)}")
        ctx = self._context(positions, slots.long())
        h, residual = self.embed_tokens(token_ids), None
        for layer in self.layers:
            h, residual = layer(h, ctx, residual)
        return self.lm_head(self.norm(h, residual, quant_for=self.lm_head))  # residual += h, norm, head

    def extra_repr(self) -> str:
        c = self.config
        return (f"quant={self.quant}, dtype={self.dtype}, layers={c.num_layers}, hidden={c.hidden_size}, "
                f"heads={c.num_heads}/{c.num_kv_heads}x{c.head_dim}, vocab={c.vocab_size}, "
                f"max_batch={self.max_batch}, max_seq_len={self.max_seq_len}"
                + (f", tp_rank={self.tp_rank}, tp_size={self.tp_size}" if self.tp_size > 1 else ""))
