"""CUDA graphs whose W8A8 kernels change shape every iteration: node updates vs recapture vs eager.

Part 1, the loop (NVIDIA's "Constructing CUDA Graphs with Dynamic Parameters", CUDA developer blog, 2022,
compares the same three on its workload: 433 ms node updates, 580 ms recapture + cudaGraphExecUpdate, 706 ms
no graph). A W8A8 residual MLP stack (``--layers`` blocks of Llama-3-8B's MLP: hidden 4096, intermediate
14336, int8 per-token / per-channel) runs ``--iters`` iterations, each at a new M drawn from [1, ``--max-m``]
(the same sequence for every method); each iteration copies a fresh input and runs the stack:

- ``update``: one `cutlass_w8a8.graphs.UpdatableGraph` captured at ``--max-m``; ``set_rows(m)`` rewrites the
  quantizer and GEMM kernel nodes in the executable graph (cudaGraphExecKernelNodeSetParams), then replays.
- ``recapture_update``: capture a new graph at m (``keep_graph=True``), ``cudaGraphExecUpdate`` it into one
  executable graph, replay that.
- ``recapture``: capture and instantiate a new graph at m (what torch.cuda.graph does), replay.
- ``eager``: launch the stack's kernels one by one.

The time is wall-clock over all iterations with the GPU work queued asynchronously and one synchronisation at
the end, so host work that the GPU does not hide is counted; medians of ``--repeats`` runs. Per-update host
cost: ``set_rows`` calls timed alone, divided by the nodes each changes.

Part 2, the decoder runner: `cutlass_w8a8.runner.DecodeGraphRunner` with ``mode="exact"`` (one graph at the
largest batch, nodes updated to the real batch) against the bucketed runner (one graph per vLLM bucket), on a
Llama-3-8B-dimension decoder (``--decoder-layers`` layers, int8): step latency at batches between and on bucket
sizes (CUDA events, median of ``--steps``; device inputs), a mixed sequence whose batch changes every step,
and the device memory the graphs take (the change of ``cudaMemGetInfo``'s used bytes across capture, which
counts the graph pool and the driver's executable graphs, and the pool's own bytes).

Writes ``graph_update_<device>.{json,md,png}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time

import torch
from torch import nn

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TARGET_OVER_RECAPTURE = 1.3
TARGET_OVER_EAGER = 1.5
TARGET_UPDATE_US = 10.0
TARGET_MEMORY_RATIO = 5.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4, help="MLP blocks of the loop's stack (default 4)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--max-m", type=int, default=64)
    p.add_argument("--iters", type=int, default=200, help="iterations per timed run (default 200)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--decoder-layers", type=int, default=8, help="decoder layers for part 2 (0: skip)")
    p.add_argument("--max-seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--quick", action="store_true", help="fewer iterations, 2 decoder layers")
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.iters, args.repeats, args.decoder_layers, args.steps = 60, 3, 2, 15
    return args


class MLPBlock(nn.Module):
    """h + down(silu(gate(h)) * up(h)) with a fused gate_up projection."""

    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, h):
        g, u = self.gate_up(h).chunk(2, dim=-1)
        return h + self.down(torch.nn.functional.silu(g) * u)


# ----------------------------------------------------------------------------------------------------
# part 1


def run_loop(args, cw):
    from cutlass_w8a8.graphs import UpdatableGraph

    torch.manual_seed(args.seed)
    model = nn.Sequential(*[MLPBlock(args.hidden, args.intermediate) for _ in range(args.layers)])
    model = cw.quantize_(model.to("cuda", torch.bfloat16).eval())
    rng = random.Random(args.seed)
    ms = [rng.randint(1, args.max_m) for _ in range(args.iters)]
    inputs = torch.randn(args.max_m, args.hidden, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    results = {}

    # update: capture once at max_m
    g = UpdatableGraph(model, [inputs])
    nodes = len(g.nodes)
    set_rows_s = []

    def update_loop():
        for m in ms:
            t = time.perf_counter()
            g.set_rows(m)
            set_rows_s.append(time.perf_counter() - t)
            g.static_inputs[0][:m].copy_(inputs[:m])
            g.replay()

    pool = torch.cuda.graph_pool_handle()
    keep = {}

    def recapture_loop(exec_update: bool):
        base = None
        for m in ms:
            x = inputs[:m]
            graph = torch.cuda.CUDAGraph(keep_graph=exec_update)
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                model(x)
            if exec_update:
                if base is None:
                    graph.instantiate()
                    base = graph
                else:
                    if not cw._ext.graph_exec_update(base.raw_cuda_graph_exec(), graph.raw_cuda_graph()):
                        graph.instantiate()
                        base = graph
                keep["latest"] = graph  # its pool memory backs the updated executable graph
                base.replay()
            else:
                graph.replay()
                keep["latest"] = graph

    def eager_loop():
        for m in ms:
            model(inputs[:m])

    methods = {"update": update_loop, "recapture_update": lambda: recapture_loop(True),
               "recapture": lambda: recapture_loop(False), "eager": eager_loop}
    with torch.no_grad():
        for name, fn in methods.items():  # warm-up
            fn()
        torch.cuda.synchronize()
        set_rows_s.clear()
        times = {name: [] for name in methods}
        for _ in range(args.repeats):
            for name, fn in methods.items():  # interleaved, so all run under the same clocks
                torch.cuda.synchronize()
                t = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t)
    changed = sum(1 for a, b in zip([args.max_m] + ms, ms) if a != b)
    per_call_us = statistics.median(set_rows_s) * 1e6
    total_set_rows = sum(set_rows_s) / args.repeats
    results = {
        "iterations": args.iters, "layers": args.layers, "nodes": nodes, "m_values": ms,
        "ms_per_iter": {k: statistics.median(v) * 1e3 / args.iters for k, v in times.items()},
        "set_rows_median_us": per_call_us,
        "update_us_per_node": total_set_rows / max(changed, 1) / nodes * 1e6,
    }
    r = results["ms_per_iter"]
    results["update_over_recapture_update"] = r["recapture_update"] / r["update"]
    results["update_over_recapture"] = r["recapture"] / r["update"]
    results["update_over_eager"] = r["eager"] / r["update"]
    del g, keep
    return results


# ----------------------------------------------------------------------------------------------------
# part 2


def _used_bytes():
    free, total = torch.cuda.mem_get_info()
    return total - free


def run_decoder(args, cw, quant_lm_head: bool):
    from cutlass_w8a8.models import LLAMA3_8B, LlamaDecoder
    from cutlass_w8a8.runner import DecodeGraphRunner

    cfg = LLAMA3_8B.replace(num_layers=args.decoder_layers)
    max_batch = 64
    model = LlamaDecoder(cfg, "int8", max_batch=max_batch, max_seq_len=args.max_seq, device="cuda", seed=args.seed,
                         quant_lm_head=quant_lm_head)
    batches = [1, 3, 8, 12, 17, 24, 33, 48, 57, 64]
    gen = torch.Generator().manual_seed(args.seed)
    out = {"layers": args.decoder_layers, "batches": batches, "modes": {}, "quant_lm_head": quant_lm_head}
    for mode in ("buckets", "exact"):
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the previous runner's pool goes back to the driver before the baseline
        used0, pool0 = _used_bytes(), torch.cuda.memory_reserved()
        t = time.perf_counter()
        runner = DecodeGraphRunner(model, mode=mode)
        torch.cuda.synchronize()
        capture_s = time.perf_counter() - t
        mem = {"device_bytes": _used_bytes() - used0, "reserved_bytes": torch.cuda.memory_reserved() - pool0,
               "pool_bytes": runner.graph_pool_bytes(), "graphs": len(runner.graphs), "capture_s": capture_s}
        lat = {}
        for b in batches:
            tok = torch.randint(0, cfg.vocab_size, (b,), generator=gen).cuda()
            pos = torch.randint(0, args.max_seq, (b,), generator=gen).cuda()
            slots = torch.randperm(max_batch, generator=gen)[:b].cuda()
            times = []
            for i in range(args.steps + 3):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                runner.step(tok, pos, slots)
                e1.record()
                if i >= 3:
                    times.append((e0, e1))
            torch.cuda.synchronize()
            lat[b] = statistics.median(a.elapsed_time(z) for a, z in times)
        # mixed: the batch changes every step (the exact runner updates its nodes before each one)
        seq = [batches[i % len(batches)] for i in range(3 * len(batches))]
        dev = {b: (torch.randint(0, cfg.vocab_size, (b,), generator=gen).cuda(),
                   torch.randint(0, args.max_seq, (b,), generator=gen).cuda(),
                   torch.randperm(max_batch, generator=gen)[:b].cuda()) for b in batches}
        torch.cuda.synchronize()
        t = time.perf_counter()
        for b in seq:
            runner.step(*dev[b])
        torch.cuda.synchronize()
        mixed_ms = (time.perf_counter() - t) * 1e3 / len(seq)
        out["modes"][mode] = {"latency_ms": lat, "mixed_ms_per_step": mixed_ms, **mem}
        del runner
    del model
    b, e = out["modes"]["buckets"], out["modes"]["exact"]
    out["exact_over_buckets"] = {bb: b["latency_ms"][bb] / e["latency_ms"][bb] for bb in batches}
    out["memory_ratio"] = b["device_bytes"] / max(e["device_bytes"], 1)
    return out


# ----------------------------------------------------------------------------------------------------
# report


def report(res) -> str:
    lines = [f"# CUDA-graph node updates, {res['device']}", "",
             f"torch {res['torch']}, commit {res.get('commit')}.", ""]
    loop = res["loop"]
    r = loop["ms_per_iter"]
    lines += [f"## W8A8 MLP loop: {loop['layers']} Llama-3-8B MLP blocks, {loop['iterations']} iterations, M random "
              f"in [1, {max(loop['m_values'])}], {loop['nodes']} updatable nodes", "",
              "| method | ms / iteration | update is faster by |", "|---|---|---|"]
    for k in ("update", "recapture_update", "recapture", "eager"):
        lines.append(f"| {k} | {r[k]:.4f} | {r[k] / r['update']:.2f}x |")
    lines += ["", f"- set_rows: {loop['set_rows_median_us']:.1f} us per call (median), "
              f"{loop['update_us_per_node']:.2f} us per node updated "
              f"(target <= {TARGET_UPDATE_US:g} us per update)",
              f"- update over recapture + cudaGraphExecUpdate: {loop['update_over_recapture_update']:.2f}x "
              f"(target >= {TARGET_OVER_RECAPTURE}); over recapture + instantiate: "
              f"{loop['update_over_recapture']:.2f}x; over eager: {loop['update_over_eager']:.2f}x "
              f"(target >= {TARGET_OVER_EAGER})", ""]
    for key in ("decoder", "decoder_w8a8_lm_head"):
        if res.get(key):
            lines += _decoder_report(res[key])
    return "\n".join(lines)


def _decoder_report(dec) -> list:
    lines = []
    if dec:
        b, e = dec["modes"]["buckets"], dec["modes"]["exact"]
        head = "W8A8 lm_head" if dec["quant_lm_head"] else "bf16 lm_head"
        lines += [f"## Decoder runner, Llama-3-8B dimensions, {dec['layers']} layers, int8, {head}: exact-M vs "
                  "buckets", "",
                  "| batch | buckets ms | exact ms | exact faster by |", "|---|---|---|---|"]
        for bb in dec["batches"]:
            lines.append(f"| {bb} | {b['latency_ms'][bb]:.3f} | {e['latency_ms'][bb]:.3f} | "
                         f"{dec['exact_over_buckets'][bb]:.2f}x |")
        mib = 2.0 ** 20
        lines += ["", "| | buckets | exact |", "|---|---|---|",
                  f"| graphs | {b['graphs']} | {e['graphs']} |",
                  f"| device memory of the graphs (MiB) | {b['device_bytes'] / mib:.1f} | {e['device_bytes'] / mib:.1f} |",
                  f"| graph pool (MiB) | {(b['pool_bytes'] or 0) / mib:.1f} | {(e['pool_bytes'] or 0) / mib:.1f} |",
                  f"| capture s | {b['capture_s']:.2f} | {e['capture_s']:.2f} |",
                  f"| mixed batches, ms / step | {b['mixed_ms_per_step']:.3f} | {e['mixed_ms_per_step']:.3f} |",
                  "", f"Device memory ratio buckets / exact: {dec['memory_ratio']:.1f}x "
                  f"(target >= {TARGET_MEMORY_RATIO:g}x).", ""]
    return lines


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cutlass_w8a8.testing.report import save_figure

    fig, axes = plt.subplots(1, 2 if res.get("decoder") else 1, figsize=(11, 4), squeeze=False)
    r = res["loop"]["ms_per_iter"]
    ax = axes[0][0]
    ax.bar(list(r), list(r.values()), color=["tab:green", "tab:orange", "tab:red", "tab:gray"])
    ax.set_ylabel("ms per iteration")
    ax.set_title("W8A8 MLP stack, new M every iteration")
    if res.get("decoder"):
        dec = res["decoder"]
        ax = axes[0][1]
        for mode, color in (("buckets", "tab:blue"), ("exact", "tab:green")):
            lat = dec["modes"][mode]["latency_ms"]
            ax.plot(dec["batches"], [lat[b] for b in dec["batches"]], "o-", color=color, label=mode)
        ax.set_xlabel("batch")
        ax.set_ylabel("ms per step")
        ax.set_title(f"decoder step, {dec['layers']} layers (int8)")
        ax.legend()
    save_figure(fig, path, res["device"], dpi=110)


def main(argv=None) -> int:
    args = parse_args(argv)
    from cutlass_w8a8.testing.report import cuda_extension_missing, publish

    missing = cuda_extension_missing("bench_graph_update")
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    import cutlass_w8a8 as cw
    from cutlass_w8a8.testing import timers as bench_utils

    name = torch.cuda.get_device_name()
    commit, _ = bench_utils.git_commit(REPO_ROOT)
    res = {"device": name, "device_slug": bench_utils.device_slug(name), "torch": torch.__version__,
           "commit": os.environ.get("CUTLASS_W8A8_GIT_COMMIT", commit)}
    res["loop"] = run_loop(args, cw)
    gc.collect()
    torch.cuda.empty_cache()
    if args.decoder_layers > 0:
        # a bf16 lm_head (cuBLAS) keeps its captured 64 rows in the exact runner; a W8A8 one is resized too
        res["decoder"] = run_decoder(args, cw, quant_lm_head=False)
        gc.collect()
        res["decoder_w8a8_lm_head"] = run_decoder(args, cw, quant_lm_head=True)
    publish(res, report(res), args.out, "graph_update", plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
