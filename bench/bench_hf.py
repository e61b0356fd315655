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
- ``graph``: ``cutlass_w8a8.hf.GraphGenerator(model, max_cache_len=..., sizes=[B])``: the same decode call captured
  eagerly into a CUDA graph by ``cutlass_w8a8.graphs.capture`` (no torch.compile), static inputs written with
  ``copy_``, replayed; its own StaticCache, prefilled eagerly.

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

Writes ``hf_decode_<device>.json`` (raw numbers), ``.md`` (tables) and ``.png`` (latency and speedups; left out,
with a note, where matplotlib is not installed) to ``--out``. A variant whose check raises (a failed compile, say)
is recorded with its error and left out of the timing; the others still run. Exits 1 when a check failed or a
variant raised (the outputs are written first), 2 when it cannot run.

Examples::

    python bench/bench_hf.py                      # 32 layers, batch 1 and 8, all 7 models, eager / compiled / graph
    python bench/bench_hf.py --quick              # 2 layers, bf16,int8,int8-opt,fp8-opt,fp8-block-opt, 3 x 12 steps:
                                                  # the flow and a first look in ~2 minutes (ratios not the 8B's)
    python bench/bench_hf.py --batches 1 --dtypes bf16,int8-opt --no-compile
    python bench/bench_hf.py --tiny --out /tmp/hf # CPU, tiny config: the flow only, no timing claims
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Optional

import torch

from cutlass_w8a8.testing.cli import int_list, name_list
from cutlass_w8a8.testing.hf_decode_report import (
    COMPILED_MIN_SQNR_DB, GRAPH_MIN_SQNR_DB, MODELS, MODES, W8A8_MIN_SQNR_DB, _size, apply_gates, derive, recheck,
    render_markdown, write_outputs)
from cutlass_w8a8.testing.hf_decode_steps import (
    GraphPoint, Point, Timer, check_mode, sqnr_db, step_inputs, time_interleaved)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (dtype, weight_block_size) of each W8A8 model; "-opt" models are the same after optimize_
QUANT = {"int8": (torch.int8, None), "fp8": (torch.float8_e4m3fn, None),
         "fp8-block": (torch.float8_e4m3fn, (128, 128))}
QUICK_MODELS = ["bf16", "int8", "int8-opt", "fp8-opt", "fp8-block-opt"]
# MODELS, MODES, the speedup and warm-up TARGETS and the logits gates (COMPILED_MIN_SQNR_DB, GRAPH_MIN_SQNR_DB,
# W8A8_MIN_SQNR_DB) are defined, with the reasons for their values, in cutlass_w8a8/testing/hf_decode_report.py,
# which applies them.


# ----------------------------------------------------------------------------------------------------
# command line


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Per-token decode latency and warm-up of transformers' LlamaForCausalLM (Llama-3-8B "
                    "dimensions, random weights): bf16 vs W8A8 int8 / fp8 / fp8-block (cutlass_w8a8.quantize_, and "
                    "after cutlass_w8a8.optimize_: -opt), eager vs torch.compile (reduce-overhead, fullgraph) vs "
                    "cutlass_w8a8.generate's CUDA-graph step, on a StaticCache.")
    parser.add_argument("--batches", type=int_list(), default=[1, 8], metavar="LIST",
                        help="comma-separated batch sizes (default: 1,8)")
    parser.add_argument("--dtypes", type=name_list(MODELS, ordered=True), default=None, metavar="LIST",
                        help=f"models among {','.join(MODELS)} (default: all; with --quick "
                             f"{','.join(QUICK_MODELS)}; without bf16 there are no speedups and no SQNR against it)")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default 32; 2 with --quick or --tiny)")
    parser.add_argument("--quick", action="store_true",
                        help="2 layers (unless --layers), 5 models, fewer repetitions: about 2 minutes on an H100 "
                             "(each compile takes seconds instead of 35-44 s); the report says the ratios are not "
                             "the 32-layer model's")
    parser.add_argument("--no-compile", action="store_true", help="no torch.compile mode")
    parser.add_argument("--no-graph", action="store_true", help="no cutlass_w8a8.generate graph mode")
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
                        help="output folder for hf_decode_<device>.{json,md,png} (default: bench/results; "
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
    args.layers = args.layers or (2 if args.tiny or args.quick else 32)
    args.reps = args.reps if args.reps is not None else (2 if args.tiny else 3 if args.quick else 7)
    args.steps = args.steps if args.steps is not None else (4 if args.tiny else 12 if args.quick else 24)
    if args.dtypes is None:
        args.dtypes = list(QUICK_MODELS if args.quick else MODELS)
    if args.reps < 1 or args.steps < 1:
        parser.error("--reps and --steps must be >= 1")
    if args.prompt_len < 1 or args.max_cache_len < args.prompt_len + max(args.steps, args.check_steps):
        parser.error("--max-cache-len must hold --prompt-len + max(--steps, --check-steps) positions")
    args.batches = sorted(set(args.batches))
    args.modes = [m for m in MODES if not ((m == "compiled" and (args.no_compile or (args.tiny and not args.compile)))
                                           or (m == "graph" and args.no_graph))]
    if args.out is None:
        args.out = (os.path.join(tempfile.gettempdir(), "cutlass_w8a8_bench_hf") if args.tiny
                    else os.path.join(REPO_ROOT, "bench", "results"))
    return args


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


@torch.no_grad()
def build_bf16(transformers: Any, config, device: torch.device, seed: int):
    """``LlamaForCausalLM`` in bf16 built directly on ``device``; every matrix (projections, embedding,
    lm_head) drawn from N(0, 0.02^2) by a seeded generator on the device, norms 1."""
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed)
    for p in model.parameters():
        if p.dim() == 2:
            p.normal_(0.0, 0.02, generator=gen)
        else:
            p.fill_(1.0)  # the RMSNorm weights (Llama has no biases)
    return model.eval().requires_grad_(False)


def quantized_copy(cw: Any, bf16, name: str):
    """A copy of ``bf16`` with every linear but ``lm_head`` swapped for a `W8A8Linear` of ``name``'s scheme
    (``QUANT``), then optimized (`cutlass_w8a8.optimize_`) for a ``-opt`` name. The embedding and ``lm_head`` are
    the bf16 model's own modules (shared, not copied)."""
    base = name[:-4] if name.endswith("-opt") else name
    dtype, block = QUANT[base]
    shared = {id(bf16.model.embed_tokens): bf16.model.embed_tokens, id(bf16.lm_head): bf16.lm_head}
    model = cw.quantize_(copy.deepcopy(bf16, memo=dict(shared)), cw.W8A8Config(dtype=dtype, weight_block_size=block),
                         filter_fn=lambda m, fqn: "lm_head" not in fqn)
    if name.endswith("-opt"):
        cw.optimize_(model)
    return model.eval()


def model_bytes(model) -> int:
    """Bytes of the parameters and buffers (each tensor once; the shared embedding and lm_head included)."""
    seen = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in seen.values())


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
    from cutlass_w8a8.testing import timers as bu

    device = torch.device("cpu" if args.tiny else "cuda")
    name = "cpu" if args.tiny else torch.cuda.get_device_name()
    commit, dirty = bu.git_commit(REPO_ROOT)
    config = llama_config(transformers, args.tiny, args.layers)
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
        "config": {"name": "tiny" if args.tiny else "llama3-8b", **{k: getattr(config, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim")}, "rope_theta": config.rope_parameters["rope_theta"],
            "attn_implementation": None},
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
        "full_size": not args.tiny and args.layers == 32,
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
    log(f"building bf16 LlamaForCausalLM on {device}: {args.layers} layers, hidden {config.hidden_size}, "
        f"vocab {config.vocab_size}")
    bf16 = build_bf16(transformers, config, device, args.seed)
    results["config"]["attn_implementation"] = bf16.config._attn_implementation
    models: dict[str, Any] = {}
    for m in dtypes:
        t0 = time.perf_counter()
        models[m] = bf16 if m == "bf16" else quantized_copy(cw, bf16, m)
        if device.type == "cuda":
            torch.cuda.synchronize()
        n_q = sum(isinstance(mod, cw.W8A8Linear) for mod in models[m].modules())
        results["models"][m] = {"weight_bytes": model_bytes(models[m]), "w8a8_linears": n_q,
                                "optimized": cw.hf.is_optimized(models[m]), "build_s": time.perf_counter() - t0}
        log(f"{m}: {_size(model_bytes(models[m]))} of weights, {n_q} W8A8Linear")
    results["dtypes"] = dtypes
    if device.type == "cuda":
        results["memory_after_build_GiB"] = torch.cuda.memory_allocated() / 2**30
    # One dynamo cache entry per (model, batch) on the same code object (the forward's wrapper).
    cfg, key = torch._dynamo.config, ("recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit")
                                      else "cache_size_limit")
    setattr(cfg, key, max(getattr(cfg, key), len(dtypes) * len(args.batches) + 2))

    failures: list[str] = []
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
        results["accuracy"][str(b)] = acc
        results["warmup"][str(b)] = warm
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
                        p = GraphPoint(cw.hf.GraphGenerator, model, prompt, args.max_cache_len)
                        setup_s = p.setup_s
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

        # the variants whose check ran (a failed compile leaves its model's eager variant in)
        variants = {key: (p, time_inputs) for key, p in points.items()}
        log(f"batch {b}: timing {len(variants)} variants, {args.reps} interleaved repetitions of {args.steps} steps")
        timings = time_interleaved(variants, args.reps, args.steps, timer, log)
        results["points"][str(b)] = {m: {mode: timings[(m, mode)] for mode in args.modes if (m, mode) in timings}
                                     for m in models}
        for mode in args.modes:
            log(f"batch {b}, {mode}: " + ", ".join(f"{m} {timings[(m, mode)]['median_ms']:.3f} ms/token"
                                                   for m in models if (m, mode) in timings))
        points = variants = p = point = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            results.setdefault("max_memory_allocated_GiB", {})[str(b)] = torch.cuda.max_memory_allocated() / 2**30
    results["failures"] = failures + apply_gates(results)
    derive(results)
    return results


# ----------------------------------------------------------------------------------------------------
# main


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    log = Log()
    if args.recheck:
        import json

        with open(args.recheck) as f:
            results = json.load(f)
        recheck(results, args.recheck)
        paths = write_outputs(results, args.out)
        print(render_markdown(results))
        log("wrote " + ", ".join(paths.values()))
        return 1 if results["failures"] else 0
    if not args.tiny:
        if not torch.cuda.is_available():
            print(f"bench_hf.py: needs a CUDA device, and torch.cuda.is_available() is False (torch "
                  f"{torch.__version__}); --tiny runs the flow on the CPU", file=sys.stderr)
            return 2
        import cutlass_w8a8 as cw

        if not cw.cuda_ops_available():
            print(f"bench_hf.py: the cutlass_w8a8 CUDA extension is not loaded: {cw.extension_status()}",
                  file=sys.stderr)
            return 2
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        print(f"bench_hf.py: needs transformers ({exc})", file=sys.stderr)
        return 2
    results = run(args, log)
    results["total_seconds"] = time.perf_counter() - log.t0
    paths = write_outputs(results, args.out)
    print(render_markdown(results))
    log("wrote " + ", ".join(paths.values()))
    if results["failures"]:
        print("bench_hf.py: correctness checks FAILED:\n  " + "\n  ".join(results["failures"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
