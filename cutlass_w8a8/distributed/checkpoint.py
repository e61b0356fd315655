"""Sharded loading of a compressed-tensors checkpoint: ``cutlass_w8a8.from_pretrained(path, tp_group=g)``.

`cutlass_w8a8.checkpoints.from_pretrained` parses and checks the config and the safetensors headers as for an
unsharded load, then calls `load_tensor_parallel`, which does not use transformers' weight loader (it reads
every tensor whole): the model is built on the meta device from its config, each linear that the plan shards
is replaced by its parallel layer built from this rank's slice of each tensor, read with safetensors'
``get_slice(name)[rows]`` / ``[:, cols]`` (only the rank's bytes leave the file), every other tensor is read
whole (replicated), and buffers that are not in the checkpoint (the rotary ``inv_freq``) are recomputed by the
model's own ``_init_weights``.

What a transformers model needs for this: attention that infers its head count from the projection output
(``view(*shape, -1, head_dim)``: Llama, Mistral, Qwen2 and most decoders of transformers 5), a dynamic KV cache,
and ``config.num_attention_heads`` / ``num_key_value_heads`` divisible by the world size. The embedding,
``lm_head`` and norms are replicated.
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict, Optional

import torch
from torch import nn

from ..linear import W8A8Linear
from . import sharding as S
from ._group import check_same_on_all_ranks, group_rank_size, sequence_code
from .float_linear import ColumnParallelLinear, RowParallelLinear
from .linear import ColumnParallelW8A8Linear, RowParallelW8A8Linear
from .plan import LLAMA_TP_PLAN, _heads, _inferred_sizes, match_plan

__all__ = ["load_tensor_parallel"]

_WHERE = "cutlass_w8a8.from_pretrained(tp_group=...)"


class _Reader:
    """Reads of whole tensors or of row / column slices from the checkpoint's files (each opened once)."""

    def __init__(self, file_of: Dict[str, str], stack: contextlib.ExitStack):
        from safetensors import safe_open

        self.file_of = file_of
        self._files = {f: stack.enter_context(safe_open(f, framework="pt")) for f in sorted(set(file_of.values()))}

    def whole(self, key: str) -> torch.Tensor:
        return self._files[self.file_of[key]].get_tensor(key)

    def rows(self, key: str, ranges) -> torch.Tensor:
        sl = self._files[self.file_of[key]].get_slice(key)
        parts = [sl[a:b] for a, b in ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def cols(self, key: str, a: int, b: int) -> torch.Tensor:
        return self._files[self.file_of[key]].get_slice(key)[:, a:b]


def _build_meta(model_cls, config, dtype: torch.dtype, shared: dict, model_kwargs: dict) -> nn.Module:
    from transformers import PreTrainedModel

    kw = {}
    if "attn_implementation" in model_kwargs:
        kw["attn_implementation"] = model_kwargs.pop("attn_implementation")
    if model_kwargs:
        raise TypeError(f"{_WHERE}: {sorted(model_kwargs)} cannot be used with `tp_group` (the sharded loader does "
                        "not go through transformers' from_pretrained)")
    with torch.device("meta"):
        if isinstance(model_cls, type) and issubclass(model_cls, PreTrainedModel):
            return model_cls._from_config(config, dtype=dtype, **kw)
        if "trust_remote_code" in shared:
            kw["trust_remote_code"] = shared["trust_remote_code"]
        return model_cls.from_config(config, dtype=dtype, **kw)


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def load_tensor_parallel(path: str, model_cls, config, parsed, targeted: dict, ckpt, dtype: torch.dtype, device,
                         tp_group, tp_plan: Optional[dict], shared: dict, model_kwargs: dict) -> nn.Module:
    """This rank's tensor-parallel shard of the checkpoint at ``path`` as a transformers model (see the module
    docstring); the arguments are those `from_pretrained` has parsed and checked (``targeted``: the quantized
    linears and their schemes; ``ckpt``: the checkpoint's tensor index).

    Raises
    ------
    ValueError
        (the same on every rank) the ranks disagree on the checkpoint's planned layers or shapes; a planned size or
        the config's head counts are not divisible by the world size; a W8A8 shard breaks the kernels' alignment;
        the checkpoint lacks a tensor the model needs.
    TypeError
        A transformers keyword argument that only transformers' own loader understands.
    """
    rank, world = group_rank_size(tp_group, _WHERE)
    device = torch.device(device) if device is not None else torch.device("cpu")
    model = _build_meta(model_cls, config, dtype, shared, dict(model_kwargs))
    plan = LLAMA_TP_PLAN if tp_plan is None else tp_plan
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    planned = {}
    for name, mod in linears.items():
        spec = match_plan(name, plan)
        if spec is not None:
            style, sizes = spec
            if style == "colwise" and sizes is None:
                sizes = _inferred_sizes(name, mod, config) or [mod.out_features]
            planned[name] = (style, sizes)
    heads = _heads(config)
    names = sorted(planned)
    check_same_on_all_ranks(tp_group, _WHERE, {
        "planned layers": len(names), "#layer shapes": sequence_code(
            [v for n in names for v in (linears[n].out_features, linears[n].in_features)]),
        "#quantized layers": sequence_code([n in targeted for n in names]), "#heads": sequence_code(heads or ()),
        "dtype": {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 0)})
    if not planned:
        raise ValueError(f"{_WHERE}: no nn.Linear of {type(model).__name__} matches `tp_plan` ({list(plan)})")
    if heads is not None:
        for label, v in (("num_attention_heads", heads[0]), ("num_key_value_heads", heads[1])):
            if v % world:
                raise ValueError(f"{_WHERE}: `config.{label}` = {v} is not divisible by the tensor-parallel world "
                                 f"size {world}")
    for name, (style, sizes) in planned.items():  # every shape error before any read
        lin = linears[name]
        if style == "colwise":
            S.check_column_shardable(lin.out_features, lin.in_features, world, sizes, f"{_WHERE} {name!r}",
                                     quantized=name in targeted)
        else:
            S.check_row_shardable(lin.out_features, lin.in_features, world, f"{_WHERE} {name!r}",
                                  quantized=name in targeted)

    with contextlib.ExitStack() as stack:
        reader = _Reader(ckpt.file_of, stack)
        replaced = set()
        for name, lin in linears.items():
            spec, t = planned.get(name), targeted.get(name)
            if spec is None and t is None:
                continue  # a float, replicated linear: loaded with the other parameters below
            new = _load_linear(reader, name, lin, spec, t, dtype, device, tp_group, rank, world)
            new.train(False)
            _set_module(model, name, new)
            replaced.add(name)
        _load_rest(model, reader, ckpt, replaced, device, config)
    _init_missing_buffers(model, device)
    model.eval()
    model.config.quantization_config = parsed.to_dict()
    gen = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen) and getattr(model, "generation_config", None) is not None:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)
    return model


def _load_linear(reader: _Reader, name: str, lin: nn.Linear, spec, target, dtype, device, group, rank, world):
    n, k = lin.out_features, lin.in_features
    has_bias = lin.bias is not None

    def key(leaf: str) -> str:
        return f"{name}.{leaf}"

    def dev(t):
        return None if t is None else t.to(device)

    if target is None:  # a float linear the plan shards
        style, sizes = spec
        if style == "colwise":
            ranges = S.column_rows(sizes, rank, world)
            w = reader.rows(key("weight"), ranges).to(device=device, dtype=dtype)
            b = reader.rows(key("bias"), ranges).to(device=device, dtype=dtype) if has_bias else None
            return ColumnParallelLinear.from_shard(w, group, output_sizes=sizes, bias=b)
        a, z = S.shard_range(k, rank, world)
        w = reader.cols(key("weight"), a, z).to(device=device, dtype=dtype)
        b = reader.whole(key("bias")).to(device=device, dtype=dtype) if has_bias else None
        return RowParallelLinear.from_shard(w, group, bias=b)

    s = target.scheme
    input_scale = dev(reader.whole(key("input_scale"))) if s.static_input else None
    if spec is None:  # quantized, replicated
        return W8A8Linear.from_quantized(
            dev(reader.whole(key("weight"))), dev(reader.whole(key("weight_scale"))),
            bias=dev(reader.whole(key("bias"))) if has_bias else None, input_scale=input_scale, dtype=dtype)
    style, sizes = spec
    if style == "colwise":
        ranges = S.column_rows(sizes, rank, world)
        per_channel = s.per_channel  # (N, 1) per channel (ckpt.check verified the shape), else (1,)
        scale = reader.rows(key("weight_scale"), ranges) if per_channel else reader.whole(key("weight_scale"))
        return ColumnParallelW8A8Linear.from_shard(
            dev(reader.rows(key("weight"), ranges)), dev(scale), group, output_sizes=sizes,
            bias=dev(reader.rows(key("bias"), ranges)) if has_bias else None, input_scale=input_scale, dtype=dtype,
            check=False)
    a, z = S.shard_range(k, rank, world)
    return RowParallelW8A8Linear.from_shard(
        dev(reader.cols(key("weight"), a, z)), dev(reader.whole(key("weight_scale"))), group,
        bias=dev(reader.whole(key("bias"))) if has_bias else None, input_scale=input_scale, dtype=dtype,
        check=False)


def _load_rest(model: nn.Module, reader: _Reader, ckpt, replaced: set, device, config) -> None:
    """Every parameter and persistent buffer outside the replaced linears, read whole and cast to the dtype the
    meta model gave it; a missing output embedding is tied to the input embedding when the config says so."""
    missing = []
    for mod_name, mod in model.named_modules():
        if mod_name in replaced or any(mod_name.startswith(r + ".") for r in replaced):
            continue
        persistent = [b for b in mod._buffers if b not in mod._non_persistent_buffers_set]
        for leaf in list(mod._parameters) + persistent:
            t = mod._parameters[leaf] if leaf in mod._parameters else mod._buffers[leaf]
            if t is None or t.device.type != "meta":
                continue
            key = f"{mod_name}.{leaf}" if mod_name else leaf
            if key not in ckpt.meta:
                missing.append(key)
                continue
            value = reader.whole(key).to(device=device, dtype=t.dtype)
            if leaf in mod._parameters:
                mod._parameters[leaf] = nn.Parameter(value, requires_grad=False)
            else:
                mod._buffers[leaf] = value
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tie = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                  "tie_word_embeddings", False)
    if out_emb is not None and in_emb is not None and tie and out_emb.weight.device.type == "meta":
        out_emb.weight = in_emb.weight
        missing = [m for m in missing if not m.endswith(".weight") or model.get_submodule(m[:-7]) is not out_emb]
    if missing:
        raise ValueError(f"{_WHERE}: the checkpoint has no tensor {missing[0]!r}" +
                         (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "") +
                         ", which the model needs")


def _init_missing_buffers(model: nn.Module, device) -> None:
    """Buffers the checkpoint does not hold (non-persistent: the rotary ``inv_freq``) are still on the meta
    device: allocate them and let the model's ``_init_weights`` compute them."""
    for name, mod in model.named_modules():
        if any(b is not None and b.device.type == "meta" for b in mod._buffers.values()):
            if any(p is not None and p.device.type == "meta" for p in mod._parameters.values()):
                raise RuntimeError(f"{_WHERE}: module {name!r} still has parameters on the meta device; please report "
                                   "this")
            mod.to_empty(device=device, recurse=False)
            model._init_weights(mod)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"{_WHERE}: {left[:4]} were neither in the checkpoint nor initialized by the model")
