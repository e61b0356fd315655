"""Compressed-tensors quantization configs: find one in a ``config.json``, check that `W8A8Linear` runs what it
describes exactly, and build one that describes a model's `W8A8Linear` modules.

The parser is compressed-tensors' own (`compressed_tensors.quantization.QuantizationConfig.model_validate`):
it fills in the defaults (a strategy inferred from ``group_size``, preset schemes named by a group) and rejects
malformed fields the way every other consumer of the format does. The checks here then accept only what the
kernels compute exactly, and name the field and value of anything else.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import re
from typing import Dict, List, Optional, Tuple

import torch

from ..ops._limits import BLOCK_SIZE

__all__ = ["LinearScheme", "ParsedConfig", "Target", "BLOCK_SCHEME", "find_quantization_config",
           "parse_quantization_config", "scheme_of", "build_quantization_config"]

# Formats whose tensors are the 8-bit weight as is (`weight`) plus `weight_scale` (and `input_scale`).
SUPPORTED_FORMATS = ("int-quantized", "float-quantized", "naive-quantized")
#: The one weight block (and activation group) size the block GEMM runs: 128 x 128 weight blocks, 1 x 128 groups.
BLOCK = [BLOCK_SIZE, BLOCK_SIZE]
_QUANT_DTYPE = {"int": torch.int8, "float": torch.float8_e4m3fn}
_TYPE_OF = {torch.int8: "int", torch.float8_e4m3fn: "float"}
_FORMAT_OF = {torch.int8: "int-quantized", torch.float8_e4m3fn: "float-quantized"}


@dataclasses.dataclass(frozen=True)
class LinearScheme:
    """What one `W8A8Linear` computes, in the terms a compressed-tensors scheme describes.

    Attributes
    ----------
    quant_dtype : torch.dtype
        ``torch.int8`` (``type: int``) or ``torch.float8_e4m3fn`` (``type: float``), weights and activations.
    per_channel : bool
        Weight scales per output channel (``strategy: channel``, ``weight_scale`` ``(N, 1)``) or one per tensor
        (``strategy: tensor``, ``(1,)``).
    static_input : bool
        Static per-tensor activation scale (``dynamic: false``, ``strategy: tensor``, ``input_scale`` ``(1,)``)
        or dynamic per-token scales (``dynamic: true``, ``strategy: token``).
    block : bool
        Block-scaled e4m3 weights (``type: float``, ``strategy: block``, ``block_structure: [128, 128]``,
        ``weight_scale`` ``[ceil(N / 128), ceil(K / 128)]``) with dynamic activations per 1 x 128 group
        (``strategy: group``, ``group_size: 128``, ``dynamic: true``): compressed-tensors' ``FP8_BLOCK`` preset,
        DeepSeek-V3's and Qwen3-FP8's scheme. ``per_channel`` and ``static_input`` are then False.
    """

    quant_dtype: torch.dtype
    per_channel: bool
    static_input: bool
    block: bool = False


class Target(collections.namedtuple("Target", "scheme group in_features out_features scale_leaf",
                                    defaults=("weight_scale",))):
    """A quantized nn.Linear of a checkpoint: its `LinearScheme`, the config group (or field) that quantizes it,
    its K and N, and the name of its weight-scale tensor (``weight_scale``; ``weight_scale_inv`` in the
    transformers-native fp8 format)."""


#: Block-scaled fp8: e4m3 weights in 128 x 128 blocks, e4m3 activations per dynamic 1 x 128 group.
BLOCK_SCHEME = LinearScheme(quant_dtype=torch.float8_e4m3fn, per_channel=False, static_input=False, block=True)


@dataclasses.dataclass
class ParsedConfig:
    """A checked compressed-tensors config.

    Attributes
    ----------
    key : str
        Where it was found in ``config.json``: ``"quantization_config"`` or ``"compression_config"``.
    config : compressed_tensors.quantization.QuantizationConfig
        The parsed config.
    schemes : dict
        ``{group name: LinearScheme}``, one per config group.
    version : str or None
        The compressed-tensors version that wrote it (``version`` in the raw dict), if given.
    """

    key: str
    config: object
    schemes: Dict[str, LinearScheme]
    version: Optional[str] = None

    def to_dict(self) -> dict:
        """The config as ``config.json``'s ``quantization_config`` holds it (JSON types only)."""
        import compressed_tensors

        d = self.config.model_dump(mode="json")
        d["quant_method"] = "compressed-tensors"
        d["version"] = self.version or compressed_tensors.__version__
        return d


def _unsupported(where: str, field: str, value, supported: str) -> ValueError:
    return ValueError(f"{where}: {field} = {value!r} is not supported (supported: {supported})")


def find_quantization_config(config_json: dict, where: str) -> Tuple[str, dict]:
    """``(key, raw dict)`` of the compressed-tensors config in a ``config.json`` dict.

    ``quantization_config`` is what transformers reads. ``compression_config`` is the key older compressed-tensors
    releases wrote, flat (``{"quant_method": ..., "config_groups": ..., "sparsity_config": ...}``) or nested
    (``{"quantization_config": {...}, "sparsity_config": {...}}``); transformers ignores that key (it would load
    the int8 weights into bf16 layers), so `from_pretrained` translates it. Raises ValueError when neither is there.
    """
    if config_json.get("quantization_config") is not None:
        raw = config_json["quantization_config"]
        key = "quantization_config"
    elif config_json.get("compression_config") is not None:
        raw = config_json["compression_config"]
        key = "compression_config"
        if isinstance(raw, dict) and isinstance(raw.get("quantization_config"), dict):
            nested = dict(raw["quantization_config"])
            if raw.get("sparsity_config"):
                nested["sparsity_config"] = raw["sparsity_config"]
            raw = nested
            key = "compression_config.quantization_config"
    else:
        text = config_json.get("text_config") or {}
        if isinstance(text, dict) and text.get("quantization_config") is not None:
            raise ValueError(f"{where}: text_config.quantization_config (a quantized sub-model) is not supported "
                             "(supported: a top-level quantization_config)")
        raise ValueError(f"{where}: config.json has no quantization_config (or compression_config): this is not a "
                         "compressed-tensors checkpoint. Load a float checkpoint with transformers and quantize it "
                         "with cutlass_w8a8.quantize_")
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: {key} must be a dict, got {type(raw).__name__}")
    return key, raw


def parse_quantization_config(raw: dict, where: str, key: str = "quantization_config") -> ParsedConfig:
    """Parse ``raw`` with compressed-tensors' classes and check that every group is a scheme `W8A8Linear` runs
    exactly; raise ValueError naming the first field that is not (``key`` prefixes the field names)."""
    from compressed_tensors.quantization import QuantizationConfig

    method = raw.get("quant_method", "compressed-tensors")
    if method != "compressed-tensors":
        raise _unsupported(where, f"{key}.quant_method", method,
                           "'compressed-tensors'; 'fp8' with 128 x 128 blocks, transformers' native format")
    # Fields compressed-tensors' QuantizationConfig drops (extra="ignore") but that change what the tensors mean.
    for extra in ("sparsity_config", "transform_config"):
        if raw.get(extra):
            raise _unsupported(where, f"{key}.{extra}", raw[extra], "absent or empty")
    if not raw.get("config_groups"):
        raise _unsupported(where, f"{key}.config_groups", raw.get("config_groups"), "a non-empty dict of schemes")
    try:
        config = QuantizationConfig.model_validate(raw)
    except Exception as e:  # pydantic.ValidationError, or the NotImplementedError / ValueError of CT's validators
        first = _validation_error(e, key)
        if first is not None:
            raise ValueError(f"{where}: {first}") from e
        raise ValueError(f"{where}: {key} is not a valid compressed-tensors config: {e}") from e

    status = getattr(config.quantization_status, "value", config.quantization_status)
    if status != "compressed":
        raise _unsupported(where, f"{key}.quantization_status", status,
                           "'compressed': the weights stored as 8-bit integers / e4m3 with their scales")
    if config.kv_cache_scheme is not None:
        raise _unsupported(where, f"{key}.kv_cache_scheme", raw.get("kv_cache_scheme"), "null")
    top_format = config.format

    schemes = {}
    for name, scheme in config.config_groups.items():
        g = f"{key}.config_groups.{name}"
        fmt = getattr(scheme.format, "value", scheme.format) or top_format
        if fmt not in SUPPORTED_FORMATS:
            field = f"{g}.format" if scheme.format is not None else f"{key}.format"
            raise _unsupported(where, field, fmt, ", ".join(repr(f) for f in SUPPORTED_FORMATS))
        if scheme.output_activations is not None:
            raise _unsupported(where, f"{g}.output_activations", scheme.output_activations.model_dump(mode="json"),
                               "null")
        w, a = scheme.weights, scheme.input_activations
        if w is None:
            raise _unsupported(where, f"{g}.weights", None, "8-bit symmetric weights")
        if a is None:
            raise _unsupported(where, f"{g}.input_activations", None,
                               "8-bit symmetric activations; weight-only schemes have no W8A8 kernel")
        _check_args(where, f"{g}.weights", w)
        _check_args(where, f"{g}.input_activations", a)
        if w.strategy == "block":
            _check_block(where, g, w, a)
            if not scheme.targets:
                raise _unsupported(where, f"{g}.targets", scheme.targets, "a non-empty list")
            schemes[name] = BLOCK_SCHEME
            continue
        if w.strategy not in ("channel", "tensor"):
            raise _unsupported(where, f"{g}.weights.strategy", w.strategy,
                               "'channel', 'tensor'; 'block' with type 'float'")
        if w.dynamic is not False:
            raise _unsupported(where, f"{g}.weights.dynamic", w.dynamic, "false")
        if a.type != w.type:
            raise _unsupported(where, f"{g}.input_activations.type", a.type,
                               f"{w.type!r}, the weights' type")
        if a.dynamic is True:
            if a.strategy != "token":
                raise _unsupported(where, f"{g}.input_activations.strategy", a.strategy,
                                   "'token' when dynamic; 'tensor' when static")
        elif a.dynamic is False:
            if a.strategy != "tensor":
                raise _unsupported(where, f"{g}.input_activations.strategy", a.strategy,
                                   "'tensor' when static; 'token' when dynamic")
        else:
            raise _unsupported(where, f"{g}.input_activations.dynamic", getattr(a.dynamic, "value", a.dynamic),
                               "true (per token), false (per tensor)")
        if not scheme.targets:
            raise _unsupported(where, f"{g}.targets", scheme.targets, "a non-empty list")
        schemes[name] = LinearScheme(quant_dtype=_QUANT_DTYPE[w.type], per_channel=w.strategy == "channel",
                                     static_input=a.dynamic is False)
    version = raw.get("version")
    return ParsedConfig(key=key, config=config, schemes=schemes, version=version if isinstance(version, str) else None)


def _check_block(where: str, g: str, w, a) -> None:
    """Block weights: e4m3 128 x 128 blocks with dynamic 1 x 128 group activations of the same type, or a
    ValueError naming the first field that differs."""
    if w.type != "float":
        raise _unsupported(where, f"{g}.weights.type", w.type,
                           "'float' with strategy 'block': e4m3 blocks; there is no int8 block-scaled kernel")
    if list(w.block_structure or []) != BLOCK:
        raise _unsupported(where, f"{g}.weights.block_structure", w.block_structure, repr(BLOCK))
    if w.dynamic is not False:
        raise _unsupported(where, f"{g}.weights.dynamic", w.dynamic, "false")
    if a.type != w.type:
        raise _unsupported(where, f"{g}.input_activations.type", a.type, f"{w.type!r}, the weights' type")
    if a.dynamic is not True:
        raise _unsupported(where, f"{g}.input_activations.dynamic", getattr(a.dynamic, "value", a.dynamic),
                           "true with block weights (activation scales per 1 x 128 group, computed at run time)")
    if a.strategy != "group":
        raise _unsupported(where, f"{g}.input_activations.strategy", a.strategy,
                           f"'group' (group_size {BLOCK_SIZE}) with block weights")
    if a.group_size != BLOCK_SIZE:
        raise _unsupported(where, f"{g}.input_activations.group_size", a.group_size, f"{BLOCK_SIZE}")


def _validation_error(e: Exception, key: str) -> Optional[str]:
    """One line for a pydantic ValidationError of compressed-tensors' parser: the field, its value and what is
    valid (``quantization_config.config_groups.group_0.weights.strategy = 'banana' is not valid: ... (valid:
    'tensor', 'channel', ...)``), or None for another exception.

    pydantic reports a failed union once per member: a config group is a scheme or a list of names, so a bad
    field in a scheme also gives "input should be a valid list" for the group. A member that failed only because
    the value is not of its type at all is dropped when another member of the union got further; member tags
    (``function-after[...]``, ``list[str]``) are left out of the field name."""
    errors = getattr(e, "errors", None)
    if not callable(errors):
        return None
    try:
        errs = list(errors())
    except Exception:
        return None

    def tags(loc):
        return [i for i, p in enumerate(loc) if isinstance(p, str) and ("[" in p or "(" in p)]

    def spurious(err):
        loc = err["loc"]
        t = tags(loc)
        if not t or t[-1] != len(loc) - 1 or not err["type"].endswith("_type"):
            return False
        prefix = loc[:t[-1]]
        return any(o is not err and o["loc"][:len(prefix)] == prefix and len(o["loc"]) > len(prefix)
                   and o["loc"][len(prefix)] != loc[-1] for o in errs)

    kept = [err for err in errs if not spurious(err)] or errs
    if not kept:
        return None
    err = kept[0]
    field = key
    for p in err["loc"]:
        if isinstance(p, int):
            field += f"[{p}]"
        elif not ("[" in p or "(" in p):
            field += f".{p}"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    msg = msg[:1].lower() + msg[1:]
    valid = ""
    m = re.search(r"is not a valid (\w+)$", msg)
    if m:
        import compressed_tensors.quantization as ctq

        cls = getattr(ctq, m.group(1), None)
        if isinstance(cls, type) and issubclass(cls, enum.Enum):
            valid = " (valid: " + ", ".join(repr(v.value) for v in cls) + ")"
    more = f"; and {len(kept) - 1} more error(s)" if len(kept) > 1 else ""
    value = f" = {err['input']!r}" if "input" in err and not isinstance(err["input"], dict) else ""
    return f"{field}{value} is not valid: {msg}{valid}{more}"


def _check_args(where: str, field: str, args) -> None:
    if args.num_bits != 8:
        raise _unsupported(where, f"{field}.num_bits", args.num_bits, "8")
    if args.type not in _QUANT_DTYPE:
        raise _unsupported(where, f"{field}.type", args.type, "'int', 'float'")
    if args.symmetric is not True:
        raise _unsupported(where, f"{field}.symmetric", args.symmetric, "true")
    scale_dtype = args.scale_dtype
    if scale_dtype is not None and scale_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise _unsupported(where, f"{field}.scale_dtype", str(scale_dtype), "null, float32, bfloat16, float16")


def scheme_of(module) -> LinearScheme:
    """The `LinearScheme` of a `W8A8Linear` (`BLOCK_SCHEME` when it has block-scaled weights)."""
    if getattr(module, "weight_block_size", None) is not None:
        return BLOCK_SCHEME
    return LinearScheme(quant_dtype=module.quant_dtype, per_channel=module.per_channel,
                        static_input=module.input_scale is not None)


def _scheme_dict(scheme: LinearScheme, targets: List[str]) -> dict:
    """One config group as plain data (what compressed-tensors' QuantizationScheme holds)."""
    t = _TYPE_OF[scheme.quant_dtype]
    weights = {"num_bits": 8, "type": t, "symmetric": True, "strategy": "channel" if scheme.per_channel else "tensor",
               "dynamic": False}
    if scheme.block:  # compressed-tensors' FP8_BLOCK preset
        weights.update(strategy="block", block_structure=list(BLOCK))
        inputs = {"num_bits": 8, "type": t, "symmetric": True, "strategy": "group", "group_size": BLOCK_SIZE,
                  "dynamic": True}
    elif scheme.static_input:
        inputs = {"num_bits": 8, "type": t, "symmetric": True, "strategy": "tensor", "dynamic": False}
    else:
        inputs = {"num_bits": 8, "type": t, "symmetric": True, "strategy": "token", "dynamic": True}
    return {"targets": list(targets), "weights": weights, "input_activations": inputs,
            "output_activations": None, "format": _FORMAT_OF[scheme.quant_dtype]}


def build_quantization_config(groups: List[Tuple[LinearScheme, List[str]]], ignore: List[str]) -> dict:
    """The ``quantization_config`` dict of a model whose quantized linears are described by ``groups``
    (``[(scheme, targets)]``, each group's targets a list of class names or module names) with ``ignore`` left in
    float: ``quantization_status: compressed``, format int-quantized / float-quantized (mixed-precision when both).

    Built with compressed-tensors' classes (``QuantizationConfig(...).model_dump()``) when compressed-tensors is
    installed, so every field has the value its own writer gives it; without it, the same groups as plain data
    (the minimal form that compressed-tensors, transformers and vLLM parse, filling in the defaults).
    """
    formats = {_FORMAT_OF[s.quant_dtype] for s, _ in groups}
    top = formats.pop() if len(formats) == 1 else "mixed-precision"
    config_groups = {f"group_{i}": _scheme_dict(s, t) for i, (s, t) in enumerate(groups)}
    try:
        import compressed_tensors
        from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    except ImportError:
        return {"quant_method": "compressed-tensors", "format": top, "quantization_status": "compressed",
                "config_groups": config_groups, "ignore": list(ignore), "kv_cache_scheme": None,
                "global_compression_ratio": None}
    schemes = {}
    for name, g in config_groups.items():
        schemes[name] = QuantizationScheme(
            targets=g["targets"], weights=QuantizationArgs(**g["weights"]),
            input_activations=QuantizationArgs(**g["input_activations"]), format=g["format"])
    qc = QuantizationConfig(config_groups=schemes, quant_method="compressed-tensors", format=top,
                            quantization_status="compressed", ignore=list(ignore))
    d = qc.model_dump(mode="json")
    d["version"] = compressed_tensors.__version__
    return d

