"""Tensor-parallel plans: which linears of a model are column- or row-parallel, by the end of their name
(transformers' ``base_model_tp_plan`` names), and `tensor_parallel_`, which shards a whole model in place by one.

Style ``"vocab"`` (the default plan's ``lm_head``): column-parallel over the vocabulary with the logits all-gathered
(``gather_output=True``: every rank returns the full logits, each computing ``vocab / world`` of them and reading
``1 / world`` of the weight; vLLM's ``ParallelLMHead``). It applies only where it can: a layer tied to the input
embedding, or whose N does not split (not divisible by the world size, a W8A8 shard not a multiple of 16 rows, a
block-scaled shard not whole 128-row blocks), stays replicated. A plan without ``lm_head`` keeps it replicated.

A plan is a dict ``{pattern: style}``: ``pattern`` is a dotted suffix of a module's fully qualified name, each
component matched with ``fnmatch`` (``"q_proj"``, ``"self_attn.q_proj"``, ``"layers.*.self_attn.q_proj"``);
``style`` is ``"colwise"``, ``"rowwise"``, or ``("colwise", output_sizes)`` for a fused layer. The first pattern
(in dict order) that matches decides. `LLAMA_TP_PLAN` is the default: the projections of Llama-family models
(transformers' names, and vLLM's fused ``qkv_proj`` / ``gate_up_proj``).
"""

from __future__ import annotations

import fnmatch
import zlib
from typing import Optional

from torch import nn

from ..linear import W8A8Linear
from ._common import TPContext, _TensorParallel
from ._group import check_same_on_all_ranks, sequence_code
from .linear import shard_linear
from .sharding import STYLES

__all__ = ["LLAMA_TP_PLAN", "match_plan", "tensor_parallel_"]

#: The default plan: attention and MLP projections of Llama-family models (transformers' ``LlamaConfig.
#: base_model_tp_plan`` names, plus the fused ``qkv_proj`` / ``gate_up_proj`` of vLLM's layout and of
#: `cutlass_w8a8.models.LlamaDecoder`), and ``lm_head`` over the vocabulary (style ``"vocab"``). Embeddings stay
#: replicated.
LLAMA_TP_PLAN = {
    "q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "qkv_proj": "colwise",
    "o_proj": "rowwise",
    "gate_proj": "colwise", "up_proj": "colwise", "gate_up_proj": "colwise",
    "down_proj": "rowwise",
    "lm_head": "vocab",
}

#: The styles a plan may name: `sharding.STYLES` and ``"vocab"`` (column-parallel, output gathered; see above).
PLAN_STYLES = STYLES + ("vocab",)

_WHERE = "tensor_parallel_"


def _matches(pattern: str, fqn: str) -> bool:
    p, f = pattern.split("."), fqn.split(".")
    return len(f) >= len(p) and all(fnmatch.fnmatchcase(fc, pc) for fc, pc in zip(f[-len(p):], p))


def match_plan(fqn: str, plan: dict):
    """``(style, output_sizes or None)`` of the first pattern of ``plan`` matching ``fqn``, or None."""
    for pattern, spec in plan.items():
        if _matches(pattern, fqn):
            if isinstance(spec, str):
                style, sizes = spec, None
            else:
                style, sizes = spec[0], list(spec[1])
            if style not in PLAN_STYLES:
                raise ValueError(f"{_WHERE}: `tp_plan[{pattern!r}]` must be 'colwise', 'rowwise', 'vocab' or "
                                 f"('colwise', output_sizes), got {spec!r}")
            if style != "colwise" and sizes is not None:
                raise ValueError(f"{_WHERE}: `tp_plan[{pattern!r}]`: output_sizes are for 'colwise' layers")
            return style, sizes
    return None


def _heads(config) -> Optional[tuple[int, int, int]]:
    """``(num_heads, num_kv_heads, head_dim)`` from a transformers or cutlass_w8a8 config, or None."""
    if config is None:
        return None
    h = getattr(config, "num_attention_heads", None) or getattr(config, "num_heads", None)
    if not h:
        return None
    kvh = getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None) or h
    d = getattr(config, "head_dim", None) or config.hidden_size // h
    return int(h), int(kvh), int(d)


def _inferred_sizes(fqn: str, linear: nn.Module, config) -> Optional[list]:
    """output_sizes of a fused ``qkv_proj`` (from the config's head counts) or ``gate_up_proj`` (two halves)."""
    leaf = fqn.rsplit(".", 1)[-1]
    n = linear.weight.shape[0]
    if leaf == "gate_up_proj":
        return [n // 2, n // 2] if n % 2 == 0 else None
    if leaf == "qkv_proj":
        heads = _heads(config)
        if heads is None:
            raise ValueError(f"{_WHERE}: cannot tell the q, k and v sizes of the fused {fqn!r} (the model has no "
                             "config with head counts): give them in the plan, ('colwise', [q, k, v])")
        h, kvh, d = heads
        sizes = [h * d, kvh * d, kvh * d]
        if sum(sizes) != n:
            raise ValueError(f"{_WHERE}: {fqn!r} has {n} outputs but the config's heads give q, k, v = {sizes}")
        return sizes
    return None


_KV_LEAVES = ("k_proj", "v_proj")
_ATTN_LEAVES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")


def layer_replicas(fqn: str, sizes, rep: int) -> Optional[list]:
    """The ``replicas`` of a planned column-parallel layer (`sharding.column_rows`) when each key/value head is
    shared by ``rep`` ranks (`sharding.kv_replicas`): ``[rep]`` for ``k_proj`` / ``v_proj``, ``[1, rep, rep]`` for
    a fused ``qkv_proj`` (``output_sizes`` q, k, v), None otherwise (and whenever ``rep`` is 1)."""
    if rep == 1:
        return None
    leaf = fqn.rsplit(".", 1)[-1]
    if leaf in _KV_LEAVES:
        return [rep]
    if leaf == "qkv_proj" and sizes is not None and len(sizes) == 3:
        return [1, rep, rep]
    return None


def head_replicas(heads, planned_names, world: int, where: str) -> int:
    """`sharding.kv_replicas` of the config's heads when the plan shards attention projections, else 1.
    ValueError (naming the config field) when the head counts cannot be split over ``world`` ranks."""
    if heads is None or not any(f.rsplit(".", 1)[-1] in _ATTN_LEAVES for f in planned_names):
        return 1
    from .sharding import kv_replicas

    return kv_replicas(heads[0], heads[1], world, where)


def set_attention_groups_(model: nn.Module, heads, world: int, rep: int) -> None:
    """After a shard with replicated key/value heads (``rep > 1``), give transformers' attention modules their
    per-rank ``num_key_value_groups``: this rank's ``H / world`` query heads all read its one key/value head (the
    config's ``H / KVH`` would repeat that head too often: `repeat_kv`)."""
    if rep == 1 or heads is None:
        return
    h, kvh, _ = heads
    local_q, local_kv = h // world, kvh * rep // world
    for mod in model.modules():
        if hasattr(mod, "num_key_value_groups") and isinstance(getattr(mod, "num_key_value_groups"), int):
            mod.num_key_value_groups = local_q // local_kv


def vocab_shardable(n: int, k: int, world: int, quantized: bool, block: bool) -> bool:
    """Whether a ``"vocab"`` layer (N = vocabulary) splits over ``world`` ranks (`sharding.check_column_shardable`
    passes); when not, it stays replicated."""
    from .sharding import check_column_shardable

    try:
        check_column_shardable(n, k, world, None, "vocab", quantized=quantized, block=block)
    except ValueError:
        return False
    return world > 1


def _tied_to_input_embedding(model: nn.Module, mod: nn.Module) -> bool:
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    return emb is not None and getattr(emb, "weight", None) is getattr(mod, "weight", None)


def tensor_parallel_(model: nn.Module, tp_group, tp_plan: Optional[dict] = None, *,
                     tp_size: Optional[int] = None) -> nn.Module:
    """Shard ``model`` in place for tensor parallelism over ``tp_group`` by ``tp_plan``.

    Every ``nn.Linear`` or `W8A8Linear` whose name matches the plan is replaced by its shard (`shard_linear`):
    `W8A8Linear` -> `ColumnParallelW8A8Linear` / `RowParallelW8A8Linear`, float ``nn.Linear`` ->
    `ColumnParallelLinear` / `RowParallelLinear`; everything else stays replicated. A fused ``qkv_proj`` /
    ``gate_up_proj`` without explicit output sizes gets them from the model's config / as two halves.

    A `cutlass_w8a8.models.LlamaDecoder` is sharded by `shard_decoder_` (its attention's head counts and KV cache
    change with its projections; ``tp_plan`` must be None). A transformers model works when its attention infers
    the head count from the projection's output (``view(..., -1, head_dim)``, as Llama, Qwen2, Mistral do) and
    uses a dynamic KV cache (a static cache sized from ``config.num_key_value_heads`` would be too large).

    Key/value heads fewer than the ranks (``KVH < world``, ``world % KVH == 0``) are replicated, as vLLM does:
    rank ``r`` keeps key/value head ``r * KVH // world`` (its rows of ``k_proj`` / ``v_proj``, or of a fused
    ``qkv_proj``'s k and v parts) and its ``H / world`` query heads, which are exactly those that read that head;
    the attention modules' ``num_key_value_groups`` becomes ``H / world``.

    Mixture-of-experts experts: every `cutlass_w8a8.moe.W8A8MoE` in ``model`` (the ``experts`` that ``quantize_``
    swapped in) is replaced by its `TensorParallelW8A8MoE` shard (`cutlass_w8a8.distributed.moe`: each expert's
    intermediate size split over the ranks, the output all-reduced), whatever ``tp_plan`` says; the routers stay
    replicated.

    Parameters
    ----------
    model : nn.Module
        Identical on every rank.
    tp_group : torch.distributed.ProcessGroup or TPContext
        Resolved once here (`TPContext.resolve`) and passed down to every layer it shards.
    tp_plan : dict, optional
        Default `LLAMA_TP_PLAN`.
    tp_size : int, optional
        The tensor-parallel size this rank was configured for; checked against the group on every rank.

    Raises
    ------
    ValueError
        (the same on every rank) the ranks disagree on the model's planned layers, their shapes or ``tp_size``;
        no layer matches the plan; a planned layer's size, or the config's ``num_attention_heads`` /
        ``num_key_value_heads`` when attention projections are planned, is not divisible by the world size (the
        key/value heads: unless they divide it); a W8A8 shard breaks the kernels' alignment.
    TypeError
        A planned module is neither ``nn.Linear`` nor `W8A8Linear`, or is already sharded.
    """
    from ..models.llama import LlamaDecoder

    if isinstance(model, LlamaDecoder):
        if tp_plan is not None:
            raise ValueError(f"{_WHERE}: a LlamaDecoder is sharded by its own layout; `tp_plan` must be None")
        from .decoder import shard_decoder_

        return shard_decoder_(model, tp_group, tp_size=tp_size)
    ctx = TPContext.resolve(tp_group, _WHERE)
    world = ctx.world
    plan = LLAMA_TP_PLAN if tp_plan is None else tp_plan
    config = getattr(model, "config", None)
    planned = []
    for fqn, mod in model.named_modules():
        if not fqn:
            continue
        spec = match_plan(fqn, plan)
        if spec is None:
            continue
        if isinstance(mod, _TensorParallel):
            raise TypeError(f"{_WHERE}: {fqn!r} is already sharded ({type(mod).__name__})")
        if not (isinstance(mod, W8A8Linear) or type(mod) is nn.Linear):
            continue  # a container matched by a loose pattern
        style, sizes = spec
        if style == "vocab" and (_tied_to_input_embedding(model, mod) or not vocab_shardable(
                mod.weight.shape[0], mod.weight.shape[1], world, isinstance(mod, W8A8Linear),
                getattr(mod, "weight_block_size", None) is not None)):
            continue  # stays replicated
        if style == "colwise" and sizes is None:
            sizes = _inferred_sizes(fqn, mod, config)
        planned.append((fqn, mod, style, sizes))
    n, k = [m.weight.shape[0] for _, m, _, _ in planned], [m.weight.shape[1] for _, m, _, _ in planned]
    heads = _heads(config)
    from .moe import experts_check_fields, shard_experts_, unsharded_experts

    experts = unsharded_experts(model)
    check_same_on_all_ranks(ctx, _WHERE, {**experts_check_fields([m for _, m in experts]),
        "tp_size": -1 if tp_size is None else int(tp_size), "planned layers": len(planned),
        "#layer names": zlib.crc32(",".join(f for f, _, _, _ in planned).encode()) & 0x7FFFFFFF,
        "#styles": sequence_code([PLAN_STYLES.index(s) for _, _, s, _ in planned]),
        "#out_features": sequence_code(n), "#in_features": sequence_code(k),
        "#quantized": sequence_code([isinstance(m, W8A8Linear) for _, m, _, _ in planned]),
        "#heads": sequence_code(heads or ())})
    if tp_size is not None and tp_size != world:
        raise ValueError(f"{_WHERE}: `tp_size` = {tp_size} but the tensor-parallel group has {world} ranks")
    if not planned:
        raise ValueError(f"{_WHERE}: no nn.Linear / W8A8Linear of {type(model).__name__} matches `tp_plan` "
                         f"({list(plan)})")
    ctx = ctx.with_kv_replicas(head_replicas(heads, [f for f, _, _, _ in planned], world, _WHERE))
    # the experts were in the check above; every experts layer's split is checked before any shard
    shard_experts_(model, ctx, check=False)
    for fqn, mod, style, sizes in planned:
        replicas = layer_replicas(fqn, sizes, ctx.kv_replicas) if style == "colwise" else None
        new = shard_linear(mod, "colwise" if style == "vocab" else style, ctx, output_sizes=sizes, check=False,
                           replicas=replicas)
        if style == "vocab":
            new.gather_output = True
        new.train(mod.training)
        parent, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    set_attention_groups_(model, heads, world, ctx.kv_replicas)
    return model
