"""The checkpoint's files and the loader's argument checks, shared by `cutlass_w8a8.checkpoints.load` (reading),
`cutlass_w8a8.checkpoints.write` (the save's read-back check) and the command line: the directory and device
arguments, ``config.json``, the tensors' names / dtypes / shapes from the safetensors headers, and reads of single
tensors."""

from __future__ import annotations

import collections
import json
import os
from typing import Dict, Tuple

import torch
from torch import nn

from ..ops import _limits
from ._scheme import Target

_WHERE = "cutlass_w8a8.from_pretrained"
# safetensors' dtype names
_ST_QUANT = {torch.int8: "I8", torch.float8_e4m3fn: "F8_E4M3"}
_ST_SCALE = ("F32", "BF16", "F16")
_ST_8BIT = ("I8", "U8", "F8_E4M3", "F8_E5M2")
# tensors compressed-tensors attaches to a quantized module, by the end of their name
_QUANT_SUFFIXES = ("_scale", "_zero_point", "_packed", "_shape", "_g_idx", "global_scale")
# the string device_map values transformers / accelerate take besides a torch device
_DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def check_checkpoint_dir(where: str, path, arg: str = "`path`") -> str:
    """``path`` as a str when it is a directory holding ``config.json``; else ValueError saying what to pass: the
    folder that holds config.json (for a file, e.g. ``model.safetensors`` or ``config.json`` itself), or a local
    directory (a Hub id must be downloaded first)."""
    try:
        path = os.fspath(path)
    except TypeError:
        raise TypeError(f"{where}: {arg} must be a str or os.PathLike, got {type(path).__name__}") from None
    if os.path.isfile(path):
        raise ValueError(f"{where}: {arg} {path!r} is a file; pass the folder that holds config.json and the "
                         f"*.safetensors files ({os.path.dirname(os.path.abspath(path))!r}?)")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"{where}: {arg} {path!r} holds no config.json; pass the folder that holds config.json "
                             "and the *.safetensors files")
        return path
    raise ValueError(f"{where}: {arg} {path!r} is not a local directory; pass the folder that holds config.json "
                     "(a Hub model must be downloaded first, e.g. with huggingface_hub.snapshot_download)")


def refuse_missing_weights(where: str, model: nn.Module, info: dict, path: str, fix: str) -> None:
    """ValueError when transformers' loading info (``output_loading_info=True``) reports weights of ``model`` that
    ``path`` does not hold: transformers initialized them randomly (BERT loaded by ``AutoModelForCausalLM`` as
    ``BertLMHeadModel``, whose head a BERT checkpoint does not store). ``fix``: what the caller can do."""
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise ValueError(f"{where}: {path!r} holds no weights for {missing[:4]}{more} of {type(model).__name__}; "
                         "transformers would initialize them randomly (the checkpoint was not saved from this "
                         f"architecture: a head it never had?); {fix}")


def check_device(where: str, device, arg: str = "`device`", on_cpu: str = "device='cpu'") -> None:
    """Raise, before any file is read, when ``device`` names a CUDA device this process cannot use: RuntimeError
    for a torch built without CUDA or with no GPU visible (instead of torch's ``AssertionError: Torch not compiled
    with CUDA enabled`` from deep inside the loader), ValueError for an index past the visible GPUs. A string that
    is neither a torch device nor a transformers ``device_map`` strategy (``"auto"``, ...) is a ValueError too:
    ``"gpu"`` / ``"gpu:1"`` asks "did you mean 'cuda'" (instead of accelerate's ``device_map`` wording). Other
    values (a ``device_map`` dict, an int) are left to transformers. ``arg`` names the argument in the message and
    ``on_cpu`` the way to load on the CPU instead (the CLI's ``--device`` / ``--device cpu``)."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        if isinstance(device, str) and device not in _DEVICE_MAP_STRATEGIES:
            if device.lower().startswith("gpu"):
                raise ValueError(f"{where}: {arg} is {device!r}; did you mean {'cuda' + device[3:]!r}? (torch names "
                                 "NVIDIA GPUs 'cuda', 'cuda:1', ...)") from None
            raise ValueError(f"{where}: {arg} is {device!r}, which is neither a torch device ('cpu', 'cuda', "
                             "'cuda:1', ...) nor a transformers device_map strategy "
                             f"({', '.join(repr(s) for s in _DEVICE_MAP_STRATEGIES)})") from None
        return
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        if not torch.backends.cuda.is_built():
            raise RuntimeError(f"{where}: {arg} is {str(device)!r}, but this torch build has no CUDA support (torch "
                               f"{torch.__version__}); install a CUDA build of torch (README.md, 'Install') or load on "
                               f"the CPU with {on_cpu}")
        raise RuntimeError(f"{where}: {arg} is {str(device)!r}, but torch sees no CUDA device "
                           "(torch.cuda.is_available() is False: no GPU or driver, or CUDA_VISIBLE_DEVICES hides "
                           f"them); load on the CPU with {on_cpu}")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"{where}: {arg} is {str(device)!r}, but only {count} CUDA device(s) are visible "
                         f"(cuda:0 to cuda:{count - 1})")


def read_config_json(where: str, config_path: str) -> dict:
    """A checkpoint's ``config.json`` as a dict; ValueError naming the file when it is not JSON (instead of a bare
    JSONDecodeError) or not a JSON object."""
    try:
        with open(config_path) as f:
            config_json = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: `path`'s config.json is not valid JSON ({config_path}: {e}); repair the file or "
                         "download the checkpoint again") from e
    if not isinstance(config_json, dict):
        raise ValueError(f"{where}: `path`'s config.json must hold a JSON object, got {type(config_json).__name__} "
                         f"({config_path})")
    return config_json


def check_tensors(tensors: Dict[str, Tuple[str, list]], targeted: Dict[str, Target], claimed=frozenset(),
                  where: str = _WHERE) -> None:
    """Raise ValueError unless every targeted module has exactly the tensors its scheme implies, with their
    dtypes and shapes, and no other tensor looks quantized (``claimed``: tensors checked elsewhere, the MoE
    experts'). ``tensors``: ``{name: (safetensors dtype, shape)}``, a checkpoint's headers."""
    for name, t in targeted.items():
        s, n, k = t.scheme, t.out_features, t.in_features
        if s.block:
            scale_shape = [_limits.blocks(n), _limits.blocks(k)]
        else:
            scale_shape = [n, 1] if s.per_channel else [1]
        expect = {"weight": ((_ST_QUANT[s.quant_dtype],), [n, k]), "weight_scale": (_ST_SCALE, scale_shape)}
        if s.static_input:
            expect["input_scale"] = (_ST_SCALE, [1])
        for leaf, (dtypes, shape) in expect.items():
            key = f"{name}.{leaf}"
            if key not in tensors:
                raise ValueError(f"{where}: the checkpoint has no tensor {key!r}, which group {t.group!r} "
                                 "implies (tensors that transformers' conversion mapping does more to than rename, "
                                 "concatenated or split on load, are not supported)")
            dt, sh = tensors[key]
            if dt not in dtypes or list(sh) != shape:
                raise ValueError(f"{where}: checkpoint tensor {key!r} is {dt} {list(sh)}; group {t.group!r} implies "
                                 f"{' or '.join(dtypes)} {shape}")
    allowed = {f"{name}.{leaf}" for name, t in targeted.items()
               for leaf in ("weight", "weight_scale", "bias") + (("input_scale",) if t.scheme.static_input else ())}
    for key, (dt, _) in tensors.items():
        if key in allowed or key in claimed:
            continue
        module, _, leaf = key.rpartition(".")
        if module in targeted:
            raise ValueError(f"{where}: checkpoint tensor {key!r} is not part of group "
                             f"{targeted[module].group!r}'s scheme (zero points, packed weights, ... are not "
                             "supported)")
        if dt in _ST_8BIT or leaf.endswith(_QUANT_SUFFIXES):
            raise ValueError(f"{where}: checkpoint tensor {key!r} ({dt}) belongs to no targeted nn.Linear (MoE "
                             "experts merged by transformers, KV-cache scales and tensors its conversion mapping "
                             "concatenates or splits are not supported)")


def checkpoint_tensors(path: str) -> Dict[str, Tuple[str, list]]:
    """``{name: (safetensors dtype, shape)}`` of every tensor of the checkpoint at ``path`` (``model.safetensors``
    or the files of ``model.safetensors.index.json``), from the files' headers only."""
    return _SafetensorsCheckpoint(path).meta


class _SafetensorsCheckpoint:
    """The safetensors files of a checkpoint directory: each tensor's file, dtype and shape (headers only), and
    reads of single small tensors."""

    def __init__(self, path: str):
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(single):
            files = ["model.safetensors"]
        else:
            raise ValueError(f"{_WHERE}: {path!r} has neither model.safetensors nor model.safetensors.index.json "
                             "(only safetensors checkpoints are supported)")
        self.file_of: Dict[str, str] = {}
        self.meta: Dict[str, Tuple[str, list]] = {}
        #: ``{name in meta / file_of: name in the files}`` for the tensors `rename` named otherwise
        self.stored: Dict[str, str] = {}
        for fname in files:
            full = os.path.join(path, fname)
            with safe_open(full, framework="pt") as f:
                for k in f.keys():
                    sl = f.get_slice(k)
                    self.file_of[k] = full
                    self.meta[k] = (sl.get_dtype(), list(sl.get_shape()))

    def rename(self, view: Dict[str, str]) -> None:
        """Name the tensors of ``view`` (``{model's name: files' name}``, `cutlass_w8a8.checkpoints._names.
        model_view`) by the model's names in `meta` and `file_of`; `read` (and `_direct.Reader` given `stored`)
        still reads them under the files' names."""
        back = {k: new for new, k in view.items()}
        self.meta = {back.get(k, k): v for k, v in self.meta.items()}
        self.file_of = {back.get(k, k): v for k, v in self.file_of.items()}
        self.stored = {**{k: v for k, v in self.stored.items() if k not in back},
                       **{new: self.stored.get(k, k) for new, k in view.items()}}

    def check(self, targeted: Dict[str, Target], claimed=frozenset()) -> None:
        """`check_tensors` of this checkpoint's tensors."""
        check_tensors(self.meta, targeted, claimed, _WHERE)

    def read(self, keys):
        """``{key: tensor}`` in the stored dtype, on the CPU, opening each file once."""
        from safetensors import safe_open

        by_file = collections.defaultdict(list)
        for k in keys:
            by_file[self.file_of[k]].append(k)
        out = {}
        for fname, ks in by_file.items():
            with safe_open(fname, framework="pt") as f:
                for k in ks:
                    out[k] = f.get_tensor(self.stored.get(k, k))
        return out
