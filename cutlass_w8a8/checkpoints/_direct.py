"""Loading a checkpoint without transformers' weight loader: the model is built on the meta device from its
config, the quantized linears are built from the safetensors tensors (`W8A8Linear.from_quantized`, or a
tensor-parallel shard of them), every other parameter and persistent buffer is read whole from the files, and
the buffers the checkpoint does not hold (the rotary ``inv_freq``) are computed by the model's own
``_init_weights``.

Used for the transformers-native block-fp8 format (``quant_method: fp8``), which transformers' own loader would
dequantize (on a CPU or a GPU before sm89) or turn into its own ``FP8Linear`` layers, and by the sharded loader
(`cutlass_w8a8.distributed.checkpoint`), and for MoE checkpoints (each block's per-expert tensors read into one
`W8A8MoE` by `cutlass_w8a8.checkpoints._moe`, Mixtral's ``block_sparse_moe`` names mapped to the model's
``mlp``). The checkpoint's tensors are read under the model's names after transformers' own load-time renames
(the ``WeightRenaming`` entries of its conversion mapping: `cutlass_w8a8.checkpoints._names`); what its other
converters do (concatenating or splitting tensors) is not applied.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Dict

import torch
from torch import nn

from ..linear import W8A8Linear
from ..ops._limits import BLOCK_SIZE, blocks

__all__ = ["Reader", "build_meta", "set_module", "load_rest", "check_rest", "init_missing_buffers",
           "load_generation_config", "block_rows", "block_size", "load_unsharded"]


class Reader:
    """Reads of whole tensors or of row / column slices from the checkpoint's files (each opened once, for the
    life of ``stack``). ``stored``: ``{name: name in the files}`` for the tensors named otherwise than in the files
    (the checkpoint's `stored`, transformers' renames: `cutlass_w8a8.checkpoints._names`)."""

    def __init__(self, file_of: Dict[str, str], stack: contextlib.ExitStack, stored: Dict[str, str] = None):
        from safetensors import safe_open

        self.file_of = file_of
        self.stored = stored or {}
        self._files = {f: stack.enter_context(safe_open(f, framework="pt")) for f in sorted(set(file_of.values()))}

    def whole(self, key: str) -> torch.Tensor:
        return self._files[self.file_of[key]].get_tensor(self.stored.get(key, key))

    def rows(self, key: str, ranges) -> torch.Tensor:
        """Rows ``[a, b)`` of each ``(a, b)`` in ``ranges``, concatenated."""
        sl = self._files[self.file_of[key]].get_slice(self.stored.get(key, key))
        parts = [sl[a:b] for a, b in ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def cols(self, key: str, a: int, b: int) -> torch.Tensor:
        """Columns ``[a, b)`` of a 2-D tensor."""
        return self._files[self.file_of[key]].get_slice(self.stored.get(key, key))[:, a:b]


def block_size(scheme):
    """The ``weight_block_size`` to give `W8A8Linear.from_quantized` for a layer of ``scheme``: ``(128, 128)``
    for block-scaled weights (explicit, so that a layer of one block stays block-scaled), else None."""
    return (BLOCK_SIZE, BLOCK_SIZE) if scheme.block else None


def block_rows(ranges) -> list:
    """The rows of a ``[ceil(N / 128), ...]`` block-scale tensor that cover weight rows ``ranges`` (each
    ``(a, b)`` starting on a block boundary; ``b`` on one too, or N)."""
    return [(a // BLOCK_SIZE, blocks(b)) for a, b in ranges]


def build_meta(model_cls, config, dtype: torch.dtype, shared: dict, model_kwargs: dict, where: str) -> nn.Module:
    """The model of ``config`` on the meta device in ``dtype``. ``model_kwargs`` (AutoConfig's unused keyword
    arguments) may hold only ``attn_implementation``: TypeError for anything else, which only transformers'
    own loader understands."""
    from transformers import PreTrainedModel

    kw = {}
    model_kwargs = dict(model_kwargs)
    if "attn_implementation" in model_kwargs:
        kw["attn_implementation"] = model_kwargs.pop("attn_implementation")
    if model_kwargs:
        raise TypeError(f"{where}: {sorted(model_kwargs)} cannot be used here (this checkpoint is not loaded through "
                        "transformers' from_pretrained)")
    with torch.device("meta"):
        if isinstance(model_cls, type) and issubclass(model_cls, PreTrainedModel):
            model = model_cls._from_config(config, dtype=dtype, **kw)
        else:
            if "trust_remote_code" in shared:
                kw["trust_remote_code"] = shared["trust_remote_code"]
            model = model_cls.from_config(config, dtype=dtype, **kw)
    _keep_in_fp32(model, dtype)
    return model


def _keep_in_fp32(model: nn.Module, dtype: torch.dtype) -> None:
    """The parameters and buffers transformers' own loader keeps in float32 whatever the model dtype, made float32 in
    the model built on the meta device (so that they are read as such): those matching the model's
    ``_keep_in_fp32_modules_strict`` (for a bf16 / fp16 model) or ``_keep_in_fp32_modules`` (for fp16) patterns,
    searched in the tensor's name (DeepSeek-V3's router ``gate.weight`` and ``e_score_correction_bias``; transformers
    5.17 builds the latter in the model dtype and keeps it float32 only when loading)."""
    patterns = []
    if dtype in (torch.float16, torch.bfloat16):
        patterns += list(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        patterns += list(getattr(model, "_keep_in_fp32_modules", None) or ())
    if not patterns:
        return
    regex = re.compile("|".join(re.escape(p).replace(r"\*", ".*") for p in patterns))
    for mod_name, mod in model.named_modules():
        for table in (mod._parameters, mod._buffers):
            for leaf, t in list(table.items()):
                key = f"{mod_name}.{leaf}" if mod_name else leaf
                if t is None or not t.is_floating_point() or t.dtype == torch.float32 or not regex.search(key):
                    continue
                new = t.to(torch.float32)
                table[leaf] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new


def set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _rest(model: nn.Module, replaced: set, rename=None, present=()):
    """``(module, leaf, tensor, checkpoint name)`` of every parameter and persistent buffer still on the meta device
    outside the ``replaced`` modules (what `load_rest` reads and `check_rest` checks): its own name when the
    checkpoint holds it (``present``; transformers' renames already applied: `cutlass_w8a8.checkpoints._names`),
    else ``rename(name)`` (the MoE rows' names)."""
    for mod_name, mod in model.named_modules():
        if mod_name in replaced or any(mod_name.startswith(r + ".") for r in replaced):
            continue
        persistent = [b for b in mod._buffers if b not in mod._non_persistent_buffers_set]
        for leaf in list(mod._parameters) + persistent:
            t = mod._parameters[leaf] if leaf in mod._parameters else mod._buffers[leaf]
            if t is None or t.device.type != "meta":
                continue
            key = f"{mod_name}.{leaf}" if mod_name else leaf
            yield mod, leaf, t, (rename(key) if rename is not None and key not in present else key)


def _tied_output(model: nn.Module, config):
    """``(output embedding, input embedding)`` when the config ties them (the output weight may be absent from
    the files), else None."""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tie = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                  "tie_word_embeddings", False)
    return (out_emb, in_emb) if out_emb is not None and in_emb is not None and tie else None


def _untie_missing(model: nn.Module, missing: list, tied) -> list:
    """``missing`` less the output embedding's weight when it is tied to the input embedding."""
    if tied is None:
        return missing
    return [m for m in missing if not m.endswith(".weight") or model.get_submodule(m[:-7]) is not tied[0]]


def _missing_message(where: str, missing: list) -> str:
    return (f"{where}: the checkpoint has no tensor {missing[0]!r}" +
            (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "") + ", which the model needs")


def load_rest(model: nn.Module, reader: Reader, meta: dict, replaced: set, device, config, where: str,
              rename=None) -> None:
    """Every parameter and persistent buffer outside the ``replaced`` modules, read whole and cast to the dtype
    the meta model gave it; a missing output embedding is tied to the input embedding when the config says so.
    ``rename(model tensor name) -> checkpoint tensor name`` where the files name a tensor otherwise (Mixtral's
    ``block_sparse_moe``; `cutlass_w8a8.checkpoints._moe.checkpoint_renamer`), None: the same names.
    ValueError naming the first tensor the checkpoint (``meta``: its tensor index) lacks."""
    missing = []
    for mod, leaf, t, key in list(_rest(model, replaced, rename, meta)):
        if key not in meta:
            missing.append(key)
            continue
        value = reader.whole(key).to(device=device, dtype=t.dtype)
        if leaf in mod._parameters:
            mod._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        else:
            mod._buffers[leaf] = value
    tied = _tied_output(model, config)
    if tied is not None and tied[0].weight.device.type == "meta":
        tied[0].weight = tied[1].weight
        missing = _untie_missing(model, missing, tied)
    if missing:
        raise ValueError(_missing_message(where, missing))


def check_rest(model: nn.Module, tensors: dict, replaced: set, config, where: str, rename=None) -> None:
    """What `load_rest` would refuse, from the headers alone: ValueError naming the first parameter or persistent
    buffer of ``model`` (built on the meta device) outside the ``replaced`` modules that ``tensors`` (``{name:
    (safetensors dtype, shape)}``) lacks (a tied output embedding may be absent) or holds with another shape."""
    missing = []
    for _, _, t, key in _rest(model, replaced, rename, tensors):
        if key not in tensors:
            missing.append(key)
        elif list(tensors[key][1]) != list(t.shape):
            raise ValueError(f"{where}: checkpoint tensor {key!r} is {tensors[key][0]} {list(tensors[key][1])}; "
                             f"the model's is {list(t.shape)}")
    missing = _untie_missing(model, missing, _tied_output(model, config))
    if missing:
        raise ValueError(_missing_message(where, missing))


def init_missing_buffers(model: nn.Module, device, where: str) -> None:
    """Buffers the checkpoint does not hold (non-persistent: the rotary ``inv_freq``) are still on the meta
    device: allocate them and let the model's ``_init_weights`` compute them."""
    for name, mod in model.named_modules():
        if any(b is not None and b.device.type == "meta" for b in mod._buffers.values()):
            if any(p is not None and p.device.type == "meta" for p in mod._parameters.values()):
                raise RuntimeError(f"{where}: module {name!r} still has parameters on the meta device; please report "
                                   "this")
            mod.to_empty(device=device, recurse=False)
            model._init_weights(mod)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"{where}: {left[:4]} were neither in the checkpoint nor initialized by the model")


def load_generation_config(model: nn.Module, path: str) -> None:
    """``generation_config.json`` of the checkpoint, when there is one, as the model's generation config."""
    gen = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen) and getattr(model, "generation_config", None) is not None:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)


def load_unsharded(path: str, model_cls, config, targeted: dict, ckpt, dtype: torch.dtype, device, shared: dict,
                   model_kwargs: dict, where: str, moe: dict = None) -> nn.Module:
    """The whole checkpoint as a transformers model on ``device`` whose ``targeted`` linears (``{name: target}``
    with ``target.scale_leaf``, the scale tensor's name, and ``target.scheme``) are `W8A8Linear` layers holding
    the stored 8-bit weights as they are and the stored scales cast to float32 (exact from bf16 / fp16).

    ``moe``: ``{experts module name: MoeTarget}`` (`cutlass_w8a8.checkpoints._moe`), each experts module becoming
    a `W8A8MoE` built from the per-expert tensors (`_moe.build_moe`), the other tensors of those blocks read under
    the files' names."""
    from ._moe import build_moe, checkpoint_renamer, fill_float_experts, link_correction_biases

    moe = moe or {}
    device = torch.device(device) if device is not None else torch.device("cpu")
    model = build_meta(model_cls, config, dtype, shared, model_kwargs, where)
    with contextlib.ExitStack() as stack:
        reader = Reader(ckpt.file_of, stack, ckpt.stored)
        for name, t in targeted.items():
            lin = model.get_submodule(name)
            if type(lin) is not nn.Linear:
                raise RuntimeError(f"{where}: {name!r} is a {type(lin).__name__}, expected nn.Linear; please report "
                                   "this")
            bias = reader.whole(f"{name}.bias").to(device) if lin.bias is not None else None
            input_scale = reader.whole(f"{name}.input_scale").to(device) if t.scheme.static_input else None
            new = W8A8Linear.from_quantized(
                reader.whole(f"{name}.weight").to(device), reader.whole(f"{name}.{t.scale_leaf}").to(device).float(),
                bias=bias, input_scale=input_scale, dtype=dtype, weight_block_size=block_size(t.scheme))
            new.train(False)
            set_module(model, name, new)
        for name, t in moe.items():
            if t.scheme is None:
                fill_float_experts(model, t, reader, device, dtype)
            else:
                set_module(model, name, build_moe(t, reader, device, dtype, where))
        load_rest(model, reader, ckpt.meta, set(targeted) | set(moe), device, config, where,
                  rename=checkpoint_renamer([t.block for t in moe.values()]))
    link_correction_biases(model, moe)
    init_missing_buffers(model, device, where)
    model.eval()
    load_generation_config(model, path)
    return model
