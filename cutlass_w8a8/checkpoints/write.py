"""`save_pretrained`: a model with `W8A8Linear` / `W8A8MoE` layers written as a compressed-tensors checkpoint (or, for
a model loaded from a transformers-native fp8 checkpoint, in that format again), and only when `from_pretrained`
reads it back.

1. Before anything is written, the checkpoint the model gives (its ``quantization_config``, and the names,
   safetensors dtypes and shapes of the tensors it stores) is checked with the loader's own rules
   (`cutlass_w8a8.checkpoints.load.check_loadable`: the config parsing, module matching and tensor checks
   `from_pretrained` runs, on the model built on the meta device from the config). A checkpoint the loader would
   refuse is not written; the ValueError names the module or tensor.
2. transformers' ``model.save_pretrained`` writes it into a temporary directory beside ``path``.
3. The written ``config.json`` and safetensors headers (``safe_open``: names, dtypes, shapes; no tensor data) are
   checked again the same way; any difference raises and the temporary directory is removed.
4. Only then are the files moved into ``path`` (renamed into place when ``path`` does not exist yet).

A failed check, an exception or an interrupt (``KeyboardInterrupt``) leaves ``path`` as it was.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import sys
import tempfile

import torch
from torch import nn

from ..linear import W8A8Linear
from ..moe.layer import W8A8MoE
from ._moe import checkpoint_block_of, float_expert_headers, moe_linear_names, moe_state_dict
from ._native_fp8 import SCALE_LEAF, NativeFp8Source, check_ue8m0
from ._files import checkpoint_tensors, read_config_json
from .load import check_loadable
from .save import quantization_config_of

__all__ = ["save_pretrained", "verify_checkpoint", "FORMATS"]

#: The checkpoint formats `save_pretrained` writes (its ``format`` argument).
FORMATS = ("compressed-tensors", "native-fp8")

_WHERE = "cutlass_w8a8.save_pretrained"
_LOADER = "cutlass_w8a8.from_pretrained"
# torch dtype -> the name safetensors stores in its header
_ST_DTYPE = {torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
             torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.float16: "F16",
             torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64"}
_TORCH_DTYPE = {v: k for k, v in _ST_DTYPE.items()}
# files of an earlier save that a new one replaces (transformers' save_pretrained removes the shards it did not
# write; a stale index or single file beside new shards would be read instead of them)
_WEIGHT_FILES = re.compile(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?$")


def _headers(state_dict: dict) -> dict:
    """``{name: (safetensors dtype, shape)}`` of a state dict, as the files would hold it."""
    return {k: (_ST_DTYPE.get(v.dtype, str(v.dtype)), list(v.shape)) for k, v in state_dict.items()
            if isinstance(v, torch.Tensor)}


def _refusal(path: str, what: str, e: ValueError) -> ValueError:
    msg = str(e)
    if msg.startswith(f"{_LOADER}: "):
        msg = msg[len(_LOADER) + 2:]
    return ValueError(f"{_WHERE}: `model` {what} that {_LOADER} would refuse, so nothing was written to {path!r}: "
                      f"{msg}")


def verify_checkpoint(model_cls, config_cls, path: str, meta: nn.Module = None) -> None:
    """Check the checkpoint at ``path`` (``config.json`` and the safetensors headers; no tensor data is read)
    with the loader's rules (`cutlass_w8a8.checkpoints.load.check_loadable`) for ``model_cls`` (its config read
    with ``config_cls.from_pretrained``; ``meta``: the model already built on the meta device for that
    architecture, if any). ValueError naming what `from_pretrained` would refuse."""
    config_json = read_config_json(_LOADER, os.path.join(path, "config.json"))
    config = config_cls.from_pretrained(path)
    check_loadable(model_cls, config, config_json, checkpoint_tensors(path), _LOADER, meta=meta)


def _move_into(tmp: str, path: str) -> None:
    """The files of ``tmp`` as ``path``: a rename when ``path`` does not exist; else each file replaces its
    namesake in ``path``, after the weight files of an earlier save that this one did not write are removed."""
    if not os.path.exists(path):
        os.rename(tmp, path)
        return
    new = set(os.listdir(tmp))
    for f in os.listdir(path):
        if f not in new and _WEIGHT_FILES.match(f) and os.path.isfile(os.path.join(path, f)):
            os.remove(os.path.join(path, f))
    for f in sorted(new):
        os.replace(os.path.join(tmp, f), os.path.join(path, f))


def _native_state_dict(model: nn.Module, state: dict, source: NativeFp8Source) -> dict:
    """``state`` (the model's tensors under the files' names, compressed-tensors leaves: per-expert linears from
    `_moe.moe_state_dict`) in the native fp8 layout ``source`` describes: each block-scaled layer's ``weight_scale``
    named ``weight_scale_inv``, and every tensor the files held in another dtype cast back to it (a bf16 scale, the
    bf16 router weight transformers keeps in float32). ValueError naming the layer or tensor for a layer that is not
    block-scaled fp8, or a scale that the files' dtype (or ``scale_fmt: ue8m0``) cannot hold exactly."""
    block = set()
    moved = []  # (block name in the written files, in the model): the files may have used the model's (Mixtral)
    for name, m in model.named_modules():
        if isinstance(m, (W8A8Linear, W8A8MoE)):
            if m.weight_block_size is None:
                raise ValueError(f"{_WHERE}: {type(m).__name__} {name!r} is not block-scaled fp8 (128 x 128 weight "
                                 "blocks), the only scheme of the native fp8 format (quant_method 'fp8'); save with "
                                 "format='compressed-tensors'")
            if isinstance(m, W8A8MoE):
                block.update(moe_linear_names(model, name, m, _WHERE))
                ckpt_block = checkpoint_block_of(model, name, _WHERE)
                if ckpt_block != name.rpartition(".")[0]:
                    moved.append((ckpt_block + ".", name.rpartition(".")[0] + "."))
            else:
                block.add(name)

    def stored_dtype(key):
        if key in source.dtypes:
            return source.dtypes[key]
        for src, dst in moved:
            if key.startswith(src) and dst + key[len(src):] in source.dtypes:
                return source.dtypes[dst + key[len(src):]]
        return None

    ue8m0 = source.quantization_config.get("scale_fmt") == "ue8m0"
    out = {}
    for key, v in state.items():
        module, _, leaf = key.rpartition(".")
        is_scale = module in block and leaf == "weight_scale"
        if is_scale:
            key = f"{module}.{SCALE_LEAF}"
        want = _TORCH_DTYPE.get(stored_dtype(key))
        if want is not None and want != v.dtype:
            cast = v.to(want)
            if is_scale and not torch.equal(cast.to(v.dtype), v):
                raise ValueError(f"{_WHERE}: the block scale {key!r} holds values that {stored_dtype(key)}, its "
                                 "dtype in the checkpoint it was loaded from, cannot hold exactly; save with "
                                 "format='compressed-tensors' (float32 scales)")
            v = cast
        if is_scale and ue8m0:
            check_ue8m0(key, v, _WHERE)
        out[key] = v
    return out


def save_pretrained(model: nn.Module, path, *, format: str = None, **save_kwargs) -> None:
    """Write ``model`` (a transformers model whose quantized linears are `W8A8Linear`, from `quantize_` or
    `from_pretrained`) as a compressed-tensors checkpoint: the 8-bit ``weight``, ``weight_scale`` (``(N, 1)``
    per channel, ``(1,)`` per tensor, or ``[ceil(N / 128), K / 128]`` for block-scaled fp8 layers),
    ``input_scale`` (``(1,)``, static activations) and ``bias`` of each layer, and ``config.json`` with the
    ``quantization_config`` that describes them (``quantization_status: compressed``, format int-quantized /
    float-quantized; block layers as compressed-tensors' ``FP8_BLOCK`` preset: weights ``strategy: block``,
    ``block_structure: [128, 128]``, activations ``strategy: group``, ``group_size: 128``, dynamic; see
    `quantization_config_of`).

    Only a checkpoint that `from_pretrained` reads back is written (the module docstring says how that is
    checked, before and after writing, from the config and the tensors' names, dtypes and shapes, without
    reading the weights back), and ``path`` changes only once the written files pass: the files are written into
    a temporary directory beside ``path`` and moved into it at the end.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Holding at least one `W8A8Linear` or `W8A8MoE`. Read back with ``from_pretrained(path)`` (its default
        ``model_cls`` is ``AutoModelForCausalLM``; the checks build ``type(model)``, so a model of another class
        loads with ``model_cls=type(model)``).
    path : str or os.PathLike
        Output directory, created if missing. An existing one is written into: files of the same name are
        replaced, and safetensors weight files of an earlier save that this one does not write (other shards)
        are removed.
    format : str, optional
        One of `FORMATS`: ``"compressed-tensors"``, or ``"native-fp8"`` (only for a model loaded from a native fp8
        checkpoint: see below). Default: ``"native-fp8"`` for such a model, else ``"compressed-tensors"``.
    **save_kwargs
        Passed to ``model.save_pretrained`` (``max_shard_size``, ...).

    A `W8A8MoE` (the ``experts`` of a block of `cutlass_w8a8.moe.families`) is written as llm-compressor writes
    MoE checkpoints: one quantized linear per expert and projection (``<layer>.mlp.experts.{e}.{gate,up,down}_proj``,
    Mixtral ``<layer>.block_sparse_moe.experts.{e}.{w1,w3,w2}``) with its rows of ``w13`` / ``w2`` and scales
    (``weight_scale`` ``[N, 1]`` or its 128 x 128 blocks; ``input_scale`` ``a13_scale`` for gate and up,
    ``a2_scale`` for down), and the routers in ``ignore`` (``re:.*mlp.gate$`` / ``re:.*block_sparse_moe.gate$``).
    A model loaded from a native block-fp8 checkpoint is written in compressed-tensors' FP8_BLOCK form, as for
    dense models. Only this function writes that layout: transformers' own ``model.save_pretrained`` would store
    the merged ``w13`` / ``w2`` buffers, which no reader understands.

    Scales are saved in float32, what the kernels use, so `from_pretrained` of the result gives back the same
    scales bit for bit (llm-compressor writes the scales in the model dtype, usually bfloat16; the readers cast
    either). Which other loaders read the result, per scheme and model family: docs/LOADERS.md.

    ``format="native-fp8"`` (the default for a model `from_pretrained` loaded from a transformers-native fp8
    checkpoint, DeepSeek-V3's format) writes that checkpoint back as it was: the same tensor names (block scales as
    ``weight_scale_inv``, the experts per expert as the family's row names them), each tensor in the dtype the
    files held it in (a bf16 scale or router weight cast back, exactly), and ``config.json``'s
    ``quantization_config`` as the files had it (``scale_fmt`` included). Unchanged after loading, every tensor is
    then byte-identical to the files'. What the loader left out is not written: the multi-token-prediction layers
    (`cutlass_w8a8.checkpoints.load.drop_mtp`). ``model.config.quantization_config`` stays the compressed-tensors
    dict describing the model's ``state_dict`` (what transformers' own ``model.save_pretrained`` writes).

    Raises
    ------
    TypeError
        ``model`` is not a transformers ``PreTrainedModel``; ``state_dict`` is passed for a model with `W8A8MoE`
        layers.
    ValueError
        ``format`` is not one of `FORMATS`, or ``"native-fp8"`` for a model not loaded from a native fp8
        checkpoint, or for one holding a layer that is not block-scaled fp8 (the message names it) or a block scale
        its files' dtype (or ``scale_fmt: ue8m0``) cannot hold exactly;
        ``path`` is an existing file (transformers' ``save_pretrained`` would only log that and write nothing);
        ``model`` holds no `W8A8Linear` or `W8A8MoE`; a `W8A8MoE` is not the ``experts`` of a block of
        `cutlass_w8a8.moe.families`, or has block scales with an intermediate size not a multiple of 128;
        `from_pretrained` would refuse the checkpoint ("`model` gives a checkpoint that
        cutlass_w8a8.from_pretrained would refuse, so nothing was written to ...", then the loader's reason, naming
        the module or tensor: a layer under a name the
        architecture does not have, such as a fused ``qkv_proj``, an MoE block it does not read, a missing
        tensor, a shape or dtype that differs). Nothing is written then.
    """
    if "transformers" in sys.modules:
        from transformers import PreTrainedModel
    else:
        PreTrainedModel = None
    if PreTrainedModel is None or not isinstance(model, PreTrainedModel):
        raise TypeError(f"{_WHERE}: `model` must be a transformers PreTrainedModel, got "
                        f"{type(model).__name__} (save another module's state_dict with torch.save or safetensors)")
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{_WHERE}: `path` {path!r} is an existing file, not a directory; give a directory (it is "
                         "created if missing)")
    source = NativeFp8Source.of(model)
    if format is None:
        format = "native-fp8" if source is not None else "compressed-tensors"
    if format not in FORMATS:
        raise ValueError(f"{_WHERE}: `format` must be one of {FORMATS}, got {format!r}")
    if format == "native-fp8" and source is None:
        raise ValueError(f"{_WHERE}: `format` 'native-fp8' writes back a model loaded from a transformers-native fp8 "
                         "checkpoint (its quantization_config and tensor dtypes come from those files); this model "
                         "was not loaded from one: save it with format='compressed-tensors'")
    qc = quantization_config_of(model)
    if qc is None:
        raise ValueError(f"{_WHERE}: `model` holds no W8A8Linear (quantize it with cutlass_w8a8.quantize_ first, or "
                         "save a float model with model.save_pretrained)")
    moe_sd = moe_state_dict(model, _WHERE)
    if moe_sd is not None:
        if "state_dict" in save_kwargs:
            raise TypeError(f"{_WHERE}: `state_dict` cannot be passed for a model with W8A8MoE layers (their "
                            "per-expert tensors are built here)")
        save_kwargs["state_dict"] = moe_sd
    written_qc = qc
    if format == "native-fp8":
        state = save_kwargs.get("state_dict")
        save_kwargs["state_dict"] = _native_state_dict(model, state if state is not None else model.state_dict(),
                                                       source)
        written_qc = copy.deepcopy(source.quantization_config)
    state = save_kwargs.get("state_dict")
    # 1. what would be written, checked before anything is
    config = copy.deepcopy(model.config)
    try:
        headers = float_expert_headers(model, _headers(state if state is not None else model.state_dict()), _WHERE)
        meta = check_loadable(type(model), config, {"quantization_config": written_qc}, headers, _LOADER,
                              model_names=True)
    except ValueError as e:
        raise _refusal(path, "gives a checkpoint", e) from None
    del state
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(path))}.saving-", dir=parent)
    try:
        model.config.quantization_config = written_qc
        try:
            model.save_pretrained(tmp, **save_kwargs)  # 2.
        finally:
            # the dict describing the model's own state_dict (the native one names other tensors)
            model.config.quantization_config = qc
        try:  # 3.
            verify_checkpoint(type(model), type(model.config), tmp, meta)
        except ValueError as e:
            raise _refusal(path, "was written by transformers' save_pretrained as files", e) from None
        _move_into(tmp, path)  # 4.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
