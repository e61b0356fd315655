"""The MoE families: one row per kind of transformers sparse-MoE block whose experts run as a `W8A8MoE`.

Every fact about a family lives in its row, and every reader takes it from here:

- `quantize_`'s experts swap (`cutlass_w8a8.moe.hf`, registered with `quantize_` by ``cutlass_w8a8.moe`` at
  package import): which blocks it swaps the experts of, their parameter names, the router's routing (`Routing`:
  what ``cutlass_w8a8.ops.moe.moe_route`` computes in `W8A8MoE`'s router-logits mode);
- the checkpoint loader and saver (`cutlass_w8a8.checkpoints._moe`): the per-expert tensor names and the block's name
  in the files, the router's tensors the files name otherwise, the router's name for ``ignore``;
- tensor parallelism (`cutlass_w8a8.distributed.moe`): how the experts split over the ranks.

A block belongs to a family when its class, or a class it derives from, is named in the row's ``blocks``
(`family_of`; matched by name, so transformers is never imported here). Adding a family is a row in `FAMILIES` and
its tiny-model config in tests/_moe_models.py (`tiny_moe_config`), nothing more: the tests of
tests/moe/test_moe_families_cpu.py run for every row.

The rows (transformers 5.24's classes, the same in 5.17; E experts, expert ``e``, ``<layer>`` a decoder layer). Every
row's experts are transformers 5's fused ``gate_up_proj`` ``[E, 2I, H]`` / ``down_proj`` ``[E, H, I]`` SwiGLU experts
(``act_fn`` SiLU, no bias), called as ``experts(hidden_states, top_k_index, top_k_weights)`` after the block's router,
and split over I for tensor parallelism. Files name expert ``e``'s linears ``<layer>.mlp.experts.{e}.{gate,up,
down}_proj`` unless said.

- Qwen2-MoE (``Qwen2MoeSparseMoeBlock``): softmax top-k renormalized when the router's ``norm_topk_prob``; a shared
  expert (``shared_expert``) scaled by a sigmoid gate (``shared_expert_gate``, N = 1, left in float).
- Qwen3-MoE (``Qwen3MoeSparseMoeBlock``), OLMoE (``OlmoeSparseMoeBlock``), FlexOlmo (``FlexOlmoSparseMoeBlock``),
  Mellum (``MellumSparseMoeBlock``): softmax top-k, renormalized when ``norm_topk_prob``.
- Qwen3-Next (``Qwen3NextSparseMoeBlock``): as Qwen2-MoE (shared expert and its gate).
- Mixtral (``MixtralSparseMoeBlock``), MiniMax (``MiniMaxSparseMoeBlock``): softmax top-k, always renormalized;
  files ``<layer>.block_sparse_moe.experts.{e}.{w1,w3,w2}`` (gate ``w1``, up ``w3``, down ``w2``; the model names the
  block ``mlp``).
- DeepSeek-V3 (``DeepseekV3MoE``; Kimi-K2, DeepSeek-R1 and V3.1 load as ``deepseek_v3``) and the blocks with its
  router (`DEEPSEEK_V3_ROUTING`: sigmoid scores, the correction bias ``gate.e_score_correction_bias`` for the
  selection, grouped top-k over ``num_group`` groups keeping ``topk_group``, renormalized when ``norm_topk_prob``,
  times ``routed_scaling_factor``) and its shared experts (``shared_experts``, a SwiGLU MLP without gate):
  GLM-4.5 / 4.6 (``Glm4MoeMoE``), DeepSeek-V3.2 (``DeepseekV32MoE``), GLM-4-MoE-Lite (``Glm4MoeLiteMoE``),
  GLM-MoE-DSA (``GlmMoeDsaMoE``), Dots1 (``Dots1MoE``), Solar-Open (``SolarOpenMoE``), A.X-K1 (``AXK1MoE``),
  EXAONE-MoE (``ExaoneMoeSparseMoEBlock``; the files hold the bias as ``<layer>.mlp.e_score_correction_bias``),
  Kimi-Linear (``KimiLinearMoE``; Mixtral's file names), MiMo-V2-Flash (``MiMoV2FlashMoE``, no shared experts).
- DeepSeek-V2 (``DeepseekV2Moe``): softmax top-k, not renormalized, times ``routed_scaling_factor``, when the router's
  ``topk_method`` is ``"greedy"`` (DeepSeek-V2-Lite); its ``group_limited_greedy`` (DeepSeek-V2) ranks groups by
  their best score, which ``moe_route`` does not, and leaves the experts in float (`Routing.requires`).
- MiniMax-M2 (``MiniMaxM2SparseMoeBlock``): sigmoid, the block's own correction bias (``e_score_correction_bias``),
  always renormalized (by the sum without DeepSeek's + 1e-20: the same float32 result for any sum above 2**-42);
  Mixtral's file names.
- Ernie-4.5-MoE (``Ernie4_5_MoeSparseMoeBlock``): softmax, the correction bias ``gate.moe_statics.
  e_score_correction_bias`` (``[1, E]``) for the selection, renormalized (by ``max(sum, moe_norm_min)``: the sum, a
  softmax top-k sum being at least 1 / E, whenever ``moe_norm_min <= 1 / E``; 1e-12 in its checkpoints); shared
  experts; the files hold the bias as ``<layer>.mlp.moe_statics.e_score_correction_bias``.
- HY-V3 (``HYV3MoE``): sigmoid, the block's correction bias, renormalized, times ``router_scaling_factor``; shared
  experts; the files name the bias ``expert_bias`` and the router ``router.gate``.
- Laguna (``LagunaSparseMoeBlock``): sigmoid of the router's (soft-capped) logits, the router's correction bias,
  renormalized; shared experts; the block scales the experts' output itself; the files hold the bias under
  ``experts``.

Left out (transformers 5.24 blocks with fused 3-D experts that ``moe_route`` and `W8A8MoE` do not serve):

- PhiMoE (``PhimoeSparseMoeBlock``): sparsemixer routing (a second expert chosen after masking the first by a
  threshold on the logits), not a top-k of scores.
- GraniteMoE (and -Shared, -Hybrid, -SWA), Cohere2-MoE, GPT-OSS, OpenAI-Privacy-Filter: a softmax over the k chosen
  logits (the same experts as a softmax top-k, but other float32 weights than a renormalized softmax); GPT-OSS and
  the privacy filter also have expert biases and a clamped, interleaved SwiGLU.
- Mistral-4 (``Mistral4MoE``): grouped softmax top-k with the softmax in the logits' dtype (bf16 in a bf16 model),
  not float32.
- LongCat-Flash: zero (identity) experts among the routed ones. Llama-4: experts called on router-scaled inputs, not
  with top-k ids. Zaya: an MLP router with a skip class. Inkling: shared experts inside the routing's normalization.
  Gemma-4 / Diffusion-Gemma: a per-expert output scale in the weights, GELU experts, no sparse block.
- LFM2-MoE: renormalizes by the sum + 1e-6 (not the float32 result ``moe_route`` gives).
- AXK2: grouped top-k masking the dropped groups to 0 instead of -inf (a dropped expert can win over negative
  biased scores).
- Clamped SwiGLU (``swiglu_limit``): DeepSeek-V4 (also hash routing), GLM-5-Next, HY-V4, MiniMax-M3-VL, Step-3.7.
- HunYuan-MoE-V1 (``HunYuanMoEV1Moe``) and AfMoE (``AfmoeSparseMoeBlock``): their routers hold the logits as an
  ``nn.Linear`` child (``gate.wg``, ``router.gate``), which `quantize_` would swap for a `W8A8Linear` and the
  checkpoints' ``ignore`` of the router does not name; their routing (softmax top-k renormalized; sigmoid, the
  block's bias, renormalized, ``route_scale``) is one ``moe_route`` computes: a row once the router's children are
  kept in float.
- Jamba: in transformers 5.17 its router is a plain ``nn.Linear`` (`quantize_` would quantize it) and the top-k a
  block attribute.
- Vision-language models (the text block of each is one of the routings above, but the tiny-model tests build causal
  LMs): Qwen3.5-MoE and Qwen4-Exp (Qwen3-Next's block; text models ``qwen3_5_moe_text`` / ``qwen4_exp_text``),
  Qwen3-VL-MoE, Qwen3-Omni-MoE, GLM-4.5V (``glm4v_moe``), Ernie-4.5-VL-MoE (text and vision experts in one block),
  DeepSeek-OCR-2.
- With fused 3-D experts only in transformers 5.24 (CI also runs 5.17): Aria, Bailing-Hybrid, Beam, Dots3-Note,
  Flint, HY-V4-VL, Inkling-2, Kolibri-1, Lara-Mini, Mistral-Large-4, Muse-Spark, Unlimited-OCR.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple, Union

import torch
from torch import nn

from ..ops._checks_moe import MOE_SCORINGS
from ..ops._limits import MOE_MAX_GROUPS

__all__ = ["CheckpointNames", "DEEPSEEK_V3_ROUTING", "EXPERT_PARAM_NAMES", "ExpertLayout", "FAMILIES", "MoeFamily",
           "Routing", "RoutingArgs", "SCORINGS", "SharedExperts", "TP_SPLITS", "block_classes", "expert_parameters",
           "family_names", "family_of", "read_routing", "routing_problem"]

#: How a router scores the experts before its top-k: ``softmax`` over the logits, or ``sigmoid`` of each logit
#: (DeepSeek-V3 / GLM-4.5, with a correction bias and grouped top-k): ``moe_route``'s ``scoring`` (the op's list).
SCORINGS = MOE_SCORINGS
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
    renamed : tuple of (str, str)
        The block's other tensors (the router's) that the files name otherwise, as transformers' conversion
        mapping reads and its ``save_pretrained`` writes them: ``(name under the model's block, name under the
        files' block)``, e.g. EXAONE-MoE's ``("gate.e_score_correction_bias", "e_score_correction_bias")``, HY-V3's
        ``("gate.weight", "router.gate.weight")``. Empty: the files use the model's names.
    """

    block: Optional[str] = None
    projs: Tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    renamed: Tuple[Tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class Routing:
    """Where a block keeps its routing: attribute names of its router module (left in float by `quantize_` and the
    loader), and the path of its correction bias; `read_routing` reads them into a `RoutingArgs`, the arguments of
    ``cutlass_w8a8.ops.moe.moe_route`` (what `W8A8MoE` runs in router-logits mode).

    The routing they describe, for T tokens and E experts (transformers' routers, ``moe_route``'s definition):
    scores ``softmax(logits)`` or ``sigmoid(logits)`` in float32; the choice value ``score + correction_bias``; with
    grouped top-k, the E experts form ``n_group`` groups and only the ``topk_group`` groups whose two best choice
    values sum highest are candidates; the ``top_k`` candidates with the highest choice values are chosen; their
    weights are the unbiased scores, divided by their sum when renormalized (sigmoid: by the sum plus 1e-20), times
    the scaling factor.

    Attributes
    ----------
    router : str
        The block's child computing the routing from the hidden states (``gate``).
    scoring : str
        One of `SCORINGS`: ``softmax`` or ``sigmoid``.
    top_k : str
        The router's int attribute holding k, the experts per token.
    renormalize : bool or str
        Whether the top-k weights are divided by their sum: always (True, Mixtral), never (False), or the name of
        the router's bool attribute saying so (``norm_topk_prob``).
    correction_bias : str, optional
        The dotted path, from the block, of the per-expert bias ``[E]`` (or ``[1, E]``) added to the scores for the
        selection only: ``gate.e_score_correction_bias`` (DeepSeek-V3: a router buffer), ``e_score_correction_bias``
        (MiniMax-M2: the block's own buffer, passed to its router),
        ``gate.moe_statics.e_score_correction_bias`` (Ernie-4.5-MoE: a ``[1, E]`` parameter).
    n_group, topk_group : str, optional
        Grouped top-k: the router's int attributes holding the number of expert groups and how many groups are
        kept.
    scaling_factor : str, optional
        The router's float attribute multiplying the final weights (``routed_scaling_factor``).
    requires : tuple of (str, object)
        Router attributes and the values they must hold for this spec to be the router's (DeepSeek-V2:
        ``(("topk_method", "greedy"),)``; its ``group_limited_greedy`` ranks groups by their best score, which
        ``moe_route`` does not): a router holding another value is not served (`RoutingArgs.unserved`).
    """

    router: str = "gate"
    scoring: str = "softmax"
    top_k: str = "top_k"
    renormalize: Union[bool, str] = True
    correction_bias: Optional[str] = None
    n_group: Optional[str] = None
    topk_group: Optional[str] = None
    scaling_factor: Optional[str] = None
    requires: Tuple[Tuple[str, object], ...] = ()

    def __post_init__(self):
        if self.scoring not in SCORINGS:
            raise ValueError(f"Routing: `scoring` must be one of {SCORINGS}, got {self.scoring!r}")
        if (self.n_group is None) != (self.topk_group is None):
            raise ValueError("Routing: give both `n_group` and `topk_group` (grouped top-k) or neither")
        if any(not isinstance(r, tuple) or len(r) != 2 or not isinstance(r[0], str) for r in self.requires):
            raise ValueError(f"Routing: `requires` must be (attribute, value) pairs, got {self.requires!r}")


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

    def checkpoint_names(self, block_name: str) -> dict:
        """``{model tensor name: files' tensor name}`` of the block's tensors the files name otherwise
        (`CheckpointNames.renamed`, under the files' block name), for the block the model names ``block_name``."""
        files = self.checkpoint_block(block_name)
        return {f"{block_name}.{m}": f"{files}.{c}" for m, c in self.checkpoint.renamed}

    def checkpoint_block(self, block_name: str) -> str:
        """The files' name of the block the model names ``block_name`` (``model.layers.0.mlp`` ->
        ``model.layers.0.block_sparse_moe`` for Mixtral; the same name otherwise)."""
        if self.checkpoint.block is None:
            return block_name
        parent = block_name.rpartition(".")[0]
        return f"{parent}.{self.checkpoint.block}" if parent else self.checkpoint.block


#: DeepSeek-V3's router (``DeepseekV3TopkRouter`` and its copies in transformers: GLM-4.5, Dots1, EXAONE-MoE, ...):
#: sigmoid scores, the correction bias ``gate.e_score_correction_bias`` for the selection, grouped top-k
#: (``num_group`` / ``topk_group``), renormalized when ``norm_topk_prob`` (sum + 1e-20), times
#: ``routed_scaling_factor``.
DEEPSEEK_V3_ROUTING = Routing(scoring="sigmoid", renormalize="norm_topk_prob",
                              correction_bias="gate.e_score_correction_bias", n_group="num_group",
                              topk_group="topk_group", scaling_factor="routed_scaling_factor")
_SHARED = SharedExperts("shared_experts")
#: Mixtral's files: the block ``block_sparse_moe``, an expert's gate / up / down linears ``w1`` / ``w3`` / ``w2``.
_MIXTRAL_NAMES = CheckpointNames(block="block_sparse_moe", projs=("w1", "w3", "w2"))


def _deepseek_like(name: str, model_type: str, block: str, experts: str, shared: bool = True) -> "MoeFamily":
    return MoeFamily(name=name, model_type=model_type, blocks=(block,), experts=(experts,),
                     routing=DEEPSEEK_V3_ROUTING, shared_experts=_SHARED if shared else None)


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
        routing=Routing(renormalize=True), checkpoint=_MIXTRAL_NAMES),
    _deepseek_like("DeepSeek-V3", "deepseek_v3", "DeepseekV3MoE", "DeepseekV3Experts"),
    _deepseek_like("GLM-4.5", "glm4_moe", "Glm4MoeMoE", "Glm4MoeExperts"),
    MoeFamily(
        name="OLMoE", model_type="olmoe", blocks=("OlmoeSparseMoeBlock",), experts=("OlmoeExperts",),
        routing=Routing(renormalize="norm_topk_prob")),
    _deepseek_like("DeepSeek-V3.2", "deepseek_v32", "DeepseekV32MoE", "DeepseekV32Experts"),
    MoeFamily(
        name="DeepSeek-V2", model_type="deepseek_v2", blocks=("DeepseekV2Moe",), experts=("DeepseekV2Experts",),
        routing=Routing(renormalize=False, scaling_factor="routed_scaling_factor",
                        requires=(("topk_method", "greedy"),)),
        shared_experts=_SHARED),
    _deepseek_like("GLM-4-MoE-Lite", "glm4_moe_lite", "Glm4MoeLiteMoE", "Glm4MoeLiteExperts"),
    _deepseek_like("GLM-MoE-DSA", "glm_moe_dsa", "GlmMoeDsaMoE", "GlmMoeDsaExperts"),
    MoeFamily(
        name="Kimi-Linear", model_type="kimi_linear", blocks=("KimiLinearMoE",), experts=("KimiLinearExperts",),
        routing=DEEPSEEK_V3_ROUTING, shared_experts=_SHARED, checkpoint=_MIXTRAL_NAMES),
    _deepseek_like("Dots1", "dots1", "Dots1MoE", "Dots1Experts"),
    MoeFamily(
        name="EXAONE-MoE", model_type="exaone_moe", blocks=("ExaoneMoeSparseMoEBlock",), experts=("ExaoneMoeExperts",),
        routing=DEEPSEEK_V3_ROUTING, shared_experts=_SHARED,
        checkpoint=CheckpointNames(renamed=(("gate.e_score_correction_bias", "e_score_correction_bias"),))),
    _deepseek_like("MiMo-V2-Flash", "mimo_v2_flash", "MiMoV2FlashMoE", "MiMoV2FlashExperts", shared=False),
    _deepseek_like("Solar-Open", "solar_open", "SolarOpenMoE", "SolarOpenExperts"),
    _deepseek_like("A.X-K1", "axk1", "AXK1MoE", "AXK1Experts"),
    MoeFamily(
        name="Qwen3-Next", model_type="qwen3_next", blocks=("Qwen3NextSparseMoeBlock",),
        experts=("Qwen3NextExperts",), routing=Routing(renormalize="norm_topk_prob"),
        shared_experts=SharedExperts("shared_expert", gate="shared_expert_gate")),
    MoeFamily(
        name="MiniMax-M2", model_type="minimax_m2", blocks=("MiniMaxM2SparseMoeBlock",),
        experts=("MiniMaxM2Experts",),
        routing=Routing(scoring="sigmoid", renormalize=True, correction_bias="e_score_correction_bias"),
        checkpoint=_MIXTRAL_NAMES),
    MoeFamily(
        name="MiniMax", model_type="minimax", blocks=("MiniMaxSparseMoeBlock",), experts=("MiniMaxExperts",),
        routing=Routing(renormalize=True), checkpoint=_MIXTRAL_NAMES),
    MoeFamily(
        name="Ernie-4.5-MoE", model_type="ernie4_5_moe", blocks=("Ernie4_5_MoeSparseMoeBlock",),
        experts=("Ernie4_5_MoeExperts",),
        routing=Routing(renormalize=True, correction_bias="gate.moe_statics.e_score_correction_bias"),
        shared_experts=_SHARED,
        checkpoint=CheckpointNames(renamed=(("gate.moe_statics.e_score_correction_bias",
                                             "moe_statics.e_score_correction_bias"),))),
    MoeFamily(
        name="HY-V3", model_type="hy_v3", blocks=("HYV3MoE",), experts=("HYV3Experts",),
        routing=Routing(scoring="sigmoid", renormalize=True, correction_bias="e_score_correction_bias",
                        scaling_factor="router_scaling_factor"),
        shared_experts=_SHARED,
        checkpoint=CheckpointNames(renamed=(("e_score_correction_bias", "expert_bias"),
                                            ("gate.weight", "router.gate.weight")))),
    MoeFamily(
        name="FlexOlmo", model_type="flex_olmo", blocks=("FlexOlmoSparseMoeBlock",), experts=("FlexOlmoExperts",),
        routing=Routing(renormalize="norm_topk_prob")),
    MoeFamily(
        name="Mellum", model_type="mellum", blocks=("MellumSparseMoeBlock",), experts=("MellumExperts",),
        routing=Routing(renormalize="norm_topk_prob")),
    MoeFamily(
        name="Laguna", model_type="laguna", blocks=("LagunaSparseMoeBlock",), experts=("LagunaExperts",),
        routing=Routing(scoring="sigmoid", renormalize=True, correction_bias="gate.e_score_correction_bias"),
        shared_experts=_SHARED,
        checkpoint=CheckpointNames(renamed=(("gate.e_score_correction_bias", "experts.e_score_correction_bias"),))),
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


def routing_problem(num_experts: int, top_k: int, scoring: str, n_group: int, topk_group: int,
                    scaling_factor: float, correction_bias) -> Optional[Tuple[type, str]]:
    """Why ``moe_route`` (`W8A8MoE`'s router-logits mode) cannot take this routing, as ``(exception type, message
    naming the argument)``, or None when it can: `W8A8MoE` raises it at construction, `RoutingArgs.unserved`
    reports it, and the op checks its tensors again at each call (`cutlass_w8a8.ops._checks_moe.check_moe_route`: the
    same rules).

    ``scoring`` one of `SCORINGS`; ``1 <= n_group <= MOE_MAX_GROUPS`` (32), above 1 dividing E into groups of at
    least 2 experts; ``1 <= topk_group <= n_group``; ``top_k <= topk_group * E / n_group`` (the experts of the kept
    groups); ``scaling_factor`` finite; ``correction_bias`` None or a floating-point tensor of E elements (the layer
    holds it as float32 ``[E]``)."""
    if scoring not in SCORINGS:
        return ValueError, f"`scoring` must be one of {SCORINGS}, got {scoring!r}"
    for name, v in (("n_group", n_group), ("topk_group", topk_group)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return ValueError, f"`{name}` must be a positive int, got {v!r}"
    if n_group > MOE_MAX_GROUPS:
        return ValueError, f"`n_group` must be in [1, {MOE_MAX_GROUPS}], got {n_group}"
    if n_group > 1 and (num_experts % n_group or num_experts // n_group < 2):
        return ValueError, (f"`n_group` = {n_group} must divide num_experts = {num_experts} into groups of at least "
                            "2 experts")
    if topk_group > n_group:
        return ValueError, f"`topk_group` = {topk_group} must be <= n_group = {n_group}"
    if top_k > topk_group * (num_experts // n_group):
        return ValueError, (f"`top_k` = {top_k} must be <= topk_group * num_experts / n_group = "
                            f"{topk_group * (num_experts // n_group)} (the experts of the kept groups)")
    if (not isinstance(scaling_factor, (int, float)) or isinstance(scaling_factor, bool)
            or not math.isfinite(scaling_factor)):
        return ValueError, f"`scaling_factor` must be a finite float, got {scaling_factor!r}"
    if correction_bias is not None:
        if not isinstance(correction_bias, torch.Tensor) or not correction_bias.is_floating_point():
            what = (correction_bias.dtype if isinstance(correction_bias, torch.Tensor)
                    else type(correction_bias).__name__)
            return TypeError, f"`correction_bias` must be a floating-point tensor [E], got {what}"
        if correction_bias.numel() != num_experts:
            return ValueError, (f"`correction_bias` must have num_experts = {num_experts} elements ([E]), got shape "
                                f"{tuple(correction_bias.shape)}")
    return None


@dataclasses.dataclass(frozen=True)
class RoutingArgs:
    """A block's routing as read from its router (`read_routing`): ``moe_route``'s arguments, `W8A8MoE`'s routing.

    Attributes
    ----------
    scoring : str
    top_k : int
    renormalize : bool
    correction_bias : torch.Tensor, optional
        The block's correction bias tensor itself (``[E]``, or ``[1, E]``; any float dtype: transformers 5.17 holds
        it in the model's dtype, 5.24 in float32), or None.
    n_group, topk_group : int
        1 and 1 without grouped top-k.
    scaling_factor : float
    num_experts : int, optional
        E, from the block's experts (None when the block has no experts parameter to read it from).
    unmet : tuple of str
        The row's `Routing.requires` that the router does not meet, described (``topk_method = 'group_limited_
        greedy' (needs 'greedy')``).
    """

    scoring: str
    top_k: int
    renormalize: bool
    correction_bias: Optional[torch.Tensor] = None
    n_group: int = 1
    topk_group: int = 1
    scaling_factor: float = 1.0
    num_experts: Optional[int] = None
    unmet: Tuple[str, ...] = ()

    def unserved(self) -> Optional[str]:
        """Why `W8A8MoE`'s router-logits mode (``moe_route``) cannot compute this routing, or None when it can:
        a requirement of the row the router does not meet (`Routing.requires`), or routing arguments
        ``moe_route`` refuses (`routing_problem`: groups that do not divide E, top-k beyond the kept groups, ...)."""
        if self.unmet:
            return f"its router has {', '.join(self.unmet)}, a routing moe_route does not compute"
        if self.num_experts is not None:
            bad = routing_problem(self.num_experts, self.top_k, self.scoring, self.n_group, self.topk_group,
                                  self.scaling_factor, self.correction_bias)
            if bad is not None:
                return f"its routing is not one moe_route computes: {bad[1]}"
        return None

    def layer_kwargs(self) -> dict:
        """The keyword arguments of `W8A8MoE` / `W8A8MoE.from_float` for this routing besides ``top_k`` and
        ``renormalize``: ``scoring``, ``n_group``, ``topk_group``, ``scaling_factor``, ``correction_bias`` (the
        block's tensor: the layer holds it as it is when float32, so that it follows a state dict loaded into the
        router, else a float32 copy)."""
        return {"scoring": self.scoring, "n_group": self.n_group, "topk_group": self.topk_group,
                "scaling_factor": self.scaling_factor, "correction_bias": self.correction_bias}


def _attr_path(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def read_routing(block: nn.Module, family: MoeFamily, where: str) -> RoutingArgs:
    """The routing of ``block`` (a block of ``family``) read from its router as ``family.routing`` says, E from its
    experts' ``gate_up`` parameter (``family.layout``).

    Raises
    ------
    ValueError
        The router lacks an attribute the row names, or holds a value of the wrong type, or the block lacks the
        correction bias the row names (the message names the router or block, the attribute and the block's
        class; ``where`` starts it).
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

    def number(name, kinds, kind_name, default):
        if name is None:
            return default
        v = getattr(router, name, None)
        if not isinstance(v, kinds) or isinstance(v, bool):
            raise ValueError(f"{where}: {what} has no {kind_name} `{name}`")
        return v

    bias = None
    if spec.correction_bias is not None:
        bias = _attr_path(block, spec.correction_bias)
        if not isinstance(bias, torch.Tensor):
            raise ValueError(f"{where}: {type(block).__name__} has no tensor `{spec.correction_bias}` (the "
                             "correction bias of its routing)")
    unmet = []
    for attr, want in spec.requires:
        got = getattr(router, attr, None)
        if got != want:
            unmet.append(f"{attr} = {got!r} (needs {want!r})")
    gate_up = getattr(getattr(block, family.layout.module, None), family.layout.gate_up, None)
    e = gate_up.shape[0] if isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3 else None
    return RoutingArgs(spec.scoring, top_k, renormalize, correction_bias=bias,
                       n_group=number(spec.n_group, int, "int", 1), topk_group=number(spec.topk_group, int, "int", 1),
                       scaling_factor=float(number(spec.scaling_factor, (int, float), "float", 1.0)),
                       num_experts=e, unmet=tuple(unmet))
