"""`from_pretrained` (the checkpoint loader, then `optimize_`) and `save_pretrained` (through `unfused`): the
top-level ``cutlass_w8a8.from_pretrained`` / ``cutlass_w8a8.save_pretrained``."""

from __future__ import annotations

from torch import nn

from .. import checkpoints
from .optimize import optimize_
from .unfuse import unfused

__all__ = ["from_pretrained", "save_pretrained"]


def from_pretrained(path, *, optimize: bool = True, **kwargs):
    """`cutlass_w8a8.checkpoints.from_pretrained` (same arguments, same returns and errors), then, with
    ``optimize=True`` (the default), `cutlass_w8a8.optimize_` on the loaded model: fused q/k/v and gate/up
    projections and fused norm / SiLU*mul quantization in the decoder layers it recognises (Llama, Mistral,
    Qwen2, Qwen3), a warning naming the others.

    Parameters
    ----------
    path, **kwargs
        As `cutlass_w8a8.checkpoints.from_pretrained`.
    optimize : bool
        Run `optimize_` on the model (default True). Tensor-parallel loads (``tp_group=...``) are not optimized
        (their sharded layers are not fused yet) and ``optimize=True`` is ignored for them without a warning.

    Raises
    ------
    TypeError
        ``optimize`` is not a bool; as `cutlass_w8a8.checkpoints.from_pretrained`.
    ValueError, RuntimeError
        As `cutlass_w8a8.checkpoints.from_pretrained`.
    """
    if not isinstance(optimize, bool):
        raise TypeError(f"cutlass_w8a8.from_pretrained: `optimize` must be a bool, got {type(optimize).__name__}")
    result = checkpoints.from_pretrained(path, **kwargs)
    if optimize and kwargs.get("tp_group") is None:
        optimize_(result[0] if isinstance(result, tuple) else result)
    return result


def save_pretrained(model, path, **save_kwargs) -> None:
    """`cutlass_w8a8.checkpoints.save_pretrained` of ``model`` in its unfused layout: an `optimize_`d model is
    written with its ``q_proj`` / ``k_proj`` / ``v_proj`` / ``gate_proj`` / ``up_proj`` tensors and scales as the
    unoptimized model would write them (the same file bytes; split from the fused tensors exactly), and stays
    optimized afterwards. The fused model's ``state_dict`` already has that layout (`optimize_`'s hooks); saving
    inside `cutlass_w8a8.hf.unfused` also gives the ``quantization_config``, which is built from the modules, the
    unfused layers' names and schemes (a part with a per-tensor weight scale is per-channel once fused). Same
    arguments and errors as `cutlass_w8a8.checkpoints.save_pretrained`."""
    if not isinstance(model, nn.Module):  # the loader's own TypeError names the argument
        return checkpoints.save_pretrained(model, path, **save_kwargs)
    with unfused(model):
        checkpoints.save_pretrained(model, path, **save_kwargs)
