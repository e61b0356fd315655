"""`from_pretrained`: a compressed-tensors W8A8 checkpoint, or a transformers-native block-fp8 one, as a
transformers model with `W8A8Linear` layers."""

from __future__ import annotations

import collections
import os
import warnings
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from ..linear import W8A8Linear
from ..ops._limits import BLOCK_SIZE
from ..ops._limits import OUT_DTYPES as _OUT_DTYPES
from ..quantize import shape_supported
from ._direct import block_size, build_meta, load_unsharded
from ._files import (_SafetensorsCheckpoint, _WHERE, check_checkpoint_dir, check_device, check_tensors,
                     checkpoint_tensors, read_config_json, refuse_missing_weights)
from ._moe import ct_moe_targets, find_moe_blocks, native_moe_targets
from ._names import model_view, renamed_index, renaming_of
from ._native_fp8 import (SCALE_LEAF, NativeFp8Source, check_ue8m0, is_native_fp8, mtp_tensors, native_targets,
                          parse_native_fp8)
from ._scheme import ParsedConfig, Target, find_quantization_config, parse_quantization_config

__all__ = ["from_pretrained", "check_loadable", "check_checkpoint_dir", "check_device", "checkpoint_tensors"]

# hf_kwargs that both AutoConfig and the model loader need (AutoConfig consumes them)
_SHARED_KWARGS = ("trust_remote_code", "revision", "code_revision", "cache_dir", "token", "local_files_only",
                  "force_download", "proxies")


def from_pretrained(path, *, device=None, dtype: torch.dtype = torch.bfloat16, model_cls=None, tp_group=None,
                    tp_plan=None, **hf_kwargs):
    """Load a compressed-tensors W8A8 checkpoint, or a transformers-native block-fp8 one, as a transformers model
    whose quantized linears are `W8A8Linear` layers holding the checkpoint's own int8 / float8_e4m3fn weights and
    scales (never dequantized and re-quantized).

    Parameters
    ----------
    path : str or os.PathLike
        A local checkpoint directory: ``config.json`` with a compressed-tensors ``quantization_config`` (or the
        older ``compression_config`` key), or transformers' native fp8 one (``quant_method: fp8``, 128 x 128
        blocks: DeepSeek-V3, Qwen3-FP8), and ``model.safetensors`` or a sharded ``model.safetensors.index.json``.
        What llm-compressor and ``compressed_tensors.ModelCompressor`` write, and `save_pretrained`.
    device : str or torch.device, optional
        Where the model is loaded (``device_map=device`` for transformers); default: transformers' default (CPU).
    dtype : torch.dtype
        The model's float dtype and the `W8A8Linear` output dtype, ``torch.bfloat16`` (default) or
        ``torch.float16``.
    model_cls : type, optional
        A transformers model class or auto class (``from_pretrained`` / ``from_config``); default
        ``transformers.AutoModelForCausalLM``.
    tp_group : torch.distributed.ProcessGroup, optional
        Load this rank's tensor-parallel shard (`cutlass_w8a8.distributed.checkpoint`): the linears ``tp_plan``
        names become column- / row-parallel layers holding only this rank's rows / columns, read from the files as
        slices (``safe_open(...).get_slice(name)[rows]``), never whole; the rest is replicated. The weights are not
        loaded by transformers' loader then: the model is built on the meta device and filled from the files;
        ``device`` is this rank's device; of ``hf_kwargs`` only those ``AutoConfig`` takes and
        ``attn_implementation`` are accepted. Every rank calls with the same arguments. Default None: no sharding.
    tp_plan : dict, optional
        With ``tp_group``: ``{name suffix: "colwise" | "rowwise"}``, default
        `cutlass_w8a8.distributed.LLAMA_TP_PLAN`.
    **hf_kwargs
        Passed to ``AutoConfig.from_pretrained`` and ``model_cls.from_pretrained`` (``trust_remote_code``,
        ``attn_implementation``, ``output_loading_info``, ...). ``quantization_config``, ``config``,
        ``device_map``, ``dtype`` / ``torch_dtype`` and ``subfolder`` are refused: this function sets them.
        A native fp8 checkpoint is not loaded by ``model_cls.from_pretrained`` (see below): of ``hf_kwargs`` only
        those ``AutoConfig`` takes and ``attn_implementation`` are accepted then.

    Returns
    -------
    transformers.PreTrainedModel
        In eval mode, ``model.hf_quantizer`` None, ``model.config.quantization_config`` the checkpoint's config as
        a plain compressed-tensors dict (so ``model.save_pretrained`` writes a valid checkpoint again).
        ``(model, loading_info)`` when ``output_loading_info=True``.

    How
    ---
    The config is read with compressed-tensors' own parser
    (``compressed_tensors.quantization.QuantizationConfig.model_validate``), so fields get the defaults and
    validation every other reader of the format applies, and checked before any weight is read: every group must
    be a scheme `W8A8Linear` computes exactly (8-bit symmetric int or e4m3 weights, per channel or per tensor;
    activations of the same type, dynamic per token or static per tensor; formats int-quantized,
    float-quantized, naive-quantized). The targeted modules (compressed-tensors' own ``targets`` / ``ignore``
    matching, ``re:`` patterns included, on the model built on the meta device) must be ``nn.Linear`` with K and N
    multiples of 16, and the checkpoint's tensors for them must have the dtypes and shapes the scheme implies
    (read from the safetensors headers). Anything else raises ValueError naming the field or tensor: there is no
    fallback.

    The weights are then loaded by transformers' own loader, kept compressed (``CompressedTensorsHfQuantizer``
    with ``dequantize=False``, ``use_optimized_inference=False``): it handles sharded files, devices and dtypes,
    and leaves each targeted ``nn.Linear`` holding the stored 8-bit ``weight`` and a ``quantization_scheme``.
    Each becomes a `W8A8Linear` around that same weight tensor (no copy), the decompression hook compressed-tensors
    registered for the first forward is removed, and ``model.hf_quantizer`` is cleared (it no longer describes
    the modules, and transformers' ``.half()`` / ``.float()`` refuse a model that has one).

    Scales are re-read from the safetensors files in their stored dtype: compressed-tensors creates the
    ``weight_scale`` / ``input_scale`` parameters in the model dtype, so transformers would round float32 scales
    to bfloat16 on load, while the kernels take float32 scales; reading the stored values keeps them exact.

    Block-scaled fp8 (compressed-tensors' ``FP8_BLOCK``: weights ``strategy: block``, ``block_structure: [128,
    128]``; activations ``strategy: group``, ``group_size: 128``, dynamic) loads the same way, each layer a
    `W8A8Linear` with ``weight_scale`` float32 ``[ceil(N / 128), K / 128]``; a targeted layer must have K a
    multiple of 128 (N may end in a partial block). Other block structures, and block weights with static or
    per-token activations, are refused naming the field.

    The transformers-native fp8 format (``quant_method: fp8``: `cutlass_w8a8.checkpoints._native_fp8` describes
    it and what is refused) is not given to transformers' loader, which would dequantize it to bf16 on a CPU or
    swap in its own ``FP8Linear`` on a GPU: the model is built on the meta device from the config without its
    ``quantization_config``, each linear stored with an e4m3 weight becomes a `W8A8Linear` from its ``weight``
    and ``weight_scale_inv`` (cast to float32: exact from bf16), and every other tensor is read from the files
    (`cutlass_w8a8.checkpoints._direct`). ``model.config.quantization_config`` is then the compressed-tensors
    FP8_BLOCK dict describing the loaded layers (what their ``state_dict`` holds).

    Mixture-of-experts checkpoints (the blocks of `cutlass_w8a8.moe.families`: Qwen2-MoE, Qwen3-MoE, Mixtral,
    DeepSeek-V3, GLM-4.5, OLMoE, ...; compressed-tensors W8A8 / FP8-dynamic /
    static / FP8_BLOCK as llm-compressor writes them, and the native block-fp8 format): the per-expert linears
    (``<layer>.mlp.experts.{e}.{gate,up,down}_proj``, Mixtral's ``<layer>.block_sparse_moe.experts.{e}.{w1,w3,w2}``)
    of each block become one `cutlass_w8a8.W8A8MoE` holding their stored 8-bit weights and float32 scales (gate rows
    then up rows in ``w13`` [E, 2I, H], ``w2`` [E, H, I]; a per-tensor weight scale is repeated per channel, the same
    dequantized weight; static input scales: the largest of each GEMM's, with a UserWarning when the experts'
    differ); the router (``mlp.gate``, left in float by the checkpoint's ``ignore``) stays transformers' own module
    and the block calls the `W8A8MoE` as its ``experts`` (which holds the family's routing for its router-logits
    mode); shared expert linears (Qwen2-MoE, DeepSeek-V3, ...) are `W8A8Linear` layers.
    Such a checkpoint is not given to transformers' loader (which would dequantize the merged experts to bf16): the
    model is built on the meta device and filled from the files as for the native format (so the same
    ``hf_kwargs`` limits apply). With ``tp_group`` each experts module becomes a
    `cutlass_w8a8.distributed.TensorParallelW8A8MoE` holding this rank's ``I / world`` intermediate channels of
    every expert, read as slices (I / world a multiple of 16, of 128 with block scales, else ValueError).
    DeepSeek-V3's native layout (MLA projections, dense first layers, shared experts, ``scale_fmt: ue8m0``, the
    multi-token-prediction layer dropped with a warning): docs/CHECKPOINTS.md, "DeepSeek-V3 (native fp8)".
    `cutlass_w8a8.checkpoints._moe` describes the layout and what is refused:
    other MoE blocks (any module holding 3-D expert parameters), some experts quantized and others not,
    experts of one block under different config groups, a missing, extra or mis-shaped expert tensor (the message
    names it). A compressed-tensors checkpoint whose experts are all left in float (ignored) loads the same way,
    the float experts read into transformers' own experts module (transformers 5.17's loader would leave them
    uninitialized) and the quantized linears `W8A8Linear`.

    Raises
    ------
    ValueError
        ``path`` is a file ("pass the folder that holds config.json"), not a local directory, or a directory without
        config.json; ``path``'s config.json is not valid JSON; ``device`` is a GPU index past the visible ones, or a
        string that is no torch device (``"gpu"``: "did you mean 'cuda'"); transformers reports weights of
        ``model_cls`` the checkpoint does not hold (it would initialize them randomly: a BERT checkpoint read as
        ``BertLMHeadModel``, whose head it never stored); the config or
        checkpoint holds something the kernels cannot run exactly (the message names the field and
        its value, e.g. ``quantization_config.config_groups.group_0.weights.strategy = 'group' is not supported
        (supported: 'channel', 'tensor')``, ``quantization_config.activation_scheme = 'static' is not supported``),
        a block-scaled layer has K not a multiple of 128 (the message names the layer and K), or ``path`` is not a
        compressed-tensors / native fp8 safetensors checkpoint.
    RuntimeError
        ``device`` is a CUDA device but torch was built without CUDA or sees no GPU (raised before any file is
        read).
    TypeError
        ``dtype`` is not bfloat16 / float16, or ``hf_kwargs`` holds an argument this function sets (or, for a
        native fp8 checkpoint, one only transformers' loader understands).

    Examples
    --------
    >>> model = cutlass_w8a8.checkpoints.from_pretrained("Meta-Llama-3-8B-Instruct-W8A8", device="cuda")
    >>> out = model.generate(input_ids, max_new_tokens=32)
    """
    if dtype not in _OUT_DTYPES:
        raise TypeError(f"{_WHERE}: `dtype` must be torch.bfloat16 or torch.float16 (the W8A8Linear output dtype), "
                        f"got {dtype}")
    for k in ("quantization_config", "config", "device_map", "dtype", "torch_dtype", "subfolder"):
        if k in hf_kwargs:
            raise TypeError(f"{_WHERE}: `{k}` cannot be passed through: it is set here (use `device=` / `dtype=`; "
                            "a sub-folder checkpoint is loaded by passing that folder as `path`)")
    check_device(_WHERE, device)
    path = check_checkpoint_dir(_WHERE, path)
    config_path = os.path.join(path, "config.json")
    config_json = read_config_json(_WHERE, config_path)
    if tp_plan is not None and tp_group is None:
        raise TypeError("cutlass_w8a8.from_pretrained: `tp_plan` is given without `tp_group`")
    if is_native_fp8(config_json):
        return _from_native_fp8(path, config_json, device, dtype, model_cls, tp_group, tp_plan, hf_kwargs)
    key, raw = find_quantization_config(config_json, _WHERE)
    parsed = parse_quantization_config(raw, _WHERE, key)
    ckpt = _SafetensorsCheckpoint(path)

    import transformers

    model_cls = model_cls or transformers.AutoModelForCausalLM
    config, model_kwargs = transformers.AutoConfig.from_pretrained(path, return_unused_kwargs=True, **hf_kwargs)
    # transformers reads only `quantization_config`; the parsed dict also drops loading switches a config.json might
    # carry (`dequantize`, `use_optimized_inference`), so the weights stay compressed and in nn.Linear.
    config.quantization_config = parsed.to_dict()
    if hasattr(config, "compression_config"):
        del config.compression_config
    shared = {k: hf_kwargs[k] for k in _SHARED_KWARGS if k in hf_kwargs}

    drop_mtp(ckpt, config)
    meta = _meta_model(model_cls, config, shared)
    ckpt.rename(model_view(meta, ckpt.meta, _WHERE))
    targeted, moe = plan_compressed_tensors(meta, parsed, ckpt.meta, _WHERE)
    del meta
    if moe:
        return _load_moe(path, model_cls, config, parsed, targeted, moe, ckpt, dtype, device, tp_group, tp_plan,
                         shared, model_kwargs, parsed.to_dict())

    if tp_group is not None:
        from ..distributed.checkpoint import load_tensor_parallel

        return load_tensor_parallel(path, model_cls, config, parsed, targeted, ckpt, dtype, device, tp_group, tp_plan,
                                    shared, model_kwargs)
    if device is not None:
        model_kwargs["device_map"] = str(torch.device(device)) if not isinstance(device, str) else device
    want_info = model_kwargs.pop("output_loading_info", False)
    model, info = model_cls.from_pretrained(path, config=config, dtype=dtype, output_loading_info=True, **shared,
                                            **model_kwargs)
    refuse_missing_weights(_WHERE, model, info, path, "pass the model class it was saved from as `model_cls`")
    _detach_compressed_tensors(model, parsed)
    _swap_to_w8a8(model, targeted, ckpt, dtype)
    return (model, info) if want_info else model


def _from_native_fp8(path, config_json, device, dtype, model_cls, tp_group, tp_plan, hf_kwargs):
    """`from_pretrained` of a transformers-native block-fp8 checkpoint (see its docstring)."""
    parsed = parse_native_fp8(config_json["quantization_config"], _WHERE)
    ckpt = _SafetensorsCheckpoint(path)

    import transformers

    model_cls = model_cls or transformers.AutoModelForCausalLM
    config, model_kwargs = transformers.AutoConfig.from_pretrained(path, return_unused_kwargs=True, **hf_kwargs)
    # built without the fp8 config, so that transformers' quantizer does not replace the linears
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    shared = {k: hf_kwargs[k] for k in _SHARED_KWARGS if k in hf_kwargs}
    drop_mtp(ckpt, config)
    meta = build_meta(model_cls, config, dtype, shared, model_kwargs, _WHERE)
    ckpt.rename(model_view(meta, ckpt.meta, _WHERE))
    targeted, moe = plan_native(meta, parsed, ckpt.meta, _WHERE)
    del meta
    if parsed.scale_fmt == "ue8m0":
        _check_ue8m0_scales(ckpt, [f"{n}.{SCALE_LEAF}" for n in targeted]
                            + [k for t in moe.values() for k in t.keys() if k.endswith(f".{SCALE_LEAF}")])
    source = NativeFp8Source(dict(config_json["quantization_config"]), {k: dt for k, (dt, _) in ckpt.meta.items()})
    if moe:
        model = _load_moe(path, model_cls, config, parsed, targeted, moe, ckpt, dtype, device, tp_group, tp_plan,
                          shared, model_kwargs, None)
        if tp_group is None:
            from .save import quantization_config_of

            model.config.quantization_config = quantization_config_of(model)
            source.attach(model)
        return model
    if tp_group is not None:
        from ..distributed.checkpoint import load_tensor_parallel

        return load_tensor_parallel(path, model_cls, config, parsed, targeted, ckpt, dtype, device, tp_group, tp_plan,
                                    shared, model_kwargs)
    model = load_unsharded(path, model_cls, config, targeted, ckpt, dtype, device, shared, model_kwargs, _WHERE)
    model.config.quantization_config = parsed.to_dict()
    source.attach(model)
    return model


def drop_mtp(ckpt, config, where: str = _WHERE) -> None:
    """Leave out of ``ckpt`` (a `_SafetensorsCheckpoint`) the tensors of the multi-token-prediction layers that
    ``config``'s transformers model does not have (`_native_fp8.mtp_tensors`: DeepSeek-V3's ``model.layers.61``),
    with one UserWarning saying how many were dropped."""
    names = mtp_tensors(ckpt.meta, config)
    if not names:
        return
    for k in names:
        del ckpt.meta[k], ckpt.file_of[k]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    first = text.num_hidden_layers
    layers = sorted({int(k.split(".")[2]) for k in names})
    which = ", ".join(f"model.layers.{i}" for i in layers)
    warnings.warn(f"{where}: dropped the {len(names)} tensors of the multi-token-prediction layer(s) {which} "
                  f"(num_nextn_predict_layers = {text.num_nextn_predict_layers} after num_hidden_layers = {first}): "
                  f"transformers' {type(config).__name__} model has no such module; save_pretrained does not write "
                  "them", UserWarning, stacklevel=3)


def _check_ue8m0_scales(ckpt, keys, chunk: int = 4096) -> None:
    """`check_ue8m0` of every scale tensor ``keys`` of ``ckpt`` (read ``chunk`` at a time)."""
    for a in range(0, len(keys), chunk):
        for k, v in ckpt.read(keys[a:a + chunk]).items():
            check_ue8m0(k, v, _WHERE)


def plan_native(meta: nn.Module, parsed, tensors: Dict[str, Tuple[str, list]], where: str = _WHERE):
    """What `from_pretrained` reads from a transformers-native fp8 checkpoint into ``meta`` (the model built on the
    meta device from its config, without its quantization_config): ``(targeted, moe)``, the block-quantized linears
    (``{name: Target}``, `_native_fp8.native_targets`) and the MoE experts modules (``{name: MoeTarget}``,
    `_moe.native_moe_targets`), after checking the checkpoint's ``tensors`` (``{name: (safetensors dtype,
    shape)}``) against them. ValueError naming the module, tensor or field of the first mismatch."""
    blocks = find_moe_blocks(meta, tensors, where)
    moe = native_moe_targets(blocks, parsed.modules_to_not_convert, tensors, where) if blocks else {}
    targeted = native_targets(meta, parsed, tensors, where, claimed={k for t in moe.values() for k in t.keys()},
                              allow_empty=bool(moe))
    return targeted, moe


def _load_moe(path, model_cls, config, parsed, targeted, moe, ckpt, dtype, device, tp_group, tp_plan, shared,
              model_kwargs, qc):
    """`from_pretrained` of a checkpoint with MoE experts: not through transformers' loader (which merges the
    per-expert tensors into its 3-D experts and dequantizes them), but built on the meta device and filled from
    the files (`_direct.load_unsharded`), each experts module a `W8A8MoE` (`_moe.build_moe`); with ``tp_group``,
    `cutlass_w8a8.distributed.checkpoint.load_tensor_parallel` (experts split over I)."""
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # built without it, so that no transformers quantizer touches the model
    if tp_group is not None:
        from ..distributed.checkpoint import load_tensor_parallel

        model = load_tensor_parallel(path, model_cls, config, parsed, targeted, ckpt, dtype, device, tp_group,
                                     tp_plan, shared, model_kwargs, moe=moe)
        if qc is not None:
            model.config.quantization_config = qc
        return model
    model = load_unsharded(path, model_cls, config, targeted, ckpt, dtype, device, shared, model_kwargs, _WHERE,
                           moe=moe)
    if qc is not None:
        model.config.quantization_config = qc
    return model


def _meta_model(model_cls, config, shared: dict) -> nn.Module:
    """The model of ``config`` on the meta device (for matching module names before any weight is read)."""
    from transformers import PreTrainedModel

    with torch.device("meta"):
        if isinstance(model_cls, type) and issubclass(model_cls, PreTrainedModel):
            return model_cls._from_config(config)
        kw = {"trust_remote_code": shared["trust_remote_code"]} if "trust_remote_code" in shared else {}
        return model_cls.from_config(config, **kw)


def plan_compressed_tensors(meta: nn.Module, parsed: ParsedConfig, tensors: Dict[str, Tuple[str, list]],
                            where: str = _WHERE) -> Tuple[Dict[str, Target], dict]:
    """What `from_pretrained` reads from a compressed-tensors checkpoint into ``meta`` (the model built on the meta
    device from its config): ``(targeted, moe)``, the quantized linears (``{name: Target}``) and the MoE experts
    modules (``{name: MoeTarget}``), after checking the checkpoint's ``tensors`` (``{name: (safetensors dtype,
    shape)}``, its headers) against them. ValueError naming the module, tensor or field of the first mismatch."""
    blocks = find_moe_blocks(meta, tensors, where)
    moe = ct_moe_targets(blocks, parsed, tensors, where) if blocks else {}
    targeted = _targeted_linears(meta, parsed, allow_empty=any(t.scheme is not None for t in moe.values()),
                                 where=where)
    check_tensors(tensors, targeted, {k for t in moe.values() for k in t.keys()}, where)
    return targeted, moe


def check_loadable(model_cls, config, config_json: dict, tensors: Dict[str, Tuple[str, list]],
                   where: str = _WHERE, model_names: bool = False, meta: nn.Module = None) -> nn.Module:
    """Raise ValueError when `from_pretrained` (with ``model_cls``) would refuse a checkpoint whose ``config.json``
    is ``config_json`` (``config``: the same as a transformers config object) and whose safetensors files hold
    ``tensors`` (``{name: (safetensors dtype, shape)}``): the loader's own checks (`find_quantization_config`,
    `parse_quantization_config`, `plan_compressed_tensors`) on the model built on the meta device, then every
    other parameter and persistent buffer of that model stored with its shape (`_direct.check_rest`). Nothing is
    read but the arguments: `cutlass_w8a8.checkpoints.write` calls it before writing (``model_names``: ``tensors``
    named as in the model, first named as transformers' ``save_pretrained`` writes them, `_names.Renaming.to_files`,
    or by the MoE rows' `CheckpointNames` where transformers has no renames for the model) and on the written files'
    headers; either way they are then viewed under the model's names as the loader views them (`_names.model_view`). Returns the model built on the meta device, which
    a second call for the same architecture may pass as ``meta`` (not built again)."""
    if is_native_fp8(config_json):
        return _check_native_loadable(model_cls, config, config_json, tensors, where, model_names, meta)
    key, raw = find_quantization_config(config_json, where)
    parsed = parse_quantization_config(raw, where, key)
    config.quantization_config = parsed.to_dict()
    if hasattr(config, "compression_config"):
        del config.compression_config
    return _check_planned(model_cls, config, tensors, where, model_names, meta,
                          lambda m, t: plan_compressed_tensors(m, parsed, t, where))


def _check_native_loadable(model_cls, config, config_json: dict, tensors: Dict[str, Tuple[str, list]], where: str,
                           model_names: bool, meta: nn.Module = None) -> nn.Module:
    """`check_loadable` of a transformers-native fp8 checkpoint: `parse_native_fp8`, `plan_native` and
    `_direct.check_rest` on the model built on the meta device from ``config`` without its quantization_config (as
    `from_pretrained` builds it). The ue8m0 check needs the scales' values: `cutlass_w8a8.checkpoints.write` makes it
    on the tensors it writes."""
    parsed = parse_native_fp8(config_json["quantization_config"], where)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    return _check_planned(model_cls, config, tensors, where, model_names, meta,
                          lambda m, t: plan_native(m, parsed, t, where))


def _check_planned(model_cls, config, tensors: Dict[str, Tuple[str, list]], where: str, model_names: bool,
                   meta: Optional[nn.Module], plan) -> nn.Module:
    """The part of `check_loadable` both formats share: the model built on the meta device (unless given), the
    files' names mapped to the model's (``model_names``), ``plan(meta, tensors) -> (targeted, moe)`` (the format's
    planner: its own refusals) and `_direct.check_rest` on everything else. Returns the meta model."""
    from ._direct import check_rest
    from ._moe import checkpoint_renamer

    if meta is None:
        meta = _meta_model(model_cls, config, {})
    renaming = renaming_of(meta)
    if model_names:  # named as transformers' save_pretrained writes them, then viewed as the loader views them
        tensors = {renaming.to_files(k): v for k, v in tensors.items()}
    tensors = renamed_index(tensors, model_view(meta, tensors, where, renaming))
    rename = checkpoint_renamer(find_moe_blocks(meta, tensors, where))
    if model_names and rename is not None and not renaming:  # the rows' names, where transformers has none
        tensors = {rename(k): v for k, v in tensors.items()}
    targeted, moe = plan(meta, tensors)
    check_rest(meta, tensors, set(targeted) | set(moe), config, where, rename=rename)
    return meta


def _targeted_linears(meta: nn.Module, parsed: ParsedConfig, allow_empty: bool = False,
                      where: str = _WHERE) -> Dict[str, Target]:
    """``{module name: Target}`` of the modules compressed-tensors will quantize, found with its own matching on
    the model built on the meta device (`_meta_model`); raises for a targeted module `W8A8Linear` cannot replace,
    and (unless ``allow_empty``: the MoE experts are quantized) when nothing is targeted."""
    from compressed_tensors.quantization.lifecycle.initialize import is_cached_attention_module
    from compressed_tensors.utils import is_narrow_match, match_named_modules, match_targets

    # the order compressed-tensors' apply_quantization_config resolves a module matched by several groups in
    target_to_group = collections.OrderedDict()
    for gname, scheme in parsed.config.config_groups.items():
        for t in scheme.targets:
            target_to_group[t] = gname
    key = parsed.key
    targeted = {}
    for name, module in match_named_modules(meta, target_to_group, parsed.config.ignore or []):
        first = match_targets(name, module, target_to_group)[0]
        gname = target_to_group[first]
        field = f"{key}.config_groups.{gname}.targets"
        targets = parsed.config.config_groups[gname].targets
        if is_cached_attention_module(module) and is_narrow_match(meta, targets, name):
            raise ValueError(f"{where}: attention module {name!r} ({type(module).__name__}) is targeted by "
                             f"{field} = {targets!r}: attention / KV-cache quantization is not supported (only "
                             "nn.Linear modules)")
        if isinstance(module, nn.Linear):
            n, k = module.out_features, module.in_features
            if not shape_supported(n, k):
                raise ValueError(f"{where}: module {name!r} (nn.Linear, in_features={k}, out_features={n}) is "
                                 f"targeted by {field} = {targets!r}: W8A8Linear needs in_features and "
                                 "out_features to be multiples of 16 (add it to `ignore`)")
            if parsed.schemes[gname].block and k % BLOCK_SIZE:
                raise ValueError(f"{where}: module {name!r} (nn.Linear, in_features={k}, out_features={n}) is "
                                 f"targeted by {field} = {targets!r} with block-scaled weights, but K = {k} is not a "
                                 f"multiple of {BLOCK_SIZE} (the block GEMM's K granularity; add it to `ignore`)")
            targeted[name] = Target(parsed.schemes[gname], gname, k, n)
        elif isinstance(module, nn.Embedding):
            raise ValueError(f"{where}: module {name!r} (nn.Embedding) is targeted by {field} = {targets!r}: "
                             "only nn.Linear modules are supported")
        # Any other match (a container such as `mlp` matched by a `re:` target) compressed-tensors leaves alone;
        # tensors stored for it are caught by the checkpoint check.
    if not targeted and not allow_empty:
        raise ValueError(f"{where}: no nn.Linear module of {type(meta).__name__} matches the targets of "
                         f"{key}.config_groups (less `ignore`)")
    return targeted


def _swap_to_w8a8(model: nn.Module, targeted: Dict[str, Target], ckpt: _SafetensorsCheckpoint,
                  dtype: torch.dtype) -> None:
    loaded = {name for name, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    if loaded != set(targeted):
        raise RuntimeError(f"{_WHERE}: transformers quantized {sorted(loaded ^ set(targeted))[:4]} differently from "
                           "the matching done before loading; please report this")
    keys = [f"{name}.{leaf}" for name, t in targeted.items()
            for leaf in ("weight_scale",) + (("input_scale",) if t.scheme.static_input else ())]
    scales = ckpt.read(keys)
    for name, t in targeted.items():
        module = model.get_submodule(name)
        if not isinstance(module, nn.Linear) or module.weight.dtype != t.scheme.quant_dtype:
            raise RuntimeError(f"{_WHERE}: {name!r} was loaded as {type(module).__name__} with "
                               f"{getattr(getattr(module, 'weight', None), 'dtype', None)} weights, expected "
                               f"nn.Linear with {t.scheme.quant_dtype}; please report this")
        dev = module.weight.device
        new = W8A8Linear.from_quantized(
            module.weight.detach(), scales[f"{name}.weight_scale"].to(dev).float(),
            bias=None if module.bias is None else module.bias.detach(),
            input_scale=scales[f"{name}.input_scale"].to(dev) if t.scheme.static_input else None, dtype=dtype,
            weight_block_size=block_size(t.scheme))
        new.train(module.training)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _detach_compressed_tensors(model: nn.Module, parsed: ParsedConfig) -> None:
    """Undo what compressed-tensors' quantizer left on the model now that the modules are ours."""
    if getattr(getattr(model, "hf_quantizer", None), "use_fp8_kernel", False):  # excluded by the config we pass
        raise RuntimeError(f"{_WHERE}: transformers loaded the model with its own fp8 kernels "
                           "(use_optimized_inference); please report this")
    hook = getattr(model, "ct_decompress_hook", None)
    if hook is not None:
        hook.remove()
        del model.ct_decompress_hook
    model.hf_quantizer = None
    model.is_quantized = False  # transformers' .half() / .float() refuse models marked quantized
    if hasattr(model, "quantization_method"):
        del model.quantization_method
    model.config.quantization_config = parsed.to_dict()
