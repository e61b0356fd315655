"""Sharded loading of a checkpoint (compressed-tensors, or transformers-native block fp8):
``cutlass_w8a8.from_pretrained(path, tp_group=g)``.

`cutlass_w8a8.checkpoints.from_pretrained` parses and checks the config and the safetensors headers as for an
unsharded load, then calls `load_tensor_parallel`, which does not use transformers' weight loader (it reads
every tensor whole): the model is built on the meta device from its config, each linear that the plan shards
is replaced by its parallel layer built from this rank's slice of each tensor, read with safetensors'
``get_slice(name)[rows]`` / ``[:, cols]`` (only the rank's bytes leave the file), every other tensor is read
whole (replicated), and buffers that are not in the checkpoint (the rotary ``inv_freq``) are recomputed by the
model's own ``_init_weights`` (the meta-model machinery is `cutlass_w8a8.checkpoints._direct`'s).

What a transformers model needs for this: attention that infers its head count from the projection output
(``view(*shape, -1, head_dim)``: Llama, Mistral, Qwen2 and most decoders of transformers 5), a dynamic KV cache,
``config.num_attention_heads`` divisible by the world size, and ``num_key_value_heads`` divisible by it or dividing
it: with fewer key/value heads than ranks each rank reads the one head it needs (``r * KVH // world``, replicated
over ``world / KVH`` ranks, as vLLM does; `cutlass_w8a8.distributed.plan.tensor_parallel_`). Multi-head latent
attention (DeepSeek-V3) is read split by heads as the plan's attention layouts say (``q_b_proj`` / ``kv_b_proj``
rows, ``o_proj`` columns, the latents ``q_a_proj`` / ``kv_a_proj_with_mqa`` whole; `cutlass_w8a8.distributed.plan.
attention_splits`, which also refuses, before any read, an attention that cannot be split so). The embedding and
norms are replicated; ``lm_head`` (style ``"vocab"`` of the default plan) is read and computed over this rank's
``vocab / world`` rows, its logits all-gathered, unless it is tied to the embedding or its N does not split
(`cutlass_w8a8.distributed.plan`): then it is replicated.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from ..checkpoints._direct import (Reader, block_rows, block_size, build_meta, init_missing_buffers,
                                   load_generation_config, load_rest, set_module)
from ..checkpoints._moe import build_moe, checkpoint_renamer, fill_float_experts, link_correction_biases
from ..linear import W8A8Linear
from ..ops._limits import BLOCK_SIZE
from . import sharding as S
from ._common import TPContext
from ._group import check_same_on_all_ranks, sequence_code
from .float_linear import ColumnParallelLinear, RowParallelLinear
from .linear import ColumnParallelW8A8Linear, RowParallelW8A8Linear
from .moe import TensorParallelW8A8MoE, routing_kwargs
from .plan import (LLAMA_TP_PLAN, _heads, _inferred_sizes, attention_splits, head_replicas, layer_replicas,
                   match_plan, set_attention_heads_, vocab_shardable)

__all__ = ["load_tensor_parallel"]

_WHERE = "cutlass_w8a8.from_pretrained(tp_group=...)"


def load_tensor_parallel(path: str, model_cls, config, parsed, targeted: dict, ckpt, dtype: torch.dtype, device,
                         tp_group, tp_plan: Optional[dict], shared: dict, model_kwargs: dict,
                         moe: Optional[dict] = None) -> nn.Module:
    """This rank's tensor-parallel shard of the checkpoint at ``path`` as a transformers model (see the module
    docstring); the arguments are those `from_pretrained` has parsed and checked (``targeted``: the quantized
    linears, their schemes and the name of their scale tensor; ``ckpt``: the checkpoint's tensor index).

    ``moe``: ``{experts module name: MoeTarget}`` of an MoE checkpoint (`cutlass_w8a8.checkpoints._moe`): each
    quantized experts module becomes a `TensorParallelW8A8MoE` built from this rank's ``I / world`` intermediate
    channels of every expert, read as slices (`_moe.build_moe` with ``shard``); float experts are replicated.

    Block-scaled fp8 layers (128 x 128 weight blocks) are split on block boundaries: a column-parallel shard
    keeps whole row blocks (its ``N / world`` rows, each stacked matrix's share a multiple of 128) and the
    matching rows of the ``[ceil(N / 128), K / 128]`` scale; a row-parallel shard keeps ``K / world`` columns, a
    multiple of 128, and the matching scale columns.

    Raises
    ------
    ValueError
        (the same on every rank) the ranks disagree on the checkpoint's planned layers or shapes; a planned size or
        the config's head counts are not divisible by the world size; an attention module that the plan splits but
        that cannot be split by heads (`cutlass_w8a8.distributed.plan.attention_splits`, naming the module); a W8A8
        shard breaks the kernels' alignment;
        a block-scaled layer's shard would split a 128 x 128 weight block (the message names the layer and its N
        or K); the checkpoint lacks a tensor the model needs.
    TypeError
        A transformers keyword argument that only transformers' own loader understands.
    """
    ctx = TPContext.resolve(tp_group, _WHERE)  # once: every layer below is given this context
    rank, world = ctx.rank, ctx.world
    device = torch.device(device) if device is not None else torch.device("cpu")
    model = build_meta(model_cls, config, dtype, shared, model_kwargs, _WHERE)
    plan = LLAMA_TP_PLAN if tp_plan is None else tp_plan
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    planned = {}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for name, mod in linears.items():
        spec = match_plan(name, plan)
        if spec is not None:
            style, sizes = spec
            if style == "vocab":  # the lm_head over the vocabulary, where it splits (else replicated)
                t = targeted.get(name)
                if tied or not vocab_shardable(mod.out_features, mod.in_features, world, t is not None,
                                               t is not None and t.scheme.block):
                    continue
                sizes = [mod.out_features]
            if style == "colwise" and sizes is None:
                sizes = _inferred_sizes(name, mod, config) or [mod.out_features]
            planned[name] = (style, sizes)
    heads = _heads(config)
    names = sorted(planned)
    moe = moe or {}
    experts = [(n, t) for n, t in sorted(moe.items()) if t.scheme is not None]  # float experts are replicated
    check_same_on_all_ranks(ctx, _WHERE, {
        # the quantized experts, sharded below with check=False: this is their one cross-rank check
        "experts layers": len(experts), "#experts sizes": sequence_code([v for _, t in experts for v in (
            t.block.num_experts, t.block.top_k, t.block.hidden_size, t.block.intermediate_size,
            int(t.block.renormalize), int(t.scheme.block), int(t.scheme.static_input))]),
        "planned layers": len(names), "#layer shapes": sequence_code(
            [v for n in names for v in (linears[n].out_features, linears[n].in_features)]),
        "#quantized layers": sequence_code([n in targeted for n in names]),
        "#block layers": sequence_code([n in targeted and targeted[n].scheme.block for n in names]),
        "#heads": sequence_code(heads or ()), "#vocab layers": sequence_code([planned[n][0] == "vocab" for n in names]),
        "dtype": {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 0)})
    if not planned:
        raise ValueError(f"{_WHERE}: no nn.Linear of {type(model).__name__} matches `tp_plan` ({list(plan)})")
    splits = attention_splits(model, {n: planned[n][0] for n in names}, world, _WHERE)
    ctx = ctx.with_kv_replicas(head_replicas(heads, names, world, _WHERE))
    rep = ctx.kv_replicas
    for name, (style, sizes) in planned.items():  # every shape error before any read
        lin, t = linears[name], targeted.get(name)
        block = t is not None and t.scheme.block
        if style in ("colwise", "vocab"):
            S.check_column_shardable(lin.out_features, lin.in_features, world, sizes, f"{_WHERE} {name!r}",
                                     quantized=t is not None, block=block, replicas=layer_replicas(name, sizes, rep))
        else:
            S.check_row_shardable(lin.out_features, lin.in_features, world, f"{_WHERE} {name!r}",
                                  quantized=t is not None, block=block)

    for name, t in moe.items():  # before any read
        if t.scheme is not None:
            S.check_moe_shardable(t.block.intermediate_size, world, t.scheme.block, f"{_WHERE} {name!r}")

    with contextlib.ExitStack() as stack:
        reader = Reader(ckpt.file_of, stack, ckpt.stored)
        replaced = set()
        for name, t in moe.items():
            replaced.add(name)
            if t.scheme is None:
                fill_float_experts(model, t, reader, device, dtype)
                continue
            i = t.block.intermediate_size
            local = i // world
            part = build_moe(t, reader, device, dtype, _WHERE, shard=(rank * local, (rank + 1) * local))
            new = TensorParallelW8A8MoE.from_shard(
                part.w13, part.w13_scale, part.w2, part.w2_scale, ctx, top_k=part.top_k, intermediate_size=i,
                dtype=dtype, renormalize=part.renormalize, weight_block_size=part.weight_block_size,
                a13_scale=part.a13_scale, a2_scale=part.a2_scale, check=False, **routing_kwargs(part))
            new.train(False)
            set_module(model, name, new)
        for name, lin in linears.items():
            spec, t = planned.get(name), targeted.get(name)
            if spec is None and t is None:
                continue  # a float, replicated linear: loaded with the other parameters below
            replicas = layer_replicas(name, spec[1], rep) if spec is not None and spec[0] == "colwise" else None
            new = _load_linear(reader, name, lin, spec, t, dtype, device, ctx, replicas)
            if spec is not None and spec[0] == "vocab":
                new.gather_output = True  # every rank returns the full logits
            new.train(False)
            set_module(model, name, new)
            replaced.add(name)
        load_rest(model, reader, ckpt.meta, replaced, device, config, _WHERE,
                  rename=checkpoint_renamer([t.block for t in moe.values()]))
    link_correction_biases(model, moe)
    init_missing_buffers(model, device, _WHERE)
    set_attention_heads_(model, splits, heads, world, rep)
    model.eval()
    model.config.quantization_config = parsed.to_dict()
    load_generation_config(model, path)
    return model


def _load_linear(reader: Reader, name: str, lin: nn.Linear, spec, target, dtype, device, ctx: TPContext,
                 replicas=None):
    rank, world = ctx.rank, ctx.world
    n, k = lin.out_features, lin.in_features
    has_bias = lin.bias is not None
    if spec is not None and spec[0] == "vocab":  # column-parallel over the vocabulary (the caller gathers)
        spec = ("colwise", spec[1])

    def key(leaf: str) -> str:
        return f"{name}.{leaf}"

    def dev(t):
        return None if t is None else t.to(device)

    if target is None:  # a float linear the plan shards
        style, sizes = spec
        if style == "colwise":
            ranges = S.column_rows(sizes, rank, world, replicas)
            w = reader.rows(key("weight"), ranges).to(device=device, dtype=dtype)
            b = reader.rows(key("bias"), ranges).to(device=device, dtype=dtype) if has_bias else None
            return ColumnParallelLinear.from_shard(w, ctx, output_sizes=sizes, bias=b, replicas=replicas)
        a, z = S.shard_range(k, rank, world)
        w = reader.cols(key("weight"), a, z).to(device=device, dtype=dtype)
        b = reader.whole(key("bias")).to(device=device, dtype=dtype) if has_bias else None
        return RowParallelLinear.from_shard(w, ctx, bias=b)

    s, scale_key = target.scheme, key(target.scale_leaf)
    input_scale = dev(reader.whole(key("input_scale"))) if s.static_input else None
    if spec is None:  # quantized, replicated
        return W8A8Linear.from_quantized(
            dev(reader.whole(key("weight"))), dev(reader.whole(scale_key).float()),
            bias=dev(reader.whole(key("bias"))) if has_bias else None, input_scale=input_scale, dtype=dtype,
            weight_block_size=block_size(s))
    style, sizes = spec
    if style == "colwise":
        ranges = S.column_rows(sizes, rank, world, replicas)
        if s.block:  # the scale rows of the shard's row blocks (check_column_shardable: whole blocks)
            scale = reader.rows(scale_key, block_rows(ranges))
        elif s.per_channel:  # (N, 1) per channel (ckpt.check verified the shape), else (1,)
            scale = reader.rows(scale_key, ranges)
        else:
            scale = reader.whole(scale_key)
        return ColumnParallelW8A8Linear.from_shard(
            dev(reader.rows(key("weight"), ranges)), dev(scale.float()), ctx, output_sizes=sizes,
            bias=dev(reader.rows(key("bias"), ranges)) if has_bias else None, input_scale=input_scale, dtype=dtype,
            weight_block_size=block_size(s), check=False, replicas=replicas)
    a, z = S.shard_range(k, rank, world)
    # block scales: the shard's column blocks (check_row_shardable: K / world is a multiple of 128)
    scale = reader.cols(scale_key, a // BLOCK_SIZE, z // BLOCK_SIZE) if s.block else reader.whole(scale_key)
    return RowParallelW8A8Linear.from_shard(
        dev(reader.cols(key("weight"), a, z)), dev(scale.float()), ctx,
        bias=dev(reader.whole(key("bias"))) if has_bias else None, input_scale=input_scale, dtype=dtype,
        weight_block_size=block_size(s), check=False)
