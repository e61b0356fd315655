"""``python -m cutlass_w8a8 quantize SRC DST``: a bf16 / fp16 Hugging Face checkpoint to a compressed-tensors W8A8
checkpoint, with `quantize_` and `save_pretrained`. Schemes (``--scheme``): ``int8`` / ``fp8`` (per-channel
weights, dynamic per-token activations; ``--dtype`` says the same), ``fp8-block`` (e4m3 weights in 128 x 128
blocks, dynamic 1 x 128 group activations: compressed-tensors' FP8_BLOCK; a linear whose K is not a multiple of
128 is left in float). The experts of Qwen2-MoE / Qwen3-MoE / Mixtral blocks become `W8A8MoE` layers, written
per expert as llm-compressor writes MoE checkpoints. The result loads with
`cutlass_w8a8.checkpoints.from_pretrained`, transformers and vLLM.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys
from typing import List, Optional

import torch

__all__ = ["main"]

_SCHEMES = ("int8", "fp8", "fp8-block")

# Files beside the weights that a quantized checkpoint needs to be used the same way (tokenizer, chat template,
# generation defaults); copied when present.
_AUX_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                 "chat_template.*", "generation_config.json", "preprocessor_config.json")


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


def main(argv: Optional[List[str]] = None) -> int:
    """Run the ``quantize`` command; ``argv`` without the program name, with or without the leading
    ``quantize``. Returns the exit status (0 on success, 1 when the source cannot be quantized)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["quantize"]:
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="python -m cutlass_w8a8 quantize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="Hugging Face checkpoint directory (float weights)")
    p.add_argument("dst", metavar="DST", help="output directory")
    p.add_argument("--scheme", choices=list(_SCHEMES), default=None,
                   help="int8 / fp8: per-channel weights, dynamic per-token activations; fp8-block: e4m3 128x128 "
                        "weight blocks, dynamic 1x128 activation groups (default: --dtype's)")
    p.add_argument("--dtype", choices=["int8", "fp8"], default=None,
                   help="quantized type of the per-channel schemes (default int8); the same as --scheme int8 / fp8")
    p.add_argument("--ignore", nargs="*", default=None, metavar="NAME",
                   help="linears left in float: module names or re: patterns (default: lm_head, as llm-compressor "
                        "checkpoints do; giving --ignore replaces the default)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to load and quantize")
    args = p.parse_args(argv)
    ignore = ["lm_head"] if args.ignore is None else args.ignore
    if args.scheme is not None and args.dtype is not None and (args.scheme, args.dtype) not in (
            ("int8", "int8"), ("fp8", "fp8"), ("fp8-block", "fp8")):
        p.error(f"--scheme {args.scheme} and --dtype {args.dtype} disagree")
    scheme = args.scheme or args.dtype or "int8"

    import transformers

    from ..config import W8A8Config
    from ..linear import W8A8Linear
    from ..moe import W8A8MoE
    from ..ops._limits import BLOCK_SIZE
    from ..quantize import quantize_
    from .load import check_device
    from .save import save_pretrained

    # what would fail only after the model is loaded and quantized, checked first
    where = "python -m cutlass_w8a8 quantize"
    if os.path.exists(args.dst) and not os.path.isdir(args.dst):
        print(f"{where}: DST {args.dst} is an existing file, not a directory; give a directory (it is created if "
              "missing)", file=sys.stderr)
        return 1
    try:
        check_device(where, args.device, "`--device`", "--device cpu")
    except (RuntimeError, ValueError) as e:
        print(e, file=sys.stderr)
        return 1
    try:
        with open(os.path.join(args.src, "config.json")) as f:
            cfg = json.load(f)
    except OSError as e:
        print(f"{where}: cannot read {args.src}/config.json: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # json.JSONDecodeError
        print(f"{where}: {os.path.join(args.src, 'config.json')} is not valid JSON: {e}; repair the file or "
              "download the checkpoint again", file=sys.stderr)
        return 1
    if not isinstance(cfg, dict):
        print(f"{where}: {os.path.join(args.src, 'config.json')} must hold a JSON object, got {type(cfg).__name__}",
              file=sys.stderr)
        return 1
    if cfg.get("quantization_config") or cfg.get("compression_config"):
        print(f"python -m cutlass_w8a8 quantize: {args.src} is already quantized; load it with "
              "cutlass_w8a8.checkpoints.from_pretrained", file=sys.stderr)
        return 1
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    stored = cfg.get("dtype") or cfg.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    dtype = torch.float16 if stored == "float16" else torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_pretrained(args.src, dtype=dtype, device_map=args.device)
    block = scheme == "fp8-block"
    config = W8A8Config(dtype=torch.int8 if scheme == "int8" else torch.float8_e4m3fn,
                        **({"weight_block_size": (BLOCK_SIZE, BLOCK_SIZE)} if block else {}))
    # block weights need K a multiple of 128 (the block GEMM's K granularity): other linears stay in float
    k_left = [fqn for fqn, m in model.named_modules()
              if block and type(m) is torch.nn.Linear and m.in_features % BLOCK_SIZE and not _ignored(fqn, ignore)]
    try:
        quantize_(model, config, filter_fn=lambda m, fqn: not _ignored(fqn, ignore) and fqn not in k_left)
    except TypeError as e:
        print(f"python -m cutlass_w8a8 quantize: {e}", file=sys.stderr)
        return 1
    n_q = sum(isinstance(m, W8A8Linear) for m in model.modules())
    n_moe = sum(isinstance(m, W8A8MoE) for m in model.modules())
    n_f = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    if n_q == 0 and n_moe == 0:
        print("python -m cutlass_w8a8 quantize: no linear was quantized (all ignored, or none with K and N "
              f"multiples of 16{', K a multiple of 128' if block else ''})", file=sys.stderr)
        return 1
    save_pretrained(model, args.dst)
    for pattern in _AUX_PATTERNS:
        for src in glob.glob(os.path.join(args.src, pattern)):
            dst = os.path.join(args.dst, os.path.basename(src))
            if os.path.isfile(src) and not os.path.exists(dst):
                shutil.copy2(src, dst)
    how = ("fp8 (e4m3 128x128 weight blocks, dynamic 1x128 activation groups)" if block else
           f"{scheme} (per-channel weights, dynamic per-token activations)")
    moe = f" and {n_moe} MoE experts modules (W8A8MoE)" if n_moe else ""
    print(f"{args.dst}: {n_q} linears{moe} quantized to {how}, {n_f} left in {dtype}" +
          (f" ({len(k_left)} with K not a multiple of {BLOCK_SIZE}: {', '.join(k_left[:4])}"
           f"{', ...' if len(k_left) > 4 else ''})" if k_left else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
