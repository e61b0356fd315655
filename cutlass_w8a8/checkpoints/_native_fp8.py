"""The transformers-native block-fp8 format (DeepSeek-V3 / R1, ``Qwen/Qwen3-*-FP8``, Kimi-K2, GLM-4.6-FP8):
find it in a ``config.json``, check that `W8A8Linear` runs what it describes exactly, and find its quantized
linears from the checkpoint's own tensors.

The format: ``quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
"weight_block_size": [128, 128], "modules_to_not_convert": [...]}`` (transformers' ``FineGrainedFP8Config``);
each quantized linear stores ``<name>.weight`` (e4m3, ``[N, K]``) and ``<name>.weight_scale_inv``
(``[ceil(N / 128), ceil(K / 128)]``, float32 in DeepSeek's checkpoints, bfloat16 in Qwen's), the dequantized
weight being ``weight[n, k] * weight_scale_inv[n // 128, k // 128]`` (despite its name the tensor multiplies);
activations are quantized per 1 x 128 group at run time (``activation_scheme: dynamic``).

Which linears are quantized is read from the tensors, not guessed from names: a linear whose stored weight is
e4m3 is quantized (and must have its block scale); one stored in a float dtype stays a float ``nn.Linear``
(DeepSeek-V3 lists no ``modules_to_not_convert`` and stores ``lm_head`` in bf16). ``modules_to_not_convert``
(and its alias ``ignored_layers``) is checked against the tensors with transformers' matching rule (a pattern
matches a module name as a regex from its start, or as its suffix): a module it names must not be stored in
e4m3.

``scale_fmt: ue8m0`` (DeepSeek-V3.1, Kimi-K2's later checkpoints) says every weight scale is a power of two (an
unsigned 8-bit exponent): still stored as float32, where a power of two is exact, so the weights dequantize the same
way and load as they are; the loader checks that the scales really are powers of two (`check_ue8m0`) and the
native save keeps the field. DeepSeek's own inference code also rounds its activation scales up to powers of two
under ``ue8m0``; the kernels here do not (see docs/CHECKPOINTS.md, "DeepSeek-V3").

A DeepSeek-V3 checkpoint holds one more decoder layer than ``num_hidden_layers``, the multi-token-prediction (MTP)
module, ``model.layers.{num_hidden_layers + j}.*`` for ``j < num_nextn_predict_layers``; transformers' models have
no such module, so `mtp_tensors` finds those tensors for the loader to leave out (with a warning).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional

import torch
from torch import nn

from ..ops._limits import BLOCK_SIZE, blocks
from ..quantize import shape_supported
from ._scheme import BLOCK, BLOCK_SCHEME, Target, build_quantization_config

__all__ = ["NativeFp8Config", "NativeFp8Source", "SCALE_FMTS", "is_native_fp8", "parse_native_fp8", "native_targets",
           "check_ue8m0", "mtp_tensors", "SCALE_LEAF"]

_KEY = "quantization_config"
_SCALE_LEAF = SCALE_LEAF = "weight_scale_inv"
#: The ``scale_fmt`` values read: absent / ``float`` (scales as stored), ``ue8m0`` (powers of two, checked).
SCALE_FMTS = (None, "float", "ue8m0")
_ST_SCALE = ("F32", "BF16", "F16")
_ST_8BIT = ("I8", "U8", "F8_E4M3", "F8_E5M2", "F8_E8M0")
# tensors a quantized linear of this format (or its static / MoE variants) may carry, by the end of their name
_QUANT_SUFFIXES = ("weight_scale_inv", "weight_scale", "activation_scale", "input_scale", ".scale")


@dataclasses.dataclass
class NativeFp8Config:
    """A checked transformers-native fp8 ``quantization_config``.

    Attributes
    ----------
    key : str
        ``"quantization_config"``.
    raw : dict
        The config as ``config.json`` holds it.
    modules_to_not_convert : list of str
        Patterns of the modules left in float (``modules_to_not_convert`` or ``ignored_layers``; empty if
        neither).
    scale_fmt : str or None
        ``"ue8m0"``: every weight scale must be a power of two (`check_ue8m0`); None or ``"float"``: any float.
    ignore : list of str
        After `native_targets`: the float ``nn.Linear`` modules of the model, by name (the ``ignore`` list of
        the compressed-tensors config `to_dict` returns).
    """

    key: str
    raw: dict
    modules_to_not_convert: List[str]
    scale_fmt: Optional[str] = None
    ignore: List[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        """The compressed-tensors ``quantization_config`` describing the loaded model (FP8_BLOCK, ``targets:
        ["Linear"]``, ``ignore`` the float linears): what the model's ``state_dict`` holds once loaded (its
        scales are named ``weight_scale``), so that ``model.save_pretrained`` writes a consistent checkpoint."""
        return build_quantization_config([(BLOCK_SCHEME, ["Linear"])], self.ignore)


def _unsupported(where: str, field: str, value, supported: str) -> ValueError:
    return ValueError(f"{where}: {_KEY}.{field} = {value!r} is not supported (supported: {supported})")


def is_native_fp8(config_json: dict) -> bool:
    """Whether ``config.json``'s ``quantization_config`` is transformers' native fp8 (``quant_method: fp8``)."""
    qc = config_json.get(_KEY)
    return isinstance(qc, dict) and qc.get("quant_method") == "fp8"


def parse_native_fp8(raw: dict, where: str) -> NativeFp8Config:
    """Check a native fp8 ``quantization_config`` (missing fields take transformers' defaults: dynamic
    activations, ``[128, 128]`` blocks, float scales) and raise ValueError naming the first field `W8A8Linear`
    cannot run exactly: ``activation_scheme`` other than ``dynamic``, ``weight_block_size`` other than
    ``[128, 128]``, ``fmt`` other than ``e4m3``, ``scale_fmt`` other than absent, ``float`` or ``ue8m0``
    (DeepSeek-V3.1's power-of-two scales: exact in float32, read as they are once `check_ue8m0` has checked them),
    or a non-empty ``modules_to_convert`` (quantized embeddings). ``dequantize`` (a loading switch of
    transformers) is ignored: the weights are always kept 8-bit."""
    scheme = raw.get("activation_scheme", "dynamic")
    if not isinstance(scheme, str) or scheme.lower() != "dynamic":
        raise _unsupported(where, "activation_scheme", scheme,
                           "'dynamic': activation scales per 1 x 128 group computed at run time")
    block = raw.get("weight_block_size", BLOCK)
    if not isinstance(block, (list, tuple)) or list(block) != BLOCK:
        raise _unsupported(where, "weight_block_size", block, repr(BLOCK))
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _unsupported(where, "fmt", fmt, "'e4m3'")
    scale_fmt = raw.get("scale_fmt")
    if scale_fmt not in SCALE_FMTS:
        raise _unsupported(where, "scale_fmt", scale_fmt, "absent, 'float' (scales used as stored) or 'ue8m0' "
                           "(power-of-two scales, stored as float32)")
    if raw.get("modules_to_convert"):
        raise _unsupported(where, "modules_to_convert", raw["modules_to_convert"],
                           "absent or empty: only nn.Linear modules are quantized")
    field = "modules_to_not_convert" if raw.get("modules_to_not_convert") is not None else "ignored_layers"
    skip = raw.get(field)
    if skip is None:
        skip = []
    if not isinstance(skip, list) or not all(isinstance(p, str) for p in skip):
        raise _unsupported(where, field, skip, "a list of module names or patterns")
    return NativeFp8Config(key=_KEY, raw=raw, modules_to_not_convert=list(skip), scale_fmt=scale_fmt)


def _not_converted(name: str, patterns: List[str]) -> Optional[str]:
    """The first of ``patterns`` that names module ``name`` by transformers' rule (a regex matching the name from
    its start, or the name's suffix), or None."""
    for p in patterns:
        try:
            if re.match(p, name):
                return p
        except re.error:
            pass
        if name.endswith(p):
            return p
    return None


def native_targets(model: nn.Module, parsed: NativeFp8Config, meta: Dict[str, tuple], where: str,
                   claimed=frozenset(), allow_empty: bool = False) -> Dict[str, Target]:
    """``{module name: Target}`` of the block-quantized linears of ``model`` (built on the meta device from the
    config): each ``nn.Linear`` whose stored ``weight`` is e4m3. Sets ``parsed.ignore`` to the other linears.

    ``meta``: ``{tensor name: (safetensors dtype, shape)}`` of the checkpoint. ``claimed``: tensors already
    accounted for (the MoE experts' per-expert tensors, `cutlass_w8a8.checkpoints._moe`), skipped by the check for
    8-bit tensors of no linear. ``allow_empty``: no e4m3 linear is not an error (a model whose only quantized
    layers are MoE experts).

    Raises
    ------
    ValueError
        A quantized linear lacks its ``weight_scale_inv``, or it has the wrong dtype (not F32 / BF16 / F16) or
        shape (not ``[ceil(N / 128), ceil(K / 128)]``); its K is not a multiple of 128 (the block GEMM's K
        granularity) or its N not a multiple of 16; a linear named by ``modules_to_not_convert`` is stored in
        e4m3; a weight is stored in another 8-bit dtype; a scale is stored for a float weight; an 8-bit or scale
        tensor belongs to no linear of the model (MoE experts merged by transformers on load, static activation
        scales, ...); no linear is stored in e4m3. Each message names the tensor or module.
    """
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    targeted: Dict[str, Target] = {}
    floats = []
    for name, lin in linears.items():
        wkey, skey = f"{name}.weight", f"{name}.{_SCALE_LEAF}"
        if wkey not in meta:  # a tied lm_head, or missing: the loader reports a missing tensor
            floats.append(name)
            continue
        dt, shape = meta[wkey]
        n, k = lin.out_features, lin.in_features
        if dt == "F8_E4M3":
            p = _not_converted(name, parsed.modules_to_not_convert)
            if p is not None:
                raise ValueError(f"{where}: checkpoint tensor {wkey!r} is F8_E4M3 but {_KEY}.modules_to_not_convert "
                                 f"pattern {p!r} leaves {name!r} unquantized")
            if skey not in meta:
                raise ValueError(f"{where}: the checkpoint has no tensor {skey!r}, the block scale of the e4m3 weight "
                                 f"{wkey!r}")
            if shape != [n, k]:
                raise ValueError(f"{where}: checkpoint tensor {wkey!r} has shape {shape}; module {name!r} is "
                                 f"nn.Linear(in_features={k}, out_features={n}), expected [{n}, {k}]")
            sdt, sshape = meta[skey]
            want = [blocks(n), blocks(k)]
            if sdt not in _ST_SCALE or sshape != want:
                raise ValueError(f"{where}: checkpoint tensor {skey!r} is {sdt} {sshape}; {_KEY}.weight_block_size "
                                 f"= {BLOCK} implies {' or '.join(_ST_SCALE)} {want} = [ceil(N/{BLOCK_SIZE}), "
                                 f"ceil(K/{BLOCK_SIZE})] for N = {n}, K = {k}")
            if k % BLOCK_SIZE:
                raise ValueError(f"{where}: module {name!r} (nn.Linear, in_features={k}, out_features={n}) has "
                                 f"block-scaled fp8 weights but K = {k} is not a multiple of {BLOCK_SIZE} (the block "
                                 "GEMM's K granularity); such a layer cannot be loaded 8-bit")
            if not shape_supported(n, k):
                raise ValueError(f"{where}: module {name!r} (nn.Linear, in_features={k}, out_features={n}) has "
                                 "block-scaled fp8 weights but N is not a multiple of 16 (the GEMM kernels' "
                                 "alignment)")
            targeted[name] = Target(BLOCK_SCHEME, _KEY, k, n, _SCALE_LEAF)
        elif dt in _ST_8BIT:
            raise ValueError(f"{where}: checkpoint tensor {wkey!r} is {dt}; {_KEY}.fmt = 'e4m3' implies F8_E4M3 "
                             "(or a float dtype for a linear left unquantized)")
        else:
            if skey in meta:
                raise ValueError(f"{where}: checkpoint tensor {skey!r} is stored for the {dt} (not e4m3) weight "
                                 f"{wkey!r}")
            floats.append(name)
    if not targeted and not allow_empty:
        raise ValueError(f"{where}: no nn.Linear of {type(model).__name__} has an e4m3 weight in the checkpoint "
                         f"({_KEY}.quant_method = 'fp8')")
    for key, (dt, _) in meta.items():
        if key in claimed:
            continue
        module, _, leaf = key.rpartition(".")
        if module in targeted:
            if leaf not in ("weight", _SCALE_LEAF, "bias"):
                raise ValueError(f"{where}: checkpoint tensor {key!r} is not part of the block-fp8 scheme of "
                                 f"{module!r} (static activation scales, zero points, ... are not supported)")
            continue
        if module in linears and leaf in ("weight", "bias"):
            continue
        if dt in _ST_8BIT or key.endswith(_QUANT_SUFFIXES):
            raise ValueError(f"{where}: checkpoint tensor {key!r} ({dt}) belongs to no nn.Linear of "
                             f"{type(model).__name__} (MoE experts merged by transformers on load, KV-cache or "
                             "static activation scales, and tensors its conversion mapping concatenates or splits "
                             "are not supported)")
    parsed.ignore = sorted(floats)
    return targeted


def check_ue8m0(key: str, scale: torch.Tensor, where: str) -> None:
    """ValueError naming checkpoint tensor ``key`` and the first block of ``scale`` (a ``weight_scale_inv``, any
    float dtype) that is not a positive finite power of two, what ``scale_fmt: ue8m0`` promises (a ue8m0 scale is
    ``2**e``, no sign, no mantissa: exact in float32)."""
    s = scale.float()
    mantissa, _ = torch.frexp(s)
    bad = ~((mantissa == 0.5) & torch.isfinite(s))
    if bool(bad.any()):
        idx = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(f"{where}: checkpoint tensor {key!r} holds {s[tuple(idx)].item()!r} at block {idx}, which is "
                         f"not a power of two, but {_KEY}.scale_fmt = 'ue8m0' says every weight scale is one (2**e); "
                         "fix the scale or the config's scale_fmt")


def mtp_tensors(names, config) -> List[str]:
    """The tensors among ``names`` (a checkpoint's) of its multi-token-prediction layers, which transformers' model
    of ``config`` does not have: ``model.layers.{L}.*`` for ``num_hidden_layers <= L < num_hidden_layers +
    num_nextn_predict_layers`` (DeepSeek-V3's ``model.layers.61``, GLM-4.5's last layer). Empty when the config has
    no ``num_nextn_predict_layers``."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    extra = getattr(text, "num_nextn_predict_layers", None) or 0
    layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(extra, int) or extra <= 0 or not isinstance(layers, int):
        return []
    out = []
    for name in names:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m and layers <= int(m.group(1)) < layers + extra:
            out.append(name)
    return out


@dataclasses.dataclass
class NativeFp8Source:
    """What a model loaded from a native fp8 checkpoint keeps of its files, so that `save_pretrained` can write them
    back as they were (`cutlass_w8a8.checkpoints.write`): the ``quantization_config`` as ``config.json`` held it
    (``scale_fmt`` included) and every tensor's safetensors dtype (``{name: "F32" | "BF16" | ...}``; scales are
    float32 in the layers, bf16 in Qwen's files; DeepSeek's router weight is bf16 in the files, float32 in
    transformers' model). Set by `attach` on the loaded model as the attribute ``ATTR``."""

    quantization_config: dict
    dtypes: Dict[str, str]

    ATTR = "cutlass_w8a8_native_fp8"

    def attach(self, model: nn.Module) -> None:
        setattr(model, self.ATTR, self)

    @classmethod
    def of(cls, model: nn.Module) -> Optional["NativeFp8Source"]:
        """The record `attach` left on ``model``, or None."""
        src = getattr(model, cls.ATTR, None)
        return src if isinstance(src, cls) else None
