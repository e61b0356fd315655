"""`save_pretrained` and `attach_quantization_config`: a model with `W8A8Linear` layers as a compressed-tensors
checkpoint that transformers, vLLM and `from_pretrained` load."""

from __future__ import annotations

import os
import sys
from typing import Optional

from torch import nn

from ..linear import W8A8Linear
from ..moe.layer import W8A8MoE
from ._moe import moe_state_dict, router_ignore
from ._scheme import BLOCK_SCHEME, LinearScheme, build_quantization_config, scheme_of

__all__ = ["save_pretrained", "attach_quantization_config", "quantization_config_of"]


def quantization_config_of(model: nn.Module) -> Optional[dict]:
    """The compressed-tensors ``quantization_config`` dict describing ``model``'s `W8A8Linear` modules, or None
    when it has none.

    All `W8A8Linear` sharing one scheme (llm-compressor's form): one group with ``targets: ["Linear"]`` and
    ``ignore`` listing every float ``nn.Linear`` by name. Several schemes: one group per scheme, its targets the
    module names, and no ignore list.
    """
    by_scheme = {}
    floats = []
    for name, m in model.named_modules():
        if isinstance(m, W8A8Linear):
            by_scheme.setdefault(scheme_of(m), []).append(name)
        elif isinstance(m, W8A8MoE):
            by_scheme.setdefault(moe_scheme_of(m), []).extend(_expert_linear_names(model, name, m))
        elif isinstance(m, nn.Linear):
            floats.append(name)
    if not by_scheme:
        return None
    if len(by_scheme) == 1:
        routers = router_ignore(model)
        return build_quantization_config([(next(iter(by_scheme)), ["Linear"])], floats + routers)
    return build_quantization_config(list(by_scheme.items()), [])


def moe_scheme_of(moe) -> LinearScheme:
    """The `LinearScheme` of a `W8A8MoE`'s expert linears, from its attributes."""
    if moe.weight_block_size is not None:
        return BLOCK_SCHEME
    return LinearScheme(quant_dtype=moe.w13.dtype, per_channel=True, static_input=moe.a13_scale is not None)


def _expert_linear_names(model: nn.Module, name: str, moe) -> list:
    """The per-expert linear names a `W8A8MoE` is written as (`_moe.moe_state_dict`'s tensors, less the leaf)."""
    from ._moe import moe_linear_names

    try:
        return moe_linear_names(model, name, moe, "cutlass_w8a8.save_pretrained")
    except ValueError:  # not in a known block: no layout (save_pretrained refuses it; attach_quantization_config
        return [name]  # must not raise, quantize_ calls it)


def attach_quantization_config(model: nn.Module) -> None:
    """Set ``model.config.quantization_config`` to the compressed-tensors dict describing ``model``'s `W8A8Linear`
    modules, so that transformers' own ``model.save_pretrained`` writes a checkpoint that loads back correctly
    (without it, the int8 / e4m3 weights are saved with no config and load into float layers).

    A no-op for a model that is not a transformers ``PreTrainedModel`` or holds no `W8A8Linear`. Cheap (one walk
    over the modules); transformers is not imported here (a model can only be a ``PreTrainedModel`` when it
    already is).
    """
    if "transformers" not in sys.modules:
        return
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return
    qc = quantization_config_of(model)
    if qc is not None:
        model.config.quantization_config = qc


def save_pretrained(model: nn.Module, path, **save_kwargs) -> None:
    """Write ``model`` (a transformers model whose quantized linears are `W8A8Linear`, from `quantize_` or
    `from_pretrained`) as a compressed-tensors checkpoint: the 8-bit ``weight``, ``weight_scale`` (``(N, 1)``
    per channel, ``(1,)`` per tensor, or ``[ceil(N / 128), K / 128]`` for block-scaled fp8 layers),
    ``input_scale`` (``(1,)``, static activations) and ``bias`` of each layer, and ``config.json`` with the
    ``quantization_config`` that describes them (``quantization_status: compressed``, format int-quantized /
    float-quantized; block layers as compressed-tensors' ``FP8_BLOCK`` preset: weights ``strategy: block``,
    ``block_structure: [128, 128]``, activations ``strategy: group``, ``group_size: 128``, dynamic; see
    `quantization_config_of`).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Holding at least one `W8A8Linear`.
    path : str or os.PathLike
        Output directory, created if missing (an existing one is written into); not an existing file.
    **save_kwargs
        Passed to ``model.save_pretrained`` (``max_shard_size``, ...).

    A `W8A8MoE` (the ``experts`` of a Qwen2-MoE / Qwen3-MoE / Mixtral block) is written as llm-compressor writes
    MoE checkpoints: one quantized linear per expert and projection (``<layer>.mlp.experts.{e}.{gate,up,down}_proj``,
    Mixtral ``<layer>.block_sparse_moe.experts.{e}.{w1,w3,w2}``) with its rows of ``w13`` / ``w2`` and scales
    (``weight_scale`` ``[N, 1]`` or its 128 x 128 blocks; ``input_scale`` ``a13_scale`` for gate and up,
    ``a2_scale`` for down), and the routers in ``ignore`` (``re:.*mlp.gate$`` / ``re:.*block_sparse_moe.gate$``).
    A model loaded from a native block-fp8 checkpoint is written in compressed-tensors' FP8_BLOCK form, as for
    dense models. Only this function writes that layout: transformers' own ``model.save_pretrained`` would store
    the merged ``w13`` / ``w2`` buffers, which no reader understands.

    Scales are saved in float32, what the kernels use, so `from_pretrained` of the result gives back the same
    scales bit for bit (llm-compressor writes the scales in the model dtype, usually bfloat16; the readers cast
    either). transformers' own loader (compressed-tensors' quantizer) creates the scale parameters in
    the model dtype and so rounds them to e.g. bfloat16 when loading: its dequantized weights equal ours exactly
    where the scales are representable in bfloat16, and differ by that rounding (at most 2**-9 relative)
    elsewhere (transformers >= 5.23 with ``dequantize=True`` dequantizes from the stored float32 scales instead,
    and also reports static layers' ``input_scale`` as unexpected keys: its dense model has none; docs/CHECKPOINTS.md,
    "save_pretrained"). `from_pretrained` reads the stored float32 values.

    Raises
    ------
    TypeError
        ``model`` is not a transformers ``PreTrainedModel``.
    ValueError
        ``path`` is an existing file (transformers' ``save_pretrained`` would only log that and write nothing);
        ``model`` holds no `W8A8Linear` or `W8A8MoE`; a `W8A8MoE` is not the ``experts`` of a Qwen2-MoE /
        Qwen3-MoE / Mixtral block, or has block scales with an intermediate size not a multiple of 128.
    """
    if "transformers" in sys.modules:
        from transformers import PreTrainedModel
    else:
        PreTrainedModel = None
    if PreTrainedModel is None or not isinstance(model, PreTrainedModel):
        raise TypeError("cutlass_w8a8.save_pretrained: `model` must be a transformers PreTrainedModel, got "
                        f"{type(model).__name__} (save another module's state_dict with torch.save or safetensors)")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"cutlass_w8a8.save_pretrained: `path` {os.fspath(path)!r} is an existing file, not a "
                         "directory; give a directory (it is created if missing)")
    qc = quantization_config_of(model)
    if qc is None:
        raise ValueError("cutlass_w8a8.save_pretrained: `model` holds no W8A8Linear (quantize it with "
                         "cutlass_w8a8.quantize_ first, or save a float model with model.save_pretrained)")
    model.config.quantization_config = qc
    moe_sd = moe_state_dict(model, "cutlass_w8a8.save_pretrained")
    if moe_sd is not None:
        if "state_dict" in save_kwargs:
            raise TypeError("cutlass_w8a8.save_pretrained: `state_dict` cannot be passed for a model with W8A8MoE "
                            "layers (their per-expert tensors are built here)")
        save_kwargs["state_dict"] = moe_sd
    model.save_pretrained(path, **save_kwargs)
