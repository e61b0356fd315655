"""Tensor parallelism for the reference decoder (`cutlass_w8a8.models.LlamaDecoder`): `shard_decoder_` turns a
full model into this rank's shard in place; ``TensorParallelLlamaDecoder(config, ..., tp_group=g)`` builds the shard
directly (each layer sharded right after it is built, through the decoder's ``build_hook``, so no rank ever holds
more than one full layer). Both make a `TensorParallelLlamaDecoder`; `LlamaDecoder` itself knows nothing of
distribution.

Megatron-LM / vLLM layout, per decoder layer:

- ``self_attn.qkv_proj``: column-parallel with ``output_sizes = [H * D, KVH * D, KVH * D]``: rank ``r`` keeps
  query heads ``[r H / tp, (r + 1) H / tp)`` and key/value heads ``[r KVH / tp, (r + 1) KVH / tp)``; query head
  ``h`` still reads key/value head ``h // (H / KVH)`` (the group size is unchanged). ``num_heads`` and
  ``num_kv_heads`` of the attention become the per-rank counts, and the KV cache holds this rank's
  ``KVH / tp`` heads: ``(max_batch + 1, 2, KVH / tp, max_seq_len, D)``. With fewer key/value heads than ranks
  (``tp % KVH == 0``) the key/value heads are replicated, as vLLM does: rank ``r`` keeps the one key/value head
  ``r * KVH // tp`` (the head its query heads read) and a cache of one head.
- ``self_attn.o_proj``: row-parallel over the ``H * D`` inputs (this rank's heads' outputs): one all-reduce.
- ``mlp.gate_up_proj``: column-parallel with ``output_sizes = [I, I]`` (the rank's gate rows, then its up rows).
- ``mlp.down_proj``: row-parallel over the ``I`` inputs: one all-reduce.

The embedding, the norms and the rotary table are replicated. Two all-reduces per layer, of ``(B, hidden)`` in
the model dtype. The ``lm_head`` is column-parallel over the vocabulary by default (``tp_lm_head=None`` when
``vocab_size`` is divisible by the world size, or ``True``; vLLM's ``ParallelLMHead``): each rank computes
``vocab / tp`` logits and one all-gather returns the full ``(B, vocab)`` logits to every rank, so a step reads
``1 / tp`` of the ``lm_head`` weight per rank instead of all of it (at Llama-3 sizes, 1 GiB of bf16 per rank less;
issue 27, TP=2 at 70B dims, 8 layers, batch 1: 1.68x TP=1 sharded against 1.42x replicated).
``tp_lm_head=False`` (or ``None`` with a vocabulary the world size does not divide) keeps it replicated: every rank
computes the full logits itself. Either way every rank returns the same full logits.

A sharded layer runs its Python path: the one-op layer ``torch.ops.cutlass_w8a8.decode_layer`` cannot all-reduce
(``use_layer_op`` is set False, and the op's operand check refuses the parallel layer types anyway). The fused
ops (``rms_norm_quant``, ``decode_attention_quant``, ``silu_mul_quant``) work on the shards unchanged: the parallel
layers are `W8A8Linear` subclasses.

Requirements (ValueError naming the field otherwise, the same on every rank): ``num_heads`` and
``intermediate_size`` divisible by the world size, ``num_kv_heads`` divisible by it or dividing it (replicated);
for W8A8 layers each shard's N and K multiples of 16.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..linear import W8A8Linear
from ..models.llama import LlamaDecoder, decoder_scheme
from ._common import TPContext, _TensorParallel
from ._group import check_same_on_all_ranks, dtype_code
from .linear import shard_linear
from .sharding import kv_replicas

__all__ = ["DecoderSharder", "TensorParallelLlamaDecoder", "shard_decoder_"]


class DecoderSharder:
    """Checks a decoder's tensor-parallel split once (on every rank, with one all_gather), then shards its layers
    one at a time (``sharder(layer)``, in place, no further collectives).

    Parameters
    ----------
    config : LlamaConfig
    tp_group : torch.distributed.ProcessGroup or TPContext
        Resolved once here; the context (with the key/value replication plan) is ``ctx``, given to every layer.
    quant : str or None
        The model's quantization (``"int8"``, ``"fp8"`` or None), compared across ranks.
    dtype : torch.dtype
        The model dtype, compared across ranks.
    tp_size : int, optional
        The tensor-parallel size this rank was configured for; checked against the group.
    tp_lm_head : bool or None
        Whether `shard_lm_head` will be used: None (default) when ``vocab_size`` is divisible by the world size,
        True always (``vocab_size`` must be divisible), False never. Resolved into the bool attribute
        ``tp_lm_head``; checked across ranks.

    Raises
    ------
    ValueError
        The ranks disagree on the config, dtype, quantization, ``tp_size`` or ``tp_lm_head``; ``num_heads``,
        ``intermediate_size`` (or with ``tp_lm_head`` ``vocab_size``) is not divisible by the world size;
        ``num_kv_heads`` and the world size divide neither way.
    """

    where = "LlamaDecoder (tensor parallel)"

    def __init__(self, config, tp_group, quant: Optional[str], dtype: torch.dtype, tp_size: Optional[int] = None,
                 tp_lm_head: Optional[bool] = None):
        ctx = TPContext.resolve(tp_group, self.where)
        self.rank, self.world = ctx.rank, ctx.world
        c = config
        if tp_lm_head is None:
            tp_lm_head = self.world > 1 and c.vocab_size % self.world == 0
        self.tp_lm_head = bool(tp_lm_head)
        check_same_on_all_ranks(ctx, self.where, {
            "tp_size": -1 if tp_size is None else int(tp_size), "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_layers": c.num_layers,
            "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "quant": {None: 0, "int8": 1, "fp8": 2}.get(quant, 3), "dtype": dtype_code(dtype),
            "tp_lm_head": int(tp_lm_head)})
        if tp_size is not None and tp_size != self.world:
            raise ValueError(f"{self.where}: `tp_size` = {tp_size} but the tensor-parallel group has {self.world} "
                             "ranks")
        #: ranks sharing each key/value head (1: split; tp / KVH: replicated)
        self.kv_replicas = kv_replicas(c.num_heads, c.num_kv_heads, self.world, self.where,
                                       ("num_heads", "num_kv_heads"))
        #: the resolved group and the replication plan, passed to every layer this sharder builds
        self.ctx = ctx.with_kv_replicas(self.kv_replicas)
        for name in ("intermediate_size",) + (("vocab_size",) if tp_lm_head else ()):
            v = getattr(c, name)
            if v % self.world:
                raise ValueError(f"{self.where}: `config.{name}` = {v} is not divisible by the tensor-parallel world "
                                 f"size {self.world}")
        self.config, self.tp_group = c, ctx.group

    def __call__(self, layer: nn.Module) -> nn.Module:
        """Shard one `LlamaDecoderLayer` in place (its four projections, the attention's head counts; its KV cache
        is dropped: the decoder reallocates it) and return it."""
        c, g = self.config, self.ctx
        attn, mlp = layer.self_attn, layer.mlp
        d = c.head_dim
        for mod in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if not (isinstance(mod, W8A8Linear) or type(mod) is nn.Linear):
                raise TypeError(f"{self.where}: can only shard nn.Linear and W8A8Linear projections, got "
                                f"{type(mod).__name__}")
        r = self.kv_replicas
        attn.qkv_proj = shard_linear(attn.qkv_proj, "colwise", g, check=False,
                                     output_sizes=[c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d],
                                     replicas=None if r == 1 else [1, r, r])
        attn.o_proj = shard_linear(attn.o_proj, "rowwise", g, check=False)
        mlp.gate_up_proj = shard_linear(mlp.gate_up_proj, "colwise", g, check=False,
                                        output_sizes=[c.intermediate_size, c.intermediate_size])
        mlp.down_proj = shard_linear(mlp.down_proj, "rowwise", g, check=False)
        attn.num_heads = c.num_heads // self.world
        attn.num_kv_heads = c.num_kv_heads * r // self.world
        attn.kv_cache = None
        layer.use_layer_op = False
        return layer

    def shard_lm_head(self, lm_head: nn.Module) -> nn.Module:
        """This rank's vocabulary slice of a full ``lm_head`` (``nn.Linear`` or `W8A8Linear`), column-parallel with
        ``gather_output=True``: its ``forward`` returns the full ``(B, vocab)`` logits on every rank."""
        head = shard_linear(lm_head, "colwise", self.ctx, check=False)
        head.gather_output = True
        return head

    def build_hook(self, name: str, module: nn.Module) -> nn.Module:
        """`LlamaDecoder`'s ``build_hook``: each decoder layer sharded (``sharder(layer)``) and ``lm_head`` sharded
        over the vocabulary when ``tp_lm_head``, right after the decoder builds them; the embedding and the final
        norm kept whole (replicated)."""
        if name.startswith("layers."):
            return self(module)
        if name == "lm_head" and self.tp_lm_head:
            return self.shard_lm_head(module)
        return module


class TensorParallelLlamaDecoder(_TensorParallel, LlamaDecoder):
    """This rank's tensor-parallel shard of a `cutlass_w8a8.models.LlamaDecoder` (module docstring): a `LlamaDecoder`
    whose layers hold the rank's heads and MLP slice, and whose ``forward`` takes the same ``(B,)`` inputs on every
    rank and returns the full ``(B, vocab)`` logits on every rank.

    ``TensorParallelLlamaDecoder(config, quant, tp_group=g, ...)`` builds it: every rank passes the same arguments;
    the weights are exactly the shards of the unsharded ``LlamaDecoder(config, quant, ...)`` of the same seed (each
    layer built full, then sharded before the next is built). `shard_decoder_` turns a full model into one in place.

    Parameters
    ----------
    config, quant, dtype, quant_lm_head, **kwargs
        As `LlamaDecoder` (``max_batch``, ``max_seq_len``, ``device``, ``seed``); checked first, as there.
    tp_group : torch.distributed.ProcessGroup or TPContext
        The group; resolved once (`TPContext`), checked across ranks once, and passed to every layer.
    tp_size : int, optional
        Checked against the group's size on every rank.
    tp_lm_head : bool or None
        None (default) shards ``lm_head`` over the vocabulary (its logits all-gathered) when ``vocab_size`` is
        divisible by the world size, True always, False keeps it replicated.

    Attributes
    ----------
    tp_group, tp_rank, tp_size
        The group, this rank, the world size.

    Raises
    ------
    NotImplementedError
        A mixture-of-experts config (``num_experts > 0``): its tensor parallelism is not implemented.
    ValueError, TypeError
        As `LlamaDecoder`, then as `DecoderSharder` (the same on every rank).
    """

    def __init__(self, config, quant=None, *, tp_group, tp_size: Optional[int] = None,
                 tp_lm_head: Optional[bool] = None, dtype: torch.dtype = torch.bfloat16, quant_lm_head: bool = False,
                 **kwargs):
        scheme = decoder_scheme(config, quant, dtype, quant_lm_head)
        if config.is_moe:
            raise NotImplementedError("LlamaDecoder: tensor parallelism of the mixture-of-experts layers "
                                      f"(num_experts = {config.num_experts}) is not implemented; pass tp_group=None")
        # checked across ranks before anything is built; each layer is built full (the same weights as the
        # unsharded model of this seed), then sharded
        sharder = DecoderSharder(config, tp_group, scheme, dtype, tp_size, tp_lm_head)
        super().__init__(config, quant, dtype=dtype, quant_lm_head=quant_lm_head, build_hook=sharder.build_hook,
                         **kwargs)
        self._tp, self.tp_rank, self.tp_size = sharder.ctx, sharder.rank, sharder.world

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", tp_rank={self.tp_rank}, tp_size={self.tp_size}" if self.tp_size > 1 else "")


def shard_decoder_(model, tp_group, *, tp_size: Optional[int] = None, tp_lm_head: Optional[bool] = None):
    """Turn a full `cutlass_w8a8.models.LlamaDecoder` into this rank's tensor-parallel shard, in place: the model
    becomes a `TensorParallelLlamaDecoder`.

    Every rank must call it on an identical model (e.g. built from the same config and seed): its layers are
    sharded as described in this module's docstring, its KV cache reallocated (zeroed, ``KVH / tp`` heads per
    layer), and ``model.tp_group`` / ``tp_rank`` / ``tp_size`` set. The result's ``forward`` takes the same
    ``(B,)`` inputs on every rank and returns the full ``(B, vocab)`` logits on every rank; its weights are
    exactly the shards of the full model's (no re-quantization), so it can be compared with the full model.

    Parameters
    ----------
    model : LlamaDecoder
        Unsharded.
    tp_group : torch.distributed.ProcessGroup or TPContext
    tp_size : int, optional
        Checked against the group's size on every rank.
    tp_lm_head : bool or None
        Shard ``lm_head`` over the vocabulary (`DecoderSharder.shard_lm_head`): None (default) when ``vocab_size``
        is divisible by the world size, True always, False never (replicated).

    Returns
    -------
    TensorParallelLlamaDecoder
        ``model``.

    Raises
    ------
    ValueError
        As `DecoderSharder`; ``model`` is already sharded.
    """
    if getattr(model, "tp_size", 1) != 1:
        raise ValueError(f"shard_decoder_: `model` is already sharded (tp_size = {model.tp_size})")
    sharder = DecoderSharder(model.config, tp_group, model.quant, model.dtype, tp_size, tp_lm_head)
    for i, layer in enumerate(model.layers):
        model.layers[i] = sharder.build_hook(f"layers.{i}", layer)
    model.lm_head = sharder.build_hook("lm_head", model.lm_head)
    # the model is now what TensorParallelLlamaDecoder builds (torch.nn.utils.parametrize swaps classes the same way)
    if not isinstance(model, TensorParallelLlamaDecoder):
        model.__class__ = TensorParallelLlamaDecoder
    model._tp, model.tp_rank, model.tp_size = sharder.ctx, sharder.rank, sharder.world
    model.allocate_cache(model.max_batch, model.max_seq_len)
    return model
