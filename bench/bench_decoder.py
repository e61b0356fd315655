"""Decode benchmark: per-token latency of a Llama-3-8B-sized decoder, bf16 and W8A8, eager and CUDA graphs.

Models (``--models``, names in `_decoder_report.MODELS`; default bf16, int8, int8+lmh, fp8, fp8-block), built one at
a time from the same seed (`cutlass_w8a8.models.LlamaDecoder`, random weights, all 32 layers by default): ``bf16``
(``nn.Linear`` layers), ``int8`` / ``fp8`` (`W8A8Linear` decoder layers, per-channel weights and per-token
activations, the embedding and ``lm_head`` in bf16), ``fp8-block`` (block-scaled fp8 `W8A8Linear`: 128x128 weight
blocks, 1x128 activation groups; issue 26's target: its graph step at batch 1 <= 1.1x fp8's) and ``int8+lmh`` /
``fp8+lmh`` / ``fp8-block+lmh`` (the same with a W8A8 ``lm_head``). ``--config qwen3-30b-a3b`` (issue 27): the
Qwen3-30B-A3B dims (48 layers by default, ``--layers`` to cut it): q/k head norms and MoE MLPs, the experts in bf16
(``torch._grouped_mm``) in the bf16 model and `W8A8MoE` in the W8A8 ones, the routers bf16 in all; target: the
int8 / fp8 graph step >= 1.6x the bf16 one at batch 1; the bytes a step reads count the experts its rows hit in
expectation (`step_weight_bytes`), and the kernel-class table has counts and times only (its byte model is the
dense layer's), with the kernels per layer.
For each model and batch size:

- ``eager``: `DecodeGraphRunner.step(..., use_graph=False)`: the step launched kernel by kernel.
- ``graph``: the same step replayed from the bucket's CUDA graph (`DecodeGraphRunner`).

Both take host inputs (token ids, positions, slots as CPU tensors) through pinned buffers, as a serving
loop would. One step decodes one token for every sequence, so the step time is the per-token latency.

Timing: each step between two CUDA events on the current stream, ``--steps`` steps after ``--warmup``
untimed ones; the median is reported. The events are recorded by the host around the step's launches, so an
eager step that the host cannot launch as fast as the GPU runs it is charged its launch time: that cost is
what the graphs remove. (`bench_utils.bench_gpu_time` is not used: it captures the function into its own
graph, which would turn the eager step into a graph too. The weights, 8-16 GB, are far beyond the L2, so
every step reads them cold anyway.)

HBM limit: the step time that the datasheet HBM bandwidth allows (`bench_utils.hbm_bandwidth_gbps`, from
``torch.cuda.get_device_name()``; omitted with a note on other devices) for the bytes a step must read once:
every weight but the embedding (of which a step reads B rows; ``lm_head`` included), plus the KV cache its
attention reads (`kv_tokens_read`): positions ``0..position`` of each row, at the benchmark's positions
(``--max-seq // 2``; a padded row of the bucket reads its one scratch position), where the model's attention
is ``decode_attention``; all ``--max-seq`` positions of each row of the bucket where it is a masked attention
over the whole cache. Activations and any gathered copy of the cache are not counted: the limit is a floor.
Reported beside the measured time, with measured / limit.

Kernel classes and PDL (the batches of ``--class-batches``, default 1 and 8): two more graphs of the bucket are
captured, one with PDL on and one with PDL off (`cutlass_w8a8.set_pdl`, restored after; a graph keeps the
setting it was captured with), their replays timed interleaved (PDL on / off); then one PDL-off replay is
profiled (torch.profiler) and its kernels sorted into classes by name (bench/_decoder_kernels.py): per class
the count, the sum of durations and the time the HBM bandwidth allows for the bytes the class must move
(`_decoder_kernels.step_class_bytes`). PDL off because a PDL kernel starts early and waits on
griddepcontrol, and its duration would include the wait.

Capture: wall-clock time of capturing every bucket (1, 2, 4, then multiples of 8 up to the largest batch,
vLLM's sizes) and the memory of the graphs' shared pool (bytes of its segments, and the change of
``torch.cuda.memory_reserved``).

Writes ``decoder_<device>.json`` (raw numbers), ``decoder_<device>.md`` (tables, the issue-18 targets) and
``decoder_<device>.png`` (latency and speedups against the batch size) to ``--out``; with ``--config qwen3-30b-a3b``
``decoder_moe_<device>.*`` (`results_prefix`), so a MoE run does not overwrite the Llama one.

Examples::

    python bench/bench_decoder.py                          # Llama-3-8B dimensions, 32 layers, batch 1, 8, 32, 64
    python bench/bench_decoder.py --quick                  # 8 layers, fewer steps
    python bench/bench_decoder.py --batches 1 --models bf16,int8,int8+lmh
    python bench/bench_decoder.py --config qwen3-30b-a3b --batches 1,8 --models bf16,int8,fp8
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch

from cutlass_w8a8.testing.cli import int_list, name_list
from cutlass_w8a8.testing.report import AccuracyError, provenance, publish, require_cuda_extension, run_checked
from cutlass_w8a8.testing.timers import cuda_kernel_times

# bench/ is on sys.path (python bench/bench_decoder.py). The models and modes compared, the derived numbers and
# targets and the reports are in bench/_decoder_report.py; the kernel classes in bench/_decoder_kernels.py.
from _decoder_kernels import class_table, step_class_bytes, summarize_kernels
from _decoder_report import DEFAULT_MODELS, LMH, MODELS, MODES, derive, model_spec, plot_results, render_markdown

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a build without fp8 (or block fp8: sm90 only) kernels records the error and goes on
OPTIONAL_MODELS = frozenset({"fp8", "fp8+lmh", "fp8-block", "fp8-block+lmh"})
# Accuracy guard: relative Frobenius error of the logits, graph replay against the eager step (the same
# kernels: they should agree bitwise; anything above this is a broken capture, not rounding).
GRAPH_EAGER_REL_TOL = 1e-3



# ----------------------------------------------------------------------------------------------------
# command line


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    # cutlass_w8a8.models.CONFIGS; listed here so --help needs no import
    config_names = ("llama3-8b", "small", "qwen3-30b-a3b")
    parser = argparse.ArgumentParser(
        description="Per-token decode latency of a Llama-style decoder (random weights): bf16 vs W8A8 "
                    "(int8, fp8), eager vs CUDA graphs captured per batch-size bucket.")
    parser.add_argument("--batches", type=int_list(), default=[1, 8, 32, 64], metavar="LIST",
                        help="comma-separated batch sizes (default: 1,8,32,64)")
    parser.add_argument("--config", choices=config_names, default="llama3-8b",
                        help="model dimensions (default: llama3-8b; qwen3-30b-a3b: the Qwen3-MoE decoder, 128 "
                             "experts of 768, top-8, q/k head norms, issue 27's target W8A8 >= 1.6x bf16 at batch 1)")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default: all of the config, 32 for llama3-8b, 48 for qwen3-30b-a3b; 8 "
                             "with --quick)")
    parser.add_argument("--models", type=name_list(MODELS, ordered=True), default=list(DEFAULT_MODELS),
                        metavar="LIST",
                        help=f"comma-separated models among {','.join(MODELS)}, run in that order; '+lmh': "
                             f"lm_head quantized too (default: {','.join(DEFAULT_MODELS)}; fp8 is skipped with "
                             "a note where its kernels are not built)")
    parser.add_argument("--max-seq", type=int, default=512,
                        help="KV-cache length in tokens, a multiple of 16 (default 512); the sequences sit at position "
                             "max_seq // 2 and attention reads positions 0..max_seq // 2")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per measurement (default 100; 30 with --quick)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps before them (default 10; 3 with --quick)")
    parser.add_argument("--quick", action="store_true", help="8 layers (unless --layers), fewer steps")
    parser.add_argument("--quant-lm-head", action="store_true",
                        help="run every W8A8 model of --models with its lm_head quantized: int8 -> int8+lmh, "
                             "fp8 -> fp8+lmh (kept for compatibility; the +lmh names say the same)")
    parser.add_argument("--class-batches", type=int_list(), default=[1, 8], metavar="LIST",
                        help="batches (among --batches) whose graph step is profiled by kernel class with PDL "
                             "off and timed with PDL off and on (default: 1,8)")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results"), metavar="DIR",
                        help="output folder for decoder_<device>.{json,md,png} (default: bench/results)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the inputs")
    args = parser.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be >= 1")
    if args.max_seq < 16 or args.max_seq % 16:
        parser.error("--max-seq must be a positive multiple of 16")
    args.batches = sorted(set(args.batches))
    args.class_batches = sorted(set(args.class_batches) & set(args.batches))
    if args.quant_lm_head:
        lmh = [m if m == "bf16" or m.endswith(LMH) else m + LMH for m in args.models]
        args.models = [m for m in MODELS if m in lmh]
    args.steps = args.steps if args.steps is not None else (30 if args.quick else 100)
    args.warmup = args.warmup if args.warmup is not None else (3 if args.quick else 10)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


# ----------------------------------------------------------------------------------------------------
# measurements


def time_interleaved(fns: dict[str, Callable[[], Any]], steps: int, warmup: int) -> dict[str, dict[str, float]]:
    """Milliseconds per call of each function of ``fns``, called in turn (one call of each per round, so slow
    drifts of clocks or temperature hit them alike), from CUDA events around each call: per name the median,
    min and max over ``steps`` calls after ``warmup`` untimed rounds, and the host wall-clock time per call
    (of all functions together, / their number)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    events = {name: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                     for _ in range(steps)] for name in fns}
    t0 = time.perf_counter()
    for i in range(steps):
        for name, fn in fns.items():
            start, end = events[name][i]
            start.record()
            fn()
            end.record()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / (steps * len(fns))
    out = {}
    for name, evs in events.items():
        times = [start.elapsed_time(end) for start, end in evs]
        out[name] = {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
                     "wall_ms": wall_ms, "steps": steps}
    return out


def time_steps(step: Callable[[], Any], steps: int, warmup: int) -> dict[str, float]:
    """`time_interleaved` of one function: median, min, max ms over ``steps`` calls, host wall-clock ms per call."""
    return time_interleaved({"step": step}, steps, warmup)["step"]


def profile_step(step: Callable[[], Any]) -> dict[str, Any]:
    """The GPU kernels of one ``step`` (torch.profiler, CUDA activity) by class (`_decoder_kernels.summarize_kernels`:
    ``kernels``, ``busy_ms`` = sum of durations, ``by_class``, ``other_names``, ``by_kernel``). Step time minus busy
    time is the time the GPU waited. Best effort: returns ``{"error": ...}`` where profiling fails."""
    try:
        return summarize_kernels(cuda_kernel_times(step))
    except Exception as exc:  # noqa: BLE001 (a diagnostic; the timings do not depend on it)
        return {"error": f"{type(exc).__name__}: {str(exc).strip()[:200]}"}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref||_F / ||ref||_F`` in float32."""
    out, ref = out.float(), ref.float()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def sqnr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``10 log10(|ref|^2 / |out - ref|^2)`` in dB."""
    out, ref = out.double(), ref.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (out - ref).pow(2).sum().clamp_min(1e-300)))


def probe_logits(model) -> torch.Tensor:
    """Logits (float32, on the CPU) of 4 eager steps of one fixed sequence from an empty cache: the same
    for every model of one seed, so the W8A8 models can be compared with the bf16 one."""
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, model.config.vocab_size, (4,), generator=gen)
    model.reset_cache()
    out = None
    for t in range(4):
        out = model(tokens[t:t + 1].to(model.device), torch.tensor([t], device=model.device),
                    torch.tensor([0], device=model.device))
    logits = out[0].float().cpu()
    model.reset_cache()
    return logits


def kv_tokens_read(models_mod: Any, batch: int, rows: int, position: int, max_seq: int) -> tuple[int, str]:
    """Cache positions (per layer, keys and values each) that one step's attention reads, and how they were
    counted: ``batch`` real rows at ``position`` and ``rows - batch`` padded rows (position 0, the scratch
    slot). The model's step context says which attention it runs: one that carries the positions
    (``decode_attention``, reading ``0..position``) or one that carries a mask over the whole cache."""
    fields = getattr(getattr(getattr(models_mod, "llama", None), "_StepContext", None), "_fields", ())
    if "mask" in fields and "positions" not in fields:
        return rows * max_seq, "the whole cache of each row (masked attention over all --max-seq positions)"
    return batch * (position + 1) + (rows - batch), "positions 0..position of each row (decode_attention)"


def step_weight_bytes(model, weight_bytes_per_step: int, rows: int) -> int:
    """Weight bytes a step of ``rows`` rows reads: all of ``weight_bytes_per_step`` for a dense model; for a
    mixture-of-experts one (``model.expert_nbytes()`` > 0) the experts' share scaled by the expected fraction of
    experts that ``rows`` tokens routed uniformly at random to ``k`` of ``E`` experts hit, ``1 - (1 - k/E)^rows``
    (the random router of the benchmark's models spreads tokens about uniformly)."""
    experts = model.expert_nbytes() if hasattr(model, "expert_nbytes") else 0
    if not experts:
        return weight_bytes_per_step
    cfg = model.config
    hit = 1.0 - (1.0 - cfg.num_experts_per_tok / cfg.num_experts) ** rows
    return int(weight_bytes_per_step - experts + hit * experts)


def hbm_limit_ms(nbytes: int, hbm_gbps: Optional[float]) -> Optional[float]:
    """Milliseconds to read ``nbytes`` bytes at ``hbm_gbps`` GB/s (1e9 B/s); None without a bandwidth."""
    return nbytes / (hbm_gbps * 1e9) * 1e3 if hbm_gbps else None


def step_classes(model, prof: dict[str, Any], point: dict[str, Any], kv_bytes_per_position: int,
                 hbm_gbps: Optional[float]) -> dict[str, Any]:
    """``point["classes"]`` of a profiled step (``prof``: `profile_step`'s): ``{"pdl": False, "profile": prof}``, and
    unless the profile failed ``"bytes"`` (`step_class_bytes` at ``point``'s rows and KV positions; None for a MoE
    model, whose byte model that is not) and ``"table"`` (`class_table`: a MoE model's has the counts and times of
    every class, its byte columns None)."""
    classes: dict[str, Any] = {"pdl": False, "profile": prof}
    if "error" in prof:
        return classes
    nbytes = None
    if not getattr(model.config, "is_moe", False):
        quant_kernels = prof["by_class"].get("quant", {}).get("count", 0)
        nbytes = step_class_bytes(model, point["rows"], point["kv_positions_read"], kv_bytes_per_position,
                                  quant_kernels)
    classes.update(bytes=nbytes, table=class_table(prof, nbytes, hbm_gbps))
    return classes


def measure_classes(model, runner, runner_mod: Any, cw: Any, inputs: dict[int, tuple], result: dict,
                    args: argparse.Namespace, hbm_gbps: Optional[float]) -> None:
    """PDL on / off and the kernel classes of the graph step at each batch of ``inputs`` (``{batch: (token
    ids, positions, slots, graph logits of ``runner``)}``), stored in ``result["batches"][str(b)]`` under
    ``"pdl"`` and ``"classes"``.

    Two more `DecodeGraphRunner` of the batches' buckets are captured, with PDL on and with PDL off
    (`cutlass_w8a8.set_pdl`, restored after: PDL is decided when a kernel is captured); their logits must match
    ``runner``'s (else `AccuracyError`), their replays are timed interleaved (``--steps // 2`` rounds of both),
    and one PDL-off replay is profiled and sorted into kernel classes (`_decoder_kernels.class_table`)."""
    buckets = sorted({runner.bucket(b) for b in inputs})
    prev = cw.set_pdl(True)
    try:
        graphs = {"on": runner_mod.DecodeGraphRunner(model, max_batch=buckets[-1], sizes=buckets)}
        cw.set_pdl(False)
        graphs["off"] = runner_mod.DecodeGraphRunner(model, max_batch=buckets[-1], sizes=buckets)
    finally:
        cw.set_pdl(prev)
    torch.cuda.synchronize()
    for b, (tok, pos, slots, ref) in inputs.items():
        point = result["batches"][str(b)]
        steps = {k: (lambda r=r, t=tok, p=pos, s=slots: r.step(t, p, s)) for k, r in graphs.items()}
        equal = {}
        for k, fn in steps.items():
            out = fn().float()
            err = rel_err(out, ref)
            if not err <= GRAPH_EAGER_REL_TOL:
                raise AccuracyError(f"batch {b}: graph captured with PDL {k} vs the default graph: relative error "
                                    f"{err:.3g} (bound {GRAPH_EAGER_REL_TOL:g})")
            equal[k] = bool(torch.equal(out, ref))
        times = time_interleaved(steps, max(1, args.steps // 2), args.warmup)  # half: two graphs per round
        point["pdl"] = {"default_on": bool(prev), "equals_default_graph": equal, "on": times["on"],
                        "off": times["off"], "on_over_off": times["on"]["median_ms"] / times["off"]["median_ms"]}
        prof = profile_step(steps["off"])
        point["classes"] = step_classes(model, prof, point, result["kv_bytes_per_position"], hbm_gbps)
        print(f"    batch {b}: graph PDL off {times['off']['median_ms']:.3f} ms, on {times['on']['median_ms']:.3f} ms; "
              f"{prof.get('kernels', '?')} kernels, busy {prof.get('busy_ms', float('nan')):.3f} ms (PDL off)",
              flush=True)
    graphs.clear()


def measure_model(name: str, args: argparse.Namespace, config, mods: Any, probe_ref: Optional[torch.Tensor],
                  hbm_gbps: Optional[float] = None) -> dict:
    """Build one model (`_decoder_report.model_spec` of ``name``), check it, capture its graphs and time every
    (batch, mode), then `measure_classes` at ``args.class_batches``; frees it on return.

    ``hbm_gbps``: datasheet HBM bandwidth (GB/s) for the HBM-limited step time of each batch (None: omitted)."""
    models, runner_mod, cw = mods
    quant, quant_lm_head = model_spec(name)
    max_batch = max(args.batches)
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    model = models.LlamaDecoder(config, quant, max_batch=max_batch, max_seq_len=args.max_seq, device="cuda",
                                seed=args.seed, quant_lm_head=quant_lm_head)
    torch.cuda.synchronize()
    result: dict[str, Any] = {"build_s": time.perf_counter() - t0, "quant": quant,
                              "lm_head": quant if quant_lm_head else "bf16",
                              "weight_bytes": model.weight_nbytes(),
                              "weight_bytes_per_step": model.weight_nbytes(include_embedding=False),
                              "cache_bytes": model.cache_nbytes(),
                              # one cache position (keys and values) over all layers: the cache holds
                              # (max_batch + 1) slots, the last the scratch one, of max_seq_len positions
                              "kv_bytes_per_position": model.cache_nbytes() // ((model.max_batch + 1)
                                                                                 * model.max_seq_len)}
    with torch.no_grad():
        logits = probe_logits(model)  # fails here, before any capture, when the kernels are missing
        if probe_ref is not None:
            result["logits_vs_bf16"] = {"sqnr_db": sqnr_db(logits, probe_ref), "rel_err": rel_err(logits, probe_ref),
                                        "top1_equal": bool(logits.argmax() == probe_ref.argmax())}
        result["probe_logits"] = logits

        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        reserved0, allocated0 = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        runner = runner_mod.DecodeGraphRunner(model, max_batch=max_batch)
        torch.cuda.synchronize()
        result["capture"] = {
            "sizes": runner.sizes,
            "seconds": runner.capture_seconds,
            "seconds_per_size": {str(b): s for b, s in runner.capture_seconds_per_size.items()},
            "pool_bytes": runner.graph_pool_bytes(),
            "reserved_delta_bytes": torch.cuda.memory_reserved() - reserved0,
            "allocated_delta_bytes": torch.cuda.memory_allocated() - allocated0,
        }

        gen = torch.Generator().manual_seed(args.seed + 1)
        result["batches"] = {}
        class_inputs = {}
        for b in args.batches:
            tok = torch.randint(0, config.vocab_size, (b,), generator=gen)
            pos = torch.full((b,), args.max_seq // 2, dtype=torch.int64)
            slots = torch.arange(b)
            graph_out = runner.step(tok, pos, slots).float().clone()
            eager_out = runner.step(tok, pos, slots, use_graph=False).float()
            err = rel_err(graph_out, eager_out)
            if not err <= GRAPH_EAGER_REL_TOL:
                raise AccuracyError(f"{name} batch {b}: graph vs eager relative error {err:.3g} "
                                    f"(bound {GRAPH_EAGER_REL_TOL:g})")
            point = {"graph_equals_eager": bool(torch.equal(graph_out, eager_out)), "graph_vs_eager_rel": err}
            # Bytes a step must read: the weights (embedding excluded) and the cache its attention reads, for
            # the rows it runs (the bucket's width: padded rows read the scratch slot).
            rows = runner.bucket(b) or b
            kv_tokens, result["kv_read"] = kv_tokens_read(models, b, rows, args.max_seq // 2, args.max_seq)
            point["rows"] = rows
            point["kv_positions_read"] = kv_tokens
            point["weight_bytes_read"] = step_weight_bytes(model, result["weight_bytes_per_step"], rows)
            point["bytes_read"] = point["weight_bytes_read"] + kv_tokens * result["kv_bytes_per_position"]
            point["hbm_limit_ms"] = hbm_limit_ms(point["bytes_read"], hbm_gbps)
            for mode in MODES:
                use_graph = mode == "graph"
                point[mode] = time_steps(lambda: runner.step(tok, pos, slots, use_graph=use_graph),  # noqa: B023
                                         args.steps, args.warmup)
            result["batches"][str(b)] = point
            limit = point["hbm_limit_ms"]
            limit_text = (f", HBM limit {limit:.3f} ms ({point['bytes_read'] / 1e9:.2f} GB at {hbm_gbps:.0f} GB/s; "
                          f"graph {point['graph']['median_ms'] / limit:.2f}x of it)" if limit else "")
            print(f"  {name} batch {b}: eager {point['eager']['median_ms']:.3f} ms, "
                  f"graph {point['graph']['median_ms']:.3f} ms{limit_text}", flush=True)
            if b in args.class_batches and runner.bucket(b) is not None:
                class_inputs[b] = (tok, pos, slots, graph_out)
        if class_inputs:
            measure_classes(model, runner, runner_mod, cw, class_inputs, result, args, hbm_gbps)
    runner = model = class_inputs = None  # free the graphs, the pool and the weights before the next model
    gc.collect()
    torch.cuda.empty_cache()
    return result


def run(args: argparse.Namespace, cw: Any, bu: Any, mods: Any) -> dict[str, Any]:
    models_mod = mods[0]
    config = models_mod.CONFIGS[args.config]
    layers = args.layers
    if layers is None:
        layers = min(8, config.num_layers) if args.quick else config.num_layers
    config = config.replace(num_layers=layers, max_position=max(config.max_position, args.max_seq))
    name = torch.cuda.get_device_name()
    copy_gbps = bu.copy_bandwidth_gbps()
    hbm_gbps = bu.hbm_bandwidth_gbps(name)
    hbm_note = (f"datasheet HBM bandwidth {hbm_gbps:.0f} GB/s" if hbm_gbps else
                f"HBM-limited step time omitted: no datasheet bandwidth known for {name!r} "
                "(cutlass_w8a8.testing.timers.HBM_BANDWIDTH_GBPS)")
    if not hbm_gbps:
        print(hbm_note, flush=True)
    results: dict[str, Any] = {
        **provenance(name, REPO_ROOT),
        "copy_GBps": copy_gbps,
        "hbm_GBps": hbm_gbps,
        "hbm_note": hbm_note,
        "config": {"name": args.config, **{k: getattr(config, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")},
                   **({k: getattr(config, k) for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                       "qk_norm")} if getattr(config, "is_moe", False) else {})},
        "max_seq": args.max_seq,
        "batches": args.batches,
        "class_batches": args.class_batches,
        "pdl_default": bool(cw.pdl_enabled()),
        "timing": {"method": "CUDA events around each step (host launches included), median",
                   "steps": args.steps, "warmup": args.warmup, "inputs": "host CPU tensors via pinned buffers"},
        "models": {},
        "errors": {},
    }
    probe_ref = None
    for model_name in args.models:
        print(f"{model_name}: building {layers} layers", flush=True)
        try:
            res = measure_model(model_name, args, config, (*mods, cw), probe_ref, hbm_gbps)
        except AccuracyError:
            raise
        except (RuntimeError, NotImplementedError) as exc:
            if model_name not in OPTIONAL_MODELS:
                raise
            lines = str(exc).strip().splitlines()
            results["errors"][model_name] = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]
            gc.collect()
            torch.cuda.empty_cache()
            continue
        logits = res.pop("probe_logits")
        if model_name == "bf16":
            probe_ref = logits
        results["models"][model_name] = res
    derive(results, copy_gbps)
    return results


# ----------------------------------------------------------------------------------------------------
# main


def results_prefix(config: str) -> str:
    """The results files' prefix: ``decoder_moe`` for the Qwen3-MoE config, ``decoder`` otherwise."""
    return "decoder_moe" if config == "qwen3-30b-a3b" else "decoder"


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    cw = require_cuda_extension("bench_decoder.py")
    from cutlass_w8a8 import models, runner
    from cutlass_w8a8.testing import timers as bu
    mods = (models, runner)
    t0 = time.perf_counter()
    results = run_checked("bench_decoder.py", run, args, cw, bu, mods)
    results["total_seconds"] = time.perf_counter() - t0
    publish(results, render_markdown(results), args.out, results_prefix(args.config), plot_results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
