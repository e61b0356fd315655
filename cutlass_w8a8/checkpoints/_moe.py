"""Mixture-of-experts checkpoints: the per-expert Linear layout llm-compressor / compressed-tensors and the
transformers-native fp8 format write, read into `cutlass_w8a8.moe.W8A8MoE` layers and written back.

The blocks read and written are those of `cutlass_w8a8.moe.families.FAMILIES` (Qwen2-MoE, Qwen3-MoE, Mixtral,
DeepSeek-V3, GLM-4.5, OLMoE and the other rows): transformers 5 holds their experts as one module with 3-D ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]
parameters (the row's `ExpertLayout`), which its conversion mapping fills on load from per-expert tensors; the files
name expert ``e``'s linears as the row's `CheckpointNames` say: ``<layer>.mlp.experts.{e}.{gate,up,down}_proj``
(Qwen), ``<layer>.block_sparse_moe.experts.{e}.{w1,w3,w2}`` (Mixtral: gate ``w1``, up ``w3``, down ``w2``; transformers
names its block ``mlp`` in the model and ``block_sparse_moe`` in the files); other tensors of the block that the files
name otherwise are the row's ``CheckpointNames.renamed``. The router (the row's ``Routing.router``, ``gate``) is left
in float, and the `W8A8MoE` gets the row's routing (`read_routing`: scoring, grouped top-k, scaling, the router's
loaded correction bias: `link_correction_biases`). Each expert linear stores ``weight`` (int8 / e4m3, ``[N, K]``) and its scale
(``weight_scale``: ``[N, 1]`` per channel, ``[1]`` per tensor, ``[ceil(N / 128), K / 128]`` block;
``weight_scale_inv`` block in the native format), and ``input_scale`` ``[1]`` when the activations are static.
Shared experts (Qwen2-MoE's ``shared_expert``, DeepSeek-V3's ``shared_experts``) are ordinary linears
(`W8A8Linear`); Qwen2-MoE's ``shared_expert_gate`` (N = 1) must be left in float.

Into a `W8A8MoE` (rows of ``w13`` [E, 2I, H]: gate then up, as transformers' ``gate_up_proj``):

- per-channel weight scales are stored as they are (float32); a per-tensor scale becomes I (or H) equal per-channel
  scales, which is the same dequantized weight exactly; block scales: gate's ``[I / 128, H / 128]`` then up's
  (I and H multiples of 128: a 128-row block of ``w13`` must not straddle gate and up);
- static input scales: the layer has one per GEMM for all experts (``a13_scale``, ``a2_scale``, float32 [1]),
  the checkpoint one per expert linear. ``a13_scale`` is the largest of every expert's gate and up
  ``input_scale``, ``a2_scale`` the largest down ``input_scale`` (vLLM's rule for static fp8 MoE): exact when they
  are all equal (what `save_pretrained` writes), else the experts with a smaller scale run on the coarser grid
  of the largest (no activation clips that did not before), and a `UserWarning` names the block and the range.

Anything else raises ValueError naming the tensor or field: another MoE block class (any module holding 3-D
expert parameters), experts stored in float or with a scheme `W8A8MoE` does not run, experts of one block under
different config groups, a missing expert or scale tensor, a shape or dtype that does not match.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..moe.families import MoeFamily, RoutingArgs, expert_parameters, family_names, family_of, read_routing
from ..moe.layer import W8A8MoE
from ..ops import _limits
from ..ops._limits import BLOCK_SIZE
from ._scheme import BLOCK_SCHEME, LinearScheme, ParsedConfig

__all__ = ["MoeBlock", "MoeTarget", "find_moe_blocks", "ct_moe_targets", "native_moe_targets", "build_moe",
           "fill_float_experts", "link_correction_biases",
           "moe_state_dict", "float_expert_headers", "moe_linear_names", "checkpoint_block_of", "router_ignore",
           "checkpoint_renamer", "PROJS"]

#: the three projections of an expert, in the order of `MoeBlock.leaves` (`CheckpointNames.projs`)
PROJS = ("gate", "up", "down")
_ST_QUANT = {torch.int8: "I8", torch.float8_e4m3fn: "F8_E4M3"}
_ST_8BIT = ("I8", "U8", "F8_E4M3", "F8_E5M2", "I32")
_ST_SCALE = ("F32", "BF16", "F16")


@dataclasses.dataclass
class MoeBlock:
    """An MoE block of the model built on the meta device.

    Attributes
    ----------
    name : str
        The block's module name in the model (``model.layers.0.mlp``).
    ckpt_name : str
        Its name in the checkpoint files (``model.layers.0.block_sparse_moe`` for Mixtral, else ``name``).
    family : MoeFamily
        Its row of `cutlass_w8a8.moe.families.FAMILIES`.
    num_experts, hidden_size, intermediate_size, top_k : int
        E, H, I (from the experts' 3-D parameters) and the router's top-k.
    renormalize : bool
        Whether the top-k weights are divided by their sum (Qwen ``norm_topk_prob``; always for Mixtral).
    cls : str
        The block's class name.
    routing : RoutingArgs, optional
        The block's routing as `read_routing` reads it from the model built on the meta device (its correction bias,
        if any, a meta tensor: `link_correction_biases` gives the loaded layer the router's loaded one).
    renamed : dict
        ``{model tensor name: files' tensor name}`` of the block's other tensors the files name otherwise (the row's
        `CheckpointNames.renamed`, where the files hold the files' name and not the model's).
    """

    name: str
    ckpt_name: str
    family: MoeFamily
    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    renormalize: bool
    cls: str
    routing: Optional[RoutingArgs] = None
    renamed: Dict[str, str] = dataclasses.field(default_factory=dict)

    def routing_kwargs(self) -> dict:
        """`W8A8MoE`'s routing keyword arguments for this block besides ``top_k`` / ``renormalize`` and the
        correction bias (`link_correction_biases`): ``scoring``, ``n_group``, ``topk_group``, ``scaling_factor``."""
        r = self.routing
        if r is None:
            return {}
        return {"scoring": r.scoring, "n_group": r.n_group or 1, "topk_group": r.topk_group or 1,
                "scaling_factor": r.scaling_factor}

    @property
    def leaves(self) -> Tuple[str, str, str]:
        """The gate, up and down linear names of one expert in the files (``("gate_proj", "up_proj", "down_proj")``
        or ``("w1", "w3", "w2")``: the family's `CheckpointNames.projs`)."""
        return self.family.checkpoint.projs

    @property
    def experts(self) -> str:
        """The experts' module name in the model (what becomes a `W8A8MoE`)."""
        return f"{self.name}.{self.family.layout.module}"

    def key(self, e: int, proj: str, leaf: str) -> str:
        """The checkpoint tensor ``leaf`` (``weight``, ``weight_scale``, ...) of projection ``proj`` (``gate`` /
        ``up`` / ``down``) of expert ``e``."""
        return f"{self.linear(e, proj)}.{leaf}"

    def linear(self, e: int, proj: str, model_side: bool = False) -> str:
        """The module name of one expert linear (as the checkpoint names it, or with the model's block name)."""
        block = self.name if model_side else self.ckpt_name
        return f"{block}.{self.family.layout.module}.{e}.{self.leaves[PROJS.index(proj)]}"

    def fused_key(self, which: str) -> str:
        """The files' name of the fused ``gate_up`` / ``down`` tensor (`ExpertLayout`), for a checkpoint that stores
        the experts fused."""
        return f"{self.ckpt_name}.{self.family.layout.module}.{getattr(self.family.layout, which)}"


@dataclasses.dataclass
class MoeTarget:
    """An MoE block of a checkpoint: the block, the `LinearScheme` of its experts (None: experts stored in float,
    loaded into transformers' own experts module), the config group (or field) that quantizes them and the name of
    their weight-scale tensors."""

    block: MoeBlock
    scheme: LinearScheme
    group: str
    scale_leaf: str = "weight_scale"

    def keys(self) -> List[str]:
        """Every checkpoint tensor of the experts."""
        if self.scheme is None:
            return [self.block.key(e, p, "weight") for e in range(self.block.num_experts) for p in PROJS]
        leaves = ("weight", self.scale_leaf) + (("input_scale",) if self.scheme.static_input else ())
        return [self.block.key(e, p, leaf) for e in range(self.block.num_experts) for p in PROJS for leaf in leaves]


def find_moe_blocks(model: nn.Module, ckpt_meta: Dict[str, tuple], where: str) -> List[MoeBlock]:
    """The MoE blocks of ``model`` (built on the meta device) whose experts the checkpoint (``ckpt_meta``:
    ``{tensor name: (safetensors dtype, shape)}``) stores, in module order. Empty for a dense model.

    Raises ValueError naming the module for a module holding 3-D expert parameters that is not the experts of a
    block of `cutlass_w8a8.moe.families.FAMILIES`: other MoE blocks route in ways ``moe_route`` does not compute
    (PhiMoE's sparsemixer) or lay the experts out otherwise, and are not loaded 8-bit; and for a family's block whose
    router lacks what the row names (`read_routing`).
    """
    blocks = []
    family_experts = set()
    for name, m in model.named_modules():
        fam = family_of(m)
        if fam is None:
            continue
        lay = fam.layout
        experts = getattr(m, lay.module, None)
        gu, dp = getattr(experts, lay.gate_up, None), getattr(experts, lay.down, None)
        if not isinstance(gu, torch.Tensor) or not isinstance(dp, torch.Tensor) or gu.dim() != 3 or dp.dim() != 3:
            raise ValueError(f"{where}: MoE block {name!r} ({type(m).__name__}) has no `{lay.module}` module with 3-D "
                             f"{lay.gate_up} / {lay.down} parameters (transformers >= 5's layout); this transformers "
                             "version's MoE layout is not supported")
        e, two_i, h = gu.shape
        i = two_i // 2
        if tuple(dp.shape) != (e, h, i) or two_i != 2 * i:
            raise ValueError(f"{where}: {name}.{lay.module} has {lay.gate_up} {tuple(gu.shape)} and {lay.down} "
                             f"{tuple(dp.shape)}; expected [E, 2I, H] and [E, H, I]")
        family_experts.add(f"{name}.{lay.module}")
        ckpt_name = fam.checkpoint_block(name)
        if ckpt_name != name:
            # the files' name (transformers' save_pretrained writes it), or the model's when the files use that
            probe = f".{lay.module}.0.{fam.checkpoint.projs[0]}.weight"
            if f"{name}{probe}" in ckpt_meta and f"{ckpt_name}{probe}" not in ckpt_meta:
                ckpt_name = name
        routing = read_routing(m, fam, where)
        renamed = {}
        for model_leaf, file_leaf in getattr(fam.checkpoint, "renamed", ()):
            model_key, file_key = f"{name}.{model_leaf}", f"{ckpt_name}.{file_leaf}"
            if file_key in ckpt_meta and model_key not in ckpt_meta:
                renamed[model_key] = file_key
        blocks.append(MoeBlock(name, ckpt_name, fam, e, h, i, routing.top_k, routing.renormalize, type(m).__name__,
                               routing, renamed))
    for name, m in model.named_modules():
        if name in family_experts:
            continue
        three_d = expert_parameters(m)
        if three_d:
            raise ValueError(f"{where}: module {name!r} ({type(m).__name__}) holds 3-D expert parameters "
                             f"{three_d}: only the experts of {family_names()} blocks "
                             "(cutlass_w8a8.moe.families) are supported; MoE blocks with other routers or expert "
                             "layouts are not loaded 8-bit")
    return blocks


def checkpoint_renamer(blocks: List[MoeBlock]):
    """``rename(model tensor name) -> checkpoint tensor name`` for the tensors of the blocks the files name
    otherwise (Mixtral's ``mlp`` -> ``block_sparse_moe``; a row's `CheckpointNames.renamed` tensors, e.g. EXAONE-MoE's
    ``gate.e_score_correction_bias`` -> ``e_score_correction_bias``), or None when every name is the same."""
    moved = [(b.name + ".", b.ckpt_name + ".") for b in blocks if b.name != b.ckpt_name]
    renamed = {k: v for b in blocks for k, v in b.renamed.items()}
    if not moved and not renamed:
        return None

    def rename(key: str) -> str:
        if key in renamed:
            return renamed[key]
        for src, dst in moved:
            if key.startswith(src):
                return dst + key[len(src):]
        return key

    return rename


def _expected(scheme: Optional[LinearScheme], n: int, k: int, scale_leaf: str) -> Dict[str, Tuple[tuple, list]]:
    if scheme is None:
        return {"weight": (_ST_SCALE, [n, k])}
    if scheme.block:
        scale_shape = [_limits.blocks(n), _limits.blocks(k)]
    else:
        scale_shape = [n, 1] if scheme.per_channel else [1]
    expect = {"weight": ((_ST_QUANT[scheme.quant_dtype],), [n, k]), scale_leaf: (_ST_SCALE, scale_shape)}
    if scheme.static_input:
        expect["input_scale"] = (_ST_SCALE, [1])
    return expect


def _check_tensors(t: MoeTarget, ckpt_meta: Dict[str, tuple], where: str) -> None:
    """Every expert tensor ``t`` implies, with its dtype and shape; I and H multiples of 128 for block scales."""
    b = t.block
    h, i = b.hidden_size, b.intermediate_size
    if t.scheme is not None and t.scheme.block and (i % BLOCK_SIZE or h % BLOCK_SIZE):
        raise ValueError(f"{where}: MoE block {b.name!r} has block-scaled fp8 experts with hidden_size {h} and "
                         f"intermediate_size {i}: both must be multiples of {BLOCK_SIZE} (the block GEMM's K, and "
                         "gate / up blocks must not share a 128-row block of w13)")
    if b.key(0, "gate", "weight") not in ckpt_meta:  # experts stored fused, as the model holds them
        fused = [k for which in ("gate_up", "down") for k in (b.fused_key(which), f"{b.fused_key(which)}.weight")
                 if k in ckpt_meta]
        if fused:
            raise ValueError(f"{where}: the checkpoint stores the experts of {b.name!r} fused ({fused[0]!r}); "
                             f"they are read as per-expert tensors ({b.key(0, 'gate', 'weight')!r}, ...)")
    for e in range(b.num_experts):
        for proj, (n, k) in zip(PROJS, ((i, h), (i, h), (h, i))):
            for leaf, (dtypes, shape) in _expected(t.scheme, n, k, t.scale_leaf).items():
                key = b.key(e, proj, leaf)
                if key not in ckpt_meta:
                    raise ValueError(f"{where}: the checkpoint has no tensor {key!r}, which {t.group} implies for "
                                     f"expert {e} of the {b.num_experts} experts of {b.name!r} ({b.cls})")
                dt, sh = ckpt_meta[key]
                if dt not in dtypes or list(sh) != shape:
                    raise ValueError(f"{where}: checkpoint tensor {key!r} is {dt} {list(sh)}; {t.group} implies "
                                     f"{' or '.join(dtypes)} {shape} (E = {b.num_experts}, H = {h}, I = {i})")
    # an expert past E (a checkpoint of a model with more experts than the config says)
    extra = f"{b.ckpt_name}.{b.family.layout.module}.{b.num_experts}."
    for key in sorted(ckpt_meta):
        if key.startswith(extra):
            raise ValueError(f"{where}: checkpoint tensor {key!r} names expert {b.num_experts}, but {b.name!r} has "
                             f"{b.num_experts} experts (the config's num_experts / num_local_experts)")


def ct_moe_targets(blocks: List[MoeBlock], parsed: ParsedConfig, ckpt_meta: Dict[str, tuple],
                   where: str) -> Dict[str, MoeTarget]:
    """``{experts module name: MoeTarget}`` of a compressed-tensors checkpoint: the config group of each expert
    linear found with compressed-tensors' own ``targets`` / ``ignore`` matching on an ``nn.Linear`` named as in the
    files (and, for Mixtral, as in the model: an ``ignore`` written for either name applies), checked to be the
    same group for every expert linear of a block, then every tensor it implies checked (`_check_tensors`).

    When no expert linear is quantized (all ignored or untargeted) and none is stored 8-bit, each block's target
    has ``scheme`` None: float experts, read into transformers' own experts module (`fill_float_experts`; its
    loader, transformers 5.17's compressed-tensors integration, leaves them uninitialized, reporting them
    missing).

    Raises ValueError naming the linear or tensor: some expert linears quantized and others not (ignored or
    untargeted), or an unquantized one stored 8-bit; experts of one block under different groups; a missing or
    mis-shaped tensor."""
    from compressed_tensors.utils import is_match, match_targets

    target_to_group = {}
    for gname, scheme in parsed.config.config_groups.items():
        for tg in scheme.targets:
            target_to_group.setdefault(tg, gname)
    ignore = list(parsed.config.ignore or [])
    key = parsed.key
    groups_of, untargeted, total = {}, [], 0
    for b in blocks:
        groups = groups_of.setdefault(b.experts, set())
        for e in range(b.num_experts):
            for proj, (n, k) in zip(PROJS, ((b.intermediate_size, b.hidden_size),) * 2 +
                                    ((b.hidden_size, b.intermediate_size),)):
                total += 1
                with torch.device("meta"):
                    lin = nn.Linear(k, n, bias=False)
                names = [b.linear(e, proj)] + ([b.linear(e, proj, True)] if b.name != b.ckpt_name else [])
                if any(is_match(nm, lin, ignore) for nm in names):
                    untargeted.append((b, e, proj, f"is named by {key}.ignore"))
                    continue
                matched = next((match_targets(nm, lin, target_to_group) for nm in names
                                if match_targets(nm, lin, target_to_group)), [])
                if not matched:
                    untargeted.append((b, e, proj, f"is targeted by no group of {key}.config_groups"))
                    continue
                groups.add(target_to_group[matched[0]])
    if untargeted:
        stored_8bit = [(b, e, p, why) for b, e, p, why in untargeted
                       if ckpt_meta.get(b.key(e, p, "weight"), ("",))[0] in _ST_8BIT]
        if len(untargeted) == total and not stored_8bit:
            out = {}
            for b in blocks:
                out[b.experts] = MoeTarget(b, None, "the float experts (no group quantizes them)")
                _check_tensors(out[b.experts], ckpt_meta, where)
            return out
        b, e, p, why = (stored_8bit or untargeted)[0]
        dt = ckpt_meta.get(b.key(e, p, "weight"), ("absent",))[0]
        raise ValueError(f"{where}: expert linear {b.linear(e, p)!r} {why} (its weight is stored {dt}), while "
                         f"{total - len(untargeted)} of the {total} expert linears are quantized: MoE experts load "
                         "8-bit when every expert linear is quantized, or as float when none is")
    out = {}
    for b in blocks:
        groups = groups_of[b.experts]
        if len(groups) != 1:
            raise ValueError(f"{where}: the experts of {b.name!r} are quantized by several groups of "
                             f"{key}.config_groups ({sorted(groups)}): W8A8MoE runs one scheme for all its experts")
        gname = groups.pop()
        t = MoeTarget(b, parsed.schemes[gname], f"group {gname!r}")
        _check_tensors(t, ckpt_meta, where)
        out[b.experts] = t
    return out


def native_moe_targets(blocks: List[MoeBlock], modules_to_not_convert: List[str], ckpt_meta: Dict[str, tuple],
                       where: str, key: str = "quantization_config") -> Dict[str, MoeTarget]:
    """``{experts module name: MoeTarget}`` of a transformers-native block-fp8 checkpoint: every expert linear
    stored as an e4m3 ``weight`` with its ``weight_scale_inv``. Raises ValueError naming the tensor or pattern
    for experts stored in another dtype (float experts are not supported), named by ``modules_to_not_convert``,
    or with a missing / mis-shaped tensor."""
    from ._native_fp8 import _not_converted

    out = {}
    for b in blocks:
        for e in range(b.num_experts):
            for proj in PROJS:
                wkey = b.key(e, proj, "weight")
                p = _not_converted(b.linear(e, proj), modules_to_not_convert)
                if p is not None:
                    raise ValueError(f"{where}: {key}.modules_to_not_convert pattern {p!r} names expert linear "
                                     f"{b.linear(e, proj)!r}: MoE experts left in float are not supported")
                if wkey in ckpt_meta and ckpt_meta[wkey][0] != "F8_E4M3":
                    raise ValueError(f"{where}: checkpoint tensor {wkey!r} is {ckpt_meta[wkey][0]}; the experts of "
                                     f"a {key}.quant_method = 'fp8' checkpoint must be F8_E4M3 (MoE experts left in "
                                     "float are not supported)")
        t = MoeTarget(b, BLOCK_SCHEME, f"{key}.weight_block_size = [128, 128]", "weight_scale_inv")
        _check_tensors(t, ckpt_meta, where)
        out[b.experts] = t
    return out


def _per_channel(scale: torch.Tensor, n: int) -> torch.Tensor:
    """A ``[N, 1]`` or ``[1]`` stored weight scale as float32 ``[N]`` (a per-tensor scale repeated: the same
    dequantized weight)."""
    s = scale.float().reshape(-1)
    return s.expand(n).contiguous() if s.numel() == 1 else s


def build_moe(t: MoeTarget, reader, device, dtype: torch.dtype, where: str, shard: Optional[Tuple[int, int]] = None):
    """The `W8A8MoE` of ``t`` on ``device`` from the checkpoint: ``w13[e]`` = expert e's gate weight rows then its
    up weight rows, ``w2[e]`` its down weight, the 8-bit values as stored; scales float32 (per-tensor ones repeated
    per channel); static input scales combined as the module docstring says (the largest of each GEMM's, with a
    UserWarning when they differ). ``dtype``: the layer's output dtype.

    ``reader``: `cutlass_w8a8.checkpoints._direct.Reader` (``whole(key)``, ``rows(key, ranges)``, ``cols(key, a,
    b)``). ``shard``: ``(a, b)``, keep only intermediate channels ``[a, b)`` of every expert (a tensor-parallel
    rank's part: gate and up rows ``[a, b)``, down columns ``[a, b)``; a and b multiples of 128 with block scales,
    b may be I), read from the files as slices; the layer then has ``intermediate_size`` b - a. None: all of I."""
    from ..config import W8A8Config

    b, s = t.block, t.scheme
    e_, h, i = b.num_experts, b.hidden_size, b.intermediate_size
    lo, hi = (0, i) if shard is None else shard
    if not (0 <= lo < hi <= i) or (s.block and (lo % BLOCK_SIZE or (hi % BLOCK_SIZE and hi != i))):
        raise ValueError(f"{where}: shard {shard} of the intermediate size {i} of {b.name!r} is not a range of it"
                         + (f" on {BLOCK_SIZE}-channel block boundaries" if s.block else ""))
    whole = shard is None
    blo, bhi = lo // BLOCK_SIZE, _limits.blocks(hi)

    def rows(key, a, z):
        return reader.whole(key) if whole else reader.rows(key, [(a, z)])

    def cols(key, a, z):
        return reader.whole(key) if whole else reader.cols(key, a, z)

    w13, w2, s13, s2, a13, a2 = [], [], [], [], [], []
    for e in range(e_):
        g, u = (rows(b.key(e, p, "weight"), lo, hi) for p in ("gate", "up"))
        d = cols(b.key(e, "down", "weight"), lo, hi)
        w13.append(torch.cat([g, u], 0))
        w2.append(d)
        gk, uk, dk = (b.key(e, p, t.scale_leaf) for p in PROJS)
        if s.block:
            s13.append(torch.cat([rows(gk, blo, bhi), rows(uk, blo, bhi)], 0).float())
            s2.append(cols(dk, blo, bhi).float())
        else:
            gs, us = (rows(k, lo, hi) if s.per_channel else reader.whole(k) for k in (gk, uk))
            s13.append(torch.cat([_per_channel(gs, hi - lo), _per_channel(us, hi - lo)]))
            s2.append(_per_channel(reader.whole(dk), h))
        if s.static_input:
            a13 += [reader.whole(b.key(e, "gate", "input_scale")).float().reshape(()),
                    reader.whole(b.key(e, "up", "input_scale")).float().reshape(())]
            a2.append(reader.whole(b.key(e, "down", "input_scale")).float().reshape(()))
    config = W8A8Config(dtype=s.quant_dtype, out_dtype=dtype,
                        weight_block_size=(BLOCK_SIZE, BLOCK_SIZE) if s.block else None)
    moe = W8A8MoE(e_, b.top_k, h, hi - lo, config, renormalize=b.renormalize, device="meta",
                  static_input_scale=s.static_input, **b.routing_kwargs())
    values = {"w13": torch.stack(w13), "w13_scale": torch.stack(s13), "w2": torch.stack(w2),
              "w2_scale": torch.stack(s2)}
    if s.static_input:
        for field, scales, what in (("a13_scale", a13, "gate_proj / up_proj"), ("a2_scale", a2, "down_proj")):
            st = torch.stack(scales)
            if not torch.all(st == st[0]):
                warnings.warn(f"{where}: the static input_scale of the {what} experts of {b.name!r} range from "
                              f"{st.min().item():.6g} to {st.max().item():.6g}; W8A8MoE has one per GEMM and uses the "
                              "largest (the experts with smaller scales then run on its coarser grid)", UserWarning,
                              stacklevel=3)
            values[field] = st.max().reshape(1)
    for name, v in values.items():
        want = getattr(moe, name)
        if tuple(v.shape) != tuple(want.shape) or v.dtype != want.dtype:
            raise RuntimeError(f"{where}: {b.experts}.{name} built as {v.dtype} {tuple(v.shape)}, W8A8MoE holds "
                               f"{want.dtype} {tuple(want.shape)}; please report this")
        moe._buffers[name] = v.to(device)
    moe.train(False)
    return moe


def link_correction_biases(model: nn.Module, moe: Dict[str, MoeTarget]) -> None:
    """Give each `W8A8MoE` of ``moe`` (``{experts module name: MoeTarget}``, built by `build_moe` before the routers
    were read) its block's loaded correction bias (the row's `Routing.correction_bias` path, DeepSeek-V3's
    ``gate.e_score_correction_bias``) as `W8A8MoE` holds one: the router's own float32 tensor (the same storage),
    else a float32 copy. Blocks whose row has none, and float experts, are left alone."""
    for name, t in moe.items():
        path = t.block.family.routing.correction_bias
        layer = model.get_submodule(name)
        if path is None or not isinstance(layer, W8A8MoE):
            continue
        bias = model.get_submodule(t.block.name)
        for part in path.split("."):
            bias = getattr(bias, part)
        bias = bias.detach().reshape(layer.num_experts)
        layer.correction_bias = bias if bias.dtype == torch.float32 else bias.float()


def fill_float_experts(model: nn.Module, t: MoeTarget, reader, device, dtype: torch.dtype) -> None:
    """Experts stored in float (``t.scheme`` None): transformers' experts module of the block gets
    ``gate_up_proj[e]`` = expert e's gate rows then up rows and ``down_proj[e]`` its down weight (the family's
    `ExpertLayout` names), in ``dtype``."""
    b = t.block
    lay = b.family.layout
    experts = model.get_submodule(b.experts)
    gu = torch.stack([torch.cat([reader.whole(b.key(e, "gate", "weight")), reader.whole(b.key(e, "up", "weight"))])
                      for e in range(b.num_experts)])
    dn = torch.stack([reader.whole(b.key(e, "down", "weight")) for e in range(b.num_experts)])
    setattr(experts, lay.gate_up, nn.Parameter(gu.to(device=device, dtype=dtype), requires_grad=False))
    setattr(experts, lay.down, nn.Parameter(dn.to(device=device, dtype=dtype), requires_grad=False))


# ---- writing -----------------------------------------------------------------------------------------------------


def router_ignore(model: nn.Module) -> List[str]:
    """compressed-tensors ``ignore`` entries for the blocks of ``model`` that belong to a family of
    `cutlass_w8a8.moe.families`, as llm-compressor writes them: their routers (``re:.*mlp.gate$``, Mixtral
    ``re:.*block_sparse_moe.gate$``: the block's name in the files, then the row's router; a reader that builds the
    router as an ``nn.Linear``, vLLM's, must leave it in float), and the experts of blocks whose experts are still
    transformers' float module (``re:.*mlp.experts.*``), so that they are read back in float."""
    out = []
    for name, m in model.named_modules():
        fam = family_of(m)
        if fam is None:
            continue
        block = fam.checkpoint_block(name).rpartition(".")[2]
        entries = [f"re:.*{block}.{fam.routing.router}$"]
        if not isinstance(getattr(m, fam.layout.module, None), W8A8MoE):
            entries.append(f"re:.*{block}.{fam.layout.module}.*")
        out += [x for x in entries if x not in out]
    return out


def _layout(model: nn.Module, name: str, where: str) -> Tuple[str, MoeFamily]:
    """``(block name in the files, family)`` of the `W8A8MoE` at ``name``; ValueError when it is not the experts
    of a block of `cutlass_w8a8.moe.families`."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    fam = family_of(parent)
    if fam is None or child != fam.layout.module:
        raise ValueError(f"{where}: W8A8MoE {name!r} is not the `experts` of a {family_names('or')} "
                         f"block (its parent is {type(parent).__name__}): no checkpoint layout to write it in")
    return fam.checkpoint_block(parent_name), fam


def checkpoint_block_of(model: nn.Module, name: str, where: str) -> str:
    """The files' name of the block whose experts are the `W8A8MoE` at ``name`` (``model.layers.0.block_sparse_moe``
    for Mixtral, else the block's module name)."""
    return _layout(model, name, where)[0]


def moe_linear_names(model: nn.Module, name: str, moe: nn.Module, where: str) -> List[str]:
    """The per-expert linear module names (as the files name them) the `W8A8MoE` at ``name`` is written as."""
    ckpt_block, fam = _layout(model, name, where)
    return [f"{ckpt_block}.{fam.layout.module}.{e}.{leaf}" for e in range(moe.w13.shape[0])
            for leaf in fam.checkpoint.projs]


def float_expert_headers(model: nn.Module, headers: Dict[str, tuple], where: str) -> Dict[str, tuple]:
    """``headers`` (``{tensor name: (safetensors dtype, shape)}`` of ``model.state_dict()``) as the files hold
    them after transformers' ``save_pretrained``, which writes the fused float experts (``gate_up_proj`` [E, 2I, H],
    ``down_proj`` [E, H, I]) of a block of `cutlass_w8a8.moe.families` per expert (``<block>.experts.{e}.{gate,
    up,down}_proj.weight``, Mixtral's under ``block_sparse_moe``), the layout the loader reads. Other modules'
    entries are kept as they are."""
    out = dict(headers)
    for name, m in model.named_modules():
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        fam = family_of(parent)
        if fam is None or name.rpartition(".")[2] != fam.layout.module:
            continue
        gu_key, dn_key = f"{name}.{fam.layout.gate_up}", f"{name}.{fam.layout.down}"
        gu, dn = out.get(gu_key), out.get(dn_key)
        if gu is None or dn is None or len(gu[1]) != 3:
            continue
        ckpt_block, fam = _layout(model, name, where)
        e_, two_i, h = gu[1]
        del out[gu_key], out[dn_key]
        shapes = ((gu[0], [two_i // 2, h]),) * 2 + ((dn[0], [h, two_i // 2]),)
        for e in range(e_):
            for leaf, (dt, shape) in zip(fam.checkpoint.projs, shapes):
                out[f"{ckpt_block}.{fam.layout.module}.{e}.{leaf}.weight"] = (dt, shape)
    return out


def moe_state_dict(model: nn.Module, where: str) -> Optional[dict]:
    """``model.state_dict()`` with each `W8A8MoE`'s buffers replaced by the per-expert tensors of the checkpoint
    layout (names as the files hold them; ``weight_scale`` float32 ``[N, 1]`` per channel or ``[ceil(N / 128),
    K / 128]`` block; ``input_scale`` float32 ``[1]`` for each gate / up (``a13_scale``) and down (``a2_scale``)
    linear of a static layer), or None when ``model`` holds no `W8A8MoE`.

    Raises ValueError naming the module for a `W8A8MoE` that is not the experts of a block of
    `cutlass_w8a8.moe.families` (the layout would have no reader), or block scales with I not a multiple of 128."""
    moes = {n: m for n, m in model.named_modules() if isinstance(m, W8A8MoE)}
    if not moes:
        return None
    sd = model.state_dict()
    for name, moe in moes.items():
        ckpt_block, fam = _layout(model, name, where)
        e_, i = moe.w13.shape[0], moe.w13.shape[1] // 2
        block = moe.weight_block_size is not None
        if block and i % BLOCK_SIZE:
            raise ValueError(f"{where}: W8A8MoE {name!r} has block scales with intermediate_size {i}, not a multiple "
                             f"of {BLOCK_SIZE}: gate and up share a scale block and cannot be written apart")
        for buf in ("w13", "w13_scale", "w2", "w2_scale", "a13_scale", "a2_scale"):
            sd.pop(f"{name}.{buf}", None)
        ib = i // BLOCK_SIZE
        for e in range(e_):
            w13, s13 = moe.w13[e], moe.w13_scale[e]
            parts = {
                "gate": (w13[:i], s13[:ib] if block else s13[:i].reshape(-1, 1), moe.a13_scale),
                "up": (w13[i:], s13[ib:] if block else s13[i:].reshape(-1, 1), moe.a13_scale),
                "down": (moe.w2[e], moe.w2_scale[e] if block else moe.w2_scale[e].reshape(-1, 1), moe.a2_scale),
            }
            for proj, (w, sc, xs) in parts.items():
                base = f"{ckpt_block}.{fam.layout.module}.{e}.{fam.checkpoint.projs[PROJS.index(proj)]}"
                # copies: safetensors refuses tensors that share storage (views of w13)
                sd[f"{base}.weight"] = w.clone()
                sd[f"{base}.weight_scale"] = sc.float().clone()
                if xs is not None:
                    sd[f"{base}.input_scale"] = xs.float().reshape(1).clone()
    return sd
