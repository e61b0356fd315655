"""``python -m cutlass_w8a8 quantize SRC DST``: a bf16 / fp16 Hugging Face causal-LM checkpoint to a
compressed-tensors W8A8 checkpoint, with `quantize_` and `save_pretrained`.

Schemes (``--scheme``): ``int8`` / ``fp8`` (per-channel weights, dynamic per-token activations; ``--dtype`` says
the same), ``fp8-block`` (e4m3 weights in 128 x 128 blocks, dynamic 1 x 128 group activations: compressed-tensors'
FP8_BLOCK; a linear whose K is not a multiple of 128 is left in float). The experts of the MoE blocks of
`cutlass_w8a8.moe.families` (Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4.5, OLMoE, ...) become `W8A8MoE`
layers, written per expert as llm-compressor writes MoE checkpoints.

What reads the output, per scheme and model family:

  model family                          int8            fp8             fp8-block
  Llama, Mistral, Qwen2, Qwen3 (dense)  ours, tf, vLLM  ours, tf, vLLM  ours, tf, vLLM
  Qwen2-MoE, Qwen3-MoE, Mixtral,
  DeepSeek-V3, GLM-4.5, OLMoE (MoE)     ours, vLLM      ours, tf, vLLM  ours, vLLM

  ours  cutlass_w8a8.from_pretrained(DST): W8A8Linear / W8A8MoE layers holding the stored 8-bit weights.
  tf    plain transformers, AutoModelForCausalLM.from_pretrained(DST), tested with transformers 5.17 and 5.24
        (compressed-tensors 0.19 / 0.20) on a CPU: no missing or unexpected keys; linears kept 8-bit and
        dequantized by compressed-tensors at run time, MoE experts dequantized to the model dtype on load.
        transformers cannot read int8 or fp8-block MoE experts (its compressed-tensors MoE conversion reads fp8
        per-channel experts only; int8 fails with "torch.cat(): expected a non-empty list of Tensors").
  vLLM  by format only, not tested here: compressed-tensors int-quantized / float-quantized W8A8 and FP8_BLOCK,
        MoE experts per expert as llm-compressor writes them, the format vLLM's compressed-tensors loader reads.

Safety. DST must not be SRC, nor lie inside it (nor SRC inside DST). An existing DST that is not empty is refused
unless --overwrite is given (and then it must hold a config.json: a checkpoint). The checkpoint is written into a
temporary directory beside DST, checked against what cutlass_w8a8.from_pretrained reads (config, tensor names,
dtypes and shapes; before and after writing), and renamed to DST at the end; with --overwrite the old DST is
replaced only then. A failed or interrupted run leaves no DST, or the old one. Refused before anything is
written: an MoE block other than the ones above, transformers Conv1D layers (GPT-2), weights the model needs that
SRC does not hold (a head transformers would initialize randomly: BERT read as BertLMHeadModel).

Exit status: 0 written and checked; 1 the source cannot be quantized or written (config.json unreadable or
already quantized, no linear to quantize, --device cuda without a usable GPU, the written checkpoint failed its
check); 2 refused: bad usage (arguments, DST equal to or inside SRC, a non-empty DST without --overwrite, a
--device that is no device) or an unsupported model (MoE block, Conv1D, weights missing from SRC).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys
import tempfile
from typing import List, Optional

import torch

__all__ = ["main", "FAMILIES", "TRANSFORMERS_READS", "TRANSFORMERS_TESTED", "EXIT_OK", "EXIT_FAILED",
           "EXIT_REFUSED"]

_SCHEMES = ("int8", "fp8", "fp8-block")
_WHERE = "python -m cutlass_w8a8 quantize"

#: exit status: written and checked / cannot quantize or write / refused (usage or unsupported model)
EXIT_OK, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2

#: the model families of the table in the module docstring (and docs/LOADERS.md), by group
FAMILIES = {"dense": ("Llama", "Mistral", "Qwen2", "Qwen3"),
            "MoE": ("Qwen2-MoE", "Qwen3-MoE", "Mixtral", "DeepSeek-V3", "GLM-4.5", "OLMoE")}
#: the schemes plain transformers reads, per family group (tests/checkpoints/test_checkpoints_loaders_cpu.py checks each cell)
TRANSFORMERS_READS = {"dense": ("int8", "fp8", "fp8-block"), "MoE": ("fp8",)}
#: the transformers versions those claims were tested with
TRANSFORMERS_TESTED = ("5.17", "5.24")

# Files beside the weights that a quantized checkpoint needs to be used the same way (tokenizer, chat template,
# generation defaults); copied when present.
_AUX_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                 "chat_template.*", "generation_config.json", "preprocessor_config.json")


class _Stop(Exception):
    """Stop with exit status ``status`` (`EXIT_REFUSED` unless given), the message printed to stderr."""

    def __init__(self, message: str, status: int = EXIT_REFUSED):
        super().__init__(message)
        self.status = status


def _ignored(fqn: str, patterns: List[str]) -> bool:
    """Whether ``fqn`` is named by ``patterns``: exact module names, or ``re:`` regexes matched from the start
    (compressed-tensors' ``ignore`` semantics)."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], fqn):
                return True
        elif p == fqn:
            return True
    return False


def _inside(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it (real paths: links resolved)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _check_paths(src: str, dst: str, overwrite: bool) -> None:
    """The refusals about SRC and DST, before anything is read (`_Stop`)."""
    if os.path.isfile(src):
        raise _Stop(f"{_WHERE}: SRC {src} is a file; pass the folder that holds config.json")
    if _inside(dst, src):
        same = os.path.realpath(dst) == os.path.realpath(src)
        raise _Stop(f"{_WHERE}: DST {dst} {'is SRC' if same else 'lies inside SRC'} {src}; writing there would "
                       "overwrite or mix with the source checkpoint: give another DST")
    if os.path.exists(dst) and _inside(src, dst):
        raise _Stop(f"{_WHERE}: SRC {src} lies inside DST {dst}; give a DST outside the source")
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise _Stop(f"{_WHERE}: DST {dst} is an existing file, not a directory; give a directory (it is created "
                       "if missing)")
    if os.path.isdir(dst) and os.listdir(dst):
        if not overwrite:
            raise _Stop(f"{_WHERE}: DST {dst} exists and is not empty; give a new or empty directory, or "
                           "--overwrite to replace it (once the new checkpoint is complete)")
        if not os.path.isfile(os.path.join(dst, "config.json")):
            raise _Stop(f"{_WHERE}: DST {dst} is not empty and holds no config.json: --overwrite replaces a "
                           "checkpoint directory only; give a new or empty directory")


def _check_architecture(model, ignore: List[str]) -> None:
    """Refuse (`_Stop`) what `quantize_` and the checkpoint cannot handle, before quantizing: transformers'
    Conv1D layers (GPT-2 family: not nn.Linear, weight stored [K, N]) and MoE experts modules (3-D expert
    parameters, `cutlass_w8a8.moe.families.expert_parameters`) that are not the ``experts`` of a block of
    `cutlass_w8a8.moe.families.FAMILIES`."""
    from ..moe.families import block_classes, expert_parameters, family_names, family_of

    conv = [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D" and not _ignored(n, ignore)]
    if conv:
        raise _Stop(f"{_WHERE}: {type(model).__name__} holds {len(conv)} transformers Conv1D layers "
                       f"({', '.join(conv[:3])}{', ...' if len(conv) > 3 else ''}): Conv1D (GPT-2's linear layer, "
                       "weight stored [K, N]) is not supported; cutlass_w8a8 quantizes nn.Linear layers only")
    for name, m in model.named_modules():
        params = expert_parameters(m)
        if not params:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if child == "experts" and family_of(parent) is not None:
            continue
        block = (f"MoE block {parent_name!r} ({type(parent).__name__})" if child == "experts" else
                 f"MoE experts module {name!r} ({type(m).__name__})")
        raise _Stop(f"{_WHERE}: {block} is not supported: its experts ({name!r}, {type(m).__name__}, 3-D "
                       f"{', '.join(params)}) would stay in float and the checkpoint would not load; supported MoE "
                       f"blocks: {', '.join(block_classes())} ({family_names()})")


def _read_config(src: str) -> dict:
    try:
        with open(os.path.join(src, "config.json")) as f:
            cfg = json.load(f)
    except OSError as e:
        raise _Stop(f"{_WHERE}: cannot read {src}/config.json: {e}", EXIT_FAILED) from None
    except ValueError as e:  # json.JSONDecodeError
        raise _Stop(f"{_WHERE}: {os.path.join(src, 'config.json')} is not valid JSON: {e}; repair the file or "
                       "download the checkpoint again", EXIT_FAILED) from None
    if not isinstance(cfg, dict):
        raise _Stop(f"{_WHERE}: {os.path.join(src, 'config.json')} must hold a JSON object, got "
                       f"{type(cfg).__name__}", EXIT_FAILED)
    if cfg.get("quantization_config") or cfg.get("compression_config"):
        raise _Stop(f"{_WHERE}: {src} is already quantized; load it with cutlass_w8a8.checkpoints.from_pretrained",
                       EXIT_FAILED)
    return cfg


def _write(model, src: str, dst: str) -> None:
    """`save_pretrained` into a temporary directory beside ``dst``, the auxiliary files copied in, then renamed to
    ``dst`` (an existing ``dst`` replaced only then). Nothing is left behind on failure or interrupt."""
    from .write import save_pretrained

    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(dst))}.quantize-", dir=parent)
    out, old = os.path.join(work, "checkpoint"), os.path.join(work, "old")
    try:
        save_pretrained(model, out)
        for pattern in _AUX_PATTERNS:
            for f in glob.glob(os.path.join(src, pattern)):
                target = os.path.join(out, os.path.basename(f))
                if os.path.isfile(f) and not os.path.exists(target):
                    shutil.copy2(f, target)
        if os.path.isdir(dst):
            os.rename(dst, old)  # the old DST (a checkpoint, or empty) out of the way ...
            try:
                os.rename(out, dst)  # ... and the new one in its place
            except BaseException:
                os.rename(old, dst)
                raise
        else:
            os.rename(out, dst)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=_WHERE, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="Hugging Face checkpoint directory (float weights)")
    p.add_argument("dst", metavar="DST", help="output directory: new, empty, or (with --overwrite) a checkpoint to "
                                              "replace; not SRC nor inside it")
    p.add_argument("--scheme", choices=list(_SCHEMES), default=None,
                   help="int8 / fp8: per-channel weights, dynamic per-token activations; fp8-block: e4m3 128x128 "
                        "weight blocks, dynamic 1x128 activation groups (default: --dtype's)")
    p.add_argument("--dtype", choices=["int8", "fp8"], default=None,
                   help="quantized type of the per-channel schemes (default int8); the same as --scheme int8 / fp8")
    p.add_argument("--ignore", nargs="*", default=None, metavar="NAME",
                   help="linears left in float: module names or re: patterns (default: lm_head, as llm-compressor "
                        "checkpoints do; giving --ignore replaces the default)")
    p.add_argument("--device", default="cpu", metavar="DEVICE",
                   help="where to load and quantize: cpu (default), cuda or cuda:N")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing non-empty DST checkpoint (only once the new one is complete)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Run the ``quantize`` command; ``argv`` without the program name, with or without the leading
    ``quantize``. Returns the exit status: `EXIT_OK` (0), `EXIT_FAILED` (1: the source cannot be quantized or
    written), `EXIT_REFUSED` (2: bad usage or an unsupported model; argparse's own errors exit 2 too)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["quantize"]:
        argv = argv[1:]
    p = _parser()
    args = p.parse_args(argv)
    if args.scheme is not None and args.dtype is not None and (args.scheme, args.dtype) not in (
            ("int8", "int8"), ("fp8", "fp8"), ("fp8-block", "fp8")):
        p.error(f"--scheme {args.scheme} and --dtype {args.dtype} disagree")
    try:
        return _run(args)
    except _Stop as e:
        print(e, file=sys.stderr)
        return e.status


def _run(args) -> int:
    ignore = ["lm_head"] if args.ignore is None else args.ignore
    scheme = args.scheme or args.dtype or "int8"

    from ._files import check_device, refuse_missing_weights

    # what would fail only after the model is loaded and quantized, checked first
    _check_paths(args.src, args.dst, args.overwrite)
    try:
        check_device(_WHERE, args.device, "`--device`", "--device cpu")
    except ValueError as e:
        raise _Stop(str(e)) from None
    except RuntimeError as e:
        raise _Stop(str(e), EXIT_FAILED) from None
    cfg = _read_config(args.src)

    import transformers

    from ..config import W8A8Config
    from ..linear import W8A8Linear
    from ..moe import W8A8MoE
    from ..ops._limits import BLOCK_SIZE
    from ..quantize import quantize_

    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    stored = cfg.get("dtype") or cfg.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    dtype = torch.float16 if stored == "float16" else torch.bfloat16
    model, info = transformers.AutoModelForCausalLM.from_pretrained(args.src, dtype=dtype, device_map=args.device,
                                                                    output_loading_info=True)
    try:
        refuse_missing_weights(_WHERE, model, info, args.src, "quantize a causal-LM checkpoint that stores them")
    except ValueError as e:
        raise _Stop(str(e)) from None
    _check_architecture(model, ignore)
    block = scheme == "fp8-block"
    config = W8A8Config(dtype=torch.int8 if scheme == "int8" else torch.float8_e4m3fn,
                        **({"weight_block_size": (BLOCK_SIZE, BLOCK_SIZE)} if block else {}))
    # block weights need K a multiple of 128 (the block GEMM's K granularity): other linears stay in float
    k_left = [fqn for fqn, m in model.named_modules()
              if block and type(m) is torch.nn.Linear and m.in_features % BLOCK_SIZE and not _ignored(fqn, ignore)]
    try:
        quantize_(model, config, filter_fn=lambda m, fqn: not _ignored(fqn, ignore) and fqn not in k_left)
    except TypeError as e:
        raise _Stop(f"{_WHERE}: {e}", EXIT_FAILED) from None
    n_q = sum(isinstance(m, W8A8Linear) for m in model.modules())
    n_moe = sum(isinstance(m, W8A8MoE) for m in model.modules())
    n_f = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    if n_q == 0 and n_moe == 0:
        raise _Stop(f"{_WHERE}: no linear was quantized (all ignored, or none with K and N multiples of 16"
                       f"{', K a multiple of 128' if block else ''})", EXIT_FAILED)
    try:
        _write(model, args.src, args.dst)
    except ValueError as e:  # the checkpoint would not load back: nothing written
        raise _Stop(f"{_WHERE}: {e}", EXIT_FAILED) from None
    except OSError as e:  # a directory that cannot be written: nothing left behind either
        raise _Stop(f"{_WHERE}: cannot write {args.dst}: {e}", EXIT_FAILED) from None
    how = ("fp8 (e4m3 128x128 weight blocks, dynamic 1x128 activation groups)" if block else
           f"{scheme} (per-channel weights, dynamic per-token activations)")
    moe = f" and {n_moe} MoE experts modules (W8A8MoE)" if n_moe else ""
    print(f"{args.dst}: {n_q} linears{moe} quantized to {how}, {n_f} left in {dtype}" +
          (f" ({len(k_left)} with K not a multiple of {BLOCK_SIZE}: {', '.join(k_left[:4])}"
           f"{', ...' if len(k_left) > 4 else ''})" if k_left else ""))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
