"""Host (CPU) cost of one eager call: W8A8Linear and the ops against nn.Linear in bf16, on host-bound shapes.

For an eager user at small batch the GPU waits for the host: a decode step of a 32-layer model is ~200 op
calls, and each costs its Python, dispatcher and launch time whether or not the kernel is short. This script
measures that cost directly: the wall time of ``--calls`` back-to-back calls of one method (no synchronisation
between them; one at the end), divided by the count. The shapes are chosen so that the GPU finishes each
call before the host has issued the next (M = 1, K = N <= 4096): then the wall time per call is the host
cost. To show that this holds, each method's GPU time per call is measured too (the same call replayed from
a CUDA graph, `bench_utils.bench_gpu_time`); a method whose GPU time exceeds its host time is marked
"GPU-bound" and its host figure is an upper bound of the GPU's, not a host cost.

Methods (each on the same fresh input x of shape (M, K), bf16):

- ``nn.Linear bf16``: the baseline, ``F.linear`` through cuBLAS.
- ``W8A8Linear int8`` / ``W8A8Linear fp8``: the module (per-token dynamic activations): one op call,
  ``torch.ops.cutlass_w8a8.w8a8_linear``.
- ``w8a8_linear op``: that op called directly (no module).
- ``quantize + scaled_mm ops``: the two-op path W8A8Linear used before (``quantize_per_token`` then
  ``scaled_mm``), for comparison.
- ``quantize_per_token op``, ``scaled_mm op``, ``cw.scaled_mm wrapper``: the single ops, and the public
  wrapper over the last (its Python checks).
- ``torch.mm bf16``: the bare GEMM without module overhead.

Methods are interleaved: every round runs each method once (``--calls`` calls), in a rotated order, and
the median over ``--rounds`` rounds is reported. Results: ``host_<device>.json`` / ``.md`` / ``.png``.

Examples::

    python bench/bench_host.py                     # M = 1, K = N in 1024, 2048, 4096
    python bench/bench_host.py --calls 500 --rounds 3 --shapes 4096x4096
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Optional

import torch

from cutlass_w8a8.testing.report import publish, require_cuda_extension, save_figure

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_LINEAR_OVER_BF16 = 1.1  # W8A8Linear host time at M = 1 at most this times nn.Linear bf16's


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1024x1024,2048x2048,4096x4096", help="KxN list (comma-separated)")
    p.add_argument("--m", type=int, default=1, help="rows of x (tokens)")
    p.add_argument("--calls", type=int, default=2000, help="back-to-back calls per timing")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds; the median is reported")
    p.add_argument("--no-fp8", action="store_true", help="leave out the fp8 layer")
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "bench", "results"))
    return p.parse_args(argv)


def host_us_per_call(fn: Callable[[], object], calls: int) -> float:
    """Wall time of `calls` calls issued back to back, per call, in microseconds (synchronised at both ends)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def methods_for(cw, k: int, n: int, m: int, with_fp8: bool) -> dict[str, Callable[[], object]]:
    g = torch.Generator(device="cuda").manual_seed(k * 7 + n)
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.normal_(0, 0.02, generator=g)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    int8 = cw.W8A8Linear.from_float(lin)
    q, s = torch.ops.cutlass_w8a8.quantize_per_token(x, torch.int8)
    w, ws = int8.weight, int8.weight_scale
    ops = torch.ops.cutlass_w8a8
    linear_op = ops.w8a8_linear.default
    qpt, smm = ops.quantize_per_token.default, ops.scaled_mm.default
    wt = w.t()
    out: dict[str, Callable[[], object]] = {
        "nn.Linear bf16": lambda: lin(x),
        "W8A8Linear int8": lambda: int8(x),
        "w8a8_linear op": lambda: linear_op(x, w, ws, None, None, torch.bfloat16),
        "quantize + scaled_mm ops": lambda: _two_ops(qpt, smm, x, wt, ws),
        "quantize_per_token op": lambda: qpt(x, torch.int8),
        "scaled_mm op": lambda: smm(q, wt, s, ws, torch.bfloat16, None),
        "cw.scaled_mm wrapper": lambda: cw.scaled_mm(q, wt, s, ws, torch.bfloat16),
        "torch.mm bf16": lambda: torch.mm(x, lin.weight.t()),
    }
    if with_fp8:
        fp8 = cw.W8A8Linear.from_float(lin, cw.W8A8Config(dtype=torch.float8_e4m3fn))
        out["W8A8Linear fp8"] = lambda: fp8(x)
    return out


def _two_ops(qpt, smm, x, wt, ws):
    q, s = qpt(x, torch.int8)
    return smm(q, wt, s, ws, torch.bfloat16, None)


def gpu_us_per_call(bench_utils, fn: Callable[[], object]) -> float:
    timing = bench_utils.bench_gpu_time(lambda: fn(), [()], replays=10)
    return timing.median_ms * 1e3


def run(args, cw, bench_utils) -> dict:
    name = torch.cuda.get_device_name()
    results: dict = {"device": name, "device_slug": bench_utils.device_slug(name), "m": args.m,
                     "calls": args.calls, "rounds": args.rounds, "torch": torch.__version__,
                     "commit": bench_utils.git_commit(REPO_ROOT)[0], "shapes": []}
    with_fp8 = not args.no_fp8 and cw.supports_fp8()
    for spec in args.shapes.split(","):
        k, n = (int(v) for v in spec.lower().split("x"))
        methods = methods_for(cw, k, n, args.m, with_fp8)
        names = list(methods)
        with torch.no_grad():
            for fn in methods.values():  # warm-up: module load, allocator, heuristics
                host_us_per_call(fn, 50)
            samples: dict[str, list[float]] = {nm: [] for nm in names}
            for r in range(args.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for nm in order:
                    samples[nm].append(host_us_per_call(methods[nm], args.calls))
            gpu = {nm: gpu_us_per_call(bench_utils, methods[nm]) for nm in names}
        host = {nm: statistics.median(v) for nm, v in samples.items()}
        base = host["nn.Linear bf16"]
        rows = {nm: {"host_us": host[nm], "host_us_all": samples[nm], "gpu_us": gpu[nm],
                     "gpu_bound": gpu[nm] >= host[nm], "over_nn_linear_bf16": host[nm] / base} for nm in names}
        results["shapes"].append({"k": k, "n": n, "methods": rows})
        print(f"K = N: {k}x{n}, M = {args.m}")
        for nm in names:
            r = rows[nm]
            print(f"  {nm:28s} host {r['host_us']:7.2f} us  ({r['over_nn_linear_bf16']:.2f}x nn.Linear)  "
                  f"GPU {r['gpu_us']:6.2f} us{'  GPU-bound' if r['gpu_bound'] else ''}")
    ratios = [s["methods"]["W8A8Linear int8"]["over_nn_linear_bf16"] for s in results["shapes"]]
    results["summary"] = {"w8a8linear_int8_over_nn_linear_bf16": ratios,
                          "target": TARGET_LINEAR_OVER_BF16, "met": all(r <= TARGET_LINEAR_OVER_BF16 for r in ratios)}
    return results


def report(results: dict) -> str:
    lines = [f"# Host time per eager call, {results['device']}", "",
             f"M = {results['m']}, {results['calls']} back-to-back calls per timing, median of "
             f"{results['rounds']} interleaved rounds; torch {results['torch']}, commit {results['commit']}. "
             "GPU = the same call's device time from a CUDA-graph replay: where it is below the host time "
             "the wall time per call is the host cost.", ""]
    for s in results["shapes"]:
        lines += [f"## K = {s['k']}, N = {s['n']}", "", "| method | host us / call | x nn.Linear bf16 | GPU us / call |",
                  "|---|---|---|---|"]
        for nm, r in s["methods"].items():
            lines.append(f"| {nm} | {r['host_us']:.2f} | {r['over_nn_linear_bf16']:.2f}x | {r['gpu_us']:.2f}"
                         f"{' (GPU-bound)' if r['gpu_bound'] else ''} |")
        lines.append("")
    sm = results["summary"]
    lines.append(f"Target: W8A8Linear int8 host time <= {sm['target']}x nn.Linear bf16 at every shape: "
                 f"{'met' if sm['met'] else 'not met'} ({', '.join(f'{r:.2f}x' for r in sm['w8a8linear_int8_over_nn_linear_bf16'])}).")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = results["shapes"]
    names = list(shapes[0]["methods"])
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(shapes)
    for i, s in enumerate(shapes):
        ax.bar([j + i * width for j in range(len(names))], [s["methods"][nm]["host_us"] for nm in names], width,
               label=f"K = N = {s['k']}" if s["k"] == s["n"] else f"{s['k']}x{s['n']}")
    ax.set_xticks([j + width * (len(shapes) - 1) / 2 for j in range(len(names))], names, rotation=30, ha="right")
    ax.set_ylabel("host us per call")
    ax.set_title(f"Host time per eager call, M = {results['m']}, {results['device']}")
    ax.legend()
    save_figure(fig, path)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    cw = require_cuda_extension("bench_host.py")
    from cutlass_w8a8.testing import timers as bench_utils

    results = run(args, cw, bench_utils)
    publish(results, report(results), args.out, "host", plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
