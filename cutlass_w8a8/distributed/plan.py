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
(transformers' names, and vLLM's fused ``qkv_proj`` / ``gate_up_proj``) and of multi-head latent attention (MLA:
DeepSeek-V2 / V3, Kimi-K2, GLM-4.7-Flash and the other transformers models whose attention has a ``kv_b_proj``).

Attention is split by heads, as vLLM splits it: the projections whose output rows are whole heads column-parallel,
``o_proj`` (whose input columns are) row-parallel, and the projections whose output every head reads (MLA's low-rank
latents ``q_a_proj`` / ``kv_a_proj_with_mqa``) replicated. `ATTENTION_LAYOUTS` is the table of those roles, one row
per kind of attention; `attention_splits` checks every attention module of a model against its row and the plan
before anything is sharded, and `set_attention_heads_` gives the split modules their per-rank head counts after.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import zlib
from typing import Optional

from torch import nn

from ..linear import W8A8Linear
from ._common import TPContext, _TensorParallel
from ._group import check_same_on_all_ranks, sequence_code
from .linear import shard_linear
from .sharding import STYLES

__all__ = ["ATTENTION_LAYOUTS", "LLAMA_TP_PLAN", "AttentionLayout", "attention_splits", "match_plan",
           "tensor_parallel_"]

#: The default plan: attention and MLP projections of Llama-family models (transformers' ``LlamaConfig.
#: base_model_tp_plan`` names, plus the fused ``qkv_proj`` / ``gate_up_proj`` of vLLM's layout and of
#: `cutlass_w8a8.models.LlamaDecoder`), MLA's per-head projections ``q_b_proj`` / ``kv_b_proj`` (``q_proj`` when
#: ``q_lora_rank`` is None; vLLM's ``DeepseekV2MLAAttention`` split: its latents ``q_a_proj`` / ``kv_a_proj_with_mqa``
#: stay replicated), and ``lm_head`` over the vocabulary (style ``"vocab"``). Embeddings stay replicated.
LLAMA_TP_PLAN = {
    "q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "qkv_proj": "colwise",
    "q_b_proj": "colwise", "kv_b_proj": "colwise",
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


@dataclasses.dataclass(frozen=True)
class AttentionLayout:
    """How the heads of one kind of attention module split over the ranks (a row of `ATTENTION_LAYOUTS`; the names
    are the module's children, transformers' attribute names).

    Attributes
    ----------
    name : str
        The kind of attention, for messages.
    marker : str
        A child that only this layout (of the rows before it) has: the first row whose marker the module has is its
        layout.
    heads : tuple of str
        Children whose output rows are whole heads, head after head: column-parallel (each rank computes its
        ``H / world`` heads).
    out : str
        The child whose input columns are whole heads: row-parallel (the heads' outputs all-reduced).
    shared : tuple of str
        Children whose output every head reads (MLA's low-rank latents): replicated.
    local_heads : tuple of str
        Integer attributes of the module that count its query heads; each becomes its value / world on every rank.
    """

    name: str
    marker: str
    heads: tuple
    out: str
    shared: tuple = ()
    local_heads: tuple = ()


#: The attention layouts `attention_splits` knows, first match first. An attention module is a module with a linear
#: child ``o_proj``. Multi-head latent attention (transformers' ``DeepseekV3Attention`` and the other attention
#: classes with a ``kv_b_proj``): the queries from ``q_b_proj`` (``q_proj`` without ``q_lora_rank``) and the keys and
#: values of every head from ``kv_b_proj``, both per head; the latents from ``q_a_proj`` and ``kv_a_proj_with_mqa``
#: (the compressed key/value and the rotary key, shared by all heads); the module's ``num_heads``. Multi-head and
#: grouped-query attention (Llama, Qwen, Mistral, ...): q / k / v or the fused qkv, per head.
ATTENTION_LAYOUTS = (
    AttentionLayout("multi-head latent attention", marker="kv_b_proj", heads=("q_proj", "q_b_proj", "kv_b_proj"),
                    out="o_proj", shared=("q_a_proj", "kv_a_proj_with_mqa"), local_heads=("num_heads",)),
    AttentionLayout("multi-head attention", marker="o_proj", heads=("q_proj", "k_proj", "v_proj", "qkv_proj"),
                    out="o_proj"),
)

_KV_LEAVES = ("k_proj", "v_proj")
_ATTN_LEAVES = tuple(sorted({leaf for lay in ATTENTION_LAYOUTS for leaf in lay.heads + (lay.out,)}))


def _is_linear(mod: nn.Module) -> bool:
    return isinstance(mod, (nn.Linear, W8A8Linear))


def _layout_of(mod: nn.Module) -> Optional[AttentionLayout]:
    """The first row of `ATTENTION_LAYOUTS` whose ``marker`` is a child of ``mod`` and ``out`` a linear child, or
    None (not an attention module)."""
    children = dict(mod.named_children())
    return next((lay for lay in ATTENTION_LAYOUTS
                 if lay.marker in children and _is_linear(children.get(lay.out, nn.Module()))), None)


def attention_splits(model: nn.Module, styles: dict, world: int, where: str) -> list:
    """``[(module, AttentionLayout)]``: the attention modules of ``model`` whose heads ``styles`` (``{fqn: style}``
    of the linears the plan shards) split, each checked against its layout (`ATTENTION_LAYOUTS`) before anything is
    sharded, so that a model whose attention cannot be split this way is refused here, naming the module, and never
    fails inside its forward.

    An attention module none of whose linear children is planned stays replicated (checked only for its shared
    projections). One whose heads are split needs: ``o_proj`` row-parallel, each of its layout's ``heads`` children
    column-parallel, its ``shared`` children replicated, every other linear child named by the plan (its output may
    be per head: only the plan can say how it splits), no parameter of its own (attention sinks and the like are per
    head and are not split), and each ``local_heads`` attribute divisible by ``world``. The head counts of the config
    are checked apart (`head_replicas`).

    Raises
    ------
    ValueError
        Naming the module and the child or attribute: a shared projection that the plan shards; ``o_proj``, or a
        per-head projection, not split as its heads are; a linear child that the plan does not name, or a parameter
        of the module's own, in an attention whose heads are split; a ``local_heads`` attribute not divisible by
        ``world``.
    """
    out = []
    for fqn, mod in model.named_modules():
        layout = _layout_of(mod)
        if layout is None:
            continue
        linears = [leaf for leaf, c in mod.named_children() if _is_linear(c)]
        style = {leaf: styles.get(f"{fqn}.{leaf}" if fqn else leaf) for leaf in linears}
        what = f"{where}: {fqn or type(mod).__name__!r} ({layout.name}, {type(mod).__name__})"
        for leaf in layout.shared:
            if style.get(leaf) is not None:
                raise ValueError(f"{what}: `{leaf}`'s output is read by every head, so it must stay replicated, but "
                                 f"`tp_plan` makes it {style[leaf]!r}: leave it out of the plan")
        if all(v is None for v in style.values()):
            continue  # replicated
        heads = [leaf for leaf in layout.heads if leaf in style]
        split = [leaf for leaf in heads if style[leaf] == "colwise"]
        if style[layout.out] != "rowwise":
            planned = ", ".join(f"`{leaf}` {v!r}" for leaf, v in style.items() if v is not None)
            raise ValueError(f"{what}: `tp_plan` shards {planned} but makes `{layout.out}` "
                             f"{style[layout.out] or 'replicated'}: an attention is split by heads, `{layout.out}` "
                             "(which takes the heads' outputs) 'rowwise', or left out of the plan")
        wrong = [leaf for leaf in heads if style[leaf] != "colwise"]
        if wrong or not split:
            names = ", ".join(f"`{v}`" for v in (wrong or heads)) or f"no {' / '.join(layout.heads)}"
            raise ValueError(f"{what}: `tp_plan` makes `{layout.out}` row-parallel, so its heads are split, but "
                             f"{names} {'is' if len(wrong) == 1 else 'are'} not column-parallel: each of "
                             f"{', '.join(heads) or ' / '.join(layout.heads)} must be 'colwise' (its output rows "
                             "are whole heads), or the attention left out of the plan")
        known = set(layout.heads) | set(layout.shared) | {layout.out}
        unplanned = [leaf for leaf in linears if leaf not in known and style[leaf] is None]
        if unplanned:
            one = len(unplanned) == 1
            raise ValueError(f"{what}: its heads are split but {', '.join(f'`{v}`' for v in unplanned)} "
                             f"{'is' if one else 'are'} in no row of `tp_plan` and no role of the {layout.name} "
                             f"layout: {'its' if one else 'their'} output may be per head (a gate), which a replicated "
                             "layer would not match; name it in `tp_plan` or leave the attention out of the plan")
        own = [n for n, _ in mod.named_parameters(recurse=False)]
        if own:
            raise ValueError(f"{what}: its heads are split but it holds parameters of its own "
                             f"({', '.join(f'`{v}`' for v in own)}), which may be per head (attention sinks) and "
                             "are not split: leave the attention out of `tp_plan`")
        for attr in layout.local_heads:
            v = getattr(mod, attr, None)
            if isinstance(v, int) and v % world:
                raise ValueError(f"{what}: `{attr}` = {v} is not divisible by the tensor-parallel world size "
                                 f"{world}")
        out.append((mod, layout))
    return out


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


def set_attention_heads_(model: nn.Module, splits: list, heads, world: int, rep: int) -> None:
    """After a shard, give the split attention modules (``splits``, from `attention_splits`) their per-rank head
    counts: each ``local_heads`` attribute of their layout (MLA's ``num_heads``) divided by ``world``; and, with
    replicated key/value heads (``rep > 1``), transformers' attention modules their per-rank
    ``num_key_value_groups``: this rank's ``H / world`` query heads all read its one key/value head (the config's
    ``H / KVH`` would repeat that head too often: `repeat_kv`)."""
    for mod, layout in splits:
        for attr in layout.local_heads:
            if isinstance(getattr(mod, attr, None), int):
                setattr(mod, attr, getattr(mod, attr) // world)
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
    the head count from the projection's output (``view(..., -1, head_dim)``, as Llama, Qwen2, Mistral and
    DeepSeek-V3's MLA do) and uses a dynamic KV cache (a static cache sized from ``config.num_key_value_heads``
    would be too large). Attention is split by heads as its layout says (`ATTENTION_LAYOUTS`; MLA: ``q_b_proj`` /
    ``kv_b_proj`` column-parallel, ``o_proj`` row-parallel, ``q_a_proj`` / ``kv_a_proj_with_mqa`` replicated, the
    module's ``num_heads`` made ``H / world``); a plan that splits an attention module inconsistently, or a module
    that its layout cannot split, is refused before anything is sharded (`attention_splits`).

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
        key/value heads: unless they divide it); a W8A8 shard breaks the kernels' alignment; an attention module
        that the plan splits but that cannot be split by heads (`attention_splits`: the message names the module
        and its projection or attribute).
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
    splits = attention_splits(model, {f: s for f, _, s, _ in planned}, world, _WHERE)
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
    set_attention_heads_(model, splits, heads, world, ctx.kv_replicas)
    return model
