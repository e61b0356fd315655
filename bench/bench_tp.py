"""Tensor-parallel decode benchmark: the CUDA-graph decode step of a Llama-3-70B-sized W8A8 decoder (fewer layers)
at TP=1 on one GPU and at TP=2 on two GPUs over NCCL, per-token latency, speedup and the all-reduce's share.

The script launches its own processes (`cutlass_w8a8.testing.tp.run_workers`, NCCL with ``NCCL_NVLS_ENABLE=0`` and
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``): first one process on cuda:0 (TP=1), then two on cuda:0 and cuda:1 (TP=2),
each building `cutlass_w8a8.models.LlamaDecoder` from the same config and seed (random weights; at TP=2 the exact
shards of the TP=1 weights, `cutlass_w8a8.distributed.TensorParallelLlamaDecoder`). Do not start it under torchrun: it refuses, with
exit status 2, when WORLD_SIZE, RANK, LOCAL_RANK or another launcher variable is set
(`cutlass_w8a8.testing.tp.refuse_under_launcher`; under ``torchrun --nproc-per-node 2`` two copies once ran at once
and timed each other).

Per process and batch B (``--batches``, default 1 and 8): a `DecodeGraphRunner` with one graph per batch (the
all-reduces after ``o_proj`` and ``down_proj`` captured in it); the step takes host inputs (token ids, positions at
``--max-seq // 2``, slots) through pinned buffers as a serving loop would; CUDA events around each step, median
of ``--steps`` after ``--warmup``. At TP=2 each rank times its own steps (the all-reduces keep them in lockstep);
the reported time is the slower rank's median.

All-reduce share, two ways (TP=2):

- ``no-reduce``: a second set of graphs captured with every row-parallel layer's ``reduce_results`` off (its
  output is then only the rank's partial sum: wrong, for timing only), timed interleaved with the real graphs;
  share = 1 - no-reduce / real.
- ``nccl kernels``: the summed duration of the NCCL kernels in one profiled replay (torch.profiler) over the step
  time. It includes the time a kernel waits for the other rank.

Also reported: the bytes of weights a step reads per GPU (all but the embedding) and the speedup that the ratio of
those bytes allows (the step reads its weights once); a speedup above it, or a share outside [0, 100 %], is marked
INVALID and the run's target is then not judged (`cutlass_w8a8.testing.physical`); the agreement of TP=2 with TP=1
(relative Frobenius error of the logits of one step from empty caches: W8A8 TP=2 quantizes the row-parallel inputs
per shard, see `cutlass_w8a8.distributed.linear`); graph replay against the eager step (must agree bit for bit).

Writes ``tp_<layers>l[_vocab_lm_head]_<device>.json`` and ``.md`` (and ``.png`` when matplotlib is installed) to
``--out``.

Bytes, and what they allow: at batch 1 a step reads its weights once, so TP=2 can gain at most the ratio of the
bytes per GPU. With few layers the replicated bf16 ``lm_head`` (2.1 GB at Llama-3's vocabulary) weighs on that
ratio: 8 int8 layers (6.8 GB) + lm_head give 8.95 GB at TP=1 and, with ``--replicated-lm-head``, 5.5 GB per GPU at
TP=2, at most 1.62x; sharded over the vocabulary (the default, as `LlamaDecoder`'s) 4.5 GB, at most 2.0x; with all
80 layers (about 73 GB at TP=1: an H200, or an 80 GB H100 with little to spare) 1.94x replicated.

Examples::

    python bench/bench_tp.py                       # Llama-3-70B dims, 8 layers, int8, batch 1 and 8
    python bench/bench_tp.py --layers 4 --quick
    python bench/bench_tp.py --replicated-lm-head  # lm_head replicated at TP=2 (default: sharded over the vocabulary)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Optional

import torch

from cutlass_w8a8.testing.cli import int_list
from cutlass_w8a8.testing.physical import judge, mark, physical_check, share_check, verdict
from cutlass_w8a8.testing.report import AccuracyError, save_figure
from cutlass_w8a8.testing.timers import cuda_kernel_times
from cutlass_w8a8.testing.tp import refuse_under_launcher

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Llama-3-70B (meta-llama/Meta-Llama-3-70B config.json): 80 layers, hidden 8192, MLP 28672, 64 query and 8
#: key/value heads of 128, vocabulary 128256, rope_theta 500000.
LLAMA3_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                  num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position=8192)
TARGET_SPEEDUP_BATCH1 = 1.6  # issue 19: TP=2 decode step at batch 1 >= 1.6x faster than TP=1
GRAPH_EAGER_REL_TOL = 1e-3  # replay vs eager of the same padded step (same kernels): anything above is broken



# ----------------------------------------------------------------------------------------------------
# command line


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Decode-step latency of a Llama-3-70B-sized W8A8 decoder at "
                                                 "tensor-parallel size 1 and 2 (NCCL, CUDA graphs).")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; 2 with --quick)")
    parser.add_argument("--batches", type=int_list(), default=[1, 8], metavar="LIST",
                        help="comma-separated batch sizes, one graph each (default: 1,8)")
    parser.add_argument("--quant", choices=("int8", "fp8"), default="int8", help="W8A8 dtype (default int8)")
    parser.add_argument("--max-seq", type=int, default=512,
                        help="KV-cache length, a multiple of 16 (default 512); steps run at position max_seq // 2")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 100; 20 with --quick)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps before them (default 10; 3 --quick)")
    parser.add_argument("--tp-lm-head", dest="tp_lm_head", action="store_true", default=True,
                        help="at TP=2 shard lm_head over the vocabulary (logits all-gathered; the default)")
    parser.add_argument("--replicated-lm-head", dest="tp_lm_head", action="store_false",
                        help="at TP=2 replicate lm_head on both ranks instead of sharding it")
    parser.add_argument("--quick", action="store_true", help="2 layers (unless --layers), fewer steps")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs")
    parser.add_argument("--timeout", type=float, default=1500.0,
                        help="seconds each launch (TP=1, then TP=2) may take before its processes are killed")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results"), metavar="DIR",
                        help="output folder for the results files (default: bench/results)")
    args = parser.parse_args(argv)
    args.layers = args.layers if args.layers is not None else (2 if args.quick else 8)
    args.steps = args.steps if args.steps is not None else (20 if args.quick else 100)
    args.warmup = args.warmup if args.warmup is not None else (3 if args.quick else 10)
    if args.layers < 1:
        parser.error("--layers must be >= 1")
    if args.max_seq < 16 or args.max_seq % 16 or args.max_seq > LLAMA3_70B["max_position"]:
        parser.error(f"--max-seq must be a multiple of 16 in [16, {LLAMA3_70B['max_position']}]")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    args.batches = sorted(set(args.batches))
    return args


def result_prefix(args: argparse.Namespace) -> str:
    """File prefix of the results: ``tp_<layers>l`` (``tp_8l``), plus ``_vocab_lm_head`` with ``--tp-lm-head``, so
    runs of different depths or lm_head modes do not overwrite each other."""
    return f"tp_{args.layers}l" + ("_vocab_lm_head" if args.tp_lm_head else "")


def worker_options(args: argparse.Namespace) -> dict:
    """What every benchmark process needs, as plain data (it is pickled to the spawned processes)."""
    return {"config": {**LLAMA3_70B, "num_layers": args.layers}, "batches": args.batches, "quant": args.quant,
            "max_seq": args.max_seq, "steps": args.steps, "warmup": args.warmup, "seed": args.seed,
            "tp_lm_head": args.tp_lm_head}


# ----------------------------------------------------------------------------------------------------
# one process (rank) of a launch


def _time_interleaved(fns: dict, steps: int, warmup: int) -> dict:
    """Median / min / max ms per call of each function, called in turn, from CUDA events around each call."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    events = {n: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
              for n in fns}
    for i in range(steps):
        for n, fn in fns.items():
            events[n][i][0].record()
            fn()
            events[n][i][1].record()
    torch.cuda.synchronize()
    out = {}
    for n, evs in events.items():
        t = [a.elapsed_time(b) for a, b in evs]
        out[n] = {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t)}
    return out


def _nccl_kernel_ms(step) -> Optional[float]:
    """Summed duration (ms) of the NCCL kernels of one ``step()`` under torch.profiler, or None when unavailable."""
    try:
        us = [t for name, t in cuda_kernel_times(step) if "nccl" in name.lower()]
        return sum(us) / 1e3 if us else None
    except Exception:  # noqa: BLE001 (a diagnostic)
        return None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def measure(rank: int, world: int, opts: dict) -> dict:
    """Build the model on cuda:``rank`` (TP=``world``), capture its graphs and time them; returns plain data."""
    import torch.distributed as dist

    from cutlass_w8a8.distributed import TensorParallelLlamaDecoder
    from cutlass_w8a8.models import LlamaConfig, LlamaDecoder
    from cutlass_w8a8.runner import DecodeGraphRunner

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    config = LlamaConfig(**opts["config"])
    batches, max_seq = opts["batches"], opts["max_seq"]
    t0 = time.perf_counter()
    kw = dict(quant=opts["quant"], max_batch=max(batches), max_seq_len=max_seq, device=dev, seed=opts["seed"])
    if world > 1:
        model = TensorParallelLlamaDecoder(config, tp_group=dist.group.WORLD, tp_lm_head=opts["tp_lm_head"], **kw)
    else:
        model = LlamaDecoder(config, **kw)
    build_s = time.perf_counter() - t0
    runner = DecodeGraphRunner(model, sizes=batches)
    rows = [m for m in model.modules() if hasattr(m, "reduce_results")]
    nr_runner = None
    if world > 1:
        for m in rows:
            m.reduce_results = False
        nr_runner = DecodeGraphRunner(model, sizes=batches)  # the graphs keep the setting they were captured with
        for m in rows:
            m.reduce_results = True
    gen = torch.Generator().manual_seed(opts["seed"] + 1)
    out: dict[str, Any] = {"rank": rank, "device": torch.cuda.get_device_name(dev), "build_s": build_s,
                           "capture_s": runner.capture_seconds,
                           "weight_bytes_per_step": model.weight_nbytes(include_embedding=False),
                           "probe_logits": {}, "batches": {}}
    for b in batches:
        ids = torch.randint(0, config.vocab_size, (b,), generator=gen)
        slots = torch.arange(b)
        # accuracy probe from empty caches: graph, then the same padded step eagerly
        model.reset_cache()
        graph = runner.step(ids, torch.zeros(b, dtype=torch.long), slots).clone()
        model.reset_cache()
        eager = runner.step(ids, torch.zeros(b, dtype=torch.long), slots, use_graph=False).clone()
        rel = _rel(graph, eager)
        if not rel <= GRAPH_EAGER_REL_TOL:
            raise AccuracyError(f"batch {b}: graph replay vs eager step differ by {rel:.3g} (relative)")
        out["probe_logits"][b] = graph.cpu()
        pos = torch.full((b,), max_seq // 2, dtype=torch.long)
        fns = {"graph": lambda: runner.step(ids, pos, slots)}
        if nr_runner is not None:
            fns["no_reduce"] = lambda: nr_runner.step(ids, pos, slots)
        res = _time_interleaved(fns, opts["steps"], opts["warmup"])
        res["graph_vs_eager_rel"] = rel
        res["nccl_kernel_ms"] = _nccl_kernel_ms(fns["graph"]) if world > 1 else None
        out["batches"][b] = res
    return out


# ----------------------------------------------------------------------------------------------------
# results


def derive(results: dict) -> dict:
    """Per batch: TP=1 and TP=2 ms (the slower rank), speedup, all-reduce share (no-reduce graphs and NCCL kernel
    time), the bytes-bound speedup; and whether the batch-1 target is met. Stored as ``results["derived"]``.

    Physical bounds (`cutlass_w8a8.testing.physical`): a step reads its weights once, so the speedup is at most the
    ratio of the weight bytes per GPU (``bytes_bound_speedup``), and each share lies in [0, 1]. A figure beyond its
    bound is listed in the batch's ``invalid`` and in ``results["invalid"]``, and then the target is not judged:
    ``target["met"]`` None, ``target["invalid"]`` the reasons (a run with an impossible figure anywhere, such as two
    copies started by torchrun timing each other, has no trustworthy figure)."""
    tp1, tp2 = results["tp1"], results["tp2"]
    bytes1 = tp1[0]["weight_bytes_per_step"]
    bytes2 = max(r["weight_bytes_per_step"] for r in tp2)
    bound = bytes1 / bytes2
    derived = {}
    for b in results["batches"]:
        k = str(b)
        t1 = tp1[0]["batches"][k]["graph"]["median_ms"]
        t2 = max(r["batches"][k]["graph"]["median_ms"] for r in tp2)
        nr = max(r["batches"][k]["no_reduce"]["median_ms"] for r in tp2)
        nccl = [r["batches"][k]["nccl_kernel_ms"] for r in tp2]
        d = {"tp1_ms": t1, "tp2_ms": t2, "speedup": t1 / t2, "tp2_no_reduce_ms": nr,
             "allreduce_share": 1.0 - nr / t2,
             "nccl_kernel_share": (max(nccl) / t2) if all(v is not None for v in nccl) else None}
        checks = {"speedup": physical_check(d["speedup"], bound, f"batch {b} speedup TP=1 / TP=2 (weight-byte "
                                            "bound)"),
                  "allreduce_share": share_check(d["allreduce_share"], f"batch {b} all-reduce share"),
                  "nccl_kernel_share": share_check(d["nccl_kernel_share"], f"batch {b} NCCL kernel share")}
        d["invalid"] = {key: why for key, why in checks.items() if why}
        derived[k] = d
    s1 = derived["1"]["speedup"] if "1" in derived else None
    reasons = [why for d in derived.values() for why in d["invalid"].values()]
    met, invalid = judge(None if s1 is None else s1 >= TARGET_SPEEDUP_BATCH1, *reasons)
    results["derived"] = derived
    results["bytes_bound_speedup"] = bound
    results["invalid"] = reasons
    results["target"] = {"speedup_batch1": TARGET_SPEEDUP_BATCH1, "met": met, "invalid": invalid}
    return results


def render_markdown(results: dict) -> str:
    """The report: setup, the per-batch table (figures beyond their physical bound marked INVALID), the target,
    accuracy."""
    c = results["config"]
    lines = [f"# Tensor-parallel decode step: TP=1 vs TP=2 ({results['device']})", "",
             f"Llama-3-70B dimensions with {c['num_layers']} layers (hidden {c['hidden_size']}, MLP "
             f"{c['intermediate_size']}, {c['num_heads']}/{c['num_kv_heads']} heads of {c['head_dim']}, vocab "
             f"{c['vocab_size']}), {results['quant']} W8A8 layers, lm_head "
             f"{'sharded over the vocabulary' if results['tp_lm_head'] else 'replicated'} at TP=2, KV cache "
             f"{results['max_seq']} positions (steps at position {results['max_seq'] // 2}). CUDA graphs, host inputs, "
             f"median of {results['steps']} steps; TP=2: the slower rank. Commit {results.get('git_commit')}.", "",
             "| batch | TP=1 ms/token | TP=2 ms/token | speedup | TP=2 without all-reduce ms | all-reduce share | "
             "NCCL kernel share |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for b in results["batches"]:
        d = results["derived"][str(b)]
        bad = d.get("invalid", {})
        nk = "n/a" if d["nccl_kernel_share"] is None else mark(f"{100 * d['nccl_kernel_share']:.1f} %",
                                                                bad.get("nccl_kernel_share"))
        speedup = mark(f"{d['speedup']:.2f}x", bad.get("speedup"))
        share = mark(f"{100 * d['allreduce_share']:.1f} %", bad.get("allreduce_share"))
        lines.append(f"| {b} | {d['tp1_ms']:.3f} | {d['tp2_ms']:.3f} | {speedup} | {d['tp2_no_reduce_ms']:.3f} | "
                     f"{share} | {nk} |")
    t = results["target"]
    lines += ["", f"Target (issue 19): TP=2 at batch 1 >= {t['speedup_batch1']}x faster than TP=1: "
              f"**{verdict(t['met'], t.get('invalid'), na='not measured (batch 1 not run)')}**."]
    if results.get("invalid"):
        lines += ["", f"**{len(results['invalid'])} figures beyond their physical bound** (a broken measurement, e.g. "
                  "another process on the GPUs; the run judges nothing): " + "; ".join(results["invalid"]) + "."]
    lines += ["", f"Weight bytes a step reads per GPU (all but the embedding): TP=1 "
              f"{results['tp1'][0]['weight_bytes_per_step'] / 1e9:.2f} GB, TP=2 "
              f"{max(r['weight_bytes_per_step'] for r in results['tp2']) / 1e9:.2f} GB: a bandwidth-bound step can "
              f"gain at most {results['bytes_bound_speedup']:.2f}x.", "",
              "Accuracy: TP=2 vs TP=1 logits of one step from empty caches (relative Frobenius error; the row-parallel "
              "layers quantize their input shards with their own per-token scales): " +
              ", ".join(f"batch {b}: {results['tp_vs_tp1_rel'][str(b)]:.3g}" for b in results["batches"]) +
              ". Graph replay vs eager step: " +
              ", ".join(f"batch {b}: {_graph_vs_eager(results, b):.1g}" for b in results["batches"]) + "."]
    return "\n".join(lines) + "\n"


def _graph_vs_eager(results: dict, b: int) -> float:
    return max(r["batches"][str(b)]["graph_vs_eager_rel"] for r in results["tp1"] + results["tp2"])


def plot_results(results: dict, path: str) -> None:
    """PNG: ms per token at TP=1 and TP=2 per batch (skipped without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bs = results["batches"]
    x = range(len(bs))
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = (("tp1_ms", "TP=1"), ("tp2_ms", "TP=2"), ("tp2_no_reduce_ms", "TP=2, no all-reduce"))
    for i, (key, label) in enumerate(bars):
        ax.bar([v + (i - 1) * 0.27 for v in x], [results["derived"][str(b)][key] for b in bs], 0.27, label=label)
    ax.set_xticks(list(x), [str(b) for b in bs])
    ax.set_xlabel("batch")
    ax.set_ylabel("ms per step (= per token)")
    ax.set_title(f"{results['config']['num_layers']}-layer Llama-3-70B dims, {results['quant']}")
    ax.legend()
    save_figure(fig, path)


def _strip(rank_results: list) -> list:
    """JSON-able copies (batch keys as strings, probe logits removed)."""
    out = []
    for r in rank_results:
        r = dict(r)
        r.pop("probe_logits", None)
        r["batches"] = {str(b): v for b, v in r["batches"].items()}
        out.append(r)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    refuse_under_launcher("bench/bench_tp.py")  # it starts its own ranks: never one copy per torchrun rank
    args = parse_args(argv)
    from cutlass_w8a8.testing.report import provenance, publish, require_cuda_extension
    from cutlass_w8a8.testing.tp import run_workers

    require_cuda_extension("bench_tp.py")
    if torch.cuda.device_count() < 2:
        sys.exit(f"bench_tp.py: needs 2 CUDA devices, found {torch.cuda.device_count()}")
    opts = worker_options(args)
    t0 = time.perf_counter()
    try:
        print(f"TP=1: {args.layers} layers on cuda:0", flush=True)
        tp1 = [r.value for r in run_workers(measure, 1, (opts,), backend="nccl", timeout_s=args.timeout,
                                            group_timeout_s=args.timeout)]
        print("TP=2: cuda:0 and cuda:1", flush=True)
        tp2 = [r.value for r in run_workers(measure, 2, (opts,), backend="nccl", timeout_s=args.timeout,
                                            group_timeout_s=args.timeout)]
    except RuntimeError as exc:
        sys.exit(f"bench_tp.py: a benchmark process failed:\n{exc}")
    name = tp1[0]["device"]
    results = {**provenance(name, REPO_ROOT), "config": opts["config"], "batches": args.batches, "quant": args.quant,
               "max_seq": args.max_seq, "steps": args.steps, "warmup": args.warmup, "tp_lm_head": args.tp_lm_head,
               "tp_vs_tp1_rel": {str(b): _rel(tp2[0]["probe_logits"][b], tp1[0]["probe_logits"][b])
                                 for b in args.batches},
               "tp1": _strip(tp1), "tp2": _strip(tp2), "total_seconds": time.perf_counter() - t0}
    derive(results)
    publish(results, render_markdown(results), args.out, result_prefix(args), plot_results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
