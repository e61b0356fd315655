"""`optimize_`: transformers decoder layers rebuilt in place around fused W8A8 projections and fused
norm / activation quantization (`RMSNormQuant`, `unfused` and `unoptimize_` are re-exported from `.unfuse`).

What a recognised decoder layer (Llama, Mistral, Qwen2, Qwen3; the attention side of Qwen3-MoE, Mixtral, Qwen2-MoE and
GLM-4.5 / 4.6, their dense MLP layers, and the shared experts of Qwen2-MoE's and GLM-4.5's MoE blocks;
``SUPPORTED_LAYERS``) becomes:

- ``self_attn``: ``q_proj`` / ``k_proj`` / ``v_proj`` (`W8A8Linear`) are replaced by one ``qkv_proj``
  (`cutlass_w8a8.distributed.fuse_w8a8`: rows stacked ``[q | k | v]``; per-tensor weight scales become
  per-channel scales, each layer's value repeated over its rows, which is exact). The module keeps its transformers
  class as a base: its class is swapped for a subclass (``Fused<Class>``) whose ``forward`` runs ``qkv_proj``
  once, splits the result into q, k and v views, and then runs the same steps as transformers' own forward with
  transformers' own functions (the model module's ``apply_rotary_pos_emb``, ``ALL_ATTENTION_FUNCTIONS`` /
  ``eager_attention_forward``, the cache's ``update``), so ``attn_implementation``, ``DynamicCache`` /
  ``StaticCache``, masks and ``generate`` behave as before.
- ``mlp``: ``gate_proj`` / ``up_proj`` become one ``gate_up_proj`` ``[gate | up]``, and ``act_fn(gate) * up``
  before a `W8A8Linear` ``down_proj`` becomes `cutlass_w8a8.silu_mul_quant`, which hands ``down_proj`` a
  `QuantizedActivation` (one kernel instead of silu, mul and the activation quantization).
- a sparse-MoE block's shared experts (the block's `cutlass_w8a8.moe.families` row's ``SharedExperts.module``) when
  that module is the layer's MLP class (Qwen2-MoE's ``shared_expert``, GLM-4.5's ``shared_experts``): fused as the
  ``mlp`` above (its quantization of the block's input stays its own: the norm before the block is not fused, the
  router and the routed experts read its float output); the block's forward and its shared-expert gate are
  unchanged.
- ``input_layernorm`` / ``post_attention_layernorm``: replaced by `RMSNormQuant`, which runs
  `cutlass_w8a8.rms_norm_quant` with the quantization of the fused projection that follows it and returns a
  `QuantizedActivation` (the decoder layer passes the norm's output straight to ``self_attn`` / ``mlp``). It holds
  the norm's own ``weight`` parameter, so ``state_dict`` keys do not change.

The residual adds stay in transformers' decoder-layer code (not fused).

transformers' interfaces (the unfused ``state_dict`` layout, the read-only ``q_proj`` ... ``up_proj``
views, `unfused`, `unoptimize_`) are kept by `cutlass_w8a8.hf.unfuse`, whose `_FusedModule` the fused classes made
here derive from.

Numerics: the fused GEMMs equal the separate ones (per-channel scales, the same quantized activation; bit for bit
on the CPU reference and for int8 on the GPU). ``silu_mul_quant`` equals ``act_fn(gate) * up`` then the
per-token quantization bit for bit. ``rms_norm_quant`` computes ``(x * rsqrt(mean(x^2) + eps)) * weight`` in
float32 and rounds once, where transformers' RMSNorm rounds ``x * rsqrt(...)`` to the model dtype and then
multiplies by ``weight`` in the model dtype (a second rounding): with norm weights that are all 1 the two agree
bit for bit, otherwise an element may differ by one unit in the last place of bfloat16 before quantization
(tests/hf/test_hf_optimize_cpu.py states the tolerance).
"""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Optional

import torch
from torch import nn

from ..fuse import fuse_w8a8
from ..linear import QuantizedActivation, W8A8Linear
from ..moe.families import family_of
from ..ops._schema import OVERLOADS as _op
from .unfuse import RMSNormQuant, _FusedModule, _add_hooks, _plain_w8a8, unfused, unoptimize_

__all__ = ["optimize_", "unoptimize_", "unfused", "RMSNormQuant", "SUPPORTED_LAYERS", "TESTED_TRANSFORMERS",
           "is_optimized"]

# decoder-layer class -> (attention class, MLP class, RMSNorm class), all by name (transformers is not imported here)
SUPPORTED_LAYERS = {
    "LlamaDecoderLayer": ("LlamaAttention", "LlamaMLP", "LlamaRMSNorm"),
    "MistralDecoderLayer": ("MistralAttention", "MistralMLP", "MistralRMSNorm"),
    "Qwen2DecoderLayer": ("Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm"),
    "Qwen3DecoderLayer": ("Qwen3Attention", "Qwen3MLP", "Qwen3RMSNorm"),
    # mixture-of-experts layers: the attention side (and a dense MLP where a layer has one); their sparse MoE
    # blocks are left as they are, without a warning (W8A8MoE quantizes its own activations after the router)
    "Qwen3MoeDecoderLayer": ("Qwen3MoeAttention", "Qwen3MoeMLP", "Qwen3MoeRMSNorm"),
    "MixtralDecoderLayer": ("MixtralAttention", "MixtralMLP", "MixtralRMSNorm"),
    "Qwen2MoeDecoderLayer": ("Qwen2MoeAttention", "Qwen2MoeMLP", "Qwen2MoeRMSNorm"),
    # GLM-4.5 / 4.6: q / k / v bias (attention_bias), q / k norms when config.use_qk_norm, partial rotary (transformers'
    # own apply_rotary_pos_emb rotates the first head_dim * partial_rotary_factor features); the first
    # first_k_dense_replace layers have a dense MLP
    "Glm4MoeDecoderLayer": ("Glm4MoeAttention", "Glm4MoeMLP", "Glm4MoeRMSNorm"),
}
# the transformers versions these layers' code was read from and the tests run with (pyproject.toml's range)
TESTED_TRANSFORMERS = ("5.17.0", "5.24.0")


def _version_tuple(v: str) -> tuple:
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def check_transformers_version(where: str = "optimize_") -> Optional[str]:
    """Warn when the installed transformers is outside ``TESTED_TRANSFORMERS`` (inclusive); return its version
    (None when transformers is not installed)."""
    try:
        import transformers
    except ImportError:
        return None
    v = transformers.__version__
    lo, hi = TESTED_TRANSFORMERS
    if not (_version_tuple(lo) <= _version_tuple(v) <= _version_tuple(hi)):
        warnings.warn(f"cutlass_w8a8.{where}: transformers {v} is outside the tested range {lo} .. {hi}; the fused "
                      "layers follow the decoder code of those versions and may not match this one", stacklevel=3)
    return v


# ---- the modules --------------------------------------------------------------------------------------------


class _FusedQKVAttention(_FusedModule):
    """The forward of ``Fused<Attention>`` classes (first in their MRO; the transformers class is the base)."""

    _cw_fused_name = "qkv_proj"

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                cache=None, **kwargs):
        cls = type(self)
        mod = sys.modules[cls._cw_base.__module__]  # the modeling module: transformers' own functions
        cache = cache if cache is not None else past_key_values
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, k, v = self.qkv_proj(hidden_states).split(self._cw_qkv_sizes, dim=-1)
        q, k, v = q.view(hidden_shape), k.view(hidden_shape), v.view(hidden_shape)
        if self._cw_qk_norm:  # Qwen3: RMSNorm over each head of q and k
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = position_embeddings
        q, k = mod.apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None:
            if cls._cw_update_kwargs:
                k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
            else:
                k, v = cache.update(k, v, self.layer_idx)
        attention_interface = mod.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                        mod.eager_attention_forward)
        extra = {}
        if self._cw_sliding == "attr":  # Qwen2 / Qwen3: per-layer window (None on full-attention layers)
            extra["sliding_window"] = self.sliding_window
        elif self._cw_sliding == "config":  # Mistral
            extra["sliding_window"] = getattr(self.config, "sliding_window", None)
        out, weights = attention_interface(self, q, k, v, attention_mask,
                                           dropout=0.0 if not self.training else self.attention_dropout,
                                           scaling=self.scaling, **extra, **kwargs)
        out = out.reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), weights


class _FusedGateUpMLP(_FusedModule):
    """The forward of ``Fused<MLP>`` classes: one ``gate_up_proj`` GEMM, then ``silu_mul_quant`` into a W8A8
    ``down_proj`` (or ``act_fn(gate) * up`` when ``down_proj`` is not a `W8A8Linear` or the activation is not
    SiLU)."""

    _cw_fused_name = "gate_up_proj"

    def forward(self, x):
        gu = self.gate_up_proj(x)
        down = self.down_proj
        if self._cw_silu_quant:
            q, s = _op.silu_mul_quant(gu, down.quant_dtype, down.input_scale, down.group_size)
            return down(QuantizedActivation(q, s if down.input_scale is None else down.input_scale))
        gate, up = gu.chunk(2, dim=-1)
        return down(self.act_fn(gate) * up)


_FUSED_CLASSES: dict = {}


def _fused_class(mixin: type, base: type) -> type:
    """``Fused<base>``: ``mixin``'s forward over transformers' ``base``, made once per base and kept in this
    module's namespace (so that ``pickle`` finds it by name)."""
    key = (mixin, base)
    if key not in _FUSED_CLASSES:
        name = f"Fused{base.__name__}"
        attrs = {"__module__": __name__, "_cw_base": base}
        if mixin is _FusedQKVAttention:
            params = inspect.signature(base.forward).parameters
            attrs["_cw_update_kwargs"] = "cache" in params  # transformers >= 5.24: cache.update(..., kwargs=kwargs)
        cls = type(name, (mixin, base), attrs)
        cls.__qualname__ = name
        _FUSED_CLASSES[key] = cls
        globals()[name] = cls
    return _FUSED_CLASSES[key]


# ---- the surgery ------------------------------------------------------------------------------------------


def _is_rmsnorm(m: nn.Module, cls_name: str) -> bool:
    w = getattr(m, "weight", None)
    return (type(m).__name__ == cls_name and isinstance(w, torch.Tensor) and w.dim() == 1
            and isinstance(getattr(m, "variance_epsilon", None), float))


def _why_not_parts(owner: nn.Module, names) -> Optional[str]:
    for n in names:
        m = getattr(owner, n, None)
        if m is None:
            return f"it has no `{n}`"
        if not _plain_w8a8(m):
            return (f"`{n}` is {type(m).__name__}, not a W8A8Linear (quantize the model with cutlass_w8a8.quantize_ "
                    "or load it with cutlass_w8a8.from_pretrained first; tensor-parallel layers are not fused)")
    return None


def _fuse_attention(layer: nn.Module, norm_cls: str, fqn: str, notes: list) -> bool:
    attn = layer.self_attn
    why = _why_not_parts(attn, ("q_proj", "k_proj", "v_proj"))
    if why:
        notes.append(f"{fqn}.self_attn: left unfused: {why}")
        return False
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    try:
        fused, sizes = fuse_w8a8(parts)
    except ValueError as e:
        notes.append(f"{fqn}.self_attn: left unfused: {e}")
        return False
    fused.train(attn.q_proj.training)
    meta = [("q_proj", *_part_meta(attn.q_proj)), ("k_proj", *_part_meta(attn.k_proj)),
            ("v_proj", *_part_meta(attn.v_proj))]
    base = type(attn)
    attn._cw_order = list(attn._modules)  # the children's order, which state_dict keys follow
    for n in ("q_proj", "k_proj", "v_proj"):
        delattr(attn, n)
    attn.qkv_proj = fused
    attn._cw_qkv_sizes = list(sizes)
    attn._cw_parts = meta
    attn._cw_qk_norm = isinstance(getattr(attn, "q_norm", None), nn.Module)
    attn._cw_sliding = ("config" if base.__name__ == "MistralAttention"
                        else "attr" if "sliding_window" in attn.__dict__ else None)
    attn.__class__ = _fused_class(_FusedQKVAttention, base)
    _add_hooks(attn)
    _fuse_norm(layer, "input_layernorm", norm_cls, fused, fqn, notes)
    return True


def _fuse_mlp(layer: nn.Module, norm_cls: str, fqn: str, notes: list) -> bool:
    """The layer's dense ``mlp`` fused (`_fuse_gate_up`), and the ``post_attention_layernorm`` before it."""
    fused = _fuse_gate_up(layer.mlp, f"{fqn}.mlp", notes)
    if fused is None:
        return False
    _fuse_norm(layer, "post_attention_layernorm", norm_cls, fused, fqn, notes)
    return True


def _fuse_gate_up(mlp: nn.Module, where: str, notes: list) -> Optional[W8A8Linear]:
    """``mlp``'s ``gate_proj`` / ``up_proj`` fused into one ``gate_up_proj`` and its class swapped for
    ``Fused<Class>``; returns the fused layer, or None (a note naming ``where``) when it is left as it is."""
    why = _why_not_parts(mlp, ("gate_proj", "up_proj"))
    if why:
        notes.append(f"{where}: left unfused: {why}")
        return None
    try:
        fused, sizes = fuse_w8a8([mlp.gate_proj, mlp.up_proj])
    except ValueError as e:
        notes.append(f"{where}: left unfused: {e}")
        return None
    fused.train(mlp.gate_proj.training)
    meta = [("gate_proj", *_part_meta(mlp.gate_proj)), ("up_proj", *_part_meta(mlp.up_proj))]
    base = type(mlp)
    mlp._cw_order = list(mlp._modules)
    del mlp.gate_proj, mlp.up_proj
    mlp.gate_up_proj = fused
    mlp._cw_parts = meta
    down = getattr(mlp, "down_proj", None)
    mlp._cw_silu_quant = (_plain_w8a8(down) and _is_silu(getattr(mlp, "act_fn", None))
                          and down.dtype == fused.dtype)
    mlp.__class__ = _fused_class(_FusedGateUpMLP, base)
    _add_hooks(mlp)
    return fused


def _fuse_shared_experts(block: nn.Module, mlp_cls: str, fqn: str, notes: list) -> bool:
    """The shared experts of a sparse-MoE ``block`` (its `cutlass_w8a8.moe.families` row's
    ``SharedExperts.module``: Qwen2-MoE's ``shared_expert``, GLM-4.5's ``shared_experts``) fused as a gate_up MLP
    when that module is the decoder layer's own MLP class ``mlp_cls`` (the same forward as a dense layer's MLP). A
    block's shared-expert gate (Qwen2-MoE's ``shared_expert_gate``) stays as it is, and so does the norm before the
    block (the router and the experts read its float output). Returns whether it fused."""
    fam = family_of(block)
    shared = None if fam is None or fam.shared_experts is None else getattr(block, fam.shared_experts.module, None)
    if shared is None or type(shared).__name__ != mlp_cls:
        return False
    return _fuse_gate_up(shared, f"{fqn}.{fam.shared_experts.module}", notes) is not None


def _is_moe_block(m) -> bool:
    """A sparse mixture-of-experts block: a block of a `cutlass_w8a8.moe.families` row (the one owner of which
    transformers classes are MoE blocks; not a class-name test, which dense ``Glm4MoeMLP`` / ``Qwen3MoeMLP`` pass)."""
    return family_of(m) is not None


def _is_silu(act) -> bool:
    """``nn.SiLU`` or transformers' ``SiLUActivation`` (``ACT2FN["silu"]``, whose forward is ``F.silu``)."""
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _fuse_norm(layer: nn.Module, name: str, norm_cls: str, target: W8A8Linear, fqn: str, notes: list) -> None:
    norm = getattr(layer, name, None)
    if not _is_rmsnorm(norm, norm_cls):
        notes.append(f"{fqn}.{name}: left as is: {type(norm).__name__} is not {norm_cls}")
        return
    if norm.weight.dtype != target.dtype:
        notes.append(f"{fqn}.{name}: left as is: the norm's weight is {norm.weight.dtype} but the fused "
                     f"projection's output dtype is {target.dtype} (load the model in {target.dtype})")
        return
    setattr(layer, name, RMSNormQuant(norm, target))


def _part_meta(m: W8A8Linear) -> tuple:
    """What a part of a fused layer needs to be rebuilt exactly: N, and whether its weight scale was one value."""
    return (m.out_features, m.weight_block_size is None and m.weight_scale.numel() == 1)


def is_optimized(model: nn.Module) -> bool:
    """Whether `optimize_` fused any layer of ``model``."""
    return any(isinstance(m, (_FusedQKVAttention, _FusedGateUpMLP, RMSNormQuant)) for m in model.modules())


def optimize_(model: nn.Module) -> nn.Module:
    """Fuse, in place, the projections and norm / activation quantization of a quantized transformers model's
    decoder layers (the module docstring says what each part becomes).

    Parameters
    ----------
    model : torch.nn.Module
        A transformers model (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
        ``Qwen3ForCausalLM``, or their base models; ``Qwen3MoeForCausalLM`` / ``MixtralForCausalLM`` /
        ``Qwen2MoeForCausalLM`` / ``Glm4MoeForCausalLM``: the attention side, any dense MLP layer and the MoE blocks'
        shared experts; the blocks' routers and routed experts are left as they are) whose q / k / v and gate / up projections are `W8A8Linear`
        (`cutlass_w8a8.quantize_`, `cutlass_w8a8.from_pretrained`): int8 or fp8, per-channel or per-tensor
        weights, dynamic per-token or static per-tensor activations, or block-scaled fp8.

    Returns
    -------
    torch.nn.Module
        ``model``. Calling it again changes nothing.

    Warnings
    --------
    One ``UserWarning`` listing what was left as it was, each naming the module and why: a decoder layer of a class
    not in ``SUPPORTED_LAYERS`` (e.g. ``'model.layers.0' (GPT2Block) is not a recognised decoder layer``), float or
    tensor-parallel projections, projections `fuse_w8a8` refuses to stack (different static ``input_scale`` values,
    ...), a norm whose dtype differs from the projection's output dtype. Also a ``UserWarning`` when transformers
    is outside ``TESTED_TRANSFORMERS``.

    Raises
    ------
    TypeError
        ``model`` is not an ``nn.Module``.

    Notes
    -----
    The model keeps transformers' interfaces. ``model.state_dict()``, transformers' own ``model.save_pretrained``
    and ``cutlass_w8a8.save_pretrained`` write the unfused layout (``q_proj`` / ``k_proj`` / ``v_proj`` /
    ``gate_proj`` / ``up_proj`` tensors and scales, the norms' ``weight``), byte for byte what the unoptimized model
    writes, and ``model.load_state_dict`` accepts it (state-dict hooks on the fused modules). ``q_proj`` ...
    ``up_proj`` are read-only views of the fused weights' rows (a new `W8A8Linear` on each access: no hooks or
    parameters of theirs take part in ``forward``); assigning them raises ``AttributeError``. To replace or wrap
    them (PEFT / LoRA, forward hooks), call `unoptimize_` first, or load with ``from_pretrained(...,
    optimize=False)``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize_: `model` must be a torch.nn.Module, got {type(model).__name__}")
    check_transformers_version()
    notes: list = []
    fused_layers = 0
    for fqn, layer in list(model.named_modules()):
        cls = type(layer).__name__
        if cls in SUPPORTED_LAYERS:
            attn_cls, mlp_cls, norm_cls = SUPPORTED_LAYERS[cls]
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            did = False
            for part, want in ((attn, attn_cls), (mlp, mlp_cls)):
                if part is mlp and _is_moe_block(mlp):
                    continue
                if part is not None and type(part).__name__ != want and not isinstance(
                        part, (_FusedQKVAttention, _FusedGateUpMLP)):
                    notes.append(f"{fqn}: left as is: its {'self_attn' if part is attn else 'mlp'} is "
                                 f"{type(part).__name__}, not {want}")
                    part = None
            if type(attn).__name__ == attn_cls:
                did |= _fuse_attention(layer, norm_cls, fqn, notes)
            if type(mlp).__name__ == mlp_cls:
                did |= _fuse_mlp(layer, norm_cls, fqn, notes)
            elif mlp is not None and _is_moe_block(mlp):
                did |= _fuse_shared_experts(mlp, mlp_cls, f"{fqn}.mlp", notes)
            fused_layers += did
        elif cls.endswith("DecoderLayer") or (hasattr(layer, "self_attn") and hasattr(layer, "mlp")):
            notes.append(f"{fqn!r} ({cls}) is not a recognised decoder layer (supported: "
                         f"{', '.join(SUPPORTED_LAYERS)}); left as is")
    if notes:
        shown = notes[:8] + ([f"... and {len(notes) - 8} more"] if len(notes) > 8 else [])
        warnings.warn("cutlass_w8a8.optimize_: " + "; ".join(shown), stacklevel=2)
    return model


# The public names of the fused mixins: ``isinstance(module, FusedQKVAttention)`` tells an `optimize_`d attention (a
# ``qkv_proj`` W8A8Linear, ``_cw_qkv_sizes``), ``isinstance(module, FusedGateUpMLP)`` an optimized MLP (a
# ``gate_up_proj``, ``_cw_silu_quant``). `cutlass_w8a8.hf.DecodeStep` tests for them; the private names stay.
FusedQKVAttention = _FusedQKVAttention
FusedGateUpMLP = _FusedGateUpMLP
__all__ += ["FusedQKVAttention", "FusedGateUpMLP"]
