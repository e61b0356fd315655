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
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import torch

from cutlass_w8a8.testing.cli import int_list, name_list
from cutlass_w8a8.testing.report import write_results

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = ("bf16", "int8", "fp8")
OPTIONAL_MODELS = frozenset({"fp8"})  # left out with a note where the device has no fp8 kernels
MODES = ("eager", "compiled")
QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}

# Speedup targets over bf16 in the same mode, by (mode, batch), for int8 and fp8.
TARGETS = {("eager", 1): 1.0, ("compiled", 1): 1.6, ("compiled", 8): 1.5}

# Sanity gates on the logits of the benchmark's own model. They catch a broken path, not rounding: accuracy
# has its gates in the tests, on models where they mean something (tests/test_hf_generate.py: compiled vs eager
# >= 30 dB (int8) / 25 dB (fp8) on CUDA with reduce-overhead; tests/test_checkpoints.py: >= 50 dB against the
# decompressed checkpoint). A 32-layer model with random weights amplifies every rounding difference layer after
# layer: on an H100 (bench/results/hf_decode_nvidia-h100-80gb-hbm3.md, 2026-11-23) the bf16 model compiled vs
# its own eager run gave 25 dB (inductor rounds its fused elementwise chains once instead of after each op), the
# int8 one 12-13 dB and the fp8 one 9 dB (an activation moved across a quantization step by that rounding moves
# by a whole step), and W8A8 eager vs bf16 eager 10 dB (int8) and 4 dB (fp8), where the tiny CPU model of the
# tests gives 39 and 29 dB. A broken compile (wrong strides, a stale cache position, the replay of old inputs) or
# a broken model gives 0 dB or less: the gates sit above that.
COMPILED_MIN_SQNR_DB = {"bf16": 6.0, "int8": 6.0, "fp8": 6.0}
# W8A8 logits vs the bf16 model's, last check step (positive: the logits are correlated, not noise).
W8A8_MIN_SQNR_DB = {"int8": 1.0, "fp8": 1.0}


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
# steps


class Point:
    """One (model, batch): its cache, its eager and compiled steps, the fixed prompt."""

    def __init__(self, transformers: Any, model, prompt: torch.Tensor, max_cache_len: int):
        self.model = model
        self.prompt = prompt
        self.batch = prompt.shape[0]
        self.cache = transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)
        self.compiled: Optional[Callable] = None

    def prefill(self) -> torch.Tensor:
        """Reset the cache and prefill the prompt with the uncompiled forward; the last position's logits."""
        self.cache.reset()
        out = self.model(input_ids=self.prompt, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits

    def step(self, mode: str, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step, ``tokens`` and ``positions`` ``(B, 1)`` int64 on the device; the logits ``(B, 1, V)``.
        A compiled step's logits live in the CUDA graph's memory pool: clone them to keep them past the next step."""
        if mode == "eager":
            fn = self.model.forward
        else:
            torch.compiler.cudagraph_mark_step_begin()
            fn = self.compiled
        return fn(input_ids=tokens, past_key_values=self.cache, position_ids=positions, use_cache=True).logits


def sqnr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``10 log10(|ref|^2 / |out - ref|^2)`` in dB (torchao's accuracy metric), in float64."""
    out, ref = out.double(), ref.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (out - ref).pow(2).sum().clamp_min(1e-300)))


def step_inputs(n: int, batch: int, start: int, vocab: int, gen: torch.Generator, device) -> list[tuple]:
    """``n`` decode steps of random tokens at positions ``start, start + 1, ...``: ``(tokens, positions)``,
    each ``(batch, 1)`` int64, contiguous, on ``device``."""
    tokens = torch.randint(0, vocab, (n, batch, 1), generator=gen)
    return [(tokens[i].to(device), torch.full((batch, 1), start + i, dtype=torch.int64).to(device)) for i in range(n)]


@torch.no_grad()
def check_mode(point: Point, inputs: list[tuple], mode: str) -> tuple[list[torch.Tensor], list[float]]:
    """The logits (float32, CPU) of every check step in ``mode`` after a reset and the prefill, and the
    wall-clock seconds of each step. In the compiled mode the first step is where the compile and the warm-up
    happen, the second where the CUDA graph is recorded."""
    point.prefill()
    logits, seconds = [], []
    for tok, pos in inputs:
        t0 = time.perf_counter()
        logits.append(point.step(mode, tok, pos).float().cpu())  # .cpu() waits for the step
        seconds.append(time.perf_counter() - t0)
    return logits, seconds


class Timer:
    """Elapsed milliseconds of a block: CUDA events on the current stream (host launches included), or the
    host clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
            torch.cuda.synchronize()
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, start) -> Callable[[], float]:
        """A function giving the elapsed ms (after a synchronize, for CUDA events)."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            return lambda: start.elapsed_time(end)
        ms = (time.perf_counter() - start) * 1e3
        return lambda: ms


@torch.no_grad()
def time_interleaved(variants: dict[tuple, tuple], reps: int, steps: int, timer: Timer,
                     log: Callable[[str], None]) -> dict[tuple, dict[str, float]]:
    """``variants``: ``(model, mode) -> (point, inputs)``. Round-robin repetitions; per variant the median,
    min and max ms/token over them."""
    samples: dict[tuple, list[Callable[[], float]]] = {key: [] for key in variants}
    for rep in range(reps):
        for key, (point, inputs) in variants.items():
            point.prefill()
            start = timer.start()
            for tok, pos in inputs[:steps]:
                point.step(key[1], tok, pos)
            samples[key].append(timer.stop(start))
        log(f"  repetition {rep + 1}/{reps} done")
    if timer.cuda:
        torch.cuda.synchronize()
    out = {}
    for key, fns in samples.items():
        per_token = [fn() / steps for fn in fns]
        out[key] = {"median_ms": statistics.median(per_token), "min_ms": min(per_token), "max_ms": max(per_token),
                    "reps": reps, "steps": steps}
    return out


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
# reports


def _fmt(value: Optional[float], spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def latency_table(results: dict[str, Any]) -> str:
    rows = ["| batch | mode | bf16 ms/token | int8 ms/token | fp8 ms/token | int8/bf16 speedup | fp8/bf16 speedup |",
            "|---:|:---|---:|---:|---:|---:|---:|"]
    for b in results["batches"]:
        point = results["points"].get(str(b), {})
        for mode in results["modes"]:
            ms = [_fmt(point.get(m, {}).get(mode, {}).get("median_ms"), ".3f") for m in MODELS]
            d = results["derived"].get(str(b), {}).get(mode, {})
            rows.append(f"| {b} | {mode} | " + " | ".join(ms) + f" | {_fmt(d.get('int8_x_bf16'), '.2f')}x"
                        f" | {_fmt(d.get('fp8_x_bf16'), '.2f')}x |")
    return "\n".join(rows).replace("–x", "–")


def recheck(results: dict[str, Any], source: str) -> None:
    """Re-evaluate the logits checks of ``results`` (a results file of this script) with the current gates,
    keeping every measured value; the failures of variants that raised are kept."""
    failures = [f for f in results.get("failures", []) if "logits SQNR" not in f]
    for b, acc in results["accuracy"].items():
        for m, a in acc.items():
            cve = a.get("compiled_vs_eager")
            if cve:
                cve["min_sqnr_db"] = COMPILED_MIN_SQNR_DB[m]
                cve["ok"] = cve["worst_sqnr_db"] >= COMPILED_MIN_SQNR_DB[m]
                if not cve["ok"]:
                    failures.append(f"batch {b} {m}: compiled vs eager logits SQNR {cve['worst_sqnr_db']:.1f} dB "
                                    f"< {COMPILED_MIN_SQNR_DB[m]} dB")
            if m in W8A8_MIN_SQNR_DB and a.get("eager_sqnr_vs_bf16_db") is not None:
                a["w8a8_ok"] = a["eager_sqnr_vs_bf16_db"] >= W8A8_MIN_SQNR_DB[m]
                if not a["w8a8_ok"]:
                    failures.append(f"batch {b} {m}: eager logits SQNR vs bf16 {a['eager_sqnr_vs_bf16_db']:.1f} dB "
                                    f"< {W8A8_MIN_SQNR_DB[m]} dB")
    results["failures"] = failures
    results["tolerances"] = {"compiled_vs_eager_min_sqnr_db": COMPILED_MIN_SQNR_DB,
                             "w8a8_vs_bf16_min_sqnr_db": W8A8_MIN_SQNR_DB}
    results["rechecked"] = (f"logits checks re-evaluated from {os.path.basename(source)} with the gates of "
                            "bench_hf.py at the commit that holds this file; measured values unchanged")


def accuracy_table(results: dict[str, Any]) -> str:
    rows = ["| batch | model | eager logits SQNR vs bf16 dB | compiled logits SQNR vs bf16 dB "
            "| compiled vs eager: worst SQNR dB / max abs diff | check | compile s |",
            "|---:|:---|---:|---:|---:|:---|---:|"]
    for b in results["batches"]:
        for m, a in results["accuracy"].get(str(b), {}).items():
            cve = a.get("compiled_vs_eager")
            cve_text = f"{cve['worst_sqnr_db']:.1f} / {cve['max_abs']:.3g}" if cve else "–"
            checks = []
            if cve:
                checks.append(f"compiled {'ok' if cve['ok'] else 'FAIL'} (>= {cve['min_sqnr_db']} dB)")
            if "w8a8_ok" in a:
                checks.append(f"vs bf16 {'ok' if a['w8a8_ok'] else 'FAIL'} (>= {W8A8_MIN_SQNR_DB[m]} dB)")
            e, c = a.get("eager_sqnr_vs_bf16_db"), a.get("compiled_sqnr_vs_bf16_db")
            rows.append(f"| {b} | {m} | {'ref' if m == 'bf16' else _fmt(e, '.1f')} | {_fmt(c, '.1f')} | {cve_text} "
                        f"| {'; '.join(checks) or '–'} | {_fmt(a.get('compile_s'), '.1f')} |")
    return "\n".join(rows)


def render_markdown(results: dict[str, Any]) -> str:
    commit = results.get("git_commit")
    commit_text = f"git {commit[:12]}{' (dirty)' if results.get('git_dirty') else ''}" if commit else "git: n/a"
    c = results["config"]
    t = results["timing"]
    lines = [f"# transformers LlamaForCausalLM decode: {results['device']}", ""]
    if results["tiny"]:
        lines += ["**CPU run of a tiny config (`--tiny`): the ops run their CPU reference implementations. It "
                  "checks the flow; the times below are not measurements of anything.**", ""]
    lines += [
        f"- torch {results['torch_version']} (CUDA {results['cuda_version']}), transformers "
        f"{results['transformers_version']}, {commit_text}",
        f"- {c['name']} dimensions, {c['num_hidden_layers']} layers: hidden {c['hidden_size']}, MLP "
        f"{c['intermediate_size']}, heads {c['num_attention_heads']}/{c['num_key_value_heads']} x {c['head_dim']}, "
        f"vocab {c['vocab_size']}, rope_theta {c['rope_theta']:g}; random weights; attention "
        f"{c['attn_implementation']}",
        "- W8A8: `quantize_(copy, W8A8Config(dtype=...), filter_fn=lambda m, fqn: \"lm_head\" not in fqn)` "
        "(per-channel weights, dynamic per-token activations; embedding and lm_head bf16). Weights: "
        + ", ".join(f"{m} {_size(r['weight_bytes'])}" for m, r in results["models"].items()),
        f"- decode step: `model(input_ids=(B, 1), past_key_values=StaticCache, position_ids=(B, 1), use_cache=True)`"
        f", StaticCache of {results['max_cache_len']} positions, {results['prompt_len']}-token prompt prefilled "
        "eagerly",
    ]
    if results["compile"]:
        lines.append(f"- compiled: `{results['compile']['call']}`, the decode step only (prefill eager)")
    lines += [
        f"- ms/token = median over {t['reps']} repetitions of {t['steps']} decode steps ({t['method']}); the "
        "variants of a batch timed round-robin",
        "",
        "## Per-token latency",
        "",
        latency_table(results),
        "",
        "## Correctness (logits of the last of the check steps, same tokens for every model)",
        "",
        accuracy_table(results),
        "",
        "## Targets (W8A8 over bf16, same mode)",
        "",
    ]
    for tgt in results["targets"]:
        if tgt["mode"] not in results["modes"] or tgt["batch"] not in results["batches"]:
            continue
        verdict = "n/a" if tgt["met"] is None else ("met" if tgt["met"] else "NOT met")
        value = "–" if tgt["value"] is None else f"{tgt['value']:.2f}x"
        lines.append(f"- {tgt['model']} {tgt['mode']} batch {tgt['batch']}: {value} "
                     f"(target >= {tgt['target']}): {verdict}")
    if results["failures"]:
        lines += ["", "## FAILED checks", ""] + [f"- {f}" for f in results["failures"]]
    if results["errors"]:
        lines += ["", "## Left out", ""] + [f"- `{m}`: {msg}" for m, msg in results["errors"].items()]
    if results.get("png_note"):
        lines += ["", f"({results['png_note']})"]
    if results.get("rechecked"):
        lines += ["", f"({results['rechecked']}.)"]
    return "\n".join(lines) + "\n"


def plot_results(results: dict[str, Any], path: str) -> None:
    """PNG: ms/token per (batch, mode) for each model, and the speedups over bf16 with the targets."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(b, mode) for b in results["batches"] for mode in results["modes"]]
    labels = [f"B={b}\n{mode}" for b, mode in groups]
    models = [m for m in MODELS if m in results["models"]]
    fig, (ax_lat, ax_x) = plt.subplots(1, 2, figsize=(13, 5))
    width = 0.8 / max(1, len(models))
    for i, m in enumerate(models):
        ys = [results["points"].get(str(b), {}).get(m, {}).get(mode, {}).get("median_ms", float("nan"))
              for b, mode in groups]
        ax_lat.bar([g + (i - (len(models) - 1) / 2) * width for g in range(len(groups))], ys, width, label=m)
    ax_lat.set_ylabel("ms per decode step (= per token of each sequence)")
    ax_lat.set_title("Per-token decode latency")
    ratios = [m for m in ("int8", "fp8") if m in models and "bf16" in models]
    width = 0.8 / max(1, len(ratios))
    for i, m in enumerate(ratios):
        ys = [results["derived"].get(str(b), {}).get(mode, {}).get(f"{m}_x_bf16") for b, mode in groups]
        ys = [float("nan") if y is None else y for y in ys]
        ax_x.bar([g + (i - (len(ratios) - 1) / 2) * width for g in range(len(groups))], ys, width,
                 label=f"{m} / bf16")
    for g, (b, mode) in enumerate(groups):
        target = TARGETS.get((mode, b))
        if target:
            ax_x.hlines(target, g - 0.45, g + 0.45, colors="gray", linestyles=":", label=None)
            ax_x.annotate(f"target {target}", xy=(g, target), ha="center", va="bottom", fontsize=8, color="gray")
    ax_x.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax_x.set_ylabel("speedup over bf16, same mode (x)")
    ax_x.set_title("W8A8 speedups")
    for ax in (ax_lat, ax_x):
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(labels)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    c = results["config"]
    title = (f"transformers Llama ({c['name']} x {c['num_hidden_layers']} layers), {results['device']}, "
             f"torch {results['torch_version']}")
    fig.suptitle(title + (" - CPU reference ops, not a measurement" if results["tiny"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(results: dict[str, Any], out_dir: str) -> dict[str, str]:
    """Write ``hf_decode_<slug>.json``, ``.md`` and ``.png`` to ``out_dir`` (cutlass_w8a8.testing.report's
    write_results); without matplotlib the PNG is left out and the report says so. Returns the paths written, by
    extension."""
    try:
        import matplotlib  # noqa: F401
        plot = plot_results
    except ImportError:
        results["png_note"] = "no PNG: matplotlib is not installed"

        def plot(results, path):
            return None
    paths = write_results(results, render_markdown(results), out_dir, "hf_decode", plot)
    return {ext: p for ext, p in paths.items() if os.path.exists(p)}


# ----------------------------------------------------------------------------------------------------


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
