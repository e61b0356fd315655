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
the rotary embedding, inside the rotary op (``rope_kv_cache_`` with the norms' weights). Such layers take the Python
path (not the one-op ``decode_layer``): per layer at decode sizes on CUDA, the dense layer's attention-side kernels
(6: fused norm + quantization, qkv GEMM, rotary + head norms + KV write, two of split-KV attention quantizing for
o_proj, o_proj GEMM) and the MoE part's (5: fused norm, ``moe_router_route`` (the bf16 router GEMM and the
routing in one kernel, T <= 16), the three of ``moe_decode_experts``).

Examples
--------
>>> from cutlass_w8a8.models import LlamaDecoder, SMALL
>>> model = LlamaDecoder(SMALL, quant="int8", max_batch=8, device="cuda")
>>> logits = model(token_ids, positions, slots)        # (B,), (B,), (B,) int64 -> (B, vocab) bf16
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch import nn

from ..config import W8A8Config
from ..ops._limits import BLOCK_SIZE
from ..quantize import quantize_
from .config import LlamaConfig
# the layer modules live in models/layers.py (public: hf.DecodeStep runs them); re-exported here, where they were
from .layers import LlamaAttention, LlamaDecoderLayer, LlamaMLP, RMSNorm, StepContext, _rope_  # noqa: F401
from .moe import MoEExperts, SparseMoeBlock

__all__ = ["LlamaDecoder", "LlamaDecoderLayer", "decoder_scheme"]

_StepContext = StepContext  # the former private name (bench/bench_decoder.py reads its fields)

_QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# quant name -> W8A8Config fields (dtype, weight_block_size): per-channel int8 / fp8, or 128 x 128 block fp8
_QUANT_SCHEMES = {"int8": (torch.int8, None), "fp8": (torch.float8_e4m3fn, None),
                  "fp8-block": (torch.float8_e4m3fn, (BLOCK_SIZE, BLOCK_SIZE))}
_MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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


def decoder_scheme(config: LlamaConfig, quant, dtype: torch.dtype, quant_lm_head: bool = False) -> Optional[str]:
    """`LlamaDecoder`'s checks of its arguments (the errors its docstring lists, in that order), before anything is
    built; returns the name of ``quant`` in `_QUANT_SCHEMES` (None for a float model). Also run by the builders of
    a decoder (`cutlass_w8a8.distributed.TensorParallelLlamaDecoder`) before their own checks."""
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
    return scheme


class LlamaDecoder(nn.Module):
    """Llama-style decoder whose ``forward`` is one decode step of a batch over a preallocated KV cache.

    Parameters
    ----------
    config : LlamaConfig
        Dimensions; see `SMALL`, `LLAMA3_8B` and `QWEN3_30B_A3B` (Qwen3-MoE: head norms, mixture-of-experts MLPs
        whose experts become `cutlass_w8a8.W8A8MoE` under ``quant``, their routers staying in ``dtype``; no tensor
        parallelism: `cutlass_w8a8.distributed.TensorParallelLlamaDecoder` raises NotImplementedError).
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
    build_hook : callable, optional
        ``build_hook(name, module) -> module``, called on each part right after it is built (and quantized), in
        order: ``"embed_tokens"``, ``"layers.0"`` ... ``"layers.{L-1}"``, ``"norm"``, ``"lm_head"``; the model keeps
        what it returns. Default None: the parts as built. This is how
        `cutlass_w8a8.distributed.TensorParallelLlamaDecoder` (this rank's tensor-parallel shard) shards each
        layer before the next is built; the decoder itself knows nothing of distribution.

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
                 seed: int = 0, quant_lm_head: bool = False,
                 build_hook: Optional[Callable[[str, nn.Module], nn.Module]] = None):
        super().__init__()
        scheme = decoder_scheme(config, quant, dtype, quant_lm_head)
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.config = config
        self.quant = scheme
        self.dtype = dtype
        gen = torch.Generator(device=device).manual_seed(seed)
        w8a8 = None
        if scheme is not None:
            qdtype, block = _QUANT_SCHEMES[scheme]
            w8a8 = W8A8Config(dtype=qdtype, out_dtype=dtype, weight_block_size=block)
        hook = build_hook if build_hook is not None else (lambda name, mod: mod)

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

        self.embed_tokens = hook("embed_tokens", build(
            lambda dtype: nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype), False))
        self.layers = nn.ModuleList(hook(f"layers.{i}", build(lambda dtype: LlamaDecoderLayer(config, dtype=dtype),
                                                              True))
                                    for i in range(config.num_layers))
        self.norm = hook("norm", build(lambda dtype: RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype),
                                       False))
        self.lm_head = hook("lm_head", build(lambda dtype: nn.Linear(config.hidden_size, config.vocab_size,
                                                                     bias=False, dtype=dtype), quant_lm_head))
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
                                device=device, dtype=dtype)  # the layer's key/value heads (a shard's own)
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

    def _context(self, positions: torch.Tensor, slots: torch.Tensor) -> StepContext:
        return StepContext(self.rope_table.index_select(0, positions), slots, positions)

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
                f"max_batch={self.max_batch}, max_seq_len={self.max_seq_len}")
