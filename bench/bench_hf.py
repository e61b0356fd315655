"""Decode benchmark on a transformers ``LlamaForCausalLM``: bf16 vs W8A8 (int8, fp8), eager vs ``torch.compile``.

The model is transformers' own Llama (``LlamaForCausalLM``, sdpa attention) with Llama-3-8B dimensions (vocab
128256, hidden 4096, MLP 14336, 32 layers, 32 query / 8 key-value heads, rope_theta 500000), built from a local
config with random weights (nothing is downloaded): bf16, once, on the device (seeded ``normal_``, std 0.02;
norms 1). The W8A8 models are copies of it swapped in place by
``cutlass_w8a8.quantize_(copy, W8A8Config(dtype=...), filter_fn=lambda m, fqn: "lm_head" not in fqn)``: every
projection of every layer becomes a `W8A8Linear` (per-channel weights, dynamic per-token activations); the
embedding and ``lm_head`` stay bf16, as llm-compressor's W8A8 checkpoints leave them.

Decode step (one new token for each of the ``B`` sequences; its time is the per-token latency)::

    model(input_ids=(B, 1), past_key_values=cache, position_ids=(B, 1), use_cache=True)

on a transformers ``StaticCache`` (``--max-cache-len`` positions) prefilled eagerly with a ``--prompt-len`` token
prompt. transformers 5.x has no ``cache_position`` argument any more: the ``StaticCache`` keeps its own length in
a device tensor (so compiled steps do not recompile as it grows) and the step passes ``position_ids``. Attention
is transformers' sdpa over the whole static cache with a mask, the same in both modes.

- ``eager``: ``model.forward`` as is.
- ``compiled``: transformers' documented recipe for a static cache,
  ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`` (inductor; CUDA graphs replayed by
  cudagraph trees), with ``dynamic=False`` so that each (model, batch) gets its own static graph (without it
  dynamo's automatic dynamic shapes would recompile the second batch size with a symbolic batch). Only the
  decode step is compiled: the prefill runs the uncompiled forward. One compile per (model, batch), and
  ``torch.compiler.cudagraph_mark_step_begin()`` before each compiled step (one inference step per call).

Eager and compiled of one (model, batch) share one ``StaticCache``. Checks, per (model, batch), on fixed tokens
that are the same for every model: ``--check-steps`` decode steps after the prefill, eager, then again compiled
after a reset and the same prefill (the compile happens on the first of them, the CUDA graph is recorded on the
second and replayed after). Reported: the SQNR (dB) of the last step's logits against the bf16 model's eager
logits on the same tokens, and, for the compiled steps, the SQNR and max abs difference of their logits against
the same model's eager ones (a sanity gate, `COMPILED_MIN_SQNR_DB`: the worst step counts; see there why the
random 32-layer model's logits are no accuracy measure).

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

    python bench/bench_hf.py                      # 32 layers, batch 1 and 8, bf16/int8/fp8, eager and compiled
    python bench/bench_hf.py --quick              # 8 layers, 4 x 16 steps: a first look (compiles ~4x shorter)
    python bench/bench_hf.py --batches 1 --dtypes bf16,int8 --no-compile
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
    COMPILED_MIN_SQNR_DB, MODELS, TARGETS, W8A8_MIN_SQNR_DB, _size, recheck, render_markdown, write_outputs)
from cutlass_w8a8.testing.hf_decode_steps import Point, Timer, check_mode, sqnr_db, step_inputs, time_interleaved

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OPTIONAL_MODELS = frozenset({"fp8"})  # left out with a note where the device has no fp8 kernels
MODES = ("eager", "compiled")
QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# MODELS, the speedup TARGETS and the logits gates (COMPILED_MIN_SQNR_DB, W8A8_MIN_SQNR_DB) are defined, with
# the reasons for their values, in cutlass_w8a8/testing/hf_decode_report.py, which applies them.


# ----------------------------------------------------------------------------------------------------
# command line


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Per-token decode latency of transformers' LlamaForCausalLM (Llama-3-8B dimensions, random "
                    "weights): bf16 vs W8A8 int8 / fp8 (cutlass_w8a8.quantize_), eager vs torch.compile "
                    "(reduce-overhead, fullgraph) on a StaticCache.")
    parser.add_argument("--batches", type=int_list(), default=[1, 8], metavar="LIST",
                        help="comma-separated batch sizes (default: 1,8)")
    parser.add_argument("--dtypes", type=name_list(MODELS, ordered=True), default=list(MODELS), metavar="LIST",
                        help="models among bf16,int8,fp8 (default: all; without bf16 there are no speedups and "
                             "no SQNR against it)")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default 32; 8 with --quick; 2 with --tiny)")
    parser.add_argument("--quick", action="store_true", help="8 layers (unless --layers), fewer repetitions")
    parser.add_argument("--no-compile", action="store_true", help="eager only (no torch.compile)")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU, tiny config (hidden 64): runs the flow on the ops' CPU reference "
                             "implementations, eager only unless --compile; no timing claims")
    parser.add_argument("--compile", action="store_true",
                        help="with --tiny: compile on the CPU too (inductor, no CUDA graphs; slow)")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed repetitions per variant, interleaved (default 7; 4 with --quick, 2 with --tiny)")
    parser.add_argument("--steps", type=int, default=None,
                        help="decode steps per repetition (default 24; 16 with --quick, 4 with --tiny)")
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
    args.layers = args.layers or (2 if args.tiny else 8 if args.quick else 32)
    args.reps = args.reps if args.reps is not None else (2 if args.tiny else 4 if args.quick else 7)
    args.steps = args.steps if args.steps is not None else (4 if args.tiny else 16 if args.quick else 24)
    if args.reps < 1 or args.steps < 1:
        parser.error("--reps and --steps must be >= 1")
    if args.prompt_len < 1 or args.max_cache_len < args.prompt_len + max(args.steps, args.check_steps):
        parser.error("--max-cache-len must hold --prompt-len + max(--steps, --check-steps) positions")
    args.batches = sorted(set(args.batches))
    args.modes = ["eager"] if args.no_compile or (args.tiny and not args.compile) else list(MODES)
    if args.out is None:
        args.out = (os.path.join(tempfile.gettempdir(), "cutlass_w8a8_bench_hf") if args.tiny
                    else os.path.join(REPO_ROOT, "bench", "results"))
    return args


# ----------------------------------------------------------------------------------------------------
# models


def llama_config(transformers: Any, tiny: bool, layers: int):
    """Llama-3-8B dimensions (or a tiny model whose linears are all multiples of 16) with ``layers`` layers."""
    if tiny:
        dims = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512)
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


def quantized_copy(cw: Any, bf16, dtype: torch.dtype):
    """A copy of ``bf16`` with every linear but ``lm_head`` swapped for a `W8A8Linear` of ``dtype``."""
    model = cw.quantize_(copy.deepcopy(bf16), cw.W8A8Config(dtype=dtype), filter_fn=lambda m, fqn: "lm_head" not in fqn)
    return model.eval()


def model_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


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
                       "w8a8_vs_bf16_min_sqnr_db": W8A8_MIN_SQNR_DB},
        "models": {},
        "points": {},
        "accuracy": {},
        "errors": {},
    }

    # ---- models: bf16 once on the device, quantized copies of it
    dtypes = list(args.dtypes)
    if not args.tiny and "fp8" in dtypes and not cw.supports_fp8():
        results["errors"]["fp8"] = "no fp8 kernels on this device (cutlass_w8a8.supports_fp8() is False)"
        dtypes.remove("fp8")
    log(f"building bf16 LlamaForCausalLM on {device}: {args.layers} layers, hidden {config.hidden_size}, "
        f"vocab {config.vocab_size}")
    bf16 = build_bf16(transformers, config, device, args.seed)
    results["config"]["attn_implementation"] = bf16.config._attn_implementation
    models: dict[str, Any] = {}
    for m in dtypes:
        t0 = time.perf_counter()
        models[m] = bf16 if m == "bf16" else quantized_copy(cw, bf16, QUANT_DTYPES[m])
        if device.type == "cuda":
            torch.cuda.synchronize()
        n_q = sum(isinstance(mod, cw.W8A8Linear) for mod in models[m].modules())
        results["models"][m] = {"weight_bytes": model_bytes(models[m]), "w8a8_linears": n_q,
                                "build_s": time.perf_counter() - t0}
        log(f"{m}: {_size(model_bytes(models[m]))} of weights, {n_q} W8A8Linear")
    if "bf16" not in dtypes:
        del bf16
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
        points: dict[str, Point] = {}
        check: dict[str, dict[str, list[torch.Tensor]]] = {}
        acc: dict[str, Any] = {}
        results["accuracy"][str(b)] = acc
        for m, model in models.items():
            point = Point(transformers, model, prompt, args.max_cache_len)
            points[m] = point
            t0 = time.perf_counter()
            acc[m] = {}
            check[m] = {}
            for mode in args.modes:
                log(f"batch {b}, {m}, {mode}: check, {args.check_steps} steps"
                    + ("; the first compiles" if mode == "compiled" else ""))
                try:
                    # the eager check runs first: its prefill allocates the cache (and marks its tensors as static
                    # addresses) outside any compiled code, as the static cache requires
                    if mode == "compiled":
                        point.compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True,
                                                       dynamic=False)
                    check[m][mode], step_s = check_mode(point, check_inputs, mode)
                except Exception as exc:  # noqa: BLE001 (recorded; the other variants still run)
                    traceback.print_exc()
                    lines = str(exc).strip().splitlines()
                    msg = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:400]
                    results["errors"][f"{m} {mode} batch {b}"] = msg
                    failures.append(f"batch {b} {m} {mode}: {msg}")
                    log(f"batch {b}, {m}, {mode}: FAILED: {msg}")
                    if mode == "eager":
                        break  # no reference for the compiled check
                    continue
                if mode == "compiled":
                    acc[m]["compile_s"] = step_s[0]  # dynamo + inductor + the warm-up run
                    acc[m]["graph_record_s"] = step_s[1]
            acc[m]["check_s"] = time.perf_counter() - t0
            if "compiled" in check[m] and "eager" in check[m]:
                ref, out = check[m]["eager"], check[m]["compiled"]
                worst = min(sqnr_db(o, r) for o, r in zip(out, ref))
                max_abs = max(float((o - r).abs().max()) for o, r in zip(out, ref))
                ok = worst >= COMPILED_MIN_SQNR_DB[m]
                acc[m]["compiled_vs_eager"] = {"worst_sqnr_db": worst, "max_abs": max_abs,
                                               "logits_max_abs": float(max(r.abs().max() for r in ref)),
                                               "min_sqnr_db": COMPILED_MIN_SQNR_DB[m], "ok": ok}
                if not ok:
                    failures.append(f"batch {b} {m}: compiled vs eager logits SQNR {worst:.1f} dB "
                                    f"< {COMPILED_MIN_SQNR_DB[m]} dB")
                log(f"batch {b}, {m}: compiled vs eager logits: worst SQNR {worst:.1f} dB, max |diff| {max_abs:.3g} "
                    f"[{'ok' if ok else 'FAIL'}, >= {COMPILED_MIN_SQNR_DB[m]} dB]; "
                    f"compile {acc[m]['compile_s']:.1f} s, graph record {acc[m]['graph_record_s']:.2f} s")
        if "eager" in check.get("bf16", {}):
            ref = check["bf16"]["eager"][-1]
            for m in check:
                for mode, logits in check[m].items():
                    s = sqnr_db(logits[-1], ref)
                    acc[m][f"{mode}_sqnr_vs_bf16_db"] = None if (m == "bf16" and mode == "eager") else s
                if m in W8A8_MIN_SQNR_DB and "eager" in check[m]:
                    s = acc[m]["eager_sqnr_vs_bf16_db"]
                    ok = s >= W8A8_MIN_SQNR_DB[m]
                    acc[m]["w8a8_ok"] = ok
                    if not ok:
                        failures.append(f"batch {b} {m}: eager logits SQNR vs bf16 {s:.1f} dB "
                                        f"< {W8A8_MIN_SQNR_DB[m]} dB")
                    log(f"batch {b}, {m}: last-step logits vs bf16: " + ", ".join(
                        f"{mode} {acc[m][f'{mode}_sqnr_vs_bf16_db']:.1f} dB" for mode in check[m])
                        + f" [{'ok' if ok else 'FAIL'}, >= {W8A8_MIN_SQNR_DB[m]} dB]")

        # the variants whose check ran (a failed compile leaves its model's eager variant in)
        variants = {(m, mode): (points[m], time_inputs) for m in models for mode in args.modes if mode in check[m]}
        log(f"batch {b}: timing {len(variants)} variants, {args.reps} interleaved repetitions of {args.steps} steps")
        timings = time_interleaved(variants, args.reps, args.steps, timer, log)
        results["points"][str(b)] = {m: {mode: timings[(m, mode)] for mode in args.modes if (m, mode) in timings}
                                     for m in models}
        for mode in args.modes:
            log(f"batch {b}, {mode}: " + ", ".join(f"{m} {timings[(m, mode)]['median_ms']:.3f} ms/token"
                                                   for m in models if (m, mode) in timings))
        points = variants = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            results.setdefault("max_memory_allocated_GiB", {})[str(b)] = torch.cuda.max_memory_allocated() / 2**30
    results["failures"] = failures
    derive(results)
    return results


def derive(results: dict[str, Any]) -> None:
    """Speedups over bf16 in the same mode (bf16 ms / W8A8 ms) per batch and mode, and the targets."""
    derived: dict[str, dict] = {}
    for b, point in results["points"].items():
        for mode in results["modes"]:
            d = derived.setdefault(b, {}).setdefault(mode, {})
            base = point.get("bf16", {}).get(mode)
            for m in ("int8", "fp8"):
                cur = point.get(m, {}).get(mode)
                d[f"{m}_x_bf16"] = base["median_ms"] / cur["median_ms"] if base and cur else None
    results["derived"] = derived
    targets = []
    for (mode, b), target in TARGETS.items():
        for m in ("int8", "fp8"):
            value = derived.get(str(b), {}).get(mode, {}).get(f"{m}_x_bf16")
            targets.append({"model": m, "mode": mode, "batch": b, "target": target, "value": value,
                            "met": None if value is None or results["tiny"] else value >= target})
    results["targets"] = targets


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
