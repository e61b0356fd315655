"""The names checkpoint files give a model's tensors, where they differ from the model's own: transformers' key
renames, the ``WeightRenaming`` entries of its conversion mapping (``transformers.conversion_mapping.
get_model_conversion_mapping``, the list its loader applies and its ``save_pretrained`` reverts: HY-V3's
``shared_mlp``, Laguna's ``shared_expert``, Kimi-Linear's and Mixtral's ``block_sparse_moe``, A.X-K1's decoder-layer
``post_mlp_layernorm``, MiMo-V2-Flash's ``attention_sink_bias``, ...). The mapping's ``WeightConverter`` entries
(the per-expert tensors merged into 3-D experts) are not applied: the MoE loader reads the per-expert tensors itself
(`cutlass_w8a8.checkpoints._moe`).

One owner for both directions: the loader views a checkpoint's tensors under the model's names (`model_view`), and
the save-time check (`cutlass_w8a8.checkpoints.load.check_loadable`) first names the model's tensors as
``save_pretrained`` writes them (`Renaming.to_files`), then views them as the loader does.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List

from torch import nn

from ..moe.families import family_of

__all__ = ["Renaming", "renaming_of", "model_view", "renamed_index"]


class Renaming:
    """transformers' key renames for one model.

    Attributes
    ----------
    forward : list
        The ``WeightRenaming`` transforms in the order transformers' loader applies them (files' name -> model's).
    reverse : list
        Their reverses, in the order its ``save_pretrained`` applies them (model's name -> files').
    """

    def __init__(self, forward: List, reverse: List):
        self.forward = forward
        self.reverse = reverse

    @staticmethod
    def _apply(key: str, transforms) -> str:
        for t in transforms:
            key, _ = t.rename_source_key(key)
        return key

    def to_model(self, key: str) -> str:
        """The model's name of the files' tensor ``key`` (``key`` itself when no rename matches)."""
        return self._apply(key, self.forward)

    def to_files(self, key: str) -> str:
        """The name transformers' ``save_pretrained`` writes the model's tensor ``key`` under."""
        return self._apply(key, self.reverse)

    def __bool__(self) -> bool:
        return bool(self.forward)


def renaming_of(model: nn.Module) -> Renaming:
    """The `Renaming` of ``model`` (built on the meta device or not): the ``WeightRenaming`` entries (less
    ``PrefixChange``, which transformers' own ``save_pretrained`` drops for a model it did not load) of the
    conversion mapping transformers has for it; empty for a model that is no transformers ``PreTrainedModel`` or
    that it has no mapping for."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightRenaming
    except ImportError:  # a transformers without conversion mappings: no renames
        return Renaming([], [])
    if not isinstance(model, PreTrainedModel):
        return Renaming([], [])
    forward = [t for t in get_model_conversion_mapping(model, add_legacy=False)
               if isinstance(t, WeightRenaming) and not isinstance(t, PrefixChange)]
    return Renaming(forward, [t.reverse_transform() for t in forward[::-1]])


def model_view(model: nn.Module, keys: Iterable[str], where: str, renaming: Renaming = None) -> Dict[str, str]:
    """``{model's name: files' name}`` for the checkpoint tensors ``keys`` that transformers' loader renames
    (`renaming_of` ``model``), the others left out (their names are the model's). A key that already names one of
    the model's tensors is kept as it is (a checkpoint written with the model's names), and so is a tensor of the
    experts of a block of `cutlass_w8a8.moe.families` (the MoE loader reads them under the row's
    `CheckpointNames`: Kimi-Linear's and Mixtral's ``block_sparse_moe.experts.{e}.w1``). ValueError naming both
    tensors when two of ``keys`` would get the same name."""
    renaming = renaming if renaming is not None else renaming_of(model)
    if not renaming:
        return {}
    keys = list(keys)
    own = set(model.state_dict().keys())
    experts = tuple(f"{name}.{fam.layout.module}." for name, m in model.named_modules()
                    for fam in (family_of(m),) if fam is not None)
    view: Dict[str, str] = {}
    for k in keys:
        if k in own:
            continue
        new = renaming.to_model(k)
        if new != k and not new.startswith(experts):
            view[new] = k
    present = set(keys)
    for new, k in view.items():
        if new in present:
            raise ValueError(f"{where}: the checkpoint holds both {k!r} and {new!r}, which transformers' conversion "
                             f"mapping for {type(model).__name__} renames {k!r} to")
    return view


def renamed_index(index: Dict[str, object], view: Dict[str, str]) -> Dict[str, object]:
    """``index`` (``{files' tensor name: value}``) keyed by the model's names of ``view`` (`model_view`)."""
    if not view:
        return index
    back = {k: new for new, k in view.items()}
    return {back.get(k, k): v for k, v in index.items()}

