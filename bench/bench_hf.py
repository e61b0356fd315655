"""Decode benchmark on a transformers ``LlamaForCausalLM``: bf16 vs W8A8 (int8, fp8, block fp8), each W8A8 model
as ``quantize_`` leaves it and after ``cutlass_w8a8.optimize_`` (``-opt``), eager vs ``torch.compile`` vs
``cutlass_w8a8.generate``'s CUDA-graph decode step (``graph``), with each path's warm-up time.

The model is transformers' own Llama (``LlamaForCausalLM``, sdpa attention) with Llama-3-8B dimensions (vocab
128256, hidden 4096, MLP 14336, 32 layers, 32 query / 8 key-value heads, rope_theta 500000), built from a local
config with random weights (nothing is downloaded): bf16, once, on the device (seeded ``normal_``, std 0.02;
norms 1). The W8A8 models are copies of it swapped in place by
``cutlass_w8a8.quantize_(copy, W8A8Config(dtype=...), filter_fn=lambda m, fqn: "lm_head" not in fqn)``: every
projection of every layer becomes a `W8A8Linear` (per-channel weights, dynamic per-token activations; ``fp8-block``:
128 x 128 weight blocks, 1 x 128 activation groups, sm90 only); the embedding and ``lm_head`` stay bf16, as
llm-compressor's W8A8 checkpoints leave them, and are shared with the bf16 model (not copied: 8 W8A8 copies of
Llama-3-8B must fit on one GPU). The ``-opt`` models are further copies passed through ``cutlass_w8a8.optimize_``:
fused q/k/v and gate/up GEMMs, RMSNorm and SiLU*mul fused with the activation quantization.

Decode step (one new token for each of the ``B`` sequences; its time is the per-token latency)::

    model(input_ids=(B, 1), past_key_values=cache, position_ids=(B, 1), attention_mask=(B, 1, 1, S) bool,
          use_cache=True)

on a transformers ``StaticCache`` (``--max-cache-len`` positions) prefilled eagerly with a ``--prompt-len`` token
prompt. transformers 5.x has no ``cache_position`` argument any more: the ``StaticCache`` keeps its own length in
a device tensor (so compiled steps do not recompile as it grows) and the step passes ``position_ids``. Attention
is transformers' sdpa over the whole static cache with the mask ``generate`` would build (the written columns),
passed as a fixed-shape 4-D bool mask, which transformers uses as it is; the same in every mode. (Without a mask,
transformers skips masking for one query token and attends to every column of the static cache, the unwritten
ones included: runs before issue 28 timed that.)

- ``eager``: ``model.forward`` as is.
- ``compiled``: transformers' documented recipe for a static cache,
  ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`` (inductor; CUDA graphs replayed by
  cudagraph trees), with ``dynamic=False`` so that each (model, batch) gets its own static graph (without it
  dynamo's automatic dynamic shapes would recompile the second batch size with a symbolic batch). Only the
  decode step is compiled: the prefill runs the uncompiled forward. One compile per (model, batch), and
  ``torch.compiler.cudagraph_mark_step_begin()`` before each compiled step (one inference step per call).
- ``graph``: ``cutlass_w8a8.hf.GraphGenerator(model, max_cache_len=..., sizes=[B], step=--graph-step)``: a decode
  step captured eagerly into a CUDA graph by ``cutlass_w8a8.graphs.capture`` (no torch.compile), static inputs
  written with ``copy_``, replayed; prefilled eagerly through ``model.forward``. Its step (``gen.step``, recorded per
  model and batch as "graph step", with ``gen.step_reason`` where ``step="auto"`` fell back): ``cw``, the package's
  decoder-layer code over the ``optimize_``d model's fused modules (split-KV decode attention, fused rope + KV
  write, on a KV cache of its own), or ``transformers``, the same ``model.forward`` call as above on a StaticCache.
  (A cutlass_w8a8 whose ``GraphGenerator`` has no ``step=`` runs the transformers step, recorded as such.)

``--config qwen3-30b-a3b`` (issue 36) times transformers' ``Qwen3MoeForCausalLM`` instead, built from a
``Qwen3MoeConfig`` with Qwen3-30B-A3B's dimensions (`qwen3_moe_config`: those of the model's config.json on the Hub,
owned by ``cutlass_w8a8.models.QWEN3_30B_A3B``: hidden 2048, 48 layers, 32 / 4 heads x 128, 128 experts of
``moe_intermediate_size`` 768, top-8, ``norm_topk_prob`` True, vocab 151936, rope_theta 1e6), random weights
(the experts' ``(E, N, K)`` tensors and the routers drawn like the other matrices). ``quantize_`` turns its
projections into `W8A8Linear` and its experts into `W8A8MoE`; the routers stay bf16. ``optimize_`` fuses the
attention side of its layers, and ``GraphGenerator(step="auto")`` runs the ``-opt`` models on the package's step
(``hf.DecodeStep``, whose MoE MLP is the block's router, ``moe_route`` and the `W8A8MoE`): the report names the step
of every graph row and in the target line. Layers: by default as many of the 48 as fit beside the bf16 copy
(`fit_layers`: the bf16 weights + every W8A8 copy + the KV caches, counted per layer by `layer_bytes` on a meta
model, within ``FIT_FRACTION`` = 85% of the GPU's free memory at the start; on an H200, ~139 GiB free: bf16 1.16 GiB
per layer + 0.58 GiB per W8A8 copy, so bf16 with one or two W8A8 models takes all 48 layers, with three 40, with six
25); a rule rather than a fixed 24 because the issue asks for as many layers as fit and the count depends on the
models asked for. Its files are ``hf_decode_qwen3-30b-a3b[_<tag>]_<device>.*`` and its one target is issue 36's:
each ``-opt`` model's graph path >= 2.5x bf16 compiled at batch 1 (the Llama targets are not shown for it).

``--config glm-4.5-air`` times transformers' ``Glm4MoeForCausalLM`` at GLM-4.5-Air's dimensions (`glm45_air_config`:
`cutlass_w8a8.testing.model_dims.GLM_45_AIR`, shared with bench/_moe_block.py: hidden 4096, 46 layers, 96 / 8 heads
x 128 with q / k / v bias and rope over half of each head, the first layer dense (10944), then 128 experts of 1408 + 1
shared expert, top-8, sigmoid routing from a float32 router), random weights (biases drawn like the matrices), layers
by the same fit rule. ``optimize_`` fuses its attention, its dense MLP and its shared experts, and ``step="auto"``
runs the ``-opt`` models on ``hf.DecodeStep``. No target is set for it (the report has the measurements only); our
reference decoder (``--decoder``) has no GLM layers.

``--decoder`` adds, in graph mode, the package's own reference decoder (``decoder int8 (cutlass_w8a8.models)``):
``cutlass_w8a8.models.LlamaDecoder(config, quant="int8", max_batch=max(--batches), max_seq_len=--max-cache-len
rounded up to a multiple of 16, device="cuda", dtype=torch.bfloat16)`` at the same dimensions and layers (random
weights of its own seed; its embedding and ``lm_head`` are replaced by the bf16 model's, the same shapes, so that
they are not held twice), its decode step captured by ``cutlass_w8a8.runner.DecodeGraphRunner(model, max_batch=B,
sizes=[B])`` (as bench/bench_decoder.py does) and fed device inputs. Its prefill is the prompt fed through the step
token by token (the decoder has no prefill op) after zeroing the cache, so its timed steps run at the same positions
as the transformers models'. It is timed interleaved with the other variants of the batch, and each ``-opt`` model's
graph path is judged against it (issue 28: within 1.1x of our decoder's graph step, same run). Checked: its graph
replay against its eager step (``DecodeGraphRunner.step(..., use_graph=False)``) on the check tokens.

Warm-up: per (model, batch, mode), the seconds from the path's first use to the first decode token: eager, the
prefill and first step; compiled, the prefill and the first step, which compiles (its CUDA graph is recorded on
the second step: "graphs replay after" adds it); graph, the bucket's creation (StaticCache, warm-up, capture) and
then the prefill and the first replay.

Eager and compiled of one (model, batch) share one ``StaticCache``. Checks, per (model, batch), on fixed tokens
that are the same for every model: ``--check-steps`` decode steps after the prefill, eager, then again compiled
after a reset and the same prefill (the compile happens on the first of them, the CUDA graph is recorded on the
second and replayed after), then through the graph path. Reported: the SQNR (dB) of the last step's logits against
the bf16 model's eager logits on the same tokens, and, for the compiled and graph steps, the SQNR and max abs
difference of their logits against the same model's eager ones (sanity gates, `COMPILED_MIN_SQNR_DB` /
`GRAPH_MIN_SQNR_DB`: the worst step counts; see there why the random 32-layer model's logits are no accuracy
measure; the graph path replays the eager kernels and is expected equal).

Timing: all the variants of one batch (models x modes) are built, compiled and warmed up first; then
``--reps`` repetitions go round-robin over them (repetition i of every variant before repetition i + 1 of any),
so that they run under the same clocks. One repetition of a variant: cache reset, eager prefill (untimed), then
``--steps`` decode steps between two CUDA events (host launches included: what the eager mode pays and the
CUDA graphs remove), on fixed device inputs; ms/token = elapsed / steps. Reported: the median over the
repetitions (min and max in the JSON).

``--tiny`` runs the same flow on the CPU (the ops' CPU reference implementations) with a tiny config, eager
only unless ``--compile``: it exercises the code (CI runs it), its times are not measurements of anything.

Writes ``hf_decode[_<tag>]_<device>.json`` (raw numbers), ``.md`` (tables, naming the device) and ``.png`` (latency
and speedups; left out, with a note, where matplotlib is not installed) to ``--out``. ``<tag>``: ``--tag``, else
``b`` and the batches (``b1``, ``b8``, ``b1-2``) unless they are the default 1 and 8 (then none), so that runs of
one batch each do not overwrite each other. A variant whose check raises (a failed compile, say)
is recorded with its error and left out of the timing; the others still run. Exits 1 when a check failed or a
variant raised (the outputs are written first), 2 when it cannot run.

Examples::

    python bench/bench_hf.py                      # 32 layers, batch 1 and 8, all 7 models, eager / compiled / graph
    python bench/bench_hf.py --quick              # 2 layers, bf16,int8,int8-opt,fp8-opt,fp8-block-opt, 3 x 12 steps:
                                                  # the flow and a first look in ~2 minutes (ratios not the 8B's)
    python bench/bench_hf.py --batches 1 --dtypes bf16,int8-opt --no-compile
    python bench/bench_hf.py --batches 1 --dtypes bf16,int8-opt,fp8-opt,fp8-block-opt --decoder
                                                  # writes hf_decode_b1_<device>.*; --batches 8: hf_decode_b8_*
    python bench/bench_hf.py --tiny --out /tmp/hf # CPU, tiny config: the flow only, no timing claims
    python bench/bench_hf.py --config qwen3-30b-a3b --batches 1 --dtypes bf16,int8-opt
                                                  # issue 36: 48 layers on an H200 (the fit rule);
                                                  # writes hf_decode_qwen3-30b-a3b_b1_<device>.*
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import inspect
import os
import re
import sys
import tempfile
import time
import traceback
from typing import Any, Optional

import torch

from cutlass_w8a8.testing.cli import int_list, name_list
from cutlass_w8a8.testing.hf_decode_report import (
    COMPILED_MIN_SQNR_DB, DECODER, GRAPH_MIN_SQNR_DB, MODELS, MODES, W8A8_MIN_SQNR_DB, _size,
    apply_gates, derive, recheck, render_markdown, targets_vs_decoder, write_outputs)
from cutlass_w8a8.testing.hf_decode_steps import (
    GraphPoint, Point, Timer, check_mode, sqnr_db, step_inputs, time_interleaved)
from cutlass_w8a8.testing.report import cuda_extension_missing

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (dtype, weight_block_size) of each W8A8 model; "-opt" models are the same after optimize_
QUANT = {"int8": (torch.int8, None), "fp8": (torch.float8_e4m3fn, None),
         "fp8-block": (torch.float8_e4m3fn, (128, 128))}
QUICK_MODELS = ["bf16", "int8", "int8-opt", "fp8-opt", "fp8-block-opt"]
# GraphGenerator(step=...): "auto" picks the package's decoder-layer step ("cw") where the model supports it
GRAPH_STEPS = ("auto", "cw", "transformers")
# MODELS, MODES, the speedup and warm-up TARGETS, the logits gates (COMPILED_MIN_SQNR_DB, GRAPH_MIN_SQNR_DB,
# W8A8_MIN_SQNR_DB), and --decoder's row name DECODER and bound DECODER_WITHIN (each -opt model's graph ms/token
# <= 1.1 x our decoder's graph step, same run; `targets_vs_decoder`) are defined, with the reasons for their values,
# in cutlass_w8a8/testing/hf_decode_report.py, which applies them and renders the report.


# ----------------------------------------------------------------------------------------------------
# command line


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Per-token decode latency and warm-up of transformers' LlamaForCausalLM (Llama-3-8B "
                    "dimensions, random weights; --config qwen3-30b-a3b: Qwen3MoeForCausalLM; --config glm-4.5-air: "
                    "Glm4MoeForCausalLM): bf16 vs W8A8 int8 / fp8 / fp8-block (cutlass_w8a8.quantize_, and "
                    "after cutlass_w8a8.optimize_: -opt), eager vs torch.compile (reduce-overhead, fullgraph) vs "
                    "cutlass_w8a8.generate's CUDA-graph step, on a StaticCache.")
    parser.add_argument("--batches", type=int_list(), default=[1, 8], metavar="LIST",
                        help="comma-separated batch sizes (default: 1,8)")
    parser.add_argument("--dtypes", type=name_list(MODELS, ordered=True), default=None, metavar="LIST",
                        help=f"models among {','.join(MODELS)} (default: all; with --quick "
                             f"{','.join(QUICK_MODELS)}; without bf16 there are no speedups and no SQNR against it)")
    parser.add_argument("--config", choices=list(CONFIGS), default="llama3-8b",
                        help="model: llama3-8b (default: LlamaForCausalLM at Llama-3-8B dims), qwen3-30b-a3b "
                             "(Qwen3MoeForCausalLM at Qwen3-30B-A3B dims: 128 experts of 768, top-8; experts become "
                             "W8A8MoE, routers stay bf16) or glm-4.5-air (Glm4MoeForCausalLM at GLM-4.5-Air dims: "
                             "128 experts of 1408 + 1 shared, top-8, partial rotary; its router stays float32); its "
                             "name goes into the report's title and file names")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default: llama3-8b 32; qwen3-30b-a3b / glm-4.5-air as many of their "
                             "48 / 46 as fit beside "
                             f"the bf16 copy: the bf16 weights, each W8A8 copy's and the KV caches within "
                             f"{FIT_FRACTION} of the GPU's free memory; 2 with --quick or --tiny)")
    parser.add_argument("--quick", action="store_true",
                        help="2 layers (unless --layers), 5 models, fewer repetitions: about 2 minutes on an H100 "
                             "(each compile takes seconds instead of 35-44 s); the report says the ratios are not "
                             "the 32-layer model's")
    parser.add_argument("--no-compile", action="store_true", help="no torch.compile mode")
    parser.add_argument("--no-graph", action="store_true", help="no cutlass_w8a8.generate graph mode")
    parser.add_argument("--graph-step", choices=GRAPH_STEPS, default="auto",
                        help="GraphGenerator's step= (default auto: cw for the -opt models, transformers for the "
                             "others; cw raises for a model it cannot run, recorded as that variant's error); the "
                             "step each graph ran is reported")
    parser.add_argument("--decoder", action="store_true",
                        help="also time the package's own decoder (cutlass_w8a8.models.LlamaDecoder, int8, same dims "
                             "and layers) captured by DecodeGraphRunner, in graph mode, and judge each -opt model's "
                             "graph path against it (within 1.1x); about 7 GiB more at 32 layers")
    parser.add_argument("--tag", default=None,
                        help="file-name tag: hf_decode_<tag>_<device>.* (default: b<batches>, e.g. b1 or b8, none for "
                             "the default 1,8); letters, digits, '.', '_', '-'")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU, tiny config (hidden 64): runs the flow on the ops' CPU reference "
                             "implementations, eager only unless --compile; no timing claims")
    parser.add_argument("--compile", action="store_true",
                        help="with --tiny: compile on the CPU too (inductor, no CUDA graphs; slow)")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed repetitions per variant, interleaved (default 7; 3 with --quick, 2 with --tiny)")
    parser.add_argument("--steps", type=int, default=None,
                        help="decode steps per repetition (default 24; 12 with --quick, 4 with --tiny)")
    parser.add_argument("--check-steps", type=int, default=5,
                        help="decode steps of the correctness check, >= 3 (compile, graph record, replays; "
                             "default 5)")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens, prefilled eagerly (default 32)")
    parser.add_argument("--max-cache-len", type=int, default=256,
                        help="StaticCache length (default 256); attention reads all of it every step")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="output folder for hf_decode[_<tag>]_<device>.{json,md,png} (default: bench/results; "
                             "with --tiny a folder under the system temp dir)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the tokens")
    parser.add_argument("--recheck", metavar="JSON", default=None,
                        help="measure nothing: re-evaluate the logits checks of a results file with this script's "
                             "gates and write its json/md/png again to --out (the measured values are kept)")
    args = parser.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be >= 1")
    if args.compile and not args.tiny:
        parser.error("--compile only applies to --tiny (the GPU run compiles unless --no-compile)")
    if args.check_steps < 3:
        parser.error("--check-steps must be >= 3 (the compiled steps: compile + warm-up, CUDA graph record, replay)")
    if args.decoder and args.no_graph:
        parser.error("--decoder times our decoder in graph mode and compares the graph paths with it: drop --no-graph")
    if args.tag is not None and not re.fullmatch(r"[A-Za-z0-9._-]*", args.tag):
        parser.error(f"--tag may hold letters, digits, '.', '_' and '-' only, got {args.tag!r}")
    # None: a "fit" config's default, resolved on the GPU by `fit_layers` (run)
    args.layers_given = args.layers is not None
    default = CONFIGS[args.config]["default_layers"]
    args.layers = args.layers or (2 if args.tiny or args.quick else None if default == "fit" else default)
    args.reps = args.reps if args.reps is not None else (2 if args.tiny else 3 if args.quick else 7)
    args.steps = args.steps if args.steps is not None else (4 if args.tiny else 12 if args.quick else 24)
    if args.dtypes is None:
        args.dtypes = list(QUICK_MODELS if args.quick else MODELS)
    if args.reps < 1 or args.steps < 1:
        parser.error("--reps and --steps must be >= 1")
    if args.prompt_len < 1 or args.max_cache_len < args.prompt_len + max(args.steps, args.check_steps):
        parser.error("--max-cache-len must hold --prompt-len + max(--steps, --check-steps) positions")
    args.batches = sorted(set(args.batches))
    args.tag_given = args.tag is not None
    args.tag = file_tag(args.batches) if args.tag is None else args.tag
    args.modes = [m for m in MODES if not ((m == "compiled" and (args.no_compile or (args.tiny and not args.compile)))
                                           or (m == "graph" and args.no_graph))]
    if args.out is None:
        args.out = (os.path.join(tempfile.gettempdir(), "cutlass_w8a8_bench_hf") if args.tiny
                    else os.path.join(REPO_ROOT, "bench", "results"))
    return args


def file_tag(batches: list[int]) -> str:
    """The default file-name tag: ``""`` for the default batches 1 and 8, else ``"b"`` and the batches joined by
    ``-`` (``[1] -> "b1"``, ``[1, 2] -> "b1-2"``)."""
    return "" if list(batches) == [1, 8] else "b" + "-".join(str(b) for b in batches)


def results_prefix(tag: str, config: str = "llama3-8b") -> str:
    """``hf_decode[_<config>][_<tag>]``: the files are ``<prefix>_<device slug>.{json,md,png}``; the config's name
    is left out for llama3-8b (the script's original files keep their names)."""
    return "_".join(["hf_decode"] + ([config] if config != "llama3-8b" else []) + ([tag] if tag else []))


# ----------------------------------------------------------------------------------------------------
# models


def llama_config(transformers: Any, tiny: bool, layers: int):
    """Llama-3-8B dimensions (or a tiny model whose linears are all multiples of 16) with ``layers`` layers."""
    if tiny:  # K and N multiples of 128: block fp8 and its fused q/k/v need them
        dims = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                    num_key_value_heads=4, head_dim=32, max_position_embeddings=512)
    else:
        dims = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                    num_key_value_heads=8, max_position_embeddings=8192)
    return transformers.LlamaConfig(num_hidden_layers=layers, rope_parameters={"rope_type": "default",
                                                                                "rope_theta": 500000.0},
                                    tie_word_embeddings=False, rms_norm_eps=1e-5, **dims)


def qwen3_moe_config(transformers: Any, tiny: bool, layers: int):
    """A transformers ``Qwen3MoeConfig`` with Qwen3-30B-A3B's dimensions and ``layers`` layers, or a tiny one.

    The dimensions are `cutlass_w8a8.models.QWEN3_30B_A3B`'s (their one owner), which are those of the model's
    config.json on the Hub (https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json): ``hidden_size``
    2048, ``num_hidden_layers`` 48, ``num_attention_heads`` 32, ``num_key_value_heads`` 4, ``head_dim`` 128,
    ``num_experts`` 128, ``moe_intermediate_size`` 768, ``num_experts_per_tok`` 8, ``norm_topk_prob`` true,
    ``decoder_sparse_step`` 1, ``mlp_only_layers`` [], ``vocab_size`` 151936, ``rope_theta`` 1000000.0,
    ``rms_norm_eps`` 1e-06, ``max_position_embeddings`` 40960, ``tie_word_embeddings`` false (``intermediate_size``
    6144 is unused: every layer is sparse). ``head_dim`` is passed explicitly: 32 x 128 is not the hidden size.
    Tiny (``tiny``): hidden 128, 4 query and 4 key/value heads of 32, 8 experts of width 128, top-2, vocab 256 (every
    K and N a multiple of 128: block fp8 and the fused q/k/v apply)."""
    from cutlass_w8a8.models import QWEN3_30B_A3B as d

    if tiny:
        dims = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                    num_key_value_heads=4, head_dim=32, max_position_embeddings=512, num_experts=8,
                    num_experts_per_tok=2, moe_intermediate_size=128)
    else:
        dims = dict(vocab_size=d.vocab_size, hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
                    num_attention_heads=d.num_heads, num_key_value_heads=d.num_kv_heads, head_dim=d.head_dim,
                    max_position_embeddings=d.max_position, num_experts=d.num_experts,
                    num_experts_per_tok=d.num_experts_per_tok, moe_intermediate_size=d.moe_intermediate_size)
    return transformers.Qwen3MoeConfig(
        num_hidden_layers=layers, rope_parameters={"rope_type": "default", "rope_theta": d.rope_theta},
        rms_norm_eps=d.rms_norm_eps, norm_topk_prob=d.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
        use_sliding_window=False, tie_word_embeddings=False, **dims)


def glm45_air_config(transformers: Any, tiny: bool, layers: int):
    """A transformers ``Glm4MoeConfig`` with GLM-4.5-Air's dimensions and ``layers`` layers, or a tiny one.

    The dimensions are `cutlass_w8a8.testing.model_dims.GLM_45_AIR`'s (their one owner, shared with
    bench/_moe_block.py's ``glm-4.5-air`` block; its docstring cites the model's config.json on the Hub): hidden 4096,
    46 layers, 96 query / 8 key-value heads of 128, 128 routed experts of 1408 + 1 shared expert, top-8, ``n_group``
    1, ``topk_group`` 1, ``routed_scaling_factor`` 1.0, the first layer dense (intermediate 10944), q / k / v bias, no
    q / k norms, rope_theta 1e6 over half of each head (``partial_rotary_factor`` 0.5). Tiny (``tiny``): hidden 128,
    4 query and 4 key/value heads of 32 (16 of them rotated), 8 experts of width 128 + 1 shared, top-2, dense
    intermediate 256, vocab 256 (every K and N a multiple of 128: block fp8 and the fused q/k/v apply)."""
    from cutlass_w8a8.testing.model_dims import GLM_45_AIR, glm_45_air_rope

    dims = dict(GLM_45_AIR)
    if tiny:
        dims.update(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                    num_key_value_heads=4, head_dim=32, max_position_embeddings=512, n_routed_experts=8,
                    num_experts_per_tok=2, moe_intermediate_size=128)
    dims["num_hidden_layers"] = layers
    return transformers.Glm4MoeConfig(rope_parameters=glm_45_air_rope(), **dims)


# The model configurations (--config): name -> the transformers class built, its config builder (transformers,
# tiny, layers), the layers of the full model, and the default layers ("fit": as many as fit beside the bf16
# copy, `fit_layers`; else that number). The Llama row is the script's original benchmark, its report unchanged.
CONFIGS = {
    "llama3-8b": {"model_class": "LlamaForCausalLM", "build_config": llama_config, "full_layers": 32,
                  "default_layers": 32, "dims": "Llama-3-8B"},
    "qwen3-30b-a3b": {"model_class": "Qwen3MoeForCausalLM", "build_config": qwen3_moe_config, "full_layers": 48,
                      "default_layers": "fit", "dims": "Qwen3-30B-A3B"},
    "glm-4.5-air": {"model_class": "Glm4MoeForCausalLM", "build_config": glm45_air_config, "full_layers": 46,
                    "default_layers": "fit", "dims": "GLM-4.5-Air"},
}
# `fit_layers`: the share of the GPU's free memory (at the start) that the weights and KV caches may take; the rest
# is left to transients (quantization of one layer, logits, compile and CUDA-graph pools, the allocator's slack)
FIT_FRACTION = 0.85


def layer_bytes(transformers: Any, config_name: str, n_w8a8: int, max_batch: int, max_cache_len: int,
                n_models: int) -> tuple[int, int]:
    """``(fixed, per_layer)`` bytes of the benchmark's models at ``config_name``'s dimensions, counted on a 2-layer
    model built on the meta device (no memory): ``fixed``, what every layer count holds once (the bf16 embedding,
    final norm and ``lm_head``, shared by every model); ``per_layer``, the larger of the two layers' share (GLM-4.5's
    first layer is dense, the rest MoE and 9x its size; counting the dense one ran the full 46 layers out of an
    H200's memory): its bf16 weights (2 bytes per parameter), plus, for each of the ``n_w8a8`` W8A8 models, its W8A8
    copy (1 byte per element of the matrices ``quantize_`` swaps: every projection and expert matrix; the bf16
    router and norms at 2 bytes; the float32 scales, under 1% of it, left to the margin), plus two KV caches (a
    StaticCache of the eager and compiled modes, and the graph path's) per model of ``n_models`` at ``max_batch`` x
    ``max_cache_len`` in bf16."""
    cfg = CONFIGS[config_name]["build_config"](transformers, False, 2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)

    def weight_bytes(layer: torch.nn.Module) -> int:
        quantized = sum(p.numel() for name, p in layer.named_parameters()
                        if p.dim() >= 2 and ".gate." not in f".{name}")
        other = sum(p.numel() for p in layer.parameters()) - quantized
        return 2 * (quantized + other) + n_w8a8 * (quantized + 2 * other)

    per_layer = max(weight_bytes(layer) for layer in model.model.layers)
    per_layer += n_models * 2 * (2 * cfg.num_key_value_heads * cfg.head_dim * max_batch * max_cache_len * 2)
    fixed = 2 * (sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in model.model.layers.parameters()))
    return fixed, per_layer


def fit_layers(free_bytes: int, fixed: int, per_layer: int, full_layers: int) -> int:
    """The default ``--layers`` of a "fit" config: the most layers, at most ``full_layers``, whose ``fixed +
    layers * per_layer`` bytes (`layer_bytes`) stay within ``FIT_FRACTION`` of ``free_bytes``. Raises ValueError
    when not even one layer fits."""
    layers = min(full_layers, int((FIT_FRACTION * free_bytes - fixed) // per_layer))
    if layers < 1:
        raise ValueError(f"not one layer fits: {fixed / 2**30:.1f} GiB + {per_layer / 2**30:.2f} GiB per layer "
                         f"> {FIT_FRACTION} x {free_bytes / 2**30:.1f} GiB free; use fewer --dtypes")
    return layers


@torch.no_grad()
def build_bf16(transformers: Any, config, device: torch.device, seed: int):
    """The ``config``'s causal LM (``LlamaForCausalLM``, ``Qwen3MoeForCausalLM``) in bf16 built directly on
    ``device``; every matrix (projections, embedding, lm_head; a MoE model's router and its experts' ``(E, N, K)``
    weights) drawn from N(0, 0.02^2) by a seeded generator on the device, norms 1."""
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() >= 2 or name.endswith(".bias"):  # GLM-4.5's q / k / v biases drawn like the matrices
            p.normal_(0.0, 0.02, generator=gen)
        else:
            p.fill_(1.0)  # the RMSNorm weights
    return model.eval().requires_grad_(False)


def quantized_copy(cw: Any, bf16, name: str):
    """A copy of ``bf16`` with every linear but ``lm_head`` swapped for a `W8A8Linear` of ``name``'s scheme
    (``QUANT``), a MoE model's experts for a `W8A8MoE` (its routers stay bf16), then optimized
    (`cutlass_w8a8.optimize_`) for a ``-opt`` name. Only the module tree is copied: every module that holds
    parameters itself (embedding, linears, experts, routers, norms) is the bf16 model's own in the copy, and
    ``quantize_`` / ``optimize_`` replace them there by new modules (``setattr`` on the copied parents), so that the
    bf16 model is left as it was and no bf16 copy of the weights is ever made (at 48 Qwen3-30B-A3B layers one would
    take 60 GB). The embedding, ``lm_head``, routers and norms stay shared with the bf16 model."""
    base = name[:-4] if name.endswith("-opt") else name
    dtype, block = QUANT[base]
    shared = {id(m): m for m in bf16.modules() if next(m.parameters(recurse=False), None) is not None}
    model = cw.quantize_(copy.deepcopy(bf16, memo=dict(shared)), cw.W8A8Config(dtype=dtype, weight_block_size=block),
                         filter_fn=lambda m, fqn: "lm_head" not in fqn)
    if name.endswith("-opt"):
        cw.optimize_(model)
    return model.eval()


def model_bytes(model) -> int:
    """Bytes of the parameters and buffers (each tensor once; the shared embedding and lm_head included)."""
    seen = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in seen.values())


def graph_generator(cw: Any, step: str):
    """``cutlass_w8a8.hf.GraphGenerator`` with ``step=step`` bound where its constructor takes ``step=`` (issue 28);
    a cutlass_w8a8 without it has only the transformers step: ``step="auto"`` then passes nothing, any other value
    is a ValueError."""
    cls = cw.hf.GraphGenerator
    if "step" in inspect.signature(cls).parameters:
        return functools.partial(cls, step=step)
    if step != "auto":
        raise ValueError(f"--graph-step {step}: this cutlass_w8a8's GraphGenerator has no `step` argument "
                         "(only the transformers step); use --graph-step auto")
    return cls


def graph_step_of(gen: Any) -> dict[str, Optional[str]]:
    """The step a ``GraphGenerator`` runs, ``{"step": "cw" | "transformers", "reason": why step="auto" fell back to
    transformers, or None}``; a generator without the ``step`` attribute runs the transformers step."""
    step = getattr(gen, "step", None)
    reason = getattr(gen, "step_reason", None)
    return {"step": step if isinstance(step, str) else "transformers",
            "reason": reason if isinstance(reason, str) else None}


def decoder_config(models: Any, config):
    """The `cutlass_w8a8.models.LlamaConfig` of the transformers Llama or Qwen3-MoE ``config``'s dimensions and
    layers (for the Llama-3-8B dimensions: ``LLAMA3_8B.replace(num_layers=...)``; for Qwen3-30B-A3B's:
    ``QWEN3_30B_A3B.replace(num_layers=...)``: q/k head norms and the experts)."""
    moe = {}
    if config.model_type == "qwen3_moe":
        moe = dict(qk_norm=True, num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                   moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob)
    elif config.model_type != "llama":
        raise ValueError(f"decoder_config: no reference decoder for model_type {config.model_type!r}")
    return models.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        rope_theta=float(config.rope_parameters["rope_theta"]), max_position=config.max_position_embeddings,
        init_std=config.initializer_range, **moe)


@torch.no_grad()
def build_decoder(models: Any, cw: Any, config, bf16, max_batch: int, max_cache_len: int, device: torch.device,
                  seed: int):
    """Our reference decoder at ``config``'s dimensions: ``LlamaDecoder(decoder_config(config), quant="int8",
    max_batch=max_batch, max_seq_len=max_cache_len rounded up to a multiple of 16, device, bfloat16, seed)``, its
    embedding and ``lm_head`` then replaced by ``bf16``'s (the same shapes and dtype: held once). Returns the model
    and its ``results["models"]`` entry."""
    t0 = time.perf_counter()
    max_seq = -(-max_cache_len // 16) * 16
    dec = models.LlamaDecoder(decoder_config(models, config), quant="int8", max_batch=max_batch, max_seq_len=max_seq,
                              device=device, dtype=torch.bfloat16, seed=seed)
    for name, ours, theirs in (("embed_tokens", dec.embed_tokens, bf16.model.embed_tokens),
                               ("lm_head", dec.lm_head, bf16.lm_head)):
        if ours.weight.shape != theirs.weight.shape or ours.weight.dtype != theirs.weight.dtype:
            raise ValueError(f"build_decoder: the decoder's {name} {tuple(ours.weight.shape)} {ours.weight.dtype} "
                             f"is not the bf16 model's {tuple(theirs.weight.shape)} {theirs.weight.dtype}")
    dec.embed_tokens, dec.lm_head = bf16.model.embed_tokens, bf16.lm_head
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the decoder's own embedding and lm_head, dropped
    info = {"weight_bytes": dec.weight_nbytes(), "w8a8_linears": sum(isinstance(m, cw.W8A8Linear)
                                                                     for m in dec.modules()),
            "optimized": None, "build_s": time.perf_counter() - t0, "quant": "int8", "max_batch": max_batch,
            "max_seq_len": max_seq, "cache_bytes": dec.cache_nbytes(),
            "shared": "embedding and lm_head of the bf16 model",
            "call": f"cutlass_w8a8.models.LlamaDecoder(config, quant='int8', max_batch={max_batch}, "
                    f"max_seq_len={max_seq}, device='{device.type}', dtype=torch.bfloat16, seed={seed})"}
    return dec, info


class DecoderPoint:
    """Our decoder at one batch ``B``, its decode step captured by ``DecodeGraphRunner(model, max_batch=B,
    sizes=[B])`` (on the CPU the runner runs it eagerly), for `check_mode` and `time_interleaved`:

    - ``prefill()``: the cache zeroed, then the prompt ``(B, L)`` fed through the step token by token (positions
      ``0 .. L - 1``, slots ``0 .. B - 1``; the decoder has no prefill op); the last logits ``(B, 1, V)``.
    - ``step(mode, tokens, positions)``: ``tokens``, ``positions`` ``(B, 1)`` int64 on the device; ``mode``
      ``"graph"`` replays the graph, ``"eager"`` runs the same step kernel by kernel; logits ``(B, 1, V)``, a view
      of the runner's static output (valid until the next step).

    ``setup_s``: the seconds the runner's creation took (warm-up and capture); ``capture_s``: the runner's own
    ``capture_seconds``."""

    def __init__(self, runner_mod: Any, model, prompt: torch.Tensor):
        self.model = model
        self.prompt = prompt
        self.batch, length = prompt.shape
        t0 = time.perf_counter()
        self.runner = runner_mod.DecodeGraphRunner(model, max_batch=self.batch, sizes=[self.batch])
        if prompt.is_cuda:
            torch.cuda.synchronize()
        self.setup_s = time.perf_counter() - t0
        self.capture_s = self.runner.capture_seconds
        self.slots = torch.arange(self.batch, device=prompt.device)
        self._prompt_steps = [(prompt[:, i].contiguous(), torch.full((self.batch,), i, dtype=torch.int64,
                                                                      device=prompt.device)) for i in range(length)]

    @torch.no_grad()
    def prefill(self) -> torch.Tensor:
        self.model.reset_cache()
        out = None
        for tok, pos in self._prompt_steps:
            out = self.runner.step(tok, pos, self.slots)
        return out[:, None, :]

    @torch.no_grad()
    def step(self, mode: str, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.runner.step(tokens[:, 0], positions[:, 0], self.slots, use_graph=mode == "graph")[:, None, :]


# ----------------------------------------------------------------------------------------------------
# run


class Log:
    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - self.t0:6.1f}s] {msg}", flush=True)


def run(args: argparse.Namespace, log: Log) -> dict[str, Any]:
    import transformers

    import cutlass_w8a8 as cw
    from cutlass_w8a8 import models as cw_models, runner as cw_runner
    from cutlass_w8a8.testing import timers as bu

    device = torch.device("cpu" if args.tiny else "cuda")
    make_generator = graph_generator(cw, args.graph_step)  # before any build: a bad --graph-step fails at once
    name = "cpu" if args.tiny else torch.cuda.get_device_name()
    commit, dirty = bu.git_commit(REPO_ROOT)
    spec = CONFIGS[args.config]
    layers_rule = None
    if args.layers is None:  # a "fit" config on the GPU: as many layers as fit beside the bf16 copy
        n_w8a8 = sum(m != "bf16" for m in args.dtypes) + int(args.decoder)  # our decoder: one more int8 copy
        free = torch.cuda.mem_get_info()[0]
        fixed, per_layer = layer_bytes(transformers, args.config, n_w8a8, max(args.batches), args.max_cache_len,
                                       len(args.dtypes))
        args.layers = fit_layers(free, fixed, per_layer, spec["full_layers"])
        layers_rule = {"rule": f"the most layers (<= {spec['full_layers']}) whose bf16 weights + {n_w8a8} W8A8 "
                               f"copies + KV caches fit in {FIT_FRACTION} x the free GPU memory",
                       "free_GiB": free / 2**30, "fixed_GiB": fixed / 2**30, "per_layer_GiB": per_layer / 2**30,
                       "layers": args.layers}
        log(f"--layers {args.layers}: {layers_rule['rule']} ({fixed / 2**30:.2f} GiB + {per_layer / 2**30:.3f} GiB "
            f"per layer, {free / 2**30:.1f} GiB free)")
    config = spec["build_config"](transformers, args.tiny, args.layers)
    results: dict[str, Any] = {
        "device": name,
        "device_slug": bu.device_slug(name),
        "capability": None if args.tiny else ".".join(map(str, torch.cuda.get_device_capability())),
        "tiny": args.tiny,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "transformers_version": transformers.__version__,
        "cutlass_w8a8_version": getattr(cw, "__version__", None),
        "git_commit": commit,
        "git_dirty": dirty,
        "config_name": args.config,
        "config": {"name": "tiny" if args.tiny else args.config, **{k: getattr(config, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim")}, "rope_theta": config.rope_parameters["rope_theta"],
            "attn_implementation": None,
            **({"model_class": spec["model_class"], "full_layers": spec["full_layers"], "dims": spec["dims"],
                "num_experts": getattr(config, "num_experts", None) or config.n_routed_experts,  # GLM: n_routed_
                "num_experts_per_tok": config.num_experts_per_tok,
                "moe_intermediate_size": config.moe_intermediate_size, "norm_topk_prob": config.norm_topk_prob,
                "experts_implementation": None,
                **({"first_k_dense_replace": config.first_k_dense_replace, "n_shared_experts": config.n_shared_experts,
                    "partial_rotary_factor": config.rope_parameters.get("partial_rotary_factor", 1.0)}
                   if config.model_type == "glm4_moe" else {})} if args.config != "llama3-8b" else {})},
        "layers_rule": layers_rule,
        "batches": args.batches,
        "dtypes": [],
        "modes": args.modes,
        "prompt_len": args.prompt_len,
        "max_cache_len": args.max_cache_len,
        "compile": ({"call": "torch.compile(model.forward, mode='reduce-overhead', fullgraph=True, dynamic=False)",
                     "compiled": "decode step only; prefill eager"} if "compiled" in args.modes else None),
        "timing": {"method": ("CUDA events around --steps decode steps (host launches included)" if not args.tiny
                              else "host clock (CPU reference ops: not a measurement)"),
                   "reps": args.reps, "steps": args.steps, "order": "round-robin over the variants of a batch",
                   "statistic": "median over repetitions of ms per step"},
        "tolerances": {"compiled_vs_eager_min_sqnr_db": COMPILED_MIN_SQNR_DB,
                       "graph_vs_eager_min_sqnr_db": GRAPH_MIN_SQNR_DB,
                       "w8a8_vs_bf16_min_sqnr_db": W8A8_MIN_SQNR_DB},
        # targets are judged on the full model, or, for a "fit" config, on the layers its rule chose
        "full_size": not args.tiny and (args.layers == spec["full_layers"] or layers_rule is not None),
        "tag": args.tag,
        # GraphGenerator(step=...) asked for (None: the constructor takes no step=), and per batch and model the
        # step it ran ({"step": "cw" | "transformers", "reason": why "auto" fell back, or None})
        "graph_step_requested": (args.graph_step if isinstance(make_generator, functools.partial) else None)
        if "graph" in args.modes else None,
        "graph_step": {},
        # --decoder: our reference decoder's build (also under "models"), per batch its runner's setup; and each
        # -opt model's graph path against its graph step (issue 28: within DECODER_WITHIN)
        "decoder": None,
        "targets_vs_decoder": [],
        "models": {},
        "points": {},
        "accuracy": {},
        "warmup": {},
        "errors": {},
    }

    # ---- models: bf16 once on the device, quantized (and optimized) copies of it
    dtypes = list(args.dtypes)
    if not args.tiny:
        for m in list(dtypes):
            if m.startswith("fp8") and not cw.supports_fp8():
                results["errors"][m] = "no fp8 kernels on this device (cutlass_w8a8.supports_fp8() is False)"
                dtypes.remove(m)
            elif m.startswith("fp8-block") and torch.cuda.get_device_capability() != (9, 0):
                results["errors"][m] = "block-scaled fp8 GEMMs need an sm90 GPU"
                dtypes.remove(m)
    log(f"building bf16 {spec['model_class']} on {device}: {args.layers} layers, hidden {config.hidden_size}, "
        f"vocab {config.vocab_size}")
    bf16 = build_bf16(transformers, config, device, args.seed)
    results["config"]["attn_implementation"] = bf16.config._attn_implementation
    if "experts_implementation" in results["config"]:  # transformers' bf16 experts: "grouped_mm" or "eager"
        results["config"]["experts_implementation"] = getattr(bf16.config, "_experts_implementation", None)
    models: dict[str, Any] = {}
    for m in dtypes:
        t0 = time.perf_counter()
        models[m] = bf16 if m == "bf16" else quantized_copy(cw, bf16, m)
        if device.type == "cuda":
            torch.cuda.synchronize()
        n_q = sum(isinstance(mod, cw.W8A8Linear) for mod in models[m].modules())
        results["models"][m] = {"weight_bytes": model_bytes(models[m]), "w8a8_linears": n_q,
                                "optimized": cw.hf.is_optimized(models[m]), "build_s": time.perf_counter() - t0}
        if config.model_type != "llama":
            results["models"][m]["w8a8_moe"] = sum(isinstance(mod, cw.W8A8MoE) for mod in models[m].modules())
        log(f"{m}: {_size(model_bytes(models[m]))} of weights, {n_q} W8A8Linear"
            + (f", {results['models'][m]['w8a8_moe']} W8A8MoE" if "w8a8_moe" in results["models"][m] else ""))
    failures: list[str] = []
    decoder = None
    if args.decoder:
        log(f"building our decoder: LlamaDecoder int8, {args.layers} layers, max_batch {max(args.batches)}")
        try:
            decoder, info = build_decoder(cw_models, cw, config, bf16, max(args.batches), args.max_cache_len, device,
                                          args.seed)
        except Exception as exc:  # noqa: BLE001 (recorded; the transformers models still run)
            traceback.print_exc()
            msg = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:400]
            results["errors"][DECODER] = msg
            failures.append(f"{DECODER}: build: {msg}")
        else:
            results["models"][DECODER] = info
            results["decoder"] = {"build_s": info["build_s"], "batches": {}}
            dtypes.append(DECODER)  # a row of the graph mode (the latency table lists results["dtypes"])
            log(f"{DECODER}: {_size(info['weight_bytes'])} of weights (embedding and lm_head shared), "
                f"{info['w8a8_linears']} W8A8Linear, built in {info['build_s']:.1f} s")
    results["dtypes"] = dtypes
    if device.type == "cuda":
        results["memory_after_build_GiB"] = torch.cuda.memory_allocated() / 2**30
    # One dynamo cache entry per (model, batch) on the same code object (the forward's wrapper).
    cfg, key = torch._dynamo.config, ("recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit")
                                      else "cache_size_limit")
    setattr(cfg, key, max(getattr(cfg, key), len(dtypes) * len(args.batches) + 2))

    timer = Timer(device)
    gen = torch.Generator().manual_seed(args.seed + 1)
    for b in args.batches:
        prompt = torch.randint(0, config.vocab_size, (b, args.prompt_len), generator=gen).to(device)
        check_inputs = step_inputs(args.check_steps, b, args.prompt_len, config.vocab_size, gen, device)
        time_inputs = step_inputs(args.steps, b, args.prompt_len, config.vocab_size, gen, device)
        points: dict[tuple, Any] = {}
        check: dict[str, dict[str, list[torch.Tensor]]] = {}
        acc: dict[str, Any] = {}
        warm: dict[str, Any] = {}
        steps_of: dict[str, Any] = {}
        results["accuracy"][str(b)] = acc
        results["warmup"][str(b)] = warm
        if "graph" in args.modes:
            results["graph_step"][str(b)] = steps_of
        for m, model in models.items():
            t0 = time.perf_counter()
            acc[m], check[m], warm[m] = {}, {}, {}
            point = Point(transformers, model, prompt, args.max_cache_len)
            for mode in args.modes:
                log(f"batch {b}, {m}, {mode}: check, {args.check_steps} steps"
                    + ("; the first compiles" if mode == "compiled" else "; capture first" if mode == "graph" else ""))
                try:
                    # the eager check runs first: its prefill allocates the cache (and marks its tensors as static
                    # addresses) outside any compiled code, as the static cache requires
                    setup_s = 0.0
                    if mode == "compiled":
                        point.compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True,
                                                       dynamic=False)
                    if mode == "graph":
                        p = GraphPoint(make_generator, model, prompt, args.max_cache_len)
                        setup_s = p.setup_s
                        steps_of[m] = graph_step_of(p.gen)
                        log(f"batch {b}, {m}, graph: step {steps_of[m]['step']}"
                            + (f" (auto fell back: {steps_of[m]['reason']})" if steps_of[m]["reason"] else ""))
                    else:
                        p = point
                    check[m][mode], step_s = check_mode(p, check_inputs, mode)
                    points[(m, mode)] = p
                except Exception as exc:  # noqa: BLE001 (recorded; the other variants still run)
                    traceback.print_exc()
                    lines = str(exc).strip().splitlines()
                    msg = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:400]
                    results["errors"][f"{m} {mode} batch {b}"] = msg
                    failures.append(f"batch {b} {m} {mode}: {msg}")
                    log(f"batch {b}, {m}, {mode}: FAILED: {msg}")
                    if mode == "eager":
                        break  # no reference for the other checks
                    continue
                w = {"first_token_s": setup_s + step_s[0]}
                if mode == "compiled":
                    w["replaying_after_s"] = step_s[0] + step_s[1]  # compile + warm-up, then the graph record
                    acc[m]["compile_s"] = step_s[0]
                    acc[m]["graph_record_s"] = step_s[1]
                if mode == "graph":
                    w["setup_s"] = setup_s
                warm[m][mode] = w
                log(f"batch {b}, {m}, {mode}: first decode token after {w['first_token_s']:.2f} s")
            acc[m]["check_s"] = time.perf_counter() - t0
            for mode in ("compiled", "graph"):
                if mode in check[m] and "eager" in check[m]:
                    ref, out = check[m]["eager"], check[m][mode]
                    worst = min(sqnr_db(o, r) for o, r in zip(out, ref))
                    max_abs = max(float((o - r).abs().max()) for o, r in zip(out, ref))
                    acc[m][f"{mode}_vs_eager"] = {"worst_sqnr_db": worst, "max_abs": max_abs,
                                                  "logits_max_abs": float(max(r.abs().max() for r in ref))}
                    log(f"batch {b}, {m}: {mode} vs eager logits: worst SQNR {worst:.1f} dB, max |diff| {max_abs:.3g}")
        if "eager" in check.get("bf16", {}):
            ref = check["bf16"]["eager"][-1]
            for m in check:
                for mode, logits in check[m].items():
                    s = sqnr_db(logits[-1], ref)
                    acc[m][f"{mode}_sqnr_vs_bf16_db"] = None if (m == "bf16" and mode == "eager") else s
                if m in W8A8_MIN_SQNR_DB and "eager" in check[m]:
                    log(f"batch {b}, {m}: last-step logits vs bf16: " + ", ".join(
                        f"{mode} {acc[m][f'{mode}_sqnr_vs_bf16_db']:.1f} dB" for mode in check[m]))

        if decoder is not None:
            check_decoder(cw_runner, decoder, prompt, check_inputs, b, points, results, failures, log)

        # the variants whose check ran (a failed compile leaves its model's eager variant in)
        variants = {key: (p, time_inputs) for key, p in points.items()}
        log(f"batch {b}: timing {len(variants)} variants, {args.reps} interleaved repetitions of {args.steps} steps")
        timings = time_interleaved(variants, args.reps, args.steps, timer, log)
        names = list(models) + ([DECODER] if (DECODER, "graph") in timings else [])
        results["points"][str(b)] = {m: {mode: timings[(m, mode)] for mode in args.modes if (m, mode) in timings}
                                     for m in names}
        for mode in args.modes:
            log(f"batch {b}, {mode}: " + ", ".join(f"{m} {timings[(m, mode)]['median_ms']:.3f} ms/token"
                                                   for m in names if (m, mode) in timings))
        points = variants = p = point = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            results.setdefault("max_memory_allocated_GiB", {})[str(b)] = torch.cuda.max_memory_allocated() / 2**30
    decoder = None
    gc.collect()
    results["failures"] = failures + apply_gates(results)
    derive(results)
    results["targets_vs_decoder"] = targets_vs_decoder(results)
    return results


def check_decoder(runner_mod: Any, decoder, prompt: torch.Tensor, check_inputs: list, b: int, points: dict,
                  results: dict[str, Any], failures: list, log: Log) -> None:
    """Our decoder at batch ``b``: its `DecoderPoint` (runner captured), the check steps eager and then replayed
    (``results["accuracy"][b][DECODER]["graph_vs_eager"]``, gated like the other graph paths), and
    ``points[(DECODER, "graph")]`` for the timing; an exception is recorded as the variant's error."""
    log(f"batch {b}, {DECODER}: capture, check, {len(check_inputs)} steps eager and replayed")
    try:
        p = DecoderPoint(runner_mod, decoder, prompt)
        eager, _ = check_mode(p, check_inputs, "eager")
        graph, _ = check_mode(p, check_inputs, "graph")
    except Exception as exc:  # noqa: BLE001 (recorded; the other variants still run)
        traceback.print_exc()
        msg = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:400]
        results["errors"][f"{DECODER} graph batch {b}"] = msg
        failures.append(f"batch {b} {DECODER} graph: {msg}")
        log(f"batch {b}, {DECODER}: FAILED: {msg}")
        return
    results["decoder"]["batches"][str(b)] = {"runner": f"DecodeGraphRunner(model, max_batch={b}, sizes=[{b}])",
                                             "graphs": bool(p.runner.use_graphs), "setup_s": p.setup_s,
                                             "capture_s": p.capture_s}
    worst = min(sqnr_db(o, r) for o, r in zip(graph, eager))
    max_abs = max(float((o - r).abs().max()) for o, r in zip(graph, eager))
    results["accuracy"][str(b)][DECODER] = {"graph_vs_eager": {
        "worst_sqnr_db": worst, "max_abs": max_abs, "logits_max_abs": float(max(r.abs().max() for r in eager))}}
    points[(DECODER, "graph")] = p
    log(f"batch {b}, {DECODER}: runner ready after {p.setup_s:.2f} s; graph vs eager logits: worst SQNR "
        f"{worst:.1f} dB, max |diff| {max_abs:.3g}")


# ----------------------------------------------------------------------------------------------------
# report (rendered by cutlass_w8a8.testing.hf_decode_report: tables, graph steps, our decoder's row and targets)


def write(results: dict[str, Any], out_dir: str) -> dict[str, str]:
    """Write ``<results_prefix(results["tag"], results["config_name"])>_<device slug>.{json,md,png}`` to ``out_dir``
    (hf_decode_report's
    `write_outputs`: `render_markdown`'s report, the PNG left out, with a note in the report, where matplotlib is
    not installed); the paths written by extension."""
    return write_outputs(results, out_dir, results_prefix(results.get("tag") or "",
                                                          results.get("config_name", "llama3-8b")))


# ----------------------------------------------------------------------------------------------------
# main


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    log = Log()
    if args.recheck:
        import json

        with open(args.recheck, encoding="utf-8") as f:
            results = json.load(f)
        recheck(results, args.recheck)
        if args.tag_given or "tag" not in results:  # else the file's own tag
            results["tag"] = args.tag if args.tag_given else file_tag(results["batches"])
        paths = write(results, args.out)
        print(render_markdown(results))
        log("wrote " + ", ".join(paths.values()))
        return 1 if results["failures"] else 0
    if not args.tiny:
        missing = cuda_extension_missing("bench_hf.py")
        if missing is not None:
            print(f"{missing}; --tiny runs the flow on the CPU", file=sys.stderr)
            return 2
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        print(f"bench_hf.py: needs transformers ({exc})", file=sys.stderr)
        return 2
    import cutlass_w8a8 as cw

    try:
        graph_generator(cw, args.graph_step)
    except ValueError as exc:
        print(f"bench_hf.py: {exc}", file=sys.stderr)
        return 2
    results = run(args, log)
    results["total_seconds"] = time.perf_counter() - log.t0
    paths = write(results, args.out)
    print(render_markdown(results))
    log("wrote " + ", ".join(paths.values()))
    if results["failures"]:
        print("bench_hf.py: correctness checks FAILED:\n  " + "\n  ".join(results["failures"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
