"""The transformers interface of a model `cutlass_w8a8.hf.optimize_` fused: the unfused checkpoint layout
kept by ``state_dict`` / ``load_state_dict`` hooks, the read-only part views and the refusals to assign or delete
them, `unfused` (that layout for the length of a ``with`` block) and `unoptimize_` (transformers' classes back for
good). `RMSNormQuant` and `_FusedModule` (the base of the ``Fused<Class>`` classes `cutlass_w8a8.hf.optimize`
makes) live here, so that this module never imports ``optimize``.

What a fused model keeps of transformers' interfaces:

- ``state_dict()`` (and so transformers' own ``model.save_pretrained``, and ``cutlass_w8a8.save_pretrained``) has the
  unfused keys and tensors: a state-dict post-hook on each fused attention / MLP splits ``qkv_proj`` /
  ``gate_up_proj`` back into ``q_proj`` / ``k_proj`` / ``v_proj`` / ``gate_proj`` / ``up_proj`` tensors, byte for
  byte what the unoptimized model holds (`_split`); ``load_state_dict`` of those keys fuses them again (a
  load-state-dict pre-hook).
- ``attn.q_proj`` ... ``mlp.up_proj`` are read-only views: a `W8A8Linear` over the fused weight's rows (no copy)
  with the part's own scales, made on each access. Assigning or deleting them raises an ``AttributeError`` that
  names `unoptimize_`, which puts transformers' classes and separate modules back for good.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch
from torch import nn

from ..linear import QuantizedActivation, W8A8Linear
from ..ops._schema import OVERLOADS as _op

__all__ = ["unfused", "unoptimize_", "RMSNormQuant"]


# ---- the modules optimize_ puts in -------------------------------------------------------------------------


class RMSNormQuant(nn.Module):
    """An RMSNorm fused with the activation quantization of the `W8A8Linear` it feeds (`rms_norm_quant`).

    ``forward(hidden_states)``: ``hidden_states`` ``(..., K)`` in ``weight``'s dtype (bfloat16 / float16) ->
    `QuantizedActivation` (``q`` ``(..., K)`` int8 / float8_e4m3fn; ``scale`` float32 ``(..., 1)`` per token,
    ``(..., K / 128)`` per 1 x 128 group for a block-scaled target, or the target's static ``(1,)``
    ``input_scale``).

    Attributes
    ----------
    weight : nn.Parameter
        The replaced norm's own ``(K,)`` weight (the same Parameter object).
    variance_epsilon : float
    quant_dtype : torch.dtype
        The target layer's ``quant_dtype``.
    group_size : int
        The target layer's ``group_size`` (0 or 128).
    input_scale : torch.Tensor or None
        The target layer's static ``(1,)`` float32 activation scale (a non-persistent buffer: not in
        ``state_dict``), or None (dynamic).
    """

    def __init__(self, norm: nn.Module, target: W8A8Linear):
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = float(norm.variance_epsilon)
        self.quant_dtype = target.quant_dtype
        self.group_size = target.group_size
        self.register_buffer("input_scale", target.input_scale, persistent=False)
        self._cw_original = (norm,)  # a tuple: not registered as a submodule; restored by `unfused`

    def forward(self, hidden_states: torch.Tensor) -> QuantizedActivation:
        q, s = _op.rms_norm_quant(hidden_states, self.weight, self.variance_epsilon, self.quant_dtype,
                                  self.input_scale, None, self.group_size)
        return QuantizedActivation(q, s if self.input_scale is None else self.input_scale)

    def extra_repr(self) -> str:
        return (f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, quant_dtype={self.quant_dtype}, "
                f"group_size={self.group_size}, static={self.input_scale is not None}")


_UNOPTIMIZE_HINT = ("call cutlass_w8a8.unoptimize_(model) first to get transformers' separate modules back, or load "
                    "the model with cutlass_w8a8.from_pretrained(..., optimize=False)")


class _FusedModule:
    """What ``Fused<Attention>`` and ``Fused<MLP>`` share (first in their MRO, before transformers' class): the
    parts fused into ``_cw_fused_name`` (``self._cw_parts``: ``(name, N, per_tensor)`` in row order) reachable as
    read-only views, and refused as assignment / deletion targets. The state-dict hooks (`_state_dict_post_hook`,
    `_load_state_dict_pre_hook`) are registered on each instance by `optimize_`."""

    _cw_fused_name = ""

    def _cw_part_names(self) -> tuple:
        return tuple(p[0] for p in self.__dict__.get("_cw_parts", ()))

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)  # nn.Module's: parameters, buffers, submodules
        except AttributeError as e:
            if name not in self._cw_part_names():
                raise  # torch's own error, unchanged
            missing = e
        fused = self._modules.get(self._cw_fused_name)
        if not _plain_w8a8(fused):
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute '{name}': optimize_ fused "
                f"{'/'.join(self._cw_part_names())} into `{self._cw_fused_name}`, which is now "
                f"{type(fused).__name__}, not the W8A8Linear whose rows could be offered as a view; load the model "
                "with cutlass_w8a8.from_pretrained(..., optimize=False), or call cutlass_w8a8.unoptimize_(model) "
                f"before changing `{self._cw_fused_name}`") from missing
        return dict(_split(fused, self._cw_parts))[name]

    def _cw_refuse(self, name: str, what: str):
        start = 0
        for part, n, _ in self._cw_parts:
            if part == name:
                break
            start += n
        raise AttributeError(
            f"{type(self).__name__}.{name} cannot be {what}: it is a read-only view of rows {start}:{start + n} of the "
            f"fused `{self._cw_fused_name}` (cutlass_w8a8.optimize_); {_UNOPTIMIZE_HINT}")

    def __setattr__(self, name, value):
        if name in self._cw_part_names():
            self._cw_refuse(name, "assigned")
        super().__setattr__(name, value)

    def __delattr__(self, name):
        if name in self._cw_part_names():
            self._cw_refuse(name, "deleted")
        super().__delattr__(name)


def _plain_w8a8(m) -> bool:
    """A full (not tensor-parallel) `W8A8Linear`."""
    return isinstance(m, W8A8Linear) and getattr(m, "_tp", None) is None and type(m) is W8A8Linear


# ---- back to the unfused layout ---------------------------------------------------------------------------


def _split(fused: W8A8Linear, parts: list) -> list:
    """The parts of a fused layer as `W8A8Linear` layers over row views of its weight (no copy of the weight),
    each with its original weight-scale layout: ``(1,)`` for a part that had one per-tensor scale (its value, the
    same for all its rows), its rows of the per-channel scale, or its row blocks of the block scales."""
    out, start = [], 0
    block = fused.weight_block_size is not None
    for name, n, per_tensor in parts:
        w = fused.weight[start:start + n]
        if block:
            scale = fused.weight_scale[start // 128: -(-(start + n) // 128)].clone()
        elif fused.weight_scale.numel() == 1:
            scale = fused.weight_scale.clone()
        elif per_tensor:
            scale = fused.weight_scale[start:start + 1].clone()
        else:
            scale = fused.weight_scale[start:start + n].clone()
        bias = None if fused.bias is None else fused.bias[start:start + n].clone()
        inp = None if fused.input_scale is None else fused.input_scale.clone()
        m = W8A8Linear.from_quantized(w, scale, bias=bias, input_scale=inp, dtype=fused.dtype,
                                      weight_block_size=fused.weight_block_size)
        m.train(fused.training)
        out.append((name, m))
        start += n
    return out


# ---- the state-dict hooks (registered on each fused module by optimize_) ------------------------------------


def _add_hooks(m: nn.Module) -> None:
    m.register_state_dict_post_hook(_state_dict_post_hook)
    m.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)


def _remove_hooks(m: nn.Module) -> None:
    for k, h in list(m._state_dict_hooks.items()):
        if h is _state_dict_post_hook:
            del m._state_dict_hooks[k]
    for k, h in list(m._load_state_dict_pre_hooks.items()):
        if getattr(h, "hook", None) is _load_state_dict_pre_hook:
            del m._load_state_dict_pre_hooks[k]


def _state_dict_post_hook(module: nn.Module, state_dict, prefix: str, local_metadata) -> None:
    """``state_dict`` of a fused attention / MLP in the unfused layout: the ``qkv_proj.*`` / ``gate_up_proj.*``
    entries replaced by each part's `W8A8Linear` state dict (`_split`: the weight's rows as views, the scales in the
    part's own layout, ``weight_scale`` ``(N, 1)`` per channel as `W8A8Linear` writes it), in the place and order
    of the unoptimized module's keys. A no-op when the module is not fused (inside `unfused`) or its fused layer is
    no longer the `W8A8Linear` optimize_ made."""
    if not isinstance(module, _FusedModule):
        return
    fused_name = module._cw_fused_name
    fused = module._modules.get(fused_name)
    if not _plain_w8a8(fused):
        return
    own = []  # this module's entries are the last ones: state_dict() adds a module's keys, then runs its hooks
    for k in reversed(state_dict):
        if not k.startswith(prefix):
            break
        own.append(k)
    groups: dict = {}
    for k in reversed(own):
        groups.setdefault(k[len(prefix):].split(".", 1)[0], []).append((k, state_dict.pop(k)))
    groups.pop(fused_name, None)
    meta = getattr(state_dict, "_metadata", None)
    parts = {}
    for name, part in _split(fused, module._cw_parts):
        sub = OrderedDict()
        sub._metadata = OrderedDict()
        part.state_dict(destination=sub, prefix=f"{prefix}{name}.")
        parts[name] = list(sub.items())
        if meta is not None:
            meta.update(sub._metadata)
    if meta is not None:
        meta.pop(prefix + fused_name, None)
    children = set(module._modules)
    order = [h for h in groups if h not in children]  # the module's own tensors come first
    order += [h for h in module._cw_order if h in parts or h in groups]
    order += [h for h in groups if h in children and h not in order]  # children added after optimize_
    for h in order:
        for k, v in parts.get(h) or groups[h]:
            state_dict[k] = v


def _load_state_dict_pre_hook(module: nn.Module, state_dict, prefix: str, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
    """``load_state_dict`` into a fused attention / MLP from the unfused layout: the parts' ``weight`` /
    ``weight_scale`` / ``bias`` / ``input_scale`` entries (as `state_dict` writes them, or as a checkpoint holds
    them: ``weight_scale`` ``(N,)``, ``(N, 1)``, ``(1, N)`` or one value, block scales ``[ceil(N / 128), K / 128]``)
    replaced by the fused layer's, stacked as `fuse_w8a8` stacks them (per-tensor weight scales kept ``(1,)`` when
    all equal, else per channel). Refused (an error message, so ``load_state_dict`` raises ``RuntimeError``) when the
    parts' tensors do not fit: a part without a tensor the others have, other N or dtypes than the fused layer's
    parts, different static ``input_scale`` values (one activation quantization serves the fused GEMM), or both
    layouts at once. Entries already in the fused layout load as they are."""
    if not isinstance(module, _FusedModule):
        return
    fused_name = module._cw_fused_name
    names = module._cw_part_names()
    tensors = ("weight", "weight_scale", "bias", "input_scale")
    found = {n: {t: state_dict[f"{prefix}{n}.{t}"] for t in tensors if f"{prefix}{n}.{t}" in state_dict}
             for n in names}
    if not any(found.values()):
        return
    where = f"{type(module).__name__} {prefix[:-1] or '(root)'}"
    fused = module._modules.get(fused_name)
    if not _plain_w8a8(fused):
        error_msgs.append(f"{where}: the state dict holds the unfused {'/'.join(names)} tensors, but `{fused_name}` "
                          f"is {type(fused).__name__}, not the W8A8Linear optimize_ made: they cannot be fused into it")
        return
    if any(k.startswith(f"{prefix}{fused_name}.") for k in state_dict):
        error_msgs.append(f"{where}: the state dict holds both the unfused {'/'.join(names)} tensors and the fused "
                          f"`{fused_name}` ones; give one layout")
        return
    for n in names:
        for t in found[n]:
            del state_dict[f"{prefix}{n}.{t}"]
    errors = []
    for t in tensors:
        have = [n for n in names if t in found[n]]
        if have and len(have) != len(names):
            errors.append(f"`{t}` is given for {have} but not for {[n for n in names if n not in have]}")
    block = fused.weight_block_size is not None
    per_tensor = []
    for (n, size, _), part in zip(module._cw_parts, (found[n] for n in names)):
        w, sc = part.get("weight"), part.get("weight_scale")
        if isinstance(w, torch.Tensor) and (w.dim() != 2 or w.shape[0] != size):
            errors.append(f"`{n}.weight` has shape {tuple(w.shape)}; the fused layer's {n} has N = {size}")
        if isinstance(w, torch.Tensor) and w.dtype != fused.weight.dtype:
            errors.append(f"`{n}.weight` is {w.dtype}, the fused layer's weight {fused.weight.dtype}")
        if isinstance(sc, torch.Tensor):
            if block:
                ok = sc.dim() == 2 and sc.shape[0] == -(-size // 128)
            else:
                ok = sc.numel() in (1, size) and (sc.numel() == 1 or max(sc.shape) == sc.numel())
            if not ok:
                errors.append(f"`{n}.weight_scale` has shape {tuple(sc.shape)}, not the "
                              f"{'[ceil(N / 128), K / 128] blocks' if block else '1 or N values'} for N = {size}")
            per_tensor.append(not block and sc.numel() == 1)
    if all("input_scale" in found[n] for n in names):
        values = [float(found[n]["input_scale"].reshape(-1)[0]) for n in names]
        if any(v != values[0] for v in values):
            errors.append(f"the static per-tensor `input_scale` values differ ({dict(zip(names, values))}): one "
                          f"activation quantization serves the fused `{fused_name}` GEMM, so they cannot be loaded "
                          f"into it; {_UNOPTIMIZE_HINT}")
    if errors:
        error_msgs.append(f"{where}: cannot fuse the unfused tensors into `{fused_name}`: " + "; ".join(errors))
        return
    fp = f"{prefix}{fused_name}."
    got = [found[n] for n in names]
    dev = got[0][next(iter(got[0]))].device
    if "weight" in got[0]:
        state_dict[fp + "weight"] = torch.cat([g["weight"].to(dev) for g in got])
    if "weight_scale" in got[0]:
        ss = [g["weight_scale"].to(device=dev, dtype=torch.float32) for g in got]
        if block:
            state_dict[fp + "weight_scale"] = torch.cat(ss)
        elif all(per_tensor) and all(torch.equal(x.reshape(1), ss[0].reshape(1)) for x in ss):
            state_dict[fp + "weight_scale"] = ss[0].reshape(1).clone()
        else:
            state_dict[fp + "weight_scale"] = torch.cat([x.reshape(-1).expand(size) for x, (_, size, _) in
                                                         zip(ss, module._cw_parts)])
    if "bias" in got[0]:
        state_dict[fp + "bias"] = torch.cat([g["bias"].reshape(-1).to(dev) for g in got])
    if "input_scale" in got[0]:
        new = got[0]["input_scale"].reshape(-1).to(torch.float32)
        if local_metadata.get("assign_to_params_buffers") and fused.input_scale is not None:
            # load_state_dict(assign=True) would give the fused layer a new tensor, and the RMSNormQuant before it
            # would keep quantizing with the old one: write the value into the tensor they share instead
            with torch.no_grad():
                fused.input_scale.copy_(new)
            new = fused.input_scale
        state_dict[fp + "input_scale"] = new
    if "weight_scale" in got[0]:  # what state_dict writes back: each part's scale in the layout it was loaded in
        module._cw_parts = [(n, size, pt) for (n, size, _), pt in zip(module._cw_parts, per_tensor)]


# ---- unfused / unoptimize_ ----------------------------------------------------------------------------------


def _unfuse_one(m: nn.Module) -> tuple:
    """Give a fused attention / MLP its transformers class and its parts (`_split` views) back; returns what
    `_refuse_one` needs to undo it."""
    fused_name, fused_cls = m._cw_fused_name, type(m)
    fused = m._modules[fused_name]
    parts = _split(fused, m._cw_parts)
    m.__class__ = fused_cls._cw_base  # first: the fused class refuses the parts' names as attributes
    delattr(m, fused_name)
    for name, part in parts:
        setattr(m, name, part)
    # the transformers order of the children again (the parts were appended last)
    for k in [*(k for k in m._cw_order if k in m._modules), *(k for k in list(m._modules) if k not in m._cw_order)]:
        m._modules[k] = m._modules.pop(k)
    return m, fused_name, fused, fused_cls


def _refuse_one(m: nn.Module, fused_name: str, fused: W8A8Linear, fused_cls: type) -> None:
    for name, *_ in m._cw_parts:
        delattr(m, name)
    setattr(m, fused_name, fused)
    m.__class__ = fused_cls


def _unfuse_norms(model: nn.Module) -> list:
    """Each `RMSNormQuant` replaced by the norm module it replaced (holding the current ``weight``); returns
    ``(parent, name, RMSNormQuant)`` for each."""
    done = []
    for _, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, RMSNormQuant):
                orig = child._cw_original[0]
                orig.weight = child.weight
                setattr(parent, child_name, orig)
                done.append((parent, child_name, child))
    return done


def _fused_modules(model: nn.Module, where: str) -> list:
    """``(fqn, module)`` of each fused attention / MLP in ``model``; ValueError naming the first whose fused layer
    is no longer the `W8A8Linear` `optimize_` made (it cannot be split back)."""
    out = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, _FusedModule)]
    for fqn, m in out:
        f = m._modules.get(m._cw_fused_name)
        if not _plain_w8a8(f):
            raise ValueError(f"{where}: {fqn + '.' if fqn else ''}{m._cw_fused_name} is {type(f).__name__}, not the "
                             "W8A8Linear optimize_ made: it cannot be split back (nothing was changed)")
    return out


@contextlib.contextmanager
def unfused(model: nn.Module):
    """Inside the block ``model`` has its unfused transformers layout again: each optimized attention / MLP its
    transformers class and its ``q_proj`` / ``k_proj`` / ``v_proj`` / ``gate_proj`` / ``up_proj`` `W8A8Linear`
    layers (views of the fused weights' rows, their scales in the original layout), each `RMSNormQuant` the
    original norm module. On exit the fused modules are put back (the same objects). ``cutlass_w8a8.save_pretrained``
    saves through it, so that the ``quantization_config`` it builds from the modules names and describes the
    unfused layers. Do not run the model's ``forward`` or move it to another device inside the block. (A fused
    model's ``state_dict`` has the unfused layout without it; `unoptimize_` makes the change permanent.)"""
    fused = _fused_modules(model, "cutlass_w8a8.hf.unfused")
    undo_norms = _unfuse_norms(model)
    undo = [_unfuse_one(m) for _, m in fused]
    try:
        yield model
    finally:
        for args in reversed(undo):
            _refuse_one(*args)
        for parent, name, norm in reversed(undo_norms):
            setattr(parent, name, norm)


_FUSE_STATE = ("_cw_parts", "_cw_order", "_cw_qkv_sizes", "_cw_qk_norm", "_cw_sliding", "_cw_silu_quant")


def unoptimize_(model: nn.Module) -> nn.Module:
    """Undo `optimize_` in place, for good: each fused attention / MLP gets its transformers class back and its
    ``q_proj`` / ``k_proj`` / ``v_proj`` / ``gate_proj`` / ``up_proj`` `W8A8Linear` layers (over row views of the
    fused weight, no copy; each part's weight scales in its original layout: one per-tensor value, its rows of the
    per-channel scales or its row blocks of the block scales; bias and static ``input_scale`` copied), and each
    `RMSNormQuant` becomes the transformers norm it replaced (holding the same ``weight``). The model then computes
    what it computed before `optimize_` (the unfused GEMMs and transformers' RMSNorm and activation) and its
    ``state_dict`` is unchanged. Use it before replacing or wrapping those modules (PEFT / LoRA, hooks on
    ``q_proj``, tensor parallelism); `optimize_` can be called again afterwards.

    Parameters
    ----------
    model : torch.nn.Module
        Any module; one that `optimize_` did not change is returned as it is.

    Returns
    -------
    torch.nn.Module
        ``model``.

    Raises
    ------
    TypeError
        ``model`` is not an ``nn.Module``.
    ValueError
        A fused module's ``qkv_proj`` / ``gate_up_proj`` is no longer the `W8A8Linear` `optimize_` made (it was
        replaced): nothing is changed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"unoptimize_: `model` must be a torch.nn.Module, got {type(model).__name__}")
    fused = _fused_modules(model, "unoptimize_")
    _unfuse_norms(model)
    for _, m in fused:
        _remove_hooks(m)
        _unfuse_one(m)
        for attr in _FUSE_STATE:
            m.__dict__.pop(attr, None)
    model.__dict__.pop("_cw_graph_generator", None)  # cutlass_w8a8.generate's, built around the fused modules
    return model
