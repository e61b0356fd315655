"""The MoE families: one row per kind of transformers sparse-MoE block whose experts run as a `W8A8MoE`.

Every fact about a family lives in its row, and every reader takes it from here:

- `quantize_`'s experts swap (`cutlass_w8a8.moe.hf`, registered with `quantize_` by ``cutlass_w8a8.moe`` at
  package import): which blocks it swaps the experts of, their parameter names, the router's top-k and
  renormalization;
- the checkpoint loader and saver (`cutlass_w8a8.checkpoints._moe`): the per-expert tensor names and the block's name
  in the files, the router's name for ``ignore``;
- tensor parallelism (`cutlass_w8a8.distributed.moe`): how the experts split over the ranks.

A block belongs to a family when its class, or a class it derives from, is named in the row's ``blocks``
(`family_of`; matched by name, so transformers is never imported here). Adding a family is a row in `FAMILIES` and
its tiny-model case in tests/moe/test_moe_families_cpu.py, nothing more.

The rows (transformers 5.24's classes; E experts, expert ``e``, ``<layer>`` a decoder layer):

- Qwen2-MoE: ``Qwen2MoeSparseMoeBlock`` / ``Qwen2MoeExperts``, files ``<layer>.mlp.experts.{e}.{gate,up,down}_proj``;
  softmax top-k renormalized when the router's ``norm_topk_prob``; a shared expert (``shared_expert``) scaled by a
  sigmoid gate (``shared_expert_gate``).
- Qwen3-MoE: ``Qwen3MoeSparseMoeBlock`` / ``Qwen3MoeExperts``, the same names; softmax top-k, ``norm_topk_prob``.
- Mixtral: ``MixtralSparseMoeBlock`` / ``MixtralExperts``, files ``<layer>.block_sparse_moe.experts.{e}.{w1,w3,w2}``
  (gate ``w1``, up ``w3``, down ``w2``; the model names the block ``mlp``); softmax top-k, always renormalized.

Every row's experts are transformers 5's fused ``gate_up_proj`` ``[E, 2I, H]`` / ``down_proj`` ``[E, H, I]`` and split
over I for tensor parallelism.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

from torch import nn

__all__ = ["CheckpointNames", "EXPERT_PARAM_NAMES", "ExpertLayout", "FAMILIES", "MoeFamily", "Routing", "RoutingArgs",
           "SCORINGS", "SharedExperts", "TP_SPLITS", "block_classes", "expert_parameters", "family_names", "family_of",
           "read_routing"]

#: How a router scores the experts before its top-k: ``softmax`` over the logits, or ``sigmoid`` of each logit
#: (DeepSeek-V3 / GLM-4.5, with a correction bias and grouped top-k; not served by the ops yet).
SCORINGS = ("softmax", "sigmoid")
#: How tensor parallelism splits a family's experts: ``intermediate``, every expert over its intermediate size I
#: (gate / up rows column-parallel, down columns row-parallel, one all-reduce of the output:
#: `cutlass_w8a8.distributed.TensorParallelW8A8MoE`).
TP_SPLITS = ("intermediate",)


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """How the experts module of a block holds its weights in the model: transformers 5's fused 3-D layout, one
    module with every expert's weights stacked (what `W8A8MoE.from_float` reads and `W8A8MoE` keeps as ``w13`` /
    ``w2``).

    Attributes
    ----------
    module : str
        The block's child holding the experts (``experts``), the module `quantize_` swaps for a `W8A8MoE`; the
        checkpoints name the per-expert linears under it too (``<block>.experts.{e}.<proj>``).
    gate_up : str
        Its ``[E, 2I, H]`` parameter: rows ``[0, I)`` each expert's gate projection, ``[I, 2I)`` its up projection.
    down : str
        Its ``[E, H, I]`` parameter: each expert's down projection.
    """

    module: str = "experts"
    gate_up: str = "gate_up_proj"
    down: str = "down_proj"


@dataclasses.dataclass(frozen=True)
class CheckpointNames:
    """How checkpoint files (compressed-tensors, transformers' native fp8) name a block's experts: one linear per
    expert and projection, ``<block>.<experts>.{e}.<proj>.{weight,weight_scale,weight_scale_inv,input_scale}``.
    (A file that stores them fused holds ``<block>.<experts>.<gate_up>`` / ``<down>``, `ExpertLayout`'s names:
    not read 8-bit, the loader names the fused tensor in its refusal.)

    Attributes
    ----------
    block : str, optional
        The block's own name in the files when it is not the model's (Mixtral: ``block_sparse_moe`` in the files,
        ``mlp`` in transformers 5's model); None: the model's.
    projs : tuple of str
        The gate, up and down linears of one expert, in that order (``("w1", "w3", "w2")`` for Mixtral).
    """

    block: Optional[str] = None
    projs: Tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class Routing:
    """Where a block's router keeps its routing, as attribute names of the router module (left in float by
    `quantize_` and the loader); `read_routing` reads them into a `RoutingArgs`.

    Attributes
    ----------
    router : str
        The block's child computing the routing from the hidden states (``gate``).
    scoring : str
        One of `SCORINGS`: ``softmax`` (then the top-k of the probabilities) or ``sigmoid`` (per-expert scores).
    top_k : str
        The router's int attribute holding k, the experts per token.
    renormalize : bool or str
        Whether the top-k weights are divided by their sum: always (True, Mixtral), never (False), or the name of
        the router's bool attribute saying so (``norm_topk_prob``).
    correction_bias : str, optional
        The router's per-expert bias added to the scores for the selection only (``e_score_correction_bias``).
    n_group, topk_group : str, optional
        Grouped top-k: the router's attributes holding the number of expert groups and how many groups are kept
        (the best by the sum of their top-2 biased scores) before the top-k inside them.
    scaling_factor : str, optional
        The router's float attribute multiplying the final weights (``routed_scaling_factor``).
    """

    router: str = "gate"
    scoring: str = "softmax"
    top_k: str = "top_k"
    renormalize: Union[bool, str] = True
    correction_bias: Optional[str] = None
    n_group: Optional[str] = None
    topk_group: Optional[str] = None
    scaling_factor: Optional[str] = None

    def __post_init__(self):
        if self.scoring not in SCORINGS:
            raise ValueError(f"Routing: `scoring` must be one of {SCORINGS}, got {self.scoring!r}")
        if (self.n_group is None) != (self.topk_group is None):
            raise ValueError("Routing: give both `n_group` and `topk_group` (grouped top-k) or neither")


@dataclasses.dataclass(frozen=True)
class SharedExperts:
    """A block's shared experts: a dense SwiGLU MLP of ``nn.Linear`` layers every token goes through, quantized as
    `W8A8Linear` layers and split by the tensor-parallel plan's MLP names (``gate_proj`` / ``up_proj`` colwise,
    ``down_proj`` rowwise).

    Attributes
    ----------
    module : str
        The block's child holding them (``shared_expert``).
    gate : str, optional
        The block's child scaling their output by a sigmoid (``shared_expert_gate``: an ``nn.Linear`` with N = 1,
        left in float).
    """

    module: str
    gate: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class MoeFamily:
    """One row of `FAMILIES`: everything cutlass_w8a8 needs to know about one kind of transformers MoE block.

    Attributes
    ----------
    name : str
        The family's name in messages (``"Qwen3-MoE"``).
    model_type : str
        transformers' ``model_type`` of the models holding these blocks (``"qwen3_moe"``).
    blocks : tuple of str
        transformers' sparse-MoE block classes (``Qwen3MoeSparseMoeBlock``), matched by `family_of`.
    experts : tuple of str
        transformers' classes of their experts module (``Qwen3MoeExperts``).
    routing : Routing
    layout : ExpertLayout
    checkpoint : CheckpointNames
    shared_experts : SharedExperts, optional
    tp : str
        One of `TP_SPLITS`.
    """

    name: str
    model_type: str
    blocks: Tuple[str, ...]
    experts: Tuple[str, ...]
    routing: Routing = Routing()
    layout: ExpertLayout = ExpertLayout()
    checkpoint: CheckpointNames = CheckpointNames()
    shared_experts: Optional[SharedExperts] = None
    tp: str = "intermediate"

    def __post_init__(self):
        if self.tp not in TP_SPLITS:
            raise ValueError(f"MoeFamily {self.name!r}: `tp` must be one of {TP_SPLITS}, got {self.tp!r}")

    def checkpoint_block(self, block_name: str) -> str:
        """The files' name of the block the model names ``block_name`` (``model.layers.0.mlp`` ->
        ``model.layers.0.block_sparse_moe`` for Mixtral; the same name otherwise)."""
        if self.checkpoint.block is None:
            return block_name
        parent = block_name.rpartition(".")[0]
        return f"{parent}.{self.checkpoint.block}" if parent else self.checkpoint.block


#: The table. Order: the order of the family names in messages.
FAMILIES: Tuple[MoeFamily, ...] = (
    MoeFamily(
        name="Qwen2-MoE", model_type="qwen2_moe", blocks=("Qwen2MoeSparseMoeBlock",), experts=("Qwen2MoeExperts",),
        routing=Routing(renormalize="norm_topk_prob"),
        shared_experts=SharedExperts("shared_expert", gate="shared_expert_gate")),
    MoeFamily(
        name="Qwen3-MoE", model_type="qwen3_moe", blocks=("Qwen3MoeSparseMoeBlock",), experts=("Qwen3MoeExperts",),
        routing=Routing(renormalize="norm_topk_prob")),
    MoeFamily(
        name="Mixtral", model_type="mixtral", blocks=("MixtralSparseMoeBlock",), experts=("MixtralExperts",),
        routing=Routing(renormalize=True),
        checkpoint=CheckpointNames(block="block_sparse_moe", projs=("w1", "w3", "w2"))),
)

_BY_BLOCK = {cls: fam for fam in FAMILIES for cls in fam.blocks}
if len(_BY_BLOCK) != sum(len(f.blocks) for f in FAMILIES):
    raise ValueError("cutlass_w8a8.moe.families: a block class is named by two rows of FAMILIES")

#: Parameter names of MoE experts modules: the rows' fused names and per-expert projection names (`expert_parameters`
#: flags other modules holding 3-D parameters so named).
EXPERT_PARAM_NAMES = tuple(dict.fromkeys(n for f in FAMILIES for n in (f.layout.gate_up, f.layout.down)
                                         + f.checkpoint.projs))


def family_of(block: nn.Module) -> Optional[MoeFamily]:
    """The row of `FAMILIES` whose ``blocks`` name the class of ``block`` or a class it derives from, or None."""
    for cls in type(block).__mro__:
        fam = _BY_BLOCK.get(cls.__name__)
        if fam is not None:
            return fam
    return None


def family_names(conjunction: str = "and") -> str:
    """The families' names for messages: ``"Qwen2-MoE, Qwen3-MoE and Mixtral"``."""
    names = [f.name for f in FAMILIES]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {conjunction} {names[-1]}"


def block_classes() -> Tuple[str, ...]:
    """Every block class name of the table, in row order."""
    return tuple(cls for f in FAMILIES for cls in f.blocks)


def expert_parameters(module: nn.Module) -> list:
    """Names of ``module``'s own 3-D parameters when it looks like an MoE experts module, else ``[]``: it holds a
    3-D parameter and an expert-ish name (a ``num_experts`` attribute, "expert" or "moe" in its class name, or a
    3-D parameter named as in `EXPERT_PARAM_NAMES`). Convolutions (3-D weights) are not experts. Used to warn
    about, or refuse, the MoE modules that are not the experts of a row of `FAMILIES`."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return []
    names = [n for n, p in module.named_parameters(recurse=False) if p is not None and p.dim() == 3]
    if not names:
        return []
    cls = type(module).__name__.lower()
    expertish = (hasattr(module, "num_experts") or "expert" in cls or "moe" in cls
                 or any(n in EXPERT_PARAM_NAMES for n in names))
    return names if expertish else []


@dataclasses.dataclass(frozen=True)
class RoutingArgs:
    """A block's routing as read from its router (`read_routing`): the values of its `Routing` fields.

    Attributes
    ----------
    scoring : str
    top_k : int
    renormalize : bool
    correction_bias : bool
        Whether the router adds a correction bias to the scores for the selection.
    n_group, topk_group : int or None
    scaling_factor : float
    """

    scoring: str
    top_k: int
    renormalize: bool
    correction_bias: bool = False
    n_group: Optional[int] = None
    topk_group: Optional[int] = None
    scaling_factor: float = 1.0

    def unserved(self) -> Optional[str]:
        """Why `W8A8MoE`'s router-logits mode (``moe_topk_softmax``: softmax, top-k, optional renormalization)
        cannot compute this routing, or None when it can."""
        parts = []
        if self.scoring != "softmax":
            parts.append(f"{self.scoring} scoring")
        if self.correction_bias:
            parts.append("a correction bias")
        if self.n_group is not None and self.n_group > 1:
            parts.append(f"grouped top-k ({self.n_group} groups)")
        if self.scaling_factor != 1.0:
            parts.append(f"a routed scaling factor {self.scaling_factor}")
        if not parts:
            return None
        return f"its router uses {', '.join(parts)}; W8A8MoE routes by softmax top-k only"


def read_routing(block: nn.Module, family: MoeFamily, where: str) -> RoutingArgs:
    """The routing of ``block`` (a block of ``family``) read from its router as ``family.routing`` says.

    Raises
    ------
    ValueError
        The router lacks an attribute the row names, or holds a value of the wrong type (the message names the
        router, the attribute and the block's class; ``where`` starts it).
    """
    spec = family.routing
    router = getattr(block, spec.router, None)
    what = f"the router `{spec.router}` of {type(block).__name__}"
    top_k = getattr(router, spec.top_k, None)
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        raise ValueError(f"{where}: {what} has no int `{spec.top_k}` (got {type(router).__name__}); cannot build its "
                         "W8A8MoE")
    if isinstance(spec.renormalize, bool):
        renormalize = spec.renormalize
    else:
        renormalize = getattr(router, spec.renormalize, None)
        if not isinstance(renormalize, bool):
            raise ValueError(f"{where}: {what} has no bool `{spec.renormalize}`; cannot tell whether it renormalizes "
                             "the top-k weights")

    def number(name, kinds, kind_name):
        if name is None:
            return None
        v = getattr(router, name, None)
        if not isinstance(v, kinds) or isinstance(v, bool):
            raise ValueError(f"{where}: {what} has no {kind_name} `{name}`")
        return v

    scaling = number(spec.scaling_factor, (int, float), "float") if spec.scaling_factor else 1.0
    return RoutingArgs(spec.scoring, top_k, renormalize,
                       correction_bias=spec.correction_bias is not None
                       and getattr(router, spec.correction_bias, None) is not None,
                       n_group=number(spec.n_group, int, "int"), topk_group=number(spec.topk_group, int, "int"),
                       scaling_factor=float(scaling))
